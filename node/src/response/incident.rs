//! `gpufence respond PID`: an admin's answer to one process (a miner the
//! sweep found, a hijacked notebook), in the order incident responders use:
//!
//! 1. refuse what must never be touched: PID 1, this process (and its
//!    ancestors), kernel threads (`PF_KTHREAD`, or no `/proc/<pid>/exe`),
//!    exempt daemons (a process in or under an `exempt_cgroups` entry, or a
//!    cgroup the fence holds exempt);
//! 2. take the process tree (the process and its descendants) and pin each
//!    member with a pidfd, so no later step can hit a recycled pid;
//! 3. stop the tree where it stands: `cgroup.freeze` for each cgroup that
//!    holds nothing but the tree, `SIGSTOP` for the others; descendants
//!    forked meanwhile are found and stopped too. Stopping destroys nothing
//!    and keeps what is collected next consistent (a tree cannot fork,
//!    hand on a descriptor or delete files while it is read);
//! 4. preserve evidence: one evidence file per member
//!    ([`crate::response::evidence`]; the members' holds read within
//!    `scan_budget_ms` all together, what is not read said in the record),
//!    and an incident file with the tree, how each
//!    member was stopped, the evidence files and the persistence entries of
//!    the process's uid with their content (root-only, never overwritten);
//! 5. `SIGKILL` every member through its pidfd, thaw, and check each is
//!    gone (waited for on its pidfd; one still exiting, a while longer);
//! 6. list, never delete, the persistence entries found;
//! 7. drain the node when asked.
//!
//! Every step writes an audit line (`respond_refused`, `respond_frozen`,
//! `respond_evidence`, `respond_killed`, `respond_survivor`,
//! `respond_persistence`, `respond_drained`, `respond_drain_failed`).
//! Descendants in an exempt cgroup are spared and named; a process that left
//! the tree before the response (double fork, re-parented to init) is not
//! part of it: sweep again.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::json;

use gpufence_cgroup::fence::Fence;
use gpufence_model::audit::AuditEvent;
use gpufence_model::device::DevNum;
use gpufence_model::record::now_rfc3339;

use crate::holders::cover::exemption;
use crate::holders::scan::Scanner;
use crate::host::persistence::{persistence_of_uid, PersistenceEntry};
use crate::host::procs::{alive, live_view, read_cmdline, read_stat, read_uid, PF_KTHREAD};
use crate::host::users::Users;
use crate::response::engine::{exited, pidfd_open, Engine, Stopped};
use crate::response::evidence::{self, GpuMemory};
use crate::{host::drain, Node};

/// Why `respond` will not act on a pid.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No such process (or a zombie: nothing left to stop).
    NotFound(i32),
    /// PID 1.
    Init,
    /// This process.
    Myself,
    /// An ancestor of this process: the response would kill itself.
    Ancestor(i32),
    /// A kernel thread.
    KernelThread(i32),
    /// A thread id, not a process: respond to the process.
    Thread {
        /// The thread.
        tid: i32,
        /// Its process.
        tgid: i32,
    },
    /// An exempt daemon.
    Exempt {
        /// The process.
        pid: i32,
        /// Its cgroup.
        cgroup: String,
        /// The exemption that covers it.
        exemption: String,
    },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::NotFound(p) => write!(f, "pid {p}: no such process (or already exited)"),
            Refusal::Init => f.write_str("pid 1 (init) is never touched"),
            Refusal::Myself => f.write_str("refusing to respond to gpufence itself"),
            Refusal::Ancestor(p) => write!(
                f,
                "pid {p} is an ancestor of this gpufence process: responding would kill the responder"
            ),
            Refusal::KernelThread(p) => write!(f, "pid {p} is a kernel thread"),
            Refusal::Thread { tid, tgid } => write!(
                f,
                "{tid} is a thread of process {tgid}: respond to {tgid}"
            ),
            Refusal::Exempt {
                pid,
                cgroup,
                exemption,
            } => write!(
                f,
                "pid {pid} is an exempt daemon (cgroup /{cgroup}, exemption {exemption}): never touched"
            ),
        }
    }
}

impl std::error::Error for Refusal {}

/// One member of the process tree.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TreeProcess {
    /// pid.
    pub pid: i32,
    /// Parent pid.
    pub ppid: i32,
    /// Real uid.
    pub uid: Option<u32>,
    /// `comm`.
    pub comm: String,
    /// Command line.
    pub cmdline: Vec<String>,
    /// cgroup2 path. JSON: absolute (`/a/b`).
    #[serde(serialize_with = "crate::host::cgpath::option::serialize")]
    pub cgroup: Option<String>,
}

