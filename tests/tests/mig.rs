//! MIG: two jobs with one slice each of the same (simulated) GPU.
//!
//! The slices' capabilities are device nodes on a test "nvidia-caps" major
//! whose minors are given meaning by a fixture `mig-minors` (the driver's
//! format, `testdata/cases/mig-minors-excerpt.txt`) under a fixture proc
//! root. Each job opens its own caps and the shared parent, not the
//! neighbour's caps; the config capability is never granted; the epilog of
//! one job never touches the other job's processes.

use gpufence_model::config::{Config, ConfigOrigin};
use gpufence_model::device::DevNum;
use gpufence_model::record::MigSlice;
use gpufence_node::job::grant::StepRequest;
use gpufence_node::job::prolog::{self, PrologEnv};
use gpufence_node::{host::fence_ops, job::epilog, Node, NodeError};
use gpufence_tests::{gone, privileged, HoldableDevice, TestEnv};
use serde_json::json;

struct Mig {
    env: TestEnv,
    node: Node,
    caps_major: u32,
}

/// `caps`: (name, minor) of cap nodes to make; `mig_minors`: the fixture;
/// `gres`: slurmd -G lines (with `{dev}` for the dev dir).
fn mig(
    tag: &str,
    caps_major: u32,
    caps: &[(&str, u32)],
    mig_minors: &str,
    gres: &str,
    extra: &str,
) -> Mig {
    let env = TestEnv::new(tag);
    env.mknod("nvidia0", 195, 0);
    for (name, minor) in caps {
        env.mknod(name, caps_major, *minor);
    }
    let proc_dir = env.path("proc");
    std::fs::create_dir_all(proc_dir.join("driver/nvidia-caps")).unwrap();
    std::fs::write(proc_dir.join("driver/nvidia-caps/mig-minors"), mig_minors).unwrap();
    let g = env.path("slurmd-G.txt");
    std::fs::write(&g, gres.replace("{dev}", env.path("dev").to_str().unwrap())).unwrap();
    let p = env.config(&format!(
        "layout = \"own\"\nproc_dir = \"{}\"\nslurmd_gres = \"{}\"\nnvml = false\nterm_grace_ms = 300\n{extra}\n[majors]\nnvidia = 195\nnvidia-caps = {caps_major}\n",
        proc_dir.display(),
        g.display()
    ));
    let node = Node::new(Config::load(&p).unwrap(), ConfigOrigin::File(p)).unwrap();
    fence_ops::install(&node).unwrap();
    Mig {
        env,
        node,
        caps_major,
    }
}

fn prolog_env(job: u32, index: u32) -> PrologEnv {
    PrologEnv {
        job_id: job,
        uid: 0,
        gres_indices: vec![index],
        slurm_conf: None,
        node_name: None,
        cuda_visible_devices: vec![],
        options: Default::default(),
        mps: false,
    }
}

const MINORS: &str = "config 1\nmonitor 2\ngpu0/gi0/access 3\ngpu0/gi0/ci0/access 4\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\ngpu0/gi2/access 21\ngpu0/gi2/ci0/access 22\n";
const TWO_SLICES: &str = "slurmd: Gres Name=gpu Type=3g.40gb Count=1 Index=13 ID=7696487 File={dev}/nvidia0,{dev}/cap12,{dev}/cap13 (null)\n\
                          slurmd: Gres Name=gpu Type=3g.40gb Count=1 Index=22 ID=7696487 File={dev}/nvidia0,{dev}/cap21,{dev}/cap22 (null)\n";

