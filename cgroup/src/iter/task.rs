//! The `task_file` and `task_vma` programs ([`Layout`] from the running
//! kernel's BTF) and their [`Iterators`].

use super::links::{load, read_all, Loaded};
use super::{
    off, seq_write, size, sized, IterError, RawRecord, Record, Seq, ANON_INODE_FS_MAGIC, KIND_ANON,
    KIND_ANON_MAP, KIND_CHAR, KIND_MAP, KIND_SOCK, RECORD_LEN, S_IFCHR, S_IFMT, S_IFSOCK,
};
use crate::asm::{AluOp, Asm, AsmError, JmpOp, Program, Reg, Size};
use crate::btf::{Btf, BtfError, Field};
use crate::fp_slot;

/// Where the programs find what they read, from the running kernel's BTF.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// BTF id of `bpf_iter_task_file` (the `attach_btf_id`).
    pub task_file: u32,
    /// BTF id of `bpf_iter_task_vma`.
    pub task_vma: u32,
    pub(super) ctx_file_task: Field,
    pub(super) ctx_file_fd: Field,
    pub(super) ctx_file_file: Field,
    pub(super) ctx_vma_task: Field,
    pub(super) ctx_vma_vma: Field,
    pub(super) meta_seq: Field,
    pub(super) tgid: Field,
    pub(super) pid: Field,
    pub(super) f_inode: Field,
    pub(super) i_mode: Field,
    pub(super) i_rdev: Field,
    pub(super) i_ino: Field,
    pub(super) i_sb: Field,
    pub(super) s_magic: Field,
    pub(super) vm_file: Field,
}

impl Layout {
    /// Reads the layout from parsed BTF. The iterator contexts are
    /// `struct bpf_iter__task_file { meta; task; u32 fd; file; }` and
    /// `struct bpf_iter__task_vma { meta; task; vma; }`
    /// (`kernel/bpf/task_iter.c`), which vmlinux BTF carries too.
    ///
    /// # Errors
    /// [`BtfError`] when a type or member is missing or not of the width read.
    pub fn from_btf(btf: &Btf) -> Result<Layout, BtfError> {
        Ok(Layout {
            task_file: btf.func_id("bpf_iter_task_file")?,
            task_vma: btf.func_id("bpf_iter_task_vma")?,
            ctx_file_task: sized(btf, "bpf_iter__task_file", "task", 8, true)?,
            ctx_file_fd: sized(btf, "bpf_iter__task_file", "fd", 4, false)?,
            ctx_file_file: sized(btf, "bpf_iter__task_file", "file", 8, true)?,
            ctx_vma_task: sized(btf, "bpf_iter__task_vma", "task", 8, true)?,
            ctx_vma_vma: sized(btf, "bpf_iter__task_vma", "vma", 8, true)?,
            meta_seq: sized(btf, "bpf_iter_meta", "seq", 8, true)?,
            tgid: sized(btf, "task_struct", "tgid", 4, false)?,
            pid: sized(btf, "task_struct", "pid", 4, false)?,
            f_inode: sized(btf, "file", "f_inode", 8, true)?,
            i_mode: sized(btf, "inode", "i_mode", 2, false)?,
            i_rdev: sized(btf, "inode", "i_rdev", 4, false)?,
            i_ino: sized(btf, "inode", "i_ino", 8, false)?,
            i_sb: sized(btf, "inode", "i_sb", 8, true)?,
            s_magic: sized(btf, "super_block", "s_magic", 8, false)?,
            vm_file: sized(btf, "vm_area_struct", "vm_file", 8, true)?,
        })
    }

    /// [`Layout::from_btf`] of the running kernel's BTF.
    ///
    /// # Errors
    /// [`BtfError`].
    pub fn vmlinux() -> Result<Layout, BtfError> {
        Self::from_btf(&Btf::vmlinux()?)
    }
}

/// The stack frame of both programs: the record alone.
#[repr(C)]
struct Frame {
    rec: RawRecord,
}

/// The record's slot (fp-24).
const REC: i16 = fp_slot!(Frame, rec);

