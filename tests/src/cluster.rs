//! A real one-node Slurm cluster (Debian's slurmctld, slurmd, munged) on
//! loopback, started by `contrib/cluster.sh` in a test's temp dir, with
//! gpufence's prolog, epilog and plugin configured and slurmd inside the
//! test's cgroup subtree.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

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
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../contrib/cluster.sh")
}

fn copy_exec(from: &Path, to: &Path) {
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
        ] {
            copy_exec(&workspace_bin(b), &bin.join(b));
        }
        copy_exec(&workspace_bin("libgpufence.so"), &bin.join("gpufence.so"));
        let config = env.config(gpufence_extra);
        // slurmd builds the Prolog's environment from scratch: the config
        // path travels in a wrapper, as it would in /etc/slurm on a node.
        for (name, b) in [
            ("prolog.sh", "gpufence-prolog"),
            ("epilog.sh", "gpufence-epilog"),
        ] {
            let p = bin.join(name);
            std::fs::write(
                &p,
                format!(
                    "#!/bin/sh\nexec {} --config {}\n",
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
        std::fs::write(dir.join("gres.conf"), gres_conf).unwrap();
        let host = hostname();
        std::fs::write(
            dir.join("slurm-extra.conf"),
            format!(
                "NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=2000 Gres={node_gres} State=UNKNOWN\n\
                 PlugStackConfig={plug}\nProlog={prolog}\nEpilog={epilog}\n",
                cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
                plug = dir.join("plugstack.conf").display(),
                prolog = bin.join("prolog.sh").display(),
                epilog = bin.join("epilog.sh").display(),
            ),
        )
        .unwrap();
        let slurmd_cg = env.cgroup("slurmd");
        let out = Command::new("bash")
            .arg(script())
            .arg("start")
            .arg(&dir)
            .env("GPUFENCE_CLUSTER_PORT_BASE", port_base.to_string())
            .env("GPUFENCE_SLURMD_CGROUP", env.cg.path(&slurmd_cg))
            .output()
            .expect("run cluster.sh");
        let c = Cluster {
            slurm_conf: dir.join("slurm.conf"),
            dir,
            bin,
            config,
        };
        assert!(
            out.status.success(),
            "cluster.sh start failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        c
    }

    /// A command run as [`TEST_USER`] (via setpriv: no PAM, no session
    /// cgroup moves) with `SLURM_CONF` set, in the jobs directory.
    pub fn user_cmd(&self, program: &str) -> Command {
        let mut c = Command::new("setpriv");
        c.args([
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
        .arg(program)
        .current_dir(self.dir.parent().unwrap().join("jobs"));
        c
    }

    /// Runs `program args` as the test user; returns the output.
    pub fn as_user(&self, program: &str, args: &[&str]) -> Output {
        self.user_cmd(program)
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
        let _ = Command::new("bash")
            .arg(script())
            .arg("stop")
            .arg(&self.dir)
            .output();
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
