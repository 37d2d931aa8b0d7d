//! The whole-machine snapshot from the kernel's iterators (pinned by the fence, or loaded per scan).

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::time::Instant;

use gpufence_cgroup::btf::Btf;
use gpufence_cgroup::iter::fdtable::{FdTableIterator, Pass};
use gpufence_cgroup::iter::{self, Iterators, Layout, Object, RingIterator, RingLayout};
use gpufence_model::device::DevNum;

use super::pids;

/// What the iterators said about one process (`task->tgid`).
#[derive(Clone, Debug, Default)]
pub(super) struct ProcRecords {
    /// Character devices in descriptor tables: (thread, fd, device); the
    /// thread is the process itself for its own (the leader's) table.
    pub(super) chars: Vec<(i32, i32, DevNum)>,
    /// Anonymous inodes in any of its tables (io_uring candidates): (the
    /// thread whose table holds it, `None` for the leader's; fd).
    pub(super) anon: Vec<(Option<i32>, i32)>,
    /// Socket inodes in any of its tables.
    pub(super) sockets: BTreeSet<u64>,
    /// Character devices it maps.
    pub(super) maps: BTreeSet<DevNum>,
    /// Character devices in rings its tasks registered: (thread, ring
    /// slot, device).
    pub(super) rings: Vec<(i32, i32, DevNum)>,
    /// Registered rings not read whole: (thread, ring slot, fixed files).
    pub(super) rings_unread: Vec<(i32, i32, u64)>,
    /// It maps anonymous inodes (io_uring rings among them).
    pub(super) anon_maps: bool,
    /// The inodes of the rings its tasks registered (read by the ring
    /// iterator).
    pub(super) ring_inos: BTreeSet<u64>,
    /// Its mappings could not be walked in the kernel (the mmap lock was
    /// busy pass after pass): its memory map is read in `/proc`.
    pub(super) maps_unread: bool,
    /// It was not read to its end within the scan's budget
    /// ([`Scanner::with_budget`]): what it holds beyond its records is
    /// unknown.
    pub(super) over_budget: bool,
}

/// One read of the machine by the iterators.
#[derive(Debug)]
pub(super) struct Snapshot {
    /// The pids `/proc` listed just before the iterators ran: a pid not
    /// among them started later and is walked in `/proc` instead.
    pub(super) listed: BTreeSet<i32>,
    pub(super) procs: HashMap<i32, ProcRecords>,
    /// Why registered rings could not be read, if so.
    pub(super) ring_error: Option<iter::IterError>,
    /// Read from the fence's pinned iterators.
    pub(super) pinned: bool,
    /// Further passes over tables and mappings stopped short (one per
    /// pending record, [`FdTableIterator::resume`]).
    pub(super) passes: usize,
}