/// The common tail: the record from task `r7` (tgid, pid), fd in `r4`,
/// kind in `r2`, value in `r3`, written with `bpf_seq_write(meta->seq)`
/// from ctx `r6`.
fn emit(a: &mut Asm, l: &Layout) {
    a.label("emit")
        .comment("struct { u32 tgid, tid, fd, kind; u64 value; } rec (fp-24)")
        .store(Size::W, Reg::R10, REC + RawRecord::OFF_KIND, Reg::R2)
        .store(Size::DW, Reg::R10, REC + RawRecord::OFF_VALUE, Reg::R3)
        .store(Size::W, Reg::R10, REC + RawRecord::OFF_FD, Reg::R4)
        .load(size(&l.tgid), Reg::R2, Reg::R7, off(&l.tgid))
        .store(Size::W, Reg::R10, REC + RawRecord::OFF_TGID, Reg::R2)
        .load(size(&l.pid), Reg::R2, Reg::R7, off(&l.pid))
        .store(Size::W, Reg::R10, REC + RawRecord::OFF_TID, Reg::R2)
        .comment("bpf_seq_write(ctx->meta->seq, &rec, 24)");
    let seq = Seq::Ctx {
        ctx: Reg::R6,
        meta_seq: off(&l.meta_seq),
    };
    seq_write(a, seq, REC, RECORD_LEN);
    a.label("out").mov64_imm(Reg::R0, 0).exit();
}

/// The `chr` and `anon` tails shared by both programs: `r6` ctx, `r7`
/// task, `r8` file, `r9` inode; the descriptor number comes from
/// `ctx_fd` (`None`: a mapping, fd 0). Each ends at `emit`.
fn kinds(a: &mut Asm, l: &Layout, ctx_fd: Option<&Field>, chr: i32, anon: i32) {
    let fd = |a: &mut Asm| {
        match ctx_fd {
            Some(f) => a.load(size(f), Reg::R4, Reg::R6, off(f)),
            None => a.mov64_imm(Reg::R4, 0),
        };
    };
    a.label("chr");
    fd(a);
    a.mov64_imm(Reg::R2, chr)
        .load(size(&l.i_rdev), Reg::R3, Reg::R9, off(&l.i_rdev))
        .ja("emit");
    a.label("anon");
    fd(a);
    a.mov64_imm(Reg::R2, anon)
        .load(size(&l.i_ino), Reg::R3, Reg::R9, off(&l.i_ino))
        .ja("emit");
}

/// The `task_file` program: a record for each character device, each
/// anonymous inode and (with `sockets`) each socket in a descriptor table.
/// (The fence pins [`crate::iter::fdtable`]'s program instead, which filters in
/// the kernel and does not pay `task_file`'s cost per descriptor.)
///
/// # Errors
/// [`AsmError`] (a bug here).
pub fn file_program(l: &Layout, sockets: bool) -> Result<Program, AsmError> {
    let mut a = Asm::new();
    a.comment("task_file: ctx = { meta, task, fd, file }")
        .mov64_reg(Reg::R6, Reg::R1)
        .load(Size::DW, Reg::R7, Reg::R6, off(&l.ctx_file_task))
        .comment("task and file are NULL in the call that ends the walk")
        .jmp_imm(JmpOp::Eq, Reg::R7, 0, "out")
        .load(Size::DW, Reg::R8, Reg::R6, off(&l.ctx_file_file))
        .jmp_imm(JmpOp::Eq, Reg::R8, 0, "out")
        .load(Size::DW, Reg::R9, Reg::R8, off(&l.f_inode))
        .jmp_imm(JmpOp::Eq, Reg::R9, 0, "out")
        .comment("mode = file->f_inode->i_mode & S_IFMT")
        .load(size(&l.i_mode), Reg::R2, Reg::R9, off(&l.i_mode))
        .alu64_imm(AluOp::And, Reg::R2, S_IFMT)
        .jmp_imm(JmpOp::Eq, Reg::R2, S_IFCHR, "chr");
    if sockets {
        a.jmp_imm(JmpOp::Eq, Reg::R2, S_IFSOCK, "sock");
    }
    a.comment("anonymous inode: file->f_inode->i_sb->s_magic == ANON_INODE_FS_MAGIC")
        .load(Size::DW, Reg::R3, Reg::R9, off(&l.i_sb))
        .jmp_imm(JmpOp::Eq, Reg::R3, 0, "out")
        .load(size(&l.s_magic), Reg::R3, Reg::R3, off(&l.s_magic))
        .jmp_imm(JmpOp::Ne, Reg::R3, ANON_INODE_FS_MAGIC as i32, "out")
        .ja("anon");
    if sockets {
        a.label("sock")
            .load(size(&l.ctx_file_fd), Reg::R4, Reg::R6, off(&l.ctx_file_fd))
            .mov64_imm(Reg::R2, KIND_SOCK)
            .load(size(&l.i_ino), Reg::R3, Reg::R9, off(&l.i_ino))
            .ja("emit");
    }
    kinds(&mut a, l, Some(&l.ctx_file_fd), KIND_CHAR, KIND_ANON);
    emit(&mut a, l);
    a.assemble()
}

