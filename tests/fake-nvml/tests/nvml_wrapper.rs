//! Loads the built fake `libnvidia_ml.so` through `nvml-wrapper` 0.13, the
//! way gpufence does, and checks it answers from the scenario file.
//!
//! The scenario path travels in a process-global environment variable, so
//! every test holds `ENV_LOCK`.

use std::ffi::CStr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nvml_wrapper::bitmasks::InitFlags;
use nvml_wrapper::enum_wrappers::device::ComputeMode;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;
use serde_json::json;

const ENV: &str = "GPUFENCE_FAKE_NVML_SCENARIO";
const MIB: u64 = 1024 * 1024;

static ENV_LOCK: Mutex<()> = Mutex::new(());

fn env_lock() -> MutexGuard<'static, ()> {
    ENV_LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// target/<profile>/libnvidia_ml.so, next to this binary's `deps` directory.
fn lib_path() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let deps = exe.parent().expect("test binary has a directory");
    let profile = deps.parent().expect("deps has a parent");
    for p in [
        profile.join("libnvidia_ml.so"),
        deps.join("libnvidia_ml.so"),
    ] {
        if p.exists() {
            return p;
        }
    }
    panic!("libnvidia_ml.so not found next to {}", deps.display());
}

fn init_from(lib: &Path) -> Result<Nvml, NvmlError> {
    Nvml::builder().lib_path(lib.as_os_str()).init()
}

fn init() -> Nvml {
    init_from(&lib_path()).expect("init the fake NVML")
}

/// A scenario file in a tempdir, named by the environment variable.
struct Scenario {
    dir: tempfile::TempDir,
    path: PathBuf,
}

impl Scenario {
    fn new(value: &serde_json::Value) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("scenario.json");
        let s = Scenario { dir, path };
        s.write(value);
        std::env::set_var(ENV, &s.path);
        s
    }

    fn write(&self, value: &serde_json::Value) {
        std::fs::write(&self.path, serde_json::to_vec_pretty(value).unwrap()).unwrap();
    }

    fn state_file(&self) -> PathBuf {
        self.dir.path().join("nvml-state.json")
    }
}

/// A `sleep` child, killed and reaped on drop.
struct Sleeper(Child);

