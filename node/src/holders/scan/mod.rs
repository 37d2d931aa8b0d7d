//! Who holds a device: a walk of every process, comparing the `st_rdev` of
//! what it holds with the devices sought. Paths are never compared: the same
//! device can have many nodes (a copy made with `mknod` elsewhere, a
//! container's `/dev`), and a descriptor passed over a unix socket keeps
//! working wherever it lands.
//!
//! A process can hold a device in more places than `/proc/<pid>/fd`:
//!
//! - the descriptor tables of its threads (`/proc/<pid>/task/<tid>/fd`): a
//!   thread that called `unshare(CLONE_FILES)` has its own table, and a
//!   process whose main thread exited (`pthread_exit`) shows an empty
//!   `/proc/<pid>/fd` while its other threads keep theirs;
//! - memory mappings (`/proc/<pid>/maps`, followed through
//!   `/proc/<pid>/map_files`): a mapping of `/dev/nvidia*` outlives `close()`;
//! - io_uring registered files (`/proc/<pid>/fdinfo/<ring fd>`, `UserFiles:`):
//!   a file registered with `IORING_REGISTER_FILES` and closed can be put
//!   back into the table later.
//!
//! What no walk can see: a descriptor in flight in a unix socket's queue
//! (sent, not yet received). It is found once a process receives it (the
//! next prolog's clean start, the sweep); see SECURITY.md.
//!
//! Whole-machine scans ([`Scanner::holders`], [`Scanner::holders_where`],
//! [`Scanner::process_fds`]) read every descriptor table and every mapping
//! in two reads of BPF iterators ([`gpufence_cgroup::iter`]: `task_file`,
//! `task_vma`), which report only character devices, anonymous inodes and
//! sockets; `/proc` is then read only for the processes they name (the
//! descriptor's path, `maps` for a device mapping, `fdinfo` of an
//! anonymous inode that is an io_uring). The results are the holds the
//! `/proc` walk finds: the same processes, descriptors and [`Via`] kinds.
//! Where the iterators cannot run (no BTF, no BPF iterator support, a
//! verifier refusal, no CAP_BPF, not in the initial pid namespace), or
//! fail midway, the scan walks `/proc` instead: never "no holders" for an
//! error. [`Scanner::source`] tells which it used.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpufence_cgroup::btf::VMLINUX_BTF;
use gpufence_model::device::DevNum;
use serde::Serialize;

mod proc_walk;
mod snapshot;
pub(crate) use proc_walk::read_maps;
use proc_walk::{char_rdev, fd_table, finish, io_uring_files, MapsView, Stop, TableRead, Tables};
use snapshot::{take_snapshot, ProcRecords, Snapshot, SnapshotError};

/// Where a device is held.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Via {
    /// The process's descriptor table.
    Fd,
    /// The descriptor table of one of its threads.
    ThreadFd,
    /// A memory mapping.
    Mmap,
    /// An io_uring registered file.
    IoUring,
    /// A file registered in an io_uring whose own descriptor the task
    /// registered (`IORING_REGISTER_RING_FDS`), read from the kernel by
    /// the ring iterator: the ring may be in no descriptor table. `fd` is
    /// the ring's registered slot.
    IoUringRegisteredRing,
}

/// One hold of a sought device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct HeldFd {
    /// The descriptor number (the ring's descriptor for io_uring; -1 for a mapping).
    pub fd: i32,
    /// Where it points, or the mapped file / registered file path.
    pub path: PathBuf,
    /// The device.
    pub dev: DevNum,
    /// Where it was found.
    pub via: Via,
    /// The thread, for [`Via::ThreadFd`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tid: Option<i32>,
    /// The device is assumed, not seen in `/proc`: a registered ring not
    /// read whole ([`Via::IoUringRegisteredRing`]), or a mapping the
    /// kernel's iterator saw that `/proc` no longer shows ([`Via::Mmap`]).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub unread: bool,
}

/// What [`Scanner::recheck`] found of one process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Recheck {
    /// It still holds a device sought: the first hold seen.
    Holds(HeldFd),
    /// Read whole: it holds none of them (any more).
    HoldsNone,
    /// Not read whole by the deadline, and no hold met in what was read:
    /// it may hold them (a caller takes it as holding: fail closed).
    Unread {
        /// Where the walk stopped.
        why: String,
    },
}

/// A walk of one process bounded by a deadline
/// ([`Scanner::holder_where_within`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bounded {
    /// The holds read before the deadline, if any.
    pub holder: Option<Holder>,
    /// Where the walk stopped, when it did not read the process whole:
    /// it may hold more than `holder` says.
    pub cut: Option<String>,
}

/// How many of the holds a scan saw [`Scanner::recheck`] looks at one by
/// one (a `stat` each) before it walks the process.
pub const RECHECK_SEEN: usize = 64;

/// A process holding at least one sought device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    /// The process.
    pub pid: i32,
    /// Its holds of sought devices.
    pub fds: Vec<HeldFd>,
}

impl Holder {
    /// The distinct devices held.
    pub fn devices(&self) -> BTreeSet<DevNum> {
        self.fds.iter().map(|f| f.dev).collect()
    }
}

