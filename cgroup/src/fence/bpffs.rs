//! The bpf filesystem the pins live on, and the lock on their directory.

use std::fs::{self, File};
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::Path;

use nix::mount::{mount, MsFlags};
use nix::sys::resource::{setrlimit, Resource, RLIM_INFINITY};
use nix::sys::statfs::{statfs, FsType, BPF_FS_MAGIC};
use nix::unistd::{access, AccessFlags};

use crate::error::{Error, Result};

/// Where bpffs is conventionally mounted (systemd mounts it there).
const BPFFS_MOUNT: &str = "/sys/fs/bpf";

/// The filesystem type of the filesystem holding `p` (`statfs(2)`).
fn fs_type(p: &Path) -> io::Result<FsType> {
    Ok(statfs(p)?.filesystem_type())
}

/// Makes sure `dir` exists on a bpf filesystem, mounting bpffs at
/// `/sys/fs/bpf` when `dir` is below it and nothing is mounted there.
/// Returns whether it mounted.
///
/// # Errors
/// [`Error::NotBpffs`].
pub fn ensure_bpffs(dir: &Path) -> Result<bool> {
    let mut existing = dir.to_path_buf();
    while !existing.exists() {
        if !existing.pop() {
            break;
        }
    }
    let not_bpffs = |detail: String| Error::NotBpffs {
        path: dir.to_path_buf(),
        detail,
    };
    let magic =
        fs_type(&existing).map_err(|e| not_bpffs(format!("statfs {}: {e}", existing.display())))?;
    let mut mounted = false;
    if magic != BPF_FS_MAGIC {
        let conventional = Path::new(BPFFS_MOUNT);
        if !dir.starts_with(conventional) || !conventional.is_dir() {
            return Err(not_bpffs(format!("{} is not bpffs", existing.display())));
        }
        if fs_type(conventional).ok() != Some(BPF_FS_MAGIC) {
            mount(
                Some("bpf"),
                BPFFS_MOUNT,
                Some("bpf"),
                MsFlags::empty(),
                Some("mode=0700"),
            )
            .map_err(|e| {
                not_bpffs(format!(
                    "mount bpf on {BPFFS_MOUNT}: {}",
                    io::Error::from(e)
                ))
            })?;
            mounted = true;
        }
    }
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| not_bpffs(format!("mkdir {}: {e}", dir.display())))?;
    if fs_type(dir).ok() != Some(BPF_FS_MAGIC) {
        return Err(not_bpffs(format!(
            "{} is not bpffs after mkdir",
            dir.display()
        )));
    }
    // A read-only bpffs (or one root may not write) would fail at the first
    // pin, after the maps were made: say so now, in the same words.
    access(dir, AccessFlags::W_OK).map_err(|e| {
        not_bpffs(format!(
            "{} cannot be written: {}",
            dir.display(),
            io::Error::from(e)
        ))
    })?;
    Ok(mounted)
}

/// Holds an exclusive `flock` on the bpffs directory while alive (taken
/// with [`gpufence_model::fsutil::lock_exclusive`], gpufence's one flock
/// helper; released when the descriptor closes).
pub(super) struct DirLock(#[allow(dead_code)] File);

impl DirLock {
    pub(super) fn take(dir: &Path) -> Result<Self> {
        let err = |op: &'static str| {
            move |e: io::Error| Error::Cgroup {
                op,
                path: dir.to_path_buf(),
                source: e,
            }
        };
        let f = File::open(dir).map_err(err("open"))?;
        gpufence_model::fsutil::lock_exclusive(&f).map_err(err("flock"))?;
        Ok(DirLock(f))
    }
}

pub(super) fn raise_memlock() {
    // Kernels before 5.11 charge BPF memory to RLIMIT_MEMLOCK; systemd and
    // slurmd may start us with a small one. Best effort: newer kernels use
    // memcg accounting and ignore it.
    let _ = setrlimit(Resource::RLIMIT_MEMLOCK, RLIM_INFINITY, RLIM_INFINITY);
}
