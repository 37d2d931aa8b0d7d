//! Leftovers in the shared-memory directory (`shm_dir`, `/dev/shm`): the
//! POSIX shared memory (`shm_open(3)` makes `/dev/shm/<name>`) and the
//! files inference and MPI stacks keep there (`vllm-*`, `nccl-*`,
//! `psm_*`, `sem.*`). A job killed at its time limit leaves them behind,
//! often readable by everyone, holding memory on a tmpfs until the next
//! reboot. The Epilog reports those of the job's user that no process
//! holds; `gpufence sweep` reports every user's with their age.

use std::collections::{BTreeSet, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;

/// One file left in the shared-memory directory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Leftover {
    /// Its name in the directory.
    pub name: String,
    /// Size in bytes.
    pub size_bytes: u64,
    /// Permission bits, octal (`0644`).
    pub mode: String,
    /// Owner uid.
    pub uid: u32,
    /// Last change, seconds since the epoch.
    pub modified: i64,
    /// Its inode, to tell it from a file put in its place before a removal.
    #[serde(skip)]
    ino: u64,
}

impl Leftover {
    /// Seconds since its last change, as of `now`.
    pub fn age_seconds(&self, now: SystemTime) -> u64 {
        let m = SystemTime::UNIX_EPOCH + Duration::from_secs(self.modified.max(0) as u64);
        now.duration_since(m).map(|d| d.as_secs()).unwrap_or(0)
    }
}

/// How many entries of the shared-memory directory one call of
/// [`leftovers`] examines (one `lstat` each): a user who leaves 100,000
/// files there costs every Epilog and sweep this much, no more. Entries
/// past it are left for a later call; [`Leftovers::complete`] says so.
pub const EXAMINED_MAX: usize = 20_000;

/// What [`leftovers`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Leftovers {
    /// The leftovers, by name.
    pub files: Vec<Leftover>,
    /// Whether every entry of the directory was examined (at most
    /// [`EXAMINED_MAX`] are).
    pub complete: bool,
    /// Live processes [`held`] could not read (unreadable, or past its
    /// time): any of them may hold any of `files`, so none may be removed
    /// while this is not 0.
    pub unread: usize,
}

impl Leftovers {
    /// Their total size in bytes.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size_bytes).sum()
    }
}

/// Regular files in `dir` (not followed: a symbolic link or a directory is
/// never one) owned by a uid `owner` accepts and changed at or after
/// `since`, that no process read within `within` holds open or mapped
/// ([`held`]; those not read are counted in [`Leftovers::unread`]). At
/// most [`EXAMINED_MAX`] entries are examined. Nothing when `dir` cannot
/// be read.
pub fn leftovers(
    dir: &Path,
    owner: &dyn Fn(u32) -> bool,
    since: Option<SystemTime>,
    within: Duration,
) -> Leftovers {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Leftovers {
            files: Vec::new(),
            complete: true,
            unread: 0,
        };
    };
    // In nanoseconds: a job's files and the next job's start often fall in
    // one second.
    let ns = |secs: i64, nsec: i64| i128::from(secs) * 1_000_000_000 + i128::from(nsec);
    let since = since.map(|t| {
        t.duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos() as i128)
            .unwrap_or(0)
    });
    let mut out: Vec<Leftover> = Vec::new();
    let mut complete = true;
    for (examined, e) in rd.filter_map(|e| e.ok()).enumerate() {
        if examined >= EXAMINED_MAX {
            complete = false;
            break;
        }
        let Ok(md) = std::fs::symlink_metadata(e.path()) else {
            continue;
        };
        let Ok(name) = e.file_name().into_string() else {
            continue;
        };
        if md.file_type().is_file()
            && owner(md.uid())
            && since.is_none_or(|s| {
                ns(md.mtime(), md.mtime_nsec()) >= s || ns(md.ctime(), md.ctime_nsec()) >= s
            })
        {
            out.push(Leftover {
                name,
                size_bytes: md.size(),
                mode: format!("{:04o}", md.mode() & 0o7777),
                uid: md.uid(),
                modified: md.mtime(),
                ino: md.ino(),
            });
        }
    }
    let mut unread = 0;
    if !out.is_empty() {
        let candidates: HashSet<&str> = out.iter().map(|l| l.name.as_str()).collect();
        let held = held(dir, &candidates, within);
        unread = held.unread;
        out.retain(|l| !held.names.contains(&l.name));
        out.sort_by(|a, b| a.name.cmp(&b.name));
    }
    Leftovers {
        files: out,
        complete,
        unread,
    }
}

