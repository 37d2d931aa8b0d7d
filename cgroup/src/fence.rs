//! The fence as kernel objects: three pinned maps, one program, one cgroup
//! link pinned in `bpffs_dir`, attached at `cgroup_root`.
//!
//! Every operation is keyed by the pin paths and safe to repeat: installing
//! twice leaves one program and one link (the second install swaps the
//! program with `BPF_LINK_UPDATE`, atomically), removing twice is a no-op.
//! Concurrent installs are serialised by an `flock(2)` on the bpffs
//! directory.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File};
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use gpufence_model::device::{Access, DevNum};
use gpufence_model::policy::ExemptIdentities;
use gpufence_model::procdevices::ProtectedMajors;
use nix::fcntl::{Flock, FlockArg};
use nix::mount::{mount, MsFlags};
use nix::sys::resource::{setrlimit, Resource, RLIM_INFINITY};
use nix::sys::statfs::{statfs, FsType, BPF_FS_MAGIC};
use nix::unistd::{access, AccessFlags};

use crate::error::{Error, Result};
use crate::hierarchy::Cgroup2;
use crate::maps::{
    self, map_specs, CgroupValue, CgroupsMap, DenialValue, DenialsMap, GrantKey, GrantValue,
    GrantsMap, LevelsMap, MajorsMap, MapLayout, MapPod, MapSpec, CGROUP_EXEMPT, CGROUP_GRANTED,
    MAJORS_ENTRIES, MAJOR_PROTECTED, PIN_CGROUPS, PIN_DENIALS, PIN_GRANTS, PIN_LEVELS, PIN_LINK,
    PIN_MAJORS,
};
use crate::program::{self, FenceProgramSpec, MAX_LEVEL};
use crate::sys;
use crate::verdict::{self, Evaluation, MapRole, MapView};

/// Where bpffs is conventionally mounted (systemd mounts it there).
const BPFFS_MOUNT: &str = "/sys/fs/bpf";
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
    /// Exempt cgroups, relative to the mount.
    pub exempt: Vec<String>,
    /// Capacity of the `cgroups` and `grants` maps.
    pub max_grants: u32,
    /// Capacity of the `denials` LRU map.
    pub max_denials: u32,
    /// Audit mode: denials are recorded and allowed.
    pub audit: bool,
    /// Whom the exempt cgroups cover (compiled into the program).
    pub identities: ExemptIdentities,
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

/// What [`Fence::set_exempt`] did: `(applied, missing)`, applied as
/// `(cgroup path, cgroup id)`, missing as the paths with no cgroup.
pub type ExemptSplit = (Vec<(String, u64)>, Vec<String>);

