//! Helpers of gpufence's privileged tests: each test gets its own cgroup2
//! subtree, bpffs directory and temp dir, and removes them on drop. Nothing
//! is attached to a cgroup the test did not create.
//!
//! Prerequisites (root, cgroup2, bpf): in CI (`CI=true`) a missing one
//! fails the test loudly; elsewhere the test says why it skipped.

use std::ffi::CString;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub mod cluster;
pub mod out;
pub mod v2node;

use gpufence_cgroup::fence::Fence;
use gpufence_cgroup::Cgroup2;

/// Whether privileged tests can run here. In CI a missing prerequisite
/// panics; elsewhere it prints the reason and returns false.
pub fn privileged() -> bool {
    let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
    // SAFETY: geteuid has no preconditions.
    let why = if unsafe { libc::geteuid() } != 0 {
        Some("not root")
    } else if Cgroup2::discover().is_err() {
        Some("no cgroup2 mount")
    } else {
        None
    };
    match why {
        None => true,
        Some(w) if ci => panic!("privileged test prerequisite missing in CI: {w}"),
        Some(w) => {
            eprintln!("SKIPPED (outside CI): {w}");
            false
        }
    }
}

static SEQ: AtomicU32 = AtomicU32::new(0);

/// One test's private world.
pub struct TestEnv {
    /// The cgroup2 mount.
    pub cg: Cgroup2,
    /// This test's cgroup subtree, relative to the mount.
    pub root: String,
    /// This test's bpffs directory.
    pub bpffs: PathBuf,
    /// This test's temp dir (state, audit, evidence, device nodes).
    pub tmp: tempfile::TempDir,
    children: Vec<Child>,
}

impl TestEnv {
    /// Creates `gpufence-test-<pid>-<n>-<tag>` under the cgroup2 mount and a
    /// temp dir (mode 0755 so unprivileged users can reach device nodes).
    pub fn new(tag: &str) -> Self {
        let cg = Cgroup2::discover().expect("cgroup2");
        let name = format!(
            "gpufence-test-{}-{}-{tag}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::SeqCst)
        );
        cg.create(&name).expect("create test cgroup");
        let tmp = tempfile::Builder::new()
            .prefix("gpufence-test-")
            .tempdir()
            .expect("tempdir");
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod");
        TestEnv {
            cg,
            bpffs: PathBuf::from("/sys/fs/bpf").join(&name),
            root: name,
            tmp,
            children: Vec::new(),
        }
    }

    /// `<root>/<rel>`, created.
    pub fn cgroup(&self, rel: &str) -> String {
        let p = format!("{}/{}", self.root, rel.trim_matches('/'));
        self.cg.create(&p).expect("create cgroup");
        p
    }

    /// A path in the temp dir.
    pub fn path(&self, rel: &str) -> PathBuf {
        self.tmp.path().join(rel)
    }

    /// Writes a config for this env with `extra` TOML appended, returns its path.
    pub fn config(&self, extra: &str) -> PathBuf {
        self.config_rooted(&self.root, extra)
    }

    /// [`TestEnv::config`] with the fence at `cgroup_root` (relative to the
    /// mount) instead of this test's subtree: the real cgroup/v2 node's
    /// `system.slice`, which the test made and removes.
    pub fn config_rooted(&self, cgroup_root: &str, extra: &str) -> PathBuf {
        let p = self.path("gpufence.toml");
        // The test's own shared-memory directory (never the machine's
        // /dev/shm), writable by every job as /dev/shm is.
        let shm = self.path("shm");
        std::fs::create_dir_all(&shm).expect("mkdir shm");
        std::fs::set_permissions(&shm, std::fs::Permissions::from_mode(0o1777)).expect("chmod shm");
        let text = format!(
            "cgroup_root = \"{}\"\nbpffs_dir = \"{}\"\nstate_dir = \"{}\"\naudit_log = \"{}\"\nevidence_dir = \"{}\"\ndev_dir = \"{}\"\nshm_dir = \"{}\"\nkill_wait_ms = 3000\n{extra}\n",
            cgroup_root,
            self.bpffs.display(),
            self.path("state").display(),
            self.path("log/audit.jsonl").display(),
            self.path("evidence").display(),
            self.path("dev").display(),
            shm.display(),
        );
        std::fs::write(&p, text).expect("write config");
        p
    }

