//! The Epilog: revoke the job's grant, then prove nothing still holds the
//! job's devices.
//!
//! Order: revoke (nothing new can open them) → ask the driver (NVML) and the
//! descriptor tables who still holds them → respond to each process that no
//! live grant or exemption covers ([`crate::response::respond`]: freeze, evidence,
//! SIGTERM, SIGKILL, check) → look again → wait for each GPU's memory to come
//! back to its idle level → in the `own` layout, kill what is left in the
//! job's cgroup and remove it → forget the record. Clean (exit 0) when
//! nothing survived and every step worked; otherwise exit non-zero and, when
//! configured, drain the node with a reason naming the job and the pid.
//!
//! Under `PrologFlags=RunInJob` (24.05+) the Epilog runs from the job's
//! extern slurmstepd inside the job cgroup: it first steps out into an
//! exempt cgroup ([`crate::job::injob::step_out`]), so that every check above
//! works as it does from slurmd's cgroup, and steps back before it exits.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use gpufence_cgroup::fence::{Fence, GrantEntry};
use gpufence_model::audit::{events, AuditEvent};
use gpufence_model::config::Layout;
use gpufence_model::device::{DevNum, DeviceRole};
use gpufence_model::record::JobRecord;

use crate::host::gpus::Gpus;
use crate::response::respond::{self, Lingering};
use crate::{crashpoint, host::drain, Node};

/// What the epilog did.
#[derive(Clone, Debug, Default)]
pub struct EpilogOutcome {
    /// Grants removed from the fence.
    pub revoked: Vec<GrantEntry>,
    /// Processes that held the job's devices.
    pub lingering: Vec<Lingering>,
    /// Processes still holding the job's devices after the response.
    pub survivors: Vec<String>,
    /// Problems that make the node unsafe (non-zero exit).
    pub errors: Vec<String>,
    /// Things worth a line that do not fail the epilog.
    pub notes: Vec<String>,
    /// The drain reason, when the node was (or should have been) drained.
    pub drain_reason: Option<String>,
    /// Compute modes restored after `--gpu-exclusive`.
    pub exclusive: Vec<String>,
}

impl EpilogOutcome {
    /// Whether the node is clean: nothing survived and every step worked.
    pub fn clean(&self) -> bool {
        self.errors.is_empty()
            && self.survivors.is_empty()
            && self.lingering.iter().all(Lingering::gone)
    }
}

/// The GPU minors among `devs` (devices on the `/dev/nvidia<N>` major,
/// excluding `nvidiactl` 255 and `nvidia-modeset` 254).
pub fn gpu_minors(devs: &BTreeSet<DevNum>, gpu_major: u32) -> BTreeSet<u32> {
    devs.iter()
        .filter(|d| d.major == gpu_major && d.minor < 254)
        .map(|d| d.minor)
        .collect()
}

fn accounting_fields(
    node: &Node,
    gpus: &Gpus,
    rec: &JobRecord,
    minors: &BTreeSet<u32>,
    ev: AuditEvent,
    now: chrono::DateTime<chrono::Utc>,
) -> AuditEvent {
    let start = chrono::DateTime::parse_from_rfc3339(&rec.created).ok();
    let Some(start) = start else { return ev };
    let wall = (now.timestamp_micros() - start.timestamp_micros()).max(0) as f64 / 1e6;
    let ev = ev
        .field("wall_seconds", (wall * 1000.0).round() / 1000.0)
        .field(
            "gpu_seconds",
            (wall * rec.gres_indices.len() as f64 * 1000.0).round() / 1000.0,
        );
    if !gpus.available() {
        return ev;
    }
    match gpus.accounting(
        minors,
        start.timestamp_micros().max(0) as u64,
        now.timestamp_micros().max(0) as u64,
    ) {
        Ok(acc) if !acc.is_empty() => {
            let per_gpu: Vec<serde_json::Value> = acc
                .into_iter()
                .map(|(minor, procs)| {
                    let max_mem = procs.iter().filter_map(|p| p.max_memory).max();
                    let utils: Vec<u32> = procs.iter().filter_map(|p| p.gpu_utilization).collect();
                    let avg = (!utils.is_empty())
                        .then(|| utils.iter().sum::<u32>() as f64 / utils.len() as f64);
                    serde_json::json!({
                        "minor": minor,
                        "processes": procs.len(),
                        "max_memory_bytes": max_mem,
                        "avg_gpu_utilization": avg,
                    })
                })
                .collect();
            ev.field("accounting", per_gpu)
        }
        Ok(_) => ev,
        Err(e) => {
            let _ = node;
            ev.field("accounting_error", e.to_string())
        }
    }
}

