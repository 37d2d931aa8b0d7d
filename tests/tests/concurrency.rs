//! Fifty jobs start and end at the same time on one node (issue 8, item 1).
//!
//! - [`fifty_jobs_at_once_on_a_real_fence`] (always run, kernel level): the
//!   real `gpufence-prolog`, the plugin's grant step (`gpufence-probe
//!   apply`, which calls the same `grant::grant_step` as the plugin) and the real
//!   `gpufence-epilog`, as separate processes, 50 of each at once against a
//!   fence on the test's own cgroup subtree; GPUs are `mknod` nodes 195:0..49
//!   (ENXIO = allowed by the device cgroup, EPERM = denied).
//! - [`fifty_jobs_at_once_on_a_real_cluster`] (always run; five waves
//!   instead of one with `GPUFENCE_LONG_TESTS=1`): the same on a real
//!   slurmctld + slurmd, with 50 fake GPUs in gres.conf and 50 batch jobs
//!   that all run at once.
//!
//! Both prove: every job gets exactly its grant (opens its GPU, none of the
//! 49 others, while all 50 grants are live), outsiders open nothing, every
//! revoke happens, the audit log has each job's lines exactly once and
//! every line is whole JSON, and no state file is ever seen half-written.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Barrier, Mutex};
use std::time::Duration;

use gpufence_cgroup::fence::Fence;
use gpufence_model::config::Config;
use gpufence_model::device::{DevNum, DeviceRole};
use gpufence_model::record::{AppliedGrant, JobRecord};
use gpufence_node::{host::fence_ops, Node};
use gpufence_tests::cluster::Cluster;
use gpufence_tests::{privileged, probe_bin, workspace_bin, TestEnv};
use serde_json::Value;

/// How many jobs run at once.
const JOBS: u32 = 50;
/// The first job id.
const JOB0: u32 = 5000;
const MAJORS: &str = "[majors]\nnvidia = 195\nnvidia-uvm = 241\n";

fn both(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The GPU stand-ins and a `slurmd -G` listing of them, in order.
fn gpus(env: &TestEnv, n: u32) -> (Vec<PathBuf>, PathBuf) {
    let devs: Vec<PathBuf> = (0..n)
        .map(|i| env.mknod(&format!("nvidia{i}"), 195, i))
        .collect();
    let text: String = devs
        .iter()
        .enumerate()
        .map(|(i, p)| {
            format!(
                "slurmd: Gres Name=gpu Type=(null) Count=1 Index={i} ID=7696487 File={} (null)\n",
                p.display()
            )
        })
        .collect();
    let g = env.path("slurmd-G.txt");
    std::fs::write(&g, text).unwrap();
    (devs, g)
}

/// Reads every state file (records and applied notes) once. A file that
/// exists but does not parse is an error; one that vanished between the
/// listing and the read is not. Returns how many were read.
fn read_state(state: &Path) -> Result<usize, String> {
    let mut n = 0;
    for sub in ["jobs", "applied"] {
        let Ok(rd) = std::fs::read_dir(state.join(sub)) else {
            continue;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                continue; // a writer's temporary file, never read by gpufence
            }
            let bytes = match std::fs::read(e.path()) {
                Ok(b) => b,
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => continue,
                Err(err) => return Err(format!("{}: {err}", e.path().display())),
            };
            let ok = if sub == "jobs" {
                serde_json::from_slice::<JobRecord>(&bytes).map(|_| ())
            } else {
                serde_json::from_slice::<AppliedGrant>(&bytes).map(|_| ())
            };
            ok.map_err(|err| {
                format!(
                    "{} is half-written ({err}): {:?}",
                    e.path().display(),
                    String::from_utf8_lossy(&bytes)
                )
            })?;
            n += 1;
        }
    }
    Ok(n)
}

