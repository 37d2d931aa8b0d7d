//! The Epilog's total deadline (`epilog_deadline_ms`): every wait on its
//! path asks [`Deadline::bound`] how long it may wait, and gets its own
//! bound cut to what is left of the deadline, less a reserve for what must
//! still happen after it. Each cut is kept, and said once the Epilog ends
//! ([`Deadline::lines`]).
//!
//! The reserve ([`reserve_for`]) is for the drain's scontrol call, the
//! last thing the Epilog does ([`Wait::Drain`] alone may use it). The
//! drain gets at least [`DRAIN_MIN`] (1 s) however little is left, even
//! past the deadline: a node that must drain is drained. A wait
//! that another must follow keeps room for it: `term_grace_ms` takes at
//! most half of what is there, so that the kill wait after SIGKILL can see
//! the holder gone ([`Wait::share`]).
//!
//! Cutting a wait never hands on a GPU: a holder still alive when its kill
//! wait was cut is a survivor, a scan cut short leaves processes not read
//! (both drain the node), memory not back when its wait was cut is a
//! survivor. Not bounded by the deadline (the fifth of slurmd's timeout it
//! leaves by default is for these): a call into the driver (NVML); the
//! whole-node `/proc` walk used where the kernel iterators cannot load; the
//! audit log's and `state_dir`'s locks; one `/proc` read of a process
//! between two checks of the evidence budget.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The drain's bound on one scontrol call, 20 s: [`crate::host::drain`]
/// takes it from here (drain asks this module for its cut, so this module
/// names no item of drain's).
pub const SCONTROL_BOUND: Duration = Duration::from_secs(20);

/// The most of the reserve: the drain's bound on one scontrol call
/// ([`SCONTROL_BOUND`]).
const RESERVE_MAX: Duration = SCONTROL_BOUND;

/// The least of the reserve: an `scontrol update` answered by a live
/// slurmctld on the same network takes tens of ms.
const RESERVE_MIN: Duration = Duration::from_millis(200);

/// The least the drain's scontrol call is given, whatever is left of the
/// deadline (even nothing): 1 s, for scontrol's start-up, its munge
/// credential and slurmctld's answer (tens of ms on a live one). The
/// drain may so end up to 1 s past the deadline: by default the deadline
/// is [`crate::job::timeouts::DEADLINE_PERCENT`] (80 %) of slurmd's
/// Epilog timeout, so slurmd's own limit lies a quarter of the deadline
/// (a fifth of the timeout) beyond it, at least 1 s for any Epilog
/// timeout of 5 s or more.
pub const DRAIN_MIN: Duration = Duration::from_secs(1);

/// A wait on the Epilog's path that the deadline may cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Wait {
    /// Between SIGTERM and SIGKILL (`term_grace_ms`).
    TermGrace,
    /// For a holder the response engine killed to be gone
    /// (`kill_wait_ms`): the only kill wait whose cut may leave a holder
    /// "not seen gone after SIGKILL".
    KillWait,
    /// For a process still exiting once `kill_wait_ms` is over
    /// ([`crate::response::engine::EXITING_WAITS`] x `kill_wait_ms`).
    Exiting,
    /// For a cgroup to report frozen or thawed
    /// ([`crate::response::engine::FREEZE_WAIT`]).
    Freeze,
    /// One scan or re-read of the holders (`scan_budget_ms`).
    ScanBudget,
    /// Hashing executables for the evidence (`evidence_time_ms`).
    Evidence,
    /// For the GPUs' memory to come back (`memory_wait_ms`).
    MemoryWait,
    /// For an MPS daemon's lock or control command
    /// ([`crate::host::mps_cgroups::MPS_WAIT`]).
    Mps,
    /// For an MPS daemon's processes, or a foreign process on it, to be
    /// gone once killed (`kill_wait_ms`, at least 1 s for a daemon's
    /// cgroup).
    MpsKill,
    /// The user's `--gpufence-report` writer (`job::report::WRITE_TIMEOUT`).
    Report,
    /// For the report writer's cgroup to be empty once killed (fixed 1 s
    /// or 2 s, `job::report`).
    ReportKill,
    /// For the leftovers of the job's own cgroup (`layout = "own"`) to be
    /// gone once killed (`kill_wait_ms`).
    LeftoverKill,
    /// The job map's lock (`job::jobmap::LOCK_WAIT`).
    JobMap,
    /// The drain's scontrol call ([`SCONTROL_BOUND`]).
    Drain,
}

