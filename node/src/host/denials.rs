//! The fence's denial records, for people: cgroup paths instead of ids,
//! user names instead of uids, wall-clock times instead of monotonic ns.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use serde::Serialize;

use gpufence_cgroup::fence::{DenialEntry, Fence};

use crate::host::users::Users;
use crate::{Node, NodeError};

/// One denial record, resolved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Denial {
    /// The denied task's cgroup path (relative to the cgroup2 mount), when
    /// the cgroup still exists. JSON: absolute (`/a/b`).
    #[serde(serialize_with = "crate::host::cgpath::option::serialize")]
    pub cgroup: Option<String>,
    /// The cgroup id.
    pub cgroup_id: u64,
    /// uid.
    pub uid: u32,
    /// User name, from `passwd_file` or NSS ([`Users`]); `None` when
    /// neither knows the uid or NSS did not answer in time.
    pub user: Option<String>,
    /// `major:minor`.
    pub device: String,
    /// The access denied: `m` (mknod), `r`, `w`, or a combination; empty
    /// for a record of a program before the access was recorded.
    pub access: String,
    /// How many denied opens or mknods.
    pub count: u64,
    /// The last denied process.
    pub last_pid: u32,
    /// Its command name.
    pub last_comm: String,
    /// When (RFC 3339).
    pub last_time: String,
}

/// cgroup id → path for every cgroup under the mount (one walk).
pub fn cgroup_paths(mount: &Path) -> BTreeMap<u64, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![mount.to_path_buf()];
    while let Some(d) = stack.pop() {
        if let Ok(md) = std::fs::metadata(&d) {
            let rel = d
                .strip_prefix(mount)
                .map(|r| r.display().to_string())
                .unwrap_or_default();
            out.insert(md.ino(), rel);
        }
        if let Ok(rd) = std::fs::read_dir(&d) {
            stack.extend(
                rd.flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path()),
            );
        }
    }
    out
}

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime into a struct we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Resolves raw records, naming users through `users`.
pub fn resolve(node: &Node, raw: Vec<DenialEntry>, users: &Users) -> Vec<Denial> {
    let paths = cgroup_paths(node.cg.mount());
    let now_mono = monotonic_ns();
    let now = chrono::Utc::now();
    raw.into_iter()
        .map(|d| {
            let ago = now_mono.saturating_sub(d.last_ns);
            let when = now - chrono::Duration::nanoseconds(ago.min(i64::MAX as u64) as i64);
            Denial {
                cgroup: paths.get(&d.cgroup_id).cloned(),
                cgroup_id: d.cgroup_id,
                uid: d.uid,
                user: users.name(d.uid),
                device: d.dev.to_string(),
                access: d.access.to_string(),
                count: d.count,
                last_pid: d.last_pid,
                last_comm: d.last_comm,
                last_time: when.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            }
        })
        .collect()
}

/// Every denial record of this node's fence, resolved; users are named
/// through a [`Users`] of its own (at most [`crate::host::users::NSS_BUDGET`]
/// spent waiting on NSS).
///
/// # Errors
/// [`NodeError`] when the fence's maps cannot be read.
pub fn list(node: &Node) -> Result<Vec<Denial>, NodeError> {
    let fence = Fence::open(&node.cfg.bpffs_dir)?;
    let users = node.users();
    Ok(resolve(node, fence.denials()?, users))
}

/// The denial records of one cgroup, summed ([`by_cgroup`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CgroupDenials {
    /// The cgroup path (relative to the mount; JSON: absolute), when it
    /// still exists.
    #[serde(serialize_with = "crate::host::cgpath::option::serialize")]
    pub cgroup: Option<String>,
    /// The cgroup id.
    pub cgroup_id: u64,
    /// Denied (in audit mode: would-be-denied) opens and mknods, summed
    /// over its records.
    pub count: u64,
    /// The uids of its records, ascending.
    pub uids: Vec<u32>,
    /// Their names where known, else the uid as text; one per uid.
    pub users: Vec<String>,
    /// The devices (`major:minor`), ascending.
    pub devices: Vec<String>,
    /// The accesses denied (`m`, `r`, `w`, `rw`, ...), ascending.
    pub access: Vec<String>,
    /// The last denied process of its latest record, and when (RFC 3339).
    pub last_pid: u32,
    /// That process's command name.
    pub last_comm: String,
    /// When.
    pub last_time: String,
    /// The `exempt_cgroups` entry suggested for it: the system service
    /// unit it runs in, when every uid is one exemptions cover.
    pub suggest: Option<String>,
    /// Why nothing is suggested, when nothing is.
    pub not_suggested: Option<String>,
}

