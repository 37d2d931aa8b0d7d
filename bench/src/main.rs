//! `gpufence-bench`: gpufence's benchmarks (root). Results are printed as
//! Markdown tables with ratios measured side by side in one run; `--json
//! FILE` keeps the numbers. Benchmarks are not tests: nothing here asserts a
//! time; `--smoke` runs each briefly so CI keeps them working.
//!
//! ```text
//! gpufence-bench open [--rounds N] [--iters N] [--smoke]
//! gpufence-bench scan [--procs N,...] [--smoke]
//! gpufence-bench job [--runs N] [--smoke]
//! gpufence-bench memory
//! ```

mod open;
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
    /// Epilog descriptor scan and full sweep with N extra processes of 20 descriptors each.
    Scan {
        /// Extra process counts.
        #[arg(long, value_delimiter = ',', default_values_t = [2000usize, 10000])]
        procs: Vec<usize>,
        /// Runs per count (median).
        #[arg(long, default_value_t = 5)]
        runs: usize,
        /// 50 processes, one run (CI).
        #[arg(long)]
        smoke: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("gpufence-bench: run as root (it attaches BPF programs to its own cgroups)");
        return ExitCode::from(2);
    }
    match cli.cmd {
        Cmd::Scan { procs, runs, smoke } => print_scan(procs, runs, smoke, cli.json),
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

fn print_scan(procs: Vec<usize>, runs: usize, smoke: bool, json: Option<std::path::PathBuf>) {
    let (procs, runs) = if smoke { (vec![50], 1) } else { (procs, runs) };
    let r = scan::run(&procs, runs);
    println!("Epilog descriptor scan and full sweep, median of {runs} runs, release build:\n");
    println!("| extra processes (20 fds each) | processes on the node | epilog scan | full sweep | holders found | sweep findings |");
    println!("|---|---|---|---|---|---|");
    for s in &r {
        println!(
            "| {} | {} | {:.0} ms | {:.0} ms | {} | {} |",
            s.procs,
            s.total_procs,
            s.epilog_scan_s * 1e3,
            s.sweep_s * 1e3,
            s.holders,
            s.sweep_findings
        );
    }
    if let Some(p) = json {
        let rows: Vec<serde_json::Value> = r
            .iter()
            .map(|s| serde_json::json!({"procs": s.procs, "total_procs": s.total_procs, "epilog_scan_s": s.epilog_scan_s, "sweep_s": s.sweep_s, "holders": s.holders, "sweep_findings": s.sweep_findings}))
            .collect();
        let _ = std::fs::write(p, serde_json::to_vec_pretty(&rows).unwrap_or_default());
    }
}
