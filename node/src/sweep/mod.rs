//! `gpufence sweep`: a node health check that looks for what the fence
//! cannot prevent on its own, cheap enough to run every minute (Slurm's
//! `HealthCheckProgram`, NHC, cron) on a node with 10,000 processes.
//!
//! One walk of `/proc`
//! ([`Scanner::process_fds`](crate::holders::scan::Scanner::process_fds):
//! each descriptor is `stat`ed once, for device holds and socket inodes
//! alike; threads sharing a table are walked once) and one read of each network namespace's TCP
//! tables find:
//!
//! | kind | severity | what |
//! | --- | --- | --- |
//! | `unfenced_gpu_holder` | critical | a process holding an NVIDIA device (descriptor, mapping, io_uring file, or per NVML) that no grant or exemption covers |
//! | `audit_gpu_holder` | low | the same while the attached fence runs in audit mode: what the enforcing fence would deny (a roll-out: `gpufence denials --by-cgroup` suggests the exemptions); below the default `sweep_fail_severity`, so `--drain` leaves the node alone |
//! | `not_read_whole` | critical | a process outside every job cgroup that the `/proc` walk (the fallback where the kernel's iterators cannot run) did not read whole within `scan_budget_ms`, and that no exemption covers: it may hold a GPU outside every grant (medium inside a job cgroup, whose Epilog judges it); never "clean" |
//! | `fence_not_attached` | critical | the fence's link is missing, detached or attached elsewhere |
//! | `fence_not_enforcing` | high | the attached program is in audit mode (allows everything) while the config says enforce, or is another version's |
//! | `unprotected_major` | critical | an NVIDIA major the node has (`/proc/devices` or `[majors]`) that the fence's majors map lacks (driver reloaded) |
//! | `mining_cmdline` | critical | a `stratum+tcp://` / `stratum+ssl://` (`+tls`, `stratum2+tcp`) argument in a command line |
//! | `mining_connection` | high | a TCP connection to a `mining_ports` port |
//! | `gpu_busy_without_grant` | high | a GPU with no live grant on it that NVML lists a process on that no exemption covers; with no process at all, only utilisation or memory above its idle level, at `busy_without_process_severity` (default high); a GPU whose only processes are exempt daemons (`dcgmi diag` through nv-hostengine) is not reported; low in audit mode |
//! | `unauthenticated_notebook` | high | a wildcard listener whose command line disables its token or password (Jupyter, code-server) |
//! | `persistence_cron` | medium | crontab entries of a user above `protected_uid_max` |
//! | `persistence_systemd` | medium | a unit, timer, drop-in or `.wants` link that appeared or changed since the baseline |
//! | `exemption_missing` | medium | a configured exempt cgroup exists but the fence does not hold it (its service restarted since the exemptions were written; `gpufence fence watch` puts it back) |
//! | `mps_foreign_process` | critical | a process whose real uid is not the daemon's user's (root's included: the daemon runs as its user) in one of gpufence's MPS daemon cgroups (granted the daemon's GPU): the next MPS Prolog or Epilog ends it |
//! | `exec_leftover` | medium | a leaf of gpufence's exempt exec cgroup holds processes whose gpufence command (`exec`, a Prolog or Epilog stepping out, `slurmd -G`) is gone: exempt from the fence |
//! | `system_uid_range` | medium | `protected_uid_max` reaches `UID_MIN` of login.defs, or login accounts have uids at or below it: they would be taken for system accounts (their jobs are refused) |
//! | `check_failed` | medium | a check could not run (NVML error, unreadable maps, corrupt state): the node cannot be called clean |
//! | `denied_open` | low | new denial records since the last sweep (the fence held; someone tried) |
//! | `wildcard_listener` | low | a TCP listener on 0.0.0.0 or :: owned by a user above `protected_uid_max`, unless every owner runs one of `slurm_listeners` |
//! | `stale_grant` | low | a grant whose cgroup no longer exists: revoked by the sweep (high when the revocation failed); or MPS registrations of jobs with no record and no Prolog running: removed, and a daemon no job is left registered with stopped (high when stopping it failed) |
//! | `stale_major` | low | a major the fence protects that the node no longer has |
//!
//! Nothing is probed over the network. `--cgroup` limits the process-based
//! checks (holders, sockets, command lines) to one cgroup subtree.
//!
//! State under `state_dir/sweep/` (one sweep at a time, under `flock`):
//! `denials.json` (what the last sweep saw, so only new denials are
//! reported, and the running total exported as a counter) and
//! `systemd-baseline.json` (each file's `lstat`: owner, mode, size, inode,
//! mtime, ctime, link target; the first sweep records it and reports
//! nothing for it; later sweeps report every file that is new or different
//! until an admin accepts the change by removing the file, or restores the
//! unit). Users' files are only read for evidence, and then only regular
//! files, opened without following links or blocking on FIFOs, 64 KiB at
//! most, for at most 100 files a sweep.
//!
//! With `resume_when_clean`, a sweep also resumes a node gpufence itself
//! drained once this sweep found the cause gone, and drains a flapping one
//! again ([`heal`]; records in `state_dir/drain/`).
//!
//! Output ([`Finding`], one JSON object per line with `--json`):
//!
//! ```json
//! {"kind":"mining_connection","severity":"high","pid":4242,"uid":1001,
//!  "user":"alice","cgroup":"/user.slice/user-1001.slice/session-7.scope",
//!  "comm":"xmrig","summary":"TCP connection to 10.1.2.3:3333 (a mining-pool port) from ...",
//!  "evidence":{"remote":"10.1.2.3:3333","local":"...","state":"Established",
//!              "inode":123,"netns":4026531840,"pids":[4242],"cmdline":["xmrig","..."]},
//!  "action":"..."}
//! ```
//!
//! `pid`, `uid`, `user`, `cgroup`, `comm` and `action` appear where they
//! apply; `evidence` is kind specific.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use gpufence_cgroup::fence::Fence;
use gpufence_model::device::DevNum;