/// The epilog's inputs besides the config.
#[derive(Clone, Debug, Default)]
pub struct EpilogEnv {
    /// `SLURM_JOB_ID`.
    pub job_id: u32,
    /// `SLURMD_NODENAME`, used to drain; `None` skips draining.
    pub node_name: Option<String>,
    /// The job's options (`--gpufence-report`), user input.
    pub options: gpufence_model::options::JobOptions,
    /// `SLURM_JOB_WORK_DIR`: where the report goes by default.
    pub work_dir: Option<PathBuf>,
    /// `SLURM_JOB_UID` / `SLURM_JOB_GID`, for writing the report as the user
    /// when the job has no record.
    pub uid: Option<u32>,
    /// See `uid`.
    pub gid: Option<u32>,
    /// `SLURM_JOB_SLUID` (25.11+): under `PrologFlags=RunInJob`, the SLUID
    /// the job cgroup the Epilog runs in must have ([`crate::job::injob`]).
    pub job_sluid: Option<String>,
}

impl EpilogEnv {
    /// Reads it from the Epilog environment.
    pub fn from_env(job_id: u32, get: &dyn Fn(&str) -> Option<String>) -> Self {
        EpilogEnv {
            job_id,
            node_name: get("SLURMD_NODENAME"),
            options: gpufence_model::options::JobOptions::from_env(get).unwrap_or_default(),
            work_dir: get("SLURM_JOB_WORK_DIR")
                .filter(|s| !s.is_empty())
                .map(PathBuf::from),
            uid: get("SLURM_JOB_UID").and_then(|v| v.parse().ok()),
            gid: get("SLURM_JOB_GID").and_then(|v| v.parse().ok()),
            job_sluid: get(crate::job::injob::SLUID_ENV).filter(|s| !s.is_empty()),
        }
    }
}

/// Step 0 of [`run_with`]: out of the job cgroup, when the Epilog runs in
/// one. A failure is an error of the Epilog (the node is not shown clean).
fn step_out_of_job<'a>(
    node: &'a Node,
    fence: &Fence,
    env: &EpilogEnv,
    out: &mut EpilogOutcome,
) -> Option<crate::job::injob::SteppedOut<'a>> {
    let stepped = match crate::job::injob::locate_script(node, env.job_id, env.job_sluid.as_deref()) {
        Ok(None) => return None,
        Ok(Some(_)) => crate::job::injob::step_out(node, fence, "epilog").map_err(|e| {
            format!(
                "{e}; NVML cannot check the job's GPUs from inside the job cgroup once its grant is revoked"
            )
        }),
        Err(e) => Err(e.to_string()),
    };
    match stepped {
        Ok(s) => Some(s),
        Err(e) => {
            out.errors.push(e);
            None
        }
    }
}

/// Runs the epilog for `job_id` (no options, no draining: tests and tools).
pub fn run(node: &Node, job_id: u32, node_name: Option<&str>) -> EpilogOutcome {
    run_with(
        node,
        &EpilogEnv {
            job_id,
            node_name: node_name.map(str::to_string),
            ..Default::default()
        },
    )
}

