//! gres/mps: NVIDIA's MPS control daemon, one per GPU and job user, run by
//! gpufence (`mps_control` set).
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
//! Why one daemon per user: NVIDIA's control daemon serves whoever reaches
//! its pipe directory. It starts an MPS server with the uid of the
//! requesting client (nvidia-cuda-mps-control(1)), so one daemon for a
//! GPU, reachable by every user, starts a server for a user with no
//! gres/mps allocation inside the cgroup the fence grants the GPU; that
//! server, exec'ed and so dumpable by its uid, hands its GPU descriptor to
//! its user (`pidfd_getfd(2)`) without an `open` the fence could deny. And
//! `quit` ("Shutdown the MPS control daemon process and all MPS servers",
//! nvidia-cuda-mps-control(1)) is taken from whoever connects: NVIDIA
//! documents no per-command access check, so file permissions are the only
//! control. Several control daemons may run side by side, each addressed by
//! its own `CUDA_MPS_PIPE_DIRECTORY` (docs.nvidia.com/deploy/mps, "Tools
//! and Interface Reference"), so gpufence runs one per (GPU, uid) and lets
//! only that uid reach it.
//!
//! What gpufence does:
//! - The Prolog of a gres/mps job (slurmd sets
//!   `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` in the Prolog's environment for
//!   gres/mps jobs only: `gres_p_epilog_set_env` in
//!   `src/plugins/gres/mps/gres_mps.c`, 22.05; `gres_p_prep_set_env`
//!   later) first ends every process of a foreign uid in the daemons'
//!   cgroups ([`end_foreign`]), then registers the job with its user's
//!   daemon on each of its GPUs
//!   (`<state_dir>/mps/<leaf>-u<uid>/<job_id>`, [`daemon_name`]), and for
//!   a daemon not running (never started, or gone: its user's own `quit`,
//!   a crash) makes `<cgroup_root>/<mps_cgroup>/<leaf>-u<uid>`
//!   ([`cgroup`]), grants it that GPU and the job's control devices under
//!   [`MPS_GRANT_JOB_ID`], and starts `mps_control -d` there **as the
//!   job's user** (its primary and supplementary groups) with
//!   `CUDA_VISIBLE_DEVICES` (slurmd's value for that GPU, as Slurm's sample
//!   passes it), `CUDA_MPS_PIPE_DIRECTORY` and `CUDA_MPS_LOG_DIRECTORY`
//!   set (`<mps_dir>/<leaf>/u<uid>/{pipe,log}`, [`user_dir`]) and no
//!   descriptor but stdio (`close_range(2)`). The control daemon starts its
//!   user's server as its child: it stays in that cgroup.
//! - Why as the user: nvidia-cuda-mps-control(1) lists `start_server -uid
//!   UID`, taken from whoever reaches the pipe; a daemon run as root would
//!   start a server of any uid (root's, another user's) in the cgroup
//!   granted the GPU. A daemon run as a user cannot set another uid
//!   (`setuid(2)`: EPERM), so the user can harm only their own daemon.
//!   NVIDIA documents the control daemon as "typically" run as root, and
//!   one run as a normal user as serving that user's clients only
//!   (docs.nvidia.com/deploy/mps). Only a real GPU can confirm that
//!   NVIDIA's daemon runs so with these directories and refuses
//!   `start_server -uid` of another uid.
//! - The directories ([`DIR_MODES`]): `<mps_dir>` and `<mps_dir>/<leaf>`
//!   are root's, 0755; `<mps_dir>/<leaf>/u<uid>` is root's, 0700, with one
//!   POSIX ACL entry `user:<uid>:r-x` ([`traverse_acl`]): only that uid
//!   (and root) reaches the pipes, and, owning nothing on the path to
//!   `u<uid>`, it can neither open it to others (`chmod`) nor swap it for
//!   a symbolic link that root would then follow. `pipe` and `log` inside
//!   are the user's (0700: the daemon writes there); root only ever
//!   removes them (`remove_dir_all`, which follows no link) and asks
//!   nothing of the daemon through them. A file system without POSIX ACLs
//!   gets no daemon (fail closed: the job runs without MPS, with a note).
//! - The job's record names its user's pipe directory; the plugin sets
//!   `CUDA_MPS_PIPE_DIRECTORY` in the job's tasks (Slurm sets no
//!   `CUDA_MPS_*` besides the percentage).
//! - The Epilog removes the job's registrations first, under no lock, ends
//!   foreign processes as the Prolog does, and for a daemon no job is
//!   registered with any more: revokes the cgroup's grant, kills
//!   everything in it (`cgroup.kill`: a daemon its user stopped is ended
//!   at once; no `quit` through a pipe directory the user owns) and
//!   removes it and the directories. A daemon is granted its GPU only
//!   while an MPS job of its user holds that GPU.
//!
//! A user's own `quit` ends that user's daemon and server only: self-harm,
//! the other users' daemons are untouched; the user's next MPS job's Prolog
//! starts a fresh one, and the Epilog of the last tolerates it gone.
//!
//! Caveat, only a real GPU can confirm: two users' MPS jobs on one GPU get
//! two MPS servers, time-sliced by the driver, where NVIDIA's one daemon
//! per GPU would queue the second user until the first's server exits; and
//! under the `EXCLUSIVE_PROCESS` compute mode the second user's server
//! cannot open the GPU until the first user's jobs end.
//!
//! Locking: one lock per daemon (`<state_dir>/mps-locks/<leaf>-u<uid>.lock`)
//! orders the Prologs and Epilogs of one user's jobs on one GPU, so that a
//! daemon is started once and stopped only when no job of its user is
//! registered; one user's slow daemon never holds up another's. A
//! registration holds the pid and start time of the Prolog that wrote it:
//! one whose job has no record and whose Prolog is gone is stale
//! ([`prune_stale`]: by the next Prolog or Epilog of that daemon, and by
//! `gpufence sweep`, which stops a daemon none is left of). An Epilog that
//! cannot have the lock within [`MPS_WAIT`] stops a daemon no job is
//! registered with all the same (fail closed).

