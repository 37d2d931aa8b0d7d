//! Kernel tests: the real verifier, real cgroups, real device checks.
//! Each test has its own cgroup subtree and bpffs directory (TestEnv).
//! Observable: opening a mknod-made node gives ENXIO when the device cgroup
//! allowed it, EPERM when our program denied it.

use std::collections::BTreeSet;

use gpufence_cgroup::fence::{programs_at, Fence};
use gpufence_model::config::Config;
use gpufence_model::device::{Access, DevNum, DeviceGrant, DeviceRole};
use gpufence_model::record::{now_rfc3339, JobRecord, RECORD_VERSION};
use gpufence_node::job::grant::{self, GrantOutcome, StepRequest};
use gpufence_node::{host::fence_ops, job::epilog, Node, NodeError};
use gpufence_tests::{gone, privileged, TestEnv};

/// Test majors: 195 stands for the GPUs, 241 (unused on the test hosts) for
/// nvidia-uvm; 242 is an unprotected, unused major.
const MAJORS: &str = "[majors]\nnvidia = 195\nnvidia-uvm = 241\n";

fn node(env: &TestEnv, extra: &str) -> Node {
    let p = env.config(extra);
    let cfg = Config::load(&p).expect("config");
    Node::new(cfg, gpufence_model::config::ConfigOrigin::File(p)).expect("node")
}

/// The level of cgroup `path` (root = 0), as the kernel counts it.
fn level(path: &str) -> u32 {
    path.split('/').filter(|s| !s.is_empty()).count() as u32
}

fn record(job_id: u32, uid: u32, devs: &[(u32, u32)]) -> JobRecord {
    JobRecord {
        version: RECORD_VERSION,
        job_id,
        uid,
        gres_indices: vec![0],
        devices: devs
            .iter()
            .map(|(ma, mi)| DeviceGrant {
                path: format!("/dev/x{ma}_{mi}").into(),
                dev: DevNum::new(*ma, *mi),
                access: Access::RW,
                role: DeviceRole::Gres,
                gres_index: Some(0),
            })
            .collect(),
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

#[test]
fn kernel_has_the_ancestor_helper() {
    if !privileged() {
        return;
    }
    gpufence_cgroup::fence::probe_ancestor_helper()
        .expect("this kernel must accept helper 123 in device programs");
}

#[test]
fn granted_job_opens_its_device_and_not_another() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("grant");
    let node = node(&env, MAJORS);
    fence_ops::install(&node).expect("install");
    let n0 = env.mknod("nvidia0", 195, 0);
    let n1 = env.mknod("nvidia1", 195, 1);
    let ctl = env.mknod("nvidiactl", 195, 255);
    let uvm = env.mknod("nvidia-uvm", 241, 0);
    let other = env.mknod("other", 242, 0);
    let job = env.cgroup("job_1");
    let task = env.cgroup("job_1/step_0/user/task_0");
    let outside = env.cgroup("outside");
    let fence = Fence::open(&env.bpffs).unwrap();
    let id = env.cg.id(&job).unwrap();
    fence
        .grant(
            id,
            &job,
            1,
            &[
                (DevNum::new(195, 0), Access::RW),
                (DevNum::new(195, 255), Access::RW),
                (DevNum::new(241, 0), Access::RW),
            ],
        )
        .unwrap();

    let exec = node.exec_cgroup();
    assert_eq!(
        fence.levels_mask().unwrap(),
        1 << level(&job) | 1 << level(&exec),
        "the walk visits the job's level and that of the exempt `gpufence exec` cgroup only"
    );
    for cg in [&job, &task] {
        assert_eq!(env.open_from(cg, &n0), "ENXIO", "granted device from /{cg}");
        assert_eq!(env.open_from(cg, &ctl), "ENXIO", "nvidiactl from /{cg}");
        assert_eq!(env.open_from(cg, &uvm), "ENXIO", "uvm from /{cg}");
        assert_eq!(env.open_from(cg, &n1), "EPERM", "other GPU from /{cg}");
    }
    for dev in [&n0, &n1, &ctl, &uvm] {
        assert_eq!(
            env.open_from(&outside, dev),
            "EPERM",
            "{} from outside",
            dev.display()
        );
        assert_eq!(
            env.open_from(&env.root, dev),
            "EPERM",
            "{} from the subtree root",
            dev.display()
        );
    }
    for cg in [&job, &outside] {
        assert_eq!(env.open_from(cg, std::path::Path::new("/dev/null")), "ok");
        assert_eq!(
            env.open_from(cg, &other),
            "ENXIO",
            "unprotected major is untouched"
        );
    }
    // Outside the test subtree the fence does not apply.
    assert_eq!(env.open_from("", &n1), "ENXIO");

    // Revoke: the job loses it.
    let gone = fence.revoke_job(1).unwrap();
    assert_eq!(gone.len(), 3);
    assert_eq!(env.open_from(&task, &n0), "EPERM");
    assert!(fence.entries().unwrap().is_empty());
    assert_eq!(
        fence.cgroup_flags().unwrap(),
        [(
            env.cg.id(&exec).unwrap(),
            gpufence_cgroup::maps::CGROUP_EXEMPT
        )]
        .into(),
        "GRANTED flag cleared; the exec cgroup stays exempt"
    );
    // A revoke does not walk the `cgroups` map to clear the job's level:
    // the bit stays (one lookup more per open at that level, never a
    // skipped grant) until the next install recomputes the mask.
    assert_eq!(
        fence.levels_mask().unwrap(),
        1 << level(&job) | 1 << level(&exec),
        "the job's level stays walked until the next install"
    );
    fence_ops::install(&node).unwrap();
    assert_eq!(
        fence.levels_mask().unwrap(),
        1 << level(&exec),
        "reinstalled: the job's level is no longer walked"
    );
}

#[test]
fn access_bits_and_mknod() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("access");
    let node = node(&env, MAJORS);
    fence_ops::install(&node).unwrap();
    let n0 = env.mknod("nvidia0", 195, 0);
    let blk = env.mknod_type("blk195", libc::S_IFBLK, 195, 0);
    let job = env.cgroup("job_2");
    let fence = Fence::open(&env.bpffs).unwrap();
    fence
        .grant(
            env.cg.id(&job).unwrap(),
            &job,
            2,
            &[(DevNum::new(195, 0), Access::READ)],
        )
        .unwrap();
    assert_eq!(env.open_mode_from(&job, &n0, true), "ENXIO", "read granted");
    assert_eq!(
        env.open_mode_from(&job, &n0, false),
        "EPERM",
        "write not granted"
    );
    let target = env.path("dev/made");
    let lines = env.probe_in(&job, &["mknod", target.to_str().unwrap(), "195", "0"]);
    assert_eq!(
        lines,
        vec![format!("{} EPERM", target.display())],
        "mknod is never granted"
    );
    let lines = env.probe_in(&job, &["mknod", target.to_str().unwrap(), "242", "0"]);
    assert_eq!(
        lines,
        vec![format!("{} ok", target.display())],
        "mknod of unprotected majors is untouched"
    );
    // A block device with a protected number is not an NVIDIA device.
    assert_eq!(env.open_from(&job, &blk), "ENXIO");
}

