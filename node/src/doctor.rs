//! `gpufence doctor`: for a process or a cgroup, every device program that
//! applies to it up the cgroup tree (ours, Slurm's, systemd's, container
//! runtimes'), with attach flags and owners as far as they can be told;
//! whether the fence is attached and current; and, for each NVIDIA device,
//! which grant or exemption lets it open it, or why it would be denied.
//!
//! The verdict is the fence program's own: the program this version
//! installs, run over the live maps ([`Fence::evaluate`]) for a task whose
//! ancestors are the target's at their kernel levels
//! ([`gpufence_cgroup::Cgroup2::kernel_ancestry`]). In a cgroup namespace
//! those levels are not the path's depth; an entry recorded at another
//! level than its cgroup's is one the program does not find, and doctor
//! says so rather than matching cgroup ids.

use std::collections::BTreeMap;
use std::os::fd::AsFd;
use std::path::PathBuf;

use serde::Serialize;

use gpufence_cgroup::fence::Fence;
use gpufence_cgroup::hierarchy::Ancestor;
use gpufence_cgroup::sys;
use gpufence_cgroup::verdict::{Evaluation, Reason, Task};
use gpufence_model::config::Mode;
use gpufence_model::device::{Access, DevNum};

use crate::inventory::char_devices;
use crate::{Node, NodeError};

/// One program attached at one cgroup.
#[derive(Clone, Debug, Serialize)]
pub struct AttachedProgram {
    /// Kernel program id.
    pub id: u32,
    /// Its name (up to 15 characters, as loaded).
    pub name: String,
    /// Its tag (hex).
    pub tag: String,
    /// uid that loaded it.
    pub loaded_by_uid: u32,
    /// Who it probably belongs to.
    pub owner: String,
    /// Whether it runs for the target (the kernel's effective list).
    pub effective: bool,
}

/// The device programs attached at one cgroup on the path.
#[derive(Clone, Debug, Serialize)]
pub struct Level {
    /// The cgroup, relative to the mount (`""` = root). JSON: absolute.
    #[serde(serialize_with = "crate::cgpath::serialize")]
    pub cgroup: String,
    /// `multi`, `override` or `none` (`BPF_F_ALLOW_*` of the attachment).
    pub attach_flags: String,
    /// Its programs.
    pub programs: Vec<AttachedProgram>,
}

/// The fence's answer for one device.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceVerdict {
    /// The device node(s) found, or the conventional name.
    pub path: String,
    /// `major:minor`.
    pub device: String,
    /// `allowed` or `denied` (by gpufence; other programs may still deny),
    /// or `unknown` when the target's kernel levels cannot be told.
    pub verdict: String,
    /// Why: the grant (job, cgroup) or exemption, or what is missing.
    pub why: String,
}

/// The whole diagnosis.
#[derive(Clone, Debug, Serialize)]
pub struct Doctor {
    /// The process, when a pid was asked about.
    pub pid: Option<i32>,
    /// The real uid the verdicts are for: the process's, or with
    /// `--cgroup` (no pid) doctor's own (an exemption covers only uids up
    /// to `protected_uid_max` and `service_uids`).
    pub uid: u32,
    /// Its cgroup (relative to the mount). JSON: absolute.
    #[serde(serialize_with = "crate::cgpath::serialize")]
    pub cgroup: String,
    /// Whether the fence is attached at `cgroup_root`.
    pub fence_attached: bool,
    /// Why not, or what is wrong.
    pub fence_problem: Option<String>,
    /// Whether the attached program is the one this version and config would
    /// install (`None` when it cannot be told).
    pub fence_current: Option<bool>,
    /// The configured mode.
    pub mode: String,
    /// The mode of the program actually attached.
    pub running_mode: crate::fence_ops::RunningMode,
    /// Whether the target is under the fenced subtree at all.
    pub under_fence: bool,
    /// The target cgroup's level as the kernel counts it (what the fence
    /// program walks by), when it can be told.
    pub kernel_level: Option<usize>,
    /// The kernel level of the cgroup2 mount's root: 0, or in a cgroup
    /// namespace how many levels above the paths shown here the
    /// hierarchy's root is.
    pub mount_root_level: Option<usize>,
    /// Programs attached from the cgroup2 root down to the target's cgroup.
    pub levels: Vec<Level>,
    /// Per NVIDIA device.
    pub devices: Vec<DeviceVerdict>,
    /// Whether users may create io_uring rings, which can hold a GPU file
    /// where no scan sees it ([`crate::scan::io_uring_exposure`]); `None`
    /// when io_uring is closed to them.
    pub io_uring: Option<String>,
}

fn flags_name(f: u32) -> &'static str {
    if f & sys::F_ALLOW_MULTI != 0 {
        "multi"
    } else if f & sys::F_ALLOW_OVERRIDE != 0 {
        "override"
    } else {
        "none"
    }
}

