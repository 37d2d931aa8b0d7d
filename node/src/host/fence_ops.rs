//! Installing, inspecting and removing the fence, with audit lines.

use gpufence_cgroup::fence::{Fence, FenceSpec, FenceStatus, InstallReport};
use gpufence_model::audit::{events, AuditEvent};

use crate::{Node, NodeError};

/// The spec of the fence this node's config describes.
///
/// # Errors
/// [`NodeError`] when the protected majors cannot be determined.
pub fn spec(node: &Node) -> Result<FenceSpec, NodeError> {
    let mut plan = exempt_plan(node);
    let exempt = exempt_cgroups(node, &mut plan);
    Ok(FenceSpec {
        cgroup_root: node.cfg.cgroup_root.clone(),
        bpffs_dir: node.cfg.bpffs_dir.clone(),
        protected: node.protected_majors()?,
        exempt,
        max_grants: node.cfg.max_grants,
        max_denials: node.cfg.max_denials,
        audit: node.cfg.mode == gpufence_model::config::Mode::Audit,
        identities: plan.identities,
    })
}

/// Resolves the user names of `exempt_cgroups` entries: `passwd_file`
/// (when set) before glibc NSS ([`crate::host::users::Users`], NSS asked
/// for 2 s at most); `None` for a name neither knows (the entry then
/// covers no one by that name: never a wider set).
pub fn exempt_resolver(node: &Node) -> impl Fn(&str) -> Option<u32> + '_ {
    let users = node.users();
    move |name: &str| users.uid(name)
}

/// The exemptions' identity classes and each entry's class
/// ([`gpufence_model::config::Config::exempt_plan`]), names resolved by
/// [`exempt_resolver`].
pub fn exempt_plan(node: &Node) -> gpufence_model::config::ExemptPlan {
    node.cfg.exempt_plan(&exempt_resolver(node))
}

/// Whom the exemptions of each class cover (the program's immediates):
/// [`exempt_plan`]'s classes with the merged ones [`exempt_cgroups`] adds,
/// as [`spec`] computes them, so that the program a fresh install would
/// build (`fence status`, doctor, the running mode) is the one installed.
pub fn exempt_identities(node: &Node) -> gpufence_model::policy::ExemptIdentities {
    let mut plan = exempt_plan(node);
    let _ = exempt_cgroups(node, &mut plan);
    plan.identities
}

/// The configured exemption that covers a process of real uid `uid` in
/// `cg` (relative to the mount): the first `exempt_cgroups` entry `cg` is
/// in or under whose users hold `uid`
/// ([`gpufence_model::config::Config::exempt_entry_for`]).
pub fn exempt_entry_for<'a>(
    node: &'a Node,
    cg: &str,
    uid: u32,
) -> Option<&'a gpufence_model::config::ExemptEntry> {
    node.cfg.exempt_entry_for(cg, uid, &exempt_resolver(node))
}

/// Each user name of an `exempt_cgroups` entry that neither `passwd_file`
/// nor NSS knows, for the entries whose cgroup exists now (a service the
/// node runs): `(entry's cgroup, name)`. Such a name covers no one (the
/// entry covers its other users only); `fence install` audits them and
/// the CLI and the plugin print one warning line each. Entries of services
/// the node lacks (DCGM's `nvidia-dcgm` on a node without DCGM) say
/// nothing.
pub fn unknown_exempt_users(node: &Node) -> Vec<(String, String)> {
    let present: std::collections::BTreeSet<usize> = node
        .cfg
        .expand_exempt(|parent| child_cgroups(node, parent))
        .into_iter()
        .filter(|(p, _)| node.cg.path(p).is_dir())
        .map(|(_, i)| i)
        .collect();
    let resolve = exempt_resolver(node);
    node.cfg
        .exempt_cgroups
        .iter()
        .enumerate()
        .filter(|(i, _)| present.contains(i))
        .flat_map(|(_, e)| {
            let (_, unknown) = e.uids(&resolve);
            unknown.into_iter().map(|n| (e.cgroup.clone(), n))
        })
        .collect()
}

