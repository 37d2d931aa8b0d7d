//! The fd-table program's instructions ([`fdtable_program`]): its stack
//! frames, the task's state and the reader's [`Pass`], the descriptor
//! table's walk (`bpf_loop` of `read_slots`) and the mappings' (the
//! open-coded vma iterator).

use std::mem::offset_of;

use super::{FdTableLayout, Pass, FD_RECORDS, MAJORS_ENTRIES};
use crate::asm::{AluOp, Asm, AsmError, Helper, JmpOp, Program, Reg, Size};
use crate::fp_slot;
use crate::iter::{
    load_seq, off, probe_read, seq_write, size, zero_unknown, RawRecord, Seq, ANON_INODE_FS_MAGIC,
    KIND_ANON, KIND_ANON_MAP, KIND_CHAR, KIND_MAP, KIND_PENDING, MAX_LOOPS, MINORBITS, RECORD_LEN,
    S_IFCHR, S_IFMT,
};
use crate::uapi::helper;

/// A task's state, on the main frame's stack; the `read_slots` callback
/// reads and fills it through its pointer.
#[repr(C)]
struct State {
    /// `fdt->fd`: the table of `struct file *`.
    table: u64,
    /// `ctx->meta->seq`.
    seq: u64,
    /// `tgid | tid << 32`: the record's first word.
    task: u64,
    /// Records written for this task.
    records: u64,
    /// Why the walk stopped: 1 records full, 2 the deadline (0: it did not).
    more: u64,
    /// The device of the record before (a copy of it is not written).
    last: u64,
    /// The batch of 8 slots the walk starts at.
    start: u64,
    /// The reader's deadline (`bpf_ktime_get_ns`; 0: none).
    deadline: u64,
    /// The batch a stopped walk resumes at.
    stop: u64,
}

/// The main frame (192 bytes), from `r10 - 192` up: the mappings' walk
/// (the last mapping's file, the loop's count, the current start, the ring
/// flag, the last device, the resume address), the reader's id, the
/// major looked up, the name read, the vma iterator, the task's state, a
/// scratch word, the record.
#[repr(C)]
struct Frame {
    vfile: u64,
    nloop: u64,
    vcur: u64,
    vanon: u64,
    vlast: u64,
    vstart: u64,
    ctl_key: u64,
    /// A `u32` key in its first bytes.
    key: u64,
    /// 11 bytes read: `[io_uring]\0`.
    name: [u8; 16],
    /// `struct bpf_iter_task_vma` (8 bytes, `kernel/bpf/task_iter.c`).
    it: u64,
    state: State,
    tmp: u64,
    rec: RawRecord,
}

/// The `read_slots` callback's frame (120 bytes): the batch of slots read,
/// the name read, the major looked up, a scratch word, the record.
#[repr(C)]
struct CbFrame {
    batch: [u64; SLOTS as usize],
    name: [u8; 16],
    /// A `u32` key in its first bytes.
    key: u64,
    tmp: u64,
    rec: RawRecord,
}

const REC: i16 = fp_slot!(Frame, rec);
const TMP: i16 = fp_slot!(Frame, tmp);
const STATE: i16 = fp_slot!(Frame, state);
const IT: i16 = fp_slot!(Frame, it);
const NAME: i16 = fp_slot!(Frame, name);
const KEY: i16 = fp_slot!(Frame, key);
const CTL_KEY: i16 = fp_slot!(Frame, ctl_key);
const VSTART: i16 = fp_slot!(Frame, vstart);
const VLAST: i16 = fp_slot!(Frame, vlast);
const VANON: i16 = fp_slot!(Frame, vanon);
const VCUR: i16 = fp_slot!(Frame, vcur);
const NLOOP: i16 = fp_slot!(Frame, nloop);
const VFILE: i16 = fp_slot!(Frame, vfile);
const ST_TABLE: i16 = offset_of!(State, table) as i16;
const ST_SEQ: i16 = offset_of!(State, seq) as i16;
const ST_TASK: i16 = offset_of!(State, task) as i16;
const ST_RECORDS: i16 = offset_of!(State, records) as i16;
const ST_MORE: i16 = offset_of!(State, more) as i16;
const ST_LAST: i16 = offset_of!(State, last) as i16;
const ST_START: i16 = offset_of!(State, start) as i16;
const ST_DEADLINE: i16 = offset_of!(State, deadline) as i16;
const ST_STOP: i16 = offset_of!(State, stop) as i16;
const CB_REC: i16 = fp_slot!(CbFrame, rec);
const CB_TMP: i16 = fp_slot!(CbFrame, tmp);
const CB_KEY: i16 = fp_slot!(CbFrame, key);
const CB_NAME: i16 = fp_slot!(CbFrame, name);
const CB_BATCH: i16 = fp_slot!(CbFrame, batch);
/// `ENOENT`: `bpf_iter_task_vma_new`'s answer for a task without memory.
const ENOENT: i32 = 2;

/// Slots read per callback: one `bpf_probe_read_kernel` of 64 bytes. A
/// table's `max_fds` is a multiple of `BITS_PER_LONG` (`alloc_fdtable`
/// in `fs/file.c` rounds it up), so a batch never reads past its array.
const SLOTS: i32 = 8;

