//! `gpufence exec -- CMD`: root runs an admin command (`nvidia-smi`, a
//! diagnostic) in a dedicated exempt cgroup, with audit lines naming who ran
//! what and how it ended. The cgroup is `<cgroup_root>/<exec_cgroup>/<pid>`;
//! `exec_cgroup` is always in the fence's exemptions.

use std::ffi::OsString;
use std::process::Command;

use gpufence_model::audit::{events, AuditEvent};

use crate::host::exec_cgroup::exempt_leaf;
use crate::host::fence_ops::open_installed;
use crate::host::procs::who;
use crate::{Node, NodeError};

/// Runs `argv` in the exempt cgroup and returns its exit code (128+signal
/// when killed; 127 when the command is not found and 126 when it cannot
/// run, as a shell says it, after one line on stderr). The `exec_end`
/// audit line has the same code.
///
/// # Errors
/// [`NodeError`] when not root, the fence is missing, the cgroup cannot be
/// made, or the command cannot start.
pub fn exec(node: &Node, argv: &[OsString]) -> Result<i32, NodeError> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(NodeError::ExecNotRoot);
    }
    let Some((prog, args)) = argv.split_first() else {
        return Err(NodeError::ExecNoCommand);
    };
    let fence = open_installed(node)?;
    let mine = exempt_leaf(node, &fence, &std::process::id().to_string())?;
    let who = who();
    let cmdline: Vec<String> = argv
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    node.audit(
        AuditEvent::new(events::EXEC_START)
            .field("who", who.clone())
            .field("argv", cmdline.clone())
            .field("cgroup", crate::host::cgpath::abs(&mine)),
    )?;
    let mut cmd = Command::new(prog);
    cmd.args(args);
    node.cg.join_at_exec(&mine, &mut cmd)?;
    let status = cmd.status();
    // As a shell says it: 127 not found, 126 found but not runnable.
    let code = match &status {
        Ok(s) => s
            .code()
            .unwrap_or_else(|| 128 + std::os::unix::process::ExitStatusExt::signal(s).unwrap_or(0)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => 127,
        Err(_) => 126,
    };
    let mut end = AuditEvent::new(events::EXEC_END)
        .field("who", who)
        .field("argv", cmdline)
        .field("exit_code", code);
    if let Err(e) = &status {
        end = end.field("error", e.to_string());
    }
    // What the command left running in the exempt leaf (a daemon it
    // started, `cmd &`) would keep every GPU open to it: ended, named.
    let left = end_leftovers(node, &mine);
    if !left.is_empty() {
        end = end.field("left_running", left.len());
    }
    let _ = node.audit(end);
    if !left.is_empty() {
        eprintln!(
            "gpufence: exec: the command left {} process(es) running in its exempt cgroup ({}): ended; run daemons as services, not through gpufence exec",
            left.len(),
            describe(&left)
        );
    }
    let _ = node.cg.remove_tree(&mine);
    if let Err(e) = status {
        eprintln!(
            "gpufence: exec: cannot run {}: {e}",
            std::path::Path::new(prog).display()
        );
    }
    Ok(code)
}

/// `pid comm` for each of `pids`, comma-separated (the first 20).
fn describe(pids: &[(i32, String)]) -> String {
    let mut out: Vec<String> = pids
        .iter()
        .take(20)
        .map(|(p, c)| format!("{p} {}", gpufence_model::text::printable(c)))
        .collect();
    if pids.len() > 20 {
        out.push(format!("and {} more", pids.len() - 20));
    }
    out.join(", ")
}

/// Ends what is left in the exec leaf `leaf` once its command returned
/// and removes the leaf ([`gpufence_cgroup::Cgroup2::kill_and_remove`]), audits `exec_leftover` with each
/// process and returns them: `(pid, comm)`.
fn end_leftovers(node: &Node, leaf: &str) -> Vec<(i32, String)> {
    let left: Vec<(i32, String)> = node
        .cg
        .procs_recursive(leaf)
        .into_iter()
        .map(|p| {
            let comm = crate::host::procs::read_stat(p)
                .map(|(c, _, _)| c)
                .unwrap_or_default();
            (p, comm)
        })
        .collect();
    if left.is_empty() {
        return left;
    }
    let ended = node
        .cg
        .kill_and_remove(
            leaf,
            std::time::Duration::from_millis(node.cfg.kill_wait_ms),
        )
        .is_ok();
    let _ = node.audit(
        AuditEvent::new(events::EXEC_LEFTOVER)
            .field("cgroup", crate::host::cgpath::abs(leaf))
            .field(
                "processes",
                left.iter()
                    .take(100)
                    .map(|(p, c)| serde_json::json!({"pid": p, "comm": gpufence_model::text::printable(c)}))
                    .collect::<Vec<_>>(),
            )
            .field("count", left.len())
            .field("ended", ended),
    );
    left
}
