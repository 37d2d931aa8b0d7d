//! The Epilog's worst case against its deadline (`epilog_deadline_ms`):
//! one holder of a job's GPU that ignores SIGTERM, alone in a cgroup (a
//! job's leftover), uid 65534, ended by [`gpufence_node::job::epilog::run`]
//! with a job record, as `gpufence-epilog` runs it, with the default
//! waits (`term_grace_ms` 5000, `kill_wait_ms` 5000, NVML off: there is
//! no GPU) and each deadline asked for: the default (no slurm.conf here:
//! 60 s) and shorter ones. Measured: the Epilog's wall time, against the
//! deadline and against the sum of the waits it would make without one;
//! how the holder ended; the waits it cut.
//!
//! Without a SIGTERM-ignoring holder the Epilog ends in milliseconds (the
//! holder exits at SIGTERM); with one, the grace is the Epilog's time.
//! No drain: the bench has no slurmctld (the deadline keeps its reserve
//! for the drain's call all the same).

use std::ffi::CString;
use std::time::Instant;

use gpufence_model::config::{Config, ConfigOrigin};
use gpufence_model::device::DevNum;
use gpufence_node::job::{epilog, timeouts};
use gpufence_node::{host::fence_ops, Node};
use gpufence_tests::{HoldableDevice, TestEnv};

use crate::respond::{record, HOLDER_UID};

/// One Epilog's run.
#[derive(Debug, Clone)]
pub struct DeadlineResult {
    /// The deadline asked for (`None`: the default).
    pub asked_ms: Option<u64>,
    /// The deadline the Epilog had, ms, and where it came from.
    pub deadline: timeouts::EpilogDeadline,
    /// The sum of the Epilog's waits with this config, ms
    /// ([`timeouts::epilog_worst_case`]).
    pub waits_ms: u64,
    /// The Epilog's wall time, ms.
    pub epilog_ms: f64,
    /// How the holder ended (`SIGKILL`, `SIGTERM`), or `not seen gone`.
    pub ended_by: String,
    /// Whether the holder is gone after the Epilog.
    pub gone: bool,
    /// Whether the Epilog was clean (else it drains).
    pub clean: bool,
    /// The waits it cut, one line each.
    pub cuts: Vec<String>,
}

/// Forks one process that ignores SIGTERM, opens `dev_path`, becomes
/// [`HOLDER_UID`] and waits; returns its pid once it holds it.
fn spawn_stubborn(dev_path: &std::path::Path) -> i32 {
    let dev = CString::new(dev_path.to_str().unwrap()).unwrap();
    let mut ready = [0i32; 2];
    // SAFETY: pipe(2) into a local array.
    assert_eq!(unsafe { libc::pipe(ready.as_mut_ptr()) }, 0);
    // SAFETY: the child makes only async-signal-safe calls and never
    // returns into Rust code.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        // SAFETY: in the forked child: raw syscalls on descriptors and
        // buffers we own, then _exit.
        unsafe {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            libc::signal(libc::SIGTERM, libc::SIG_IGN);
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
    assert_eq!(
        crate::scan::wait_ready(ready, 1),
        1,
        "the holder opened the device"
    );
    pid
}

/// Reaps `pid`; whether it had exited (else it is killed and reaped).
fn reap(pid: i32) -> bool {
    let mut st = 0;
    // SAFETY: reaps our own child without blocking.
    let exited = unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) } == pid;
    if !exited {
        // SAFETY: kill and reap our own child.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
        }
    }
    exited
}

