//! The `bpf(2)` commands the fence uses, as owned file descriptors.
//!
//! Attribute layouts are the members of `union bpf_attr` and the info
//! structs in `include/uapi/linux/bpf.h`, prefixes only: the kernel zero-fills
//! what a caller's shorter struct leaves out (`bpf_check_uarg_tail_zero`).

use std::io;
use std::mem::size_of;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

mod info;
mod links;
mod maps;
mod progs;

pub use info::{
    link_info, map_info, name_str, prog_info, prog_map_ids, prog_query_cgroup_device,
    prog_query_cgroup_device_flags, prog_query_guarded, prog_xlated, LinkInfo, MapInfo, ProgInfo,
    QUERY_REVISION_OFFSET,
};
pub use links::{
    iter_create, link_create_cgroup_device, link_create_iter, link_create_iter_cgroup,
    link_create_iter_task, link_detach, link_update, obj_get, obj_pin,
};
pub use maps::{
    map_create, map_delete, map_entries_batch, map_keys, map_lookup, map_obj_get, map_update,
    MapFd, MapShape, RawEntries,
};
pub use progs::{
    btf_load, map_fd_by_id, prog_attach_cgroup_device, prog_detach_cgroup_device, prog_fd_by_id,
    prog_load_cgroup_device, prog_load_iter, prog_load_iter_funcs, FuncInfo, LoadError,
};
// The kernel's numbers these calls take, from the one table of them
// (`crate::uapi`), under the names callers have used from here.
pub use crate::uapi::{
    ATTACH_CGROUP_DEVICE, ATTACH_TRACE_ITER, CGROUP_ITER_ANCESTORS_UP, CGROUP_ITER_SELF_ONLY,
    F_ALLOW_MULTI, F_ALLOW_OVERRIDE, F_QUERY_EFFECTIVE, LINK_TYPE_CGROUP, PROG_TYPE_CGROUP_DEVICE,
    PROG_TYPE_TRACING, UPDATE_ANY,
};

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
    const { assert!(size_of::<T>() <= ATTR_SIZE && align_of::<T>() <= 8) };
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

// ---------------------------------------------------------------------------
// BPF iterators (`kernel/bpf/bpf_iter.c`): a tracing program attached to an
// iterator target, a link, and a file whose read() runs the program once per
// object.

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
    use super::info::*;
    use super::links::*;
    use super::maps::*;
    use super::progs::*;
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
