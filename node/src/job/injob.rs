//! `PrologFlags=RunInJob` (Slurm 24.05+) with `layout = "slurm"`: the
//! Prolog and the Epilog run from the job's extern slurmstepd, inside
//! `<scope>/<job dir>/step_extern/slurm` (`_run_prolog_epilog`,
//! `src/slurmd/slurmstepd/mgr.c`, 24.05-26.05), and the extern step's
//! `slurm_spank_init` runs before the Prolog, when there is no record yet.
//!
//! What gpufence does then:
//!
//! - The Prolog finds its job cgroup from its own cgroup
//!   ([`locate_script`]: the kernel's `/proc/self/cgroup`, where Slurm put
//!   the extern slurmstepd; never the job's environment) and, after writing
//!   and auditing the record, grants it itself
//!   ([`crate::job::grant::grant_in_prolog`], step `extern`): the extern step,
//!   ssh sessions pam_slurm_adopt puts in `step_extern/user/task_special`,
//!   and every later step hold the grant from the moment the Prolog
//!   returns. Later steps' `slurm_spank_init` grant the same again, which
//!   is harmless ([`crate::job::grant::grant_placed`]).
//! - The extern step's `slurm_spank_init` without a record is expected
//!   ([`crate::job::grant::no_record_expected`]).
//! - The Prolog and the Epilog step out of the job cgroup into an exempt
//!   leaf of the exec cgroup for their work ([`step_out`]) and back in
//!   before they exit. Inside the job cgroup NVML cannot do its part:
//!   the Epilog revokes the job's grant before its NVML checks (so nothing
//!   new can open the GPUs), after which the job cgroup may open none of
//!   them; and even with the job's grant in place NVML enumerates every
//!   GPU of the node, `nvmlDeviceGetHandleByIndex` answers
//!   `NVML_ERROR_NO_PERMISSION` for the others (NVML's documentation of
//!   `nvmlDeviceGetCount_v2`), which fails the query, and each such open
//!   would be a denial in the fence's record. Outside, they run as the
//!   Prolog and Epilog of slurmd (in `slurmd.service`, exempt by default)
//!   do: the idle-memory baseline, the memory-return proof and
//!   `--gpu-exclusive` work unchanged, and so do `slurmd -G`, `scontrol`
//!   and the drain they may run.
//!
//! With `layout = "own"`, or a Prolog or Epilog that is not in a job cgroup
//! (slurmd's Prolog), nothing of this happens. (`layout = "own"` under
//! RunInJob is not handled: the scripts then run in gpufence's own
//! `job_<id>/step_extern`, which the plugin moved the extern slurmstepd
//! into, under the fence without a grant, and the own layout's Epilog
//! clean-up of `job_<id>` would reach the Epilog and that slurmstepd.)

use gpufence_cgroup::Fence;
use gpufence_model::config::Layout;

use crate::host::slurm_cgroup::{find_job_cgroup, is_sluid, job_dir_id, SlurmJobCgroup};
use crate::job::grant::{self, JobCgroup};
use crate::{Node, NodeError};

/// The Prolog's and Epilog's variable with the job's SLUID (25.11+,
/// `_build_env`, `src/plugins/prep/script/prep_script_slurmd.c`).
pub const SLUID_ENV: &str = "SLURM_JOB_SLUID";

