//! Crashes and restarts (issue 8, items 2 and 3).
//!
//! Crashes, at kernel level, always run: the real `gpufence-prolog`, the
//! plugin's grant step (`gpufence-probe apply`, the same `grant::grant_step` the
//! plugin calls in slurmstepd) and the real `gpufence-epilog` are killed
//! with SIGKILL at every step boundary listed in
//! [`gpufence_node::crashpoint::ALL`], through `GPUFENCE_TEST_CRASH_AT` in
//! their process environment. Each kill is checked to have happened (the
//! process died of SIGKILL: the boundary was reached). Then:
//!
//! - GPUs stay closed: outsiders and the subtree root open no GPU, the job
//!   never opens its neighbour's, a revoked job no longer opens its own,
//!   and a neighbour job keeps its grant;
//! - no state file is half-written and the audit log has only whole lines;
//! - [`every_crash_is_repaired_by_the_next_run`]: the next run of the job
//!   (prolog again after a prolog crash, as Slurm requeues; the epilog
//!   after a grant-step crash; the epilog again after an epilog crash)
//!   leaves nothing: no grant, record, note, temporary file or job cgroup;
//! - [`grants_left_by_crashes_are_collected_by_the_sweep`]: in the `slurm`
//!   layout, once Slurm removed the job cgroup, `gpufence sweep` (the CLI)
//!   removes whatever grant a crashed grant step or epilog left.
//!
//! Crashes on a real cluster (Debian's Slurm 22.05):
//! [`real_slurmstepd_killed_in_its_grant_step`] (the switch in slurmd's
//! environment, inherited by slurmstepd) and
//! [`real_prolog_and_epilog_killed_at_every_boundary`] (the switch in the
//! Prolog/Epilog wrapper scripts).
//!
//! Restarts, on a real cluster: [`slurmd_restart_keeps_fence_and_grant`].
//!
//! Devices are `mknod` nodes: ENXIO = allowed by the device cgroup, EPERM =
//! denied.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output};
use std::time::Duration;

use gpufence_cgroup::fence::{Fence, FORCE_NO_HELPER_ENV};
use gpufence_model::config::{Config, ConfigOrigin};
use gpufence_model::record::{AppliedGrant, JobRecord};
use gpufence_node::crashpoint::{self, Component, CrashPoint};
use gpufence_node::{host::fence_ops, Node};
use gpufence_tests::cluster::Cluster;
use gpufence_tests::{gone, privileged, probe_bin, workspace_bin, TestEnv};
use serde_json::Value;

const MAJORS: &str = "[majors]\nnvidia = 195\nnvidia-uvm = 241\n";
/// The job that crashes, on GPU 0.
const JOB: u32 = 42;
/// A neighbour that runs throughout, on GPU 1.
const NEIGHBOUR: u32 = 77;
const UID: u32 = 61_000;

