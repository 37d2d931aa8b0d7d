//! `gpufence sweep` and `gpufence respond PID` against real processes,
//! sockets (loopback, and wildcard listeners for the exposure check), a
//! real fence in each test's own cgroup subtree, the fake NVML, and fixture
//! cron / systemd / passwd trees. Every sweep is limited to the test's own
//! subtree (`--cgroup`), so what else runs on the machine cannot show up.

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::Child;
use std::time::{Duration, Instant};

use gpufence_cgroup::fence::Fence;
use gpufence_model::config::{Config, ConfigOrigin};
use gpufence_model::device::{Access, DevNum};
use gpufence_node::response::incident::{self, Refusal};
use gpufence_node::sweep::{self, Finding, Kind, Severity, SweepOutcome, SweepRequest};
use gpufence_node::{host::fence_ops, Node};
use gpufence_tests::cluster::{test_uid, TEST_USER};
use gpufence_tests::{gone, privileged, workspace_bin, HoldableDevice, TestEnv};
use serde_json::{json, Value};

struct World {
    env: TestEnv,
    node: Node,
    /// `nvml-scenario.json` of the fake NVML, when the world has one.
    scenario: Option<PathBuf>,
}

/// Keys every world sets: fixture persistence trees, a passwd file naming
/// the test user (home in the temp dir), a fake scontrol. `extra` comes
/// before `[majors]` (which is `nvidia = 195` plus `majors`).
fn config(env: &TestEnv, extra: &str, majors: &str, nvml: Option<&PathBuf>) -> Node {
    for d in ["cron", "systemd", "home/gt/.config/systemd/user"] {
        std::fs::create_dir_all(env.path(d)).unwrap();
    }
    // The test user's home is theirs, as a real home is: the sweep reads a
    // user's tree only below directories the user owns.
    for d in [
        "home/gt",
        "home/gt/.config",
        "home/gt/.config/systemd",
        "home/gt/.config/systemd/user",
    ] {
        std::os::unix::fs::chown(env.path(d), Some(test_uid()), Some(test_uid())).unwrap();
    }
    std::fs::write(
        env.path("passwd"),
        format!(
            "root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1::/usr/sbin:/usr/sbin/nologin\n{TEST_USER}:x:{uid}:{uid}::{home}:/bin/sh\n",
            uid = test_uid(),
            home = env.path("home/gt").display()
        ),
    )
    .unwrap();
    let scontrol = env.path("scontrol");
    std::fs::write(
        &scontrol,
        format!(
            "#!/bin/sh\nprintf '%s\\n' \"$@\" >> {}\n",
            env.path("scontrol.args").display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&scontrol, std::fs::Permissions::from_mode(0o755)).unwrap();
    let nvml = match nvml {
        Some(lib) => format!("nvml_library = \"{}\"\n", lib.display()),
        None => "nvml = false\n".into(),
    };
    let p = env.config(&format!(
        "{nvml}cron_spool_dir = \"{}\"\nsystemd_system_dir = \"{}\"\npasswd_file = \"{}\"\nscontrol_bin = \"{}\"\n{extra}\n[majors]\nnvidia = 195\n{majors}\n",
        env.path("cron").display(),
        env.path("systemd").display(),
        env.path("passwd").display(),
        scontrol.display(),
    ));
    Node::new(Config::load(&p).unwrap(), ConfigOrigin::File(p)).unwrap()
}

/// Writes `text` to `path` in the test user's home, as the user would:
/// owned by them.
fn user_file(path: &std::path::Path, text: &str) {
    std::fs::write(path, text).unwrap();
    std::os::unix::fs::chown(path, Some(test_uid()), Some(test_uid())).unwrap();
}

fn world(tag: &str, extra: &str, majors: &str, fence: bool) -> World {
    let env = TestEnv::new(tag);
    let node = config(&env, extra, majors, None);
    if fence {
        fence_ops::install(&node).unwrap();
    }
    World {
        env,
        node,
        scenario: None,
    }
}

/// A world whose NVML is a private copy of the fake library.
fn nvml_world(tag: &str) -> World {
    nvml_world_with(tag, |_| String::new())
}

/// [`nvml_world`] with config lines `extra` makes from the env (its
/// cgroup paths).
fn nvml_world_with(tag: &str, extra: impl FnOnce(&TestEnv) -> String) -> World {
    let env = TestEnv::new(tag);
    let extra = extra(&env);
    let lib_dir = env.path("nvml");
    std::fs::create_dir_all(&lib_dir).unwrap();
    let lib = lib_dir.join("libnvidia-ml.so.1");
    std::fs::copy(workspace_bin("libnvidia_ml.so"), &lib).unwrap();
    let scenario = lib_dir.join("nvml-scenario.json");
    std::fs::write(&scenario, json!({"gpus": []}).to_string()).unwrap();
    let node = config(&env, &extra, "", Some(&lib));
    fence_ops::install(&node).unwrap();
    World {
        env,
        node,
        scenario: Some(scenario),
    }
}

impl World {
    fn sweep_with(&self, f: impl FnOnce(&mut SweepRequest)) -> SweepOutcome {
        let mut req = SweepRequest {
            cgroup: Some(self.env.root.clone()),
            ..Default::default()
        };
        f(&mut req);
        // How long it takes is measured in `gpufence-bench scan`, not here.
        sweep::execute(&self.node, &req)
    }
    fn sweep(&self) -> SweepOutcome {
        self.sweep_with(|_| {})
    }
    fn audit(&self) -> Vec<Value> {
        gpufence_tests::audit_log_settled(&self.node.cfg.audit_log)
    }
    fn events(&self) -> Vec<String> {
        self.audit()
            .into_iter()
            .map(|e| e["event"].as_str().unwrap_or("").to_string())
            .collect()
    }
}

fn of_kind(o: &SweepOutcome, k: Kind) -> Vec<&Finding> {
    o.report.findings.iter().filter(|f| f.kind == k).collect()
}

fn kinds(o: &SweepOutcome) -> Vec<Kind> {
    o.report.findings.iter().map(|f| f.kind).collect()
}

fn mode(p: &std::path::Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

/// A fence, a user's sleeper and a user's loopback listener, empty cron and
/// systemd trees: nothing to report, exit 0, on the first sweep (which
/// records the systemd baseline) and on the next.
#[test]
fn a_clean_node_has_no_finding() {
    if !privileged() {
        return;
    }
    let mut w = world("clean", "", "", true);
    std::fs::write(
        w.env.path("systemd/base.service"),
        "[Service]\nExecStart=/bin/true\n",
    )
    .unwrap();
    let cg = w.env.cgroup("job_1");
    w.env.spawn_user_sleeper(&cg);
    w.env
        .spawn_user_probe(&cg, &["listen", "127.0.0.1", "0"], "listening");
    for round in 0..2 {
        let o = w.sweep();
        assert!(o.report.findings.is_empty(), "round {round}: {o:#?}");
        assert_eq!(o.exit, 0, "{o:#?}");
        assert!(o.errors.is_empty(), "{:?}", o.errors);
        assert!(o.report.fence_installed);
        assert!(o.report.processes >= 2, "{}", o.report.processes);
        assert_eq!(
            o.report
                .notes
                .iter()
                .any(|n| n.starts_with("systemd baseline recorded")),
            round == 0,
            "{:?}",
            o.report.notes
        );
        // Whether users may create io_uring rings is said by `fence
        // install` and `doctor`, not on every sweep (a timer's journal).
        assert!(
            !o.report
                .notes
                .iter()
                .any(|n| n.starts_with("io_uring is open")),
            "{:?}",
            o.report.notes
        );
    }
}

/// A user's listener on 0.0.0.0 is low; one whose command line disables
/// Jupyter's token is high; root's listener on 0.0.0.0 is not reported.
#[test]
fn wildcard_listeners_and_open_notebooks() {
    if !privileged() {
        return;
    }
    let mut w = world("listen", "", "", true);
    let cg = w.env.cgroup("sessions");
    let notebook = w.env.spawn_user_probe(
        &cg,
        &[
            "listen",
            "0.0.0.0",
            "0",
            "jupyter-notebook",
            "--NotebookApp.token=",
            "--no-browser",
        ],
        "listening",
    );
    let plain = w
        .env
        .spawn_user_probe(&cg, &["listen", "0.0.0.0", "0"], "listening");
    let rootd = w
        .env
        .spawn_probe(&cg, &["listen", "0.0.0.0", "0"], "listening");
    let o = w.sweep();
    let nb = of_kind(&o, Kind::UnauthenticatedNotebook);
    assert_eq!(nb.len(), 1, "{o:#?}");
    assert_eq!(nb[0].pid, Some(notebook));
    assert_eq!(nb[0].severity, Severity::High);
    assert_eq!(nb[0].uid, Some(test_uid()));
    assert_eq!(nb[0].user.as_deref(), Some(TEST_USER));
    assert_eq!(
        nb[0].evidence["auth_disabled"],
        json!(["--NotebookApp.token="])
    );
    assert!(nb[0].evidence["local"]
        .as_str()
        .unwrap()
        .starts_with("0.0.0.0:"));
    let wl = of_kind(&o, Kind::WildcardListener);
    assert_eq!(wl.len(), 1, "{o:#?}");
    assert_eq!((wl[0].pid, wl[0].severity), (Some(plain), Severity::Low));
    assert!(
        o.report.findings.iter().all(|f| f.pid != Some(rootd)),
        "root's listener is not a user's exposure: {o:#?}"
    );
    assert_eq!(o.exit, 1, "high is above the default threshold (medium)");
    let line = nb[0].line();
    assert!(
        line.starts_with(&format!(
            "high unauthenticated_notebook pid={notebook} uid={}({TEST_USER}) cgroup=/{cg}",
            test_uid()
        )),
        "{line}"
    );
}

/// A listener whose owner runs one of `slurm_listeners` (srun's own ports)
/// is not a finding, matched on the executable, not on the command name;
/// the same executable with a notebook's token disabled still is.
#[test]
fn slurm_listeners_are_not_findings_but_open_notebooks_are() {
    if !privileged() {
        return;
    }
    // As /proc/<pid>/exe names it.
    let probe = std::fs::canonicalize(gpufence_tests::probe_bin()).unwrap();
    let extra = format!("slurm_listeners = [{:?}]\n", probe.display().to_string());
    let mut w = world("slurmlisten", &extra, "", true);
    let cg = w.env.cgroup("steps");
    let srun_like = w
        .env
        .spawn_user_probe(&cg, &["listen", "0.0.0.0", "0", "srun"], "listening");
    let notebook = w.env.spawn_user_probe(
        &cg,
        &[
            "listen",
            "0.0.0.0",
            "0",
            "jupyter-lab",
            "--ServerApp.token=",
        ],
        "listening",
    );
    let o = w.sweep();
    assert!(of_kind(&o, Kind::WildcardListener).is_empty(), "{o:#?}");
    assert!(
        o.report.findings.iter().all(|f| f.pid != Some(srun_like)),
        "{o:#?}"
    );
    let nb = of_kind(&o, Kind::UnauthenticatedNotebook);
    assert_eq!(nb.len(), 1, "{o:#?}");
    assert_eq!(nb[0].pid, Some(notebook));
    // The defaults name Slurm's binaries, not the probe: the first test
    // sees the same listener reported.
    let d = Config::default();
    assert!(d.slurm_listeners.contains(&"/usr/bin/srun".into()));
    assert!(!d.slurm_listeners.contains(&probe));
}

/// A TCP connection to a mining-pool port (3333, on loopback) is high.
#[test]
fn a_connection_to_a_mining_port_is_found() {
    if !privileged() {
        return;
    }
    let pool = std::net::TcpListener::bind("127.0.0.1:3333").unwrap_or_else(|e| {
        panic!(
            "this test needs 127.0.0.1:3333 (a mining-pool port) free to stand in for a pool: {e}"
        )
    });
    let mut w = world("mining", "", "", true);
    let cg = w.env.cgroup("outside");
    let miner = w
        .env
        .spawn_user_probe(&cg, &["connect", "127.0.0.1", "3333"], "connected");
    let o = w.sweep();
    let m = of_kind(&o, Kind::MiningConnection);
    assert_eq!(m.len(), 1, "{o:#?}");
    assert_eq!(m[0].pid, Some(miner));
    assert_eq!(m[0].severity, Severity::High);
    assert_eq!(m[0].evidence["remote"], "127.0.0.1:3333");
    assert_eq!(m[0].cgroup.as_deref(), Some(format!("/{cg}").as_str()));
    drop(pool);
}

/// A stratum URL in a command line is critical, connection or not.
#[test]
fn a_stratum_url_in_a_command_line_is_found() {
    if !privileged() {
        return;
    }
    let mut w = world("stratum", "", "", true);
    let cg = w.env.cgroup("outside");
    let miner = w.env.spawn_user_probe(
        &cg,
        &[
            "listen",
            "127.0.0.1",
            "0",
            "xmrig",
            "-o",
            "stratum+tcp://127.0.0.1:3333",
            "-u",
            "wallet",
        ],
        "listening",
    );
    let o = w.sweep();
    let m = of_kind(&o, Kind::MiningCmdline);
    assert_eq!(m.len(), 1, "{o:#?}");
    assert_eq!((m[0].pid, m[0].severity), (Some(miner), Severity::Critical));
    assert_eq!(
        m[0].evidence["arguments"],
        json!(["stratum+tcp://127.0.0.1:3333"])
    );
    assert_eq!(
        kinds(&o),
        vec![Kind::MiningCmdline],
        "loopback: no listener finding"
    );
}

/// A user's crontab with entries is persistence (medium); root's, and a
/// user's with only comments, are not.
#[test]
fn a_users_crontab_is_persistence() {
    if !privileged() {
        return;
    }
    let w = world("cron", "", "", true);
    std::fs::write(
        w.env.path(&format!("cron/{TEST_USER}")),
        "# DO NOT EDIT\nMAILTO=\"\"\n*/5 * * * * /tmp/.x/miner --quiet\n",
    )
    .unwrap();
    std::fs::write(w.env.path("cron/root"), "0 3 * * * /usr/sbin/logrotate\n").unwrap();
    std::fs::write(w.env.path("cron/daemon"), "* * * * * /x\n").unwrap();
    std::fs::write(w.env.path("cron/nobody-here"), "# nothing\n").unwrap();
    let o = w.sweep();
    let c = of_kind(&o, Kind::PersistenceCron);
    assert_eq!(c.len(), 1, "{o:#?}");
    assert_eq!(c[0].user.as_deref(), Some(TEST_USER));
    assert_eq!(c[0].uid, Some(test_uid()));
    assert_eq!(c[0].severity, Severity::Medium);
    assert_eq!(
        c[0].evidence["entries"],
        json!(["*/5 * * * * /tmp/.x/miner --quiet"])
    );
    assert_eq!(o.exit, 1);
}

/// Units, timers, `.wants` links and users' units that appear or change
/// after the baseline are reported on every sweep until the baseline is
/// removed (the admin's acceptance); the first sweep reports nothing.
#[test]
fn new_systemd_units_after_the_baseline() {
    if !privileged() {
        return;
    }
    let w = world("systemd", "", "", true);
    let sys = w.env.path("systemd");
    std::fs::write(sys.join("site.service"), "[Service]\nExecStart=/bin/true\n").unwrap();
    let o = w.sweep();
    assert!(of_kind(&o, Kind::PersistenceSystemd).is_empty(), "{o:#?}");
    assert!(sweep::baseline_path(&w.node).exists());

    std::fs::write(
        sys.join("site.service"),
        "[Service]\nExecStart=/bin/false\n",
    )
    .unwrap();
    std::fs::write(
        sys.join("gpu-helper.service"),
        "[Service]\nExecStart=/tmp/.x/miner\n",
    )
    .unwrap();
    std::fs::write(
        sys.join("gpu-helper.timer"),
        "[Timer]\nOnCalendar=minutely\n",
    )
    .unwrap();
    std::fs::create_dir_all(sys.join("timers.target.wants")).unwrap();
    std::os::unix::fs::symlink(
        "../gpu-helper.timer",
        sys.join("timers.target.wants/gpu-helper.timer"),
    )
    .unwrap();
    let user_unit = w.env.path("home/gt/.config/systemd/user/notebook.service");
    user_file(&user_unit, "[Service]\nExecStart=jupyter lab\n");
    for _ in 0..2 {
        let o = w.sweep();
        let s = of_kind(&o, Kind::PersistenceSystemd);
        let seen: BTreeSet<(String, String)> = s
            .iter()
            .map(|f| {
                (
                    f.evidence["file"].as_str().unwrap().to_string(),
                    f.evidence["change"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        let want: BTreeSet<(String, String)> = [
            (sys.join("site.service"), "changed"),
            (sys.join("gpu-helper.service"), "new"),
            (sys.join("gpu-helper.timer"), "new"),
            (sys.join("timers.target.wants/gpu-helper.timer"), "new"),
            (user_unit.clone(), "new"),
        ]
        .into_iter()
        .map(|(p, c)| (p.display().to_string(), c.to_string()))
        .collect();
        assert_eq!(seen, want, "{o:#?}");
        assert!(s.iter().all(|f| f.severity == Severity::Medium));
        let link = s
            .iter()
            .find(|f| {
                f.evidence["file"]
                    .as_str()
                    .unwrap()
                    .ends_with("wants/gpu-helper.timer")
            })
            .unwrap();
        assert_eq!(link.evidence["link"], "../gpu-helper.timer");
        let user = s
            .iter()
            .find(|f| f.evidence["scope"] == "systemd_user")
            .unwrap();
        assert_eq!(user.evidence["file"], user_unit.display().to_string());
    }
    std::fs::remove_file(sweep::baseline_path(&w.node)).unwrap();
    let o = w.sweep();
    assert!(of_kind(&o, Kind::PersistenceSystemd).is_empty(), "{o:#?}");
}

/// An open the fence denied (a process outside every job) is reported by
/// the next sweep, once; the exported total keeps counting.
#[test]
fn denied_opens_are_reported_once() {
    if !privileged() {
        return;
    }
    let w = world("denied", "", "", true);
    let gpu = w.env.mknod("nvidia0", 195, 0);
    let out = w.env.cgroup("outside");
    assert_eq!(w.env.open_from(&out, &gpu), "EPERM");
    let o = w.sweep();
    let d = of_kind(&o, Kind::DeniedOpen);
    assert_eq!(d.len(), 1, "{o:#?}");
    assert_eq!(d[0].severity, Severity::Low);
    assert_eq!(d[0].comm.as_deref(), Some("gpufence-probe"));
    assert_eq!(d[0].uid, Some(0));
    assert_eq!(d[0].user.as_deref(), Some("root"));
    assert_eq!(d[0].cgroup.as_deref(), Some(format!("/{out}").as_str()));
    assert_eq!(d[0].evidence["device"], "195:0");
    assert_eq!(d[0].evidence["new"], 1);
    assert!(d[0].pid.is_some_and(|p| p > 1));
    assert_eq!(o.report.denials_total, 1);
    assert_eq!(o.exit, 0, "low is below the default threshold");

    let o = w.sweep();
    assert!(of_kind(&o, Kind::DeniedOpen).is_empty(), "{o:#?}");
    assert_eq!(o.report.denials_total, 1);

    assert_eq!(w.env.open_from(&out, &gpu), "EPERM");
    assert_eq!(w.env.open_from(&out, &gpu), "EPERM");
    let o = w.sweep();
    let d = of_kind(&o, Kind::DeniedOpen);
    assert_eq!(d.len(), 1, "{o:#?}");
    assert_eq!(
        (d[0].evidence["new"].clone(), d[0].evidence["count"].clone()),
        (json!(2), json!(3))
    );
    assert_eq!(o.report.denials_total, 3);

    // A consumer with its own cursor (the health check beside the timer)
    // sees every denial once, whatever the shared cursor reported.
    let health = |w: &World| w.sweep_with(|r| r.cursor = Some("health".into()));
    let o = health(&w);
    let d = of_kind(&o, Kind::DeniedOpen);
    assert_eq!(d.len(), 1, "{o:#?}");
    assert_eq!(d[0].evidence["new"], 3);
    assert!(of_kind(&health(&w), Kind::DeniedOpen).is_empty());
    assert!(of_kind(&w.sweep(), Kind::DeniedOpen).is_empty());
    assert_eq!(w.env.open_from(&out, &gpu), "EPERM");
    assert_eq!(of_kind(&w.sweep(), Kind::DeniedOpen).len(), 1);
    assert_eq!(of_kind(&health(&w), Kind::DeniedOpen).len(), 1);
    // A cursor name is a file name part: anything else is refused.
    for bad in ["", "../x", "a/b", "x y", &"a".repeat(65)] {
        let o = w.sweep_with(|r| r.cursor = Some(bad.to_string()));
        assert_eq!(o.exit, 2, "{bad:?}: {o:#?}");
        assert!(
            o.errors.iter().any(|e| e.contains("--cursor")),
            "{bad:?}: {:?}",
            o.errors
        );
    }
}

/// A grant whose cgroup was removed is revoked by the sweep and reported
/// with the action; a live grant stays.
#[test]
fn grants_of_removed_cgroups_are_collected() {
    if !privileged() {
        return;
    }
    let w = world("stale", "", "", true);
    let fence = Fence::open(&w.env.bpffs).unwrap();
    let dead = w.env.cgroup("job_77");
    let live = w.env.cgroup("job_78");
    let dead_id = w.env.cg.id(&dead).unwrap();
    let live_id = w.env.cg.id(&live).unwrap();
    fence
        .grant(dead_id, &dead, 77, &[(DevNum::new(195, 0), Access::RW)])
        .unwrap();
    fence
        .grant(live_id, &live, 78, &[(DevNum::new(195, 1), Access::RW)])
        .unwrap();
    std::fs::remove_dir(w.env.cg.path(&dead)).unwrap();
    let o = w.sweep();
    let s = of_kind(&o, Kind::StaleGrant);
    assert_eq!(s.len(), 1, "{o:#?}");
    assert_eq!(s[0].severity, Severity::Low);
    assert_eq!(s[0].evidence["cgroup_id"], dead_id);
    assert_eq!(s[0].evidence["job_ids"], json!([77]));
    assert_eq!(s[0].action.as_deref(), Some("revoked 1 grant entry"));
    let left: Vec<u32> = fence.entries().unwrap().iter().map(|e| e.job_id).collect();
    assert_eq!(left, vec![78]);
    assert_eq!(o.report.grants, 1);
    let collected: Vec<Value> = w
        .audit()
        .into_iter()
        .filter(|e| e["event"] == "grant_collected")
        .collect();
    assert_eq!(collected.len(), 1);
    assert_eq!(collected[0]["job_id"], 77);
    assert_eq!(collected[0]["cgroup_id"], dead_id);
    let o = w.sweep();
    assert!(of_kind(&o, Kind::StaleGrant).is_empty(), "{o:#?}");
}

/// A process holding a protected device outside every grant is critical;
/// one in a granted cgroup and a system account's in an exempt cgroup are
/// not reported.
#[test]
fn a_holder_outside_every_grant_is_found() {
    if !privileged() {
        return;
    }
    let real = HoldableDevice::claim();
    let dev = DevNum::new(real.major, real.minor);
    let env = TestEnv::new("holder");
    let exempt = format!("{}/exempt", env.root);
    let node = config(
        &env,
        &format!("exempt_cgroups = [\"{exempt}\"]"),
        &format!("fake-gpu = {}", real.major),
        None,
    );
    let mut w = World {
        env,
        node,
        scenario: None,
    };
    let gpu = w.env.mknod("gpu", real.major, real.minor);
    let g = gpu.to_str().unwrap();
    // Opened before the fence: it would deny them afterwards.
    let out = w.env.cgroup("outside");
    let intruder = w.env.spawn_user_probe(&out, &["hold", g], "held");
    let ex = w.env.cgroup("exempt");
    let daemon = w.env.spawn_probe(&ex, &["hold", g], "held");
    // A hold no descriptor table shows: a registered io_uring file (the
    // sweep readlinks only anonymous inodes, rings among them). io_uring
    // may be disabled by sysctl; then there is nothing to hide in.
    let out2 = w.env.cgroup("outside2");
    let mut cmd = w.env.command_in(&out2, gpufence_tests::probe_bin());
    cmd.args(["hold", "--via=io_uring", g]);
    let mut ring_child = cmd.stdout(std::process::Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(ring_child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let ring = (line.trim() == "held").then_some(ring_child.id() as i32);
    if ring.is_none() {
        eprintln!("io_uring unavailable here: {}", line.trim());
    }
    fence_ops::install(&w.node).unwrap();
    let job = w.env.cgroup("job_5");
    let fence = Fence::open(&w.env.bpffs).unwrap();
    fence
        .grant(w.env.cg.id(&job).unwrap(), &job, 5, &[(dev, Access::RW)])
        .unwrap();
    let user = w.env.spawn_user_probe(&job, &["hold", g], "held");
    let o = w.sweep();
    let h = of_kind(&o, Kind::UnfencedGpuHolder);
    if let Some(ring) = ring {
        let r: Vec<&&Finding> = h.iter().filter(|f| f.pid == Some(ring)).collect();
        assert_eq!(r.len(), 1, "{o:#?}");
        assert_eq!(r[0].evidence["holds"][0]["via"], "io_uring");
    }
    let h: Vec<&Finding> = h.into_iter().filter(|f| f.pid != ring).collect();
    assert_eq!(h.len(), 1, "{o:#?}");
    assert_eq!(h[0].pid, Some(intruder));
    assert_eq!(h[0].severity, Severity::Critical);
    assert_eq!(h[0].evidence["devices"], json!([dev.to_string()]));
    assert_eq!(h[0].evidence["holds"][0]["via"], "fd");
    assert_eq!(h[0].evidence["holds"][0]["path"], g);
    assert!(o
        .report
        .findings
        .iter()
        .all(|f| f.pid != Some(user) && f.pid != Some(daemon)));
    assert_eq!(o.exit, 1);
    let _ = ring_child.kill();
    let _ = ring_child.wait();
}

/// NVML: a GPU with utilisation and no grant, a GPU with a process (which
/// holds it per NVML alone, outside every grant), a granted busy GPU (not
/// reported), an idle GPU (not reported).
#[test]
fn busy_gpus_without_grants_and_nvml_only_holders() {
    if !privileged() {
        return;
    }
    let mut w = nvml_world("gpubusy");
    let out = w.env.cgroup("outside");
    let ghost = w.env.spawn_user_sleeper(&out);
    let job = w.env.cgroup("job_9");
    Fence::open(&w.env.bpffs)
        .unwrap()
        .grant(
            w.env.cg.id(&job).unwrap(),
            &job,
            9,
            &[(DevNum::new(195, 2), Access::RW)],
        )
        .unwrap();
    let gpu = |minor: u32| {
        json!({"minor": minor, "uuid": format!("GPU-00000000-0000-0000-0000-00000000000{minor}"),
               "idle_used_mib": 500, "memory_total_mib": 81920})
    };
    let mut g0 = gpu(0);
    g0["util_gpu"] = json!(90);
    g0["util_mem"] = json!(40);
    let mut g1 = gpu(1);
    g1["processes"] = json!([{"pid": ghost, "used_mib": 2000}]);
    let mut g2 = gpu(2);
    g2["util_gpu"] = json!(80);
    let g3 = gpu(3);
    std::fs::write(
        w.scenario.as_ref().unwrap(),
        json!({"gpus": [g0, g1, g2, g3]}).to_string(),
    )
    .unwrap();
    let o = w.sweep();
    let busy = of_kind(&o, Kind::GpuBusyWithoutGrant);
    let minors: Vec<u64> = busy
        .iter()
        .map(|f| f.evidence["minor"].as_u64().unwrap())
        .collect();
    assert_eq!(minors, vec![0, 1], "{o:#?}");
    assert!(busy.iter().all(|f| f.severity == Severity::High));
    let b0 = busy.iter().find(|f| f.evidence["minor"] == 0).unwrap();
    assert_eq!(
        (
            b0.evidence["utilization_gpu"].clone(),
            b0.evidence["utilization_memory"].clone()
        ),
        (json!(90), json!(40))
    );
    let b1 = busy.iter().find(|f| f.evidence["minor"] == 1).unwrap();
    assert_eq!(b1.evidence["pids"], json!([ghost]));
    let h = of_kind(&o, Kind::UnfencedGpuHolder);
    assert_eq!(h.len(), 1, "{o:#?}");
    assert_eq!(h[0].pid, Some(ghost));
    assert_eq!(h[0].evidence["devices"], json!(["195:1"]));
    assert_eq!(h[0].evidence["gpu_memory"][0]["used_bytes"], 2000u64 << 20);
    assert_eq!(h[0].evidence["holds"], json!([]));

    // A query that fails mid-sweep cannot say clean.
    let mut g = gpu(0);
    g["fail"] = json!({"processes": 999});
    std::fs::write(
        w.scenario.as_ref().unwrap(),
        json!({"gpus": [g]}).to_string(),
    )
    .unwrap();
    let o = w.sweep();
    assert_eq!(kinds(&o), vec![Kind::CheckFailed], "{o:#?}");
    assert_eq!(o.exit, 1);
}

/// Drift: the fence not attached, and a protected major the fence lacks
/// (driver reloaded) or has in excess.
#[test]
fn drift_is_reported() {
    if !privileged() {
        return;
    }
    let w = world("drift", "", "", false);
    let o = w.sweep();
    assert_eq!(kinds(&o), vec![Kind::FenceNotAttached], "{o:#?}");
    assert!(!o.report.fence_installed);
    assert_eq!(o.report.findings[0].severity, Severity::Critical);
    fence_ops::install(&w.node).unwrap();
    assert!(w.sweep().report.findings.is_empty());
    // The node now has another NVIDIA major (uvm loaded after the
    // install) and lost none: unprotected.
    let grown = config(&w.env, "", "nvidia-uvm = 511", None);
    let o = sweep::execute(
        &grown,
        &SweepRequest {
            cgroup: Some(w.env.root.clone()),
            ..Default::default()
        },
    );
    let u = of_kind(&o, Kind::UnprotectedMajor);
    assert_eq!(u.len(), 1, "{o:#?}");
    assert_eq!(u[0].evidence["major"], 511);
    assert_eq!(u[0].severity, Severity::Critical);
    // Installed with 511, then the node no longer has it: stale.
    fence_ops::install(&grown).unwrap();
    let shrunk = config(&w.env, "", "", None);
    let o = sweep::execute(
        &shrunk,
        &SweepRequest {
            cgroup: Some(w.env.root.clone()),
            ..Default::default()
        },
    );
    let s = of_kind(&o, Kind::StaleMajor);
    assert_eq!(s.len(), 1, "{o:#?}");
    assert_eq!(
        (s[0].evidence["major"].clone(), s[0].severity),
        (json!(511), Severity::Low)
    );
    // An audit-mode program left running on an enforcing node denies
    // nothing: the sweep says so, and so does `fence status`.
    fence_ops::install(&shrunk).unwrap();
    let audit = config(&w.env, "mode = \"audit\"", "", None);
    fence_ops::install(&audit).unwrap();
    assert_eq!(
        fence_ops::running_mode(&shrunk),
        fence_ops::RunningMode::Audit
    );
    let o = sweep::execute(
        &shrunk,
        &SweepRequest {
            cgroup: Some(w.env.root.clone()),
            ..Default::default()
        },
    );
    let a = of_kind(&o, Kind::FenceNotEnforcing);
    assert_eq!(a.len(), 1, "{o:#?}");
    assert_eq!(
        (a[0].severity, a[0].evidence["running_mode"].clone()),
        (Severity::High, json!("audit"))
    );
    assert_eq!(o.exit, 1);
    let (st, mode) = fence_ops::status_with_mode(&shrunk);
    assert_eq!(mode, fence_ops::RunningMode::Audit);
    assert!(
        st.problems.iter().any(|p| p.contains("AUDIT mode")),
        "{:?}",
        st.problems
    );
    // Where audit is what the config asks, it is no finding.
    let o = sweep::execute(
        &audit,
        &SweepRequest {
            cgroup: Some(w.env.root.clone()),
            ..Default::default()
        },
    );
    assert!(of_kind(&o, Kind::FenceNotEnforcing).is_empty(), "{o:#?}");
    fence_ops::install(&shrunk).unwrap();
    assert_eq!(
        fence_ops::running_mode(&shrunk),
        fence_ops::RunningMode::Enforce
    );
    assert!(fence_ops::status(&shrunk).problems.is_empty());
}

/// The textfile: written atomically, HELP/TYPE lines, one series per kind;
/// exit codes follow the threshold (CLI override, then config).
#[test]
fn textfile_and_exit_codes_by_severity() {
    if !privileged() {
        return;
    }
    let w = world("prom", "", "", true);
    std::fs::write(w.env.path(&format!("cron/{TEST_USER}")), "@reboot /tmp/x\n").unwrap();
    let dir = w.env.path("textfiles");
    std::fs::create_dir_all(&dir).unwrap();
    let prom = dir.join("gpufence.prom");
    std::fs::write(&prom, "stale content\n").unwrap();
    let o = w.sweep_with(|r| r.prometheus = Some(prom.clone()));
    assert_eq!((o.exit, o.threshold), (1, Severity::Medium), "{o:#?}");
    let text = std::fs::read_to_string(&prom).unwrap();
    for l in [
        "# HELP gpufence_fence_installed ",
        "# TYPE gpufence_fence_installed gauge\ngpufence_fence_installed 1\n",
        "# TYPE gpufence_grants gauge\ngpufence_grants 0\n",
        "# TYPE gpufence_denials_total counter\ngpufence_denials_total 0\n",
        "# HELP gpufence_findings ",
        "# TYPE gpufence_findings gauge\n",
        "gpufence_findings{kind=\"persistence_cron\"} 1\n",
        "gpufence_findings{kind=\"unfenced_gpu_holder\"} 0\n",
    ] {
        assert!(text.contains(l), "{l:?} missing from\n{text}");
    }
    for k in Kind::ALL {
        assert!(
            text.contains(&format!("gpufence_findings{{kind=\"{k}\"}} ")),
            "{k}"
        );
    }
    assert_eq!(mode(&prom), 0o644);
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, vec!["gpufence.prom"], "no temporary file left");

    assert_eq!(w.sweep_with(|r| r.fail_on = Some(Severity::High)).exit, 0);
    assert_eq!(w.sweep_with(|r| r.fail_on = Some(Severity::Medium)).exit, 1);
    assert_eq!(w.sweep_with(|r| r.fail_on = Some(Severity::Info)).exit, 1);
    let lenient = config(&w.env, "sweep_fail_severity = \"critical\"", "", None);
    assert_eq!(sweep::threshold(&lenient, None), Ok(Severity::Critical));
    assert_eq!(sweep::threshold(&lenient, Some("low")), Ok(Severity::Low));
    assert!(sweep::threshold(&lenient, Some("urgent")).is_err());
    let o = sweep::execute(
        &lenient,
        &SweepRequest {
            cgroup: Some(w.env.root.clone()),
            ..Default::default()
        },
    );
    assert_eq!((o.exit, o.threshold), (0, Severity::Critical));
    // An unwritable textfile: nothing fails, but the sweep says so (2).
    let o = sweep::execute(
        &lenient,
        &SweepRequest {
            cgroup: Some(w.env.root.clone()),
            prometheus: Some(w.env.path("no/such/dir/x.prom")),
            ..Default::default()
        },
    );
    assert_eq!(o.exit, 2, "{o:#?}");
    // A scope that does not exist is an error, not a clean node.
    let o = sweep::execute(
        &lenient,
        &SweepRequest {
            cgroup: Some(format!("{}/nope", w.env.root)),
            ..Default::default()
        },
    );
    assert_eq!(o.exit, 2, "{o:#?}");
}

/// `--drain` drains with a reason naming the worst finding, only when one
/// is at or above the threshold.
#[test]
fn drain_names_the_finding() {
    if !privileged() {
        return;
    }
    let w = world("drain", "", "", true);
    std::fs::write(w.env.path(&format!("cron/{TEST_USER}")), "@reboot /tmp/x\n").unwrap();
    let args = w.env.path("scontrol.args");
    let o = w.sweep_with(|r| {
        r.drain_node = Some("node17".into());
        r.fail_on = Some(Severity::High);
    });
    assert_eq!((o.exit, o.drained.clone()), (0, None));
    assert!(!args.exists(), "nothing at or above high: no drain");
    let o = w.sweep_with(|r| r.drain_node = Some("node17".into()));
    assert_eq!(o.exit, 1);
    let lines: Vec<String> = std::fs::read_to_string(&args)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    assert_eq!(&lines[..3], &["update", "nodename=node17", "state=drain"]);
    assert!(
        lines[3].starts_with(&format!(
            "reason=gpufence: sweep: medium persistence_cron user {TEST_USER}: crontab of {TEST_USER}"
        )),
        "{lines:?}"
    );
    assert_eq!(o.drained.as_deref(), lines[3].strip_prefix("reason="));
    assert!(w.events().contains(&"sweep_drained".to_string()));
    assert!(!gpufence_model::nodename::node_name(None).is_empty());
    // A drain that fails (scontrol exits 1) is not a finding's code: the
    // node is not drained, and the exit says the sweep could not do all it
    // was asked.
    let failing = w.env.path("scontrol-fails");
    std::fs::write(
        &failing,
        "#!/bin/sh\necho 'slurm_update error: Access denied' >&2\nexit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(&failing, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut node = Node::new(w.node.cfg.clone(), w.node.origin.clone()).unwrap();
    node.cfg.scontrol_bin = failing;
    let o = sweep::execute(
        &node,
        &SweepRequest {
            cgroup: Some(w.env.root.clone()),
            drain_node: Some("node17".into()),
            ..Default::default()
        },
    );
    assert_eq!((o.exit, o.drained.clone()), (2, None), "{:?}", o.errors);
    assert!(
        o.errors
            .iter()
            .any(|e| e.contains("could not drain node17")),
        "{:?}",
        o.errors
    );
}

/// `sh -c 'sleep & sleep & wait'` as the test user, alone in its cgroup.
/// The caller waits for the returned child.
#[allow(clippy::zombie_processes)]
fn spawn_tree(env: &TestEnv, cg: &str) -> (Child, Vec<i32>) {
    let child = env
        .user_command_in(cg, "sh")
        .args(["-c", "sleep 1000 & sleep 1000 & wait"])
        .spawn()
        .unwrap();
    let sh = child.id() as i32;
    let t0 = Instant::now();
    loop {
        let kids: Vec<i32> = std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|p| {
                std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| {
                    s.rsplit(')')
                        .next()
                        .and_then(|r| r.split_whitespace().nth(1))
                        .and_then(|pp| pp.parse::<i32>().ok())
                        == Some(sh)
                })
            })
            .filter(|p| {
                std::fs::read_to_string(format!("/proc/{p}/comm"))
                    .is_ok_and(|c| c.trim() == "sleep")
            })
            .collect();
        if kids.len() == 2 {
            let mut all = vec![sh];
            all.extend(kids);
            return (child, all);
        }
        if t0.elapsed() > Duration::from_secs(5) {
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
            panic!("the process tree did not start");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// respond PID on a process tree alone in its cgroup: frozen as a cgroup,
/// one evidence file per member (0600) and an incident file with the tree
/// and the user's persistence entries, every member killed, the entries
/// listed and left in place, the node drained, every step audited.
#[test]
fn respond_stops_preserves_and_kills_a_process_tree() {
    if !privileged() {
        return;
    }
    let w = world("respond", "", "", false);
    let cron = w.env.path(&format!("cron/{TEST_USER}"));
    std::fs::write(&cron, "* * * * * /tmp/.x/miner\n").unwrap();
    let unit = w.env.path("home/gt/.config/systemd/user/miner.service");
    user_file(&unit, "[Service]\nExecStart=/tmp/.x/miner\n");
    let cg = w.env.cgroup("incident");
    let (mut child, tree) = spawn_tree(&w.env, &cg);
    let o = incident::respond_pid(&w.node, tree[0], Some("node9")).unwrap();
    let _ = child.wait();
    assert!(o.complete(), "{o:#?}");
    let got: BTreeSet<i32> = o.tree.iter().map(|t| t.pid).collect();
    assert_eq!(got, tree.iter().copied().collect(), "{o:#?}");
    assert_eq!(o.tree[0].pid, tree[0], "the process first");
    assert!(
        o.frozen.values().all(|h| h.as_str() == "cgroup-freeze"),
        "{o:#?}"
    );
    assert_eq!(o.killed.iter().copied().collect::<BTreeSet<_>>(), got);
    assert!(tree.iter().all(|p| gone(*p)));
    assert_eq!(o.uid, Some(test_uid()));
    assert_eq!(o.user.as_deref(), Some(TEST_USER));
    // Evidence: one per member, root-only; the incident file names them.
    assert_eq!(o.evidence.len(), 3);
    for e in &o.evidence {
        assert_eq!(mode(e), 0o600, "{}", e.display());
        let v: Value = serde_json::from_slice(&std::fs::read(e).unwrap()).unwrap();
        assert!(got.contains(&(v["pid"].as_i64().unwrap() as i32)));
        assert_eq!(v["frozen"], "cgroup-freeze");
        // Outside every job: named by the pid alone.
        let name = e.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            name.starts_with(&format!("pid{}-", v["pid"])) && name.ends_with(".json"),
            "{name}"
        );
    }
    let inc = o.incident_file.as_ref().unwrap();
    let name = inc.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with(&format!("incident-pid{}-", tree[0])),
        "{name}"
    );
    assert_eq!(mode(inc), 0o600);
    let v: Value = serde_json::from_slice(&std::fs::read(inc).unwrap()).unwrap();
    assert_eq!(v["tree"].as_array().unwrap().len(), 3);
    assert_eq!(v["evidence"].as_array().unwrap().len(), 3);
    // Who asked, as `gpufence exec` names it.
    let who = gpufence_node::host::procs::who();
    assert!(who.ends_with("(uid 0)"), "{who}");
    assert_eq!(v["by"], who.as_str());
    let kinds: BTreeSet<&str> = v["persistence"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["cron", "systemd_user"].into_iter().collect());
    assert!(v["persistence"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["content"]
            .as_str()
            .is_some_and(|c| c.contains("ExecStart=/tmp/.x/miner"))));
    // Listed, not deleted.
    assert_eq!(o.persistence.len(), 2);
    assert!(cron.exists() && unit.exists());
    // Drained, audited.
    let args = std::fs::read_to_string(w.env.path("scontrol.args")).unwrap();
    assert!(args.contains("nodename=node9"), "{args}");
    assert!(
        args.contains(&format!(
            "reason=gpufence: respond: pid {} (sh) of {TEST_USER} killed",
            tree[0]
        )),
        "{args}"
    );
    let ev = w.events();
    for e in [
        "respond_frozen",
        "respond_evidence",
        "respond_killed",
        "respond_persistence",
        "respond_drained",
    ] {
        assert!(ev.contains(&e.to_string()), "{e} missing: {ev:?}");
    }
    let order: Vec<&str> = ev.iter().map(String::as_str).collect();
    let pos = |e: &str| order.iter().position(|x| *x == e).unwrap();
    assert!(pos("respond_frozen") < pos("respond_evidence"));
    assert!(pos("respond_evidence") < pos("respond_killed"));
    assert!(pos("respond_killed") < pos("respond_persistence"));
    let a = w
        .audit()
        .into_iter()
        .find(|e| e["event"] == "respond_persistence")
        .unwrap();
    assert_eq!(a["deleted"], false);
    assert_eq!(a["uid"], test_uid());
    let respond_lines: Vec<Value> = w
        .audit()
        .into_iter()
        .filter(|e| {
            e["event"]
                .as_str()
                .is_some_and(|s| s.starts_with("respond_"))
        })
        .collect();
    assert!(respond_lines.len() >= 5);
    for l in &respond_lines {
        assert_eq!(l["by"], who.as_str(), "{l}");
    }
}

/// respond PID on a process whose main thread exited while another thread
/// keeps a device mapped (its descriptor closed): `/proc/<pid>` shows no
/// `exe`, `maps` or `cmdline` and the leader reads as a zombie, yet the
/// process lives. It is responded to like any other: frozen, evidence with
/// its executable and mapping (read through the live thread), killed.
#[test]
fn respond_acts_on_a_process_whose_leader_exited() {
    if !privileged() {
        return;
    }
    let mut w = world("respond-leader", "", "", false);
    let cg = w.env.cgroup("leaderless");
    let pid = w.env.spawn_user_probe(
        &cg,
        &["hold", "--via=mmap-leader-exit", "/dev/zero"],
        "held",
    );
    let t0 = Instant::now();
    while !gpufence_node::host::procs::leader_exited(pid) {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the main thread of {pid} did not exit"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let o = incident::respond_pid(&w.node, pid, None).unwrap();
    assert!(o.complete(), "{o:#?}");
    assert_eq!(o.killed, vec![pid], "{o:#?}");
    // Gone: at most the leader's zombie is left (this test is its parent).
    let dead = || {
        gone(pid) && std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |d| d.count()) <= 1
    };
    let t0 = Instant::now();
    while !dead() && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(dead(), "a thread of {pid} survived");
    assert_eq!(o.evidence.len(), 1, "{o:#?}");
    let v: Value = serde_json::from_slice(&std::fs::read(&o.evidence[0]).unwrap()).unwrap();
    assert_eq!(v["pid"], pid);
    assert_eq!(
        v["exe"],
        gpufence_tests::probe_bin().display().to_string(),
        "exe read through the live thread: {v}"
    );
    assert!(
        v["cmdline"].as_array().is_some_and(|a| a
            .iter()
            .any(|x| x == "mmap-leader-exit" || x == "--via=mmap-leader-exit")),
        "cmdline read through the live thread: {v}"
    );
}

/// Root reads nothing for a user that the user could not read: with the
/// user's `~/.config/systemd/user` a symlink to a root-only directory, and
/// then with a root-only file put in the user's real unit directory, no
/// byte of those files reaches the sweep's findings, its baseline or an
/// incident file, and their names are not listed as the user's units.
#[test]
fn a_users_links_and_others_files_are_not_read() {
    if !privileged() {
        return;
    }
    let mut w = world("userlinks", "", "", false);
    const SECRET: &str = "ROOT-ONLY-0f5e1d";
    let secret = w.env.path("root-only");
    std::fs::create_dir_all(&secret).unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::write(secret.join("id_rsa.service"), format!("{SECRET}\n")).unwrap();
    std::fs::set_permissions(
        secret.join("id_rsa.service"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    let units = w.env.path("home/gt/.config/systemd/user");
    std::fs::remove_dir(&units).unwrap();
    std::os::unix::fs::symlink(&secret, &units).unwrap();
    let leaks = |what: &str, text: &str| {
        assert!(
            !text.contains(SECRET) && !text.contains("id_rsa.service"),
            "{what} shows the root-only file:\n{text}"
        );
    };
    // Twice: the first records the baseline, the second reports changes.
    for _ in 0..2 {
        let o = w.sweep();
        leaks("the sweep", &format!("{o:?}"));
    }
    leaks(
        "the baseline",
        &std::fs::read_to_string(sweep::baseline_path(&w.node)).unwrap_or_default(),
    );
    let cg = w.env.cgroup("incident");
    let pid = w.env.spawn_user_sleeper(&cg);
    let o = incident::respond_pid(&w.node, pid, None).unwrap();
    assert!(o.complete(), "{o:#?}");
    let inc = std::fs::read_to_string(o.incident_file.as_ref().unwrap()).unwrap();
    leaks("the incident file", &inc);
    // A real directory of the user's again, with a root-only file put in it
    // (and one of the user's own beside it, which is read).
    std::fs::remove_file(&units).unwrap();
    std::fs::create_dir(&units).unwrap();
    std::os::unix::fs::chown(&units, Some(test_uid()), Some(test_uid())).unwrap();
    std::fs::copy(secret.join("id_rsa.service"), units.join("id_rsa.service")).unwrap();
    user_file(
        &units.join("own.service"),
        "[Service]\nExecStart=/bin/own\n",
    );
    let pid = w.env.spawn_user_sleeper(&cg);
    let o = incident::respond_pid(&w.node, pid, None).unwrap();
    let inc = std::fs::read_to_string(o.incident_file.as_ref().unwrap()).unwrap();
    leaks("the incident file", &inc);
    assert!(
        inc.contains("ExecStart=/bin/own"),
        "the user's own unit is read:\n{inc}"
    );
    let o = w.sweep();
    leaks("the sweep", &format!("{o:?}"));
    assert!(
        of_kind(&o, Kind::PersistenceSystemd)
            .iter()
            .any(|f| f.evidence["file"] == units.join("own.service").display().to_string()),
        "{o:#?}"
    );
}

/// A user's unit tree with thousands of directories is read whole by a
/// sweep with few descriptors (64: the walk holds a handful, not one per
/// directory waiting its turn), and many new files of one user make 20
/// findings and one that counts the rest, in text and in JSON.
#[test]
fn a_users_crowded_unit_tree_is_read_and_counted() {
    if !privileged() {
        return;
    }
    let w = world("crowded-units", "", "", false);
    let units = w.env.path("home/gt/.config/systemd/user");
    let cfg = w.env.path("gpufence.toml");
    let sweep = || {
        std::process::Command::new("prlimit")
            .arg("--nofile=64:64")
            .arg(workspace_bin("gpufence"))
            .arg("--config")
            .arg(&cfg)
            .args(["sweep", "--json", "--cgroup", &w.env.root])
            .output()
            .unwrap()
    };
    let o = sweep();
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("systemd baseline recorded"),
        "{o:?}"
    );
    let own = |p: &std::path::Path| {
        std::os::unix::fs::chown(p, Some(test_uid()), Some(test_uid())).unwrap()
    };
    for i in 0..2_000 {
        let d = units.join(format!("d{i:04}"));
        std::fs::create_dir(&d).unwrap();
        own(&d);
    }
    // Deep in the walk: a drop-in past the directories.
    let dropin = units.join("d1999/benign.service.d");
    std::fs::create_dir(&dropin).unwrap();
    own(&dropin);
    user_file(
        &dropin.join("evil.conf"),
        "[Service]\nExecStart=/tmp/.x/m\n",
    );
    for i in 0..30 {
        let l = units.join(format!("l{i:02}.service"));
        std::os::unix::fs::symlink("/dev/null", &l).unwrap();
        std::os::unix::fs::lchown(&l, Some(test_uid()), Some(test_uid())).unwrap();
    }
    let o = sweep();
    let found: Vec<Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|f: &Value| f["kind"] == "persistence_systemd")
        .collect();
    assert_eq!(found.len(), 21, "20 findings and one count: {found:#?}");
    let summary = found
        .iter()
        .find(|f| f["evidence"]["more"].is_u64())
        .expect("the count");
    assert_eq!(
        summary["evidence"]["more"], 11,
        "31 new files in all: {summary}"
    );
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("evil.conf"),
        "the drop-in past 2,000 directories is seen"
    );
}

/// `shm_remove_leftovers = true` and an Epilog whose deadline left the
/// leftovers check no time (`scan_budget_ms` cut to 0): no process was
/// read, so any may hold the job's files (this test holds one open): none
/// is removed, and the note and the `shm_leftovers` line say why
/// (`processes_unread`). Given its time, the next Epilog reads every
/// process: the file no one holds is removed, the held one is kept.
#[test]
fn shm_leftovers_are_kept_while_a_process_is_not_read() {
    if !privileged() {
        return;
    }
    let w = world("shmunread", "shm_remove_leftovers = true", "", true);
    let uid = test_uid();
    let job = 49;
    let shm = w.node.cfg.shm_dir.clone();
    let write = |name: &str| {
        let p = shm.join(name);
        std::fs::write(&p, b"0123456789").unwrap();
        std::os::unix::fs::chown(&p, Some(uid), Some(uid)).unwrap();
        p
    };
    let epilog = |node: &Node| {
        w.node
            .state
            .write_record(&gpufence_tests::job_record(job, uid, None))
            .unwrap();
        // File times come from the kernel's coarse clock (a tick behind).
        std::thread::sleep(Duration::from_millis(50));
        write("vllm-free");
        let held = write("psm_held");
        let open = std::fs::File::open(held).unwrap();
        let o = gpufence_node::job::epilog::run_within(
            node,
            &gpufence_node::job::epilog::EpilogEnv {
                job_id: job,
                ..Default::default()
            },
        );
        (o, open)
    };
    let spent = std::sync::Arc::new(gpufence_node::host::deadline::Deadline::new(Duration::ZERO));
    let (o, open) = epilog(&w.node.with_deadline(spent));
    assert!(shm.join("vllm-free").exists() && shm.join("psm_held").exists());
    assert!(
        o.notes.iter().any(
            |n| n.contains(&format!("left in {} (not removed: ", shm.display()))
                && n.ends_with("process(es) not read within 0 ms: they may hold them)")
        ),
        "{:?}",
        o.notes
    );
    let audit = gpufence_tests::audit_log(&w.node.cfg.audit_log);
    let line = audit
        .iter()
        .rfind(|e| e["event"] == "shm_leftovers" && e["job_id"] == job)
        .expect("a shm_leftovers line");
    assert_eq!(line["removed"], false, "{line}");
    assert!(line["processes_unread"].as_u64().unwrap() >= 1, "{line}");
    assert!(
        line["note"]
            .as_str()
            .is_some_and(|n| n.starts_with("not removed: ") && n.ends_with("they may hold them")),
        "{line}"
    );
    drop(open);

    let unreadable = gpufence_tests::unreadable_pids();
    let (o, _open) = epilog(&w.node);
    assert!(shm.join("psm_held").exists(), "held open: kept");
    let audit = gpufence_tests::audit_log(&w.node.cfg.audit_log);
    let line = audit
        .iter()
        .rfind(|e| e["event"] == "shm_leftovers" && e["job_id"] == job)
        .expect("a shm_leftovers line");
    assert_eq!(
        line["files_total"], 1,
        "the held one is no leftover: {line}"
    );
    if unreadable.is_empty() {
        assert!(!shm.join("vllm-free").exists(), "{:?}", o.notes);
        assert_eq!(line["removed"], true, "{line}");
        assert_eq!(line["processes_unread"], 0, "{line}");
    } else {
        // A sandbox whose init root cannot read: it may hold it.
        assert!(shm.join("vllm-free").exists(), "{unreadable:?}");
        assert_eq!(line["removed"], false, "{line}");
        assert!(
            line["processes_unread"].as_u64().unwrap() >= unreadable.len() as u64,
            "{unreadable:?} {line}"
        );
    }
}

/// A job that leaves 100,000 long-named files in the shared-memory
/// directory: the Epilog's `shm_leftovers` line stays under 64 KiB (the
/// first names, then the counts and the total), and the sweep's output
/// under 1 MiB (one finding for the user, with a count), in text and JSON.
#[test]
fn a_flood_of_shm_files_stays_bounded() {
    if !privileged() {
        return;
    }
    let w = world("shmflood", "", "", true);
    let uid = test_uid();
    let job = 48;
    w.node
        .state
        .write_record(&gpufence_tests::job_record(job, uid, None))
        .unwrap();
    // File times come from the kernel's coarse clock (a tick behind).
    std::thread::sleep(Duration::from_millis(50));
    let shm = w.node.cfg.shm_dir.clone();
    let long = "x".repeat(200);
    for i in 0..100_000 {
        let p = shm.join(format!("{long}-{i:06}"));
        std::fs::write(&p, b"0123456789").unwrap();
        std::os::unix::fs::chown(&p, Some(uid), Some(uid)).unwrap();
    }
    let cfg = w.env.path("gpufence.toml");
    let o = std::process::Command::new(workspace_bin("gpufence-epilog"))
        .args(["--config", cfg.to_str().unwrap()])
        .env("SLURM_JOB_ID", job.to_string())
        .env("SLURM_JOB_UID", uid.to_string())
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    let text = std::fs::read_to_string(&w.node.cfg.audit_log).unwrap();
    let line = text
        .lines()
        .find(|l| l.contains("\"shm_leftovers\""))
        .expect("a shm_leftovers line");
    assert!(line.len() <= 64 << 10, "{} bytes", line.len());
    let v: Value = serde_json::from_str(line).unwrap();
    let examined = gpufence_node::holders::shm::EXAMINED_MAX as u64;
    assert_eq!(
        v["files_total"], examined,
        "at most that many entries examined"
    );
    assert_eq!(v["examined_all"], false);
    assert_eq!(v["bytes_total"], examined * 10);
    let listed = v["files"].as_array().unwrap().len();
    assert!(
        listed > 100 && listed as u64 == v["files_listed"],
        "{listed}"
    );
    let run = |args: &[&str]| {
        std::process::Command::new(workspace_bin("gpufence"))
            .arg("--config")
            .arg(&cfg)
            .args(args)
            .output()
            .unwrap()
    };
    for args in [&["sweep"][..], &["sweep", "--json"][..]] {
        let o = run(args);
        assert!(
            o.stdout.len() <= 1 << 20,
            "{args:?}: {} bytes",
            o.stdout.len()
        );
        let out = String::from_utf8_lossy(&o.stdout);
        assert_eq!(
            out.lines().filter(|l| l.contains("shm_leftover")).count(),
            1,
            "{args:?}: one finding for the user"
        );
        assert!(
            out.contains(&format!("at least {examined} file(s)")),
            "{args:?}"
        );
    }
}

/// When the cgroup holds other processes, the tree is stopped with SIGSTOP
/// and only the tree is killed.
#[test]
fn respond_uses_sigstop_in_a_shared_cgroup_and_spares_bystanders() {
    if !privileged() {
        return;
    }
    let mut w = world("respond-shared", "", "", false);
    let cg = w.env.cgroup("shared");
    let bystander = w.env.spawn_user_sleeper(&cg);
    let target = w.env.spawn_user_sleeper(&cg);
    let o = incident::respond_pid(&w.node, target, None).unwrap();
    assert!(o.complete(), "{o:#?}");
    assert_eq!(o.frozen.get(&target).map(|h| h.as_str()), Some("SIGSTOP"));
    assert_eq!(o.killed, vec![target]);
    assert!(gone(target));
    assert!(!gone(bystander), "a bystander in the same cgroup lives");
    assert!(o.drained.is_none());
    assert!(!w.env.path("scontrol.args").exists());
    let status = std::fs::read_to_string(format!("/proc/{bystander}/stat")).unwrap();
    assert!(
        !status
            .rsplit(')')
            .next()
            .unwrap()
            .trim_start()
            .starts_with('T'),
        "the bystander was not stopped: {status}"
    );
}

/// Refusals: PID 1, itself, its ancestors, kernel threads, exempt daemons,
/// processes that do not exist. Nothing is touched; each is audited.
#[test]
fn respond_refuses_what_must_not_be_touched() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("refuse");
    let exempt = format!("{}/exempt", env.root);
    let node = config(&env, &format!("exempt_cgroups = [\"{exempt}\"]"), "", None);
    let mut w = World {
        env,
        node,
        scenario: None,
    };
    let ex = w.env.cgroup("exempt");
    let daemon = w.env.spawn_sleeper(&ex);
    assert_eq!(
        incident::respond_pid(&w.node, 1, None).unwrap_err(),
        Refusal::Init
    );
    let me = std::process::id() as i32;
    assert_eq!(
        incident::respond_pid(&w.node, me, None).unwrap_err(),
        Refusal::Myself
    );
    // SAFETY: getppid has no preconditions.
    let parent = unsafe { libc::getppid() };
    if parent > 1 {
        assert_eq!(
            incident::respond_pid(&w.node, parent, None).unwrap_err(),
            Refusal::Ancestor(parent)
        );
    }
    match incident::respond_pid(&w.node, daemon, None).unwrap_err() {
        Refusal::Exempt { pid, cgroup, .. } => {
            assert_eq!((pid, cgroup), (daemon, ex.clone()));
        }
        r => panic!("{r:?}"),
    }
    assert!(!gone(daemon), "an exempt daemon is never touched");
    let kthread = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .find(|p| {
            gpufence_node::host::procs::read_stat(*p)
                .is_some_and(|(_, _, f)| f & gpufence_node::host::procs::PF_KTHREAD != 0)
        });
    match kthread {
        Some(k) => assert_eq!(
            incident::respond_pid(&w.node, k, None).unwrap_err(),
            Refusal::KernelThread(k)
        ),
        None => {
            eprintln!("no kernel thread visible here (pid namespace): that refusal is unchecked")
        }
    }
    // A thread id is not a process.
    let t = std::thread::spawn(|| {
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        std::thread::sleep(Duration::from_millis(300));
        tid
    });
    std::thread::sleep(Duration::from_millis(50));
    let tids: Vec<i32> = std::fs::read_dir(format!("/proc/{me}/task"))
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter(|t| *t != me)
        .collect();
    if let Some(tid) = tids.first() {
        assert_eq!(
            incident::respond_pid(&w.node, *tid, None).unwrap_err(),
            Refusal::Thread {
                tid: *tid,
                tgid: me
            }
        );
    }
    let _ = t.join();
    let none = i32::MAX - 7;
    assert_eq!(
        incident::respond_pid(&w.node, none, None).unwrap_err(),
        Refusal::NotFound(none)
    );
    let refused = w
        .audit()
        .into_iter()
        .filter(|e| e["event"] == "respond_refused")
        .count();
    assert!(refused >= 4, "{refused}");
    assert!(
        !w.env.path("evidence").exists(),
        "no evidence, nothing done"
    );
    // A user's process in the exempt cgroup is no exempt daemon: an
    // exemption covers system accounts only.
    let user = w.env.spawn_user_sleeper(&ex);
    let o = incident::respond_pid(&w.node, user, None).unwrap();
    assert_eq!(o.killed, vec![user], "{o:#?}");
    assert!(gone(user) && !gone(daemon));
}

/// The CLI as an admin or a health check calls it: `gpufence sweep` prints
/// one JSON object per finding and exits 1 at the threshold, 0 below it;
/// `gpufence respond 1` refuses with exit 2.
#[test]
fn the_cli_sweeps_and_refuses() {
    if !privileged() {
        return;
    }
    let w = world("cli", "", "", true);
    std::fs::write(
        w.env.path(&format!("cron/{TEST_USER}")),
        "* * * * * /tmp/x\n",
    )
    .unwrap();
    let cfg = w.env.path("gpufence.toml");
    let run = |args: &[&str]| {
        std::process::Command::new(workspace_bin("gpufence"))
            .arg("--config")
            .arg(&cfg)
            .args(args)
            .output()
            .unwrap()
    };
    let o = run(&["sweep", "--json", "--cgroup", &w.env.root]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let found: Vec<Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(
        (found[0]["kind"].as_str(), found[0]["severity"].as_str()),
        (Some("persistence_cron"), Some("medium"))
    );
    let o = run(&["sweep", "--fail-on", "high", "--cgroup", &w.env.root]);
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("persistence_cron"),
        "{o:?}"
    );
    let o = run(&["sweep", "--fail-on", "urgent"]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    let o = run(&["respond", "1"]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    assert!(
        !String::from_utf8_lossy(&o.stderr).is_empty(),
        "says why: {o:?}"
    );
}

/// `gpufence respond PID` prints what the process and its user chose (the
/// process name, unit file names under their home, crontab lines) through
/// the one sanitiser: no escape sequence reaches root's terminal.
#[test]
fn respond_prints_no_escape_sequences() {
    if !privileged() {
        return;
    }
    let w = world("respond-esc", "", "", false);
    let esc = "\u{1b}]0;owned\u{7}\u{1b}[2J";
    std::fs::write(
        w.env.path(&format!("cron/{TEST_USER}")),
        format!("* * * * * /tmp/x {esc}\n"),
    )
    .unwrap();
    user_file(
        &w.env
            .path(&format!("home/gt/.config/systemd/user/m{esc}.service")),
        "[Service]\n",
    );
    // A program whose file name (its process name) carries an escape.
    let bin = w.env.path("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let named = bin.join("\u{1b}[31mx");
    std::fs::copy("/bin/sleep", &named).unwrap();
    let cg = w.env.cgroup("incident-esc");
    let mut child = w
        .env
        .user_command_in(&cg, &named)
        .arg("1000")
        .spawn()
        .unwrap();
    let pid = child.id();
    let t0 = Instant::now();
    while !std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.contains('\u{1b}'))
        && t0.elapsed() < Duration::from_secs(5)
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    let ConfigOrigin::File(config) = &w.node.origin else {
        panic!("a config file");
    };
    let o = std::process::Command::new(workspace_bin("gpufence"))
        .arg("--config")
        .arg(config)
        .args(["respond", &pid.to_string()])
        .output()
        .unwrap();
    let _ = child.wait();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(gone(pid as i32), "{out}{err}");
    assert!(
        out.contains("?[31mx")
            && out.contains("/tmp/x ?]0;owned??[2J")
            && out.contains("m?]0;owned??[2J.service"),
        "{out}"
    );
    assert!(
        !out.contains('\u{1b}') && !err.contains('\u{1b}') && !out.contains('\u{7}'),
        "{out:?}{err:?}"
    );
}

/// A roll-out in audit mode: a user's process outside every grant holds
/// a GPU (the audit fence allowed its open, and recorded it). The sweep
/// reports it as `audit_gpu_holder`, low (below the default
/// `sweep_fail_severity`), saying the enforcing fence would deny it, and
/// `--drain` leaves the node alone. The same node enforcing: critical
/// `unfenced_gpu_holder`, as before.
#[test]
fn an_audit_mode_rollout_drains_nothing() {
    if !privileged() {
        return;
    }
    let real = HoldableDevice::claim();
    let env = TestEnv::new("auditroll");
    let node = config(
        &env,
        "mode = \"audit\"",
        &format!("fake-gpu = {}", real.major),
        None,
    );
    let mut w = World {
        env,
        node,
        scenario: None,
    };
    let gpu = w.env.mknod("gpu", real.major, real.minor);
    let g = gpu.to_str().unwrap();
    fence_ops::install(&w.node).unwrap();
    let out = w.env.cgroup("outside");
    let intruder = w.env.spawn_user_probe(&out, &["hold", g], "held");
    let args = w.env.path("scontrol.args");
    let o = w.sweep_with(|r| r.drain_node = Some("node17".into()));
    assert!(of_kind(&o, Kind::UnfencedGpuHolder).is_empty(), "{o:#?}");
    let h = of_kind(&o, Kind::AuditGpuHolder);
    assert_eq!(h.len(), 1, "{o:#?}");
    assert_eq!(h[0].pid, Some(intruder));
    assert_eq!(h[0].severity, Severity::Low);
    assert_eq!(h[0].evidence["fence_mode"], "audit");
    assert_eq!(h[0].evidence["would_be_denied"], true);
    assert!(h[0].summary.contains("audit mode"), "{}", h[0].summary);
    assert_eq!((o.exit, o.drained.clone()), (0, None), "{o:#?}");
    assert!(!args.exists(), "a roll-out in audit mode drains nothing");
    // What the audit fence let through is in its records.
    let d = gpufence_node::host::denials::list(&w.node).unwrap();
    assert!(
        d.iter().any(|x| x.cgroup.as_deref() == Some(out.as_str())
            && x.uid == test_uid()
            && x.device == format!("{}:{}", real.major, real.minor)),
        "{d:#?}"
    );
    // Enforcing, the same holder breaks the fence's promise.
    let mut cfg = w.node.cfg.clone();
    cfg.mode = gpufence_model::config::Mode::Enforce;
    let node = Node::new(cfg, w.node.origin.clone()).unwrap();
    fence_ops::install(&node).unwrap();
    let o = sweep::execute(
        &node,
        &SweepRequest {
            cgroup: Some(w.env.root.clone()),
            ..Default::default()
        },
    );
    assert!(of_kind(&o, Kind::AuditGpuHolder).is_empty(), "{o:#?}");
    let h = of_kind(&o, Kind::UnfencedGpuHolder);
    assert_eq!(h.len(), 1, "{o:#?}");
    assert_eq!(
        (h[0].pid, h[0].severity),
        (Some(intruder), Severity::Critical)
    );
    assert_eq!(h[0].evidence["fence_mode"], "enforce");
    assert_eq!(o.exit, 1);
}

/// `gpufence denials --by-cgroup`: one line per cgroup, and a ready
/// `exempt_cgroups` line that adds the system services among them (root in
/// a `.service` unit, a sub-cgroup of one named by its unit) and never a
/// job's cgroup, a user's, a container's scope or a unit whose process is
/// a user's. The line is a config gpufence reads.
#[test]
fn denials_by_cgroup_suggest_system_services_only() {
    if !privileged() {
        return;
    }
    let w = world("bycg", "", "", true);
    let gpu = w.env.mknod("nvidia0", 195, 0);
    let ctl = w.env.mknod("nvidiactl", 195, 255);
    let r = &w.env.root;
    let fm = w.env.cgroup("sys/fm-standin.service");
    let agent = w.env.cgroup("sys/agent.service/sub");
    let useragent = w.env.cgroup("sys/useragent.service");
    let scope = w.env.cgroup("sys/docker-abc.scope");
    let job = w.env.cgroup("job_7/step_0");
    let session = w.env.cgroup("user.slice/x.service");
    for (cg, dev) in [
        (&fm, &gpu),
        (&fm, &ctl),
        (&fm, &gpu),
        (&agent, &ctl),
        (&scope, &gpu),
        (&job, &gpu),
        (&session, &gpu),
    ] {
        assert_eq!(w.env.open_from(cg, dev), "EPERM", "{cg}");
    }
    let o = w
        .env
        .user_command_in(&useragent, gpufence_tests::probe_bin())
        .args(["open", gpu.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("EPERM"),
        "{o:?}"
    );
    let cfg = w.env.path("gpufence.toml");
    let run = |args: &[&str]| {
        std::process::Command::new(workspace_bin("gpufence"))
            .arg("--config")
            .arg(&cfg)
            .args(args)
            .output()
            .unwrap()
    };
    let o = run(&["denials", "--by-cgroup", "--json"]);
    assert!(o.status.success(), "{o:?}");
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let want_fm = format!("{r}/sys/fm-standin.service");
    let want_agent = format!("{r}/sys/agent.service");
    assert_eq!(v["suggested"], json!([want_agent, want_fm]), "{v:#}");
    let by: std::collections::BTreeMap<String, &Value> = v["cgroups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["cgroup"].as_str().unwrap().to_string(), c))
        .collect();
    let fm_row = by[&format!("/{fm}")];
    assert_eq!(fm_row["count"], 3);
    assert_eq!(fm_row["devices"], json!(["195:0", "195:255"]));
    assert_eq!(fm_row["users"], json!(["root"]));
    assert_eq!(fm_row["last_comm"], "gpufence-probe");
    for c in [&useragent, &scope, &job, &session] {
        let row = by[&format!("/{c}")];
        assert!(row["suggest"].is_null(), "{c}: {row:#}");
        assert!(row["not_suggested"].is_string(), "{c}: {row:#}");
    }
    assert!(by[&format!("/{job}")]["not_suggested"]
        .as_str()
        .unwrap()
        .contains("job"));
    assert_eq!(by[&format!("/{useragent}")]["uids"], json!([test_uid()]));
    // The text form ends with the line to paste, which gpufence reads.
    let o = run(&["denials", "--by-cgroup"]);
    assert!(o.status.success(), "{o:?}");
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    let last = text.lines().last().unwrap();
    assert!(
        last.starts_with("exempt_cgroups = [\"system.slice/slurmd.service\""),
        "{text}"
    );
    let c = Config::parse(last, std::path::Path::new("/pasted")).unwrap();
    // Root's services: bare entries (root only).
    assert_eq!(
        &c.exempt_cgroups[c.exempt_cgroups.len() - 2..],
        &[
            gpufence_model::config::ExemptEntry::root(want_agent.clone()),
            gpufence_model::config::ExemptEntry::root(want_fm.clone())
        ],
        "{text}"
    );
    assert!(c
        .exempt_cgroups
        .starts_with(&Config::default().exempt_cgroups));
    assert!(text.contains(&format!("exempt /{want_fm}")), "{text}");
}

/// Busy without a grant means someone else's use. Against the fake NVML:
/// DCGM's host engine (a root daemon in an exempt cgroup) running
/// `dcgmi diag` on an idle GPU (utilisation, memory) is not
/// `gpu_busy_without_grant`; utilisation with no process at all is, at
/// `busy_without_process_severity`; the daemon beside a user's process
/// is, high, naming the user's process only.
#[test]
fn exempt_daemons_on_an_idle_gpu_are_not_busy_without_grant() {
    if !privileged() {
        return;
    }
    let mut w = nvml_world_with("gpudiag", |env| {
        format!(
            "exempt_cgroups = [\"{}/dcgm.service\"]\nbusy_without_process_severity = \"medium\"",
            env.root
        )
    });
    let dcgm = w.env.cgroup("dcgm.service");
    let engine = w.env.spawn_sleeper(&dcgm);
    let out = w.env.cgroup("outside");
    let user = w.env.spawn_user_sleeper(&out);
    let gpu = |minor: u32, procs: Value| {
        json!({"minor": minor, "idle_used_mib": 500, "memory_total_mib": 81920,
               "util_gpu": 100, "util_mem": 60, "processes": procs})
    };
    std::fs::write(
        w.scenario.as_ref().unwrap(),
        json!({"gpus": [
            gpu(0, json!([{"pid": engine, "used_mib": 30000}])),
            gpu(1, json!([])),
            gpu(2, json!([{"pid": engine, "used_mib": 1000}, {"pid": user, "used_mib": 1000}])),
        ]})
        .to_string(),
    )
    .unwrap();
    let o = w.sweep();
    let busy = of_kind(&o, Kind::GpuBusyWithoutGrant);
    let by: std::collections::BTreeMap<u64, &&Finding> = busy
        .iter()
        .map(|f| (f.evidence["minor"].as_u64().unwrap(), f))
        .collect();
    assert_eq!(by.keys().copied().collect::<Vec<_>>(), vec![1, 2], "{o:#?}");
    assert_eq!(by[&1].severity, Severity::Medium);
    assert!(
        by[&1].summary.contains("no process listed"),
        "{}",
        by[&1].summary
    );
    assert_eq!(by[&2].severity, Severity::High);
    assert_eq!(by[&2].evidence["pids"], json!([user]));
    assert_eq!(by[&2].evidence["exempt_pids"], json!([engine]));
    let h = of_kind(&o, Kind::UnfencedGpuHolder);
    assert_eq!(
        h.iter().map(|f| f.pid).collect::<Vec<_>>(),
        vec![Some(user)]
    );
}

/// `gpufence-probe tables /dev/null 8 N` in cgroup `cg`, as uid 23456
/// (`as_other`) or root: eight private descriptor tables of up to 5,000
/// slots (`RLIMIT_NOFILE` allowing), holding nothing the sweep looks for.
fn big_tables(env: &mut TestEnv, cg: &str, as_other: bool) -> i32 {
    let mut nofile = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit into a struct we own.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut nofile) };
    let slots = (nofile.rlim_max.min(5_100) as usize)
        .saturating_sub(100)
        .to_string();
    let mut cmd = env.command_in(cg, "setpriv");
    if as_other {
        cmd.args(["--reuid", "23456", "--regid", "23456", "--clear-groups"]);
    }
    cmd.arg("--")
        .arg(gpufence_tests::probe_bin())
        .args(["tables", "/dev/null", "8", &slots]);
    env.spawn_ready(cmd, "held")
}

/// Issue 33, point 1: where the kernel's iterators cannot run, the
/// sweep's `/proc` walk is bounded (`scan_budget_ms` per process, 20 ms
/// here) and fails closed. A process outside every job whose eight tables
/// of 5,000 descriptors are not read whole by then is a critical
/// `not_read_whole` finding naming its pid and "not read" (`--drain`
/// drains with that reason; nothing is killed); the same in a job cgroup
/// is medium (its Epilog judges it); root's in an exempt cgroup is no
/// finding; a small process is read whole. With the default budget
/// every one of them is read whole: no such finding.
#[test]
fn the_sweeps_proc_walk_is_bounded_and_fails_closed() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("notread");
    let exempt = format!("{}/exempt", env.root);
    let mut node = config(
        &env,
        &format!("exempt_cgroups = [\"{exempt}\"]\nscan_budget_ms = 20"),
        "",
        None,
    );
    fence_ops::install(&node).unwrap();
    let mut env = env;
    let out = env.cgroup("outside");
    let job = env.cgroup("job_7/step_0/user/task_0");
    let ex = env.cgroup("exempt");
    let outside = big_tables(&mut env, &out, true);
    let in_job = big_tables(&mut env, &job, true);
    let daemon = big_tables(&mut env, &ex, false);
    let small = env.spawn_user_sleeper(&out);
    let mut w = World {
        env,
        node: Node::new(node.cfg.clone(), node.origin.clone()).unwrap(),
        scenario: None,
    };
    let args = w.env.path("scontrol.args");
    // The `/proc` walk, whatever the iterators could do.
    let o = w.sweep_with(|r| {
        r.drain_node = Some("node17".into());
        r.proc_walk = true;
    });
    let nr = of_kind(&o, Kind::NotReadWhole);
    let f = nr
        .iter()
        .find(|f| f.pid == Some(outside))
        .unwrap_or_else(|| panic!("{outside} not reported: {o:#?}"));
    assert_eq!(f.severity, Severity::Critical);
    assert_eq!(f.uid, Some(23456));
    assert!(
        f.summary.starts_with(&format!(
            "pid {outside} not read whole within scan_budget_ms (20 ms): "
        )),
        "{}",
        f.summary
    );
    let j = nr
        .iter()
        .find(|f| f.pid == Some(in_job))
        .unwrap_or_else(|| panic!("{in_job} not reported: {o:#?}"));
    assert_eq!(j.severity, Severity::Medium);
    assert_eq!(j.evidence["job_cgroup"], "job_7");
    for p in [daemon, small] {
        assert!(!nr.iter().any(|f| f.pid == Some(p)), "{p}: {o:#?}");
    }
    // Critical: `--drain` drains, the reason naming the pid and "not read".
    assert_eq!(o.exit, 1);
    let drained = o.drained.clone().unwrap_or_default();
    assert!(
        drained.starts_with(&format!(
            "gpufence: sweep: critical not_read_whole pid {outside} "
        )) && drained.contains("not read whole"),
        "{drained}"
    );
    assert!(std::fs::read_to_string(&args)
        .unwrap()
        .contains(&format!("pid {outside} ")));
    for p in [outside, in_job, daemon, small] {
        assert!(!gone(p), "{p} is never killed");
    }
    assert!(o.report.duration_seconds < 60.0, "stalled: {o:#?}");
    // The default budget: every one read whole.
    node.cfg.scan_budget_ms = 2000;
    w.node = node;
    let o = w.sweep_with(|r| r.proc_walk = true);
    assert!(
        !of_kind(&o, Kind::NotReadWhole)
            .iter()
            .any(|f| [outside, in_job, daemon, small].contains(&f.pid.unwrap_or(0))),
        "{o:#?}"
    );
}

/// `fence watch`'s pass resolves the patterns again when it writes: a
/// unit of a pattern started between the pass's look and its write is
/// exempted by that write, and its `exemption_applied` line names it (it
/// was exempted silently before: the e2e fabric test waited for a line
/// that never came when the NVSM unit appeared in that window).
#[test]
fn a_unit_started_while_the_watch_writes_is_named() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("watchrace");
    let svc = format!("{}/svc", env.root);
    let fm = format!("{svc}/nvidia-fabricmanager.service");
    let node = config(
        &env,
        &format!("exempt_cgroups = [\"{fm}\", \"{svc}/nvsm*.service\"]"),
        "",
        None,
    );
    let w = World {
        env,
        node,
        scenario: None,
    };
    w.env.cgroup("svc/nvidia-fabricmanager.service");
    fence_ops::install(&w.node).unwrap();
    // A restart of the Fabric Manager unit: a new cgroup, a new id.
    w.env.cg.remove_tree(&fm).unwrap();
    w.env.cgroup("svc/nvidia-fabricmanager.service");
    // The pass looked before the NVSM unit started, then it started.
    let paths = fence_ops::exempt_paths(&w.node);
    assert!(paths.iter().all(|p| !p.contains("nvsm")), "{paths:?}");
    let nvsm = w.env.cgroup("svc/nvsm-core.service");
    fence_ops::reapply_exemptions(&w.node, &paths).unwrap();
    let fence = Fence::open(&w.env.bpffs).unwrap();
    let ids = [w.env.cg.id(&fm).unwrap(), w.env.cg.id(&nvsm).unwrap()];
    assert!(ids.iter().all(|id| fence.is_exempt(*id).unwrap()));
    let named: Vec<Value> = w
        .audit()
        .into_iter()
        .filter(|e| e["event"] == "exemption_applied")
        .flat_map(|e| e["exempt"].as_array().cloned().unwrap_or_default())
        .collect();
    let named_ids: BTreeSet<u64> = named
        .iter()
        .filter_map(|e| e["cgroup_id"].as_u64())
        .collect();
    assert_eq!(named_ids, ids.into_iter().collect(), "{named:#?}");
    // Nothing new: the next pass writes nothing and says nothing.
    fence_ops::reapply_exemptions(&w.node, &fence_ops::exempt_paths(&w.node)).unwrap();
    assert_eq!(
        w.events()
            .iter()
            .filter(|e| *e == "exemption_applied")
            .count(),
        1
    );
}
