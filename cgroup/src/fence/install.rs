//! Install: the probe, the maps, what they hold, the program, the link
//! and the scan iterators.

use std::collections::BTreeSet;
use std::fs::{self, File};
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;

use gpufence_model::policy::ExemptIdentities;

use super::bpffs::{ensure_bpffs, raise_memlock, DirLock};
use super::status::{fence_programs_at, join_ids};
use super::{bpf_err, typed_map, ExemptSplit, Fence, FenceSpec, InstallReport, PROG_NAME};
use crate::error::{Error, Result};
use crate::hierarchy::Cgroup2;
use crate::maps::{
    CgroupsMap, DenialsMap, GrantsMap, LevelsMap, MajorsMap, Map, MapLayout, PIN_LINK,
};
use crate::program::{self, FenceProgramSpec, MAX_LEVEL};
use crate::sys;

/// **Test-only switch.** When this variable is `1` in the environment of
/// the process, [`probe_ancestor_helper`] answers as a kernel without the
/// helper does (before 6.1), so tests can check what gpufence does on such
/// a host. It can only make gpufence refuse to install (fail closed), never
/// weaken a fence; production configs never set it (slurmd builds the
/// Prolog's environment, and jobs cannot reach slurmd's).
pub const FORCE_NO_HELPER_ENV: &str = "GPUFENCE_TEST_FORCE_NO_HELPER";

/// Checks that the kernel lets device programs call
/// `bpf_get_current_ancestor_cgroup_id` by loading a 4-instruction program
/// that does: probe, do not trust version numbers (the helper reached
/// device programs through `cgroup_current_func_proto` in
/// `kernel/bpf/cgroup.c` in 6.1; distribution kernels backport it, e.g.
/// RHEL 9.3's BPF rebase).
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

