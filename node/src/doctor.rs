//! `gpufence doctor`: for a process or a cgroup, every device program that
//! applies to it up the cgroup tree (ours, Slurm's, systemd's, container
//! runtimes'), with attach flags and owners as far as they can be told;
//! whether the fence is attached and current; and, for each NVIDIA device,
//! which grant or exemption lets it open it, or why it would be denied.

use std::collections::BTreeMap;
use std::os::fd::AsFd;
use std::path::PathBuf;

use serde::Serialize;

use gpufence_cgroup::fence::Fence;
use gpufence_cgroup::sys;
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
    /// `allowed` or `denied` (by gpufence; other programs may still deny).
    pub verdict: String,
    /// Why: the grant (job, cgroup) or exemption, or what is missing.
    pub why: String,
}

/// The whole diagnosis.
#[derive(Clone, Debug, Serialize)]
pub struct Doctor {
    /// The process, when a pid was asked about.
    pub pid: Option<i32>,
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
    /// Programs attached from the cgroup2 root down to the target's cgroup.
    pub levels: Vec<Level>,
    /// Per NVIDIA device.
    pub devices: Vec<DeviceVerdict>,
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
            f.fresh_program_tag(audit),
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
    let ancestry = node.cg.ancestry(&cg);
    let entries = fence
        .as_ref()
        .and_then(|f| f.entries().ok())
        .unwrap_or_default();
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
        } else if let Some((p, _)) = ancestry.iter().find(|(_, id)| {
            fence
                .as_ref()
                .is_some_and(|f| f.is_exempt(*id).unwrap_or(false))
        }) {
            ("allowed", format!("exempt: /{p}"))
        } else if let Some((p, e)) = ancestry.iter().find_map(|(p, id)| {
            entries
                .iter()
                .find(|e| e.cgroup_id == *id && e.dev == d && e.access.contains(Access::RW))
                .map(|e| (p.clone(), e))
        }) {
            ("allowed", format!("grant of job {} on /{p}", e.job_id))
        } else {
            let other_jobs: Vec<u32> = entries
                .iter()
                .filter(|e| e.dev == d)
                .map(|e| e.job_id)
                .collect();
            (
                if audit { "allowed" } else { "denied" },
                if other_jobs.is_empty() {
                    format!(
                        "no grant on /{cg} or its ancestors, not exempt{}",
                        if audit {
                            " (audit mode: recorded, allowed)"
                        } else {
                            ""
                        }
                    )
                } else {
                    format!("granted to job(s) {other_jobs:?} elsewhere, not to /{cg} or its ancestors{}", if audit { " (audit mode: recorded, allowed)" } else { "" })
                },
            )
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
        levels,
        devices,
    })
}
