//! End to end on a real one-node Slurm cluster (the host's 22.05, layout
//! `own`): two ways past the job-end promise found in the fourth security
//! round, on one cluster.
//!
//! 1. A job hands its GPU's descriptor to a process outside the job, which
//!    maps it, closes it and lets its main thread exit: only a live
//!    thread's `/proc/<tid>/maps` shows the mapping. The Epilog finds it,
//!    keeps evidence and ends it. A mappable GPU stands in as a node of
//!    `/dev/zero` (`c 1 5`; a private mapping of it keeps the device file,
//!    as a GPU mapping does): nothing else on the machine may hold 1:5
//!    while this runs ([`claim_dev_zero`]).
//! 2. A user whose uid is at or below `protected_uid_max` (a site migrated
//!    from UID_MIN 500) submits `sbatch --get-user-env`, whose login
//!    scripts slurmd runs in its own cgroup, exempt here as on a real node.
//!    The warning names the account (`fence status`, `doctor`, `sweep`),
//!    the Prolog refuses the job, and the login scripts' GPU probe never
//!    opens a GPU.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use gpufence_model::device::DevNum;
use gpufence_tests::cluster::{test_uid, Cluster};
use gpufence_tests::out::{both, field, stdout};
use gpufence_tests::{gone, privileged, TestEnv};
use serde_json::Value;

fn audit(env: &TestEnv) -> Vec<Value> {
    gpufence_tests::audit_log(&env.path("log/audit.jsonl"))
}

/// Panics unless no process on this machine holds `/dev/zero` (1:5): the
/// Epilog of a job whose "GPU" is 1:5 ends every holder it finds.
fn claim_dev_zero() {
    let zero = DevNum::new(1, 5);
    let h = gpufence_node::holders::scan::holders(&[zero].into());
    assert!(
        h.is_empty(),
        "processes hold /dev/zero (1:5) here, which this test's Epilog would end: {:?}",
        h.iter().map(|h| h.pid).collect::<Vec<_>>()
    );
}

