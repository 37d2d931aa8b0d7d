//! The record every task iterator program writes, typed once for the
//! programs that write it and the reader that decodes it: [`RawRecord`]
//! (`#[repr(C)]`, 24 bytes, the emitters' store offsets derived from it),
//! what it says ([`Record`], [`Object`]), and the one `bpf_seq_write` tail
//! ([`seq_write`]) of every iterator program, the cgroup level iterator's
//! ([`crate::level`]) included.

use std::mem::{offset_of, size_of};

use super::MINORBITS;
use crate::asm::{AluOp, Asm, Reg, Size};
use crate::uapi::helper;

/// One record as the programs write it with `bpf_seq_write`, in native
/// byte order: `struct { u32 tgid; u32 tid; u32 fd; u32 kind; u64 value; }`.
/// The programs keep it at the end of their stack frame; its member
/// offsets ([`RawRecord::OFF_TGID`] ...) are where they store each word.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RawRecord {
    /// `task->tgid`.
    pub tgid: i32,
    /// `task->pid`.
    pub tid: i32,
    /// A descriptor number, a registered ring slot, or a batch to resume at
    /// ([`Object`] says which).
    pub fd: i32,
    /// What `value` is: one of the `KIND_*` words [`Record::decode`] knows.
    pub kind: i32,
    /// A `dev_t` (`major << 20 | minor`), an inode number, a count or an
    /// address, by `kind`.
    pub value: u64,
}

/// Bytes of one [`RawRecord`]: 24.
pub const RECORD_LEN: usize = size_of::<RawRecord>();
// What fits the iterator's buffer ([`RING_RECORDS`](super::RING_RECORDS),
// `FD_RECORDS`) was counted in records of 24 bytes.
const _: () = assert!(RECORD_LEN == 24);

/// The byte offset of `meta` in every iterator context
/// (`struct bpf_iter__task { meta; task; }`, `bpf_iter__task_file`,
/// `bpf_iter__task_vma`, `bpf_iter__cgroup`: `DEFINE_BPF_ITER_FUNC` in
/// `include/linux/bpf.h` puts `struct bpf_iter_meta *meta` first).
const CTX_META: i16 = 0;

impl RawRecord {
    /// Offset of `tgid`; a program that keeps the task as one word
    /// (`tgid | tid << 32`) stores it here as a `u64`, which puts `tid`
    /// at [`RawRecord::OFF_TID`] on the little-endian machines gpufence runs on.
    pub const OFF_TGID: i16 = offset_of!(RawRecord, tgid) as i16;
    /// Offset of `tid`.
    pub const OFF_TID: i16 = offset_of!(RawRecord, tid) as i16;
    /// Offset of `fd`.
    pub const OFF_FD: i16 = offset_of!(RawRecord, fd) as i16;
    /// Offset of `kind`.
    pub const OFF_KIND: i16 = offset_of!(RawRecord, kind) as i16;
    /// Offset of `value`.
    pub const OFF_VALUE: i16 = offset_of!(RawRecord, value) as i16;

    /// Reads one record's words in native byte order.
    pub fn from_ne_bytes(b: &[u8; RECORD_LEN]) -> RawRecord {
        RawRecord {
            tgid: i32::from_ne_bytes(bytes(b, Self::OFF_TGID)),
            tid: i32::from_ne_bytes(bytes(b, Self::OFF_TID)),
            fd: i32::from_ne_bytes(bytes(b, Self::OFF_FD)),
            kind: i32::from_ne_bytes(bytes(b, Self::OFF_KIND)),
            value: u64::from_ne_bytes(bytes(b, Self::OFF_VALUE)),
        }
    }
}

/// The `N` bytes at `at` of a record (offsets from [`RawRecord`]'s
/// layout: always inside it).
fn bytes<const N: usize>(b: &[u8; RECORD_LEN], at: i16) -> [u8; N] {
    let mut w = [0u8; N];
    let at = at as usize;
    w.copy_from_slice(&b[at..at + N]);
    w
}

