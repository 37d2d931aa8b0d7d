//! `gpufence-epilog`: slurmd's Epilog. Revokes the job's grant, finds every
//! process still holding the job's devices outside any grant, keeps
//! evidence, kills them, checks the GPUs' memory came back. Exit 0 when the
//! node is clean; non-zero when something survived or a grant could not be
//! revoked. It then also drains the node (`scontrol update ... state=drain`)
//! with a reason naming gpufence, the job and the pid, so `sinfo -R` tells
//! the admin what happened; a failing scontrol does not hide the exit code.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use gpufence_node::job::epilog;
use gpufence_node::job::prolog::env_u32;
use gpufence_node::Node;

/// Revoke a job's GPU grant and clean up after it (run as slurmd's Epilog).
#[derive(Parser, Debug)]
#[command(name = "gpufence-epilog", version, about)]
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
                eprintln!("gpufence-epilog: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if let Some(line) = gpufence_node::host::procs::not_root_line(
        "gpufence-epilog",
        "slurmd runs its Epilog as root",
    ) {
        eprintln!("{line}");
        return ExitCode::FAILURE;
    }
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
    let env = epilog::EpilogEnv::from_env(job_id, &get);
    let out = epilog::run_with(&node, &env);
    // All lines in one write(2): slurmd reads the Epilog's stderr through a
    // pipe, and `eprintln!` writes each formatted piece on its own.
    let mut text = String::new();
    for n in &out.notes {
        text.push_str(&format!("gpufence-epilog: job {job_id}: {n}\n"));
    }
    for l in &out.lingering {
        let ev = l
            .evidence
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "none".into());
        text.push_str(&format!(
            "gpufence-epilog: job {job_id}: pid {} held {:?} after the job ({}); evidence {ev}\n",
            l.pid,
            l.devices.iter().map(|d| d.to_string()).collect::<Vec<_>>(),
            l.ended_by
                .map(|s| format!("ended by {s}"))
                .unwrap_or_else(|| "SURVIVED SIGKILL".into())
        ));
    }
    for s in &out.survivors {
        text.push_str(&format!("gpufence-epilog: job {job_id}: survivor: {s}\n"));
    }
    for e in &out.errors {
        text.push_str(&format!("gpufence-epilog: job {job_id}: {e}\n"));
    }
    if !text.is_empty() {
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), text.as_bytes());
    }
    if out.clean() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// What gpufence-epilog(8) says besides its options.
fn man_extra() -> gpufence_man::Extra {
    gpufence_man::Extra {
        exit_status: &[
            ("0", "The job's grant is revoked and nothing still holds its devices."),
            ("1", "Something survived the response (or a system account's or another user's job's process holds a device), an NVML query failed, or not root: the node is drained with a reason naming gpufence, the job and the pid."),
        ],
        files: gpufence_man::JOB_SCRIPT_FILES,
        environment: &[
            ("SLURM_JOB_ID, SLURM_JOB_UID, SLURM_JOB_GID", "The job and its user (set by slurmd: trusted)."),
            ("SLURMD_NODENAME", "This node as Slurm names it (the drain)."),
            ("SLURM_JOB_WORK_DIR", "Where --gpufence-report writes its report when given a relative path (as the user)."),
            ("SPANK__SLURM_SPANK_OPTION_gpufence_gpu_exclusive, SPANK__SLURM_SPANK_OPTION_gpufence_gpufence_report", "The job's --gpu-exclusive (its compute modes are restored) and --gpufence-report options."),
            ("GPUFENCE_CONFIG", "The configuration file when --config is not given."),
        ],
        examples: &[
            ("Epilog=/usr/sbin/gpufence-epilog", "In slurm.conf (or a script that runs it, with --config)."),
        ],
        see_also: gpufence_man::see_also(&[
            "gpufence(8)",
            "gpufence.toml(5)",
            "gpufence-prolog(8)",
            "slurm.conf(5)",
        ]),
    }
}
