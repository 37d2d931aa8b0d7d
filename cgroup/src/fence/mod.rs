//! The fence as kernel objects: five pinned maps (`majors`, `cgroups`,
//! `grants`, `denials`, `levels`: [`crate::maps`]), one program, one cgroup
//! link pinned in `bpffs_dir`, attached at `cgroup_root`; the scans'
//! iterator links are pinned beside them ([`crate::iter`]).
//!
//! Every operation is keyed by the pin paths and safe to repeat: installing
//! twice leaves one program and one link (the second install swaps the
//! program with `BPF_LINK_UPDATE`, atomically), removing twice is a no-op.
//! Concurrent installs are serialised by an `flock(2)` on the bpffs
//! directory.

use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use gpufence_model::device::{Access, DevNum};
use gpufence_model::policy::ExemptIdentities;
use gpufence_model::procdevices::ProtectedMajors;

use crate::error::{Error, Result};
use crate::hierarchy::Cgroup2;
use crate::maps::{CgroupsMap, DenialsMap, GrantsMap, LevelsMap, MajorsMap, Map, MapLayout};
use crate::sys;

mod bpffs;
mod exemptions;
mod grants;
mod install;
mod majors;
mod status;

pub use bpffs::ensure_bpffs;
pub use install::{probe_ancestor_helper, FORCE_NO_HELPER_ENV};
pub use status::{fence_programs_at, programs_at, NotAttached};

use bpffs::DirLock;

/// Name of the program as the kernel lists it.
pub const PROG_NAME: &str = "gpufence";

/// What to install.
#[derive(Clone, Debug)]
pub struct FenceSpec {
    /// Attach point, relative to the cgroup2 mount (`""` = the whole node).
    pub cgroup_root: String,
    /// bpffs directory for the pins.
    pub bpffs_dir: PathBuf,
    /// Majors to protect. Must not be empty.
    pub protected: ProtectedMajors,
    /// Exempt cgroups, relative to the mount, each with its identity class.
    pub exempt: Vec<ExemptCgroup>,
    /// Capacity of the `cgroups` and `grants` maps.
    pub max_grants: u32,
    /// Capacity of the `denials` LRU map.
    pub max_denials: u32,
    /// Audit mode: denials are recorded and allowed.
    pub audit: bool,
    /// Whom the exempt cgroups of each class cover (compiled into the
    /// program).
    pub identities: ExemptIdentities,
}

/// One exempt cgroup to install: where it is and whom it covers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExemptCgroup {
    /// The cgroup, relative to the cgroup2 mount.
    pub path: String,
    /// Its identity class: an index into [`FenceSpec::identities`]'
    /// classes, stored in the `cgroups` map's flags
    /// ([`crate::maps::with_class`]). An index with no class covers no one.
    pub class: u32,
}

impl ExemptCgroup {
    /// `path`, root only ([`ExemptIdentities::ROOT_CLASS`]).
    pub fn root(path: impl Into<String>) -> ExemptCgroup {
        ExemptCgroup {
            path: path.into(),
            class: ExemptIdentities::ROOT_CLASS,
        }
    }
}

/// What an install did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InstallReport {
    /// A link was already pinned and its program was swapped in place.
    pub replaced_program: bool,
    /// The kernel id of the new program.
    pub prog_id: u32,
    /// The kernel id of the link.
    pub link_id: u32,
    /// The cgroup id of `cgroup_root`.
    pub root_cgroup_id: u64,
    /// Exempt cgroups found, with their ids.
    pub exempt_applied: Vec<(String, u64)>,
    /// Exempt cgroups that do not exist (yet): not exempt until the next install.
    pub exempt_missing: Vec<String>,
    /// The protected majors now in the map.
    pub majors: Vec<u32>,
    /// Pinned maps already existed and were kept (grants survive reinstall).
    pub reused_maps: bool,
    /// bpffs was mounted at /sys/fs/bpf by this install.
    pub mounted_bpffs: bool,
    /// Notes for the admin (e.g. a map kept with another capacity).
    pub notes: Vec<String>,
    /// The kernel level of the cgroup2 mount's root: 0, or in a cgroup
    /// namespace how far below the hierarchy's root this process's paths
    /// start.
    pub mount_root_level: usize,
    /// Entries kept from an earlier install whose recorded level was not
    /// the kernel's level of their cgroup, now corrected:
    /// `(cgroup path, id, recorded, kernel level)`.
    pub relevelled: Vec<(String, u64, u32, usize)>,
    /// Why the scan iterators ([`crate::iter`]) were not pinned with the
    /// fence, if they were not (no BTF, no iterator support): each scan
    /// then parses BTF and loads its own, and says nothing wrong.
    pub iterators_unpinned: Option<String>,
}

/// What `status` found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FenceStatus {
    /// A link is pinned, attached, and attached at `cgroup_root`.
    pub installed: bool,
    /// The configured attach point.
    pub cgroup_root: String,
    /// Its cgroup id, when it exists.
    pub root_cgroup_id: Option<u64>,
    /// Where the pinned link is attached (0 when detached by someone).
    pub link_cgroup_id: Option<u64>,
    /// The pinned link's id.
    pub link_id: Option<u32>,
    /// The attached program's id.
    pub prog_id: Option<u32>,
    /// Protected majors in the map.
    pub protected_majors: Vec<u32>,
    /// Entries in the grants map.
    pub grants: usize,
    /// Exempt cgroup ids.
    pub exempt_cgroup_ids: Vec<u64>,
    /// gpufence programs ([`PROG_NAME`]) attached directly at
    /// `cgroup_root` that the pinned link does not run: a fence whose pins
    /// this process cannot see (another mount namespace's bpffs, another
    /// `bpffs_dir`), which still enforces.
    pub unpinned_programs: Vec<u32>,
    /// Why it is not installed, or what looks wrong.
    pub problems: Vec<String>,
    /// The kernel level of the cgroup2 mount's root (`Some(0)` outside a
    /// cgroup namespace; more inside one: paths here start that many
    /// levels below the hierarchy's root); `None` when it cannot be told
    /// (then a problem says why).
    pub mount_root_level: Option<usize>,
}

