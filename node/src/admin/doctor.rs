//! `gpufence doctor`: for a process or a cgroup, every device program that
//! applies to it up the cgroup tree (ours, Slurm's, systemd's, container
//! runtimes'), with attach flags and owners as far as they can be told;
//! whether the fence is attached and current; and, for each NVIDIA device,
//! which grant or exemption lets it open it, or why it would be denied.
//!
//! The verdict is that of every device program the kernel runs for the
//! target (the effective programs of its cgroup), since one that returns
//! 0 denies the open whatever the others say (`bpf_prog_run_array_cg`,
//! `kernel/bpf/cgroup.c`). Other tools' programs are read back from the
//! kernel and run in the interpreter ([`gpufence_cgroup::foreign`]); one
//! that calls the kernel or reads a map is said to *may deny*. The fence's
//! own is the program this version installs, run over the live maps
//! ([`Fence::evaluate`]) for a task whose
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
use gpufence_cgroup::foreign::{self, Answer};
use gpufence_cgroup::hierarchy::Ancestor;
use gpufence_cgroup::sys;
use gpufence_cgroup::verdict::{Evaluation, Reason, Task};
use gpufence_model::config::Mode;
use gpufence_model::device::{Access, DevNum};

use crate::host::cgpath::abs;
use crate::host::inventory::char_devices;
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
    /// Who it belongs to, where that is known: the fence's (the program
    /// of its pinned link), Slurm's (by name and instruction shape,
    /// [`gpufence_cgroup::foreign::slurm_shaped`]); else `unknown`.
    pub owner: String,
    /// Whether it runs for the target (the kernel's effective list).
    pub effective: bool,
}

/// The device programs attached at one cgroup on the path.
#[derive(Clone, Debug, Serialize)]
pub struct Level {
    /// The cgroup, relative to the mount (`""` = root). JSON: absolute.
    #[serde(serialize_with = "crate::host::cgpath::serialize")]
    pub cgroup: String,
    /// `multi`, `override` or `none` (`BPF_F_ALLOW_*` of the attachment).
    pub attach_flags: String,
    /// Its programs.
    pub programs: Vec<AttachedProgram>,
}

/// What one effective program answers for one device.
#[derive(Clone, Debug, Serialize)]
pub struct ProgramVerdict {
    /// Kernel program id.
    pub id: u32,
    /// Its name.
    pub name: String,
    /// Its owner, as [`AttachedProgram::owner`].
    pub owner: String,
    /// Where it is attached (relative to the mount; `None` when above what
    /// this cgroup namespace shows). JSON: absolute.
    pub attached_at: Option<String>,
    /// `allows`, `denies` or `may deny`.
    pub answer: String,
    /// Why, for the fence (the grant, the exemption, what is missing) and
    /// for a program that may deny; empty otherwise.
    pub why: String,
}

/// The answer for one device: every effective program's, combined as the
/// kernel combines them.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceVerdict {
    /// The device node(s) found, or the conventional name.
    pub path: String,
    /// `major:minor`.
    pub device: String,
    /// `allowed` (every program allows), `denied` (one denies: named in
    /// `why`), `may be denied` (none denies, one cannot be evaluated), or
    /// `unknown` when the target's kernel levels cannot be told.
    pub verdict: String,
    /// Why: the program that denies, the grant (job, cgroup) or exemption,
    /// or what is missing.
    pub why: String,
    /// Each effective program's answer, in the kernel's order.
    pub programs: Vec<ProgramVerdict>,
}