#[test]
fn neighbours_open_their_own_caps_and_the_shared_parent() {
    if !privileged() {
        return;
    }
    let caps = [
        ("cap1", 1),
        ("cap2", 2),
        ("cap12", 12),
        ("cap13", 13),
        ("cap21", 21),
        ("cap22", 22),
    ];
    let mut m = mig("mig", 242, &caps, MINORS, TWO_SLICES, "");
    let a = prolog::run(&m.node, &prolog_env(61, 0)).unwrap();
    let b = prolog::run(&m.node, &prolog_env(62, 1)).unwrap();
    let cm = m.caps_major;
    assert_eq!(
        a.mig,
        vec![MigSlice {
            parent: DevNum::new(195, 0),
            gpu: 0,
            gi: 1,
            ci: Some(0),
            gi_cap: DevNum::new(cm, 12),
            ci_cap: Some(DevNum::new(cm, 13)),
        }]
    );
    assert_eq!((b.mig[0].gi, b.mig[0].gi_cap), (2, DevNum::new(cm, 21)));
    for (job, rec) in [(61u32, &a), (62, &b)] {
        let slurmd = m.env.cgroup("slurmd");
        let stepd = m.env.spawn_sleeper(&slurmd);
        gpufence_tests::grant_step(
            &m.node,
            &StepRequest {
                job_id: job,
                step_id: 0,
                uid: rec.uid,
                stepd_pid: stepd,
            },
        )
        .unwrap();
    }
    let dev = |n: &str| m.env.path("dev").join(n);
    let ja = format!("{}/job_61/step_0", m.env.root);
    let jb = format!("{}/job_62/step_0", m.env.root);
    let out = m.env.cgroup("outside");
    for (cg, own, other) in [
        (&ja, ["cap12", "cap13"], ["cap21", "cap22"]),
        (&jb, ["cap21", "cap22"], ["cap12", "cap13"]),
    ] {
        assert_eq!(
            m.env.open_from(cg, &dev("nvidia0")),
            "ENXIO",
            "shared parent from /{cg}"
        );
        for c in own {
            assert_eq!(m.env.open_from(cg, &dev(c)), "ENXIO", "own {c} from /{cg}");
        }
        for c in other {
            assert_eq!(
                m.env.open_from(cg, &dev(c)),
                "EPERM",
                "neighbour's {c} from /{cg}"
            );
        }
        for c in ["cap1", "cap2"] {
            assert_eq!(
                m.env.open_from(cg, &dev(c)),
                "EPERM",
                "{c} (config/monitor) from /{cg}"
            );
        }
    }
    for c in ["nvidia0", "cap12", "cap21"] {
        assert_eq!(m.env.open_from(&out, &dev(c)), "EPERM", "outsider {c}");
    }
    // Job 61 ends: job 62 keeps the parent and its caps.
    assert!(epilog::run(&m.node, 61, None).clean());
    assert_eq!(m.env.open_from(&jb, &dev("nvidia0")), "ENXIO");
    assert_eq!(m.env.open_from(&jb, &dev("cap22")), "ENXIO");
}

#[test]
fn config_is_never_granted_monitor_only_when_asked() {
    if !privileged() {
        return;
    }
    let caps = [("cap1", 1), ("cap2", 2), ("cap21", 21), ("cap22", 22)];
    let gres =
        "Gres Name=gpu Count=1 File={dev}/nvidia0,{dev}/cap1,{dev}/cap2,{dev}/cap21,{dev}/cap22\n";
    let m = mig("mig-config", 242, &caps, MINORS, gres, "");
    let r = prolog::run(&m.node, &prolog_env(63, 0)).unwrap();
    let devs: Vec<DevNum> = r.devices.iter().map(|d| d.dev).collect();
    assert!(
        !devs.contains(&DevNum::new(242, 1)),
        "config granted: {devs:?}"
    );
    assert!(
        !devs.contains(&DevNum::new(242, 2)),
        "monitor granted by default: {devs:?}"
    );
    assert!(devs.contains(&DevNum::new(242, 21)) && devs.contains(&DevNum::new(242, 22)));
    assert!(
        r.notes
            .iter()
            .any(|n| n.contains("config capability: never granted")),
        "{:?}",
        r.notes
    );
    let m2 = mig(
        "mig-monitor",
        242,
        &caps,
        MINORS,
        gres,
        "grant_mig_monitor = true",
    );
    let r = prolog::run(&m2.node, &prolog_env(64, 0)).unwrap();
    let devs: Vec<DevNum> = r.devices.iter().map(|d| d.dev).collect();
    assert!(
        devs.contains(&DevNum::new(242, 2)) && !devs.contains(&DevNum::new(242, 1)),
        "{devs:?}"
    );
}

