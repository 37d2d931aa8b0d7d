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

/// Whom exemptions cover: identity classes, each a small set of uids.
/// An exemption is a cgroup *and* one class (its `exempt_cgroups` entry's
/// `users`, [`crate::config::ExemptEntry`]): a task in an exempt cgroup
/// (or below one) is exempt only when its uid is in that cgroup's class;
/// any other task there is judged as if the cgroup were not exempt. So
/// user code that ends up in a daemon's cgroup (slurmd runs `su - <user>`
/// for `sbatch --get-user-env` in its own cgroup, before the job's
/// credential is checked: `_rpc_batch_job` in
/// `src/slurmd/slurmd/req.c`) borrows nothing, whatever its uid.
///
/// Class [`ROOT_CLASS`](Self::ROOT_CLASS) is always `{0}`: a bare
/// `exempt_cgroups` entry and the exec cgroup use it. A class index with
/// no class (or a class left empty because none of its users resolved)
/// covers no one: an exemption that cannot be resolved grants nothing.
///
/// The uid is the task's real uid in the initial user namespace, as
/// `bpf_get_current_uid_gid` gives it (`current_uid_gid()`,
/// `kernel/bpf/helpers.c`): a setuid-root program a user runs keeps the
/// user's real uid, and a user namespace changes nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExemptIdentities {
    /// The classes, by index (the index is stored in the `cgroups` map's
    /// flags of each exempt cgroup). At most [`MAX_CLASSES`](Self::MAX_CLASSES).
    pub classes: Vec<BTreeSet<u32>>,
}

impl ExemptIdentities {
    /// The class of root only (`{0}`), index 0.
    pub const ROOT_CLASS: u32 = 0;
    /// The most classes the program tells apart. Their index sits in bits
    /// 8..=11 of the `cgroups` map's flags; an index past the classes (up
    /// to 15) covers no one.
    pub const MAX_CLASSES: usize = 8;
    /// The most uids one class holds (one compare instruction each, per
    /// level walked).
    pub const MAX_UIDS: usize = 8;
    /// The largest uid the program compares against: its compare
    /// immediates are signed 32-bit.
    pub const MAX_UID: u32 = i32::MAX as u32;

    /// Whether a task of `uid` in an exempt cgroup of class `class` is
    /// exempt; `false` for a class index there is no class for.
    pub fn covers(&self, class: u32, uid: u32) -> bool {
        self.classes
            .get(class as usize)
            .is_some_and(|c| c.contains(&uid))
    }

    /// The index of the class that is exactly `uids`, added when there is
    /// none yet; `None` when [`MAX_CLASSES`](Self::MAX_CLASSES) are taken
    /// by other sets.
    pub fn class_of(&mut self, uids: &BTreeSet<u32>) -> Option<u32> {
        if let Some(i) = self.classes.iter().position(|c| c == uids) {
            return Some(i as u32);
        }
        if self.classes.len() >= Self::MAX_CLASSES {
            return None;
        }
        self.classes.push(uids.clone());
        Some((self.classes.len() - 1) as u32)
    }

    /// Whether the classes fit the program: at most
    /// [`MAX_CLASSES`](Self::MAX_CLASSES), each of at most
    /// [`MAX_UIDS`](Self::MAX_UIDS) uids, each at most
    /// [`MAX_UID`](Self::MAX_UID).
    pub fn fits(&self) -> bool {
        self.classes.len() <= Self::MAX_CLASSES
            && self
                .classes
                .iter()
                .all(|c| c.len() <= Self::MAX_UIDS && c.iter().all(|u| *u <= Self::MAX_UID))
    }
}

impl Default for ExemptIdentities {
    /// One class, [`ROOT_CLASS`](Self::ROOT_CLASS): root only.
    fn default() -> Self {
        ExemptIdentities {
            classes: vec![BTreeSet::from([0])],
        }
    }
}

/// What the fence knows: the protected majors, the exempt cgroups and whom
/// they cover, and the grants, keyed by cgroup id (the cgroup2 directory's
/// inode number).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    /// Character majors under the fence.
    pub protected: BTreeSet<u32>,
    /// cgroup ids whose processes (and descendants) may open every device,
    /// each with the index of its class in [`identities`](Self::identities):
    /// only tasks whose uid that class holds.
    pub exempt: BTreeMap<u64, u32>,
    /// Whom each exemption covers.
    pub identities: ExemptIdentities,
    /// `(cgroup id, device) -> access`; a device `major:*`
    /// ([`DevNum::any_minor`]) covers every minor of that major.
    pub grants: BTreeMap<(u64, DevNum), Access>,
}