/// Files left in the state directory's `jobs/` and `applied/` (including
/// temporary ones).
fn state_files(state: &Path) -> Vec<String> {
    ["jobs", "applied"]
        .iter()
        .flat_map(|sub| {
            std::fs::read_dir(state.join(sub))
                .into_iter()
                .flatten()
                .flatten()
                .map(move |e| format!("{sub}/{}", e.file_name().to_string_lossy()))
        })
        .collect()
}

/// The verdict `gpufence-probe open` printed for `path`.
fn verdict_of(out: &str, path: &Path) -> String {
    let p = format!("{} ", path.display());
    out.lines()
        .find_map(|l| l.strip_prefix(&p))
        .unwrap_or("missing")
        .to_string()
}

/// Checks the per-job audit lines: exactly recorded → applied → revoked,
/// once each, and no error line at all.
fn check_audit_per_job(lines: &[Value], jobs: &BTreeSet<u32>) -> Vec<String> {
    let mut per: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    let mut problems = Vec::new();
    for l in lines {
        let ev = l["event"].as_str().unwrap_or("?").to_string();
        if l["ts"].as_str().is_none() {
            problems.push(format!("line without ts: {l}"));
        }
        if ev == "error" || ev == "grant_refused" {
            problems.push(format!("unexpected {ev}: {l}"));
        }
        if let Some(j) = l["job_id"].as_u64() {
            per.entry(j as u32).or_default().push(ev);
        }
    }
    for j in jobs {
        let got = per.remove(j).unwrap_or_default();
        if got != ["grant_recorded", "grant_applied", "grant_revoked"] {
            problems.push(format!("job {j}: {got:?}"));
        }
    }
    for (j, got) in per {
        problems.push(format!("lines of an unknown job {j}: {got:?}"));
    }
    problems
}