/// Runs the epilog: the steps below, in order, each a method of `Run`.
pub fn run_with(node: &Node, env: &EpilogEnv) -> EpilogOutcome {
    let job_id = env.job_id;
    let mut out = EpilogOutcome::default();
    // The job's end, for the audit line's and the report's wall time alike.
    let ended = chrono::Utc::now();
    let rec = match node.state.read_record(job_id) {
        Ok(r) => r,
        Err(e) => {
            out.errors.push(e.to_string());
            None
        }
    };
    let fence = match Fence::open(&node.cfg.bpffs_dir) {
        Ok(f) => Some(f),
        Err(e) => {
            out.notes.push(format!("no fence to revoke from: {e}"));
            None
        }
    };
    // 0. Under PrologFlags=RunInJob the Epilog runs in the job's
    //    step_extern/slurm: once the grant is revoked the job cgroup may
    //    open none of the job's GPUs, and NVML (which opens every GPU)
    //    could not prove them clean. It steps out into an exempt cgroup,
    //    as slurmd's Epilog runs in slurmd's exempt cgroup, until it
    //    returns ([`crate::job::injob`]).
    let _stepped_out = fence
        .as_ref()
        .and_then(|f| step_out_of_job(node, f, env, &mut out));
    // What an earlier, interrupted response left stopped is ended first.
    out.notes
        .extend(crate::response::engine::finish_interrupted(node));
    crashpoint::reached(crashpoint::EPILOG_STARTED);
    // 1. Revoke.
    if let Some(f) = &fence {
        match f.revoke_job(job_id) {
            Ok(gone) => out.revoked = gone,
            Err(e) => out
                .errors
                .push(format!("revoking job {job_id}'s grant: {e}")),
        }
    }
    crashpoint::reached(crashpoint::EPILOG_REVOKED);
    // 1b. gres/mps: the job's registrations go; a GPU's last MPS job stops
    //     its daemon, whose grant goes with it (crate::job::mps).
    let (released, mps_errors) = crate::job::mps::release(node, fence.as_ref(), job_id);
    out.errors.extend(mps_errors);
    for r in released.iter().filter(|r| r.stopped) {
        out.notes.push(format!(
            "MPS daemon {} stopped (the GPU's last MPS job){}",
            r.leaf,
            if r.killed.is_empty() {
                String::new()
            } else {
                format!("; killed {:?} left after quit", r.killed)
            }
        ));
    }
    let mut run = Run::new(node, env, rec, fence, ended, out);
    run.audit_revoked();
    crashpoint::reached(crashpoint::EPILOG_REVOKE_AUDITED);
    // 2. and 3. Who holds the job's devices; respond; look again.
    run.respond();
    // 4. Memory comes back.
    run.memory_back();
    crashpoint::reached(crashpoint::EPILOG_RESPONDED);
    run.remove_own_cgroup();
    run.restore_compute_modes();
    run.write_report();
    crashpoint::reached(crashpoint::EPILOG_CGROUP_REMOVED);
    // 5d. What the job left in the shared-memory directory.
    if let Some(r) = &run.rec {
        crate::job::leftovers::report(node, r, &mut run.out);
    }
    run.forget();
    crashpoint::reached(crashpoint::EPILOG_FORGOTTEN);
    run.drain_if_unclean();
    run.out
}

/// One Epilog run: what its steps share.
struct Run<'a> {
    node: &'a Node,
    env: &'a EpilogEnv,
    job_id: u32,
    node_name: Option<&'a str>,
    ended: chrono::DateTime<chrono::Utc>,
    rec: Option<JobRecord>,
    fence: Option<Fence>,
    /// The job's devices: its record's, and those its revoked entries named.
    devs: BTreeSet<DevNum>,
    gpu_major: u32,
    mig: Vec<gpufence_model::record::MigSlice>,
    /// The job's GPUs for NVML: its GRES devices on the nvidia major.
    minors: BTreeSet<u32>,
    gpus: Gpus,
    out: EpilogOutcome,
}

impl<'a> Run<'a> {
    fn new(
        node: &'a Node,
        env: &'a EpilogEnv,
        rec: Option<JobRecord>,
        fence: Option<Fence>,
        ended: chrono::DateTime<chrono::Utc>,
        out: EpilogOutcome,
    ) -> Self {
        let mut devs: BTreeSet<DevNum> = rec
            .iter()
            .flat_map(|r| r.devices.iter().map(|d| d.dev))
            .collect();
        devs.extend(out.revoked.iter().map(|e| e.dev));
        let gpu_major = node.gpu_major();
        let mig = rec.as_ref().map(|r| r.mig.clone()).unwrap_or_default();
        let gres_devs: BTreeSet<DevNum> = match &rec {
            Some(r) => r
                .devices
                .iter()
                .filter(|d| d.role == DeviceRole::Gres)
                .map(|d| d.dev)
                .collect(),
            None => devs.clone(),
        };
        let minors = gpu_minors(&gres_devs, gpu_major);
        let gpus = if minors.is_empty() {
            Gpus::none("the job has no NVIDIA GPU")
        } else {
            node.open_gpus()
        };
        Run {
            node,
            env,
            job_id: env.job_id,
            node_name: env.node_name.as_deref(),
            ended,
            rec,
            fence,
            devs,
            gpu_major,
            mig,
            minors,
            gpus,
            out,
        }
    }

