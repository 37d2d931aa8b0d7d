//! A fake NVIDIA Management Library (`libnvidia_ml.so`) for tests.
//!
//! It exports the NVML entry points that `nvml-wrapper` 0.13 calls for
//! gpufence's queries, and answers them from a JSON *scenario* file, so the
//! real NVML code path (`Nvml::builder().lib_path(p).init()`) runs on machines
//! without a GPU.
//!
//! # Where the scenario comes from
//!
//! The scenario is re-read on every call (tests edit it while processes use
//! the library). Its path is the environment variable
//! `GPUFENCE_FAKE_NVML_SCENARIO` when set and not empty, else
//! `nvml-scenario.json` in the directory of the loaded `.so` itself (found
//! with `dladdr`), for processes whose environment a test cannot set (Slurm's
//! Prolog and Epilog).
//!
//! # Scenario schema
//!
//! ```json
//! {
//!   "init_error": null,
//!   "driver_version": "550.54.15",
//!   "control_device": "/dev/nvidiactl",
//!   "gpus": [
//!     {
//!       "minor": 0,
//!       "uuid": "GPU-11111111-2222-3333-4444-555555555555",
//!       "pci_bus_id": "00000000:17:00.0",
//!       "name": "NVIDIA H200",
//!       "memory_total_mib": 143771,
//!       "idle_used_mib": 512,
//!       "stuck_used_mib": 0,
//!       "processes": [{"pid": 1234, "used_mib": 1000, "kind": "compute"}],
//!       "fail": {"processes": 999, "memory": null},
//!       "accounting": {
//!         "enabled": true,
//!         "pids": [{"pid": 1234, "max_memory_mib": 900, "gpu_util": 55, "mem_util": 20,
//!                   "start_time_us": 1700000000000000, "time_ms": 5000, "is_running": false}]
//!       },
//!       "compute_mode": 0,
//!       "util_gpu": 0,
//!       "util_mem": 0,
//!       "device_file": "/dev/nvidia0"
//!     }
//!   ]
//! }
//! ```
//!
//! Unknown keys anywhere are an error (a typo must not pass silently). Every
//! key is optional:
//!
//! * `init_error` (default `null`): an NVML return code (e.g. 9 =
//!   `NVML_ERROR_DRIVER_NOT_LOADED`, 4 = `NO_PERMISSION`) that `nvmlInit_v2`
//!   and `nvmlInitWithFlags` return; `null` or 0 means init succeeds.
//! * `driver_version` (default `"550.54.15"`): `nvmlSystemGetDriverVersion`.
//! * `control_device` (default none): a file that init opens read-write, as
//!   the real library opens `/dev/nvidiactl`. Refused (EPERM from a device
//!   cgroup, EACCES): init returns `NVML_ERROR_NO_PERMISSION` (4); missing:
//!   `NVML_ERROR_DRIVER_NOT_LOADED`; ENXIO/ENODEV (a `mknod` stand-in with
//!   no driver behind it, let through by the device cgroup) count as
//!   opened.
//! * `gpus` (default `[]`): one entry per device, in NVML index order
//!   (`nvmlDeviceGetHandleByIndex_v2(i)` is `gpus[i]`).
//!   * `minor` (default: the index): `nvmlDeviceGetMinorNumber`.
//!   * `uuid` (default `GPU-fa4e0000-0000-0000-0000-<index as 12 hex digits>`).
//!   * `pci_bus_id` (default `00000000:<index+1 as 2 hex digits>:00.0`):
//!     `busId` of `nvmlDeviceGetPciInfo_v3`; domain, bus and device are parsed
//!     from it, `busIdLegacy` is derived, the PCI device ids are 0.
//!   * `name` (default `"NVIDIA Fake GPU"`).
//!   * `memory_total_mib` (default 81920), `idle_used_mib` (default 0),
//!     `stuck_used_mib` (default 0): `nvmlDeviceGetMemoryInfo_v2` reports
//!     used = idle + stuck + the `used_mib` of every listed process that is
//!     alive, free = total - used (saturating), reserved = 0. So killing a
//!     process frees its memory; `stuck_used_mib` never comes back.
//!   * `processes` (default `[]`): `pid`, `used_mib` (default 0; `null` means
//!     NVML's "not available"), `kind` (`"compute"`, the default, or
//!     `"graphics"`, or `"mps"`: a client of an MPS server, listed by
//!     `nvmlDeviceGetMPSComputeRunningProcesses_v3`), `gi` / `ci` (MIG GPU /
//!     compute instance ids; absent: not on a MIG instance). A process is
//!     listed by `nvmlDeviceGet{Compute,Graphics,MPSCompute}RunningProcesses_v3` only while
//!     `/proc/<pid>` exists and is not a zombie, as with the real driver.
//!   * `fail` (default: nothing fails): per query, an NVML return code that
//!     query returns instead of its answer (`null` or 0: answer normally).
//!     Keys: `handle` (get handle by index/UUID/PCI bus id), `minor`, `uuid`,
//!     `pci_info`, `name`, `processes` (every process list),
//!     `compute_processes`, `graphics_processes`, `mps_processes` (one
//!     list; wins over `processes`), `memory`, `accounting_mode`, `accounting_pids`,
//!     `accounting_stats`, `compute_mode`, `set_compute_mode`, `utilization`.
//!   * `accounting` (default: disabled): `enabled` (default `false`) is
//!     `nvmlDeviceGetAccountingMode`; while disabled, the pid and stats
//!     queries return `NVML_ERROR_NOT_SUPPORTED`, like the real driver. `pids`
//!     lists the processes `nvmlDeviceGetAccountingPids` returns (alive or
//!     not, as accounting outlives processes). `nvmlDeviceGetAccountingStats`
//!     for a pid not listed returns `NVML_ERROR_NOT_FOUND`; for a listed one:
//!     `max_memory_mib`, `gpu_util`, `mem_util` (each absent or `null`: NVML's
//!     "not available"), `start_time_us`, `time_ms` (default 0), and
//!     `is_running` (absent or `null`: whether the pid is alive now).
//!   * `compute_mode` (default 0 = DEFAULT; 1 EXCLUSIVE_THREAD, 2 PROHIBITED,
//!     3 EXCLUSIVE_PROCESS), unless overridden by the state file below.
//!   * `util_gpu`, `util_mem` (default 0): `nvmlDeviceGetUtilizationRates`.
//!   * `device_file` (default none): a file that taking the GPU's handle
//!     (by index, UUID or PCI bus id) opens as `control_device` is opened,
//!     with the same answers: a device cgroup that denies `/dev/nvidia<N>`
//!     makes its handle `NVML_ERROR_NO_PERMISSION`, as with the real
//!     driver (`nvmlDeviceGetCount_v2` counts GPUs the caller may not open;
//!     `nvmlDeviceGetHandleByIndex_v2` then refuses them).
//!
//! # Other behaviour
//!
//! * A missing or unparsable scenario makes init return
//!   `NVML_ERROR_DRIVER_NOT_LOADED` (9); it writes nothing (set
//!   `GPUFENCE_FAKE_NVML_DEBUG=1` to get the reason on stderr). If the
//!   scenario goes missing or bad after init, other calls return
//!   `NVML_ERROR_UNKNOWN` (999).
//! * Init and shutdown are reference counted like the real library; calls
//!   other than init and `nvmlErrorString` return `NVML_ERROR_UNINITIALIZED`
//!   when the count is 0.
//! * `nvmlDeviceSetComputeMode` persists the mode in `nvml-state.json` next to
//!   the scenario, as `{"compute_mode": {"<minor>": <mode>}}` (under `flock`),
//!   and `nvmlDeviceGetComputeMode` reads it back, so separate processes see
//!   it. Delete the file to go back to the scenario's `compute_mode`.
//! * Device handles are `index + 1` cast to a pointer; they are checked
//!   against the current scenario's GPU count on every call.
//! * No function panics across the FFI boundary: every body runs under
//!   `catch_unwind` and a panic becomes `NVML_ERROR_UNKNOWN`.