use std::collections::BTreeSet;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpufence_cgroup::Fence;
use gpufence_model::audit::{events, AuditEvent};
use gpufence_model::device::{DevNum, DeviceRole};
use gpufence_model::record::{JobRecord, MpsDaemon, MPS_GRANT_JOB_ID};

use crate::{Node, NodeError};

/// The Prolog environment variable slurmd sets for gres/mps jobs only.
pub const MPS_ENV: &str = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";

/// The modes of the directories on the way to a daemon's pipes:
/// `<mps_dir>`, `<mps_dir>/<leaf>` (root's), `<mps_dir>/<leaf>/u<uid>`
/// (root's, with the ACL [`traverse_acl`] for its uid), and its `pipe`
/// and `log` (the daemon's user's: the daemon runs as that user and writes
/// there).
pub const DIR_MODES: [u32; 5] = [0o755, 0o755, 0o700, 0o700, 0o700];

/// The name of the GPU of GRES device `dev`: `gpu<minor>` for
/// `/dev/nvidia<minor>` (major `gpu_major`); `dev<major>.<minor>` for a
/// GRES file on another major (a site's or a test's stand-in).
pub fn leaf(dev: DevNum, gpu_major: u32) -> String {
    if dev.major == gpu_major {
        format!("gpu{}", dev.minor)
    } else {
        format!("dev{}.{}", dev.major, dev.minor)
    }
}

pub use crate::host::mps_cgroups::{
    daemon_name, gpu_dir, is_foreign, parse_daemon, prune_stale, registry_daemons, sweep_stale,
    user_dir, MpsStartError, MpsStopError, RunError, SweptDaemon, MPS_WAIT,
};
use crate::host::mps_cgroups::{lock, registered, registration_mark, stop_one};

/// The parent of the daemons' cgroups: `<cgroup_root>/<mps_cgroup>`.
pub fn cgroup_parent(node: &Node) -> String {
    crate::host::mps_cgroups::parent(node)
}

/// A daemon's cgroup (relative to the mount):
/// `<cgroup_root>/<mps_cgroup>/<daemon>` ([`daemon_name`]).
pub fn cgroup(node: &Node, daemon: &str) -> String {
    crate::host::mps_cgroups::daemon_cgroup(node, daemon)
}

