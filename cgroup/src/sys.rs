//! The `bpf(2)` commands the fence uses, as owned file descriptors.
//!
//! Attribute layouts are the members of `union bpf_attr` and the info
//! structs in `include/uapi/linux/bpf.h`, prefixes only: the kernel zero-fills
//! what a caller's shorter struct leaves out (`bpf_check_uarg_tail_zero`).

use std::ffi::CString;
use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::asm::RawInsn;

const BPF_MAP_CREATE: i32 = 0;
const BPF_MAP_LOOKUP_ELEM: i32 = 1;
const BPF_MAP_UPDATE_ELEM: i32 = 2;
const BPF_MAP_DELETE_ELEM: i32 = 3;
const BPF_MAP_GET_NEXT_KEY: i32 = 4;
const BPF_PROG_LOAD: i32 = 5;
const BPF_OBJ_PIN: i32 = 6;
const BPF_OBJ_GET: i32 = 7;
const BPF_PROG_QUERY: i32 = 16;
const BPF_OBJ_GET_INFO_BY_FD: i32 = 15;
const BPF_LINK_CREATE: i32 = 28;
const BPF_LINK_UPDATE: i32 = 29;
const BPF_LINK_DETACH: i32 = 34;

/// `BPF_PROG_TYPE_CGROUP_DEVICE`.
pub const PROG_TYPE_CGROUP_DEVICE: u32 = 15;
/// `BPF_CGROUP_DEVICE` attach type.
pub const ATTACH_CGROUP_DEVICE: u32 = 6;
/// `BPF_LINK_TYPE_CGROUP`.
pub const LINK_TYPE_CGROUP: u32 = 3;
/// `BPF_ANY` for map updates.
pub const UPDATE_ANY: u64 = 0;
/// `BPF_F_ALLOW_MULTI` as reported in query attach flags.
pub const F_ALLOW_MULTI: u32 = 1 << 1;
/// `BPF_F_ALLOW_OVERRIDE`.
pub const F_ALLOW_OVERRIDE: u32 = 1 << 0;

/// How many bytes of `union bpf_attr` every call hands the kernel: more
/// than the union has ever been (144 bytes in 6.1's
/// `include/uapi/linux/bpf.h`; later kernels only add members). The kernel
/// writes some results into the caller's attr at the offsets of its own,
/// current layout whatever size the caller passed: since 6.6
/// `__cgroup_bpf_query` (`kernel/bpf/cgroup.c`) copies the query's
/// `revision` to offset 56, past the 32-byte query struct older callers
/// use. A zeroed buffer this large takes every such write; the kernel
/// accepts the zero tail (`bpf_check_uarg_tail_zero`).
pub const ATTR_SIZE: usize = 256;

/// The zeroed attr buffer, 8-byte aligned like `union bpf_attr`.
#[repr(C, align(8))]
struct AttrBuf([u8; ATTR_SIZE]);

/// `bpf(cmd, attr)` with `attr` (a `repr(C)` prefix of `union bpf_attr`
/// for `cmd`) at the start of a zeroed [`ATTR_SIZE`]-byte buffer; what the
/// kernel wrote into the prefix is copied back into `attr`.
fn bpf<T: Copy>(cmd: i32, attr: &mut T) -> io::Result<i64> {
    bpf_raw(cmd, attr, &mut AttrBuf([0; ATTR_SIZE]).0)
}

