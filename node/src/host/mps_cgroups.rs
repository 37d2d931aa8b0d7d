//! gpufence's MPS daemons' cgroups, `<cgroup_root>/<mps_cgroup>/<gpu>-u<uid>`
//! (one per GPU and job user: `crate::job::mps`), and who belongs in them:
//! the names, the rule, and the processes that break it, for the MPS
//! Prolog and Epilog (which end them) and the sweep (which reports them);
//! the daemons' registry and locks, and how a daemon is stopped (shared by
//! the Epilog and the sweep).

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpufence_cgroup::Fence;
use gpufence_model::audit::{events, AuditEvent};

use crate::{join_cgroup, Node, NodeError};

/// The name of uid `uid`'s daemon on GPU `leaf`: `<leaf>-u<uid>` (its
/// registry directory and its cgroup).
pub fn daemon_name(leaf: &str, uid: u32) -> String {
    format!("{leaf}-u{uid}")
}

/// The GPU and the uid of a daemon named by [`daemon_name`]; `None` for
/// another name (a daemon of gpufence before one ran per user).
pub fn parse_daemon(name: &str) -> Option<(&str, u32)> {
    let (leaf, uid) = name.rsplit_once("-u")?;
    if leaf.is_empty() || uid.is_empty() || !uid.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((leaf, uid.parse().ok()?))
}

/// Whether a process of real uid `uid` in the cgroup of a daemon of
/// `daemon_uid` is foreign: any uid but the daemon's user's, root's
/// included (the control daemon runs as its user, its servers too; root
/// is there only for the instant between the daemon's spawn joining the
/// cgroup and dropping to its user, and gpufence asks nothing of a daemon
/// through its pipes). Every process of a daemon of unknown user (one of
/// gpufence before daemons ran per user, as root) but root's is.
pub fn is_foreign(uid: u32, daemon_uid: Option<u32>) -> bool {
    match daemon_uid {
        Some(d) => uid != d,
        None => uid != 0,
    }
}

/// The parent of the daemons' cgroups: `<cgroup_root>/<mps_cgroup>`.
pub fn parent(node: &Node) -> String {
    join_cgroup(&node.cfg.cgroup_root, &node.cfg.mps_cgroup)
}

/// Daemon `daemon`'s cgroup (relative to the mount):
/// `<cgroup_root>/<mps_cgroup>/<daemon>`.
pub fn daemon_cgroup(node: &Node, daemon: &str) -> String {
    join_cgroup(&parent(node), daemon)
}

/// A process of a foreign uid ([`is_foreign`]) in a daemon's cgroup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForeignProcess {
    /// Its pid.
    pub pid: i32,
    /// Its real uid (`Uid:` of `/proc/<pid>/status`).
    pub uid: u32,
    /// The daemon's cgroup (relative to the mount).
    pub cgroup: String,
    /// The daemon's user, when its name says it.
    pub daemon_uid: Option<u32>,
}

/// Every process of a foreign uid in the daemons' cgroups, as they are now.
pub fn foreign_processes(node: &Node) -> Vec<ForeignProcess> {
    let parent = parent(node);
    let Ok(rd) = std::fs::read_dir(node.cg.path(&parent)) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in rd.flatten() {
        if !e.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let Some(name) = e.file_name().to_str().map(str::to_string) else {
            continue;
        };
        let daemon_uid = parse_daemon(&name).map(|(_, u)| u);
        let cgroup = join_cgroup(&parent, &name);
        for pid in node.cg.procs_recursive(&cgroup) {
            if let Some(uid) = crate::host::procs::uid_of(pid) {
                if is_foreign(uid, daemon_uid) {
                    out.push(ForeignProcess {
                        pid,
                        uid,
                        cgroup: cgroup.clone(),
                        daemon_uid,
                    });
                }
            }
        }
    }
    out
}

/// How long the Prolog or Epilog waits for a daemon's lock, and for the
/// control command (`-d` returns once the daemon forked).
pub const MPS_WAIT: Duration = Duration::from_secs(10);

/// GPU `leaf`'s directory: `<mps_dir>/<leaf>`, root's, 0755.
pub fn gpu_dir(node: &Node, leaf: &str) -> PathBuf {
    node.cfg.mps_dir.join(leaf)
}

/// uid `uid`'s directory on GPU `leaf`: `<mps_dir>/<leaf>/u<uid>` (`pipe/`,
/// `log/`), root's, 0700, reachable by `uid` through its ACL.
pub fn user_dir(node: &Node, leaf: &str, uid: u32) -> PathBuf {
    gpu_dir(node, leaf).join(format!("u{uid}"))
}

