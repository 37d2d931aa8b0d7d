//! The `cgroups` map (exempt and granted cgroups, at their kernel
//! levels) and the populated-levels mask.

use std::collections::{BTreeMap, BTreeSet};

use super::{bpf_err, located_level, ExemptCgroup, ExemptSplit, Fence};
use crate::error::Result;
use crate::hierarchy::Cgroup2;
use crate::maps::{
    class_of, with_class, CgroupValue, CGROUP_CLASS_MASK, CGROUP_EXEMPT, CGROUP_GRANTED,
};
use crate::program::MAX_LEVEL;

impl Fence {
    /// The `cgroups` entry of `cgroup_id`: `(flags, level)`.
    pub(super) fn entry_of(&self, cgroup_id: u64) -> Result<Option<(u32, u32)>> {
        Ok(self
            .cgroups
            .lookup(&cgroup_id)
            .map_err(bpf_err("BPF_MAP_LOOKUP_ELEM", "cgroups"))?
            .map(|v| (v.flags, v.level)))
    }

    pub(super) fn flags_of(&self, cgroup_id: u64) -> Result<u32> {
        Ok(self.entry_of(cgroup_id)?.map_or(0, |(f, _)| f))
    }

    /// Writes the flags of `cgroup_id` (deleting the entry at 0); `level`
    /// is the cgroup's level, kept from the existing entry when `None`.
    /// The level's bit is set in the `levels` mask before the entry is
    /// written (the program must not skip it); a deletion leaves the mask
    /// as it is (the next install recomputes it: [`Fence::refresh_levels`]).
    /// Callers hold the fence lock.
    pub(super) fn write_flags(&self, cgroup_id: u64, flags: u32, level: Option<u32>) -> Result<()> {
        if flags == 0 {
            self.cgroups
                .delete(&cgroup_id)
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
                self.levels
                    .update(&0, &(mask | 1 << level))
                    .map_err(bpf_err("BPF_MAP_UPDATE_ELEM", "levels"))?;
            }
        }
        self.cgroups
            .update(&cgroup_id, &CgroupValue { flags, level })
            .map_err(bpf_err("BPF_MAP_UPDATE_ELEM", "cgroups"))?;
        Ok(())
    }

    /// Recomputes the populated-levels mask from the `cgroups` entries (a
    /// walk of the whole map): at install, under the fence lock, after the
    /// exemptions are written. Between installs the mask only gains bits
    /// ([`Fence::write_flags`]), so the program never skips a level that
    /// matters.
    pub(super) fn refresh_levels(&self) -> Result<()> {
        let mut mask = 0u32;
        for (_, (_, level)) in self.cgroup_entries()? {
            if (1..=MAX_LEVEL as u32).contains(&level) {
                mask |= 1 << level;
            }
        }
        self.levels
            .update(&0, &mask)
            .map_err(bpf_err("BPF_MAP_UPDATE_ELEM", "levels"))
    }

    /// The populated-levels mask, from the map.
    ///
    /// # Errors
    /// [`Error::Bpf`](crate::Error::Bpf).
    pub fn levels_mask(&self) -> Result<u32> {
        Ok(self
            .levels
            .lookup(&0)
            .map_err(bpf_err("BPF_MAP_LOOKUP_ELEM", "levels"))?
            .unwrap_or(0))
    }

    /// Every entry of the `cgroups` map: id → (flags, level).
    pub(super) fn cgroup_entries(&self) -> Result<BTreeMap<u64, (u32, u32)>> {
        if let Some(all) = self
            .cgroups
            .entries_batch()
            .map_err(bpf_err("BPF_MAP_LOOKUP_BATCH", "cgroups"))?
        {
            return Ok(all
                .into_iter()
                .map(|(id, v)| (id, (v.flags, v.level)))
                .collect());
        }
        let keys = self
            .cgroups
            .keys()
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
    /// [`Error::Bpf`](crate::Error::Bpf).
    pub fn cgroup_flags(&self) -> Result<BTreeMap<u64, u32>> {
        let keys = self
            .cgroups
            .keys()
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
    /// As [`Fence::add_exempt_in`], and [`Error::NoCgroup2`](crate::Error::NoCgroup2).
    pub fn add_exempt(&self, cgroup_id: u64, path: &str) -> Result<()> {
        self.add_exempt_in(&Cgroup2::discover()?, cgroup_id, path)
    }

    /// Makes cgroup `cgroup_id` (at `path`, relative to `cg`'s mount)
    /// exempt now for root only
    /// ([`ExemptIdentities::ROOT_CLASS`](gpufence_model::policy::ExemptIdentities::ROOT_CLASS)),
    /// without a reinstall, at its kernel level ([`Cgroup2::kernel_level`]).
    ///
    /// # Errors
    /// [`Error::Bpf`](crate::Error::Bpf);
    /// [`Error::KernelLevelUnknown`](crate::Error::KernelLevelUnknown)
    /// (nothing is written); [`Error::Cgroup`](crate::Error::Cgroup) when
    /// `path` is not cgroup `cgroup_id`.
    pub fn add_exempt_in(&self, cg: &Cgroup2, cgroup_id: u64, path: &str) -> Result<()> {
        let level = located_level(cg, cgroup_id, path)?;
        self.locked(|| {
            let f = self.flags_of(cgroup_id)?;
            let class = gpufence_model::policy::ExemptIdentities::ROOT_CLASS;
            self.write_flags(
                cgroup_id,
                with_class(f | CGROUP_EXEMPT, class),
                Some(level as u32),
            )
        })
    }

    /// The identity class of cgroup `cgroup_id` when it is exempt
    /// ([`crate::maps::class_of`]); `None` when it is not.
    ///
    /// # Errors
    /// [`Error::Bpf`](crate::Error::Bpf).
    pub fn exempt_class(&self, cgroup_id: u64) -> Result<Option<u32>> {
        let f = self.flags_of(cgroup_id)?;
        Ok((f & CGROUP_EXEMPT != 0).then(|| class_of(f)))
    }

    /// Whether cgroup `id` is exempt.
    ///
    /// # Errors
    /// [`Error::Bpf`](crate::Error::Bpf).
    pub fn is_exempt(&self, cgroup_id: u64) -> Result<bool> {
        Ok(self.flags_of(cgroup_id)? & CGROUP_EXEMPT != 0)
    }

    /// Whether cgroup `cgroup_id` holds a grant of some device (its
    /// `GRANTED` flag).
    ///
    /// # Errors
    /// [`Error::Bpf`](crate::Error::Bpf) when the map cannot be read.
    pub fn is_granted(&self, cgroup_id: u64) -> Result<bool> {
        Ok(self.flags_of(cgroup_id)? & CGROUP_GRANTED != 0)
    }

    /// Makes exactly the existing cgroups of `paths` exempt, each for its
    /// class: adds the missing flags and sets the classes, then clears the
    /// flag (and class) from cgroups no longer listed. Returns `(applied,
    /// missing)`.
    ///
    /// # Errors
    /// [`Error::Bpf`](crate::Error::Bpf).
    pub fn set_exempt(&self, cg: &Cgroup2, paths: &[ExemptCgroup]) -> Result<ExemptSplit> {
        self.locked(|| self.set_exempt_unlocked(cg, paths, false))
    }

    /// What an install writes of `paths` before it swaps programs: as
    /// [`Fence::set_exempt`], but an entry whose class changes (or that is
    /// new) covers no one until [`Fence::set_exempt`] writes its class
    /// under the new program ([`Fence::install`] does both).
    ///
    /// # Errors
    /// [`Error::Bpf`](crate::Error::Bpf).
    pub fn stage_exempt(&self, cg: &Cgroup2, paths: &[ExemptCgroup]) -> Result<ExemptSplit> {
        self.locked(|| self.set_exempt_unlocked(cg, paths, true))
    }

    /// [`Fence::set_exempt`] under the lock the caller holds. `interim`:
    /// the program that reads these entries now is not the one their
    /// classes were computed for (an install, before it swaps programs):
    /// an entry whose class changes, or that is new, gets an index with no
    /// class ([`CGROUP_CLASS_MASK`]: covers no one under either program)
    /// until the call after the swap writes its class. An entry whose
    /// class stays is written as it will be (a plain reinstall blinks no
    /// service). Were the swap to fail, the changed entries cover no one:
    /// closed, never another entry's users.
    pub(super) fn set_exempt_unlocked(
        &self,
        cg: &Cgroup2,
        paths: &[ExemptCgroup],
        interim: bool,
    ) -> Result<ExemptSplit> {
        let mut applied = Vec::new();
        let mut classes = Vec::new();
        let mut missing = Vec::new();
        for p in paths {
            match cg.id(&p.path) {
                Ok(id) => {
                    applied.push((p.path.clone(), id));
                    classes.push(p.class);
                }
                Err(_) => missing.push(p.path.clone()),
            }
        }
        let want: BTreeSet<u64> = applied.iter().map(|(_, id)| *id).collect();
        let levels = applied
            .iter()
            .map(|(p, _)| cg.kernel_level(p))
            .collect::<Result<Vec<_>>>()?;
        let mut newly = Vec::new();
        for (((path, id), level), class) in applied.iter().zip(levels).zip(classes) {
            let f = self.flags_of(*id)?;
            if f & CGROUP_EXEMPT == 0 {
                newly.push((path.clone(), *id));
            }
            let stays = f & CGROUP_EXEMPT != 0 && class_of(f) == class;
            let class = if interim && !stays {
                CGROUP_CLASS_MASK
            } else {
                class
            };
            self.write_flags(
                *id,
                with_class(f | CGROUP_EXEMPT, class),
                Some(level as u32),
            )?;
        }
        for (id, f) in self.cgroup_flags()? {
            if f & CGROUP_EXEMPT != 0 && !want.contains(&id) {
                self.write_flags(id, with_class(f & !CGROUP_EXEMPT, 0), None)?;
            }
        }
        Ok(ExemptSplit {
            applied,
            newly,
            missing,
        })
    }

    /// Rewrites the level of every entry whose recorded level is not the
    /// kernel's level of its cgroup (entries an earlier version recorded
    /// at a cgroup namespace's depth). Cgroups this mount does not show
    /// (gone, or outside the namespace) are left alone. Callers hold the
    /// lock and refresh the mask after.
    pub(super) fn relevel_unlocked(&self, cg: &Cgroup2) -> Result<Vec<(String, u64, u32, usize)>> {
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
}
