//! The fence's decision, written as plain Rust.
//!
//! This is the specification the BPF program (`gpufence-cgroup`'s
//! `program` module) must implement; tests run the generated instructions
//! on synthetic inputs and compare them with [`Policy::allows`].

use std::collections::{BTreeMap, BTreeSet};

use crate::device::{Access, DevNum};

/// Device type as the kernel passes it in the low 16 bits of
/// `bpf_cgroup_dev_ctx.access_type` (`BPF_DEVCG_DEV_*`, `include/uapi/linux/bpf.h`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DevType {
    /// `BPF_DEVCG_DEV_BLOCK` = 1.
    Block,
    /// `BPF_DEVCG_DEV_CHAR` = 2.
    Char,
}

impl DevType {
    /// The kernel's number for this type.
    pub const fn raw(self) -> u32 {
        match self {
            DevType::Block => 1,
            DevType::Char => 2,
        }
    }
}

/// One device check: what the opening (or mknod-ing) task asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// Block or character.
    pub dev_type: DevType,
    /// The device number.
    pub dev: DevNum,
    /// The access asked for.
    pub access: Access,
}

/// What the fence knows: the protected majors, the exempt cgroups and the
/// grants, keyed by cgroup id (the cgroup2 directory's inode number).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    /// Character majors under the fence.
    pub protected: BTreeSet<u32>,
    /// cgroup ids whose processes (and descendants) may open every device.
    pub exempt: BTreeSet<u64>,
    /// `(cgroup id, device) -> access`.
    pub grants: BTreeMap<(u64, DevNum), Access>,
}

impl Policy {
    /// Whether a task whose cgroup ancestry is `ancestry` may do `req`.
    ///
    /// `ancestry[0]` is the cgroup2 root, `ancestry[k]` the ancestor at
    /// level `k`, the last element the task's own cgroup (the values
    /// `bpf_get_current_ancestor_cgroup_id(k)` returns). Levels
    /// `1..=max_level` are consulted; the root never grants or exempts.
    ///
    /// Rules: block devices and unprotected majors are allowed; a protected
    /// character device is allowed when some consulted ancestor is exempt or
    /// holds a grant whose access covers the request; otherwise denied.
    pub fn allows(&self, ancestry: &[u64], req: &Request, max_level: usize) -> bool {
        if req.dev_type != DevType::Char || !self.protected.contains(&req.dev.major) {
            return true;
        }
        ancestry
            .iter()
            .enumerate()
            .skip(1)
            .take(max_level)
            .any(|(_, id)| {
                self.exempt.contains(id)
                    || self
                        .grants
                        .get(&(*id, req.dev))
                        .is_some_and(|a| a.contains(req.access))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(major: u32, minor: u32, access: Access) -> Request {
        Request {
            dev_type: DevType::Char,
            dev: DevNum::new(major, minor),
            access,
        }
    }

    fn policy() -> Policy {
        Policy {
            protected: [195, 509].into(),
            exempt: [50].into(),
            grants: [
                ((10, DevNum::new(195, 0)), Access::RW),
                ((11, DevNum::new(195, 1)), Access::READ),
            ]
            .into(),
        }
    }

    #[test]
    fn table() {
        let p = policy();
        let job10 = [1, 7, 10, 12, 13];
        let outside = [1, 7, 8];
        let exempt_child = [1, 50, 51];
        let cases = [
            (&job10[..], req(195, 0, Access::RW), true),
            (&job10[..], req(195, 0, Access::all()), false), // mknod never granted
            (&job10[..], req(195, 1, Access::READ), false),
            (&job10[..], req(1, 3, Access::RW), true), // /dev/null
            (&outside[..], req(195, 0, Access::READ), false),
            (&outside[..], req(509, 0, Access::READ), false),
            (&exempt_child[..], req(509, 0, Access::all()), true),
            (&[1, 11][..], req(195, 1, Access::WRITE), false),
            (&[1, 11][..], req(195, 1, Access::READ), true),
        ];
        for (anc, r, want) in cases {
            assert_eq!(p.allows(anc, &r, 16), want, "{anc:?} {r:?}");
        }
        let block = Request {
            dev_type: DevType::Block,
            ..req(195, 0, Access::RW)
        };
        assert!(p.allows(&outside, &block, 16));
    }

    #[test]
    fn grants_deeper_than_max_level_do_not_count() {
        let p = policy();
        assert!(p.allows(&[1, 2, 10], &req(195, 0, Access::READ), 2));
        assert!(!p.allows(&[1, 2, 10], &req(195, 0, Access::READ), 1));
        // the root (level 0) never grants
        assert!(!p.allows(&[10], &req(195, 0, Access::READ), 16));
    }
}