/// The whole diagnosis.
#[derive(Clone, Debug, Serialize)]
pub struct Doctor {
    /// The process, when a pid was asked about.
    pub pid: Option<i32>,
    /// The real uid the verdicts are for: the process's, or with
    /// `--cgroup` (no pid) doctor's own (an exemption covers only the
    /// users of its `exempt_cgroups` entry: a bare entry root alone).
    pub uid: u32,
    /// Its cgroup (relative to the mount). JSON: absolute.
    #[serde(serialize_with = "crate::host::cgpath::serialize")]
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
    pub running_mode: crate::host::fence_ops::RunningMode,
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
    /// where no scan sees it ([`crate::holders::scan::io_uring_exposure`]); `None`
    /// when io_uring is closed to them.
    pub io_uring: Option<String>,
    /// Warnings about the uids taken for system accounts
    /// ([`crate::host::accounts::range_warnings`]).
    pub warnings: Vec<String>,
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

/// The owner of program `id` named `name` with instructions `insns`, only
/// where known: the program of the fence's pinned link, or Slurm's
/// cgroup/v2 program by its name and shape together.
fn owner_of(
    id: u32,
    name: &str,
    insns: &[gpufence_cgroup::asm::RawInsn],
    ours: Option<u32>,
) -> String {
    if Some(id) == ours {
        return "gpufence (this node's fence: the program of its pinned link)".into();
    }
    if name == foreign::SLURM_PROG_NAME && foreign::slurm_shaped(insns) {
        return "Slurm cgroup/v2 ConstrainDevices (its name and instruction shape, src/plugins/cgroup/v2/ebpf.c)"
            .into();
    }
    "unknown".into()
}

/// A program's name and its instructions as the kernel gives them back
/// (empty when they cannot be read).
fn program_of(id: u32) -> (Option<sys::ProgInfo>, Vec<gpufence_cgroup::asm::RawInsn>) {
    match sys::prog_fd_by_id(id) {
        Ok(fd) => (
            sys::prog_info(fd.as_fd()).ok(),
            sys::prog_xlated(fd.as_fd()).unwrap_or_default(),
        ),
        Err(_) => (None, Vec::new()),
    }
}

/// Diagnoses process `pid`, or cgroup `cgroup` (relative to the mount).
///
/// # Errors
/// [`NodeError`] when the process or cgroup does not exist.
pub fn doctor(node: &Node, pid: Option<i32>, cgroup: Option<&str>) -> Result<Doctor, NodeError> {
    let cg = target_cgroup(node, pid, cgroup)?;
    let attached = Fence::check_attached(&node.cg, &node.cfg.cgroup_root, &node.cfg.bpffs_dir);
    let fence = Fence::open(&node.cfg.bpffs_dir).ok();
    let ours = Fence::linked_prog_id(&node.cfg.bpffs_dir);
    let audit = node.cfg.mode == Mode::Audit;
    let fence_current = fence_current(node, fence.as_ref(), ours, audit);
    let (levels, runs) = programs_on_path(node, &cg, ours);
    let me = std::process::id() as i32;
    let uid = crate::host::procs::uid_of(pid.unwrap_or(me)).ok_or(NodeError::ProcessGone {
        pid: pid.unwrap_or(me),
    })?;
    let under_fence = crate::is_under(&cg, &node.cfg.cgroup_root);
    let kernel = node.cg.kernel_ancestry(&cg);
    let target = Target {
        cg: &cg,
        uid,
        under_fence,
        attached: attached.is_ok(),
        kernel: kernel.as_ref().map(|a| a.as_slice()),
        ids: kernel
            .as_ref()
            .map(|a| a.iter().map(|x| x.id).collect())
            .unwrap_or_default(),
        fence: fence.as_ref(),
        entries: fence
            .as_ref()
            .and_then(|f| f.entries().ok())
            .unwrap_or_default(),
        identities: crate::host::fence_ops::exempt_identities(node),
        audit,
    };
    let devices = nvidia_devices(node)
        .into_iter()
        .map(|(d, paths)| {
            let path = paths
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ");
            combine(path, d, &runs, ours, fence_verdict(node, &target, d))
        })
        .collect();
    Ok(Doctor {
        pid,
        uid,
        cgroup: cg.clone(),
        fence_attached: attached.is_ok(),
        fence_problem: attached.err().map(|e| e.to_string()),
        fence_current,
        running_mode: crate::host::fence_ops::running_mode(node),
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
        io_uring: crate::holders::scan::io_uring_exposure(std::path::Path::new("/proc/sys")),
        warnings: crate::host::accounts::host_range_warnings(&node.cfg),
    })
}

/// The cgroup asked about: `pid`'s, `cgroup` (checked to exist), or this
/// process's.
fn target_cgroup(node: &Node, pid: Option<i32>, cgroup: Option<&str>) -> Result<String, NodeError> {
    Ok(match (pid, cgroup) {
        (Some(p), _) => node.cg.cgroup_of(p)?,
        (None, Some(c)) => {
            let c = gpufence_model::config::normalize_cgroup_path(c)?;
            node.cg.id(&c)?;
            c
        }
        (None, None) => node.cg.cgroup_of(std::process::id() as i32)?,
    })
}

/// Whether the attached program (`ours`) is the one this version and
/// config would install; `None` when it cannot be told.
fn fence_current(
    node: &Node,
    fence: Option<&Fence>,
    ours: Option<u32>,
    audit: bool,
) -> Option<bool> {
    let (f, id) = (fence?, ours?);
    match (
        f.fresh_program_tag(audit, &crate::host::fence_ops::exempt_identities(node)),
        sys::prog_fd_by_id(id).and_then(|fd| sys::prog_info(fd.as_fd())),
    ) {
        (Ok(fresh), Ok(info)) => Some(fresh == info.tag),
        _ => None,
    }
}

/// The device programs attached from the cgroup2 root down to `cg`, per
/// level, and the effective ones (what the kernel runs for `cg`) in the
/// kernel's order, those attached above what this namespace shows last.
fn programs_on_path(node: &Node, cg: &str, ours: Option<u32>) -> (Vec<Level>, Vec<Effective>) {
    let effective: Vec<u32> = std::fs::File::open(node.cg.path(cg))
        .ok()
        .and_then(|f| sys::prog_query_cgroup_device_flags(f.as_fd(), sys::F_QUERY_EFFECTIVE).ok())
        .map(|(_, ids)| ids)
        .unwrap_or_default();
    let path: Vec<String> = match gpufence_model::CgroupPath::parse(cg) {
        Ok(p) => p
            .ancestors()
            .into_iter()
            .map(gpufence_model::CgroupPath::into_string)
            .collect(),
        // Not a cgroup path (`..`): only the root can be looked at.
        Err(_) => vec![String::new()],
    };
    let mut levels = Vec::new();
    let mut runs: Vec<Effective> = Vec::new();
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
                let (info, run) = effective_program(*id, Some(at.clone()), ours);
                let attached = AttachedProgram {
                    id: *id,
                    tag: info
                        .as_ref()
                        .map(|i| i.tag.iter().map(|b| format!("{b:02x}")).collect())
                        .unwrap_or_default(),
                    loaded_by_uid: info.as_ref().map(|i| i.created_by_uid).unwrap_or(0),
                    owner: run.owner.clone(),
                    name: run.name.clone(),
                    effective: effective.contains(id),
                };
                if effective.contains(id) {
                    runs.push(run);
                }
                attached
            })
            .collect();
        levels.push(Level {
            cgroup: at.clone(),
            attach_flags: flags_name(flags).into(),
            programs,
        });
    }
    runs.sort_by_key(|r| effective.iter().position(|e| *e == r.id));
    for id in &effective {
        if !runs.iter().any(|r| r.id == *id) {
            runs.push(effective_program(*id, None, ours).1);
        }
    }
    (levels, runs)
}