fn owner_guess(id: u32, name: &str, at: &str, ours: Option<u32>) -> String {
    if Some(id) == ours {
        return "gpufence (this node's fence)".into();
    }
    if name == "gpufence" {
        return "gpufence (a program not held by the pinned link: another install?)".into();
    }
    if name.starts_with("sd_") {
        return "systemd (DeviceAllow=)".into();
    }
    if at.contains("docker")
        || at.contains("containerd")
        || at.contains("libpod")
        || at.contains("crio")
    {
        return "container runtime".into();
    }
    if at
        .split('/')
        .any(|p| p.starts_with("job_") || p.starts_with("step_"))
    {
        return "Slurm (ConstrainDevices) or another tool on a job cgroup".into();
    }
    "unknown".into()
}

/// Diagnoses process `pid`, or cgroup `cgroup` (relative to the mount).
///
/// # Errors
/// [`NodeError`] when the process or cgroup does not exist.
pub fn doctor(node: &Node, pid: Option<i32>, cgroup: Option<&str>) -> Result<Doctor, NodeError> {
    let cg = match (pid, cgroup) {
        (Some(p), _) => node.cg.cgroup_of(p)?,
        (None, Some(c)) => {
            let c =
                gpufence_model::config::normalize_cgroup_path(c).map_err(NodeError::JobCgroup)?;
            node.cg.id(&c)?;
            c
        }
        (None, None) => node.cg.cgroup_of(std::process::id() as i32)?,
    };
    let attached = Fence::check_attached(&node.cg, &node.cfg.cgroup_root, &node.cfg.bpffs_dir);
    let fence = Fence::open(&node.cfg.bpffs_dir).ok();
    let ours = Fence::linked_prog_id(&node.cfg.bpffs_dir);
    let audit = node.cfg.mode == Mode::Audit;
    let fence_current = match (&fence, ours) {
        (Some(f), Some(id)) => match (
            f.fresh_program_tag(audit, &node.cfg.exempt_identities()),
            sys::prog_fd_by_id(id).and_then(|fd| sys::prog_info(fd.as_fd())),
        ) {
            (Ok(fresh), Ok(info)) => Some(fresh == info.tag),
            _ => None,
        },
        _ => None,
    };

    // Effective programs of the target, then what is attached at each level.
    let target_dir = node.cg.path(&cg);
    let effective: Vec<u32> = std::fs::File::open(&target_dir)
        .ok()
        .and_then(|f| sys::prog_query_cgroup_device_flags(f.as_fd(), sys::F_QUERY_EFFECTIVE).ok())
        .map(|(_, ids)| ids)
        .unwrap_or_default();
    let mut path = vec![String::new()];
    let mut cur = String::new();
    for part in cg.split('/').filter(|s| !s.is_empty()) {
        if !cur.is_empty() {
            cur.push('/');
        }
        cur.push_str(part);
        path.push(cur.clone());
    }
    let mut levels = Vec::new();
    for at in &path {
        let Ok(f) = std::fs::File::open(node.cg.path(at)) else {
            continue;
        };
        let Ok((flags, ids)) = sys::prog_query_cgroup_device(f.as_fd()) else {
            continue;
        };
        if ids.is_empty() {
            continue;
        }
        let programs = ids
            .iter()
            .map(|id| {
                let info = sys::prog_fd_by_id(*id)
                    .and_then(|fd| sys::prog_info(fd.as_fd()))
                    .ok();
                let name = info
                    .as_ref()
                    .map(|i| sys::name_str(&i.name))
                    .unwrap_or_default();
                AttachedProgram {
                    id: *id,
                    tag: info
                        .as_ref()
                        .map(|i| i.tag.iter().map(|b| format!("{b:02x}")).collect())
                        .unwrap_or_default(),
                    loaded_by_uid: info.as_ref().map(|i| i.created_by_uid).unwrap_or(0),
                    owner: owner_guess(*id, &name, at, ours),
                    name,
                    effective: effective.contains(id),
                }
            })
            .collect();
        levels.push(Level {
            cgroup: at.clone(),
            attach_flags: flags_name(flags).into(),
            programs,
        });
    }

    // Per device: the fence's verdict for read+write.
    let under_fence = crate::is_under(&cg, &node.cfg.cgroup_root);
    let protected = node.protected_majors().unwrap_or_default();
    let mut devs: BTreeMap<DevNum, Vec<PathBuf>> = char_devices(&node.cfg.dev_dir)
        .into_iter()
        .filter(|(d, _)| protected.contains(d.major))
        .collect();
    let (control, _) = protected.control_devices();
    for (name, d) in control {
        devs.entry(d)
            .or_insert_with(|| vec![node.cfg.dev_dir.join(name)]);
    }
    let me = std::process::id() as i32;
    let uid = crate::respond::uid_of(pid.unwrap_or(me))
        .ok_or_else(|| NodeError::JobCgroup(format!("process {} is gone", pid.unwrap_or(me))))?;
    let identities = node.cfg.exempt_identities();
    let kernel = node.cg.kernel_ancestry(&cg);
    let ids: Vec<u64> = kernel
        .as_ref()
        .map(|a| a.iter().map(|x| x.id).collect())
        .unwrap_or_default();
    let entries = fence
        .as_ref()
        .and_then(|f| f.entries().ok())
        .unwrap_or_default();
    let audit_note = if audit {
        " (audit mode: recorded, allowed)"
    } else {
        ""
    };
    let mut devices = Vec::new();
    for (d, paths) in devs {
        let path = paths
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        let (verdict, why) = if !under_fence {
            (
                "allowed",
                format!(
                    "/{cg} is outside the fenced subtree /{}",
                    node.cfg.cgroup_root
                ),
            )
        } else if attached.is_err() {
            ("allowed", "the fence is not attached".to_string())
        } else {
            match (&kernel, &fence) {
                (Err(e), _) => (
                    "unknown",
                    format!("the kernel levels of /{cg} cannot be told: {e}"),
                ),
                (Ok(_), None) => ("unknown", "the fence's maps cannot be opened".to_string()),
                (Ok(anc), Some(f)) => match f.evaluate(
                    Task {
                        ancestry: &ids,
                        uid,
                    },
                    &identities,
                    d,
                    Access::RW,
                ) {
                    Err(e) => ("unknown", format!("the fence's maps cannot be read: {e}")),
                    Ok(ev) => explain(&ev, anc, &cg, d, &entries, audit, audit_note),
                },
            }
        };
        devices.push(DeviceVerdict {
            path,
            device: d.to_string(),
            verdict: verdict.into(),
            why,
        });
    }
    Ok(Doctor {
        pid,
        uid,
        cgroup: cg,
        fence_attached: attached.is_ok(),
        fence_problem: attached.err(),
        fence_current,
        running_mode: crate::fence_ops::running_mode(node),
        mode: if audit {
            "audit".into()
        } else {
            "enforce".into()
        },
        under_fence,
        kernel_level: kernel.as_ref().ok().and_then(|a| a.last()).map(|a| a.level),
        mount_root_level: node.cg.root_level().ok(),
        levels,
        devices,
        io_uring: crate::scan::io_uring_exposure(std::path::Path::new("/proc/sys")),
    })
}

