//! What the Prolog's several-types query costs a job start against a
//! slurmctld holding many jobs (README.md, "What gpufence asks of Slurm").
//!
//! One node of this host's Slurm (the test cluster, `layout = "own"`), two
//! GPU types (`gpu:a`, `gpu:b`, mknod-made). The Prolog slurmd runs is
//! `gpufence-bench time-exec FILE -- gpufence-prolog --config C`, with C
//! alternating run by run (the order flips each round) between:
//!
//! - **query**: the node's own `slurmd -G` list (cached at slurmd start):
//!   two types, so the Prolog asks slurmctld (`scontrol --json show job`,
//!   on 22.05 then `squeue --json`, which dumps every job);
//! - **no query**: the same list from a file (`slurmd_gres`) with every
//!   GPU of type `a`: one type, so the Prolog asks nothing.
//!
//! The job is `srun --gres=gpu:a:1 true`, from an idle node. Between queue
//! sizes the test user submits held one-node jobs (`sbatch --hold`), which
//! stay pending and which 22.05's `squeue --json` lists each time.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpufence_tests::cluster::{Cluster, ClusterSpec};
use gpufence_tests::TestEnv;

/// One queue size's medians.
#[derive(Clone, Debug, Default)]
pub struct CtldRow {
    /// Jobs pending in slurmctld (held) while measuring.
    pub queued: usize,
    /// Median Prolog wall time with the query, in s.
    pub query_s: f64,
    /// Median Prolog wall time without it, in s.
    pub no_query_s: f64,
    /// Median `srun` wall time with the query, in s.
    pub srun_query_s: f64,
    /// Median `srun` wall time without it, in s.
    pub srun_no_query_s: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn write_exec(path: &Path, text: &str) {
    let tmp = path.with_extension("bench-tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// The node idle (`sinfo`), at most 60 s.
fn wait_idle(c: &Cluster) {
    let ok = Cluster::wait_for(Duration::from_secs(60), || {
        let o = c.admin("sinfo", &["-h", "-N", "-o", "%T"]);
        String::from_utf8_lossy(&o.stdout).trim() == "idle"
    });
    assert!(ok, "node never idle:\n{}", c.log_tail("slurmd.log"));
}

fn srun(c: &Cluster) -> f64 {
    wait_idle(c);
    let t = Instant::now();
    let o = c.as_user("srun", &["--gres=gpu:a:1", "true"]);
    let s = t.elapsed().as_secs_f64();
    assert!(
        o.status.success(),
        "srun: {o:?}\n{}",
        c.log_tail("slurmd.log")
    );
    s
}

/// Submits held jobs until slurmctld holds `n` of them (4 submitters).
fn fill_queue(c: &Cluster, have: usize, n: usize) {
    if n <= have {
        return;
    }
    let more = n - have;
    let script = format!(
        "seq {more} | xargs -P 4 -I{{}} sbatch --hold --quiet --output=/dev/null --wrap true"
    );
    let o = c.as_user("sh", &["-c", &script]);
    assert!(o.status.success(), "sbatch --hold x{more}: {o:?}");
    let o = c.admin("squeue", &["-h", "-t", "PD", "-o", "%i"]);
    let pending = String::from_utf8_lossy(&o.stdout).lines().count();
    assert!(pending >= n, "{pending} jobs pending, wanted {n}");
}

/// Runs the benchmark: `runs` jobs per mode at each queue size.
pub fn run(queued: &[usize], runs: usize) -> Vec<CtldRow> {
    let env = TestEnv::new("bench-ctld");
    let a = env.mknod("nvidia0", 195, 0);
    let b = env.mknod("nvidia1", 195, 1);
    let c = Cluster::start_with(
        &env,
        &ClusterSpec {
            gres_conf: format!(
                "Name=gpu Type=a File={}\nName=gpu Type=b File={}\n",
                a.display(),
                b.display()
            ),
            node_gres: "gpu:a:1,gpu:b:1".into(),
            gpufence_extra: "layout = \"own\"\nnvml = false\n[majors]\nnvidia = 195\n".into(),
            port_base: 19517,
            ..ClusterSpec::default()
        },
    );
    // The plugin cached slurmd -G at slurmd start: the same list with one
    // type, for the configuration without the query.
    // (`slurmd-G.txt`, or `slurmd-G-<node>.txt` for a slurmd started with -N.)
    let cached = std::fs::read_dir(env.path("state"))
        .expect("state_dir")
        .flatten()
        .find(|e| e.file_name().to_string_lossy().starts_with("slurmd-G"))
        .and_then(|e| std::fs::read_to_string(e.path()).ok())
        .expect("slurmd -G cache (written by the plugin at slurmd start)");
    let one_type: String = cached
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| format!("{}\n", l.replace("Type=b", "Type=a")))
        .collect();
    assert!(one_type.contains("Type=a") && !one_type.contains("Type=b"));
    let list = env.path("slurmd-G-one-type.txt");
    std::fs::write(&list, one_type).unwrap();
    let no_query: PathBuf = env.path("gpufence-no-query.toml");
    std::fs::write(
        &no_query,
        format!(
            "slurmd_gres = \"{}\"\n{}",
            list.display(),
            std::fs::read_to_string(&c.config).unwrap()
        ),
    )
    .unwrap();
    let exe = std::env::current_exe().expect("current_exe");
    gpufence_tests::cluster::copy_exec(&exe, &c.bin.join("gpufence-bench"));
    let times = env.path("times");
    std::fs::create_dir_all(&times).unwrap();
    let configs = [c.config.clone(), no_query];
    let file = |k: usize, q: usize| times.join(format!("{k}-{q}.ns"));
    let set = |k: usize, q: usize| {
        write_exec(
            &c.bin.join("prolog.sh"),
            &format!(
                "#!/bin/sh\nexec {} time-exec {} -- {} --config {}\n",
                c.bin.join("gpufence-bench").display(),
                file(k, q).display(),
                c.bin.join("gpufence-prolog").display(),
                configs[k].display()
            ),
        );
    };
    let mut rows = Vec::new();
    let mut have = 0;
    for &q in queued {
        fill_queue(&c, have, q);
        have = have.max(q);
        // A first job in each mode, not counted (caches warm).
        for k in 0..2 {
            set(k, usize::MAX);
            srun(&c);
        }
        let mut s: [Vec<f64>; 2] = Default::default();
        for round in 0..runs {
            for j in 0..2 {
                let k = (j + round) % 2;
                set(k, q);
                s[k].push(srun(&c));
            }
        }
        let prolog = |k: usize| {
            median(
                std::fs::read_to_string(file(k, q))
                    .unwrap_or_default()
                    .lines()
                    .filter_map(|l| l.trim().parse::<u64>().ok())
                    .map(|ns| ns as f64 / 1e9)
                    .collect(),
            )
        };
        let [s_query, s_none] = s;
        rows.push(CtldRow {
            queued: q,
            query_s: prolog(0),
            no_query_s: prolog(1),
            srun_query_s: median(s_query),
            srun_no_query_s: median(s_none),
        });
        eprintln!("{q} queued done");
    }
    let _ = c.admin(
        "scancel",
        &["--state=PENDING", "-u", gpufence_tests::cluster::TEST_USER],
    );
    drop(c);
    rows
}

/// The Markdown table.
pub fn print(rows: &[CtldRow], runs: usize) {
    println!(
        "The Prolog of `srun --gres=gpu:a:1 true` on a node with two GPU types (query: the Prolog asks slurmctld; no query: the same GPUs listed as one type), medians of {runs} runs per mode, alternating:\n"
    );
    println!("| jobs queued (held) | Prolog, no query | Prolog, query | added by the query | srun, no query | srun, query |");
    println!("|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {:.1} ms | {:.1} ms | {:+.1} ms | {:.0} ms | {:.0} ms |",
            r.queued,
            r.no_query_s * 1e3,
            r.query_s * 1e3,
            (r.query_s - r.no_query_s) * 1e3,
            r.srun_no_query_s * 1e3,
            r.srun_query_s * 1e3
        );
    }
}
