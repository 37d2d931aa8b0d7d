//! A real one-node Slurm cluster (Debian's slurmctld, slurmd, munged) on
//! loopback, started by `contrib/cluster.sh` in a test's temp dir, with
//! gpufence's prolog, epilog and plugin configured and slurmd inside the
//! test's cgroup subtree.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::out::{both, stdout};
use crate::{workspace_bin, TestEnv};

/// The unprivileged user jobs run as (created by `contrib/setup.sh`).
pub const TEST_USER: &str = "gpufence-test";

/// A running cluster; stopped on drop.
pub struct Cluster {
    /// The cluster directory (slurm.conf, logs, munge socket).
    pub dir: PathBuf,
    /// `SLURM_CONF`.
    pub slurm_conf: PathBuf,
    /// Copies of the binaries, readable by the test user.
    pub bin: PathBuf,
    /// The gpufence config the cluster uses.
    pub config: PathBuf,
    /// The cgroup directory slurmd runs in.
    pub slurmd_cgroup: PathBuf,
    /// The Debian root of another Slurm release the cluster runs in.
    pub root: Option<PathBuf>,
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../contrib/cluster.sh")
}

/// `contrib/cluster.sh start DIR` with slurmctld on `port_base` (slurmd on
/// the next port) and slurmd in a new cgroup `slurmd` of `env`. Returns
/// cluster.sh's output (the caller asserts on it) and slurmd's cgroup
/// directory.
pub fn cluster_sh_start(env: &TestEnv, dir: &Path, port_base: u16) -> (Output, PathBuf) {
    let slurmd_cg = env.cg.path(&env.cgroup("slurmd"));
    let out = cluster_sh_start_in(dir, port_base, &slurmd_cg, false, None);
    (out, slurmd_cg)
}

/// `contrib/cluster.sh start DIR` with slurmd in the cgroup directory
/// `slurmd_cg`; `v2node`: as on a pure cgroup v2 node
/// (`GPUFENCE_CLUSTER_V2NODE=1`); `root`: chrooted in that Debian root of
/// another Slurm release (`GPUFENCE_CLUSTER_ROOT`).
pub fn cluster_sh_start_in(
    dir: &Path,
    port_base: u16,
    slurmd_cg: &Path,
    v2node: bool,
    root: Option<&Path>,
) -> Output {
    cluster_sh_start_env(dir, port_base, slurmd_cg, v2node, root, &[])
}

/// [`cluster_sh_start_in`] with `vars` added to cluster.sh's environment.
pub fn cluster_sh_start_env(
    dir: &Path,
    port_base: u16,
    slurmd_cg: &Path,
    v2node: bool,
    root: Option<&Path>,
    vars: &[(&str, &str)],
) -> Output {
    let mut c = Command::new("bash");
    c.envs(vars.iter().copied());
    c.arg(script())
        .arg("start")
        .arg(dir)
        .env("GPUFENCE_CLUSTER_PORT_BASE", port_base.to_string())
        .env("GPUFENCE_SLURMD_CGROUP", slurmd_cg);
    if v2node {
        c.env("GPUFENCE_CLUSTER_V2NODE", "1");
    }
    if let Some(r) = root {
        c.env("GPUFENCE_CLUSTER_ROOT", r);
    }
    c.output().expect("run cluster.sh")
}

/// `contrib/cluster.sh start DIR` for several nodes on this host
/// (`GPUFENCE_CLUSTER_NODES`): one slurmd per name, each in
/// `slurmd_cg` with `%n` replaced by its name, as on a real cgroup/v2
/// node. The caller writes slurm-extra.conf (the NodeName lines with
/// `Port=`, the `%n` paths) and `DIR/node-<name>.env`.
pub fn cluster_sh_start_nodes(
    dir: &Path,
    port_base: u16,
    slurmd_cg: &str,
    nodes: &[&str],
) -> Output {
    Command::new("bash")
        .arg(script())
        .arg("start")
        .arg(dir)
        .env("GPUFENCE_CLUSTER_PORT_BASE", port_base.to_string())
        .env("GPUFENCE_SLURMD_CGROUP", slurmd_cg)
        .env("GPUFENCE_CLUSTER_NODES", nodes.join(" "))
        .env("GPUFENCE_CLUSTER_V2NODE", "1")
        .output()
        .expect("run cluster.sh")
}

/// `inner` run chrooted in `root` (`contrib/v2node/chroot.sh`), in the
/// same working directory (the root shares this host's `/tmp`).
pub fn in_root(root: &Path, inner: &Command) -> Command {
    let mut c = Command::new("bash");
    c.arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../contrib/v2node/chroot.sh"))
        .arg(root)
        .arg("env");
    if let Some(d) = inner.get_current_dir() {
        c.arg("-C").arg(d);
    }
    for (k, v) in inner.get_envs() {
        if let Some(v) = v {
            c.arg(format!("{}={}", k.to_string_lossy(), v.to_string_lossy()));
        }
    }
    c.arg(inner.get_program()).args(inner.get_args());
    c
}

/// `contrib/cluster.sh stop DIR`; what fails is ignored (cleanup).
pub fn cluster_sh_stop(dir: &Path) {
    let _ = Command::new("bash")
        .arg(script())
        .arg("stop")
        .arg(dir)
        .output();
}

