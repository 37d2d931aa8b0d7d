//! The MIG placement model behind `gpufence mig check --gpu MODEL PROFILE[,PROFILE...]`:
//! does a set of MIG GPU-instance profiles fit on one GPU together, where does
//! each one start, and if not, why not. Pure: no I/O, no NVML. The drawing,
//! the best partial packing and the JSON the command prints are built in
//! [`crate::migdraw`] from [`place`]'s answers.
//!
//! # The model
//!
//! A MIG-capable GPU is cut into *memory slices* (8 on A100/H100/H200, 4 on
//! A30) and *compute (SM) slices* (7 on A100/H100/H200, 4 on A30). A GPU
//! instance profile such as `3g.20gb` takes a number of compute slices (the
//! `3g`) and a run of consecutive memory slices, and may only start at
//! certain memory-slice indices. `nvidia-smi mig -lgipp` prints those starts
//! and the run length as `{0,4}:4`; NVML's `nvmlGpuInstancePlacement_t`
//! defines `start` as the "index of first occupied memory slice" and `size`
//! as the "number of memory slices occupied", and GPU-instance creation
//! "will fail if there is overlap with the already occupied memory slices"
//! (NVML API reference, Multi Instance GPU Management,
//! <https://docs.nvidia.com/deploy/nvml-api/structnvmlGpuInstancePlacement__t.html>
//! and `nvmlDeviceGetGpuInstancePossiblePlacements_v2` in
//! <https://docs.nvidia.com/deploy/nvml-api/group__nvmlMultiInstanceGPU.html>).
//! Slice counts: MIG User Guide, *Concepts → Terminology/Partitioning*
//! (<https://docs.nvidia.com/datacenter/tesla/mig-user-guide/concepts.html>):
//! "Each GPU memory slice gets 1/8 of the total GPU memory resources and
//! each GPU SM slice gets 1/7 of the total number of SMs"; the A30 tables
//! use quarters.
//!
//! # Rules [`place`] applies, in this order
//!
//! 1. Every name is a profile of the model ([`PlacementError::UnknownProfile`]).
//! 2. At most [`Profile::max_count`] instances of each profile — the
//!    "Number of Instances Available" column of the guide's tables
//!    ([`PlacementError::TooMany`]).
//! 3. At most one instance with media extensions (`+me`) per GPU
//!    ([`PlacementError::MediaExtensions`]). The guide says "A single 1g
//!    profile can include media extensions" (and on A30 "A single 2g
//!    profile…"); its Hardware Units column gives every `+me` profile 1 OFA
//!    and the whole-GPU profile only 1 OFA, so two `+me` instances, even of
//!    different profiles (A30 `1g.6gb+me` + `2g.12gb+me`), cannot coexist.
//!    The cross-profile case is derived from the table, not stated outright.
//! 4. The memory slices asked for add up to at most the GPU's
//!    ([`PlacementError::MemoryExceeded`]).
//! 5. The compute slices asked for add up to at most the GPU's
//!    ([`PlacementError::ComputeExceeded`]).
//! 6. Every instance gets one of its allowed starts and no two runs of
//!    memory slices overlap ([`PlacementError::NoPlacement`]). All
//!    assignments are searched (backtracking), so "no placement" means none
//!    exists, not that a greedy order failed.
//!
//! Rules 4 and 5 are implied by rule 6 on these tables (a profile never has
//! more compute than memory slices, and the last memory slice is reachable
//! only by profiles with fewer compute than memory slices); they are checked
//! first because their message is clearer. With the tables below, every
//! request that passes rules 1–5 can be placed (the test
//! `exhaustive_small_requests_agree_with_brute_force` enumerates them), so
//! rule 6 only fires on tables added later.
//!
//! No rule forbids `4g` and `3g` together: the guide says "prior to NVIDIA
//! driver release R510, the combination of a (4 memory, 4 compute) and a
//! (4 memory, 3 compute) profile was not supported. This restriction no
//! longer applies on newer drivers" (*Concepts → Partitioning*). This model
//! is for R510 and later. Profiles that need newer drivers (guide notes:
//! `1g.5gb+me`/`1g.6gb+me` from R470, A100 `1g.10gb` and A30 `2g.12gb+me`
//! from R525) are listed as always available.
//!
//! Engine counts (NVDEC, JPEG) are not checked: the guide's tables never let
//! a combination that fits in memory ask for more of them than the whole-GPU
//! profile has, except OFA, which rule 3 covers.
//!
//! The placement returned is *a* valid one, found deterministically
//! (largest profiles first, lowest start first), not necessarily the one
//! `nvidia-smi mig -cgi` would choose: `nvidia-smi` places instances greedily
//! in the order given, and the guide (*Getting Started → Creating GPU
//! Instances*, "Example 2: Creation of a 3-2-1-1 geometry") shows
//! `-cgi 19,19,14,9` failing with "Insufficient Resources" where `9,19,14,19`
//! succeeds. Listing the profiles largest first avoids that.
//!
//! # Sources per table
//!
//! - Names, memory and SM fractions, "Number of Instances Available",
//!   `+me`: MIG User Guide (v580), *Supported MIG Profiles*,
//!   <https://docs.nvidia.com/datacenter/tesla/mig-user-guide/supported-mig-profiles.html>,
//!   sections "A30 MIG Profiles", "A100 MIG Profiles", "H100 MIG Profiles"
//!   (80GB and 94GB tables) and "H200 MIG Profiles".
//! - A100-40GB profile ids and placements: the same guide, *Getting Started
//!   with MIG → List GPU Instance Profiles*,
//!   <https://docs.nvidia.com/datacenter/tesla/mig-user-guide/getting-started-with-mig.html>,
//!   which prints `nvidia-smi mig -lgip` and `-lgipp` for an A100-SXM4-40GB.
//! - Other models' ids and placements: see each table's note; where the
//!   guide shows no `-lgipp` for a model, the placements come from captures
//!   of real GPUs quoted in public repositories and issues, as named there.

use std::fmt;
use std::str::FromStr;

mod rules;
mod tables;

