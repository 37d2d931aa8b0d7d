//! The job's record as the Prolog builds it: the GRES files of its
//! indices by device number, the control devices, its MIG slices and,
//! when the site asks, the IMEX channel. Nothing is written here.

use std::collections::BTreeSet;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;

use gpufence_model::device::{Access, DevNum, DeviceGrant, DeviceRole};
use gpufence_model::nvproc::MigMinors;
use gpufence_model::record::{now_rfc3339, JobRecord, RECORD_VERSION};

use super::env::PrologEnv;
use super::mig::{index_mig, mig_cap, read_mig_minors};
use crate::host::gresmap;
use crate::{Node, NodeError};

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

#[cfg(test)]
mod tests {
    use super::super::env::tests::env;
    use super::*;
    use gpufence_model::config::{Config, ConfigOrigin};

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
}
