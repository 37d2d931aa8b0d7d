//! The sweep's state under `state_dir/sweep/`: denials seen, the systemd baseline, the lock.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpufence_cgroup::fence::DenialEntry;
use gpufence_model::fsutil::{create_dir_all_mode, write_atomic};
use serde::{Deserialize, Serialize};

use super::SweepError;
use crate::host::persistence::Fingerprint;
use crate::Node;

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct SeenDenial {
    pub(super) cgroup_id: u64,
    pub(super) uid: u32,
    pub(super) major: u32,
    pub(super) minor: u32,
    /// The record's access bits (0 in a state file of a version before
    /// records had them).
    #[serde(default)]
    pub(super) access: u32,
    pub(super) count: u64,
    pub(super) last_ns: u64,
}

/// What the last sweep saw of the denial records.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct DenialState {
    /// Denied opens counted by every sweep so far (a counter: the LRU map
    /// forgets, this does not, until `state_dir` goes with a reboot).
    pub(super) total: u64,
    pub(super) seen: Vec<SeenDenial>,
}

pub(super) fn denial_key(d: &DenialEntry) -> (u64, u32, u32, u32, u32) {
    (
        d.cgroup_id,
        d.uid,
        d.dev.major,
        d.dev.minor,
        d.access.bits(),
    )
}

/// The records that are new or grew since `prev`, with how many denials
/// each adds, and the state to keep.
pub(super) fn new_denials(
    prev: &DenialState,
    now: &[DenialEntry],
) -> (Vec<(DenialEntry, u64)>, DenialState) {
    let old: BTreeMap<(u64, u32, u32, u32, u32), &SeenDenial> = prev
        .seen
        .iter()
        .map(|s| ((s.cgroup_id, s.uid, s.major, s.minor, s.access), s))
        .collect();
    let mut fresh = Vec::new();
    let mut total = prev.total;
    for d in now {
        let delta = match old.get(&denial_key(d)) {
            // Same record, grown.
            Some(s) if d.count >= s.count && d.last_ns >= s.last_ns => d.count - s.count,
            // Evicted and made again, or never seen.
            _ => d.count,
        };
        if delta > 0 {
            total += delta;
            fresh.push((d.clone(), delta));
        }
    }
    let seen = now
        .iter()
        .map(|d| SeenDenial {
            cgroup_id: d.cgroup_id,
            uid: d.uid,
            major: d.dev.major,
            minor: d.dev.minor,
            access: d.access.bits(),
            count: d.count,
            last_ns: d.last_ns,
        })
        .collect();
    (fresh, DenialState { total, seen })
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(super) struct Baseline {
    pub(super) recorded: String,
    pub(super) files: BTreeMap<PathBuf, Fingerprint>,
}

/// The systemd baseline file (remove it to accept the current units):
/// [`gpufence_model::record::StateDir::systemd_baseline_path`].
pub fn baseline_path(node: &Node) -> PathBuf {
    node.state.systemd_baseline_path()
}

/// A sweep state file as `T`; `None` when it is not there.
pub(super) fn read_json<T: for<'de> Deserialize<'de>>(p: &Path) -> Result<Option<T>, SweepError> {
    match std::fs::read(p) {
        Ok(b) => serde_json::from_slice(&b)
            .map(Some)
            .map_err(|source| SweepError::Corrupt {
                path: p.to_path_buf(),
                source,
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(SweepError::Io {
            path: p.to_path_buf(),
            source,
        }),
    }
}

/// Replaces a sweep state file with `v` (0600).
pub(super) fn write_json<T: Serialize>(p: &Path, v: &T) -> Result<(), SweepError> {
    let bytes = serde_json::to_vec_pretty(v).unwrap_or_default();
    write_atomic(p, &bytes, 0o600).map_err(|source| SweepError::Io {
        path: p.to_path_buf(),
        source,
    })
}

/// Holds an exclusive `flock` on `state_dir/sweep/lock` while alive.
pub(super) struct SweepLock(#[allow(dead_code)] std::fs::File);

pub(super) fn lock(node: &Node) -> Result<SweepLock, SweepError> {
    let dir = node.state.sweep_dir();
    create_dir_all_mode(&dir, 0o700).map_err(|source| SweepError::Io {
        path: dir.clone(),
        source,
    })?;
    let p = node.state.sweep_lock_path();
    match gpufence_model::fsutil::lock_file_within(
        &p,
        Duration::from_secs(30),
        Duration::from_millis(50),
    ) {
        Ok(Some(f)) => Ok(SweepLock(f)),
        Ok(None) => Err(SweepError::Locked(p)),
        Err(source) => Err(SweepError::Io { path: p, source }),
    }
}

/// Whether `name` may name a denial cursor (it becomes part of a file name).
pub(super) fn valid_cursor(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}
