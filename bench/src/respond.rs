//! The Epilog's response to many holders of one job's GPU
//! ([`gpufence_node::job::epilog::run`] with a job record, as `gpufence-epilog`
//! runs it): N processes of a user (uid 65534) hold a protected node (a
//! misc device no process on the machine holds, claimed like the tests do,
//! on a major the bench's fence protects), all in one cgroup, as a job's
//! leftovers would be. Measured: the Epilog's wall time until every holder
//! is gone, and the evidence it wrote (files, bytes), for the default
//! evidence budget and for an unbounded one (`evidence_time_ms` and
//! `evidence_max_mib` too large to matter), alternating, in one run.
//!
//! The holders are forked from this one, die with it (`PR_SET_PDEATHSIG`)
//! and are reaped at the end. Everything else lives in a [`TestEnv`]: its
//! own cgroup subtree, bpffs directory and temp dir.

use std::ffi::CString;
use std::time::Instant;

use gpufence_model::config::{Config, ConfigOrigin};
use gpufence_model::device::{Access, DevNum, DeviceGrant, DeviceRole};
use gpufence_model::record::{now_rfc3339, JobRecord, RECORD_VERSION};
use gpufence_node::{host::fence_ops, job::epilog, Node};
use gpufence_tests::{HoldableDevice, TestEnv};

/// The uid the holders run as (nobody: above `protected_uid_max`, so they
/// are ended, not spared).
pub(crate) const HOLDER_UID: u32 = 65534;

/// One Epilog's response.
#[derive(Debug, Clone)]
pub struct RespondResult {
    /// Holders started.
    pub holders: usize,
    /// `default` or `unbounded`.
    pub budget: &'static str,
    /// The Epilog's wall time, seconds.
    pub epilog_s: f64,
    /// Holders still alive after it.
    pub left: usize,
    /// Evidence files written.
    pub files: usize,
    /// Their bytes.
    pub bytes: u64,
    /// Whether every holder had an evidence file, cut or whole.
    pub all_recorded: bool,
}

/// The record of job `job`, of [`HOLDER_UID`], given `gpu` (at `path`).
pub(crate) fn record(job: u32, path: &std::path::Path, gpu: DevNum) -> JobRecord {
    JobRecord {
        version: RECORD_VERSION,
        job_id: job,
        uid: HOLDER_UID,
        gres_indices: vec![0],
        devices: vec![DeviceGrant {
            path: path.to_path_buf(),
            dev: gpu,
            access: Access::RW,
            role: DeviceRole::Gres,
            gres_index: Some(0),
        }],
        created: now_rfc3339(),
        notes: vec![],
        user_notes: vec![],
        gpu_idle: vec![],
        mig: vec![],
        cuda_visible_devices: vec![],
        saved_compute_modes: Vec::new(),
        job_map: Vec::new(),
        mps: Vec::new(),
    }
}

/// Forks `n` processes that open `dev_path`, become [`HOLDER_UID`] and
/// wait; returns their pids once all hold it.
fn spawn_holders(n: usize, dev_path: &std::path::Path) -> Vec<i32> {
    let dev = CString::new(dev_path.to_str().unwrap()).unwrap();
    let mut ready = [0i32; 2];
    // SAFETY: pipe(2) into a local array.
    assert_eq!(unsafe { libc::pipe(ready.as_mut_ptr()) }, 0);
    let mut pids = Vec::with_capacity(n);
    for _ in 0..n {
        // SAFETY: the child makes only async-signal-safe calls and never
        // returns into Rust code.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            // SAFETY: in the forked child: raw syscalls on descriptors and
            // buffers we own, then _exit.
            unsafe {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                if libc::open(dev.as_ptr(), libc::O_RDONLY) < 0
                    || libc::setresgid(HOLDER_UID, HOLDER_UID, HOLDER_UID) != 0
                    || libc::setresuid(HOLDER_UID, HOLDER_UID, HOLDER_UID) != 0
                {
                    libc::_exit(1);
                }
                libc::write(ready[1], b"r".as_ptr().cast(), 1);
                loop {
                    libc::pause();
                }
            }
        }
        pids.push(pid);
    }
    let got = crate::scan::wait_ready(ready, n);
    assert_eq!(got, n, "every holder opened the device");
    pids
}

