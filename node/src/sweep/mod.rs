//! `gpufence sweep`: a node health check that looks for what the fence
//! cannot prevent on its own, cheap enough to run every minute (Slurm's
//! `HealthCheckProgram`, NHC, cron) on a node with 10,000 processes.
//!
//! One walk of `/proc` ([`Scanner::process_fds`]: each descriptor is
//! `stat`ed once, for device holds and socket inodes alike; threads sharing
//! a table are walked once) and one read of each network namespace's TCP
//! tables find:
//!
//! | kind | severity | what |
//! | --- | --- | --- |
//! | `unfenced_gpu_holder` | critical | a process holding an NVIDIA device (descriptor, mapping, io_uring file, or per NVML) that no grant or exemption covers |
//! | `fence_not_attached` | critical | the fence's link is missing, detached or attached elsewhere |
//! | `fence_not_enforcing` | high | the attached program is in audit mode (allows everything) while the config says enforce, or is another version's |
//! | `unprotected_major` | critical | an NVIDIA major the node has (`/proc/devices` or `[majors]`) that the fence's majors map lacks (driver reloaded) |
//! | `mining_cmdline` | critical | a `stratum+tcp://` / `stratum+ssl://` (`+tls`, `stratum2+tcp`) argument in a command line |
//! | `mining_connection` | high | a TCP connection to a `mining_ports` port |
//! | `gpu_busy_without_grant` | high | a GPU with utilisation, memory above its idle level, or processes, and no live grant on it (NVML) |
//! | `unauthenticated_notebook` | high | a wildcard listener whose command line disables its token or password (Jupyter, code-server) |
//! | `persistence_cron` | medium | crontab entries of a user above `protected_uid_max` |
//! | `persistence_systemd` | medium | a unit, timer, drop-in or `.wants` link that appeared or changed since the baseline |
//! | `check_failed` | medium | a check could not run (NVML error, unreadable maps, corrupt state): the node cannot be called clean |
//! | `denied_open` | low | new denial records since the last sweep (the fence held; someone tried) |
//! | `wildcard_listener` | low | a TCP listener on 0.0.0.0 or :: owned by a user above `protected_uid_max`, unless every owner runs one of `slurm_listeners` |
//! | `stale_grant` | low | a grant whose cgroup no longer exists: revoked by the sweep (high when the revocation failed) |
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
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use gpufence_cgroup::fence::{DenialEntry, Fence, GrantEntry};
use gpufence_model::audit::AuditEvent;
use gpufence_model::device::DevNum;
use gpufence_model::fsutil::{create_dir_all_mode, write_atomic};
use gpufence_model::procnet::{TCP_ESTABLISHED, TCP_LISTEN, TCP_SYN_SENT};
use gpufence_model::record::now_rfc3339;

use crate::holders::cover::covered;
use crate::holders::scan::{HeldFd, Scanner, Via};
use crate::host::denials;
use crate::host::persistence::{
    file_evidence, systemd_files, user_crontabs, Fingerprint, UNIT_EVIDENCE_MAX,
};
use crate::host::procs::{read_cmdline, read_stat, read_uid, PF_KTHREAD};
use crate::host::users::Passwd;
use crate::response::evidence::GpuMemory;
use crate::{host::drain, is_under, Node};

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
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "info" => Ok(Severity::Info),
            "low" => Ok(Severity::Low),
            "medium" => Ok(Severity::Medium),
            "high" => Ok(Severity::High),
            "critical" => Ok(Severity::Critical),
            _ => Err(format!(
                "{s:?} is not a severity (info, low, medium, high, critical)"
            )),
        }
    }
}

/// What a finding is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A process holds an NVIDIA device outside every grant and exemption.
    UnfencedGpuHolder,
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
}

impl Kind {
    /// Every kind, in severity order (for the metrics, one series each).
    pub const ALL: [Kind; 16] = [
        Kind::UnfencedGpuHolder,
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
    ];