fn both(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// One test world: a fence on the env's subtree, two GPUs, a neighbour job
/// holding GPU 1.
struct World {
    env: TestEnv,
    cfg: PathBuf,
    node: Node,
    gpu: [PathBuf; 2],
    outside: String,
    own: bool,
    /// Stand-in slurmstepds: (job, pid).
    stepds: Vec<(u32, i32)>,
}

impl World {
    fn new(tag: &str, own: bool) -> World {
        let mut env = TestEnv::new(tag);
        let gpu = [env.mknod("nvidia0", 195, 0), env.mknod("nvidia1", 195, 1)];
        let g = env.path("slurmd-G.txt");
        std::fs::write(
            &g,
            gpu.iter()
                .enumerate()
                .map(|(i, p)| {
                    format!(
                        "slurmd: Gres Name=gpu Type=(null) Count=1 Index={i} ID=7696487 File={} (null)\n",
                        p.display()
                    )
                })
                .collect::<String>(),
        )
        .unwrap();
        for d in ["cron", "systemd"] {
            std::fs::create_dir_all(env.path(d)).unwrap();
        }
        std::fs::write(env.path("passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
        let cfg = env.config(&format!(
            "layout = \"{}\"\nslurmd_gres = \"{}\"\nnvml = false\ndrain = false\n\
             cron_spool_dir = \"{}\"\nsystemd_system_dir = \"{}\"\npasswd_file = \"{}\"\n{MAJORS}",
            if own { "own" } else { "slurm" },
            g.display(),
            env.path("cron").display(),
            env.path("systemd").display(),
            env.path("passwd").display(),
        ));
        let node = Node::new(Config::load(&cfg).unwrap(), ConfigOrigin::File(cfg.clone())).unwrap();
        fence_ops::install(&node).expect("install the fence on the test subtree");
        let outside = env.cgroup("outside");
        let _ = &mut env;
        let mut w = World {
            env,
            cfg,
            node,
            gpu,
            outside,
            own,
            stepds: Vec::new(),
        };
        let st = w.prolog(NEIGHBOUR, 1, None);
        assert!(st.success(), "neighbour prolog");
        let st = w.grant(NEIGHBOUR, None);
        assert!(st.success(), "neighbour grant");
        w
    }

    /// The job cgroup (relative to the mount).
    fn job_cg(&self, job: u32) -> String {
        format!("{}/job_{job}", self.env.root)
    }

    fn cmd(&self, bin: &str, crash: Option<CrashPoint>) -> Command {
        let mut c = Command::new(workspace_bin(bin));
        // slurmd gives its scripts a fresh environment; the crash switch is
        // the only test addition.
        c.env_clear();
        if let Some(p) = crash {
            c.env(crashpoint::ENV, p.to_string());
        }
        c
    }

    fn run(&self, mut c: Command, what: &str, crash: Option<CrashPoint>) -> ExitStatus {
        let o = c.output().unwrap();
        check_status(&o, what, crash);
        o.status
    }

    /// `gpufence-prolog` for `job` on GPU index `gpu`.
    fn prolog(&self, job: u32, gpu: u32, crash: Option<CrashPoint>) -> ExitStatus {
        let mut c = self.cmd("gpufence-prolog", crash);
        c.args(["--config", self.cfg.to_str().unwrap()])
            .env("SLURM_JOB_ID", job.to_string())
            .env("SLURM_JOB_UID", UID.to_string())
            .env("SLURM_JOB_GPUS", gpu.to_string());
        self.run(c, &format!("prolog of job {job}"), crash)
    }

    /// The grant step for `job`, with a new stand-in slurmstepd (`own`
    /// layout: the step moves it into the job cgroup; `slurm` layout: it
    /// starts in `job_<id>/step_0/slurm`, as Slurm's cgroup/v2 puts it).
    fn grant(&mut self, job: u32, crash: Option<CrashPoint>) -> ExitStatus {
        let cg = if self.own {
            self.env.cgroup("stepds")
        } else {
            self.env.cgroup(&format!("job_{job}/step_0/slurm"))
        };
        let pid = self.env.spawn_sleeper(&cg);
        self.stepds.push((job, pid));
        let mut c = Command::new(probe_bin());
        c.env_clear();
        if let Some(p) = crash {
            c.env(crashpoint::ENV, p.to_string());
        }
        c.args([
            "apply",
            self.cfg.to_str().unwrap(),
            &job.to_string(),
            &UID.to_string(),
            &pid.to_string(),
        ]);
        let o = c.output().unwrap();
        check_status(&o, &format!("grant step of job {job}"), crash);
        if crash.is_none() {
            assert!(both(&o).starts_with("Granted {"), "{}", both(&o));
        }
        o.status
    }

    /// `gpufence-epilog` for `job`.
    fn epilog(&self, job: u32, crash: Option<CrashPoint>) -> ExitStatus {
        let mut c = self.cmd("gpufence-epilog", crash);
        c.args(["--config", self.cfg.to_str().unwrap()])
            .env("SLURM_JOB_ID", job.to_string())
            .env("SLURM_JOB_UID", UID.to_string());
        self.run(c, &format!("epilog of job {job}"), crash)
    }

    /// What Slurm does at the end of a job in the `slurm` layout: its
    /// processes are killed and its cgroup removed.
    fn slurm_ends_job(&self, job: u32) {
        let cg = self.job_cg(job);
        if self.env.cg.path(&cg).exists() {
            let _ = self.env.cg.kill(&cg);
            let ok = Cluster::wait_for(Duration::from_secs(10), || {
                self.env.cg.remove_tree(&cg).is_ok()
            });
            assert!(ok, "cannot remove /{cg}");
        }
    }

    fn opens(&self, cg: &str, gpu: usize) -> String {
        self.env.open_from(cg, &self.gpu[gpu])
    }

    /// GPUs are closed to everyone without a grant; the neighbour keeps
    /// its GPU; `job` never opens its neighbour's GPU, and its own only
    /// while its grant may legitimately live (`own_may_open`).
    fn check_closed(&self, job: u32, own_may_open: bool, when: &str) {
        for g in 0..2 {
            assert_eq!(
                self.opens(&self.outside, g),
                "EPERM",
                "{when}: outsider, GPU {g}"
            );
            assert_eq!(
                self.opens(&self.env.root, g),
                "EPERM",
                "{when}: subtree root, GPU {g}"
            );
        }
        let n = self.job_cg(NEIGHBOUR);
        assert_eq!(
            self.opens(&n, 1),
            "ENXIO",
            "{when}: the neighbour keeps its GPU"
        );
        assert_eq!(
            self.opens(&n, 0),
            "EPERM",
            "{when}: the neighbour never gets GPU 0"
        );
        let j = self.job_cg(job);
        if self.env.cg.path(&j).exists() {
            assert_eq!(
                self.opens(&j, 1),
                "EPERM",
                "{when}: job {job} never gets GPU 1"
            );
            if !own_may_open {
                assert_eq!(
                    self.opens(&j, 0),
                    "EPERM",
                    "{when}: job {job} after its revoke"
                );
            }
        }
        let (_, bad) = self.node.state.applied(None);
        assert!(bad.is_empty(), "{when}: {bad:?}");
        check_state_whole(&self.env.path("state"), when);
        audit_lines(&self.env.path("log/audit.jsonl"), when);
    }

    /// Nothing of `job` is left: no grant, record, note, temporary file or
    /// (own layout) job cgroup; the neighbour's grant is intact.
    fn check_gone(&self, job: u32, when: &str) {
        let fence = Fence::open(&self.env.bpffs).unwrap();
        let entries = fence.entries().unwrap();
        assert!(
            entries.iter().all(|e| e.job_id == NEIGHBOUR),
            "{when}: grants left {entries:?}"
        );
        assert!(
            entries.iter().any(|e| e.job_id == NEIGHBOUR),
            "{when}: the neighbour lost its grant"
        );
        assert_eq!(
            self.node.state.read_record(job).unwrap(),
            None,
            "{when}: record left"
        );
        assert!(
            self.node.state.applied(Some(job)).0.is_empty(),
            "{when}: notes left"
        );
        let tmp: Vec<String> = state_files(&self.env.path("state"))
            .into_iter()
            .filter(|f| f.contains("/."))
            .collect();
        assert!(tmp.is_empty(), "{when}: temporary files left {tmp:?}");
        if self.own {
            assert!(
                !self.env.cg.path(&self.job_cg(job)).exists(),
                "{when}: job cgroup left"
            );
        }
        self.check_closed(job, false, when);
    }
}

/// A run armed with `crash` died of SIGKILL (the boundary was reached);
/// an unarmed run succeeded.
fn check_status(o: &Output, what: &str, crash: Option<CrashPoint>) {
    match crash {
        Some(p) => assert_eq!(
            o.status.signal(),
            Some(libc::SIGKILL),
            "{what} armed at {p} did not die there: {:?}\n{}",
            o.status,
            both(o)
        ),
        None => assert!(o.status.success(), "{what}: {:?}\n{}", o.status, both(o)),
    }
}

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

/// Every record and note parses.
fn check_state_whole(state: &Path, when: &str) {
    for f in state_files(state) {
        if f.contains("/.") {
            continue;
        }
        let bytes = std::fs::read(state.join(&f)).unwrap();
        let ok = if f.starts_with("jobs/") {
            serde_json::from_slice::<JobRecord>(&bytes).is_ok()
        } else {
            serde_json::from_slice::<AppliedGrant>(&bytes).is_ok()
        };
        assert!(
            ok,
            "{when}: {f} is half-written: {}",
            String::from_utf8_lossy(&bytes)
        );
    }
}

fn audit_lines(path: &Path, when: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        text.is_empty() || text.ends_with('\n'),
        "{when}: torn audit line"
    );
    text.lines()
        .map(|l| {
            serde_json::from_str(l).unwrap_or_else(|e| panic!("{when}: audit line {l:?}: {e}"))
        })
        .collect()
}

/// Events of `job`, in order.
fn events(w: &World, job: u32) -> Vec<String> {
    audit_lines(&w.env.path("log/audit.jsonl"), "events")
        .into_iter()
        .filter(|e| e["job_id"] == job)
        .map(|e| e["event"].as_str().unwrap_or("?").to_string())
        .collect()
}

/// Whether the job's grant may still live at `p`: after it was granted
/// and before the epilog revoked it.
fn grant_may_live(p: CrashPoint) -> bool {
    !matches!(
        p,
        crashpoint::EPILOG_REVOKED
            | crashpoint::EPILOG_REVOKE_AUDITED
            | crashpoint::EPILOG_RESPONDED
            | crashpoint::EPILOG_CGROUP_REMOVED
            | crashpoint::EPILOG_FORGOTTEN
    )
}

fn crash_and_repair(p: CrashPoint) {
    let tag = format!("crash-{}-{}", p.component.as_str(), p.step);
    let mut w = World::new(&tag, true);
    let when = format!("after a crash at {p} ({})", p.state);
    match p.component {
        Component::Prolog => {
            // An earlier job with the same id whose epilog was killed
            // before it revoked: its grant, record and note are still there.
            w.prolog(JOB, 0, None);
            w.grant(JOB, None);
            w.epilog(JOB, Some(crashpoint::EPILOG_STARTED));
            w.prolog(JOB, 0, Some(p));
            w.check_closed(JOB, true, &when);
            // Slurm requeues the job: the prolog runs again, then the job.
            w.prolog(JOB, 0, None);
            assert!(
                w.node.state.applied(Some(JOB)).0.is_empty(),
                "{when}: the next prolog cleared the earlier job's notes"
            );
            w.grant(JOB, None);
            assert_eq!(
                w.opens(&w.job_cg(JOB), 0),
                "ENXIO",
                "{when}: the requeued job has its GPU"
            );
            w.epilog(JOB, None);
        }
        Component::Grant => {
            w.prolog(JOB, 0, None);
            w.grant(JOB, Some(p));
            w.check_closed(JOB, true, &when);
            // The step failed; the job ends; its epilog runs.
            w.epilog(JOB, None);
        }
        Component::Epilog => {
            w.prolog(JOB, 0, None);
            w.grant(JOB, None);
            assert_eq!(w.opens(&w.job_cg(JOB), 0), "ENXIO");
            w.epilog(JOB, Some(p));
            w.check_closed(JOB, grant_may_live(p), &when);
            // The epilog runs again (an admin, or Slurm after a requeue).
            w.epilog(JOB, None);
        }
    }
    let when = format!("after the repair of a crash at {p}");
    w.check_gone(JOB, &when);
    let ev = events(&w, JOB);
    let last = |n: &str| ev.iter().rposition(|e| e == n);
    assert!(
        last("grant_revoked") > last("grant_applied") || last("grant_applied").is_none(),
        "{when}: the last grant was revoked in the audit log: {ev:?}"
    );
    // The neighbour ends cleanly too.
    w.epilog(NEIGHBOUR, None);
    let fence = Fence::open(&w.env.bpffs).unwrap();
    assert_eq!(
        fence.entries().unwrap(),
        vec![],
        "{when}: neighbour revoked"
    );
    assert!(state_files(&w.env.path("state")).is_empty(), "{when}");
}

/// Every crash point of the prolog, the grant step and the epilog, each
/// in its own world; the next run repairs the state.
#[test]
fn every_crash_is_repaired_by_the_next_run() {
    if !privileged() {
        return;
    }
    assert!(crashpoint::ALL.len() >= 12);
    for p in crashpoint::ALL {
        crash_and_repair(*p);
    }
}

/// Grant-step and epilog crashes in the `slurm` layout: once Slurm removed
/// the job cgroup, `gpufence sweep` removes the grant the crash left, and
/// nothing else.
#[test]
fn grants_left_by_crashes_are_collected_by_the_sweep() {
    if !privileged() {
        return;
    }
    let points: Vec<CrashPoint> = crashpoint::ALL
        .iter()
        .copied()
        .filter(|p| p.component != Component::Prolog)
        .collect();
    for p in points {
        let tag = format!("sweep-{}-{}", p.component.as_str(), p.step);
        let mut w = World::new(&tag, false);
        let when = format!("after a crash at {p} ({})", p.state);
        w.prolog(JOB, 0, None);
        if p.component == Component::Grant {
            w.grant(JOB, Some(p));
        } else {
            w.grant(JOB, None);
            w.epilog(JOB, Some(p));
        }
        w.check_closed(JOB, grant_may_live(p), &when);
        w.slurm_ends_job(JOB);
        let o = Command::new(workspace_bin("gpufence"))
            .args([
                "--config",
                w.cfg.to_str().unwrap(),
                "sweep",
                "--json",
                "--cgroup",
                &w.env.root,
            ])
            .output()
            .unwrap();
        let fence = Fence::open(&w.env.bpffs).unwrap();
        let left: Vec<u32> = fence.entries().unwrap().iter().map(|e| e.job_id).collect();
        assert!(
            left.iter().all(|j| *j == NEIGHBOUR) && left.contains(&NEIGHBOUR),
            "{when}: the sweep left grants {left:?}:\n{}",
            both(&o)
        );
        let stale: Vec<Value> = String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|f| f["kind"] == "stale_grant")
            .collect();
        let had_grant = p == crashpoint::GRANT_GRANTED || p == crashpoint::EPILOG_STARTED;
        assert_eq!(
            stale.len(),
            usize::from(had_grant),
            "{when}: stale grants found: {stale:?}\n{}",
            both(&o)
        );
        w.check_closed(JOB, false, &format!("{when}, swept"));
    }
}

/// The port base of this file's clusters (`GPUFENCE_FAULTS_PORT_BASE`,
/// default 17217; each test adds its own offset of 10).
fn port_base(offset: u16) -> u16 {
    std::env::var("GPUFENCE_FAULTS_PORT_BASE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(17217)
        + offset
}

/// A cluster with two fake GPUs (nvidia0 195:0, nvidia1 195:1), layout
/// `own` (this host's Slurm places no job in cgroup v2).
fn two_gpu_cluster(env: &TestEnv, offset: u16) -> (Cluster, [PathBuf; 2]) {
    let gpu = [env.mknod("nvidia0", 195, 0), env.mknod("nvidia1", 195, 1)];
    let gres = format!(
        "Name=gpu File={}\nName=gpu File={}\n",
        gpu[0].display(),
        gpu[1].display()
    );
    let c = Cluster::start(
        env,
        &gres,
        "gpu:2",
        &format!("layout = \"own\"\nnvml = false\n{MAJORS}"),
        port_base(offset),
    );
    (c, gpu)
}

/// The cluster's audit log while its Prologs and Epilogs may still write.
fn cluster_audit(env: &TestEnv) -> Vec<Value> {
    gpufence_tests::audit_log(&env.path("log/audit.jsonl"))
}

fn live_grant_jobs(c: &Cluster) -> Vec<u64> {
    let o = c.gpufence(&["grants", "--json"]);
    let v: Value = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("gpufence grants --json: {e}: {}", both(&o)));
    v.as_array()
        .unwrap()
        .iter()
        .map(|g| g["job_id"].as_u64().unwrap())
        .collect()
}

fn node_state(c: &Cluster) -> String {
    String::from_utf8_lossy(&c.as_user("sinfo", &["-h", "-o", "%T"]).stdout)
        .trim()
        .to_string()
}

/// slurmd is restarted while a job runs, once cleanly (SIGTERM) and once
/// by a crash (SIGKILL): the fence stays attached through the same pinned
/// link (the new slurmd swaps the program in, `replaced_program`), the
/// job's grant stays, the job opens its GPU (and not the other) while
/// slurmd is down and after it is back, outsiders open neither, and the
/// epilog the new slurmd runs still revokes the grant and forgets the job.
/// In between, a slurmd started on a "kernel without the ancestor helper"
/// (the test switch) refuses to start, and the job keeps its GPU.
#[test]
fn slurmd_restart_keeps_fence_and_grant() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("restart");
    let (cluster, gpu) = two_gpu_cluster(&env, 0);
    let jobs = env.path("jobs");
    let probe = cluster.bin.join("gpufence-probe");
    let script = format!(
        "#!/bin/sh\necho JOB=$SLURM_JOB_ID\necho GPUS=$SLURM_JOB_GPUS\nk=1\n\
         while [ ! -e {d}/end ]; do\n\
           if [ -e {d}/ask-$k ]; then {p} open {g0} {g1} > {d}/ans-$k.tmp; mv {d}/ans-$k.tmp {d}/ans-$k; k=$((k+1)); fi\n\
           sleep 0.1\n\
         done\n",
        d = jobs.display(),
        p = probe.display(),
        g0 = gpu[0].display(),
        g1 = gpu[1].display(),
    );
    let script_path = jobs.join("restart.sh");
    std::fs::write(&script_path, script).unwrap();
    let out = jobs.join("restart.out");
    let o = cluster.as_user(
        "sbatch",
        &[
            "--gres=gpu:1",
            "-o",
            out.to_str().unwrap(),
            script_path.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", both(&o));
    let mut text = String::new();
    assert!(
        Cluster::wait_for(Duration::from_secs(30), || {
            text = std::fs::read_to_string(&out).unwrap_or_default();
            text.contains("GPUS=")
        }),
        "the job did not start: {text}\n{}",
        cluster.log_tail("slurmd.log")
    );
    let job: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("JOB="))
        .and_then(|v| v.parse().ok())
        .unwrap();
    let mine: usize = text
        .lines()
        .find_map(|l| l.strip_prefix("GPUS="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("one GPU index: {text}"));
    let outside = env.cgroup("outside");
    let mut k = 0;
    let mut check = |when: &str| {
        // The job opens its GPU anew (a fresh device check), not the other.
        k += 1;
        std::fs::write(jobs.join(format!("ask-{k}")), "").unwrap();
        let ans = jobs.join(format!("ans-{k}"));
        assert!(
            Cluster::wait_for(Duration::from_secs(30), || ans.exists()),
            "{when}: the job did not answer"
        );
        let a = std::fs::read_to_string(&ans).unwrap();
        let v = |g: &PathBuf| {
            let p = format!("{} ", g.display());
            a.lines()
                .find_map(|l| l.strip_prefix(&p))
                .unwrap_or("missing")
                .to_string()
        };
        assert_eq!(
            v(&gpu[mine]),
            "ENXIO",
            "{when}: the job opens its GPU:\n{a}"
        );
        assert_eq!(v(&gpu[1 - mine]), "EPERM", "{when}: not the other:\n{a}");
        for g in &gpu {
            assert_eq!(env.open_from(&outside, g), "EPERM", "{when}: outsider");
        }
        assert_eq!(
            live_grant_jobs(&cluster),
            vec![job],
            "{when}: the grant stays"
        );
        let st = cluster.gpufence(&["fence", "status", "--json"]);
        let st: Value = serde_json::from_slice(&st.stdout).unwrap();
        assert_eq!(st["installed"], true, "{when}: {st}");
    };
    check("before the restart");
    let installs = |env: &TestEnv| -> Vec<Value> {
        cluster_audit(env)
            .into_iter()
            .filter(|e| e["event"] == "fence_installed")
            .collect()
    };
    let before = installs(&env);
    let link = before.last().unwrap()["link_id"].clone();
    for (signal, how) in [(libc::SIGTERM, "SIGTERM"), (libc::SIGKILL, "SIGKILL")] {
        let n = installs(&env).len();
        cluster.stop_slurmd(signal);
        check(&format!("while slurmd is down ({how})"));
        cluster.start_slurmd();
        assert!(
            Cluster::wait_for(Duration::from_secs(30), || installs(&env).len() > n),
            "the new slurmd did not reinstall the fence:\n{}",
            cluster.log_tail("slurmd.log")
        );
        let last = installs(&env).pop().unwrap();
        assert_eq!(last["link_id"], link, "the same pinned link: {last}");
        assert_eq!(last["replaced_program"], true, "{last}");
        check(&format!("after slurmd came back ({how})"));
    }
    // A slurmd whose plugin cannot install the fence (the kernel lacks the
    // ancestor helper, forced by the test switch in slurmd's environment)
    // does not start: the required plugin's init fails, slurmd exits and
    // says why in its log. The fence it found stays attached with the
    // job's grant; the job keeps its GPU, outsiders stay out.
    cluster.stop_slurmd(libc::SIGTERM);
    let n = installs(&env).len();
    let refused = cluster.spawn_slurmd(&[(FORCE_NO_HELPER_ENV, "1")]);
    assert!(
        Cluster::wait_for(Duration::from_secs(30), || gone(refused)),
        "slurmd started without the helper:\n{}",
        cluster.log_tail("slurmd.log")
    );
    let log = cluster.log_tail("slurmd.log");
    assert!(
        log.contains("bpf_get_current_ancestor_cgroup_id") && log.contains("Linux 6.1"),
        "slurmd's log names the reason:\n{log}"
    );
    assert_eq!(installs(&env).len(), n, "nothing installed");
    check("after a slurmd refused to start (no helper)");
    cluster.start_slurmd();
    check("after slurmd came back (helper present)");
    // The job ends; the new slurmd's epilog cleans up.
    std::fs::write(jobs.join("end"), "").unwrap();
    let revoked = |env: &TestEnv| {
        cluster_audit(env)
            .iter()
            .filter(|e| e["job_id"] == job)
            .map(|e| e["event"].as_str().unwrap_or("?").to_string())
            .collect::<Vec<_>>()
    };
    assert!(
        Cluster::wait_for(Duration::from_secs(60), || revoked(&env)
            .contains(&"grant_revoked".to_string())
            && node_state(&cluster) == "idle"),
        "the epilog did not run after the restarts: {:?} {}\n{}",
        revoked(&env),
        node_state(&cluster),
        cluster.log_tail("slurmd.log")
    );
    assert_eq!(
        revoked(&env),
        ["grant_recorded", "grant_applied", "grant_revoked"],
        "each once"
    );
    assert_eq!(live_grant_jobs(&cluster), Vec::<u64>::new());
    assert!(state_files(&env.path("state")).is_empty());
    assert!(!env.cg.path(&format!("{}/job_{job}", env.root)).exists());
    for g in &gpu {
        assert_eq!(
            env.open_from(&outside, g),
            "EPERM",
            "outsider after the job"
        );
    }
}

/// Whether cgroup `rel` exists and holds no process (`populated 0`).
fn empty_cgroup(env: &TestEnv, rel: &str) -> bool {
    std::fs::read_to_string(env.cg.path(rel).join("cgroup.events"))
        .is_ok_and(|t| t.lines().any(|l| l == "populated 0"))
}

/// The real slurmstepd is killed with SIGKILL at each boundary of the
/// plugin's grant step (the switch is in slurmd's environment, which
/// slurmstepd inherits; never in the job's). Slurm 22.05 does not notice a
/// dead slurmstepd by itself: the step hangs (srun waits) until the job is
/// cancelled. Meanwhile outsiders open no GPU and the step's tasks never
/// run; after `scancel`, the epilog leaves no grant, record, note or job
/// cgroup, and the node stays in service. Then, with the switch gone, a
/// job gets its GPU again.
#[test]
fn real_slurmstepd_killed_in_its_grant_step() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("stepd-crash");
    let (cluster, gpu) = two_gpu_cluster(&env, 10);
    let probe = cluster.bin.join("gpufence-probe");
    let outside = env.cgroup("outside");
    let script = format!(
        "echo JOB=$SLURM_JOB_ID; {} open {} {}",
        probe.display(),
        gpu[0].display(),
        gpu[1].display()
    );
    let admin = |args: &[&str]| {
        Command::new("env")
            .arg(format!("SLURM_CONF={}", cluster.slurm_conf.display()))
            .args(args)
            .output()
            .unwrap()
    };
    let mut arm: Vec<Option<CrashPoint>> = crashpoint::ALL
        .iter()
        .copied()
        .filter(|p| p.component == Component::Grant)
        .map(Some)
        .collect();
    arm.push(None);
    for p in arm {
        cluster.stop_slurmd(libc::SIGTERM);
        match p {
            Some(p) => cluster.start_slurmd_with_env(&[(crashpoint::ENV, &p.to_string())]),
            None => cluster.start_slurmd(),
        }
        let when = p.map_or("unarmed".to_string(), |p| {
            format!("slurmstepd killed at {p}")
        });
        assert!(
            Cluster::wait_for(Duration::from_secs(30), || node_state(&cluster) == "idle"),
            "{when}: node {}",
            node_state(&cluster)
        );
        let srun = cluster
            .user_cmd("srun")
            .args(["--gres=gpu:1", "sh", "-c", &script])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Armed, the job hangs in squeue; unarmed, it may be gone before
        // squeue is first asked (its Prolog and Epilog take a few ms): its
        // id then comes from its own output.
        let (job, out) = if p.is_some() {
            let mut job: Option<u64> = None;
            assert!(
                Cluster::wait_for(Duration::from_secs(30), || {
                    job = String::from_utf8_lossy(&admin(&["squeue", "-h", "-o", "%i"]).stdout)
                        .trim()
                        .parse()
                        .ok();
                    job.is_some()
                }),
                "{when}: no job in squeue"
            );
            let job = job.unwrap();
            let step_cg = format!("{}/job_{job}/step_0", env.root);
            // The step cgroup exists (the grant step placed slurmstepd
            // there) and is empty: slurmstepd died at the boundary.
            assert!(
                Cluster::wait_for(Duration::from_secs(30), || empty_cgroup(&env, &step_cg)),
                "{when}: slurmstepd of job {job} did not die in /{step_cg}\n{}",
                cluster.log_tail("slurmd.log")
            );
            for g in &gpu {
                assert_eq!(env.open_from(&outside, g), "EPERM", "{when}: outsider");
                assert_eq!(env.open_from(&env.root, g), "EPERM", "{when}: subtree root");
            }
            let o = admin(&["scancel", &job.to_string()]);
            assert!(o.status.success(), "{when}: {}", both(&o));
            let out = both(&srun.wait_with_output().unwrap());
            // (srun's own exit status after the cancel varies; what
            // matters is that the task never ran.)
            assert!(
                !out.contains("JOB=") && !out.contains("ENXIO") && !out.contains("EPERM"),
                "{when}: the task never ran: {out}"
            );
            (job, out)
        } else {
            let o = srun.wait_with_output().unwrap();
            let out = both(&o);
            assert!(o.status.success(), "{when}: {out}");
            assert_eq!(out.matches("ENXIO").count(), 1, "{when}: one GPU: {out}");
            let job = job_of(&out).unwrap_or_else(|| panic!("{when}: no JOB= in {out}"));
            (job, out)
        };
        let events = |env: &TestEnv| -> Vec<String> {
            cluster_audit(env)
                .iter()
                .filter(|e| e["job_id"] == job)
                .map(|e| e["event"].as_str().unwrap_or("?").to_string())
                .collect()
        };
        let mut state = String::new();
        assert!(
            Cluster::wait_for(Duration::from_secs(60), || {
                state = node_state(&cluster);
                events(&env).contains(&"grant_revoked".to_string())
                    && live_grant_jobs(&cluster).is_empty()
                    && state_files(&env.path("state")).is_empty()
                    && state == "idle"
            }),
            "{when}: job {job} not cleaned up: {:?} grants {:?} files {:?} node {state}\n{}\n{out}",
            events(&env),
            live_grant_jobs(&cluster),
            state_files(&env.path("state")),
            cluster.log_tail("slurmd.log")
        );
        assert!(
            !env.cg.path(&format!("{}/job_{job}", env.root)).exists(),
            "{when}: job cgroup left"
        );
        for g in &gpu {
            assert_eq!(
                env.open_from(&outside, g),
                "EPERM",
                "{when}: outsider after"
            );
        }
    }
}

/// The job's id from a `JOB=` line.
fn job_of(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("JOB="))
        .and_then(|v| v.trim().parse().ok())
}