/// The job cgroup a Prolog or Epilog of job `job_id` runs in, from its
/// own cgroup `own_cgroup` (relative to the cgroup2 mount, as
/// `/proc/self/cgroup` gives it): `Some` when `own_cgroup` is
/// `<job dir>/step_extern/slurm` of this job ([`find_job_cgroup`]: the job
/// dir is `job_<job_id>` or a SLUID, nothing job-like above it), `None`
/// when it is not in a job's extern step (slurmd's Prolog, in
/// `system.slice/slurmd.service`). `sluid` is `SLURM_JOB_SLUID` from the
/// script's environment (slurmd's or slurmstepd's, 25.11+): when set, a
/// SLUID job dir must be it.
///
/// # Errors
/// [`WrongJob`] when `own_cgroup` is the extern step of another job (a
/// `job_<n>` of another id, or a SLUID other than `sluid`): Slurm ran the
/// script of one job in another's cgroup, and granting there would give
/// this job's GPUs to the other.
pub fn script_job_cgroup(
    own_cgroup: &str,
    job_id: u32,
    sluid: Option<&str>,
) -> Result<Option<SlurmJobCgroup>, WrongJob> {
    let sluid = sluid.map(str::trim).filter(|s| !s.is_empty());
    let other = |dir: &str| WrongJob {
        job_id,
        sluid: sluid.map(str::to_string),
        cgroup: own_cgroup.to_string(),
        dir: dir.to_string(),
    };
    if let Some(j) = find_job_cgroup(own_cgroup, job_id, "extern") {
        if is_sluid(&j.dir) && sluid.is_some_and(|s| s != j.dir) {
            return Err(other(&j.dir));
        }
        return Ok(Some(j));
    }
    // Another job's extern step, by job id?
    let parts: Vec<&str> = own_cgroup.split('/').filter(|s| !s.is_empty()).collect();
    if let [.., dir, _, _] = parts.as_slice() {
        if let Some(id) = job_dir_id(dir).filter(|id| *id != job_id) {
            if find_job_cgroup(own_cgroup, id, "extern").is_some() {
                return Err(other(dir));
            }
        }
    }
    Ok(None)
}

/// The Prolog or Epilog runs in the extern step of another job
/// ([`script_job_cgroup`]): granting there would give this job's GPUs to
/// the other.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the Prolog/Epilog of job {job_id}{} runs in cgroup {}, the extern step of another job ({dir}): \
     Slurm ran it in the wrong job, whose cgroup gets nothing of this job's",
    .sluid.as_deref().map_or_else(String::new, |s| format!(" ({SLUID_ENV}={s})")),
    crate::host::cgpath::abs(.cgroup)
)]
pub struct WrongJob {
    /// The job the script is for.
    pub job_id: u32,
    /// Its `SLURM_JOB_SLUID`, trimmed, when set.
    pub sluid: Option<String>,
    /// The script's own cgroup (relative).
    pub cgroup: String,
    /// The other job's directory (`job_<n>` or its SLUID).
    pub dir: String,
}

/// [`script_job_cgroup`] for this process, with `layout = "slurm"`; `None`
/// with `layout = "own"`.
///
/// # Errors
/// [`NodeError::WrongJob`] when this process is in another job's extern
/// step, [`NodeError::OutsideFence`] when the job cgroup is outside the
/// fenced subtree;
/// [`NodeError::Kernel`] when `/proc/self/cgroup` cannot be read.
pub fn locate_script(
    node: &Node,
    job_id: u32,
    sluid: Option<&str>,
) -> Result<Option<JobCgroup>, NodeError> {
    if node.cfg.layout != Layout::Slurm {
        return Ok(None);
    }
    let own = node.cg.cgroup_of(std::process::id() as i32)?;
    let Some(job) =
        script_job_cgroup(&own, job_id, sluid).map_err(|e| NodeError::WrongJob(e.to_string()))?
    else {
        return Ok(None);
    };
    grant::fenced(node, &job.path)?;
    Ok(Some(JobCgroup {
        path: job.path,
        dir: job.dir,
    }))
}

/// This process, moved into an exempt cgroup by [`step_out`]; dropping it
/// moves the process back where it came from and removes the exempt leaf.
#[derive(Debug)]
pub struct SteppedOut<'a> {
    node: &'a Node,
    /// Where the process was (the job's `step_extern/slurm`).
    pub back: String,
    /// Where it is: `<cgroup_root>/<exec_cgroup>/<tag>-<pid>`.
    pub here: String,
}

