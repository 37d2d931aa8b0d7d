//! What an Epilog did ([`crate::job::epilog`]): the grants it revoked, the
//! holders it responded to, what survived and what failed, as types. The
//! texts the Epilog prints, audits and drains with are these types'
//! `Display`, one place each; the drain reason is derived from the
//! outcome ([`EpilogOutcome::drain_cause`]).

use std::path::PathBuf;

use gpufence_cgroup::fence::GrantEntry;
use gpufence_model::device::DevNum;
use gpufence_model::record::StateError;

use crate::host::drain::DrainError;
use crate::host::gpus::GpuError;
use crate::host::mps_cgroups::MpsStopError;
use crate::response::respond::{Lingering, NotRead, ResponseError};
use crate::NodeError;

/// What the epilog did.
#[derive(Debug, Default)]
pub struct EpilogOutcome {
    /// Grants removed from the fence.
    pub revoked: Vec<GrantEntry>,
    /// Processes that held the job's devices.
    pub lingering: Vec<Lingering>,
    /// What still holds (or may hold) the job's devices after the
    /// response: holders seen again, GPU memory not back, and processes
    /// not read whole within `scan_budget_ms` that gpufence does not end.
    pub survivors: Vec<Survivor>,
    /// Problems that make the node unsafe (non-zero exit).
    pub errors: Vec<EpilogError>,
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

    /// The job's grant could not be revoked (one of [`Self::errors`]): it
    /// is still in the fence, so the job's record and note are kept.
    pub fn revoke_failed(&self) -> Option<&RevokeFailed> {
        self.errors.iter().find_map(|e| match e {
            EpilogError::Revoke(f) => Some(f),
            _ => None,
        })
    }

    /// What the drain reason names, after `gpufence: job <id>: `: the first
    /// holder not gone (its pid, `comm`, fate and devices), else the first
    /// survivor, else the first error; empty when there is none.
    /// `kill_cut`: the kill wait was cut by `epilog_deadline_ms` (a holder
    /// not seen gone is said so, not "survived").
    pub fn drain_cause(&self, kill_cut: bool) -> String {
        self.lingering
            .iter()
            .find(|l| !l.gone())
            .map(|l| {
                format!(
                    "pid {} ({}) {} holding {}",
                    l.pid,
                    l.comm.clone().unwrap_or_default(),
                    if l.spared.is_some() {
                        "spared (system account)"
                    } else if kill_cut {
                        "not seen gone after SIGKILL (kill wait cut by epilog_deadline_ms)"
                    } else {
                        "survived SIGKILL"
                    },
                    devices(&l.devices)
                )
            })
            .or_else(|| self.survivors.first().map(ToString::to_string))
            .or_else(|| self.errors.first().map(ToString::to_string))
            .unwrap_or_default()
    }
}

/// `a,b,c` of device numbers.
fn devices(d: &[DevNum]) -> String {
    d.iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// What still holds, or may hold, a job's devices after its Epilog's
/// response. Its `Display` is the line the Epilog prints and audits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Survivor {
    /// A holder the look after the response found (its fate: it was not
    /// responded to in time, or it took a descriptor on since).
    StillHolds {
        /// The process.
        pid: i32,
        /// The job's devices it holds.
        devices: Vec<DevNum>,
    },
    /// A GPU of the job whose used memory did not come back to its idle
    /// level within `memory_wait_ms`.
    MemoryInUse {
        /// The GPU's minor.
        minor: u32,
        /// Used memory, MiB.
        used_mib: u64,
        /// The idle level (with the tolerance), MiB.
        idle_mib: u64,
        /// How long the Epilog waited, ms.
        waited_ms: u128,
    },
    /// On a GPU shared with another job: a process no grant covers that
    /// still has memory there after `memory_wait_ms`.
    SharedMemory {
        /// The GPU's minor.
        minor: u32,
        /// The process, as the driver names it.
        pid: u32,
        /// Its memory there, MiB.
        mib: u64,
        /// How long the Epilog waited, ms.
        waited_ms: u128,
    },
    /// A process not read whole within `scan_budget_ms` that gpufence
    /// does not end ([`NotRead::reason`]).
    NotRead(NotRead),
}

