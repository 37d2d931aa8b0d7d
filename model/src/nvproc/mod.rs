//! The NVIDIA driver's `/proc` files: per-GPU `information`, the MIG
//! capability minors, the MIG capability tree, and a walker that reads them
//! all into an [`Inventory`] (for `gpufence devices` and for MIG grants).
//!
//! Sources: NVIDIA's open kernel modules
//! (`github.com/NVIDIA/open-gpu-kernel-modules`, read at 595.45.04; the
//! shapes are the same back to 515.43.04) and the MIG User Guide, "Device
//! Nodes and Capabilities". Fixtures: `../testdata/nvproc/`.
//!
//! # `/proc/driver/nvidia/gpus/<pci bus id>/information`
//!
//! `nv_procfs_read_gpu_info()` in `kernel-open/nvidia/nv-procfs.c`; the
//! directory is named `"%04x:%02x:%02x.%1x"` (domain, bus, slot, function)
//! by `nv_procfs_add_gpu()` in the same file. One `Key: \t value` line each,
//! tabs and spaces between colon and value:
//!
//! ```text
//! Model:           NVIDIA H100 80GB HBM3      "Model: \t\t %s"
//! IRQ:             145                        "IRQ:   \t\t %d"
//! GPU UUID:        GPU-3f5a9c2e-...           "GPU UUID: \t %s"  (omitted when the UUID cache is invalid)
//! Video BIOS:      96.00.99.00.01             "Video BIOS: \t %s"
//! Bus Type:        PCIe                       "Bus Type: \t %s"  (PCIe or PCI)
//! DMA Size:        52 bits                    "DMA Size: \t %d bits"
//! DMA Mask:        0xfffffffffffff            "DMA Mask: \t 0x%llx"
//! Bus Location:    0000:18:00.0               "Bus Location: \t %04x:%02x:%02x.%x"
//! Device Minor:    0                          "Device Minor: \t %u"  (the N of /dev/nvidiaN)
//! GPU Firmware:    550.54.15                  "GPU Firmware: \t %s"  (N/A without GSP firmware)
//! BAR0:            0x... (16MB)               DEBUG builds only; kept in `other`
//! GPU Excluded:    No                         "GPU Excluded:\t %s"   (Yes or No)
//! ```
//!
//! # `/proc/driver/nvidia-caps/mig-minors`
//!
//! `nv_procfs_read_mig_minors()` in `kernel-open/nvidia/nv-caps.c` prints
//! `"%s %d\n"`, name and minor of the `nvidia-caps` character device
//! (`/dev/nvidia-caps/nvidia-cap<minor>`):
//!
//! ```text
//! config 1
//! monitor 2
//! gpu0/gi0/access 3
//! gpu0/gi0/ci0/access 4
//! ...
//! gpu0/gi0/ci7/access 11
//! gpu0/gi1/access 12
//! ...
//! gpu31/gi14/ci7/access 4322
//! ```
//!
//! The table is static (`g_nv_cap_mig_table`, `g_nv_cap_mig_gpu_table`,
//! numbered by `nv_cap_tables_init()`): every slot `gpu0..31` × `gi0..14` ×
//! (`access`, `ci0..7/access`) is listed whether or not that GPU or instance
//! exists. Minor 0 is nvlink's `fabric-mgmt` (in `nvlink-minors`) and 4323
//! is `fabric-imex-mgmt` (in `sys-minors`, since 550.40.07): same
//! `"%s %d"` shape, so [`parse_mig_minors`] reads those files too and returns
//! their names as [`CapKind::Other`]. IMEX channels are not capabilities:
//! they have their own major `nvidia-caps-imex-channels` and minor N is
//! `/dev/nvidia-caps-imex-channels/channelN` (`kernel-open/nvidia/nv-caps-imex.c`);
//! no `/proc` minors file lists them.
//!
//! **What `gpu<G>` numbers:** the GPU's *device minor*, the N of
//! `/dev/nvidiaN` and the `Device Minor:` of its `information` file: the
//! directory is made by `osRmCapRegisterGpu()`
//! (`src/nvidia/arch/nvalloc/unix/src/os.c`) as `"gpu%u"` of
//! `nv_get_dev_minor()`. It is *not* the NVML/`nvidia-smi` index (PCI order)
//! nor a CUDA index. `gi<I>` is the GPU instance id (`"gi%u"` of the swizzle
//! id, `osRmCapRegisterSmcPartition()`) and `ci<C>` the compute instance id
//! (`"ci%u"`, `osRmCapRegisterSmcExecutionPartition()`): the `GI ID` and
//! `CI ID` columns of `nvidia-smi`.
//!
//! # `/proc/driver/nvidia/capabilities/gpu<G>/mig/gi<I>[/ci<C>]/access`
//!
//! Present only while the instance exists (made by the `osRmCapRegister*()`
//! functions above; `gpu<G>/mig/` itself always exists). Printed by
//! `nv_cap_procfs_read()` in `kernel-open/nvidia/nv-caps.c`:
//!
//! ```text
//! DeviceFileMinor: 12      "%s: %d"  the nvidia-caps minor
//! DeviceFileMode: 292      "%s: %d"  permission bits in decimal: 292 = 0o444
//! DeviceFileModify: 1      "%s: %d"  NVreg_ModifyDeviceFiles (may nvidia-modprobe fix the node)
//! ```
//!
//! `capabilities/mig/config` (mode 256 = 0o400), `capabilities/mig/monitor`
//! (292) and `capabilities/fabric-imex-mgmt` (256) have the same content.

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::error::ParseError;

mod information;

pub use information::{parse_gpu_information, GpuProcInfo};

/// What an `nvidia-caps` minor stands for, by its name in `mig-minors`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CapKind {
    /// `config`: create and destroy MIG instances on every GPU. Never a
    /// job's grant.
    Config,
    /// `monitor`: read MIG state of every GPU (`nvidia-smi` as non-root).
    Monitor,
    /// `gpu<G>/gi<I>/access`: use GPU instance `gi` of the GPU whose device
    /// minor is `gpu`.
    GpuInstance {
        /// Device minor of the parent GPU (`/dev/nvidia<gpu>`).
        gpu: u32,
        /// GPU instance id.
        gi: u32,
    },
    /// `gpu<G>/gi<I>/ci<C>/access`: use compute instance `ci` of that GPU
    /// instance.
    ComputeInstance {
        /// Device minor of the parent GPU.
        gpu: u32,
        /// GPU instance id.
        gi: u32,
        /// Compute instance id within the GPU instance.
        ci: u32,
    },
    /// Any other name (`fabric-imex-mgmt` of `sys-minors`, `fabric-mgmt` of
    /// `nvlink-minors`, names of later drivers).
    Other(String),
}

