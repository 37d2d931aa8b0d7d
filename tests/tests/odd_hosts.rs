//! Old kernels, odd hosts and program limits (issue 8, items 5 and 6): each
//! fault gives one clear line naming the fix, and leaves the GPUs closed
//! rather than open.
//!
//! Observable, as everywhere: a `mknod`-made node opens with ENXIO when the
//! device cgroup allowed it and EPERM when the fence denied it. "Closed"
//! means: the prolog or the plugin refused, so the job holds no grant (its
//! cgroup gets EPERM), or a fence installed earlier keeps denying.
//!
//! Faults are made inside the test's own world only: a private mount
//! namespace (cgroup v1 only), mounts under the test's temp dir (no bpffs,
//! read-only state dir, full disk), unmounted when the test ends; foreign
//! programs on the test's own cgroup subtree.

use std::ffi::CString;
use std::os::fd::AsFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use gpufence_cgroup::asm::{Asm, Reg};
use gpufence_cgroup::fence::{programs_at, Fence, FORCE_NO_HELPER_ENV};
use gpufence_cgroup::sys;
use gpufence_model::config::{Config, ConfigOrigin};
use gpufence_model::device::{Access, DevNum};
use gpufence_node::job::grant::{self, GrantOutcome, StepFate, StepRequest};
use gpufence_node::{host::fence_ops, Node, NodeError};
use gpufence_tests::cluster::test_uid;
use gpufence_tests::{privileged, workspace_bin, TestEnv};

/// 195 stands for the GPUs, 241 for nvidia-uvm (unused majors here).
const MAJORS: &str = "[majors]\nnvidia = 195\nnvidia-uvm = 241\n";

/// A mount made by this test under its temp dir; lazily unmounted on drop.
struct Mount(PathBuf);

impl Mount {
    /// `mount -t FSTYPE -o OPTS none TARGET` (TARGET is created).
    fn new(fstype: &str, opts: &str, target: &Path) -> Mount {
        std::fs::create_dir_all(target).unwrap();
        let t = CString::new(target.to_str().unwrap()).unwrap();
        let f = CString::new(fstype).unwrap();
        let o = CString::new(opts).unwrap();
        // SAFETY: mount(2) with NUL-terminated strings we own.
        let r = unsafe { libc::mount(f.as_ptr(), t.as_ptr(), f.as_ptr(), 0, o.as_ptr().cast()) };
        assert_eq!(
            r,
            0,
            "mount -t {fstype} -o {opts} {}: {}",
            target.display(),
            std::io::Error::last_os_error()
        );
        Mount(target.to_path_buf())
    }

    /// Remounts it read-only.
    fn make_read_only(&self) {
        let t = CString::new(self.0.to_str().unwrap()).unwrap();
        // SAFETY: mount(2) remount with NUL-terminated strings we own.
        let r = unsafe {
            libc::mount(
                std::ptr::null(),
                t.as_ptr(),
                std::ptr::null(),
                libc::MS_REMOUNT | libc::MS_RDONLY,
                std::ptr::null(),
            )
        };
        assert_eq!(r, 0, "remount ro: {}", std::io::Error::last_os_error());
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let t = CString::new(self.0.to_str().unwrap()).unwrap();
        // SAFETY: umount2(2) of a mount this test made.
        unsafe { libc::umount2(t.as_ptr(), libc::MNT_DETACH) };
    }
}

/// A tiny tmpfs at `dir`, filled to the last byte: the next write fails
/// with ENOSPC (no file on it has a partly used page to append into).
fn full_tmpfs(dir: &Path) -> Mount {
    let m = Mount::new("tmpfs", "size=64k,mode=0755", dir);
    let mut f = std::fs::File::create(dir.join("filler")).unwrap();
    let block = [0u8; 4096];
    loop {
        if let Err(e) = std::io::Write::write_all(&mut f, &block) {
            assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
            break;
        }
    }
    let _ = f.sync_all();
    m
}

