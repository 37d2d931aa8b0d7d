//! A cgroup's level as the kernel counts it, read from the kernel itself.
//!
//! The fence program walks a task's ancestors with
//! `bpf_get_current_ancestor_cgroup_id(level)`, and that level counts from
//! the root of the whole cgroup2 hierarchy (`cgroup->level`,
//! `include/linux/cgroup-defs.h`: root 0, each child one more). Paths do
//! not: in a cgroup namespace (a container, `unshare --cgroup`)
//! `/proc/<pid>/cgroup` and a cgroup2 mount made inside it are relative to
//! the namespace's root, which may sit any number of levels below the real
//! root. Counting path components there gives a level that is short by
//! the namespace root's own level, and a grant recorded at it is never
//! consulted.
//!
//! This module reads the truth with a BPF cgroup iterator
//! (`kernel/bpf/cgroup_iter.c`, Linux 6.1): a `BPF_TRACE_ITER` program on
//! `bpf_iter__cgroup`, linked with `bpf_iter_link_info.cgroup = { order
//! ANCESTORS_UP, cgroup_fd }`, runs once for the cgroup whose directory is
//! open and once for each of its ancestors up to the real root (the walk
//! follows `cgroup->parent`, whatever namespace the reader is in). For
//! each it writes `{ u64 cgroup->kn->id; u32 cgroup->level; u32 0 }` with
//! `bpf_seq_write`; member offsets come from vmlinux BTF ([`CgroupLayout`]).
//! `kn->id` is the cgroup id: the directory's inode number on 64-bit
//! kernels (`kernfs_ino`), the same in every namespace.
//!
//! Nothing is attached to any cgroup: the link only names the program and
//! holds a reference to the start cgroup while it is read.

use std::mem::{offset_of, size_of};
use std::os::fd::{AsFd, BorrowedFd};

use crate::asm::{Asm, AsmError, JmpOp, Program, Reg, Size};
use crate::btf::{Btf, BtfError, Field};
use crate::fp_slot;
use crate::iter::{self, IterError, Seq};
use crate::sys;

/// Where the program finds what it reads, from the running kernel's BTF.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupLayout {
    /// BTF id of `bpf_iter_cgroup` (the `attach_btf_id`).
    pub iter_cgroup: u32,
    ctx_cgroup: Field,
    meta_seq: Field,
    level: Field,
    kn: Field,
    kn_id: Field,
}

impl CgroupLayout {
    /// Reads the layout from parsed BTF. The iterator context is
    /// `struct bpf_iter__cgroup { meta; cgroup; }` (`DEFINE_BPF_ITER_FUNC(cgroup, ...)`,
    /// `kernel/bpf/cgroup_iter.c`); `struct cgroup` has `int level` and
    /// `struct kernfs_node *kn`, whose `u64 id` is the cgroup id.
    ///
    /// # Errors
    /// [`BtfError`]: no cgroup iterator in this kernel (before 6.1), or a
    /// member missing or not of the width read.
    pub fn from_btf(btf: &Btf) -> Result<CgroupLayout, BtfError> {
        Ok(CgroupLayout {
            iter_cgroup: btf.func_id("bpf_iter_cgroup")?,
            ctx_cgroup: iter::sized(btf, "bpf_iter__cgroup", "cgroup", 8, true)?,
            meta_seq: iter::sized(btf, "bpf_iter_meta", "seq", 8, true)?,
            level: iter::sized(btf, "cgroup", "level", 4, false)?,
            kn: iter::sized(btf, "cgroup", "kn", 8, true)?,
            kn_id: iter::sized(btf, "kernfs_node", "id", 8, false)?,
        })
    }

    /// [`CgroupLayout::from_btf`] of the running kernel's BTF.
    ///
    /// # Errors
    /// [`BtfError`] (no `/sys/kernel/btf/vmlinux`: `CONFIG_DEBUG_INFO_BTF=n`).
    pub fn vmlinux() -> Result<CgroupLayout, BtfError> {
        Self::from_btf(&Btf::vmlinux()?)
    }
}

/// The id of the root cgroup of the cgroup2 hierarchy: kernfs numbers the
/// nodes of a root from 1 and the root's own directory comes first
/// (`kernfs_create_root`, `__kernfs_new_node`: `idr_alloc_cyclic(.., 1, ..)`,
/// `fs/kernfs/dir.c`), so `stat` of the hierarchy's root says inode 1 and
/// `bpf_get_current_ancestor_cgroup_id(0)` returns 1. Every other cgroup,
/// a cgroup namespace's root included, has another id.
pub const ROOT_CGROUP_ID: u64 = 1;

