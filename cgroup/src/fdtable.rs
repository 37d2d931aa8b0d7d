//! Every descriptor table and every mapping on the machine, filtered in
//! the kernel: one `task` iterator program (`kernel/bpf/task_iter.c`) that
//! walks each table's slots with `bpf_loop` and each group leader's
//! mappings with the open-coded vma iterator, and writes a record only for
//! what a scan for protected devices needs: character devices on a major
//! the fence protects, and io_uring rings. The fence install loads it and
//! pins it ([`PIN_FDTABLE`]); the Prolog's and the Epilog's scans read it.
//!
//! The `task_file` iterator ([`crate::iter::Iterators`]) costs about
//! 0.3 µs per descriptor on the project's 2-vCPU machine before the
//! program runs at all (`fget_task_next` takes the task lock, a reference
//! on each file and drops it again), so a node with a million open
//! descriptors paid about 330 ms per scan whatever the program did. Here
//! one program run reads one table: `task->files->fdt->fd[0..max_fds]`,
//! eight slots per `bpf_probe_read_kernel`, each file cast to a BTF
//! pointer with the kfunc `bpf_rdonly_cast` (6.2+; the verifier turns it
//! into a move) so that `file->f_inode->i_mode` is read with plain loads
//! (a load that faults reads 0: the slot is skipped). The program runs
//! under `rcu_read_lock`, as every non-sleepable iterator program does
//! (`bpf_iter_run_prog` in `kernel/bpf/bpf_iter.c`), and `struct file` is
//! `SLAB_TYPESAFE_BY_RCU`. Only a character device or an anonymous inode
//! (type bits 0: `alloc_anon_inode` in `fs/libfs.c` sets `S_IRUSR |
//! S_IWUSR` alone) reads further. Mappings come from
//! `bpf_iter_task_vma_new/_next/_destroy` (6.7+), which only try the
//! task's mmap lock: a task whose lock was busy is said not read whole.
//!
//! A thread whose table is its group leader's is skipped (the leader's
//! run reads it), as `task_file`'s `skip_if_dup_files` does; a thread
//! with a table of its own (`unshare(CLONE_FILES)`), or every thread once
//! the leader has exited, is read. Records are [`Record`]s of the same
//! kinds as `task_file`'s and `task_vma`'s ([`Object::CharFd`](crate::iter::Object::CharFd),
//! [`Object::AnonInode`](crate::iter::Object::AnonInode), [`Object::CharMap`](crate::iter::Object::CharMap), [`Object::AnonMap`](crate::iter::Object::AnonMap)); a
//! table or mapping walk not done whole says so ([`Object::TableUnread`](crate::iter::Object::TableUnread))
//! and its process is then read in `/proc` by the scan.

use std::os::fd::OwnedFd;
use std::path::Path;

use crate::asm::{AluOp, Asm, AsmError, Helper, JmpOp, Program, Reg, Size};
use crate::btf::{Btf, BtfError, Field};
use crate::iter::{
    self, off, probe_read, size, sized, zero_unknown, IterError, Loaded, Record,
    ANON_INODE_FS_MAGIC, FUNC_LOOP, FUNC_SEQ_WRITE, KIND_ANON, KIND_ANON_MAP, KIND_CHAR, KIND_MAP,
    KIND_TABLE_UNREAD, MAX_LOOPS, MINORBITS, RECORD_LEN, S_IFCHR, S_IFMT,
};

/// The pin name of the fd-table iterator's link in the fence's bpffs
/// directory (see [`crate::iter::PIN_RINGS`] for the suffix).
pub const PIN_FDTABLE: &str = "iter_fdtable_v1";

/// The most records one table's run writes; a table with more says so
/// ([`Object::TableUnread`](crate::iter::Object::TableUnread)). What one program run writes must fit the
/// iterator's buffer (8 pages, else `E2BIG`, `bpf_seq_read` in
/// `kernel/bpf/bpf_iter.c`): 1,000 records of 24 bytes and the closing
/// one do.
pub const FD_RECORDS: i32 = 1000;

/// Entries in the fence's `majors` array map: a major at or past it is
/// let through to user space (the kernel's character majors stop at 511,
/// `CHRDEV_MAJOR_MAX` in `fs/char_dev.c`).
const MAJORS_ENTRIES: i32 = 4096;

/// Where the program finds what it reads, from the running kernel's BTF.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FdTableLayout {
    /// BTF id of `bpf_iter_task` (the `attach_btf_id`).
    pub task: u32,
    /// BTF id of the kfunc `bpf_rdonly_cast` (6.2+, `kernel/bpf/helpers.c`).
    rdonly_cast: u32,
    /// BTF id of `struct file`.
    file: u32,
    /// BTF ids of the open-coded vma iterator's kfuncs (6.7+,
    /// `kernel/bpf/task_iter.c`): `bpf_iter_task_vma_new`, `_next`,
    /// `_destroy`.
    vma_new: u32,
    vma_next: u32,
    vma_destroy: u32,
    ctx_task: Field,
    meta_seq: Field,
    tgid: Field,
    pid: Field,
    files: Field,
    group_leader: Field,
    mm: Field,
    vm_file: Field,
    fdt: Field,
    max_fds: Field,
    fd: Field,
    f_inode: Field,
    i_mode: Field,
    i_rdev: Field,
    i_ino: Field,
    i_sb: Field,
    s_magic: Field,
    /// `file->f_path.dentry` and `dentry->d_name.name`: offsets of
    /// pointers inside a member struct.
    f_path_dentry: i16,
    d_name_name: i16,
}