/// A scan: remembers which mapped files are character devices, so that a
/// library mapped by every process is examined once, and (for
/// [`Scanner::process_fds`]) the iterators' snapshot of the machine.
#[derive(Debug)]
pub struct Scanner {
    mapped: HashMap<(String, u64), Option<DevNum>>,
    /// Where the BTF for the iterators is read from.
    btf: PathBuf,
    /// Walk `/proc` without trying the iterators.
    proc_only: bool,
    /// The snapshot [`Scanner::process_fds`] answers from, taken at its
    /// first call (`Err`: the iterators failed; walk `/proc`).
    snapshot: Option<Result<Snapshot, SnapshotError>>,
    source: Option<Source>,
    /// While [`Scanner::holders`] runs: the devices a registered ring that
    /// was not read whole is taken to hold (fail closed).
    unread_means: Option<BTreeSet<DevNum>>,
    /// Why the last snapshot could not read registered rings, if so.
    ring_error: Option<String>,
    /// Registered rings not read whole that a scan for a predicate (not a
    /// device set) met: (pid, thread, ring slot, fixed files).
    unread_rings: Vec<(i32, i32, i32, u64)>,
    /// The fence's bpffs directory, where its install pinned the scan
    /// iterators ([`gpufence_cgroup::iter::fdtable::PIN_FDTABLE`]).
    pins: Option<PathBuf>,
    /// The last whole-machine scan read the pinned iterators.
    read_pins: bool,
    /// How long a whole-machine scan of the pinned iterators may take
    /// ([`Scanner::with_budget`]).
    budget: Option<Duration>,
    /// Processes the last scan did not read to their end within its
    /// budget.
    over_budget: BTreeSet<i32>,
    /// How long the `/proc` walk of one process may take in
    /// [`Scanner::process_fds`] ([`Scanner::with_walk_budget`]).
    walk_budget: Option<Duration>,
    /// Further passes the last scan made over tables and mappings that
    /// one pass did not read whole.
    passes: usize,
    /// Readers a pinned scan splits the tasks between (`None`: one per
    /// CPU this process may use on a crowded machine,
    /// [`snapshot::default_readers`]).
    readers: Option<usize>,
}

impl Default for Scanner {
    fn default() -> Self {
        Scanner {
            mapped: HashMap::new(),
            btf: PathBuf::from(VMLINUX_BTF),
            proc_only: false,
            snapshot: None,
            source: None,
            unread_means: None,
            ring_error: None,
            unread_rings: Vec::new(),
            pins: None,
            read_pins: false,
            budget: None,
            over_budget: BTreeSet::new(),
            walk_budget: None,
            passes: 0,
            readers: None,
        }
    }
}

/// What a whole-machine scan read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// The BPF iterators, then `/proc` for the processes they named.
    Iterators,
    /// The `/proc` walk: asked for ([`Scanner::proc_walk`]), or the
    /// iterators failed (the reason).
    Proc(Option<String>),
}

/// Which devices a scan looks for.
pub type DevicePredicate<'a> = &'a dyn Fn(DevNum) -> bool;

/// One walk of one process: its holds of the devices sought and the inodes
/// of the sockets in its descriptor tables (both from the same `stat` of
/// each descriptor), for the sweep, which walks `/proc` once.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcessFds {
    /// Its holds of devices the predicate selected, if any.
    pub holder: Option<Holder>,
    /// Socket inodes (`socket:[N]`) in its descriptor tables.
    pub sockets: BTreeSet<u64>,
    /// Where a `/proc` walk bounded by [`Scanner::with_walk_budget`]
    /// stopped, when it did not read the process whole: it may hold more
    /// than `holder` says (fail closed: the caller reports it).
    pub cut: Option<String>,
}

impl Scanner {
    /// A fresh scan: the iterators first, `/proc` if they fail.
    pub fn new() -> Self {
        Self::default()
    }

    /// A scan that walks `/proc` only.
    pub fn proc_walk() -> Self {
        Scanner {
            proc_only: true,
            ..Self::default()
        }
    }

    /// A scan whose iterators read the kernel's BTF from `path` instead of
    /// `/sys/kernel/btf/vmlinux` (tests: a path that is not BTF of this
    /// kernel forces the fallback).
    pub fn with_btf(path: &Path) -> Self {
        Scanner {
            btf: path.to_path_buf(),
            ..Self::default()
        }
    }

    /// A scan that reads the iterators the fence pinned in `bpffs_dir`
    /// when it looks for devices the fence protects ([`Scanner::holders`]):
    /// no BTF parsed, no program loaded, and only protected devices and
    /// io_uring rings cross to user space. Anything else (no pins, a
    /// device on a major the fence does not protect, a predicate scan)
    /// loads its own iterators as [`Scanner::new`] does.
    pub fn with_pins(bpffs_dir: &Path) -> Self {
        Scanner {
            pins: Some(bpffs_dir.to_path_buf()),
            ..Self::default()
        }
    }

    /// A time budget for each whole-machine scan through the pinned
    /// iterators ([`Scanner::holders`]): the kernel's passes stop at it
    /// (each task's run looks at the clock), and what is not read to its
    /// end by then is listed in [`Scanner::over_budget`], never taken as
    /// "holds nothing" silently. What to do about those is the caller's
    /// (the response: [`crate::response::respond::uncovered`]).
    pub fn with_budget(mut self, budget: Duration) -> Self {
        self.budget = Some(budget);
        self
    }

    /// A time budget for each process [`Scanner::process_fds`] walks in
    /// `/proc` (every process when the iterators fail, a process the
    /// snapshot did not list otherwise): the walk stops at it (the clock
    /// is read before each descriptor, thread, mapping and ring), and the
    /// answer says where ([`ProcessFds::cut`]), never "holds nothing"
    /// for what it did not read. Without it the walk reads each process
    /// whole, however long that takes.
    pub fn with_walk_budget(mut self, per_process: Duration) -> Self {
        self.walk_budget = Some(per_process);
        self
    }

    /// Splits a pinned scan between `n` readers (threads; at least 1)
    /// instead of one per CPU this process may use: tests and benchmarks.
    pub fn with_readers(mut self, n: usize) -> Self {
        self.readers = Some(n.max(1));
        self
    }

    /// The processes (pids) the last scan could not read to their end
    /// within its budget: they may hold more than the scan says.
    pub fn over_budget(&self) -> &BTreeSet<i32> {
        &self.over_budget
    }

    /// How many further passes the last scan made over descriptor tables
    /// and mappings one pass did not read whole (more than
    /// [`gpufence_cgroup::iter::fdtable::FD_RECORDS`] records, a busy mmap lock).
    pub fn passes(&self) -> usize {
        self.passes
    }

