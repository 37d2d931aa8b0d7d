//! The job path on real cgroup/v2 Slurm nodes (`gpufence_tests::v2node`:
//! Slurm's own cgroup/v2 plugin, `proctrack/cgroup`, `task/cgroup`,
//! `ConstrainDevices=yes`, `PrologFlags=Alloc,Contain`, gpufence's default
//! `layout = "slurm"`), one node per Slurm release: the host's 22.05 and
//! the Debian roots' releases (`contrib/v2node/make-root.sh`), each with 8
//! mknod-made GPUs in gres.conf and 16 CPUs declared, so that up to 8
//! one-GPU jobs run at once.
//!
//! Three configurations per release, side by side in one run:
//!
//! - **Slurm alone**: Slurm's cgroup/v2 plugin and nothing else (no
//!   Prolog, no Epilog, no SPANK plugin): a node of its own, started first
//!   (only one real cgroup/v2 node fits on a machine at a time);
//! - **empty scripts**: a Prolog and an Epilog that run an empty program
//!   (`/bin/true`), no plugin: what a site that already runs a Prolog pays;
//! - **gpufence**: its plugin, Prolog and Epilog.
//!
//! The last two share one node and alternate run by run (the order flips
//! each round): between runs the Prolog/Epilog scripts and plugstack.conf
//! are rewritten (slurmd runs the script by path for each job; each
//! slurmstepd reads plugstack.conf when it starts), so drift of the machine
//! lands on both.
//!
//! Measured:
//! - `srun --gres=gpu:1 true` wall time, as the unprivileged test user,
//!   each run from an idle node;
//! - the Prolog and the Epilog as slurmd runs them: each script execs
//!   `gpufence-bench time-exec FILE -- PROGRAM`, which appends the
//!   program's wall time (fork, exec, run, exit): `gpufence-prolog` /
//!   `gpufence-epilog` against `/bin/true`;
//! - a burst: a job array of N one-GPU `true` jobs, submit until `squeue`
//!   lists none (Epilogs included), and with gpufence whether the audit log
//!   holds each job's `grant_recorded` and `grant_revoked` exactly once;
//! - the step slurmstepd's VmRSS with and without the plugin, and the
//!   pinned maps' locked memory.
//!
//! Binaries come from this one's directory (`cargo build --release
//! --workspace`); a root's plugin from `target/v2node/<suite>.gpufence.so`
//! (`PROFILE=release contrib/v2node/build-plugin.sh`).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use gpufence_tests::cluster::{Cluster, ClusterSpec};
use gpufence_tests::v2node::V2Slice;
use gpufence_tests::TestEnv;

/// GPUs in gres.conf.
const GPUS: u32 = 8;

/// A Slurm release to run the node with.
#[derive(Clone, Debug)]
pub struct Release {
    /// `host` or a Debian suite (`trixie`, `sid`).
    pub name: String,
    root: Option<PathBuf>,
    plugin: Option<PathBuf>,
}

/// Why a release cannot be benchmarked ([`Release::named`]).
#[derive(Debug, thiserror::Error)]
pub enum ReleaseError {
    /// This executable's path is unknown.
    #[error(transparent)]
    CurrentExe(std::io::Error),
    /// This executable is not in a cargo target directory.
    #[error("no target directory")]
    NoTargetDir,
    /// The release's root or plugin is missing: how to make them.
    #[error("release {name}: needs {} (contrib/v2node/make-root.sh {name} {}) and {} (PROFILE=release contrib/v2node/build-plugin.sh {} {})", root.display(), root.display(), plugin.display(), root.display(), plugin.display())]
    Missing {
        /// The suite.
        name: String,
        /// Its root (made by `make-root.sh`).
        root: PathBuf,
        /// Its plugin (built by `build-plugin.sh`).
        plugin: PathBuf,
    },
}

/// The audit log does not hold one `grant_recorded` and one
/// `grant_revoked` line per job: each problem as `job N: COUNT EVENT`.
#[derive(Debug, thiserror::Error)]
#[error("{}", .0.join(", "))]
pub struct AuditMismatch(pub Vec<String>);

