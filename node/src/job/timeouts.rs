//! How long gpufence's Prolog and Epilog may take at worst, from the
//! config and the waits in the code, and whether slurm.conf gives them that
//! long ([`timeout_warnings`]): `gpufence doctor` and `gpufence fence status`
//! say so, one line each, with the numbers and what to change.
//!
//! The worst case adds up every bounded wait on the hook's path, each at
//! its bound, as the code runs them one after the other
//! ([`epilog_worst_case`], [`prolog_worst_case`]). A real hook takes far
//! less: most waits end as soon as what they wait for happens.
//!
//! The Epilog has a total deadline besides ([`epilog_deadline`]:
//! `epilog_deadline_ms`, else [`DEADLINE_PERCENT`] of slurm.conf's Epilog
//! timeout, else [`DEFAULT_DEADLINE_MS`]) that cuts its waits to fit
//! ([`crate::host::deadline`]): its worst case is the shorter of the two
//! ([`WorstCase::with_deadline`]; with the 1 s a drain may take past it,
//! [`crate::host::deadline::DRAIN_MIN`]), so with the default it fits the
//! site's timeout (any of 5 s or more), and doctor says so.
//!
//! Slurm's keys (`src/common/read_config.c`, 22.05-26.05), all in seconds:
//! - `PrologEpilogTimeout` (every series): both hooks; unset is `NO_VAL16`
//!   (65534, "wait forever").
//! - `PrologTimeout`, `EpilogTimeout` (25.05+): each hook's own; when one
//!   is not set it takes `PrologEpilogTimeout`'s value (`_validate_and_set_defaults`,
//!   slurm-25.05 read_config.c: `if (!s_p_get_uint16(&conf->prolog_timeout,
//!   "PrologTimeout", hashtbl)) conf->prolog_timeout = uint16_tmp; /*
//!   PrologEpilogTimeout */`). Before 25.05 they are unknown keys, which
//!   slurmd refuses, so reading them on every series is safe.
//! - A hook's timeout of `NO_VAL16` runs it without a limit
//!   (`prep_script_slurmd.c`: `timeout != NO_VAL16 ? timeout * 1000 : -1`),
//!   and `run_command` waits forever for a `max_wait <= 0`
//!   (`src/common/run_command.c`): 0, 65534 and 65535 (`INFINITE16`, 18 h)
//!   read as no limit here.
//! - `MessageTimeout`: default 10 (`DEFAULT_MSG_TIMEOUT`, read_config.h).
//! - `UnkillableStepTimeout`: default `MAX(60, 5 * MessageTimeout)`
//!   (`DEFAULT_UNKILLABLE_TIMEOUT`). It is reported, never warned about:
//!   it bounds slurmstepd's wait for the step's own tasks, which ends
//!   (or drains the node for "Kill task failed") before the Epilog runs;
//!   gpufence's kill waits are for processes outside the job's grants,
//!   one after the other with Slurm's, never inside it. What they add
//!   to the Epilog is in the Epilog's worst case.

use std::path::Path;
use std::time::Duration;

use gpufence_model::config::{Config, Layout};
use serde::Serialize;

use crate::host::slurmconf::conf_value;

/// The allowance for loading NVML and starting it (`nvmlInit`): no bound
/// in the code (the driver answers), so a fixed allowance, 2 s.
pub const NVML_START_MS: u64 = 2000;

/// The margin the suggested Slurm timeout adds to a worst case: a quarter,
/// rounded up to whole seconds ([`suggested_timeout_s`]).
pub const MARGIN_PERCENT: u64 = 25;

/// The Epilog's deadline when `epilog_deadline_ms` is unset and slurm.conf
/// gives the Epilog a timeout: this much of it, in percent. The rest is
/// for what the deadline's clock does not see (slurmd's fork and exec of
/// the Epilog, its start, a loaded node's scheduling): 1 s of a 5 s
/// timeout, 40 s of Slurm's 200 s in the shipped snippet.
pub const DEADLINE_PERCENT: u64 = 80;

/// The Epilog's deadline when `epilog_deadline_ms` is unset and slurm.conf
/// sets no Epilog timeout (or cannot be read), in ms: 60 s, Slurm's own
/// default for how long slurmstepd waits for a job's processes to die
/// before it drains the node (`DEFAULT_UNKILLABLE_TIMEOUT`,
/// `src/common/read_config.h`). Without a timeout slurmd waits for the
/// Epilog forever and the job stays COMPLETING; past 60 s a holder that
/// would not die has had the time Slurm gives its own, and the node is
/// drained instead of held.
pub const DEFAULT_DEADLINE_MS: u64 = 60_000;

/// The Epilog's total deadline ([`crate::host::deadline`]) and where it
/// comes from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EpilogDeadline {
    /// The deadline, in ms.
    pub ms: u64,
    /// Where it comes from: `epilog_deadline_ms` (gpufence.toml),
    /// `80% of EpilogTimeout=200` (or `PrologEpilogTimeout`), or
    /// `default` (slurm.conf sets no Epilog timeout, or was not read).
    pub from: String,
}

/// The Epilog's deadline: `epilog_deadline_ms` when set; else
/// [`DEADLINE_PERCENT`] of the Epilog's timeout in `slurm` (see the module
/// for which key Slurm uses); else [`DEFAULT_DEADLINE_MS`].
pub fn epilog_deadline(cfg: &Config, slurm: Option<&SlurmTimeouts>) -> EpilogDeadline {
    if let Some(ms) = cfg.epilog_deadline_ms {
        return EpilogDeadline {
            ms,
            from: "epilog_deadline_ms".into(),
        };
    }
    let unseen = if slurm.is_some_and(|t| t.has_include) {
        "; slurm.conf's Include lines not followed"
    } else {
        ""
    };
    match slurm.and_then(|t| Some((t.epilog.seconds?, t.epilog.key?))) {
        Some((s, key)) => EpilogDeadline {
            ms: s * 1000 * DEADLINE_PERCENT / 100,
            from: format!("{DEADLINE_PERCENT}% of {key}={s}{unseen}"),
        },
        None => EpilogDeadline {
            ms: DEFAULT_DEADLINE_MS,
            from: format!("default{unseen}"),
        },
    }
}