/// The pinned maps, opened.
#[derive(Debug)]
pub struct Fence {
    dir: PathBuf,
    majors: OwnedFd,
    cgroups: OwnedFd,
    grants: OwnedFd,
    denials: OwnedFd,
    levels: OwnedFd,
    max_entries: u32,
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

/// **Test-only switch.** When this variable is `1` in the environment of
/// the process, [`probe_ancestor_helper`] answers as a kernel without the
/// helper does (before 6.1), so tests can check what gpufence does on such
/// a host. It can only make gpufence refuse to install (fail closed), never
/// weaken a fence; production configs never set it (slurmd builds the
/// Prolog's environment, and jobs cannot reach slurmd's).
pub const FORCE_NO_HELPER_ENV: &str = "GPUFENCE_TEST_FORCE_NO_HELPER";

/// Checks that the kernel lets device programs call
/// `bpf_get_current_ancestor_cgroup_id` by loading a 4-instruction program
/// that does (`../shared/domain/bpf.md`: probe, do not trust versions).
///
/// # Errors
/// [`Error::HelperUnsupported`] naming the requirement (also when the
/// test-only [`FORCE_NO_HELPER_ENV`] is `1`), or [`Error::Bpf`] when
/// loading fails for another reason (no CAP_BPF).
pub fn probe_ancestor_helper() -> Result<()> {
    if std::env::var_os(FORCE_NO_HELPER_ENV).is_some_and(|v| v == "1") {
        return Err(Error::HelperUnsupported {
            detail: format!("forced by {FORCE_NO_HELPER_ENV}=1 (a test switch)"),
        });
    }
    let p = program::probe()?;
    match sys::prog_load_cgroup_device(&p.insns, "gpufence_probe") {
        Ok(_fd) => Ok(()),
        Err(e) if e.errno.raw_os_error() == Some(libc::EINVAL) => Err(Error::HelperUnsupported {
            detail: format!(
                "{}: {}",
                e.errno,
                e.log
                    .lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or("")
            ),
        }),
        Err(e) => Err(Error::Bpf {
            op: "BPF_PROG_LOAD",
            what: format!("probe program ({})", e.log.trim()),
            source: e.errno,
        }),
    }
}

/// The error of `BPF_LINK_CREATE` at `root_dir`: `E2BIG` is the kernel's
/// per-cgroup program limit, said as such with the count and the fix.
fn link_create_err(root_dir: &Path, root_fd: &File, e: io::Error) -> Error {
    if e.raw_os_error() == Some(libc::E2BIG) {
        let count = sys::prog_query_cgroup_device(root_fd.as_fd())
            .map(|(_, ids)| ids.len())
            .unwrap_or(64);
        return Error::TooManyPrograms {
            path: root_dir.to_path_buf(),
            count,
        };
    }
    bpf_err("BPF_LINK_CREATE", root_dir.display().to_string())(e)
}

fn open_or_create_map(
    dir: &Path,
    spec: &MapSpec,
    notes: &mut Vec<String>,
) -> Result<(OwnedFd, bool)> {
    let pin = dir.join(spec.name);
    for _ in 0..3 {
        match sys::obj_get(&pin) {
            Ok(fd) => {
                check_map(&fd, &pin, spec, notes)?;
                return Ok((fd, true));
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(bpf_err("BPF_OBJ_GET", pin.display().to_string())(e)),
        }
        let fd = sys::map_create(
            spec.map_type,
            spec.key_size,
            spec.value_size,
            spec.max_entries,
            spec.name,
        )
        .map_err(bpf_err("BPF_MAP_CREATE", spec.name))?;
        match sys::obj_pin(fd.as_fd(), &pin) {
            Ok(()) => return Ok((fd, false)),
            // Another installer pinned first: use theirs.
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => continue,
            Err(e) => return Err(bpf_err("BPF_OBJ_PIN", pin.display().to_string())(e)),
        }
    }
    Err(Error::Bpf {
        op: "BPF_OBJ_GET",
        what: pin.display().to_string(),
        source: io::Error::other("pin appeared and vanished repeatedly"),
    })
}

/// Checks that the map pinned at `pin` has the layout of `spec`: its
/// type, key size and value size, and its capacity where the layout fixes
/// it ([`MapSpec::fixed_entries`]). A configured capacity that differs is
/// kept, with a note (the map holds live grants).
///
/// # Errors
/// [`Error::MapMismatch`] naming the pin, what it has and what this
/// version needs; [`Error::Bpf`] when the kernel cannot say.
fn check_map(fd: &OwnedFd, pin: &Path, spec: &MapSpec, notes: &mut Vec<String>) -> Result<()> {
    let info = sys::map_info(fd.as_fd())
        .map_err(bpf_err("BPF_OBJ_GET_INFO_BY_FD", pin.display().to_string()))?;
    let found = (info.map_type, info.key_size, info.value_size);
    let wanted = (spec.map_type, spec.key_size, spec.value_size);
    if found != wanted || (spec.fixed_entries && info.max_entries != spec.max_entries) {
        let shape =
            |t: u32, k: u32, v: u32, n: u32| format!("type {t} key {k} value {v} max_entries {n}");
        return Err(Error::MapMismatch {
            path: pin.to_path_buf(),
            found: shape(
                info.map_type,
                info.key_size,
                info.value_size,
                info.max_entries,
            ),
            expected: if spec.fixed_entries {
                shape(
                    spec.map_type,
                    spec.key_size,
                    spec.value_size,
                    spec.max_entries,
                )
            } else {
                format!(
                    "type {} key {} value {}",
                    spec.map_type, spec.key_size, spec.value_size
                )
            },
        });
    }
    if info.max_entries != spec.max_entries {
        notes.push(format!(
            "{} keeps its capacity {} (config asks {}): it holds live grants; `gpufence fence remove` then install to resize",
            pin.display(),
            info.max_entries,
            spec.max_entries
        ));
    }
    Ok(())
}

/// Holds an exclusive `flock` on the bpffs directory while alive.
struct DirLock(#[allow(dead_code)] Flock<File>);

impl DirLock {
    fn take(dir: &Path) -> Result<Self> {
        let f = File::open(dir).map_err(|e| Error::Cgroup {
            op: "open",
            path: dir.to_path_buf(),
            source: e,
        })?;
        // Released when the lock (and the descriptor) is dropped.
        let lock = Flock::lock(f, FlockArg::LockExclusive).map_err(|(_, e)| Error::Cgroup {
            op: "flock",
            path: dir.to_path_buf(),
            source: e.into(),
        })?;
        Ok(DirLock(lock))
    }
}

fn raise_memlock() {
    // Kernels before 5.11 charge BPF memory to RLIMIT_MEMLOCK; systemd and
    // slurmd may start us with a small one. Best effort: newer kernels use
    // memcg accounting and ignore it.
    let _ = setrlimit(Resource::RLIMIT_MEMLOCK, RLIM_INFINITY, RLIM_INFINITY);
}

/// Attaches program `prog_fd` at `root_dir` through the link pinned in
/// `spec.bpffs_dir`: the pinned link's program swapped in place
/// (`BPF_LINK_UPDATE`) when it is attached there; else a new link made
/// and pinned (first, so there is no moment without a fence) and the old
/// one retired. The link's id and what was done go to `report`.
fn attach_link(
    spec: &FenceSpec,
    root_dir: &Path,
    root_fd: &File,
    prog_fd: &OwnedFd,
    report: &mut InstallReport,
) -> Result<()> {
    let link_pin = spec.bpffs_dir.join(PIN_LINK);
    match sys::obj_get(&link_pin) {
        Ok(link) => {
            let info = sys::link_info(link.as_fd()).map_err(bpf_err(
                "BPF_OBJ_GET_INFO_BY_FD",
                link_pin.display().to_string(),
            ))?;
            if info.cgroup_id == report.root_cgroup_id && info.prog_id != 0 {
                sys::link_update(link.as_fd(), prog_fd.as_fd())
                    .map_err(bpf_err("BPF_LINK_UPDATE", link_pin.display().to_string()))?;
                report.replaced_program = true;
                report.link_id = info.id;
            } else {
                // Pinned link detached by someone, or attached at another
                // root: attach the new one first, then retire the old
                // one, so there is no moment without a fence.
                let new = sys::link_create_cgroup_device(prog_fd.as_fd(), root_fd.as_fd())
                    .map_err(|e| link_create_err(root_dir, root_fd, e))?;
                let _ = sys::link_detach(link.as_fd());
                fs::remove_file(&link_pin).map_err(|e| Error::Cgroup {
                    op: "unlink",
                    path: link_pin.clone(),
                    source: e,
                })?;
                sys::obj_pin(new.as_fd(), &link_pin)
                    .map_err(bpf_err("BPF_OBJ_PIN", link_pin.display().to_string()))?;
                report.link_id = sys::link_info(new.as_fd()).map(|i| i.id).unwrap_or(0);
                report.notes.push(format!(
                    "replaced a pinned link that was {}",
                    if info.prog_id == 0 {
                        "detached".to_string()
                    } else {
                        format!("attached to cgroup id {}", info.cgroup_id)
                    }
                ));
            }
        }
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
            let link = sys::link_create_cgroup_device(prog_fd.as_fd(), root_fd.as_fd())
                .map_err(|e| link_create_err(root_dir, root_fd, e))?;
            if let Err(e) = sys::obj_pin(link.as_fd(), &link_pin) {
                // Unpinned, the link would vanish with this process:
                // say so rather than pretend.
                let _ = sys::link_detach(link.as_fd());
                return Err(bpf_err("BPF_OBJ_PIN", link_pin.display().to_string())(e));
            }
            report.link_id = sys::link_info(link.as_fd()).map(|i| i.id).unwrap_or(0);
        }
        Err(e) => return Err(bpf_err("BPF_OBJ_GET", link_pin.display().to_string())(e)),
    }
    Ok(())
}

impl Fence {
    /// Installs (or re-installs) the fence: probe, maps, majors, exemptions,
    /// program, link. Fails closed: on any error the previous state stays
    /// (a previously attached program keeps running) and the error says why.
    ///
    /// # Errors
    /// [`Error`]: no bpffs, no helper, no CAP_BPF, a cgroup_root that does
    /// not exist, a pinned map of another layout, an empty majors set.
    ///
    /// A failed install leaves nothing of its own behind: every pin it made
    /// in `bpffs_dir` (maps, iterator links) is removed, so its maps are
    /// freed with its descriptors, and the directory too when this install
    /// made it; pins that were there before (an earlier fence's) stay.
    /// bpffs stays mounted when this install mounted it.
    pub fn install(cg: &Cgroup2, spec: &FenceSpec) -> Result<(Fence, InstallReport)> {
        let existed = spec.bpffs_dir.is_dir();
        let before: BTreeSet<std::ffi::OsString> = pin_names(&spec.bpffs_dir);
        let r = Self::install_here(cg, spec);
        if r.is_err() && spec.bpffs_dir.is_dir() {
            for name in pin_names(&spec.bpffs_dir).difference(&before) {
                let _ = fs::remove_file(spec.bpffs_dir.join(name));
            }
            if !existed {
                let _ = fs::remove_dir(&spec.bpffs_dir);
            }
        }
        r
    }

    /// [`Fence::install`]'s steps, under the directory lock: the probe,
    /// the maps, what they hold, the program, the link, the iterators.
    fn install_here(cg: &Cgroup2, spec: &FenceSpec) -> Result<(Fence, InstallReport)> {
        let mut report = InstallReport::default();
        if spec.protected.is_empty() {
            return Err(Error::Bpf {
                op: "install",
                what: "protected majors".into(),
                source: io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "no NVIDIA major in /proc/devices and no [majors] table: nothing to protect (is the driver loaded?)",
                ),
            });
        }
        raise_memlock();
        report.mounted_bpffs = ensure_bpffs(&spec.bpffs_dir)?;
        let _lock = DirLock::take(&spec.bpffs_dir)?;
        probe_ancestor_helper()?;

        let root_dir = cg.path(&spec.cgroup_root);
        let root_fd = File::open(&root_dir).map_err(|e| Error::Cgroup {
            op: "open",
            path: root_dir.clone(),
            source: e,
        })?;
        report.root_cgroup_id = cg.id(&spec.cgroup_root)?;
        // Every level the fence records is the kernel's: where that cannot
        // be told (a cgroup namespace on a kernel without the cgroup
        // iterator), no fence whose grants would all be refused.
        report.mount_root_level = cg.root_level()?;

        let fence = Self::open_or_create_maps(spec, &mut report)?;
        fence.fill_maps(cg, spec, &mut report)?;
        let prog_fd = fence.load_program(spec.audit, &spec.identities, &mut report)?;
        attach_link(spec, &root_dir, &root_fd, &prog_fd, &mut report)?;
        report.iterators_unpinned = pin_iterators(&spec.bpffs_dir, &fence.majors).err();
        if let Some(why) = &report.iterators_unpinned {
            report.notes.push(format!(
                "scan iterators not pinned ({why}): each Prolog and Epilog scan loads its own (slower, not less safe)"
            ));
        }
        Ok((fence, report))
    }

    /// The pinned maps, opened, or made and pinned where missing; whether
    /// the grants were kept goes to `report`.
    fn open_or_create_maps(spec: &FenceSpec, report: &mut InstallReport) -> Result<Fence> {
        let [majors_spec, cgroups_spec, grants_spec, denials_spec, levels_spec] =
            map_specs(spec.max_grants, spec.max_denials);
        let (majors, r1) = open_or_create_map(&spec.bpffs_dir, &majors_spec, &mut report.notes)?;
        let (cgroups, r2) = open_or_create_map(&spec.bpffs_dir, &cgroups_spec, &mut report.notes)?;
        let (grants, r3) = open_or_create_map(&spec.bpffs_dir, &grants_spec, &mut report.notes)?;
        let (denials, _) = open_or_create_map(&spec.bpffs_dir, &denials_spec, &mut report.notes)?;
        let (levels, _) = open_or_create_map(&spec.bpffs_dir, &levels_spec, &mut report.notes)?;
        report.reused_maps = r1 && r2 && r3;
        let max_entries = sys::map_info(grants.as_fd())
            .map(|i| i.max_entries)
            .unwrap_or(spec.max_grants);
        Ok(Fence {
            dir: spec.bpffs_dir.clone(),
            majors,
            cgroups,
            grants,
            denials,
            levels,
            max_entries,
        })
    }

    /// What the maps hold at install: the protected majors, the exempt
    /// cgroups (this call holds the directory lock already: the unlocked
    /// variants), the entries' levels, then the mask the program reads to
    /// skip empty levels.
    fn fill_maps(&self, cg: &Cgroup2, spec: &FenceSpec, report: &mut InstallReport) -> Result<()> {
        self.set_majors(&spec.protected)?;
        report.majors = spec.protected.majors().collect();
        let (applied, missing) = self.set_exempt_unlocked(cg, &spec.exempt)?;
        report.relevelled = self.relevel_unlocked(cg)?;
        self.refresh_levels()?;
        report.exempt_applied = applied;
        report.exempt_missing = missing;
        Ok(())
    }

    /// The fence program built against these maps and loaded through the
    /// verifier; its id goes to `report`.
    fn load_program(
        &self,
        audit: bool,
        identities: &ExemptIdentities,
        report: &mut InstallReport,
    ) -> Result<OwnedFd> {
        let prog = program::build(&FenceProgramSpec {
            majors_fd: self.majors.as_raw_fd(),
            cgroups_fd: self.cgroups.as_raw_fd(),
            grants_fd: self.grants.as_raw_fd(),
            denials_fd: self.denials.as_raw_fd(),
            levels_fd: self.levels.as_raw_fd(),
            max_level: MAX_LEVEL,
            audit,
            identities: identities.clone(),
        })?;
        let prog_fd =
            sys::prog_load_cgroup_device(&prog.insns, PROG_NAME).map_err(|e| Error::Verifier {
                source: e.errno,
                log: e.log,
            })?;
        report.prog_id = sys::prog_info(prog_fd.as_fd())
            .map_err(bpf_err("BPF_OBJ_GET_INFO_BY_FD", "fence program"))?
            .id;
        Ok(prog_fd)
    }

    /// Whether every major of `majors` is protected by the fence pinned in
    /// `bpffs_dir` (its `majors` map, one lookup each): what a scan asks
    /// before it reads the pinned iterators, which write only protected
    /// majors ([`crate::fdtable`]).
    ///
    /// # Errors
    /// [`Error::Bpf`]: no pinned map, or a lookup failed.
    pub fn majors_protected(bpffs_dir: &Path, majors: &[u32]) -> Result<bool> {
        let pin = bpffs_dir.join(PIN_MAJORS);
        let fd = sys::obj_get(&pin).map_err(bpf_err("BPF_OBJ_GET", pin.display().to_string()))?;
        for m in majors {
            if *m >= MAJORS_ENTRIES
                || maps::lookup::<MajorsMap>(fd.as_fd(), m)
                    .map_err(bpf_err("BPF_MAP_LOOKUP_ELEM", "majors"))?
                    .unwrap_or(0)
                    == 0
            {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Opens the pinned maps of an installed fence.
    ///
    /// # Errors
    /// [`Error::NotInstalled`] when a map is not pinned; [`Error::Bpf`] otherwise.
    pub fn open(bpffs_dir: &Path) -> Result<Fence> {
        let get = |name: &'static str| -> Result<OwnedFd> {
            let p = bpffs_dir.join(name);
            sys::obj_get(&p).map_err(|e| {
                if e.raw_os_error() == Some(libc::ENOENT) {
                    Error::NotInstalled {
                        path: bpffs_dir.to_path_buf(),
                        what: name,
                    }
                } else {
                    bpf_err("BPF_OBJ_GET", p.display().to_string())(e)
                }
            })
        };
        let grants = get(PIN_GRANTS)?;
        let max_entries = sys::map_info(grants.as_fd())
            .map(|i| i.max_entries)
            .unwrap_or(0);
        Ok(Fence {
            dir: bpffs_dir.to_path_buf(),
            majors: get(PIN_MAJORS)?,
            cgroups: get(PIN_CGROUPS)?,
            grants,
            denials: get(PIN_DENIALS)?,
            levels: get(PIN_LEVELS)?,
            max_entries,
        })
    }

    /// The tag (SHA-1 prefix over the instructions, map references zeroed;
    /// `bpf_prog_calc_tag`) of the program this version would install now
    /// in mode `audit`: loaded against the pinned maps, never attached.
    /// Compared with the attached program's tag, it says whether the fence
    /// is current.
    ///
    /// # Errors
    /// [`Error`] when it cannot be built or loaded.
    pub fn fresh_program_tag(&self, audit: bool, identities: &ExemptIdentities) -> Result<[u8; 8]> {
        let prog = program::build(&FenceProgramSpec {
            majors_fd: self.majors.as_raw_fd(),
            cgroups_fd: self.cgroups.as_raw_fd(),
            grants_fd: self.grants.as_raw_fd(),
            denials_fd: self.denials.as_raw_fd(),
            levels_fd: self.levels.as_raw_fd(),
            max_level: MAX_LEVEL,
            audit,
            identities: identities.clone(),
        })?;
        let fd =
            sys::prog_load_cgroup_device(&prog.insns, PROG_NAME).map_err(|e| Error::Verifier {
                source: e.errno,
                log: e.log,
            })?;
        Ok(sys::prog_info(fd.as_fd())
            .map_err(bpf_err("BPF_OBJ_GET_INFO_BY_FD", "fresh program"))?
            .tag)
    }

    /// The id of the program the pinned link runs, if any.
    pub fn linked_prog_id(bpffs_dir: &Path) -> Option<u32> {
        let link = sys::obj_get(&bpffs_dir.join(PIN_LINK)).ok()?;
        sys::link_info(link.as_fd())
            .ok()
            .map(|i| i.prog_id)
            .filter(|id| *id != 0)
    }

    /// Every denial record (the LRU map keeps the most recent `max_denials`).
    ///
    /// # Errors
    /// [`Error::Bpf`].
    pub fn denials(&self) -> Result<Vec<DenialEntry>> {
        let cap = sys::map_info(self.denials.as_fd())
            .map(|i| i.max_entries)
            .unwrap_or(0);
        let keys = maps::keys::<DenialsMap>(self.denials.as_fd(), cap)
            .map_err(bpf_err("BPF_MAP_GET_NEXT_KEY", "denials"))?;
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            let val: Option<DenialValue> = maps::lookup::<DenialsMap>(self.denials.as_fd(), &key)
                .map_err(bpf_err("BPF_MAP_LOOKUP_ELEM", "denials"))?;
            if let Some(val) = val {
                out.push(DenialEntry {
                    cgroup_id: key.cgroup_id,
                    uid: key.uid,
                    dev: key.dev(),
                    count: val.count,
                    last_pid: val.last_pid,
                    last_comm: val.comm_str(),
                    last_ns: val.last_ns,
                });
            }
        }
        out.sort_by_key(|d| (d.cgroup_id, d.uid, d.dev));
        Ok(out)
    }

    /// Reports whether the fence is attached at `cgroup_root` and what it holds.
    /// Never fails: problems are listed in [`FenceStatus::problems`].
    pub fn status(cg: &Cgroup2, cgroup_root: &str, bpffs_dir: &Path) -> FenceStatus {
        let mut st = FenceStatus {
            cgroup_root: cgroup_root.to_string(),
            ..Default::default()
        };
        match cg.id(cgroup_root) {
            Ok(id) => st.root_cgroup_id = Some(id),
            Err(e) => st.problems.push(e.to_string()),
        }
        let link_pin = bpffs_dir.join(PIN_LINK);
        match sys::obj_get(&link_pin) {
            Ok(link) => match sys::link_info(link.as_fd()) {
                Ok(info) => {
                    st.link_id = Some(info.id);
                    st.link_cgroup_id = Some(info.cgroup_id);
                    if info.prog_id == 0 {
                        st.problems.push(format!(
                            "{} is detached from its cgroup",
                            link_pin.display()
                        ));
                    } else {
                        st.prog_id = Some(info.prog_id);
                    }
                    if st.root_cgroup_id.is_some()
                        && Some(info.cgroup_id) != st.root_cgroup_id
                        && info.prog_id != 0
                    {
                        st.problems.push(format!(
                            "the link is attached to cgroup id {}, not to cgroup_root {:?} (id {:?})",
                            info.cgroup_id, cgroup_root, st.root_cgroup_id
                        ));
                    }
                }
                Err(e) => st.problems.push(format!("{}: {e}", link_pin.display())),
            },
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => st
                .problems
                .push(format!("no pinned link at {}", link_pin.display())),
            Err(e) => st
                .problems
                .push(format!("pinned link {}: {e}", link_pin.display())),
        }
        // Grants and exemptions are recorded at kernel levels: in a cgroup
        // namespace where the level of the mount's root cannot be read,
        // every grant is refused.
        match cg.root_level() {
            Ok(level) => st.mount_root_level = Some(level),
            Err(e) => st.problems.push(e.to_string()),
        }
        match Fence::open(bpffs_dir) {
            Ok(f) => {
                match f.protected_majors() {
                    Ok(m) => st.protected_majors = m,
                    Err(e) => st.problems.push(e.to_string()),
                }
                match f.entries() {
                    Ok(g) => st.grants = g.len(),
                    Err(e) => st.problems.push(e.to_string()),
                }
                match f.cgroup_flags() {
                    Ok(c) => {
                        st.exempt_cgroup_ids = c
                            .into_iter()
                            .filter(|(_, fl)| fl & CGROUP_EXEMPT != 0)
                            .map(|(id, _)| id)
                            .collect()
                    }
                    Err(e) => st.problems.push(e.to_string()),
                }
                if st.mount_root_level.is_some() {
                    match f.level_problems(cg) {
                        Ok(p) => st.problems.extend(p),
                        Err(e) => st.problems.push(format!("checking the levels: {e}")),
                    }
                }
            }
            Err(e) => st.problems.push(e.to_string()),
        }
        st.installed = st.problems.is_empty() && st.prog_id.is_some();
        st
    }

    /// Detaches the link and removes every pin and the directory. Returns
    /// whether anything was there.
    ///
    /// # Errors
    /// [`Error`] when a pin exists but cannot be detached or removed.
    pub fn remove(bpffs_dir: &Path) -> Result<bool> {
        if !bpffs_dir.exists() {
            return Ok(false);
        }
        let _lock = DirLock::take(bpffs_dir)?;
        let mut found = false;
        let link_pin = bpffs_dir.join(PIN_LINK);
        match sys::obj_get(&link_pin) {
            Ok(link) => {
                found = true;
                match sys::link_detach(link.as_fd()) {
                    Ok(()) => {}
                    // Already detached (ENOLINK on some kernels, EINVAL on others).
                    Err(e)
                        if matches!(e.raw_os_error(), Some(libc::ENOLINK) | Some(libc::EINVAL)) => {
                    }
                    Err(e) => {
                        return Err(bpf_err("BPF_LINK_DETACH", link_pin.display().to_string())(
                            e,
                        ))
                    }
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(bpf_err("BPF_OBJ_GET", link_pin.display().to_string())(e)),
        }
        let iterator_pins = crate::iter::PINS
            .into_iter()
            .flat_map(|n| [n.to_string(), format!("{n}_new")]);
        for name in [
            PIN_LINK,
            PIN_GRANTS,
            PIN_CGROUPS,
            PIN_MAJORS,
            PIN_DENIALS,
            PIN_LEVELS,
        ]
        .into_iter()
        .map(String::from)
        .chain(iterator_pins)
        {
            let p = bpffs_dir.join(name);
            match fs::remove_file(&p) {
                Ok(()) => found = true,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(Error::Cgroup {
                        op: "unlink",
                        path: p,
                        source: e,
                    })
                }
            }
        }
        drop(_lock);
        match fs::remove_dir(bpffs_dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(Error::Cgroup {
                    op: "rmdir",
                    path: bpffs_dir.to_path_buf(),
                    source: e,
                })
            }
        }
        Ok(found)
    }

    /// The bpffs directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Capacity of the grants map.
    pub fn max_entries(&self) -> u32 {
        self.max_entries
    }

    /// Protects each of `majors` that is not protected yet (never
    /// unprotects). Returns the ones added. A few lookups: cheap enough for
    /// every prolog, which heals a driver loaded after the install.
    ///
    /// # Errors
    /// [`Error::Bpf`].
    pub fn add_majors(&self, majors: &[u32]) -> Result<Vec<u32>> {
        let mut added = Vec::new();
        for m in majors {
            let on = maps::lookup::<MajorsMap>(self.majors.as_fd(), m)
                .map_err(bpf_err("BPF_MAP_LOOKUP_ELEM", format!("majors[{m}]")))?
                .is_some_and(|v| v != 0);
            if !on {
                maps::update::<MajorsMap>(self.majors.as_fd(), m, &MAJOR_PROTECTED)
                    .map_err(bpf_err("BPF_MAP_UPDATE_ELEM", format!("majors[{m}]")))?;
                added.push(*m);
            }
        }
        Ok(added)
    }

    /// Whether the pinned link in `bpffs_dir` is attached at `cgroup_root`:
    /// one pin lookup and one info call, for the prolog and the plugin (the
    /// full [`Fence::status`] walks every map).
    ///
    /// # Errors
    /// A one-line reason when it is not.
    pub fn check_attached(
        cg: &Cgroup2,
        cgroup_root: &str,
        bpffs_dir: &Path,
    ) -> std::result::Result<(), String> {
        let link_pin = bpffs_dir.join(PIN_LINK);
        let link = sys::obj_get(&link_pin).map_err(|e| {
            if e.raw_os_error() == Some(libc::ENOENT) {
                format!("no pinned link at {}", link_pin.display())
            } else {
                format!("pinned link {}: {e}", link_pin.display())
            }
        })?;
        let info =
            sys::link_info(link.as_fd()).map_err(|e| format!("{}: {e}", link_pin.display()))?;
        if info.prog_id == 0 {
            return Err(format!(
                "{} is detached from its cgroup",
                link_pin.display()
            ));
        }
        let root = cg.id(cgroup_root).map_err(|e| e.to_string())?;
        if info.cgroup_id != root {
            return Err(format!(
                "the link is attached to cgroup id {}, not to cgroup_root /{cgroup_root} (id {root})",
                info.cgroup_id
            ));
        }
        Ok(())
    }

    fn set_majors(&self, protected: &ProtectedMajors) -> Result<()> {
        let want: BTreeSet<u32> = protected.majors().collect();
        let current: BTreeSet<u32> = self.protected_majors()?.into_iter().collect();
        // Protect new majors before unprotecting old ones: no moment in
        // which a major that should be closed is open.
        for m in want.difference(&current) {
            maps::update::<MajorsMap>(self.majors.as_fd(), m, &MAJOR_PROTECTED)
                .map_err(bpf_err("BPF_MAP_UPDATE_ELEM", format!("majors[{m}]")))?;
        }
        for m in current.difference(&want) {
            maps::update::<MajorsMap>(self.majors.as_fd(), m, &0)
                .map_err(bpf_err("BPF_MAP_UPDATE_ELEM", format!("majors[{m}]")))?;
        }
        Ok(())
    }

    /// The protected majors, from the map.
    ///
    /// # Errors
    /// [`Error::Bpf`].
    pub fn protected_majors(&self) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        for m in 0..MAJORS_ENTRIES {
            if maps::lookup::<MajorsMap>(self.majors.as_fd(), &m)
                .map_err(bpf_err("BPF_MAP_LOOKUP_ELEM", "majors"))?
                .is_some_and(|v| v != 0)
            {
                out.push(m);
            }
        }
        Ok(out)
    }

    /// The `cgroups` entry of `cgroup_id`: `(flags, level)`.
    fn entry_of(&self, cgroup_id: u64) -> Result<Option<(u32, u32)>> {
        Ok(maps::lookup::<CgroupsMap>(self.cgroups.as_fd(), &cgroup_id)
            .map_err(bpf_err("BPF_MAP_LOOKUP_ELEM", "cgroups"))?
            .map(|v| (v.flags, v.level)))
    }

    fn flags_of(&self, cgroup_id: u64) -> Result<u32> {
        Ok(self.entry_of(cgroup_id)?.map_or(0, |(f, _)| f))
    }

    /// Writes the flags of `cgroup_id` (deleting the entry at 0); `level`
    /// is the cgroup's level, kept from the existing entry when `None`.
    /// The level's bit is set in the `levels` mask before the entry is
    /// written (the program must not skip it); a deletion leaves the mask
    /// as it is (the next install recomputes it: [`Fence::refresh_levels`]).
    /// Callers hold the fence lock.
    fn write_flags(&self, cgroup_id: u64, flags: u32, level: Option<u32>) -> Result<()> {
        if flags == 0 {
            maps::delete::<CgroupsMap>(self.cgroups.as_fd(), &cgroup_id)
                .map_err(bpf_err("BPF_MAP_DELETE_ELEM", "cgroups"))?;
            return Ok(());
        }
        let level = match level {
            Some(l) => l,
            None => self.entry_of(cgroup_id)?.map_or(0, |(_, l)| l),
        };
        if (1..=MAX_LEVEL as u32).contains(&level) {
            let mask = self.levels_mask()?;
            if mask & (1 << level) == 0 {
                maps::update::<LevelsMap>(self.levels.as_fd(), &0, &(mask | 1 << level))
                    .map_err(bpf_err("BPF_MAP_UPDATE_ELEM", "levels"))?;
            }
        }
        maps::update::<CgroupsMap>(
            self.cgroups.as_fd(),
            &cgroup_id,
            &CgroupValue { flags, level },
        )
        .map_err(bpf_err("BPF_MAP_UPDATE_ELEM", "cgroups"))?;
        Ok(())
    }

    /// Recomputes the populated-levels mask from the `cgroups` entries (a
    /// walk of the whole map): at install, under the fence lock, after the
    /// exemptions are written. Between installs the mask only gains bits
    /// ([`Fence::write_flags`]), so the program never skips a level that
    /// matters.
    fn refresh_levels(&self) -> Result<()> {
        let mut mask = 0u32;
        for (_, (_, level)) in self.cgroup_entries()? {
            if (1..=MAX_LEVEL as u32).contains(&level) {
                mask |= 1 << level;
            }
        }
        maps::update::<LevelsMap>(self.levels.as_fd(), &0, &mask)
            .map_err(bpf_err("BPF_MAP_UPDATE_ELEM", "levels"))
    }

    /// The populated-levels mask, from the map.
    ///
    /// # Errors
    /// [`Error::Bpf`].
    pub fn levels_mask(&self) -> Result<u32> {
        Ok(maps::lookup::<LevelsMap>(self.levels.as_fd(), &0)
            .map_err(bpf_err("BPF_MAP_LOOKUP_ELEM", "levels"))?
            .unwrap_or(0))
    }

    /// Runs a change of the `cgroups`/`grants` maps under the fence lock
    /// (concurrent prologs, plugins and epilogs).
    fn locked<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let _lock = DirLock::take(&self.dir)?;
        f()
    }