fn node_of(cfg: &Path) -> Node {
    Node::new(
        Config::load(cfg).expect("config"),
        ConfigOrigin::File(cfg.to_path_buf()),
    )
    .expect("node")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The one non-empty line of `text`; panics when there are more or none.
fn one_line(text: &str) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "exactly one line expected:\n{text}");
    lines[0].to_string()
}

/// `gpufence --config CFG ARGS` with extra environment.
fn gpufence(cfg: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(workspace_bin("gpufence"))
        .arg("--config")
        .arg(cfg)
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("gpufence")
}

/// `gpufence-prolog` (or `-epilog`) as slurmd runs it: a clean environment
/// with the variables slurmd sets for job `job` of the test user holding
/// GRES index 0.
fn slurm_script(bin: &str, cfg: &Path, job: u32) -> Command {
    let mut c = Command::new(workspace_bin(bin));
    c.env_clear()
        .arg("--config")
        .arg(cfg)
        .env("SLURM_JOB_ID", job.to_string())
        .env("SLURM_JOB_UID", test_uid().to_string())
        .env("SLURM_JOB_GID", test_uid().to_string())
        .env("SLURM_JOB_GPUS", "0");
    c
}

/// A config for `env` whose GRES list is a fixture: index 0 is `nvidia0`
/// (195:0), index 1 `nvidia1` (195:1), made here. `extra` is appended
/// before `[majors]`.
fn gpu_config(env: &TestEnv, extra: &str) -> PathBuf {
    let n0 = env.mknod("nvidia0", 195, 0);
    let n1 = env.mknod("nvidia1", 195, 1);
    let g = env.path("slurmd-G.txt");
    std::fs::write(
        &g,
        format!(
            "slurmd: Gres Name=gpu Type=(null) Count=1 Index=0 ID=7696487 File={} (null)\n\
             slurmd: Gres Name=gpu Type=(null) Count=1 Index=1 ID=7696487 File={} (null)\n",
            n0.display(),
            n1.display()
        ),
    )
    .unwrap();
    env.config(&format!(
        "layout = \"own\"\nnvml = false\nslurmd_gres = \"{}\"\n{extra}\n{MAJORS}",
        g.display()
    ))
}

/// What the plugin's step did for a job.
struct Step {
    /// The job cgroup.
    cgroup: String,
    /// The slurmstepd stand-in's request.
    req: StepRequest,
    /// The first half (placement).
    placed: Result<grant::Placement, NodeError>,
    /// The second half (grant).
    granted: Result<GrantOutcome, NodeError>,
}

/// The plugin's step for `job` in the `own` layout, with a sleeper of the
/// test's own as the slurmstepd stand-in (never a pid the test did not
/// start: placing moves it into the job cgroup).
fn plugin_step(env: &mut TestEnv, node: &Node, job: u32) -> Step {
    let outside = env.cgroup("stepd-start");
    let stepd = env.spawn_sleeper(&outside);
    let req = StepRequest {
        job_id: job,
        step_id: 0,
        uid: test_uid(),
        stepd_pid: stepd,
    };
    let placed = grant::place(node, &req);
    let cgroup = placed
        .as_ref()
        .expect("placed (the fence is up)")
        .job_cgroup
        .clone();
    let granted = grant::grant_placed(node, &req, placed.as_ref().unwrap());
    Step {
        cgroup,
        req,
        placed,
        granted,
    }
}

fn grants_of(env: &TestEnv, job: u32) -> usize {
    Fence::open(&env.bpffs)
        .unwrap()
        .entries()
        .unwrap()
        .iter()
        .filter(|e| e.job_id == job)
        .count()
}