impl Release {
    /// `host`: this machine's Slurm; a suite: the root under
    /// `$GPUFENCE_SLURM_ROOTS` (default `/var/cache/gpufence/roots`) and
    /// its plugin at `target/v2node/<suite>.gpufence.so`.
    ///
    /// # Errors
    /// [`ReleaseError`]: what is missing and how to make it.
    pub fn named(name: &str) -> Result<Release, ReleaseError> {
        if name == "host" {
            return Ok(Release {
                name: name.into(),
                root: None,
                plugin: None,
            });
        }
        let roots = std::env::var_os("GPUFENCE_SLURM_ROOTS")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/var/cache/gpufence/roots"));
        let root = roots.join(name);
        let exe = std::env::current_exe().map_err(ReleaseError::CurrentExe)?;
        let target = exe
            .parent()
            .and_then(Path::parent)
            .ok_or(ReleaseError::NoTargetDir)?;
        let plugin = target.join(format!("v2node/{name}.gpufence.so"));
        if !root.join(".gpufence-root").exists() || !plugin.exists() {
            return Err(ReleaseError::Missing {
                name: name.into(),
                root,
                plugin,
            });
        }
        Ok(Release {
            name: name.into(),
            root: Some(root),
            plugin: Some(plugin),
        })
    }

    fn version(&self) -> String {
        let mut c = match &self.root {
            Some(r) => {
                let mut c = Command::new("chroot");
                c.arg(r).arg("slurmd");
                c
            }
            None => Command::new("slurmd"),
        };
        c.arg("-V")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    }
}

/// What one release's node measured; times in seconds, medians.
#[derive(Debug, Default, Clone)]
pub struct JobResult {
    /// The release (`host`, `sid`, ...) and `slurmd -V`.
    pub release: String,
    /// `slurmd -V` of it.
    pub version: String,
    /// `srun --gres=gpu:1 true`: Slurm alone, empty scripts, gpufence.
    pub srun_s: [f64; 3],
    /// Prolog program wall time on an idle node (the srun runs):
    /// `/bin/true`, `gpufence-prolog`.
    pub prolog_s: [f64; 2],
    /// Epilog program wall time on an idle node: `/bin/true`,
    /// `gpufence-epilog`.
    pub epilog_s: [f64; 2],
    /// Prolog program wall time during the bursts (up to 8 jobs at once).
    pub burst_prolog_s: [f64; 2],
    /// Epilog program wall time during the bursts.
    pub burst_epilog_s: [f64; 2],
    /// Burst of `burst_jobs` array jobs, submit to all gone: Slurm alone,
    /// empty scripts, gpufence.
    pub burst_s: [f64; 3],
    /// Jobs per burst.
    pub burst_jobs: usize,
    /// `None` when every gpufence burst's jobs each have one
    /// `grant_recorded` and one `grant_revoked` line; otherwise what was
    /// found.
    pub audit_once: Option<String>,
    /// slurmstepd VmRSS of the step, KiB: (gpufence, empty scripts).
    pub stepd_rss_kib: (u64, u64),
    /// Pinned maps: (name, max_entries, memlock bytes).
    pub maps: Vec<(String, u32, u64)>,
    /// Runs per measurement.
    pub runs: usize,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Empty,
    Gpufence,
}

/// The gpufence node of a release and the files its wrappers write.
struct Node<'a> {
    cluster: &'a Cluster,
    times: PathBuf,
}

