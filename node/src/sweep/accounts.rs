//! The uid range gpufence takes for system accounts.

use serde_json::json;

use super::{Finding, Kind, Sweep};

impl Sweep<'_> {
    /// One `system_uid_range` finding per warning of
    /// [`crate::host::accounts::range_warnings`]. Out of a `--cgroup`
    /// sweep's scope.
    pub(super) fn uid_range(&mut self) {
        if self.scope.is_some() {
            return;
        }
        for w in crate::host::accounts::range_warnings(&self.node.cfg, self.users) {
            self.findings.push(Finding::new(
                Kind::SystemUidRange,
                w,
                json!({
                    "protected_uid_max": self.node.cfg.protected_uid_max,
                    "login_defs": self.node.cfg.login_defs,
                }),
            ));
        }
    }
}