    /// Every entry of the `cgroups` map: id → (flags, level).
    fn cgroup_entries(&self) -> Result<BTreeMap<u64, (u32, u32)>> {
        if let Some(all) = maps::entries_batch::<CgroupsMap>(self.cgroups.as_fd())
            .map_err(bpf_err("BPF_MAP_LOOKUP_BATCH", "cgroups"))?
        {
            return Ok(all
                .into_iter()
                .map(|(id, v)| (id, (v.flags, v.level)))
                .collect());
        }
        let keys = maps::keys::<CgroupsMap>(self.cgroups.as_fd(), self.max_entries)
            .map_err(bpf_err("BPF_MAP_GET_NEXT_KEY", "cgroups"))?;
        let mut out = BTreeMap::new();
        for id in keys {
            if let Some(e) = self.entry_of(id)? {
                out.insert(id, e);
            }
        }
        Ok(out)
    }

    /// Every entry of the `cgroups` map: id → flags.
    ///
    /// # Errors
    /// [`Error::Bpf`].
    pub fn cgroup_flags(&self) -> Result<BTreeMap<u64, u32>> {
        let keys = maps::keys::<CgroupsMap>(self.cgroups.as_fd(), self.max_entries)
            .map_err(bpf_err("BPF_MAP_GET_NEXT_KEY", "cgroups"))?;
        let mut out = BTreeMap::new();
        for id in keys {
            let f = self.flags_of(id)?;
            if f != 0 {
                out.insert(id, f);
            }
        }
        Ok(out)
    }

