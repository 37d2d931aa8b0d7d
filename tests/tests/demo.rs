//! `contrib/demo.sh`, the README's first command, on a host whose
//! `system.slice` is busy, as on every systemd-booted machine: the
//! machine's services live there.
//!
//! The demo runs its Slurm node in a cgroup namespace rooted at a cgroup of
//! its own (`/gpufence-<name>/node`), so it needs, makes, fences and
//! signals nothing in the machine's `system.slice`; its clean-up (at the
//! end, from its trap, and for what an interrupted run left) kills the
//! processes of its own cgroup only, once it has proved that cgroup is the
//! one it made.
//!
//! How a systemd host is simulated here (no systemd runs on the CI
//! machine): where the cgroup2 root has no `system.slice`, the test makes
//! one and starts long-running processes of its own in it, each in a
//! service cgroup of its own: a plain `sleep`, and two named like Slurm's
//! daemons (`slurmd` in `system.slice/slurmd.service`, as a host with
//! Debian's slurmd package has it, and `slurmstepd`). They and the
//! slice's cgroups must come out of every run untouched: same processes,
//! same start times, not stopped, not frozen, in the same cgroups; no
//! cgroup made below `system.slice` and no device program attached to it
//! or to the root at any time (a watcher looks every 50 ms). On a machine
//! whose `system.slice` already holds processes (a real systemd host), the
//! test uses those instead and makes nothing there. `system.slice` at the
//! root is shared with the real cgroup/v2 node tests, so these tests hold
//! their lock ([`gpufence_tests::v2node::lock_node`]) while it exists.
//!
//! The demo runs for real (`bash contrib/demo.sh`) with
//! `GPUFENCE_DEMO_PREBUILT` (no `setup.sh`, no build: the workspace's
//! binaries), its own directory and its own ports.

use std::collections::BTreeSet;
use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpufence_cgroup::{sys, Cgroup2};
use gpufence_tests::{privileged, workspace_bin};

const SLICE: &str = "system.slice";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Field 22 of `/proc/<pid>/stat` (start time) and the state letter;
/// `None` when the process is gone.
fn stat_of(pid: i32) -> Option<(u64, char)> {
    gpufence_model::procstat::ProcStat::of(pid).map(|s| (s.starttime, s.state))
}

/// Every cgroup below `rel` (relative to the mount), `rel` included.
fn tree(cg: &Cgroup2, rel: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut stack = vec![rel.to_string()];
    while let Some(r) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(cg.path(&r)) else {
            continue;
        };
        out.insert(r.clone());
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(format!("{r}/{}", e.file_name().to_string_lossy()));
            }
        }
    }
    out
}

/// The device programs attached to cgroup `rel` itself (not inherited).
fn programs_at(cg: &Cgroup2, rel: &str) -> Option<Vec<u32>> {
    let dir = File::open(cg.path(rel)).ok()?;
    sys::prog_query_cgroup_device(dir.as_fd())
        .ok()
        .map(|(_, ids)| ids)
}

/// A process in `system.slice` that the demo did not start.
struct Bystander {
    pid: i32,
    start: u64,
    cgroup: String,
    what: String,
    child: Option<Child>,
}

/// `system.slice` at the cgroup2 root, busy as on a systemd host; while
/// it lives, the real cgroup/v2 node tests wait for it.
struct BusySlice {
    cg: Cgroup2,
    made: bool,
    bystanders: Vec<Bystander>,
    before: BTreeSet<String>,
    _links: tempfile::TempDir,
    _lock: File,
}