/// Denials grouped by cgroup, with the exemptions they suggest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ByCgroup {
    /// One entry per cgroup id, most denials first.
    pub cgroups: Vec<CgroupDenials>,
    /// The entries to add to `exempt_cgroups` (relative to the mount),
    /// sorted, no repeats, none already configured.
    pub suggested: Vec<String>,
    /// `exempt_cgroups = [...]`: the entries the config has, then
    /// `suggested`, ready to paste into the config.
    pub exempt_cgroups_line: String,
}

/// What an `exempt_cgroups` entry for a cgroup that was denied would be,
/// or why there is none. Only a system service qualifies: the cgroup is
/// in (or below) a `.service` unit outside `user.slice`, outside every
/// Slurm job cgroup (`job_<id>`, a SLUID, `slurmstepd.scope`, the fenced
/// subtree's gpufence cgroups), and every uid seen there is a system
/// account (up to `protected_uid_max`) or a service account some entry
/// names ([`gpufence_model::config::Config::is_system_or_service_uid`]).
/// The entry suggested covers those uids only
/// ([`ByCgroup::exempt_cgroups_line`]). A job's or a user's cgroup is
/// never suggested.
pub fn suggestion(node: &Node, cgroup: Option<&str>, uids: &[u32]) -> Result<String, String> {
    let Some(cg) = cgroup else {
        return Err("the cgroup is gone (a restarted unit: look at its successor)".into());
    };
    let parts: Vec<&str> = cg.split('/').filter(|s| !s.is_empty()).collect();
    if parts
        .iter()
        .any(|p| *p == "user.slice" || p.starts_with("user@") || p.starts_with("user-"))
    {
        return Err("a user's session or user manager".into());
    }
    if parts.iter().any(|p| {
        crate::host::slurm_cgroup::is_job_dir(p)
            || *p == "slurmstepd.scope"
            || p.ends_with("_slurmstepd.scope")
    }) {
        return Err("a Slurm job's cgroup: jobs get grants, never exemptions".into());
    }
    let gpufence_own = [
        node.exec_cgroup(),
        crate::join_cgroup(&node.cfg.cgroup_root, gpufence_model::config::REPORT_CGROUP),
        crate::join_cgroup(&node.cfg.cgroup_root, &node.cfg.mps_cgroup),
    ];
    if gpufence_own.iter().any(|o| crate::is_under(cg, o)) {
        return Err("one of gpufence's own cgroups".into());
    }
    let resolve = crate::host::fence_ops::exempt_resolver(node);
    if let Some(u) = uids
        .iter()
        .find(|u| !node.cfg.is_system_or_service_uid(**u, &resolve))
    {
        return Err(format!(
            "uid {u} is above protected_uid_max and no exempt_cgroups entry names it: not a system account"
        ));
    }
    // A person's uid at or below protected_uid_max (old RHEL's UID_MIN
    // 500) is never suggested: an exemption would cover their login shell.
    if let Some(u) = uids
        .iter()
        .find(|u| **u != 0 && node.users().is_login_account(**u))
    {
        return Err(format!(
            "uid {u} is a login account (a shell and a home of a person): never exempt a person"
        ));
    }
    let Some(unit) = parts.iter().position(|p| p.ends_with(".service")) else {
        return Err(
            "not in a service unit (a container's or session's scope has a new name each time)"
                .into(),
        );
    };
    Ok(parts[..=unit].join("/"))
}

