//! The fd-table program as it was before further passes (pin
//! `iter_fdtable_v1`), frozen here for the benchmarks that measure it side
//! by side with today's ([`gpufence_cgroup::iter::fdtable::fdtable_program`]):
//! no copy of a descriptor dropped, a table of more than [`FD_RECORDS`]
//! records cut there with one "not read whole" record (kind 9), after
//! which its process was walked in `/proc`. Written with the cgroup
//! crate's public assembler and iterator API; the product never compiles
//! it.

use std::collections::BTreeSet;
use std::mem::offset_of;

use gpufence_cgroup::asm::{AluOp, Asm, AsmError, Helper, JmpOp, Program, Reg, Size};
use gpufence_cgroup::fp_slot;
use gpufence_cgroup::iter::fdtable::{FdTableLayout, FD_RECORDS};
use gpufence_cgroup::iter::{
    self, load_seq, off, probe_read, seq_write, size, zero_unknown, IterError, Loaded, RawRecord,
    Record, Seq, ANON_INODE_FS_MAGIC, KIND_ANON, KIND_ANON_MAP, KIND_CHAR, KIND_MAP, MAX_LOOPS,
    MINORBITS, RECORD_LEN, S_IFCHR, S_IFMT,
};
use gpufence_cgroup::uapi::helper;

/// Entries in the fence's `majors` map, as the compare's immediate.
const MAJORS_ENTRIES: i32 = gpufence_cgroup::maps::MAJORS_ENTRIES as i32;

/// The first program's pin name.
const PIN_V1: &str = "iter_fdtable_v1";

/// The first program's "table not read whole" record kind.
const KIND_TABLE_UNREAD_V1: i32 = 9;

/// A task's state, on the main frame's stack, which the `read_slots`
/// callback reads and fills.
#[repr(C)]
struct State {
    /// `fdt->fd`.
    table: u64,
    /// `ctx->meta->seq`.
    seq: u64,
    /// `tgid | tid << 32`: the record's first word.
    task: u64,
    /// Records written for this task.
    records: u64,
    /// Not read whole.
    more: u64,
}

/// The main frame (104 bytes), from `r10 - 104` up: the major looked up
/// (a `u32`), the name read, the vma iterator, the task's state, a
/// scratch word, the record.
#[repr(C)]
struct Frame {
    key: u64,
    name: [u8; 16],
    it: u64,
    state: State,
    tmp: u64,
    rec: RawRecord,
}