/// Program `id` read back from the kernel (its info, when it can be
/// read) as an [`Effective`] attached at `at`, its owner named where known.
fn effective_program(
    id: u32,
    at: Option<String>,
    ours: Option<u32>,
) -> (Option<sys::ProgInfo>, Effective) {
    let (info, insns) = program_of(id);
    let name = info
        .as_ref()
        .map(|i| sys::name_str(&i.name))
        .unwrap_or_default();
    let run = Effective {
        id,
        owner: owner_of(id, &name, &insns, ours),
        name,
        attached_at: at,
        insns,
    };
    (info, run)
}

/// Every NVIDIA device node in `dev_dir` on a protected major, and the
/// control devices by their conventional names.
fn nvidia_devices(node: &Node) -> BTreeMap<DevNum, Vec<PathBuf>> {
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
    devs
}

/// What the fence's verdict depends on, for one target.
struct Target<'a> {
    cg: &'a str,
    uid: u32,
    under_fence: bool,
    attached: bool,
    /// Its ancestry at the kernel's levels, or why it cannot be told.
    kernel: Result<&'a [Ancestor], &'a gpufence_cgroup::Error>,
    /// The ids of that ancestry, root first (what the program walks).
    ids: Vec<u64>,
    fence: Option<&'a Fence>,
    /// The fence's grant entries, read once for every device.
    entries: Vec<gpufence_cgroup::fence::GrantEntry>,
    identities: gpufence_model::policy::ExemptIdentities,
    audit: bool,
}

/// The fence program's verdict for read+write of `d` and why.
fn fence_verdict(node: &Node, t: &Target<'_>, d: DevNum) -> (&'static str, String) {
    if !t.under_fence {
        return (
            "allowed",
            format!(
                "{} is outside the fenced subtree {}",
                abs(t.cg),
                abs(&node.cfg.cgroup_root)
            ),
        );
    }
    if !t.attached {
        return ("allowed", "the fence is not attached".to_string());
    }
    let anc = match &t.kernel {
        Err(e) => {
            return (
                "unknown",
                format!("the kernel levels of {} cannot be told: {e}", abs(t.cg)),
            )
        }
        Ok(a) => *a,
    };
    let Some(f) = t.fence else {
        return ("unknown", "the fence's maps cannot be opened".to_string());
    };
    let audit_note = if t.audit {
        " (audit mode: recorded, allowed)"
    } else {
        ""
    };
    match f.evaluate(
        Task {
            ancestry: &t.ids,
            uid: t.uid,
        },
        &t.identities,
        d,
        Access::RW,
    ) {
        Err(e) => ("unknown", format!("the fence's maps cannot be read: {e}")),
        Ok(ev) => {
            let (v, why) = explain(&ev, anc, t.cg, d, &t.entries, t.audit, audit_note);
            (v, format!("{why}{}", exemption_rule(node, t)))
        }
    }
}

