//! What `/proc` says of a process: its stat line, real uid, command line;
//! and who runs this command.

/// `PF_KTHREAD` (`include/linux/sched.h`).
pub const PF_KTHREAD: u64 = 0x0020_0000;

/// `(comm, ppid, flags)` from `/proc/<pid>/stat`.
pub fn read_stat(pid: i32) -> Option<(String, i32, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let open = s.find('(')?;
    let close = s.rfind(')')?;
    let comm = s.get(open + 1..close)?.to_string();
    let rest: Vec<&str> = s.get(close + 1..)?.split_whitespace().collect();
    // state ppid pgrp session tty_nr tpgid flags
    let ppid = rest.get(1)?.parse().ok()?;
    let flags = rest.get(6)?.parse().ok()?;
    Some((comm, ppid, flags))
}

/// The real uid of `pid` (`Uid:` of `/proc/<pid>/status`).
pub fn read_uid(pid: i32) -> Option<u32> {
    uid_of(pid)
}

/// The command line of `pid`, split at NULs.
pub fn read_cmdline(pid: i32) -> Vec<String> {
    let Ok(b) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return Vec::new();
    };
    let mut v: Vec<String> = b
        .split(|c| *c == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    if v.last().is_some_and(String::is_empty) {
        v.pop();
    }
    v
}

/// The Slurm node name: `$SLURMD_NODENAME`, else the short host name.
pub fn node_name() -> String {
    if let Ok(n) = std::env::var("SLURMD_NODENAME") {
        if !n.is_empty() {
            return n;
        }
    }
    let mut buf = [0u8; 256];
    // SAFETY: gethostname into a buffer we own, with its length.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if r != 0 {
        return "localhost".into();
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    let full = String::from_utf8_lossy(&buf[..end]).into_owned();
    full.split('.').next().unwrap_or(&full).to_string()
}

/// The real uid of `pid` (`Uid:` in `/proc/<pid>/status`, first field):
/// the uid the fence program judges exemptions by
/// (`bpf_get_current_uid_gid`). `None` when the process is gone.
pub fn uid_of(pid: i32) -> Option<u32> {
    procfs::process::Process::new(pid)
        .ok()?
        .status()
        .ok()
        .map(|s| s.ruid)
}

/// Who is running this: `SUDO_USER` (when root via sudo), else the login
/// name, with the real uid.
pub fn who() -> String {
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let name = std::env::var("SUDO_USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .or_else(|_| std::env::var("USER"))
        .unwrap_or_else(|_| "unknown".into());
    format!("{name} (uid {uid})")
}