/// No `bpf_get_current_ancestor_cgroup_id` for device programs (kernels
/// before 6.1), forced with the test-only switch: `fence install` refuses
/// with one line naming the requirement, installs nothing, and a fence
/// installed before (the host ran a newer kernel's gpufence... or the
/// switch is set for a reinstall only) stays attached and keeps denying
/// with its grants. The prolog on a fence-less node refuses the job.
#[test]
fn no_ancestor_helper_refuses_to_install_and_keeps_the_old_fence() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("nohelper");
    let cfg = gpu_config(&env, "");
    let force = [(FORCE_NO_HELPER_ENV, "1")];
    let o = gpufence(&cfg, &["fence", "install"], &force);
    assert!(!o.status.success());
    let line = one_line(&stderr(&o));
    assert!(
        line.starts_with("gpufence: ")
            && line.contains("bpf_get_current_ancestor_cgroup_id")
            && line.contains("Linux 6.1")
            && line.contains("NOT installed"),
        "{line}"
    );
    let (_, progs) = programs_at(&env.cg, &env.root).unwrap();
    assert!(progs.is_empty(), "nothing attached: {progs:?}");
    // Without a fence no job starts: the prolog fails (Slurm drains).
    let o = slurm_script("gpufence-prolog", &cfg, 31)
        .env(FORCE_NO_HELPER_ENV, "1")
        .output()
        .unwrap();
    assert!(!o.status.success());
    let line = one_line(&stderr(&o));
    assert!(
        line.contains("fence is not installed") && line.contains("gpufence fence install"),
        "{line}"
    );
    assert!(!env.path("state/jobs/31.json").exists(), "no record");

    // A fence installed before: a reinstall without the helper fails and
    // leaves it in place, still denying, grants kept.
    let o = gpufence(&cfg, &["fence", "install"], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let job = env.cgroup("job_5");
    let outside = env.cgroup("outside");
    let fence = Fence::open(&env.bpffs).unwrap();
    fence
        .grant(
            env.cg.id(&job).unwrap(),
            &job,
            5,
            &[(DevNum::new(195, 0), Access::RW)],
        )
        .unwrap();
    let before = Fence::linked_prog_id(&env.bpffs);
    let o = gpufence(&cfg, &["fence", "install"], &force);
    assert!(!o.status.success());
    assert!(one_line(&stderr(&o)).contains("Linux 6.1"));
    assert_eq!(
        Fence::linked_prog_id(&env.bpffs),
        before,
        "old program kept"
    );
    let n0 = env.path("dev/nvidia0");
    assert_eq!(
        env.open_from(&outside, &n0),
        "EPERM",
        "outsider still denied"
    );
    assert_eq!(env.open_from(&job, &n0), "ENXIO", "the grant survived");
}