#[test]
fn unidentifiable_caps_are_refused() {
    if !privileged() {
        return;
    }
    let caps = [("cap77", 77)];
    let gres = "Gres Name=gpu Count=1 File={dev}/nvidia0,{dev}/cap77\n";
    let m = mig("mig-unknown", 242, &caps, MINORS, gres, "");
    let e = prolog::run(&m.node, &prolog_env(65, 0)).unwrap_err();
    assert!(
        matches!(&e, NodeError::Mig(msg) if msg.contains("not listed in")),
        "{e}"
    );
    let m = mig("mig-nominors", 242, &caps, "", gres, "");
    std::fs::remove_file(m.node.cfg.proc_dir.join("driver/nvidia-caps/mig-minors")).unwrap();
    let e = prolog::run(&m.node, &prolog_env(66, 0)).unwrap_err();
    assert!(matches!(e, NodeError::Mig(_)), "{e}");
}

/// Descriptors: a lingering holder of job A's cap is A's and is killed; the
/// neighbour's process holding its own cap is left alone. The caps here are
/// real misc devices nothing else holds (so they can be held open), with
/// `mig-minors` naming them as the two slices' GI caps.
#[test]
fn the_epilog_kills_only_its_own_slice_holders() {
    if !privileged() {
        return;
    }
    let ca = HoldableDevice::claim();
    let cb = HoldableDevice::claim();
    assert_eq!(ca.major, cb.major);
    let minors = format!(
        "config 1\nmonitor 2\ngpu0/gi1/access {}\ngpu0/gi2/access {}\n",
        ca.minor, cb.minor
    );
    let gres = "Gres Name=gpu Count=1 File={dev}/nvidia0,{dev}/capA\nGres Name=gpu Count=1 File={dev}/nvidia0,{dev}/capB\n";
    let mut m = mig(
        "mig-epilog",
        ca.major,
        &[("capA", ca.minor), ("capB", cb.minor)],
        &minors,
        gres,
        "",
    );
    prolog::run(&m.node, &prolog_env(67, 0)).unwrap();
    prolog::run(&m.node, &prolog_env(68, 1)).unwrap();
    let slurmd = m.env.cgroup("slurmd");
    for job in [67, 68] {
        let stepd = m.env.spawn_sleeper(&slurmd);
        gpufence_tests::grant_step(
            &m.node,
            &StepRequest {
                job_id: job,
                step_id: 0,
                uid: 0,
                stepd_pid: stepd,
            },
        )
        .unwrap();
    }
    let cap_b = m.env.path("dev/capB");
    let cap_a = m.env.path("dev/capA");
    let jb = format!("{}/job_68/step_0", m.env.root);
    let neighbour = m
        .env
        .spawn_user_probe(&jb, &["hold", cap_b.to_str().unwrap()], "held");
    // A's leftover: holds A's cap from outside any job (opened where the fence does not apply).
    let mut cmd = gpufence_tests::as_test_user(gpufence_tests::probe_bin());
    cmd.args(["hold", cap_a.to_str().unwrap()]);
    let leftover = m.env.spawn_ready(cmd, "held");
    let o = epilog::run(&m.node, 67, None);
    assert!(o.clean(), "{o:?}");
    assert_eq!(
        o.lingering.iter().map(|l| l.pid).collect::<Vec<_>>(),
        vec![leftover]
    );
    assert!(gone(leftover));
    assert!(
        !gone(neighbour),
        "job 68's process on its own slice is untouched"
    );
}

