//! Holds that `/proc/<pid>/fd` does not show (found in an attack on the
//! first version): a thread with its own descriptor table, a process whose
//! main thread exited, an io_uring registered file (live, here), a mapping
//! whose descriptor was closed (on fixture /proc shapes in `node::scan`'s
//! unit tests: test hosts have no mappable character device). Plus the epilog's answers to a holder that hands its
//! descriptor on while handling SIGTERM, and to one owned by a system account.

use std::collections::BTreeSet;

use gpufence_cgroup::fence::Fence;
use gpufence_model::config::{Config, ConfigOrigin};
use gpufence_model::device::{Access, DevNum, DeviceGrant, DeviceRole};
use gpufence_model::record::{now_rfc3339, JobRecord, RECORD_VERSION};
use gpufence_node::scan::{Scanner, Via};
use gpufence_node::{epilog, fence_ops, Node};
use gpufence_tests::{gone, privileged, HoldableDevice, TestEnv};

fn hold_via(env: &mut TestEnv, dev: &std::path::Path, via: &str) -> Option<i32> {
    let cg = env.cgroup("holders");
    let arg = format!("--via={via}");
    let mut cmd = env.command_in(&cg, gpufence_tests::probe_bin());
    cmd.args(["hold", &arg, dev.to_str().unwrap()]);
    let mut child = cmd.stdout(std::process::Stdio::piped()).spawn().unwrap();
    let pid = child.id() as i32;
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    if line.trim() != "held" {
        let _ = child.kill();
        let _ = child.wait();
        eprintln!("{via}: {}", line.trim());
        return None;
    }
    std::mem::forget(child); // killed with the test's cgroup
    Some(pid)
}

#[test]
fn hidden_holds_are_found() {
    if !privileged() {
        return;
    }
    let mut env = TestEnv::new("hidden");
    let real = HoldableDevice::claim();
    let dev = DevNum::new(real.major, real.minor);
    let node_path = env.mknod("held", real.major, real.minor);
    let want: BTreeSet<DevNum> = [dev].into();
    let mut pids = Vec::new();
    for (via, expect) in [("thread", Via::ThreadFd), ("leader-exit", Via::ThreadFd)] {
        let pid = hold_via(&mut env, &node_path, via).expect(via);
        // The main thread leaves right after saying "held": wait until its
        // table is gone from /proc/<pid>/fd.
        let t0 = std::time::Instant::now();
        while via == "leader-exit"
            && std::fs::read_dir(format!("/proc/{pid}/fd"))
                .map(|d| d.count() > 0)
                .unwrap_or(false)
            && t0.elapsed().as_secs() < 5
        {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        pids.push(pid);
        let h = Scanner::new()
            .holder(pid, &want)
            .unwrap_or_else(|| panic!("{via}: not found"));
        assert!(
            h.fds.iter().any(|f| f.via == expect && f.dev == dev),
            "{via}: {h:?}"
        );
        let plain = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|d| d.count())
            .unwrap_or(0);
        assert!(
            h.fds.iter().all(|f| f.via != Via::Fd),
            "{via}: the main table must not show it ({plain} entries there): {h:?}"
        );
    }
    // io_uring can be disabled by sysctl (kernel.io_uring_disabled); then
    // there is nothing to hide in and nothing to find.
    match hold_via(&mut env, &node_path, "io_uring") {
        Some(pid) => {
            let h = Scanner::new()
                .holder(pid, &want)
                .expect("io_uring registered file found");
            assert!(h.fds.iter().any(|f| f.via == Via::IoUring), "{h:?}");
        }
        None => eprintln!("io_uring unavailable here: registered-file holds cannot exist"),
    }
    // Killing a cgroup kills a process whose main thread exited, too (the
    // own layout's epilog and stale-job cleanup rely on it).
    let cg = format!("{}/holders", env.root);
    env.cg.kill(&cg).unwrap();
    let t0 = std::time::Instant::now();
    let dead = |p: i32| {
        gone(p)
            && std::fs::read_dir(format!("/proc/{p}/task"))
                .map(|d| d.count())
                .unwrap_or(0)
                <= 1
    };
    while !pids.iter().all(|p| dead(*p)) && t0.elapsed().as_secs() < 5 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    for p in pids {
        assert!(
            std::fs::read_dir(format!("/proc/{p}/task"))
                .map(|d| d.count())
                .unwrap_or(0)
                <= 1
                && gone(p),
            "pid {p} survived the cgroup kill"
        );
    }
}

