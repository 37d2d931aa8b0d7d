//! Every open file and every device mapping on the machine in one read:
//! two BPF iterator programs (`kernel/bpf/task_iter.c`), for the scans that
//! look for processes holding a device (`gpufence_node::holders::scan`).
//!
//! - `task_file` runs once per (task, descriptor). It skips threads that
//!   share their group leader's descriptor table (`task_seq_get_next` with
//!   `skip_if_dup_files`), so a process is its leader's table plus the
//!   tables of threads that `unshare(CLONE_FILES)`d, or, once the leader
//!   has exited (its `files` is NULL), each remaining thread's.
//! - `task_vma` (Linux 5.12) runs once per (task, vma), with the same
//!   skipping.
//!
//! Each program reads, through BTF-typed pointers, `file->f_inode->i_mode`
//! and `i_rdev` (character devices), `i_ino` (sockets, for the sweep) and
//! `i_sb->s_magic` (anonymous inodes: io_uring rings are among them), and
//! writes a fixed 24-byte [`Record`] with `bpf_seq_write` for those files
//! only. Member offsets come from the running kernel's BTF ([`Layout`]);
//! nothing is attached to any cgroup or hook: the link only names the
//! program, and the iterator is a global read.
//!
//! Task numbers are global (`task->tgid`, `task->pid`): callers must be in
//! the initial pid namespace ([`in_initial_pid_ns`]) to compare them with
//! `/proc`.

use std::io;
use std::os::fd::{AsFd, OwnedFd};

use crate::asm::{AluOp, Asm, AsmError, JmpOp, Program, Reg, Size};
use crate::btf::{Btf, BtfError, Field};
use crate::sys;

/// `ANON_INODE_FS_MAGIC` (`include/uapi/linux/magic.h`): the superblock of
/// anonymous inodes. io_uring's rings are made with
/// `anon_inode_create_getfile` on `anon_inode_mnt` (`io_uring/io_uring.c`,
/// `fs/anon_inodes.c`), so every ring is on it.
pub const ANON_INODE_FS_MAGIC: u64 = 0x0904_1934;
/// `S_IFMT` (`include/uapi/linux/stat.h`).
pub(crate) const S_IFMT: i32 = 0o170000;
/// `S_IFCHR`.
pub(crate) const S_IFCHR: i32 = 0o020000;
/// `S_IFSOCK`.
const S_IFSOCK: i32 = 0o140000;
/// `BPF_FUNC_seq_write` (`include/uapi/linux/bpf.h`):
/// `long bpf_seq_write(struct seq_file *m, const void *data, u32 len)`.
pub(crate) const FUNC_SEQ_WRITE: i32 = 127;
/// `PROC_PID_INIT_INO` (`include/linux/proc_ns.h`): the inode of the
/// initial pid namespace in `/proc/<pid>/ns/pid`.
const PROC_PID_INIT_INO: u64 = 0xEFFF_FFFC;
/// `MINORBITS` (`include/linux/kdev_t.h`): a kernel `dev_t` is
/// `major << 20 | minor`.
pub(crate) const MINORBITS: u32 = 20;

/// The size of one [`Record`] as the programs write it.
pub const RECORD_LEN: usize = 24;

/// What a record describes. Values are the `kind` word of the record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Object {
    /// A character device open in a descriptor table: `(major, minor)`.
    CharFd(u32, u32),
    /// A socket open in a descriptor table: its inode number (what
    /// `stat(/proc/<pid>/fd/N).st_ino` and `socket:[N]` say).
    Socket(u64),
    /// A file on the anonymous-inode filesystem (eventfd, epoll, io_uring,
    /// ...): its inode number.
    AnonInode(u64),
    /// A mapping of a character device: `(major, minor)`.
    CharMap(u32, u32),
    /// A mapping of a file on the anonymous-inode filesystem (an io_uring's
    /// rings, which keep the ring alive without a descriptor): its inode.
    AnonMap(u64),
    /// A ring a task registered (`IORING_REGISTER_RING_FDS`): the inode of
    /// its file, so that its mappings are known as read. `fd` is its slot.
    RingSeen(u64),
    /// A character device registered as a fixed file of an io_uring whose
    /// own descriptor the task registered (`IORING_REGISTER_RING_FDS`):
    /// `(major, minor)`; the record's `fd` is the ring's registered slot.
    RingFile(u32, u32),
    /// A registered ring that was not read whole: more than
    /// [`RING_RECORDS`] character-device records, or more fixed files than
    /// `bpf_loop` walks; the value is its number of fixed files. The
    /// record's `fd` is the ring's registered slot. What else the ring
    /// holds is unknown.
    RingTruncated(u64),
    /// A descriptor table the fd-table program did not read whole (more
    /// than [`crate::fdtable::FD_RECORDS`] records, more slots than
    /// `bpf_loop` walks): the value is its `max_fds`, the record's `fd`
    /// -1. What it holds is unknown: its process is read in `/proc`.
    TableUnread(u64),
}

pub(crate) const KIND_CHAR: i32 = 1;
const KIND_SOCK: i32 = 2;
pub(crate) const KIND_ANON: i32 = 3;
pub(crate) const KIND_MAP: i32 = 4;
const KIND_RING: i32 = 5;
const KIND_RING_TRUNC: i32 = 6;
pub(crate) const KIND_ANON_MAP: i32 = 7;
const KIND_RING_SEEN: i32 = 8;
pub(crate) const KIND_TABLE_UNREAD: i32 = 9;

