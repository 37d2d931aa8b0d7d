//! What `/proc` shows of a process's holds: descriptors, threads' tables, mappings, io_uring rings and their registered files.

use std::cmp::Ordering;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Instant;

use gpufence_model::device::DevNum;

use super::{DevicePredicate, HeldFd, Holder, Scanner, Via};

pub(super) fn char_rdev(p: &Path) -> Option<DevNum> {
    match stat_cached(p)? {
        Cached::Char(d) => Some(d),
        _ => None,
    }
}

/// What [`stat_cached`] says of a file.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Cached {
    Char(DevNum),
    Socket(u64),
    /// A directory, symlink, block device or FIFO.
    Other,
    /// Anything else: a regular file or an anonymous inode (no type).
    Plain,
}

/// [`crate::host::procs::stat_cached`] of `p` (no round trip to a FUSE
/// or network file system; a device node's type and number never change,
/// so the cached attributes are the truth for what the walk asks), told
/// as the walk needs it. `None` when `statx` fails.
pub(super) fn stat_cached(p: &Path) -> Option<Cached> {
    let st = crate::host::procs::stat_cached(p, 0)?;
    Some(match u32::from(st.stx_mode) & libc::S_IFMT {
        libc::S_IFCHR => Cached::Char(DevNum::new(st.stx_rdev_major, st.stx_rdev_minor)),
        libc::S_IFSOCK => Cached::Socket(st.stx_ino),
        libc::S_IFDIR | libc::S_IFLNK | libc::S_IFBLK | libc::S_IFIFO => Cached::Other,
        _ => Cached::Plain,
    })
}

/// What one `stat` of a descriptor says: a character device, a socket (by
/// inode, as the kernel's socket tables name it), or something else.
pub(super) enum FdKind {
    Char(DevNum),
    Socket(u64),
    /// An anonymous inode (no file type: io_uring, eventfd, epoll, ...), a
    /// regular file (kernels may yet give anonymous inodes `S_IFREG`), or
    /// one `stat` could not read: worth a `readlink` for io_uring.
    Anon,
    Other,
}

pub(super) fn fd_kind(p: &Path) -> FdKind {
    match stat_cached(p) {
        Some(Cached::Char(d)) => FdKind::Char(d),
        Some(Cached::Socket(ino)) => FdKind::Socket(ino),
        Some(Cached::Other) => FdKind::Other,
        Some(Cached::Plain) | None => FdKind::Anon,
    }
}

/// `kcmp(a, b, KCMP_FILES)`: how task `a`'s descriptor table orders
/// against task `b`'s. `Equal`: one table, shared. The kernel orders
/// tables by their (obfuscated) addresses, a total order that holds until
/// reboot (`kernel/kcmp.c`, `kcmp_ptr`: 0 equal, 1 less, 2 greater).
/// `None` when the kernel cannot say (no kcmp, no permission, a task gone).
pub(super) fn kcmp_files(a: i32, b: i32) -> Option<Ordering> {
    const KCMP_FILES: libc::c_long = 2;
    // SAFETY: kcmp(2) compares kernel objects of two tasks; no memory is passed.
    let r = unsafe { libc::syscall(libc::SYS_kcmp, a, b, KCMP_FILES, 0, 0) };
    match r {
        0 => Some(Ordering::Equal),
        1 => Some(Ordering::Less),
        2 => Some(Ordering::Greater),
        _ => None,
    }
}

/// The descriptor tables a walk has read, one task named for each, in
/// `kcmp(2)`'s order: whether a thread's table is one already read costs
/// `log2(tables)` kcmp calls, not one per table read (a process of 4,000
/// private tables cost 8 million calls that way).
#[derive(Debug, Default)]
pub(super) struct Tables {
    sorted: Vec<i32>,
}

impl Tables {
    /// Tables holding the table of `first`, with no comparison made.
    pub(super) fn with(first: i32) -> Tables {
        Tables {
            sorted: vec![first],
        }
    }

    /// How many tables are held.
    pub(super) fn len(&self) -> usize {
        self.sorted.len()
    }

