//! End to end on a real cgroup/v2 Slurm node with gpufence's **default**
//! configuration (`layout = "slurm"`): Slurm's cgroup/v2 plugin,
//! `ProctrackType=proctrack/cgroup`, `TaskPlugin=task/cgroup`,
//! `ConstrainDevices=yes`, `PrologFlags=Alloc,Contain`, slurmd in
//! `system.slice/slurmd.service` as systemd starts it
//! (`gpufence_tests::v2node` says how this runs on a hybrid host).
//!
//! Slurm here is the host's (Debian 12: 22.05). GPUs are `mknod` stand-ins
//! whose names, minors and GRES order disagree:
//!
//! ```text
//! GRES index 0: nvidia3      c 195:3    Type=sim
//! GRES index 1: nvidia1      c 195:1    Type=sim
//! GRES index 2: nvidia-held  c 10:M     Type=held  (a real misc device: it opens, so a
//!                                                  job can hold it and hand it out)
//! nvidiactl                  c 195:255  (not in gres.conf: Slurm never restricts it)
//! ```
//!
//! First the same node runs Slurm alone (its ConstrainDevices only), then
//! with gpufence; the test prints what an outsider and the jobs open in
//! each, side by side.

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpufence_tests::cluster::{
    assert_node_clean, end_job, hostname, job_grants, job_state, sbatch_as, test_uid, wait_output,
    Cluster, ClusterSpec,
};
use gpufence_tests::out::{both, field, stdout, verdict};
use gpufence_tests::v2node::{Release, V2Slice, SLICE};
use gpufence_tests::{gone, privileged, HoldableDevice, TestEnv};
use serde_json::Value;

fn events_for(audit: &Path, job: u32) -> Vec<String> {
    gpufence_tests::audit_log(audit)
        .into_iter()
        .filter(|e| e["job_id"] == job)
        .map(|e| e["event"].as_str().unwrap_or("").to_string())
        .collect()
}

/// The node's stand-in devices.
struct Devices {
    n3: PathBuf,
    n1: PathBuf,
    held: PathBuf,
    ctl: PathBuf,
    real: HoldableDevice,
}

impl Devices {
    fn make(env: &TestEnv) -> Devices {
        let real = HoldableDevice::claim();
        Devices {
            n3: env.mknod("nvidia3", 195, 3),
            n1: env.mknod("nvidia1", 195, 1),
            held: env.mknod("nvidia-held", real.major, real.minor),
            ctl: env.mknod("nvidiactl", 195, 255),
            real,
        }
    }

    fn gres_conf(&self) -> String {
        format!(
            "Name=gpu Type=sim File={}\nName=gpu Type=sim File={}\nName=gpu Type=held File={}\n",
            self.n3.display(),
            self.n1.display(),
            self.held.display()
        )
    }

    fn all(&self) -> [&PathBuf; 4] {
        [&self.n3, &self.n1, &self.held, &self.ctl]
    }

    fn args(&self) -> String {
        self.all()
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// What one party opened: nvidia3, nvidia1, nvidia-held, nvidiactl.
fn row(out: &str, d: &Devices) -> [String; 4] {
    d.all().map(|p| verdict(out, p))
}

fn spec(
    release: &Release,
    slice: &V2Slice,
    d: &Devices,
    gpufence_extra: &str,
    slurm_only: bool,
    prolog_flags: &str,
) -> ClusterSpec {
    ClusterSpec {
        root: release.root.clone(),
        plugin: release.plugin.clone(),
        gres_conf: d.gres_conf(),
        node_gres: "gpu:sim:2,gpu:held:1".into(),
        gpufence_extra: gpufence_extra.into(),
        port_base: std::env::var("GPUFENCE_V2NODE_PORT_BASE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(17417),
        v2node: Some(slice.spec(prolog_flags)),
        slurm_only,
        ..ClusterSpec::default()
    }
}

/// `salloc --no-shell --time=5 ARGS` as the test user: an allocation with
/// no shell (only its extern step, when there is one); its job id.
fn salloc_no_shell(cluster: &Cluster, args: &[&str]) -> u32 {
    let o = cluster.as_user("salloc", &[args, &["--no-shell", "--time=5"]].concat());
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(
        o.status.success(),
        "{}\n{}",
        both(&o),
        cluster.log_tail("slurmd.log")
    );
    err.lines()
        .find_map(|l| l.strip_prefix("salloc: Granted job allocation "))
        .and_then(|w| w.trim().parse().ok())
        .unwrap_or_else(|| panic!("job id in {err:?}"))
}

/// A cgroup of the test's own under the fenced slice, where a user's
/// process outside every job runs (an ssh session pam_systemd moved out of
/// the job, a container started through dockerd).
const OUTSIDE: &str = "system.slice/gpufence-test-outside.service";

#[test]
fn real_cgroup_v2_node_slurm_22_05_host() {
    if privileged() {
        real_cgroup_v2_node(&Release {
            root: None,
            plugin: None,
        });
    }
}

#[test]
fn real_cgroup_v2_node_slurm_24_11_debian_trixie() {
    if let Some(r) = privileged().then(|| Release::debian("trixie")).flatten() {
        real_cgroup_v2_node(&r);
    }
}

#[test]
fn real_cgroup_v2_node_slurm_26_05_debian_sid() {
    if let Some(r) = privileged().then(|| Release::debian("sid")).flatten() {
        real_cgroup_v2_node(&r);
    }
}

/// Every scenario on one node of `release`, with the default layout.
fn real_cgroup_v2_node(release: &Release) {
    let mut env = TestEnv::new("v2node");
    let d = Devices::make(&env);
    let slice = V2Slice::claim();
    env.cg.create(OUTSIDE).unwrap();
    let host = hostname();
    let probe_of = |c: &Cluster| c.bin.join("gpufence-probe").display().to_string();
    let open_script = |probe: &str| {
        format!(
            "echo JOB=$SLURM_JOB_ID; echo CG=$(grep ^0:: /proc/self/cgroup); {probe} open {}",
            d.args()
        )
    };

    // --- Slurm alone: its ConstrainDevices, no gpufence --------------------
    let (alone_job, alone_cpu, alone_out) = {
        let cluster =
            Cluster::start_with(&env, &spec(release, &slice, &d, "", true, "Alloc,Contain"));
        let probe = probe_of(&cluster);
        let o = cluster.as_user(
            "srun",
            &["--gres=gpu:sim:1", "sh", "-c", &open_script(&probe)],
        );
        assert!(
            o.status.success(),
            "{}\n{}",
            both(&o),
            cluster.log_tail("slurmd.log")
        );
        let job = row(&stdout(&o), &d);
        assert!(
            field(&stdout(&o), "CG")
                .is_some_and(|c| c.contains(&format!("/{host}_slurmstepd.scope/"))
                    && c.contains("/step_0/user/task_0")),
            "Slurm's cgroup/v2 plugin placed the job:\n{}",
            stdout(&o)
        );
        let o = cluster.as_user("srun", &["sh", "-c", &open_script(&probe)]);
        assert!(o.status.success(), "{}", both(&o));
        let cpu = row(&stdout(&o), &d);
        let o = env
            .user_command_in(OUTSIDE, &probe)
            .arg("open")
            .args(d.all())
            .output()
            .unwrap();
        let outsider = row(&stdout(&o), &d);
        // Let Slurm remove its job cgroups before the cluster is stopped
        // (stop kills step daemons that may still be at it); what is left
        // of Slurm alone is removed, so that only gpufence's node is judged.
        Cluster::wait_for(Duration::from_secs(10), || {
            slice.job_cgroups(&host).is_empty()
        });
        drop(cluster);
        slice.clear_job_cgroups(&host);
        (job, cpu, outsider)
    };
    // What Slurm alone lets through (seen on 22.05, 24.11, 26.05): the job
    // its own GPU, every job nvidiactl, the outsider everything.
    assert_eq!(
        alone_out[..2],
        ["ENXIO", "ENXIO"],
        "Slurm alone: outsider opens GPUs"
    );
    assert_eq!(
        alone_cpu[3], "ENXIO",
        "Slurm alone: a CPU-only job opens nvidiactl"
    );
    assert_eq!(
        alone_job[..2].iter().filter(|v| *v == "ENXIO").count(),
        1,
        "Slurm alone: the job opens one GPU: {alone_job:?}"
    );

    // --- The same node with gpufence, default layout ------------------------
    let extra = format!(
        "term_grace_ms = 1000\nnvml = false\n[majors]\nnvidia = 195\nfake-held = {}\n",
        d.real.major
    );
    let cluster = Cluster::start_with(
        &env,
        &spec(release, &slice, &d, &extra, false, "Alloc,Contain"),
    );
    let audit = env.path("log/audit.jsonl");
    let probe = cluster.bin.join("gpufence-probe");
    let probe_s = probe_of(&cluster);
    let st = cluster.gpufence(&["fence", "status", "--json"]);
    let st: Value = serde_json::from_slice(&st.stdout).expect("status JSON");
    assert_eq!(
        st["installed"],
        true,
        "{st}\n{}",
        cluster.log_tail("slurmd.log")
    );
    assert_eq!(st["cgroup_root"], format!("/{SLICE}"));
    // slurmd runs where the default exemption covers it (systemd's unit;
    // 26.05 moves itself below it): no line about its cgroup.
    let log = std::fs::read_to_string(cluster.dir.join("log/slurmd.log")).unwrap_or_default();
    assert!(
        !log.contains("no exempt_cgroups entry covers"),
        "{}",
        cluster.log_tail("slurmd.log")
    );

    // 1. A --gres=gpu:sim:1 job opens its GPU, not the other; the GRES
    //    index maps through slurmd -G's order (nvidia3 first), not minors.
    let o = cluster.as_user(
        "srun",
        &[
            "--gres=gpu:sim:1",
            "sh",
            "-c",
            &format!(
                "echo GPUS=${{SLURM_STEP_GPUS:-$SLURM_JOB_GPUS}}; {}",
                open_script(&probe_s)
            ),
        ],
    );
    let out = stdout(&o);
    assert!(
        o.status.success(),
        "{}\n{}",
        both(&o),
        cluster.log_tail("slurmd.log")
    );
    let job1: u32 = field(&out, "JOB").unwrap().parse().unwrap();
    let fenced_job = row(&out, &d);
    let applied: Vec<Value> = gpufence_tests::audit_log(&audit)
        .into_iter()
        .filter(|e| e["job_id"] == job1 && e["event"] == "grant_applied")
        .collect();
    assert!(!applied.is_empty(), "{:?}", events_for(&audit, job1));
    // Which GPU the job was given is Slurm's choice; the grant must follow
    // slurmd -G's order (GRES index 0 = nvidia3, listed first), not minors.
    let granted = applied[0]["devices"].to_string();
    let (mine, other) = if granted.contains("\"195:3 ") {
        (0, 1)
    } else {
        (1, 0)
    };
    assert!(
        granted.contains(["\"195:3 ", "\"195:1 "][mine])
            && !granted.contains(["\"195:3 ", "\"195:1 "][other]),
        "one sim GPU granted: {granted}"
    );
    assert_eq!(
        (fenced_job[mine].as_str(), fenced_job[other].as_str(), fenced_job[2].as_str(), fenced_job[3].as_str()),
        ("ENXIO", "EPERM", "EPERM", "ENXIO"),
        "own GPU opens, the other and the unallocated one do not, nvidiactl comes with a GPU:\n{out}"
    );
    let index: usize = field(&out, "GPUS")
        .and_then(|g| g.parse().ok())
        .unwrap_or(mine);
    assert_eq!(
        index,
        mine,
        "GRES index {index} is {:?} in slurmd -G order:\n{out}",
        d.all()[index]
    );
    // The grant went to the job cgroup Slurm made (job_<id>; the SLUID on
    // 26.05), an ancestor of the task's cgroup.
    let scope = V2Slice::scope(&host);
    let task_cg = field(&out, "CG").unwrap_or_default();
    for a in &applied {
        let cg = a["cgroup"].as_str().unwrap_or("");
        let job_dir = cg.strip_prefix(&format!("/{scope}/")).unwrap_or("");
        assert!(
            !job_dir.is_empty()
                && !job_dir.contains('/')
                && task_cg.starts_with(&format!("0::{cg}/step_")),
            "grant at {cg}, task in {task_cg}: {a}"
        );
    }

    // 2. The same user outside any job opens nothing; a CPU-only job runs
    //    and opens nothing either.
    let o = env
        .user_command_in(OUTSIDE, &probe)
        .arg("open")
        .args(d.all())
        .output()
        .unwrap();
    let fenced_out = row(&stdout(&o), &d);
    assert_eq!(
        fenced_out,
        ["EPERM"; 4].map(String::from),
        "outsider:\n{}",
        stdout(&o)
    );
    let o = cluster.as_user("srun", &["sh", "-c", &open_script(&probe_s)]);
    assert!(o.status.success(), "a CPU-only job runs: {}", both(&o));
    let fenced_cpu = row(&stdout(&o), &d);
    assert_eq!(
        fenced_cpu,
        ["EPERM"; 4].map(String::from),
        "CPU-only job:\n{}",
        stdout(&o)
    );
    assert!(
        !both(&o).contains("gpufence:"),
        "no message for a CPU-only job: {}",
        both(&o)
    );

    // 3. A job's own environment widens nothing (user_cmd resets the
    //    environment: the variables travel as `env` arguments; a marker
    //    proves they reached the job).
    let o = cluster.as_user(
        "env",
        &[
            "CUDA_VISIBLE_DEVICES=0,1,2",
            "SLURM_JOB_GPUS=0,1,2",
            "SLURM_STEP_GPUS=0,1,2",
            "SPANK__SLURM_SPANK_OPTION_gpufence_gpu_exclusive=1",
            "GPUFENCE_SPOOF_MARK=reached",
            "srun",
            "--export=ALL",
            "--gres=gpu:sim:1",
            "sh",
            "-c",
            &format!("echo MARK=$GPUFENCE_SPOOF_MARK; {}", open_script(&probe_s)),
        ],
    );
    let out = stdout(&o);
    assert!(o.status.success(), "{}", both(&o));
    assert_eq!(field(&out, "MARK").as_deref(), Some("reached"), "{out}");
    let spoof = row(&out, &d);
    assert_eq!(
        spoof[..3].iter().filter(|v| *v == "ENXIO").count(),
        1,
        "exactly one GPU despite the spoofed environment: {spoof:?}"
    );

    // 4. A batch job gets its (real, holdable) GPU in the batch step.
    let out_file = env.path("jobs/batch.out");
    let o = cluster.as_user(
        "sbatch",
        &[
            "--wait",
            "--gres=gpu:held:1",
            "-o",
            out_file.to_str().unwrap(),
            "--wrap",
            &format!("{probe_s} open {}", d.held.display()),
        ],
    );
    assert!(o.status.success(), "{}", both(&o));
    let out = std::fs::read_to_string(&out_file).unwrap_or_default();
    assert_eq!(
        verdict(&out, &d.held),
        "ok",
        "batch step opens its GPU:\n{out}"
    );

    // 5. A descriptor handed to a process outside the job is found at job
    //    end (by st_rdev), with evidence, and the process ended.
    let sock = env.path("jobs/handoff.sock");
    let mut recv = env.user_command_in(OUTSIDE, &probe);
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
                d.held.display()
            ),
        ],
    );
    let out = stdout(&o);
    assert!(o.status.success() && out.contains("sent"), "{}", both(&o));
    let job5: u32 = field(&out, "JOB").unwrap().parse().unwrap();
    assert!(
        Cluster::wait_for(Duration::from_secs(30), || gone(receiver)
            && events_for(&audit, job5).contains(&"process_killed".to_string())),
        "the epilog did not end pid {receiver}: {:?}\n{}",
        events_for(&audit, job5),
        cluster.log_tail("slurmd.log")
    );
    let killed: Vec<Value> = gpufence_tests::audit_log(&audit)
        .into_iter()
        .filter(|e| e["job_id"] == job5 && e["event"] == "process_killed")
        .collect();
    assert_eq!(killed.len(), 1, "{:?}", events_for(&audit, job5));
    assert_eq!(
        (killed[0]["pid"].clone(), killed[0]["uid"].clone()),
        (Value::from(receiver), Value::from(test_uid()))
    );
    let evidence: Vec<_> = std::fs::read_dir(env.path("evidence"))
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(&format!("job{job5}-pid{receiver}-"))
        })
        .collect();
    assert_eq!(evidence.len(), 1, "one evidence file");
    let e: Value = serde_json::from_slice(&std::fs::read(evidence[0].path()).unwrap()).unwrap();
    assert_eq!(e["exe"], probe.display().to_string());

    // 6. After the jobs: no grant, no job cgroup, the node not drained, and
    //    each job's grant recorded, applied, revoked in that order.
    let mut state = String::new();
    let idle = Cluster::wait_for(Duration::from_secs(20), || {
        state = stdout(&cluster.as_user("sinfo", &["-h", "-o", "%T"]))
            .trim()
            .to_string();
        state == "idle"
    });
    assert!(
        idle,
        "node not idle after the jobs: {state}\n{}",
        cluster.log_tail("slurmd.log")
    );
    for job in [job1, job5] {
        let ev = events_for(&audit, job);
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
    assert_eq!(
        serde_json::from_slice::<Value>(&g.stdout).unwrap(),
        serde_json::json!([]),
        "no grant is left"
    );
    slice.assert_no_job_cgroups(&host, &cluster.dir.join("log"), release);

    let table = [
        (
            "",
            [
                "Slurm ConstrainDevices alone".to_string(),
                "Slurm + gpufence".to_string(),
            ],
        ),
        (
            "the user outside any job",
            [alone_out.join(" "), fenced_out.join(" ")],
        ),
        (
            "a --gres=gpu:sim:1 job",
            [alone_job.join(" "), fenced_job.join(" ")],
        ),
        (
            "a CPU-only job",
            [alone_cpu.join(" "), fenced_cpu.join(" ")],
        ),
    ];
    println!(
        "\nOn a real cgroup/v2 {} node, what each opens of nvidia3 nvidia1 nvidia-held nvidiactl\n\
         (ENXIO or ok: allowed, EPERM: denied):",
        release.slurm_version()
    );
    for (who, [a, b]) in table {
        println!("  {who:<26} {a:<30} {b}");
    }
    drop(cluster);
}

