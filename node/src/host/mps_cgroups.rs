//! gpufence's MPS daemons' cgroups, `<cgroup_root>/<mps_cgroup>/<gpu>-u<uid>`
//! (one per GPU and job user: `crate::job::mps`), and who belongs in them:
//! the names, the rule, and the processes that break it, for the MPS
//! Prolog and Epilog (which end them) and the sweep (which reports them).

use crate::{join_cgroup, Node};

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
