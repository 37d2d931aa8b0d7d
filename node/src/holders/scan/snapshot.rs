//! The whole-machine snapshot from the kernel's iterators (pinned by the fence, or loaded per scan).

use super::*;

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
    /// A descriptor table of it was not read whole in the kernel
    /// ([`Object::TableUnread`]): read it in `/proc`.
    pub(super) table_unread: bool,
}

/// One read of the machine by the iterators.
#[derive(Debug)]
pub(super) struct Snapshot {
    /// The pids `/proc` listed just before the iterators ran: a pid not
    /// among them started later and is walked in `/proc` instead.
    pub(super) listed: BTreeSet<i32>,
    pub(super) procs: HashMap<i32, ProcRecords>,
    /// Why registered rings could not be read, if so.
    pub(super) ring_error: Option<String>,
    /// Read from the fence's pinned iterators.
    pub(super) pinned: bool,
}

/// Why no snapshot was taken: the reason the scan walks `/proc` instead
/// ([`Source::Proc`]).
#[derive(Debug, thiserror::Error)]
pub(super) enum SnapshotError {
    /// The scanner was told to walk `/proc` ([`Scanner::proc_walk`],
    /// [`set_proc_only`]): no failure, no reason to show.
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

/// Runs both iterators (and the ring iterator): those pinned in `pins`
/// (without sockets, protected majors only) where given and there,
/// otherwise loaded here. Any failure is the reason to walk `/proc`.
pub(super) fn take_snapshot(
    btf_path: &Path,
    sockets: bool,
    list: bool,
    pins: Option<&Path>,
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
                .map_err(|e| e.to_string())
                .and_then(|l| RingIterator::load(&l).map_err(|e| e.to_string()));
            (Readers::Loaded(it), rings)
        }
    };
    let listed: BTreeSet<i32> = if list {
        pids().into_iter().collect()
    } else {
        BTreeSet::new()
    };
    let (files, maps) = match &it {
        // One walk reads tables and mappings.
        Readers::Pinned(_) => (it.files(), Ok(Ok(Vec::new()))),
        // The two walks are independent: one each on two CPUs.
        Readers::Loaded(_) => std::thread::scope(|s| {
            let maps = s.spawn(|| it.maps());
            let files = it.files();
            (files, maps.join())
        }),
    };
    let files = files?;
    let maps = maps.map_err(|_| SnapshotError::VmaReaderPanicked)??;
    // Rings registered with IORING_REGISTER_RING_FDS (in no descriptor
    // table, maybe): read from the kernel where it can be; where it cannot
    // (no io_uring in the kernel, no bpf_loop), the snapshot says why.
    let (rings, ring_error) = match rings.and_then(|it| it.files().map_err(|e| e.to_string())) {
        Ok(r) => (r, None),
        Err(e) => (Vec::new(), Some(e)),
    };
    let mut procs: HashMap<i32, ProcRecords> = HashMap::new();
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
            Object::TableUnread(_) => p.table_unread = true,
        }
    }
    Ok(Snapshot {
        listed,
        procs,
        ring_error,
        pinned: was_pinned,
    })
}
