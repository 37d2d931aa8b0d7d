//! Hostile input from inside a job, as the job's user (issue 8, item 7).
//! None of it widens a grant: each attempt is refused by the kernel (the
//! fence, file or cgroup permissions), refused by Slurm or the plugin at
//! submission, or ignored (gpufence never reads it); what can only be
//! caught at job end (a descriptor handed outside) is covered by
//! `e2e_slurm.rs` (scenario 7), `kernel.rs`
//! (`epilog_kills_a_holder_outside_the_job_and_spares_granted_ones`) and
//! `holders.rs`. Each assertion below says which way an attempt ends.
//!
//! The cluster is the one of `e2e_slurm.rs` (Debian 12's Slurm 22.05,
//! layout `own`), with two stand-in GPUs made with mknod:
//! GRES index 0 is `nvidia3` (195:3), index 1 `nvidia1` (195:1).

use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpufence_cgroup::fence::Fence;
use gpufence_model::device::{Access, DevNum};
use gpufence_node::host::fence_ops;
use gpufence_tests::cluster::{test_uid, Cluster, TEST_USER};
use gpufence_tests::out::{both, field, stdout, verdict};
use gpufence_tests::{privileged, probe_bin, TestEnv};
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

/// `program` as the test user with `vars` in its environment (besides
/// `SLURM_CONF`). `Cluster::user_cmd` runs `setpriv --reset-env`, which
/// drops whatever `Command::env` sets: the variables must be `env`'s
/// arguments after the reset.
fn user_env_cmd(
    cluster: &Cluster,
    vars: &[(&str, std::ffi::OsString)],
    program: &str,
) -> std::process::Command {
    let mut c = std::process::Command::new("setpriv");
    c.args([
        "--reuid",
        TEST_USER,
        "--regid",
        TEST_USER,
        "--init-groups",
        "--reset-env",
        "--",
        "env",
    ])
    .arg(format!("SLURM_CONF={}", cluster.slurm_conf.display()));
    for (k, v) in vars {
        let mut kv = std::ffi::OsString::from(format!("{k}="));
        kv.push(v);
        c.arg(kv);
    }
    c.arg(program)
        .current_dir(cluster.dir.parent().unwrap().join("jobs"));
    c
}

/// Shell lines that try `cmd` and print `SUBJECT done` or `SUBJECT refused`.
fn attempt(subject: &str, cmd: &str) -> String {
    format!(
        "if ({cmd}) 2>/dev/null; then echo '{subject} done'; else echo '{subject} refused'; fi\n"
    )
}