/// [`bpf`] with the caller's buffer (tests look at what the kernel wrote
/// past `T`).
fn bpf_raw<T: Copy>(cmd: i32, attr: &mut T, buf: &mut [u8; ATTR_SIZE]) -> io::Result<i64> {
    const { assert!(size_of::<T>() <= ATTR_SIZE && std::mem::align_of::<T>() <= 8) };
    let at = buf.as_mut_ptr().cast::<T>();
    // SAFETY: `buf` holds ATTR_SIZE >= size_of::<T>() bytes; `T` is plain
    // data (integers, arrays, pointers as u64), so unaligned reads and
    // writes of it are sound and any bytes the kernel writes are a valid T.
    unsafe { at.write_unaligned(*attr) };
    // SAFETY: `buf` is valid for reads and writes of ATTR_SIZE bytes for
    // the call; pointers inside `attr` are the caller's, valid as its
    // `cmd` requires.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, buf.as_mut_ptr(), ATTR_SIZE) };
    // SAFETY: `at` points at the first size_of::<T>() of the ATTR_SIZE
    // bytes of `buf`, which the kernel may have rewritten; every bit
    // pattern is a valid `T` (integers and byte arrays only), and the
    // read is unaligned-safe.
    *attr = unsafe { at.read_unaligned() };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn fd_result(r: i64) -> OwnedFd {
    // SAFETY: the kernel returned a new descriptor we now own.
    unsafe { OwnedFd::from_raw_fd(r as RawFd) }
}

fn name16(name: &str) -> [u8; 16] {
    let mut b = [0u8; 16];
    // BPF object names: at most 15 chars of [A-Za-z0-9_.]
    for (d, s) in b.iter_mut().zip(
        name.bytes()
            .filter(|c| c.is_ascii_alphanumeric() || *c == b'_' || *c == b'.')
            .take(15),
    ) {
        *d = s;
    }
    b
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct MapCreateAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    inner_map_fd: u32,
    numa_node: u32,
    map_name: [u8; 16],
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
struct MapElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
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
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

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
) -> io::Result<Option<Vec<(Vec<u8>, Vec<u8>)>>> {
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

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

/// A refused `BPF_PROG_LOAD`: errno and the verifier's log.
#[derive(Debug)]
pub struct LoadError {
    /// errno.
    pub errno: io::Error,
    /// The verifier log (empty when the kernel wrote none).
    pub log: String,
}

/// Runs `attempt` (one `BPF_PROG_LOAD`, with the verifier log buffer when
/// given one); on failure, runs it again with a 1 MiB log so the error
/// carries the verifier's reason. The first errno is the one returned.
fn load_with_log(
    attempt: impl Fn(Option<&mut Vec<u8>>) -> io::Result<OwnedFd>,
) -> Result<OwnedFd, LoadError> {
    match attempt(None) {
        Ok(fd) => Ok(fd),
        Err(errno) => {
            let mut buf = vec![0u8; 1 << 20];
            let second = attempt(Some(&mut buf));
            let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
            let log = String::from_utf8_lossy(&buf[..end]).into_owned();
            match second {
                // Loading with a log succeeded where the first did not:
                // transient; use it.
                Ok(fd) => Ok(fd),
                Err(_) => Err(LoadError { errno, log }),
            }
        }
    }
}

/// `BPF_PROG_LOAD` of a `BPF_PROG_TYPE_CGROUP_DEVICE` program. On failure,
/// loads again with the verifier log on, so the error carries the reason.
///
/// # Errors
/// [`LoadError`].
pub fn prog_load_cgroup_device(insns: &[RawInsn], name: &str) -> Result<OwnedFd, LoadError> {
    let license = c"GPL";
    let attempt = |log: Option<&mut Vec<u8>>| {
        let mut a = ProgLoadAttr {
            prog_type: PROG_TYPE_CGROUP_DEVICE,
            insn_cnt: insns.len() as u32,
            insns: insns.as_ptr() as u64,
            license: license.as_ptr() as u64,
            prog_name: name16(name),
            expected_attach_type: ATTACH_CGROUP_DEVICE,
            ..Default::default()
        };
        if let Some(buf) = log {
            a.log_level = 1;
            a.log_size = buf.len() as u32;
            a.log_buf = buf.as_mut_ptr() as u64;
        }
        bpf(BPF_PROG_LOAD, &mut a).map(fd_result)
    };
    load_with_log(attempt)
}

#[repr(C)]
#[derive(Clone, Copy)]
struct ObjAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

fn cpath(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in path"))
}

/// `BPF_OBJ_PIN`: pins `fd` at `path` on a bpffs.
///
/// # Errors
/// errno (`EEXIST` when the pin exists, `EPERM` off bpffs).
pub fn obj_pin(fd: BorrowedFd<'_>, path: &Path) -> io::Result<()> {
    let c = cpath(path)?;
    let mut a = ObjAttr {
        pathname: c.as_ptr() as u64,
        bpf_fd: fd.as_raw_fd() as u32,
        file_flags: 0,
    };
    bpf(BPF_OBJ_PIN, &mut a).map(|_| ())
}

/// `BPF_OBJ_GET`: opens a pinned object.
///
/// # Errors
/// errno (`ENOENT` when nothing is pinned there).
pub fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let c = cpath(path)?;
    let mut a = ObjAttr {
        pathname: c.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
    };
    bpf(BPF_OBJ_GET, &mut a).map(fd_result)
}

#[repr(C)]
#[derive(Clone, Copy)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
}

/// `BPF_LINK_CREATE` of a device program on a cgroup (MULTI semantics).
///
/// # Errors
/// errno (`E2BIG` when the cgroup already has 64 programs).
pub fn link_create_cgroup_device(
    prog: BorrowedFd<'_>,
    cgroup: BorrowedFd<'_>,
) -> io::Result<OwnedFd> {
    let mut a = LinkCreateAttr {
        prog_fd: prog.as_raw_fd() as u32,
        target_fd: cgroup.as_raw_fd() as u32,
        attach_type: ATTACH_CGROUP_DEVICE,
        flags: 0,
    };
    bpf(BPF_LINK_CREATE, &mut a).map(fd_result)
}

#[repr(C)]
#[derive(Clone, Copy)]
struct LinkUpdateAttr {
    link_fd: u32,
    new_prog_fd: u32,
    flags: u32,
    old_prog_fd: u32,
}

/// `BPF_LINK_UPDATE`: swaps the link's program atomically.
///
/// # Errors
/// errno.
pub fn link_update(link: BorrowedFd<'_>, prog: BorrowedFd<'_>) -> io::Result<()> {
    let mut a = LinkUpdateAttr {
        link_fd: link.as_raw_fd() as u32,
        new_prog_fd: prog.as_raw_fd() as u32,
        flags: 0,
        old_prog_fd: 0,
    };
    bpf(BPF_LINK_UPDATE, &mut a).map(|_| ())
}

