//! Crash points: the named step boundaries of the prolog, the plugin's
//! grant step and the epilog, at which a test can make the process kill
//! itself with `SIGKILL`, to prove that whatever a crash leaves behind is
//! repaired by the next run (the next prolog or epilog of the job, or
//! `gpufence sweep`) and that GPUs stay closed to outsiders meanwhile.
//!
//! The switch is the process environment variable [`ENV`]
//! (`GPUFENCE_TEST_CRASH_AT=<component>:<step>`, e.g. `epilog:revoked`),
//! read with `std::env`: the environment of the `gpufence-prolog` and
//! `gpufence-epilog` binaries and of slurmd / slurmstepd, which only root
//! sets. It is never read from a job's environment (`spank_getenv`), which
//! the job's user controls: a user must not be able to stop the plugin
//! half-way. Unset (production), each boundary costs one `getenv`.
//!
//! Every boundary is listed in [`ALL`]; tests iterate over it, so a new
//! boundary is tested as soon as it is listed. A boundary is *after* the
//! step it names: `prolog:record_written` kills the prolog once the record
//! is on disk and before its audit line.

use std::fmt;

/// The environment variable that names the crash point.
pub const ENV: &str = "GPUFENCE_TEST_CRASH_AT";

/// Which part of gpufence a crash point belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Component {
    /// `gpufence-prolog` ([`crate::job::prolog::run`]).
    Prolog,
    /// The SPANK plugin's grant step in slurmstepd ([`crate::job::grant::place`],
    /// [`crate::job::grant::grant_placed`]).
    Grant,
    /// `gpufence-epilog` ([`crate::job::epilog::run_with`]).
    Epilog,
}

impl Component {
    /// The name used in [`ENV`]: `prolog`, `grant`, `epilog`.
    pub fn as_str(self) -> &'static str {
        match self {
            Component::Prolog => "prolog",
            Component::Grant => "grant",
            Component::Epilog => "epilog",
        }
    }
}

/// One step boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CrashPoint {
    /// The component.
    pub component: Component,
    /// The step just completed (`snake_case`).
    pub step: &'static str,
    /// What is done and what is not when the process dies here.
    pub state: &'static str,
}

impl fmt::Display for CrashPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.component.as_str(), self.step)
    }
}

const fn point(component: Component, step: &'static str, state: &'static str) -> CrashPoint {
    CrashPoint {
        component,
        step,
        state,
    }
}

/// Prolog: the fence was found attached; nothing changed yet.
pub const PROLOG_FENCE_CHECKED: CrashPoint = point(
    Component::Prolog,
    "fence_checked",
    "fence found attached; nothing changed",
);
/// Prolog: grants and notes an earlier job with this id left were removed.
pub const PROLOG_STALE_CLEARED: CrashPoint = point(
    Component::Prolog,
    "stale_cleared",
    "stale grants and notes of an earlier job with this id removed; no record yet",
);
/// Prolog: the record is built and the job's GPUs are free; not written.
pub const PROLOG_CLEAN_STARTED: CrashPoint = point(
    Component::Prolog,
    "clean_started",
    "record built, GPUs checked free; nothing written",
);
/// Prolog: the record is on disk; its `grant_recorded` line is not.
pub const PROLOG_RECORD_WRITTEN: CrashPoint = point(
    Component::Prolog,
    "record_written",
    "record written; no grant_recorded audit line",
);
/// Prolog: record and audit line written; only the exit is left.
pub const PROLOG_AUDITED: CrashPoint = point(
    Component::Prolog,
    "audited",
    "record and grant_recorded line written; not exited",
);
/// Grant step: the fence is there and the job cgroup found (or, `own`
/// layout, made and slurmstepd moved into it); nothing granted.
pub const GRANT_PLACED: CrashPoint = point(
    Component::Grant,
    "placed",
    "job cgroup found or made, slurmstepd in it; nothing granted",
);
/// Grant step: `grant_applied` written; no note, no grant.
pub const GRANT_AUDITED: CrashPoint = point(
    Component::Grant,
    "audited",
    "grant_applied line written; no applied note, no fence entry",
);
/// Grant step: the applied note is on disk; the fence has no entry yet.
pub const GRANT_NOTED: CrashPoint = point(
    Component::Grant,
    "noted",
    "applied note written; no fence entry",
);
/// Grant step: the fence holds the grant; only the return is left.
pub const GRANT_GRANTED: CrashPoint = point(
    Component::Grant,
    "granted",
    "fence entries written; the step would run now",
);
/// Epilog: record read, fence opened; nothing changed yet.
pub const EPILOG_STARTED: CrashPoint = point(
    Component::Epilog,
    "started",
    "record read, fence opened; grant still live",
);
/// Epilog: the job's grants are out of the fence; no `grant_revoked` line.
pub const EPILOG_REVOKED: CrashPoint = point(
    Component::Epilog,
    "revoked",
    "grants removed from the fence; no grant_revoked line",
);
/// Epilog: `grant_revoked` written; holders not looked for yet.
pub const EPILOG_REVOKE_AUDITED: CrashPoint = point(
    Component::Epilog,
    "revoke_audited",
    "grant_revoked written; holders not looked for",
);
/// Epilog: lingering holders were dealt with.
pub const EPILOG_RESPONDED: CrashPoint = point(
    Component::Epilog,
    "responded",
    "lingering holders dealt with; job cgroup (own layout) and record still there",
);
/// A response (the Epilog's, or the Prolog's clean start) has noted and
/// stopped its holders and kept no evidence yet. Reached only where there
/// are holders, so it is not in [`ALL`] (whose tests have none): tested on
/// its own (`tests/tests/holders.rs`).
pub const RESPOND_FROZEN: CrashPoint = point(
    Component::Epilog,
    "holders_frozen",
    "holders noted and stopped; no evidence, none killed",
);
/// Epilog: (own layout) the job cgroup is gone; record and notes remain.
pub const EPILOG_CGROUP_REMOVED: CrashPoint = point(
    Component::Epilog,
    "cgroup_removed",
    "job cgroup removed (own layout), modes restored, report written; record and notes remain",
);
/// Epilog: record and notes removed; drain and exit are left.
pub const EPILOG_FORGOTTEN: CrashPoint = point(
    Component::Epilog,
    "forgotten",
    "record and applied notes removed; not exited",
);