    /// [`Fence::add_exempt_in`] with `path` relative to the cgroup2 mount
    /// this process finds ([`Cgroup2::discover`]).
    ///
    /// # Errors
    /// As [`Fence::add_exempt_in`], and [`Error::NoCgroup2`].
    pub fn add_exempt(&self, cgroup_id: u64, path: &str) -> Result<()> {
        self.add_exempt_in(&Cgroup2::discover()?, cgroup_id, path)
    }

    /// Makes cgroup `cgroup_id` (at `path`, relative to `cg`'s mount)
    /// exempt now, without a reinstall, at its kernel level
    /// ([`Cgroup2::kernel_level`]).
    ///
    /// # Errors
    /// [`Error::Bpf`]; [`Error::KernelLevelUnknown`] (nothing is written);
    /// [`Error::Cgroup`] when `path` is not cgroup `cgroup_id`.
    pub fn add_exempt_in(&self, cg: &Cgroup2, cgroup_id: u64, path: &str) -> Result<()> {
        let level = located_level(cg, cgroup_id, path)?;
        self.locked(|| {
            let f = self.flags_of(cgroup_id)?;
            self.write_flags(cgroup_id, f | CGROUP_EXEMPT, Some(level as u32))
        })
    }

    /// Whether cgroup `id` is exempt.
    ///
    /// # Errors
    /// [`Error::Bpf`].
    pub fn is_exempt(&self, cgroup_id: u64) -> Result<bool> {
        Ok(self.flags_of(cgroup_id)? & CGROUP_EXEMPT != 0)
    }

