//! What gpufence does with a process that holds a job's GPU outside any
//! grant, in the order incident responders use, at job end (epilog) and at
//! job start (prolog, "clean start"):
//!
//! 1. pin each process's identity: a pidfd taken when it was found
//!    ([`uncovered`]), so no step can hit a recycled pid; and check again
//!    that it still holds the device (a process that let go of it in the
//!    meantime is left alone), at a cost bounded by `scan_budget_ms`
//!    whatever the process owns: the descriptors the scan named first,
//!    then a walk cut at the budget, where "not read whole" is "still
//!    holding" ([`crate::holders::scan::Scanner::recheck`]);
//! 2. freeze it: `cgroup.freeze` when its cgroup holds nothing but such
//!    processes, `SIGSTOP` otherwise — it cannot act while we look;
//! 3. write the evidence file, then an audit line;
//! 4. `SIGTERM`, thaw, wait `term_grace_ms`; `SIGKILL` what is left, wait
//!    `kill_wait_ms` on the pidfds (a process still exiting then, longer:
//!    [`crate::response::engine::EXITING_WAITS`]); check each is gone.
//!
//! Exempt daemons and processes in a cgroup with a live grant for the device
//! are never candidates ([`uncovered`]).
//!
//! Past the scan's budget (`scan_budget_ms`) the GPU is never handed on
//! uncertified ([`over_budget_rule`]): a process not read whole in the
//! job's cgroup, or of the job's user outside every job when the scan had
//! its whole budget (not cut by `epilog_deadline_ms`, [`ScanTime`]), is a
//! candidate; any other is read again alone, and if it still cannot be read whole it
//! is never killed, but the node is not handed on ([`NotRead`]: the Epilog
//! drains, the Prolog fails).
//!
//! The Prolog's `prolog_strays = "refuse"` is the same response in
//! [`Mode::Refuse`]: evidence and the `lingering_process` line for each
//! holder, nothing stopped or signalled.

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use gpufence_cgroup::fence::Fence;
use gpufence_model::audit::{events, AuditEvent};
use gpufence_model::device::DevNum;
use gpufence_model::record::MigSlice;

use crate::holders::cover::covered;
use crate::holders::scan::{self, HeldFd};
use crate::host::deadline::Wait;
use crate::host::gpus::GpuInfo;
use crate::host::procs::uid_of;
use crate::response::engine::{exited, note_stopped, EndedBy, Engine, NoteError, PidFd, Stopped};
use crate::response::evidence::{self, GpuMemory};
use crate::{Node, NodeError};

/// How a response acts on the holders it is given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Pin, freeze, evidence and audit, `SIGTERM`, `SIGKILL`, check: the
    /// Epilog, and the Prolog under `prolog_strays = "kill"`.
    End,
    /// Evidence and the `lingering_process` line only; nothing is stopped
    /// or signalled: the Prolog under `prolog_strays = "refuse"` (the job
    /// does not start, Slurm drains the node).
    Refuse,
}

impl From<gpufence_model::config::StrayPolicy> for Mode {
    fn from(p: gpufence_model::config::StrayPolicy) -> Mode {
        match p {
            gpufence_model::config::StrayPolicy::Kill => Mode::End,
            gpufence_model::config::StrayPolicy::Refuse => Mode::Refuse,
        }
    }
}

/// A step of a response that failed: returned beside its outcome (the
/// other holders are still responded to), and the node is not clean.
#[derive(Debug, thiserror::Error)]
pub enum ResponseError {
    /// A holder is there but cannot be pinned: it cannot be acted on
    /// safely.
    #[error(transparent)]
    Unpinnable(#[from] Unpinnable),
    /// The note of a stopped holder (for a response that is interrupted)
    /// cannot be written.
    #[error(transparent)]
    Note(#[from] NoteError),
    /// A holder's evidence file cannot be written.
    #[error("evidence for pid {pid}: {source}")]
    Evidence {
        /// The holder.
        pid: i32,
        /// Why.
        source: NodeError,
    },
    /// An audit line cannot be written ([`NodeError::Audit`]).
    #[error(transparent)]
    Audit(NodeError),
}

/// A process found on a job's devices without a grant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// Host pid.
    pub pid: i32,
    /// The process, pinned when it was found (`None`: gone by then).
    pub pidfd: Option<PidFd>,
    /// Its cgroup2 path.
    pub cgroup: Option<String>,
    /// The uncovered devices it holds (by descriptor or per NVML).
    pub devices: BTreeSet<DevNum>,
    /// Its descriptors on them.
    pub fds: Vec<HeldFd>,
    /// Its GPU memory per NVML.
    pub gpu_memory: Vec<GpuMemory>,
}

impl Candidate {
    /// What the scan found of it, for its evidence.
    pub fn found(&self) -> evidence::Found {
        evidence::Found {
            fds: self.fds.clone(),
            cgroup: self.cgroup.clone(),
            gpu_memory: self.gpu_memory.clone(),
            unread: None,
        }
    }
}

/// What happened to one candidate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lingering {
    /// The process.
    pub pid: i32,
    /// `comm`, when it could be read.
    pub comm: Option<String>,
    /// Its cgroup.
    pub cgroup: Option<String>,
    /// The devices it held without a grant.
    pub devices: Vec<DevNum>,
    /// The evidence file, when written.
    pub evidence: Option<PathBuf>,
    /// How it was stopped first.
    pub frozen: Option<Stopped>,
    /// The signal that ended it, when it is gone.
    pub ended_by: Option<EndedBy>,
    /// Why it was left alive on purpose, if so.
    pub spared: Option<LeftAlive>,
}

