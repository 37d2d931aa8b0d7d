//! The Epilog: revoke the job's grant, then prove nothing still holds the
//! job's devices.
//!
//! Order: revoke (nothing new can open them) → ask the driver (NVML) and the
//! descriptor tables who still holds them → respond to each process that no
//! live grant or exemption covers ([`crate::response::respond`]: freeze, evidence,
//! SIGTERM, SIGKILL, check) → look again → wait for each GPU's memory to come
//! back to its idle level → in the `own` layout, kill what is left in the
//! job's cgroup and remove it → forget the record → take the job out of
//! the job map ([`crate::job::jobmap`], when configured). Clean (exit 0) when
//! nothing survived and every step worked; otherwise exit non-zero and, when
//! configured, drain the node with a reason naming the job and the pid.
//!
//! Under `PrologFlags=RunInJob` (24.05+) the Epilog runs from the job's
//! extern slurmstepd inside the job cgroup: it first steps out into an
//! exempt cgroup ([`crate::job::injob::step_out`]), so that every check above
//! works as it does from slurmd's cgroup, and steps back before it exits.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use gpufence_cgroup::fence::{Fence, GrantEntry};

pub use crate::job::outcome::{EpilogError, EpilogOutcome, RevokeFailed, Survivor};
use gpufence_model::audit::{events, AuditEvent};
use gpufence_model::config::Layout;
use gpufence_model::device::{gpu_minors, DevNum};
use gpufence_model::record::JobRecord;

use crate::host::deadline::{Deadline, Wait};
use crate::host::gpus::{AccountedProcess, GpuError, Gpus};
use crate::job::grant::granted_minors;
use crate::response::respond::{self, Mode};
use crate::{crashpoint, host::drain, Node};

/// The job's accounting, computed once, for the `grant_revoked` line and
/// the user's report alike: from its record's creation to its end.
struct Accounting {
    /// The record's creation.
    start: chrono::DateTime<chrono::FixedOffset>,
    /// From `start` to the job's end, seconds.
    wall_seconds: f64,
    /// NVML's accounting of the processes started on the job's GPUs in
    /// that time, per GPU; `None` without NVML.
    per_gpu: Option<Result<PerGpu, GpuError>>,
}

/// NVML's accounting per GPU minor: the processes it kept.
type PerGpu = Vec<(u32, Vec<AccountedProcess>)>;

impl Accounting {
    /// The accounting of job `rec` on `minors`, up to `ended`; `None` when
    /// the record's creation time does not parse.
    fn of(
        rec: &JobRecord,
        gpus: &Gpus,
        minors: &BTreeSet<u32>,
        ended: chrono::DateTime<chrono::Utc>,
    ) -> Option<Accounting> {
        let start = chrono::DateTime::parse_from_rfc3339(&rec.created).ok()?;
        let wall_seconds =
            (ended.timestamp_micros() - start.timestamp_micros()).max(0) as f64 / 1e6;
        let per_gpu = gpus.available().then(|| {
            gpus.accounting(
                minors,
                start.timestamp_micros().max(0) as u64,
                ended.timestamp_micros().max(0) as u64,
            )
        });
        Some(Accounting {
            start,
            wall_seconds,
            per_gpu,
        })
    }