/// How many character-device records the ring iterator writes for one
/// registered ring (a run of one device is one record); a ring with more
/// says so ([`Object::RingTruncated`]). What one program run writes must
/// fit the iterator's buffer (`bpf_seq_read`: 8 pages, else `E2BIG`,
/// `kernel/bpf/bpf_iter.c`): 16 rings of 66 records of 24 bytes do.
pub const RING_RECORDS: i32 = 64;
/// `BPF_FUNC_loop` (`include/uapi/linux/bpf.h`, 5.17+):
/// `long bpf_loop(u32 nr_loops, void *callback_fn, void *callback_ctx, u64 flags)`,
/// at most `BPF_MAX_LOOPS` (1 << 23) calls.
pub(crate) const FUNC_LOOP: i32 = 181;
/// `BPF_MAX_LOOPS` (`kernel/bpf/bpf_iter.c`).
pub(crate) const MAX_LOOPS: i32 = 1 << 23;
/// `IO_RINGFD_REG_MAX` (`include/linux/io_uring_types.h`): the registered
/// ring slots of a task.
const RING_FDS: usize = 16;
/// `BPF_FUNC_probe_read_kernel` (`include/uapi/linux/bpf.h`).
pub(crate) const FUNC_PROBE_READ_KERNEL: i32 = 113;
/// Flag bits kept in the low bits of a fixed file's `file_ptr`
/// (`FFS_NOWAIT`, `FFS_ISREG`, and in 5.18-6.6 `FFS_SCM`:
/// `io_uring/filetable.h`); a `struct file` is at least 8-byte aligned.
const FFS_FLAGS: i32 = 7;

/// One object the iterators report.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Record {
    /// `task->tgid`: the process.
    pub tgid: i32,
    /// `task->pid`: the thread whose table (or, for mappings, whose walk)
    /// showed it; equal to `tgid` for the leader.
    pub tid: i32,
    /// The descriptor number (0 for mappings).
    pub fd: i32,
    /// What it is.
    pub object: Object,
}

impl Record {
    /// Decodes one record: `{ u32 tgid; u32 tid; u32 fd; u32 kind; u64 value; }`
    /// in native byte order, as [`file_program`] and [`vma_program`] write it.
    pub fn decode(b: &[u8; RECORD_LEN]) -> Option<Record> {
        let w = |i: usize| i32::from_ne_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let value = u64::from_ne_bytes([b[16], b[17], b[18], b[19], b[20], b[21], b[22], b[23]]);
        let dev = || {
            (
                (value as u32) >> MINORBITS,
                (value as u32) & ((1 << MINORBITS) - 1),
            )
        };
        let object = match w(12) {
            KIND_CHAR => {
                let (ma, mi) = dev();
                Object::CharFd(ma, mi)
            }
            KIND_SOCK => Object::Socket(value),
            KIND_ANON => Object::AnonInode(value),
            KIND_MAP => {
                let (ma, mi) = dev();
                Object::CharMap(ma, mi)
            }
            KIND_RING => {
                let (ma, mi) = dev();
                Object::RingFile(ma, mi)
            }
            KIND_RING_TRUNC => Object::RingTruncated(value),
            KIND_ANON_MAP => Object::AnonMap(value),
            KIND_RING_SEEN => Object::RingSeen(value),
            KIND_TABLE_UNREAD => Object::TableUnread(value),
            _ => return None,
        };
        Some(Record {
            tgid: w(0),
            tid: w(4),
            fd: w(8),
            object,
        })
    }
}

/// Where the programs find what they read, from the running kernel's BTF.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// BTF id of `bpf_iter_task_file` (the `attach_btf_id`).
    pub task_file: u32,
    /// BTF id of `bpf_iter_task_vma`.
    pub task_vma: u32,
    ctx_file_task: Field,
    ctx_file_fd: Field,
    ctx_file_file: Field,
    ctx_vma_task: Field,
    ctx_vma_vma: Field,
    meta_seq: Field,
    tgid: Field,
    pid: Field,
    f_inode: Field,
    i_mode: Field,
    i_rdev: Field,
    i_ino: Field,
    i_sb: Field,
    s_magic: Field,
    vm_file: Field,
}

pub(crate) fn sized(btf: &Btf, s: &str, m: &str, size: u32, ptr: bool) -> Result<Field, BtfError> {
    let f = btf.field(s, m)?;
    if f.size != size || f.is_ptr != ptr {
        return Err(BtfError::Unexpected {
            name: format!("{s}.{m}"),
            why: format!(
                "{} bytes{}, expected {size}{}",
                f.size,
                if f.is_ptr { " (pointer)" } else { "" },
                if ptr { " (pointer)" } else { "" }
            ),
        });
    }
    if f.offset > i16::MAX as u32 {
        return Err(BtfError::Unexpected {
            name: format!("{s}.{m}"),
            why: format!("offset {} past a load's reach", f.offset),
        });
    }
    Ok(f)
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

    /// The byte offset of the ctx's `meta` (first member of both contexts).
    const CTX_META: i16 = 0;
}

pub(crate) fn off(f: &Field) -> i16 {
    // sized() checked the range.
    f.offset as i16
}

pub(crate) fn size(f: &Field) -> Size {
    match f.size {
        1 => Size::B,
        2 => Size::H,
        4 => Size::W,
        _ => Size::DW,
    }
}

