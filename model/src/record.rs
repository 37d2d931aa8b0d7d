//! What the prolog records for a job and what the plugin notes when it
//! applies a grant, kept as small JSON files under `state_dir`, and every
//! other path there ([`StateDir`] names each one; nothing else joins a
//! name onto `state_dir`):
//!
//! ```text
//! <state_dir>/jobs/<job_id>.json            JobRecord, written by the prolog
//! <state_dir>/applied/<job_id>-<cgid>.json  AppliedGrant, written by the plugin
//! <state_dir>/slurmd-G.txt                  cached `slurmd -G` output
//! <state_dir>/slurmd-G-<node>.txt           the same for one Slurm node,
//!                                           when slurmd names its node (-N)
//! <state_dir>/nvml-unavailable.txt          why NVML is unavailable, as last audited
//! <state_dir>/mps-locks/<gpu>-u<uid>.lock   an MPS daemon's lock (flock)
//! <state_dir>/job-map.lock                  the job map's lock (flock)
//! <state_dir>/mps/<gpu>-u<uid>/<job_id>     a gres/mps job registered with its
//!                                           user's MPS daemon on a GPU (the
//!                                           pid and start time of its Prolog)
//! <state_dir>/responding/<pid>-<start>.json a process a response is stopping
//! <state_dir>/sweep/lock                    one sweep at a time (flock)
//! <state_dir>/sweep/denials[-<cursor>].json the denial records the last sweep saw
//! <state_dir>/sweep/systemd-baseline.json   the systemd units the sweep accepted
//! ```
//!
//! Every write is atomic (temporary file + rename): a reader sees a whole
//! record or none, even when the writer is killed.

use std::collections::BTreeSet;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::device::{DevNum, DeviceGrant, DeviceRole};
use crate::fsutil::{create_dir_all_mode, write_atomic};

/// Format version of [`JobRecord`] files.
pub const RECORD_VERSION: u32 = 1;

/// What a job was allocated, as the prolog found it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobRecord {
    /// [`RECORD_VERSION`].
    pub version: u32,
    /// `SLURM_JOB_ID`.
    pub job_id: u32,
    /// `SLURM_JOB_UID`.
    pub uid: u32,
    /// GRES indices from `SLURM_JOB_GPUS`, in order.
    pub gres_indices: Vec<u32>,
    /// Every device the job may open: its GRES files and the control devices.
    /// Empty for a job without GPUs (it gets no grant at all).
    pub devices: Vec<DeviceGrant>,
    /// When the prolog wrote it (RFC 3339).
    pub created: String,
    /// Things the prolog noticed for the admin (e.g. a control device
    /// with no major on this node): its log and `grant_recorded`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    /// Lines for the job's user, each whole (`--gpu-exclusive: ...`, a
    /// compute mode not set; `gres/mps: ...`, no MPS daemon): the plugin
    /// prints each in the job's output after `gpufence: job J step S: `.
    /// The Prolog's log and `grant_recorded` carry them too, after
    /// [`JobRecord::notes`] ([`JobRecord::all_notes`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub user_notes: Vec<String>,
    /// Used memory of each job GPU when the job started (after the clean
    /// start), from NVML: the level the epilog waits for memory to return to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_idle: Vec<GpuIdle>,
    /// The MIG slices the job holds, from its GRES caps and `mig-minors`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig: Vec<MigSlice>,
    /// `CUDA_VISIBLE_DEVICES` as slurmd set it for the Prolog (informational;
    /// grants never come from it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cuda_visible_devices: Vec<String>,
    /// Compute modes the prolog changed for `--gpu-exclusive`:
    /// `(minor, mode before)`, restored by the epilog.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub saved_compute_modes: Vec<(u32, u32)>,
    /// The MPS daemons (gpufence's, `mps_control`) this gres/mps job uses,
    /// one per GPU; empty for every other job.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mps: Vec<MpsDaemon>,
    /// The job's files in the job map (`job_map_dir`), by name: each GPU's
    /// NVML index, or `<index>.<GPU instance id>` for a MIG slice, as the
    /// Prolog found them through NVML. Empty when no map is configured,
    /// the job has no GPU or NVML could not tell the indices (a note
    /// says so). Kept here so that rewriting the map needs no NVML.
    /// Absent in records of earlier versions: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub job_map: Vec<String>,
}