/// Why no snapshot was taken: the reason the scan walks `/proc` instead
/// ([`Source::Proc`]).
#[derive(Debug, thiserror::Error)]
pub(super) enum SnapshotError {
    /// The scanner was told to walk `/proc` ([`Scanner::proc_walk`]): no
    /// failure, no reason to show.
    #[error("the /proc walk was asked for")]
    ProcWalkAsked,
    /// In a pid namespace other than the initial one: the iterators give
    /// global ids, which mean other processes here.
    #[error("not in the initial pid namespace (task ids are global ids)")]
    PidNamespace,
    /// The BTF could not be read or lacks something, or an iterator could
    /// not be loaded or read.
    #[error(transparent)]
    Iter(#[from] iter::IterError),
    /// The thread reading the mappings (`task_vma`) panicked.
    #[error("the task_vma reader panicked")]
    VmaReaderPanicked,
}

impl SnapshotError {
    /// The reason to show with [`Source::Proc`]: none when the walk was
    /// asked for.
    pub(super) fn reason(&self) -> Option<String> {
        match self {
            SnapshotError::ProcWalkAsked => None,
            e => Some(e.to_string()),
        }
    }
}

/// The descriptor tables' and mappings' readers of one snapshot.
pub(super) enum Readers {
    /// Loaded by this scan: every character device, anonymous inode (and
    /// socket) crosses to user space.
    Loaded(Iterators),
    /// The fence's pins: protected majors and io_uring rings only, tables
    /// and mappings in one walk.
    Pinned(FdTableIterator),
}

impl Readers {
    pub(super) fn files(&self) -> Result<Vec<iter::Record>, iter::IterError> {
        match self {
            Readers::Loaded(it) => it.files(),
            Readers::Pinned(t) => t.files(),
        }
    }
    pub(super) fn maps(&self) -> Result<Vec<iter::Record>, iter::IterError> {
        match self {
            Readers::Loaded(it) => it.maps(),
            // The fd-table walk wrote the mappings too.
            Readers::Pinned(_) => Ok(Vec::new()),
        }
    }
}

/// The iterators the fence pinned in `dir`, if all are there.
pub(super) fn open_pins(dir: &Path) -> Option<(Readers, RingIterator)> {
    Some((
        Readers::Pinned(FdTableIterator::open_pinned(dir).ok()?),
        RingIterator::open_pinned(dir).ok()?,
    ))
}

/// The most readers a pinned scan splits the tasks between.
const MAX_SHARES: usize = 16;

/// How many times a task whose mmap lock was busy is tried again before
/// its memory map is read in `/proc` instead.
const BUSY_TRIES: u32 = 3;

/// Below this many tasks (threads) and [`SPLIT_FROM_FILES`] open files on
/// the machine one reader walks them all: a thread costs more to start
/// than it saves (about 0.2 ms against a walk of about a millisecond).
const SPLIT_FROM_TASKS: usize = 2000;
/// See [`SPLIT_FROM_TASKS`].
const SPLIT_FROM_FILES: usize = 50_000;

/// The open files on the machine: the first field of
/// `/proc/sys/fs/file-nr` (allocated `struct file`s, `proc_nr_files` in
/// `fs/file_table.c`; copies of one descriptor share one); `usize::MAX`
/// when it cannot be read.
fn machine_files() -> usize {
    std::fs::read_to_string("/proc/sys/fs/file-nr")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|n| n.parse().ok()))
        .unwrap_or(usize::MAX)
}

/// The number of tasks (threads) on the machine: the denominator of the
/// fourth field of `/proc/loadavg` (`nr_threads`, `loadavg_proc_show` in
/// `fs/proc/loadavg.c`); `usize::MAX` when it cannot be read.
fn machine_tasks() -> usize {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(3)
                .and_then(|f| f.split_once('/'))
                .and_then(|(_, n)| n.parse().ok())
        })
        .unwrap_or(usize::MAX)
}

/// The readers a pinned scan splits the machine between: one per CPU
/// this process may use ([`reader_cpus`]) on a crowded machine, one
/// below [`SPLIT_FROM_TASKS`] tasks and [`SPLIT_FROM_FILES`] files.
pub(super) fn default_readers() -> usize {
    if machine_tasks() < SPLIT_FROM_TASKS && machine_files() < SPLIT_FROM_FILES {
        1
    } else {
        reader_cpus()
    }
}

/// The CPUs this process may run on (its affinity mask, as slurmd's
/// `TaskPlugin` and cgroup cpusets leave it; the cgroup's CPU quota
/// where there is one: `available_parallelism`), at most [`MAX_SHARES`].
pub(super) fn reader_cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, MAX_SHARES)
}

/// `CLOCK_MONOTONIC` nanoseconds at `at` (what `bpf_ktime_get_ns` reads;
/// `Instant` is `CLOCK_MONOTONIC` on Linux).
fn monotonic_ns(at: Instant) -> u64 {
    let now = Instant::now();
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime(2) into a timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    let now_ns = (ts.tv_sec as u64).saturating_mul(1_000_000_000) + ts.tv_nsec as u64;
    if at >= now {
        now_ns.saturating_add(at.duration_since(now).as_nanos() as u64)
    } else {
        now_ns
            .saturating_sub(now.duration_since(at).as_nanos() as u64)
            .max(1)
    }
}

