//! IMEX channels under the fence: Slurm's `switch/nvidia_imex` and the
//! driver's shared `channel0`.
//!
//! Slurm (24.05+, `src/plugins/switch/nvidia_imex/`) gives every job an
//! IMEX channel, CPU-only jobs included (slurmctld reserves channel 0 and
//! hands out the lowest free one from 1, `switch_nvidia_imex.c`). No
//! Prolog variable or SPANK item carries it. Each step's slurmstepd, as
//! root in `<job>/step_<id>/slurm`, *after* `spank_init` (where gpufence
//! grants), enters a new mount namespace, mounts a tmpfs over
//! `/dev/nvidia-caps-imex-channels` and `mknod`s `channel<N>` with the
//! `nvidia-caps-imex-channels` major (or `SwitchParameters=imex_dev_major`)
//! (`imex_device.c` `setup_imex_channel`, `slurmstepd/mgr.c`); with a
//! namespace plugin the extern step makes it in the job's namespace. The
//! device cgroup checks that `mknod` as it checks an open.
//!
//! So gpufence grants in two halves:
//! 1. at the step's grant ([`grant_mknod`], from the plugin's
//!    `slurm_spank_init`): `mknod` of every minor of the IMEX major
//!    (`major:*`, [`DevNum::any_minor`]) to the job cgroup. Creating a
//!    node opens nothing, and only root (`CAP_MKNOD` in the initial user
//!    namespace, `vfs_mknod`, `fs/namei.c`) can create one: slurmstepd;
//! 2. before each task runs ([`grant_channel`], from
//!    `slurm_spank_task_init_privileged`, root, in slurmstepd's mount
//!    namespace): read and write of exactly the channel Slurm made in the
//!    step's own tmpfs, the one trusted source of the channel's number.
//!    The directory must be a mount of its own (the tmpfs slurmstepd
//!    mounted, not the node's `/dev` directory, which slurmd empties at
//!    start and anyone with root could fill), and the node a character
//!    device of root's with the IMEX major whose minor is its name's.
//!
//! No other job's channel opens: its node is in that job's mount namespace
//! and its number is not granted here. `channel0`, the driver's shared
//! channel (`NVreg_CreateImexChannel0=1`), is never taken from a step's
//! directory: [`gpufence_model::config::Config::imex_channel0`] grants it to GPU jobs through their
//! record.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use gpufence_cgroup::fence::Fence;
use gpufence_model::audit::{events, AuditEvent};
use gpufence_model::device::{Access, DevNum, DeviceGrant, DeviceRole};

use crate::host::slurmconf::SlurmConf;
use crate::job::grant::{step_name, StepRequest};
use crate::{Node, NodeError};

/// The directory of the channel nodes under `dev_dir`, and the driver's
/// name of their major in `/proc/devices` (`nv-caps-imex.c`).
pub const CHANNEL_DIR: &str = "nvidia-caps-imex-channels";

/// Where Slurm's switch plugin makes each step's channel node, whatever
/// `dev_dir` says (a fixed path in `imex_device.c`; its error names it:
/// `setup_imex_channel: failed to create /dev/nvidia-caps-imex-channels/channel1`).
pub const SLURM_CHANNEL_DIR: &str = "/dev/nvidia-caps-imex-channels";

/// The job id under which Slurm's scope cgroups are granted `mknod` of
/// the IMEX major ([`grant_scope_mknod`]): no Slurm job has it (job ids
/// stay below `MAX_JOB_ID`, 0x03FFFFFF, `slurm.h`), and no Epilog revokes
/// it.
pub const SCOPE_GRANT_JOB_ID: u32 = 0xFFFF_FE00;

/// At most this many entries of the channel directory are looked at: a
/// step's tmpfs holds its one channel (one per segment at most).
pub const MAX_ENTRIES: usize = 64;

/// The IMEX major this node's jobs get channels of, when slurm.conf has
/// `SwitchType=switch/nvidia_imex`: `SwitchParameters`' `imex_dev_major`,
/// else the protected major the driver names `nvidia-caps-imex-channels`.
/// `None` without the switch plugin, or when the major is not one the
/// fence protects (then nothing is granted: the fence does not guard it).
pub fn switch_major(node: &Node, slurm: &SlurmConf) -> Option<u32> {
    let imex = slurm.imex_switch()?;
    let protected = node.protected_majors().ok()?;
    let major = imex.dev_major.or_else(|| protected.major_of(CHANNEL_DIR))?;
    protected.contains(major).then_some(major)
}

