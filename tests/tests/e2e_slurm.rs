//! End to end on a real one-node Slurm cluster (Debian 12's slurmctld,
//! slurmd, munged; Slurm 22.05), jobs run as an unprivileged user.
//!
//! GPUs are stand-ins made with mknod in the test's temp dir; their names,
//! minors and GRES order disagree on purpose:
//!
//! ```text
//! GRES index 0: nvidia3      c 195:3    Type=sim
//! GRES index 1: nvidia1      c 195:1    Type=sim
//! GRES index 2: nvidia-held  c 10:M     Type=held  (a real misc device nothing else on
//!                                                  the machine holds, HoldableDevice: it opens
//!                                                  for real, so a job can hold it and hand it out)
//! ```
//!
//! The fence is attached at the test's cgroup subtree (slurmd, its prologs
//! and its slurmstepds live below it); `[majors]` protects 195, 241 (uvm
//! stand-in) and 10 there only. Layout `own` (this host's Slurm uses no
//! cgroup2). One test function runs the scenarios in order on one cluster.

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpufence_tests::cluster::{
    assert_node_clean, end_job, job_grants, job_state, sbatch_as, test_uid, wait_output, Cluster,
    ClusterSpec, PeerUser,
};
use gpufence_tests::out::{both, field, stdout, verdict};
use gpufence_tests::{gone, privileged, probe_bin, HoldableDevice, TestEnv};
use serde_json::Value;

fn audit(env: &TestEnv) -> Vec<Value> {
    gpufence_tests::audit_log(&env.path("log/audit.jsonl"))
}

fn events_for(env: &TestEnv, job: u32) -> Vec<String> {
    audit(env)
        .into_iter()
        .filter(|e| e["job_id"] == job)
        .map(|e| e["event"].as_str().unwrap_or("").to_string())
        .collect()
}

/// Two MIG slices of one GPU, `parent` (device minor `gpu`): GPU
/// instances 1 and 2 with compute instance 0 each. Their caps are
/// `mknod`-made `nvidia-caps` nodes (242:687, 688, 696, 697: the driver's
/// numbering for gpu5, though gpufence takes the numbers from `mig-minors`
/// alone), a fixture `<proc_dir>/driver/nvidia-caps/mig-minors` names
/// them, and gres.conf lists each slice with `MultipleFiles=` as a manual
/// MIG setup writes it.
struct MigSlices {
    /// gi1 access, gi1/ci0 access, gi2 access, gi2/ci0 access.
    caps: Vec<PathBuf>,
    /// The config's `proc_dir` (holds the fixture `mig-minors`).
    proc_dir: PathBuf,
    /// gres.conf's two `Name=gpu Type=mig MultipleFiles=` lines.
    gres: String,
}

impl MigSlices {
    fn make(env: &TestEnv, parent: &Path, gpu: u32) -> MigSlices {
        let caps: Vec<PathBuf> = [687, 688, 696, 697]
            .iter()
            .map(|m| env.mknod(&format!("nvidia-caps/nvidia-cap{m}"), 242, *m))
            .collect();
        let proc_dir = env.path("proc");
        std::fs::create_dir_all(proc_dir.join("driver/nvidia-caps")).unwrap();
        std::fs::write(
            proc_dir.join("driver/nvidia-caps/mig-minors"),
            format!(
                "config 1\nmonitor 2\ngpu{gpu}/gi1/access 687\ngpu{gpu}/gi1/ci0/access 688\n\
                 gpu{gpu}/gi2/access 696\ngpu{gpu}/gi2/ci0/access 697\n"
            ),
        )
        .unwrap();
        let gres = format!(
            "Name=gpu Type=mig MultipleFiles={p},{},{}\nName=gpu Type=mig MultipleFiles={p},{},{}\n",
            caps[0].display(),
            caps[1].display(),
            caps[2].display(),
            caps[3].display(),
            p = parent.display(),
        );
        MigSlices {
            caps,
            proc_dir,
            gres,
        }
    }
}