    /// Whether cgroup `cgroup_id` holds a grant of some device (its
    /// `GRANTED` flag).
    ///
    /// # Errors
    /// [`Error::Bpf`] when the map cannot be read.
    pub fn is_granted(&self, cgroup_id: u64) -> Result<bool> {
        Ok(self.flags_of(cgroup_id)? & CGROUP_GRANTED != 0)
    }

    /// Makes exactly the existing cgroups of `paths` exempt: adds the
    /// missing flags, then clears the flag from cgroups no longer listed.
    /// Returns `(applied, missing)`.
    ///
    /// # Errors
    /// [`Error::Bpf`].
    pub fn set_exempt(&self, cg: &Cgroup2, paths: &[String]) -> Result<ExemptSplit> {
        self.locked(|| self.set_exempt_unlocked(cg, paths))
    }

    fn set_exempt_unlocked(&self, cg: &Cgroup2, paths: &[String]) -> Result<ExemptSplit> {
        let mut applied = Vec::new();
        let mut missing = Vec::new();
        for p in paths {
            match cg.id(p) {
                Ok(id) => applied.push((p.clone(), id)),
                Err(_) => missing.push(p.clone()),
            }
        }
        let want: BTreeSet<u64> = applied.iter().map(|(_, id)| *id).collect();
        let levels = applied
            .iter()
            .map(|(p, _)| cg.kernel_level(p))
            .collect::<Result<Vec<_>>>()?;
        for ((_, id), level) in applied.iter().zip(levels) {
            let f = self.flags_of(*id)?;
            self.write_flags(*id, f | CGROUP_EXEMPT, Some(level as u32))?;
        }
        for (id, f) in self.cgroup_flags()? {
            if f & CGROUP_EXEMPT != 0 && !want.contains(&id) {
                self.write_flags(id, f & !CGROUP_EXEMPT, None)?;
            }
        }
        Ok((applied, missing))
    }