#[test]
fn hostile_jobs_on_a_real_cluster() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("hostile");
    let n3 = env.mknod("nvidia3", 195, 3);
    let n1 = env.mknod("nvidia1", 195, 1);
    let by_index = [n3.clone(), n1.clone()];
    let gres = format!(
        "Name=gpu Type=sim File={}\nName=gpu Type=sim File={}\n",
        n3.display(),
        n1.display()
    );
    let cluster = Cluster::start(
        &env,
        &gres,
        "gpu:sim:2",
        "layout = \"own\"\nnvml = false\nterm_grace_ms = 1000\n[majors]\nnvidia = 195\nnvidia-uvm = 241\n",
        std::env::var("GPUFENCE_HOSTILE_PORT_BASE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(17317),
    );
    let probe = cluster.bin.join("gpufence-probe");
    let probe_s = probe.display().to_string();
    let gpus = format!("{} {}", n3.display(), n1.display());
    let jobs = env.path("jobs");

    // Job A holds one GPU and waits.
    let a_out = jobs.join("a.out");
    let a_go = jobs.join("a.go");
    let o = cluster.as_user(
        "sbatch",
        &[
            "--gres=gpu:sim:1",
            "-o",
            a_out.to_str().unwrap(),
            "--wrap",
            &format!(
                "echo JOB=$SLURM_JOB_ID; echo GPUS=$SLURM_JOB_GPUS; while [ ! -e {} ]; do sleep 0.1; done",
                a_go.display()
            ),
        ],
    );
    assert!(o.status.success(), "{}", both(&o));
    assert!(
        Cluster::wait_for(Duration::from_secs(20), || {
            field(&std::fs::read_to_string(&a_out).unwrap_or_default(), "GPUS").is_some()
        }),
        "job A did not start: {}\n{}",
        std::fs::read_to_string(&a_out).unwrap_or_default(),
        cluster.log_tail("slurmd.log")
    );
    let a_text = std::fs::read_to_string(&a_out).unwrap();
    let job_a: u32 = field(&a_text, "JOB").unwrap().parse().unwrap();
    let a_idx: usize = field(&a_text, "GPUS").unwrap().parse().unwrap();
    let (a_gpu, b_gpu) = (&by_index[a_idx], &by_index[1 - a_idx]);

    // Job B, the hostile one, with the other GPU. In one step it tries:
    let mount = env.cg.mount().display().to_string();
    let root_cg = format!("{mount}/{}", env.root);
    let outside = env.cgroup("outside");
    let bpffs = env.bpffs.display().to_string();
    let state = env.path("state").display().to_string();
    let mut script = String::from("echo JOB=$SLURM_JOB_ID\n");
    // - job A's GPU (and its own), through the fence;
    script.push_str(&format!("{probe_s} open {gpus}\n"));
    // - the fence's pinned maps and link (bpffs_dir is root's, 0700);
    script.push_str(&format!(
        "{probe_s} objget {bpffs}/grants {bpffs}/cgroups {bpffs}/majors {bpffs}/link\n"
    ));
    // - the state records (its own, job A's, a new one) and the audit log;
    script.push_str(&format!(
        "{probe_s} write {state}/jobs/$SLURM_JOB_ID.json {state}/jobs/{job_a}.json {state}/jobs/4242.json {state}/applied/x.json {log} {ev}\n",
        log = env.path("log/audit.jsonl").display(),
        ev = env.path("evidence/x").display(),
    ));
    // - a cgroup of its own to escape into, or someone else's.
    let own_cg = "$(sed -n 's/^0:://p' /proc/self/cgroup)";
    script.push_str(&attempt(
        "mkdir-in-job",
        &format!("mkdir {mount}{own_cg}/../escape"),
    ));
    script.push_str(&attempt(
        "mkdir-in-root",
        &format!("mkdir {root_cg}/escape"),
    ));
    script.push_str(&attempt(
        "move-outside",
        &format!("echo $$ > {mount}/{outside}/cgroup.procs"),
    ));
    script.push_str(&attempt(
        "move-to-root",
        &format!("echo $$ > {root_cg}/cgroup.procs"),
    ));
    script.push_str(&format!("{probe_s} open {gpus}\n"));
    let o = cluster.as_user("srun", &["--gres=gpu:sim:1", "sh", "-c", &script]);
    let out = stdout(&o);
    assert!(
        o.status.success(),
        "{}\n{}",
        both(&o),
        cluster.log_tail("slurmd.log")
    );
    let job_b: u32 = field(&out, "JOB").unwrap().parse().unwrap();
    let gpu_lines: Vec<&str> = out
        .lines()
        .filter(|l| {
            l.starts_with(&n3.display().to_string()) || l.starts_with(&n1.display().to_string())
        })
        .collect();
    assert_eq!(gpu_lines.len(), 4, "two opens of two GPUs:\n{out}");
    for pass in gpu_lines.chunks(2) {
        let v = |p: &Path| {
            pass.iter()
                .find_map(|l| l.strip_prefix(&format!("{} ", p.display())))
                .unwrap()
        };
        assert_eq!(v(b_gpu), "ENXIO", "B opens its own GPU:\n{out}");
        assert_eq!(v(a_gpu), "EPERM", "B never opens A's GPU (fence):\n{out}");
    }
    for pin in ["grants", "cgroups", "majors", "link"] {
        assert_eq!(
            verdict(&out, format!("{bpffs}/{pin}")),
            "EACCES",
            "pinned {pin} (bpffs_dir 0700):\n{out}"
        );
    }
    assert!(!out.contains(" update "), "no map was opened:\n{out}");
    for f in [
        format!("{state}/jobs/{job_b}.json"),
        format!("{state}/jobs/{job_a}.json"),
        format!("{state}/jobs/4242.json"),
        format!("{state}/applied/x.json"),
        env.path("log/audit.jsonl").display().to_string(),
    ] {
        assert_eq!(
            verdict(&out, &f),
            "EACCES",
            "{f} (root's, 0700/0640):\n{out}"
        );
    }
    // The evidence dir is made when first needed, in a root-only parent.
    let ev = env.path("evidence/x");
    assert!(
        matches!(
            verdict(&out, ev.display().to_string()).as_str(),
            "EACCES" | "errno 2"
        ) && !ev.exists(),
        "{out}"
    );
    assert!(!env.path("state/jobs/4242.json").exists());
    for what in [
        "mkdir-in-job",
        "mkdir-in-root",
        "move-outside",
        "move-to-root",
    ] {
        assert_eq!(
            verdict(&out, what),
            "refused",
            "{what}: cgroups are root's (no delegation to jobs):\n{out}"
        );
    }
    let applied: Vec<Value> = audit(&env)
        .into_iter()
        .filter(|e| e["job_id"] == job_b && e["event"] == "grant_applied")
        .collect();
    assert!(
        !applied.is_empty()
            && applied.iter().all(|e| {
                let d = e["devices"].to_string();
                !d.contains(&format!("195:{}", [3, 1][a_idx]))
            }),
        "B's grants never name A's GPU: {applied:?}"
    );

    // Environment spoofing (the job's environment is never read by gpufence):
    let open_cmd = format!("echo JOB=$SLURM_JOB_ID; {probe_s} open {gpus}");
    let count_open = |out: &str| {
        by_index
            .iter()
            .filter(|p| verdict(out, p.display().to_string()) == "ENXIO")
            .count()
    };
    // - another job's id (its own job A): srun runs a step *in job A*,
    //   which has A's GPU only — Slurm's own semantics, nothing widened;
    let os = |s: &str| std::ffi::OsString::from(s);
    let o = user_env_cmd(
        &cluster,
        &[
            ("SLURM_JOB_ID", os(&job_a.to_string())),
            ("SLURM_JOBID", os(&job_a.to_string())),
            ("SLURM_JOB_GPUS", os("0,1")),
            ("CUDA_VISIBLE_DEVICES", os("0,1")),
        ],
        "srun",
    )
    .args(["--export=ALL", "--overlap", "sh", "-c", &open_cmd])
    .output()
    .unwrap();
    let out = stdout(&o);
    assert!(o.status.success(), "{}", both(&o));
    assert_eq!(field(&out, "JOB"), Some(job_a.to_string()), "{out}");
    assert_eq!(verdict(&out, a_gpu.display().to_string()), "ENXIO", "{out}");
    assert_eq!(verdict(&out, b_gpu.display().to_string()), "EPERM", "{out}");
    // - a job id that does not exist: refused by Slurm, nothing runs;
    let o = user_env_cmd(&cluster, &[("SLURM_JOB_ID", os("999999"))], "srun")
        .args(["--export=ALL", "--gres=gpu:sim:1", "sh", "-c", &open_cmd])
        .output()
        .unwrap();
    assert!(!o.status.success(), "{}", both(&o));
    assert_eq!(count_open(&stdout(&o)), 0, "{}", both(&o));
    // - huge, binary and `..` values in the variables gpufence could be
    //   thought to read: the job gets the one GPU Slurm allocated.
    let huge = "0,1,".repeat(20_000);
    for (k, v) in [
        ("CUDA_VISIBLE_DEVICES", huge.clone().into_bytes()),
        ("SLURM_JOB_GPUS", b"0,1,../../1,\xff\xfe".to_vec()),
        ("SLURM_STEP_GPUS", b"0-1".to_vec()),
        ("GPU_DEVICE_ORDINAL", b"0,1".to_vec()),
        ("SLURM_JOB_UID", b"0".to_vec()),
    ] {
        let o = user_env_cmd(&cluster, &[(k, std::ffi::OsString::from_vec(v))], "srun")
            .args(["--export=ALL", "--gres=gpu:sim:1", "sh", "-c", &open_cmd])
            .output()
            .unwrap();
        assert!(o.status.success(), "{k}: {}", both(&o));
        assert_eq!(
            count_open(&stdout(&o)),
            1,
            "{k}: exactly one GPU:\n{}",
            both(&o)
        );
    }

    // SPANK option values (user input, reaching the Prolog and Epilog):
    // - `..` paths: the report is written as the user, so a path above the
    //   work dir lands where the user may write and nowhere else;
    let escape = "../../../../../../../../etc/gpufence-hostile-report";
    let rel = "../jobs/rel-report.txt";
    for path in [escape, rel] {
        let o = cluster.as_user(
            "srun",
            &[
                &format!("--gpufence-report={path}"),
                "--gres=gpu:sim:1",
                "sh",
                "-c",
                &open_cmd,
            ],
        );
        assert!(o.status.success(), "{path}: {}", both(&o));
        assert_eq!(count_open(&stdout(&o)), 1, "{path}: {}", both(&o));
    }
    assert!(
        Cluster::wait_for(Duration::from_secs(20), || jobs
            .join("rel-report.txt")
            .exists()),
        "the `..` report inside the user's reach is written"
    );
    let md = std::fs::metadata(jobs.join("rel-report.txt")).unwrap();
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&md), test_uid());
    // - a huge value is refused at submission, nothing runs;
    let o = cluster.as_user(
        "srun",
        &[
            &format!("--gpufence-report={}", "x".repeat(5000)),
            "--gres=gpu:sim:1",
            "sh",
            "-c",
            &open_cmd,
        ],
    );
    assert!(!o.status.success(), "{}", both(&o));
    assert_eq!(count_open(&stdout(&o)), 0);
    // - a binary value, and values put straight into the variables Slurm
    //   carries options in (skipping the plugin's check at submission):
    //   the job runs with its one GPU; the Prolog and Epilog ignore values
    //   that do not parse, and write reports as the user only.
    let o = cluster
        .user_cmd("srun")
        .arg(std::ffi::OsString::from_vec(
            b"--gpufence-report=/etc/\xff\xfe-hostile".to_vec(),
        ))
        .args(["--gres=gpu:sim:1", "sh", "-c", &open_cmd])
        .output()
        .unwrap();
    assert!(o.status.success(), "binary value: {}", both(&o));
    assert_eq!(count_open(&stdout(&o)), 1, "{}", both(&o));
    let o = user_env_cmd(
        &cluster,
        &[
            (
                "SLURM_SPANK__SLURM_SPANK_OPTION_gpufence_gpufence_report",
                os("/etc/gpufence-hostile-env"),
            ),
            (
                "SLURM_SPANK__SLURM_SPANK_OPTION_gpufence_gpu_exclusive",
                os("0,1"),
            ),
            (
                "_SLURM_SPANK_OPTION_gpufence_gpufence_report",
                os("/etc/gpufence-hostile-env"),
            ),
        ],
        "srun",
    )
    .args(["--export=ALL", "--gres=gpu:sim:1", "sh", "-c", &open_cmd])
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", both(&o));
    assert_eq!(count_open(&stdout(&o)), 1, "{}", both(&o));

    // Job A ends: its grant is revoked, nothing is left, and none of the
    // above drained the node.
    std::fs::write(&a_go, "").unwrap();
    assert!(
        Cluster::wait_for(Duration::from_secs(30), || events_for(&env, job_a)
            .contains(&"grant_revoked".into())),
        "{:?}\n{}",
        events_for(&env, job_a),
        cluster.log_tail("slurmd.log")
    );
    let mut st = String::new();
    assert!(
        Cluster::wait_for(Duration::from_secs(20), || {
            st = stdout(&cluster.as_user("sinfo", &["-h", "-o", "%T"]))
                .trim()
                .to_string();
            st == "idle"
        }),
        "node state {st}"
    );
    let g = cluster.gpufence(&["grants", "--json"]);
    assert_eq!(
        serde_json::from_slice::<Value>(&g.stdout).unwrap(),
        serde_json::json!([])
    );
    for p in ["/etc/gpufence-hostile-report", "/etc/gpufence-hostile-env"] {
        assert!(!Path::new(p).exists(), "{p} written as root");
    }
    let etc_binary: Vec<PathBuf> = std::fs::read_dir("/etc")
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.to_string_lossy().contains("-hostile"))
        .collect();
    assert!(etc_binary.is_empty(), "{etc_binary:?}");
    let _ = probe_bin();
    drop(cluster);
}

