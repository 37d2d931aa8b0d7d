//! The one response engine: what gpufence does to processes it must end,
//! whoever asks (the Prolog's clean start and the Epilog, through
//! [`crate::response::respond`]; an admin's `gpufence respond PID`,
//! through [`crate::response::incident`]), in the order incident
//! responders use:
//!
//! 1. pin: each process is named by a pidfd (`pidfd_open(2)`, [`PidFd`])
//!    from when it was found, so no step can hit a recycled pid;
//! 2. stop ([`Engine::stop`]): `cgroup.freeze` of its cgroup when the
//!    cgroup holds nothing but processes being stopped, `SIGSTOP`
//!    otherwise: it cannot act (fork, hand on a descriptor, delete files)
//!    while evidence is taken; a note in `state_dir/responding` says so
//!    until it is ended, so that an interrupted response is finished by
//!    the next one ([`finish_interrupted`]);
//! 3. evidence ([`crate::response::evidence`]), by the caller;
//! 4. end ([`Engine::end`]): `SIGTERM` (and `SIGCONT` to a process
//!    stopped by signal), thaw, `term_grace_ms`, then `SIGKILL`; or
//!    `SIGKILL` at once; wait `kill_wait_ms`; check each is gone.

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use gpufence_model::audit::AuditEvent;

use crate::host::deadline::Wait;
use crate::Node;

/// A pidfd (`pidfd_open(2)`), shared: it names one process for as long as
/// it is open, whatever happens to the pid. Equal to itself only.
#[derive(Clone, Debug)]
pub struct PidFd(std::sync::Arc<OwnedFd>);

impl PidFd {
    /// A pidfd for `pid`; `None` when the process is gone.
    pub fn open(pid: i32) -> Option<PidFd> {
        pidfd_open(pid).map(|fd| PidFd(std::sync::Arc::new(fd)))
    }

    /// The descriptor.
    pub fn fd(&self) -> &OwnedFd {
        &self.0
    }
}

impl std::ops::Deref for PidFd {
    type Target = OwnedFd;
    fn deref(&self) -> &OwnedFd {
        &self.0
    }
}

impl PartialEq for PidFd {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for PidFd {}

/// `pidfd_open(2)`: a descriptor that names `pid` until it is closed, so a
/// recycled pid is never signalled. `None` when the process is gone.
pub(crate) fn pidfd_open(pid: i32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open(2) returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    // SAFETY: a non-negative result is a new descriptor nothing else owns.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// `pidfd_send_signal(2)`; whether the signal was sent.
pub(crate) fn signal(pidfd: &OwnedFd, sig: i32) -> bool {
    // SAFETY: pidfd_send_signal(2) on a pidfd we own.
    unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            sig,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        ) == 0
    }
}

/// Whether the pidfd's process has exited (zombie or reaped).
pub(crate) fn exited(pidfd: &OwnedFd) -> bool {
    let mut p = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // A pidfd is readable once its process has exited (zombie or reaped).
    // SAFETY: poll of one valid pollfd, no wait.
    unsafe { libc::poll(&mut p, 1, 0) > 0 }
}

/// How long a response waits for a cgroup to report frozen
/// (`cgroup.events`: `frozen 1`); past it the signals that follow act on
/// the cgroup's processes either way.
pub const FREEZE_WAIT: Duration = Duration::from_millis(1000);