impl FdTableLayout {
    /// Reads the layout from parsed BTF: `struct task_struct { files;
    /// group_leader; }`, `struct files_struct { fdt; }`, `struct fdtable
    /// { max_fds; fd; }` (`include/linux/fdtable.h`), the file, inode,
    /// dentry and super_block members the checks read, and the kfunc
    /// `bpf_rdonly_cast`.
    ///
    /// # Errors
    /// [`BtfError`] when a type or member is missing or of another width
    /// (a kernel before 6.2 has no `bpf_rdonly_cast`).
    pub fn from_btf(btf: &Btf) -> Result<FdTableLayout, BtfError> {
        let at = |outer: (&str, &str), inner: (&str, &str)| -> Result<i16, BtfError> {
            let o = btf.field(outer.0, outer.1)?.offset;
            let i = sized(btf, inner.0, inner.1, 8, true)?.offset;
            i16::try_from(o + i).map_err(|_| BtfError::Unexpected {
                name: format!("{}.{}.{}", outer.0, outer.1, inner.1),
                why: "offset past a load's reach".into(),
            })
        };
        Ok(FdTableLayout {
            task: btf.func_id("bpf_iter_task")?,
            rdonly_cast: btf.func_id("bpf_rdonly_cast")?,
            file: btf.struct_id("file")?,
            vma_new: btf.func_id("bpf_iter_task_vma_new")?,
            vma_next: btf.func_id("bpf_iter_task_vma_next")?,
            vma_destroy: btf.func_id("bpf_iter_task_vma_destroy")?,
            ctx_task: sized(btf, "bpf_iter__task", "task", 8, true)?,
            meta_seq: sized(btf, "bpf_iter_meta", "seq", 8, true)?,
            tgid: sized(btf, "task_struct", "tgid", 4, false)?,
            pid: sized(btf, "task_struct", "pid", 4, false)?,
            files: sized(btf, "task_struct", "files", 8, true)?,
            group_leader: sized(btf, "task_struct", "group_leader", 8, true)?,
            mm: sized(btf, "task_struct", "mm", 8, true)?,
            vm_file: sized(btf, "vm_area_struct", "vm_file", 8, true)?,
            fdt: sized(btf, "files_struct", "fdt", 8, true)?,
            max_fds: sized(btf, "fdtable", "max_fds", 4, false)?,
            fd: sized(btf, "fdtable", "fd", 8, true)?,
            f_inode: sized(btf, "file", "f_inode", 8, true)?,
            i_mode: sized(btf, "inode", "i_mode", 2, false)?,
            i_rdev: sized(btf, "inode", "i_rdev", 4, false)?,
            i_ino: sized(btf, "inode", "i_ino", 8, false)?,
            i_sb: sized(btf, "inode", "i_sb", 8, true)?,
            s_magic: sized(btf, "super_block", "s_magic", 8, false)?,
            f_path_dentry: at(("file", "f_path"), ("path", "dentry"))?,
            d_name_name: at(("dentry", "d_name"), ("qstr", "name"))?,
        })
    }
}

// The main frame: the record at fp-24, scratch at fp-32, the callback's
// state at fp-72..fp-33, the vma iterator at fp-80, the name read at
// fp-96..fp-86, the major looked up at fp-104.
const TMP: i16 = -32;
const STATE: i16 = -72;
const IT: i16 = -80;
const NAME: i16 = -96;
const KEY: i16 = -104;
const ST_TABLE: i16 = 0;
const ST_SEQ: i16 = 8;
const ST_TASK: i16 = 16;
const ST_RECORDS: i16 = 24;
const ST_MORE: i16 = 32;
// The callback's frame: its record at fp-24, scratch at fp-32, the major
// looked up at fp-40, the name read at fp-56..fp-46, the batch of slots
// at fp-120..fp-57.
const CB_TMP: i16 = -32;
const CB_KEY: i16 = -40;
const CB_NAME: i16 = -56;
const CB_BATCH: i16 = -120;
/// `ENOENT`: `bpf_iter_task_vma_new`'s answer for a task without memory.
const ENOENT: i32 = 2;

/// Slots read per callback: one `bpf_probe_read_kernel` of 64 bytes. A
/// table's `max_fds` is a multiple of `BITS_PER_LONG` (`alloc_fdtable`
/// in `fs/file.c` rounds it up), so a batch never reads past its array.
const SLOTS: i32 = 8;

/// In the main frame: writes `{ tgid, tid, fd, kind, r3 }` with
/// `bpf_seq_write(state.seq)` and goes on; `kind` is `r2` when `None`.
fn main_record(a: &mut Asm, kind: Option<i32>, fd: i32) {
    a.store(Size::DW, Reg::R10, -8, Reg::R3);
    match kind {
        Some(k) => a.store_imm(Size::W, Reg::R10, -12, k),
        None => a.store(Size::W, Reg::R10, -12, Reg::R2),
    };
    a.store_imm(Size::W, Reg::R10, -16, fd)
        .load(Size::DW, Reg::R1, Reg::R10, STATE + ST_TASK)
        .store(Size::DW, Reg::R10, -24, Reg::R1)
        .load(Size::DW, Reg::R1, Reg::R10, STATE + ST_SEQ)
        .mov64_reg(Reg::R2, Reg::R10)
        .alu64_imm(AluOp::Add, Reg::R2, -(RECORD_LEN as i32))
        .mov64_imm(Reg::R3, RECORD_LEN as i32)
        .call_id(FUNC_SEQ_WRITE, "seq_write");
}

