//! The profile tables: one per [`GpuModel`], each with its NVIDIA sources
//! (see *Sources per table* in the module docs of [`super`]).

use super::{GpuModel, Profile};

/// A model's profile table with the GPU's slice counts.
pub(super) struct Table {
    pub(super) model: GpuModel,
    pub(super) memory_slices: u8,
    pub(super) compute_slices: u8,
    pub(super) profiles: &'static [Profile],
}

impl GpuModel {
    /// The model's profile table with its slice counts.
    pub(super) fn table(self) -> &'static Table {
        match self {
            GpuModel::A100_40GB => &A100_40GB,
            GpuModel::A100_80GB => &A100_80GB,
            GpuModel::A30_24GB => &A30_24GB,
            GpuModel::H100_80GB => &H100_80GB,
            GpuModel::H100_94GB => &H100_94GB,
            GpuModel::H200_141GB => &H200_141GB,
        }
    }
}

const STARTS_0_TO_6: &[u8] = &[0, 1, 2, 3, 4, 5, 6];
const STARTS_EVEN_4: &[u8] = &[0, 2, 4, 6];
const STARTS_EVEN_3: &[u8] = &[0, 2, 4];
const STARTS_HALVES: &[u8] = &[0, 4];
const STARTS_0: &[u8] = &[0];

