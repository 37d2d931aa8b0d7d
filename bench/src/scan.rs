//! Scans on a crowded node: the epilog's descriptor scan
//! ([`gpufence_node::holders::scan::holders`], what `gpufence-epilog` runs for a
//! job's devices) and a full `gpufence sweep` ([`gpufence_node::sweep::execute`]
//! without `--cgroup`: the whole machine), with N extra processes that each
//! hold 20 ordinary descriptors (8 of a regular file, 3 pipes, 2 socket
//! pairs, 2 of `/dev/null`), 5 of them also holding a protected node (a misc
//! device no process on the machine holds, claimed like the tests do, on a
//! major the bench's fence protects).
//!
//! Each run measures both ways of scanning, alternating: the default (BPF
//! iterators, [`gpufence_node::holders::scan::Source::Iterators`]) and the `/proc`
//! walk it falls back to ([`gpufence_node::holders::scan::Scanner::proc_walk`], and
//! [`gpufence_node::sweep::SweepRequest::proc_walk`] for the sweep), and
//! checks that both found the same holders.
//!
//! The extra processes are forked from this one, die with it
//! (`PR_SET_PDEATHSIG`) and are killed at the end. Everything else lives in
//! a [`TestEnv`]: its own cgroup subtree, bpffs directory and temp dir.

use std::collections::BTreeSet;
use std::ffi::CString;
use std::time::Instant;

use gpufence_model::config::{Config, ConfigOrigin};
use gpufence_model::device::DevNum;
use gpufence_node::sweep::{self, SweepRequest};
use gpufence_node::{holders::scan, host::fence_ops, Node};
use gpufence_tests::{HoldableDevice, TestEnv};

/// Per process count: median seconds of the epilog scan and of the sweep,
/// and what they found (holders; sweep findings).
#[derive(Debug, Clone)]
pub struct ScanResult {
    /// Extra processes started.
    pub procs: usize,
    /// Ordinary descriptors each holds.
    pub fds: usize,
    /// Median wall time of the epilog scan reading the iterators the
    /// fence pinned (what `gpufence-epilog` runs), seconds.
    pub epilog_scan_pinned_s: f64,
    /// Processes on the machine during the measurement.
    pub total_procs: usize,
    /// Median wall time of the same scan with the first fd-table program
    /// (before further passes and split readers:
    /// [`crate::v1`]), same runs, seconds.
    pub epilog_scan_v1_s: f64,
    /// Median wall time of the pinned scan with this process given 1, 2
    /// and all of the machine's CPUs (its affinity; the scan splits its
    /// readers by the CPUs it may use), same runs: `(cpus, seconds)`.
    pub pinned_by_cpus: Vec<(usize, f64)>,
    /// Median wall time of the epilog's descriptor scan, seconds (default
    /// scanner: the iterators).
    pub epilog_scan_s: f64,
    /// Median wall time of a full sweep, seconds (default scanner).
    pub sweep_s: f64,
    /// Median wall time of the epilog scan walking `/proc`, same runs.
    pub epilog_scan_proc_s: f64,
    /// Median wall time of a full sweep walking `/proc`, same runs.
    pub sweep_proc_s: f64,
    /// Median wall time of the epilog scan as it was before the iterators:
    /// the `/proc` walk on one thread, same runs.
    pub epilog_scan_serial_s: f64,
    /// What the default scanner read (`iterators`, or `proc: <why>`).
    pub source: String,
    /// Whether every run's two epilog scans found the same holders.
    pub same_holders: bool,
    /// Holders the epilog scan found (5 expected).
    pub holders: usize,
    /// Findings of the last sweep.
    pub sweep_findings: usize,
    /// Findings of the last `/proc` sweep.
    pub sweep_findings_proc: usize,
}