/// [`epilog_deadline`] on this host, for the Epilog: slurm.conf
/// ([`slurm_conf_path`]) is read only when `epilog_deadline_ms` is unset
/// (one read of one file, no `Include`).
pub fn host_epilog_deadline(cfg: &Config) -> EpilogDeadline {
    let slurm = cfg
        .epilog_deadline_ms
        .is_none()
        .then(|| std::fs::read_to_string(slurm_conf_path()).ok())
        .flatten()
        .map(|t| SlurmTimeouts::parse(&t));
    epilog_deadline(cfg, slurm.as_ref())
}

/// One named part of a worst case.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Part {
    /// What waits: a config key (`kill_wait_ms`) or a constant of the code
    /// (`slurmd_g`, `nvml_start`).
    pub name: &'static str,
    /// How long at most, in ms (all its occurrences together).
    pub ms: u64,
    /// How it is counted (`3 rounds x 5 x 5000`).
    pub how: String,
}

/// A hook's worst case: its parts, in the order they run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WorstCase {
    /// How long the hook may take, in ms: the sum of the parts, or the
    /// deadline and the drain's floor past it
    /// ([`crate::host::deadline::DRAIN_MIN`], 1 s) when that is shorter.
    pub total_ms: u64,
    /// The sum of the parts, in ms.
    pub waits_ms: u64,
    /// The hook's deadline (the Epilog's), which cuts its waits to fit.
    pub deadline: Option<EpilogDeadline>,
    /// The parts.
    pub parts: Vec<Part>,
}

impl WorstCase {
    fn new(parts: Vec<Part>) -> Self {
        let parts: Vec<Part> = parts.into_iter().filter(|p| p.ms > 0).collect();
        let waits_ms = parts.iter().map(|p| p.ms).sum();
        WorstCase {
            total_ms: waits_ms,
            waits_ms,
            deadline: None,
            parts,
        }
    }

    /// This worst case under `deadline`: at most its `ms`, and the 1 s
    /// a drain is given however little of it is left
    /// ([`crate::host::deadline::DRAIN_MIN`]).
    pub fn with_deadline(self, deadline: EpilogDeadline) -> Self {
        let past = crate::host::deadline::DRAIN_MIN.as_millis() as u64;
        WorstCase {
            total_ms: self.waits_ms.min(deadline.ms + past),
            deadline: Some(deadline),
            ..self
        }
    }

    /// Whether the deadline, not the sum of the waits, bounds it.
    fn cut(&self) -> bool {
        self.total_ms < self.waits_ms
    }

    /// The largest parts first, at most `n`, as `name N s`.
    pub fn dominant(&self, n: usize) -> String {
        let mut p: Vec<&Part> = self.parts.iter().collect();
        p.sort_by_key(|p| std::cmp::Reverse(p.ms));
        p.iter()
            .take(n)
            .map(|p| format!("{} {}", p.name, secs(p.ms)))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The largest part that is a gpufence.toml key (`..._ms`).
    fn largest_key(&self) -> Option<&'static str> {
        self.parts
            .iter()
            .filter(|p| p.name.ends_with("_ms"))
            .max_by_key(|p| p.ms)
            .map(|p| p.name)
    }
}

/// `ms` as seconds, one decimal when not whole.
fn secs(ms: u64) -> String {
    if ms.is_multiple_of(1000) {
        format!("{} s", ms / 1000)
    } else {
        format!("{:.1} s", ms as f64 / 1000.0)
    }
}

fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

fn part(name: &'static str, ms: u64, how: String) -> Part {
    Part { name, ms, how }
}

/// The waits of one response ([`crate::response::respond::respond`]) but
/// the evidence (its budget is one per hook): the pin's re-read
/// (`scan_budget_ms`), the freeze and the thaw
/// ([`crate::response::engine::FREEZE_WAIT`] each), `term_grace_ms`, and
/// `kill_wait_ms` (at least 100 ms) once and
/// [`crate::response::engine::EXITING_WAITS`] times more for a process on
/// its way out ([`crate::response::engine::Engine::end`]).
fn response_parts(cfg: &Config, times: u64, scans: &mut u64) -> Vec<Part> {
    use crate::response::engine::{EXITING_WAITS, FREEZE_WAIT};
    *scans += times; // the pin
    let kill = cfg.kill_wait_ms.max(100);
    let kills = 1 + u64::from(EXITING_WAITS);
    vec![
        part(
            "freeze",
            times * 2 * ms(FREEZE_WAIT),
            format!("{times} x (freeze + thaw) x {}", ms(FREEZE_WAIT)),
        ),
        part(
            "term_grace_ms",
            times * cfg.term_grace_ms,
            format!("{times} x {}", cfg.term_grace_ms),
        ),
        part(
            "kill_wait_ms",
            times * kills * kill,
            format!("{times} x (1 + EXITING_WAITS {EXITING_WAITS}) x {kill}"),
        ),
    ]
}

fn scan_part(cfg: &Config, scans: u64) -> Part {
    part(
        "scan_budget_ms",
        scans * cfg.scan_budget_ms,
        format!("{scans} scans x {}", cfg.scan_budget_ms),
    )
}

