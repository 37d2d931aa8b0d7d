//! Self-healing drains (`resume_when_clean`): after the checks, a sweep
//! resumes the node gpufence itself drained once this sweep found the
//! cause gone, and drains it again as flapping after `resume_max` resumes
//! within `resume_window_s` ([`gpufence_model::drainrec::decide`]).
//!
//! The node's state and reason come from `scontrol show node`, never from
//! gpufence's record alone: a node an admin drained, or whose reason an
//! admin replaced, is left as it is with a note. "Gone" is this sweep's
//! own re-scan: no unfenced holder (nor one the audit-mode fence lets
//! through, nor a process not read whole), the fence installed and
//! enforcing with every major, no failed check, nothing critical and
//! nothing at or above the sweep's threshold ([`why_not_clean`]). A user
//! whose holder lives cannot get the node resumed: the holder is a
//! finding of this very sweep.

use gpufence_model::audit::{events, AuditEvent};
use gpufence_model::config::Mode;
use gpufence_model::drainrec::{decide, Decision};

use super::state::lock;
use super::{Kind, Severity, SweepReport};
use crate::host::drain;
use crate::Node;

/// What the heal step did, for the sweep's outcome.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Healed {
    /// The reason of the drain gpufence resumed, when it resumed one.
    pub resumed: Option<String>,
    /// The flapping reason the node was drained again with.
    pub flapping: Option<String>,
    /// Lines for the report's notes (left as it is, forgotten, why).
    pub notes: Vec<String>,
    /// What could not be done (scontrol, the record).
    pub errors: Vec<String>,
}

/// Kinds that keep a drain whatever their severity: a holder outside every
/// grant (or one the fence would deny), a process not read whole, a fence
/// not installed, not enforcing or missing a major, a foreign process in
/// an MPS daemon's cgroup, a GPU in use without a grant, a check that did
/// not run.
pub const KEEP_DRAINED: &[Kind] = &[
    Kind::UnfencedGpuHolder,
    Kind::AuditGpuHolder,
    Kind::NotReadWhole,
    Kind::FenceNotAttached,
    Kind::FenceNotEnforcing,
    Kind::UnprotectedMajor,
    Kind::MpsForeignProcess,
    Kind::GpuBusyWithoutGrant,
    Kind::CheckFailed,
];

/// `Ok` when `report` shows the node clean enough to resume: the fence
/// installed and the config enforcing (`audit` is `mode = "audit"`), no
/// io_uring ring left unread ([`SweepReport::unread_rings`]), and no
/// finding that is critical, at or above `threshold`, or of a
/// [`KEEP_DRAINED`] kind. `Err` says why not: how many findings keep it and
/// the worst one's kind and summary.
pub fn why_not_clean(report: &SweepReport, threshold: Severity, audit: bool) -> Result<(), String> {
    if !report.fence_installed {
        return Err("the fence is not installed".into());
    }
    if audit {
        return Err("the fence runs in audit mode (mode = \"audit\"): it enforces nothing".into());
    }
    if report.unread_rings > 0 {
        return Err(format!(
            "{} io_uring ring(s) not read whole: their processes may hold a GPU",
            report.unread_rings
        ));
    }
    let keep: Vec<_> = report
        .findings
        .iter()
        .filter(|f| {
            f.severity >= threshold
                || f.severity >= Severity::Critical
                || KEEP_DRAINED.contains(&f.kind)
        })
        .collect();
    match keep.iter().max_by_key(|f| f.severity) {
        None => Ok(()),
        Some(w) => Err(format!(
            "{} finding(s) remain, the worst {} {}{}: {}",
            keep.len(),
            w.severity,
            w.kind,
            w.pid.map(|p| format!(" pid {p}")).unwrap_or_default(),
            w.summary
        )),
    }
}