#[repr(C)]
#[derive(Clone, Copy)]
struct LinkDetachAttr {
    link_fd: u32,
}

/// `BPF_LINK_DETACH`: detaches the link's program now, whoever holds it.
///
/// # Errors
/// errno.
pub fn link_detach(link: BorrowedFd<'_>) -> io::Result<()> {
    let mut a = LinkDetachAttr {
        link_fd: link.as_raw_fd() as u32,
    };
    bpf(BPF_LINK_DETACH, &mut a).map(|_| ())
}

#[repr(C)]
#[derive(Clone, Copy)]
struct InfoAttr {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

/// The prefix of `struct bpf_link_info` for cgroup links.
#[repr(C)]
#[derive(Default, Debug, Clone, Copy)]
pub struct LinkInfo {
    /// `BPF_LINK_TYPE_*`.
    pub link_type: u32,
    /// Link id.
    pub id: u32,
    /// Id of the attached program; 0 after a detach.
    pub prog_id: u32,
    _pad: u32,
    /// The cgroup's id (0 after a detach).
    pub cgroup_id: u64,
    /// Attach type.
    pub attach_type: u32,
    _pad2: u32,
}

/// The prefix of `struct bpf_map_info`.
#[repr(C)]
#[derive(Default, Debug, Clone, Copy)]
pub struct MapInfo {
    /// `BPF_MAP_TYPE_*`.
    pub map_type: u32,
    /// Map id.
    pub id: u32,
    /// Key size.
    pub key_size: u32,
    /// Value size.
    pub value_size: u32,
    /// Capacity.
    pub max_entries: u32,
    /// Flags.
    pub map_flags: u32,
    /// Name.
    pub name: [u8; 16],
}

fn info_by_fd<T: Default>(fd: BorrowedFd<'_>) -> io::Result<T> {
    let mut info = T::default();
    let mut a = InfoAttr {
        bpf_fd: fd.as_raw_fd() as u32,
        info_len: size_of::<T>() as u32,
        info: &mut info as *mut T as u64,
    };
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut a)?;
    Ok(info)
}

/// `BPF_OBJ_GET_INFO_BY_FD` on a link.
///
/// # Errors
/// errno.
pub fn link_info(fd: BorrowedFd<'_>) -> io::Result<LinkInfo> {
    info_by_fd(fd)
}

/// `BPF_OBJ_GET_INFO_BY_FD` on a map.
///
/// # Errors
/// errno.
pub fn map_info(fd: BorrowedFd<'_>) -> io::Result<MapInfo> {
    info_by_fd(fd)
}

/// The prefix of `struct bpf_prog_info` up to the name.
#[repr(C)]
#[derive(Default, Debug, Clone, Copy)]
pub struct ProgInfo {
    /// `BPF_PROG_TYPE_*`.
    pub prog_type: u32,
    /// Program id.
    pub id: u32,
    /// SHA-1 prefix of the instructions.
    pub tag: [u8; 8],
    jited_prog_len: u32,
    xlated_prog_len: u32,
    jited_prog_insns: u64,
    xlated_prog_insns: u64,
    /// Load time, ns since boot.
    pub load_time: u64,
    /// Loader's uid.
    pub created_by_uid: u32,
    nr_map_ids: u32,
    map_ids: u64,
    /// Name.
    pub name: [u8; 16],
}

/// `BPF_OBJ_GET_INFO_BY_FD` on a program.
///
/// # Errors
/// errno.
pub fn prog_info(fd: BorrowedFd<'_>) -> io::Result<ProgInfo> {
    info_by_fd(fd)
}

#[repr(C)]
#[derive(Clone, Copy)]
struct QueryAttr {
    target_fd: u32,
    attach_type: u32,
    query_flags: u32,
    attach_flags: u32,
    prog_ids: u64,
    prog_cnt: u32,
    _pad: u32,
}

impl QueryAttr {
    /// A `BPF_PROG_QUERY` of `cgroup`'s device programs with `query_flags`,
    /// their ids written into `ids` (as many as it holds).
    fn device(cgroup: BorrowedFd<'_>, query_flags: u32, ids: &mut [u32]) -> QueryAttr {
        QueryAttr {
            target_fd: cgroup.as_raw_fd() as u32,
            attach_type: ATTACH_CGROUP_DEVICE,
            query_flags,
            attach_flags: 0,
            prog_ids: ids.as_mut_ptr() as u64,
            prog_cnt: ids.len() as u32,
            _pad: 0,
        }
    }
}

/// Programs attached directly at a cgroup (not inherited), for the device
/// attach type: `(attach_flags, prog_ids)`. Link-attached programs are
/// listed too.
///
/// # Errors
/// errno.
pub fn prog_query_cgroup_device(cgroup: BorrowedFd<'_>) -> io::Result<(u32, Vec<u32>)> {
    let mut ids = vec![0u32; 64];
    let mut a = QueryAttr::device(cgroup, 0, &mut ids);
    bpf(BPF_PROG_QUERY, &mut a)?;
    ids.truncate(a.prog_cnt as usize);
    Ok((a.attach_flags, ids))
}