/// The Epilog's worst case ([`crate::job::epilog::run_with`]): NVML's
/// start; the MPS daemons' stop when `mps_control` is set (one daemon:
/// the lock and `quit`, [`crate::job::mps::MPS_WAIT`] each, then
/// `kill_wait_ms` for it to leave and `kill_wait_ms` for its cgroup's
/// kill); the first look (the scan and the re-read of processes not read
/// whole: two `scan_budget_ms`); `response_rounds` rounds of a response
/// and a look again; the evidence (`evidence_time_ms`, once for the
/// hook); the last look; `memory_wait_ms`; the drain's scontrol call
/// ([`crate::host::drain::SCONTROL_TIMEOUT`]) when `drain` is on.
pub fn epilog_worst_case(cfg: &Config) -> WorstCase {
    use crate::job::mps::MPS_WAIT;
    let rounds = u64::from(cfg.response_rounds.max(1));
    let mut scans = 2; // the first look: the scan and the re-read
    let mut parts = Vec::new();
    if cfg.nvml {
        parts.push(part("nvml_start", NVML_START_MS, "fixed allowance".into()));
    }
    if cfg.mps_control.is_some() {
        parts.push(part(
            "mps_stop",
            2 * ms(MPS_WAIT) + 2 * cfg.kill_wait_ms,
            format!(
                "lock {} + quit {} + 2 x kill_wait_ms {}",
                ms(MPS_WAIT),
                ms(MPS_WAIT),
                cfg.kill_wait_ms
            ),
        ));
    }
    let response = response_parts(cfg, rounds, &mut scans);
    scans += rounds * 2; // each round's look again
    scans += 2; // the last look
    parts.push(scan_part(cfg, scans));
    parts.extend(response);
    parts.push(part(
        "evidence_time_ms",
        cfg.evidence_time_ms,
        "once per hook".into(),
    ));
    if cfg.nvml {
        parts.push(part(
            "memory_wait_ms",
            cfg.memory_wait_ms,
            "once, all GPUs together".into(),
        ));
    }
    if cfg.drain {
        parts.push(part(
            "drain",
            ms(crate::host::drain::SCONTROL_TIMEOUT),
            "one scontrol call".into(),
        ));
    }
    WorstCase::new(parts)
}

/// The Prolog's worst case ([`crate::job::prolog`]): NVML's start;
/// `slurmd -G` on a cache miss ([`crate::host::gresmap::SLURMD_G_TIMEOUT`]);
/// slurmctld's view of the job for nodes of several GPU types
/// ([`crate::job::prolog::SLURMCTLD_TIMEOUT`]); a stale cgroup of the own
/// layout (`kill_wait_ms`); the clean start (the look, one response with
/// its evidence, the look again); the MPS daemon's start when
/// `mps_control` is set (the lock, `-d`, and the kill of a daemon that
/// did not start: [`crate::job::mps::MPS_WAIT`] each).
pub fn prolog_worst_case(cfg: &Config) -> WorstCase {
    use crate::job::mps::MPS_WAIT;
    let mut scans = 2;
    let mut parts = Vec::new();
    if cfg.nvml {
        parts.push(part("nvml_start", NVML_START_MS, "fixed allowance".into()));
    }
    parts.push(part(
        "slurmd_g",
        ms(crate::host::gresmap::SLURMD_G_TIMEOUT),
        "slurmd -G, when its cache is stale".into(),
    ));
    parts.push(part(
        "slurmctld",
        ms(crate::job::prolog::SLURMCTLD_TIMEOUT),
        "the job's GRES from slurmctld (several GPU types)".into(),
    ));
    if cfg.layout == Layout::Own {
        parts.push(part(
            "stale_cgroup",
            cfg.kill_wait_ms,
            "kill_wait_ms, a stale job cgroup".into(),
        ));
    }
    let response = response_parts(cfg, 1, &mut scans);
    scans += 2; // the look again
    parts.push(scan_part(cfg, scans));
    parts.extend(response);
    parts.push(part(
        "evidence_time_ms",
        cfg.evidence_time_ms,
        "once per hook".into(),
    ));
    if cfg.mps_control.is_some() {
        parts.push(part(
            "mps_start",
            3 * ms(MPS_WAIT),
            format!("lock + -d + kill, {} each", ms(MPS_WAIT)),
        ));
    }
    WorstCase::new(parts)
}

/// `worst_ms` plus [`MARGIN_PERCENT`], in whole seconds, rounded up to ten.
pub fn suggested_timeout_s(worst_ms: u64) -> u64 {
    let with = worst_ms * (100 + MARGIN_PERCENT) / 100;
    with.div_ceil(1000).div_ceil(10) * 10
}

/// Slurm's `DEFAULT_MSG_TIMEOUT` (s).
pub const DEFAULT_MESSAGE_TIMEOUT_S: u64 = 10;

/// Slurm's `DEFAULT_UNKILLABLE_TIMEOUT` (s).
pub const DEFAULT_UNKILLABLE_TIMEOUT_S: u64 = 60;

/// A hook's timeout as slurm.conf sets it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct HookTimeout {
    /// Seconds; `None`: no limit (unset, 0, 65534 or 65535).
    pub seconds: Option<u64>,
    /// The key it comes from (`EpilogTimeout`, `PrologEpilogTimeout`), or
    /// `None` when neither is set.
    pub key: Option<&'static str>,
}

/// The timeouts of slurm.conf gpufence compares with.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SlurmTimeouts {
    /// The Prolog's (`PrologTimeout`, else `PrologEpilogTimeout`).
    pub prolog: HookTimeout,
    /// The Epilog's (`EpilogTimeout`, else `PrologEpilogTimeout`).
    pub epilog: HookTimeout,
    /// `MessageTimeout` (s).
    pub message_timeout_s: u64,
    /// `UnkillableStepTimeout` (s), Slurm's default when unset.
    pub unkillable_step_timeout_s: u64,
    /// Whether the file has `Include` lines (`include` as the first word,
    /// any case: `src/common/parse_config.c`, `_parse_include_directive`),
    /// which gpufence does not follow: a timeout set in an included file
    /// is not seen.
    pub has_include: bool,
}