/// One line for an [`unknown_exempt_users`] pair.
pub fn unknown_exempt_user_line(cgroup: &str, name: &str) -> String {
    format!(
        "exempt_cgroups entry /{cgroup}: user {name:?} is unknown to passwd_file and NSS: it covers no one there (fail closed)"
    )
}

/// The cgroups to exempt now, each with its class: [`exempt_paths`], the
/// exec cgroup root only. A cgroup two entries name gets the class of
/// their users together (added to `plan`), or, when the classes are all
/// taken or the users together are more than one class holds
/// ([`ExemptIdentities::MAX_UIDS`](gpufence_model::policy::ExemptIdentities::MAX_UIDS)),
/// an index with no class (no one: fail closed; the program still fits).
pub fn exempt_cgroups(
    node: &Node,
    plan: &mut gpufence_model::config::ExemptPlan,
) -> Vec<gpufence_cgroup::fence::ExemptCgroup> {
    use gpufence_cgroup::fence::ExemptCgroup;
    use gpufence_model::policy::ExemptIdentities;
    let mut out: Vec<ExemptCgroup> = Vec::new();
    for (path, entry) in node.cfg.expand_exempt(|parent| child_cgroups(node, parent)) {
        let class = plan
            .entry_class
            .get(entry)
            .copied()
            .unwrap_or(ExemptIdentities::MAX_CLASSES as u32);
        match out.iter_mut().find(|e| e.path == path) {
            Some(e) if e.class != class => {
                let both: std::collections::BTreeSet<u32> = [e.class, class]
                    .iter()
                    .filter_map(|c| plan.identities.classes.get(*c as usize))
                    .flatten()
                    .copied()
                    .collect();
                e.class = if both.len() > ExemptIdentities::MAX_UIDS {
                    ExemptIdentities::MAX_CLASSES as u32
                } else {
                    plan.identities
                        .class_of(&both)
                        .unwrap_or(ExemptIdentities::MAX_CLASSES as u32)
                };
            }
            Some(_) => {}
            None => out.push(ExemptCgroup { path, class }),
        }
    }
    out.push(ExemptCgroup::root(node.exec_cgroup()));
    out
}

/// `cgroup_root` names an existing directory of the cgroup2 mount.
///
/// # Errors
/// [`NodeError::NoCgroupRoot`], naming the setting and the fix.
pub fn check_cgroup_root(node: &Node) -> Result<(), NodeError> {
    let path = node.cg.path(&node.cfg.cgroup_root);
    if path.is_dir() {
        return Ok(());
    }
    Err(NodeError::NoCgroupRoot {
        cgroup_root: node.cfg.cgroup_root.clone(),
        path,
        config: node.origin.to_string(),
    })
}

/// The exemptions the config asks for now (`exempt_cgroups`, each
/// pattern resolved to the cgroups that exist now by
/// [`gpufence_model::config::Config::expand_exempt`], and the exec
/// cgroup), relative to the cgroup2 mount.
pub fn exempt_paths(node: &Node) -> Vec<String> {
    node.cfg
        .expand_exempt(|parent| child_cgroups(node, parent))
        .into_iter()
        .map(|(p, _)| p)
        .chain(std::iter::once(node.exec_cgroup()))
        .collect()
}

/// The names of the child cgroups of `parent` (none when it does not
/// exist or cannot be read). systemd makes these (one per unit of a
/// slice); one `readdir`.
fn child_cgroups(node: &Node, parent: &gpufence_model::CgroupPath) -> Vec<String> {
    std::fs::read_dir(node.cg.path(parent.as_str()))
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// One configured exemption as the node has it now.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ExemptionState {
    /// The cgroup (relative to the mount; absolute in JSON).
    #[serde(serialize_with = "crate::host::cgpath::serialize")]
    pub cgroup: String,
    /// Its id now, when it exists.
    pub id: Option<u64>,
    /// Whether the fence holds that id as exempt.
    pub exempt: bool,
}