/// slurmd's Prolog and Epilog killed at each of their boundaries on a real
/// cluster (the switch travels in the wrapper scripts slurm.conf names,
/// which only root writes).
///
/// - Prolog: Slurm drains the node and requeues the job held; no grant
///   exists meanwhile and outsiders open nothing. With the switch gone, the
///   admin resumes the node and releases the job: the job's next prolog
///   repairs what the killed one left, the job runs with its GPU (and not
///   the other), and its epilog leaves nothing.
/// - Epilog: Slurm drains the node (fail loud); outsiders open nothing, and
///   a grant the epilog did not revoke yet sits on the job's empty cgroup.
///   The repair is the admin's: run the Epilog again for the job (as the
///   drain reason asks), then resume; nothing of the job is left.
#[test]
fn real_prolog_and_epilog_killed_at_every_boundary() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("script-crash");
    let (cluster, gpu) = two_gpu_cluster(&env, 20);
    let probe = cluster.bin.join("gpufence-probe");
    let outside = env.cgroup("outside");
    let jobs = env.path("jobs");
    let open = format!(
        "{} open {} {}",
        probe.display(),
        gpu[0].display(),
        gpu[1].display()
    );
    let host = gpufence_tests::cluster::hostname();
    let resume = || {
        let o = cluster.admin(
            "scontrol",
            &["update", &format!("nodename={host}"), "state=resume"],
        );
        assert!(o.status.success(), "resume: {}", both(&o));
    };
    let closed = |when: &str| {
        for g in &gpu {
            assert_eq!(env.open_from(&outside, g), "EPERM", "{when}: outsider");
            assert_eq!(env.open_from(&env.root, g), "EPERM", "{when}: subtree root");
        }
    };
    let events = |job: u64| -> Vec<String> {
        cluster_audit(&env)
            .iter()
            .filter(|e| e["job_id"] == job)
            .map(|e| e["event"].as_str().unwrap_or("?").to_string())
            .collect()
    };
    // Clean: revoked after the last grant, no grant, no state file, no job
    // cgroup, node idle.
    let gone = |job: u64, when: &str| {
        let mut state = String::new();
        assert!(
            Cluster::wait_for(Duration::from_secs(60), || {
                state = node_state(&cluster);
                let ev = events(job);
                let last = |n: &str| ev.iter().rposition(|e| e == n);
                // (No grant_applied at all: the step ran without a grant.)
                (last("grant_revoked") > last("grant_applied") || last("grant_applied").is_none())
                    && live_grant_jobs(&cluster).is_empty()
                    && state_files(&env.path("state")).is_empty()
                    && state == "idle"
                    // The job cgroup goes too; under CI's two test threads
                    // on two CPUs it has been seen to go after the node
                    // is idle again.
                    && !env.cg.path(&format!("{}/job_{job}", env.root)).exists()
            }),
            "{when}: job {job}: {:?} grants {:?} files {:?} node {state} job cgroup left {}\n{}",
            events(job),
            live_grant_jobs(&cluster),
            state_files(&env.path("state")),
            env.cg.path(&format!("{}/job_{job}", env.root)).exists(),
            cluster.log_tail("slurmd.log")
        );
        closed(when);
    };
    let drained = |when: &str| {
        let mut st = String::new();
        assert!(
            Cluster::wait_for(Duration::from_secs(60), || {
                st = node_state(&cluster);
                st.starts_with("drain")
            }),
            "{when}: Slurm drains the node: {st}\n{}",
            cluster.log_tail("slurmd.log")
        );
    };
    for p in crashpoint::ALL
        .iter()
        .copied()
        .filter(|p| p.component == Component::Prolog)
    {
        let when = format!("prolog killed at {p}");
        cluster.set_script_env("prolog", &[(crashpoint::ENV, &p.to_string())]);
        let out = jobs.join(format!("prolog-{}.out", p.step));
        let o = cluster.as_user(
            "sbatch",
            &[
                "--parsable",
                "--gres=gpu:1",
                "-o",
                out.to_str().unwrap(),
                "--wrap",
                &format!("echo JOB=$SLURM_JOB_ID; echo GPUS=$SLURM_JOB_GPUS; {open}"),
            ],
        );
        assert!(o.status.success(), "{when}: {}", both(&o));
        let job: u64 = String::from_utf8_lossy(&o.stdout).trim().parse().unwrap();
        drained(&when);
        // Requeued and held: pending, never ran.
        assert!(
            Cluster::wait_for(Duration::from_secs(30), || {
                let s = both(&cluster.admin("squeue", &["-h", "-j", &job.to_string(), "-o", "%T"]));
                s.trim() == "PENDING"
            }),
            "{when}: job {job} requeued: {}",
            both(&cluster.admin("squeue", &["-h", "-o", "%i %T %r"]))
        );
        assert!(live_grant_jobs(&cluster).is_empty(), "{when}: no grant");
        closed(&when);
        check_state_whole(&env.path("state"), &when);
        cluster.set_script_env("prolog", &[]);
        resume();
        let o = cluster.admin("scontrol", &["release", &job.to_string()]);
        assert!(o.status.success(), "{when}: release: {}", both(&o));
        // A requeued job waits for a begin time Slurm sets in the future.
        let o = cluster.admin(
            "scontrol",
            &["update", &format!("jobid={job}"), "starttime=now"],
        );
        assert!(o.status.success(), "{when}: starttime: {}", both(&o));
        let mut text = String::new();
        assert!(
            Cluster::wait_for(Duration::from_secs(60), || {
                text = std::fs::read_to_string(&out).unwrap_or_default();
                text.lines().filter(|l| l.contains(" E")).count() == 2
            }),
            "{when}: the requeued job did not run: {text}\n{}",
            both(&cluster.admin("squeue", &["-h", "-o", "%i %T %r"]))
        );
        assert_eq!(job_of(&text), Some(job), "{when}: {text}");
        let mine: usize = text
            .lines()
            .find_map(|l| l.strip_prefix("GPUS="))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{when}: {text}"));
        let v = |g: &PathBuf| {
            let pre = format!("{} ", g.display());
            text.lines()
                .find_map(|l| l.strip_prefix(&pre))
                .unwrap_or("missing")
                .to_string()
        };
        // Slurm 22.05 sometimes relaunches a job requeued after a prolog
        // failure without running the Prolog again (seen here when the
        // relaunch follows the failed attempt quickly: "reissued job
        // credential", then "Launching batch job" with no Prolog). The
        // job then has no record: it runs without GPUs, and says so.
        let prolog_skipped = events(job).contains(&"grant_refused".to_string());
        if prolog_skipped {
            assert!(
                text.lines()
                    .any(|l| l.starts_with(&format!("gpufence: job {job} step "))
                        && l.contains(" has no GPU grant")),
                "{when}: the user is told:\n{text}"
            );
            assert_eq!(v(&gpu[mine]), "EPERM", "{when}: no record, no GPU:\n{text}");
        } else {
            assert_eq!(
                v(&gpu[mine]),
                "ENXIO",
                "{when}: its GPU:\n{text}\n{:?}\n{}",
                events(job),
                cluster.log_tail("slurmd.log")
            );
        }
        assert_eq!(v(&gpu[1 - mine]), "EPERM", "{when}: not the other:\n{text}");
        gone(job, &format!("after the repair of a {when}"));
    }
    for p in crashpoint::ALL
        .iter()
        .copied()
        .filter(|p| p.component == Component::Epilog)
    {
        let when = format!("epilog killed at {p}");
        cluster.set_script_env("epilog", &[(crashpoint::ENV, &p.to_string())]);
        let o = cluster.as_user(
            "srun",
            &[
                "--gres=gpu:1",
                "sh",
                "-c",
                &format!("echo JOB=$SLURM_JOB_ID; {open}"),
            ],
        );
        let text = both(&o);
        assert!(o.status.success(), "{when}: {text}");
        assert_eq!(text.matches("ENXIO").count(), 1, "{when}: {text}");
        let job = job_of(&text).unwrap();
        drained(&when);
        closed(&when);
        check_state_whole(&env.path("state"), &when);
        let live = live_grant_jobs(&cluster);
        if grant_may_live(p) {
            assert_eq!(live, vec![job], "{when}: the grant is not revoked yet");
        } else {
            assert!(live.is_empty(), "{when}: revoked: {live:?}");
        }
        // The admin's repair: the Epilog again for the job, then resume.
        cluster.set_script_env("epilog", &[]);
        let o = Command::new(cluster.bin.join("epilog.sh"))
            .env_clear()
            .env("SLURM_JOB_ID", job.to_string())
            .output()
            .unwrap();
        assert!(o.status.success(), "{when}: epilog again: {}", both(&o));
        resume();
        gone(job, &format!("after the repair of an {when}"));
    }
}