/// Delegation: when the user owns a cgroup subtree (systemd delegates
/// `user@UID.service`; some sites delegate job subtrees), it can make
/// cgroups and move its processes inside that subtree only. Inside a
/// granted job the grant follows (it covers descendants), no wider; a
/// move out of the job needs the common ancestor's `cgroup.procs`, which
/// is root's: refused. A cgroup the user makes and names like a granted
/// job is a different cgroup (grants are keyed by id): nothing opens.
#[test]
fn delegated_cgroups_stay_inside_the_grant() {
    if !privileged() {
        return;
    }
    let mut env = TestEnv::new("delegate");
    let cfg = env.config("[majors]\nnvidia = 195\nnvidia-uvm = 241\n");
    let node = gpufence_node::Node::new(
        gpufence_model::config::Config::load(&cfg).unwrap(),
        gpufence_model::config::ConfigOrigin::File(cfg.clone()),
    )
    .unwrap();
    fence_ops::install(&node).expect("install");
    let n0 = env.mknod("nvidia0", 195, 0);
    let n1 = env.mknod("nvidia1", 195, 1);
    let job = env.cgroup("job_1");
    let inside = env.cgroup("job_1/deleg");
    let mine = env.cgroup("user-deleg");
    Fence::open(&env.bpffs)
        .unwrap()
        .grant(
            env.cg.id(&job).unwrap(),
            &job,
            1,
            &[(DevNum::new(195, 0), Access::RW)],
        )
        .unwrap();
    // Delegate both subtrees to the user, as systemd does (Delegate=yes):
    // the directory and its cgroup.procs, subtree_control and threads.
    let uid = test_uid();
    for cg in [&inside, &mine] {
        let d = env.cg.path(cg);
        for p in [
            d.clone(),
            d.join("cgroup.procs"),
            d.join("cgroup.subtree_control"),
            d.join("cgroup.threads"),
        ] {
            std::os::unix::fs::chown(&p, Some(uid), Some(uid)).unwrap();
        }
    }
    let probe = probe_bin().display().to_string();
    let (m, i, o) = (
        env.cg.mount().display().to_string(),
        inside.clone(),
        mine.clone(),
    );
    let script = format!(
        "{a}{b}{probe} open {n0} {n1}\n{c}{d}{probe} open {n0} {n1}\n",
        a = attempt("mkdir-sub", &format!("mkdir {m}/{i}/sub")),
        b = attempt("move-sub", &format!("echo $$ > {m}/{i}/sub/cgroup.procs")),
        c = attempt("move-out", &format!("echo $$ > {m}/{o}/cgroup.procs")),
        d = attempt("mkdir-lookalike", &format!("mkdir -p {m}/{o}/job_1")),
        n0 = n0.display(),
        n1 = n1.display(),
    );
    let out = env
        .user_command_in(&inside, "sh")
        .args(["-c", &script])
        .output()
        .unwrap();
    let text = stdout(&out);
    assert_eq!(verdict(&text, "mkdir-sub"), "done", "{text}");
    assert_eq!(verdict(&text, "move-sub"), "done", "{text}");
    assert_eq!(
        verdict(&text, "move-out"),
        "refused",
        "leaving the job needs root's cgroup.procs:\n{text}"
    );
    assert_eq!(verdict(&text, "mkdir-lookalike"), "done", "{text}");
    let n0s = n0.display().to_string();
    let n1s = n1.display().to_string();
    let opens: Vec<(&str, &str)> = text
        .lines()
        .filter_map(|l| {
            l.strip_prefix(&format!("{n0s} "))
                .map(|v| ("n0", v))
                .or_else(|| l.strip_prefix(&format!("{n1s} ")).map(|v| ("n1", v)))
        })
        .collect();
    assert_eq!(
        opens,
        vec![
            ("n0", "ENXIO"),
            ("n1", "EPERM"),
            ("n0", "ENXIO"),
            ("n1", "EPERM")
        ],
        "in a sub-cgroup of the job: its grant, no more:\n{text}"
    );
    // From the user's own delegated subtree (outside the job), even in a
    // cgroup named job_1: nothing opens.
    let lookalike = format!("{mine}/job_1");
    let pid = env.spawn_user_sleeper(&mine);
    std::fs::write(
        env.cg.path(&lookalike).join("cgroup.procs"),
        pid.to_string(),
    )
    .expect("root moves the user's sleeper (the test's own)");
    for (dev, name) in [(&n0, "n0"), (&n1, "n1")] {
        let o = env
            .user_command_in(&lookalike, probe_bin())
            .arg("open")
            .arg(dev)
            .output()
            .unwrap();
        assert!(
            stdout(&o).trim().ends_with("EPERM"),
            "{name} from /{lookalike}: {}",
            stdout(&o)
        );
    }
    // The grant is where it was, on job_1's id alone.
    let entries = Fence::open(&env.bpffs).unwrap().entries().unwrap();
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0].cgroup_id, env.cg.id(&job).unwrap());
}