#[test]
fn fifty_jobs_at_once_on_a_real_fence() {
    if !privileged() {
        return;
    }
    let mut env = TestEnv::new("conc50");
    let (devs, gres) = gpus(&env, JOBS);
    let cfg_path = env.config(&format!(
        "layout = \"own\"\nslurmd_gres = \"{}\"\nnvml = false\n{MAJORS}",
        gres.display()
    ));
    let node = Node::new(
        Config::load(&cfg_path).unwrap(),
        gpufence_model::config::ConfigOrigin::File(cfg_path.clone()),
    )
    .unwrap();
    fence_ops::install(&node).expect("install the fence on the test subtree");
    let outside = env.cgroup("outside");
    // Stand-ins for the 50 slurmstepds; the grant step moves each into its
    // job's cgroup (layout "own"), as the plugin does with slurmstepd.
    let stepds_cg = env.cgroup("stepds");
    let stepds: Vec<i32> = (0..JOBS).map(|_| env.spawn_sleeper(&stepds_cg)).collect();
    let prolog = workspace_bin("gpufence-prolog");
    let epilog = workspace_bin("gpufence-epilog");
    let probe = probe_bin();
    let state = env.path("state");
    let audit = env.path("log/audit.jsonl");
    let dev_args: Vec<String> = devs.iter().map(|d| d.display().to_string()).collect();

    let barrier = Barrier::new(JOBS as usize + 1);
    let done = AtomicBool::new(false);
    let reads = AtomicUsize::new(0);
    let torn: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let problems: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let env_ref = &env;
    std::thread::scope(|s| {
        // A reader that keeps reading every state file while the jobs come
        // and go: a half-written record would show here.
        s.spawn(|| {
            while !done.load(Ordering::SeqCst) {
                match read_state(&state) {
                    Ok(n) => {
                        reads.fetch_add(n, Ordering::SeqCst);
                    }
                    Err(e) => torn.lock().unwrap().push(e),
                }
            }
        });
        let mut jobs = Vec::new();
        for i in 0..JOBS {
            let (barrier, problems) = (&barrier, &problems);
            let (prolog, epilog, probe, cfg_path) = (&prolog, &epilog, &probe, &cfg_path);
            let (dev_args, devs, stepd) = (&dev_args, &devs, stepds[i as usize]);
            jobs.push(s.spawn(move || {
                let job = JOB0 + i;
                let uid = 60_000 + i;
                // Never panic before the last barrier: the others wait there.
                let mut errs: Vec<String> = Vec::new();
                barrier.wait(); // 1. all prologs at once
                let o = Command::new(prolog)
                    .env_clear()
                    .args(["--config", cfg_path.to_str().unwrap()])
                    .env("SLURM_JOB_ID", job.to_string())
                    .env("SLURM_JOB_UID", uid.to_string())
                    .env("SLURM_JOB_GPUS", i.to_string())
                    .output()
                    .unwrap();
                if !o.status.success() {
                    errs.push(format!("prolog of job {job}: {}", both(&o)));
                }
                // The grant step, as slurmstepd runs it.
                let o = Command::new(probe)
                    .args([
                        "apply",
                        cfg_path.to_str().unwrap(),
                        &job.to_string(),
                        &uid.to_string(),
                        &stepd.to_string(),
                    ])
                    .output()
                    .unwrap();
                if !(o.status.success() && both(&o).starts_with("Granted {")) {
                    errs.push(format!("grant step of job {job}: {}", both(&o)));
                }
                barrier.wait(); // 2. every grant is in (main checks the fence)
                barrier.wait(); // 3. main is done checking
                                // A task of the job opens all 50 GPUs: its own only.
                let task = format!("{}/job_{job}/step_0/user/task_0", env_ref.root);
                if let Err(e) = env_ref.cg.create(&task) {
                    errs.push(format!("job {job}: task cgroup: {e}"));
                }
                let out = String::from_utf8_lossy(
                    &env_ref
                        .command_in(&task, probe)
                        .arg("open")
                        .args(dev_args)
                        .output()
                        .unwrap()
                        .stdout,
                )
                .into_owned();
                for (k, d) in devs.iter().enumerate() {
                    let want = if k as u32 == i { "ENXIO" } else { "EPERM" };
                    let got = verdict_of(&out, d);
                    if got != want {
                        errs.push(format!("job {job} opening {}: {got}", d.display()));
                    }
                }
                barrier.wait(); // 4. all epilogs at once
                let o = Command::new(epilog)
                    .env_clear()
                    .args(["--config", cfg_path.to_str().unwrap()])
                    .env("SLURM_JOB_ID", job.to_string())
                    .env("SLURM_JOB_UID", uid.to_string())
                    .output()
                    .unwrap();
                if !o.status.success() {
                    errs.push(format!("epilog of job {job}: {}", both(&o)));
                }
                problems.lock().unwrap().extend(errs);
            }));
        }
        barrier.wait(); // 1
        barrier.wait(); // 2: every prolog and grant step has returned
                        // Every job's grant is exactly its record: its GPU and the control
                        // devices, keyed by its own cgroup.
        let fence = Fence::open(&env_ref.bpffs).unwrap();
        let mut by_job: BTreeMap<u32, BTreeSet<(u64, DevNum)>> = BTreeMap::new();
        for e in fence.entries().unwrap() {
            by_job
                .entry(e.job_id)
                .or_default()
                .insert((e.cgroup_id, e.dev));
        }
        let mut p = Vec::new();
        for i in 0..JOBS {
            let job = JOB0 + i;
            let rec = node.state.read_record(job).ok().flatten();
            let Some(rec) = rec else {
                p.push(format!("job {job}: no record"));
                continue;
            };
            let gres: Vec<DevNum> = rec
                .devices
                .iter()
                .filter(|d| d.role == DeviceRole::Gres)
                .map(|d| d.dev)
                .collect();
            if gres != [DevNum::new(195, i)] {
                p.push(format!("job {job}: GRES devices {gres:?}"));
            }
            let cg = env_ref.cg.id(&format!("{}/job_{job}", env_ref.root)).ok();
            let want: BTreeSet<(u64, DevNum)> = rec
                .devices
                .iter()
                .map(|d| (cg.unwrap_or(0), d.dev))
                .collect();
            let got = by_job.remove(&job).unwrap_or_default();
            if got != want || !want.contains(&(cg.unwrap_or(0), DevNum::new(195, 255))) {
                p.push(format!("job {job}: fence holds {got:?}, want {want:?}"));
            }
            let (notes, bad) = node.state.applied(Some(job));
            if notes.len() != 1 || !bad.is_empty() || Some(notes[0].cgroup_id) != cg {
                p.push(format!("job {job}: applied notes {notes:?} {bad:?}"));
            }
        }
        if !by_job.is_empty() {
            p.push(format!("grants of unknown jobs: {by_job:?}"));
        }
        // Read while all 50 are live: each one whole.
        match read_state(&state) {
            Ok(n) if n == 2 * JOBS as usize => {}
            other => p.push(format!(
                "state files while all jobs run: {other:?}, want {}",
                2 * JOBS
            )),
        }
        // Outsiders open none of the 50 GPUs while all grants are live.
        let out = String::from_utf8_lossy(
            &env_ref
                .command_in(&outside, &probe)
                .arg("open")
                .args(&dev_args)
                .output()
                .unwrap()
                .stdout,
        )
        .into_owned();
        for d in &devs {
            if verdict_of(&out, d) != "EPERM" {
                p.push(format!(
                    "outsider opening {}: {}",
                    d.display(),
                    verdict_of(&out, d)
                ));
            }
        }
        problems.lock().unwrap().extend(p);
        barrier.wait(); // 3
        barrier.wait(); // 4
        for j in jobs {
            let _ = j.join();
        }
        done.store(true, Ordering::SeqCst);
    });
    let mut problems = problems.into_inner().unwrap();
    let torn = torn.into_inner().unwrap();
    assert!(torn.is_empty(), "half-written state files: {torn:?}");
    assert!(
        reads.load(Ordering::SeqCst) > 0 || problems.iter().any(|p| p.contains("state files")),
        "the reader never saw a state file"
    );

    // Every revoke happened: nothing in the fence, no record, no note, no
    // temporary file, no job cgroup.
    let fence = Fence::open(&env.bpffs).unwrap();
    let left = fence.entries().unwrap();
    if !left.is_empty() {
        problems.push(format!("grants left after the epilogs: {left:?}"));
    }
    let files = state_files(&state);
    if !files.is_empty() {
        problems.push(format!("state files left: {files:?}"));
    }
    let cgs: Vec<String> = std::fs::read_dir(env.cg.path(&env.root))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("job_"))
        .collect();
    if !cgs.is_empty() {
        problems.push(format!("job cgroups left: {cgs:?}"));
    }
    // The audit log: whole lines, each job's three lines exactly once.
    let lines = gpufence_tests::audit_log_settled(&audit);
    let jobs: BTreeSet<u32> = (JOB0..JOB0 + JOBS).collect();
    problems.extend(check_audit_per_job(&lines, &jobs));
    let others: Vec<&str> = lines
        .iter()
        .filter(|l| l["job_id"].is_null())
        .map(|l| l["event"].as_str().unwrap_or("?"))
        .collect();
    // nvml = false: NVML is unavailable, said once however many prologs
    // find it so at the same time.
    if others != ["fence_installed", "nvml_unavailable"] {
        problems.push(format!("lines of no job: {others:?}"));
    }
    assert!(
        problems.is_empty(),
        "{} problems:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

/// How many waves of 50 jobs the cluster test runs: 1, or 5 with
/// `GPUFENCE_LONG_TESTS=1` (more chances for a race to show).
fn waves() -> u32 {
    if std::env::var("GPUFENCE_LONG_TESTS").is_ok_and(|v| v == "1") {
        5
    } else {
        1
    }
}

/// One wave: 50 batch jobs submitted held, released in one call (slurmctld
/// starts them in one scheduling pass, slurmd runs 50 prologs at once), all
/// running at the same time (each waits for a `go` file after opening every
/// GPU), then ended at once (50 epilogs). Returns the job ids.
fn wave(env: &TestEnv, cluster: &Cluster, devs: &[PathBuf], w: u32) -> BTreeSet<u32> {
    let probe = cluster.bin.join("gpufence-probe");
    let go = env.path(&format!("jobs/go-{w}"));
    let script = format!(
        "#!/bin/sh\necho JOB=$SLURM_JOB_ID\necho GPUS=$SLURM_JOB_GPUS\n{probe} open {devs}\necho OPENED\nwhile [ ! -e {go} ]; do sleep 0.2; done\n",
        probe = probe.display(),
        devs = devs
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(" "),
        go = go.display(),
    );
    let script_path = env.path(&format!("jobs/conc-{w}.sh"));
    std::fs::write(&script_path, script).unwrap();
    let outs: Vec<PathBuf> = (0..JOBS)
        .map(|i| env.path(&format!("jobs/conc-{w}-{i}.out")))
        .collect();
    let mut ids = Vec::new();
    for out in &outs {
        let o = cluster.as_user(
            "sbatch",
            &[
                "--parsable",
                "--hold",
                "--gres=gpu:1",
                "-o",
                out.to_str().unwrap(),
                script_path.to_str().unwrap(),
            ],
        );
        assert!(o.status.success(), "{}", both(&o));
        ids.push(String::from_utf8_lossy(&o.stdout).trim().to_string());
    }
    let o = cluster.as_user("scontrol", &["release", &ids.join(",")]);
    assert!(o.status.success(), "{}", both(&o));
    let all_opened = Cluster::wait_for(Duration::from_secs(120), || {
        outs.iter().all(|o| {
            std::fs::read_to_string(o)
                .unwrap_or_default()
                .contains("OPENED")
        })
    });
    let squeue = both(&cluster.as_user("squeue", &["-h", "-o", "%i %T %R"]));
    assert!(
        all_opened,
        "wave {w}: not all {JOBS} jobs ran at once:\n{squeue}\n{}",
        cluster.log_tail("slurmd.log")
    );
    // All 50 are running now: one live grant each.
    let g: Value = serde_json::from_slice(&cluster.gpufence(&["grants", "--json"]).stdout).unwrap();
    let live: BTreeSet<u64> = g
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["job_id"].as_u64().unwrap())
        .collect();
    std::fs::write(&go, "").unwrap();
    // Each job opened exactly its GPU (by GRES index), none of the others.
    let mut problems = Vec::new();
    let mut jobs = BTreeSet::new();
    let mut indices = BTreeSet::new();
    for out in &outs {
        let text = std::fs::read_to_string(out).unwrap();
        let job: u32 = text
            .lines()
            .find_map(|l| l.strip_prefix("JOB="))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no job id in {text}"));
        let idx: usize = text
            .lines()
            .find_map(|l| l.strip_prefix("GPUS="))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("job {job}: one GPU index in {text}"));
        jobs.insert(job);
        indices.insert(idx);
        for (k, d) in devs.iter().enumerate() {
            let want = if k == idx { "ENXIO" } else { "EPERM" };
            let got = verdict_of(&text, d);
            if got != want {
                problems.push(format!(
                    "job {job} (GPU {idx}) opening {}: {got}",
                    d.display()
                ));
            }
        }
    }
    assert!(problems.is_empty(), "wave {w}:\n{}", problems.join("\n"));
    assert_eq!(
        indices.len(),
        JOBS as usize,
        "wave {w}: 50 different GPUs: {indices:?}"
    );
    let want: BTreeSet<u64> = jobs.iter().map(|j| u64::from(*j)).collect();
    assert_eq!(live, want, "wave {w}: one live grant per running job: {g}");
    // Every epilog ran: node idle, each job revoked.
    let mut state = String::new();
    let done = Cluster::wait_for(Duration::from_secs(120), || {
        state = String::from_utf8_lossy(&cluster.as_user("sinfo", &["-h", "-o", "%T"]).stdout)
            .trim()
            .to_string();
        // Epilogs may still be writing: a line in progress is left out.
        let revoked: BTreeSet<u32> = gpufence_tests::audit_log(&env.path("log/audit.jsonl"))
            .iter()
            .filter(|l| l["event"] == "grant_revoked")
            .filter_map(|l| l["job_id"].as_u64())
            .map(|j| j as u32)
            .collect();
        state == "idle" && jobs.is_subset(&revoked)
    });
    assert!(
        done,
        "wave {w}: node {state}, epilogs missing:\n{}",
        cluster.log_tail("slurmd.log")
    );
    jobs
}