/// NVML: on a MIG parent, only processes on the job's GPU/compute instance
/// are the job's; the neighbour's (another GI) are not touched.
#[test]
fn nvml_processes_are_matched_by_instance() {
    if !privileged() {
        return;
    }
    let caps = [("cap12", 12), ("cap13", 13), ("cap21", 21), ("cap22", 22)];
    let mut m = mig("mig-nvml", 242, &caps, MINORS, TWO_SLICES, "");
    let lib_dir = m.env.path("nvml");
    std::fs::create_dir_all(&lib_dir).unwrap();
    let lib = lib_dir.join("libnvidia-ml.so.1");
    std::fs::copy(gpufence_tests::workspace_bin("libnvidia_ml.so"), &lib).unwrap();
    let p = m.env.config(&format!(
        "layout = \"own\"\nproc_dir = \"{}\"\nslurmd_gres = \"{}\"\nnvml_library = \"{}\"\nterm_grace_ms = 300\nmemory_wait_ms = 200\n[majors]\nnvidia = 195\nnvidia-caps = 242\n",
        m.node.cfg.proc_dir.display(),
        m.env.path("slurmd-G.txt").display(),
        lib.display()
    ));
    m.node = Node::new(Config::load(&p).unwrap(), ConfigOrigin::File(p)).unwrap();
    std::fs::write(
        lib_dir.join("nvml-scenario.json"),
        json!({"gpus": []}).to_string(),
    )
    .unwrap();
    prolog::run(&m.node, &prolog_env(69, 0)).unwrap();
    prolog::run(&m.node, &prolog_env(70, 1)).unwrap();
    let out = m.env.cgroup("outside");
    let mine = m.env.spawn_user_sleeper(&out);
    let theirs = m.env.spawn_user_sleeper(&out);
    std::fs::write(
        lib_dir.join("nvml-scenario.json"),
        json!({"gpus": [{"minor": 0, "processes": [
            {"pid": mine, "used_mib": 100, "gi": 1, "ci": 0},
            {"pid": theirs, "used_mib": 100, "gi": 2, "ci": 0}
        ]}]})
        .to_string(),
    )
    .unwrap();
    let o = epilog::run(&m.node, 69, None);
    assert_eq!(
        o.lingering.iter().map(|l| l.pid).collect::<Vec<_>>(),
        vec![mine],
        "{o:?}"
    );
    assert!(gone(mine) && !gone(theirs));
}

/// A MIG-partitioned GPU's bare parent, a GRES of its own in gres.conf:
/// granted (Slurm gave it), with a note in the record and in the
/// `grant_recorded` audit line; a GPU without instances gets none.
#[test]
fn a_partitioned_gpus_parent_granted_alone_is_noted() {
    if !privileged() {
        return;
    }
    let parent_alone =
        "slurmd: Gres Name=gpu Type=a100 Count=1 Index=0 ID=7696487 File={dev}/nvidia0 (null)\n";
    let m = mig("migparent", 242, &[], MINORS, parent_alone, "");
    // Not partitioned yet: no note.
    let rec = prolog::run(&m.node, &prolog_env(71, 0)).unwrap();
    assert!(
        rec.notes.iter().all(|n| !n.contains("MIG-partitioned")),
        "{:?}",
        rec.notes
    );
    assert!(epilog::run(&m.node, 71, None).clean());
    // Two GPU instances exist on GPU 0 (the driver's capability tree).
    for gi in [1, 2] {
        let d = m
            .env
            .path(&format!("proc/driver/nvidia/capabilities/gpu0/mig/gi{gi}"));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(
            d.join("access"),
            format!(
                "DeviceFileMinor: {}\nDeviceFileMode: 292\nDeviceFileModify: 1\n",
                gi * 9 + 3
            ),
        )
        .unwrap();
    }
    let rec = prolog::run(&m.node, &prolog_env(72, 0)).unwrap();
    assert_eq!(
        rec.devices
            .iter()
            .filter(|d| d.dev == DevNum::new(195, 0))
            .count(),
        1,
        "granted"
    );
    let note = rec
        .notes
        .iter()
        .find(|n| n.contains("MIG-partitioned"))
        .unwrap_or_else(|| panic!("no note: {:?}", rec.notes));
    assert!(
        note.contains("/dev/nvidia0 (195:0) alone") && note.contains("gi1, gi2"),
        "{note}"
    );
    let audit = gpufence_tests::audit_log_settled(&m.env.path("log/audit.jsonl"));
    let line = audit
        .iter()
        .find(|e| e["event"] == "grant_recorded" && e["job_id"] == json!(72))
        .unwrap_or_else(|| panic!("no grant_recorded for 72: {audit:?}"));
    assert!(
        line["notes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n.as_str().unwrap().contains("MIG-partitioned")),
        "{line}"
    );
    assert!(epilog::run(&m.node, 72, None).clean());
}
