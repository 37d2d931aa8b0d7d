//! Who holds a device open: a walk of `/proc/<pid>/fd`, comparing the
//! `st_rdev` of what each descriptor points at with the devices sought.
//! Paths are never compared: the same device can have many nodes (a copy
//! made with `mknod` elsewhere, a container's `/dev`), and a descriptor
//! passed over a unix socket keeps working wherever it lands.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::PathBuf;

use gpufence_model::device::DevNum;
use serde::Serialize;

/// One descriptor that points at a sought device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct HeldFd {
    /// The descriptor number.
    pub fd: i32,
    /// Where it points (`readlink /proc/<pid>/fd/<fd>`).
    pub path: PathBuf,
    /// The device.
    pub dev: DevNum,
}

/// A process holding at least one sought device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    /// The process.
    pub pid: i32,
    /// Its descriptors on sought devices.
    pub fds: Vec<HeldFd>,
}

impl Holder {
    /// The distinct devices held.
    pub fn devices(&self) -> BTreeSet<DevNum> {
        self.fds.iter().map(|f| f.dev).collect()
    }
}

/// Every process (other than this one) with a descriptor on a character
/// device in `devs`. Processes that vanish during the walk are skipped.
pub fn holders(devs: &BTreeSet<DevNum>) -> Vec<Holder> {
    let mut out = Vec::new();
    if devs.is_empty() {
        return out;
    }
    let me = std::process::id() as i32;
    let Ok(proc_dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in proc_dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        if let Some(h) = holder(pid, devs) {
            out.push(h);
        }
    }
    out.sort_by_key(|h| h.pid);
    out
}

/// The descriptors of `pid` on devices in `devs`, if any.
pub fn holder(pid: i32, devs: &BTreeSet<DevNum>) -> Option<Holder> {
    let fd_dir = PathBuf::from(format!("/proc/{pid}/fd"));
    let rd = std::fs::read_dir(&fd_dir).ok()?;
    let mut fds = Vec::new();
    for e in rd.flatten() {
        let Some(fd) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let p = e.path();
        // metadata() follows the magic link to the open file itself.
        let Ok(md) = std::fs::metadata(&p) else {
            continue;
        };
        if !md.file_type().is_char_device() {
            continue;
        }
        let dev = DevNum::from_rdev(md.rdev());
        if devs.contains(&dev) {
            fds.push(HeldFd {
                fd,
                path: std::fs::read_link(&p).unwrap_or_default(),
                dev,
            });
        }
    }
    (!fds.is_empty()).then(|| {
        fds.sort_by_key(|f| f.fd);
        Holder { pid, fds }
    })
}

/// Groups holders by device, for messages.
pub fn by_device(holders: &[Holder]) -> BTreeMap<DevNum, Vec<i32>> {
    let mut m: BTreeMap<DevNum, Vec<i32>> = BTreeMap::new();
    for h in holders {
        for d in h.devices() {
            m.entry(d).or_default().push(h.pid);
        }
    }
    m
}
