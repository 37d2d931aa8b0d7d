//! The pinned maps the fence program reads and the prolog, plugin and epilog
//! edit, with their byte layouts.
//!
//! ```text
//! majors   ARRAY     u32 major        -> u32 (1 = protected)          4096 entries
//! cgroups  HASH      u64 cgroup id    -> CgroupValue {u32 flags (EXEMPT|GRANTED), u32 level}
//! levels   ARRAY     u32 0            -> u32 mask: bit L set once a cgroup at level L has flags
//! grants   HASH      GrantKey {u64 cgid, u32 major, u32 minor} -> GrantValue {u32 access, u32 job id}
//! denials  LRU_HASH  DenialKey {u64 cgid, u32 uid, u32 major, u32 minor, u32 pad}
//!                    -> DenialValue {u64 count, u64 last_ns, u32 last_pid, u32 pad, char comm[16]}
//! ```
//!
//! Each key and value is a `#[repr(C)]` struct (or a `u32`/`u64`) whose
//! fields, in native byte order, are the bytes the program builds on its
//! stack and reads from the map ([`crate::program`] takes its offsets from
//! the `OFF_*` constants here, which are `offset_of!` of these structs).
//! They are encoded and decoded field by field ([`MapPod`]), with no
//! `unsafe`; each map's types, kind and capacity are one [`MapLayout`],
//! from which [`map_specs`] derives what an install creates and what a
//! pinned map must report to be used. A map is read and written only
//! through a [`Map`] of its layout, made after [`MapSpec::check`] passed
//! on the shape the kernel reports: at install and at every open of a
//! pin alike.
//!
//! `cgroups` lets the program skip an ancestor with one lookup when it is
//! neither exempt nor granted; `levels` lets it skip, with one bit test and
//! no helper call, every level where no cgroup has an entry at all (on a
//! Slurm node: all but the exempt services' level 2 and the jobs' level 3).
//! A bit is set before the entry that needs it is written and cleared only
//! by the next install, which recomputes the mask: a bit left set when its
//! level empties costs one lookup per open at that level, never a skipped
//! grant or exemption, and no grant or revoke walks the `cgroups` map.

use std::io;
use std::marker::PhantomData;
use std::mem::offset_of;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};

use gpufence_model::device::{Access, DevNum};

use crate::sys;

// The map types of the fence's maps ([`crate::uapi::map_type`]), under
// the names the layouts give them.
pub use crate::uapi::map_type::{
    ARRAY as MAP_TYPE_ARRAY, HASH as MAP_TYPE_HASH, LRU_HASH as MAP_TYPE_LRU_HASH,
};

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

/// Entries of the majors array: every major the kernel can represent.
pub const MAJORS_ENTRIES: u32 = gpufence_model::device::MAX_MAJOR + 1;
/// Value of a protected major in the majors array.
pub const MAJOR_PROTECTED: u32 = 1;

/// `cgroups` flag: processes here and below may open every protected device.
pub const CGROUP_EXEMPT: u32 = 1;
/// `cgroups` flag: this cgroup holds at least one entry in `grants`.
pub const CGROUP_GRANTED: u32 = 2;
/// `cgroups` flags: the shift of an exempt cgroup's identity class
/// (bits 8..=11: the index into
/// [`ExemptIdentities::classes`](gpufence_model::policy::ExemptIdentities),
/// whose uids alone the exemption covers).
pub const CGROUP_CLASS_SHIFT: u32 = 8;
/// `cgroups` flags: the identity class, once shifted down by
/// [`CGROUP_CLASS_SHIFT`]: room for
/// [`ExemptIdentities::MAX_CLASSES`](gpufence_model::policy::ExemptIdentities::MAX_CLASSES)
/// classes and indices past them, which cover no one.
pub const CGROUP_CLASS_MASK: u32 = 0xf;

/// The flags `flags` with identity class `class` in place of the one they
/// hold; a class beyond [`CGROUP_CLASS_MASK`] is stored as the mask
/// itself, an index with no class (covers no one: fail closed).
pub const fn with_class(flags: u32, class: u32) -> u32 {
    let class = if class > CGROUP_CLASS_MASK {
        CGROUP_CLASS_MASK
    } else {
        class
    };
    (flags & !(CGROUP_CLASS_MASK << CGROUP_CLASS_SHIFT)) | (class << CGROUP_CLASS_SHIFT)
}

/// The identity class `flags` hold.
pub const fn class_of(flags: u32) -> u32 {
    (flags >> CGROUP_CLASS_SHIFT) & CGROUP_CLASS_MASK
}

