//! The fence program's answer for a task, computed the way the kernel
//! computes it: the program this version installs is run, in the
//! interpreter ([`crate::interp`]), over the fence's maps as they are, for
//! a task whose ancestors at each kernel level are given. `gpufence doctor`
//! and `fence status` say what this says, so they agree with the kernel
//! also where paths would mislead (a cgroup namespace: an entry recorded
//! at a level where the task's ancestor is another cgroup is never
//! consulted, though the cgroup id matches).
//!
//! Alongside the verdict, a walk that mirrors the program step by step
//! over the same maps says why: which level and entry allowed, or that
//! none did, and which ancestors hold an entry recorded at another level
//! than the one the kernel has them at. The two read the maps one after
//! the other; when they disagree (the maps changed in between) the
//! verdict stands and the reason says so.

use std::cell::RefCell;

use gpufence_model::device::{Access, DevNum};
use gpufence_model::policy::ExemptIdentities;

use crate::error::{Error, Result};
use crate::interp::{self, Env};
use crate::maps::{
    CgroupValue, DenialKey, DenialValue, GrantKey, GrantValue, MapPod, CGROUP_EXEMPT,
    CGROUP_GRANTED,
};
use crate::program::{self, FenceProgramSpec, DEVCG_DEV_CHAR, MAX_LEVEL};

/// The maps the program reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapRole {
    /// `majors`: u32 major → u32 protected.
    Majors,
    /// `cgroups`: u64 id → { u32 flags; u32 level }.
    Cgroups,
    /// `grants`: { id, major, minor } → { access, job id }.
    Grants,
    /// `levels`: 0 → u32 mask.
    Levels,
}

/// Read access to the fence's maps, as the program has it.
pub trait MapView {
    /// The value under `key` in map `map` (`bpf_map_lookup_elem`), `None`
    /// when there is none.
    ///
    /// # Errors
    /// [`Error::Bpf`] when the map cannot be read.
    fn lookup(&self, map: MapRole, key: &[u8]) -> Result<Option<Vec<u8>>>;
}

/// Why the program answers as it does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reason {
    /// Not a protected major: allowed before any walk.
    NotProtected,
    /// The ancestor at `level` is exempt and the exemption covers the
    /// task's uid.
    Exempt {
        /// Its kernel level.
        level: usize,
        /// Its id.
        cgroup_id: u64,
    },
    /// The ancestor at `level` holds a grant covering the access.
    Granted {
        /// Its kernel level.
        level: usize,
        /// Its id.
        cgroup_id: u64,
        /// The job the grant is for.
        job_id: u32,
    },
    /// No levels mask: the program denies.
    NoLevels,
    /// No ancestor at a level the program consults is exempt or holds a
    /// grant covering the access: denied.
    NoMatch,
    /// The walk over the maps read again disagrees with the program's run
    /// (the maps changed in between); the verdict is the program's.
    Changed,
}

/// An entry on the task's ancestry recorded at another level than the
/// kernel has its cgroup at: the program looks for it at the recorded
/// level only, where the task's ancestor is another cgroup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Misrecorded {
    /// The cgroup's kernel level on this ancestry.
    pub level: usize,
    /// Its id.
    pub cgroup_id: u64,
    /// The level its entry says.
    pub recorded: u32,
    /// Its flags (`EXEMPT`, `GRANTED`).
    pub flags: u32,
}

/// The program's answer for one task and device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Evaluation {
    /// The enforcing program allows it (in audit mode everything is
    /// allowed; what is recorded is what this says is denied).
    pub allowed: bool,
    /// Why.
    pub reason: Reason,
    /// Ancestors whose entries the program does not find where they are.
    pub misrecorded: Vec<Misrecorded>,
}

/// The task a verdict is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Task<'a> {
    /// Its ancestors' ids by kernel level: index 0 the root of the
    /// hierarchy, the last its own cgroup (what
    /// `bpf_get_current_ancestor_cgroup_id(k)` returns for it).
    pub ancestry: &'a [u64],
    /// Its real uid (what `bpf_get_current_uid_gid` returns).
    pub uid: u32,
}

// Map fds of the program as the interpreter runs it: any distinct numbers
// (the instructions are those of the installed program but for the fd
// immediates, which `bpf_prog_calc_tag` zeroes too).
const MAJORS: i32 = 1;
const CGROUPS: i32 = 2;
const GRANTS: i32 = 3;
const DENIALS: i32 = 4;
const LEVELS: i32 = 5;

struct ViewEnv<'a> {
    view: &'a dyn MapView,
    ancestry: &'a [u64],
    uid: u32,
    failed: RefCell<Option<Error>>,
}

