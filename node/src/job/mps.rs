//! gres/mps: NVIDIA's MPS control daemon, one per GPU, run by gpufence
//! (`mps_control` set).
//!
//! Why: Slurm starts no MPS daemon. Its documented pattern
//! (`etc/prolog.example`, gres.html "MPS Management") starts
//! `nvidia-cuda-mps-control -d` from the Prolog, as root, and the server as
//! the job's user (`start_server -uid`), in slurmd's cgroup unless
//! `PrologFlags=RunInJob`, and quits it only in a later Prolog. To the
//! fence that is a process outside every job: denied the GPU, or, holding
//! it, ended at the next job end. Under RunInJob it lives in the first MPS
//! job's cgroup and dies with that job, under its co-tenants' clients.
//!
//! What gpufence does instead:
//! - The Prolog of a gres/mps job (slurmd sets
//!   `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` in the Prolog's environment for
//!   gres/mps jobs only: `gres_p_epilog_set_env` in
//!   `src/plugins/gres/mps/gres_mps.c`, 22.05; `gres_p_prep_set_env`
//!   later) registers the job as a user of each of its GPUs
//!   (`<state_dir>/mps/gpu<minor>/<job_id>`), and for a GPU that has no
//!   daemon yet makes `<cgroup_root>/<mps_cgroup>/gpu<minor>` ([`leaf`]), grants it
//!   that GPU and the job's control devices under [`MPS_GRANT_JOB_ID`], and
//!   starts `mps_control -d` there with `CUDA_VISIBLE_DEVICES` (slurmd's
//!   value for that GPU, as Slurm's sample passes it),
//!   `CUDA_MPS_PIPE_DIRECTORY` and `CUDA_MPS_LOG_DIRECTORY` set
//!   (`<mps_dir>/gpu<minor>/{pipe,log}`). The control daemon starts the
//!   per-user servers as its children: they stay in that cgroup.
//! - The job's record names the pipe directory; the plugin sets
//!   `CUDA_MPS_PIPE_DIRECTORY` in the job's tasks (Slurm sets no
//!   `CUDA_MPS_*` besides the percentage).
//! - The Epilog removes the job's registration; the last job of a GPU
//!   stops its daemon (`quit` on the control daemon's stdin, as
//!   nvidia-cuda-mps-control(1) says), revokes the cgroup's grant, ends
//!   what is left in it and removes it. A daemon is granted its GPU only
//!   while an MPS job holds that GPU.
//!
//! One lock (`<state_dir>/mps.lock`) orders the Prologs and Epilogs of
//! concurrent jobs, so that a daemon is started once and stopped only
//! when no job is registered.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpufence_cgroup::Fence;
use gpufence_model::audit::{events, AuditEvent};
use gpufence_model::device::{DevNum, DeviceRole};
use gpufence_model::record::{JobRecord, MpsDaemon, MPS_GRANT_JOB_ID};

use crate::{join_cgroup, Node, NodeError};

/// The Prolog environment variable slurmd sets for gres/mps jobs only.
pub const MPS_ENV: &str = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";

/// How long the Prolog or Epilog waits for the MPS lock, and for the
/// control command (`-d` returns once the daemon forked; `quit` once it
/// was told).
pub const MPS_WAIT: Duration = Duration::from_secs(10);

/// The name of the daemon of GRES device `dev`: `gpu<minor>` for
/// `/dev/nvidia<minor>` (major `gpu_major`); `dev<major>.<minor>` for a
/// GRES file on another major (a site's or a test's stand-in).
pub fn leaf(dev: DevNum, gpu_major: u32) -> String {
    if dev.major == gpu_major {
        format!("gpu{}", dev.minor)
    } else {
        format!("dev{}.{}", dev.major, dev.minor)
    }
}

/// The daemon's cgroup (relative to the mount):
/// `<cgroup_root>/<mps_cgroup>/<leaf>`.
pub fn cgroup(node: &Node, leaf: &str) -> String {
    join_cgroup(
        &join_cgroup(&node.cfg.cgroup_root, &node.cfg.mps_cgroup),
        leaf,
    )
}

