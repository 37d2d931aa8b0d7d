//! `gpufence.so`, the SPANK plugin. Glue only: it reads Slurm's items,
//! calls `gpufence_node::job::step` and maps the results to SPANK return
//! codes; the logic and its tests live there.
//!
//! - slurmd context (slurmd start, root): check that Slurm's settings fit
//!   the layout (`layout = "slurm"` needs `ProctrackType=proctrack/cgroup`
//!   and no `CgroupPlugin=cgroup/v1`), install (or refresh) the fence and
//!   warm the `slurmd -G` cache. A failure of the first two stops slurmd
//!   (fail closed, loud: one line saying what to set).
//! - remote context (slurmstepd, root), `slurm_spank_init`: place the step
//!   (fence present, job cgroup found or made) and apply the job's record.
//!   With `PrologFlags=RunInJob` in slurm.conf the extern step starts
//!   before the Prolog: finding no record there is expected (a verbose log
//!   line, nothing for the user, no `grant_refused`); the Prolog then
//!   grants the job cgroup itself (`gpufence_node::job::injob`). With
//!   Slurm's `SwitchType=switch/nvidia_imex`, the job cgroup also gets
//!   `mknod` of the IMEX major, for slurmstepd to make the step's channel
//!   (`gpufence_node::job::imex`). Then the job's door
//!   (`gpufence_node::job::door`): credentials in the batch script and
//!   environment, container images by tag; its refusal is the step's.
//! - `task_init_privileged` / `task_init` (in each task, before exec, stderr
//!   connected to the job's): print the one line the user must see, and
//!   stop the task when the step was refused; under `switch/nvidia_imex`,
//!   grant the channel slurmstepd made in the step's mount namespace.
//! - local / allocator / job_script contexts: nothing (srun runs as the
//!   user: never touch root-only paths there).
//!
//! plugstack.conf arguments: `config=PATH`, `mode=audit|enforce`. Unknown
//! arguments are errors.
//! Panics are caught by slurm-spank (`catch_unwind`) and become -1.

use std::error::Error;
use std::io::Write;
use std::os::raw::{c_char, c_int};
use std::panic::{catch_unwind, AssertUnwindSafe};

use slurm_spank::{spank_log, Context, LogLevel, Plugin, SpankHandle};

use gpufence_node::job::grant::StepRequest;
use gpufence_node::job::step::{self, DoorItems, Level, PluginArgs, PluginArgsError, Step};

mod ffi;

include!(concat!(env!("OUT_DIR"), "/plugin_decl.rs"));

// The symbols Slurm's plugin loader looks for (`src/common/plugin.c`):
// name, type "spank", and the version of the headers built against (only
// major.minor must match the running Slurm for SPANK plugins).

/// `plugin_name`.
#[no_mangle]
#[allow(non_upper_case_globals)]
pub static plugin_name: [u8; 9] = *b"gpufence\0";
/// `plugin_type`.
#[no_mangle]
#[allow(non_upper_case_globals)]
pub static plugin_type: [u8; 6] = *b"spank\0";
/// `plugin_version`.
#[no_mangle]
#[allow(non_upper_case_globals)]
pub static plugin_version: std::os::raw::c_uint = BUILT_FOR_SLURM;

/// One SPANK callback of the [`Plugin`] trait (`Plugin::init`, ...).
type Callback = fn(&mut dyn Plugin, &mut SpankHandle) -> Result<(), Box<dyn Error>>;

/// Runs one SPANK callback of [`GpuFence`] through slurm-spank's globals
/// (state across callbacks, option cache, panic catching).
fn hook(
    spank: slurm_spank::spank_sys::spank_t,
    ac: c_int,
    argv: *const *const c_char,
    which: Callback,
) -> c_int {
    // SAFETY: Slurm passes argc and argv of the plugstack.conf line.
    let args = unsafe { ffi::raw_plugin_args(ac, argv) };
    ARGS.with(|a| *a.borrow_mut() = args);
    slurm_spank::spank_callback_with_globals::<GpuFence, _>(move |plugin, options, need_setup| {
        let mut h = slurm_spank::init_spank_handle(spank, ac, argv, options);
        if need_setup {
            plugin.setup(&mut h)?;
        }
        which(plugin, &mut h).inspect_err(|e| plugin.report_error(e.as_ref()))
    })
}

thread_local! {
    /// The plugstack.conf arguments of the callback running on this thread,
    /// read by [`hook`] ([`ffi::raw_plugin_args`]).
    static ARGS: std::cell::RefCell<Result<PluginArgs, PluginArgsError>> =
        std::cell::RefCell::new(Ok(PluginArgs::default()));
}

/// The plugstack.conf arguments of the running callback.
///
/// # Errors
/// [`PluginArgsError`]: an unknown or malformed argument, or one that is
/// not UTF-8.
fn plugin_args() -> Result<PluginArgs, PluginArgsError> {
    ARGS.with(|a| a.borrow().clone())
}

/// `slurm_spank_init`: options first (every context where users type them
/// or where their values arrive), then [`GpuFence::init`].
#[no_mangle]
pub extern "C" fn slurm_spank_init(
    spank: slurm_spank::spank_sys::spank_t,
    ac: c_int,
    argv: *const *const c_char,
) -> c_int {
    use slurm_spank::spank_sys::*;
    // SAFETY: spank_context() has no arguments and no preconditions.
    let ctx = unsafe { spank_context() };
    if (ctx == spank_context_S_CTX_LOCAL
        || ctx == spank_context_S_CTX_ALLOCATOR
        || ctx == spank_context_S_CTX_REMOTE)
        && ffi::register_options(spank) != 0
    {
        return -1;
    }
    hook(spank, ac, argv, |p, h| p.init(h))
}

