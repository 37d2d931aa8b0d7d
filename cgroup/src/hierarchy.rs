//! The cgroup2 hierarchy: where it is mounted, cgroup ids, which cgroup a
//! process is in, and the few changes gpufence makes (creating its own job
//! cgroups in the `own` layout, moving slurmstepd, removing them at job end).
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

/// The id of the root cgroup of the cgroup2 hierarchy: kernfs numbers the
/// nodes of a root from 1 and the root's own directory comes first
/// (`kernfs_create_root`, `__kernfs_new_node`: `idr_alloc_cyclic(.., 1, ..)`,
/// `fs/kernfs/dir.c`), so `stat` of the hierarchy's root says inode 1 and
/// `bpf_get_current_ancestor_cgroup_id(0)` returns 1. Every other cgroup,
/// a cgroup namespace's root included, has another id.
pub const ROOT_CGROUP_ID: u64 = 1;

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

/// A job cgroup of Slurm's cgroup/v2 plugin, found from slurmstepd's own
/// cgroup by [`find_job_cgroup`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlurmJobCgroup {
    /// The job cgroup, relative to the mount
    /// (`system.slice/node1_slurmstepd.scope/job_7`).
    pub path: String,
    /// Its name, for logs: `job_<id>` (Slurm 22.05-25.11, and 26.05.2+ with
    /// `CgroupJobIdPaths=yes`) or the job's SLUID (26.05 by default).
    pub dir: String,
    /// The step cgroup's name below it (`step_0`, `step_batch`,
    /// `step_extern`, `step_interactive`, `step_0+1` for a het component).
    pub step_dir: String,
}

/// In the `slurm` layout, finds the job cgroup from the cgroup slurmstepd
/// runs in (`own_cgroup`, from the kernel's `/proc/<pid>/cgroup`: where
/// Slurm put its own daemon; never the job's environment) for job `job_id`
/// and step `step` (`0`, `batch`, `extern`, `interactive`: the name Slurm
/// gives the step, as `gpufence_node::job::apply::step_name` spells it).
///
/// Slurm's cgroup/v2 plugin (`cgroup_p_step_create`,
/// `src/plugins/cgroup/v2/cgroup_v2.c`) makes
/// `<scope>/<job dir>/step_<step>/{slurm,user/task_<n>}` and puts slurmstepd
/// in `step_<step>/slurm`, a leaf; with `PrologFlags=RunInJob` (24.05+) the
/// Prolog runs in `<job dir>/step_extern/slurm` too. So `own_cgroup` must
/// end in exactly those three names:
/// - `<job dir>`: `job_<job_id>` for this job id (22.05-25.11; 26.05.2+
///   with `CgroupJobIdPaths=yes`), or a SLUID ([`is_sluid`]; 26.05 names
///   job cgroups by the job's SLUID, and SPANK gives no SLUID to compare
///   with, so any well-formed one is accepted: slurmstepd serves one job,
///   and the step below it must match);
/// - `step_<step>`, or `step_<step>+<n>` for component n of a
///   heterogeneous step (`log_build_step_id_str`, `src/common/log.c`,
///   22.05-25.11 with job ids);
/// - `slurm`.
///
/// Nothing above the job dir may look like a job or a step (`job_<n>`, a
/// SLUID, `step_*`): Slurm makes job dirs right in its scope, never inside
/// another job, so `.../job_7/step_0/user/task_0/job_8/step_0/slurm` (a
/// lookalike made inside job 7's task cgroup, e.g. by a container runtime
/// with a delegated subtree) gives `None` for job 8 (granting it would hand
/// job 8's GPUs to job 7's processes) and for job 7 (its slurmstepd is not
/// there). A deeper cgroup (`.../step_0/slurm/x`) or another step's
/// cgroup gives `None` as well.
pub fn find_job_cgroup(own_cgroup: &str, job_id: u32, step: &str) -> Option<SlurmJobCgroup> {
    let parts: Vec<&str> = own_cgroup.split('/').filter(|s| !s.is_empty()).collect();
    let [above @ .., job_dir, step_dir, leaf] = parts.as_slice() else {
        return None;
    };
    if *leaf != "slurm" {
        return None;
    }
    let step_ok = step_dir.strip_prefix("step_").is_some_and(|s| {
        s == step
            || s.strip_prefix(step)
                .and_then(|r| r.strip_prefix('+'))
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    });
    let job_ok = *job_dir == format!("job_{job_id}") || is_sluid(job_dir);
    let lookalike_above = above
        .iter()
        .any(|p| is_job_id_dir(p) || is_sluid(p) || p.starts_with("step_"));
    if !step_ok || !job_ok || lookalike_above {
        return None;
    }
    Some(SlurmJobCgroup {
        path: parts[..parts.len() - 2].join("/"),
        dir: job_dir.to_string(),
        step_dir: step_dir.to_string(),
    })
}