/// Groups `denials` by cgroup id (count summed, users and devices
/// collected, the latest record's process kept), and suggests
/// exemptions for the system services among them ([`suggestion`]).
pub fn by_cgroup(node: &Node, denials: &[Denial]) -> ByCgroup {
    let mut groups: BTreeMap<u64, CgroupDenials> = BTreeMap::new();
    for d in denials {
        let g = groups.entry(d.cgroup_id).or_insert_with(|| CgroupDenials {
            cgroup: d.cgroup.clone(),
            cgroup_id: d.cgroup_id,
            count: 0,
            uids: Vec::new(),
            users: Vec::new(),
            devices: Vec::new(),
            access: Vec::new(),
            last_pid: d.last_pid,
            last_comm: d.last_comm.clone(),
            last_time: d.last_time.clone(),
            suggest: None,
            not_suggested: None,
        });
        g.count = g.count.saturating_add(d.count);
        if !g.uids.contains(&d.uid) {
            g.uids.push(d.uid);
            g.users
                .push(d.user.clone().unwrap_or_else(|| d.uid.to_string()));
        }
        if !g.devices.contains(&d.device) {
            g.devices.push(d.device.clone());
        }
        if !d.access.is_empty() && !g.access.contains(&d.access) {
            g.access.push(d.access.clone());
        }
        // RFC 3339 times of one clock, same format: text order is time order.
        if d.last_time > g.last_time {
            g.last_pid = d.last_pid;
            g.last_comm = d.last_comm.clone();
            g.last_time = d.last_time.clone();
        }
    }
    let mut cgroups: Vec<CgroupDenials> = groups.into_values().collect();
    let mut suggested = std::collections::BTreeSet::new();
    let mut users_of: BTreeMap<String, std::collections::BTreeSet<u32>> = BTreeMap::new();
    for g in &mut cgroups {
        let mut pairs: Vec<(u32, String)> = g
            .uids
            .iter()
            .copied()
            .zip(g.users.iter().cloned())
            .collect();
        pairs.sort();
        (g.uids, g.users) = pairs.into_iter().unzip();
        g.devices.sort();
        g.access.sort();
        match suggestion(node, g.cgroup.as_deref(), &g.uids) {
            Ok(s) if node.cfg.exempt_entry_covering(&s).is_some() => {
                g.not_suggested = Some(
                    "already in exempt_cgroups: denied while its unit restarted, before `gpufence fence watch` exempted its new cgroup".into(),
                );
            }
            Ok(s) => {
                users_of
                    .entry(s.clone())
                    .or_default()
                    .extend(g.uids.iter().copied());
                suggested.insert(s.clone());
                g.suggest = Some(s);
            }
            Err(why) => g.not_suggested = Some(why),
        }
    }
    cgroups.sort_by(|a, b| b.count.cmp(&a.count).then(a.cgroup_id.cmp(&b.cgroup_id)));
    let suggested: Vec<String> = suggested.into_iter().collect();
    // Each suggested entry covers the uids seen there (root alone: a
    // bare string).
    let all: Vec<String> = node
        .cfg
        .exempt_cgroups
        .iter()
        .cloned()
        .chain(suggested.iter().map(|s| {
            let uids = users_of.get(s).cloned().unwrap_or_default();
            if uids.is_empty() || uids == [0].into() {
                gpufence_model::config::ExemptEntry::root(s.as_str())
            } else {
                let users: Vec<gpufence_model::config::ExemptUser> = uids
                    .into_iter()
                    .map(gpufence_model::config::ExemptUser::Uid)
                    .collect();
                gpufence_model::config::ExemptEntry::with_users(s.as_str(), &users)
            }
        }))
        .map(|e| e.to_string())
        .collect();
    ByCgroup {
        cgroups,
        exempt_cgroups_line: format!("exempt_cgroups = [{}]", all.join(", ")),
        suggested,
    }
}

#[cfg(test)]
mod suggestion_tests {
    use super::*;
    use gpufence_model::config::{Config, ConfigOrigin};

    /// A denied service's uids are suggested only when none is a person's
    /// login account, whatever protected_uid_max says (review finding 9).
    #[test]
    fn a_persons_low_uid_is_never_suggested() {
        let d = tempfile::tempdir().unwrap();
        let passwd = d.path().join("passwd");
        std::fs::write(
            &passwd,
            "gpufence-p600:x:600:600::/home/p600:/bin/sh\n\
             gpufence-s601:x:601:601::/var/lib/s601:/usr/sbin/nologin\n",
        )
        .unwrap();
        let text = format!(
            "audit_log = \"{0}/a.jsonl\"\npasswd_file = \"{1}\"\n",
            d.path().display(),
            passwd.display()
        );
        let node = Node::new(
            Config::parse(&text, Path::new("t")).unwrap(),
            ConfigOrigin::Defaults,
        )
        .unwrap();
        let cg = Some("system.slice/x.service/sub");
        let e = suggestion(&node, cg, &[601, 600]).unwrap_err();
        assert!(e.contains("uid 600 is a login account"), "{e}");
        assert_eq!(
            suggestion(&node, cg, &[601, 0]).unwrap(),
            "system.slice/x.service"
        );
    }
}