/// The common tail: the record at `fp-24` from task `r7` (tgid, pid), fd in
/// `r4`, kind in `r2`, value in `r3`, written with `bpf_seq_write(meta->seq)`
/// from ctx `r6`.
fn emit(a: &mut Asm, l: &Layout) {
    a.label("emit")
        .comment("struct { u32 tgid, tid, fd, kind; u64 value; } rec (fp-24)")
        .store(Size::W, Reg::R10, -12, Reg::R2)
        .store(Size::DW, Reg::R10, -8, Reg::R3)
        .store(Size::W, Reg::R10, -16, Reg::R4)
        .load(size(&l.tgid), Reg::R2, Reg::R7, off(&l.tgid))
        .store(Size::W, Reg::R10, -24, Reg::R2)
        .load(size(&l.pid), Reg::R2, Reg::R7, off(&l.pid))
        .store(Size::W, Reg::R10, -20, Reg::R2)
        .comment("bpf_seq_write(ctx->meta->seq, &rec, 24)")
        .load(Size::DW, Reg::R1, Reg::R6, Layout::CTX_META)
        .load(Size::DW, Reg::R1, Reg::R1, off(&l.meta_seq))
        .mov64_reg(Reg::R2, Reg::R10)
        .alu64_imm(AluOp::Add, Reg::R2, -(RECORD_LEN as i32))
        .mov64_imm(Reg::R3, RECORD_LEN as i32)
        .call_id(FUNC_SEQ_WRITE, "seq_write")
        .label("out")
        .mov64_imm(Reg::R0, 0)
        .exit();
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
/// (The fence pins [`crate::fdtable`]'s program instead, which filters in
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

/// Where a ring's fixed files are (`struct io_ring_ctx`'s `file_table`,
/// `io_uring/filetable.h`), as the running kernel lays them out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileTable {
    /// 6.13+: `file_table.data` is a `struct io_rsrc_data { unsigned nr;
    /// struct io_rsrc_node **nodes; }`; each node's `file_ptr`.
    Nodes {
        /// Offset of `nr` in the ring context.
        nr: i32,
        /// Offset of `nodes` in the ring context.
        nodes: i32,
        /// Offset of `file_ptr` in `struct io_rsrc_node`.
        file_ptr: i32,
    },
    /// Before 6.13: `file_table.files` is an array of `struct
    /// io_fixed_file { unsigned long file_ptr; }`, `nr_user_files` its
    /// length.
    Files {
        /// Offset of `nr_user_files` in the ring context.
        nr: i32,
        /// Offset of `file_table.files` in the ring context.
        files: i32,
    },
}

/// What the ring iterator reads, from the running kernel's BTF: a `task`
/// iterator that follows each task's `io_uring->registered_rings[]` (the
/// rings registered with `IORING_REGISTER_RING_FDS`, which may be in no
/// descriptor table) to each ring's fixed files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RingLayout {
    /// BTF id of `bpf_iter_task`.
    pub task: u32,
    ctx_task: Field,
    meta_seq: Field,
    tgid: Field,
    pid: Field,
    io_uring: Field,
    rings: Field,
    private_data: Field,
    file_inode: Field,
    i_ino: Field,
    f_inode: i32,
    i_mode: i32,
    i_rdev: i32,
    table: FileTable,
}

impl RingLayout {
    /// Reads the layout from parsed BTF.
    ///
    /// # Errors
    /// [`BtfError`] when io_uring's types are missing (a kernel without
    /// io_uring) or of another shape.
    pub fn from_btf(btf: &Btf) -> Result<RingLayout, BtfError> {
        let ctx_off = |path: &[(&str, &str)]| -> Result<i32, BtfError> {
            let mut o = 0u32;
            for (st, m) in path {
                o += btf.field(st, m)?.offset;
            }
            i32::try_from(o).map_err(|_| BtfError::Unexpected {
                name: format!("{path:?}"),
                why: "offset too large".into(),
            })
        };
        let table = match btf.field("io_file_table", "data") {
            Ok(_) => FileTable::Nodes {
                nr: ctx_off(&[
                    ("io_ring_ctx", "file_table"),
                    ("io_file_table", "data"),
                    ("io_rsrc_data", "nr"),
                ])?,
                nodes: ctx_off(&[
                    ("io_ring_ctx", "file_table"),
                    ("io_file_table", "data"),
                    ("io_rsrc_data", "nodes"),
                ])?,
                file_ptr: ctx_off(&[("io_rsrc_node", "file_ptr")])?,
            },
            Err(_) => FileTable::Files {
                nr: ctx_off(&[("io_ring_ctx", "nr_user_files")])?,
                files: ctx_off(&[("io_ring_ctx", "file_table"), ("io_file_table", "files")])?,
            },
        };
        let rings = btf.field("io_uring_task", "registered_rings")?;
        if rings.size != 8 * RING_FDS as u32 || rings.offset + rings.size > i16::MAX as u32 {
            return Err(BtfError::Unexpected {
                name: "io_uring_task.registered_rings".into(),
                why: format!("{} bytes at {}", rings.size, rings.offset),
            });
        }
        Ok(RingLayout {
            task: btf.func_id("bpf_iter_task")?,
            ctx_task: sized(btf, "bpf_iter__task", "task", 8, true)?,
            meta_seq: sized(btf, "bpf_iter_meta", "seq", 8, true)?,
            tgid: sized(btf, "task_struct", "tgid", 4, false)?,
            pid: sized(btf, "task_struct", "pid", 4, false)?,
            io_uring: sized(btf, "task_struct", "io_uring", 8, true)?,
            rings,
            private_data: sized(btf, "file", "private_data", 8, true)?,
            file_inode: sized(btf, "file", "f_inode", 8, true)?,
            i_ino: sized(btf, "inode", "i_ino", 8, false)?,
            f_inode: ctx_off(&[("file", "f_inode")])?,
            i_mode: ctx_off(&[("inode", "i_mode")])?,
            i_rdev: ctx_off(&[("inode", "i_rdev")])?,
            table,
        })
    }
}

// The ring program's stack (main frame): the record at fp-24 (as `emit`),
// a scratch word, the ring's count of fixed files, then the state the
// callback reads and fills:
// { table; seq; tgid_tid; slot; last; records; more; } (u64 each).
const RING_TMP: i16 = -32;
const RING_NR: i16 = -40;
const STATE: i16 = -96;
const ST_TABLE: i16 = 0;
const ST_SEQ: i16 = 8;
const ST_TASK: i16 = 16;
const ST_SLOT: i16 = 24;
const ST_LAST: i16 = 32;
const ST_RECORDS: i16 = 40;
const ST_MORE: i16 = 48;
// The callback's own frame: the record at fp-24, a scratch word, the
// file's inode.
const CB_TMP: i16 = -32;
const CB_INODE: i16 = -40;