pub use tables::{
    A100_40GB_PROFILES, A100_80GB_PROFILES, A30_24GB_PROFILES, H100_80GB_PROFILES,
    H100_94GB_PROFILES, H200_141GB_PROFILES,
};

/// A MIG-capable GPU model this module knows the profile table of.
///
/// Parsed from what admins type, case-insensitively and ignoring a leading
/// `NVIDIA` and any spaces, `-`, `_` or `.` (so `A100-40GB`, `a100_40gb`,
/// `"A100 40GB"` and `NVIDIA A100-SXM4-40GB` are one form). Accepted forms,
/// written with dashes:
///
/// | model | forms |
/// |---|---|
/// | [`A100_40GB`](GpuModel::A100_40GB) | `A100-40GB`, `A100-SXM4-40GB`, `A100-PCIE-40GB` |
/// | [`A100_80GB`](GpuModel::A100_80GB) | `A100-80GB`, `A100-SXM4-80GB`, `A100-PCIE-80GB`, `A100-80GB-PCIe` |
/// | [`A30_24GB`](GpuModel::A30_24GB) | `A30`, `A30-24GB`, `A30-PCIE`, `A30-PCIE-24GB` |
/// | [`H100_80GB`](GpuModel::H100_80GB) | `H100-80GB`, `H100-SXM5-80GB`, `H100-PCIE-80GB`, `H100-80GB-HBM3` |
/// | [`H100_94GB`](GpuModel::H100_94GB) | `H100-94GB`, `H100-NVL`, `H100-NVL-94GB`, `H100-SXM5-94GB`, `H100-PCIE-94GB` |
/// | [`H200_141GB`](GpuModel::H200_141GB) | `H200`, `H200-141GB`, `H200-SXM5`, `H200-SXM5-141GB`, `H200-NVL`, `H200-NVL-141GB` |
///
/// A bare `A100` (or `A100-SXM4`, `A100-PCIE`) and a bare `H100` (or
/// `H100-SXM5`, `H100-PCIE`) are refused as ambiguous
/// ([`PlacementError::AmbiguousModel`]): both memory sizes exist under those
/// names (guide, *Supported GPUs*), and A100-40GB and A100-80GB share the
/// name `1g.10gb` for different profiles. `Display` writes the first form of
/// each row, which parses back.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GpuModel {
    /// A100-SXM4-40GB and A100-PCIE-40GB.
    A100_40GB,
    /// A100-SXM4-80GB and A100 80GB PCIe.
    A100_80GB,
    /// A30 24GB.
    A30_24GB,
    /// H100 80GB, SXM5 and PCIe.
    H100_80GB,
    /// H100 94GB (H100 NVL; the guide's "H100 94GB product (PCIe and SXM5)").
    H100_94GB,
    /// H200 141GB (H200-SXM5; H200 NVL assumed identical, see [`H200_141GB_PROFILES`]).
    H200_141GB,
}

impl GpuModel {
    /// Every model, in a fixed order.
    pub const ALL: [GpuModel; 6] = [
        GpuModel::A100_40GB,
        GpuModel::A100_80GB,
        GpuModel::A30_24GB,
        GpuModel::H100_80GB,
        GpuModel::H100_94GB,
        GpuModel::H200_141GB,
    ];

    /// The canonical name `Display` writes, e.g. `A100-40GB`.
    pub fn name(self) -> &'static str {
        match self {
            GpuModel::A100_40GB => "A100-40GB",
            GpuModel::A100_80GB => "A100-80GB",
            GpuModel::A30_24GB => "A30-24GB",
            GpuModel::H100_80GB => "H100-80GB",
            GpuModel::H100_94GB => "H100-94GB",
            GpuModel::H200_141GB => "H200-141GB",
        }
    }

    /// Number of memory slices (the units of [`Placement::start`] and
    /// [`Placement::size`]): 8, or 4 on the A30.
    pub fn memory_slices(self) -> u8 {
        self.table().memory_slices
    }

    /// Number of compute (SM) slices: 7, or 4 on the A30.
    pub fn compute_slices(self) -> u8 {
        self.table().compute_slices
    }

    /// The model's GPU-instance profiles; same as [`profiles`].
    pub fn profiles(self) -> &'static [Profile] {
        self.table().profiles
    }
}

impl fmt::Display for GpuModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Accepted spellings, normalised: lower case, no leading `nvidia`, only
/// letters and digits.
const MODEL_ALIASES: &[(&str, GpuModel)] = &[
    ("a10040gb", GpuModel::A100_40GB),
    ("a100sxm440gb", GpuModel::A100_40GB),
    ("a100pcie40gb", GpuModel::A100_40GB),
    ("a10040gbpcie", GpuModel::A100_40GB),
    ("a10040gbsxm4", GpuModel::A100_40GB),
    ("a10080gb", GpuModel::A100_80GB),
    ("a100sxm480gb", GpuModel::A100_80GB),
    ("a100pcie80gb", GpuModel::A100_80GB),
    ("a10080gbpcie", GpuModel::A100_80GB),
    ("a10080gbsxm4", GpuModel::A100_80GB),
    ("a30", GpuModel::A30_24GB),
    ("a3024gb", GpuModel::A30_24GB),
    ("a30pcie", GpuModel::A30_24GB),
    ("a30pcie24gb", GpuModel::A30_24GB),
    ("a3024gbpcie", GpuModel::A30_24GB),
    ("h10080gb", GpuModel::H100_80GB),
    ("h10080gbhbm3", GpuModel::H100_80GB),
    ("h100sxm580gb", GpuModel::H100_80GB),
    ("h100pcie80gb", GpuModel::H100_80GB),
    ("h10080gbpcie", GpuModel::H100_80GB),
    ("h10080gbsxm5", GpuModel::H100_80GB),
    ("h10094gb", GpuModel::H100_94GB),
    ("h100nvl", GpuModel::H100_94GB),
    ("h100nvl94gb", GpuModel::H100_94GB),
    ("h10094gbnvl", GpuModel::H100_94GB),
    ("h100sxm594gb", GpuModel::H100_94GB),
    ("h100pcie94gb", GpuModel::H100_94GB),
    ("h200", GpuModel::H200_141GB),
    ("h200141gb", GpuModel::H200_141GB),
    ("h200sxm5", GpuModel::H200_141GB),
    ("h200sxm5141gb", GpuModel::H200_141GB),
    ("h200nvl", GpuModel::H200_141GB),
    ("h200nvl141gb", GpuModel::H200_141GB),
    ("h200141gbnvl", GpuModel::H200_141GB),
    ("h200141gbhbm3e", GpuModel::H200_141GB),
];

