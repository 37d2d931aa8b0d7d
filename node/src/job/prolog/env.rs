//! The Prolog's environment: what slurmd (or, under
//! `PrologFlags=RunInJob`, the extern slurmstepd) sets for it. With
//! slurmd's GRES list and its own cgroup, the only input the Prolog
//! trusts; the job's options in it are user input, read as such.

use std::path::PathBuf;

use gpufence_model::gres::parse_index_list;

use crate::NodeError;

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

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use std::collections::HashMap;

    /// The Prolog's environment made of `vars` (the record's tests use it
    /// too).
    pub(in crate::job::prolog) fn env(vars: &[(&str, &str)]) -> Result<PrologEnv, NodeError> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        PrologEnv::from_env(&|k| m.get(k).cloned())
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
