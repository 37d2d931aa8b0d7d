//! A job's life on the node: Prolog, grant step, Epilog, report.

pub mod apply;
pub mod epilog;
pub mod injob;
pub mod leftovers;
pub mod mps;
pub mod prolog;
pub mod report;

/// The minors on major `gpu_major` that a live grant in `fence` covers,
/// leaving out job `other_than`'s grants: the GPUs another job shares
/// (gres/shard, gres/mps). None without a fence or when its grants cannot
/// be read.
pub(crate) fn granted_minors(
    fence: Option<&gpufence_cgroup::Fence>,
    gpu_major: u32,
    other_than: Option<u32>,
) -> std::collections::BTreeSet<u32> {
    fence
        .and_then(|f| f.entries().ok())
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.dev.major == gpu_major && Some(e.job_id) != other_than)
        .map(|e| e.dev.minor)
        .collect()
}