/// A timeout value: `None` for no limit or a value Slurm would refuse.
fn limit(v: &str) -> Option<u64> {
    match v.trim().parse::<u64>().ok()? {
        0 | 65534.. => None,
        s => Some(s),
    }
}

fn hook(text: &str, own: &'static str) -> HookTimeout {
    for key in [own, "PrologEpilogTimeout"] {
        if let Some(v) = conf_value(text, key) {
            return HookTimeout {
                seconds: limit(&v),
                key: Some(key),
            };
        }
    }
    HookTimeout {
        seconds: None,
        key: None,
    }
}

impl SlurmTimeouts {
    /// Reads them from slurm.conf `text` (see the module for Slurm's rules).
    pub fn parse(text: &str) -> Self {
        let message_timeout_s = conf_value(text, "MessageTimeout")
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(DEFAULT_MESSAGE_TIMEOUT_S);
        let unkillable_step_timeout_s = conf_value(text, "UnkillableStepTimeout")
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| {
                (message_timeout_s * 5).clamp(DEFAULT_UNKILLABLE_TIMEOUT_S, u64::from(u16::MAX))
            });
        let has_include = text.lines().any(|l| {
            l.split_whitespace()
                .next()
                .is_some_and(|w| w.eq_ignore_ascii_case("include"))
        });
        SlurmTimeouts {
            has_include,
            prolog: hook(text, "PrologTimeout"),
            epilog: hook(text, "EpilogTimeout"),
            message_timeout_s,
            unkillable_step_timeout_s,
        }
    }
}

/// What `gpufence doctor --json` shows as `timeouts`: the worst cases, the
/// site's values, and where they were read.
#[derive(Clone, Debug, Serialize)]
pub struct TimeoutsReport {
    /// The slurm.conf read.
    pub slurm_conf: String,
    /// Why it could not be read (then no Slurm value is compared).
    pub slurm_conf_error: Option<String>,
    /// The Prolog's worst case.
    pub prolog_worst: WorstCase,
    /// The Epilog's worst case.
    pub epilog_worst: WorstCase,
    /// The timeout suggested for the Epilog (its waits' sum + margin: the
    /// deadline then cuts none of them), in s.
    pub epilog_suggested_s: u64,
    /// The timeout suggested for the Prolog, in s.
    pub prolog_suggested_s: u64,
    /// The drain's bound on one scontrol call, in s.
    pub scontrol_timeout_s: u64,
    /// slurm.conf's values, when it was read.
    pub slurm: Option<SlurmTimeouts>,
    /// The warnings ([`timeout_warnings`]).
    pub warnings: Vec<String>,
    /// The Epilog's deadline ([`epilog_deadline`]).
    pub epilog_deadline: EpilogDeadline,
    /// That the Epilog fits slurm.conf's timeout, when it does.
    pub epilog_fits: Option<String>,
}

/// Whether `worst` fits a hook timeout of `s` seconds: `None` when it
/// does, else `Some(the most it may take, ms)`. Bounded by a deadline that
/// cuts its waits, the deadline must be at most [`DEADLINE_PERCENT`] of
/// the timeout (the default deadline is exactly that), leaving the rest
/// for what the deadline's clock cannot see or cut (slurmd's fork and
/// exec, NVML's start, the drain's [`crate::host::deadline::DRAIN_MIN`]);
/// else its whole worst case must be within the timeout.
fn fits_within(worst: &WorstCase, s: u64) -> Option<u64> {
    match worst.deadline.as_ref().filter(|_| worst.cut()) {
        Some(d) => {
            let most = s * 1000 * DEADLINE_PERCENT / 100;
            (d.ms > most).then_some(most)
        }
        None => (worst.total_ms > s * 1000).then_some(s * 1000),
    }
}

/// `suggest`: the timeout to set, in s (for `PrologEpilogTimeout`, the
/// larger hook's).
fn hook_warning(
    hook: &str,
    worst: &WorstCase,
    t: &HookTimeout,
    file: &str,
    suggest: u64,
) -> Option<String> {
    let (s, key) = (t.seconds?, t.key?);
    // Nothing to say when it fits.
    fits_within(worst, s)?;
    if worst.cut() {
        return Some(format!(
            "gpufence's {hook} may take up to {} at worst (its deadline, epilog_deadline_ms {}, and {} for a drain past it; its waits add up to {}), a deadline above {DEADLINE_PERCENT}% of {key}={s} in {file}: slurmd would kill it (what the deadline cannot cut, slurmd's fork and exec and NVML's start, needs the rest) and drain the node; raise {key} to {} or more, or lower epilog_deadline_ms to {} or less in gpufence.toml (unset, it is {DEADLINE_PERCENT}% of {key})",
            secs(worst.total_ms),
            worst.deadline.as_ref().map_or(worst.total_ms, |d| d.ms),
            secs(crate::host::deadline::DRAIN_MIN.as_millis() as u64),
            secs(worst.waits_ms),
            suggest,
            s * 1000 * DEADLINE_PERCENT / 100,
        ));
    }
    let largest = worst.largest_key().unwrap_or("response_rounds");
    Some(format!(
        "gpufence's {hook} may take up to {} at worst ({}), more than {key}={s} in {file}: slurmd would kill it and drain the node; raise {key} to {} or more, or lower {largest} in gpufence.toml",
        secs(worst.total_ms),
        worst.dominant(3),
        suggest,
    ))
}