/// `slurm_spank_task_init_privileged`.
#[no_mangle]
pub extern "C" fn slurm_spank_task_init_privileged(
    spank: slurm_spank::spank_sys::spank_t,
    ac: c_int,
    argv: *const *const c_char,
) -> c_int {
    hook(spank, ac, argv, |p, h| p.task_init_privileged(h))
}

/// `slurm_spank_task_init`.
#[no_mangle]
pub extern "C" fn slurm_spank_task_init(
    spank: slurm_spank::spank_sys::spank_t,
    ac: c_int,
    argv: *const *const c_char,
) -> c_int {
    hook(spank, ac, argv, |p, h| p.task_init(h))
}

/// The error a task returns when its step was refused: the user already
/// has the reason on stderr, so it is not logged again.
#[derive(Debug)]
struct Refused;

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("step refused")
    }
}

impl Error for Refused {}

/// The plugin's state across callbacks of one process: the step
/// `slurm_spank_init` started, for the tasks slurmstepd forks.
#[derive(Default)]
pub struct GpuFence {
    step: Step,
}

/// Logs `msg` to slurmd's log at `level` ([`step::log_line`]).
fn log(level: Level, msg: &str) {
    let level = match level {
        Level::Error => LogLevel::Error,
        Level::Info => LogLevel::Info,
        Level::Verbose => LogLevel::Verbose,
    };
    spank_log(level, &step::log_line(msg));
}

/// Writes `lines` to this task's stderr (the job's output); a failed write
/// is dropped (nowhere else to say it).
fn to_stderr(lines: impl IntoIterator<Item = impl std::fmt::Display>) {
    for l in lines {
        let _ = writeln!(std::io::stderr(), "{l}");
    }
}

/// A spank item slurm-spank panics on when Slurm gives NULL: caught, it is
/// an item not given, never a failed step.
fn item<T, E>(read: impl FnOnce() -> Result<T, E>) -> Option<T> {
    catch_unwind(AssertUnwindSafe(read))
        .ok()
        .and_then(Result::ok)
}

// SAFETY: the trait's contract (slurm-spank 0.2.4, `Plugin`): task
// callbacks run in children slurmstepd forks from itself, where a
// multi-threaded plugin could deadlock. This plugin starts no thread, and
// its task callbacks (`task_init_privileged`, `task_init`) write lines
// built in `init` to stderr, set variables built there (`spank_setenv`)
// and, under `switch/nvidia_imex`, read the config, a directory and the
// fence's pinned maps with plain syscalls, taking no lock another thread
// could hold. The crate catches panics at every
// hook (`catch_unwind`), so none unwinds into Slurm.
unsafe impl Plugin for GpuFence {
    fn setup(&self, _spank: &mut SpankHandle) -> Result<(), Box<dyn Error>> {
        // No tracing subscriber: messages go through spank_log directly.
        Ok(())
    }

    fn report_error(&self, error: &dyn Error) {
        // `Refused` is reported by its text: the trait hands a non-'static
        // `dyn Error`, which cannot be downcast.
        if error.to_string() != Refused.to_string() {
            log(Level::Error, &error.to_string());
        }
    }

    fn init(&mut self, spank: &mut SpankHandle) -> Result<(), Box<dyn Error>> {
        match spank.context()? {
            Context::Slurmd => {
                let args = plugin_args()?;
                Ok(step::slurmd_start(
                    args.config.as_deref(),
                    args.mode,
                    &mut log,
                )?)
            }
            Context::Remote => {
                let args = plugin_args()?;
                let req = StepRequest {
                    job_id: spank.job_id()?,
                    step_id: spank.job_stepid()?,
                    uid: spank.job_uid()?,
                    stepd_pid: std::process::id() as i32,
                };
                let items = || DoorItems {
                    argv: item(|| spank.job_argv_os()),
                    env: item(|| spank.job_env_os()),
                };
                self.step = Step::start(&args, req, items, &mut log);
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn task_init_privileged(&mut self, spank: &mut SpankHandle) -> Result<(), Box<dyn Error>> {
        // In the forked task, before exec, stderr already the job's.
        let task0 = spank.task_global_id().unwrap_or(0) == 0;
        let t = self.step.task_init_privileged(task0, &mut log);
        to_stderr(&t.stderr);
        if t.refuse {
            return Err(Box::new(Refused));
        }
        Ok(())
    }

    fn task_init(&mut self, spank: &mut SpankHandle) -> Result<(), Box<dyn Error>> {
        for (k, v) in self.step.job_env() {
            if let Err(e) = spank.setenv(k, v, true) {
                to_stderr([step::setenv_failed_line(k, &e)]);
            }
        }
        let task0 = spank.task_global_id().unwrap_or(0) == 0;
        let getenv = |k: &str| spank.getenv(k).ok().flatten();
        // S_JOB_ARGV in task_init: the argv slurmstepd is about to exec.
        to_stderr(
            self.step
                .task_lines(task0, getenv, || spank.job_argv().ok()),
        );
        Ok(())
    }
}