/// Each configured exemption: its id now, and whether `exempt_ids` (the
/// fence's exempt cgroup ids) holds it. A cgroup that exists but is not
/// exempt was made (or made again, with a new id: a restarted service)
/// after the fence learnt the exemptions.
pub fn exemption_states(node: &Node, exempt_ids: &[u64]) -> Vec<ExemptionState> {
    exempt_paths(node)
        .into_iter()
        .map(|p| {
            let id = node.cg.id(&p).ok();
            ExemptionState {
                exempt: id.is_some_and(|i| exempt_ids.contains(&i)),
                cgroup: p,
                id,
            }
        })
        .collect()
}

/// The problem line of an exemption that exists but is not in the fence.
pub fn missing_exemption_problem(e: &ExemptionState) -> String {
    format!(
        "exempt cgroup {} (id {}) is not in the fence (made or restarted since the fence learnt its exemptions): its processes are fenced; `gpufence fence watch` (gpufence-watch.service) puts it back within a second, or run `gpufence fence install`",
        crate::host::cgpath::abs(&e.cgroup),
        e.id.unwrap_or(0)
    )
}

/// How often [`watch_exemptions`] looks at the configured exemptions.
pub const WATCH_PERIOD: std::time::Duration = std::time::Duration::from_millis(250);

/// Keeps the configured exemptions in the fence: every [`WATCH_PERIOD`],
/// each configured exempt cgroup's id is read (one `stat` each); when one
/// that exists is not exempt in the fence (a service restarted: systemd
/// made its cgroup anew, with a new id), the exemptions are written again
/// ([`Fence::set_exempt`], the install's own step) and an
/// `exemption_applied` line says which. Runs until `stop` says so (checked
/// every period); a fence that is not attached is waited for. Errors are
/// audited once per kind and the watch goes on.
pub fn watch_exemptions(node: &Node, stop: &dyn Fn() -> bool) {
    let mut seen: Option<Vec<(String, Option<u64>)>> = None;
    let mut last_error: Option<String> = None;
    while !stop() {
        // Patterns are resolved anew each period: a unit of the family
        // started now is a new cgroup to exempt. User names only when
        // something is to be written (reapply_exemptions).
        let paths = exempt_paths(node);
        let ids: Vec<(String, Option<u64>)> = paths
            .iter()
            .map(|p| (p.clone(), node.cg.id(p).ok()))
            .collect();
        if seen.as_ref() != Some(&ids) {
            // Names as NSS answers now (an account made since the last
            // rewrite), not as this long-lived node first heard them.
            match reapply_exemptions(&node.afresh(), &paths) {
                Ok(()) => {
                    seen = Some(ids);
                    last_error = None;
                }
                Err(e) => {
                    let e = e.to_string();
                    if last_error.as_ref() != Some(&e) {
                        let _ = node.audit(
                            AuditEvent::new(events::ERROR)
                                .field("component", "fence watch")
                                .field("reason", e.clone()),
                        );
                        last_error = Some(e);
                    }
                }
            }
        }
        std::thread::sleep(WATCH_PERIOD);
    }
}

