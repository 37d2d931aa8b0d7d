//! MIG in a job's GRES: which capability each `nvidia-caps` device is
//! (`mig-minors`, never guessed), which of them are granted, and the
//! job's slices (a GPU instance, a compute instance, their parent) for
//! its record.

use std::path::Path;

use gpufence_model::device::DevNum;
use gpufence_model::nvproc::{parse_mig_minors, CapKind, MigMinors};
use gpufence_model::record::{JobRecord, MigSlice};

use crate::{Node, NodeError};

/// `mig-minors` relative to `proc_dir` (`nv_procfs_read_mig_minors`,
/// `kernel-open/nvidia/nv-caps.c`).
pub const MIG_MINORS: &str = "driver/nvidia-caps/mig-minors";

/// A MIG capability `dev` (`file`) of a GRES index, by what
/// `mig-minors` says it is: a GPU instance's or a compute instance's cap
/// goes into `gi` / `ci`; the config capability is never granted, the
/// monitor capability only with `grant_mig_monitor` (a note says so).
/// Returns whether to grant it.
///
/// # Errors
/// [`NodeError::Mig`] for a capability that is not a MIG instance's or
/// that `mig-minors` does not list.
pub(super) fn mig_cap(
    node: &Node,
    mm: &MigMinors,
    file: &Path,
    dev: DevNum,
    notes: &mut Vec<String>,
    gi: &mut Option<(u32, u32, DevNum)>,
    ci: &mut Option<(u32, DevNum)>,
) -> Result<bool, NodeError> {
    match mm.kind_of(dev.minor) {
        Some(CapKind::Config) => {
            notes.push(format!(
                "{} is the MIG config capability: never granted (it reconfigures MIG for every job)",
                file.display()
            ));
            Ok(false)
        }
        Some(CapKind::Monitor) if !node.cfg.grant_mig_monitor => {
            notes.push(format!(
                "{} is the MIG monitor capability: not granted (grant_mig_monitor = false)",
                file.display()
            ));
            Ok(false)
        }
        Some(CapKind::Monitor) => Ok(true),
        Some(CapKind::GpuInstance { gpu, gi: g }) => {
            *gi = Some((*gpu, *g, dev));
            Ok(true)
        }
        Some(CapKind::ComputeInstance { gpu, gi: g, ci: c }) => {
            *ci = Some((*c, dev));
            if gi.is_none() {
                // The GI cap by number, for the record; it is granted only
                // if the GRES lists it too.
                let m = mm.gi_minor(*gpu, *g).unwrap_or(dev.minor);
                *gi = Some((*gpu, *g, DevNum::new(dev.major, m)));
            }
            Ok(true)
        }
        Some(CapKind::Other(name)) => Err(NodeError::Mig(format!(
            "{} is the capability {name:?}, not a MIG instance: not granted; fix gres.conf",
            file.display()
        ))),
        None => Err(NodeError::Mig(format!(
            "{} ({dev}) is not listed in {}: cannot tell which MIG capability it is",
            file.display(),
            node.cfg.proc_dir.join(MIG_MINORS).display()
        ))),
    }
}