    /// `mknod <tmp>/dev/<name> c major minor`, mode 0666.
    pub fn mknod(&self, name: &str, major: u32, minor: u32) -> PathBuf {
        self.mknod_type(name, libc::S_IFCHR, major, minor)
    }

    /// `mknod` of a given type (`S_IFCHR` / `S_IFBLK`), mode 0666.
    pub fn mknod_type(&self, name: &str, kind: libc::mode_t, major: u32, minor: u32) -> PathBuf {
        let p = self.path("dev").join(name);
        std::fs::create_dir_all(p.parent().unwrap()).expect("mkdir dev");
        let _ = std::fs::remove_file(&p);
        let c = CString::new(p.to_str().unwrap()).unwrap();
        // SAFETY: mknod(2) with a NUL-terminated path.
        let r = unsafe { libc::mknod(c.as_ptr(), kind | 0o666, libc::makedev(major, minor)) };
        assert_eq!(
            r,
            0,
            "mknod {}: {}",
            p.display(),
            std::io::Error::last_os_error()
        );
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o666)).expect("chmod");
        p
    }

    /// A command that moves itself into cgroup `rel` (relative to the mount)
    /// between fork and exec, so it runs there from its first instruction.
    pub fn command_in(&self, rel: &str, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new(program);
        self.cg.join_at_exec(rel, &mut cmd).expect("cgroup path");
        cmd
    }

    /// Runs `gpufence-probe ARGS` in cgroup `rel` and returns its stdout lines.
    pub fn probe_in(&self, rel: &str, args: &[&str]) -> Vec<String> {
        let out = self
            .command_in(rel, probe_bin())
            .args(args)
            .output()
            .expect("run probe");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(String::from)
            .collect()
    }

    /// The verdict word of opening `path` from cgroup `rel` (`ENXIO`, `EPERM`, `ok`).
    pub fn open_from(&self, rel: &str, path: &Path) -> String {
        self.open_mode_from(rel, path, false)
    }

    /// Same, read-only when `ro`.
    pub fn open_mode_from(&self, rel: &str, path: &Path, ro: bool) -> String {
        let p = path.to_str().unwrap();
        let args: Vec<&str> = if ro {
            vec!["open", "--ro", p]
        } else {
            vec!["open", p]
        };
        let lines = self.probe_in(rel, &args);
        lines
            .first()
            .and_then(|l| l.rsplit(' ').next())
            .unwrap_or("no output")
            .to_string()
    }

    /// Starts `gpufence-probe ARGS` in cgroup `rel`, waits until it prints
    /// `ready` (a line), and keeps it for cleanup. Returns its pid.
    pub fn spawn_probe(&mut self, rel: &str, args: &[&str], ready: &str) -> i32 {
        let mut cmd = self.command_in(rel, probe_bin());
        cmd.args(args);
        self.spawn_ready(cmd, ready)
    }

    /// Starts `cmd`, waits until its first stdout line is `ready`, and keeps
    /// it for cleanup. Returns its pid.
    pub fn spawn_ready(&mut self, mut cmd: Command, ready: &str) -> i32 {
        let mut child = cmd.stdout(Stdio::piped()).spawn().expect("spawn");
        let pid = child.id() as i32;
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(out).lines();
            let first = lines.next().and_then(Result::ok).unwrap_or_default();
            let _ = tx.send(first);
            for _ in lines {}
        });
        let line = rx.recv_timeout(Duration::from_secs(10)).unwrap_or_default();
        self.children.push(child);
        assert_eq!(line, ready, "{cmd:?} said {line:?}");
        pid
    }

    /// `program` in cgroup `rel` from its first instruction, as the
    /// unprivileged test user ([`as_test_user`]).
    pub fn user_command_in(&self, rel: &str, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = self.command_in(rel, "setpriv");
        test_user_args(&mut cmd, program);
        cmd
    }

    /// Like [`TestEnv::spawn_probe`], as the unprivileged test user (via
    /// setpriv: no PAM, no cgroup move). Root and system accounts' processes
    /// are never killed by gpufence, so lingering processes in tests that
    /// must be killed run as this user.
    pub fn spawn_user_probe(&mut self, rel: &str, args: &[&str], ready: &str) -> i32 {
        let mut cmd = self.user_command_in(rel, probe_bin());
        cmd.args(args);
        self.spawn_ready(cmd, ready)
    }

    /// `sleep 1000` in cgroup `rel` as the unprivileged test user.
    pub fn spawn_user_sleeper(&mut self, rel: &str) -> i32 {
        let child = self
            .user_command_in(rel, "sleep")
            .arg("1000")
            .spawn()
            .expect("setpriv sleep");
        let pid = child.id() as i32;
        self.children.push(child);
        // setpriv execs sleep in place: same pid, wait until it is sleep.
        let t0 = Instant::now();
        while std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .map(|c| c.trim() != "sleep")
            .unwrap_or(true)
            && t0.elapsed() < Duration::from_secs(5)
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        pid
    }

    /// Starts `sleep 1000` in cgroup `rel` (a stand-in for slurmstepd).
    pub fn spawn_sleeper(&mut self, rel: &str) -> i32 {
        let child = self
            .command_in(rel, "sleep")
            .arg("1000")
            .spawn()
            .expect("sleep");
        let pid = child.id() as i32;
        self.children.push(child);
        pid
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = self.cg.kill(&self.root);
        let _ = Fence::remove(&self.bpffs);
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.cg.remove_tree(&self.root).is_err() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A cgroup v1 freezer cgroup of a test, `/sys/fs/cgroup/freezer/<root>`
/// (a hybrid host's), standing in for a process nothing can end: a task
/// the v1 freezer froze stays frozen whatever signal it gets, and a
/// `SIGKILL` stays pending until it is thawed (the legacy freezer,
/// `kernel/cgroup/legacy_freezer.c`; Linux's
/// `Documentation/admin-guide/cgroup-v1/freezer-subsystem.rst`). It is
/// frozen only when the test says so. On drop it is thawed, what is left
/// in it (the test's own processes, by pid) is killed, and it is removed,
/// so a failing test leaves no frozen process behind.
pub struct V1Freezer {
    /// Its directory.
    pub dir: PathBuf,
}

impl V1Freezer {
    /// Makes the freezer cgroup of `env` (panics where there is no v1
    /// freezer: such a test needs one).
    pub fn create(env: &TestEnv) -> V1Freezer {
        let dir = PathBuf::from(format!("/sys/fs/cgroup/freezer/{}", env.root));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (a cgroup v1 freezer simulates an unkillable process here)",
                dir.display()
            )
        });
        V1Freezer { dir }
    }

    /// Moves process `pid` into it.
    pub fn add(&self, pid: i32) {
        std::fs::write(self.dir.join("cgroup.procs"), pid.to_string())
            .unwrap_or_else(|e| panic!("pid {pid} into {}: {e}", self.dir.display()));
    }

    /// `FROZEN`, and waits (5 s at most) until the kernel says so.
    pub fn freeze(&self) {
        self.set("FROZEN");
    }

    /// `THAWED`, and waits (5 s at most) until the kernel says so.
    pub fn thaw(&self) {
        self.set("THAWED");
    }

    fn set(&self, state: &str) {
        let f = self.dir.join("freezer.state");
        std::fs::write(&f, state).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(5) {
            if std::fs::read_to_string(&f).is_ok_and(|s| s.trim() == state) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("{} never read {state}", f.display());
    }
}