/// With the name pointer in `r3`: reads 11 bytes of it into `fp+at` and
/// goes to `yes` when they are `[io_uring]\0` (or cannot be read), else
/// to `no`.
fn io_uring_name(a: &mut Asm, at: i16, yes: &str, no: &str) {
    probe_read(a, at, Size::W, 11, Reg::R1, yes);
    a.jmp_imm(JmpOp::Ne, Reg::R1, i32::from_le_bytes(*b"[io_"), no)
        .load(Size::W, Reg::R1, Reg::R10, at + 4)
        .jmp_imm(JmpOp::Ne, Reg::R1, i32::from_le_bytes(*b"urin"), no)
        .load(Size::H, Reg::R1, Reg::R10, at + 8)
        .jmp_imm(
            JmpOp::Ne,
            Reg::R1,
            i32::from(u16::from_le_bytes(*b"g]")),
            no,
        )
        .load(Size::B, Reg::R1, Reg::R10, at + 10)
        .jmp_imm(JmpOp::Ne, Reg::R1, 0, no)
        .ja(yes);
}

/// The fd-table program: for each task with a table of its own, every
/// slot of `files->fdt->fd`, walked with `bpf_loop`; a record for each
/// character device on a major `majors_fd` (the fence's `majors` map)
/// marks protected, and each anonymous inode named `[io_uring]` (the
/// dentry name `io_uring_get_file` gives a ring,
/// `anon_inode_create_getfile("[io_uring]", ...)` in
/// `io_uring/io_uring.c`); a name that cannot be read is let through.
///
/// # Errors
/// [`AsmError`] (a bug here).
pub fn fdtable_program(l: &FdTableLayout, majors_fd: i32) -> Result<Program, AsmError> {
    let mut a = Asm::new();
    task_state(&mut a, l);
    table_walk(&mut a, l);
    vma_walk(&mut a, l);
    vma_record(&mut a, l, majors_fd);
    read_slots(&mut a, l, majors_fd);
    a.assemble()
}

/// The task (`r7`) and its table (`r8`), else out; the loop state's
/// `seq`, `tgid | tid << 32`, and `records` and `more` as unknown zeros.
fn task_state(a: &mut Asm, l: &FdTableLayout) {
    a.comment("task: ctx = { meta, task }")
        .mov64_reg(Reg::R6, Reg::R1)
        .load(Size::DW, Reg::R7, Reg::R6, off(&l.ctx_task))
        .jmp_imm(JmpOp::Eq, Reg::R7, 0, "out")
        .comment("r8 = task->files (NULL: an exiting task or a kernel thread's)")
        .load(Size::DW, Reg::R8, Reg::R7, off(&l.files))
        .jmp_imm(JmpOp::Eq, Reg::R8, 0, "out")
        .comment("state = { -, seq, tgid | tid << 32, records 0, more 0 }")
        .load(Size::DW, Reg::R1, Reg::R6, 0)
        .load(Size::DW, Reg::R1, Reg::R1, off(&l.meta_seq))
        .store(Size::DW, Reg::R10, STATE + ST_SEQ, Reg::R1)
        .load(size(&l.pid), Reg::R1, Reg::R7, off(&l.pid))
        .alu64_imm(AluOp::Lsh, Reg::R1, 32)
        .load(size(&l.tgid), Reg::R2, Reg::R7, off(&l.tgid))
        .alu64_reg(AluOp::Or, Reg::R1, Reg::R2)
        .store(Size::DW, Reg::R10, STATE + ST_TASK, Reg::R1);
    zero_unknown(a, TMP, STATE + ST_RECORDS, "out");
    zero_unknown(a, TMP, STATE + ST_MORE, "out");
}

/// The descriptor table, read by the leader's run (or a thread's of its
/// own): `bpf_loop` of `read_slots` over its slots, 8 at a time; a table
/// past `BPF_MAX_LOOPS` or past [`FD_RECORDS`] is said not read whole.
fn table_walk(a: &mut Asm, l: &FdTableLayout) {
    a.comment("a thread sharing its leader's table: the leader's run reads it")
        .load(size(&l.pid), Reg::R1, Reg::R7, off(&l.pid))
        .load(size(&l.tgid), Reg::R2, Reg::R7, off(&l.tgid))
        .jmp_reg(JmpOp::Eq, Reg::R1, Reg::R2, "own")
        .load(Size::DW, Reg::R1, Reg::R7, off(&l.group_leader))
        .jmp_imm(JmpOp::Eq, Reg::R1, 0, "own")
        .load(Size::DW, Reg::R1, Reg::R1, off(&l.files))
        .jmp_reg(JmpOp::Eq, Reg::R1, Reg::R8, "vmas")
        .label("own")
        .comment("fdt = files->fdt; state.table = fdt->fd")
        .load(Size::DW, Reg::R9, Reg::R8, off(&l.fdt))
        .jmp_imm(JmpOp::Eq, Reg::R9, 0, "vmas")
        .load(Size::DW, Reg::R1, Reg::R9, off(&l.fd))
        .jmp_imm(JmpOp::Eq, Reg::R1, 0, "vmas")
        .store(Size::DW, Reg::R10, STATE + ST_TABLE, Reg::R1)
        .comment(
            "bpf_loop((fdt->max_fds + 7) / 8, read_slots, &state, 0): past BPF_MAX_LOOPS it refuses",
        )
        .load(size(&l.max_fds), Reg::R1, Reg::R9, off(&l.max_fds))
        .alu64_imm(AluOp::Add, Reg::R1, SLOTS - 1)
        .alu64_imm(AluOp::Rsh, Reg::R1, 3)
        .jmp_imm(JmpOp::Gt, Reg::R1, MAX_LOOPS, "unread")
        .ld_func(Reg::R2, "read_slots")
        .mov64_reg(Reg::R3, Reg::R10)
        .alu64_imm(AluOp::Add, Reg::R3, STATE as i32)
        .mov64_imm(Reg::R4, 0)
        .call_id(FUNC_LOOP, "loop")
        .load(Size::DW, Reg::R1, Reg::R10, STATE + ST_MORE)
        .jmp_imm(JmpOp::Eq, Reg::R1, 0, "vmas")
        .label("unread")
        .comment("rec = { tgid, tid, -1, TABLE_UNREAD, max_fds }")
        .load(size(&l.max_fds), Reg::R3, Reg::R9, off(&l.max_fds));
    main_record(a, Some(KIND_TABLE_UNREAD), -1);
}