impl Node<'_> {
    fn write(path: &Path, text: &str) {
        let tmp = path.with_extension("bench-tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::rename(&tmp, path).unwrap();
    }

    fn times_file(&self, what: &str, mode: Mode) -> PathBuf {
        self.times.join(format!("{what}-{mode:?}.ns"))
    }

    /// Rewrites the Prolog, the Epilog and plugstack.conf for `mode`.
    fn set_mode(&self, mode: Mode) {
        let c = self.cluster;
        let bench = c.bin.join("gpufence-bench");
        for what in ["prolog", "epilog"] {
            let program = match mode {
                Mode::Empty => "/bin/true".to_string(),
                Mode::Gpufence => format!(
                    "{} --config {}",
                    c.bin.join(format!("gpufence-{what}")).display(),
                    c.config.display()
                ),
            };
            Self::write(
                &c.bin.join(format!("{what}.sh")),
                &format!(
                    "#!/bin/sh\nexec {} time-exec {} -- {program}\n",
                    bench.display(),
                    self.times_file(what, mode).display()
                ),
            );
        }
        Self::write(
            &c.dir.join("plugstack.conf"),
            &match mode {
                Mode::Empty => String::new(),
                Mode::Gpufence => format!(
                    "required {} config={}\n",
                    c.bin.join("gpufence.so").display(),
                    c.config.display()
                ),
            },
        );
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn times(p: &Path) -> Vec<f64> {
    std::fs::read_to_string(p)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse::<u64>().ok())
        .map(|ns| ns as f64 / 1e9)
        .collect()
}

fn wait_idle(c: &Cluster) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let o = c.as_user("sinfo", &["-h", "-N", "-o", "%T"]);
        if String::from_utf8_lossy(&o.stdout).trim() == "idle" {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "node never idle: {}\n{}",
            String::from_utf8_lossy(&o.stdout),
            c.log_tail("slurmd.log")
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn srun(c: &Cluster) -> f64 {
    wait_idle(c);
    let t = Instant::now();
    let o = c.as_user("srun", &["--gres=gpu:1", "true"]);
    let s = t.elapsed().as_secs_f64();
    assert!(
        o.status.success(),
        "srun: {o:?}\n{}",
        c.log_tail("slurmd.log")
    );
    s
}

/// A job array of `n` one-GPU `true` jobs, submit to none listed; the
/// array's job ids (the first task's id is the array's).
fn burst(c: &Cluster, n: usize) -> (f64, u32) {
    wait_idle(c);
    let t = Instant::now();
    let o = c.as_user(
        "sbatch",
        &[
            "--parsable",
            &format!("--array=0-{}", n - 1),
            "--gres=gpu:1",
            "--output=/dev/null",
            "--wrap",
            "true",
        ],
    );
    assert!(o.status.success(), "sbatch: {o:?}");
    let id: u32 = String::from_utf8_lossy(&o.stdout)
        .trim()
        .split(';')
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("job id in {o:?}"));
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let q = c.as_user("squeue", &["-h", "-r", "-j", &id.to_string(), "-o", "%i"]);
        if String::from_utf8_lossy(&q.stdout).trim().is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "burst {id} did not end");
        std::thread::sleep(Duration::from_millis(20));
    }
    (t.elapsed().as_secs_f64(), id)
}

/// Whether the audit log at `audit` holds exactly one `grant_recorded`
/// and one `grant_revoked` line for each task of each array `(id, n)`:
/// on an otherwise idle controller an array's tasks get job ids `id` to
/// `id + n - 1` (the last task to run keeps the array's id).
fn check_audit(audit: &Path, ids: &[(u32, usize)]) -> Result<(), AuditMismatch> {
    let lines = gpufence_tests::audit_log_settled(audit);
    let mut problems = Vec::new();
    for &(first, n) in ids {
        // Array task ids are allocated consecutively from the array's id
        // on an otherwise idle controller.
        for job in first..first + n as u32 {
            for ev in ["grant_recorded", "grant_revoked"] {
                let count = lines
                    .iter()
                    .filter(|l| {
                        l.get("event").and_then(|v| v.as_str()) == Some(ev)
                            && l.get("job_id").and_then(serde_json::Value::as_u64)
                                == Some(u64::from(job))
                    })
                    .count();
                if count != 1 {
                    problems.push(format!("job {job}: {count} {ev}"));
                }
            }
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(AuditMismatch(problems))
    }
}

/// Starts `srun --gres=gpu:1 sleep 2`, reads the step's slurmstepd VmRSS
/// after 1.2 s.
fn stepd_rss(c: &Cluster) -> u64 {
    wait_idle(c);
    let mut child = c
        .user_cmd("srun")
        .args(["--gres=gpu:1", "sleep", "2"])
        .spawn()
        .expect("srun sleep");
    std::thread::sleep(Duration::from_millis(1200));
    let mut rss = 0;
    let conf = c.slurm_conf.display().to_string();
    for pid in gpufence_node::holders::scan::pids() {
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd);
        if !cmd.starts_with("slurmstepd: [") || !cmd.contains(".0]") {
            continue;
        }
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        if !String::from_utf8_lossy(&environ).contains(&conf) {
            continue;
        }
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        if let Some(kib) = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        {
            rss = rss.max(kib);
        }
    }
    let _ = child.wait();
    rss
}