/// One pass of [`watch_exemptions`]: writes the exemptions again, each
/// with its identity class ([`exempt_cgroups`], user names resolved now),
/// when an existing configured cgroup of `paths` is not exempt in the
/// fence. When the running program's classes are not those (an account's
/// name resolves otherwise than at install: the program's tag differs,
/// [`running_mode`] is `Other`), the fence is installed again
/// ([`install`]) instead, so that no cgroup gets a class the program
/// reads otherwise.
///
/// # Errors
/// [`NodeError`]: the fence is not attached, or its maps cannot be
/// written.
pub fn reapply_exemptions(node: &Node, paths: &[String]) -> Result<(), NodeError> {
    let fence = open_installed(node)?;
    let exempt_before: Vec<u64> = paths
        .iter()
        .filter_map(|p| node.cg.id(p).ok())
        .filter(|id| fence.is_exempt(*id).unwrap_or(false))
        .collect();
    if paths
        .iter()
        .filter_map(|p| node.cg.id(p).ok())
        .all(|id| exempt_before.contains(&id))
    {
        return Ok(());
    }
    if running_mode(node) == RunningMode::Other {
        install(node)?;
        return Ok(());
    }
    let mut plan = exempt_plan(node);
    // The patterns are resolved again for the write, and what it made
    // exempt is read under the fence lock: a unit started since `paths`
    // was read is named, one another writer exempted first is not.
    let split = fence.set_exempt(&node.cg, &exempt_cgroups(node, &mut plan))?;
    if split.newly.is_empty() {
        return Ok(());
    }
    node.audit(
        AuditEvent::new(events::EXEMPTION_APPLIED).field(
            "exempt",
            split
                .newly
                .iter()
                .map(|(p, id)| serde_json::json!({"cgroup": crate::host::cgpath::abs(p), "cgroup_id": id}))
                .collect::<Vec<_>>(),
        ),
    )?;
    Ok(())
}

/// Installs or re-installs the fence and writes `fence_installed`; when
/// it cannot, writes one `error` line (`component` "fence install",
/// `reason`) and returns the error ([`Fence::install`] has removed what
/// the try made).
///
/// # Errors
/// [`NodeError`]: the fence is not installed (or the old one stays) and the
/// message says why.
pub fn install(node: &Node) -> Result<InstallReport, NodeError> {
    check_cgroup_root(node)?;
    // The exempt cgroup of `gpufence exec` exists from the install on.
    if node.cg.path(&node.cfg.cgroup_root).is_dir() {
        let _ = node.cg.create(&node.exec_cgroup());
    }
    let installed = spec(node).and_then(|spec| Ok(Fence::install(&node.cg, &spec)?));
    let (_fence, report) = match installed {
        Ok(r) => r,
        Err(e) => {
            // One line, whatever failed: the fence is not (re)installed, an
            // earlier one stays as it was, and nothing of this try is left.
            let _ = node.audit(
                AuditEvent::new(events::ERROR)
                    .field("component", "fence install")
                    .field(
                        "cgroup_root",
                        crate::host::cgpath::abs(&node.cfg.cgroup_root),
                    )
                    .field("bpffs_dir", node.cfg.bpffs_dir.display().to_string())
                    .field("reason", e.to_string()),
            );
            return Err(e);
        }
    };
    let mut ev = AuditEvent::new(events::FENCE_INSTALLED)
        .field(
            "cgroup_root",
            crate::host::cgpath::abs(&node.cfg.cgroup_root),
        )
        .field("protected_majors", report.majors.clone())
        .field("prog_id", report.prog_id)
        .field("link_id", report.link_id)
        .field("replaced_program", report.replaced_program)
        .field("mode", format!("{:?}", node.cfg.mode).to_lowercase())
        .field(
            "exempt",
            report
                .exempt_applied
                .iter()
                .map(|(p, _)| p.clone())
                .collect::<Vec<_>>(),
        )
        .field("exempt_missing", report.exempt_missing.clone())
        .field("mount_root_level", report.mount_root_level);
    let unknown = unknown_exempt_users(node);
    if !unknown.is_empty() {
        ev = ev.field(
            "exempt_unknown_users",
            unknown
                .iter()
                .map(|(c, n)| serde_json::json!({"cgroup": crate::host::cgpath::abs(c), "user": n}))
                .collect::<Vec<_>>(),
        );
    }
    if !report.relevelled.is_empty() {
        // Entries an earlier version recorded at a cgroup namespace's depth.
        ev = ev.field(
            "relevelled",
            report
                .relevelled
                .iter()
                .map(|(p, id, from, to)| {
                    serde_json::json!({
                        "cgroup": crate::host::cgpath::abs(p),
                        "cgroup_id": id,
                        "recorded_level": from,
                        "kernel_level": to,
                    })
                })
                .collect::<Vec<_>>(),
        );
    }
    node.audit(ev)?;
    Ok(report)
}

