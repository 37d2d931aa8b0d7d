//! Applying a job's record to the fence for its cgroup: what the SPANK
//! plugin does in `slurm_spank_init` in slurmstepd (remote context), after
//! Slurm made the job cgroup and before any task exists.
//!
//! Inputs are spank items from slurmstepd (job id, step id, uid) and
//! slurmstepd's own pid: nothing from the job's environment or options.

use gpufence_model::audit::{events, AuditEvent};
use gpufence_model::config::Layout;
use gpufence_model::record::{now_rfc3339, AppliedGrant, JobRecord};

use gpufence_cgroup::Fence;

use crate::host::fence_ops::open_installed;
use crate::host::slurm_cgroup::find_job_cgroup;
use crate::{crashpoint, is_under, join_cgroup, Node, NodeError};

/// The extern step's id (`SLURM_EXTERN_CONT`, `slurm.h`): the step
/// pam_slurm_adopt puts ssh sessions in, and where the Prolog and Epilog
/// run under `PrologFlags=RunInJob`.
pub const EXTERN_STEP_ID: u32 = 0xffff_fffc;

/// Slurm's special step ids (`slurm.h`: `SLURM_EXTERN_CONT`, `SLURM_BATCH_SCRIPT`,
/// `SLURM_INTERACTIVE_STEP`).
pub fn step_name(step_id: u32) -> String {
    match step_id {
        EXTERN_STEP_ID => "extern".into(),
        0xffff_fffb => "batch".into(),
        0xffff_fffa => "interactive".into(),
        n => n.to_string(),
    }
}

/// `job J step S`: how every line about a step names it, the step by
/// [`step_name`] (`job 7 step extern`, never `job 7 step 4294967292`).
pub fn step_label(req: &StepRequest) -> String {
    format!("job {} step {}", req.job_id, step_name(req.step_id))
}

/// The plugin's log line when the step's job cgroup got its devices:
/// `job J step S: N device(s) granted to /CGROUP (job cgroup DIR)`.
pub fn granted_line(req: &StepRequest, devices: usize, cgroup_path: &str, job_dir: &str) -> String {
    format!(
        "{}: {devices} device(s) granted to /{cgroup_path} (job cgroup {job_dir})",
        step_label(req)
    )
}

/// The line (log and user) refusing a step when the plugin cannot load its
/// configuration: `gpufence: job J step S refused on NODE: ERROR`.
pub fn load_refused_line(
    req: &StepRequest,
    node_name: &str,
    error: &dyn std::fmt::Display,
) -> String {
    format!(
        "gpufence: {} refused on {node_name}: {error}",
        step_label(req)
    )
}

/// A note of the job's record for the user, as the step prints it:
/// `gpufence: job J step S: NOTE`.
pub fn user_note_line(req: &StepRequest, note: &str) -> String {
    format!("gpufence: {}: {note}", step_label(req))
}

/// The plugin's log line for the extern step that finds no record under
/// `PrologFlags=RunInJob` ([`no_record_expected`]).
pub fn run_in_job_no_record_line(req: &StepRequest) -> String {
    format!(
        "{}: no record yet (PrologFlags=RunInJob: the Prolog runs after this \
         step started and grants the job cgroup itself)",
        step_label(req)
    )
}

/// What the plugin knows about the step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepRequest {
    /// `S_JOB_ID`.
    pub job_id: u32,
    /// `S_JOB_STEPID`.
    pub step_id: u32,
    /// `S_JOB_UID`.
    pub uid: u32,
    /// slurmstepd's pid (`getpid()` in the plugin).
    pub stepd_pid: i32,
}

/// What happened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GrantOutcome {
    /// The job's devices are granted to `cgroup_path`.
    Granted {
        /// The job cgroup.
        cgroup_path: String,
        /// Its id.
        cgroup_id: u64,
        /// How many devices.
        devices: usize,
        /// What the Prolog noted for the user (a `--gpu-exclusive` that
        /// could not be set, an MPS daemon that did not start): the plugin
        /// prints these in the job's output.
        user_notes: Vec<String>,
        /// Variables the plugin sets in the step's tasks, from the record
        /// (never from the job's own environment):
        /// `CUDA_MPS_PIPE_DIRECTORY` for a gres/mps job ([`job_env`]).
        job_env: Vec<(String, String)>,
    },
    /// The job has a record without GPUs: nothing to grant.
    NoGpus,
    /// No record: the prolog did not run for this job. The step runs
    /// without GPU access.
    NoRecord,
}

