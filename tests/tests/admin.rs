//! Admin tools on the real kernel: `gpufence doctor` with a foreign program
//! attached below the fence, `gpufence exec` in the exempt cgroup, and the
//! job report's writer (as the user, whole or not at all).

use std::os::fd::AsFd;
use std::process::Command;

use gpufence_cgroup::asm::{Asm, Reg};
use gpufence_cgroup::fence::Fence;
use gpufence_cgroup::sys;
use gpufence_model::device::{Access, DevNum};
use gpufence_tests::{privileged, probe_bin, workspace_bin, TestEnv};
use serde_json::Value;

const MAJORS: &str = "[majors]\nnvidia = 195\nnvidia-uvm = 241\n";

fn gpufence(cfg: &std::path::Path, args: &[&str]) -> std::process::Output {
    Command::new(workspace_bin("gpufence"))
        .arg("--config")
        .arg(cfg)
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn doctor_lists_programs_up_the_tree_and_explains_each_device() {
    if !privileged() {
        return;
    }
    let mut env = TestEnv::new("doctor");
    let cfg = env.config(MAJORS);
    assert!(gpufence(&cfg, &["fence", "install"]).status.success());
    env.mknod("nvidia0", 195, 0);
    env.mknod("nvidia1", 195, 1);
    let job = env.cgroup("job_5");
    let task = env.cgroup("job_5/step_0/user/task_0");
    // A foreign device program below the fence, attached the way Slurm
    // attaches at a task cgroup (flags 0): allow-all.
    let mut a = Asm::new();
    a.mov64_imm(Reg::R0, 1).exit();
    let prog = sys::prog_load_cgroup_device(&a.assemble().unwrap().insns, "slurm_like").unwrap();
    let task_dir = std::fs::File::open(env.cg.path(&task)).unwrap();
    sys::prog_attach_cgroup_device(prog.as_fd(), task_dir.as_fd(), 0).unwrap();
    Fence::open(&env.bpffs)
        .unwrap()
        .grant(
            env.cg.id(&job).unwrap(),
            &job,
            5,
            &[(DevNum::new(195, 0), Access::RW)],
        )
        .unwrap();
    let pid = env.spawn_sleeper(&task);
    let o = gpufence(&cfg, &["doctor", &pid.to_string(), "--json"]);
    // Exit 1: some device (nvidia1, nvidiactl) is denied to it.
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let d: Value = serde_json::from_slice(&o.stdout).unwrap();
    // JSON cgroup paths are absolute, as sweep and the audit log write them.
    assert_eq!(d["cgroup"], format!("/{task}"));
    assert_eq!(
        (d["fence_attached"].clone(), d["fence_current"].clone()),
        (Value::from(true), Value::from(true))
    );
    let levels = d["levels"].as_array().unwrap();
    let at = |c: &str| {
        levels
            .iter()
            .find(|l| l["cgroup"] == format!("/{c}"))
            .unwrap_or_else(|| panic!("no level /{c}: {d}"))
    };
    let ours = at(&env.root);
    assert_eq!(ours["attach_flags"], "multi");
    assert!(
        ours["programs"][0]["owner"]
            .as_str()
            .unwrap()
            .starts_with("gpufence (this node"),
        "{ours}"
    );
    assert_eq!(ours["programs"][0]["effective"], true);
    let foreign = at(&task);
    assert_eq!(foreign["attach_flags"], "none");
    assert_eq!(foreign["programs"][0]["name"], "slurm_like");
    assert_eq!(foreign["programs"][0]["effective"], true);
    // Its name and an allow-all body are not Slurm's shape: no owner guessed.
    assert_eq!(foreign["programs"][0]["owner"], "unknown", "{foreign}");
    let dev = |n: &str| {
        d["devices"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["device"] == n)
            .cloned()
            .unwrap()
    };
    assert_eq!(dev("195:0")["verdict"], "allowed");
    assert_eq!(dev("195:0")["why"], format!("grant of job 5 on /{job}"));
    // Both programs answered: the fence's and the allow-all one.
    let v0 = dev("195:0");
    let answers: Vec<&str> = v0["programs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["answer"].as_str().unwrap())
        .collect();
    assert_eq!(answers, ["allows", "allows"], "{d}");
    assert_eq!(dev("195:1")["verdict"], "denied");
    assert!(
        dev("241:0")["why"]
            .as_str()
            .unwrap()
            .starts_with("no grant"),
        "{d}"
    );
    // The kernel agrees with the doctor.
    assert_eq!(env.open_from(&task, &env.path("dev/nvidia0")), "ENXIO");
    assert_eq!(env.open_from(&task, &env.path("dev/nvidia1")), "EPERM");
    // An audit-mode config says the enforcing program is not current for it.
    let audit_cfg = env.path("audit.toml");
    std::fs::write(
        &audit_cfg,
        std::fs::read_to_string(&cfg).unwrap().replacen(
            "cgroup_root",
            "mode = \"audit\"\ncgroup_root",
            1,
        ),
    )
    .unwrap();
    let d: Value = serde_json::from_slice(
        &gpufence(&audit_cfg, &["doctor", "--cgroup", &task, "--json"]).stdout,
    )
    .unwrap();
    assert_eq!(d["fence_current"], false);
    // Text form.
    let t =
        String::from_utf8_lossy(&gpufence(&cfg, &["doctor", &pid.to_string()]).stdout).into_owned();
    assert!(
        t.contains("slurm_like") && t.contains("195:1    denied"),
        "{t}"
    );
    // slurm.conf's hook timeout shorter than the hooks' worst cases: a
    // warning for the Prolog; the Epilog's deadline (80% of it) fits, and
    // doctor says so, but it is too short for one SIGTERM-ignoring
    // holder: a warning for that; what was compared in --json.
    let slurm_conf = env.path("slurm.conf");
    std::fs::write(&slurm_conf, "PrologEpilogTimeout=5\n").unwrap();
    let doctor = |json: bool| {
        let mut c = Command::new(workspace_bin("gpufence"));
        c.arg("--config")
            .arg(&cfg)
            .args(["doctor", &pid.to_string()]);
        if json {
            c.arg("--json");
        }
        c.env("SLURM_CONF", &slurm_conf).output().unwrap().stdout
    };
    let d: Value = serde_json::from_slice(&doctor(true)).unwrap();
    let t = &d["timeouts"];
    assert_eq!(t["slurm"]["epilog"]["seconds"], 5, "{t}");
    assert_eq!(t["slurm"]["epilog"]["key"], "PrologEpilogTimeout", "{t}");
    // The deadline, 4 s, and the drain's 1 s past it.
    assert_eq!(t["epilog_worst"]["total_ms"], 5000, "{t}");
    assert!(
        t["epilog_worst"]["waits_ms"].as_u64().unwrap() > 5000,
        "{t}"
    );
    assert_eq!(t["epilog_deadline"]["from"], "80% of PrologEpilogTimeout=5");
    let w: Vec<&str> = d["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .filter(|w| w.contains("PrologEpilogTimeout=5"))
        .collect();
    assert_eq!(w.len(), 2, "{w:?}");
    assert!(
        w[0].starts_with("gpufence's Prolog may take up to "),
        "{}",
        w[0]
    );
    assert!(
        // The test environment's kill_wait_ms is 3000.
        w[1].starts_with("the Epilog's deadline, 4 s (80% of PrologEpilogTimeout=5), is shorter than one holder that ignores SIGTERM needs (12.8 s: term_grace_ms 5000 + kill_wait_ms 3000 + 2 scans of scan_budget_ms 2000 + the drain's reserve)"),
        "{}",
        w[1]
    );
    let text = String::from_utf8_lossy(&doctor(false)).into_owned();
    assert!(
        text.contains("warning: gpufence's Prolog may take up to ")
            && text.contains("raise PrologEpilogTimeout to ")
            && text.contains("note: the Epilog fits PrologEpilogTimeout=5 in ")
            && text.contains("at worst 5 s (its deadline, 4 s (80% of PrologEpilogTimeout=5), and 1 s for a drain past it;")
            && !text.contains("gpufence's Epilog may take"),
        "{text}"
    );
    // A deadline set past the timeout: the Epilog's warning names it.
    let late = env.path("late.toml");
    // First: the file may end in a table.
    let body = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&late, format!("epilog_deadline_ms = 90000\n{body}")).unwrap();
    let out = Command::new(workspace_bin("gpufence"))
        .arg("--config")
        .arg(&late)
        .args(["doctor", &pid.to_string()])
        .env("SLURM_CONF", &slurm_conf)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.contains("warning: gpufence's Epilog may take up to 91 s at worst (its deadline, epilog_deadline_ms 90000, and 1 s for a drain past it;")
            && text.contains("lower epilog_deadline_ms to 4000 or less"),
        "{text}"
    );
}

/// Slurm's cgroup/v2 device program for a job given 195:0 of 195:0-1
/// (`src/plugins/cgroup/v2/ebpf.c`: type, access, major, minor to r2-r5;
/// one block per listed device; default allow), denying `deny`.
fn slurm_program(deny: &[(u32, u32)]) -> std::os::fd::OwnedFd {
    use gpufence_cgroup::asm::{AluOp, JmpOp, Size};
    let mut a = Asm::new();
    a.load(Size::W, Reg::R2, Reg::R1, 0)
        .alu32_imm(AluOp::And, Reg::R2, 0xFFFF)
        .load(Size::W, Reg::R3, Reg::R1, 0)
        .alu32_imm(AluOp::Rsh, Reg::R3, 16)
        .load(Size::W, Reg::R4, Reg::R1, 4)
        .load(Size::W, Reg::R5, Reg::R1, 8);
    for (n, (major, minor)) in deny.iter().enumerate() {
        let next = format!("next{n}");
        a.jmp_imm(JmpOp::Ne, Reg::R2, 2, &next)
            .jmp_imm(JmpOp::Ne, Reg::R4, *major as i32, &next)
            .jmp_imm(JmpOp::Ne, Reg::R5, *minor as i32, &next)
            .mov64_imm(Reg::R0, 0)
            .exit()
            .label(&next);
    }
    a.mov64_imm(Reg::R0, 1).exit();
    sys::prog_load_cgroup_device(&a.assemble().unwrap().insns, "Slurm_Cgroup_v2").unwrap()
}

/// Doctor's verdict is every effective program's, and it equals the real
/// open(): a job granted 195:0 and 195:1 by the fence, with Slurm's
/// program on its job cgroup denying 195:1 (named as Slurm's by its
/// shape) and another tool's deny-all program on one task cgroup (named
/// as the denier, owner unknown); a program that calls the kernel is said
/// to may deny.
#[test]
fn doctor_names_the_program_that_denies() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("doctordeny");
    let cfg = env.config(MAJORS);
    assert!(gpufence(&cfg, &["fence", "install"]).status.success());
    let n0 = env.mknod("nvidia0", 195, 0);
    let n1 = env.mknod("nvidia1", 195, 1);
    let job = env.cgroup("job_7");
    let task0 = env.cgroup("job_7/step_0/user/task_0");
    let task1 = env.cgroup("job_7/step_0/user/task_1");
    let task2 = env.cgroup("job_7/step_0/user/task_2");
    Fence::open(&env.bpffs)
        .unwrap()
        .grant(
            env.cg.id(&job).unwrap(),
            &job,
            7,
            &[
                (DevNum::new(195, 0), Access::RW),
                (DevNum::new(195, 1), Access::RW),
            ],
        )
        .unwrap();
    let at = |c: &str| std::fs::File::open(env.cg.path(c)).unwrap();
    let slurm = slurm_program(&[(195, 1)]);
    sys::prog_attach_cgroup_device(slurm.as_fd(), at(&job).as_fd(), sys::F_ALLOW_OVERRIDE).unwrap();
    let mut a = Asm::new();
    a.mov64_imm(Reg::R0, 0).exit();
    let deny_all = sys::prog_load_cgroup_device(&a.assemble().unwrap().insns, "deny_all").unwrap();
    sys::prog_attach_cgroup_device(deny_all.as_fd(), at(&task1).as_fd(), 0).unwrap();
    let mut a = Asm::new();
    a.call(gpufence_cgroup::asm::Helper::GetCurrentUidGid)
        .mov64_imm(Reg::R0, 1)
        .exit();
    let caller = sys::prog_load_cgroup_device(&a.assemble().unwrap().insns, "by_uid").unwrap();
    sys::prog_attach_cgroup_device(caller.as_fd(), at(&task2).as_fd(), 0).unwrap();

    let doctor = |task: &str| -> Value {
        let o = gpufence(&cfg, &["doctor", "--cgroup", task, "--json"]);
        let d: Value = serde_json::from_slice(&o.stdout).unwrap();
        // Exit 0 only when every device is allowed.
        let all_allowed = d["devices"]
            .as_array()
            .unwrap()
            .iter()
            .all(|v| v["verdict"] == "allowed");
        assert_eq!(
            o.status.code(),
            Some(if all_allowed { 0 } else { 1 }),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(!all_allowed, "each task here has a device it cannot open");
        d
    };
    let dev = |d: &Value, n: &str| -> Value {
        d["devices"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["device"] == n)
            .cloned()
            .unwrap_or_else(|| panic!("no {n}: {d}"))
    };
    // task_0: the fence and Slurm's program run; Slurm's denies 195:1.
    let d = doctor(&task0);
    assert_eq!(dev(&d, "195:0")["verdict"], "allowed", "{d}");
    let v1 = dev(&d, "195:1");
    assert_eq!(v1["verdict"], "denied", "{v1}");
    let why = v1["why"].as_str().unwrap();
    assert!(
        why.starts_with("denied by program") && why.contains("Slurm_Cgroup_v2"),
        "{why}"
    );
    assert!(why.contains(&format!("attached at /{job}")), "{why}");
    let slurm_answer = v1["programs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "Slurm_Cgroup_v2")
        .cloned()
        .unwrap();
    assert_eq!(slurm_answer["answer"], "denies");
    assert!(
        slurm_answer["owner"]
            .as_str()
            .unwrap()
            .starts_with("Slurm cgroup/v2"),
        "{slurm_answer}"
    );
    assert_eq!(env.open_from(&task0, &n0), "ENXIO");
    assert_eq!(env.open_from(&task0, &n1), "EPERM");
    // task_1: the deny-all program below the grant denies both.
    let d = doctor(&task1);
    for n in ["195:0", "195:1"] {
        let v = dev(&d, n);
        assert_eq!(v["verdict"], "denied", "{v}");
        assert!(
            v["why"]
                .as_str()
                .unwrap()
                .contains("\"deny_all\" (unknown)"),
            "{v}"
        );
    }
    assert_eq!(env.open_from(&task1, &n0), "EPERM");
    assert_eq!(env.open_from(&task1, &n1), "EPERM");
    // task_2: a program that calls the kernel may deny; it allows here.
    let d = doctor(&task2);
    let v0 = dev(&d, "195:0");
    assert_eq!(v0["verdict"], "may be denied", "{v0}");
    assert!(
        v0["why"].as_str().unwrap().contains("calls the kernel"),
        "{v0}"
    );
    assert_eq!(env.open_from(&task2, &n0), "ENXIO");
    // Text: the denier named on the device's line.
    let t = String::from_utf8_lossy(&gpufence(&cfg, &["doctor", "--cgroup", &task1]).stdout)
        .into_owned();
    assert!(
        t.contains("195:0    denied   denied by program") && t.contains("deny_all: denies"),
        "{t}"
    );
}

#[test]
fn exec_runs_admin_commands_exempt_and_audited() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("exec");
    let cfg = env.config(MAJORS);
    assert!(gpufence(&cfg, &["fence", "install"]).status.success());
    let n0 = env.mknod("nvidia0", 195, 0);
    let out = env.cgroup("outside");
    assert_eq!(env.open_from(&out, &n0), "EPERM");
    let o = gpufence(
        &cfg,
        &[
            "exec",
            "--",
            probe_bin().to_str().unwrap(),
            "open",
            n0.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        format!("{} ENXIO", n0.display())
    );
    let audit = std::fs::read_to_string(env.path("log/audit.jsonl")).unwrap();
    let evs: Vec<Value> = audit
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let start = evs.iter().find(|e| e["event"] == "exec_start").unwrap();
    assert_eq!(start["argv"][1], "open");
    assert!(start["who"].as_str().unwrap().contains("uid 0"), "{start}");
    assert!(start["cgroup"]
        .as_str()
        .unwrap()
        .starts_with(&format!("/{}/gpufence-exec/", env.root)));
    let end = evs.iter().find(|e| e["event"] == "exec_end").unwrap();
    assert_eq!(end["exit_code"], 0);
    // The command's exit code is passed on; per-run cgroups are removed.
    let o = gpufence(&cfg, &["exec", "--", "sh", "-c", "exit 7"]);
    assert_eq!(o.status.code(), Some(7));
    let left: Vec<_> = std::fs::read_dir(env.cg.path(&format!("{}/gpufence-exec", env.root)))
        .unwrap()
        .flatten()
        .filter(|e| e.file_type().unwrap().is_dir())
        .collect();
    assert!(left.is_empty(), "{left:?}");
    // A command that is not there: 127 as a shell says it, one line, and
    // the audit line has the same code.
    let o = gpufence(&cfg, &["exec", "--", "/nonexistent/nvidia-smi"]);
    assert_eq!(o.status.code(), Some(127), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.starts_with("gpufence: exec: cannot run /nonexistent/nvidia-smi:")
            && err.lines().count() == 1,
        "{err}"
    );
    let audit = std::fs::read_to_string(env.path("log/audit.jsonl")).unwrap();
    let end: Value = audit
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .rfind(|e| e["event"] == "exec_end")
        .unwrap();
    assert_eq!(end["exit_code"], 127, "{end}");
    assert!(
        end["error"].as_str().is_some_and(|e| !e.is_empty()),
        "{end}"
    );
    // Man pages: the directory is made; section 8, one page per
    // subcommand, and gpufence.toml(5).
    let man = env.path("man/all");
    let o = Command::new(workspace_bin("gpufence"))
        .arg("man")
        .arg(&man)
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    for page in [
        "gpufence.8",
        "gpufence-sweep.8",
        "gpufence-exec.8",
        "gpufence-fence-status.8",
        "gpufence.toml.5",
    ] {
        assert!(man.join(page).exists(), "{page}");
    }
    let status = std::fs::read_to_string(man.join("gpufence-fence-status.8")).unwrap();
    assert!(status.contains(".SH \"EXIT STATUS\""), "{status}");
    for b in ["gpufence-prolog", "gpufence-epilog"] {
        let d = env.path(&format!("man-{b}/man8"));
        let o = Command::new(workspace_bin(b))
            .arg("--generate-man")
            .arg(&d)
            .output()
            .unwrap();
        assert!(o.status.success(), "{b}: {o:?}");
        let page = std::fs::read_to_string(d.join(format!("{b}.8"))).unwrap();
        for section in ["EXIT STATUS", "FILES", "ENVIRONMENT", "SEE ALSO"] {
            assert!(page.contains(section), "{b}: {section}");
        }
    }
    // Not for users.
    let o = gpufence_tests::as_test_user(workspace_bin("gpufence"))
        .arg("--config")
        .arg(&cfg)
        .args(["exec", "--", "true"])
        .output()
        .unwrap();
    assert!(!o.status.success());
}

/// Without root, commands that read the maps say so (exit 2) instead of
/// reporting a missing fence; a closed pipe ends the CLI quietly (SIGPIPE),
/// not with a panic.
#[test]
fn the_cli_asks_for_root_and_survives_a_closed_pipe() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("cli-root");
    let cfg = env.config(MAJORS);
    assert!(gpufence(&cfg, &["fence", "install"]).status.success());
    for args in [
        &["fence", "status"][..],
        &["grants"],
        &["denials"],
        &["sweep"],
        &["exec", "--", "id"],
        &["respond", "1"],
    ] {
        let o = gpufence_tests::as_test_user(workspace_bin("gpufence"))
            .arg("--config")
            .arg(&cfg)
            .args(args)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{args:?}: {o:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("needs root"), "{args:?}: {err}");
        assert!(o.stdout.is_empty(), "{args:?}: nothing on stdout");
        let why = match args[0] {
            "exec" => "runs the command in the fence's exempt cgroup",
            "respond" => "freezes and kills processes",
            _ => "reads the fence's pinned maps",
        };
        assert!(err.contains(why), "{args:?}: {err}");
    }
    // The reader goes away before the CLI writes.
    let (r, w) = std::io::pipe().unwrap();
    drop(r);
    let o = Command::new(workspace_bin("gpufence"))
        .arg("--config")
        .arg(&cfg)
        .args(["fence", "status"])
        .stdout(w)
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&o.status),
        Some(libc::SIGPIPE),
        "{o:?}"
    );
    assert!(o.stderr.is_empty(), "no panic message: {o:?}");
    // With grants, `fence remove` wants --force.
    let job = env.cgroup("job_3");
    Fence::open(&env.bpffs)
        .unwrap()
        .grant(
            env.cg.id(&job).unwrap(),
            &job,
            3,
            &[(DevNum::new(195, 0), Access::RW)],
        )
        .unwrap();
    let o = gpufence(&cfg, &["fence", "remove"]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("(job 3)"),
        "{o:?}"
    );
    assert!(
        Fence::linked_prog_id(&env.bpffs).is_some(),
        "still attached"
    );
    assert!(gpufence(&cfg, &["fence", "remove", "--force"])
        .status
        .success());
    assert!(Fence::linked_prog_id(&env.bpffs).is_none());
}