impl JobRecord {
    /// The job's GRES devices (its GPUs, shards, MIG parents): what
    /// `SLURM_JOB_GPUS` named, without the control devices.
    pub fn gres_devices(&self) -> BTreeSet<DevNum> {
        self.devices
            .iter()
            .filter(|d| d.role == DeviceRole::Gres)
            .map(|d| d.dev)
            .collect()
    }

    /// The job's GPUs: the minors of its GRES devices on `gpu_major`
    /// ([`crate::device::gpu_minors`]), what NVML is asked about.
    pub fn gpu_minors(&self, gpu_major: u32) -> BTreeSet<u32> {
        crate::device::gpu_minors(&self.gres_devices(), gpu_major)
    }

    /// Every note, the admin's ([`JobRecord::notes`]) then the user's
    /// ([`JobRecord::user_notes`]): what the Prolog logs and
    /// `grant_recorded` carries.
    pub fn all_notes(&self) -> Vec<String> {
        self.notes.iter().chain(&self.user_notes).cloned().collect()
    }
}

/// The job id the grants of gpufence's MPS daemons carry in the fence
/// (`<cgroup_root>/<mps_cgroup>/gpu<minor>-u<uid>`): no Slurm job's, since Slurm
/// numbers jobs below `MAX_JOB_ID` (`0x03FFFFFF`,
/// `src/common/slurm_protocol_defs.h`... `src/slurmctld/job_mgr.c` in older
/// releases). An Epilog's `revoke_job` never takes them; the Epilog of a
/// last MPS job of a daemon's user on its GPU revokes them by cgroup.
pub const MPS_GRANT_JOB_ID: u32 = 0xFFFF_FF00;

/// A gres/mps job's MPS daemon on one of its GPUs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MpsDaemon {
    /// The GPU (its GRES device: `/dev/nvidia<minor>`).
    pub dev: DevNum,
    /// Its `CUDA_MPS_PIPE_DIRECTORY` (`<mps_dir>/gpu<minor>/u<uid>/pipe`,
    /// the job's user's daemon), what the job's clients are told.
    pub pipe_dir: PathBuf,
}

/// One MIG slice of a job: the parent GPU (shared with the neighbours on the
/// same GPU) and the job's own GPU-instance and compute-instance caps.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigSlice {
    /// `/dev/nvidia<gpu>`: the parent device.
    pub parent: DevNum,
    /// The parent's minor (`gpu<G>` in `mig-minors`).
    pub gpu: u32,
    /// GPU instance id.
    pub gi: u32,
    /// Compute instance id, when the GRES names one.
    pub ci: Option<u32>,
    /// The GI access cap device.
    pub gi_cap: DevNum,
    /// The CI access cap device.
    pub ci_cap: Option<DevNum>,
}

/// A GPU's used memory at job start.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuIdle {
    /// `/dev/nvidia<minor>`.
    pub minor: u32,
    /// Used memory, bytes.
    pub used_bytes: u64,
    /// Another job's live grant covered this GPU at job start (a shard or
    /// MPS co-tenant): its used memory then is no idle level (the
    /// co-tenant's memory is in it), so the Epilog checks this GPU per
    /// process instead. Absent in records of earlier versions: `false`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shared: bool,
}

/// A grant the plugin applied to a cgroup for a job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AppliedGrant {
    /// The job.
    pub job_id: u32,
    /// The step whose slurmstepd applied it (`extern`, `batch`, `0`, ...).
    pub step: String,
    /// The cgroup id the grant is keyed by.
    pub cgroup_id: u64,
    /// That cgroup's path relative to the cgroup2 mount.
    pub cgroup_path: String,
    /// When (RFC 3339).
    pub applied: String,
}

/// A state file that exists but cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// Reading or writing failed.
    #[error("{path}: {source}; gpufence keeps job records in state_dir: it must be a writable, root-only directory (check its mount, free space and permissions)")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// The file is not a valid record.
    #[error("{path}: corrupt state file: {msg}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// serde's message.
        msg: String,
    },
}