/// A step's job cgroup, as [`locate`] found or made it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobCgroup {
    /// The job cgroup, relative to the cgroup2 mount.
    pub path: String,
    /// Its name, for logs: `job_<id>`, or in the `slurm` layout on Slurm
    /// 26.05 the job's SLUID (`s7C5M8ST6RSJ00`).
    pub dir: String,
}

/// Finds (slurm layout) or makes and enters (own layout) the job cgroup.
///
/// - `own`: `<cgroup_root>/job_<id>`, with slurmstepd moved into its
///   `step_<step>`.
/// - `slurm`: from slurmstepd's own cgroup (`/proc/<pid>/cgroup`, where
///   Slurm put it), [`find_job_cgroup`]: `<scope>/<job_<id> or SLUID>/step_<step>/slurm`
///   (Slurm's cgroup/v2 plugin, `src/plugins/cgroup/v2/cgroup_v2.c`); the
///   job cgroup must lie under `cgroup_root`.
///
/// # Errors
/// [`NodeError::NoJobCgroup`] when there is no job cgroup (the message says
/// which cgroup slurmstepd is in and the two reasons: Slurm's cgroup/v2
/// plugin without proctrack/cgroup, or a cgroup v1/hybrid host that wants
/// `layout = "own"`), [`NodeError::OutsideFence`] when it lies outside
/// the fenced subtree, [`NodeError::MoveStepd`] when slurmstepd cannot be
/// moved; [`NodeError::Kernel`] when slurmstepd's
/// cgroup cannot be read or the own layout's cgroup cannot be made.
pub fn locate(node: &Node, req: &StepRequest) -> Result<JobCgroup, NodeError> {
    let step = step_name(req.step_id);
    match node.cfg.layout {
        Layout::Own => {
            let dir = format!("job_{}", req.job_id);
            let job = node.own_job_cgroup(req.job_id);
            let step_cg = join_cgroup(&job, &format!("step_{step}"));
            node.cg.create(&step_cg)?;
            node.cg
                .move_pid(&step_cg, req.stepd_pid)
                .map_err(|e| NodeError::MoveStepd {
                    pid: req.stepd_pid,
                    cgroup: step_cg.clone(),
                    source: Box::new(e),
                })?;
            Ok(JobCgroup { path: job, dir })
        }
        Layout::Slurm => {
            let own = node.cg.cgroup_of(req.stepd_pid)?;
            let job =
                find_job_cgroup(&own, req.job_id, &step).ok_or_else(|| NodeError::NoJobCgroup {
                    job_id: req.job_id,
                    step: step.clone(),
                    pid: req.stepd_pid,
                    cgroup: crate::host::cgpath::abs(&own),
                })?;
            fenced(node, &job.path)?;
            Ok(JobCgroup {
                path: job.path,
                dir: job.dir,
            })
        }
    }
}

/// Whether job cgroup `job` lies in the fenced subtree (`cgroup_root`).
///
/// # Errors
/// [`NodeError::OutsideFence`] when it does not: a grant there would guard
/// nothing, and the job's tasks would not be under the fence.
pub(crate) fn fenced(node: &Node, job: &str) -> Result<(), NodeError> {
    let root = &node.cfg.cgroup_root;
    if is_under(job, root) {
        return Ok(());
    }
    Err(NodeError::OutsideFence {
        job: crate::host::cgpath::abs(job),
        root: crate::host::cgpath::abs(root),
    })
}

/// Where a step's grant goes: the fence is installed and the job cgroup is
/// known (and, in the `own` layout, slurmstepd is in it).
#[derive(Debug)]
pub struct Placement {
    fence: Fence,
    /// The job cgroup, relative to the cgroup2 mount.
    pub job_cgroup: String,
    /// Its name, for logs: `job_<id>` or (slurm layout, Slurm 26.05) the
    /// job's SLUID.
    pub job_dir: String,
}

