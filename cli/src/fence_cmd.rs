//! `gpufence fence install|watch|status|remove`.

use std::process::ExitCode;

use serde_json::json;

use gpufence_node::{admin::grants, host::fence_ops, Node, NodeError};

/// `gpufence fence install`: what was attached, exempt and corrected.
pub(crate) fn run_fence_install(node: &Node) -> Result<ExitCode, NodeError> {
    let r = fence_ops::install(node)?;
    println!(
        "fence {} at /{} (program {}, link {}); protected majors {:?}",
        if r.replaced_program {
            "updated"
        } else {
            "installed"
        },
        node.cfg.cgroup_root,
        r.prog_id,
        r.link_id,
        r.majors
    );
    for (p, id) in &r.exempt_applied {
        println!("exempt: /{p} (cgroup id {id})");
    }
    for p in &r.exempt_missing {
        println!("exempt cgroup /{p} does not exist yet: not exempt until the next install");
    }
    for (c, n) in fence_ops::unknown_exempt_users(node) {
        println!("warning: {}", fence_ops::unknown_exempt_user_line(&c, &n));
    }
    if r.mount_root_level > 0 {
        println!(
            "cgroup namespace: paths here start {} level(s) below the hierarchy's root; grants are recorded at kernel levels",
            r.mount_root_level
        );
    }
    for (p, id, from, to) in &r.relevelled {
        println!(
            "corrected: /{p} (cgroup id {id}) was recorded at level {from}, the kernel has it at level {to}"
        );
    }
    for n in &r.notes {
        println!("note: {n}");
    }
    for w in gpufence_node::host::accounts::host_range_warnings(&node.cfg) {
        println!("warning: {w}");
    }
    // Once, where the admin sets the node up (not on every status or sweep).
    if let Some(n) =
        gpufence_node::holders::scan::io_uring_exposure(std::path::Path::new("/proc/sys"))
    {
        println!("note: {n}");
    }
    Ok(ExitCode::SUCCESS)
}

static STOP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_stop(_: libc::c_int) {
    STOP.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// `gpufence fence watch`: [`fence_ops::watch_exemptions`] until SIGTERM
/// or SIGINT; exit 0.
pub(crate) fn run_fence_watch(node: &Node) -> ExitCode {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: a handler that only stores to an atomic.
        unsafe { libc::signal(sig, on_stop as *const () as libc::sighandler_t) };
    }
    fence_ops::watch_exemptions(node, &|| STOP.load(std::sync::atomic::Ordering::SeqCst));
    ExitCode::SUCCESS
}

/// `gpufence fence status`: exit 1 when the fence is not installed.
pub(crate) fn run_fence_status(node: &Node, json: bool) -> ExitCode {
    let (st, mode) = fence_ops::status_with_mode(node);
    // Each configured exemption: its id now, and whether the fence has it.
    let exempt: Vec<serde_json::Value> =
        fence_ops::exemption_states(node, &st.exempt_cgroup_ids)
            .into_iter()
            .map(|e| json!({"cgroup": gpufence_node::host::cgpath::abs(&e.cgroup), "id": e.id, "exempt": e.exempt}))
            .collect();
    // Slurm's scope's IMEX mknod grant is the node's, not a job's.
    let jobs: std::collections::BTreeSet<u32> = grants::list(node)
        .map(|g| {
            g.into_iter()
                .map(|c| c.job_id)
                .filter(|j| *j != gpufence_node::job::imex::SCOPE_GRANT_JOB_ID)
                .collect()
        })
        .unwrap_or_default();
    let io_uring =
        gpufence_node::holders::scan::io_uring_exposure(std::path::Path::new("/proc/sys"));
    let mut warnings = gpufence_node::host::accounts::host_range_warnings(&node.cfg);
    let timeouts = gpufence_node::job::timeouts::host_report(&node.cfg);
    warnings.extend(timeouts.warnings.iter().cloned());
    if json {
        let v = json!({
            "installed": st.installed,
            "unpinned_programs": st.unpinned_programs,
            "mode": mode,
            "cgroup_root": format!("/{}", st.cgroup_root),
            "cgroup_root_id": st.root_cgroup_id,
            "bpffs_dir": node.cfg.bpffs_dir,
            "link_id": st.link_id,
            "prog_id": st.prog_id,
            "protected_majors": st.protected_majors,
            "grants": st.grants,
            "grant_jobs": jobs.len(),
            "mount_root_level": st.mount_root_level,
            "exempt": exempt,
            "problems": st.problems,
            "warnings": warnings,
            "timeouts": timeouts,
            "io_uring": io_uring,
            "config": node.origin.to_string(),
        });
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    } else {
        println!(
            "fence: {}\nmode: {mode}\ncgroup_root: /{}\nprotected majors: {:?}\ngrants: {} device entries for {} job(s)\nconfig: {}",
            if st.installed {
                "installed".to_string()
            } else if st.prog_id.is_none() && !st.unpinned_programs.is_empty() {
                format!(
                    "ATTACHED (program {}), but its pins are not visible here",
                    st.unpinned_programs
                        .iter()
                        .map(u32::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            } else {
                "NOT INSTALLED".to_string()
            },
            st.cgroup_root,
            st.protected_majors,
            st.grants,
            jobs.len(),
            node.origin
        );
        if let Some(n) = st.mount_root_level.filter(|n| *n > 0) {
            println!(
                "cgroup namespace: paths here start {n} level(s) below the hierarchy's root (cgroup_root /{} is at kernel level {})",
                st.cgroup_root,
                n + gpufence_cgroup::hierarchy::level_of(&st.cgroup_root)
            );
        }
        for e in &exempt {
            println!(
                "exempt: {} {}",
                e["cgroup"].as_str().unwrap_or(""),
                match (e["id"].as_u64(), e["exempt"].as_bool()) {
                    (None, _) => "(does not exist: not exempt)".to_string(),
                    (Some(id), Some(true)) => format!("(id {id})"),
                    (Some(id), _) => format!("(id {id}, NOT in the fence: see the problem below)"),
                }
            );
        }
        for p in &st.problems {
            println!("problem: {}", gpufence_model::text::printable(p));
        }
        for w in &warnings {
            println!("warning: {}", gpufence_model::text::printable(w));
        }
        if let Some(f) = &timeouts.epilog_fits {
            println!("note: {}", gpufence_model::text::printable(f));
        }
        // The io_uring note is said by `fence install` and `doctor`, not on
        // every status (a timer's journal); JSON keeps it.
    }
    // NHC and monitoring read the code: 0 only for a fence installed as
    // the config says.
    if st.installed && st.problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `gpufence fence remove`: refused (exit 2) while jobs hold grants, unless
/// `force`.
pub(crate) fn run_fence_remove(node: &Node, force: bool) -> Result<ExitCode, NodeError> {
    let jobs: std::collections::BTreeSet<u32> = grants::list(node)
        .map(|g| g.into_iter().map(|c| c.job_id).collect())
        .unwrap_or_default();
    if !jobs.is_empty() && !force {
        eprintln!(
            "gpufence: {} running job(s) hold grants (job {}); removing the fence ends their isolation. Drain the node first, or pass --force",
            jobs.len(),
            jobs.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
        );
        return Ok(ExitCode::from(2));
    }
    let found = fence_ops::remove(node)?;
    println!(
        "{}",
        if found {
            "fence removed: NVIDIA devices are no longer guarded on this node"
        } else {
            "no fence was installed"
        }
    );
    Ok(ExitCode::SUCCESS)
}
