//! The job map for GPU monitoring (`job_map_dir`): which jobs are on which
//! GPU, in the format GPU exporters read.
//!
//! dcgm-exporter (`--hpc-job-mapping-dir`, `DCGM_HPC_JOB_MAPPING_DIR`;
//! `internal/pkg/transformation/hpc.go`, re-read at each collection),
//! CEEMS (`gpu_job_map_dir`) and jobstats label a GPU's metrics with the
//! jobs listed in a directory holding one file per GPU: named by the GPU's
//! NVML index (dcgm-exporter's `gpu` label), or `<index>.<GPU instance
//! id>` for a MIG slice (`^\d+(\.\d+)?$`; NVML's GPU instance id, not a MIG
//! device index), holding the ids of the jobs on it, one per line.
//!
//! Site Prolog scripts write these files from `CUDA_VISIBLE_DEVICES` or
//! `SLURM_JOB_GPUS`, which are GRES indices, not NVML indices: wrong
//! wherever gres.conf does not list the GPUs in PCI bus order
//! (PrincetonUniversity/jobstats#34, guilbaults/slurm-job-exporter#63).
//! Here the job's GPUs come from its record (the device numbers Slurm
//! allocated, [`JobRecord::gpu_minors`], and its MIG slices' parent minor
//! and GPU instance id, [`MigSlice`]), and each minor's NVML index from
//! NVML itself ([`crate::host::gpus::Gpus::indices`]); never from the job's environment.
//!
//! The Prolog names the job's files in its record ([`name_files`],
//! [`JobRecord::job_map`]) and, once the record is written, rewrites the
//! map ([`sync`]); the Epilog rewrites it without the job. A rewrite
//! recomputes every file from every job record under `state_dir`, under
//! one lock (`<state_dir>/job-map.lock`), so co-tenants of a GPU
//! (gres/shard, gres/mps) are each listed, two Prologs or Epilogs at once
//! lose no line, and a file no job holds any more is removed. Without NVML
//! (or on an NVML error) the job gets no file and one note says why: a
//! wrong index is worse than none.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpufence_model::fsutil::{create_dir_all_mode, lock_file_within, write_atomic};
use gpufence_model::record::{JobRecord, MigSlice};

use crate::host::gpus::GpuError;
use crate::Node;

/// How long a rewrite waits for another Prolog's or Epilog's to finish.
pub const LOCK_WAIT: Duration = Duration::from_secs(5);

/// Mode of the map directory when gpufence makes it (exporters run as
/// other users).
pub const DIR_MODE: u32 = 0o755;

/// Mode of each map file.
pub const FILE_MODE: u32 = 0o644;