impl Survivor {
    /// The process, when one is named.
    pub fn pid(&self) -> Option<i32> {
        match self {
            Survivor::StillHolds { pid, .. } | Survivor::NotRead(NotRead { pid, .. }) => Some(*pid),
            Survivor::SharedMemory { pid, .. } => i32::try_from(*pid).ok(),
            Survivor::MemoryInUse { .. } => None,
        }
    }
}

impl std::fmt::Display for Survivor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Survivor::StillHolds { pid, devices: d } => {
                write!(f, "pid {pid} still holds {}", devices(d))
            }
            Survivor::MemoryInUse {
                minor,
                used_mib,
                idle_mib,
                waited_ms,
            } => write!(
                f,
                "GPU /dev/nvidia{minor} still has {used_mib} MiB in use (idle level {idle_mib} MiB) after {waited_ms} ms"
            ),
            Survivor::SharedMemory {
                minor,
                pid,
                mib,
                waited_ms,
            } => write!(
                f,
                "GPU /dev/nvidia{minor} (shared with another job) still has {mib} MiB of pid {pid}, which no grant covers, after {waited_ms} ms"
            ),
            Survivor::NotRead(n) => f.write_str(&n.reason()),
        }
    }
}

/// The job's grant could not be revoked from the fence (step 1 of
/// [`crate::job::epilog::run_with`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("revoking job {job_id}'s grant: {reason}")]
pub struct RevokeFailed {
    /// The job.
    pub job_id: u32,
    /// The fence's error.
    pub reason: String,
}

