//! gpufence's own exempt cgroup, `<cgroup_root>/<exec_cgroup>`: where
//! `gpufence exec` runs admin commands, `slurmd -G` runs, and the Prolog
//! and Epilog step out of a job cgroup under `PrologFlags=RunInJob`.

use gpufence_cgroup::Fence;

use crate::{join_cgroup, Node, NodeError};

/// Makes `<cgroup_root>/<exec_cgroup>/<leaf>` and returns its path
/// (relative to the mount): the exec cgroup is made too when missing and
/// (again) flagged exempt in `fence`, since a cgroup made anew after the
/// install has a new id. What `gpufence exec` runs commands in, and where
/// the Prolog and Epilog step out of the job cgroup under
/// `PrologFlags=RunInJob` ([`crate::job::injob::step_out`]).
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
/// `slurmd -G` runs in ([`crate::host::gresmap`]), fence or not.
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
