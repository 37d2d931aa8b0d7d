//! Installing, inspecting and removing the fence, with audit lines.

use gpufence_cgroup::fence::{Fence, FenceSpec, FenceStatus, InstallReport};
use gpufence_model::audit::{events, AuditEvent};

use crate::{Node, NodeError};

/// The spec of the fence this node's config describes.
///
/// # Errors
/// [`NodeError`] when the protected majors cannot be determined.
pub fn spec(node: &Node) -> Result<FenceSpec, NodeError> {
    Ok(FenceSpec {
        cgroup_root: node.cfg.cgroup_root.clone(),
        bpffs_dir: node.cfg.bpffs_dir.clone(),
        protected: node.protected_majors()?,
        exempt: node
            .cfg
            .exempt_cgroups
            .iter()
            .cloned()
            .chain(std::iter::once(node.exec_cgroup()))
            .collect(),
        max_grants: node.cfg.max_grants,
        max_denials: node.cfg.max_denials,
        audit: node.cfg.mode == gpufence_model::config::Mode::Audit,
    })
}

/// Installs or re-installs the fence and writes `fence_installed`.
///
/// # Errors
/// [`NodeError`]: the fence is not installed (or the old one stays) and the
/// message says why.
pub fn install(node: &Node) -> Result<InstallReport, NodeError> {
    // The exempt cgroup of `gpufence exec` exists from the install on.
    if node.cg.path(&node.cfg.cgroup_root).is_dir() {
        let _ = node.cg.create(&node.exec_cgroup());
    }
    let spec = spec(node)?;
    let (_fence, report) = Fence::install(&node.cg, &spec)?;
    node.audit(
        AuditEvent::new(events::FENCE_INSTALLED)
            .field("cgroup_root", format!("/{}", node.cfg.cgroup_root))
            .field("protected_majors", report.majors.clone())
            .field("prog_id", report.prog_id)
            .field("link_id", report.link_id)
            .field("replaced_program", report.replaced_program)
            .field("mode", format!("{:?}", node.cfg.mode).to_lowercase())
            .field(
                "exempt",
                report
                    .exempt_applied
                    .iter()
                    .map(|(p, _)| p.clone())
                    .collect::<Vec<_>>(),
            )
            .field("exempt_missing", report.exempt_missing.clone()),
    )?;
    Ok(report)
}

/// Status of this node's fence. Besides what the kernel objects say, an
/// NVIDIA major registered since the install (a driver loaded later) and not
/// protected is a problem: the fence is then not installed as configured.
pub fn status(node: &Node) -> FenceStatus {
    let mut st = Fence::status(&node.cg, &node.cfg.cgroup_root, &node.cfg.bpffs_dir);
    if st.prog_id.is_some() {
        if let Ok(want) = node.protected_majors() {
            for m in want.majors().filter(|m| !st.protected_majors.contains(m)) {
                st.problems.push(format!(
                    "major {m} ({}) is registered but not protected: run `gpufence fence install`",
                    want.names(m).collect::<Vec<_>>().join(", ")
                ));
                st.installed = false;
            }
        }
    }
    st
}

/// Opens the fence's maps, refusing when the fence is not attached at
/// `cgroup_root` (a grant into maps nobody reads would be a lie). Cheap: it
/// does not walk the maps. It also protects NVIDIA majors registered since
/// the install (a driver loaded later) and audits that.
///
/// # Errors
/// [`NodeError::FenceMissing`].
pub fn open_installed(node: &Node) -> Result<Fence, NodeError> {
    Fence::check_attached(&node.cg, &node.cfg.cgroup_root, &node.cfg.bpffs_dir)
        .map_err(|detail| NodeError::FenceMissing { detail })?;
    let fence = Fence::open(&node.cfg.bpffs_dir)?;
    let want: Vec<u32> = node.protected_majors()?.majors().collect();
    let added = fence.add_majors(&want)?;
    if !added.is_empty() {
        node.audit(
            AuditEvent::new("majors_added")
                .field("majors", added)
                .field(
                    "why",
                    "registered after the fence was installed (driver loaded later)",
                ),
        )?;
    }
    Ok(fence)
}

/// Removes the fence and writes `fence_removed`. Returns whether anything
/// was installed.
///
/// # Errors
/// [`NodeError`] when a pin cannot be removed.
pub fn remove(node: &Node) -> Result<bool, NodeError> {
    let found = Fence::remove(&node.cfg.bpffs_dir)?;
    if found {
        node.audit(
            AuditEvent::new(events::FENCE_REMOVED)
                .field("cgroup_root", format!("/{}", node.cfg.cgroup_root))
                .field("bpffs_dir", node.cfg.bpffs_dir.display().to_string()),
        )?;
    }
    Ok(found)
}