impl CapKind {
    /// The capability's file under the proc root
    /// (`driver/nvidia/capabilities/...`), whose `DeviceFileMinor:` is the
    /// minor; `None` for [`CapKind::Other`], whose directory is not known.
    pub fn proc_path(&self) -> Option<PathBuf> {
        let base = Path::new("driver/nvidia/capabilities");
        match self {
            CapKind::Config => Some(base.join("mig/config")),
            CapKind::Monitor => Some(base.join("mig/monitor")),
            CapKind::GpuInstance { gpu, gi } => {
                Some(base.join(format!("gpu{gpu}/mig/gi{gi}/access")))
            }
            CapKind::ComputeInstance { gpu, gi, ci } => {
                Some(base.join(format!("gpu{gpu}/mig/gi{gi}/ci{ci}/access")))
            }
            CapKind::Other(_) => None,
        }
    }
}

/// The name as `mig-minors` prints it (`gpu0/gi1/ci0/access`).
impl fmt::Display for CapKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CapKind::Config => f.write_str("config"),
            CapKind::Monitor => f.write_str("monitor"),
            CapKind::GpuInstance { gpu, gi } => write!(f, "gpu{gpu}/gi{gi}/access"),
            CapKind::ComputeInstance { gpu, gi, ci } => {
                write!(f, "gpu{gpu}/gi{gi}/ci{ci}/access")
            }
            CapKind::Other(name) => f.write_str(name),
        }
    }
}

/// The device node of `nvidia-caps` minor `minor`,
/// `/dev/nvidia-caps/nvidia-cap<minor>` (the name `nvidia-modprobe -f`
/// gives it and Slurm's `File=` uses; the major is the dynamic
/// `nvidia-caps` of `/proc/devices`).
pub fn cap_device_path(minor: u32) -> PathBuf {
    PathBuf::from(format!("/dev/nvidia-caps/nvidia-cap{minor}"))
}

/// `/proc/driver/nvidia-caps/mig-minors`: capability ↔ `nvidia-caps` minor,
/// both ways.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MigMinors {
    /// `(kind, minor)` in file order.
    entries: Vec<(CapKind, u32)>,
    by_minor: BTreeMap<u32, usize>,
    by_kind: BTreeMap<CapKind, u32>,
}

impl MigMinors {
    /// What minor `minor` stands for.
    pub fn kind_of(&self, minor: u32) -> Option<&CapKind> {
        self.by_minor.get(&minor).map(|&i| &self.entries[i].0)
    }

    /// The minor of `kind`.
    pub fn minor_of(&self, kind: &CapKind) -> Option<u32> {
        self.by_kind.get(kind).copied()
    }

    /// The minor of `gpu<gpu>/gi<gi>/access`; `gpu` is the GPU's device minor.
    pub fn gi_minor(&self, gpu: u32, gi: u32) -> Option<u32> {
        self.minor_of(&CapKind::GpuInstance { gpu, gi })
    }

    /// The minor of `gpu<gpu>/gi<gi>/ci<ci>/access`.
    pub fn ci_minor(&self, gpu: u32, gi: u32, ci: u32) -> Option<u32> {
        self.minor_of(&CapKind::ComputeInstance { gpu, gi, ci })
    }

    /// The minor of `config`.
    pub fn config_minor(&self) -> Option<u32> {
        self.minor_of(&CapKind::Config)
    }

    /// The minor of `monitor`.
    pub fn monitor_minor(&self) -> Option<u32> {
        self.minor_of(&CapKind::Monitor)
    }

    /// `(kind, minor)` in file order.
    pub fn iter(&self) -> impl Iterator<Item = (&CapKind, u32)> + '_ {
        self.entries.iter().map(|(k, m)| (k, *m))
    }

    /// Number of lines.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the file had no lines.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Parses `/proc/driver/nvidia-caps/mig-minors` (or `sys-minors`,
/// `nvlink-minors`: same shape) read from `source`.
///
/// # Errors
/// A [`ParseError`] naming `source` and the 1-based line for a line that is
/// not `<name> <minor>`, a minor that is not a decimal number, a name
/// starting with `gpu` and holding a `/` that is neither
/// `gpu<G>/gi<I>/access` nor `gpu<G>/gi<I>/ci<C>/access` (ids in plain
/// decimal, as `%d` prints them), or a name or minor given twice.
pub fn parse_mig_minors(text: &str, source: &Path) -> Result<MigMinors, ParseError> {
    let mut out = MigMinors::default();
    for (i, raw) in text.lines().enumerate() {
        let n = i + 1;
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        let err = |msg: String| ParseError::new(source, n, msg);
        let mut words = line.split_whitespace();
        let (Some(name), Some(num), None) = (words.next(), words.next(), words.next()) else {
            return Err(err(format!("expected \"<name> <minor>\", found {line:?}")));
        };
        let minor = dec_u32(num).ok_or_else(|| err(format!("minor {num:?} is not a number")))?;
        let kind = cap_kind(name)
            .ok_or_else(|| err(format!("{name:?} is not gpu<G>/gi<I>[/ci<C>]/access")))?;
        if let Some(&j) = out.by_minor.get(&minor) {
            return Err(err(format!(
                "minor {minor} given twice ({} and {name})",
                out.entries[j].0
            )));
        }
        if out.by_kind.contains_key(&kind) {
            return Err(err(format!("{name} given twice")));
        }
        out.by_minor.insert(minor, out.entries.len());
        out.by_kind.insert(kind.clone(), minor);
        out.entries.push((kind, minor));
    }
    Ok(out)
}