/// One record as [`level_program`] writes it with `bpf_seq_write`, in
/// native byte order: `struct { u64 id; u32 level; u32 pad; }`. The
/// program's store offsets and [`decode`]'s read offsets both come from
/// this layout.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LevelRecord {
    /// `cgroup->kn->id`.
    pub id: u64,
    /// `cgroup->level`.
    pub level: u32,
    /// 0.
    pub pad: u32,
}

/// Bytes of one [`LevelRecord`]: 16.
pub const LEVEL_RECORD_LEN: usize = size_of::<LevelRecord>();

/// The level program's stack frame: the record alone.
#[repr(C)]
struct Frame {
    rec: LevelRecord,
}

/// The record's slot (fp-16) and its members' offsets.
const REC: i16 = fp_slot!(Frame, rec);
const ID: usize = offset_of!(LevelRecord, id);
const LEVEL: usize = offset_of!(LevelRecord, level);
const PAD: usize = offset_of!(LevelRecord, pad);

/// One cgroup as the kernel sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelCgroup {
    /// Its id (`cgroup->kn->id`): the directory's inode number.
    pub id: u64,
    /// `cgroup->level`: 0 for the root of the hierarchy.
    pub level: u32,
}

/// The iterator program: for each cgroup visited, one record.
///
/// ```c
/// int levels(struct bpf_iter__cgroup *ctx) {
///     struct cgroup *c = ctx->cgroup;
///     if (!c) return 0;                   // the call that ends the walk
///     struct kernfs_node *kn = c->kn;
///     if (!kn) return 0;
///     struct { u64 id; u32 level; u32 pad; } r = { kn->id, c->level, 0 };
///     bpf_seq_write(ctx->meta->seq, &r, 16);
///     return 0;                           // 0: go on to the parent
/// }
/// ```
///
/// # Errors
/// [`AsmError`] (a bug here).
pub fn level_program(l: &CgroupLayout) -> Result<Program, AsmError> {
    let mut a = Asm::new();
    a.comment("cgroup iterator: ctx = { meta, cgroup }")
        .mov64_reg(Reg::R6, Reg::R1)
        .load(Size::DW, Reg::R7, Reg::R6, iter::off(&l.ctx_cgroup))
        .comment("cgroup is NULL in the call that ends the walk")
        .jmp_imm(JmpOp::Eq, Reg::R7, 0, "out")
        .load(Size::DW, Reg::R8, Reg::R7, iter::off(&l.kn))
        .jmp_imm(JmpOp::Eq, Reg::R8, 0, "out")
        .comment("r = { kn->id, cgroup->level, 0 } (fp-16)")
        .load(iter::size(&l.kn_id), Reg::R3, Reg::R8, iter::off(&l.kn_id))
        .store(Size::DW, Reg::R10, REC + ID as i16, Reg::R3)
        .load(iter::size(&l.level), Reg::R2, Reg::R7, iter::off(&l.level))
        .store(Size::W, Reg::R10, REC + LEVEL as i16, Reg::R2)
        .store_imm(Size::W, Reg::R10, REC + PAD as i16, 0)
        .comment("bpf_seq_write(ctx->meta->seq, &r, 16)");
    let seq = Seq::Ctx {
        ctx: Reg::R6,
        meta_seq: iter::off(&l.meta_seq),
    };
    iter::seq_write(&mut a, seq, REC, LEVEL_RECORD_LEN);
    a.label("out").mov64_imm(Reg::R0, 0).exit();
    a.assemble()
}