/// Waits until every pidfd in `fds` has exited or `wait` passes, in
/// `poll(2)` on the pidfds (readable once the whole thread group has
/// exited: `pidfd_poll`, `kernel/fork.c`, `fs/pidfs.c` from 6.9), so a
/// process is seen gone the moment it is.
pub(crate) fn wait_all(fds: &[&OwnedFd], wait: Duration) {
    let deadline = Instant::now() + wait;
    loop {
        let mut open: Vec<libc::pollfd> = fds
            .iter()
            .filter(|f| !exited(f))
            .map(|f| libc::pollfd {
                fd: f.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        let left = deadline.saturating_duration_since(Instant::now());
        if open.is_empty() || left.is_zero() {
            return;
        }
        // At most a second at a time: the loop looks at the deadline.
        let ms = left.as_millis().clamp(1, 1000) as libc::c_int;
        // SAFETY: poll(2) on a vector of pollfds we own, of its length.
        unsafe { libc::poll(open.as_mut_ptr(), open.len() as libc::nfds_t, ms) };
    }
}

/// How many times `kill_wait_ms` more [`Engine::end`] waits for a
/// process that is exiting when `kill_wait_ms` is over (its leader a
/// zombie or in `do_exit`): closing millions of descriptors in thousands
/// of private tables takes the kernel seconds, and a process on its way
/// out is not a survivor. Past that it is one (fail closed: a process
/// stuck in its exit, in a driver's uninterruptible wait, may keep the
/// GPU).
pub const EXITING_WAITS: u32 = 4;

/// `PF_EXITING` in `/proc/<pid>/stat`'s flags: the task is in `do_exit`
/// (`include/linux/sched.h`).
const PF_EXITING: u64 = 0x0000_0004;

/// Whether `pid` is on its way out: its leader a zombie (`Z`, `X`) or in
/// `do_exit` (`PF_EXITING`), from `/proc/<pid>/stat` (`fs/proc/array.c`).
/// One read, whatever the number of its threads.
pub fn exiting(pid: i32) -> bool {
    gpufence_model::procstat::ProcStat::of(pid)
        .is_some_and(|s| matches!(s.state, 'Z' | 'X') || s.flags & PF_EXITING != 0)
}

/// Freezes (`on`) or thaws `cgroup` through `cgroup.freeze`; when
/// freezing, waits up to `wait` for `cgroup.events` to say `frozen 1`.
/// Returns whether the write worked (a tree still freezing after `wait` is
/// treated as frozen: the signals that follow act on it either way).
pub(crate) fn set_frozen(node: &Node, cgroup: &str, on: bool, wait: Duration) -> bool {
    let p = node.cg.path(cgroup);
    if std::fs::write(p.join("cgroup.freeze"), if on { "1" } else { "0" }).is_err() {
        return false;
    }
    if !on {
        return true;
    }
    let deadline = Instant::now() + node.bound(Wait::Freeze, wait);
    while Instant::now() < deadline {
        if std::fs::read_to_string(p.join("cgroup.events"))
            .is_ok_and(|e| e.lines().any(|l| l == "frozen 1"))
        {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

/// What a response notes about a process before it stops it, in
/// `<state_dir>/responding/<pid>-<start>.json`, until it has ended it.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Stopping {
    pid: i32,
    /// Its start time in clock ticks since boot (`/proc/<pid>/stat` field
    /// 22): with the pid, which process it was.
    start: u64,
    job_id: u32,
    /// Its cgroup.
    cgroup: Option<String>,
    /// Whether the response froze that cgroup whole (then only it thaws it).
    froze_cgroup: bool,
    /// The responding process (an Epilog, a Prolog) and its start time: a
    /// note of a response still running is not another's to act on.
    by_pid: i32,
    by_start: u64,
}

fn responding_dir(node: &Node) -> PathBuf {
    node.state.responding_dir()
}

/// `pid`'s start time in clock ticks since boot.
fn start_ticks(pid: i32) -> Option<u64> {
    gpufence_model::procstat::ProcStat::of(pid).map(|s| s.starttime)
}

/// The note of a stopped holder (`note_stopped`) could not be written.
#[derive(Debug, thiserror::Error)]
#[error("{}: {source}", path.display())]
pub struct NoteError {
    /// The note file (or where it would have gone).
    path: PathBuf,
    /// Why.
    source: std::io::Error,
}

pub(crate) fn note_stopped(
    node: &Node,
    job_id: u32,
    pid: i32,
    cgroup: Option<&str>,
    froze_cgroup: bool,
) -> Result<Option<PathBuf>, NoteError> {
    let dir = responding_dir(node);
    // Gone already: nothing to note (the kill finds it exited).
    let Some(start) = start_ticks(pid) else {
        return Ok(None);
    };
    let me = std::process::id() as i32;
    let note = Stopping {
        pid,
        start,
        job_id,
        cgroup: cgroup.map(str::to_string),
        froze_cgroup,
        by_pid: me,
        by_start: start_ticks(me).unwrap_or(0),
    };
    let p = dir.join(format!("{pid}-{start}.json"));
    gpufence_model::fsutil::create_dir_all_mode(&dir, 0o700)
        .and_then(|()| {
            gpufence_model::fsutil::write_atomic(
                &p,
                &serde_json::to_vec(&note).unwrap_or_default(),
                0o600,
            )
        })
        .map_err(|source| NoteError {
            path: p.clone(),
            source,
        })?;
    Ok(Some(p))
}

/// Ends what an interrupted response (an Epilog or Prolog killed while it
/// held holders stopped) left: notes whose responder is still running
/// (same pid and start time) are left to it; for the others, each noted
/// process that is still the same process (pid and start time) is killed
/// (`SIGKILL` through a pidfd), and a cgroup the response froze whole is
/// thawed. Each is audited (`interrupted_response`) and its note removed.
/// Called at the start of every Prolog, Epilog and sweep; returns one
/// note per process for their outcome.
pub fn finish_interrupted(node: &Node) -> Vec<String> {
    let Ok(rd) = std::fs::read_dir(responding_dir(node)) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in rd.flatten() {
        let p = e.path();
        let Some(note) = std::fs::read(&p)
            .ok()
            .and_then(|b| serde_json::from_slice::<Stopping>(&b).ok())
        else {
            let _ = std::fs::remove_file(&p);
            continue;
        };
        if start_ticks(note.by_pid) == Some(note.by_start) {
            continue; // its response is still running
        }
        let same = || start_ticks(note.pid) == Some(note.start);
        let fd = same()
            .then(|| PidFd::open(note.pid))
            .flatten()
            .filter(|_| same());
        let killed = fd.as_ref().is_some_and(|fd| signal(fd.fd(), libc::SIGKILL));
        if let Some(cg) = note.cgroup.as_ref().filter(|_| note.froze_cgroup) {
            let freeze = node.cg.path(cg).join("cgroup.freeze");
            if std::fs::read_to_string(&freeze).is_ok_and(|v| v.trim() == "1") {
                set_frozen(node, cg, false, FREEZE_WAIT);
            }
        }
        if let Some(fd) = &fd {
            wait_all(
                &[fd.fd()],
                node.bound(Wait::KillWait, Duration::from_millis(node.cfg.kill_wait_ms)),
            );
        }
        let what = format!(
            "pid {} of job {} was left stopped by an interrupted response: {}",
            note.pid,
            note.job_id,
            if killed { "killed" } else { "already gone" }
        );
        let _ = node.audit(
            AuditEvent::new(gpufence_model::audit::events::INTERRUPTED_RESPONSE)
                .job(note.job_id)
                .pid(note.pid)
                .field("killed", killed)
                .field(
                    "cgroup",
                    note.cgroup
                        .as_deref()
                        .map(crate::host::cgpath::abs)
                        .unwrap_or_default(),
                ),
        );
        let _ = std::fs::remove_file(&p);
        out.push(what);
    }
    out
}

/// How [`Engine::stop`] stopped a process. Written as in the audit lines
/// and evidence (`cgroup-freeze`, `SIGSTOP`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Stopped {
    /// Its cgroup was frozen whole (`cgroup.freeze`).
    #[serde(rename = "cgroup-freeze")]
    CgroupFreeze,
    /// `SIGSTOP`.
    #[serde(rename = "SIGSTOP")]
    Sigstop,
}

impl Stopped {
    /// As written in audit lines and evidence.
    pub fn as_str(self) -> &'static str {
        match self {
            Stopped::CgroupFreeze => "cgroup-freeze",
            Stopped::Sigstop => "SIGSTOP",
        }
    }
}

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What ended a process ([`Engine::end`]). Written as in the audit lines
/// (`ended_by`) and the user's report (`SIGTERM`, `SIGKILL`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum EndedBy {
    /// It exited within the grace after `SIGTERM`.
    #[serde(rename = "SIGTERM")]
    Sigterm,
    /// `SIGKILL`.
    #[serde(rename = "SIGKILL")]
    Sigkill,
}

impl EndedBy {
    /// As written in audit lines and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            EndedBy::Sigterm => "SIGTERM",
            EndedBy::Sigkill => "SIGKILL",
        }
    }
}