use crate::host::users::Users;
use crate::{is_under, Node};

mod accounts;
mod cmdline;
mod fence;
mod heal;
mod holders;
mod output;
mod persistence;
mod procs;
mod shm;
mod state;

pub use cmdline::{auth_disabled, stratum_urls};
pub use heal::{heal, why_not_clean, Healed, KEEP_DRAINED};
pub use output::{drain_reason, execute, prometheus, threshold, SweepOutcome, SweepRequest};
use procs::{walk_proc, ProcMeta, Procs};
pub use state::baseline_path;
use state::{lock, valid_cursor};

/// Why a sweep could not run, or could not keep its state
/// (`state_dir/sweep`). [`sweep`] returns the first two; the others land in
/// [`SweepReport::errors`] (or a [`Kind::CheckFailed`] finding) as text.
#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    /// `--cursor` is not 1 to 64 letters, digits, `_` or `-`.
    #[error("--cursor {0:?}: 1 to 64 letters, digits, '_' or '-'")]
    BadCursor(String),
    /// `--cgroup` names no cgroup (relative, as given without its slashes).
    #[error("--cgroup /{cgroup}: no such cgroup under {}", mount.display())]
    NoSuchCgroup {
        /// The cgroup, relative to the mount.
        cgroup: String,
        /// The cgroup2 mount.
        mount: PathBuf,
    },
    /// A state file (a baseline, a denial cursor) is not the JSON it should be.
    #[error("{}: corrupt: {source}", path.display())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Why.
        source: serde_json::Error,
    },
    /// A state file or directory (or the lock) cannot be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Another sweep kept the lock (`state_dir/sweep/lock`) for 30 s.
    #[error("another sweep has held {} for 30 s", .0.display())]
    Locked(PathBuf),
}

/// A severity that is none of `info`, `low`, `medium`, `high`, `critical`
/// (any case), as `--fail-on` or `sweep_fail_severity` gave it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a severity (info, low, medium, high, critical)")]
pub struct SeverityError(pub String);

