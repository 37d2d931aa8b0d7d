//! The `majors` map: which majors the fence protects.

use std::collections::BTreeSet;
use std::path::Path;

use gpufence_model::procdevices::ProtectedMajors;

use super::{bpf_err, Fence};
use crate::error::Result;
use crate::maps::{MajorsMap, MAJORS_ENTRIES, MAJOR_PROTECTED};

impl Fence {
    /// Whether every major of `majors` is protected by the fence pinned in
    /// `bpffs_dir` (its `majors` map, one lookup each): what a scan asks
    /// before it reads the pinned iterators, which write only protected
    /// majors ([`crate::iter::fdtable`]).
    ///
    /// # Errors
    /// [`Error::NotInstalled`](crate::Error::NotInstalled): no pinned map;
    /// [`Error::MapMismatch`](crate::Error::MapMismatch): a map of another
    /// layout; [`Error::Bpf`](crate::Error::Bpf): a lookup failed.
    pub fn majors_protected(bpffs_dir: &Path, majors: &[u32]) -> Result<bool> {
        let map = Self::open_map::<MajorsMap>(bpffs_dir)?;
        for m in majors {
            if *m >= MAJORS_ENTRIES
                || map
                    .lookup(m)
                    .map_err(bpf_err("BPF_MAP_LOOKUP_ELEM", "majors"))?
                    .unwrap_or(0)
                    == 0
            {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Protects each of `majors` that is not protected yet (never
    /// unprotects). Returns the ones added. A few lookups: cheap enough for
    /// every prolog, which heals a driver loaded after the install.
    ///
    /// # Errors
    /// [`Error::Bpf`](crate::Error::Bpf).
    pub fn add_majors(&self, majors: &[u32]) -> Result<Vec<u32>> {
        let mut added = Vec::new();
        for m in majors {
            let on = self
                .majors
                .lookup(m)
                .map_err(bpf_err("BPF_MAP_LOOKUP_ELEM", format!("majors[{m}]")))?
                .is_some_and(|v| v != 0);
            if !on {
                self.majors
                    .update(m, &MAJOR_PROTECTED)
                    .map_err(bpf_err("BPF_MAP_UPDATE_ELEM", format!("majors[{m}]")))?;
                added.push(*m);
            }
        }
        Ok(added)
    }

    pub(super) fn set_majors(&self, protected: &ProtectedMajors) -> Result<()> {
        let want: BTreeSet<u32> = protected.majors().collect();
        let current: BTreeSet<u32> = self.protected_majors()?.into_iter().collect();
        // Protect new majors before unprotecting old ones: no moment in
        // which a major that should be closed is open.
        for m in want.difference(&current) {
            self.majors
                .update(m, &MAJOR_PROTECTED)
                .map_err(bpf_err("BPF_MAP_UPDATE_ELEM", format!("majors[{m}]")))?;
        }
        for m in current.difference(&want) {
            self.majors
                .update(m, &0)
                .map_err(bpf_err("BPF_MAP_UPDATE_ELEM", format!("majors[{m}]")))?;
        }
        Ok(())
    }

    /// The protected majors, from the map.
    ///
    /// # Errors
    /// [`Error::Bpf`](crate::Error::Bpf).
    pub fn protected_majors(&self) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        for m in 0..MAJORS_ENTRIES {
            if self
                .majors
                .lookup(&m)
                .map_err(bpf_err("BPF_MAP_LOOKUP_ELEM", "majors"))?
                .is_some_and(|v| v != 0)
            {
                out.push(m);
            }
        }
        Ok(out)
    }
}
