//! A real cgroup/v2 Slurm node on this machine: Slurm's own cgroup/v2
//! plugin, `ProctrackType=proctrack/cgroup`, `TaskPlugin=task/cgroup`,
//! `ConstrainDevices=yes`, slurmd started as systemd starts it (in
//! `system.slice/slurmd.service`, with `INVOCATION_ID`), and gpufence with
//! its default `layout = "slurm"`.
//!
//! On a hybrid-cgroup host (this project's CI machine: v1 controllers under
//! `/sys/fs/cgroup/<ctrl>`, cgroup2 at `/sys/fs/cgroup/unified`) slurmd runs
//! through `contrib/v2node/enter.sh`: a private mount namespace with
//! cgroup2 at `/sys/fs/cgroup` and an `LD_PRELOAD` library that hides the v1
//! lines of `/proc/<pid>/cgroup`, on which Slurm's cgroup/v2 plugin dies
//! (`src/plugins/cgroup/v2/cgroup_v2.c`, "Hybrid mode is not supported").
//! The host's mounts stay as they are.
//!
//! Slurm then builds its tree at the cgroup2 root (`system.slice/<NodeName>_slurmstepd.scope`:
//! Debian builds Slurm with `MULTIPLE_SLURMD`), so only one such node runs
//! on a machine at a time ([`V2Slice`] holds a lock), and the fence under
//! test is attached to `system.slice`: never to the machine's root cgroup.
//! `system.slice` is made by the test only where none exists, and removed
//! with all it holds afterwards.
//!
//! While such a node runs, `system.slice/slurmd.service` exists at the
//! cgroup2 root, and every fence installed with the default
//! `exempt_cgroups` exempts it. The tests that use this module therefore
//! live in test binaries of their own (`tests/e2e_v2node.rs`): `cargo test`
//! runs one test binary at a time, so no other test's fence sees them.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpufence_cgroup::Cgroup2;

use crate::cluster::V2NodeSpec;

/// The slice Slurm's cgroup/v2 plugin puts slurmd and its scope in, and the
/// fence's `cgroup_root` on the test node.
pub const SLICE: &str = "system.slice";

/// Where slurmd runs, relative to the cgroup2 mount (systemd's unit cgroup).
pub const SLURMD_SERVICE: &str = "system.slice/slurmd.service";

/// Serialises the real cgroup/v2 nodes of concurrent tests (and test
/// runs): Slurm's tree is at the cgroup2 root, there is room for one.
const LOCK: &str = "/run/lock/gpufence-v2node.lock";

/// cgroup.conf of a stock cgroup/v2 node, as far as this host allows:
/// no v2 controllers are available in this host's cgroup2 tree, so the
/// resource constraints are off (Slurm logs `Controller cpuset is not
/// enabled!` and goes on); devices need no controller in cgroup v2 (a BPF
/// program). `IgnoreSystemd=yes`: Slurm makes its scope with `mkdir`
/// instead of asking systemd over D-Bus (there is no systemd here).
pub const CGROUP_CONF: &str = "CgroupPlugin=cgroup/v2\nIgnoreSystemd=yes\n\
     ConstrainDevices=yes\nConstrainCores=no\nConstrainRAMSpace=no\nConstrainSwapSpace=no\n";

/// Takes the machine's one real cgroup/v2 node slot (its ports, Slurm's
/// tree), waiting for another test's to end; held until dropped. For a
/// node that needs no `system.slice` at the root (slurmd in a container).
pub fn lock_node() -> std::fs::File {
    let _ = std::fs::create_dir_all("/run/lock");
    let lock = std::fs::File::create(LOCK).expect("v2node lock");
    gpufence_model::fsutil::lock_exclusive(&lock).unwrap_or_else(|e| panic!("flock {LOCK}: {e}"));
    lock
}