/// The `state_dir` tree.
#[derive(Clone, Debug)]
pub struct StateDir {
    root: PathBuf,
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> StateError + '_ {
    move |source| StateError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// How many end notes `<state_dir>/ended` keeps ([`StateDir::write_ended`]):
/// far more jobs than one node ends within slurmd's dedup window.
pub const ENDED_KEPT: usize = 4096;

/// Every how many job ids an Epilog prunes the end notes.
pub const ENDED_PRUNE_EVERY: u32 = 256;

impl StateDir {
    /// The tree rooted at `root` (nothing is created yet).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        StateDir { root: root.into() }
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn made(d: PathBuf) -> Result<PathBuf, StateError> {
        create_dir_all_mode(&d, 0o700).map_err(io_err(&d))?;
        Ok(d)
    }

    /// `<state_dir>/jobs`: the job records.
    pub fn jobs_dir(&self) -> PathBuf {
        self.root.join("jobs")
    }

    /// Path of a job's record.
    pub fn record_path(&self, job_id: u32) -> PathBuf {
        self.jobs_dir().join(format!("{job_id}.json"))
    }

    /// The jobs that have a record file (readable or not), ascending.
    pub fn recorded_jobs(&self) -> Vec<u32> {
        let Ok(rd) = std::fs::read_dir(self.jobs_dir()) else {
            return Vec::new();
        };
        let mut out: Vec<u32> = rd
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.strip_suffix(".json")?.parse().ok())
            .collect();
        out.sort_unstable();
        out
    }

    /// `<state_dir>/applied`: the applied-grant notes.
    pub fn applied_dir(&self) -> PathBuf {
        self.root.join("applied")
    }

    /// `<state_dir>/nvml-unavailable.txt`: why NVML is unavailable, as
    /// last audited (`nvml_unavailable` is written again only when it
    /// changes).
    pub fn nvml_unavailable_path(&self) -> PathBuf {
        self.root.join("nvml-unavailable.txt")
    }

    /// `<state_dir>/mps-locks/<daemon>.lock`: the lock that orders the
    /// Prologs and Epilogs starting and stopping MPS daemon `daemon`, one
    /// per daemon (GPU and uid), so that no user's daemon waits on
    /// another's.
    pub fn mps_daemon_lock_path(&self, daemon: &str) -> PathBuf {
        self.root.join("mps-locks").join(format!("{daemon}.lock"))
    }

    /// `<state_dir>/job-map.lock`: the lock that orders the Prologs and
    /// Epilogs rewriting the job map (`job_map_dir`).
    pub fn job_map_lock_path(&self) -> PathBuf {
        self.root.join("job-map.lock")
    }

    /// `<state_dir>/mps`: the MPS registry, one directory per daemon (GPU
    /// and uid: `<gpu>-u<uid>`).
    pub fn mps_registry_dir(&self) -> PathBuf {
        self.root.join("mps")
    }

    /// `<state_dir>/mps/<daemon>`: the gres/mps jobs registered on the
    /// daemon (GPU and uid) named `daemon`, one empty file each.
    pub fn mps_daemon_dir(&self, daemon: &str) -> PathBuf {
        self.mps_registry_dir().join(daemon)
    }

    /// `<state_dir>/mps/<daemon>/<job_id>`: job `job_id` registered on
    /// `daemon`.
    pub fn mps_registration_path(&self, daemon: &str, job_id: u32) -> PathBuf {
        self.mps_daemon_dir(daemon).join(job_id.to_string())
    }

    /// `<state_dir>/responding`: a note per process a response is stopping,
    /// until it has ended it.
    pub fn responding_dir(&self) -> PathBuf {
        self.root.join("responding")
    }

    /// `<state_dir>/sweep`: the sweep's state.
    pub fn sweep_dir(&self) -> PathBuf {
        self.root.join("sweep")
    }

    /// `<state_dir>/door.key`: the node's key (32 bytes, 0600) of the
    /// hashes the job-start checks keep of a credential they find
    /// ([`crate::secrets::HashKey`]).
    pub fn door_key_path(&self) -> PathBuf {
        self.root.join("door.key")
    }

    /// `<state_dir>/sweep/lock`: one sweep at a time.
    pub fn sweep_lock_path(&self) -> PathBuf {
        self.sweep_dir().join("lock")
    }

    /// `<state_dir>/sweep/systemd-baseline.json`: the systemd units the
    /// sweep accepted (remove it to accept the current ones).
    pub fn systemd_baseline_path(&self) -> PathBuf {
        self.sweep_dir().join("systemd-baseline.json")
    }