/// The value of the `system.posix_acl_access` extended attribute that lets
/// `uid` list and traverse a directory of mode 0700 and no one else in:
/// `user::rwx user:<uid>:r-x group::--- mask::r-x other::---`, in the
/// kernel's format (`struct posix_acl_xattr_header` and `_entry`, little
/// endian, entries in tag order: `include/uapi/linux/posix_acl_xattr.h`,
/// `include/uapi/linux/posix_acl.h`).
pub fn traverse_acl(uid: u32) -> Vec<u8> {
    const VERSION: u32 = 2;
    const UNDEFINED: u32 = u32::MAX;
    // (tag, perm, id): ACL_USER_OBJ, ACL_USER, ACL_GROUP_OBJ, ACL_MASK,
    // ACL_OTHER.
    let entries: [(u16, u16, u32); 5] = [
        (0x01, 7, UNDEFINED),
        (0x02, 5, uid),
        (0x04, 0, UNDEFINED),
        (0x10, 5, UNDEFINED),
        (0x20, 0, UNDEFINED),
    ];
    let mut v = VERSION.to_le_bytes().to_vec();
    for (tag, perm, id) in entries {
        v.extend_from_slice(&tag.to_le_bytes());
        v.extend_from_slice(&perm.to_le_bytes());
        v.extend_from_slice(&id.to_le_bytes());
    }
    v
}

/// Sets [`traverse_acl`] on directory `path` (no symbolic link followed).
fn set_traverse_acl(path: &Path, uid: u32) -> Result<(), MpsStartError> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| {
        MpsStartError::NulInPath {
            path: path.to_path_buf(),
        }
    })?;
    let acl = traverse_acl(uid);
    // SAFETY: lsetxattr(2) with NUL-terminated strings and a buffer of
    // acl.len() bytes we own.
    let r = unsafe {
        libc::lsetxattr(
            c.as_ptr(),
            c"system.posix_acl_access".as_ptr(),
            acl.as_ptr().cast(),
            acl.len(),
            0,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(MpsStartError::Acl {
            path: path.to_path_buf(),
            uid,
            source: std::io::Error::last_os_error(),
        })
    }
}

/// Whether `meta` is of a directory root owns that no one else may write
/// (so no one else can put a symbolic link in its place or inside it).
fn root_only_dir(meta: &std::fs::Metadata) -> bool {
    meta.file_type().is_dir() && meta.uid() == 0 && meta.mode() & 0o022 == 0
}

/// Makes directory `p` (mode `mode`, root's) if missing, and checks it is
/// a directory, not a link, root's and writable by root alone.
fn root_dir(p: &Path, mode: u32) -> Result<(), MpsStartError> {
    match std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), mode & 0o700)
        .create(p)
    {
        Ok(()) => std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
            .map_err(dir_error(p))?,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(dir_error(p)(e)),
    }
    let m = std::fs::symlink_metadata(p).map_err(dir_error(p))?;
    if root_only_dir(&m) {
        Ok(())
    } else {
        Err(MpsStartError::NotRootOnly {
            path: p.to_path_buf(),
            owner: m.uid(),
            mode: m.mode() & 0o7777,
        })
    }
}

/// [`MpsStartError::Dir`] of `p`.
fn dir_error(p: &Path) -> impl Fn(std::io::Error) -> MpsStartError + '_ {
    move |source| MpsStartError::Dir {
        path: p.to_path_buf(),
        source,
    }
}

/// Makes directory `p` (mode `mode`) for `uid`:`gid`, where no one but
/// root may write the parent (so nothing can be swapped in between), and
/// checks it is a directory, not a link, of that owner and mode.
fn user_owned_dir(p: &Path, mode: u32, uid: u32, gid: u32) -> Result<(), MpsStartError> {
    std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), mode & 0o700)
        .create(p)
        .map_err(dir_error(p))?;
    std::os::unix::fs::lchown(p, Some(uid), Some(gid)).map_err(dir_error(p))?;
    let m = std::fs::symlink_metadata(p).map_err(dir_error(p))?;
    if m.file_type().is_dir() && m.uid() == uid && m.mode() & 0o7777 == mode {
        Ok(())
    } else {
        Err(MpsStartError::NotAsMade {
            path: p.to_path_buf(),
            uid,
            mode,
        })
    }
}