/// The IMEX major for `channel0`: the protected major the driver names
/// `nvidia-caps-imex-channels`, else slurm.conf's `imex_dev_major`.
pub fn channel_major(node: &Node, slurm: Option<&SlurmConf>) -> Option<u32> {
    let protected = node.protected_majors().ok()?;
    protected.major_of(CHANNEL_DIR).or_else(|| {
        slurm
            .and_then(SlurmConf::imex_switch)
            .and_then(|s| s.dev_major)
            .filter(|m| protected.contains(*m))
    })
}

/// The record's grant of `channel0` (read and write) for a GPU job when
/// `imex_channel0` is set and the IMEX major is known ([`channel_major`]).
pub fn channel0_grant(node: &Node, major: u32) -> DeviceGrant {
    DeviceGrant {
        path: node.cfg.dev_dir.join(CHANNEL_DIR).join("channel0"),
        dev: DevNum::new(major, 0),
        access: Access::RW,
        role: DeviceRole::Control,
        gres_index: None,
    }
}

/// Grants `mknod` of every minor of `major` to the job cgroup
/// `job_cgroup` (relative to the mount) for `req`'s job, after its
/// `grant_applied` line (`"imex": "mknod"`): what slurmstepd needs to
/// make the step's channel node. Repeating it is harmless.
///
/// # Errors
/// [`NodeError`]: the fence, the cgroup or the audit log.
pub fn grant_mknod(
    node: &Node,
    req: &StepRequest,
    job_cgroup: &str,
    major: u32,
) -> Result<(), NodeError> {
    let dev = DevNum::any_minor(major);
    grant(node, req, job_cgroup, dev, Access::MKNOD, "mknod")
}

/// Finds the channels Slurm made for this step in [`SLURM_CHANNEL_DIR`]
/// as this process sees it (slurmstepd's mount namespace) and grants each
/// (read and write) to the job cgroup `job_cgroup`, after a
/// `grant_applied` line (`"imex": "channel"`); a channel the cgroup holds
/// already is left as it is. Returns the channels granted now. Nothing
/// when the directory is not a mount of its own ([`channels`]).
///
/// # Errors
/// [`NodeError`]: the fence, the cgroup or the audit log.
pub fn grant_channel(
    node: &Node,
    req: &StepRequest,
    job_cgroup: &str,
    major: u32,
) -> Result<Vec<u32>, NodeError> {
    grant_channels_in(node, req, job_cgroup, major, Path::new(SLURM_CHANNEL_DIR))
}

/// [`grant_channel`] with the channels of `dir` ([`channels`]) instead of
/// Slurm's directory.
///
/// # Errors
/// As [`grant_channel`].
pub fn grant_channels_in(
    node: &Node,
    req: &StepRequest,
    job_cgroup: &str,
    major: u32,
    dir: &Path,
) -> Result<Vec<u32>, NodeError> {
    let fence = Fence::open(&node.cfg.bpffs_dir)?;
    let id = node.cg.id(job_cgroup)?;
    let mut granted = Vec::new();
    for minor in channels(dir, major) {
        let dev = DevNum::new(major, minor);
        if fence
            .lookup(id, dev)?
            .is_some_and(|g| g.access().contains(Access::RW))
        {
            continue;
        }
        grant(node, req, job_cgroup, dev, Access::RW, "channel")?;
        granted.push(minor);
    }
    Ok(granted)
}

fn grant(
    node: &Node,
    req: &StepRequest,
    job_cgroup: &str,
    dev: DevNum,
    access: Access,
    what: &str,
) -> Result<(), NodeError> {
    let fence = Fence::open(&node.cfg.bpffs_dir)?;
    let id = node.cg.id(job_cgroup)?;
    let level = node.cg.kernel_level(job_cgroup)?;
    let path: PathBuf = if dev.is_any_minor() {
        Path::new(SLURM_CHANNEL_DIR).join("*")
    } else {
        Path::new(SLURM_CHANNEL_DIR).join(format!("channel{}", dev.minor))
    };
    // Recorded before it takes effect, as every grant.
    node.audit(
        AuditEvent::new(events::GRANT_APPLIED)
            .job(req.job_id)
            .uid(req.uid)
            .pid(std::process::id() as i32)
            .devices(&[DeviceGrant {
                path,
                dev,
                access,
                role: DeviceRole::Control,
                gres_index: None,
            }])
            .field("cgroup", crate::host::cgpath::abs(job_cgroup))
            .field("cgroup_id", id)
            .field("cgroup_level", level)
            .field("step", step_name(req.step_id))
            .field("imex", what),
    )?;
    fence.grant_in(&node.cg, id, job_cgroup, req.job_id, &[(dev, access)])?;
    Ok(())
}

