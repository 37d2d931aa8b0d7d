//! `gpufence.so`, the SPANK plugin. Glue only: it reads Slurm's items into a
//! [`StepRequest`] and calls `gpufence-node`; the logic and its tests live
//! there.
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
use std::path::PathBuf;

use slurm_spank::{spank_log, Context, LogLevel, Plugin, SpankHandle};

use gpufence_node::job::door;
use gpufence_node::job::grant::{self, StepRequest, StepVerdict};
use gpufence_node::{host::fence_ops, host::gresmap, host::slurmconf, Node};
use std::panic::{catch_unwind, AssertUnwindSafe};

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

/// Registers `--gpu-exclusive` and `--gpufence-report[=PATH]` with Slurm,
/// raw: slurm-spank's `register_option` cannot make an option whose value
/// is optional (`has_arg = 2`), and Slurm ignores a static `spank_options`
/// table in sbatch/salloc (allocator context, `_spank_plugin_create`,
/// `src/common/plugstack.c`). Slurm copies the struct, so a stack value is
/// fine. Values reach the Prolog and Epilog as
/// `SPANK__SLURM_SPANK_OPTION_gpufence_*`, which act on them.
fn register_options(spank: slurm_spank::spank_sys::spank_t) -> c_int {
    use slurm_spank::spank_sys::{spank_option, spank_option_register};
    let mut opts = [
        spank_option {
            name: c"gpu-exclusive".as_ptr(),
            arginfo: std::ptr::null(),
            usage: c"run this job's GPUs in exclusive-process compute mode (restored at job end)".as_ptr(),
            has_arg: 0,
            val: 1,
            cb: Some(option_cb),
        },
        spank_option {
            name: c"gpufence-report".as_ptr(),
            arginfo: c"PATH".as_ptr(),
            usage: c"at job end, write a report of the job's GPU use (devices, denied opens, lingering processes, GPU-seconds); =PATH is optional (%j job id, %N node), without it: gpufence-<jobid>.txt in the job's working directory".as_ptr(),
            has_arg: 2,
            val: 2,
            cb: Some(option_cb),
        },
    ];
    for o in opts.iter_mut() {
        // SAFETY: a valid spank handle from Slurm and a valid option struct.
        let rc = unsafe { spank_option_register(spank, o) };
        if rc != 0 {
            log(
                LogLevel::Error,
                &format!("cannot register an option (spank error {rc})"),
            );
            return -1;
        }
    }
    0
}

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
    let args = unsafe { raw_plugin_args(ac, argv) };
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
    /// read by [`hook`] ([`raw_plugin_args`]).
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

/// Reads the arguments Slurm passes to a callback. A plugstack.conf line
/// with no arguments comes as `argc == 0` and `argv` NULL (`_spank_plugin_create`,
/// `src/common/plugstack.c`): slurm-spank 0.2.4's `plugin_argv` then makes a
/// slice from a NULL pointer, which is undefined behaviour (debug builds
/// abort, taking slurmd down), so the plugin reads them itself.
///
/// # Safety
/// `argv` is NULL or points to `ac` pointers, each NULL or to a
/// NUL-terminated string, valid for the call.
unsafe fn raw_plugin_args(
    ac: c_int,
    argv: *const *const c_char,
) -> Result<PluginArgs, PluginArgsError> {
    if ac <= 0 || argv.is_null() {
        return Ok(PluginArgs::default());
    }
    let mut words = Vec::new();
    for i in 0..ac as usize {
        // SAFETY: i < ac, as the caller promises.
        let p = unsafe { *argv.add(i) };
        if p.is_null() {
            continue;
        }
        // SAFETY: a NUL-terminated string, as the caller promises.
        let w = unsafe { std::ffi::CStr::from_ptr(p) };
        words.push(
            w.to_str()
                .map_err(|_| PluginArgsError::NotUtf8(w.to_owned()))?
                .to_string(),
        );
    }
    PluginArgs::parse(words.iter().map(String::as_str))
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
        && register_options(spank) != 0
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

/// Validates option values where the user types them (srun, sbatch), so a
/// bad value fails at submission with a clear line. Never panics.
unsafe extern "C" fn option_cb(val: c_int, optarg: *const c_char, _remote: c_int) -> c_int {
    let r = catch_unwind(|| {
        if val == 2 && !optarg.is_null() {
            // SAFETY: Slurm passes a NUL-terminated string or NULL.
            let s = unsafe { std::ffi::CStr::from_ptr(optarg) }
                .to_string_lossy()
                .into_owned();
            // A bare `--gpufence-report` reaches slurmstepd as an empty
            // value: the default path, not an error.
            if s.is_empty() || s == "(null)" {
                return 0;
            }
            if let Err(e) = gpufence_model::options::check_report_path(&s) {
                log(LogLevel::Error, &e.to_string());
                return -1;
            }
        }
        0
    });
    r.unwrap_or(-1)
}

/// Why the plugstack.conf arguments are refused; the plugin then fails the
/// callback with this message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PluginArgsError {
    /// An argument that is not `config=PATH` (PATH not empty),
    /// `mode=audit` or `mode=enforce`.
    #[error("unknown plugstack.conf argument {0:?} (known: config=PATH, mode=audit|enforce)")]
    Unknown(String),
    /// An argument that is not UTF-8.
    #[error("plugstack.conf argument {0:?} is not UTF-8")]
    NotUtf8(std::ffi::CString),
}