/// The callback looks at the clock once per this many batches (1,024
/// slots, some 30 µs of reading): the deadline check costs one
/// `bpf_ktime_get_ns` per 1,024 descriptors.
pub(super) const CLOCK_EVERY: i32 = 128;

/// In the main frame: writes `{ tgid, tid, fd, kind, r3 }` with
/// `bpf_seq_write(state.seq)` and goes on; `kind` is `r2` when `None`.
fn main_record(a: &mut Asm, kind: Option<i32>, fd: i32) {
    a.store(Size::DW, Reg::R10, REC + RawRecord::OFF_VALUE, Reg::R3);
    match kind {
        Some(k) => a.store_imm(Size::W, Reg::R10, REC + RawRecord::OFF_KIND, k),
        None => a.store(Size::W, Reg::R10, REC + RawRecord::OFF_KIND, Reg::R2),
    };
    a.store_imm(Size::W, Reg::R10, REC + RawRecord::OFF_FD, fd);
    seq_write_main(a);
}

/// In the main frame: the record's task word, then `bpf_seq_write` of
/// the record.
fn seq_write_main(a: &mut Asm) {
    a.load(Size::DW, Reg::R1, Reg::R10, STATE + ST_TASK).store(
        Size::DW,
        Reg::R10,
        REC + RawRecord::OFF_TGID,
        Reg::R1,
    );
    let seq = Seq::Saved {
        base: Reg::R10,
        off: STATE + ST_SEQ,
    };
    seq_write(a, seq, REC, RECORD_LEN);
}

/// In the main frame: the task's [`Object::Pending`](crate::iter::Object::Pending)
/// record `{ tgid, tid, batch (fd), PENDING, vaddr }` (`batch` in `r4`,
/// `vaddr` in `r5`), then out.
fn pending_record(a: &mut Asm) {
    a.store(Size::DW, Reg::R10, REC + RawRecord::OFF_VALUE, Reg::R5)
        .store_imm(Size::W, Reg::R10, REC + RawRecord::OFF_KIND, KIND_PENDING)
        .store(Size::W, Reg::R10, REC + RawRecord::OFF_FD, Reg::R4);
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
        .load(Size::W, Reg::R1, Reg::R0, Pass::OFF_SHARES)
        .jmp_imm(JmpOp::Le, Reg::R1, 1, "one")
        .load(size(&l.tgid), Reg::R2, Reg::R7, off(&l.tgid))
        .alu64_reg(AluOp::Mod, Reg::R2, Reg::R1)
        .load(Size::W, Reg::R3, Reg::R0, Pass::OFF_SHARE)
        .jmp_reg(JmpOp::Ne, Reg::R2, Reg::R3, "out")
        .label("one")
        .load(Size::DW, Reg::R1, Reg::R0, Pass::OFF_DEADLINE_NS)
        .store(Size::DW, Reg::R10, STATE + ST_DEADLINE, Reg::R1)
        .comment("a resumption: pass.tid only, its table from pass.batch, its mappings from pass.vaddr")
        .load(Size::W, Reg::R1, Reg::R0, Pass::OFF_TID)
        .jmp_imm(JmpOp::Eq, Reg::R1, 0, "state")
        .load(size(&l.pid), Reg::R2, Reg::R7, off(&l.pid))
        .jmp_reg(JmpOp::Ne, Reg::R1, Reg::R2, "out")
        .load(Size::W, Reg::R1, Reg::R0, Pass::OFF_BATCH)
        .store(Size::DW, Reg::R10, STATE + ST_START, Reg::R1)
        .load(Size::DW, Reg::R1, Reg::R0, Pass::OFF_VADDR)
        .store(Size::DW, Reg::R10, VSTART, Reg::R1)
        .label("state")
        .comment("r8 = task->files (NULL: an exiting task or a kernel thread's)")
        .load(Size::DW, Reg::R8, Reg::R7, off(&l.files))
        .jmp_imm(JmpOp::Eq, Reg::R8, 0, "out")
        .comment("state = { -, seq, tgid | tid << 32, records 0, more 0, last 0, .. }");
    load_seq(a, Reg::R6, off(&l.meta_seq));
    a.store(Size::DW, Reg::R10, STATE + ST_SEQ, Reg::R1)
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
        .store(Size::DW, Reg::R10, CB_REC + RawRecord::OFF_VALUE, Reg::R3)
        .store(Size::W, Reg::R10, CB_REC + RawRecord::OFF_KIND, Reg::R2)
        .mov64_reg(Reg::R1, Reg::R9)
        .alu64_imm(AluOp::Add, Reg::R1, k)
        .store(Size::W, Reg::R10, CB_REC + RawRecord::OFF_FD, Reg::R1)
        .load(Size::DW, Reg::R1, Reg::R6, ST_TASK)
        .store(Size::DW, Reg::R10, CB_REC + RawRecord::OFF_TGID, Reg::R1);
    let seq = Seq::Saved {
        base: Reg::R6,
        off: ST_SEQ,
    };
    seq_write(a, seq, CB_REC, RECORD_LEN);
}

#[cfg(test)]
mod bytes {
    use super::super::FdTableLayout;
    use super::fdtable_program;
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