/// What gpufence's Prolog or Epilog says when Slurm started it as the
/// job's user (`gpufence_node::host::procs::not_root_line`).
const SLURM_22736: &str = "(the job's user: Slurm 24.11 before 24.11.6";

/// Runs `test` on `release`, and again (twice at most) when it failed
/// because Slurm started a RunInJob Prolog or Epilog as the job's user:
/// Slurm 24.11 before 24.11.6 does so at random (its X11 shutdown thread
/// drops privileges process-wide while the extern step forks the script;
/// SchedMD ticket 22736, fixed in 24.11.6 by commit 46cec1d440; Debian
/// trixie ships 24.11.5). gpufence then refuses, as it must, and Slurm
/// drains the node; the failure's text carries slurmd.log's tail with
/// gpufence's line naming that bug. Any other failure fails at once.
fn again_on_slurm_22736(release: &Release, test: fn(&Release)) {
    for attempt in 1..=3 {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| test(release))) {
            Ok(()) => return,
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                if attempt < 3 && msg.contains(SLURM_22736) {
                    eprintln!(
                        "attempt {attempt}: {} started a RunInJob script as the job's user \
                         (SchedMD ticket 22736); gpufence refused and the node drained: again",
                        release.slurm_version()
                    );
                    continue;
                }
                std::panic::resume_unwind(p);
            }
        }
    }
}

#[test]
fn run_in_job_slurm_24_11_debian_trixie() {
    if let Some(r) = privileged().then(|| Release::debian("trixie")).flatten() {
        again_on_slurm_22736(&r, run_in_job);
    }
}

#[test]
fn run_in_job_slurm_26_05_debian_sid() {
    if let Some(r) = privileged().then(|| Release::debian("sid")).flatten() {
        run_in_job(&r);
    }
}

/// `PrologFlags=RunInJob` (24.05+): the extern step starts before the
/// Prolog, which then runs inside it. A process placed in the extern
/// step's cgroup, as pam_slurm_adopt places an ssh session
/// (`step_extern/user/task_special`), opens the job's GPU before any srun
/// step runs; srun and batch steps do too; no step is refused.
fn run_in_job(release: &Release) {
    let env = TestEnv::new("runinjob");
    let d = Devices::make(&env);
    let slice = V2Slice::claim();
    let host = hostname();
    let extra = format!(
        "term_grace_ms = 1000\nnvml = false\n[majors]\nnvidia = 195\nfake-held = {}\n",
        d.real.major
    );
    let cluster = Cluster::start_with(
        &env,
        &spec(release, &slice, &d, &extra, false, "Alloc,Contain,RunInJob"),
    );
    let audit = env.path("log/audit.jsonl");
    let probe = cluster.bin.join("gpufence-probe");
    let probe_s = probe.display().to_string();

    // An allocation without a shell: only its extern step runs.
    let job = salloc_no_shell(&cluster, &["--gres=gpu:held:1"]);
    // The extern step's cgroup (the job dir is job_<id>, or the SLUID).
    let mut extern_cg = None;
    assert!(
        Cluster::wait_for(Duration::from_secs(20), || {
            extern_cg = slice
                .job_cgroups(&host)
                .into_iter()
                .map(|j| format!("{}/{j}/step_extern", V2Slice::scope(&host)))
                .find(|c| env.cg.path(c).exists());
            extern_cg.is_some() && events_for(&audit, job).iter().any(|e| e == "grant_applied")
        }),
        "job {job}: extern step {extern_cg:?}, events {:?}\n{}",
        events_for(&audit, job),
        cluster.log_tail("slurmd.log")
    );
    let adopted = format!("{}/user/task_special", extern_cg.unwrap());
    // 24.11 has made it already (its extern step's holder runs there);
    // 26.05 makes it only when pam_slurm_adopt asks.
    let made = !env.cg.path(&adopted).exists();
    env.cg.create(&adopted).unwrap();
    let o = env
        .user_command_in(&adopted, &probe)
        .arg("open")
        .args(d.all())
        .output()
        .unwrap();
    let out = stdout(&o);
    assert_eq!(
        row(&out, &d),
        ["EPERM", "EPERM", "ok", "ENXIO"].map(String::from),
        "an adopted ssh session in /{adopted} opens the job's GPU before any srun step:\n{out}"
    );
    // A task_special the test made (pam_slurm_adopt has slurmstepd make
    // it) is the test's to remove: Slurm leaves a job cgroup holding a
    // directory it did not make. (An exited task leaves its cgroup a
    // moment after wait() returns.)
    let adopted_dir = env.cg.path(&adopted);
    let removed = || std::fs::remove_dir(&adopted_dir).is_ok() || !adopted_dir.exists();
    assert!(
        !made || Cluster::wait_for(Duration::from_secs(5), removed),
        "{} stays busy: {:?}",
        adopted_dir.display(),
        std::fs::read_to_string(adopted_dir.join("cgroup.procs"))
    );
    // An srun step in the allocation.
    let o = cluster.as_user(
        "srun",
        &[
            &format!("--jobid={job}"),
            "--gres=gpu:held:1",
            &probe_s,
            "open",
            &d.held.display().to_string(),
        ],
    );
    assert_eq!(
        verdict(&stdout(&o), &d.held),
        "ok",
        "srun step: {}\n{}",
        both(&o),
        cluster.log_tail("slurmd.log")
    );
    let o = cluster.admin("scancel", &[&job.to_string()]);
    assert!(o.status.success(), "{}", both(&o));
    // A batch job.
    let out_file = env.path("jobs/runinjob-batch.out");
    let o = cluster.as_user(
        "sbatch",
        &[
            "--wait",
            "--gres=gpu:held:1",
            "-o",
            out_file.to_str().unwrap(),
            "--wrap",
            &format!(
                "echo JOB=$SLURM_JOB_ID; {probe_s} open {}",
                d.held.display()
            ),
        ],
    );
    assert!(
        o.status.success(),
        "{}\n{}",
        both(&o),
        cluster.log_tail("slurmd.log")
    );
    let out = std::fs::read_to_string(&out_file).unwrap_or_default();
    assert_eq!(verdict(&out, &d.held), "ok", "batch step:\n{out}");
    let batch: u32 = field(&out, "JOB").unwrap().parse().unwrap();
    // No step was refused, every grant was revoked, nothing is left.
    let mut state = String::new();
    let idle = Cluster::wait_for(Duration::from_secs(30), || {
        state = stdout(&cluster.as_user("sinfo", &["-h", "-o", "%T"]))
            .trim()
            .to_string();
        state == "idle"
            && [job, batch]
                .iter()
                .all(|j| events_for(&audit, *j).contains(&"grant_revoked".to_string()))
    });
    assert!(
        idle,
        "node {state}, events {:?} {:?}\n{}",
        events_for(&audit, job),
        events_for(&audit, batch),
        cluster.log_tail("slurmd.log")
    );
    for j in [job, batch] {
        let ev = events_for(&audit, j);
        assert!(
            !ev.contains(&"grant_refused".to_string()),
            "job {j}: {ev:?}"
        );
    }
    let g = cluster.gpufence(&["grants", "--json"]);
    assert_eq!(
        serde_json::from_slice::<Value>(&g.stdout).unwrap(),
        serde_json::json!([])
    );
    slice.assert_no_job_cgroups(&host, &cluster.dir.join("log"), release);
    drop(cluster);
}

#[test]
fn run_in_job_nvml_slurm_24_11_debian_trixie() {
    if let Some(r) = privileged().then(|| Release::debian("trixie")).flatten() {
        again_on_slurm_22736(&r, run_in_job_nvml);
    }
}

#[test]
fn run_in_job_nvml_slurm_26_05_debian_sid() {
    if let Some(r) = privileged().then(|| Release::debian("sid")).flatten() {
        run_in_job_nvml(&r);
    }
}