/// Why a holder is left alive on purpose ([`respond`]'s step 1): it gets
/// evidence and its audit lines, and makes the node unclean. The text
/// (`Display`) is the audit lines' `not_killed`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeftAlive {
    /// A system account (uid at or below `protected_uid_max`): a user
    /// could hand a job's descriptor to a root daemon to have it killed.
    SystemAccount {
        /// Its uid.
        uid: u32,
        /// The config's `protected_uid_max`.
        max: u32,
    },
    /// In another user's job ([`other_users_job`]).
    OtherUsersJob {
        /// That job's cgroup directory (`job_<id>`).
        dir: String,
        /// Its uid (0 when unread).
        uid: u32,
    },
}

impl std::fmt::Display for LeftAlive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LeftAlive::SystemAccount { uid, max } => write!(
                f,
                "system account (uid {uid} <= protected_uid_max {max}): not killed"
            ),
            LeftAlive::OtherUsersJob { dir, uid } => write!(
                f,
                "in another user's job ({dir}, uid {uid}): gpufence does not end another user's job for a descriptor handed to it; evidence kept, node drained for an admin"
            ),
        }
    }
}

impl Lingering {
    /// Whether it is gone.
    pub fn gone(&self) -> bool {
        self.ended_by.is_some()
    }
}

/// What [`uncovered`] found: the candidates, and the processes not read
/// whole that gpufence neither ends nor could clear.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Uncovered {
    /// The holders to respond to ([`respond`]).
    pub candidates: Vec<Candidate>,
    /// Processes not read to their end within `scan_budget_ms`, by the
    /// scan nor by their own re-read ([`settle_over_budget`]), that no
    /// exemption covers and gpufence does not end (another user's, a
    /// system account's, one in another job): the GPU is not handed on
    /// ([`NotRead::reason`]: the Epilog drains, the Prolog fails).
    pub not_read: Vec<NotRead>,
}

/// A process that could not be read whole within `scan_budget_ms`, twice
/// (the scan, then a re-read of it alone): it may hold the job's GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotRead {
    /// The process.
    pub pid: i32,
    /// Its real uid, when known.
    pub uid: Option<u32>,
    /// Its cgroup2 path.
    pub cgroup: Option<String>,
    /// Where its re-read stopped.
    pub why: String,
    /// The budget it was read within (`scan_budget_ms`).
    pub budget_ms: u64,
}

impl NotRead {
    /// The words of a drain reason or a Prolog failure: `pid 1234 (uid
    /// 1001, cgroup /x) not read within scan_budget_ms (2000 ms); GPU not
    /// handed on`.
    pub fn reason(&self) -> String {
        format!(
            "pid {} (uid {}, cgroup {}) not read within scan_budget_ms ({} ms); GPU not handed on",
            self.pid,
            self.uid.map_or_else(|| "?".to_string(), |u| u.to_string()),
            self.cgroup
                .as_deref()
                .map(crate::host::cgpath::abs)
                .unwrap_or_else(|| "?".into()),
            self.budget_ms
        )
    }
}

/// What the rule does with a process the scan did not read to its end
/// within `scan_budget_ms` ([`over_budget_rule`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OverBudget {
    /// Taken as holding every device of the job: a candidate, ended as
    /// any holder (frozen, evidence, ended).
    Candidate,
    /// Read again, alone, within `scan_budget_ms`
    /// ([`settle_over_budget`]): read whole, it is judged by what it
    /// holds; not read whole, the GPU is not handed on (never killed).
    ReRead,
}

/// How much of its own budget (`scan_budget_ms`) the scan had: all of
/// it, or less, cut by the Epilog's deadline (`epilog_deadline_ms`,
/// [`crate::host::deadline`]). A cut scan may leave a process unread for
/// no fault of its own (at 0 ms every process with an anonymous inode is
/// "not read whole"), so only a full one may make the job's user's
/// processes outside every job candidates ([`over_budget_rule`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScanTime {
    /// The whole of `scan_budget_ms`.
    Full,
    /// Less than `scan_budget_ms`: the deadline cut it.
    Cut,
}

impl ScanTime {
    /// `Cut` when the scan was `given` less than its `configured` budget.
    pub fn of(given: Duration, configured: Duration) -> ScanTime {
        if given < configured {
            ScanTime::Cut
        } else {
            ScanTime::Full
        }
    }
}

/// When [`settle_over_budget`]'s re-reads must end, and how much time the
/// scan that left the processes unread had ([`ScanTime`]).
#[derive(Clone, Copy, Debug)]
pub struct Settle {
    /// The scan's time: a [`ScanTime::Cut`] scan makes no candidates of
    /// the job's user's processes outside every job (rule 2 is rule 3).
    pub scan: ScanTime,
    /// When every re-read ends; a process met after it is not read.
    pub deadline: Instant,
}

/// The rule for a process of real uid `uid` in `cgroup` that the scan
/// for job `job_id`'s devices (the job runs as `job_uid`) did not read to
/// its end within `scan_budget_ms`:
///
/// 1. in the job's own cgroup (`job_<job_id>`), not a system account's
///    (uid above `protected_uid_max`): a candidate, as the job has ended;
/// 2. of the job's own user, outside every job cgroup (no `job_<n>` nor
///    SLUID in its path), not a system account's: a candidate, the same
///    (a user's process outside every job holds no GPU of right, and the
///    job's user could hand it the job's descriptor) — only when the scan
///    had its whole budget (`scan` is [`ScanTime::Full`]): a scan the
///    Epilog's deadline cut leaves the user's session (systemd --user,
///    tmux, dbus) unread for want of time, and these are read again as
///    rule 3 says;
/// 3. any other (another user's, in another job, a system account's, or
///    of an unknown uid; the job's uid unknown): read again alone
///    ([`OverBudget::ReRead`]), never ended for being unread.
///
/// An exemption that covers the process (an exempt daemon for its own
/// uid) is the caller's to apply first ([`crate::holders::cover`]).
pub fn over_budget_rule(
    cgroup: Option<&str>,
    uid: Option<u32>,
    job_id: u32,
    job_uid: Option<u32>,
    protected_uid_max: u32,
    scan: ScanTime,
) -> OverBudget {
    let Some(uid) = uid.filter(|u| *u > protected_uid_max) else {
        return OverBudget::ReRead;
    };
    let Some(cg) = cgroup else {
        return OverBudget::ReRead;
    };
    let users_outside = scan == ScanTime::Full && job_uid == Some(uid) && outside_every_job(cg);
    if in_job(cg, job_id) || users_outside {
        OverBudget::Candidate
    } else {
        OverBudget::ReRead
    }
}

