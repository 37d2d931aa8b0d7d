//! The epilog's and prolog's NVML path against the fake `libnvidia-ml`
//! (`tests/fake-nvml`): the real nvml-wrapper code runs, the library answers
//! from a scenario file next to it. Each test copies the library into its
//! own temp dir, so each has its own scenario (found by the library with
//! dladdr). The fence is real (each test's own cgroup subtree).
//!
//! Gap, named: the fake answers as NVML documents; what a real driver does
//! under load is checked by `contrib/gpu-check.sh` on a GPU machine.

use std::path::PathBuf;

use gpufence_cgroup::fence::Fence;
use gpufence_model::config::{Config, ConfigOrigin};
use gpufence_model::device::{Access, DevNum, DeviceGrant, DeviceRole};
use gpufence_model::record::{now_rfc3339, JobRecord, RECORD_VERSION};
use gpufence_node::job::prolog::{self, PrologEnv};
use gpufence_node::{host::fence_ops, job::epilog, Node, NodeError};
use gpufence_tests::{gone, privileged, workspace_bin, TestEnv};
use serde_json::{json, Value};

struct World {
    env: TestEnv,
    node: Node,
    scenario: PathBuf,
}

/// A test env with the fence installed and NVML = a private copy of the fake.
fn world(tag: &str, extra: &str) -> World {
    let env = TestEnv::new(tag);
    let lib_dir = env.path("nvml");
    std::fs::create_dir_all(&lib_dir).unwrap();
    let lib = lib_dir.join("libnvidia-ml.so.1");
    std::fs::copy(workspace_bin("libnvidia_ml.so"), &lib).unwrap();
    let scenario = lib_dir.join("nvml-scenario.json");
    std::fs::write(&scenario, json!({"gpus": []}).to_string()).unwrap();
    let p = env.config(&format!(
        "nvml_library = \"{}\"\nterm_grace_ms = 300\nmemory_wait_ms = 1500\nmemory_tolerance_mib = 16\n{extra}\n[majors]\nnvidia = 195\nnvidia-uvm = 241\n",
        lib.display()
    ));
    let node = Node::new(Config::load(&p).unwrap(), ConfigOrigin::File(p)).unwrap();
    fence_ops::install(&node).unwrap();
    World {
        env,
        node,
        scenario,
    }
}

impl World {
    fn scenario(&self, v: Value) {
        std::fs::write(&self.scenario, v.to_string()).unwrap();
    }
    fn record(&self, job: u32, minors: &[u32]) {
        let devices = minors
            .iter()
            .map(|m| DeviceGrant {
                path: format!("/dev/nvidia{m}").into(),
                dev: DevNum::new(195, *m),
                access: Access::RW,
                role: DeviceRole::Gres,
                gres_index: Some(*m),
            })
            .collect();
        self.node
            .state
            .write_record(&JobRecord {
                version: RECORD_VERSION,
                job_id: job,
                uid: 0,
                gres_indices: minors.to_vec(),
                devices,
                created: now_rfc3339(),
                notes: vec![],
                user_notes: vec![],
                gpu_idle: vec![],
                mig: vec![],
                cuda_visible_devices: vec![],
                saved_compute_modes: Vec::new(),
                job_map: Vec::new(),
                mps: Vec::new(),
            })
            .unwrap();
    }
    fn audit(&self) -> Vec<Value> {
        gpufence_tests::audit_log_settled(&self.node.cfg.audit_log)
    }
    fn events(&self, job: u32) -> Vec<String> {
        self.audit()
            .into_iter()
            .filter(|e| e["job_id"] == job)
            .map(|e| e["event"].as_str().unwrap().to_string())
            .collect()
    }
}

fn gpu(minor: u32, procs: Value) -> Value {
    json!({"minor": minor, "uuid": format!("GPU-00000000-0000-0000-0000-00000000000{minor}"),
           "idle_used_mib": 500, "memory_total_mib": 81920, "processes": procs})
}

/// A node whose `slurmd -G` lists one GPU, `/dev/nvidia<minor>` (a node
/// made in the test's temp dir), with the world's fake NVML and `extra`
/// config.
fn one_gpu_node(w: &World, minor: u32, extra: &str) -> Node {
    let slurmd_g = w.env.path("slurmd-G.txt");
    let n = w.env.mknod(&format!("nvidia{minor}"), 195, minor);
    std::fs::write(
        &slurmd_g,
        format!("Gres Name=gpu Count=1 File={}\n", n.display()),
    )
    .unwrap();
    let p = w.env.config(&format!(
        "nvml_library = \"{}\"\nslurmd_gres = \"{}\"\n{extra}[majors]\nnvidia = 195\n",
        w.scenario.with_file_name("libnvidia-ml.so.1").display(),
        slurmd_g.display()
    ));
    Node::new(Config::load(&p).unwrap(), ConfigOrigin::File(p)).unwrap()
}

/// The Prolog's environment of root's job `job_id` on GRES index 0.
fn prolog_env(job_id: u32) -> PrologEnv {
    PrologEnv {
        job_id,
        uid: 0,
        gres_indices: vec![0],
        slurm_conf: None,
        node_name: None,
        cuda_visible_devices: vec![],
        options: Default::default(),
        mps: false,
    }
}

/// NVML lists a process on the job's GPU that holds no descriptor of it
/// (e.g. in another mount namespace): found by NVML alone, frozen, evidence
/// with its GPU memory, killed; its memory comes back, the node is clean.
#[test]
fn nvml_only_holder_is_found_and_killed() {
    if !privileged() {
        return;
    }
    let mut w = world("nvml-only", "");
    let out_cg = w.env.cgroup("outside");
    let ghost = w.env.spawn_user_sleeper(&out_cg);
    w.scenario(
        json!({"gpus": [gpu(0, json!([{"pid": ghost, "used_mib": 4000}])), gpu(1, json!([]))]}),
    );
    w.record(21, &[0]);
    let o = epilog::run(&w.node, 21, None);
    assert!(o.clean(), "{o:?}");
    assert_eq!(o.lingering.len(), 1);
    assert_eq!((o.lingering[0].pid, o.lingering[0].gone()), (ghost, true));
    assert!(gone(ghost));
    let ev: Value =
        serde_json::from_slice(&std::fs::read(o.lingering[0].evidence.as_ref().unwrap()).unwrap())
            .unwrap();
    assert_eq!(ev["gpu_memory"][0]["minor"], 0);
    assert_eq!(ev["gpu_memory"][0]["used_bytes"], 4000u64 << 20);
    assert_eq!(ev["fds"], json!([]));
    assert_eq!(
        ev["frozen"], "cgroup-freeze",
        "alone in its cgroup: frozen as a cgroup"
    );
}

