//! The cgroup2 hierarchy: where it is mounted, cgroup ids, which cgroup a
//! process is in, and the few changes gpufence makes (creating cgroups,
//! moving a process, killing and removing a subtree). Paths only: which
//! cgroup is a Slurm job's is the node's business
//! (`gpufence_node::host::slurm_cgroup`).
//!
//! Never assume `/sys/fs/cgroup`: on hybrid hosts (Debian 12 with v1
//! controllers) cgroup2 is at `/sys/fs/cgroup/unified`. The mount is read
//! from `/proc/self/mountinfo`. The device check always runs against the
//! task's cgroup2 cgroup, even on hybrid hosts where that hierarchy has no
//! controllers: `__cgroup_bpf_check_dev_permission` in
//! `kernel/bpf/cgroup.c` runs the programs of `task_dfl_cgroup(current)`,
//! the task's cgroup in the default (v2) hierarchy.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{self, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

pub use crate::level::ROOT_CGROUP_ID;

/// **Test-only switch.** When this variable is `1` in the environment, the
/// cgroup iterator that reads a cgroup namespace root's level answers as a
/// kernel without it does, so tests can check that gpufence then refuses
/// (fails closed) inside a cgroup namespace. It can only make gpufence
/// refuse, never grant at another level; outside a namespace the level is
/// known without the iterator.
pub const FORCE_NO_CGROUP_ITER_ENV: &str = "GPUFENCE_TEST_FORCE_NO_CGROUP_ITER";

/// The ids by level (index 0 the root) of the cgroups from the root of the
/// hierarchy down to a mount's root cgroup, by that cgroup's id: a cgroup
/// never changes parent (`cgroup_rename` refuses another parent, `rmdir`
/// ends the id, and ids are not reused on 64-bit kernels), so an entry
/// stays true for as long as the process runs.
static ROOT_CHAINS: Mutex<BTreeMap<u64, Arc<[u64]>>> = Mutex::new(BTreeMap::new());

/// One cgroup on the way from the root of the hierarchy to a cgroup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ancestor {
    /// Its level as the kernel counts it (root = 0).
    pub level: usize,
    /// Its id.
    pub id: u64,
    /// Its path relative to the mount; `None` above the mount's root (the
    /// part of the hierarchy a cgroup namespace hides).
    pub path: Option<String>,
}

/// The cgroup2 mount.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cgroup2 {
    mount: PathBuf,
}

fn cg_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> Error + 'a {
    move |source| Error::Cgroup {
        op,
        path: path.to_path_buf(),
        source,
    }
}

impl Cgroup2 {
    /// Finds the cgroup2 mount in `/proc/self/mountinfo` (the first one
    /// whose root is `/`).
    ///
    /// # Errors
    /// [`Error::NoCgroup2`] when there is none; [`Error::Cgroup`] when
    /// mountinfo is unreadable.
    pub fn discover() -> Result<Self> {
        let infos = procfs::process::Process::myself()
            .and_then(|p| p.mountinfo())
            .map_err(|e| Error::Cgroup {
                op: "read",
                path: "/proc/self/mountinfo".into(),
                source: io::Error::other(e.to_string()),
            })?;
        infos
            .into_iter()
            .find(|m| m.fs_type == "cgroup2" && m.root == "/")
            .map(|m| Cgroup2 {
                mount: m.mount_point,
            })
            .ok_or(Error::NoCgroup2)
    }

    /// A hierarchy mounted at `mount` (tests).
    pub fn at(mount: impl Into<PathBuf>) -> Self {
        Cgroup2 {
            mount: mount.into(),
        }
    }

    /// The mount point.
    pub fn mount(&self) -> &Path {
        &self.mount
    }

    /// The directory of cgroup `rel` (relative to the mount, `""` is the root).
    pub fn path(&self, rel: &str) -> PathBuf {
        let rel = rel.trim_matches('/');
        if rel.is_empty() {
            self.mount.clone()
        } else {
            self.mount.join(rel)
        }
    }

    /// The id of cgroup `rel`: the inode number of its directory, which is
    /// what `bpf_get_current_ancestor_cgroup_id` returns (kernfs node id).
    ///
    /// # Errors
    /// [`Error::Cgroup`] when the cgroup does not exist.
    pub fn id(&self, rel: &str) -> Result<u64> {
        let p = self.path(rel);
        fs::metadata(&p)
            .map(|m| m.ino())
            .map_err(cg_err("stat", &p))
    }