#[test]
fn exempt_cgroup_and_descendants_open_everything() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("exempt");
    let exempt = env.cgroup("system.slice/nvidia-persistenced.service");
    let child = env.cgroup("system.slice/nvidia-persistenced.service/sub");
    let sibling = env.cgroup("system.slice/other.service");
    let node = node(&env, &format!("exempt_cgroups = [\"{exempt}\"]\n{MAJORS}"));
    let r = fence_ops::install(&node).unwrap();
    let exec = node.exec_cgroup();
    let applied: Vec<&str> = r.exempt_applied.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(applied, vec![exempt.as_str(), exec.as_str()]);
    let n1 = env.mknod("nvidia1", 195, 1);
    let uvm = env.mknod("nvidia-uvm-tools", 241, 1);
    for cg in [&exempt, &child] {
        assert_eq!(env.open_from(cg, &n1), "ENXIO");
        assert_eq!(env.open_from(cg, &uvm), "ENXIO");
    }
    assert_eq!(env.open_from(&sibling, &n1), "EPERM");
    let fence = Fence::open(&env.bpffs).unwrap();
    assert_eq!(
        fence.levels_mask().unwrap(),
        1 << level(&exempt) | 1 << level(&exec)
    );
    // A grant one level deeper adds its level; the exempt one stays.
    let job = env.cgroup("system.slice/other.service/job_9");
    fence
        .grant(
            env.cg.id(&job).unwrap(),
            &job,
            9,
            &[(DevNum::new(195, 1), Access::RW)],
        )
        .unwrap();
    assert_eq!(
        fence.levels_mask().unwrap(),
        1 << level(&exempt) | 1 << level(&job) | 1 << level(&exec)
    );
    assert_eq!(env.open_from(&job, &n1), "ENXIO");
    fence.revoke_job(9).unwrap();
    // Dropping it from the config and reinstalling removes the exemption.
    let node = self::node(&env, MAJORS);
    fence_ops::install(&node).unwrap();
    assert_eq!(env.open_from(&child, &n1), "EPERM");
    assert_eq!(fence.levels_mask().unwrap(), 1 << level(&exec));
}

/// Opens `dev` from cgroup `cg` as real uid `uid` (setpriv, numeric ids:
/// no account needed): `ENXIO` allowed, `EPERM` denied.
fn open_as(env: &TestEnv, cg: &str, uid: u32, dev: &std::path::Path) -> String {
    let o = env
        .command_in(cg, "setpriv")
        .args([
            format!("--reuid={uid}"),
            format!("--regid={uid}"),
            "--clear-groups".into(),
        ])
        .arg(gpufence_tests::probe_bin())
        .args(["open", dev.to_str().unwrap()])
        .output()
        .expect("setpriv probe");
    let out = String::from_utf8_lossy(&o.stdout);
    out.split_whitespace().last().unwrap_or("").to_string()
}

/// Issue 33, point 2: an exemption is a cgroup and its users, never a uid
/// range. In slurmd's cgroup (a bare entry: root only) a uid-600 process
/// (an old RHEL site's user whose `~/.profile` slurmd ran for `sbatch
/// --get-user-env`) is denied, though 600 is below `protected_uid_max`;
/// root is allowed. A service account named in its own entry (by name,
/// through `passwd_file`) is allowed there and denied in slurmd's cgroup;
/// a name that does not resolve covers no one. The userspace rule
/// (`exempt_entry_for`, the doctor) says the same.
/// A reinstall whose identity classes change (two entries swap class
/// indices) never lets the running program read an entry's new index
/// against its own classes: before the swap, the changed entries cover no
/// one (root included), an unchanged one (slurmd's, class 0) keeps
/// working; after it, each covers its own users (review finding 3).
#[test]
fn a_reinstall_that_changes_classes_lends_no_entry_anothers_users() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("exempt-swap");
    let slurmd = env.cgroup("system.slice/slurmd.service");
    let a = env.cgroup("system.slice/a.service");
    let b = env.cgroup("system.slice/b.service");
    let cfg = |first: &str, second: &str| {
        format!("exempt_cgroups = [\"{slurmd}\", {first}, {second}]\n{MAJORS}")
    };
    let ea = format!("{{ cgroup = \"{a}\", users = [61501] }}");
    let eb = format!("{{ cgroup = \"{b}\", users = [61502] }}");
    let n0 = env.mknod("nvidia0", 195, 0);
    let node_a = node(&env, &cfg(&ea, &eb));
    fence_ops::install(&node_a).unwrap();
    let row = || {
        [
            open_as(&env, &a, 61501, &n0),
            open_as(&env, &a, 61502, &n0),
            open_as(&env, &b, 61502, &n0),
            open_as(&env, &b, 61501, &n0),
            open_as(&env, &a, 0, &n0),
            open_as(&env, &slurmd, 0, &n0),
        ]
    };
    let own = ["ENXIO", "EPERM", "ENXIO", "EPERM", "EPERM", "ENXIO"].map(String::from);
    assert_eq!(row(), own, "installed: each entry its own users");
    // The same entries, the other order: their classes swap indices.
    let node_b = node(&env, &cfg(&eb, &ea));
    let spec_b = fence_ops::spec(&node_b).unwrap();
    let fence = Fence::open(&node_b.cfg.bpffs_dir).unwrap();
    fence.stage_exempt(&node_b.cg, &spec_b.exempt).unwrap();
    assert_eq!(
        row(),
        ["EPERM", "EPERM", "EPERM", "EPERM", "EPERM", "ENXIO"].map(String::from),
        "staged under the old program: the changed entries cover no one, slurmd's stays"
    );
    fence_ops::install(&node_b).unwrap();
    assert_eq!(row(), own, "reinstalled: each entry its own users again");
}