/// What the attached fence program does, found by comparing its tag with
/// the tags of the two programs this version builds (`bpf_prog_calc_tag`:
/// the instructions with map references zeroed, so the same program over
/// the same maps has the same tag).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RunningMode {
    /// This version's enforcing program: it denies.
    Enforce,
    /// This version's audit program: it records and allows everything.
    Audit,
    /// Another program (an older or newer gpufence).
    Other,
    /// No program attached, or it could not be read.
    Unknown,
}

impl std::fmt::Display for RunningMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RunningMode::Enforce => "enforce",
            RunningMode::Audit => "audit",
            RunningMode::Other => "other (not this version's program)",
            RunningMode::Unknown => "unknown",
        })
    }
}

/// The mode of the program attached through the pinned link (see
/// [`RunningMode`]). Loads the two candidate programs (never attached) to
/// learn their tags.
pub fn running_mode(node: &Node) -> RunningMode {
    let Some(id) = Fence::linked_prog_id(&node.cfg.bpffs_dir) else {
        return RunningMode::Unknown;
    };
    let Ok(fence) = Fence::open(&node.cfg.bpffs_dir) else {
        return RunningMode::Unknown;
    };
    let Ok(info) = gpufence_cgroup::sys::prog_fd_by_id(id)
        .and_then(|fd| gpufence_cgroup::sys::prog_info(std::os::fd::AsFd::as_fd(&fd)))
    else {
        return RunningMode::Unknown;
    };
    let ids = exempt_identities(node);
    if fence
        .fresh_program_tag(false, &ids)
        .is_ok_and(|t| t == info.tag)
    {
        RunningMode::Enforce
    } else if fence
        .fresh_program_tag(true, &ids)
        .is_ok_and(|t| t == info.tag)
    {
        RunningMode::Audit
    } else {
        RunningMode::Other
    }
}

/// [`status_with_mode`] without the mode.
pub fn status(node: &Node) -> FenceStatus {
    status_with_mode(node).0
}

/// Status of this node's fence, and the running program's mode. Besides
/// what the kernel objects say, an NVIDIA major registered since the
/// install (a driver loaded later) and not protected is a problem: the fence
/// is then not installed as configured. So is a running program in another
/// mode than the config's, or not this version's.
pub fn status_with_mode(node: &Node) -> (FenceStatus, RunningMode) {
    let mut st = Fence::status(&node.cg, &node.cfg.cgroup_root, &node.cfg.bpffs_dir);
    if let Err(e) = check_cgroup_root(node) {
        st.problems.insert(0, e.to_string());
    }
    let mode = running_mode(node);
    let want = if node.cfg.mode == gpufence_model::config::Mode::Audit {
        RunningMode::Audit
    } else {
        RunningMode::Enforce
    };
    if st.prog_id.is_some() && mode != want {
        st.problems.push(match mode {
            RunningMode::Audit => "the fence runs in AUDIT mode: it records and allows every open; the config says enforce: run `gpufence fence install`".to_string(),
            RunningMode::Enforce => "the fence runs in enforce mode; the config says audit: run `gpufence fence install` to switch".to_string(),
            _ => "the attached program is not the one this version builds (another gpufence version): run `gpufence fence install`".to_string(),
        });
    }
    if st.prog_id.is_some() {
        if let Ok(want) = node.protected_majors() {
            for m in want.majors().filter(|m| !st.protected_majors.contains(m)) {
                st.problems.push(format!(
                    "major {m} ({}) is registered but not protected: run `gpufence fence install`",
                    want.names(m).collect::<Vec<_>>().join(", ")
                ));
                st.installed = false;
            }
        }
    }
    for l in crate::host::exec_cgroup::stale_leaves(node) {
        st.problems
            .push(crate::host::exec_cgroup::stale_leaf_problem(&l));
    }
    if st.prog_id.is_some() {
        for e in exemption_states(node, &st.exempt_cgroup_ids) {
            if e.id.is_some() && !e.exempt {
                st.problems.push(missing_exemption_problem(&e));
            }
        }
    }
    (st, mode)
}