impl Drop for V1Freezer {
    fn drop(&mut self) {
        let _ = std::fs::write(self.dir.join("freezer.state"), "THAWED");
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(5) {
            let left: Vec<i32> = std::fs::read_to_string(self.dir.join("cgroup.procs"))
                .unwrap_or_default()
                .lines()
                .filter_map(|l| l.trim().parse().ok())
                .collect();
            if left.is_empty() && std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            for pid in left {
                // SAFETY: kill(2) of a process the test put in its own
                // freezer cgroup.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A real device a test can hold open, standing in for a GPU a process
/// keeps using (a `mknod c 195 N` node can never be held: ENXIO).
///
/// The epilog and the prolog look for holders across the whole machine by
/// device number, so the stand-in must be a number that no other process
/// here holds, or the test would find (and kill) it. This claims one: the
/// first misc device of a list, least used first, that opens and that no
/// process holds, under an exclusive `flock` so that concurrent test runs on
/// one machine claim different ones. Released on drop.
pub struct HoldableDevice {
    /// Major (10, misc).
    pub major: u32,
    /// Minor.
    pub minor: u32,
    /// The driver's name.
    pub name: &'static str,
    _lock: std::fs::File,
}

impl HoldableDevice {
    /// Claims one, or panics naming what holds them all.
    pub fn claim() -> HoldableDevice {
        let candidates = [
            (234, "btrfs-control"),
            (237, "loop-control"),
            (256, "vga_arbiter"),
            (257, "userfaultfd"),
            (235, "autofs"),
            (200, "tun"),
            (229, "fuse"),
        ];
        let mut why = Vec::new();
        for (minor, name) in candidates {
            let lock_path = std::env::temp_dir().join(format!("gpufence-test-misc-{minor}.lock"));
            let Ok(f) = std::fs::File::create(&lock_path) else {
                continue;
            };
            if !gpufence_model::fsutil::lock_exclusive_within(&f, Duration::ZERO, Duration::ZERO)
                .unwrap_or(false)
            {
                why.push(format!("{name}: claimed by another test run"));
                continue;
            }
            let dev = gpufence_model::device::DevNum::new(10, minor);
            let holders = gpufence_node::holders::scan::holders(&[dev].into());
            if !holders.is_empty() {
                why.push(format!(
                    "{name}: held by pids {:?}",
                    holders.iter().map(|h| h.pid).collect::<Vec<_>>()
                ));
                continue;
            }
            let dir = tempfile::tempdir().expect("tempdir");
            let node = dir.path().join("n");
            let c = CString::new(node.to_str().unwrap()).unwrap();
            // SAFETY: mknod(2) with a NUL-terminated path.
            if unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o600, libc::makedev(10, minor)) }
                != 0
            {
                continue;
            }
            if std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&node)
                .is_err()
            {
                why.push(format!("{name}: does not open here"));
                continue;
            }
            return HoldableDevice {
                major: 10,
                minor,
                name,
                _lock: f,
            };
        }
        panic!("no misc device can stand in for a held GPU: {why:?}");
    }
}

/// A binary of this workspace: beside the running executable (a workspace
/// binary such as `gpufence-bench`), or next to the test executable's
/// `deps/` directory (cargo builds a package's binaries before its
/// integration tests).
pub fn workspace_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    // A binary of the workspace itself (the benchmarks) sits beside them.
    let beside = exe.parent().map(|d| d.join(name));
    if let Some(p) = beside.filter(|p| p.exists()) {
        return p;
    }
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} not built (cargo build --workspace first)",
        p.display()
    );
    p
}

