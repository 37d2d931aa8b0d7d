//! The job path on real Slurm, with and without gpufence, side by side:
//! two one-node clusters (`contrib/cluster.sh`, Debian's slurmctld, slurmd
//! and munged on loopback) that differ only in gpufence's plugin, Prolog and
//! Epilog, each with one "GPU" (a mknod-made node on major 195) in
//! gres.conf. Runs alternate between the clusters (the order flips each
//! round), so drift of the machine lands on both.
//!
//! Measured: wall time of `srun --gres=gpu:1 true` and of an `sbatch
//! --gres=gpu:1 --wrap true` job from submit until `squeue` no longer lists
//! it (Epilog included), both run as the unprivileged test user; the
//! Prolog's and the Epilog's own wall time (each wrapped by
//! `gpufence-bench time-exec`); the resident size of the step's slurmstepd
//! (`VmRSS`, during `srun sleep`); the pinned maps' locked memory
//! (`memlock:` of each map's fdinfo) at the configured bounds.
//!
//! Binaries come from the directory of this one (`cargo build --release
//! --workspace`). Everything lives in two [`TestEnv`]s: own cgroup
//! subtrees, bpffs directories, temp dirs; both clusters are stopped and
//! removed at the end.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use gpufence_tests::cluster::{cluster_sh_start, cluster_sh_stop, user_command, TEST_USER};
use gpufence_tests::TestEnv;

/// One cluster of the comparison.
struct Side {
    name: &'static str,
    env: TestEnv,
    dir: PathBuf,
    slurm_conf: PathBuf,
    /// Files the time-exec wrappers append to (with gpufence only).
    prolog_times: PathBuf,
    epilog_times: PathBuf,
}

/// What the job benchmark measured; times in seconds.
#[derive(Debug, Default, Clone)]
pub struct JobResult {
    /// `srun --gres=gpu:1 true`, median: (with gpufence, without, with
    /// empty Prolog/Epilog scripts and no plugin).
    pub srun_s: (f64, f64, f64),
    /// sbatch submit to gone, median: (with, without, empty scripts).
    pub sbatch_s: (f64, f64, f64),
    /// Prolog wall time, median.
    pub prolog_s: f64,
    /// Epilog wall time, median.
    pub epilog_s: f64,
    /// slurmstepd VmRSS of the step, KiB, median: (with, without).
    pub stepd_rss_kib: (u64, u64),
    /// Pinned maps: (name, max_entries, memlock bytes).
    pub maps: Vec<(String, u32, u64)>,
    /// Runs per measurement.
    pub runs: usize,
}

fn here(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let p = exe.parent().expect("bin dir").join(name);
    assert!(
        p.exists(),
        "{} not built (cargo build --release --workspace)",
        p.display()
    );
    p
}

fn install(from: &Path, to: &Path) {
    std::fs::copy(from, to).unwrap_or_else(|e| panic!("copy {}: {e}", from.display()));
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o755)).unwrap();
}