/// Offset of `revision` in the `query` member of `union bpf_attr` (6.6+,
/// `include/uapi/linux/bpf.h`): after `prog_attach_flags`, `link_ids` and
/// `link_attach_flags`, past the 32 bytes of [`QueryAttr`].
pub const QUERY_REVISION_OFFSET: usize = 56;

/// `BPF_PROG_QUERY` of a cgroup's device programs through a buffer of
/// [`ATTR_SIZE`] bytes followed by 64 guard bytes of `0xAA`: the query's
/// `revision` as the kernel wrote it at [`QUERY_REVISION_OFFSET`] (0 on
/// kernels before 6.6, which do not write it), and the guard bytes
/// afterwards. Shows that the attr every call passes is large enough.
///
/// # Errors
/// errno.
pub fn prog_query_guarded(cgroup: BorrowedFd<'_>) -> io::Result<(u64, [u8; 64])> {
    #[repr(C, align(8))]
    struct Guarded {
        attr: [u8; ATTR_SIZE],
        guard: [u8; 64],
    }
    let mut g = Guarded {
        attr: [0; ATTR_SIZE],
        guard: [0xAA; 64],
    };
    let mut ids = vec![0u32; 64];
    let mut a = QueryAttr::device(cgroup, 0, &mut ids);
    bpf_raw(BPF_PROG_QUERY, &mut a, &mut g.attr)?;
    let at = QUERY_REVISION_OFFSET;
    let revision = u64::from_ne_bytes(g.attr[at..at + 8].try_into().unwrap_or([0; 8]));
    Ok((revision, g.guard))
}

/// Trims a NUL-padded BPF object name.
pub fn name_str(b: &[u8; 16]) -> String {
    let end = b.iter().position(|c| *c == 0).unwrap_or(16);
    String::from_utf8_lossy(&b[..end]).into_owned()
}

const BPF_PROG_ATTACH: i32 = 8;
const BPF_PROG_DETACH: i32 = 9;
const BPF_PROG_GET_FD_BY_ID: i32 = 13;
/// `BPF_F_QUERY_EFFECTIVE`.
pub const F_QUERY_EFFECTIVE: u32 = 1;

#[repr(C)]
#[derive(Clone, Copy)]
struct AttachAttr {
    target_fd: u32,
    attach_bpf_fd: u32,
    attach_type: u32,
    attach_flags: u32,
}

/// `BPF_PROG_ATTACH` of a device program on a cgroup with `flags`
/// (0, `BPF_F_ALLOW_OVERRIDE` or `BPF_F_ALLOW_MULTI`), as Slurm, systemd
/// and runc attach theirs. gpufence itself attaches through a link; this is
/// for tests that put a foreign program beside the fence.
///
/// # Errors
/// errno.
pub fn prog_attach_cgroup_device(
    prog: BorrowedFd<'_>,
    cgroup: BorrowedFd<'_>,
    flags: u32,
) -> io::Result<()> {
    let mut a = AttachAttr {
        target_fd: cgroup.as_raw_fd() as u32,
        attach_bpf_fd: prog.as_raw_fd() as u32,
        attach_type: ATTACH_CGROUP_DEVICE,
        attach_flags: flags,
    };
    bpf(BPF_PROG_ATTACH, &mut a).map(|_| ())
}

/// `BPF_PROG_DETACH` of `prog` from a cgroup's device hook.
///
/// # Errors
/// errno.
pub fn prog_detach_cgroup_device(prog: BorrowedFd<'_>, cgroup: BorrowedFd<'_>) -> io::Result<()> {
    let mut a = AttachAttr {
        target_fd: cgroup.as_raw_fd() as u32,
        attach_bpf_fd: prog.as_raw_fd() as u32,
        attach_type: ATTACH_CGROUP_DEVICE,
        attach_flags: 0,
    };
    bpf(BPF_PROG_DETACH, &mut a).map(|_| ())
}

#[repr(C)]
#[derive(Clone, Copy)]
struct GetIdAttr {
    id: u32,
    next_id: u32,
    open_flags: u32,
}

/// `BPF_PROG_GET_FD_BY_ID`.
///
/// # Errors
/// errno (`ENOENT` when the program is gone).
pub fn prog_fd_by_id(id: u32) -> io::Result<OwnedFd> {
    let mut a = GetIdAttr {
        id,
        next_id: 0,
        open_flags: 0,
    };
    bpf(BPF_PROG_GET_FD_BY_ID, &mut a).map(fd_result)
}

/// Like [`prog_query_cgroup_device`] with query flags (e.g.
/// [`F_QUERY_EFFECTIVE`]: every program that runs for the cgroup).
///
/// # Errors
/// errno.
pub fn prog_query_cgroup_device_flags(
    cgroup: BorrowedFd<'_>,
    query_flags: u32,
) -> io::Result<(u32, Vec<u32>)> {
    let mut ids = vec![0u32; 128];
    let mut a = QueryAttr::device(cgroup, query_flags, &mut ids);
    bpf(BPF_PROG_QUERY, &mut a)?;
    ids.truncate(a.prog_cnt as usize);
    Ok((a.attach_flags, ids))
}