impl Sleeper {
    fn spawn() -> Self {
        Sleeper(
            Command::new("sleep")
                .arg("600")
                .spawn()
                .expect("spawn sleep"),
        )
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A pid that no process has (a reaped child's).
fn dead_pid() -> u32 {
    let mut c = Command::new("true").spawn().unwrap();
    let pid = c.id();
    c.wait().unwrap();
    pid
}

fn pids(list: &[nvml_wrapper::struct_wrappers::device::ProcessInfo]) -> Vec<u32> {
    list.iter().map(|p| p.pid).collect()
}

#[test]
fn every_method_returns_the_scripted_values() {
    let _g = env_lock();
    let compute = Sleeper::spawn();
    let graphics = Sleeper::spawn();
    let gone = dead_pid();
    let mut scenario = json!({
        "init_error": null,
        "driver_version": "550.54.15",
        "gpus": [
            {"minor": 3, "uuid": "GPU-11111111-2222-3333-4444-555555555555",
             "pci_bus_id": "00000000:17:00.0", "name": "NVIDIA H200",
             "memory_total_mib": 143771, "idle_used_mib": 512, "stuck_used_mib": 100,
             "processes": [
                 {"pid": compute.pid(), "used_mib": 1000, "kind": "compute"},
                 {"pid": graphics.pid(), "used_mib": 20, "kind": "graphics"},
                 {"pid": gone, "used_mib": 5000}
             ],
             "fail": {"processes": null, "memory": null},
             "accounting": {"enabled": true, "pids": [
                 {"pid": 1234, "max_memory_mib": 900, "gpu_util": 55, "mem_util": 20,
                  "start_time_us": 1_700_000_000_000_000u64, "time_ms": 5000, "is_running": false},
                 {"pid": compute.pid()}
             ]},
             "compute_mode": 0, "util_gpu": 42, "util_mem": 7},
            {"minor": 1, "uuid": "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee",
             "pci_bus_id": "00000000:3B:00.0", "name": "NVIDIA H100 80GB HBM3",
             "memory_total_mib": 81559,
             "compute_mode": 3}
        ]
    });
    let s = Scenario::new(&scenario);
    let nvml = init();

    assert_eq!(nvml.sys_driver_version().unwrap(), "550.54.15");
    assert_eq!(nvml.device_count().unwrap(), 2);
    assert!(matches!(
        nvml.device_by_index(2),
        Err(NvmlError::InvalidArg)
    ));

    let d = nvml.device_by_index(0).unwrap();
    assert_eq!(d.minor_number().unwrap(), 3);
    assert_eq!(
        d.uuid().unwrap(),
        "GPU-11111111-2222-3333-4444-555555555555"
    );
    assert_eq!(d.name().unwrap(), "NVIDIA H200");
    let pci = d.pci_info().unwrap();
    assert_eq!(pci.bus_id, "00000000:17:00.0");
    assert_eq!((pci.domain, pci.bus, pci.device), (0, 0x17, 0));

    let c = d.running_compute_processes().unwrap();
    assert_eq!(pids(&c), vec![compute.pid()], "the dead pid is not listed");
    assert_eq!(c[0].used_gpu_memory, UsedGpuMemory::Used(1000 * MIB));
    assert_eq!(c[0].gpu_instance_id, None);
    assert_eq!(c[0].compute_instance_id, None);
    assert_eq!(d.running_compute_processes_count().unwrap(), 1);
    let g = d.running_graphics_processes().unwrap();
    assert_eq!(pids(&g), vec![graphics.pid()]);
    assert_eq!(g[0].used_gpu_memory, UsedGpuMemory::Used(20 * MIB));

    let m = d.memory_info().unwrap();
    assert_eq!(m.total, 143771 * MIB);
    assert_eq!(m.used, (512 + 100 + 1000 + 20) * MIB);
    assert_eq!(m.free, m.total - m.used);
    assert_eq!(m.reserved, 0);

    assert!(d.is_accounting_enabled().unwrap());
    assert_eq!(d.accounting_pids().unwrap(), vec![1234, compute.pid()]);
    let a = d.accounting_stats_for(1234).unwrap();
    assert_eq!(a.gpu_utilization, Some(55));
    assert_eq!(a.memory_utilization, Some(20));
    assert_eq!(a.max_memory_usage, Some(900 * MIB));
    assert_eq!(a.start_time, 1_700_000_000_000_000);
    assert_eq!(a.time, 5000);
    assert!(!a.is_running);
    let a = d.accounting_stats_for(compute.pid()).unwrap();
    assert_eq!(
        (a.gpu_utilization, a.memory_utilization, a.max_memory_usage),
        (None, None, None),
        "absent values are NVML_VALUE_NOT_AVAILABLE"
    );
    assert!(a.is_running, "is_running follows /proc when not scripted");
    assert!(matches!(
        d.accounting_stats_for(4321),
        Err(NvmlError::NotFound)
    ));

    assert_eq!(d.compute_mode().unwrap(), ComputeMode::Default);
    let u = d.utilization_rates().unwrap();
    assert_eq!((u.gpu, u.memory), (42, 7));

    let d1 = nvml.device_by_index(1).unwrap();
    assert_eq!(d1.minor_number().unwrap(), 1);
    assert_eq!(d1.name().unwrap(), "NVIDIA H100 80GB HBM3");
    assert_eq!(d1.pci_info().unwrap().bus, 0x3b);
    assert!(d1.running_compute_processes().unwrap().is_empty());
    assert!(d1.running_graphics_processes().unwrap().is_empty());
    let m1 = d1.memory_info().unwrap();
    assert_eq!((m1.used, m1.free), (0, 81559 * MIB));
    assert!(!d1.is_accounting_enabled().unwrap());
    assert!(matches!(d1.accounting_pids(), Err(NvmlError::NotSupported)));
    assert!(matches!(
        d1.accounting_stats_for(1),
        Err(NvmlError::NotSupported)
    ));
    assert_eq!(d1.compute_mode().unwrap(), ComputeMode::ExclusiveProcess);

    // Handles by UUID and by PCI bus id (any case, short domain).
    let by_uuid = nvml
        .device_by_uuid("GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee")
        .unwrap();
    assert_eq!(by_uuid.minor_number().unwrap(), 1);
    let by_pci = nvml.device_by_pci_bus_id("0000:3b:00.0").unwrap();
    assert_eq!(by_pci.minor_number().unwrap(), 1);
    assert!(matches!(
        nvml.device_by_uuid("GPU-nope"),
        Err(NvmlError::NotFound)
    ));

    // nvmlErrorString.
    // SAFETY: nvmlErrorString returns a static NUL-terminated string for
    // any code (the fake's table, as NVML's).
    let text = |code| unsafe { CStr::from_ptr(nvml.lib().nvmlErrorString(code)) };
    assert_eq!(text(9).to_str().unwrap(), "Driver Not Loaded");
    assert_eq!(text(0).to_str().unwrap(), "Success");
    assert_eq!(text(4242).to_str().unwrap(), "Unknown Error");

    // The scenario is re-read on every call.
    scenario["gpus"][0]["name"] = json!("NVIDIA H200 NVL");
    scenario["gpus"][0]["util_gpu"] = json!(99);
    scenario["gpus"][0]["processes"] = json!([]);
    s.write(&scenario);
    assert_eq!(d.name().unwrap(), "NVIDIA H200 NVL");
    assert_eq!(d.utilization_rates().unwrap().gpu, 99);
    assert!(d.running_compute_processes().unwrap().is_empty());
    assert_eq!(d.memory_info().unwrap().used, (512 + 100) * MIB);

    // Two instances at once (refcounted init), then nvmlInitWithFlags.
    let second = init();
    drop(second);
    assert_eq!(nvml.device_count().unwrap(), 2, "still initialized");
    nvml.shutdown().unwrap();
    let flagged = Nvml::builder()
        .lib_path(lib_path().as_os_str())
        .flags(InitFlags::NO_GPUS)
        .init()
        .unwrap();
    assert_eq!(flagged.device_count().unwrap(), 2);
    flagged.shutdown().unwrap();

    assert!(!s.state_file().exists(), "reads write nothing");
}

#[test]
fn a_killed_process_vanishes_and_frees_its_memory() {
    let _g = env_lock();
    let mut victim = Sleeper::spawn();
    let survivor = Sleeper::spawn();
    let pid = victim.pid();
    let _s = Scenario::new(&json!({"gpus": [{
        "memory_total_mib": 1000, "idle_used_mib": 10, "stuck_used_mib": 200,
        "processes": [{"pid": pid, "used_mib": 300}, {"pid": survivor.pid(), "used_mib": 5}],
        "accounting": {"enabled": true, "pids": [{"pid": pid, "max_memory_mib": 300}]}
    }]}));
    let nvml = init();
    let d = nvml.device_by_index(0).unwrap();
    assert_eq!(
        pids(&d.running_compute_processes().unwrap()),
        vec![pid, survivor.pid()]
    );
    assert_eq!(d.memory_info().unwrap().used, 515 * MIB);
    assert!(d.accounting_stats_for(pid).unwrap().is_running);

    // SIGKILL, not reaped yet: a zombie must not be listed either.
    victim.0.kill().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids(&d.running_compute_processes().unwrap()).contains(&pid) {
        assert!(Instant::now() < deadline, "killed pid {pid} still listed");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        Path::new(&format!("/proc/{pid}")).exists(),
        "still a zombie here"
    );
    assert_eq!(
        pids(&d.running_compute_processes().unwrap()),
        vec![survivor.pid()]
    );
    let m = d.memory_info().unwrap();
    assert_eq!(m.used, 215 * MIB, "stuck memory never comes back");
    assert_eq!(m.free, 785 * MIB);

    victim.0.wait().unwrap();
    assert_eq!(
        pids(&d.running_compute_processes().unwrap()),
        vec![survivor.pid()]
    );
    // Accounting outlives the process.
    assert_eq!(d.accounting_pids().unwrap(), vec![pid]);
    let a = d.accounting_stats_for(pid).unwrap();
    assert!(!a.is_running);
    assert_eq!(a.max_memory_usage, Some(300 * MIB));
}

#[test]
fn fail_codes_surface_as_nvml_errors() {
    let _g = env_lock();
    let p = Sleeper::spawn();
    let _s = Scenario::new(&json!({"gpus": [
        {"processes": [{"pid": p.pid(), "used_mib": 1}],
         "fail": {"processes": 999, "memory": 15, "uuid": 3, "utilization": 3,
                  "accounting_mode": 4, "set_compute_mode": 4, "compute_mode": 15}},
        {"processes": [{"pid": p.pid(), "used_mib": 1, "kind": "graphics"}],
         "fail": {"processes": 999, "graphics_processes": 15, "minor": 0, "memory": null}},
        {"fail": {"handle": 4}}
    ]}));
    let nvml = init();
    let mut d = nvml.device_by_index(0).unwrap();
    assert!(matches!(
        d.running_compute_processes(),
        Err(NvmlError::Unknown)
    ));
    assert!(matches!(
        d.running_graphics_processes(),
        Err(NvmlError::Unknown)
    ));
    assert!(matches!(d.memory_info(), Err(NvmlError::GpuLost)));
    assert!(matches!(d.uuid(), Err(NvmlError::NotSupported)));
    assert!(matches!(
        d.utilization_rates(),
        Err(NvmlError::NotSupported)
    ));
    assert!(matches!(
        d.is_accounting_enabled(),
        Err(NvmlError::NoPermission)
    ));
    assert!(matches!(d.compute_mode(), Err(NvmlError::GpuLost)));
    assert!(matches!(
        d.set_compute_mode(ComputeMode::Prohibited),
        Err(NvmlError::NoPermission)
    ));
    assert_eq!(d.name().unwrap(), "NVIDIA Fake GPU", "other queries answer");

    let d1 = nvml.device_by_index(1).unwrap();
    assert!(
        matches!(d1.running_compute_processes(), Err(NvmlError::Unknown)),
        "`processes` covers the list without its own key"
    );
    assert!(matches!(
        d1.running_graphics_processes(),
        Err(NvmlError::GpuLost)
    ));
    assert_eq!(d1.minor_number().unwrap(), 1, "fail code 0 is success");
    assert_eq!(d1.memory_info().unwrap().used, MIB);

    assert!(matches!(
        nvml.device_by_index(2),
        Err(NvmlError::NoPermission)
    ));
}

#[test]
fn init_fails_as_scripted_or_without_a_scenario() {
    let _g = env_lock();
    let lib = lib_path();
    let s = Scenario::new(&json!({"init_error": 9, "gpus": [{}]}));
    assert!(matches!(init_from(&lib), Err(NvmlError::DriverNotLoaded)));
    s.write(&json!({"init_error": 4}));
    assert!(matches!(init_from(&lib), Err(NvmlError::NoPermission)));
    assert!(matches!(
        Nvml::builder()
            .lib_path(lib.as_os_str())
            .flags(InitFlags::NO_ATTACH)
            .init(),
        Err(NvmlError::NoPermission)
    ));

    std::fs::write(&s.path, "{ not json").unwrap();
    assert!(matches!(init_from(&lib), Err(NvmlError::DriverNotLoaded)));
    s.write(&json!({"gpus": [{"naem": "typo"}]}));
    assert!(matches!(init_from(&lib), Err(NvmlError::DriverNotLoaded)));
    std::fs::remove_file(&s.path).unwrap();
    assert!(matches!(init_from(&lib), Err(NvmlError::DriverNotLoaded)));
    assert_eq!(
        std::fs::read_dir(s.dir.path()).unwrap().count(),
        0,
        "a failed init writes nothing"
    );

    // Defaults: an empty object is a driver with no GPUs.
    s.write(&json!({}));
    let nvml = init_from(&lib).unwrap();
    assert_eq!(nvml.device_count().unwrap(), 0);
    assert_eq!(nvml.sys_driver_version().unwrap(), "550.54.15");
    // The scenario vanishing after init is an unknown error, not a crash.
    std::fs::remove_file(&s.path).unwrap();
    assert!(matches!(nvml.device_count(), Err(NvmlError::Unknown)));
}

#[test]
fn set_compute_mode_persists_across_instances() {
    let _g = env_lock();
    let s = Scenario::new(&json!({"gpus": [
        {"minor": 4, "compute_mode": 0},
        {"minor": 0, "compute_mode": 3}
    ]}));
    {
        let nvml = init();
        let mut d = nvml.device_by_index(0).unwrap();
        assert_eq!(d.compute_mode().unwrap(), ComputeMode::Default);
        d.set_compute_mode(ComputeMode::Prohibited).unwrap();
        assert_eq!(d.compute_mode().unwrap(), ComputeMode::Prohibited);
    }
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(s.state_file()).unwrap()).unwrap();
    assert_eq!(state, json!({"compute_mode": {"4": 2}}), "keyed by minor");
    {
        let nvml = init();
        let mut d = nvml.device_by_index(0).unwrap();
        assert_eq!(d.compute_mode().unwrap(), ComputeMode::Prohibited);
        let mut d1 = nvml.device_by_index(1).unwrap();
        assert_eq!(d1.compute_mode().unwrap(), ComputeMode::ExclusiveProcess);
        d1.set_compute_mode(ComputeMode::Default).unwrap();
        d.set_compute_mode(ComputeMode::ExclusiveProcess).unwrap();
    }
    let nvml = init();
    assert_eq!(
        nvml.device_by_index(0).unwrap().compute_mode().unwrap(),
        ComputeMode::ExclusiveProcess
    );
    assert_eq!(
        nvml.device_by_index(1).unwrap().compute_mode().unwrap(),
        ComputeMode::Default
    );
    // Removing the state goes back to the scenario's modes.
    std::fs::remove_file(s.state_file()).unwrap();
    assert_eq!(
        nvml.device_by_index(1).unwrap().compute_mode().unwrap(),
        ComputeMode::ExclusiveProcess
    );
}

#[test]
fn default_scenario_next_to_the_library() {
    let _g = env_lock();
    let dir = tempfile::tempdir().unwrap();
    let lib = dir.path().join("libnvidia_ml.so");
    std::fs::copy(lib_path(), &lib).unwrap();
    std::fs::write(
        dir.path().join("nvml-scenario.json"),
        json!({"driver_version": "535.1.2", "gpus": [{"name": "Next To The Library"}]}).to_string(),
    )
    .unwrap();
    std::env::remove_var(ENV);

    let nvml = init_from(&lib).expect("init from the scenario next to the copy");
    assert_eq!(nvml.sys_driver_version().unwrap(), "535.1.2");
    let mut d = nvml.device_by_index(0).unwrap();
    assert_eq!(d.name().unwrap(), "Next To The Library");
    assert_eq!(d.minor_number().unwrap(), 0);
    assert_eq!(
        d.uuid().unwrap(),
        "GPU-fa4e0000-0000-0000-0000-000000000000"
    );
    assert_eq!(d.pci_info().unwrap().bus_id, "00000000:01:00.0");
    d.set_compute_mode(ComputeMode::Prohibited).unwrap();
    assert!(dir.path().join("nvml-state.json").exists());
    drop(nvml);

    // An empty variable also means "next to the library".
    std::env::set_var(ENV, "");
    let nvml = init_from(&lib).unwrap();
    assert_eq!(
        nvml.device_by_index(0).unwrap().compute_mode().unwrap(),
        ComputeMode::Prohibited
    );
}

#[test]
fn device_files_are_opened_at_init_and_handle() {
    let _g = env_lock();
    let lib = lib_path();
    let s = Scenario::new(&json!({}));
    let ctl = s.dir.path().join("nvidiactl");
    let n0 = s.dir.path().join("nvidia0");
    std::fs::write(&ctl, "").unwrap();
    s.write(&json!({"control_device": ctl, "gpus": [{"device_file": n0}]}));
    let nvml = init_from(&lib).expect("control device opens");
    // The GPU's file is missing: no driver behind it.
    assert!(matches!(
        nvml.device_by_index(0),
        Err(NvmlError::DriverNotLoaded)
    ));
    std::fs::write(&n0, "").unwrap();
    assert_eq!(nvml.device_by_index(0).unwrap().minor_number().unwrap(), 0);
    drop(nvml);
    std::fs::remove_file(&ctl).unwrap();
    assert!(matches!(init_from(&lib), Err(NvmlError::DriverNotLoaded)));
}