    /// Whether the last whole-machine scan read the fence's pinned
    /// iterators ([`Scanner::with_pins`]).
    pub fn read_pins(&self) -> bool {
        self.read_pins
    }

    /// What the last whole-machine scan read (`None` before one).
    pub fn source(&self) -> Option<&Source> {
        self.source.as_ref()
    }

    /// Registered rings not read whole that scans for a predicate met
    /// ([`Scanner::process_fds`], the sweep): (pid, thread, ring slot,
    /// fixed files). They may hold any device; [`Scanner::holders`] takes
    /// them to hold the devices it looks for.
    pub fn unread_rings(&self) -> &[(i32, i32, i32, u64)] {
        &self.unread_rings
    }

    /// Why the last whole-machine scan could not read the rings tasks
    /// registered (`IORING_REGISTER_RING_FDS`): `None` when it read them
    /// (or before a scan). A `/proc` walk never can.
    pub fn ring_error(&self) -> Option<&str> {
        match self.source {
            Some(Source::Proc(_)) => Some("the /proc walk cannot see them"),
            _ => self.ring_error.as_deref(),
        }
    }

    /// Every process (other than this one) holding a device in `devs`.
    /// Processes that vanish during the walk are skipped.
    pub fn holders(&mut self, devs: &BTreeSet<DevNum>) -> Vec<Holder> {
        if devs.is_empty() {
            return Vec::new();
        }
        let want = |d: DevNum| devs.contains(&d);
        self.unread_means = Some(devs.clone());
        // The pinned iterators write protected majors only: read them when
        // every device sought is on one.
        let majors: Vec<u32> = devs.iter().map(|d| d.major).collect();
        let pins = self
            .pins
            .clone()
            .filter(|dir| gpufence_cgroup::Fence::majors_protected(dir, &majors).unwrap_or(false));
        let out = match self.holders_fast(&want, pins.as_deref()) {
            Ok(h) => {
                self.source = Some(Source::Iterators);
                h
            }
            Err(why) => {
                self.source = Some(Source::Proc(why.reason()));
                self.holders_proc_parallel(&want)
            }
        };
        self.unread_means = None;
        out
    }

    /// The whole machine through the iterators, or `Err(why)`.
    fn holders_fast(
        &mut self,
        want: DevicePredicate<'_>,
        pins: Option<&Path>,
    ) -> Result<Vec<Holder>, SnapshotError> {
        if self.proc_only {
            return Err(SnapshotError::ProcWalkAsked);
        }
        let deadline = self.budget.map(|b| Instant::now() + b);
        let snap = take_snapshot(&self.btf, false, false, pins, deadline, self.readers)?;
        self.read_pins = snap.pinned;
        self.passes = snap.passes;
        self.over_budget = snap
            .procs
            .iter()
            .filter(|(_, r)| r.over_budget)
            .map(|(p, _)| *p)
            .collect();
        self.ring_error = snap.ring_error.as_ref().map(ToString::to_string);
        let me = std::process::id() as i32;
        let mut out: Vec<Holder> = Vec::new();
        let mut pids: Vec<&i32> = snap.procs.keys().filter(|p| **p != me).collect();
        pids.sort();
        for pid in pids {
            let r = &snap.procs[pid];
            // Past the budget, a ring's fdinfo (one read each, a table may
            // hold thousands) is not read: that process is not read whole.
            let late = deadline.is_some_and(|d| Instant::now() >= d) && !r.anon.is_empty();
            let h = if late {
                self.over_budget.insert(*pid);
                let mut cut = r.clone();
                cut.anon.clear();
                self.holder_from_records(*pid, &cut, want)
            } else {
                self.holder_from_records(*pid, r, want)
            };
            if let Some(h) = h {
                out.push(h);
            }
        }
        Ok(out)
    }