/// A key or value of a pinned map: a fixed-size record of native-endian
/// fixed-width integers, `SIZE` bytes long, as the kernel stores it and
/// the program reads it. Encoding and decoding go field by field
/// (`to_ne_bytes`/`from_ne_bytes` at each field's `offset_of!`), so the
/// bytes follow the `#[repr(C)]` layout without any `unsafe`.
pub trait MapPod: Copy + Sized {
    /// Size in bytes: the map's `key_size` or `value_size`.
    const SIZE: usize;
    /// The encoded form, `[u8; SIZE]`.
    type Bytes: AsRef<[u8]> + AsMut<[u8]> + Copy;
    /// A zeroed [`Self::Bytes`], for the kernel to write into.
    fn zeroed() -> Self::Bytes;
    /// The native-endian bytes (padding written as 0 unless the record
    /// carries it).
    fn encode(&self) -> Self::Bytes;
    /// Parses exactly [`Self::SIZE`] bytes; `None` for any other length.
    fn decode(b: &[u8]) -> Option<Self>;
}

/// The `N` bytes of `b` at `off`, when `b` holds them.
fn field<const N: usize>(b: &[u8], off: usize) -> Option<[u8; N]> {
    b.get(off..off + N)?.try_into().ok()
}

/// Writes `v` at `off` in `b` (the encoders' offsets are in bounds: the
/// layout tests check every field ends within `SIZE`).
fn put<const N: usize>(b: &mut [u8], off: usize, v: [u8; N]) {
    b[off..off + N].copy_from_slice(&v);
}

impl MapPod for u32 {
    const SIZE: usize = 4;
    type Bytes = [u8; 4];
    fn zeroed() -> [u8; 4] {
        [0; 4]
    }
    fn encode(&self) -> [u8; 4] {
        self.to_ne_bytes()
    }
    fn decode(b: &[u8]) -> Option<Self> {
        Some(u32::from_ne_bytes(b.try_into().ok()?))
    }
}

impl MapPod for u64 {
    const SIZE: usize = 8;
    type Bytes = [u8; 8];
    fn zeroed() -> [u8; 8] {
        [0; 8]
    }
    fn encode(&self) -> [u8; 8] {
        self.to_ne_bytes()
    }
    fn decode(b: &[u8]) -> Option<Self> {
        Some(u64::from_ne_bytes(b.try_into().ok()?))
    }
}

/// Implements [`MapPod`] for a `#[repr(C)]` struct of `u32`/`u64`/byte
/// array fields, each encoded at its `offset_of!`, and the inherent
/// `SIZE`, `to_bytes` and `from_bytes` callers use without the trait.
macro_rules! map_pod {
    ($t:ident, $size:literal, { $($f:ident : $ft:tt),* $(,)? }) => {
        impl MapPod for $t {
            const SIZE: usize = $size;
            type Bytes = [u8; $size];
            fn zeroed() -> [u8; $size] {
                [0; $size]
            }
            fn encode(&self) -> [u8; $size] {
                let mut b = [0u8; $size];
                $(put(&mut b, offset_of!($t, $f), map_pod!(@enc $ft, self.$f));)*
                b
            }
            fn decode(b: &[u8]) -> Option<Self> {
                if b.len() != $size {
                    return None;
                }
                Some($t {
                    $($f: map_pod!(@dec $ft, field(b, offset_of!($t, $f))?),)*
                })
            }
        }

        impl $t {
            /// Size in bytes (`key_size`/`value_size` of its map).
            pub const SIZE: usize = $size;

            /// Native-endian bytes, as the kernel stores them.
            pub fn to_bytes(&self) -> [u8; $size] {
                MapPod::encode(self)
            }

            /// Parses exactly [`Self::SIZE`] bytes; `None` for any other
            /// length.
            pub fn from_bytes(b: &[u8]) -> Option<Self> {
                <$t as MapPod>::decode(b)
            }
        }
    };
    (@enc u32, $v:expr) => { $v.to_ne_bytes() };
    (@enc u64, $v:expr) => { $v.to_ne_bytes() };
    (@enc [u8; 16], $v:expr) => { $v };
    (@dec u32, $b:expr) => { u32::from_ne_bytes($b) };
    (@dec u64, $b:expr) => { u64::from_ne_bytes($b) };
    (@dec [u8; 16], $b:expr) => { $b };
}