/// Arguments from plugstack.conf.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PluginArgs {
    /// `config=PATH`.
    pub config: Option<PathBuf>,
    /// `mode=audit|enforce`: overrides the config's `mode` for the fence the
    /// plugin installs at slurmd start.
    pub mode: Option<gpufence_model::config::Mode>,
}

impl PluginArgs {
    /// Parses `key=value` arguments.
    ///
    /// # Errors
    /// [`PluginArgsError::Unknown`] naming an unknown or malformed argument.
    pub fn parse<'a>(argv: impl IntoIterator<Item = &'a str>) -> Result<Self, PluginArgsError> {
        let mut a = PluginArgs::default();
        for arg in argv {
            match arg.split_once('=') {
                Some(("config", v)) if !v.is_empty() => a.config = Some(PathBuf::from(v)),
                Some(("mode", "audit")) => a.mode = Some(gpufence_model::config::Mode::Audit),
                Some(("mode", "enforce")) => a.mode = Some(gpufence_model::config::Mode::Enforce),
                _ => return Err(PluginArgsError::Unknown(arg.to_string())),
            }
        }
        Ok(a)
    }
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

/// The plugin's state across callbacks of one process.
#[derive(Default)]
pub struct GpuFence {
    verdict: Option<StepVerdict>,
    /// Lines for the job's output (task 0's stderr), from the record's
    /// notes for the user: a `--gpu-exclusive` that could not be set, an
    /// MPS daemon that did not start.
    user_notes: Vec<String>,
    /// Variables for the tasks' environment, from the job's record
    /// (`CUDA_MPS_PIPE_DIRECTORY` of gpufence's MPS daemon).
    job_env: Vec<(String, String)>,
    /// Slurm's IMEX channels (`SwitchType=switch/nvidia_imex`): the step's
    /// channel is granted before each task runs, once slurmstepd has made
    /// it ([`gpufence_node::job::imex`]).
    imex: Option<ImexStep>,
}

/// What a task needs to grant its step's IMEX channel.
struct ImexStep {
    /// The config the step's node was loaded from.
    config: Option<PathBuf>,
    req: StepRequest,
    /// The job cgroup, relative to the cgroup2 mount.
    job_cgroup: String,
    /// The channels' major.
    major: u32,
}

fn log(level: LogLevel, msg: &str) {
    if msg.starts_with("gpufence: ") {
        spank_log(level, msg);
    } else {
        spank_log(level, &format!("gpufence: {msg}"));
    }
}

/// This node in the user's lines, as the drain names it: slurmstepd's
/// `SLURMD_NODENAME` (Slurm's node name), else the short host name.
fn node_name() -> String {
    gpufence_model::nodename::node_name(None)
}

/// slurm.conf: `$SLURM_CONF`, which slurmd sets for its plugins (also with
/// `-f` and configless) and slurmstepd inherits, else the default path.
fn slurm_conf_path() -> PathBuf {
    std::env::var_os("SLURM_CONF")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(gresmap::DEFAULT_SLURM_CONF))
}

