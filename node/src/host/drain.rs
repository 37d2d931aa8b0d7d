//! Taking the node out of service with a reason an admin can act on:
//! `scontrol update nodename=$SLURMD_NODENAME state=drain reason=...`, so
//! `sinfo -R` says what gpufence found. A failing scontrol is reported but
//! never hides the epilog's own non-zero exit.
//!
//! Every scontrol call (drain, resume, show) goes through one bounded path
//! (`scontrol`: 20 s, then killed). Each drain is recorded under
//! `state_dir/drain/` ([`gpufence_model::drainrec`]): with
//! `resume_when_clean`, `gpufence sweep` resumes only the drains that
//! record and the node's current reason both say are gpufence's.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpufence_model::audit::{events, AuditEvent};
use gpufence_model::drainrec::{parse_show_node, DrainRecord, NodeShow};

use crate::Node;

/// The longest reason passed to scontrol (Slurm stores it as a string; long
/// reasons make `sinfo -R` unreadable).
pub const MAX_REASON: usize = 200;

/// Makes `reason` safe as one scontrol argument: one line, printable ASCII,
/// at most [`MAX_REASON`] characters, prefixed with `gpufence: `.
pub fn clean_reason(reason: &str) -> String {
    let mut r: String = reason
        .chars()
        .map(|c| {
            if c.is_ascii_graphic() || c == ' ' {
                c
            } else {
                ' '
            }
        })
        .collect();
    if !r.starts_with("gpufence") {
        r = format!("gpufence: {r}");
    }
    if r.len() > MAX_REASON {
        r.truncate(MAX_REASON - 3);
        r.push_str("...");
    }
    r
}

/// How long one scontrol call may take before it is killed.
pub const SCONTROL_TIMEOUT: Duration = crate::host::deadline::SCONTROL_BOUND;

/// The most of scontrol's stdout read (`scontrol show node` prints about
/// 1 KiB per node).
const MAX_STDOUT: u64 = 64 * 1024;

/// Why scontrol could not drain, resume or show the node ([`drain`],
/// [`resume`], [`show`]); callers report it as
/// `could not drain <node>: <message>` (or resume, show).
#[derive(Debug, thiserror::Error)]
pub enum DrainError {
    /// scontrol (`scontrol_bin`) could not be started.
    #[error("{}: {source}", bin.display())]
    Spawn {
        /// The scontrol binary.
        bin: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// scontrol exited non-zero.
    #[error("scontrol {op}: {status}: {stderr}")]
    Failed {
        /// What was asked: `update nodename=<node> state=drain`, ...
        op: String,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// Its stderr, trimmed.
        stderr: String,
    },
    /// scontrol did not exit within its bound ([`SCONTROL_TIMEOUT`], or
    /// less: what was left of the Epilog's deadline): killed.
    #[error("scontrol did not answer within {} ms", .0.as_millis())]
    Timeout(Duration),
    /// Waiting for scontrol (or reading its output) failed.
    #[error(transparent)]
    Wait(std::io::Error),
    /// `scontrol show node` printed no `State=`
    /// ([`gpufence_model::drainrec::parse_show_node`]).
    #[error("scontrol show node {node_name}: no State= in its output")]
    Unparsable {
        /// The node.
        node_name: String,
    },
}

/// Runs `scontrol <args>` (the one path every scontrol call takes):
/// stdin empty, at most [`SCONTROL_TIMEOUT`], then killed and reaped.
/// `op` names the call in errors. Returns stdout (at most 64 KiB, lossy
/// UTF-8).
fn scontrol(node: &Node, args: &[String], op: &str) -> Result<String, DrainError> {
    let mut child = Command::new(&node.cfg.scontrol_bin)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| DrainError::Spawn {
            bin: node.cfg.scontrol_bin.clone(),
            source,
        })?;
    let bound = node.bound(crate::host::deadline::Wait::Drain, SCONTROL_TIMEOUT);
    let deadline = Instant::now() + bound;
    match crate::host::procs::wait_until(&mut child, deadline, Duration::from_millis(20)) {
        Ok(Some(st)) if st.success() => Ok(read_bounded(child.stdout.take())),
        Ok(Some(st)) => Err(DrainError::Failed {
            op: op.to_string(),
            status: st,
            stderr: read_bounded(child.stderr.take()).trim().to_string(),
        }),
        Ok(None) => Err(DrainError::Timeout(bound)),
        Err(e) => Err(DrainError::Wait(e)),
    }
}