    /// A process's holds from its records: `/proc` is read for the paths
    /// and, where the records show a device mapping or an anonymous inode,
    /// for `maps` and io_uring `fdinfo`, as the walk reads them.
    fn holder_from_records(
        &mut self,
        pid: i32,
        r: &ProcRecords,
        want: DevicePredicate<'_>,
    ) -> Option<Holder> {
        let hit_fd = r.chars.iter().any(|(_, _, d)| want(*d));
        let hit_map = r.maps.iter().any(|d| want(*d));
        let hit_ring = r.rings.iter().any(|(_, _, d)| want(*d));
        let unread = self
            .unread_means
            .clone()
            .filter(|_| !r.rings_unread.is_empty());
        if unread.is_none() {
            self.unread_rings.extend(
                r.rings_unread
                    .iter()
                    .map(|&(tid, slot, n)| (pid, tid, slot, n)),
            );
        }
        if !hit_fd
            && !hit_map
            && !hit_ring
            && unread.is_none()
            && r.anon.is_empty()
            && !r.anon_maps
            && !r.maps_unread
        {
            return None;
        }
        let base = PathBuf::from(format!("/proc/{pid}"));
        let mut fds = Vec::new();
        let mut chars: Vec<&(i32, i32, DevNum)> =
            r.chars.iter().filter(|(_, _, d)| want(*d)).collect();
        // The leader's table first, then threads by id, as the walk does.
        chars.sort_by_key(|(tid, fd, _)| (*tid != pid, *tid, *fd));
        for &&(tid, fd, dev) in &chars {
            let (path, via, t) = if tid == pid {
                (base.join("fd").join(fd.to_string()), Via::Fd, None)
            } else {
                (
                    base.join("task")
                        .join(tid.to_string())
                        .join("fd")
                        .join(fd.to_string()),
                    Via::ThreadFd,
                    Some(tid),
                )
            };
            fds.push(HeldFd {
                fd,
                path: std::fs::read_link(&path).unwrap_or_default(),
                dev,
                via,
                tid: t,
                unread: false,
            });
        }
        // Read once, for the mappings and the rings they keep (and where
        // the kernel could not walk them: its mmap lock stayed busy).
        let maps = (hit_map || r.anon_maps || r.maps_unread)
            .then(|| read_maps(&base, pid))
            .flatten();
        if r.maps_unread {
            self.mappings(maps.as_ref(), want, &mut fds, None);
        }
        if hit_map {
            self.mappings(maps.as_ref(), want, &mut fds, None);
            // The kernel saw the mapping; `/proc` may not show it (the
            // process unmapped it meanwhile, or hides it somewhere this
            // reader does not look): taken as held, never dropped.
            for &d in r.maps.iter().filter(|d| want(**d)) {
                if !fds.iter().any(|f| f.via == Via::Mmap && f.dev == d) {
                    fds.push(HeldFd {
                        fd: -1,
                        path: PathBuf::from(
                            "a mapping the kernel's iterator saw; /proc shows none",
                        ),
                        dev: d,
                        via: Via::Mmap,
                        tid: None,
                        unread: true,
                    });
                }
            }
        }
        let mut known = io_uring_files(&base, want, &mut fds, &r.anon, None);
        // A memory map the kernel could not walk may keep a ring alive
        // with no descriptor: looked for as where the kernel saw one.
        if r.anon_maps || r.maps_unread {
            known.extend(r.ring_inos.iter().copied());
            self.mapped_rings(maps.as_ref(), pid, &mut fds, &known);
        }
        for &(tid, slot, dev) in r.rings.iter().filter(|(_, _, d)| want(*d)) {
            fds.push(HeldFd {
                fd: slot,
                path: PathBuf::from(format!("io_uring registered ring {slot}")),
                dev,
                via: Via::IoUringRegisteredRing,
                tid: Some(tid),
                unread: false,
            });
        }
        // A registered ring not read whole may hold any of the devices
        // sought: fail closed (wherever its process is: a job's process
        // may hold another job's GPU in it).
        if let Some(devs) = &unread {
            for &(tid, slot, n) in &r.rings_unread {
                for dev in devs {
                    fds.push(HeldFd {
                        fd: slot,
                        path: PathBuf::from(format!(
                            "io_uring registered ring {slot}: {n} fixed files, not read whole"
                        )),
                        dev: *dev,
                        via: Via::IoUringRegisteredRing,
                        tid: Some(tid),
                        unread: true,
                    });
                }
            }
        }
        finish(pid, fds)
    }

    /// The holds of `pid` on devices in `devs`, if any.
    pub fn holder(&mut self, pid: i32, devs: &BTreeSet<DevNum>) -> Option<Holder> {
        self.holder_at(&PathBuf::from(format!("/proc/{pid}")), pid, devs)
    }

    /// [`Scanner::holder`] reading the process directory `base` (a
    /// `/proc/<pid>`, or a fixture tree of the same shape in tests).
    pub fn holder_at(&mut self, base: &Path, pid: i32, devs: &BTreeSet<DevNum>) -> Option<Holder> {
        self.walk(base, pid, &|d| devs.contains(&d), None, None)
    }

    /// Whether `pid` still holds one of `devs`, at a cost bounded by
    /// `deadline` whatever the number of its threads, tables and
    /// descriptors: the re-check before a response stops a process the
    /// scan found.
    ///
    /// First the holds the scan saw (`seen`, at most [`RECHECK_SEEN`] of
    /// them): a descriptor of the process's table or of one thread's
    /// (`/proc/<pid>/fd/<fd>`, `/proc/<pid>/task/<tid>/fd/<fd>`), one
    /// `stat` each, still on a device of `devs` answers
    /// [`Recheck::Holds`] at once. Otherwise a walk of `/proc/<pid>` as
    /// [`Scanner::holder`]'s, stopping at its first hold
    /// ([`Recheck::Holds`]) or at `deadline` ([`Recheck::Unread`]: the
    /// caller must take it as holding, fail closed); read whole with no
    /// hold, [`Recheck::HoldsNone`]. Past `deadline` on entry, only the
    /// seen holds are looked at.
    ///
    /// The kernel facts: `/proc/<pid>/task/<tid>/fd` shows that thread's
    /// own table (`fs/proc/base.c`, `tid_base_stuff`); a `stat` through
    /// the magic link is of the open file itself (`fs/proc/fd.c`).
    pub fn recheck(
        &mut self,
        pid: i32,
        seen: &[HeldFd],
        devs: &BTreeSet<DevNum>,
        deadline: Instant,
    ) -> Recheck {
        let base = PathBuf::from(format!("/proc/{pid}"));
        for f in seen.iter().take(RECHECK_SEEN) {
            if f.unread || f.fd < 0 {
                continue;
            }
            let path = match (f.via, f.tid) {
                (Via::Fd, _) => base.join("fd").join(f.fd.to_string()),
                (Via::ThreadFd, Some(tid)) => base
                    .join("task")
                    .join(tid.to_string())
                    .join("fd")
                    .join(f.fd.to_string()),
                _ => continue,
            };
            if char_rdev(&path).is_some_and(|d| devs.contains(&d)) {
                return Recheck::Holds(f.clone());
            }
        }
        let mut stop = Stop::new(deadline, true);
        let h = self.walk(&base, pid, &|d| devs.contains(&d), None, Some(&mut stop));
        match (h.and_then(|h| h.fds.into_iter().next()), stop.cut) {
            (Some(f), _) => Recheck::Holds(f),
            (None, Some(why)) => Recheck::Unread { why },
            (None, None) => Recheck::HoldsNone,
        }
    }

    /// [`Scanner::holder_where`] within `deadline`: the holds read by
    /// then, and, when the walk was cut before reading the process whole
    /// (its threads' tables, memory map and rings), where it stopped.
    /// The cost is bounded by `deadline` (the clock is read before each
    /// descriptor, thread, mapping and ring), whatever the process holds.
    pub fn holder_where_within(
        &mut self,
        pid: i32,
        want: DevicePredicate<'_>,
        deadline: Instant,
    ) -> Bounded {
        let mut stop = Stop::new(deadline, false);
        let holder = self.walk(
            &PathBuf::from(format!("/proc/{pid}")),
            pid,
            want,
            None,
            Some(&mut stop),
        );
        Bounded {
            holder,
            cut: stop.cut,
        }
    }