    /// The cgroup2 path of process `pid`, relative to the mount, from the
    /// `0::` line of `/proc/<pid>/cgroup`.
    ///
    /// # Errors
    /// [`Error::Cgroup`] when the process is gone or has no cgroup2 line.
    pub fn cgroup_of(&self, pid: i32) -> Result<String> {
        let file = PathBuf::from(format!("/proc/{pid}/cgroup"));
        let text = fs::read_to_string(&file).map_err(cg_err("read", &file))?;
        parse_proc_cgroup(&text).ok_or_else(|| Error::Cgroup {
            op: "parse",
            path: file,
            source: io::Error::new(io::ErrorKind::InvalidData, "no cgroup2 (0::) line"),
        })
    }

    /// The ids of `rel`'s ancestors from level 1 down to `rel` itself, with
    /// their paths. Stops at the first one that no longer exists. Empty for
    /// a path with `.` or `..` components (a process outside this cgroup
    /// namespace's root: `mount/..` is no cgroup, and its inode number is
    /// no cgroup id).
    pub fn ancestry(&self, rel: &str) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        if check_inside(rel).is_err() {
            return out;
        }
        let mut cur = String::new();
        for part in rel.split('/').filter(|s| !s.is_empty()) {
            if !cur.is_empty() {
                cur.push('/');
            }
            cur.push_str(part);
            match self.id(&cur) {
                Ok(id) => out.push((cur.clone(), id)),
                Err(_) => break,
            }
        }
        out
    }

    /// The ids of the cgroups from the root of the hierarchy (index 0) down
    /// to the cgroup this mount shows at its root (the last): one id when
    /// the mount shows the whole hierarchy, more in a cgroup namespace.
    ///
    /// The mount's root is the hierarchy's root exactly when its inode is
    /// [`ROOT_CGROUP_ID`] (on a cgroup2 filesystem): then nothing is asked
    /// of BPF. Otherwise the kernel is asked with a cgroup iterator
    /// ([`crate::level::ancestors_up`]) and the answer is kept for the
    /// process's life (a cgroup's place in the hierarchy never changes).
    ///
    /// # Errors
    /// [`Error::Cgroup`] when the mount cannot be opened or is not cgroup2;
    /// [`Error::KernelLevelUnknown`] when the mount's root is not the
    /// hierarchy's root and the kernel cannot say where it is (no cgroup
    /// iterator, no vmlinux BTF, no CAP_BPF/CAP_PERFMON, or the test-only
    /// [`FORCE_NO_CGROUP_ITER_ENV`]).
    pub fn root_chain(&self) -> Result<Arc<[u64]>> {
        let dir = File::open(&self.mount).map_err(cg_err("open", &self.mount))?;
        let id = dir.metadata().map_err(cg_err("stat", &self.mount))?.ino();
        let sfs =
            nix::sys::statfs::fstatfs(&dir).map_err(|e| cg_err("statfs", &self.mount)(e.into()))?;
        if sfs.filesystem_type() != nix::sys::statfs::CGROUP2_SUPER_MAGIC {
            return Err(cg_err("statfs", &self.mount)(io::Error::new(
                io::ErrorKind::InvalidData,
                "not a cgroup2 filesystem",
            )));
        }
        if id == ROOT_CGROUP_ID {
            return Ok(Arc::from([ROOT_CGROUP_ID]));
        }
        let unknown = |detail: String| Error::KernelLevelUnknown {
            mount: self.mount.clone(),
            root_id: id,
            detail,
        };
        if std::env::var_os(FORCE_NO_CGROUP_ITER_ENV).is_some_and(|v| v == "1") {
            return Err(unknown(format!(
                "forced by {FORCE_NO_CGROUP_ITER_ENV}=1 (a test switch)"
            )));
        }
        if let Some(c) = ROOT_CHAINS.lock().ok().and_then(|m| m.get(&id).cloned()) {
            return Ok(c);
        }
        let walk = crate::level::ancestors_up(dir.as_fd()).map_err(|e| unknown(e.to_string()))?;
        let chain: Arc<[u64]> = crate::level::chain_by_level(&walk, id)
            .map_err(|e| unknown(e.to_string()))?
            .into();
        if let Ok(mut m) = ROOT_CHAINS.lock() {
            m.insert(id, chain.clone());
        }
        Ok(chain)
    }

    /// The kernel's level of the cgroup this mount shows at its root: 0
    /// unless in a cgroup namespace. See [`Cgroup2::root_chain`].
    ///
    /// # Errors
    /// As [`Cgroup2::root_chain`].
    pub fn root_level(&self) -> Result<usize> {
        Ok(self.root_chain()?.len() - 1)
    }

    /// The level of cgroup `rel` (relative to the mount) as the kernel
    /// counts it, which is what the fence program's walk
    /// (`bpf_get_current_ancestor_cgroup_id(level)`) and the levels mask
    /// use: the mount root's level plus `rel`'s depth below it.
    ///
    /// # Errors
    /// [`Error::OutsideMount`] for a path with `.` or `..` components (a
    /// process outside this cgroup namespace shows as `/../..` in
    /// `/proc/<pid>/cgroup`); as [`Cgroup2::root_chain`].
    pub fn kernel_level(&self, rel: &str) -> Result<usize> {
        check_inside(rel)?;
        Ok(self.root_level()? + level_of(rel))
    }

    /// The kernel's ancestry of cgroup `rel`: every cgroup from the root
    /// of the hierarchy (level 0) down to `rel` itself, each at its index,
    /// with ids as `bpf_get_current_ancestor_cgroup_id(level)` returns them
    /// for a task in `rel`. Above the mount's root they have no path. Stops
    /// at the first one that no longer exists.
    ///
    /// # Errors
    /// As [`Cgroup2::kernel_level`].
    pub fn kernel_ancestry(&self, rel: &str) -> Result<Vec<Ancestor>> {
        check_inside(rel)?;
        let chain = self.root_chain()?;
        let top = chain.len() - 1;
        let mut out: Vec<Ancestor> = chain
            .iter()
            .enumerate()
            .map(|(level, id)| Ancestor {
                level,
                id: *id,
                path: (level == top).then(String::new),
            })
            .collect();
        for (path, id) in self.ancestry(rel) {
            out.push(Ancestor {
                level: top + level_of(&path),
                id,
                path: Some(path),
            });
        }
        Ok(out)
    }

    /// Every cgroup this mount shows, by id: its path and its kernel level.
    /// A walk of the whole tree (for `fence status` and install, not for
    /// a job's hot path).
    ///
    /// # Errors
    /// As [`Cgroup2::root_chain`].
    pub fn kernel_levels(&self) -> Result<BTreeMap<u64, (String, usize)>> {
        let top = self.root_level()?;
        let mut out = BTreeMap::new();
        let mut stack = vec![String::new()];
        while let Some(rel) = stack.pop() {
            let dir = self.path(&rel);
            let Ok(m) = fs::metadata(&dir) else { continue };
            out.insert(m.ino(), (rel.clone(), top + level_of(&rel)));
            if let Ok(rd) = fs::read_dir(&dir) {
                for e in rd.flatten() {
                    if e.file_type().is_ok_and(|t| t.is_dir()) {
                        if let Some(name) = e.file_name().to_str() {
                            stack.push(if rel.is_empty() {
                                name.to_string()
                            } else {
                                format!("{rel}/{name}")
                            });
                        }
                    }
                }
            }
        }
        Ok(out)
    }

    /// Creates cgroup `rel` and its missing parents.
    ///
    /// # Errors
    /// [`Error::Cgroup`].
    pub fn create(&self, rel: &str) -> Result<()> {
        let p = self.path(rel);
        fs::create_dir_all(&p).map_err(cg_err("mkdir", &p))
    }

    /// Moves process `pid` (all its threads) into cgroup `rel`.
    ///
    /// # Errors
    /// [`Error::Cgroup`].
    pub fn move_pid(&self, rel: &str, pid: i32) -> Result<()> {
        let p = self.path(rel).join("cgroup.procs");
        let mut f = File::options()
            .write(true)
            .open(&p)
            .map_err(cg_err("open", &p))?;
        f.write_all(pid.to_string().as_bytes())
            .map_err(cg_err("write", &p))
    }

    /// Makes the child that `cmd` spawns join cgroup `rel` between fork and
    /// exec (it writes `0` to `cgroup.procs`: open, write and close only,
    /// which are async-signal-safe), so the command runs there from its
    /// first instruction. Spawning fails with the errno when it cannot
    /// join.
    ///
    /// # Errors
    /// [`Error::Cgroup`] (`EINVAL`) when the path holds a NUL byte.
    pub fn join_at_exec(&self, rel: &str, cmd: &mut std::process::Command) -> Result<()> {
        use std::os::unix::ffi::OsStrExt;
        use std::os::unix::process::CommandExt;
        let p = self.path(rel).join("cgroup.procs");
        let procs = std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|_| cg_err("join", &p)(io::Error::from_raw_os_error(libc::EINVAL)))?;
        // SAFETY: between fork and exec the child may only make
        // async-signal-safe calls: the closure runs open(2), write(2) and
        // close(2) and nothing that allocates or locks (raw libc on
        // purpose, no wrapper); `procs` is a NUL-terminated path the
        // closure owns, `b"0"` a static byte, and `fd` is closed on every
        // path after it was opened.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                let r = libc::write(fd, b"0".as_ptr().cast(), 1);
                let err = io::Error::last_os_error();
                libc::close(fd);
                if r != 1 {
                    return Err(err);
                }
                Ok(())
            });
        }
        Ok(())
    }

    /// The processes in `rel` and every cgroup below it.
    pub fn procs_recursive(&self, rel: &str) -> Vec<i32> {
        let mut out = Vec::new();
        let mut stack = vec![self.path(rel)];
        while let Some(dir) = stack.pop() {
            if let Ok(text) = fs::read_to_string(dir.join("cgroup.procs")) {
                out.extend(text.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
            }
            if let Ok(rd) = fs::read_dir(&dir) {
                stack.extend(
                    rd.flatten()
                        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                        .map(|e| e.path()),
                );
            }
        }
        out
    }

    /// Kills every process in `rel` and below: `cgroup.kill` (Linux 5.14+),
    /// then SIGKILL to every thread listed in `cgroup.threads` as well: a
    /// process whose main thread exited (a zombie leader with live threads)
    /// was seen to survive `cgroup.kill` alone on 6.18.
    ///
    /// # Errors
    /// Never: what cannot be killed shows when the cgroup cannot be removed.
    pub fn kill(&self, rel: &str) -> Result<()> {
        let dir = self.path(rel);
        if !dir.exists() {
            return Ok(());
        }
        let _ = fs::write(dir.join("cgroup.kill"), b"1");
        let mut stack = vec![dir];
        while let Some(d) = stack.pop() {
            for file in ["cgroup.procs", "cgroup.threads"] {
                if let Ok(text) = fs::read_to_string(d.join(file)) {
                    for id in text.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                        // A thread id signals its whole thread group.
                        let _ = nix::sys::signal::kill(
                            nix::unistd::Pid::from_raw(id),
                            nix::sys::signal::Signal::SIGKILL,
                        );
                    }
                }
            }
            if let Ok(rd) = fs::read_dir(&d) {
                stack.extend(
                    rd.flatten()
                        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                        .map(|e| e.path()),
                );
            }
        }
        Ok(())
    }

    /// Kills whatever is in cgroup `rel` and below ([`Cgroup2::kill`]) and
    /// removes the tree ([`Cgroup2::remove_tree`]), killing again while
    /// killed processes are still leaving, every 10 ms for up to `wait`.
    /// The one way gpufence ends a cgroup of its own: `gpufence exec`
    /// leaves, `slurmd -G` runs, MPS daemons, the report writer, and the
    /// `own` layout's job cgroups (a stale one in the Prolog, the job's in
    /// the Epilog).
    ///
    /// # Errors
    /// [`Error::Cgroup`] when the tree is still there after `wait`.
    pub fn kill_and_remove(&self, rel: &str, wait: std::time::Duration) -> Result<()> {
        let deadline = std::time::Instant::now() + wait;
        loop {
            self.kill(rel)?;
            match self.remove_tree(rel) {
                Ok(()) => return Ok(()),
                Err(e) if std::time::Instant::now() >= deadline => return Err(e),
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
            }
        }
    }

    /// Removes cgroup `rel` and every cgroup below it, deepest first.
    /// Absent is fine.
    ///
    /// # Errors
    /// [`Error::Cgroup`] for a cgroup that cannot be removed (`EBUSY`: it
    /// still holds processes).
    pub fn remove_tree(&self, rel: &str) -> Result<()> {
        let root = self.path(rel);
        if !root.exists() {
            return Ok(());
        }
        let mut dirs = vec![root.clone()];
        let mut i = 0;
        while i < dirs.len() {
            if let Ok(rd) = fs::read_dir(&dirs[i]) {
                dirs.extend(
                    rd.flatten()
                        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                        .map(|e| e.path()),
                );
            }
            i += 1;
        }
        for d in dirs.iter().rev() {
            match fs::remove_dir(d) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(cg_err("rmdir", d)(e)),
                _ => {}
            }
        }
        Ok(())
    }
}

