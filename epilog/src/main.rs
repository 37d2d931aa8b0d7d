//! `gpufence-epilog`: slurmd's Epilog. Revokes the job's grant, finds every
//! process still holding the job's devices outside any grant, keeps
//! evidence, kills them. Exit 0 when the node is clean; non-zero when
//! something survived or a grant could not be revoked (Slurm drains the node).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use gpufence_model::audit::{events, AuditEvent};
use gpufence_node::epilog;
use gpufence_node::prolog::env_u32;
use gpufence_node::Node;

/// Revoke a job's GPU grant and clean up after it (run as slurmd's Epilog).
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Config file (default: $GPUFENCE_CONFIG, else /etc/slurm/gpufence.toml).
    #[arg(long, value_name = "PATH")]
    config: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let node = match Node::load(args.config.as_deref()) {
        Ok(n) => n,
        Err(e) => {
            eprintln!("gpufence-epilog: {e}");
            return ExitCode::FAILURE;
        }
    };
    let get = |k: &str| std::env::var(k).ok();
    let job_id = match env_u32(&get, "SLURM_JOB_ID") {
        Ok(j) => j,
        Err(e) => {
            eprintln!("gpufence-epilog: {e}");
            return ExitCode::FAILURE;
        }
    };
    let out = epilog::run(&node, job_id);
    for n in &out.notes {
        eprintln!("gpufence-epilog: job {job_id}: {n}");
    }
    for l in &out.lingering {
        let ev = l
            .evidence
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "none".into());
        eprintln!(
            "gpufence-epilog: job {job_id}: pid {} held {:?} after the job ({}); evidence {ev}",
            l.pid,
            l.devices.iter().map(|d| d.to_string()).collect::<Vec<_>>(),
            if l.gone { "killed" } else { "SURVIVED SIGKILL" }
        );
    }
    for e in &out.errors {
        eprintln!("gpufence-epilog: job {job_id}: {e}");
        let _ = node.audit(
            AuditEvent::new(events::ERROR)
                .job(job_id)
                .field("component", "epilog")
                .field("error", e.clone()),
        );
    }
    if out.clean() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
