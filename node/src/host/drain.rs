//! Taking the node out of service with a reason an admin can act on:
//! `scontrol update nodename=$SLURMD_NODENAME state=drain reason=...`, so
//! `sinfo -R` says what gpufence found. A failing scontrol is reported but
//! never hides the epilog's own non-zero exit.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

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

/// Why the node could not be drained ([`drain`]); callers report it as
/// `could not drain <node>: <message>`.
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
    #[error("scontrol update nodename={node_name} state=drain: {status}: {stderr}")]
    Failed {
        /// The node.
        node_name: String,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// Its stderr, trimmed.
        stderr: String,
    },
    /// scontrol did not exit within 20 s: killed.
    #[error("scontrol did not answer within 20 s")]
    Timeout,
    /// Waiting for scontrol failed.
    #[error(transparent)]
    Wait(std::io::Error),
}

/// Drains `node_name` with `reason`.
///
/// # Errors
/// [`DrainError`] when scontrol cannot run, times out or exits non-zero.
pub fn drain(node: &Node, node_name: &str, reason: &str) -> Result<(), DrainError> {
    let reason = clean_reason(reason);
    let mut child = Command::new(&node.cfg.scontrol_bin)
        .args([
            "update",
            &format!("nodename={node_name}"),
            "state=drain",
            &format!("reason={reason}"),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| DrainError::Spawn {
            bin: node.cfg.scontrol_bin.clone(),
            source,
        })?;
    let deadline = Instant::now() + Duration::from_secs(20);
    match crate::host::procs::wait_until(&mut child, deadline, Duration::from_millis(20)) {
        Ok(Some(st)) if st.success() => Ok(()),
        Ok(Some(st)) => {
            let mut msg = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut msg);
            }
            Err(DrainError::Failed {
                node_name: node_name.to_string(),
                status: st,
                stderr: msg.trim().to_string(),
            })
        }
        Ok(None) => Err(DrainError::Timeout),
        Err(e) => Err(DrainError::Wait(e)),
    }
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
}
