//! What `/proc` says of a process: its stat line, real uid, command line;
//! and who runs this command.

pub use gpufence_model::procstat::{ProcStat, PF_KTHREAD};

/// Waits for `child` until `deadline`, looking every `poll`: `Ok(Some(status))`
/// when it exited; `Ok(None)` when it was still running at `deadline`,
/// and has been killed (`SIGKILL`) and reaped. When waiting fails the
/// child is killed and reaped too, and the error returned. Every bounded
/// child gpufence runs (scontrol, `slurmd -G`, the MPS control command)
/// ends this way.
///
/// # Errors
/// `waitpid`'s.
pub fn wait_until(
    child: &mut std::process::Child,
    deadline: std::time::Instant,
    poll: std::time::Duration,
) -> std::io::Result<Option<std::process::ExitStatus>> {
    loop {
        match child.try_wait() {
            Ok(Some(s)) => return Ok(Some(s)),
            Ok(None) if std::time::Instant::now() < deadline => std::thread::sleep(poll),
            other => {
                let _ = child.kill();
                let _ = child.wait();
                return other.map(|_| None);
            }
        }
    }
}

/// `statx(2)` of `p` (following `/proc` magic links to the open file, as
/// `stat` does) with `AT_STATX_DONT_SYNC`: the attributes the kernel
/// holds, no `getattr` round trip to the file's file system. Without it a
/// file on FUSE whose daemon never answers holds the caller in
/// uninterruptible sleep (a FUSE `getattr` request; `fs/fuse/dir.c`
/// `fuse_update_get_attr` takes the cached attributes under
/// `AT_STATX_DONT_SYNC`). NFS honours the flag in `nfs_getattr`, but the
/// walk through a `/proc` magic link may still revalidate the dentry
/// (`nfs_weak_revalidate`): a hung NFS server (an admin's mount, not a
/// user's) can still stall it.
/// `mask`: the `STATX_*` fields asked for (the type, device numbers and
/// inode come always). `None` when `statx` fails.
pub fn stat_cached(p: &std::path::Path, mask: u32) -> Option<libc::statx> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).ok()?;
    // SAFETY: an all-zero statx is a valid value of a plain C struct.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: statx(2) with a NUL-terminated path and a buffer it fills.
    let r = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            c.as_ptr(),
            libc::AT_STATX_DONT_SYNC,
            mask | libc::STATX_TYPE | libc::STATX_INO,
            &mut st,
        )
    };
    (r == 0).then_some(st)
}

/// How much of a process's `mountinfo` [`fs_type_of`] reads: a user can
/// grow it (FUSE mounts through the setuid `fusermount`, a mount namespace
/// of its own).
pub const MOUNTINFO_MAX: u64 = 1 << 20;

/// The file system type (`ext4`, `overlay`, `fuse.sshfs`, ...) of the
/// mount of device `major:minor` in `pid`'s mount namespace, from the
/// first [`MOUNTINFO_MAX`] bytes of `/proc/<pid>/mountinfo`
/// (proc_pid_mountinfo(5): field 3 the device, the field after ` - ` the
/// type). `None` when no line there names the device.
pub fn fs_type_of(pid: i32, major: u32, minor: u32) -> Option<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(format!("/proc/{pid}/mountinfo"))
        .ok()?
        .take(MOUNTINFO_MAX)
        .read_to_string(&mut text)
        .ok()?;
    fs_type_in(&text, major, minor)
}

/// [`fs_type_of`] on mountinfo text.
pub fn fs_type_in(mountinfo: &str, major: u32, minor: u32) -> Option<String> {
    let want = format!("{major}:{minor}");
    mountinfo.lines().find_map(|l| {
        let (head, tail) = l.split_once(" - ")?;
        (head.split(' ').nth(2)? == want).then(|| tail.split(' ').next().map(str::to_string))?
    })
}

/// `(comm, ppid, flags)` from `/proc/<pid>/stat` ([`ProcStat`]).
pub fn read_stat(pid: i32) -> Option<(String, i32, u64)> {
    ProcStat::of(pid).map(|s| (s.comm, s.ppid, s.flags))
}

/// The real uid of `pid` (`Uid:` of `/proc/<pid>/status`).
pub fn read_uid(pid: i32) -> Option<u32> {
    uid_of(pid)
}