/// What one holder that ignores SIGTERM needs of the Epilog, in ms:
/// `term_grace_ms` + `kill_wait_ms` + two scans (`scan_budget_ms`: the
/// look and the re-scan after the kill) + the drain's reserve under
/// `deadline_ms` ([`crate::host::deadline::reserve_for`]).
pub fn one_holder_ms(cfg: &Config, deadline_ms: u64) -> u64 {
    let reserve = crate::host::deadline::reserve_for(Duration::from_millis(deadline_ms));
    cfg.term_grace_ms + cfg.kill_wait_ms + 2 * cfg.scan_budget_ms + reserve.as_millis() as u64
}

/// A warning when the Epilog's deadline (`worst.deadline`) is shorter
/// than what one SIGTERM-ignoring holder needs ([`one_holder_ms`]): the
/// Epilog fits slurm.conf's timeout, but it cuts the grace and the kill
/// wait, and may drain a node that the whole waits would have left clean.
/// Names the timeout (`t`, in `file`) whose [`DEADLINE_PERCENT`] holds
/// them.
fn core_warning(cfg: &Config, worst: &WorstCase, t: &HookTimeout, file: &str) -> Option<String> {
    let d = worst.deadline.as_ref()?;
    let need = one_holder_ms(cfg, d.ms);
    if d.ms >= need {
        return None;
    }
    // The least timeout whose default deadline holds what one holder
    // needs under it (the reserve grows with the deadline).
    let enough = (1..=65533u64)
        .find(|t| {
            let ms = t * 1000 * DEADLINE_PERCENT / 100;
            ms >= one_holder_ms(cfg, ms)
        })
        .unwrap_or(65533);
    let raise = match (t.seconds, t.key) {
        (Some(s), Some(key)) => format!("raise {key}={s} in {file} to {enough} or more"),
        _ => "raise the Epilog's timeout in slurm.conf".into(),
    };
    Some(format!(
        "the Epilog's deadline, {} ({}), is shorter than one holder that ignores SIGTERM needs ({}: term_grace_ms {} + kill_wait_ms {} + 2 scans of scan_budget_ms {} + the drain's reserve): the Epilog cuts those waits and may drain a node the whole waits would have left clean; {raise}, or lower those keys in gpufence.toml",
        secs(d.ms),
        d.from,
        secs(need),
        cfg.term_grace_ms,
        cfg.kill_wait_ms,
        cfg.scan_budget_ms,
    ))
}

/// What slurm.conf's Epilog timeout `t` says of `worst`, when it fits
/// and a deadline bounds it ([`hook_warning`]'s rule: a deadline that
/// cuts the waits at most [`DEADLINE_PERCENT`] of the timeout): `the
/// Epilog fits EpilogTimeout=200 in FILE: at worst 156 s (its deadline,
/// 160 s (80% of EpilogTimeout=200); its waits add up to 156 s)`.
fn epilog_fits(worst: &WorstCase, t: &HookTimeout, file: &str) -> Option<String> {
    let d = worst.deadline.as_ref()?;
    let (s, key) = (t.seconds?, t.key?);
    fits_within(worst, s).is_none().then(|| {
        format!(
            "the Epilog fits {key}={s} in {file}: at worst {} (its deadline, {} ({}){}; its waits add up to {}{})",
            secs(worst.total_ms),
            secs(d.ms),
            d.from,
            if worst.cut() {
                format!(
                    ", and {} for a drain past it",
                    secs(crate::host::deadline::DRAIN_MIN.as_millis() as u64)
                )
            } else {
                String::new()
            },
            secs(worst.waits_ms),
            if worst.cut() {
                ", those past the deadline are cut"
            } else {
                ""
            }
        )
    })
}

/// One line per timeout of `slurm` that gpufence's worst cases do not fit
/// (`file` names slurm.conf in them): the Epilog's and the Prolog's; and
/// `MessageTimeout` at or above the drain's scontrol bound (scontrol could
/// be killed before slurmctld answers, and the drain lost). None when
/// everything fits or a hook has no limit.
pub fn timeout_warnings(cfg: &Config, slurm: &SlurmTimeouts, file: &str) -> Vec<String> {
    let epilog = epilog_worst_case(cfg).with_deadline(epilog_deadline(cfg, Some(slurm)));
    let prolog = prolog_worst_case(cfg);
    // The timeouts that cut nothing: with the margin (a quarter), the
    // Epilog's default deadline (80% of it) is its waits' sum.
    let both = suggested_timeout_s(epilog.waits_ms.max(prolog.waits_ms));
    let suggest = |worst: &WorstCase, t: &HookTimeout| {
        if t.key == Some("PrologEpilogTimeout") {
            both
        } else {
            suggested_timeout_s(worst.waits_ms)
        }
    };
    let mut out = Vec::new();
    out.extend(hook_warning(
        "Epilog",
        &epilog,
        &slurm.epilog,
        file,
        suggest(&epilog, &slurm.epilog),
    ));
    out.extend(hook_warning(
        "Prolog",
        &prolog,
        &slurm.prolog,
        file,
        suggest(&prolog, &slurm.prolog),
    ));
    out.extend(core_warning(cfg, &epilog, &slurm.epilog, file));
    if slurm.has_include && cfg.epilog_deadline_ms.is_none() {
        out.push(format!(
            "{file} has Include lines, which gpufence does not follow: a PrologEpilogTimeout or EpilogTimeout set in an included file is not seen, and the Epilog's deadline ({}) may be longer than slurmd's limit; set epilog_deadline_ms in gpufence.toml (at most {DEADLINE_PERCENT}% of the Epilog's timeout)",
            secs(epilog.deadline.as_ref().map_or(DEFAULT_DEADLINE_MS, |d| d.ms))
        ));
    }
    let bound = crate::host::drain::SCONTROL_TIMEOUT.as_secs();
    if cfg.drain && slurm.message_timeout_s >= bound {
        out.push(format!(
            "MessageTimeout={} in {file} is at or above the {bound} s gpufence gives one scontrol call: a drain may be killed before slurmctld answers; lower MessageTimeout below {bound}",
            slurm.message_timeout_s
        ));
    }
    out
}

