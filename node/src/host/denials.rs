//! The fence's denial records, for people: cgroup paths instead of ids,
//! user names instead of uids, wall-clock times instead of monotonic ns.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use serde::Serialize;

use gpufence_cgroup::fence::{DenialEntry, Fence};

use crate::host::users::Users;
use crate::{Node, NodeError};

/// One denial record, resolved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Denial {
    /// The denied task's cgroup path (relative to the cgroup2 mount), when
    /// the cgroup still exists. JSON: absolute (`/a/b`).
    #[serde(serialize_with = "crate::host::cgpath::option::serialize")]
    pub cgroup: Option<String>,
    /// The cgroup id.
    pub cgroup_id: u64,
    /// uid.
    pub uid: u32,
    /// User name, from `passwd_file` or NSS ([`Users`]); `None` when
    /// neither knows the uid or NSS did not answer in time.
    pub user: Option<String>,
    /// `major:minor`.
    pub device: String,
    /// How many denied opens or mknods.
    pub count: u64,
    /// The last denied process.
    pub last_pid: u32,
    /// Its command name.
    pub last_comm: String,
    /// When (RFC 3339).
    pub last_time: String,
}

/// cgroup id → path for every cgroup under the mount (one walk).
pub fn cgroup_paths(mount: &Path) -> BTreeMap<u64, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![mount.to_path_buf()];
    while let Some(d) = stack.pop() {
        if let Ok(md) = std::fs::metadata(&d) {
            let rel = d
                .strip_prefix(mount)
                .map(|r| r.display().to_string())
                .unwrap_or_default();
            out.insert(md.ino(), rel);
        }
        if let Ok(rd) = std::fs::read_dir(&d) {
            stack.extend(
                rd.flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path()),
            );
        }
    }
    out
}

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime into a struct we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Resolves raw records, naming users through `users`.
pub fn resolve(node: &Node, raw: Vec<DenialEntry>, users: &Users) -> Vec<Denial> {
    let paths = cgroup_paths(node.cg.mount());
    let now_mono = monotonic_ns();
    let now = chrono::Utc::now();
    raw.into_iter()
        .map(|d| {
            let ago = now_mono.saturating_sub(d.last_ns);
            let when = now - chrono::Duration::nanoseconds(ago.min(i64::MAX as u64) as i64);
            Denial {
                cgroup: paths.get(&d.cgroup_id).cloned(),
                cgroup_id: d.cgroup_id,
                uid: d.uid,
                user: users.name(d.uid),
                device: d.dev.to_string(),
                count: d.count,
                last_pid: d.last_pid,
                last_comm: d.last_comm,
                last_time: when.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            }
        })
        .collect()
}

/// Every denial record of this node's fence, resolved; users are named
/// through a [`Users`] of its own (at most [`crate::host::users::NSS_BUDGET`]
/// spent waiting on NSS).
///
/// # Errors
/// [`NodeError`] when the fence's maps cannot be read.
pub fn list(node: &Node) -> Result<Vec<Denial>, NodeError> {
    let fence = Fence::open(&node.cfg.bpffs_dir)?;
    let users = Users::new(node.cfg.passwd_file.as_deref());
    Ok(resolve(node, fence.denials()?, &users))
}