/// Decodes the iterator's output.
///
/// # Errors
/// [`IterError::Malformed`] for a length that is not a whole number of
/// records.
pub fn decode(bytes: &[u8]) -> Result<Vec<KernelCgroup>, IterError> {
    if !bytes.len().is_multiple_of(LEVEL_RECORD_LEN) {
        return Err(IterError::Malformed(format!(
            "{} bytes is not a whole number of {LEVEL_RECORD_LEN}-byte cgroup records",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(LEVEL_RECORD_LEN)
        .map(|c| {
            let mut id = [0u8; 8];
            id.copy_from_slice(&c[ID..ID + 8]);
            let mut level = [0u8; 4];
            level.copy_from_slice(&c[LEVEL..LEVEL + 4]);
            KernelCgroup {
                id: u64::from_ne_bytes(id),
                level: u32::from_ne_bytes(level),
            }
        })
        .collect())
}

/// The cgroup whose directory `dir` is open, then each of its ancestors up
/// to the root of the hierarchy, as the kernel has them: one cgroup
/// iterator walk (`BPF_CGROUP_ITER_ANCESTORS_UP`).
///
/// # Errors
/// [`IterError`]: no vmlinux BTF or no cgroup iterator (before 6.1), no
/// permission (CAP_BPF and CAP_PERFMON), `dir` not a cgroup directory.
pub fn ancestors_up(dir: BorrowedFd<'_>) -> Result<Vec<KernelCgroup>, IterError> {
    let layout = CgroupLayout::vmlinux()?;
    let prog = level_program(&layout)?;
    let prog =
        sys::prog_load_iter(&prog.insns, "gpufence_cglevel", layout.iter_cgroup).map_err(|e| {
            IterError::Load {
                target: "cgroup",
                errno: e.errno,
                log: e.log,
            }
        })?;
    let link = sys::link_create_iter_cgroup(prog.as_fd(), dir, sys::CGROUP_ITER_ANCESTORS_UP)
        .map_err(|err| IterError::Sys {
            what: "BPF_LINK_CREATE (cgroup iterator)",
            err,
        })?;
    decode(&iter::read_raw(&link)?)
}

/// Why a walk up the cgroup tree is not one cgroup's chain of ancestors
/// ([`chain_by_level`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    /// The iterator reported nothing.
    #[error("the cgroup iterator reported no cgroup")]
    Empty,
    /// It started at another cgroup.
    #[error("the cgroup iterator reported cgroup id {got}, not {id}")]
    OtherCgroup {
        /// The cgroup it reported first.
        got: u64,
        /// The cgroup asked about.
        id: u64,
    },
    /// It is not one cgroup per level up to the root.
    #[error("cgroup id {id} is at level {level} but the walk up has {len} cgroups")]
    Length {
        /// The cgroup asked about.
        id: u64,
        /// Its level.
        level: u32,
        /// Cgroups in the walk.
        len: usize,
    },
    /// It does not end at the hierarchy's root.
    #[error(
        "the walk up from cgroup id {id} ends at cgroup id {root}, not the root's {}",
        ROOT_CGROUP_ID
    )]
    NotAtRoot {
        /// The cgroup asked about.
        id: u64,
        /// Where the walk ended.
        root: u64,
    },
    /// A level is skipped or repeated.
    #[error("the walk up from cgroup id {id} has level {level} at step {step}")]
    Gap {
        /// The cgroup asked about.
        id: u64,
        /// The level found.
        level: u32,
        /// Where in the walk.
        step: usize,
    },
}

/// Checks that `walk` is what [`ancestors_up`] gives for the cgroup `id`:
/// that cgroup first, each next one level up, ending at the root (level 0,
/// [`ROOT_CGROUP_ID`]). Returns the ids by level: index
/// 0 the root, the last `id`.
///
/// # Errors
/// [`ChainError`]: what does not fit.
pub fn chain_by_level(walk: &[KernelCgroup], id: u64) -> Result<Vec<u64>, ChainError> {
    let Some(first) = walk.first() else {
        return Err(ChainError::Empty);
    };
    if first.id != id {
        return Err(ChainError::OtherCgroup { got: first.id, id });
    }
    if walk.len() != first.level as usize + 1 {
        return Err(ChainError::Length {
            id,
            level: first.level,
            len: walk.len(),
        });
    }
    for (i, c) in walk.iter().enumerate() {
        if c.level as usize != first.level as usize - i {
            return Err(ChainError::Gap {
                id,
                level: c.level,
                step: i,
            });
        }
    }
    let root = walk[walk.len() - 1].id;
    if root != ROOT_CGROUP_ID {
        return Err(ChainError::NotAtRoot { id, root });
    }
    Ok(walk.iter().rev().map(|c| c.id).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: u64, level: u32) -> Vec<u8> {
        let mut v = id.to_ne_bytes().to_vec();
        v.extend_from_slice(&level.to_ne_bytes());
        v.extend_from_slice(&0u32.to_ne_bytes());
        v
    }

    #[test]
    fn records_decode_and_chain() {
        let bytes = [rec(77, 2), rec(9, 1), rec(1, 0)].concat();
        let walk = decode(&bytes).unwrap();
        assert_eq!(
            walk,
            vec![
                KernelCgroup { id: 77, level: 2 },
                KernelCgroup { id: 9, level: 1 },
                KernelCgroup { id: 1, level: 0 }
            ]
        );
        assert_eq!(chain_by_level(&walk, 77).unwrap(), vec![1, 9, 77]);
        assert!(decode(&bytes[..20]).is_err());
        // Another start, a gap, a wrong root: refused.
        assert!(chain_by_level(&walk, 78).is_err());
        assert!(chain_by_level(&walk[..2], 77).is_err());
        let gap = decode(&[rec(77, 3), rec(9, 1), rec(1, 0)].concat()).unwrap();
        assert!(chain_by_level(&gap, 77).is_err());
        let odd_root = decode(&[rec(77, 1), rec(5, 0)].concat()).unwrap();
        assert!(chain_by_level(&odd_root, 77).is_err());
        assert!(chain_by_level(&[], 77).is_err());
    }

    /// The level program emits exactly the instructions it emitted when
    /// this fingerprint was recorded (before its record was typed).
    #[test]
    fn program_keeps_its_bytes() {
        use crate::iter::tests::{field, insn_hash};
        let l = CgroupLayout {
            iter_cgroup: 99,
            ctx_cgroup: field(8, 8, true),
            meta_seq: field(0, 8, true),
            level: field(100, 4, false),
            kn: field(200, 8, true),
            kn_id: field(48, 8, false),
        };
        let got = insn_hash(&level_program(&l).unwrap());
        assert_eq!(got, (18, 6229468317542342033), "{got:?}");
    }
}

