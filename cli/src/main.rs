//! `gpufence`: the admin CLI.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use gpufence_node::{admin::grants, Node, NodeError};

mod fence_cmd;
mod man_pages;
mod sweep_cmd;
mod tables;

use fence_cmd::{run_fence_install, run_fence_remove, run_fence_status, run_fence_watch};
use tables::{cell, print_devices, print_doctor, print_table};

/// Admin tool of gpufence, the node-wide GPU fence for Slurm.
#[derive(Parser, Debug)]
#[command(name = "gpufence", version, about, propagate_version = true)]
struct Cli {
    /// Config file (default: $GPUFENCE_CONFIG, else /etc/slurm/gpufence.toml).
    #[arg(long, global = true, value_name = "PATH")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Install, inspect or remove the node-wide fence.
    Fence {
        #[command(subcommand)]
        op: FenceOp,
    },
    /// List the live grants: job, cgroup, devices.
    Grants {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Denied opens of NVIDIA devices: cgroup, user, device, count, last process and time.
    ///
    /// In audit mode the fence records what it would deny: the same list
    /// is what enforcing would break.
    Denials {
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// One line per cgroup (count, users, devices, last process), then
        /// a ready `exempt_cgroups = [...]` line with the system services
        /// among them (every uid at most protected_uid_max or named by an
        /// exempt_cgroups entry, in a .service unit), each for the uids
        /// seen there; a job's or a user's cgroup is never suggested.
        #[arg(long)]
        by_cgroup: bool,
    },
    /// The node's NVIDIA devices: GPUs, MIG slices and their capabilities, protected majors.
    Devices {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Why a process (or every process of a cgroup) can or cannot open each NVIDIA device.
    ///
    /// Also warns when slurm.conf ($SLURM_CONF, else /etc/slurm/slurm.conf)
    /// gives the Prolog or Epilog less time than gpufence's worst case
    /// (`timeouts` in --json: what was compared).
    ///
    /// Exit 0 every device is allowed; 1 at least one is denied, may be
    /// denied or unknown (or doctor could not answer); 2 not root.
    Doctor {
        /// The process (default: this shell's process).
        pid: Option<i32>,
        /// A cgroup instead of a process (relative to the cgroup2 mount).
        #[arg(long, conflicts_with = "pid")]
        cgroup: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Look for GPU misuse now: unfenced holders, busy GPUs without a grant,
    /// denied opens, mining, exposed notebooks, persistence, fence drift.
    ///
    /// With resume_when_clean in the config, also resume the node
    /// (SLURMD_NODENAME, else the host name) when gpufence drained it, its
    /// reason is still gpufence's recorded one and this sweep found the
    /// cause gone; at resume_max resumes within resume_window_s it is
    /// drained again as flapping instead.
    ///
    /// Exit 0 clean, 1 findings at or above --fail-on, 2 incomplete (or a
    /// drain asked for failed).
    Sweep(sweep_cmd::SweepArgs),
    /// Stop a misusing process tree: freeze, keep evidence, kill, audit
    /// (and drain with --drain).
    ///
    /// Exit 0 gone, 1 survived, 2 refused.
    Respond(sweep_cmd::RespondArgs),
    /// Run an admin command (e.g. nvidia-smi) in the exempt cgroup, audited (root only).
    Exec {
        /// The command and its arguments, after `--`.
        #[arg(last = true, required = true)]
        cmd: Vec<std::ffi::OsString>,
    },
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Write the man pages into DIR (made if missing): gpufence(8), one
    /// page per subcommand in section 8, and gpufence.toml(5);
    /// gpufence-prolog and gpufence-epilog write theirs with --generate-man DIR.
    Man {
        /// Output directory.
        dir: PathBuf,
    },
    /// MIG planning.
    Mig {
        #[command(subcommand)]
        op: MigOp,
    },
}

#[derive(Subcommand, Debug)]
enum MigOp {
    /// Whether MIG profiles fit on one GPU together, and where.
    ///
    /// Draws the
    /// GPU's memory slices with a box per instance, then lists each as
    /// PROFILE at START:SIZE. When they do not all fit, draws the best
    /// partial packing and lists what is left over. Exit 0 fits, 1 does not
    /// fit (or an unknown profile), 2 unknown GPU model.
    Check {
        /// GPU model: A100-40GB, A100-80GB, A30, H100-80GB, H100-94GB (H100-NVL), H200 (141GB).
        #[arg(long)]
        gpu: String,
        /// Profiles, comma separated (e.g. 3g.40gb,2g.20gb,1g.10gb).
        profiles: String,
        /// Print JSON: instances (start and size in memory slices), left over, per-slice occupancy.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand, Debug)]
enum FenceOp {
    /// Attach the fence (or swap in the current program); safe to repeat.
    Install,
    /// Whether the fence is attached at cgroup_root, and what it holds.
    ///
    /// Exit 0
    /// installed as the config says; 1 not installed, or any `problem:` line
    /// (audit mode where the config says enforce, an exemption missing, an
    /// unprotected major, pins not visible); 2 not root.
    Status {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Keep the configured exemptions in the fence: when an exempt service's
    /// cgroup is made anew (`systemctl restart nvidia-persistenced`), its new
    /// id is exempt within a second. Runs until SIGTERM or SIGINT
    /// (gpufence-watch.service).
    Watch,
    /// Detach the fence and remove every pin: GPUs are then open to every process.
    /// Refused while jobs hold grants, unless --force.
    Remove {
        /// Remove even though running jobs hold grants (they lose GPU isolation).
        #[arg(long)]
        force: bool,
    },
}

fn main() -> ExitCode {
    // `gpufence grants | head`: die quietly on a closed pipe, as CLIs do,
    // instead of panicking in println!.
    // SAFETY: resetting a signal disposition before any thread exists.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("gpufence: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs one subcommand: those that need no node first, then the root
/// check, then the node's (one function each).
fn run(cli: Cli) -> Result<ExitCode, NodeError> {
    // These need no node, no config.
    match &cli.cmd {
        Cmd::Completions { shell } => return Ok(run_completions(*shell)),
        Cmd::Man { dir } => return run_man(dir),
        Cmd::Mig {
            op:
                MigOp::Check {
                    gpu,
                    profiles,
                    json,
                },
        } => return Ok(mig_check(gpu, profiles, *json)),
        _ => {}
    }
    // Everything below reads pinned maps, /proc of other users or the
    // state dir: without root the answers would be wrong, not just short.
    let needs_root = !matches!(cli.cmd, Cmd::Devices { .. });
    // SAFETY: geteuid has no preconditions.
    if needs_root && unsafe { libc::geteuid() } != 0 {
        let why = match cli.cmd {
            Cmd::Exec { .. } => "it runs the command in the fence's exempt cgroup",
            Cmd::Respond(_) => "it freezes and kills processes and keeps evidence",
            _ => "it reads the fence's pinned maps and every process's descriptors",
        };
        eprintln!("gpufence: this command needs root ({why}): run it with sudo");
        return Ok(ExitCode::from(2));
    }
    let node = Node::load(cli.config.as_deref())?;
    match cli.cmd {
        Cmd::Mig { .. } | Cmd::Completions { .. } | Cmd::Man { .. } => Ok(ExitCode::SUCCESS),
        Cmd::Sweep(args) => Ok(sweep_cmd::run_sweep(&node, &args)),
        Cmd::Respond(args) => Ok(sweep_cmd::run_respond(&node, &args)),
        Cmd::Exec { cmd } => run_exec(&node, &cmd),
        Cmd::Doctor { pid, cgroup, json } => run_doctor(&node, pid, cgroup.as_deref(), json),
        Cmd::Denials { json, by_cgroup } => run_denials(&node, json, by_cgroup),
        Cmd::Devices { json } => Ok(run_devices(&node, json)),
        Cmd::Fence {
            op: FenceOp::Install,
        } => run_fence_install(&node),
        Cmd::Fence {
            op: FenceOp::Status { json },
        } => Ok(run_fence_status(&node, json)),
        Cmd::Fence {
            op: FenceOp::Remove { force },
        } => run_fence_remove(&node, force),
        Cmd::Fence { op: FenceOp::Watch } => Ok(run_fence_watch(&node)),
        Cmd::Grants { json } => run_grants(&node, json),
    }
}

/// `gpufence completions SHELL`: the completion script on stdout.
fn run_completions(shell: clap_complete::Shell) -> ExitCode {
    let mut cmd = <Cli as clap::CommandFactory>::command();
    let mut buf = Vec::new();
    clap_complete::generate(shell, &mut cmd, "gpufence", &mut buf);
    let _ = std::io::Write::write_all(&mut std::io::stdout(), &buf);
    ExitCode::SUCCESS
}

/// `gpufence man DIR`: gpufence(8), one page per subcommand (section 8)
/// and gpufence.toml(5), into `dir`.
fn run_man(dir: &std::path::Path) -> Result<ExitCode, NodeError> {
    let cmd = <Cli as clap::CommandFactory>::command();
    let err = |e| NodeError::io("write man pages", dir, e);
    gpufence_man::write_pages(
        cmd,
        gpufence_man::ADMIN_SECTION,
        &man_pages::top(),
        &man_pages::sub,
        dir,
    )
    .map_err(err)?;
    gpufence_man::write_config_page(include_str!("../../contrib/gpufence.toml"), dir)
        .map_err(err)?;
    Ok(ExitCode::SUCCESS)
}

/// `gpufence exec -- CMD...`: the command in the exempt cgroup; its exit
/// status (1 when it does not fit a byte).
fn run_exec(node: &Node, cmd: &[std::ffi::OsString]) -> Result<ExitCode, NodeError> {
    let code = gpufence_node::admin::exec::exec(node, cmd)?;
    Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)))
}

/// `gpufence doctor [PID | --cgroup CG]`.
fn run_doctor(
    node: &Node,
    pid: Option<i32>,
    cgroup: Option<&str>,
    json: bool,
) -> Result<ExitCode, NodeError> {
    let mut d = gpufence_node::admin::doctor::doctor(node, pid, cgroup)?;
    // The hooks' worst cases against slurm.conf's timeouts, beside the
    // account warnings; in --json, what was compared (`timeouts`).
    let timeouts = gpufence_node::job::timeouts::host_report(&node.cfg);
    d.warnings.extend(timeouts.warnings.iter().cloned());
    if json {
        let mut v = serde_json::to_value(&d).unwrap_or_default();
        v["timeouts"] = serde_json::to_value(&timeouts).unwrap_or_default();
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    } else {
        print_doctor(&d);
        if let Some(f) = &timeouts.epilog_fits {
            println!("note: {}", gpufence_model::text::printable(f));
        }
    }
    // 0 only when every device opens: a script can ask `doctor PID && ...`.
    Ok(if d.devices.iter().all(|v| v.verdict == "allowed") {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// `gpufence denials`: the denied opens, one row per cgroup, user and device.
fn run_denials(node: &Node, json: bool, by_cgroup: bool) -> Result<ExitCode, NodeError> {
    let d = gpufence_node::host::denials::list(node)?;
    if by_cgroup {
        let g = gpufence_node::host::denials::by_cgroup(node, &d);
        if json {
            println!("{}", serde_json::to_string_pretty(&g).unwrap_or_default());
            return Ok(ExitCode::SUCCESS);
        }
        if g.cgroups.is_empty() {
            println!("no denied opens recorded");
            return Ok(ExitCode::SUCCESS);
        }
        let mut rows =
            vec!["count\tusers\tdevices\taccess\tpid\tcomm\tlast\tcgroup\tsuggest".to_string()];
        for x in &g.cgroups {
            rows.push(format!(
                "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
                x.count,
                cell(&x.users.join(",")),
                x.devices.join(","),
                x.access.join(","),
                x.last_pid,
                cell(&x.last_comm),
                x.last_time,
                x.cgroup
                    .as_deref()
                    .map(|c| cell(&gpufence_node::host::cgpath::abs(c)))
                    .unwrap_or_else(|| format!("(gone, id {})", x.cgroup_id)),
                match (&x.suggest, &x.not_suggested) {
                    (Some(s), _) =>
                        format!("exempt {}", cell(&gpufence_node::host::cgpath::abs(s))),
                    (None, Some(why)) => format!("no: {}", cell(why)),
                    (None, None) => "no".into(),
                }
            ));
        }
        print_table(&rows);
        println!();
        if g.suggested.is_empty() {
            println!("# no system service among them: nothing to add to exempt_cgroups");
        } else {
            println!(
                "# exempt_cgroups for {}: the entries it has, then the system services above",
                node.origin
            );
        }
        println!("{}", g.exempt_cgroups_line);
        return Ok(ExitCode::SUCCESS);
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&d).unwrap_or_default());
    } else if d.is_empty() {
        println!("no denied opens recorded");
    } else {
        let mut rows = vec!["count\tuser\tdevice\taccess\tpid\tcomm\tlast\tcgroup".to_string()];
        for x in d {
            rows.push(format!(
                "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
                x.count,
                x.user.unwrap_or_else(|| x.uid.to_string()),
                x.device,
                if x.access.is_empty() {
                    "?"
                } else {
                    x.access.as_str()
                },
                x.last_pid,
                cell(&x.last_comm),
                x.last_time,
                x.cgroup
                    .map(|c| cell(&gpufence_node::host::cgpath::abs(&c)))
                    .unwrap_or_else(|| format!("(gone, id {})", x.cgroup_id))
            ));
        }
        print_table(&rows);
    }
    Ok(ExitCode::SUCCESS)
}

/// `gpufence devices`: exit 1 when some driver file could not be read.
fn run_devices(node: &Node, json: bool) -> ExitCode {
    let d = gpufence_node::host::inventory::devices(node);
    if json {
        println!("{}", serde_json::to_string_pretty(&d).unwrap_or_default());
    } else {
        print_devices(&d);
    }
    if d.errors.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `gpufence grants`: one row per job's cgroup with its devices.
fn run_grants(node: &Node, json: bool) -> Result<ExitCode, NodeError> {
    let g = grants::list(node)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&g).unwrap_or_default());
    } else if g.is_empty() {
        println!("no live grants");
    } else {
        let mut rows = vec!["job\tcgroup_id\talive\tcgroup\tdevices".to_string()];
        for c in g {
            let devs: Vec<String> = c
                .devices
                .iter()
                .map(|d| format!("{} {}", d.dev, d.access))
                .collect();
            rows.push(format!(
                "{}\t{}\t{}\t{}\t{}",
                c.job_id,
                c.cgroup_id,
                c.cgroup_alive,
                c.cgroup_path
                    .map(|p| cell(&gpufence_node::host::cgpath::abs(&p)))
                    .unwrap_or_else(|| "?".into()),
                devs.join(", ")
            ));
        }
        print_table(&rows);
    }
    Ok(ExitCode::SUCCESS)
}

fn mig_check(gpu: &str, profiles: &str, json: bool) -> ExitCode {
    use gpufence_model::mig::GpuModel;
    use gpufence_model::migdraw;
    let model: GpuModel = match gpu.parse() {
        Ok(m) => m,
        Err(e) => {
            eprintln!("gpufence: {e}");
            return ExitCode::from(2);
        }
    };
    let list: Vec<&str> = profiles
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    let plan = match migdraw::plan(model, &list) {
        Ok(plan) => plan,
        Err(e) => {
            if json {
                let v = migdraw::error_json(model, &e);
                println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            } else {
                println!("does not fit on one {model}: {e}");
            }
            return ExitCode::FAILURE;
        }
    };
    if json {
        let v = migdraw::plan_json(&plan);
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    } else {
        print!("{}", migdraw::render_text(&plan));
    }
    if plan.fits() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