/// Slurm's scope cgroups under the fenced subtree, relative to the mount:
/// `system.slice/slurmstepd.scope`, or `system.slice/<node>_slurmstepd.scope`
/// where slurmd is built for several per host, the cgroup every job
/// cgroup of the `slurm` layout is made in (`_get_stepd_scope_path` ...
/// `cgroup_v2.c`), looked for below `cgroup_root` and below
/// `<cgroup_root>/system.slice`.
pub fn scopes(node: &Node) -> Vec<String> {
    let root = node.cfg.cgroup_root.clone();
    let mut out = Vec::new();
    for parent in [crate::join_cgroup(&root, "system.slice"), root.clone()] {
        let Ok(rd) = std::fs::read_dir(node.cg.path(&parent)) else {
            continue;
        };
        for e in rd.take(4096).flatten() {
            let Ok(name) = e.file_name().into_string() else {
                continue;
            };
            if (name == "slurmstepd.scope" || name.ends_with("_slurmstepd.scope"))
                && e.file_type().is_ok_and(|t| t.is_dir())
            {
                let p = crate::join_cgroup(&parent, &name);
                if !out.contains(&p) {
                    out.push(p);
                }
            }
        }
    }
    out
}

/// Grants `mknod` of every minor of `major` to each of Slurm's scope
/// cgroups ([`scopes`]) that does not hold it yet, under
/// [`SCOPE_GRANT_JOB_ID`], after a `grant_applied` line each: with a
/// namespace plugin (`job_container/tmpfs`, `namespace/*`) the extern
/// step makes the job's channel node while it creates the job's
/// namespace, before its `slurm_spank_init` (`_spawn_job_container`,
/// `slurmstepd/mgr.c`), so the job cgroup's own grant ([`grant_mknod`])
/// comes too late; the scope holds only slurmstepd and the jobs. Called
/// by the Prolog (before the extern step starts) and at slurmd start.
/// Returns the scopes granted now.
///
/// # Errors
/// [`NodeError`]: the fence, a cgroup or the audit log.
pub fn grant_scope_mknod(node: &Node, major: u32) -> Result<Vec<String>, NodeError> {
    let fence = Fence::open(&node.cfg.bpffs_dir)?;
    let dev = DevNum::any_minor(major);
    let mut granted = Vec::new();
    for scope in scopes(node) {
        let id = node.cg.id(&scope)?;
        if fence
            .lookup(id, dev)?
            .is_some_and(|g| g.access().contains(Access::MKNOD))
        {
            continue;
        }
        let req = StepRequest {
            job_id: SCOPE_GRANT_JOB_ID,
            step_id: 0,
            uid: 0,
            stepd_pid: std::process::id() as i32,
        };
        grant(node, &req, &scope, dev, Access::MKNOD, "mknod")?;
        granted.push(scope);
    }
    Ok(granted)
}

/// The channel numbers (minors, 1 and up) of the nodes in `dir`, when
/// `dir` is a mount of its own (its device differs from its parent's: the
/// tmpfs Slurm's switch plugin mounted in the step's namespace): entries
/// named `channel<N>` that are character devices of `major` with minor
/// `N`, owned by root, not links (never followed). At most
/// [`MAX_ENTRIES`] entries are read. Empty when `dir` is missing, is the
/// node's own directory, or cannot be read.
pub fn channels(dir: &Path, major: u32) -> Vec<u32> {
    let (Ok(d), Some(Ok(p))) = (
        std::fs::symlink_metadata(dir),
        dir.parent().map(std::fs::symlink_metadata),
    ) else {
        return Vec::new();
    };
    if !d.is_dir() || d.dev() == p.dev() {
        return Vec::new();
    }
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<u32> = rd
        .take(MAX_ENTRIES)
        .flatten()
        .filter_map(|e| {
            let n: u32 = e
                .file_name()
                .to_str()?
                .strip_prefix("channel")?
                .parse()
                .ok()?;
            let m = std::fs::symlink_metadata(e.path()).ok()?;
            let dev = DevNum::from_rdev(m.rdev());
            (n >= 1
                && m.file_type().is_char_device()
                && m.uid() == 0
                && dev == DevNum::new(major, n))
            .then_some(n)
        })
        .collect();
    out.sort_unstable();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nodes_own_directory_holds_no_trusted_channel() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join(CHANNEL_DIR);
        std::fs::create_dir(&dir).unwrap();
        // A plain directory (same device as its parent): nothing, even
        // with entries named like channels.
        std::fs::write(dir.join("channel1"), "").unwrap();
        assert!(channels(&dir, 120).is_empty());
        assert!(channels(&t.path().join("missing"), 120).is_empty());
    }
}
