//! `gpufence-bench`: gpufence's benchmarks (root). Results are printed as
//! Markdown tables with ratios measured side by side in one run; `--json
//! FILE` keeps the numbers. Benchmarks are not tests: nothing here asserts a
//! time; `--smoke` runs each briefly so CI keeps them working.
//!
//! ```text
//! gpufence-bench open [--rounds N] [--iters N] [--smoke]   open() in the kernel's device check
//! gpufence-bench scan [--crowds PxF,...] [--runs N] [--smoke] epilog scan and sweep, crowded node
//! gpufence-bench job [--runs N] [--bursts N] [--burst-jobs N] [--releases host,sid] [--smoke]
//!                                                         srun/Prolog/Epilog/bursts on real cgroup/v2 nodes, RSS, map memory
//! gpufence-bench growth [--procs N,..] [--fds N,..] [--grants N,..] [--smoke]  Prolog/Epilog cost as the node grows
//! gpufence-bench respond [--holders N,...] [--smoke]       the Epilog's response to N holders, evidence budget
//! gpufence-bench flood [--procs N,..] [--fds N,..] [--runs N] [--smoke]
//!                                                         a co-tenant's scan while another job floods its tables
//! gpufence-bench ctld [--queued N,..] [--runs N] [--smoke]  the Prolog's several-types query against a full slurmctld
//! gpufence-bench door [--runs N] [--smoke]                 the job's door (credentials, images) off vs warn
//! gpufence-bench deadline [--deadlines default,MS,..] [--runs N] [--smoke]
//!                                                         the Epilog against a SIGTERM-ignoring holder, per deadline
//! ```
//!
//! See BENCHMARKS.md for the commands and the last results.

mod ctld;
mod deadline;
mod door;
mod flood;
mod growth;
mod job;
mod open;
mod respond;
mod scan;
mod v1;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "gpufence-bench", about = "gpufence benchmarks (root)")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// Also write the numbers as JSON here.
    #[arg(long, global = true)]
    json: Option<std::path::PathBuf>,
}