#[test]
fn an_exemption_covers_its_own_users_only() {
    if !privileged() {
        return;
    }
    let mut env = TestEnv::new("exempt-users");
    let slurmd = env.cgroup("system.slice/slurmd.service");
    let svc = env.cgroup("system.slice/nvidia-persistenced.service");
    let ghost = env.cgroup("system.slice/ghost.service");
    let passwd = env.path("passwd");
    std::fs::write(
        &passwd,
        "gf-test-svc:x:61500:61500::/nonexistent:/usr/sbin/nologin\n",
    )
    .unwrap();
    let node = node(
        &env,
        &format!(
            "passwd_file = \"{}\"\nexempt_cgroups = [\"{slurmd}\", \
             {{ cgroup = \"{svc}\", users = [\"gf-test-svc\", 0] }}, \
             {{ cgroup = \"{ghost}\", users = [\"gf-test-no-such-user\"] }}]\n{MAJORS}",
            passwd.display()
        ),
    );
    fence_ops::install(&node).unwrap();
    // The name that does not resolve is audited (its cgroup exists).
    let installed = gpufence_tests::audit_log(&node.cfg.audit_log)
        .into_iter()
        .rfind(|e| e["event"] == "fence_installed")
        .unwrap();
    assert_eq!(
        installed["exempt_unknown_users"],
        serde_json::json!([{"cgroup": format!("/{ghost}"), "user": "gf-test-no-such-user"}]),
        "{installed}"
    );
    let n0 = env.mknod("nvidia0", 195, 0);
    let n1 = env.mknod("nvidia1", 195, 1);
    for dev in [&n0, &n1] {
        assert_eq!(open_as(&env, &slurmd, 0, dev), "ENXIO", "root in slurmd's");
        assert_eq!(
            open_as(&env, &slurmd, 600, dev),
            "EPERM",
            "uid 600 in slurmd's"
        );
        assert_eq!(
            open_as(&env, &slurmd, 61500, dev),
            "EPERM",
            "service in slurmd's"
        );
        assert_eq!(
            open_as(&env, &svc, 61500, dev),
            "ENXIO",
            "service in its own"
        );
        assert_eq!(
            open_as(&env, &svc, 0, dev),
            "ENXIO",
            "root in the service's"
        );
        assert_eq!(
            open_as(&env, &svc, 600, dev),
            "EPERM",
            "uid 600 in the service's"
        );
        assert_eq!(
            open_as(&env, &ghost, 0, dev),
            "EPERM",
            "an unresolved entry"
        );
    }
    // The userspace rule agrees.
    let resolve = fence_ops::exempt_resolver(&node);
    for (cg, uid, want) in [
        (&slurmd, 0, true),
        (&slurmd, 600, false),
        (&slurmd, 61500, false),
        (&svc, 61500, true),
        (&svc, 600, false),
        (&ghost, 0, false),
    ] {
        assert_eq!(
            node.cfg.exempt_entry_for(cg, uid, &resolve).is_some(),
            want,
            "{cg} uid {uid}"
        );
    }
    // The doctor says why, for a uid-600 process in slurmd's cgroup.
    let mut cmd = env.command_in(&slurmd, "setpriv");
    cmd.args([
        "--reuid=600",
        "--regid=600",
        "--clear-groups",
        "sh",
        "-c",
        "echo ready; exec sleep 1000",
    ]);
    let pid = env.spawn_ready(cmd, "ready");
    let d = gpufence_node::admin::doctor::doctor(&node, Some(pid), None).unwrap();
    let v = d.devices.iter().find(|v| v.device == "195:1").unwrap();
    assert_eq!((d.uid, v.verdict.as_str()), (600, "denied"), "{v:?}");
    assert!(
        v.why
            .contains("an exemption covers only its entry's users (0), not uid 600"),
        "{v:?}"
    );
    // The fence records each cgroup's class.
    let fence = Fence::open(&env.bpffs).unwrap();
    let plan = fence_ops::exempt_plan(&node);
    assert_eq!(
        plan.identities.classes,
        vec![[0].into(), [0, 61500].into(), BTreeSet::new()]
    );
    for (cg, class) in [(&slurmd, 0), (&svc, 1), (&ghost, 2)] {
        assert_eq!(
            fence.exempt_class(env.cg.id(cg).unwrap()).unwrap(),
            Some(class),
            "{cg}"
        );
    }
}

#[test]
fn install_twice_is_one_program_and_keeps_grants() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("twice");
    let node = node(&env, MAJORS);
    let first = fence_ops::install(&node).unwrap();
    assert!(!first.replaced_program && !first.reused_maps);
    let job = env.cgroup("job_3");
    let n0 = env.mknod("nvidia0", 195, 0);
    Fence::open(&env.bpffs)
        .unwrap()
        .grant(
            env.cg.id(&job).unwrap(),
            &job,
            3,
            &[(DevNum::new(195, 0), Access::RW)],
        )
        .unwrap();
    let second = fence_ops::install(&node).unwrap();
    assert!(second.replaced_program && second.reused_maps);
    assert_eq!(second.link_id, first.link_id, "same link");
    assert_ne!(second.prog_id, first.prog_id, "program swapped in place");
    let (flags, ids) = programs_at(&env.cg, &env.root).unwrap();
    assert_eq!(
        ids,
        vec![second.prog_id],
        "exactly one program at the root (flags {flags:#x})"
    );
    assert_eq!(
        env.open_from(&job, &n0),
        "ENXIO",
        "grant survived reinstall"
    );
    let st = fence_ops::status(&node);
    assert!(st.installed, "{:?}", st.problems);
    assert_eq!(
        (st.grants, st.protected_majors.clone()),
        (1, vec![195, 241])
    );
}

/// Every `bpf(2)` call hands the kernel a zeroed attr of
/// `sys::ATTR_SIZE` bytes. On 6.6+ `BPF_PROG_QUERY` writes the query's
/// `revision` 56 bytes in, past the 32-byte query struct gpufence reads
/// (before, that write landed on the caller's stack); nothing lands past
/// the attr.
#[test]
fn bpf_query_writes_stay_inside_the_attr() {
    if !privileged() {
        return;
    }
    use std::os::fd::AsFd;
    let env = TestEnv::new("attr-guard");
    let node = node(&env, MAJORS);
    fence_ops::install(&node).unwrap();
    let dir = std::fs::File::open(env.cg.path(&env.root)).unwrap();
    let (revision, guard) = gpufence_cgroup::sys::prog_query_guarded(dir.as_fd()).unwrap();
    assert_eq!(guard, [0xAA; 64], "guard bytes after the attr untouched");
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let (major, minor) = release
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse::<u32>().ok())
        .take(2)
        .fold((0, 0), |(a, _), n| if a == 0 { (n, 0) } else { (a, n) });
    if (major, minor) >= (6, 6) {
        assert!(
            revision >= 1,
            "kernel {release}: the query's revision written at offset {} (a link is attached here)",
            gpufence_cgroup::sys::QUERY_REVISION_OFFSET
        );
    }
}

#[test]
fn driver_reload_rekeys_majors_without_a_gap() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("rekey");
    let node = node(&env, MAJORS);
    fence_ops::install(&node).unwrap();
    let old_uvm = env.mknod("uvm-old", 241, 0);
    let new_uvm = env.mknod("uvm-new", 243, 0);
    let out = env.cgroup("outside");
    assert_eq!(env.open_from(&out, &old_uvm), "EPERM");
    assert_eq!(env.open_from(&out, &new_uvm), "ENXIO");
    let node = self::node(&env, "[majors]\nnvidia = 195\nnvidia-uvm = 243\n");
    fence_ops::install(&node).unwrap();
    assert_eq!(env.open_from(&out, &new_uvm), "EPERM");
    assert_eq!(env.open_from(&out, &old_uvm), "ENXIO");
}