/// Opens the fence's maps, refusing when the fence is not attached at
/// `cgroup_root` (a grant into maps nobody reads would be a lie). Cheap: it
/// does not walk the maps. It also protects NVIDIA majors registered since
/// the install (a driver loaded later) and audits that.
///
/// # Errors
/// [`NodeError::FenceMissing`].
pub fn open_installed(node: &Node) -> Result<Fence, NodeError> {
    Fence::check_attached(&node.cg, &node.cfg.cgroup_root, &node.cfg.bpffs_dir).map_err(|e| {
        NodeError::FenceMissing {
            detail: e.to_string(),
        }
    })?;
    let fence = Fence::open(&node.cfg.bpffs_dir)?;
    let want: Vec<u32> = node.protected_majors()?.majors().collect();
    let added = fence.add_majors(&want)?;
    if !added.is_empty() {
        node.audit(
            AuditEvent::new(events::MAJORS_ADDED)
                .field("majors", added)
                .field(
                    "why",
                    "registered after the fence was installed (driver loaded later)",
                ),
        )?;
    }
    Ok(fence)
}

/// Removes the fence and writes `fence_removed`. Returns whether anything
/// was installed.
///
/// # Errors
/// [`NodeError`] when a pin cannot be removed.
pub fn remove(node: &Node) -> Result<bool, NodeError> {
    // Only the fence attached where the config says: a link attached at
    // another cgroup (a wrong cgroup_root) may be the node's working fence.
    match Fence::check_attached(&node.cg, &node.cfg.cgroup_root, &node.cfg.bpffs_dir) {
        Ok(()) => {}
        Err(
            gpufence_cgroup::fence::NotAttached::Elsewhere { .. }
            | gpufence_cgroup::fence::NotAttached::Root(_),
        ) => {
            let attached = Fence::status(&node.cg, &node.cfg.cgroup_root, &node.cfg.bpffs_dir)
                .link_cgroup_id
                .map(|id| {
                    node.cg
                        .kernel_levels()
                        .ok()
                        .and_then(|l| l.get(&id).map(|(p, _)| crate::host::cgpath::abs(p)))
                        .unwrap_or_else(|| format!("cgroup id {id}"))
                })
                .unwrap_or_else(|| "another cgroup".into());
            return Err(NodeError::FenceNotHere {
                bpffs_dir: node.cfg.bpffs_dir.clone(),
                attached,
                cgroup_root: node.cfg.cgroup_root.clone(),
                config: node.origin.to_string(),
            });
        }
        // No pin, a detached link: what is left is removed.
        Err(_) => {}
    }
    let found = Fence::remove(&node.cfg.bpffs_dir)?;
    if found {
        node.audit(
            AuditEvent::new(events::FENCE_REMOVED)
                .field(
                    "cgroup_root",
                    crate::host::cgpath::abs(&node.cfg.cgroup_root),
                )
                .field("bpffs_dir", node.cfg.bpffs_dir.display().to_string()),
        )?;
    }
    Ok(found)
}

/// The line for the admin when slurmd runs in a fenced cgroup that no
/// `exempt_cgroups` entry covers (found at slurmd start from slurmd's own
/// cgroup, `slurmd_cgroup`, relative to the mount): slurmd's own NVML
/// autodetection and everything slurmd runs there (the Prolog and Epilog
/// outside `PrologFlags=RunInJob`) are then fenced like any user process,
/// so the Prolog's NVML checks and `AutoDetect=nvml` fail. `None` when it
/// is exempt or outside the fenced subtree. Exemptions stay what the
/// config says: this names the cgroup, it never adds one.
pub fn slurmd_exemption_note(node: &Node, slurmd_cgroup: &str) -> Option<String> {
    // slurmd runs as root: an entry that covers its cgroup must name root
    // (this process's real uid), as the fence program asks.
    slurmd_exemption_note_for(node, slurmd_cgroup, nix::unistd::getuid().as_raw())
}