impl BusySlice {
    fn claim() -> BusySlice {
        let cg = Cgroup2::discover().expect("cgroup2");
        let lock = gpufence_tests::v2node::lock_node();
        let links = tempfile::tempdir().expect("tempdir");
        let mut made = false;
        let mut bystanders = Vec::new();
        if cg.path(SLICE).exists() && !cg.procs_recursive(SLICE).is_empty() {
            // A real systemd host: its services are the bystanders; those
            // that have run for a minute are expected to run on.
            let ticks = 100; // USER_HZ
            let uptime: f64 = std::fs::read_to_string("/proc/uptime")
                .ok()
                .and_then(|s| s.split_whitespace().next()?.parse().ok())
                .unwrap_or(0.0);
            for pid in cg.procs_recursive(SLICE) {
                let (Some((start, _)), Ok(cgroup)) = (stat_of(pid), cg.cgroup_of(pid)) else {
                    continue;
                };
                if uptime - start as f64 / ticks as f64 > 60.0 {
                    bystanders.push(Bystander {
                        pid,
                        start,
                        cgroup,
                        what: format!("a service of this host (pid {pid})"),
                        child: None,
                    });
                }
            }
        } else {
            // An empty one is what a killed test run left.
            cg.remove_tree(SLICE)
                .expect("remove a stale, empty system.slice");
            made = true;
            for (service, name) in [
                ("gpufence-test-bystander.service", "sleep"),
                ("slurmd.service", "slurmd"),
                ("gpufence-test-lookalike.service", "slurmstepd"),
            ] {
                let rel = format!("{SLICE}/{service}");
                cg.create(&rel).expect("create a service cgroup");
                let exe = links.path().join(name);
                std::os::unix::fs::symlink("/bin/sleep", &exe).expect("symlink");
                let mut cmd = Command::new(&exe);
                cmd.arg("100000")
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null());
                cg.join_at_exec(&rel, &mut cmd).expect("join");
                // SAFETY: prctl is async-signal-safe; the bystander dies
                // with the test rather than outlive it in system.slice.
                unsafe {
                    cmd.pre_exec(|| {
                        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                        Ok(())
                    });
                }
                let child = cmd.spawn().expect("start a bystander");
                let pid = child.id() as i32;
                let start = stat_of(pid).expect("bystander started").0;
                bystanders.push(Bystander {
                    pid,
                    start,
                    cgroup: rel,
                    what: format!("{name} in /{SLICE}/{service}"),
                    child: Some(child),
                });
            }
        }
        let before = tree(&cg, SLICE);
        BusySlice {
            cg,
            made,
            bystanders,
            before,
            _links: links,
            _lock: lock,
        }
    }

    /// The bystanders' pids.
    fn pids(&self) -> Vec<i32> {
        self.bystanders.iter().map(|b| b.pid).collect()
    }

    /// Every bystander runs on as it was, and `system.slice` holds the
    /// same cgroups as before.
    fn assert_untouched(&mut self, when: &str) {
        for b in &mut self.bystanders {
            let st = stat_of(b.pid);
            assert!(
                st.is_some_and(|(start, _)| start == b.start),
                "{when}: {} is gone (pid {})",
                b.what,
                b.pid
            );
            let state = st.map(|s| s.1).unwrap_or('?');
            assert!(
                !matches!(state, 'T' | 't' | 'Z' | 'X'),
                "{when}: {} is in state {state}",
                b.what
            );
            if let Some(c) = b.child.as_mut() {
                assert!(
                    matches!(c.try_wait(), Ok(None)),
                    "{when}: {} exited",
                    b.what
                );
            }
            assert_eq!(
                self.cg.cgroup_of(b.pid).ok().as_deref(),
                Some(b.cgroup.as_str()),
                "{when}: {} moved",
                b.what
            );
            let events =
                std::fs::read_to_string(self.cg.path(&b.cgroup).join("cgroup.events")).unwrap();
            assert!(
                events.lines().any(|l| l == "frozen 0"),
                "{when}: /{} is frozen: {events}",
                b.cgroup
            );
        }
        if self.made {
            assert_eq!(
                tree(&self.cg, SLICE),
                self.before,
                "{when}: the cgroups under /{SLICE} changed"
            );
        }
    }
}

