//! The rules [`super::place`] applies: name lookup, the count and sum checks
//! (rules 1–5 of the module docs), then the backtracking over allowed starts
//! (rule 6).

use super::tables::Table;
use super::{Placement, PlacementError, Profile};

impl Table {
    pub(super) fn find(&self, name: &str) -> Result<&'static Profile, PlacementError> {
        let lower = name.trim().to_ascii_lowercase();
        let mut key = lower.as_str();
        key = key.strip_prefix("nvidia.com/").unwrap_or(key);
        for prefix in ["mig-", "mig "] {
            if let Some(rest) = key.strip_prefix(prefix) {
                key = rest.trim_start();
                break;
            }
        }
        let by_id = key.parse::<u32>().ok();
        self.profiles
            .iter()
            .find(|p| p.name == key || by_id == Some(p.profile_id))
            .ok_or_else(|| PlacementError::UnknownProfile {
                model: self.model,
                name: name.to_string(),
                valid: self.profiles.iter().map(|p| p.name).collect(),
            })
    }

    pub(super) fn place(&self, requested: &[&str]) -> Result<Vec<Placement>, PlacementError> {
        let wanted: Vec<&'static Profile> = requested
            .iter()
            .map(|n| self.find(n))
            .collect::<Result<_, _>>()?;
        self.check_counts(&wanted)?;
        self.check_sums(&wanted)?;

        // Search order: largest first (fewest ways to fit), identical
        // profiles adjacent so their starts can be forced ascending (they are
        // interchangeable, so this loses no solution).
        let table_index = |p: &Profile| {
            self.profiles
                .iter()
                .position(|q| std::ptr::eq(q, p))
                .unwrap_or(usize::MAX)
        };
        let mut order: Vec<usize> = (0..wanted.len()).collect();
        order.sort_by_key(|&i| {
            let p = wanted[i];
            (
                std::cmp::Reverse(p.memory_slices),
                std::cmp::Reverse(p.compute_slices),
                p.placements.len(),
                table_index(p),
                i,
            )
        });
        let items: Vec<&'static Profile> = order.iter().map(|&i| wanted[i]).collect();
        let mut search = Search {
            memory_slices: self.memory_slices,
            items: &items,
            starts: Vec::with_capacity(items.len()),
            deepest: None,
        };
        if search.run(0, 0) {
            let mut out = vec![None; wanted.len()];
            for (k, &i) in order.iter().enumerate() {
                let p = items[k];
                out[i] = Some(Placement {
                    profile: p,
                    start: search.starts[k],
                    size: p.memory_slices,
                });
            }
            return Ok(out.into_iter().flatten().collect());
        }
        let (k, mut occupied) = search
            .deepest
            .expect("a failed search records where it failed");
        occupied.sort_by_key(|p| p.start);
        Err(PlacementError::NoPlacement {
            model: self.model,
            profile: items[k].name,
            spec: items[k].placement_spec(),
            occupied,
        })
    }

    fn check_counts(&self, wanted: &[&'static Profile]) -> Result<(), PlacementError> {
        for p in self.profiles {
            let n = wanted.iter().filter(|w| std::ptr::eq(**w, p)).count();
            if n > usize::from(p.max_count) {
                return Err(PlacementError::TooMany {
                    model: self.model,
                    profile: p.name,
                    requested: n,
                    max: p.max_count,
                });
            }
        }
        let me: Vec<&'static str> = wanted
            .iter()
            .filter(|p| p.media_extensions)
            .map(|p| p.name)
            .collect();
        if me.len() > 1 {
            return Err(PlacementError::MediaExtensions {
                model: self.model,
                requested: me,
            });
        }
        Ok(())
    }

    fn check_sums(&self, wanted: &[&'static Profile]) -> Result<(), PlacementError> {
        let breakdown = |f: fn(&Profile) -> u8| {
            let parts: Vec<String> = wanted
                .iter()
                .map(|p| format!("{}:{}", p.name, f(p)))
                .collect();
            parts.join(" + ")
        };
        let memory: u32 = wanted.iter().map(|p| u32::from(p.memory_slices)).sum();
        if memory > u32::from(self.memory_slices) {
            return Err(PlacementError::MemoryExceeded {
                model: self.model,
                requested: memory,
                available: self.memory_slices,
                breakdown: breakdown(|p| p.memory_slices),
            });
        }
        let compute: u32 = wanted.iter().map(|p| u32::from(p.compute_slices)).sum();
        if compute > u32::from(self.compute_slices) {
            return Err(PlacementError::ComputeExceeded {
                model: self.model,
                requested: compute,
                available: self.compute_slices,
                breakdown: breakdown(|p| p.compute_slices),
            });
        }
        Ok(())
    }
}

/// Backtracking over the items in search order; `starts[k]` is item k's.
struct Search<'a> {
    memory_slices: u8,
    items: &'a [&'static Profile],
    starts: Vec<u8>,
    /// The deepest item index at which no start was free, with what was
    /// placed at that moment.
    deepest: Option<(usize, Vec<Placement>)>,
}

impl Search<'_> {
    fn run(&mut self, k: usize, occupied: u64) -> bool {
        let Some(&p) = self.items.get(k) else {
            return true;
        };
        // Identical profiles are adjacent in search order: force ascending
        // starts among them.
        let floor = match k.checked_sub(1) {
            Some(j) if std::ptr::eq(self.items[j], p) => Some(self.starts[j]),
            _ => None,
        };
        let mut any_free = false;
        for &start in p.placements {
            if floor.is_some_and(|f| start <= f) {
                continue;
            }
            let Some(mask) = slice_mask(start, p.memory_slices, self.memory_slices) else {
                continue;
            };
            if occupied & mask != 0 {
                continue;
            }
            any_free = true;
            self.starts.push(start);
            if self.run(k + 1, occupied | mask) {
                return true;
            }
            self.starts.pop();
        }
        if !any_free && self.deepest.as_ref().is_none_or(|(d, _)| k > *d) {
            let placed = self.items[..k]
                .iter()
                .zip(&self.starts)
                .map(|(q, &s)| Placement {
                    profile: q,
                    start: s,
                    size: q.memory_slices,
                })
                .collect();
            self.deepest = Some((k, placed));
        }
        false
    }
}

/// Bit mask of memory slices `start..start + size`, or `None` when the run
/// leaves the GPU (never for the tables here; guards hand-written ones).
fn slice_mask(start: u8, size: u8, total: u8) -> Option<u64> {
    let end = u32::from(start) + u32::from(size);
    if size == 0 || end > u32::from(total) || end > 64 {
        return None;
    }
    let ones = if size >= 64 {
        u64::MAX
    } else {
        (1u64 << size) - 1
    };
    Some(ones << start)
}
