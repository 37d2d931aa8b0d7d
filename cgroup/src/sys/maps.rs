//! The map commands: create, look up, update, delete, walk the keys, read in batches.

use super::*;

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
) -> io::Result<OwnedFd> {
    let mut a = MapCreateAttr {
        map_type,
        key_size,
        value_size,
        max_entries,
        map_name: name16(name),
        ..Default::default()
    };
    bpf(BPF_MAP_CREATE, &mut a).map(fd_result)
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
/// errno other than `ENOENT`.
pub fn map_lookup(map: BorrowedFd<'_>, key: &[u8], value: &mut [u8]) -> io::Result<bool> {
    let mut a = MapElemAttr {
        map_fd: map.as_raw_fd() as u32,
        _pad: 0,
        key: key.as_ptr() as u64,
        value: value.as_mut_ptr() as u64,
        flags: 0,
    };
    match bpf(BPF_MAP_LOOKUP_ELEM, &mut a) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// `BPF_MAP_UPDATE_ELEM` with `BPF_ANY`.
///
/// # Errors
/// errno (`E2BIG` when a hash map is full).
pub fn map_update(map: BorrowedFd<'_>, key: &[u8], value: &[u8]) -> io::Result<()> {
    let mut a = MapElemAttr {
        map_fd: map.as_raw_fd() as u32,
        _pad: 0,
        key: key.as_ptr() as u64,
        value: value.as_ptr() as u64,
        flags: UPDATE_ANY,
    };
    bpf(BPF_MAP_UPDATE_ELEM, &mut a).map(|_| ())
}

/// `BPF_MAP_DELETE_ELEM`: `Ok(false)` when the key was absent.
///
/// # Errors
/// errno other than `ENOENT`.
pub fn map_delete(map: BorrowedFd<'_>, key: &[u8]) -> io::Result<bool> {
    let mut a = MapElemAttr {
        map_fd: map.as_raw_fd() as u32,
        _pad: 0,
        key: key.as_ptr() as u64,
        value: 0,
        flags: 0,
    };
    match bpf(BPF_MAP_DELETE_ELEM, &mut a) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Every key of a hash map (`BPF_MAP_GET_NEXT_KEY` from NULL). Keys deleted
/// concurrently may restart the walk; the kernel then returns the first key
/// again, so this is bounded by `max_entries` visits plus a guard.
///
/// # Errors
/// errno other than the `ENOENT` that ends the walk.
pub fn map_keys(
    map: BorrowedFd<'_>,
    key_size: usize,
    max_entries: u32,
) -> io::Result<Vec<Vec<u8>>> {
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
        match bpf(BPF_MAP_GET_NEXT_KEY, &mut a) {
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

/// `BPF_MAP_LOOKUP_BATCH` (`include/uapi/linux/bpf.h`, Linux 5.6).
const BPF_MAP_LOOKUP_BATCH: i32 = 24;

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
/// than a chunk (`ENOSPC`): the caller walks it key by key.
///
/// # Errors
/// errno of another failure.
pub fn map_entries_batch(
    map: BorrowedFd<'_>,
    key_size: usize,
    value_size: usize,
) -> io::Result<Option<RawEntries>> {
    const CHUNK: usize = 4096;
    // `ENOTSUPP` (524) is kernel-internal; it reaches user space as is.
    const ENOTSUPP: i32 = 524;
    let mut out = Vec::new();
    let mut keys = vec![0u8; key_size * CHUNK];
    let mut values = vec![0u8; value_size * CHUNK];
    // A hash map's batch cursor is a bucket number (u32).
    let mut in_batch = 0u64;
    let mut out_batch = 0u64;
    let mut first = true;
    loop {
        let mut a = BatchAttr {
            in_batch: if first {
                0
            } else {
                &mut in_batch as *mut u64 as u64
            },
            out_batch: &mut out_batch as *mut u64 as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: CHUNK as u32,
            map_fd: map.as_raw_fd() as u32,
            elem_flags: 0,
            flags: 0,
        };
        let done = match bpf(BPF_MAP_LOOKUP_BATCH, &mut a) {
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
        in_batch = out_batch;
        first = false;
    }
}