/// Why the map could not be rewritten.
#[derive(Debug, thiserror::Error)]
pub enum JobMapError {
    /// Making the directory, reading it, or writing or removing a file
    /// (or the lock file) failed.
    #[error("job map {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// Another Prolog or Epilog held the lock for [`LOCK_WAIT`].
    #[error("job map: {lock} was held by another Prolog or Epilog for {}s", waited.as_secs())]
    Busy {
        /// The lock file.
        lock: PathBuf,
        /// How long this one waited.
        waited: Duration,
    },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> JobMapError + '_ {
    move |source| JobMapError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Whether `name` is a map file's name: `<index>` or `<index>.<gi>`,
/// decimal (`^\d+(\.\d+)?$`, dcgm-exporter's). Nothing else in the
/// directory is read, written or removed.
pub fn is_map_name(name: &str) -> bool {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    match name.split_once('.') {
        Some((index, gi)) => digits(index) && digits(gi),
        None => digits(name),
    }
}

/// The names of a job's map files: for each MIG slice
/// `<index of its parent>.<gi>`, for each other GPU `<index>`, from
/// `minors` (the job's GPUs), `mig` (its slices) and `indices` (minor →
/// NVML index, [`crate::host::gpus::Gpus::indices`]). A slice's parent is named only through
/// the slice: the whole GPU is not the job's. Ascending by index, then
/// GPU instance, each once.
///
/// # Errors
/// [`GpuError::NoSuchMinor`] for a GPU NVML does not list: then no name
/// at all (the job's map would be partial).
pub fn names(
    minors: &BTreeSet<u32>,
    mig: &[MigSlice],
    indices: &BTreeMap<u32, u32>,
) -> Result<Vec<String>, GpuError> {
    let index = |m: u32| indices.get(&m).copied().ok_or(GpuError::NoSuchMinor(m));
    let parents: BTreeSet<u32> = mig.iter().map(|s| s.gpu).collect();
    let mut out: BTreeSet<(u32, Option<u32>)> = BTreeSet::new();
    for s in mig {
        out.insert((index(s.gpu)?, Some(s.gi)));
    }
    for &m in minors.iter().filter(|m| !parents.contains(m)) {
        out.insert((index(m)?, None));
    }
    Ok(out
        .into_iter()
        .map(|(i, gi)| match gi {
            Some(g) => format!("{i}.{g}"),
            None => i.to_string(),
        })
        .collect())
}

/// The Prolog's half before the record is written: with `job_map_dir`
/// set, the names of the job's map files into [`JobRecord::job_map`],
/// from NVML's index of each of its GPUs. When NVML is unavailable or
/// fails, or does not list one of the job's GPUs, the job gets no file
/// and a note in [`JobRecord::notes`] says why (the Prolog's log line and
/// `grant_recorded` carry it). A job without GPUs gets nothing.
pub fn name_files(node: &Node, rec: &mut JobRecord) {
    if node.cfg.job_map_dir.is_none() {
        return;
    }
    let minors = rec.gpu_minors(node.gpu_major());
    if minors.is_empty() {
        return;
    }
    let gpus = node.open_gpus();
    match gpus
        .indices(&minors)
        .and_then(|ix| names(&minors, &rec.mig, &ix))
    {
        Ok(n) => rec.job_map = n,
        Err(e) => rec.notes.push(format!(
            "job_map_dir: no job map file for this job: {e}; a GPU's NVML index is told by NVML alone, \
             and a wrong one is worse than none"
        )),
    }
}

/// Rewrites the map in `job_map_dir` (nothing when it is unset) from the
/// job records under `state_dir`, leaving out job `leaving` (the Epilog's
/// job, whether its record is still there or not): each file lists the
/// jobs whose [`JobRecord::job_map`] names it, ascending, one per line;
/// a map file no job names is removed. Files are written atomically
/// (`0644`), only when their content changes; the directory is made
/// (`0755`) if missing. Under `<state_dir>/job-map.lock`, so the last of
/// several Prologs and Epilogs at once writes what all records say. A
/// record that cannot be read is left out (its Epilog reports it). Reads
/// one record per job on the node and one directory.
///
/// # Errors
/// [`JobMapError::Busy`] when the lock is not had within [`LOCK_WAIT`];
/// [`JobMapError::Io`] for the directory, a file or the lock.
pub fn sync(node: &Node, leaving: Option<u32>) -> Result<(), JobMapError> {
    let Some(dir) = &node.cfg.job_map_dir else {
        return Ok(());
    };
    let root = node.state.root();
    create_dir_all_mode(root, 0o700).map_err(io_err(root))?;
    let lock = node.state.job_map_lock_path();
    let wait = node.bound(crate::host::deadline::Wait::JobMap, LOCK_WAIT);
    let _held = lock_file_within(&lock, wait, Duration::from_millis(10))
        .map_err(io_err(&lock))?
        .ok_or(JobMapError::Busy {
            lock: lock.clone(),
            waited: wait,
        })?;
    create_dir_all_mode(dir, DIR_MODE).map_err(io_err(dir))?;
    let mut want: BTreeMap<String, BTreeSet<u32>> = BTreeMap::new();
    for job in node.state.recorded_jobs() {
        if Some(job) == leaving {
            continue;
        }
        let Ok(Some(rec)) = node.state.read_record(job) else {
            continue;
        };
        for name in rec.job_map.iter().filter(|n| is_map_name(n)) {
            want.entry(name.clone()).or_default().insert(job);
        }
    }
    let mut names: BTreeSet<String> = want.keys().cloned().collect();
    for e in std::fs::read_dir(dir).map_err(io_err(dir))?.flatten() {
        if let Some(n) = e.file_name().to_str().filter(|n| is_map_name(n)) {
            if e.file_type().is_ok_and(|t| t.is_file()) {
                names.insert(n.to_string());
            }
        }
    }
    for name in names {
        let path = dir.join(&name);
        match want.get(&name) {
            Some(jobs) => {
                let text: String = jobs.iter().map(|j| format!("{j}\n")).collect();
                if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
                    write_atomic(&path, text.as_bytes(), FILE_MODE).map_err(io_err(&path))?;
                }
            }
            None => match std::fs::remove_file(&path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(io_err(&path)(e)),
                _ => {}
            },
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpufence_model::device::DevNum;

    #[test]
    fn names_are_nvml_indices_and_slices() {
        let slice = |gpu, gi| MigSlice {
            parent: DevNum::new(195, gpu),
            gpu,
            gi,
            ci: Some(0),
            gi_cap: DevNum::new(242, 12),
            ci_cap: None,
        };
        // minor 3 is NVML index 0, minor 1 index 1.
        let ix: BTreeMap<u32, u32> = [(3, 0), (1, 1)].into();
        let minors: BTreeSet<u32> = [1, 3].into();
        assert_eq!(names(&minors, &[], &ix).unwrap(), vec!["0", "1"]);
        assert_eq!(
            names(&minors, &[slice(1, 2)], &ix).unwrap(),
            vec!["0", "1.2"],
            "a slice's parent is named through the slice only"
        );
        assert!(matches!(
            names(&[7].into(), &[], &ix),
            Err(GpuError::NoSuchMinor(7))
        ));
    }

    #[test]
    fn only_index_names_are_map_files() {
        for ok in ["0", "12", "3.1", "10.14"] {
            assert!(is_map_name(ok), "{ok}");
        }
        for bad in [
            "",
            ".",
            "1.",
            ".1",
            "1.2.3",
            "a",
            "-1",
            "../1",
            ".gpufence-x.tmp",
            "1 ",
        ] {
            assert!(!is_map_name(bad), "{bad}");
        }
    }
}
