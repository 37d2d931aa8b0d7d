//! The Prolog: record what Slurm allocated to a job.
//!
//! Runs as slurmd's Prolog, before the job cgroup exists; or, with
//! `PrologFlags=RunInJob` (24.05+), from the job's extern slurmstepd inside
//! the job cgroup, which it then grants itself ([`run_with_sluid`],
//! [`crate::job::injob`]). Its only inputs are the variables slurmd or
//! slurmstepd sets (trusted), slurmd's GRES list and its own cgroup (the
//! kernel's); nothing the job's user controls.

use std::collections::BTreeSet;

use gpufence_cgroup::fence::Fence;
use gpufence_model::audit::{events, AuditEvent};
use gpufence_model::device::DeviceRole;
use gpufence_model::record::{GpuIdle, JobRecord};

use crate::host::fence_ops::open_installed;
use crate::host::gpus::Gpus;
use crate::job::grant::granted_minors;
use crate::response::respond::{self, Mode};
use crate::{crashpoint, response::evidence};
use crate::{Node, NodeError};

mod env;
mod mig;
mod record;

pub use env::{env_u32, PrologEnv};
pub use mig::{read_mig_minors, MIG_MINORS};
pub use record::{build_record, SLURMCTLD_TIMEOUT};

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
            node.cg
                .kill_and_remove(&cg, std::time::Duration::from_millis(node.cfg.kill_wait_ms))?;
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