/// First half of [`grant_step`]: checks the fence and places the step.
///
/// # Errors
/// [`NodeError::FenceMissing`], [`NodeError::NoJobCgroup`],
/// [`NodeError::OutsideFence`], [`NodeError::MoveStepd`],
/// [`NodeError::ExemptAncestor`], [`NodeError::Kernel`].
/// The step must not run: its tasks would not be under the fence's control
/// (no fence) or could land in slurmd's (possibly exempt) cgroup.
pub fn place(node: &Node, req: &StepRequest) -> Result<Placement, NodeError> {
    let fence = open_installed(node)?;
    let job = locate(node, req)?;
    refuse_exempt_ancestor(node, &fence, &job.path)?;
    crashpoint::reached(crashpoint::GRANT_PLACED);
    Ok(Placement {
        fence,
        job_cgroup: job.path,
        job_dir: job.dir,
    })
}

/// An exempt cgroup that is the job cgroup or one of its ancestors lets
/// every process of the job open every NVIDIA device, whatever Slurm
/// allocated (a misconfigured `exempt_cgroups` naming `system.slice`, or
/// Slurm's scope): the step is refused, with the line that says which
/// exemption to remove.
///
/// # Errors
/// [`NodeError::ExemptAncestor`] naming the exempt cgroup; [`NodeError::Kernel`]
/// when the fence's flags cannot be read.
fn refuse_exempt_ancestor(node: &Node, fence: &Fence, job: &str) -> Result<(), NodeError> {
    for (path, id) in node.cg.ancestry(job) {
        if fence.is_exempt(id)? {
            return Err(NodeError::ExemptAncestor {
                job: crate::host::cgpath::abs(job),
                exempt: crate::host::cgpath::abs(&path),
                path,
                config: match &node.origin {
                    gpufence_model::config::ConfigOrigin::File(p) => p.display().to_string(),
                    gpufence_model::config::ConfigOrigin::Defaults => {
                        gpufence_model::config::DEFAULT_CONFIG_PATH.to_string()
                    }
                },
            });
        }
    }
    Ok(())
}

/// Second half of [`grant_step`]: grants the job's record to the placed step.
///
/// Granting a job cgroup that already holds the job's grant (the Prolog
/// applied it under `PrologFlags=RunInJob`, [`grant_in_prolog`], or an
/// earlier step did) is harmless: the same `grant_applied` line again,
/// this step's note replaces the earlier one for that cgroup
/// (`applied/<job>-<cgroup id>.json`), and [`Fence::grant`] writes the
/// same map values again (`BPF_ANY` updates of existing keys, the
/// cgroup's flags ORed with GRANTED at the same level).
///
/// # Errors
/// [`NodeError`] for a corrupt or foreign record, an unwritable audit log,
/// or a full map. The step is fenced without a grant: it may run, with no
/// GPU access.
pub fn grant_placed(
    node: &Node,
    req: &StepRequest,
    placement: &Placement,
) -> Result<GrantOutcome, NodeError> {
    grant_at(node, req, &placement.fence, &placement.job_cgroup, None)
}

/// [`grant_placed`] by the Prolog under `PrologFlags=RunInJob` ([`crate::job::injob`]):
/// the record just written goes to `job_cgroup` (the job cgroup the
/// Prolog's own cgroup is in, [`crate::job::injob::locate_script`]), as the
/// extern step's. The `grant_applied` line is the one [`grant_placed`] writes
/// (`step` is `req`'s, `pid` the Prolog's), with `"phase": "prolog"`.
///
/// # Errors
/// As [`grant_placed`].
pub fn grant_in_prolog(
    node: &Node,
    req: &StepRequest,
    fence: &Fence,
    job_cgroup: &str,
) -> Result<GrantOutcome, NodeError> {
    grant_at(node, req, fence, job_cgroup, Some("prolog"))
}