/// Names that match more than one model.
const AMBIGUOUS_MODELS: &[(&str, [GpuModel; 2])] = &[
    ("a100", [GpuModel::A100_40GB, GpuModel::A100_80GB]),
    ("a100sxm4", [GpuModel::A100_40GB, GpuModel::A100_80GB]),
    ("a100pcie", [GpuModel::A100_40GB, GpuModel::A100_80GB]),
    ("h100", [GpuModel::H100_80GB, GpuModel::H100_94GB]),
    ("h100sxm5", [GpuModel::H100_80GB, GpuModel::H100_94GB]),
    ("h100pcie", [GpuModel::H100_80GB, GpuModel::H100_94GB]),
];

fn normalize_model(s: &str) -> String {
    let lower = s.trim().to_ascii_lowercase();
    let rest = lower.strip_prefix("nvidia").unwrap_or(&lower);
    rest.chars().filter(|c| c.is_ascii_alphanumeric()).collect()
}

impl FromStr for GpuModel {
    type Err = PlacementError;

    /// Parses the forms listed on [`GpuModel`].
    ///
    /// # Errors
    /// [`PlacementError::AmbiguousModel`] for a bare `A100`/`H100` family
    /// name, [`PlacementError::UnknownModel`] for anything else unknown.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let key = normalize_model(s);
        if let Some((_, m)) = MODEL_ALIASES.iter().find(|(a, _)| *a == key) {
            return Ok(*m);
        }
        if let Some((_, c)) = AMBIGUOUS_MODELS.iter().find(|(a, _)| *a == key) {
            return Err(PlacementError::AmbiguousModel {
                input: s.to_string(),
                candidates: c.to_vec(),
            });
        }
        Err(PlacementError::UnknownModel {
            input: s.to_string(),
        })
    }
}

/// One MIG GPU-instance profile of a model, as `nvidia-smi mig -lgip` and
/// `-lgipp` list it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Profile {
    /// Short name, lower case, as `nvidia-smi -cgi` accepts it: `1g.10gb`,
    /// `1g.10gb+me`.
    pub name: &'static str,
    /// The GPU-instance profile id `nvidia-smi mig -lgip` prints in its `ID`
    /// column and `-cgi` accepts (e.g. 19 for `1g.5gb` on A100-40GB). Not the
    /// `NVML_GPU_INSTANCE_PROFILE_*` enum index.
    pub profile_id: u32,
    /// Compute (SM) slices, the `Ng` of the name: 1..=7 (1..=4 on A30).
    pub compute_slices: u8,
    /// Memory slices occupied, the `:size` of `-lgipp`.
    pub memory_slices: u8,
    /// Allowed start memory-slice indices, ascending, the `{...}` of `-lgipp`.
    pub placements: &'static [u8],
    /// Most instances of this profile one GPU can hold ("Number of
    /// Instances Available").
    pub max_count: u8,
    /// Whether this is a `+me` profile, holding the GPU's media extensions
    /// (OFA, JPEG, …); at most one such instance per GPU.
    pub media_extensions: bool,
}

impl Profile {
    /// The placements the way `nvidia-smi mig -lgipp` writes them:
    /// `{0,2,4,6}:2`.
    pub fn placement_spec(&self) -> String {
        let starts: Vec<String> = self.placements.iter().map(|s| s.to_string()).collect();
        format!("{{{}}}:{}", starts.join(","), self.memory_slices)
    }
}

/// Where one requested instance goes: memory slices `start..start + size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// The profile placed.
    pub profile: &'static Profile,
    /// Index of the first memory slice occupied (one of `profile.placements`).
    pub start: u8,
    /// Number of memory slices occupied (= `profile.memory_slices`).
    pub size: u8,
}

impl fmt::Display for Placement {
    /// `3g.20gb at 4:4` (start:size, as `nvidia-smi mig -lgi` prints it).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} at {}:{}", self.profile.name, self.start, self.size)
    }
}

/// Why a model name or a set of profiles was refused. Each `Display` is one
/// line meant for an admin.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// The GPU model is not one this module knows.
    #[error("unknown GPU model `{input}`; known: {}", known_models())]
    UnknownModel {
        /// What was typed.
        input: String,
    },
    /// The GPU model names a family with more than one memory size.
    #[error("GPU model `{input}` is ambiguous: say {}", join_models(candidates))]
    AmbiguousModel {
        /// What was typed.
        input: String,
        /// The models it could mean.
        candidates: Vec<GpuModel>,
    },
    /// A requested profile is not one of the model's.
    #[error("{model} has no MIG profile `{name}`; valid: {}", valid.join(", "))]
    UnknownProfile {
        /// The model asked about.
        model: GpuModel,
        /// The name as given.
        name: String,
        /// The model's profile names.
        valid: Vec<&'static str>,
    },
    /// More instances of one profile than a GPU can hold.
    #[error("{requested} x {profile} requested, but {model} holds at most {max}")]
    TooMany {
        /// The model asked about.
        model: GpuModel,
        /// The profile's name.
        profile: &'static str,
        /// How many were requested.
        requested: usize,
        /// The profile's [`Profile::max_count`].
        max: u8,
    },
    /// More than one `+me` instance.
    #[error(
        "at most one media-extension (+me) instance fits on an {model}, requested: {}",
        requested.join(", ")
    )]
    MediaExtensions {
        /// The model asked about.
        model: GpuModel,
        /// The `+me` profiles requested, in request order.
        requested: Vec<&'static str>,
    },
    /// The memory slices requested add up to more than the GPU has.
    #[error(
        "the request needs {requested} memory slices ({breakdown}), an {model} has {available}"
    )]
    MemoryExceeded {
        /// The model asked about.
        model: GpuModel,
        /// Sum of the profiles' memory slices.
        requested: u32,
        /// The model's memory slices.
        available: u8,
        /// `name:slices` per requested instance, e.g. `7g.40gb:8 + 1g.5gb:1`.
        breakdown: String,
    },
    /// The compute slices requested add up to more than the GPU has.
    #[error(
        "the request needs {requested} compute slices ({breakdown}), an {model} has {available}"
    )]
    ComputeExceeded {
        /// The model asked about.
        model: GpuModel,
        /// Sum of the profiles' compute slices.
        requested: u32,
        /// The model's compute slices.
        available: u8,
        /// `name:slices` per requested instance.
        breakdown: String,
    },
    /// Every arrangement was tried and none fits.
    #[error(
        "no arrangement fits on an {model}: {profile} (starts {spec}) finds no free slices once {} are placed",
        describe_occupied(occupied)
    )]
    NoPlacement {
        /// The model asked about.
        model: GpuModel,
        /// The profile that could not be placed in the deepest attempt.
        profile: &'static str,
        /// Its allowed placements, `{...}:size`.
        spec: String,
        /// What the deepest attempt had already placed, by start.
        occupied: Vec<Placement>,
    },
}

