//! The ring iterator: a `task` iterator that follows each task's
//! registered io_uring rings to their fixed files ([`RingLayout`],
//! [`ring_program`], [`RingIterator`]).

use super::links::{load_with_callback, open_pin, pin_link, read_all, Loaded};
use super::{
    load_seq, off, probe_read, seq_write, size, sized, zero_unknown, IterError, RawRecord, Record,
    Seq, FFS_FLAGS, KIND_RING, KIND_RING_SEEN, KIND_RING_TRUNC, MAX_LOOPS, PIN_RINGS, RECORD_LEN,
    RING_FDS, RING_RECORDS, S_IFCHR, S_IFMT,
};
use crate::asm::{AluOp, Asm, AsmError, JmpOp, Program, Reg, Size};
use crate::btf::{Btf, BtfError, Field};
use crate::fp_slot;
use crate::uapi::helper;

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
    pub(super) ctx_task: Field,
    pub(super) meta_seq: Field,
    pub(super) tgid: Field,
    pub(super) pid: Field,
    pub(super) io_uring: Field,
    pub(super) rings: Field,
    pub(super) private_data: Field,
    pub(super) file_inode: Field,
    pub(super) i_ino: Field,
    pub(super) f_inode: i32,
    pub(super) i_mode: i32,
    pub(super) i_rdev: i32,
    pub(crate) table: FileTable,
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

/// The state the `read_file` callback reads and fills, on the main
/// frame's stack.
#[repr(C)]
struct State {
    /// The ring's table of fixed files (or of their nodes).
    table: u64,
    /// `ctx->meta->seq`.
    seq: u64,
    /// `tgid | tid << 32`: the record's first word.
    task: u64,
    /// The registered ring slot read.
    slot: u64,
    /// The last device written (a run of one device is one record).
    last: u64,
    /// Records written for this ring.
    records: u64,
    /// Not read whole.
    more: u64,
}

/// The ring program's main frame (96 bytes): the loop state, the ring's
/// count of fixed files, a scratch word, the record.
#[repr(C)]
struct Frame {
    state: State,
    nr: u64,
    tmp: u64,
    rec: RawRecord,
}

/// The callback's own frame (40 bytes): the file's inode, a scratch word,
/// the record.
#[repr(C)]
struct CbFrame {
    inode: u64,
    tmp: u64,
    rec: RawRecord,
}

const REC: i16 = fp_slot!(Frame, rec);
const RING_TMP: i16 = fp_slot!(Frame, tmp);
const RING_NR: i16 = fp_slot!(Frame, nr);
const STATE: i16 = fp_slot!(Frame, state);
const ST_TABLE: i16 = std::mem::offset_of!(State, table) as i16;
const ST_SEQ: i16 = std::mem::offset_of!(State, seq) as i16;
const ST_TASK: i16 = std::mem::offset_of!(State, task) as i16;
const ST_SLOT: i16 = std::mem::offset_of!(State, slot) as i16;
const ST_LAST: i16 = std::mem::offset_of!(State, last) as i16;
const ST_RECORDS: i16 = std::mem::offset_of!(State, records) as i16;
const ST_MORE: i16 = std::mem::offset_of!(State, more) as i16;
const CB_REC: i16 = fp_slot!(CbFrame, rec);
const CB_TMP: i16 = fp_slot!(CbFrame, tmp);
const CB_INODE: i16 = fp_slot!(CbFrame, inode);

/// In the ring program's main frame: writes the record `{ tgid, tid, slot,
/// kind, r3 }` of task `r7` with `bpf_seq_write(state.seq)`, and goes on.
fn emit_ring_record(a: &mut Asm, l: &RingLayout, kind: i32, slot: usize) {
    a.store(Size::DW, Reg::R10, REC + RawRecord::OFF_VALUE, Reg::R3)
        .store_imm(Size::W, Reg::R10, REC + RawRecord::OFF_KIND, kind)
        .store_imm(Size::W, Reg::R10, REC + RawRecord::OFF_FD, slot as i32)
        .load(size(&l.tgid), Reg::R2, Reg::R7, off(&l.tgid))
        .store(Size::W, Reg::R10, REC + RawRecord::OFF_TGID, Reg::R2)
        .load(size(&l.pid), Reg::R2, Reg::R7, off(&l.pid))
        .store(Size::W, Reg::R10, REC + RawRecord::OFF_TID, Reg::R2);
    let seq = Seq::Saved {
        base: Reg::R10,
        off: STATE + ST_SEQ,
    };
    seq_write(a, seq, REC, RECORD_LEN);
}

/// The ring program (`task` iterator): for each task with an io_uring
/// context, each of its 16 registered ring slots that holds a ring
/// (`io_uring->registered_rings[]`, which may be in no descriptor table),
/// every fixed file of that ring, walked with `bpf_loop` (a callback
/// verified once, whatever the ring's size): a record per run of one
/// character device, up to [`RING_RECORDS`], and an
/// [`Object::RingTruncated`](super::Object::RingTruncated) record for a ring not read whole. Ring
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
        .comment("state.seq = ctx->meta->seq; state.task = tgid | tid << 32");
    load_seq(a, Reg::R6, off(&l.meta_seq));
    a.store(Size::DW, Reg::R10, STATE + ST_SEQ, Reg::R1)
        .load(size(&l.pid), Reg::R1, Reg::R7, off(&l.pid))
        .alu64_imm(AluOp::Lsh, Reg::R1, 32)
        .load(size(&l.tgid), Reg::R2, Reg::R7, off(&l.tgid))
        .alu64_reg(AluOp::Or, Reg::R1, Reg::R2)
        .store(Size::DW, Reg::R10, STATE + ST_TASK, Reg::R1);
}

/// Registered ring slot `i` of the task: a [`Object::RingSeen`] record
/// for the ring, then its fixed files walked with `bpf_loop` of
/// `read_file`; a ring whose table cannot be read, or not read whole, gets
/// an [`Object::RingTruncated`](super::Object::RingTruncated) record.
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
        .call_id(helper::LOOP, "loop")
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
    .store(Size::DW, Reg::R10, CB_REC + RawRecord::OFF_VALUE, Reg::R3)
    .store_imm(Size::W, Reg::R10, CB_REC + RawRecord::OFF_KIND, KIND_RING)
    .load(Size::DW, Reg::R1, Reg::R6, ST_SLOT)
    .store(Size::W, Reg::R10, CB_REC + RawRecord::OFF_FD, Reg::R1)
    .load(Size::DW, Reg::R1, Reg::R6, ST_TASK)
    .store(Size::DW, Reg::R10, CB_REC + RawRecord::OFF_TGID, Reg::R1);
    let seq = Seq::Saved {
        base: Reg::R6,
        off: ST_SEQ,
    };
    seq_write(a, seq, CB_REC, RECORD_LEN);
    a.label("cb_next")
        .mov64_imm(Reg::R0, 0)
        .exit()
        .label("cb_full")
        .store_imm(Size::DW, Reg::R6, ST_MORE, 1)
        .mov64_imm(Reg::R0, 1)
        .exit();
}

/// The ring iterator ([`ring_program`]), loaded and linked; each
/// [`RingIterator::files`] call is a fresh walk of every task.
#[derive(Debug)]
pub struct RingIterator {
    it: Loaded,
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