/// The `/proc` directory that shows `pid`'s memory, executable and
/// command line: `/proc/<pid>`, or, when its leader (main thread) has
/// exited while other threads live on, `/proc/<tid>` of a live thread.
///
/// A leader that calls `exit(2)` (not `exit_group(2)`) stays a zombie
/// until the last thread of its group exits (`delay_group_leader`,
/// `kernel/exit.c`), and its mm is gone: `/proc/<pid>/maps`,
/// `map_files`, `exe` and `cmdline` read the leader's mm and show
/// nothing, while every live thread shares the process's mm. A thread's
/// directory is reachable by its id although `/proc` does not list it
/// (`proc_pid_lookup`, `fs/proc/base.c`), and there `maps`, `map_files`,
/// `exe` and `cmdline` read that thread's (the process's) mm.
pub fn live_view(pid: i32) -> std::path::PathBuf {
    live_view_at(std::path::Path::new("/proc"), pid)
}

/// [`live_view`] under a `/proc`-shaped directory `proc_root` (tests use
/// fixture trees).
pub fn live_view_at(proc_root: &std::path::Path, pid: i32) -> std::path::PathBuf {
    let base = proc_root.join(pid.to_string());
    if state_at(&base) != Some('Z') {
        return base;
    }
    let Ok(tasks) = std::fs::read_dir(base.join("task")) else {
        return base;
    };
    tasks
        .flatten()
        .filter_map(|t| t.file_name().to_str()?.parse::<i32>().ok())
        .filter(|t| *t != pid)
        .map(|t| proc_root.join(t.to_string()))
        .find(|d| !matches!(state_at(d), Some('Z' | 'X') | None))
        .unwrap_or(base)
}

/// The state letter of the task whose `/proc` directory is `dir`.
fn state_at(dir: &std::path::Path) -> Option<char> {
    ProcStat::read_at(dir).map(|s| s.state)
}

/// Whether `pid` is a live process: gpufence's one answer to "is it still
/// there". `/proc/<pid>` shows it and it is neither dead (`X`) nor a
/// zombie, unless the zombie is a leader whose other threads live on
/// ([`leader_exited`]: they keep the process's descriptors, mappings and
/// cgroup). Any other zombie holds nothing, runs nothing and cleans up
/// after nothing. `false` for a pid ≤ 0. Reads `/proc/<pid>/stat` (and
/// `task/` for a zombie).
pub fn alive(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    match state_of(pid) {
        None | Some('X') => false,
        Some('Z') => leader_exited(pid),
        Some(_) => true,
    }
}

/// The state letter of `pid` (`R`, `S`, `Z`, ...; `/proc/<pid>/stat`).
pub fn state_of(pid: i32) -> Option<char> {
    state_at(std::path::Path::new(&format!("/proc/{pid}")))
}

/// Whether `pid` is a process whose leader has exited while another of
/// its threads lives: a zombie leader whose [`live_view`] is a thread.
pub fn leader_exited(pid: i32) -> bool {
    live_view(pid) != std::path::Path::new(&format!("/proc/{pid}"))
}