/// The seven-profile layout shared by A100-40GB, A100-80GB, H100-80GB,
/// H100-94GB and H200-141GB: only the names (memory in GB) differ. Ids 19,
/// 20, 15, 14, 9, 5, 0 and placements `{0..6}:1`, `{0..6}:1`, `{0,2,4,6}:2`,
/// `{0,2,4}:2`, `{0,4}:4`, `{0}:4`, `{0}:8`.
const fn eight_slice_profiles(names: [&'static str; 7]) -> [Profile; 7] {
    [
        Profile {
            name: names[0],
            profile_id: 19,
            compute_slices: 1,
            memory_slices: 1,
            placements: STARTS_0_TO_6,
            max_count: 7,
            media_extensions: false,
        },
        Profile {
            name: names[1],
            profile_id: 20,
            compute_slices: 1,
            memory_slices: 1,
            placements: STARTS_0_TO_6,
            max_count: 1,
            media_extensions: true,
        },
        Profile {
            name: names[2],
            profile_id: 15,
            compute_slices: 1,
            memory_slices: 2,
            placements: STARTS_EVEN_4,
            max_count: 4,
            media_extensions: false,
        },
        Profile {
            name: names[3],
            profile_id: 14,
            compute_slices: 2,
            memory_slices: 2,
            placements: STARTS_EVEN_3,
            max_count: 3,
            media_extensions: false,
        },
        Profile {
            name: names[4],
            profile_id: 9,
            compute_slices: 3,
            memory_slices: 4,
            placements: STARTS_HALVES,
            max_count: 2,
            media_extensions: false,
        },
        Profile {
            name: names[5],
            profile_id: 5,
            compute_slices: 4,
            memory_slices: 4,
            placements: STARTS_0,
            max_count: 1,
            media_extensions: false,
        },
        Profile {
            name: names[6],
            profile_id: 0,
            compute_slices: 7,
            memory_slices: 8,
            placements: STARTS_0,
            max_count: 1,
            media_extensions: false,
        },
    ]
}

/// A100-40GB (A100-SXM4-40GB, A100-PCIE-40GB): 8 memory, 7 compute slices.
///
/// | profile | id | compute | memory | `-lgipp` | max |
/// |---|---|---|---|---|---|
/// | `1g.5gb` | 19 | 1 | 1 | `{0,1,2,3,4,5,6}:1` | 7 |
/// | `1g.5gb+me` | 20 | 1 | 1 | `{0,1,2,3,4,5,6}:1` | 1 |
/// | `1g.10gb` | 15 | 1 | 2 | `{0,2,4,6}:2` | 4 |
/// | `2g.10gb` | 14 | 2 | 2 | `{0,2,4}:2` | 3 |
/// | `3g.20gb` | 9 | 3 | 4 | `{0,4}:4` | 2 |
/// | `4g.20gb` | 5 | 4 | 4 | `{0}:4` | 1 |
/// | `7g.40gb` | 0 | 7 | 8 | `{0}:8` | 1 |
///
/// Source: MIG User Guide, *Supported MIG Profiles → A100 MIG Profiles*
/// (Table "GPU Instance Profiles on A100", A100-SXM4-40GB), and *Getting
/// Started with MIG → List GPU Instance Profiles*, whose `nvidia-smi mig
/// -lgip` / `-lgipp` output on an A100-SXM4-40GB gives every id and
/// placement above; the `-lgi` examples there (3-2-1-1 and 2-1-1-1-1-1
/// geometries) agree. The guide's table gives `1g.10gb` a memory fraction of
/// "1/8", which contradicts its own `-lgipp` (`{0,2,4,6}:2`) and `-lgip`
/// (9.62 GiB, twice `1g.5gb`'s 4.75); the `-lgipp` value is used.
pub static A100_40GB_PROFILES: [Profile; 7] = eight_slice_profiles([
    "1g.5gb",
    "1g.5gb+me",
    "1g.10gb",
    "2g.10gb",
    "3g.20gb",
    "4g.20gb",
    "7g.40gb",
]);

/// A100-80GB (A100-SXM4-80GB, A100 80GB PCIe): 8 memory, 7 compute slices.
///
/// | profile | id | compute | memory | `-lgipp` | max |
/// |---|---|---|---|---|---|
/// | `1g.10gb` | 19 | 1 | 1 | `{0,1,2,3,4,5,6}:1` | 7 |
/// | `1g.10gb+me` | 20 | 1 | 1 | `{0,1,2,3,4,5,6}:1` | 1 |
/// | `1g.20gb` | 15 | 1 | 2 | `{0,2,4,6}:2` | 4 |
/// | `2g.20gb` | 14 | 2 | 2 | `{0,2,4}:2` | 3 |
/// | `3g.40gb` | 9 | 3 | 4 | `{0,4}:4` | 2 |
/// | `4g.40gb` | 5 | 4 | 4 | `{0}:4` | 1 |
/// | `7g.80gb` | 0 | 7 | 8 | `{0}:8` | 1 |
///
/// Source: MIG User Guide, *Supported MIG Profiles → A100 MIG Profiles*: "For
/// A100-SXM4-80GB, the profile names will change according to the memory
/// proportion – for example, 1g.10gb, 1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb,
/// 4g.40gb, 7g.80gb respectively", i.e. the A100-40GB rows renamed. Ids 19,
/// 20, 14, 9, 5, 0: `nvidia-smi mig -lgip` on A100 80GB (driver 515) quoted
/// in public notes. **Not confirmed from a primary source:** `1g.20gb`'s id
/// 15 and all A100-80GB placements; they are taken to equal A100-40GB's, as
/// the guide's "respectively" implies (no `-lgipp` capture of an A100-80GB
/// was found).
pub static A100_80GB_PROFILES: [Profile; 7] = eight_slice_profiles([
    "1g.10gb",
    "1g.10gb+me",
    "1g.20gb",
    "2g.20gb",
    "3g.40gb",
    "4g.40gb",
    "7g.80gb",
]);

/// H100-80GB (SXM5 and PCIe): 8 memory, 7 compute slices. Same ids and
/// placements as [`A100_80GB_PROFILES`], same names.
///
/// | profile | id | compute | memory | `-lgipp` | max |
/// |---|---|---|---|---|---|
/// | `1g.10gb` | 19 | 1 | 1 | `{0,1,2,3,4,5,6}:1` | 7 |
/// | `1g.10gb+me` | 20 | 1 | 1 | `{0,1,2,3,4,5,6}:1` | 1 |
/// | `1g.20gb` | 15 | 1 | 2 | `{0,2,4,6}:2` | 4 |
/// | `2g.20gb` | 14 | 2 | 2 | `{0,2,4}:2` | 3 |
/// | `3g.40gb` | 9 | 3 | 4 | `{0,4}:4` | 2 |
/// | `4g.40gb` | 5 | 4 | 4 | `{0}:4` | 1 |
/// | `7g.80gb` | 0 | 7 | 8 | `{0}:8` | 1 |
///
/// Source: MIG User Guide, *Supported MIG Profiles → H100 MIG Profiles*
/// (table for "the H100 80GB product (PCIe and SXM5)": names, fractions 1/8,
/// 1/8, 1/4, 2/8, 4/8, 4/8, Full, instance counts). Ids and placements: `nvidia-smi mig -lgip`
/// of an H100 80GB (SM 16/16/26/32/60/64/132) at
/// <https://jbarrow.ai/field_notes/nvidia-mig/>, and `-lgipp` on H100
/// quoted in public notes and in a Dataproc init script ("This is the result
/// when using H100 instances on 20241220"); the guide itself prints no H100
/// `-lgipp`.
pub static H100_80GB_PROFILES: [Profile; 7] = eight_slice_profiles([
    "1g.10gb",
    "1g.10gb+me",
    "1g.20gb",
    "2g.20gb",
    "3g.40gb",
    "4g.40gb",
    "7g.80gb",
]);

/// H100-94GB (H100 NVL; the guide's "H100 94GB product (PCIe and SXM5)"): 8
/// memory, 7 compute slices.
///
/// | profile | id | compute | memory | `-lgipp` | max |
/// |---|---|---|---|---|---|
/// | `1g.12gb` | 19 | 1 | 1 | `{0,1,2,3,4,5,6}:1` | 7 |
/// | `1g.12gb+me` | 20 | 1 | 1 | `{0,1,2,3,4,5,6}:1` | 1 |
/// | `1g.24gb` | 15 | 1 | 2 | `{0,2,4,6}:2` | 4 |
/// | `2g.24gb` | 14 | 2 | 2 | `{0,2,4}:2` | 3 |
/// | `3g.47gb` | 9 | 3 | 4 | `{0,4}:4` | 2 |
/// | `4g.47gb` | 5 | 4 | 4 | `{0}:4` | 1 |
/// | `7g.94gb` | 0 | 7 | 8 | `{0}:8` | 1 |
///
/// Source: MIG User Guide, *Supported MIG Profiles → H100 MIG Profiles*
/// (table for "the H100 94GB product (PCIe and SXM5)"). Ids and placements:
/// `nvidia-smi mig -lgip` and `-lgipp` of an "NVIDIA H100 NVL" (driver
/// 560.35.03) in an Azure MIG walkthrough on GitHub; the same `-lgipp` is
/// quoted for "the H100 NVL GPU" in a vendor blog. The `-lgip` there is also
/// quoted in NVIDIA/mig-parted pull request #101. The H100 SXM5 94GB was not
/// seen; it is assumed to match the NVL.
pub static H100_94GB_PROFILES: [Profile; 7] = eight_slice_profiles([
    "1g.12gb",
    "1g.12gb+me",
    "1g.24gb",
    "2g.24gb",
    "3g.47gb",
    "4g.47gb",
    "7g.94gb",
]);

/// H200-141GB: 8 memory, 7 compute slices.
///
/// | profile | id | compute | memory | `-lgipp` | max |
/// |---|---|---|---|---|---|
/// | `1g.18gb` | 19 | 1 | 1 | `{0,1,2,3,4,5,6}:1` | 7 |
/// | `1g.18gb+me` | 20 | 1 | 1 | `{0,1,2,3,4,5,6}:1` | 1 |
/// | `1g.35gb` | 15 | 1 | 2 | `{0,2,4,6}:2` | 4 |
/// | `2g.35gb` | 14 | 2 | 2 | `{0,2,4}:2` | 3 |
/// | `3g.71gb` | 9 | 3 | 4 | `{0,4}:4` | 2 |
/// | `4g.71gb` | 5 | 4 | 4 | `{0}:4` | 1 |
/// | `7g.141gb` | 0 | 7 | 8 | `{0}:8` | 1 |
///
/// Source: MIG User Guide, *Supported MIG Profiles → H200 MIG Profiles*
/// ("the H200 141GB product": names, fractions, instance counts). Ids:
/// `nvidia-smi mig -lgip` of eight H200s in NVIDIA/mig-parted issue #120,
/// <https://github.com/NVIDIA/mig-parted/issues/120>. **Not confirmed from a
/// primary source:** the placements (no H200 `-lgipp` capture was found);
/// they are taken to equal H100's, which has the same memory fractions,
/// ids and instance counts. The H200 NVL is assumed to use this table.
pub static H200_141GB_PROFILES: [Profile; 7] = eight_slice_profiles([
    "1g.18gb",
    "1g.18gb+me",
    "1g.35gb",
    "2g.35gb",
    "3g.71gb",
    "4g.71gb",
    "7g.141gb",
]);

/// A30-24GB: 4 memory, 4 compute slices.
///
/// | profile | id | compute | memory | `-lgipp` | max |
/// |---|---|---|---|---|---|
/// | `1g.6gb` | 14 | 1 | 1 | `{0,1,2,3}:1` | 4 |
/// | `1g.6gb+me` | 21 | 1 | 1 | `{0,1,2,3}:1` | 1 |
/// | `2g.12gb` | 5 | 2 | 2 | `{0,2}:2` | 2 |
/// | `2g.12gb+me` | 6 | 2 | 2 | `{0,2}:2` | 1 |
/// | `4g.24gb` | 0 | 4 | 4 | `{0}:4` | 1 |
///
/// Source: MIG User Guide, *Supported MIG Profiles → A30 MIG Profiles*
/// (names, fractions 1/4, 1/4, 2/4, 2/4, Full, instance counts, "A single
/// 1g profile…"/"A single 2g profile can include media extensions"). Ids
/// and placements: `nvidia-smi mig -lgip` and `-lgipp` of an NVIDIA A30
/// (driver 535.183.01) quoted in public notes on GitHub, ids also in
/// `Summer-Lo/Docker_configuration` `000-MIG/README.md`; the `-lgi` there
/// shows `1g.6gb` at 0:1 and 1:1 and `2g.12gb` at 2:2.
pub static A30_24GB_PROFILES: [Profile; 5] = [
    Profile {
        name: "1g.6gb",
        profile_id: 14,
        compute_slices: 1,
        memory_slices: 1,
        placements: &[0, 1, 2, 3],
        max_count: 4,
        media_extensions: false,
    },
    Profile {
        name: "1g.6gb+me",
        profile_id: 21,
        compute_slices: 1,
        memory_slices: 1,
        placements: &[0, 1, 2, 3],
        max_count: 1,
        media_extensions: true,
    },
    Profile {
        name: "2g.12gb",
        profile_id: 5,
        compute_slices: 2,
        memory_slices: 2,
        placements: &[0, 2],
        max_count: 2,
        media_extensions: false,
    },
    Profile {
        name: "2g.12gb+me",
        profile_id: 6,
        compute_slices: 2,
        memory_slices: 2,
        placements: &[0, 2],
        max_count: 1,
        media_extensions: true,
    },
    Profile {
        name: "4g.24gb",
        profile_id: 0,
        compute_slices: 4,
        memory_slices: 4,
        placements: STARTS_0,
        max_count: 1,
        media_extensions: false,
    },
];

static A100_40GB: Table = Table {
    model: GpuModel::A100_40GB,
    memory_slices: 8,
    compute_slices: 7,
    profiles: &A100_40GB_PROFILES,
};
static A100_80GB: Table = Table {
    model: GpuModel::A100_80GB,
    memory_slices: 8,
    compute_slices: 7,
    profiles: &A100_80GB_PROFILES,
};
static A30_24GB: Table = Table {
    model: GpuModel::A30_24GB,
    memory_slices: 4,
    compute_slices: 4,
    profiles: &A30_24GB_PROFILES,
};
static H100_80GB: Table = Table {
    model: GpuModel::H100_80GB,
    memory_slices: 8,
    compute_slices: 7,
    profiles: &H100_80GB_PROFILES,
};
static H100_94GB: Table = Table {
    model: GpuModel::H100_94GB,
    memory_slices: 8,
    compute_slices: 7,
    profiles: &H100_94GB_PROFILES,
};
static H200_141GB: Table = Table {
    model: GpuModel::H200_141GB,
    memory_slices: 8,
    compute_slices: 7,
    profiles: &H200_141GB_PROFILES,
};