#[derive(Subcommand)]
enum Cmd {
    /// open() cost: floor, Slurm-style allow-lists, gpufence with many grants, depths 3/8/16.
    Open {
        /// Rounds (median over rounds).
        #[arg(long, default_value_t = 15)]
        rounds: usize,
        /// opens per measurement.
        #[arg(long, default_value_t = 20_000)]
        iters: u32,
        /// One short round of a few configurations (CI).
        #[arg(long)]
        smoke: bool,
    },
    /// Epilog descriptor scan and full sweep with crowds of extra processes.
    Scan {
        /// Crowds, each `PROCESSESxDESCRIPTORS` (descriptors each, whole
        /// groups of 20).
        #[arg(long, value_delimiter = ',', default_values = ["2000x20", "10000x20", "1000x1000"], value_parser = parse_crowd)]
        crowds: Vec<(usize, usize)>,
        /// Runs per count (median).
        #[arg(long, default_value_t = 5)]
        runs: usize,
        /// 50 processes, one run (CI).
        #[arg(long)]
        smoke: bool,
    },
    /// Job path on real cgroup/v2 Slurm nodes: Slurm alone, empty Prolog/Epilog, gpufence; bursts; memory.
    Job {
        /// `srun` runs per configuration (median).
        #[arg(long, default_value_t = 24)]
        runs: usize,
        /// Bursts per configuration (median).
        #[arg(long, default_value_t = 3)]
        bursts: usize,
        /// Jobs per burst (a job array).
        #[arg(long, default_value_t = 200)]
        burst_jobs: usize,
        /// Releases: `host` (this machine's Slurm) and Debian suites with a
        /// root and plugin (`trixie`, `sid`).
        #[arg(long, value_delimiter = ',', default_values = ["host", "sid"])]
        releases: Vec<String>,
        /// One run, one burst of 10 jobs, on the host's release (CI).
        #[arg(long)]
        smoke: bool,
    },
    /// The Epilog's response to N holders of one job's GPU, default evidence budget against an unbounded one.
    Respond {
        /// Holder counts.
        #[arg(long, value_delimiter = ',', default_values_t = [100usize, 1000])]
        holders: Vec<usize>,
        /// 20 holders (CI).
        #[arg(long)]
        smoke: bool,
    },
    /// The Epilog against one holder that ignores SIGTERM, with the default waits, per deadline (epilog_deadline_ms).
    Deadline {
        /// Deadlines in ms; `default` for none set (60 s without slurm.conf).
        #[arg(long, value_delimiter = ',', default_values = ["default", "10000", "3000", "1500"], value_parser = parse_deadline)]
        deadlines: Vec<Option<u64>>,
        /// Runs per deadline (interleaved).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// One run at 1500 ms (CI).
        #[arg(long)]
        smoke: bool,
    },
    /// Prolog and Epilog cost against processes, descriptors and grants in the map.
    Growth {
        /// Extra processes (20 descriptors each).
        #[arg(long, value_delimiter = ',', default_values_t = [1000usize, 10000, 30000])]
        procs: Vec<usize>,
        /// Extra descriptors in all.
        #[arg(long, value_delimiter = ',', default_values_t = [10000usize, 100000, 1000000])]
        fds: Vec<usize>,
        /// Grants of other jobs in the map.
        #[arg(long, value_delimiter = ',', default_values_t = [1usize, 1000, 100000])]
        grants: Vec<usize>,
        /// Runs per row (median).
        #[arg(long, default_value_t = 7)]
        runs: usize,
        /// Small values, one run (CI).
        #[arg(long)]
        smoke: bool,
    },
    /// A co-tenant's scan for its GPU while another job floods descriptor tables (copies of its GPU; bare io_uring rings), now and before further passes.
    Flood {
        /// Flooding processes.
        #[arg(long, value_delimiter = ',', default_values_t = [20usize, 64])]
        procs: Vec<usize>,
        /// Descriptors in each flooding process's table.
        #[arg(long, value_delimiter = ',', default_values_t = [19_002usize, 131_072])]
        fds: Vec<usize>,
        /// Runs per row (median).
        #[arg(long, default_value_t = 5)]
        runs: usize,
        /// 2 processes of 2,500 descriptors, one run (CI).
        #[arg(long)]
        smoke: bool,
    },
    /// The Prolog's several-types query (slurmctld) against held jobs in the queue, with and without it.
    Ctld {
        /// Jobs held in the queue while measuring.
        #[arg(long, value_delimiter = ',', default_values_t = [0usize, 1000, 5000])]
        queued: Vec<usize>,
        /// Jobs per mode and queue size (median).
        #[arg(long, default_value_t = 15)]
        runs: usize,
        /// 0 and 20 jobs queued, one run (CI).
        #[arg(long)]
        smoke: bool,
    },
    /// The job's door (credentials in the batch script and environment, container images): off against warn, per input size.
    Door {
        /// Runs per mode and input (median).
        #[arg(long, default_value_t = 41)]
        runs: usize,
        /// Three runs (CI).
        #[arg(long)]
        smoke: bool,
    },
    /// Where a pinned scan's time goes (pieces timed alone).
    #[command(hide = true)]
    ScanProfile {
        /// Extra processes.
        #[arg(long, default_value_t = 10_000)]
        procs: usize,
        /// Descriptors each.
        #[arg(long, default_value_t = 20)]
        fds: usize,
        /// Runs (median).
        #[arg(long, default_value_t = 7)]
        runs: usize,
    },
    /// Run a command and append its wall time in ns to FILE (the job benchmark's Prolog/Epilog wrapper).
    #[command(hide = true)]
    TimeExec {
        /// Where to append.
        file: std::path::PathBuf,
        /// The command, after `--`.
        #[arg(last = true, required = true)]
        cmd: Vec<std::ffi::OsString>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("gpufence-bench: run as root (it attaches BPF programs to its own cgroups)");
        return ExitCode::from(2);
    }
    if let Cmd::TimeExec { file, cmd } = &cli.cmd {
        return ExitCode::from(job::time_exec(file, cmd));
    }
    match cli.cmd {
        Cmd::TimeExec { .. } => {}
        Cmd::Job {
            runs,
            bursts,
            burst_jobs,
            releases,
            smoke,
        } => return bench_job(runs, bursts, burst_jobs, releases, smoke, cli.json),
        Cmd::Growth {
            procs,
            fds,
            grants,
            runs,
            smoke,
        } => bench_growth(procs, fds, grants, runs, smoke, cli.json),
        Cmd::Scan {
            crowds,
            runs,
            smoke,
        } => print_scan(crowds, runs, smoke, cli.json),
        Cmd::Respond { holders, smoke } => bench_respond(holders, smoke, cli.json),
        Cmd::Ctld {
            queued,
            runs,
            smoke,
        } => bench_ctld(queued, runs, smoke, cli.json),
        Cmd::Deadline {
            deadlines,
            runs,
            smoke,
        } => bench_deadline(deadlines, runs, smoke, cli.json),
        Cmd::Door { runs, smoke } => {
            let runs = if smoke { 3 } else { runs };
            let r = door::run(runs);
            door::print(&r, runs);
            if let Some(p) = cli.json {
                let rows: Vec<serde_json::Value> = r
                    .iter()
                    .map(|x| serde_json::json!({"input": x.input, "script_bytes": x.script_bytes, "env_vars": x.env_vars, "off_ms": x.off_ms, "warn_ms": x.warn_ms, "warn_p95_ms": x.warn_p95_ms, "warm_ms": x.warm_ms, "all_rules_ms": x.all_rules_ms, "rules_compiled": x.compiled, "lines": x.lines}))
                    .collect();
                let _ = std::fs::write(p, serde_json::to_vec_pretty(&rows).unwrap_or_default());
            }
        }
        Cmd::ScanProfile { procs, fds, runs } => scan::profile(procs, fds, runs),
        Cmd::Flood {
            procs,
            fds,
            runs,
            smoke,
        } => bench_flood(procs, fds, runs, smoke, cli.json),
        Cmd::Open {
            rounds,
            iters,
            smoke,
        } => bench_open(rounds, iters, smoke, cli.json),
    }
    ExitCode::SUCCESS
}