/// [`TimeoutsReport`] for `cfg` and the slurm.conf at `slurm_conf`.
pub fn report(cfg: &Config, slurm_conf: &Path) -> TimeoutsReport {
    let file = slurm_conf.display().to_string();
    let (slurm, slurm_conf_error) = match std::fs::read_to_string(slurm_conf) {
        Ok(t) => (Some(SlurmTimeouts::parse(&t)), None),
        Err(e) => (None, Some(e.to_string())),
    };
    let warnings = slurm
        .as_ref()
        .map(|s| timeout_warnings(cfg, s, &file))
        .unwrap_or_default();
    let epilog_deadline = epilog_deadline(cfg, slurm.as_ref());
    let prolog_worst = prolog_worst_case(cfg);
    let epilog_worst = epilog_worst_case(cfg).with_deadline(epilog_deadline.clone());
    let epilog_fits = slurm
        .as_ref()
        .and_then(|s| epilog_fits(&epilog_worst, &s.epilog, &file));
    TimeoutsReport {
        slurm_conf: file,
        slurm_conf_error,
        prolog_suggested_s: suggested_timeout_s(prolog_worst.total_ms),
        epilog_suggested_s: suggested_timeout_s(epilog_worst.waits_ms),
        prolog_worst,
        epilog_worst,
        scontrol_timeout_s: crate::host::drain::SCONTROL_TIMEOUT.as_secs(),
        slurm,
        warnings,
        epilog_deadline,
        epilog_fits,
    }
}

/// The slurm.conf doctor and `fence status` read:
/// [`crate::host::slurmconf::slurm_conf_path`].
pub use crate::host::slurmconf::slurm_conf_path;

