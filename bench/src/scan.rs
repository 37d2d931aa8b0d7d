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
//! walk it falls back to ([`gpufence_node::holders::scan::set_proc_only`]), and
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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Runs the scan benchmark for each `(processes, descriptors each)` in
/// `counts`, `runs` runs each. The `/proc` walks (two threads, one thread,
/// and the sweep's) run only up to 200,000 descriptors in all: past that
/// each takes seconds and says nothing new (their cost is per descriptor).
pub fn run(counts: &[(usize, usize)], runs: usize) -> Vec<ScanResult> {
    let dev = HoldableDevice::claim();
    let env = TestEnv::new("bench-scan");
    let node_path = env.mknod("gpu", dev.major, dev.minor);
    let cfg = env.config(&format!(
        "nvml = false\n[majors]\nnvidia = 195\nbench-gpu = {}\n",
        dev.major
    ));
    let node =
        Node::new(Config::load(&cfg).expect("config"), ConfigOrigin::File(cfg)).expect("node");
    let installed = fence_ops::install(&node).expect("install the bench's fence");
    if let Some(why) = &installed.iterators_unpinned {
        eprintln!("scan iterators not pinned: {why}");
    }
    let devs: BTreeSet<DevNum> = [DevNum::new(dev.major, dev.minor)].into();
    let mut out = Vec::new();
    for &(n, fds) in counts {
        let pids = spawn_crowd(n, fds, 5.min(n), &env.path("."), &node_path);
        let walks = n * fds <= 200_000;
        let mut scans_pinned = Vec::new();
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
            // What the Epilog runs: the fence's pinned iterators.
            let mut s = scan::Scanner::with_pins(&node.cfg.bpffs_dir);
            let t = Instant::now();
            let pinned = s.holders(&devs);
            scans_pinned.push(t.elapsed().as_secs_f64());
            assert!(s.read_pins(), "the pinned iterators were not read");
            for proc_walk in [run % 2 == 1, run % 2 == 0] {
                if proc_walk && !walks {
                    continue;
                }
                scan::set_proc_only(proc_walk);
                let mut s = scan::Scanner::new();
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
                let o = sweep::execute(&node, &SweepRequest::default());
                let dt = t.elapsed().as_secs_f64();
                if proc_walk {
                    sweeps_proc.push(dt);
                    findings_proc = o.report.findings.len();
                } else {
                    sweeps.push(dt);
                    findings = o.report.findings.len();
                }
            }
            scan::set_proc_only(false);
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
    drop(env);
    out
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
