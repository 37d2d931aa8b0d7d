//! gpufence in a cgroup namespace (slurmd in a container: Kubernetes-hosted
//! Slurm, `unshare --cgroup`), on the real kernel.
//!
//! In a cgroup namespace `/proc/<pid>/cgroup` and a cgroup2 mount made
//! inside it show paths from the namespace's root, while the fence
//! program walks `bpf_get_current_ancestor_cgroup_id(level)` with levels
//! from the hierarchy's root. The namespaced side of these tests runs in a
//! child: this test binary again, started in the test's own
//! `<root>/ns` cgroup, that unshares a cgroup and a mount namespace there
//! and mounts cgroup2 over the mount point, so that every path it sees is
//! relative to `<root>/ns` (kernel level 2). It installs a fence on
//! `fenced` (`<root>/ns/fenced`), grants through the plugin's API, opens
//! devices from job cgroups and asks `doctor` and `fence status`.
//!
//! Observable: opening a mknod-made node gives ENXIO when the device
//! cgroup allowed it, EPERM when our program denied it.

use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

use gpufence_cgroup::fence::Fence;
use gpufence_cgroup::hierarchy::{level_of, Cgroup2, FORCE_NO_CGROUP_ITER_ENV, ROOT_CGROUP_ID};
use gpufence_cgroup::maps::{CGROUP_GRANTED, PIN_CGROUPS, PIN_LEVELS};
use gpufence_cgroup::{level, sys};
use gpufence_model::config::{Config, ConfigOrigin};
use gpufence_model::device::{Access, DevNum, DeviceGrant, DeviceRole};
use gpufence_model::record::{now_rfc3339, JobRecord, RECORD_VERSION};
use gpufence_node::job::grant::{GrantOutcome, StepRequest};
use gpufence_node::{admin::doctor, host::fence_ops, Node, NodeError};
use gpufence_tests::{privileged, probe_bin, workspace_bin, TestEnv};

const MAJORS: &str = "[majors]\nnvidia = 195\n";
/// Set in the child's environment: the config it uses.
const CHILD_CONFIG: &str = "GPUFENCE_CGNS_CONFIG";
/// Set in the child's environment: the kernel level of its namespace root.
const CHILD_NS_LEVEL: &str = "GPUFENCE_CGNS_NS_LEVEL";

/// The scope of the slurm layout, below `cgroup_root`.
const SCOPE: &str = "fenced/system.slice/slurmstepd.scope";

fn record(job_id: u32, minor: u32) -> JobRecord {
    JobRecord {
        version: RECORD_VERSION,
        job_id,
        uid: 1000,
        gres_indices: vec![0],
        devices: vec![DeviceGrant {
            path: format!("/dev/nvidia{minor}").into(),
            dev: DevNum::new(195, minor),
            access: Access::RW,
            role: DeviceRole::Gres,
            gres_index: Some(0),
        }],
        created: now_rfc3339(),
        notes: vec![],
        user_notes: vec![],
        gpu_idle: vec![],
        mig: vec![],
        cuda_visible_devices: vec![],
        saved_compute_modes: Vec::new(),
        job_map: Vec::new(),
        mps: Vec::new(),
    }
}

/// Outside any cgroup namespace, the kernel's level of a cgroup is its
/// depth below the mount, and the cgroup iterator's walk up names each
/// ancestor by its directory's inode, ending at the root (id 1).
#[test]
fn kernel_levels_are_path_depths_outside_namespaces() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("levels");
    let deep = env.cgroup("a/b/c");
    assert_eq!(env.cg.root_chain().unwrap().as_ref(), &[ROOT_CGROUP_ID]);
    assert_eq!(env.cg.root_level().unwrap(), 0);
    for rel in [
        "",
        env.root.as_str(),
        &env.cgroup("a"),
        &env.cgroup("a/b"),
        &deep,
    ] {
        let dir = std::fs::File::open(env.cg.path(rel)).unwrap();
        let walk = level::ancestors_up(dir.as_fd()).unwrap_or_else(|e| panic!("/{rel}: {e}"));
        assert_eq!(walk[0].level as usize, level_of(rel), "/{rel}: {walk:?}");
        assert_eq!(walk[0].id, dir.metadata().unwrap().ino());
        let ids: Vec<u64> = std::iter::once(ROOT_CGROUP_ID)
            .chain(env.cg.ancestry(rel).into_iter().map(|(_, id)| id))
            .collect();
        assert_eq!(level::chain_by_level(&walk, walk[0].id).unwrap(), ids);
        assert_eq!(env.cg.kernel_level(rel).unwrap(), level_of(rel));
        let anc = env.cg.kernel_ancestry(rel).unwrap();
        assert_eq!(anc.iter().map(|a| a.id).collect::<Vec<_>>(), ids);
        assert!(anc.iter().enumerate().all(|(i, a)| a.level == i));
    }
    // A path leaving the mount has no level.
    assert!(matches!(
        env.cg.kernel_level("../x"),
        Err(gpufence_cgroup::Error::OutsideMount { .. })
    ));
}