/// A cgroup v1-only host: the cgroup2 mount is not in mountinfo (a private
/// mount namespace where it is unmounted). `fence install`, the prolog and
/// the epilog each fail with one line naming the fix; the prolog writes no
/// record, so no step of the job can be granted anything.
#[test]
fn cgroup_v1_only_host_fails_with_the_fix() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("v1only");
    let cfg = gpu_config(&env, "");
    let mount = CString::new(env.cg.mount().to_str().unwrap()).unwrap();
    // Runs `cmd` in a private mount namespace without the cgroup2 mount.
    let without_cgroup2 = |mut cmd: Command| -> Output {
        let m = mount.clone();
        // SAFETY: unshare, mount and umount2 are async-signal-safe
        // syscalls; the namespace is this child's alone.
        unsafe {
            cmd.pre_exec(move || {
                if libc::unshare(libc::CLONE_NEWNS) != 0
                    || libc::mount(
                        c"none".as_ptr(),
                        c"/".as_ptr(),
                        std::ptr::null(),
                        libc::MS_REC | libc::MS_PRIVATE,
                        std::ptr::null(),
                    ) != 0
                    || libc::umount2(m.as_ptr(), libc::MNT_DETACH) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd.output().expect("run without cgroup2")
    };
    // The namespace really lacks it (a test that cannot fail is a defect).
    let o = without_cgroup2({
        let mut c = Command::new("grep");
        c.args(["-c", " - cgroup2 ", "/proc/self/mountinfo"]);
        c
    });
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "0");
    let fix =
        |line: &str| line.contains("no cgroup2 filesystem") && line.contains("mount -t cgroup2");
    let mut install = Command::new(workspace_bin("gpufence"));
    install.arg("--config").arg(&cfg).args(["fence", "install"]);
    let o = without_cgroup2(install);
    assert!(!o.status.success());
    let line = one_line(&stderr(&o));
    assert!(line.starts_with("gpufence: ") && fix(&line), "{line}");
    for bin in ["gpufence-prolog", "gpufence-epilog"] {
        let o = without_cgroup2(slurm_script(bin, &cfg, 41));
        assert!(!o.status.success(), "{bin} must fail");
        let line = one_line(&stderr(&o));
        assert!(
            line.starts_with(&format!("{bin}: ")) && fix(&line),
            "{line}"
        );
    }
    assert!(!env.path("state/jobs/41.json").exists(), "no record");
    // The host itself still has its cgroup2 mount.
    assert!(gpufence_cgroup::Cgroup2::discover().is_ok());
}

/// No usable bpffs: `bpffs_dir` on an ordinary filesystem (the test's temp
/// dir), and on a read-only bpffs mounted there. Each install fails with
/// one line naming the fix and attaches nothing; the prolog then refuses.
#[test]
fn no_bpffs_refuses_with_the_fix() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("nobpffs");
    let plain = env.path("not-bpffs/gpufence");
    let ro_mount = env.path("bpf-ro");
    let ro_dir = ro_mount.join("gpufence");
    let m = Mount::new("bpf", "mode=0700", &ro_mount);
    std::fs::create_dir(&ro_dir).unwrap();
    m.make_read_only();
    let base = gpu_config(&env, "");
    let text = std::fs::read_to_string(&base).unwrap();
    for (name, dir, why) in [
        ("plain", &plain, "is not bpffs"),
        ("read-only", &ro_dir, "Read-only file system"),
    ] {
        let cfg = env.path(&format!("{name}.toml"));
        std::fs::write(
            &cfg,
            text.replace(
                &format!("bpffs_dir = \"{}\"", env.bpffs.display()),
                &format!("bpffs_dir = \"{}\"", dir.display()),
            ),
        )
        .unwrap();
        assert!(std::fs::read_to_string(&cfg)
            .unwrap()
            .contains(dir.to_str().unwrap()));
        let o = gpufence(&cfg, &["fence", "install"], &[]);
        assert!(!o.status.success(), "{name}");
        let line = one_line(&stderr(&o));
        assert!(
            line.contains(why)
                && line.contains("mount -t bpf bpf /sys/fs/bpf")
                && line.contains("NOT installed"),
            "{name}: {line}"
        );
        let (_, progs) = programs_at(&env.cg, &env.root).unwrap();
        assert!(progs.is_empty(), "{name}: nothing attached: {progs:?}");
        let o = slurm_script("gpufence-prolog", &cfg, 51).output().unwrap();
        assert!(!o.status.success(), "{name}: prolog");
        assert!(
            one_line(&stderr(&o)).contains("fence is not installed"),
            "{name}: {}",
            stderr(&o)
        );
    }
    assert!(
        std::fs::read_dir(&ro_dir).unwrap().next().is_none(),
        "nothing pinned on the read-only bpffs"
    );
    drop(m);
}