/// A descendant left alone, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Spared {
    /// pid.
    pub pid: i32,
    /// Why.
    pub why: String,
}

/// What `respond` did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct IncidentOutcome {
    /// The process responded to.
    pub pid: i32,
    /// Its uid.
    pub uid: Option<u32>,
    /// Its user.
    pub user: Option<String>,
    /// Its `comm`.
    pub comm: Option<String>,
    /// The tree (the process first, then its descendants).
    pub tree: Vec<TreeProcess>,
    /// Descendants left alone.
    pub spared: Vec<Spared>,
    /// How each member was stopped: `cgroup-freeze` or `SIGSTOP`.
    pub frozen: BTreeMap<i32, Stopped>,
    /// The evidence files, one per member.
    pub evidence: Vec<PathBuf>,
    /// The incident file (tree, persistence, evidence list).
    pub incident_file: Option<PathBuf>,
    /// Members gone after SIGKILL.
    pub killed: Vec<i32>,
    /// Members still alive after SIGKILL and `kill_wait_ms`.
    pub survivors: Vec<i32>,
    /// The persistence entries of its uid: listed, never deleted.
    pub persistence: Vec<PersistenceEntry>,
    /// The drain reason, when the node was drained.
    pub drained: Option<String>,
    /// What went wrong (evidence, audit, drain).
    pub errors: Vec<String>,
    /// What the evidence left out to stay within its budget, if anything
    /// ([`evidence::Budget::summary`]).
    pub notes: Vec<String>,
    /// Members whose holds could not be read whole within
    /// `scan_budget_ms` (all members together): `pid P: not read whole
    /// within N ms: where it stopped`. They were stopped and killed all
    /// the same; what they held is not known whole.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub not_read: Vec<String>,
}

impl IncidentOutcome {
    /// Whether the tree is gone and every step worked.
    pub fn complete(&self) -> bool {
        self.survivors.is_empty() && self.errors.is_empty()
    }
}

/// The thread group (process) id of task `pid`: `Tgid` of
/// `/proc/<pid>/status` (`fs/proc/array.c`), read with `procfs`.
fn tgid_of(pid: i32) -> Option<i32> {
    procfs::process::Process::new(pid)
        .ok()?
        .status()
        .ok()
        .map(|s| s.tgid)
}

/// pid → ppid of every process.
fn parents() -> BTreeMap<i32, i32> {
    crate::holders::scan::pids()
        .into_iter()
        .filter_map(|p| read_stat(p).map(|(_, pp, _)| (p, pp)))
        .collect()
}

/// `root` and its descendants, parents before children.
fn tree_of(parents: &BTreeMap<i32, i32>, root: i32) -> Vec<i32> {
    let mut children: BTreeMap<i32, Vec<i32>> = BTreeMap::new();
    for (p, pp) in parents {
        children.entry(*pp).or_default().push(*p);
    }
    let mut out = vec![root];
    let mut i = 0;
    while i < out.len() {
        if let Some(c) = children.get(&out[i]) {
            for p in c {
                if !out.contains(p) {
                    out.push(*p);
                }
            }
        }
        i += 1;
    }
    out
}

fn ancestors_of_me(parents: &BTreeMap<i32, i32>) -> BTreeSet<i32> {
    let mut out = BTreeSet::new();
    let mut cur = std::process::id() as i32;
    while let Some(pp) = parents.get(&cur) {
        if *pp <= 0 || !out.insert(*pp) {
            break;
        }
        cur = *pp;
    }
    out
}