/// How bad a finding is. Ordered: `Info < Low < Medium < High < Critical`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// Worth knowing.
    Info,
    /// Worth a look; nothing to fix on the node.
    Low,
    /// An admin should act.
    Medium,
    /// Likely abuse or exposure.
    High,
    /// The fence's promise is broken on this node now.
    Critical,
}

impl Severity {
    /// Its name.
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Info => "info",
            Severity::Low => "low",
            Severity::Medium => "medium",
            Severity::High => "high",
            Severity::Critical => "critical",
        }
    }
}

impl fmt::Display for Severity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Severity {
    type Err = SeverityError;
    fn from_str(s: &str) -> Result<Self, SeverityError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "info" => Ok(Severity::Info),
            "low" => Ok(Severity::Low),
            "medium" => Ok(Severity::Medium),
            "high" => Ok(Severity::High),
            "critical" => Ok(Severity::Critical),
            _ => Err(SeverityError(s.to_string())),
        }
    }
}

/// What a finding is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A process holds an NVIDIA device outside every grant and exemption.
    UnfencedGpuHolder,
    /// The same while the attached fence runs in audit mode: what the
    /// enforcing fence would deny.
    AuditGpuHolder,
    /// The fence is not attached at `cgroup_root`.
    FenceNotAttached,
    /// An NVIDIA major the node has is not in the fence's map.
    UnprotectedMajor,
    /// The attached program is not the one the config asks for: audit mode
    /// (it allows everything) on an enforcing node, or another version's.
    FenceNotEnforcing,
    /// A stratum URL in a command line.
    MiningCmdline,
    /// A TCP connection to a mining-pool port.
    MiningConnection,
    /// A GPU in use with no live grant on it.
    GpuBusyWithoutGrant,
    /// A notebook or dashboard server on a wildcard address with its
    /// token or password disabled.
    UnauthenticatedNotebook,
    /// Crontab entries of a non-system user.
    PersistenceCron,
    /// A systemd unit or timer new or changed since the baseline.
    PersistenceSystemd,
    /// A check that could not run.
    CheckFailed,
    /// New denial records.
    DeniedOpen,
    /// A user's listener on a wildcard address.
    WildcardListener,
    /// A grant whose cgroup is gone (revoked by the sweep).
    StaleGrant,
    /// A protected major the node no longer has.
    StaleMajor,
    /// A user's file in the shared-memory directory that no process holds.
    ShmLeftover,
    /// `protected_uid_max` reaches `UID_MIN`, or login accounts sit at or
    /// below it ([`crate::host::accounts::range_warnings`]).
    SystemUidRange,
    /// A configured exempt cgroup exists but the fence does not hold it
    /// (its service restarted since the exemptions were written).
    ExemptionMissing,
    /// A leaf of gpufence's exempt exec cgroup holds processes whose
    /// gpufence command is gone.
    ExecLeftover,
    /// A process of a foreign uid in one of gpufence's MPS daemon cgroups
    /// ([`crate::host::mps_cgroups::is_foreign`]).
    MpsForeignProcess,
    /// A process the `/proc` walk did not read whole within
    /// `scan_budget_ms`: it may hold a GPU.
    NotReadWhole,
}

impl Kind {
    /// Every kind, in severity order (for the metrics, one series each).
    pub const ALL: [Kind; 22] = [
        Kind::UnfencedGpuHolder,
        Kind::MpsForeignProcess,
        Kind::NotReadWhole,
        Kind::FenceNotAttached,
        Kind::UnprotectedMajor,
        Kind::FenceNotEnforcing,
        Kind::MiningCmdline,
        Kind::MiningConnection,
        Kind::GpuBusyWithoutGrant,
        Kind::UnauthenticatedNotebook,
        Kind::PersistenceCron,
        Kind::PersistenceSystemd,
        Kind::CheckFailed,
        Kind::DeniedOpen,
        Kind::WildcardListener,
        Kind::StaleGrant,
        Kind::StaleMajor,
        Kind::ShmLeftover,
        Kind::SystemUidRange,
        Kind::ExemptionMissing,
        Kind::ExecLeftover,
        Kind::AuditGpuHolder,
    ];