impl std::fmt::Display for EndedBy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Stops processes and ends them, the same way for every caller. One per
/// response: it remembers how each process was stopped and which cgroups
/// it froze whole, so that ending thaws exactly those.
#[derive(Debug)]
pub struct Engine<'a> {
    node: &'a Node,
    frozen: BTreeSet<String>,
    how: BTreeMap<i32, Stopped>,
}

impl<'a> Engine<'a> {
    /// An engine for `node` that has stopped nothing yet.
    pub fn new(node: &'a Node) -> Self {
        Engine {
            node,
            frozen: BTreeSet::new(),
            how: BTreeMap::new(),
        }
    }

    /// Stops `pid` (pinned as `fd`, in `cgroup`) unless it is stopped
    /// already: its cgroup frozen whole when every process in it is one of
    /// `members` (a cgroup of other processes is never frozen), else
    /// `SIGSTOP`. Returns how.
    pub fn stop(
        &mut self,
        pid: i32,
        fd: &OwnedFd,
        cgroup: Option<&str>,
        members: &BTreeSet<i32>,
    ) -> Stopped {
        if let Some(h) = self.how.get(&pid) {
            return *h;
        }
        let frozen = cgroup
            .filter(|c| !c.is_empty())
            .is_some_and(|cg| self.frozen.contains(cg) || self.freeze_if_only(cg, members));
        let how = if frozen {
            Stopped::CgroupFreeze
        } else {
            signal(fd, libc::SIGSTOP);
            Stopped::Sigstop
        };
        self.how.insert(pid, how);
        how
    }

