//! The process walk: one pass over `/proc` for every process-based check.

use std::collections::BTreeMap;

use gpufence_model::device::DevNum;

use crate::holders::scan::{HeldFd, Scanner};
use crate::host::procs::{read_cmdline, read_stat, read_uid, PF_KTHREAD};
use crate::host::users::Users;
use crate::{is_under, Node};

/// The arguments that carry a stratum (mining pool) URL.
pub fn stratum_urls(cmdline: &[String]) -> Vec<String> {
    const SCHEMES: [&str; 4] = [
        "stratum+tcp://",
        "stratum+ssl://",
        "stratum+tls://",
        "stratum2+tcp://",
    ];
    cmdline
        .iter()
        .filter(|a| {
            let l = a.to_ascii_lowercase();
            SCHEMES.iter().any(|s| l.contains(s))
        })
        .cloned()
        .collect()
}

/// What the sweep knows of a process it reports.
#[derive(Clone, Debug, Default)]
pub(super) struct ProcMeta {
    pub(super) pid: i32,
    pub(super) comm: Option<String>,
    pub(super) uid: Option<u32>,
    pub(super) user: Option<String>,
    pub(super) cgroup: Option<String>,
    pub(super) cmdline: Vec<String>,
}

/// Whether `pid` runs one of `slurm_listeners` (by `/proc/<pid>/exe`: a
/// deleted or replaced binary reads `... (deleted)` and does not match).
pub(super) fn slurm_exe(node: &Node, pid: i32) -> bool {
    std::fs::read_link(crate::host::procs::live_view(pid).join("exe"))
        .is_ok_and(|exe| node.cfg.slurm_listeners.contains(&exe))
}

pub(super) fn netns_of(pid: i32) -> Option<u64> {
    let l = std::fs::read_link(format!("/proc/{pid}/ns/net")).ok()?;
    let s = l.to_str()?;
    s.strip_prefix("net:[")?.strip_suffix(']')?.parse().ok()
}

/// Reads what findings need about processes, once each.
pub(super) struct Procs<'a> {
    pub(super) node: &'a Node,
    pub(super) users: &'a Users,
    pub(super) cache: BTreeMap<i32, ProcMeta>,
}

impl Procs<'_> {
    pub(super) fn meta(&mut self, pid: i32) -> ProcMeta {
        if let Some(m) = self.cache.get(&pid) {
            return m.clone();
        }
        let uid = read_uid(pid);
        let m = ProcMeta {
            pid,
            comm: read_stat(pid).map(|(c, _, _)| c),
            uid,
            user: uid.and_then(|u| self.users.name(u)),
            cgroup: self.node.cg.cgroup_of(pid).ok(),
            cmdline: read_cmdline(pid),
        };
        self.cache.insert(pid, m.clone());
        m
    }
}

/// What one pass over `/proc` keeps: only processes with something to say.
#[derive(Default)]
pub(super) struct Walk {
    pub(super) walked: usize,
    /// Why rings tasks registered (`IORING_REGISTER_RING_FDS`) were not
    /// read, if so.
    pub(super) ring_error: Option<String>,
    /// Registered rings not read whole: (pid, thread, slot, fixed files).
    pub(super) unread_rings: Vec<(i32, i32, i32, u64)>,
    pub(super) holders: BTreeMap<i32, Vec<HeldFd>>,
    /// socket inode → owning pids.
    pub(super) sockets: BTreeMap<u64, Vec<i32>>,
    /// network namespace → a pid in it.
    pub(super) netns: BTreeMap<u64, i32>,
    pub(super) stratum: BTreeMap<i32, Vec<String>>,
    /// Processes the `/proc` walk did not read whole within
    /// `scan_budget_ms` each: pid → where it stopped.
    pub(super) not_read: BTreeMap<i32, String>,
}

/// `proc_only`: walk `/proc` without trying the iterators
/// ([`Options::proc_walk`](super::Options::proc_walk)).
pub(super) fn walk_proc(
    node: &Node,
    scope: Option<&str>,
    proc_only: bool,
    want: &dyn Fn(DevNum) -> bool,
) -> Walk {
    let me = std::process::id() as i32;
    let mut w = Walk::default();
    // Where the iterators cannot run, each process's `/proc` walk is
    // bounded by `scan_budget_ms`: one process of a thousand tables
    // cannot hold the sweep for minutes, and what it did not read is
    // reported (`not_read_whole`), never taken for "clean".
    let scanner = if proc_only {
        Scanner::proc_walk()
    } else {
        Scanner::new()
    };
    let mut scanner =
        scanner.with_walk_budget(std::time::Duration::from_millis(node.cfg.scan_budget_ms));
    for pid in crate::holders::scan::pids() {
        if pid == me {
            continue;
        }
        let Some((_, _, flags)) = read_stat(pid) else {
            continue;
        };
        if flags & PF_KTHREAD != 0 {
            continue;
        }
        if let Some(scope) = scope {
            if !node.cg.cgroup_of(pid).is_ok_and(|cg| is_under(&cg, scope)) {
                continue;
            }
        }
        w.walked += 1;
        let urls = stratum_urls(&read_cmdline(pid));
        if !urls.is_empty() {
            w.stratum.insert(pid, urls);
        }
        let f = scanner.process_fds(pid, want);
        if let Some(why) = f.cut {
            w.not_read.insert(pid, why);
        }
        if let Some(h) = f.holder {
            w.holders.insert(pid, h.fds);
        }
        if !f.sockets.is_empty() {
            if let Some(ns) = netns_of(pid) {
                w.netns.entry(ns).or_insert(pid);
            }
            for s in f.sockets {
                w.sockets.entry(s).or_default().push(pid);
            }
        }
    }
    w.ring_error = scanner.ring_error().map(String::from);
    w.unread_rings = scanner.unread_rings().to_vec();
    w
}