impl Side {
    /// `with`: gpufence's plugin, Prolog and Epilog; `scripts`: without
    /// gpufence, but a Prolog and an Epilog that do nothing (`exit 0`), as
    /// most sites already run some: Slurm's own cost of running them.
    fn start(name: &'static str, with: bool, scripts: bool, port_base: u16) -> Side {
        let env = TestEnv::new(&format!("bench-job-{name}"));
        let gpu = env.mknod("nvidia0", 195, 0);
        let dir = env.path("cluster");
        let bin = env.path("bin");
        let jobs = env.path("jobs");
        for d in [&dir, &bin, &jobs] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        std::fs::set_permissions(&jobs, std::fs::Permissions::from_mode(0o1777)).unwrap();
        std::fs::write(
            dir.join("gres.conf"),
            format!("Name=gpu File={}\n", gpu.display()),
        )
        .unwrap();
        let host = gpufence_tests::cluster::hostname();
        let mut extra = format!(
            "NodeName={host} NodeAddr=127.0.0.1 CPUs={} RealMemory=2000 Gres=gpu:1 State=UNKNOWN\n",
            std::thread::available_parallelism().map_or(1, |n| n.get())
        );
        let prolog_times = env.path("prolog.ns");
        let epilog_times = env.path("epilog.ns");
        if with {
            for b in [
                "gpufence-prolog",
                "gpufence-epilog",
                "gpufence",
                "gpufence-bench",
            ] {
                install(&here(b), &bin.join(b));
            }
            install(&here("libgpufence.so"), &bin.join("gpufence.so"));
            // state_dir is /run/gpufence on a node, a tmpfs: so it is here.
            let state = env.path("state");
            std::fs::create_dir_all(&state).unwrap();
            let mounted = Command::new("mount")
                .args(["-t", "tmpfs", "-o", "size=16m,mode=0700", "gpufence-bench"])
                .arg(&state)
                .status()
                .is_ok_and(|s| s.success());
            assert!(mounted, "mount a tmpfs on {}", state.display());
            let config = env.config("layout = \"own\"\nnvml = false\n[majors]\nnvidia = 195\n");
            for (script, b, times) in [
                ("prolog.sh", "gpufence-prolog", &prolog_times),
                ("epilog.sh", "gpufence-epilog", &epilog_times),
            ] {
                let p = bin.join(script);
                std::fs::write(
                    &p,
                    format!(
                        "#!/bin/sh\nexec {} time-exec {} -- {} --config {}\n",
                        bin.join("gpufence-bench").display(),
                        times.display(),
                        bin.join(b).display(),
                        config.display()
                    ),
                )
                .unwrap();
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
            }
            std::fs::write(
                dir.join("plugstack.conf"),
                format!(
                    "required {} config={}\n",
                    bin.join("gpufence.so").display(),
                    config.display()
                ),
            )
            .unwrap();
            extra.push_str(&format!(
                "PlugStackConfig={}\nProlog={}\nEpilog={}\n",
                dir.join("plugstack.conf").display(),
                bin.join("prolog.sh").display(),
                bin.join("epilog.sh").display()
            ));
        }
        if scripts {
            let p = bin.join("noop.sh");
            std::fs::write(&p, "#!/bin/sh\nexit 0\n").unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
            extra.push_str(&format!("Prolog={}\nEpilog={}\n", p.display(), p.display()));
        }
        std::fs::write(dir.join("slurm-extra.conf"), extra).unwrap();
        let (out, _) = cluster_sh_start(&env, &dir, port_base);
        let side = Side {
            name,
            slurm_conf: dir.join("slurm.conf"),
            dir,
            env,
            prolog_times,
            epilog_times,
        };
        assert!(
            out.status.success(),
            "cluster.sh start ({name}) failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        side
    }

    fn user(&self, program: &str, args: &[&str]) -> Output {
        user_command(&self.slurm_conf, &self.env.path("jobs"), program)
            .args(args)
            .output()
            .expect("run as the test user")
    }

    fn srun(&self) -> f64 {
        self.wait_idle();
        let t = Instant::now();
        let o = self.user("srun", &["--gres=gpu:1", "true"]);
        let s = t.elapsed().as_secs_f64();
        assert!(o.status.success(), "srun ({}): {o:?}", self.name);
        s
    }

    fn sbatch(&self) -> f64 {
        // Start from an idle node: a node still finishing the previous job
        // (its completing flag lags the job's end) makes slurmctld wait for
        // its next scheduling pass, which would measure Slurm, not us.
        self.wait_idle();
        let t = Instant::now();
        let o = self.user(
            "sbatch",
            &[
                "--parsable",
                "--gres=gpu:1",
                "--output=/dev/null",
                "--wrap",
                "true",
            ],
        );
        assert!(o.status.success(), "sbatch ({}): {o:?}", self.name);
        let id = String::from_utf8_lossy(&o.stdout).trim().to_string();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let q = self.user("squeue", &["-h", "-j", &id, "-o", "%T"]);
            if String::from_utf8_lossy(&q.stdout).trim().is_empty() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "job {id} ({}) did not end",
                self.name
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        t.elapsed().as_secs_f64()
    }

    fn wait_idle(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let o = self.user("sinfo", &["-h", "-N", "-o", "%T"]);
            if String::from_utf8_lossy(&o.stdout).trim() == "idle" {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "node of {} never idle",
                self.name
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Starts `srun sleep 2`, reads the step's slurmstepd VmRSS after 1 s.
    fn stepd_rss(&self) -> u64 {
        let mut child = Command::new("setpriv")
            .args([
                "--reuid",
                TEST_USER,
                "--regid",
                TEST_USER,
                "--init-groups",
                "--reset-env",
                "--",
                "env",
            ])
            .arg(format!("SLURM_CONF={}", self.slurm_conf.display()))
            .args(["srun", "--gres=gpu:1", "sleep", "2"])
            .current_dir(self.env.path("jobs"))
            .spawn()
            .expect("srun sleep");
        std::thread::sleep(Duration::from_millis(1200));
        let mark = format!("GPUFENCE_CLUSTER_DIR={}", self.dir.display());
        let mut rss = 0;
        for pid in gpufence_node::scan::pids() {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd);
            // The step's daemon renames itself `slurmstepd: [<job>.<step>]`;
            // the batch/extern/interactive ones are not the step.
            if !cmd.starts_with("slurmstepd: [") || !cmd.contains(".0]") {
                continue;
            }
            let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            if !environ.split(|b| *b == 0).any(|e| e == mark.as_bytes()) {
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

    fn times(p: &Path) -> Vec<f64> {
        std::fs::read_to_string(p)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse::<u64>().ok())
            .map(|ns| ns as f64 / 1e9)
            .collect()
    }
}

impl Drop for Side {
    fn drop(&mut self) {
        cluster_sh_stop(&self.dir);
        let state = self.env.path("state");
        if state.is_dir() {
            let _ = Command::new("umount").arg(&state).status();
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
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

/// Runs the job benchmark: `runs` alternating runs of each measurement.
pub fn run(runs: usize) -> JobResult {
    let with = Side::start("with", true, false, 18817);
    let without = Side::start("without", false, false, 18917);
    let scripts = Side::start("scripts", false, true, 19017);
    // cluster.sh's own check job already ran once on each; the timing
    // files start now.
    let _ = std::fs::remove_file(&with.prolog_times);
    let _ = std::fs::remove_file(&with.epilog_times);
    let sides = [&with, &without, &scripts];
    let mut srun: [Vec<f64>; 3] = Default::default();
    let mut sbatch: [Vec<f64>; 3] = Default::default();
    let mut rss: [Vec<f64>; 2] = Default::default();
    // Each round runs the three in a rotated order.
    for r in 0..runs {
        for k in 0..3 {
            let i = (k + r) % 3;
            srun[i].push(sides[i].srun());
        }
    }
    for r in 0..runs {
        for k in 0..3 {
            let i = (k + r) % 3;
            sbatch[i].push(sides[i].sbatch());
        }
    }
    for _ in 0..runs.clamp(1, 3) {
        rss[0].push(with.stepd_rss() as f64);
        rss[1].push(without.stepd_rss() as f64);
    }
    // squeue no longer lists a job once its epilog completed, so the
    // Epilog's times are all in.
    let [s0, s1, s2] = srun;
    let [b0, b1, b2] = sbatch;
    let [r0, r1] = rss;
    let result = JobResult {
        srun_s: (median(s0), median(s1), median(s2)),
        sbatch_s: (median(b0), median(b1), median(b2)),
        prolog_s: median(Side::times(&with.prolog_times)),
        epilog_s: median(Side::times(&with.epilog_times)),
        stepd_rss_kib: (median(r0) as u64, median(r1) as u64),
        maps: map_memory(&with.env.bpffs),
        runs,
    };
    drop(scripts);
    drop(without);
    drop(with);
    result
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