    /// Freezes `cg` whole when every process in it is one of `members`;
    /// returns whether it did.
    fn freeze_if_only(&mut self, cg: &str, members: &BTreeSet<i32>) -> bool {
        let inside = self.node.cg.procs_recursive(cg);
        let only = !inside.is_empty() && inside.iter().all(|q| members.contains(q));
        if only && set_frozen(self.node, cg, true, FREEZE_WAIT) {
            self.frozen.insert(cg.to_string());
            return true;
        }
        false
    }

    /// How `pid` was stopped, if it was.
    pub fn how(&self, pid: i32) -> Option<Stopped> {
        self.how.get(&pid).copied()
    }

    /// Whether the response froze `cgroup` whole.
    pub fn froze(&self, cgroup: &str) -> bool {
        self.frozen.contains(cgroup)
    }

    /// The cgroups the response froze whole.
    pub fn frozen_cgroups(&self) -> &BTreeSet<String> {
        &self.frozen
    }

    /// Ends `targets` (pid, pidfd): with `grace`, `SIGTERM` first
    /// (`SIGCONT` too for one stopped by signal), the frozen cgroups
    /// thawed, `grace` waited, then `SIGKILL` for what is left; without,
    /// `SIGKILL` and the thaw. Then waits up to `kill_wait_ms` (at least
    /// 100 ms) on the pidfds; a process still there but exiting
    /// ([`exiting`]: thousands of tables take seconds to close) is waited
    /// for up to [`EXITING_WAITS`] times as long again. Returns, per pid,
    /// the signal that ended it, or `None` when it is still there (a
    /// survivor). Each wait is cut by the node's deadline, if any
    /// ([`Node::bound`]): a process not seen gone in a cut wait is a
    /// survivor like any other.
    pub fn end(
        &mut self,
        targets: &[(i32, &OwnedFd)],
        grace: Option<Duration>,
    ) -> BTreeMap<i32, Option<EndedBy>> {
        let fds: Vec<&OwnedFd> = targets.iter().map(|(_, f)| *f).collect();
        let mut ended: BTreeMap<i32, Option<EndedBy>> = BTreeMap::new();
        if let Some(grace) = grace {
            for (pid, fd) in targets {
                signal(fd, libc::SIGTERM);
                if self.how.get(pid) == Some(&Stopped::Sigstop) {
                    signal(fd, libc::SIGCONT);
                }
            }
            self.thaw();
            wait_all(&fds, self.node.bound(Wait::TermGrace, grace));
            for (pid, fd) in targets {
                if exited(fd) {
                    ended.insert(*pid, Some(EndedBy::Sigterm));
                }
            }
        }
        for (pid, fd) in targets {
            if !ended.contains_key(pid) {
                signal(fd, libc::SIGKILL);
            }
        }
        self.thaw();
        let wait = Duration::from_millis(self.node.cfg.kill_wait_ms.max(100));
        wait_all(&fds, self.node.bound(Wait::KillWait, wait));
        let on_the_way: Vec<&OwnedFd> = targets
            .iter()
            .filter(|(pid, fd)| !exited(fd) && exiting(*pid))
            .map(|(_, fd)| *fd)
            .collect();
        if !on_the_way.is_empty() {
            wait_all(
                &on_the_way,
                self.node.bound(Wait::Exiting, wait * EXITING_WAITS),
            );
        }
        for (pid, fd) in targets {
            if !ended.contains_key(pid) {
                ended.insert(*pid, exited(fd).then_some(EndedBy::Sigkill));
            }
        }
        ended
    }