/// `gpufence-bench job`: each release in turn, then one table per release;
/// exit 2 for a release that cannot be set up.
fn bench_job(
    runs: usize,
    bursts: usize,
    burst_jobs: usize,
    releases: Vec<String>,
    smoke: bool,
    json: Option<std::path::PathBuf>,
) -> ExitCode {
    let (runs, bursts, burst_jobs, releases) = if smoke {
        (1, 1, 10, vec!["host".to_string()])
    } else {
        (runs, bursts, burst_jobs, releases)
    };
    let mut results = Vec::new();
    for name in &releases {
        match job::Release::named(name) {
            Ok(rel) => {
                results.push(job::run(&rel, runs, bursts, burst_jobs));
                eprintln!("{name} done");
            }
            Err(e) => {
                eprintln!("gpufence-bench job: {e}");
                return ExitCode::from(2);
            }
        }
    }
    print_job(&results, json);
    ExitCode::SUCCESS
}

/// `gpufence-bench growth`: Prolog and Epilog cost as processes,
/// descriptors and grants grow.
fn bench_growth(
    procs: Vec<usize>,
    fds: Vec<usize>,
    grants: Vec<usize>,
    runs: usize,
    smoke: bool,
    json: Option<std::path::PathBuf>,
) {
    let (procs, fds, grants, runs) = if smoke {
        (vec![50], vec![1000], vec![1, 100], 1)
    } else {
        (procs, fds, grants, runs)
    };
    let r = growth::run(&procs, &fds, &grants, runs);
    growth::print(&r, runs);
    if let Some(p) = json {
        let rows: Vec<serde_json::Value> = r
            .iter()
            .map(|x| serde_json::json!({"axis": x.axis, "value": x.value, "total_procs": x.total_procs, "prolog_s": x.prolog_s, "epilog_s": x.epilog_s, "scan_s": x.scan_s}))
            .collect();
        let _ = std::fs::write(p, serde_json::to_vec_pretty(&rows).unwrap_or_default());
    }
}

/// `gpufence-bench ctld`: the Prolog with and without the several-types
/// query, at each queue size.
fn bench_ctld(queued: Vec<usize>, runs: usize, smoke: bool, json: Option<std::path::PathBuf>) {
    let (queued, runs) = if smoke {
        (vec![0, 20], 1)
    } else {
        (queued, runs.max(1))
    };
    let r = ctld::run(&queued, runs);
    ctld::print(&r, runs);
    if let Some(p) = json {
        let rows: Vec<serde_json::Value> = r
            .iter()
            .map(|x| serde_json::json!({"queued": x.queued, "prolog_query_s": x.query_s, "prolog_no_query_s": x.no_query_s, "srun_query_s": x.srun_query_s, "srun_no_query_s": x.srun_no_query_s}))
            .collect();
        let _ = std::fs::write(p, serde_json::to_vec_pretty(&rows).unwrap_or_default());
    }
}

