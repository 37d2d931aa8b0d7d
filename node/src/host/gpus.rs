//! The driver's view of the GPUs, through NVML (`nvml-wrapper`, which loads
//! `libnvidia-ml.so.1` at run time).
//!
//! GPUs are matched by minor number (`/dev/nvidia<minor>`, from
//! `nvmlDeviceGetMinorNumber`), never by NVML index: NVML orders devices by
//! PCI bus id (`nvmlDeviceGetHandleByIndex`, NVML API reference), Slurm by
//! its GRES list (the order of gres.conf's `File=` lines, as `slurmd -G`
//! prints them), and the two disagree when gres.conf does not list GPUs in
//! bus order (`testdata/cases/slurmd-G-plain.txt` lists `nvidia3` before
//! `nvidia1`). UUID and PCI bus id are reported with each.
//!
//! A node without the library or driver is not an error: [`Gpus::open`]
//! returns a view that says why it is unavailable, and callers fall back to
//! the descriptor scan. An NVML error in the middle of a query *is* an error:
//! a query that failed cannot say "clean".

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;
use serde::Serialize;

use gpufence_model::config::Config;

/// A process the driver lists on a GPU (host pid).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GpuProcess {
    /// Host pid.
    pub pid: u32,
    /// GPU memory it uses, bytes, when the driver says.
    pub used_memory: Option<u64>,
    /// `compute`, `graphics`, or `mps` (a client of an MPS server).
    pub kind: &'static str,
    /// MIG GPU instance id, when MIG is on.
    pub gpu_instance_id: Option<u32>,
    /// MIG compute instance id, when MIG is on.
    pub compute_instance_id: Option<u32>,
}

/// One GPU as the driver sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GpuInfo {
    /// `/dev/nvidia<minor>`.
    pub minor: u32,
    /// `GPU-...`.
    pub uuid: String,
    /// `0000:17:00.0` form.
    pub pci_bus_id: String,
    /// Used memory, bytes.
    pub memory_used: u64,
    /// Total memory, bytes.
    pub memory_total: u64,
    /// Compute and graphics processes.
    pub processes: Vec<GpuProcess>,
}

/// One GPU's utilisation over the driver's last sample period
/// (`nvmlDeviceGetUtilizationRates`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct GpuUtilization {
    /// `/dev/nvidia<minor>`.
    pub minor: u32,
    /// Percent of the time a kernel ran; `None` when not reported.
    pub gpu: Option<u32>,
    /// Percent of the time device memory was read or written.
    pub memory: Option<u32>,
}

/// What NVML accounting kept about one process of a GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AccountedProcess {
    /// Host pid.
    pub pid: u32,
    /// Max memory ever allocated, bytes.
    pub max_memory: Option<u64>,
    /// Average GPU utilisation over the process's life, percent.
    pub gpu_utilization: Option<u32>,
    /// Average memory utilisation, percent.
    pub memory_utilization: Option<u32>,
    /// Start, µs since the epoch.
    pub start_time_us: u64,
    /// Active time, ms.
    pub time_ms: u64,
}

/// The NVML handle, or why there is none.
pub struct Gpus {
    nvml: Option<Nvml>,
    /// Why NVML is not available (library missing, driver not loaded, disabled).
    pub unavailable: Option<String>,
}

impl std::fmt::Debug for Gpus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpus")
            .field("available", &self.nvml.is_some())
            .field("unavailable", &self.unavailable)
            .finish()
    }
}

/// Where an NVML call was aimed, as its message names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NvmlAt {
    /// The library or a device already named (`nvmlDeviceGetCount: ...`).
    Node,
    /// A device by NVML's index (`nvmlDeviceGetHandleByIndex(0): ...`).
    Index(u32),
    /// A device by its minor (`nvmlDeviceGetMemoryInfo (minor 0): ...`).
    Minor(u32),
}

impl std::fmt::Display for NvmlAt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NvmlAt::Node => Ok(()),
            NvmlAt::Index(i) => write!(f, "({i})"),
            NvmlAt::Minor(m) => write!(f, " (minor {m})"),
        }
    }
}

