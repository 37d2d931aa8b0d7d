//! The admin CLI on fixture trees: `gpufence devices` reads the driver's
//! /proc files through `proc_dir` and device nodes through `dev_dir`;
//! `gpufence mig check` plans slices.

use std::process::Command;

use gpufence_tests::{privileged, workspace_bin, TestEnv};
use serde_json::Value;

fn copy_tree(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let t = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &t);
        } else {
            std::fs::copy(e.path(), t).unwrap();
        }
    }
}

#[test]
fn devices_lists_gpus_mig_slices_caps_and_majors() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("devices");
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/nvproc");
    let proc_dir = env.path("proc");
    let gpu_dir = proc_dir.join("driver/nvidia/gpus/0000:18:00.0");
    std::fs::create_dir_all(&gpu_dir).unwrap();
    std::fs::copy(
        fixtures.join("information-h100.txt"),
        gpu_dir.join("information"),
    )
    .unwrap();
    std::fs::create_dir_all(proc_dir.join("driver/nvidia-caps")).unwrap();
    std::fs::copy(
        fixtures.join("mig-minors.txt"),
        proc_dir.join("driver/nvidia-caps/mig-minors"),
    )
    .unwrap();
    copy_tree(
        &fixtures.join("capabilities"),
        &proc_dir.join("driver/nvidia/capabilities"),
    );
    env.mknod("nvidia0", 195, 0);
    env.mknod("nvidiactl", 195, 255);
    for m in [12, 13, 21, 22] {
        env.mknod(&format!("nvidia-caps/nvidia-cap{m}"), 242, m);
    }
    let cfg = env.config(&format!(
        "proc_dir = \"{}\"\nnvml = false\n[majors]\nnvidia = 195\nnvidia-caps = 242\nnvidia-uvm = 241\n",
        proc_dir.display()
    ));
    let o = Command::new(workspace_bin("gpufence"))
        .arg("--config")
        .arg(&cfg)
        .args(["devices", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let d: Value = serde_json::from_slice(&o.stdout).unwrap();
    let g = &d["gpus"][0];
    assert_eq!(g["minor"], 0);
    assert_eq!(g["uuid"], "GPU-3f5a9c2e-7b41-4d8e-a0c6-19e2b7d4f853");
    assert_eq!(g["pci_bus_id"], "0000:18:00.0");
    assert_eq!(g["model"], "NVIDIA H100 80GB HBM3");
    assert_eq!(g["mig_mode"], "instances present");
    assert_eq!(
        g["device_file"],
        env.path("dev/nvidia0").display().to_string()
    );
    let mig: Vec<(u64, Option<u64>, u64, bool)> = g["mig"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["gi"].as_u64().unwrap(),
                m["ci"].as_u64(),
                m["cap_minor"].as_u64().unwrap(),
                m["device_file"].is_string(),
            )
        })
        .collect();
    assert_eq!(
        mig,
        vec![
            (1, None, 12, true),
            (1, Some(0), 13, true),
            (2, None, 21, true),
            (2, Some(0), 22, true),
            (2, Some(1), 23, false)
        ]
    );
    assert_eq!(d["mig_admin_caps"]["config"], 1);
    assert_eq!(d["mig_admin_caps"]["monitor"], 2);
    let majors: Vec<(u64, usize)> = d["majors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["major"].as_u64().unwrap(),
                m["files"].as_array().unwrap().len(),
            )
        })
        .collect();
    assert_eq!(majors, vec![(195, 2), (241, 0), (242, 4)]);
    assert_eq!(d["nvml_unavailable"], "disabled in the config");
    assert_eq!(d["errors"], serde_json::json!([]));
    // The text form names the same things.
    let o = Command::new(workspace_bin("gpufence"))
        .arg("--config")
        .arg(&cfg)
        .arg("devices")
        .output()
        .unwrap();
    let t = String::from_utf8_lossy(&o.stdout);
    assert!(
        t.contains("GPU minor 0  0000:18:00.0  GPU-3f5a9c2e")
            && t.contains("MIG gi 2 ci 1  cap minor 23  (no device file)"),
        "{t}"
    );
}

#[test]
fn mig_check_places_or_explains() {
    let run = |args: &[&str]| {
        let o = Command::new(workspace_bin("gpufence"))
            .args(["mig", "check"])
            .args(args)
            .output()
            .unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr),
        )
    };
    let (rc, out) = run(&["--gpu", "H200", "3g.71gb,3g.71gb"]);
    assert_eq!(rc, Some(0), "{out}");
    assert!(
        out.contains("3g.71gb at 0:4") && out.contains("3g.71gb at 4:4"),
        "{out}"
    );
    let (rc, out) = run(&["--gpu", "A30", "4g.24gb,1g.6gb"]);
    assert_eq!(rc, Some(1), "{out}");
    assert!(out.starts_with("does not fit on one A30-24GB"), "{out}");
    let (rc, out) = run(&["--gpu", "H100-80GB", "5g.50gb"]);
    assert_eq!(rc, Some(1));
    assert!(out.contains("1g.10gb"), "lists the valid profiles: {out}");
    let (rc, _) = run(&["--gpu", "V100", "1g.5gb"]);
    assert_eq!(rc, Some(2));
}