/// The mappings, walked by the leader's run (or each thread's once the
/// leader's mm is gone) with the open-coded vma iterator: a mapped
/// character device goes to `vchr`, an anonymous inode named
/// `[io_uring]` (a ring's mapping) to `vanon`.
fn vma_walk(a: &mut Asm, l: &FdTableLayout) {
    a.label("vmas")
        .comment("mappings: the leader's run walks them (or each thread's once the leader's mm is gone)")
        .load(size(&l.pid), Reg::R1, Reg::R7, off(&l.pid))
        .load(size(&l.tgid), Reg::R2, Reg::R7, off(&l.tgid))
        .jmp_reg(JmpOp::Eq, Reg::R1, Reg::R2, "walk")
        .load(Size::DW, Reg::R1, Reg::R7, off(&l.group_leader))
        .jmp_imm(JmpOp::Eq, Reg::R1, 0, "walk")
        .load(Size::DW, Reg::R1, Reg::R1, off(&l.mm))
        .jmp_imm(JmpOp::Ne, Reg::R1, 0, "out")
        .label("walk")
        .comment("bpf_iter_task_vma_new(&it, task, 0): destroyed whatever it returns")
        .mov64_reg(Reg::R1, Reg::R10)
        .alu64_imm(AluOp::Add, Reg::R1, IT as i32)
        .mov64_reg(Reg::R2, Reg::R7)
        .mov64_imm(Reg::R3, 0)
        .call_kfunc(l.vma_new, "bpf_iter_task_vma_new")
        .comment("it could not start (the mmap lock was busy: it only tries; no memory): not read whole; no mm: nothing to read")
        .comment("(an int: its low 32 bits, as 32-bit arithmetic leaves them)")
        .alu32_imm(AluOp::Add, Reg::R0, 0)
        .jmp_imm(JmpOp::Eq, Reg::R0, 0, "vma")
        .alu32_imm(AluOp::Add, Reg::R0, ENOENT)
        .jmp_imm(JmpOp::Eq, Reg::R0, 0, "vdone")
        .ja("vfull")
        .label("vma")
        .comment("vma = bpf_iter_task_vma_next(&it); file = vma->vm_file; inode = file->f_inode")
        .mov64_reg(Reg::R1, Reg::R10)
        .alu64_imm(AluOp::Add, Reg::R1, IT as i32)
        .call_kfunc(l.vma_next, "bpf_iter_task_vma_next")
        .jmp_imm(JmpOp::Eq, Reg::R0, 0, "vdone")
        .load(Size::DW, Reg::R8, Reg::R0, off(&l.vm_file))
        .jmp_imm(JmpOp::Eq, Reg::R8, 0, "vma")
        .load(Size::DW, Reg::R9, Reg::R8, off(&l.f_inode))
        .jmp_imm(JmpOp::Eq, Reg::R9, 0, "vma")
        .load(size(&l.i_mode), Reg::R1, Reg::R9, off(&l.i_mode))
        .alu64_imm(AluOp::And, Reg::R1, S_IFMT)
        .jmp_imm(JmpOp::Eq, Reg::R1, S_IFCHR, "vchr")
        .jmp_imm(JmpOp::Ne, Reg::R1, 0, "vma")
        .comment("an io_uring's mapped rings: anonymous inode named [io_uring]")
        .load(Size::DW, Reg::R1, Reg::R9, off(&l.i_sb))
        .jmp_imm(JmpOp::Eq, Reg::R1, 0, "vma")
        .load(size(&l.s_magic), Reg::R1, Reg::R1, off(&l.s_magic))
        .jmp_imm(JmpOp::Ne, Reg::R1, ANON_INODE_FS_MAGIC as i32, "vma")
        .load(Size::DW, Reg::R1, Reg::R8, l.f_path_dentry)
        .jmp_imm(JmpOp::Eq, Reg::R1, 0, "vanon")
        .load(Size::DW, Reg::R3, Reg::R1, l.d_name_name)
        .jmp_imm(JmpOp::Eq, Reg::R3, 0, "vanon");
    io_uring_name(a, NAME, "vanon", "vma");
}