/// Copies an executable to `to`, mode 0755 (readable by the test user).
pub fn copy_exec(from: &Path, to: &Path) {
    std::fs::copy(from, to)
        .unwrap_or_else(|e| panic!("copy {} -> {}: {e}", from.display(), to.display()));
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// The uid of [`TEST_USER`].
pub fn test_uid() -> u32 {
    let out = Command::new("id")
        .args(["-u", TEST_USER])
        .output()
        .expect("id");
    assert!(
        out.status.success(),
        "user {TEST_USER} missing: run contrib/setup.sh"
    );
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("uid")
}

/// How long [`Cluster::as_user`] lets a command run, in seconds.
pub const AS_USER_TIMEOUT_S: &str = "240";

/// What [`Cluster::start_with`] builds.
#[derive(Clone, Debug, Default)]
pub struct ClusterSpec {
    /// The gres.conf body.
    pub gres_conf: String,
    /// The node's `Gres=` value.
    pub node_gres: String,
    /// TOML appended to the test env's gpufence config.
    pub gpufence_extra: String,
    /// slurmctld's port; slurmd uses the next one.
    pub port_base: u16,
    /// CPUs declared for the node (slurmd takes them as configured,
    /// `SlurmdParameters=config_overrides`); `None`: this machine's count.
    pub cpus: Option<u32>,
    /// A real cgroup/v2 node ([`crate::v2node`]): slurmd runs through
    /// `contrib/v2node/enter.sh` in this cgroup directory (absolute), with
    /// these slurm.conf lines and this cgroup.conf; the gpufence config's
    /// `cgroup_root` is `fence_root`. `None`: the env's own subtree, Slurm
    /// without cgroups.
    pub v2node: Option<V2NodeSpec>,
    /// Slurm alone: no gpufence Prolog, Epilog or plugin (the baseline).
    pub slurm_only: bool,
    /// Another Slurm release: a Debian root made by
    /// `contrib/v2node/make-root.sh`, whose daemons and clients run
    /// chrooted (`contrib/v2node/chroot.sh`); `None`: this host's Slurm.
    pub root: Option<PathBuf>,
    /// The plugin built for that release's series
    /// (`contrib/v2node/build-plugin.sh`); `None`: the workspace's build.
    pub plugin: Option<PathBuf>,
    /// A plugstack.conf line put before gpufence's (another SPANK plugin,
    /// as a site stacks Pyxis); `None`: gpufence's line alone.
    pub plugstack_first: Option<String>,
    /// Slurm's `switch/nvidia_imex` (24.05+) with this `imex_dev_major`
    /// (a real cgroup/v2 node only): slurm.conf gets `SwitchType`,
    /// `SwitchParameters=imex_dev_major=<major>,imex_channel_count=16`,
    /// `DebugFlags=Switch` and `SlurmdDebug=debug`; slurmd starts with a
    /// tmpfs of its own over `/dev/nvidia-caps-imex-channels` in its
    /// private mount namespace (`GPUFENCE_V2NODE_IMEX`,
    /// `contrib/v2node/enter.sh`: slurmd empties that directory at start);
    /// the gpufence config's `[majors]` gets
    /// `nvidia-caps-imex-channels = <major>` (and `nvidia = 195` when the
    /// caller gave no `[majors]`). `cluster.sh start`'s check job may fail
    /// (`GPUFENCE_CLUSTER_CHECK=warn`: it says so on stderr), so that a
    /// test can measure a node whose every step fails.
    pub imex: Option<u32>,
    /// Files written next to slurm.conf (name, text): job_container.conf,
    /// namespace.yaml. Those of an earlier start in the same directory
    /// that this spec does not name are removed.
    pub extra_files: Vec<(String, String)>,
}

/// `gpufence_extra` with `nvidia-caps-imex-channels = <major>` in its
/// `[majors]` table (one is added, with `nvidia = 195`, when it has none).
pub fn with_imex_major(gpufence_extra: &str, major: u32) -> String {
    const NAME: &str = "nvidia-caps-imex-channels";
    if gpufence_extra
        .lines()
        .any(|l| l.trim_start().starts_with(NAME))
    {
        return gpufence_extra.to_string();
    }
    if gpufence_extra.lines().any(|l| l.trim() == "[majors]") {
        return gpufence_extra
            .lines()
            .map(|l| {
                if l.trim() == "[majors]" {
                    format!("{l}\n{NAME} = {major}\n")
                } else {
                    format!("{l}\n")
                }
            })
            .collect();
    }
    format!("{gpufence_extra}\n[majors]\nnvidia = 195\n{NAME} = {major}\n")
}

/// The cgroup/v2 part of a [`ClusterSpec`].
#[derive(Clone, Debug, Default)]
pub struct V2NodeSpec {
    /// slurmd's cgroup directory (`<mount>/system.slice/slurmd.service`).
    pub slurmd_cgroup: PathBuf,
    /// The fence's `cgroup_root`, relative to the mount (`system.slice`).
    pub fence_root: String,
    /// Lines for slurm.conf (ProctrackType, TaskPlugin, PrologFlags).
    pub slurm_conf: String,
    /// cgroup.conf.
    pub cgroup_conf: String,
    /// slurmd in a container: `slurmd_cgroup` becomes the root of a cgroup
    /// namespace, and slurmd runs in `system.slice/slurmd.service` below it
    /// (`GPUFENCE_V2NODE_CGROUPNS`, `contrib/v2node/enter.sh`);
    /// `fence_root` is then relative to that namespace.
    pub cgroupns: bool,
}

impl Cluster {
    /// Starts a cluster for `env`: `gres_conf` is the gres.conf body,
    /// `node_gres` the node's `Gres=` value, `gpufence_toml` the config
    /// (written to the cluster dir). slurmd runs in `<env.root>/slurmd`.
    pub fn start(
        env: &TestEnv,
        gres_conf: &str,
        node_gres: &str,
        gpufence_extra: &str,
        port_base: u16,
    ) -> Cluster {
        Cluster::start_with(
            env,
            &ClusterSpec {
                gres_conf: gres_conf.into(),
                node_gres: node_gres.into(),
                gpufence_extra: gpufence_extra.into(),
                port_base,
                ..ClusterSpec::default()
            },
        )
    }

    /// Starts a cluster for `env` as `spec` says (see [`Cluster::start`]).
    pub fn start_with(env: &TestEnv, spec: &ClusterSpec) -> Cluster {
        let (c, out) = Cluster::launch(env, spec);
        assert!(
            out.status.success(),
            "cluster.sh start failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        c
    }

    /// [`Cluster::start_with`] that returns `cluster.sh start`'s output
    /// instead of asserting that it succeeded (a node that must refuse to
    /// start). The cluster is stopped on drop either way.
    pub fn launch(env: &TestEnv, spec: &ClusterSpec) -> (Cluster, Output) {
        assert!(
            spec.imex.is_none() || spec.v2node.is_some(),
            "ClusterSpec::imex needs a real cgroup/v2 node (v2node)"
        );
        let gpufence_extra = match spec.imex {
            Some(major) => with_imex_major(&spec.gpufence_extra, major),
            None => spec.gpufence_extra.clone(),
        };
        let (gres_conf, node_gres, gpufence_extra, port_base) = (
            spec.gres_conf.as_str(),
            spec.node_gres.as_str(),
            gpufence_extra.as_str(),
            spec.port_base,
        );
        let dir = env.path("cluster");
        let bin = env.path("bin");
        for d in [&dir, &bin] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let jobs = env.path("jobs");
        std::fs::create_dir_all(&jobs).unwrap();
        std::fs::set_permissions(&jobs, std::fs::Permissions::from_mode(0o1777)).unwrap();
        for b in [
            "gpufence-prolog",
            "gpufence-epilog",
            "gpufence",
            "gpufence-probe",
            "gpufence-mps-standin",
        ] {
            copy_exec(&workspace_bin(b), &bin.join(b));
        }
        copy_exec(
            &spec
                .plugin
                .clone()
                .unwrap_or_else(|| workspace_bin("libgpufence.so")),
            &bin.join("gpufence.so"),
        );
        let config = match &spec.v2node {
            Some(v2) => {
                // The Prolog runs `slurmd -G` with the environment slurmd
                // gives it, which holds no LD_PRELOAD: on a hybrid host
                // that slurmd -G would die on the v1 lines of
                // /proc/self/cgroup, and 23.11+ in a cgroup namespace on
                // the path of /proc/1/cgroup, outside it
                // (v2node/enter.sh). A wrapper adds the library there (a
                // harness matter: elsewhere it just execs).
                let wrapper = bin.join("slurmd-v2node");
                std::fs::write(
                    &wrapper,
                    format!(
                        "#!/bin/sh
if grep -qv '^0::' /proc/self/cgroup || grep -q '^0::/\\.\\.' /proc/1/cgroup; then
                             LD_PRELOAD={}/proc-cgroup-v2only.so exec /usr/sbin/slurmd \"$@\"
fi
                         exec /usr/sbin/slurmd \"$@\"
",
                        dir.display()
                    ),
                )
                .unwrap();
                std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
                env.config_rooted(
                    &v2.fence_root,
                    &format!("slurmd_bin = \"{}\"\n{gpufence_extra}", wrapper.display()),
                )
            }
            None => env.config(gpufence_extra),
        };
        // slurmd builds the Prolog's environment from scratch: the config
        // path travels in a wrapper, as it would in /etc/slurm on a node.
        write_wrapper(&bin, &config, "prolog", &[]);
        write_wrapper(&bin, &config, "epilog", &[]);
        // Written empty for Slurm alone: slurmd reads plugstack.conf next to
        // slurm.conf when PlugStackConfig is unset (`default_plugstack`,
        // src/common/read_config.c).
        std::fs::write(
            dir.join("plugstack.conf"),
            if spec.slurm_only {
                String::new()
            } else {
                format!(
                    "{}required {} config={}\n",
                    spec.plugstack_first
                        .as_ref()
                        .map(|l| format!("{l}\n"))
                        .unwrap_or_default(),
                    bin.join("gpufence.so").display(),
                    config.display()
                )
            },
        )
        .unwrap();
        std::fs::write(dir.join("gres.conf"), gres_conf).unwrap();
        let host = hostname();
        let mut extra = format!(
            "NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=2000 Gres={node_gres} State=UNKNOWN\n",
            cpus = spec.cpus.unwrap_or_else(|| {
                std::thread::available_parallelism().map_or(1, |n| n.get() as u32)
            }),
        );
        if !spec.slurm_only {
            extra += &format!(
                "PlugStackConfig={plug}\nProlog={prolog}\nEpilog={epilog}\n",
                plug = dir.join("plugstack.conf").display(),
                prolog = bin.join("prolog.sh").display(),
                epilog = bin.join("epilog.sh").display(),
            );
        }
        let _ = std::fs::remove_file(dir.join("cgroup.conf"));
        if let Some(v2) = &spec.v2node {
            extra += &v2.slurm_conf;
            std::fs::write(dir.join("cgroup.conf"), &v2.cgroup_conf).unwrap();
        }
        if let Some(major) = spec.imex {
            extra += &format!(
                "SwitchType=switch/nvidia_imex\n\
                 SwitchParameters=imex_dev_major={major},imex_channel_count=16\n\
                 DebugFlags=Switch\nSlurmdDebug=debug\n"
            );
        }
        let listed = dir.join(".extra-files");
        for old in std::fs::read_to_string(&listed).unwrap_or_default().lines() {
            let _ = std::fs::remove_file(dir.join(old));
        }
        for (name, text) in &spec.extra_files {
            assert!(!name.contains('/'), "extra file {name}: a name, not a path");
            std::fs::write(dir.join(name), text).unwrap();
        }
        std::fs::write(
            &listed,
            spec.extra_files
                .iter()
                .map(|(n, _)| format!("{n}\n"))
                .collect::<String>(),
        )
        .unwrap();
        std::fs::write(dir.join("slurm-extra.conf"), extra).unwrap();
        let (out, slurmd_cgroup) = match &spec.v2node {
            Some(v2) => (
                cluster_sh_start_env(
                    &dir,
                    port_base,
                    &v2.slurmd_cgroup,
                    true,
                    spec.root.as_deref(),
                    // Travel in cluster.sh's environment to v2node/enter.sh.
                    &[
                        v2.cgroupns.then_some(("GPUFENCE_V2NODE_CGROUPNS", "1")),
                        spec.imex.map(|_| ("GPUFENCE_V2NODE_IMEX", "1")),
                        spec.imex.map(|_| ("GPUFENCE_CLUSTER_CHECK", "warn")),
                    ]
                    .into_iter()
                    .flatten()
                    .collect::<Vec<_>>(),
                ),
                v2.slurmd_cgroup.clone(),
            ),
            None => cluster_sh_start(env, &dir, port_base),
        };
        let c = Cluster {
            slurm_conf: dir.join("slurm.conf"),
            dir,
            bin,
            config,
            slurmd_cgroup,
            root: spec.root.clone(),
        };
        (c, out)
    }

    /// A command run as [`TEST_USER`] (via setpriv: no PAM, no session
    /// cgroup moves) with `SLURM_CONF` set, in the jobs directory.
    pub fn user_cmd(&self, program: &str) -> Command {
        let c = user_command(
            &self.slurm_conf,
            &self.dir.parent().unwrap().join("jobs"),
            program,
        );
        match &self.root {
            Some(r) => in_root(r, &c),
            None => c,
        }
    }

    /// Runs `program args` as the test user; returns the output. Ended
    /// after [`AS_USER_TIMEOUT_S`] (`timeout(1)`, exit 124): an `srun` or
    /// `sbatch --wait` on a node that drained waits for ever, and a test
    /// must fail instead.
    pub fn as_user(&self, program: &str, args: &[&str]) -> Output {
        self.user_cmd("timeout")
            .args(["--kill-after=10", AS_USER_TIMEOUT_S, program])
            .args(args)
            .output()
            .expect("run as user")
    }

    /// Runs the admin CLI with the cluster's config.
    pub fn gpufence(&self, args: &[&str]) -> Output {
        Command::new(self.bin.join("gpufence"))
            .arg("--config")
            .arg(&self.config)
            .args(args)
            .output()
            .expect("gpufence")
    }

    /// The tail of a log file in the cluster dir, for failure messages.
    pub fn log_tail(&self, name: &str) -> String {
        let text = std::fs::read_to_string(self.dir.join("log").join(name))
            .or_else(|_| std::fs::read_to_string(self.dir.join(name)))
            .unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// slurmd's pid, as `cluster.sh` (or [`Cluster::start_slurmd`]) recorded
    /// it, when that process is alive.
    pub fn slurmd_pid(&self) -> Option<i32> {
        let text = std::fs::read_to_string(self.dir.join("run/slurmd.pid")).ok()?;
        let pid: i32 = text.trim().parse().ok()?;
        (!crate::gone(pid)).then_some(pid)
    }

    /// Stops slurmd with `signal` (`SIGTERM`: a clean shutdown; `SIGKILL`:
    /// a crash) and waits until it is gone. Running jobs' slurmstepds stay.
    pub fn stop_slurmd(&self, signal: i32) {
        let pid = self.slurmd_pid().expect("slurmd is running");
        // SAFETY: kill(2) on the pid this cluster recorded for its slurmd.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0, "kill slurmd {pid}");
        assert!(
            Cluster::wait_for(Duration::from_secs(30), || crate::gone(pid)),
            "slurmd {pid} did not exit on signal {signal}"
        );
    }

    /// Starts slurmd again the way `cluster.sh start` does (same cgroup,
    /// same marked environment so `cluster.sh stop` finds it, own session,
    /// log appended, no inherited descriptors), records its pid, and waits
    /// until it accepts connections on its port (its SPANK plugin's slurmd
    /// init, which reinstalls the fence, runs before that).
    pub fn start_slurmd(&self) {
        self.start_slurmd_with_env(&[]);
    }

    /// [`Cluster::start_slurmd`] with `vars` added to slurmd's environment,
    /// which its slurmstepds inherit (e.g. `GPUFENCE_TEST_CRASH_AT`).
    pub fn start_slurmd_with_env(&self, vars: &[(&str, &str)]) {
        self.spawn_slurmd(vars);
        let port = self.slurmd_port();
        let up = Cluster::wait_for(Duration::from_secs(30), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        assert!(
            up,
            "slurmd did not come back on port {port}:\n{}",
            self.log_tail("slurmd.log")
        );
    }

    /// Spawns slurmd as [`Cluster::start_slurmd_with_env`] does, without
    /// waiting for it, and returns its pid (reaped when it exits).
    pub fn spawn_slurmd(&self, vars: &[(&str, &str)]) -> i32 {
        use std::os::unix::process::CommandExt;
        let dir = std::fs::canonicalize(&self.dir).expect("cluster dir");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("log/slurmd.stderr"))
            .expect("slurmd.stderr");
        let mut cmd = Command::new("slurmd");
        cmd.args(["-D", "-f"])
            .arg(&self.slurm_conf)
            .args(["-N", &hostname()])
            .env("GPUFENCE_CLUSTER_DIR", &dir)
            .env("SLURM_CONF", &self.slurm_conf)
            .envs(vars.iter().copied())
            .current_dir("/")
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        // SAFETY: setsid is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
        gpufence_cgroup::hierarchy::Cgroup2::at(&self.slurmd_cgroup)
            .join_at_exec("", &mut cmd)
            .expect("slurmd cgroup path");
        let mut child = cmd.spawn().expect("spawn slurmd");
        let pid = child.id();
        std::fs::write(dir.join("run/slurmd.pid"), format!("{pid}\n")).unwrap();
        // Reap it whenever it exits (cluster.sh stop kills it).
        std::thread::spawn(move || {
            let _ = child.wait();
        });
        pid as i32
    }

    /// Sets the environment slurmd's Prolog (`which` = `"prolog"`) or
    /// Epilog (`"epilog"`) runs gpufence with, e.g. `GPUFENCE_TEST_CRASH_AT`
    /// (slurmd gives them a fresh environment, so it goes in the wrapper
    /// script, which only root writes); `&[]` clears it.
    pub fn set_script_env(&self, which: &str, vars: &[(&str, &str)]) {
        write_wrapper(&self.bin, &self.config, which, vars);
    }

    /// Makes slurmd's Epilog save the environment slurmd gave it (`env
    /// -0`) to `<dir>/<job id>.env` before it runs gpufence's, for
    /// [`Cluster::replay_epilog`]; atomically, as [`Cluster::set_script_env`].
    pub fn keep_epilog_env(&self, dir: &Path) {
        std::fs::create_dir_all(dir).expect("epilog env dir");
        let p = self.bin.join("epilog.sh");
        let tmp = self.bin.join(".epilog.sh.tmp");
        std::fs::write(
            &tmp,
            format!(
                "#!/bin/sh
env -0 >{d}/$SLURM_JOB_ID.env.tmp && mv {d}/$SLURM_JOB_ID.env.tmp {d}/$SLURM_JOB_ID.env
exec {} --config {}
",
                self.bin.join("gpufence-epilog").display(),
                self.config.display(),
                d = dir.display(),
            ),
        )
        .unwrap();
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::rename(&tmp, &p).unwrap();
    }

    /// Runs gpufence's Epilog of job `job` again, as root, with exactly the
    /// environment slurmd gave the first run (saved by
    /// [`Cluster::keep_epilog_env`] in `dir`), in the cluster's root if
    /// any: what slurmd does when it runs an Epilog a second time.
    pub fn replay_epilog(&self, dir: &Path, job: u32) -> Output {
        let saved = std::fs::read(dir.join(format!("{job}.env")))
            .unwrap_or_else(|e| panic!("job {job}'s Epilog environment: {e}"));
        let mut c = Command::new("env");
        c.arg("-i");
        for kv in saved.split(|b| *b == 0).filter(|kv| !kv.is_empty()) {
            c.arg(String::from_utf8_lossy(kv).into_owned());
        }
        c.arg(self.bin.join("gpufence-epilog"))
            .arg("--config")
            .arg(&self.config);
        match &self.root {
            Some(r) => in_root(r, &c),
            None => c,
        }
        .output()
        .expect("replay the epilog")
    }

    /// Runs `program args` as root with the cluster's `SLURM_CONF`
    /// (scontrol, scancel: what an admin does).
    pub fn admin(&self, program: &str, args: &[&str]) -> Output {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", &self.slurm_conf).args(args);
        match &self.root {
            Some(r) => in_root(r, &c),
            None => c,
        }
        .output()
        .expect("run admin command")
    }

    /// slurmd's port, from slurm.conf.
    pub fn slurmd_port(&self) -> u16 {
        std::fs::read_to_string(&self.slurm_conf)
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.trim().strip_prefix("SlurmdPort="))
            .and_then(|v| v.trim().parse().ok())
            .expect("SlurmdPort in slurm.conf")
    }

    /// Waits until `pred` holds, up to `timeout`.
    pub fn wait_for(timeout: Duration, mut pred: impl FnMut() -> bool) -> bool {
        let t0 = Instant::now();
        while t0.elapsed() < timeout {
            if pred() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        pred()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        cluster_sh_stop(&self.dir);
    }
}

/// Writes `<bin>/<which>.sh` (`which`: `prolog` or `epilog`), the script
/// slurm.conf names, running `gpufence-<which> --config CONFIG` with `vars`
/// in its environment; atomically, since slurmd may start it any moment.
fn write_wrapper(bin: &Path, config: &Path, which: &str, vars: &[(&str, &str)]) {
    let env: String = vars.iter().map(|(k, v)| format!("{k}='{v}' ")).collect();
    let p = bin.join(format!("{which}.sh"));
    let tmp = bin.join(format!(".{which}.sh.tmp"));
    std::fs::write(
        &tmp,
        format!(
            "#!/bin/sh\n{}exec {} --config {}\n",
            if env.is_empty() {
                String::new()
            } else {
                format!("export {env}\n")
            },
            bin.join(format!("gpufence-{which}")).display(),
            config.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::rename(&tmp, &p).unwrap();
}

/// `sbatch --parsable -o OUT --wrap SCRIPT ARGS` through `cmd` (a user's
/// `sbatch`, e.g. [`Cluster::user_cmd`] or [`PeerUser::cmd`]); the job
/// id. Panics when sbatch fails.
pub fn sbatch_as(mut cmd: Command, args: &[&str], out: &Path, script: &str) -> u32 {
    let o = cmd
        .arg("--parsable")
        .arg("-o")
        .arg(out)
        .args(args)
        .arg("--wrap")
        .arg(script)
        .output()
        .expect("sbatch");
    assert!(o.status.success(), "sbatch: {}", both(&o));
    stdout(&o)
        .trim()
        .split(';')
        .next()
        .and_then(|j| j.parse().ok())
        .unwrap_or_else(|| panic!("job id in {}", both(&o)))
}

/// Waits (60 s at most) until file `out` (a job's output) has a line
/// `line`; its text. Panics with slurmd's log otherwise.
pub fn wait_output(cluster: &Cluster, out: &Path, line: &str) -> String {
    let mut text = String::new();
    let ok = Cluster::wait_for(Duration::from_secs(60), || {
        text = std::fs::read_to_string(out).unwrap_or_default();
        text.lines().any(|l| l == line)
    });
    assert!(
        ok,
        "{} never said {line:?}:\n{text}\n{}",
        out.display(),
        cluster.log_tail("slurmd.log")
    );
    text
}

/// A job's state (`squeue -h -o %T`); empty once it has left the queue.
pub fn job_state(cluster: &Cluster, job: u32) -> String {
    stdout(&cluster.admin("squeue", &["-h", "-j", &job.to_string(), "-o", "%T"]))
        .trim()
        .to_string()
}

/// Cancels `job` (as root, `scancel`) and waits (60 s at most) until its
/// Epilog has run to its end (its record under `env`'s `state/jobs/`
/// forgotten) and it has left the queue; panics otherwise.
pub fn end_job(cluster: &Cluster, env: &TestEnv, job: u32) {
    let o = cluster.admin("scancel", &[&job.to_string()]);
    assert!(o.status.success(), "scancel {job}: {}", both(&o));
    let record = env.path(&format!("state/jobs/{job}.json"));
    assert!(
        Cluster::wait_for(Duration::from_secs(60), || !record.exists()
            && job_state(cluster, job).is_empty()),
        "job {job} did not end ({}; record {}):\n{}",
        job_state(cluster, job),
        if record.exists() { "kept" } else { "gone" },
        cluster.log_tail("slurmd.log")
    );
}

/// How many entries of the fence's `grants` map (the cluster config's
/// `bpffs_dir`) carry job `job`'s id; 0 when the fence cannot be read.
pub fn job_grants(cluster: &Cluster, job: u32) -> usize {
    gpufence_cgroup::Fence::open(
        &gpufence_model::config::Config::load(&cluster.config)
            .expect("the cluster's gpufence config")
            .bpffs_dir,
    )
    .and_then(|f| f.entries())
    .map(|g| g.into_iter().filter(|e| e.job_id == job).count())
    .unwrap_or(0)
}

/// After shared jobs: the node idle (not drained) within 30 s, no grant
/// left (`gpufence grants --json`), and no Epilog of `jobs` found anything
/// to end (no `lingering_process`, `process_killed` or `survivor` line of
/// theirs in the audit log `audit`). Panics otherwise.
pub fn assert_node_clean(cluster: &Cluster, jobs: &[u32], audit: &Path) {
    let mut state = String::new();
    assert!(
        Cluster::wait_for(Duration::from_secs(30), || {
            state = stdout(&cluster.admin("sinfo", &["-h", "-o", "%T"]))
                .trim()
                .to_string();
            state == "idle"
        }),
        "node not idle: {state}\n{}",
        cluster.log_tail("slurmd.log")
    );
    let g = cluster.gpufence(&["grants", "--json"]);
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&g.stdout).unwrap_or_default(),
        serde_json::json!([]),
        "no grant is left: {}",
        both(&g)
    );
    for job in jobs {
        let ev: Vec<String> = crate::audit_log(audit)
            .into_iter()
            .filter(|e| e["job_id"] == *job)
            .map(|e| e["event"].as_str().unwrap_or("").to_string())
            .collect();
        for bad in ["lingering_process", "process_killed", "survivor"] {
            assert!(!ev.iter().any(|e| e == bad), "job {job}: {ev:?}");
        }
    }
}

/// This machine's short hostname (Slurm's NodeName).
pub fn hostname() -> String {
    let out = Command::new("hostname")
        .arg("-s")
        .output()
        .expect("hostname");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// `program` run as [`TEST_USER`] through setpriv (no PAM, no session
/// cgroup moves, an empty environment) with only `SLURM_CONF=slurm_conf`
/// set, in `dir`. The cluster tests and the job benchmark use it.
pub fn user_command(slurm_conf: &Path, dir: &Path, program: &str) -> Command {
    user_command_as(TEST_USER, slurm_conf, dir, program)
}

/// [`user_command`] as `user` (another job user of a test).
pub fn user_command_as(user: &str, slurm_conf: &Path, dir: &Path, program: &str) -> Command {
    let mut c = Command::new("setpriv");
    c.args([
        "--reuid",
        user,
        "--regid",
        user,
        "--init-groups",
        "--reset-env",
        "--",
        "env",
    ])
    .arg(format!("SLURM_CONF={}", slurm_conf.display()))
    .arg(program)
    .current_dir(dir);
    c
}

/// A second job user, `gpufence-peer` (uid chosen by `useradd`, 1000 and
/// up: an ordinary user to gpufence), made on this host and, for a
/// cluster of a Debian root, in that root with the same uid and gid; both
/// removed on drop, with whatever still runs as it. For two users' jobs on
/// one GPU (gres/shard, gres/mps).
pub struct PeerUser {
    /// Its name.
    pub name: &'static str,
    /// Its uid.
    pub uid: u32,
    root: Option<PathBuf>,
}

impl PeerUser {
    /// Makes the user (removing a stale one first).
    pub fn create(root: Option<&Path>) -> PeerUser {
        let name = "gpufence-peer";
        let drop_user = |root: Option<&Path>| {
            let mut c = Command::new("userdel");
            c.arg(name);
            let _ = match root {
                Some(r) => {
                    let mut c = Command::new("chroot");
                    c.arg(r).arg("userdel").arg(name);
                    c.output()
                }
                None => c.output(),
            };
        };
        drop_user(root);
        drop_user(None);
        let o = Command::new("useradd")
            .args(["-U", "-M", "-d", "/", "-s", "/bin/sh", name])
            .output()
            .expect("useradd");
        assert!(o.status.success(), "useradd {name}: {o:?}");
        let id = |flag: &str| -> u32 {
            let o = Command::new("id").arg(flag).arg(name).output().unwrap();
            String::from_utf8_lossy(&o.stdout).trim().parse().unwrap()
        };
        let (uid, gid) = (id("-u"), id("-g"));
        if let Some(r) = root {
            let _ = Command::new("chroot")
                .arg(r)
                .args(["groupdel", name])
                .output();
            for args in [
                vec![
                    "groupadd".to_string(),
                    "-g".into(),
                    gid.to_string(),
                    name.into(),
                ],
                vec![
                    "useradd".into(),
                    "-M".into(),
                    "-d".into(),
                    "/".into(),
                    "-s".into(),
                    "/bin/sh".into(),
                    "-u".into(),
                    uid.to_string(),
                    "-g".into(),
                    gid.to_string(),
                    name.into(),
                ],
            ] {
                let o = Command::new("chroot").arg(r).args(&args).output().unwrap();
                assert!(o.status.success(), "in {}: {args:?}: {o:?}", r.display());
            }
        }
        PeerUser {
            name,
            uid,
            root: root.map(Path::to_path_buf),
        }
    }

    /// `program` as this user with the cluster's `SLURM_CONF`, in its
    /// jobs directory (in the cluster's root, if any).
    pub fn cmd(&self, cluster: &Cluster, program: &str) -> Command {
        let c = user_command_as(
            self.name,
            &cluster.slurm_conf,
            &cluster.dir.parent().unwrap().join("jobs"),
            program,
        );
        match &cluster.root {
            Some(r) => in_root(r, &c),
            None => c,
        }
    }

    /// Runs `program args` as this user; returns the output.
    pub fn run(&self, cluster: &Cluster, program: &str, args: &[&str]) -> Output {
        self.cmd(cluster, program)
            .args(args)
            .output()
            .expect("run as peer")
    }
}

impl Drop for PeerUser {
    fn drop(&mut self) {
        let _ = Command::new("pkill")
            .args(["-KILL", "-u", &self.uid.to_string()])
            .output();
        if let Some(r) = &self.root {
            let _ = Command::new("chroot")
                .arg(r)
                .args(["userdel", self.name])
                .output();
        }
        let _ = Command::new("userdel").arg(self.name).output();
    }
}

/// A user made for one test with a uid in 500..=999, what gpufence takes
/// for a system account (`protected_uid_max`, 999 by default) and what a
/// site migrated from old RHEL's `UID_MIN` 500 still hands to people: a
/// login shell (`/bin/sh`) and a home in the test's temp dir. Made on this
/// host and, for a cluster of a Debian root, in that root with the same
/// uid and gid (the root sees the host's `/tmp`). On drop whatever runs as
/// its uid is killed (the uid was free when the test took it) and the user
/// removed from both places.
pub struct LowUser {
    /// Its name.
    pub name: &'static str,
    /// Its uid (and gid).
    pub uid: u32,
    /// Its home, owned by it.
    pub home: PathBuf,
    root: Option<PathBuf>,
}

impl LowUser {
    /// Makes user `name` with `uid` (`None`: the first uid in 500..=999
    /// free as a uid and a gid here) and home `home`, in this host and in
    /// `root`. Panics when the uid is taken.
    pub fn create(
        name: &'static str,
        uid: Option<u32>,
        home: &Path,
        root: Option<&Path>,
    ) -> LowUser {
        let free = |u: u32| {
            nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(u))
                .ok()
                .flatten()
                .is_none()
                && nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(u))
                    .ok()
                    .flatten()
                    .is_none()
        };
        let chroot = |r: &Path, args: &[&str]| {
            Command::new("chroot")
                .arg(r)
                .args(args)
                .output()
                .expect("chroot")
        };
        let _ = Command::new("userdel").arg(name).output();
        if let Some(r) = root {
            let _ = chroot(r, &["userdel", name]);
            let _ = chroot(r, &["groupdel", name]);
        }
        let uid = match uid {
            Some(u) => {
                assert!(free(u), "uid {u} is taken on this host");
                u
            }
            None => (500..1000)
                .find(|u| free(*u))
                .expect("a free uid in 500..=999"),
        };
        let (u, h) = (uid.to_string(), home.display().to_string());
        let o = Command::new("groupadd")
            .args(["-g", &u, name])
            .output()
            .expect("groupadd");
        assert!(o.status.success(), "groupadd: {o:?}");
        let o = Command::new("useradd")
            .args(["-u", &u, "-g", &u, "-M", "-s", "/bin/sh", "-d", &h, name])
            .output()
            .expect("useradd");
        assert!(o.status.success(), "useradd: {o:?}");
        if let Some(r) = root {
            for args in [
                vec!["groupadd", "-g", &u, name],
                vec![
                    "useradd", "-u", &u, "-g", &u, "-M", "-s", "/bin/sh", "-d", &h, name,
                ],
            ] {
                let o = chroot(r, &args);
                assert!(o.status.success(), "in {}: {args:?}: {o:?}", r.display());
            }
        }
        std::fs::create_dir_all(home).expect("home");
        std::os::unix::fs::chown(home, Some(uid), Some(uid)).expect("chown home");
        LowUser {
            name,
            uid,
            home: home.to_path_buf(),
            root: root.map(Path::to_path_buf),
        }
    }

    /// `program` as this user with the cluster's `SLURM_CONF`, in its
    /// home (in the cluster's root, if any).
    pub fn cmd(&self, cluster: &Cluster, program: &str) -> Command {
        let c = user_command_as(self.name, &cluster.slurm_conf, &self.home, program);
        match &cluster.root {
            Some(r) => in_root(r, &c),
            None => c,
        }
    }
}

impl Drop for LowUser {
    fn drop(&mut self) {
        let _ = Command::new("pkill")
            .args(["-KILL", "-u", &self.uid.to_string()])
            .output();
        if let Some(r) = &self.root {
            let _ = Command::new("chroot")
                .arg(r)
                .args(["userdel", self.name])
                .output();
            let _ = Command::new("chroot")
                .arg(r)
                .args(["groupdel", self.name])
                .output();
        }
        let _ = Command::new("userdel").arg(self.name).output();
        let _ = Command::new("groupdel").arg(self.name).output();
    }
}

/// Builds `tests/spank-probe/order_probe.c` (a SPANK plugin that opens
/// devices from its `slurm_spank_task_init`) into `out`, against the
/// `<slurm/spank.h>` of the release in Debian root `root` (`None`: this
/// host's), with this host's compiler and C headers otherwise (a plugin of
/// the older glibc loads under the roots' newer one).
pub fn build_order_probe(root: Option<&Path>, out: &Path) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("spank-probe/order_probe.c");
    let mut c = Command::new("cc");
    c.args(["-shared", "-fPIC", "-Wall", "-Werror", "-o"])
        .arg(out)
        .arg(&src);
    let inc = out.with_extension("include");
    if let Some(r) = root {
        std::fs::create_dir_all(&inc).expect("include dir");
        let link = inc.join("slurm");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(r.join("usr/include/slurm"), &link).expect("symlink");
        c.arg(format!("-I{}", inc.display()));
    }
    let o = c.output().expect("cc");
    assert!(
        o.status.success(),
        "building the probe plugin: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}
