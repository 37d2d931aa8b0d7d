//! The map commands: create, look up, update, delete, walk the keys, read in
//! batches, each through a [`MapFd`]: a map's descriptor with the shape the
//! kernel reports for it, so that no call hands the kernel a key or value
//! buffer of another size than the map's.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::Path;

use super::info::map_info;
use super::links::obj_get;
use super::{bpf, fd_result, name16, UPDATE_ANY};
use crate::uapi::{cmd, map_type};

#[repr(C)]
#[derive(Default, Clone, Copy)]
pub(super) struct MapCreateAttr {
    pub(super) map_type: u32,
    pub(super) key_size: u32,
    pub(super) value_size: u32,
    pub(super) max_entries: u32,
    pub(super) map_flags: u32,
    pub(super) inner_map_fd: u32,
    pub(super) numa_node: u32,
    pub(super) map_name: [u8; 16],
}

/// What the kernel holds a map to: its type, key and value sizes and
/// capacity, fixed for the map's life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapShape {
    /// `BPF_MAP_TYPE_*`.
    pub map_type: u32,
    /// Key size in bytes.
    pub key_size: u32,
    /// Value size in bytes.
    pub value_size: u32,
    /// Capacity.
    pub max_entries: u32,
}

impl std::fmt::Display for MapShape {
    /// `type T key K value V max_entries N`, the words of
    /// [`crate::Error::MapMismatch`].
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "type {} key {} value {} max_entries {}",
            self.map_type, self.key_size, self.value_size, self.max_entries
        )
    }
}

/// An open BPF map and its [`MapShape`], read once when the handle is
/// made: from the attributes of the [`map_create`] that made it, or from
/// `BPF_OBJ_GET_INFO_BY_FD` on a descriptor opened otherwise
/// ([`MapFd::from_fd`], [`map_obj_get`], [`map_fd_by_id`](super::map_fd_by_id)). A map's shape
/// never changes, so the element calls ([`map_lookup`], [`map_update`],
/// [`map_delete`], [`map_keys`], [`map_entries_batch`]) size their buffers
/// from it, or refuse a caller's buffer of another size before the
/// syscall: the kernel copies exactly the map's sizes to and from the
/// pointers it is given.
///
/// A descriptor that is not a map's has no map shape (its info is another
/// struct); every map command refuses such a descriptor in the kernel
/// (`EINVAL` from `__bpf_map_get`) before it reads or writes a buffer.
#[derive(Debug)]
pub struct MapFd {
    fd: OwnedFd,
    shape: MapShape,
}

impl MapFd {
    /// The map open at `fd`, its shape read with `BPF_OBJ_GET_INFO_BY_FD`.
    ///
    /// # Errors
    /// errno of the info call.
    pub fn from_fd(fd: OwnedFd) -> io::Result<MapFd> {
        let i = map_info(fd.as_fd())?;
        Ok(MapFd {
            fd,
            shape: MapShape {
                map_type: i.map_type,
                key_size: i.key_size,
                value_size: i.value_size,
                max_entries: i.max_entries,
            },
        })
    }

    /// Its shape, as the kernel reports it.
    pub fn shape(&self) -> MapShape {
        self.shape
    }

    /// The descriptor.
    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// A second descriptor of the same map, with its shape.
    ///
    /// # Errors
    /// errno of `dup`.
    pub fn try_clone(&self) -> io::Result<MapFd> {
        Ok(MapFd {
            fd: self.fd.try_clone()?,
            shape: self.shape,
        })
    }

    /// Refuses a `what` buffer of `len` bytes where the map's are `want`
    /// bytes (`InvalidInput`, as `EINVAL`; nothing reaches the kernel).
    fn check(&self, what: &str, len: usize, want: u32) -> io::Result<()> {
        if len == want as usize {
            return Ok(());
        }
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "a {what} of {len} bytes for a map of {}-byte {what}s ({})",
                want, self.shape
            ),
        ))
    }

    /// Refuses a per-CPU map for a call that moves values (its values are
    /// not `value_size` bytes across the syscall: [`PERCPU_MAP_TYPES`]).
    fn check_values(&self) -> io::Result<()> {
        if map_type::PERCPU.contains(&self.shape.map_type) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "values of a per-CPU map ({}) are not read or written here",
                    self.shape
                ),
            ));
        }
        Ok(())
    }

    /// The key pointer of `key` (checked against the key size): NULL for
    /// a map without keys (queues, stacks, bloom filters: `key_size` 0,
    /// where the kernel refuses any other pointer).
    fn key_ptr(&self, key: &[u8]) -> io::Result<u64> {
        self.check("key", key.len(), self.shape.key_size)?;
        Ok(if key.is_empty() {
            0
        } else {
            key.as_ptr() as u64
        })
    }
}