fn slurmd_start(args: &PluginArgs) -> Result<(), Box<dyn Error>> {
    let mut node = Node::load(args.config.as_deref())?;
    if let Some(m) = args.mode {
        node.cfg.mode = m;
    }
    // slurmd's own command line (this process): its -N, if any.
    let cmdline: Vec<String> = std::fs::read("/proc/self/cmdline")
        .unwrap_or_default()
        .split(|b| *b == 0)
        .map(|w| String::from_utf8_lossy(w).into_owned())
        .collect();
    node.slurm_node = gpufence_node::slurmd_node_arg(&cmdline);
    let conf = slurm_conf_path();
    // layout = "slurm" without proctrack/cgroup (or with cgroup/v1) would
    // refuse every step: refuse slurmd instead, with the one line that says
    // what to set.
    slurmconf::check_node_layout(&node, &conf)?;
    let r = fence_ops::install(&node)?;
    log(
        LogLevel::Info,
        &format!(
            "fence {} at /{} (program {}), protected majors {:?}",
            if r.replaced_program {
                "refreshed"
            } else {
                "installed"
            },
            node.cfg.cgroup_root,
            r.prog_id,
            r.majors
        ),
    );
    for p in &r.exempt_missing {
        log(
            LogLevel::Info,
            &format!("exempt cgroup /{p} does not exist: not exempt"),
        );
    }
    for (c, n) in fence_ops::unknown_exempt_users(&node) {
        log(
            LogLevel::Error,
            &fence_ops::unknown_exempt_user_line(&c, &n),
        );
    }
    // Slurm's IMEX channels: slurmstepd (and, with a namespace plugin, the
    // extern step before its slurm_spank_init) makes channel nodes in the
    // jobs' cgroups under Slurm's scope (gpufence_node::job::imex).
    if let Some(s) = slurmconf::SlurmConf::load(&conf)
        .ok()
        .and_then(|s| s.imex_switch())
    {
        match slurmconf::SlurmConf::load(&conf)
            .ok()
            .and_then(|c| gpufence_node::job::imex::switch_major(&node, &c))
        {
            Some(major) => {
                if let Err(e) = gpufence_node::job::imex::grant_scope_mknod(&node, major) {
                    log(
                        LogLevel::Error,
                        &format!("IMEX channels: Slurm's scope cannot be granted mknod: {e}"),
                    );
                }
            }
            None => log(
                LogLevel::Error,
                &format!(
                    "SwitchType=switch/nvidia_imex, but the IMEX major ({}) is not one the fence protects: jobs get no channel; name it in [majors] as nvidia-caps-imex-channels",
                    s.dev_major
                        .map(|m| m.to_string())
                        .unwrap_or_else(|| "no nvidia-caps-imex-channels in /proc/devices".into())
                ),
            ),
        }
    }
    // Where slurmd actually runs (this process), against the exemptions.
    if let Ok(own) = node.cg.cgroup_of(std::process::id() as i32) {
        if let Some(line) = fence_ops::slurmd_exemption_note(&node, &own) {
            log(LogLevel::Error, &line);
        }
    }
    // Warm the slurmd -G cache; the prolog recomputes it if this fails.
    // An empty list is only "0 GPUs" when gres.conf gives this node none:
    // otherwise refresh fails (NoGpusListed, or a line naming Name=gpu in
    // an unknown shape) and the error is what the log says.
    if node.cfg.slurmd_gres.is_none() && std::env::var_os(gresmap::IN_SLURMD_G_ENV).is_none() {
        match gresmap::refresh(&node, &conf) {
            Ok(m) if m.devices.is_empty() => log(
                LogLevel::Info,
                "slurmd -G lists no GPU and gres.conf gives this node none: no GPU, cached",
            ),
            Ok(m) => log(
                LogLevel::Info,
                &format!("{} GPU(s) in slurmd -G, cached", m.devices.len()),
            ),
            Err(e) => log(
                LogLevel::Error,
                &format!(
                    "GRES cache not warmed (the Prolog of each GPU job runs slurmd -G again): {e}"
                ),
            ),
        }
    }
    Ok(())
}

