//! The device inventory admins read (`gpufence devices`): per GPU its minor,
//! UUID, PCI bus id, model, MIG mode and MIG slices with their capability
//! minors and device files; the protected majors and which device files
//! exist on them; and what the driver (NVML) adds when it is there.
//!
//! Every path goes through `proc_dir` and `dev_dir`, so tests run on
//! fixture trees.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use serde::Serialize;

use gpufence_model::device::DevNum;
use gpufence_model::nvproc::{read_inventory, CapKind};

use crate::Node;

/// One MIG slice (a GPU instance, or a compute instance inside one).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MigEntry {
    /// GPU instance id.
    pub gi: u32,
    /// Compute instance id; `None` for the GPU instance's own entry.
    pub ci: Option<u32>,
    /// The access capability's minor on the `nvidia-caps` major.
    pub cap_minor: u32,
    /// Its device file, when one exists under `dev_dir`.
    pub device_file: Option<PathBuf>,
}

/// One GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GpuEntry {
    /// `/dev/nvidia<minor>`.
    pub minor: u32,
    /// `GPU-...`.
    pub uuid: String,
    /// PCI bus id.
    pub pci_bus_id: String,
    /// Model, from `information` (and NVML's name when it differs).
    pub model: String,
    /// Its device file, when it exists.
    pub device_file: Option<PathBuf>,
    /// `enabled` / `disabled` per NVML (with `pending` when a change waits
    /// for a reset); else `instances present` / `no instances` from /proc.
    pub mig_mode: String,
    /// MIG slices from the capability tree.
    pub mig: Vec<MigEntry>,
    /// MIG devices per NVML: `(uuid, profile)`, e.g. `3g.40gb`.
    pub nvml_mig_devices: Vec<(String, String)>,
    /// Total memory per NVML, bytes.
    pub memory_total: Option<u64>,
}

/// A protected major and the device files on it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MajorEntry {
    /// The major.
    pub major: u32,
    /// Its names in `/proc/devices` (or the `[majors]` table).
    pub names: Vec<String>,
    /// Device files under `dev_dir` on this major.
    pub files: Vec<PathBuf>,
}

/// The whole inventory.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Devices {
    /// GPUs by minor.
    pub gpus: Vec<GpuEntry>,
    /// Protected majors.
    pub majors: Vec<MajorEntry>,
    /// The MIG `config` and `monitor` capability minors, when known.
    pub mig_admin_caps: BTreeMap<String, u32>,
    /// Why NVML added nothing, when it did not.
    pub nvml_unavailable: Option<String>,
    /// Files that could not be read or parsed.
    pub errors: Vec<String>,
}

/// Character device files under `dir` (recursively, not following links):
/// number → paths.
pub fn char_devices(dir: &Path) -> BTreeMap<DevNum, Vec<PathBuf>> {
    let mut out: BTreeMap<DevNum, Vec<PathBuf>> = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(md) = std::fs::symlink_metadata(e.path()) else {
                continue;
            };
            if md.is_dir() {
                stack.push(e.path());
            } else if md.file_type().is_char_device() {
                out.entry(DevNum::from_rdev(md.rdev()))
                    .or_default()
                    .push(e.path());
            }
        }
    }
    for v in out.values_mut() {
        v.sort();
    }
    out
}