/// [`slurmd_exemption_note`] for slurmd running as `uid`.
fn slurmd_exemption_note_for(node: &Node, slurmd_cgroup: &str, uid: u32) -> Option<String> {
    let root = &node.cfg.cgroup_root;
    if !crate::is_under(slurmd_cgroup, root) {
        return None;
    }
    if exempt_entry_for(node, slurmd_cgroup, uid).is_some() {
        return None;
    }
    Some(format!(
        "slurmd runs in {}, which no exempt_cgroups entry covers for uid {uid}: its NVML autodetection and the Prolog's and Epilog's NVML checks are fenced there; \
         add \"{}\" to exempt_cgroups in {}",
        crate::host::cgpath::abs(slurmd_cgroup),
        slurmd_cgroup,
        match &node.origin {
            gpufence_model::config::ConfigOrigin::File(p) => p.display().to_string(),
            gpufence_model::config::ConfigOrigin::Defaults =>
                gpufence_model::config::DEFAULT_CONFIG_PATH.to_string(),
        }
    ))
}

#[cfg(test)]
mod slurmd_exemption_tests {
    use super::*;
    use gpufence_model::config::{Config, ConfigOrigin};

    /// A node of config `extra`, its audit log in `dir`.
    fn node_from(dir: &std::path::Path, extra: &str) -> Node {
        let text = format!("audit_log = \"{}/a.jsonl\"\n{extra}", dir.display());
        Node::new(
            Config::parse(&text, std::path::Path::new("t")).unwrap(),
            ConfigOrigin::Defaults,
        )
        .unwrap()
    }

    #[test]
    fn slurmd_outside_every_exemption_is_named() {
        let d = tempfile::tempdir().unwrap();
        let node = |extra: &str| node_from(d.path(), extra);
        let n = node("");
        // slurmd runs as root (uid 0 here, whoever runs the test): systemd's
        // unit, and 26.05's own move below it, are covered; the bare entry
        // covers root alone, so slurmd as any other uid is not.
        assert!(slurmd_exemption_note_for(&n, "system.slice/slurmd.service", 1001).is_some());
        assert_eq!(
            slurmd_exemption_note_for(&n, "system.slice/slurmd.service", 0),
            None
        );
        assert_eq!(
            slurmd_exemption_note_for(&n, "system.slice/slurmd.service/slurmd", 0),
            None
        );
        let l = slurmd_exemption_note_for(&n, "system.slice/slurmd@gpu1.service", 0).unwrap();
        assert!(
            l.contains("/system.slice/slurmd@gpu1.service")
                && l.contains("add \"system.slice/slurmd@gpu1.service\" to exempt_cgroups"),
            "{l}"
        );
        // Outside the fenced subtree nothing is fenced.
        let n = node("cgroup_root = \"system.slice/x_slurmstepd.scope\"\n");
        assert_eq!(
            slurmd_exemption_note_for(&n, "system.slice/slurmd-x.service", 0),
            None
        );
        let n = node("exempt_cgroups = [\"/system.slice/slurmd@gpu1.service/\"]\n");
        assert_eq!(
            slurmd_exemption_note_for(&n, "system.slice/slurmd@gpu1.service", 0),
            None
        );
        // An entry for slurmd that does not name root does not cover it.
        let n = node(
            "exempt_cgroups = [{ cgroup = \"system.slice/slurmd.service\", users = [1500] }]\n",
        );
        assert!(slurmd_exemption_note_for(&n, "system.slice/slurmd.service", 0).is_some());
    }

