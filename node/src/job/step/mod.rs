//! The SPANK plugin's hooks as node calls. The plugin (`spank-plugin/`)
//! reads Slurm's items, calls these, and maps their results to SPANK
//! return codes; what it decides and says is decided and said here.
//!
//! - slurmd context, `slurm_spank_init`: [`slurmd_start`].
//! - remote context (slurmstepd), `slurm_spank_init`: [`Step::start`]:
//!   the grant ([`crate::job::grant::grant_step`]), the job's door
//!   ([`crate::job::door`]) and, under `switch/nvidia_imex`, the job
//!   cgroup's `mknod` of the IMEX major ([`crate::job::imex`]).
//! - `task_init_privileged`: [`Step::task_init_privileged`].
//! - `task_init`: [`Step::job_env`], then [`Step::task_lines`].
//! - option values where the user types them: [`check_report_option`].
//!
//! Lines for slurmd's log go through the plugin's sink ([`Log`]); lines
//! for the job's stderr come back as values. Nothing here blocks on the
//! network or panics.

mod args;
mod slurmd;
mod task;

use std::borrow::Cow;
use std::ffi::OsStr;
use std::path::PathBuf;

use crate::host::slurmconf::{slurm_conf_path, SlurmConf};
use crate::job::door;
use crate::job::grant::{self, StepFate, StepRequest};
use crate::job::imex;
use crate::Node;

pub use args::{PluginArgs, PluginArgsError};
pub use slurmd::{slurmd_node_arg, slurmd_start};
pub use task::{container_hint, has_gpus};

/// How a line for slurmd's log is logged (the plugin maps these to
/// `spank_log`'s levels).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    /// `error`: what an admin must act on.
    Error,
    /// `info`.
    Info,
    /// `verbose`: routine, seen with `-v`.
    Verbose,
}

/// The plugin's sink for lines for slurmd's log, each passed through
/// [`log_line`] by the plugin.
pub type Log<'a> = &'a mut dyn FnMut(Level, &str);

/// A line for slurmd's log as gpufence writes it: `gpufence: ` first,
/// once.
pub fn log_line(msg: &str) -> Cow<'_, str> {
    if msg.starts_with("gpufence: ") {
        Cow::Borrowed(msg)
    } else {
        Cow::Owned(format!("gpufence: {msg}"))
    }
}

/// Checks a `--gpufence-report` value where the user types it (srun,
/// sbatch), so that a bad one fails at submission: `value` is the
/// option's argument; empty or `(null)` is a bare `--gpufence-report`
/// (as it reaches slurmstepd), the default path, not an error.
///
/// # Errors
/// [`gpufence_model::options::OptionsError`] from
/// [`gpufence_model::options::check_report_path`], one line for the user.
pub fn check_report_option(value: &str) -> Result<(), gpufence_model::options::OptionsError> {
    if value.is_empty() || value == "(null)" {
        return Ok(());
    }
    gpufence_model::options::check_report_path(value).map(|_| ())
}

/// The line on the task's stderr when a variable of the job's record
/// cannot be set in its environment (`spank_setenv` failed with `error`).
pub fn setenv_failed_line(name: &str, error: &dyn std::fmt::Display) -> String {
    format!("gpufence: cannot set {name}: {error}")
}

/// A step's spank items the job's door reads (`S_JOB_ARGV`, `S_JOB_ENV`),
/// each `None` when slurmstepd did not give it.
#[derive(Clone, Debug, Default)]
pub struct DoorItems<'a> {
    /// `S_JOB_ARGV`.
    pub argv: Option<Vec<&'a OsStr>>,
    /// `S_JOB_ENV`.
    pub env: Option<Vec<&'a OsStr>>,
}

/// What a task's `task_init_privileged` does: lines for its stderr, and
/// whether it must not run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TaskStart {
    /// Lines for the task's stderr (the job's output), in order.
    pub stderr: Vec<String>,
    /// The step was refused: the task fails (its reason is in `stderr`
    /// of task 0, not logged again).
    pub refuse: bool,
}

/// One slurmstepd's step across its callbacks: what `slurm_spank_init`
/// decided, for the tasks it then forks. [`Step::default`] is a step
/// never started (no remote `slurm_spank_init`): its tasks run, told
/// nothing.
#[derive(Debug, Default)]
pub struct Step {
    fate: Option<StepFate>,
    /// Lines for the job's output (task 0's stderr), from the record's
    /// notes for the user (a `--gpu-exclusive` that could not be set, an
    /// MPS daemon that did not start) and the door's.
    user_notes: Vec<String>,
    /// Variables for the tasks' environment, from the job's record
    /// (`CUDA_MPS_PIPE_DIRECTORY` of gpufence's MPS daemon).
    job_env: Vec<(String, String)>,
    /// Slurm's IMEX channels (`SwitchType=switch/nvidia_imex`): the step's
    /// channel is granted before each task runs, once slurmstepd has made
    /// it ([`crate::job::imex`]).
    imex: Option<ImexStep>,
}