/// `r0 = bpf_probe_read_kernel(fp+tmp, bytes, r3)`; on failure goto
/// `fail`; else `dst = *(size *)(fp+tmp)`.
pub(crate) fn probe_read(a: &mut Asm, tmp: i16, size: Size, bytes: i32, dst: Reg, fail: &str) {
    a.store_imm(Size::DW, Reg::R10, tmp, 0)
        .mov64_reg(Reg::R1, Reg::R10)
        .alu64_imm(AluOp::Add, Reg::R1, tmp as i32)
        .mov64_imm(Reg::R2, bytes)
        .call_id(FUNC_PROBE_READ_KERNEL, "probe_read_kernel")
        .jmp_imm(JmpOp::Ne, Reg::R0, 0, fail)
        .load(size, dst, Reg::R10, tmp);
}

/// `*(u64 *)(fp + slot) = 0`, as a value the verifier does not know (read
/// back with `bpf_probe_read_kernel` from the scratch word at `fp + tmp`):
/// a counter a loop compares and adds to then stays imprecise, and the
/// loop is verified in a few passes, not once per value.
pub(crate) fn zero_unknown(a: &mut Asm, tmp: i16, slot: i16, fail: &str) {
    a.store_imm(Size::DW, Reg::R10, tmp, 0)
        .mov64_reg(Reg::R3, Reg::R10)
        .alu64_imm(AluOp::Add, Reg::R3, tmp as i32);
    probe_read(a, tmp, Size::DW, 8, Reg::R1, fail);
    a.store(Size::DW, Reg::R10, slot, Reg::R1);
}

/// In the ring program's main frame: writes the record `{ tgid, tid, slot,
/// kind, r3 }` of task `r7` with `bpf_seq_write(state.seq)`, and goes on.
fn emit_ring_record(a: &mut Asm, l: &RingLayout, kind: i32, slot: usize) {
    a.store(Size::DW, Reg::R10, -8, Reg::R3)
        .store_imm(Size::W, Reg::R10, -12, kind)
        .store_imm(Size::W, Reg::R10, -16, slot as i32)
        .load(size(&l.tgid), Reg::R2, Reg::R7, off(&l.tgid))
        .store(Size::W, Reg::R10, -24, Reg::R2)
        .load(size(&l.pid), Reg::R2, Reg::R7, off(&l.pid))
        .store(Size::W, Reg::R10, -20, Reg::R2)
        .load(Size::DW, Reg::R1, Reg::R10, STATE + ST_SEQ)
        .mov64_reg(Reg::R2, Reg::R10)
        .alu64_imm(AluOp::Add, Reg::R2, -(RECORD_LEN as i32))
        .mov64_imm(Reg::R3, RECORD_LEN as i32)
        .call_id(FUNC_SEQ_WRITE, "seq_write");
}

/// The ring program (`task` iterator): for each task with an io_uring
/// context, each of its 16 registered ring slots that holds a ring
/// (`io_uring->registered_rings[]`, which may be in no descriptor table),
/// every fixed file of that ring, walked with `bpf_loop` (a callback
/// verified once, whatever the ring's size): a record per run of one
/// character device, up to [`RING_RECORDS`], and an
/// [`Object::RingTruncated`] record for a ring not read whole. Ring
/// contexts and fixed files are reached through `bpf_probe_read_kernel`
/// (`file->private_data` is a `void *`); a read that faults skips the
/// file.
///
/// # Errors
/// [`AsmError`] (a bug here).
pub fn ring_program(l: &RingLayout) -> Result<Program, AsmError> {
    let mut a = Asm::new();
    ring_task(&mut a, l);
    for i in 0..RING_FDS {
        ring_slot(&mut a, l, i);
    }
    a.label(&format!("ring_{RING_FDS}"))
        .label("out")
        .mov64_imm(Reg::R0, 0)
        .exit();
    read_file(&mut a, l);
    a.assemble()
}

/// The task (`r7`) and its io_uring context (`r8`), else out; the loop
/// state's `seq` and `tgid | tid << 32`.
fn ring_task(a: &mut Asm, l: &RingLayout) {
    a.comment("task: ctx = { meta, task }")
        .mov64_reg(Reg::R6, Reg::R1)
        .load(Size::DW, Reg::R7, Reg::R6, off(&l.ctx_task))
        .jmp_imm(JmpOp::Eq, Reg::R7, 0, "out")
        .comment("r8 = task->io_uring (NULL: the task never used io_uring)")
        .load(Size::DW, Reg::R8, Reg::R7, off(&l.io_uring))
        .jmp_imm(JmpOp::Eq, Reg::R8, 0, "out")
        .comment("state.seq = ctx->meta->seq; state.task = tgid | tid << 32")
        .load(Size::DW, Reg::R1, Reg::R6, Layout::CTX_META)
        .load(Size::DW, Reg::R1, Reg::R1, off(&l.meta_seq))
        .store(Size::DW, Reg::R10, STATE + ST_SEQ, Reg::R1)
        .load(size(&l.pid), Reg::R1, Reg::R7, off(&l.pid))
        .alu64_imm(AluOp::Lsh, Reg::R1, 32)
        .load(size(&l.tgid), Reg::R2, Reg::R7, off(&l.tgid))
        .alu64_reg(AluOp::Or, Reg::R1, Reg::R2)
        .store(Size::DW, Reg::R10, STATE + ST_TASK, Reg::R1);
}