/// Checks that `pid` may be responded to.
///
/// # Errors
/// The [`Refusal`].
pub fn check(node: &Node, pid: i32) -> Result<(), Refusal> {
    let me = std::process::id() as i32;
    if pid == 1 {
        return Err(Refusal::Init);
    }
    if pid == me {
        return Err(Refusal::Myself);
    }
    if pid <= 0 {
        return Err(Refusal::NotFound(pid));
    }
    let Some((_, _, flags)) = read_stat(pid) else {
        return Err(Refusal::NotFound(pid));
    };
    if flags & PF_KTHREAD != 0 {
        return Err(Refusal::KernelThread(pid));
    }
    // A zombie is gone, unless only its leader exited and other threads
    // live on (they keep the process's descriptors and mappings).
    if !alive(pid) {
        return Err(Refusal::NotFound(pid));
    }
    if let Some(tgid) = tgid_of(pid).filter(|t| *t != pid) {
        return Err(Refusal::Thread { tid: pid, tgid });
    }
    if std::fs::read_link(live_view(pid).join("exe"))
        .is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound)
    {
        return Err(Refusal::KernelThread(pid));
    }
    let fence = Fence::open(&node.cfg.bpffs_dir).ok();
    if let Ok(cg) = node.cg.cgroup_of(pid) {
        if let Some(e) = exemption(node, fence.as_ref(), &cg, read_uid(pid)) {
            return Err(Refusal::Exempt {
                pid,
                cgroup: cg,
                exemption: e,
            });
        }
    }
    if ancestors_of_me(&parents()).contains(&pid) {
        return Err(Refusal::Ancestor(pid));
    }
    Ok(())
}

const REASON: &str = "gpufence respond: incident response requested by an admin";

/// Responds to `pid` as the module says; `drain_node` drains that node.
///
/// # Errors
/// The [`Refusal`] (audited as `respond_refused`) when `pid` must not be
/// touched; nothing was done then.
pub fn respond_pid(
    node: &Node,
    pid: i32,
    drain_node: Option<&str>,
) -> Result<IncidentOutcome, Refusal> {
    let refuse = |r: Refusal| {
        let _ = node.audit(
            AuditEvent::new(gpufence_model::audit::events::RESPOND_REFUSED)
                .pid(pid)
                .field("by", crate::host::procs::who())
                .field("reason", r.to_string()),
        );
        Err(r)
    };
    // 1. Pinned before it is checked: if the pid is recycled meanwhile,
    //    the pidfd says the process it named exited, and nothing is done.
    let target = match (pid > 0).then(|| pidfd_open(pid)).flatten() {
        Some(fd) => fd,
        None => return refuse(check(node, pid).err().unwrap_or(Refusal::NotFound(pid))),
    };
    if let Err(r) = check(node, pid) {
        return refuse(r);
    }
    if exited(&target) {
        return refuse(Refusal::NotFound(pid));
    }
    let mut i = Incident::new(node, pid);
    i.pin_tree(target);
    i.stop_tree();
    i.collect_evidence();
    i.kill();
    i.list_persistence();
    if let Some(name) = drain_node {
        i.drain(name);
    }
    Ok(i.out)
}

/// One response to a process tree: what its steps share.
struct Incident<'a> {
    node: &'a Node,
    pid: i32,
    /// Who asked: every line and the incident file name them.
    by: String,
    fence: Option<Fence>,
    /// Names and homes of users (NSS): the node's.
    users: &'a Users,
    engine: Engine<'a>,
    /// The members, pinned.
    pinned: BTreeMap<i32, OwnedFd>,
    cgroups: BTreeMap<i32, Option<String>>,
    spared_pids: BTreeSet<i32>,
    /// The tree as first listed, parents first.
    order: Vec<i32>,
    /// The members in tree order, those found later after them.
    tree_pids: Vec<i32>,
    out: IncidentOutcome,
}

impl<'a> Incident<'a> {
    fn new(node: &'a Node, pid: i32) -> Self {
        let users = node.users();
        let uid = read_uid(pid);
        let out = IncidentOutcome {
            pid,
            uid,
            user: uid.and_then(|u| users.name(u)),
            comm: read_stat(pid).map(|(c, _, _)| c),
            ..Default::default()
        };
        Incident {
            node,
            pid,
            by: crate::host::procs::who(),
            fence: Fence::open(&node.cfg.bpffs_dir).ok(),
            users,
            engine: Engine::new(node),
            pinned: BTreeMap::new(),
            cgroups: BTreeMap::new(),
            spared_pids: BTreeSet::new(),
            order: Vec::new(),
            tree_pids: Vec::new(),
            out,
        }
    }

    /// Writes `ev` with `by` (and the process's uid when `with_uid`); a
    /// failure is one of the outcome's errors.
    fn audit(&mut self, ev: AuditEvent, uid: bool) {
        let ev = if uid { with_uid(ev, self.out.uid) } else { ev };
        if let Err(e) = self.node.audit(ev.field("by", self.by.clone())) {
            self.out.errors.push(e.to_string());
        }
    }

