//! Every open file and every device mapping on the machine in one read:
//! the BPF iterator programs (`kernel/bpf/task_iter.c`) of the scans that
//! look for processes holding a device (`gpufence_node::holders::scan`):
//! `task_file` and `task_vma` below, the io_uring rings' fixed files
//! ([`RingIterator`]), and the one task iterator that reads a whole descriptor
//! table and memory map per task, in bounded passes ([`fdtable`]).
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

use crate::asm::{AluOp, Asm, AsmError, JmpOp, Reg, Size};
use crate::btf::{Btf, BtfError, Field};
use crate::uapi::helper;

pub mod fdtable;
mod links;
mod record;
mod ring;
mod task;

pub(crate) use links::read_all;
pub use links::{load_with_callback, open_pin, pin_link, read_raw, Loaded, PINS, PIN_RINGS};
pub use record::{
    load_seq, seq_write, Object, RawRecord, Record, Seq, KIND_ANON, KIND_ANON_MAP, KIND_CHAR,
    KIND_MAP, RECORD_LEN,
};
pub(crate) use record::{KIND_PENDING, KIND_RING, KIND_RING_SEEN, KIND_RING_TRUNC, KIND_SOCK};
pub use ring::{ring_program, FileTable, RingIterator, RingLayout};
pub use task::{file_program, vma_program, Iterators, Layout};

/// `ANON_INODE_FS_MAGIC` (`include/uapi/linux/magic.h`): the superblock of
/// anonymous inodes. io_uring's rings are made with
/// `anon_inode_create_getfile` on `anon_inode_mnt` (`io_uring/io_uring.c`,
/// `fs/anon_inodes.c`), so every ring is on it.
pub const ANON_INODE_FS_MAGIC: u64 = 0x0904_1934;
/// `S_IFMT` (`include/uapi/linux/stat.h`).
pub const S_IFMT: i32 = 0o170000;
/// `S_IFCHR`.
pub const S_IFCHR: i32 = 0o020000;
/// `S_IFSOCK`.
const S_IFSOCK: i32 = 0o140000;
/// `PROC_PID_INIT_INO` (`include/linux/proc_ns.h`): the inode of the
/// initial pid namespace in `/proc/<pid>/ns/pid`.
const PROC_PID_INIT_INO: u64 = 0xEFFF_FFFC;
/// `MINORBITS` (`include/linux/kdev_t.h`): a kernel `dev_t` is
/// `major << 20 | minor`.
pub const MINORBITS: u32 = 20;

/// How many character-device records the ring iterator writes for one
/// registered ring (a run of one device is one record); a ring with more
/// says so ([`Object::RingTruncated`]). What one program run writes must
/// fit the iterator's buffer (`bpf_seq_read`: 8 pages, else `E2BIG`,
/// `kernel/bpf/bpf_iter.c`): 16 rings of 66 records of 24 bytes do.
pub const RING_RECORDS: i32 = 64;
/// `BPF_MAX_LOOPS` (`kernel/bpf/bpf_iter.c`).
pub const MAX_LOOPS: i32 = 1 << 23;
/// `IO_RINGFD_REG_MAX` (`include/linux/io_uring_types.h`): the registered
/// ring slots of a task.
const RING_FDS: usize = 16;
/// Flag bits kept in the low bits of a fixed file's `file_ptr`
/// (`FFS_NOWAIT`, `FFS_ISREG`, and in 5.18-6.6 `FFS_SCM`:
/// `io_uring/filetable.h`); a `struct file` is at least 8-byte aligned.
const FFS_FLAGS: i32 = 7;

/// Member `m` of struct `s` in `btf`, checked to be `size` bytes and a
/// pointer or not (`ptr`), at an offset a load's 16-bit offset reaches.
///
/// # Errors
/// [`BtfError`]: missing, or of another size or kind.
pub fn sized(btf: &Btf, s: &str, m: &str, size: u32, ptr: bool) -> Result<Field, BtfError> {
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

/// `f`'s offset as a load's offset ([`sized`] checked that it fits).
pub fn off(f: &Field) -> i16 {
    // sized() checked the range.
    f.offset as i16
}

/// The load width of `f` (1, 2, 4 bytes, else 8).
pub fn size(f: &Field) -> Size {
    match f.size {
        1 => Size::B,
        2 => Size::H,
        4 => Size::W,
        _ => Size::DW,
    }
}

/// `r0 = bpf_probe_read_kernel(fp+tmp, bytes, r3)`; on failure goto
/// `fail`; else `dst = *(size *)(fp+tmp)`.
pub fn probe_read(a: &mut Asm, tmp: i16, size: Size, bytes: i32, dst: Reg, fail: &str) {
    a.store_imm(Size::DW, Reg::R10, tmp, 0)
        .mov64_reg(Reg::R1, Reg::R10)
        .alu64_imm(AluOp::Add, Reg::R1, tmp as i32)
        .mov64_imm(Reg::R2, bytes)
        .call_id(helper::PROBE_READ_KERNEL, "probe_read_kernel")
        .jmp_imm(JmpOp::Ne, Reg::R0, 0, fail)
        .load(size, dst, Reg::R10, tmp);
}

/// `*(u64 *)(fp + slot) = 0`, as a value the verifier does not know (read
/// back with `bpf_probe_read_kernel` from the scratch word at `fp + tmp`):
/// a counter a loop compares and adds to then stays imprecise, and the
/// loop is verified in a few passes, not once per value.
pub fn zero_unknown(a: &mut Asm, tmp: i16, slot: i16, fail: &str) {
    a.store_imm(Size::DW, Reg::R10, tmp, 0)
        .mov64_reg(Reg::R3, Reg::R10)
        .alu64_imm(AluOp::Add, Reg::R3, tmp as i32);
    probe_read(a, tmp, Size::DW, 8, Reg::R1, fail);
    a.store(Size::DW, Reg::R10, slot, Reg::R1);
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

/// Whether this process is in the initial pid namespace, where
/// `task->tgid` is the number `/proc` shows. `false` when it cannot tell.
pub fn in_initial_pid_ns() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").is_ok_and(|m| m.ino() == PROC_PID_INIT_INO)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::asm::Program;

    /// [`Program::fingerprint`]: the programs' fingerprint tests.
    pub(crate) fn insn_hash(p: &Program) -> (usize, u64) {
        p.fingerprint()
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
        b[12..16].copy_from_slice(&KIND_PENDING.to_ne_bytes());
        assert_eq!(Record::decode(&b).unwrap().object, Object::Pending(12345));
        // 9 was the first fd-table program's "not read whole".
        b[12..16].copy_from_slice(&9i32.to_ne_bytes());
        assert_eq!(Record::decode(&b), None);
        b[12..16].copy_from_slice(&11i32.to_ne_bytes());
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
            assert_eq!(r, 1, "{}", io::Error::last_os_error());
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
