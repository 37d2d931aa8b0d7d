//! The cgroup2 hierarchy: where it is mounted, cgroup ids, which cgroup a
//! process is in, and the few changes gpufence makes (creating its own job
//! cgroups in the `own` layout, moving slurmstepd, removing them at job end).
//!
//! Never assume `/sys/fs/cgroup`: on hybrid hosts (Debian 12 with v1
//! controllers) cgroup2 is at `/sys/fs/cgroup/unified`. The mount is read
//! from `/proc/self/mountinfo`. The device check always runs against the
//! task's cgroup2 cgroup, even on hybrid hosts where that hierarchy has no
//! controllers (`../shared/domain/bpf.md`).

use std::fs::{self, File};
use std::io::{self, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

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
    /// their paths. Stops at the first one that no longer exists.
    pub fn ancestry(&self, rel: &str) -> Vec<(String, u64)> {
        let mut out = Vec::new();
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
        // SAFETY: only open, write and close run between fork and exec.
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
                        // SAFETY: kill(2); a thread id signals its whole
                        // thread group.
                        unsafe { libc::kill(id, libc::SIGKILL) };
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

/// In the `slurm` layout, the job cgroup is the ancestor of slurmstepd's
/// cgroup named `job_<job_id>` (Slurm's cgroup/v2 plugin,
/// `system.slice/slurmstepd.scope/job_<id>/step_<n>/slurm`). Returns its
/// path, or `None` when `own_cgroup` has no such ancestor.
pub fn find_job_cgroup(own_cgroup: &str, job_id: u32) -> Option<String> {
    let want = format!("job_{job_id}");
    let parts: Vec<&str> = own_cgroup.split('/').filter(|s| !s.is_empty()).collect();
    let pos = parts.iter().position(|p| *p == want)?;
    Some(parts[..=pos].join("/"))
}

/// The level of cgroup `rel` (root = 0).
pub fn level_of(rel: &str) -> usize {
    rel.split('/').filter(|s| !s.is_empty()).count()
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

    #[test]
    fn job_cgroup_is_the_named_ancestor() {
        let own = "system.slice/slurmstepd.scope/job_42/step_0/slurm";
        assert_eq!(
            find_job_cgroup(own, 42).as_deref(),
            Some("system.slice/slurmstepd.scope/job_42")
        );
        assert_eq!(find_job_cgroup(own, 4), None, "job_4 is not job_42");
        assert_eq!(find_job_cgroup("system.slice/slurmd.service", 42), None);
        assert_eq!(
            find_job_cgroup("job_7/step_batch", 7).as_deref(),
            Some("job_7")
        );
    }

    #[test]
    fn levels() {
        assert_eq!(level_of(""), 0);
        assert_eq!(level_of("system.slice/slurmstepd.scope/job_1"), 3);
    }
}