    /// Its name (as in JSON and metrics).
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::UnfencedGpuHolder => "unfenced_gpu_holder",
            Kind::AuditGpuHolder => "audit_gpu_holder",
            Kind::FenceNotAttached => "fence_not_attached",
            Kind::UnprotectedMajor => "unprotected_major",
            Kind::FenceNotEnforcing => "fence_not_enforcing",
            Kind::MiningCmdline => "mining_cmdline",
            Kind::MiningConnection => "mining_connection",
            Kind::GpuBusyWithoutGrant => "gpu_busy_without_grant",
            Kind::UnauthenticatedNotebook => "unauthenticated_notebook",
            Kind::PersistenceCron => "persistence_cron",
            Kind::PersistenceSystemd => "persistence_systemd",
            Kind::CheckFailed => "check_failed",
            Kind::DeniedOpen => "denied_open",
            Kind::WildcardListener => "wildcard_listener",
            Kind::StaleGrant => "stale_grant",
            Kind::StaleMajor => "stale_major",
            Kind::ShmLeftover => "shm_leftover",
            Kind::SystemUidRange => "system_uid_range",
            Kind::ExemptionMissing => "exemption_missing",
            Kind::ExecLeftover => "exec_leftover",
            Kind::MpsForeignProcess => "mps_foreign_process",
            Kind::NotReadWhole => "not_read_whole",
        }
    }

    /// Its usual severity (see the module's table).
    pub fn severity(self) -> Severity {
        match self {
            Kind::UnfencedGpuHolder
            | Kind::NotReadWhole
            | Kind::FenceNotAttached
            | Kind::UnprotectedMajor
            | Kind::MiningCmdline
            | Kind::MpsForeignProcess => Severity::Critical,
            Kind::MiningConnection
            | Kind::GpuBusyWithoutGrant
            | Kind::UnauthenticatedNotebook
            | Kind::FenceNotEnforcing => Severity::High,
            Kind::PersistenceCron
            | Kind::PersistenceSystemd
            | Kind::CheckFailed
            | Kind::SystemUidRange
            | Kind::ExemptionMissing
            | Kind::ExecLeftover => Severity::Medium,
            Kind::DeniedOpen
            | Kind::WildcardListener
            | Kind::StaleGrant
            | Kind::StaleMajor
            | Kind::ShmLeftover
            | Kind::AuditGpuHolder => Severity::Low,
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One finding: what, how bad, who, and the evidence that triggered it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Finding {
    /// What.
    pub kind: Kind,
    /// How bad.
    pub severity: Severity,
    /// The process, where one applies.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pid: Option<i32>,
    /// Its (real) uid, or the uid the finding is about.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// That uid's name, from `passwd_file` or NSS ([`Users`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// The cgroup (`/`-prefixed, relative to the cgroup2 mount).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
    /// The process's command name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub comm: Option<String>,
    /// One line for people.
    pub summary: String,
    /// What triggered it (kind specific).
    pub evidence: Value,
    /// What the sweep did about it, if anything.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub action: Option<String>,
}

impl Finding {
    fn new(kind: Kind, summary: impl Into<String>, evidence: Value) -> Self {
        Finding {
            kind,
            severity: kind.severity(),
            pid: None,
            uid: None,
            user: None,
            cgroup: None,
            comm: None,
            summary: summary.into(),
            evidence,
            action: None,
        }
    }

    /// The same finding at another severity than its kind's usual one.
    fn severity(mut self, s: Severity) -> Self {
        self.severity = s;
        self
    }

    fn who(mut self, p: &ProcMeta) -> Self {
        self.pid = Some(p.pid);
        self.uid = p.uid;
        self.user = p.user.clone();
        self.cgroup = p.cgroup.as_deref().map(crate::host::cgpath::abs);
        self.comm = p.comm.clone();
        self
    }

    /// The finding as one line of text:
    /// `SEVERITY KIND [pid=.. uid=..(user) cgroup=.. comm=..]: SUMMARY [action: ..]`.
    pub fn line(&self) -> String {
        let mut s = format!("{} {}", self.severity, self.kind);
        if let Some(p) = self.pid {
            s.push_str(&format!(" pid={p}"));
        }
        match (self.uid, &self.user) {
            (Some(u), Some(n)) => s.push_str(&format!(" uid={u}({n})")),
            (Some(u), None) => s.push_str(&format!(" uid={u}")),
            (None, Some(n)) => s.push_str(&format!(" user={n}")),
            _ => {}
        }
        if let Some(c) = &self.cgroup {
            s.push_str(&format!(" cgroup={c}"));
        }
        if let Some(c) = &self.comm {
            s.push_str(&format!(" comm={c}"));
        }
        s.push_str(": ");
        s.push_str(&self.summary);
        if let Some(a) = &self.action {
            s.push_str(&format!(" [action: {a}]"));
        }
        gpufence_model::text::printable(&s)
    }
}

// ---------------------------------------------------------------------------
// Command lines.

// ---------------------------------------------------------------------------
// The process walk.

// ---------------------------------------------------------------------------
// State.

// ---------------------------------------------------------------------------
// The sweep.

/// What to sweep.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Limit the process-based checks to this cgroup subtree (relative to
    /// the cgroup2 mount); `None`: every process.
    pub cgroup: Option<String>,
    /// Whose record of reported denials to use: `None` the node's shared
    /// one (`sweep/denials.json`: each denial is reported by the first sweep
    /// that sees it), `Some(name)` a consumer's own
    /// (`sweep/denials-<name>.json`), so a timer and a health check each
    /// report every denial once. Names are 1 to 64 of `[A-Za-z0-9_-]`.
    pub cursor: Option<String>,
    /// Walk `/proc` only, without trying the BPF iterators first
    /// ([`Scanner::proc_walk`](crate::holders::scan::Scanner::proc_walk)):
    /// the benchmark's side-by-side, and tests of the fallback.
    pub proc_walk: bool,
}

/// What a sweep found, and the numbers it exports.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SweepReport {
    /// The findings, most severe first.
    pub findings: Vec<Finding>,
    /// The fence is attached at `cgroup_root`.
    pub fence_installed: bool,
    /// Live grant entries (cgroup, device) after stale ones were collected.
    pub grants: usize,
    /// Denied opens counted by sweeps since `state_dir` was created.
    pub denials_total: u64,
    /// Processes walked.
    pub processes: usize,
    /// How long it took.
    pub duration_seconds: f64,
    /// Processes with an io_uring ring whose files were not read whole
    /// (each also a note): they may hold a GPU, so they keep a gpufence
    /// drain (`resume_when_clean`, [`why_not_clean`]).
    pub unread_rings: usize,
    /// Things worth a line that are not findings (baseline recorded, no NVML).
    pub notes: Vec<String>,
    /// The sweep could not do part of its job (state not writable).
    pub errors: Vec<String>,
}