fn known_models() -> String {
    join_models(&GpuModel::ALL)
}

fn join_models(models: &[GpuModel]) -> String {
    let names: Vec<&str> = models.iter().map(|m| m.name()).collect();
    names.join(" or ")
}

fn describe_occupied(occupied: &[Placement]) -> String {
    if occupied.is_empty() {
        return "no others".to_string();
    }
    let parts: Vec<String> = occupied.iter().map(|p| p.to_string()).collect();
    parts.join(", ")
}

/// The model's GPU-instance profiles, in `nvidia-smi mig -lgip` order.
pub fn profiles(model: GpuModel) -> &'static [Profile] {
    model.profiles()
}

/// Looks a profile up by name: case-insensitive, surrounding blanks ignored,
/// and a leading `MIG ` (as `-lgip` prints it), `mig-` or `nvidia.com/mig-`
/// (as Kubernetes resources name it) dropped. A bare number is taken as the
/// `-lgip` profile id. `1G.10GB`, `MIG 1g.10gb`, `nvidia.com/mig-1g.10gb` and
/// (on A100-80GB) `19` all find `1g.10gb`.
///
/// # Errors
/// [`PlacementError::UnknownProfile`], listing the model's names.
pub fn find_profile(model: GpuModel, name: &str) -> Result<&'static Profile, PlacementError> {
    model.table().find(name)
}

/// Finds where each requested profile goes on one GPU of `model`, or why
/// they cannot all go there.
///
/// `requested` holds profile names in any form [`find_profile`] accepts,
/// repeated for several instances (`["3g.20gb", "3g.20gb"]`). On success the
/// result has one [`Placement`] per request, in request order; starts and
/// sizes are memory-slice indices and counts. The result is deterministic and
/// the search complete (see the module docs for the rules). An empty request
/// fits trivially.
///
/// # Errors
/// The first rule broken, in the order of the module docs:
/// [`PlacementError::UnknownProfile`], [`PlacementError::TooMany`],
/// [`PlacementError::MediaExtensions`], [`PlacementError::MemoryExceeded`],
/// [`PlacementError::ComputeExceeded`], [`PlacementError::NoPlacement`].
pub fn place(model: GpuModel, requested: &[&str]) -> Result<Vec<Placement>, PlacementError> {
    model.table().place(requested)
}

#[cfg(test)]
mod tests {
    use super::tables::Table;
    use super::*;

    /// Starts of a successful placement, in request order.
    fn starts(model: GpuModel, req: &[&str]) -> Vec<u8> {
        match place(model, req) {
            Ok(ps) => {
                assert_valid(model, req, &ps);
                ps.iter().map(|p| p.start).collect()
            }
            Err(e) => panic!("{model} {req:?} should fit: {e}"),
        }
    }

    fn err(model: GpuModel, req: &[&str]) -> PlacementError {
        match place(model, req) {
            Ok(ps) => panic!("{model} {req:?} should not fit, got {ps:?}"),
            Err(e) => e,
        }
    }