    /// Its name (as in JSON and metrics).
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::UnfencedGpuHolder => "unfenced_gpu_holder",
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
        }
    }

    /// Its usual severity (see the module's table).
    pub fn severity(self) -> Severity {
        match self {
            Kind::UnfencedGpuHolder
            | Kind::FenceNotAttached
            | Kind::UnprotectedMajor
            | Kind::MiningCmdline => Severity::Critical,
            Kind::MiningConnection
            | Kind::GpuBusyWithoutGrant
            | Kind::UnauthenticatedNotebook
            | Kind::FenceNotEnforcing => Severity::High,
            Kind::PersistenceCron | Kind::PersistenceSystemd | Kind::CheckFailed => {
                Severity::Medium
            }
            Kind::DeniedOpen
            | Kind::WildcardListener
            | Kind::StaleGrant
            | Kind::StaleMajor
            | Kind::ShmLeftover => Severity::Low,
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
    /// That uid's name, from `passwd_file`.
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

/// The arguments that disable a notebook or dashboard server's
/// authentication: a Jupyter trait `--<Class>.token`, `.password` or
/// `.hashed_password` set to nothing (`--ServerApp.token=`, `=''`, `=""`,
/// or an empty next argument), and code-server's `--auth none`.
pub fn auth_disabled(cmdline: &[String]) -> Vec<String> {
    let empty = |v: &str| matches!(v.trim(), "" | "''" | "\"\"");
    let mut out = Vec::new();
    for (i, a) in cmdline.iter().enumerate() {
        if !a.starts_with("--") {
            continue;
        }
        let (key, val, joined) = match a.split_once('=') {
            Some((k, v)) => (k, Some(v.to_string()), true),
            None => (a.as_str(), cmdline.get(i + 1).cloned(), false),
        };
        let k = key.to_ascii_lowercase();
        let jupyter = k.contains('.')
            && (k.ends_with(".token")
                || k.ends_with(".password")
                || k.ends_with(".hashed_password"));
        if jupyter {
            if let Some(v) = val.filter(|v| joined || !v.starts_with("--")) {
                if empty(&v) {
                    out.push(if joined {
                        a.clone()
                    } else {
                        format!("{a} {v:?}")
                    });
                }
            }
        } else if k == "--auth"
            && val
                .as_deref()
                .is_some_and(|v| v.eq_ignore_ascii_case("none"))
        {
            out.push(if joined {
                a.clone()
            } else {
                format!("{a} none")
            });
        }
    }
    out
}

// ---------------------------------------------------------------------------
// The process walk.

/// What the sweep knows of a process it reports.
#[derive(Clone, Debug, Default)]
struct ProcMeta {
    pid: i32,
    comm: Option<String>,
    uid: Option<u32>,
    user: Option<String>,
    cgroup: Option<String>,
    cmdline: Vec<String>,
}

/// Whether `pid` runs one of `slurm_listeners` (by `/proc/<pid>/exe`: a
/// deleted or replaced binary reads `... (deleted)` and does not match).
fn slurm_exe(node: &Node, pid: i32) -> bool {
    std::fs::read_link(format!("/proc/{pid}/exe"))
        .is_ok_and(|exe| node.cfg.slurm_listeners.contains(&exe))
}

fn netns_of(pid: i32) -> Option<u64> {
    let l = std::fs::read_link(format!("/proc/{pid}/ns/net")).ok()?;
    let s = l.to_str()?;
    s.strip_prefix("net:[")?.strip_suffix(']')?.parse().ok()
}

/// Reads what findings need about processes, once each.
struct Procs<'a> {
    node: &'a Node,
    users: &'a Passwd,
    cache: BTreeMap<i32, ProcMeta>,
}

impl Procs<'_> {
    fn meta(&mut self, pid: i32) -> ProcMeta {
        if let Some(m) = self.cache.get(&pid) {
            return m.clone();
        }
        let uid = read_uid(pid);
        let m = ProcMeta {
            pid,
            comm: read_stat(pid).map(|(c, _, _)| c),
            uid,
            user: uid.and_then(|u| self.users.name(u)).map(String::from),
            cgroup: self.node.cg.cgroup_of(pid).ok(),
            cmdline: read_cmdline(pid),
        };
        self.cache.insert(pid, m.clone());
        m
    }
}

/// What one pass over `/proc` keeps: only processes with something to say.
#[derive(Default)]
struct Walk {
    walked: usize,
    /// Why rings tasks registered (`IORING_REGISTER_RING_FDS`) were not
    /// read, if so.
    ring_error: Option<String>,
    /// Registered rings not read whole: (pid, thread, slot, fixed files).
    unread_rings: Vec<(i32, i32, i32, u64)>,
    holders: BTreeMap<i32, Vec<HeldFd>>,
    /// socket inode → owning pids.
    sockets: BTreeMap<u64, Vec<i32>>,
    /// network namespace → a pid in it.
    netns: BTreeMap<u64, i32>,
    stratum: BTreeMap<i32, Vec<String>>,
}

fn walk_proc(node: &Node, scope: Option<&str>, want: &dyn Fn(DevNum) -> bool) -> Walk {
    let me = std::process::id() as i32;
    let mut w = Walk::default();
    let mut scanner = Scanner::new();
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

// ---------------------------------------------------------------------------
// State.

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct SeenDenial {
    cgroup_id: u64,
    uid: u32,
    major: u32,
    minor: u32,
    count: u64,
    last_ns: u64,
}

/// What the last sweep saw of the denial records.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct DenialState {
    /// Denied opens counted by every sweep so far (a counter: the LRU map
    /// forgets, this does not, until `state_dir` goes with a reboot).
    total: u64,
    seen: Vec<SeenDenial>,
}

fn denial_key(d: &DenialEntry) -> (u64, u32, u32, u32) {
    (d.cgroup_id, d.uid, d.dev.major, d.dev.minor)
}