/// Makes uid `uid`'s directory on GPU `leaf` afresh, as [`DIR_MODES`]
/// says: what an earlier daemon left there is removed first. `pipe` and
/// `log` are `uid`'s (group `gid`), made inside root's `u<uid>`, which
/// `uid` cannot write.
fn make_user_dirs(
    node: &Node,
    leaf: &str,
    uid: u32,
    gid: u32,
) -> Result<(PathBuf, PathBuf), MpsStartError> {
    let mps = &node.cfg.mps_dir;
    if let Some(parent) = mps.parent() {
        std::fs::create_dir_all(parent).map_err(dir_error(parent))?;
    }
    root_dir(mps, DIR_MODES[0])?;
    let g = gpu_dir(node, leaf);
    root_dir(&g, DIR_MODES[1])?;
    let u = user_dir(node, leaf, uid);
    // A root-owned path under root-only directories: nothing on it is a
    // user's to redirect; remove_dir_all removes the user's `pipe` and
    // `log` and a link in them, never follows one.
    match std::fs::remove_dir_all(&u) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(dir_error(&u)(e)),
    }
    root_dir(&u, DIR_MODES[2])?;
    set_traverse_acl(&u, uid)?;
    let (pipe, log) = (u.join("pipe"), u.join("log"));
    user_owned_dir(&pipe, DIR_MODES[3], uid, gid)?;
    user_owned_dir(&log, DIR_MODES[4], uid, gid)?;
    Ok((pipe, log))
}

/// Runs `cmd` with `input` on its stdin for up to `wait`; killed past it.
fn run_bounded(mut cmd: Command, input: &[u8], wait: Duration) -> Result<(), RunError> {
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut child = cmd.spawn().map_err(RunError::Io)?;
    if let Some(mut i) = child.stdin.take() {
        let _ = i.write_all(input);
    }
    match crate::host::procs::wait_until(
        &mut child,
        Instant::now() + wait,
        Duration::from_millis(10),
    ) {
        Ok(Some(s)) if s.success() => Ok(()),
        Ok(Some(s)) => Err(RunError::Exited(s)),
        Ok(None) => Err(RunError::TimedOut {
            secs: wait.as_secs(),
        }),
        Err(e) => Err(RunError::Io(e)),
    }
}

/// The control command with the daemon's environment and nothing else:
/// its pipe and log directories.
fn control(program: &Path, pipe: &Path, log: &Path, visible: Option<&str>) -> Command {
    let mut c = Command::new(program);
    c.env_clear()
        .env(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        )
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .env("CUDA_MPS_LOG_DIRECTORY", log)
        .current_dir("/");
    if let Some(v) = visible {
        c.env("CUDA_VISIBLE_DEVICES", v);
    }
    c
}

/// Who a daemon of uid `uid` runs as: `(gid, groups)`, its user's primary
/// group and its supplementary groups (`getgrouplist(3)`).
fn daemon_identity(uid: u32) -> Result<(u32, Vec<u32>), MpsStartError> {
    let user = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
        .map_err(|source| MpsStartError::User { uid, source })?
        .ok_or(MpsStartError::NoUser { uid })?;
    let name = std::ffi::CString::new(user.name.as_bytes())
        .map_err(|_| MpsStartError::NulInName { uid })?;
    let groups = nix::unistd::getgrouplist(&name, user.gid)
        .map_err(|source| MpsStartError::Groups { uid, source })?;
    Ok((
        user.gid.as_raw(),
        groups.into_iter().map(|g| g.as_raw()).collect(),
    ))
}

/// Makes `cmd` run as `uid` (primary group `gid`, supplementary `groups`)
/// with no descriptor but stdio, after the `pre_exec` hooks already set
/// (joining a cgroup needs root).
fn drop_to(cmd: &mut Command, uid: u32, gid: u32, groups: Vec<u32>) {
    use std::os::unix::process::CommandExt;
    let groups: Vec<libc::gid_t> = groups;
    // SAFETY: between fork and exec only async-signal-safe system calls:
    // setgroups(2), setgid(2), setuid(2) and close_range(2) (or fcntl(2)),
    // on memory the closure owns; nothing allocates.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setgroups(groups.len(), groups.as_ptr()) != 0
                || libc::setgid(gid) != 0
                || libc::setuid(uid) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            crate::host::procs::cloexec_above_stdio()
        });
    }
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