/// Every crash point, in the order a job meets them.
pub const ALL: &[CrashPoint] = &[
    PROLOG_FENCE_CHECKED,
    PROLOG_STALE_CLEARED,
    PROLOG_CLEAN_STARTED,
    PROLOG_RECORD_WRITTEN,
    PROLOG_AUDITED,
    GRANT_PLACED,
    GRANT_AUDITED,
    GRANT_NOTED,
    GRANT_GRANTED,
    EPILOG_STARTED,
    EPILOG_REVOKED,
    EPILOG_REVOKE_AUDITED,
    EPILOG_RESPONDED,
    EPILOG_CGROUP_REMOVED,
    EPILOG_FORGOTTEN,
];

/// The crash point named `name` (`component:step`).
pub fn by_name(name: &str) -> Option<CrashPoint> {
    ALL.iter().copied().find(|p| p.to_string() == name)
}

/// Whether [`ENV`] names `p`. Never panics (a non-UTF-8 value names nothing).
pub fn armed(p: CrashPoint) -> bool {
    let Some(v) = std::env::var_os(ENV) else {
        return false;
    };
    v.to_str()
        .and_then(|v| v.split_once(':'))
        .is_some_and(|(c, s)| c == p.component.as_str() && s == p.step)
}

/// Called at boundary `p`: when [`ENV`] names it, the whole process is
/// killed with `SIGKILL` here (no destructors, no flushing: a crash).
/// Otherwise returns at once.
pub fn reached(p: CrashPoint) {
    if armed(p) {
        // SAFETY: kill(2) on our own pid; SIGKILL cannot be caught, and it
        // is delivered before the syscall returns to user space.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
        // Not reached; never continue past an armed boundary.
        std::process::abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_round_trip() {
        let mut seen = std::collections::BTreeSet::new();
        for p in ALL {
            let name = p.to_string();
            assert!(seen.insert(name.clone()), "duplicate crash point {name}");
            assert_eq!(by_name(&name), Some(*p));
            assert!(
                p.step.chars().all(|c| c.is_ascii_lowercase() || c == '_'),
                "{name}"
            );
        }
        for c in [Component::Prolog, Component::Grant, Component::Epilog] {
            assert!(
                ALL.iter().filter(|p| p.component == c).count() >= 4,
                "{c:?} has its boundaries listed"
            );
        }
        assert_eq!(by_name("epilog:nowhere"), None);
    }

    #[test]
    fn unarmed_points_return() {
        // The variable is not set in unit tests: every boundary returns.
        if std::env::var_os(ENV).is_none() {
            for p in ALL {
                assert!(!armed(*p));
                reached(*p);
            }
        }
    }
}
