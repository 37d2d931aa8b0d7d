//! Loading programs (device programs, iterator programs with their BTF),
//! attaching and detaching them at cgroups, and opening them by id.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

use super::maps::MapFd;
use super::{
    bpf, fd_result, name16, ATTACH_CGROUP_DEVICE, ATTACH_TRACE_ITER, PROG_TYPE_CGROUP_DEVICE,
    PROG_TYPE_TRACING,
};
use crate::asm::RawInsn;
use crate::uapi::cmd;

#[repr(C)]
#[derive(Default, Clone, Copy)]
pub(super) struct ProgLoadAttr {
    pub(super) prog_type: u32,
    pub(super) insn_cnt: u32,
    pub(super) insns: u64,
    pub(super) license: u64,
    pub(super) log_level: u32,
    pub(super) log_size: u32,
    pub(super) log_buf: u64,
    pub(super) kern_version: u32,
    pub(super) prog_flags: u32,
    pub(super) prog_name: [u8; 16],
    pub(super) prog_ifindex: u32,
    pub(super) expected_attach_type: u32,
}

/// A refused `BPF_PROG_LOAD`: errno and the verifier's log.
#[derive(Debug)]
pub struct LoadError {
    /// errno.
    pub errno: io::Error,
    /// The verifier log (empty when the kernel wrote none).
    pub log: String,
}

/// How many times a `BPF_PROG_LOAD` that says `EAGAIN` is made: the
/// verifier stops with `EAGAIN` when a signal is pending for the loading
/// task (`do_check` in `kernel/bpf/verifier.c`), which says nothing about
/// the program; libbpf retries as often (`PROG_LOAD_ATTEMPTS`,
/// `tools/lib/bpf/bpf.c`).
const LOAD_ATTEMPTS: usize = 5;

/// Runs `attempt` (one `BPF_PROG_LOAD`, with the verifier log buffer when
/// given one), again while it says `EAGAIN` ([`LOAD_ATTEMPTS`] in all); on
/// failure, runs it again with a 1 MiB log so the error carries the
/// verifier's reason. The first errno is the one returned.
fn load_with_log(
    attempt: impl Fn(Option<&mut Vec<u8>>) -> io::Result<OwnedFd>,
) -> Result<OwnedFd, LoadError> {
    let attempt = |mut log: Option<&mut Vec<u8>>| {
        let mut tries = 1;
        loop {
            match attempt(log.as_deref_mut()) {
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) && tries < LOAD_ATTEMPTS => {
                    tries += 1;
                }
                r => return r,
            }
        }
    };
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
        bpf(cmd::PROG_LOAD, &mut a).map(fd_result)
    };
    load_with_log(attempt)
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct AttachAttr {
    pub(super) target_fd: u32,
    pub(super) attach_bpf_fd: u32,
    pub(super) attach_type: u32,
    pub(super) attach_flags: u32,
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
    bpf(cmd::PROG_ATTACH, &mut a).map(|_| ())
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
    bpf(cmd::PROG_DETACH, &mut a).map(|_| ())
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct GetIdAttr {
    pub(super) id: u32,
    pub(super) next_id: u32,
    pub(super) open_flags: u32,
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
    bpf(cmd::PROG_GET_FD_BY_ID, &mut a).map(fd_result)
}

/// `BPF_MAP_GET_FD_BY_ID`: a read-write descriptor of map `id`
/// (CAP_SYS_ADMIN), with its shape.
///
/// # Errors
/// errno (`ENOENT` when the map is gone).
pub fn map_fd_by_id(id: u32) -> io::Result<MapFd> {
    let mut a = GetIdAttr {
        id,
        next_id: 0,
        open_flags: 0,
    };
    MapFd::from_fd(bpf(cmd::MAP_GET_FD_BY_ID, &mut a).map(fd_result)?)
}

/// `union bpf_attr` for `BPF_PROG_LOAD` up to `attach_btf_obj_fd`.
#[repr(C)]
#[derive(Default, Clone, Copy)]
pub(super) struct ProgLoadBtfAttr {
    pub(super) prog_type: u32,
    pub(super) insn_cnt: u32,
    pub(super) insns: u64,
    pub(super) license: u64,
    pub(super) log_level: u32,
    pub(super) log_size: u32,
    pub(super) log_buf: u64,
    pub(super) kern_version: u32,
    pub(super) prog_flags: u32,
    pub(super) prog_name: [u8; 16],
    pub(super) prog_ifindex: u32,
    pub(super) expected_attach_type: u32,
    pub(super) prog_btf_fd: u32,
    pub(super) func_info_rec_size: u32,
    pub(super) func_info: u64,
    pub(super) func_info_cnt: u32,
    pub(super) line_info_rec_size: u32,
    pub(super) line_info: u64,
    pub(super) line_info_cnt: u32,
    pub(super) attach_btf_id: u32,
    pub(super) attach_btf_obj_fd: u32,
    pub(super) _pad: u32,
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
        bpf(cmd::PROG_LOAD, &mut a).map(fd_result)
    };
    load_with_log(attempt)
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct BtfLoadAttr {
    pub(super) btf: u64,
    pub(super) btf_log_buf: u64,
    pub(super) btf_size: u32,
    pub(super) btf_log_size: u32,
    pub(super) btf_log_level: u32,
    pub(super) _pad: u32,
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
    bpf(cmd::BTF_LOAD, &mut a).map(fd_result)
}

#[cfg(test)]
mod load_tests {
    use super::*;
    use std::cell::Cell;

    fn some_fd() -> OwnedFd {
        std::fs::File::open("/dev/null").unwrap().into()
    }

    /// A load interrupted by a pending signal (`EAGAIN`) is made again, up
    /// to [`LOAD_ATTEMPTS`] times; a refusal (`EINVAL`) is not, and comes
    /// back with its errno after one more try with the log.
    #[test]
    fn a_load_that_says_eagain_is_made_again() {
        let calls = Cell::new(0);
        let r = load_with_log(|_| {
            calls.set(calls.get() + 1);
            if calls.get() < 3 {
                Err(io::Error::from_raw_os_error(libc::EAGAIN))
            } else {
                Ok(some_fd())
            }
        });
        assert!(r.is_ok());
        assert_eq!(calls.get(), 3);

        let calls = Cell::new(0);
        let r = load_with_log(|_| {
            calls.set(calls.get() + 1);
            Err(io::Error::from_raw_os_error(libc::EAGAIN))
        });
        assert_eq!(r.unwrap_err().errno.raw_os_error(), Some(libc::EAGAIN));
        assert_eq!(calls.get(), 2 * LOAD_ATTEMPTS);

        let calls = Cell::new(0);
        let r = load_with_log(|_| {
            calls.set(calls.get() + 1);
            Err(io::Error::from_raw_os_error(libc::EINVAL))
        });
        assert_eq!(r.unwrap_err().errno.raw_os_error(), Some(libc::EINVAL));
        assert_eq!(calls.get(), 2);
    }
}