    /// [`Fence::grant_in`] with `cgroup_path` relative to the cgroup2 mount
    /// this process finds ([`Cgroup2::discover`]).
    ///
    /// # Errors
    /// As [`Fence::grant_in`], and [`Error::NoCgroup2`].
    pub fn grant(
        &self,
        cgroup_id: u64,
        cgroup_path: &str,
        job_id: u32,
        devices: &[(DevNum, Access)],
    ) -> Result<()> {
        self.grant_in(
            &Cgroup2::discover()?,
            cgroup_id,
            cgroup_path,
            job_id,
            devices,
        )
    }

    /// Grants `devices` to cgroup `cgroup_id` (at `cgroup_path`, relative
    /// to `cg`'s mount) for `job_id`, recorded at the cgroup's kernel level
    /// ([`Cgroup2::kernel_level`]: in a cgroup namespace, the namespace
    /// root's level plus the path's depth), the level at which the program
    /// finds it. Grant entries are written before the cgroup's GRANTED
    /// flag, so the program never sees a half grant as more than it is. On
    /// failure, what this call added is removed again.
    ///
    /// # Errors
    /// [`Error::TooDeep`] (past the walk, or the root);
    /// [`Error::KernelLevelUnknown`] (nothing is granted at a guessed
    /// level); [`Error::Cgroup`] when `cgroup_path` is not cgroup
    /// `cgroup_id` (gone, or replaced by another); [`Error::Bpf`] (`E2BIG`:
    /// the map is full).
    pub fn grant_in(
        &self,
        cg: &Cgroup2,
        cgroup_id: u64,
        cgroup_path: &str,
        job_id: u32,
        devices: &[(DevNum, Access)],
    ) -> Result<()> {
        let level = located_level(cg, cgroup_id, cgroup_path)?;
        if level == 0 || level > MAX_LEVEL {
            return Err(Error::TooDeep {
                path: cgroup_path.to_string(),
                level,
                max: MAX_LEVEL,
            });
        }
        let mut added: Vec<GrantKey> = Vec::new();
        let result = self.locked(|| {
            for (dev, access) in devices {
                let key = GrantKey::new(cgroup_id, *dev);
                let val = GrantValue::new(*access, job_id);
                maps::update::<GrantsMap>(self.grants.as_fd(), &key, &val).map_err(bpf_err(
                    "BPF_MAP_UPDATE_ELEM",
                    format!("grants[{cgroup_id}, {dev}]"),
                ))?;
                added.push(key);
            }
            let f = self.flags_of(cgroup_id)?;
            self.write_flags(cgroup_id, f | CGROUP_GRANTED, Some(level as u32))
        });
        if result.is_err() {
            for k in &added {
                let _ = maps::delete::<GrantsMap>(self.grants.as_fd(), k);
            }
        }
        result
    }