#[test]
fn remove_leaves_nothing_behind() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("remove");
    let node = node(&env, MAJORS);
    fence_ops::install(&node).unwrap();
    let n0 = env.mknod("nvidia0", 195, 0);
    let out = env.cgroup("outside");
    assert_eq!(env.open_from(&out, &n0), "EPERM");
    assert!(fence_ops::remove(&node).unwrap());
    assert!(!env.bpffs.exists(), "bpffs dir removed");
    assert_eq!(
        programs_at(&env.cg, &env.root).unwrap().1,
        Vec::<u32>::new()
    );
    assert_eq!(env.open_from(&out, &n0), "ENXIO");
    assert!(
        !fence_ops::remove(&node).unwrap(),
        "second remove is a no-op"
    );
    let st = fence_ops::status(&node);
    assert!(!st.installed);
    // Audit has installed then removed.
    let audit = std::fs::read_to_string(&node.cfg.audit_log).unwrap();
    let events: Vec<String> = audit
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["event"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(events, vec!["fence_installed", "fence_removed"]);
}

#[test]
fn grants_deeper_than_the_walk_are_refused_and_deep_tasks_still_match() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("deep");
    let node = node(&env, MAJORS);
    fence_ops::install(&node).unwrap();
    let fence = Fence::open(&env.bpffs).unwrap();
    let job = env.cgroup("job_4");
    let deep_rel: String = (0..20)
        .map(|i| format!("d{i}"))
        .collect::<Vec<_>>()
        .join("/");
    let deep = env.cgroup(&format!("job_4/{deep_rel}"));
    let n0 = env.mknod("nvidia0", 195, 0);
    fence
        .grant(
            env.cg.id(&job).unwrap(),
            &job,
            4,
            &[(DevNum::new(195, 0), Access::RW)],
        )
        .unwrap();
    assert_eq!(
        env.open_from(&deep, &n0),
        "ENXIO",
        "task 21 levels down finds the grant at level 2"
    );
    let e = fence
        .grant(
            env.cg.id(&deep).unwrap(),
            &deep,
            5,
            &[(DevNum::new(195, 1), Access::RW)],
        )
        .unwrap_err();
    assert!(matches!(e, gpufence_cgroup::Error::TooDeep { .. }), "{e}");
    assert!(
        fence.entries().unwrap().iter().all(|g| g.job_id == 4),
        "failed grant left nothing"
    );
}

#[test]
fn layout_slurm_finds_job_cgroup_in_a_hand_made_tree() {
    if !privileged() {
        return;
    }
    let mut env = TestEnv::new("slurm");
    let node = node(&env, &format!("layout = \"slurm\"\n{MAJORS}"));
    fence_ops::install(&node).unwrap();
    let base = "system.slice/slurmstepd.scope";
    let stepd_cg = env.cgroup(&format!("{base}/job_42/step_0/slurm"));
    let task = env.cgroup(&format!("{base}/job_42/step_0/user/task_0"));
    let other_task = env.cgroup(&format!("{base}/job_43/step_0/user/task_0"));
    let n0 = env.mknod("nvidia0", 195, 0);
    let n1 = env.mknod("nvidia1", 195, 1);
    node.state
        .write_record(&record(42, 1000, &[(195, 0)]))
        .unwrap();
    let stepd = env.spawn_sleeper(&stepd_cg);
    let req = StepRequest {
        job_id: 42,
        step_id: 0,
        uid: 1000,
        stepd_pid: stepd,
    };
    let out = gpufence_tests::grant_step(&node, &req).unwrap();
    let want_cg = format!("{}/{base}/job_42", env.root);
    assert!(
        matches!(&out, GrantOutcome::Granted { cgroup_path, devices: 1, .. } if *cgroup_path == want_cg),
        "{out:?}"
    );
    assert_eq!(env.open_from(&task, &n0), "ENXIO");
    assert_eq!(env.open_from(&task, &n1), "EPERM");
    assert_eq!(
        env.open_from(&other_task, &n0),
        "EPERM",
        "job 43 does not get job 42's GPU"
    );

    // A record for another uid is refused (stale record of a reused job id).
    let e = gpufence_tests::grant_step(
        &node,
        &StepRequest {
            uid: 1001,
            ..req.clone()
        },
    )
    .unwrap_err();
    assert!(matches!(e, NodeError::RecordMismatch { .. }), "{e}");
    // A slurmstepd without a job_<id> ancestor cannot be placed.
    let lost = env.cgroup("system.slice/slurmd.service");
    let stray = env.spawn_sleeper(&lost);
    let e = grant::place(
        &node,
        &StepRequest {
            stepd_pid: stray,
            ..req.clone()
        },
    )
    .unwrap_err();
    assert!(matches!(e, NodeError::NoJobCgroup { .. }), "{e}");
}

#[test]
fn an_exempt_ancestor_of_a_job_cgroup_refuses_the_step() {
    if !privileged() {
        return;
    }
    let mut env = TestEnv::new("exemptup");
    let base = "system.slice/slurmstepd.scope";
    let stepd_cg = env.cgroup(&format!("{base}/job_7/step_0/slurm"));
    let scope = format!("{}/{base}", env.root);
    // Slurm's scope named as exempt: every job below it would be exempt.
    let exempting = node(
        &env,
        &format!("layout = \"slurm\"\nexempt_cgroups = [\"{scope}\"]\n{MAJORS}"),
    );
    fence_ops::install(&exempting).unwrap();
    exempting
        .state
        .write_record(&record(7, 1000, &[(195, 0)]))
        .unwrap();
    let stepd = env.spawn_sleeper(&stepd_cg);
    let req = StepRequest {
        job_id: 7,
        step_id: 0,
        uid: 1000,
        stepd_pid: stepd,
    };
    let e = grant::place(&exempting, &req).unwrap_err();
    assert!(
        matches!(&e, NodeError::ExemptAncestor { .. })
            && e.to_string()
                .contains(&format!("below the exempt cgroup /{scope}"))
            && e.to_string().contains("remove"),
        "{e}"
    );
    // Without that exemption the same step is placed.
    let plain = node(
        &env,
        &format!("layout = \"slurm\"\nexempt_cgroups = []\n{MAJORS}"),
    );
    fence_ops::install(&plain).unwrap();
    grant::place(&plain, &req).unwrap();
}