/// [`report`] for this host's slurm.conf ([`slurm_conf_path`]).
pub fn host_report(cfg: &Config) -> TimeoutsReport {
    report(cfg, &slurm_conf_path())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_worst_cases_are_the_stated_numbers() {
        let cfg = Config::default();
        let e = epilog_worst_case(&cfg);
        // nvml 2 + scans 13 x 2 + freeze 3 x 2 + term 3 x 5 + kill 3 x 5 x 5
        // + evidence 2 + memory 10 + drain 20.
        assert_eq!(e.total_ms, 156_000, "{e:?}");
        assert_eq!(
            e.dominant(3),
            "kill_wait_ms 75 s, scan_budget_ms 26 s, drain 20 s"
        );
        let p = prolog_worst_case(&cfg);
        // nvml 2 + slurmd -G 60 + slurmctld 10 + scans 5 x 2 + freeze 2
        // + term 5 + kill 25 + evidence 2.
        assert_eq!(p.total_ms, 116_000, "{p:?}");
        assert_eq!(suggested_timeout_s(e.total_ms), 200);
        assert_eq!(suggested_timeout_s(p.total_ms), 150);
    }

    #[test]
    fn a_key_changes_the_worst_case() {
        let base = epilog_worst_case(&Config::default()).total_ms;
        let fewer = Config {
            response_rounds: 1,
            ..Config::default()
        };
        // Two rounds less: each 2 + 5 + 25 + 3 x 2 s.
        assert_eq!(epilog_worst_case(&fewer).total_ms, base - 2 * 38_000);
        let kill = Config {
            kill_wait_ms: 1000,
            ..Config::default()
        };
        assert_eq!(epilog_worst_case(&kill).total_ms, base - 15 * 4000);
        let mps = Config {
            mps_control: Some("/usr/bin/nvidia-cuda-mps-control".into()),
            ..Config::default()
        };
        assert_eq!(epilog_worst_case(&mps).total_ms, base + 30_000);
        assert_eq!(
            prolog_worst_case(&mps).total_ms,
            prolog_worst_case(&Config::default()).total_ms + 30_000
        );
        let quiet = Config {
            drain: false,
            ..Config::default()
        };
        assert_eq!(epilog_worst_case(&quiet).total_ms, base - 20_000);
    }

    #[test]
    fn slurm_timeouts_are_read_by_slurms_rules() {
        let t = SlurmTimeouts::parse("PrologEpilogTimeout=300\n");
        assert_eq!(t.prolog.seconds, Some(300));
        assert_eq!(t.epilog.key, Some("PrologEpilogTimeout"));
        assert_eq!((t.message_timeout_s, t.unkillable_step_timeout_s), (10, 60));
        // The per-hook key wins, the other hook keeps PrologEpilogTimeout.
        let t = SlurmTimeouts::parse("EpilogTimeout=400 PrologEpilogTimeout=300\n");
        assert_eq!(
            (t.epilog.seconds, t.epilog.key),
            (Some(400), Some("EpilogTimeout"))
        );
        assert_eq!(
            (t.prolog.seconds, t.prolog.key),
            (Some(300), Some("PrologEpilogTimeout"))
        );
        let t = SlurmTimeouts::parse("PrologTimeout=50\nEpilogTimeout=65534\n");
        assert_eq!(t.prolog.seconds, Some(50));
        assert_eq!(
            (t.epilog.seconds, t.epilog.key),
            (None, Some("EpilogTimeout"))
        );
        // Unset, 0 and the infinite encodings: no limit.
        for text in [
            "",
            "PrologEpilogTimeout=0",
            "PrologEpilogTimeout=65534",
            "PrologEpilogTimeout=65535",
        ] {
            let t = SlurmTimeouts::parse(text);
            assert_eq!((t.prolog.seconds, t.epilog.seconds), (None, None), "{text}");
        }
        let t = SlurmTimeouts::parse("MessageTimeout=30\n");
        assert_eq!(
            (t.message_timeout_s, t.unkillable_step_timeout_s),
            (30, 150)
        );
        let t = SlurmTimeouts::parse("UnkillableStepTimeout=120\n");
        assert_eq!(t.unkillable_step_timeout_s, 120);
    }

    #[test]
    fn the_warnings_say_what_to_change() {
        let cfg = Config::default();
        let f = "/etc/slurm/slurm.conf";
        // The Epilog's deadline, 80% of it, fits (but is too short for one
        // SIGTERM-ignoring holder: the second line); the Prolog has none.
        let w = timeout_warnings(&cfg, &SlurmTimeouts::parse("PrologEpilogTimeout=5\n"), f);
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[1].starts_with("the Epilog's deadline, 4 s "), "{}", w[1]);
        assert!(
            w[0].starts_with("gpufence's Prolog may take up to 116 s at worst (slurmd_g 60 s,")
                && w[0].contains("raise PrologEpilogTimeout to 200 or more")
                && w[0].ends_with("or lower kill_wait_ms in gpufence.toml"),
            "{}",
            w[0]
        );
        // A deadline set above the timeout, waits that do not fit: said,
        // with the key to lower.
        let late = Config {
            epilog_deadline_ms: Some(300_000),
            ..Config::default()
        };
        let w = timeout_warnings(&late, &SlurmTimeouts::parse("EpilogTimeout=100\n"), f);
        assert_eq!(
            w,
            ["gpufence's Epilog may take up to 156 s at worst (kill_wait_ms 75 s, scan_budget_ms 26 s, drain 20 s), more than EpilogTimeout=100 in /etc/slurm/slurm.conf: slurmd would kill it and drain the node; raise EpilogTimeout to 200 or more, or lower kill_wait_ms in gpufence.toml"]
        );
        let late = Config {
            epilog_deadline_ms: Some(120_000),
            ..Config::default()
        };
        let w = timeout_warnings(&late, &SlurmTimeouts::parse("EpilogTimeout=100\n"), f);
        assert_eq!(
            w,
            ["gpufence's Epilog may take up to 121 s at worst (its deadline, epilog_deadline_ms 120000, and 1 s for a drain past it; its waits add up to 156 s), a deadline above 80% of EpilogTimeout=100 in /etc/slurm/slurm.conf: slurmd would kill it (what the deadline cannot cut, slurmd's fork and exec and NVML's start, needs the rest) and drain the node; raise EpilogTimeout to 200 or more, or lower epilog_deadline_ms to 80000 or less in gpufence.toml (unset, it is 80% of EpilogTimeout)"]
        );
        // A deadline equal to the timeout leaves nothing for what it
        // cannot cut: warned; 80% of it (the default's own) is not.
        for (ms, warned) in [(100_000, true), (80_001, true), (80_000, false)] {
            let c = Config {
                epilog_deadline_ms: Some(ms),
                ..Config::default()
            };
            let w = timeout_warnings(&c, &SlurmTimeouts::parse("EpilogTimeout=100\n"), f);
            assert_eq!(w.len(), usize::from(warned), "{ms}: {w:?}");
        }
        // Each hook its own key.
        let w = timeout_warnings(
            &late,
            &SlurmTimeouts::parse("PrologTimeout=600 EpilogTimeout=100\n"),
            f,
        );
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("a deadline above 80% of EpilogTimeout=100"),
            "{}",
            w[0]
        );
        let w = timeout_warnings(&cfg, &SlurmTimeouts::parse("PrologTimeout=100\n"), f);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("raise PrologTimeout to 150 or more"),
            "{}",
            w[0]
        );
        // Everything fits, or no limit: nothing to say.
        for text in [
            "PrologEpilogTimeout=200",
            "",
            "PrologEpilogTimeout=65534",
            "UnkillableStepTimeout=1",
        ] {
            assert!(
                timeout_warnings(&cfg, &SlurmTimeouts::parse(text), f).is_empty(),
                "{text}"
            );
        }
        // An Include line: the deadline's source says it was not
        // followed, and a warning says to set the key.
        let t = SlurmTimeouts::parse("PrologEpilogTimeout=200\ninclude /etc/slurm/timeouts.conf\n");
        assert!(t.has_include);
        assert_eq!(
            epilog_deadline(&cfg, Some(&t)).from,
            "80% of PrologEpilogTimeout=200; slurm.conf's Include lines not followed"
        );
        let w = timeout_warnings(&cfg, &t, f);
        assert_eq!(
            w,
            ["/etc/slurm/slurm.conf has Include lines, which gpufence does not follow: a PrologEpilogTimeout or EpilogTimeout set in an included file is not seen, and the Epilog's deadline (160 s) may be longer than slurmd's limit; set epilog_deadline_ms in gpufence.toml (at most 80% of the Epilog's timeout)"]
        );
        let keyed = Config {
            epilog_deadline_ms: Some(10_000),
            ..Config::default()
        };
        assert!(timeout_warnings(&keyed, &t, f)
            .iter()
            .all(|w| !w.contains("Include")));
        assert!(!SlurmTimeouts::parse("# Include x\nIncludeX=1\n").has_include);
        let w = timeout_warnings(&cfg, &SlurmTimeouts::parse("MessageTimeout=20\n"), f);
        assert_eq!(
            w,
            ["MessageTimeout=20 in /etc/slurm/slurm.conf is at or above the 20 s gpufence gives one scontrol call: a drain may be killed before slurmctld answers; lower MessageTimeout below 20"]
        );
    }

    #[test]
    fn the_report_shows_what_was_compared() {
        let d = tempfile::tempdir().unwrap();
        let conf = d.path().join("slurm.conf");
        std::fs::write(&conf, "PrologEpilogTimeout=5\n").unwrap();
        let r = report(&Config::default(), &conf);
        // The Prolog's, and the Epilog's deadline too short for one
        // SIGTERM-ignoring holder: 5 + 5 + 2 x 2 s + the reserve 0.8 s =
        // 14.8 s; 80% of 22 s holds it with its own reserve.
        assert_eq!(r.warnings.len(), 2, "{:?}", r.warnings);
        assert!(r.warnings[0].starts_with("gpufence's Prolog may take up to "));
        assert_eq!(
            r.warnings[1],
            format!(
                "the Epilog's deadline, 4 s (80% of PrologEpilogTimeout=5), is shorter than one holder that ignores SIGTERM needs (14.8 s: term_grace_ms 5000 + kill_wait_ms 5000 + 2 scans of scan_budget_ms 2000 + the drain's reserve): the Epilog cuts those waits and may drain a node the whole waits would have left clean; raise PrologEpilogTimeout=5 in {} to 22 or more, or lower those keys in gpufence.toml",
                conf.display()
            )
        );
        // The deadline, 80% of 5 s, and the drain's 1 s past it bound
        // the Epilog: it still fits.
        assert_eq!(
            (r.epilog_worst.total_ms, r.epilog_worst.waits_ms),
            (5000, 156_000)
        );
        assert_eq!(r.epilog_deadline.from, "80% of PrologEpilogTimeout=5");
        assert_eq!(
            r.epilog_fits.as_deref(),
            Some(format!(
                "the Epilog fits PrologEpilogTimeout=5 in {}: at worst 5 s (its deadline, 4 s (80% of PrologEpilogTimeout=5), and 1 s for a drain past it; its waits add up to 156 s, those past the deadline are cut)",
                conf.display()
            ))
            .as_deref()
        );
        assert_eq!(r.slurm.as_ref().unwrap().epilog.seconds, Some(5));
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["epilog_suggested_s"], 200);
        assert_eq!(v["epilog_worst"]["deadline"]["ms"], 4000);
        // The shipped snippet's 200 s: a 160 s deadline that cuts nothing.
        std::fs::write(&conf, "EpilogTimeout=200\nPrologTimeout=150\n").unwrap();
        let r = report(&Config::default(), &conf);
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
        assert_eq!(r.epilog_worst.total_ms, 156_000);
        assert!(r
            .epilog_fits
            .unwrap()
            .ends_with("at worst 156 s (its deadline, 160 s (80% of EpilogTimeout=200); its waits add up to 156 s)"));
        let gone = report(&Config::default(), &d.path().join("absent"));
        assert!(gone.slurm.is_none() && gone.slurm_conf_error.is_some());
        assert!(gone.warnings.is_empty() && gone.epilog_fits.is_none());
        assert_eq!(gone.epilog_deadline.ms, DEFAULT_DEADLINE_MS);
        assert_eq!(
            gone.epilog_worst.total_ms, 61_000,
            "the deadline and the drain's 1 s"
        );
    }

    /// The shipped slurm.conf lines, per series (contrib/package.sh picks
    /// one): each hook's limit fits its worst case with the default
    /// config, by the keys of its series, and the Epilog's deadline they
    /// make cuts none of its waits; the rest of the two files is the same.
    #[test]
    fn the_shipped_snippets_fit_the_worst_cases() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../contrib");
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
        let (old, new) = (read("slurm.conf.snippet"), read("slurm.conf.snippet-25.05"));
        let cfg = Config::default();
        for (text, key_e, key_p) in [
            (&old, "PrologEpilogTimeout", "PrologEpilogTimeout"),
            (&new, "EpilogTimeout", "PrologTimeout"),
        ] {
            let t = SlurmTimeouts::parse(text);
            assert_eq!((t.epilog.key, t.prolog.key), (Some(key_e), Some(key_p)));
            assert!(timeout_warnings(&cfg, &t, "f").is_empty(), "{text}");
            let d = epilog_deadline(&cfg, Some(&t));
            assert!(d.ms >= epilog_worst_case(&cfg).waits_ms, "{d:?}");
            assert_eq!(
                t.epilog.seconds,
                Some(suggested_timeout_s(epilog_worst_case(&cfg).waits_ms))
            );
        }
        assert!(!new.lines().any(|l| l.starts_with("PrologEpilogTimeout")));
        let settings = |t: &str| -> Vec<String> {
            t.lines()
                .filter(|l| !l.starts_with('#') && !l.contains("Timeout="))
                .map(str::to_string)
                .collect()
        };
        assert_eq!(settings(&old), settings(&new));
    }

    #[test]
    fn the_epilog_deadline_comes_from_the_key_then_slurm_conf_then_60_s() {
        let cfg = Config::default();
        let t = SlurmTimeouts::parse("PrologEpilogTimeout=10 EpilogTimeout=30\n");
        let d = epilog_deadline(&cfg, Some(&t));
        assert_eq!((d.ms, d.from.as_str()), (24_000, "80% of EpilogTimeout=30"));
        let t = SlurmTimeouts::parse("PrologEpilogTimeout=10\n");
        assert_eq!(epilog_deadline(&cfg, Some(&t)).ms, 8000);
        // No limit in slurm.conf, or none read: the fixed default.
        for t in [Some(SlurmTimeouts::parse("EpilogTimeout=65534\n")), None] {
            let d = epilog_deadline(&cfg, t.as_ref());
            assert_eq!((d.ms, d.from.as_str()), (60_000, "default"));
        }
        // The key wins over everything.
        let set = Config {
            epilog_deadline_ms: Some(1500),
            ..Config::default()
        };
        let t = SlurmTimeouts::parse("EpilogTimeout=30\n");
        let d = epilog_deadline(&set, Some(&t));
        assert_eq!((d.ms, d.from.as_str()), (1500, "epilog_deadline_ms"));
        assert_eq!(
            epilog_worst_case(&set).with_deadline(d).total_ms,
            2500,
            "the deadline and the drain's 1 s past it bound the worst case"
        );
    }
}