/// 50 simultaneous batch jobs on a real slurmctld + slurmd (one wave; five
/// with `GPUFENCE_LONG_TESTS=1`), while a reader keeps parsing every state
/// file.
#[test]
fn fifty_jobs_at_once_on_a_real_cluster() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("conc50-slurm");
    let devs: Vec<PathBuf> = (0..JOBS)
        .map(|i| env.mknod(&format!("nvidia{i}"), 195, i))
        .collect();
    let gres: String = devs
        .iter()
        .map(|d| format!("Name=gpu File={}\n", d.display()))
        .collect();
    let cluster = Cluster::start_with(
        &env,
        &gpufence_tests::cluster::ClusterSpec {
            gres_conf: gres,
            node_gres: format!("gpu:{JOBS}"),
            gpufence_extra: format!("layout = \"own\"\nnvml = false\n{MAJORS}"),
            port_base: std::env::var("GPUFENCE_CONC_PORT_BASE")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(17117),
            // One CPU per job, declared (config_overrides: slurmd takes it).
            cpus: Some(JOBS + 2),
            ..Default::default()
        },
    );
    let state = env.path("state");
    let done = AtomicBool::new(false);
    let torn: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut all_jobs = BTreeSet::new();
    std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(Ordering::SeqCst) {
                if let Err(e) = read_state(&state) {
                    torn.lock().unwrap().push(e);
                }
            }
        });
        // Never panic inside the scope before `done` is set: the reader
        // would keep the scope open.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for w in 0..waves() {
                all_jobs.extend(wave(&env, &cluster, &devs, w));
            }
        }));
        done.store(true, Ordering::SeqCst);
        if let Err(p) = r {
            std::panic::resume_unwind(p);
        }
    });
    let torn = torn.into_inner().unwrap();
    assert!(torn.is_empty(), "half-written state files: {torn:?}");
    let g: Value = serde_json::from_slice(&cluster.gpufence(&["grants", "--json"]).stdout).unwrap();
    assert_eq!(g, serde_json::json!([]), "no grant outlives its job");
    let files = state_files(&state);
    assert!(files.is_empty(), "state files left: {files:?}");
    let cgs: Vec<String> = std::fs::read_dir(env.cg.path(&env.root))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("job_"))
        .collect();
    assert!(cgs.is_empty(), "job cgroups left: {cgs:?}");
    // The audit log: whole lines; each job recorded, applied (batch step)
    // and revoked exactly once. Job 1 is cluster.sh's check, without GPUs:
    // no line at all.
    let lines = gpufence_tests::audit_log_settled(&env.path("log/audit.jsonl"));
    all_jobs.insert(1);
    let mut problems = check_audit_per_job(&lines, &all_jobs);
    problems.retain(|l| l != "job 1: []");
    let others: Vec<&str> = lines
        .iter()
        .filter(|l| l["job_id"].is_null())
        .map(|l| l["event"].as_str().unwrap_or("?"))
        .collect();
    if others != ["fence_installed", "nvml_unavailable"] {
        problems.push(format!("lines of no job: {others:?}"));
    }
    assert!(
        problems.is_empty(),
        "{} problems:\n{}",
        problems.len(),
        problems.join("\n")
    );
}