    /// The denial records the last sweep saw: `<state_dir>/sweep/denials.json`,
    /// or `denials-<cursor>.json` for a named cursor (checked by the caller).
    pub fn denials_path(&self, cursor: Option<&str>) -> PathBuf {
        match cursor {
            None => self.sweep_dir().join("denials.json"),
            Some(c) => self.sweep_dir().join(format!("denials-{c}.json")),
        }
    }

    /// Path of the cached `slurmd -G` output.
    pub fn gres_cache_path(&self) -> PathBuf {
        self.root.join("slurmd-G.txt")
    }

    /// Path of the cached `slurmd -G -N <node>` output of Slurm node
    /// `node` (a host running several slurmd lists each node's GPUs
    /// apart); `None`: [`StateDir::gres_cache_path`]. Characters outside
    /// `[A-Za-z0-9._-]` in the name become `_`.
    pub fn gres_cache_path_for(&self, node: Option<&str>) -> PathBuf {
        match node {
            None => self.gres_cache_path(),
            Some(n) => self
                .root
                .join(format!("slurmd-G-{}.txt", node_file_name(n))),
        }
    }

    /// Writes `text` as the `slurmd -G` cache, atomically.
    ///
    /// # Errors
    /// [`StateError::Io`].
    pub fn write_gres_cache(&self, text: &str) -> Result<(), StateError> {
        self.write_gres_cache_for(None, text)
    }

    /// Writes `text` as the `slurmd -G` cache of `node`
    /// ([`StateDir::gres_cache_path_for`]), atomically.
    ///
    /// # Errors
    /// [`StateError::Io`].
    pub fn write_gres_cache_for(&self, node: Option<&str>, text: &str) -> Result<(), StateError> {
        create_dir_all_mode(&self.root, 0o700).map_err(io_err(&self.root))?;
        let p = self.gres_cache_path_for(node);
        write_atomic(&p, text.as_bytes(), 0o600).map_err(io_err(&p))
    }

    /// Writes a job record atomically, replacing any earlier one.
    ///
    /// # Errors
    /// [`StateError::Io`].
    pub fn write_record(&self, rec: &JobRecord) -> Result<(), StateError> {
        Self::made(self.jobs_dir())?;
        let p = self.record_path(rec.job_id);
        let bytes = serde_json::to_vec_pretty(rec).map_err(|e| StateError::Corrupt {
            path: p.clone(),
            msg: e.to_string(),
        })?;
        write_atomic(&p, &bytes, 0o600).map_err(io_err(&p))
    }