/// The records that are new or grew since `prev`, with how many denials
/// each adds, and the state to keep.
fn new_denials(prev: &DenialState, now: &[DenialEntry]) -> (Vec<(DenialEntry, u64)>, DenialState) {
    let old: BTreeMap<(u64, u32, u32, u32), &SeenDenial> = prev
        .seen
        .iter()
        .map(|s| ((s.cgroup_id, s.uid, s.major, s.minor), s))
        .collect();
    let mut fresh = Vec::new();
    let mut total = prev.total;
    for d in now {
        let delta = match old.get(&denial_key(d)) {
            // Same record, grown.
            Some(s) if d.count >= s.count && d.last_ns >= s.last_ns => d.count - s.count,
            // Evicted and made again, or never seen.
            _ => d.count,
        };
        if delta > 0 {
            total += delta;
            fresh.push((d.clone(), delta));
        }
    }
    let seen = now
        .iter()
        .map(|d| SeenDenial {
            cgroup_id: d.cgroup_id,
            uid: d.uid,
            major: d.dev.major,
            minor: d.dev.minor,
            count: d.count,
            last_ns: d.last_ns,
        })
        .collect();
    (fresh, DenialState { total, seen })
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct Baseline {
    recorded: String,
    files: BTreeMap<PathBuf, Fingerprint>,
}

fn sweep_dir(node: &Node) -> PathBuf {
    node.state.root().join("sweep")
}

/// The systemd baseline file (remove it to accept the current units).
pub fn baseline_path(node: &Node) -> PathBuf {
    sweep_dir(node).join("systemd-baseline.json")
}

fn read_json<T: for<'de> Deserialize<'de>>(p: &Path) -> Result<Option<T>, String> {
    match std::fs::read(p) {
        Ok(b) => serde_json::from_slice(&b)
            .map(Some)
            .map_err(|e| format!("{}: corrupt: {e}", p.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", p.display())),
    }
}

fn write_json<T: Serialize>(p: &Path, v: &T) -> Result<(), String> {
    let bytes = serde_json::to_vec_pretty(v).unwrap_or_default();
    write_atomic(p, &bytes, 0o600).map_err(|e| format!("{}: {e}", p.display()))
}

/// Holds an exclusive `flock` on `state_dir/sweep/lock` while alive.
struct SweepLock(#[allow(dead_code)] std::fs::File);

fn lock(node: &Node) -> Result<SweepLock, String> {
    let dir = sweep_dir(node);
    create_dir_all_mode(&dir, 0o700).map_err(|e| format!("{}: {e}", dir.display()))?;
    let p = dir.join("lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&p)
        .map_err(|e| format!("{}: {e}", p.display()))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        // SAFETY: flock on a descriptor we own; released when it closes.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(SweepLock(f));
        }
        if Instant::now() > deadline {
            return Err(format!("another sweep has held {} for 30 s", p.display()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

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
}

/// Whether `name` may name a denial cursor (it becomes part of a file name).
fn valid_cursor(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
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
/// cgroup `cg` (never a user's process: [`crate::holders::cover::exemption`]).
fn config_exempt(node: &Node, cg: Option<&str>, uid: Option<u32>) -> bool {
    uid.is_some_and(|u| node.cfg.exempt_identities().covers(u))
        && cg.is_some_and(|c| node.cfg.exempt_cgroups.iter().any(|e| is_under(c, e)))
}

fn check_failed(what: &str, e: String) -> Finding {
    Finding::new(
        Kind::CheckFailed,
        format!("{what}: {e}"),
        json!({"check": what, "error": e}),
    )
}

/// What a process holds outside every grant, by descriptor and per NVML.
#[derive(Default)]
struct Holding {
    devices: BTreeSet<DevNum>,
    fds: Vec<HeldFd>,
    gpu_memory: Vec<GpuMemory>,
}

/// One sweep's context: the handles every check uses, and what they found.
struct Sweep<'a> {
    node: &'a Node,
    users: &'a Passwd,
    procs: Procs<'a>,
    scope: Option<String>,
    /// The file of what earlier sweeps reported of the denial records.
    denial_state: PathBuf,
    fence: Option<Fence>,
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

    /// The fence attached, its majors against the node's. Returns the
    /// node's protected majors.
    fn drift(&mut self) -> BTreeSet<u32> {
        let node = self.node;
        let attached = Fence::check_attached(&node.cg, &node.cfg.cgroup_root, &node.cfg.bpffs_dir);
        self.report.fence_installed = attached.is_ok();
        if let Err(detail) = &attached {
            self.findings.push(Finding::new(
                Kind::FenceNotAttached,
                format!(
                    "the fence is not attached at /{}: {detail}: every process may open every GPU; run `gpufence fence install`",
                    node.cfg.cgroup_root
                ),
                json!({
                    "cgroup_root": format!("/{}", node.cfg.cgroup_root),
                    "bpffs_dir": node.cfg.bpffs_dir, "detail": detail,
                }),
            ));
        }
        if attached.is_ok() {
            let mode = crate::host::fence_ops::running_mode(node);
            let want = if node.cfg.mode == gpufence_model::config::Mode::Audit {
                crate::host::fence_ops::RunningMode::Audit
            } else {
                crate::host::fence_ops::RunningMode::Enforce
            };
            if mode != want {
                self.findings.push(Finding::new(
                    Kind::FenceNotEnforcing,
                    format!(
                        "the attached fence program runs in mode {mode}, the config asks for {}: run `gpufence fence install`",
                        if want == crate::host::fence_ops::RunningMode::Audit { "audit" } else { "enforce" }
                    ),
                    json!({"running_mode": mode, "config_mode": format!("{:?}", node.cfg.mode).to_lowercase()}),
                ));
            }
        }
        self.fence = match Fence::open(&node.cfg.bpffs_dir) {
            Ok(f) => Some(f),
            Err(e) => {
                if attached.is_ok() {
                    self.findings
                        .push(check_failed("fence maps", e.to_string()));
                }
                None
            }
        };
        let want = match node.protected_majors() {
            Ok(p) => p,
            Err(e) => {
                self.findings
                    .push(check_failed("protected majors", e.to_string()));
                return BTreeSet::new();
            }
        };
        let want_set: BTreeSet<u32> = want.majors().collect();
        let Some(f) = &self.fence else {
            return want_set;
        };
        let have: BTreeSet<u32> = match f.protected_majors() {
            Ok(h) => h.into_iter().collect(),
            Err(e) => {
                self.findings
                    .push(check_failed("fence majors", e.to_string()));
                return want_set;
            }
        };
        for m in want_set.difference(&have) {
            let names: Vec<&str> = want.names(*m).collect();
            self.findings.push(Finding::new(
                Kind::UnprotectedMajor,
                format!(
                    "major {m} ({}) is an NVIDIA driver's but the fence does not protect it (driver reloaded since install?): run `gpufence fence install`",
                    names.join(",")
                ),
                json!({"major": m, "names": names, "fence_majors": have}),
            ));
        }
        for m in have.difference(&want_set) {
            self.findings.push(Finding::new(
                Kind::StaleMajor,
                format!(
                    "the fence protects major {m}, which the node no longer has (driver unloaded or renumbered)"
                ),
                json!({"major": m, "node_majors": want_set}),
            ));
        }
        want_set
    }

    /// Grants whose cgroup is gone are revoked ("collected"). The entries
    /// are read before the cgroups are listed: a grant's cgroup exists
    /// before its grant does, so a live one cannot be taken for stale.
    /// Returns the live grants.
    fn stale_grants(&mut self) -> Vec<GrantEntry> {
        let node = self.node;
        let Some(f) = &self.fence else {
            return Vec::new();
        };
        let entries = match f.entries() {
            Ok(e) => e,
            Err(e) => {
                self.findings
                    .push(check_failed("fence grants", e.to_string()));
                return Vec::new();
            }
        };
        if entries.is_empty() {
            return entries;
        }
        let alive = denials::cgroup_paths(node.cg.mount());
        let noted: BTreeMap<u64, String> = node
            .state
            .applied(None)
            .0
            .into_iter()
            .map(|a| (a.cgroup_id, a.cgroup_path))
            .collect();
        let ids: BTreeSet<u64> = entries.iter().map(|e| e.cgroup_id).collect();
        let mut live = Vec::new();
        for id in ids {
            let mine: Vec<GrantEntry> = entries
                .iter()
                .filter(|e| e.cgroup_id == id)
                .copied()
                .collect();
            if alive.contains_key(&id) {
                live.extend(mine);
                continue;
            }
            let jobs: BTreeSet<u32> = mine.iter().map(|e| e.job_id).collect();
            let devs: BTreeSet<DevNum> = mine.iter().map(|e| e.dev).collect();
            let path = noted.get(&id).map(|p| crate::host::cgpath::abs(p));
            let mut fnd = Finding::new(
                Kind::StaleGrant,
                format!(
                    "grant of job(s) {jobs:?} on {} to cgroup id {id}{} whose cgroup no longer exists",
                    dev_list(&devs),
                    path.as_deref().map(|p| format!(" ({p})")).unwrap_or_default()
                ),
                json!({
                    "cgroup_id": id, "cgroup_path": path, "job_ids": jobs,
                    "devices": devs.iter().map(|d| d.to_string()).collect::<Vec<_>>(),
                }),
            );
            fnd.cgroup = path.clone();
            match f.revoke_cgroup(id) {
                Ok(gone) => {
                    fnd.action = Some(format!(
                        "revoked {} grant entr{}",
                        gone.len(),
                        if gone.len() == 1 { "y" } else { "ies" }
                    ));
                    let mut ev = AuditEvent::new("grant_collected")
                        .devices(devs.iter())
                        .field("cgroup_id", id)
                        .field("entries", gone.len())
                        .field("why", "the grant's cgroup no longer exists (sweep)");
                    if let Some(j) = jobs.iter().next() {
                        ev = ev.job(*j);
                    }
                    if let Some(p) = &path {
                        ev = ev.field("cgroup", p.clone());
                    }
                    if let Err(e) = node.audit(ev) {
                        self.report.errors.push(e.to_string());
                    }
                }
                Err(e) => {
                    fnd.severity = Severity::High;
                    fnd.action = Some(format!("revocation failed: {e}"));
                    live.extend(mine);
                }
            }
            self.findings.push(fnd);
        }
        live
    }

    /// Denial records new or grown since the last sweep.
    fn denials(&mut self) {
        let node = self.node;
        let Some(f) = &self.fence else {
            return;
        };
        let now = match f.denials() {
            Ok(d) => d,
            Err(e) => {
                self.findings
                    .push(check_failed("fence denials", e.to_string()));
                return;
            }
        };
        let state_path = self.denial_state.clone();
        let prev = match read_json::<DenialState>(&state_path) {
            Ok(p) => p.unwrap_or_default(),
            Err(e) => {
                self.report.errors.push(e);
                DenialState::default()
            }
        };
        let (fresh, next) = new_denials(&prev, &now);
        self.report.denials_total = next.total;
        let deltas: Vec<u64> = fresh.iter().map(|(_, d)| *d).collect();
        let resolved = denials::resolve(node, fresh.into_iter().map(|(d, _)| d).collect());
        for (d, delta) in resolved.into_iter().zip(deltas) {
            let mut fnd = Finding::new(
                Kind::DeniedOpen,
                format!(
                    "{delta} denied open(s) of {} by {} (uid {}) since the last sweep; last pid {} ({}) at {}",
                    d.device,
                    d.user.as_deref().unwrap_or("?"),
                    d.uid,
                    d.last_pid,
                    d.last_comm,
                    d.last_time
                ),
                json!({
                    "device": d.device, "new": delta, "count": d.count,
                    "cgroup_id": d.cgroup_id, "last_time": d.last_time,
                }),
            );
            fnd.pid = (d.last_pid > 0).then_some(d.last_pid as i32);
            fnd.uid = Some(d.uid);
            fnd.user = d.user;
            fnd.cgroup = d.cgroup.map(|c| crate::host::cgpath::abs(&c));
            fnd.comm = Some(d.last_comm);
            self.findings.push(fnd);
        }
        if let Err(e) = write_json(&state_path, &next) {
            self.report.errors.push(e);
        }
    }

    /// Processes holding protected devices by descriptor that no grant
    /// or exemption covers.
    fn descriptor_holders(&mut self, walk: &Walk) -> BTreeMap<i32, Holding> {
        let node = self.node;
        let mut holding = BTreeMap::new();
        for (pid, fds) in &walk.holders {
            let m = self.procs.meta(*pid);
            let cg = m.cgroup.as_deref();
            let devs: BTreeSet<DevNum> = fds
                .iter()
                .map(|f| f.dev)
                .filter(|d| {
                    !config_exempt(node, cg, m.uid)
                        && !covered(node, self.fence.as_ref(), cg, m.uid, *d)
                })
                .collect();
            if devs.is_empty() {
                continue;
            }
            let fds = fds
                .iter()
                .filter(|f| devs.contains(&f.dev))
                .cloned()
                .collect();
            holding.insert(
                *pid,
                Holding {
                    devices: devs,
                    fds,
                    gpu_memory: Vec::new(),
                },
            );
        }
        holding
    }

    /// NVML: processes on GPUs no grant covers (added to `holding`), and
    /// GPUs in use with no live grant.
    fn gpus(&mut self, live: &[GrantEntry], holding: &mut BTreeMap<i32, Holding>) {
        let node = self.node;
        let gpus = node.open_gpus();
        if let Some(why) = &gpus.unavailable {
            self.report.notes.push(format!(
                "NVML unavailable ({why}): descriptor scan only, GPU use not checked"
            ));
            return;
        }
        let queried = gpus.minors().and_then(|minors| {
            let info = gpus.query(&minors)?;
            let util = gpus.utilization(&minors)?;
            Ok((info, util))
        });
        let (info, util) = match queried {
            Ok(q) => q,
            Err(e) => {
                self.findings.push(check_failed("NVML", e));
                return;
            }
        };
        let gpu_major = node.gpu_major();
        let me = std::process::id() as i32;
        let util: BTreeMap<u32, Option<(u32, u32)>> = util
            .into_iter()
            .map(|u| (u.minor, u.gpu.zip(u.memory)))
            .collect();
        let granted: BTreeSet<u32> = live
            .iter()
            .filter(|e| e.dev.major == gpu_major)
            .map(|e| e.dev.minor)
            .collect();
        let idle_max = (node.cfg.idle_memory_mib + node.cfg.memory_tolerance_mib) << 20;
        for g in &info {
            let dev = DevNum::new(gpu_major, g.minor);
            let mut pids = Vec::new();
            for p in &g.processes {
                let Ok(pid) = i32::try_from(p.pid) else {
                    continue;
                };
                if pid <= 0 || pid == me {
                    continue;
                }
                let m = self.procs.meta(pid);
                let cg = m.cgroup.as_deref();
                if !self.in_scope(cg) || config_exempt(node, cg, m.uid) {
                    continue;
                }
                pids.push(pid);
                if covered(node, self.fence.as_ref(), cg, m.uid, dev) {
                    continue;
                }
                let h = holding.entry(pid).or_default();
                h.devices.insert(dev);
                h.gpu_memory.push(GpuMemory {
                    minor: g.minor,
                    uuid: g.uuid.clone(),
                    used_bytes: p.used_memory,
                });
            }
            if granted.contains(&g.minor) {
                continue;
            }
            let u = util.get(&g.minor).copied().flatten();
            let utilised = u.is_some_and(|(gu, mu)| gu > 0 || mu > 0);
            let mem_busy = g.memory_used > idle_max;
            if !utilised && !mem_busy && pids.is_empty() {
                continue;
            }
            let mut why = Vec::new();
            if let Some((gu, mu)) = u.filter(|_| utilised) {
                why.push(format!("{gu}% GPU / {mu}% memory utilisation"));
            }
            if mem_busy {
                why.push(format!("{} MiB of memory in use", g.memory_used >> 20));
            }
            if !pids.is_empty() {
                why.push(format!("processes {pids:?}"));
            }
            self.findings.push(Finding::new(
                Kind::GpuBusyWithoutGrant,
                format!(
                    "GPU /dev/nvidia{} ({}) is in use with no live grant on it: {}",
                    g.minor,
                    g.uuid,
                    why.join(", ")
                ),
                json!({
                    "minor": g.minor, "uuid": g.uuid, "pci_bus_id": g.pci_bus_id,
                    "utilization_gpu": u.map(|x| x.0), "utilization_memory": u.map(|x| x.1),
                    "memory_used_bytes": g.memory_used, "memory_total_bytes": g.memory_total,
                    "idle_threshold_bytes": idle_max, "pids": pids,
                }),
            ));
        }
    }

    fn report_holders(&mut self, holding: BTreeMap<i32, Holding>) {
        for (pid, h) in holding {
            let m = self.procs.meta(pid);
            let how: Vec<String> = h
                .fds
                .iter()
                .map(|f| {
                    let via = match f.via {
                        Via::Fd => format!("fd {}", f.fd),
                        Via::ThreadFd => format!("thread {} fd {}", f.tid.unwrap_or(0), f.fd),
                        Via::Mmap => "mapping".into(),
                        Via::IoUring => format!("io_uring fd {}", f.fd),
                        Via::IoUringRegisteredRing => format!(
                            "thread {} io_uring registered ring {}",
                            f.tid.unwrap_or(0),
                            f.fd
                        ),
                    };
                    format!("{} {} ({via})", f.dev, f.path.display())
                })
                .chain(h.gpu_memory.iter().map(|g| {
                    format!(
                        "GPU {} per NVML{}",
                        g.minor,
                        g.used_bytes
                            .map(|b| format!(", {} MiB", b >> 20))
                            .unwrap_or_default()
                    )
                }))
                .collect();
            self.findings.push(
                Finding::new(
                    Kind::UnfencedGpuHolder,
                    format!(
                        "holds {} outside every grant and exemption: {}",
                        dev_list(&h.devices),
                        how.join("; ")
                    ),
                    json!({
                        "devices": h.devices.iter().map(|d| d.to_string()).collect::<Vec<_>>(),
                        "holds": h.fds, "gpu_memory": h.gpu_memory, "cmdline": m.cmdline,
                    }),
                )
                .who(&m),
            );
        }
    }

    /// Command lines with a pool URL.
    fn stratum(&mut self, walk: &Walk) {
        for (pid, urls) in &walk.stratum {
            let m = self.procs.meta(*pid);
            self.findings.push(
                Finding::new(
                    Kind::MiningCmdline,
                    format!("mining pool URL in its command line: {}", urls.join(" ")),
                    json!({"arguments": urls, "cmdline": m.cmdline}),
                )
                .who(&m),
            );
        }
    }

    /// Each network namespace's TCP tables, read once: wildcard listeners
    /// of users, connections to mining-pool ports.
    fn sockets(&mut self, walk: &Walk) {
        let node = self.node;
        let ports: BTreeSet<u16> = node.cfg.mining_ports.iter().copied().collect();
        let max = node.cfg.protected_uid_max;
        for (ns, rep) in &walk.netns {
            for proto in ["tcp", "tcp6"] {
                // Gone since the walk, or no IPv6: nothing to read.
                let path = PathBuf::from(format!("/proc/{rep}/net/{proto}"));
                let Ok(text) = std::fs::read_to_string(&path) else {
                    continue;
                };
                // A table that does not parse is reported, never skipped.
                let table = match gpufence_model::procnet::parse_tcp(&text, &path) {
                    Ok(t) => t,
                    Err(e) => {
                        self.findings
                            .push(check_failed("TCP sockets", e.to_string()));
                        continue;
                    }
                };
                for e in table {
                    let Some(owners) = walk.sockets.get(&e.inode) else {
                        continue;
                    };
                    let (local_address, remote_address) = (e.local, e.remote);
                    let listen = e.state == TCP_LISTEN;
                    if listen && local_address.ip().is_unspecified() {
                        let m = self.procs.meta(owners[0]);
                        if e.uid <= max && m.uid.is_none_or(|u| u <= max) {
                            continue;
                        }
                        let mut off = Vec::new();
                        for pid in owners {
                            off.extend(auth_disabled(&self.procs.meta(*pid).cmdline));
                        }
                        if off.is_empty() && owners.iter().all(|p| slurm_exe(node, *p)) {
                            continue;
                        }
                        let ev = json!({
                            "proto": proto, "local": local_address.to_string(),
                            "socket_uid": e.uid, "inode": e.inode, "netns": ns,
                            "pids": owners, "cmdline": m.cmdline, "auth_disabled": off,
                        });
                        let f = if off.is_empty() {
                            Finding::new(
                                Kind::WildcardListener,
                                format!("listens on {} ({proto}, every address)", local_address),
                                ev,
                            )
                        } else {
                            Finding::new(
                                Kind::UnauthenticatedNotebook,
                                format!(
                                    "listens on {} ({proto}, every address) with authentication disabled: {}",
                                    local_address,
                                    off.join(" ")
                                ),
                                ev,
                            )
                        };
                        self.findings.push(f.who(&m));
                    } else if matches!(e.state, TCP_ESTABLISHED | TCP_SYN_SENT)
                        && ports.contains(&remote_address.port())
                    {
                        let m = self.procs.meta(owners[0]);
                        self.findings.push(
                            Finding::new(
                                Kind::MiningConnection,
                                format!(
                                    "TCP connection to {} (a mining-pool port) from {}",
                                    remote_address, local_address
                                ),
                                json!({
                                    "proto": proto, "local": local_address.to_string(),
                                    "remote": remote_address.to_string(),
                                    "state": if e.state == TCP_SYN_SENT { "SynSent" } else { "Established" },
                                    "inode": e.inode,
                                    "netns": ns, "pids": owners, "cmdline": m.cmdline,
                                }),
                            )
                            .who(&m),
                        );
                    }
                }
            }
        }
    }

    /// Users' crontabs; systemd files against the baseline.
    /// Users' files in `shm_dir` that no process holds, with their age
    /// ([`crate::holders::shm::leftovers`]; system users and exempt service uids
    /// aside). Out of a `--cgroup` sweep's scope.
    fn shm_leftovers(&mut self) {
        if self.scope.is_some() {
            return;
        }
        let ids = self.node.cfg.exempt_identities();
        let now = std::time::SystemTime::now();
        for l in crate::holders::shm::leftovers(&self.node.cfg.shm_dir, &|u| !ids.covers(u), None) {
            let path = self.node.cfg.shm_dir.join(&l.name);
            let age = l.age_seconds(now);
            let mut f = Finding::new(
                Kind::ShmLeftover,
                format!(
                    "{} ({} bytes, mode {}) left {}s ago, held by no process",
                    path.display(),
                    l.size_bytes,
                    l.mode,
                    age
                ),
                json!({
                    "path": path.display().to_string(),
                    "size_bytes": l.size_bytes,
                    "mode": l.mode,
                    "age_seconds": age,
                }),
            );
            f.uid = Some(l.uid);
            f.user = self.users.name(l.uid).map(str::to_string);
            self.findings.push(f);
        }
    }

    fn persistence(&mut self) {
        let node = self.node;
        let users = self.users;
        for c in user_crontabs(node, users) {
            let mut f = Finding::new(
                Kind::PersistenceCron,
                format!(
                    "crontab of {} with {} entr{}: {}",
                    c.user.as_deref().unwrap_or("?"),
                    c.entries.len(),
                    if c.entries.len() == 1 { "y" } else { "ies" },
                    c.entries.join(" | ")
                ),
                json!({"file": c.path, "entries": c.entries, "sha256": c.sha256}),
            );
            f.uid = c.uid;
            f.user = c.user.clone();
            self.findings.push(f);
        }
        let current = systemd_files(node, users);
        let bpath = baseline_path(node);
        let b = match read_json::<Baseline>(&bpath) {
            Err(e) => {
                self.findings.push(check_failed(
                    "systemd baseline",
                    format!("{e}; remove it to record a new baseline"),
                ));
                return;
            }
            Ok(Some(b)) => b,
            Ok(None) => {
                let b = Baseline {
                    recorded: now_rfc3339(),
                    files: current
                        .iter()
                        .map(|(p, (f, _))| (p.clone(), f.clone()))
                        .collect(),
                };
                match write_json(&bpath, &b) {
                    Ok(()) => self.report.notes.push(format!(
                        "systemd baseline recorded: {} file(s) in {}",
                        b.files.len(),
                        bpath.display()
                    )),
                    Err(e) => self.report.errors.push(e),
                }
                return;
            }
        };
        let mut read = 0;
        for (p, (f, scope_kind)) in &current {
            let change = match b.files.get(p) {
                None => "new",
                Some(old) if old != f => "changed",
                Some(_) => continue,
            };
            let (sha256, content) = if read < UNIT_EVIDENCE_MAX {
                read += 1;
                file_evidence(p)
            } else {
                (None, None)
            };
            let mut fnd = Finding::new(
                Kind::PersistenceSystemd,
                format!(
                    "{change} systemd {} {} since the baseline of {}",
                    if *scope_kind == "systemd_user" {
                        "user file"
                    } else {
                        "file"
                    },
                    p.display(),
                    b.recorded
                ),
                json!({
                    "file": p, "change": change, "scope": scope_kind, "sha256": sha256,
                    "content": content, "link": f.link, "owner_uid": f.uid,
                    "mode": format!("{:o}", f.mode), "size": f.size,
                    "previous": b.files.get(p), "baseline": bpath,
                }),
            );
            fnd.uid = Some(f.uid);
            fnd.user = users.name(f.uid).map(String::from);
            self.findings.push(fnd);
        }
    }
}

/// Runs every check once. A check that cannot run is a
/// [`Kind::CheckFailed`] finding, a state that cannot be kept is in
/// [`SweepReport::errors`].
///
/// # Errors
/// Only when there is nothing to sweep: `opts.cgroup` names no cgroup, or
/// `opts.cursor` is not a valid name.
pub fn sweep(node: &Node, opts: &Options) -> Result<SweepReport, String> {
    let t0 = Instant::now();
    let scope = opts
        .cgroup
        .as_deref()
        .map(|s| s.trim_matches('/').to_string());
    let mut report = SweepReport::default();
    let denial_state = match opts.cursor.as_deref() {
        None => sweep_dir(node).join("denials.json"),
        Some(c) if valid_cursor(c) => sweep_dir(node).join(format!("denials-{c}.json")),
        Some(c) => {
            return Err(format!(
                "--cursor {c:?}: 1 to 64 letters, digits, '_' or '-'"
            ))
        }
    };
    if let Some(s) = &scope {
        if !node.cg.path(s).is_dir() {
            return Err(format!(
                "--cgroup /{s}: no such cgroup under {}",
                node.cg.mount().display()
            ));
        }
    }
    let _lock = lock(node).map_err(|e| report.errors.push(e)).ok();
    report
        .notes
        .extend(crate::holders::scan::io_uring_exposure(Path::new(
            "/proc/sys",
        )));
    report
        .notes
        .extend(crate::response::respond::finish_interrupted(node));
    let users = Passwd::load(&node.cfg.passwd_file);
    let mut s = Sweep {
        node,
        users: &users,
        procs: Procs {
            node,
            users: &users,
            cache: BTreeMap::new(),
        },
        scope,
        denial_state,
        fence: None,
        report,
        findings: Vec::new(),
    };
    let protected = s.drift();
    let live = s.stale_grants();
    s.report.grants = live.len();
    s.denials();
    let want = |d: DevNum| protected.contains(&d.major);
    let walk = walk_proc(node, s.scope.as_deref(), &want);
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
    s.report.processes = walk.walked;
    let mut holding = s.descriptor_holders(&walk);
    s.gpus(&live, &mut holding);
    s.report_holders(holding);
    s.stratum(&walk);
    s.sockets(&walk);
    s.persistence();
    s.shm_leftovers();
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

fn prom_escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The node_exporter textfile of `r`.
pub fn prometheus(r: &SweepReport) -> String {
    let mut s = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, lines: Vec<(String, String)>| {
        s.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
        for (labels, v) in lines {
            s.push_str(&format!("{name}{labels} {v}\n"));
        }
    };
    metric(
        "gpufence_fence_installed",
        "gauge",
        "Whether the gpufence device fence is attached at cgroup_root (1) or not (0).",
        vec![(String::new(), u8::from(r.fence_installed).to_string())],
    );
    metric(
        "gpufence_grants",
        "gauge",
        "Live grant entries (job cgroup, device) in the fence.",
        vec![(String::new(), r.grants.to_string())],
    );
    metric(
        "gpufence_denials_total",
        "counter",
        "Opens of NVIDIA devices the fence denied, as counted by sweeps.",
        vec![(String::new(), r.denials_total.to_string())],
    );
    metric(
        "gpufence_findings",
        "gauge",
        "Findings of the last gpufence sweep, by kind.",
        r.counts()
            .into_iter()
            .map(|(k, n)| {
                (
                    format!("{{kind=\"{}\"}}", prom_escape(k.as_str())),
                    n.to_string(),
                )
            })
            .collect(),
    );
    metric(
        "gpufence_sweep_duration_seconds",
        "gauge",
        "How long the last gpufence sweep took.",
        vec![(String::new(), format!("{:.3}", r.duration_seconds))],
    );
    s
}

/// The drain reason naming the most severe of `failing` (most severe first).
pub fn drain_reason(failing: &[&Finding]) -> Option<String> {
    let f = failing.iter().max_by_key(|f| f.severity)?;
    let mut who = String::new();
    if let Some(p) = f.pid {
        who.push_str(&format!(" pid {p}"));
        if let Some(c) = &f.comm {
            who.push_str(&format!(" ({c})"));
        }
    }
    if let Some(u) = &f.user {
        who.push_str(&format!(" user {u}"));
    }
    let more = if failing.len() > 1 {
        format!(" (+{} more)", failing.len() - 1)
    } else {
        String::new()
    };
    Some(drain::clean_reason(&format!(
        "gpufence: sweep: {} {}{who}: {}{more}",
        f.severity, f.kind, f.summary
    )))
}

/// What `gpufence sweep` was asked to do.
#[derive(Clone, Debug, Default)]
pub struct SweepRequest {
    /// See [`Options::cgroup`].
    pub cgroup: Option<String>,
    /// Fail on findings at or above this; `None`: `sweep_fail_severity`.
    pub fail_on: Option<Severity>,
    /// Drain this node when something fails.
    pub drain_node: Option<String>,
    /// Write the node_exporter textfile here.
    pub prometheus: Option<PathBuf>,
    /// See [`Options::cursor`].
    pub cursor: Option<String>,
}

/// What `gpufence sweep` did.
#[derive(Clone, Debug)]
pub struct SweepOutcome {
    /// The findings and numbers.
    pub report: SweepReport,
    /// The severity that fails.
    pub threshold: Severity,
    /// The drain reason, when the node was drained.
    pub drained: Option<String>,
    /// What could not be done (textfile, drain, state).
    pub errors: Vec<String>,
    /// The exit status: 0 clean, 1 findings at or above the threshold, 2
    /// none but the sweep could not do all it was asked.
    pub exit: u8,
}

/// The severity that fails a sweep: `fail_on` (CLI), else the config's.
///
/// # Errors
/// A message naming the bad value.
pub fn threshold(node: &Node, fail_on: Option<&str>) -> Result<Severity, String> {
    match fail_on {
        Some(s) => s.parse(),
        None => node.cfg.sweep_fail_severity.parse(),
    }
}

/// Sweeps, writes the textfile, drains when asked and something fails.
pub fn execute(node: &Node, req: &SweepRequest) -> SweepOutcome {
    let threshold = req
        .fail_on
        .or_else(|| node.cfg.sweep_fail_severity.parse().ok())
        .unwrap_or(Severity::Medium);
    let report = match sweep(
        node,
        &Options {
            cgroup: req.cgroup.clone(),
            cursor: req.cursor.clone(),
        },
    ) {
        Ok(r) => r,
        // Nothing was swept: no textfile (it would say "clean"), no drain.
        Err(e) => {
            return SweepOutcome {
                report: SweepReport::default(),
                threshold,
                drained: None,
                errors: vec![e],
                exit: 2,
            }
        }
    };
    let mut errors = report.errors.clone();
    if let Some(p) = &req.prometheus {
        if let Err(e) = write_atomic(p, prometheus(&report).as_bytes(), 0o644) {
            errors.push(format!("textfile {}: {e}", p.display()));
        }
    }
    let failing = report.failing(threshold);
    let mut drained = None;
    if let (Some(name), Some(reason)) = (&req.drain_node, drain_reason(&failing)) {
        match drain::drain(node, name, &reason) {
            Ok(()) => {
                let _ = node.audit(
                    AuditEvent::new("sweep_drained")
                        .field("node", name.clone())
                        .field("drain_reason", reason.clone())
                        .field("findings", failing.len()),
                );
                drained = Some(reason);
            }
            Err(e) => errors.push(format!("could not drain {name}: {e}")),
        }
    }
    let exit = if !failing.is_empty() {
        1
    } else if !errors.is_empty() {
        2
    } else {
        0
    };
    SweepOutcome {
        report,
        threshold,
        drained,
        errors,
        exit,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::persistence::{cron_entries, unit_files};

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

    #[test]
    fn passwd_names_uids_and_homes() {
        let p = Passwd::parse("root:x:0:0:root:/root:/bin/bash\nalice:x:1001:1001::/home/alice:/bin/sh\nbad line\n#c:x:5:5::/:/\n");
        assert_eq!(p.name(1001), Some("alice"));
        assert_eq!(p.uid("root"), Some(0));
        assert_eq!(p.home(1001), Some(Path::new("/home/alice")));
        assert_eq!(p.users().count(), 2);
    }

    fn denial(count: u64, last_ns: u64) -> DenialEntry {
        DenialEntry {
            cgroup_id: 7,
            uid: 1001,
            dev: DevNum::new(195, 0),
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
