//! Self-healing drains (`resume_when_clean`) on a real Slurm cluster on
//! this host: `gpufence sweep` (the CLI, with the cluster's `SLURM_CONF`
//! and the real `scontrol`) resumes a drain gpufence made once the cause
//! is gone, never while a holder lives, never with the key off, never an
//! admin's drain or a gpufence drain whose reason an admin replaced, and
//! leaves a flapping node drained with a reason saying so; and it resumes
//! the Epilog's own drain (a survivor of the job's end) once the survivor
//! is gone, after which the next GPU job runs.
//!
//! Every sweep is limited to the test's own subtree (`--cgroup`); the
//! causes are the test's own: a holder of a claimed misc device opened
//! before the fence (outside every job), a crontab in the test's own
//! cron directory (a medium finding, at the default threshold), and a
//! process the cgroup v1 freezer keeps from ending.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use gpufence_tests::cluster::{hostname, Cluster, ClusterSpec, AS_USER_TIMEOUT_S, TEST_USER};
use gpufence_tests::{gone, privileged, HoldableDevice, TestEnv, V1Freezer};
use serde_json::Value;

fn both(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `gpufence --config <config> sweep --cgroup <root> [--drain]` as a
/// health check runs it: the cluster's `SLURM_CONF`, `SLURMD_NODENAME`.
/// First waits (60 s at most) while slurmctld has the node
/// `NOT_RESPONDING` (between its pings of this loopback slurmd), a state
/// gpufence never resumes from.
fn sweep(cluster: &Cluster, config: &Path, root: &str, drain: bool) -> Output {
    Cluster::wait_for(Duration::from_secs(60), || {
        !show(cluster).0.contains("NOT_RESPONDING")
    });
    let mut c = Command::new(cluster.bin.join("gpufence"));
    c.arg("--config")
        .arg(config)
        .args(["sweep", "--cgroup", root])
        .env("SLURM_CONF", &cluster.slurm_conf)
        .env("SLURMD_NODENAME", hostname());
    if drain {
        c.arg("--drain");
    }
    c.output().expect("gpufence sweep")
}

/// The node's `State=` and `Reason=` per `scontrol show node` (Slurm's
/// own client, as root).
fn show(cluster: &Cluster) -> (String, Option<String>) {
    let o = cluster.admin("scontrol", &["show", "node", &hostname()]);
    let s = gpufence_model::drainrec::parse_show_node(&String::from_utf8_lossy(&o.stdout))
        .unwrap_or_else(|| panic!("scontrol show node: {}", both(&o)));
    (s.state, s.reason)
}

fn drained(cluster: &Cluster) -> bool {
    show(cluster).0.contains("DRAIN")
}

fn admin_ok(cluster: &Cluster, args: &[&str]) {
    let o = cluster.admin("scontrol", args);
    assert!(o.status.success(), "scontrol {args:?}: {}", both(&o));
}

fn events(env: &TestEnv, name: &str) -> Vec<Value> {
    gpufence_tests::audit_log(&env.path("log/audit.jsonl"))
        .into_iter()
        .filter(|e| e["event"] == name)
        .collect()
}

/// The config's keys for a sweep of this test's own node (appended to
/// [`TestEnv::config`]'s): `top` (top-level keys), layout `own`, nothing
/// exempt but the test's own cgroup `<root>/exempt` (never made: the
/// machine's slurmd.service, which other clusters on this host restart,
/// would otherwise be an `exemption_missing` finding of this node-wide
/// check), no NVML, the test's own (empty) cron and systemd directories,
/// `resume_when_clean = true` with `resume_max = 2` in 24 h, and the held
/// stand-in's misc `major` protected beside `nvidia`.
fn resume_config(env: &TestEnv, major: u32, top: &str) -> String {
    let (cron, units) = (env.path("cron"), env.path("systemd"));
    for d in [&cron, &units] {
        std::fs::create_dir_all(d).unwrap();
    }
    format!(
        "{top}layout = \"own\"\nexempt_cgroups = [\"{}/exempt\"]\nnvml = false\ncron_spool_dir = \"{}\"\nsystemd_system_dir = \"{}\"\nresume_when_clean = true\nresume_max = 2\nresume_window_s = 86400\n[majors]\nnvidia = 195\nfake-held = {major}\n",
        env.root,
        cron.display(),
        units.display(),
    )
}

/// slurmctld's port: `GPUFENCE_E2E_PORT_BASE` plus `offset`, else
/// `default` (slurmd takes the next one).
fn port_base(offset: u16, default: u16) -> u16 {
    std::env::var("GPUFENCE_E2E_PORT_BASE")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(default, |p: u16| p + offset)
}

/// The whole story on one cluster (a cluster start is the expensive part):
///
/// 1. a holder outside every job: `sweep --drain` drains with a
///    `gpufence: sweep: critical unfenced_gpu_holder` reason and records it;
/// 2. the holder lives: a sweep leaves the node drained, saying why;
/// 3. the holder gone, the key off: nothing resumed;
/// 4. the key on: resumed, `node_resumed` audited with the old reason;
/// 5. an admin's drain (`reason=maintenance`): left alone;
/// 6. a gpufence drain whose reason an admin replaced: left alone (a
///    note); resumed by the admin, gpufence forgets its record;
/// 7. `resume_max = 2` resumes within the window: the next clean sweep
///    drains it again as flapping, and later sweeps leave it.
#[test]
fn gpufence_drains_heal_themselves_and_no_one_elses() {
    if !privileged() {
        return;
    }
    let mut env = TestEnv::new("resume");
    let real = HoldableDevice::claim();
    let held = env.mknod("held", real.major, real.minor);
    let n0 = env.mknod("nvidia0", 195, 0);
    let cron = env.path("cron");
    // Opened before the fence (slurmd installs it at start): a holder
    // outside every job that the fence would now deny.
    let out = env.cgroup("outside");
    let holder = env.spawn_user_probe(&out, &["hold", held.to_str().unwrap()], "held");
    let cluster = Cluster::start_with(
        &env,
        &ClusterSpec {
            gres_conf: format!("Name=gpu Type=sim File={}\n", n0.display()),
            node_gres: "gpu:sim:1".into(),
            gpufence_extra: resume_config(&env, real.major, ""),
            port_base: port_base(1400, 18317),
            ..ClusterSpec::default()
        },
    );
    let on = cluster.config.clone();
    // The same config with the key off.
    let off: PathBuf = env.path("gpufence-off.toml");
    std::fs::write(
        &off,
        std::fs::read_to_string(&on)
            .unwrap()
            .replace("resume_when_clean = true", "resume_when_clean = false"),
    )
    .unwrap();
    let root = env.root.clone();
    let host = hostname();

    // 1. Drained for the holder.
    let o = sweep(&cluster, &on, &root, true);
    assert_eq!(o.status.code(), Some(1), "{}", both(&o));
    let (state, reason) = show(&cluster);
    assert!(state.contains("DRAIN"), "{state}");
    let reason = reason.unwrap_or_default();
    assert!(
        reason.starts_with(&format!(
            "gpufence: sweep: critical unfenced_gpu_holder pid {holder}"
        )),
        "{reason}"
    );
    let st = gpufence_model::record::StateDir::new(env.path("state"));
    let rec = st.read_drain(&host).unwrap().drain.expect("drain recorded");
    assert_eq!(rec.reason, reason);

    // 2. The holder lives: left drained, the note says why.
    let o = sweep(&cluster, &on, &root, false);
    assert_eq!(o.status.code(), Some(1), "{}", both(&o));
    assert!(drained(&cluster), "resumed while the holder lives");
    assert!(
        both(&o).contains("stays drained: ") && both(&o).contains("unfenced_gpu_holder"),
        "{}",
        both(&o)
    );

    // 3. The holder gone, the key off: still drained.
    // SAFETY: kill(2) of the probe this test started.
    unsafe { libc::kill(holder, libc::SIGKILL) };
    assert!(Cluster::wait_for(Duration::from_secs(10), || gone(holder)));
    let o = sweep(&cluster, &off, &root, false);
    assert_eq!(o.status.code(), Some(0), "{}", both(&o));
    assert!(drained(&cluster), "resumed with resume_when_clean = false");
    assert!(events(&env, "node_resumed").is_empty());

    // 4. The key on: resumed and audited.
    let o = sweep(&cluster, &on, &root, false);
    assert_eq!(o.status.code(), Some(0), "{}", both(&o));
    assert!(
        both(&o).contains("gpufence sweep: node resumed"),
        "{}",
        both(&o)
    );
    let (state, _) = show(&cluster);
    assert!(!state.contains("DRAIN"), "not resumed: {state}");
    let ev = events(&env, "node_resumed");
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(ev[0]["old_reason"], reason.as_str());
    assert_eq!(ev[0]["node"], host.as_str());
    assert_eq!(ev[0]["drained_at"], rec.drained_at);
    assert_eq!(ev[0]["resumes_in_window"], 1);
    let h = st.read_drain(&host).unwrap();
    assert_eq!((h.drain, h.resumes.len()), (None, 1));

    // 5. An admin's drain: left alone.
    let node = format!("nodename={host}");
    admin_ok(
        &cluster,
        &["update", &node, "state=drain", "reason=maintenance"],
    );
    let o = sweep(&cluster, &on, &root, false);
    assert_eq!(o.status.code(), Some(0), "{}", both(&o));
    assert_eq!(
        show(&cluster).1.as_deref(),
        Some("maintenance"),
        "{}",
        both(&o)
    );
    assert!(drained(&cluster));
    assert_eq!(events(&env, "node_resumed").len(), 1);
    admin_ok(&cluster, &["update", &node, "state=resume"]);

    // 6. A gpufence drain (a crontab, medium) whose reason an admin
    // replaced: left alone with a note, then forgotten once the admin
    // resumed it.
    let tab = cron.join(TEST_USER);
    std::fs::write(&tab, "@reboot /tmp/x\n").unwrap();
    let o = sweep(&cluster, &on, &root, true);
    assert_eq!(o.status.code(), Some(1), "{}", both(&o));
    let cron_reason = show(&cluster).1.unwrap_or_default();
    assert!(
        cron_reason.starts_with("gpufence: sweep: medium persistence_cron"),
        "{cron_reason}"
    );
    admin_ok(
        &cluster,
        &["update", &node, "state=drain", "reason=admin is looking"],
    );
    std::fs::remove_file(&tab).unwrap();
    let o = sweep(&cluster, &on, &root, false);
    assert_eq!(o.status.code(), Some(0), "{}", both(&o));
    assert!(both(&o).contains("another reason"), "{}", both(&o));
    assert_eq!(show(&cluster).1.as_deref(), Some("admin is looking"));
    assert!(drained(&cluster));
    admin_ok(&cluster, &["update", &node, "state=resume"]);
    let o = sweep(&cluster, &on, &root, false);
    assert!(both(&o).contains("no longer drained"), "{}", both(&o));
    assert_eq!(st.read_drain(&host).unwrap().drain, None);

    // 7. Flapping: one more resume reaches resume_max = 2; the drain after
    // it stays, with the flapping reason.
    std::fs::write(&tab, "@reboot /tmp/x\n").unwrap();
    assert_eq!(sweep(&cluster, &on, &root, true).status.code(), Some(1));
    std::fs::remove_file(&tab).unwrap();
    let o = sweep(&cluster, &on, &root, false);
    assert!(!drained(&cluster), "second resume: {}", both(&o));
    std::fs::write(&tab, "@reboot /tmp/x\n").unwrap();
    assert_eq!(sweep(&cluster, &on, &root, true).status.code(), Some(1));
    std::fs::remove_file(&tab).unwrap();
    let o = sweep(&cluster, &on, &root, false);
    assert!(drained(&cluster), "flapping node resumed: {}", both(&o));
    let flap = show(&cluster).1.unwrap_or_default();
    assert!(
        flap.starts_with(
            "gpufence: flapping: 2 resumes in 24h; last cause: sweep: medium persistence_cron"
        ) && flap.ends_with("; resume by hand"),
        "{flap}\n{}",
        both(&o)
    );
    assert_eq!(events(&env, "node_flapping").len(), 1);
    let o = sweep(&cluster, &on, &root, false);
    assert!(drained(&cluster), "{}", both(&o));
    assert!(both(&o).contains("flaps"), "{}", both(&o));
    assert_eq!(events(&env, "node_resumed").len(), 2);
    admin_ok(&cluster, &["update", &node, "state=resume"]);
}

/// The Epilog's own drain, resumed end to end: a job hands its GPU's
/// descriptor to a process of its user outside the job that nothing can
/// end (frozen by the cgroup v1 freezer: its `SIGKILL` stays pending,
/// [`V1Freezer`]), so the Epilog's response leaves a survivor and the
/// Epilog drains the node with gpufence's reason, naming the job and the
/// pid. A sweep while the survivor lives leaves the node drained, saying
/// why; once it is gone a sweep resumes the node, audits `node_resumed`
/// with the Epilog's reason, job and device, and the next GPU job runs on
/// the idle node.
#[test]
fn the_epilogs_drain_heals_once_its_survivor_is_gone() {
    if !privileged() {
        return;
    }
    let mut env = TestEnv::new("resume-epilog");
    let real = HoldableDevice::claim();
    let held = env.mknod("held", real.major, real.minor);
    let cluster = Cluster::start_with(
        &env,
        &ClusterSpec {
            gres_conf: format!("Name=gpu Type=held File={}\n", held.display()),
            node_gres: "gpu:held:1".into(),
            gpufence_extra: resume_config(&env, real.major, "term_grace_ms = 1000\n"),
            port_base: port_base(1420, 18337),
            ..ClusterSpec::default()
        },
    );
    let (config, root, host) = (cluster.config.clone(), env.root.clone(), hostname());
    let probe = cluster.bin.join("gpufence-probe");

    // The survivor-to-be: the user's process outside every job, waiting
    // for the job's descriptor, in a freezer cgroup (not frozen yet).
    let sock = env.path("jobs/handoff.sock");
    let outside = env.cgroup("outside");
    let mut recv = env.user_command_in(&outside, &probe);
    recv.arg("recvfd").arg(&sock);
    let stuck = env.spawn_ready(recv, "listening");
    let freezer = V1Freezer::create(&env);
    freezer.add(stuck);
    let go = env.path("jobs/go");
    let srun = cluster
        .user_cmd("timeout")
        .args([
            "--kill-after=10",
            AS_USER_TIMEOUT_S,
            "srun",
            "--gres=gpu:held:1",
            "sh",
            "-c",
            &format!(
                "echo JOB=$SLURM_JOB_ID; {} sendfd {} {}; while [ ! -e {} ]; do sleep 0.1; done",
                probe.display(),
                sock.display(),
                held.display(),
                go.display()
            ),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("srun");
    let dev = gpufence_model::device::DevNum::new(real.major, real.minor);
    let want: BTreeSet<_> = [dev].into();
    assert!(
        Cluster::wait_for(Duration::from_secs(30), || {
            gpufence_node::holders::scan::holder(stuck, &want).is_some()
        }),
        "the receiver {stuck} never got the job's descriptor"
    );
    freezer.freeze();
    std::fs::write(&go, "").unwrap();
    let o = srun.wait_with_output().expect("srun");
    let job: u32 = String::from_utf8_lossy(&o.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("JOB="))
        .and_then(|j| j.parse().ok())
        .unwrap_or_else(|| panic!("JOB= in {}", both(&o)));

    // 1. The Epilog drained the node, with gpufence's reason, and
    // recorded its drain (after its scontrol: both are waited for, and the
    // Epilog's last line, its `error` naming the drain).
    let reason_ok = |r: &str| {
        r.starts_with("gpufence")
            && r.contains(&format!("job {job}"))
            && r.contains(&format!("pid {stuck}"))
    };
    let st = gpufence_model::record::StateDir::new(env.path("state"));
    let mut now = (String::new(), None);
    assert!(
        Cluster::wait_for(Duration::from_secs(60), || {
            now = show(&cluster);
            now.0.contains("DRAIN")
                && now.1.as_deref().is_some_and(reason_ok)
                && st.read_drain(&host).is_ok_and(|h| h.drain.is_some())
                && events(&env, "error").iter().any(|e| e["job_id"] == job)
        }),
        "not drained by the Epilog: {now:?}, record {:?}\n{:?}\n{}",
        st.read_drain(&host),
        events(&env, "survivor"),
        cluster.log_tail("slurmd.log")
    );
    let reason = now.1.unwrap_or_default();
    let survivors: Vec<Value> = events(&env, "survivor")
        .into_iter()
        .filter(|e| e["job_id"] == job)
        .collect();
    assert_eq!(survivors.len(), 1, "{survivors:?}");
    assert_eq!(survivors[0]["pid"], stuck);
    let rec = st.read_drain(&host).unwrap().drain.unwrap();
    assert_eq!(
        (rec.reason.as_str(), rec.job_id),
        (reason.as_str(), Some(job))
    );
    let drain_line: Vec<Value> = events(&env, "error")
        .into_iter()
        .filter(|e| e["job_id"] == job)
        .collect();
    assert_eq!(drain_line.len(), 1, "{drain_line:?}");
    assert_eq!(drain_line[0]["drain_reason"], reason.as_str());

    // 2. The survivor lives: a sweep leaves the node drained, saying why.
    let o = sweep(&cluster, &config, &root, false);
    assert_eq!(o.status.code(), Some(1), "{}", both(&o));
    assert!(drained(&cluster), "resumed while the survivor lives");
    assert!(
        both(&o).contains("stays drained: ")
            && both(&o).contains(&format!("unfenced_gpu_holder pid {stuck}")),
        "{}",
        both(&o)
    );
    assert!(events(&env, "node_resumed").is_empty());

    // 3. Thawed, its pending SIGKILL ends it: the next sweep resumes.
    freezer.thaw();
    assert!(
        Cluster::wait_for(Duration::from_secs(10), || gone(stuck)),
        "the survivor {stuck} outlived its thaw"
    );
    drop(freezer);
    let o = sweep(&cluster, &config, &root, false);
    assert_eq!(o.status.code(), Some(0), "{}", both(&o));
    assert!(
        both(&o).contains("gpufence sweep: node resumed"),
        "{}",
        both(&o)
    );
    assert!(!drained(&cluster), "not resumed: {:?}", show(&cluster));
    let ev = events(&env, "node_resumed");
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(
        (&ev[0]["old_reason"], &ev[0]["job_id"], &ev[0]["node"]),
        (
            &Value::from(reason.as_str()),
            &Value::from(job),
            &Value::from(host.as_str())
        ),
    );
    assert_eq!(ev[0]["devices"], serde_json::json!([dev.to_string()]));
    assert_eq!(st.read_drain(&host).unwrap().drain, None);

    // 4. The node is usable: the next GPU job gets its GPU and the node
    // is idle after it, its Epilog clean.
    let o = cluster.as_user(
        "srun",
        &[
            "--gres=gpu:held:1",
            "sh",
            "-c",
            &format!(
                "echo JOB=$SLURM_JOB_ID; {} open {}",
                probe.display(),
                held.display()
            ),
        ],
    );
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{}", both(&o));
    assert!(
        out.contains(&format!("{} ok", held.display())),
        "the next job opens its GPU:\n{out}"
    );
    let next: u32 = out
        .lines()
        .find_map(|l| l.strip_prefix("JOB="))
        .and_then(|j| j.parse().ok())
        .unwrap();
    gpufence_tests::cluster::assert_node_clean(&cluster, &[next], &env.path("log/audit.jsonl"));
    assert!(!drained(&cluster));
}
