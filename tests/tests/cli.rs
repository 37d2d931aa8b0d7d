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

/// The user of the test NSS module (tests/fake-nss): known to no file.
const NSS_ONLY_USER: &str = "nssonly";
const NSS_ONLY_UID: u32 = 4242;

/// `gpufence sweep --json` in a mount namespace of its own where
/// /etc/nsswitch.conf reads `passwd: files gpufencetest` (a bind mount that
/// lives only in that namespace: the machine's /etc is not changed), with
/// the test module `libnss_gpufencetest.so.2` on LD_LIBRARY_PATH, and a
/// file of [`NSS_ONLY_UID`] left in `shm_dir`. nscd, if one runs, is hidden
/// (an empty directory over /run/nscd) so that glibc asks the modules.
/// `hang`: the module sleeps that many seconds in every call. Returns the
/// findings, stderr and how long the sweep took.
fn sweep_with_nss_module(
    tag: &str,
    hang: Option<u64>,
) -> (Vec<Value>, String, std::time::Duration) {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::process::CommandExt;

    let env = TestEnv::new(tag);
    let lib_dir = env.path("nss");
    std::fs::create_dir_all(&lib_dir).unwrap();
    std::fs::copy(
        workspace_bin("libnss_gpufencetest.so"),
        lib_dir.join("libnss_gpufencetest.so.2"),
    )
    .unwrap();
    let conf = env.path("nsswitch.conf");
    std::fs::write(&conf, "passwd: files gpufencetest\ngroup: files\n").unwrap();
    let empty = env.path("empty");
    std::fs::create_dir_all(&empty).unwrap();
    for d in ["cron", "systemd"] {
        std::fs::create_dir_all(env.path(d)).unwrap();
    }
    let cfg = env.config(&format!(
        "nvml = false\ncron_spool_dir = \"{}\"\nsystemd_system_dir = \"{}\"\n[majors]\nnvidia = 195\n",
        env.path("cron").display(),
        env.path("systemd").display(),
    ));
    // Written by the test (root), owned by the NSS-only uid, held by no
    // process: an shm_leftover of that user.
    let left = env.path("shm/nss-leftover");
    std::fs::write(&left, b"x").unwrap();
    std::os::unix::fs::chown(&left, Some(NSS_ONLY_UID), Some(NSS_ONLY_UID)).unwrap();

    let c = |p: &std::path::Path| CString::new(p.as_os_str().as_bytes()).unwrap();
    let (conf_c, empty_c) = (c(&conf), c(&empty));
    let nscd = std::path::Path::new("/run/nscd")
        .is_dir()
        .then(|| c(std::path::Path::new("/run/nscd")));
    let mut cmd = Command::new(workspace_bin("gpufence"));
    cmd.arg("--config")
        .arg(&cfg)
        .args(["sweep", "--json"])
        .env("LD_LIBRARY_PATH", &lib_dir)
        .env_remove("GPUFENCE_NSS_TEST_HANG");
    if let Some(s) = hang {
        cmd.env("GPUFENCE_NSS_TEST_HANG", s.to_string());
    }
    // SAFETY: only async-signal-safe calls (unshare, mount) between fork
    // and exec, on strings made before the fork.
    unsafe {
        cmd.pre_exec(move || {
            let ok = |r: libc::c_int| {
                if r == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            };
            let none = std::ptr::null();
            ok(libc::unshare(libc::CLONE_NEWNS))?;
            // Nothing of this namespace propagates back to the machine's.
            ok(libc::mount(
                c"none".as_ptr(),
                c"/".as_ptr(),
                none,
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ))?;
            ok(libc::mount(
                conf_c.as_ptr(),
                c"/etc/nsswitch.conf".as_ptr(),
                none,
                libc::MS_BIND,
                std::ptr::null(),
            ))?;
            if let Some(n) = &nscd {
                ok(libc::mount(
                    empty_c.as_ptr(),
                    n.as_ptr(),
                    none,
                    libc::MS_BIND,
                    std::ptr::null(),
                ))?;
            }
            Ok(())
        });
    }
    let t0 = std::time::Instant::now();
    let o = cmd.output().unwrap_or_else(|e| {
        panic!(
            "gpufence in a mount namespace with {} over /etc/nsswitch.conf: {e}",
            conf.display()
        )
    });
    let took = t0.elapsed();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    let findings = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}\n{stderr}")))
        .collect();
    (findings, stderr, took)
}

fn nss_leftover(findings: &[Value]) -> &Value {
    findings
        .iter()
        .find(|f| f["kind"] == "shm_leftover" && f["uid"] == NSS_ONLY_UID)
        .unwrap_or_else(|| panic!("no shm_leftover of uid {NSS_ONLY_UID}: {findings:?}"))
}

/// A user only NSS knows (LDAP, SSSD: here the test module) is named in
/// the sweep's findings.
#[test]
fn sweep_names_a_user_only_nss_knows() {
    if !privileged() {
        return;
    }
    let (findings, stderr, _) = sweep_with_nss_module("nss", None);
    let f = nss_leftover(&findings);
    assert_eq!(f["user"], NSS_ONLY_USER, "{f}\n{stderr}");
    assert!(!stderr.contains("NSS did not answer"), "{stderr}");
}

/// An NSS that does not answer (an LDAP server down: the module sleeps a
/// minute in every call) costs the sweep 2 s, not a hang: the finding comes
/// without a name and a note says why.
#[test]
fn sweep_does_not_hang_on_nss() {
    if !privileged() {
        return;
    }
    let (findings, stderr, took) = sweep_with_nss_module("nss-hang", Some(60));
    assert!(took < std::time::Duration::from_secs(40), "{took:?}");
    let f = nss_leftover(&findings);
    assert!(f.get("user").is_none(), "{f}");
    assert!(
        stderr.contains("note: NSS did not answer within 2 s: user names left out"),
        "{stderr}"
    );
}
