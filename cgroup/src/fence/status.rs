//! What is installed: status, the link check, denials, the program's
//! answer over the live maps; and removal.

use std::fs::{self, File};
use std::io;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use gpufence_model::device::{Access, DevNum};
use gpufence_model::policy::ExemptIdentities;

use super::bpffs::DirLock;
use super::{bpf_err, DenialEntry, Fence, FenceStatus, PROG_NAME};
use crate::error::{Error, Result};
use crate::hierarchy::Cgroup2;
use crate::maps::{
    CgroupsMap, DenialValue, GrantsMap, LevelsMap, MajorsMap, MapLayout, MapPod, CGROUP_EXEMPT,
    PIN_CGROUPS, PIN_DENIALS, PIN_GRANTS, PIN_LEVELS, PIN_LINK, PIN_MAJORS,
};
use crate::sys;
use crate::verdict::{self, Evaluation, MapRole, MapView};

impl Fence {
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
        let keys = self
            .denials
            .keys()
            .map_err(bpf_err("BPF_MAP_GET_NEXT_KEY", "denials"))?;
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            let val: Option<DenialValue> = self
                .denials
                .lookup(&key)
                .map_err(bpf_err("BPF_MAP_LOOKUP_ELEM", "denials"))?;
            if let Some(val) = val {
                out.push(DenialEntry {
                    cgroup_id: key.cgroup_id,
                    uid: key.uid,
                    dev: key.dev(),
                    access: key.access(),
                    count: val.count,
                    last_pid: val.last_pid,
                    last_comm: val.comm_str(),
                    last_ns: val.last_ns,
                });
            }
        }
        out.sort_by_key(|d| (d.cgroup_id, d.uid, d.dev, d.access.bits()));
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
        // What the kernel says is attached at cgroup_root: a gpufence
        // program the pins do not name is a fence this process cannot see.
        if let Ok(ids) = fence_programs_at(cg, cgroup_root) {
            st.unpinned_programs = ids
                .into_iter()
                .filter(|id| Some(*id) != st.prog_id)
                .collect();
        }
        if !st.unpinned_programs.is_empty() && st.prog_id.is_none() {
            st.problems.push(format!(
                "a gpufence program (id {}) is attached at cgroup_root /{cgroup_root} and enforces, but its pins are not visible in {} (bpffs mounted elsewhere, a private mount namespace, or another bpffs_dir): run gpufence where they are",
                join_ids(&st.unpinned_programs),
                bpffs_dir.display()
            ));
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

    /// Whether the pinned link in `bpffs_dir` is attached at `cgroup_root`:
    /// one pin lookup and one info call, for the prolog and the plugin (the
    /// full [`Fence::status`] walks every map).
    ///
    /// # Errors
    /// [`NotAttached`]: why it is not, in one line.
    pub fn check_attached(
        cg: &Cgroup2,
        cgroup_root: &str,
        bpffs_dir: &Path,
    ) -> std::result::Result<(), NotAttached> {
        let link_pin = bpffs_dir.join(PIN_LINK);
        let link = sys::obj_get(&link_pin).map_err(|e| {
            if e.raw_os_error() == Some(libc::ENOENT) {
                NotAttached::NoPin(link_pin.clone())
            } else {
                NotAttached::Pin {
                    path: link_pin.clone(),
                    source: e,
                }
            }
        })?;
        let info = sys::link_info(link.as_fd()).map_err(|e| NotAttached::Info {
            path: link_pin.clone(),
            source: e,
        })?;
        if info.prog_id == 0 {
            return Err(NotAttached::Detached(link_pin));
        }
        let root = cg
            .id(cgroup_root)
            .map_err(|e| NotAttached::Root(Box::new(e)))?;
        if info.cgroup_id != root {
            return Err(NotAttached::Elsewhere {
                cgroup_id: info.cgroup_id,
                cgroup_root: cgroup_root.to_string(),
                root,
            });
        }
        Ok(())
    }

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

    /// What `status` says about levels: entries recorded at another level
    /// than the kernel has their cgroup at, and grants or exemptions the
    /// program, run over the maps for a task in their cgroup, does not
    /// honour. Only cgroups this mount shows are checked.
    pub(super) fn level_problems(&self, cg: &Cgroup2) -> Result<Vec<String>> {
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
                    // Whatever its class, root in every class: the check
                    // is of the entry's level, not of whom it covers.
                    let every_class = ExemptIdentities {
                        classes: vec![[0].into(); ExemptIdentities::MAX_CLASSES],
                    };
                    if !self
                        .evaluate(root_task(&ancestry), &every_class, dev, Access::RW)?
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

/// The value size of map `M`.
fn value_size<M: MapLayout>() -> usize {
    <M::Value as MapPod>::SIZE
}

impl MapView for Fence {
    fn lookup(&self, map: MapRole, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let (fd, size, name) = match map {
            MapRole::Majors => (self.majors.map_fd(), value_size::<MajorsMap>(), PIN_MAJORS),
            MapRole::Cgroups => (
                self.cgroups.map_fd(),
                value_size::<CgroupsMap>(),
                PIN_CGROUPS,
            ),
            MapRole::Grants => (self.grants.map_fd(), value_size::<GrantsMap>(), PIN_GRANTS),
            MapRole::Levels => (self.levels.map_fd(), value_size::<LevelsMap>(), PIN_LEVELS),
        };
        let mut v = vec![0u8; size];
        let found =
            sys::map_lookup(fd, key, &mut v).map_err(bpf_err("BPF_MAP_LOOKUP_ELEM", name))?;
        Ok(found.then_some(v))
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

/// The gpufence fence programs (named [`PROG_NAME`]) attached directly at
/// cgroup `rel`, by id: what the kernel says is there, whatever pins this
/// process can see (`BPF_PROG_QUERY`, then each program's name).
///
/// # Errors
/// [`Error`] when the cgroup cannot be opened or queried.
pub fn fence_programs_at(cg: &Cgroup2, rel: &str) -> Result<Vec<u32>> {
    let (_, ids) = programs_at(cg, rel)?;
    Ok(ids
        .into_iter()
        .filter(|id| {
            sys::prog_fd_by_id(*id)
                .and_then(|fd| sys::prog_info(fd.as_fd()))
                .is_ok_and(|i| sys::name_str(&i.name) == PROG_NAME)
        })
        .collect())
}

/// Ids as `1, 2, 3`.
pub(super) fn join_ids(ids: &[u32]) -> String {
    ids.iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Why the fence's link is not attached at `cgroup_root`
/// ([`Fence::check_attached`]).
#[derive(Debug, thiserror::Error)]
pub enum NotAttached {
    /// Nothing is pinned: never installed, or removed.
    #[error("no pinned link at {}", .0.display())]
    NoPin(PathBuf),
    /// The pin cannot be opened.
    #[error("pinned link {}: {source}", path.display())]
    Pin {
        /// The pin.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// The link cannot be asked about.
    #[error("{}: {source}", path.display())]
    Info {
        /// The pin.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// The link was detached (`BPF_LINK_DETACH`).
    #[error("{} is detached from its cgroup", .0.display())]
    Detached(PathBuf),
    /// `cgroup_root` cannot be found.
    #[error("{0}")]
    Root(#[source] Box<Error>),
    /// The link is attached to another cgroup.
    #[error("the link is attached to cgroup id {cgroup_id}, not to cgroup_root /{cgroup_root} (id {root})")]
    Elsewhere {
        /// Where it is attached.
        cgroup_id: u64,
        /// The configured `cgroup_root`.
        cgroup_root: String,
        /// `cgroup_root`'s id.
        root: u64,
    },
}
