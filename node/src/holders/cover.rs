//! What covers a holder of a protected device: an exemption (a configured
//! `exempt_cgroups` entry or an exempt cgroup in the fence, for that
//! exemption's users only) or a live grant on its cgroup or an ancestor.

use gpufence_cgroup::fence::Fence;
use gpufence_model::device::DevNum;

use crate::Node;

/// The exemption that covers a process of real uid `uid` in cgroup `cg`,
/// by the fence program's rule (an exemption is a cgroup and its users):
/// a configured `exempt_cgroups` entry it is in or under that names
/// `uid`, or an ancestor the fence holds exempt whose identity class
/// holds `uid`; `None` when there is none (a user's process in a daemon's
/// cgroup, whatever its uid, judged as if the cgroup were not exempt:
/// [`gpufence_model::policy::ExemptIdentities`]) or the uid is unknown
/// (the process is gone).
pub fn exemption(node: &Node, fence: Option<&Fence>, cg: &str, uid: Option<u32>) -> Option<String> {
    let uid = uid?;
    let resolve = crate::host::fence_ops::exempt_resolver(node);
    if let Some(e) = node.cfg.exempt_entry_for(cg, uid, &resolve) {
        return Some(crate::host::cgpath::abs(&e.cgroup));
    }
    let f = fence?;
    // The classes (names resolved) only when some ancestor is exempt.
    let exempt: Vec<(String, u64, u32)> = node
        .cg
        .ancestry(cg)
        .into_iter()
        .filter_map(|(p, id)| Some((p, id, f.exempt_class(id).ok().flatten()?)))
        .collect();
    if exempt.is_empty() {
        return None;
    }
    let ids = node.cfg.exempt_plan(&resolve).identities;
    exempt
        .into_iter()
        .find(|(_, _, class)| ids.covers(*class, uid))
        .map(|(p, id, _)| format!("{} (fence-exempt id {id})", crate::host::cgpath::abs(&p)))
}

/// Whether a process of real uid `uid` in `cgroup` may hold `dev`: an
/// exemption covers it ([`exemption`]), or an ancestor holds a live grant
/// for `dev`.
pub fn covered(
    node: &Node,
    fence: Option<&Fence>,
    cgroup: Option<&str>,
    uid: Option<u32>,
    dev: DevNum,
) -> bool {
    let (Some(fence), Some(cg)) = (fence, cgroup) else {
        return false;
    };
    exemption(node, Some(fence), cg, uid).is_some()
        || node
            .cg
            .ancestry(cg)
            .into_iter()
            .any(|(_, id)| fence.lookup(id, dev).ok().flatten().is_some())
}