#[test]
fn layout_own_moves_slurmstepd_into_its_job_cgroup() {
    if !privileged() {
        return;
    }
    let mut env = TestEnv::new("own");
    let node = node(&env, &format!("layout = \"own\"\n{MAJORS}"));
    fence_ops::install(&node).unwrap();
    let slurmd = env.cgroup("slurmd");
    let stepd = env.spawn_sleeper(&slurmd);
    node.state.write_record(&record(7, 0, &[(195, 0)])).unwrap();
    let req = StepRequest {
        job_id: 7,
        step_id: 0xffff_fffb,
        uid: 0,
        stepd_pid: stepd,
    };
    gpufence_tests::grant_step(&node, &req).unwrap();
    let job = format!("{}/job_7", env.root);
    assert_eq!(
        env.cg.cgroup_of(stepd).unwrap(),
        format!("{job}/step_batch")
    );
    let n0 = env.mknod("nvidia0", 195, 0);
    assert_eq!(env.open_from(&format!("{job}/step_batch"), &n0), "ENXIO");
    assert_eq!(env.open_from(&slurmd, &n0), "EPERM");
    // No record: placed, but nothing granted.
    let stepd2 = env.spawn_sleeper(&slurmd);
    let out = gpufence_tests::grant_step(
        &node,
        &StepRequest {
            job_id: 8,
            stepd_pid: stepd2,
            ..req
        },
    )
    .unwrap();
    assert_eq!(out, GrantOutcome::NoRecord);
    assert_eq!(
        env.open_from(&format!("{}/job_8/step_batch", env.root), &n0),
        "EPERM"
    );
    // Epilog of job 7 removes its cgroup, killing the stand-in slurmstepd.
    let o = epilog::run(&node, 7, None);
    assert!(o.clean(), "{:?}", o.errors);
    assert!(!env.cg.path(&job).exists());
    assert!(std::fs::read_dir(node.state.jobs_dir())
        .unwrap()
        .next()
        .is_none());
}

#[test]
fn no_fence_means_no_placement() {
    if !privileged() {
        return;
    }
    let mut env = TestEnv::new("nofence");
    let node = node(&env, &format!("layout = \"own\"\n{MAJORS}"));
    let slurmd = env.cgroup("slurmd");
    let stepd = env.spawn_sleeper(&slurmd);
    let e = grant::place(
        &node,
        &StepRequest {
            job_id: 9,
            step_id: 0,
            uid: 0,
            stepd_pid: stepd,
        },
    )
    .unwrap_err();
    assert!(matches!(e, NodeError::FenceMissing { .. }), "{e}");
    assert!(e.to_string().contains("gpufence fence install"), "{e}");
}

/// A descriptor opened inside the job and handed to a process outside over
/// a unix socket keeps working (the check runs at open only); the epilog
/// finds the holder by st_rdev, keeps evidence and kills it, and leaves a
/// process of another job with a live grant on the same device alone.
#[test]
fn epilog_kills_a_holder_outside_the_job_and_spares_granted_ones() {
    if !privileged() {
        return;
    }
    let mut env = TestEnv::new("epilog");
    // A real misc device nothing else holds, on a node in our temp dir,
    // its major protected in our subtree only.
    let held = gpufence_tests::HoldableDevice::claim();
    let (ma, mi) = (held.major, held.minor);
    let node = node(&env, &format!("[majors]\nnvidia = 195\nfake-gpu = {ma}\n"));
    fence_ops::install(&node).unwrap();
    let gpu = env.mknod("nvidia7", ma, mi);
    let job = env.cgroup("job_11");
    let other_job = env.cgroup("job_12");
    let outside = env.cgroup("outside");
    let fence = Fence::open(&env.bpffs).unwrap();
    for (j, cg) in [(11, &job), (12, &other_job)] {
        fence
            .grant(
                env.cg.id(cg).unwrap(),
                cg,
                j,
                &[(DevNum::new(ma, mi), Access::RW)],
            )
            .unwrap();
    }
    node.state
        .write_record(&record(11, 0, &[(ma, mi)]))
        .unwrap();
    assert_eq!(env.open_from(&outside, &gpu), "EPERM");
    // The receiver runs as the test user: its socket goes in a directory it may write.
    let sock_dir = env.path("sockets");
    std::fs::create_dir_all(&sock_dir).unwrap();
    std::fs::set_permissions(
        &sock_dir,
        std::os::unix::fs::PermissionsExt::from_mode(0o1777),
    )
    .unwrap();
    let sock = sock_dir.join("hand.sock");
    let s = sock.to_str().unwrap().to_string();
    let receiver = env.spawn_user_probe(&outside, &["recvfd", &s], "listening");
    let lines = env.probe_in(&job, &["sendfd", &s, gpu.to_str().unwrap()]);
    assert_eq!(lines, vec!["sent"]);
    let neighbour = env.spawn_probe(&other_job, &["hold", gpu.to_str().unwrap()], "held");
    // wait until the receiver really holds it
    let want: BTreeSet<DevNum> = [DevNum::new(ma, mi)].into();
    let t0 = std::time::Instant::now();
    while gpufence_node::holders::scan::holder(receiver, &want).is_none()
        && t0.elapsed().as_secs() < 5
    {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }

    let out = epilog::run(&node, 11, None);
    assert!(out.clean(), "{:?}", out.errors);
    assert_eq!(out.revoked.len(), 1);
    assert_eq!(out.lingering.len(), 1, "{:?}", out.lingering);
    let l = &out.lingering[0];
    assert_eq!((l.pid, l.gone()), (receiver, true));
    assert!(gone(receiver));
    assert!(!gone(neighbour), "job 12's process holds its own grant");
    let ev_path = l.evidence.clone().expect("evidence written");
    let md = std::fs::metadata(&ev_path).unwrap();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&md.permissions()) & 0o777,
        0o600
    );
    let ev: serde_json::Value = serde_json::from_slice(&std::fs::read(&ev_path).unwrap()).unwrap();
    assert_eq!(ev["pid"], receiver);
    assert_eq!(ev["job_id"], 11);
    assert_eq!(ev["fds"][0]["dev"]["minor"], mi);
    assert_eq!(ev["cgroup"], format!("/{outside}"));
    assert_eq!(ev["cmdline"][1], "recvfd");
    assert_eq!(ev["exe_sha256"].as_str().unwrap().len(), 64);
    assert!(ev["start_time"].is_string() && ev["ppid"].is_number());
    assert_eq!(ev["uid"], gpufence_tests::cluster::test_uid());
    let audit = std::fs::read_to_string(&node.cfg.audit_log).unwrap();
    let events: Vec<serde_json::Value> = audit
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let names: Vec<&str> = events
        .iter()
        .map(|e| e["event"].as_str().unwrap())
        .collect();
    assert!(
        names.ends_with(&["grant_revoked", "lingering_process", "process_killed"]),
        "{names:?}"
    );
    assert_eq!(events.last().unwrap()["pid"], receiver);
    // Job 12 still has its grant; job 11 none.
    let left = fence.entries().unwrap();
    assert_eq!(left.iter().map(|g| g.job_id).collect::<Vec<_>>(), vec![12]);
    // Running the epilog again (or for a job without a record) is fine.
    assert!(epilog::run(&node, 11, None).clean());
    assert!(epilog::run(&node, 999, None).clean());
}