/// The map of layout `M` pinned in `dir`, its layout checked
/// ([`typed_map`]: a pinned map of another layout is refused with
/// [`Error::MapMismatch`] and nothing is written to it), or made with
/// `configured` entries and pinned when none is; and whether it was
/// there. A configured capacity that differs from a kept map's is kept,
/// with a note (the map holds live grants).
fn open_or_create_map<M: MapLayout>(
    dir: &Path,
    configured: u32,
    notes: &mut Vec<String>,
) -> Result<(Map<M>, bool)> {
    let pin = dir.join(M::NAME);
    for _ in 0..3 {
        match sys::obj_get(&pin) {
            Ok(fd) => {
                let map = typed_map::<M>(fd, &pin)?;
                let spec = M::spec(configured);
                if map.max_entries() != spec.max_entries {
                    notes.push(format!(
                        "{} keeps its capacity {} (config asks {}): it holds live grants; `gpufence fence remove` then install to resize",
                        pin.display(),
                        map.max_entries(),
                        spec.max_entries
                    ));
                }
                return Ok((map, true));
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(bpf_err("BPF_OBJ_GET", pin.display().to_string())(e)),
        }
        let map = Map::<M>::create(configured).map_err(bpf_err("BPF_MAP_CREATE", M::NAME))?;
        match sys::obj_pin(map.as_fd(), &pin) {
            Ok(()) => return Ok((map, false)),
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

/// Attaches program `prog_fd` at `root_dir` through the link pinned in
/// `spec.bpffs_dir`: the pinned link's program swapped in place
/// (`BPF_LINK_UPDATE`) when it is attached there; else a new link made
/// and pinned (first, so there is no moment without a fence) and the old
/// one retired. The link's id and what was done go to `report`.
/// Refuses to attach when a gpufence program is attached at
/// `cgroup_root` that the link pinned in `bpffs_dir` does not run: its
/// pins are out of this process's sight, and a second fence would stack
/// on the first ([`Error::FenceElsewhere`]).
fn refuse_second_fence(cg: &Cgroup2, spec: &FenceSpec) -> Result<()> {
    let ours = Fence::linked_prog_id(&spec.bpffs_dir);
    let others: Vec<u32> = fence_programs_at(cg, &spec.cgroup_root)?
        .into_iter()
        .filter(|id| Some(*id) != ours)
        .collect();
    if others.is_empty() {
        return Ok(());
    }
    Err(Error::FenceElsewhere {
        path: cg.path(&spec.cgroup_root),
        bpffs_dir: spec.bpffs_dir.clone(),
        prog_ids: join_ids(&others),
    })
}

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
    pub(super) fn install_here(cg: &Cgroup2, spec: &FenceSpec) -> Result<(Fence, InstallReport)> {
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

        refuse_second_fence(cg, spec)?;
        let fence = Self::open_or_create_maps(spec, &mut report)?;
        fence.fill_maps(cg, spec, &mut report)?;
        let prog_fd = fence.load_program(spec.audit, &spec.identities, &mut report)?;
        attach_link(spec, &root_dir, &root_fd, &prog_fd, &mut report)?;
        // The classes, now that the program they were computed for runs
        // (fill_maps wrote changed ones as covering no one).
        if let Err(e) = fence.set_exempt_unlocked(cg, &spec.exempt, false) {
            report.notes.push(format!(
                "exemptions whose identity class changed cover no one until the next install: {e}"
            ));
        }
        report.iterators_unpinned = pin_iterators(&spec.bpffs_dir, &fence.majors)
            .err()
            .map(|e| e.to_string());
        if let Some(why) = &report.iterators_unpinned {
            report.notes.push(format!(
                "scan iterators not pinned ({why}): each Prolog and Epilog scan loads its own (slower, not less safe)"
            ));
        }
        Ok((fence, report))
    }

    /// The pinned maps, opened, or made and pinned where missing; whether
    /// the grants were kept goes to `report`.
    pub(super) fn open_or_create_maps(
        spec: &FenceSpec,
        report: &mut InstallReport,
    ) -> Result<Fence> {
        let dir = &spec.bpffs_dir;
        let notes = &mut report.notes;
        let (majors, r1) = open_or_create_map::<MajorsMap>(dir, 0, notes)?;
        let (cgroups, r2) = open_or_create_map::<CgroupsMap>(dir, spec.max_grants, notes)?;
        let (grants, r3) = open_or_create_map::<GrantsMap>(dir, spec.max_grants, notes)?;
        let (denials, _) = open_or_create_map::<DenialsMap>(dir, spec.max_denials, notes)?;
        let (levels, _) = open_or_create_map::<LevelsMap>(dir, 0, notes)?;
        report.reused_maps = r1 && r2 && r3;
        Ok(Fence {
            dir: spec.bpffs_dir.clone(),
            majors,
            cgroups,
            grants,
            denials,
            levels,
        })
    }

    /// What the maps hold at install: the protected majors, the exempt
    /// cgroups (this call holds the directory lock already: the unlocked
    /// variants), the entries' levels, then the mask the program reads to
    /// skip empty levels.
    pub(super) fn fill_maps(
        &self,
        cg: &Cgroup2,
        spec: &FenceSpec,
        report: &mut InstallReport,
    ) -> Result<()> {
        self.set_majors(&spec.protected)?;
        report.majors = spec.protected.majors().collect();
        let ExemptSplit {
            applied, missing, ..
        } = self.set_exempt_unlocked(cg, &spec.exempt, true)?;
        report.relevelled = self.relevel_unlocked(cg)?;
        self.refresh_levels()?;
        report.exempt_applied = applied;
        report.exempt_missing = missing;
        Ok(())
    }

    /// The fence program built against these maps and loaded through the
    /// verifier; its id goes to `report`.
    pub(super) fn load_program(
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
}

/// The names in `dir` (none when it cannot be read).
fn pin_names(dir: &Path) -> BTreeSet<std::ffi::OsString> {
    fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.file_name())).collect())
        .unwrap_or_default()
}

/// Loads the scan iterators (the descriptor tables' and mappings'
/// [`crate::iter::fdtable`] program, filtered by the fence's `majors` map, and
/// the ring iterator) and pins their links in `dir` (replacing older
/// pins). On failure, removes what this call pinned so that no stale
/// iterator outlives the fence it was made for, and says why.
fn pin_iterators(
    dir: &Path,
    majors: &Map<MajorsMap>,
) -> std::result::Result<(), crate::iter::IterError> {
    use crate::iter::{RingIterator, RingLayout};
    let r = (|| -> std::result::Result<(), crate::iter::IterError> {
        let btf = crate::btf::Btf::vmlinux()?;
        let rings = RingIterator::load(&RingLayout::from_btf(&btf)?)?;
        let tables = crate::iter::fdtable::FdTableIterator::load(
            &crate::iter::fdtable::FdTableLayout::from_btf(&btf)?,
            majors,
        )?;
        tables.pin(dir)?;
        rings.pin(dir)
    })();
    if r.is_err() {
        for n in crate::iter::PINS {
            let _ = fs::remove_file(dir.join(n));
        }
    }
    r
}