/// A job hands its GPU descriptor to a process of *another* job (which
/// has a grant, for another device): the kernel cannot stop it (the check
/// runs at open), the receiver cannot open the device itself, and the
/// first job's epilog finds the holder in the other job's cgroup by
/// `st_rdev` and kills it — a grant covers only its own devices — while
/// the other job's own processes go on.
#[test]
fn a_descriptor_handed_to_another_job_is_caught_at_job_end() {
    if !privileged() {
        return;
    }
    let mut env = TestEnv::new("handjob");
    let held = gpufence_tests::HoldableDevice::claim();
    let (ma, mi) = (held.major, held.minor);
    let cfg = env.config(&format!(
        "[majors]\nnvidia = 195\nfake-gpu = {ma}\nnvidia-uvm = 241\n"
    ));
    let node = gpufence_node::Node::new(
        gpufence_model::config::Config::load(&cfg).unwrap(),
        gpufence_model::config::ConfigOrigin::File(cfg.clone()),
    )
    .unwrap();
    fence_ops::install(&node).expect("install");
    let x = env.mknod("nvidia-x", ma, mi);
    let job_a = env.cgroup("job_21");
    let job_b = env.cgroup("job_22");
    let fence = Fence::open(&env.bpffs).unwrap();
    for (j, cg, dev) in [
        (21, &job_a, DevNum::new(ma, mi)),
        (22, &job_b, DevNum::new(195, 0)),
    ] {
        fence
            .grant(env.cg.id(cg).unwrap(), cg, j, &[(dev, Access::RW)])
            .unwrap();
    }
    node.state
        .write_record(&gpufence_model::record::JobRecord {
            version: gpufence_model::record::RECORD_VERSION,
            job_id: 21,
            uid: test_uid(),
            gres_indices: vec![0],
            devices: vec![gpufence_model::device::DeviceGrant {
                path: x.clone(),
                dev: DevNum::new(ma, mi),
                access: Access::RW,
                role: gpufence_model::device::DeviceRole::Gres,
                gres_index: Some(0),
            }],
            created: gpufence_model::record::now_rfc3339(),
            notes: vec![],
            user_notes: vec![],
            gpu_idle: vec![],
            mig: vec![],
            cuda_visible_devices: vec![],
            saved_compute_modes: vec![],
            job_map: Vec::new(),
            mps: vec![],
        })
        .unwrap();
    let sock_dir = env.path("sockets");
    std::fs::create_dir_all(&sock_dir).unwrap();
    std::fs::set_permissions(
        &sock_dir,
        std::os::unix::fs::PermissionsExt::from_mode(0o1777),
    )
    .unwrap();
    let sock = sock_dir.join("hand.sock").display().to_string();
    let receiver = env.spawn_user_probe(&job_b, &["recvfd", &sock], "listening");
    let bystander = env.spawn_user_sleeper(&job_b);
    assert_eq!(
        env.open_from(&job_b, &x),
        "EPERM",
        "job 22 cannot open job 21's device itself"
    );
    let lines = env.probe_in(&job_a, &["sendfd", &sock, x.to_str().unwrap()]);
    assert_eq!(lines, vec!["sent"], "the kernel lets the descriptor pass");
    let want: std::collections::BTreeSet<DevNum> = [DevNum::new(ma, mi)].into();
    assert!(
        Cluster::wait_for(Duration::from_secs(5), || {
            gpufence_node::holders::scan::holder(receiver, &want).is_some()
        }),
        "the receiver holds it"
    );
    let out = gpufence_node::job::epilog::run(&node, 21, None);
    assert!(out.clean(), "{:?} {:?}", out.errors, out.survivors);
    assert_eq!(
        out.lingering
            .iter()
            .map(|l| (l.pid, l.gone()))
            .collect::<Vec<_>>(),
        vec![(receiver, true)],
        "the holder in job 22 is caught and killed"
    );
    assert!(gpufence_tests::gone(receiver));
    assert!(
        !gpufence_tests::gone(bystander),
        "job 22's own process goes on"
    );
    let left = Fence::open(&env.bpffs).unwrap().entries().unwrap();
    assert_eq!(left.iter().map(|g| g.job_id).collect::<Vec<_>>(), vec![22]);
}
