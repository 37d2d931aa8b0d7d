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
//! [`Object::AnonInode`](crate::iter::Object::AnonInode), [`Object::CharMap`](crate::iter::Object::CharMap), [`Object::AnonMap`](crate::iter::Object::AnonMap)).
//!
//! What one job's table costs another job's scan is bounded (what the
//! scan needs is which devices a task holds, not every copy):
//!
//! - a protected device that repeats the record before is not written (a
//!   table of a million `dup`s of one GPU descriptor is one record), nor is
//!   a mapping of the file of the mapping before (a library's segments);
//! - an io_uring ring is written only when it has fixed files: a ring
//!   without any holds nothing;
//! - a task whose run stops short (past [`FD_RECORDS`] records, past one
//!   `bpf_loop`'s reach, its mmap lock busy, or the reader's deadline
//!   passed) writes one [`Object::Pending`](crate::iter::Object::Pending)
//!   record saying where it stopped, and a further pass over that thread
//!   alone ([`FdTableIterator::resume`], a link for one tid) goes on from
//!   there, in the kernel: never a `/proc` walk of the table;
//! - each reader thread says in the program's control map ([`Pass`]) which
//!   share of the tasks it reads (several readers on several CPUs split
//!   the machine), which task it resumes, and its deadline, which the
//!   program reads from `bpf_ktime_get_ns` at each task and every
//!   128 batches (1,024 slots).

use std::os::fd::OwnedFd;
use std::path::Path;

#[cfg(feature = "baseline")]
pub mod baseline;

use crate::asm::{AluOp, Asm, AsmError, Helper, JmpOp, Program, Reg, Size};
use crate::btf::{Btf, BtfError, Field};
use crate::iter::{
    self, off, probe_read, size, sized, zero_unknown, IterError, Loaded, Record,
    ANON_INODE_FS_MAGIC, KIND_ANON, KIND_ANON_MAP, KIND_CHAR, KIND_MAP, KIND_PENDING, MAX_LOOPS,
    MINORBITS, RECORD_LEN, S_IFCHR, S_IFMT,
};
use crate::uapi::helper;

/// The pin name of the fd-table iterator's link in the fence's bpffs
/// directory (see [`crate::iter::PIN_RINGS`] for the suffix).
pub const PIN_FDTABLE: &str = "iter_fdtable_v2";

/// The most records one task's run writes; a task with more says where it
/// stopped ([`Object::Pending`](crate::iter::Object::Pending)). What one program run writes must fit the
/// iterator's buffer (8 pages, else `E2BIG`, `bpf_seq_read` in
/// `kernel/bpf/bpf_iter.c`): 1,000 records of 24 bytes and the closing
/// one do.
pub const FD_RECORDS: i32 = 1000;

/// Entries in the fence's `majors` array map ([`crate::maps::MAJORS_ENTRIES`],
/// as the compare's immediate): a major at or past it is let through to
/// user space (the kernel's character majors stop at 511,
/// `CHRDEV_MAJOR_MAX` in `fs/char_dev.c`).
const MAJORS_ENTRIES: i32 = crate::maps::MAJORS_ENTRIES as i32;

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
    /// `vm_area_struct.vm_start`: where a resumed walk of the mappings
    /// starts.
    vm_start: Field,
    /// `file.private_data`: a ring's `struct io_ring_ctx`.
    private_data: Field,
    /// The offset of a ring's count of fixed files in its context
    /// ([`crate::iter::FileTable`]); `None` (no io_uring in the kernel):
    /// every ring is written.
    ring_nr: Option<i32>,
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
            vm_start: sized(btf, "vm_area_struct", "vm_start", 8, false)?,
            private_data: sized(btf, "file", "private_data", 8, true)?,
            ring_nr: iter::RingLayout::from_btf(btf).ok().map(|r| match r.table {
                iter::FileTable::Nodes { nr, .. } => nr,
                iter::FileTable::Files { nr, .. } => nr,
            }),
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
// state at fp-104..fp-33, the vma iterator at fp-112, the name read at
// fp-128..fp-118, the major looked up at fp-136, the reader's id at
// fp-144, the mappings' resume address, last device, ring flag and
// current start at fp-152..fp-176, the loop's count at fp-184, the
// last mapping's file at fp-192.
const TMP: i16 = -32;
const STATE: i16 = -104;
const IT: i16 = -112;
const NAME: i16 = -128;
const KEY: i16 = -136;
const CTL_KEY: i16 = -144;
const VSTART: i16 = -152;
const VLAST: i16 = -160;
const VANON: i16 = -168;
const VCUR: i16 = -176;
const NLOOP: i16 = -184;
const VFILE: i16 = -192;
const ST_TABLE: i16 = 0;
const ST_SEQ: i16 = 8;
const ST_TASK: i16 = 16;
const ST_RECORDS: i16 = 24;
const ST_MORE: i16 = 32;
const ST_LAST: i16 = 40;
const ST_START: i16 = 48;
const ST_DEADLINE: i16 = 56;
const ST_STOP: i16 = 64;
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

/// The callback looks at the clock once per this many batches (1,024
/// slots, some 30 µs of reading): the deadline check costs one
/// `bpf_ktime_get_ns` per 1,024 descriptors.
const CLOCK_EVERY: i32 = 128;

/// The fd-table program's control map (`BPF_MAP_TYPE_HASH`, key the
/// reader's `bpf_get_current_pid_tgid()`, value [`Pass`] as 32 bytes):
/// each reader thread says which share of the tasks it reads, which task
/// it resumes and by when it must be done. A plain hash never drops a
/// live reader's entry (an LRU map may, before it is full, from another
/// CPU's free list); full of entries of readers killed before they
/// removed theirs, a reader removes those of threads that are gone
/// ([`FdTableIterator::read`]).
const CTL_ENTRIES: u32 = 1024;
/// The control map's name, as [`FdTableIterator::open_pinned`] finds it
/// among the program's maps.
const CTL_NAME: &str = "gpufence_fdtctl";
/// `pass.batch` meaning "the descriptor table is read": past any
/// table's batches.
const BATCH_DONE: u32 = u32::MAX;

