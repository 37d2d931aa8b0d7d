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

/// Whom an exemption covers. A task in an exempt cgroup (or below one) is
/// exempt only when its uid is at most [`uid_max`](Self::uid_max) (system
/// accounts: root, the driver's and monitoring daemons) or one of
/// [`uids`](Self::uids) (service accounts above it); any other task there
/// is judged as if the cgroup were not exempt. So user code that ends up in
/// a daemon's cgroup (slurmd runs `su - <user>` for `sbatch
/// --get-user-env` in its own cgroup) borrows nothing.
///
/// The uid is the task's real uid in the initial user namespace, as
/// `bpf_get_current_uid_gid` gives it (`current_uid_gid()`,
/// `kernel/bpf/helpers.c`): a setuid-root program a user runs keeps the
/// user's real uid, and a user namespace changes nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExemptIdentities {
    /// uids up to this one are covered (`protected_uid_max`).
    pub uid_max: u32,
    /// uids above `uid_max` that are covered too (`service_uids`).
    pub uids: BTreeSet<u32>,
}

impl ExemptIdentities {
    /// The most uids above `uid_max` the program compares against (one
    /// instruction each per level walked).
    pub const MAX_UIDS: usize = 16;
    /// The largest uid the program compares against: its compare
    /// immediates are signed 32-bit.
    pub const MAX_UID: u32 = i32::MAX as u32;

    /// Whether a task of `uid` in an exempt cgroup is exempt.
    pub fn covers(&self, uid: u32) -> bool {
        uid <= self.uid_max || self.uids.contains(&uid)
    }
}

impl Default for ExemptIdentities {
    /// System accounts (uid 0-999), no service account.
    fn default() -> Self {
        ExemptIdentities {
            uid_max: 999,
            uids: BTreeSet::new(),
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
    /// when [`identities`](Self::identities) covers them.
    pub exempt: BTreeSet<u64>,
    /// Whom an exemption covers.
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
    /// and the exemption covers `uid`, or holds a grant whose access covers
    /// the request, for the device itself or for every minor of its major
    /// (`major:*`); otherwise denied.
    pub fn allows(&self, ancestry: &[u64], uid: u32, req: &Request, max_level: usize) -> bool {
        if req.dev_type != DevType::Char || !self.protected.contains(&req.dev.major) {
            return true;
        }
        let exempt_uid = self.identities.covers(uid);
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
                (exempt_uid && self.exempt.contains(id))
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
            exempt: [50].into(),
            identities: ExemptIdentities {
                uid_max: 999,
                uids: [1500].into(),
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
            (&exempt_child[..], req(509, 0, Access::all()), true),
            (&[1, 11][..], req(195, 1, Access::WRITE), false),
            (&[1, 11][..], req(195, 1, Access::READ), true),
        ];
        for (anc, r, want) in cases {
            assert_eq!(p.allows(anc, 0, &r, 16), want, "{anc:?} {r:?}");
        }
        // An exemption covers system accounts and the service uids only:
        // a user's process in the exempt cgroup is judged as outside it.
        for (uid, want) in [
            (0, true),
            (999, true),
            (1000, false),
            (1500, true),
            (1501, false),
        ] {
            assert_eq!(
                p.allows(&exempt_child, uid, &req(195, 0, Access::RW), 16),
                want,
                "uid {uid} in an exempt cgroup"
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