/// A daemon's lock, held until dropped.
pub(crate) struct Lock(#[allow(dead_code)] std::fs::File);

/// Takes daemon `name`'s lock (`<state_dir>/mps-locks/<name>.lock`): one
/// per daemon, so that one user's slow start or stop never holds up
/// another user's daemon.
pub(crate) fn lock(node: &Node, name: &str) -> Result<Lock, NodeError> {
    let p = node.state.mps_daemon_lock_path(name);
    if let Some(dir) = p.parent() {
        gpufence_model::fsutil::create_dir_all_mode(dir, 0o700)
            .map_err(|e| NodeError::io("create", dir, e))?;
    }
    let wait = node.bound(crate::host::deadline::Wait::Mps, MPS_WAIT);
    match gpufence_model::fsutil::lock_file_within(&p, wait, Duration::from_millis(10)) {
        Ok(Some(f)) => Ok(Lock(f)),
        Ok(None) => Err(NodeError::MpsLocked {
            path: p,
            waited_ms: u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
            daemon: name.to_string(),
        }),
        Err(e) => Err(NodeError::io("open", &p, e)),
    }
}

/// What a registration holds: the pid and start time (`/proc/<pid>/stat`
/// field 22) of the Prolog that wrote it, so that a registration whose job
/// has no record is told apart from one whose Prolog is still running
/// (the record is written after the daemon is started).
pub(crate) fn registration_mark() -> String {
    let pid = std::process::id() as i32;
    let start = gpufence_model::procstat::ProcStat::of(pid).map_or(0, |s| s.starttime);
    format!("{pid} {start}\n")
}

/// How old a registration without a writer named in it must be to be
/// stale when its job has no record.
const UNMARKED_STALE: Duration = Duration::from_secs(300);

/// Whether registration `path` of job `job_id` is stale: the job has no
/// record in `state_dir` (readable or not) and the Prolog that wrote the
/// registration is gone (an Epilog that never ran, a Prolog killed between
/// registering and writing the record).
fn stale_registration(node: &Node, path: &Path, job_id: u32) -> bool {
    if node.state.record_path(job_id).exists() {
        return false;
    }
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut it = text.split_whitespace();
    match (
        it.next().and_then(|p| p.parse::<i32>().ok()),
        it.next().and_then(|s| s.parse::<u64>().ok()),
    ) {
        (Some(pid), Some(start)) => !gpufence_model::procstat::ProcStat::of(pid)
            .is_some_and(|s| s.starttime == start && s.state != 'Z' && s.state != 'X'),
        _ => std::fs::metadata(path)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > UNMARKED_STALE),
    }
}