/// A read-only `state_dir`: the prolog cannot record the job and fails
/// with one line naming state_dir and the fix (no record, so no step is
/// granted); the plugin's grant step cannot note its grant and grants
/// nothing (the step runs without GPUs and the user reads why); the epilog
/// still revokes a live grant, and fails so that Slurm drains the node.
#[test]
fn read_only_state_dir_fails_closed() {
    if !privileged() {
        return;
    }
    let mut env = TestEnv::new("rostate");
    let cfg = gpu_config(&env, "");
    let node = node_of(&cfg);
    fence_ops::install(&node).expect("install");
    let n0 = env.path("dev/nvidia0");
    let state = Mount::new("tmpfs", "size=1m,mode=0700", &env.path("state"));

    // Job 61 is recorded while the state dir is writable, granted, and
    // then the state dir turns read-only.
    let o = slurm_script("gpufence-prolog", &cfg, 61).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let s61 = plugin_step(&mut env, &node, 61);
    let job61 = s61.cgroup.clone();
    assert!(
        matches!(s61.granted, Ok(GrantOutcome::Granted { .. })),
        "{:?}",
        s61.granted
    );
    assert_eq!(env.open_from(&job61, &n0), "ENXIO");
    // Job 62 is recorded too, and gets its step only after.
    let o = slurm_script("gpufence-prolog", &cfg, 62).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    state.make_read_only();

    // Prolog of job 63: refused, one line, no record.
    let o = slurm_script("gpufence-prolog", &cfg, 63).output().unwrap();
    assert!(!o.status.success());
    let line = one_line(&stderr(&o));
    assert!(
        line.starts_with("gpufence-prolog: job 63: ")
            && line.contains("Read-only file system")
            && line.contains("state_dir"),
        "{line}"
    );
    assert!(!env.path("state/jobs/63.json").exists());

    // The plugin for job 62: no grant, the user's line says why.
    let s62 = plugin_step(&mut env, &node, 62);
    assert!(
        s62.granted.is_err(),
        "no grant without its note in state_dir"
    );
    assert_eq!(grants_of(&env, 62), 0);
    assert_eq!(
        env.open_from(&s62.cgroup, &n0),
        "EPERM",
        "job 62 has no GPU"
    );
    let v = grant::step_fate(
        &node,
        &s62.req,
        "n1",
        &s62.placed,
        Some(&s62.granted),
        false,
    );
    match v {
        StepFate::RunWithoutGpus(l) => {
            assert!(
                l.contains("state_dir") && l.contains("without GPU access"),
                "{l}"
            )
        }
        other => panic!("{other:?}"),
    }

    // The epilog of job 61 revokes even though it cannot forget the record.
    let o = slurm_script("gpufence-epilog", &cfg, 61).output().unwrap();
    assert_eq!(grants_of(&env, 61), 0, "revoked: {}", stderr(&o));
    assert!(!env.cg.path(&job61).exists(), "its cgroup went with it");
    assert!(!o.status.success(), "the node is not clean: drain");
    assert!(
        stderr(&o).contains("Read-only file system"),
        "{}",
        stderr(&o)
    );
    drop(state);
}