impl Wait {
    /// Its name in what the Epilog says: the gpufence.toml key, or what
    /// the code waits for.
    pub fn name(self) -> &'static str {
        match self {
            Wait::TermGrace => "term_grace_ms",
            Wait::KillWait => "kill_wait_ms",
            Wait::Exiting => "the wait for a process still exiting",
            Wait::Freeze => "the freeze wait",
            Wait::ScanBudget => "scan_budget_ms",
            Wait::Evidence => "evidence_time_ms",
            Wait::MemoryWait => "memory_wait_ms",
            Wait::Mps => "the MPS daemon's wait",
            Wait::MpsKill => "the MPS kill wait",
            Wait::Report => "the report writer's wait",
            Wait::ReportKill => "the report writer's kill wait",
            Wait::LeftoverKill => "the job cgroup's leftovers' kill wait (kill_wait_ms)",
            Wait::JobMap => "the job map's lock wait",
            Wait::Drain => "the drain's scontrol call",
        }
    }

    /// The part of what is left (less the reserve) it may take, in
    /// percent: a wait another must follow keeps room for it.
    pub fn share(self) -> u64 {
        match self {
            Wait::TermGrace | Wait::Mps | Wait::Report | Wait::JobMap => 50,
            Wait::Freeze | Wait::Evidence => 25,
            _ => 100,
        }
    }

    /// Whether the reserve is kept from it (all but the drain itself).
    fn keeps_reserve(self) -> bool {
        self != Wait::Drain
    }
}

/// The reserve a deadline of `total` keeps for the drain: a fifth of it,
/// within 200 ms and 20 s.
pub fn reserve_for(total: Duration) -> Duration {
    (total / 5).clamp(RESERVE_MIN, RESERVE_MAX)
}

/// How long `wait`, bound to `configured`, may wait with `left` of the
/// deadline and `reserve` kept: `configured`, or less when what is left
/// (less the reserve, unless `wait` is the drain) times its share is
/// less. Zero when nothing is left, but for the drain: at least
/// [`DRAIN_MIN`] (or `configured`, if less).
pub fn allowed(wait: Wait, configured: Duration, left: Duration, reserve: Duration) -> Duration {
    let room = if wait.keeps_reserve() {
        left.saturating_sub(reserve)
    } else {
        left.max(DRAIN_MIN)
    };
    let room = room * wait.share() as u32 / 100;
    configured.min(room)
}

/// A wait the deadline cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cut {
    /// Which.
    pub wait: Wait,
    /// Its own bound.
    pub configured: Duration,
    /// What it was given (zero: skipped).
    pub given: Duration,
}

/// The Epilog's deadline: when it ends, and the waits it cut.
#[derive(Debug)]
pub struct Deadline {
    total: Duration,
    end: Instant,
    reserve: Duration,
    cuts: Mutex<Vec<Cut>>,
}

impl Deadline {
    /// A deadline `total` from now, with [`reserve_for`] `total` kept.
    pub fn new(total: Duration) -> Self {
        Deadline {
            total,
            end: Instant::now() + total,
            reserve: reserve_for(total),
            cuts: Mutex::new(Vec::new()),
        }
    }

    /// The whole deadline.
    pub fn total(&self) -> Duration {
        self.total
    }

    /// What is left of it.
    pub fn left(&self) -> Duration {
        self.end.saturating_duration_since(Instant::now())
    }

    /// How long `wait` may wait now ([`allowed`]); a cut is kept.
    pub fn bound(&self, wait: Wait, configured: Duration) -> Duration {
        let given = allowed(wait, configured, self.left(), self.reserve);
        if given < configured {
            if let Ok(mut c) = self.cuts.lock() {
                c.push(Cut {
                    wait,
                    configured,
                    given,
                });
            }
        }
        given
    }

    /// The waits cut so far, in the order they were.
    pub fn cuts(&self) -> Vec<Cut> {
        self.cuts.lock().map(|c| c.clone()).unwrap_or_default()
    }