/// Builds the inventory for this node.
pub fn devices(node: &Node) -> Devices {
    let mut out = Devices::default();
    let inv = read_inventory(&node.cfg.proc_dir);
    out.errors.extend(inv.errors.iter().map(|e| e.to_string()));
    let devs = char_devices(&node.cfg.dev_dir);
    let protected = match node.protected_majors() {
        Ok(p) => p,
        Err(e) => {
            out.errors.push(e.to_string());
            Default::default()
        }
    };
    let gpu_major = node.gpu_major();
    let caps_major = protected.major_of("nvidia-caps");
    let file = |d: DevNum| devs.get(&d).and_then(|v| v.first().cloned());
    if let Some(mm) = &inv.mig_minors {
        for (k, m) in mm.iter() {
            if matches!(k, CapKind::Config | CapKind::Monitor) {
                out.mig_admin_caps.insert(k.to_string(), m);
            }
        }
    }
    let nvml = gpufence_nvml_view(node);
    out.nvml_unavailable = nvml.1.clone();
    for g in &inv.gpus {
        let mig: Vec<MigEntry> = inv
            .mig_of(g.device_minor)
            .map(|m| MigEntry {
                gi: m.gi,
                ci: m.ci,
                cap_minor: m.cap_minor,
                device_file: caps_major.and_then(|cm| file(DevNum::new(cm, m.cap_minor))),
            })
            .collect();
        let from_nvml = nvml.0.get(&g.device_minor);
        let mig_mode = match from_nvml.and_then(|n| n.mig_mode.clone()) {
            Some(m) => m,
            None if !mig.is_empty() => "instances present".into(),
            None => "no instances".into(),
        };
        out.gpus.push(GpuEntry {
            minor: g.device_minor,
            uuid: g.uuid.clone(),
            pci_bus_id: g.bus_location.clone(),
            model: match from_nvml.and_then(|n| n.name.clone()) {
                Some(n) if n != g.model => format!("{} (NVML: {n})", g.model),
                _ => g.model.clone(),
            },
            device_file: file(DevNum::new(gpu_major, g.device_minor)),
            mig_mode,
            mig,
            nvml_mig_devices: from_nvml.map(|n| n.mig_devices.clone()).unwrap_or_default(),
            memory_total: from_nvml.and_then(|n| n.memory_total),
        });
    }
    out.gpus.sort_by_key(|g| g.minor);
    for major in protected.majors() {
        out.majors.push(MajorEntry {
            major,
            names: protected.names(major).map(str::to_string).collect(),
            files: devs
                .iter()
                .filter(|(d, _)| d.major == major)
                .flat_map(|(_, p)| p.iter().cloned())
                .collect(),
        });
    }
    out
}

#[derive(Default)]
struct NvmlGpu {
    name: Option<String>,
    mig_mode: Option<String>,
    mig_devices: Vec<(String, String)>,
    memory_total: Option<u64>,
}

/// What NVML says per GPU minor, or why it says nothing.
fn gpufence_nvml_view(node: &Node) -> (BTreeMap<u32, NvmlGpu>, Option<String>) {
    if !node.cfg.nvml {
        return (BTreeMap::new(), Some("disabled in the config".into()));
    }
    let nvml = match nvml_wrapper::Nvml::builder()
        .lib_path(OsStr::new(node.cfg.nvml_library.as_os_str()))
        .init()
    {
        Ok(n) => n,
        Err(e) => {
            return (
                BTreeMap::new(),
                Some(format!("{}: {e}", node.cfg.nvml_library.display())),
            )
        }
    };
    let mut out = BTreeMap::new();
    let n = nvml.device_count().unwrap_or(0);
    for i in 0..n {
        let Ok(d) = nvml.device_by_index(i) else {
            continue;
        };
        let Ok(minor) = d.minor_number() else {
            continue;
        };
        let mut g = NvmlGpu {
            name: d.name().ok(),
            memory_total: d.memory_info().ok().map(|m| m.total),
            ..Default::default()
        };
        if let Ok(m) = d.mig_mode() {
            g.mig_mode = Some(match (m.current, m.pending) {
                (1, 1) => "enabled".into(),
                (0, 0) => "disabled".into(),
                (c, p) => format!(
                    "{} (pending {} after reset)",
                    if c == 1 { "enabled" } else { "disabled" },
                    if p == 1 { "enabled" } else { "disabled" }
                ),
            });
            if m.current == 1 {
                for j in 0..d.mig_device_count().unwrap_or(0) {
                    if let Ok(md) = d.mig_device_by_index(j) {
                        let name = md.name().unwrap_or_default();
                        let profile = name
                            .rsplit_once("MIG ")
                            .map(|(_, p)| p.to_string())
                            .unwrap_or(name);
                        g.mig_devices.push((md.uuid().unwrap_or_default(), profile));
                    }
                }
            }
        }
        out.insert(minor, g);
    }
    (out, None)
}
