//! The GPUs a job shares with other jobs (gres/shard, gres/mps): those
//! another job's live grant covers. The Prolog records them (their idle
//! memory says nothing about one job), the Epilog checks them process by
//! process.

use std::collections::BTreeSet;

use gpufence_cgroup::fence::Fence;

/// The minors on major `gpu_major` that a live grant in `fence` covers,
/// leaving out job `other_than`'s grants: the GPUs another job shares
/// (gres/shard, gres/mps). None without a fence or when its grants cannot
/// be read.
pub(crate) fn granted_minors(
    fence: Option<&Fence>,
    gpu_major: u32,
    other_than: Option<u32>,
) -> BTreeSet<u32> {
    fence
        .and_then(|f| f.entries().ok())
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.dev.major == gpu_major && Some(e.job_id) != other_than)
        .map(|e| e.dev.minor)
        .collect()
}