/// Value of the `cgroups` map: `struct { u32 flags; u32 level; }` (the
/// level, the kernel's `cgroup->level` with the hierarchy's root = 0, also
/// in a cgroup namespace, lets the fence recompute the populated-levels
/// mask). Keyed by the cgroup id (`u64`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CgroupValue {
    /// [`CGROUP_EXEMPT`] | [`CGROUP_GRANTED`] | an exempt cgroup's
    /// identity class ([`with_class`]).
    pub flags: u32,
    /// The cgroup's kernel level (root = 0).
    pub level: u32,
}

map_pod!(CgroupValue, 8, { flags: u32, level: u32 });

impl CgroupValue {
    /// Offset of `flags`, which the program loads.
    pub const OFF_FLAGS: i16 = offset_of!(CgroupValue, flags) as i16;
    /// Offset of `level`.
    pub const OFF_LEVEL: i16 = offset_of!(CgroupValue, level) as i16;
}

/// Size of a `cgroups` map value ([`CgroupValue`]).
pub const CGROUP_VALUE_SIZE: u32 = CgroupValue::SIZE as u32;

/// Key of the denial records:
/// `struct { u64 cgroup_id; u32 uid; u32 major; u32 minor; u32 access; }`.
/// `access` (the denied `BPF_DEVCG_ACC_*` bits: mknod, read, write) was
/// padding written as 0 before, so records an older program wrote read as
/// "access unknown" and the layout (24 bytes) is unchanged.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DenialKey {
    /// The denied task's cgroup id (`bpf_get_current_cgroup_id`).
    pub cgroup_id: u64,
    /// Its uid (low half of `bpf_get_current_uid_gid`).
    pub uid: u32,
    /// The device's major number.
    pub major: u32,
    /// The device's minor number.
    pub minor: u32,
    /// The access asked for and denied (`BPF_DEVCG_ACC_*`; 0 in records
    /// of programs before this field).
    pub access: u32,
}

map_pod!(DenialKey, 24, { cgroup_id: u64, uid: u32, major: u32, minor: u32, access: u32 });

impl DenialKey {
    /// Offset of `cgroup_id`.
    pub const OFF_CGROUP_ID: i16 = offset_of!(DenialKey, cgroup_id) as i16;
    /// Offset of `uid`.
    pub const OFF_UID: i16 = offset_of!(DenialKey, uid) as i16;
    /// Offset of `major`.
    pub const OFF_MAJOR: i16 = offset_of!(DenialKey, major) as i16;
    /// Offset of `minor`.
    pub const OFF_MINOR: i16 = offset_of!(DenialKey, minor) as i16;
    /// Offset of `access`.
    pub const OFF_ACCESS: i16 = offset_of!(DenialKey, access) as i16;

    /// The key of `uid`'s denied `access` to `dev` in cgroup `cgroup_id`.
    pub fn new(cgroup_id: u64, uid: u32, dev: DevNum, access: Access) -> Self {
        DenialKey {
            cgroup_id,
            uid,
            major: dev.major,
            minor: dev.minor,
            access: access.bits(),
        }
    }

    /// The access denied (unknown bits dropped; empty in records of
    /// programs before the field).
    pub fn access(&self) -> Access {
        Access::from_bits_truncate(self.access)
    }

    /// The device.
    pub fn dev(&self) -> DevNum {
        DevNum::new(self.major, self.minor)
    }
}

/// Value of the denial records:
/// `struct { u64 count; u64 last_ns; u32 last_pid; u32 pad; char comm[16]; }`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DenialValue {
    /// How many denied opens/mknods.
    pub count: u64,
    /// When the last one happened (`bpf_ktime_get_ns`, CLOCK_MONOTONIC).
    pub last_ns: u64,
    /// The last denied process (tgid).
    pub last_pid: u32,
    /// Padding, written as 0.
    pad: u32,
    /// Its command name (`TASK_COMM_LEN` bytes, NUL-padded).
    pub comm: [u8; 16],
}

map_pod!(DenialValue, 40, { count: u64, last_ns: u64, last_pid: u32, pad: u32, comm: [u8; 16] });

impl DenialValue {
    /// Offset of `count`.
    pub const OFF_COUNT: i16 = offset_of!(DenialValue, count) as i16;
    /// Offset of `last_ns`.
    pub const OFF_LAST_NS: i16 = offset_of!(DenialValue, last_ns) as i16;
    /// Offset of `last_pid`.
    pub const OFF_LAST_PID: i16 = offset_of!(DenialValue, last_pid) as i16;
    /// Offset of the padding.
    pub const OFF_PAD: i16 = offset_of!(DenialValue, pad) as i16;
    /// Offset of `comm`.
    pub const OFF_COMM: i16 = offset_of!(DenialValue, comm) as i16;
    /// Length of `comm` (`TASK_COMM_LEN`).
    pub const COMM_LEN: usize = 16;

