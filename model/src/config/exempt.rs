//! `exempt_cgroups`: its entries (a cgroup or a pattern, with the users
//! each covers), the defaults, and how the config resolves them against
//! the cgroups and accounts a node has now.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::{Config, REPORT_CGROUP};
use crate::cgpath::CgroupPath;

/// is a handful; more is a pattern that says too much.
pub const MAX_PATTERN_MATCHES: usize = 64;

/// An `exempt_cgroups` entry with wildcards ([`crate::cgpath::is_glob`])
/// has them in its last component only (a unit name pattern such as
/// `system.slice/nvsm*.service`: the slice is named), with at least one
/// literal character there (`system.slice/*` would exempt every
/// service, and any user's transient scope), and is a valid glob.
pub(super) fn check_exempt_pattern(n: &CgroupPath) -> Result<(), String> {
    let parts: Vec<&str> = n.components().collect();
    let Some((last, parents)) = parts.split_last() else {
        return Ok(());
    };
    if let Some(p) = parents.iter().find(|p| crate::cgpath::is_glob(p)) {
        return Err(format!(
            "{n}: a wildcard may only stand in the last component (the unit's name), not in {p:?}"
        ));
    }
    if !crate::cgpath::is_glob(last) {
        return Ok(());
    }
    if let Err(e) = glob::Pattern::new(last) {
        return Err(format!("{n}: not a valid pattern: {e}"));
    }
    // What a pattern must name literally: the unit's type suffix
    // (`.service`, `.scope`), so that `nvsm*` cannot also take a slice.
    if !last.ends_with(".service") {
        return Err(format!(
            "{n}: a pattern names service units: its last component ends in `.service` (e.g. `system.slice/nvsm*.service`)"
        ));
    }
    Ok(())
}

/// A user an [`ExemptEntry`] covers: a uid, or a name resolved through
/// `passwd_file` and NSS when the fence is installed (and whenever
/// userspace asks whether an exemption covers a process). A name that
/// does not resolve covers no one.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(untagged, expecting = "a user name or a uid")]
pub enum ExemptUser {
    /// A uid, at most [`crate::policy::ExemptIdentities::MAX_UID`].
    Uid(u32),
    /// A user name.
    Name(String),
}

impl fmt::Display for ExemptUser {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExemptUser::Uid(u) => write!(f, "{u}"),
            ExemptUser::Name(n) => f.write_str(n),
        }
    }
}

/// One `exempt_cgroups` entry: a cgroup (or a pattern of service units)
/// and the users whose processes there, and below, may open every NVIDIA
/// device. An exemption is a cgroup *and* its users, never a uid range:
/// any other process in that cgroup (a user's login shell that slurmd
/// runs there for `sbatch --get-user-env`) is fenced as anywhere else.
///
/// In TOML either a bare string, which covers root (uid 0) only, or a
/// table `{ cgroup = "system.slice/nvidia-persistenced.service", users =
/// ["nvidia-persistenced", "root"] }` (users by name or uid, 1 to
/// [`crate::policy::ExemptIdentities::MAX_UIDS`] of them).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "RawExemptEntry", into = "RawExemptEntry")]
pub struct ExemptEntry {
    /// The cgroup or pattern, relative to the cgroup2 mount (normalised by
    /// [`Config::parse`]).
    pub cgroup: String,
    /// Whom it covers; `[Uid(0)]` for a bare entry.
    pub users: Vec<ExemptUser>,
}

impl ExemptEntry {
    /// An entry that covers root only (what a bare string means).
    pub fn root(cgroup: impl Into<String>) -> ExemptEntry {
        ExemptEntry {
            cgroup: cgroup.into(),
            users: vec![ExemptUser::Uid(0)],
        }
    }

    /// An entry that covers `users`.
    pub fn with_users(cgroup: impl Into<String>, users: &[ExemptUser]) -> ExemptEntry {
        ExemptEntry {
            cgroup: cgroup.into(),
            users: users.to_vec(),
        }
    }

    /// The uids this entry covers, names resolved by `resolve` (a name it
    /// does not know is left out and returned in the second list: never
    /// a wider set).
    pub fn uids(
        &self,
        resolve: &dyn Fn(&str) -> Option<u32>,
    ) -> (std::collections::BTreeSet<u32>, Vec<String>) {
        let mut uids = std::collections::BTreeSet::new();
        let mut unknown = Vec::new();
        for u in &self.users {
            match u {
                ExemptUser::Uid(n) => {
                    uids.insert(*n);
                }
                // A name that resolves past what the program compares
                // (`MAX_UID`) is left out as an unknown one: the entry
                // covers no one by it, and the install goes on.
                ExemptUser::Name(n) => match resolve(n) {
                    Some(id) if id <= crate::policy::ExemptIdentities::MAX_UID => {
                        uids.insert(id);
                    }
                    Some(id) => unknown.push(format!(
                        "{n} (uid {id}, above {})",
                        crate::policy::ExemptIdentities::MAX_UID
                    )),
                    None => unknown.push(n.clone()),
                },
            }
        }
        (uids, unknown)
    }