/// Classifies a `mig-minors` name; `None` for a malformed `gpu…/…` name.
fn cap_kind(name: &str) -> Option<CapKind> {
    match name {
        "config" => return Some(CapKind::Config),
        "monitor" => return Some(CapKind::Monitor),
        _ => {}
    }
    if !(name.starts_with("gpu") && name.contains('/')) {
        return Some(CapKind::Other(name.to_string()));
    }
    let parts: Vec<&str> = name.split('/').collect();
    let id = |s: &str, prefix: &str| s.strip_prefix(prefix).and_then(dec_u32);
    match parts.as_slice() {
        [g, i, "access"] => Some(CapKind::GpuInstance {
            gpu: id(g, "gpu")?,
            gi: id(i, "gi")?,
        }),
        [g, i, c, "access"] => Some(CapKind::ComputeInstance {
            gpu: id(g, "gpu")?,
            gi: id(i, "gi")?,
            ci: id(c, "ci")?,
        }),
        _ => None,
    }
}

/// One capability file (`.../access`, `mig/config`, `mig/monitor`,
/// `fabric-imex-mgmt`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct CapFile {
    /// `DeviceFileMinor:`, the `nvidia-caps` minor.
    pub minor: u32,
    /// `DeviceFileMode:`, the permission bits the node should have (printed
    /// in decimal: 292 = 0o444).
    pub mode: Option<u32>,
    /// `DeviceFileModify:`, whether `nvidia-modprobe` may create or fix the
    /// node (`NVreg_ModifyDeviceFiles`; 1 by default).
    pub modify: Option<i32>,
    /// The 1-based line of `DeviceFileMinor:`, for errors about it.
    #[serde(skip)]
    pub minor_line: usize,
}

/// Parses one capability file read from `source`.
///
/// # Errors
/// A [`ParseError`] naming `source` and the 1-based line for a non-empty line
/// without `Key:`, a key given twice, or a `DeviceFile*` value that is not a
/// decimal number (the minor and mode non-negative). A missing
/// `DeviceFileMinor:` is an error at line 0. Other keys are ignored.
pub fn parse_cap_file(text: &str, source: &Path) -> Result<CapFile, ParseError> {
    let mut minor: Option<(u32, usize)> = None;
    let mut mode = None;
    let mut modify = None;
    for (i, raw) in text.lines().enumerate() {
        let n = i + 1;
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        let err = |msg: String| ParseError::new(source, n, msg);
        let (key, value) = line
            .split_once(':')
            .ok_or_else(|| err(format!("expected \"<key>: <value>\", found {line:?}")))?;
        let (key, value) = (key.trim(), value.trim());
        let twice = || err(format!("{key:?} given twice"));
        match key {
            "DeviceFileMinor" => {
                let v = dec_u32(value)
                    .ok_or_else(|| err(format!("DeviceFileMinor {value:?} is not a number")))?;
                if minor.replace((v, n)).is_some() {
                    return Err(twice());
                }
            }
            "DeviceFileMode" => {
                let v = dec_u32(value)
                    .ok_or_else(|| err(format!("DeviceFileMode {value:?} is not a number")))?;
                if mode.replace(v).is_some() {
                    return Err(twice());
                }
            }
            "DeviceFileModify" => {
                let v = dec_i32(value)
                    .ok_or_else(|| err(format!("DeviceFileModify {value:?} is not a number")))?;
                if modify.replace(v).is_some() {
                    return Err(twice());
                }
            }
            "" => return Err(err(format!("empty key in {line:?}"))),
            _ => {}
        }
    }
    let (minor, minor_line) =
        minor.ok_or_else(|| ParseError::new(source, 0, "no \"DeviceFileMinor:\" line"))?;
    Ok(CapFile {
        minor,
        mode,
        modify,
        minor_line,
    })
}

/// A live MIG instance, from the capability tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct MigInstance {
    /// Device minor of the parent GPU (the `gpu<G>` directory).
    pub gpu: u32,
    /// GPU instance id.
    pub gi: u32,
    /// Compute instance id; `None` for the GPU instance's own `access`.
    pub ci: Option<u32>,
    /// The `nvidia-caps` minor of its `access` file.
    pub cap_minor: u32,
}

impl MigInstance {
    /// The capability this instance's `access` file stands for.
    pub fn cap_kind(&self) -> CapKind {
        match self.ci {
            None => CapKind::GpuInstance {
                gpu: self.gpu,
                gi: self.gi,
            },
            Some(ci) => CapKind::ComputeInstance {
                gpu: self.gpu,
                gi: self.gi,
                ci,
            },
        }
    }
}

/// Everything the driver's `/proc` files say about this node's GPUs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Inventory {
    /// One per readable, well-formed `gpus/*/information`, in directory-name
    /// (PCI bus id) order.
    pub gpus: Vec<GpuProcInfo>,
    /// Live MIG GPU and compute instances, by `(gpu, gi, ci)` with each GPU
    /// instance before its compute instances.
    pub mig: Vec<MigInstance>,
    /// `driver/nvidia-caps/mig-minors`; `None` when absent (no
    /// `nvidia-caps`, or a driver without MIG).
    pub mig_minors: Option<MigMinors>,
    /// Every file or directory that could not be read or parsed (line 0 for
    /// I/O errors), and every `access` file whose minor disagrees with
    /// `mig-minors`.
    pub errors: Vec<ParseError>,
}

impl Inventory {
    /// The GPU whose device minor is `minor`.
    pub fn gpu_by_minor(&self, minor: u32) -> Option<&GpuProcInfo> {
        self.gpus.iter().find(|g| g.device_minor == minor)
    }

    /// The live MIG instances of the GPU with device minor `gpu`.
    pub fn mig_of(&self, gpu: u32) -> impl Iterator<Item = &MigInstance> + '_ {
        self.mig.iter().filter(move |m| m.gpu == gpu)
    }
}