/// In the main frame: writes `{ tgid, tid, fd, kind, r3 }` with
/// `bpf_seq_write(state.seq)` and goes on; `kind` is `r2` when `None`.
fn main_record(a: &mut Asm, kind: Option<i32>, fd: i32) {
    a.store(Size::DW, Reg::R10, -8, Reg::R3);
    match kind {
        Some(k) => a.store_imm(Size::W, Reg::R10, -12, k),
        None => a.store(Size::W, Reg::R10, -12, Reg::R2),
    };
    a.store_imm(Size::W, Reg::R10, -16, fd);
    seq_write_main(a);
}

/// In the main frame: the record's task word, then `bpf_seq_write` of
/// the 24 bytes at fp-24.
fn seq_write_main(a: &mut Asm) {
    a.load(Size::DW, Reg::R1, Reg::R10, STATE + ST_TASK)
        .store(Size::DW, Reg::R10, -24, Reg::R1)
        .load(Size::DW, Reg::R1, Reg::R10, STATE + ST_SEQ)
        .mov64_reg(Reg::R2, Reg::R10)
        .alu64_imm(AluOp::Add, Reg::R2, -(RECORD_LEN as i32))
        .mov64_imm(Reg::R3, RECORD_LEN as i32)
        .call_id(helper::SEQ_WRITE, "seq_write");
}

/// In the main frame: the task's [`Object::Pending`](crate::iter::Object::Pending)
/// record `{ tgid, tid, batch (fd), PENDING, vaddr }` (`batch` in `r4`,
/// `vaddr` in `r5`), then out.
fn pending_record(a: &mut Asm) {
    a.store(Size::DW, Reg::R10, -8, Reg::R5)
        .store_imm(Size::W, Reg::R10, -12, KIND_PENDING)
        .store(Size::W, Reg::R10, -16, Reg::R4);
    seq_write_main(a);
    a.ja("out");
}