/// The command line of `pid`, split at NULs (read through [`live_view`]:
/// a process whose leader exited still has one).
pub fn read_cmdline(pid: i32) -> Vec<String> {
    let b = match std::fs::read(format!("/proc/{pid}/cmdline")) {
        // Empty: a kernel thread, or a leader that exited.
        Ok(b) if b.is_empty() => std::fs::read(live_view(pid).join("cmdline")).unwrap_or(b),
        Ok(b) => b,
        Err(_) => return Vec::new(),
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

/// The one line a gpufence program prints when it is not running as root
/// (effective uid 0), before it reads anything: the Prolog and Epilog run
/// as root under slurmd, and a permission error on `state_dir` or a pin
/// would send the admin the wrong way. `None` as root.
pub fn not_root_line(program: &str, role: &str) -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    (euid != 0).then(|| {
        let why = if std::env::var("SLURM_JOB_UID").ok().and_then(|u| u.parse().ok()) == Some(euid)
        {
            " (the job's user: Slurm 24.11 before 24.11.6 starts the Prolog and \
             Epilog so at random under PrologFlags=RunInJob, its X11 shutdown \
             thread having dropped privileges at that moment; SchedMD ticket \
             22736, fixed in 24.11.6: upgrade Slurm or remove RunInJob)"
        } else {
            ""
        };
        format!(
            "{program}: must run as root ({role}); it runs as uid {euid}{why} here: nothing was done"
        )
    })
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

/// Marks every descriptor from 3 up close-on-exec: for a `pre_exec` hook
/// of a child that runs as a user (who may `ptrace(2)` it), so that no
/// descriptor the parent opened without `O_CLOEXEC` (libnvidia-ml's,
/// say) reaches it. `close_range(3, ~0, CLOSE_RANGE_CLOEXEC)` (Linux
/// 5.11): marked rather than closed, so that the standard library's own
/// close-on-exec pipe, which reports a failed `exec` to the parent, still
/// works; on an older kernel each descriptor below `RLIMIT_NOFILE` is
/// marked with `fcntl(2)`. Async-signal-safe: system calls only.
///
/// # Errors
/// The `getrlimit(2)` error when neither way is open.
pub fn cloexec_above_stdio() -> std::io::Result<()> {
    // SAFETY: close_range(2) takes no memory; flags are the kernel's.
    let r = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3u32,
            u32::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    };
    if r == 0 {
        return Ok(());
    }
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit(2) into a struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let top = i32::try_from(lim.rlim_cur).unwrap_or(i32::MAX);
    for fd in 3..top {
        // SAFETY: fcntl(2) on a number; EBADF for one not open.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    Ok(())
}

#[cfg(test)]
mod fs_type_tests {
    use super::*;

    #[test]
    fn a_devices_file_system_is_read_from_mountinfo() {
        let text = "\
22 1 0:21 / /proc rw,nosuid - proc proc rw
29 22 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
61 29 0:52 / /home/u/mnt rw,nosuid,nodev shared:30 - fuse.sshfs u@h:/ rw,user_id=1000
";
        assert_eq!(fs_type_in(text, 8, 1).as_deref(), Some("ext4"));
        assert_eq!(fs_type_in(text, 0, 52).as_deref(), Some("fuse.sshfs"));
        assert_eq!(fs_type_in(text, 0, 5), None);
        // This process's own root: what statx names, mountinfo knows.
        let st = stat_cached(std::path::Path::new("/proc/self/exe"), 0).unwrap();
        assert!(fs_type_of(
            std::process::id() as i32,
            st.stx_dev_major,
            st.stx_dev_minor
        )
        .is_some());
    }
}

#[cfg(test)]
mod cloexec_tests {
    use super::*;
    use std::os::unix::process::CommandExt;

    /// A descriptor opened without `O_CLOEXEC` before the spawn is not
    /// the child's; stdio is, and a failed exec is still reported.
    #[test]
    fn no_descriptor_but_stdio_reaches_the_child() {
        let t = tempfile::tempdir().unwrap();
        let marker = t.path().join("marker");
        std::fs::write(&marker, "x").unwrap();
        let c = std::ffi::CString::new(marker.to_str().unwrap()).unwrap();
        // SAFETY: open(2) of a path we own, closed below.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY) };
        assert!(fd >= 3);
        let mut cmd = std::process::Command::new("sleep");
        cmd.arg("30");
        // SAFETY: the hook makes system calls only.
        unsafe { cmd.pre_exec(cloexec_above_stdio) };
        let mut child = cmd.spawn().unwrap();
        let links: Vec<std::path::PathBuf> = std::fs::read_dir(format!("/proc/{}/fd", child.id()))
            .unwrap()
            .flatten()
            .filter_map(|e| std::fs::read_link(e.path()).ok())
            .collect();
        let _ = child.kill();
        let _ = child.wait();
        // SAFETY: our own descriptor.
        unsafe { libc::close(fd) };
        assert!(!links.contains(&marker), "inherited: {links:?}");
        let mut bad = std::process::Command::new("/nonexistent/gpufence-no-such-program");
        // SAFETY: as above.
        unsafe { bad.pre_exec(cloexec_above_stdio) };
        assert_eq!(
            bad.spawn().unwrap_err().kind(),
            std::io::ErrorKind::NotFound
        );
    }
}

#[cfg(test)]
mod alive_tests {
    use super::*;

    /// A running child is alive; once it exits and is not reaped (a
    /// zombie whose only thread is gone) it is not; reaped, it is not.
    #[test]
    fn a_zombie_is_not_alive() {
        assert!(alive(std::process::id() as i32));
        assert!(!alive(0) && !alive(-1));
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        assert!(alive(pid));
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while state_of(pid) != Some('Z') && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(state_of(pid), Some('Z'));
        assert!(!alive(pid), "an unreaped zombie");
        child.wait().unwrap();
        assert!(!alive(pid), "reaped");
    }
}
