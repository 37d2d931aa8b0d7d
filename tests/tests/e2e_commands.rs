//! Every Slurm command gpufence runs, on a real Slurm cluster on this host
//! (README.md, "What gpufence asks of Slurm"): the config's `scontrol_bin`
//! and `slurmd_bin` are recording wrappers (each appends its caller's name
//! and its argv to a file, then execs the real program), with a recording
//! `squeue` beside that `scontrol` (the Prolog runs `squeue` from
//! `scontrol_bin`'s directory on 22.05).
//!
//! - a node with one GPU type: the plugin at slurmd start runs `slurmd -G`
//!   once (the cache); a GPU job and a job without GPUs then run no Slurm
//!   command at all (Prolog, plugin in slurmstepd, Epilog);
//! - a node with two GPU types: a GPU job's Prolog runs exactly the
//!   documented query (`scontrol --json show job ID`, then, on 22.05,
//!   `squeue --json`) and nothing else runs one; a job without GPUs runs
//!   none;
//! - a drain (`gpufence respond PID --drain`) runs exactly one
//!   `scontrol update nodename=NODE state=drain reason=...`.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use gpufence_tests::cluster::{hostname, Cluster, ClusterSpec};
use gpufence_tests::{privileged, TestEnv};

/// The file the wrappers append to: one line per run, `CALLER PROGRAM
/// ARGS...` (`CALLER` is the parent's `comm`).
fn log_path(env: &TestEnv) -> PathBuf {
    env.path("slurm-commands.log")
}