/// Moves this process (all its threads) from the job cgroup into
/// `<cgroup_root>/<exec_cgroup>/<tag>-<pid>`, exempt in the fence
/// ([`crate::host::exec_cgroup::exempt_leaf`]), until the returned guard is dropped.
/// Leaves of scripts killed while stepped out are removed first.
/// Child processes started meanwhile start there too. Slurm waits for the
/// script by its pid (and kills its process group on a timeout), not by
/// its cgroup.
///
/// # Errors
/// [`NodeError`] when the exempt leaf cannot be made or the process
/// cannot be moved (the leaf is removed again).
pub fn step_out<'a>(node: &'a Node, fence: &Fence, tag: &str) -> Result<SteppedOut<'a>, NodeError> {
    let me = std::process::id() as i32;
    let back = node.cg.cgroup_of(me)?;
    remove_dead_leaves(node);
    let here = crate::host::exec_cgroup::exempt_leaf(node, fence, &format!("{tag}-{me}"))?;
    if let Err(e) = node.cg.move_pid(&here, me) {
        let _ = node.cg.remove_tree(&here);
        return Err(NodeError::StepOut {
            tag: tag.to_string(),
            pid: me,
            from: crate::host::cgpath::abs(&back),
            to: crate::host::cgpath::abs(&here),
            source: Box::new(e),
        });
    }
    Ok(SteppedOut { node, back, here })
}

/// The leaves a Prolog or Epilog killed while stepped out left behind
/// (`prolog-<pid>`, `epilog-<pid>` whose pid is gone): removed. A leaf of a
/// live pid is left alone, even if empty: its script may be about to move
/// in.
fn remove_dead_leaves(node: &Node) {
    let base = node.exec_cgroup();
    let Ok(rd) = std::fs::read_dir(node.cg.path(&base)) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let pid = ["prolog-", "epilog-"]
            .iter()
            .find_map(|p| name.strip_prefix(p))
            .and_then(|n| n.parse::<i32>().ok());
        let Some(pid) = pid else { continue };
        if pid > 0 && !crate::host::procs::alive(pid) {
            // rmdir refuses a cgroup that holds processes.
            let _ = node.cg.remove_tree(&crate::join_cgroup(&base, &name));
        }
    }
}