/// Every denied open is recorded: who (cgroup, uid, pid, comm), what
/// (device), how often, when; `gpufence denials` resolves names.
#[test]
fn denials_are_recorded() {
    if !privileged() {
        return;
    }
    let mut env = TestEnv::new("denials");
    let node = node(&env, MAJORS);
    fence_ops::install(&node).unwrap();
    let n1 = env.mknod("nvidia1", 195, 1);
    let out = env.cgroup("outside");
    for _ in 0..3 {
        assert_eq!(env.open_from(&out, &n1), "EPERM");
    }
    let _ = env.spawn_user_probe(
        &out,
        &["open", n1.to_str().unwrap()],
        &format!("{} EPERM", n1.display()),
    );
    let d = gpufence_node::host::denials::list(&node).unwrap();
    let uid = gpufence_tests::cluster::test_uid();
    let by_uid = |u: u32| {
        d.iter()
            .find(|x| x.uid == u)
            .unwrap_or_else(|| panic!("no record for uid {u}: {d:?}"))
    };
    let root = by_uid(0);
    assert_eq!(
        (root.count, root.device.as_str(), root.cgroup.as_deref()),
        (3, "195:1", Some(out.as_str()))
    );
    assert_eq!(root.last_comm, "gpufence-probe");
    let user = by_uid(uid);
    assert_eq!(
        (user.count, user.user.as_deref()),
        (1, Some(gpufence_tests::cluster::TEST_USER))
    );
    let t = chrono::DateTime::parse_from_rfc3339(&user.last_time).unwrap();
    assert!(
        (chrono::Utc::now() - t.with_timezone(&chrono::Utc))
            .num_seconds()
            .abs()
            < 30,
        "{}",
        user.last_time
    );
    // Allowed and unprotected opens leave no record.
    let job = env.cgroup("job_1");
    Fence::open(&env.bpffs)
        .unwrap()
        .grant(
            env.cg.id(&job).unwrap(),
            &job,
            1,
            &[(DevNum::new(195, 1), Access::RW)],
        )
        .unwrap();
    assert_eq!(env.open_from(&job, &n1), "ENXIO");
    assert_eq!(env.open_from(&out, std::path::Path::new("/dev/null")), "ok");
    assert_eq!(gpufence_node::host::denials::list(&node).unwrap().len(), 2);
}

/// Audit mode records what it would deny and allows it; switching to
/// enforce replaces the program atomically: under a loop of opens by an
/// outsider, no open succeeds after the switch returns.
#[test]
fn audit_mode_then_enforce_without_a_gap() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("audit");
    let audit = node(&env, &format!("mode = \"audit\"\n{MAJORS}"));
    let r = fence_ops::install(&audit).unwrap();
    let n0 = env.mknod("nvidia0", 195, 0);
    let out = env.cgroup("outside");
    assert_eq!(env.open_from(&out, &n0), "ENXIO", "audit mode allows");
    let d = gpufence_node::host::denials::list(&audit).unwrap();
    assert_eq!(
        (d.len(), d[0].count, d[0].device.as_str()),
        (1, 1, "195:0"),
        "and records: {d:?}"
    );

    // An outsider opens in a tight loop and reports each result with a
    // monotonic timestamp; the switch happens in the middle.
    let log = env.path("loop.log");
    let script = format!(
        // the timestamp is taken before the open starts
        "while :; do t=$(date +%s%N); r=$({} open {}); echo \"$t $r\"; done > {}",
        gpufence_tests::probe_bin().display(),
        n0.display(),
        log.display()
    );
    let mut looper = env
        .command_in(&out, "sh")
        .arg("-c")
        .arg(&script)
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let enforce = node(&env, MAJORS);
    let r2 = fence_ops::install(&enforce).unwrap();
    let switched = chrono::Utc::now().timestamp_nanos_opt().unwrap();
    assert!(
        r2.replaced_program && r2.link_id == r.link_id,
        "same link, program swapped"
    );
    std::thread::sleep(std::time::Duration::from_millis(300));
    let _ = looper.kill();
    let _ = looper.wait();
    let _ = env.cg.kill(&out);
    let text = std::fs::read_to_string(&log).unwrap();
    let (mut before, mut after) = (0, 0);
    for line in text.lines() {
        let mut it = line.split_whitespace();
        let (Some(ts), Some(_path), Some(verdict)) = (it.next(), it.next(), it.next()) else {
            continue;
        };
        let ts: i64 = ts.parse().unwrap();
        if ts > switched {
            assert_eq!(
                verdict, "EPERM",
                "an open after the switch returned succeeded: {line}"
            );
            after += 1;
        } else if verdict == "ENXIO" {
            before += 1;
        }
    }
    assert!(
        before > 0 && after > 0,
        "the loop ran on both sides of the switch ({before} before, {after} after)"
    );
}

/// A program the verifier refuses comes back with its errno and the
/// verifier's own reason (the load is retried with the log on), which the
/// fence puts into the admin's error.
#[test]
fn a_refused_program_carries_the_verifier_log() {
    if !privileged() {
        return;
    }
    use gpufence_cgroup::asm::{Asm, Reg};
    use gpufence_cgroup::sys;
    let mut ok = Asm::new();
    ok.mov64_imm(Reg::R0, 1).exit();
    assert!(sys::prog_load_cgroup_device(&ok.assemble().unwrap().insns, "ok").is_ok());
    // R0 never written: "R0 !read_ok" (kernel/bpf/verifier.c).
    let mut bad = Asm::new();
    bad.exit();
    let e = sys::prog_load_cgroup_device(&bad.assemble().unwrap().insns, "bad").unwrap_err();
    assert_eq!(e.errno.raw_os_error(), Some(libc::EACCES), "{e:?}");
    assert!(e.log.contains("R0 !read_ok"), "{}", e.log);
}

/// `Fence::entries` reads the `grants` map in batches
/// (`BPF_MAP_LOOKUP_BATCH`, 4,096 per call): 10,000 grants come back
/// each once, with their values, across the batches; and a revoke of one
/// job among them removes exactly its entries.
#[test]
fn grants_are_read_whole_in_batches() {
    if !privileged() {
        return;
    }
    use gpufence_cgroup::maps::{GrantKey, GrantValue, GrantsMap};
    let env = TestEnv::new("batch");
    let node = node(&env, MAJORS);
    fence_ops::install(&node).expect("install");
    let fence = Fence::open(&env.bpffs).unwrap();
    let grants = Fence::open_map::<GrantsMap>(&env.bpffs).unwrap();
    let mut want = Vec::new();
    for i in 0..10_000u64 {
        let key = GrantKey::new((1 << 40) + i, DevNum::new(195, (i % 8) as u32));
        let value = GrantValue::new(Access::RW, 500_000 + (i / 100) as u32);
        grants.update(&key, &value).unwrap();
        want.push((value.job_id, key.cgroup_id, key.dev()));
    }
    want.sort();
    let got: Vec<(u32, u64, DevNum)> = fence
        .entries()
        .unwrap()
        .iter()
        .map(|e| (e.job_id, e.cgroup_id, e.dev))
        .collect();
    assert_eq!(got.len(), 10_000);
    assert_eq!(got, want);
    let gone = fence.revoke_job(500_042).unwrap();
    assert_eq!(gone.len(), 100);
    assert!(gone.iter().all(|e| e.job_id == 500_042));
    assert_eq!(fence.entries().unwrap().len(), 9_900);
}

