//! The pinned maps the fence program reads and the prolog, plugin and epilog
//! edit, with their byte layouts.
//!
//! ```text
//! majors   ARRAY  u32 major            -> u32 (1 = protected)       4096 entries
//! cgroups  HASH   u64 cgroup id        -> {u32 flags (EXEMPT|GRANTED), u32 level}
//! levels   ARRAY  0                    -> u32 mask: bit L set once a cgroup at level L has flags
//! grants   HASH   {u64 cgid, u32 major, u32 minor} -> {u32 access, u32 job id}
//! ```
//!
//! `cgroups` lets the program skip an ancestor with one lookup when it is
//! neither exempt nor granted; `levels` lets it skip, with one bit test and
//! no helper call, every level where no cgroup has an entry at all (on a
//! Slurm node: all but the exempt services' level 2 and the jobs' level 3).
//! A bit is set before the entry that needs it is written and cleared only
//! by the next install, which recomputes the mask: a bit left set when its
//! level empties costs one lookup per open at that level, never a skipped
//! grant or exemption, and no grant or revoke walks the `cgroups` map.

use gpufence_model::device::{Access, DevNum};

/// `BPF_MAP_TYPE_HASH`.
pub const MAP_TYPE_HASH: u32 = 1;
/// `BPF_MAP_TYPE_ARRAY`.
pub const MAP_TYPE_ARRAY: u32 = 2;
/// `BPF_MAP_TYPE_LRU_HASH`: full maps evict the least recently used entry.
pub const MAP_TYPE_LRU_HASH: u32 = 9;

/// Pin name of the cgroup link, in `bpffs_dir`.
pub const PIN_LINK: &str = "link";
/// Pin name of the protected-majors map.
pub const PIN_MAJORS: &str = "majors";
/// Pin name of the cgroup-flags map.
pub const PIN_CGROUPS: &str = "cgroups";
/// Pin name of the grants map.
pub const PIN_GRANTS: &str = "grants";
/// Pin name of the denial records.
pub const PIN_DENIALS: &str = "denials";
/// Pin name of the populated-levels mask.
pub const PIN_LEVELS: &str = "levels";

/// Size of a `cgroups` map value: `struct { u32 flags; u32 level; }` (the
/// level, the kernel's `cgroup->level` with the hierarchy's root = 0, also
/// in a cgroup namespace, lets the fence recompute the populated-levels
/// mask).
pub const CGROUP_VALUE_SIZE: u32 = 8;

/// Entries of the majors array: every major the kernel can represent.
pub const MAJORS_ENTRIES: u32 = gpufence_model::device::MAX_MAJOR + 1;
/// Value of a protected major in the majors array.
pub const MAJOR_PROTECTED: u32 = 1;

/// `cgroups` flag: processes here and below may open every protected device.
pub const CGROUP_EXEMPT: u32 = 1;
/// `cgroups` flag: this cgroup holds at least one entry in `grants`.
pub const CGROUP_GRANTED: u32 = 2;

/// The shape of one map, compared with what a pinned map reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapSpec {
    /// Pin name and map name.
    pub name: &'static str,
    /// `BPF_MAP_TYPE_*`.
    pub map_type: u32,
    /// Key size in bytes.
    pub key_size: u32,
    /// Value size in bytes.
    pub value_size: u32,
    /// Capacity.
    pub max_entries: u32,
}

/// The four maps, with `grants` and `cgroups` sized for `max_grants`
/// entries and `denials` for `max_denials`.
pub fn map_specs(max_grants: u32, max_denials: u32) -> [MapSpec; 5] {
    [
        MapSpec {
            name: PIN_MAJORS,
            map_type: MAP_TYPE_ARRAY,
            key_size: 4,
            value_size: 4,
            max_entries: MAJORS_ENTRIES,
        },
        MapSpec {
            name: PIN_CGROUPS,
            map_type: MAP_TYPE_HASH,
            key_size: 8,
            value_size: CGROUP_VALUE_SIZE,
            max_entries: max_grants,
        },
        MapSpec {
            name: PIN_GRANTS,
            map_type: MAP_TYPE_HASH,
            key_size: GrantKey::SIZE as u32,
            value_size: GrantValue::SIZE as u32,
            max_entries: max_grants,
        },
        MapSpec {
            name: PIN_DENIALS,
            map_type: MAP_TYPE_LRU_HASH,
            key_size: DenialKey::SIZE as u32,
            value_size: DenialValue::SIZE as u32,
            max_entries: max_denials,
        },
        MapSpec {
            name: PIN_LEVELS,
            map_type: MAP_TYPE_ARRAY,
            key_size: 4,
            value_size: 4,
            max_entries: 1,
        },
    ]
}

/// Key of the denial records:
/// `struct { u64 cgroup_id; u32 uid; u32 major; u32 minor; u32 pad; }`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DenialKey {
    /// The denied task's cgroup id (`bpf_get_current_cgroup_id`).
    pub cgroup_id: u64,
    /// Its uid (low half of `bpf_get_current_uid_gid`).
    pub uid: u32,
    /// The device.
    pub dev: DevNum,
}

impl DenialKey {
    /// Size in bytes.
    pub const SIZE: usize = 24;
    /// Offsets.
    pub const OFF_CGROUP_ID: i16 = 0;
    /// Offset of `uid`.
    pub const OFF_UID: i16 = 8;
    /// Offset of `major`.
    pub const OFF_MAJOR: i16 = 12;
    /// Offset of `minor`.
    pub const OFF_MINOR: i16 = 16;
    /// Offset of the padding (written as 0: keys are compared as bytes).
    pub const OFF_PAD: i16 = 20;

