//! Device numbers, access bits and the device grants a job receives.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The largest major number Linux can represent (`MINORBITS = 20`, 12 bits of
/// major in `dev_t` for the kernel's internal `MAJOR()`; `include/linux/kdev_t.h`).
pub const MAX_MAJOR: u32 = (1 << 12) - 1;

/// The GPUs among `devs`: the minors on major `gpu_major` (`/dev/nvidia<N>`),
/// leaving out `nvidia-modeset` (254) and `nvidiactl` (255). A job's GPU
/// set is this of its GRES devices ([`crate::record::JobRecord::gpu_minors`]).
pub fn gpu_minors<'a>(
    devs: impl IntoIterator<Item = &'a DevNum>,
    gpu_major: u32,
) -> std::collections::BTreeSet<u32> {
    devs.into_iter()
        .filter(|d| d.major == gpu_major && d.minor < 254)
        .map(|d| d.minor)
        .collect()
}

/// A character device number, `major:minor`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DevNum {
    /// Major number (driver), e.g. 195 for `/dev/nvidia*`.
    pub major: u32,
    /// Minor number (instance), e.g. 0 for `/dev/nvidia0`, 255 for `/dev/nvidiactl`.
    pub minor: u32,
}

/// The minor of a grant that covers every minor of its major
/// ([`DevNum::any_minor`]): `u32::MAX`, which no device has (a minor is
/// 20 bits, `MINORBITS`, `include/linux/kdev_t.h`). The fence grants it
/// only for `mknod` of IMEX channels to job cgroups (Slurm's
/// `switch/nvidia_imex` makes each step's channel node there).
pub const ANY_MINOR: u32 = u32::MAX;

impl DevNum {
    /// Builds `major:minor`.
    pub const fn new(major: u32, minor: u32) -> Self {
        DevNum { major, minor }
    }

    /// `major:*`: every minor of `major`, in a grant ([`ANY_MINOR`]).
    pub const fn any_minor(major: u32) -> Self {
        DevNum {
            major,
            minor: ANY_MINOR,
        }
    }

    /// Whether this is a `major:*` grant key.
    pub const fn is_any_minor(&self) -> bool {
        self.minor == ANY_MINOR
    }

    /// Splits a `st_rdev` as returned by `stat(2)` (glibc's `major()`/`minor()`).
    pub fn from_rdev(rdev: u64) -> Self {
        DevNum {
            major: libc::major(rdev),
            minor: libc::minor(rdev),
        }
    }
}

impl fmt::Display for DevNum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_any_minor() {
            write!(f, "{}:*", self.major)
        } else {
            write!(f, "{}:{}", self.major, self.minor)
        }
    }
}

bitflags::bitflags! {
    /// Access bits of a device check, as the kernel passes them in the high
    /// 16 bits of `bpf_cgroup_dev_ctx.access_type` (`BPF_DEVCG_ACC_*` in
    /// `include/uapi/linux/bpf.h`). Written as a string of `m`, `r`, `w`
    /// (the letters of cgroup v1's `devices.allow`).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct Access: u32 {
        /// `mknod(2)` of the device.
        const MKNOD = 1;
        /// `open(2)` for reading.
        const READ = 2;
        /// `open(2)` for writing.
        const WRITE = 4;
    }
}

impl Access {
    /// Read and write: what a job needs to use a GPU. Never `mknod`.
    pub const RW: Access = Access::READ.union(Access::WRITE);
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.contains(Access::READ) {
            f.write_str("r")?;
        }
        if self.contains(Access::WRITE) {
            f.write_str("w")?;
        }
        if self.contains(Access::MKNOD) {
            f.write_str("m")?;
        }
        Ok(())
    }
}

impl FromStr for Access {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut a = Access::empty();
        for c in s.chars() {
            a |= match c {
                'r' => Access::READ,
                'w' => Access::WRITE,
                'm' => Access::MKNOD,
                other => {
                    return Err(format!(
                        "unknown access letter {other:?} in {s:?} (use r, w, m)"
                    ))
                }
            };
        }
        Ok(a)
    }
}

impl Serialize for Access {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Access {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Why a device is in a job's grant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceRole {
    /// A file of a GRES record the job was allocated (a GPU, or a MIG cap).
    Gres,
    /// A control device every CUDA program opens (`nvidiactl`, `nvidia-uvm`,
    /// `nvidia-uvm-tools`), granted by number whether or not its node exists.
    Control,
}

/// One device a job may open: what the prolog records and the plugin applies.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceGrant {
    /// The device file as Slurm names it, or the conventional path for
    /// control devices. Informational: the fence matches numbers, not paths.
    pub path: PathBuf,
    /// The device number the fence checks.
    pub dev: DevNum,
    /// What the job may do with it.
    pub access: Access,
    /// Why it is granted.
    pub role: DeviceRole,
    /// The GRES index it came from (position in `slurmd -G`), for GRES files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gres_index: Option<u32>,
}

impl fmt::Display for DeviceGrant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} {}", self.dev, self.access, self.path.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_round_trips_through_letters() {
        for (s, a) in [
            ("rw", Access::RW),
            ("r", Access::READ),
            ("rwm", Access::all()),
            ("", Access::empty()),
        ] {
            assert_eq!(s.parse::<Access>().unwrap(), a);
            assert_eq!(a.to_string(), s);
        }
        assert!("rx".parse::<Access>().is_err());
    }

    #[test]
    fn gpus_are_the_gpu_major_below_the_control_minors() {
        let devs = [
            DevNum::new(195, 0),
            DevNum::new(195, 7),
            DevNum::new(195, 254),
            DevNum::new(195, 255),
            DevNum::new(508, 0),
        ];
        assert_eq!(gpu_minors(&devs, 195), [0, 7].into());
        assert!(gpu_minors(&devs, 196).is_empty());
    }

    #[test]
    fn rdev_splits_like_glibc() {
        // makedev(195, 255) as glibc encodes it
        let rdev = libc::makedev(195, 255);
        assert_eq!(DevNum::from_rdev(rdev), DevNum::new(195, 255));
        let big = libc::makedev(509, 1 << 19);
        assert_eq!(DevNum::from_rdev(big), DevNum::new(509, 1 << 19));
    }
}