    /// Whether `tid`'s table is one held (`Some(true)`); if not, it is
    /// added (`Some(false)`). `None` when kcmp cannot say for some
    /// comparison (a task gone meanwhile): the caller reads the table
    /// (finding a hold twice is harmless: [`finish`] drops the copy).
    pub(super) fn seen_or_add(&mut self, tid: i32) -> Option<bool> {
        let (mut lo, mut hi) = (0usize, self.sorted.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match kcmp_files(self.sorted[mid], tid)? {
                Ordering::Equal => return Some(true),
                Ordering::Less => lo = mid + 1,
                Ordering::Greater => hi = mid,
            }
        }
        self.sorted.insert(lo, tid);
        Some(false)
    }
}

/// Where a walk of one process stops early: at a deadline (the walk is
/// then "not read whole", and says where), and, for a re-check that only
/// needs a yes, at the first hold found.
#[derive(Debug)]
pub(super) struct Stop {
    /// Past it, nothing more is read.
    pub(super) deadline: Instant,
    /// Stop at the first hold of a device sought.
    pub(super) first_hit: bool,
    /// A hold was found (with `first_hit`: the walk is done).
    pub(super) hit: bool,
    /// Why the walk was cut before reading the process whole.
    pub(super) cut: Option<String>,
}

impl Stop {
    pub(super) fn new(deadline: Instant, first_hit: bool) -> Stop {
        Stop {
            deadline,
            first_hit,
            hit: false,
            cut: None,
        }
    }

    /// Whether the walk must stop now: cut already, done (the first hold
    /// found), or the deadline passed (then cut, saying at `what`).
    pub(super) fn now(&mut self, what: impl FnOnce() -> String) -> bool {
        if self.cut.is_some() || (self.first_hit && self.hit) {
            return true;
        }
        if Instant::now() >= self.deadline {
            self.cut = Some(what());
            return true;
        }
        false
    }
}

impl Scanner {
    /// Rings kept alive by a mapping alone: their descriptor closed and
    /// not registered, the mapped rings hold the file (and an SQPOLL thread
    /// still runs what is written to them). A ring file cannot be opened
    /// again by path (`map_files` answers ENXIO for an anonymous inode), so
    /// their fixed files cannot be read: each `anon_inode:[io_uring]`
    /// mapping whose inode is not `known` (rings in the process's tables,
    /// rings its tasks registered) is taken to hold the devices
    /// [`Scanner::holders`] looks for (fail closed), or, in a scan for a
    /// predicate, listed in [`Scanner::unread_rings`] with slot -1.
    pub(super) fn mapped_rings(
        &mut self,
        maps: Option<&MapsView>,
        pid: i32,
        out: &mut Vec<HeldFd>,
        known: &BTreeSet<u64>,
    ) {
        let Some((_, maps)) = maps else {
            return;
        };
        let mut seen = known.clone();
        for line in maps.lines() {
            let mut it = line.split_whitespace();
            let (Some(_), _, _, _, Some(inode)) =
                (it.next(), it.next(), it.next(), it.next(), it.next())
            else {
                continue;
            };
            if it.collect::<Vec<_>>().join(" ") != "anon_inode:[io_uring]" {
                continue;
            }
            let Ok(ino) = inode.parse::<u64>() else {
                continue;
            };
            if !seen.insert(ino) {
                continue;
            }
            match &self.unread_means {
                Some(devs) => out.extend(devs.iter().map(|dev| HeldFd {
                    fd: -1,
                    path: PathBuf::from(format!(
                        "io_uring ring (inode {ino}) kept by a mapping alone: its files cannot be read"
                    )),
                    dev: *dev,
                    via: Via::IoUring,
                    tid: None,
                    unread: true,
                })),
                None => self.unread_rings.push((pid, pid, -1, 0)),
            }
        }
    }
}

/// A process's memory map: the `/proc` directory it was read in (whose
/// `map_files` and `fd` show the same process) and the text of `maps`.
pub(crate) type MapsView = (PathBuf, String);