    fn n(name: &'static str, count: usize) -> Vec<&'static str> {
        vec![name; count]
    }

    /// Every invariant a returned placement must satisfy.
    fn assert_valid(model: GpuModel, req: &[&str], ps: &[Placement]) {
        assert_eq!(ps.len(), req.len());
        let mut used = 0u64;
        let mut compute = 0u32;
        for (p, name) in ps.iter().zip(req) {
            assert_eq!(
                p.profile,
                find_profile(model, name).unwrap(),
                "request order kept"
            );
            assert!(p.profile.placements.contains(&p.start), "{p} allowed");
            assert_eq!(p.size, p.profile.memory_slices);
            assert!(p.start + p.size <= model.memory_slices(), "{p} inside");
            let mask = ((1u64 << p.size) - 1) << p.start;
            assert_eq!(used & mask, 0, "{p} overlaps");
            used |= mask;
            compute += u32::from(p.profile.compute_slices);
        }
        assert!(compute <= u32::from(model.compute_slices()));
        for prof in model.profiles() {
            let count = ps.iter().filter(|p| p.profile == prof).count();
            assert!(count <= usize::from(prof.max_count));
        }
        assert!(ps.iter().filter(|p| p.profile.media_extensions).count() <= 1);
    }

    // --- tables -----------------------------------------------------------

    #[test]
    fn tables_are_consistent() {
        for m in GpuModel::ALL {
            let profs = profiles(m);
            assert_eq!(profs, m.profiles());
            for (i, p) in profs.iter().enumerate() {
                assert!(!p.placements.is_empty(), "{m} {}", p.name);
                assert!(p.placements.windows(2).all(|w| w[0] < w[1]));
                for &s in p.placements {
                    assert!(s + p.memory_slices <= m.memory_slices(), "{m} {}", p.name);
                }
                assert!(p.compute_slices <= p.memory_slices);
                assert!(p.compute_slices <= m.compute_slices());
                assert!(p.max_count >= 1);
                assert!(usize::from(p.max_count) <= p.placements.len());
                assert_eq!(p.media_extensions, p.name.ends_with("+me"));
                assert!(p.name.starts_with(&format!("{}g.", p.compute_slices)));
                for q in &profs[i + 1..] {
                    assert_ne!(p.name, q.name, "{m}");
                    assert_ne!(p.profile_id, q.profile_id, "{m}");
                }
            }
        }
        assert_eq!(GpuModel::A30_24GB.memory_slices(), 4);
        assert_eq!(GpuModel::A30_24GB.compute_slices(), 4);
        assert_eq!(GpuModel::A100_40GB.memory_slices(), 8);
        assert_eq!(GpuModel::A100_40GB.compute_slices(), 7);
    }

    #[test]
    fn a100_40gb_matches_the_guide_lgipp() {
        // getting-started-with-mig.html, `nvidia-smi mig -lgipp`.
        let m = GpuModel::A100_40GB;
        let lines: Vec<(u32, String)> = profiles(m)
            .iter()
            .map(|p| (p.profile_id, p.placement_spec()))
            .collect();
        assert_eq!(
            lines,
            [
                (19, "{0,1,2,3,4,5,6}:1".to_string()),
                (20, "{0,1,2,3,4,5,6}:1".to_string()),
                (15, "{0,2,4,6}:2".to_string()),
                (14, "{0,2,4}:2".to_string()),
                (9, "{0,4}:4".to_string()),
                (5, "{0}:4".to_string()),
                (0, "{0}:8".to_string()),
            ]
        );
        let p = find_profile(m, "1g.5gb").unwrap();
        assert_eq!((p.compute_slices, p.memory_slices, p.max_count), (1, 1, 7));
        assert!(find_profile(m, "1g.5gb+me").unwrap().media_extensions);
        assert_eq!(find_profile(m, "7g.40gb").unwrap().compute_slices, 7);
    }

    // --- model names --------------------------------------------------------

    #[test]
    fn model_forms() {
        let cases: &[(&str, GpuModel)] = &[
            ("A100-40GB", GpuModel::A100_40GB),
            ("a100_40gb", GpuModel::A100_40GB),
            ("A100 40GB", GpuModel::A100_40GB),
            ("A100-SXM4-40GB", GpuModel::A100_40GB),
            ("NVIDIA A100-PCIE-40GB", GpuModel::A100_40GB),
            ("A100-80GB", GpuModel::A100_80GB),
            ("NVIDIA A100 80GB PCIe", GpuModel::A100_80GB),
            ("a100-sxm4-80gb", GpuModel::A100_80GB),
            ("A30", GpuModel::A30_24GB),
            ("NVIDIA A30", GpuModel::A30_24GB),
            ("a30_24gb", GpuModel::A30_24GB),
            ("H100-80GB", GpuModel::H100_80GB),
            ("NVIDIA H100 80GB HBM3", GpuModel::H100_80GB),
            ("H100-94GB", GpuModel::H100_94GB),
            ("H100-NVL", GpuModel::H100_94GB),
            ("NVIDIA H100 NVL", GpuModel::H100_94GB),
            ("h100_nvl", GpuModel::H100_94GB),
            ("H200", GpuModel::H200_141GB),
            ("H200-141GB", GpuModel::H200_141GB),
            ("nvidia h200 nvl", GpuModel::H200_141GB),
            ("  h200.141gb  ", GpuModel::H200_141GB),
        ];
        for (s, m) in cases {
            assert_eq!(s.parse::<GpuModel>().as_ref(), Ok(m), "{s}");
        }
        for m in GpuModel::ALL {
            assert_eq!(m.to_string().parse::<GpuModel>(), Ok(m));
        }
    }

    #[test]
    fn model_errors() {
        let e = "A100".parse::<GpuModel>().unwrap_err();
        assert_eq!(
            e,
            PlacementError::AmbiguousModel {
                input: "A100".into(),
                candidates: vec![GpuModel::A100_40GB, GpuModel::A100_80GB],
            }
        );
        assert_eq!(
            e.to_string(),
            "GPU model `A100` is ambiguous: say A100-40GB or A100-80GB"
        );
        assert!(matches!(
            "h100".parse::<GpuModel>(),
            Err(PlacementError::AmbiguousModel { .. })
        ));
        for bad in ["", "GH200", "B200", "A100-40", "V100", "H200x"] {
            let e = bad.parse::<GpuModel>().unwrap_err();
            assert!(matches!(e, PlacementError::UnknownModel { .. }), "{bad}");
            let msg = e.to_string();
            assert!(msg.contains("known: A100-40GB or A100-80GB"), "{msg}");
            assert!(msg.contains("H200-141GB"), "{msg}");
        }
    }

    // --- profile names ------------------------------------------------------

    #[test]
    fn profile_lookup_forms() {
        let m = GpuModel::A100_80GB;
        for s in [
            "1g.10gb",
            "1G.10GB",
            " MIG 1g.10gb ",
            "mig-1g.10gb",
            "nvidia.com/mig-1g.10gb",
            "19",
        ] {
            assert_eq!(find_profile(m, s).unwrap().name, "1g.10gb", "{s}");
        }
        assert_eq!(find_profile(m, "MIG 1g.10gb+me").unwrap().profile_id, 20);
        // The same name is a different profile on the 40GB board.
        let p = find_profile(GpuModel::A100_40GB, "1g.10gb").unwrap();
        assert_eq!((p.profile_id, p.memory_slices), (15, 2));
    }

    #[test]
    fn unknown_profile_lists_valid_names() {
        let e = find_profile(GpuModel::A30_24GB, "1g.5gb").unwrap_err();
        assert_eq!(
            e.to_string(),
            "A30-24GB has no MIG profile `1g.5gb`; valid: 1g.6gb, 1g.6gb+me, 2g.12gb, 2g.12gb+me, 4g.24gb"
        );
        let e = err(GpuModel::H100_94GB, &["3g.47gb", "1g.10gb"]);
        assert!(
            matches!(&e, PlacementError::UnknownProfile { name, valid, .. }
                if name == "1g.10gb" && valid.len() == 7 && valid[0] == "1g.12gb"),
            "{e:?}"
        );
        assert!(matches!(
            err(GpuModel::A100_40GB, &[""]),
            PlacementError::UnknownProfile { .. }
        ));
    }

    // --- A100-40GB ------------------------------------------------------------

    #[test]
    fn a100_40gb_fits() {
        let m = GpuModel::A100_40GB;
        assert_eq!(starts(m, &["3g.20gb", "3g.20gb"]), [0, 4]);
        assert_eq!(starts(m, &["4g.20gb", "2g.10gb", "1g.5gb"]), [0, 4, 6]);
        assert_eq!(starts(m, &n("1g.5gb", 7)), [0, 1, 2, 3, 4, 5, 6]);
        assert_eq!(starts(m, &["7g.40gb"]), [0]);
        // 4g + 3g: refused before R510 only (guide, Concepts → Partitioning).
        assert_eq!(starts(m, &["3g.20gb", "4g.20gb"]), [4, 0]);
        assert_eq!(starts(m, &n("1g.10gb", 4)), [0, 2, 4, 6]);
        // The guide's 3-2-1-1 geometry, in its failing -cgi order 19,19,14,9:
        // a complete search still finds a layout (3g must take 4:4).
        assert_eq!(
            starts(m, &["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"]),
            [2, 3, 0, 4]
        );
        // The guide's 2-1-1-1-1-1 geometry.
        assert_eq!(
            starts(
                m,
                &["2g.10gb", "1g.5gb", "1g.5gb", "1g.5gb", "1g.5gb", "1g.5gb"]
            ),
            [0, 2, 3, 4, 5, 6]
        );
        // One +me next to six plain 1g.
        let mut req = vec!["1g.5gb+me"];
        req.extend(n("1g.5gb", 6));
        assert_eq!(starts(m, &req), [6, 0, 1, 2, 3, 4, 5]);
        // 1g.10gb spans two slices and can take the last pair.
        let mut req = vec!["1g.10gb"];
        req.extend(n("1g.5gb", 6));
        assert_eq!(starts(m, &req), [6, 0, 1, 2, 3, 4, 5]);
        assert_eq!(starts(m, &[]), Vec::<u8>::new());
    }

    #[test]
    fn a100_40gb_refusals() {
        let m = GpuModel::A100_40GB;
        let e = err(m, &["3g.20gb", "3g.20gb", "1g.5gb"]);
        assert!(
            matches!(
                e,
                PlacementError::MemoryExceeded {
                    requested: 9,
                    available: 8,
                    ..
                }
            ),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            "the request needs 9 memory slices (3g.20gb:4 + 3g.20gb:4 + 1g.5gb:1), an A100-40GB has 8"
        );
        let e = err(m, &["7g.40gb", "1g.5gb"]);
        assert!(
            matches!(e, PlacementError::MemoryExceeded { requested: 9, .. }),
            "{e:?}"
        );
        let e = err(m, &n("1g.5gb", 8));
        assert_eq!(
            e,
            PlacementError::TooMany {
                model: m,
                profile: "1g.5gb",
                requested: 8,
                max: 7
            }
        );
        assert_eq!(
            e.to_string(),
            "8 x 1g.5gb requested, but A100-40GB holds at most 7"
        );
        assert!(matches!(
            err(m, &["1g.5gb+me", "1g.5gb+me"]),
            PlacementError::TooMany {
                profile: "1g.5gb+me",
                requested: 2,
                max: 1,
                ..
            }
        ));
        assert!(matches!(
            err(m, &["4g.20gb", "4g.20gb"]),
            PlacementError::TooMany {
                profile: "4g.20gb",
                ..
            }
        ));
        assert!(matches!(
            err(m, &n("1g.10gb", 5)),
            PlacementError::TooMany {
                profile: "1g.10gb",
                max: 4,
                ..
            }
        ));
        // 8 memory slices, but 8 compute slices of 7.
        let mut req = vec!["2g.10gb"];
        req.extend(n("1g.5gb", 6));
        let e = err(m, &req);
        assert!(
            matches!(
                e,
                PlacementError::ComputeExceeded {
                    requested: 8,
                    available: 7,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e
            .to_string()
            .starts_with("the request needs 8 compute slices (2g.10gb:2 + 1g.5gb:1"));
        assert!(matches!(
            err(m, &["4g.20gb", "2g.10gb", "2g.10gb"]),
            PlacementError::ComputeExceeded { .. }
        ));
    }

    // --- A100-80GB ------------------------------------------------------------

    #[test]
    fn a100_80gb() {
        let m = GpuModel::A100_80GB;
        assert_eq!(starts(m, &["1g.20gb", "1g.20gb", "3g.40gb"]), [4, 6, 0]);
        assert_eq!(
            starts(m, &["2g.20gb", "2g.20gb", "2g.20gb", "1g.10gb"]),
            [0, 2, 4, 6]
        );
        assert_eq!(starts(m, &n("1g.10gb", 7)), [0, 1, 2, 3, 4, 5, 6]);
        assert_eq!(starts(m, &["4g.40gb", "3g.40gb"]), [0, 4]);
        assert_eq!(starts(m, &["7g.80gb"]), [0]);
        assert!(matches!(
            err(m, &["4g.40gb", "2g.20gb", "2g.20gb"]),
            PlacementError::ComputeExceeded { requested: 8, .. }
        ));
        assert!(matches!(
            err(m, &n("1g.20gb", 5)),
            PlacementError::TooMany {
                profile: "1g.20gb",
                max: 4,
                ..
            }
        ));
        assert!(matches!(
            err(m, &["7g.80gb", "1g.10gb"]),
            PlacementError::MemoryExceeded { .. }
        ));
        assert!(matches!(
            err(m, &["1g.5gb"]),
            PlacementError::UnknownProfile { .. }
        ));
    }

    // --- A30 ------------------------------------------------------------------

    #[test]
    fn a30() {
        let m = GpuModel::A30_24GB;
        assert_eq!(starts(m, &["2g.12gb", "2g.12gb"]), [0, 2]);
        assert_eq!(starts(m, &["1g.6gb", "2g.12gb", "1g.6gb"]), [2, 0, 3]);
        assert_eq!(starts(m, &n("1g.6gb", 4)), [0, 1, 2, 3]);
        assert_eq!(starts(m, &["4g.24gb"]), [0]);
        assert_eq!(starts(m, &["1g.6gb+me", "2g.12gb", "1g.6gb"]), [3, 0, 2]);
        assert_eq!(starts(m, &["2g.12gb+me", "2g.12gb"]), [2, 0]);
        let e = err(m, &["1g.6gb+me", "2g.12gb+me"]);
        assert_eq!(
            e,
            PlacementError::MediaExtensions {
                model: m,
                requested: vec!["1g.6gb+me", "2g.12gb+me"]
            }
        );
        assert_eq!(
            e.to_string(),
            "at most one media-extension (+me) instance fits on an A30-24GB, requested: 1g.6gb+me, 2g.12gb+me"
        );
        assert!(matches!(
            err(m, &["4g.24gb", "1g.6gb"]),
            PlacementError::MemoryExceeded {
                requested: 5,
                available: 4,
                ..
            }
        ));
        assert!(matches!(
            err(m, &n("2g.12gb", 3)),
            PlacementError::TooMany {
                profile: "2g.12gb",
                max: 2,
                ..
            }
        ));
        assert!(matches!(
            err(m, &n("1g.6gb", 5)),
            PlacementError::TooMany {
                profile: "1g.6gb",
                max: 4,
                ..
            }
        ));
    }

    // --- H100-80GB ------------------------------------------------------------

    #[test]
    fn h100_80gb() {
        let m = GpuModel::H100_80GB;
        assert_eq!(
            starts(m, &["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]),
            [4, 0, 2, 3]
        );
        assert_eq!(starts(m, &["3g.40gb", "3g.40gb"]), [0, 4]);
        assert_eq!(starts(m, &["1g.10gb+me", "1g.20gb", "4g.40gb"]), [6, 4, 0]);
        assert!(matches!(
            err(m, &["1g.10gb+me", "1g.10gb+me"]),
            PlacementError::TooMany {
                profile: "1g.10gb+me",
                ..
            }
        ));
        assert!(matches!(
            err(m, &["3g.40gb", "3g.40gb", "1g.10gb"]),
            PlacementError::MemoryExceeded { .. }
        ));
        assert!(matches!(
            err(m, &n("1g.10gb", 8)),
            PlacementError::TooMany {
                requested: 8,
                max: 7,
                ..
            }
        ));
    }

    // --- H100-94GB ------------------------------------------------------------

    #[test]
    fn h100_94gb() {
        let m = GpuModel::H100_94GB;
        assert_eq!(starts(m, &["4g.47gb", "3g.47gb"]), [0, 4]);
        assert_eq!(starts(m, &n("1g.24gb", 4)), [0, 2, 4, 6]);
        assert_eq!(
            starts(m, &["1g.12gb+me", "2g.24gb", "2g.24gb", "2g.24gb"]),
            [6, 0, 2, 4]
        );
        assert_eq!(starts(m, &["7g.94gb"]), [0]);
        assert!(matches!(
            err(m, &["7g.94gb", "1g.12gb"]),
            PlacementError::MemoryExceeded { .. }
        ));
        assert!(matches!(
            err(m, &["4g.47gb", "2g.24gb", "1g.12gb", "1g.12gb"]),
            PlacementError::ComputeExceeded { requested: 8, .. }
        ));
    }

    // --- H200-141GB -----------------------------------------------------------

    #[test]
    fn h200_141gb() {
        let m = GpuModel::H200_141GB;
        assert_eq!(starts(m, &["3g.71gb", "3g.71gb"]), [0, 4]);
        assert_eq!(starts(m, &n("1g.18gb", 7)), [0, 1, 2, 3, 4, 5, 6]);
        assert_eq!(starts(m, &["1g.35gb", "2g.35gb", "4g.71gb"]), [6, 4, 0]);
        assert_eq!(starts(m, &["7g.141gb"]), [0]);
        assert!(matches!(
            err(m, &n("1g.18gb", 8)),
            PlacementError::TooMany { .. }
        ));
        assert!(matches!(
            err(m, &["4g.71gb", "2g.35gb", "1g.18gb", "1g.18gb"]),
            PlacementError::ComputeExceeded { requested: 8, .. }
        ));
        assert!(matches!(
            err(m, &["1g.18gb+me", "1g.18gb+me"]),
            PlacementError::TooMany { .. }
        ));
    }

    // --- the search itself, on a hand-made table ------------------------------

    static TIGHT_PROFILES: [Profile; 2] = [
        Profile {
            name: "1g.x",
            profile_id: 1,
            compute_slices: 1,
            memory_slices: 1,
            placements: &[0, 2],
            max_count: 4,
            media_extensions: false,
        },
        Profile {
            name: "2g.x",
            profile_id: 2,
            compute_slices: 2,
            memory_slices: 3,
            placements: &[0],
            max_count: 1,
            media_extensions: false,
        },
    ];
    static TIGHT: Table = Table {
        model: GpuModel::A30_24GB,
        memory_slices: 4,
        compute_slices: 4,
        profiles: &TIGHT_PROFILES,
    };

    #[test]
    fn no_placement_names_the_profile_and_what_was_taken() {
        assert_eq!(
            TIGHT
                .place(&["1g.x", "1g.x"])
                .unwrap()
                .iter()
                .map(|p| p.start)
                .collect::<Vec<_>>(),
            [0, 2]
        );
        let e = TIGHT.place(&["1g.x", "1g.x", "1g.x"]).unwrap_err();
        let PlacementError::NoPlacement {
            profile,
            spec,
            occupied,
            ..
        } = &e
        else {
            panic!("{e:?}")
        };
        assert_eq!(*profile, "1g.x");
        assert_eq!(spec, "{0,2}:1");
        assert_eq!(occupied.iter().map(|p| p.start).collect::<Vec<_>>(), [0, 2]);
        assert_eq!(
            e.to_string(),
            "no arrangement fits on an A30-24GB: 1g.x (starts {0,2}:1) finds no free slices once 1g.x at 0:1, 1g.x at 2:1 are placed"
        );
        // 2g.x at 0:3 blocks both of 1g.x's starts.
        let e = TIGHT.place(&["1g.x", "2g.x"]).unwrap_err();
        assert!(
            matches!(&e, PlacementError::NoPlacement { profile: "1g.x", occupied, .. }
                if occupied.len() == 1 && occupied[0].start == 0 && occupied[0].size == 3),
            "{e:?}"
        );
    }

    // --- exhaustive and property checks -----------------------------------------

    /// Independent feasibility check: every assignment, in request order, no
    /// symmetry breaking, no pre-checks.
    fn brute_fits(model: GpuModel, profs: &[&'static Profile]) -> bool {
        fn go(total: u8, profs: &[&'static Profile], used: u64) -> bool {
            let Some((p, rest)) = profs.split_first() else {
                return true;
            };
            p.placements.iter().any(|&s| {
                if s + p.memory_slices > total {
                    return false;
                }
                let mask = ((1u64 << p.memory_slices) - 1) << s;
                used & mask == 0 && go(total, rest, used | mask)
            })
        }
        go(model.memory_slices(), profs, 0)
    }

    fn rules_allow(model: GpuModel, profs: &[&'static Profile]) -> bool {
        let counts_ok = model
            .profiles()
            .iter()
            .all(|q| profs.iter().filter(|p| **p == q).count() <= usize::from(q.max_count));
        let me_ok = profs.iter().filter(|p| p.media_extensions).count() <= 1;
        let mem: u32 = profs.iter().map(|p| u32::from(p.memory_slices)).sum();
        let cmp: u32 = profs.iter().map(|p| u32::from(p.compute_slices)).sum();
        counts_ok
            && me_ok
            && mem <= u32::from(model.memory_slices())
            && cmp <= u32::from(model.compute_slices())
    }

    /// Every multiset of profiles of up to `memory_slices` instances: `place`
    /// succeeds exactly when the rules allow it and a brute force finds a
    /// layout, and with these tables it never answers `NoPlacement`.
    #[test]
    fn exhaustive_small_requests_agree_with_brute_force() {
        fn multisets(
            k: usize,
            from: usize,
            len: usize,
            cur: &mut Vec<usize>,
            out: &mut Vec<Vec<usize>>,
        ) {
            out.push(cur.clone());
            if cur.len() == len {
                return;
            }
            for i in from..k {
                cur.push(i);
                multisets(k, i, len, cur, out);
                cur.pop();
            }
        }
        for m in GpuModel::ALL {
            let profs = m.profiles();
            let mut all = Vec::new();
            multisets(
                profs.len(),
                0,
                usize::from(m.memory_slices()),
                &mut Vec::new(),
                &mut all,
            );
            let mut fits = 0;
            for combo in &all {
                let chosen: Vec<&'static Profile> = combo.iter().map(|&i| &profs[i]).collect();
                let names: Vec<&str> = chosen.iter().map(|p| p.name).collect();
                let expected = rules_allow(m, &chosen) && brute_fits(m, &chosen);
                match place(m, &names) {
                    Ok(ps) => {
                        assert!(expected, "{m} {names:?} placed but should not be");
                        assert_valid(m, &names, &ps);
                        fits += 1;
                    }
                    Err(e) => {
                        assert!(!expected, "{m} {names:?} refused: {e}");
                        assert!(
                            !matches!(e, PlacementError::NoPlacement { .. }),
                            "{m} {names:?}: {e}"
                        );
                    }
                }
            }
            assert!(fits > 10, "{m}: {fits}");
        }
    }

    fn arb_request() -> impl proptest::strategy::Strategy<Value = (GpuModel, Vec<String>)> {
        use proptest::prelude::*;
        let name = prop_oneof![
            8 => (0usize..7).prop_map(Some),
            1 => Just(None),
        ];
        (
            0usize..GpuModel::ALL.len(),
            proptest::collection::vec((name, "[ -~]{0,12}"), 0..12),
        )
            .prop_map(|(mi, picks)| {
                let m = GpuModel::ALL[mi];
                let names = picks
                    .into_iter()
                    .map(|(pick, junk)| match pick {
                        Some(i) => m.profiles()[i % m.profiles().len()].name.to_string(),
                        None => junk,
                    })
                    .collect();
                (m, names)
            })
    }

    proptest::proptest! {
        #[test]
        fn place_never_panics_and_placements_are_sound((m, names) in arb_request()) {
            let req: Vec<&str> = names.iter().map(String::as_str).collect();
            let got = place(m, &req);
            proptest::prop_assert_eq!(&got, &place(m, &req), "deterministic");
            match got {
                Ok(ps) => assert_valid(m, &req, &ps),
                Err(e) => {
                    proptest::prop_assert!(!e.to_string().is_empty());
                    proptest::prop_assert!(!e.to_string().contains('\n'));
                    if let Ok(profs) = req.iter().map(|n| find_profile(m, n)).collect::<Result<Vec<_>, _>>() {
                        // Only refused when a rule or the geometry says so.
                        proptest::prop_assert!(!(rules_allow(m, &profs) && brute_fits(m, &profs)), "{}", e);
                    }
                }
            }
        }

        #[test]
        fn arbitrary_strings_never_panic(model in "\\PC{0,24}", list in proptest::collection::vec("\\PC{0,16}", 0..10)) {
            let _ = model.parse::<GpuModel>();
            let req: Vec<&str> = list.iter().map(String::as_str).collect();
            for m in GpuModel::ALL {
                let _ = place(m, &req);
            }
        }
    }
}