impl GpuFence {
    fn remote_init(&mut self, spank: &mut SpankHandle) -> Result<(), Box<dyn Error>> {
        let args = plugin_args()?;
        let req = StepRequest {
            job_id: spank.job_id()?,
            step_id: spank.job_stepid()?,
            uid: spank.job_uid()?,
            stepd_pid: std::process::id() as i32,
        };
        let node = match Node::load(args.config.as_deref()) {
            Ok(n) => n,
            Err(e) => {
                let line = grant::load_refused_line(&req, &node_name(), &e);
                log(LogLevel::Error, &line);
                self.verdict = Some(StepVerdict::Refuse(line));
                return Ok(());
            }
        };
        let slurm = slurmconf::SlurmConf::load(&slurm_conf_path()).ok();
        let mut g = grant::grant_step(&node, &req, &node_name(), || {
            slurm.as_ref().is_some_and(|c| c.run_in_job())
        });
        // The job's door: credentials (batch step), container images
        // (gpufence_node::job::door). slurm-spank panics on a NULL item:
        // caught, it is an item not given, never a failed step.
        if req.step_id != grant::EXTERN_STEP_ID {
            let argv = catch_unwind(AssertUnwindSafe(|| spank.job_argv_os()))
                .ok()
                .and_then(Result::ok);
            let env = catch_unwind(AssertUnwindSafe(|| spank.job_env_os()))
                .ok()
                .and_then(Result::ok);
            let step = door::DoorStep {
                req: &req,
                argv: argv.as_deref().unwrap_or_default(),
                env: env.as_deref(),
            };
            let d = door::check_step(&node, slurm.as_ref(), &step);
            for l in &d.log_lines {
                log(LogLevel::Error, l);
            }
            g.user_notes.extend(d.user_lines);
            if let (Some(r), false) = (d.refuse, matches!(g.verdict, StepVerdict::Refuse(_))) {
                g.verdict = StepVerdict::Refuse(r);
            }
        }
        // Slurm's IMEX channels: slurmstepd makes the step's channel node
        // after this callback, in the job cgroup (gpufence_node::job::imex).
        let major = slurm
            .as_ref()
            .and_then(|s| gpufence_node::job::imex::switch_major(&node, s));
        if let (Some(major), Some(job_cgroup)) = (major, &g.job_cgroup) {
            match gpufence_node::job::imex::grant_mknod(&node, &req, job_cgroup, major) {
                Ok(()) => {
                    self.imex = Some(ImexStep {
                        config: args.config.clone(),
                        req,
                        job_cgroup: job_cgroup.clone(),
                        major,
                    })
                }
                Err(e) => log(
                    LogLevel::Error,
                    &format!(
                        "job {} step {}: the IMEX channel node cannot be made in the job cgroup /{job_cgroup}: {e}; Slurm's switch/nvidia_imex will fail the step",
                        req.job_id,
                        grant::step_name(req.step_id)
                    ),
                ),
            }
        }
        if let Some(n) = &g.note {
            log(LogLevel::Verbose, n);
        }
        if let StepVerdict::Refuse(l) | StepVerdict::RunWithoutGpus(l) = &g.verdict {
            log(LogLevel::Error, l);
        }
        self.user_notes = g.user_notes;
        self.job_env = g.job_env;
        self.verdict = Some(g.verdict);
        Ok(())
    }

