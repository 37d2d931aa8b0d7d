//! The Prolog: record what Slurm allocated to a job.
//!
//! Runs as slurmd's Prolog, before the job cgroup exists; or, with
//! `PrologFlags=RunInJob` (24.05+), from the job's extern slurmstepd inside
//! the job cgroup, which it then grants itself ([`run_with_sluid`],
//! [`crate::job::injob`]). Its only inputs are the variables slurmd or
//! slurmstepd sets (trusted), slurmd's GRES list and its own cgroup (the
//! kernel's); nothing the job's user controls.

use std::collections::BTreeSet;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

use gpufence_cgroup::fence::Fence;
use gpufence_model::audit::{events, AuditEvent};
use gpufence_model::device::{Access, DevNum, DeviceGrant, DeviceRole};
use gpufence_model::gres::parse_index_list;
use gpufence_model::nvproc::{parse_mig_minors, CapKind, MigMinors};
use gpufence_model::record::{now_rfc3339, GpuIdle, JobRecord, MigSlice, RECORD_VERSION};

use crate::host::fence_ops::open_installed;
use crate::host::gpus::Gpus;
use crate::job::shared::granted_minors;
use crate::response::respond::{self, Mode};
use crate::{crashpoint, host::gresmap, response::evidence};
use crate::{Node, NodeError};

/// The Prolog's view of its environment (from slurmd).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrologEnv {
    /// `SLURM_JOB_ID`.
    pub job_id: u32,
    /// `SLURM_JOB_UID`.
    pub uid: u32,
    /// `SLURM_JOB_GPUS`: GRES indices; empty for a job without GPUs.
    pub gres_indices: Vec<u32>,
    /// `SLURM_CONF`.
    pub slurm_conf: Option<PathBuf>,
    /// `SLURMD_NODENAME`: this node as Slurm names it.
    pub node_name: Option<String>,
    /// `CUDA_VISIBLE_DEVICES` as slurmd set it (recorded, never granted from).
    pub cuda_visible_devices: Vec<gpufence_model::visible::VisibleDevice>,
    /// The job's `--gpu-exclusive` / `--gpufence-report` (user input).
    pub options: gpufence_model::options::JobOptions,
    /// A gres/mps job: slurmd set [`crate::job::mps::MPS_ENV`].
    pub mps: bool,
}

/// Parses a numeric variable slurmd always sets.
///
/// # Errors
/// [`NodeError::Env`] when absent or not a `u32`.
pub fn env_u32(get: &dyn Fn(&str) -> Option<String>, var: &'static str) -> Result<u32, NodeError> {
    let v = get(var).ok_or(NodeError::Env {
        var,
        msg: "not set".into(),
    })?;
    v.trim().parse().map_err(|_| NodeError::Env {
        var,
        msg: format!("{v:?} is not a number"),
    })
}

impl PrologEnv {
    /// Reads the Prolog environment through `get` (`std::env::var` in production).
    ///
    /// # Errors
    /// [`NodeError::Env`] / [`NodeError::Parse`] for missing or malformed values.
    pub fn from_env(get: &dyn Fn(&str) -> Option<String>) -> Result<Self, NodeError> {
        let job_id = env_u32(get, "SLURM_JOB_ID")?;
        let uid = env_u32(get, "SLURM_JOB_UID")?;
        let gres_indices = match get("SLURM_JOB_GPUS") {
            Some(v) => parse_index_list(&v, "SLURM_JOB_GPUS")?,
            None => Vec::new(),
        };
        Ok(PrologEnv {
            job_id,
            uid,
            gres_indices,
            slurm_conf: get("SLURM_CONF")
                .filter(|s| !s.is_empty())
                .map(PathBuf::from),
            node_name: get("SLURMD_NODENAME").filter(|s| !s.is_empty()),
            cuda_visible_devices: match get("CUDA_VISIBLE_DEVICES") {
                Some(v) => {
                    gpufence_model::visible::parse_visible_devices(&v, "CUDA_VISIBLE_DEVICES")?
                }
                None => Vec::new(),
            },
            // User input, already checked by the plugin at submission; a
            // value that still does not parse is ignored, never guessed.
            options: gpufence_model::options::JobOptions::from_env(get).unwrap_or_default(),
            mps: get(crate::job::mps::MPS_ENV).is_some(),
        })
    }
}

fn stat_char_device(index: u32, path: &Path) -> Result<DevNum, NodeError> {
    let bad = |msg: String| NodeError::BadDevice {
        index,
        path: path.to_path_buf(),
        msg,
    };
    let md = std::fs::metadata(path).map_err(|e| bad(e.to_string()))?;
    if !md.file_type().is_char_device() {
        return Err(bad("not a character device".into()));
    }
    Ok(DevNum::from_rdev(std::os::unix::fs::MetadataExt::rdev(&md)))
}