    /// Parses 24 key bytes.
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        if b.len() != Self::SIZE {
            return None;
        }
        let u32_at = |o: usize| b[o..o + 4].try_into().ok().map(u32::from_ne_bytes);
        Some(DenialKey {
            cgroup_id: u64::from_ne_bytes(b[0..8].try_into().ok()?),
            uid: u32_at(8)?,
            dev: DevNum::new(u32_at(12)?, u32_at(16)?),
        })
    }

    /// Native-endian bytes.
    pub fn to_bytes(&self) -> [u8; 24] {
        let mut b = [0u8; 24];
        b[0..8].copy_from_slice(&self.cgroup_id.to_ne_bytes());
        b[8..12].copy_from_slice(&self.uid.to_ne_bytes());
        b[12..16].copy_from_slice(&self.dev.major.to_ne_bytes());
        b[16..20].copy_from_slice(&self.dev.minor.to_ne_bytes());
        b
    }
}

/// Value of the denial records:
/// `struct { u64 count; u64 last_ns; u32 last_pid; u32 pad; char comm[16]; }`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DenialValue {
    /// How many denied opens/mknods.
    pub count: u64,
    /// When the last one happened (`bpf_ktime_get_ns`, CLOCK_MONOTONIC).
    pub last_ns: u64,
    /// The last denied process (tgid).
    pub last_pid: u32,
    /// Its command name.
    pub comm: [u8; 16],
}

impl DenialValue {
    /// Size in bytes.
    pub const SIZE: usize = 40;
    /// Offset of `count`.
    pub const OFF_COUNT: i16 = 0;
    /// Offset of `last_ns`.
    pub const OFF_LAST_NS: i16 = 8;
    /// Offset of `last_pid`.
    pub const OFF_LAST_PID: i16 = 16;
    /// Offset of the padding.
    pub const OFF_PAD: i16 = 20;
    /// Offset of `comm`.
    pub const OFF_COMM: i16 = 24;
    /// Length of `comm` (`TASK_COMM_LEN`).
    pub const COMM_LEN: usize = 16;

    /// Parses 40 value bytes.
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        if b.len() != Self::SIZE {
            return None;
        }
        let mut comm = [0u8; 16];
        comm.copy_from_slice(&b[24..40]);
        Some(DenialValue {
            count: u64::from_ne_bytes(b[0..8].try_into().ok()?),
            last_ns: u64::from_ne_bytes(b[8..16].try_into().ok()?),
            last_pid: u32::from_ne_bytes(b[16..20].try_into().ok()?),
            comm,
        })
    }

    /// The command name as text.
    pub fn comm_str(&self) -> String {
        let end = self.comm.iter().position(|c| *c == 0).unwrap_or(16);
        String::from_utf8_lossy(&self.comm[..end]).into_owned()
    }
}

/// Key of the grants map: `struct { u64 cgroup_id; u32 major; u32 minor; }`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GrantKey {
    /// The cgroup id (inode of its cgroup2 directory).
    pub cgroup_id: u64,
    /// The device.
    pub dev: DevNum,
}

impl GrantKey {
    /// Size in bytes.
    pub const SIZE: usize = 16;
    /// Offset of `cgroup_id` in the key.
    pub const OFF_CGROUP_ID: i16 = 0;
    /// Offset of `major`.
    pub const OFF_MAJOR: i16 = 8;
    /// Offset of `minor`.
    pub const OFF_MINOR: i16 = 12;

    /// Native-endian bytes, as the program builds the key on its stack.
    pub fn to_bytes(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&self.cgroup_id.to_ne_bytes());
        b[8..12].copy_from_slice(&self.dev.major.to_ne_bytes());
        b[12..16].copy_from_slice(&self.dev.minor.to_ne_bytes());
        b
    }

    /// Parses 16 key bytes.
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        if b.len() != Self::SIZE {
            return None;
        }
        Some(GrantKey {
            cgroup_id: u64::from_ne_bytes(b[0..8].try_into().ok()?),
            dev: DevNum::new(
                u32::from_ne_bytes(b[8..12].try_into().ok()?),
                u32::from_ne_bytes(b[12..16].try_into().ok()?),
            ),
        })
    }
}

/// Value of the grants map: `struct { u32 access; u32 job_id; }`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrantValue {
    /// Access bits granted (`BPF_DEVCG_ACC_*`).
    pub access: Access,
    /// The Slurm job the grant belongs to; the epilog revokes by it.
    pub job_id: u32,
}

impl GrantValue {
    /// Size in bytes.
    pub const SIZE: usize = 8;
    /// Offset of `access` in the value.
    pub const OFF_ACCESS: i16 = 0;

    /// Native-endian bytes.
    pub fn to_bytes(&self) -> [u8; 8] {
        let mut b = [0u8; 8];
        b[0..4].copy_from_slice(&self.access.bits().to_ne_bytes());
        b[4..8].copy_from_slice(&self.job_id.to_ne_bytes());
        b
    }

    /// Parses 8 value bytes; unknown access bits are dropped.
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        if b.len() != Self::SIZE {
            return None;
        }
        Some(GrantValue {
            access: Access::from_bits_truncate(u32::from_ne_bytes(b[0..4].try_into().ok()?)),
            job_id: u32::from_ne_bytes(b[4..8].try_into().ok()?),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_and_value_round_trip() {
        let k = GrantKey {
            cgroup_id: 0x1122_3344_5566_7788,
            dev: DevNum::new(509, 1),
        };
        assert_eq!(GrantKey::from_bytes(&k.to_bytes()), Some(k));
        let v = GrantValue {
            access: Access::RW,
            job_id: 4_000_000_000,
        };
        assert_eq!(GrantValue::from_bytes(&v.to_bytes()), Some(v));
        assert_eq!(GrantKey::from_bytes(&[0; 15]), None);
    }
}