/// The `--gpufence-report` writer runs as the job's user: the report
/// appears whole (a temporary file beside it, renamed), owned by the user,
/// 0600; it replaces an old report, never writes into a directory of that
/// name, cannot write where the user may not, and leaves no temporary file.
/// It runs in a fenced cgroup of its own (the Epilog's, slurmd's, is exempt,
/// and the user may ptrace their own process), enters the working
/// directory only after dropping root, and a writer the user stops is
/// killed after `WRITE_TIMEOUT` rather than holding the Epilog.
#[test]
fn reports_are_written_whole_and_as_the_user() {
    if !privileged() {
        return;
    }
    use gpufence_model::config::{Config, ConfigOrigin};
    use gpufence_node::job::report::{write_as_user, REPORT_CGROUP, WRITE_TIMEOUT};
    use gpufence_tests::cluster::{test_uid, TEST_USER};
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let env = TestEnv::new("report");
    let cfg = env.config(MAJORS);
    assert!(gpufence(&cfg, &["fence", "install"]).status.success());
    let node =
        gpufence_node::Node::new(Config::load(&cfg).unwrap(), ConfigOrigin::File(cfg.clone()))
            .unwrap();
    let uid = test_uid();
    let out = Command::new("id").args(["-g", TEST_USER]).output().unwrap();
    let gid: u32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    let d = tempfile::tempdir().unwrap();
    let mine = d.path().join("mine");
    std::fs::create_dir(&mine).unwrap();
    std::os::unix::fs::chown(&mine, Some(uid), Some(gid)).unwrap();
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let names = |dir: &std::path::Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    let write = |text: &str, path: &str, dir: &std::path::Path| {
        write_as_user(&node, 9, text, std::path::Path::new(path), dir, uid, gid)
    };
    let writer_cg = format!("{}/{REPORT_CGROUP}/job_9", env.root);

    let p = write("first report\n", "r.txt", &mine).unwrap();
    assert_eq!(p, mine.join("r.txt"));
    assert_eq!(std::fs::read_to_string(&p).unwrap(), "first report\n");
    let md = std::fs::metadata(&p).unwrap();
    assert_eq!((md.uid(), md.gid(), md.mode() & 0o777), (uid, gid, 0o600));
    // Replaced whole; no temporary file left. A reader polling meanwhile
    // sees the old report or the new one, never a part (4 MiB take many
    // pipe writes: `cat > r.txt` would show an empty or partial file).
    let big = "0123456789abcdef".repeat(256 * 1024);
    let done = std::sync::atomic::AtomicBool::new(false);
    let torn = std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let mut torn = Vec::new();
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(t) = std::fs::read_to_string(&p) {
                    if t != "first report\n" && t != big {
                        torn.push(t.len());
                    }
                }
            }
            torn
        });
        write(&big, "r.txt", &mine).unwrap();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        reader.join().unwrap()
    });
    assert!(
        torn.is_empty(),
        "{} reads of a partial report (lengths {:?}...)",
        torn.len(),
        &torn[..torn.len().min(5)]
    );
    assert_eq!(std::fs::read_to_string(&p).unwrap(), big);
    write("second\n", "r.txt", &mine).unwrap();
    assert_eq!(std::fs::read_to_string(&p).unwrap(), "second\n");
    assert_eq!(names(&mine), ["r.txt"]);
    // A directory of that name is not written into.
    std::fs::create_dir(mine.join("adir")).unwrap();
    std::os::unix::fs::chown(mine.join("adir"), Some(uid), Some(gid)).unwrap();
    assert!(write("x\n", "adir", &mine).is_err());
    assert!(names(&mine.join("adir")).is_empty());
    assert_eq!(names(&mine), ["adir", "r.txt"]);
    // Where the user may not write (root's 0755 directory): nothing.
    let e = write("x\n", "pwned", d.path()).unwrap_err().to_string();
    assert!(e.contains(&format!("uid {uid} cannot write")), "{e}");
    assert_eq!(names(d.path()), ["mine"]);
    // A working directory behind one the user cannot search (root's 0700)
    // is entered as the user, so not at all.
    let hidden = d.path().join("hidden");
    std::fs::create_dir(&hidden).unwrap();
    std::fs::set_permissions(&hidden, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::create_dir(hidden.join("open")).unwrap();
    std::fs::set_permissions(hidden.join("open"), std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = write("x\n", "r.txt", &hidden.join("open"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot start the report writer"), "{e}");
    assert!(names(&hidden.join("open")).is_empty());
    assert!(
        !env.cg.path(&writer_cg).exists(),
        "the writer's cgroup is removed"
    );

    // The user stops the writer: it is found in its own cgroup, where the
    // fence denies GPUs, and killed after WRITE_TIMEOUT; the call returns.
    let n0 = env.mknod("nvidia0", 195, 0);
    // The writer lives for as long as `cat` copies the report: 32 MiB make
    // that long enough to be seen most times; a writer that finished before
    // the test saw it is tried again under a new name (a busy CI machine
    // once let one finish unseen), never counted as caught.
    let slow = "0123456789abcdef".repeat(2 * 1024 * 1024);
    // A descriptor of ours without O_CLOEXEC (as libnvidia-ml may leave
    // one): not the writer's once it has exec'd.
    let marker = d.path().join("not-cloexec");
    std::fs::write(&marker, "x").unwrap();
    let c_marker = std::ffi::CString::new(marker.to_str().unwrap()).unwrap();
    // SAFETY: open(2) of a path we own, closed after the loop.
    let leaked = unsafe { libc::open(c_marker.as_ptr(), libc::O_RDONLY) };
    assert!(leaked >= 0);
    let me = std::fs::read_link("/proc/self/exe").unwrap();
    let mut inherited = Vec::new();
    let mut looked = 0;
    let mut caught = None;
    for attempt in 0..20 {
        let name = format!("stopped-{attempt}.txt");
        let t0 = std::time::Instant::now();
        let (r, seen) = std::thread::scope(|s| {
            let w = s.spawn(|| write(&slow, &name, &mine));
            let mut seen = None;
            while seen.is_none() && !w.is_finished() {
                let procs = std::fs::read_to_string(env.cg.path(&writer_cg).join("cgroup.procs"))
                    .unwrap_or_default();
                let Some(pid) = procs.lines().next().and_then(|l| l.parse::<i32>().ok()) else {
                    continue;
                };
                let real_uid = std::fs::read_to_string(format!("/proc/{pid}/status"))
                    .unwrap_or_default()
                    .lines()
                    .find_map(|l| l.strip_prefix("Uid:"))
                    .and_then(|v| v.split_whitespace().next()?.parse::<u32>().ok());
                // The user may stop it from the moment it has their uid, even
                // before it has exec'd (the parent then still waits in spawn).
                if real_uid != Some(uid) {
                    continue;
                }
                // SAFETY: kill(2) on the writer the test just found.
                unsafe { libc::kill(pid, libc::SIGSTOP) };
                // Exec'd (no longer this test's image): its descriptors.
                if std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|e| e != me) {
                    looked += 1;
                    inherited.extend(
                        std::fs::read_dir(format!("/proc/{pid}/fd"))
                            .into_iter()
                            .flatten()
                            .flatten()
                            .filter_map(|e| std::fs::read_link(e.path()).ok())
                            .filter(|l| *l == marker),
                    );
                }
                let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
                // Its cgroup is fenced: a process of the user there is denied.
                let opened = env.open_from(&writer_cg, &n0);
                seen = Some((pid, cg, opened));
            }
            (w.join().unwrap(), seen)
        });
        match (seen, r) {
            (Some(seen), Err(e)) => {
                caught = Some((name, t0, e, seen));
                break;
            }
            // Seen, but it exited before the stop reached it: not caught.
            (_, Ok(_)) => {}
            (None, Err(e)) => panic!("an unseen writer failed: {e}"),
        }
    }
    // SAFETY: our own descriptor.
    unsafe { libc::close(leaked) };
    assert!(
        inherited.is_empty(),
        "the writer inherited {inherited:?} ({looked} looked at)"
    );
    let (name, t0, e, (pid, cg, opened)) =
        caught.expect("the writer was never stopped in its cgroup as the user in 20 tries");
    assert!(cg.trim_end().ends_with(&format!("/{writer_cg}")), "{cg}");
    assert_eq!(
        opened, "EPERM",
        "the writer's cgroup is fenced and not exempt"
    );
    assert!(e.to_string().contains("did not finish"), "{e}");
    assert!(t0.elapsed() >= WRITE_TIMEOUT, "{:?}", t0.elapsed());
    assert!(gpufence_tests::gone(pid), "the stopped writer was killed");
    assert!(!env.cg.path(&writer_cg).exists(), "and its cgroup removed");
    assert!(!mine.join(&name).exists());

    // A tracer that never reaps the writer (its exit then waits for the
    // tracer, and so would a parent's wait): the call still returns at the
    // deadline. Tried again, as above, when the writer finished unseen.
    let mut caught = None;
    for attempt in 0..20 {
        let name = format!("traced-{attempt}.txt");
        let t0 = std::time::Instant::now();
        let mut tracer = None;
        let r = std::thread::scope(|s| {
            let w = s.spawn(|| write(&slow, &name, &mine));
            while tracer.is_none() && !w.is_finished() {
                let procs = std::fs::read_to_string(env.cg.path(&writer_cg).join("cgroup.procs"))
                    .unwrap_or_default();
                let Some(pid) = procs.lines().next().and_then(|l| l.parse::<i32>().ok()) else {
                    continue;
                };
                // SAFETY: kill(2) on the writer the test just found.
                unsafe { libc::kill(pid, libc::SIGSTOP) };
                let mut t = Command::new(probe_bin())
                    .args(["trace", &pid.to_string()])
                    .stdout(std::process::Stdio::piped())
                    .spawn()
                    .unwrap();
                let mut line = String::new();
                std::io::BufRead::read_line(
                    &mut std::io::BufReader::new(t.stdout.take().unwrap()),
                    &mut line,
                )
                .unwrap();
                // SAFETY: as above.
                unsafe { libc::kill(pid, libc::SIGCONT) };
                if line.trim() != "traced" {
                    // Gone between the read and the attach: not caught.
                    let _ = t.kill();
                    let _ = t.wait();
                    continue;
                }
                tracer = Some(t);
            }
            w.join().unwrap()
        });
        if let Some(t) = tracer {
            caught = Some((t0.elapsed(), t, r));
            break;
        }
        assert!(r.is_ok(), "an untraced writer finished: {r:?}");
    }
    let (took, mut tracer, r) = caught.expect("the writer was never seen in 20 tries");
    let _ = tracer.kill();
    let _ = tracer.wait();
    let e = r.unwrap_err().to_string();
    assert!(e.contains("did not finish"), "{e}");
    assert!(
        took < WRITE_TIMEOUT + std::time::Duration::from_secs(4),
        "{took:?}"
    );
}

/// `gpufence denials` and `gpufence grants` print columns that line up
/// whatever the widths (a 13-character user name, long cgroup paths), one
/// line per record.
#[test]
fn tables_line_up() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("tables");
    let cfg = env.config(MAJORS);
    assert!(gpufence(&cfg, &["fence", "install"]).status.success());
    let n0 = env.mknod("nvidia0", 195, 0);
    let out = env.cgroup("outside-with-a-rather-long-name");
    assert_eq!(env.open_from(&out, &n0), "EPERM");
    let o = env
        .user_command_in(&out, probe_bin())
        .arg("open")
        .arg(&n0)
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("EPERM"),
        "{o:?}"
    );
    let job = env.cgroup("job_7");
    Fence::open(&env.bpffs)
        .unwrap()
        .grant(
            env.cg.id(&job).unwrap(),
            &job,
            7,
            &[(DevNum::new(195, 0), Access::RW)],
        )
        .unwrap();
    for (args, header, col) in [
        (&["denials"][..], "count", "device"),
        (&["grants"][..], "job", "alive"),
    ] {
        let o = gpufence(&cfg, args);
        assert!(o.status.success(), "{o:?}");
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with(header), "{text}");
        let at = lines[0].find(col).unwrap();
        let rows = &lines[1..];
        assert!(!rows.is_empty(), "{text}");
        if args[0] == "denials" {
            assert_eq!(
                rows.len(),
                2,
                "root and {}: {text}",
                gpufence_tests::cluster::TEST_USER
            );
        }
        for r in rows {
            // The column starts where its header does, after two spaces.
            assert_eq!(&r[at - 2..at], "  ", "{args:?}:\n{text}");
            assert_ne!(&r[at..at + 1], " ", "{args:?}:\n{text}");
        }
    }
    // In JSON, cgroup paths are absolute, as in sweep's and the audit log.
    let json =
        |args: &[&str]| -> Value { serde_json::from_slice(&gpufence(&cfg, args).stdout).unwrap() };
    let d = json(&["denials", "--json"]);
    assert!(
        d.as_array()
            .unwrap()
            .iter()
            .all(|x| x["cgroup"] == format!("/{out}")),
        "{d}"
    );
}