/// Whether the control daemon of cgroup `cg` runs: a process of its uid
/// there (it runs as its user, [`is_foreign`] ends every other uid's).
fn daemon_runs(node: &Node, cg: &str, uid: u32) -> bool {
    node.cg
        .procs_recursive(cg)
        .into_iter()
        .any(|p| crate::host::procs::uid_of(p) == Some(uid))
}

/// A process [`end_foreign`] found and ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Foreign {
    /// Its pid.
    pub pid: i32,
    /// Its real uid.
    pub uid: u32,
    /// The daemon's cgroup it was in (relative to the mount).
    pub cgroup: String,
    /// Whether it is gone now.
    pub ended: bool,
}

/// Ends (`SIGKILL` through a pidfd) every process in a daemon's cgroup
/// whose real uid is foreign to it ([`is_foreign`]): the daemon serves its
/// user only, and anything else there holds the daemon's grant. Each is
/// audited (`mps_foreign_process`, with `job` when a Prolog or Epilog
/// found it), never ended silently. Called (under no lock) by the
/// Prolog and the Epilog of every gres/mps job.
pub fn end_foreign(node: &Node, job: Option<u32>, phase: &str) -> Vec<Foreign> {
    let mut out = Vec::new();
    for f in crate::host::mps_cgroups::foreign_processes(node) {
        // The pidfd first, then the uid and the cgroup again: the signal
        // is then for the process judged, whatever happens to the pid.
        let Some(fd) = crate::response::engine::pidfd_open(f.pid) else {
            continue;
        };
        let uid = crate::host::procs::uid_of(f.pid);
        if uid != Some(f.uid) || !node.cg.procs_recursive(&f.cgroup).contains(&f.pid) {
            continue;
        }
        crate::response::engine::signal(&fd, libc::SIGKILL);
        crate::response::engine::wait_all(
            &[&fd],
            node.bound(
                crate::host::deadline::Wait::MpsKill,
                Duration::from_millis(node.cfg.kill_wait_ms),
            ),
        );
        let ended = crate::response::engine::exited(&fd);
        let mut ev = AuditEvent::new(events::MPS_FOREIGN_PROCESS)
            .pid(f.pid)
            .uid(f.uid)
            .field("phase", phase)
            .field("cgroup", crate::host::cgpath::abs(&f.cgroup))
            .field(
                "daemon_uid",
                f.daemon_uid.map_or(serde_json::Value::Null, Into::into),
            )
            .field("killed", ended);
        if let Some(j) = job {
            ev = ev.job(j);
        }
        let _ = node.audit(ev);
        out.push(Foreign {
            pid: f.pid,
            uid: f.uid,
            cgroup: f.cgroup,
            ended,
        });
    }
    out
}

