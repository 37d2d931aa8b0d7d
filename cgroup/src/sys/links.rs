//! Pins, and the links: cgroup device links, iterator links, and the
//! files an iterator link makes.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use super::{bpf, fd_result, ATTACH_CGROUP_DEVICE, ATTACH_TRACE_ITER};
use crate::uapi::cmd;

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct ObjAttr {
    pub(super) pathname: u64,
    pub(super) bpf_fd: u32,
    pub(super) file_flags: u32,
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
    bpf(cmd::OBJ_PIN, &mut a).map(|_| ())
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
    bpf(cmd::OBJ_GET, &mut a).map(fd_result)
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct LinkCreateAttr {
    pub(super) prog_fd: u32,
    pub(super) target_fd: u32,
    pub(super) attach_type: u32,
    pub(super) flags: u32,
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
    bpf(cmd::LINK_CREATE, &mut a).map(fd_result)
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct LinkUpdateAttr {
    pub(super) link_fd: u32,
    pub(super) new_prog_fd: u32,
    pub(super) flags: u32,
    pub(super) old_prog_fd: u32,
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
    bpf(cmd::LINK_UPDATE, &mut a).map(|_| ())
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct LinkDetachAttr {
    pub(super) link_fd: u32,
}

/// `BPF_LINK_DETACH`: detaches the link's program now, whoever holds it.
///
/// # Errors
/// errno.
pub fn link_detach(link: BorrowedFd<'_>) -> io::Result<()> {
    let mut a = LinkDetachAttr {
        link_fd: link.as_raw_fd() as u32,
    };
    bpf(cmd::LINK_DETACH, &mut a).map(|_| ())
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct LinkCreateIterAttr {
    pub(super) prog_fd: u32,
    pub(super) target_fd: u32,
    pub(super) attach_type: u32,
    pub(super) flags: u32,
    pub(super) iter_info: u64,
    pub(super) iter_info_len: u32,
    pub(super) _pad: u32,
}

/// `BPF_LINK_CREATE` of an iterator program with no `bpf_iter_link_info`:
/// for the task iterators, every task of the caller's pid namespace
/// (`bpf_iter_attach_task`, `kernel/bpf/task_iter.c`). Nothing is attached
/// anywhere: the link only names the program for [`iter_create`].
///
/// # Errors
/// errno.
pub fn link_create_iter(prog: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    link_create_iter_info::<()>(prog, None)
}

/// `BPF_LINK_CREATE` of an iterator program with `info` as its
/// `bpf_iter_link_info` (none: `iter_info` 0).
fn link_create_iter_info<I>(prog: BorrowedFd<'_>, info: Option<&I>) -> io::Result<OwnedFd> {
    let mut a = LinkCreateIterAttr {
        prog_fd: prog.as_raw_fd() as u32,
        target_fd: 0,
        attach_type: ATTACH_TRACE_ITER,
        flags: 0,
        iter_info: info.map_or(0, |i| i as *const I as u64),
        iter_info_len: info.map_or(0, |_| size_of::<I>() as u32),
        _pad: 0,
    };
    bpf(cmd::LINK_CREATE, &mut a).map(fd_result)
}

/// The `task` member of `union bpf_iter_link_info`
/// (`include/uapi/linux/bpf.h`, Linux 6.1): at most one of `tid`, `pid`,
/// `pid_fd` non-zero.
#[repr(C)]
#[derive(Clone, Copy)]
struct TaskIterInfo {
    tid: u32,
    pid: u32,
    pid_fd: u32,
}

/// `BPF_LINK_CREATE` of a `task` iterator program that visits one thread,
/// `tid` (`BPF_TASK_ITER_TID`, `bpf_iter_attach_task` in
/// `kernel/bpf/task_iter.c`; a global id: the caller is in the initial
/// pid namespace).
///
/// # Errors
/// errno (`ENOENT`: no such thread; `EINVAL`: a kernel before 6.1).
pub fn link_create_iter_task(prog: BorrowedFd<'_>, tid: u32) -> io::Result<OwnedFd> {
    let info = TaskIterInfo {
        tid,
        pid: 0,
        pid_fd: 0,
    };
    link_create_iter_info(prog, Some(&info))
}

/// The `cgroup` member of `union bpf_iter_link_info`
/// (`include/uapi/linux/bpf.h`, Linux 6.1): the order, and the start
/// cgroup as an fd or an id (at most one non-zero).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct CgroupIterInfo {
    pub(super) order: u32,
    pub(super) cgroup_fd: u32,
    pub(super) cgroup_id: u64,
}

/// `BPF_LINK_CREATE` of a cgroup iterator program (`bpf_iter_attach_cgroup`,
/// `kernel/bpf/cgroup_iter.c`) starting at the cgroup whose directory
/// `cgroup` is open, walking in `order`
/// ([`CGROUP_ITER_SELF_ONLY`](crate::uapi::CGROUP_ITER_SELF_ONLY),
/// [`CGROUP_ITER_ANCESTORS_UP`](crate::uapi::CGROUP_ITER_ANCESTORS_UP)).
/// Nothing is attached to the cgroup: the link holds a reference to it for [`iter_create`].
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
    link_create_iter_info(prog, Some(&info))
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct IterCreateAttr {
    pub(super) link_fd: u32,
    pub(super) flags: u32,
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
    bpf(cmd::ITER_CREATE, &mut a).map(fd_result)
}
