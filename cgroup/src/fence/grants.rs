//! The `grants` map: grant, list, look up, revoke.

use std::collections::BTreeSet;

use gpufence_model::device::{Access, DevNum};

use super::{bpf_err, located_level, Fence, GrantEntry};
use crate::error::{Error, Result};
use crate::hierarchy::Cgroup2;
use crate::maps::{GrantKey, GrantValue, CGROUP_GRANTED};
use crate::program::MAX_LEVEL;

impl Fence {
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
                self.grants.update(&key, &val).map_err(bpf_err(
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
                let _ = self.grants.delete(k);
            }
        }
        result
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
        let mut out: Vec<GrantEntry> = match self
            .grants
            .entries_batch()
            .map_err(bpf_err("BPF_MAP_LOOKUP_BATCH", "grants"))?
        {
            Some(all) => all.iter().map(|(k, v)| entry(k, v)).collect(),
            None => {
                let keys = self
                    .grants
                    .keys()
                    .map_err(bpf_err("BPF_MAP_GET_NEXT_KEY", "grants"))?;
                let mut out = Vec::with_capacity(keys.len());
                for key in keys {
                    if let Some(val) = self
                        .grants
                        .lookup(&key)
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
        self.grants
            .lookup(&GrantKey::new(cgroup_id, dev))
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

    pub(super) fn revoke_where(
        &self,
        pred: impl Fn(&GrantEntry) -> bool,
    ) -> Result<Vec<GrantEntry>> {
        self.locked(|| self.revoke_where_unlocked(pred))
    }

    pub(super) fn revoke_where_unlocked(
        &self,
        pred: impl Fn(&GrantEntry) -> bool,
    ) -> Result<Vec<GrantEntry>> {
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
            self.grants.delete(&key).map_err(bpf_err(
                "BPF_MAP_DELETE_ELEM",
                format!("grants[{}, {}]", e.cgroup_id, e.dev),
            ))?;
        }
        Ok(gone)
    }
}
