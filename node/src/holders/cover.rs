//! What covers a holder of a protected device: an exemption (a configured
//! `exempt_cgroups` entry or an exempt cgroup in the fence, for the uids
//! exemptions cover) or a live grant on its cgroup or an ancestor.

use gpufence_cgroup::fence::Fence;
use gpufence_model::device::DevNum;

use crate::Node;

/// The exemption that covers a process of real uid `uid` in cgroup `cg`:
/// a configured `exempt_cgroups` entry it is in or under, or an ancestor
/// the fence holds exempt; `None` when there is none, or when the
/// exemption does not cover `uid` (a user's process in a daemon's cgroup,
/// judged by the fence program as if the cgroup were not exempt:
/// [`gpufence_model::policy::ExemptIdentities`]) or the uid is unknown
/// (the process is gone).
pub fn exemption(node: &Node, fence: Option<&Fence>, cg: &str, uid: Option<u32>) -> Option<String> {
    if !uid.is_some_and(|u| node.cfg.exempt_identities().covers(u)) {
        return None;
    }
    if let Some(e) = node.cfg.exempt_entry_covering(cg) {
        return Some(crate::host::cgpath::abs(e));
    }
    let f = fence?;
    node.cg
        .ancestry(cg)
        .into_iter()
        .find(|(_, id)| f.is_exempt(*id).unwrap_or(false))
        .map(|(p, id)| format!("{} (fence-exempt id {id})", crate::host::cgpath::abs(&p)))
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
