//! What is kept about a lingering process before it is killed.
//!
//! One JSON file per process in `evidence_dir`, mode 0600, created with
//! `O_EXCL` (never overwritten): `job<id>-pid<pid>-<utc time>.json`.

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::Serialize;
use sha2::{Digest, Sha256};

use gpufence_model::fsutil::{create_dir_all_mode, write_new};
use gpufence_model::record::now_rfc3339;

use crate::scan::HeldFd;
use crate::NodeError;

/// Evidence about one process.
#[derive(Clone, Debug, Serialize)]
pub struct Evidence {
    /// When it was collected (RFC 3339).
    pub collected: String,
    /// The job whose devices it holds.
    pub job_id: u32,
    /// Why it is here.
    pub reason: String,
    /// Process id.
    pub pid: i32,
    /// Parent pid.
    pub ppid: Option<i32>,
    /// Real uid.
    pub uid: Option<u32>,
    /// `comm`.
    pub comm: Option<String>,
    /// Command line.
    pub cmdline: Vec<String>,
    /// `readlink /proc/<pid>/exe`.
    pub exe: Option<String>,
    /// SHA-256 of the executable's content, read through `/proc/<pid>/exe`
    /// (works when the file was deleted).
    pub exe_sha256: Option<String>,
    /// cgroup2 path.
    pub cgroup: Option<String>,
    /// Start time (RFC 3339), from `/proc/<pid>/stat` and the boot time.
    pub start_time: Option<String>,
    /// The descriptors on the job's devices.
    pub fds: Vec<HeldFd>,
}

fn sha256_file(p: &Path) -> Option<String> {
    let mut f = std::fs::File::open(p).ok()?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = f.read(&mut buf).ok()?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Some(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

fn start_time(stat: &procfs::process::Stat) -> Option<String> {
    let btime = procfs::boot_time_secs().ok()?;
    let ticks = procfs::ticks_per_second();
    if ticks == 0 {
        return None;
    }
    let secs = btime as i64 + (stat.starttime / ticks) as i64;
    let nanos = ((stat.starttime % ticks) * 1_000_000_000 / ticks) as u32;
    chrono::DateTime::from_timestamp(secs, nanos)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
}

/// Collects what can still be read about `pid`. Fields that cannot be read
/// (the process is exiting, a kernel thread) are `None`.
pub fn collect(
    pid: i32,
    job_id: u32,
    reason: &str,
    fds: Vec<HeldFd>,
    cgroup: Option<String>,
) -> Evidence {
    let proc = procfs::process::Process::new(pid).ok();
    let stat = proc.as_ref().and_then(|p| p.stat().ok());
    let status = proc.as_ref().and_then(|p| p.status().ok());
    Evidence {
        collected: now_rfc3339(),
        job_id,
        reason: reason.to_string(),
        pid,
        ppid: stat.as_ref().map(|s| s.ppid),
        uid: status.as_ref().map(|s| s.ruid),
        comm: stat.as_ref().map(|s| s.comm.clone()),
        cmdline: proc
            .as_ref()
            .and_then(|p| p.cmdline().ok())
            .unwrap_or_default(),
        exe: proc
            .as_ref()
            .and_then(|p| p.exe().ok())
            .map(|e| e.display().to_string()),
        exe_sha256: sha256_file(&PathBuf::from(format!("/proc/{pid}/exe"))),
        cgroup,
        start_time: stat.as_ref().and_then(start_time),
        fds,
    }
}

/// Writes `ev` as a new root-only file in `dir` and returns its path.
///
/// # Errors
/// [`NodeError::Io`] when the directory or file cannot be created.
pub fn write(dir: &Path, ev: &Evidence) -> Result<PathBuf, NodeError> {
    create_dir_all_mode(dir, 0o700).map_err(|e| NodeError::io("mkdir", dir, e))?;
    let bytes = serde_json::to_vec_pretty(ev).unwrap_or_default();
    let stamp = chrono::Utc::now().format("%Y%m%dT%H%M%S%.6fZ");
    for n in 0..100 {
        let suffix = if n == 0 {
            String::new()
        } else {
            format!("-{n}")
        };
        let p = dir.join(format!(
            "job{}-pid{}-{stamp}{suffix}.json",
            ev.job_id, ev.pid
        ));
        match write_new(&p, &bytes, 0o600) {
            Ok(()) => return Ok(p),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(NodeError::io("create", &p, e)),
        }
    }
    Err(NodeError::io(
        "create",
        dir,
        std::io::Error::other("100 evidence files with the same name"),
    ))
}
