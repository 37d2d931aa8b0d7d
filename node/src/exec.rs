//! `gpufence exec -- CMD`: root runs an admin command (`nvidia-smi`, a
//! diagnostic) in a dedicated exempt cgroup, with audit lines naming who ran
//! what and how it ended. The cgroup is `<cgroup_root>/<exec_cgroup>/<pid>`;
//! `exec_cgroup` is always in the fence's exemptions.

use std::ffi::OsString;
use std::process::Command;

use gpufence_cgroup::Fence;
use gpufence_model::audit::AuditEvent;

use crate::fence_ops::open_installed;
use crate::{join_cgroup, Node, NodeError};

/// Who is running this: `SUDO_USER` (when root via sudo), else the login
/// name, with the real uid.
pub fn who() -> String {
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let name = std::env::var("SUDO_USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .or_else(|_| std::env::var("USER"))
        .unwrap_or_else(|_| "unknown".into());
    format!("{name} (uid {uid})")
}

/// Makes `<cgroup_root>/<exec_cgroup>/<leaf>` and returns its path
/// (relative to the mount): the exec cgroup is made too when missing and
/// (again) flagged exempt in `fence`, since a cgroup made anew after the
/// install has a new id. What `gpufence exec` runs commands in, and where
/// the Prolog and Epilog step out of the job cgroup under
/// `PrologFlags=RunInJob` ([`crate::injob::step_out`]).
///
/// # Errors
/// [`NodeError`] when a cgroup cannot be made or the fence refuses.
pub fn exempt_leaf(node: &Node, fence: &Fence, leaf: &str) -> Result<String, NodeError> {
    exec_leaf(node, Some(fence), leaf)
}

/// [`exempt_leaf`], the exemption only when there is a `fence`: makes
/// `<cgroup_root>/<exec_cgroup>/<leaf>` (and the exec cgroup when missing)
/// and returns its path. With no fence installed (yet) nothing needs an
/// exemption, and the cgroup is still a place of gpufence's own: what
/// `slurmd -G` runs in ([`crate::gresmap`]), fence or not.
///
/// # Errors
/// [`NodeError::Kernel`] when a cgroup cannot be made or the fence refuses.
pub fn exec_leaf(node: &Node, fence: Option<&Fence>, leaf: &str) -> Result<String, NodeError> {
    let base = node.exec_cgroup();
    node.cg.create(&base)?;
    if let Some(fence) = fence {
        fence.add_exempt_in(&node.cg, node.cg.id(&base)?, &base)?;
    }
    let mine = join_cgroup(&base, leaf);
    node.cg.create(&mine)?;
    Ok(mine)
}

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
        return Err(NodeError::JobCgroup(
            "gpufence exec: only root may run commands in the exempt cgroup".into(),
        ));
    }
    let Some((prog, args)) = argv.split_first() else {
        return Err(NodeError::JobCgroup(
            "gpufence exec: no command (gpufence exec -- CMD ...)".into(),
        ));
    };
    let fence = open_installed(node)?;
    let mine = exempt_leaf(node, &fence, &std::process::id().to_string())?;
    let who = who();
    let cmdline: Vec<String> = argv
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    node.audit(
        AuditEvent::new("exec_start")
            .field("who", who.clone())
            .field("argv", cmdline.clone())
            .field("cgroup", crate::cgpath::abs(&mine)),
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
    let mut end = AuditEvent::new("exec_end")
        .field("who", who)
        .field("argv", cmdline)
        .field("exit_code", code);
    if let Err(e) = &status {
        end = end.field("error", e.to_string());
    }
    let _ = node.audit(end);
    let _ = node.cg.remove_tree(&mine);
    if let Err(e) = status {
        eprintln!(
            "gpufence: exec: cannot run {}: {e}",
            std::path::Path::new(prog).display()
        );
    }
    Ok(code)
}
