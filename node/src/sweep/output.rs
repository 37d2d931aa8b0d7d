//! What a sweep gives: the Prometheus textfile, the drain reason, the CLI's request and outcome.

use std::path::PathBuf;

use gpufence_model::audit::{events, AuditEvent};
use gpufence_model::fsutil::write_atomic;

use super::{sweep, Finding, Options, Severity, SeverityError, SweepReport};
use crate::host::drain;
use crate::Node;

pub(super) fn prom_escape(s: &str) -> String {
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
    /// The Slurm node whose gpufence drain this sweep may resume once its
    /// cause is gone, when the config's `resume_when_clean` is on
    /// ([`super::heal`]); `None`: no node is resumed.
    pub resume_node: Option<String>,
    /// See [`Options::proc_walk`].
    pub proc_walk: bool,
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
    /// The reason of the gpufence drain this sweep resumed
    /// (`resume_when_clean`), when it resumed one.
    pub resumed: Option<String>,
    /// The flapping reason the node was drained again with, when it flaps.
    pub flapping: Option<String>,
    /// What could not be done (textfile, drain, state).
    pub errors: Vec<String>,
    /// The exit status: 0 clean, 1 findings at or above the threshold, 2
    /// none but the sweep could not do all it was asked.
    pub exit: u8,
}

/// The severity that fails a sweep: `fail_on` (CLI), else the config's.
///
/// # Errors
/// [`SeverityError`] naming the bad value.
pub fn threshold(node: &Node, fail_on: Option<&str>) -> Result<Severity, SeverityError> {
    match fail_on {
        Some(s) => s.parse(),
        None => node.cfg.sweep_fail_severity.parse(),
    }
}

/// Sweeps, writes the textfile, drains when asked and something fails,
/// and (`resume_when_clean`, [`SweepRequest::resume_node`]) resumes a
/// gpufence drain whose cause this sweep found gone.
pub fn execute(node: &Node, req: &SweepRequest) -> SweepOutcome {
    let threshold = req
        .fail_on
        .or_else(|| node.cfg.sweep_fail_severity.parse().ok())
        .unwrap_or(Severity::Medium);
    let mut report = match sweep(
        node,
        &Options {
            cgroup: req.cgroup.clone(),
            cursor: req.cursor.clone(),
            proc_walk: req.proc_walk,
        },
    ) {
        Ok(r) => r,
        // Nothing was swept: no textfile (it would say "clean"), no drain.
        Err(e) => {
            return SweepOutcome {
                report: SweepReport::default(),
                threshold,
                drained: None,
                resumed: None,
                flapping: None,
                errors: vec![e.to_string()],
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
    let mut drain_failed = false;
    if let (Some(name), Some(reason)) = (&req.drain_node, drain_reason(&failing)) {
        match drain::drain(node, name, &reason) {
            Ok(()) => {
                let _ = node.audit(
                    AuditEvent::new(events::SWEEP_DRAINED)
                        .field("node", name.clone())
                        .field("drain_reason", reason.clone())
                        .field("findings", failing.len()),
                );
                drained = Some(reason);
            }
            Err(e) => {
                drain_failed = true;
                errors.push(format!("could not drain {name}: {e}"));
            }
        }
    }
    let any_failing = !failing.is_empty();
    let mut healed = super::heal::Healed::default();
    if let (true, Some(name), None) = (
        node.cfg.resume_when_clean,
        &req.resume_node,
        drained.as_ref(),
    ) {
        healed = super::heal::heal(node, name, &report, threshold);
        report.notes.append(&mut healed.notes);
        errors.append(&mut healed.errors);
    }
    // A drain that was asked for and failed is not a finding's code: the
    // node is not drained, and the caller (NHC, a timer) must hear that.
    let exit = if drain_failed {
        2
    } else if any_failing {
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
        resumed: healed.resumed,
        flapping: healed.flapping,
        errors,
        exit,
    }
}