fn reap(pids: &[i32]) -> usize {
    let mut left = 0;
    for p in pids {
        let mut st = 0;
        // SAFETY: reaps our own child without blocking.
        if unsafe { libc::waitpid(*p, &mut st, libc::WNOHANG) } == 0 {
            left += 1;
            // SAFETY: kill and reap our own child.
            unsafe {
                libc::kill(*p, libc::SIGKILL);
                libc::waitpid(*p, std::ptr::null_mut(), 0);
            }
        }
    }
    left
}

fn dir_usage(dir: &std::path::Path) -> (usize, u64) {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.metadata().ok())
                .fold((0, 0), |(n, b), m| (n + 1, b + m.len()))
        })
        .unwrap_or((0, 0))
}

/// Runs the respond benchmark for each holder count in `counts`, once with
/// each budget, alternating which goes first.
pub fn run(counts: &[usize]) -> Vec<RespondResult> {
    let dev = HoldableDevice::claim();
    let env = TestEnv::new("bench-respond");
    let node_path = env.mknod("gpu", dev.major, dev.minor);
    let gpu = DevNum::new(dev.major, dev.minor);
    let holders_cg = env.cgroup("job_leftovers");
    let mut out = Vec::new();
    let mut job = 100;
    for (i, &n) in counts.iter().enumerate() {
        let order: [&'static str; 2] = if i % 2 == 0 {
            ["default", "unbounded"]
        } else {
            ["unbounded", "default"]
        };
        for budget in order {
            job += 1;
            let evidence = env.path("evidence");
            let _ = std::fs::remove_dir_all(&evidence);
            let extra = match budget {
                "default" => "",
                _ => "evidence_time_ms = 3600000\nevidence_max_mib = 1048576\n",
            };
            let cfg = env.config(&format!(
                "nvml = false\n{extra}[majors]\nnvidia = 195\nbench-gpu = {}\n",
                dev.major
            ));
            let node = Node::new(Config::load(&cfg).expect("config"), ConfigOrigin::File(cfg))
                .expect("node");
            fence_ops::install(&node).expect("install the bench's fence");
            let pids = spawn_holders(n, &node_path);
            for p in &pids {
                env.cg.move_pid(&holders_cg, *p).expect("move a holder");
            }
            node.state
                .write_record(&record(job, &node_path, gpu))
                .expect("record");
            let t = Instant::now();
            let o = epilog::run(&node, job, None);
            let epilog_s = t.elapsed().as_secs_f64();
            let left = reap(&pids);
            let (files, bytes) = dir_usage(&evidence);
            out.push(RespondResult {
                holders: n,
                budget,
                epilog_s,
                left,
                files,
                bytes,
                all_recorded: o.lingering.len() == n
                    && o.lingering.iter().all(|l| l.evidence.is_some()),
            });
            eprintln!("{n} holders, {budget} budget: {epilog_s:.2} s");
        }
    }
    drop(env);
    out
}

/// The table, with the default budget against the unbounded one.
pub fn print(r: &[RespondResult]) {
    println!("The Epilog's response to N holders of one job's GPU (one cgroup, uid 65534, SIGTERM ends them), default evidence budget against an unbounded one, alternating in one run:\n");
    println!("| holders | budget | Epilog (all gone) | holders left | evidence files | evidence bytes | every holder recorded | time ratio to unbounded |");
    println!("|---|---|---|---|---|---|---|---|");
    for x in r {
        let unbounded = r
            .iter()
            .find(|y| y.holders == x.holders && y.budget == "unbounded")
            .map(|y| y.epilog_s);
        println!(
            "| {} | {} | {:.2} s | {} | {} | {:.2} MB | {} | {} |",
            x.holders,
            x.budget,
            x.epilog_s,
            x.left,
            x.files,
            x.bytes as f64 / 1e6,
            x.all_recorded,
            unbounded
                .map(|u| format!("{:.3}x", x.epilog_s / u))
                .unwrap_or_default()
        );
    }
}
