//! Users' leftovers in the shared-memory directory.

use super::*;

impl Sweep<'_> {
    /// Users' crontabs; systemd files against the baseline.
    /// Users' files in `shm_dir` that no process holds, with their age
    /// ([`crate::holders::shm::leftovers`]; system users and exempt service uids
    /// aside). Out of a `--cgroup` sweep's scope.
    pub(super) fn shm_leftovers(&mut self) {
        if self.scope.is_some() {
            return;
        }
        let ids = self.node.cfg.exempt_identities();
        let now = std::time::SystemTime::now();
        for l in crate::holders::shm::leftovers(&self.node.cfg.shm_dir, &|u| !ids.covers(u), None) {
            let path = self.node.cfg.shm_dir.join(&l.name);
            let age = l.age_seconds(now);
            let mut f = Finding::new(
                Kind::ShmLeftover,
                format!(
                    "{} ({} bytes, mode {}) left {}s ago, held by no process",
                    path.display(),
                    l.size_bytes,
                    l.mode,
                    age
                ),
                json!({
                    "path": path.display().to_string(),
                    "size_bytes": l.size_bytes,
                    "mode": l.mode,
                    "age_seconds": age,
                }),
            );
            f.uid = Some(l.uid);
            f.user = self.users.name(l.uid);
            self.findings.push(f);
        }
    }
}