/// Writes `dir/<name>`: logs `<parent comm> <name> <args>` to `log`, then
/// execs `real`.
fn recorder(dir: &Path, name: &str, real: &str, log: &Path) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(
        &p,
        format!(
            "#!/bin/sh\nprintf '%s %s %s\\n' \"$(cat /proc/$PPID/comm)\" {name} \"$*\" >> {log}\nexec {real} \"$@\"\n",
            log = log.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

/// The recorded lines so far.
fn recorded(env: &TestEnv) -> Vec<String> {
    std::fs::read_to_string(log_path(env))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

fn clear(env: &TestEnv) {
    std::fs::write(log_path(env), "").unwrap();
}

fn both(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Runs `srun ARGS sh -c 'echo JOB=$SLURM_JOB_ID'` as the test user and
/// waits until the job has left `COMPLETING` (its Epilog done); returns the
/// job id.
fn job(cluster: &Cluster, args: &[&str]) -> u32 {
    let mut a: Vec<&str> = args.to_vec();
    a.extend(["sh", "-c", "echo JOB=$SLURM_JOB_ID"]);
    let o = cluster.as_user("srun", &a);
    assert!(
        o.status.success(),
        "srun {args:?}: {}\n{}",
        both(&o),
        cluster.log_tail("slurmd.log")
    );
    let id: u32 = String::from_utf8_lossy(&o.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("JOB="))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no job id: {}", both(&o)));
    let done = Cluster::wait_for(Duration::from_secs(60), || {
        let o = cluster.admin(
            "squeue",
            &["-h", "-t", "all", "-j", &id.to_string(), "-o", "%T"],
        );
        let s = String::from_utf8_lossy(&o.stdout).trim().to_string();
        o.status.success() && !s.is_empty() && !s.contains("COMPLETING") && !s.contains("RUNNING")
    });
    assert!(
        done,
        "job {id} never completed:\n{}",
        cluster.log_tail("slurmd.log")
    );
    id
}

/// Whether this host's Slurm is 22.05 (its `scontrol` has no `--json`).
fn slurm_22_05(cluster: &Cluster) -> bool {
    let o = cluster.admin("scontrol", &["--version"]);
    String::from_utf8_lossy(&o.stdout).contains(" 22.05.")
}

/// A cluster of `gres` (gres.conf) and `node_gres` whose gpufence runs the
/// recording wrappers.
fn start(env: &TestEnv, gres: &str, node_gres: &str, port: u16) -> Cluster {
    let wrappers = env.path("wrappers");
    std::fs::create_dir_all(&wrappers).unwrap();
    std::fs::set_permissions(&wrappers, std::fs::Permissions::from_mode(0o755)).unwrap();
    let log = log_path(env);
    let scontrol = recorder(&wrappers, "scontrol", "/usr/bin/scontrol", &log);
    recorder(&wrappers, "squeue", "/usr/bin/squeue", &log);
    let slurmd = recorder(&wrappers, "slurmd", "/usr/sbin/slurmd", &log);
    Cluster::start_with(
        env,
        &ClusterSpec {
            gres_conf: gres.into(),
            node_gres: node_gres.into(),
            gpufence_extra: format!(
                "layout = \"own\"\nnvml = false\nscontrol_bin = \"{}\"\nslurmd_bin = \"{}\"\n[majors]\nnvidia = 195\n",
                scontrol.display(),
                slurmd.display()
            ),
            port_base: port,
            ..ClusterSpec::default()
        },
    )
}

fn port_base() -> u16 {
    std::env::var("GPUFENCE_E2E_PORT_BASE")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(18517, |p: u16| p + 1600)
}

/// One GPU type: `slurmd -G` once, at slurmd start, by the plugin in
/// slurmd; jobs then run no Slurm command.
#[test]
fn one_gpu_type_jobs_run_no_slurm_command() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("cmds1");
    let n0 = env.mknod("nvidia0", 195, 0);
    let n1 = env.mknod("nvidia1", 195, 1);
    let cluster = start(
        &env,
        &format!(
            "Name=gpu Type=sim File={}\nName=gpu Type=sim File={}\n",
            n0.display(),
            n1.display()
        ),
        "gpu:sim:2",
        port_base(),
    );
    // cluster.sh's check job ran too: only slurmd's own slurmd -G (the
    // plugin warming the cache) may be there from before.
    let at_start = recorded(&env);
    let gres_runs: Vec<&String> = at_start
        .iter()
        .filter(|l| l.contains("slurmd -G"))
        .collect();
    assert!(
        !gres_runs.is_empty() && gres_runs.iter().all(|l| l.starts_with("slurmd slurmd -G")),
        "slurmd -G at slurmd start, run by the plugin in slurmd: {at_start:?}"
    );
    clear(&env);
    let gpu = job(&cluster, &["--gres=gpu:sim:1"]);
    let none = job(&cluster, &[]);
    let two = job(&cluster, &["--gres=gpu:sim:2"]);
    let got = recorded(&env);
    assert!(
        got.is_empty(),
        "jobs {gpu}, {none}, {two} on a one-type node ran Slurm commands: {got:?}"
    );
    // The jobs did run gpufence (so nothing was skipped for want of it).
    let audit = gpufence_tests::audit_log(&env.path("log/audit.jsonl"));
    for id in [gpu, two] {
        assert!(
            audit
                .iter()
                .any(|e| e["event"] == "grant_revoked" && e["job_id"] == id),
            "job {id} not revoked by the Epilog: {audit:?}"
        );
    }
}

/// Two GPU types: a GPU job's Prolog runs exactly the documented query; a
/// drain runs exactly one `scontrol update ... state=drain`.
#[test]
fn two_gpu_types_prolog_asks_slurmctld_once_and_a_drain_is_one_update() {
    if !privileged() {
        return;
    }
    let mut env = TestEnv::new("cmds2");
    let n0 = env.mknod("nvidia0", 195, 0);
    let n1 = env.mknod("nvidia1", 195, 1);
    let cluster = start(
        &env,
        &format!(
            "Name=gpu Type=a File={}\nName=gpu Type=b File={}\n",
            n0.display(),
            n1.display()
        ),
        "gpu:a:1,gpu:b:1",
        port_base() + 10,
    );
    clear(&env);
    let query = |id: u32| {
        let mut q = vec![format!("gpufence-prolog scontrol --json show job {id}")];
        if slurm_22_05(&cluster) {
            q.push("gpufence-prolog squeue --json".to_string());
        }
        q
    };
    for gres in ["--gres=gpu:a:1", "--gres=gpu:a:1,gpu:b:1"] {
        let id = job(&cluster, &[gres]);
        assert_eq!(recorded(&env), query(id), "job {id} ({gres})");
        clear(&env);
    }
    // Both types granted: the query completed SLURM_JOB_GPUS.
    let id = job(&cluster, &["--gres=gpu:a:1,gpu:b:1"]);
    let rec = gpufence_tests::audit_log(&env.path("log/audit.jsonl"))
        .into_iter()
        .find(|e| e["event"] == "grant_recorded" && e["job_id"] == id)
        .unwrap_or_else(|| panic!("no grant_recorded for job {id}"));
    let text = rec.to_string();
    assert!(
        text.contains(&n0.display().to_string()) && text.contains(&n1.display().to_string()),
        "job {id} of both types: {text}"
    );
    clear(&env);
    let none = job(&cluster, &[]);
    assert_eq!(
        recorded(&env),
        Vec::<String>::new(),
        "job {none} without GPUs"
    );

    // A drain: one scontrol update, nothing else.
    let victim = env.cgroup("victim");
    let pid = env.spawn_user_sleeper(&victim);
    let o = std::process::Command::new(cluster.bin.join("gpufence"))
        .arg("--config")
        .arg(&cluster.config)
        .args(["respond", &pid.to_string(), "--drain"])
        .env("SLURM_CONF", &cluster.slurm_conf)
        .env("SLURMD_NODENAME", hostname())
        .output()
        .expect("gpufence respond");
    assert!(o.status.success(), "respond --drain: {}", both(&o));
    let got = recorded(&env);
    let prefix = format!(
        "gpufence scontrol update nodename={} state=drain reason=gpufence: respond: pid {pid} ",
        hostname()
    );
    assert!(
        got.len() == 1 && got[0].starts_with(&prefix),
        "a drain runs one scontrol update (want {prefix:?}...): {got:?}"
    );
    let o = cluster.admin(
        "scontrol",
        &[
            "update",
            &format!("nodename={}", hostname()),
            "state=resume",
        ],
    );
    assert!(o.status.success(), "resume: {}", both(&o));
}