    /// Step 1's audit line: `grant_revoked`, with the job's accounting.
    fn audit_revoked(&mut self) {
        let (node, job_id) = (self.node, self.job_id);
        if !self.out.revoked.is_empty() || self.rec.as_ref().is_some_and(|r| !r.devices.is_empty())
        {
            let cgroups: BTreeSet<u64> = self.out.revoked.iter().map(|e| e.cgroup_id).collect();
            let mut ev = AuditEvent::new(events::GRANT_REVOKED)
                .job(job_id)
                .devices(self.devs.iter())
                .field("cgroup_ids", cgroups.into_iter().collect::<Vec<_>>())
                .field("entries", self.out.revoked.len());
            if let Some(r) = &self.rec {
                ev =
                    accounting_fields(node, &self.gpus, r, &self.minors, ev.uid(r.uid), self.ended);
            }
            if let Err(e) = node.audit(ev) {
                self.out.errors.push(e.to_string());
            }
        }
    }

    /// Steps 2 and 3: who holds the job's devices, by descriptor and per
    /// the driver; the response; a look again (a holder may have handed
    /// its descriptor on while it handled SIGTERM): new holders get the
    /// same response, up to `response_rounds`; what is still there after
    /// that survives.
    fn respond(&mut self) {
        let info = match self.gpus.query(&self.minors) {
            Ok(i) => i,
            Err(e) => {
                self.out.errors.push(format!(
                    "NVML query failed, the job's GPUs cannot be shown clean: {e}"
                ));
                Vec::new()
            }
        };
        let (node, job_id, fence, devs, gpu_major, mig, gpus, minors) = (
            self.node,
            self.job_id,
            &self.fence,
            &self.devs,
            self.gpu_major,
            &self.mig,
            &self.gpus,
            &self.minors,
        );
        // The job's user: slurmd's SLURM_JOB_UID, or the record's.
        let job_uid = self.rec.as_ref().map(|r| r.uid).or(self.env.uid);
        let out = &mut self.out;
        let mut cands =
            respond::uncovered(node, job_id, fence.as_ref(), devs, &info, gpu_major, mig);
        let mut handled: BTreeSet<i32> = BTreeSet::new();
        let responded = !cands.is_empty();
        let mut budget = crate::response::evidence::Budget::from_config(&node.cfg);
        for round in 0..node.cfg.response_rounds.max(1) {
            let fresh: Vec<_> = cands
                .into_iter()
                .filter(|c| !handled.contains(&c.pid))
                .collect();
            if fresh.is_empty() {
                break;
            }
            if round > 0 {
                out.notes.push(format!(
                    "round {}: new holders {:?}",
                    round + 1,
                    fresh.iter().map(|c| c.pid).collect::<Vec<_>>()
                ));
            }
            let (lingering, errs) = respond::respond(
                node,
                job_id,
                job_uid,
                "epilog",
                "holds a device of an ended job outside any grant",
                fresh,
                &mut budget,
            );
            // Acted on: only those pinned (one that let go of the device
            // before it was stopped is looked for again like any other).
            handled.extend(lingering.iter().map(|l| l.pid));
            out.lingering.extend(lingering);
            out.errors.extend(errs);
            let again = gpus.query(minors).unwrap_or_default();
            cands = respond::uncovered(node, job_id, fence.as_ref(), devs, &again, gpu_major, mig);
        }
        if let Some(s) = budget.summary() {
            let _ = node.audit(
                AuditEvent::new("evidence_budget")
                    .job(job_id)
                    .field("phase", "epilog")
                    .field("executables_hashed", budget.hashed())
                    .field("hashes_left_out", budget.hashes_left_out)
                    .field("records_cut", budget.records_cut)
                    .field("records_left_out", budget.records_left_out),
            );
            out.notes.push(s);
        }
        if responded {
            let again = gpus.query(minors).unwrap_or_default();
            for c in respond::uncovered(node, job_id, fence.as_ref(), devs, &again, gpu_major, mig)
            {
                if out
                    .lingering
                    .iter()
                    .any(|l| l.pid == c.pid && l.spared.is_some())
                {
                    continue; // already a survivor, on purpose
                }
                out.survivors.push(format!(
                    "pid {} still holds {}",
                    c.pid,
                    c.devices
                        .iter()
                        .map(|d| d.to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                ));
            }
        }
    }

    /// Step 4: each job GPU's used memory comes back to its idle level; on
    /// a GPU shared with another job (another live grant covers it now, or
    /// did at job start: gres/shard, gres/mps) the level says nothing about
    /// this job, so there no process the driver lists (compute, graphics,
    /// MPS client) may keep memory outside every live grant and exemption.
    fn memory_back(&mut self) {
        let (node, rec, fence, gpus, minors, gpu_major) = (
            self.node,
            &self.rec,
            &self.fence,
            &self.gpus,
            &self.minors,
            self.gpu_major,
        );
        let out = &mut self.out;
        if gpus.available() && !minors.is_empty() {
            // The ending job's grant is revoked by now: all that is left
            // is other jobs'.
            let shared_now = super::granted_minors(fence.as_ref(), gpu_major, None);
            let shared_at_start: BTreeSet<u32> = rec
                .as_ref()
                .map(|r| {
                    r.gpu_idle
                        .iter()
                        .filter(|g| g.shared)
                        .map(|g| g.minor)
                        .collect()
                })
                .unwrap_or_default();
            let per_process: BTreeSet<u32> = minors
                .iter()
                .filter(|m| shared_now.contains(m) || shared_at_start.contains(m))
                .copied()
                .collect();
            let check: BTreeSet<u32> = minors.difference(&per_process).copied().collect();
            let idle = |minor: u32| -> u64 {
                rec.as_ref()
                    .and_then(|r| r.gpu_idle.iter().find(|g| g.minor == minor))
                    .map(|g| g.used_bytes)
                    .unwrap_or(node.cfg.idle_memory_mib << 20)
                    + (node.cfg.memory_tolerance_mib << 20)
            };
            // What the driver lists on the shared GPUs outside every grant:
            // (minor, pid, bytes).
            let outside = |info: &[crate::host::gpus::GpuInfo]| -> Vec<(u32, u32, u64)> {
                let me = std::process::id();
                info.iter()
                    .flat_map(|g| g.processes.iter().map(move |p| (g.minor, p)))
                    .filter(|(_, p)| p.pid != me && p.used_memory != Some(0))
                    .filter(|(m, p)| {
                        let pid = p.pid as i32;
                        !crate::holders::cover::covered(
                            node,
                            fence.as_ref(),
                            node.cg.cgroup_of(pid).ok().as_deref(),
                            crate::host::procs::uid_of(pid),
                            DevNum::new(gpu_major, *m),
                        )
                    })
                    .map(|(m, p)| (m, p.pid, p.used_memory.unwrap_or(0)))
                    .collect()
            };
            let deadline = Instant::now() + Duration::from_millis(node.cfg.memory_wait_ms);
            loop {
                let high = gpus.memory_used(&check).map(|used| {
                    used.into_iter()
                        .filter(|(m, u)| *u > idle(*m))
                        .collect::<Vec<(u32, u64)>>()
                });
                let left = if per_process.is_empty() {
                    Ok(Vec::new())
                } else {
                    gpus.query(&per_process).map(|info| outside(&info))
                };
                match (high, left) {
                    (Ok(high), Ok(left)) => {
                        if high.is_empty() && left.is_empty() {
                            break;
                        }
                        if Instant::now() >= deadline {
                            for (m, u) in high {
                                out.survivors.push(format!(
                                    "GPU /dev/nvidia{m} still has {} MiB in use (idle level {} MiB) after {} ms",
                                    u >> 20,
                                    idle(m) >> 20,
                                    node.cfg.memory_wait_ms
                                ));
                            }
                            for (m, pid, u) in left {
                                out.survivors.push(format!(
                                    "GPU /dev/nvidia{m} (shared with another job) still has {} MiB of pid {pid}, which no grant covers, after {} ms",
                                    u >> 20,
                                    node.cfg.memory_wait_ms
                                ));
                            }
                            break;
                        }
                    }
                    (Err(e), _) | (_, Err(e)) => {
                        out.errors.push(format!("NVML memory query failed: {e}"));
                        break;
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    /// Step 5, own layout: the job's cgroup goes with the job.
    fn remove_own_cgroup(&mut self) {
        let (node, job_id) = (self.node, self.job_id);
        let out = &mut self.out;
        if node.cfg.layout == Layout::Own {
            let job_cg = node.own_job_cgroup(job_id);
            if node.cg.path(&job_cg).exists() {
                let left = node.cg.procs_recursive(&job_cg);
                if !left.is_empty() {
                    out.notes.push(format!(
                        "killing {} leftover process(es) in /{job_cg}",
                        left.len()
                    ));
                    let _ = node.cg.kill(&job_cg);
                }
                let deadline = Instant::now() + Duration::from_millis(node.cfg.kill_wait_ms);
                loop {
                    match node.cg.remove_tree(&job_cg) {
                        Ok(()) => break,
                        Err(_) if Instant::now() < deadline => {
                            std::thread::sleep(Duration::from_millis(10))
                        }
                        Err(e) => {
                            out.errors.push(format!(
                                "{e} (processes left: {:?})",
                                node.cg.procs_recursive(&job_cg)
                            ));
                            break;
                        }
                    }
                }
            }
        }
    }

    /// Step 5b: compute modes changed for `--gpu-exclusive` go back, whatever the job's fate.
    fn restore_compute_modes(&mut self) {
        let (node, rec, gpus) = (self.node, &self.rec, &self.gpus);
        let out = &mut self.out;
        if let Some(r) = &rec {
            if !r.saved_compute_modes.is_empty() {
                let g = if gpus.available() {
                    None
                } else {
                    Some(node.open_gpus())
                };
                let gpus_ref = g.as_ref().unwrap_or(gpus);
                for (minor, old) in &r.saved_compute_modes {
                    match gpus_ref.swap_compute_mode(*minor, *old) {
                        Ok(_) => out.exclusive.push(format!(
                            "/dev/nvidia{minor}: exclusive-process during the job, mode {old} restored"
                        )),
                        Err(e) => out.errors.push(format!(
                            "restoring the compute mode of /dev/nvidia{minor}: {e}"
                        )),
                    }
                }
            }
        }
    }

    /// Step 5c: the user's report (`--gpufence-report`).
    fn write_report(&mut self) {
        let (node, job_id, node_name, ended, env, rec, gpus, minors) = (
            self.node,
            self.job_id,
            self.node_name,
            self.ended,
            self.env,
            &self.rec,
            &self.gpus,
            &self.minors,
        );
        let out = &mut self.out;
        if let Some(path) = &env.options.report {
            let uid_gid = rec.as_ref().map(|r| r.uid).or(env.uid).zip(env.gid);
            match (uid_gid, env.work_dir.as_ref()) {
                (Some((uid, gid)), Some(wd)) => {
                    let start = rec
                        .as_ref()
                        .and_then(|r| chrono::DateTime::parse_from_rfc3339(&r.created).ok());
                    let wall = start.map(|s| {
                        (ended.timestamp_micros() - s.timestamp_micros()).max(0) as f64 / 1e6
                    });
                    let denials = crate::host::denials::list(node)
                        .unwrap_or_default()
                        .into_iter()
                        .filter(|d| d.uid == uid)
                        .filter(|d| {
                            start.is_none_or(|s| {
                                chrono::DateTime::parse_from_rfc3339(&d.last_time)
                                    .is_ok_and(|t| t >= s)
                            })
                        })
                        .collect();
                    let accounting = match (&rec, start) {
                        (Some(_), Some(s)) if gpus.available() => gpus
                            .accounting(minors, s.timestamp_micros().max(0) as u64, chrono::Utc::now().timestamp_micros() as u64)
                            .unwrap_or_default()
                            .into_iter()
                            .map(|(m, procs)| {
                                let max = procs.iter().filter_map(|p| p.max_memory).max().unwrap_or(0);
                                let u: Vec<u32> = procs.iter().filter_map(|p| p.gpu_utilization).collect();
                                let avg = if u.is_empty() { 0.0 } else { u.iter().sum::<u32>() as f64 / u.len() as f64 };
                                format!("/dev/nvidia{m}: max memory {} MiB, average utilisation {avg:.0}% ({} processes)", max >> 20, procs.len())
                            })
                            .collect(),
                        _ => Vec::new(),
                    };
                    let text = crate::job::report::render(&crate::job::report::ReportData {
                        record: rec.as_ref(),
                        job_id,
                        node_name: node_name.unwrap_or("this node").to_string(),
                        denials,
                        lingering: &out.lingering,
                        wall_seconds: wall,
                        accounting,
                        exclusive: out.exclusive.clone(),
                    });
                    let target = gpufence_model::options::expand_report_path(
                        &path
                            .clone()
                            .unwrap_or_else(|| PathBuf::from(format!("gpufence-{job_id}.txt"))),
                        job_id,
                        node_name.unwrap_or("node"),
                    );
                    // The user's path, the user's problem: audited (the admin
                    // can tell the user why), never a drain.
                    let (event, note) = match crate::job::report::write_as_user(
                        node, job_id, &text, &target, wd, uid, gid,
                    ) {
                        Ok(p) => (
                            AuditEvent::new("report_written")
                                .field("path", p.display().to_string()),
                            format!("report written to {}", p.display()),
                        ),
                        Err(e) => (
                            AuditEvent::new("report_failed")
                                .field("path", target.display().to_string())
                                .field("error", e.to_string()),
                            format!("report not written: {e}"),
                        ),
                    };
                    let _ = node.audit(event.job(job_id).uid(uid));
                    out.notes.push(note);
                }
                _ => out.notes.push(
                    "report not written: the job's uid, gid or working directory is unknown".into(),
                ),
            }
        }
    }

    /// Step 6: forget the job, unless its grant is still in the fence.
    fn forget(&mut self) {
        let (node, job_id) = (self.node, self.job_id);
        let out = &mut self.out;
        if out.errors.iter().all(|e| !e.starts_with("revoking")) {
            if let Err(e) = node
                .state
                .remove_record(job_id)
                .and_then(|_| node.state.remove_applied(job_id))
            {
                out.errors.push(e.to_string());
            }
        }
    }

    /// Step 7: drain with a reason when the node is not clean.
    fn drain_if_unclean(&mut self) {
        let (node, job_id, node_name) = (self.node, self.job_id, self.node_name);
        let out = &mut self.out;
        if !out.clean() {
            let first = out
                .lingering
                .iter()
                .find(|l| !l.gone())
                .map(|l| {
                    format!(
                        "pid {} ({}) {} holding {}",
                        l.pid,
                        l.comm.clone().unwrap_or_default(),
                        if l.spared.is_some() {
                            "spared (system account)"
                        } else {
                            "survived SIGKILL"
                        },
                        l.devices
                            .iter()
                            .map(|d| d.to_string())
                            .collect::<Vec<_>>()
                            .join(",")
                    )
                })
                .or_else(|| out.survivors.first().cloned())
                .or_else(|| out.errors.first().cloned())
                .unwrap_or_default();
            let reason = format!("gpufence: job {job_id}: {first}");
            if node.cfg.drain {
                if let Some(name) = node_name {
                    match drain::drain(node, name, &reason) {
                        Ok(()) => out.notes.push(format!("node {name} drained: {reason}")),
                        Err(e) => out.errors.push(format!("could not drain {name}: {e}")),
                    }
                }
            }
            let _ = node.audit(
                AuditEvent::new(events::ERROR)
                    .job(job_id)
                    .field("component", "epilog")
                    .field("drain_reason", drain::clean_reason(&reason))
                    .field("survivors", out.survivors.clone())
                    .field("errors", out.errors.clone()),
            );
            out.drain_reason = Some(drain::clean_reason(&reason));
        }
    }
}
