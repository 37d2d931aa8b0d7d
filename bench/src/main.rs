//! `gpufence-bench`: gpufence's benchmarks (root). Results are printed as
//! Markdown tables with ratios measured side by side in one run; `--json
//! FILE` keeps the numbers. Benchmarks are not tests: nothing here asserts a
//! time; `--smoke` runs each briefly so CI keeps them working.
//!
//! ```text
//! gpufence-bench open [--rounds N] [--iters N] [--smoke]   open() in the kernel's device check
//! gpufence-bench scan [--crowds PxF,...] [--runs N] [--smoke] epilog scan and sweep, crowded node
//! gpufence-bench job [--runs N] [--smoke]                 srun/sbatch/Prolog/Epilog, slurmstepd RSS, map memory
//! gpufence-bench respond [--holders N,...] [--smoke]       the Epilog's response to N holders, evidence budget
//! ```
//!
//! See BENCHMARKS.md for the commands and the last results.

mod job;
mod open;
mod respond;
mod scan;

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
    /// Job path on two real one-node Slurm clusters, with and without gpufence; memory.
    Job {
        /// Alternating runs per measurement (median).
        #[arg(long, default_value_t = 20)]
        runs: usize,
        /// One run each (CI).
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
        Cmd::Job { runs, smoke } => print_job(if smoke { 1 } else { runs }, cli.json),
        Cmd::Scan {
            crowds,
            runs,
            smoke,
        } => print_scan(crowds, runs, smoke, cli.json),
        Cmd::Respond { holders, smoke } => {
            let r = respond::run(if smoke { &[20] } else { &holders });
            respond::print(&r);
            if let Some(p) = cli.json {
                let rows: Vec<serde_json::Value> = r
                    .iter()
                    .map(|x| serde_json::json!({"holders": x.holders, "budget": x.budget, "epilog_s": x.epilog_s, "left": x.left, "files": x.files, "bytes": x.bytes, "all_recorded": x.all_recorded}))
                    .collect();
                let _ = std::fs::write(p, serde_json::to_vec_pretty(&rows).unwrap_or_default());
            }
        }
        Cmd::Open {
            rounds,
            iters,
            smoke,
        } => {
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
            if let Some(p) = cli.json {
                let rows: Vec<serde_json::Value> = r
                    .iter()
                    .map(|((c, d, t), v)| serde_json::json!({"config": c.to_string(), "depth": d, "target": format!("{t:?}"), "ns": v}))
                    .collect();
                let _ = std::fs::write(p, serde_json::to_vec_pretty(&rows).unwrap_or_default());
            }
        }
    }
    ExitCode::SUCCESS
}

/// `PROCESSESxDESCRIPTORS`, e.g. `1000x1000`.
fn parse_crowd(s: &str) -> Result<(usize, usize), String> {
    let (p, f) = s
        .split_once('x')
        .ok_or_else(|| format!("{s}: expected PROCESSESxDESCRIPTORS, e.g. 1000x1000"))?;
    let n = |v: &str| v.parse::<usize>().map_err(|e| format!("{s}: {e}"));
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
            .map(|s| serde_json::json!({"procs": s.procs, "fds": s.fds, "epilog_scan_pinned_s": s.epilog_scan_pinned_s, "total_procs": s.total_procs, "epilog_scan_s": s.epilog_scan_s, "sweep_s": s.sweep_s, "epilog_scan_proc_s": s.epilog_scan_proc_s, "sweep_proc_s": s.sweep_proc_s, "epilog_scan_serial_s": s.epilog_scan_serial_s, "source": s.source, "same_holders": s.same_holders, "holders": s.holders, "sweep_findings": s.sweep_findings, "sweep_findings_proc": s.sweep_findings_proc}))
            .collect();
        let _ = std::fs::write(p, serde_json::to_vec_pretty(&rows).unwrap_or_default());
    }
}

fn print_job(runs: usize, json: Option<std::path::PathBuf>) {
    let r = job::run(runs);
    let ms = |s: f64| s * 1e3;
    println!("Job path, three one-node Slurm 22.05 clusters side by side (gpufence; nothing; empty Prolog and Epilog scripts without the plugin), each run from an idle node, median of {} rotated runs:\n", r.runs);
    println!("| measurement | with gpufence | without | empty scripts | added vs without | added vs empty scripts |");
    println!("|---|---|---|---|---|---|");
    for (what, (w, wo, sc)) in [
        ("`srun --gres=gpu:1 true`", r.srun_s),
        (
            "`sbatch --gres=gpu:1 --wrap true`, submit to gone (Epilog included)",
            r.sbatch_s,
        ),
    ] {
        println!(
            "| {what} | {:.1} ms | {:.1} ms | {:.1} ms | {:+.1} ms ({:.3}x) | {:+.1} ms ({:.3}x) |",
            ms(w),
            ms(wo),
            ms(sc),
            ms(w - wo),
            w / wo,
            ms(w - sc),
            w / sc
        );
    }
    println!(
        "| Prolog alone (`gpufence-prolog`) | {:.1} ms | | | | |",
        ms(r.prolog_s)
    );
    println!(
        "| Epilog alone (`gpufence-epilog`) | {:.1} ms | | | | |",
        ms(r.epilog_s)
    );
    println!(
        "| Prolog + Epilog | {:.1} ms | | | {:.1}% of `srun true` without | |",
        ms(r.prolog_s + r.epilog_s),
        100.0 * (r.prolog_s + r.epilog_s) / r.srun_s.1
    );
    println!(
        "| step slurmstepd VmRSS | {} KiB | {} KiB | | {:+} KiB | |",
        r.stepd_rss_kib.0,
        r.stepd_rss_kib.1,
        r.stepd_rss_kib.0 as i64 - r.stepd_rss_kib.1 as i64
    );
    println!("\nPinned maps at their configured bounds (fdinfo `memlock:`):\n");
    println!("| map | max_entries | memlock |");
    println!("|---|---|---|");
    let mut total = 0;
    for (name, max, mem) in &r.maps {
        total += mem;
        println!("| {name} | {max} | {:.1} KiB |", *mem as f64 / 1024.0);
    }
    println!("| all | | {:.1} MiB |", total as f64 / 1048576.0);
    if let Some(p) = json {
        let v = serde_json::json!({
            "runs": r.runs,
            "srun_s": {"gpufence": r.srun_s.0, "without": r.srun_s.1, "empty_scripts": r.srun_s.2},
            "sbatch_s": {"gpufence": r.sbatch_s.0, "without": r.sbatch_s.1, "empty_scripts": r.sbatch_s.2},
            "prolog_s": r.prolog_s,
            "epilog_s": r.epilog_s,
            "stepd_rss_kib": [r.stepd_rss_kib.0, r.stepd_rss_kib.1],
            "maps": r.maps.iter().map(|(n, m, b)| serde_json::json!({"map": n, "max_entries": m, "memlock": b})).collect::<Vec<_>>(),
        });
        let _ = std::fs::write(p, serde_json::to_vec_pretty(&v).unwrap_or_default());
    }
}