/// `PrologFlags=RunInJob` with NVML (the fake `libnvidia-ml`, which opens
/// `nvidiactl` at init and `/dev/nvidia<N>` for each handle as the driver
/// does, so a device cgroup fences it as it fences the real library): the
/// Prolog and the Epilog run in the job's extern step, yet their NVML work
/// runs outside the fence. The Prolog records the idle-memory baseline and
/// sets `--gpu-exclusive`; the Epilog proves memory came back (here it did
/// not: the node drains, naming the GPU) and restores the compute mode.
/// Neither leaves a denial in the fence's record. Inside the job cgroup
/// NVML's init is refused before the grant, and the other GPU's handle
/// after it: the baseline and the mode would be missing.
fn run_in_job_nvml(release: &Release) {
    let env = TestEnv::new("runinjob-nvml");
    let d = Devices::make(&env);
    let slice = V2Slice::claim();
    let host = hostname();
    let nvml_dir = env.path("nvml");
    std::fs::create_dir_all(&nvml_dir).unwrap();
    std::fs::set_permissions(
        &nvml_dir,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let lib = nvml_dir.join("libnvidia-ml.so.1");
    std::fs::copy(gpufence_tests::workspace_bin("libnvidia_ml.so"), &lib).unwrap();
    let scenario = |stuck: Option<u32>| {
        let gpu = |minor: u32, file: &Path| {
            serde_json::json!({"minor": minor, "device_file": file, "idle_used_mib": 400,
                "stuck_used_mib": if stuck == Some(minor) { 2000 } else { 0 }})
        };
        let v = serde_json::json!({"control_device": d.ctl,
            "gpus": [gpu(1, &d.n1), gpu(3, &d.n3)]});
        std::fs::write(nvml_dir.join("nvml-scenario.json"), v.to_string()).unwrap();
    };
    scenario(None);
    let extra = format!(
        "term_grace_ms = 1000\nmemory_wait_ms = 1000\nnvml_library = \"{}\"\n[majors]\nnvidia = 195\nfake-held = {}\n",
        lib.display(),
        d.real.major
    );
    let cluster = Cluster::start_with(
        &env,
        &spec(release, &slice, &d, &extra, false, "Alloc,Contain,RunInJob"),
    );
    let audit = env.path("log/audit.jsonl");
    let modes = || -> Value {
        std::fs::read(nvml_dir.join("nvml-state.json"))
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .map(|v| v["compute_mode"].clone())
            .unwrap_or(Value::Null)
    };

    let job = salloc_no_shell(&cluster, &["--gres=gpu:sim:1", "--gpu-exclusive"]);
    assert!(
        Cluster::wait_for(Duration::from_secs(20), || events_for(&audit, job)
            .iter()
            .any(|e| e == "grant_applied")),
        "job {job}: events {:?}\n{}",
        events_for(&audit, job),
        cluster.log_tail("slurmd.log")
    );
    // --gpu-exclusive: exclusive-process (3) on the job's GPU, one GPU.
    let set = modes();
    let set = set.as_object().cloned().unwrap_or_default();
    assert_eq!(set.len(), 1, "one GPU switched: {set:?}");
    let (minor, mode) = set.iter().next().unwrap();
    assert_eq!(mode, 3, "exclusive-process on /dev/nvidia{minor}");
    let minor: u32 = minor.parse().unwrap();
    // The baseline: the job's GPU at its idle level, from NVML.
    let rec: Value = serde_json::from_slice(
        &std::fs::read(env.path(&format!("state/jobs/{job}.json"))).unwrap(),
    )
    .unwrap();
    assert_eq!(
        rec["gpu_idle"],
        serde_json::json!([{"minor": minor, "used_bytes": 400u64 << 20}]),
        "{rec}"
    );
    assert!(
        rec["devices"]
            .as_array()
            .unwrap()
            .iter()
            .any(|g| g["dev"] == serde_json::json!({"major": 195, "minor": minor})),
        "the switched GPU is the job's: {rec}"
    );
    // The job leaves memory on its GPU that never comes back.
    scenario(Some(minor));
    let o = cluster.admin("scancel", &[&job.to_string()]);
    assert!(o.status.success(), "{}", both(&o));
    let mut state = String::new();
    let drained = Cluster::wait_for(Duration::from_secs(30), || {
        state = stdout(&cluster.as_user("sinfo", &["-h", "-o", "%T"]))
            .trim()
            .to_string();
        // The Epilog drains, then writes its error line.
        let ev = events_for(&audit, job);
        state.starts_with("drain")
            && ev.contains(&"grant_revoked".to_string())
            && ev.contains(&"error".to_string())
    });
    assert!(
        drained,
        "node {state}, events {:?}\n{}",
        events_for(&audit, job),
        cluster.log_tail("slurmd.log")
    );
    let lines = gpufence_tests::audit_log_settled(&audit);
    let err = lines
        .iter()
        .find(|e| e["job_id"] == job && e["event"] == "error")
        .unwrap_or_else(|| panic!("the Epilog's error line: {lines:#?}"));
    let survivors = err["survivors"].to_string();
    assert!(
        survivors.contains(&format!("/dev/nvidia{minor} still has 2400 MiB in use")),
        "the memory-return proof names the GPU: {err}"
    );
    assert_eq!(err["errors"], serde_json::json!([]), "{err}");
    assert_eq!(
        modes()[minor.to_string()],
        0,
        "the compute mode is restored"
    );
    // Neither script's NVML work was denied by the fence.
    let denials: Value =
        serde_json::from_slice(&cluster.gpufence(&["denials", "--json"]).stdout).unwrap();
    assert_eq!(denials, serde_json::json!([]), "denials: {denials}");
    // The node back in service.
    scenario(None);
    let o = cluster.admin(
        "scontrol",
        &["update", &format!("nodename={host}"), "state=resume"],
    );
    assert!(o.status.success(), "{}", both(&o));
    let g = cluster.gpufence(&["grants", "--json"]);
    assert_eq!(
        serde_json::from_slice::<Value>(&g.stdout).unwrap(),
        serde_json::json!([])
    );
    slice.assert_no_job_cgroups(&host, &cluster.dir.join("log"), release);
    drop(cluster);
}

/// A job with no extern or batch step (`PrologFlags=Alloc`, no `Contain`):
/// Slurm removes the job cgroup with each step and makes a new one, with a
/// new cgroup id, for the next (`cgroup_p_step_destroy`). Each step opens
/// its GPU, and the grants of the earlier, removed job cgroups are gone
/// from the fence once the next step is granted.
#[test]
fn recreated_job_cgroup_slurm_22_05_host() {
    if !privileged() {
        return;
    }
    let release = Release {
        root: None,
        plugin: None,
    };
    let env = TestEnv::new("recreated");
    let d = Devices::make(&env);
    let slice = V2Slice::claim();
    let extra = "nvml = false\n[majors]\nnvidia = 195\n";
    let cluster = Cluster::start_with(&env, &spec(&release, &slice, &d, extra, false, "Alloc"));
    let audit = env.path("log/audit.jsonl");
    let probe_s = cluster.bin.join("gpufence-probe").display().to_string();
    let job = salloc_no_shell(&cluster, &["--gres=gpu:sim:1"]);
    let grants_of_job = || -> Vec<u64> {
        let g = cluster.gpufence(&["grants", "--json"]);
        let g: Value = serde_json::from_slice(&g.stdout).expect("grants JSON");
        g.as_array()
            .unwrap()
            .iter()
            .filter(|c| c["job_id"] == job)
            .map(|c| c["cgroup_id"].as_u64().unwrap())
            .collect()
    };
    let mut ids = Vec::new();
    for _ in 0..2 {
        let o = cluster.as_user(
            "srun",
            &[
                &format!("--jobid={job}"),
                "sh",
                "-c",
                &format!(
                    "grep ^0:: /proc/self/cgroup; {probe_s} open {} {}",
                    d.n3.display(),
                    d.n1.display()
                ),
            ],
        );
        let out = stdout(&o);
        assert!(o.status.success(), "{}", both(&o));
        assert_eq!(
            [verdict(&out, &d.n3), verdict(&out, &d.n1)]
                .iter()
                .filter(|v| *v == "ENXIO")
                .count(),
            1,
            "each step opens its one GPU:\n{out}"
        );
        let applied: Vec<u64> = gpufence_tests::audit_log(&audit)
            .into_iter()
            .filter(|e| e["job_id"] == job && e["event"] == "grant_applied")
            .map(|e| e["cgroup_id"].as_u64().unwrap())
            .collect();
        ids.push(*applied.last().expect("a grant_applied line"));
        assert_eq!(
            grants_of_job(),
            vec![*ids.last().unwrap()],
            "the fence holds the job's grant for its latest job cgroup only"
        );
    }
    assert_ne!(
        ids[0], ids[1],
        "Slurm made a new job cgroup for the second step: {ids:?}"
    );
    let dropped: Vec<Value> = gpufence_tests::audit_log(&audit)
        .into_iter()
        .filter(|e| {
            e["job_id"] == job && e["event"] == "grant_revoked" && e["kept_cgroup_id"] == ids[1]
        })
        .collect();
    assert_eq!(dropped.len(), 1, "{:?}", events_for(&audit, job));
    assert_eq!(dropped[0]["cgroup_ids"], serde_json::json!([ids[0]]));
    let o = cluster.admin("scancel", &[&job.to_string()]);
    assert!(o.status.success(), "{}", both(&o));
    assert!(
        Cluster::wait_for(Duration::from_secs(20), || events_for(&audit, job)
            .last()
            .is_some_and(|e| e == "grant_revoked")
            && grants_of_job().is_empty()),
        "{:?}",
        events_for(&audit, job)
    );
    drop(cluster);
}

#[test]
fn slurmd_g_leaves_slurmd_alone_slurm_24_11_debian_trixie() {
    if let Some(r) = privileged().then(|| Release::debian("trixie")).flatten() {
        slurmd_g_leaves_slurmd_alone(&r);
    }
}

#[test]
fn slurmd_g_leaves_slurmd_alone_slurm_26_05_debian_sid() {
    if let Some(r) = privileged().then(|| Release::debian("sid")).flatten() {
        slurmd_g_leaves_slurmd_alone(&r);
    }
}

/// `slurmd -G` initialises Slurm's cgroup plugin as slurmd does
/// (`_slurmd_init`): without `INVOCATION_ID` it moves itself to
/// `<scope>/slurmd` (24.11), from another cgroup 26.05 makes
/// `<cgroup>/slurmd` and moves there, and 24.11+ resets the cpuset and
/// memory limits of the cgroup it runs in. gpufence runs it, at slurmd start
/// (the plugin) and on a Prolog's cache miss, in a cgroup of its own: after
/// both, slurmd's cgroup holds slurmd alone, no `slurmd` cgroup appeared
/// anywhere, and nothing of gpufence's is left. (This host has no v2
/// controllers, so the limit reset itself cannot show here.)
fn slurmd_g_leaves_slurmd_alone(release: &Release) {
    let env = TestEnv::new("slurmdg");
    let d = Devices::make(&env);
    let slice = V2Slice::claim();
    let cluster = Cluster::start_with(
        &env,
        &spec(
            release,
            &slice,
            &d,
            "nvml = false\n[majors]\nnvidia = 195\n",
            false,
            "Alloc,Contain",
        ),
    );
    let slurmd = cluster.slurmd_pid().expect("slurmd runs");
    let cgroup_of = |pid: i32| {
        gpufence_cgroup::hierarchy::parse_proc_cgroup(
            &std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default(),
        )
        .unwrap_or_default()
    };
    // Where slurmd put itself: systemd's unit cgroup, or below it
    // `slurmd.service/slurmd` (26.05 moves there itself: Slurm's own
    // placement, which gpufence must keep as it is).
    let own = cgroup_of(slurmd);
    assert!(
        own.starts_with(gpufence_tests::v2node::SLURMD_SERVICE),
        "slurmd in /{own}"
    );
    let placement = |when: &str| {
        assert_eq!(cgroup_of(slurmd), own, "{when}: slurmd stays in its cgroup");
        let procs =
            std::fs::read_to_string(env.cg.path(&own).join("cgroup.procs")).unwrap_or_default();
        assert_eq!(
            procs.trim(),
            slurmd.to_string(),
            "{when}: slurmd's cgroup holds slurmd alone"
        );
        let mut stray = Vec::new();
        let mut stack = vec![env.cg.path(SLICE)];
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                if e.path().is_dir() {
                    let name = e.file_name().to_string_lossy().into_owned();
                    if (name == "slurmd" || name.starts_with("slurmd-G"))
                        && e.path() != env.cg.path(&own)
                    {
                        stray.push(e.path());
                    }
                    stack.push(e.path());
                }
            }
        }
        assert!(stray.is_empty(), "{when}: cgroups {stray:?}");
    };
    placement("after slurmd start (the plugin warmed the slurmd -G cache)");
    // A Prolog that finds no cache runs slurmd -G itself (from slurmd's
    // cgroup, with the Prolog's environment: no INVOCATION_ID).
    // (slurmd runs with -N <node>: its cache is the node's own.)
    let cache = env.path(&format!("state/slurmd-G-{}.txt", hostname()));
    assert!(cache.exists(), "the plugin's cache at {}", cache.display());
    std::fs::remove_file(&cache).unwrap();
    let probe_s = cluster.bin.join("gpufence-probe").display().to_string();
    let o = cluster.as_user(
        "srun",
        &[
            "--gres=gpu:sim:1",
            &probe_s,
            "open",
            &d.n3.display().to_string(),
            &d.n1.display().to_string(),
        ],
    );
    let out = stdout(&o);
    assert!(
        o.status.success(),
        "{}\n{}",
        both(&o),
        cluster.log_tail("slurmd.log")
    );
    assert_eq!(
        [verdict(&out, &d.n3), verdict(&out, &d.n1)]
            .iter()
            .filter(|v| *v == "ENXIO")
            .count(),
        1,
        "the job opens its GPU after the Prolog's slurmd -G:\n{out}"
    );
    assert!(cache.exists(), "the Prolog rewrote the cache");
    placement("after a Prolog ran slurmd -G");
    drop(cluster);
}

/// `layout = "slurm"` (the default) needs Slurm's job cgroups, which only
/// `ProctrackType=proctrack/cgroup` makes for slurmstepd: a node set to
/// another proctrack is caught at slurmd start, which fails, with one line
/// saying what to set.
#[test]
fn default_layout_without_proctrack_cgroup_stops_slurmd_22_05_host() {
    if !privileged() {
        return;
    }
    let release = Release {
        root: None,
        plugin: None,
    };
    let env = TestEnv::new("proctrack");
    let d = Devices::make(&env);
    let slice = V2Slice::claim();
    let mut s = spec(
        &release,
        &slice,
        &d,
        "nvml = false\n",
        false,
        "Alloc,Contain",
    );
    if let Some(v2) = s.v2node.as_mut() {
        v2.slurm_conf = v2.slurm_conf.replace(
            "ProctrackType=proctrack/cgroup",
            "ProctrackType=proctrack/linuxproc",
        );
    }
    let (cluster, out) = Cluster::launch(&env, &s);
    assert!(!out.status.success(), "slurmd started: {}", both(&out));
    let log = std::fs::read_to_string(cluster.dir.join("log/slurmd.log")).unwrap_or_default();
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("gpufence:")).collect();
    assert!(
        lines
            .iter()
            .any(|l| l.contains("ProctrackType=proctrack/linuxproc")
                && l.contains("set ProctrackType=proctrack/cgroup")
                && l.contains("layout = \"own\"")),
        "one line naming what is set and what to set:\n{}",
        lines.join("\n")
    );
    assert!(
        log.contains("slurmd initialization failed") || log.contains("fatal"),
        "slurmd did not start:\n{log}"
    );
    drop(cluster);
}