    /// Every process (other than this one) holding a device `want` selects
    /// (e.g. any device whose major is protected), in pid order.
    pub fn holders_where(&mut self, want: DevicePredicate<'_>) -> Vec<Holder> {
        match self.holders_fast(want, None) {
            Ok(h) => {
                self.source = Some(Source::Iterators);
                h
            }
            Err(why) => {
                self.source = Some(Source::Proc(why.reason()));
                self.holders_proc(want)
            }
        }
    }

    /// The `/proc` walk of every process.
    fn holders_proc(&mut self, want: DevicePredicate<'_>) -> Vec<Holder> {
        let me = std::process::id() as i32;
        let mut out: Vec<Holder> = pids()
            .into_iter()
            .filter(|p| *p != me)
            .filter_map(|pid| self.holder_where(pid, want))
            .collect();
        out.sort_by_key(|h| h.pid);
        out
    }

    /// [`Scanner::holders_proc`] split between two threads (the walk is
    /// system calls, and nodes have more than one CPU), for a predicate
    /// that can be shared.
    fn holders_proc_parallel(&mut self, want: &(dyn Fn(DevNum) -> bool + Sync)) -> Vec<Holder> {
        let me = std::process::id() as i32;
        let all: Vec<i32> = pids().into_iter().filter(|p| *p != me).collect();
        let (a, b) = all.split_at(all.len() / 2);
        let means = self.unread_means.clone();
        let mut out: Vec<Holder> = std::thread::scope(|s| {
            let other = s.spawn(move || {
                let mut sc = Scanner {
                    unread_means: means,
                    ..Scanner::proc_walk()
                };
                b.iter()
                    .filter_map(|pid| sc.holder_where(*pid, want))
                    .collect::<Vec<_>>()
            });
            let mut mine: Vec<Holder> = a
                .iter()
                .filter_map(|pid| self.holder_where(*pid, want))
                .collect();
            // A panic in the other half is a bug; walking that half again
            // here keeps the answer whole.
            match other.join() {
                Ok(h) => mine.extend(h),
                Err(_) => mine.extend(b.iter().filter_map(|pid| self.holder_where(*pid, want))),
            }
            mine
        });
        out.sort_by_key(|h| h.pid);
        out
    }

    /// The holds of `pid` on devices `want` selects, if any (a walk of its
    /// `/proc` directory).
    pub fn holder_where(&mut self, pid: i32, want: DevicePredicate<'_>) -> Option<Holder> {
        self.walk(
            &PathBuf::from(format!("/proc/{pid}")),
            pid,
            want,
            None,
            None,
        )
    }

    /// `pid`'s holds of devices `want` selects (descriptor tables of the
    /// process and its threads, mappings, io_uring files, as
    /// [`Scanner::holder`]) and the inodes of its sockets, for a pass over
    /// every process (the sweep).
    ///
    /// The first call takes one snapshot of the machine with the iterators;
    /// this and later calls answer from it, reading `/proc` only for
    /// processes it shows holding something `want` selects. A pid `/proc`
    /// did not list before the snapshot, or every pid when the iterators
    /// fail, is walked in `/proc` ([`Scanner::walk_process`]). Make a new
    /// scanner for a new pass.
    pub fn process_fds(&mut self, pid: i32, want: DevicePredicate<'_>) -> ProcessFds {
        if self.snapshot.is_none() {
            let s = if self.proc_only {
                Err(SnapshotError::ProcWalkAsked)
            } else {
                take_snapshot(&self.btf, true, true, None, None, None)
            };
            self.source = Some(match &s {
                Ok(_) => Source::Iterators,
                Err(why) => Source::Proc(why.reason()),
            });
            self.ring_error = match &s {
                Ok(snap) => snap.ring_error.as_ref().map(ToString::to_string),
                Err(_) => Some("the iterators did not run".into()),
            };
            self.snapshot = Some(s);
        }
        let snap = self.snapshot.take();
        let out = match &snap {
            Some(Ok(s)) if s.listed.contains(&pid) => match s.procs.get(&pid) {
                Some(r) => ProcessFds {
                    holder: self.holder_from_records(pid, r, want),
                    sockets: r.sockets.clone(),
                    cut: None,
                },
                None => ProcessFds::default(),
            },
            _ => match self.walk_budget {
                Some(b) => self.walk_process_within(pid, want, Instant::now() + b),
                None => self.walk_process(pid, want),
            },
        };
        self.snapshot = snap;
        out
    }

    /// [`Scanner::walk_process`] within `deadline`: what was read by
    /// then, and where the walk stopped when it did not read the process
    /// whole ([`ProcessFds::cut`]).
    pub fn walk_process_within(
        &mut self,
        pid: i32,
        want: DevicePredicate<'_>,
        deadline: Instant,
    ) -> ProcessFds {
        let mut sockets = BTreeSet::new();
        let mut stop = Stop::new(deadline, false);
        let base = PathBuf::from(format!("/proc/{pid}"));
        let holder = self.walk(&base, pid, want, Some(&mut sockets), Some(&mut stop));
        ProcessFds {
            holder,
            sockets,
            cut: stop.cut,
        }
    }

    /// One walk of `/proc/<pid>`: [`Scanner::process_fds`] without the
    /// iterators. Threads whose descriptor table is one already walked
    /// (`kcmp(2)` `KCMP_FILES`) are skipped, so a process of a thousand
    /// threads costs one table, not a thousand; the holds found are the same.
    pub fn walk_process(&mut self, pid: i32, want: DevicePredicate<'_>) -> ProcessFds {
        let mut sockets = BTreeSet::new();
        let base = PathBuf::from(format!("/proc/{pid}"));
        let holder = self.walk(&base, pid, want, Some(&mut sockets), None);
        ProcessFds {
            holder,
            sockets,
            cut: None,
        }
    }