/// A `--deadlines` item: `default` (none set) or ms.
fn parse_deadline(s: &str) -> Result<Option<u64>, String> {
    match s {
        "default" => Ok(None),
        _ => s
            .parse()
            .map(Some)
            .map_err(|e| format!("{s}: {e} (ms, or default)")),
    }
}

/// `gpufence-bench deadline`: the Epilog against a SIGTERM-ignoring
/// holder, per deadline.
fn bench_deadline(
    deadlines: Vec<Option<u64>>,
    runs: usize,
    smoke: bool,
    json: Option<std::path::PathBuf>,
) {
    let (asked, runs) = if smoke {
        (vec![Some(1500)], 1)
    } else {
        (deadlines, runs.max(1))
    };
    let r = deadline::run(&asked, runs);
    deadline::print(&asked, &r);
    if let Some(p) = json {
        let rows: Vec<serde_json::Value> = r
            .iter()
            .map(|x| serde_json::json!({"deadline_ms": x.deadline.ms, "from": x.deadline.from, "waits_ms": x.waits_ms, "epilog_ms": x.epilog_ms, "ended_by": x.ended_by, "gone": x.gone, "clean": x.clean, "cuts": x.cuts}))
            .collect();
        let _ = std::fs::write(p, serde_json::to_vec_pretty(&rows).unwrap_or_default());
    }
}

/// `gpufence-bench respond`: the Epilog's response to N holders.
fn bench_respond(holders: Vec<usize>, smoke: bool, json: Option<std::path::PathBuf>) {
    let r = respond::run(if smoke { &[20] } else { &holders });
    respond::print(&r);
    if let Some(p) = json {
        let rows: Vec<serde_json::Value> = r
            .iter()
            .map(|x| serde_json::json!({"holders": x.holders, "budget": x.budget, "epilog_s": x.epilog_s, "left": x.left, "files": x.files, "bytes": x.bytes, "all_recorded": x.all_recorded}))
            .collect();
        let _ = std::fs::write(p, serde_json::to_vec_pretty(&rows).unwrap_or_default());
    }
}

/// `gpufence-bench open`: open() cost per configuration and cgroup depth,
/// as a Markdown table with ratios.
fn bench_open(rounds: usize, iters: u32, smoke: bool, json: Option<std::path::PathBuf>) {
    use open::{Config::*, Target};
    let (configs, depths, rounds, iters) = if smoke {
        (vec![Floor, Empty, Slurm(8), Fence(1000)], vec![8], 1, 500)
    } else {
        (
            vec![
                Floor,
                Empty,
                Slurm(8),
                Slurm(64),
                Fence(1),
                Fence(1000),
                Fence(100_000),
            ],
            vec![3, 8, 16],
            rounds,
            iters,
        )
    };
    let r = open::run(&configs, &depths, rounds, iters);
    println!("open()+close() per call, median of {rounds} rounds x {iters} calls, ns; ratios to the floor, to the empty program and to Slurm-style 8 devices at the same depth and device:\n");
    println!("| configuration | depth | /dev/null | granted (ENXIO) | denied (EPERM) |");
    println!("|---|---|---|---|---|");
    for c in &configs {
        for d in &depths {
            let cell = |t: Target| {
                let v = r[&(*c, *d, t)];
                let floor = r[&(Floor, *d, t)];
                let slurm = r.get(&(Slurm(8), *d, t)).copied();
                let empty = r.get(&(Empty, *d, t)).copied();
                format!(
                    "{v:.0} ({:.3}x floor{}{})",
                    v / floor,
                    empty
                        .map(|s| format!(", {:.3}x empty", v / s))
                        .unwrap_or_default(),
                    slurm
                        .map(|s| format!(", {:.3}x slurm8", v / s))
                        .unwrap_or_default()
                )
            };
            println!(
                "| {c} | {d} | {} | {} | {} |",
                cell(Target::Null),
                cell(Target::Granted),
                cell(Target::Denied)
            );
        }
    }
    if let Some(p) = json {
        let rows: Vec<serde_json::Value> = r
            .iter()
            .map(|((c, d, t), v)| serde_json::json!({"config": c.to_string(), "depth": d, "target": format!("{t:?}"), "ns": v}))
            .collect();
        let _ = std::fs::write(p, serde_json::to_vec_pretty(&rows).unwrap_or_default());
    }
}

/// Why a `--crowd` value is refused ([`parse_crowd`]).
#[derive(Debug, thiserror::Error)]
enum CrowdError {
    /// No `x` between the two numbers.
    #[error("{0}: expected PROCESSESxDESCRIPTORS, e.g. 1000x1000")]
    Shape(String),
    /// A number that does not parse.
    #[error("{value}: {source}")]
    Number {
        /// The whole value.
        value: String,
        /// Why.
        source: std::num::ParseIntError,
    },
}