/// Forks `n` processes holding `fds` ordinary descriptors each (rounded
/// down to whole groups of 20: 8 of a regular file, 2 pipes, 2 socket
/// pairs, 2 of `/dev/null`, an eventfd and an epoll instance, the last two
/// anonymous inodes as a training job's event loops hold); the first
/// `holding` also hold `dev_path`. Returns their pids once all are ready.
pub(crate) fn spawn_crowd(
    n: usize,
    fds: usize,
    holding: usize,
    dir: &std::path::Path,
    dev_path: &std::path::Path,
) -> Vec<i32> {
    let file = CString::new(dir.join("ordinary").to_str().unwrap()).unwrap();
    std::fs::write(dir.join("ordinary"), b"x").unwrap();
    let null = CString::new("/dev/null").unwrap();
    let dev = CString::new(dev_path.to_str().unwrap()).unwrap();
    let mut ready = [0i32; 2];
    // SAFETY: pipe(2) into a local array.
    assert_eq!(unsafe { libc::pipe(ready.as_mut_ptr()) }, 0);
    let mut pids = Vec::with_capacity(n);
    for i in 0..n {
        // SAFETY: the child makes only async-signal-safe calls and never
        // returns into Rust code.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            // SAFETY: in the forked child: raw syscalls on descriptors and
            // buffers we own, then _exit.
            unsafe {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                let mut lim = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
                lim.rlim_cur = lim.rlim_max;
                libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
                for _ in 0..(fds / 20).max(1) {
                    for _ in 0..8 {
                        libc::open(file.as_ptr(), libc::O_RDONLY);
                    }
                    let mut p = [0i32; 2];
                    for _ in 0..2 {
                        libc::pipe(p.as_mut_ptr());
                    }
                    for _ in 0..2 {
                        libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, p.as_mut_ptr());
                    }
                    for _ in 0..2 {
                        libc::open(null.as_ptr(), libc::O_RDONLY);
                    }
                    libc::eventfd(0, 0);
                    libc::epoll_create1(0);
                }
                if i < holding {
                    libc::open(dev.as_ptr(), libc::O_RDONLY);
                }
                libc::write(ready[1], b"r".as_ptr().cast(), 1);
                loop {
                    libc::pause();
                }
            }
        }
        pids.push(pid);
    }
    wait_ready(ready, n);
    pids
}

/// Closes the write end of the readiness pipe `ready` (its children each
/// wrote one byte when ready) and reads until `n` bytes came or every
/// writer is gone; how many came.
pub(crate) fn wait_ready(ready: [i32; 2], n: usize) -> usize {
    // SAFETY: closes our copy of the write end, reads one byte per child.
    unsafe { libc::close(ready[1]) };
    let mut got = 0;
    let mut buf = [0u8; 256];
    while got < n {
        // SAFETY: read into a local buffer.
        let r = unsafe { libc::read(ready[0], buf.as_mut_ptr().cast(), buf.len()) };
        if r <= 0 {
            break;
        }
        got += r as usize;
    }
    // SAFETY: close of our fd.
    unsafe { libc::close(ready[0]) };
    got
}

pub(crate) fn kill_crowd(pids: &[i32]) {
    for p in pids {
        // SAFETY: signals our own children.
        unsafe { libc::kill(*p, libc::SIGKILL) };
    }
    for p in pids {
        // SAFETY: reaps our own children.
        unsafe { libc::waitpid(*p, std::ptr::null_mut(), 0) };
    }
}

/// Runs `f` with this thread (and the threads it starts) allowed on the
/// first `n` CPUs of its affinity mask only, then restores the mask.
fn on_cpus<T>(n: usize, f: impl FnOnce() -> T) -> T {
    // SAFETY: sched_getaffinity/sched_setaffinity of this thread into and
    // from cpu_set_t values we own.
    unsafe {
        let mut all: libc::cpu_set_t = std::mem::zeroed();
        libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut all);
        let mut some: libc::cpu_set_t = std::mem::zeroed();
        let mut k = 0;
        for c in 0..libc::CPU_SETSIZE as usize {
            if k < n && libc::CPU_ISSET(c, &all) {
                libc::CPU_SET(c, &mut some);
                k += 1;
            }
        }
        libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &some);
        let out = f();
        libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &all);
        out
    }
}

