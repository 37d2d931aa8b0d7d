//! What gpufence's man pages say besides the command line
//! ([`gpufence_man::Extra`]): exit codes, files, environment, examples.

use gpufence_man::{see_also, Extra};

/// The files every gpufence program reads or writes (defaults; each is a
/// key of gpufence.toml(5)).
pub const FILES: &[(&str, &str)] = &[
    ("/etc/slurm/gpufence.toml", "The configuration, gpufence.toml(5) (or GPUFENCE_CONFIG, or --config)."),
    ("/sys/fs/bpf/gpufence/", "The fence's pins (bpffs_dir): its link, maps and scan iterators."),
    ("/run/gpufence/", "State (state_dir): job records, the slurmd -G cache, the sweep's cursor and baseline, gpufence's record of its drains (drain/<node>.json, what resume_when_clean resumes)."),
    ("/var/log/gpufence/audit.jsonl", "The audit log (audit_log): one JSON object per line, every grant, revocation, response and finding."),
    ("/var/lib/gpufence/evidence/", "Evidence files (evidence_dir): one root-only JSON file per process a response acted on."),
    ("/etc/slurm/plugstack.conf.d/gpufence.conf", "Loads the SPANK plugin gpufence.so into slurmd and slurmstepd."),
    ("gpufence.service, gpufence-watch.service, gpufence-sweep.timer", "systemd units: install the fence at boot, keep exempt services exempt across their restarts, sweep every 5 minutes."),
];

/// `gpufence(8)`.
pub fn top() -> Extra {
    Extra {
        exit_status: &[
            ("0", "Done; for a question (status, doctor, sweep), the good answer."),
            ("1", "Failed, or the bad answer: each subcommand's page says which."),
            ("2", "Wrong usage, not root, or refused (respond to a pid that must not be touched; fence remove while jobs hold grants)."),
        ],
        files: FILES,
        environment: &[
            ("GPUFENCE_CONFIG", "The configuration file when --config is not given (else /etc/slurm/gpufence.toml)."),
            ("SUDO_USER, LOGNAME, USER", "Who ran the command, for the audit lines of exec and respond."),
        ],
        examples: &[
            ("gpufence fence status", "Whether the fence is attached as configured (exit 1 on any problem: for NHC)."),
            ("gpufence doctor 4242", "Why process 4242 can or cannot open each NVIDIA device, program by program."),
            ("gpufence sweep --drain", "A node health check (Slurm's HealthCheckProgram): drain the node on a finding at or above sweep_fail_severity."),
            ("gpufence exec -- nvidia-smi", "Run an admin command with GPU access, audited."),
            ("gpufence respond 4242 --drain", "Freeze process 4242's tree, keep evidence, kill it, drain the node."),
        ],
        see_also: see_also(&["gpufence.toml(5)", "gpufence-prolog(8)", "gpufence-epilog(8)", "slurm.conf(5)", "spank(8)"]),
    }
}

/// A subcommand's page, by its full name (`gpufence-fence-status`).
pub fn sub(name: &str) -> Option<Extra> {
    let exit_status: &'static [(&'static str, &'static str)] = match name {
        "gpufence-fence-status" => &[
            ("0", "The fence is attached at cgroup_root as the configuration says."),
            ("1", "Not installed, or a problem: line (audit mode where the config says enforce, a configured exemption missing, an unprotected major, pins not visible, a leftover exec cgroup)."),
            ("2", "Not root."),
        ],
        "gpufence-fence-install" => &[
            ("0", "Installed (or the program swapped in)."),
            ("1", "Not installed: one line says why and what to do (nothing of the try is left)."),
        ],
        "gpufence-fence-remove" => &[
            ("0", "Removed, or nothing was installed."),
            ("1", "Refused: the pinned fence is attached elsewhere than cgroup_root (a wrong config), or a pin cannot be removed."),
            ("2", "Refused: running jobs hold grants (use --force), or not root."),
        ],
        "gpufence-fence-watch" => &[("0", "Ended by SIGTERM or SIGINT.")],
        "gpufence-doctor" => &[
            ("0", "Every NVIDIA device is allowed to the process or cgroup."),
            ("1", "At least one is denied, may be denied or unknown, or doctor could not answer."),
            ("2", "Not root."),
        ],
        "gpufence-sweep" => &[
            ("0", "Clean."),
            ("1", "A finding at or above --fail-on (default: sweep_fail_severity)."),
            ("2", "Nothing fails but the sweep could not do all it was asked (textfile, state, a resume or flapping drain under resume_when_clean), the arguments are wrong, or a drain it was asked for failed (whatever it found)."),
        ],
        "gpufence-respond" => &[
            ("0", "The tree is gone and every step worked."),
            ("1", "Something survived or a step failed."),
            ("2", "Refused: init, gpufence itself or an ancestor, a kernel thread, an exempt daemon, no such process."),
        ],
        "gpufence-exec" => &[
            ("N", "The command's exit status (128+signal when killed)."),
            ("126, 127", "The command cannot run / is not found, as a shell says."),
        ],
        "gpufence-devices" => &[("0", "Every driver file was read."), ("1", "Some could not be.")],
        "gpufence-mig-check" => &[
            ("0", "The profiles fit on one GPU."),
            ("1", "They do not fit (or a profile is unknown)."),
            ("2", "Unknown GPU model."),
        ],
        _ => &[("0", "Done."), ("1", "Failed: one line on stderr says why."), ("2", "Wrong usage or not root.")],
    };
    let examples: &'static [(&'static str, &'static str)] = match name {
        "gpufence-fence-status" => &[(
            "gpufence fence status --json",
            "The same as JSON (problems, exemptions, unpinned programs).",
        )],
        "gpufence-sweep" => &[
            ("gpufence sweep --json", "One JSON finding per line."),
            (
                "gpufence sweep --prometheus /var/lib/prometheus/node-exporter/gpufence.prom",
                "Also write node_exporter's textfile.",
            ),
        ],
        "gpufence-doctor" => &[(
            "gpufence doctor --cgroup /system.slice/nvidia-persistenced.service",
            "Every device's verdict for a cgroup's processes.",
        )],
        _ => &[],
    };
    Some(Extra {
        exit_status,
        files: &[],
        environment: &[(
            "GPUFENCE_CONFIG",
            "The configuration file when --config is not given.",
        )],
        examples,
        see_also: see_also(&["gpufence(8)", "gpufence.toml(5)"]),
    })
}