/// The probe binary.
pub fn probe_bin() -> PathBuf {
    workspace_bin("gpufence-probe")
}

/// The live processes whose memory map (`/proc/<pid>/maps`) this
/// process cannot read: none on a node where the tests run as root with
/// every capability; in a sandbox whose init holds capabilities the
/// tests lack (ptrace's access check, `security/commoncap.c`
/// `cap_ptrace_access_check`), its init. The shared-memory leftovers
/// check counts each as maybe holding every file, and then removes none.
pub fn unreadable_pids() -> Vec<i32> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()))
        .filter(|p| std::fs::read_to_string(format!("/proc/{p}/maps")).is_err() && !gone(*p))
        .collect()
}

/// Whether process `pid` is gone or a zombie.
pub fn gone(pid: i32) -> bool {
    gpufence_model::procstat::ProcStat::of(pid).is_none_or(|s| s.state == 'Z')
}

/// The audit log's lines as JSON, read while writers may still append.
/// Appends are one `write(2)` each under `flock`, but a reader takes no
/// lock and a write becomes visible page by page, so the last line may be
/// a write in progress: without its newline, it is left out. Every whole
/// line must be JSON (panics naming it). A missing log is empty.
pub fn audit_log(path: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let whole = match text.rfind('\n') {
        Some(i) => &text[..=i],
        None => "",
    };
    parse_audit(path, whole)
}