    /// Thaws every cgroup the response froze (once).
    fn thaw(&mut self) {
        for cg in std::mem::take(&mut self.frozen) {
            set_frozen(self.node, &cg, false, FREEZE_WAIT);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How a process was stopped and what ended it read in the audit
    /// lines, evidence and reports as they always did.
    #[test]
    fn stops_and_ends_are_written_as_before() {
        assert_eq!(Stopped::CgroupFreeze.to_string(), "cgroup-freeze");
        assert_eq!(
            serde_json::to_value(Stopped::Sigstop).unwrap(),
            serde_json::json!("SIGSTOP")
        );
        assert_eq!(
            serde_json::to_value(Some(Stopped::CgroupFreeze)).unwrap(),
            serde_json::json!("cgroup-freeze")
        );
        assert_eq!(EndedBy::Sigterm.as_str(), "SIGTERM");
        assert_eq!(format!("ended by {}", EndedBy::Sigkill), "ended by SIGKILL");
        assert_eq!(
            serde_json::to_value(EndedBy::Sigkill).unwrap(),
            serde_json::json!("SIGKILL")
        );
    }

    /// A live process is not exiting; a zombie is, and its pidfd, polled,
    /// says it exited.
    #[test]
    fn exiting_processes_are_told_and_waited_for() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let fd = pidfd_open(pid).unwrap();
        assert!(!exiting(pid));
        assert!(!exited(&fd));
        assert!(signal(&fd, libc::SIGKILL));
        wait_all(&[&fd], Duration::from_secs(10));
        assert!(exited(&fd), "the pidfd is readable once it exited");
        assert!(exiting(pid), "a zombie is on its way out");
        let _ = child.wait();
    }
}
