//! The live grants, grouped by job and cgroup, for `gpufence grants`.

use std::collections::BTreeMap;

use serde::Serialize;

use gpufence_cgroup::fence::Fence;
use gpufence_model::device::{Access, DevNum};

use crate::{Node, NodeError};

/// One device granted to one cgroup.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GrantedDevice {
    /// `major:minor`.
    pub dev: String,
    /// Access letters.
    pub access: Access,
}

/// A job's grant on one cgroup.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CgroupGrant {
    /// The job.
    pub job_id: u32,
    /// The cgroup id the grant is keyed by.
    pub cgroup_id: u64,
    /// Its path relative to the cgroup2 mount, from the plugin's note;
    /// `None` when no note names it. JSON: absolute (`/a/b`).
    #[serde(serialize_with = "crate::host::cgpath::option::serialize")]
    pub cgroup_path: Option<String>,
    /// Whether that cgroup still exists.
    pub cgroup_alive: bool,
    /// The devices.
    pub devices: Vec<GrantedDevice>,
}

/// Every live grant.
///
/// # Errors
/// [`NodeError`] when the fence's maps cannot be read.
pub fn list(node: &Node) -> Result<Vec<CgroupGrant>, NodeError> {
    let fence = Fence::open(&node.cfg.bpffs_dir)?;
    let (notes, _) = node.state.applied(None);
    let paths: BTreeMap<u64, String> = notes
        .into_iter()
        .map(|a| (a.cgroup_id, a.cgroup_path))
        .collect();
    let mut by: BTreeMap<(u32, u64), Vec<(DevNum, Access)>> = BTreeMap::new();
    for e in fence.entries()? {
        by.entry((e.job_id, e.cgroup_id))
            .or_default()
            .push((e.dev, e.access));
    }
    Ok(by
        .into_iter()
        .map(|((job_id, cgroup_id), devs)| {
            let cgroup_path = paths.get(&cgroup_id).cloned();
            let cgroup_alive = cgroup_path
                .as_deref()
                .is_some_and(|p| node.cg.id(p).ok() == Some(cgroup_id));
            CgroupGrant {
                job_id,
                cgroup_id,
                cgroup_path,
                cgroup_alive,
                devices: devs
                    .into_iter()
                    .map(|(d, a)| GrantedDevice {
                        dev: d.to_string(),
                        access: a,
                    })
                    .collect(),
            }
        })
        .collect())
}
