//! The job's GPU report (`--gpufence-report[=PATH]`): what the job was
//! granted, what it was denied, what was killed at its end, its GPU-seconds
//! and, with NVML accounting, its memory and utilisation. Written as the
//! job's user (never as root: the path is the user's choice; from a fenced
//! cgroup of its own, see [`write_as_user`]), to PATH or to
//! `gpufence-<jobid>.txt` in the job's working directory.

use std::ffi::CString;
use std::fmt::Write as _;
use std::io::{Read as _, Seek as _, SeekFrom, Write as _};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use gpufence_model::record::JobRecord;

use crate::host::deadline::Wait;
use crate::host::denials::Denial;
use crate::response::respond::Lingering;
use crate::{join_cgroup, Node};

/// Everything the report says.
#[derive(Clone, Debug, Default)]
pub struct ReportData<'a> {
    /// The job's record (devices, uid, start), when there was one.
    pub record: Option<&'a JobRecord>,
    /// The job.
    pub job_id: u32,
    /// The node.
    pub node_name: String,
    /// Denied opens by the job's user since it started.
    pub denials: Vec<Denial>,
    /// What the epilog found and did.
    pub lingering: &'a [Lingering],
    /// Wall time and GPU-seconds.
    pub wall_seconds: Option<f64>,
    /// Per-GPU accounting lines (already formatted).
    pub accounting: Vec<String>,
    /// Whether exclusive-process mode was set and restored.
    pub exclusive: Vec<String>,
}

/// The report's text.
pub fn render(d: &ReportData<'_>) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "gpufence report for job {} on {}", d.job_id, d.node_name);
    match d.record {
        Some(r) if !r.devices.is_empty() => {
            let _ = writeln!(s, "devices granted:");
            for dev in &r.devices {
                let _ = writeln!(s, "  {dev}");
            }
        }
        _ => {
            let _ = writeln!(s, "devices granted: none");
        }
    }
    if let (Some(w), Some(r)) = (d.wall_seconds, d.record) {
        let n = r.gres_indices.len();
        let _ = writeln!(
            s,
            "GPU-seconds: {:.1} ({w:.1} s x {n} GPU{})",
            w * n as f64,
            if n == 1 { "" } else { "s" }
        );
    }
    for e in &d.exclusive {
        let _ = writeln!(s, "{e}");
    }
    for a in &d.accounting {
        let _ = writeln!(s, "{a}");
    }
    if d.denials.is_empty() {
        let _ = writeln!(s, "denied opens during the job: none");
    } else {
        let _ = writeln!(s, "denied opens during the job (by your uid):");
        for x in &d.denials {
            let _ = writeln!(
                s,
                "  {} x{} by {} (pid {}), last {}",
                x.device, x.count, x.last_comm, x.last_pid, x.last_time
            );
        }
    }
    if d.lingering.is_empty() {
        let _ = writeln!(s, "processes left holding the job's GPUs at its end: none");
    } else {
        let _ = writeln!(s, "processes left holding the job's GPUs at its end:");
        for l in d.lingering {
            let _ = writeln!(
                s,
                "  pid {} ({}) held {} -> {}",
                l.pid,
                l.comm.clone().unwrap_or_default(),
                l.devices
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(","),
                l.ended_by
                    .map(|e| format!("ended by {e}"))
                    .unwrap_or_else(|| "still there: the node was drained".into())
            );
        }
    }
    s
}

/// How long the report writer may take before it is killed: it runs as
/// the user, who can stop it (SIGSTOP, ptrace, a FIFO for a file), and the
/// Epilog must not wait on the user.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// The shell the writer runs: a new temporary file beside `$1` (`mktemp`,
/// 0600), the report from stdin into it, then a rename onto `$1` (`mv -fT`:
/// never into a directory of that name), so a reader sees no report or a
/// whole one.
const WRITER: &str = "umask 077; t=$(mktemp -- \"$1.XXXXXX\") || exit 1; \
     if cat > \"$t\" && mv -fT -- \"$t\" \"$1\"; then exit 0; fi; rm -f -- \"$t\"; exit 1";