/// The Prolog's part for a gres/mps job (`mps_control` set): ends foreign
/// processes in the daemons' cgroups ([`end_foreign`]), registers the job
/// with its user's daemon on each of its GPUs and starts the daemons not
/// running (see the module's text). Fills `rec.mps`; marks the GPUs shared
/// in `rec.gpu_idle` (the daemon is a co-tenant until the last job ends).
/// A daemon that cannot be started is a note for the user and an `error`
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
    let uid = rec.uid;
    end_foreign(node, Some(rec.job_id), "prolog");
    for (dev, visible) in gpus {
        let leaf = leaf(dev, gpu_major);
        let name = daemon_name(&leaf, uid);
        let _lock = lock(node, &name)?;
        prune_stale(node, &name, Some(rec.job_id), "prolog");
        let users = node.state.mps_daemon_dir(&name);
        gpufence_model::fsutil::create_dir_all_mode(&users, 0o700)
            .map_err(|e| NodeError::io("create", &users, e))?;
        let mark = node.state.mps_registration_path(&name, rec.job_id);
        std::fs::write(&mark, registration_mark()).map_err(|e| NodeError::io("write", &mark, e))?;
        rec.mps.push(MpsDaemon {
            dev,
            pipe_dir: user_dir(node, &leaf, uid).join("pipe"),
        });
        for g in rec
            .gpu_idle
            .iter_mut()
            .filter(|g| dev.major == gpu_major && g.minor == dev.minor)
        {
            g.shared = true;
        }
        let cg = cgroup(node, &name);
        if daemon_runs(node, &cg, uid) {
            continue;
        }
        // Gone (its user's `quit`, a crash) or never started: what is left
        // of it goes, then a fresh one starts.
        let restart = node.cg.path(&cg).exists();
        if restart {
            if let Err(why) = stop_one(node, Some(fence), &name) {
                let _ = node.audit(
                    AuditEvent::new(events::ERROR)
                        .job(rec.job_id)
                        .field("phase", "prolog")
                        .field("mps_daemon", name.clone())
                        .field(
                            "reason",
                            format!("MPS daemon found gone, not cleaned: {why}"),
                        ),
                );
            }
        }
        let started = start_one(
            node,
            fence,
            rec,
            &program,
            (dev, &leaf, uid),
            visible.as_deref(),
            restart,
        );
        if let Err(why) = started {
            rec.user_notes.push(format!(
                "gres/mps: no MPS daemon for {dev} ({why}); the job runs without MPS"
            ));
            node.audit(
                AuditEvent::new(events::ERROR)
                    .job(rec.job_id)
                    .field("phase", "prolog")
                    .field("mps_daemon", name.clone())
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
    program: &Path,
    (gpu, leaf, uid): (DevNum, &str, u32),
    visible: Option<&str>,
    restart: bool,
) -> Result<(), MpsStartError> {
    let name = daemon_name(leaf, uid);
    let (gid, groups) = daemon_identity(uid)?;
    let (pipe, log) = match make_user_dirs(node, leaf, uid, gid) {
        Ok(p) => p,
        Err(e) => {
            let _ = std::fs::remove_dir_all(user_dir(node, leaf, uid));
            return Err(e);
        }
    };
    let cg = cgroup(node, &name);
    node.cg.create(&cg)?;
    let id = node.cg.id(&cg)?;
    let devs: Vec<(DevNum, gpufence_model::device::Access)> = rec
        .devices
        .iter()
        .filter(|d| d.role == DeviceRole::Control || d.dev == gpu)
        .map(|d| (d.dev, d.access))
        .collect();
    fence.grant_in(&node.cg, id, &cg, MPS_GRANT_JOB_ID, &devs)?;
    let mut cmd = control(program, &pipe, &log, visible);
    cmd.arg("-d");
    // First, as root: into the daemon's cgroup; then as its user.
    node.cg.join_at_exec(&cg, &mut cmd)?;
    drop_to(&mut cmd, uid, gid, groups);
    if let Err(e) = run_bounded(cmd, b"", MPS_WAIT) {
        let _ = fence.revoke_cgroup(id);
        let _ = node.cg.kill_and_remove(&cg, MPS_WAIT);
        let _ = std::fs::remove_dir_all(user_dir(node, leaf, uid));
        return Err(MpsStartError::Run {
            program: program.to_path_buf(),
            source: e,
        });
    }
    let _ = node.audit(
        AuditEvent::new(events::MPS_STARTED)
            .job(rec.job_id)
            .uid(uid)
            .devices(devs.iter().map(|(d, _)| d))
            .field("mps_daemon", name)
            .field("restarted", restart)
            .field("pipe_dir", pipe.display().to_string())
            .field("cgroup", crate::host::cgpath::abs(&cg))
            .field("pids", node.cg.procs_recursive(&cg)),
    );
    Ok(())
}

/// What [`release`] did with one daemon.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Released {
    /// The daemon's name ([`daemon_name`]).
    pub leaf: String,
    /// Whether the daemon was stopped (the job was its user's last MPS job
    /// on the GPU).
    pub stopped: bool,
    /// Processes that were in the daemon's cgroup, killed.
    pub killed: Vec<i32>,
}

/// The Epilog's part: removes job `job_id`'s registrations first, under no
/// lock (an unlink each: however long a lock is held elsewhere, this job
/// no longer keeps a daemon granted), ends foreign processes in the
/// daemons' cgroups ([`end_foreign`]), and then, under each daemon's own
/// lock, prunes its stale registrations ([`prune_stale`]) and stops a
/// daemon no job is registered with any more (its grant
/// revoked first, its cgroup killed and removed, its directories removed).
/// A daemon whose lock cannot be had within [`MPS_WAIT`] and that no job is
/// registered with is stopped all the same (fail closed; `locked: false`
/// in its `mps_stopped` line). Returns what was done with each daemon, and
/// what failed (each daemon's name and why), after trying every one: a grant that could not
/// be revoked or a daemon cgroup that could not be emptied (the
/// node is unclean: the Epilog drains it).
pub fn release(
    node: &Node,
    fence: Option<&Fence>,
    job_id: u32,
) -> (Vec<Released>, Vec<(String, MpsStopError)>) {
    let mut done = Vec::new();
    let mut errors = Vec::new();
    let mine: Vec<String> = registry_daemons(node)
        .into_iter()
        .filter(|name| {
            let p = node.state.mps_registration_path(name, job_id);
            p.exists() && std::fs::remove_file(&p).is_ok()
        })
        .collect();
    if mine.is_empty() {
        return (done, errors);
    }
    end_foreign(node, Some(job_id), "epilog");
    for name in mine {
        let not_stopped = |name: String| Released {
            leaf: name,
            stopped: false,
            killed: Vec::new(),
        };
        if !registered(node, &name).is_empty() {
            done.push(not_stopped(name));
            continue;
        }
        // Without the lock (held past MPS_WAIT by a Prolog or Epilog of the
        // same daemon) the daemon is stopped all the same when no job is
        // registered with it: fail closed, no grant outlives its jobs.
        let (_lock, locked) = match lock(node, &name) {
            Ok(l) => (Some(l), true),
            Err(_) => (None, false),
        };
        prune_stale(node, &name, None, "epilog");
        if !registered(node, &name).is_empty() {
            done.push(not_stopped(name));
            continue;
        }
        let _ = std::fs::remove_dir(node.state.mps_daemon_dir(&name));
        match stop_one(node, fence, &name) {
            Ok(killed) => {
                let mut ev = AuditEvent::new(events::MPS_STOPPED)
                    .job(job_id)
                    .field("mps_daemon", name.clone())
                    .field("locked", locked)
                    .field("killed", killed.clone());
                if let Some((_, uid)) = parse_daemon(&name) {
                    ev = ev.uid(uid);
                }
                let _ = node.audit(ev);
                done.push(Released {
                    leaf: name,
                    stopped: true,
                    killed,
                });
            }
            Err(e) => errors.push((name, e)),
        }
    }
    (done, errors)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_user_may_traverse_and_root_owns_the_way() {
        // The way: <mps_dir>, <leaf> 0755; u<uid> 0700 (+ ACL); pipe, log.
        assert_eq!(DIR_MODES, [0o755, 0o755, 0o700, 0o700, 0o700]);
        assert!(
            DIR_MODES.iter().all(|m| m & 0o022 == 0),
            "the owner alone writes"
        );
        assert!(
            DIR_MODES[3..].iter().all(|m| m & 0o077 == 0),
            "the user's own"
        );
        assert_eq!(DIR_MODES[2] & 0o077, 0, "no one but root by mode");
        let acl = traverse_acl(1234);
        assert_eq!(acl.len(), 4 + 5 * 8);
        assert_eq!(&acl[..4], &2u32.to_le_bytes());
        let entries: Vec<(u16, u16, u32)> = acl[4..]
            .chunks(8)
            .map(|c| {
                (
                    u16::from_le_bytes([c[0], c[1]]),
                    u16::from_le_bytes([c[2], c[3]]),
                    u32::from_le_bytes([c[4], c[5], c[6], c[7]]),
                )
            })
            .collect();
        assert_eq!(
            entries,
            [
                (0x01, 7, u32::MAX),
                (0x02, 5, 1234),
                (0x04, 0, u32::MAX),
                (0x10, 5, u32::MAX),
                (0x20, 0, u32::MAX),
            ]
        );
    }

    #[test]
    fn the_acl_lets_the_user_alone_through() {
        // On this machine's file system (tempdir), as far as it has ACLs.
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("u1234");
        std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), 0o700)
            .create(&d)
            .unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        match set_traverse_acl(&d, 1234) {
            Ok(()) => {
                let m = std::fs::symlink_metadata(&d).unwrap();
                // The group bits show the mask (r-x), the other bits none.
                assert_eq!(m.mode() & 0o777, 0o750, "{:o}", m.mode());
            }
            Err(e) => assert!(e.to_string().contains("POSIX ACL"), "{e}"),
        }
        let link = t.path().join("link");
        std::os::unix::fs::symlink(&d, &link).unwrap();
        assert!(!root_only_dir(&std::fs::symlink_metadata(&link).unwrap()));
    }
}
