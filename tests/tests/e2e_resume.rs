//! Self-healing drains (`resume_when_clean`) on a real Slurm cluster on
//! this host: `gpufence sweep` (the CLI, with the cluster's `SLURM_CONF`
//! and the real `scontrol`) resumes a drain gpufence made once the cause
//! is gone, never while a holder lives, never with the key off, never an
//! admin's drain or a gpufence drain whose reason an admin replaced, and
//! leaves a flapping node drained with a reason saying so.
//!
//! Every sweep is limited to the test's own subtree (`--cgroup`); the
//! causes are the test's own: a holder of a claimed misc device opened
//! before the fence (outside every job), and a crontab in the test's own
//! cron directory (a medium finding, at the default threshold).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use gpufence_tests::cluster::{hostname, Cluster, ClusterSpec, TEST_USER};
use gpufence_tests::{gone, privileged, HoldableDevice, TestEnv};
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
    let units = env.path("systemd");
    for d in [&cron, &units] {
        std::fs::create_dir_all(d).unwrap();
    }
    // Opened before the fence (slurmd installs it at start): a holder
    // outside every job that the fence would now deny.
    let out = env.cgroup("outside");
    let holder = env.spawn_user_probe(&out, &["hold", held.to_str().unwrap()], "held");
    // The exemption is the test's own (never made): the machine's
    // slurmd.service, which other clusters on this host restart, would
    // otherwise be an `exemption_missing` finding of this node-wide check.
    let exempt = format!("{}/exempt", env.root);
    let extra = |on: bool| {
        format!(
            "layout = \"own\"\nexempt_cgroups = [\"{exempt}\"]\nnvml = false\ncron_spool_dir = \"{}\"\nsystemd_system_dir = \"{}\"\nresume_when_clean = {on}\nresume_max = 2\nresume_window_s = 86400\n[majors]\nnvidia = 195\nfake-held = {}\n",
            cron.display(),
            units.display(),
            real.major
        )
    };
    let cluster = Cluster::start_with(
        &env,
        &ClusterSpec {
            gres_conf: format!("Name=gpu Type=sim File={}\n", n0.display()),
            node_gres: "gpu:sim:1".into(),
            gpufence_extra: extra(true),
            port_base: std::env::var("GPUFENCE_E2E_PORT_BASE")
                .ok()
                .and_then(|v| v.parse().ok())
                .map_or(18317, |p: u16| p + 1400),
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