/// `system.slice` claimed for one test: made here (when absent), with
/// `slurmd.service` below it; on drop everything left in it is killed and
/// the slice removed.
pub struct V2Slice {
    cg: Cgroup2,
    _lock: Option<std::fs::File>,
    made: bool,
}

impl V2Slice {
    /// Takes the machine's one real cgroup/v2 node slot (waits for another
    /// test's to end) and makes `system.slice/slurmd.service`.
    ///
    /// Panics when a `system.slice` with processes exists (a systemd host:
    /// its real services are there, and the test must not touch them).
    pub fn claim() -> V2Slice {
        let cg = Cgroup2::discover().expect("cgroup2");
        let lock = lock_node();
        if cg.path(SLICE).exists() {
            let procs = cg.procs_recursive(SLICE);
            assert!(
                procs.is_empty(),
                "{} exists with processes {procs:?}: this machine's own services live there; \
                 the real cgroup/v2 node tests need a machine whose cgroup2 root has no system.slice",
                cg.path(SLICE).display()
            );
            // An empty one is what a killed earlier run of this test left.
            cg.remove_tree(SLICE)
                .expect("remove a stale, empty system.slice");
        }
        cg.create(SLURMD_SERVICE)
            .expect("create system.slice/slurmd.service");
        V2Slice {
            cg,
            _lock: Some(lock),
            made: true,
        }
    }

    /// A value for [`V2Slice::spec`] alone, with no slice made or locked
    /// (a node whose tree lives elsewhere, e.g. in a container's cgroup).
    pub fn unclaimed() -> V2Slice {
        V2Slice {
            cg: Cgroup2::discover().expect("cgroup2"),
            _lock: None,
            made: false,
        }
    }

    /// slurmd's cgroup directory (absolute, on this process's mount).
    pub fn slurmd_cgroup(&self) -> PathBuf {
        self.cg.path(SLURMD_SERVICE)
    }

    /// A [`V2NodeSpec`] for a stock node: `PrologFlags=<prolog_flags>`
    /// (`Alloc,Contain` as most GPU sites set; `RunInJob` from 24.05).
    pub fn spec(&self, prolog_flags: &str) -> V2NodeSpec {
        V2NodeSpec {
            slurmd_cgroup: self.slurmd_cgroup(),
            fence_root: SLICE.into(),
            slurm_conf: format!(
                "ProctrackType=proctrack/cgroup\nTaskPlugin=task/cgroup\nPrologFlags={prolog_flags}\n"
            ),
            cgroup_conf: CGROUP_CONF.into(),
            cgroupns: false,
        }
    }

    /// Slurm's scope for node `node_name` (`MULTIPLE_SLURMD` builds:
    /// `<NodeName>_slurmstepd.scope`), relative to the mount.
    pub fn scope(node_name: &str) -> String {
        format!("{SLICE}/{node_name}_slurmstepd.scope")
    }

    /// The job cgroups under Slurm's scope: directories named `job_<id>`,
    /// or a SLUID (26.05).
    pub fn job_cgroups(&self, node_name: &str) -> Vec<String> {
        let Ok(rd) = std::fs::read_dir(self.cg.path(&V2Slice::scope(node_name))) else {
            return Vec::new();
        };
        rd.flatten()
            .filter(|e| e.path().is_dir())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("job_") || gpufence_node::host::slurm_cgroup::is_sluid(n))
            .collect()
    }
}

