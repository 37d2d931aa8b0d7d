//! Users' leftovers in the shared-memory directory, one finding per user.

use std::collections::BTreeMap;

use serde_json::json;

use super::{Finding, Kind, Sweep};

/// How many names one user's `shm_leftover` finding lists (the rest are
/// counted).
pub(super) const NAMES_PER_USER: usize = 10;

/// How many users get a `shm_leftover` finding of their own; the others
/// are counted in a note (the sweep's output stays bounded however many
/// files and owners the directory holds).
pub(super) const USERS_MAX: usize = 200;

impl Sweep<'_> {
    /// Users' files in `shm_dir` that no process holds
    /// ([`crate::holders::shm::leftovers`]; system users and exempt service
    /// uids aside), one finding per user: how many, their total size, the
    /// oldest's age and the first [`NAMES_PER_USER`] names. Out of a
    /// `--cgroup` sweep's scope.
    pub(super) fn shm_leftovers(&mut self) {
        if self.scope.is_some() {
            return;
        }
        let resolve = crate::host::fence_ops::exempt_resolver(self.node);
        let cfg = &self.node.cfg;
        let now = std::time::SystemTime::now();
        let dir = &self.node.cfg.shm_dir;
        let found = crate::holders::shm::leftovers(
            dir,
            &|u| !cfg.is_system_or_service_uid(u, &resolve),
            None,
            std::time::Duration::from_millis(cfg.scan_budget_ms),
        );
        let mut by_uid: BTreeMap<u32, Vec<&crate::holders::shm::Leftover>> = BTreeMap::new();
        for l in &found.files {
            by_uid.entry(l.uid).or_default().push(l);
        }
        let at_least = if found.complete { "" } else { "at least " };
        if by_uid.len() > USERS_MAX {
            self.report.notes.push(format!(
                "{} users have leftovers in {}: the first {USERS_MAX} by uid are reported",
                by_uid.len(),
                dir.display()
            ));
        }
        for (uid, files) in by_uid.into_iter().take(USERS_MAX) {
            let bytes: u64 = files.iter().map(|l| l.size_bytes).sum();
            let oldest = files.iter().map(|l| l.age_seconds(now)).max().unwrap_or(0);
            let names: Vec<String> = files
                .iter()
                .take(NAMES_PER_USER)
                .map(|l| gpufence_model::text::printable(&l.name))
                .collect();
            let first = &files[0];
            let mut f = Finding::new(
                Kind::ShmLeftover,
                format!(
                    "{at_least}{} file(s) ({bytes} bytes) left in {} held by no process, the oldest {oldest}s ago: {}{}",
                    files.len(),
                    dir.display(),
                    names.join(", "),
                    if files.len() > names.len() { ", ..." } else { "" }
                ),
                json!({
                    "dir": dir.display().to_string(),
                    "files": files.len(),
                    "bytes": bytes,
                    "oldest_age_seconds": oldest,
                    "examined_all": found.complete,
                    "names": names,
                    "path": dir.join(&first.name).display().to_string(),
                    "size_bytes": first.size_bytes,
                    "mode": first.mode,
                    "age_seconds": first.age_seconds(now),
                }),
            );
            f.uid = Some(uid);
            f.user = self.users.name(uid);
            self.findings.push(f);
        }
    }
}