/// `PROCESSESxDESCRIPTORS`, e.g. `1000x1000`.
fn parse_crowd(s: &str) -> Result<(usize, usize), CrowdError> {
    let (p, f) = s
        .split_once('x')
        .ok_or_else(|| CrowdError::Shape(s.to_string()))?;
    let n = |v: &str| {
        v.parse::<usize>().map_err(|source| CrowdError::Number {
            value: s.to_string(),
            source,
        })
    };
    Ok((n(p)?, n(f)?))
}

fn print_scan(
    crowds: Vec<(usize, usize)>,
    runs: usize,
    smoke: bool,
    json: Option<std::path::PathBuf>,
) {
    let (crowds, runs) = if smoke {
        (vec![(50, 20), (10, 200)], 1)
    } else {
        (crowds, runs)
    };
    let r = scan::run(&crowds, runs);
    scan::print_pinned(&r, runs);
    scan::print_side_by_side(&r, runs);
    println!("Epilog descriptor scan and full sweep (iterators), median of {runs} runs:\n");
    println!("| extra processes x descriptors | processes on the node | epilog scan (pinned) | full sweep | holders found | sweep findings |");
    println!("|---|---|---|---|---|---|");
    for s in &r {
        println!(
            "| {} x {} | {} | {:.1} ms | {:.0} ms | {} | {} |",
            s.procs,
            s.fds,
            s.total_procs,
            s.epilog_scan_pinned_s * 1e3,
            s.sweep_s * 1e3,
            s.holders,
            s.sweep_findings
        );
    }
    if let Some(p) = json {
        let rows: Vec<serde_json::Value> = r
            .iter()
            .map(|s| serde_json::json!({"procs": s.procs, "fds": s.fds, "epilog_scan_pinned_s": s.epilog_scan_pinned_s, "epilog_scan_v1_s": s.epilog_scan_v1_s, "pinned_by_cpus": s.pinned_by_cpus, "total_procs": s.total_procs, "epilog_scan_s": s.epilog_scan_s, "sweep_s": s.sweep_s, "epilog_scan_proc_s": s.epilog_scan_proc_s, "sweep_proc_s": s.sweep_proc_s, "epilog_scan_serial_s": s.epilog_scan_serial_s, "source": s.source, "same_holders": s.same_holders, "holders": s.holders, "sweep_findings": s.sweep_findings, "sweep_findings_proc": s.sweep_findings_proc}))
            .collect();
        let _ = std::fs::write(p, serde_json::to_vec_pretty(&rows).unwrap_or_default());
    }
}