impl V2Slice {
    /// Waits up to 30 s for the job cgroups under `node_name`'s scope to go
    /// (slurmstepd removes a job cgroup as it exits, which may be just after
    /// the node reads idle), and panics naming those left, with the
    /// processes and cgroups in each.
    ///
    /// One leftover is Slurm's and is excused, with a line on stderr
    /// (which quotes the extern step's logged errors), on a `release`
    /// before 24.11.6 only: a `job_<id>` that holds no process and no
    /// cgroup but its extern step's. There slurmstepd's SIGTERM handler
    /// drops privileges process-wide for the X11 shutdown
    /// (`_shutdown_x11_forward`, `src/slurmd/slurmstepd/mgr.c`) while
    /// `cgroup_p_step_destroy` (`src/plugins/cgroup/v2/cgroup_v2.c`) moves
    /// the step daemon out and removes the step's cgroups as root: a move
    /// or a removal fails with EACCES and the extern step's and the job's
    /// cgroups stay. SchedMD ticket 22736, fixed by commit 1c065cb908 in
    /// 25.05 and its cherry-pick 46cec1d440 in 24.11.6 (seen here on
    /// Debian trixie's 24.11.5; 22.05 has the same handler). The failure
    /// is not always in the log at its default level (an `EBUSY` removal
    /// is logged at `debug2`), so the log's line is quoted, not required.
    /// gpufence makes no cgroup under a Slurm job cgroup and stops no step
    /// daemon: a leftover with a process, or with any other cgroup, or on
    /// a fixed release, fails.
    pub fn assert_no_job_cgroups(&self, node_name: &str, log_dir: &Path, release: &Release) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let left = loop {
            let left = self.job_cgroups(node_name);
            if left.is_empty() || Instant::now() > deadline {
                break left;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let logs = logs_in(log_dir);
        let racy = slurm_has_x11_race(&release.slurm_version());
        // (job cgroup, its processes, its cgroups, its extern step's errors)
        type Left = (String, Vec<i32>, Vec<String>, Vec<String>);
        let mut inside: Vec<Left> = Vec::new();
        for j in left {
            let rel = format!("{}/{j}", V2Slice::scope(node_name));
            let procs = self.cg.procs_recursive(&rel);
            let dirs = subdirs(&self.cg.path(&rel));
            let extern_only = dirs
                .iter()
                .all(|d| d == "step_extern" || d.starts_with("step_extern/"));
            if racy && procs.is_empty() && extern_only {
                eprintln!(
                    "{j} left by slurmstepd's X11 shutdown race (Slurm ticket 22736, fixed in 24.11.6){}: {:?}",
                    if slurm_x11_race(&logs, &j, node_name) {
                        ", its error logged"
                    } else {
                        ", no error logged at this level"
                    },
                    extern_errors(&logs, &j)
                );
                continue;
            }
            let errors: Vec<String> = extern_errors(&logs, &j)
                .into_iter()
                .map(str::to_string)
                .collect();
            inside.push((j, procs, dirs, errors));
        }
        assert!(
            inside.is_empty(),
            "job cgroups left under /{} (with the processes, the cgroups and the extern step's logged errors of each): {inside:?}",
            V2Slice::scope(node_name)
        );
    }

    /// Kills what is left in the job cgroups under `node_name`'s scope and
    /// removes them, waiting up to 10 s (a step daemon of a stopped
    /// cluster may still be exiting there); panics naming any that stays.
    /// Between two clusters on one slice, so that the second starts from
    /// no job cgroup of the first (both number their jobs from 1).
    pub fn clear_job_cgroups(&self, node_name: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let left = self.job_cgroups(node_name);
            if left.is_empty() {
                return;
            }
            for j in &left {
                let rel = format!("{}/{j}", V2Slice::scope(node_name));
                let _ = self.cg.kill(&rel);
                let _ = self.cg.remove_tree(&rel);
            }
            assert!(
                Instant::now() < deadline,
                "job cgroups of a stopped cluster stay under /{}: {left:?}",
                V2Slice::scope(node_name)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for V2Slice {
    fn drop(&mut self) {
        if !self.made {
            return;
        }
        let _ = self.cg.kill(SLICE);
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.cg.remove_tree(SLICE).is_err() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A Slurm release to run a node with: this host's (22.05), or one in a
/// Debian root (`contrib/v2node/make-root.sh`) with the plugin built
/// against its headers (`contrib/v2node/build-plugin.sh`).
pub struct Release {
    /// A Debian root of that release; `None`: this host's Slurm.
    pub root: Option<PathBuf>,
    /// The plugin built against its headers; `None`: the workspace's.
    pub plugin: Option<PathBuf>,
}

impl Release {
    /// This host's Slurm.
    pub fn host() -> Release {
        Release {
            root: None,
            plugin: None,
        }
    }

    /// The release in the Debian root of `suite` under
    /// `$GPUFENCE_SLURM_ROOTS` (default `/var/cache/gpufence/roots`), with
    /// its plugin at `target/v2node/<suite>.gpufence.so`; `contrib/test.sh`
    /// makes both. Missing: a failure in CI, a skip elsewhere.
    pub fn debian(suite: &str) -> Option<Release> {
        Release::debian_having(suite, None)
    }

    /// [`Release::debian`], whose root must also hold `file` (absolute in
    /// the root: a tool a test runs there, from a newer `make-root.sh`).
    pub fn debian_having(suite: &str, file: Option<&str>) -> Option<Release> {
        let roots = std::env::var_os("GPUFENCE_SLURM_ROOTS")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/var/cache/gpufence/roots"));
        let root = roots.join(suite);
        let exe = std::env::current_exe().unwrap();
        let target = exe
            .parent()
            .and_then(Path::parent)
            .and_then(Path::parent)
            .unwrap();
        let plugin = target.join(format!("v2node/{suite}.gpufence.so"));
        let why = if !root.join(".gpufence-root").exists() {
            format!("no Debian {suite} root at {}", root.display())
        } else if !plugin.exists() {
            format!("no plugin built for it at {}", plugin.display())
        } else if let Some(f) = file.filter(|f| !root.join(f.trim_start_matches('/')).exists()) {
            format!(
                "the root at {} has no {f} (made before it was added)",
                root.display()
            )
        } else {
            return Some(Release {
                root: Some(root),
                plugin: Some(plugin),
            });
        };
        let fix = format!(
            "contrib/v2node/make-root.sh {suite} {}; contrib/v2node/build-plugin.sh {} {} (contrib/test.sh does both)",
            root.display(),
            root.display(),
            plugin.display()
        );
        if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") {
            panic!("{why}: {fix}");
        }
        eprintln!("SKIPPED (outside CI): {why}: {fix}");
        None
    }

    /// `path` (absolute) in the release's filesystem.
    pub fn file(&self, path: &str) -> PathBuf {
        match &self.root {
            Some(r) => r.join(path.trim_start_matches('/')),
            None => PathBuf::from(path),
        }
    }

    /// `host`, or `root <dir>`: for reports.
    pub fn name(&self) -> String {
        match &self.root {
            Some(r) => format!("root {}", r.display()),
            None => "host".into(),
        }
    }

    /// `slurmd -V` of the release (empty when it cannot say).
    pub fn slurm_version(&self) -> String {
        let mut c = match &self.root {
            Some(r) => {
                let mut c = std::process::Command::new("chroot");
                c.arg(r).arg("slurmd");
                c
            }
            None => std::process::Command::new("slurmd"),
        };
        c.arg("-V")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    }
}

/// The cgroups below `dir`, relative to it, parents first (a diagnostic:
/// which step's cgroup Slurm left).
fn subdirs(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                let p = e.path();
                out.push(p.strip_prefix(dir).unwrap_or(&p).display().to_string());
                todo.push(p);
            }
        }
    }
    out.sort();
    out
}

/// The text of every file in `dir` (empty when it cannot be read).
fn logs_in(dir: &Path) -> String {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| std::fs::read_to_string(e.path()).ok())
                .collect::<Vec<_>>()
                .join("\n")
        })
        .unwrap_or_default()
}