/// A map pinned where the fence keeps its maps, with another layout than
/// this version's (what an older or newer gpufence might have left: here a
/// `grants` map with 12-byte values, then a `majors` array of another
/// capacity, which the program relies on), is refused: the install fails
/// with one line naming the pin and saying to run `gpufence fence remove`
/// then `gpufence fence install`, leaves that pin as it was and attaches
/// nothing; after a remove, the install succeeds.
#[test]
fn a_map_pinned_with_another_layout_is_refused() {
    if !privileged() {
        return;
    }
    use gpufence_cgroup::maps::{
        GrantKey, GrantValue, MAJORS_ENTRIES, MAP_TYPE_ARRAY, MAP_TYPE_HASH, PIN_GRANTS, PIN_LINK,
        PIN_MAJORS,
    };
    use gpufence_cgroup::sys;
    use std::os::fd::AsFd;
    let env = TestEnv::new("layout");
    let node = node(&env, MAJORS);
    std::fs::create_dir_all(&env.bpffs).unwrap();
    let check_refused = |pin_name: &str, found: &str| {
        let pin = env.bpffs.join(pin_name);
        let e = fence_ops::install(&node).expect_err("a map of another layout must be refused");
        let msg = e.to_string();
        assert!(
            matches!(
                e,
                NodeError::Kernel(gpufence_cgroup::Error::MapMismatch { .. })
            ),
            "{e:?}"
        );
        assert!(!msg.contains('\n'), "one line: {msg}");
        assert!(msg.contains(&pin.display().to_string()), "{msg}");
        assert!(msg.contains(found), "{msg}");
        let remove = msg.find("gpufence fence remove").expect(&msg);
        let install = msg.find("gpufence fence install").expect(&msg);
        assert!(remove < install, "remove, then install: {msg}");
        let info = sys::map_info(sys::obj_get(&pin).unwrap().as_fd()).unwrap();
        assert!(
            format!(
                "type {} key {} value {} max_entries {}",
                info.map_type, info.key_size, info.value_size, info.max_entries
            )
            .contains(found),
            "the pin is left as it was"
        );
        assert!(!env.bpffs.join(PIN_LINK).exists(), "nothing attached");
        assert_eq!(Fence::linked_prog_id(&env.bpffs), None);
    };

    // grants with 12-byte values (this version's: 8).
    let grants = sys::map_create(
        MAP_TYPE_HASH,
        GrantKey::SIZE as u32,
        GrantValue::SIZE as u32 + 4,
        1024,
        "grants",
    )
    .unwrap();
    sys::obj_pin(grants.as_fd(), &env.bpffs.join(PIN_GRANTS)).unwrap();
    check_refused(PIN_GRANTS, "type 1 key 16 value 12");
    std::fs::remove_file(env.bpffs.join(PIN_GRANTS)).unwrap();

    // majors sized for 256 majors (this version's: every major, 4096).
    let majors = sys::map_create(MAP_TYPE_ARRAY, 4, 4, 256, "majors").unwrap();
    sys::obj_pin(majors.as_fd(), &env.bpffs.join(PIN_MAJORS)).unwrap();
    check_refused(PIN_MAJORS, "type 2 key 4 value 4 max_entries 256");
    let e = fence_ops::install(&node).unwrap_err().to_string();
    assert!(
        e.contains(&format!(
            "needs type 2 key 4 value 4 max_entries {MAJORS_ENTRIES}"
        )),
        "{e}"
    );

    // After a remove, the install makes maps of this layout.
    fence_ops::remove(&node).unwrap();
    fence_ops::install(&node).expect("install after remove");
    assert!(Fence::linked_prog_id(&env.bpffs).is_some());
}

/// Issue 25: a pin replaced after the install is checked when it is
/// opened, not only at install. With the fence's `grants` pin replaced by
/// a hash map of 64-byte values holding one entry, `Fence::open` (and the
/// typed open of that one map) fails with the install's one-line layout
/// error naming the pin, what it has, what this version needs and the
/// remedy; the status is not "installed" and says so as a problem; the
/// grants listing fails instead of decoding a row read past its buffer
/// (the reported "job 33686018", 0x02020202); the raw lookup with the
/// fence's 8-byte value buffer is refused before the kernel writes 64
/// bytes into it. The remedy (remove, install) works.
#[test]
fn a_pin_replaced_after_the_install_is_refused_when_opened() {
    if !privileged() {
        return;
    }
    use gpufence_cgroup::maps::{GrantKey, GrantValue, GrantsMap, MAP_TYPE_HASH, PIN_GRANTS};
    use gpufence_cgroup::sys;
    let env = TestEnv::new("repin");
    let node = node(&env, MAJORS);
    fence_ops::install(&node).expect("install");
    assert!(fence_ops::status(&node).installed);

    let pin = env.bpffs.join(PIN_GRANTS);
    std::fs::remove_file(&pin).unwrap();
    let other = sys::map_create(MAP_TYPE_HASH, GrantKey::SIZE as u32, 64, 16, "grants").unwrap();
    sys::map_update(&other, &[1; 16], &[2; 64]).unwrap();
    sys::obj_pin(std::os::fd::AsFd::as_fd(&other), &pin).unwrap();

    let found = "type 1 key 16 value 64 max_entries 16";
    let check = |msg: &str| {
        assert!(!msg.contains('\n'), "one line: {msg}");
        assert!(msg.contains(&pin.display().to_string()), "{msg}");
        assert!(msg.contains(found), "{msg}");
        assert!(msg.contains("needs type 1 key 16 value 8"), "{msg}");
        let remove = msg.find("gpufence fence remove").expect(msg);
        let install = msg.find("gpufence fence install").expect(msg);
        assert!(remove < install, "remove, then install: {msg}");
    };
    let e = Fence::open(&env.bpffs).expect_err("a grants map of another layout");
    assert!(
        matches!(e, gpufence_cgroup::Error::MapMismatch { .. }),
        "{e:?}"
    );
    check(&e.to_string());
    eprintln!("Fence::open: {e}");
    let e = Fence::open_map::<GrantsMap>(&env.bpffs).unwrap_err();
    check(&e.to_string());

    let st = fence_ops::status(&node);
    assert!(!st.installed, "{st:?}");
    assert!(
        st.problems.iter().any(|p| p.contains(found)),
        "{:?}",
        st.problems
    );
    let e = gpufence_node::admin::grants::list(&node).expect_err("no listing of that map");
    assert!(
        matches!(
            e,
            NodeError::Kernel(gpufence_cgroup::Error::MapMismatch { .. })
        ),
        "{e:?}"
    );
    check(&e.to_string());

    // The raw calls take their sizes from the map: the fence's 8-byte
    // value buffer is refused, and nothing is written into it.
    let raw = sys::map_obj_get(&pin).unwrap();
    assert_eq!(raw.shape().value_size, 64);
    let mut v = [0xAAu8; GrantValue::SIZE];
    let e = sys::map_lookup(&raw, &[1; 16], &mut v).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{e}");
    assert_eq!(v, [0xAA; GrantValue::SIZE]);
    let mut v = [0u8; 64];
    assert!(sys::map_lookup(&raw, &[1; 16], &mut v).unwrap());
    assert_eq!(v, [2; 64]);

    // The remedy the message gives.
    fence_ops::remove(&node).unwrap();
    fence_ops::install(&node).expect("install after remove");
    assert!(fence_ops::status(&node).installed);
    assert!(Fence::open(&env.bpffs)
        .unwrap()
        .entries()
        .unwrap()
        .is_empty());
}