/// The fd-table program's records for the whole machine: `cpus` readers
/// on a share of the tasks each (one: every task) and, beside them, the
/// ring iterator; then further passes over each task that stopped short,
/// one thread at a time, until none is left or `deadline` passes. A task
/// still pending then is listed in the second value (by tgid); one whose
/// mmap lock stayed busy in the third.
#[allow(clippy::type_complexity)]
fn read_pinned(
    t: &FdTableIterator,
    rings: Result<RingIterator, iter::IterError>,
    cpus: usize,
    deadline: Option<Instant>,
) -> Result<
    (
        Vec<iter::Record>,
        BTreeSet<i32>,
        BTreeSet<i32>,
        Result<Vec<iter::Record>, iter::IterError>,
        usize,
    ),
    SnapshotError,
> {
    let deadline_ns = deadline.map(monotonic_ns).unwrap_or(0);
    let shares = cpus.max(1) as u32;
    let pass = |share: u32| Pass {
        shares,
        share,
        deadline_ns,
        ..Pass::default()
    };
    let ring_read = |r: Result<RingIterator, iter::IterError>| r.and_then(|it| it.files());
    let (mut files, ring_files) = if shares == 1 {
        let f = t.pass(&pass(0))?;
        (f, ring_read(rings))
    } else {
        std::thread::scope(|s| {
            let others: Vec<_> = (1..shares)
                .map(|i| s.spawn(move || t.pass(&pass(i))))
                .collect();
            let ring = s.spawn(move || ring_read(rings));
            let mut f = t.pass(&pass(0))?;
            for h in others {
                f.extend(h.join().map_err(|_| SnapshotError::VmaReaderPanicked)??);
            }
            let r = ring.join().map_err(|_| SnapshotError::VmaReaderPanicked)?;
            Ok::<_, SnapshotError>((f, r))
        })?
    };
    // Further passes, one thread at a time, from where each stopped.
    let mut queue: Vec<iter::Record> = files
        .iter()
        .filter(|r| matches!(r.object, Object::Pending(_)))
        .cloned()
        .collect();
    files.retain(|r| !matches!(r.object, Object::Pending(_)));
    let (mut over, mut busy) = (BTreeSet::new(), BTreeSet::new());
    let mut tries: HashMap<i32, u32> = HashMap::new();
    let mut passes = 0;
    while let Some(p) = queue.pop() {
        let Object::Pending(vaddr) = p.object else {
            continue;
        };
        if deadline.is_some_and(|d| Instant::now() >= d) {
            over.insert(p.tgid);
            continue;
        }
        // The table read and the mappings where they were: the mmap lock
        // was busy (the iterator only tries it).
        if p.fd < 0 {
            let n = tries.entry(p.tid).or_default();
            *n += 1;
            if *n > BUSY_TRIES {
                busy.insert(p.tgid);
                continue;
            }
        }
        passes += 1;
        match t.resume(&Pass::resume(p.tid, p.fd, vaddr, deadline_ns)) {
            Ok(more) => {
                for r in more {
                    if matches!(r.object, Object::Pending(_)) {
                        // A pass that ends where it began (its control
                        // entry lost, a kernel that stops at once) would
                        // loop: not read, said so.
                        if r.tid == p.tid && r.fd == p.fd && r.object == p.object && p.fd >= 0 {
                            over.insert(p.tgid);
                        } else {
                            queue.push(r);
                        }
                    } else {
                        files.push(r);
                    }
                }
            }
            // The thread is gone: nothing of it to hold.
            Err(iter::IterError::Sys { err, .. }) if err.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok((files, over, busy, ring_files, passes))
}

/// Runs both iterators (and the ring iterator): those pinned in `pins`
/// (without sockets, protected majors only) where given and there,
/// otherwise loaded here. Any failure is the reason to walk `/proc`.
/// `deadline` bounds the pinned program's passes, `readers` splits them
/// (`None`: [`default_readers`]) ([`read_pinned`]).
pub(super) fn take_snapshot(
    btf_path: &Path,
    sockets: bool,
    list: bool,
    pins: Option<&Path>,
    deadline: Option<Instant>,
    readers: Option<usize>,
) -> Result<Snapshot, SnapshotError> {
    if !iter::in_initial_pid_ns() {
        return Err(SnapshotError::PidNamespace);
    }
    let pinned = pins.filter(|_| !sockets).and_then(open_pins);
    let was_pinned = pinned.is_some();
    let (it, rings) = match pinned {
        Some((it, rings)) => (it, Ok(rings)),
        None => {
            let btf = Btf::from_file(btf_path).map_err(iter::IterError::from)?;
            let layout = Layout::from_btf(&btf).map_err(iter::IterError::from)?;
            let it = Iterators::load(&layout, sockets)?;
            // Loaded (and verified) before any read, so that the three
            // reads follow each other closely.
            let rings = RingLayout::from_btf(&btf)
                .map_err(iter::IterError::from)
                .and_then(|l| RingIterator::load(&l));
            (Readers::Loaded(it), rings)
        }
    };
    let listed: BTreeSet<i32> = if list {
        pids().into_iter().collect()
    } else {
        BTreeSet::new()
    };
    let (files, maps, over, busy, ring_files, passes) = match &it {
        // One walk reads tables and mappings, split between the CPUs.
        Readers::Pinned(t) => {
            let (f, over, busy, r, passes) =
                read_pinned(t, rings, readers.unwrap_or_else(default_readers), deadline)?;
            (f, Vec::new(), over, busy, r, passes)
        }
        // The two walks are independent: one each on two CPUs.
        Readers::Loaded(_) => {
            let (files, maps) = std::thread::scope(|s| {
                let maps = s.spawn(|| it.maps());
                let files = it.files();
                (files, maps.join())
            });
            let files = files?;
            let maps = maps.map_err(|_| SnapshotError::VmaReaderPanicked)??;
            // Rings registered with IORING_REGISTER_RING_FDS (in no
            // descriptor table, maybe): read from the kernel where it can
            // be; where it cannot (no io_uring in the kernel, no
            // bpf_loop), the snapshot says why.
            let r = rings.and_then(|it| it.files());
            (files, maps, BTreeSet::new(), BTreeSet::new(), r, 0)
        }
    };
    let (rings, ring_error) = match ring_files {
        Ok(r) => (r, None),
        Err(e) => (Vec::new(), Some(e)),
    };
    let mut procs: HashMap<i32, ProcRecords> = HashMap::new();
    for pid in &over {
        procs.entry(*pid).or_default().over_budget = true;
    }
    for pid in &busy {
        procs.entry(*pid).or_default().maps_unread = true;
    }
    for r in files.into_iter().chain(maps).chain(rings) {
        let p = procs.entry(r.tgid).or_default();
        match r.object {
            Object::CharFd(ma, mi) => p.chars.push((r.tid, r.fd, DevNum::new(ma, mi))),
            Object::Socket(ino) => {
                p.sockets.insert(ino);
            }
            Object::AnonInode(_) => {
                p.anon.push(((r.tid != r.tgid).then_some(r.tid), r.fd));
            }
            Object::CharMap(ma, mi) => {
                p.maps.insert(DevNum::new(ma, mi));
            }
            Object::RingFile(ma, mi) => p.rings.push((r.tid, r.fd, DevNum::new(ma, mi))),
            Object::RingTruncated(n) => p.rings_unread.push((r.tid, r.fd, n)),
            Object::AnonMap(_) => p.anon_maps = true,
            Object::RingSeen(ino) => {
                p.ring_inos.insert(ino);
            }
            // Taken from the records above; never left in them.
            Object::Pending(_) => {}
        }
    }
    // A further pass reads the batch it stopped in again: once each.
    for p in procs.values_mut() {
        p.chars.sort_unstable();
        p.chars.dedup();
    }
    Ok(Snapshot {
        listed,
        procs,
        ring_error,
        pinned: was_pinned,
        passes,
    })
}