/// Runs the Epilog `runs` times for each deadline in `asked` (`None`: the
/// default), in turn.
pub fn run(asked: &[Option<u64>], runs: usize) -> Vec<DeadlineResult> {
    let dev = HoldableDevice::claim();
    let env = TestEnv::new("bench-deadline");
    let node_path = env.mknod("gpu", dev.major, dev.minor);
    let gpu = DevNum::new(dev.major, dev.minor);
    let cg = env.cgroup("stubborn");
    let mut out = Vec::new();
    let mut job = 200;
    for _ in 0..runs {
        for &a in asked {
            job += 1;
            let key = a
                .map(|ms| format!("epilog_deadline_ms = {ms}\n"))
                .unwrap_or_default();
            let p = env.config(&format!(
                "nvml = false\nterm_grace_ms = 5000\n{key}[majors]\nnvidia = 195\nbench-gpu = {}\n",
                dev.major
            ));
            // TestEnv's configs wait 3 s for a kill; the default is 5 s.
            let text = std::fs::read_to_string(&p).expect("config");
            std::fs::write(
                &p,
                text.replace("kill_wait_ms = 3000", "kill_wait_ms = 5000"),
            )
            .expect("config");
            let cfg = Config::load(&p).expect("config");
            let node = Node::new(cfg.clone(), ConfigOrigin::File(p)).expect("node");
            fence_ops::install(&node).expect("install the bench's fence");
            let pid = spawn_stubborn(&node_path);
            env.cg.move_pid(&cg, pid).expect("move the holder");
            node.state
                .write_record(&record(job, &node_path, gpu))
                .expect("record");
            let t = Instant::now();
            let o = epilog::run(&node, job, None);
            let epilog_ms = t.elapsed().as_secs_f64() * 1000.0;
            let gone = reap(pid);
            let ended_by = o
                .lingering
                .iter()
                .find(|l| l.pid == pid)
                .map(|l| {
                    l.ended_by
                        .map_or("not seen gone", |e| e.as_str())
                        .to_string()
                })
                .unwrap_or_else(|| "not found".into());
            let r = DeadlineResult {
                asked_ms: a,
                deadline: timeouts::host_epilog_deadline(&cfg),
                waits_ms: timeouts::epilog_worst_case(&cfg).waits_ms,
                epilog_ms,
                ended_by,
                gone,
                clean: o.clean(),
                cuts: o
                    .notes
                    .iter()
                    .filter(|n| n.starts_with("epilog_deadline_ms "))
                    .cloned()
                    .collect(),
            };
            eprintln!(
                "deadline {} ms: Epilog {:.0} ms, holder {}",
                r.deadline.ms, r.epilog_ms, r.ended_by
            );
            out.push(r);
        }
    }
    drop(env);
    out
}

/// The table: per deadline of `asked`, the median and the largest wall
/// time of its runs, then the waits cut (of the last run).
pub fn print(asked: &[Option<u64>], r: &[DeadlineResult]) {
    let runs = r.len() / asked.len().max(1);
    println!("The Epilog against one holder of the job's GPU that ignores SIGTERM (its own cgroup, uid 65534), default waits (term_grace_ms 5000, kill_wait_ms 5000; NVML off, no drain), per deadline, {runs} run(s) each, interleaved:\n");
    println!("| epilog_deadline_ms | from | sum of the waits | Epilog, median | Epilog, largest | largest / deadline | holder ended by | holder gone | clean |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for a in asked {
        let rows: Vec<&DeadlineResult> = r.iter().filter(|x| x.asked_ms == *a).collect();
        let mut t: Vec<f64> = rows.iter().map(|x| x.epilog_ms).collect();
        t.sort_by(f64::total_cmp);
        let (median, max) = (t[t.len() / 2], t[t.len() - 1]);
        let x = rows[rows.len() - 1];
        let mut ended: Vec<&str> = rows.iter().map(|x| x.ended_by.as_str()).collect();
        ended.sort();
        ended.dedup();
        println!(
            "| {} | {} | {:.1} s | {:.0} ms | {:.0} ms | {:.2} | {} | {} | {} |",
            x.deadline.ms,
            x.deadline.from,
            x.waits_ms as f64 / 1000.0,
            median,
            max,
            max / x.deadline.ms as f64,
            ended.join(", "),
            rows.iter().all(|x| x.gone),
            rows.iter().all(|x| x.clean),
        );
    }
    println!("\nThe waits each deadline cut (its last run; the Epilog's own lines):\n");
    for a in asked {
        if let Some(x) = r.iter().rev().find(|x| x.asked_ms == *a) {
            if x.cuts.is_empty() {
                println!("- {} ms: none", x.deadline.ms);
            }
            for c in &x.cuts {
                println!("- {c}");
            }
        }
    }
}