impl Env for ViewEnv<'_> {
    fn key_size(&self, fd: i32) -> Option<usize> {
        match fd {
            MAJORS | LEVELS => Some(4),
            CGROUPS => Some(8),
            GRANTS => Some(GrantKey::SIZE),
            DENIALS => Some(DenialKey::SIZE),
            _ => None,
        }
    }
    fn value_size(&self, fd: i32) -> Option<usize> {
        (fd == DENIALS).then_some(DenialValue::SIZE)
    }
    fn map_lookup(&self, fd: i32, key: &[u8]) -> Option<Vec<u8>> {
        let role = match fd {
            MAJORS => MapRole::Majors,
            CGROUPS => MapRole::Cgroups,
            GRANTS => MapRole::Grants,
            LEVELS => MapRole::Levels,
            // Denial records: none, and nothing is written (map_update).
            _ => return None,
        };
        match self.view.lookup(role, key) {
            Ok(v) => v,
            Err(e) => {
                self.failed.borrow_mut().get_or_insert(e);
                None
            }
        }
    }
    fn ancestor_cgroup_id(&self, level: u64) -> u64 {
        usize::try_from(level)
            .ok()
            .and_then(|l| self.ancestry.get(l))
            .copied()
            .unwrap_or(0)
    }
    fn cgroup_id(&self) -> u64 {
        self.ancestry.last().copied().unwrap_or(0)
    }
    fn uid_gid(&self) -> u64 {
        u64::from(self.uid)
    }
}

/// A `u32` value (`majors`, `levels`).
fn u32_value(v: &[u8]) -> Option<u32> {
    u32::decode(v)
}

/// What the enforcing program built with `identities` answers for `task`
/// opening character device `dev` for `access`.
///
/// # Errors
/// [`Error::Bpf`] when a map cannot be read, [`Error::Interp`] when the
/// program does not run in the interpreter (a bug).
pub fn evaluate(
    view: &dyn MapView,
    task: Task<'_>,
    identities: &ExemptIdentities,
    dev: DevNum,
    access: Access,
) -> Result<Evaluation> {
    let ancestry = task.ancestry;
    let prog = program::build(&FenceProgramSpec {
        majors_fd: MAJORS,
        cgroups_fd: CGROUPS,
        grants_fd: GRANTS,
        denials_fd: DENIALS,
        levels_fd: LEVELS,
        max_level: MAX_LEVEL,
        audit: false,
        identities: identities.clone(),
    })?;
    let env = ViewEnv {
        view,
        ancestry,
        uid: task.uid,
        failed: RefCell::new(None),
    };
    let ctx = [
        DEVCG_DEV_CHAR as u32 | (access.bits() << 16),
        dev.major,
        dev.minor,
    ];
    let r0 = interp::run(&prog.insns, ctx, &env)?;
    if let Some(e) = env.failed.into_inner() {
        return Err(e);
    }
    let allowed = r0 == 1;
    let (walk_allowed, reason) = walk(view, task, identities, dev, access)?;
    let reason = if walk_allowed == allowed {
        reason
    } else {
        Reason::Changed
    };
    Ok(Evaluation {
        allowed,
        reason,
        misrecorded: misrecorded(view, ancestry)?,
    })
}

/// The program's steps over `view`, in Rust, with the reason.
fn walk(
    view: &dyn MapView,
    task: Task<'_>,
    identities: &ExemptIdentities,
    dev: DevNum,
    access: Access,
) -> Result<(bool, Reason)> {
    let ancestry = task.ancestry;
    let protected = view
        .lookup(MapRole::Majors, &dev.major.encode())?
        .and_then(|v| u32_value(&v))
        .is_some_and(|p| p != 0);
    if !protected {
        return Ok((true, Reason::NotProtected));
    }
    let Some(mask) = view
        .lookup(MapRole::Levels, &0u32.encode())?
        .and_then(|v| u32_value(&v))
    else {
        return Ok((false, Reason::NoLevels));
    };
    for level in 1..=MAX_LEVEL {
        if mask & (1 << level) == 0 {
            continue;
        }
        let id = ancestry.get(level).copied().unwrap_or(0);
        if id == 0 {
            break;
        }
        let Some(flags) = view
            .lookup(MapRole::Cgroups, &id.encode())?
            .and_then(|v| CgroupValue::from_bytes(&v))
            .map(|v| v.flags)
        else {
            continue;
        };
        if flags & CGROUP_EXEMPT != 0 && identities.covers(crate::maps::class_of(flags), task.uid) {
            return Ok((
                true,
                Reason::Exempt {
                    level,
                    cgroup_id: id,
                },
            ));
        }
        if flags & CGROUP_GRANTED == 0 {
            continue;
        }
        // The device's own entry, then the major-wide one (`major:*`),
        // as the program looks them up.
        for key in [
            GrantKey::new(id, dev),
            GrantKey::new(id, DevNum::any_minor(dev.major)),
        ] {
            if let Some(g) = view
                .lookup(MapRole::Grants, &key.to_bytes())?
                .and_then(|v| GrantValue::from_bytes(&v))
            {
                if g.access().contains(access) {
                    return Ok((
                        true,
                        Reason::Granted {
                            level,
                            cgroup_id: id,
                            job_id: g.job_id,
                        },
                    ));
                }
            }
        }
    }
    Ok((false, Reason::NoMatch))
}