    /// Reads a job's record; `Ok(None)` when there is none.
    ///
    /// # Errors
    /// [`StateError`] when the file exists but is unreadable or corrupt.
    pub fn read_record(&self, job_id: u32) -> Result<Option<JobRecord>, StateError> {
        let p = self.record_path(job_id);
        let bytes = match std::fs::read(&p) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err(&p)(e)),
        };
        let rec: JobRecord = serde_json::from_slice(&bytes).map_err(|e| StateError::Corrupt {
            path: p.clone(),
            msg: e.to_string(),
        })?;
        if rec.job_id != job_id {
            return Err(StateError::Corrupt {
                path: p,
                msg: format!("holds job {} instead of {job_id}", rec.job_id),
            });
        }
        if rec.version != RECORD_VERSION {
            return Err(StateError::Corrupt {
                path: p,
                msg: format!(
                    "record format version {} (this gpufence reads {RECORD_VERSION})",
                    rec.version
                ),
            });
        }
        Ok(Some(rec))
    }

    /// Removes a job's record; absent is fine.
    ///
    /// # Errors
    /// [`StateError::Io`] for anything but "not found".
    pub fn remove_record(&self, job_id: u32) -> Result<(), StateError> {
        remove_if_exists(&self.record_path(job_id))
    }

    /// `<state_dir>/ended`: one small file per job whose Epilog ended it
    /// (named by the job id, holding the end time), so that a second
    /// Epilog of the job (slurmctld resends TERMINATE_JOB after a lost
    /// EPILOG_COMPLETE and slurmd runs it again once its dedup entry
    /// expired: SchedMD commit 2090c3af3b, ticket 24874, before 26.05)
    /// knows it was ended. Kept at most [`ENDED_KEPT`] files.
    pub fn ended_dir(&self) -> PathBuf {
        self.root.join("ended")
    }

    /// Notes that job `job_id` was ended at `when` (RFC 3339). Every
    /// [`ENDED_PRUNE_EVERY`]th job id, the oldest notes past
    /// [`ENDED_KEPT`] are removed (a directory read, not one per Epilog).
    ///
    /// # Errors
    /// [`StateError::Io`].
    pub fn write_ended(&self, job_id: u32, when: &str) -> Result<(), StateError> {
        let d = Self::made(self.ended_dir())?;
        let p = d.join(job_id.to_string());
        write_atomic(&p, when.as_bytes(), 0o600).map_err(io_err(&p))?;
        if job_id.is_multiple_of(ENDED_PRUNE_EVERY) {
            self.prune_ended(ENDED_KEPT);
        }
        Ok(())
    }

    /// When job `job_id` was ended, if an Epilog noted it
    /// ([`StateDir::write_ended`]).
    pub fn ended_at(&self, job_id: u32) -> Option<String> {
        let t = std::fs::read_to_string(self.ended_dir().join(job_id.to_string())).ok()?;
        let t = t.trim();
        (!t.is_empty() && t.len() <= 64).then(|| t.to_string())
    }

    /// Removes job `job_id`'s end note (a new job with that id started:
    /// ids wrapped, or `slurmctld -i`); absent is fine.
    ///
    /// # Errors
    /// [`StateError::Io`] for anything but "not found".
    pub fn remove_ended(&self, job_id: u32) -> Result<(), StateError> {
        remove_if_exists(&self.ended_dir().join(job_id.to_string()))
    }

    /// Removes the oldest end notes (by modification time) past `keep`
    /// ([`ENDED_KEPT`] in the Epilog); what cannot be read or removed is
    /// left.
    pub fn prune_ended(&self, keep: usize) {
        let Ok(rd) = std::fs::read_dir(self.ended_dir()) else {
            return;
        };
        let mut notes: Vec<(std::time::SystemTime, PathBuf)> = rd
            .flatten()
            .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
            .collect();
        if notes.len() <= keep {
            return;
        }
        notes.sort();
        let extra = notes.len() - keep;
        for (_, p) in notes.into_iter().take(extra) {
            let _ = std::fs::remove_file(p);
        }
    }

    fn applied_path(&self, job_id: u32, cgroup_id: u64) -> PathBuf {
        self.applied_dir()
            .join(format!("{job_id}-{cgroup_id}.json"))
    }

    /// Notes that a grant was applied.
    ///
    /// # Errors
    /// [`StateError::Io`].
    pub fn write_applied(&self, a: &AppliedGrant) -> Result<(), StateError> {
        Self::made(self.applied_dir())?;
        let p = self.applied_path(a.job_id, a.cgroup_id);
        let bytes = serde_json::to_vec(a).map_err(|e| StateError::Corrupt {
            path: p.clone(),
            msg: e.to_string(),
        })?;
        write_atomic(&p, &bytes, 0o600).map_err(io_err(&p))
    }

    /// Every applied-grant note, optionally for one job only. Corrupt notes
    /// are returned as errors beside the good ones, never hidden.
    pub fn applied(&self, job_id: Option<u32>) -> (Vec<AppliedGrant>, Vec<StateError>) {
        let dir = self.applied_dir();
        let mut good = Vec::new();
        let mut bad = Vec::new();
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return (good, bad),
            Err(e) => {
                bad.push(io_err(&dir)(e));
                return (good, bad);
            }
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if !name.ends_with(".json") || name.starts_with('.') {
                continue;
            }
            if let Some(j) = job_id {
                if !name.starts_with(&format!("{j}-")) {
                    continue;
                }
            }
            let p = entry.path();
            match std::fs::read(&p) {
                Ok(b) => match serde_json::from_slice::<AppliedGrant>(&b) {
                    Ok(a) => good.push(a),
                    Err(e) => bad.push(StateError::Corrupt {
                        path: p,
                        msg: e.to_string(),
                    }),
                },
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => bad.push(io_err(&p)(e)),
            }
        }
        good.sort_by_key(|a| (a.job_id, a.cgroup_id));
        (good, bad)
    }

    /// Removes a job's applied-grant notes.
    ///
    /// # Errors
    /// The first removal that failed for another reason than "not found".
    pub fn remove_applied(&self, job_id: u32) -> Result<(), StateError> {
        let (notes, _) = self.applied(Some(job_id));
        for a in notes {
            remove_if_exists(&self.applied_path(a.job_id, a.cgroup_id))?;
        }
        Ok(())
    }
}