fn grant_at(
    node: &Node,
    req: &StepRequest,
    fence: &Fence,
    job: &str,
    phase: Option<&'static str>,
) -> Result<GrantOutcome, NodeError> {
    let Some(rec) = node.state.read_record(req.job_id)? else {
        return Ok(GrantOutcome::NoRecord);
    };
    if rec.uid != req.uid {
        return Err(NodeError::RecordMismatch {
            job_id: req.job_id,
            path: node.state.record_path(req.job_id),
            record_uid: rec.uid,
            step_uid: req.uid,
        });
    }
    if rec.devices.is_empty() {
        return Ok(GrantOutcome::NoGpus);
    }
    let cgroup_id = node.cg.id(job)?;
    // The level the fence records the grant at, the kernel's (in a cgroup
    // namespace, the namespace root's level plus the path's depth): known
    // before the audit line says the grant is applied, or no grant at all.
    let level = node.cg.kernel_level(job)?;
    let devs: Vec<_> = rec.devices.iter().map(|d| (d.dev, d.access)).collect();
    let step = step_name(req.step_id);
    let mut ev = AuditEvent::new(events::GRANT_APPLIED)
        .job(req.job_id)
        .uid(req.uid)
        .pid(req.stepd_pid)
        .devices(&rec.devices)
        .field("cgroup", crate::host::cgpath::abs(job))
        .field("cgroup_id", cgroup_id)
        .field("cgroup_level", level)
        .field("step", step.clone());
    if let Some(phase) = phase {
        ev = ev.field("phase", phase);
    }
    // Recorded before it takes effect: no grant without its audit line.
    node.audit(ev)?;
    crashpoint::reached(crashpoint::GRANT_AUDITED);
    node.state.write_applied(&AppliedGrant {
        job_id: req.job_id,
        step,
        cgroup_id,
        cgroup_path: job.to_string(),
        applied: now_rfc3339(),
    })?;
    crashpoint::reached(crashpoint::GRANT_NOTED);
    // At the job cgroup's kernel level: in a cgroup namespace (slurmd in
    // a container) its path counts from the namespace's root, the fence
    // program's walk from the hierarchy's.
    fence.grant_in(&node.cg, cgroup_id, job, req.job_id, &devs)?;
    crashpoint::reached(crashpoint::GRANT_GRANTED);
    drop_predecessors(node, req, fence, cgroup_id);
    Ok(GrantOutcome::Granted {
        cgroup_path: job.to_string(),
        cgroup_id,
        devices: devs.len(),
        user_notes: rec.user_notes.clone(),
        job_env: job_env(&rec),
    })
}

/// The variables a step of job `rec` gets in its tasks: for a gres/mps
/// job whose MPS daemon gpufence runs, `CUDA_MPS_PIPE_DIRECTORY` (its
/// user's daemon on its first GPU: one client connects to one daemon; Slurm gives a job MPS on
/// one GPU unless `MULTIPLE_SHARING_GRES_PJ` is set). Slurm itself sets no
/// `CUDA_MPS_*` variable but the thread percentage
/// (`src/plugins/gres/mps/gres_mps.c`).
pub fn job_env(rec: &JobRecord) -> Vec<(String, String)> {
    rec.mps
        .first()
        .map(|d| {
            vec![(
                "CUDA_MPS_PIPE_DIRECTORY".to_string(),
                d.pipe_dir.display().to_string(),
            )]
        })
        .unwrap_or_default()
}

/// Removes the grants of `req`'s job keyed by its earlier job cgroups.
///
/// Slurm removes a job cgroup with the job's last step
/// (`cgroup_p_step_destroy`, `src/plugins/cgroup/v2/cgroup_v2.c`, all
/// releases) and makes a new one, with a new cgroup id, for the next step
/// of a job that has no extern or batch step holding it. A job has one job
/// cgroup at a time (its directory is named by the job id or SLUID), so the
/// job's grants keyed by any other id belong to predecessors that are gone:
/// they are removed (a `grant_revoked` line with `reason`), so that no
/// later cgroup given a recycled id could ever inherit them. A failure to
/// remove them is an `error` line; the step keeps its own grant (the stale
/// entries name no live cgroup, and the Epilog revokes every grant of the
/// job).
fn drop_predecessors(node: &Node, req: &StepRequest, fence: &Fence, keep: u64) {
    // Every grant is noted in `applied/` before it is made: when the only
    // note of the job is this cgroup's, no predecessor holds a grant, and
    // the walk of the whole `grants` map is spared.
    let (applied, unreadable) = node.state.applied(Some(req.job_id));
    if unreadable.is_empty() && applied.iter().all(|a| a.cgroup_id == keep) {
        return;
    }
    match fence.revoke_job_except(req.job_id, keep) {
        Ok(gone) if gone.is_empty() => {}
        Ok(gone) => {
            let ids: std::collections::BTreeSet<u64> = gone.iter().map(|e| e.cgroup_id).collect();
            let _ = node.audit(
                AuditEvent::new(events::GRANT_REVOKED)
                    .job(req.job_id)
                    .uid(req.uid)
                    .pid(req.stepd_pid)
                    .field("cgroup_ids", ids.into_iter().collect::<Vec<_>>())
                    .field("entries", gone.len())
                    .field("kept_cgroup_id", keep)
                    .field("step", step_name(req.step_id))
                    .field(
                        "reason",
                        "Slurm made a new job cgroup for this step: the grants of the job's earlier, removed job cgroups",
                    ),
            );
        }
        Err(e) => {
            let _ = node.audit(
                AuditEvent::new(events::ERROR)
                    .job(req.job_id)
                    .pid(req.stepd_pid)
                    .field("step", step_name(req.step_id))
                    .field(
                        "reason",
                        format!("cannot remove the grants of the job's earlier job cgroups: {e}"),
                    ),
            );
        }
    }
}