/// Parses `/proc/<pid>/cgroup`: the path of the `0::` line without its
/// leading `/` (`""` for the root).
pub fn parse_proc_cgroup(text: &str) -> Option<String> {
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(|p| p.trim().trim_start_matches('/').to_string())
}

/// The depth of cgroup `rel` below the mount's root (the mount's root =
/// 0). This is the kernel's level only when the mount shows the whole
/// hierarchy; [`Cgroup2::kernel_level`] is the kernel's level everywhere.
pub fn level_of(rel: &str) -> usize {
    rel.split('/').filter(|s| !s.is_empty()).count()
}

/// Refuses a path that leaves the mount (`..`) or that a depth count would
/// miscount (`.`).
fn check_inside(rel: &str) -> Result<()> {
    if rel.split('/').any(|p| p == ".." || p == ".") {
        return Err(Error::OutsideMount {
            path: rel.to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child that cannot join its cgroup never runs: spawning fails with
    /// the errno of the join (here a directory with no `cgroup.procs`).
    /// That it runs inside the cgroup when it can is the kernel tests'
    /// EPERM/ENXIO observable (`TestEnv::command_in`, `gpufence exec`).
    #[test]
    fn a_child_that_cannot_join_does_not_run() {
        let d = tempfile::tempdir().unwrap();
        let marker = d.path().join("ran");
        let mut cmd = std::process::Command::new("sh");
        cmd.arg("-c").arg(format!("touch {}", marker.display()));
        Cgroup2::at(d.path())
            .join_at_exec("missing", &mut cmd)
            .unwrap();
        let e = cmd.status().unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT), "{e}");
        assert!(!marker.exists());
        // A path with a NUL byte is refused before anything is spawned.
        let mut cmd = std::process::Command::new("true");
        assert!(Cgroup2::at(d.path())
            .join_at_exec("a\0b", &mut cmd)
            .is_err());
    }

    #[test]
    fn proc_cgroup_lines() {
        assert_eq!(parse_proc_cgroup("0::/\n").as_deref(), Some(""));
        assert_eq!(
            parse_proc_cgroup("12:devices:/slurm/uid_0\n0::/system.slice/slurmd.service\n")
                .as_deref(),
            Some("system.slice/slurmd.service")
        );
        assert_eq!(parse_proc_cgroup("4:memory:/x\n"), None);
    }

    /// A process outside a cgroup namespace's root shows as `/../x`: no
    /// ancestry (the mount's parent directory is no cgroup) and no level.
    #[test]
    fn paths_leaving_the_mount_have_no_ancestry() {
        let d = tempfile::tempdir().unwrap();
        fs::create_dir_all(d.path().join("a/x")).unwrap();
        let cg = Cgroup2::at(d.path().join("a"));
        assert_eq!(cg.ancestry("x").len(), 1);
        for rel in ["../a/x", "./x", "x/..", "x/../x"] {
            assert!(cg.ancestry(rel).is_empty(), "{rel}");
            assert!(matches!(
                cg.kernel_level(rel),
                Err(Error::OutsideMount { .. })
            ));
        }
        // Not cgroup2: no level at all.
        assert!(matches!(cg.root_level(), Err(Error::Cgroup { .. })));
    }

    #[test]
    fn levels() {
        assert_eq!(level_of(""), 0);
        assert_eq!(level_of("system.slice/slurmstepd.scope/job_1"), 3);
    }
}