/// The jobs registered with daemon `name`.
pub(crate) fn registered(node: &Node, name: &str) -> Vec<u32> {
    std::fs::read_dir(node.state.mps_daemon_dir(name))
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Removes the stale registrations of daemon `name` (no record of the
/// job, the Prolog that wrote it gone; job `except`'s is never one), each
/// audited (`stale_job_state`). Called
/// under the daemon's lock by the Prolog and the Epilog, and by the sweep.
/// The jobs whose registrations went.
pub fn prune_stale(node: &Node, name: &str, except: Option<u32>, phase: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for job in registered(node, name) {
        if Some(job) == except {
            continue;
        }
        let path = node.state.mps_registration_path(name, job);
        if !stale_registration(node, &path, job) || std::fs::remove_file(&path).is_err() {
            continue;
        }
        let mut ev = AuditEvent::new(events::STALE_JOB_STATE)
            .job(job)
            .field("phase", phase)
            .field("mps_daemon", name)
            .field(
                "reason",
                "MPS registration of a job with no record and no Prolog running: removed",
            );
        if let Some((_, uid)) = parse_daemon(name) {
            ev = ev.uid(uid);
        }
        let _ = node.audit(ev);
        out.push(job);
    }
    out.sort_unstable();
    out
}

/// Every daemon in the registry (`<state_dir>/mps/<name>/`).
pub fn registry_daemons(node: &Node) -> Vec<String> {
    let Ok(rd) = std::fs::read_dir(node.state.mps_registry_dir()) else {
        return Vec::new();
    };
    let mut out: Vec<String> = rd
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .collect();
    out.sort();
    out
}

/// What [`sweep_stale`] did with one daemon.
#[derive(Debug)]
pub struct SweptDaemon {
    /// The daemon's name ([`daemon_name`]).
    pub name: String,
    /// The jobs whose stale registrations were removed.
    pub jobs: Vec<u32>,
    /// `None` while a job is still registered with it; else what stopping
    /// it gave (the processes killed, or why it failed).
    pub stopped: Option<Result<Vec<i32>, MpsStopError>>,
}

/// `gpufence sweep`'s part: under each daemon's lock, removes its stale
/// registrations ([`prune_stale`]: a job with no record whose Prolog is
/// gone, so whose Epilog will not release it) and stops a daemon that
/// none is left of (as the Epilog would have). Daemons whose lock cannot
/// be had are left to the next sweep.
pub fn sweep_stale(node: &Node, fence: Option<&Fence>) -> Vec<SweptDaemon> {
    let mut out = Vec::new();
    for name in registry_daemons(node) {
        let Ok(_lock) = lock(node, &name) else {
            continue;
        };
        let jobs = prune_stale(node, &name, None, "sweep");
        if jobs.is_empty() {
            continue;
        }
        let stopped = registered(node, &name).is_empty().then(|| {
            let _ = std::fs::remove_dir(node.state.mps_daemon_dir(&name));
            let r = stop_one(node, fence, &name);
            if let Ok(killed) = &r {
                let mut ev = AuditEvent::new(events::MPS_STOPPED)
                    .field("phase", "sweep")
                    .field("mps_daemon", name.clone())
                    .field("killed", killed.clone());
                if let Some((_, uid)) = parse_daemon(&name) {
                    ev = ev.uid(uid);
                }
                let _ = node.audit(ev);
            }
            r
        });
        out.push(SweptDaemon {
            name,
            jobs,
            stopped,
        });
    }
    out
}

/// Why an MPS control daemon could not be started
/// ([`crate::job::mps::start`]): the job runs without MPS. Each text is
/// the one the user's note and the `error` audit line give.
#[derive(Debug, thiserror::Error)]
pub enum MpsStartError {
    /// A directory on the way to the pipes could not be made, read or
    /// removed.
    #[error("{}: {source}", path.display())]
    Dir {
        /// The directory.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A path with a NUL byte (no system call can take it).
    #[error("{}: a NUL in the path", path.display())]
    NulInPath {
        /// The path.
        path: PathBuf,
    },
    /// The POSIX ACL that lets the user alone traverse could not be set.
    #[error("{}: setting the POSIX ACL that lets uid {uid} alone reach the pipes: {source} (a file system without POSIX ACLs cannot hold mps_dir)", path.display())]
    Acl {
        /// The directory.
        path: PathBuf,
        /// The daemon's user.
        uid: u32,
        /// Why (`lsetxattr(2)`).
        source: std::io::Error,
    },
    /// A directory that must be root's and root-writable only is not.
    #[error("{} is not a directory of root's that only root may write (owner {owner}, mode {mode:o}): it is left as it is", path.display())]
    NotRootOnly {
        /// The directory.
        path: PathBuf,
        /// Its owner.
        owner: u32,
        /// Its permission bits.
        mode: u32,
    },
    /// A directory made for the user is not as it was made.
    #[error("{} is not the directory of uid {uid}, mode {mode:o} it was made as", path.display())]
    NotAsMade {
        /// The directory.
        path: PathBuf,
        /// The user it was made for.
        uid: u32,
        /// The mode it was made with.
        mode: u32,
    },
    /// The user's passwd entry could not be read.
    #[error("uid {uid}: {source}")]
    User {
        /// The user.
        uid: u32,
        /// Why.
        source: nix::Error,
    },
    /// The user has no passwd entry.
    #[error("uid {uid} has no passwd entry")]
    NoUser {
        /// The user.
        uid: u32,
    },
    /// The user's name has a NUL byte.
    #[error("uid {uid}: a NUL in the user name")]
    NulInName {
        /// The user.
        uid: u32,
    },
    /// The user's groups could not be read (`getgrouplist(3)`).
    #[error("uid {uid}: its groups: {source}")]
    Groups {
        /// The user.
        uid: u32,
        /// Why.
        source: nix::Error,
    },
    /// The daemon's cgroup could not be made or joined, or granted.
    #[error("{0}")]
    Kernel(#[from] gpufence_cgroup::Error),
    /// `mps_control -d` failed.
    #[error("{} -d: {source}", program.display())]
    Run {
        /// The control program.
        program: PathBuf,
        /// Why.
        source: RunError,
    },
}

/// Why a bounded command (the control program, run with a wait) failed.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// It could not be started, or waited for.
    #[error("{0}")]
    Io(std::io::Error),
    /// It exited unsuccessfully.
    #[error("exited with {0}")]
    Exited(std::process::ExitStatus),
    /// It ran past its wait, and was killed.
    #[error("still running after {secs} s: killed")]
    TimedOut {
        /// The wait, seconds.
        secs: u64,
    },
}

/// Why a daemon could not be stopped (the Epilog's release, the sweep):
/// its grant may still be in the fence, or something may still run in its
/// cgroup.
#[derive(Debug, thiserror::Error)]
pub enum MpsStopError {
    /// Its cgroup's grant could not be revoked (nothing was killed).
    #[error("revoking its grant: {0}")]
    Revoke(gpufence_cgroup::Error),
    /// Its cgroup could not be emptied and removed.
    #[error("{source} (processes {processes:?})")]
    Kill {
        /// Why.
        source: Box<NodeError>,
        /// What was in the cgroup.
        processes: Vec<i32>,
    },
}

/// Stops daemon `name` ([`daemon_name`]): its cgroup's grant revoked
/// first, then everything in it killed (`cgroup.kill`: a daemon or server
/// its user stopped or that does not answer is ended at once, none is
/// asked to `quit` through a pipe directory its user owns), the cgroup
/// removed, its directories removed. What was in the cgroup.
pub(crate) fn stop_one(
    node: &Node,
    fence: Option<&Fence>,
    name: &str,
) -> Result<Vec<i32>, MpsStopError> {
    let cg = daemon_cgroup(node, name);
    let id = node.cg.id(&cg).ok();
    // A daemon of gpufence before one ran per user: `<mps_dir>/<leaf>`.
    let dir = match parse_daemon(name) {
        Some((leaf, uid)) => user_dir(node, leaf, uid),
        None => gpu_dir(node, name),
    };
    if let (Some(f), Some(id)) = (fence, id) {
        f.revoke_cgroup(id).map_err(MpsStopError::Revoke)?;
    }
    let killed = node.cg.procs_recursive(&cg);
    if node.cg.path(&cg).exists() {
        let wait = node.bound(
            crate::host::deadline::Wait::MpsKill,
            Duration::from_millis(node.cfg.kill_wait_ms).max(Duration::from_secs(1)),
        );
        node.cg
            .kill_and_remove(&cg, wait)
            .map_err(|source| MpsStopError::Kill {
                source: Box::new(source.into()),
                processes: killed.clone(),
            })?;
    }
    // Root's `u<uid>` under root-only directories: nothing on the way is a
    // user's; remove_dir_all removes the user's `pipe` and `log` and what
    // is in them without following a link (unlinkat, O_NOFOLLOW).
    let _ = std::fs::remove_dir_all(&dir);
    if let Some((leaf, _)) = parse_daemon(name) {
        // The GPU's directory too, once no user's is left (fails while one is).
        let _ = std::fs::remove_dir(gpu_dir(node, leaf));
    }
    // The parent cgroup too, once no daemon is left (fails while one is).
    let _ = std::fs::remove_dir(node.cg.path(&parent(node)));
    Ok(killed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn daemon_names_carry_the_gpu_and_the_uid() {
        let n = daemon_name("gpu3", 1234);
        assert_eq!(n, "gpu3-u1234");
        assert_eq!(parse_daemon(&n), Some(("gpu3", 1234)));
        assert_eq!(
            parse_daemon(&daemon_name("dev10.123", 0)),
            Some(("dev10.123", 0))
        );
        // gpufence's daemons before one ran per user, and other names.
        for other in [
            "gpu3",
            "gpu3-u",
            "-u5",
            "gpu3-ux1",
            "gpu3-u1-",
            "gpu3-u99999999999",
        ] {
            assert_eq!(parse_daemon(other), None, "{other}");
        }
    }

    #[test]
    fn only_the_daemons_user_belongs_in_its_cgroup() {
        assert!(
            is_foreign(0, Some(1000)),
            "root: the daemon runs as its user"
        );
        assert!(!is_foreign(1000, Some(1000)), "its daemon and server");
        assert!(!is_foreign(0, Some(0)), "root's own daemon");
        assert!(is_foreign(1001, Some(1000)), "another user");
        assert!(is_foreign(1000, None), "a daemon of unknown user");
        assert!(!is_foreign(0, None));
    }
}