/// The callback's frame (120 bytes): the batch of slots read, the name
/// read, the major looked up, a scratch word, the record.
#[repr(C)]
struct CbFrame {
    batch: [u64; SLOTS as usize],
    name: [u8; 16],
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
const ST_TABLE: i16 = offset_of!(State, table) as i16;
const ST_SEQ: i16 = offset_of!(State, seq) as i16;
const ST_TASK: i16 = offset_of!(State, task) as i16;
const ST_RECORDS: i16 = offset_of!(State, records) as i16;
const ST_MORE: i16 = offset_of!(State, more) as i16;
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

/// In the main frame: writes `{ tgid, tid, fd, kind, r3 }` with
/// `bpf_seq_write(state.seq)` and goes on; `kind` is `r2` when `None`.
fn main_record(a: &mut Asm, kind: Option<i32>, fd: i32) {
    a.store(Size::DW, Reg::R10, REC + RawRecord::OFF_VALUE, Reg::R3);
    match kind {
        Some(k) => a.store_imm(Size::W, Reg::R10, REC + RawRecord::OFF_KIND, k),
        None => a.store(Size::W, Reg::R10, REC + RawRecord::OFF_KIND, Reg::R2),
    };
    a.store_imm(Size::W, Reg::R10, REC + RawRecord::OFF_FD, fd)
        .load(Size::DW, Reg::R1, Reg::R10, STATE + ST_TASK)
        .store(Size::DW, Reg::R10, REC + RawRecord::OFF_TGID, Reg::R1);
    let seq = Seq::Saved {
        base: Reg::R10,
        off: STATE + ST_SEQ,
    };
    seq_write(a, seq, REC, RECORD_LEN);
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
pub fn program(l: &FdTableLayout, majors_fd: i32) -> Result<Program, AsmError> {
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
        .comment("state = { -, seq, tgid | tid << 32, records 0, more 0 }");
    load_seq(a, Reg::R6, off(&l.meta_seq));
    a.store(Size::DW, Reg::R10, STATE + ST_SEQ, Reg::R1)
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
        .call_id(helper::LOOP, "loop")
        .load(Size::DW, Reg::R1, Reg::R10, STATE + ST_MORE)
        .jmp_imm(JmpOp::Eq, Reg::R1, 0, "vmas")
        .label("unread")
        .comment("rec = { tgid, tid, -1, TABLE_UNREAD, max_fds }")
        .load(size(&l.max_fds), Reg::R3, Reg::R9, off(&l.max_fds));
    main_record(a, Some(KIND_TABLE_UNREAD_V1), -1);
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
    main_record(a, Some(KIND_TABLE_UNREAD_V1), -1);
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

/// The first fd-table program, loaded and linked (not pinned).
#[derive(Debug)]
pub struct BaselineIterator {
    it: Loaded,
}

impl BaselineIterator {
    /// Loads [`program`] for `layout` and the fence's `majors` map.
    ///
    /// # Errors
    /// [`IterError`].
    pub fn load(
        layout: &FdTableLayout,
        majors: &gpufence_cgroup::maps::Map<gpufence_cgroup::maps::MajorsMap>,
    ) -> Result<BaselineIterator, IterError> {
        use std::os::fd::AsRawFd;
        Ok(BaselineIterator {
            it: iter::load_with_callback(
                &program(layout, majors.as_raw_fd())?,
                "gpufence_fdt1",
                "task",
                layout.task,
                ("fdtable", "read_slots"),
            )?,
        })
    }

    /// Pins the link in `dir` under the first program's name
    /// (`iter_fdtable_v1`), as its fence install did.
    ///
    /// # Errors
    /// [`IterError::Sys`].
    pub fn pin(&self, dir: &std::path::Path) -> Result<(), IterError> {
        iter::pin_link(self.it.link(), dir, PIN_V1)
    }

    /// Opens the link pinned by [`BaselineIterator::pin`], as its scans did.
    ///
    /// # Errors
    /// [`IterError::Sys`].
    pub fn open_pinned(dir: &std::path::Path) -> Result<BaselineIterator, IterError> {
        Ok(BaselineIterator {
            it: iter::open_pin(dir, PIN_V1)?,
        })
    }

    /// One walk of every task: its records, and the processes (tgids) it
    /// said it did not read whole.
    ///
    /// # Errors
    /// [`IterError`].
    pub fn files(&self) -> Result<(Vec<Record>, BTreeSet<i32>), IterError> {
        let raw = iter::read_raw(self.it.link())?;
        let mut recs = Vec::new();
        let mut unread = BTreeSet::new();
        for c in raw.chunks_exact(RECORD_LEN) {
            let Ok(b) = <&[u8; RECORD_LEN]>::try_from(c) else {
                continue;
            };
            let r = RawRecord::from_ne_bytes(b);
            if r.kind == KIND_TABLE_UNREAD_V1 {
                unread.insert(r.tgid);
            } else if let Some(r) = Record::decode(b) {
                recs.push(r);
            }
        }
        Ok((recs, unread))
    }
}

#[cfg(test)]
mod tests {
    use super::program;
    use gpufence_cgroup::btf::Field;
    use gpufence_cgroup::iter::fdtable::FdTableLayout;

    fn field(offset: u32, size: u32, is_ptr: bool) -> Field {
        Field {
            offset,
            size,
            is_ptr,
        }
    }

    /// The frozen program emits exactly the instructions it emitted in the
    /// cgroup crate, when this fingerprint was recorded: it stays the
    /// program the benchmarks compare against.
    #[test]
    fn the_first_program_keeps_its_bytes() {
        let l = FdTableLayout {
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
        };
        let got = program(&l, 7).unwrap().fingerprint();
        assert_eq!(got, (738, 18350818569060539144), "{got:?}");
    }
}