/// Why the report was not written ([`write_as_user`]); the Epilog audits
/// the message (`report_failed`) and notes it for the job.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// The writer's cgroup `<cgroup_root>/gpufence-report/job_<id>` could
    /// not be made.
    #[error("cannot make the report writer's cgroup: {0}")]
    MakeCgroup(#[source] gpufence_cgroup::Error),
    /// The writer could not be set to join its cgroup.
    #[error("report writer's cgroup: {0}")]
    JoinCgroup(#[source] gpufence_cgroup::Error),
    /// The job's working directory holds a NUL byte (it cannot be entered).
    #[error("working directory {} holds a NUL byte", .0.display())]
    WorkDirNul(PathBuf),
    /// The anonymous files carrying the report and the writer's stderr.
    #[error("report buffer: {0}")]
    Buffer(#[source] std::io::Error),
    /// The writer did not finish in [`WRITE_TIMEOUT`]: it was killed.
    #[error("the report writer (uid {uid}) did not finish in {secs} s: killed")]
    Timeout {
        /// The job's user.
        uid: u32,
        /// [`WRITE_TIMEOUT`] in seconds.
        secs: u64,
    },
    /// The writer could not start (the user cannot enter `work_dir`).
    #[error("cannot start the report writer as uid {uid} in {}: {source}", work_dir.display())]
    Start {
        /// The job's user.
        uid: u32,
        /// The job's working directory.
        work_dir: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The writer failed: the user cannot write the path.
    #[error("uid {uid} cannot write {}: {stderr}", path.display())]
    Write {
        /// The job's user.
        uid: u32,
        /// The report path, as the user gave it (expanded).
        path: PathBuf,
        /// The writer's stderr, trimmed.
        stderr: String,
    },
}

/// Writes `text` to `path` (relative to `work_dir`) as `uid:gid`, with the
/// user's own permissions, and returns the path written.
///
/// The writer is a child that, between fork and exec: joins its own cgroup
/// `<cgroup_root>/gpufence-report/job_<id>` (fenced, never exempt, never
/// granted: the user can ptrace a process of theirs, and the Epilog's own
/// cgroup, slurmd's, is exempt), drops root (groups, gid, uid), and only
/// then enters `work_dir` (a directory the user cannot reach stays out of
/// reach). It gets [`WRITE_TIMEOUT`]; then, and in any case, everything in
/// its cgroup is killed and the cgroup removed.
///
/// # Errors
/// [`ReportError`] when the cgroup cannot be made, the writer cannot start
/// (the user cannot enter `work_dir`), the user cannot write there, or the
/// writer timed out.
pub fn write_as_user(
    node: &Node,
    job_id: u32,
    text: &str,
    path: &Path,
    work_dir: &Path,
    uid: u32,
    gid: u32,
) -> Result<PathBuf, ReportError> {
    let cg = join_cgroup(
        &join_cgroup(&node.cfg.cgroup_root, REPORT_CGROUP),
        &format!("job_{job_id}"),
    );
    // A writer of an earlier, killed epilog of this job: gone first.
    let _ = node.cg.kill(&cg);
    node.cg.create(&cg).map_err(ReportError::MakeCgroup)?;
    let r = run_writer(node, &cg, text, path, work_dir, uid, gid);
    // Whatever the writer left (a process it forked) goes with its cgroup.
    let _ = node
        .cg
        .kill_and_remove(&cg, node.bound(Wait::ReportKill, Duration::from_secs(2)));
    r.map(|()| {
        if path.is_absolute() {
            path.to_path_buf()
        } else {
            work_dir.join(path)
        }
    })
}

/// The subtree of `cgroup_root` the report writers run in (never exempt:
/// the config refuses it).
pub use gpufence_model::config::REPORT_CGROUP;

fn run_writer(
    node: &Node,
    cg: &str,
    text: &str,
    path: &Path,
    work_dir: &Path,
    uid: u32,
    gid: u32,
) -> Result<(), ReportError> {
    let wd = CString::new(work_dir.as_os_str().as_bytes())
        .map_err(|_| ReportError::WorkDirNul(work_dir.to_path_buf()))?;
    let mut cmd = Command::new("/bin/sh");
    cmd.arg("-c")
        .arg(WRITER)
        .arg("gpufence-report")
        .arg(path)
        .env_clear()
        .stdout(Stdio::null());
    // First, as root: into the writer's cgroup.
    node.cg
        .join_at_exec(cg, &mut cmd)
        .map_err(ReportError::JoinCgroup)?;
    // SAFETY: only async-signal-safe calls between fork and exec (system
    // calls, no allocation).
    unsafe {
        cmd.pre_exec(move || {
            if libc::setgroups(0, std::ptr::null()) != 0
                || libc::setgid(gid) != 0
                || libc::setuid(uid) != 0
                || libc::chdir(wd.as_ptr()) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            // No descriptor of ours (libnvidia-ml's, opened without
            // O_CLOEXEC) reaches a process the user may ptrace.
            crate::host::procs::cloexec_above_stdio()
        });
    }
    // The report comes from a memfd and stderr goes to one: no pipe whose
    // other end the user could hold (pidfd_getfd on a traced writer) to
    // keep us reading or writing.
    let input = memfd("gpufence-report-in")
        .and_then(|mut f| {
            f.write_all(text.as_bytes())?;
            f.seek(SeekFrom::Start(0))?;
            Ok(f)
        })
        .map_err(ReportError::Buffer)?;
    let mut errors = memfd("gpufence-report-err").map_err(ReportError::Buffer)?;
    let errors_for_child = errors.try_clone().map_err(ReportError::Buffer)?;
    cmd.stdin(Stdio::from(input))
        .stderr(Stdio::from(errors_for_child));
    // The user can stop or trace the writer from the moment it has their
    // uid, even before it execs (`spawn` then waits for the exec) or after
    // it exits (a tracer that never reaps it keeps `wait` waiting). So the
    // writer is started and waited for on a thread of its own; we wait for
    // that thread's answer until the deadline, kill the writer's cgroup,
    // give it a moment, and otherwise leave the thread behind (the Epilog
    // exits soon after; nothing it holds matters then).
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let r = cmd.spawn().and_then(|mut child| child.wait());
        let _ = tx.send(r);
    });
    let answer = match rx.recv_timeout(node.bound(Wait::Report, WRITE_TIMEOUT)) {
        Ok(r) => Some(r),
        Err(_) => {
            let _ = node.cg.kill(cg);
            let _ = rx.recv_timeout(node.bound(Wait::ReportKill, Duration::from_secs(1)));
            None
        }
    };
    let mut err = String::new();
    if errors.seek(SeekFrom::Start(0)).is_ok() {
        let _ = (&mut errors).take(4096).read_to_string(&mut err);
    }
    match answer {
        None => Err(ReportError::Timeout {
            uid,
            secs: WRITE_TIMEOUT.as_secs(),
        }),
        Some(Err(source)) => Err(ReportError::Start {
            uid,
            work_dir: work_dir.to_path_buf(),
            source,
        }),
        Some(Ok(s)) if s.success() => Ok(()),
        Some(Ok(_)) => Err(ReportError::Write {
            uid,
            path: path.to_path_buf(),
            stderr: err.trim().to_string(),
        }),
    }
}

/// An anonymous file (`memfd_create`, close-on-exec): the writer gets it
/// as stdin or stderr by `dup2`, and nobody can hold a pipe end of it.
fn memfd(name: &str) -> std::io::Result<std::fs::File> {
    use std::os::fd::FromRawFd;
    let name = CString::new(name).map_err(std::io::Error::other)?;
    // SAFETY: memfd_create with a NUL-terminated name; the fd is ours.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a new descriptor nobody else owns.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}