/// The CPUs this thread may run on.
fn cpus_allowed() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Runs the scan benchmark for each `(processes, descriptors each)` in
/// `counts`, `runs` runs each. The `/proc` walks (two threads, one thread,
/// and the sweep's) run only up to 200,000 descriptors in all: past that
/// each takes seconds and says nothing new (their cost is per descriptor).
pub fn run(counts: &[(usize, usize)], runs: usize) -> Vec<ScanResult> {
    let b = BenchNode::new("bench-scan");
    let (dev, env, node_path, node) = (&b.dev, &b.env, &b.gpu_path, &b.node);
    let devs: BTreeSet<DevNum> = [DevNum::new(dev.major, dev.minor)].into();
    let all_cpus = cpus_allowed();
    let mut cpu_counts: Vec<usize> = [1, 2, all_cpus]
        .into_iter()
        .filter(|n| *n <= all_cpus)
        .collect();
    cpu_counts.dedup();
    let mut out = Vec::new();
    for &(n, fds) in counts {
        let pids = spawn_crowd(n, fds, 5.min(n), &env.path("."), node_path);
        let walks = n * fds <= 200_000;
        let mut scans_pinned = Vec::new();
        let mut scans_v1 = Vec::new();
        let mut by_cpus: Vec<Vec<f64>> = vec![Vec::new(); cpu_counts.len()];
        let total_procs = scan::pids().len();
        let (mut scans, mut scans_proc) = (Vec::new(), Vec::new());
        let mut scans_serial = Vec::new();
        let (mut sweeps, mut sweeps_proc) = (Vec::new(), Vec::new());
        let mut holders = 0;
        let (mut findings, mut findings_proc) = (0, 0);
        let mut source = String::new();
        let mut same = true;
        for run in 0..runs {
            // Alternate which goes first, so neither always finds the
            // other's dentries warm.
            let mut found = [Vec::new(), Vec::new()];
            // The scan before further passes and split readers (the first
            // program and the ring iterator, opened from their pins, each
            // process it did not read whole walked in /proc) and what the
            // Epilog runs now, which first alternating.
            let mut v1 = BTreeSet::new();
            if run % 2 == 1 {
                let t = Instant::now();
                v1 = v1_scan(&node.cfg.bpffs_dir, &devs).0;
                scans_v1.push(t.elapsed().as_secs_f64());
            }
            let mut s = scan::Scanner::with_pins(&node.cfg.bpffs_dir);
            let t = Instant::now();
            let pinned = s.holders(&devs);
            scans_pinned.push(t.elapsed().as_secs_f64());
            assert!(s.read_pins(), "the pinned iterators were not read");
            if run % 2 == 0 {
                let t = Instant::now();
                v1 = v1_scan(&node.cfg.bpffs_dir, &devs).0;
                scans_v1.push(t.elapsed().as_secs_f64());
            }
            same &= v1 == pinned.iter().map(|h| h.pid).collect::<BTreeSet<i32>>();
            // Today's, given 1, 2 and all CPUs.
            let k = cpu_counts.len();
            for i in (0..k).map(|i| (i + run) % k) {
                let n = cpu_counts[i];
                let t = Instant::now();
                let h = on_cpus(n, || {
                    scan::Scanner::with_pins(&node.cfg.bpffs_dir).holders(&devs)
                });
                by_cpus[i].push(t.elapsed().as_secs_f64());
                same &= h == pinned;
            }
            for proc_walk in [run % 2 == 1, run % 2 == 0] {
                if proc_walk && !walks {
                    continue;
                }
                let mut s = if proc_walk {
                    scan::Scanner::proc_walk()
                } else {
                    scan::Scanner::new()
                };
                let t = Instant::now();
                let h = s.holders(&devs);
                let dt = t.elapsed().as_secs_f64();
                if proc_walk {
                    scans_proc.push(dt);
                } else {
                    scans.push(dt);
                    holders = h.len();
                    source = match s.source() {
                        Some(scan::Source::Iterators) => "iterators".into(),
                        Some(scan::Source::Proc(why)) => format!("proc: {why:?}"),
                        None => "none".into(),
                    };
                }
                found[usize::from(proc_walk)] = h;
                if !walks {
                    continue;
                }
                let t = Instant::now();
                let req = SweepRequest {
                    proc_walk,
                    ..SweepRequest::default()
                };
                let o = sweep::execute(node, &req);
                let dt = t.elapsed().as_secs_f64();
                if proc_walk {
                    sweeps_proc.push(dt);
                    findings_proc = o.report.findings.len();
                } else {
                    sweeps.push(dt);
                    findings = o.report.findings.len();
                }
            }
            same &= pinned == found[0];
            if walks {
                let t = Instant::now();
                let serial = scan::Scanner::proc_walk().holders_where(&|d| devs.contains(&d));
                scans_serial.push(t.elapsed().as_secs_f64());
                same &= found[0] == found[1] && found[0] == serial;
            }
        }
        kill_crowd(&pids);
        eprintln!("{n} extra processes x {fds} descriptors done");
        let median = |v: Vec<f64>| if v.is_empty() { f64::NAN } else { median(v) };
        out.push(ScanResult {
            procs: n,
            fds,
            epilog_scan_pinned_s: median(scans_pinned),
            total_procs,
            epilog_scan_v1_s: median(scans_v1),
            pinned_by_cpus: cpu_counts
                .iter()
                .zip(by_cpus)
                .map(|(n, v)| (*n, median(v)))
                .collect(),
            epilog_scan_s: median(scans),
            sweep_s: median(sweeps),
            epilog_scan_proc_s: median(scans_proc),
            sweep_proc_s: median(sweeps_proc),
            epilog_scan_serial_s: median(scans_serial),
            source,
            same_holders: same,
            holders,
            sweep_findings: findings,
            sweep_findings_proc: findings_proc,
        });
    }
    drop(b);
    out
}