    /// Fills the maps with `n` grants of 8 devices each to cgroups that do
    /// not exist (ids from 2^48 up, job id `u32::MAX`), flagged GRANTED at
    /// `level`: what a node with many live grants looks like to the
    /// program, for the benchmarks (one bulk write instead of `n / 8`
    /// [`Fence::grant`] calls).
    ///
    /// # Errors
    /// [`Error::Bpf`] (`E2BIG` past `max_grants`).
    pub fn fill_grants_for_bench(&self, n: usize, level: u32) -> Result<()> {
        self.locked(|| {
            for i in 0..n as u64 {
                let cgroup_id = (1u64 << 48) + i / 8;
                let key = GrantKey::new(cgroup_id, DevNum::new(195, (i % 8) as u32));
                let val = GrantValue::new(Access::RW, u32::MAX);
                maps::update::<GrantsMap>(self.grants.as_fd(), &key, &val)
                    .map_err(bpf_err("BPF_MAP_UPDATE_ELEM", "grants (bench fill)"))?;
                if i % 8 == 0 {
                    self.write_flags(cgroup_id, CGROUP_GRANTED, Some(level))?;
                }
            }
            Ok(())
        })
    }

    /// Every grant in the map.
    ///
    /// # Errors
    /// [`Error::Bpf`].
    pub fn entries(&self) -> Result<Vec<GrantEntry>> {
        let entry = |key: &GrantKey, val: &GrantValue| GrantEntry {
            cgroup_id: key.cgroup_id,
            dev: key.dev(),
            access: val.access(),
            job_id: val.job_id,
        };
        let mut out: Vec<GrantEntry> = match maps::entries_batch::<GrantsMap>(self.grants.as_fd())
            .map_err(bpf_err("BPF_MAP_LOOKUP_BATCH", "grants"))?
        {
            Some(all) => all.iter().map(|(k, v)| entry(k, v)).collect(),
            None => {
                let keys = maps::keys::<GrantsMap>(self.grants.as_fd(), self.max_entries)
                    .map_err(bpf_err("BPF_MAP_GET_NEXT_KEY", "grants"))?;
                let mut out = Vec::with_capacity(keys.len());
                for key in keys {
                    if let Some(val) = maps::lookup::<GrantsMap>(self.grants.as_fd(), &key)
                        .map_err(bpf_err("BPF_MAP_LOOKUP_ELEM", "grants"))?
                    {
                        out.push(entry(&key, &val));
                    }
                }
                out
            }
        };
        out.sort_by_key(|e| (e.job_id, e.cgroup_id, e.dev));
        Ok(out)
    }

    /// The grant for `(cgroup_id, dev)`, if any.
    ///
    /// # Errors
    /// [`Error::Bpf`].
    pub fn lookup(&self, cgroup_id: u64, dev: DevNum) -> Result<Option<GrantValue>> {
        maps::lookup::<GrantsMap>(self.grants.as_fd(), &GrantKey::new(cgroup_id, dev))
            .map_err(bpf_err("BPF_MAP_LOOKUP_ELEM", "grants"))
    }

    /// Removes every grant of `job_id` (whatever cgroup it is keyed by) and
    /// clears the GRANTED flag of cgroups left without grants. Returns what
    /// was removed. Repeating it is a no-op.
    ///
    /// # Errors
    /// [`Error::Bpf`] when an entry cannot be deleted (the fence then still
    /// holds a grant: the caller must treat the node as unsafe).
    pub fn revoke_job(&self, job_id: u32) -> Result<Vec<GrantEntry>> {
        self.revoke_where(|e| e.job_id == job_id)
    }

    /// Removes every grant of `job_id` keyed by a cgroup other than `keep`:
    /// the job's earlier job cgroups, gone (Slurm makes one job cgroup per
    /// job at a time). Returns what was removed.
    ///
    /// # Errors
    /// As [`Fence::revoke_job`].
    pub fn revoke_job_except(&self, job_id: u32, keep: u64) -> Result<Vec<GrantEntry>> {
        self.revoke_where(|e| e.job_id == job_id && e.cgroup_id != keep)
    }

    /// Removes every grant keyed by `cgroup_id` (a cgroup that is gone).
    ///
    /// # Errors
    /// As [`Fence::revoke_job`].
    pub fn revoke_cgroup(&self, cgroup_id: u64) -> Result<Vec<GrantEntry>> {
        self.revoke_where(|e| e.cgroup_id == cgroup_id)
    }

    fn revoke_where(&self, pred: impl Fn(&GrantEntry) -> bool) -> Result<Vec<GrantEntry>> {
        self.locked(|| self.revoke_where_unlocked(pred))
    }

    fn revoke_where_unlocked(&self, pred: impl Fn(&GrantEntry) -> bool) -> Result<Vec<GrantEntry>> {
        let all = self.entries()?;
        let (gone, kept): (Vec<GrantEntry>, Vec<GrantEntry>) =
            all.into_iter().partition(|e| pred(e));
        let touched: BTreeSet<u64> = gone.iter().map(|e| e.cgroup_id).collect();
        let still: BTreeSet<u64> = kept.iter().map(|e| e.cgroup_id).collect();
        // Clear the flag first: from then on the program skips the cgroup.
        for id in touched.difference(&still) {
            let f = self.flags_of(*id)?;
            self.write_flags(*id, f & !CGROUP_GRANTED, None)?;
        }
        for e in &gone {
            let key = GrantKey::new(e.cgroup_id, e.dev);
            maps::delete::<GrantsMap>(self.grants.as_fd(), &key).map_err(bpf_err(
                "BPF_MAP_DELETE_ELEM",
                format!("grants[{}, {}]", e.cgroup_id, e.dev),
            ))?;
        }
        Ok(gone)
    }
}

/// The value size of map `M`.
fn value_size<M: MapLayout>() -> usize {
    <M::Value as MapPod>::SIZE
}

