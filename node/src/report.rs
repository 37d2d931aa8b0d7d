//! The job's GPU report (`--gpufence-report[=PATH]`): what the job was
//! granted, what it was denied, what was killed at its end, its GPU-seconds
//! and, with NVML accounting, its memory and utilisation. Written as the
//! job's user (never as root: the path is the user's choice), to PATH or to
//! `gpufence-<jobid>.txt` in the job's working directory.

use std::fmt::Write as _;
use std::io::Write as _;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use gpufence_model::record::JobRecord;

use crate::denials::Denial;
use crate::respond::Lingering;

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

/// Writes `text` to `path` (relative to `work_dir`) as `uid:gid`, with the
/// user's own permissions: a child process drops root (groups, gid, uid)
/// before it opens anything. The report is written to a new temporary file
/// beside `path` (`mktemp`, 0600) and renamed onto it (`mv -fT`: never into
/// a directory of that name), so a reader sees no report or a whole one.
/// Returns the path written.
///
/// # Errors
/// A message when the child cannot run or the user cannot write there.
pub fn write_as_user(
    text: &str,
    path: &Path,
    work_dir: &Path,
    uid: u32,
    gid: u32,
) -> Result<PathBuf, String> {
    let mut cmd = Command::new("/bin/sh");
    cmd.arg("-c")
        .arg(
            "umask 077; t=$(mktemp -- \"$1.XXXXXX\") || exit 1; \
             if cat > \"$t\" && mv -fT -- \"$t\" \"$1\"; then exit 0; fi; rm -f -- \"$t\"; exit 1",
        )
        .arg("gpufence-report")
        .arg(path)
        .current_dir(work_dir)
        .env_clear()
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setgroups(0, std::ptr::null()) != 0
                || libc::setgid(gid) != 0
                || libc::setuid(uid) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start the report writer: {e}"))?;
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(text.as_bytes());
    }
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "uid {uid} cannot write {}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(if path.is_absolute() {
        path.to_path_buf()
    } else {
        work_dir.join(path)
    })
}