/// A mapping's record: an io_uring ring's inode number, or a character
/// device on a protected major; past [`FD_RECORDS`], or when the walk
/// could not start, not read whole; then the iterator destroyed.
fn vma_record(a: &mut Asm, l: &FdTableLayout, majors_fd: i32) {
    a.label("vanon")
        .load(size(&l.i_ino), Reg::R3, Reg::R9, off(&l.i_ino))
        .mov64_imm(Reg::R2, KIND_ANON_MAP)
        .ja("vemit")
        .label("vchr")
        .comment("majors[i_rdev >> MINORBITS] != 0, else nothing to say")
        .load(size(&l.i_rdev), Reg::R3, Reg::R9, off(&l.i_rdev))
        .store(Size::DW, Reg::R10, TMP, Reg::R3)
        .alu64_imm(AluOp::Rsh, Reg::R3, MINORBITS as i32)
        .jmp_imm(JmpOp::Ge, Reg::R3, MAJORS_ENTRIES, "vchr_emit")
        .store(Size::W, Reg::R10, KEY, Reg::R3)
        .ld_map_fd(Reg::R1, majors_fd, "majors")
        .mov64_reg(Reg::R2, Reg::R10)
        .alu64_imm(AluOp::Add, Reg::R2, KEY as i32)
        .call(Helper::MapLookupElem)
        .jmp_imm(JmpOp::Eq, Reg::R0, 0, "vma")
        .load(Size::W, Reg::R1, Reg::R0, 0)
        .jmp_imm(JmpOp::Eq, Reg::R1, 0, "vma")
        .label("vchr_emit")
        .load(Size::DW, Reg::R3, Reg::R10, TMP)
        .mov64_imm(Reg::R2, KIND_MAP)
        .label("vemit")
        .comment("if (records >= FD_RECORDS) not read whole; rec = { tgid, tid, 0, kind, value }")
        .load(Size::DW, Reg::R4, Reg::R10, STATE + ST_RECORDS)
        .jmp_imm(JmpOp::Ge, Reg::R4, FD_RECORDS, "vfull")
        .alu64_imm(AluOp::Add, Reg::R4, 1)
        .store(Size::DW, Reg::R10, STATE + ST_RECORDS, Reg::R4);
    main_record(a, None, 0);
    a.ja("vma")
        .label("vfull")
        .mov64_reg(Reg::R1, Reg::R10)
        .alu64_imm(AluOp::Add, Reg::R1, IT as i32)
        .call_kfunc(l.vma_destroy, "bpf_iter_task_vma_destroy")
        .mov64_imm(Reg::R3, 0);
    main_record(a, Some(KIND_TABLE_UNREAD), -1);
    a.ja("out")
        .label("vdone")
        .mov64_reg(Reg::R1, Reg::R10)
        .alu64_imm(AluOp::Add, Reg::R1, IT as i32)
        .call_kfunc(l.vma_destroy, "bpf_iter_task_vma_destroy")
        .label("out")
        .mov64_imm(Reg::R0, 0)
        .exit();
}

/// The `bpf_loop` callback `read_slots`: eight slots of the table read
/// at once, then one `slot` block each.
fn read_slots(a: &mut Asm, l: &FdTableLayout, majors_fd: i32) {
    // long read_slots(u64 j, struct state *st): slots 8j..8j+7, read in
    // one bpf_probe_read_kernel; each file is cast to a BTF pointer
    // (bpf_rdonly_cast, which the verifier turns into a move) so that its
    // members are read with plain loads (a fault reads 0). r6 = st,
    // r7 = file, r8 = inode, r9 = 8j.
    a.label("read_slots")
        .comment("batch = st->table[8j .. 8j+8]")
        .mov64_reg(Reg::R6, Reg::R2)
        .mov64_reg(Reg::R9, Reg::R1)
        .alu64_imm(AluOp::Lsh, Reg::R9, 3)
        .mov64_reg(Reg::R3, Reg::R9)
        .alu64_imm(AluOp::Lsh, Reg::R3, 3)
        .load(Size::DW, Reg::R1, Reg::R6, ST_TABLE)
        .alu64_reg(AluOp::Add, Reg::R3, Reg::R1);
    probe_read(a, CB_BATCH, Size::DW, 8 * SLOTS, Reg::R1, "next");
    for k in 0..SLOTS {
        slot(a, l, majors_fd, k);
    }
    a.label("next")
        .mov64_imm(Reg::R0, 0)
        .exit()
        .label("full")
        .store_imm(Size::DW, Reg::R6, ST_MORE, 1)
        .mov64_imm(Reg::R0, 1)
        .exit();
}