/// The daemon's directory: `<mps_dir>/<leaf>` (`pipe/`, `log/`).
pub fn dir(node: &Node, leaf: &str) -> PathBuf {
    node.cfg.mps_dir.join(leaf)
}

fn err(msg: String) -> NodeError {
    NodeError::JobCgroup(msg)
}

/// The MPS lock, held until dropped.
struct Lock(#[allow(dead_code)] std::fs::File);

fn lock(node: &Node) -> Result<Lock, NodeError> {
    let root = node.state.root();
    gpufence_model::fsutil::create_dir_all_mode(root, 0o700)
        .map_err(|e| NodeError::io("create", root, e))?;
    let p = node.state.mps_lock_path();
    match gpufence_model::fsutil::lock_file_within(&p, MPS_WAIT, Duration::from_millis(10)) {
        Ok(Some(f)) => Ok(Lock(f)),
        Ok(None) => Err(err(format!(
            "{} stayed locked for {} s (another Prolog or Epilog starting or stopping an MPS daemon)",
            p.display(),
            MPS_WAIT.as_secs()
        ))),
        Err(e) => Err(NodeError::io("open", &p, e)),
    }
}

/// Runs `cmd` with `input` on its stdin for up to `wait`; killed past it.
fn run_bounded(mut cmd: Command, input: &[u8], wait: Duration) -> Result<(), String> {
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut child = cmd.spawn().map_err(|e| e.to_string())?;
    if let Some(mut i) = child.stdin.take() {
        let _ = i.write_all(input);
    }
    match crate::host::procs::wait_until(
        &mut child,
        Instant::now() + wait,
        Duration::from_millis(10),
    ) {
        Ok(Some(s)) if s.success() => Ok(()),
        Ok(Some(s)) => Err(format!("exited with {s}")),
        Ok(None) => Err(format!("still running after {} s: killed", wait.as_secs())),
        Err(e) => Err(e.to_string()),
    }
}

/// The control command with the daemon's environment and nothing else.
fn control(node: &Node, program: &std::path::Path, leaf: &str, visible: Option<&str>) -> Command {
    let d = dir(node, leaf);
    let mut c = Command::new(program);
    c.env_clear()
        .env(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        )
        .env("CUDA_MPS_PIPE_DIRECTORY", d.join("pipe"))
        .env("CUDA_MPS_LOG_DIRECTORY", d.join("log"))
        .current_dir("/");
    if let Some(v) = visible {
        c.env("CUDA_VISIBLE_DEVICES", v);
    }
    c
}

/// The job's GPUs with slurmd's `CUDA_VISIBLE_DEVICES` entry for each:
/// `(device, entry)`, from the record's GRES devices.
fn job_gpus(rec: &JobRecord) -> Vec<(DevNum, Option<String>)> {
    let mut seen = BTreeSet::new();
    rec.devices
        .iter()
        .filter(|d| d.role == DeviceRole::Gres)
        .filter(|d| seen.insert(d.dev))
        .map(|d| {
            let pos = d
                .gres_index
                .and_then(|i| rec.gres_indices.iter().position(|g| *g == i));
            let visible = pos.and_then(|p| rec.cuda_visible_devices.get(p).cloned());
            (d.dev, visible)
        })
        .collect()
}

/// The Prolog's part for a gres/mps job (`mps_control` set): registers
/// the job on each of its GPUs and starts the daemons not yet running (see
/// the module's text). Fills `rec.mps`; marks the GPUs shared in
/// `rec.gpu_idle` (the daemon is a co-tenant until the last job ends). A
/// daemon that cannot be started is a note for the user and an `error`
/// line: the job runs with its own grant (MPS clients that find no daemon
/// run "as \[they\] normally would without MPS", nvidia-cuda-mps-control(1)),
/// and nothing else gains the GPU.
///
/// # Errors
/// [`NodeError`] when the lock or the registration cannot be had (the
/// Prolog fails: the job's registration must exist for its Epilog).
pub fn start(node: &Node, fence: &Fence, rec: &mut JobRecord) -> Result<(), NodeError> {
    let Some(program) = node.cfg.mps_control.clone() else {
        return Ok(());
    };
    let gpus = job_gpus(rec);
    if gpus.is_empty() {
        return Ok(());
    }
    let gpu_major = node.gpu_major();
    let _lock = lock(node)?;
    for (dev, visible) in gpus {
        let leaf = leaf(dev, gpu_major);
        let users = node.state.mps_daemon_dir(&leaf);
        gpufence_model::fsutil::create_dir_all_mode(&users, 0o700)
            .map_err(|e| NodeError::io("create", &users, e))?;
        let mark = node.state.mps_registration_path(&leaf, rec.job_id);
        std::fs::write(&mark, b"").map_err(|e| NodeError::io("write", &mark, e))?;
        rec.mps.push(MpsDaemon {
            dev,
            pipe_dir: dir(node, &leaf).join("pipe"),
        });
        for g in rec
            .gpu_idle
            .iter_mut()
            .filter(|g| dev.major == gpu_major && g.minor == dev.minor)
        {
            g.shared = true;
        }
        if !node.cg.procs_recursive(&cgroup(node, &leaf)).is_empty() {
            continue;
        }
        if let Err(why) = start_one(node, fence, rec, &program, dev, &leaf, visible.as_deref()) {
            rec.user_notes.push(format!(
                "gres/mps: no MPS daemon for {dev} ({why}); the job runs without MPS"
            ));
            node.audit(
                AuditEvent::new(events::ERROR)
                    .job(rec.job_id)
                    .field("phase", "prolog")
                    .field("mps_daemon", leaf.clone())
                    .field("reason", format!("MPS control daemon not started: {why}")),
            )?;
        }
    }
    Ok(())
}

fn start_one(
    node: &Node,
    fence: &Fence,
    rec: &JobRecord,
    program: &std::path::Path,
    gpu: DevNum,
    leaf: &str,
    visible: Option<&str>,
) -> Result<(), String> {
    let d = dir(node, leaf);
    for sub in ["pipe", "log"] {
        let p = d.join(sub);
        std::fs::create_dir_all(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        // Clients of every MPS job's user connect in `pipe`; both are
        // root's, written by the daemon alone.
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .map_err(|e| format!("{}: {e}", p.display()))?;
    }
    let cg = cgroup(node, leaf);
    node.cg.create(&cg).map_err(|e| e.to_string())?;
    let id = node.cg.id(&cg).map_err(|e| e.to_string())?;
    let devs: Vec<(DevNum, gpufence_model::device::Access)> = rec
        .devices
        .iter()
        .filter(|d| d.role == DeviceRole::Control || d.dev == gpu)
        .map(|d| (d.dev, d.access))
        .collect();
    fence
        .grant_in(&node.cg, id, &cg, MPS_GRANT_JOB_ID, &devs)
        .map_err(|e| e.to_string())?;
    let mut cmd = control(node, program, leaf, visible);
    cmd.arg("-d");
    node.cg
        .join_at_exec(&cg, &mut cmd)
        .map_err(|e| e.to_string())?;
    if let Err(e) = run_bounded(cmd, b"", MPS_WAIT) {
        let _ = fence.revoke_cgroup(id);
        let _ = crate::host::exec_cgroup::kill_and_remove(node, &cg, MPS_WAIT);
        return Err(format!("{} -d: {e}", program.display()));
    }
    let _ = node.audit(
        AuditEvent::new(events::MPS_STARTED)
            .job(rec.job_id)
            .devices(devs.iter().map(|(d, _)| d))
            .field("mps_daemon", leaf)
            .field("cgroup", crate::host::cgpath::abs(&cg))
            .field("pids", node.cg.procs_recursive(&cg)),
    );
    Ok(())
}

/// What [`release`] did on one GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Released {
    /// The daemon's name ([`leaf`]).
    pub leaf: String,
    /// Whether the daemon was stopped (the job was the GPU's last MPS job).
    pub stopped: bool,
    /// Processes still in the daemon's cgroup after `quit`, killed.
    pub killed: Vec<i32>,
}

/// The Epilog's part: removes job `job_id`'s registrations; on a GPU no
/// other job is registered on, stops the daemon (`quit`, up to
/// `kill_wait_ms` for its cgroup to empty), revokes its cgroup's grant,
/// kills what is left and removes the cgroup and its directory. Runs
/// whatever `mps_control` says now (a daemon started before it was unset
/// is still stopped; `quit` is skipped then). Returns what was done on
/// each GPU, and what failed, as text, after trying every GPU: the lock, a
/// grant that could not be revoked or a daemon cgroup that could not be
/// emptied (the node is unclean: the Epilog drains it).
pub fn release(node: &Node, fence: Option<&Fence>, job_id: u32) -> (Vec<Released>, Vec<String>) {
    let mut done = Vec::new();
    let mut errors = Vec::new();
    let Ok(entries) = std::fs::read_dir(node.state.mps_registry_dir()) else {
        return (done, errors);
    };
    let mine: Vec<String> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|leaf| node.state.mps_registration_path(leaf, job_id).exists())
        .collect();
    if mine.is_empty() {
        return (done, errors);
    }
    let _lock = match lock(node) {
        Ok(l) => l,
        Err(e) => {
            errors.push(e.to_string());
            return (done, errors);
        }
    };
    for leaf in mine {
        let users = node.state.mps_daemon_dir(&leaf);
        let _ = std::fs::remove_file(node.state.mps_registration_path(&leaf, job_id));
        let others = std::fs::read_dir(&users)
            .map(|r| r.flatten().count())
            .unwrap_or(0);
        if others > 0 {
            done.push(Released {
                leaf,
                stopped: false,
                killed: Vec::new(),
            });
            continue;
        }
        let _ = std::fs::remove_dir(&users);
        match stop_one(node, fence, &leaf) {
            Ok(killed) => {
                let _ = node.audit(
                    AuditEvent::new(events::MPS_STOPPED)
                        .job(job_id)
                        .field("mps_daemon", leaf.clone())
                        .field("killed", killed.clone()),
                );
                done.push(Released {
                    leaf,
                    stopped: true,
                    killed,
                });
            }
            Err(e) => errors.push(format!("MPS daemon {leaf}: {e}")),
        }
    }
    (done, errors)
}