// ---------------------------------------------------------------------------
// BPF iterators (`kernel/bpf/bpf_iter.c`): a tracing program attached to an
// iterator target, a link, and a file whose read() runs the program once per
// object.

const BPF_ITER_CREATE: i32 = 33;
/// `BPF_PROG_TYPE_TRACING`.
pub const PROG_TYPE_TRACING: u32 = 26;
/// `BPF_TRACE_ITER` (`enum bpf_attach_type`).
pub const ATTACH_TRACE_ITER: u32 = 28;

/// `union bpf_attr` for `BPF_PROG_LOAD` up to `attach_btf_obj_fd`.
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct ProgLoadBtfAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
    prog_btf_fd: u32,
    func_info_rec_size: u32,
    func_info: u64,
    func_info_cnt: u32,
    line_info_rec_size: u32,
    line_info: u64,
    line_info_cnt: u32,
    attach_btf_id: u32,
    attach_btf_obj_fd: u32,
    _pad: u32,
}

/// `BPF_PROG_LOAD` of a `BPF_PROG_TYPE_TRACING` program with
/// `expected_attach_type` `BPF_TRACE_ITER`, attached to the vmlinux BTF
/// function `attach_btf_id` (a `bpf_iter_<target>` from
/// `DEFINE_BPF_ITER_FUNC`). License "GPL": `bpf_seq_write` is GPL-only
/// (`kernel/trace/bpf_trace.c`) and gpufence is GPL-2.0-or-later. On
/// failure, loads again with the verifier log on.
///
/// # Errors
/// [`LoadError`] (`EPERM` without CAP_BPF and CAP_PERFMON, `ESRCH`/`EINVAL`
/// for an id that is not an iterator target, `EACCES` from the verifier).
pub fn prog_load_iter(
    insns: &[RawInsn],
    name: &str,
    attach_btf_id: u32,
) -> Result<OwnedFd, LoadError> {
    prog_load_iter_funcs(insns, name, attach_btf_id, None)
}

/// One `struct bpf_func_info` (`include/uapi/linux/bpf.h`): where a
/// function starts and its `BTF_KIND_FUNC` type id in the program's BTF.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FuncInfo {
    /// Its first instruction.
    pub insn_off: u32,
    /// Its `BTF_KIND_FUNC` id.
    pub type_id: u32,
}

/// [`prog_load_iter`] of a program with subprograms (a `bpf_loop`
/// callback): `funcs` is the program's BTF (from [`btf_load`]) and one
/// [`FuncInfo`] per function, the first at instruction 0 (the verifier
/// wants `func_info` for callbacks: "missing btf func_info").
///
/// # Errors
/// As [`prog_load_iter`].
pub fn prog_load_iter_funcs(
    insns: &[RawInsn],
    name: &str,
    attach_btf_id: u32,
    funcs: Option<(BorrowedFd<'_>, &[FuncInfo])>,
) -> Result<OwnedFd, LoadError> {
    let license = c"GPL";
    let attempt = |log: Option<&mut Vec<u8>>| {
        let mut a = ProgLoadBtfAttr {
            prog_type: PROG_TYPE_TRACING,
            insn_cnt: insns.len() as u32,
            insns: insns.as_ptr() as u64,
            license: license.as_ptr() as u64,
            prog_name: name16(name),
            expected_attach_type: ATTACH_TRACE_ITER,
            attach_btf_id,
            ..Default::default()
        };
        if let Some((btf, info)) = funcs {
            a.prog_btf_fd = btf.as_raw_fd() as u32;
            a.func_info_rec_size = size_of::<FuncInfo>() as u32;
            a.func_info = info.as_ptr() as u64;
            a.func_info_cnt = info.len() as u32;
        }
        if let Some(buf) = log {
            a.log_level = 1;
            a.log_size = buf.len() as u32;
            a.log_buf = buf.as_mut_ptr() as u64;
        }
        bpf(BPF_PROG_LOAD, &mut a).map(fd_result)
    };
    load_with_log(attempt)
}

const BPF_BTF_LOAD: i32 = 18;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct BtfLoadAttr {
    btf: u64,
    btf_log_buf: u64,
    btf_size: u32,
    btf_log_size: u32,
    btf_log_level: u32,
    _pad: u32,
}

/// `BPF_BTF_LOAD` of a BTF blob (`struct btf_header`, types, strings:
/// `include/uapi/linux/btf.h`), for a program's `func_info`.
///
/// # Errors
/// errno (`EINVAL` for a malformed blob).
pub fn btf_load(data: &[u8]) -> io::Result<OwnedFd> {
    let mut a = BtfLoadAttr {
        btf: data.as_ptr() as u64,
        btf_size: data.len() as u32,
        ..Default::default()
    };
    bpf(BPF_BTF_LOAD, &mut a).map(fd_result)
}

#[repr(C)]
#[derive(Clone, Copy)]
struct LinkCreateIterAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
    iter_info: u64,
    iter_info_len: u32,
    _pad: u32,
}