/// How long the Prolog waits for slurmctld's view of a job.
pub const SLURMCTLD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The job's GRES indices on this node. `SLURM_JOB_GPUS` is exact unless the
/// node has GPUs of several types: then slurmd sets it once per type record
/// of the job, each overwriting the last (`gres_g_prep_set_env`,
/// `src/interfaces/gres.c`, `gres_common_prep_set_env`,
/// `src/plugins/gres/common/gres_common.c`; still so in 26.05 and master),
/// and the Prolog sees only one type's GPUs. No node-local source names the
/// others (see [`crate::host::slurmctld`] for the Slurm sources checked),
/// so on such nodes, and only there, the job's allocation on this node is
/// read from slurmctld as JSON and united with the environment (which also
/// carries shard allocations, that the JSON `gpu` entries do not): one
/// command, two on 22.05 (`scontrol --json show job`, then `squeue
/// --json`), within [`SLURMCTLD_TIMEOUT`] together. A node with one GPU
/// type asks slurmctld nothing. Both sources are Slurm's own; if slurmctld
/// cannot answer, the environment alone is used (never more than
/// allocated: fail closed) and a note says so.
fn complete_indices(
    node: &Node,
    env: &PrologEnv,
    map: &gresmap::GresMap,
    notes: &mut Vec<String>,
) -> Result<Vec<u32>, NodeError> {
    let types: BTreeSet<Option<&str>> =
        map.devices.iter().map(|d| d.gres_type.as_deref()).collect();
    if types.len() <= 1 {
        return Ok(env.gres_indices.clone());
    }
    let Some(node_name) = env.node_name.as_deref() else {
        notes.push(
            "SLURMD_NODENAME unset: GPUs of several types may be granted only in part".into(),
        );
        return Ok(env.gres_indices.clone());
    };
    match crate::host::slurmctld::job_gpu_indices(
        &node.cfg.scontrol_bin,
        env.slurm_conf.as_deref(),
        env.job_id,
        node_name,
        SLURMCTLD_TIMEOUT,
    ) {
        Ok(from_ctld) => {
            let mut all: Vec<u32> = env.gres_indices.clone();
            for i in from_ctld {
                if !all.contains(&i) {
                    all.push(i);
                }
            }
            if all.len() != env.gres_indices.len() {
                notes.push(format!(
                    "SLURM_JOB_GPUS={:?} was incomplete (several GPU types); slurmctld allocated {all:?} here",
                    env.gres_indices
                ));
            }
            Ok(all)
        }
        Err(e) => {
            notes.push(format!("slurmctld could not be asked for the job's GPUs ({e}); granting SLURM_JOB_GPUS only"));
            Ok(env.gres_indices.clone())
        }
    }
}

/// `mig-minors` relative to `proc_dir` (`nv_procfs_read_mig_minors`,
/// `kernel-open/nvidia/nv-caps.c`).
pub const MIG_MINORS: &str = "driver/nvidia-caps/mig-minors";

/// A MIG capability `dev` (`file`) of a GRES index, by what
/// `mig-minors` says it is: a GPU instance's or a compute instance's cap
/// goes into `gi` / `ci`; the config capability is never granted, the
/// monitor capability only with `grant_mig_monitor` (a note says so).
/// Returns whether to grant it.
///
/// # Errors
/// [`NodeError::Mig`] for a capability that is not a MIG instance's or
/// that `mig-minors` does not list.
fn mig_cap(
    node: &Node,
    mm: &MigMinors,
    file: &Path,
    dev: DevNum,
    notes: &mut Vec<String>,
    gi: &mut Option<(u32, u32, DevNum)>,
    ci: &mut Option<(u32, DevNum)>,
) -> Result<bool, NodeError> {
    match mm.kind_of(dev.minor) {
        Some(CapKind::Config) => {
            notes.push(format!(
                "{} is the MIG config capability: never granted (it reconfigures MIG for every job)",
                file.display()
            ));
            Ok(false)
        }
        Some(CapKind::Monitor) if !node.cfg.grant_mig_monitor => {
            notes.push(format!(
                "{} is the MIG monitor capability: not granted (grant_mig_monitor = false)",
                file.display()
            ));
            Ok(false)
        }
        Some(CapKind::Monitor) => Ok(true),
        Some(CapKind::GpuInstance { gpu, gi: g }) => {
            *gi = Some((*gpu, *g, dev));
            Ok(true)
        }
        Some(CapKind::ComputeInstance { gpu, gi: g, ci: c }) => {
            *ci = Some((*c, dev));
            if gi.is_none() {
                // The GI cap by number, for the record; it is granted only
                // if the GRES lists it too.
                let m = mm.gi_minor(*gpu, *g).unwrap_or(dev.minor);
                *gi = Some((*gpu, *g, DevNum::new(dev.major, m)));
            }
            Ok(true)
        }
        Some(CapKind::Other(name)) => Err(NodeError::Mig(format!(
            "{} is the capability {name:?}, not a MIG instance: not granted; fix gres.conf",
            file.display()
        ))),
        None => Err(NodeError::Mig(format!(
            "{} ({dev}) is not listed in {}: cannot tell which MIG capability it is",
            file.display(),
            node.cfg.proc_dir.join(MIG_MINORS).display()
        ))),
    }
}