fn stop_one(node: &Node, fence: Option<&Fence>, leaf: &str) -> Result<Vec<i32>, String> {
    let cg = cgroup(node, leaf);
    let id = node.cg.id(&cg).ok();
    if let Some(program) = &node.cfg.mps_control {
        if !node.cg.procs_recursive(&cg).is_empty() {
            // A daemon that does not answer is killed below.
            let _ = run_bounded(control(node, program, leaf, None), b"quit\n", MPS_WAIT);
        }
    }
    let wait = Duration::from_millis(node.cfg.kill_wait_ms);
    let deadline = Instant::now() + wait;
    while !node.cg.procs_recursive(&cg).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    if let (Some(f), Some(id)) = (fence, id) {
        f.revoke_cgroup(id)
            .map_err(|e| format!("revoking its grant: {e}"))?;
    }
    let killed = node.cg.procs_recursive(&cg);
    if node.cg.path(&cg).exists() {
        crate::host::exec_cgroup::kill_and_remove(node, &cg, wait)
            .map_err(|e| format!("{e} (processes {killed:?})"))?;
    }
    let _ = std::fs::remove_dir_all(dir(node, leaf));
    // The parent too, once no daemon is left (fails while one is).
    let _ = std::fs::remove_dir(
        node.cg
            .path(&join_cgroup(&node.cfg.cgroup_root, &node.cfg.mps_cgroup)),
    );
    Ok(killed)
}