/// What a task needs to grant its step's IMEX channel.
#[derive(Debug)]
struct ImexStep {
    /// The config the step's node was loaded from.
    config: Option<PathBuf>,
    req: StepRequest,
    /// The job cgroup, relative to the cgroup2 mount.
    job_cgroup: String,
    /// The channels' major.
    major: u32,
}

impl Step {
    /// The remote `slurm_spank_init` of step `req` (slurmstepd, root): the
    /// config (`args`; one that cannot load refuses the step,
    /// [`grant::load_refused_line`]), the grant
    /// ([`grant::grant_step`]; `PrologFlags=RunInJob` from
    /// [`slurm_conf_path`]), the job's door for every step but the extern
    /// one ([`door::check_step`], its items read through `items` only
    /// then; its refusal is the step's unless the step is refused
    /// already), and under `switch/nvidia_imex` the job cgroup's `mknod`
    /// of the IMEX major. Lines for slurmd's log go to `log`; the
    /// fate's line is logged as an error. This node is named by
    /// [`gpufence_model::nodename::node_name`].
    pub fn start<'a>(
        args: &PluginArgs,
        req: StepRequest,
        items: impl FnOnce() -> DoorItems<'a>,
        log: Log,
    ) -> Step {
        let node_name = gpufence_model::nodename::node_name(None);
        let node = match Node::load(args.config.as_deref()) {
            Ok(n) => n,
            Err(e) => {
                let line = grant::load_refused_line(&req, &node_name, &e);
                log(Level::Error, &line);
                return Step {
                    fate: Some(StepFate::Refuse(line)),
                    ..Step::default()
                };
            }
        };
        let slurm = SlurmConf::load(&slurm_conf_path()).ok();
        let mut g = grant::grant_step(&node, &req, &node_name, || {
            slurm.as_ref().is_some_and(|c| c.run_in_job())
        });
        // The job's door: credentials (batch step), container images.
        if req.step_id != grant::EXTERN_STEP_ID {
            let it = items();
            let step = door::DoorStep {
                req: &req,
                argv: it.argv.as_deref().unwrap_or_default(),
                env: it.env.as_deref(),
            };
            let d = door::check_step(&node, slurm.as_ref(), &step);
            for l in &d.log_lines {
                log(Level::Error, l);
            }
            g.user_notes.extend(d.user_lines);
            if let (Some(r), false) = (d.refuse, matches!(g.fate, StepFate::Refuse(_))) {
                g.fate = StepFate::Refuse(r);
            }
        }
        // Slurm's IMEX channels: slurmstepd makes the step's channel node
        // after this callback, in the job cgroup.
        let mut imex_step = None;
        let major = slurm.as_ref().and_then(|s| imex::switch_major(&node, s));
        if let (Some(major), Some(job_cgroup)) = (major, &g.job_cgroup) {
            match imex::grant_mknod(&node, &req, job_cgroup, major) {
                Ok(()) => {
                    imex_step = Some(ImexStep {
                        config: args.config.clone(),
                        req,
                        job_cgroup: job_cgroup.clone(),
                        major,
                    })
                }
                Err(e) => log(
                    Level::Error,
                    &format!(
                        "job {} step {}: the IMEX channel node cannot be made in the job cgroup /{job_cgroup}: {e}; Slurm's switch/nvidia_imex will fail the step",
                        req.job_id,
                        grant::step_name(req.step_id)
                    ),
                ),
            }
        }
        if let Some(n) = &g.note {
            log(Level::Verbose, n);
        }
        if let StepFate::Refuse(l) | StepFate::RunWithoutGpus(l) = &g.fate {
            log(Level::Error, l);
        }
        Step {
            fate: Some(g.fate),
            user_notes: g.user_notes,
            job_env: g.job_env,
            imex: imex_step,
        }
    }

    /// `task_init_privileged`, in the forked task before exec, root, in
    /// slurmstepd's mount namespace; `task0`: the task's global id is 0
    /// (only task 0 prints). A refused step: its line (task 0) and
    /// `refuse`. Else, under `switch/nvidia_imex`, the step's IMEX
    /// channel (made by Slurm after `slurm_spank_init`) is granted
    /// ([`imex::grant_channel`]); a failure is logged and printed.
    pub fn task_init_privileged(&self, task0: bool, log: Log) -> TaskStart {
        let mut t = TaskStart::default();
        if let Some(StepFate::Refuse(line)) = &self.fate {
            if task0 {
                t.stderr.push(line.clone());
            }
            t.refuse = true;
            return t;
        }
        if let Some(x) = &self.imex {
            let granted = Node::load(x.config.as_deref())
                .map_err(|e| e.to_string())
                .and_then(|node| {
                    imex::grant_channel(&node, &x.req, &x.job_cgroup, x.major)
                        .map_err(|e| e.to_string())
                });
            if let Err(e) = granted {
                let line = format!(
                    "gpufence: job {} step {}: its IMEX channel could not be granted: {e}; this step's tasks cannot open it",
                    x.req.job_id,
                    grant::step_name(x.req.step_id)
                );
                log(Level::Error, &line);
                if task0 {
                    t.stderr.push(line);
                }
            }
        }
        t
    }

    /// Variables for each task's environment (`task_init`, before exec:
    /// slurmstepd execs the task with the environment as the plugin
    /// leaves it, `exec_task`, `src/slurmd/slurmstepd/task.c`; a
    /// TaskProlog may still change it). A failure to set one is
    /// [`setenv_failed_line`] on the task's stderr.
    pub fn job_env(&self) -> &[(String, String)] {
        &self.job_env
    }

    /// The lines for a task's stderr at `task_init`, in order; only task 0
    /// (`task0`) gets any: the record's and the door's notes; for a step
    /// that runs with its GPUs ([`has_gpus`] of the task's environment,
    /// `getenv`), the [`container_hint`] of its command line (`argv`:
    /// `S_JOB_ARGV`, read only then); for a step that runs without GPUs,
    /// why.
    pub fn task_lines<'a>(
        &self,
        task0: bool,
        getenv: impl Fn(&str) -> Option<String>,
        argv: impl FnOnce() -> Option<Vec<&'a str>>,
    ) -> Vec<String> {
        if !task0 {
            return Vec::new();
        }
        let mut lines = self.user_notes.clone();
        if matches!(self.fate, Some(StepFate::Run)) && has_gpus(getenv) {
            if let Some(hint) = argv().and_then(|a| container_hint(&a)) {
                lines.push(hint.to_string());
            }
        }
        if let Some(StepFate::RunWithoutGpus(l)) = &self.fate {
            lines.push(l.clone());
        }
        lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(fate: Option<StepFate>) -> Step {
        Step {
            fate,
            user_notes: vec!["note".into()],
            ..Step::default()
        }
    }

    #[test]
    fn log_lines_say_gpufence_once() {
        assert_eq!(log_line("x"), "gpufence: x");
        assert_eq!(log_line("gpufence: x"), "gpufence: x");
    }

    #[test]
    fn report_option_values() {
        for ok in ["", "(null)", "r-%j.txt", "/tmp/x"] {
            assert!(check_report_option(ok).is_ok(), "{ok:?}");
        }
        assert!(check_report_option("a\nb").is_err());
    }

    #[test]
    fn a_refused_step_stops_every_task_and_tells_task_0() {
        let s = step(Some(StepFate::Refuse("gpufence: no".into())));
        let mut logged = Vec::new();
        let t = s.task_init_privileged(true, &mut |l, m: &str| logged.push((l, m.to_string())));
        assert_eq!(
            t,
            TaskStart {
                stderr: vec!["gpufence: no".into()],
                refuse: true
            }
        );
        let t = s.task_init_privileged(false, &mut |l, m: &str| logged.push((l, m.to_string())));
        assert_eq!(
            t,
            TaskStart {
                stderr: vec![],
                refuse: true
            }
        );
        assert!(
            logged.is_empty(),
            "logged at init, not per task: {logged:?}"
        );
        let t = Step::default().task_init_privileged(true, &mut |_, _| {});
        assert_eq!(t, TaskStart::default());
    }

    #[test]
    fn task_lines_in_order_for_task_0_only() {
        let gpus = |k: &str| (k == "SLURM_STEP_GPUS").then(|| "0".to_string());
        let podman = || Some(vec!["podman", "run", "img"]);
        let s = step(Some(StepFate::Run));
        let l = s.task_lines(true, gpus, podman);
        assert_eq!(l.len(), 2, "{l:?}");
        assert_eq!(l[0], "note");
        assert!(l[1].starts_with("gpufence: podman"), "{l:?}");
        assert!(s.task_lines(false, gpus, podman).is_empty());
        // No GPUs in the task's environment: no hint, argv not read.
        let l = s.task_lines(
            true,
            |_| None,
            || -> Option<Vec<&str>> { panic!("argv read") },
        );
        assert_eq!(l, ["note"]);
        // Without GPUs: no hint, the reason last.
        let s = step(Some(StepFate::RunWithoutGpus("gpufence: why".into())));
        assert_eq!(s.task_lines(true, gpus, podman), ["note", "gpufence: why"]);
        assert!(Step::default().task_lines(true, gpus, podman).is_empty());
    }

    #[test]
    fn setenv_failure_line() {
        assert_eq!(
            setenv_failed_line("X", &"busy"),
            "gpufence: cannot set X: busy"
        );
    }
}