/// Registered ring slot `i` of the task: a [`Object::RingSeen`] record
/// for the ring, then its fixed files walked with `bpf_loop` of
/// `read_file`; a ring whose table cannot be read, or not read whole, gets
/// an [`Object::RingTruncated`] record.
fn ring_slot(a: &mut Asm, l: &RingLayout, i: usize) {
    let (nr_off, base_off) = match l.table {
        FileTable::Nodes { nr, nodes, .. } => (nr, nodes),
        FileTable::Files { nr, files } => (nr, files),
    };
    let next_ring = format!("ring_{}", i + 1);
    let truncated = format!("truncated_{i}");
    a.label(&format!("ring_{i}"))
        .comment(&format!(
            "file = io_uring->registered_rings[{i}]; if (!file) next ring; ctx = file->private_data"
        ))
        .load(Size::DW, Reg::R1, Reg::R8, off(&l.rings) + (8 * i) as i16)
        .jmp_imm(JmpOp::Eq, Reg::R1, 0, &next_ring)
        .comment("rec = { tgid, tid, slot, RING_SEEN, file->f_inode->i_ino }")
        .load(Size::DW, Reg::R3, Reg::R1, off(&l.file_inode))
        .jmp_imm(JmpOp::Eq, Reg::R3, 0, &format!("seen_{i}"))
        .load(Size::DW, Reg::R3, Reg::R3, off(&l.i_ino));
    emit_ring_record(a, l, KIND_RING_SEEN, i);
    a.label(&format!("seen_{i}"))
        .load(Size::DW, Reg::R1, Reg::R8, off(&l.rings) + (8 * i) as i16)
        .jmp_imm(JmpOp::Eq, Reg::R1, 0, &next_ring)
        .load(Size::DW, Reg::R9, Reg::R1, off(&l.private_data))
        .jmp_imm(JmpOp::Eq, Reg::R9, 0, &next_ring)
        .comment(
            "nr = the ring's count of fixed files; state.table = their table (unreadable: say so)",
        )
        .store_imm(Size::DW, Reg::R10, RING_NR, 0)
        .mov64_reg(Reg::R3, Reg::R9)
        .alu64_imm(AluOp::Add, Reg::R3, nr_off);
    probe_read(a, RING_TMP, Size::W, 4, Reg::R1, &truncated);
    a.store(Size::DW, Reg::R10, RING_NR, Reg::R1)
        .mov64_reg(Reg::R3, Reg::R9)
        .alu64_imm(AluOp::Add, Reg::R3, base_off);
    probe_read(a, RING_TMP, Size::DW, 8, Reg::R1, &truncated);
    a.jmp_imm(JmpOp::Eq, Reg::R1, 0, &next_ring)
        .store(Size::DW, Reg::R10, STATE + ST_TABLE, Reg::R1)
        .store_imm(Size::DW, Reg::R10, STATE + ST_SLOT, i as i32)
        .store_imm(Size::DW, Reg::R10, STATE + ST_LAST, 0);
    zero_unknown(a, RING_TMP, STATE + ST_RECORDS, &truncated);
    zero_unknown(a, RING_TMP, STATE + ST_MORE, &truncated);
    a.comment("bpf_loop(nr, read_file, &state, 0): past BPF_MAX_LOOPS it refuses")
        .load(Size::DW, Reg::R1, Reg::R10, RING_NR)
        .jmp_imm(JmpOp::Gt, Reg::R1, MAX_LOOPS, &truncated)
        .ld_func(Reg::R2, "read_file")
        .mov64_reg(Reg::R3, Reg::R10)
        .alu64_imm(AluOp::Add, Reg::R3, STATE as i32)
        .mov64_imm(Reg::R4, 0)
        .call_id(FUNC_LOOP, "loop")
        .load(Size::DW, Reg::R1, Reg::R10, STATE + ST_MORE)
        .jmp_imm(JmpOp::Eq, Reg::R1, 0, &next_ring)
        .label(&truncated)
        .load(Size::DW, Reg::R3, Reg::R10, RING_NR);
    emit_ring_record(a, l, KIND_RING_TRUNC, i);
}

/// The `bpf_loop` callback `read_file(j, st)`: fixed file `j` of the
/// ring (through its node on 6.13+), read with `bpf_probe_read_kernel`;
/// a character device is a record, unless it repeats the last one, up
/// to [`RING_RECORDS`] (then `more` and stop).
fn read_file(a: &mut Asm, l: &RingLayout) {
    // The callback: long read_file(u64 j, struct state *st).
    a.label("read_file")
        .comment("read_file(j, st): st->table[j] -> file; a character device: a record, unless it repeats the last")
        .mov64_reg(Reg::R6, Reg::R2)
        .load(Size::DW, Reg::R3, Reg::R6, ST_TABLE)
        .alu64_imm(AluOp::Lsh, Reg::R1, 3)
        .alu64_reg(AluOp::Add, Reg::R3, Reg::R1);
    if let FileTable::Nodes { file_ptr, .. } = l.table {
        a.comment("node = nodes[j]; r3 = &node->file_ptr");
        probe_read(a, CB_TMP, Size::DW, 8, Reg::R3, "cb_next");
        a.jmp_imm(JmpOp::Eq, Reg::R3, 0, "cb_next")
            .alu64_imm(AluOp::Add, Reg::R3, file_ptr);
    }
    a.comment("file = file_ptr & ~(FFS_NOWAIT|FFS_ISREG); inode = file->f_inode");
    probe_read(a, CB_TMP, Size::DW, 8, Reg::R3, "cb_next");
    a.alu64_imm(AluOp::And, Reg::R3, !FFS_FLAGS)
        .jmp_imm(JmpOp::Eq, Reg::R3, 0, "cb_next")
        .alu64_imm(AluOp::Add, Reg::R3, l.f_inode);
    probe_read(a, CB_TMP, Size::DW, 8, Reg::R3, "cb_next");
    a.jmp_imm(JmpOp::Eq, Reg::R3, 0, "cb_next")
        .store(Size::DW, Reg::R10, CB_INODE, Reg::R3)
        .alu64_imm(AluOp::Add, Reg::R3, l.i_mode);
    probe_read(a, CB_TMP, Size::H, 2, Reg::R2, "cb_next");
    a.alu64_imm(AluOp::And, Reg::R2, S_IFMT)
        .jmp_imm(JmpOp::Ne, Reg::R2, S_IFCHR, "cb_next")
        .load(Size::DW, Reg::R3, Reg::R10, CB_INODE)
        .alu64_imm(AluOp::Add, Reg::R3, l.i_rdev);
    probe_read(a, CB_TMP, Size::W, 4, Reg::R3, "cb_next");
    a.comment(
        "if (rdev == st->last) next; if (st->records >= RING_RECORDS) { st->more = 1; stop }",
    )
    .load(Size::DW, Reg::R4, Reg::R6, ST_LAST)
    .jmp_reg(JmpOp::Eq, Reg::R4, Reg::R3, "cb_next")
    .store(Size::DW, Reg::R6, ST_LAST, Reg::R3)
    .load(Size::DW, Reg::R4, Reg::R6, ST_RECORDS)
    .jmp_imm(JmpOp::Ge, Reg::R4, RING_RECORDS, "cb_full")
    .alu64_imm(AluOp::Add, Reg::R4, 1)
    .store(Size::DW, Reg::R6, ST_RECORDS, Reg::R4)
    .comment("rec = { tgid, tid, slot, RING, rdev }; bpf_seq_write(st->seq, &rec, 24)")
    .store(Size::DW, Reg::R10, -8, Reg::R3)
    .store_imm(Size::W, Reg::R10, -12, KIND_RING)
    .load(Size::DW, Reg::R1, Reg::R6, ST_SLOT)
    .store(Size::W, Reg::R10, -16, Reg::R1)
    .load(Size::DW, Reg::R1, Reg::R6, ST_TASK)
    .store(Size::DW, Reg::R10, -24, Reg::R1)
    .load(Size::DW, Reg::R1, Reg::R6, ST_SEQ)
    .mov64_reg(Reg::R2, Reg::R10)
    .alu64_imm(AluOp::Add, Reg::R2, -(RECORD_LEN as i32))
    .mov64_imm(Reg::R3, RECORD_LEN as i32)
    .call_id(FUNC_SEQ_WRITE, "seq_write")
    .label("cb_next")
    .mov64_imm(Reg::R0, 0)
    .exit()
    .label("cb_full")
    .store_imm(Size::DW, Reg::R6, ST_MORE, 1)
    .mov64_imm(Reg::R0, 1)
    .exit();
}