#[test]
fn real_slurm_cluster_end_to_end() {
    if !privileged() {
        return;
    }
    let mut env = TestEnv::new("e2e");
    let real = HoldableDevice::claim();
    let n3 = env.mknod("nvidia3", 195, 3);
    let n1 = env.mknod("nvidia1", 195, 1);
    let held = env.mknod("nvidia-held", real.major, real.minor);
    // Two MIG slices of one simulated GPU (parent nvidia5).
    let n5 = env.mknod("nvidia5", 195, 5);
    let MigSlices {
        caps,
        proc_dir,
        gres,
    } = MigSlices::make(&env, &n5, 5);
    let gres = format!(
        "Name=gpu Type=sim File={}\nName=gpu Type=sim File={}\nName=gpu Type=held File={}\n{gres}",
        n3.display(),
        n1.display(),
        held.display(),
    );
    let by_index: [PathBuf; 3] = [n3.clone(), n1.clone(), held.clone()];
    // The driver's view through the fake NVML (tests/fake-nvml): the two
    // "sim" GPUs exist for it, idle. Its state file shows compute modes.
    let nvml_dir = env.path("nvml");
    std::fs::create_dir_all(&nvml_dir).unwrap();
    std::fs::set_permissions(
        &nvml_dir,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let nvml_lib = nvml_dir.join("libnvidia-ml.so.1");
    std::fs::copy(gpufence_tests::workspace_bin("libnvidia_ml.so"), &nvml_lib).unwrap();
    std::fs::write(
        nvml_dir.join("nvml-scenario.json"),
        serde_json::json!({"gpus": [
            {"minor": 3, "uuid": "GPU-33333333-0000-0000-0000-000000000003", "idle_used_mib": 400},
            {"minor": 1, "uuid": "GPU-11111111-0000-0000-0000-000000000001", "idle_used_mib": 400}
        ]})
        .to_string(),
    )
    .unwrap();
    let cluster = Cluster::start(
        &env,
        &gres,
        "gpu:sim:2,gpu:held:1,gpu:mig:2",
        &format!(
            "layout = \"own\"\nterm_grace_ms = 1000\nproc_dir = \"{}\"\nnvml_library = \"{}\"\n[majors]\nnvidia = 195\nnvidia-uvm = 241\nnvidia-caps = 242\nfake-held = {}\n",
            proc_dir.display(),
            nvml_lib.display(),
            real.major
        ),
        std::env::var("GPUFENCE_E2E_PORT_BASE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(16917),
    );
    let probe = cluster.bin.join("gpufence-probe");
    let probe_s = probe.to_str().unwrap().to_string();
    let devs = [
        n3.to_str().unwrap(),
        n1.to_str().unwrap(),
        held.to_str().unwrap(),
    ];

    // The plugin installed the fence at slurmd start (slurmd context).
    let st = cluster.gpufence(&["fence", "status", "--json"]);
    let st: Value = serde_json::from_slice(&st.stdout).expect("status JSON");
    assert_eq!(
        st["installed"],
        true,
        "{st}\n{}",
        cluster.log_tail("slurmd.log")
    );
    assert_eq!(st["cgroup_root"], format!("/{}", env.root));
    assert_eq!(
        st["protected_majors"],
        serde_json::json!([10, 195, 241, 242])
    );

    // 1. srun --gres=gpu:sim:1 opens its GPU and not the other.
    let script = format!("echo JOB=$SLURM_JOB_ID; echo GPUS=${{SLURM_STEP_GPUS:-$SLURM_JOB_GPUS}}; {probe_s} open {}", devs.join(" "));
    let o = cluster.as_user("srun", &["--gres=gpu:sim:1", "sh", "-c", &script]);
    let out = stdout(&o);
    assert!(
        o.status.success(),
        "{}\n{}",
        both(&o),
        cluster.log_tail("slurmd.log")
    );
    let job1: u32 = field(&out, "JOB").unwrap().parse().unwrap();
    let idx: usize = field(&out, "GPUS")
        .unwrap()
        .parse()
        .unwrap_or_else(|_| panic!("one GRES index:\n{out}"));
    let (mine, other) = (&by_index[idx], &by_index[1 - idx]);
    assert_eq!(verdict(&out, mine), "ENXIO", "own GPU, index {idx}:\n{out}");
    assert_eq!(verdict(&out, other), "EPERM", "other GPU:\n{out}");
    assert_eq!(
        verdict(&out, &held),
        "EPERM",
        "unallocated held GPU:\n{out}"
    );

    // 2. The same user outside any job opens neither (and root neither).
    let outside = env.cgroup("outside");
    let o = env
        .user_command_in(&outside, &probe)
        .arg("open")
        .args(devs)
        .output()
        .unwrap();
    let out = stdout(&o);
    for d in [&n3, &n1, &held] {
        assert_eq!(
            verdict(&out, d),
            "EPERM",
            "outsider {}:\n{out}",
            d.display()
        );
    }
    assert_eq!(
        env.open_from(&outside, &n3),
        "EPERM",
        "root outside any job"
    );

    // 3. A job that names every GPU in its own environment still gets one.
    //    (user_cmd resets the environment: the variables travel as `env`
    //    arguments, and a marker shows they reached the job.)
    let o = cluster.as_user(
        "env",
        &[
            "CUDA_VISIBLE_DEVICES=0,1",
            "SLURM_JOB_GPUS=0,1",
            "SLURM_STEP_GPUS=0,1",
            "GPUFENCE_SPOOF_MARK=reached",
            "srun",
            "--export=ALL",
            "--gres=gpu:sim:1",
            "sh",
            "-c",
            &format!("echo MARK=$GPUFENCE_SPOOF_MARK; {script}"),
        ],
    );
    let out = stdout(&o);
    assert!(o.status.success(), "{}", both(&o));
    assert_eq!(
        field(&out, "MARK").as_deref(),
        Some("reached"),
        "the spoofed environment reached the job:\n{out}"
    );
    let opened: Vec<_> = [&n3, &n1]
        .into_iter()
        .filter(|d| verdict(&out, d) == "ENXIO")
        .collect();
    assert_eq!(
        opened.len(),
        1,
        "exactly one GPU despite the spoofed environment:\n{out}"
    );
    let job3: u32 = field(&out, "JOB").unwrap().parse().unwrap();

    // 4. After the jobs, `gpufence grants` shows nothing for them, and the
    //    audit log has recorded -> applied -> revoked for each.
    for job in [job1, job3] {
        assert!(
            Cluster::wait_for(Duration::from_secs(20), || events_for(&env, job)
                .contains(&"grant_revoked".into())),
            "epilog of job {job} did not run: {:?}\n{}",
            events_for(&env, job),
            cluster.log_tail("slurmd.log")
        );
        let ev = events_for(&env, job);
        let pos = |n: &str| {
            ev.iter()
                .position(|e| e == n)
                .unwrap_or_else(|| panic!("{n} missing in {ev:?}"))
        };
        assert!(
            pos("grant_recorded") < pos("grant_applied")
                && pos("grant_applied") < pos("grant_revoked"),
            "{ev:?}"
        );
    }
    let g = cluster.gpufence(&["grants", "--json"]);
    let g: Value = serde_json::from_slice(&g.stdout).expect("grants JSON");
    let live: Vec<u64> = g
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["job_id"].as_u64().unwrap())
        .collect();
    assert!(
        !live.contains(&(job1 as u64)) && !live.contains(&(job3 as u64)),
        "{g}"
    );
    assert!(
        !env.cg.path(&format!("{}/job_{job1}", env.root)).exists(),
        "own-layout job cgroup removed"
    );

    // 5. A job without GPUs runs, and opens none.
    let o = cluster.as_user(
        "srun",
        &["sh", "-c", &format!("{probe_s} open {}", devs.join(" "))],
    );
    let out = stdout(&o);
    assert!(o.status.success(), "{}", both(&o));
    for d in [&n3, &n1, &held] {
        assert_eq!(
            verdict(&out, d),
            "EPERM",
            "GPU-less job {}:\n{out}",
            d.display()
        );
    }
    assert!(
        !both(&o).contains("gpufence:"),
        "no message for a job without GPUs: {}",
        both(&o)
    );

    // 6. A batch job gets its GPU in the batch step.
    let out_file = env.path("jobs/batch.out");
    let o = cluster.as_user(
        "sbatch",
        &[
            "--wait",
            "--gres=gpu:held:1",
            "-o",
            out_file.to_str().unwrap(),
            "--wrap",
            &format!("{probe_s} open {}", held.display()),
        ],
    );
    assert!(o.status.success(), "{}", both(&o));
    let out = std::fs::read_to_string(&out_file).unwrap_or_default();
    assert_eq!(
        verdict(&out, &held),
        "ok",
        "batch step opens its (real) device:\n{out}"
    );

    // 7. A job hands its open GPU descriptor to a process outside the job
    //    over a unix socket, then ends: the epilog finds the holder by
    //    st_rdev, writes evidence and audit lines, and kills it.
    let sock = env.path("jobs/handoff.sock");
    let mut recv = env.user_command_in(&outside, &probe);
    recv.arg("recvfd").arg(&sock);
    let receiver = env.spawn_ready(recv, "listening");
    let o = cluster.as_user(
        "srun",
        &[
            "--gres=gpu:held:1",
            "sh",
            "-c",
            &format!(
                "echo JOB=$SLURM_JOB_ID; {probe_s} sendfd {} {}",
                sock.display(),
                held.display()
            ),
        ],
    );
    let out = stdout(&o);
    assert!(o.status.success() && out.contains("sent"), "{}", both(&o));
    let job7: u32 = field(&out, "JOB").unwrap().parse().unwrap();
    assert!(
        Cluster::wait_for(Duration::from_secs(30), || gone(receiver)
            && events_for(&env, job7).contains(&"process_killed".to_string())),
        "the epilog did not kill pid {receiver}: {:?}\n{}",
        events_for(&env, job7),
        cluster.log_tail("slurmd.log")
    );
    let ev: Vec<Value> = audit(&env)
        .into_iter()
        .filter(|e| e["job_id"] == job7)
        .collect();
    let names: Vec<&str> = ev.iter().map(|e| e["event"].as_str().unwrap()).collect();
    assert!(
        names.ends_with(&["grant_revoked", "lingering_process", "process_killed"]),
        "{names:?}"
    );
    let killed = ev.last().unwrap();
    assert_eq!(killed["pid"], receiver);
    assert_eq!(killed["uid"], test_uid());
    assert_eq!(
        killed["devices"],
        serde_json::json!([format!("{}:{}", real.major, real.minor)])
    );
    let evidence: Vec<_> = std::fs::read_dir(env.path("evidence"))
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(&format!("job{job7}-pid{receiver}-"))
        })
        .collect();
    assert_eq!(evidence.len(), 1, "one evidence file");
    let e: Value = serde_json::from_slice(&std::fs::read(evidence[0].path()).unwrap()).unwrap();
    assert_eq!(
        (e["pid"].clone(), e["uid"].clone()),
        (Value::from(receiver), Value::from(test_uid()))
    );
    assert_eq!(e["exe"], probe.display().to_string());
    // Slurm did not drain the node: the epilog exited 0 (the node is clean).
    let mut state = String::new();
    let idle = Cluster::wait_for(Duration::from_secs(20), || {
        state = stdout(&cluster.as_user("sinfo", &["-h", "-o", "%T"]))
            .trim()
            .to_string();
        state == "idle"
    });
    assert!(idle, "node not idle after the epilog: {state}");

    // Nothing of the jobs is left: no grants, no job cgroups, no records.
    let g = cluster.gpufence(&["grants", "--json"]);
    assert_eq!(
        serde_json::from_slice::<Value>(&g.stdout).unwrap(),
        serde_json::json!([])
    );
    let jobs_left: Vec<_> = std::fs::read_dir(env.cg.path(&env.root))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("job_"))
        .collect();
    assert!(jobs_left.is_empty(), "{jobs_left:?}");

    // 7b. Several GPU types in one job: Slurm 22.05's Prolog sees only the
    //     last type in SLURM_JOB_GPUS; gpufence asks slurmctld and grants both.
    let o = cluster.as_user(
        "srun",
        &[
            "--gres=gpu:sim:1,gpu:held:1",
            &probe_s,
            "open",
            devs[0],
            devs[1],
            devs[2],
        ],
    );
    let out = stdout(&o);
    assert!(o.status.success(), "{}", both(&o));
    assert_eq!(
        verdict(&out, &held),
        "ok",
        "the held GPU of a two-type job:\n{out}"
    );
    assert_eq!(
        [verdict(&out, &n3), verdict(&out, &n1)]
            .iter()
            .filter(|v| *v == "ENXIO")
            .count(),
        1,
        "exactly one sim GPU of a two-type job:\n{out}"
    );

    // 7c. A job leaves a daemonised child that ignores SIGTERM and holds its
    //     GPU: the epilog freezes it, keeps evidence, SIGTERM, SIGKILL; the
    //     node stays up.
    let o = cluster.as_user(
        "srun",
        &[
            "--gres=gpu:held:1",
            "sh",
            "-c",
            &format!(
                "echo JOB=$SLURM_JOB_ID; {probe_s} hold --ignore-term --daemon {}",
                held.display()
            ),
        ],
    );
    let out = stdout(&o);
    assert!(o.status.success(), "{}", both(&o));
    let job_d: u32 = field(&out, "JOB").unwrap().parse().unwrap();
    let daemon: i32 = out
        .lines()
        .find_map(|l| l.strip_prefix("held "))
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("daemon pid:\n{}", both(&o)));
    assert!(
        Cluster::wait_for(Duration::from_secs(30), || gone(daemon)
            && events_for(&env, job_d).contains(&"process_killed".to_string())),
        "daemon {daemon} of job {job_d} survived: {:?}",
        events_for(&env, job_d)
    );
    let killed: Vec<Value> = audit(&env)
        .into_iter()
        .filter(|e| e["job_id"] == job_d && e["event"] == "process_killed")
        .collect();
    assert_eq!(killed.len(), 1, "{:?}", events_for(&env, job_d));
    assert_eq!(
        (killed[0]["pid"].clone(), killed[0]["ended_by"].clone()),
        (Value::from(daemon), Value::from("SIGKILL"))
    );
    assert!(
        killed[0]["frozen"].is_string() && killed[0]["evidence"].is_string(),
        "{}",
        killed[0]
    );
    let idle = Cluster::wait_for(Duration::from_secs(20), || {
        state = stdout(&cluster.as_user("sinfo", &["-h", "-o", "%T"]))
            .trim()
            .to_string();
        state == "idle"
    });
    assert!(
        idle,
        "node stays up after killing a TERM-ignoring daemon: {state}"
    );

    // 7d. A GPU held by a stray process before a job starts: the prolog
    //     (policy kill) deals with it and the job gets its GPU.
    // The user's process outside the fenced subtree (where the fence does
    // not apply) opens the device node first.
    let mut stray_cmd = gpufence_tests::as_test_user(&probe);
    stray_cmd.arg("hold").arg(&held);
    let stray = env.spawn_ready(stray_cmd, "held");
    let o = cluster.as_user(
        "srun",
        &[
            "--gres=gpu:held:1",
            "sh",
            "-c",
            &format!("echo JOB=$SLURM_JOB_ID; {probe_s} open {}", held.display()),
        ],
    );
    let out = stdout(&o);
    assert!(o.status.success(), "{}", both(&o));
    assert_eq!(verdict(&out, &held), "ok", "{out}");
    assert!(gone(stray), "the prolog killed the stray {stray}");
    let job_s: u32 = field(&out, "JOB").unwrap().parse().unwrap();
    let pro: Vec<Value> = audit(&env)
        .into_iter()
        .filter(|e| e["job_id"] == job_s && e["phase"] == "prolog")
        .collect();
    assert_eq!(
        pro.iter()
            .map(|e| e["event"].as_str().unwrap())
            .collect::<Vec<_>>(),
        vec!["lingering_process", "process_killed"],
        "{pro:?}"
    );
    assert_eq!(pro[1]["pid"], stray);

    // 7e. A holder that cannot be killed (frozen by the cgroup v1 freezer:
    //     SIGKILL stays pending): the epilog exits non-zero and drains the
    //     node with a reason naming gpufence, the job and the pid.
    let freezer = gpufence_tests::V1Freezer::create(&env);
    let sock2 = env.path("jobs/handoff2.sock");
    let mut recv2 = env.user_command_in(&outside, &probe);
    recv2.arg("recvfd").arg(&sock2);
    let stuck = env.spawn_ready(recv2, "listening");
    freezer.add(stuck);
    let go = env.path("jobs/frozen");
    let job_cmd = format!(
        "echo JOB=$SLURM_JOB_ID; {probe_s} sendfd {} {}; while [ ! -e {} ]; do sleep 0.1; done",
        sock2.display(),
        held.display(),
        go.display()
    );
    let srun = cluster
        .user_cmd("srun")
        .args(["--gres=gpu:held:1", "sh", "-c", &job_cmd])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let want: std::collections::BTreeSet<_> =
        [gpufence_model::device::DevNum::new(real.major, real.minor)].into();
    assert!(
        Cluster::wait_for(Duration::from_secs(20), || {
            gpufence_node::holders::scan::holder(stuck, &want).is_some()
        }),
        "receiver never got the descriptor"
    );
    freezer.freeze();
    std::fs::write(&go, "").unwrap();
    let o = srun.wait_with_output().unwrap();
    let job_u: u32 = field(&stdout(&o), "JOB").unwrap().parse().unwrap();
    let reason_ok = |r: &str| {
        r.contains("gpufence")
            && r.contains(&format!("job {job_u}"))
            && r.contains(&format!("pid {stuck}"))
    };
    let mut reasons = String::new();
    let drained = Cluster::wait_for(Duration::from_secs(30), || {
        reasons = stdout(&cluster.as_user("sinfo", &["-R", "-h", "-o", "%T|%E"]));
        reasons
            .lines()
            .any(|l| l.starts_with("drain") && reason_ok(l))
    });
    // Thaw before asserting, so a failure leaves no frozen process behind.
    freezer.thaw();
    assert!(
        Cluster::wait_for(Duration::from_secs(10), || gone(stuck)),
        "pending SIGKILL ends it once thawed"
    );
    drop(freezer);
    assert!(
        drained,
        "sinfo -R: {reasons}\n{:?}\n{}",
        events_for(&env, job_u),
        cluster.log_tail("slurmctld.log")
    );
    let surv: Vec<Value> = audit(&env)
        .into_iter()
        .filter(|e| e["job_id"] == job_u && e["event"] == "survivor")
        .collect();
    assert_eq!(surv.len(), 1, "{:?}", events_for(&env, job_u));
    // The Epilog recorded its drain (what `resume_when_clean` resumes):
    // the reason as given to scontrol, the job, the device held.
    let rec = gpufence_model::record::StateDir::new(env.path("state"))
        .read_drain(&gpufence_tests::cluster::hostname())
        .unwrap()
        .drain
        .expect("the Epilog's drain recorded");
    assert!(reason_ok(&rec.reason), "{rec:?}");
    assert_eq!(rec.job_id, Some(job_u), "{rec:?}");
    assert!(
        rec.devices
            .contains(&format!("{}:{}", real.major, real.minor)),
        "{rec:?}"
    );
    let admin = |args: &[&str]| {
        std::process::Command::new("env")
            .arg(format!("SLURM_CONF={}", cluster.slurm_conf.display()))
            .args(args)
            .output()
            .unwrap()
    };
    let o = admin(&[
        "scontrol",
        "update",
        &format!("nodename={}", gpufence_tests::cluster::hostname()),
        "state=resume",
    ]);
    assert!(o.status.success(), "{}", both(&o));

    // 7f. Two jobs, each with a MIG slice of the same GPU: each opens the
    //     shared parent and its own slice's caps, never the neighbour's.
    let mig_open = format!(
        "{probe_s} open {} {} {} {} {}",
        n5.display(),
        caps[0].display(),
        caps[1].display(),
        caps[2].display(),
        caps[3].display()
    );
    let a_out = env.path("jobs/mig-a.out");
    let a_go = env.path("jobs/mig-a.go");
    let o = cluster.as_user(
        "sbatch",
        &[
            "--gres=gpu:mig:1",
            "-o",
            a_out.to_str().unwrap(),
            "--wrap",
            &format!(
                "{mig_open}; while [ ! -e {} ]; do sleep 0.1; done",
                a_go.display()
            ),
        ],
    );
    assert!(o.status.success(), "{}", both(&o));
    assert!(
        // Up to a minute: under CI's two test threads on two CPUs the
        // scheduler's next pass alone has taken over 20 s.
        Cluster::wait_for(Duration::from_secs(60), || std::fs::read_to_string(&a_out)
            .unwrap_or_default()
            .lines()
            .count()
            >= 5),
        "job A did not run within 60 s: {}",
        std::fs::read_to_string(&a_out).unwrap_or_default()
    );
    let o = cluster.as_user("srun", &["--gres=gpu:mig:1", "sh", "-c", &mig_open]);
    std::fs::write(&a_go, "").unwrap();
    let b = stdout(&o);
    let a = std::fs::read_to_string(&a_out).unwrap();
    assert!(o.status.success(), "{}", both(&o));
    for out in [&a, &b] {
        assert_eq!(verdict(out, &n5), "ENXIO", "shared parent:\n{out}");
    }
    let pair = |out: &str| -> Vec<String> { caps.iter().map(|c| verdict(out, c)).collect() };
    let (pa, pb) = (pair(&a), pair(&b));
    let slice1 = vec!["ENXIO", "ENXIO", "EPERM", "EPERM"];
    let slice2 = vec!["EPERM", "EPERM", "ENXIO", "ENXIO"];
    assert!(
        (pa == slice1 && pb == slice2) || (pa == slice2 && pb == slice1),
        "each job its own slice only: A {pa:?}, B {pb:?}"
    );

    // 7g. The options users have: --gpu-exclusive (compute mode set for the
    //     job, restored after it) and --gpufence-report[=PATH].
    let o = cluster.as_user("sbatch", &["--help"]);
    let help = both(&o);
    assert!(
        help.contains("--gpu-exclusive") && help.contains("--gpufence-report=PATH"),
        "{help}"
    );
    let state = nvml_dir.join("nvml-state.json");
    let o = cluster.as_user(
        "srun",
        &[
            "--gpu-exclusive",
            "--gres=gpu:sim:1",
            "sh",
            "-c",
            &format!(
                "echo JOB=$SLURM_JOB_ID; echo GPUS=$SLURM_STEP_GPUS; cat {}",
                state.display()
            ),
        ],
    );
    let out = stdout(&o);
    assert!(o.status.success(), "{}", both(&o));
    assert!(
        !both(&o).contains("--gpu-exclusive: "),
        "set, so nothing to say: {}",
        both(&o)
    );
    let idx: usize = field(&out, "GPUS").unwrap().parse().unwrap();
    let minor = [3, 1][idx];
    let mode_of = |text: &str| -> Option<u64> {
        let start = text.find('{')?;
        let v: Value = serde_json::from_str(&text[start..]).ok()?;
        v["compute_mode"][minor.to_string()].as_u64()
    };
    assert_eq!(
        mode_of(&out),
        Some(3),
        "exclusive-process (3) on minor {minor} during the job:\n{out}"
    );
    let job_x: u32 = field(&out, "JOB").unwrap().parse().unwrap();
    assert!(
        Cluster::wait_for(Duration::from_secs(20), || events_for(&env, job_x)
            .contains(&"grant_revoked".into())),
        "{:?}",
        events_for(&env, job_x)
    );
    assert!(
        Cluster::wait_for(Duration::from_secs(10), || std::fs::read_to_string(&state)
            .is_ok_and(|s| mode_of(&s) == Some(0))),
        "mode restored after the job: {}",
        std::fs::read_to_string(&state).unwrap_or_default()
    );
    // A GPU NVML does not know (the MIG parent here): the job runs, and the
    // user reads one line saying the mode was not set, naming the file.
    let o = cluster.as_user("srun", &["--gpu-exclusive", "--gres=gpu:mig:1", "true"]);
    assert!(o.status.success(), "{}", both(&o));
    let lines: Vec<String> = both(&o)
        .lines()
        .filter(|l| l.contains("--gpu-exclusive: "))
        .map(str::to_string)
        .collect();
    assert_eq!(lines.len(), 1, "{}", both(&o));
    assert!(
        lines[0].starts_with("gpufence: job ")
            && lines[0].contains(&format!("{}: not set", n5.display())),
        "{lines:?}"
    );
    // The report, to the default place (the job's working directory) and to a path.
    let o = cluster.as_user(
        "srun",
        &[
            "--gpufence-report",
            "--gres=gpu:sim:1",
            "sh",
            "-c",
            "echo JOB=$SLURM_JOB_ID",
        ],
    );
    assert!(o.status.success(), "{}", both(&o));
    let job_r: u32 = field(&stdout(&o), "JOB").unwrap().parse().unwrap();
    let default_report = env.path(&format!("jobs/gpufence-{job_r}.txt"));
    // The report appears whole (written beside and renamed), then the
    // epilog audits it.
    assert!(
        Cluster::wait_for(Duration::from_secs(20), || events_for(&env, job_r)
            .contains(&"report_written".to_string())),
        "no report at {}: {:?}",
        default_report.display(),
        events_for(&env, job_r)
    );
    let text = std::fs::read_to_string(&default_report).unwrap();
    assert!(
        text.starts_with(&format!("gpufence report for job {job_r}")),
        "{text}"
    );
    assert!(
        text.contains("devices granted:") && text.contains("GPU-seconds:"),
        "{text}"
    );
    let md = std::fs::metadata(&default_report).unwrap();
    assert_eq!(
        std::os::unix::fs::MetadataExt::uid(&md),
        test_uid(),
        "written as the user"
    );
    assert!(
        !cluster.log_tail("slurmd.log").contains("empty path"),
        "a bare --gpufence-report is no error: {}",
        cluster.log_tail("slurmd.log")
    );
    // %j in the path is the job id, as in sbatch --output.
    let pattern = env.path("jobs/my-report-%j.txt");
    let o = cluster.as_user(
        "srun",
        &[
            &format!("--gpufence-report={}", pattern.display()),
            "--gres=gpu:sim:1",
            "sh",
            "-c",
            "echo JOB=$SLURM_JOB_ID",
        ],
    );
    assert!(o.status.success(), "{}", both(&o));
    let job_p: u32 = field(&stdout(&o), "JOB").unwrap().parse().unwrap();
    let mine = env.path(&format!("jobs/my-report-{job_p}.txt"));
    assert!(
        Cluster::wait_for(Duration::from_secs(20), || events_for(&env, job_p)
            .contains(&"report_written".to_string())),
        "no report at {}: {:?}",
        mine.display(),
        events_for(&env, job_p)
    );
    assert!(mine.exists());
    // A path the user may not write is not written (as root it would be).
    let o = cluster.as_user(
        "srun",
        &[
            "--gpufence-report=/etc/gpufence-pwned",
            "--gres=gpu:sim:1",
            "sh",
            "-c",
            "echo JOB=$SLURM_JOB_ID",
        ],
    );
    assert!(o.status.success(), "{}", both(&o));
    let job_f: u32 = field(&stdout(&o), "JOB").unwrap().parse().unwrap();
    assert!(
        Cluster::wait_for(Duration::from_secs(20), || events_for(&env, job_f)
            .contains(&"report_failed".to_string())),
        "the failure is audited: {:?}",
        events_for(&env, job_f)
    );
    assert!(
        !Path::new("/etc/gpufence-pwned").exists(),
        "the report was written as root"
    );
    // A bad value is refused at submission.
    let o = cluster.as_user("srun", &["--gpufence-report=a\nb", "true"]);
    assert!(!o.status.success(), "{}", both(&o));

    // 8. The fence disappears while a job runs: its next step is refused,
    //    and the user reads why, in one line, in the job's output.
    let flag = env.path("jobs/fence-removed");
    let out_file = env.path("jobs/refused.out");
    let batch = format!(
        "#!/bin/sh\nsrun true\necho STEP1_DONE > {ready}\nwhile [ ! -e {flag} ]; do sleep 0.1; done\nsrun {probe_s} open {dev}\necho SRUN_RC=$?\n",
        ready = env.path("jobs/step1").display(),
        flag = flag.display(),
        dev = devs[0],
    );
    let script_path = env.path("jobs/refused.sh");
    std::fs::write(&script_path, batch).unwrap();
    let o = cluster.as_user(
        "sbatch",
        &[
            "--gres=gpu:sim:1",
            "-o",
            out_file.to_str().unwrap(),
            script_path.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", both(&o));
    assert!(
        Cluster::wait_for(Duration::from_secs(20), || env.path("jobs/step1").exists()),
        "first step did not run: {}",
        std::fs::read_to_string(&out_file).unwrap_or_default()
    );
    // A running job holds a grant: removing the fence is refused unless forced.
    let o = cluster.gpufence(&["fence", "remove"]);
    assert_eq!(o.status.code(), Some(2), "{}", both(&o));
    assert!(both(&o).contains("--force"), "{}", both(&o));
    let o = cluster.gpufence(&["fence", "remove", "--force"]);
    assert!(o.status.success(), "{}", both(&o));
    std::fs::write(&flag, "").unwrap();
    assert!(
        Cluster::wait_for(Duration::from_secs(20), || std::fs::read_to_string(
            &out_file
        )
        .unwrap_or_default()
        .contains("SRUN_RC=")),
        "batch job did not finish"
    );
    let all = std::fs::read_to_string(&out_file).unwrap();
    let lines: Vec<&str> = all.lines().filter(|l| l.starts_with("gpufence:")).collect();
    assert_eq!(lines.len(), 1, "one gpufence line for the user:\n{all}");
    assert!(
        lines[0].contains("fence is not installed") && lines[0].contains("gpufence fence install"),
        "{all}"
    );
    assert!(
        !all.contains(&format!("{} ", devs[0])),
        "the task never ran its command:\n{all}"
    );
    assert!(!all.contains("SRUN_RC=0"), "{all}");
    let o = cluster.gpufence(&["fence", "install"]);
    assert!(o.status.success(), "{}", both(&o));

    // 9. A job cannot start on a node without the fence: the prolog fails,
    //    Slurm drains the node; `gpufence fence install` and a resume fix it.
    let o = cluster.gpufence(&["fence", "remove"]);
    assert!(o.status.success(), "{}", both(&o));
    let o = cluster.as_user(
        "srun",
        &[
            "--gres=gpu:sim:1",
            "-J",
            "noprolog",
            &probe_s,
            "open",
            devs[0],
        ],
    );
    let all = both(&o);
    assert!(
        !o.status.success() && all.contains("prolog failed"),
        "{all}"
    );
    assert!(
        !all.contains(&format!("{} ", devs[0])),
        "the task never ran:\n{all}"
    );
    // The failed job's Epilog may still run ("completing") before the
    // node reads drained.
    let mut state = String::new();
    assert!(
        Cluster::wait_for(Duration::from_secs(20), || {
            state = stdout(&cluster.as_user("sinfo", &["-h", "-o", "%T"]))
                .trim()
                .to_string();
            state.starts_with("drain")
        }),
        "node drained: {state}"
    );
    let errors: Vec<Value> = audit(&env)
        .into_iter()
        .filter(|e| e["event"] == "error" && e["component"] == "prolog")
        .collect();
    assert!(
        errors.last().is_some_and(|e| e["error"]
            .as_str()
            .unwrap_or("")
            .contains("gpufence fence install")),
        "{errors:?}"
    );
    // Found by job id like every other line of the job.
    let last = errors.last().unwrap();
    assert!(last["job_id"].is_u64(), "{last}");
    assert_eq!(
        last["job_id"].to_string(),
        last["slurm_job_id"].as_str().unwrap()
    );
    let o = cluster.gpufence(&["fence", "install"]);
    assert!(o.status.success(), "{}", both(&o));
    let _ = admin(&["scancel", "-n", "noprolog"]);
    let o = admin(&[
        "scontrol",
        "update",
        &format!("nodename={}", gpufence_tests::cluster::hostname()),
        "state=resume",
    ]);
    assert!(o.status.success(), "{}", both(&o));
    let o = cluster.as_user(
        "srun",
        &["--gres=gpu:sim:1", &probe_s, "open", devs[0], devs[1]],
    );
    let out = stdout(&o);
    assert!(o.status.success(), "{}", both(&o));
    assert_eq!(
        [verdict(&out, &n3), verdict(&out, &n1)]
            .iter()
            .filter(|v| *v == "ENXIO")
            .count(),
        1,
        "back in service with the fence:\n{out}"
    );
    // What a job leaves in the shared-memory directory: reported once by
    // its Epilog (name, size, mode), by the sweep with its age, removed at
    // job end only when the config says so.
    let shm = env.path("shm");
    let leave = |names: &str| {
        let script = format!(
            "echo JOB=$SLURM_JOB_ID; for n in {names}; do head -c 4096 /dev/zero > {}/$n-$SLURM_JOB_ID; chmod 644 {}/$n-$SLURM_JOB_ID; done",
            shm.display(),
            shm.display()
        );
        let o = cluster.as_user("srun", &["--gres=gpu:sim:1", "sh", "-c", &script]);
        assert!(o.status.success(), "{}", both(&o));
        let job: u32 = field(&stdout(&o), "JOB").expect("JOB=").parse().unwrap();
        let mut line = Value::Null;
        assert!(
            Cluster::wait_for(Duration::from_secs(30), || {
                line = audit(&env)
                    .into_iter()
                    .find(|e| e["event"] == "shm_leftovers" && e["job_id"] == job)
                    .unwrap_or(Value::Null);
                !line.is_null()
            }),
            "no shm_leftovers line for job {job}: {:?}",
            events_for(&env, job)
        );
        (job, line)
    };
    let (job, line) = leave("vllm psm_shm");
    let names: Vec<&str> = line["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [format!("psm_shm-{job}"), format!("vllm-{job}")],
        "{line}"
    );
    assert_eq!(line["files"][0]["size_bytes"], 4096);
    assert_eq!(line["files"][0]["mode"], "0644");
    assert_eq!(line["uid"], test_uid());
    assert_eq!(line["removed"], false);
    assert!(shm.join(format!("vllm-{job}")).exists());
    // The sweep: one JSON finding per line.
    let sw = cluster.gpufence(&["sweep", "--json"]);
    let found: Vec<Value> = String::from_utf8_lossy(&sw.stdout)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("one JSON object per line"))
        .filter(|f| f["kind"] == "shm_leftover")
        .collect();
    // One finding for the user, naming both files, with the oldest's age.
    assert_eq!(found.len(), 1, "{}", both(&sw));
    assert!(
        found
            .iter()
            .all(|f| f["evidence"]["oldest_age_seconds"].is_u64()
                && f["evidence"]["files"] == 2
                && f["evidence"]["bytes"] == 8192
                && f["uid"] == test_uid()),
        "{found:?}"
    );
    assert_eq!(
        found[0]["evidence"]["names"],
        serde_json::json!([format!("psm_shm-{job}"), format!("vllm-{job}")])
    );
    assert_eq!(line["files_total"], 2);
    assert_eq!(line["bytes_total"], 8192);
    // Removal switched on: the next job's leftovers go (the earlier job's,
    // older than this job, are not its own and stay).
    let cfg = env.path("gpufence.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, format!("shm_remove_leftovers = true\n{text}")).unwrap();
    let unreadable = gpufence_tests::unreadable_pids();
    let (job2, line) = leave("nccl");
    assert_eq!(line["files"][0]["name"], format!("nccl-{job2}"), "{line}");
    // A process root cannot read (a sandbox's init) may hold it: kept.
    assert_eq!(
        line["removed"],
        unreadable.is_empty(),
        "{unreadable:?} {line}"
    );
    assert_eq!(
        shm.join(format!("nccl-{job2}")).exists(),
        !unreadable.is_empty()
    );
    assert!(shm.join(format!("vllm-{job}")).exists());
    std::fs::write(&cfg, text).unwrap();

    if let Some(dst) = std::env::var_os("GPUFENCE_E2E_KEEP_AUDIT") {
        let _ = std::fs::copy(env.path("log/audit.jsonl"), dst);
    }
    let _ = probe_bin();
    drop(cluster);
}

/// Issue 34, the Epilog run twice with a MIG slice: before 26.05 slurmd
/// runs job J's Epilog a second time when slurmctld resent
/// TERMINATE_JOB after a lost EPILOG_COMPLETE (SchedMD commit
/// 2090c3af3b, ticket 24874), by then after job K of another user got
/// the same MIG slice. The second run, with the environment slurmd gave
/// the first, writes one line saying J was already ended and exits 0; K
/// keeps its grant, its process (neither stopped, frozen nor killed) and
/// its opens, the node is not drained, and no audit line says J's
/// devices were held.
///
/// The MIG parent is the real, holdable stand-in ([`HoldableDevice`]): this
/// test's `[majors]` names its misc major `nvidia`, so it is the GPU and
/// `mig-minors` names its slices `gpu<minor>/...`, and K's process keeps
/// it open as a CUDA process keeps its `/dev/nvidiaN`. The caps stay
/// `mknod`-made (`ENXIO`: allowed). The node's other slice is taken by a
/// job of the first user for the whole test, so that K gets J's.
#[test]
fn epilog_run_twice_leaves_the_next_tenant_of_a_mig_slice_alone() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("mig-again");
    let real = HoldableDevice::claim();
    let parent = env.mknod(&format!("nvidia{}", real.minor), real.major, real.minor);
    let MigSlices {
        caps,
        proc_dir,
        gres,
    } = MigSlices::make(&env, &parent, real.minor);
    let peer = PeerUser::create(None);
    let cluster = Cluster::start_with(
        &env,
        &ClusterSpec {
            gres_conf: gres,
            node_gres: "gpu:mig:2".into(),
            gpufence_extra: format!(
                "layout = \"own\"\nnvml = false\nterm_grace_ms = 1000\nproc_dir = \"{}\"\n[majors]\nnvidia = {}\nnvidia-caps = 242\n",
                proc_dir.display(),
                real.major
            ),
            port_base: std::env::var("GPUFENCE_E2E_PORT_BASE")
                .ok()
                .and_then(|v| v.parse().ok())
                .map_or(18417, |p: u16| p + 1500),
            cpus: Some(4),
            ..ClusterSpec::default()
        },
    );
    let epilog_env = env.path("epilog-env");
    cluster.keep_epilog_env(&epilog_env);
    let audit = env.path("log/audit.jsonl");
    let probe = cluster.bin.join("gpufence-probe").display().to_string();
    let open_all = format!(
        "{probe} open {} {}",
        parent.display(),
        caps.iter()
            .map(|c| c.display().to_string())
            .collect::<Vec<_>>()
            .join(" ")
    );
    let slice = |out: &str| -> Vec<String> { caps.iter().map(|c| verdict(out, c)).collect() };
    let slices = [
        ["ENXIO", "ENXIO", "EPERM", "EPERM"],
        ["EPERM", "EPERM", "ENXIO", "ENXIO"],
    ];
    let one_slice = |who: &str, out: &str| {
        assert_eq!(
            verdict(out, &parent),
            "ok",
            "{who} opens the parent:\n{out}"
        );
        let s = slice(out);
        assert!(
            slices.iter().any(|w| s == w),
            "{who} opens its own slice's caps only: {s:?}\n{out}"
        );
        s
    };

    // The other slice, taken for the whole test (the first user's job F).
    let (out_f, go_f) = (env.path("jobs/mig-f.out"), env.path("jobs/mig-f.go"));
    let f = sbatch_as(
        cluster.user_cmd("sbatch"),
        &["--gres=gpu:mig:1"],
        &out_f,
        &format!(
            "{open_all}; echo READY; while [ ! -e {} ]; do sleep 0.1; done",
            go_f.display()
        ),
    );
    let slice_f = one_slice("job F", &wait_output(&cluster, &out_f, "READY"));

    // J (the first user) gets the other slice, opens it, ends.
    let o = cluster.as_user(
        "srun",
        &[
            "--gres=gpu:mig:1",
            "sh",
            "-c",
            &format!(
                "echo JOB=$SLURM_JOB_ID; echo GPUS=${{SLURM_STEP_GPUS:-$SLURM_JOB_GPUS}}; {open_all}"
            ),
        ],
    );
    let out_j = stdout(&o);
    assert!(o.status.success(), "{}", both(&o));
    let j: u32 = field(&out_j, "JOB").unwrap().parse().unwrap();
    let slice_j = one_slice("job J", &out_j);
    assert_ne!(slice_j, slice_f, "J and F on one slice");
    let st = gpufence_model::record::StateDir::new(env.path("state"));
    assert!(
        Cluster::wait_for(Duration::from_secs(60), || st.ended_at(j).is_some()
            && job_state(&cluster, j).is_empty()
            && epilog_env.join(format!("{j}.env")).exists()),
        "job {j}'s Epilog did not end it: {:?}\n{}",
        events_for(&env, j),
        cluster.log_tail("slurmd.log")
    );

    // K (another user) gets J's slice and keeps its parent open.
    let (out_k, go_k) = (env.path("jobs/mig-k.out"), env.path("jobs/mig-k.go"));
    let k = sbatch_as(
        peer.cmd(&cluster, "sbatch"),
        &["--gres=gpu:mig:1"],
        &out_k,
        &format!(
            "echo GPUS=$SLURM_JOB_GPUS; {open_all}; {probe} hold {} & echo HOLDER=$!; \
             while [ ! -e {} ]; do sleep 0.1; done; echo AFTER; {open_all}; echo DONE; wait",
            parent.display(),
            go_k.display()
        ),
    );
    let text_k = wait_output(&cluster, &out_k, "held");
    assert_eq!(
        (field(&text_k, "GPUS"), one_slice("job K", &text_k)),
        (field(&out_j, "GPUS"), slice_j.clone()),
        "K got J's slice (F holds the other)"
    );
    let holder: i32 = field(&text_k, "HOLDER").unwrap().parse().unwrap();
    assert_eq!(gpufence_node::host::procs::uid_of(holder), Some(peer.uid));
    let want: std::collections::BTreeSet<_> =
        [gpufence_model::device::DevNum::new(real.major, real.minor)].into();
    let holds = || gpufence_node::holders::scan::holder(holder, &want).is_some();
    assert!(holds(), "K's process {holder} holds the MIG parent");
    let k_grants = job_grants(&cluster, k);
    assert!(k_grants > 0, "job {k} holds a grant");

    // J's Epilog again, as slurmd would run it.
    let before = gpufence_tests::audit_log(&audit).len();
    let o = cluster.replay_epilog(&epilog_env, j);
    assert!(
        o.status.success(),
        "the second Epilog of job {j}: {}",
        both(&o)
    );
    let said: Vec<String> = both(&o).lines().map(str::to_string).collect();
    assert!(
        said.len() == 1 && said[0].contains(&format!("job {j} was already ended at ")),
        "one line: {said:?}"
    );
    let again: Vec<Value> = gpufence_tests::audit_log(&audit)
        .into_iter()
        .skip(before)
        .collect();
    assert_eq!(
        again
            .iter()
            .map(|e| e["event"].as_str().unwrap_or("").to_string())
            .collect::<Vec<_>>(),
        ["epilog_repeated"],
        "{again:?}"
    );
    assert_eq!(again[0]["job_id"], j);
    // K untouched: running, its process alive, holding, neither stopped
    // (SIGSTOP) nor frozen (its cgroup's `frozen 0`), its grant whole.
    assert_eq!(job_state(&cluster, k), "RUNNING");
    let stat = gpufence_model::procstat::ProcStat::of(holder);
    assert!(
        stat.as_ref()
            .is_some_and(|s| !matches!(s.state, 'T' | 't' | 'Z')),
        "K's process {holder}: {stat:?}"
    );
    assert!(holds(), "K's process {holder} still holds the MIG parent");
    let cg = std::fs::read_to_string(format!("/proc/{holder}/cgroup")).unwrap();
    let cg = cg
        .lines()
        .find_map(|l| l.strip_prefix("0::/"))
        .expect("cgroup2 line");
    let events = std::fs::read_to_string(env.cg.path(cg).join("cgroup.events")).unwrap();
    assert!(events.lines().any(|l| l == "frozen 0"), "{cg}: {events}");
    assert_eq!(
        job_grants(&cluster, k),
        k_grants,
        "job {k}'s grant is untouched"
    );
    let state = stdout(&cluster.admin("sinfo", &["-h", "-o", "%T"]));
    assert!(!state.trim().starts_with("drain"), "node drained: {state}");
    // K's processes still open its slice's caps and its GPU.
    std::fs::write(&go_k, "").unwrap();
    let text = wait_output(&cluster, &out_k, "DONE");
    let after = text.split_once("AFTER\n").map_or("", |(_, a)| a);
    assert_eq!(verdict(after, &parent), "ok", "{text}");
    assert_eq!(slice(after), slice_j, "{text}");

    end_job(&cluster, &env, k);
    assert!(gone(holder));
    std::fs::write(&go_f, "").unwrap();
    assert!(
        Cluster::wait_for(Duration::from_secs(60), || job_state(&cluster, f)
            .is_empty()
            && st.ended_at(f).is_some()),
        "job {f} did not end"
    );
    assert_node_clean(&cluster, &[j, k, f], &audit);
}