/// A copy of `cfg` at `name` in the temp dir with `key` set to `value`
/// (a TOML value), for a second view of the same fence.
fn variant(
    env: &TestEnv,
    cfg: &std::path::Path,
    name: &str,
    key: &str,
    value: &str,
) -> std::path::PathBuf {
    let text = std::fs::read_to_string(cfg).unwrap();
    let mut out: Vec<String> = text
        .lines()
        .filter(|l| !l.starts_with(&format!("{key} =")))
        .map(String::from)
        .collect();
    out.insert(0, format!("{key} = {value}"));
    let p = env.path(name);
    std::fs::write(&p, out.join("\n") + "\n").unwrap();
    p
}

/// An exempt service restarted: systemd makes its cgroup anew, with a new
/// id. Until the exemptions are written again, `fence status` has a
/// `problem:` line and exits 1, and the sweep reports `exemption_missing`
/// (exit 1: an NHC failure); `gpufence fence watch` puts the new id into
/// the fence within a second, audited, and a process there opens a GPU.
#[test]
fn an_exempt_cgroup_made_anew_is_exempt_again_within_a_second() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("exempt-anew");
    let svc = format!("{}/persistenced", env.root);
    let cfg = env.config(&format!(
        "exempt_cgroups = [\"{svc}\"]\nnvml = false\n{MAJORS}"
    ));
    env.cgroup("persistenced");
    let gpu = env.mknod("nvidia0", 195, 0);
    assert!(gpufence(&cfg, &["fence", "install"]).status.success());
    let st = gpufence(&cfg, &["fence", "status"]);
    assert_eq!(st.status.code(), Some(0), "{st:?}");
    let fence = Fence::open(&env.bpffs).unwrap();
    let first = env.cg.id(&svc).unwrap();
    assert!(fence.is_exempt(first).unwrap());
    // The service restarts: its cgroup is removed and made again.
    let remake = |env: &TestEnv| {
        std::fs::remove_dir(env.cg.path(&svc)).unwrap();
        env.cg.create(&svc).unwrap();
        env.cg.id(&svc).unwrap()
    };
    let second = remake(&env);
    assert_ne!(first, second, "a new cgroup, a new id");
    assert!(!fence.is_exempt(second).unwrap());
    assert_eq!(
        env.probe_in(&svc, &["open", gpu.to_str().unwrap()]),
        [format!("{} EPERM", gpu.display())],
        "the restarted service is fenced"
    );
    let st = gpufence(&cfg, &["fence", "status"]);
    let text = String::from_utf8_lossy(&st.stdout);
    assert_eq!(st.status.code(), Some(1), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("problem: exempt cgroup /")
                && l.contains(&format!("/persistenced (id {second}) is not in the fence"))),
        "{text}"
    );
    let sw = gpufence(&cfg, &["sweep", "--json", "--cgroup", &env.root]);
    assert_eq!(sw.status.code(), Some(1), "{sw:?}");
    assert!(
        String::from_utf8_lossy(&sw.stdout)
            .lines()
            .any(|l| l.contains("\"exemption_missing\"") && l.contains(&second.to_string())),
        "{}",
        String::from_utf8_lossy(&sw.stdout)
    );
    // The watch: exempt again within a second of each restart.
    let mut watch = Command::new(workspace_bin("gpufence"))
        .arg("--config")
        .arg(&cfg)
        .args(["fence", "watch"])
        .spawn()
        .unwrap();
    let exempt_within = |id: u64| {
        let t0 = std::time::Instant::now();
        while t0.elapsed() < std::time::Duration::from_secs(1) {
            if fence.is_exempt(id).unwrap() {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        false
    };
    assert!(exempt_within(second), "the watch put back the exemption");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let third = remake(&env);
    assert!(exempt_within(third), "and again after the next restart");
    assert!(gpufence(&cfg, &["fence", "status"]).status.success());
    let open = |env: &TestEnv| env.probe_in(&svc, &["open", gpu.to_str().unwrap()]);
    assert_eq!(
        open(&env),
        [format!("{} ENXIO", gpu.display())],
        "exempt: allowed"
    );
    // SAFETY: signals our own child.
    unsafe { libc::kill(watch.id() as i32, libc::SIGTERM) };
    let code = watch.wait().unwrap();
    assert!(code.success(), "the watch ends on SIGTERM: {code:?}");
    let audit = gpufence_tests::audit_log(&env.path("log/audit.jsonl"));
    let applied: Vec<&Value> = audit
        .iter()
        .filter(|e| e["event"] == "exemption_applied")
        .collect();
    assert!(applied.len() >= 2, "{applied:?}");
    assert!(applied.iter().any(|e| e["exempt"][0]["cgroup_id"] == third));
}

/// Commands that could act on the wrong fence: a config whose
/// `cgroup_root` names another cgroup (or none) never removes the working
/// fence, and says where it is; where the fence's pins are not visible (a
/// private mount namespace with its own bpffs), `fence status` says the
/// fence is attached with its pins out of sight, and `fence install`
/// refuses to attach a second fence.
#[test]
fn a_wrong_config_never_acts_on_the_working_fence() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("wrong-root");
    let cfg = env.config(&format!("nvml = false\n{MAJORS}"));
    env.cgroup("elsewhere");
    assert!(gpufence(&cfg, &["fence", "install"]).status.success());
    let prog = Fence::linked_prog_id(&env.bpffs).expect("attached");
    // Another cgroup_root, the same pins.
    let other = variant(
        &env,
        &cfg,
        "other.toml",
        "cgroup_root",
        &format!("\"{}/elsewhere\"", env.root),
    );
    let o = gpufence(&other, &["fence", "remove", "--force"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(
        err.contains(&format!(
            "is attached at /{}, not at cgroup_root /{}/elsewhere",
            env.root, env.root
        )) && err.contains("not removed"),
        "{err}"
    );
    assert_eq!(
        Fence::linked_prog_id(&env.bpffs),
        Some(prog),
        "still attached"
    );
    // A cgroup_root that does not exist: said with the setting and the fix.
    let missing = variant(
        &env,
        &cfg,
        "missing.toml",
        "cgroup_root",
        "\"gpufence-no-such-cgroup\"",
    );
    let o = gpufence(&missing, &["fence", "install"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(
        err.contains("cgroup_root = \"gpufence-no-such-cgroup\" in ")
            && err.contains("does not exist")
            && err.contains("set cgroup_root to an existing cgroup2 directory"),
        "{err}"
    );
    let o = gpufence(&missing, &["fence", "status"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stdout)
        .contains("problem: cgroup_root = \"gpufence-no-such-cgroup\""));
    let o = gpufence(&missing, &["fence", "remove", "--force"]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert_eq!(
        Fence::linked_prog_id(&env.bpffs),
        Some(prog),
        "still attached"
    );
    // The pins hidden: a fresh bpffs mounted over them in a private mount
    // namespace, as a container or a unit with PrivateMounts= sees it.
    let hidden = |args: &str| {
        Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg(format!(
                "mount -t bpf bpf {} && {} --config {} {args}",
                env.bpffs.display(),
                workspace_bin("gpufence").display(),
                cfg.display()
            ))
            .output()
            .unwrap()
    };
    let o = hidden("fence status");
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(
        out.contains(&format!(
            "fence: ATTACHED (program {prog}), but its pins are not visible here"
        )),
        "{out}"
    );
    let o = hidden("fence install");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(err.contains("Not attaching a second one"), "{err}");
    let (_, progs) = gpufence_cgroup::fence::programs_at(&env.cg, &env.root).unwrap();
    assert_eq!(progs, vec![prog], "one fence program at the root");
    // The right config still removes it.
    assert!(gpufence(&cfg, &["fence", "remove", "--force"])
        .status
        .success());
    assert_eq!(Fence::linked_prog_id(&env.bpffs), None);
}

/// The Prolog and the Epilog say first, in one line, when they do not run
/// as root; the Prolog says at once when slurm.conf cannot be read (not
/// after `slurmd -G`'s minute of retries).
#[test]
fn prolog_and_epilog_say_why_at_once() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("why-at-once");
    let cfg = env.config(&format!("nvml = false\n{MAJORS}"));
    for bin in ["gpufence-prolog", "gpufence-epilog"] {
        let o = gpufence_tests::as_test_user(workspace_bin(bin))
            .args(["--config", cfg.to_str().unwrap()])
            .env("SLURM_JOB_ID", "7")
            .env(
                "SLURM_JOB_UID",
                gpufence_tests::cluster::test_uid().to_string(),
            )
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{bin}: {o:?}");
        assert_eq!(err.lines().count(), 1, "{bin}: one line: {err}");
        assert!(
            err.starts_with(&format!("{bin}: must run as root")),
            "{bin}: {err}"
        );
        // Run as the job's own user (what Slurm 24.11 before 24.11.6 does
        // at random under RunInJob), the line names that Slurm bug.
        assert!(
            err.contains("(the job's user: Slurm 24.11 before 24.11.6"),
            "{bin}: {err}"
        );
    }
    assert!(gpufence(&cfg, &["fence", "install"]).status.success());
    let o = Command::new(workspace_bin("gpufence-prolog"))
        .args(["--config", cfg.to_str().unwrap()])
        .env_clear()
        .env("SLURM_JOB_ID", "7")
        .env("SLURM_JOB_UID", "61000")
        .env("SLURM_JOB_GPUS", "0")
        .env("SLURM_CONF", env.path("no/slurm.conf"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    // gpufence's own line (slurmd -G, which retries for a minute, never ran).
    assert!(
        err.contains("cannot be read")
            && err.contains("SLURM_CONF")
            && !err.contains("slurmd -G` failed"),
        "{err}"
    );
}

/// `gpufence exec` of a command that leaves a process behind (`cmd &`):
/// the process is ended when the command returns, said on stderr and in an
/// `exec_leftover` audit line; its exempt leaf is removed. A leaf whose
/// gpufence command is gone (killed before it could clean up) with a
/// process in it is a `problem:` in `fence status` (exit 1) and an
/// `exec_leftover` finding in the sweep.
#[test]
fn exec_leaves_nothing_running_and_stale_leaves_are_reported() {
    if !privileged() {
        return;
    }
    let mut env = TestEnv::new("exec-left");
    let cfg = env.config(&format!("nvml = false\n{MAJORS}"));
    assert!(gpufence(&cfg, &["fence", "install"]).status.success());
    let marker = env.path("bg.pid");
    let o = gpufence(
        &cfg,
        &[
            "exec",
            "--",
            "sh",
            "-c",
            // Returns once the child runs `sleep` (not a forked `sh` yet).
            &format!(
                "sleep 1000 & echo $! > {}; until grep -qx sleep /proc/$!/comm; do :; done",
                marker.display()
            ),
        ],
    );
    assert!(o.status.success(), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("the command left 1 process(es) running in its exempt cgroup")
            && err.contains("sleep"),
        "{err}"
    );
    let bg: i32 = std::fs::read_to_string(&marker)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let t0 = std::time::Instant::now();
    while !gpufence_tests::gone(bg) && t0.elapsed() < std::time::Duration::from_secs(5) {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(gpufence_tests::gone(bg), "the background process was ended");
    let audit = gpufence_tests::audit_log(&env.path("log/audit.jsonl"));
    let left = audit
        .iter()
        .find(|e| e["event"] == "exec_leftover")
        .expect("exec_leftover");
    assert_eq!(left["processes"][0]["pid"], bg);
    assert_eq!(left["ended"], true);
    assert!(audit
        .iter()
        .any(|e| e["event"] == "exec_end" && e["left_running"] == 1));
    let exec = format!("{}/gpufence-exec", env.root);
    let leaves: Vec<_> = std::fs::read_dir(env.cg.path(&exec))
        .unwrap()
        .flatten()
        .filter(|e| e.file_type().unwrap().is_dir())
        .collect();
    assert!(leaves.is_empty(), "the leaf is removed: {leaves:?}");
    // A leaf left by a gpufence command that is gone (pid 2^22-1 is
    // nobody's here: pid_max is at most 2^22), with a process in it.
    let stale = format!("{exec}/4194303");
    env.cg.create(&stale).unwrap();
    let pid = env.spawn_sleeper(&stale);
    let st = gpufence(&cfg, &["fence", "status"]);
    let text = String::from_utf8_lossy(&st.stdout);
    assert_eq!(st.status.code(), Some(1), "{text}");
    assert!(
        text.contains(&format!(
            "problem: /{stale} holds 1 process(es) (pid {pid})"
        )),
        "{text}"
    );
    let sw = gpufence(&cfg, &["sweep", "--json", "--cgroup", &env.root]);
    assert!(
        String::from_utf8_lossy(&sw.stdout)
            .lines()
            .any(|l| l.contains("\"exec_leftover\"") && l.contains(&pid.to_string())),
        "{sw:?}"
    );
    env.cg.kill(&stale).unwrap();
}

/// Issue 25, as reported: with the fence's `grants` pin replaced by a
/// hash map of 64-byte values holding one entry, `gpufence fence status`
/// does not say "installed" (a `problem:` line with the layout and the
/// remedy, exit 1), and `gpufence grants` fails with that error instead
/// of printing a row decoded from bytes past its buffer (job 33686018).
#[test]
fn status_and_grants_refuse_a_grants_pin_of_another_layout() {
    if !privileged() {
        return;
    }
    use gpufence_cgroup::maps::{MAP_TYPE_HASH, PIN_GRANTS};
    let env = TestEnv::new("cli-repin");
    let cfg = env.config(MAJORS);
    assert!(gpufence(&cfg, &["fence", "install"]).status.success());
    let pin = env.bpffs.join(PIN_GRANTS);
    std::fs::remove_file(&pin).unwrap();
    let other = sys::map_create(MAP_TYPE_HASH, 16, 64, 16, "grants").unwrap();
    sys::map_update(&other, &[1; 16], &[2; 64]).unwrap();
    sys::obj_pin(other.as_fd(), &pin).unwrap();
    let found = format!(
        "pinned map {} has type 1 key 16 value 64 max_entries 16",
        pin.display()
    );

    let st = gpufence(&cfg, &["fence", "status"]);
    let text = String::from_utf8_lossy(&st.stdout);
    assert_eq!(st.status.code(), Some(1), "{text}");
    assert!(
        text.lines().any(|l| l.starts_with("problem: ")
            && l.contains(&found)
            && l.contains("gpufence fence remove")),
        "{text}"
    );
    eprintln!("{text}");

    let g = gpufence(&cfg, &["grants"]);
    let out = String::from_utf8_lossy(&g.stdout);
    let err = String::from_utf8_lossy(&g.stderr);
    assert!(!g.status.success(), "{out}{err}");
    assert!(!out.contains("33686018"), "{out}");
    assert!(err.contains(&found), "{err}");
    eprintln!("{err}");
}