    /// Takes `p` into the tree, pinned, unless it is spared (this process,
    /// init, a kernel thread, an exempt daemon: named in the outcome) or
    /// no longer the process the tree listed (gone, or not a child of a
    /// member). Returns whether it was taken.
    fn admit(&mut self, p: i32) -> bool {
        if self.pinned.contains_key(&p) || self.spared_pids.contains(&p) {
            return false;
        }
        let node = self.node;
        let me = std::process::id() as i32;
        let cg = node.cg.cgroup_of(p).ok();
        let why = if p == me || p == 1 {
            Some("gpufence itself or init".to_string())
        } else if read_stat(p).is_some_and(|(_, _, f)| f & PF_KTHREAD != 0) {
            Some("kernel thread".to_string())
        } else {
            cg.as_deref()
                .and_then(|c| exemption(node, self.fence.as_ref(), c, read_uid(p)))
                .map(|e| format!("exempt daemon ({e})"))
        };
        if let Some(why) = why {
            self.spared_pids.insert(p);
            self.out.spared.push(Spared { pid: p, why });
            return false;
        }
        let Some(fd) = pidfd_open(p) else {
            return false;
        };
        // Still the process the tree listed: alive, and a child of a
        // member (pinned before it: the tree lists parents first).
        let parent = read_stat(p).map(|(_, pp, _)| pp);
        if exited(&fd) || !parent.is_some_and(|pp| self.pinned.contains_key(&pp)) {
            return false;
        }
        self.pinned.insert(p, fd);
        self.cgroups.insert(p, cg);
        true
    }

    /// Step 2: the tree, pinned. Exempt descendants and this process's own
    /// lineage are spared.
    fn pin_tree(&mut self, target: OwnedFd) {
        self.pinned.insert(self.pid, target);
        self.cgroups
            .insert(self.pid, self.node.cg.cgroup_of(self.pid).ok());
        self.order = tree_of(&parents(), self.pid);
        for p in self.order.clone() {
            self.admit(p);
        }
    }

    /// Step 3: stops the tree (whole cgroups when they hold only the
    /// tree, else SIGSTOP), then looks for descendants forked meanwhile,
    /// until none are new; lists it (`respond_frozen`).
    fn stop_tree(&mut self) {
        // One look after each stop: a child forked before its parent
        // stopped is in /proc by then, and nothing stopped can fork again.
        for _round in 0..8 {
            let members: BTreeSet<i32> = self.pinned.keys().copied().collect();
            for (p, fd) in &self.pinned {
                if self.out.frozen.contains_key(p) {
                    continue;
                }
                let cg = self.cgroups.get(p).cloned().flatten();
                let how = self.engine.stop(*p, fd, cg.as_deref(), &members);
                self.out.frozen.insert(*p, how);
            }
            let mut new = false;
            for p in tree_of(&parents(), self.pid) {
                new |= self.admit(p);
            }
            if !new {
                break;
            }
        }
        let order = &self.order;
        self.tree_pids = order
            .iter()
            .copied()
            .filter(|p| self.pinned.contains_key(p))
            .chain(self.pinned.keys().copied().filter(|p| !order.contains(p)))
            .collect();
        self.out.tree = self
            .tree_pids
            .iter()
            .map(|p| TreeProcess {
                pid: *p,
                ppid: read_stat(*p).map(|(_, pp, _)| pp).unwrap_or(0),
                uid: read_uid(*p),
                comm: read_stat(*p).map(|(c, _, _)| c).unwrap_or_default(),
                cmdline: read_cmdline(*p),
                cgroup: self.cgroups.get(p).cloned().flatten(),
            })
            .collect();
        let frozen_ev = AuditEvent::new(gpufence_model::audit::events::RESPOND_FROZEN)
            .pid(self.pid)
            .field("tree", self.tree_pids.clone())
            .field(
                "how",
                self.out
                    .frozen
                    .iter()
                    .map(|(p, h)| (p.to_string(), serde_json::Value::from(h.as_str())))
                    .collect::<serde_json::Map<_, _>>(),
            )
            .field(
                "frozen_cgroups",
                self.engine
                    .frozen_cgroups()
                    .iter()
                    .map(|c| crate::host::cgpath::abs(c))
                    .collect::<Vec<_>>(),
            )
            .field(
                "spared",
                serde_json::to_value(&self.out.spared).unwrap_or_default(),
            );
        self.audit(frozen_ev, true);
    }