fn print_job(results: &[job::JobResult], json: Option<std::path::PathBuf>) {
    let ms = |s: f64| s * 1e3;
    for r in results {
        println!(
            "Slurm {} ({}), real cgroup/v2 node, 8 GPUs, PrologFlags=Alloc,Contain; medians of {} srun runs per configuration (empty scripts and gpufence alternating on one node), bursts of {} jobs:\n",
            r.version, r.release, r.runs, r.burst_jobs
        );
        println!(
            "| measurement | Slurm alone | empty scripts | gpufence | gpufence vs empty scripts |"
        );
        println!("|---|---|---|---|---|");
        println!(
            "| `srun --gres=gpu:1 true` | {:.1} ms | {:.1} ms | {:.1} ms | {:+.1} ms ({:.3}x) |",
            ms(r.srun_s[0]),
            ms(r.srun_s[1]),
            ms(r.srun_s[2]),
            ms(r.srun_s[2] - r.srun_s[1]),
            r.srun_s[2] / r.srun_s[1]
        );
        println!(
            "| Prolog program, idle node (`/bin/true` / `gpufence-prolog`) | | {:.2} ms | {:.2} ms | {:+.2} ms |",
            ms(r.prolog_s[0]),
            ms(r.prolog_s[1]),
            ms(r.prolog_s[1] - r.prolog_s[0])
        );
        println!(
            "| Epilog program, idle node (`/bin/true` / `gpufence-epilog`) | | {:.2} ms | {:.2} ms | {:+.2} ms |",
            ms(r.epilog_s[0]),
            ms(r.epilog_s[1]),
            ms(r.epilog_s[1] - r.epilog_s[0])
        );
        println!(
            "| Prolog program during the bursts | | {:.2} ms | {:.2} ms | {:+.2} ms |",
            ms(r.burst_prolog_s[0]),
            ms(r.burst_prolog_s[1]),
            ms(r.burst_prolog_s[1] - r.burst_prolog_s[0])
        );
        println!(
            "| Epilog program during the bursts | | {:.2} ms | {:.2} ms | {:+.2} ms |",
            ms(r.burst_epilog_s[0]),
            ms(r.burst_epilog_s[1]),
            ms(r.burst_epilog_s[1] - r.burst_epilog_s[0])
        );
        println!(
            "| burst of {} `true` jobs, submit to all gone | {:.2} s | {:.2} s | {:.2} s | {:+.2} s ({:.3}x) |",
            r.burst_jobs,
            r.burst_s[0],
            r.burst_s[1],
            r.burst_s[2],
            r.burst_s[2] - r.burst_s[1],
            r.burst_s[2] / r.burst_s[1]
        );
        println!(
            "| step slurmstepd VmRSS | | {} KiB | {} KiB | {:+} KiB |",
            r.stepd_rss_kib.1,
            r.stepd_rss_kib.0,
            r.stepd_rss_kib.0 as i64 - r.stepd_rss_kib.1 as i64
        );
        println!(
            "\nAudit log of the gpufence bursts: {}\n",
            match &r.audit_once {
                None => "each job's grant_recorded and grant_revoked once".to_string(),
                Some(e) => format!("NOT once: {e}"),
            }
        );
    }
    if let Some(r) = results.first() {
        println!("Pinned maps at their configured bounds (fdinfo `memlock:`):\n");
        println!("| map | max_entries | memlock |");
        println!("|---|---|---|");
        let mut total = 0;
        for (name, max, mem) in &r.maps {
            total += mem;
            println!("| {name} | {max} | {:.1} KiB |", *mem as f64 / 1024.0);
        }
        println!("| all | | {:.1} MiB |", total as f64 / 1048576.0);
    }
    if let Some(p) = json {
        let v: Vec<serde_json::Value> = results
            .iter()
            .map(|r| {
                serde_json::json!({
                    "release": r.release,
                    "version": r.version,
                    "runs": r.runs,
                    "srun_s": {"alone": r.srun_s[0], "empty_scripts": r.srun_s[1], "gpufence": r.srun_s[2]},
                    "prolog_s": {"empty": r.prolog_s[0], "gpufence": r.prolog_s[1]},
                    "epilog_s": {"empty": r.epilog_s[0], "gpufence": r.epilog_s[1]},
                    "burst_prolog_s": {"empty": r.burst_prolog_s[0], "gpufence": r.burst_prolog_s[1]},
                    "burst_epilog_s": {"empty": r.burst_epilog_s[0], "gpufence": r.burst_epilog_s[1]},
                    "burst_jobs": r.burst_jobs,
                    "burst_s": {"alone": r.burst_s[0], "empty_scripts": r.burst_s[1], "gpufence": r.burst_s[2]},
                    "audit_once": r.audit_once.is_none(),
                    "stepd_rss_kib": [r.stepd_rss_kib.0, r.stepd_rss_kib.1],
                    "maps": r.maps.iter().map(|(n, m, b)| serde_json::json!({"map": n, "max_entries": m, "memlock": b})).collect::<Vec<_>>(),
                })
            })
            .collect();
        let _ = std::fs::write(p, serde_json::to_vec_pretty(&v).unwrap_or_default());
    }
}

fn bench_flood(
    procs: Vec<usize>,
    fds: Vec<usize>,
    runs: usize,
    smoke: bool,
    json: Option<std::path::PathBuf>,
) {
    let (procs, fds, runs) = if smoke {
        (vec![2], vec![2500], 1)
    } else {
        (procs, fds, runs.max(1))
    };
    let r = flood::run(&procs, &fds, runs);
    flood::print(&r, runs);
    if let Some(p) = json {
        let v: Vec<serde_json::Value> = r
            .iter()
            .map(|x| serde_json::json!({"kind": x.kind, "procs": x.procs, "fds": x.fds, "now_s": x.now_s, "before_s": x.before_s, "passes": x.passes, "over_budget": x.over_budget, "before_walked": x.before_walked, "holders_now": x.holders.0, "holders_before": x.holders.1}))
            .collect();
        let _ = std::fs::write(p, serde_json::to_string_pretty(&v).unwrap_or_default());
    }
}