/// Slot `k` of the batch: a character device on a protected major, or an
/// anonymous inode named `[io_uring]`, is written as a record (up to
/// [`FD_RECORDS`], then `more` and stop).
fn slot(a: &mut Asm, l: &FdTableLayout, majors_fd: i32, k: i32) {
    let next = if k + 1 < SLOTS {
        format!("slot_{}", k + 1)
    } else {
        "next".to_string()
    };
    let (chr, chr_emit, anon, emit) = (
        format!("chr_{k}"),
        format!("chr_emit_{k}"),
        format!("anon_{k}"),
        format!("emit_{k}"),
    );
    a.label(&format!("slot_{k}"))
        .comment(&format!(
            "file = batch[{k}]; inode = file->f_inode; mode = inode->i_mode & S_IFMT"
        ))
        .load(Size::DW, Reg::R1, Reg::R10, CB_BATCH + 8 * k as i16)
        .jmp_imm(JmpOp::Eq, Reg::R1, 0, &next)
        .mov64_imm(Reg::R2, l.file as i32)
        .call_kfunc(l.rdonly_cast, "bpf_rdonly_cast")
        .mov64_reg(Reg::R7, Reg::R0)
        .load(Size::DW, Reg::R8, Reg::R7, off(&l.f_inode))
        .jmp_imm(JmpOp::Eq, Reg::R8, 0, &next)
        .load(size(&l.i_mode), Reg::R1, Reg::R8, off(&l.i_mode))
        .alu64_imm(AluOp::And, Reg::R1, S_IFMT)
        .jmp_imm(JmpOp::Eq, Reg::R1, S_IFCHR, &chr)
        .jmp_imm(JmpOp::Ne, Reg::R1, 0, &next)
        .comment("no type bits: an anonymous inode if inode->i_sb->s_magic == ANON_INODE_FS_MAGIC")
        .load(Size::DW, Reg::R1, Reg::R8, off(&l.i_sb))
        .jmp_imm(JmpOp::Eq, Reg::R1, 0, &next)
        .load(size(&l.s_magic), Reg::R1, Reg::R1, off(&l.s_magic))
        .jmp_imm(JmpOp::Ne, Reg::R1, ANON_INODE_FS_MAGIC as i32, &next)
        .comment("file->f_path.dentry->d_name.name == \"[io_uring]\" (unreadable: let through)")
        .load(Size::DW, Reg::R1, Reg::R7, l.f_path_dentry)
        .jmp_imm(JmpOp::Eq, Reg::R1, 0, &anon)
        .load(Size::DW, Reg::R3, Reg::R1, l.d_name_name)
        .jmp_imm(JmpOp::Eq, Reg::R3, 0, &anon);
    io_uring_name(a, CB_NAME, &anon, &next);
    a.label(&anon)
        .load(size(&l.i_ino), Reg::R3, Reg::R8, off(&l.i_ino))
        .mov64_imm(Reg::R2, KIND_ANON)
        .ja(&emit)
        .label(&chr)
        .comment("rdev = inode->i_rdev; majors[rdev >> MINORBITS] != 0, else nothing to say")
        .load(size(&l.i_rdev), Reg::R3, Reg::R8, off(&l.i_rdev))
        .store(Size::DW, Reg::R10, CB_TMP, Reg::R3)
        .alu64_imm(AluOp::Rsh, Reg::R3, MINORBITS as i32)
        .jmp_imm(JmpOp::Ge, Reg::R3, MAJORS_ENTRIES, &chr_emit)
        .store(Size::W, Reg::R10, CB_KEY, Reg::R3)
        .ld_map_fd(Reg::R1, majors_fd, "majors")
        .mov64_reg(Reg::R2, Reg::R10)
        .alu64_imm(AluOp::Add, Reg::R2, CB_KEY as i32)
        .call(Helper::MapLookupElem)
        .jmp_imm(JmpOp::Eq, Reg::R0, 0, &next)
        .load(Size::W, Reg::R1, Reg::R0, 0)
        .jmp_imm(JmpOp::Eq, Reg::R1, 0, &next)
        .label(&chr_emit)
        .load(Size::DW, Reg::R3, Reg::R10, CB_TMP)
        .mov64_imm(Reg::R2, KIND_CHAR)
        .label(&emit)
        .comment("if (st->records >= FD_RECORDS) { st->more = 1; stop }")
        .load(Size::DW, Reg::R4, Reg::R6, ST_RECORDS)
        .jmp_imm(JmpOp::Ge, Reg::R4, FD_RECORDS, "full")
        .alu64_imm(AluOp::Add, Reg::R4, 1)
        .store(Size::DW, Reg::R6, ST_RECORDS, Reg::R4)
        .comment(&format!(
            "rec = {{ tgid, tid, 8j + {k}, kind, value }}; bpf_seq_write(st->seq, &rec, 24)"
        ))
        .store(Size::DW, Reg::R10, -8, Reg::R3)
        .store(Size::W, Reg::R10, -12, Reg::R2)
        .mov64_reg(Reg::R1, Reg::R9)
        .alu64_imm(AluOp::Add, Reg::R1, k)
        .store(Size::W, Reg::R10, -16, Reg::R1)
        .load(Size::DW, Reg::R1, Reg::R6, ST_TASK)
        .store(Size::DW, Reg::R10, -24, Reg::R1)
        .load(Size::DW, Reg::R1, Reg::R6, ST_SEQ)
        .mov64_reg(Reg::R2, Reg::R10)
        .alu64_imm(AluOp::Add, Reg::R2, -(RECORD_LEN as i32))
        .mov64_imm(Reg::R3, RECORD_LEN as i32)
        .call_id(FUNC_SEQ_WRITE, "seq_write");
}

/// The fd-table program, loaded and linked; each
/// [`FdTableIterator::files`] call is a fresh walk of every task.
#[derive(Debug)]
pub struct FdTableIterator {
    it: Loaded,
}

impl FdTableIterator {
    /// Loads [`fdtable_program`] for `layout` and the fence's `majors` map
    /// through the real verifier, and links it.
    ///
    /// # Errors
    /// [`IterError`]: no permission, no `task` iterator or `bpf_loop`
    /// (5.17+), a verifier refusal.
    pub fn load(layout: &FdTableLayout, majors: &OwnedFd) -> Result<FdTableIterator, IterError> {
        use std::os::fd::AsRawFd;
        Ok(FdTableIterator {
            it: iter::load_with_callback(
                &fdtable_program(layout, majors.as_raw_fd())?,
                "gpufence_fdt",
                "task",
                layout.task,
                ("fdtable", "read_slots"),
            )?,
        })
    }