/// What one step's grant came to ([`grant_step`]).
#[derive(Debug)]
pub struct StepGrant {
    /// The step's fate, with the user's line when it is not a plain run
    /// (logged as an error by the plugin, printed on task 0's stderr).
    pub fate: StepFate,
    /// The plugin's verbose log line: what was granted
    /// ([`granted_line`]), or the extern step that has no record yet under
    /// `PrologFlags=RunInJob` ([`run_in_job_no_record_line`]).
    pub note: Option<String>,
    /// Lines for the job's output (task 0's stderr), from the record's
    /// notes for the user ([`user_note_line`]).
    pub user_notes: Vec<String>,
    /// Variables for the tasks' environment ([`job_env`]).
    pub job_env: Vec<(String, String)>,
    /// What [`place`] then [`grant_placed`] returned: the placement's error, or
    /// the grant's outcome.
    pub outcome: Result<GrantOutcome, NodeError>,
    /// The job cgroup the step was placed in (relative to the mount),
    /// when it was: where later grants of the step go (its IMEX channel,
    /// [`crate::job::imex`]).
    pub job_cgroup: Option<String>,
}

/// The grant step of one slurmstepd, whole: [`place`], [`grant_placed`], the
/// [`step_fate`] (and its `grant_refused` line), the log line and the
/// user's lines. What the plugin's `slurm_spank_init` runs in slurmstepd,
/// and what the tests and `gpufence-probe apply` call. `node_name` is for
/// the user's line; `run_in_job` says whether slurm.conf has
/// `PrologFlags=RunInJob`, asked only for an extern step that found no
/// record ([`no_record_expected`]).
pub fn grant_step(
    node: &Node,
    req: &StepRequest,
    node_name: &str,
    run_in_job: impl FnOnce() -> bool,
) -> StepGrant {
    let placed = place(node, req);
    let granted = placed.as_ref().ok().map(|p| grant_placed(node, req, p));
    let mut note = None;
    let (mut user_notes, mut env) = (Vec::new(), Vec::new());
    if let (
        Ok(p),
        Some(Ok(GrantOutcome::Granted {
            cgroup_path,
            devices,
            user_notes: notes,
            job_env,
            ..
        })),
    ) = (&placed, &granted)
    {
        user_notes = notes.iter().map(|n| user_note_line(req, n)).collect();
        env = job_env.clone();
        note = Some(granted_line(req, *devices, cgroup_path, &p.job_dir));
    }
    let run_in_job = matches!(granted, Some(Ok(GrantOutcome::NoRecord)))
        && no_record_expected(req, req.step_id == EXTERN_STEP_ID && run_in_job());
    let fate = step_fate(node, req, node_name, &placed, granted.as_ref(), run_in_job);
    if run_in_job && fate == StepFate::Run {
        note = Some(run_in_job_no_record_line(req));
    }
    StepGrant {
        fate,
        note,
        user_notes,
        job_env: env,
        job_cgroup: placed.as_ref().ok().map(|p| p.job_cgroup.clone()),
        // No grant only when the placement failed: its error.
        outcome: match granted {
            Some(g) => g,
            None => placed.map(|_| GrantOutcome::NoRecord),
        },
    }
}

/// What the plugin does with a step, and the one line the user sees.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StepFate {
    /// Run; the grant (if any) is in place.
    Run,
    /// Run with no GPU access; tell the user why.
    RunWithoutGpus(String),
    /// Do not run the step's tasks; tell the user why.
    Refuse(String),
}