/// A full disk under the audit log. Decision (SECURITY.md): no grant
/// without its audit line, so the prolog and the plugin refuse (the prolog
/// removes the record it wrote; the plugin grants nothing) with one line
/// naming the fix; the epilog revokes anyway (revoking only closes) and
/// fails, so Slurm drains the node until an admin frees the disk.
#[test]
fn full_audit_log_fails_closed() {
    if !privileged() {
        return;
    }
    let mut env = TestEnv::new("fullaudit");
    let cfg = gpu_config(&env, "");
    let node = node_of(&cfg);
    fence_ops::install(&node).expect("install");
    let n0 = env.path("dev/nvidia0");
    let log_dir = env.path("log");
    for job in [71, 72] {
        let o = slurm_script("gpufence-prolog", &cfg, job).output().unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let s71 = plugin_step(&mut env, &node, 71);
    let job71 = s71.cgroup.clone();
    assert!(
        matches!(s71.granted, Ok(GrantOutcome::Granted { .. })),
        "{:?}",
        s71.granted
    );

    let full = full_tmpfs(&log_dir);
    // The prolog of job 73: refused, no record.
    let o = slurm_script("gpufence-prolog", &cfg, 73).output().unwrap();
    assert!(!o.status.success());
    let line = one_line(&stderr(&o));
    assert!(
        line.contains("No space left on device") && line.contains("fix the audit log"),
        "{line}"
    );
    assert!(!env.path("state/jobs/73.json").exists(), "record removed");
    // The plugin for job 72: no grant.
    let s72 = plugin_step(&mut env, &node, 72);
    assert!(
        matches!(s72.granted, Err(NodeError::Audit(_))),
        "no grant without its audit line: {:?}",
        s72.granted
    );
    assert_eq!(grants_of(&env, 72), 0);
    assert_eq!(env.open_from(&s72.cgroup, &n0), "EPERM");
    match grant::step_fate(
        &node,
        &s72.req,
        "n1",
        &s72.placed,
        Some(&s72.granted),
        false,
    ) {
        StepFate::RunWithoutGpus(l) => {
            assert!(
                l.contains("fix the audit log") && l.contains("without GPU access"),
                "{l}"
            )
        }
        other => panic!("{other:?}"),
    }
    // The epilog of job 71: revoked, and a failure (drain).
    let o = slurm_script("gpufence-epilog", &cfg, 71).output().unwrap();
    assert_eq!(grants_of(&env, 71), 0, "revoked: {}", stderr(&o));
    assert!(!env.cg.path(&job71).exists(), "its cgroup went with it");
    assert!(!o.status.success(), "the node is not clean: drain");
    assert!(
        stderr(&o).contains("No space left on device"),
        "{}",
        stderr(&o)
    );
    drop(full);
    // Space again: the next job is recorded and audited as usual.
    let o = slurm_script("gpufence-prolog", &cfg, 74).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
}

/// An allow-all device program, loaded (one per call: the kernel refuses
/// the same program twice on one cgroup).
fn foreign_program() -> std::os::fd::OwnedFd {
    let mut a = Asm::new();
    a.mov64_imm(Reg::R0, 1).exit();
    sys::prog_load_cgroup_device(&a.assemble().unwrap().insns, "foreign").expect("load")
}

/// Attaches `n` allow-all programs (MULTI, as systemd and runc do) at `dir`.
fn attach_foreign(dir: &std::fs::File, n: usize) {
    for i in 0..n {
        let p = foreign_program();
        sys::prog_attach_cgroup_device(p.as_fd(), dir.as_fd(), sys::F_ALLOW_MULTI)
            .unwrap_or_else(|e| panic!("foreign program {i}: {e}"));
    }
}

/// A cgroup that already holds 63 programs of someone else: the fence
/// installs as the 64th (the kernel's limit, `BPF_CGROUP_MAX_PROGS`), is
/// ANDed with them (their allow-all does not open anything), and can be
/// reinstalled (the link swaps its program in place, no new slot); the
/// kernel refuses a 65th from anyone.
#[test]
fn the_fence_installs_as_the_64th_program() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("limit63");
    let node = node_of(&env.config(MAJORS));
    let n0 = env.mknod("nvidia0", 195, 0);
    let outside = env.cgroup("outside");
    let root = std::fs::File::open(env.cg.path(&env.root)).unwrap();
    attach_foreign(&root, 63);
    assert_eq!(env.open_from(&outside, &n0), "ENXIO", "allow-all only");
    fence_ops::install(&node).expect("install as the 64th");
    assert_eq!(programs_at(&env.cg, &env.root).unwrap().1.len(), 64);
    assert_eq!(env.open_from(&outside, &n0), "EPERM");
    let r = fence_ops::install(&node).expect("reinstall at the limit");
    assert!(r.replaced_program);
    assert_eq!(programs_at(&env.cg, &env.root).unwrap().1.len(), 64);
    let p = foreign_program();
    let e = sys::prog_attach_cgroup_device(p.as_fd(), root.as_fd(), sys::F_ALLOW_MULTI)
        .expect_err("a 65th");
    assert_eq!(e.raw_os_error(), Some(libc::E2BIG), "{e}");
    assert_eq!(env.open_from(&outside, &n0), "EPERM");
}