/// One entry of the grants map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrantEntry {
    /// The cgroup it is keyed by.
    pub cgroup_id: u64,
    /// The device.
    pub dev: DevNum,
    /// Access granted.
    pub access: Access,
    /// The job.
    pub job_id: u32,
}

/// What [`Fence::set_exempt`] did, read under the fence lock.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExemptSplit {
    /// Each exemption written: `(cgroup path, cgroup id)`.
    pub applied: Vec<(String, u64)>,
    /// Those of `applied` that were not exempt before this write: what
    /// it made exempt (an exemption another writer made first is not
    /// among them).
    pub newly: Vec<(String, u64)>,
    /// The paths with no cgroup.
    pub missing: Vec<String>,
}

/// The pinned maps, opened, each of its layout ([`Map`]).
#[derive(Debug)]
pub struct Fence {
    dir: PathBuf,
    majors: Map<MajorsMap>,
    cgroups: Map<CgroupsMap>,
    grants: Map<GrantsMap>,
    denials: Map<DenialsMap>,
    levels: Map<LevelsMap>,
}

/// One denial record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DenialEntry {
    /// The denied task's cgroup id.
    pub cgroup_id: u64,
    /// Its uid.
    pub uid: u32,
    /// The device.
    pub dev: DevNum,
    /// The access denied (mknod, read, write; empty in a record of a
    /// program before the access was recorded).
    pub access: Access,
    /// How many times.
    pub count: u64,
    /// The last denied process (tgid).
    pub last_pid: u32,
    /// Its command name.
    pub last_comm: String,
    /// When, as `CLOCK_MONOTONIC` ns (`bpf_ktime_get_ns`).
    pub last_ns: u64,
}

fn bpf_err(op: &'static str, what: impl Into<String>) -> impl FnOnce(io::Error) -> Error {
    let what = what.into();
    move |source| Error::Bpf { op, what, source }
}

/// The kernel level of cgroup `path` (relative to `cg`'s mount), checking
/// first that `path` is cgroup `cgroup_id` (a cgroup removed and made again
/// under the same name has another id).
fn located_level(cg: &Cgroup2, cgroup_id: u64, path: &str) -> Result<usize> {
    let found = cg.id(path)?;
    if found != cgroup_id {
        return Err(Error::Cgroup {
            op: "stat",
            path: cg.path(path),
            source: io::Error::new(
                io::ErrorKind::InvalidData,
                format!("is cgroup id {found}, not {cgroup_id} (removed and made again?)"),
            ),
        });
    }
    cg.kernel_level(path)
}

/// The map open at `fd`, pinned at `pin`, as a map of layout `M`.
///
/// # Errors
/// [`Error::MapMismatch`] naming the pin, what it has and what this
/// version needs ([`crate::maps::MapSpec::check`]); [`Error::Bpf`] when the kernel
/// cannot say.
fn typed_map<M: MapLayout>(fd: OwnedFd, pin: &Path) -> Result<Map<M>> {
    let fd = sys::MapFd::from_fd(fd)
        .map_err(bpf_err("BPF_OBJ_GET_INFO_BY_FD", pin.display().to_string()))?;
    Map::from_fd(fd).map_err(|m| Error::MapMismatch {
        path: pin.to_path_buf(),
        found: m.found,
        expected: m.expected,
    })
}

impl Fence {
    /// Opens the pinned maps of an installed fence, each checked against
    /// its layout ([`Fence::open_map`]).
    ///
    /// # Errors
    /// [`Error::NotInstalled`] when a map is not pinned;
    /// [`Error::MapMismatch`] when one has another layout; [`Error::Bpf`]
    /// otherwise.
    pub fn open(bpffs_dir: &Path) -> Result<Fence> {
        let grants = Self::open_map(bpffs_dir)?;
        Ok(Fence {
            dir: bpffs_dir.to_path_buf(),
            majors: Self::open_map(bpffs_dir)?,
            cgroups: Self::open_map(bpffs_dir)?,
            grants,
            denials: Self::open_map(bpffs_dir)?,
            levels: Self::open_map(bpffs_dir)?,
        })
    }

    /// The map of layout `M` pinned in `bpffs_dir` (as
    /// [`MapLayout::NAME`]), its shape checked against `M` before any
    /// element is read or written.
    ///
    /// # Errors
    /// [`Error::NotInstalled`] when it is not pinned;
    /// [`Error::MapMismatch`] naming the pin, what it has and what this
    /// version needs; [`Error::Bpf`] otherwise.
    pub fn open_map<M: MapLayout>(bpffs_dir: &Path) -> Result<Map<M>> {
        let p = bpffs_dir.join(M::NAME);
        let fd = sys::obj_get(&p).map_err(|e| {
            if e.raw_os_error() == Some(libc::ENOENT) {
                Error::NotInstalled {
                    path: bpffs_dir.to_path_buf(),
                    what: M::NAME,
                }
            } else {
                bpf_err("BPF_OBJ_GET", p.display().to_string())(e)
            }
        })?;
        typed_map(fd, &p)
    }

    /// The bpffs directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Capacity of the grants map.
    pub fn max_entries(&self) -> u32 {
        self.grants.max_entries()
    }

    /// Runs a change of the `cgroups`/`grants` maps under the fence lock
    /// (concurrent prologs, plugins and epilogs).
    fn locked<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let _lock = DirLock::take(&self.dir)?;
        f()
    }
}