impl SweepReport {
    /// The findings at or above `threshold`.
    pub fn failing(&self, threshold: Severity) -> Vec<&Finding> {
        self.findings
            .iter()
            .filter(|f| f.severity >= threshold)
            .collect()
    }

    /// How many findings of each kind (every kind, 0 when not seen).
    pub fn counts(&self) -> BTreeMap<Kind, usize> {
        let mut m: BTreeMap<Kind, usize> = Kind::ALL.iter().map(|k| (*k, 0)).collect();
        for f in &self.findings {
            *m.entry(f.kind).or_default() += 1;
        }
        m
    }
}

fn dev_list(devs: &BTreeSet<DevNum>) -> String {
    devs.iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Whether a configured exemption covers a process of real uid `uid` in
/// cgroup `cg`: an entry `cg` is in or under that names `uid`
/// ([`crate::holders::cover::exemption`]).
fn config_exempt(node: &Node, cg: Option<&str>, uid: Option<u32>) -> bool {
    match (cg, uid) {
        (Some(c), Some(u)) => crate::host::fence_ops::exempt_entry_for(node, c, u).is_some(),
        _ => false,
    }
}

fn check_failed(what: &str, e: String) -> Finding {
    Finding::new(
        Kind::CheckFailed,
        format!("{what}: {e}"),
        json!({"check": what, "error": e}),
    )
}

/// One sweep's context: the handles every check uses, and what they found.
struct Sweep<'a> {
    node: &'a Node,
    users: &'a Users,
    procs: Procs<'a>,
    scope: Option<String>,
    /// The file of what earlier sweeps reported of the denial records.
    denial_state: PathBuf,
    fence: Option<Fence>,
    /// The attached fence runs in audit mode (or, none attached, the
    /// config says audit): what it would deny is allowed, a roll-out.
    audit: bool,
    report: SweepReport,
    findings: Vec<Finding>,
}

