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
        return match gpufence_man::write_pages(
            cmd,
            gpufence_man::ADMIN_SECTION,
            &man_extra(),
            &|_| None,
            dir,
        ) {
            Ok(_) => ExitCode::SUCCESS,
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
            // All notes in one write(2): slurmd reads the Prolog's stderr
            // through a pipe, and `eprintln!` writes each piece on its own.
            let text: String = rec
                .all_notes()
                .iter()
                .map(|n| format!("gpufence-prolog: job {}: note: {n}\n", rec.job_id))
                .collect();
            if !text.is_empty() {
                let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), text.as_bytes());
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

/// What gpufence-prolog(8) says besides its options.
fn man_extra() -> gpufence_man::Extra {
    gpufence_man::Extra {
        exit_status: &[
            ("0", "The job's devices are recorded (and, under PrologFlags=RunInJob, granted): it may start."),
            ("1", "Refused, with one line saying why (no fence, a GRES index slurmd does not list, a uid taken for a system account, holders that survived the clean start, not root, an unreadable slurm.conf): Slurm drains the node and holds the job."),
        ],
        files: gpufence_man::JOB_SCRIPT_FILES,
        environment: &[
            ("SLURM_JOB_ID, SLURM_JOB_UID", "The job and its user (set by slurmd: trusted)."),
            ("SLURM_JOB_GPUS", "The job's GRES indices on this node, mapped to device files by their position in `slurmd -G`'s list (never a minor or an NVML index)."),
            ("CUDA_VISIBLE_DEVICES", "As slurmd set it: recorded, never granted from."),
            ("SLURM_CONF", "slurm.conf for `slurmd -G` and, on nodes with several GPU types, for asking slurmctld the job's allocation (configless nodes: slurmd's cached copy)."),
            ("SLURMD_NODENAME", "This node as Slurm names it (`slurmd -G -N`, the drain)."),
            ("SLURM_JOB_SLUID", "The job's SLUID (Slurm 25.11+): the job cgroup's name from 26.05, checked under PrologFlags=RunInJob."),
            ("SPANK__SLURM_SPANK_OPTION_gpufence_gpu_exclusive, SPANK__SLURM_SPANK_OPTION_gpufence_gpufence_report", "The job's --gpu-exclusive and --gpufence-report options (the user's input: never a grant)."),
            ("GPUFENCE_CONFIG", "The configuration file when --config is not given."),
        ],
        examples: &[
            ("Prolog=/usr/sbin/gpufence-prolog", "In slurm.conf (or a script that runs it, with --config)."),
        ],
        see_also: gpufence_man::see_also(&[
            "gpufence(8)",
            "gpufence.toml(5)",
            "gpufence-epilog(8)",
            "slurm.conf(5)",
        ]),
    }
}
