//! Loading iterator programs, linking, pinning and reading their links.

use std::os::fd::{AsFd, OwnedFd};

use super::{IterError, Record, RECORD_LEN};
use crate::asm::Program;
use crate::sys;

/// One loaded iterator: its program (none when opened from a pin) and
/// link.
#[derive(Debug)]
pub struct Loaded {
    pub(crate) _prog: Option<OwnedFd>,
    pub(crate) link: OwnedFd,
}

impl Loaded {
    /// The iterator's link: what [`read_raw`] reads and [`pin_link`] pins.
    pub fn link(&self) -> &OwnedFd {
        &self.link
    }
}

/// Links loaded iterator program `prog` (`BPF_LINK_CREATE`).
fn linked(prog: OwnedFd) -> Result<Loaded, IterError> {
    let link = sys::link_create_iter(prog.as_fd()).map_err(|err| IterError::Sys {
        what: "BPF_LINK_CREATE (iterator)",
        err,
    })?;
    Ok(Loaded {
        _prog: Some(prog),
        link,
    })
}

pub(super) fn load(target: &'static str, p: &Program, btf_id: u32) -> Result<Loaded, IterError> {
    let prog =
        sys::prog_load_iter(&p.insns, &format!("gpufence_{target}"), btf_id).map_err(|e| {
            IterError::Load {
                target,
                errno: e.errno,
                log: e.log,
            }
        })?;
    linked(prog)
}

/// The pin name of the ring iterator's link in the fence's bpffs
/// directory (with [`crate::iter::fdtable::PIN_FDTABLE`]). The suffix is the
/// record format and filter: a gpufence whose programs write something
/// else uses new names, and never reads an old pin.
pub const PIN_RINGS: &str = "iter_task_rings_v1";
/// Every name an iterator pin has had, for removal (`iter_fdtable_v1`:
/// the fd-table program before further passes, which said "not read
/// whole" where it now says where to resume).
pub const PINS: [&str; 3] = [
    crate::iter::fdtable::PIN_FDTABLE,
    PIN_RINGS,
    "iter_fdtable_v1",
];

/// Pins `link` at `dir/name`, replacing what is there: pinned as
/// `name_new`, then renamed over `name` (bpffs renames like any
/// directory: `bpf_dir_iops`, `kernel/bpf/inode.c`), so a reader opens
/// the old link or the new one, never none. (bpffs refuses names with a
/// dot, `bpf_lookup` in `kernel/bpf/inode.c`: hence `_`.)
///
/// # Errors
/// [`IterError::Sys`].
pub fn pin_link(link: &OwnedFd, dir: &std::path::Path, name: &str) -> Result<(), IterError> {
    let tmp = dir.join(format!("{name}_new"));
    let _ = std::fs::remove_file(&tmp);
    sys::obj_pin(link.as_fd(), &tmp).map_err(|err| IterError::Sys {
        what: "BPF_OBJ_PIN (iterator link)",
        err,
    })?;
    std::fs::rename(&tmp, dir.join(name)).map_err(|err| {
        let _ = std::fs::remove_file(&tmp);
        IterError::Sys {
            what: "rename (iterator link pin)",
            err,
        }
    })
}

/// Opens the iterator link pinned at `dir/name`.
///
/// # Errors
/// [`IterError::Sys`] (`ENOENT`: not pinned).
pub fn open_pin(dir: &std::path::Path, name: &str) -> Result<Loaded, IterError> {
    let link = sys::obj_get(&dir.join(name)).map_err(|err| IterError::Sys {
        what: "BPF_OBJ_GET (pinned iterator link)",
        err,
    })?;
    Ok(Loaded { _prog: None, link })
}

/// Reads an iterator to its end. `EAGAIN` means the kernel visited a
/// million objects without output in one read (`MAX_ITER_OBJECTS`,
/// `bpf_seq_read` in `kernel/bpf/bpf_iter.c`) and kept its place: read on.
pub(crate) fn read_all(link: &OwnedFd) -> Result<Vec<Record>, IterError> {
    let out = read_raw(link)?;
    if out.len() % RECORD_LEN != 0 {
        return Err(IterError::Malformed(format!(
            "{} bytes is not a whole number of {RECORD_LEN}-byte records",
            out.len()
        )));
    }
    out.chunks_exact(RECORD_LEN)
        .map(|c| {
            <&[u8; RECORD_LEN]>::try_from(c)
                .ok()
                .and_then(Record::decode)
                .ok_or_else(|| IterError::Malformed(format!("record {c:?}")))
        })
        .collect()
}