impl AsFd for MapFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for MapFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// `BPF_MAP_CREATE`.
///
/// # Errors
/// errno (`EPERM` without CAP_BPF, `ENOMEM` past RLIMIT_MEMLOCK on < 5.11).
pub fn map_create(
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    name: &str,
) -> io::Result<MapFd> {
    let mut a = MapCreateAttr {
        map_type,
        key_size,
        value_size,
        max_entries,
        map_name: name16(name),
        ..Default::default()
    };
    let fd = bpf(cmd::MAP_CREATE, &mut a).map(fd_result)?;
    Ok(MapFd {
        fd,
        shape: MapShape {
            map_type,
            key_size,
            value_size,
            max_entries,
        },
    })
}

/// `BPF_OBJ_GET` of the map pinned at `path`, with its shape.
///
/// # Errors
/// errno (`ENOENT` when nothing is pinned there).
pub fn map_obj_get(path: &Path) -> io::Result<MapFd> {
    MapFd::from_fd(obj_get(path)?)
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct MapElemAttr {
    pub(super) map_fd: u32,
    pub(super) _pad: u32,
    pub(super) key: u64,
    pub(super) value: u64,
    pub(super) flags: u64,
}

/// `BPF_MAP_LOOKUP_ELEM`: `Ok(false)` when the key is absent.
///
/// # Errors
/// `InvalidInput`, before any syscall, when `key` or `value` is not of
/// the map's key or value size, or the map is per-CPU; errno other than
/// `ENOENT`.
pub fn map_lookup(map: &MapFd, key: &[u8], value: &mut [u8]) -> io::Result<bool> {
    let key = map.key_ptr(key)?;
    map.check_values()?;
    map.check("value", value.len(), map.shape.value_size)?;
    let mut a = MapElemAttr {
        map_fd: map.as_raw_fd() as u32,
        _pad: 0,
        key,
        value: value.as_mut_ptr() as u64,
        flags: 0,
    };
    match bpf(cmd::MAP_LOOKUP_ELEM, &mut a) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// `BPF_MAP_UPDATE_ELEM` with `BPF_ANY`.
///
/// # Errors
/// `InvalidInput`, before any syscall, when `key` or `value` is not of
/// the map's key or value size, or the map is per-CPU; errno (`E2BIG`
/// when a hash map is full).
pub fn map_update(map: &MapFd, key: &[u8], value: &[u8]) -> io::Result<()> {
    let key = map.key_ptr(key)?;
    map.check_values()?;
    map.check("value", value.len(), map.shape.value_size)?;
    let mut a = MapElemAttr {
        map_fd: map.as_raw_fd() as u32,
        _pad: 0,
        key,
        value: value.as_ptr() as u64,
        flags: UPDATE_ANY,
    };
    bpf(cmd::MAP_UPDATE_ELEM, &mut a).map(|_| ())
}

/// `BPF_MAP_DELETE_ELEM`: `Ok(false)` when the key was absent.
///
/// # Errors
/// `InvalidInput`, before any syscall, when `key` is not of the map's key
/// size; errno other than `ENOENT`.
pub fn map_delete(map: &MapFd, key: &[u8]) -> io::Result<bool> {
    let key = map.key_ptr(key)?;
    let mut a = MapElemAttr {
        map_fd: map.as_raw_fd() as u32,
        _pad: 0,
        key,
        value: 0,
        flags: 0,
    };
    match bpf(cmd::MAP_DELETE_ELEM, &mut a) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Every key of a hash map (`BPF_MAP_GET_NEXT_KEY` from NULL), each of the
/// map's key size. Keys deleted concurrently may restart the walk; the
/// kernel then returns the first key again, so this is bounded by twice
/// the map's `max_entries` visits plus a guard.
///
/// # Errors
/// errno other than the `ENOENT` that ends the walk.
pub fn map_keys(map: &MapFd) -> io::Result<Vec<Vec<u8>>> {
    let key_size = map.shape.key_size as usize;
    let max_entries = map.shape.max_entries;
    let mut keys: Vec<Vec<u8>> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut cur: Option<Vec<u8>> = None;
    let limit = max_entries as usize * 2 + 16;
    for _ in 0..limit {
        let mut next = vec![0u8; key_size];
        let mut a = MapElemAttr {
            map_fd: map.as_raw_fd() as u32,
            _pad: 0,
            key: cur.as_ref().map_or(0, |k| k.as_ptr() as u64),
            value: next.as_mut_ptr() as u64,
            flags: 0,
        };
        match bpf(cmd::MAP_GET_NEXT_KEY, &mut a) {
            Ok(_) => {
                if seen.insert(next.clone()) {
                    keys.push(next.clone());
                }
                cur = Some(next);
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(keys),
            Err(e) => return Err(e),
        }
    }
    Ok(keys)
}

/// The `batch` member of `union bpf_attr`.
#[repr(C)]
#[derive(Default, Clone, Copy)]
pub(super) struct BatchAttr {
    pub(super) in_batch: u64,
    pub(super) out_batch: u64,
    pub(super) keys: u64,
    pub(super) values: u64,
    pub(super) count: u32,
    pub(super) map_fd: u32,
    pub(super) elem_flags: u64,
    pub(super) flags: u64,
}

/// A map's entries as raw bytes: `(key, value)` pairs.
pub type RawEntries = Vec<(Vec<u8>, Vec<u8>)>;

/// Every `(key, value)` of hash map `map` with `BPF_MAP_LOOKUP_BATCH`, up
/// to 4,096 entries per call: one pass over the map's buckets in the
/// kernel instead of a `BPF_MAP_GET_NEXT_KEY` and a `BPF_MAP_LOOKUP_ELEM`
/// per entry (a map of 100,000 grants: about 25 calls instead of
/// 200,000). `Ok(None)` when the kernel has no batch operations for the
/// map (`EINVAL`, `ENOTSUPP`, before 5.6) or a bucket holds more entries
/// than a chunk (`ENOSPC`): the caller walks it key by key. Keys and
/// values are of the map's sizes.
///
/// # Errors
/// `InvalidInput`, before any syscall, for a per-CPU map; errno of
/// another failure.
pub fn map_entries_batch(map: &MapFd) -> io::Result<Option<RawEntries>> {
    const CHUNK: usize = 4096;
    // `ENOTSUPP` (524) is kernel-internal; it reaches user space as is.
    const ENOTSUPP: i32 = 524;
    map.check_values()?;
    let key_size = map.shape.key_size as usize;
    let value_size = map.shape.value_size as usize;
    let mut out = Vec::new();
    let mut keys = vec![0u8; key_size * CHUNK];
    let mut values = vec![0u8; value_size * CHUNK];
    // A hash map's batch cursor is a bucket number (u32); other maps'
    // (`generic_map_lookup_batch`) is a key: room for either.
    let cursor = key_size.max(8);
    let mut in_batch = vec![0u8; cursor];
    let mut out_batch = vec![0u8; cursor];
    let mut first = true;
    loop {
        let mut a = BatchAttr {
            in_batch: if first {
                0
            } else {
                in_batch.as_mut_ptr() as u64
            },
            out_batch: out_batch.as_mut_ptr() as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: CHUNK as u32,
            map_fd: map.as_raw_fd() as u32,
            elem_flags: 0,
            flags: 0,
        };
        let done = match bpf(cmd::MAP_LOOKUP_BATCH, &mut a) {
            Ok(_) => false,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => true,
            // No batch operations here; or one bucket holds more than a
            // chunk (ENOSPC): walk key by key instead.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINVAL) | Some(ENOTSUPP) | Some(libc::ENOSPC)
                ) =>
            {
                return Ok(None)
            }
            Err(e) => return Err(e),
        };
        let n = (a.count as usize).min(CHUNK);
        for i in 0..n {
            out.push((
                keys[i * key_size..(i + 1) * key_size].to_vec(),
                values[i * value_size..(i + 1) * value_size].to_vec(),
            ));
        }
        if done {
            return Ok(Some(out));
        }
        in_batch.copy_from_slice(&out_batch);
        first = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::maps::MAP_TYPE_HASH;

    fn root() -> bool {
        if nix::unistd::geteuid().is_root() {
            return true;
        }
        eprintln!("SKIPPED: needs root (BPF_MAP_CREATE)");
        false
    }

    /// On a real map (hash, 8-byte keys, 16-byte values): a key or value
    /// slice of another size is refused as `InvalidInput` before the
    /// syscall (a lookup into a short buffer, which the kernel would fill
    /// with 16 bytes, leaves every byte of it and of what follows as it
    /// was; a refused update or delete leaves the entry), while slices of
    /// the map's sizes work; walks and batches size their buffers from the
    /// handle; the shape read back with `BPF_OBJ_GET_INFO_BY_FD` is the one
    /// `map_create` recorded.
    #[test]
    fn slices_of_another_size_never_reach_the_kernel() {
        if !root() {
            return;
        }
        let map = map_create(MAP_TYPE_HASH, 8, 16, 4, "test_sizes").unwrap();
        let shape = map.shape();
        assert_eq!(
            MapFd::from_fd(map.fd().try_clone().unwrap())
                .unwrap()
                .shape(),
            shape
        );
        assert_eq!(shape.to_string(), "type 1 key 8 value 16 max_entries 4");
        let key = 7u64.to_ne_bytes();
        map_update(&map, &key, &[5; 16]).unwrap();

        let refused = |r: io::Result<()>| {
            let e = r.expect_err("a slice of another size");
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
            assert_eq!(e.raw_os_error(), None, "no syscall: {e}");
            e.to_string()
        };
        // A lookup into 8 bytes of a guarded buffer: nothing is written.
        let mut buf = [0xAAu8; 64];
        let msg = refused(map_lookup(&map, &key, &mut buf[..8]).map(|_| ()));
        assert_eq!(
            msg,
            "a value of 8 bytes for a map of 16-byte values (type 1 key 8 value 16 max_entries 4)"
        );
        assert_eq!(buf, [0xAA; 64]);
        refused(map_lookup(&map, &key, &mut buf[..32]).map(|_| ()));
        assert_eq!(buf, [0xAA; 64]);
        refused(map_lookup(&map, &key[..4], &mut buf[..16]).map(|_| ()));
        assert_eq!(buf, [0xAA; 64]);
        // Updates and deletes of the wrong sizes change nothing.
        refused(map_update(&map, &key, &[9; 8]));
        refused(map_update(&map, &key, &[9; 64]));
        refused(map_update(&map, &[0; 16], &[9; 16]));
        refused(map_delete(&map, &key[..4]).map(|_| ()));
        let mut v = [0u8; 16];
        assert!(map_lookup(&map, &key, &mut v).unwrap());
        assert_eq!(v, [5; 16]);
        // Walks take their sizes from the handle.
        assert_eq!(map_keys(&map).unwrap(), vec![key.to_vec()]);
        if let Some(all) = map_entries_batch(&map).unwrap() {
            assert_eq!(all, vec![(key.to_vec(), vec![5; 16])]);
        }
        assert!(map_delete(&map, &key).unwrap());
        assert!(!map_lookup(&map, &key, &mut v).unwrap());
    }

    /// The batch walk over several chunks (10,000 entries: calls of 4,096,
    /// 4,096 and the rest) gives the map whole, each entry once with its
    /// own value, as the key-by-key walk sees it.
    #[test]
    fn batches_grow_and_miss_nothing() {
        if !root() {
            return;
        }
        let map = map_create(MAP_TYPE_HASH, 8, 8, 10_000, "test_batches").unwrap();
        for k in 0..10_000u64 {
            map_update(&map, &k.to_ne_bytes(), &(k * 3).to_ne_bytes()).unwrap();
        }
        let Some(all) = map_entries_batch(&map).unwrap() else {
            panic!("this kernel (6.18) has batch lookups for hash maps");
        };
        assert_eq!(all.len(), 10_000);
        let got: std::collections::BTreeMap<u64, u64> = all
            .iter()
            .map(|(k, v)| {
                (
                    u64::from_ne_bytes(k[..].try_into().unwrap()),
                    u64::from_ne_bytes(v[..].try_into().unwrap()),
                )
            })
            .collect();
        assert_eq!(got.len(), 10_000, "an entry came back twice");
        assert!(got.iter().all(|(k, v)| *v == k * 3));
        assert_eq!(map_keys(&map).unwrap().len(), 10_000);
    }

    /// A per-CPU map's values cross the syscall once per CPU, not as
    /// `value_size` bytes: the calls that move values refuse it.
    #[test]
    fn per_cpu_values_are_refused() {
        if !root() {
            return;
        }
        let map = map_create(map_type::PERCPU_HASH, 4, 4, 4, "test_percpu").unwrap();
        let mut v = [0u8; 4];
        for e in [
            map_lookup(&map, &[0; 4], &mut v).map(|_| ()).unwrap_err(),
            map_update(&map, &[0; 4], &[0; 4]).unwrap_err(),
            map_entries_batch(&map).map(|_| ()).unwrap_err(),
        ] {
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
        }
        assert!(!map_delete(&map, &[0; 4]).unwrap());
    }
}