/// Whether a step that found no record is expected to: the extern step
/// when slurm.conf has `PrologFlags=RunInJob` (`run_in_job`,
/// [`crate::host::slurmconf::SlurmConf::run_in_job`]). The extern slurmstepd
/// then calls `spank_init` and only afterwards runs the Prolog
/// (`_spawn_job_container` → `_run_prolog_epilog`,
/// `src/slurmd/slurmstepd/mgr.c`, 24.05-26.05), which grants the job
/// cgroup itself ([`grant_in_prolog`]). No user process runs in the job
/// before the Prolog succeeded.
pub fn no_record_expected(req: &StepRequest, run_in_job: bool) -> bool {
    run_in_job && req.step_id == EXTERN_STEP_ID
}

/// The step's fate, without the audit line: [`step_fate`]'s decision.
fn decide(
    req: &StepRequest,
    node_name: &str,
    placed: Option<&NodeError>,
    granted: Option<Result<&GrantOutcome, &NodeError>>,
    run_in_job: bool,
) -> StepFate {
    let step = step_label(req);
    match (placed, granted) {
        (Some(e), _) => StepFate::Refuse(format!("gpufence: {step} refused on {node_name}: {e}")),
        (None, Some(Ok(GrantOutcome::NoRecord))) if no_record_expected(req, run_in_job) => {
            StepFate::Run
        }
        (None, Some(Ok(GrantOutcome::NoRecord))) => StepFate::RunWithoutGpus(format!(
            "gpufence: {step} has no GPU grant on {node_name} (the gpufence prolog left no record for the job); \
             this step runs without GPU access. Admin: check Prolog= in slurm.conf"
        )),
        (None, Some(Err(e))) => StepFate::RunWithoutGpus(format!(
            "gpufence: {step} could not be granted its GPUs on {node_name}: {e}; this step runs without GPU access"
        )),
        (None, _) => StepFate::Run,
    }
}

/// Decides the step's fate from the two halves' results ([`place`],
/// [`grant_placed`]), and writes a `grant_refused` audit line when it is not a
/// plain run. `node_name` is for the user's message. `run_in_job`:
/// slurm.conf has `PrologFlags=RunInJob`; then the extern step without a
/// record ([`no_record_expected`]) runs
/// with neither a line for the user nor a `grant_refused` line. Every
/// other step without a record, and any step under other flags, runs
/// without GPUs and says why.
pub fn step_fate(
    node: &Node,
    req: &StepRequest,
    node_name: &str,
    placed: &Result<Placement, NodeError>,
    granted: Option<&Result<GrantOutcome, NodeError>>,
    run_in_job: bool,
) -> StepFate {
    let v = decide(
        req,
        node_name,
        placed.as_ref().err(),
        granted.map(Result::as_ref),
        run_in_job,
    );
    let job = req.job_id;
    if let StepFate::Refuse(line) | StepFate::RunWithoutGpus(line) = &v {
        let _ = node.audit(
            AuditEvent::new(events::GRANT_REFUSED)
                .job(job)
                .uid(req.uid)
                .pid(req.stepd_pid)
                .field("step", step_name(req.step_id))
                .field("refused_step", matches!(v, StepFate::Refuse(_)))
                .field("reason", line.clone()),
        );
    }
    v
}

