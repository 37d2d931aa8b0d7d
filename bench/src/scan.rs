//! Scans on a crowded node: the epilog's descriptor scan
//! ([`gpufence_node::scan::holders`], what `gpufence-epilog` runs for a
//! job's devices) and a full `gpufence sweep` ([`gpufence_node::sweep::execute`]
//! without `--cgroup`: the whole machine), with N extra processes that each
//! hold 20 ordinary descriptors (8 of a regular file, 3 pipes, 2 socket
//! pairs, 2 of `/dev/null`), 5 of them also holding a protected node (a misc
//! device no process on the machine holds, claimed like the tests do, on a
//! major the bench's fence protects).
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
use gpufence_node::{fence_ops, scan, Node};
use gpufence_tests::{HoldableDevice, TestEnv};

/// Per process count: median seconds of the epilog scan and of the sweep,
/// and what they found (holders; sweep findings).
#[derive(Debug, Clone)]
pub struct ScanResult {
    /// Extra processes started.
    pub procs: usize,
    /// Processes on the machine during the measurement.
    pub total_procs: usize,
    /// Median wall time of the epilog's descriptor scan, seconds.
    pub epilog_scan_s: f64,
    /// Median wall time of a full sweep, seconds.
    pub sweep_s: f64,
    /// Holders the epilog scan found (5 expected).
    pub holders: usize,
    /// Findings of the last sweep.
    pub sweep_findings: usize,
}

/// Forks `n` processes holding 20 descriptors each; the first `holding`
/// also hold `dev_path`. Returns their pids once all are ready.
fn spawn_crowd(
    n: usize,
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
            unsafe {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                for _ in 0..8 {
                    libc::open(file.as_ptr(), libc::O_RDONLY);
                }
                let mut p = [0i32; 2];
                for _ in 0..3 {
                    libc::pipe(p.as_mut_ptr());
                }
                for _ in 0..2 {
                    libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, p.as_mut_ptr());
                }
                for _ in 0..2 {
                    libc::open(null.as_ptr(), libc::O_RDONLY);
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
    pids
}

fn kill_crowd(pids: &[i32]) {
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

/// Runs the scan benchmark for each count in `counts`, `runs` runs each.
pub fn run(counts: &[usize], runs: usize) -> Vec<ScanResult> {
    let dev = HoldableDevice::claim();
    let env = TestEnv::new("bench-scan");
    let node_path = env.mknod("gpu", dev.major, dev.minor);
    let cfg = env.config(&format!(
        "nvml = false\n[majors]\nnvidia = 195\nbench-gpu = {}\n",
        dev.major
    ));
    let node =
        Node::new(Config::load(&cfg).expect("config"), ConfigOrigin::File(cfg)).expect("node");
    fence_ops::install(&node).expect("install the bench's fence");
    let devs: BTreeSet<DevNum> = [DevNum::new(dev.major, dev.minor)].into();
    let mut out = Vec::new();
    for &n in counts {
        let pids = spawn_crowd(n, 5.min(n), &env.path("."), &node_path);
        let total_procs = scan::pids().len();
        let mut scans = Vec::new();
        let mut sweeps = Vec::new();
        let mut holders = 0;
        let mut findings = 0;
        for _ in 0..runs {
            let t = Instant::now();
            holders = scan::holders(&devs).len();
            scans.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            let o = sweep::execute(&node, &SweepRequest::default());
            sweeps.push(t.elapsed().as_secs_f64());
            findings = o.report.findings.len();
        }
        kill_crowd(&pids);
        eprintln!("{n} extra processes done");
        out.push(ScanResult {
            procs: n,
            total_procs,
            epilog_scan_s: median(scans),
            sweep_s: median(sweeps),
            holders,
            sweep_findings: findings,
        });
    }
    drop(env);
    out
}