    fn walk(
        &mut self,
        base: &Path,
        pid: i32,
        want: DevicePredicate<'_>,
        mut sockets: Option<&mut BTreeSet<u64>>,
        mut stop: Option<&mut Stop>,
    ) -> Option<Holder> {
        let base = base.to_path_buf();
        let mut fds = Vec::new();
        let mut anon = Vec::new();
        fd_table(
            &base,
            want,
            Via::Fd,
            None,
            TableRead {
                out: &mut fds,
                sockets: sockets.as_deref_mut(),
                anon: Some(&mut anon),
                stop: stop.as_deref_mut(),
            },
        );
        // Threads: only those whose table differs are worth a walk. Where
        // kcmp can tell, tables already walked are skipped (found in
        // kcmp's order: log2(tables) calls per thread); otherwise each is
        // walked and duplicates are dropped below.
        let mut walked = Tables::with(pid);
        let mut anon: Vec<(Option<i32>, i32)> = anon.into_iter().map(|fd| (None, fd)).collect();
        if let Ok(tasks) = std::fs::read_dir(base.join("task")) {
            for (n, t) in tasks.flatten().enumerate() {
                if let Some(s) = stop.as_deref_mut() {
                    if s.now(|| {
                        format!(
                            "threads read up to the {n}th ({} descriptor tables)",
                            walked.len()
                        )
                    }) {
                        break;
                    }
                }
                let Some(tid) = t.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                    continue;
                };
                if tid == pid {
                    continue;
                }
                if walked.seen_or_add(tid) == Some(true) {
                    continue;
                }
                let mut thread_anon = Vec::new();
                fd_table(
                    &t.path(),
                    want,
                    Via::ThreadFd,
                    Some(tid),
                    TableRead {
                        out: &mut fds,
                        sockets: sockets.as_deref_mut(),
                        anon: Some(&mut thread_anon),
                        stop: stop.as_deref_mut(),
                    },
                );
                anon.extend(thread_anon.into_iter().map(|fd| (Some(tid), fd)));
            }
        }
        if stop
            .as_deref_mut()
            .is_some_and(|s| s.now(|| "before the memory map".into()))
        {
            return finish(pid, fds);
        }
        // One read of the memory map, for the mappings and the rings.
        let maps = read_maps(&base, pid);
        self.mappings(maps.as_ref(), want, &mut fds, stop.as_deref_mut());
        // Only anonymous inodes can be rings: just those are readlinked.
        let known = io_uring_files(&base, want, &mut fds, &anon, stop.as_deref_mut());
        if stop.as_deref().is_some_and(|s| s.cut.is_some()) {
            // Rings kept by a mapping alone are told from those in the
            // tables, which were not all read: not judged from half.
            return finish(pid, fds);
        }
        self.mapped_rings(maps.as_ref(), pid, &mut fds, &known);
        finish(pid, fds)
    }

    /// The process's mappings of devices `want` selects, from its memory
    /// map resolved through `map_files` ([`read_maps`]: a live thread's
    /// view when the leader exited).
    fn mappings(
        &mut self,
        maps: Option<&MapsView>,
        want: DevicePredicate<'_>,
        out: &mut Vec<HeldFd>,
        mut stop: Option<&mut Stop>,
    ) {
        let Some((view, maps)) = maps else {
            return;
        };
        for (n, line) in maps.lines().enumerate() {
            if let Some(s) = stop.as_deref_mut() {
                if s.now(|| format!("the memory map read up to its line {n}")) {
                    return;
                }
            }
            // address perms offset dev inode path
            let mut it = line.split_whitespace();
            let (Some(range), _, _, Some(fsdev), Some(inode)) =
                (it.next(), it.next(), it.next(), it.next(), it.next())
            else {
                continue;
            };
            let path: String = it.collect::<Vec<_>>().join(" ");
            let Ok(ino) = inode.parse::<u64>() else {
                continue;
            };
            if ino == 0 || path.is_empty() || path.starts_with('[') {
                continue;
            }
            let key = (fsdev.to_string(), ino);
            let dev = match self.mapped.get(&key) {
                Some(d) => *d,
                None => {
                    let d = char_rdev(&view.join("map_files").join(range));
                    self.mapped.insert(key, d);
                    d
                }
            };
            if let Some(d) = dev.filter(|d| want(*d)) {
                if let Some(s) = stop.as_deref_mut() {
                    s.hit = true;
                }
                if !out.iter().any(|f| f.via == Via::Mmap && f.dev == d) {
                    out.push(HeldFd {
                        fd: -1,
                        path: PathBuf::from(path),
                        dev: d,
                        via: Via::Mmap,
                        tid: None,
                        unread: false,
                    });
                }
            }
        }
    }
}

/// What `/proc/sys/kernel/io_uring_disabled` says (Linux 6.6+,
/// `io_uring/io_uring.c`, Documentation/admin-guide/sysctl/kernel.rst):
/// 0 (or no such file: older kernels) every user may create rings, 1 only
/// members of `kernel.io_uring_group` and `CAP_SYS_ADMIN`, 2 nobody.
///
/// Returns a line for the admin when users may create rings: a ring's
/// registered files are known from its fdinfo by path only (rings in a
/// descriptor table), so a GPU file opened through a bind mount in a user
/// and mount namespace that is gone, and registered in a ring, is not
/// recognised (rings a task registered with `IORING_REGISTER_RING_FDS`
/// are read from the kernel by device number instead:
/// [`gpufence_cgroup::iter::RingIterator`]); `None` when io_uring is closed
/// to users.
pub fn io_uring_exposure(proc_sys: &Path) -> Option<String> {
    let disabled = std::fs::read_to_string(proc_sys.join("kernel/io_uring_disabled")).ok();
    let group = std::fs::read_to_string(proc_sys.join("kernel/io_uring_group")).ok();
    let how = match disabled.as_deref().map(str::trim) {
        Some("2") => return None,
        Some("1") => format!(
            "to members of group {} (kernel.io_uring_disabled = 1, kernel.io_uring_group = {})",
            group.as_deref().map_or("?", str::trim),
            group.as_deref().map_or("?", str::trim)
        ),
        Some(v) => format!("to every user (kernel.io_uring_disabled = {v})"),
        None => "to every user (this kernel has no kernel.io_uring_disabled)".to_string(),
    };
    Some(format!(
        "io_uring is open {how}: a ring's registered files are named by path only, so a GPU file opened through a bind mount in a user namespace that is gone and registered in a ring is not recognised; set kernel.io_uring_disabled = 2 (or 1 with a kernel.io_uring_group no job user is in) to close that"
    ))
}