/// `logs` show the X11 shutdown race for job cgroup `job` (`job_<id>`)
/// of node `node_name`: an error of its extern step that a root step
/// daemon cannot have, naming that node's scope (every node of a test
/// cluster logs to one file): "Permission denied" on a cgroup file of the
/// scope (moving itself out, `common_file_write_uints`; removing a task's
/// or the step's cgroup, `common_cgroup_delete`,
/// `src/plugins/cgroup/common/cgroup_common.c`), or "Unable to move pid"
/// (`cgroup_p_step_destroy`, `src/plugins/cgroup/v2/cgroup_v2.c`).
fn slurm_x11_race(logs: &str, job: &str, node_name: &str) -> bool {
    extern_errors(logs, job).iter().any(|l| {
        l.contains(&format!("/{node_name}_slurmstepd.scope/"))
            && (l.contains("Permission denied") || l.contains("Unable to move pid "))
    })
}

/// The error lines of job cgroup `job`'s (`job_<id>`) extern step in
/// `logs`, at most 8 (for a failure's message).
fn extern_errors<'a>(logs: &'a str, job: &str) -> Vec<&'a str> {
    let Some(id) = job.strip_prefix("job_") else {
        return Vec::new();
    };
    let tag = format!("[{id}.extern] error: ");
    logs.lines().filter(|l| l.contains(&tag)).take(8).collect()
}