/// Memory that never comes back after the kills is a survivor: not clean,
/// with a drain reason naming the GPU.
#[test]
fn memory_that_never_comes_back_is_a_survivor() {
    if !privileged() {
        return;
    }
    let w = world("stuck", "");
    let mut g = gpu(0, json!([]));
    g["stuck_used_mib"] = json!(2048);
    w.scenario(json!({"gpus": [g]}));
    w.record(22, &[0]);
    let o = epilog::run(&w.node, 22, None);
    assert!(!o.clean());
    assert_eq!(o.survivors.len(), 1, "{o:?}");
    assert!(
        o.survivors[0]
            .to_string()
            .contains("/dev/nvidia0 still has 2548 MiB in use"),
        "{}",
        o.survivors[0]
    );
    let r = o.drain_reason.unwrap();
    assert!(r.starts_with("gpufence: job 22: GPU /dev/nvidia0"), "{r}");
}

/// The drain goes through scontrol with the node and the reason; a failing
/// scontrol is reported and does not make the epilog look clean.
#[test]
fn drain_calls_scontrol_and_its_failure_is_not_hidden() {
    if !privileged() {
        return;
    }
    let w = world("drain", "");
    let mut g = gpu(0, json!([]));
    g["stuck_used_mib"] = json!(4096);
    w.scenario(json!({"gpus": [g]}));
    let log = w.env.path("scontrol.args");
    let cfg_extra = |rc: &str| {
        let f = w.env.path(&format!("scontrol-{rc}"));
        std::fs::write(
            &f,
            format!(
                "#!/bin/sh\nprintf '%s\\n' \"$@\" > {}\nexit {rc}\n",
                log.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&f, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let p = w.env.config(&format!(
            "nvml_library = \"{}\"\nscontrol_bin = \"{}\"\nmemory_wait_ms = 200\n[majors]\nnvidia = 195\n",
            w.scenario.with_file_name("libnvidia-ml.so.1").display(),
            f.display()
        ));
        Node::new(Config::load(&p).unwrap(), ConfigOrigin::File(p)).unwrap()
    };
    let node = cfg_extra("0");
    w.record(34, &[0]);
    let o = epilog::run(&node, 34, Some("gpu17"));
    assert!(!o.clean());
    let args = std::fs::read_to_string(&log).unwrap();
    let args: Vec<&str> = args.lines().collect();
    assert_eq!(&args[..3], &["update", "nodename=gpu17", "state=drain"]);
    assert!(
        args[3].starts_with("reason=gpufence: job 34: GPU /dev/nvidia0 still has"),
        "{args:?}"
    );
    assert!(
        o.notes.iter().any(|n| n.starts_with("node gpu17 drained")),
        "{:?}",
        o.notes
    );
    let node = cfg_extra("1");
    w.record(35, &[0]);
    let o = epilog::run(&node, 35, Some("gpu17"));
    assert!(!o.clean());
    assert!(
        o.errors
            .iter()
            .any(|e| e.to_string().starts_with("could not drain gpu17")),
        "{:?}",
        o.errors
    );
}

/// The baseline the prolog measured is the idle level: a GPU that idles at
/// 3 GiB (another tenant's MIG slice, a persistence daemon) is clean at 3 GiB.
#[test]
fn the_prolog_baseline_is_the_idle_level() {
    if !privileged() {
        return;
    }
    let w = world("baseline", "idle_memory_mib = 0");
    let mut g = gpu(3, json!([]));
    g["stuck_used_mib"] = json!(2548);
    w.scenario(json!({"gpus": [g]}));
    let node = one_gpu_node(&w, 3, "memory_wait_ms = 500\n");
    let rec = prolog::run(&node, &prolog_env(23)).unwrap();
    assert_eq!(rec.gpu_idle.len(), 1);
    assert_eq!(rec.gpu_idle[0].used_bytes, 3048u64 << 20);
    assert!(epilog::run(&node, 23, None).clean());
}

/// A process on a GPU the job did not hold is none of the epilog's business;
/// the prolog of the next job that gets that GPU kills it (policy kill).
#[test]
fn a_process_on_another_gpu_is_left_to_the_next_prolog() {
    if !privileged() {
        return;
    }
    let mut w = world("other-gpu", "");
    let out_cg = w.env.cgroup("outside");
    let squatter = w.env.spawn_user_sleeper(&out_cg);
    w.scenario(
        json!({"gpus": [gpu(0, json!([])), gpu(1, json!([{"pid": squatter, "used_mib": 100}]))]}),
    );
    w.record(24, &[0]);
    let o = epilog::run(&w.node, 24, None);
    assert!(o.clean() && o.lingering.is_empty(), "{o:?}");
    assert!(!gone(squatter));

    let node = one_gpu_node(&w, 1, "term_grace_ms = 300\n");
    let rec = prolog::run(&node, &prolog_env(25)).unwrap();
    assert!(gone(squatter), "the prolog killed the squatter");
    assert!(
        rec.notes.iter().any(|n| n.contains("clean start: killed")),
        "{:?}",
        rec.notes
    );
    let ev: Vec<String> = w
        .audit()
        .into_iter()
        .filter(|e| e["job_id"] == 25 && e["phase"] == "prolog")
        .map(|e| e["event"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ev, vec!["lingering_process", "process_killed"]);
}

/// Policy refuse: evidence, no kill, the prolog fails (Slurm drains, requeues).
#[test]
fn refuse_policy_keeps_evidence_and_refuses() {
    if !privileged() {
        return;
    }
    let mut w = world("refuse", "");
    let out_cg = w.env.cgroup("outside");
    let squatter = w.env.spawn_user_sleeper(&out_cg);
    w.scenario(json!({"gpus": [gpu(1, json!([{"pid": squatter, "used_mib": 100}]))]}));
    let n1 = w.env.mknod("nvidia1", 195, 1);
    let g = w.env.path("slurmd-G.txt");
    std::fs::write(&g, format!("Gres Name=gpu Count=1 File={}\n", n1.display())).unwrap();
    let p = w.env.config(&format!(
        "nvml_library = \"{}\"\nslurmd_gres = \"{}\"\nprolog_strays = \"refuse\"\n[majors]\nnvidia = 195\n",
        w.scenario.with_file_name("libnvidia-ml.so.1").display(),
        g.display()
    ));
    let node = Node::new(Config::load(&p).unwrap(), ConfigOrigin::File(p)).unwrap();
    let env = PrologEnv {
        job_id: 26,
        uid: 0,
        gres_indices: vec![0],
        slurm_conf: None,
        node_name: None,
        cuda_visible_devices: vec![],
        options: Default::default(),
        mps: false,
    };
    let e = prolog::run(&node, &env).unwrap_err();
    assert!(
        matches!(&e, NodeError::Strays { pids, .. } if *pids == vec![squatter]),
        "{e}"
    );
    assert!(!gone(squatter), "refuse does not kill");
    assert!(
        node.state.read_record(26).unwrap().is_none(),
        "no record, no grant"
    );
    assert_eq!(
        std::fs::read_dir(&node.cfg.evidence_dir).unwrap().count(),
        1
    );
}

/// Exempt daemons (nvidia-persistenced, DCGM) are never flagged.
#[test]
fn exempt_daemons_are_never_flagged() {
    if !privileged() {
        return;
    }
    let mut w = world("exempt", "");
    let daemon_cg = w.env.cgroup("system.slice/nvidia-persistenced.service");
    let p = w.env.config(&format!(
        "nvml_library = \"{}\"\nexempt_cgroups = [\"{daemon_cg}\"]\n[majors]\nnvidia = 195\n",
        w.scenario.with_file_name("libnvidia-ml.so.1").display()
    ));
    let node = Node::new(Config::load(&p).unwrap(), ConfigOrigin::File(p)).unwrap();
    fence_ops::install(&node).unwrap();
    let daemon = w.env.spawn_sleeper(&daemon_cg);
    w.scenario(json!({"gpus": [gpu(0, json!([{"pid": daemon, "used_mib": 10}]))]}));
    w.record(27, &[0]);
    let o = epilog::run(&node, 27, None);
    assert!(o.clean() && o.lingering.is_empty(), "{o:?}");
    assert!(!gone(daemon));
}

/// No library or no driver: the descriptor scan alone, said once in the
/// audit log, and the job is never failed for it.
#[test]
fn missing_driver_falls_back_and_says_so_once() {
    if !privileged() {
        return;
    }
    let w = world("nodriver", "");
    w.scenario(json!({"init_error": 9}));
    for job in [28, 29] {
        w.record(job, &[0]);
        assert!(epilog::run(&w.node, job, None).clean());
    }
    let notes: Vec<Value> = w
        .audit()
        .into_iter()
        .filter(|e| e["event"] == "nvml_unavailable")
        .collect();
    assert_eq!(notes.len(), 1, "said once: {notes:?}");
    assert!(
        notes[0]["reason"]
            .as_str()
            .unwrap()
            .contains("libnvidia-ml.so.1"),
        "{}",
        notes[0]
    );
    // A library that does not exist at all: same.
    let p = w
        .env
        .config("nvml_library = \"/nonexistent/libnvidia-ml.so.1\"\n[majors]\nnvidia = 195\n");
    let node = Node::new(Config::load(&p).unwrap(), ConfigOrigin::File(p)).unwrap();
    w.record(30, &[0]);
    assert!(epilog::run(&node, 30, None).clean());
}

/// With `nvml_failure = "drain"`, an NVML error in the middle of a query
/// is a finding, never "clean": the Epilog drains, the Prolog refuses.
#[test]
fn nvml_errors_mid_query_drain_when_asked() {
    if !privileged() {
        return;
    }
    let w = world("nvml-err", "nvml_failure = \"drain\"\n");
    let mut g = gpu(0, json!([]));
    g["fail"] = json!({"processes": 15});
    w.scenario(json!({"gpus": [g]}));
    w.record(31, &[0]);
    let o = epilog::run(&w.node, 31, None);
    assert!(!o.clean());
    assert!(
        o.errors
            .iter()
            .any(|e| e.to_string().contains("NVML query failed")),
        "{:?}",
        o.errors
    );
    assert!(o.drain_reason.unwrap().contains("NVML"));
    // The prolog refuses on the same answer.
    let n0 = w.env.mknod("nvidia0", 195, 0);
    let gf = w.env.path("slurmd-G.txt");
    std::fs::write(
        &gf,
        format!("Gres Name=gpu Count=1 File={}\n", n0.display()),
    )
    .unwrap();
    let p = w.env.config(&format!(
        "nvml_failure = \"drain\"\nnvml_library = \"{}\"\nslurmd_gres = \"{}\"\n[majors]\nnvidia = 195\n",
        w.scenario.with_file_name("libnvidia-ml.so.1").display(),
        gf.display()
    ));
    let node = Node::new(Config::load(&p).unwrap(), ConfigOrigin::File(p)).unwrap();
    let env = PrologEnv {
        job_id: 32,
        uid: 0,
        gres_indices: vec![0],
        slurm_conf: None,
        node_name: None,
        cuda_visible_devices: vec![],
        options: Default::default(),
        mps: false,
    };
    assert!(matches!(prolog::run(&node, &env), Err(NodeError::Nvml(_))));
}

/// By default (`nvml_failure = "report"`) a failed NVML query where the
/// descriptor scan found nothing is one `check_failed` line: the Epilog
/// is clean and drains nothing, the Prolog starts the job ("never drain on
/// ignorance").
#[test]
fn nvml_errors_mid_query_are_reported_by_default() {
    if !privileged() {
        return;
    }
    let w = world("nvml-report", "");
    let mut g = gpu(0, json!([]));
    g["fail"] = json!({"processes": 15, "memory": 15});
    w.scenario(json!({"gpus": [g]}));
    w.record(33, &[0]);
    let o = epilog::run(&w.node, 33, None);
    assert!(o.clean(), "{o:?}");
    assert!(o.drain_reason.is_none() && o.errors.is_empty(), "{o:?}");
    assert!(
        o.notes
            .iter()
            .any(|n| n.contains("NVML query failed") && n.contains("nvml_failure = report")),
        "{:?}",
        o.notes
    );
    let failed: Vec<Value> = w
        .audit()
        .into_iter()
        .filter(|e| e["event"] == "check_failed")
        .collect();
    assert!(
        failed
            .iter()
            .any(|e| e["job_id"] == 33 && e["component"] == "nvml"),
        "{failed:?}"
    );
    let node = one_gpu_node(&w, 0, "");
    assert!(prolog::run(&node, &prolog_env(34)).is_ok());
    assert!(w
        .audit()
        .iter()
        .any(|e| e["event"] == "check_failed" && e["job_id"] == 34));
}

/// grant_revoked carries GPU-seconds, and with accounting mode on, each
/// GPU's max memory and average utilisation of the job's processes.
#[test]
fn revoke_carries_gpu_seconds_and_accounting() {
    if !privileged() {
        return;
    }
    let w = world("acct", "");
    w.record(33, &[0, 1]);
    let now_us = chrono::Utc::now().timestamp_micros() as u64;
    let mut g0 = gpu(0, json!([]));
    g0["accounting"] = json!({"enabled": true, "pids": [
        {"pid": 4242, "max_memory_mib": 900, "gpu_util": 60, "mem_util": 20, "start_time_us": now_us, "time_ms": 10, "is_running": false},
        {"pid": 4243, "max_memory_mib": 1200, "gpu_util": 40, "mem_util": 10, "start_time_us": now_us, "time_ms": 10, "is_running": false},
        {"pid": 17, "max_memory_mib": 99999, "gpu_util": 99, "start_time_us": 1000, "time_ms": 10, "is_running": false}
    ]});
    w.scenario(json!({"gpus": [g0, gpu(1, json!([]))]}));
    std::thread::sleep(std::time::Duration::from_millis(50));
    let o = epilog::run(&w.node, 33, None);
    assert!(o.clean(), "{o:?}");
    let rev = w
        .audit()
        .into_iter()
        .find(|e| e["event"] == "grant_revoked" && e["job_id"] == 33)
        .unwrap();
    let wall = rev["wall_seconds"].as_f64().unwrap();
    assert!(
        wall > 0.0 && (rev["gpu_seconds"].as_f64().unwrap() - 2.0 * wall).abs() < 0.01,
        "{rev}"
    );
    let acc = &rev["accounting"];
    assert_eq!(
        acc.as_array().unwrap().len(),
        1,
        "GPU 1 has accounting off: {rev}"
    );
    assert_eq!(acc[0]["minor"], 0);
    assert_eq!(
        acc[0]["processes"], 2,
        "the pid that started before the job is not the job's"
    );
    assert_eq!(acc[0]["max_memory_bytes"], 1200u64 << 20);
    assert_eq!(acc[0]["avg_gpu_utilization"], 50.0);
    assert!(Fence::open(&w.env.bpffs)
        .unwrap()
        .entries()
        .unwrap()
        .is_empty());
    assert_eq!(w.events(33), vec!["grant_revoked"]);
}

/// The fake answers at the C library boundary as the driver does under a
/// device cgroup: init opens `nvidiactl` and each handle opens its
/// `/dev/nvidia<N>` (here `mknod` stand-ins), so in a cgroup without a
/// grant init is `NoPermission`, and with a grant of `nvidiactl` and one
/// GPU the other GPU's handle is `NoPermission` (NVML lists every GPU of
/// the node). The real-node RunInJob test relies on this to show where the
/// Prolog's and Epilog's NVML work runs.
#[test]
fn the_fake_nvml_is_fenced_like_the_driver() {
    if !privileged() {
        return;
    }
    let w = world("nvml-fenced", "");
    let ctl = w.env.mknod("nvidiactl", 195, 255);
    let n0 = w.env.mknod("nvidia0", 195, 0);
    let n1 = w.env.mknod("nvidia1", 195, 1);
    w.scenario(json!({
        "control_device": ctl,
        "gpus": [
            {"minor": 0, "device_file": n0},
            {"minor": 1, "device_file": n1},
        ]
    }));
    let lib = w.scenario.with_file_name("libnvidia-ml.so.1");
    let lib = lib.to_str().unwrap();
    let outside = w.env.cgroup("outside");
    assert_eq!(
        w.env.probe_in(&outside, &["nvml", lib]),
        vec!["init NoPermission"],
        "no grant: nvidiactl is denied"
    );
    let job = w.env.cgroup("job_31");
    Fence::open(&w.env.bpffs)
        .unwrap()
        .grant(
            w.env.cg.id(&job).unwrap(),
            &job,
            31,
            &[
                (DevNum::new(195, 0), Access::RW),
                (DevNum::new(195, 255), Access::RW),
            ],
        )
        .unwrap();
    assert_eq!(
        w.env.probe_in(&job, &["nvml", lib]),
        vec!["init ok", "handle 0 minor 0", "handle 1 NoPermission"],
        "the grant's GPU only"
    );
}

/// A client of an MPS server is listed by NVML apart from the processes
/// (`nvmlDeviceGetMPSComputeRunningProcesses_v3`): one of the ended job's
/// user outside every grant, holding no descriptor, is found by that list
/// alone, and ended with evidence of its kind.
#[test]
fn an_mps_client_outside_every_grant_is_found_and_ended() {
    if !privileged() {
        return;
    }
    let mut w = world("mps-client", "");
    let out_cg = w.env.cgroup("outside");
    let client = w.env.spawn_user_sleeper(&out_cg);
    w.scenario(json!({"gpus": [gpu(0, json!([{"pid": client, "used_mib": 700, "kind": "mps"}]))]}));
    w.record(32, &[0]);
    let o = epilog::run(&w.node, 32, None);
    assert!(o.clean(), "{o:?}");
    assert_eq!(o.lingering.len(), 1, "{o:?}");
    assert_eq!((o.lingering[0].pid, o.lingering[0].gone()), (client, true));
    let ev: Value =
        serde_json::from_slice(&std::fs::read(o.lingering[0].evidence.as_ref().unwrap()).unwrap())
            .unwrap();
    assert_eq!(ev["gpu_memory"][0]["used_bytes"], 700u64 << 20, "{ev}");
}

/// gres/shard and gres/mps put several jobs on one GPU. The Prolog marks a
/// GPU another job's live grant covers as shared (its used memory then is
/// the co-tenant's, no idle level); the Epilog checks such a GPU per
/// process: a process NVML lists there outside every grant, which the
/// response left alive (root's, spared), is a survivor by name, though the
/// GPU's total is below the level measured at start; the co-tenant's own
/// process, covered by its grant, is not.
#[test]
fn a_shared_gpu_is_checked_per_process() {
    if !privileged() {
        return;
    }
    let mut w = world("shared-gpu", "idle_memory_mib = 0");
    let co_job = w.env.cgroup("job_41");
    let co_tenant = w.env.spawn_user_sleeper(&co_job);
    Fence::open(&w.env.bpffs)
        .unwrap()
        .grant(
            w.env.cg.id(&co_job).unwrap(),
            &co_job,
            41,
            &[(DevNum::new(195, 3), Access::RW)],
        )
        .unwrap();
    w.scenario(json!({"gpus": [gpu(3, json!([{"pid": co_tenant, "used_mib": 3000}]))]}));
    // The Prolog of job 40 on that GPU: shared.
    let node = one_gpu_node(&w, 3, "memory_wait_ms = 500\nidle_memory_mib = 0\n");
    let rec = prolog::run(&node, &prolog_env(40)).unwrap();
    assert_eq!(rec.gpu_idle.len(), 1);
    assert!(rec.gpu_idle[0].shared, "{:?}", rec.gpu_idle);
    assert_eq!(rec.gpu_idle[0].used_bytes, 3500u64 << 20);
    // The job leaves a root process on the GPU (spared: never killed),
    // holding 1,000 MiB: 1,500 MiB in all, below the 3,500 at start.
    let out_cg = w.env.cgroup("outside");
    let left = w.env.spawn_sleeper(&out_cg);
    w.scenario(json!({"gpus": [gpu(3, json!([
        {"pid": co_tenant, "used_mib": 3000},
        {"pid": left, "used_mib": 1000}
    ]))]}));
    let o = epilog::run(&node, 40, None);
    assert!(!o.clean(), "{o:?}");
    assert!(
        o.survivors.iter().any(|s| s.to_string().contains(&format!(
            "GPU /dev/nvidia3 (shared with another job) still has 1000 MiB of pid {left}, which no grant covers"
        ))),
        "{:?}",
        o.survivors
    );
    assert!(
        !o.survivors
            .iter()
            .any(|s| s.to_string().contains(&format!("pid {co_tenant}"))),
        "the co-tenant's process is covered by its grant: {:?}",
        o.survivors
    );
    assert!(!gone(co_tenant) && !gone(left));
    // Alone on the GPU now, with the job's leftover gone: clean, whatever
    // the level measured at start.
    w.scenario(json!({"gpus": [gpu(3, json!([{"pid": co_tenant, "used_mib": 3000}]))]}));
    let rec = prolog::run(&node, &prolog_env(42)).unwrap();
    assert!(rec.gpu_idle[0].shared);
    assert!(epilog::run(&node, 42, None).clean());
}

/// The grant entries of gpufence's MPS daemons in the fence.
fn mps_grants(w: &World) -> Vec<gpufence_cgroup::fence::GrantEntry> {
    Fence::open(&w.env.bpffs)
        .unwrap()
        .entries()
        .unwrap()
        .into_iter()
        .filter(|e| e.job_id == gpufence_model::record::MPS_GRANT_JOB_ID)
        .collect()
}

/// `mps_control` that cannot start (`/bin/false -d` exits 1): the gres/mps
/// job still starts, with one note for its user and an `error` line;
/// nothing is granted to a daemon cgroup, which is gone; the GPU counts as
/// shared (per-process memory check); the Epilog is clean.
#[test]
fn an_mps_daemon_that_cannot_start_is_one_line_and_no_grant() {
    if !privileged() {
        return;
    }
    let w = world("mps-fail", "");
    w.scenario(json!({"gpus": [gpu(3, json!([]))]}));
    let node = one_gpu_node(
        &w,
        3,
        &format!(
            "mps_control = \"/bin/false\"\nmps_dir = \"{}\"\n",
            w.env.path("mps").display()
        ),
    );
    let rec = prolog::run(
        &node,
        &PrologEnv {
            mps: true,
            ..prolog_env(50)
        },
    )
    .unwrap();
    assert_eq!(
        rec.user_notes,
        vec!["gres/mps: no MPS daemon for 195:3 (/bin/false -d: exited with exit status: 1); the job runs without MPS"],
        "{:?}",
        rec.notes
    );
    assert!(
        rec.notes.iter().all(|n| !n.starts_with("gres/mps: ")),
        "the user's line is not the admin's too: {:?}",
        rec.notes
    );
    assert!(rec.gpu_idle.iter().all(|g| g.shared), "{:?}", rec.gpu_idle);
    assert_eq!(
        rec.mps.iter().map(|d| d.dev).collect::<Vec<_>>(),
        vec![DevNum::new(195, 3)]
    );
    assert!(mps_grants(&w).is_empty());
    let cg = gpufence_node::job::mps::cgroup(&node, "gpu3-u0");
    assert!(!node.cg.path(&cg).exists(), "{cg} left behind");
    let errors: Vec<Value> = w
        .audit()
        .into_iter()
        .filter(|e| e["job_id"] == 50 && e["event"] == "error")
        .collect();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0]["mps_daemon"], "gpu3-u0");
    let o = epilog::run(&node, 50, None);
    assert!(o.clean(), "{o:?}");
    assert!(!node.state.mps_registration_path("gpu3-u0", 50).exists());
}

/// The daemon (the stand-in, `gpufence-mps-standin -d`) is started once
/// for two gres/mps jobs of one user on one GPU, in
/// `<cgroup_root>/gpufence-mps/gpu3-u0`,
/// granted that GPU (and the control devices) under `MPS_GRANT_JOB_ID`;
/// the first job's Epilog leaves it running and granted; the second's
/// stops it: no process, no cgroup, no grant.
#[test]
fn an_mps_daemon_lives_while_an_mps_job_holds_its_gpu() {
    if !privileged() {
        return;
    }
    let w = world("mps-life", "");
    w.scenario(json!({"gpus": [gpu(3, json!([]))]}));
    let node = standin_node(&w);
    let cg = gpufence_node::job::mps::cgroup(&node, "gpu3-u0");
    for job in [51, 52] {
        let rec = prolog::run(
            &node,
            &PrologEnv {
                mps: true,
                ..prolog_env(job)
            },
        )
        .unwrap();
        assert!(rec.user_notes.is_empty(), "{:?}", rec.user_notes);
        assert_eq!(
            gpufence_node::job::grant::job_env(&rec),
            vec![(
                "CUDA_MPS_PIPE_DIRECTORY".to_string(),
                w.env.path("mps/gpu3/u0/pipe").display().to_string()
            )]
        );
    }
    let daemon = node.cg.procs_recursive(&cg);
    assert_eq!(daemon.len(), 1, "one daemon: {daemon:?}");
    let started = w
        .audit()
        .into_iter()
        .filter(|e| e["event"] == "mps_started")
        .count();
    assert_eq!(started, 1);
    let granted: Vec<DevNum> = mps_grants(&w).iter().map(|e| e.dev).collect();
    assert!(granted.contains(&DevNum::new(195, 3)), "{granted:?}");
    assert!(
        granted.iter().all(|d| d.major == 195 || d.major == 241),
        "the GPU and control devices only: {granted:?}"
    );
    let o = epilog::run(&node, 51, None);
    assert!(o.clean(), "{o:?}");
    assert_eq!(node.cg.procs_recursive(&cg), daemon, "still running");
    assert!(!mps_grants(&w).is_empty(), "still granted");
    let o = epilog::run(&node, 52, None);
    assert!(o.clean(), "{o:?}");
    assert!(
        o.notes
            .iter()
            .any(|n| n.starts_with("MPS daemon gpu3-u0 stopped")),
        "{:?}",
        o.notes
    );
    assert!(gone(daemon[0]), "the daemon ended");
    assert!(!node.cg.path(&cg).exists(), "{cg} removed");
    assert!(mps_grants(&w).is_empty(), "{:?}", mps_grants(&w));
    assert!(!w.env.path("mps/gpu3/u0").exists());
}

/// A node with GPU 3 whose `mps_control` is the stand-in (a script any
/// user may run: `gpufence-mps-standin --gpu /dev/null "$@"`).
fn standin_node(w: &World) -> Node {
    let control = w.env.path("mps-control");
    std::fs::write(
        &control,
        format!(
            "#!/bin/sh\nexec {} --gpu /dev/null \"$@\"\n",
            workspace_bin("gpufence-mps-standin").display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(
        &control,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    one_gpu_node(
        w,
        3,
        &format!(
            "mps_control = \"{}\"\nmps_dir = \"{}\"\n",
            control.display(),
            w.env.path("mps").display()
        ),
    )
}

/// The real uid of `pid`.
fn uid_of(pid: i32) -> u32 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|u| u.parse().ok())
        .unwrap()
}

/// What `cmd` (the stand-in) prints, run as `uid` with `pipe` as its
/// pipe directory and `input` on stdin.
fn as_user(uid: u32, pipe: &std::path::Path, args: &[&str], input: &str) -> String {
    use std::io::Write;
    use std::os::unix::process::CommandExt;
    let mut c = std::process::Command::new(workspace_bin("gpufence-mps-standin"));
    c.args(args)
        .uid(uid)
        .gid(uid)
        .env_clear()
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .current_dir("/")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = c.spawn().unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The daemon runs as its job's user (not root): the pipe and log
/// directories are that user's, 0700; `start_server -uid 0` or `-uid
/// <peer>` sent through the user's own pipe starts nothing (the
/// stand-in's setuid fails with EPERM, as a daemon not run as root must),
/// and nothing but the user's processes is ever in the daemon's cgroup.
/// A descriptor the Prolog's process holds without `O_CLOEXEC` is not the
/// daemon's. Then the user stops their daemon and server (`SIGSTOP`), and
/// another Prolog or Epilog holds that daemon's lock: another uid's MPS
/// Prolog on the same GPU is not held up (one lock per daemon); the
/// user's last job's Epilog removes its registration at once, and, the
/// lock not to be had, stops the daemon all the same (no job is
/// registered: its grant revoked, its cgroup killed). A registration of a
/// job with no record and no Prolog running is removed by the next Prolog.
#[test]
fn an_mps_daemon_runs_as_its_user_and_never_holds_up_another() {
    if !privileged() {
        return;
    }
    use std::os::unix::fs::MetadataExt;
    let w = world("mps-user", "");
    w.scenario(json!({"gpus": [gpu(3, json!([]))]}));
    let node = standin_node(&w);
    let user = gpufence_tests::cluster::test_uid();
    let name = format!("gpu3-u{user}");
    let cg = gpufence_node::job::mps::cgroup(&node, &name);
    let pipe = w.env.path(&format!("mps/gpu3/u{user}/pipe"));
    // A descriptor of the Prolog's process without O_CLOEXEC (as
    // libnvidia-ml may leave one).
    let marker = w.env.path("not-cloexec");
    std::fs::write(&marker, "x").unwrap();
    let c = std::ffi::CString::new(marker.to_str().unwrap()).unwrap();
    // SAFETY: open(2) of a path we own, closed below.
    let leaked = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY) };
    assert!(leaked >= 0);
    let rec = prolog::run(
        &node,
        &PrologEnv {
            mps: true,
            uid: user,
            ..prolog_env(61)
        },
    );
    // SAFETY: our own descriptor.
    unsafe { libc::close(leaked) };
    let rec = rec.unwrap();
    if rec.user_notes.iter().any(|n| n.contains("POSIX ACL")) {
        eprintln!("SKIPPED: no POSIX ACLs on the test's file system");
        let _ = epilog::run(&node, 61, None);
        return;
    }
    assert!(rec.user_notes.is_empty(), "{:?}", rec.user_notes);
    let daemon = node.cg.procs_recursive(&cg);
    assert_eq!(daemon.len(), 1, "{daemon:?}");
    assert_eq!(uid_of(daemon[0]), user, "the daemon runs as its user");
    let fds: Vec<PathBuf> = std::fs::read_dir(format!("/proc/{}/fd", daemon[0]))
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .collect();
    assert!(!fds.contains(&marker), "inherited: {fds:?}");
    for d in [&pipe, &pipe.with_file_name("log")] {
        let m = std::fs::symlink_metadata(d).unwrap();
        assert!(m.is_dir());
        assert_eq!(
            (m.uid(), m.mode() & 0o7777),
            (user, 0o700),
            "{}",
            d.display()
        );
    }
    let u = std::fs::symlink_metadata(pipe.parent().unwrap()).unwrap();
    assert_eq!((u.uid(), u.mode() & 0o7777 & !0o070), (0, 0o700));
    // start_server for root, and for a peer, through the user's own pipe.
    for other in [0u32, 65534] {
        let said = as_user(
            user,
            &pipe,
            &["--gpu", "/dev/null"],
            &format!("start_server -uid {other}\n"),
        );
        assert_eq!(said.trim(), "server-failed EPERM", "uid {other}");
        assert!(gpufence_node::host::mps_cgroups::foreign_processes(&node).is_empty());
        assert_eq!(node.cg.procs_recursive(&cg), daemon);
    }
    // The user's own client gets a server of the user's, in the cgroup.
    let said = as_user(user, &pipe, &["client"], "");
    assert!(
        said.starts_with("MPS server ") && said.trim().ends_with(" ok"),
        "{said}"
    );
    let procs = node.cg.procs_recursive(&cg);
    assert_eq!(procs.len(), 2, "{procs:?}");
    assert!(procs.iter().all(|p| uid_of(*p) == user));
    // The user stops them, as the user.
    let mut kill = std::process::Command::new("kill");
    kill.arg("-STOP");
    for p in &procs {
        kill.arg(p.to_string());
    }
    std::os::unix::process::CommandExt::uid(&mut kill, user);
    assert!(kill.status().unwrap().success());
    // Another Prolog or Epilog holds the user's daemon's lock.
    let held = gpufence_model::fsutil::lock_file_within(
        &node.state.mps_daemon_lock_path(&name),
        std::time::Duration::from_secs(1),
        std::time::Duration::from_millis(10),
    )
    .unwrap()
    .expect("the lock");
    // Root's MPS job on the same GPU: its own daemon, at once.
    let t0 = std::time::Instant::now();
    let rec0 = prolog::run(
        &node,
        &PrologEnv {
            mps: true,
            ..prolog_env(63)
        },
    )
    .unwrap();
    assert!(rec0.user_notes.is_empty(), "{:?}", rec0.user_notes);
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(5),
        "held up: {:?}",
        t0.elapsed()
    );
    let cg0 = gpufence_node::job::mps::cgroup(&node, "gpu3-u0");
    assert_eq!(node.cg.procs_recursive(&cg0).len(), 1);
    // The user's job ends: registration gone, daemon stopped regardless.
    let o = epilog::run(&node, 61, None);
    drop(held);
    assert!(!node.state.mps_registration_path(&name, 61).exists());
    assert!(
        procs.iter().all(|p| gone(*p)),
        "stopped daemon and server ended"
    );
    assert!(!node.cg.path(&cg).exists(), "{cg} removed");
    assert!(!pipe.parent().unwrap().exists());
    let cg0_id = node.cg.id(&cg0).unwrap();
    assert!(
        mps_grants(&w).iter().all(|e| e.cgroup_id == cg0_id),
        "only root's daemon is granted: {:?}",
        mps_grants(&w)
    );
    assert!(o.clean(), "{o:?}");
    // A registration of a job that has no record and whose Prolog is gone
    // (pid 1 did not start at tick 0) goes at the next Prolog.
    std::fs::write(node.state.mps_registration_path("gpu3-u0", 99), "1 0\n").unwrap();
    prolog::run(
        &node,
        &PrologEnv {
            mps: true,
            ..prolog_env(64)
        },
    )
    .unwrap();
    assert!(!node.state.mps_registration_path("gpu3-u0", 99).exists());
    assert!(
        w.events(99).contains(&"stale_job_state".to_string()),
        "{:?}",
        w.events(99)
    );
    let o = epilog::run(&node, 63, None);
    assert!(o.clean(), "{o:?}");
    assert!(node.cg.path(&cg0).exists(), "job 64 still uses it");
    // Job 64's Epilog will not run (its record is gone, its Prolog too):
    // the sweep removes its registration and stops the daemon no job uses.
    node.state.remove_record(64).unwrap();
    std::fs::write(node.state.mps_registration_path("gpu3-u0", 64), "1 0\n").unwrap();
    let report = gpufence_node::sweep::sweep(
        &node,
        &gpufence_node::sweep::Options {
            cgroup: Some(w.env.root.clone()),
            cursor: None,
            proc_walk: false,
        },
    )
    .unwrap();
    let f = report
        .findings
        .iter()
        .find(|f| f.evidence["mps_daemon"] == "gpu3-u0")
        .unwrap_or_else(|| panic!("{:?}", report.findings));
    assert_eq!(f.kind.as_str(), "stale_grant");
    assert!(
        f.action.as_deref().unwrap_or("").contains("stopped"),
        "{f:?}"
    );
    assert!(!node.state.mps_registration_path("gpu3-u0", 64).exists());
    assert!(!node.cg.path(&cg0).exists());
    assert!(mps_grants(&w).is_empty(), "{:?}", mps_grants(&w));
    assert!(!w.env.path("mps/gpu3").exists());
}