/// Why [`Gpus`] could not answer: an NVML error with the call that failed,
/// or a compute mode that cannot be set.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// An NVML call failed: `nvmlDeviceGetMemoryInfo (minor 0): <NVML's words>`.
    #[error("{call}{at}: {source}")]
    Nvml {
        /// The NVML function (`nvmlDeviceGetComputeRunningProcesses`).
        call: String,
        /// Which device.
        at: NvmlAt,
        /// NVML's error.
        source: NvmlError,
    },
    /// An NVML error named by itself (reading a minor while looking for one).
    #[error(transparent)]
    Bare(NvmlError),
    /// NVML is not loaded (the reason [`Gpus::open`] kept).
    #[error("NVML unavailable: {0}")]
    Unavailable(String),
    /// A compute mode number NVML does not have.
    #[error("unknown compute mode {0}")]
    UnknownMode(ComputeModeNum),
    /// No GPU NVML lists has this minor.
    #[error("NVML lists no GPU with minor {0}")]
    NoSuchMinor(u32),
}

impl GpuError {
    fn nvml(call: &str, at: NvmlAt, source: NvmlError) -> Self {
        GpuError::Nvml {
            call: call.to_string(),
            at,
            source,
        }
    }
}

impl Gpus {
    /// Loads NVML as the config says. Never fails.
    pub fn open(cfg: &Config) -> Gpus {
        if !cfg.nvml {
            return Gpus {
                nvml: None,
                unavailable: Some("disabled in the config (nvml = false)".into()),
            };
        }
        let lib = cfg.nvml_library.as_os_str();
        match Nvml::builder().lib_path(OsStr::new(lib)).init() {
            Ok(n) => Gpus {
                nvml: Some(n),
                unavailable: None,
            },
            Err(e) => Gpus {
                nvml: None,
                unavailable: Some(format!("{}: {e}", cfg.nvml_library.display())),
            },
        }
    }

    /// A view without NVML (tests, and nodes without GPUs).
    pub fn none(reason: &str) -> Gpus {
        Gpus {
            nvml: None,
            unavailable: Some(reason.into()),
        }
    }

    /// Whether NVML answers.
    pub fn available(&self) -> bool {
        self.nvml.is_some()
    }