    /// The command name as text.
    pub fn comm_str(&self) -> String {
        let end = self.comm.iter().position(|c| *c == 0).unwrap_or(16);
        String::from_utf8_lossy(&self.comm[..end]).into_owned()
    }
}

/// Key of the grants map: `struct { u64 cgroup_id; u32 major; u32 minor; }`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GrantKey {
    /// The cgroup id (inode of its cgroup2 directory).
    pub cgroup_id: u64,
    /// The device's major number.
    pub major: u32,
    /// The device's minor number.
    pub minor: u32,
}

map_pod!(GrantKey, 16, { cgroup_id: u64, major: u32, minor: u32 });

impl GrantKey {
    /// Offset of `cgroup_id` in the key.
    pub const OFF_CGROUP_ID: i16 = offset_of!(GrantKey, cgroup_id) as i16;
    /// Offset of `major`.
    pub const OFF_MAJOR: i16 = offset_of!(GrantKey, major) as i16;
    /// Offset of `minor`.
    pub const OFF_MINOR: i16 = offset_of!(GrantKey, minor) as i16;

    /// The key of `dev` granted to cgroup `cgroup_id`.
    pub const fn new(cgroup_id: u64, dev: DevNum) -> Self {
        GrantKey {
            cgroup_id,
            major: dev.major,
            minor: dev.minor,
        }
    }

    /// The device.
    pub const fn dev(&self) -> DevNum {
        DevNum::new(self.major, self.minor)
    }
}

/// Value of the grants map: `struct { u32 access; u32 job_id; }`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrantValue {
    /// Access bits granted (`BPF_DEVCG_ACC_*`), as stored: see
    /// [`GrantValue::access`].
    pub access_bits: u32,
    /// The Slurm job the grant belongs to; the epilog revokes by it.
    pub job_id: u32,
}

map_pod!(GrantValue, 8, { access_bits: u32, job_id: u32 });

impl GrantValue {
    /// Offset of `access` in the value.
    pub const OFF_ACCESS: i16 = offset_of!(GrantValue, access_bits) as i16;
    /// Offset of `job_id`.
    pub const OFF_JOB_ID: i16 = offset_of!(GrantValue, job_id) as i16;

    /// `access` granted to `job_id`.
    pub const fn new(access: Access, job_id: u32) -> Self {
        GrantValue {
            access_bits: access.bits(),
            job_id,
        }
    }

    /// The access granted; bits gpufence does not know are dropped.
    pub const fn access(&self) -> Access {
        Access::from_bits_truncate(self.access_bits)
    }
}

/// One of the fence's maps: its pin name, kind, key and value records and,
/// where it does not come from the configuration, its capacity.
pub trait MapLayout {
    /// Pin name in `bpffs_dir`, and the map's name.
    const NAME: &'static str;
    /// `BPF_MAP_TYPE_*`.
    const MAP_TYPE: u32;
    /// Capacity when fixed by the layout (the program relies on it);
    /// `None` when configured (`max_grants`, `max_denials`).
    const MAX_ENTRIES: Option<u32>;
    /// Key record.
    type Key: MapPod;
    /// Value record.
    type Value: MapPod;

    /// Its [`MapSpec`], with `configured` entries unless the capacity is
    /// fixed.
    fn spec(configured: u32) -> MapSpec {
        MapSpec {
            name: Self::NAME,
            map_type: Self::MAP_TYPE,
            key_size: Self::Key::SIZE as u32,
            value_size: Self::Value::SIZE as u32,
            max_entries: Self::MAX_ENTRIES.unwrap_or(configured),
            fixed_entries: Self::MAX_ENTRIES.is_some(),
        }
    }
}

/// `majors`: `u32` major → `u32` ([`MAJOR_PROTECTED`] or 0), an array of
/// [`MAJORS_ENTRIES`].
#[derive(Clone, Copy, Debug)]
pub struct MajorsMap;
impl MapLayout for MajorsMap {
    const NAME: &'static str = PIN_MAJORS;
    const MAP_TYPE: u32 = MAP_TYPE_ARRAY;
    const MAX_ENTRIES: Option<u32> = Some(MAJORS_ENTRIES);
    type Key = u32;
    type Value = u32;
}