/// The pinned maps of the fence in `bpffs`: name, max_entries, memlock.
fn map_memory(bpffs: &Path) -> Vec<(String, u32, u64)> {
    let mut out = Vec::new();
    for name in ["majors", "cgroups", "grants", "denials", "levels"] {
        let Ok(fd) = gpufence_cgroup::sys::obj_get(&bpffs.join(name)) else {
            continue;
        };
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{raw}")).unwrap_or_default();
        let field = |k: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(k))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(0)
        };
        out.push((
            name.to_string(),
            field("max_entries:") as u32,
            field("memlock:"),
        ));
    }
    out
}

fn spec(release: &Release, slice: &V2Slice, env: &TestEnv, alone: bool) -> ClusterSpec {
    let gres: String = (0..GPUS)
        .map(|i| {
            format!(
                "Name=gpu File={}\n",
                env.mknod(&format!("nvidia{i}"), 195, i).display()
            )
        })
        .collect();
    env.mknod("nvidiactl", 195, 255);
    ClusterSpec {
        root: release.root.clone(),
        plugin: release.plugin.clone(),
        gres_conf: gres,
        node_gres: format!("gpu:{GPUS}"),
        gpufence_extra: "nvml = false\n[majors]\nnvidia = 195\n".into(),
        port_base: 19417,
        cpus: Some(2 * GPUS),
        v2node: Some(slice.spec("Alloc,Contain")),
        slurm_only: alone,
        ..ClusterSpec::default()
    }
}

