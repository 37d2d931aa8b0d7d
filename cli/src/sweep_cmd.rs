//! `gpufence sweep` and `gpufence respond PID`: thin shells over
//! [`gpufence_node::sweep`] and [`gpufence_node::response::incident`].
//!
//! `gpufence sweep` prints one finding per line (`--json`: one JSON object
//! per line) on stdout, notes and errors on stderr, and exits 0 when clean,
//! 1 when a finding is at or above `--fail-on` (default: the config's
//! `sweep_fail_severity`), 2 when nothing fails but the sweep could not do
//! all it was asked (textfile, state) or the arguments are wrong, and 2
//! whatever it found when a drain it was asked for (`--drain`) failed.
//! That fits Slurm's `HealthCheckProgram` (with `--drain`, since slurmd
//! does not act on the exit status) and NHC (which does).
//!
//! `gpufence respond PID` exits 0 when the tree is gone and every step
//! worked, 1 when something survived or a step failed, 2 when it refused.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

use gpufence_node::sweep::{self, Severity, SweepRequest};
use gpufence_node::{response::incident, Node};

/// `gpufence sweep`.
#[derive(Args, Debug, Clone, Default)]
pub struct SweepArgs {
    /// One JSON object per finding, one per line.
    #[arg(long)]
    pub json: bool,
    /// Write a node_exporter textfile (atomically) to FILE.
    #[arg(long, value_name = "FILE")]
    pub prometheus: Option<PathBuf>,
    /// Drain the node (SLURMD_NODENAME, else the host name) with a reason
    /// naming the worst finding when a finding is at or above the threshold.
    #[arg(long)]
    pub drain: bool,
    /// Exit non-zero for findings at or above this severity (info, low,
    /// medium, high, critical); default: the config's sweep_fail_severity.
    #[arg(long, value_name = "SEVERITY")]
    pub fail_on: Option<String>,
    /// Check only processes in this cgroup subtree (relative to the cgroup2
    /// mount); the node-wide checks still run.
    #[arg(long, value_name = "PATH")]
    pub cgroup: Option<String>,
    /// Report denied opens new since this consumer's previous sweep (its
    /// own record, e.g. `--cursor health` for the health check) instead of
    /// since any sweep's.
    #[arg(long, value_name = "NAME")]
    pub cursor: Option<String>,
}

/// `gpufence respond`.
#[derive(Args, Debug, Clone, Default)]
pub struct RespondArgs {
    /// The process whose tree to stop, preserve and kill.
    pub pid: i32,
    /// Drain the node afterwards (SLURMD_NODENAME, else the host name).
    #[arg(long)]
    pub drain: bool,
    /// Print the outcome as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Runs `gpufence sweep`.
pub fn run_sweep(node: &Node, args: &SweepArgs) -> ExitCode {
    let fail_on = match args.fail_on.as_deref().map(str::parse::<Severity>) {
        None => None,
        Some(Ok(s)) => Some(s),
        Some(Err(e)) => {
            eprintln!("gpufence sweep: --fail-on: {e}");
            return ExitCode::from(2);
        }
    };
    let req = SweepRequest {
        cgroup: args.cgroup.clone(),
        fail_on,
        drain_node: args
            .drain
            .then(|| gpufence_model::nodename::node_name(None)),
        prometheus: args.prometheus.clone(),
        cursor: args.cursor.clone(),
        // Only read when the config's resume_when_clean is on.
        resume_node: node
            .cfg
            .resume_when_clean
            .then(|| gpufence_model::nodename::node_name(None)),
        // The iterators first, `/proc` where they cannot run.
        proc_walk: false,
    };
    let o = sweep::execute(node, &req);
    for f in &o.report.findings {
        if args.json {
            println!("{}", serde_json::to_string(f).unwrap_or_default());
        } else {
            println!("{}", f.line());
        }
    }
    use gpufence_model::text::printable as p;
    for n in &o.report.notes {
        eprintln!("gpufence sweep: note: {}", p(n));
    }
    for e in &o.errors {
        eprintln!("gpufence sweep: error: {}", p(e));
    }
    if let Some(r) = &o.drained {
        eprintln!("gpufence sweep: node drained: {}", p(r));
    }
    // On stderr, as every line of the sweep's: the journal of its timer or
    // slurmd's log keeps them (the audit log has `node_resumed`).
    if let Some(r) = &o.resumed {
        eprintln!(
            "gpufence sweep: node resumed: the cause of its drain is gone ({})",
            p(r)
        );
    }
    if let Some(r) = &o.flapping {
        eprintln!("gpufence sweep: node flaps, drained again: {}", p(r));
    }
    ExitCode::from(o.exit)
}

/// Runs `gpufence respond PID`.
pub fn run_respond(node: &Node, args: &RespondArgs) -> ExitCode {
    // What is printed here comes from the process and its user (its name,
    // file names under their home, crontab lines): through the one
    // sanitiser, so none of it reaches root's terminal as escapes.
    use gpufence_model::text::printable as p;
    let name = args
        .drain
        .then(|| gpufence_model::nodename::node_name(None));
    match incident::respond_pid(node, args.pid, name.as_deref()) {
        Err(r) => {
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({"pid": args.pid, "refused": r.to_string()})
                );
            }
            eprintln!("gpufence respond: refused: {}", p(&r.to_string()));
            ExitCode::from(2)
        }
        Ok(o) => {
            if args.json {
                println!("{}", serde_json::to_string_pretty(&o).unwrap_or_default());
            } else {
                println!(
                    "pid {} ({}) of {}: tree of {} process(es) stopped ({}), evidence kept, killed {:?}{}",
                    o.pid,
                    p(o.comm.as_deref().unwrap_or("?")),
                    p(&o
                        .user
                        .clone()
                        .or_else(|| o.uid.map(|u| format!("uid {u}")))
                        .unwrap_or_else(|| "?".into())),
                    o.tree.len(),
                    o.frozen
                        .values()
                        .map(|h| h.as_str())
                        .collect::<std::collections::BTreeSet<_>>()
                        .into_iter()
                        .collect::<Vec<_>>()
                        .join("+"),
                    o.killed,
                    if o.survivors.is_empty() {
                        String::new()
                    } else {
                        format!(", SURVIVED {:?}", o.survivors)
                    }
                );
                for n in &o.not_read {
                    println!("{}", p(n));
                }
                for s in &o.spared {
                    println!("spared: pid {} ({})", s.pid, p(&s.why));
                }
                for e in &o.evidence {
                    println!("evidence: {}", p(&e.display().to_string()));
                }
                if let Some(f) = &o.incident_file {
                    println!("incident file: {}", p(&f.display().to_string()));
                }
                for e in &o.persistence {
                    println!(
                        "persistence (listed, not deleted): {} {}{}",
                        e.kind,
                        p(&e.path.display().to_string()),
                        if e.entries.is_empty() {
                            String::new()
                        } else {
                            format!(": {}", p(&e.entries.join(" | ")))
                        }
                    );
                }
                for n in &o.notes {
                    println!("note: {}", p(n));
                }
                if let Some(r) = &o.drained {
                    println!("node drained: {}", p(r));
                }
                for e in &o.errors {
                    eprintln!("gpufence respond: error: {}", p(e));
                }
            }
            if o.complete() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
    }
}