/// With the name pointer in `r3`: reads 11 bytes of it into `fp+at` and
/// goes to `yes` when they are `[io_uring]\0`, to `unreadable` when they
/// cannot be read, else to `no`.
fn io_uring_name(a: &mut Asm, at: i16, unreadable: &str, yes: &str, no: &str) {
    probe_read(a, at, Size::W, 11, Reg::R1, unreadable);
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

/// With a ring's file in `file` (a BTF pointer): goes to `no` when the
/// ring has no fixed files (`file->private_data` is its `struct
/// io_ring_ctx`, `io_uring_get_file` in `io_uring/io_uring.c`; the count
/// at [`FdTableLayout`]'s `ring_nr`), else (or when it cannot be read) to
/// `yes`. A ring without fixed files holds no file: nothing to look at.
fn ring_has_files(a: &mut Asm, l: &FdTableLayout, file: Reg, tmp: i16, yes: &str, no: &str) {
    let Some(nr) = l.ring_nr else {
        a.ja(yes);
        return;
    };
    a.comment("ctx = file->private_data; if (!ctx->nr fixed files) nothing to look at")
        .load(Size::DW, Reg::R3, file, off(&l.private_data))
        .jmp_imm(JmpOp::Eq, Reg::R3, 0, yes)
        .alu64_imm(AluOp::Add, Reg::R3, nr);
    probe_read(a, tmp, Size::W, 4, Reg::R1, yes);
    a.jmp_imm(JmpOp::Eq, Reg::R1, 0, no).ja(yes);
}

/// The fd-table program: for each task with a table of its own, the
/// slots of `files->fdt->fd`, walked with `bpf_loop`; a record for each
/// character device on a major `majors_fd` (the fence's `majors` map)
/// marks protected, unless it repeats the device of the record before
/// (a table of a million copies of one descriptor is one record), and
/// each anonymous inode named `[io_uring]` (the dentry name
/// `io_uring_get_file` gives a ring, `anon_inode_create_getfile("[io_uring]",
/// ...)` in `io_uring/io_uring.c`) that has fixed files (a name that
/// cannot be read is let through); then the group leader's mappings,
/// likewise. The reader's entry in `ctl_fd` ([`Pass`]) picks the tasks
/// (a share of them, or one task resumed where an earlier pass stopped)
/// and the deadline; a task not done by its end, past [`FD_RECORDS`]
/// records, or whose mmap lock was busy gets one
/// [`Object::Pending`](crate::iter::Object::Pending) record saying where
/// to resume.
///
/// # Errors
/// [`AsmError`] (a bug here).
pub fn fdtable_program(
    l: &FdTableLayout,
    majors_fd: i32,
    ctl_fd: i32,
) -> Result<Program, AsmError> {
    let mut a = Asm::new();
    task_state(&mut a, l, ctl_fd);
    table_walk(&mut a, l);
    vma_walk(&mut a, l);
    vma_record(&mut a, l, majors_fd);
    read_slots(&mut a, l, majors_fd);
    a.assemble()
}

/// The task (`r7`) and its table (`r8`), else out; the loop state's
/// `seq`, `tgid | tid << 32`, `records` and `more` as unknown zeros;
/// then the reader's [`Pass`]: out when the task is not in its share or
/// not the task it resumes; the start batch, the mappings' start and the
/// deadline.
fn task_state(a: &mut Asm, l: &FdTableLayout, ctl_fd: i32) {
    a.comment("task: ctx = { meta, task }")
        .mov64_reg(Reg::R6, Reg::R1)
        .load(Size::DW, Reg::R7, Reg::R6, off(&l.ctx_task))
        .jmp_imm(JmpOp::Eq, Reg::R7, 0, "out")
        .comment("start = vstart = deadline = 0")
        .store_imm(Size::DW, Reg::R10, STATE + ST_START, 0)
        .store_imm(Size::DW, Reg::R10, VSTART, 0)
        .store_imm(Size::DW, Reg::R10, STATE + ST_DEADLINE, 0)
        .comment("pass = ctl[bpf_get_current_pid_tgid()] (none: every task from its start), read at once")
        .call(Helper::GetCurrentPidTgid)
        .store(Size::DW, Reg::R10, CTL_KEY, Reg::R0)
        .ld_map_fd(Reg::R1, ctl_fd, "ctl")
        .mov64_reg(Reg::R2, Reg::R10)
        .alu64_imm(AluOp::Add, Reg::R2, CTL_KEY as i32)
        .call(Helper::MapLookupElem)
        .jmp_imm(JmpOp::Eq, Reg::R0, 0, "state")
        .comment("a share: tgid % pass.shares == pass.share, else not this reader's (before any other work)")
        .load(Size::W, Reg::R1, Reg::R0, 0)
        .jmp_imm(JmpOp::Le, Reg::R1, 1, "one")
        .load(size(&l.tgid), Reg::R2, Reg::R7, off(&l.tgid))
        .alu64_reg(AluOp::Mod, Reg::R2, Reg::R1)
        .load(Size::W, Reg::R3, Reg::R0, 4)
        .jmp_reg(JmpOp::Ne, Reg::R2, Reg::R3, "out")
        .label("one")
        .load(Size::DW, Reg::R1, Reg::R0, 24)
        .store(Size::DW, Reg::R10, STATE + ST_DEADLINE, Reg::R1)
        .comment("a resumption: pass.tid only, its table from pass.batch, its mappings from pass.vaddr")
        .load(Size::W, Reg::R1, Reg::R0, 8)
        .jmp_imm(JmpOp::Eq, Reg::R1, 0, "state")
        .load(size(&l.pid), Reg::R2, Reg::R7, off(&l.pid))
        .jmp_reg(JmpOp::Ne, Reg::R1, Reg::R2, "out")
        .load(Size::W, Reg::R1, Reg::R0, 12)
        .store(Size::DW, Reg::R10, STATE + ST_START, Reg::R1)
        .load(Size::DW, Reg::R1, Reg::R0, 16)
        .store(Size::DW, Reg::R10, VSTART, Reg::R1)
        .label("state")
        .comment("r8 = task->files (NULL: an exiting task or a kernel thread's)")
        .load(Size::DW, Reg::R8, Reg::R7, off(&l.files))
        .jmp_imm(JmpOp::Eq, Reg::R8, 0, "out")
        .comment("state = { -, seq, tgid | tid << 32, records 0, more 0, last 0, .. }")
        .load(Size::DW, Reg::R1, Reg::R6, 0)
        .load(Size::DW, Reg::R1, Reg::R1, off(&l.meta_seq))
        .store(Size::DW, Reg::R10, STATE + ST_SEQ, Reg::R1)
        .load(size(&l.pid), Reg::R1, Reg::R7, off(&l.pid))
        .alu64_imm(AluOp::Lsh, Reg::R1, 32)
        .load(size(&l.tgid), Reg::R2, Reg::R7, off(&l.tgid))
        .alu64_reg(AluOp::Or, Reg::R1, Reg::R2)
        .store(Size::DW, Reg::R10, STATE + ST_TASK, Reg::R1)
        .store_imm(Size::DW, Reg::R10, STATE + ST_LAST, 0)
        .store_imm(Size::DW, Reg::R10, STATE + ST_STOP, 0)
        .store_imm(Size::DW, Reg::R10, VLAST, 0)
        .store_imm(Size::DW, Reg::R10, VANON, 0)
        .store_imm(Size::DW, Reg::R10, VCUR, 0)
        .store_imm(Size::DW, Reg::R10, VFILE, 0);
    zero_unknown(a, TMP, STATE + ST_RECORDS, "out");
    zero_unknown(a, TMP, STATE + ST_MORE, "out");
}

/// The descriptor table, read by the leader's run (or a thread's of its
/// own): `bpf_loop` of `read_slots` over its slots from `state.start`, 8
/// at a time, at most `BPF_MAX_LOOPS` batches a run; stopped short (past
/// [`FD_RECORDS`], the deadline, the loop's reach) it says where to
/// resume.
fn table_walk(a: &mut Asm, l: &FdTableLayout) {
    a.label("table")
        .comment("a thread sharing its leader's table: the leader's run reads it")
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
        .comment("batches = (fdt->max_fds + 7) / 8; none left from state.start: the mappings")
        .load(size(&l.max_fds), Reg::R1, Reg::R9, off(&l.max_fds))
        .alu64_imm(AluOp::Add, Reg::R1, SLOTS - 1)
        .alu64_imm(AluOp::Rsh, Reg::R1, 3)
        .load(Size::DW, Reg::R2, Reg::R10, STATE + ST_START)
        .jmp_reg(JmpOp::Ge, Reg::R2, Reg::R1, "vmas");
    a.label("table_loop")
        .comment("n = min(batches - start, BPF_MAX_LOOPS); bpf_loop(n, read_slots, &state, 0)")
        .load(size(&l.max_fds), Reg::R1, Reg::R9, off(&l.max_fds))
        .alu64_imm(AluOp::Add, Reg::R1, SLOTS - 1)
        .alu64_imm(AluOp::Rsh, Reg::R1, 3)
        .load(Size::DW, Reg::R2, Reg::R10, STATE + ST_START)
        .alu64_reg(AluOp::Sub, Reg::R1, Reg::R2)
        .jmp_imm(JmpOp::Le, Reg::R1, MAX_LOOPS, "table_n")
        .mov64_imm(Reg::R1, MAX_LOOPS)
        .label("table_n")
        .store(Size::DW, Reg::R10, NLOOP, Reg::R1)
        .ld_func(Reg::R2, "read_slots")
        .mov64_reg(Reg::R3, Reg::R10)
        .alu64_imm(AluOp::Add, Reg::R3, STATE as i32)
        .mov64_imm(Reg::R4, 0)
        .call_id(helper::LOOP, "loop")
        .comment("stopped (records full, the deadline): resume at state.stop")
        .load(Size::DW, Reg::R1, Reg::R10, STATE + ST_MORE)
        .jmp_imm(JmpOp::Eq, Reg::R1, 0, "table_reach")
        .load(Size::DW, Reg::R4, Reg::R10, STATE + ST_STOP)
        .ja("table_pending")
        .label("table_reach")
        .comment("past one loop's reach: resume at start + n")
        .load(Size::DW, Reg::R4, Reg::R10, STATE + ST_START)
        .load(Size::DW, Reg::R1, Reg::R10, NLOOP)
        .alu64_reg(AluOp::Add, Reg::R4, Reg::R1)
        .load(size(&l.max_fds), Reg::R1, Reg::R9, off(&l.max_fds))
        .alu64_imm(AluOp::Add, Reg::R1, SLOTS - 1)
        .alu64_imm(AluOp::Rsh, Reg::R1, 3)
        .jmp_reg(JmpOp::Ge, Reg::R4, Reg::R1, "vmas")
        .label("table_pending")
        .comment("rec = { tgid, tid, batch, PENDING, vstart }: the mappings not read yet either")
        .load(Size::DW, Reg::R5, Reg::R10, VSTART);
    pending_record(a);
}

/// The mappings, walked by the leader's run (or each thread's once the
/// leader's mm is gone) with the open-coded vma iterator from the
/// resume address: a mapped character device goes to `vchr`, an
/// anonymous inode named `[io_uring]` (a ring's mapping) with fixed
/// files to `vanon`.
fn vma_walk(a: &mut Asm, l: &FdTableLayout) {
    a.label("vmas")
        .comment(
            "mappings: the leader's run walks them (or each thread's once the leader's mm is gone)",
        )
        .load(size(&l.pid), Reg::R1, Reg::R7, off(&l.pid))
        .load(size(&l.tgid), Reg::R2, Reg::R7, off(&l.tgid))
        .jmp_reg(JmpOp::Eq, Reg::R1, Reg::R2, "walk")
        .load(Size::DW, Reg::R1, Reg::R7, off(&l.group_leader))
        .jmp_imm(JmpOp::Eq, Reg::R1, 0, "walk")
        .load(Size::DW, Reg::R1, Reg::R1, off(&l.mm))
        .jmp_imm(JmpOp::Ne, Reg::R1, 0, "out")
        .label("walk")
        .comment("vstart == ~0: the mappings were read by an earlier pass")
        .load(Size::DW, Reg::R1, Reg::R10, VSTART)
        .jmp_imm(JmpOp::Eq, Reg::R1, -1, "out");
    a.label("vma_start")
        .comment("bpf_iter_task_vma_new(&it, task, vstart): destroyed whatever it returns")
        .mov64_reg(Reg::R1, Reg::R10)
        .alu64_imm(AluOp::Add, Reg::R1, IT as i32)
        .mov64_reg(Reg::R2, Reg::R7)
        .load(Size::DW, Reg::R3, Reg::R10, VSTART)
        .call_kfunc(l.vma_new, "bpf_iter_task_vma_new")
        .comment("it could not start (the mmap lock was busy: it only tries; no memory): resume later; no mm: nothing to read")
        .comment("(an int: its low 32 bits, as 32-bit arithmetic leaves them)")
        .alu32_imm(AluOp::Add, Reg::R0, 0)
        .jmp_imm(JmpOp::Eq, Reg::R0, 0, "vma")
        .alu32_imm(AluOp::Add, Reg::R0, ENOENT)
        .jmp_imm(JmpOp::Eq, Reg::R0, 0, "vdone");
    destroy_vma_iter(a, l);
    a.mov64_imm(Reg::R4, -1)
        .load(Size::DW, Reg::R5, Reg::R10, VSTART);
    pending_record(a);
    a.label("vma")
        .comment("vma = bpf_iter_task_vma_next(&it); vcur = vma->vm_start; file = vma->vm_file; inode = file->f_inode")
        .mov64_reg(Reg::R1, Reg::R10)
        .alu64_imm(AluOp::Add, Reg::R1, IT as i32)
        .call_kfunc(l.vma_next, "bpf_iter_task_vma_next")
        .jmp_imm(JmpOp::Eq, Reg::R0, 0, "vdone")
        .load(size(&l.vm_start), Reg::R1, Reg::R0, off(&l.vm_start))
        .store(Size::DW, Reg::R10, VCUR, Reg::R1)
        .load(Size::DW, Reg::R8, Reg::R0, off(&l.vm_file))
        .jmp_imm(JmpOp::Eq, Reg::R8, 0, "vma")
        .comment("the file of the mapping before (a library's segments): looked at already")
        .load(Size::DW, Reg::R1, Reg::R10, VFILE)
        .jmp_reg(JmpOp::Eq, Reg::R1, Reg::R8, "vma")
        .store(Size::DW, Reg::R10, VFILE, Reg::R8)
        .load(Size::DW, Reg::R9, Reg::R8, off(&l.f_inode))
        .jmp_imm(JmpOp::Eq, Reg::R9, 0, "vma")
        .load(size(&l.i_mode), Reg::R1, Reg::R9, off(&l.i_mode))
        .alu64_imm(AluOp::And, Reg::R1, S_IFMT)
        .jmp_imm(JmpOp::Eq, Reg::R1, S_IFCHR, "vchr")
        .jmp_imm(JmpOp::Ne, Reg::R1, 0, "vma")
        .comment("an io_uring's mapped rings: anonymous inode named [io_uring], with fixed files")
        .load(Size::DW, Reg::R1, Reg::R9, off(&l.i_sb))
        .jmp_imm(JmpOp::Eq, Reg::R1, 0, "vma")
        .load(size(&l.s_magic), Reg::R1, Reg::R1, off(&l.s_magic))
        .jmp_imm(JmpOp::Ne, Reg::R1, ANON_INODE_FS_MAGIC as i32, "vma")
        .load(Size::DW, Reg::R1, Reg::R8, l.f_path_dentry)
        .jmp_imm(JmpOp::Eq, Reg::R1, 0, "vanon")
        .load(Size::DW, Reg::R3, Reg::R1, l.d_name_name)
        .jmp_imm(JmpOp::Eq, Reg::R3, 0, "vanon");
    io_uring_name(a, NAME, "vanon", "vring", "vma");
    a.label("vring");
    ring_has_files(a, l, Reg::R8, TMP, "vanon", "vma");
}

/// `bpf_iter_task_vma_destroy(&it)`: the vma iterator at fp+IT ended,
/// as the verifier wants after every `_new`, whatever it returned.
fn destroy_vma_iter(a: &mut Asm, l: &FdTableLayout) {
    a.mov64_reg(Reg::R1, Reg::R10)
        .alu64_imm(AluOp::Add, Reg::R1, IT as i32)
        .call_kfunc(l.vma_destroy, "bpf_iter_task_vma_destroy");
}

/// A mapping's record: the first mapped io_uring ring's inode number (one
/// is enough: user space then reads the memory map), or a character
/// device on a protected major unless it repeats the last one; past
/// [`FD_RECORDS`] the walk stops and says where to resume; then the
/// iterator destroyed.
fn vma_record(a: &mut Asm, l: &FdTableLayout, majors_fd: i32) {
    a.label("vanon")
        .load(Size::DW, Reg::R1, Reg::R10, VANON)
        .jmp_imm(JmpOp::Ne, Reg::R1, 0, "vma")
        .store_imm(Size::DW, Reg::R10, VANON, 1)
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
        .comment("the device of the mapping before: said already")
        .load(Size::DW, Reg::R3, Reg::R10, TMP)
        .load(Size::DW, Reg::R1, Reg::R10, VLAST)
        .jmp_reg(JmpOp::Eq, Reg::R1, Reg::R3, "vma")
        .store(Size::DW, Reg::R10, VLAST, Reg::R3)
        .mov64_imm(Reg::R2, KIND_MAP)
        .label("vemit")
        .comment("if (records >= FD_RECORDS) resume at this mapping; rec = { tgid, tid, 0, kind, value }")
        .load(Size::DW, Reg::R4, Reg::R10, STATE + ST_RECORDS)
        .jmp_imm(JmpOp::Ge, Reg::R4, FD_RECORDS, "vfull")
        .alu64_imm(AluOp::Add, Reg::R4, 1)
        .store(Size::DW, Reg::R10, STATE + ST_RECORDS, Reg::R4);
    main_record(a, None, 0);
    a.ja("vma").label("vfull");
    destroy_vma_iter(a, l);
    a.mov64_imm(Reg::R4, -1)
        .load(Size::DW, Reg::R5, Reg::R10, VCUR);
    pending_record(a);
    a.label("vdone");
    destroy_vma_iter(a, l);
    a.label("out").mov64_imm(Reg::R0, 0).exit();
}

/// The `bpf_loop` callback `read_slots`: every [`CLOCK_EVERY`] batches
/// the deadline; eight slots of the table read at once, then one `slot`
/// block each.
fn read_slots(a: &mut Asm, l: &FdTableLayout, majors_fd: i32) {
    // long read_slots(u64 j, struct state *st): batch st->start + j, slots
    // 8(start+j)..+7, read in one bpf_probe_read_kernel; each file is cast
    // to a BTF pointer (bpf_rdonly_cast, which the verifier turns into a
    // move) so that its members are read with plain loads (a fault reads
    // 0). r6 = st, r7 = file, r8 = inode, r9 = 8(start+j).
    a.label("read_slots")
        .mov64_reg(Reg::R6, Reg::R2)
        .mov64_reg(Reg::R9, Reg::R1)
        .comment("every CLOCK_EVERY batches after the first: past st->deadline, stop (st->more = 2) at this batch")
        .jmp_imm(JmpOp::Eq, Reg::R1, 0, "batch")
        .alu64_imm(AluOp::And, Reg::R1, CLOCK_EVERY - 1)
        .jmp_imm(JmpOp::Ne, Reg::R1, 0, "batch")
        .load(Size::DW, Reg::R1, Reg::R6, ST_DEADLINE)
        .jmp_imm(JmpOp::Eq, Reg::R1, 0, "batch")
        .call(Helper::KtimeGetNs)
        .load(Size::DW, Reg::R1, Reg::R6, ST_DEADLINE)
        .jmp_reg(JmpOp::Le, Reg::R0, Reg::R1, "batch")
        .load(Size::DW, Reg::R1, Reg::R6, ST_START)
        .alu64_reg(AluOp::Add, Reg::R1, Reg::R9)
        .store(Size::DW, Reg::R6, ST_STOP, Reg::R1)
        .store_imm(Size::DW, Reg::R6, ST_MORE, 2)
        .mov64_imm(Reg::R0, 1)
        .exit()
        .label("batch")
        .comment("batch = st->table[8(start+j) .. +8]")
        .load(Size::DW, Reg::R1, Reg::R6, ST_START)
        .alu64_reg(AluOp::Add, Reg::R9, Reg::R1)
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
        .comment("records full: stop (st->more = 1) at this batch; a further pass reads it again")
        .store_imm(Size::DW, Reg::R6, ST_MORE, 1)
        .mov64_reg(Reg::R1, Reg::R9)
        .alu64_imm(AluOp::Rsh, Reg::R1, 3)
        .store(Size::DW, Reg::R6, ST_STOP, Reg::R1)
        .mov64_imm(Reg::R0, 1)
        .exit();
}

/// Slot `k` of the batch: a character device on a protected major (not
/// the device of the record before), or an anonymous inode named
/// `[io_uring]` with fixed files, is written as a record (up to
/// [`FD_RECORDS`], then `more` and stop).
fn slot(a: &mut Asm, l: &FdTableLayout, majors_fd: i32, k: i32) {
    let next = if k + 1 < SLOTS {
        format!("slot_{}", k + 1)
    } else {
        "next".to_string()
    };
    let (chr, chr_emit, anon, ring, emit) = (
        format!("chr_{k}"),
        format!("chr_emit_{k}"),
        format!("anon_{k}"),
        format!("ring_{k}"),
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
    io_uring_name(a, CB_NAME, &anon, &ring, &next);
    a.label(&ring);
    ring_has_files(a, l, Reg::R7, CB_TMP, &anon, &next);
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
        .comment("the device of the record before (a copy of one descriptor): said already")
        .load(Size::DW, Reg::R3, Reg::R10, CB_TMP)
        .load(Size::DW, Reg::R1, Reg::R6, ST_LAST)
        .jmp_reg(JmpOp::Eq, Reg::R1, Reg::R3, &next)
        .store(Size::DW, Reg::R6, ST_LAST, Reg::R3)
        .mov64_imm(Reg::R2, KIND_CHAR)
        .label(&emit)
        .comment("if (st->records >= FD_RECORDS) { st->more = 1; stop }")
        .load(Size::DW, Reg::R4, Reg::R6, ST_RECORDS)
        .jmp_imm(JmpOp::Ge, Reg::R4, FD_RECORDS, "full")
        .alu64_imm(AluOp::Add, Reg::R4, 1)
        .store(Size::DW, Reg::R6, ST_RECORDS, Reg::R4)
        .comment(&format!(
            "rec = {{ tgid, tid, 8(start+j) + {k}, kind, value }}; bpf_seq_write(st->seq, &rec, 24)"
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
        .call_id(helper::SEQ_WRITE, "seq_write");
}

/// One reader's pass over the fd-table program: which tasks it reads
/// and by when. Written into the program's control map under the reading
/// thread's id for the length of one read, then removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pass {
    /// Read only tasks whose `tgid % shares == share` (0 or 1: every
    /// task): readers on several CPUs split the machine, a process's
    /// table and mappings in one share.
    pub shares: u32,
    /// This reader's share, below `shares`.
    pub share: u32,
    /// Resume this one thread (a global tid; 0: none): its table from
    /// `batch`, its mappings from `vaddr`, as its
    /// [`Object::Pending`](crate::iter::Object::Pending) record said.
    pub tid: u32,
    /// The batch of 8 slots to resume the table at (`u32::MAX`: read).
    pub batch: u32,
    /// The address to resume the mappings at (`u64::MAX`: read).
    pub vaddr: u64,
    /// `CLOCK_MONOTONIC` nanoseconds (`bpf_ktime_get_ns`) past which each
    /// task's run stops where it is and says so (0: none).
    pub deadline_ns: u64,
}

impl Pass {
    /// A resumption of `tid` where its pending record (`fd` = batch,
    /// value = address) said.
    pub fn resume(tid: i32, batch: i32, vaddr: u64, deadline_ns: u64) -> Pass {
        Pass {
            shares: 1,
            share: 0,
            tid: tid as u32,
            batch: u32::try_from(batch).unwrap_or(BATCH_DONE),
            vaddr,
            deadline_ns,
        }
    }

    fn bytes(&self) -> [u8; 32] {
        let mut b = [0u8; 32];
        b[0..4].copy_from_slice(&self.shares.to_ne_bytes());
        b[4..8].copy_from_slice(&self.share.to_ne_bytes());
        b[8..12].copy_from_slice(&self.tid.to_ne_bytes());
        b[12..16].copy_from_slice(&self.batch.to_ne_bytes());
        b[16..24].copy_from_slice(&self.vaddr.to_ne_bytes());
        b[24..32].copy_from_slice(&self.deadline_ns.to_ne_bytes());
        b
    }
}

/// The fd-table program, loaded and linked, with its control map; each
/// [`FdTableIterator::files`] call is a fresh walk of every task.
#[derive(Debug)]
pub struct FdTableIterator {
    it: Loaded,
    /// The program (to link it again for one task: [`FdTableIterator::resume`]).
    prog: OwnedFd,
    /// Its control map ([`Pass`] per reader).
    ctl: crate::sys::MapFd,
}

impl FdTableIterator {
    /// Loads [`fdtable_program`] for `layout` and the fence's `majors` map
    /// (and a control map of its own) through the real verifier, and
    /// links it.
    ///
    /// # Errors
    /// [`IterError`]: no permission, no `task` iterator or `bpf_loop`
    /// (5.17+), a verifier refusal.
    pub fn load(
        layout: &FdTableLayout,
        majors: &crate::maps::Map<crate::maps::MajorsMap>,
    ) -> Result<FdTableIterator, IterError> {
        use std::os::fd::AsRawFd;
        let ctl = crate::sys::map_create(
            crate::uapi::map_type::LRU_HASH,
            8,
            32,
            CTL_ENTRIES,
            CTL_NAME,
        )
        .map_err(|err| IterError::Sys {
            what: "BPF_MAP_CREATE (the fd-table program's control map)",
            err,
        })?;
        let it = iter::load_with_callback(
            &fdtable_program(layout, majors.as_raw_fd(), ctl.as_raw_fd())?,
            "gpufence_fdt",
            "task",
            layout.task,
            ("fdtable", "read_slots"),
        )?;
        let prog = it
            ._prog
            .as_ref()
            .ok_or_else(|| IterError::Malformed("a loaded program without its fd".into()))?
            .try_clone()
            .map_err(|err| IterError::Sys {
                what: "dup (the fd-table program)",
                err,
            })?;
        Ok(FdTableIterator { it, prog, ctl })
    }

    /// Pins the link in `dir` ([`PIN_FDTABLE`]), replacing an earlier pin.
    ///
    /// # Errors
    /// [`IterError::Sys`].
    pub fn pin(&self, dir: &Path) -> Result<(), IterError> {
        iter::pin_link(&self.it.link, dir, PIN_FDTABLE)
    }

    /// Opens the link pinned in `dir`, and through it its program and the
    /// program's control map (by id: the link names its program, the
    /// program its maps), so that the three always belong together.
    ///
    /// # Errors
    /// [`IterError::Sys`] (`ENOENT`: not pinned); [`IterError::Malformed`]
    /// when the program has no control map (not this program).
    pub fn open_pinned(dir: &Path) -> Result<FdTableIterator, IterError> {
        use std::os::fd::AsFd;
        let sys = |what: &'static str| move |err| IterError::Sys { what, err };
        let it = iter::open_pin(dir, PIN_FDTABLE)?;
        let info = crate::sys::link_info(it.link.as_fd())
            .map_err(sys("BPF_OBJ_GET_INFO_BY_FD (the fd-table link)"))?;
        let prog = crate::sys::prog_fd_by_id(info.prog_id)
            .map_err(sys("BPF_PROG_GET_FD_BY_ID (the fd-table program)"))?;
        let ids = crate::sys::prog_map_ids(prog.as_fd())
            .map_err(sys("BPF_OBJ_GET_INFO_BY_FD (the fd-table program's maps)"))?;
        for id in ids {
            let Ok(map) = crate::sys::map_fd_by_id(id) else {
                continue;
            };
            let Ok(mi) = crate::sys::map_info(map.as_fd()) else {
                continue;
            };
            let shape = map.shape();
            if crate::sys::name_str(&mi.name) == CTL_NAME
                && shape.key_size == 8
                && shape.value_size == 32
            {
                return Ok(FdTableIterator { it, prog, ctl: map });
            }
        }
        Err(IterError::Malformed(format!(
            "the program pinned as {PIN_FDTABLE} has no control map {CTL_NAME}"
        )))
    }

    /// Every protected character device and io_uring ring with fixed
    /// files in a descriptor table, and every task's mappings of them, in
    /// task order: one reader, every task, no deadline (tasks stopped
    /// short still say where to resume).
    ///
    /// # Errors
    /// [`IterError`].
    pub fn files(&self) -> Result<Vec<Record>, IterError> {
        self.read(&self.it.link, &Pass::default())
    }

    /// [`FdTableIterator::files`] for the tasks and deadline of `pass`
    /// (its `tid` 0: a share of every task), read by this thread.
    ///
    /// # Errors
    /// [`IterError`].
    pub fn pass(&self, pass: &Pass) -> Result<Vec<Record>, IterError> {
        self.read(&self.it.link, pass)
    }

    /// A further pass over one thread (`pass.tid`, from where its
    /// [`Object::Pending`](crate::iter::Object::Pending) record said), with
    /// the program linked for that thread alone (`BPF_TASK_ITER_TID`,
    /// 6.1+): no walk of the other tasks.
    ///
    /// # Errors
    /// [`IterError::Sys`] (`ENOENT`: the thread is gone).
    pub fn resume(&self, pass: &Pass) -> Result<Vec<Record>, IterError> {
        use std::os::fd::AsFd;
        let link =
            crate::sys::link_create_iter_task(self.prog.as_fd(), pass.tid).map_err(|err| {
                IterError::Sys {
                    what: "BPF_LINK_CREATE (the fd-table program, one thread)",
                    err,
                }
            })?;
        self.read(&link, pass)
    }

    /// Reads `link` with `pass` in the control map under this thread's
    /// id (`bpf_get_current_pid_tgid`: tgid high, tid low), removed after.
    /// A full map (entries of readers killed before they removed theirs)
    /// loses the entries of threads that are gone, once, and is written
    /// again.
    fn read(&self, link: &OwnedFd, pass: &Pass) -> Result<Vec<Record>, IterError> {
        let key =
            ((std::process::id() as u64) << 32) | nix::unistd::gettid().as_raw() as u32 as u64;
        let write = || crate::sys::map_update(&self.ctl, &key.to_ne_bytes(), &pass.bytes());
        let written = match write() {
            Err(e) if e.raw_os_error() == Some(libc::E2BIG) => {
                self.remove_gone_readers();
                write()
            }
            r => r,
        };
        written.map_err(|err| IterError::Sys {
            what: "BPF_MAP_UPDATE_ELEM (the fd-table program's control map)",
            err,
        })?;
        let out = iter::read_all(link);
        let _ = crate::sys::map_delete(&self.ctl, &key.to_ne_bytes());
        out
    }

    /// Removes the control map's entries of threads that no longer exist
    /// (`/proc/<tgid>/task/<tid>`).
    fn remove_gone_readers(&self) {
        let Ok(keys) = crate::sys::map_keys(&self.ctl) else {
            return;
        };
        for k in keys {
            let Ok(b) = <[u8; 8]>::try_from(k.as_slice()) else {
                continue;
            };
            let id = u64::from_ne_bytes(b);
            let (tgid, tid) = (id >> 32, id & 0xffff_ffff);
            if !Path::new(&format!("/proc/{tgid}/task/{tid}")).exists() {
                let _ = crate::sys::map_delete(&self.ctl, &b);
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod live {
    use super::*;
    use crate::iter::{in_initial_pid_ns, Object};
    use crate::maps::{MajorsMap, Map};
    use std::os::fd::AsRawFd;

    /// A `majors` array map like the fence's, with `protected` marked.
    pub(crate) fn majors(protected: &[u32]) -> Map<MajorsMap> {
        let map = Map::<MajorsMap>::create(0).unwrap_or_else(|e| panic!("map_create: {e}"));
        for m in protected {
            map.update(m, &1).unwrap();
        }
        map
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
    /// table and memory are not read twice; copies of one descriptor are
    /// one record; a ring without fixed files is not written; a table
    /// holding more than [`FD_RECORDS`] records' worth says where to
    /// resume, and further passes over its thread alone read the rest; a
    /// past deadline stops every task at once; two shares split the tasks.
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
        // A ring is worth a look only with fixed files: register one
        // (IORING_REGISTER_FILES, 2); a second ring without any, mapped
        // too, is not written.
        if ring >= 0 {
            let files = [reg.as_raw_fd()];
            // SAFETY: io_uring_register(2) of one descriptor we hold.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_io_uring_register,
                    ring as i32,
                    2u32,
                    files.as_ptr(),
                    1u32,
                )
            };
            assert_eq!(
                r,
                0,
                "IORING_REGISTER_FILES: {}",
                std::io::Error::last_os_error()
            );
        }
        let mut params2 = [0u8; 120];
        // SAFETY: as above.
        let bare = unsafe { libc::syscall(libc::SYS_io_uring_setup, 4u32, params2.as_mut_ptr()) };
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
        let bmap = if bare >= 0 {
            map(bare as i32, libc::MAP_SHARED)
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
        // /dev/null (1:3): `null`, or an earlier copy (stdin) whose record
        // it repeats.
        assert!(
            mine.iter().any(|r| r.tid == me
                && r.fd <= null.as_raw_fd()
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
        if bare >= 0 {
            assert!(
                !mine
                    .iter()
                    .any(|r| r.fd == bare as i32 && matches!(r.object, Object::AnonInode(_))),
                "a ring without fixed files: {mine:?}"
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
                "the mapped ring with fixed files, once (the bare one not): {maps:?}"
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

        // Copies of one protected descriptor are one record (the device
        // repeats the record before); more distinct records than one run
        // writes: the run stops and says where to resume, and further
        // passes over this thread alone read the rest, each record once.
        let nulls = |recs: &[Record]| {
            recs.iter()
                .filter(|r| r.tgid == me && r.tid == me && r.object == Object::CharFd(1, 3))
                .count()
        };
        let before = nulls(&it.files().unwrap());
        let copies: Vec<std::fs::File> = (0..FD_RECORDS + 10)
            .map(|_| null.try_clone().unwrap())
            .collect();
        let recs = it.files().unwrap();
        assert!(
            nulls(&recs) <= before + 1,
            "{} copies of /dev/null: {} records, {before} before",
            copies.len(),
            nulls(&recs)
        );
        assert!(
            !recs
                .iter()
                .any(|r| r.tgid == me && matches!(r.object, Object::Pending(_))),
            "one record: nothing pending"
        );
        drop(copies);
        // Alternating /dev/null and /dev/zero: no record repeats the one
        // before.
        let many: Vec<std::fs::File> = (0..FD_RECORDS + 10)
            .map(|i| {
                std::fs::File::open(if i % 2 == 0 { "/dev/null" } else { "/dev/zero" }).unwrap()
            })
            .collect();
        let fds: std::collections::BTreeSet<i32> = many.iter().map(|f| f.as_raw_fd()).collect();
        let recs = it.files().unwrap();
        let pending: Vec<&Record> = recs
            .iter()
            .filter(|r| r.tgid == me && r.tid == me && matches!(r.object, Object::Pending(_)))
            .collect();
        assert_eq!(pending.len(), 1, "one pending record: {pending:?}");
        let mut seen: std::collections::BTreeMap<i32, Object> = recs
            .iter()
            .filter(|r| r.tgid == me && r.tid == me && matches!(r.object, Object::CharFd(..)))
            .map(|r| (r.fd, r.object))
            .collect();
        assert!(seen.len() <= FD_RECORDS as usize);
        let mut next = *pending[0];
        let mut passes = 0;
        loop {
            let Object::Pending(vaddr) = next.object else {
                unreachable!()
            };
            assert!(
                next.fd >= 0,
                "the table stopped, not the mappings: {next:?}"
            );
            let more = it.resume(&Pass::resume(me, next.fd, vaddr, 0)).unwrap();
            passes += 1;
            assert!(
                more.iter().all(|r| r.tid == me),
                "one thread only: {more:?}"
            );
            seen.extend(
                more.iter()
                    .filter(|r| matches!(r.object, Object::CharFd(..)))
                    .map(|r| (r.fd, r.object)),
            );
            match more.iter().find(|r| matches!(r.object, Object::Pending(_))) {
                Some(p) => next = *p,
                None => break,
            }
            assert!(passes < 10, "{passes} passes");
        }
        assert!(passes >= 1);
        // Every descriptor is written, or repeats the device of the record
        // before it: another test thread of this process may open
        // /dev/null or /dev/zero between two of ours, and a copy of the
        // device before is said once.
        for (i, f) in many.iter().enumerate() {
            let fd = f.as_raw_fd();
            if seen.contains_key(&fd) {
                continue;
            }
            let want = if i % 2 == 0 {
                Object::CharFd(1, 3)
            } else {
                Object::CharFd(1, 5)
            };
            assert_eq!(
                seen.range(..fd).next_back().map(|(_, o)| *o),
                Some(want),
                "fd {fd} of {} neither written nor a repeat of the record before ({} read)",
                fds.len(),
                fds.iter().filter(|f| seen.contains_key(f)).count()
            );
        }
        drop(many);
        // A deadline already past: a table is read up to its first clock
        // check (CLOCK_EVERY batches, 1,024 slots) and says where it
        // stopped; a task whose table ends before that is read whole (a
        // deadline never cuts the many small tasks that come late).
        let copies: Vec<std::fs::File> = (0..2000).map(|_| null.try_clone().unwrap()).collect();
        let late = it
            .pass(&Pass {
                deadline_ns: 1,
                ..Pass::default()
            })
            .unwrap();
        let mine: Vec<&Record> = late.iter().filter(|r| r.tgid == me).collect();
        assert!(
            mine.iter()
                .any(|r| r.tid == me && r.object == Object::Pending(0) && r.fd == CLOCK_EVERY),
            "{mine:?}"
        );
        assert!(
            mine.iter()
                .any(|r| r.tid == me && r.object == Object::CharFd(1, 3)),
            "read up to the clock check: {mine:?}"
        );
        // Any other task stopped has a table past the first clock check
        // (`FDSize:`, its max_fds, above 1,024 slots).
        let fd_size = |tid: i32| {
            std::fs::read_to_string(format!("/proc/{tid}/status"))
                .ok()
                .and_then(|s| {
                    s.lines()
                        .find_map(|l| l.strip_prefix("FDSize:"))
                        .and_then(|v| v.trim().parse::<i32>().ok())
                })
        };
        for r in late
            .iter()
            .filter(|r| r.tgid != me && matches!(r.object, Object::Pending(_)))
        {
            if let Some(n) = fd_size(r.tid) {
                assert!(
                    n > 8 * CLOCK_EVERY,
                    "pid {} with {n} slots stopped: {r:?}",
                    r.tid
                );
            }
        }
        drop(copies);
        // Two shares of the machine: each task in exactly one.
        let halves: Vec<Vec<Record>> = (0..2)
            .map(|share| {
                it.pass(&Pass {
                    shares: 2,
                    share,
                    ..Pass::default()
                })
                .unwrap()
            })
            .collect();
        let mine_in = |h: &Vec<Record>| h.iter().any(|r| r.tgid == me);
        assert!(mine_in(&halves[me as usize % 2]) && !mine_in(&halves[1 - me as usize % 2]));
        // SAFETY: unmaps and closes what this test made.
        unsafe {
            libc::munmap(zmap, 4096);
            if rmap != libc::MAP_FAILED {
                libc::munmap(rmap, 4096);
            }
            if bmap != libc::MAP_FAILED {
                libc::munmap(bmap, 4096);
            }
            if bare >= 0 {
                libc::close(bare as i32);
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
            vm_start: field(0, 8, false),
            private_data: field(200, 8, true),
            ring_nr: Some(1024),
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
        let got = insn_hash(&fdtable_program(&synthetic_layout(), 7, 8).unwrap());
        assert_eq!(got, RECORDED, "{got:?}");
    }
    const RECORDED: (usize, u64) = (970, 1279765977476487771);
}