/// Whether cgroup path `cg` is in no Slurm job cgroup (no component
/// `job_<n>` nor a SLUID, [`crate::host::slurm_cgroup::is_job_dir`]).
fn outside_every_job(cg: &str) -> bool {
    !cg.split('/').any(crate::host::slurm_cgroup::is_job_dir)
}

/// Processes holding any of `devs` — by descriptor, or listed by NVML on a
/// GPU of `gpu_info` — that no grant or exemption covers. `gpu_major` is
/// the major of `/dev/nvidia<minor>` (NVML minors are on it).
///
/// `mig` is the job's MIG slices. A MIG parent GPU is shared with the jobs
/// holding the other slices, so on it only the job's own processes count:
/// per NVML, those on the job's GPU/compute instances; per descriptors,
/// those holding one of the job's slice caps. A process that holds only the
/// shared parent is not this job's to judge (the sweep reports it).
///
/// The descriptor scan has a time budget (`scan_budget_ms`). Past it, the
/// GPU is never handed on uncertified. A process not read to its end
/// within it ([`scan::Scanner::over_budget`]) is judged by
/// [`over_budget_rule`] (`job_uid`: the job's user, slurmd's
/// `SLURM_JOB_UID` or the record's):
///
/// 1. in job `job_id`'s own cgroup, or of the job's user outside every
///    job when the scan had its whole `scan_budget_ms` ([`ScanTime::Full`];
///    the Epilog's deadline may cut it), and not a system account's: a
///    candidate holding all of
///    `devs`, its descriptors saying "not read to its end within
///    scan_budget_ms"; the usual response ends it;
/// 2. any other: covered by an exemption for its uid, nothing; otherwise
///    read again, alone, within a further `scan_budget_ms`
///    ([`settle_over_budget`]): read whole and holding none of `devs`,
///    nothing; holding one, a candidate like any holder (the response's
///    rules for system accounts and other users' jobs apply); still not
///    read whole, it is in [`Uncovered::not_read`], never killed: the
///    Epilog drains the node with a reason naming it and "not read", the
///    Prolog fails. All of them are named in one `scan_over_budget`
///    audit line (with `not_read`: those still unread).
///
/// At most two budgets: the scan's and the re-reads' (one for all).
pub fn uncovered(node: &Node, job_id: u32, job_uid: Option<u32>, sought: &Sought<'_>) -> Uncovered {
    uncovered_except(node, job_id, job_uid, sought, &BTreeSet::new())
}

/// What [`uncovered`] looks for: the job's devices (`devs`; `gpu_major`,
/// the GPUs' major; `mig`, the job's MIG slices, whose parents other jobs
/// share), what covers a holder (`fence`'s live grants, `None`: only
/// exemptions), and what NVML says runs on the job's GPUs (`gpu_info`).
#[derive(Clone, Copy, Debug)]
pub struct Sought<'a> {
    /// The fence, for its live grants.
    pub fence: Option<&'a Fence>,
    /// The job's devices.
    pub devs: &'a BTreeSet<DevNum>,
    /// NVML's processes on the job's GPUs.
    pub gpu_info: &'a [GpuInfo],
    /// The GPUs' major.
    pub gpu_major: u32,
    /// The job's MIG slices.
    pub mig: &'a [MigSlice],
}