/// What [`held`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// The candidates a process read holds.
    pub names: BTreeSet<String>,
    /// Live processes not read: `maps` or `fd` unreadable, or met past
    /// the time [`held`] had. Each may hold any candidate.
    pub unread: usize,
}

/// Those of `candidates` (names of files directly in `dir`) that a live
/// process holds: a descriptor (`/proc/<pid>/fd/*`, the link's target) or
/// a mapping (`maps`, its path column; through a live thread's view when
/// the leader exited, `read_maps` in `crate::holders::scan`). Read only when
/// there are candidates, so an Epilog with nothing left pays one
/// directory read; what is kept is bounded by the candidates, whatever
/// the processes hold. Every read ends by `within` from now (the clock is
/// looked at before each process and each descriptor): a live process not
/// read whole by then, or whose `maps` or `fd` cannot be read, counts in
/// [`Held::unread`]; one gone meanwhile holds nothing.
pub fn held(dir: &Path, candidates: &HashSet<&str>, within: Duration) -> Held {
    let end = Instant::now() + within;
    let late = || Instant::now() >= end;
    let alive = crate::host::procs::alive;
    let prefix = format!("{}/", dir.display().to_string().trim_end_matches('/'));
    let name_of = |p: &str| -> Option<String> {
        let rest = p.strip_prefix(&prefix)?;
        let name = rest.trim_end_matches(" (deleted)");
        (!rest.contains('/') && candidates.contains(name)).then(|| name.to_string())
    };
    let mut out = BTreeSet::new();
    let mut unread = 0;
    'procs: for pid in crate::holders::scan::pids() {
        if late() {
            unread += usize::from(alive(pid));
            continue;
        }
        // A live thread's view when the leader exited: it shows the
        // process's descriptors and mappings.
        let Some((base, maps)) =
            crate::holders::scan::read_maps(Path::new(&format!("/proc/{pid}")), pid)
        else {
            unread += usize::from(alive(pid));
            continue;
        };
        match std::fs::read_dir(base.join("fd")) {
            Ok(rd) => {
                for e in rd.filter_map(|e| e.ok()) {
                    if late() {
                        unread += usize::from(alive(pid));
                        continue 'procs;
                    }
                    if let Ok(t) = std::fs::read_link(e.path()) {
                        out.extend(t.to_str().and_then(name_of));
                    }
                }
            }
            Err(_) => {
                unread += usize::from(alive(pid));
                continue;
            }
        }
        for line in maps.lines() {
            // address perms offset dev inode path (the path may hold spaces)
            if let Some(at) = line.find(&prefix) {
                out.extend(name_of(&line[at..]));
            }
        }
    }
    Held { names: out, unread }
}