// The exported functions are the C ABI that NVML and glibc NSS define
// (their headers document each); the bodies read and write through the
// caller's pointers under that contract. This is a test double.
#![allow(
    missing_docs,
    unsafe_op_in_unsafe_fn,
    clippy::undocumented_unsafe_blocks
)]
#![allow(clippy::missing_safety_doc)]

use std::collections::BTreeMap;
use std::ffi::{c_char, c_uint, c_void, CStr, OsStr};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::io::AsRawFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

use nvml_wrapper_sys::bindings::{
    nvmlAccountingStats_t, nvmlComputeMode_t, nvmlDevice_t, nvmlEnableState_t, nvmlMemory_v2_t,
    nvmlPciInfo_t, nvmlProcessInfo_t,
    nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH as ARGUMENT_VERSION_MISMATCH,
    nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED as DRIVER_NOT_LOADED,
    nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE as INSUFFICIENT_SIZE,
    nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT as INVALID_ARGUMENT,
    nvmlReturn_enum_NVML_ERROR_NOT_FOUND as NOT_FOUND,
    nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED as NOT_SUPPORTED,
    nvmlReturn_enum_NVML_ERROR_NO_PERMISSION as NO_PERMISSION,
    nvmlReturn_enum_NVML_ERROR_UNINITIALIZED as UNINITIALIZED,
    nvmlReturn_enum_NVML_ERROR_UNKNOWN as UNKNOWN, nvmlReturn_enum_NVML_SUCCESS as SUCCESS,
    nvmlReturn_t, nvmlUtilization_t,
};
use serde::{Deserialize, Deserializer, Serialize};