    /// Pins the link in `dir` ([`PIN_FDTABLE`]), replacing an earlier pin.
    ///
    /// # Errors
    /// [`IterError::Sys`].
    pub fn pin(&self, dir: &Path) -> Result<(), IterError> {
        iter::pin_link(&self.it.link, dir, PIN_FDTABLE)
    }

    /// Opens the link pinned in `dir`.
    ///
    /// # Errors
    /// [`IterError::Sys`] (`ENOENT`: not pinned).
    pub fn open_pinned(dir: &Path) -> Result<FdTableIterator, IterError> {
        Ok(FdTableIterator {
            it: iter::open_pin(dir, PIN_FDTABLE)?,
        })
    }

    /// Every protected character device and io_uring ring in a descriptor
    /// table, and every table not read whole, in task order.
    ///
    /// # Errors
    /// [`IterError`].
    pub fn files(&self) -> Result<Vec<Record>, IterError> {
        iter::read_all(&self.it.link)
    }
}

#[cfg(test)]
pub(crate) mod live {
    use super::*;
    use crate::iter::{in_initial_pid_ns, Object};
    use std::os::fd::{AsFd, AsRawFd};

    /// A `majors` array map like the fence's, with `protected` marked.
    pub(crate) fn majors(protected: &[u32]) -> OwnedFd {
        let fd = crate::sys::map_create(
            crate::maps::MAP_TYPE_ARRAY,
            4,
            4,
            MAJORS_ENTRIES as u32,
            "test_majors",
        )
        .unwrap_or_else(|e| panic!("map_create: {e}"));
        for m in protected {
            crate::sys::map_update(fd.as_fd(), &m.to_ne_bytes(), &1u32.to_ne_bytes()).unwrap();
        }
        fd
    }

    fn layout() -> Option<FdTableLayout> {
        if !nix::unistd::geteuid().is_root() || !in_initial_pid_ns() {
            eprintln!("SKIPPED: needs root in the initial pid namespace");
            return None;
        }
        let btf = match Btf::vmlinux() {
            Ok(b) => b,
            Err(e) => {
                eprintln!("SKIPPED: {e}");
                return None;
            }
        };
        match FdTableLayout::from_btf(&btf) {
            Ok(l) => Some(l),
            // 6.2+ has every piece: there, a failure is a bug.
            Err(e) if btf.func_id("bpf_rdonly_cast").is_ok() => panic!("{e}"),
            Err(e) => {
                eprintln!("SKIPPED: {e}");
                None
            }
        }
    }