/// Where a program finds the `struct seq_file *` that `bpf_seq_write`
/// writes to.
#[derive(Clone, Copy, Debug)]
pub enum Seq {
    /// `ctx->meta->seq`: the context in `ctx`; `meta_seq` is the offset of
    /// `seq` in `struct bpf_iter_meta` (from BTF).
    Ctx {
        /// The register holding the program's context.
        ctx: Reg,
        /// `bpf_iter_meta.seq`'s offset.
        meta_seq: i16,
    },
    /// A copy of it saved at `off` from `base` (a loop state's `seq`, on the
    /// main frame's stack or behind a callback's state pointer).
    Saved {
        /// `r10`, or the register holding the state's address.
        base: Reg,
        /// The saved word's offset from `base`.
        off: i16,
    },
}

/// `r1 = ctx->meta->seq`: the context in `ctx`, `meta_seq` the offset of
/// `seq` in `struct bpf_iter_meta`.
pub fn load_seq(a: &mut Asm, ctx: Reg, meta_seq: i16) {
    a.load(Size::DW, Reg::R1, ctx, CTX_META)
        .load(Size::DW, Reg::R1, Reg::R1, meta_seq);
}

/// The tail every iterator program writes a record with:
/// `bpf_seq_write(seq, fp + rec, len)` (`r1`..`r3`, the call clobbers
/// `r0`..`r5`). `rec` is the record's `r10`-relative slot, `len` its size
/// ([`RECORD_LEN`], or the level iterator's).
pub fn seq_write(a: &mut Asm, seq: Seq, rec: i16, len: usize) {
    match seq {
        Seq::Ctx { ctx, meta_seq } => load_seq(a, ctx, meta_seq),
        Seq::Saved { base, off } => {
            a.load(Size::DW, Reg::R1, base, off);
        }
    }
    a.mov64_reg(Reg::R2, Reg::R10)
        .alu64_imm(AluOp::Add, Reg::R2, i32::from(rec))
        .mov64_imm(Reg::R3, len as i32)
        .call_id(helper::SEQ_WRITE, "seq_write");
}

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
    /// [`RING_RECORDS`](super::RING_RECORDS) character-device records, or more fixed files than
    /// `bpf_loop` walks; the value is its number of fixed files. The
    /// record's `fd` is the ring's registered slot. What else the ring
    /// holds is unknown.
    RingTruncated(u64),
    /// A task whose run of the fd-table program stopped before its end
    /// (more than [`crate::iter::fdtable::FD_RECORDS`] records, more slots than
    /// one `bpf_loop` walks, its mmap lock busy, or the scan's deadline
    /// passed): where a further pass resumes
    /// ([`crate::iter::fdtable::FdTableIterator::resume`]). The record's `fd` is
    /// the batch of 8 slots to resume the descriptor table at (-1: the
    /// table is read), the value the address to resume the mappings at
    /// (`u64::MAX`: they are read).
    Pending(u64),
}

/// [`Object::CharFd`]'s kind word.
pub const KIND_CHAR: i32 = 1;
/// [`Object::Socket`]'s.
pub(crate) const KIND_SOCK: i32 = 2;
/// [`Object::AnonInode`]'s.
pub const KIND_ANON: i32 = 3;
/// [`Object::CharMap`]'s.
pub const KIND_MAP: i32 = 4;
/// [`Object::RingFile`]'s.
pub(crate) const KIND_RING: i32 = 5;
/// [`Object::RingTruncated`]'s.
pub(crate) const KIND_RING_TRUNC: i32 = 6;
/// [`Object::AnonMap`]'s.
pub const KIND_ANON_MAP: i32 = 7;
/// [`Object::RingSeen`]'s.
pub(crate) const KIND_RING_SEEN: i32 = 8;
/// [`Object::Pending`]'s. (9 was the first fd-table program's "not read
/// whole", which no program writes now.)
pub(crate) const KIND_PENDING: i32 = 10;
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
    /// Decodes one record ([`RawRecord`], native byte order), as
    /// [`file_program`](super::file_program), [`vma_program`](super::vma_program),
    /// the ring and the fd-table programs write it; `None` for a kind no
    /// program writes.
    pub fn decode(b: &[u8; RECORD_LEN]) -> Option<Record> {
        let raw = RawRecord::from_ne_bytes(b);
        let value = raw.value;
        let dev = || {
            (
                (value as u32) >> MINORBITS,
                (value as u32) & ((1 << MINORBITS) - 1),
            )
        };
        let object = match raw.kind {
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
            KIND_PENDING => Object::Pending(value),
            _ => return None,
        };
        Some(Record {
            tgid: raw.tgid,
            tid: raw.tid,
            fd: raw.fd,
            object,
        })
    }
}