/// What the scan before further passes found: the holders' pids (the
/// first fd-table program's records and the pinned ring iterator, the
/// processes it did not read whole walked in `/proc`, as
/// `Scanner::holders` did), and how many processes it walked in `/proc`.
pub(crate) fn v1_scan(dir: &std::path::Path, devs: &BTreeSet<DevNum>) -> (BTreeSet<i32>, usize) {
    use gpufence_cgroup::iter::{Object, RingIterator};
    let majors: Vec<u32> = devs.iter().map(|d| d.major).collect();
    assert!(gpufence_cgroup::Fence::majors_protected(dir, &majors).unwrap_or(false));
    let it = crate::v1::BaselineIterator::open_pinned(dir).expect("the first program's pin");
    let rings = RingIterator::open_pinned(dir).expect("the pinned ring iterator");
    let (recs, unread) = it.files().expect("the first program");
    let _ = rings.files().expect("the ring iterator");
    let me = std::process::id() as i32;
    let mut out: BTreeSet<i32> = recs
        .iter()
        .filter(|r| r.tgid != me)
        .filter(
            |r| matches!(r.object, Object::CharFd(ma, mi) if devs.contains(&DevNum::new(ma, mi))),
        )
        .map(|r| r.tgid)
        .collect();
    let walked = unread.len();
    for pid in unread.into_iter().filter(|p| *p != me) {
        if scan::Scanner::proc_walk()
            .holder_where(pid, &|d| devs.contains(&d))
            .is_some()
        {
            out.insert(pid);
        }
    }
    (out, walked)
}

/// A benchmark's node: a misc device no process holds (the bench's GPU,
/// on a major the fence protects besides 195), its node `gpu_path` in a
/// [`TestEnv`], and the fence installed there with its scan iterators
/// pinned, and the first fd-table program pinned beside them as its
/// install did ([`v1_scan`]).
pub(crate) struct BenchNode {
    pub(crate) dev: HoldableDevice,
    pub(crate) env: TestEnv,
    pub(crate) gpu_path: std::path::PathBuf,
    pub(crate) node: Node,
}