/// `BPF_LINK_CREATE` of an iterator program with no `bpf_iter_link_info`:
/// for the task iterators, every task of the caller's pid namespace
/// (`bpf_iter_attach_task`, `kernel/bpf/task_iter.c`). Nothing is attached
/// anywhere: the link only names the program for [`iter_create`].
///
/// # Errors
/// errno.
pub fn link_create_iter(prog: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let mut a = LinkCreateIterAttr {
        prog_fd: prog.as_raw_fd() as u32,
        target_fd: 0,
        attach_type: ATTACH_TRACE_ITER,
        flags: 0,
        iter_info: 0,
        iter_info_len: 0,
        _pad: 0,
    };
    bpf(BPF_LINK_CREATE, &mut a).map(fd_result)
}

/// `BPF_CGROUP_ITER_SELF_ONLY` (`enum bpf_cgroup_iter_order`,
/// `include/uapi/linux/bpf.h`): the program runs for the start cgroup only.
pub const CGROUP_ITER_SELF_ONLY: u32 = 1;
/// `BPF_CGROUP_ITER_ANCESTORS_UP`: the start cgroup, then each parent up to
/// the root of the hierarchy (`cgroup_iter_seq_next`: `curr->parent`,
/// whatever cgroup namespace the reader is in).
pub const CGROUP_ITER_ANCESTORS_UP: u32 = 4;

/// The `cgroup` member of `union bpf_iter_link_info`
/// (`include/uapi/linux/bpf.h`, Linux 6.1): the order, and the start
/// cgroup as an fd or an id (at most one non-zero).
#[repr(C)]
#[derive(Clone, Copy)]
struct CgroupIterInfo {
    order: u32,
    cgroup_fd: u32,
    cgroup_id: u64,
}

/// `BPF_LINK_CREATE` of a cgroup iterator program (`bpf_iter_attach_cgroup`,
/// `kernel/bpf/cgroup_iter.c`) starting at the cgroup whose directory
/// `cgroup` is open, walking in `order` ([`CGROUP_ITER_SELF_ONLY`],
/// [`CGROUP_ITER_ANCESTORS_UP`]). Nothing is attached to the cgroup: the
/// link holds a reference to it for [`iter_create`].
///
/// # Errors
/// errno (`EINVAL` for an order the kernel does not know, `EBADF` for an fd
/// that is not a cgroup directory).
pub fn link_create_iter_cgroup(
    prog: BorrowedFd<'_>,
    cgroup: BorrowedFd<'_>,
    order: u32,
) -> io::Result<OwnedFd> {
    let info = CgroupIterInfo {
        order,
        cgroup_fd: cgroup.as_raw_fd() as u32,
        cgroup_id: 0,
    };
    let mut a = LinkCreateIterAttr {
        prog_fd: prog.as_raw_fd() as u32,
        target_fd: 0,
        attach_type: ATTACH_TRACE_ITER,
        flags: 0,
        iter_info: &info as *const CgroupIterInfo as u64,
        iter_info_len: size_of::<CgroupIterInfo>() as u32,
        _pad: 0,
    };
    bpf(BPF_LINK_CREATE, &mut a).map(fd_result)
}

#[repr(C)]
#[derive(Clone, Copy)]
struct IterCreateAttr {
    link_fd: u32,
    flags: u32,
}

/// `BPF_ITER_CREATE`: a new read-only file whose read() runs the link's
/// program over the target's objects (`bpf_iter_new_fd`).
///
/// # Errors
/// errno.
pub fn iter_create(link: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let mut a = IterCreateAttr {
        link_fd: link.as_raw_fd() as u32,
        flags: 0,
    };
    bpf(BPF_ITER_CREATE, &mut a).map(fd_result)
}

/// The instructions of program `fd` as the kernel holds them after
/// verification (`xlated_prog_insns` of `BPF_OBJ_GET_INFO_BY_FD`,
/// `bpf_prog_get_info_by_fd` in `kernel/bpf/syscall.c`): two calls, the
/// first for the length. `bpf_insn_prepare_dump` there turns map
/// references into map ids and, for a reader who may not see kernel
/// addresses, zeroes call targets: a reader runs such a program only when
/// it has neither.
///
/// # Errors
/// errno (`EPERM` without CAP_SYS_ADMIN / CAP_PERFMON).
pub fn prog_xlated(fd: BorrowedFd<'_>) -> io::Result<Vec<crate::asm::RawInsn>> {
    let first: ProgInfo = info_by_fd(fd)?;
    let n = first.xlated_prog_len as usize / size_of::<crate::asm::RawInsn>();
    let mut insns = vec![crate::asm::RawInsn::default(); n];
    let mut info = ProgInfo {
        xlated_prog_len: (n * size_of::<crate::asm::RawInsn>()) as u32,
        xlated_prog_insns: insns.as_mut_ptr() as u64,
        ..Default::default()
    };
    let mut a = InfoAttr {
        bpf_fd: fd.as_raw_fd() as u32,
        info_len: size_of::<ProgInfo>() as u32,
        info: &mut info as *mut ProgInfo as u64,
    };
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut a)?;
    // The program cannot change; a shorter answer is kept as given.
    let got = (info.xlated_prog_len as usize / size_of::<crate::asm::RawInsn>()).min(n);
    insns.truncate(got);
    Ok(insns)
}