#[test]
fn mappings_behind_an_exited_leader_and_low_uids_on_a_real_cluster() {
    if !privileged() {
        return;
    }
    let mut env = TestEnv::new("e2eacct");
    claim_dev_zero();
    let n0 = env.mknod("nvidia0", 195, 0);
    let n1 = env.mknod("nvidia1", 195, 1);
    let map = env.mknod("nvidia-map", 1, 5);
    let gres = format!(
        "Name=gpu Type=sim File={}\nName=gpu Type=sim File={}\nName=gpu Type=map File={}\n",
        n0.display(),
        n1.display(),
        map.display()
    );
    // slurmd's cgroup is exempt, as system.slice/slurmd.service is on a
    // real node (AutoDetect=nvml opens every GPU from there).
    let cluster = Cluster::start(
        &env,
        &gres,
        "gpu:sim:2,gpu:map:1",
        &format!(
            "layout = \"own\"\nnvml = false\nterm_grace_ms = 500\nexempt_cgroups = [\"{}/slurmd\"]\n[majors]\nnvidia = 195\n",
            env.root
        ),
        std::env::var("GPUFENCE_E2E_PORT_BASE")
            .ok()
            .and_then(|v| v.parse::<u16>().ok())
            .map_or(17517, |p| p + 600),
    );
    let probe = cluster.bin.join("gpufence-probe");
    let probe_s = probe.to_str().unwrap().to_string();

    // 1. The descriptor leaves the job, is mapped and closed, and the
    //    receiver's main thread exits.
    let sock = env.path("jobs/map-handoff.sock");
    let outside = env.cgroup("outside");
    let mut recv = env.user_command_in(&outside, &probe);
    recv.args(["recvfd", "--map-leader-exit"]).arg(&sock);
    let receiver = env.spawn_ready(recv, "listening");
    let o = cluster.as_user(
        "srun",
        &[
            "--gres=gpu:map:1",
            "sh",
            "-c",
            &format!(
                "echo JOB=$SLURM_JOB_ID; {probe_s} sendfd {} {}",
                sock.display(),
                map.display()
            ),
        ],
    );
    let out = stdout(&o);
    assert!(o.status.success() && out.contains("sent"), "{}", both(&o));
    let job: u32 = field(&out, "JOB").unwrap().parse().unwrap();
    let threads = |p: i32| std::fs::read_dir(format!("/proc/{p}/task")).map_or(0, |d| d.count());
    let killed_in = |ev: &[Value]| {
        ev.iter()
            .any(|e| e["job_id"] == job && e["event"] == "process_killed")
    };
    let ended = Cluster::wait_for(Duration::from_secs(30), || {
        gone(receiver) && threads(receiver) <= 1 && killed_in(&audit(&env))
    });
    let ev: Vec<Value> = audit(&env)
        .into_iter()
        .filter(|e| e["job_id"] == job)
        .collect();
    let names: Vec<&str> = ev.iter().filter_map(|e| e["event"].as_str()).collect();
    assert!(
        ended && names.contains(&"process_killed"),
        "the Epilog did not end pid {receiver} (its mapping is seen through a live thread only): {names:?}\n{}",
        cluster.log_tail("slurmd.log")
    );
    let killed = ev.iter().find(|e| e["event"] == "process_killed").unwrap();
    assert_eq!(killed["pid"], receiver);
    assert_eq!(killed["uid"], test_uid());
    assert_eq!(killed["devices"], serde_json::json!(["1:5"]));
    let evidence: Vec<PathBuf> = std::fs::read_dir(env.path("evidence"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(&format!("job{job}-pid{receiver}-"))
        })
        .collect();
    assert_eq!(evidence.len(), 1, "one evidence file");
    let e: Value = serde_json::from_slice(&std::fs::read(&evidence[0]).unwrap()).unwrap();
    assert_eq!(e["exe"], probe.display().to_string(), "{e}");
    assert!(
        e["fds"].as_array().is_some_and(|f| {
            f.iter().any(|x| {
                x["via"] == "mmap" && x["dev"] == serde_json::json!({"major": 1, "minor": 5})
            })
        }),
        "the mapping is in the evidence: {e}"
    );

    // 2. A user at uid 500..=999 with a login shell.
    let low =
        gpufence_tests::cluster::LowUser::create("gpufence-low", None, &env.path("home-low"), None);
    let opened = low.home.join("gpus-opened");
    std::fs::write(
        low.home.join(".profile"),
        format!(
            "{probe_s} open {} {} > {} 2>&1\n",
            n0.display(),
            n1.display(),
            opened.display()
        ),
    )
    .unwrap();
    let want = format!("{} ({})", low.name, low.uid);
    let st = cluster.gpufence(&["fence", "status"]);
    assert!(
        stdout(&st).lines().any(|l| l.starts_with("warning: ")
            && l.contains("login account(s) at or below protected_uid_max (999)")
            && l.contains(&want)),
        "fence status warns about {want}:\n{}",
        both(&st)
    );
    let doc = cluster.gpufence(&["doctor", "--cgroup", &format!("/{outside}")]);
    assert!(
        stdout(&doc)
            .lines()
            .any(|l| l.starts_with("warning: ") && l.contains(&want)),
        "doctor warns about {want}:\n{}",
        both(&doc)
    );
    let sw = cluster.gpufence(&["sweep", "--json"]);
    let findings: Vec<Value> = stdout(&sw)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert!(
        findings.iter().any(|f| f["kind"] == "system_uid_range"
            && f["summary"].as_str().is_some_and(|s| s.contains(&want))),
        "sweep reports the range: {}",
        both(&sw)
    );
    let o = low
        .cmd(&cluster, "sbatch")
        .args([
            "--get-user-env",
            "--gres=gpu:sim:1",
            "-o",
            "/dev/null",
            "--parsable",
            "--wrap",
            "true",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "sbatch: {}", both(&o));
    let job: u32 = stdout(&o).trim().parse().expect("job id");
    let refused = Cluster::wait_for(Duration::from_secs(30), || {
        audit(&env).iter().any(|e| {
            e["job_id"] == job
                && e["event"] == "error"
                && e["error"].as_str().is_some_and(|s| {
                    s.contains(&format!(
                        "runs as uid {}, at or below protected_uid_max (999)",
                        low.uid
                    ))
                })
        })
    });
    assert!(
        refused,
        "the Prolog did not refuse job {job} of uid {}; its login scripts said {:?}:\n{:?}\n{}",
        low.uid,
        std::fs::read_to_string(&opened).unwrap_or_default(),
        audit(&env),
        cluster.log_tail("slurmd.log")
    );
    // No grant was ever recorded for it, and its login scripts opened no GPU.
    assert!(!audit(&env)
        .iter()
        .any(|e| e["job_id"] == job && e["event"] == "grant_recorded"));
    std::thread::sleep(Duration::from_secs(2));
    let said = std::fs::read_to_string(&opened).unwrap_or_default();
    assert!(
        said.lines().all(|l| l.ends_with(" EPERM")),
        "the login scripts of uid {} opened a GPU from slurmd's cgroup:\n{said}",
        low.uid
    );
    let _ = Command::new("scancel")
        .env("SLURM_CONF", &cluster.slurm_conf)
        .arg(job.to_string())
        .output();
}