/// [`uncovered`], leaving out of the re-reads the processes in
/// `not_read_before`: an earlier look of the same Prolog or Epilog found
/// them not read whole (they are in its [`Uncovered::not_read`] already),
/// so each round does not pay their re-read again.
pub fn uncovered_except(
    node: &Node,
    job_id: u32,
    job_uid: Option<u32>,
    sought: &Sought<'_>,
    not_read_before: &BTreeSet<i32>,
) -> Uncovered {
    let Sought {
        fence,
        devs,
        gpu_info,
        gpu_major,
        mig,
    } = *sought;
    let me = std::process::id() as i32;
    let shared: BTreeSet<DevNum> = mig.iter().map(|s| s.parent).collect();
    let own_caps: BTreeSet<DevNum> = mig
        .iter()
        .flat_map(|s| std::iter::once(s.gi_cap).chain(s.ci_cap))
        .collect();
    let mine_per_nvml = |minor: u32, gi: Option<u32>, ci: Option<u32>| {
        let on_mig = mig.iter().filter(|s| s.gpu == minor).collect::<Vec<_>>();
        on_mig.is_empty()
            || gi.is_none()
            || on_mig
                .iter()
                .any(|s| Some(s.gi) == gi && (s.ci.is_none() || ci.is_none() || s.ci == ci))
    };
    let mut by_pid: BTreeMap<i32, Candidate> = BTreeMap::new();
    let configured = Duration::from_millis(node.cfg.scan_budget_ms);
    let given = node.bound(Wait::ScanBudget, configured);
    let mut scanner = scan::Scanner::with_pins(&node.cfg.bpffs_dir).with_budget(given);
    for h in scanner.holders(devs) {
        let c = by_pid
            .entry(h.pid)
            .or_insert_with(|| new_candidate(node, h.pid));
        c.fds.extend(h.fds.iter().cloned());
        c.devices.extend(h.devices());
    }
    let over: Vec<i32> = scanner
        .over_budget()
        .iter()
        .copied()
        .filter(|p| !not_read_before.contains(p))
        .collect();
    let not_read = if over.is_empty() {
        Vec::new()
    } else {
        let (cands, not_read) = settle_over_budget(
            node,
            job_id,
            job_uid,
            fence,
            devs,
            &over,
            Settle {
                scan: ScanTime::of(given, configured),
                deadline: Instant::now() + node.bound(Wait::ScanBudget, configured),
            },
        );
        for c in cands {
            let e = by_pid
                .entry(c.pid)
                .or_insert_with(|| new_candidate(node, c.pid));
            e.devices.extend(c.devices);
            for f in c.fds {
                if !e.fds.contains(&f) {
                    e.fds.push(f);
                }
            }
        }
        not_read
    };
    for g in gpu_info {
        let dev = DevNum::new(gpu_major, g.minor);
        for p in &g.processes {
            let Ok(pid) = i32::try_from(p.pid) else {
                continue;
            };
            if pid == me
                || pid <= 1
                || !mine_per_nvml(g.minor, p.gpu_instance_id, p.compute_instance_id)
            {
                continue;
            }
            let c = by_pid
                .entry(pid)
                .or_insert_with(|| new_candidate(node, pid));
            c.devices.insert(dev);
            c.gpu_memory.push(GpuMemory {
                minor: g.minor,
                uuid: g.uuid.clone(),
                used_bytes: p.used_memory,
            });
        }
    }
    let candidates = by_pid
        .into_values()
        .filter_map(|mut c| {
            let cg = c.cgroup.clone();
            let uid = uid_of(c.pid);
            c.devices
                .retain(|d| !covered(node, fence, cg.as_deref(), uid, *d));
            c.fds.retain(|f| c.devices.contains(&f.dev));
            let nvml_listed = !c.gpu_memory.is_empty();
            let only_shared = !c.devices.is_empty() && c.devices.iter().all(|d| shared.contains(d));
            let holds_own_cap = c.fds.iter().any(|f| own_caps.contains(&f.dev));
            if only_shared && !holds_own_cap && !nvml_listed {
                return None;
            }
            (!c.devices.is_empty()).then_some(c)
        })
        .collect();
    Uncovered {
        candidates,
        not_read,
    }
}

fn new_candidate(node: &Node, pid: i32) -> Candidate {
    Candidate {
        pid,
        pidfd: PidFd::open(pid),
        cgroup: node.cg.cgroup_of(pid).ok(),
        devices: BTreeSet::new(),
        fds: Vec::new(),
        gpu_memory: Vec::new(),
    }
}

/// The descriptor [`uncovered`] gives a process it takes as holding `dev`
/// without having read it to its end.
fn unread_hold(node: &Node, dev: DevNum) -> HeldFd {
    HeldFd {
        fd: -1,
        path: PathBuf::from(format!(
            "not read to its end within scan_budget_ms ({} ms)",
            node.cfg.scan_budget_ms
        )),
        dev,
        via: scan::Via::Fd,
        tid: None,
        unread: true,
    }
}

/// [`uncovered`]'s answer to the processes `over` the scan for job
/// `job_id`'s devices `devs` did not read to their end
/// ([`over_budget_rule`]): the candidates (the job's own and its user's
/// outside every job, taken as holding all of `devs`; others found
/// holding on a re-read) and those still not read whole. The re-reads
/// (one `/proc` walk of each process alone, [`scan::Scanner::recheck`])
/// all end by `settle.deadline`; a process met after it is not read. A
/// scan the deadline cut (`settle.scan`) makes no candidate of the job's
/// user's processes outside every job: they are read again. A process
/// an exemption covers for every device in `devs` is left alone; one gone
/// meanwhile reads whole, holding nothing. One `scan_over_budget` audit
/// line names those read again (`not_read`: those still unread).
pub fn settle_over_budget(
    node: &Node,
    job_id: u32,
    job_uid: Option<u32>,
    fence: Option<&Fence>,
    devs: &BTreeSet<DevNum>,
    over: &[i32],
    settle: Settle,
) -> (Vec<Candidate>, Vec<NotRead>) {
    let deadline = settle.deadline;
    let mut cands = Vec::new();
    let mut not_read = Vec::new();
    let mut reread: Vec<(i32, Option<String>)> = Vec::new();
    let mut scanner = scan::Scanner::new();
    for &pid in over {
        let cgroup = node.cg.cgroup_of(pid).ok();
        let uid = uid_of(pid);
        match over_budget_rule(
            cgroup.as_deref(),
            uid,
            job_id,
            job_uid,
            node.cfg.protected_uid_max,
            settle.scan,
        ) {
            OverBudget::Candidate => {
                let mut c = new_candidate(node, pid);
                c.devices.extend(devs.iter().copied());
                c.fds.extend(devs.iter().map(|d| unread_hold(node, *d)));
                cands.push(c);
            }
            OverBudget::ReRead => {
                let left: BTreeSet<DevNum> = devs
                    .iter()
                    .copied()
                    .filter(|d| !covered(node, fence, cgroup.as_deref(), uid, *d))
                    .collect();
                if left.is_empty() {
                    continue;
                }
                reread.push((pid, cgroup.clone()));
                match scanner.recheck(pid, &[], &left, deadline) {
                    scan::Recheck::HoldsNone => {}
                    scan::Recheck::Holds(f) => {
                        let mut c = new_candidate(node, pid);
                        c.devices.insert(f.dev);
                        c.fds.push(f);
                        cands.push(c);
                    }
                    scan::Recheck::Unread { why } => not_read.push(NotRead {
                        pid,
                        uid,
                        cgroup,
                        why,
                        budget_ms: node.cfg.scan_budget_ms,
                    }),
                }
            }
        }
    }
    if !reread.is_empty() {
        let _ = node.audit(
            AuditEvent::new(events::SCAN_OVER_BUDGET)
                .job(job_id)
                .field("budget_ms", node.cfg.scan_budget_ms)
                .field("processes", reread.len())
                .field(
                    "pids",
                    reread
                        .iter()
                        .take(OVER_BUDGET_LISTED)
                        .map(|(p, _)| *p)
                        .collect::<Vec<_>>(),
                )
                .field(
                    "cgroups",
                    reread
                        .iter()
                        .take(OVER_BUDGET_LISTED)
                        .map(|(_, c)| {
                            c.as_deref()
                                .map(crate::host::cgpath::abs)
                                .unwrap_or_default()
                        })
                        .collect::<Vec<_>>(),
                )
                .field(
                    "not_read",
                    not_read
                        .iter()
                        .take(OVER_BUDGET_LISTED)
                        .map(|n| n.pid)
                        .collect::<Vec<_>>(),
                ),
        );
    }
    (cands, not_read)
}