/// The `repr(C)` attr and info structs above against the kernel's UAPI
/// layouts. Expected offsets and sizes are those of
/// `include/uapi/linux/bpf.h` (Linux 6.1, as installed in
/// `/usr/include/linux/bpf.h`), computed there with `offsetof`/`sizeof`
/// for x86_64 and aarch64 alike (the UAPI structs use fixed-width types
/// and `__aligned_u64`, so 64-bit targets agree). Our structs are
/// prefixes: the size checked is the offset where the prefix ends,
/// rounded up to its alignment.
#[cfg(test)]
mod layout_tests {
    use super::*;
    use std::mem::{align_of, offset_of};

    /// Asserts `offset_of!(T, field) == off` for each pair.
    macro_rules! offsets {
        ($t:ty { $($f:ident : $off:expr),* $(,)? }) => {
            $(assert_eq!(
                offset_of!($t, $f), $off,
                concat!(stringify!($t), ".", stringify!($f))
            );)*
        };
    }

    #[test]
    fn bpf_attr_members_match_the_uapi_offsets() {
        // `union bpf_attr` is 144 bytes in 6.1: the buffer every call
        // passes is larger.
        const BPF_ATTR_SIZE_6_1: usize = 144;
        const { assert!(ATTR_SIZE >= BPF_ATTR_SIZE_6_1) };
        assert_eq!(align_of::<AttrBuf>(), 8);

        // BPF_MAP_CREATE: the anonymous struct at the union's start.
        offsets!(MapCreateAttr {
            map_type: 0,
            key_size: 4,
            value_size: 8,
            max_entries: 12,
            map_flags: 16,
            inner_map_fd: 20,
            numa_node: 24,
            map_name: 28,
        });
        // map_ifindex follows map_name[16] at 44.
        assert_eq!(size_of::<MapCreateAttr>(), 44);

        // BPF_MAP_*_ELEM: map_fd, key, value/next_key, flags.
        offsets!(MapElemAttr {
            map_fd: 0,
            _pad: 4,
            key: 8,
            value: 16,
            flags: 24,
        });
        assert_eq!(size_of::<MapElemAttr>(), 32);

        // BPF_MAP_*_BATCH: the `batch` member (56 bytes).
        offsets!(BatchAttr {
            in_batch: 0,
            out_batch: 8,
            keys: 16,
            values: 24,
            count: 32,
            map_fd: 36,
            elem_flags: 40,
            flags: 48,
        });
        assert_eq!(size_of::<BatchAttr>(), 56);

        // BPF_PROG_LOAD, up to expected_attach_type (prog_btf_fd at 72).
        offsets!(ProgLoadAttr {
            prog_type: 0,
            insn_cnt: 4,
            insns: 8,
            license: 16,
            log_level: 24,
            log_size: 28,
            log_buf: 32,
            kern_version: 40,
            prog_flags: 44,
            prog_name: 48,
            prog_ifindex: 64,
            expected_attach_type: 68,
        });
        assert_eq!(size_of::<ProgLoadAttr>(), 72);

        // BPF_PROG_LOAD, up to attach_btf_obj_fd (then padding to 120).
        offsets!(ProgLoadBtfAttr {
            prog_type: 0,
            insn_cnt: 4,
            insns: 8,
            license: 16,
            log_level: 24,
            log_size: 28,
            log_buf: 32,
            kern_version: 40,
            prog_flags: 44,
            prog_name: 48,
            prog_ifindex: 64,
            expected_attach_type: 68,
            prog_btf_fd: 72,
            func_info_rec_size: 76,
            func_info: 80,
            func_info_cnt: 88,
            line_info_rec_size: 92,
            line_info: 96,
            line_info_cnt: 104,
            attach_btf_id: 108,
            attach_btf_obj_fd: 112,
            _pad: 116,
        });
        assert_eq!(size_of::<ProgLoadBtfAttr>(), 120);

        // BPF_OBJ_PIN / BPF_OBJ_GET.
        offsets!(ObjAttr {
            pathname: 0,
            bpf_fd: 8,
            file_flags: 12,
        });
        assert_eq!(size_of::<ObjAttr>(), 16);

        // BPF_PROG_ATTACH / BPF_PROG_DETACH (replace_bpf_fd at 16).
        offsets!(AttachAttr {
            target_fd: 0,
            attach_bpf_fd: 4,
            attach_type: 8,
            attach_flags: 12,
        });
        assert_eq!(size_of::<AttachAttr>(), 16);

        // BPF_*_GET_FD_BY_ID: prog_id (start_id, map_id...), next_id,
        // open_flags.
        offsets!(GetIdAttr {
            id: 0,
            next_id: 4,
            open_flags: 8,
        });
        assert_eq!(size_of::<GetIdAttr>(), 12);

        // BPF_OBJ_GET_INFO_BY_FD: the `info` member.
        offsets!(InfoAttr {
            bpf_fd: 0,
            info_len: 4,
            info: 8,
        });
        assert_eq!(size_of::<InfoAttr>(), 16);

        // BPF_PROG_QUERY: the `query` member up to prog_cnt
        // (prog_attach_flags at 32).
        offsets!(QueryAttr {
            target_fd: 0,
            attach_type: 4,
            query_flags: 8,
            attach_flags: 12,
            prog_ids: 16,
            prog_cnt: 24,
            _pad: 28,
        });
        assert_eq!(size_of::<QueryAttr>(), 32);
        // `revision` (6.6+: after prog_attach_flags at 32, link_ids at 40
        // and link_attach_flags at 48) lies past the struct, inside the
        // buffer.
        const { assert!(QUERY_REVISION_OFFSET >= size_of::<QueryAttr>()) };
        const { assert!(QUERY_REVISION_OFFSET + 8 <= ATTR_SIZE) };

        // BPF_BTF_LOAD (btf_log_true_size at 28 since 6.4: our padding).
        offsets!(BtfLoadAttr {
            btf: 0,
            btf_log_buf: 8,
            btf_size: 16,
            btf_log_size: 20,
            btf_log_level: 24,
            _pad: 28,
        });
        assert_eq!(size_of::<BtfLoadAttr>(), 32);

        // BPF_LINK_CREATE: the `link_create` member.
        offsets!(LinkCreateAttr {
            prog_fd: 0,
            target_fd: 4,
            attach_type: 8,
            flags: 12,
        });
        assert_eq!(size_of::<LinkCreateAttr>(), 16);
        offsets!(LinkCreateIterAttr {
            prog_fd: 0,
            target_fd: 4,
            attach_type: 8,
            flags: 12,
            iter_info: 16,
            iter_info_len: 24,
            _pad: 28,
        });
        assert_eq!(size_of::<LinkCreateIterAttr>(), 32);

        // BPF_LINK_UPDATE.
        offsets!(LinkUpdateAttr {
            link_fd: 0,
            new_prog_fd: 4,
            flags: 8,
            old_prog_fd: 12,
        });
        assert_eq!(size_of::<LinkUpdateAttr>(), 16);

        // BPF_LINK_DETACH.
        offsets!(LinkDetachAttr { link_fd: 0 });
        assert_eq!(size_of::<LinkDetachAttr>(), 4);

        // BPF_ITER_CREATE.
        offsets!(IterCreateAttr {
            link_fd: 0,
            flags: 4,
        });
        assert_eq!(size_of::<IterCreateAttr>(), 8);

        // Every attr fits the buffer at an alignment it gives.
        for (size, align) in [
            (size_of::<MapCreateAttr>(), align_of::<MapCreateAttr>()),
            (size_of::<ProgLoadBtfAttr>(), align_of::<ProgLoadBtfAttr>()),
            (size_of::<BatchAttr>(), align_of::<BatchAttr>()),
        ] {
            assert!(size <= ATTR_SIZE && align <= 8);
        }
    }