    /// Whether this entry covers a process of `uid` (names resolved by
    /// `resolve`).
    pub fn covers_uid(&self, uid: u32, resolve: &dyn Fn(&str) -> Option<u32>) -> bool {
        uid <= crate::policy::ExemptIdentities::MAX_UID
            && self.users.iter().any(|u| match u {
                ExemptUser::Uid(n) => *n == uid,
                ExemptUser::Name(n) => resolve(n) == Some(uid),
            })
    }

    /// Whether this is a bare (root-only) entry.
    pub fn is_root_only(&self) -> bool {
        self.users == [ExemptUser::Uid(0)]
    }
}

impl From<&str> for ExemptEntry {
    /// [`ExemptEntry::root`].
    fn from(cgroup: &str) -> ExemptEntry {
        ExemptEntry::root(cgroup)
    }
}

impl From<String> for ExemptEntry {
    /// [`ExemptEntry::root`].
    fn from(cgroup: String) -> ExemptEntry {
        ExemptEntry::root(cgroup)
    }
}

impl fmt::Display for ExemptEntry {
    /// The TOML form: a quoted string, or an inline table.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let quote = |s: &str| toml::Value::String(s.to_string()).to_string();
        if self.is_root_only() {
            return f.write_str(&quote(&self.cgroup));
        }
        let users: Vec<String> = self
            .users
            .iter()
            .map(|u| match u {
                ExemptUser::Uid(n) => n.to_string(),
                ExemptUser::Name(n) => quote(n),
            })
            .collect();
        write!(
            f,
            "{{ cgroup = {}, users = [{}] }}",
            quote(&self.cgroup),
            users.join(", ")
        )
    }
}

/// The TOML shapes of an [`ExemptEntry`].
#[derive(Clone, Serialize, Deserialize)]
#[serde(
    untagged,
    expecting = "a cgroup path string, or a table { cgroup = \"...\", users = [\"name\" or uid, ...] }"
)]
enum RawExemptEntry {
    Bare(String),
    Table(ExemptTable),
}

#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExemptTable {
    cgroup: String,
    users: Vec<ExemptUser>,
}

impl From<RawExemptEntry> for ExemptEntry {
    fn from(r: RawExemptEntry) -> ExemptEntry {
        match r {
            RawExemptEntry::Bare(c) => ExemptEntry::root(c),
            RawExemptEntry::Table(t) => ExemptEntry {
                cgroup: t.cgroup,
                users: t.users,
            },
        }
    }
}

impl From<ExemptEntry> for RawExemptEntry {
    fn from(e: ExemptEntry) -> RawExemptEntry {
        if e.is_root_only() {
            RawExemptEntry::Bare(e.cgroup)
        } else {
            RawExemptEntry::Table(ExemptTable {
                cgroup: e.cgroup,
                users: e.users,
            })
        }
    }
}

/// The default `exempt_cgroups`: the NVIDIA daemons of HGX, DGX and GB200
/// nodes and slurmd, each for the accounts it runs as.
///
/// - slurmd: root (`slurmd.service`).
/// - nvidia-persistenced: the `nvidia-persistenced` user when started
///   with `--user nvidia-persistenced` (NVIDIA's sample unit,
///   `nvidia-persistenced/init/systemd/nvidia-persistenced.service.template`,
///   and the distro packages), else root.
/// - DCGM's nv-hostengine (`nvidia-dcgm.service`, older `dcgm.service`):
///   `nvidia-dcgm` (DCGM 3.x runs it with `--service-account
///   nvidia-dcgm`), else root.
/// - Fabric Manager, IMEX, the MIG manager and NVSM: root.
pub fn default_exemptions() -> Vec<ExemptEntry> {
    let named = |cg: &str, user: &str| {
        ExemptEntry::with_users(cg, &[ExemptUser::Name(user.into()), ExemptUser::Uid(0)])
    };
    vec![
        ExemptEntry::root("system.slice/slurmd.service"),
        named(
            "system.slice/nvidia-persistenced.service",
            "nvidia-persistenced",
        ),
        named("system.slice/nvidia-dcgm.service", "nvidia-dcgm"),
        named("system.slice/dcgm.service", "nvidia-dcgm"),
        ExemptEntry::root("system.slice/nvidia-fabricmanager.service"),
        ExemptEntry::root("system.slice/nvidia-imex.service"),
        ExemptEntry::root("system.slice/nvidia-mig-manager.service"),
        ExemptEntry::root("system.slice/nvsm*.service"),
    ]
}

/// The exemptions resolved for the fence: the identity classes and each
/// `exempt_cgroups` entry's class ([`Config::exempt_plan`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExemptPlan {
    /// The classes; class [`crate::policy::ExemptIdentities::ROOT_CLASS`]
    /// is root only.
    pub identities: crate::policy::ExemptIdentities,
    /// Entry `i`'s class index.
    pub entry_class: Vec<u32>,
    /// `(entry's cgroup, user name)` for each name that did not resolve
    /// (left out of its class).
    pub unknown: Vec<(String, String)>,
}

