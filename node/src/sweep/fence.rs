//! Checks of the fence itself: drift from the config, stale grants, new denials.

use std::collections::{BTreeMap, BTreeSet};

use gpufence_cgroup::fence::{Fence, GrantEntry};
use gpufence_model::audit::{events, AuditEvent};
use gpufence_model::device::DevNum;
use serde_json::json;

use super::state::{new_denials, read_json, write_json, DenialState};
use super::{check_failed, dev_list, Finding, Kind, Severity, Sweep};
use crate::host::denials;

impl Sweep<'_> {
    /// The fence attached, its majors against the node's. Returns the
    /// node's protected majors.
    pub(super) fn drift(&mut self) -> BTreeSet<u32> {
        self.attachment();
        self.own_cgroups();
        self.exemptions();
        self.majors()
    }

    /// Whether the fence is attached and in the configured mode (sets
    /// `report.fence_installed`, `audit` and `fence`).
    fn attachment(&mut self) {
        let node = self.node;
        let attached = Fence::check_attached(&node.cg, &node.cfg.cgroup_root, &node.cfg.bpffs_dir);
        self.report.fence_installed = attached.is_ok();
        // A gpufence program the kernel has at cgroup_root whose pins this
        // sweep cannot see still enforces: say that, not "every process may
        // open every GPU".
        let unseen = attached
            .as_ref()
            .err()
            .and_then(|_| {
                gpufence_cgroup::fence::fence_programs_at(&node.cg, &node.cfg.cgroup_root).ok()
            })
            .filter(|ids| !ids.is_empty());
        if let Some(ids) = &unseen {
            self.findings.push(check_failed(
                "fence pins",
                format!(
                    "a gpufence program (id {ids:?}) is attached at /{} and enforces, but its pins are not visible in {} (bpffs mounted elsewhere, a private mount namespace, or another bpffs_dir): run the sweep where they are",
                    node.cfg.cgroup_root,
                    node.cfg.bpffs_dir.display()
                ),
            ));
        } else if let Err(detail) = &attached {
            self.findings.push(Finding::new(
                Kind::FenceNotAttached,
                format!(
                    "the fence is not attached at /{}: {detail}: every process may open every GPU; run `gpufence fence install`",
                    node.cfg.cgroup_root
                ),
                json!({
                    "cgroup_root": crate::host::cgpath::abs(&node.cfg.cgroup_root),
                    "bpffs_dir": node.cfg.bpffs_dir, "detail": detail.to_string(),
                }),
            ));
        }
        self.audit = node.cfg.mode == gpufence_model::config::Mode::Audit;
        if attached.is_ok() {
            let mode = crate::host::fence_ops::running_mode(node);
            match mode {
                crate::host::fence_ops::RunningMode::Audit => self.audit = true,
                crate::host::fence_ops::RunningMode::Enforce => self.audit = false,
                _ => {}
            }
            let want = if node.cfg.mode == gpufence_model::config::Mode::Audit {
                crate::host::fence_ops::RunningMode::Audit
            } else {
                crate::host::fence_ops::RunningMode::Enforce
            };
            if mode != want {
                self.findings.push(Finding::new(
                    Kind::FenceNotEnforcing,
                    format!(
                        "the attached fence program runs in mode {mode}, the config asks for {}: run `gpufence fence install`",
                        if want == crate::host::fence_ops::RunningMode::Audit { "audit" } else { "enforce" }
                    ),
                    json!({"running_mode": mode, "config_mode": format!("{:?}", node.cfg.mode).to_lowercase()}),
                ));
            }
        }
        self.fence = match Fence::open(&node.cfg.bpffs_dir) {
            Ok(f) => Some(f),
            Err(e) => {
                if attached.is_ok() {
                    self.findings
                        .push(check_failed("fence maps", e.to_string()));
                }
                None
            }
        };
    }

    /// gpufence's own cgroups: exec leaves left by a process that is gone,
    /// foreign processes in MPS daemon cgroups, MPS registrations of jobs
    /// that have ended (removed here).
    fn own_cgroups(&mut self) {
        let node = self.node;
        for l in crate::host::exec_cgroup::stale_leaves(node) {
            self.findings.push(Finding::new(
                Kind::ExecLeftover,
                crate::host::exec_cgroup::stale_leaf_problem(&l),
                json!({"cgroup": crate::host::cgpath::abs(&l.cgroup), "pids": l.pids}),
            ));
        }
        for p in crate::host::mps_cgroups::foreign_processes(node) {
            let mut f = Finding::new(
                Kind::MpsForeignProcess,
                format!(
                    "process {} of uid {} runs in MPS daemon cgroup {}, granted its GPU, which serves {} only: the next gres/mps Prolog or Epilog ends it (`gpufence respond {}` now)",
                    p.pid,
                    p.uid,
                    crate::host::cgpath::abs(&p.cgroup),
                    p.daemon_uid.map_or("root".to_string(), |u| format!("uid {u}")),
                    p.pid
                ),
                json!({"daemon_uid": p.daemon_uid}),
            );
            f.pid = Some(p.pid);
            f.uid = Some(p.uid);
            f.cgroup = Some(crate::host::cgpath::abs(&p.cgroup));
            self.findings.push(f);
        }
        for d in crate::host::mps_cgroups::sweep_stale(node, self.fence.as_ref()) {
            let mut f = Finding::new(
                Kind::StaleGrant,
                format!(
                    "MPS daemon {} had registrations of job(s) {:?} that have no record and no Prolog running (their Epilog will not release them): removed",
                    d.name, d.jobs
                ),
                json!({"mps_daemon": d.name, "job_ids": d.jobs}),
            );
            f.uid = crate::host::mps_cgroups::parse_daemon(&d.name).map(|(_, u)| u);
            f.cgroup = Some(crate::host::cgpath::abs(
                &crate::host::mps_cgroups::daemon_cgroup(node, &d.name),
            ));
            f.action = Some(match &d.stopped {
                None => "registrations removed; other jobs still use the daemon".to_string(),
                Some(Ok(killed)) => format!(
                    "registrations removed; the daemon, used by no job, stopped (grant revoked, processes {killed:?} killed)"
                ),
                Some(Err(e)) => {
                    f.severity = Severity::High;
                    format!("registrations removed; stopping the daemon failed: {e}")
                }
            });
            self.findings.push(f);
        }
    }

    /// Each configured exemption whose cgroup exists and is not exempt in
    /// the fence (a service restarted since the install or the last
    /// `fence watch` pass).
    fn exemptions(&mut self) {
        let node = self.node;
        if let Some(f) = &self.fence {
            let exempt: Vec<u64> = f
                .cgroup_flags()
                .map(|c| {
                    c.into_iter()
                        .filter(|(_, fl)| fl & gpufence_cgroup::maps::CGROUP_EXEMPT != 0)
                        .map(|(id, _)| id)
                        .collect()
                })
                .unwrap_or_default();
            for e in crate::host::fence_ops::exemption_states(node, &exempt) {
                if e.id.is_some() && !e.exempt {
                    self.findings.push(Finding::new(
                        Kind::ExemptionMissing,
                        crate::host::fence_ops::missing_exemption_problem(&e),
                        json!({"cgroup": crate::host::cgpath::abs(&e.cgroup), "cgroup_id": e.id}),
                    ));
                }
            }
        }
    }

    /// The node's protected majors against the fence's. Returns the
    /// node's.
    fn majors(&mut self) -> BTreeSet<u32> {
        let node = self.node;
        let want = match node.protected_majors() {
            Ok(p) => p,
            Err(e) => {
                self.findings
                    .push(check_failed("protected majors", e.to_string()));
                return BTreeSet::new();
            }
        };
        let want_set: BTreeSet<u32> = want.majors().collect();
        let Some(f) = &self.fence else {
            return want_set;
        };
        let have: BTreeSet<u32> = match f.protected_majors() {
            Ok(h) => h.into_iter().collect(),
            Err(e) => {
                self.findings
                    .push(check_failed("fence majors", e.to_string()));
                return want_set;
            }
        };
        for m in want_set.difference(&have) {
            let names: Vec<&str> = want.names(*m).collect();
            self.findings.push(Finding::new(
                Kind::UnprotectedMajor,
                format!(
                    "major {m} ({}) is an NVIDIA driver's but the fence does not protect it (driver reloaded since install?): run `gpufence fence install`",
                    names.join(",")
                ),
                json!({"major": m, "names": names, "fence_majors": have}),
            ));
        }
        for m in have.difference(&want_set) {
            self.findings.push(Finding::new(
                Kind::StaleMajor,
                format!(
                    "the fence protects major {m}, which the node no longer has (driver unloaded or renumbered)"
                ),
                json!({"major": m, "node_majors": want_set}),
            ));
        }
        want_set
    }

    /// Grants whose cgroup is gone are revoked ("collected"). The entries
    /// are read before the cgroups are listed: a grant's cgroup exists
    /// before its grant does, so a live one cannot be taken for stale.
    /// Returns the live grants.
    pub(super) fn stale_grants(&mut self) -> Vec<GrantEntry> {
        let node = self.node;
        let Some(f) = &self.fence else {
            return Vec::new();
        };
        let entries = match f.entries() {
            Ok(e) => e,
            Err(e) => {
                self.findings
                    .push(check_failed("fence grants", e.to_string()));
                return Vec::new();
            }
        };
        if entries.is_empty() {
            return entries;
        }
        let alive = denials::cgroup_paths(node.cg.mount());
        let noted: BTreeMap<u64, String> = node
            .state
            .applied(None)
            .0
            .into_iter()
            .map(|a| (a.cgroup_id, a.cgroup_path))
            .collect();
        let ids: BTreeSet<u64> = entries.iter().map(|e| e.cgroup_id).collect();
        let mut live = Vec::new();
        for id in ids {
            let mine: Vec<GrantEntry> = entries
                .iter()
                .filter(|e| e.cgroup_id == id)
                .copied()
                .collect();
            if alive.contains_key(&id) {
                live.extend(mine);
                continue;
            }
            let jobs: BTreeSet<u32> = mine.iter().map(|e| e.job_id).collect();
            let devs: BTreeSet<DevNum> = mine.iter().map(|e| e.dev).collect();
            let path = noted.get(&id).map(|p| crate::host::cgpath::abs(p));
            let mut fnd = Finding::new(
                Kind::StaleGrant,
                format!(
                    "grant of job(s) {jobs:?} on {} to cgroup id {id}{} whose cgroup no longer exists",
                    dev_list(&devs),
                    path.as_deref().map(|p| format!(" ({p})")).unwrap_or_default()
                ),
                json!({
                    "cgroup_id": id, "cgroup_path": path, "job_ids": jobs,
                    "devices": devs.iter().map(|d| d.to_string()).collect::<Vec<_>>(),
                }),
            );
            fnd.cgroup = path.clone();
            match f.revoke_cgroup(id) {
                Ok(gone) => {
                    fnd.action = Some(format!(
                        "revoked {} grant entr{}",
                        gone.len(),
                        if gone.len() == 1 { "y" } else { "ies" }
                    ));
                    let mut ev = AuditEvent::new(events::GRANT_COLLECTED)
                        .devices(devs.iter())
                        .field("cgroup_id", id)
                        .field("entries", gone.len())
                        .field("why", "the grant's cgroup no longer exists (sweep)");
                    if let Some(j) = jobs.iter().next() {
                        ev = ev.job(*j);
                    }
                    if let Some(p) = &path {
                        ev = ev.field("cgroup", p.clone());
                    }
                    if let Err(e) = node.audit(ev) {
                        self.report.errors.push(e.to_string());
                    }
                }
                Err(e) => {
                    fnd.severity = Severity::High;
                    fnd.action = Some(format!("revocation failed: {e}"));
                    live.extend(mine);
                }
            }
            self.findings.push(fnd);
        }
        live
    }

    /// Denial records new or grown since the last sweep.
    pub(super) fn denials(&mut self) {
        let node = self.node;
        let Some(f) = &self.fence else {
            return;
        };
        let now = match f.denials() {
            Ok(d) => d,
            Err(e) => {
                self.findings
                    .push(check_failed("fence denials", e.to_string()));
                return;
            }
        };
        let state_path = self.denial_state.clone();
        let prev = match read_json::<DenialState>(&state_path) {
            Ok(p) => p.unwrap_or_default(),
            Err(e) => {
                self.report.errors.push(e.to_string());
                DenialState::default()
            }
        };
        let (fresh, next) = new_denials(&prev, &now);
        self.report.denials_total = next.total;
        let deltas: Vec<u64> = fresh.iter().map(|(_, d)| *d).collect();
        let resolved = denials::resolve(
            node,
            fresh.into_iter().map(|(d, _)| d).collect(),
            self.users,
        );
        for (d, delta) in resolved.into_iter().zip(deltas) {
            let mut fnd = Finding::new(
                Kind::DeniedOpen,
                format!(
                    "{delta} denied open(s) of {}{} by {} (uid {}) since the last sweep; last pid {} ({}) at {}",
                    d.device,
                    if d.access.is_empty() { String::new() } else { format!(" ({})", d.access) },
                    d.user.as_deref().unwrap_or("?"),
                    d.uid,
                    d.last_pid,
                    d.last_comm,
                    d.last_time
                ),
                json!({
                    "device": d.device, "access": d.access, "new": delta, "count": d.count,
                    "cgroup_id": d.cgroup_id, "last_time": d.last_time,
                }),
            );
            fnd.pid = (d.last_pid > 0).then_some(d.last_pid as i32);
            fnd.uid = Some(d.uid);
            fnd.user = d.user;
            fnd.cgroup = d.cgroup.map(|c| crate::host::cgpath::abs(&c));
            fnd.comm = Some(d.last_comm);
            self.findings.push(fnd);
        }
        if let Err(e) = write_json(&state_path, &next) {
            self.report.errors.push(e.to_string());
        }
    }
}