fn remove_if_exists(p: &Path) -> Result<(), StateError> {
    match std::fs::remove_file(p) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err(p)(e)),
        _ => Ok(()),
    }
}

/// A Slurm node name as a part of a file name in `state_dir`: characters
/// outside `[A-Za-z0-9._-]` become `_`.
pub fn node_file_name(node: &str) -> String {
    node.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Now, as RFC 3339 with microseconds, in UTC.
pub fn now_rfc3339() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{Access, DevNum, DeviceRole};

    fn rec(job: u32) -> JobRecord {
        JobRecord {
            version: RECORD_VERSION,
            job_id: job,
            uid: 1000,
            gres_indices: vec![1],
            devices: vec![DeviceGrant {
                path: "/dev/nvidia3".into(),
                dev: DevNum::new(195, 3),
                access: Access::RW,
                role: DeviceRole::Gres,
                gres_index: Some(1),
            }],
            created: now_rfc3339(),
            notes: vec![],
            user_notes: vec![],
            gpu_idle: vec![],
            mig: vec![],
            cuda_visible_devices: vec![],
            saved_compute_modes: vec![],
            job_map: Vec::new(),
            mps: vec![],
        }
    }

    /// An ended job is noted, read back, forgotten when its id is reused;
    /// past the bound the oldest notes go.
    #[test]
    fn end_notes_are_kept_within_their_bound() {
        let d = tempfile::tempdir().unwrap();
        let st = StateDir::new(d.path());
        assert_eq!(st.ended_at(7), None);
        st.write_ended(7, "2026-12-07T10:00:00Z").unwrap();
        assert_eq!(st.ended_at(7).as_deref(), Some("2026-12-07T10:00:00Z"));
        st.remove_ended(7).unwrap();
        st.remove_ended(7).unwrap();
        assert_eq!(st.ended_at(7), None);
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        for id in 1001..=1008 {
            st.write_ended(id, "t").unwrap();
            if id <= 1003 {
                std::fs::File::options()
                    .write(true)
                    .open(st.ended_dir().join(id.to_string()))
                    .unwrap()
                    .set_modified(old)
                    .unwrap();
            }
        }
        st.prune_ended(5);
        let left = std::fs::read_dir(st.ended_dir()).unwrap().count();
        assert_eq!(left, 5);
        for id in 1001..=1003 {
            assert_eq!(st.ended_at(id), None, "the oldest go: {id}");
        }
        assert!(st.ended_at(1004).is_some());
    }

    #[test]
    fn records_round_trip_and_vanish() {
        let d = tempfile::tempdir().unwrap();
        let s = StateDir::new(d.path().join("state"));
        assert_eq!(s.read_record(7).unwrap(), None);
        s.write_record(&rec(7)).unwrap();
        assert_eq!(
            s.read_record(7).unwrap(),
            Some(rec(7)).map(|mut r| {
                r.created = s.read_record(7).unwrap().unwrap().created;
                r
            })
        );
        s.remove_record(7).unwrap();
        s.remove_record(7).unwrap();
        assert_eq!(s.read_record(7).unwrap(), None);
    }

    #[test]
    fn corrupt_or_misplaced_records_are_errors() {
        let d = tempfile::tempdir().unwrap();
        let s = StateDir::new(d.path());
        s.write_record(&rec(8)).unwrap();
        std::fs::rename(s.record_path(8), s.record_path(9)).unwrap();
        assert!(matches!(s.read_record(9), Err(StateError::Corrupt { .. })));
        std::fs::write(s.record_path(10), b"{\"version\":1,").unwrap();
        assert!(matches!(s.read_record(10), Err(StateError::Corrupt { .. })));
    }

    #[test]
    fn other_record_versions_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let s = StateDir::new(d.path());
        let mut r = rec(12);
        r.version = 2;
        s.write_record(&r).unwrap();
        let e = s.read_record(12).unwrap_err().to_string();
        assert!(e.contains("12.json") && e.contains("version 2"), "{e}");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(300))]

        /// Any bytes in a record file: a record, or an error naming the
        /// file (and, for malformed JSON, the line); never a panic.
        #[test]
        fn any_record_file_is_read_or_named(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300)) {
            let d = tempfile::tempdir().unwrap();
            let s = StateDir::new(d.path());
            std::fs::create_dir_all(d.path().join("jobs")).unwrap();
            std::fs::write(s.record_path(3), &bytes).unwrap();
            if let Err(e) = s.read_record(3) {
                let m = e.to_string();
                proptest::prop_assert!(m.contains("jobs/3.json"), "{}", m);
                proptest::prop_assert!(!m.contains('\n'), "{}", m);
            }
        }

        /// A real record cut or with one byte changed: whole, or an error
        /// naming the file and the line of the fault.
        #[test]
        fn damaged_records_name_file_and_line(cut in 0usize..2000, at in 0usize..2000, b in proptest::prelude::any::<u8>()) {
            let d = tempfile::tempdir().unwrap();
            let s = StateDir::new(d.path());
            s.write_record(&rec(4)).unwrap();
            let mut bytes = std::fs::read(s.record_path(4)).unwrap();
            let n = bytes.len();
            bytes[at % n] = b;
            bytes.truncate(cut % (n + 1));
            std::fs::write(s.record_path(4), &bytes).unwrap();
            match s.read_record(4) {
                Ok(_) => {}
                Err(StateError::Corrupt { path, msg }) => {
                    proptest::prop_assert_eq!(path, s.record_path(4));
                    proptest::prop_assert!(
                        msg.contains(" line ") || msg.contains("holds job") || msg.contains("version"),
                        "{}", msg
                    );
                }
                Err(e) => proptest::prop_assert!(false, "{}", e),
            }
        }

        /// Applied-grant notes with any content: the good ones listed, the
        /// bad ones as errors naming their file; never a panic.
        #[test]
        fn any_applied_note_is_listed_or_named(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200)) {
            let d = tempfile::tempdir().unwrap();
            let s = StateDir::new(d.path());
            std::fs::create_dir_all(d.path().join("applied")).unwrap();
            std::fs::write(d.path().join("applied/5-9.json"), &bytes).unwrap();
            let (good, bad) = s.applied(None);
            proptest::prop_assert_eq!(good.len() + bad.len(), 1);
            for e in bad {
                proptest::prop_assert!(e.to_string().contains("5-9.json"), "{}", e);
            }
        }
    }

    #[test]
    fn every_state_path_is_named_here_and_under_the_root() {
        let d = tempfile::tempdir().unwrap();
        let s = StateDir::new(d.path());
        let r = |p: PathBuf| p.strip_prefix(d.path()).unwrap().display().to_string();
        assert_eq!(r(s.record_path(3)), "jobs/3.json");
        assert_eq!(r(s.nvml_unavailable_path()), "nvml-unavailable.txt");
        assert_eq!(
            r(s.mps_daemon_lock_path("gpu3-u5")),
            "mps-locks/gpu3-u5.lock"
        );
        assert_eq!(r(s.mps_registration_path("gpu3", 50)), "mps/gpu3/50");
        assert_eq!(r(s.responding_dir()), "responding");
        assert_eq!(r(s.sweep_lock_path()), "sweep/lock");
        assert_eq!(r(s.denials_path(None)), "sweep/denials.json");
        assert_eq!(r(s.denials_path(Some("a"))), "sweep/denials-a.json");
        assert_eq!(r(s.systemd_baseline_path()), "sweep/systemd-baseline.json");
        assert!(s.recorded_jobs().is_empty());
        for job in [12, 3] {
            s.write_record(&rec(job)).unwrap();
        }
        std::fs::write(s.jobs_dir().join(".gpufence-x.tmp"), b"").unwrap();
        assert_eq!(s.recorded_jobs(), [3, 12]);
    }

    #[test]
    fn applied_notes_by_job() {
        let d = tempfile::tempdir().unwrap();
        let s = StateDir::new(d.path());
        for (job, cg) in [(5, 100), (5, 101), (51, 100)] {
            s.write_applied(&AppliedGrant {
                job_id: job,
                step: "0".into(),
                cgroup_id: cg,
                cgroup_path: format!("job_{job}"),
                applied: now_rfc3339(),
            })
            .unwrap();
        }
        assert_eq!(s.applied(Some(5)).0.len(), 2);
        assert_eq!(s.applied(None).0.len(), 3);
        s.remove_applied(5).unwrap();
        let (left, bad) = s.applied(None);
        assert_eq!((left.len(), left[0].job_id, bad.len()), (1, 51, 0));
    }
}