    #[test]
    fn info_structs_match_the_uapi_offsets() {
        // struct bpf_prog_info, up to name[16] (ifindex at 80).
        offsets!(ProgInfo {
            prog_type: 0,
            id: 4,
            tag: 8,
            jited_prog_len: 16,
            xlated_prog_len: 20,
            jited_prog_insns: 24,
            xlated_prog_insns: 32,
            load_time: 40,
            created_by_uid: 48,
            nr_map_ids: 52,
            map_ids: 56,
            name: 64,
        });
        assert_eq!(size_of::<ProgInfo>(), 80);

        // struct bpf_map_info, up to name[16] (ifindex at 40).
        offsets!(MapInfo {
            map_type: 0,
            id: 4,
            key_size: 8,
            value_size: 12,
            max_entries: 16,
            map_flags: 20,
            name: 24,
        });
        assert_eq!(size_of::<MapInfo>(), 40);

        // struct bpf_link_info with its `cgroup` member: cgroup_id at 16
        // (the union after prog_id is 8-aligned), attach_type at 24.
        offsets!(LinkInfo {
            link_type: 0,
            id: 4,
            prog_id: 8,
            _pad: 12,
            cgroup_id: 16,
            attach_type: 24,
            _pad2: 28,
        });
        assert_eq!(size_of::<LinkInfo>(), 32);

        // The `cgroup` member of union bpf_iter_link_info (16 bytes).
        offsets!(CgroupIterInfo {
            order: 0,
            cgroup_fd: 4,
            cgroup_id: 8,
        });
        assert_eq!(size_of::<CgroupIterInfo>(), 16);

        // struct bpf_func_info (8 bytes).
        offsets!(FuncInfo {
            insn_off: 0,
            type_id: 4,
        });
        assert_eq!(size_of::<FuncInfo>(), 8);
    }
}