/// Two nodes on this host (Debian builds Slurm with `MULTIPLE_SLURMD`: two
/// slurmd with their own node names and ports), each a cgroup/v2 node with
/// its own gpufence (config, maps, state, audit log) fencing its own
/// `system.slice/<node>_slurmstepd.scope`, as two machines would. `n1` has
/// two GPUs of one type, `n2` GPUs of two types (its Prolog also asks
/// slurmctld for the allocation, since Slurm's Prolog environment holds
/// only the last type's indices). A job spanning both nodes gets, on each,
/// exactly that node's share.
#[test]
fn two_nodes_each_grant_their_own_share_22_05_host() {
    use gpufence_tests::cluster::{cluster_sh_start_nodes, copy_exec};
    use std::os::unix::fs::PermissionsExt;
    if !privileged() {
        return;
    }
    let env = TestEnv::new("twonodes");
    let real = HoldableDevice::claim();
    let a3 = env.mknod("nvidia3", 195, 3);
    let a1 = env.mknod("nvidia1", 195, 1);
    let b5 = env.mknod("nvidia5", 195, 5);
    let held = env.mknod("nvidia-held", real.major, real.minor);
    let slice = V2Slice::claim();
    let nodes = ["gfn1", "gfn2"];
    for n in nodes {
        env.cg
            .create(&format!("{SLICE}/slurmd-{n}.service"))
            .unwrap();
        env.cg.create(&V2Slice::scope(n)).unwrap();
    }
    let port: u16 = std::env::var("GPUFENCE_V2NODE_PORT_BASE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(17417);
    let dir = env.path("cluster");
    let bin = env.path("bin");
    for d in [&dir, &bin, &env.path("jobs")] {
        std::fs::create_dir_all(d).unwrap();
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
    for b in [
        "gpufence-prolog",
        "gpufence-epilog",
        "gpufence",
        "gpufence-probe",
    ] {
        copy_exec(&gpufence_tests::workspace_bin(b), &bin.join(b));
    }
    copy_exec(
        &gpufence_tests::workspace_bin("libgpufence.so"),
        &bin.join("gpufence.so"),
    );
    // One gpufence per node: its own config, maps, state and audit log.
    let config = |n: &str| bin.join(format!("gpufence-{n}.toml"));
    for n in nodes {
        std::fs::write(
            config(n),
            format!(
                "cgroup_root = \"{scope}\"\nbpffs_dir = \"{bpffs}-{n}\"\nstate_dir = \"{tmp}/state-{n}\"\n\
                 audit_log = \"{tmp}/log/audit-{n}.jsonl\"\nevidence_dir = \"{tmp}/evidence-{n}\"\n\
                 dev_dir = \"{tmp}/dev\"\nshm_dir = \"{tmp}/shm\"\nnvml = false\nslurmd_bin = \"{bin}/slurmd-v2node\"\n\
                 [majors]\nnvidia = 195\nfake-held = {major}\n",
                scope = V2Slice::scope(n),
                bpffs = env.bpffs.display(),
                tmp = env.tmp.path().display(),
                bin = bin.display(),
                major = real.major,
            ),
        )
        .unwrap();
        std::fs::write(
            dir.join(format!("node-{n}.env")),
            format!("GPUFENCE_CONFIG={}\n", config(n).display()),
        )
        .unwrap();
    }
    for which in ["prolog", "epilog"] {
        let p = bin.join(format!("{which}.sh"));
        std::fs::write(
            &p,
            format!(
                "#!/bin/sh\nexec {}/gpufence-{which} --config {}/gpufence-$SLURMD_NODENAME.toml\n",
                bin.display(),
                bin.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::write(
        bin.join("slurmd-v2node"),
        format!(
            "#!/bin/sh\nif grep -qv '^0::' /proc/self/cgroup; then\n    LD_PRELOAD={}/proc-cgroup-v2only.so exec /usr/sbin/slurmd \"$@\"\nfi\nexec /usr/sbin/slurmd \"$@\"\n",
            dir.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(
        bin.join("slurmd-v2node"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    // The plugin reads its config from GPUFENCE_CONFIG (per slurmd).
    std::fs::write(
        dir.join("plugstack.conf"),
        format!("required {}/gpufence.so\n", bin.display()),
    )
    .unwrap();
    std::fs::write(
        dir.join("gres.conf"),
        format!(
            "NodeName=gfn1 Name=gpu Type=sim File={}\nNodeName=gfn1 Name=gpu Type=sim File={}\n\
             NodeName=gfn2 Name=gpu Type=sim File={}\nNodeName=gfn2 Name=gpu Type=held File={}\n",
            a3.display(),
            a1.display(),
            b5.display(),
            held.display()
        ),
    )
    .unwrap();
    std::fs::write(dir.join("cgroup.conf"), gpufence_tests::v2node::CGROUP_CONF).unwrap();
    std::fs::write(
        dir.join("slurm-extra.conf"),
        format!(
            "NodeName=gfn1 NodeHostname={host} NodeAddr=127.0.0.1 Port={p1} CPUs=2 RealMemory=2000 Gres=gpu:sim:2 State=UNKNOWN\n\
             NodeName=gfn2 NodeHostname={host} NodeAddr=127.0.0.1 Port={p2} CPUs=2 RealMemory=2000 Gres=gpu:sim:1,gpu:held:1 State=UNKNOWN\n\
             SlurmdSpoolDir={d}/spool/%n\nSlurmdLogFile={d}/log/slurmd-%n.log\nSlurmdPidFile={d}/run/slurmd-%n.slurm-pid\n\
             ProctrackType=proctrack/cgroup\nTaskPlugin=task/cgroup\nPrologFlags=Alloc,Contain\n\
             PlugStackConfig={d}/plugstack.conf\nProlog={b}/prolog.sh\nEpilog={b}/epilog.sh\n",
            host = hostname(),
            p1 = port + 2,
            p2 = port + 3,
            d = dir.display(),
            b = bin.display(),
        ),
    )
    .unwrap();
    let cg = format!("{}/slurmd-%n.service", env.cg.path(SLICE).display());
    let pins: Vec<PathBuf> = nodes
        .iter()
        .map(|n| PathBuf::from(format!("{}-{n}", env.bpffs.display())))
        .collect();
    struct Unpin(Vec<PathBuf>);
    impl Drop for Unpin {
        fn drop(&mut self) {
            for p in &self.0 {
                let _ = gpufence_cgroup::fence::Fence::remove(p);
            }
        }
    }
    let _unpin = Unpin(pins);
    let out = cluster_sh_start_nodes(&dir, port, &cg, &nodes);
    let cluster = Cluster {
        slurm_conf: dir.join("slurm.conf"),
        dir: dir.clone(),
        bin: bin.clone(),
        config: config("gfn1"),
        slurmd_cgroup: env.cg.path(SLICE),
        root: None,
    };
    let log = |n: &str| {
        std::fs::read_to_string(dir.join(format!("log/slurmd-{n}.log"))).unwrap_or_default()
    };
    assert!(
        out.status.success(),
        "{}\n{}\n{}",
        both(&out),
        log("gfn1"),
        log("gfn2")
    );

    let probe_s = bin.join("gpufence-probe").display().to_string();
    let all = [&a3, &a1, &b5, &held]
        .map(|p| p.display().to_string())
        .join(" ");
    let script = format!("{probe_s} open {all} | sed \"s/^/$SLURMD_NODENAME /\"");
    // A job on both nodes, one sim GPU on each.
    let o = cluster.as_user(
        "srun",
        &[
            "-N2",
            "--ntasks-per-node=1",
            "--gres=gpu:sim:1",
            "sh",
            "-c",
            &script,
        ],
    );
    let out = stdout(&o);
    assert!(
        o.status.success(),
        "{}\n{}\n{}",
        both(&o),
        log("gfn1"),
        log("gfn2")
    );
    let on =
        |out: &str, node: &str, dev: &PathBuf| verdict(out, format!("{node} {}", dev.display()));
    assert_eq!(
        [on(&out, "gfn1", &a3), on(&out, "gfn1", &a1)]
            .iter()
            .filter(|v| *v == "ENXIO")
            .count(),
        1,
        "gfn1: one of its own GPUs:\n{out}"
    );
    assert_eq!(
        (on(&out, "gfn1", &b5), on(&out, "gfn1", &held)),
        ("EPERM".to_string(), "EPERM".to_string()),
        "gfn1: nothing of gfn2's:\n{out}"
    );
    assert_eq!(
        (
            on(&out, "gfn2", &b5),
            on(&out, "gfn2", &a3),
            on(&out, "gfn2", &a1),
            on(&out, "gfn2", &held)
        ),
        (
            "ENXIO".to_string(),
            "EPERM".to_string(),
            "EPERM".to_string(),
            "EPERM".to_string()
        ),
        "gfn2: its sim GPU only:\n{out}"
    );
    // Both types on gfn2 (Slurm's Prolog environment lists only the last
    // type's index: the Prolog asks slurmctld and grants both).
    let o = cluster.as_user(
        "srun",
        &[
            "-w",
            "gfn2",
            "--gres=gpu:sim:1,gpu:held:1",
            "sh",
            "-c",
            &script,
        ],
    );
    let out = stdout(&o);
    assert!(o.status.success(), "{}\n{}", both(&o), log("gfn2"));
    assert_eq!(
        (
            on(&out, "gfn2", &b5),
            on(&out, "gfn2", &held),
            on(&out, "gfn2", &a3)
        ),
        ("ENXIO".to_string(), "ok".to_string(), "EPERM".to_string()),
        "gfn2: both types:\n{out}"
    );
    // Each node's audit log holds its own grants only, and no grant is left.
    for n in nodes {
        let lines = gpufence_tests::audit_log(&env.path(&format!("log/audit-{n}.jsonl")));
        let applied: Vec<&Value> = lines
            .iter()
            .filter(|e| e["event"] == "grant_applied")
            .collect();
        assert!(!applied.is_empty(), "{n}: {lines:?}");
        for a in applied {
            assert!(
                a["cgroup"]
                    .as_str()
                    .unwrap_or("")
                    .starts_with(&format!("/{}/", V2Slice::scope(n))),
                "{n} granted outside its scope: {a}"
            );
        }
    }
    assert!(
        Cluster::wait_for(Duration::from_secs(20), || nodes.iter().all(|n| {
            let o = std::process::Command::new(bin.join("gpufence"))
                .arg("--config")
                .arg(config(n))
                .args(["grants", "--json"])
                .output()
                .unwrap();
            serde_json::from_slice::<Value>(&o.stdout).ok() == Some(serde_json::json!([]))
        })),
        "grants left"
    );
    for n in nodes {
        slice.assert_no_job_cgroups(n, &cluster.dir.join("log"), &Release::host());
    }
    drop(cluster);
}

/// slurmd in a container (Kubernetes-hosted Slurm such as Slinky or
/// soperator, any `unshare --cgroup`): a cgroup namespace rooted at a cgroup
/// of the test's own, cgroup2 mounted inside it, slurmd in the container's
/// `system.slice/slurmd.service`, gpufence's default layout with
/// `cgroup_root = "system.slice"` as the container sees it. Cgroup paths
/// there are relative to the namespace's root while the kernel counts
/// levels from the true root: jobs must open exactly their GPUs, and
/// `gpufence doctor`, run inside the container, must say what the kernel
/// does.
#[test]
fn slurmd_in_a_cgroup_namespace_22_05_host() {
    if privileged() {
        slurmd_in_a_cgroup_namespace(&Release {
            root: None,
            plugin: None,
        });
    }
}

/// [`slurmd_in_a_cgroup_namespace_22_05_host`] on 24.11 (Debian 13's
/// Slurm), which also reads `/proc/1/cgroup` for the root of its tree:
/// pid 1 is outside the namespace, as it is for `contrib/demo.sh` on a
/// Debian 13 host (`contrib/v2node/enter.sh` shows it at the root, as a
/// container's init would be).
#[test]
fn slurmd_in_a_cgroup_namespace_slurm_24_11_debian_trixie() {
    if let Some(r) = privileged().then(|| Release::debian("trixie")).flatten() {
        slurmd_in_a_cgroup_namespace(&r);
    }
}

fn slurmd_in_a_cgroup_namespace(release: &Release) {
    let _node = gpufence_tests::v2node::lock_node();
    let env = TestEnv::new("cgroupns");
    let d = Devices::make(&env);
    let container = env.cgroup("container");
    let host = hostname();
    let mut spec = spec(
        release,
        // (only its spec() is used: the node lives in the container)
        &V2Slice::unclaimed(),
        &d,
        &format!(
            "nvml = false\n[majors]\nnvidia = 195\nfake-held = {}\n",
            d.real.major
        ),
        false,
        "Alloc,Contain",
    );
    if let Some(v2) = spec.v2node.as_mut() {
        v2.slurmd_cgroup = env.cg.path(&container);
        v2.cgroupns = true;
    }
    let cluster = Cluster::start_with(&env, &spec);
    let slurmd = cluster.slurmd_pid().expect("slurmd");
    // What an admin runs in the container (kubectl exec): the CLI in
    // slurmd's cgroup and mount namespaces (and its root: a release's
    // root is chrooted).
    let in_container = |args: &[&str]| {
        std::process::Command::new("nsenter")
            .args(["-t", &slurmd.to_string(), "-m", "-C", "-r", "--"])
            .arg(cluster.bin.join("gpufence"))
            .arg("--config")
            .arg(&cluster.config)
            .args(args)
            .output()
            .expect("nsenter")
    };
    let probe_s = cluster.bin.join("gpufence-probe").display().to_string();
    let o = cluster.as_user(
        "srun",
        &[
            "--gres=gpu:sim:1",
            "sh",
            "-c",
            &format!("grep ^0:: /proc/self/cgroup; {probe_s} open {}", d.args()),
        ],
    );
    let out = stdout(&o);
    assert!(
        o.status.success(),
        "{}\n{}",
        both(&o),
        cluster.log_tail("slurmd.log")
    );
    assert!(
        out.starts_with("0::/system.slice/"),
        "the job sees namespace-relative paths:\n{out}"
    );
    let job = row(&out, &d);
    assert_eq!(
        job[..2].iter().filter(|v| *v == "ENXIO").count(),
        1,
        "the job opens its own GPU in the container:\n{out}"
    );
    assert_eq!(
        (job[2].as_str(), job[3].as_str()),
        ("EPERM", "ENXIO"),
        "{out}"
    );
    // The grant was recorded at the kernel's level of the job cgroup: the
    // container's own depth from the true root, plus the job's depth in
    // the container (system.slice/<node>_slurmstepd.scope/job_<id>).
    let audit = gpufence_tests::audit_log(&env.path("log/audit.jsonl"));
    let applied = audit
        .iter()
        .find(|e| e["event"] == "grant_applied")
        .unwrap_or_else(|| panic!("no grant_applied: {audit:?}"));
    assert_eq!(
        applied["cgroup_level"].as_u64(),
        Some((container.split('/').count() + 3) as u64),
        "{applied}"
    );
    // A user's process in the container outside every job.
    let outside = format!("{container}/system.slice/outside.service");
    env.cg.create(&outside).unwrap();
    let o = env
        .user_command_in(&outside, cluster.bin.join("gpufence-probe"))
        .arg("open")
        .args(d.all())
        .output()
        .unwrap();
    assert_eq!(
        row(&stdout(&o), &d),
        ["EPERM"; 4].map(String::from),
        "outsider in the container:\n{}",
        stdout(&o)
    );
    // doctor, for a running job's task, agrees with what the kernel did.
    let flag = env.path("jobs/opened");
    let o = cluster.as_user(
        "sbatch",
        &[
            "--gres=gpu:sim:1",
            "-o",
            "/dev/null",
            "--wrap",
            &format!(
                "{probe_s} open {} > {f}.tmp; mv {f}.tmp {f}; sleep 60",
                d.args(),
                f = flag.display()
            ),
        ],
    );
    assert!(o.status.success(), "{}", both(&o));
    let batch: u32 = stdout(&o)
        .split_whitespace()
        .last()
        .and_then(|w| w.parse().ok())
        .expect("batch job id");
    assert!(
        Cluster::wait_for(Duration::from_secs(30), || flag.exists()),
        "batch job {batch} did not run:\n{}",
        cluster.log_tail("slurmd.log")
    );
    let opened = std::fs::read_to_string(&flag).unwrap();
    let task_cg = format!(
        "{container}/system.slice/{host}_slurmstepd.scope/job_{batch}/step_batch/user/task_0"
    );
    let task: i32 = std::fs::read_to_string(env.cg.path(&task_cg).join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .next()
        .and_then(|l| l.trim().parse().ok())
        .unwrap_or_else(|| panic!("no task in /{task_cg}"));
    let o = in_container(&["doctor", "--json", &task.to_string()]);
    let doc: Value = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("doctor JSON: {e}: {}", both(&o)));
    for p in d.all() {
        let kernel = verdict(&opened, p);
        let said = doc["devices"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|v| {
                v["path"]
                    .as_str()
                    .is_some_and(|s| s.contains(&*p.display().to_string()))
            })
            .map(|v| v["verdict"].as_str().unwrap_or("").to_string())
            .unwrap_or_else(|| format!("missing in {doc}"));
        let want = if kernel == "EPERM" {
            "denied"
        } else {
            "allowed"
        };
        assert_eq!(
            said,
            want,
            "{}: the kernel said {kernel}; doctor: {doc}",
            p.display()
        );
    }
    let o = cluster.admin("scancel", &[&batch.to_string()]);
    assert!(o.status.success(), "{}", both(&o));
    assert!(
        Cluster::wait_for(Duration::from_secs(20), || {
            let g = in_container(&["grants", "--json"]);
            serde_json::from_slice::<Value>(&g.stdout).ok() == Some(serde_json::json!([]))
        }),
        "grants left"
    );
    drop(cluster);
}

/// slurmd running in a fenced cgroup that no exemption covers (an admin
/// who runs it as `slurmd-other.service`): slurmd start names the cgroup
/// and the line to add, once; jobs still run.
#[test]
fn slurmd_outside_its_exemption_is_named_22_05_host() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("unexempt");
    let d = Devices::make(&env);
    let slice = V2Slice::claim();
    let other = format!("{SLICE}/slurmd-other.service");
    env.cg.create(&other).unwrap();
    let mut s = spec(
        &Release {
            root: None,
            plugin: None,
        },
        &slice,
        &d,
        "nvml = false\n[majors]\nnvidia = 195\n",
        false,
        "Alloc,Contain",
    );
    if let Some(v2) = s.v2node.as_mut() {
        v2.slurmd_cgroup = env.cg.path(&other);
    }
    let cluster = Cluster::start_with(&env, &s);
    let log = std::fs::read_to_string(cluster.dir.join("log/slurmd.log")).unwrap_or_default();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("no exempt_cgroups entry covers"))
        .collect();
    assert_eq!(lines.len(), 1, "{log}");
    assert!(
        lines[0].contains(&format!("slurmd runs in /{other}"))
            && lines[0].contains(&format!("add \"{other}\" to exempt_cgroups")),
        "{}",
        lines[0]
    );
    drop(cluster);
}

/// `sbatch --get-user-env`: slurmd runs `su - <user>` as its own child, in
/// its own cgroup (`system.slice/slurmd.service`, which the default config
/// exempts), so the user's `~/.bash_profile` runs there as the user. A
/// daemon it starts with `setsid -f` stays in slurmd's cgroup; the fence's
/// exemption covers system accounts only, so it opens no NVIDIA device.
#[test]
fn get_user_env_daemon_in_slurmds_cgroup_22_05_host() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("getuserenv");
    let d = Devices::make(&env);
    let slice = V2Slice::claim();
    let host = hostname();
    let extra = format!(
        "nvml = false\n[majors]\nnvidia = 195\nfake-held = {}\n",
        d.real.major
    );
    let cluster = Cluster::start_with(
        &env,
        &spec(
            &Release {
                root: None,
                plugin: None,
            },
            &slice,
            &d,
            &extra,
            false,
            "Alloc,Contain",
        ),
    );
    // What the daemon reports, in a directory the test user may write.
    let dir = env.path("getuserenv");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let armed = dir.join("armed");
    std::fs::write(&armed, "").unwrap();
    std::fs::set_permissions(&armed, std::os::unix::fs::PermissionsExt::from_mode(0o666)).unwrap();
    let out = dir.join("daemon.out");
    let probe = cluster.bin.join("gpufence-probe");
    let profile = Profile::install(&format!(
        "[ -e {armed} ] && rm -f {armed} && setsid -f sh -c 'echo PID=$$; echo CG=$(grep ^0:: /proc/self/cgroup); {probe} open {devs}; exec sleep 120' </dev/null >{out}.tmp 2>&1 && sleep 1 && mv {out}.tmp {out}\n",
        armed = armed.display(),
        probe = probe.display(),
        devs = d.args(),
        out = out.display(),
    ));
    let o = cluster.as_user(
        "sbatch",
        &[
            "--get-user-env",
            "--wait",
            "-o",
            "/dev/null",
            "--wrap",
            "true",
        ],
    );
    assert!(o.status.success(), "{}", both(&o));
    assert!(
        Cluster::wait_for(Duration::from_secs(20), || out.exists()),
        "the user's login script never ran (slurmd's su - for --get-user-env):\n{}",
        cluster.log_tail("slurmd.log")
    );
    drop(profile);
    let text = std::fs::read_to_string(&out).unwrap();
    let pid: i32 = field(&text, "PID").and_then(|p| p.parse().ok()).unwrap();
    // The premise: the user's daemon runs in slurmd's (exempt) cgroup.
    assert!(
        field(&text, "CG").is_some_and(|c| c.ends_with("/system.slice/slurmd.service")),
        "{text}"
    );
    assert_eq!(
        row(&text, &d),
        ["EPERM", "EPERM", "EPERM", "EPERM"].map(String::from),
        "a user's daemon in slurmd's cgroup opens nothing:\n{text}"
    );
    // The sweep names it only if it holds something; doctor agrees.
    let o = cluster.gpufence(&["doctor", "--json", &pid.to_string()]);
    let doc: Value = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("doctor JSON: {e}: {}", both(&o)));
    assert!(
        doc["devices"]
            .as_array()
            .unwrap()
            .iter()
            .all(|v| v["verdict"] == "denied"),
        "{doc:#}"
    );
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status();
    let _ = host;
    drop(cluster);
}

/// Issue 33, point 2: a user of uid 600 (a site migrated from old RHEL's
/// UID_MIN 500) submits `sbatch --get-user-env`. slurmd runs `su - <user>`
/// in its own cgroup before it checks the job (`_rpc_batch_job` calls
/// `_get_user_env` before the revoked credential is seen,
/// src/slurmd/slurmd/req.c, 22.05 through master), even though the Prolog
/// refuses the job (a uid at or below `protected_uid_max`); the daemon the
/// user's `~/.profile` starts there with `setsid -f` stays in slurmd's
/// cgroup. slurmd's exemption (a bare entry: root only) does not cover uid
/// 600, so it opens no NVIDIA device. `prolog_flags`: `Alloc,Contain` on
/// 22.05; `Alloc,Contain,RunInJob` on 24.11 and 26.05, where the Prolog
/// runs in the job's extern step and slurmd still forks the `su -`.
fn get_user_env_daemon_of_uid_600(release: &Release, prolog_flags: &str) {
    let env = TestEnv::new("getuserenv600");
    let d = Devices::make(&env);
    let slice = V2Slice::claim();
    let extra = format!(
        "nvml = false\n[majors]\nnvidia = 195\nfake-held = {}\n",
        d.real.major
    );
    let cluster = Cluster::start_with(
        &env,
        &spec(release, &slice, &d, &extra, false, prolog_flags),
    );
    let low = gpufence_tests::cluster::LowUser::create(
        "gpufence-low600",
        Some(600),
        &env.path("home-low600"),
        release.root.as_deref(),
    );
    let dir = env.path("getuserenv600");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let armed = dir.join("armed");
    std::fs::write(&armed, "").unwrap();
    std::fs::set_permissions(&armed, std::os::unix::fs::PermissionsExt::from_mode(0o666)).unwrap();
    let out = dir.join("daemon.out");
    let probe = cluster.bin.join("gpufence-probe");
    std::fs::write(
        low.home.join(".profile"),
        format!(
            "[ -e {armed} ] && rm -f {armed} && setsid -f sh -c 'echo PID=$$; echo UID=$(id -u); echo CG=$(grep ^0:: /proc/self/cgroup); {probe} open {devs}; exec sleep 120' </dev/null >{out}.tmp 2>&1 && sleep 1 && mv {out}.tmp {out}\n",
            armed = armed.display(),
            probe = probe.display(),
            devs = d.args(),
            out = out.display(),
        ),
    )
    .unwrap();
    let v = release.slurm_version();
    let o = low
        .cmd(&cluster, "sbatch")
        .args([
            "--get-user-env",
            "--parsable",
            "-o",
            "/dev/null",
            "--wrap",
            "true",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{v}: sbatch: {}", both(&o));
    let job = stdout(&o).trim().to_string();
    let ran = Cluster::wait_for(Duration::from_secs(30), || out.exists());
    let _ = cluster.admin("scancel", &[&job]);
    assert!(
        ran,
        "{v}: the login script of uid {} never ran (slurmd's su - for --get-user-env):\n{}",
        low.uid,
        cluster.log_tail("slurmd.log")
    );
    let text = std::fs::read_to_string(&out).unwrap();
    // The premise: uid 600's daemon runs in slurmd's (exempt) cgroup
    // (26.05's slurmd runs in a `slurmd` child of its unit's cgroup).
    assert_eq!(
        field(&text, "UID"),
        Some(low.uid.to_string()),
        "{v}: {text}"
    );
    assert!(
        field(&text, "CG").is_some_and(|c| c.ends_with("/system.slice/slurmd.service")
            || c.ends_with("/system.slice/slurmd.service/slurmd")),
        "{v}: {text}"
    );
    assert_eq!(
        row(&text, &d),
        ["EPERM", "EPERM", "EPERM", "EPERM"].map(String::from),
        "{v}: uid 600's daemon in slurmd's cgroup opens nothing:\n{text}"
    );
    drop(low);
    drop(cluster);
}

#[test]
fn get_user_env_daemon_of_uid_600_is_fenced_22_05_host() {
    if !privileged() {
        return;
    }
    get_user_env_daemon_of_uid_600(
        &Release {
            root: None,
            plugin: None,
        },
        "Alloc,Contain",
    );
}

#[test]
fn get_user_env_daemon_of_uid_600_is_fenced_run_in_job_slurm_24_11_debian_trixie() {
    if let Some(r) = privileged().then(|| Release::debian("trixie")).flatten() {
        get_user_env_daemon_of_uid_600(&r, "Alloc,Contain,RunInJob");
    }
}

#[test]
fn get_user_env_daemon_of_uid_600_is_fenced_run_in_job_slurm_26_05_debian_sid() {
    if let Some(r) = privileged().then(|| Release::debian("sid")).flatten() {
        get_user_env_daemon_of_uid_600(&r, "Alloc,Contain,RunInJob");
    }
}

/// The test user's `~/.bash_profile` replaced for one test, put back on
/// drop.
struct Profile {
    path: PathBuf,
    old: Option<Vec<u8>>,
}

impl Profile {
    fn install(text: &str) -> Profile {
        let home = std::process::Command::new("getent")
            .args(["passwd", gpufence_tests::cluster::TEST_USER])
            .output()
            .map(|o| stdout(&o))
            .unwrap_or_default();
        let home = home
            .trim()
            .split(':')
            .nth(5)
            .expect("the test user's home")
            .to_string();
        let path = PathBuf::from(home).join(".bash_profile");
        let old = std::fs::read(&path).ok();
        std::fs::write(&path, text).unwrap();
        Profile { path, old }
    }
}

impl Drop for Profile {
    fn drop(&mut self) {
        let _ = match &self.old {
            Some(b) => std::fs::write(&self.path, b),
            None => std::fs::remove_file(&self.path),
        };
    }
}

/// 24.11 with `LogTimeFormat=iso8601_ms,format_stderr`: `slurmd -G` prints
/// every line as `[<time>] Gres Name=...` (the 25.05+ shape) on a running
/// node; the plugin and the Prolog read it, and a job opens its own GPU
/// and not the other.
#[test]
fn slurmd_g_with_format_stderr_slurm_24_11_debian_trixie() {
    let Some(release) = privileged().then(|| Release::debian("trixie")).flatten() else {
        return;
    };
    let env = TestEnv::new("formatstderr");
    let d = Devices::make(&env);
    let slice = V2Slice::claim();
    let host = hostname();
    let extra = format!(
        "nvml = false\n[majors]\nnvidia = 195\nfake-held = {}\n",
        d.real.major
    );
    let mut spec = spec(&release, &slice, &d, &extra, false, "Alloc,Contain");
    if let Some(v) = spec.v2node.as_mut() {
        v.slurm_conf
            .push_str("LogTimeFormat=iso8601_ms,format_stderr\n");
    }
    let cluster = Cluster::start_with(&env, &spec);
    let probe = cluster.bin.join("gpufence-probe").display().to_string();
    let o = cluster.as_user(
        "srun",
        &[
            "--gres=gpu:sim:1",
            "sh",
            "-c",
            &format!("{probe} open {} {}", d.n3.display(), d.n1.display()),
        ],
    );
    assert!(
        o.status.success(),
        "{}\n{}",
        both(&o),
        cluster.log_tail("slurmd.log")
    );
    let out = stdout(&o);
    let mut got = [verdict(&out, &d.n3), verdict(&out, &d.n1)];
    got.sort();
    assert_eq!(got, ["ENXIO", "EPERM"], "{out}");
    // The shape that was parsed: slurmd -G's own lines, as cached.
    let cache = std::fs::read_to_string(env.path(&format!("state/slurmd-G-{host}.txt")))
        .unwrap_or_default();
    let gres: Vec<&str> = cache
        .lines()
        .filter(|l| l.contains("Gres Name=gpu"))
        .collect();
    assert_eq!(gres.len(), 3, "{cache}");
    assert!(
        gres.iter()
            .all(|l| l.starts_with('[') && l.contains("] Gres Name=gpu")),
        "every line time-stamped:\n{cache}"
    );
    drop(cluster);
}

/// A job hands its GPU's descriptor to two processes outside the job that
/// keep it only in an io_uring: one in a ring whose own descriptor was
/// registered (`IORING_REGISTER_RING_FDS`) and closed, one in a ring in a
/// thread's private descriptor table (`unshare(CLONE_FILES)`). Neither
/// shows the device in `/proc/<pid>/fd`; the Epilog finds both at job end,
/// keeps evidence and ends them.
#[test]
fn io_uring_holds_outside_the_job_are_ended_22_05_host() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("v2ring");
    let d = Devices::make(&env);
    let slice = V2Slice::claim();
    env.cg.create(OUTSIDE).unwrap();
    let extra = format!(
        "term_grace_ms = 1000\nnvml = false\n[majors]\nnvidia = 195\nfake-held = {}\n",
        d.real.major
    );
    let cluster = Cluster::start_with(
        &env,
        &spec(
            &Release {
                root: None,
                plugin: None,
            },
            &slice,
            &d,
            &extra,
            false,
            "Alloc,Contain",
        ),
    );
    let audit = env.path("log/audit.jsonl");
    let probe = cluster.bin.join("gpufence-probe");
    let mut receivers = Vec::new();
    for ring in ["registered", "thread"] {
        let sock = env.path(&format!("jobs/ring-{ring}.sock"));
        let mut recv = env.user_command_in(OUTSIDE, &probe);
        recv.arg("recvfd").arg(format!("--ring={ring}")).arg(&sock);
        let mut child = recv.stdout(std::process::Stdio::piped()).spawn().unwrap();
        let pid = child.id() as i32;
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        assert_eq!(line.trim(), "listening", "{ring}");
        std::mem::forget(child);
        receivers.push((ring, pid, sock, out));
    }
    let sends: Vec<String> = receivers
        .iter()
        .map(|(_, _, sock, _)| {
            format!(
                "{} sendfd {} {}",
                probe.display(),
                sock.display(),
                d.held.display()
            )
        })
        .collect();
    let o = cluster.as_user(
        "srun",
        &[
            "--gres=gpu:held:1",
            "sh",
            "-c",
            &format!("echo JOB=$SLURM_JOB_ID; {}", sends.join("; ")),
        ],
    );
    let out = stdout(&o);
    assert!(
        o.status.success() && out.matches("sent").count() == 2,
        "{}",
        both(&o)
    );
    let job: u32 = field(&out, "JOB").unwrap().parse().unwrap();
    for (ring, pid, _, out) in &mut receivers {
        let mut line = String::new();
        std::io::BufRead::read_line(out, &mut line).unwrap();
        assert_eq!(line.trim(), "received", "{ring}");
        // Not in any descriptor table the process shows.
        let fds: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .flatten()
            .filter_map(|e| std::fs::read_link(e.path()).ok())
            .map(|t| t.display().to_string())
            .collect();
        assert!(
            !fds.iter().any(|f| f.contains("nvidia-held")),
            "{ring}: {fds:?}"
        );
    }
    let pids: Vec<i32> = receivers.iter().map(|(_, p, _, _)| *p).collect();
    // Gone first, then audited: wait for both (the Epilog writes
    // process_killed once it has seen each exit).
    let killed = || -> Vec<i64> {
        gpufence_tests::audit_log(&audit)
            .into_iter()
            .filter(|e| e["job_id"] == job && e["event"] == "process_killed")
            .filter_map(|e| e["pid"].as_i64())
            .collect()
    };
    assert!(
        Cluster::wait_for(Duration::from_secs(30), || pids.iter().all(|p| gone(*p))
            && killed().len() >= pids.len()),
        "the Epilog did not end {pids:?}: {:?}\n{}",
        events_for(&audit, job),
        cluster.log_tail("slurmd.log")
    );
    let killed = killed();
    for p in &pids {
        assert!(killed.contains(&i64::from(*p)), "{killed:?} {pids:?}");
        let ev = std::fs::read_dir(env.path("evidence"))
            .unwrap()
            .flatten()
            .any(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with(&format!("job{job}-pid{p}-"))
            });
        assert!(ev, "evidence for {p}");
    }
    let mut state = String::new();
    assert!(
        Cluster::wait_for(Duration::from_secs(20), || {
            state = stdout(&cluster.as_user("sinfo", &["-h", "-o", "%T"]))
                .trim()
                .to_string();
            state == "idle"
        }),
        "node {state}"
    );
    drop(cluster);
}

/// Another SPANK plugin listed *before* gpufence.so in plugstack.conf opens
/// the GPUs from its own `slurm_spank_task_init`, as Pyxis (Enroot) starts
/// a job's container from there (`tests/spank-probe/order_probe.c`, built
/// against the release's own `<slurm/spank.h>`). The job's grant is in
/// place by then, whatever the order: gpufence grants in
/// `slurm_spank_init`, which slurmstepd runs for every plugin before any
/// task callback. The job's GPU opens (ENXIO), the other GPU and the
/// held device are denied (EPERM).
fn plugin_before_gpufence(release: &Release) {
    let env = TestEnv::new("v2order");
    let d = Devices::make(&env);
    let slice = V2Slice::claim();
    let plugin = env.path("order_probe.so");
    gpufence_tests::cluster::build_order_probe(release.root.as_deref(), &plugin);
    let opened = env.path("jobs/order-probe.txt");
    let cluster = Cluster::start_with(
        &env,
        &ClusterSpec {
            plugstack_first: Some(format!(
                "optional {} out={} dev={} dev={} dev={}",
                plugin.display(),
                opened.display(),
                d.n3.display(),
                d.n1.display(),
                d.held.display()
            )),
            ..spec(release, &slice, &d, "", false, "Alloc,Contain")
        },
    );
    let o = cluster.as_user(
        "srun",
        &[
            "--gres=gpu:sim:1",
            "sh",
            "-c",
            "echo GPUS=${SLURM_STEP_GPUS:-$SLURM_JOB_GPUS}",
        ],
    );
    assert!(
        o.status.success(),
        "{}\n{}",
        both(&o),
        cluster.log_tail("slurmd.log")
    );
    let index: usize = field(&stdout(&o), "GPUS")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("one GPU index: {}", stdout(&o)));
    let said = std::fs::read_to_string(&opened).unwrap_or_default();
    let (mine, other) = if index == 0 {
        (&d.n3, &d.n1)
    } else {
        (&d.n1, &d.n3)
    };
    for (dev, want) in [(mine, "ENXIO"), (other, "EPERM"), (&d.held, "EPERM")] {
        assert!(
            said.lines()
                .any(|l| l == format!("{} {want}", dev.display())),
            "{}: {} should be {want} in a plugin's task_init before gpufence's:\n{said}\n{}",
            release.slurm_version(),
            dev.display(),
            cluster.log_tail("slurmd.log")
        );
    }
}

#[test]
fn plugin_before_gpufence_sees_the_grant_22_05_host() {
    if !privileged() {
        return;
    }
    plugin_before_gpufence(&Release {
        root: None,
        plugin: None,
    });
}

#[test]
fn plugin_before_gpufence_sees_the_grant_24_11_debian_trixie() {
    if !privileged() {
        return;
    }
    if let Some(r) = Release::debian("trixie") {
        plugin_before_gpufence(&r);
    }
}

#[test]
fn plugin_before_gpufence_sees_the_grant_26_05_debian_sid() {
    if !privileged() {
        return;
    }
    if let Some(r) = Release::debian("sid") {
        plugin_before_gpufence(&r);
    }
}

/// A node whose one GRES GPU is the real, holdable stand-in
/// (`nvidia-held`), shared as `kind` (`shard`: 4 shards; `mps`: 100 MPS
/// units); `nvidia3` (195:3) is a GPU of the node that no job is given.
/// `gpufence_extra`: top-level keys only (a `[majors]` table follows).
/// Six CPUs: several jobs run side by side.
fn shared_gpu_spec(
    release: &Release,
    slice: &V2Slice,
    d: &Devices,
    kind: &str,
    gpufence_extra: &str,
) -> ClusterSpec {
    let (count, node_gres) = match kind {
        "shard" => (4, "gpu:held:1,shard:4"),
        _ => (100, "gpu:held:1,mps:100"),
    };
    // The stand-in's misc major is protected as an NVIDIA major would be
    // (only in the test's fence, attached at the test's own system.slice).
    let extra = format!(
        "nvml = false\n{gpufence_extra}[majors]\nnvidia = 195\nfake-held = {}\n",
        d.real.major
    );
    let mut s = spec(release, slice, d, &extra, false, "Alloc,Contain");
    if let Some(v2) = s.v2node.as_mut() {
        v2.slurm_conf += &format!("GresTypes=gpu,{kind}\n");
    }
    ClusterSpec {
        gres_conf: format!(
            "Name=gpu Type=held File={held}\nName={kind} Count={count} File={held}\n",
            held = d.held.display()
        ),
        node_gres: node_gres.into(),
        cpus: Some(6),
        ..s
    }
}

/// The pid a job printed as `PID=` (its batch shell, which then execs the
/// holder).
fn printed_pid(text: &str) -> i32 {
    text.split_whitespace()
        .find_map(|w| w.strip_prefix("PID="))
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("PID= in {text}"))
}

/// What the Epilog of `job` did to process `pid`: the events naming it.
fn events_on(audit: &Path, job: u32, pid: i32) -> Vec<String> {
    gpufence_tests::audit_log(audit)
        .into_iter()
        .filter(|e| e["job_id"] == job && e["pid"] == pid)
        .map(|e| e["event"].as_str().unwrap_or("").to_string())
        .collect()
}

/// gres/shard: two users' jobs with shards of one GPU each open that GPU
/// and not the node's other GPU, hold it side by side, and the first to
/// end leaves the other's holder alone (it is covered by the other job's
/// grant); then the node is clean and idle.
fn shard_co_tenants(release: &Release) {
    let env = TestEnv::new("v2shard");
    let d = Devices::make(&env);
    let slice = V2Slice::claim();
    let peer = gpufence_tests::cluster::PeerUser::create(release.root.as_deref());
    let cluster = Cluster::start_with(&env, &shared_gpu_spec(release, &slice, &d, "shard", ""));
    let epilog_env = env.path("epilog-env");
    cluster.keep_epilog_env(&epilog_env);
    let audit = env.path("log/audit.jsonl");
    let probe = cluster.bin.join("gpufence-probe").display().to_string();
    let script = format!(
        "echo JOB=$SLURM_JOB_ID PID=$$ GPUS=$SLURM_JOB_GPUS; {probe} open {held} {n3}; exec {probe} hold {held}",
        held = d.held.display(),
        n3 = d.n3.display()
    );
    let (out_a, out_b) = (env.path("jobs/shard-a.out"), env.path("jobs/shard-b.out"));
    let a = sbatch_as(
        cluster.user_cmd("sbatch"),
        &["--gres=shard:2"],
        &out_a,
        &script,
    );
    let text_a = wait_output(&cluster, &out_a, "held");
    let b = sbatch_as(
        peer.cmd(&cluster, "sbatch"),
        &["--gres=shard:2"],
        &out_b,
        &script,
    );
    let text_b = wait_output(&cluster, &out_b, "held");
    for (who, text) in [("first user", &text_a), ("second user", &text_b)] {
        assert_eq!(
            (verdict(text, &d.held), verdict(text, &d.n3)),
            ("ok".to_string(), "EPERM".to_string()),
            "{}: the {who}'s shard job opens its GPU and not the other:\n{text}",
            release.slurm_version()
        );
    }
    let (pid_a, pid_b) = (printed_pid(&text_a), printed_pid(&text_b));
    assert_eq!(gpufence_node::host::procs::uid_of(pid_b), Some(peer.uid));
    end_job(&cluster, &env, a);
    assert!(gone(pid_a), "job {a}'s holder outlived it");
    assert!(
        !gone(pid_b) && job_state(&cluster, b) == "RUNNING",
        "{}: job {a}'s end touched the co-tenant job {b} (holder {pid_b}): {:?}\n{}",
        release.slurm_version(),
        events_on(&audit, a, pid_b),
        cluster.log_tail("slurmd.log")
    );
    assert_eq!(events_on(&audit, a, pid_b), Vec::<String>::new());
    // Issue 34: slurmd runs job a's Epilog a second time (a lost
    // EPILOG_COMPLETE before 26.05), with the environment it gave the
    // first, while the other user's job b holds the shared GPU: one line,
    // exit 0, and b's grant, holder and node untouched.
    let before = gpufence_tests::audit_log(&audit).len();
    let grants = |job: u32| job_grants(&cluster, job);
    let b_grants = grants(b);
    assert!(b_grants > 0, "job {b} holds a grant");
    let o = cluster.replay_epilog(&epilog_env, a);
    assert!(
        o.status.success(),
        "{}: the second Epilog of job {a}: {}",
        release.slurm_version(),
        both(&o)
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
    assert_eq!(again[0]["job_id"], a);
    assert!(!gone(pid_b) && job_state(&cluster, b) == "RUNNING");
    assert_eq!(grants(b), b_grants, "job {b}'s grant is untouched");
    end_job(&cluster, &env, b);
    assert!(gone(pid_b));
    assert_node_clean(&cluster, &[a, b], &audit);
}

/// Issue 34, the simple case kept tested: job `a` of one user has the
/// node's whole GPU (`--gres=gpu:held:1`) and ends; job `b` of another
/// user then gets that same GPU and holds it; slurmd runs `a`'s Epilog a
/// second time with the environment it gave the first. One line, exit 0,
/// one `epilog_repeated` audit line, and `b`'s grant, holder and node
/// untouched.
fn whole_gpu_epilog_twice(release: &Release) {
    let env = TestEnv::new("v2twice");
    let d = Devices::make(&env);
    let slice = V2Slice::claim();
    let peer = gpufence_tests::cluster::PeerUser::create(release.root.as_deref());
    let cluster = Cluster::start_with(&env, &shared_gpu_spec(release, &slice, &d, "shard", ""));
    let epilog_env = env.path("epilog-env");
    cluster.keep_epilog_env(&epilog_env);
    let audit = env.path("log/audit.jsonl");
    let probe = cluster.bin.join("gpufence-probe").display().to_string();
    let script = |hold: bool| {
        format!(
            "echo JOB=$SLURM_JOB_ID PID=$$ GPUS=$SLURM_JOB_GPUS; {probe} open {held} {n3}; {}",
            if hold {
                format!("exec {probe} hold {}", d.held.display())
            } else {
                "echo held".into()
            },
            held = d.held.display(),
            n3 = d.n3.display()
        )
    };
    let (out_a, out_b) = (env.path("jobs/whole-a.out"), env.path("jobs/whole-b.out"));
    let a = sbatch_as(
        cluster.user_cmd("sbatch"),
        &["--gres=gpu:held:1"],
        &out_a,
        &script(false),
    );
    let text_a = wait_output(&cluster, &out_a, "held");
    assert_eq!(verdict(&text_a, &d.held), "ok", "job {a}: {text_a}");
    end_job(&cluster, &env, a);
    let b = sbatch_as(
        peer.cmd(&cluster, "sbatch"),
        &["--gres=gpu:held:1"],
        &out_b,
        &script(true),
    );
    let text_b = wait_output(&cluster, &out_b, "held");
    assert_eq!(
        (verdict(&text_b, &d.held), verdict(&text_b, &d.n3)),
        ("ok".to_string(), "EPERM".to_string()),
        "{}: job {b} opens the GPU job {a} had and not the other:\n{text_b}",
        release.slurm_version()
    );
    let pid_b = printed_pid(&text_b);
    assert_eq!(gpufence_node::host::procs::uid_of(pid_b), Some(peer.uid));
    let before = gpufence_tests::audit_log(&audit).len();
    let b_grants = job_grants(&cluster, b);
    assert!(b_grants > 0, "job {b} holds a grant");
    let o = cluster.replay_epilog(&epilog_env, a);
    assert!(
        o.status.success(),
        "{}: the second Epilog of job {a}: {}",
        release.slurm_version(),
        both(&o)
    );
    let said = both(&o);
    assert_eq!(
        said.lines().filter(|l| !l.trim().is_empty()).count(),
        1,
        "one line: {said}"
    );
    assert!(
        said.contains(&format!("job {a} was already ended")),
        "{said}"
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
    assert_eq!(again[0]["job_id"], a);
    assert!(
        !gone(pid_b) && job_state(&cluster, b) == "RUNNING",
        "{}: the second Epilog of job {a} touched job {b} (holder {pid_b})",
        release.slurm_version()
    );
    assert_eq!(
        job_grants(&cluster, b),
        b_grants,
        "job {b}'s grant is untouched"
    );
    end_job(&cluster, &env, b);
    assert!(gone(pid_b));
    assert_node_clean(&cluster, &[a, b], &audit);
}

/// `program` on this host as `uid` (its primary group, no other), with
/// nothing of the test's environment but `envs`: a user's process outside
/// every job.
fn as_uid(uid: u32, program: &Path, envs: &[(&str, &Path)]) -> std::process::Command {
    use std::os::unix::process::CommandExt;
    let gid = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
        .ok()
        .flatten()
        .map_or(uid, |u| u.gid.as_raw());
    let mut c = std::process::Command::new(program);
    c.env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .envs(envs.iter().copied())
        .current_dir("/")
        .uid(uid)
        .gid(gid);
    c
}

/// `echo quit | <control>` as `uid` ([`as_uid`] with `envs`): what a
/// user's `quit` to an MPS control daemon answers.
fn quit_as(uid: u32, control: &Path, envs: &[(&str, &Path)]) -> std::process::Output {
    use std::io::Write;
    use std::process::Stdio;
    let mut q = as_uid(uid, control, envs)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let _ = q.stdin.take().unwrap().write_all(b"quit\n");
    q.wait_with_output().unwrap()
}

/// gres/mps with gpufence's MPS daemons, one per GPU and user
/// (`mps_control`; here the stand-in `gpufence-mps-standin`, which serves
/// clients over its pipe directory and execs a server per user that holds
/// the GPU, as NVIDIA's does): the first MPS job of a user starts that
/// user's daemon in `<cgroup_root>/gpufence-mps/<gpu>-u<uid>`, its pipes
/// under `mps/<gpu>/u<uid>`, which only that uid reaches; jobs get their
/// user's `CUDA_MPS_PIPE_DIRECTORY`; a user's two jobs share one server,
/// which holds the GPU across the first one's end; another user's job gets
/// a server of its own. An outsider can neither reach a user's daemon nor
/// `quit` it nor take its server's descriptor; a process of another uid in
/// a daemon's cgroup is reported and ended by the next MPS Prolog; a
/// user's own `quit` ends only that user's daemon, and the user's next job
/// gets a fresh one. The daemon runs as its user: `start_server -uid 0`
/// (or the peer's uid) through the user's own pipe starts nothing. A user
/// who stops (`SIGSTOP`) their daemon and server and has their last two
/// jobs cancelled one second apart holds up neither those Epilogs nor the
/// peer's new MPS job's Prolog; the stopped daemon is ended all the same.
/// The last job of each user stops that user's daemon, no registration
/// and no grant is left, and the node is clean.
fn mps_co_tenants(release: &Release) {
    let env = TestEnv::new("v2mps");
    let d = Devices::make(&env);
    let slice = V2Slice::claim();
    let peer = gpufence_tests::cluster::PeerUser::create(release.root.as_deref());
    let bin = env.path("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let control = env.path("mps-control");
    std::fs::write(
        &control,
        format!(
            "#!/bin/sh\nexec {} --gpu {} \"$@\"\n",
            bin.join("gpufence-mps-standin").display(),
            d.held.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(
        &control,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let extra = format!(
        "mps_control = \"{}\"\nmps_dir = \"{}\"\n",
        control.display(),
        env.path("mps").display()
    );
    let cluster = Cluster::start_with(&env, &shared_gpu_spec(release, &slice, &d, "mps", &extra));
    let audit = env.path("log/audit.jsonl");
    let probe = cluster.bin.join("gpufence-probe");
    let standin = cluster.bin.join("gpufence-mps-standin");
    let script = format!(
        "echo JOB=$SLURM_JOB_ID PID=$$ PIPE=$CUDA_MPS_PIPE_DIRECTORY; {probe} open {held} {n3}; {client} client; exec {probe} hold {held}",
        probe = probe.display(),
        client = standin.display(),
        held = d.held.display(),
        n3 = d.n3.display()
    );
    let v = release.slurm_version();
    let leaf = format!("dev{}.{}", d.real.major, d.real.minor);
    let (ua, ub) = (test_uid(), peer.uid);
    let pipe = |uid: u32| env.path(&format!("mps/{leaf}/u{uid}/pipe"));
    let daemon_cg = |uid: u32| {
        slice
            .slurmd_cgroup()
            .parent()
            .unwrap()
            .join("gpufence-mps")
            .join(format!("{leaf}-u{uid}"))
    };
    let out = |n: &str| env.path(&format!("jobs/mps-{n}.out"));
    let submit_a = |n: &str| {
        sbatch_as(
            cluster.user_cmd("sbatch"),
            &["--gres=mps:20"],
            &out(n),
            &script,
        )
    };
    let check_job = |who: &str, text: &str, uid: u32| {
        assert_eq!(
            (verdict(text, &d.held), verdict(text, &d.n3)),
            ("ok".to_string(), "EPERM".to_string()),
            "{v}: MPS job {who} opens its GPU and not the other:\n{text}"
        );
        assert!(
            text.contains(&format!("PIPE={}", pipe(uid).display())),
            "{v}: job {who} is told its user's pipe directory:\n{text}"
        );
    };
    let server = |t: &str| -> i32 {
        t.lines()
            .find_map(|l| {
                l.strip_prefix("MPS server ")?
                    .strip_suffix(" ok")?
                    .parse()
                    .ok()
            })
            .unwrap_or_else(|| panic!("{v}: the MPS server answered no client:\n{t}"))
    };
    let in_cgroup = |pid: i32, uid: u32| {
        let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
        cg.lines()
            .any(|l| l.starts_with("0::") && l.ends_with(&format!("/gpufence-mps/{leaf}-u{uid}")))
    };

    // User A's first job: A's daemon and server.
    let a1 = submit_a("a1");
    let t_a1 = wait_output(&cluster, &out("a1"), "held");
    check_job("a1", &t_a1, ua);
    let s_a = server(&t_a1);
    assert_eq!(gpufence_node::host::procs::uid_of(s_a), Some(ua));
    assert!(
        in_cgroup(s_a, ua),
        "{v}: A's server runs in A's daemon cgroup"
    );

    // A's daemon runs as A, not root: everything in its cgroup is A's, and
    // `start_server -uid 0` or `-uid <peer>` sent through A's own pipe
    // starts nothing (a daemon not run as root cannot set another uid;
    // NVIDIA's is what only a real GPU can confirm).
    let procs_a = || -> Vec<i32> {
        std::fs::read_to_string(daemon_cg(ua).join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    };
    let before = procs_a();
    assert!(
        before.len() == 2
            && before
                .iter()
                .all(|p| gpufence_node::host::procs::uid_of(*p) == Some(ua)),
        "{v}: A's daemon and server, both A's: {before:?}"
    );
    for other in [0, ub] {
        use std::io::Write;
        let p = pipe(ua);
        let env_a = [("CUDA_MPS_PIPE_DIRECTORY", p.as_path())];
        let mut q = as_uid(ua, &standin, &env_a)
            .arg("--gpu")
            .arg(&d.held)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let _ = q
            .stdin
            .take()
            .unwrap()
            .write_all(format!("start_server -uid {other}\n").as_bytes());
        let o = q.wait_with_output().unwrap();
        assert_eq!(
            stdout(&o).trim(),
            "server-failed EPERM",
            "{v}: A's start_server -uid {other}: {}",
            both(&o)
        );
        assert_eq!(
            procs_a(),
            before,
            "{v}: start_server -uid {other} started one"
        );
    }

    // An outsider (the peer, no MPS job yet) cannot reach A's daemon, quit
    // it, or take its server's descriptor; A itself can (the server is
    // exec'ed, dumpable by its uid, as NVIDIA's is).
    let pipe_a = pipe(ua);
    let env_a = [("CUDA_MPS_PIPE_DIRECTORY", pipe_a.as_path())];
    let o = as_uid(ub, &standin, &env_a).arg("client").output().unwrap();
    assert_eq!(
        stdout(&o).trim(),
        format!("MPS unreachable {} EACCES", pipe_a.display()),
        "{v}: an outsider's client reaches A's daemon: {}",
        both(&o)
    );
    let o = quit_as(ub, &control, &env_a);
    assert!(
        !o.status.success()
            && !stdout(&o).contains("bye")
            && String::from_utf8_lossy(&o.stderr).contains("EACCES"),
        "{v}: an outsider's quit reached A's daemon: {}",
        both(&o)
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(!gone(s_a), "{v}: an outsider's quit ended A's server");
    let fd = "9"; // SERVER_FD of the stand-in
    let getfd = |uid: u32| {
        let o = as_uid(uid, &probe, &[])
            .args(["getfd", &s_a.to_string(), fd])
            .output()
            .unwrap();
        stdout(&o).trim().to_string()
    };
    assert_eq!(
        getfd(ub),
        "getfd EPERM",
        "{v}: an outsider took A's GPU descriptor"
    );
    // (Yama's ptrace_scope 1 and up refuses a non-descendant even its uid.)
    let yama = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope").unwrap_or_default();
    if matches!(yama.trim(), "" | "0") {
        assert_eq!(
            getfd(ua),
            "getfd ok",
            "{v}: the stand-in's server is not dumpable by its uid"
        );
    }

    // A process of another uid in A's daemon cgroup: reported and ended by
    // the next MPS Prolog (the peer's job's).
    let mut intruder = as_uid(ub, Path::new("/bin/sleep"), &[])
        .arg("600")
        .spawn()
        .unwrap();
    let ipid = intruder.id() as i32;
    std::fs::write(daemon_cg(ua).join("cgroup.procs"), ipid.to_string()).unwrap();
    // The sweep reports it (and leaves it to the MPS Prolog or Epilog).
    let sw = cluster.gpufence(&["sweep", "--json"]);
    let line = String::from_utf8_lossy(&sw.stdout)
        .lines()
        .find(|l| l.contains("\"mps_foreign_process\""))
        .map(str::to_string)
        .unwrap_or_default();
    assert!(
        line.contains(&format!("\"pid\":{ipid}")) && line.contains("\"critical\""),
        "{v}: the sweep did not report the intruder {ipid}: {}",
        both(&sw)
    );
    assert!(!gone(ipid));
    let b = sbatch_as(
        peer.cmd(&cluster, "sbatch"),
        &["--gres=mps:20"],
        &out("b"),
        &script,
    );
    let t_b = wait_output(&cluster, &out("b"), "held");
    let _ = intruder.wait();
    let foreign: Vec<Value> = gpufence_tests::audit_log(&audit)
        .into_iter()
        .filter(|e| e["event"] == "mps_foreign_process")
        .collect();
    assert!(
        foreign.iter().any(|e| e["pid"] == ipid
            && e["uid"] == ub
            && e["job_id"] == b
            && e["killed"] == true
            && e["cgroup"]
                .as_str()
                .is_some_and(|c| c.ends_with(&format!("{leaf}-u{ua}")))),
        "{v}: the intruder {ipid} in A's daemon cgroup was not reported and ended by job {b}'s Prolog: {foreign:?}"
    );
    assert!(gone(ipid));

    // The peer's job: a daemon and server of its own.
    check_job("b", &t_b, ub);
    let s_b = server(&t_b);
    assert_ne!(s_b, s_a, "{v}: two users share a server");
    assert_eq!(gpufence_node::host::procs::uid_of(s_b), Some(ub));
    assert!(
        in_cgroup(s_b, ub),
        "{v}: B's server runs in B's daemon cgroup"
    );

    // A's second job: A's server again.
    let a2 = submit_a("a2");
    let t_a2 = wait_output(&cluster, &out("a2"), "held");
    check_job("a2", &t_a2, ua);
    assert_eq!(server(&t_a2), s_a, "one server for the user's two jobs");
    let started: Vec<Value> = gpufence_tests::audit_log(&audit)
        .into_iter()
        .filter(|e| e["event"] == "mps_started")
        .collect();
    assert_eq!(started.len(), 2, "one daemon per user: {started:?}");

    // A's own quit ends A's daemon and server only; A's next job gets a
    // fresh daemon.
    let o = quit_as(ua, &control, &env_a);
    assert!(stdout(&o).contains("bye"), "{v}: A's quit: {}", both(&o));
    assert!(
        Cluster::wait_for(Duration::from_secs(10), || gone(s_a)),
        "{v}: A's quit left A's server {s_a}"
    );
    assert!(!gone(s_b), "{v}: A's quit ended B's server");
    let a3 = submit_a("a3");
    let t_a3 = wait_output(&cluster, &out("a3"), "held");
    check_job("a3", &t_a3, ua);
    let s_a3 = server(&t_a3);
    assert_ne!(s_a3, s_a);
    assert!(in_cgroup(s_a3, ua));
    assert!(
        gpufence_tests::audit_log(&audit)
            .iter()
            .any(|e| e["event"] == "mps_started" && e["job_id"] == a3 && e["restarted"] == true),
        "{v}: job {a3}'s Prolog did not restart A's daemon"
    );

    // B's own quit likewise ends B's daemon only; B's last Epilog then
    // finds it gone and cleans up all the same.
    let pipe_b = pipe(ub);
    let o = quit_as(
        ub,
        &control,
        &[("CUDA_MPS_PIPE_DIRECTORY", pipe_b.as_path())],
    );
    assert!(stdout(&o).contains("bye"), "{v}: B's quit: {}", both(&o));
    assert!(
        Cluster::wait_for(Duration::from_secs(10), || gone(s_b)),
        "{v}: B's quit left B's server {s_b}"
    );
    assert!(!gone(s_a3), "{v}: B's quit ended A's server");

    // A stops A's daemon and server (SIGSTOP, as A): they would answer no
    // `quit`, and must hold up neither A's Epilogs nor B's Prolog.
    let stopped_a = procs_a();
    assert!(stopped_a.contains(&s_a3), "{v}: {stopped_a:?}");
    let mut k = as_uid(ua, Path::new("/bin/kill"), &[]);
    k.arg("-STOP");
    for p in &stopped_a {
        k.arg(p.to_string());
    }
    assert!(k.status().unwrap().success(), "{v}: A's kill -STOP");
    let holders = [printed_pid(&t_b), printed_pid(&t_a2), printed_pid(&t_a3)];
    end_job(&cluster, &env, a1);
    assert!(
        !gone(s_a3) && holders.iter().all(|p| !gone(*p)),
        "{v}: job {a1}'s end ended A's MPS server or a co-tenant {holders:?}: {:?}\n{}",
        events_for(&audit, a1),
        cluster.log_tail("slurmd.log")
    );
    for j in [b, a2, a3] {
        assert_eq!(job_state(&cluster, j), "RUNNING", "job {j}");
    }
    end_job(&cluster, &env, b);
    assert!(
        events_for(&audit, b).contains(&"mps_stopped".to_string()),
        "{v}: B's last job's Epilog did not clean up B's quit daemon: {:?}",
        events_for(&audit, b)
    );
    assert!(!gone(s_a3), "{v}: B's daemon's end ended A's server");
    assert!(!pipe(ub).exists() && !daemon_cg(ub).exists());
    // A's last two jobs are cancelled one second apart while B submits a
    // new MPS job: A's stopped daemon is stopped all the same (grant
    // revoked, cgroup killed), and B's Prolog is not held up.
    let o = cluster.admin("scancel", &[&a2.to_string()]);
    assert!(o.status.success(), "scancel {a2}: {}", both(&o));
    std::thread::sleep(Duration::from_secs(1));
    let o = cluster.admin("scancel", &[&a3.to_string()]);
    assert!(o.status.success(), "scancel {a3}: {}", both(&o));
    let b2 = sbatch_as(
        peer.cmd(&cluster, "sbatch"),
        &["--gres=mps:20"],
        &out("b2"),
        &script,
    );
    let t_b2 = wait_output(&cluster, &out("b2"), "held");
    check_job("b2", &t_b2, ub);
    for j in [a2, a3] {
        let record = env.path(&format!("state/jobs/{j}.json"));
        assert!(
            Cluster::wait_for(Duration::from_secs(60), || !record.exists()
                && job_state(&cluster, j).is_empty()),
            "{v}: job {j} did not end:\n{}",
            cluster.log_tail("slurmd.log")
        );
    }
    assert!(
        Cluster::wait_for(Duration::from_secs(10), || stopped_a
            .iter()
            .all(|p| gone(*p))),
        "{v}: A's last Epilog did not end A's stopped daemon and server {stopped_a:?}: {:?}",
        events_for(&audit, a3)
    );
    assert!(!pipe(ua).exists() && !daemon_cg(ua).exists());
    for j in [a2, a3] {
        assert!(
            !events_for(&audit, j).contains(&"error".to_string()),
            "{v}: job {j}: {:?}",
            events_for(&audit, j)
        );
    }
    end_job(&cluster, &env, b2);
    assert!(
        events_for(&audit, b2).contains(&"mps_stopped".to_string()),
        "{v}: {:?}",
        events_for(&audit, b2)
    );
    let registry = env.path("state/mps");
    assert!(
        std::fs::read_dir(&registry).map_or(true, |r| r.flatten().next().is_none()),
        "{v}: MPS registrations left in {}",
        registry.display()
    );
    assert!(
        events_for(&audit, a2).contains(&"mps_stopped".to_string())
            || events_for(&audit, a3).contains(&"mps_stopped".to_string()),
        "{:?} {:?}",
        events_for(&audit, a2),
        events_for(&audit, a3)
    );
    assert!(
        !env.path(&format!("mps/{leaf}")).exists(),
        "the GPU's MPS directory is removed"
    );
    assert_node_clean(&cluster, &[a1, b, a2, a3, b2], &audit);
    assert!(
        !slice
            .slurmd_cgroup()
            .parent()
            .unwrap()
            .join("gpufence-mps")
            .exists(),
        "the daemons' cgroup is removed"
    );
}

#[test]
fn whole_gpu_epilog_twice_22_05_host() {
    if !privileged() {
        return;
    }
    whole_gpu_epilog_twice(&Release {
        root: None,
        plugin: None,
    });
}

#[test]
fn shard_co_tenants_22_05_host() {
    if !privileged() {
        return;
    }
    shard_co_tenants(&Release {
        root: None,
        plugin: None,
    });
}

#[test]
fn shard_co_tenants_slurm_24_11_debian_trixie() {
    if !privileged() {
        return;
    }
    if let Some(r) = Release::debian("trixie") {
        shard_co_tenants(&r);
    }
}

#[test]
fn shard_co_tenants_slurm_26_05_debian_sid() {
    if !privileged() {
        return;
    }
    if let Some(r) = Release::debian("sid") {
        shard_co_tenants(&r);
    }
}

#[test]
fn mps_co_tenants_and_daemon_22_05_host() {
    if !privileged() {
        return;
    }
    mps_co_tenants(&Release {
        root: None,
        plugin: None,
    });
}

#[test]
fn mps_co_tenants_and_daemon_slurm_24_11_debian_trixie() {
    if !privileged() {
        return;
    }
    if let Some(r) = Release::debian("trixie") {
        mps_co_tenants(&r);
    }
}

#[test]
fn mps_co_tenants_and_daemon_slurm_26_05_debian_sid() {
    if !privileged() {
        return;
    }
    if let Some(r) = Release::debian("sid") {
        mps_co_tenants(&r);
    }
}

/// Starts `gpufence-probe hold PATH` as root in cgroup `cg` (a daemon of
/// a system unit) and waits for `held`; a device the fence denies makes
/// the probe say `PATH EPERM` instead, and this panics with it.
fn root_holder(env: &TestEnv, cg: &str, path: &Path) -> std::process::Child {
    let mut cmd = env.command_in(cg, gpufence_tests::probe_bin());
    cmd.args(["hold", path.to_str().unwrap()]);
    let mut child = cmd.stdout(std::process::Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    if line.trim() != "held" {
        let _ = child.kill();
        let _ = child.wait();
        panic!(
            "a daemon in /{cg} could not hold {}: {line:?}",
            path.display()
        );
    }
    child
}

/// The findings of `gpufence sweep --json` over the node's slice.
fn sweep_findings(cluster: &Cluster) -> Vec<Value> {
    let o = cluster.gpufence(&["sweep", "--json", "--cgroup", SLICE]);
    stdout(&o)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .collect()
}

/// Waits until `gpufence fence watch` has written an `exemption_applied`
/// line naming cgroup `cg` with its current id.
fn wait_exempt(env: &TestEnv, audit: &Path, cg: &str) -> bool {
    let id = env.cg.id(cg).unwrap();
    // 30 s: the watch looks every 250 ms, but two test threads of real
    // Slurm nodes share this machine's CPUs (it returns at once when seen).
    Cluster::wait_for(Duration::from_secs(30), || {
        gpufence_tests::audit_log(audit).iter().any(|e| {
            e["event"] == "exemption_applied"
                && e["exempt"]
                    .as_array()
                    .is_some_and(|a| a.iter().any(|x| x["cgroup_id"] == id))
        })
    })
}

/// An HGX/DGX node's NVIDIA daemons under the fence with gpufence's
/// default exemptions: a Fabric Manager stand-in (root, in
/// `system.slice/nvidia-fabricmanager.service`) holds a stand-in NVSwitch
/// device (the node's holdable device, which is also the job's `held`
/// GPU, as the real Fabric Manager holds every GPU) from before the fence
/// is installed. The sweep reports nothing of it; a job on that device
/// ends and its Epilog leaves the daemon alone; the unit restarted (a new
/// cgroup, a new id) after the install is exempt once `gpufence fence
/// watch` has seen it, and its daemon holds the device again; an NVSM
/// unit (`nvsm-core.service`, the default `nvsm*.service` pattern) started
/// after the install too. A root daemon of another unit is denied: the
/// fence enforces.
fn fabric_daemons_keep_their_gpus(release: &Release) {
    let env = TestEnv::new("v2fabric");
    let d = Devices::make(&env);
    let slice = V2Slice::claim();
    let fm = format!("{SLICE}/nvidia-fabricmanager.service");
    let nvsm = format!("{SLICE}/nvsm-core.service");
    let other = format!("{SLICE}/gpufence-test-other.service");
    for c in [&fm, &other] {
        env.cg.create(c).unwrap();
    }
    let nvswitch = env.mknod("nvidia-nvswitch0", d.real.major, d.real.minor);
    let mut fm1 = root_holder(&env, &fm, &nvswitch);
    let fm1_pid = fm1.id() as i32;
    let extra = format!(
        "term_grace_ms = 1000\nnvml = false\n[majors]\nnvidia = 195\nfake-held = {}\n",
        d.real.major
    );
    let cluster = Cluster::start_with(
        &env,
        &spec(release, &slice, &d, &extra, false, "Alloc,Contain"),
    );
    let audit = env.path("log/audit.jsonl");
    // The control: another unit's root daemon is fenced.
    assert_eq!(env.open_from(&other, &nvswitch), "EPERM");
    let f = sweep_findings(&cluster);
    assert!(
        !f.iter().any(|x| x["pid"] == fm1_pid
            || x["kind"] == "unfenced_gpu_holder"
            || x["kind"] == "gpu_busy_without_grant"),
        "the sweep reported the Fabric Manager stand-in: {f:#?}"
    );
    // A job on the device the daemon holds: its Epilog leaves it alone.
    let o = cluster.as_user(
        "srun",
        &[
            "--gres=gpu:held:1",
            "sh",
            "-c",
            &format!(
                "echo JOB=$SLURM_JOB_ID; {} open {}",
                cluster.bin.join("gpufence-probe").display(),
                d.held.display()
            ),
        ],
    );
    let out = stdout(&o);
    assert!(o.status.success(), "{}", both(&o));
    assert_eq!(verdict(&out, &d.held), "ok", "{out}");
    let job: u32 = field(&out, "JOB").unwrap().parse().unwrap();
    let mut state = String::new();
    assert!(
        Cluster::wait_for(Duration::from_secs(30), || {
            state = stdout(&cluster.as_user("sinfo", &["-h", "-o", "%T"]))
                .trim()
                .to_string();
            state == "idle" && events_for(&audit, job).contains(&"grant_revoked".to_string())
        }),
        "node {state}, job {job}: {:?}",
        events_for(&audit, job)
    );
    assert!(
        !gone(fm1_pid),
        "the Epilog ended the Fabric Manager stand-in"
    );
    assert!(
        !gpufence_tests::audit_log(&audit)
            .iter()
            .any(|e| e["pid"] == fm1_pid),
        "an audit line names the Fabric Manager stand-in"
    );
    // A restart: systemd removes the unit's cgroup and makes it anew.
    let mut watch = std::process::Command::new(cluster.bin.join("gpufence"))
        .arg("--config")
        .arg(&cluster.config)
        .args(["fence", "watch"])
        .spawn()
        .unwrap();
    let _ = fm1.kill();
    let _ = fm1.wait();
    env.cg.remove_tree(&fm).unwrap();
    env.cg.create(&fm).unwrap();
    env.cg.create(&nvsm).unwrap();
    let watched = wait_exempt(&env, &audit, &fm) && wait_exempt(&env, &audit, &nvsm);
    let holders = watched.then(|| {
        (
            root_holder(&env, &fm, &nvswitch),
            root_holder(&env, &nvsm, &nvswitch),
        )
    });
    let _ = watch.kill();
    let _ = watch.wait();
    assert!(
        watched,
        "fence watch did not exempt the restarted units: {:?}",
        gpufence_tests::audit_log(&audit)
            .iter()
            .filter(|e| e["event"] == "exemption_applied"
                || e["event"] == "error"
                || e["event"] == "fence_installed")
            .collect::<Vec<_>>()
    );
    let (mut fm2, mut nvsm1) = holders.unwrap();
    let f = sweep_findings(&cluster);
    let pids = [fm2.id() as i32, nvsm1.id() as i32];
    assert!(
        !f.iter().any(|x| x["pid"]
            .as_i64()
            .is_some_and(|p| pids.contains(&(p as i32)))
            || x["kind"] == "unfenced_gpu_holder"
            || x["kind"] == "exemption_missing"),
        "{f:#?}"
    );
    for c in [&mut fm2, &mut nvsm1] {
        let _ = c.kill();
        let _ = c.wait();
    }
    drop(cluster);
    for c in [&fm, &nvsm, &other] {
        let _ = env.cg.remove_tree(c);
    }
}

#[test]
fn fabric_daemons_keep_their_gpus_22_05_host() {
    if !privileged() {
        return;
    }
    fabric_daemons_keep_their_gpus(&Release {
        root: None,
        plugin: None,
    });
}

#[test]
fn fabric_daemons_keep_their_gpus_slurm_26_05_debian_sid() {
    let Some(release) = privileged().then(|| Release::debian("sid")).flatten() else {
        return;
    };
    fabric_daemons_keep_their_gpus(&release);
}