fn node(env: &TestEnv, major: u32) -> Node {
    let p = env.config(&format!(
        "term_grace_ms = 500\n[majors]\nnvidia = 195\nfake-gpu = {major}\n"
    ));
    Node::new(Config::load(&p).unwrap(), ConfigOrigin::File(p)).unwrap()
}

fn record(node: &Node, job: u32, dev: DevNum) {
    node.state
        .write_record(&JobRecord {
            version: RECORD_VERSION,
            job_id: job,
            uid: 0,
            gres_indices: vec![0],
            devices: vec![DeviceGrant {
                path: "/dev/x".into(),
                dev,
                access: Access::RW,
                role: DeviceRole::Gres,
                gres_index: Some(0),
            }],
            created: now_rfc3339(),
            notes: vec![],
            gpu_idle: vec![],
            mig: vec![],
            cuda_visible_devices: vec![],
            saved_compute_modes: Vec::new(),
        })
        .unwrap();
}

/// A holder that, on SIGTERM, hands the descriptor to an accomplice that
/// hides it in a thread: the epilog's next round finds and kills the
/// accomplice too.
#[test]
fn a_descriptor_handed_on_during_sigterm_is_followed() {
    if !privileged() {
        return;
    }
    let mut env = TestEnv::new("handoff");
    let real = HoldableDevice::claim();
    let dev = DevNum::new(real.major, real.minor);
    let node = node(&env, real.major);
    fence_ops::install(&node).unwrap();
    let gpu = env.mknod("gpu", real.major, real.minor);
    let out = env.cgroup("outside");
    let sock = env.path("acc.sock");
    let s = sock.to_str().unwrap().to_string();
    std::fs::set_permissions(
        env.tmp.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let accomplice = env.spawn_user_probe(&out, &["recvfd", &s], "listening");
    // The first holder opens from outside the fenced subtree (where it may).
    let mut cmd = std::process::Command::new("setpriv");
    cmd.args([
        "--reuid",
        gpufence_tests::cluster::TEST_USER,
        "--regid",
        gpufence_tests::cluster::TEST_USER,
        "--init-groups",
        "--",
    ])
    .arg(gpufence_tests::probe_bin())
    .args([
        "hold",
        &format!("--pass-on-term={s}"),
        gpu.to_str().unwrap(),
    ]);
    let first = env.spawn_ready(cmd, "held");
    record(&node, 41, dev);
    let o = epilog::run(&node, 41, None);
    assert!(o.clean(), "{o:?}");
    let pids: Vec<i32> = o.lingering.iter().map(|l| l.pid).collect();
    assert_eq!(pids, vec![first, accomplice], "{o:?}");
    assert!(gone(first) && gone(accomplice));
    assert!(
        o.notes.iter().any(|n| n.starts_with("round 2")),
        "{:?}",
        o.notes
    );
    let _ = Fence::open(&env.bpffs).unwrap();
}

/// A root process holding a job's device (a user handed it a descriptor:
/// dbus keeps passed descriptors) is not killed: evidence, a survivor line,
/// an unclean epilog and a drain reason saying it was spared.
#[test]
fn system_accounts_are_spared_and_the_node_flagged() {
    if !privileged() {
        return;
    }
    let mut env = TestEnv::new("spared");
    let real = HoldableDevice::claim();
    let dev = DevNum::new(real.major, real.minor);
    let node = node(&env, real.major);
    fence_ops::install(&node).unwrap();
    let gpu = env.mknod("gpu", real.major, real.minor);
    let mut cmd = std::process::Command::new(gpufence_tests::probe_bin());
    cmd.args(["hold", gpu.to_str().unwrap()]);
    let daemon = env.spawn_ready(cmd, "held");
    record(&node, 42, dev);
    let o = epilog::run(&node, 42, None);
    assert!(!o.clean());
    assert!(!gone(daemon), "root's process is left alive");
    assert_eq!(o.lingering.len(), 1);
    assert!(
        o.lingering[0]
            .spared
            .as_deref()
            .unwrap()
            .starts_with("system account (uid 0"),
        "{o:?}"
    );
    assert!(o.lingering[0].evidence.is_some());
    let r = o.drain_reason.unwrap();
    assert!(
        r.contains(&format!("pid {daemon}")) && r.contains("spared"),
        "{r}"
    );
}