fn misrecorded(view: &dyn MapView, ancestry: &[u64]) -> Result<Vec<Misrecorded>> {
    let mut out = Vec::new();
    for (level, id) in ancestry.iter().enumerate().skip(1) {
        let Some(CgroupValue {
            flags,
            level: recorded,
        }) = view
            .lookup(MapRole::Cgroups, &id.encode())?
            .and_then(|v| CgroupValue::from_bytes(&v))
        else {
            continue;
        };
        if flags != 0 && recorded as usize != level {
            out.push(Misrecorded {
                level,
                cgroup_id: *id,
                recorded,
                flags,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::maps::MAJOR_PROTECTED;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    /// Maps as plain data.
    #[derive(Default, Debug, Clone)]
    struct Maps {
        protected: Vec<u32>,
        mask: Option<u32>,
        cgroups: BTreeMap<u64, (u32, u32)>,
        grants: BTreeMap<(u64, DevNum), (Access, u32)>,
    }

    impl MapView for Maps {
        fn lookup(&self, map: MapRole, key: &[u8]) -> Result<Option<Vec<u8>>> {
            let u32k = || u32::from_ne_bytes(key.try_into().unwrap_or([0xff; 4]));
            Ok(match map {
                MapRole::Majors => Some(
                    if self.protected.contains(&u32k()) {
                        MAJOR_PROTECTED
                    } else {
                        0
                    }
                    .to_ne_bytes()
                    .to_vec(),
                ),
                MapRole::Levels => self.mask.map(|m| m.to_ne_bytes().to_vec()),
                MapRole::Cgroups => {
                    let id = u64::from_ne_bytes(key.try_into().unwrap_or([0; 8]));
                    self.cgroups
                        .get(&id)
                        .map(|(f, l)| [f.to_ne_bytes(), l.to_ne_bytes()].concat())
                }
                MapRole::Grants => {
                    let k = GrantKey::from_bytes(key).unwrap();
                    self.grants
                        .get(&(k.cgroup_id, k.dev()))
                        .map(|(access, job_id)| {
                            GrantValue::new(*access, *job_id).to_bytes().to_vec()
                        })
                }
            })
        }
    }

    const GPU0: DevNum = DevNum::new(195, 0);

    fn root(ancestry: &[u64]) -> Task<'_> {
        Task { ancestry, uid: 0 }
    }

    fn ids() -> ExemptIdentities {
        ExemptIdentities::default()
    }

    /// The fault seen in a container: the job at kernel level 4 granted
    /// at its namespace depth 3. The program never finds the grant; the
    /// evaluation says denied and names the misrecorded entry. Recorded
    /// at its kernel level, it is found.
    #[test]
    fn a_grant_recorded_at_the_namespace_depth_is_not_found() {
        let ancestry = [1, 10, 11, 12, 13, 14];
        let mut m = Maps {
            protected: vec![195],
            mask: Some(1 << 3),
            cgroups: [(13, (CGROUP_GRANTED, 3))].into(),
            grants: [((13, GPU0), (Access::RW, 4))].into(),
        };
        let e = evaluate(&m, root(&ancestry), &ids(), GPU0, Access::RW).unwrap();
        assert!(!e.allowed);
        assert_eq!(e.reason, Reason::NoMatch);
        assert_eq!(
            e.misrecorded,
            vec![Misrecorded {
                level: 4,
                cgroup_id: 13,
                recorded: 3,
                flags: CGROUP_GRANTED
            }]
        );
        m.cgroups.insert(13, (CGROUP_GRANTED, 4));
        m.mask = Some(1 << 4);
        let e = evaluate(&m, root(&ancestry), &ids(), GPU0, Access::RW).unwrap();
        assert!(e.allowed);
        assert_eq!(
            e.reason,
            Reason::Granted {
                level: 4,
                cgroup_id: 13,
                job_id: 4
            }
        );
        assert!(e.misrecorded.is_empty());
        // Unprotected majors never get to the walk.
        let e = evaluate(&m, root(&ancestry), &ids(), DevNum::new(1, 3), Access::RW).unwrap();
        assert_eq!((e.allowed, e.reason), (true, Reason::NotProtected));
        // Exempt above the job.
        m.cgroups.insert(11, (CGROUP_EXEMPT, 2));
        m.mask = Some(1 << 2 | 1 << 4);
        let e = evaluate(&m, root(&ancestry), &ids(), DevNum::new(195, 7), Access::RW).unwrap();
        assert_eq!(
            (e.allowed, e.reason),
            (
                true,
                Reason::Exempt {
                    level: 2,
                    cgroup_id: 11
                }
            )
        );
        // The exemption covers system accounts only: a user's task is
        // judged as if it were not there (and denied GPU 7).
        let user = Task {
            ancestry: &ancestry,
            uid: 1000,
        };
        let e = evaluate(&m, user, &ids(), DevNum::new(195, 7), Access::RW).unwrap();
        assert_eq!((e.allowed, e.reason), (false, Reason::NoMatch));
        // A class that names uid 1000 covers it; the root-only class
        // (the cgroup's now) does not, nor does protected_uid_max.
        let service = ExemptIdentities {
            classes: vec![[0].into(), [1000].into()],
        };
        let e = evaluate(&m, user, &service, DevNum::new(195, 7), Access::RW).unwrap();
        assert!(!e.allowed, "another class's service uid: {e:?}");
        let sys = Task {
            ancestry: &ancestry,
            uid: 600,
        };
        let e = evaluate(&m, sys, &ids(), DevNum::new(195, 7), Access::RW).unwrap();
        assert!(!e.allowed, "uid 600 in a root-only cgroup: {e:?}");
        m.cgroups
            .insert(11, (crate::maps::with_class(CGROUP_EXEMPT, 1), 2));
        let e = evaluate(&m, user, &service, DevNum::new(195, 7), Access::RW).unwrap();
        assert!(e.allowed, "a service uid in its own class: {e:?}");
        m.cgroups.insert(11, (CGROUP_EXEMPT, 2));
        m.mask = None;
        let e = evaluate(&m, root(&ancestry), &ids(), GPU0, Access::RW).unwrap();
        assert_eq!((e.allowed, e.reason), (false, Reason::NoLevels));
    }

    fn arb_maps() -> impl Strategy<Value = Maps> {
        let id = 1u64..10;
        (
            prop::collection::vec(prop::sample::select(vec![195u32, 509, 1]), 0..3),
            prop::option::weighted(0.9, any::<u32>()),
            prop::collection::btree_map(
                id.clone(),
                ((0u32..4), (0u32..10), (0u32..20))
                    .prop_map(|(f, c, l)| (crate::maps::with_class(f, c), l)),
                0..8,
            ),
            prop::collection::btree_map(
                (
                    id,
                    prop_oneof![
                        3 => (0u32..3).prop_map(|m| DevNum::new(195, m)),
                        1 => Just(DevNum::any_minor(195)),
                    ],
                ),
                ((0u32..8).prop_map(Access::from_bits_truncate), 0u32..5),
                0..10,
            ),
        )
            .prop_map(|(protected, mask, cgroups, grants)| Maps {
                protected,
                mask,
                cgroups,
                grants,
            })
    }

    proptest! {
        /// Over any maps (entries at any recorded level, any mask, flags
        /// without grants and grants without flags), the walk that gives
        /// the reason agrees with the program's run.
        #[test]
        fn walk_agrees_with_the_program(
            maps in arb_maps(),
            ancestry in prop::collection::vec(1u64..10, 1..20),
            minor in 0u32..3,
            access in (1u32..8).prop_map(Access::from_bits_truncate),
            uid in prop::sample::select(vec![0u32, 600, 999, 1000, 1500]),
            classes in prop::collection::vec(
                prop::collection::btree_set(prop::sample::select(vec![0u32, 600, 1000, 1500]), 0..3),
                0..4,
            ),
        ) {
            let task = Task { ancestry: &ancestry, uid };
            let ids = ExemptIdentities { classes };
            let e = evaluate(&maps, task, &ids, DevNum::new(195, minor), access).unwrap();
            prop_assert_ne!(e.reason, Reason::Changed);
        }
    }
}