/// Runs the job benchmark on `release`: `runs` runs of `srun` per
/// configuration and `bursts` bursts of `burst_jobs` jobs.
pub fn run(release: &Release, runs: usize, bursts: usize, burst_jobs: usize) -> JobResult {
    let mut r = JobResult {
        release: release.name.clone(),
        version: release.version(),
        burst_jobs,
        runs,
        ..JobResult::default()
    };
    let slice = V2Slice::claim();
    let host = gpufence_tests::cluster::hostname();
    // Slurm alone first: a node of its own.
    {
        let env = TestEnv::new("bench-job-alone");
        let c = Cluster::start_with(&env, &spec(release, &slice, &env, true));
        let s: Vec<f64> = (0..runs).map(|_| srun(&c)).collect();
        let b: Vec<f64> = (0..bursts).map(|_| burst(&c, burst_jobs).0).collect();
        r.srun_s[0] = median(s);
        r.burst_s[0] = median(b);
        Cluster::wait_for(Duration::from_secs(10), || {
            slice.job_cgroups(&host).is_empty()
        });
        drop(c);
        slice.clear_job_cgroups(&host);
    }
    // Empty scripts and gpufence: one node, alternating.
    let env = TestEnv::new("bench-job");
    // state_dir is /run/gpufence on a node, a tmpfs: so it is here.
    let state = env.path("state");
    std::fs::create_dir_all(&state).unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=16m,mode=0700", "gpufence-bench"])
        .arg(&state)
        .status()
        .is_ok_and(|s| s.success());
    assert!(mounted, "mount a tmpfs on {}", state.display());
    let c = Cluster::start_with(&env, &spec(release, &slice, &env, false));
    let exe = std::env::current_exe().expect("current_exe");
    gpufence_tests::cluster::copy_exec(&exe, &c.bin.join("gpufence-bench"));
    let times_dir = env.path("times");
    std::fs::create_dir_all(&times_dir).unwrap();
    std::fs::set_permissions(&times_dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let node = Node {
        cluster: &c,
        times: times_dir,
    };
    let modes = [Mode::Empty, Mode::Gpufence];
    // A first job in each mode, not counted: caches (slurmd -G, page
    // cache of the binaries) are warm for both from here on.
    for m in modes {
        node.set_mode(m);
        srun(&c);
    }
    for m in modes {
        for what in ["prolog", "epilog"] {
            let _ = std::fs::remove_file(node.times_file(what, m));
        }
    }
    let mut s: [Vec<f64>; 2] = Default::default();
    for round in 0..runs {
        for k in 0..2 {
            let i = (k + round) % 2;
            node.set_mode(modes[i]);
            s[i].push(srun(&c));
        }
    }
    // The Prolog and Epilog times so far are the srun runs' (an idle
    // node); the bursts' are kept apart (8 jobs at once on the node).
    for m in modes {
        for what in ["prolog", "epilog"] {
            let f = node.times_file(what, m);
            let _ = std::fs::rename(&f, f.with_extension("idle"));
        }
    }
    let mut b: [Vec<f64>; 2] = Default::default();
    let mut audited = Vec::new();
    for round in 0..bursts {
        for k in 0..2 {
            let i = (k + round) % 2;
            node.set_mode(modes[i]);
            let (t, id) = burst(&c, burst_jobs);
            b[i].push(t);
            if modes[i] == Mode::Gpufence {
                audited.push((id, burst_jobs));
            }
        }
    }
    let [s_empty, s_gpufence] = s;
    let [b_empty, b_gpufence] = b;
    r.srun_s[1] = median(s_empty);
    r.srun_s[2] = median(s_gpufence);
    r.burst_s[1] = median(b_empty);
    r.burst_s[2] = median(b_gpufence);
    for (i, m) in modes.iter().enumerate() {
        let idle = |what| times(&node.times_file(what, *m).with_extension("idle"));
        let burst = |what| times(&node.times_file(what, *m));
        r.prolog_s[i] = median(idle("prolog"));
        r.epilog_s[i] = median(idle("epilog"));
        r.burst_prolog_s[i] = median(burst("prolog"));
        r.burst_epilog_s[i] = median(burst("epilog"));
    }
    r.audit_once = check_audit(&env.path("log/audit.jsonl"), &audited)
        .err()
        .map(|e| e.to_string());
    node.set_mode(Mode::Gpufence);
    let with = stepd_rss(&c);
    node.set_mode(Mode::Empty);
    let without = stepd_rss(&c);
    r.stepd_rss_kib = (with, without);
    r.maps = map_memory(&env.bpffs);
    node.set_mode(Mode::Gpufence);
    wait_idle(&c);
    drop(c);
    let _ = Command::new("umount").arg(&state).status();
    drop(env);
    drop(slice);
    r
}

/// `gpufence-bench time-exec FILE -- CMD ARGS...`: runs CMD, appends its
/// wall time in ns as one line to FILE, exits with CMD's status.
pub fn time_exec(file: &Path, cmd: &[std::ffi::OsString]) -> u8 {
    let Some((prog, args)) = cmd.split_first() else {
        eprintln!("gpufence-bench time-exec: no command");
        return 2;
    };
    let t = Instant::now();
    let status = Command::new(prog).args(args).status();
    let ns = t.elapsed().as_nanos();
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(file)
    {
        let _ = std::io::Write::write_all(&mut f, format!("{ns}\n").as_bytes());
    }
    match status {
        Ok(s) => s.code().map_or(1, |c| c as u8),
        Err(e) => {
            eprintln!("gpufence-bench time-exec: {}: {e}", prog.to_string_lossy());
            127
        }
    }
}
