//! `gpufence.so`, the SPANK plugin. Glue only: it reads Slurm's items into a
//! [`StepRequest`] and calls `gpufence-node`; the logic and its tests live
//! there.
//!
//! - slurmd context (slurmd start, root): install (or refresh) the fence and
//!   warm the `slurmd -G` cache. A failure stops slurmd (fail closed, loud).
//! - remote context (slurmstepd, root), `slurm_spank_init`: place the step
//!   (fence present, job cgroup found or made) and apply the job's record.
//! - `task_init_privileged` / `task_init` (in each task, before exec, stderr
//!   connected to the job's): print the one line the user must see, and
//!   stop the task when the step was refused.
//! - local / allocator / job_script contexts: nothing (srun runs as the
//!   user: never touch root-only paths there).
//!
//! plugstack.conf arguments: `config=PATH`, `mode=audit|enforce`. Unknown
//! arguments are errors.
//! Panics are caught by slurm-spank (`catch_unwind`) and become -1.

use std::error::Error;
use std::io::Write;
use std::path::PathBuf;

use slurm_spank::{spank_log, Context, LogLevel, Plugin, SpankHandle};

use gpufence_node::apply::{self, StepRequest, StepVerdict};
use gpufence_node::{fence_ops, gresmap, Node};

include!(concat!(env!("OUT_DIR"), "/plugin_decl.rs"));

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
    /// A message naming an unknown or malformed argument.
    pub fn parse<'a>(argv: impl IntoIterator<Item = &'a str>) -> Result<Self, String> {
        let mut a = PluginArgs::default();
        for arg in argv {
            match arg.split_once('=') {
                Some(("config", v)) if !v.is_empty() => a.config = Some(PathBuf::from(v)),
                Some(("mode", "audit")) => a.mode = Some(gpufence_model::config::Mode::Audit),
                Some(("mode", "enforce")) => a.mode = Some(gpufence_model::config::Mode::Enforce),
                _ => {
                    return Err(format!(
                        "unknown plugstack.conf argument {arg:?} (known: config=PATH, mode=audit|enforce)"
                    ))
                }
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
}

fn log(level: LogLevel, msg: &str) {
    if msg.starts_with("gpufence: ") {
        spank_log(level, msg);
    } else {
        spank_log(level, &format!("gpufence: {msg}"));
    }
}

fn node_name() -> String {
    nix_hostname().unwrap_or_else(|| "this node".into())
}

fn nix_hostname() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname into a buffer we own, NUL-terminated by the kernel
    // when it fits.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return None;
    }
    let end = buf.iter().position(|b| *b == 0)?;
    Some(String::from_utf8_lossy(&buf[..end]).into_owned())
}

fn slurmd_start(args: &PluginArgs) -> Result<(), Box<dyn Error>> {
    let mut node = Node::load(args.config.as_deref())?;
    if let Some(m) = args.mode {
        node.cfg.mode = m;
    }
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
    // Warm the slurmd -G cache; the prolog recomputes it if this fails.
    if node.cfg.slurmd_gres.is_none() && std::env::var_os(gresmap::IN_SLURMD_G_ENV).is_none() {
        let conf = std::env::var_os("SLURM_CONF")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(gresmap::DEFAULT_SLURM_CONF));
        match gresmap::refresh(&node, &conf) {
            Ok(m) => log(
                LogLevel::Info,
                &format!("{} GPU(s) in slurmd -G, cached", m.devices.len()),
            ),
            Err(e) => log(LogLevel::Error, &format!("GRES cache not warmed: {e}")),
        }
    }
    Ok(())
}

impl GpuFence {
    fn remote_init(&mut self, spank: &mut SpankHandle) -> Result<(), Box<dyn Error>> {
        let args = PluginArgs::parse(spank.plugin_argv()?)?;
        let req = StepRequest {
            job_id: spank.job_id()?,
            step_id: spank.job_stepid()?,
            uid: spank.job_uid()?,
            stepd_pid: std::process::id() as i32,
        };
        let node = match Node::load(args.config.as_deref()) {
            Ok(n) => n,
            Err(e) => {
                let line = format!(
                    "gpufence: job {} refused on {}: {e}",
                    req.job_id,
                    node_name()
                );
                log(LogLevel::Error, &line);
                self.verdict = Some(StepVerdict::Refuse(line));
                return Ok(());
            }
        };
        let placed = apply::place(&node, &req);
        let granted = placed.as_ref().ok().map(|p| apply::grant(&node, &req, p));
        if let Some(Ok(apply::ApplyOutcome::Granted {
            cgroup_path,
            devices,
            ..
        })) = &granted
        {
            log(
                LogLevel::Verbose,
                &format!(
                    "job {} step {}: {devices} device(s) granted to /{cgroup_path}",
                    req.job_id, req.step_id
                ),
            );
        }
        let v = apply::verdict(&node, &req, &node_name(), &placed, granted.as_ref());
        if let StepVerdict::Refuse(l) | StepVerdict::RunWithoutGpus(l) = &v {
            log(LogLevel::Error, l);
        }
        self.verdict = Some(v);
        Ok(())
    }

    fn user_line(&self) -> Option<&str> {
        match &self.verdict {
            Some(StepVerdict::Refuse(l)) | Some(StepVerdict::RunWithoutGpus(l)) => Some(l),
            _ => None,
        }
    }
}

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
                let args = PluginArgs::parse(spank.plugin_argv()?)?;
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
        Ok(())
    }

    fn task_init(&mut self, spank: &mut SpankHandle) -> Result<(), Box<dyn Error>> {
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
    fn built_for_the_installed_headers() {
        // 22.05.8 on Debian 12: 0x160508; any build: major.minor non-zero.
        assert!(BUILT_FOR_SLURM >> 8 != 0);
    }
}