/// Whether Slurm `version` (`slurmd -V`: `slurm 24.11.5`) has the X11
/// shutdown race: before 24.11.6 (ticket 22736). An unreadable version
/// has it not (nothing is excused).
fn slurm_has_x11_race(version: &str) -> bool {
    let v: Vec<u32> = version
        .split_whitespace()
        .last()
        .unwrap_or("")
        .split(['.', '-'])
        .map_while(|p| p.parse().ok())
        .collect();
    v.len() >= 3 && (v[0], v[1], v[2]) < (24, 11, 6)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_x11_race_is_the_extern_steps_own() {
        let logs = "[2026-12-07T21:15:55.827] [3.extern] error: Unable to move pid 18883 to system cgroup /sys/fs/cgroup/system.slice/vm_slurmstepd.scope/system\n\
                    [2026-12-07T21:15:55.827] [4.0] error: Unable to move pid 1 to system cgroup /x\n\
                    [2026-12-07T21:15:56.001] [5.extern] error: Unable to rmdir(/sys/fs/cgroup/system.slice/vm_slurmstepd.scope/job_5/step_extern/user/task_special), unexpected error: Permission denied\n\
                    [2026-12-07T21:15:56.002] [6.extern] error: Unable to rmdir(/sys/fs/cgroup/system.slice/vm_slurmstepd.scope/job_6/step_extern/slurm), unexpected error: Device or resource busy\n";
        assert!(slurm_x11_race(logs, "job_3", "vm"));
        assert!(
            !slurm_x11_race(logs, "job_3", "vm2"),
            "another node's scope"
        );
        assert!(
            !slurm_x11_race(logs, "job_4", "vm"),
            "a step other than extern"
        );
        assert!(!slurm_x11_race(logs, "job_33", "vm"));
        assert!(
            !slurm_x11_race(logs, "s7C5M8ST6RSJ00", "vm"),
            "a SLUID (26.05)"
        );
        assert!(
            slurm_x11_race(logs, "job_5", "vm"),
            "a removal refused to the dropped ids"
        );
        assert!(!slurm_x11_race(logs, "job_6", "vm"), "busy is not the race");
        assert_eq!(extern_errors(logs, "job_6").len(), 1);
        assert!(slurm_has_x11_race("slurm 24.11.5"));
        assert!(slurm_has_x11_race("slurm-wlm 22.05.8"));
        assert!(!slurm_has_x11_race("slurm 24.11.6"));
        assert!(!slurm_has_x11_race("slurm 25.05.0"));
        assert!(!slurm_has_x11_race("slurm 26.05.0-0rc1"));
        assert!(!slurm_has_x11_race(""));
    }
}