/// `cgroups`: `u64` cgroup id → [`CgroupValue`], a hash of `max_grants`.
#[derive(Clone, Copy, Debug)]
pub struct CgroupsMap;
impl MapLayout for CgroupsMap {
    const NAME: &'static str = PIN_CGROUPS;
    const MAP_TYPE: u32 = MAP_TYPE_HASH;
    const MAX_ENTRIES: Option<u32> = None;
    type Key = u64;
    type Value = CgroupValue;
}

/// `grants`: [`GrantKey`] → [`GrantValue`], a hash of `max_grants`.
#[derive(Clone, Copy, Debug)]
pub struct GrantsMap;
impl MapLayout for GrantsMap {
    const NAME: &'static str = PIN_GRANTS;
    const MAP_TYPE: u32 = MAP_TYPE_HASH;
    const MAX_ENTRIES: Option<u32> = None;
    type Key = GrantKey;
    type Value = GrantValue;
}

/// `denials`: [`DenialKey`] → [`DenialValue`], an LRU hash of
/// `max_denials`.
#[derive(Clone, Copy, Debug)]
pub struct DenialsMap;
impl MapLayout for DenialsMap {
    const NAME: &'static str = PIN_DENIALS;
    const MAP_TYPE: u32 = MAP_TYPE_LRU_HASH;
    const MAX_ENTRIES: Option<u32> = None;
    type Key = DenialKey;
    type Value = DenialValue;
}

/// `levels`: `u32` 0 → `u32` populated-levels mask, an array of one.
#[derive(Clone, Copy, Debug)]
pub struct LevelsMap;
impl MapLayout for LevelsMap {
    const NAME: &'static str = PIN_LEVELS;
    const MAP_TYPE: u32 = MAP_TYPE_ARRAY;
    const MAX_ENTRIES: Option<u32> = Some(1);
    type Key = u32;
    type Value = u32;
}

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
    /// The capacity is part of the layout (the program indexes the map up
    /// to it): a pinned map of another capacity is refused, not kept.
    pub fixed_entries: bool,
}

/// The five maps, with `grants` and `cgroups` sized for `max_grants`
/// entries and `denials` for `max_denials`.
pub fn map_specs(max_grants: u32, max_denials: u32) -> [MapSpec; 5] {
    [
        MajorsMap::spec(0),
        CgroupsMap::spec(max_grants),
        GrantsMap::spec(max_grants),
        DenialsMap::spec(max_denials),
        LevelsMap::spec(0),
    ]
}

/// A map found with another shape than its layout needs, in the words of
/// [`sys::MapShape`]'s display (`type T key K value V max_entries N`; the
/// capacity in `expected` only where the layout fixes it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayoutMismatch {
    /// What the kernel reports.
    pub found: String,
    /// What the layout needs.
    pub expected: String,
}

impl MapSpec {
    /// Whether a map of `shape` has this layout: its type, key size and
    /// value size, and its capacity where the layout fixes it
    /// ([`MapSpec::fixed_entries`]); a configured capacity may differ.
    /// The one check every map handle passes ([`Map::from_fd`]), at
    /// install and at every open of a pin.
    ///
    /// # Errors
    /// [`LayoutMismatch`] saying what the map has and what it needs.
    pub fn check(&self, shape: &sys::MapShape) -> Result<(), LayoutMismatch> {
        let found = (shape.map_type, shape.key_size, shape.value_size);
        let wanted = (self.map_type, self.key_size, self.value_size);
        if found == wanted && (!self.fixed_entries || shape.max_entries == self.max_entries) {
            return Ok(());
        }
        let expected = sys::MapShape {
            map_type: self.map_type,
            key_size: self.key_size,
            value_size: self.value_size,
            max_entries: self.max_entries,
        };
        Err(LayoutMismatch {
            found: shape.to_string(),
            expected: if self.fixed_entries {
                expected.to_string()
            } else {
                format!(
                    "type {} key {} value {}",
                    self.map_type, self.key_size, self.value_size
                )
            },
        })
    }
}

/// A map of layout `M`: a [`sys::MapFd`] whose shape, as the kernel
/// reports it, passed [`MapSpec::check`] for `M` (type, key size, value
/// size, and capacity where `M` fixes it) when the handle was made, which
/// is the only way to make one ([`Map::from_fd`], [`Map::create`]). Its
/// keys and values are `M`'s records, so every call hands the kernel
/// buffers of the map's sizes.
pub struct Map<M: MapLayout> {
    fd: sys::MapFd,
    layout: PhantomData<fn() -> M>,
}

impl<M: MapLayout> std::fmt::Debug for Map<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Map")
            .field("layout", &M::NAME)
            .field("fd", &self.fd)
            .finish()
    }
}

