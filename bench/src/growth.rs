//! How the Prolog's and the Epilog's cost grows with the node: processes,
//! open descriptors and grants in the map. Each row times
//! [`gpufence_node::job::prolog::run`] and [`gpufence_node::job::epilog::run`] (what
//! `gpufence-prolog` and `gpufence-epilog` run, in this process: without
//! the exec of a binary, which is constant) for a one-GPU job, and the
//! Epilog's descriptor scan alone ([`gpufence_node::holders::scan::Scanner`] with
//! the fence's pinned iterators), on a node that holds:
//!
//! - N extra processes of 20 ordinary descriptors each (the scan
//!   benchmark's mix);
//! - 500, 1,000 or 1,000 processes holding 20, 100 or 1,000 descriptors
//!   each: 10,000, 100,000 and one million descriptors;
//! - 1, 1,000 or 100,000 grants of other jobs in the `grants` map
//!   (`max_grants = 131072`), written straight into the map.
//!
//! Everything lives in one [`TestEnv`] (`layout = "own"`, `slurmd -G`
//! output from a file): its own cgroup subtree, bpffs directory and temp
//! dir; the crowds are forked from this process and killed after their
//! row.

use std::collections::BTreeSet;
use std::time::Instant;

use gpufence_cgroup::maps::{GrantKey, GrantValue, GrantsMap};
use gpufence_model::config::{Config, ConfigOrigin};
use gpufence_model::device::{Access, DevNum};
use gpufence_node::job::prolog::{self, PrologEnv};
use gpufence_node::{holders::scan, host::fence_ops, job::epilog, Node};
use gpufence_tests::TestEnv;

/// One row: what the node held and the medians, seconds.
#[derive(Debug, Clone)]
pub struct GrowthRow {
    /// `processes`, `descriptors` or `grants`.
    pub axis: &'static str,
    /// The value on that axis.
    pub value: usize,
    /// Processes on the machine during the row.
    pub total_procs: usize,
    /// `prolog::run`, median.
    pub prolog_s: f64,
    /// `epilog::run`, median.
    pub epilog_s: f64,
    /// The Epilog's scan alone, median.
    pub scan_s: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Writes `n` grants of other jobs (job ids from 1,000,000 on, cgroup ids
/// no cgroup has) into the fence's `grants` map.
fn fill_grants(bpffs: &std::path::Path, n: usize) {
    let grants = gpufence_cgroup::Fence::open_map::<GrantsMap>(bpffs).expect("grants pin");
    for i in 0..n {
        let key = GrantKey::new((1 << 40) + i as u64, DevNum::new(195, (i % 8) as u32));
        let value = GrantValue::new(Access::RW, 1_000_000 + (i / 8) as u32);
        grants.update(&key, &value).expect("fill the grants map");
    }
}

/// Runs `runs` Prolog/Epilog pairs and scans on `node` as it is now.
fn measure(node: &Node, job: &mut u32, runs: usize) -> (f64, f64, f64) {
    let (mut p, mut e, mut s) = (Vec::new(), Vec::new(), Vec::new());
    let devs: BTreeSet<DevNum> = [DevNum::new(195, 0)].into();
    for _ in 0..runs {
        *job += 1;
        let env = PrologEnv {
            job_id: *job,
            uid: 0,
            gres_indices: vec![0],
            slurm_conf: None,
            node_name: None,
            cuda_visible_devices: vec![],
            options: Default::default(),
            mps: false,
        };
        let t = Instant::now();
        prolog::run(node, &env).expect("prolog");
        p.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let o = epilog::run(node, *job, None);
        e.push(t.elapsed().as_secs_f64());
        assert!(o.errors.is_empty(), "epilog: {:?}", o.errors);
        let t = Instant::now();
        let mut sc = scan::Scanner::with_pins(&node.cfg.bpffs_dir);
        let h = sc.holders(&devs);
        s.push(t.elapsed().as_secs_f64());
        assert!(sc.read_pins() && h.is_empty(), "scan: {h:?}");
    }
    (median(p), median(e), median(s))
}

/// Runs every row, `runs` times each; `procs`, `fds` (total descriptors)
/// and `grants` are the values of each axis.
pub fn run(procs: &[usize], fds: &[usize], grants: &[usize], runs: usize) -> Vec<GrowthRow> {
    let env = TestEnv::new("bench-growth");
    env.mknod("nvidia0", 195, 0);
    env.mknod("nvidiactl", 195, 255);
    let g = env.path("slurmd-G.txt");
    std::fs::write(
        &g,
        format!(
            "slurmd: Gres Name=gpu Type=(null) Count=1 Index=0 ID=7696487 File={}/nvidia0 (null)\n",
            env.path("dev").display()
        ),
    )
    .unwrap();
    let cfg = env.config(&format!(
        "layout = \"own\"\nslurmd_gres = \"{}\"\nnvml = false\nmax_grants = 131072\n[majors]\nnvidia = 195\n",
        g.display()
    ));
    let node =
        Node::new(Config::load(&cfg).expect("config"), ConfigOrigin::File(cfg)).expect("node");
    let installed = fence_ops::install(&node).expect("install the bench's fence");
    assert!(
        installed.iterators_unpinned.is_none(),
        "scan iterators not pinned: {:?}",
        installed.iterators_unpinned
    );
    let null = std::path::PathBuf::from("/dev/null");
    let mut job = 0u32;
    let mut out = Vec::new();
    let mut row = |axis: &'static str, value: usize, job: &mut u32| {
        let total_procs = scan::pids().len();
        let (p, e, s) = measure(&node, job, runs);
        eprintln!("{axis} {value}: prolog {:.2} ms", p * 1e3);
        out.push(GrowthRow {
            axis,
            value,
            total_procs,
            prolog_s: p,
            epilog_s: e,
            scan_s: s,
        });
    };
    for &n in procs {
        let pids = crate::scan::spawn_crowd(n, 20, 0, &env.path("."), &null);
        row("processes", n, &mut job);
        crate::scan::kill_crowd(&pids);
    }
    for &n in fds {
        // Up to 10,000: processes of 20 each; beyond: 1,000 processes.
        let (p, each) = if n <= 10_000 {
            (n.div_ceil(20).max(1), 20)
        } else {
            (1000, n / 1000)
        };
        let pids = crate::scan::spawn_crowd(p, each, 0, &env.path("."), &null);
        row("descriptors", p * (each / 20).max(1) * 20, &mut job);
        crate::scan::kill_crowd(&pids);
    }
    let mut filled = 0;
    for &n in grants {
        if n > filled {
            fill_grants(&env.bpffs, n - filled);
            filled = n;
        }
        row("grants", n, &mut job);
    }
    drop(node);
    drop(env);
    out
}

/// The table.
pub fn print(rows: &[GrowthRow], runs: usize) {
    println!("The Prolog's and the Epilog's cost as the node grows (in-process `prolog::run` / `epilog::run` for a one-GPU job, and the Epilog's scan alone), median of {runs}:\n");
    println!("| axis | value | processes on the node | Prolog | Epilog | scan |");
    println!("|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {} | {} | {:.2} ms | {:.2} ms | {:.2} ms |",
            r.axis,
            r.value,
            r.total_procs,
            r.prolog_s * 1e3,
            r.epilog_s * 1e3,
            r.scan_s * 1e3
        );
    }
    println!();
}
