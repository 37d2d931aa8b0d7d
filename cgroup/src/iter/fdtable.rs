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

use std::mem::{offset_of, size_of};
use std::os::fd::OwnedFd;
use std::path::Path;

mod program;

pub use program::fdtable_program;

use crate::btf::{Btf, BtfError, Field};
use crate::iter::{self, sized, IterError, Loaded, Record};

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

/// Where the program finds what it reads, from the running kernel's BTF
/// ([`FdTableLayout::from_btf`]). Public for programs built outside this
/// crate on the same facts (the benchmark's frozen first program).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FdTableLayout {
    /// BTF id of `bpf_iter_task` (the `attach_btf_id`).
    pub task: u32,
    /// BTF id of the kfunc `bpf_rdonly_cast` (6.2+, `kernel/bpf/helpers.c`).
    pub rdonly_cast: u32,
    /// BTF id of `struct file`.
    pub file: u32,
    /// BTF id of the open-coded vma iterator's kfunc
    /// `bpf_iter_task_vma_new` (6.7+, `kernel/bpf/task_iter.c`).
    pub vma_new: u32,
    /// `bpf_iter_task_vma_next`'s.
    pub vma_next: u32,
    /// `bpf_iter_task_vma_destroy`'s.
    pub vma_destroy: u32,
    /// `vm_area_struct.vm_start`: where a resumed walk of the mappings
    /// starts.
    pub vm_start: Field,
    /// `file.private_data`: a ring's `struct io_ring_ctx`.
    pub private_data: Field,
    /// The offset of a ring's count of fixed files in its context
    /// ([`crate::iter::FileTable`]); `None` (no io_uring in the kernel):
    /// every ring is written.
    pub ring_nr: Option<i32>,
    /// `bpf_iter__task.task` (`kernel/bpf/task_iter.c`).
    pub ctx_task: Field,
    /// `bpf_iter_meta.seq` (`include/linux/bpf.h`).
    pub meta_seq: Field,
    /// `task_struct.tgid` (`include/linux/sched.h`).
    pub tgid: Field,
    /// `task_struct.pid`.
    pub pid: Field,
    /// `task_struct.files`.
    pub files: Field,
    /// `task_struct.group_leader`.
    pub group_leader: Field,
    /// `task_struct.mm`.
    pub mm: Field,
    /// `vm_area_struct.vm_file` (`include/linux/mm_types.h`).
    pub vm_file: Field,
    /// `files_struct.fdt` (`include/linux/fdtable.h`).
    pub fdt: Field,
    /// `fdtable.max_fds`.
    pub max_fds: Field,
    /// `fdtable.fd`: the array of `struct file *`.
    pub fd: Field,
    /// `file.f_inode` (`include/linux/fs.h`).
    pub f_inode: Field,
    /// `inode.i_mode`.
    pub i_mode: Field,
    /// `inode.i_rdev`.
    pub i_rdev: Field,
    /// `inode.i_ino`.
    pub i_ino: Field,
    /// `inode.i_sb`.
    pub i_sb: Field,
    /// `super_block.s_magic`.
    pub s_magic: Field,
    /// `file->f_path.dentry`: the offset of a pointer inside a member
    /// struct.
    pub f_path_dentry: i16,
    /// `dentry->d_name.name`, likewise.
    pub d_name_name: i16,
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

/// One reader's pass over the fd-table program: which tasks it reads
/// and by when. Written into the program's control map under the reading
/// thread's id for the length of one read, then removed: the map's value
/// is this struct's 32 bytes in native byte order, which the program reads
/// at its members' offsets (`offset_of!`).
#[repr(C)]
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

    /// Offset of `shares` in the control map's value.
    const OFF_SHARES: i16 = offset_of!(Pass, shares) as i16;
    /// Offset of `share`.
    const OFF_SHARE: i16 = offset_of!(Pass, share) as i16;
    /// Offset of `tid`.
    const OFF_TID: i16 = offset_of!(Pass, tid) as i16;
    /// Offset of `batch`.
    const OFF_BATCH: i16 = offset_of!(Pass, batch) as i16;
    /// Offset of `vaddr`.
    const OFF_VADDR: i16 = offset_of!(Pass, vaddr) as i16;
    /// Offset of `deadline_ns`.
    const OFF_DEADLINE_NS: i16 = offset_of!(Pass, deadline_ns) as i16;

    /// The control map's value: each member at its offset.
    fn bytes(&self) -> [u8; PASS_LEN] {
        let mut b = [0u8; PASS_LEN];
        let mut put = |at: i16, w: &[u8]| {
            let at = at as usize;
            b[at..at + w.len()].copy_from_slice(w);
        };
        put(Self::OFF_SHARES, &self.shares.to_ne_bytes());
        put(Self::OFF_SHARE, &self.share.to_ne_bytes());
        put(Self::OFF_TID, &self.tid.to_ne_bytes());
        put(Self::OFF_BATCH, &self.batch.to_ne_bytes());
        put(Self::OFF_VADDR, &self.vaddr.to_ne_bytes());
        put(Self::OFF_DEADLINE_NS, &self.deadline_ns.to_ne_bytes());
        b
    }
}

/// Bytes of the control map's value: one [`Pass`].
const PASS_LEN: usize = size_of::<Pass>();

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
            crate::uapi::map_type::HASH,
            size_of::<u64>() as u32,
            PASS_LEN as u32,
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
                && shape.key_size as usize == size_of::<u64>()
                && shape.value_size as usize == PASS_LEN
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
    use super::program::CLOCK_EVERY;
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

    /// The control map is a plain hash: full of the entries of readers
    /// that are gone (killed before they removed theirs), a read is
    /// refused room (`E2BIG`), removes those entries and is written; an
    /// LRU map would instead have dropped one entry, whoever's, a live
    /// reader's included, and kept the dead ones.
    #[test]
    fn a_full_control_map_loses_gone_readers_not_live_ones() {
        let Some(l) = layout() else { return };
        let it = FdTableIterator::load(&l, &majors(&[1])).unwrap_or_else(|e| panic!("{e}"));
        let _null = std::fs::File::open("/dev/null").unwrap();
        // Keys of threads that do not exist: tgid 0 is never a process.
        for tid in 1..=u64::from(CTL_ENTRIES) {
            crate::sys::map_update(
                &it.ctl,
                &tid.to_ne_bytes(),
                &Pass::resume(0, 0, 0, 0).bytes(),
            )
            .unwrap();
        }
        let me = std::process::id() as i32;
        let recs = it.files().unwrap_or_else(|e| panic!("{e}"));
        assert!(
            recs.iter().any(|r| r.tgid == me),
            "this process's /dev/null"
        );
        assert_eq!(
            crate::sys::map_keys(&it.ctl).unwrap().len(),
            0,
            "the gone readers' entries are removed, and this reader's after its read"
        );
    }
}