impl<M: MapLayout> Map<M> {
    /// The map open at `fd` as a map of layout `M`, when its shape is
    /// `M`'s.
    ///
    /// # Errors
    /// [`LayoutMismatch`]: what the map has, and what `M` needs.
    pub fn from_fd(fd: sys::MapFd) -> Result<Map<M>, LayoutMismatch> {
        let shape = fd.shape();
        M::spec(shape.max_entries).check(&shape)?;
        Ok(Map {
            fd,
            layout: PhantomData,
        })
    }

    /// A new map of layout `M` (named [`MapLayout::NAME`]) with
    /// `configured` entries unless `M` fixes its capacity.
    ///
    /// # Errors
    /// errno of `BPF_MAP_CREATE`.
    pub fn create(configured: u32) -> io::Result<Map<M>> {
        let spec = M::spec(configured);
        let fd = sys::map_create(
            spec.map_type,
            spec.key_size,
            spec.value_size,
            spec.max_entries,
            spec.name,
        )?;
        Map::from_fd(fd).map_err(|m| io::Error::other(format!("{}: {}", m.found, m.expected)))
    }

    /// The descriptor and its shape.
    pub fn map_fd(&self) -> &sys::MapFd {
        &self.fd
    }

    /// The map's capacity.
    pub fn max_entries(&self) -> u32 {
        self.fd.shape().max_entries
    }

    /// `BPF_MAP_LOOKUP_ELEM` of `key`: `Ok(None)` when absent.
    ///
    /// # Errors
    /// errno other than `ENOENT`.
    pub fn lookup(&self, key: &M::Key) -> io::Result<Option<M::Value>> {
        let mut v = <M::Value as MapPod>::zeroed();
        if !sys::map_lookup(&self.fd, key.encode().as_ref(), v.as_mut())? {
            return Ok(None);
        }
        Ok(M::Value::decode(v.as_ref()))
    }

    /// `BPF_MAP_UPDATE_ELEM` (`BPF_ANY`) of `key` → `value`.
    ///
    /// # Errors
    /// errno (`E2BIG` when a hash map is full).
    pub fn update(&self, key: &M::Key, value: &M::Value) -> io::Result<()> {
        sys::map_update(&self.fd, key.encode().as_ref(), value.encode().as_ref())
    }

    /// `BPF_MAP_DELETE_ELEM` of `key`: `Ok(false)` when absent.
    ///
    /// # Errors
    /// errno other than `ENOENT`.
    pub fn delete(&self, key: &M::Key) -> io::Result<bool> {
        sys::map_delete(&self.fd, key.encode().as_ref())
    }

    /// Every key of the (hash) map ([`sys::map_keys`], at most about its
    /// capacity).
    ///
    /// # Errors
    /// errno.
    pub fn keys(&self) -> io::Result<Vec<M::Key>> {
        Ok(sys::map_keys(&self.fd)?
            .iter()
            .filter_map(|k| M::Key::decode(k))
            .collect())
    }

    /// Every entry of the (hash) map in `BPF_MAP_LOOKUP_BATCH` calls
    /// ([`sys::map_entries_batch`]): `Ok(None)` when the kernel cannot
    /// batch this map (the caller walks [`Map::keys`] instead).
    ///
    /// # Errors
    /// errno.
    pub fn entries_batch(&self) -> io::Result<Option<Entries<M>>> {
        Ok(sys::map_entries_batch(&self.fd)?.map(|all| {
            all.iter()
                .filter_map(|(k, v)| Some((M::Key::decode(k)?, M::Value::decode(v)?)))
                .collect()
        }))
    }
}

impl<M: MapLayout> AsFd for Map<M> {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl<M: MapLayout> AsRawFd for Map<M> {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// The entries of map `M`, decoded.
pub type Entries<M> = Vec<(<M as MapLayout>::Key, <M as MapLayout>::Value)>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, size_of};