/// How many processes a `scan_over_budget` line names (it counts all).
const OVER_BUDGET_LISTED: usize = 20;

/// Whether cgroup path `cg` is in job `job_id`'s cgroup: its first
/// component that names a job (`job_<n>`, Slurm's `job_%u` in
/// `src/plugins/cgroup/v2/cgroup_v2.c`, or a SLUID) is `job_<job_id>`. A
/// `job_<id>` below another job's cgroup (a lookalike a container runtime
/// made in a delegated subtree) is that other job's, as
/// `find_job_cgroup` holds too; a SLUID is never taken for a job id.
fn in_job(cg: &str, job_id: u32) -> bool {
    use crate::host::slurm_cgroup::{is_job_dir, job_dir_id};
    cg.split('/')
        .find(|d| is_job_dir(d))
        .is_some_and(|d| job_dir_id(d) == Some(job_id))
}

/// A holder that is there but cannot be pinned (no pidfd: out of
/// descriptors).
#[derive(Debug, thiserror::Error)]
#[error("pid {pid} holds {devices} but cannot be pinned (pidfd_open: {source})")]
pub struct Unpinnable {
    /// The holder.
    pid: i32,
    /// What it holds, comma-separated.
    devices: String,
    /// Why `pidfd_open` failed.
    source: std::io::Error,
}

/// The pidfd of `c` (taken when it was found) when the process is still
/// there and still holds what made it a candidate: one of its devices by
/// descriptor, or (listed by NVML, or in a registered ring) nothing to
/// look at again. Checked
/// through `/proc/<pid>` and then the pidfd: the pidfd still open
/// afterwards means `/proc/<pid>` was that process when it was read.
/// `Ok(None)`: gone, or let go of the device.
///
/// The look costs what the scan found, not what the process owns
/// ([`scan::Scanner::recheck`]): the descriptors the scan named are
/// looked at first (one `stat` each), then a walk that stops at its first
/// hold or at `deadline` (the response's re-check budget,
/// `scan_budget_ms`); a process not read whole by then is taken as
/// still holding (fail closed: a candidate stays a candidate), so a
/// holder of thousands of private tables costs the response at most the
/// budget, never minutes.
///
/// # Errors
/// [`Unpinnable`] when the process is there but cannot be pinned (no
/// pidfd: out of descriptors): it cannot be acted on safely, and the node
/// is not clean.
fn still_holding(c: &Candidate, deadline: Instant) -> Result<Option<PidFd>, Unpinnable> {
    let fd = match &c.pidfd {
        Some(fd) => fd.clone(),
        None => match PidFd::open(c.pid) {
            Some(fd) => fd,
            None if std::path::Path::new(&format!("/proc/{}", c.pid)).exists() => {
                return Err(Unpinnable {
                    pid: c.pid,
                    devices: c
                        .devices
                        .iter()
                        .map(|d| d.to_string())
                        .collect::<Vec<_>>()
                        .join(","),
                    source: std::io::Error::last_os_error(),
                });
            }
            None => return Ok(None),
        },
    };
    if exited(fd.fd()) {
        return Ok(None);
    }
    // Holds `/proc` cannot show (per NVML; in a registered ring, which
    // only the kernel's iterator reads) are taken as found.
    let proc_shows_all = c.gpu_memory.is_empty()
        && c.fds
            .iter()
            .all(|f| f.via != scan::Via::IoUringRegisteredRing && !f.unread);
    if proc_shows_all {
        let look = scan::Scanner::new().recheck(c.pid, &c.fds, &c.devices, deadline);
        if look == scan::Recheck::HoldsNone || exited(fd.fd()) {
            return Ok(None);
        }
    }
    Ok(Some(fd))
}

/// Whose response it is, one value for each of its steps: the node, the
/// job and its user (`job_uid`: a holder of another uid inside another
/// job's cgroup is spared, [`other_users_job`]), and the phase that
/// responds (`prolog`, `epilog`: in evidence and audit lines).
#[derive(Clone, Copy, Debug)]
pub struct Responder<'a> {
    /// The node.
    pub node: &'a Node,
    /// The job.
    pub job_id: u32,
    /// The job's user, when known.
    pub job_uid: Option<u32>,
    /// `prolog` or `epilog`.
    pub phase: &'a str,
}