/// A cgroup of the target's ancestry in words: its path, or its id and
/// level where this cgroup namespace does not show it.
fn name_of(anc: &[Ancestor], level: usize, id: u64) -> String {
    match anc.get(level).and_then(|a| a.path.as_deref()) {
        Some(p) => format!("/{p}"),
        None => format!("cgroup id {id} (level {level}, above this cgroup namespace's root)"),
    }
}

/// The verdict and its reason in words, from the program's evaluation.
fn explain(
    ev: &Evaluation,
    anc: &[Ancestor],
    cg: &str,
    d: DevNum,
    entries: &[gpufence_cgroup::fence::GrantEntry],
    audit: bool,
    audit_note: &str,
) -> (&'static str, String) {
    let misrecorded: Vec<String> = ev
        .misrecorded
        .iter()
        .map(|m| {
            format!(
                "{} is at kernel level {} but its entry says level {}: the fence program does not find it",
                name_of(anc, m.level, m.cgroup_id),
                m.level,
                m.recorded
            )
        })
        .collect();
    let tail = if misrecorded.is_empty() {
        String::new()
    } else {
        format!("; {}", misrecorded.join("; "))
    };
    if ev.allowed {
        let why = match &ev.reason {
            Reason::NotProtected => "not a protected major".to_string(),
            Reason::Exempt { level, cgroup_id } => {
                format!("exempt: {}", name_of(anc, *level, *cgroup_id))
            }
            Reason::Granted {
                level,
                cgroup_id,
                job_id,
            } => format!(
                "grant of job {job_id} on {}",
                name_of(anc, *level, *cgroup_id)
            ),
            _ => "allowed by the fence program (the maps changed while read)".to_string(),
        };
        return ("allowed", format!("{why}{tail}"));
    }
    let verdict = if audit { "allowed" } else { "denied" };
    let on_path: Vec<u64> = anc.iter().map(|a| a.id).collect();
    let other_jobs: Vec<u32> = entries
        .iter()
        .filter(|e| e.dev == d && !on_path.contains(&e.cgroup_id))
        .map(|e| e.job_id)
        .collect();
    let why = match &ev.reason {
        Reason::NoLevels => "the fence's levels mask is missing: the program denies".to_string(),
        Reason::Changed => "denied by the fence program (the maps changed while read)".to_string(),
        _ if other_jobs.is_empty() => {
            format!("no grant on /{cg} or its ancestors that the fence program finds, not exempt")
        }
        _ => format!("granted to job(s) {other_jobs:?} elsewhere, not to /{cg} or its ancestors"),
    };
    (verdict, format!("{why}{tail}{audit_note}"))
}