    /// Through the real verifier: the program writes this process's
    /// descriptors and mappings of a protected major (`/dev/null` 1:3 and a
    /// mapping of `/dev/zero` 1:5, with major 1 marked) and its io_uring
    /// ring (descriptor and mapping), and nothing for an unprotected major
    /// (`/dev/ptmx`'s 5; major 1 when only 7 is marked), an eventfd, an
    /// epoll instance, a socket or a regular file; a thread with a table of
    /// its own is read under its own id, the threads sharing the leader's
    /// table and memory are not read twice; a table holding more than
    /// [`FD_RECORDS`] protected descriptors says it was not read whole.
    #[test]
    fn the_fd_table_program_writes_protected_devices_and_rings_only() {
        let Some(l) = layout() else { return };
        let me = std::process::id() as i32;
        let it = FdTableIterator::load(&l, &majors(&[1])).unwrap_or_else(|e| panic!("{e}"));
        let null = std::fs::File::open("/dev/null").unwrap();
        let ptmx = std::fs::File::open("/dev/ptmx").ok();
        let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let reg = std::fs::File::open("/proc/self/status").unwrap();
        // SAFETY: descriptors we then own.
        let (efd, epfd) = unsafe { (libc::eventfd(0, 0), libc::epoll_create1(0)) };
        assert!(efd >= 0 && epfd >= 0);
        let mut params = [0u8; 120];
        // SAFETY: io_uring_setup(2) with a zeroed params struct.
        let ring = unsafe { libc::syscall(libc::SYS_io_uring_setup, 4u32, params.as_mut_ptr()) };
        // Mappings: /dev/zero (1:5) privately (the device file stays the
        // vma's file), /dev/tty-like unprotected ones never, the ring's
        // submission queue (IORING_OFF_SQ_RING = 0).
        let zero = std::fs::File::open("/dev/zero").unwrap();
        let map = |fd: i32, flags: i32| {
            // SAFETY: a read mapping of one page of a descriptor we hold.
            unsafe { libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_READ, flags, fd, 0) }
        };
        let zmap = map(zero.as_raw_fd(), libc::MAP_PRIVATE);
        assert_ne!(zmap, libc::MAP_FAILED);
        let rmap = if ring >= 0 {
            map(ring as i32, libc::MAP_SHARED)
        } else {
            libc::MAP_FAILED
        };
        // A thread with a table of its own holding /dev/null.
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            // SAFETY: unshare(2) of this thread's descriptor table.
            assert_eq!(unsafe { libc::unshare(libc::CLONE_FILES) }, 0);
            let own = std::fs::File::open("/dev/null").unwrap();
            tx.send((nix::unistd::gettid().as_raw(), own.as_raw_fd()))
                .unwrap();
            let _ = done_rx.recv();
            drop(own);
        });
        let (tid, own_fd) = rx.recv().unwrap();
        let recs = it.files().unwrap();
        let _ = done_tx.send(());
        t.join().unwrap();
        let mine: Vec<&Record> = recs.iter().filter(|r| r.tgid == me).collect();
        assert!(
            mine.iter().any(|r| r.tid == me
                && r.fd == null.as_raw_fd()
                && r.object == Object::CharFd(1, 3)),
            "{mine:?}"
        );
        assert!(
            mine.iter()
                .any(|r| r.tid == tid && r.fd == own_fd && r.object == Object::CharFd(1, 3)),
            "the thread's own table: {mine:?}"
        );
        if ring >= 0 {
            assert!(
                mine.iter().any(|r| r.tid == me
                    && r.fd == ring as i32
                    && matches!(r.object, Object::AnonInode(_))),
                "the ring: {mine:?}"
            );
        }
        // One walk of the mappings, by the leader's run: each once.
        let maps: Vec<&&Record> = mine
            .iter()
            .filter(|r| matches!(r.object, Object::CharMap(..) | Object::AnonMap(_)))
            .collect();
        assert_eq!(
            maps.iter()
                .filter(|r| r.object == Object::CharMap(1, 5))
                .count(),
            1,
            "{maps:?}"
        );
        if rmap != libc::MAP_FAILED {
            assert_eq!(
                maps.iter()
                    .filter(|r| matches!(r.object, Object::AnonMap(_)))
                    .count(),
                1,
                "the mapped ring: {maps:?}"
            );
        }
        assert!(maps.iter().all(|r| r.tid == me), "{maps:?}");
        // An unprotected major's mapping is not written.
        let other = FdTableIterator::load(&l, &majors(&[7])).unwrap_or_else(|e| panic!("{e}"));
        let recs = other.files().unwrap();
        assert!(
            !recs
                .iter()
                .any(|r| r.tgid == me
                    && matches!(r.object, Object::CharMap(..) | Object::CharFd(..))),
            "major 1 is not protected there"
        );
        for fd in [efd, epfd, sock.as_raw_fd(), reg.as_raw_fd()]
            .into_iter()
            .chain(ptmx.as_ref().map(|f| f.as_raw_fd()))
        {
            assert!(
                !mine.iter().any(|r| r.tid == me && r.fd == fd),
                "fd {fd} is not for user space: {mine:?}"
            );
        }
        // The leader's table is read once: no record under another
        // thread's id but the thread with its own table.
        assert!(mine.iter().all(|r| r.tid == me || r.tid == tid), "{mine:?}");
        let mut seen = std::collections::BTreeSet::new();
        assert!(
            mine.iter()
                .filter(|r| matches!(r.object, Object::CharFd(..) | Object::AnonInode(_)))
                .all(|r| seen.insert((r.tid, r.fd))),
            "{mine:?}"
        );

        // More protected descriptors than one run writes: said, not cut
        // silently.
        let many: Vec<std::fs::File> = (0..FD_RECORDS + 10)
            .map(|_| std::fs::File::open("/dev/null").unwrap())
            .collect();
        let recs = it.files().unwrap();
        let mine: Vec<&Record> = recs.iter().filter(|r| r.tgid == me).collect();
        assert!(
            mine.iter().any(|r| r.tid == me
                && matches!(r.object, Object::TableUnread(n) if n > FD_RECORDS as u64)),
            "{} records, none says the table was not read whole",
            mine.len()
        );
        drop(many);
        // SAFETY: unmaps and closes what this test made.
        unsafe {
            libc::munmap(zmap, 4096);
            if rmap != libc::MAP_FAILED {
                libc::munmap(rmap, 4096);
            }
            libc::close(efd);
            libc::close(epfd);
            if ring >= 0 {
                libc::close(ring as i32);
            }
        }
    }
}

#[cfg(test)]
mod bytes {
    use super::*;
    use crate::iter::tests::{field, insn_hash};

    fn synthetic_layout() -> FdTableLayout {
        FdTableLayout {
            task: 103,
            rdonly_cast: 104,
            file: 105,
            vma_new: 106,
            vma_next: 107,
            vma_destroy: 108,
            ctx_task: field(8, 8, true),
            meta_seq: field(0, 8, true),
            tgid: field(1240, 4, false),
            pid: field(1236, 4, false),
            files: field(1900, 8, true),
            group_leader: field(1300, 8, true),
            mm: field(900, 8, true),
            vm_file: field(160, 8, true),
            fdt: field(32, 8, true),
            max_fds: field(0, 4, false),
            fd: field(8, 8, true),
            f_inode: field(32, 8, true),
            i_mode: field(0, 2, false),
            i_rdev: field(76, 4, false),
            i_ino: field(64, 8, false),
            i_sb: field(40, 8, true),
            s_magic: field(96, 8, false),
            f_path_dentry: 24,
            d_name_name: 40,
        }
    }

    /// The fd-table program emits exactly the instructions it emitted
    /// when this fingerprint was recorded.
    #[test]
    fn program_keeps_its_bytes() {
        let got = insn_hash(&fdtable_program(&synthetic_layout(), 7).unwrap());
        assert_eq!(got, RECORDED, "{got:?}");
    }
    const RECORDED: (usize, u64) = (738, 18350818569060539144);
}