    /// What NVML lists on every GPU: `(minor, uuid, pid, used bytes)`.
    fn gpu_processes(&self) -> Vec<(u32, String, u32, Option<u64>)> {
        let g = self.node.open_gpus();
        g.minors()
            .and_then(|m| g.query(&m))
            .unwrap_or_default()
            .into_iter()
            .flat_map(|gi| {
                gi.processes
                    .iter()
                    .map(|p| (gi.minor, gi.uuid.clone(), p.pid, p.used_memory))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Step 4: evidence, each member's, then the incident file with the
    /// persistence entries of the process's uid (`respond_evidence`).
    fn collect_evidence(&mut self) {
        let node = self.node;
        let protected: BTreeSet<u32> = node
            .protected_majors()
            .map(|p| p.majors().collect())
            .unwrap_or_default();
        let want = |d: DevNum| protected.contains(&d.major);
        let mut scanner = Scanner::new();
        let gpu_mem = self.gpu_processes();
        let mut budget = evidence::Budget::from_config(&node.cfg);
        // The tree's holds are read within `scan_budget_ms`, all members
        // together: a member of thousands of private tables costs the
        // response that, never minutes; what is not read is said in its
        // record (the tree is stopped and killed either way).
        let deadline = Instant::now() + Duration::from_millis(node.cfg.scan_budget_ms);
        for p in &self.tree_pids {
            let look = scanner.holder_where_within(*p, &want, deadline);
            let holds = look.holder.map(|h| h.fds).unwrap_or_default();
            if let Some(why) = &look.cut {
                self.out.not_read.push(format!(
                    "pid {p}: not read whole within {} ms (scan_budget_ms): {why}",
                    node.cfg.scan_budget_ms
                ));
            }
            let mem: Vec<GpuMemory> = gpu_mem
                .iter()
                .filter(|(_, _, q, _)| i64::from(*q) == i64::from(*p))
                .map(|(minor, uuid, _, used)| GpuMemory {
                    minor: *minor,
                    uuid: uuid.clone(),
                    used_bytes: *used,
                })
                .collect();
            let found = evidence::Found {
                fds: holds,
                cgroup: self.cgroups.get(p).cloned().flatten(),
                gpu_memory: mem,
                unread: look.cut.map(|why| {
                    format!(
                        "within scan_budget_ms ({} ms): {why}",
                        node.cfg.scan_budget_ms
                    )
                }),
            };
            let ev = evidence::collect(
                *p,
                0,
                REASON,
                found,
                self.out.frozen.get(p).copied(),
                &mut budget,
            );
            match evidence::write_within(&node.cfg.evidence_dir, &ev, &mut budget) {
                Ok(Some(f)) => self.out.evidence.push(f),
                Ok(None) => {}
                Err(e) => self.out.errors.push(format!("evidence for pid {p}: {e}")),
            }
        }
        let out = &mut self.out;
        out.notes.extend(budget.summary());
        out.notes.extend(self.users.note());
        out.persistence = out
            .uid
            .map(|u| persistence_of_uid(node, u, self.users))
            .unwrap_or_default();
        let incident = json!({
            "collected": now_rfc3339(),
            "reason": REASON,
            "by": self.by,
            "pid": self.pid,
            "uid": out.uid,
            "user": out.user,
            "comm": out.comm,
            "tree": out.tree,
            "spared": out.spared,
            "frozen": out.frozen,
            "evidence": out.evidence,
            "persistence": out.persistence,
        });
        match write_incident(node, self.pid, &incident) {
            Ok(p) => out.incident_file = Some(p),
            Err(e) => out.errors.push(e.to_string()),
        }
        let ev = AuditEvent::new(gpufence_model::audit::events::RESPOND_EVIDENCE)
            .pid(self.pid)
            .field(
                "evidence",
                out.evidence
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>(),
            )
            .field(
                "incident_file",
                out.incident_file
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
            )
            .field("tree", self.tree_pids.clone());
        self.audit(ev, true);
    }

    /// Step 5: SIGKILL through the pidfds; thaw; check
    /// (`respond_killed`, `respond_survivor`).
    fn kill(&mut self) {
        let targets: Vec<(i32, &OwnedFd)> = self.pinned.iter().map(|(p, f)| (*p, f)).collect();
        for (p, ended) in self.engine.end(&targets, None) {
            match ended {
                Some(_) => self.out.killed.push(p),
                None => self.out.survivors.push(p),
            }
        }
        let ev = AuditEvent::new(gpufence_model::audit::events::RESPOND_KILLED)
            .pid(self.pid)
            .field("signal", "SIGKILL")
            .field("killed", self.out.killed.clone())
            .field("survivors", self.out.survivors.clone());
        self.audit(ev, true);
        if !self.out.survivors.is_empty() {
            let ev = AuditEvent::new(gpufence_model::audit::events::RESPOND_SURVIVOR)
                .pid(self.pid)
                .field("survivors", self.out.survivors.clone());
            self.audit(ev, true);
        }
    }

    /// Step 6: the persistence entries, listed, never deleted
    /// (`respond_persistence`).
    fn list_persistence(&mut self) {
        let ev = AuditEvent::new(gpufence_model::audit::events::RESPOND_PERSISTENCE)
            .pid(self.pid)
            .field(
                "entries",
                self.out
                    .persistence
                    .iter()
                    .map(|e| json!({"kind": e.kind, "path": e.path, "entries": e.entries}))
                    .collect::<Vec<_>>(),
            )
            .field("deleted", false);
        self.audit(ev, true);
    }

    /// Step 7: drains node `name` with a reason naming the process
    /// (`respond_drained`, `respond_drain_failed`).
    fn drain(&mut self, name: &str) {
        let out = &self.out;
        let unread = if out.not_read.is_empty() {
            String::new()
        } else {
            format!(
                "; {} not read whole within {} ms",
                out.not_read.len(),
                self.node.cfg.scan_budget_ms
            )
        };
        let reason = drain::clean_reason(&format!(
            "gpufence: respond: pid {} ({}) of {} killed with its tree ({} process(es)){}{unread}",
            self.pid,
            out.comm.as_deref().unwrap_or("?"),
            out.user
                .clone()
                .or_else(|| out.uid.map(|u| format!("uid {u}")))
                .unwrap_or_else(|| "?".into()),
            out.killed.len(),
            if out.survivors.is_empty() {
                String::new()
            } else {
                format!(", {} survived", out.survivors.len())
            }
        ));
        match drain::drain(self.node, name, &reason) {
            Ok(()) => {
                let ev = AuditEvent::new(gpufence_model::audit::events::RESPOND_DRAINED)
                    .pid(self.pid)
                    .field("node", name.to_string())
                    .field("drain_reason", reason.clone());
                self.audit(ev, false);
                self.out.drained = Some(reason);
            }
            Err(e) => {
                self.out.errors.push(format!("could not drain {name}: {e}"));
                let ev = AuditEvent::new(gpufence_model::audit::events::RESPOND_DRAIN_FAILED)
                    .pid(self.pid)
                    .field("node", name.to_string())
                    .field("error", e.to_string());
                self.audit(ev, false);
            }
        }
    }
}

fn with_uid(ev: AuditEvent, uid: Option<u32>) -> AuditEvent {
    match uid {
        Some(u) => ev.uid(u),
        None => ev,
    }
}

/// Writes the incident file into the evidence directory.
///
/// # Errors
/// [`evidence::write_file`]'s ([`crate::NodeError::Io`]).
fn write_incident(
    node: &Node,
    pid: i32,
    v: &serde_json::Value,
) -> Result<PathBuf, crate::NodeError> {
    evidence::write_file(
        &node.cfg.evidence_dir,
        &format!("incident-pid{pid}"),
        &serde_json::to_vec_pretty(v).unwrap_or_default(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trees_are_descendants_parents_first() {
        let parents: BTreeMap<i32, i32> =
            [(10, 1), (11, 10), (12, 10), (13, 11), (20, 1), (21, 20)].into();
        assert_eq!(tree_of(&parents, 10), vec![10, 11, 12, 13]);
        assert_eq!(tree_of(&parents, 21), vec![21]);
    }

    #[test]
    fn refusals_read_as_one_line() {
        for r in [
            Refusal::Init,
            Refusal::Myself,
            Refusal::KernelThread(2),
            Refusal::NotFound(9),
            Refusal::Ancestor(5),
            Refusal::Thread { tid: 8, tgid: 7 },
            Refusal::Exempt {
                pid: 3,
                cgroup: "system.slice/x.service".into(),
                exemption: "/system.slice/x.service".into(),
            },
        ] {
            let s = r.to_string();
            assert!(!s.contains('\n') && !s.is_empty());
        }
    }
}
