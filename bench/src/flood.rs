//! One job cannot slow another: the scan a co-tenant job's Prolog (clean
//! start) and Epilog run for its own GPU
//! ([`gpufence_node::response::respond::uncovered`]'s scan:
//! `Scanner::with_pins(..).with_budget(scan_budget_ms).holders(devs)`)
//! while another job floods its descriptor tables, side by side in the same
//! runs with the scan before further passes (the first fd-table program,
//! [`crate::v1`]: a table of more than
//! `FD_RECORDS` records cut there, then its process walked in `/proc`,
//! plus the pinned ring iterator, as `Scanner::holders` did).
//!
//! Two floods, each process made by `gpufence-probe flood`:
//! - **copies**: the flooding job's GPU (a misc device no process holds,
//!   on a major the fence protects) opened once and `dup`ed 1,001 times,
//!   the rest of the table `/dev/null` copies;
//! - **rings**: 1,001 io_uring rings without fixed files, the rest
//!   `/dev/null` copies.
//!
//! Neither holds the co-tenant's GPU (195:0): both scans must find no
//! holder. Everything lives in a [`gpufence_tests::TestEnv`] and the flooding processes
//! are killed at the end of each row.

use std::collections::BTreeSet;
use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpufence_model::device::DevNum;
use gpufence_node::holders::scan;

/// One row: a flood and both scans' medians.
#[derive(Debug, Clone)]
pub struct FloodResult {
    /// `copies` or `rings` (or `none`: no flood).
    pub kind: &'static str,
    /// Flooding processes.
    pub procs: usize,
    /// Descriptors in each one's table.
    pub fds: usize,
    /// Median seconds of today's scan (pinned program, further passes,
    /// readers on every CPU, the default budget).
    pub now_s: f64,
    /// Median seconds of the scan before further passes.
    pub before_s: f64,
    /// Further passes today's scan made (last run).
    pub passes: usize,
    /// Processes today's scan did not read within its budget (last run).
    pub over_budget: usize,
    /// Processes the scan before walked in `/proc` (last run).
    pub before_walked: usize,
    /// Holders each found (0 expected).
    pub holders: (usize, usize),
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// This process's hard `RLIMIT_NOFILE` (what a flooding probe may reach
/// without `CAP_SYS_RESOURCE`).
fn nofile_hard() -> usize {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit into a struct we own.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    usize::try_from(lim.rlim_max).unwrap_or(usize::MAX)
}

/// Starts `n` flooding probes; returns them once each said "flooded".
fn flood(n: usize, args: &[String]) -> Vec<Child> {
    let mut kids = Vec::new();
    for _ in 0..n {
        let mut c = Command::new(gpufence_tests::probe_bin())
            .arg("flood")
            .args(args)
            .stdout(Stdio::piped())
            .spawn()
            .expect("gpufence-probe flood");
        let out = c.stdout.take().expect("stdout");
        let mut line = String::new();
        let _ = std::io::BufReader::new(out).read_line(&mut line);
        assert_eq!(
            line.trim(),
            "flooded",
            "gpufence-probe flood {args:?}: {line:?}"
        );
        kids.push(c);
    }
    kids
}

/// Runs each flood (`procs` x `fds`, both kinds, and no flood first),
/// `runs` runs each, the two scans alternating which goes first.
pub fn run(procs: &[usize], fds: &[usize], runs: usize) -> Vec<FloodResult> {
    let b = crate::scan::BenchNode::new("bench-flood");
    let (gpu_path, node) = (&b.gpu_path, &b.node);
    let budget = Duration::from_millis(node.cfg.scan_budget_ms);
    let dir = node.cfg.bpffs_dir.clone();
    let want: BTreeSet<DevNum> = [DevNum::new(195, 0)].into();
    let mut rows: Vec<(&'static str, usize, usize)> = vec![("none", 0, 0)];
    for kind in ["copies", "rings"] {
        for &p in procs {
            for &f in fds {
                rows.push((kind, p, f));
            }
        }
    }
    let mut out = Vec::new();
    let hard = nofile_hard();
    for (kind, p, f) in rows {
        if f + 64 > hard {
            println!(
                "(not run: {kind} flood of {p} x {f}: this machine's hard RLIMIT_NOFILE is {hard}, and raising it needs CAP_SYS_RESOURCE)\n"
            );
            continue;
        }
        let args: Vec<String> = match kind {
            "copies" => vec![
                gpu_path.display().to_string(),
                "1001".into(),
                f.saturating_sub(1002).to_string(),
                "0".into(),
            ],
            _ => vec![
                "-".into(),
                "0".into(),
                f.saturating_sub(1001).to_string(),
                "1001".into(),
            ],
        };
        let mut kids = flood(p, &args);
        let (mut now, mut then) = (Vec::new(), Vec::new());
        let (mut passes, mut over, mut walked, mut holders) = (0, 0, 0, (0, 0));
        for run in 0..runs {
            for old in [run % 2 == 1, run % 2 == 0] {
                let t = Instant::now();
                if old {
                    let (h, w) = crate::scan::v1_scan(&dir, &want);
                    then.push(t.elapsed().as_secs_f64());
                    walked = w;
                    holders.1 = h.len();
                } else {
                    let mut s = scan::Scanner::with_pins(&node.cfg.bpffs_dir).with_budget(budget);
                    let h = s.holders(&want);
                    now.push(t.elapsed().as_secs_f64());
                    assert!(s.read_pins(), "the pinned program was not read");
                    passes = s.passes();
                    over = s.over_budget().len();
                    holders.0 = h.len();
                }
            }
        }
        for k in &mut kids {
            let _ = k.kill();
            let _ = k.wait();
        }
        eprintln!("{kind} flood, {p} processes x {f} descriptors done");
        out.push(FloodResult {
            kind,
            procs: p,
            fds: f,
            now_s: median(now),
            before_s: median(then),
            passes,
            over_budget: over,
            before_walked: walked,
            holders,
        });
    }
    drop(b);
    out
}

/// The rows as a Markdown table.
pub fn print(r: &[FloodResult], runs: usize) {
    println!("A co-tenant's scan for its own GPU while another job floods its descriptor tables, median of {runs} runs, alternating:\n");
    println!("| flood | processes x descriptors each | scan now | scan before | ratio | now: further passes, over budget | before: processes walked in /proc | holders found (now / before) |");
    println!("|---|---|---|---|---|---|---|---|");
    for x in r {
        println!(
            "| {} | {} x {} | {:.1} ms | {:.1} ms | {:.3}x | {}, {} | {} | {} / {} |",
            x.kind,
            x.procs,
            x.fds,
            x.now_s * 1e3,
            x.before_s * 1e3,
            x.now_s / x.before_s,
            x.passes,
            x.over_budget,
            x.before_walked,
            x.holders.0,
            x.holders.1
        );
    }
    println!();
}