/// Reads the NVIDIA driver's files under `proc_root` (`/proc`, or a test
/// tree shaped like it):
///
/// - `driver/nvidia/gpus/*/information` ([`parse_gpu_information`]);
/// - `driver/nvidia-caps/mig-minors` ([`parse_mig_minors`]);
/// - `driver/nvidia/capabilities/gpu<G>/mig/gi<I>/access` and
///   `.../gi<I>/ci<C>/access` ([`parse_cap_file`]).
///
/// Never fails and never panics: a file or directory that does not exist is
/// not there (no driver, no MIG, an instance destroyed while walking); one
/// that cannot be read or parsed is an entry of [`Inventory::errors`] and
/// the walk goes on. Entries of the capability tree not named
/// `gpu<N>`, `gi<N>`, `ci<N>` are skipped (`mig/`, `fabric-imex-mgmt`).
pub fn read_inventory(proc_root: &Path) -> Inventory {
    let mut inv = Inventory::default();

    let gpus_dir = proc_root.join("driver/nvidia/gpus");
    for dir in list_dir(&gpus_dir, &mut inv.errors) {
        let path = dir.join("information");
        if let Some(text) = read_text(&path, &mut inv.errors) {
            match parse_gpu_information(&text, &path) {
                Ok(info) => inv.gpus.push(info),
                Err(e) => inv.errors.push(e),
            }
        }
    }

    let minors_path = proc_root.join("driver/nvidia-caps/mig-minors");
    if let Some(text) = read_text(&minors_path, &mut inv.errors) {
        match parse_mig_minors(&text, &minors_path) {
            Ok(m) => inv.mig_minors = Some(m),
            Err(e) => inv.errors.push(e),
        }
    }

    let caps = proc_root.join("driver/nvidia/capabilities");
    for (gpu, gpu_dir) in list_numbered(&caps, "gpu", &mut inv.errors) {
        for (gi, gi_dir) in list_numbered(&gpu_dir.join("mig"), "gi", &mut inv.errors) {
            let mut found = Vec::new();
            found.push((None, gi_dir.join("access")));
            for (ci, ci_dir) in list_numbered(&gi_dir, "ci", &mut inv.errors) {
                found.push((Some(ci), ci_dir.join("access")));
            }
            for (ci, path) in found {
                let Some(text) = read_text(&path, &mut inv.errors) else {
                    continue;
                };
                let cap = match parse_cap_file(&text, &path) {
                    Ok(c) => c,
                    Err(e) => {
                        inv.errors.push(e);
                        continue;
                    }
                };
                let inst = MigInstance {
                    gpu,
                    gi,
                    ci,
                    cap_minor: cap.minor,
                };
                if let Some(listed) = inv
                    .mig_minors
                    .as_ref()
                    .and_then(|m| m.minor_of(&inst.cap_kind()))
                {
                    if listed != cap.minor {
                        inv.errors.push(ParseError::new(
                            &path,
                            cap.minor_line,
                            format!(
                                "DeviceFileMinor {} but mig-minors lists {} as {listed}",
                                cap.minor,
                                inst.cap_kind()
                            ),
                        ));
                    }
                }
                inv.mig.push(inst);
            }
        }
    }
    inv.mig.sort();
    inv
}

/// The entries of `dir`, sorted by name; nothing when `dir` does not exist.
fn list_dir(dir: &Path, errors: &mut Vec<ParseError>) -> Vec<PathBuf> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => {
            errors.push(ParseError::new(dir, 0, format!("cannot list: {e}")));
            return Vec::new();
        }
    };
    let mut out = Vec::new();
    for entry in rd {
        match entry {
            Ok(entry) => out.push(entry.path()),
            Err(e) => errors.push(ParseError::new(dir, 0, format!("cannot list: {e}"))),
        }
    }
    out.sort();
    out
}

/// The entries of `dir` named `<prefix><N>` (plain decimal N), by N.
fn list_numbered(dir: &Path, prefix: &str, errors: &mut Vec<ParseError>) -> Vec<(u32, PathBuf)> {
    let mut out: Vec<(u32, PathBuf)> = list_dir(dir, errors)
        .into_iter()
        .filter_map(|p| {
            let n = p
                .file_name()?
                .to_str()?
                .strip_prefix(prefix)
                .and_then(dec_u32)?;
            Some((n, p))
        })
        .collect();
    out.sort();
    out
}

/// The text of `path`; `None` when it does not exist (silently) or cannot
/// be read (recorded in `errors`).
fn read_text(path: &Path, errors: &mut Vec<ParseError>) -> Option<String> {
    match std::fs::read_to_string(path) {
        Ok(t) => Some(t),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => {
            errors.push(ParseError::new(path, 0, format!("cannot read: {e}")));
            None
        }
    }
}

/// A decimal `u32` as `%d`/`%u` print it: digits only, no sign, no leading
/// zero (so `gpu01` is not `gpu1`).
fn dec_u32(s: &str) -> Option<u32> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) || (s.len() > 1 && s.starts_with('0'))
    {
        return None;
    }
    s.parse().ok()
}

/// A decimal `i32` as `%d` prints it.
fn dec_i32(s: &str) -> Option<i32> {
    match s.strip_prefix('-') {
        Some(rest) => dec_u32(rest)
            .filter(|&v| v != 0)
            .and_then(|v| 0i64.checked_sub(i64::from(v)))
            .and_then(|v| i32::try_from(v).ok()),
        None => dec_u32(s).and_then(|v| i32::try_from(v).ok()),
    }
}

#[cfg(test)]
mod tests {
    use super::information::is_bus_location;
    use super::*;

    fn fixture(rel: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../testdata")
            .join(rel)
    }

