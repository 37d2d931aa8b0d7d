//! `gpufence-prolog`: slurmd's Prolog. Records what Slurm allocated to the
//! job (from slurmd's environment and `slurmd -G`) so the SPANK plugin can
//! grant it. Exit 0 on success; non-zero makes Slurm drain the node and
//! requeue the job, which is right when the node cannot guard its GPUs.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use gpufence_model::audit::{events, AuditEvent};
use gpufence_node::job::prolog::{self, PrologEnv};
use gpufence_node::Node;

/// Record the devices Slurm allocated to a job (run as slurmd's Prolog).
#[derive(Parser, Debug)]
#[command(name = "gpufence-prolog", version, about)]
struct Args {
    /// Config file (default: $GPUFENCE_CONFIG, else /etc/slurm/gpufence.toml).
    #[arg(long, value_name = "PATH")]
    config: Option<PathBuf>,
    /// Write the man page into DIR (made if missing) and exit (packaging).
    #[arg(long, value_name = "DIR", hide = true)]
    generate_man: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(dir) = &args.generate_man {
        let cmd = <Args as clap::CommandFactory>::command();
        return match std::fs::create_dir_all(dir).and_then(|()| clap_mangen::generate_to(cmd, dir))
        {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("gpufence-prolog: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if let Some(line) = gpufence_node::host::procs::not_root_line(
        "gpufence-prolog",
        "slurmd runs its Prolog as root",
    ) {
        eprintln!("{line}");
        return ExitCode::FAILURE;
    }
    let node = match Node::load(args.config.as_deref()) {
        Ok(n) => n,
        Err(e) => {
            eprintln!("gpufence-prolog: {e}");
            return ExitCode::FAILURE;
        }
    };
    let get = |k: &str| std::env::var(k).ok();
    let result = PrologEnv::from_env(&get).and_then(|env| prolog::run(&node, &env));
    match result {
        Ok(rec) => {
            for n in &rec.notes {
                eprintln!("gpufence-prolog: job {}: note: {n}", rec.job_id);
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            let job = get("SLURM_JOB_ID").unwrap_or_default();
            if job.is_empty() {
                eprintln!("gpufence-prolog: {e}");
            } else {
                eprintln!("gpufence-prolog: job {job}: {e}");
            }
            // `job_id` as every other line has it (a number) when slurmd's
            // value is one; the raw value is kept as given.
            let mut ev = AuditEvent::new(events::ERROR)
                .field("component", "prolog")
                .field("error", e.to_string());
            if let Ok(id) = job.parse::<u32>() {
                ev = ev.job(id);
            }
            let _ = node.audit(ev.field("slurm_job_id", job));
            ExitCode::FAILURE
        }
    }
}