    fn user_line(&self) -> Option<&str> {
        match &self.verdict {
            Some(StepVerdict::Refuse(l)) | Some(StepVerdict::RunWithoutGpus(l)) => Some(l),
            _ => None,
        }
    }
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
/// not one started by a script.
fn container_hint(argv: &[&str]) -> Option<&'static str> {
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
            log(LogLevel::Error, &error.to_string());
        }
    }

    fn init(&mut self, spank: &mut SpankHandle) -> Result<(), Box<dyn Error>> {
        match spank.context()? {
            Context::Slurmd => {
                let args = plugin_args()?;
                slurmd_start(&args)
            }
            Context::Remote => self.remote_init(spank),
            _ => Ok(()),
        }
    }

    fn task_init_privileged(&mut self, spank: &mut SpankHandle) -> Result<(), Box<dyn Error>> {
        // Runs in the forked task, before exec, stderr already the job's.
        if let Some(StepVerdict::Refuse(line)) = &self.verdict {
            if spank.task_global_id().unwrap_or(0) == 0 {
                let _ = writeln!(std::io::stderr(), "{line}");
            }
            return Err(Box::new(Refused));
        }
        // Root, in slurmstepd's mount namespace, where Slurm made the
        // step's IMEX channel (after slurm_spank_init): grant exactly it.
        if let Some(x) = &self.imex {
            let granted = Node::load(x.config.as_deref())
                .map_err(|e| e.to_string())
                .and_then(|node| {
                    gpufence_node::job::imex::grant_channel(&node, &x.req, &x.job_cgroup, x.major)
                        .map_err(|e| e.to_string())
                });
            if let Err(e) = granted {
                let line = format!(
                    "gpufence: job {} step {}: its IMEX channel could not be granted: {e}; this step's tasks cannot open it",
                    x.req.job_id,
                    grant::step_name(x.req.step_id)
                );
                log(LogLevel::Error, &line);
                if spank.task_global_id().unwrap_or(0) == 0 {
                    let _ = writeln!(std::io::stderr(), "{line}");
                }
            }
        }
        Ok(())
    }

    fn task_init(&mut self, spank: &mut SpankHandle) -> Result<(), Box<dyn Error>> {
        // In the task, before exec: slurmstepd execs the task with the
        // job's environment as this leaves it (`exec_task`,
        // src/slurmd/slurmstepd/task.c; a TaskProlog may still change it).
        for (k, v) in &self.job_env {
            if let Err(e) = spank.setenv(k, v, true) {
                let _ = writeln!(std::io::stderr(), "gpufence: cannot set {k}: {e}");
            }
        }
        if spank.task_global_id().unwrap_or(0) == 0 {
            for n in &self.user_notes {
                let _ = writeln!(std::io::stderr(), "{n}");
            }
            // S_JOB_ARGV: the task's own command line (slurm/spank.h; in
            // task_init it is the argv slurmstepd is about to exec).
            // Only a step that runs with GPUs (Slurm sets SLURM_STEP_GPUS /
            // SLURM_JOB_GPUS in the task's environment for its GRES gpus).
            let has_gpus = ["SLURM_STEP_GPUS", "SLURM_JOB_GPUS"].iter().any(|k| {
                spank
                    .getenv(k)
                    .ok()
                    .flatten()
                    .is_some_and(|v| !v.is_empty())
            });
            if matches!(self.verdict, Some(StepVerdict::Run)) && has_gpus {
                if let Some(hint) = spank.job_argv().ok().and_then(|a| container_hint(&a)) {
                    let _ = writeln!(std::io::stderr(), "{hint}");
                }
            }
        }
        if let (Some(StepVerdict::RunWithoutGpus(_)), Some(line)) =
            (&self.verdict, self.user_line())
        {
            if spank.task_global_id().unwrap_or(0) == 0 {
                let _ = writeln!(std::io::stderr(), "{line}");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args() {
        assert_eq!(PluginArgs::parse([]).unwrap(), PluginArgs::default());
        assert_eq!(
            PluginArgs::parse(["config=/etc/x.toml"]).unwrap().config,
            Some(PathBuf::from("/etc/x.toml"))
        );
        assert_eq!(
            PluginArgs::parse(["mode=audit"]).unwrap().mode,
            Some(gpufence_model::config::Mode::Audit)
        );
        for bad in ["config=", "cfg=/x", "config", "mode=watch", "mode="] {
            assert!(PluginArgs::parse([bad]).is_err(), "{bad}");
        }
    }

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
    fn raw_args_without_any() {
        // A plugstack.conf line with no arguments: argc 0, argv NULL.
        // SAFETY: NULL argv with argc 0 is what the function handles.
        let a = unsafe { raw_plugin_args(0, std::ptr::null()) };
        assert_eq!(a, Ok(PluginArgs::default()));
        let words = [c"config=/etc/x.toml".as_ptr(), c"mode=audit".as_ptr()];
        // SAFETY: two valid C strings.
        let a = unsafe { raw_plugin_args(2, words.as_ptr()) }.unwrap();
        assert_eq!(
            (a.config, a.mode),
            (
                Some(PathBuf::from("/etc/x.toml")),
                Some(gpufence_model::config::Mode::Audit)
            )
        );
        let bad = [c"cfg=/x".as_ptr()];
        // SAFETY: one valid C string.
        assert!(unsafe { raw_plugin_args(1, bad.as_ptr()) }.is_err());
    }
}