/// At most [`MAX_STDOUT`] bytes of `r` (lossy UTF-8); empty when absent.
fn read_bounded<R: std::io::Read>(r: Option<R>) -> String {
    let mut b = Vec::new();
    if let Some(r) = r {
        let _ = std::io::Read::read_to_end(&mut r.take(MAX_STDOUT), &mut b);
    }
    String::from_utf8_lossy(&b).into_owned()
}

/// What caused a drain, for gpufence's record of it
/// ([`gpufence_model::drainrec::DrainRecord`]).
#[derive(Clone, Debug, Default)]
pub struct Cause {
    /// The job whose end drained the node (the Epilog).
    pub job_id: Option<u32>,
    /// The devices the cause held (`major:minor`), when known.
    pub devices: Vec<String>,
}

/// Drains `node_name` with `reason` ([`drain_for`] with no job or devices).
///
/// # Errors
/// [`DrainError`] when scontrol cannot run, times out or exits non-zero.
pub fn drain(node: &Node, node_name: &str, reason: &str) -> Result<(), DrainError> {
    drain_for(node, node_name, reason, &Cause::default())
}

/// Drains `node_name` with `reason` (made safe by [`clean_reason`]), then
/// records the drain in `state_dir/drain/<node>.json` (the reason as
/// passed, the time, `cause`; the resumes already recorded are kept) so
/// that `gpufence sweep` with `resume_when_clean` may resume it once the
/// cause is gone. A record that cannot be written is an `error` audit
/// line, never a failed drain: without it gpufence only never resumes the
/// node.
///
/// # Errors
/// [`DrainError`] when scontrol cannot run, times out or exits non-zero.
pub fn drain_for(
    node: &Node,
    node_name: &str,
    reason: &str,
    cause: &Cause,
) -> Result<(), DrainError> {
    let reason = clean_reason(reason);
    update_drain(node, node_name, &reason)?;
    let rec = DrainRecord {
        node: node_name.to_string(),
        reason,
        drained_at: chrono::Utc::now().timestamp(),
        job_id: cause.job_id,
        devices: cause
            .devices
            .iter()
            .take(gpufence_model::drainrec::MAX_DEVICES)
            .cloned()
            .collect(),
        flapping: false,
    };
    record(node, rec);
    Ok(())
}

/// Writes `rec` as the node's drain, keeping its resumes; a failure is an
/// `error` audit line.
pub(crate) fn record(node: &Node, rec: DrainRecord) {
    let name = rec.node.clone();
    let mut h = node.state.read_drain(&name).unwrap_or_default();
    h.drain = Some(rec);
    if let Err(e) = node.state.write_drain(&name, &h) {
        let _ = node.audit(
            AuditEvent::new(events::ERROR)
                .field("component", "drain")
                .field("node", name)
                .field(
                    "reason",
                    format!("{e}; gpufence will not resume this drain by itself"),
                ),
        );
    }
}

/// `scontrol update nodename=<node_name> state=drain reason=<reason>`,
/// `reason` already clean.
fn update_drain(node: &Node, node_name: &str, reason: &str) -> Result<(), DrainError> {
    scontrol(
        node,
        &[
            "update".into(),
            format!("nodename={node_name}"),
            "state=drain".into(),
            format!("reason={reason}"),
        ],
        &format!("update nodename={node_name} state=drain"),
    )
    .map(|_| ())
}

/// `scontrol update nodename=<node_name> state=resume`.
///
/// # Errors
/// [`DrainError`] when scontrol cannot run, times out or exits non-zero.
pub fn resume(node: &Node, node_name: &str) -> Result<(), DrainError> {
    scontrol(
        node,
        &[
            "update".into(),
            format!("nodename={node_name}"),
            "state=resume".into(),
        ],
        &format!("update nodename={node_name} state=resume"),
    )
    .map(|_| ())
}

/// The node's state and reason now, from `scontrol show node <node_name>`
/// ([`gpufence_model::drainrec::parse_show_node`]).
///
/// # Errors
/// [`DrainError`] when scontrol cannot run, times out or exits non-zero,
/// [`DrainError::Unparsable`] when its output has no `State=`.
pub fn show(node: &Node, node_name: &str) -> Result<NodeShow, DrainError> {
    let out = scontrol(
        node,
        &["show".into(), "node".into(), node_name.to_string()],
        &format!("show node {node_name}"),
    )?;
    parse_show_node(&out).ok_or_else(|| DrainError::Unparsable {
        node_name: node_name.to_string(),
    })
}