/// Every file in the job map directory `dir`, with its content (none
/// when the directory is absent).
fn job_map(dir: &std::path::Path) -> std::collections::BTreeMap<String, String> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| {
                    (
                        e.file_name().to_string_lossy().into_owned(),
                        std::fs::read_to_string(e.path()).unwrap_or_default(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn job_map_config(dir: &std::path::Path) -> String {
    format!("job_map_dir = \"{}\"\n", dir.display())
}

/// Two co-tenant jobs (gres/shard: both records name the GPU) on
/// `/dev/nvidia3`, which NVML lists first: the job map file is `0` (NVML's
/// index, not the minor), listing both jobs; a stale file no job holds is
/// removed, a file not named like a GPU is left alone; the first Epilog
/// leaves the other job, the second removes the file.
#[test]
fn the_job_map_names_nvml_indices_and_lists_co_tenants() {
    if !privileged() {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let w = world("jobmap-shared", "");
    w.scenario(json!({"gpus": [gpu(3, json!([])), gpu(1, json!([]))]}));
    let dir = w.env.path("run/gpu-job-map");
    let node = one_gpu_node(&w, 3, &job_map_config(&dir));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("1"), "999\n").unwrap();
    std::fs::write(dir.join("README"), "site notes\n").unwrap();
    let a = prolog::run(&node, &prolog_env(50)).unwrap();
    assert_eq!(a.job_map, vec!["0".to_string()], "{:?}", a.notes);
    let b = prolog::run(&node, &prolog_env(51)).unwrap();
    assert_eq!(b.job_map, vec!["0".to_string()]);
    let want = |pairs: &[(&str, &str)]| -> std::collections::BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    assert_eq!(
        job_map(&dir),
        want(&[("0", "50\n51\n"), ("README", "site notes\n")])
    );
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode(&dir.join("0")), 0o644);
    let o = epilog::run(&node, 50, None);
    assert!(o.clean(), "{o:?}");
    assert_eq!(
        job_map(&dir),
        want(&[("0", "51\n"), ("README", "site notes\n")])
    );
    let o = epilog::run(&node, 51, None);
    assert!(o.clean(), "{o:?}");
    assert_eq!(job_map(&dir), want(&[("README", "site notes\n")]));
    // A missing directory is made, 0755.
    std::fs::remove_dir_all(&dir).unwrap();
    prolog::run(&node, &prolog_env(52)).unwrap();
    assert_eq!(mode(&dir), 0o755);
    assert_eq!(job_map(&dir), want(&[("0", "52\n")]));
    epilog::run(&node, 52, None);
    assert!(job_map(&dir).is_empty());
}

/// A MIG slice (GPU instance 2 of `/dev/nvidia5`, which NVML lists
/// second): the file is `1.2`, `<parent's NVML index>.<GPU instance id>`;
/// neither the whole GPU's `1` nor the minor's `5.2`.
#[test]
fn the_job_map_names_a_mig_slice_by_its_parents_index_and_instance() {
    if !privileged() {
        return;
    }
    let w = world("jobmap-mig", "");
    w.scenario(json!({"gpus": [gpu(0, json!([])), gpu(5, json!([]))]}));
    for (name, major, minor) in [("nvidia5", 195, 5), ("cap21", 242, 21), ("cap22", 242, 22)] {
        w.env.mknod(name, major, minor);
    }
    let proc_dir = w.env.path("proc");
    std::fs::create_dir_all(proc_dir.join("driver/nvidia-caps")).unwrap();
    std::fs::write(
        proc_dir.join("driver/nvidia-caps/mig-minors"),
        "config 1\nmonitor 2\ngpu5/gi1/access 12\ngpu5/gi1/ci0/access 13\ngpu5/gi2/access 21\ngpu5/gi2/ci0/access 22\n",
    )
    .unwrap();
    let slurmd_g = w.env.path("slurmd-G.txt");
    let dev = w.env.path("dev");
    std::fs::write(
        &slurmd_g,
        format!(
            "Gres Name=gpu Type=3g.40gb Count=1 File={d}/nvidia5,{d}/cap21,{d}/cap22\n",
            d = dev.display()
        ),
    )
    .unwrap();
    let dir = w.env.path("gpu-job-map");
    let p = w.env.config(&format!(
        "nvml_library = \"{}\"\nslurmd_gres = \"{}\"\nproc_dir = \"{}\"\n{}[majors]\nnvidia = 195\nnvidia-caps = 242\n",
        w.scenario.with_file_name("libnvidia-ml.so.1").display(),
        slurmd_g.display(),
        proc_dir.display(),
        job_map_config(&dir),
    ));
    let node = Node::new(Config::load(&p).unwrap(), ConfigOrigin::File(p)).unwrap();
    let rec = prolog::run(&node, &prolog_env(55)).unwrap();
    assert_eq!(
        (rec.mig.len(), rec.mig[0].gpu, rec.mig[0].gi),
        (1, 5, 2),
        "{rec:?}"
    );
    assert_eq!(rec.job_map, vec!["1.2".to_string()], "{:?}", rec.notes);
    assert_eq!(
        job_map(&dir),
        [("1.2".to_string(), "55\n".to_string())].into()
    );
    epilog::run(&node, 55, None);
    assert!(job_map(&dir).is_empty(), "{:?}", job_map(&dir));
}

/// Without NVML the job gets no map file (a GPU's NVML index cannot be
/// told) and one note says why, in the record and in `grant_recorded`;
/// the Epilog, without NVML too, still takes an earlier job out of the
/// file the Prolog wrote when NVML answered.
#[test]
fn without_nvml_no_job_map_file_and_one_line() {
    if !privileged() {
        return;
    }
    let w = world("jobmap-nonvml", "");
    w.scenario(json!({"gpus": [gpu(3, json!([])), gpu(1, json!([]))]}));
    let dir = w.env.path("gpu-job-map");
    let node = one_gpu_node(&w, 3, &job_map_config(&dir));
    let a = prolog::run(&node, &prolog_env(60)).unwrap();
    assert_eq!(a.job_map, vec!["0".to_string()]);
    w.scenario(json!({"init_error": 9}));
    let b = prolog::run(&node, &prolog_env(61)).unwrap();
    assert!(b.job_map.is_empty(), "{b:?}");
    let why: Vec<&String> = b
        .notes
        .iter()
        .filter(|n| n.starts_with("job_map_dir: no job map file for this job"))
        .collect();
    assert_eq!(why.len(), 1, "{:?}", b.notes);
    assert!(why[0].contains("NVML unavailable"), "{}", why[0]);
    let recorded: Vec<Value> = w
        .audit()
        .into_iter()
        .filter(|e| e["event"] == "grant_recorded" && e["job_id"] == 61)
        .collect();
    assert_eq!(recorded.len(), 1);
    assert!(
        recorded[0]["notes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n.as_str() == Some(why[0].as_str())),
        "{}",
        recorded[0]
    );
    assert_eq!(
        job_map(&dir),
        [("0".to_string(), "60\n".to_string())].into(),
        "job 61 is in no file"
    );
    epilog::run(&node, 60, None);
    assert!(job_map(&dir).is_empty(), "{:?}", job_map(&dir));
    epilog::run(&node, 61, None);
    assert!(job_map(&dir).is_empty());
}