impl MapView for Fence {
    fn lookup(&self, map: MapRole, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let (fd, size, name) = match map {
            MapRole::Majors => (&self.majors, value_size::<MajorsMap>(), PIN_MAJORS),
            MapRole::Cgroups => (&self.cgroups, value_size::<CgroupsMap>(), PIN_CGROUPS),
            MapRole::Grants => (&self.grants, value_size::<GrantsMap>(), PIN_GRANTS),
            MapRole::Levels => (&self.levels, value_size::<LevelsMap>(), PIN_LEVELS),
        };
        let mut v = vec![0u8; size];
        let found = sys::map_lookup(fd.as_fd(), key, &mut v)
            .map_err(bpf_err("BPF_MAP_LOOKUP_ELEM", name))?;
        Ok(found.then_some(v))
    }
}

impl Fence {
    /// What the enforcing fence program built with `identities` answers,
    /// over these maps as they are now, for a task of real uid `uid` whose
    /// ancestors by kernel level are `ancestry`
    /// ([`Cgroup2::kernel_ancestry`]'s ids) opening `dev` for `access`
    /// ([`verdict::evaluate`]).
    ///
    /// # Errors
    /// [`Error::Bpf`] when a map cannot be read.
    pub fn evaluate(
        &self,
        task: verdict::Task<'_>,
        identities: &ExemptIdentities,
        dev: DevNum,
        access: Access,
    ) -> Result<Evaluation> {
        verdict::evaluate(self, task, identities, dev, access)
    }

    /// Rewrites the level of every entry whose recorded level is not the
    /// kernel's level of its cgroup (entries an earlier version recorded
    /// at a cgroup namespace's depth). Cgroups this mount does not show
    /// (gone, or outside the namespace) are left alone. Callers hold the
    /// lock and refresh the mask after.
    fn relevel_unlocked(&self, cg: &Cgroup2) -> Result<Vec<(String, u64, u32, usize)>> {
        let entries = self.cgroup_entries()?;
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        let levels = cg.kernel_levels()?;
        let mut out = Vec::new();
        for (id, (flags, recorded)) in entries {
            let Some((path, level)) = levels.get(&id) else {
                continue;
            };
            if *level as u32 != recorded && flags != 0 {
                self.write_flags(id, flags, Some(*level as u32))?;
                out.push((path.clone(), id, recorded, *level));
            }
        }
        Ok(out)
    }

    /// What `status` says about levels: entries recorded at another level
    /// than the kernel has their cgroup at, and grants or exemptions the
    /// program, run over the maps for a task in their cgroup, does not
    /// honour. Only cgroups this mount shows are checked.
    fn level_problems(&self, cg: &Cgroup2) -> Result<Vec<String>> {
        let entries = self.cgroup_entries()?;
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        let levels = cg.kernel_levels()?;
        let grants = self.entries()?;
        let some_protected = self.protected_majors()?.first().map(|m| DevNum::new(*m, 0));
        let mut out = Vec::new();
        for (id, (flags, recorded)) in &entries {
            let Some((path, level)) = levels.get(id) else {
                continue;
            };
            if *level as u32 != *recorded {
                out.push(format!(
                    "cgroup /{path} (id {id}) is recorded at level {recorded}, but the kernel has it at level {level}: \
                     the fence program looks for it at level {recorded}, where its tasks have another ancestor; \
                     `gpufence fence install` records the kernel's levels"
                ));
            }
            let ancestry: Vec<u64> = cg.kernel_ancestry(path)?.iter().map(|a| a.id).collect();
            // A denial is said only of an entry still there after the
            // evaluation (a revoke in between is no problem).
            if flags & CGROUP_EXEMPT != 0 {
                if let Some(dev) = some_protected {
                    if !self
                        .evaluate(
                            root_task(&ancestry),
                            &ExemptIdentities::default(),
                            dev,
                            Access::RW,
                        )?
                        .allowed
                        && self.is_exempt(*id)?
                    {
                        out.push(format!(
                            "exempt cgroup /{path} (id {id}) is not exempt for the fence program: it denies {dev} to its tasks"
                        ));
                    }
                }
            }
            for g in grants.iter().filter(|g| g.cgroup_id == *id) {
                if !self
                    .evaluate(
                        root_task(&ancestry),
                        &ExemptIdentities::default(),
                        g.dev,
                        g.access,
                    )?
                    .allowed
                    && self.lookup(g.cgroup_id, g.dev)?.is_some()
                {
                    out.push(format!(
                        "job {}'s grant of {} on /{path} (id {id}) has no effect: the fence program denies it to the tasks there",
                        g.job_id, g.dev
                    ));
                }
            }
        }
        Ok(out)
    }
}

/// A root task (uid 0, which every exemption covers) with this ancestry:
/// what `status` checks exemptions and grants with.
fn root_task(ancestry: &[u64]) -> verdict::Task<'_> {
    verdict::Task { ancestry, uid: 0 }
}

/// The programs attached directly at cgroup `rel` for device checks:
/// `(attach_flags, prog_ids)`. For tests and `doctor`.
///
/// # Errors
/// [`Error`] when the cgroup cannot be opened or queried.
pub fn programs_at(cg: &Cgroup2, rel: &str) -> Result<(u32, Vec<u32>)> {
    let p = cg.path(rel);
    let f = File::open(&p).map_err(|e| Error::Cgroup {
        op: "open",
        path: p.clone(),
        source: e,
    })?;
    sys::prog_query_cgroup_device(f.as_fd())
        .map_err(bpf_err("BPF_PROG_QUERY", p.display().to_string()))
}

/// Loads the scan iterators (the descriptor tables' and mappings'
/// [`crate::fdtable`] program, filtered by the fence's `majors` map, and
/// the ring iterator) and pins
/// their links in `dir` (replacing older pins). On failure, removes what
/// this call pinned so that no stale iterator outlives the fence it was
/// made for, and says why.
/// The names in `dir` (none when it cannot be read).
fn pin_names(dir: &Path) -> BTreeSet<std::ffi::OsString> {
    fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.file_name())).collect())
        .unwrap_or_default()
}

fn pin_iterators(dir: &Path, majors: &OwnedFd) -> std::result::Result<(), String> {
    use crate::iter::{RingIterator, RingLayout};
    let r = (|| -> std::result::Result<(), String> {
        let btf = crate::btf::Btf::vmlinux().map_err(|e| e.to_string())?;
        let rings = RingLayout::from_btf(&btf)
            .map_err(|e| e.to_string())
            .and_then(|l| RingIterator::load(&l).map_err(|e| e.to_string()))?;
        let tables = crate::fdtable::FdTableLayout::from_btf(&btf)
            .map_err(|e| e.to_string())
            .and_then(|l| {
                crate::fdtable::FdTableIterator::load(&l, majors).map_err(|e| e.to_string())
            })?;
        tables.pin(dir).map_err(|e| e.to_string())?;
        rings.pin(dir).map_err(|e| e.to_string())
    })();
    if r.is_err() {
        for n in crate::iter::PINS {
            let _ = fs::remove_file(dir.join(n));
        }
    }
    r
}