/// Removes `files` from `dir`: each only if the name is still a regular
/// file with the same inode and owner (never a link put in its place).
/// Returns the names not removed, with why.
pub fn remove(dir: &Path, files: &[Leftover]) -> Vec<(String, String)> {
    let mut failed = Vec::new();
    for f in files {
        let p = dir.join(&f.name);
        match std::fs::symlink_metadata(&p) {
            Ok(md) if md.file_type().is_file() && md.ino() == f.ino && md.uid() == f.uid => {
                if let Err(e) = std::fs::remove_file(&p) {
                    failed.push((f.name.clone(), e.to_string()));
                }
            }
            Ok(_) => failed.push((f.name.clone(), "replaced since it was seen".into())),
            Err(e) => failed.push((f.name.clone(), e.to_string())),
        }
    }
    failed
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn leftovers_are_the_unheld_regular_files_of_the_owner() {
        let d = tempfile::tempdir().unwrap();
        let me = nix_uid();
        let w = |n: &str, len: usize| {
            std::fs::write(d.path().join(n), vec![0u8; len]).unwrap();
            std::fs::set_permissions(d.path().join(n), std::fs::Permissions::from_mode(0o644))
                .unwrap();
        };
        w("vllm-1234", 4096);
        w("psm_shm.abc", 10);
        w("held-open", 1);
        w("mapped", 4096);
        std::os::unix::fs::symlink("/etc/passwd", d.path().join("link")).unwrap();
        std::fs::create_dir(d.path().join("sub")).unwrap();
        let _open = std::fs::File::open(d.path().join("held-open")).unwrap();
        let m = std::fs::File::open(d.path().join("mapped")).unwrap();
        // SAFETY: a read mapping of one page of a file we hold.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ,
                libc::MAP_SHARED,
                std::os::fd::AsRawFd::as_raw_fd(&m),
                0,
            )
        };
        assert_ne!(map, libc::MAP_FAILED);
        drop(m);
        // Live processes whose maps cannot be read here (root may still be
        // refused one: a process holding a capability root lacks, as pid 1
        // of some sandboxes): `held` must count exactly those, so the count
        // lies between the processes unreadable both before and after the
        // call and those unreadable either time.
        let unreadable = || -> BTreeSet<i32> {
            std::fs::read_dir("/proc")
                .unwrap()
                .flatten()
                .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse().ok()))
                .filter(|p: &i32| {
                    std::fs::read(format!("/proc/{p}/maps")).is_err()
                        && gpufence_model::procstat::ProcStat::of(*p)
                            .is_some_and(|s| s.state != 'Z')
                })
                .collect()
        };
        let before = unreadable();
        let all = leftovers(d.path(), &|u| u == me, None, Duration::from_secs(60));
        let after = unreadable();
        if me == 0 {
            let (both, either) = (
                before.intersection(&after).count(),
                before.union(&after).count(),
            );
            assert!(
                (both..=either).contains(&all.unread),
                "as root, unread {} where {before:?} then {after:?} could not be read",
                all.unread
            );
        }
        let got = all.files;
        let names: Vec<&str> = got.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(names, ["psm_shm.abc", "vllm-1234"]);
        assert_eq!(
            (got[1].size_bytes, got[1].mode.as_str(), got[1].uid),
            (4096, "0644", me)
        );
        let long = Duration::from_secs(60);
        assert!(leftovers(d.path(), &|u| u != me, None, long)
            .files
            .is_empty());
        let later = SystemTime::now() + Duration::from_secs(3600);
        assert!(leftovers(d.path(), &|_| true, Some(later), long)
            .files
            .is_empty());
        // No time to read: every live process (this one at least) is not
        // read, and may hold any of them.
        let late = leftovers(d.path(), &|u| u == me, None, Duration::ZERO);
        assert!(late.unread >= 1, "{late:?}");
        let h = held(
            d.path(),
            &["held-open", "mapped"].into_iter().collect(),
            Duration::ZERO,
        );
        assert!(h.names.is_empty() && h.unread >= 1, "{h:?}");
        let before = unreadable();
        let h = held(
            d.path(),
            &["held-open", "mapped"].into_iter().collect(),
            long,
        );
        let after = unreadable();
        assert!(
            me != 0
                || (before.intersection(&after).count()..=before.union(&after).count())
                    .contains(&h.unread),
            "{h:?}: {before:?} then {after:?} could not be read"
        );
        assert_eq!(
            h.names.iter().map(String::as_str).collect::<Vec<_>>(),
            ["held-open", "mapped"]
        );
        assert!(remove(d.path(), &got).is_empty());
        assert!(!d.path().join("vllm-1234").exists());
        assert!(d.path().join("held-open").exists() && d.path().join("link").exists());
        // SAFETY: unmaps the page mapped above.
        unsafe { libc::munmap(map, 4096) };
    }

    fn nix_uid() -> u32 {
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() }
    }
}