/// The process's memory map (`maps`) and the directory whose `map_files`
/// resolve it: `base` (`/proc/<pid>`), or, when `base/maps` is empty
/// because the leader exited while other threads live, that of a live
/// thread ([`crate::host::procs::live_view_at`]): the leader's directory
/// reads the leader's mm, which is gone, while every thread shares the
/// process's. `None` when neither can be read. A `base` not named after
/// `pid` (a fixture tree) is read as it is.
pub(crate) fn read_maps(base: &Path, pid: i32) -> Option<MapsView> {
    let text = std::fs::read_to_string(base.join("maps")).ok();
    if text.as_deref().is_some_and(|t| !t.is_empty()) {
        return Some((base.to_path_buf(), text.unwrap_or_default()));
    }
    let root = base
        .parent()
        .filter(|_| base.file_name().and_then(|n| n.to_str()) == Some(&pid.to_string()))?;
    let view = crate::host::procs::live_view_at(root, pid);
    if view == base {
        return text.map(|t| (view, t));
    }
    let t = std::fs::read_to_string(view.join("maps")).ok()?;
    Some((view, t))
}

/// Drops the same hold seen through the main table and a thread sharing
/// it (or two threads sharing one table), then orders the holds.
pub(super) fn finish(pid: i32, mut fds: Vec<HeldFd>) -> Option<Holder> {
    let mut seen = BTreeSet::new();
    fds.retain(|f| seen.insert((f.fd, f.dev, f.via == Via::Mmap, f.via == Via::IoUring)));
    (!fds.is_empty()).then(|| {
        fds.sort_by_key(|f| (f.via, f.fd));
        Holder { pid, fds }
    })
}

/// What [`fd_table`] reads one table into, and when it stops.
pub(super) struct TableRead<'a> {
    /// Holds of the devices sought.
    pub(super) out: &'a mut Vec<HeldFd>,
    /// Socket inodes, when wanted.
    pub(super) sockets: Option<&'a mut BTreeSet<u64>>,
    /// Descriptors of anonymous inodes (maybe io_uring rings), when wanted.
    pub(super) anon: Option<&'a mut Vec<i32>>,
    /// The deadline and the first-hold rule, when the read is bounded.
    pub(super) stop: Option<&'a mut Stop>,
}

/// Reads the descriptor table `dir/fd` (a `/proc/<pid>` or
/// `/proc/<pid>/task/<tid>`): holds of devices `want` selects into
/// `into.out`, socket inodes into `into.sockets`, anonymous inodes (maybe
/// rings) into `into.anon` ([`TableRead`]). With a [`Stop`], it looks at the clock before each descriptor
/// (a `stat` each, some 14 µs: a table of 20,000 costs a quarter second)
/// and stops at its deadline, or at the first hold when that is all it
/// needs.
pub(super) fn fd_table(
    dir: &Path,
    want: DevicePredicate<'_>,
    via: Via,
    tid: Option<i32>,
    into: TableRead<'_>,
) {
    let TableRead {
        out,
        mut sockets,
        mut anon,
        mut stop,
    } = into;
    let Ok(rd) = std::fs::read_dir(dir.join("fd")) else {
        return;
    };
    for (n, e) in rd.flatten().enumerate() {
        if let Some(s) = stop.as_deref_mut() {
            if s.now(|| format!("{} read up to its descriptor {n}", dir.display())) {
                return;
            }
        }
        let Some(fd) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let p = e.path();
        match fd_kind(&p) {
            FdKind::Char(dev) if want(dev) => {
                if let Some(s) = stop.as_deref_mut() {
                    s.hit = true;
                }
                out.push(HeldFd {
                    fd,
                    path: std::fs::read_link(&p).unwrap_or_default(),
                    dev,
                    via,
                    tid,
                    unread: false,
                })
            }
            FdKind::Socket(ino) => {
                if let Some(s) = sockets.as_deref_mut() {
                    s.insert(ino);
                }
            }
            FdKind::Anon => {
                if let Some(a) = anon.as_deref_mut() {
                    a.push(fd);
                }
            }
            _ => {}
        }
    }
}