    /// A cgroup two entries name is exempt for their users together; the
    /// exec cgroup for root only.
    #[test]
    fn a_cgroup_two_entries_name_gets_both_their_users() {
        let d = tempfile::tempdir().unwrap();
        let node = node_from(
            d.path(),
            "exempt_cgroups = [\"a.service\", { cgroup = \"b.service\", users = [1500] }, \
             { cgroup = \"a.service\", users = [1500] }]\n",
        );
        let mut plan = exempt_plan(&node);
        let cgs = exempt_cgroups(&node, &mut plan);
        let class = |p: &str| cgs.iter().find(|c| c.path == p).unwrap().class;
        let uids = |c: u32| plan.identities.classes[c as usize].clone();
        assert_eq!(uids(class("a.service")), [0, 1500].into());
        assert_eq!(uids(class("b.service")), [1500].into());
        assert_eq!(uids(class(&node.exec_cgroup())), [0].into());
        assert_eq!(cgs.len(), 3);
        // The identities doctor, `fence status` and the running mode
        // compare with are the installed program's, merged class included
        // (they were the plan's alone, so such a config read as a program
        // gpufence did not build: `fence_not_enforcing`).
        let installed = plan.identities.clone();
        assert_eq!(exempt_identities(&node), installed);
        assert!(exempt_identities(&node).classes.contains(&[0, 1500].into()));
    }

    /// Two entries for one cgroup whose users together are more than a
    /// class holds: that cgroup covers no one (fail closed), and the
    /// program's classes still fit, so the install goes on.
    #[test]
    fn a_merge_past_a_class_covers_no_one() {
        let d = tempfile::tempdir().unwrap();
        let node = node_from(
            d.path(),
            "exempt_cgroups = [\
             { cgroup = \"a.service\", users = [1501, 1502, 1503, 1504, 1505] }, \
             { cgroup = \"a.service\", users = [1506, 1507, 1508, 1509, 1510] }]\n",
        );
        let mut plan = exempt_plan(&node);
        let cgs = exempt_cgroups(&node, &mut plan);
        let a = cgs.iter().find(|c| c.path == "a.service").unwrap();
        assert!(plan.identities.classes.get(a.class as usize).is_none());
        assert!(plan.identities.fits(), "{:?}", plan.identities);
        assert!(!plan.identities.covers(a.class, 1501));
        assert!(!plan.identities.covers(a.class, 0));
    }

    /// One resolver per run: the node and its clones ask once and keep the
    /// answer (an Epilog's candidates × devices); `afresh` asks again (the
    /// long-lived `fence watch`, per rewrite).
    #[test]
    fn names_are_resolved_once_per_run() {
        let d = tempfile::tempdir().unwrap();
        let passwd = d.path().join("passwd");
        std::fs::write(&passwd, "gpufence-svc-t:x:1501:1501::/:/bin/sh\n").unwrap();
        let node = node_from(
            d.path(),
            &format!(
                "passwd_file = \"{}\"\nexempt_cgroups = [{{ cgroup = \"a.service\", users = [\"gpufence-svc-t\"] }}]\n",
                passwd.display()
            ),
        );
        let resolve = exempt_resolver(&node);
        assert_eq!(resolve("gpufence-svc-t"), Some(1501));
        let clone = node.for_slurm_node(Some("n1"));
        assert!(
            std::ptr::eq(node.users(), clone.users()),
            "clones share one resolver"
        );
        std::fs::write(&passwd, "gpufence-svc-t:x:1502:1502::/:/bin/sh\n").unwrap();
        assert!(
            exempt_entry_for(&clone, "a.service", 1501).is_some(),
            "the run's answer is kept"
        );
        let fresh = node.afresh();
        assert!(!std::ptr::eq(node.users(), fresh.users()));
        assert!(exempt_entry_for(&fresh, "a.service", 1502).is_some());
        assert!(exempt_entry_for(&fresh, "a.service", 1501).is_none());
    }
}