impl Sweep<'_> {
    fn in_scope(&self, cg: Option<&str>) -> bool {
        match &self.scope {
            None => true,
            Some(s) => cg.is_some_and(|c| is_under(c, s)),
        }
    }
}

/// Runs every check once. A check that cannot run is a
/// [`Kind::CheckFailed`] finding, a state that cannot be kept is in
/// [`SweepReport::errors`].
///
/// # Errors
/// Only when there is nothing to sweep: `opts.cgroup` names no cgroup
/// ([`SweepError::NoSuchCgroup`]), or `opts.cursor` is not a valid name
/// ([`SweepError::BadCursor`]).
pub fn sweep(node: &Node, opts: &Options) -> Result<SweepReport, SweepError> {
    let t0 = Instant::now();
    let scope = opts
        .cgroup
        .as_deref()
        .map(|s| s.trim_matches('/').to_string());
    let mut report = SweepReport::default();
    let denial_state = match opts.cursor.as_deref() {
        None => node.state.denials_path(None),
        Some(c) if valid_cursor(c) => node.state.denials_path(Some(c)),
        Some(c) => return Err(SweepError::BadCursor(c.to_string())),
    };
    if let Some(s) = &scope {
        if !node.cg.path(s).is_dir() {
            return Err(SweepError::NoSuchCgroup {
                cgroup: s.clone(),
                mount: node.cg.mount().to_path_buf(),
            });
        }
    }
    let _lock = lock(node)
        .map_err(|e| report.errors.push(e.to_string()))
        .ok();
    report
        .notes
        .extend(crate::response::engine::finish_interrupted(node));
    let users = node.users();
    let mut s = Sweep {
        node,
        users,
        procs: Procs {
            node,
            users,
            cache: BTreeMap::new(),
        },
        scope,
        denial_state,
        fence: None,
        audit: false,
        report,
        findings: Vec::new(),
    };
    let protected = s.drift();
    let live = s.stale_grants();
    s.report.grants = live.len();
    s.denials();
    let want = |d: DevNum| protected.contains(&d.major);
    let walk = walk_proc(node, s.scope.as_deref(), opts.proc_walk, &want);
    for (pid, tid, slot, n) in &walk.unread_rings {
        let which = if *slot < 0 {
            "kept by a mapping alone".to_string()
        } else {
            format!("thread {tid}'s registered slot {slot}, {n} fixed files")
        };
        s.report.notes.push(format!(
            "pid {pid} has an io_uring ring ({which}) whose files were not read whole: it may hold a GPU; the next Epilog of a GPU job ends it, or `gpufence respond {pid}`"
        ));
    }
    if let Some(why) = &walk.ring_error {
        s.report.notes.push(format!(
            "io_uring rings registered with IORING_REGISTER_RING_FDS (in no descriptor table) were not read: {why}"
        ));
    }
    s.report.unread_rings = walk.unread_rings.len();
    s.report.processes = walk.walked;
    s.not_read(&walk);
    let mut holding = s.descriptor_holders(&walk);
    s.gpus(&live, &mut holding);
    s.report_holders(holding);
    s.stratum(&walk);
    s.sockets(&walk);
    s.persistence();
    s.shm_leftovers();
    s.uid_range();
    s.report.notes.extend(users.note());
    let mut r = s.report;
    r.findings = s.findings;
    r.findings.sort_by(|a, b| {
        b.severity
            .cmp(&a.severity)
            .then(a.kind.cmp(&b.kind))
            .then(a.pid.cmp(&b.pid))
    });
    r.duration_seconds = t0.elapsed().as_secs_f64();
    Ok(r)
}