    /// One line per wait it cut (the same wait with the same bound cut
    /// several times: one line), each naming the wait and its own bound:
    /// `epilog_deadline_ms 1500: waited at most 550 ms of term_grace_ms 5000`,
    /// `epilog_deadline_ms 1500: skipped kill_wait_ms 5000 (nothing left)`,
    /// `epilog_deadline_ms 1500: cut scan_budget_ms 2000 3 times, to 0-640 ms`.
    pub fn lines(&self) -> Vec<String> {
        lines(self.total, &self.cuts())
    }
}

/// Whether `cuts` hold a cut of the response engine's own kill waits
/// ([`Wait::KillWait`], [`Wait::Exiting`]): only then may a holder still
/// alive be "not seen gone after SIGKILL" rather than a survivor of it.
/// The report writer's, the MPS daemon's and the leftovers' kill waits
/// ([`Wait::ReportKill`], [`Wait::MpsKill`], [`Wait::LeftoverKill`]) are
/// no holder's.
pub fn kill_cut(cuts: &[Cut]) -> bool {
    cuts.iter()
        .any(|c| matches!(c.wait, Wait::KillWait | Wait::Exiting))
}

/// [`Deadline::lines`] for a deadline of `total` and its `cuts`.
pub fn lines(total: Duration, cuts: &[Cut]) -> Vec<String> {
    let mut waits: Vec<(Wait, Duration)> = cuts.iter().map(|c| (c.wait, c.configured)).collect();
    waits.sort();
    waits.dedup();
    let t = total.as_millis();
    waits
        .into_iter()
        .map(|(w, configured)| {
            let of: Vec<&Cut> = cuts
                .iter()
                .filter(|c| c.wait == w && c.configured == configured)
                .collect();
            let conf = configured.as_millis();
            let lo = of.iter().map(|c| c.given).min().unwrap_or_default();
            let hi = of.iter().map(|c| c.given).max().unwrap_or_default();
            match (of.len(), hi.is_zero()) {
                (1, true) => format!(
                    "epilog_deadline_ms {t}: skipped {} {conf} (nothing left)",
                    w.name()
                ),
                (1, false) => format!(
                    "epilog_deadline_ms {t}: waited at most {} ms of {} {conf}",
                    hi.as_millis(),
                    w.name()
                ),
                (n, _) => format!(
                    "epilog_deadline_ms {t}: cut {} {conf} {n} times, to {}-{} ms",
                    w.name(),
                    lo.as_millis(),
                    hi.as_millis()
                ),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn the_reserve_is_a_fifth_within_its_bounds() {
        assert_eq!(reserve_for(ms(1500)), ms(300));
        assert_eq!(reserve_for(ms(500)), ms(200));
        assert_eq!(reserve_for(ms(60_000)), ms(12_000));
        assert_eq!(reserve_for(ms(160_000)), ms(20_000));
    }

    #[test]
    fn a_wait_is_cut_to_what_is_left_less_the_reserve() {
        let r = ms(300);
        // Room enough: the wait's own bound.
        assert_eq!(allowed(Wait::KillWait, ms(5000), ms(9000), r), ms(5000));
        // Less room: what is left less the reserve.
        assert_eq!(allowed(Wait::KillWait, ms(5000), ms(1300), r), ms(1000));
        assert_eq!(allowed(Wait::MemoryWait, ms(10_000), ms(2300), r), ms(2000));
        // term_grace_ms keeps half for the kill wait that follows it.
        assert_eq!(allowed(Wait::TermGrace, ms(5000), ms(1300), r), ms(500));
        assert_eq!(allowed(Wait::TermGrace, ms(5000), ms(20_300), r), ms(5000));
        // Nothing left past the reserve: skipped.
        assert_eq!(allowed(Wait::ScanBudget, ms(2000), ms(200), r), ms(0));
        assert_eq!(allowed(Wait::KillWait, ms(5000), ms(0), r), ms(0));
        // The drain may use the reserve, and what is left past 1 s.
        assert_eq!(allowed(Wait::Drain, ms(20_000), ms(1250), r), ms(1250));
        assert_eq!(allowed(Wait::Drain, ms(20_000), ms(60_000), r), ms(20_000));
        // It gets 1 s however little is left, even nothing.
        assert_eq!(allowed(Wait::Drain, ms(20_000), ms(250), r), DRAIN_MIN);
        assert_eq!(allowed(Wait::Drain, ms(20_000), ms(0), r), DRAIN_MIN);
        assert_eq!(allowed(Wait::Drain, ms(500), ms(0), r), ms(500));
        // Other kill waits are cut as kill_wait_ms is, and no floor.
        assert_eq!(allowed(Wait::ReportKill, ms(2000), ms(0), r), ms(0));
        assert_eq!(allowed(Wait::MpsKill, ms(5000), ms(1300), r), ms(1000));
    }

    #[test]
    fn a_deadline_keeps_its_cuts_and_says_each_wait_once() {
        let d = Deadline::new(ms(1500));
        // Plenty within a long bound's reach: not a cut.
        assert_eq!(d.bound(Wait::Freeze, ms(1)), ms(1));
        let g = d.bound(Wait::TermGrace, ms(5000));
        assert!(g <= ms(600) && g > ms(0), "{g:?}");
        assert!(d.bound(Wait::ScanBudget, ms(2000)) <= ms(1200));
        assert!(d.bound(Wait::ScanBudget, ms(2000)) <= ms(1200));
        assert_eq!(d.cuts().len(), 3);
        let l = d.lines();
        assert_eq!(l.len(), 2, "{l:?}");
        assert!(
            l[0].starts_with("epilog_deadline_ms 1500: waited at most ")
                && l[0].ends_with(" ms of term_grace_ms 5000"),
            "{}",
            l[0]
        );
        assert!(
            l[1].starts_with("epilog_deadline_ms 1500: cut scan_budget_ms 2000 2 times, to "),
            "{}",
            l[1]
        );
    }

    /// A drain at the deadline's end is still given its floor (and no
    /// cut is kept when it gets its own bound).
    #[test]
    fn a_drain_past_the_deadline_gets_its_floor() {
        let d = Deadline::new(ms(0));
        assert_eq!(d.bound(Wait::Drain, ms(20_000)), DRAIN_MIN);
        assert_eq!(d.bound(Wait::KillWait, ms(5000)), ms(0));
    }

    /// Only the response engine's kill waits make a kill cut.
    #[test]
    fn only_the_responses_kill_waits_make_a_kill_cut() {
        let cut = |wait| Cut {
            wait,
            configured: ms(2000),
            given: ms(0),
        };
        for w in [
            Wait::ReportKill,
            Wait::MpsKill,
            Wait::LeftoverKill,
            Wait::TermGrace,
            Wait::Drain,
        ] {
            assert!(!kill_cut(&[cut(w)]), "{w:?}");
        }
        assert!(kill_cut(&[cut(Wait::ReportKill), cut(Wait::KillWait)]));
        assert!(kill_cut(&[cut(Wait::Exiting)]));
        assert!(!kill_cut(&[]));
    }

    /// Each line names its own wait and that wait's own bound: the report
    /// writer's 2 s kill wait is not said to be `kill_wait_ms`, and one
    /// wait cut at two bounds is two lines.
    #[test]
    fn each_line_names_its_own_wait_and_bound() {
        let cut = |wait, configured, given| Cut {
            wait,
            configured: ms(configured),
            given: ms(given),
        };
        let cuts = [
            cut(Wait::ReportKill, 2000, 0),
            cut(Wait::KillWait, 5000, 300),
            cut(Wait::ReportKill, 1000, 0),
            cut(Wait::KillWait, 5000, 100),
        ];
        assert_eq!(
            lines(ms(1500), &cuts),
            [
                "epilog_deadline_ms 1500: cut kill_wait_ms 5000 2 times, to 100-300 ms",
                "epilog_deadline_ms 1500: skipped the report writer's kill wait 1000 (nothing left)",
                "epilog_deadline_ms 1500: skipped the report writer's kill wait 2000 (nothing left)",
            ]
        );
    }

    #[test]
    fn the_lines_say_what_was_skipped() {
        let cuts = [
            Cut {
                wait: Wait::KillWait,
                configured: ms(5000),
                given: ms(0),
            },
            Cut {
                wait: Wait::Drain,
                configured: ms(20_000),
                given: ms(180),
            },
        ];
        assert_eq!(
            lines(ms(8000), &cuts),
            [
                "epilog_deadline_ms 8000: skipped kill_wait_ms 5000 (nothing left)",
                "epilog_deadline_ms 8000: waited at most 180 ms of the drain's scontrol call 20000",
            ]
        );
    }
}