impl BenchNode {
    pub(crate) fn new(tag: &str) -> BenchNode {
        use crate::v1::BaselineIterator;
        use gpufence_cgroup::iter::fdtable::FdTableLayout;
        let dev = HoldableDevice::claim();
        let env = TestEnv::new(tag);
        let gpu_path = env.mknod("gpu", dev.major, dev.minor);
        let cfg = env.config(&format!(
            "nvml = false\n[majors]\nnvidia = 195\nbench-gpu = {}\n",
            dev.major
        ));
        let node =
            Node::new(Config::load(&cfg).expect("config"), ConfigOrigin::File(cfg)).expect("node");
        let installed = fence_ops::install(&node).expect("install the bench's fence");
        assert_eq!(
            installed.iterators_unpinned, None,
            "the scan iterators were not pinned"
        );
        let btf = gpufence_cgroup::btf::Btf::vmlinux().expect("vmlinux BTF");
        let majors = gpufence_cgroup::Fence::open_map::<gpufence_cgroup::maps::MajorsMap>(
            &node.cfg.bpffs_dir,
        )
        .expect("the fence's majors map");
        BaselineIterator::load(&FdTableLayout::from_btf(&btf).expect("layout"), &majors)
            .expect("the first fd-table program")
            .pin(&node.cfg.bpffs_dir)
            .expect("pinned");
        BenchNode {
            dev,
            env,
            gpu_path,
            node,
        }
    }
}

/// Today's pinned scan against the one before it, and by CPUs.
pub fn print_pinned(r: &[ScanResult], runs: usize) {
    let cpus: Vec<usize> = r
        .first()
        .map(|s| s.pinned_by_cpus.iter().map(|(n, _)| *n).collect())
        .unwrap_or_default();
    println!("The Epilog's pinned scan now (further passes, readers split by CPU) against the first fd-table program (one reader, a table past 1,000 records walked in /proc), same runs, median of {runs}; and now with this process given 1, 2, all CPUs:\n");
    print!("| extra processes x descriptors | now | before | ratio |");
    for n in &cpus {
        print!(" {n} CPU{} |", if *n == 1 { "" } else { "s" });
    }
    println!();
    print!("|---|---|---|---|");
    for _ in &cpus {
        print!("---|");
    }
    println!();
    for s in r {
        print!(
            "| {} x {} | {:.1} ms | {:.1} ms | {:.3}x |",
            s.procs,
            s.fds,
            s.epilog_scan_pinned_s * 1e3,
            s.epilog_scan_v1_s * 1e3,
            s.epilog_scan_pinned_s / s.epilog_scan_v1_s
        );
        for (_, t) in &s.pinned_by_cpus {
            print!(" {:.1} ms |", t * 1e3);
        }
        println!();
    }
    println!();
}

/// The two scanners side by side, as ratios.
pub fn print_side_by_side(r: &[ScanResult], runs: usize) {
    println!("Iterators (default) against the /proc walk, same runs, median of {runs}:\n");
    println!("(/proc walk: the fallback, two threads for the epilog scan; one thread: the epilog scan before the iterators.)\n");
    println!("(pinned: the iterators the fence install pinned, filtered in the kernel, what the Epilog reads; loaded: iterators loaded by the scan, every descriptor of the kinds read crossing to user space, what the Epilog did before.)\n");
    println!("| extra processes x descriptors | epilog scan: pinned | loaded | ratio | /proc walk | one thread | ratio loaded to /proc / one thread | full sweep: iterators | /proc walk | ratio | same holders | source |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for s in r {
        println!(
            "| {} x {} | {:.1} ms | {:.1} ms | {:.3}x | {:.0} ms | {:.0} ms | {:.2}x / {:.2}x | {:.0} ms | {:.0} ms | {:.2}x | {} ({} holders; sweep findings {} / {}) | {} |",
            s.procs,
            s.fds,
            s.epilog_scan_pinned_s * 1e3,
            s.epilog_scan_s * 1e3,
            s.epilog_scan_pinned_s / s.epilog_scan_s,
            s.epilog_scan_proc_s * 1e3,
            s.epilog_scan_serial_s * 1e3,
            s.epilog_scan_s / s.epilog_scan_proc_s,
            s.epilog_scan_s / s.epilog_scan_serial_s,
            s.sweep_s * 1e3,
            s.sweep_proc_s * 1e3,
            s.sweep_s / s.sweep_proc_s,
            if s.same_holders { "yes" } else { "NO" },
            s.holders,
            s.sweep_findings,
            s.sweep_findings_proc,
            s.source
        );
    }
    println!();
}