    #[test]
    fn key_and_value_round_trip() {
        let k = GrantKey::new(0x1122_3344_5566_7788, DevNum::new(509, 1));
        assert_eq!(GrantKey::from_bytes(&k.to_bytes()), Some(k));
        assert_eq!(k.dev(), DevNum::new(509, 1));
        let v = GrantValue::new(Access::RW, 4_000_000_000);
        assert_eq!(GrantValue::from_bytes(&v.to_bytes()), Some(v));
        assert_eq!(v.access(), Access::RW);
        assert_eq!(GrantKey::from_bytes(&[0; 15]), None);
        assert_eq!(GrantKey::from_bytes(&[0; 17]), None);
        let d = DenialKey::new(7, 1001, DevNum::new(195, 3), Access::RW);
        assert_eq!(DenialKey::from_bytes(&d.to_bytes()), Some(d));
        let c = CgroupValue {
            flags: CGROUP_EXEMPT | CGROUP_GRANTED,
            level: 3,
        };
        assert_eq!(CgroupValue::from_bytes(&c.to_bytes()), Some(c));
        let mut dv = [0u8; 40];
        dv[24..29].copy_from_slice(b"xmrig");
        dv[0] = 2;
        let dv = DenialValue::from_bytes(&dv).unwrap();
        assert_eq!((dv.count, dv.comm_str().as_str()), (2, "xmrig"));
        assert_eq!(DenialValue::from_bytes(&dv.to_bytes()), Some(dv));
    }

    /// The bytes are native-endian fields at their C offsets, as the
    /// program writes them: checked against a hand-built buffer.
    #[test]
    fn encoding_is_the_c_layout() {
        let k = GrantKey::new(0x0102_0304_0506_0708, DevNum::new(195, 255));
        let mut want = Vec::new();
        want.extend_from_slice(&0x0102_0304_0506_0708u64.to_ne_bytes());
        want.extend_from_slice(&195u32.to_ne_bytes());
        want.extend_from_slice(&255u32.to_ne_bytes());
        assert_eq!(k.to_bytes().as_slice(), want.as_slice());
        let v = GrantValue::new(Access::READ | Access::MKNOD, 42);
        let want = [3u32.to_ne_bytes(), 42u32.to_ne_bytes()].concat();
        assert_eq!(v.to_bytes().as_slice(), want.as_slice());
        let d = DenialKey::new(9, 1001, DevNum::new(195, 3), Access::MKNOD);
        let want = [
            9u64.to_ne_bytes().as_slice(),
            &1001u32.to_ne_bytes(),
            &195u32.to_ne_bytes(),
            &3u32.to_ne_bytes(),
            &1u32.to_ne_bytes(),
        ]
        .concat();
        assert_eq!(d.to_bytes().as_slice(), want.as_slice());
        // Unknown access bits survive a round trip of the record but not
        // `access()`.
        let odd = GrantValue::from_bytes(&[0xff, 0, 0, 0, 1, 0, 0, 0]).unwrap();
        assert_eq!(odd.access(), Access::all());
    }

    /// Every record's `size_of`, alignment and `offset_of!` are the sizes
    /// and offsets the program and the map specs use (the program's
    /// structs: `grant_key`, `denial_key`, `denial_value`, the `cgroups`
    /// value), so a field moved or resized fails here and not in the
    /// kernel.
    #[test]
    fn layouts_match_the_program() {
        assert_eq!(size_of::<GrantKey>(), 16);
        assert_eq!(size_of::<GrantKey>(), GrantKey::SIZE);
        assert_eq!(align_of::<GrantKey>(), 8);
        assert_eq!(offset_of!(GrantKey, cgroup_id), 0);
        assert_eq!(offset_of!(GrantKey, major), 8);
        assert_eq!(offset_of!(GrantKey, minor), 12);
        assert_eq!(
            (
                GrantKey::OFF_CGROUP_ID,
                GrantKey::OFF_MAJOR,
                GrantKey::OFF_MINOR
            ),
            (0, 8, 12)
        );

        assert_eq!(size_of::<GrantValue>(), 8);
        assert_eq!(size_of::<GrantValue>(), GrantValue::SIZE);
        assert_eq!(offset_of!(GrantValue, access_bits), 0);
        assert_eq!(offset_of!(GrantValue, job_id), 4);
        assert_eq!((GrantValue::OFF_ACCESS, GrantValue::OFF_JOB_ID), (0, 4));

        assert_eq!(size_of::<CgroupValue>(), 8);
        assert_eq!(size_of::<CgroupValue>(), CGROUP_VALUE_SIZE as usize);
        assert_eq!(offset_of!(CgroupValue, flags), 0);
        assert_eq!(offset_of!(CgroupValue, level), 4);
        assert_eq!((CgroupValue::OFF_FLAGS, CgroupValue::OFF_LEVEL), (0, 4));

        assert_eq!(size_of::<DenialKey>(), 24);
        assert_eq!(size_of::<DenialKey>(), DenialKey::SIZE);
        assert_eq!(offset_of!(DenialKey, cgroup_id), 0);
        assert_eq!(offset_of!(DenialKey, uid), 8);
        assert_eq!(offset_of!(DenialKey, major), 12);
        assert_eq!(offset_of!(DenialKey, minor), 16);
        assert_eq!(offset_of!(DenialKey, access), 20);
        assert_eq!(
            (
                DenialKey::OFF_CGROUP_ID,
                DenialKey::OFF_UID,
                DenialKey::OFF_MAJOR,
                DenialKey::OFF_MINOR,
                DenialKey::OFF_ACCESS
            ),
            (0, 8, 12, 16, 20)
        );

        assert_eq!(size_of::<DenialValue>(), 40);
        assert_eq!(size_of::<DenialValue>(), DenialValue::SIZE);
        assert_eq!(offset_of!(DenialValue, count), 0);
        assert_eq!(offset_of!(DenialValue, last_ns), 8);
        assert_eq!(offset_of!(DenialValue, last_pid), 16);
        assert_eq!(offset_of!(DenialValue, pad), 20);
        assert_eq!(offset_of!(DenialValue, comm), 24);
        assert_eq!(
            (
                DenialValue::OFF_COUNT,
                DenialValue::OFF_LAST_NS,
                DenialValue::OFF_LAST_PID,
                DenialValue::OFF_PAD,
                DenialValue::OFF_COMM
            ),
            (0, 8, 16, 20, 24)
        );
        assert_eq!(DenialValue::COMM_LEN, 16);

        assert_eq!((<u32 as MapPod>::SIZE, <u64 as MapPod>::SIZE), (4, 8));
    }