/// Drains `node_name` again with `reason` (already clean) and records the
/// drain as flapping: gpufence never resumes it.
///
/// # Errors
/// [`DrainError`] when scontrol cannot run, times out or exits non-zero.
pub fn drain_flapping(node: &Node, prev: &DrainRecord, reason: &str) -> Result<(), DrainError> {
    let reason = clean_reason(reason);
    update_drain(node, &prev.node, &reason)?;
    record(
        node,
        DrainRecord {
            reason,
            drained_at: chrono::Utc::now().timestamp(),
            flapping: true,
            ..prev.clone()
        },
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_are_one_safe_line() {
        assert_eq!(
            clean_reason("job 5: pid 7\nsurvived"),
            "gpufence: job 5: pid 7 survived"
        );
        assert_eq!(clean_reason("gpufence: x\t\u{7}y"), "gpufence: x  y");
        let long = clean_reason(&"x".repeat(500));
        assert_eq!(long.len(), MAX_REASON);
        assert!(long.ends_with("..."));
    }

    /// A node whose scontrol is `script` (a shell script standing in for
    /// the binary: the bounded path, its arguments, output and status;
    /// real Slurm is `tests/tests/e2e_resume.rs`).
    fn node(dir: &std::path::Path, script: &str) -> Node {
        use std::os::unix::fs::PermissionsExt;
        let bin = dir.join("scontrol");
        std::fs::write(&bin, format!("#!/bin/sh\n{script}")).unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        let text = format!(
            "state_dir = \"{d}/state\"\naudit_log = \"{d}/audit.jsonl\"\nscontrol_bin = \"{b}\"\n",
            d = dir.display(),
            b = bin.display()
        );
        let cfg =
            gpufence_model::config::Config::parse(&text, std::path::Path::new("t.toml")).unwrap();
        Node::new(cfg, gpufence_model::config::ConfigOrigin::Defaults).expect("cgroup2 mount")
    }

    #[test]
    fn drains_are_recorded_and_every_call_is_one_bounded_path() {
        let d = tempfile::tempdir().unwrap();
        let args = d.path().join("args");
        let n = node(
            d.path(),
            &format!(
                "printf '%s\\n' \"$@\" >> {a}\nif [ \"$1\" = show ]; then printf 'NodeName=n1\\n   State=IDLE+DRAIN x=1\\n   Reason=gpufence: job 5: y [root@now]\\n'; fi\n",
                a = args.display()
            ),
        );
        // Resumes already counted are kept across a new drain.
        n.state
            .write_drain(
                "n1",
                &gpufence_model::drainrec::DrainHistory {
                    drain: None,
                    resumes: vec![7],
                },
            )
            .unwrap();
        drain_for(
            &n,
            "n1",
            "job 5: y",
            &Cause {
                job_id: Some(5),
                devices: vec!["195:0".into()],
            },
        )
        .unwrap();
        let h = n.state.read_drain("n1").unwrap();
        let rec = h.drain.unwrap();
        assert_eq!(
            (rec.reason.as_str(), rec.job_id, rec.devices, rec.flapping),
            (
                "gpufence: job 5: y",
                Some(5),
                vec!["195:0".to_string()],
                false
            )
        );
        assert_eq!(h.resumes, vec![7]);
        let s = show(&n, "n1").unwrap();
        assert_eq!(s.state, "IDLE+DRAIN");
        assert_eq!(s.reason.as_deref(), Some("gpufence: job 5: y"));
        resume(&n, "n1").unwrap();
        assert_eq!(
            std::fs::read_to_string(&args).unwrap(),
            "update\nnodename=n1\nstate=drain\nreason=gpufence: job 5: y\nshow\nnode\nn1\nupdate\nnodename=n1\nstate=resume\n"
        );
        // A failing scontrol names the call and its stderr; output without
        // State= is an error, never a node state.
        let bad = tempfile::tempdir().unwrap();
        let f = node(bad.path(), "echo 'Access denied' >&2\nexit 1\n");
        let e = resume(&f, "n1").unwrap_err().to_string();
        assert!(
            e.starts_with("scontrol update nodename=n1 state=resume: exit status: 1")
                && e.ends_with(": Access denied"),
            "{e}"
        );
        let empty = tempfile::tempdir().unwrap();
        let q = node(empty.path(), "echo 'Node n1 not found'\n");
        assert!(matches!(show(&q, "n1"), Err(DrainError::Unparsable { .. })));
    }
}