/// Responds to `cands` as the module says, for `job` ([`Responder`]),
/// in `mode`, with evidence within `budget` (one per Epilog or Prolog,
/// over all its rounds). `reason` goes into evidence. Failed steps (evidence, audit, notes, a holder that cannot
/// be pinned) are returned beside the outcome, each holder still
/// responded to.
pub fn respond(
    job: &Responder<'_>,
    mode: Mode,
    reason: &str,
    cands: Vec<Candidate>,
    budget: &mut evidence::Budget,
) -> (Vec<Lingering>, Vec<ResponseError>) {
    let Responder {
        node,
        job_id,
        phase,
        ..
    } = *job;
    let mut errors = Vec::new();
    if mode == Mode::Refuse {
        let out = cands
            .iter()
            .map(|c| record(job, reason, c, None, None, budget, &mut errors).0)
            .collect();
        return (out, errors);
    }
    // 1. Pin identities; system accounts are spared.
    let (spared_out, pinned) = pin(job, reason, cands, budget, &mut errors);
    let pids: BTreeSet<i32> = pinned.iter().map(|(c, _)| c.pid).collect();
    // Noted before they are stopped: a response killed from here on
    // (PrologEpilogTimeout) leaves notes the next Prolog, Epilog or sweep
    // acts on ([`finish_interrupted`]), never processes stopped for good.
    let notes: Vec<PathBuf> = pinned
        .iter()
        .filter_map(
            |(c, _)| match note_stopped(node, job_id, c.pid, c.cgroup.as_deref(), false) {
                Ok(p) => p,
                Err(e) => {
                    errors.push(e.into());
                    None
                }
            },
        )
        .collect();

    // 2. Stop: whole cgroups when they hold only candidates, else SIGSTOP.
    let mut engine = Engine::new(node);
    for (c, fd) in &pinned {
        engine.stop(c.pid, fd, c.cgroup.as_deref(), &pids);
    }
    // The notes of holders whose cgroup was frozen whole say so.
    for (c, _) in &pinned {
        if c.cgroup.as_deref().is_some_and(|cg| engine.froze(cg)) {
            if let Err(e) = note_stopped(node, job_id, c.pid, c.cgroup.as_deref(), true) {
                errors.push(e.into());
            }
        }
    }
    crate::crashpoint::reached(crate::crashpoint::RESPOND_FROZEN);

    // 3. Evidence, then the audit line.
    let out: Vec<(Lingering, Option<u32>)> = pinned
        .iter()
        .map(|(c, _)| {
            let how = engine.how(c.pid);
            record(job, reason, c, how, None, budget, &mut errors)
        })
        .collect();

    // 4. SIGTERM, thaw, grace; SIGKILL, wait; check.
    let targets: Vec<(i32, &OwnedFd)> = pinned.iter().map(|(c, f)| (c.pid, &**f)).collect();
    let ended = engine.end(
        &targets,
        Some(Duration::from_millis(node.cfg.term_grace_ms)),
    );
    for n in notes {
        let _ = std::fs::remove_file(n);
    }
    let mut result = spared_out;
    for (mut l, uid) in out {
        l.ended_by = ended.get(&l.pid).copied().flatten();
        let name = if l.gone() {
            events::PROCESS_KILLED
        } else {
            events::SURVIVOR
        };
        if let Err(e) = node.audit(audit_line(name, job_id, phase, &l, uid)) {
            errors.push(ResponseError::Audit(e));
        }
        result.push(l);
    }
    (result, errors)
}

/// Step 3 for one holder `c`, in either [`Mode`]: its evidence (`frozen`:
/// how it was stopped), then its `lingering_process` line (with
/// `not_killed` when `spared` says why it is left alive). Returns it and
/// its uid.
fn record(
    job: &Responder<'_>,
    reason: &str,
    c: &Candidate,
    frozen: Option<Stopped>,
    spared: Option<LeftAlive>,
    budget: &mut evidence::Budget,
    errors: &mut Vec<ResponseError>,
) -> (Lingering, Option<u32>) {
    let Responder {
        node,
        job_id,
        phase,
        ..
    } = *job;
    let ev = evidence::collect(c.pid, job_id, reason, c.found(), frozen, budget);
    let mut l = Lingering {
        pid: c.pid,
        comm: ev.comm.clone(),
        cgroup: c.cgroup.clone(),
        devices: c.devices.iter().copied().collect(),
        evidence: None,
        frozen,
        ended_by: None,
        spared,
    };
    match evidence::write_within(&node.cfg.evidence_dir, &ev, budget) {
        Ok(p) => l.evidence = p,
        Err(source) => errors.push(ResponseError::Evidence { pid: c.pid, source }),
    }
    let mut line = audit_line(events::LINGERING_PROCESS, job_id, phase, &l, ev.uid);
    if let Some(why) = &l.spared {
        line = line.field("not_killed", why.to_string());
    }
    if let Err(e) = node.audit(line) {
        errors.push(ResponseError::Audit(e));
    }
    (l, ev.uid)
}