    /// The specs an install creates and a pinned map is checked against,
    /// derived from the layouts: the sizes above, the kinds, and which
    /// capacities are fixed.
    #[test]
    fn specs_follow_the_layouts() {
        let [majors, cgroups, grants, denials, levels] = map_specs(1000, 50);
        let shape = |s: MapSpec| {
            (
                s.name,
                s.map_type,
                s.key_size,
                s.value_size,
                s.max_entries,
                s.fixed_entries,
            )
        };
        assert_eq!(
            shape(majors),
            (PIN_MAJORS, MAP_TYPE_ARRAY, 4, 4, MAJORS_ENTRIES, true)
        );
        assert_eq!(
            shape(cgroups),
            (PIN_CGROUPS, MAP_TYPE_HASH, 8, 8, 1000, false)
        );
        assert_eq!(
            shape(grants),
            (PIN_GRANTS, MAP_TYPE_HASH, 16, 8, 1000, false)
        );
        assert_eq!(
            shape(denials),
            (PIN_DENIALS, MAP_TYPE_LRU_HASH, 24, 40, 50, false)
        );
        assert_eq!(shape(levels), (PIN_LEVELS, MAP_TYPE_ARRAY, 4, 4, 1, true));
    }

    /// The one layout check ([`MapSpec::check`]): type, key size and
    /// value size always; the capacity only where the layout fixes it; the
    /// mismatch in the words of the install's error.
    #[test]
    fn a_shape_is_checked_against_its_layout() {
        let shape = |map_type, key_size, value_size, max_entries| sys::MapShape {
            map_type,
            key_size,
            value_size,
            max_entries,
        };
        let grants = GrantsMap::spec(1000);
        assert_eq!(grants.check(&shape(MAP_TYPE_HASH, 16, 8, 1000)), Ok(()));
        assert_eq!(grants.check(&shape(MAP_TYPE_HASH, 16, 8, 7)), Ok(()));
        assert_eq!(
            grants.check(&shape(MAP_TYPE_HASH, 16, 64, 16)),
            Err(LayoutMismatch {
                found: "type 1 key 16 value 64 max_entries 16".into(),
                expected: "type 1 key 16 value 8".into(),
            })
        );
        assert!(grants
            .check(&shape(MAP_TYPE_LRU_HASH, 16, 8, 1000))
            .is_err());
        assert!(grants.check(&shape(MAP_TYPE_HASH, 24, 8, 1000)).is_err());
        let majors = MajorsMap::spec(0);
        assert_eq!(
            majors.check(&shape(MAP_TYPE_ARRAY, 4, 4, MAJORS_ENTRIES)),
            Ok(())
        );
        assert_eq!(
            majors.check(&shape(MAP_TYPE_ARRAY, 4, 4, 256)),
            Err(LayoutMismatch {
                found: "type 2 key 4 value 4 max_entries 256".into(),
                expected: format!("type 2 key 4 value 4 max_entries {MAJORS_ENTRIES}"),
            })
        );
    }
}