// ---------------------------------------------------------------------------
// Outputs.

#[cfg(test)]
mod tests {
    use super::state::{new_denials, DenialState};
    use super::*;
    use crate::host::persistence::{cron_entries, unit_files, UnitRoot};
    use gpufence_cgroup::fence::DenialEntry;
    use std::path::Path;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn severities_order_and_parse() {
        assert!(Severity::Info < Severity::Low && Severity::High < Severity::Critical);
        assert_eq!("HIGH".parse::<Severity>(), Ok(Severity::High));
        assert!("urgent".parse::<Severity>().is_err());
        assert_eq!(serde_json::to_value(Severity::Medium).unwrap(), "medium");
        for k in Kind::ALL {
            assert_eq!(serde_json::to_value(k).unwrap(), k.as_str());
        }
        let names: BTreeSet<&str> = Kind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(names.len(), Kind::ALL.len());
    }

    #[test]
    fn crontab_entries_skip_comments_and_assignments() {
        let t = "# DO NOT EDIT THIS FILE\n\nMAILTO=\"\"\nSHELL=/bin/sh\n*/5 * * * * /tmp/.x/xmrig\n@reboot nohup ./m &\n  # indented comment\n0 0 * * * env A=b run\n";
        assert_eq!(
            cron_entries(t),
            vec![
                "*/5 * * * * /tmp/.x/xmrig",
                "@reboot nohup ./m &",
                "0 0 * * * env A=b run"
            ]
        );
        assert!(cron_entries("# only\n# comments\n").is_empty());
    }

    #[test]
    fn stratum_arguments_are_found() {
        assert_eq!(
            stratum_urls(&args(&[
                "xmrig",
                "-o",
                "stratum+tcp://pool:3333",
                "-u",
                "w"
            ])),
            vec!["stratum+tcp://pool:3333"]
        );
        assert_eq!(
            stratum_urls(&args(&["m", "--url=STRATUM+SSL://p:443"])).len(),
            1
        );
        assert!(stratum_urls(&args(&["curl", "https://pool:3333"])).is_empty());
    }

    #[test]
    fn disabled_notebook_auth_is_recognised() {
        for a in [
            vec!["jupyter-notebook", "--NotebookApp.token=", "--ip=0.0.0.0"],
            vec!["jupyter", "lab", "--ServerApp.token=''"],
            vec!["jupyter", "lab", "--IdentityProvider.token=\"\""],
            vec!["jupyter", "lab", "--ServerApp.token", ""],
            vec!["jupyter", "notebook", "--NotebookApp.password="],
            vec![
                "jupyter",
                "lab",
                "--PasswordIdentityProvider.hashed_password=''",
            ],
            vec!["code-server", "--auth", "none"],
            vec!["code-server", "--auth=none"],
        ] {
            assert!(!auth_disabled(&args(&a)).is_empty(), "{a:?}");
        }
        for a in [
            vec!["jupyter", "lab", "--ServerApp.token=abc123"],
            vec!["jupyter", "lab", "--ServerApp.token", "--no-browser"],
            vec!["jupyter", "lab", "--ip=0.0.0.0"],
            vec!["code-server", "--auth", "password"],
            vec!["tool", "--token="],
        ] {
            assert!(auth_disabled(&args(&a)).is_empty(), "{a:?}");
        }
    }

    fn denial(count: u64, last_ns: u64) -> DenialEntry {
        DenialEntry {
            cgroup_id: 7,
            uid: 1001,
            dev: DevNum::new(195, 0),
            access: gpufence_model::device::Access::RW,
            count,
            last_pid: 42,
            last_comm: "x".into(),
            last_ns,
        }
    }