/// The bytes a fresh walk of iterator `link` writes, to its end.
///
/// # Errors
/// [`IterError::Sys`]: `BPF_ITER_CREATE` or a read failed.
pub fn read_raw(link: &OwnedFd) -> Result<Vec<u8>, IterError> {
    let file = sys::iter_create(link.as_fd()).map_err(|err| IterError::Sys {
        what: "BPF_ITER_CREATE",
        err,
    })?;
    let mut out = Vec::new();
    // One buffer large enough for a whole walk's usual output: the cgroup
    // iterator cannot resume a walk in a second read(2) (EOPNOTSUPP,
    // `cgroup_iter_seq_start` in kernel/bpf/cgroup_iter.c), so a small
    // first read (`read_to_end`'s probe) fails the level iterator.
    let mut buf = vec![0u8; 1 << 16];
    let mut again = 0u32;
    loop {
        let n = match nix::unistd::read(&file, &mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(nix::errno::Errno::EAGAIN) if again < 10_000 => {
                again += 1;
                continue;
            }
            Err(e) => {
                return Err(IterError::Sys {
                    what: "reading the iterator",
                    err: e.into(),
                })
            }
        };
        out.extend_from_slice(&buf[..n]);
    }
    Ok(out)
}

/// The BTF of a program of two functions, `long <main>(void *ctx)` and
/// the static `bpf_loop` callback `long <callback>(long index, void *ctx)`
/// (`include/uapi/linux/btf.h`: header, types, strings). Type ids: 4 the
/// main function, 6 the callback.
fn funcs_btf(main: &str, callback: &str) -> Vec<u8> {
    use crate::btf::kind::{
        FUNC as KIND_FUNC, FUNC_PROTO as KIND_FUNC_PROTO, INT as KIND_INT, PTR as KIND_PTR,
    };
    let mut strs: Vec<u8> = vec![0];
    let mut name = |n: &str| -> u32 {
        let at = strs.len() as u32;
        strs.extend_from_slice(n.as_bytes());
        strs.push(0);
        at
    };
    let (long, ctx, index) = (name("long"), name("ctx"), name("index"));
    let (main, callback) = (name(main), name(callback));
    let mut t: Vec<u32> = Vec::new();
    let info = |kind: u32, vlen: u32| kind << 24 | vlen;
    // 1: long (signed, 64 bits)
    t.extend([long, info(KIND_INT, 0), 8, 1 << 24 | 64]);
    // 2: void *
    t.extend([0, info(KIND_PTR, 0), 0]);
    // 3: long (void *ctx)
    t.extend([0, info(KIND_FUNC_PROTO, 1), 1, ctx, 2]);
    // 4: main, static
    t.extend([main, info(KIND_FUNC, 0), 3]);
    // 5: long (long index, void *ctx)
    t.extend([0, info(KIND_FUNC_PROTO, 2), 1, index, 1, ctx, 2]);
    // 6: the callback, static (a callback must be)
    t.extend([callback, info(KIND_FUNC, 0), 5]);
    let types: Vec<u8> = t.iter().flat_map(|w| w.to_ne_bytes()).collect();
    let mut out = Vec::new();
    out.extend(crate::btf::BTF_MAGIC.to_ne_bytes());
    out.extend([1u8, 0u8]);
    for w in [
        24u32,
        0,
        types.len() as u32,
        types.len() as u32,
        strs.len() as u32,
    ] {
        out.extend(w.to_ne_bytes());
    }
    out.extend(types);
    out.extend(strs);
    out
}

/// Loads iterator program `p` of two functions (the main one at 0, the
/// `bpf_loop` callback where its one `ld_imm64` of a function points)
/// through the real verifier, with their BTF, and links it.
///
/// # Errors
/// [`IterError::Load`] (the verifier's refusal, with its log),
/// [`IterError::Sys`].
pub fn load_with_callback(
    p: &Program,
    prog_name: &str,
    target: &'static str,
    attach_btf_id: u32,
    names: (&str, &str),
) -> Result<Loaded, IterError> {
    let callback = p
        .insns
        .iter()
        .enumerate()
        .find(|(_, i)| {
            i.src() == crate::uapi::PSEUDO_FUNC && i.code == crate::uapi::opcode::LD_IMM64
        })
        .map(|(at, i)| (at as i64 + 1 + i64::from(i.imm)) as u32)
        .ok_or_else(|| IterError::Malformed(format!("the {prog_name} program has no callback")))?;
    let btf = sys::btf_load(&funcs_btf(names.0, names.1)).map_err(|err| IterError::Sys {
        what: "BPF_BTF_LOAD (an iterator program's functions)",
        err,
    })?;
    let funcs = [
        sys::FuncInfo {
            insn_off: 0,
            type_id: 4,
        },
        sys::FuncInfo {
            insn_off: callback,
            type_id: 6,
        },
    ];
    let prog = sys::prog_load_iter_funcs(
        &p.insns,
        prog_name,
        attach_btf_id,
        Some((btf.as_fd(), &funcs)),
    )
    .map_err(|e| IterError::Load {
        target,
        errno: e.errno,
        log: e.log,
    })?;
    linked(prog)
}