/// The pids in `/proc` (processes, not threads), unsorted.
pub fn pids() -> Vec<i32> {
    let Ok(proc_dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    proc_dir
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()))
        .collect()
}

/// Every process (other than this one) holding a device in `devs`.
pub fn holders(devs: &BTreeSet<DevNum>) -> Vec<Holder> {
    Scanner::new().holders(devs)
}

/// The holds of `pid` on devices in `devs`, if any.
pub fn holder(pid: i32, devs: &BTreeSet<DevNum>) -> Option<Holder> {
    Scanner::new().holder(pid, devs)
}

/// Groups holders by device, for messages.
pub fn by_device(holders: &[Holder]) -> BTreeMap<DevNum, Vec<i32>> {
    let mut m: BTreeMap<DevNum, Vec<i32>> = BTreeMap::new();
    for h in holders {
        for d in h.devices() {
            m.entry(d).or_default().push(h.pid);
        }
    }
    m
}

#[cfg(test)]
mod io_uring_tests {
    use super::*;

    fn sys(disabled: Option<&str>, group: Option<&str>) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("kernel")).unwrap();
        if let Some(v) = disabled {
            std::fs::write(d.path().join("kernel/io_uring_disabled"), v).unwrap();
        }
        if let Some(g) = group {
            std::fs::write(d.path().join("kernel/io_uring_group"), g).unwrap();
        }
        d
    }

    #[test]
    fn io_uring_exposure_follows_the_sysctls() {
        let open = io_uring_exposure(sys(Some("0\n"), Some("-1\n")).path()).unwrap();
        assert!(
            open.contains("to every user (kernel.io_uring_disabled = 0)"),
            "{open}"
        );
        assert!(
            open.contains("kernel.io_uring_disabled = 2"),
            "names the fix: {open}"
        );
        let old = io_uring_exposure(sys(None, None).path()).unwrap();
        assert!(old.contains("has no kernel.io_uring_disabled"), "{old}");
        let group = io_uring_exposure(sys(Some("1\n"), Some("1234\n")).path()).unwrap();
        assert!(group.contains("to members of group 1234"), "{group}");
        assert_eq!(io_uring_exposure(sys(Some("2\n"), None).path()), None);
    }
}

#[cfg(test)]
mod tests {
    use super::proc_walk::kcmp_files;
    use super::*;
    use std::os::unix::fs::symlink;