/// [`audit_log`] once no writer runs: a last line without its newline is
/// then a torn line, and panics.
pub fn audit_log_settled(path: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        text.is_empty() || text.ends_with('\n'),
        "{}: the audit log ends in a torn line: {:?}",
        path.display(),
        text.lines().last()
    );
    parse_audit(path, &text)
}

fn parse_audit(path: &Path, text: &str) -> Vec<serde_json::Value> {
    text.lines()
        .enumerate()
        .map(|(n, l)| {
            serde_json::from_str(l).unwrap_or_else(|e| {
                panic!(
                    "{}: audit line {} is not whole JSON ({e}): {l:?}",
                    path.display(),
                    n + 1
                )
            })
        })
        .collect()
}

/// `program` run as the unprivileged test user ([`cluster::TEST_USER`])
/// through setpriv: no PAM, no session, no cgroup move (it stays in its
/// parent's cgroup), the environment kept.
pub fn as_test_user(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new("setpriv");
    test_user_args(&mut cmd, program);
    cmd
}

fn test_user_args(cmd: &mut Command, program: impl AsRef<std::ffi::OsStr>) {
    cmd.args([
        "--reuid",
        cluster::TEST_USER,
        "--regid",
        cluster::TEST_USER,
        "--init-groups",
        "--",
    ])
    .arg(program);
}

/// A job record as the Prolog writes it: job `job_id` of `uid`, granted
/// `dev` (file `path`) as GRES index 0, or nothing with `dev` `None`;
/// made now.
pub fn job_record(
    job_id: u32,
    uid: u32,
    dev: Option<(gpufence_model::device::DevNum, &Path)>,
) -> gpufence_model::record::JobRecord {
    use gpufence_model::device::{Access, DeviceGrant, DeviceRole};
    gpufence_model::record::JobRecord {
        version: gpufence_model::record::RECORD_VERSION,
        job_id,
        uid,
        gres_indices: dev.map_or_else(Vec::new, |_| vec![0]),
        devices: dev
            .map(|(dev, path)| DeviceGrant {
                path: path.to_path_buf(),
                dev,
                access: Access::RW,
                role: DeviceRole::Gres,
                gres_index: Some(0),
            })
            .into_iter()
            .collect(),
        created: gpufence_model::record::now_rfc3339(),
        notes: vec![],
        user_notes: vec![],
        gpu_idle: vec![],
        mig: vec![],
        cuda_visible_devices: vec![],
        saved_compute_modes: Vec::new(),
        job_map: Vec::new(),
        mps: Vec::new(),
    }
}

/// The plugin's grant step for `req` ([`gpufence_node::job::grant::grant_step`],
/// the node named `n1`, no `PrologFlags=RunInJob`): its outcome.
pub fn grant_step(
    node: &gpufence_node::Node,
    req: &gpufence_node::job::grant::StepRequest,
) -> Result<gpufence_node::job::grant::GrantOutcome, gpufence_node::NodeError> {
    gpufence_node::job::grant::grant_step(node, req, "n1", || false).outcome
}