    #[test]
    fn only_new_denials_are_reported_and_the_total_only_grows() {
        let (fresh, s1) = new_denials(&DenialState::default(), &[denial(3, 100)]);
        assert_eq!(fresh.len(), 1);
        assert_eq!((fresh[0].1, s1.total), (3, 3));
        let (fresh, s2) = new_denials(&s1, &[denial(3, 100)]);
        assert!(fresh.is_empty());
        assert_eq!(s2.total, 3);
        let (fresh, s3) = new_denials(&s2, &[denial(5, 200)]);
        assert_eq!((fresh[0].1, s3.total), (2, 5));
        // Evicted by the LRU and made again: a smaller count is all new.
        let (fresh, s4) = new_denials(&s3, &[denial(1, 300)]);
        assert_eq!((fresh[0].1, s4.total), (1, 6));
        // Evicted and gone: nothing new, the total stays.
        let (fresh, s5) = new_denials(&s4, &[]);
        assert!(fresh.is_empty());
        assert_eq!(s5.total, 6);
    }

    #[test]
    fn textfile_has_every_kind_with_help_and_type() {
        let mut r = SweepReport {
            fence_installed: true,
            grants: 3,
            denials_total: 9,
            ..Default::default()
        };
        r.findings
            .push(Finding::new(Kind::WildcardListener, "x", json!({})));
        r.findings
            .push(Finding::new(Kind::WildcardListener, "y", json!({})));
        let t = prometheus(&r);
        for l in [
            "# TYPE gpufence_fence_installed gauge",
            "gpufence_fence_installed 1",
            "gpufence_grants 3",
            "# TYPE gpufence_denials_total counter",
            "gpufence_denials_total 9",
            "# HELP gpufence_findings ",
            "gpufence_findings{kind=\"wildcard_listener\"} 2",
            "gpufence_findings{kind=\"unfenced_gpu_holder\"} 0",
        ] {
            assert!(t.contains(l), "{l} missing in\n{t}");
        }
        assert_eq!(
            t.lines()
                .filter(|l| l.starts_with("gpufence_findings{"))
                .count(),
            Kind::ALL.len()
        );
    }

    #[test]
    fn drain_reason_names_the_worst_finding() {
        let low = Finding::new(Kind::DeniedOpen, "tried", json!({}));
        let mut crit = Finding::new(Kind::MiningCmdline, "pool URL", json!({}));
        crit.pid = Some(77);
        crit.comm = Some("xmrig".into());
        let r = drain_reason(&[&low, &crit]).unwrap();
        assert!(
            r.starts_with(
                "gpufence: sweep: critical mining_cmdline pid 77 (xmrig): pool URL (+1 more)"
            ),
            "{r}"
        );
        assert!(drain_reason(&[]).is_none());
    }

    #[test]
    fn unit_files_fingerprint_files_and_links() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("multi-user.target.wants")).unwrap();
        std::fs::write(
            d.path().join("a.service"),
            "[Service]\nExecStart=/bin/true\n",
        )
        .unwrap();
        std::os::unix::fs::symlink(
            "../a.service",
            d.path().join("multi-user.target.wants/a.service"),
        )
        .unwrap();
        let f = unit_files(d.path());
        let root = UnitRoot::system(d.path());
        let file_evidence = |p: &Path| root.evidence(p);
        assert_eq!(f.len(), 2);
        let a = &f[&d.path().join("a.service")];
        assert!(a.link.is_none() && a.size > 0 && a.ctime_ns > 0);
        let (sha, text) = file_evidence(&d.path().join("a.service"));
        assert_eq!(sha.map(|s| s.len()), Some(64));
        assert!(text.unwrap().contains("ExecStart"));
        // A FIFO swapped in for a file is neither read nor waited on.
        let fifo = d.path().join("f.service");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo(3) with a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert_eq!(file_evidence(&fifo), (None, None));
        assert!(!unit_files(d.path()).contains_key(&fifo));
        // A symlink is not followed.
        assert_eq!(
            file_evidence(&d.path().join("multi-user.target.wants/a.service")),
            (None, None)
        );
        let l = &f[&d.path().join("multi-user.target.wants/a.service")];
        assert_eq!(l.link.as_deref(), Some("../a.service"));
    }
}