/// The MIG side of GRES index `index` once its files are read: its slice
/// (`parent` with the `gi` / `ci` caps) into the record, or a note when it
/// grants a MIG-partitioned GPU's parent alone.
///
/// # Errors
/// [`NodeError::Mig`] when caps come without their parent, or with
/// another GPU's.
pub(super) fn index_mig(
    node: &Node,
    index: u32,
    parent: Option<DevNum>,
    gi: Option<(u32, u32, DevNum)>,
    ci: Option<(u32, DevNum)>,
    rec: &mut JobRecord,
) -> Result<(), NodeError> {
    if let (Some(parent), None) = (parent, gi) {
        let instances = mig_instances(node, parent.minor);
        if !instances.is_empty() {
            rec.notes.push(format!(
                "GRES index {index} grants /dev/nvidia{m} ({parent}) alone, but GPU {m} is MIG-partitioned \
                 (GPU instances {}): the parent alone runs no CUDA work and is shared with the jobs holding its \
                 instances; gres.conf should give each MIG instance as the parent with its caps \
                 (MultipleFiles=, Slurm's gres.conf(5))",
                instances
                    .iter()
                    .map(|g| format!("gi{g}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                m = parent.minor,
            ));
        }
    }
    if let Some((gpu_minor, g, gi_cap)) = gi {
        let parent = parent.ok_or_else(|| {
            NodeError::Mig(format!(
                "GRES index {index} holds MIG caps of gpu{gpu_minor} but not its parent /dev/nvidia{gpu_minor}"
            ))
        })?;
        if parent.minor != gpu_minor {
            return Err(NodeError::Mig(format!(
                "GRES index {index}: caps of gpu{gpu_minor} listed with /dev/nvidia{}",
                parent.minor
            )));
        }
        rec.mig.push(MigSlice {
            parent,
            gpu: gpu_minor,
            gi: g,
            ci: ci.map(|(c, _)| c),
            gi_cap,
            ci_cap: ci.map(|(_, d)| d),
        });
    }
    Ok(())
}

/// The GPU instances that exist on the GPU of device minor `gpu`: the
/// `gi<N>` directories of the driver's capability tree,
/// `<proc_dir>/driver/nvidia/capabilities/gpu<gpu>/mig/` (NVIDIA MIG user
/// guide, "Device Nodes and Capabilities"); none when the GPU is not
/// partitioned or the tree cannot be read.
fn mig_instances(node: &Node, gpu: u32) -> Vec<u32> {
    let dir = node
        .cfg
        .proc_dir
        .join(format!("driver/nvidia/capabilities/gpu{gpu}/mig"));
    let mut out: Vec<u32> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().to_str()?.strip_prefix("gi")?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    out.sort_unstable();
    out
}

/// Reads `<proc_dir>/driver/nvidia-caps/mig-minors`.
///
/// # Errors
/// [`NodeError::Mig`] when it is missing or malformed: a cap that cannot be
/// identified is never granted.
pub fn read_mig_minors(node: &Node) -> Result<MigMinors, NodeError> {
    let p = node.cfg.proc_dir.join(MIG_MINORS);
    let text = std::fs::read_to_string(&p).map_err(|e| {
        NodeError::Mig(format!(
            "{}: {e}: MIG capabilities in a GRES cannot be identified",
            p.display()
        ))
    })?;
    Ok(parse_mig_minors(&text, &p)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpufence_model::config::{Config, ConfigOrigin};
    use gpufence_model::record::RECORD_VERSION;

    const MINORS: &str = "config 1\nmonitor 2\ngpu0/gi0/access 3\ngpu0/gi0/ci0/access 4\n\
                          gpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\nfabric-imex 99\n";
    const CAPS: u32 = 237;

    /// A node whose `proc_dir` is `dir/proc`, holding `mig-minors` and
    /// GPU 0's capability tree with GPU instances 0 and 1.
    fn node(dir: &Path, extra: &str) -> Node {
        let proc = dir.join("proc");
        std::fs::create_dir_all(proc.join("driver/nvidia-caps")).unwrap();
        std::fs::write(proc.join(MIG_MINORS), MINORS).unwrap();
        for gi in ["gi0", "gi1"] {
            std::fs::create_dir_all(proc.join("driver/nvidia/capabilities/gpu0/mig").join(gi))
                .unwrap();
        }
        let text = format!(
            "state_dir = \"{d}/state\"\naudit_log = \"{d}/a.jsonl\"\nproc_dir = \"{p}\"\n{extra}",
            d = dir.display(),
            p = proc.display()
        );
        Node::new(
            Config::parse(&text, Path::new("t.toml")).unwrap(),
            ConfigOrigin::Defaults,
        )
        .unwrap()
    }

    fn record() -> JobRecord {
        JobRecord {
            version: RECORD_VERSION,
            job_id: 9,
            uid: 1000,
            gres_indices: vec![0],
            devices: Vec::new(),
            created: String::new(),
            notes: Vec::new(),
            user_notes: Vec::new(),
            gpu_idle: Vec::new(),
            mig: Vec::new(),
            saved_compute_modes: Vec::new(),
            job_map: Vec::new(),
            mps: Vec::new(),
            cuda_visible_devices: Vec::new(),
        }
    }

    /// Each capability is what `mig-minors` says: a GPU and a compute
    /// instance's are granted and make the slice; the config capability
    /// never, the monitor only with `grant_mig_monitor`; one that is not a
    /// MIG instance's, or that the table does not list, is an error.
    #[test]
    fn caps_are_what_mig_minors_says() {
        let d = tempfile::tempdir().unwrap();
        let n = node(d.path(), "");
        let mm = read_mig_minors(&n).unwrap();
        let f = Path::new("/dev/nvidia-caps/nvidia-cap");
        let (mut notes, mut gi, mut ci) = (Vec::new(), None, None);
        let cap = |minor: u32, notes: &mut Vec<String>, gi: &mut _, ci: &mut _| {
            mig_cap(&n, &mm, f, DevNum::new(CAPS, minor), notes, gi, ci)
        };
        assert!(!cap(1, &mut notes, &mut gi, &mut ci).unwrap(), "config");
        assert!(!cap(2, &mut notes, &mut gi, &mut ci).unwrap(), "monitor");
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert!(notes[0].contains("config capability") && notes[1].contains("grant_mig_monitor"));
        assert_eq!((gi, ci), (None, None));
        assert!(
            cap(13, &mut notes, &mut gi, &mut ci).unwrap(),
            "gpu0/gi1/ci0"
        );
        // The GPU instance's cap is found by number for the record.
        assert_eq!(gi, Some((0, 1, DevNum::new(CAPS, 12))));
        assert_eq!(ci, Some((0, DevNum::new(CAPS, 13))));
        assert!(
            matches!(cap(99, &mut notes, &mut gi, &mut ci), Err(NodeError::Mig(m)) if m.contains("not a MIG instance"))
        );
        assert!(
            matches!(cap(500, &mut notes, &mut gi, &mut ci), Err(NodeError::Mig(m)) if m.contains("not listed"))
        );
        let n = node(d.path(), "grant_mig_monitor = true\n");
        let mut gi = None;
        assert!(mig_cap(
            &n,
            &mm,
            f,
            DevNum::new(CAPS, 2),
            &mut notes,
            &mut gi,
            &mut None
        )
        .unwrap());
    }

    /// A slice goes into the record with its parent; caps without their
    /// parent, or with another GPU's, are errors; a MIG-partitioned GPU's
    /// parent alone is granted with a note naming its instances.
    #[test]
    fn slices_need_their_parent() {
        let d = tempfile::tempdir().unwrap();
        let n = node(d.path(), "");
        let gpu0 = DevNum::new(195, 0);
        let gi = Some((0, 1, DevNum::new(CAPS, 12)));
        let ci = Some((0, DevNum::new(CAPS, 13)));
        let mut rec = record();
        index_mig(&n, 0, Some(gpu0), gi, ci, &mut rec).unwrap();
        assert_eq!(
            rec.mig,
            vec![MigSlice {
                parent: gpu0,
                gpu: 0,
                gi: 1,
                ci: Some(0),
                gi_cap: DevNum::new(CAPS, 12),
                ci_cap: Some(DevNum::new(CAPS, 13)),
            }]
        );
        assert!(
            matches!(index_mig(&n, 0, None, gi, ci, &mut record()), Err(NodeError::Mig(m)) if m.contains("not its parent"))
        );
        assert!(matches!(
            index_mig(&n, 0, Some(DevNum::new(195, 1)), gi, ci, &mut record()),
            Err(NodeError::Mig(m)) if m.contains("listed with /dev/nvidia1")
        ));
        let mut rec = record();
        index_mig(&n, 0, Some(gpu0), None, None, &mut rec).unwrap();
        assert!(rec.mig.is_empty());
        assert!(
            rec.notes
                .iter()
                .any(|m| m.contains("MIG-partitioned") && m.contains("gi0, gi1")),
            "{:?}",
            rec.notes
        );
        // Not partitioned: no note.
        let mut rec = record();
        index_mig(&n, 0, Some(DevNum::new(195, 3)), None, None, &mut rec).unwrap();
        assert!(rec.notes.is_empty() && rec.mig.is_empty());
    }

    /// A missing or malformed `mig-minors` is an error: a cap that cannot
    /// be identified is never granted.
    #[test]
    fn an_unreadable_table_is_an_error() {
        let d = tempfile::tempdir().unwrap();
        let n = node(d.path(), "");
        std::fs::write(d.path().join("proc").join(MIG_MINORS), "config one\n").unwrap();
        assert!(read_mig_minors(&n).is_err());
        std::fs::remove_file(d.path().join("proc").join(MIG_MINORS)).unwrap();
        assert!(
            matches!(read_mig_minors(&n), Err(NodeError::Mig(m)) if m.contains("cannot be identified"))
        );
    }
}