    fn read(rel: &str) -> String {
        let p = fixture(rel);
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    fn h100() -> String {
        read("nvproc/information-h100.txt")
    }

    #[test]
    fn h100_information_as_the_driver_prints_it() {
        let g = parse_gpu_information(&h100(), Path::new("info")).unwrap();
        assert_eq!(
            g,
            GpuProcInfo {
                model: "NVIDIA H100 80GB HBM3".into(),
                uuid: "GPU-3f5a9c2e-7b41-4d8e-a0c6-19e2b7d4f853".into(),
                bus_location: "0000:18:00.0".into(),
                device_minor: 0,
                excluded: Some(false),
                irq: Some(145),
                video_bios: Some("96.00.99.00.01".into()),
                bus_type: Some("PCIe".into()),
                dma_size_bits: Some(52),
                dma_mask: Some(0xf_ffff_ffff_ffff),
                firmware: Some("550.54.15".into()),
                other: vec![],
            }
        );
    }

    #[test]
    fn information_variants_the_driver_can_print() {
        // An excluded GPU, no GSP firmware, a debug build's BAR lines, a
        // 32-bit PCI domain, and no "GPU Excluded:" line (older drivers).
        let text = h100()
            .replace("GPU Excluded:\t No", "GPU Excluded:\t Yes")
            .replace("550.54.15", "N/A")
            .replace("0000:18:00.0", "10000:c1:1f.7")
            + "BAR0: \t\t 0xc2000000 (16MB)\nBAR1: \t\t 0x3c0000000000 (131072MB)\n";
        let g = parse_gpu_information(&text, Path::new("i")).unwrap();
        assert_eq!(g.excluded, Some(true));
        assert_eq!(g.firmware, None);
        assert_eq!(g.bus_location, "10000:c1:1f.7");
        assert_eq!(
            g.other,
            vec![
                ("BAR0".to_string(), "0xc2000000 (16MB)".to_string()),
                ("BAR1".to_string(), "0x3c0000000000 (131072MB)".to_string()),
            ]
        );
        let old: String = h100()
            .lines()
            .filter(|l| !l.starts_with("GPU Excluded") && !l.starts_with("GPU Firmware"))
            .map(|l| format!("{l}\n"))
            .collect();
        let g = parse_gpu_information(&old, Path::new("i")).unwrap();
        assert_eq!((g.excluded, g.firmware), (None, None));
    }

    #[test]
    fn missing_fields_are_named() {
        for (prefix, field) in [
            ("Model:", "Model"),
            ("GPU UUID:", "GPU UUID"),
            ("Device Minor:", "Device Minor"),
            ("Bus Location:", "Bus Location"),
        ] {
            let text: String = h100()
                .lines()
                .filter(|l| !l.starts_with(prefix))
                .map(|l| format!("{l}\n"))
                .collect();
            let e = parse_gpu_information(&text, Path::new("/p/information")).unwrap_err();
            assert_eq!(e.line, 0, "{e}");
            assert!(
                e.to_string()
                    .starts_with(&format!("/p/information:0: no \"{field}:\" line")),
                "{e}"
            );
        }
    }

    #[test]
    fn malformed_information_lines_name_file_and_line() {
        let src = Path::new("/proc/driver/nvidia/gpus/0000:18:00.0/information");
        let cases = [
            (
                "Device Minor: \t 0",
                "Device Minor: \t zero",
                9,
                "Device Minor \"zero\"",
            ),
            (
                "Device Minor: \t 0",
                "Device Minor: \t -1",
                9,
                "not a number",
            ),
            (
                "GPU Excluded:\t No",
                "GPU Excluded:\t maybe",
                11,
                "not Yes or No",
            ),
            ("DMA Size: \t 52 bits", "DMA Size: \t 52", 6, "<n> bits"),
            (
                "DMA Mask: \t 0xfffffffffffff",
                "DMA Mask: \t fff",
                7,
                "0x<hex>",
            ),
            (
                "Bus Location: \t 0000:18:00.0",
                "Bus Location: \t 18:00",
                8,
                "domain:bus",
            ),
            ("IRQ:   \t\t 145", "IRQ:   \t\t many", 2, "IRQ"),
            (
                "Bus Type: \t PCIe",
                "Bus Type: \t PCIe\nno colon here",
                6,
                "expected",
            ),
            (
                "GPU UUID: \t GPU-",
                "GPU UUID: \t GPU- x\nGPU UUID: \t GPU-",
                3,
                "one word",
            ),
            (
                "Model: \t\t NVIDIA H100 80GB HBM3",
                "Model: \t\t ",
                1,
                "no value",
            ),
            (
                "Bus Type: \t PCIe",
                "Bus Type: \t PCIe\nModel: X",
                6,
                "twice",
            ),
            (
                "Bus Type: \t PCIe",
                "Bus Type: \t PCIe\n: x",
                6,
                "empty key",
            ),
        ];
        for (from, to, line, needle) in cases {
            let text = h100().replacen(from, to, 1);
            assert_ne!(text, h100(), "{from:?} not in the fixture");
            let e = parse_gpu_information(&text, src).unwrap_err();
            assert_eq!(e.line, line, "{to:?}: {e}");
            assert_eq!(e.source_name, src);
            assert!(e.msg.contains(needle), "{to:?}: {e}");
            assert!(e
                .to_string()
                .starts_with(&format!("{}:{line}: ", src.display())));
        }
    }

    #[test]
    fn full_mig_minors_is_the_drivers_static_table() {
        let m = parse_mig_minors(&read("nvproc/mig-minors.txt"), Path::new("m")).unwrap();
        assert_eq!(m.len(), 2 + 32 * 15 * 9);
        assert_eq!(m.config_minor(), Some(1));
        assert_eq!(m.monitor_minor(), Some(2));
        // nv_cap_tables_init(): 3 + 135 per GPU + 9 per GI (+ 1 + ci).
        for gpu in 0..32 {
            for gi in 0..15 {
                let base = 3 + gpu * 135 + gi * 9;
                assert_eq!(m.gi_minor(gpu, gi), Some(base));
                assert_eq!(m.kind_of(base), Some(&CapKind::GpuInstance { gpu, gi }));
                for ci in 0..8 {
                    assert_eq!(m.ci_minor(gpu, gi, ci), Some(base + 1 + ci));
                }
            }
        }
        assert_eq!(m.ci_minor(31, 14, 7), Some(4322));
        assert_eq!(m.gi_minor(32, 0), None);
        assert_eq!(m.gi_minor(0, 15), None);
        assert_eq!(m.ci_minor(0, 0, 8), None);
        assert_eq!(m.kind_of(0), None); // nvlink's fabric-mgmt, not listed here
        assert_eq!(m.kind_of(4323), None); // sys-minors' fabric-imex-mgmt
                                           // Display gives the file's names back, in order.
        let back: String = m.iter().map(|(k, n)| format!("{k} {n}\n")).collect();
        assert_eq!(back, read("nvproc/mig-minors.txt"));
    }

    #[test]
    fn excerpt_agrees_with_the_full_table() {
        let full = parse_mig_minors(&read("nvproc/mig-minors.txt"), Path::new("m")).unwrap();
        let ex = parse_mig_minors(&read("cases/mig-minors-excerpt.txt"), Path::new("x")).unwrap();
        assert_eq!(ex.len(), 11);
        for (k, n) in ex.iter() {
            assert_eq!(full.minor_of(k), Some(n), "{k}");
        }
        assert_eq!(ex.gi_minor(1, 1), Some(147));
        assert_eq!(ex.ci_minor(0, 0, 1), Some(5));
        assert_eq!(
            ex.kind_of(22),
            Some(&CapKind::ComputeInstance {
                gpu: 0,
                gi: 2,
                ci: 0
            })
        );
        assert_eq!(ex.kind_of(1), Some(&CapKind::Config));
    }

    #[test]
    fn other_names_and_sibling_files() {
        let m = parse_mig_minors("fabric-imex-mgmt 4323\n", Path::new("sys-minors")).unwrap();
        assert_eq!(
            m.kind_of(4323),
            Some(&CapKind::Other("fabric-imex-mgmt".into()))
        );
        assert_eq!(CapKind::Other("x".into()).proc_path(), None);
        let m = parse_mig_minors("fabric-mgmt 0\n", Path::new("nvlink-minors")).unwrap();
        assert_eq!(m.kind_of(0), Some(&CapKind::Other("fabric-mgmt".into())));
        assert_eq!(parse_mig_minors("", Path::new("e")).unwrap().len(), 0);
    }

    #[test]
    fn cap_paths() {
        let k = CapKind::ComputeInstance {
            gpu: 3,
            gi: 1,
            ci: 0,
        };
        assert_eq!(k.to_string(), "gpu3/gi1/ci0/access");
        assert_eq!(
            k.proc_path().unwrap(),
            Path::new("driver/nvidia/capabilities/gpu3/mig/gi1/ci0/access")
        );
        assert_eq!(
            CapKind::Config.proc_path().unwrap(),
            Path::new("driver/nvidia/capabilities/mig/config")
        );
        assert_eq!(
            cap_device_path(21),
            Path::new("/dev/nvidia-caps/nvidia-cap21")
        );
    }

    #[test]
    fn malformed_mig_minors_lines_name_file_and_line() {
        let src = Path::new("/proc/driver/nvidia-caps/mig-minors");
        let cases = [
            ("gpu0/gi0/access", 3, "expected"),
            ("gpu0/gi0/access 3 4", 3, "expected"),
            ("gpu0/gi0/access x", 3, "not a number"),
            ("gpu0/gi0/access -3", 3, "not a number"),
            ("gpu0/gix/access 3", 3, "not gpu<G>"),
            ("gpu0/gi0/ci0/ci1/access 3", 3, "not gpu<G>"),
            ("gpu0/gi0/read 3", 3, "not gpu<G>"),
            ("gpu01/gi0/access 3", 3, "not gpu<G>"),
            ("gpu0/gi0/ci/access 3", 3, "not gpu<G>"),
            (
                "gpu0/gi0/access 2",
                3,
                "minor 2 given twice (monitor and gpu0/gi0/access)",
            ),
            ("config 3", 3, "config given twice"),
        ];
        for (bad, line, needle) in cases {
            let text = format!("config 1\nmonitor 2\n{bad}\ngpu0/gi0/ci0/access 4\n");
            let e = parse_mig_minors(&text, src).unwrap_err();
            assert_eq!(
                (e.source_name.as_path(), e.line),
                (src, line),
                "{bad:?}: {e}"
            );
            assert!(e.msg.contains(needle), "{bad:?}: {e}");
        }
        let e = parse_mig_minors("config 1\n\nmonitor\n", src).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "{}:3: expected \"<name> <minor>\", found \"monitor\"",
                src.display()
            )
        );
    }

    #[test]
    fn cap_files_of_the_fixture_tree() {
        let c = parse_cap_file(
            &read("nvproc/capabilities/gpu0/mig/gi1/access"),
            Path::new("a"),
        )
        .unwrap();
        assert_eq!(
            c,
            CapFile {
                minor: 12,
                mode: Some(0o444),
                modify: Some(1),
                minor_line: 1
            }
        );
        let c = parse_cap_file(&read("nvproc/capabilities/mig/config"), Path::new("c")).unwrap();
        assert_eq!((c.minor, c.mode), (1, Some(0o400)));
        // Only the minor is required; unknown keys are ignored.
        let c = parse_cap_file("Other: x\n\nDeviceFileMinor: 7\n", Path::new("c")).unwrap();
        assert_eq!(
            (c.minor, c.mode, c.modify, c.minor_line),
            (7, None, None, 3)
        );
    }

    #[test]
    fn malformed_cap_file_lines_name_file_and_line() {
        let src = Path::new("/proc/driver/nvidia/capabilities/gpu0/mig/gi1/access");
        let cases = [
            ("DeviceFileMinor: 12\nDeviceFileMode 292\n", 2, "expected"),
            ("DeviceFileMinor: twelve\n", 1, "DeviceFileMinor \"twelve\""),
            ("DeviceFileMinor: -1\n", 1, "not a number"),
            (
                "DeviceFileMinor: 12\nDeviceFileMode: 0o444\n",
                2,
                "DeviceFileMode",
            ),
            (
                "DeviceFileMinor: 12\nDeviceFileModify: yes\n",
                2,
                "DeviceFileModify",
            ),
            ("DeviceFileMinor: 12\nDeviceFileMinor: 13\n", 2, "twice"),
            ("DeviceFileMinor: 12\n: 1\n", 2, "empty key"),
            ("DeviceFileMode: 292\n", 0, "no \"DeviceFileMinor:\""),
        ];
        for (text, line, needle) in cases {
            let e = parse_cap_file(text, src).unwrap_err();
            assert_eq!(
                (e.source_name.as_path(), e.line),
                (src, line),
                "{text:?}: {e}"
            );
            assert!(e.msg.contains(needle), "{text:?}: {e}");
        }
        assert_eq!(
            parse_cap_file("DeviceFileMinor: 1\nDeviceFileModify: -1\n", src)
                .unwrap()
                .modify,
            Some(-1)
        );
    }

    // ---- the walker, over trees built in tempdirs ----

    fn put(root: &Path, rel: &str, text: &str) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    fn copy_tree(from: &Path, to: &Path) {
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            let dst = to.join(e.file_name());
            if e.file_type().unwrap().is_dir() {
                std::fs::create_dir_all(&dst).unwrap();
                copy_tree(&e.path(), &dst);
            } else {
                std::fs::copy(e.path(), dst).unwrap();
            }
        }
    }

    /// A node with an H100 at 0000:18:00.0 (minor 0, MIG: GI 1 and GI 2),
    /// a second GPU at 0000:2a:00.0 (minor 1, MIG on, no instances), and
    /// the driver's full mig-minors.
    fn mig_node() -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        put(r, "driver/nvidia/gpus/0000:18:00.0/information", &h100());
        let second = h100()
            .replace("0000:18:00.0", "0000:2a:00.0")
            .replace("Device Minor: \t 0", "Device Minor: \t 1")
            .replace("3f5a9c2e", "0b7e11d4");
        put(r, "driver/nvidia/gpus/0000:2a:00.0/information", &second);
        put(
            r,
            "driver/nvidia-caps/mig-minors",
            &read("nvproc/mig-minors.txt"),
        );
        let caps = r.join("driver/nvidia/capabilities");
        std::fs::create_dir_all(&caps).unwrap();
        copy_tree(&fixture("nvproc/capabilities"), &caps);
        std::fs::create_dir_all(caps.join("gpu1/mig")).unwrap();
        t
    }

    fn inst(gpu: u32, gi: u32, ci: Option<u32>, cap_minor: u32) -> MigInstance {
        MigInstance {
            gpu,
            gi,
            ci,
            cap_minor,
        }
    }

    #[test]
    fn walks_a_mig_node() {
        let t = mig_node();
        let inv = read_inventory(t.path());
        assert_eq!(inv.errors, vec![]);
        assert_eq!(
            inv.gpus
                .iter()
                .map(|g| (g.bus_location.as_str(), g.device_minor))
                .collect::<Vec<_>>(),
            vec![("0000:18:00.0", 0), ("0000:2a:00.0", 1)]
        );
        assert_eq!(
            inv.mig,
            vec![
                inst(0, 1, None, 12),
                inst(0, 1, Some(0), 13),
                inst(0, 2, None, 21),
                inst(0, 2, Some(0), 22),
                inst(0, 2, Some(1), 23),
            ]
        );
        let m = inv.mig_minors.as_ref().unwrap();
        for i in &inv.mig {
            assert_eq!(m.minor_of(&i.cap_kind()), Some(i.cap_minor));
        }
        assert_eq!(inv.gpu_by_minor(1).unwrap().bus_location, "0000:2a:00.0");
        assert_eq!(inv.mig_of(0).count(), 5);
        assert_eq!(inv.mig_of(1).count(), 0);
    }

    #[test]
    fn absent_files_are_not_there() {
        // No driver at all.
        let t = tempfile::tempdir().unwrap();
        assert_eq!(read_inventory(t.path()), Inventory::default());
        assert_eq!(read_inventory(&t.path().join("nope")), Inventory::default());
        // Driver without nvidia-caps, no MIG instances; a GPU directory
        // without information (unbound while walking) is skipped.
        put(
            t.path(),
            "driver/nvidia/gpus/0000:18:00.0/information",
            &h100(),
        );
        std::fs::create_dir_all(t.path().join("driver/nvidia/gpus/0000:19:00.0")).unwrap();
        std::fs::create_dir_all(t.path().join("driver/nvidia/capabilities/gpu0/mig")).unwrap();
        let inv = read_inventory(t.path());
        assert_eq!(inv.errors, vec![]);
        assert_eq!(inv.gpus.len(), 1);
        assert!(inv.mig.is_empty() && inv.mig_minors.is_none());
        // A GI directory whose access file is gone (destroyed while walking).
        std::fs::create_dir_all(t.path().join("driver/nvidia/capabilities/gpu0/mig/gi3")).unwrap();
        let inv = read_inventory(t.path());
        assert_eq!(inv.errors, vec![]);
        assert!(inv.mig.is_empty());
    }

    #[test]
    fn bad_files_become_errors_and_the_walk_goes_on() {
        let t = mig_node();
        let r = t.path();
        // Malformed information: that GPU is left out, the other stays.
        let bad = h100().replace("Device Minor: \t 0", "Device Minor: \t x");
        put(r, "driver/nvidia/gpus/0000:18:00.0/information", &bad);
        // Unreadable information (a directory where the file should be).
        std::fs::create_dir_all(r.join("driver/nvidia/gpus/0000:3b:00.0/information")).unwrap();
        // A malformed CI access file, and one that disagrees with mig-minors.
        put(
            r,
            "driver/nvidia/capabilities/gpu0/mig/gi2/ci1/access",
            "DeviceFileMinor: 23\nDeviceFileMode 292\n",
        );
        put(
            r,
            "driver/nvidia/capabilities/gpu0/mig/gi1/ci0/access",
            "DeviceFileMinor: 99\nDeviceFileMode: 292\n",
        );
        // Non-numbered entries of the tree are skipped.
        std::fs::create_dir_all(r.join("driver/nvidia/capabilities/gpuX/mig/gi1")).unwrap();
        put(r, "driver/nvidia/capabilities/gpu0/mig/gi01/access", "junk");
        let inv = read_inventory(r);

        let errs: Vec<(String, usize)> = inv
            .errors
            .iter()
            .map(|e| {
                let rel = e.source_name.strip_prefix(r).unwrap();
                (rel.display().to_string(), e.line)
            })
            .collect();
        assert_eq!(
            errs,
            vec![
                ("driver/nvidia/gpus/0000:18:00.0/information".to_string(), 9),
                ("driver/nvidia/gpus/0000:3b:00.0/information".to_string(), 0),
                (
                    "driver/nvidia/capabilities/gpu0/mig/gi1/ci0/access".to_string(),
                    1
                ),
                (
                    "driver/nvidia/capabilities/gpu0/mig/gi2/ci1/access".to_string(),
                    2
                ),
            ],
            "{:#?}",
            inv.errors
        );
        assert!(
            inv.errors[1].msg.starts_with("cannot read:"),
            "{}",
            inv.errors[1]
        );
        assert!(
            inv.errors[2]
                .msg
                .contains("DeviceFileMinor 99 but mig-minors lists gpu0/gi1/ci0/access as 13"),
            "{}",
            inv.errors[2]
        );
        assert_eq!(inv.gpus.len(), 1);
        assert_eq!(inv.gpus[0].device_minor, 1);
        // The disagreeing file still yields its instance, as the file says.
        assert_eq!(
            inv.mig,
            vec![
                inst(0, 1, None, 12),
                inst(0, 1, Some(0), 99),
                inst(0, 2, None, 21),
                inst(0, 2, Some(0), 22),
            ]
        );
    }

    #[test]
    fn malformed_mig_minors_is_an_error_not_a_table() {
        let t = mig_node();
        put(
            t.path(),
            "driver/nvidia-caps/mig-minors",
            "config 1\nmonitor 2\ngpu0/gi0/access\n",
        );
        let inv = read_inventory(t.path());
        assert!(inv.mig_minors.is_none());
        assert_eq!(inv.errors.len(), 1);
        assert_eq!(inv.errors[0].line, 3);
        assert_eq!(inv.mig.len(), 5);
    }

    #[test]
    fn non_utf8_is_an_error() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("driver/nvidia-caps/mig-minors");
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, b"config \xff1\n").unwrap();
        let inv = read_inventory(t.path());
        assert_eq!(inv.errors.len(), 1);
        assert_eq!(
            (inv.errors[0].source_name.as_path(), inv.errors[0].line),
            (p.as_path(), 0)
        );
    }

    #[test]
    fn number_helpers() {
        assert_eq!(dec_u32("0"), Some(0));
        assert_eq!(dec_u32("4294967295"), Some(u32::MAX));
        for bad in ["", "01", "+1", "-1", "4294967296", " 1", "1a"] {
            assert_eq!(dec_u32(bad), None, "{bad:?}");
        }
        assert_eq!(dec_i32("-2147483648"), Some(i32::MIN));
        assert_eq!(dec_i32("2147483647"), Some(i32::MAX));
        for bad in ["-0", "2147483648", "-2147483649", "--1"] {
            assert_eq!(dec_i32(bad), None, "{bad:?}");
        }
        assert!(is_bus_location("0000:18:00.0"));
        assert!(is_bus_location("10000:c1:1f.7"));
        for bad in [
            "0000:18:00",
            "0000:18:00.00",
            "0000:180:00.0",
            "x000:18:00.0",
            "0000:18:00.0:1",
        ] {
            assert!(!is_bus_location(bad), "{bad:?}");
        }
    }

    proptest::proptest! {
        #[test]
        fn parsers_never_panic(s in "\\PC*") {
            let _ = parse_gpu_information(&s, Path::new("fuzz"));
            let _ = parse_mig_minors(&s, Path::new("fuzz"));
            let _ = parse_cap_file(&s, Path::new("fuzz"));
        }

        #[test]
        fn parsers_never_panic_on_near_misses(
            lines in proptest::collection::vec(
                (
                    proptest::sample::select(vec![
                        "Model", "GPU UUID", "Device Minor", "Bus Location", "DMA Size",
                        "DMA Mask", "IRQ", "GPU Excluded", "GPU Firmware", "DeviceFileMinor",
                        "DeviceFileMode", "DeviceFileModify", "config", "monitor",
                        "gpu0/gi1/access", "gpu1/gi2/ci3/access", "gpu/gi/access",
                    ]),
                    proptest::sample::select(vec![": ", ":\t ", " ", ""]),
                    "[-0-9a-fx:. ]{0,24}",
                ),
                0..12,
            )
        ) {
            let text: String = lines.iter().map(|(k, sep, v)| format!("{k}{sep}{v}\n")).collect();
            for r in [
                parse_gpu_information(&text, Path::new("f")).err(),
                parse_mig_minors(&text, Path::new("f")).err(),
                parse_cap_file(&text, Path::new("f")).err(),
            ].into_iter().flatten() {
                // An error names the file and a line of it (0: the whole file).
                proptest::prop_assert_eq!(r.source_name.as_path(), Path::new("f"));
                proptest::prop_assert!(r.line <= lines.len());
            }
        }

        #[test]
        fn mig_minors_lookups_round_trip(
            caps in proptest::collection::btree_map(
                (0u32..40, 0u32..16, proptest::option::of(0u32..9)),
                0u32..10_000,
                0..40,
            )
        ) {
            // Distinct minors, as the driver's table has.
            let mut seen = std::collections::BTreeSet::new();
            let caps: Vec<_> = caps.into_iter().filter(|(_, m)| seen.insert(*m)).collect();
            let text: String = caps
                .iter()
                .map(|((g, i, c), m)| match c {
                    None => format!("gpu{g}/gi{i}/access {m}\n"),
                    Some(c) => format!("gpu{g}/gi{i}/ci{c}/access {m}\n"),
                })
                .collect();
            let mm = parse_mig_minors(&text, Path::new("f")).unwrap();
            for ((g, i, c), m) in &caps {
                let kind = match c {
                    None => CapKind::GpuInstance { gpu: *g, gi: *i },
                    Some(c) => CapKind::ComputeInstance { gpu: *g, gi: *i, ci: *c },
                };
                proptest::prop_assert_eq!(mm.minor_of(&kind), Some(*m));
                proptest::prop_assert_eq!(mm.kind_of(*m), Some(&kind));
            }
        }

        #[test]
        fn walker_never_panics(
            info in "\\PC{0,200}",
            minors in "\\PC{0,200}",
            access in "\\PC{0,80}",
        ) {
            let t = tempfile::tempdir().unwrap();
            put(t.path(), "driver/nvidia/gpus/0000:18:00.0/information", &info);
            put(t.path(), "driver/nvidia-caps/mig-minors", &minors);
            put(t.path(), "driver/nvidia/capabilities/gpu0/mig/gi1/access", &access);
            put(t.path(), "driver/nvidia/capabilities/gpu0/mig/gi1/ci0/access", &access);
            let inv = read_inventory(t.path());
            proptest::prop_assert!(inv.gpus.len() + inv.errors.len() >= 1);
        }
    }
}
