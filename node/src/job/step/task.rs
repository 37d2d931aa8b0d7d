//! What a task is told before it runs: whether its step runs with GPUs,
//! and the one line for a container runtime that would leave the job.

/// Whether a task's step runs with GPUs: Slurm's gres/gpu plugin sets
/// `SLURM_STEP_GPUS` / `SLURM_JOB_GPUS` in the task's environment for its
/// GRES gpus (`src/plugins/gres/gpu/gres_gpu.c`). `getenv` reads the
/// task's environment (the plugin: `spank_getenv`); an empty value is
/// none.
pub fn has_gpus(getenv: impl Fn(&str) -> Option<String>) -> bool {
    ["SLURM_STEP_GPUS", "SLURM_JOB_GPUS"]
        .iter()
        .any(|k| getenv(k).is_some_and(|v| !v.is_empty()))
}

/// The one line for a task that starts a container runtime which puts the
/// container in a cgroup of its own: outside the job's cgroup the fence
/// denies every GPU (the job's own included), and the container sees no
/// GPU with no word why. Podman does so by default where it can (its
/// systemd cgroup manager makes `user.slice/.../libpod-<id>.scope`,
/// podman-run(1) `--cgroups`); `--cgroups=disabled` keeps the container in
/// the cgroup podman runs in. Apptainer does so only when asked for limits
/// (`--apply-cgroups` and the resource flags, apptainer's "Limiting
/// container resources" docs); without them it stays in the job's cgroup.
/// Only a runtime the task runs directly is seen (`srun podman run ...`),
/// not one started by a script. `argv`: the task's command line
/// (`S_JOB_ARGV` in `task_init`, `slurm/spank.h`).
pub fn container_hint(argv: &[&str]) -> Option<&'static str> {
    let prog = argv.first()?.rsplit('/').next()?;
    let args = &argv[1..];
    match prog {
        "podman" => {
            let runs = args
                .iter()
                .find(|a| !a.starts_with('-'))
                .is_some_and(|sub| matches!(*sub, "run" | "create" | "start"));
            let disabled = args.windows(2).any(|w| w == ["--cgroups", "disabled"])
                || args.contains(&"--cgroups=disabled");
            (runs && !disabled).then_some(
                "gpufence: podman may run this container in a cgroup of its own, outside \
                 this job, where the job's GPUs are denied; add --cgroups=disabled to \
                 `podman run` to keep it in the job (the job's limits still apply)",
            )
        }
        "apptainer" | "singularity" => {
            const OWN_CGROUP: [&str; 11] = [
                "--apply-cgroups",
                "--cpus",
                "--cpu-shares",
                "--cpuset-cpus",
                "--cpuset-mems",
                "--memory",
                "--memory-reservation",
                "--memory-swap",
                "--oom-kill-disable",
                "--pids-limit",
                "--blkio-weight",
            ];
            let own = args.iter().any(|a| {
                let flag = a.split('=').next().unwrap_or(a);
                OWN_CGROUP.contains(&flag)
            });
            own.then_some(
                "gpufence: with --apply-cgroups or a resource-limit flag (--cpus, \
                 --memory, ...) apptainer runs the container in a cgroup of its own, \
                 outside this job, where the job's GPUs are denied; drop them to keep \
                 it in the job (the job's limits still apply)",
            )
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn container_hints() {
        for argv in [
            &["podman", "run", "--rm", "img", "nvidia-smi"][..],
            &["/usr/bin/podman", "--log-level=info", "run", "img"],
            &[
                "apptainer",
                "exec",
                "--apply-cgroups",
                "l.toml",
                "x.sif",
                "true",
            ],
            &["apptainer", "run", "--memory=1G", "x.sif"],
        ] {
            assert!(container_hint(argv).is_some(), "{argv:?}");
        }
        for argv in [
            &["podman", "run", "--cgroups=disabled", "img"][..],
            &["podman", "run", "--cgroups", "disabled", "img"],
            &["podman", "images"],
            &["apptainer", "exec", "--nv", "x.sif", "true"],
            &["python", "train.py", "--cpus", "4"],
            &[],
        ] {
            assert!(container_hint(argv).is_none(), "{argv:?}");
        }
    }

    #[test]
    fn gpus_by_slurms_variables() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert!(has_gpus(env(&[("SLURM_STEP_GPUS", "0,1")])));
        assert!(has_gpus(env(&[("SLURM_JOB_GPUS", "2")])));
        assert!(!has_gpus(env(&[
            ("SLURM_STEP_GPUS", ""),
            ("SLURM_JOB_GPUS", "")
        ])));
        assert!(!has_gpus(env(&[("CUDA_VISIBLE_DEVICES", "0")])));
        assert!(!has_gpus(env(&[])));
    }
}