impl Config {
    /// The first `exempt_cgroups` entry that `cg` (relative to the cgroup2
    /// mount) is in or under, patterns matched per component
    /// ([`CgroupPath::is_under_pattern`]), whoever its users are; `None`
    /// when none is, or `cg` is not a cgroup path. Whether it covers a
    /// process is [`Config::exempt_entry_for`].
    pub fn exempt_entry_covering(&self, cg: &str) -> Option<&ExemptEntry> {
        let c = CgroupPath::parse(cg).ok()?;
        self.exempt_cgroups
            .iter()
            .find(|e| CgroupPath::parse(&e.cgroup).is_ok_and(|e| c.is_under_pattern(&e)))
    }

    /// The first `exempt_cgroups` entry that covers a process of real uid
    /// `uid` in cgroup `cg` (relative to the cgroup2 mount): `cg` is in or
    /// under it and `uid` is one of its users (names resolved by
    /// `resolve`). The rule the fence program applies: an exemption is a
    /// cgroup and its users.
    pub fn exempt_entry_for(
        &self,
        cg: &str,
        uid: u32,
        resolve: &dyn Fn(&str) -> Option<u32>,
    ) -> Option<&ExemptEntry> {
        let c = CgroupPath::parse(cg).ok()?;
        self.exempt_cgroups.iter().find(|e| {
            CgroupPath::parse(&e.cgroup).is_ok_and(|p| c.is_under_pattern(&p))
                && e.covers_uid(uid, resolve)
        })
    }

    /// Whether `uid` is a system account or a service account: at most
    /// `protected_uid_max`, or a uid some `exempt_cgroups` entry names
    /// (names resolved by `resolve`). Not an exemption: what the accounts
    /// checks (`sweep`'s shared-memory leftovers, the suggested
    /// exemptions) ask.
    pub fn is_system_or_service_uid(
        &self,
        uid: u32,
        resolve: &dyn Fn(&str) -> Option<u32>,
    ) -> bool {
        uid <= self.protected_uid_max
            || self
                .exempt_cgroups
                .iter()
                .any(|e| e.covers_uid(uid, resolve))
    }

    /// The identity classes of the exemptions: class 0 root only, then one
    /// class per distinct set of resolved uids, and each entry's class.
    /// An entry whose users all fail to resolve gets an empty class
    /// (covers no one). The config's validation bounds the number of
    /// distinct user lists, so classes never run out; were they to, the
    /// entry would get an empty class too (fail closed).
    pub fn exempt_plan(&self, resolve: &dyn Fn(&str) -> Option<u32>) -> ExemptPlan {
        use crate::policy::ExemptIdentities;
        let mut identities = ExemptIdentities::default();
        let mut entry_class = Vec::new();
        let mut unknown = Vec::new();
        for e in &self.exempt_cgroups {
            let (uids, missing) = e.uids(resolve);
            unknown.extend(missing.into_iter().map(|n| (e.cgroup.clone(), n)));
            let class = identities
                .class_of(&uids)
                .or_else(|| identities.class_of(&Default::default()))
                .unwrap_or(ExemptIdentities::MAX_CLASSES as u32);
            entry_class.push(class);
        }
        ExemptPlan {
            identities,
            entry_class,
            unknown,
        }
    }

    /// The cgroups `exempt_cgroups` names now (relative to the mount), each
    /// with the index of its entry: each plain entry as it is, whether or not it exists; each pattern
    /// replaced by the existing children of its parent that match it,
    /// sorted, at most [`MAX_PATTERN_MATCHES`] of them. `children` lists
    /// the names of a cgroup's child cgroups (empty when it has none or
    /// does not exist). A match that contains the fenced subtree
    /// (`cgroup_root`) or job reports' cgroup is left out, as the config
    /// refuses such a plain entry.
    pub fn expand_exempt(
        &self,
        children: impl Fn(&CgroupPath) -> Vec<String>,
    ) -> Vec<(String, usize)> {
        let root = CgroupPath::parse(&self.cgroup_root).unwrap_or_default();
        let reports = root.join_path(&CgroupPath::parse(REPORT_CGROUP).unwrap_or_default());
        let mut out = Vec::new();
        for (i, e) in self.exempt_cgroups.iter().enumerate() {
            let Ok(n) = CgroupPath::parse(&e.cgroup) else {
                continue;
            };
            let Some(last) = n.components().last().filter(|l| crate::cgpath::is_glob(l)) else {
                out.push((n.into_string(), i));
                continue;
            };
            let Ok(pat) = glob::Pattern::new(last) else {
                continue;
            };
            let parent = CgroupPath::parse(
                n.as_str()
                    .rsplit_once('/')
                    .map(|(p, _)| p)
                    .unwrap_or_default(),
            )
            .unwrap_or_default();
            let mut names: Vec<String> = children(&parent)
                .into_iter()
                .filter(|c| !c.contains('/') && pat.matches(c))
                .collect();
            names.sort();
            out.extend(
                names
                    .into_iter()
                    .filter_map(|c| parent.join(&c).ok())
                    .filter(|m| !root.is_under(m) && !m.is_under(&reports) && !reports.is_under(m))
                    .take(MAX_PATTERN_MATCHES)
                    .map(|m| (m.into_string(), i)),
            );
        }
        out
    }
}