/// Where a pinned scan's time goes on a crowd of `n` x `fds`: each piece
/// timed alone, `runs` times (median), printed.
pub fn profile(n: usize, fds: usize, runs: usize) {
    use gpufence_cgroup::iter::fdtable::{FdTableIterator, Pass};
    use gpufence_cgroup::iter::RingIterator;
    let b = BenchNode::new("bench-profile");
    let (dev, env, node_path, node) = (&b.dev, &b.env, &b.gpu_path, &b.node);
    let pids = spawn_crowd(n, fds, 5.min(n), &env.path("."), node_path);
    let dir = node.cfg.bpffs_dir.clone();
    let devs: BTreeSet<DevNum> = [DevNum::new(dev.major, dev.minor)].into();
    let time = |f: &mut dyn FnMut()| {
        let mut v = Vec::new();
        for _ in 0..runs {
            let t = Instant::now();
            f();
            v.push(t.elapsed().as_secs_f64() * 1e3);
        }
        median(v)
    };
    let t = FdTableIterator::open_pinned(&dir).expect("pin");
    let r = RingIterator::open_pinned(&dir).expect("rings");
    let open = time(&mut || {
        let _ = FdTableIterator::open_pinned(&dir).unwrap();
        let _ = RingIterator::open_pinned(&dir).unwrap();
    });
    let one = time(&mut || {
        let _ = t.pass(&Pass::default()).unwrap();
    });
    let rings = time(&mut || {
        let _ = r.files().unwrap();
    });
    let share = |k: u32| Pass {
        shares: 2,
        share: k,
        ..Pass::default()
    };
    let half = time(&mut || {
        let _ = t.pass(&share(0)).unwrap();
    });
    let two = time(&mut || {
        std::thread::scope(|s| {
            let h = s.spawn(|| t.pass(&share(1)).unwrap());
            let _ = t.pass(&share(0)).unwrap();
            let _ = h.join();
        })
    });
    let two_rings = time(&mut || {
        std::thread::scope(|s| {
            let h = s.spawn(|| t.pass(&share(1)).unwrap());
            let g = s.spawn(|| r.files().unwrap());
            let _ = t.pass(&share(0)).unwrap();
            let _ = h.join();
            let _ = g.join();
        })
    });
    let none = time(&mut || {
        let _ = t
            .pass(&Pass {
                shares: u32::MAX,
                share: u32::MAX - 1,
                ..Pass::default()
            })
            .unwrap();
    });
    println!("bare walk (no task in this reader's share) {none:.1} ms");
    let whole = time(&mut || {
        let _ = scan::Scanner::with_pins(&dir).holders(&devs);
    });
    let whole1 = time(&mut || {
        let _ = scan::Scanner::with_pins(&dir)
            .with_readers(1)
            .holders(&devs);
    });
    kill_crowd(&pids);
    println!("{n} x {fds}, median of {runs} (ms): open pins {open:.2}; fd-table one reader {one:.1}; one of two shares alone {half:.1}; two shares in parallel {two:.1}; ring iterator {rings:.1}; two shares and rings in parallel {two_rings:.1}; holders() default {whole:.1}; holders() one reader {whole1:.1}");
}
