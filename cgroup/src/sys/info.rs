//! `BPF_OBJ_GET_INFO_BY_FD` on links, maps and programs, and the
//! cgroup program queries.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use super::{bpf, bpf_raw, ATTACH_CGROUP_DEVICE, ATTR_SIZE};
use crate::asm::RawInsn;
use crate::uapi::cmd;

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct InfoAttr {
    pub(super) bpf_fd: u32,
    pub(super) info_len: u32,
    pub(super) info: u64,
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
    pub(super) _pad: u32,
    /// The cgroup's id (0 after a detach).
    pub cgroup_id: u64,
    /// Attach type.
    pub attach_type: u32,
    pub(super) _pad2: u32,
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
    info_into(fd, T::default())
}

/// `BPF_OBJ_GET_INFO_BY_FD` into `info` as the caller filled it (buffers
/// and their lengths for the kernel to fill), returned as the kernel
/// left it.
fn info_into<T>(fd: BorrowedFd<'_>, mut info: T) -> io::Result<T> {
    let mut a = InfoAttr {
        bpf_fd: fd.as_raw_fd() as u32,
        info_len: size_of::<T>() as u32,
        info: &mut info as *mut T as u64,
    };
    bpf(cmd::OBJ_GET_INFO_BY_FD, &mut a)?;
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
    pub(super) jited_prog_len: u32,
    pub(super) xlated_prog_len: u32,
    pub(super) jited_prog_insns: u64,
    pub(super) xlated_prog_insns: u64,
    /// Load time, ns since boot.
    pub load_time: u64,
    /// Loader's uid.
    pub created_by_uid: u32,
    pub(super) nr_map_ids: u32,
    pub(super) map_ids: u64,
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

/// The ids of the maps program `fd` uses (`bpf_prog_info.map_ids`, filled
/// by `bpf_prog_get_info_by_fd` in `kernel/bpf/syscall.c`), at most 64.
///
/// # Errors
/// errno.
pub fn prog_map_ids(fd: BorrowedFd<'_>) -> io::Result<Vec<u32>> {
    let mut ids = [0u32; 64];
    let info = info_into(
        fd,
        ProgInfo {
            nr_map_ids: ids.len() as u32,
            map_ids: ids.as_mut_ptr() as u64,
            ..ProgInfo::default()
        },
    )?;
    // The kernel writes the program's count, which may exceed ours.
    let n = (info.nr_map_ids as usize).min(ids.len());
    Ok(ids[..n].to_vec())
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct QueryAttr {
    pub(super) target_fd: u32,
    pub(super) attach_type: u32,
    pub(super) query_flags: u32,
    pub(super) attach_flags: u32,
    pub(super) prog_ids: u64,
    pub(super) prog_cnt: u32,
    pub(super) _pad: u32,
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
    bpf(cmd::PROG_QUERY, &mut a)?;
    ids.truncate(a.prog_cnt as usize);
    Ok((a.attach_flags, ids))
}

/// Offset of `revision` in the `query` member of `union bpf_attr` (6.6+,
/// `include/uapi/linux/bpf.h`): after `prog_attach_flags`, `link_ids` and
/// `link_attach_flags`, past the 32 bytes of `QueryAttr`.
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
    bpf_raw(cmd::PROG_QUERY, &mut a, &mut g.attr)?;
    let at = QUERY_REVISION_OFFSET;
    let revision = u64::from_ne_bytes(g.attr[at..at + 8].try_into().unwrap_or([0; 8]));
    Ok((revision, g.guard))
}

/// Trims a NUL-padded BPF object name.
pub fn name_str(b: &[u8; 16]) -> String {
    let end = b.iter().position(|c| *c == 0).unwrap_or(16);
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// Like [`prog_query_cgroup_device`] with query flags (e.g.
/// [`F_QUERY_EFFECTIVE`](super::F_QUERY_EFFECTIVE): every program that runs for the cgroup).
///
/// # Errors
/// errno.
pub fn prog_query_cgroup_device_flags(
    cgroup: BorrowedFd<'_>,
    query_flags: u32,
) -> io::Result<(u32, Vec<u32>)> {
    let mut ids = vec![0u32; 128];
    let mut a = QueryAttr::device(cgroup, query_flags, &mut ids);
    bpf(cmd::PROG_QUERY, &mut a)?;
    ids.truncate(a.prog_cnt as usize);
    Ok((a.attach_flags, ids))
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
pub fn prog_xlated(fd: BorrowedFd<'_>) -> io::Result<Vec<RawInsn>> {
    let first: ProgInfo = info_by_fd(fd)?;
    let n = first.xlated_prog_len as usize / size_of::<RawInsn>();
    let mut insns = vec![RawInsn::default(); n];
    let info = info_into(
        fd,
        ProgInfo {
            xlated_prog_len: (n * size_of::<RawInsn>()) as u32,
            xlated_prog_insns: insns.as_mut_ptr() as u64,
            ..Default::default()
        },
    )?;
    // The program cannot change; a shorter answer is kept as given.
    let got = (info.xlated_prog_len as usize / size_of::<RawInsn>()).min(n);
    insns.truncate(got);
    Ok(insns)
}
