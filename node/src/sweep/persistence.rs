//! Crontabs and systemd units a user can come back through.

use std::collections::BTreeMap;

use gpufence_model::record::now_rfc3339;
use serde_json::json;

use super::state::{baseline_path, read_json, write_json, Baseline};
use super::{check_failed, Finding, Kind, Sweep};
use crate::host::persistence::{systemd_files, user_crontabs, UNIT_EVIDENCE_MAX};

impl Sweep<'_> {
    pub(super) fn persistence(&mut self) {
        let node = self.node;
        let users = self.users;
        for c in user_crontabs(node, users) {
            let mut f = Finding::new(
                Kind::PersistenceCron,
                format!(
                    "crontab of {} with {} entr{}: {}",
                    c.user.as_deref().unwrap_or("?"),
                    c.entries.len(),
                    if c.entries.len() == 1 { "y" } else { "ies" },
                    c.entries.join(" | ")
                ),
                json!({"file": c.path, "entries": c.entries, "sha256": c.sha256}),
            );
            f.uid = c.uid;
            f.user = c.user.clone();
            self.findings.push(f);
        }
        let current = systemd_files(node, users);
        let bpath = baseline_path(node);
        let b = match read_json::<Baseline>(&bpath) {
            Err(e) => {
                self.findings.push(check_failed(
                    "systemd baseline",
                    format!("{e}; remove it to record a new baseline"),
                ));
                return;
            }
            Ok(Some(b)) => b,
            Ok(None) => {
                let b = Baseline {
                    recorded: now_rfc3339(),
                    files: current
                        .iter()
                        .map(|(p, (f, _, _))| (p.clone(), f.clone()))
                        .collect(),
                };
                match write_json(&bpath, &b) {
                    Ok(()) => self.report.notes.push(format!(
                        "systemd baseline recorded: {} file(s) in {}",
                        b.files.len(),
                        bpath.display()
                    )),
                    Err(e) => self.report.errors.push(e.to_string()),
                }
                return;
            }
        };
        let mut read = 0;
        // Per owner: the first PER_OWNER files get a finding each, the rest
        // one summary (a user can make thousands of files every sweep).
        let mut per_owner: BTreeMap<u32, (usize, Vec<String>)> = BTreeMap::new();
        for (p, (f, scope_kind, root)) in &current {
            let change = match b.files.get(p) {
                None => "new",
                Some(old) if old != f => "changed",
                Some(_) => continue,
            };
            let seen = per_owner.entry(f.uid).or_default();
            seen.0 += 1;
            if seen.0 > PER_OWNER {
                if seen.1.len() < PER_OWNER {
                    seen.1.push(p.display().to_string());
                }
                continue;
            }
            let (sha256, content) = if read < UNIT_EVIDENCE_MAX {
                read += 1;
                root.evidence(p)
            } else {
                (None, None)
            };
            let mut fnd = Finding::new(
                Kind::PersistenceSystemd,
                format!(
                    "{change} systemd {} {} since the baseline of {}",
                    if *scope_kind == "systemd_user" {
                        "user file"
                    } else {
                        "file"
                    },
                    p.display(),
                    b.recorded
                ),
                json!({
                    "file": p, "change": change, "scope": scope_kind, "sha256": sha256,
                    "content": content, "link": f.link, "owner_uid": f.uid,
                    "mode": format!("{:o}", f.mode), "size": f.size,
                    "previous": b.files.get(p), "baseline": bpath,
                }),
            );
            fnd.uid = Some(f.uid);
            fnd.user = users.name(f.uid);
            self.findings.push(fnd);
        }
        for (uid, (n, more)) in per_owner.into_iter().filter(|(_, (n, _))| *n > PER_OWNER) {
            let mut fnd = Finding::new(
                Kind::PersistenceSystemd,
                format!(
                    "and {} more new or changed systemd files of uid {uid} since the baseline of {} (first: {})",
                    n - PER_OWNER,
                    b.recorded,
                    more.first().map(String::as_str).unwrap_or("")
                ),
                json!({"owner_uid": uid, "more": n - PER_OWNER, "files": more, "baseline": bpath}),
            );
            fnd.uid = Some(uid);
            fnd.user = users.name(uid);
            self.findings.push(fnd);
        }
    }
}

/// How many new or changed systemd files of one owner get a finding of
/// their own in one sweep; the rest are counted in one more finding that
/// names the next [`PER_OWNER`] paths.
pub(super) const PER_OWNER: usize = 20;