/// Step 1 of [`respond`]: pins each candidate still holding what made it
/// one ([`still_holding`], all of them together within `scan_budget_ms`).
/// System accounts are kept alive: a user could
/// hand a job's descriptor to a root daemon (dbus keeps passed
/// descriptors) to have it killed. They get evidence, their audit lines
/// (`lingering_process`, `survivor` with `not_killed`) and make the node
/// unclean. Returns the spared and the pinned.
fn pin(
    job: &Responder<'_>,
    reason: &str,
    cands: Vec<Candidate>,
    budget: &mut evidence::Budget,
    errors: &mut Vec<ResponseError>,
) -> (Vec<Lingering>, Vec<(Candidate, PidFd)>) {
    let Responder {
        node,
        job_id,
        job_uid,
        phase,
    } = *job;
    let mut spared_out = Vec::new();
    let mut pinned: Vec<(Candidate, PidFd)> = Vec::new();
    // One re-check budget for every candidate of this round: past it, a
    // candidate is taken as still holding without a look.
    let deadline = Instant::now()
        + node.bound(
            Wait::ScanBudget,
            Duration::from_millis(node.cfg.scan_budget_ms),
        );
    for c in cands {
        let uid = uid_of(c.pid);
        let spare = if uid.is_some_and(|u| u <= node.cfg.protected_uid_max) {
            Some(LeftAlive::SystemAccount {
                uid: uid.unwrap_or(0),
                max: node.cfg.protected_uid_max,
            })
        } else {
            other_users_job(c.cgroup.as_deref(), job_id, job_uid, uid).map(|dir| {
                LeftAlive::OtherUsersJob {
                    dir,
                    uid: uid.unwrap_or(0),
                }
            })
        };
        if let Some(why) = spare {
            let (l, uid) = record(job, reason, &c, None, Some(why.clone()), budget, errors);
            if let Err(e) = node.audit(
                audit_line(events::SURVIVOR, job_id, phase, &l, uid)
                    .field("not_killed", why.to_string()),
            ) {
                errors.push(ResponseError::Audit(e));
            }
            spared_out.push(l);
            continue;
        }
        match still_holding(&c, deadline) {
            Ok(Some(fd)) => pinned.push((c, fd)),
            Ok(None) => {}
            Err(e) => errors.push(e.into()),
        }
    }
    (spared_out, pinned)
}

/// The Slurm job cgroup directory (`job_<id>` of another job, or a SLUID:
/// 26.05 names job cgroups by it) that `cgroup` is in, when the holder's
/// real uid `uid` is not the ending job's `job_uid`: a process of another
/// user's job. A user can hand their job's descriptor to any process that
/// accepts descriptors (NCCL's abstract unix sockets need no permission);
/// ending the receiver would let one user end another's job at will, so
/// such a holder is spared like a system account (evidence, survivor, the
/// node drained for an admin). Outside any job a holder is ended as
/// always: no job holds a GPU there. `None` when the job's uid or the
/// holder's is unknown, or the uids are the same.
pub fn other_users_job(
    cgroup: Option<&str>,
    job_id: u32,
    job_uid: Option<u32>,
    uid: Option<u32>,
) -> Option<String> {
    let (Some(job_uid), Some(uid), Some(cg)) = (job_uid, uid, cgroup) else {
        return None;
    };
    if uid == job_uid {
        return None;
    }
    cg.split('/')
        .find(|d| {
            crate::host::slurm_cgroup::job_dir_id(d).is_some_and(|n| n != job_id)
                || crate::host::slurm_cgroup::is_sluid(d)
        })
        .map(str::to_string)
}

fn audit_line(name: &str, job_id: u32, phase: &str, l: &Lingering, uid: Option<u32>) -> AuditEvent {
    let mut a = AuditEvent::new(name)
        .job(job_id)
        .pid(l.pid)
        .devices(l.devices.iter())
        .field("phase", phase)
        .field(
            "cgroup",
            l.cgroup
                .as_deref()
                .map(crate::host::cgpath::abs)
                .unwrap_or_default(),
        )
        .field("comm", l.comm.clone().unwrap_or_default());
    if let Some(u) = uid {
        a = a.uid(u);
    }
    if let Some(p) = &l.evidence {
        a = a.field("evidence", p.display().to_string());
    }
    if let Some(f) = l.frozen {
        a = a.field("frozen", f.as_str());
    }
    if let Some(s) = l.ended_by {
        a = a.field("ended_by", s.as_str());
    }
    a
}

#[cfg(test)]
mod error_tests {
    use super::{LeftAlive, ResponseError};
    use crate::NodeError;

    /// Why a holder is left alive reads as the audit lines' `not_killed`
    /// always did.
    #[test]
    fn left_alive_reads_as_before() {
        assert_eq!(
            LeftAlive::SystemAccount { uid: 0, max: 999 }.to_string(),
            "system account (uid 0 <= protected_uid_max 999): not killed"
        );
        assert!(LeftAlive::OtherUsersJob {
            dir: "job_9".into(),
            uid: 23456
        }
        .to_string()
        .starts_with("in another user's job (job_9, uid 23456): gpufence does not end"));
    }

    /// A response's audit failure is the Prolog's [`NodeError::Audit`],
    /// message and all; any other failed step is [`NodeError::Response`]
    /// with the step's own message.
    #[test]
    fn response_errors_become_node_errors_as_they_read() {
        let audit = ResponseError::Audit(NodeError::Audit(std::io::Error::other("disk full")));
        let text = audit.to_string();
        let e = NodeError::from(audit);
        assert!(matches!(e, NodeError::Audit(_)), "{e:?}");
        assert_eq!(e.to_string(), text);
        let ev = ResponseError::Evidence {
            pid: 42,
            source: NodeError::Mig("x".into()),
        };
        assert_eq!(ev.to_string(), "evidence for pid 42: MIG: x");
        let e = NodeError::from(ev);
        assert!(matches!(e, NodeError::Response(_)), "{e:?}");
        assert_eq!(e.to_string(), "evidence for pid 42: MIG: x");
    }
}

#[cfg(test)]
mod in_job_tests {
    use super::in_job;

    /// The job's own cgroup and below; never a lookalike inside another
    /// job's, one below a SLUID, another job's, or a name that only
    /// starts like one.
    #[test]
    fn in_job_is_anchored_at_the_first_job_dir() {
        assert!(in_job(
            "system.slice/slurmstepd.scope/job_42/step_0/user/task_0",
            42
        ));
        assert!(in_job("gpufence-test/job_42", 42));
        assert!(!in_job("system.slice/slurmstepd.scope/job_43/step_0", 42));
        assert!(!in_job(
            "system.slice/slurmstepd.scope/job_7/step_0/user/task_0/job_42/step_0",
            42
        ));
        assert!(!in_job(
            "system.slice/slurmstepd.scope/s7C5M8ST6RSJ00/job_42",
            42
        ));
        assert!(!in_job("user.slice/user-1000.slice/session-1.scope", 42));
        assert!(!in_job("system.slice/job_42x", 42));
    }
}