/// Environment variable naming the scenario file.
const SCENARIO_ENV: &str = "GPUFENCE_FAKE_NVML_SCENARIO";
/// Scenario file name next to the `.so` when the variable is not set.
const DEFAULT_SCENARIO: &str = "nvml-scenario.json";
/// Persistent state (compute modes) next to the scenario.
const STATE_FILE: &str = "nvml-state.json";
/// When set (not empty), scenario load errors are printed to stderr.
const DEBUG_ENV: &str = "GPUFENCE_FAKE_NVML_DEBUG";

const MIB: u64 = 1024 * 1024;
/// `NVML_VALUE_NOT_AVAILABLE` (-1) in the unsigned fields.
const NA_U32: u32 = u32::MAX;
const NA_U64: u64 = u64::MAX;

// ---------------------------------------------------------------------------
// Scenario
// ---------------------------------------------------------------------------

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Scenario {
    #[serde(default)]
    init_error: Option<u32>,
    #[serde(default = "default_driver_version")]
    driver_version: String,
    #[serde(default)]
    gpus: Vec<Gpu>,
    /// A file opened at init, as the real library opens `/dev/nvidiactl`.
    #[serde(default)]
    control_device: Option<PathBuf>,
}

fn default_driver_version() -> String {
    "550.54.15".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Gpu {
    #[serde(default)]
    minor: Option<u32>,
    #[serde(default)]
    uuid: Option<String>,
    #[serde(default)]
    pci_bus_id: Option<String>,
    #[serde(default = "default_name")]
    name: String,
    #[serde(default = "default_total")]
    memory_total_mib: u64,
    #[serde(default)]
    idle_used_mib: u64,
    #[serde(default)]
    stuck_used_mib: u64,
    #[serde(default)]
    processes: Vec<Process>,
    #[serde(default)]
    fail: Fail,
    #[serde(default)]
    accounting: Accounting,
    #[serde(default)]
    compute_mode: u32,
    #[serde(default)]
    util_gpu: u32,
    #[serde(default)]
    util_mem: u32,
    /// A file opened when a handle is taken, as the real library opens
    /// `/dev/nvidia<minor>`.
    #[serde(default)]
    device_file: Option<PathBuf>,
}

fn default_name() -> String {
    "NVIDIA Fake GPU".into()
}

fn default_total() -> u64 {
    81920
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Process {
    pid: u32,
    /// `None` (JSON `null`) is NVML's "not available"; absent is 0.
    #[serde(default = "some_zero", deserialize_with = "nullable")]
    used_mib: Option<u64>,
    #[serde(default)]
    kind: Kind,
    /// MIG GPU instance id the process runs on (`null`/absent: not MIG).
    #[serde(default)]
    gi: Option<u32>,
    /// MIG compute instance id.
    #[serde(default)]
    ci: Option<u32>,
}

fn some_zero() -> Option<u64> {
    Some(0)
}

fn nullable<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    Option::<u64>::deserialize(d)
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Kind {
    #[default]
    Compute,
    Graphics,
    /// A client of an MPS server: listed by
    /// `nvmlDeviceGetMPSComputeRunningProcesses_v3` only (the server
    /// itself is a `compute` process).
    Mps,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Fail {
    handle: Option<u32>,
    minor: Option<u32>,
    uuid: Option<u32>,
    pci_info: Option<u32>,
    name: Option<u32>,
    processes: Option<u32>,
    compute_processes: Option<u32>,
    graphics_processes: Option<u32>,
    mps_processes: Option<u32>,
    memory: Option<u32>,
    accounting_mode: Option<u32>,
    accounting_pids: Option<u32>,
    accounting_stats: Option<u32>,
    compute_mode: Option<u32>,
    set_compute_mode: Option<u32>,
    utilization: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Accounting {
    #[serde(default)]
    enabled: bool,
    #[serde(default)]
    pids: Vec<AccountingPid>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AccountingPid {
    pid: u32,
    #[serde(default)]
    max_memory_mib: Option<u64>,
    #[serde(default)]
    gpu_util: Option<u32>,
    #[serde(default)]
    mem_util: Option<u32>,
    #[serde(default)]
    start_time_us: u64,
    #[serde(default)]
    time_ms: u64,
    #[serde(default)]
    is_running: Option<bool>,
}

impl Gpu {
    fn minor(&self, index: usize) -> u32 {
        self.minor.unwrap_or(index as u32)
    }

    fn uuid(&self, index: usize) -> String {
        self.uuid
            .clone()
            .unwrap_or_else(|| format!("GPU-fa4e0000-0000-0000-0000-{index:012x}"))
    }

    fn pci_bus_id(&self, index: usize) -> String {
        self.pci_bus_id
            .clone()
            .unwrap_or_else(|| format!("00000000:{:02X}:00.0", (index + 1) & 0xff))
    }

    /// The listed processes of `kind` that are alive now.
    fn live_processes(&self, kind: Kind) -> Vec<&Process> {
        self.processes
            .iter()
            .filter(|p| p.kind == kind && alive(p.pid))
            .collect()
    }

    fn used_mib(&self) -> u64 {
        let procs: u64 = self
            .processes
            .iter()
            .filter(|p| alive(p.pid))
            .map(|p| p.used_mib.unwrap_or(0))
            .fold(0, u64::saturating_add);
        self.idle_used_mib
            .saturating_add(self.stuck_used_mib)
            .saturating_add(procs)
    }
}

/// A loaded scenario and the path it came from.
struct Loaded {
    path: PathBuf,
    scenario: Scenario,
}

impl Loaded {
    fn state_path(&self) -> PathBuf {
        match self.path.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir.join(STATE_FILE),
            _ => PathBuf::from(STATE_FILE),
        }
    }
}

/// Something in this library's own code, to find its file with `dladdr`.
/// Private, so that no other loaded copy of the library can interpose it.
#[inline(never)]
extern "C" fn anchor() {}

/// The directory of the loaded `.so`, found once.
fn own_dir() -> Option<PathBuf> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| {
        // SAFETY: dladdr only reads the address; Dl_info is plain data.
        let fname = unsafe {
            let mut info: libc::Dl_info = std::mem::zeroed();
            let f: extern "C" fn() = anchor;
            if libc::dladdr(f as *const c_void, &mut info) == 0 || info.dli_fname.is_null() {
                return None;
            }
            PathBuf::from(OsStr::from_bytes(CStr::from_ptr(info.dli_fname).to_bytes()))
        };
        let fname = std::fs::canonicalize(&fname).unwrap_or(fname);
        fname.parent().map(Path::to_path_buf)
    })
    .clone()
}

fn scenario_path() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os(SCENARIO_ENV) {
        if !p.is_empty() {
            return Ok(PathBuf::from(p));
        }
    }
    own_dir()
        .map(|d| d.join(DEFAULT_SCENARIO))
        .ok_or_else(|| "cannot find the library's own directory (dladdr)".into())
}

fn load() -> Result<Loaded, String> {
    let path = scenario_path()?;
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let scenario: Scenario =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(Loaded { path, scenario })
}

fn debug(msg: &str) {
    if std::env::var_os(DEBUG_ENV).is_some_and(|v| !v.is_empty()) {
        eprintln!("fake libnvidia-ml: {msg}");
    }
}

/// Whether `/proc/<pid>` exists and is not a zombie (or dead).
fn alive(pid: u32) -> bool {
    if pid == 0 {
        return false;
    }
    let Ok(stat) = std::fs::read(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // "pid (comm) S ...": the state follows the last ')'.
    let Some(close) = stat.iter().rposition(|&b| b == b')') else {
        return false;
    };
    let state = stat
        .get(close + 1..)
        .and_then(|rest| rest.iter().find(|b| !b.is_ascii_whitespace()));
    !matches!(state, None | Some(b'Z') | Some(b'X') | Some(b'x'))
}

// ---------------------------------------------------------------------------
// Persistent state (compute modes)
// ---------------------------------------------------------------------------

#[derive(Debug, Default, Serialize, Deserialize)]
struct State {
    #[serde(default)]
    compute_mode: BTreeMap<String, u32>,
}

fn flock(f: &File, op: libc::c_int) -> std::io::Result<()> {
    // SAFETY: a valid open descriptor.
    if unsafe { libc::flock(f.as_raw_fd(), op) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn parse_state(text: &str) -> Result<State, String> {
    if text.trim().is_empty() {
        return Ok(State::default());
    }
    serde_json::from_str(text).map_err(|e| e.to_string())
}

fn read_state(path: &Path) -> Result<State, String> {
    let mut f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(State::default()),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    flock(&f, libc::LOCK_SH).map_err(|e| e.to_string())?;
    let mut text = String::new();
    f.read_to_string(&mut text).map_err(|e| e.to_string())?;
    parse_state(&text)
}

fn update_state(path: &Path, change: impl FnOnce(&mut State)) -> Result<(), String> {
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    // Root (the Prolog) and the test user both use it.
    let _ = f.set_permissions(std::fs::Permissions::from_mode(0o666));
    flock(&f, libc::LOCK_EX).map_err(|e| e.to_string())?;
    let mut text = String::new();
    f.read_to_string(&mut text).map_err(|e| e.to_string())?;
    let mut state = parse_state(&text)?;
    change(&mut state);
    let out = serde_json::to_string_pretty(&state).map_err(|e| e.to_string())?;
    f.seek(SeekFrom::Start(0)).map_err(|e| e.to_string())?;
    f.set_len(0).map_err(|e| e.to_string())?;
    f.write_all(out.as_bytes()).map_err(|e| e.to_string())?;
    f.write_all(b"\n").map_err(|e| e.to_string())?;
    Ok(())
}

// ---------------------------------------------------------------------------
// Call plumbing
// ---------------------------------------------------------------------------

static INIT_COUNT: AtomicU32 = AtomicU32::new(0);

/// Runs `f`, turning a panic into `NVML_ERROR_UNKNOWN`.
fn guard(f: impl FnOnce() -> nvmlReturn_t) -> nvmlReturn_t {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(UNKNOWN)
}

/// A fail code that is set and not success.
fn failing(code: Option<u32>) -> Option<nvmlReturn_t> {
    code.filter(|&c| c != SUCCESS)
}

/// Checks init, loads the scenario and runs `f` with it.
fn with_scenario(f: impl FnOnce(&Loaded) -> nvmlReturn_t) -> nvmlReturn_t {
    guard(|| {
        if INIT_COUNT.load(Ordering::SeqCst) == 0 {
            return UNINITIALIZED;
        }
        match load() {
            Ok(l) => f(&l),
            Err(e) => {
                debug(&e);
                UNKNOWN
            }
        }
    })
}

/// Like `with_scenario`, for the GPU behind `device`; `fail` picks the query's
/// fail code.
fn with_gpu(
    device: nvmlDevice_t,
    fail: impl FnOnce(&Fail) -> Option<u32>,
    f: impl FnOnce(&Loaded, &Gpu, usize) -> nvmlReturn_t,
) -> nvmlReturn_t {
    with_scenario(|l| {
        let h = device as usize;
        if h == 0 || h > l.scenario.gpus.len() {
            return INVALID_ARGUMENT;
        }
        let index = h - 1;
        let gpu = &l.scenario.gpus[index];
        if let Some(code) = failing(fail(&gpu.fail)) {
            return code;
        }
        f(l, gpu, index)
    })
}

fn handle_for(index: usize) -> nvmlDevice_t {
    (index + 1) as nvmlDevice_t
}

/// Copies `s` and a NUL into the caller's buffer of `len` bytes.
unsafe fn put_str(dst: *mut c_char, len: c_uint, s: &str) -> nvmlReturn_t {
    if dst.is_null() {
        return INVALID_ARGUMENT;
    }
    let b = s.as_bytes();
    if b.len() >= len as usize {
        return INSUFFICIENT_SIZE;
    }
    std::ptr::copy_nonoverlapping(b.as_ptr().cast::<c_char>(), dst, b.len());
    *dst.add(b.len()) = 0;
    SUCCESS
}

/// Copies `s` into a fixed C array, truncating, always NUL-terminated.
fn fill_array(dst: &mut [c_char], s: &str) {
    dst.fill(0);
    let n = s.len().min(dst.len().saturating_sub(1));
    for (d, &b) in dst.iter_mut().zip(&s.as_bytes()[..n]) {
        *d = b as c_char;
    }
}

/// Reads a C string argument.
unsafe fn arg_str<'a>(p: *const c_char) -> Option<&'a str> {
    if p.is_null() {
        None
    } else {
        CStr::from_ptr(p).to_str().ok()
    }
}

/// "DDDDDDDD:BB:DD.F" (or "DDDD:BB:DD.F") to (domain, bus, device, function).
fn parse_bus_id(s: &str) -> (u32, u32, u32, u32) {
    let mut parts = s.trim().rsplitn(3, ':');
    let devfn = parts.next().unwrap_or("");
    let bus = parts.next().unwrap_or("");
    let domain = parts.next().unwrap_or("");
    let (dev, func) = devfn.split_once('.').unwrap_or((devfn, "0"));
    let hex = |s: &str| u32::from_str_radix(s, 16).unwrap_or(0);
    (hex(domain), hex(bus), hex(dev), hex(func))
}

/// The same bus id, case- and domain-width-insensitively.
fn same_bus_id(a: &str, b: &str) -> bool {
    parse_bus_id(a) == parse_bus_id(b)
}

/// Opens a device file read-write and closes it again, as the real library
/// does with `/dev/nvidiactl` at init and `/dev/nvidia<minor>` when it
/// takes a device's handle: `None` when the open went through, or failed
/// only because no driver stands behind the file (ENXIO or ENODEV: the
/// tests' `mknod` stand-ins, which the device cgroup let through);
/// `NVML_ERROR_NO_PERMISSION` when it was refused (EPERM from the device
/// cgroup, EACCES from the file's mode), as `nvmlInit_v2` and
/// `nvmlDeviceGetHandleByIndex_v2` answer then (NVML API reference,
/// "Insufficient Permissions"); `NVML_ERROR_DRIVER_NOT_LOADED` for a
/// missing file.
fn device_open(path: &Path) -> Option<nvmlReturn_t> {
    match OpenOptions::new().read(true).write(true).open(path) {
        Ok(_) => None,
        Err(e) => match e.raw_os_error() {
            Some(libc::ENXIO) | Some(libc::ENODEV) => None,
            Some(libc::EPERM) | Some(libc::EACCES) => {
                debug(&format!("{}: {e}", path.display()));
                Some(NO_PERMISSION)
            }
            _ => {
                debug(&format!("{}: {e}", path.display()));
                Some(DRIVER_NOT_LOADED)
            }
        },
    }
}

// ---------------------------------------------------------------------------
// Exported entry points
// ---------------------------------------------------------------------------

fn init() -> nvmlReturn_t {
    guard(|| match load() {
        Err(e) => {
            debug(&e);
            DRIVER_NOT_LOADED
        }
        Ok(l) => match failing(l.scenario.init_error)
            .or_else(|| l.scenario.control_device.as_deref().and_then(device_open))
        {
            Some(code) => code,
            None => {
                INIT_COUNT.fetch_add(1, Ordering::SeqCst);
                SUCCESS
            }
        },
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    init()
}

/// The flags (`NVML_INIT_FLAG_NO_GPUS`, `NO_ATTACH`) are accepted and ignored.
#[no_mangle]
pub unsafe extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    init()
}

/// The legacy `nvmlInit` (v1), for completeness.
#[no_mangle]
pub unsafe extern "C" fn nvmlInit() -> nvmlReturn_t {
    init()
}

#[no_mangle]
pub unsafe extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    guard(|| {
        match INIT_COUNT.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)) {
            Ok(_) => SUCCESS,
            Err(_) => UNINITIALIZED,
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    catch_unwind(|| error_string(result))
        .unwrap_or(c"Unknown Error")
        .as_ptr()
}

fn error_string(code: nvmlReturn_t) -> &'static CStr {
    match code {
        0 => c"Success",
        1 => c"Uninitialized",
        2 => c"Invalid Argument",
        3 => c"Not Supported",
        4 => c"Insufficient Permissions",
        5 => c"Already Initialized",
        6 => c"Not Found",
        7 => c"Insufficient Size",
        8 => c"Insufficient External Power",
        9 => c"Driver Not Loaded",
        10 => c"Timeout",
        11 => c"Interrupt request issue",
        12 => c"NVML Shared Library Not Found",
        13 => c"Function Not Found",
        14 => c"Corrupted infoROM",
        15 => c"GPU is lost",
        16 => c"GPU requires reset",
        17 => c"GPU access blocked by the operating system",
        18 => c"RM has detected an NVML/RM version mismatch",
        19 => c"In use by another client",
        20 => c"Insufficient Memory",
        21 => c"No data",
        22 => c"The requested vgpu operation is not available on target device, because ECC is enabled",
        23 => c"Insufficient resources for the requested operation",
        24 => c"Frequency not supported",
        25 => c"Argument version mismatch",
        26 => c"Deprecated",
        27 => c"Not Ready",
        28 => c"GPU not found",
        29 => c"Invalid state",
        30 => c"Reset type not supported",
        _ => c"Unknown Error",
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    with_scenario(|l| put_str(version, length, &l.scenario.driver_version))
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> nvmlReturn_t {
    with_scenario(|l| {
        if count.is_null() {
            return INVALID_ARGUMENT;
        }
        *count = l.scenario.gpus.len() as c_uint;
        SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    with_scenario(|l| {
        if device.is_null() {
            return INVALID_ARGUMENT;
        }
        let Some(gpu) = l.scenario.gpus.get(index as usize) else {
            return INVALID_ARGUMENT;
        };
        if let Some(code) =
            failing(gpu.fail.handle).or_else(|| gpu.device_file.as_deref().and_then(device_open))
        {
            return code;
        }
        *device = handle_for(index as usize);
        SUCCESS
    })
}

/// Finds a device by a predicate over (gpu, index).
unsafe fn handle_by(
    device: *mut nvmlDevice_t,
    key: *const c_char,
    matches: impl Fn(&Gpu, usize, &str) -> bool,
) -> nvmlReturn_t {
    with_scenario(|l| {
        let Some(key) = arg_str(key) else {
            return INVALID_ARGUMENT;
        };
        if device.is_null() {
            return INVALID_ARGUMENT;
        }
        let found = l
            .scenario
            .gpus
            .iter()
            .enumerate()
            .find(|(i, g)| matches(g, *i, key));
        let Some((index, gpu)) = found else {
            return NOT_FOUND;
        };
        if let Some(code) =
            failing(gpu.fail.handle).or_else(|| gpu.device_file.as_deref().and_then(device_open))
        {
            return code;
        }
        *device = handle_for(index);
        SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    handle_by(device, uuid, |g, i, key| g.uuid(i) == key)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId_v2(
    pci_bus_id: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    handle_by(device, pci_bus_id, |g, i, key| {
        same_bus_id(&g.pci_bus_id(i), key)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(
    device: nvmlDevice_t,
    minor: *mut c_uint,
) -> nvmlReturn_t {
    with_gpu(
        device,
        |f| f.minor,
        |_, gpu, index| {
            if minor.is_null() {
                return INVALID_ARGUMENT;
            }
            *minor = gpu.minor(index);
            SUCCESS
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    with_gpu(
        device,
        |f| f.uuid,
        |_, gpu, index| put_str(uuid, length, &gpu.uuid(index)),
    )
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    with_gpu(
        device,
        |f| f.name,
        |_, gpu, _| put_str(name, length, &gpu.name),
    )
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    with_gpu(
        device,
        |f| f.pci_info,
        |_, gpu, index| {
            if pci.is_null() {
                return INVALID_ARGUMENT;
            }
            let bus_id = gpu.pci_bus_id(index);
            let (domain, bus, dev, func) = parse_bus_id(&bus_id);
            // SAFETY: plain C data, all-zero is valid.
            let mut info: nvmlPciInfo_t = std::mem::zeroed();
            info.domain = domain;
            info.bus = bus;
            info.device = dev;
            fill_array(&mut info.busId, &bus_id);
            fill_array(
                &mut info.busIdLegacy,
                &format!("{:04X}:{:02X}:{:02X}.{:X}", domain & 0xffff, bus, dev, func),
            );
            pci.write(info);
            SUCCESS
        },
    )
}

/// The count-then-fill protocol of the `*RunningProcesses_v3` calls.
unsafe fn running_processes(
    device: nvmlDevice_t,
    kind: Kind,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    with_gpu(
        device,
        |f| match kind {
            Kind::Compute => f.compute_processes.or(f.processes),
            Kind::Graphics => f.graphics_processes.or(f.processes),
            Kind::Mps => f.mps_processes.or(f.processes),
        },
        |_, gpu, _| {
            if count.is_null() {
                return INVALID_ARGUMENT;
            }
            let list = gpu.live_processes(kind);
            let room = *count as usize;
            *count = list.len() as c_uint;
            if list.is_empty() {
                return SUCCESS;
            }
            if infos.is_null() || room < list.len() {
                return INSUFFICIENT_SIZE;
            }
            for (i, p) in list.iter().enumerate() {
                infos.add(i).write(nvmlProcessInfo_t {
                    pid: p.pid,
                    usedGpuMemory: p.used_mib.map_or(NA_U64, |m| m.saturating_mul(MIB)),
                    gpuInstanceId: p.gi.unwrap_or(NA_U32),
                    computeInstanceId: p.ci.unwrap_or(NA_U32),
                });
            }
            SUCCESS
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    running_processes(device, Kind::Compute, count, infos)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetGraphicsRunningProcesses_v3(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    running_processes(device, Kind::Graphics, count, infos)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMPSComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    running_processes(device, Kind::Mps, count, infos)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    with_gpu(
        device,
        |f| f.memory,
        |_, gpu, _| {
            if memory.is_null() {
                return INVALID_ARGUMENT;
            }
            // NVML_STRUCT_VERSION(Memory, 2), as nvml.h defines nvmlMemory_v2.
            let want = (size_of::<nvmlMemory_v2_t>() as u32) | (2 << 24);
            if (*memory).version != want {
                return ARGUMENT_VERSION_MISMATCH;
            }
            let total = gpu.memory_total_mib.saturating_mul(MIB);
            let used = gpu.used_mib().saturating_mul(MIB);
            (*memory).total = total;
            (*memory).reserved = 0;
            (*memory).used = used;
            (*memory).free = total.saturating_sub(used);
            SUCCESS
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetAccountingMode(
    device: nvmlDevice_t,
    mode: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    with_gpu(
        device,
        |f| f.accounting_mode,
        |_, gpu, _| {
            if mode.is_null() {
                return INVALID_ARGUMENT;
            }
            *mode = gpu.accounting.enabled as nvmlEnableState_t;
            SUCCESS
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetAccountingPids(
    device: nvmlDevice_t,
    count: *mut c_uint,
    pids: *mut c_uint,
) -> nvmlReturn_t {
    with_gpu(
        device,
        |f| f.accounting_pids,
        |_, gpu, _| {
            if count.is_null() {
                return INVALID_ARGUMENT;
            }
            if !gpu.accounting.enabled {
                return NOT_SUPPORTED;
            }
            let list = &gpu.accounting.pids;
            let room = *count as usize;
            *count = list.len() as c_uint;
            if list.is_empty() {
                return SUCCESS;
            }
            if pids.is_null() || room < list.len() {
                return INSUFFICIENT_SIZE;
            }
            for (i, p) in list.iter().enumerate() {
                pids.add(i).write(p.pid);
            }
            SUCCESS
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetAccountingStats(
    device: nvmlDevice_t,
    pid: c_uint,
    stats: *mut nvmlAccountingStats_t,
) -> nvmlReturn_t {
    with_gpu(
        device,
        |f| f.accounting_stats,
        |_, gpu, _| {
            if stats.is_null() {
                return INVALID_ARGUMENT;
            }
            if !gpu.accounting.enabled {
                return NOT_SUPPORTED;
            }
            // The latest entry wins on a pid collision, as with the driver.
            let Some(p) = gpu.accounting.pids.iter().rev().find(|p| p.pid == pid) else {
                return NOT_FOUND;
            };
            stats.write(nvmlAccountingStats_t {
                gpuUtilization: p.gpu_util.unwrap_or(NA_U32),
                memoryUtilization: p.mem_util.unwrap_or(NA_U32),
                maxMemoryUsage: p.max_memory_mib.map_or(NA_U64, |m| m.saturating_mul(MIB)),
                time: p.time_ms,
                startTime: p.start_time_us,
                isRunning: p.is_running.unwrap_or_else(|| alive(p.pid)) as c_uint,
                reserved: [0; 5],
            });
            SUCCESS
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeMode(
    device: nvmlDevice_t,
    mode: *mut nvmlComputeMode_t,
) -> nvmlReturn_t {
    with_gpu(
        device,
        |f| f.compute_mode,
        |l, gpu, index| {
            if mode.is_null() {
                return INVALID_ARGUMENT;
            }
            let state = match read_state(&l.state_path()) {
                Ok(s) => s,
                Err(e) => {
                    debug(&e);
                    return UNKNOWN;
                }
            };
            let key = gpu.minor(index).to_string();
            *mode = state
                .compute_mode
                .get(&key)
                .copied()
                .unwrap_or(gpu.compute_mode);
            SUCCESS
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceSetComputeMode(
    device: nvmlDevice_t,
    mode: nvmlComputeMode_t,
) -> nvmlReturn_t {
    with_gpu(
        device,
        |f| f.set_compute_mode,
        |l, gpu, index| {
            if mode > 3 {
                return INVALID_ARGUMENT;
            }
            let key = gpu.minor(index).to_string();
            match update_state(&l.state_path(), |s| {
                s.compute_mode.insert(key, mode);
            }) {
                Ok(()) => SUCCESS,
                Err(e) => {
                    debug(&e);
                    UNKNOWN
                }
            }
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: nvmlDevice_t,
    utilization: *mut nvmlUtilization_t,
) -> nvmlReturn_t {
    with_gpu(
        device,
        |f| f.utilization,
        |_, gpu, _| {
            if utilization.is_null() {
                return INVALID_ARGUMENT;
            }
            utilization.write(nvmlUtilization_t {
                gpu: gpu.util_gpu,
                memory: gpu.util_mem,
            });
            SUCCESS
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids() {
        assert_eq!(parse_bus_id("00000000:17:00.0"), (0, 0x17, 0, 0));
        assert_eq!(parse_bus_id("0001:3b:1f.2"), (1, 0x3b, 0x1f, 2));
        assert!(same_bus_id("00000000:3B:00.0", "0000:3b:00.0"));
        assert!(!same_bus_id("00000000:3B:00.0", "0000:3c:00.0"));
    }

    #[test]
    fn liveness() {
        assert!(alive(std::process::id()));
        assert!(!alive(0));
        assert!(!alive(u32::MAX));
    }

    #[test]
    fn strings() {
        let mut buf = [1 as c_char; 8];
        unsafe {
            assert_eq!(put_str(buf.as_mut_ptr(), 8, "abcdefg"), SUCCESS);
            assert_eq!(CStr::from_ptr(buf.as_ptr()).to_str(), Ok("abcdefg"));
            assert_eq!(put_str(buf.as_mut_ptr(), 8, "abcdefgh"), INSUFFICIENT_SIZE);
            assert_eq!(put_str(std::ptr::null_mut(), 8, "a"), INVALID_ARGUMENT);
        }
        let mut arr = [1 as c_char; 4];
        fill_array(&mut arr, "abcdef");
        assert_eq!(arr, [b'a' as c_char, b'b' as c_char, b'c' as c_char, 0]);
        assert_eq!(error_string(9).to_str(), Ok("Driver Not Loaded"));
        assert_eq!(error_string(12345).to_str(), Ok("Unknown Error"));
    }

    #[test]
    fn scenario_defaults_and_typos() {
        let s: Scenario = serde_json::from_str(
            r#"{"gpus": [{"processes": [{"pid": 1, "used_mib": null}, {"pid": 2}]}]}"#,
        )
        .unwrap();
        assert_eq!(s.driver_version, "550.54.15");
        let g = &s.gpus[0];
        assert_eq!(g.minor(3), 3);
        assert_eq!(g.processes[0].used_mib, None);
        assert_eq!(g.processes[1].used_mib, Some(0));
        assert_eq!(g.processes[1].kind, Kind::Compute);
        assert!(
            serde_json::from_str::<Scenario>(r#"{"gpus": [{"fail": {"proceses": 9}}]}"#).is_err()
        );
        assert!(serde_json::from_str::<Scenario>(r#"{"gpu": []}"#).is_err());
    }
}