/// The `task_vma` program: a record for each mapping of a character device
/// (`vma->vm_file->f_inode`) and of an anonymous inode (an io_uring's
/// rings), fd 0.
///
/// # Errors
/// [`AsmError`] (a bug here).
pub fn vma_program(l: &Layout) -> Result<Program, AsmError> {
    let mut a = Asm::new();
    a.comment("task_vma: ctx = { meta, task, vma }")
        .mov64_reg(Reg::R6, Reg::R1)
        .load(Size::DW, Reg::R7, Reg::R6, off(&l.ctx_vma_task))
        .jmp_imm(JmpOp::Eq, Reg::R7, 0, "out")
        .load(Size::DW, Reg::R8, Reg::R6, off(&l.ctx_vma_vma))
        .jmp_imm(JmpOp::Eq, Reg::R8, 0, "out")
        .comment("file = vma->vm_file (anonymous memory has none); inode = file->f_inode")
        .load(Size::DW, Reg::R8, Reg::R8, off(&l.vm_file))
        .jmp_imm(JmpOp::Eq, Reg::R8, 0, "out")
        .load(Size::DW, Reg::R9, Reg::R8, off(&l.f_inode))
        .jmp_imm(JmpOp::Eq, Reg::R9, 0, "out")
        .load(size(&l.i_mode), Reg::R2, Reg::R9, off(&l.i_mode))
        .alu64_imm(AluOp::And, Reg::R2, S_IFMT)
        .jmp_imm(JmpOp::Eq, Reg::R2, S_IFCHR, "chr")
        .comment("an anonymous inode (an io_uring's rings): file->f_inode->i_sb->s_magic == ANON_INODE_FS_MAGIC")
        .load(Size::DW, Reg::R3, Reg::R9, off(&l.i_sb))
        .jmp_imm(JmpOp::Eq, Reg::R3, 0, "out")
        .load(size(&l.s_magic), Reg::R3, Reg::R3, off(&l.s_magic))
        .jmp_imm(JmpOp::Ne, Reg::R3, ANON_INODE_FS_MAGIC as i32, "out")
        .ja("anon");
    kinds(&mut a, l, None, KIND_MAP, KIND_ANON_MAP);
    emit(&mut a, l);
    a.assemble()
}

/// The two iterators, loaded and linked; each [`Iterators::files`] or
/// [`Iterators::maps`] call is a fresh walk of every task.
#[derive(Debug)]
pub struct Iterators {
    files: Loaded,
    maps: Loaded,
}

impl Iterators {
    /// Loads both programs for `layout` (through the real verifier) and
    /// links them. `sockets`: also report sockets.
    ///
    /// # Errors
    /// [`IterError`]: no permission (CAP_BPF, CAP_PERFMON), no iterator
    /// support, a verifier refusal.
    pub fn load(layout: &Layout, sockets: bool) -> Result<Iterators, IterError> {
        Ok(Iterators {
            files: load(
                "task_file",
                &file_program(layout, sockets)?,
                layout.task_file,
            )?,
            maps: load("task_vma", &vma_program(layout)?, layout.task_vma)?,
        })
    }

    /// Every character device, anonymous inode (and socket, if loaded so)
    /// open in a descriptor table, in iteration order: by task id, then by
    /// descriptor.
    ///
    /// # Errors
    /// [`IterError`].
    pub fn files(&self) -> Result<Vec<Record>, IterError> {
        read_all(&self.files.link)
    }

    /// Every mapping of a character device, one record per vma.
    ///
    /// # Errors
    /// [`IterError`].
    pub fn maps(&self) -> Result<Vec<Record>, IterError> {
        read_all(&self.maps.link)
    }
}