impl Drop for SteppedOut<'_> {
    fn drop(&mut self) {
        // Best effort: if the job cgroup is gone the process stays in the
        // (exempt, empty once it exits) leaf.
        let me = std::process::id() as i32;
        if self.node.cg.move_pid(&self.back, me).is_ok() {
            let _ = self.node.cg.remove_tree(&self.here);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCOPE: &str = "system.slice/node1_slurmstepd.scope";

    fn found(own: &str, job: u32, sluid: Option<&str>) -> Result<Option<(String, String)>, String> {
        script_job_cgroup(own, job, sluid)
            .map(|o| o.map(|j| (j.path, j.dir)))
            .map_err(|e| e.to_string())
    }

    /// 24.11 (and 26.05 with `CgroupJobIdPaths=yes`): `job_<id>`, with or
    /// without a SLUID in the environment.
    #[test]
    fn job_id_dir() {
        let own = format!("{SCOPE}/job_7/step_extern/slurm");
        let want = Ok(Some((format!("{SCOPE}/job_7"), "job_7".to_string())));
        assert_eq!(found(&own, 7, None), want);
        assert_eq!(found(&own, 7, Some("s7C5M8ST6RSJ00")), want);
        assert_eq!(found(&format!("/{own}"), 7, None), want, "leading /");
    }

    /// 26.05: the job dir is the SLUID, which must be `SLURM_JOB_SLUID`
    /// when that is set.
    #[test]
    fn sluid_dir() {
        let own = format!("{SCOPE}/s7C5M8ST6RSJ00/step_extern/slurm");
        let want = Ok(Some((
            format!("{SCOPE}/s7C5M8ST6RSJ00"),
            "s7C5M8ST6RSJ00".to_string(),
        )));
        assert_eq!(found(&own, 9, Some("s7C5M8ST6RSJ00")), want);
        assert_eq!(found(&own, 9, Some(" s7C5M8ST6RSJ00\n")), want);
        assert_eq!(found(&own, 9, None), want, "no SLURM_JOB_SLUID");
        assert_eq!(found(&own, 9, Some("")), want, "empty is unset");
        let e = found(&own, 9, Some("s7C5M8ST6RSJ01")).unwrap_err();
        for want in [
            "job 9 (SLURM_JOB_SLUID=s7C5M8ST6RSJ01)",
            &format!("/{SCOPE}/s7C5M8ST6RSJ00/step_extern/slurm"),
            "another job (s7C5M8ST6RSJ00)",
        ] {
            assert!(e.contains(want), "{want:?} not in {e}");
        }
    }

    #[test]
    fn another_jobs_extern_step_is_an_error() {
        let own = format!("{SCOPE}/job_8/step_extern/slurm");
        let e = found(&own, 7, None).unwrap_err();
        assert!(
            e.contains("job 7") && e.contains("another job (job_8)"),
            "{e}"
        );
        // A lookalike inside job 8's task cgroup is no job cgroup at all.
        let own = format!("{SCOPE}/job_8/step_0/user/task_0/job_9/step_extern/slurm");
        assert_eq!(found(&own, 7, None), Ok(None));
        assert_eq!(found(&own, 9, None), Ok(None));
    }

    /// slurmd's Prolog, and anything that is not a job's extern step.
    #[test]
    fn not_in_a_job() {
        for own in [
            "system.slice/slurmd.service",
            "system.slice/slurmd.service/slurmd",
            "",
            SCOPE,
            &format!("{SCOPE}/job_7"),
            &format!("{SCOPE}/job_7/step_extern"),
            &format!("{SCOPE}/job_7/step_extern/user/task_special"),
            &format!("{SCOPE}/job_7/step_0/slurm"),
            &format!("{SCOPE}/job_7/step_batch/slurm"),
            &format!("{SCOPE}/job_8/step_0/slurm"),
            "gpufence-exec/prolog-123",
        ] {
            assert_eq!(found(own, 7, Some("s7C5M8ST6RSJ00")), Ok(None), "{own}");
        }
    }

    /// The first line of `/proc/self/cgroup` as the kernel writes it, through
    /// the parser `Cgroup2::cgroup_of` uses.
    #[test]
    fn from_proc_self_cgroup() {
        use gpufence_cgroup::hierarchy::parse_proc_cgroup;
        let line = |p: &str| parse_proc_cgroup(&format!("0::/{p}\n")).unwrap_or_default();
        assert_eq!(
            found(&line(&format!("{SCOPE}/job_7/step_extern/slurm")), 7, None),
            Ok(Some((format!("{SCOPE}/job_7"), "job_7".into())))
        );
        assert_eq!(
            found(&line("system.slice/slurmd.service"), 7, None),
            Ok(None)
        );
    }

    /// This test process is in no job cgroup: nothing to grant, in either
    /// layout.
    #[test]
    fn locate_script_outside_a_job() {
        use gpufence_model::config::{Config, ConfigOrigin};
        let d = tempfile::tempdir().unwrap();
        for layout in ["slurm", "own"] {
            let text = format!(
                "layout = \"{layout}\"\naudit_log = \"{}/a.jsonl\"\n",
                d.path().display()
            );
            let node = Node::new(
                Config::parse(&text, std::path::Path::new("t")).unwrap(),
                ConfigOrigin::Defaults,
            )
            .unwrap();
            assert_eq!(locate_script(&node, 7, None).unwrap(), None, "{layout}");
        }
    }
}