/// `job_<digits>`: a job cgroup of Slurm by job id.
fn is_job_id_dir(name: &str) -> bool {
    name.strip_prefix("job_")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The job id of a `job_<digits>` cgroup directory name (Slurm's
/// `job_%u`), `None` for anything else (a SLUID names no id).
pub fn job_dir_id(name: &str) -> Option<u32> {
    is_job_id_dir(name)
        .then(|| name.strip_prefix("job_").and_then(|n| n.parse().ok()))
        .flatten()
}

/// Whether cgroup directory `name` is a Slurm job's: `job_<digits>` or a
/// SLUID ([`is_sluid`]).
pub fn is_job_dir(name: &str) -> bool {
    is_job_id_dir(name) || is_sluid(name)
}

/// Whether `name` is a SLUID as Slurm prints it (`print_sluid`,
/// `src/common/sluid.c`, 25.11+): `s`, then 13 characters of Crockford's
/// base32 upper case (`0-9A-Z` without `I L O U`), most significant first,
/// 14 in all (`SLUID_STR_BYTES` 15 with the NUL). 13 × 5 bits hold the
/// 64-bit id, so the first of them carries only 4 bits (`0`-`F`). An id of
/// 0 is invalid (`log_build_step_id_str` prints `Invalid`; the cluster id
/// in the top 12 bits is 2-4095, `generate_cluster_id`), so all zeros is
/// refused. Example: `s7C5M8ST6RSJ00`.
pub fn is_sluid(name: &str) -> bool {
    const CB32: &[u8] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";
    let Some(body) = name.strip_prefix('s') else {
        return false;
    };
    let b = body.as_bytes();
    b.len() == 13
        && b.iter().all(|c| CB32.contains(c))
        && b[0] <= b'F'
        && b.iter().any(|c| *c != b'0')
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

    fn found(own: &str, job: u32, step: &str) -> Option<(String, String)> {
        find_job_cgroup(own, job, step).map(|j| (j.path, j.dir))
    }

    fn some(path: &str, dir: &str) -> Option<(String, String)> {
        Some((path.to_string(), dir.to_string()))
    }

    /// 22.05 and 24.11 (seen): `job_<id>`, slurmstepd in `step_<n>/slurm`.
    #[test]
    fn job_id_dirs() {
        let scope = "system.slice/node1_slurmstepd.scope";
        for (step, name) in [
            ("0", "step_0"),
            ("batch", "step_batch"),
            ("extern", "step_extern"),
            ("interactive", "step_interactive"),
            ("3", "step_3+1"),
        ] {
            let own = format!("{scope}/job_7/{name}/slurm");
            assert_eq!(
                found(&own, 7, step),
                some(&format!("{scope}/job_7"), "job_7"),
                "{own}"
            );
        }
        let j = find_job_cgroup(&format!("{scope}/job_7/step_batch/slurm"), 7, "batch").unwrap();
        assert_eq!(j.step_dir, "step_batch");
        assert_eq!(found("job_7/step_0/slurm", 7, "0"), some("job_7", "job_7"));
        assert_eq!(
            found("system.slice/slurmstepd.scope/job_42/step_0/slurm", 4, "0"),
            None,
            "job_42 is not job_4"
        );
        assert_eq!(found(&format!("{scope}/job_7/step_0/slurm"), 8, "0"), None);
    }

    /// 26.05 (seen): the job dir is the job's SLUID.
    #[test]
    fn sluid_dirs() {
        let scope = "system.slice/node1_slurmstepd.scope";
        assert_eq!(
            found(
                &format!("{scope}/s7C5M8ST6RSJ00/step_extern/slurm"),
                9,
                "extern"
            ),
            some(&format!("{scope}/s7C5M8ST6RSJ00"), "s7C5M8ST6RSJ00")
        );
        assert_eq!(
            found(&format!("{scope}/s7C5M8ST6RSJ00/step_0/slurm"), 9, "0"),
            some(&format!("{scope}/s7C5M8ST6RSJ00"), "s7C5M8ST6RSJ00")
        );
        for name in ["s7C5M8ST6RSJ00", "sF000000000001", "s0123456789ABC"] {
            assert!(is_sluid(name), "{name}");
        }
        for name in [
            "S7C5M8ST6RSJ00",  // print_sluid writes a lower-case s
            "s7c5m8st6rsj00",  // and upper-case digits
            "s7C5M8ST6RSJ0",   // 12 digits
            "s7C5M8ST6RSJ000", // 14
            "s7C5M8ST6RSJ0I",  // I is no Crockford digit
            "s7C5M8ST6RSJ0U",
            "sG000000000000", // more than 64 bits
            "s0000000000000", // id 0: invalid
            "x7C5M8ST6RSJ00",
            "job_7",
            "",
        ] {
            assert!(!is_sluid(name), "{name}");
        }
        assert_eq!(
            found(&format!("{scope}/s7c5m8st6rsj00/step_0/slurm"), 9, "0"),
            None
        );
    }

    #[test]
    fn wrong_step_or_leaf_finds_nothing() {
        let scope = "system.slice/node1_slurmstepd.scope";
        for (own, step) in [
            (format!("{scope}/job_7/step_0/slurm"), "1"),
            (format!("{scope}/job_7/step_0/slurm"), "batch"),
            (format!("{scope}/job_7/step_10/slurm"), "1"),
            (format!("{scope}/job_7/step_1+/slurm"), "1"),
            (format!("{scope}/job_7/step_1+x/slurm"), "1"),
            (format!("{scope}/job_7/step_extern/slurm"), "batch"),
            // the task's cgroup, not slurmstepd's
            (format!("{scope}/job_7/step_0/user/task_0"), "0"),
            (format!("{scope}/job_7/step_0/user"), "0"),
            (format!("{scope}/job_7/step_0"), "0"),
            (format!("{scope}/job_7"), "0"),
            // below slurmstepd's leaf
            (format!("{scope}/job_7/step_0/slurm/x"), "0"),
            (format!("{scope}/job_7/x/step_0/slurm"), "0"),
            (format!("{scope}/job_7/step_0/slurmx"), "0"),
        ] {
            assert_eq!(found(&own, 7, step), None, "{own} step {step}");
        }
    }

    /// A cgroup that looks like Slurm's, made inside job 7's task cgroup:
    /// neither job 8 (its "job cgroup" would be inside job 7: job 7's
    /// processes would get job 8's GPUs) nor job 7 (its slurmstepd is not
    /// there) is found.
    #[test]
    fn lookalikes_inside_a_job_find_nothing() {
        let scope = "system.slice/node1_slurmstepd.scope";
        let own = format!("{scope}/job_7/step_0/user/task_0/job_8/step_0/slurm");
        assert_eq!(found(&own, 8, "0"), None);
        assert_eq!(found(&own, 7, "0"), None);
        let own = format!("{scope}/s7C5M8ST6RSJ00/step_0/user/task_0/s7C5M8ST6RSJ01/step_0/slurm");
        assert_eq!(found(&own, 8, "0"), None);
        let own = format!("{scope}/job_7/step_0/user/task_0/x/job_8/step_0/slurm");
        assert_eq!(found(&own, 8, "0"), None);
    }

    #[test]
    fn no_match() {
        for own in [
            "",
            "system.slice/slurmd.service",
            "system.slice/slurmd.service/slurmd",
            "user.slice/user-1000.slice/session-3.scope",
            "system.slice/node1_slurmstepd.scope",
            "system.slice/node1_slurmstepd.scope/job_/step_0/slurm",
            "system.slice/node1_slurmstepd.scope/job_x/step_0/slurm",
            "system.slice/node1_slurmstepd.scope/7/step_0/slurm",
        ] {
            assert_eq!(found(own, 7, "0"), None, "{own}");
        }
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