/// A step of the Epilog that failed: the node is not clean (non-zero
/// exit, drained when configured). Its `Display` is the line printed,
/// audited (`errors`) and, when first, the drain reason.
#[derive(Debug, thiserror::Error)]
pub enum EpilogError {
    /// Under `PrologFlags=RunInJob`: the job's cgroup could not be told
    /// ([`crate::job::injob::locate_script`]).
    #[error("{0}")]
    LocateScript(NodeError),
    /// Under `PrologFlags=RunInJob`: the Epilog could not step out of the
    /// job cgroup ([`crate::job::injob::step_out`]).
    #[error("{0}; NVML cannot check the job's GPUs from inside the job cgroup once its grant is revoked")]
    StepOut(NodeError),
    /// The job's record exists but cannot be read.
    #[error("{0}")]
    ReadRecord(StateError),
    /// The grant is still in the fence.
    #[error(transparent)]
    Revoke(RevokeFailed),
    /// An MPS daemon of the job's could not be stopped
    /// ([`crate::job::mps::release`]).
    #[error("MPS daemon {daemon}: {source}")]
    Mps {
        /// The daemon ([`crate::job::mps::daemon_name`]).
        daemon: String,
        /// Why.
        source: MpsStopError,
    },
    /// An audit line could not be written.
    #[error("{0}")]
    Audit(NodeError),
    /// NVML could not list the job's GPUs' processes (`nvml_failure =
    /// drain`).
    #[error("NVML query failed, the job's GPUs cannot be shown clean: {0}")]
    NvmlQuery(GpuError),
    /// A step of the response failed.
    #[error("{0}")]
    Response(ResponseError),
    /// NVML could not tell the GPUs' used memory (`nvml_failure = drain`).
    #[error("NVML memory query failed: {0}")]
    NvmlMemory(GpuError),
    /// The `own` layout's job cgroup could not be emptied and removed.
    #[error("{source} (processes left: {left:?})")]
    OwnCgroup {
        /// Why.
        source: NodeError,
        /// The processes still in it.
        left: Vec<i32>,
    },
    /// A compute mode changed for `--gpu-exclusive` could not be restored.
    #[error("restoring the compute mode of /dev/nvidia{minor}: {source}")]
    ComputeMode {
        /// The GPU's minor.
        minor: u32,
        /// NVML's error.
        source: GpuError,
    },
    /// The job's shared-memory leftovers could not be removed
    /// (`shm_remove_leftovers`): the first failure, and how many more.
    #[error("removing {}: {reason}{}", path.display(), if *more > 0 { format!(" (and {more} more not removed)") } else { String::new() })]
    ShmRemove {
        /// The first file not removed.
        path: PathBuf,
        /// Why.
        reason: String,
        /// How many others were not removed.
        more: usize,
    },
    /// The job's state could not be forgotten (record, note, end mark).
    #[error("{0}")]
    Forget(StateError),
    /// The node could not be drained.
    #[error("could not drain {node}: {source}")]
    Drain {
        /// The Slurm node.
        node: String,
        /// Why.
        source: DrainError,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A failed revoke reads as it always did among the errors, and it is
    /// what keeps the record ([`EpilogOutcome::revoke_failed`]).
    #[test]
    fn a_failed_revoke_is_typed_and_reads_as_before() {
        let f = RevokeFailed {
            job_id: 7,
            reason: "EPERM".into(),
        };
        let o = EpilogOutcome {
            errors: vec![EpilogError::Revoke(f.clone())],
            ..Default::default()
        };
        assert_eq!(o.errors[0].to_string(), "revoking job 7's grant: EPERM");
        assert_eq!(o.revoke_failed(), Some(&f));
        assert!(!o.clean());
        assert_eq!(o.drain_cause(false), "revoking job 7's grant: EPERM");
    }

    /// Survivors read as the Epilog always wrote them, and come before
    /// errors in the drain reason; a holder not gone comes first.
    #[test]
    fn survivors_read_as_before_and_name_the_drain() {
        let held = Survivor::StillHolds {
            pid: 42,
            devices: vec![DevNum::new(195, 0), DevNum::new(195, 255)],
        };
        assert_eq!(held.to_string(), "pid 42 still holds 195:0,195:255");
        assert_eq!(held.pid(), Some(42));
        let mem = Survivor::MemoryInUse {
            minor: 0,
            used_mib: 2548,
            idle_mib: 64,
            waited_ms: 500,
        };
        assert_eq!(
            mem.to_string(),
            "GPU /dev/nvidia0 still has 2548 MiB in use (idle level 64 MiB) after 500 ms"
        );
        let shared = Survivor::SharedMemory {
            minor: 1,
            pid: 9,
            mib: 10,
            waited_ms: 5,
        };
        assert_eq!(
            shared.to_string(),
            "GPU /dev/nvidia1 (shared with another job) still has 10 MiB of pid 9, which no grant covers, after 5 ms"
        );
        let mut o = EpilogOutcome {
            survivors: vec![mem.clone()],
            errors: vec![EpilogError::ShmRemove {
                path: "/dev/shm/x".into(),
                reason: "EBUSY".into(),
                more: 2,
            }],
            ..Default::default()
        };
        assert_eq!(o.drain_cause(false), mem.to_string());
        assert_eq!(
            o.errors[0].to_string(),
            "removing /dev/shm/x: EBUSY (and 2 more not removed)"
        );
        o.survivors.clear();
        assert_eq!(o.drain_cause(false), o.errors[0].to_string());
        o.lingering.push(Lingering {
            pid: 5,
            comm: Some("x".into()),
            cgroup: None,
            devices: vec![DevNum::new(195, 0)],
            evidence: None,
            frozen: None,
            ended_by: None,
            spared: None,
        });
        assert_eq!(
            o.drain_cause(false),
            "pid 5 (x) survived SIGKILL holding 195:0"
        );
        assert_eq!(
            o.drain_cause(true),
            "pid 5 (x) not seen gone after SIGKILL (kill wait cut by epilog_deadline_ms) holding 195:0"
        );
    }
}