/// A tmpfs mounted over a directory of the test's own, lazily unmounted
/// on drop: the step's private `/dev/nvidia-caps-imex-channels`, as
/// Slurm's switch/nvidia_imex mounts it in the step's namespace.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn over(dir: &std::path::Path) -> Tmpfs {
        std::fs::create_dir_all(dir).unwrap();
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=64k,mode=0755", "tmpfs"])
            .arg(dir)
            .status()
            .unwrap()
            .success();
        assert!(ok, "mount tmpfs over {}", dir.display());
        Tmpfs(dir.to_path_buf())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// Slurm's IMEX channels on the real kernel: the job cgroup may `mknod`
/// any channel of the IMEX major (slurmstepd makes the step's channel
/// after the grant), opens none by that; the channel found in the step's
/// own tmpfs is granted to it, read and write, and no other channel, not
/// `channel0`, not a node whose minor is not its name's; outside the job
/// and in another job, neither mknod nor open. The job's revoke takes
/// both.
#[test]
fn imex_channels_mknod_in_jobs_and_exactly_their_channel() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("imex");
    let node = node(
        &env,
        "[majors]\nnvidia = 195\nnvidia-uvm = 241\nnvidia-caps-imex-channels = 120\n",
    );
    fence_ops::install(&node).unwrap();
    let job = env.cgroup("job_3");
    let stepd = env.cgroup("job_3/step_0/slurm");
    let other = env.cgroup("job_4/step_0/slurm");
    let outside = env.cgroup("outside");
    let req = StepRequest {
        job_id: 3,
        step_id: 0,
        uid: 1000,
        stepd_pid: std::process::id() as i32,
    };
    let target = env.path("dev/made");
    std::fs::create_dir_all(env.path("dev")).unwrap();
    let t = target.to_str().unwrap();
    let mknod = |cg: &str, minor: &str| env.probe_in(cg, &["mknod", t, "120", minor]);
    assert_eq!(mknod(&stepd, "5"), vec![format!("{t} EPERM")], "before");
    gpufence_node::job::imex::grant_mknod(&node, &req, &job, 120).unwrap();
    assert_eq!(mknod(&stepd, "5"), vec![format!("{t} ok")]);
    assert_eq!(mknod(&stepd, "1999"), vec![format!("{t} ok")]);
    assert_eq!(mknod(&other, "5"), vec![format!("{t} EPERM")]);
    assert_eq!(mknod(&outside, "5"), vec![format!("{t} EPERM")]);
    // mknod of another major is not in it.
    let lines = env.probe_in(&stepd, &["mknod", t, "195", "0"]);
    assert_eq!(lines, vec![format!("{t} EPERM")]);
    // The step's channel directory: its own tmpfs with the channel Slurm
    // made (minor 5), channel0, a node whose minor is not its name's,
    // and a link.
    let dir = env.path("dev/nvidia-caps-imex-channels");
    let _tmpfs = Tmpfs::over(&dir);
    let mk = |name: &str, minor: u32| {
        let c = std::ffi::CString::new(dir.join(name).to_str().unwrap()).unwrap();
        // SAFETY: mknod(2) with a NUL-terminated path.
        let r =
            unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(120, minor)) };
        assert_eq!(r, 0, "mknod {name}: {}", std::io::Error::last_os_error());
        dir.join(name)
    };
    let ch5 = mk("channel5", 5);
    let ch0 = mk("channel0", 0);
    let liar = mk("channel6", 9);
    std::os::unix::fs::symlink(&ch5, dir.join("channel7")).unwrap();
    assert_eq!(gpufence_node::job::imex::channels(&dir, 120), vec![5]);
    assert_eq!(env.open_from(&stepd, &ch5), "EPERM", "mknod is not open");
    let granted =
        gpufence_node::job::imex::grant_channels_in(&node, &req, &job, 120, &dir).unwrap();
    assert_eq!(granted, vec![5]);
    // Again: nothing new (already held).
    assert!(
        gpufence_node::job::imex::grant_channels_in(&node, &req, &job, 120, &dir)
            .unwrap()
            .is_empty()
    );
    assert_eq!(env.open_from(&stepd, &ch5), "ENXIO");
    assert_eq!(env.open_from(&stepd, &ch0), "EPERM");
    assert_eq!(env.open_from(&stepd, &liar), "EPERM");
    assert_eq!(env.open_from(&other, &ch5), "EPERM");
    assert_eq!(env.open_from(&outside, &ch5), "EPERM");
    // The denials say which access was denied.
    let d = gpufence_node::host::denials::list(&node).unwrap();
    assert!(
        d.iter()
            .any(|x| x.cgroup.as_deref() == Some(outside.as_str())
                && x.device == "120:5"
                && x.access == "m"),
        "{d:#?}"
    );
    assert!(
        d.iter()
            .any(|x| x.cgroup.as_deref() == Some(outside.as_str())
                && x.device == "120:5"
                && x.access == "rw"),
        "{d:#?}"
    );
    let audit = gpufence_tests::audit_log(&node.cfg.audit_log);
    let imex: Vec<&serde_json::Value> = audit
        .iter()
        .filter(|e| e["event"] == "grant_applied" && e["imex"].is_string())
        .collect();
    assert_eq!(imex.len(), 2, "{imex:#?}");
    let fence = Fence::open(&env.bpffs).unwrap();
    let gone = fence.revoke_job(3).unwrap();
    let devs: BTreeSet<String> = gone.iter().map(|e| e.dev.to_string()).collect();
    assert_eq!(devs, ["120:*".to_string(), "120:5".to_string()].into());
    assert_eq!(env.open_from(&stepd, &ch5), "EPERM");
    assert_eq!(mknod(&stepd, "5"), vec![format!("{t} EPERM")]);
}