#[cfg(test)]
mod live {
    use super::*;
    use crate::hierarchy::{level_of, Cgroup2, ROOT_CGROUP_ID};
    use std::os::unix::fs::MetadataExt;

    /// Outside any cgroup namespace, the kernel's level of a cgroup is its
    /// depth below the cgroup2 mount, and the walk up names each ancestor
    /// by the inode of its directory: checked, through the real verifier,
    /// for the root and for cgroups of the first three levels found here
    /// (read only: nothing is made or attached). Skipped without root,
    /// cgroup2 or BTF.
    #[test]
    fn kernel_levels_are_depths_outside_namespaces() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIPPED: needs root");
            return;
        }
        let Ok(cg) = Cgroup2::discover() else {
            eprintln!("SKIPPED: no cgroup2");
            return;
        };
        if let Err(e) = CgroupLayout::vmlinux() {
            eprintln!("SKIPPED: {e}");
            return;
        }
        assert_eq!(cg.root_chain().unwrap().as_ref(), &[ROOT_CGROUP_ID]);
        let mut found = vec![String::new()];
        let mut frontier = vec![String::new()];
        for _ in 0..3 {
            let mut next = Vec::new();
            for rel in &frontier {
                let Ok(rd) = std::fs::read_dir(cg.path(rel)) else {
                    continue;
                };
                for e in rd
                    .flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                {
                    let name = e.file_name().to_string_lossy().into_owned();
                    next.push(if rel.is_empty() {
                        name
                    } else {
                        format!("{rel}/{name}")
                    });
                    if next.len() >= 4 {
                        break;
                    }
                }
            }
            found.extend(next.iter().cloned());
            frontier = next;
        }
        for rel in &found {
            // Other tests make and remove cgroups meanwhile: one that is
            // gone by the end of its check is left out.
            let Ok(dir) = std::fs::File::open(cg.path(rel)) else {
                continue;
            };
            let walk = ancestors_up(dir.as_fd());
            if !cg.path(rel).exists() {
                continue;
            }
            let walk = walk.unwrap_or_else(|e| panic!("/{rel}: {e}"));
            let want: Vec<u64> = std::iter::once(ROOT_CGROUP_ID)
                .chain(cg.ancestry(rel).into_iter().map(|(_, id)| id))
                .collect();
            assert_eq!(walk[0].level as usize, level_of(rel), "/{rel}: {walk:?}");
            assert_eq!(walk[0].id, dir.metadata().unwrap().ino(), "/{rel}");
            assert_eq!(chain_by_level(&walk, walk[0].id).unwrap(), want, "/{rel}");
            assert_eq!(cg.kernel_level(rel).unwrap(), level_of(rel));
        }
        // A host whose cgroup2 holds nothing (hybrid, no controllers) has
        // the root alone; tests/tests/cgroupns.rs makes cgroups of its own.
    }
}