impl Drop for BusySlice {
    fn drop(&mut self) {
        for b in &mut self.bystanders {
            if let Some(mut c) = b.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        if self.made {
            let deadline = Instant::now() + Duration::from_secs(10);
            while self.cg.remove_tree(SLICE).is_err() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// What the watcher saw while the demo ran.
#[derive(Default)]
struct Seen {
    /// Cgroups that appeared below `system.slice`.
    new_in_slice: BTreeSet<String>,
    /// Device programs attached to the root or to `system.slice` that were
    /// not there before, as `cgroup: ids`.
    programs: BTreeSet<String>,
    /// slurmd was seen in the demo's own node cgroup.
    slurmd_in_demo_cgroup: bool,
}

/// Looks at `system.slice`, the root's programs and the demo's cgroup
/// every 50 ms until stopped.
struct Watcher {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Seen>>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Watcher {
    fn start(slice: &BusySlice, demo: &Demo) -> Watcher {
        let cg = slice.cg.clone();
        let before = tree(&cg, SLICE);
        let progs_before = [("", programs_at(&cg, "")), (SLICE, programs_at(&cg, SLICE))];
        let slurmd_cg = format!("{}/node/{SLICE}/slurmd.service", demo.cgroup);
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (stop2, seen2) = (stop.clone(), seen.clone());
        let handle = std::thread::spawn(move || {
            while !stop2.load(Ordering::SeqCst) {
                let now = tree(&cg, SLICE);
                let populated = std::fs::read_to_string(cg.path(&slurmd_cg).join("cgroup.procs"))
                    .is_ok_and(|t| !t.trim().is_empty());
                let mut s = seen2.lock().unwrap();
                s.new_in_slice.extend(now.difference(&before).cloned());
                s.slurmd_in_demo_cgroup |= populated;
                for (rel, was) in &progs_before {
                    let is = programs_at(&cg, rel);
                    if is != *was {
                        s.programs
                            .insert(format!("/{rel}: {is:?} (before: {was:?})"));
                    }
                }
                drop(s);
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        Watcher {
            stop,
            seen,
            handle: Some(handle),
        }
    }

    /// Stops watching; panics with what it saw that it must not have.
    fn assert_clean(mut self, slice: &BusySlice) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.handle.take() {
            h.join().unwrap();
        }
        let s = self.seen.lock().unwrap();
        if slice.made {
            assert!(
                s.new_in_slice.is_empty(),
                "cgroups made below /{SLICE} while the demo ran: {:?}",
                s.new_in_slice
            );
        }
        assert!(
            s.programs.is_empty(),
            "device programs attached at the root or at /{SLICE} while the demo ran: {:?}",
            s.programs
        );
        assert!(
            s.slurmd_in_demo_cgroup,
            "slurmd never ran in the demo's own cgroup"
        );
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// One demo: its directory, cgroup and ports.
struct Demo {
    dir: PathBuf,
    /// Its cgroup, relative to the mount (`gpufence-<dir name>`).
    cgroup: String,
    bpffs: PathBuf,
    port_base: u16,
    logs: tempfile::TempDir,
    runs: u32,
}

/// A finished (or killed) run: its exit status and output.
struct Run {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

impl Run {
    fn both(&self) -> String {
        format!("{}\n--- stderr ---\n{}", self.stdout, self.stderr)
    }
}

impl Demo {
    fn new(tag: &str, port_base: u16) -> Demo {
        let name = format!("demotest-{}-{tag}", std::process::id());
        Demo {
            dir: PathBuf::from(format!("/tmp/gpufence-{name}")),
            cgroup: format!("gpufence-{name}"),
            bpffs: PathBuf::from(format!("/sys/fs/bpf/gpufence-{name}")),
            port_base,
            logs: tempfile::tempdir().expect("tempdir"),
            runs: 0,
        }
    }

    /// Starts `bash contrib/demo.sh ARGS`; output goes to files (a run
    /// killed midway leaves processes that would hold a pipe open).
    fn spawn(&mut self, args: &[&str]) -> (Child, PathBuf, PathBuf) {
        self.runs += 1;
        let out = self.logs.path().join(format!("run{}.out", self.runs));
        let err = self.logs.path().join(format!("run{}.err", self.runs));
        let prebuilt = workspace_bin("gpufence")
            .parent()
            .expect("target dir")
            .to_path_buf();
        let child = Command::new("bash")
            .arg(repo().join("contrib/demo.sh"))
            .args(args)
            .env("GPUFENCE_DEMO_DIR", &self.dir)
            .env("GPUFENCE_CLUSTER_PORT_BASE", self.port_base.to_string())
            .env("GPUFENCE_DEMO_PREBUILT", prebuilt)
            .env_remove("SLURM_CONF")
            .env_remove("GPUFENCE_CONFIG")
            .stdin(Stdio::null())
            .stdout(File::create(&out).unwrap())
            .stderr(File::create(&err).unwrap())
            .spawn()
            .expect("run demo.sh");
        (child, out, err)
    }

    /// Runs `bash contrib/demo.sh ARGS` to its end (at most `limit`).
    fn run(&mut self, args: &[&str], limit: Duration) -> Run {
        let (mut child, out, err) = self.spawn(args);
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break st;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let st = child.wait().unwrap();
                panic!(
                    "demo.sh {args:?} ran past {limit:?} ({st}):\n{}",
                    read(&out) + &read(&err)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        Run {
            status,
            stdout: read(&out),
            stderr: read(&err),
        }
    }

    /// Waits until the run's output holds `what` (at most `limit`), then
    /// sends `signal` to the demo's bash alone, as `kill` or the OOM
    /// killer would, and waits for it to exit.
    fn interrupt(&mut self, what: &str, signal: i32, limit: Duration) -> Run {
        self.interrupt_when(what, &|| true, signal, limit)
    }

    /// [`Demo::interrupt`], once `ready()` holds too (after `what`).
    fn interrupt_when(
        &mut self,
        what: &str,
        ready: &dyn Fn() -> bool,
        signal: i32,
        limit: Duration,
    ) -> Run {
        let (mut child, out, err) = self.spawn(&[]);
        let deadline = Instant::now() + limit;
        loop {
            if let Some(st) = child.try_wait().unwrap() {
                panic!(
                    "demo.sh ended ({st}) before printing {what:?}:\n{}",
                    read(&out) + &read(&err)
                );
            }
            if read(&out).contains(what) && ready() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "demo.sh did not print {what:?} within {limit:?}:\n{}",
                read(&out) + &read(&err)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        // SAFETY: kill(2) on the bash this test started and has not reaped.
        assert_eq!(unsafe { libc::kill(child.id() as i32, signal) }, 0);
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break st;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("demo.sh did not end on signal {signal}");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        Run {
            status,
            stdout: read(&out),
            stderr: read(&err),
        }
    }

    /// The demo's processes still running in its cgroup.
    fn procs(&self, cg: &Cgroup2) -> Vec<i32> {
        cg.procs_recursive(&self.cgroup)
    }

    /// Nothing of the demo is left: no cgroup, no pins, no process with
    /// its cluster's mark (`contrib/cluster.sh` gives its daemons one) but
    /// those of `not_its` (the bystanders), its ports free; `dir_too`: no
    /// directory either.
    fn assert_gone(&self, cg: &Cgroup2, not_its: &[i32], dir_too: bool) {
        assert!(
            !cg.path(&self.cgroup).exists(),
            "/{} is left, with processes {:?}",
            self.cgroup,
            self.procs(cg)
        );
        assert!(!self.bpffs.exists(), "{} is left", self.bpffs.display());
        if dir_too {
            assert!(!self.dir.exists(), "{} is left", self.dir.display());
        }
        let mark = format!("GPUFENCE_CLUSTER_DIR={}/cluster", self.dir.display());
        let mut marked = Vec::new();
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let Ok(env) = std::fs::read(e.path().join("environ")) else {
                continue;
            };
            if !not_its.contains(&pid) && env.split(|b| *b == 0).any(|v| v == mark.as_bytes()) {
                let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
                marked.push((pid, comm.trim().to_string()));
            }
        }
        assert!(
            marked.is_empty(),
            "the demo's processes are left: {marked:?}"
        );
        for p in [self.port_base, self.port_base + 1] {
            assert!(
                std::net::TcpStream::connect(("127.0.0.1", p)).is_err(),
                "port {p} still answers"
            );
        }
    }
}

impl Drop for Demo {
    /// A test that failed midway: what the demo left goes the demo's own
    /// way (`--stop`, which proves the cgroup is its own first).
    fn drop(&mut self) {
        let cg_left = Cgroup2::discover().is_ok_and(|cg| cg.path(&self.cgroup).exists());
        if self.dir.exists() || cg_left {
            let _ = Command::new("bash")
                .arg(repo().join("contrib/demo.sh"))
                .arg("--stop")
                .env("GPUFENCE_DEMO_DIR", &self.dir)
                .output();
        }
    }
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

/// The side-by-side table: the lines from "Side by side" to the third row.
fn table(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let Some(i) = lines.iter().position(|l| l.starts_with("Side by side")) else {
        return Vec::new();
    };
    lines[i..(i + 6).min(lines.len())]
        .iter()
        .map(|l| l.trim_end().to_string())
        .collect()
}

/// The demo on a host whose `system.slice` is busy: it runs to its end,
/// prints the README's table word for word, and leaves the slice, its
/// processes and the root's programs as they were; nothing of the demo is
/// left afterwards.
#[test]
fn demo_runs_beside_a_busy_system_slice() {
    if !privileged() {
        return;
    }
    let mut demo = Demo::new("busy", 17857);
    let mut slice = BusySlice::claim();
    let watcher = Watcher::start(&slice, &demo);
    let t0 = Instant::now();
    let run = demo.run(&[], Duration::from_secs(240));
    println!("demo.sh took {:?}:\n{}", t0.elapsed(), run.both());
    assert!(
        run.status.success(),
        "demo.sh failed ({}):\n{}",
        run.status,
        run.both()
    );
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let want = table(&readme);
    assert_eq!(want.len(), 6, "no side-by-side table in README.md");
    assert_eq!(
        table(&run.stdout),
        want,
        "the demo's table is not README's:\n{}",
        run.stdout
    );
    watcher.assert_clean(&slice);
    slice.assert_untouched("after the demo");
    demo.assert_gone(&slice.cg, &slice.pids(), true);
}

/// A demo killed midway (SIGKILL: no trap runs), with the marker an older
/// demo.sh left: `--stop` stops what that run started, all of it in the
/// demo's own cgroup, and touches nothing in the busy `system.slice`, not
/// even processes named like Slurm's daemons. Then a run stopped
/// with SIGTERM: its trap does the same.
#[test]
fn an_interrupted_demo_is_cleaned_up_touching_nothing_it_did_not_start() {
    if !privileged() {
        return;
    }
    let mut demo = Demo::new("interrupted", 17867);
    let mut slice = BusySlice::claim();
    let watcher = Watcher::start(&slice, &demo);

    // Killed while jobs run on the fenced node.
    let killed = demo.interrupt("== 5.", libc::SIGKILL, Duration::from_secs(180));
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&killed.status),
        Some(libc::SIGKILL)
    );
    let left = demo.procs(&slice.cg);
    assert!(
        !left.is_empty(),
        "the killed run left nothing running to clean up:\n{}",
        killed.both()
    );
    assert!(demo.bpffs.exists(), "the killed run left no fence");
    slice.assert_untouched("after the kill");
    // What an older demo.sh left behind, and made its next run kill every
    // process in system.slice.
    std::fs::write(demo.dir.join("made-system-slice"), "").unwrap();

    let stop = demo.run(&["--stop"], Duration::from_secs(60));
    println!("--stop after SIGKILL:\n{}", stop.both());
    assert!(stop.status.success(), "--stop failed:\n{}", stop.both());
    assert!(
        stop.stdout
            .contains("stopping what an earlier run of this demo left"),
        "{}",
        stop.both()
    );
    assert!(
        stop.stderr.contains("ignoring") && stop.stderr.contains("made-system-slice"),
        "{}",
        stop.both()
    );
    for pid in &left {
        assert!(
            gpufence_tests::gone(*pid),
            "pid {pid} of the killed run is left"
        );
    }
    demo.assert_gone(&slice.cg, &slice.pids(), true);
    slice.assert_untouched("after --stop");

    // Stopped with SIGTERM (as Ctrl-C or `kill` would) while its node
    // starts: the trap stops everything it started and keeps the logs.
    // (Once its cluster has a log directory: the header is printed before
    // the cluster starts, and a run stopped before that has no logs to
    // keep.)
    let logs = demo.dir.join("cluster/log");
    let termed = demo.interrupt_when(
        "== 3.",
        &|| logs.exists(),
        libc::SIGTERM,
        Duration::from_secs(120),
    );
    println!("SIGTERM:\n{}", termed.both());
    assert_eq!(termed.status.code(), Some(143), "{}", termed.both());
    assert!(
        termed.stderr.contains("everything it started is gone"),
        "{}",
        termed.both()
    );
    demo.assert_gone(&slice.cg, &slice.pids(), false);
    assert!(demo.dir.join("cluster/log").exists(), "the logs went too");
    let stop = demo.run(&["--stop"], Duration::from_secs(60));
    assert!(stop.status.success(), "--stop failed:\n{}", stop.both());
    demo.assert_gone(&slice.cg, &slice.pids(), true);

    watcher.assert_clean(&slice);
    slice.assert_untouched("at the end");
}

/// A cgroup of the demo's name that the demo cannot prove it made (no
/// record, or a record of another cgroup, or of a run still going) is
/// left alone with its processes, by a run and by `--stop`; a port in use
/// stops the demo before anything is installed or started.
#[test]
fn demo_leaves_alone_what_it_cannot_prove_is_its_own() {
    if !privileged() {
        return;
    }
    let cg = Cgroup2::discover().expect("cgroup2");
    let mut demo = Demo::new("foreign", 17877);
    cg.create(&demo.cgroup).unwrap();
    let mut cmd = Command::new("sleep");
    cmd.arg("100000");
    cg.join_at_exec(&demo.cgroup, &mut cmd).unwrap();
    let mut other = cmd.spawn().unwrap();
    let pid = other.id() as i32;
    let start = stat_of(pid).unwrap().0;
    let ino = std::fs::metadata(cg.path(&demo.cgroup))
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .unwrap();
    let (pid1_start, _) = stat_of(1).unwrap();
    let records = [
        None,
        // Another cgroup's inode (the root's).
        Some("1 999999 1\n".to_string()),
        // Its inode, but made by a run that still goes (pid 1 stands in).
        Some(format!("{ino} 1 {pid1_start}\n")),
    ];
    for record in &records {
        std::fs::create_dir_all(&demo.dir).unwrap();
        if let Some(r) = record {
            std::fs::write(demo.dir.join("owner"), r).unwrap();
        }
        for args in [&[][..], &["--stop"][..]] {
            let run = demo.run(args, Duration::from_secs(60));
            assert_eq!(
                run.status.code(),
                Some(1),
                "{record:?} {args:?}:\n{}",
                run.both()
            );
            assert!(
                run.stderr.contains("is left alone")
                    || run.stderr.contains("another run of this demo"),
                "{record:?} {args:?}:\n{}",
                run.both()
            );
            assert!(!run.stdout.contains("== 1."), "{}", run.both());
            assert_eq!(
                stat_of(pid).map(|s| s.0),
                Some(start),
                "{record:?} {args:?}: the process in /{} is gone",
                demo.cgroup
            );
            assert!(matches!(other.try_wait(), Ok(None)));
            assert_eq!(cg.cgroup_of(pid).unwrap(), demo.cgroup);
        }
    }
    let _ = other.kill();
    let _ = other.wait();
    cg.remove_tree(&demo.cgroup).unwrap();
    std::fs::remove_dir_all(&demo.dir).unwrap();

    // A port in use: one line saying so, before anything is installed.
    let busy = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
    let port = busy.local_addr().unwrap().port();
    demo.port_base = port - 1;
    let run = demo.run(&[], Duration::from_secs(60));
    assert_eq!(run.status.code(), Some(1), "{}", run.both());
    assert!(
        run.stderr
            .contains(&format!("port {port} on 127.0.0.1 is in use")),
        "{}",
        run.both()
    );
    assert!(
        run.stderr.contains("nothing was installed or started"),
        "{}",
        run.both()
    );
    assert!(!run.stdout.contains("== 1."), "{}", run.both());
    assert!(!cg.path(&demo.cgroup).exists());
    assert!(!demo.dir.exists());
}