/// With 64 foreign programs there is no room: the install fails with one
/// line that says so, counts them and names the fix; nothing is attached.
#[test]
fn a_full_cgroup_says_why_the_fence_cannot_attach() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("limit64");
    let cfg = env.config(MAJORS);
    let root = std::fs::File::open(env.cg.path(&env.root)).unwrap();
    attach_foreign(&root, 64);
    let o = gpufence(&cfg, &["fence", "install"], &[]);
    assert!(!o.status.success());
    let line = one_line(&stderr(&o));
    assert!(
        line.contains("already holds 64 device programs")
            && line.contains("BPF_CGROUP_MAX_PROGS")
            && line.contains("bpftool cgroup show")
            && line.contains("NOT installed"),
        "{line}"
    );
    assert_eq!(Fence::linked_prog_id(&env.bpffs), None);
    let st = Fence::status(&env.cg, &env.root, &env.bpffs);
    assert!(!st.installed, "{st:?}");
    // Nothing of the try is left: no map, no iterator, no link pinned
    // (the maps are freed with them).
    let left: Vec<_> = std::fs::read_dir(&env.bpffs)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.file_name())).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "pins left by a failed install: {left:?}");
    // And one `error` audit line says why.
    let errors: Vec<serde_json::Value> =
        gpufence_tests::audit_log_settled(&env.path("log/audit.jsonl"))
            .into_iter()
            .filter(|e| e["event"] == "error")
            .collect();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0]["component"], "fence install");
    let reason = errors[0]["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("already holds 64 device programs"),
        "{reason}"
    );
    // A later install that succeeds (room made) starts clean and works.
    for id in programs_at(&env.cg, &env.root).unwrap().1 {
        let p = sys::prog_fd_by_id(id).unwrap();
        sys::prog_detach_cgroup_device(p.as_fd(), root.as_fd()).unwrap();
    }
    let o = gpufence(&cfg, &["fence", "install"], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(Fence::status(&env.cg, &env.root, &env.bpffs).installed);
}

/// Another tool detaches everything it can from the cgroup (query, then
/// `BPF_PROG_DETACH` each program by id) and tries to attach its own with
/// other flags: the foreign programs go, the fence's link stays attached,
/// the grant still opens and the outsider is still denied.
#[test]
fn a_tool_that_detaches_everything_leaves_the_link() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("detachall");
    let node = node_of(&env.config(MAJORS));
    let n0 = env.mknod("nvidia0", 195, 0);
    let outside = env.cgroup("outside");
    let job = env.cgroup("job_9");
    let root = std::fs::File::open(env.cg.path(&env.root)).unwrap();
    attach_foreign(&root, 3);
    fence_ops::install(&node).expect("install");
    let ours = Fence::linked_prog_id(&env.bpffs).expect("linked");
    Fence::open(&env.bpffs)
        .unwrap()
        .grant(
            env.cg.id(&job).unwrap(),
            &job,
            9,
            &[(DevNum::new(195, 0), Access::RW)],
        )
        .unwrap();
    let (_, ids) = programs_at(&env.cg, &env.root).unwrap();
    assert_eq!(ids.len(), 4);
    let mut detached = Vec::new();
    for id in ids {
        let fd = sys::prog_fd_by_id(id).expect("prog by id");
        match sys::prog_detach_cgroup_device(fd.as_fd(), root.as_fd()) {
            Ok(()) => detached.push(id),
            Err(e) => assert_eq!(id, ours, "only ours resists: {id}: {e}"),
        }
    }
    assert_eq!(detached.len(), 3, "the three foreign ones went");
    assert!(!detached.contains(&ours));
    for flags in [0, sys::F_ALLOW_OVERRIDE] {
        let p = foreign_program();
        let e = sys::prog_attach_cgroup_device(p.as_fd(), root.as_fd(), flags)
            .expect_err("flags other than MULTI beside a MULTI link");
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "flags {flags}: {e}");
    }
    assert_eq!(programs_at(&env.cg, &env.root).unwrap().1, vec![ours]);
    assert!(fence_ops::status(&node).installed);
    assert_eq!(env.open_from(&outside, &n0), "EPERM");
    assert_eq!(env.open_from(&job, &n0), "ENXIO");
}