/// The minors on major `gpu_major` that a live grant in `fence` covers,
/// leaving out job `other_than`'s grants: the GPUs this job shares with
/// another (gres/shard, gres/mps). The Prolog records them (their idle
/// memory says nothing about one job), the Epilog checks them process by
/// process. Empty without a fence or when its grants cannot be read.
pub(crate) fn granted_minors(
    fence: Option<&Fence>,
    gpu_major: u32,
    other_than: Option<u32>,
) -> std::collections::BTreeSet<u32> {
    fence
        .and_then(|f| f.entries().ok())
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.dev.major == gpu_major && Some(e.job_id) != other_than)
        .map(|e| e.dev.minor)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node with the defaults and its audit log at `dir/a.jsonl`.
    fn audited_node(dir: &std::path::Path) -> (Node, std::path::PathBuf) {
        use gpufence_model::config::{Config, ConfigOrigin};
        let audit = dir.join("a.jsonl");
        let text = format!("audit_log = \"{}\"\n", audit.display());
        let node = Node::new(
            Config::parse(&text, std::path::Path::new("t")).unwrap(),
            ConfigOrigin::Defaults,
        )
        .unwrap();
        (node, audit)
    }

    #[test]
    fn special_step_names() {
        assert_eq!(step_name(0xffff_fffc), "extern");
        assert_eq!(step_name(0xffff_fffb), "batch");
        assert_eq!(step_name(0xffff_fffa), "interactive");
        assert_eq!(step_name(3), "3");
    }

    /// Every line about a step, for the user, the log or the audit log,
    /// names Slurm's special steps by name: a raw id (4294967292 for the
    /// extern step) would fail here.
    #[test]
    fn step_lines_name_special_steps() {
        let e = NodeError::ProcessGone { pid: 1 };
        for (id, name) in [
            (0xffff_fffc, "extern"),
            (0xffff_fffb, "batch"),
            (0xffff_fffa, "interactive"),
            (5, "5"),
        ] {
            let req = StepRequest {
                job_id: 9,
                step_id: id,
                uid: 1000,
                stepd_pid: 1,
            };
            let want = format!("job 9 step {name}");
            let decided = [
                decide(&req, "n1", Some(&e), None, false),
                decide(&req, "n1", None, Some(Ok(&GrantOutcome::NoRecord)), false),
                decide(&req, "n1", None, Some(Err(&e)), false),
            ];
            let mut lines: Vec<String> = decided
                .into_iter()
                .map(|v| match v {
                    StepFate::Refuse(l) | StepFate::RunWithoutGpus(l) => l,
                    StepFate::Run => panic!("{id}: a line was expected"),
                })
                .collect();
            lines.extend([
                step_label(&req),
                granted_line(&req, 2, "s/job_9", "job_9"),
                load_refused_line(&req, "n1", &"bad config"),
                user_note_line(&req, "note"),
                run_in_job_no_record_line(&req),
            ]);
            for l in &lines {
                assert!(l.contains(&want), "{want:?} not in {l:?}");
                if id > 0xffff_fff0 {
                    assert!(!l.contains(&id.to_string()), "raw id {id} in {l:?}");
                }
            }
        }
    }

    /// The audit lines of a step carry its name in `step`.
    #[test]
    fn refusal_audit_line_names_the_extern_step() {
        let d = tempfile::tempdir().unwrap();
        let (node, audit) = audited_node(d.path());
        let req = StepRequest {
            job_id: 9,
            step_id: EXTERN_STEP_ID,
            uid: 1000,
            stepd_pid: 1,
        };
        let placed: Result<Placement, NodeError> = Err(NodeError::ProcessGone { pid: 1 });
        let _ = step_fate(&node, &req, "n1", &placed, None, false);
        let line = std::fs::read_to_string(&audit).unwrap();
        let v: serde_json::Value = serde_json::from_str(line.lines().next().unwrap()).unwrap();
        assert_eq!(v["step"], "extern", "{line}");
        assert!(!line.contains("4294967292"), "{line}");
        assert!(
            v["reason"].as_str().unwrap().contains("job 9 step extern"),
            "{line}"
        );
    }

    /// A slurmstepd outside Slurm's job cgroups (here: this test process,
    /// wherever it runs): the error says where it is and both ways out.
    #[test]
    fn no_job_cgroup_says_what_was_found_and_both_fixes() {
        use gpufence_model::config::{Config, ConfigOrigin};
        let d = tempfile::tempdir().unwrap();
        let text = format!(
            "layout = \"slurm\"\naudit_log = \"{}/a.jsonl\"\n",
            d.path().display()
        );
        let node = Node::new(
            Config::parse(&text, std::path::Path::new("t")).unwrap(),
            ConfigOrigin::Defaults,
        )
        .unwrap();
        let me = std::process::id() as i32;
        let own = node.cg.cgroup_of(me).unwrap();
        let req = StepRequest {
            job_id: 7,
            step_id: 0xffff_fffc,
            uid: 1000,
            stepd_pid: me,
        };
        let e = locate(&node, &req).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, NodeError::NoJobCgroup { .. }), "{msg}");
        for want in [
            format!(
                "job 7 step extern (pid {me}) is in cgroup {}",
                crate::host::cgpath::abs(&own)
            ),
            "<job_7 or SLUID>/step_extern/slurm".to_string(),
            "ProctrackType=proctrack/cgroup".to_string(),
            "CgroupPlugin=cgroup/v2".to_string(),
            "set layout = \"own\"".to_string(),
        ] {
            assert!(msg.contains(&want), "{want:?} not in {msg}");
        }
    }

    #[test]
    fn fates() {
        let d = tempfile::tempdir().unwrap();
        let (node, _) = audited_node(d.path());
        let req = StepRequest {
            job_id: 3,
            step_id: 0,
            uid: 1000,
            stepd_pid: 1,
        };
        let refused: Result<Placement, NodeError> =
            Err(NodeError::FenceMissing { detail: "x".into() });
        assert!(
            matches!(step_fate(&node, &req, "n1", &refused, None, false), StepFate::Refuse(l) if l.starts_with("gpufence: job 3 step 0 refused on n1: the GPU fence is not installed"))
        );
        let audit = std::fs::read_to_string(d.path().join("a.jsonl")).unwrap();
        assert!(
            audit.contains("\"event\":\"grant_refused\"")
                && audit.contains("\"refused_step\":true"),
            "{audit}"
        );
    }

    /// `PrologFlags=RunInJob`: the extern step without a record runs
    /// quietly (no line for the user, no `grant_refused`); any other step
    /// without a record, or the extern step without RunInJob, says why.
    #[test]
    fn extern_step_without_record_under_run_in_job() {
        let req = |step_id| StepRequest {
            job_id: 4,
            step_id,
            uid: 1000,
            stepd_pid: 1,
        };
        let no_record = Ok(&GrantOutcome::NoRecord);
        assert!(no_record_expected(&req(EXTERN_STEP_ID), true));
        assert_eq!(
            decide(&req(EXTERN_STEP_ID), "n1", None, Some(no_record), true),
            StepFate::Run
        );
        for (step, run_in_job) in [(0, true), (0xffff_fffb, true), (EXTERN_STEP_ID, false)] {
            assert!(!no_record_expected(&req(step), run_in_job));
            let v = decide(&req(step), "n1", None, Some(no_record), run_in_job);
            assert!(
                matches!(&v, StepFate::RunWithoutGpus(l) if l.starts_with(&format!("gpufence: job 4 step {} has no GPU grant on n1", step_name(step)))),
                "{step} {run_in_job}: {v:?}"
            );
        }
        // Only a missing record is expected: a refused placement or a
        // failed grant of the extern step still says so.
        let e = NodeError::ProcessGone { pid: 1 };
        assert!(matches!(
            decide(&req(EXTERN_STEP_ID), "n1", Some(&e), Some(no_record), true),
            StepFate::Refuse(_)
        ));
        assert!(matches!(
            decide(&req(EXTERN_STEP_ID), "n1", None, Some(Err(&e)), true),
            StepFate::RunWithoutGpus(_)
        ));
        assert_eq!(
            decide(
                &req(EXTERN_STEP_ID),
                "n1",
                None,
                Some(Ok(&GrantOutcome::NoGpus)),
                true
            ),
            StepFate::Run
        );
    }

    /// Only [`StepFate::Refuse`] and [`StepFate::RunWithoutGpus`]
    /// are audited (so the quiet extern step has no `grant_refused`): a
    /// refused extern step still is, RunInJob or not.
    #[test]
    fn refused_extern_step_is_audited_under_run_in_job() {
        let d = tempfile::tempdir().unwrap();
        let (node, audit) = audited_node(d.path());
        let req = StepRequest {
            job_id: 4,
            step_id: EXTERN_STEP_ID,
            uid: 1000,
            stepd_pid: 1,
        };
        let placed: Result<Placement, NodeError> = Err(NodeError::ProcessGone { pid: 1 });
        let v = step_fate(
            &node,
            &req,
            "n1",
            &placed,
            Some(&Ok(GrantOutcome::NoRecord)),
            true,
        );
        assert!(matches!(v, StepFate::Refuse(_)));
        let text = std::fs::read_to_string(&audit).unwrap();
        assert_eq!(
            text.matches("\"event\":\"grant_refused\"").count(),
            1,
            "{text}"
        );
    }
}