/// Resumes `node_name` when its drain is gpufence's and `report` (this
/// sweep, at `threshold`) found its cause gone; drains it as flapping at
/// `resume_max` resumes within `resume_window_s`. Under the sweep lock.
/// Every resume is audited (`node_resumed`: the old reason, when it was
/// drained, the resumes in the window, the job and devices when recorded), every flap too
/// (`node_flapping`).
pub fn heal(node: &Node, node_name: &str, report: &SweepReport, threshold: Severity) -> Healed {
    let mut out = Healed::default();
    let _lock = match lock(node) {
        Ok(l) => l,
        Err(e) => {
            out.errors.push(format!("resume_when_clean: {e}"));
            return out;
        }
    };
    let mut hist = match node.state.read_drain(node_name) {
        Ok(h) => h,
        Err(e) => {
            out.errors.push(format!(
                "resume_when_clean: {e}; gpufence resumes nothing until it is removed"
            ));
            return out;
        }
    };
    // No drain of gpufence's on record: nothing to resume, and no
    // `scontrol show node` (a call to slurmctld) from every node at every
    // sweep.
    if hist.drain.is_none() {
        return out;
    }
    let show = match drain::show(node, node_name) {
        Ok(s) => s,
        Err(e) => {
            // Nothing known of the node: nothing resumed.
            if hist.drain.is_some() {
                out.errors.push(format!(
                    "resume_when_clean: could not read node {node_name}: {e}"
                ));
            }
            return out;
        }
    };
    let clean = why_not_clean(report, threshold, node.cfg.mode == Mode::Audit);
    let now = chrono::Utc::now().timestamp();
    let (max, window) = (node.cfg.resume_max, node.cfg.resume_window_s);
    match decide(
        &show,
        &hist,
        clean.as_ref().map(|_| ()).map_err(String::as_str),
        now,
        max,
        window,
    ) {
        Decision::Nothing => {}
        Decision::Leave(n) => out.notes.push(n),
        Decision::Forget {
            note,
            reset_resumes,
        } => {
            hist.drain = None;
            if reset_resumes {
                hist.resumes.clear();
            }
            out.notes.push(note);
            if let Err(e) = node.state.write_drain(node_name, &hist) {
                out.errors.push(format!("resume_when_clean: {e}"));
            }
        }
        Decision::Resume { resumes_in_window } => {
            let Some(rec) = hist.drain.clone() else {
                return out;
            };
            match drain::resume(node, node_name) {
                Ok(()) => {
                    hist.note_resume(now, window);
                    if let Err(e) = node.state.write_drain(node_name, &hist) {
                        out.errors.push(format!(
                            "resume_when_clean: node {node_name} resumed, but {e}: its resume is not counted"
                        ));
                    }
                    let mut ev = AuditEvent::new(events::NODE_RESUMED)
                        .field("node", node_name.to_string())
                        .field("old_reason", rec.reason.clone())
                        .field("drained_at", rec.drained_at)
                        .field("resumes_in_window", resumes_in_window)
                        .field("resume_max", max)
                        .field("resume_window_s", window);
                    if let Some(j) = rec.job_id {
                        ev = ev.job(j);
                    }
                    if !rec.devices.is_empty() {
                        // `devices` is a reserved key: `field` would drop it.
                        ev = ev.devices(&rec.devices);
                    }
                    let _ = node.audit(ev);
                    out.resumed = Some(rec.reason);
                }
                Err(e) => out
                    .errors
                    .push(format!("could not resume {node_name}: {e}")),
            }
        }
        Decision::Flap {
            reason,
            resumes_in_window,
        } => {
            let Some(rec) = hist.drain.clone() else {
                return out;
            };
            match drain::drain_flapping(node, &rec, &reason) {
                Ok(()) => {
                    let reason = drain::clean_reason(&reason);
                    let _ = node.audit(
                        AuditEvent::new(events::NODE_FLAPPING)
                            .field("node", node_name.to_string())
                            .field("old_reason", rec.reason.clone())
                            .field("drained_at", rec.drained_at)
                            .field("resumes_in_window", resumes_in_window)
                            .field("drain_reason", reason.clone()),
                    );
                    out.flapping = Some(reason);
                }
                Err(e) => out.errors.push(format!("could not drain {node_name}: {e}")),
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sweep::Finding;
    use serde_json::json;

    fn report(kinds: &[Kind]) -> SweepReport {
        SweepReport {
            fence_installed: true,
            findings: kinds
                .iter()
                .map(|k| Finding::new(*k, "x", json!({})))
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn clean_means_fence_enforcing_and_nothing_that_keeps_a_drain() {
        let m = Severity::Medium;
        assert_eq!(why_not_clean(&report(&[]), m, false), Ok(()));
        // Below the threshold and not blocking: clean.
        assert_eq!(
            why_not_clean(&report(&[Kind::DeniedOpen, Kind::StaleGrant]), m, false),
            Ok(())
        );
        // A holder, even one the audit-mode fence lets through (low).
        for k in [
            Kind::UnfencedGpuHolder,
            Kind::AuditGpuHolder,
            Kind::NotReadWhole,
            Kind::FenceNotEnforcing,
            Kind::CheckFailed,
            Kind::GpuBusyWithoutGrant,
        ] {
            let e = why_not_clean(&report(&[Kind::DeniedOpen, k]), Severity::Critical, false)
                .unwrap_err();
            assert!(e.starts_with("1 finding(s) remain, the worst "), "{e}");
            assert!(e.contains(k.as_str()), "{e}");
        }
        // At the threshold.
        assert_eq!(
            why_not_clean(&report(&[Kind::PersistenceCron]), m, false),
            Err("1 finding(s) remain, the worst medium persistence_cron: x".into())
        );
        assert_eq!(
            why_not_clean(&report(&[Kind::PersistenceCron]), Severity::High, false),
            Ok(())
        );
        // Critical whatever the threshold.
        assert!(why_not_clean(&report(&[Kind::MiningCmdline]), Severity::Critical, false).is_err());
        // No fence, or a fence in audit mode.
        let mut r = report(&[]);
        r.fence_installed = false;
        assert_eq!(
            why_not_clean(&r, m, false),
            Err("the fence is not installed".into())
        );
        assert!(why_not_clean(&report(&[]), m, true)
            .unwrap_err()
            .contains("audit mode"));
        // A ring not read whole may hold a GPU.
        let mut r = report(&[]);
        r.unread_rings = 1;
        assert_eq!(
            why_not_clean(&r, m, false),
            Err("1 io_uring ring(s) not read whole: their processes may hold a GPU".into())
        );
    }
}