/// Why the iterators could not run.
#[derive(Debug, thiserror::Error)]
pub enum IterError {
    /// The kernel's BTF lacks something (or there is none).
    #[error(transparent)]
    Btf(#[from] BtfError),
    /// A program did not assemble (a bug).
    #[error(transparent)]
    Asm(#[from] AsmError),
    /// The verifier or the kernel refused a program.
    #[error("loading the {target} iterator: {errno}\n{log}")]
    Load {
        /// `task_file` or `task_vma`.
        target: &'static str,
        /// errno.
        errno: io::Error,
        /// The verifier's log.
        log: String,
    },
    /// A `bpf(2)` call or a read failed.
    #[error("{what}: {err}")]
    Sys {
        /// Which step.
        what: &'static str,
        /// errno.
        err: io::Error,
    },
    /// Output that is not a whole number of records, or an unknown kind.
    #[error("iterator output malformed: {0}")]
    Malformed(String),
}

/// One loaded iterator: its program (none when opened from a pin) and
/// link.
#[derive(Debug)]
pub(crate) struct Loaded {
    pub(crate) _prog: Option<OwnedFd>,
    pub(crate) link: OwnedFd,
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

fn load(target: &'static str, p: &Program, btf_id: u32) -> Result<Loaded, IterError> {
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
/// directory (with [`crate::fdtable::PIN_FDTABLE`]). The suffix is the
/// record format and filter: a gpufence whose programs write something
/// else uses new names, and never reads an old pin.
pub const PIN_RINGS: &str = "iter_task_rings_v1";
/// Every name an iterator pin has had, for removal.
pub const PINS: [&str; 2] = [crate::fdtable::PIN_FDTABLE, PIN_RINGS];

/// Pins `link` at `dir/name`, replacing what is there: pinned as
/// `name_new`, then renamed over `name` (bpffs renames like any
/// directory: `bpf_dir_iops`, `kernel/bpf/inode.c`), so a reader opens
/// the old link or the new one, never none. (bpffs refuses names with a
/// dot, `bpf_lookup` in `kernel/bpf/inode.c`: hence `_`.)
pub(crate) fn pin_link(link: &OwnedFd, dir: &std::path::Path, name: &str) -> Result<(), IterError> {
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

pub(crate) fn open_pin(dir: &std::path::Path, name: &str) -> Result<Loaded, IterError> {
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
pub(crate) fn read_raw(link: &OwnedFd) -> Result<Vec<u8>, IterError> {
    let file = sys::iter_create(link.as_fd()).map_err(|err| IterError::Sys {
        what: "BPF_ITER_CREATE",
        err,
    })?;
    let mut out = Vec::new();
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

/// The ring iterator ([`ring_program`]), loaded and linked; each
/// [`RingIterator::files`] call is a fresh walk of every task.
#[derive(Debug)]
pub struct RingIterator {
    it: Loaded,
}

/// The BTF of a program of two functions, `long <main>(void *ctx)` and
/// the static `bpf_loop` callback `long <callback>(long index, void *ctx)`
/// (`include/uapi/linux/btf.h`: header, types, strings). Type ids: 4 the
/// main function, 6 the callback.
fn funcs_btf(main: &str, callback: &str) -> Vec<u8> {
    const KIND_INT: u32 = 1;
    const KIND_PTR: u32 = 2;
    const KIND_FUNC: u32 = 12;
    const KIND_FUNC_PROTO: u32 = 13;
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
    out.extend(0xEB9Fu16.to_ne_bytes());
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
pub(crate) fn load_with_callback(
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
        .find(|(_, i)| i.regs >> 4 == crate::asm::PSEUDO_FUNC && i.code == 0x18)
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

impl RingIterator {
    /// Loads the ring program for `layout` through the real verifier and
    /// links it.
    ///
    /// # Errors
    /// [`IterError`]: no permission, no `task` iterator or `bpf_loop`
    /// (5.17+), a verifier refusal.
    pub fn load(layout: &RingLayout) -> Result<RingIterator, IterError> {
        Ok(RingIterator {
            it: load_with_callback(
                &ring_program(layout)?,
                "gpufence_ring",
                "task",
                layout.task,
                ("ring", "read_file"),
            )?,
        })
    }

    /// Pins the link in `dir` ([`PIN_RINGS`]), replacing an earlier pin.
    ///
    /// # Errors
    /// [`IterError::Sys`].
    pub fn pin(&self, dir: &std::path::Path) -> Result<(), IterError> {
        pin_link(&self.it.link, dir, PIN_RINGS)
    }

    /// Opens the link pinned in `dir`.
    ///
    /// # Errors
    /// [`IterError::Sys`] (`ENOENT`: not pinned).
    pub fn open_pinned(dir: &std::path::Path) -> Result<RingIterator, IterError> {
        Ok(RingIterator {
            it: open_pin(dir, PIN_RINGS)?,
        })
    }

    /// Every character device registered in a ring a task registered
    /// (`IORING_REGISTER_RING_FDS`), and every such ring with more fixed
    /// files than are read.
    ///
    /// # Errors
    /// [`IterError`].
    pub fn files(&self) -> Result<Vec<Record>, IterError> {
        read_all(&self.it.link)
    }
}

/// Whether this process is in the initial pid namespace, where
/// `task->tgid` is the number `/proc` shows. `false` when it cannot tell.
pub fn in_initial_pid_ns() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").is_ok_and(|m| m.ino() == PROC_PID_INIT_INO)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// FNV-1a over the encoded instructions: a stable fingerprint of a
    /// program's bytes, to check that a refactor emits the same program.
    pub(crate) fn insn_hash(p: &Program) -> (usize, u64) {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for i in &p.insns {
            let mut b = vec![i.code, i.regs];
            b.extend_from_slice(&i.off.to_le_bytes());
            b.extend_from_slice(&i.imm.to_le_bytes());
            for x in b {
                h ^= u64::from(x);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        }
        (p.insns.len(), h)
    }

    /// A field at `offset` of `size` bytes, for the synthetic layouts.
    pub(crate) fn field(offset: u32, size: u32, is_ptr: bool) -> Field {
        Field {
            offset,
            size,
            is_ptr,
        }
    }

    fn synthetic_layout() -> Layout {
        Layout {
            task_file: 101,
            task_vma: 102,
            ctx_file_task: field(8, 8, true),
            ctx_file_fd: field(16, 4, false),
            ctx_file_file: field(24, 8, true),
            ctx_vma_task: field(8, 8, true),
            ctx_vma_vma: field(16, 8, true),
            meta_seq: field(0, 8, true),
            tgid: field(1240, 4, false),
            pid: field(1236, 4, false),
            f_inode: field(32, 8, true),
            i_mode: field(0, 2, false),
            i_rdev: field(76, 4, false),
            i_ino: field(64, 8, false),
            i_sb: field(40, 8, true),
            s_magic: field(96, 8, false),
            vm_file: field(160, 8, true),
        }
    }

    fn synthetic_ring_layout(table: FileTable) -> RingLayout {
        RingLayout {
            task: 103,
            ctx_task: field(8, 8, true),
            meta_seq: field(0, 8, true),
            tgid: field(1240, 4, false),
            pid: field(1236, 4, false),
            io_uring: field(2000, 8, true),
            rings: field(24, 8, true),
            private_data: field(200, 8, true),
            file_inode: field(32, 8, true),
            i_ino: field(64, 8, false),
            f_inode: 32,
            i_mode: 0,
            i_rdev: 76,
            table,
        }
    }

    /// The task_file, task_vma and ring programs emit exactly the
    /// instructions they emitted when these fingerprints were recorded.
    #[test]
    fn programs_keep_their_bytes() {
        let l = synthetic_layout();
        let got = [
            insn_hash(&file_program(&l, false).unwrap()),
            insn_hash(&file_program(&l, true).unwrap()),
            insn_hash(&vma_program(&l).unwrap()),
            insn_hash(
                &ring_program(&synthetic_ring_layout(FileTable::Nodes {
                    nr: 300,
                    nodes: 308,
                    file_ptr: 16,
                }))
                .unwrap(),
            ),
            insn_hash(
                &ring_program(&synthetic_ring_layout(FileTable::Files {
                    nr: 300,
                    files: 308,
                }))
                .unwrap(),
            ),
        ];
        assert_eq!(got, RECORDED, "{got:?}");
    }
    const RECORDED: [(usize, u64); 5] = [
        (38, 9939681305795814215),
        (43, 4217678228567470338),
        (40, 155947109649395413),
        (1529, 3812654082418059763),
        (1520, 1997594485595387644),
    ];

    #[test]
    fn records_decode() {
        let mut b = [0u8; RECORD_LEN];
        b[0..4].copy_from_slice(&42i32.to_ne_bytes());
        b[4..8].copy_from_slice(&43i32.to_ne_bytes());
        b[8..12].copy_from_slice(&7i32.to_ne_bytes());
        b[12..16].copy_from_slice(&KIND_CHAR.to_ne_bytes());
        b[16..24].copy_from_slice(&((195u64 << 20) | 255).to_ne_bytes());
        assert_eq!(
            Record::decode(&b),
            Some(Record {
                tgid: 42,
                tid: 43,
                fd: 7,
                object: Object::CharFd(195, 255)
            })
        );
        b[12..16].copy_from_slice(&KIND_SOCK.to_ne_bytes());
        b[16..24].copy_from_slice(&12345u64.to_ne_bytes());
        assert_eq!(Record::decode(&b).unwrap().object, Object::Socket(12345));
        b[12..16].copy_from_slice(&KIND_TABLE_UNREAD.to_ne_bytes());
        assert_eq!(
            Record::decode(&b).unwrap().object,
            Object::TableUnread(12345)
        );
        b[12..16].copy_from_slice(&10i32.to_ne_bytes());
        assert_eq!(Record::decode(&b), None);
    }
}

#[cfg(test)]
mod live {
    use super::*;
    use std::os::fd::AsRawFd;

    /// The ring iterator sees /dev/null registered as a fixed file of an
    /// io_uring whose own descriptor was registered
    /// (`IORING_REGISTER_RING_FDS`) and closed: in no descriptor table.
    /// Skipped without root, BTF or io_uring.
    #[test]
    fn the_ring_iterator_sees_a_ring_in_no_descriptor_table() {
        if !nix::unistd::geteuid().is_root() || !in_initial_pid_ns() {
            eprintln!("SKIPPED: needs root in the initial pid namespace");
            return;
        }
        let Ok(btf) = Btf::vmlinux() else {
            eprintln!("SKIPPED: no BTF");
            return;
        };
        let layout = match RingLayout::from_btf(&btf) {
            Ok(l) => l,
            // A kernel with io_uring must have the layout read.
            Err(e) if btf.field("task_struct", "io_uring").is_ok() => {
                panic!("io_uring is in this kernel, yet its layout is not read: {e}")
            }
            Err(e) => {
                eprintln!("SKIPPED: {e}");
                return;
            }
        };
        let it = RingIterator::load(&layout).unwrap_or_else(|e| panic!("{e}"));
        // In a thread of its own: registered rings are per task, and the
        // ring stays registered until the thread exits.
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            let null = std::fs::File::open("/dev/null").unwrap();
            let mut params = [0u8; 120];
            let ring =
                // SAFETY: io_uring_setup(2) with a zeroed params struct of
                // its size (120 bytes) that outlives the call.
                unsafe { libc::syscall(libc::SYS_io_uring_setup, 4u32, params.as_mut_ptr()) };
            if ring < 0 {
                tx.send(None).unwrap();
                return;
            }
            let fds = [null.as_raw_fd()];
            // IORING_REGISTER_FILES = 2.
            // SAFETY: io_uring_register(2) of one descriptor.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_io_uring_register,
                    ring as i32,
                    2u32,
                    fds.as_ptr(),
                    1u32,
                )
            };
            assert_eq!(r, 0);
            // struct io_uring_rsrc_update { u32 offset; u32 resv; u64 data; }:
            // offset -1 takes any free slot; IORING_REGISTER_RING_FDS = 20.
            let mut upd = [0u64; 2];
            upd[0] = u32::MAX as u64;
            upd[1] = ring as u64;
            // SAFETY: io_uring_register(2) with one update struct.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_io_uring_register,
                    ring as i32,
                    20u32,
                    upd.as_mut_ptr(),
                    1u32,
                )
            };
            assert_eq!(r, 1, "{}", std::io::Error::last_os_error());
            // SAFETY: closes the ring's descriptor and /dev/null's: the
            // ring lives on in the task's registered slots only.
            unsafe { libc::close(ring as i32) };
            drop(null);
            tx.send(Some(nix::unistd::gettid().as_raw())).unwrap();
            let _ = done_rx.recv();
        });
        let Some(tid) = rx.recv().unwrap() else {
            eprintln!("SKIPPED: no io_uring here");
            return;
        };
        let me = std::process::id() as i32;
        let recs = it.files().unwrap();
        let _ = done_tx.send(());
        t.join().unwrap();
        assert!(
            recs.iter()
                .any(|r| r.tgid == me && r.tid == tid && r.object == Object::RingFile(1, 3)),
            "{:?}",
            recs.iter().filter(|r| r.tgid == me).collect::<Vec<_>>()
        );
    }

    /// Through the real verifier: both programs load, and a walk shows this
    /// process's /dev/null descriptor (1:3), a socket's inode and an eventfd
    /// (an anonymous inode). Skipped without root or BTF.
    #[test]
    fn iterators_see_this_process() {
        if !nix::unistd::geteuid().is_root() || !in_initial_pid_ns() {
            eprintln!("SKIPPED: needs root in the initial pid namespace");
            return;
        }
        let layout = match Layout::vmlinux() {
            Ok(l) => l,
            Err(e) => {
                eprintln!("SKIPPED: {e}");
                return;
            }
        };
        let it = Iterators::load(&layout, true).unwrap_or_else(|e| panic!("{e}"));
        let null = std::fs::File::open("/dev/null").unwrap();
        let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        // SAFETY: eventfd(2) returns a descriptor we then own.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        assert!(efd >= 0);
        use std::os::unix::fs::MetadataExt;
        let sock_ino = std::fs::metadata(format!("/proc/self/fd/{}", sock.as_raw_fd()))
            .unwrap()
            .ino();
        let me = std::process::id() as i32;
        let recs = it.files().unwrap();
        let mine: Vec<&Record> = recs.iter().filter(|r| r.tgid == me).collect();
        assert!(
            mine.iter()
                .any(|r| r.fd == null.as_raw_fd() && r.object == Object::CharFd(1, 3)),
            "{mine:?}"
        );
        assert!(mine
            .iter()
            .any(|r| r.fd == sock.as_raw_fd() && r.object == Object::Socket(sock_ino)));
        assert!(mine
            .iter()
            .any(|r| r.fd == efd && matches!(r.object, Object::AnonInode(_))));
        assert!(mine.iter().all(|r| r.tid == me), "threads share the table");
        let zero = std::fs::File::open("/dev/zero").unwrap();
        // SAFETY: a private read mapping of one page of /dev/zero, a
        // descriptor we hold (a character device whose private mappings
        // keep the device file as vm_file); nothing reads through it, and
        // it is unmapped below.
        let m = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                zero.as_raw_fd(),
                0,
            )
        };
        assert_ne!(m, libc::MAP_FAILED);
        let maps = it.maps().unwrap();
        assert!(
            maps.iter()
                .any(|r| r.tgid == me && r.object == Object::CharMap(1, 5)),
            "{:?}",
            maps.iter().filter(|r| r.tgid == me).collect::<Vec<_>>()
        );
        // SAFETY: unmaps and closes what this test made.
        unsafe {
            libc::munmap(m, 4096);
            libc::close(efd);
        }
    }
}