/// The MIG side of GRES index `index` once its files are read: its slice
/// (`parent` with the `gi` / `ci` caps) into the record, or a note when it
/// grants a MIG-partitioned GPU's parent alone.
///
/// # Errors
/// [`NodeError::Mig`] when caps come without their parent, or with
/// another GPU's.
fn index_mig(
    node: &Node,
    index: u32,
    parent: Option<DevNum>,
    gi: Option<(u32, u32, DevNum)>,
    ci: Option<(u32, DevNum)>,
    rec: &mut JobRecord,
) -> Result<(), NodeError> {
    if let (Some(parent), None) = (parent, gi) {
        let instances = mig_instances(node, parent.minor);
        if !instances.is_empty() {
            rec.notes.push(format!(
                "GRES index {index} grants /dev/nvidia{m} ({parent}) alone, but GPU {m} is MIG-partitioned \
                 (GPU instances {}): the parent alone runs no CUDA work and is shared with the jobs holding its \
                 instances; gres.conf should give each MIG instance as the parent with its caps \
                 (MultipleFiles=, Slurm's gres.conf(5))",
                instances
                    .iter()
                    .map(|g| format!("gi{g}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                m = parent.minor,
            ));
        }
    }
    if let Some((gpu_minor, g, gi_cap)) = gi {
        let parent = parent.ok_or_else(|| {
            NodeError::Mig(format!(
                "GRES index {index} holds MIG caps of gpu{gpu_minor} but not its parent /dev/nvidia{gpu_minor}"
            ))
        })?;
        if parent.minor != gpu_minor {
            return Err(NodeError::Mig(format!(
                "GRES index {index}: caps of gpu{gpu_minor} listed with /dev/nvidia{}",
                parent.minor
            )));
        }
        rec.mig.push(MigSlice {
            parent,
            gpu: gpu_minor,
            gi: g,
            ci: ci.map(|(c, _)| c),
            gi_cap,
            ci_cap: ci.map(|(_, d)| d),
        });
    }
    Ok(())
}

/// The GPU instances that exist on the GPU of device minor `gpu`: the
/// `gi<N>` directories of the driver's capability tree,
/// `<proc_dir>/driver/nvidia/capabilities/gpu<gpu>/mig/` (NVIDIA MIG user
/// guide, "Device Nodes and Capabilities"); none when the GPU is not
/// partitioned or the tree cannot be read.
fn mig_instances(node: &Node, gpu: u32) -> Vec<u32> {
    let dir = node
        .cfg
        .proc_dir
        .join(format!("driver/nvidia/capabilities/gpu{gpu}/mig"));
    let mut out: Vec<u32> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().to_str()?.strip_prefix("gi")?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    out.sort_unstable();
    out
}

/// Reads `<proc_dir>/driver/nvidia-caps/mig-minors`.
///
/// # Errors
/// [`NodeError::Mig`] when it is missing or malformed: a cap that cannot be
/// identified is never granted.
pub fn read_mig_minors(node: &Node) -> Result<MigMinors, NodeError> {
    let p = node.cfg.proc_dir.join(MIG_MINORS);
    let text = std::fs::read_to_string(&p).map_err(|e| {
        NodeError::Mig(format!(
            "{}: {e}: MIG capabilities in a GRES cannot be identified",
            p.display()
        ))
    })?;
    Ok(parse_mig_minors(&text, &p)?)
}

/// Builds the job's record: its GRES files by number, plus the control
/// devices. Does not write anything.
///
/// # Errors
/// [`NodeError`] for an index slurmd does not list, a missing device file,
/// or an unreadable GRES list.
pub fn build_record(node: &Node, env: &PrologEnv) -> Result<JobRecord, NodeError> {
    let mut rec = JobRecord {
        version: RECORD_VERSION,
        job_id: env.job_id,
        uid: env.uid,
        gres_indices: env.gres_indices.clone(),
        devices: Vec::new(),
        created: now_rfc3339(),
        notes: Vec::new(),
        user_notes: Vec::new(),
        gpu_idle: Vec::new(),
        mig: Vec::new(),
        saved_compute_modes: Vec::new(),
        job_map: Vec::new(),
        mps: Vec::new(),
        cuda_visible_devices: env
            .cuda_visible_devices
            .iter()
            .map(|v| v.to_string())
            .collect(),
    };
    if env.gres_indices.is_empty() {
        return Ok(rec);
    }
    let protected = node.protected_majors()?;
    let map = gresmap::load(
        &node.for_slurm_node(env.node_name.as_deref()),
        env.slurm_conf.as_deref(),
    )?;
    let indices = complete_indices(node, env, &map, &mut rec.notes)?;
    rec.gres_indices = indices.clone();
    let mut seen = BTreeSet::new();
    let caps_major = protected.major_of("nvidia-caps");
    let gpu_major = node.gpu_major();
    let mut mig_minors: Option<MigMinors> = None;
    for &index in &indices {
        let gpu = map
            .devices
            .get(index as usize)
            .ok_or_else(|| NodeError::UnmappedIndex {
                job_id: env.job_id,
                index,
                count: map.devices.len(),
                source_name: map.source.clone(),
            })?;
        let mut parent: Option<DevNum> = None;
        let mut gi: Option<(u32, u32, DevNum)> = None;
        let mut ci: Option<(u32, DevNum)> = None;
        for file in &gpu.files {
            let dev = stat_char_device(index, file)?;
            if Some(dev.major) == caps_major {
                // A MIG capability: which one is in mig-minors, never guessed.
                if mig_minors.is_none() {
                    mig_minors = Some(read_mig_minors(node)?);
                }
                let mm = mig_minors
                    .as_ref()
                    .ok_or_else(|| NodeError::Mig("mig-minors unread".into()))?;
                if !mig_cap(node, mm, file, dev, &mut rec.notes, &mut gi, &mut ci)? {
                    continue;
                }
            } else if dev.major == gpu_major {
                parent = Some(dev);
            }
            if !protected.contains(dev.major) {
                rec.notes.push(format!(
                    "{} ({dev}) is not on a protected major: the fence does not guard it",
                    file.display()
                ));
            }
            if seen.insert(dev) {
                rec.devices.push(DeviceGrant {
                    path: file.clone(),
                    dev,
                    access: Access::RW,
                    role: DeviceRole::Gres,
                    gres_index: Some(index),
                });
            }
        }
        index_mig(node, index, parent, gi, ci, &mut rec)?;
    }
    let (control, missing) = protected.control_devices();
    for (name, dev) in control {
        if seen.insert(dev) {
            rec.devices.push(DeviceGrant {
                path: node.cfg.dev_dir.join(name),
                dev,
                access: Access::RW,
                role: DeviceRole::Control,
                gres_index: None,
            });
        }
    }
    for name in missing {
        rec.notes
            .push(format!("{name}: no major for it on this node; not granted"));
    }
    // The driver's shared IMEX channel, for GPU jobs, when the site opted
    // in (`imex_channel0`; NVIDIA: for trusted environments only).
    if node.cfg.imex_channel0 {
        let slurm = crate::host::slurmconf::SlurmConf::load(
            &crate::host::slurmconf::slurm_conf_or_default(env.slurm_conf.as_deref()),
        )
        .ok();
        match crate::job::imex::channel_major(node, slurm.as_ref()) {
            Some(major) => {
                let g = crate::job::imex::channel0_grant(node, major);
                if seen.insert(g.dev) {
                    rec.devices.push(g);
                }
            }
            None => rec.notes.push(format!(
                "imex_channel0: no protected `{}` major on this node (/proc/devices, [majors] or SwitchParameters=imex_dev_major); channel0 not granted",
                crate::job::imex::CHANNEL_DIR
            )),
        }
    }
    Ok(rec)
}

/// The clean start: processes that hold the job's GPUs (by descriptor, or
/// per NVML) outside every grant and exemption are dealt with per
/// `prolog_strays`; then each GPU's used memory is recorded as its idle level.
///
/// # Errors
/// [`NodeError::Strays`] when the policy refuses or something survives;
/// [`NodeError::NotRead`] when a process not read whole within
/// `scan_budget_ms` (twice) that gpufence does not end may hold the GPUs
/// ([`respond::uncovered`]);
/// [`NodeError::Response`] / [`NodeError::Audit`] when a step of the
/// response fails; [`NodeError::Nvml`] when NVML answers with an error
/// and `nvml_failure = "drain"` (`report`: a `check_failed` line, the
/// descriptor scan's answer alone).
pub fn clean_start(node: &Node, fence: &Fence, rec: &mut JobRecord) -> Result<(), NodeError> {
    let gres = rec.gres_devices();
    if gres.is_empty() {
        return Ok(());
    }
    let gpu_major = node.gpu_major();
    let minors = rec.gpu_minors(gpu_major);
    let gpus = if minors.is_empty() {
        Gpus::none("no NVIDIA GPU in the job")
    } else {
        node.open_gpus()
    };
    let info = match gpus.query(&minors) {
        Ok(i) => i,
        Err(e) if node.nvml_failed(rec.job_id, "NVML query", &e) => return Err(NodeError::Nvml(e)),
        Err(_) => Vec::new(),
    };
    let sought = |gpu_info| respond::Sought {
        fence: Some(fence),
        devs: &gres,
        gpu_info,
        gpu_major,
        mig: &rec.mig,
    };
    let found = respond::uncovered(node, rec.job_id, Some(rec.uid), &sought(&info));
    let not_read = found.not_read;
    let cands = found.candidates;
    if !cands.is_empty() {
        let pids: Vec<i32> = cands.iter().map(|c| c.pid).collect();
        // `refuse`: evidence and the audit line only; `kill`: the response.
        let mode = Mode::from(node.cfg.prolog_strays);
        let (done, errors) = respond::respond(
            &respond::Responder {
                node,
                job_id: rec.job_id,
                job_uid: Some(rec.uid),
                phase: "prolog",
            },
            mode,
            match mode {
                Mode::Refuse => "held the job's GPU before it started (policy: refuse)",
                Mode::End => "held the job's GPU before it started",
            },
            cands,
            &mut evidence::Budget::from_config(&node.cfg),
        );
        if let Some(e) = errors.into_iter().next() {
            return Err(e.into());
        }
        if mode == Mode::Refuse {
            return Err(NodeError::Strays {
                job_id: rec.job_id,
                what: "stray processes (policy: refuse)".into(),
                pids,
            });
        }
        let mut survived: Vec<i32> = done.iter().filter(|l| !l.gone()).map(|l| l.pid).collect();
        // And what holds them now (one that let go before it was
        // stopped and took the device up again, or was handed it).
        let again = gpus.query(&minors).unwrap_or_default();
        let known: BTreeSet<i32> = not_read.iter().map(|n| n.pid).collect();
        for c in respond::uncovered_except(node, rec.job_id, Some(rec.uid), &sought(&again), &known)
            .candidates
        {
            if !survived.contains(&c.pid) {
                survived.push(c.pid);
            }
        }
        if !survived.is_empty() {
            return Err(NodeError::Strays {
                job_id: rec.job_id,
                what: "processes survived SIGKILL".into(),
                pids: survived,
            });
        }
        rec.notes
            .push(format!("clean start: killed {pids:?} on the job's GPUs"));
    }
    // Past the budget, the GPU is never handed on uncertified: a process
    // not read whole that gpufence does not end fails the job's start.
    if !not_read.is_empty() {
        return Err(NodeError::NotRead {
            job_id: rec.job_id,
            what: not_read
                .iter()
                .map(respond::NotRead::reason)
                .collect::<Vec<_>>()
                .join("; "),
        });
    }
    if gpus.available() {
        // A GPU another job's live grant covers (gres/shard, gres/mps:
        // several jobs on one GPU) idles at no level this job can measure.
        let shared = granted_minors(Some(fence), gpu_major, Some(rec.job_id));
        let used = match gpus.memory_used(&minors) {
            Ok(u) => u,
            // No idle level: the Epilog then uses idle_memory_mib.
            Err(e) if !node.nvml_failed(rec.job_id, "NVML memory query", &e) => Vec::new(),
            Err(e) => return Err(NodeError::Nvml(e)),
        };
        rec.gpu_idle = used
            .into_iter()
            .map(|(minor, used_bytes)| GpuIdle {
                minor,
                used_bytes,
                shared: shared.contains(&minor),
            })
            .collect();
    }
    Ok(())
}

/// Removes what an earlier job with the same id left behind (its epilog was
/// killed, or job ids wrapped or were reset with `slurmctld -i`): grants
/// still keyed by this job id, bookkeeping notes, and in the `own` layout
/// its cgroup with whatever still runs in it. Otherwise the new job would
/// start in a cgroup holding an old grant and old processes. Returns notes.
///
/// # Errors
/// [`NodeError`] when the fence refuses the revoke or the cgroup cannot be
/// emptied.
pub fn clear_stale(node: &Node, fence: &Fence, job_id: u32) -> Result<Vec<String>, NodeError> {
    let mut notes = Vec::new();
    // Every grant is noted in `applied/` before it is made
    // ([`crate::job::grant`]): a job with no note (and no unreadable one) has no
    // grant to revoke, and the walk of the whole `grants` map is spared.
    let (applied, unreadable) = node.state.applied(Some(job_id));
    let gone = if applied.is_empty() && unreadable.is_empty() {
        Vec::new()
    } else {
        fence.revoke_job(job_id)?
    };
    if !gone.is_empty() {
        notes.push(format!(
            "revoked {} stale grant entries of an earlier job {job_id}",
            gone.len()
        ));
    }
    node.state.remove_applied(job_id)?;
    if node.cfg.layout == gpufence_model::config::Layout::Own {
        let cg = node.own_job_cgroup(job_id);
        if node.cg.path(&cg).exists() {
            let procs = node.cg.procs_recursive(&cg);
            crate::host::exec_cgroup::kill_and_remove(
                node,
                &cg,
                std::time::Duration::from_millis(node.cfg.kill_wait_ms),
            )?;
            notes.push(format!(
                "removed the stale cgroup /{cg} (processes killed: {procs:?})"
            ));
        }
    }
    if !notes.is_empty() {
        node.audit(
            AuditEvent::new(events::STALE_JOB_STATE)
                .job(job_id)
                .field("phase", "prolog")
                .field("cleared", notes.clone()),
        )?;
    }
    Ok(notes)
}

/// `--gpu-exclusive`: exclusive-process compute mode on the job's GPUs,
/// remembering each GPU's mode for the epilog to restore. A GPU that cannot
/// be switched is a note for the job's user (the job still runs: the mode
/// is the user's wish, not a security boundary).
fn set_exclusive(node: &Node, rec: &mut JobRecord) {
    let minors = rec.gpu_minors(node.gpu_major());
    let gpus = node.open_gpus();
    for m in minors {
        match gpus.swap_compute_mode(m, crate::host::gpus::EXCLUSIVE_PROCESS) {
            Ok(old) => rec.saved_compute_modes.push((m, old)),
            Err(e) => {
                // The file the job was given (the demo's and the tests'
                // stand-ins are not in /dev).
                let path = rec
                    .devices
                    .iter()
                    .find(|d| d.role == DeviceRole::Gres && d.dev.minor == m)
                    .map_or_else(
                        || format!("/dev/nvidia{m}"),
                        |d| d.path.display().to_string(),
                    );
                rec.user_notes.push(format!(
                    "--gpu-exclusive: {path}: not set ({e}); the GPU stays in its current compute mode"
                ));
            }
        }
    }
}

/// Runs the Prolog: checks the fence, builds the record, makes sure the
/// job's GPUs are free, writes the record, audits. `SLURM_JOB_SLUID` is
/// read from the process environment ([`run_with_sluid`]).
///
/// # Errors
/// [`NodeError`]: Slurm then drains the node and requeues the job.
pub fn run(node: &Node, env: &PrologEnv) -> Result<JobRecord, NodeError> {
    let sluid = std::env::var(crate::job::injob::SLUID_ENV).ok();
    run_with_sluid(node, env, sluid.as_deref())
}

/// [`run`] with the job's SLUID as slurmd or slurmstepd set it
/// (`SLURM_JOB_SLUID`, 25.11+; `None` before).
///
/// Where the Prolog runs decides one thing more. In slurmd's cgroup (the
/// usual Prolog) nothing else happens: the steps' `slurm_spank_init`
/// grant the record. Under `PrologFlags=RunInJob` with `layout = "slurm"`
/// the Prolog runs in the job's `step_extern/slurm` ([`crate::job::injob`]),
/// after the extern step's `slurm_spank_init` found no record; then, in
/// this order:
/// 1. the job cgroup is taken from the Prolog's own cgroup
///    ([`crate::job::injob::locate_script`]; with `sluid` it must be this job's
///    SLUID);
/// 2. the Prolog steps out into an exempt leaf of the exec cgroup
///    ([`crate::job::injob::step_out`]), so that the stale-state clean-up, the
///    record (`slurmd -G`, `scontrol`) and the NVML checks (clean start,
///    idle-memory baseline, `--gpu-exclusive`) run as they do from
///    slurmd's exempt cgroup; the job's grant alone would not do for NVML,
///    which opens every GPU of the node;
/// 3. the record is written and `grant_recorded` audited, as always;
/// 4. the record is granted to the job cgroup
///    ([`crate::job::grant::grant_in_prolog`]: `grant_applied` with step
///    `extern` and `phase` `prolog`, the applied note, the fence), so the
///    extern step (and the ssh sessions pam_slurm_adopt puts there) and
///    every later step hold it when the Prolog returns; Slurm starts no
///    user process in the job before. It comes last so that no failure
///    leaves a grant behind: if it fails, what it did is undone, the
///    record removed, and the Prolog fails;
/// 5. the Prolog steps back into the job cgroup and exits.
///
/// In either place, with `job_map_dir` set, the job's map file names
/// (NVML indices) go into the record before it is written, and the job map
/// is rewritten last ([`crate::job::jobmap`]); a map that cannot be
/// written is an `error` audit line, never a failed Prolog.
///
/// # Errors
/// As [`run`]; also [`NodeError::WrongJob`] when the Prolog runs in
/// another job's extern step, [`NodeError::OutsideFence`] when that lies
/// outside the fenced subtree, [`NodeError::StepOut`] when it cannot step
/// out.
pub fn run_with_sluid(
    node: &Node,
    env: &PrologEnv,
    sluid: Option<&str>,
) -> Result<JobRecord, NodeError> {
    // No job of a uid taken for a system account (crate::host::accounts):
    // before anything of the job's user runs on the node.
    if crate::host::accounts::is_system_job_uid(&node.cfg, env.uid) {
        return Err(NodeError::SystemUidJob {
            job_id: env.job_id,
            uid: env.uid,
            max: node.cfg.protected_uid_max,
            config: node.origin.to_string(),
        });
    }
    // A job must not start on a node whose GPUs nobody guards.
    let fence = open_installed(node)?;
    crashpoint::reached(crashpoint::PROLOG_FENCE_CHECKED);
    let in_job = crate::job::injob::locate_script(node, env.job_id, sluid)?;
    let _stepped_out = match &in_job {
        Some(_) => Some(crate::job::injob::step_out(node, &fence, "prolog")?),
        None => None,
    };
    let interrupted = crate::response::engine::finish_interrupted(node);
    let stale = clear_stale(node, &fence, env.job_id)?;
    crashpoint::reached(crashpoint::PROLOG_STALE_CLEARED);
    let mut rec = build_record(node, env)?;
    rec.notes.extend(stale);
    rec.notes.extend(interrupted);
    clean_start(node, &fence, &mut rec)?;
    if env.options.gpu_exclusive {
        set_exclusive(node, &mut rec);
    }
    crashpoint::reached(crashpoint::PROLOG_CLEAN_STARTED);
    // A failure from here on leaves no MPS registration of this job (its
    // Epilog may never run: Slurm drains the node and requeues the job).
    let undo_mps = |fence: &Fence| {
        let _ = crate::job::mps::release(node, Some(fence), env.job_id);
    };
    if env.mps {
        if let Err(e) = crate::job::mps::start(node, &fence, &mut rec) {
            undo_mps(&fence);
            return Err(e);
        }
    }
    // The job map's file names (NVML indices) go into the record, from
    // which every rewrite of the map is made (crate::job::jobmap).
    crate::job::jobmap::name_files(node, &mut rec);
    let rec = rec;
    if let Err(e) = node.state.write_record(&rec) {
        undo_mps(&fence);
        return Err(e.into());
    }
    // A new job with an old job's id (ids wrapped, `slurmctld -i`): its
    // Epilog is a first one, whatever the old job's end note says.
    let _ = node.state.remove_ended(rec.job_id);
    crashpoint::reached(crashpoint::PROLOG_RECORD_WRITTEN);
    if !rec.devices.is_empty() {
        let mut ev = AuditEvent::new(events::GRANT_RECORDED)
            .job(rec.job_id)
            .uid(rec.uid)
            .devices(&rec.devices)
            .field("gres_indices", rec.gres_indices.clone());
        let notes = rec.all_notes();
        if !notes.is_empty() {
            ev = ev.field("notes", notes);
        }
        if let Err(e) = node.audit(ev) {
            // No record of the grant, no grant.
            let _ = node.state.remove_record(rec.job_id);
            undo_mps(&fence);
            return Err(e);
        }
    }
    crashpoint::reached(crashpoint::PROLOG_AUDITED);
    if let Some(job) = &in_job {
        if let Err(e) = grant_job_cgroup(node, &fence, &rec, &job.path) {
            undo_mps(&fence);
            return Err(e);
        }
    }
    // Slurm's IMEX channels with a namespace plugin: the extern step makes
    // the job's channel node before its slurm_spank_init; the scope's
    // mknod grant is in place before the extern step starts
    // (crate::job::imex::grant_scope_mknod). A failure is one `error`
    // line: without a namespace plugin the step's own grant suffices.
    let slurm = crate::host::slurmconf::SlurmConf::load(
        &crate::host::slurmconf::slurm_conf_or_default(env.slurm_conf.as_deref()),
    )
    .ok();
    if let Some(major) = slurm
        .as_ref()
        .and_then(|s| crate::job::imex::switch_major(node, s))
    {
        if let Err(e) = crate::job::imex::grant_scope_mknod(node, major) {
            let _ = node.audit(
                AuditEvent::new(events::ERROR)
                    .job(rec.job_id)
                    .field("phase", "prolog")
                    .field(
                        "reason",
                        format!("IMEX channels: Slurm's scope cannot be granted mknod: {e}"),
                    ),
            );
        }
    }
    // Last, when nothing can fail the job any more: the job map, for
    // monitoring. A map that cannot be written is one `error` line, never
    // a refused job.
    if let Err(e) = crate::job::jobmap::sync(node, None) {
        let _ = node.audit(
            AuditEvent::new(events::ERROR)
                .job(rec.job_id)
                .field("phase", "prolog")
                .field("reason", format!("{e}; the job map lacks this job")),
        );
    }
    Ok(rec)
}

/// Step 4 of [`run_with_sluid`]: the extern step's grant, by the Prolog.
fn grant_job_cgroup(
    node: &Node,
    fence: &Fence,
    rec: &JobRecord,
    job_cgroup: &str,
) -> Result<(), NodeError> {
    let req = crate::job::grant::StepRequest {
        job_id: rec.job_id,
        step_id: crate::job::grant::EXTERN_STEP_ID,
        uid: rec.uid,
        stepd_pid: std::process::id() as i32,
    };
    let err = match crate::job::grant::grant_in_prolog(node, &req, fence, job_cgroup) {
        Ok(
            crate::job::grant::GrantOutcome::Granted { .. }
            | crate::job::grant::GrantOutcome::NoGpus,
        ) => return Ok(()),
        Ok(crate::job::grant::GrantOutcome::NoRecord) => NodeError::RecordGone {
            job_id: rec.job_id,
            path: node.state.record_path(rec.job_id),
        },
        Err(e) => e,
    };
    // The job is requeued: neither its grant nor its record may stay.
    let _ = fence.revoke_job(rec.job_id);
    let _ = node.state.remove_applied(rec.job_id);
    let _ = node.state.remove_record(rec.job_id);
    Err(err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpufence_model::config::{Config, ConfigOrigin};
    use std::collections::HashMap;

    /// A node whose GRES list comes from a file; device files are ordinary
    /// character devices every machine has (/dev/null 1:3, /dev/zero 1:5),
    /// listed so that names, numbers and order disagree.
    fn node(dir: &Path, gres: &str, majors: &str) -> Node {
        let g = dir.join("slurmd-G.txt");
        std::fs::write(&g, gres).unwrap();
        let text = format!(
            "state_dir = \"{d}/state\"\naudit_log = \"{d}/audit.jsonl\"\nslurmd_gres = \"{g}\"\n{majors}",
            d = dir.display(),
            g = g.display()
        );
        let cfg = Config::parse(&text, Path::new("test.toml")).unwrap();
        Node::new(cfg, ConfigOrigin::Defaults).expect("cgroup2 mount")
    }

    const GRES: &str = "slurmd: Gres Name=gpu Type=(null) Count=1 Index=0 ID=1 File=/dev/zero (null)\n\
                        slurmd: Gres Name=gpu Type=(null) Count=1 Index=3 ID=1 File=/dev/null (null)\n";
    const MAJORS: &str = "[majors]\nnvidia = 1\nnvidia-uvm = 241\n";

    fn env(vars: &[(&str, &str)]) -> Result<PrologEnv, NodeError> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        PrologEnv::from_env(&|k| m.get(k).cloned())
    }

    #[test]
    fn index_maps_by_position_and_adds_control_devices() {
        let d = tempfile::tempdir().unwrap();
        let n = node(d.path(), GRES, MAJORS);
        let e = env(&[
            ("SLURM_JOB_ID", "17"),
            ("SLURM_JOB_UID", "1000"),
            ("SLURM_JOB_GPUS", "1"),
        ])
        .unwrap();
        let r = build_record(&n, &e).unwrap();
        let devs: Vec<(DevNum, DeviceRole)> = r.devices.iter().map(|d| (d.dev, d.role)).collect();
        assert_eq!(
            devs,
            vec![
                (DevNum::new(1, 3), DeviceRole::Gres), // index 1 is the second line: /dev/null, not /dev/zero
                (DevNum::new(1, 255), DeviceRole::Control),
                (DevNum::new(241, 0), DeviceRole::Control),
                (DevNum::new(241, 1), DeviceRole::Control),
            ]
        );
        assert!(r.devices.iter().all(|d| d.access == Access::RW));
        assert_eq!(r.devices[0].gres_index, Some(1));
        assert!(r.notes.is_empty(), "{:?}", r.notes);
    }

    /// `imex_channel0`: a GPU job's record gets `channel0` of the IMEX
    /// major (read, write); a CPU-only job's, and any job's without the
    /// key, none.
    #[test]
    fn channel0_is_granted_to_gpu_jobs_only_when_asked() {
        let d = tempfile::tempdir().unwrap();
        let majors = "[majors]\nnvidia = 1\nnvidia-caps-imex-channels = 120\n";
        let gpu_job = env(&[
            ("SLURM_JOB_ID", "17"),
            ("SLURM_JOB_UID", "1000"),
            ("SLURM_JOB_GPUS", "1"),
            ("SLURM_CONF", "/nonexistent/slurm.conf"),
        ])
        .unwrap();
        let cpu_job = env(&[("SLURM_JOB_ID", "18"), ("SLURM_JOB_UID", "1000")]).unwrap();
        let on = node(d.path(), GRES, &format!("imex_channel0 = true\n{majors}"));
        let r = build_record(&on, &gpu_job).unwrap();
        let ch0: Vec<_> = r.devices.iter().filter(|g| g.dev.major == 120).collect();
        assert_eq!(ch0.len(), 1, "{:?}", r.devices);
        assert_eq!(
            (ch0[0].dev, ch0[0].access),
            (DevNum::new(120, 0), Access::RW)
        );
        assert!(ch0[0].path.ends_with("nvidia-caps-imex-channels/channel0"));
        assert!(build_record(&on, &cpu_job).unwrap().devices.is_empty());
        let off = node(d.path(), GRES, majors);
        let r = build_record(&off, &gpu_job).unwrap();
        assert!(
            r.devices.iter().all(|g| g.dev.major != 120),
            "{:?}",
            r.devices
        );
        // Asked for, with no IMEX major: a note, no grant.
        let none = node(d.path(), GRES, &format!("imex_channel0 = true\n{MAJORS}"));
        let r = build_record(&none, &gpu_job).unwrap();
        assert!(
            r.notes.iter().any(|n| n.contains("channel0 not granted")),
            "{:?}",
            r.notes
        );
    }

    #[test]
    fn job_without_gpus_gets_no_devices() {
        let d = tempfile::tempdir().unwrap();
        let n = node(d.path(), GRES, MAJORS);
        for vars in [
            vec![("SLURM_JOB_ID", "5"), ("SLURM_JOB_UID", "0")],
            vec![
                ("SLURM_JOB_ID", "5"),
                ("SLURM_JOB_UID", "0"),
                ("SLURM_JOB_GPUS", ""),
            ],
        ] {
            let r = build_record(&n, &env(&vars).unwrap()).unwrap();
            assert!(r.devices.is_empty() && r.gres_indices.is_empty());
        }
    }

    #[test]
    fn node_problems_are_errors() {
        let d = tempfile::tempdir().unwrap();
        let n = node(d.path(), GRES, MAJORS);
        let e = env(&[
            ("SLURM_JOB_ID", "5"),
            ("SLURM_JOB_UID", "0"),
            ("SLURM_JOB_GPUS", "2"),
        ])
        .unwrap();
        assert!(matches!(
            build_record(&n, &e),
            Err(NodeError::UnmappedIndex {
                index: 2,
                count: 2,
                ..
            })
        ));
        let missing = "Gres Name=gpu Count=1 File=/dev/nvidia-does-not-exist\n";
        let n = node(d.path(), missing, MAJORS);
        let e = env(&[
            ("SLURM_JOB_ID", "5"),
            ("SLURM_JOB_UID", "0"),
            ("SLURM_JOB_GPUS", "0"),
        ])
        .unwrap();
        let err = build_record(&n, &e).unwrap_err();
        assert!(
            matches!(err, NodeError::BadDevice { index: 0, .. }),
            "{err}"
        );
        let n = node(
            d.path(),
            "Gres Name=gpu Count=1 File=/etc/hostname\n",
            MAJORS,
        );
        assert!(matches!(
            build_record(&n, &e),
            Err(NodeError::BadDevice { .. })
        ));
    }

    #[test]
    fn unprotected_major_and_missing_uvm_are_noted() {
        let d = tempfile::tempdir().unwrap();
        let n = node(d.path(), GRES, "[majors]\nnvidia = 195\n");
        let e = env(&[
            ("SLURM_JOB_ID", "5"),
            ("SLURM_JOB_UID", "0"),
            ("SLURM_JOB_GPUS", "0"),
        ])
        .unwrap();
        let r = build_record(&n, &e).unwrap();
        assert!(
            r.notes
                .iter()
                .any(|m| m.contains("/dev/zero") && m.contains("not on a protected major")),
            "{:?}",
            r.notes
        );
        assert!(
            r.notes.iter().any(|m| m.starts_with("nvidia-uvm")),
            "{:?}",
            r.notes
        );
    }

    #[test]
    fn environment_is_checked() {
        assert!(matches!(
            env(&[("SLURM_JOB_UID", "0")]),
            Err(NodeError::Env {
                var: "SLURM_JOB_ID",
                ..
            })
        ));
        assert!(matches!(
            env(&[("SLURM_JOB_ID", "x"), ("SLURM_JOB_UID", "0")]),
            Err(NodeError::Env {
                var: "SLURM_JOB_ID",
                ..
            })
        ));
        assert!(matches!(
            env(&[
                ("SLURM_JOB_ID", "1"),
                ("SLURM_JOB_UID", "0"),
                ("SLURM_JOB_GPUS", "0,../1")
            ]),
            Err(NodeError::Parse(_))
        ));
    }
}