/// What the exemption rule says of the target, when it is in or under an
/// `exempt_cgroups` entry: an exemption is a cgroup and its users, so
/// the entry covers the target's uid, or it does not and the target is
/// judged as if the cgroup were not exempt. Empty otherwise.
fn exemption_rule(node: &Node, t: &Target<'_>) -> String {
    let Some(e) = node.cfg.exempt_entry_covering(t.cg) else {
        return String::new();
    };
    let users: Vec<String> = e.users.iter().map(|u| u.to_string()).collect();
    let resolve = crate::host::fence_ops::exempt_resolver(node);
    let (_, unknown) = e.uids(&resolve);
    let unknown = if unknown.is_empty() {
        String::new()
    } else {
        format!(
            " ({} unknown to passwd_file and NSS: covers no one)",
            unknown.join(", ")
        )
    };
    if node.cfg.exempt_entry_for(t.cg, t.uid, &resolve).is_some() {
        format!(
            "; in exempt cgroup {}, whose entry covers uid {} (its users: {}{unknown})",
            abs(&e.cgroup),
            t.uid,
            users.join(", ")
        )
    } else {
        format!(
            "; in exempt cgroup {}, but an exemption covers only its entry's users ({}{unknown}), \
             not uid {}: its processes are fenced there as anywhere else (protected_uid_max grants nothing)",
            abs(&e.cgroup),
            users.join(", "),
            t.uid
        )
    }
}

/// An effective program of the target.
struct Effective {
    id: u32,
    name: String,
    owner: String,
    attached_at: Option<String>,
    insns: Vec<gpufence_cgroup::asm::RawInsn>,
}

/// The verdict for device `d` at `path` from every effective program:
/// the fence's own (`fence`: its verdict and why, as [`explain`] gives
/// them) where it runs, the others through [`foreign::answer`].
fn combine(
    path: String,
    d: DevNum,
    runs: &[Effective],
    ours: Option<u32>,
    fence: (&str, String),
) -> DeviceVerdict {
    let programs: Vec<ProgramVerdict> = runs
        .iter()
        .map(|r| {
            let (answer, why) = if Some(r.id) == ours {
                match fence.0 {
                    "allowed" => ("allows", fence.1.clone()),
                    "denied" => ("denies", fence.1.clone()),
                    _ => ("may deny", fence.1.clone()),
                }
            } else {
                match foreign::answer(&r.insns, d, Access::RW) {
                    Answer::Allows => ("allows", String::new()),
                    Answer::Denies => ("denies", String::new()),
                    Answer::MayDeny(why) => ("may deny", why),
                }
            };
            ProgramVerdict {
                id: r.id,
                name: r.name.clone(),
                owner: r.owner.clone(),
                attached_at: r.attached_at.as_ref().map(|c| abs(c)),
                answer: answer.into(),
                why,
            }
        })
        .collect();
    let ours_runs = programs.iter().any(|p| Some(p.id) == ours);
    let named = |p: &ProgramVerdict| {
        format!(
            "program {} {:?} ({}) attached at {}",
            p.id,
            p.name,
            p.owner,
            p.attached_at
                .as_deref()
                .unwrap_or("a cgroup above this namespace")
        )
    };
    let foreign_deniers: Vec<String> = programs
        .iter()
        .filter(|p| Some(p.id) != ours && p.answer == "denies")
        .map(|p| format!("denied by {}", named(p)))
        .collect();
    let unsure: Vec<String> = programs
        .iter()
        .filter(|p| Some(p.id) != ours && p.answer == "may deny")
        .map(|p| format!("{} may deny: {}", named(p), p.why))
        .collect();
    let (verdict, why) = if !foreign_deniers.is_empty() {
        let mut why = foreign_deniers.join("; ");
        if ours_runs && fence.0 == "denied" {
            why = format!("{why}; and by the fence: {}", fence.1);
        } else if ours_runs {
            why = format!("{why} (the fence itself: {}: {})", fence.0, fence.1);
        }
        ("denied".to_string(), why)
    } else if !ours_runs && !unsure.is_empty() {
        (
            "may be denied".to_string(),
            format!("{}; {}", fence.1, unsure.join("; ")),
        )
    } else if fence.0 == "allowed" && !unsure.is_empty() {
        (
            "may be denied".to_string(),
            format!("the fence allows ({}); {}", fence.1, unsure.join("; ")),
        )
    } else {
        (fence.0.to_string(), fence.1)
    };
    DeviceVerdict {
        path,
        device: d.to_string(),
        verdict,
        why,
        programs,
    }
}

/// A cgroup of the target's ancestry in words: its path, or its id and
/// level where this cgroup namespace does not show it.
fn name_of(anc: &[Ancestor], level: usize, id: u64) -> String {
    match anc.get(level).and_then(|a| a.path.as_deref()) {
        Some(p) => abs(p),
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