    fn each_device<T>(
        &self,
        minors: &BTreeSet<u32>,
        mut f: impl FnMut(u32, &nvml_wrapper::Device<'_>) -> Result<T, GpuError>,
    ) -> Result<Vec<T>, GpuError> {
        self.each_device_at(minors, |_, minor, d| f(minor, d))
    }

    /// [`Gpus::each_device`] with each GPU's NVML index (`f(index, minor,
    /// device)`): none without NVML.
    fn each_device_at<T>(
        &self,
        minors: &BTreeSet<u32>,
        mut f: impl FnMut(u32, u32, &nvml_wrapper::Device<'_>) -> Result<T, GpuError>,
    ) -> Result<Vec<T>, GpuError> {
        let Some(nvml) = &self.nvml else {
            return Ok(Vec::new());
        };
        let n = nvml
            .device_count()
            .map_err(|e| GpuError::nvml("nvmlDeviceGetCount", NvmlAt::Node, e))?;
        let mut out = Vec::new();
        for i in 0..n {
            let d = nvml
                .device_by_index(i)
                .map_err(|e| GpuError::nvml("nvmlDeviceGetHandleByIndex", NvmlAt::Index(i), e))?;
            let minor = d
                .minor_number()
                .map_err(|e| GpuError::nvml("nvmlDeviceGetMinorNumber", NvmlAt::Index(i), e))?;
            if minors.contains(&minor) {
                out.push(f(i, minor, &d)?);
            }
        }
        Ok(out)
    }

    /// The GPUs with these minors, with their processes and memory. GPUs
    /// NVML does not list are absent from the result.
    ///
    /// # Errors
    /// The first NVML error, with the call that failed.
    pub fn query(&self, minors: &BTreeSet<u32>) -> Result<Vec<GpuInfo>, GpuError> {
        self.each_device(minors, |minor, d| {
            let err = |what: &str, e: NvmlError| GpuError::nvml(what, NvmlAt::Minor(minor), e);
            let mem = d
                .memory_info()
                .map_err(|e| err("nvmlDeviceGetMemoryInfo", e))?;
            let mut processes = Vec::new();
            // MPS clients are listed apart from the server, which is a
            // compute process (`nvmlDeviceGetMPSComputeRunningProcesses_v3`,
            // NVML API reference); a driver or library without the call
            // has no MPS clients to list.
            let mps = match d.mps_running_compute_processes() {
                Err(
                    NvmlError::NotSupported
                    | NvmlError::FunctionNotFound
                    | NvmlError::FailedToLoadSymbol(_),
                ) => Ok(Vec::new()),
                r => r,
            };
            for (kind, call, list) in [
                ("compute", "Compute", d.running_compute_processes()),
                ("graphics", "Graphics", d.running_graphics_processes()),
                ("mps", "MPSCompute", mps),
            ] {
                let list =
                    list.map_err(|e| err(&format!("nvmlDeviceGet{call}RunningProcesses"), e))?;
                processes.extend(list.into_iter().map(|p| GpuProcess {
                    pid: p.pid,
                    used_memory: match p.used_gpu_memory {
                        UsedGpuMemory::Used(b) => Some(b),
                        UsedGpuMemory::Unavailable => None,
                    },
                    kind,
                    gpu_instance_id: p.gpu_instance_id,
                    compute_instance_id: p.compute_instance_id,
                }));
            }
            Ok(GpuInfo {
                minor,
                uuid: d.uuid().map_err(|e| err("nvmlDeviceGetUUID", e))?,
                pci_bus_id: d
                    .pci_info()
                    .map_err(|e| err("nvmlDeviceGetPciInfo", e))?
                    .bus_id,
                memory_used: mem.used,
                memory_total: mem.total,
                processes,
            })
        })
    }

    /// The NVML index of each GPU with these minors: `minor -> index`,
    /// the index `nvmlDeviceGetHandleByIndex` takes (NVML orders GPUs by
    /// PCI bus id, NVML API reference), which is what `nvidia-smi` and
    /// DCGM call the GPU's number (dcgm-exporter's `gpu` label). It is not
    /// the minor of `/dev/nvidia<minor>`, nor Slurm's GRES index (this
    /// module's doc). A minor NVML does not list is absent from the map.
    ///
    /// # Errors
    /// [`GpuError::Unavailable`] without NVML (an index cannot be told
    /// then); else the first NVML error, with the call that failed.
    pub fn indices(&self, minors: &BTreeSet<u32>) -> Result<BTreeMap<u32, u32>, GpuError> {
        if self.nvml.is_none() {
            return Err(GpuError::Unavailable(
                self.unavailable.clone().unwrap_or_default(),
            ));
        }
        Ok(self
            .each_device_at(minors, |index, minor, _| Ok((minor, index)))?
            .into_iter()
            .collect())
    }

    /// The minors of every GPU NVML lists (none without NVML).
    ///
    /// # Errors
    /// The first NVML error.
    pub fn minors(&self) -> Result<BTreeSet<u32>, GpuError> {
        let Some(nvml) = &self.nvml else {
            return Ok(BTreeSet::new());
        };
        let n = nvml
            .device_count()
            .map_err(|e| GpuError::nvml("nvmlDeviceGetCount", NvmlAt::Node, e))?;
        let mut out = BTreeSet::new();
        for i in 0..n {
            let d = nvml
                .device_by_index(i)
                .map_err(|e| GpuError::nvml("nvmlDeviceGetHandleByIndex", NvmlAt::Index(i), e))?;
            out.insert(
                d.minor_number()
                    .map_err(|e| GpuError::nvml("nvmlDeviceGetMinorNumber", NvmlAt::Index(i), e))?,
            );
        }
        Ok(out)
    }

    /// Utilisation of each GPU with these minors over the driver's last
    /// sample period. A GPU that does not report it
    /// (`NVML_ERROR_NOT_SUPPORTED`, e.g. with MIG enabled) has `None`s.
    ///
    /// # Errors
    /// The first other NVML error.
    pub fn utilization(&self, minors: &BTreeSet<u32>) -> Result<Vec<GpuUtilization>, GpuError> {
        self.each_device(minors, |minor, d| match d.utilization_rates() {
            Ok(u) => Ok(GpuUtilization {
                minor,
                gpu: Some(u.gpu),
                memory: Some(u.memory),
            }),
            Err(NvmlError::NotSupported) => Ok(GpuUtilization {
                minor,
                gpu: None,
                memory: None,
            }),
            Err(e) => Err(GpuError::nvml(
                "nvmlDeviceGetUtilizationRates",
                NvmlAt::Minor(minor),
                e,
            )),
        })
    }

    /// Used memory of each GPU with these minors, bytes.
    ///
    /// # Errors
    /// The first NVML error.
    pub fn memory_used(&self, minors: &BTreeSet<u32>) -> Result<Vec<(u32, u64)>, GpuError> {
        self.each_device(minors, |minor, d| {
            d.memory_info()
                .map(|m| (minor, m.used))
                .map_err(|e| GpuError::nvml("nvmlDeviceGetMemoryInfo", NvmlAt::Minor(minor), e))
        })
    }

    /// For GPUs with accounting mode on: the processes accounted that
    /// started in `[since_us, until_us]` (µs since the epoch). GPUs with
    /// accounting off are absent.
    ///
    /// # Errors
    /// The first NVML error.
    pub fn accounting(
        &self,
        minors: &BTreeSet<u32>,
        since_us: u64,
        until_us: u64,
    ) -> Result<Vec<(u32, Vec<AccountedProcess>)>, GpuError> {
        let all = self.each_device(minors, |minor, d| {
            let err = |what: &str, e: NvmlError| GpuError::nvml(what, NvmlAt::Minor(minor), e);
            if !d
                .is_accounting_enabled()
                .map_err(|e| err("nvmlDeviceGetAccountingMode", e))?
            {
                return Ok(None);
            }
            let mut procs = Vec::new();
            for pid in d
                .accounting_pids()
                .map_err(|e| err("nvmlDeviceGetAccountingPids", e))?
            {
                let s = d
                    .accounting_stats_for(pid)
                    .map_err(|e| err("nvmlDeviceGetAccountingStats", e))?;
                if s.start_time >= since_us && s.start_time <= until_us {
                    procs.push(AccountedProcess {
                        pid,
                        max_memory: s.max_memory_usage,
                        gpu_utilization: s.gpu_utilization,
                        memory_utilization: s.memory_utilization,
                        start_time_us: s.start_time,
                        time_ms: s.time,
                    });
                }
            }
            Ok(Some((minor, procs)))
        })?;
        Ok(all.into_iter().flatten().collect())
    }
}

/// A GPU compute mode (`nvmlComputeMode_t`), by NVML's number:
/// 0 default, 1 exclusive-thread (removed), 2 prohibited, 3 exclusive-process.
pub type ComputeModeNum = u32;

fn mode_from(m: nvml_wrapper::enum_wrappers::device::ComputeMode) -> ComputeModeNum {
    use nvml_wrapper::enum_wrappers::device::ComputeMode::*;
    match m {
        Default => 0,
        ExclusiveThread => 1,
        Prohibited => 2,
        ExclusiveProcess => 3,
    }
}

fn mode_to(n: ComputeModeNum) -> Option<nvml_wrapper::enum_wrappers::device::ComputeMode> {
    use nvml_wrapper::enum_wrappers::device::ComputeMode::*;
    Some(match n {
        0 => Default,
        1 => ExclusiveThread,
        2 => Prohibited,
        3 => ExclusiveProcess,
        _ => return None,
    })
}

/// NVML's exclusive-process compute mode.
pub const EXCLUSIVE_PROCESS: ComputeModeNum = 3;

impl Gpus {
    /// Sets the compute mode of the GPU with this minor and returns the
    /// mode it had (needs root).
    ///
    /// # Errors
    /// The NVML error ([`GpuError::Nvml`], [`GpuError::Bare`]),
    /// [`GpuError::Unavailable`], [`GpuError::UnknownMode`] or
    /// [`GpuError::NoSuchMinor`].
    pub fn swap_compute_mode(
        &self,
        minor: u32,
        mode: ComputeModeNum,
    ) -> Result<ComputeModeNum, GpuError> {
        let Some(nvml) = &self.nvml else {
            return Err(GpuError::Unavailable(
                self.unavailable.clone().unwrap_or_default(),
            ));
        };
        let want = mode_to(mode).ok_or(GpuError::UnknownMode(mode))?;
        let n = nvml
            .device_count()
            .map_err(|e| GpuError::nvml("nvmlDeviceGetCount", NvmlAt::Node, e))?;
        for i in 0..n {
            let mut d = nvml
                .device_by_index(i)
                .map_err(|e| GpuError::nvml("nvmlDeviceGetHandleByIndex", NvmlAt::Index(i), e))?;
            if d.minor_number().map_err(GpuError::Bare)? != minor {
                continue;
            }
            let old = mode_from(
                d.compute_mode()
                    .map_err(|e| GpuError::nvml("nvmlDeviceGetComputeMode", NvmlAt::Node, e))?,
            );
            d.set_compute_mode(want)
                .map_err(|e| GpuError::nvml("nvmlDeviceSetComputeMode", NvmlAt::Minor(minor), e))?;
            return Ok(old);
        }
        Err(GpuError::NoSuchMinor(minor))
    }
}