impl Policy {
    /// Whether a task of real uid `uid` whose cgroup ancestry is
    /// `ancestry` may do `req`.
    ///
    /// `ancestry[0]` is the cgroup2 root, `ancestry[k]` the ancestor at
    /// level `k`, the last element the task's own cgroup (the values
    /// `bpf_get_current_ancestor_cgroup_id(k)` returns). Levels
    /// `1..=max_level` are consulted; the root never grants or exempts.
    ///
    /// Rules: block devices and unprotected majors are allowed; a protected
    /// character device is allowed when some consulted ancestor is exempt
    /// and its class covers `uid`, or holds a grant whose access covers
    /// the request, for the device itself or for every minor of its major
    /// (`major:*`); otherwise denied.
    pub fn allows(&self, ancestry: &[u64], uid: u32, req: &Request, max_level: usize) -> bool {
        if req.dev_type != DevType::Char || !self.protected.contains(&req.dev.major) {
            return true;
        }
        ancestry
            .iter()
            .enumerate()
            .skip(1)
            .take(max_level)
            .any(|(_, id)| {
                let covers = |dev: DevNum| {
                    self.grants
                        .get(&(*id, dev))
                        .is_some_and(|a| a.contains(req.access))
                };
                self.exempt
                    .get(id)
                    .is_some_and(|c| self.identities.covers(*c, uid))
                    || covers(req.dev)
                    || covers(DevNum::any_minor(req.dev.major))
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
            exempt: [(50, 1), (60, 0)].into(),
            identities: ExemptIdentities {
                classes: vec![[0].into(), [1500].into()],
            },
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
            (&[1, 60, 61][..], req(509, 0, Access::all()), true),
            (&[1, 11][..], req(195, 1, Access::WRITE), false),
            (&[1, 11][..], req(195, 1, Access::READ), true),
        ];
        for (anc, r, want) in cases {
            assert_eq!(p.allows(anc, 0, &r, 16), want, "{anc:?} {r:?}");
        }
        // An exemption covers its own class's uids only: any other
        // process in the exempt cgroup, a system account's included, is
        // judged as outside it.
        let root_only = [1, 60, 61];
        for (uid, service, root) in [
            (0, false, true),
            (600, false, false),
            (999, false, false),
            (1000, false, false),
            (1500, true, false),
            (1501, false, false),
        ] {
            assert_eq!(
                p.allows(&exempt_child, uid, &req(195, 0, Access::RW), 16),
                service,
                "uid {uid} in the service's exempt cgroup"
            );
            assert_eq!(
                p.allows(&root_only, uid, &req(195, 0, Access::RW), 16),
                root,
                "uid {uid} in a root-only exempt cgroup"
            );
        }
        // A grant does not depend on the uid.
        assert!(p.allows(&job10, 1000, &req(195, 0, Access::RW), 16));
        let block = Request {
            dev_type: DevType::Block,
            ..req(195, 0, Access::RW)
        };
        assert!(p.allows(&outside, 1000, &block, 16));
    }

    #[test]
    fn a_major_wide_grant_covers_every_minor_for_its_access_only() {
        let mut p = policy();
        p.protected.insert(120);
        p.grants.insert((10, DevNum::any_minor(120)), Access::MKNOD);
        p.grants.insert((10, DevNum::new(120, 3)), Access::RW);
        let job10 = [1, 7, 10, 12];
        assert!(p.allows(&job10, 0, &req(120, 7, Access::MKNOD), 16));
        assert!(p.allows(&job10, 0, &req(120, 3, Access::MKNOD), 16));
        assert!(p.allows(&job10, 0, &req(120, 3, Access::RW), 16));
        assert!(!p.allows(&job10, 0, &req(120, 7, Access::READ), 16));
        assert!(!p.allows(&job10, 0, &req(120, 7, Access::all()), 16));
        assert!(!p.allows(&[1, 7, 8], 0, &req(120, 7, Access::MKNOD), 16));
        assert!(!p.allows(&job10, 0, &req(195, 9, Access::MKNOD), 16));
        assert_eq!(DevNum::any_minor(120).to_string(), "120:*");
    }

    #[test]
    fn grants_deeper_than_max_level_do_not_count() {
        let p = policy();
        assert!(p.allows(&[1, 2, 10], 0, &req(195, 0, Access::READ), 2));
        assert!(!p.allows(&[1, 2, 10], 0, &req(195, 0, Access::READ), 1));
        // the root (level 0) never grants
        assert!(!p.allows(&[10], 0, &req(195, 0, Access::READ), 16));
    }
}
