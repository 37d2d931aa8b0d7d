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

/// A leaf of the exec cgroup that holds processes while the gpufence
/// process that made it is gone: what an interrupted `gpufence exec` (or a
/// killed Prolog, Epilog or `slurmd -G` run) left there, exempt from the
/// fence.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct StaleLeaf {
    /// The leaf (relative to the mount; absolute in JSON).
    #[serde(serialize_with = "crate::host::cgpath::serialize")]
    pub cgroup: String,
    /// The processes in it.
    pub pids: Vec<i32>,
}

/// A pid as a leaf's name writes it: decimal, no sign, no leading zero,
/// not 0; `None` for anything else.
pub fn pid_in_name(n: &str) -> Option<u32> {
    if n.is_empty() || n.starts_with('0') || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    n.parse().ok()
}

/// The leaves of `<cgroup_root>/<exec_cgroup>` that hold processes and
/// whose maker (the pid their name ends with: `<pid>`, `slurmd-G-<pid>`,
/// `prolog-<pid>`, [`pid_in_name`]) is no longer alive.
pub fn stale_leaves(node: &Node) -> Vec<StaleLeaf> {
    let base = node.exec_cgroup();
    let Ok(rd) = std::fs::read_dir(node.cg.path(&base)) else {
        return Vec::new();
    };
    let mut out: Vec<StaleLeaf> = rd
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| {
            let name = e.file_name().to_str()?.to_string();
            let maker = pid_in_name(name.rsplit('-').next()?)?;
            if i32::try_from(maker).is_ok_and(crate::host::procs::alive) {
                return None;
            }
            let leaf = join_cgroup(&base, &name);
            let pids = node.cg.procs_recursive(&leaf);
            (!pids.is_empty()).then_some(StaleLeaf { cgroup: leaf, pids })
        })
        .collect();
    out.sort_by(|a, b| a.cgroup.cmp(&b.cgroup));
    out
}

/// The problem line of a [`StaleLeaf`].
pub fn stale_leaf_problem(l: &StaleLeaf) -> String {
    format!(
        "{} holds {} process(es) (pid {}) whose gpufence command is gone: they are exempt from the fence; end them (`gpufence respond PID`, or kill them) and remove the cgroup",
        crate::host::cgpath::abs(&l.cgroup),
        l.pids.len(),
        l.pids
            .iter()
            .take(10)
            .map(i32::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    )
}