#[cfg(test)]
mod over_budget_tests {
    use super::{over_budget_rule, NotRead, OverBudget, ScanTime};

    const MAX: u32 = 999;

    /// The rule past the budget: the job's own cgroup and the job's user
    /// outside every job are candidates; everything else (another user
    /// outside jobs, another job's cgroup, a SLUID's, a system account,
    /// an unknown uid or cgroup, the job's uid unknown) is read again,
    /// never ended for being unread.
    #[test]
    fn over_budget_processes_are_ended_or_read_again_by_the_rule() {
        let job = "system.slice/slurmstepd.scope/job_42/step_0/user/task_0";
        let other_job = "system.slice/slurmstepd.scope/job_43/step_0/user/task_0";
        let sluid = "system.slice/slurmstepd.scope/s7C5M8ST6RSJ00/step_0";
        let session = "user.slice/user-1001.slice/session-3.scope";
        let rule = |cg, uid, job_uid| over_budget_rule(cg, uid, 42, job_uid, MAX, ScanTime::Full);
        // 1. The job's own cgroup: its user's, or another non-system uid.
        assert_eq!(
            rule(Some(job), Some(1001), Some(1001)),
            OverBudget::Candidate
        );
        assert_eq!(
            rule(Some(job), Some(1002), Some(1001)),
            OverBudget::Candidate
        );
        assert_eq!(rule(Some(job), Some(1001), None), OverBudget::Candidate);
        // 2. The job's user outside every job.
        assert_eq!(
            rule(Some(session), Some(1001), Some(1001)),
            OverBudget::Candidate
        );
        assert_eq!(
            rule(Some(""), Some(1001), Some(1001)),
            OverBudget::Candidate
        );
        // 3. Everything else.
        for (cg, uid, job_uid, who) in [
            (
                Some(session),
                Some(1002),
                Some(1001),
                "another user outside jobs",
            ),
            (Some(session), Some(1001), None, "the job's uid unknown"),
            (
                Some(other_job),
                Some(1001),
                Some(1001),
                "the user's other job",
            ),
            (
                Some(other_job),
                Some(1002),
                Some(1001),
                "another user's job",
            ),
            (
                Some(sluid),
                Some(1001),
                Some(1001),
                "a job named by a SLUID",
            ),
            (
                Some(job),
                Some(0),
                Some(1001),
                "root in the job (slurmstepd)",
            ),
            (
                Some(job),
                Some(MAX),
                Some(1001),
                "a system account in the job",
            ),
            (
                Some(session),
                Some(MAX),
                Some(MAX),
                "a system account's own job uid",
            ),
            (Some(session), None, Some(1001), "gone: uid unknown"),
            (None, Some(1001), Some(1001), "cgroup unknown"),
            (
                Some("system.slice/job_42x"),
                Some(1002),
                Some(1001),
                "a lookalike name, another user",
            ),
        ] {
            assert_eq!(rule(cg, uid, job_uid), OverBudget::ReRead, "{who}");
        }
    }

    /// A scan the Epilog's deadline cut: the job's own cgroup is still a
    /// candidate, but the job's user outside every job (systemd --user,
    /// tmux, dbus, left unread for want of time) is only read again,
    /// never ended for being unread.
    #[test]
    fn a_cut_scan_makes_no_candidate_of_the_users_processes_outside_jobs() {
        let job = "system.slice/slurmstepd.scope/job_42/step_0/user/task_0";
        let session = "user.slice/user-1001.slice/user@1001.service/init.scope";
        let rule = |cg, scan| over_budget_rule(Some(cg), Some(1001), 42, Some(1001), MAX, scan);
        assert_eq!(rule(job, ScanTime::Cut), OverBudget::Candidate);
        assert_eq!(rule(session, ScanTime::Cut), OverBudget::ReRead);
        assert_eq!(rule(session, ScanTime::Full), OverBudget::Candidate);
        assert_eq!(rule("", ScanTime::Cut), OverBudget::ReRead);
    }

    /// Only less than the configured budget is a cut.
    #[test]
    fn a_scan_is_cut_only_when_given_less_than_its_budget() {
        let ms = std::time::Duration::from_millis;
        assert_eq!(ScanTime::of(ms(2000), ms(2000)), ScanTime::Full);
        assert_eq!(ScanTime::of(ms(0), ms(0)), ScanTime::Full);
        assert_eq!(ScanTime::of(ms(1999), ms(2000)), ScanTime::Cut);
        assert_eq!(ScanTime::of(ms(0), ms(2000)), ScanTime::Cut);
    }

    /// The reason names the pid, its uid and cgroup, the budget and "not
    /// read"; unknowns read `?`.
    #[test]
    fn a_not_read_reason_names_the_process() {
        let n = NotRead {
            pid: 1234,
            uid: Some(1001),
            cgroup: Some("user.slice/user-1001.slice".into()),
            why: "threads read up to the 7th".into(),
            budget_ms: 5,
        };
        assert_eq!(
            n.reason(),
            "pid 1234 (uid 1001, cgroup /user.slice/user-1001.slice) not read within scan_budget_ms (5 ms); GPU not handed on"
        );
        let n = NotRead {
            uid: None,
            cgroup: None,
            ..n
        };
        assert!(n
            .reason()
            .starts_with("pid 1234 (uid ?, cgroup ?) not read"));
    }
}