/// The test's side: makes `<root>/ns`, the device nodes and the config,
/// runs the namespaced side ([`namespaced_side`]) in a child that enters a
/// cgroup namespace rooted at `<root>/ns`, then checks from outside that
/// the kernel agrees with what the child saw.
#[test]
fn grants_made_inside_a_cgroup_namespace_hold_at_kernel_levels() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("cgns");
    let ns = env.cgroup("ns");
    env.cgroup("ns/fenced");
    env.mknod("nvidia0", 195, 0);
    env.mknod("nvidia1", 195, 1);
    let ns_level = env.cg.kernel_level(&ns).unwrap();
    assert_eq!(ns_level, level_of(&env.root) + 1);
    // cgroup_root as the namespace sees it.
    let cfg = env.config_rooted("fenced", &format!("layout = \"slurm\"\n{MAJORS}"));

    let procs =
        std::ffi::CString::new(env.cg.path(&ns).join("cgroup.procs").as_os_str().as_bytes())
            .unwrap();
    let mount = std::ffi::CString::new(env.cg.mount().as_os_str().as_bytes()).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap());
    child
        .args([
            "--exact",
            "namespaced_side",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_CONFIG, &cfg)
        .env(CHILD_NS_LEVEL, ns_level.to_string());
    // SAFETY: open, write, close, unshare, mount and umount2 are async-signal-safe
    // syscalls; the namespaces are this child's alone.
    unsafe {
        child.pre_exec(move || {
            let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let w = libc::write(fd, b"0".as_ptr().cast(), 1);
            libc::close(fd);
            if w != 1
                || libc::unshare(libc::CLONE_NEWCGROUP | libc::CLONE_NEWNS) != 0
                || libc::mount(
                    c"none".as_ptr(),
                    c"/".as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ) != 0
                // The same filesystem cannot be mounted on its own mount
                // point (EBUSY): the host's view goes first.
                || libc::umount2(mount.as_ptr(), libc::MNT_DETACH) != 0
                || libc::mount(
                    c"none".as_ptr(),
                    mount.as_ptr(),
                    c"cgroup2".as_ptr(),
                    0,
                    std::ptr::null(),
                ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    // Output to a file, not a pipe: processes the child leaves behind
    // when it fails must not hold the test up.
    let log = env.path("namespaced-side.log");
    let f = std::fs::File::create(&log).unwrap();
    child.stdout(f.try_clone().unwrap()).stderr(f);
    let mut running = child.spawn().expect("run the namespaced side");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let status = loop {
        if let Some(st) = running.try_wait().unwrap() {
            break Some(st);
        }
        if std::time::Instant::now() > deadline {
            let _ = running.kill();
            let _ = running.wait();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        status.is_some_and(|s| s.success()),
        "namespaced side failed ({status:?}):\n{text}"
    );
    // Shown with --nocapture: what the child measured.
    println!("{text}");
    assert!(
        text.contains("namespaced side done"),
        "the namespaced side did not run:\n{text}"
    );

    // From outside: the same cgroups, the same verdicts.
    let task = format!("{ns}/{SCOPE}/job_4/step_0/user/task_0");
    let other = format!("{ns}/{SCOPE}/job_5/step_0/user/task_0");
    assert_eq!(env.open_from(&task, &env.path("dev/nvidia0")), "ENXIO");
    assert_eq!(env.open_from(&task, &env.path("dev/nvidia1")), "EPERM");
    assert_eq!(env.open_from(&other, &env.path("dev/nvidia0")), "EPERM");
    let fence = Fence::open(&env.bpffs).unwrap();
    let job = env.cg.id(&format!("{ns}/{SCOPE}/job_4")).unwrap();
    assert!(fence
        .entries()
        .unwrap()
        .iter()
        .any(|g| g.cgroup_id == job && g.job_id == 4));
    let host_cfg = env.config_rooted(
        &format!("{ns}/fenced"),
        &format!("layout = \"slurm\"\n{MAJORS}"),
    );
    let host = Node::new(
        Config::load(&host_cfg).unwrap(),
        ConfigOrigin::File(host_cfg),
    )
    .unwrap();
    let st = fence_ops::status(&host);
    assert_eq!(st.mount_root_level, Some(0));
    assert!(st.installed, "{:?}", st.problems);
    let d = doctor::doctor(&host, None, Some(&task)).unwrap();
    assert_eq!(
        d.kernel_level,
        Some(ns_level + level_of(&task) - level_of(&ns))
    );
    let verdict = |d: &doctor::Doctor, dev: &str| {
        d.devices
            .iter()
            .find(|v| v.device == dev)
            .map(|v| v.verdict.clone())
            .unwrap_or_default()
    };
    assert_eq!(verdict(&d, "195:0"), "allowed", "{:?}", d.devices);
    assert_eq!(verdict(&d, "195:1"), "denied", "{:?}", d.devices);
}

/// Writes entry `{flags, level}` for cgroup `id` and the levels mask
/// straight into the pinned maps: what an earlier gpufence left after
/// granting in a cgroup namespace at the namespace depth.
fn write_as_before(bpffs: &Path, id: u64, flags: u32, level: u32, mask: u32) {
    let cgroups = sys::map_obj_get(&bpffs.join(PIN_CGROUPS)).unwrap();
    let v = [flags.to_ne_bytes(), level.to_ne_bytes()].concat();
    sys::map_update(&cgroups, &id.to_ne_bytes(), &v).unwrap();
    let levels = sys::map_obj_get(&bpffs.join(PIN_LEVELS)).unwrap();
    sys::map_update(&levels, &0u32.to_ne_bytes(), &mask.to_ne_bytes()).unwrap();
}

/// The namespaced side: a no-op unless started by
/// [`grants_made_inside_a_cgroup_namespace_hold_at_kernel_levels`].
#[test]
fn namespaced_side() {
    let Some(cfg) = std::env::var_os(CHILD_CONFIG) else {
        return;
    };
    let ns_level: usize = std::env::var(CHILD_NS_LEVEL).unwrap().parse().unwrap();
    let cfg = std::path::PathBuf::from(cfg);
    let config = Config::load(&cfg).unwrap();
    let dev = config.dev_dir.clone();
    let bpffs = config.bpffs_dir.clone();
    let node = Node::new(config, ConfigOrigin::File(cfg.clone())).unwrap();
    // The mount shows the namespace's root: paths start at <root>/ns.
    assert_eq!(
        node.cg.cgroup_of(std::process::id() as i32).unwrap(),
        "",
        "this process is at its namespace's root"
    );
    assert_ne!(node.cg.id("").unwrap(), ROOT_CGROUP_ID);
    assert_eq!(node.cg, Cgroup2::discover().unwrap());
    let t0 = std::time::Instant::now();
    assert_eq!(node.cg.root_level().unwrap(), ns_level);
    let first = t0.elapsed();
    let t1 = std::time::Instant::now();
    assert_eq!(node.cg.kernel_level("fenced").unwrap(), ns_level + 1);
    println!(
        "the namespace root's kernel level: {first:?} (cgroup iterator), then {:?} (kept)",
        t1.elapsed()
    );

    let report = fence_ops::install(&node).expect("install inside the namespace");
    assert_eq!(report.mount_root_level, ns_level);
    let exec = node.exec_cgroup();
    let exec_level = ns_level + level_of(&exec);

    // As on a Slurm node in a container: slurmstepd in
    // <scope>/job_4/step_0/slurm, the plugin grants job_4.
    let stepd_cg = format!("{SCOPE}/job_4/step_0/slurm");
    let task = format!("{SCOPE}/job_4/step_0/user/task_0");
    let other_task = format!("{SCOPE}/job_5/step_0/user/task_0");
    for c in [&stepd_cg, &task, &other_task] {
        node.cg.create(c).unwrap();
    }
    let job = format!("{SCOPE}/job_4");
    let job_level = ns_level + level_of(&job);
    node.state.write_record(&record(4, 0)).unwrap();
    let mut sleepers = Vec::new();
    let mut sleeper_in = |cg: &str| {
        let mut cmd = Command::new("sleep");
        cmd.arg("1000")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        node.cg.join_at_exec(cg, &mut cmd).unwrap();
        let c = cmd.spawn().unwrap();
        let pid = c.id() as i32;
        sleepers.push(c);
        pid
    };
    let stepd = sleeper_in(&stepd_cg);
    let req = StepRequest {
        job_id: 4,
        step_id: 0,
        uid: 1000,
        stepd_pid: stepd,
    };
    let out = gpufence_tests::grant_step(&node, &req).expect("grant inside the namespace");
    assert!(
        matches!(&out, GrantOutcome::Granted { cgroup_path, .. } if *cgroup_path == job),
        "{out:?}"
    );
    let fence = Fence::open(&bpffs).unwrap();
    assert_eq!(
        fence.levels_mask().unwrap(),
        1 << job_level | 1 << exec_level,
        "job_4 at kernel level {job_level} (namespace depth {}), the exec cgroup at {exec_level}",
        level_of(&job)
    );
    let audit = gpufence_tests::audit_log(&node.cfg.audit_log);
    assert!(
        audit.iter().any(|e| e["event"] == "grant_applied"
            && e["job_id"] == 4
            && e["cgroup_level"] == job_level),
        "{audit:?}"
    );

    let open_from = |cg: &str, dev_name: &str| -> String {
        let mut cmd = Command::new(probe_bin());
        cmd.args(["open", dev.join(dev_name).to_str().unwrap()]);
        node.cg.join_at_exec(cg, &mut cmd).unwrap();
        let o = cmd.output().unwrap();
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .next()
            .and_then(|l| l.rsplit(' ').next())
            .unwrap_or("no output")
            .to_string()
    };
    let task_pid = sleeper_in(&task);
    let verdicts = |pid: i32| -> Vec<(String, String)> {
        let d = doctor::doctor(&node, Some(pid), None).unwrap();
        assert_eq!(d.kernel_level, Some(ns_level + level_of(&task)));
        assert_eq!(d.mount_root_level, Some(ns_level));
        d.devices
            .iter()
            .filter(|v| v.device == "195:0" || v.device == "195:1")
            .map(|v| (v.device.clone(), format!("{}: {}", v.verdict, v.why)))
            .collect()
    };
    // doctor's verdict is the real open's.
    let agree = |pid: i32, cg: &str| {
        for (device, v) in verdicts(pid) {
            let name = if device == "195:0" {
                "nvidia0"
            } else {
                "nvidia1"
            };
            let real = open_from(cg, name);
            let want = if real == "ENXIO" { "allowed" } else { "denied" };
            assert!(
                v.starts_with(want),
                "doctor says {v:?} for {device} from /{cg}, the open says {real}"
            );
        }
    };
    assert_eq!(open_from(&task, "nvidia0"), "ENXIO", "its own GPU");
    assert_eq!(open_from(&task, "nvidia1"), "EPERM", "another GPU");
    assert_eq!(open_from(&other_task, "nvidia0"), "EPERM", "job 5: none");
    agree(task_pid, &task);
    let other_pid = sleeper_in(&other_task);
    agree(other_pid, &other_task);
    let st = fence_ops::status(&node);
    assert!(st.installed, "{:?}", st.problems);
    assert_eq!(st.mount_root_level, Some(ns_level));
    let o = Command::new(workspace_bin("gpufence"))
        .arg("--config")
        .arg(&cfg)
        .args(["fence", "status"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{text}");
    assert!(
        text.contains(&format!(
            "cgroup namespace: paths here start {ns_level} level(s) below the hierarchy's root"
        )),
        "{text}"
    );

    // What an earlier gpufence left: job_4 recorded at its namespace
    // depth. The kernel denies the job its own GPU; doctor and status say
    // so (they follow the program, not the cgroup id); install corrects it.
    let job_id = node.cg.id(&job).unwrap();
    write_as_before(
        &bpffs,
        job_id,
        CGROUP_GRANTED,
        level_of(&job) as u32,
        1 << level_of(&job) | 1 << exec_level,
    );
    assert_eq!(
        open_from(&task, "nvidia0"),
        "EPERM",
        "the fault, reproduced"
    );
    agree(task_pid, &task);
    let v = verdicts(task_pid);
    assert!(
        v.iter().any(|(d, v)| d == "195:0"
            && v.contains(&format!(
                "is at kernel level {job_level} but its entry says level {}",
                level_of(&job)
            ))),
        "{v:?}"
    );
    let st = fence_ops::status(&node);
    assert!(!st.installed);
    assert!(
        st.problems.iter().any(|p| p.contains(&format!(
            "is recorded at level {}, but the kernel has it at level {job_level}",
            level_of(&job)
        ))),
        "{:?}",
        st.problems
    );
    assert!(
        st.problems
            .iter()
            .any(|p| p.contains("job 4's grant of 195:0") && p.contains("has no effect")),
        "{:?}",
        st.problems
    );
    let report = fence_ops::install(&node).unwrap();
    assert_eq!(
        report.relevelled,
        vec![(job.clone(), job_id, level_of(&job) as u32, job_level)]
    );
    assert_eq!(open_from(&task, "nvidia0"), "ENXIO", "corrected");
    agree(task_pid, &task);
    let st = fence_ops::status(&node);
    assert!(st.installed, "{:?}", st.problems);

    // Without a way to read the kernel's level here, nothing is granted
    // (the test switch makes the cgroup iterator unavailable).
    // SAFETY: this child runs one test on one thread.
    unsafe { std::env::set_var(FORCE_NO_CGROUP_ITER_ENV, "1") };
    node.state.write_record(&record(5, 1)).unwrap();
    node.cg
        .create(&format!("{SCOPE}/job_5/step_0/slurm"))
        .unwrap();
    let stepd5 = sleeper_in(&format!("{SCOPE}/job_5/step_0/slurm"));
    let e = gpufence_tests::grant_step(
        &node,
        &StepRequest {
            job_id: 5,
            step_id: 0,
            uid: 1000,
            stepd_pid: stepd5,
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            NodeError::Kernel(gpufence_cgroup::Error::KernelLevelUnknown { .. })
        ),
        "{e}"
    );
    assert!(e.to_string().contains("cgroup iterator"), "{e}");
    assert!(fence.entries().unwrap().iter().all(|g| g.job_id != 5));
    assert!(!gpufence_tests::audit_log(&node.cfg.audit_log)
        .iter()
        .any(|e| e["event"] == "grant_applied" && e["job_id"] == 5));
    assert!(matches!(
        fence.grant_in(
            &node.cg,
            node.cg.id(&format!("{SCOPE}/job_5")).unwrap(),
            &format!("{SCOPE}/job_5"),
            5,
            &[(DevNum::new(195, 1), Access::RW)]
        ),
        Err(gpufence_cgroup::Error::KernelLevelUnknown { .. })
    ));
    let e = fence_ops::install(&node).unwrap_err();
    assert!(e.to_string().contains("cgroup iterator"), "{e}");
    let d = doctor::doctor(&node, Some(other_pid), None).unwrap();
    assert!(
        d.devices
            .iter()
            .filter(|v| v.device == "195:0")
            .all(|v| v.verdict == "unknown"),
        "{:?}",
        d.devices
    );
    assert!(!fence_ops::status(&node).installed);
    // SAFETY: as above.
    unsafe { std::env::remove_var(FORCE_NO_CGROUP_ITER_ENV) };

    for mut c in sleepers {
        let _ = c.kill();
        let _ = c.wait();
    }
    println!("namespaced side done");
}