    /// One walk of a live process (this one) finds its sockets by inode, as
    /// the kernel's TCP table names them, and its holds of devices a
    /// predicate selects; threads sharing the table add nothing.
    #[test]
    fn process_fds_finds_sockets_and_predicate_holds() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let null = std::fs::File::open("/dev/null").unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || rx.recv());
        let me = std::process::id() as i32;
        let f = Scanner::new().process_fds(me, &|d| d.major == 1 && d.minor == 3);
        let inode = procfs::process::Process::myself()
            .unwrap()
            .tcp()
            .unwrap()
            .into_iter()
            .find(|e| e.local_address.port() == port)
            .unwrap()
            .inode;
        assert!(f.sockets.contains(&inode), "{f:?}");
        let h = f.holder.expect("/dev/null is held");
        assert!(h.fds.iter().all(|x| x.dev == DevNum::new(1, 3)));
        assert!(h
            .fds
            .iter()
            .any(|x| x.via == Via::Fd && x.path == Path::new("/dev/null")));
        assert!(
            h.fds.iter().all(|x| x.via != Via::ThreadFd),
            "threads share the table: {h:?}"
        );
        assert!(Scanner::new().process_fds(me, &|_| false).holder.is_none());
        tx.send(()).unwrap();
        let _ = t.join();
        drop((l, null));
    }

    /// kcmp's order finds a thread's table among those read: threads
    /// sharing the leader's table are seen, each private table is added
    /// once, whatever order the threads come in.
    #[test]
    fn tables_are_told_apart_in_kcmp_order() {
        let (tx, rx) = std::sync::mpsc::channel::<i32>();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let stop_rx = std::sync::Arc::new(std::sync::Mutex::new(stop_rx));
        let mut joins = Vec::new();
        for private in [false, true, false, true, true] {
            let (tx, stop_rx) = (tx.clone(), stop_rx.clone());
            joins.push(std::thread::spawn(move || {
                // SAFETY: unshare of this thread's descriptor table only.
                if private && unsafe { libc::unshare(libc::CLONE_FILES) } != 0 {
                    return;
                }
                // SAFETY: gettid(2) takes nothing.
                let tid = unsafe { libc::syscall(libc::SYS_gettid) } as i32;
                let _ = tx.send(tid);
                let _ = stop_rx.lock().map(|r| r.recv());
            }));
        }
        let tids: Vec<i32> = (0..5).filter_map(|_| rx.recv().ok()).collect();
        let me = std::process::id() as i32;
        let mut t = Tables::with(me);
        let mut added = 0;
        for &tid in tids.iter().chain(tids.iter()) {
            if t.seen_or_add(tid) == Some(false) {
                added += 1;
            }
        }
        for _ in &joins {
            let _ = stop_tx.send(());
        }
        for j in joins {
            let _ = j.join();
        }
        if kcmp_files(me, me).is_none() {
            return; // no kcmp here: the walk reads every table
        }
        assert_eq!(tids.len(), 5);
        assert_eq!(added, 3, "three private tables, once each");
        assert_eq!(t.len(), 4);
    }

    /// A bounded re-check answers from the descriptor the scan saw (one
    /// `stat`), walks to its first hold otherwise, and past its deadline
    /// says "not read whole", never "holds none"; a holder walked within
    /// a deadline says where it was cut.
    #[test]
    fn rechecks_are_bounded_and_fail_closed() {
        let null = std::fs::File::open("/dev/null").unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&null);
        let me = std::process::id() as i32;
        let devs: BTreeSet<DevNum> = [DevNum::new(1, 3)].into();
        let seen = HeldFd {
            fd,
            path: PathBuf::from("/dev/null"),
            dev: DevNum::new(1, 3),
            via: Via::Fd,
            tid: None,
            unread: false,
        };
        let past = Instant::now();
        let later = Instant::now() + Duration::from_secs(60);
        // The seen descriptor answers even with no time left.
        assert!(matches!(
            Scanner::new().recheck(me, std::slice::from_ref(&seen), &devs, past),
            Recheck::Holds(f) if f.fd == fd
        ));
        // No seen hold: the walk finds one before its deadline.
        assert!(matches!(
            Scanner::new().recheck(me, &[], &devs, later),
            Recheck::Holds(f) if f.dev == DevNum::new(1, 3)
        ));
        // No time: not read, so not "holds none".
        assert!(matches!(
            Scanner::new().recheck(me, &[], &devs, past),
            Recheck::Unread { .. }
        ));
        // Read whole, a device nobody holds: holds none.
        let none: BTreeSet<DevNum> = [DevNum::new(1, 250)].into();
        assert_eq!(
            Scanner::new().recheck(me, std::slice::from_ref(&seen), &none, later),
            Recheck::HoldsNone
        );
        let want = |d: DevNum| d == DevNum::new(1, 3);
        let whole = Scanner::new().holder_where_within(me, &want, later);
        assert_eq!(whole.cut, None);
        assert!(whole
            .holder
            .is_some_and(|h| h.fds.iter().any(|f| f.fd == fd)));
        let cut = Scanner::new().holder_where_within(me, &want, past);
        assert!(cut.cut.is_some(), "{cut:?}");
        drop(null);
    }

    /// The sweep's bounded `/proc` walk: given time it reads the process
    /// whole (the hold and the sockets, nothing cut); past its deadline it
    /// says where it stopped, never "holds nothing" for what it skipped.
    #[test]
    fn a_bounded_process_walk_says_where_it_stopped() {
        let null = std::fs::File::open("/dev/null").unwrap();
        let me = std::process::id() as i32;
        let want = |d: DevNum| d == DevNum::new(1, 3);
        let whole = Scanner::proc_walk().walk_process_within(
            me,
            &want,
            Instant::now() + Duration::from_secs(60),
        );
        let fd = std::os::fd::AsRawFd::as_raw_fd(&null);
        assert_eq!(whole.cut, None);
        assert!(
            whole
                .holder
                .as_ref()
                .is_some_and(|h| h.fds.iter().any(|f| f.fd == fd)),
            "{whole:?}"
        );
        let cut = Scanner::proc_walk().walk_process_within(me, &want, Instant::now());
        assert!(cut.cut.is_some(), "{cut:?}");
        assert!(cut.holder.is_none(), "{cut:?}");
        let budgeted = Scanner::proc_walk()
            .with_walk_budget(Duration::ZERO)
            .process_fds(me, &want);
        assert!(budgeted.cut.is_some(), "{budgeted:?}");
        drop(null);
    }

    /// A fixture process directory: a mapping of /dev/null (1:3) shown in
    /// `maps` and followed through `map_files`, and an io_uring whose
    /// fdinfo lists /dev/null as a registered file. Live mappings of
    /// devices need a mappable character device, which test hosts lack
    /// (/dev/zero maps as shmem, /dev/mem is usually off); the kernel tests
    /// cover the live thread and io_uring cases.
    #[test]
    fn mappings_and_io_uring_files_from_proc_shapes() {
        let d = tempfile::tempdir().unwrap();
        let base = d.path();
        std::fs::create_dir_all(base.join("map_files")).unwrap();
        std::fs::create_dir_all(base.join("fd")).unwrap();
        std::fs::create_dir_all(base.join("fdinfo")).unwrap();
        std::fs::write(
            base.join("maps"),
            "55d0c0000000-55d0c0001000 r--p 00000000 fd:01 1234 /usr/bin/x\n\
             7f0000000000-7f0000001000 rw-s 00000000 00:05 4 /dev/null\n\
             7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]\n",
        )
        .unwrap();
        symlink(
            "/dev/null",
            base.join("map_files/7f0000000000-7f0000001000"),
        )
        .unwrap();
        symlink(
            "/etc/hostname",
            base.join("map_files/55d0c0000000-55d0c0001000"),
        )
        .unwrap();
        symlink("anon_inode:[io_uring]", base.join("fd/7")).unwrap();
        std::fs::write(
            base.join("fdinfo/7"),
            "pos:\t0\nflags:\t02000002\nSqMask:\t0x3\nUserFiles:\t2\n    0: /etc/hostname\n    1: /dev/null\nUserBufs:\t0\n",
        )
        .unwrap();
        let want: BTreeSet<DevNum> = [DevNum::new(1, 3)].into();
        let h = Scanner::new().holder_at(base, 42, &want).expect("found");
        let vias: Vec<Via> = h.fds.iter().map(|f| f.via).collect();
        assert_eq!(vias, vec![Via::Mmap, Via::IoUring], "{h:?}");
        assert_eq!(h.fds[1].fd, 7);
        assert_eq!(h.fds[0].path, PathBuf::from("/dev/null"));
        assert!(Scanner::new()
            .holder_at(base, 42, &[DevNum::new(1, 5)].into())
            .is_none());
    }
}