    /// Its fields of the `grant_revoked` line: wall time, GPU time over
    /// the job's `gres` GPUs, NVML's figures per GPU (or why there are
    /// none).
    fn fields(&self, gres: usize, ev: AuditEvent) -> AuditEvent {
        let wall = self.wall_seconds;
        let ev = ev
            .field("wall_seconds", (wall * 1000.0).round() / 1000.0)
            .field(
                "gpu_seconds",
                (wall * gres as f64 * 1000.0).round() / 1000.0,
            );
        match &self.per_gpu {
            Some(Ok(acc)) if !acc.is_empty() => {
                let per_gpu: Vec<serde_json::Value> = acc
                    .iter()
                    .map(|(minor, procs)| {
                        let max_mem = procs.iter().filter_map(|p| p.max_memory).max();
                        let utils: Vec<u32> =
                            procs.iter().filter_map(|p| p.gpu_utilization).collect();
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
            Some(Err(e)) => ev.field("accounting_error", e.to_string()),
            _ => ev,
        }
    }

    /// Its lines in the user's report, one per GPU.
    fn lines(&self) -> Vec<String> {
        let Some(Ok(acc)) = &self.per_gpu else {
            return Vec::new();
        };
        acc.iter()
            .map(|(m, procs)| {
                let max = procs.iter().filter_map(|p| p.max_memory).max().unwrap_or(0);
                let u: Vec<u32> = procs.iter().filter_map(|p| p.gpu_utilization).collect();
                let avg = if u.is_empty() {
                    0.0
                } else {
                    u.iter().sum::<u32>() as f64 / u.len() as f64
                };
                format!(
                    "/dev/nvidia{m}: max memory {} MiB, average utilisation {avg:.0}% ({} processes)",
                    max >> 20,
                    procs.len()
                )
            })
            .collect()
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
    let stepped = match crate::job::injob::locate_script(node, env.job_id, env.job_sluid.as_deref())
    {
        Ok(None) => return None,
        Ok(Some(_)) => {
            crate::job::injob::step_out(node, fence, "epilog").map_err(EpilogError::StepOut)
        }
        Err(e) => Err(EpilogError::LocateScript(e)),
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

/// Runs the epilog within its deadline ([`crate::job::timeouts::host_epilog_deadline`]):
/// every wait on its path is cut to what is left of it
/// ([`crate::host::deadline`]), and each cut is a note and one
/// `epilog_deadline` audit line.
pub fn run_with(node: &Node, env: &EpilogEnv) -> EpilogOutcome {
    let deadline = crate::job::timeouts::host_epilog_deadline(&node.cfg);
    let clock = std::sync::Arc::new(Deadline::new(Duration::from_millis(deadline.ms)));
    let node = node.with_deadline(clock.clone());
    let mut out = run_within(&node, env);
    say_cuts(&node, env.job_id, &deadline, &clock, &mut out);
    out
}

/// The waits `clock` cut, one note each, and one `epilog_deadline` audit
/// line with them all (none when nothing was cut).
fn say_cuts(
    node: &Node,
    job_id: u32,
    deadline: &crate::job::timeouts::EpilogDeadline,
    clock: &Deadline,
    out: &mut EpilogOutcome,
) {
    let lines = clock.lines();
    if lines.is_empty() {
        return;
    }
    let ev = AuditEvent::new(events::EPILOG_DEADLINE)
        .job(job_id)
        .field("deadline_ms", deadline.ms)
        .field("from", deadline.from.clone())
        .field(
            "elapsed_ms",
            clock.total().saturating_sub(clock.left()).as_millis() as u64,
        )
        .field("cut", lines.clone());
    if let Err(e) = node.audit(ev) {
        out.errors.push(EpilogError::Audit(e));
    }
    out.notes.extend(lines);
}

/// The epilog's steps, in order; from step 1's audit line on, each a
/// method of the run's read-only context (`Ctx`) that adds to the
/// outcome. Its waits are bound by the deadline `node` carries
/// ([`Node::with_deadline`]; none: each its own bound), and its cuts are
/// not said: [`run_with`] makes the deadline from the config and says
/// them. For a caller that keeps its own clock (a test of a deadline
/// spent before the Epilog starts).
pub fn run_within(node: &Node, env: &EpilogEnv) -> EpilogOutcome {
    let job_id = env.job_id;
    let mut out = EpilogOutcome::default();
    // The job's end, for the audit line's and the report's wall time and
    // accounting alike.
    let ended = chrono::Utc::now();
    let rec = match node.state.read_record(job_id) {
        Ok(r) => r,
        Err(e) => {
            out.errors.push(EpilogError::ReadRecord(e));
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
            Err(e) => {
                out.errors.push(EpilogError::Revoke(RevokeFailed {
                    job_id,
                    reason: e.to_string(),
                }));
            }
        }
    }
    crashpoint::reached(crashpoint::EPILOG_REVOKED);
    // 1b. gres/mps: the job's registrations go; a user's last MPS job on a
    //     GPU stops that user's daemon, whose grant goes with it
    //     (crate::job::mps).
    let (released, mps_errors) = crate::job::mps::release(node, fence.as_ref(), job_id);
    out.errors.extend(
        mps_errors
            .into_iter()
            .map(|(daemon, source)| EpilogError::Mps { daemon, source }),
    );
    for r in released.iter().filter(|r| r.stopped) {
        out.notes.push(format!(
            "MPS daemon {} stopped (its user's last MPS job on the GPU){}",
            r.leaf,
            if r.killed.is_empty() {
                String::new()
            } else {
                format!("; its grant revoked, then {:?} killed", r.killed)
            }
        ));
    }
    // A second Epilog of a job an earlier one ended (slurmd runs it again
    // when slurmctld resent TERMINATE_JOB after a lost EPILOG_COMPLETE:
    // SchedMD commit 2090c3af3b, ticket 24874, before 26.05). Another
    // user's job may hold the same GPUs by now: nothing of this job is
    // left to look at, so nothing is scanned, stopped, killed or drained.
    if rec.is_none() && out.revoked.is_empty() && released.is_empty() && out.errors.is_empty() {
        if let Some(at) = node.state.ended_at(job_id) {
            out.notes.push(format!(
                "job {job_id} was already ended at {at}: this Epilog (run again by slurmd) did nothing"
            ));
            if let Err(e) = node.audit(
                AuditEvent::new(events::EPILOG_REPEATED)
                    .job(job_id)
                    .field("ended_at", at),
            ) {
                out.errors.push(EpilogError::Audit(e));
            }
            return out;
        }
    }
    let cx = Ctx::new(node, env, rec, fence, ended, &out.revoked);
    cx.audit_revoked(&mut out);
    crashpoint::reached(crashpoint::EPILOG_REVOKE_AUDITED);
    // 2. and 3. Who holds the job's devices; respond; look again.
    cx.respond(&mut out);
    // 4. Memory comes back.
    cx.memory_back(&mut out);
    crashpoint::reached(crashpoint::EPILOG_RESPONDED);
    cx.remove_own_cgroup(&mut out);
    cx.restore_compute_modes(&mut out);
    cx.write_report(&mut out);
    crashpoint::reached(crashpoint::EPILOG_CGROUP_REMOVED);
    // 5d. What the job left in the shared-memory directory.
    if let Some(r) = &cx.rec {
        crate::job::leftovers::report(node, r, &mut out.errors, &mut out.notes);
    }
    cx.forget(&mut out);
    cx.leave_job_map(&mut out);
    crashpoint::reached(crashpoint::EPILOG_FORGOTTEN);
    cx.drain_if_unclean(&mut out);
    out
}

/// One Epilog run once the grant is revoked: what its steps read. Each
/// step adds to the [`EpilogOutcome`] it is given; none changes this.
struct Ctx<'a> {
    node: &'a Node,
    env: &'a EpilogEnv,
    job_id: u32,
    node_name: Option<&'a str>,
    rec: Option<JobRecord>,
    fence: Option<Fence>,
    /// The job's devices: its record's, and those its revoked entries named.
    devs: BTreeSet<DevNum>,
    gpu_major: u32,
    mig: Vec<gpufence_model::record::MigSlice>,
    /// The job's GPUs for NVML: its GRES devices on the nvidia major.
    minors: BTreeSet<u32>,
    gpus: Gpus,
    /// The job's accounting up to its end (taken once, when the Epilog
    /// started); `None` without a record.
    accounting: Option<Accounting>,
}

impl<'a> Ctx<'a> {
    fn new(
        node: &'a Node,
        env: &'a EpilogEnv,
        rec: Option<JobRecord>,
        fence: Option<Fence>,
        ended: chrono::DateTime<chrono::Utc>,
        revoked: &[GrantEntry],
    ) -> Self {
        let mut devs: BTreeSet<DevNum> = rec
            .iter()
            .flat_map(|r| r.devices.iter().map(|d| d.dev))
            .collect();
        // A major-wide entry (`major:*`, the IMEX channels' mknod) names
        // no device a process can hold; the channel granted beside it does.
        devs.extend(revoked.iter().map(|e| e.dev).filter(|d| !d.is_any_minor()));
        let gpu_major = node.gpu_major();
        let mig = rec.as_ref().map(|r| r.mig.clone()).unwrap_or_default();
        let minors = match &rec {
            Some(r) => r.gpu_minors(gpu_major),
            None => gpu_minors(&devs, gpu_major),
        };
        let gpus = if minors.is_empty() {
            Gpus::none("the job has no NVIDIA GPU")
        } else {
            node.open_gpus()
        };
        let accounting = rec
            .as_ref()
            .and_then(|r| Accounting::of(r, &gpus, &minors, ended));
        Ctx {
            node,
            env,
            job_id: env.job_id,
            node_name: env.node_name.as_deref(),
            rec,
            fence,
            devs,
            gpu_major,
            mig,
            minors,
            gpus,
            accounting,
        }
    }

    /// Step 1's audit line: `grant_revoked`, with the job's accounting.
    fn audit_revoked(&self, out: &mut EpilogOutcome) {
        let (node, job_id) = (self.node, self.job_id);
        if !out.revoked.is_empty() || self.rec.as_ref().is_some_and(|r| !r.devices.is_empty()) {
            let cgroups: BTreeSet<u64> = out.revoked.iter().map(|e| e.cgroup_id).collect();
            let mut ev = AuditEvent::new(events::GRANT_REVOKED)
                .job(job_id)
                .devices(self.devs.iter())
                .field("cgroup_ids", cgroups.into_iter().collect::<Vec<_>>())
                .field("entries", out.revoked.len());
            if let Some(r) = &self.rec {
                ev = ev.uid(r.uid);
                if let Some(a) = &self.accounting {
                    ev = a.fields(r.gres_indices.len(), ev);
                }
            }
            if let Err(e) = node.audit(ev) {
                out.errors.push(EpilogError::Audit(e));
            }
        }
    }

    /// Steps 2 and 3: who holds the job's devices, by descriptor and per
    /// the driver; the response; a look again (a holder may have handed
    /// its descriptor on while it handled SIGTERM): new holders get the
    /// same response, up to `response_rounds`; what is still there after
    /// that survives.
    fn respond(&self, out: &mut EpilogOutcome) {
        let info = match self.gpus.query(&self.minors) {
            Ok(i) => i,
            Err(e) => {
                let fails = self.node.nvml_failed(self.job_id, "NVML query", &e);
                let err = EpilogError::NvmlQuery(e);
                if fails {
                    out.errors.push(err);
                } else {
                    out.notes.push(format!(
                        "{err}; judged by the descriptor scan alone (nvml_failure = report)"
                    ));
                }
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
        // Processes not read whole (by the scan nor their re-read) that
        // gpufence does not end: each one drains the node, and is read
        // again once only (later looks leave it out).
        let mut not_read: BTreeMap<i32, respond::NotRead> = BTreeMap::new();
        let mut look = |info: &[crate::host::gpus::GpuInfo]| {
            let before: BTreeSet<i32> = not_read.keys().copied().collect();
            let sought = respond::Sought {
                fence: fence.as_ref(),
                devs,
                gpu_info: info,
                gpu_major,
                mig,
            };
            let u = respond::uncovered_except(node, job_id, job_uid, &sought, &before);
            for n in u.not_read {
                not_read.entry(n.pid).or_insert(n);
            }
            u.candidates
        };
        let mut cands = look(&info);
        let mut handled: BTreeSet<i32> = BTreeSet::new();
        let responded = !cands.is_empty();
        let mut budget = crate::response::evidence::Budget::for_node(node);
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
                &respond::Responder {
                    node,
                    job_id,
                    job_uid,
                    phase: "epilog",
                },
                Mode::End,
                "holds a device of an ended job outside any grant",
                fresh,
                &mut budget,
            );
            // Acted on: only those pinned (one that let go of the device
            // before it was stopped is looked for again like any other).
            handled.extend(lingering.iter().map(|l| l.pid));
            out.lingering.extend(lingering);
            out.errors
                .extend(errs.into_iter().map(EpilogError::Response));
            let again = gpus.query(minors).unwrap_or_default();
            cands = look(&again);
        }
        if let Some(s) = budget.summary() {
            let _ = node.audit(
                AuditEvent::new(events::EVIDENCE_BUDGET)
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
            for c in look(&again) {
                if out
                    .lingering
                    .iter()
                    .any(|l| l.pid == c.pid && l.spared.is_some())
                {
                    continue; // already a survivor, on purpose
                }
                out.survivors.push(Survivor::StillHolds {
                    pid: c.pid,
                    devices: c.devices.iter().copied().collect(),
                });
            }
        }
        // Past the budget, the GPU is never handed on uncertified.
        out.survivors
            .extend(not_read.into_values().map(Survivor::NotRead));
    }

    /// Step 4: each job GPU's used memory comes back to its idle level; on
    /// a GPU shared with another job (another live grant covers it now, or
    /// did at job start: gres/shard, gres/mps) the level says nothing about
    /// this job, so there no process the driver lists (compute, graphics,
    /// MPS client) may keep memory outside every live grant and exemption.
    fn memory_back(&self, out: &mut EpilogOutcome) {
        let (node, rec, fence, gpus, minors, gpu_major) = (
            self.node,
            &self.rec,
            &self.fence,
            &self.gpus,
            &self.minors,
            self.gpu_major,
        );
        if gpus.available() && !minors.is_empty() {
            // The ending job's grant is revoked by now: all that is left
            // is other jobs'.
            let shared_now = granted_minors(fence.as_ref(), gpu_major, None);
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
            let wait = node.bound(
                Wait::MemoryWait,
                Duration::from_millis(node.cfg.memory_wait_ms),
            );
            let deadline = Instant::now() + wait;
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
                                out.survivors.push(Survivor::MemoryInUse {
                                    minor: m,
                                    used_mib: u >> 20,
                                    idle_mib: idle(m) >> 20,
                                    waited_ms: wait.as_millis(),
                                });
                            }
                            for (m, pid, u) in left {
                                out.survivors.push(Survivor::SharedMemory {
                                    minor: m,
                                    pid,
                                    mib: u >> 20,
                                    waited_ms: wait.as_millis(),
                                });
                            }
                            break;
                        }
                    }
                    (Err(e), _) | (_, Err(e)) => {
                        let fails = node.nvml_failed(self.job_id, "NVML memory query", &e);
                        let err = EpilogError::NvmlMemory(e);
                        if fails {
                            out.errors.push(err);
                        } else {
                            out.notes.push(format!("{err} (nvml_failure = report)"));
                        }
                        break;
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    /// Step 5, own layout: the job's cgroup goes with the job.
    fn remove_own_cgroup(&self, out: &mut EpilogOutcome) {
        let (node, job_id) = (self.node, self.job_id);
        if node.cfg.layout == Layout::Own {
            let job_cg = node.own_job_cgroup(job_id);
            if node.cg.path(&job_cg).exists() {
                let left = node.cg.procs_recursive(&job_cg);
                if !left.is_empty() {
                    out.notes.push(format!(
                        "killing {} leftover process(es) in /{job_cg}",
                        left.len()
                    ));
                }
                let wait = node.bound(
                    Wait::LeftoverKill,
                    Duration::from_millis(node.cfg.kill_wait_ms),
                );
                if let Err(e) = node.cg.kill_and_remove(&job_cg, wait) {
                    out.errors.push(EpilogError::OwnCgroup {
                        source: e.into(),
                        left: node.cg.procs_recursive(&job_cg),
                    });
                }
            }
        }
    }

    /// Step 5b: compute modes changed for `--gpu-exclusive` go back, whatever the job's fate.
    fn restore_compute_modes(&self, out: &mut EpilogOutcome) {
        let (node, rec, gpus) = (self.node, &self.rec, &self.gpus);
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
                        Err(e) => out.errors.push(EpilogError::ComputeMode {
                            minor: *minor,
                            source: e,
                        }),
                    }
                }
            }
        }
    }

    /// Step 5c: the user's report (`--gpufence-report`).
    fn write_report(&self, out: &mut EpilogOutcome) {
        let (node, job_id, node_name, env, rec) =
            (self.node, self.job_id, self.node_name, self.env, &self.rec);
        if let Some(path) = &env.options.report {
            let uid_gid = rec.as_ref().map(|r| r.uid).or(env.uid).zip(env.gid);
            match (uid_gid, env.work_dir.as_ref()) {
                (Some((uid, gid)), Some(wd)) => {
                    let start = self.accounting.as_ref().map(|a| a.start);
                    let wall = self.accounting.as_ref().map(|a| a.wall_seconds);
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
                    let accounting = self
                        .accounting
                        .as_ref()
                        .map(Accounting::lines)
                        .unwrap_or_default();
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
                            AuditEvent::new(events::REPORT_WRITTEN)
                                .field("path", p.display().to_string()),
                            format!("report written to {}", p.display()),
                        ),
                        Err(e) => (
                            AuditEvent::new(events::REPORT_FAILED)
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
    fn forget(&self, out: &mut EpilogOutcome) {
        let (node, job_id) = (self.node, self.job_id);
        if out.revoke_failed().is_none() {
            if let Err(e) = node
                .state
                .remove_record(job_id)
                .and_then(|_| node.state.remove_applied(job_id))
                .and_then(|_| {
                    node.state
                        .write_ended(job_id, &gpufence_model::record::now_rfc3339())
                })
            {
                out.errors.push(EpilogError::Forget(e));
            }
        }
    }

    /// Step 6b: the job map (`job_map_dir`) rewritten without the job, from
    /// the other jobs' records: no NVML is needed ([`crate::job::jobmap`]).
    /// A failure is a note and an `error` line, never a drain (the map is
    /// for monitoring).
    fn leave_job_map(&self, out: &mut EpilogOutcome) {
        let (node, job_id) = (self.node, self.job_id);
        if let Err(e) = crate::job::jobmap::sync(node, Some(job_id)) {
            let reason = format!("{e}; the job map may still list job {job_id}");
            let _ = node.audit(
                AuditEvent::new(events::ERROR)
                    .job(job_id)
                    .field("phase", "epilog")
                    .field("reason", reason.clone()),
            );
            out.notes.push(reason);
        }
    }

    /// Step 7: drain with a reason when the node is not clean.
    fn drain_if_unclean(&self, out: &mut EpilogOutcome) {
        let (node, job_id, node_name) = (self.node, self.job_id, self.node_name);
        if !out.clean() {
            let kill_cut = node
                .deadline()
                .is_some_and(|d| crate::host::deadline::kill_cut(&d.cuts()));
            let reason = format!("gpufence: job {job_id}: {}", out.drain_cause(kill_cut));
            if node.cfg.drain {
                if let Some(name) = node_name {
                    // The record lets `gpufence sweep` (resume_when_clean)
                    // resume the node once these devices' holders are gone.
                    let cause = drain::Cause {
                        job_id: Some(job_id),
                        devices: out
                            .lingering
                            .iter()
                            .filter(|l| !l.gone())
                            .flat_map(|l| l.devices.iter().map(|d| d.to_string()))
                            .collect::<BTreeSet<_>>()
                            .into_iter()
                            .collect(),
                    };
                    match drain::drain_for(node, name, &reason, &cause) {
                        Ok(()) => out.notes.push(format!("node {name} drained: {reason}")),
                        Err(e) => out.errors.push(EpilogError::Drain {
                            node: name.to_string(),
                            source: e,
                        }),
                    }
                }
            }
            let _ = node.audit(
                AuditEvent::new(events::ERROR)
                    .job(job_id)
                    .field("component", "epilog")
                    .field("drain_reason", drain::clean_reason(&reason))
                    .field(
                        "survivors",
                        out.survivors
                            .iter()
                            .map(ToString::to_string)
                            .collect::<Vec<_>>(),
                    )
                    .field(
                        "errors",
                        out.errors
                            .iter()
                            .map(ToString::to_string)
                            .collect::<Vec<_>>(),
                    ),
            );
            out.drain_reason = Some(drain::clean_reason(&reason));
        }
    }
}