/// Files registered with an io_uring: the `UserFiles:` section of the
/// ring's fdinfo lists them as `<index>: <path>` (`io_uring_show_fdinfo`,
/// `io_uring/fdinfo.c`). Paths are resolved with `stat`. `candidates` are
/// anonymous inodes in the process's tables: (the thread whose own table
/// holds it, `None` for the leader's; fd). A ring kept only in a thread's
/// private table (after `unshare(CLONE_FILES)`) is read there
/// (`/proc/<pid>/task/<tid>/fd{,info}`). Returns the inodes of the rings
/// found in the tables.
pub(super) fn io_uring_files(
    base: &Path,
    want: DevicePredicate<'_>,
    out: &mut Vec<HeldFd>,
    candidates: &[(Option<i32>, i32)],
    mut stop: Option<&mut Stop>,
) -> BTreeSet<u64> {
    let mut rings = BTreeSet::new();
    for (n, &(tid, fd)) in candidates.iter().enumerate() {
        if let Some(s) = stop.as_deref_mut() {
            if s.now(|| format!("anonymous inodes read up to {n} of {}", candidates.len())) {
                break;
            }
        }
        let table = match tid {
            Some(t) => base.join("task").join(t.to_string()),
            None => base.to_path_buf(),
        };
        let link = table.join("fd").join(fd.to_string());
        let Ok(target) = std::fs::read_link(&link) else {
            continue;
        };
        if target.as_os_str() != "anon_inode:[io_uring]" {
            continue;
        }
        // The cached statx: the descriptor may have been swapped for a
        // FUSE file since the readlink.
        if let Some(st) = crate::host::procs::stat_cached(&link, 0) {
            rings.insert(st.stx_ino);
        }
        let Ok(info) = std::fs::read_to_string(table.join("fdinfo").join(fd.to_string())) else {
            continue;
        };
        for (path, dev) in ring_user_files(&info, want) {
            if let Some(s) = stop.as_deref_mut() {
                s.hit = true;
            }
            out.push(HeldFd {
                fd,
                path,
                dev,
                via: Via::IoUring,
                tid,
                unread: false,
            });
        }
    }
    rings
}

/// The `UserFiles:` of a ring's fdinfo text that are devices `want` selects.
pub(super) fn ring_user_files(info: &str, want: DevicePredicate<'_>) -> Vec<(PathBuf, DevNum)> {
    let mut out = Vec::new();
    let mut in_files = false;
    for line in info.lines() {
        if line.starts_with("UserFiles:") {
            in_files = true;
            continue;
        }
        if in_files {
            let Some((idx, path)) = line.trim_start().split_once(": ") else {
                in_files = false;
                continue;
            };
            if idx.bytes().any(|b| !b.is_ascii_digit()) {
                in_files = false;
                continue;
            }
            let path = path.trim();
            if let Some(dev) = char_rdev(Path::new(path)).filter(|d| want(*d)) {
                out.push((PathBuf::from(path), dev));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;

    /// The cached `statx` names what `stat` names: a character device
    /// (directly and through a `/proc/self/fd` magic link), a socket by
    /// its inode, a directory, a regular file; nothing for a missing path.
    #[test]
    fn the_cached_stat_tells_what_stat_tells() {
        let null = std::fs::File::open("/dev/null").unwrap();
        let want = Cached::Char(DevNum::new(1, 3));
        assert_eq!(stat_cached(Path::new("/dev/null")), Some(want));
        let link = PathBuf::from(format!("/proc/self/fd/{}", null.as_raw_fd()));
        assert_eq!(char_rdev(&link), Some(DevNum::new(1, 3)));
        let d = tempfile::tempdir().unwrap();
        let sock = std::os::unix::net::UnixListener::bind(d.path().join("s")).unwrap();
        let ino = std::fs::metadata(d.path().join("s")).unwrap().ino();
        assert_eq!(stat_cached(&d.path().join("s")), Some(Cached::Socket(ino)));
        let link = PathBuf::from(format!("/proc/self/fd/{}", sock.as_raw_fd()));
        assert!(matches!(fd_kind(&link), FdKind::Socket(_)));
        assert_eq!(stat_cached(d.path()), Some(Cached::Other));
        std::fs::write(d.path().join("f"), "x").unwrap();
        assert_eq!(stat_cached(&d.path().join("f")), Some(Cached::Plain));
        assert_eq!(char_rdev(&d.path().join("f")), None);
        assert_eq!(stat_cached(&d.path().join("missing")), None);
        assert!(matches!(fd_kind(&d.path().join("missing")), FdKind::Anon));
    }
}
