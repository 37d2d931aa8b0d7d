//! System accounts and the users who run jobs.
//!
//! gpufence treats uids up to `protected_uid_max` as system accounts: no
//! response ever stops or ends them. It grants no exemption: an exempt
//! cgroup covers only its `exempt_cgroups` entry's users (slurmd's root
//! alone), so a low uid's `~/.profile` that slurmd runs for `sbatch
//! --get-user-env` in its own cgroup (under `PrologFlags=Alloc` even for a
//! job the Prolog refuses: `_rpc_batch_job` in
//! `src/slurmd/slurmd/req.c` gets the environment before it checks the
//! credential) is fenced there. Never ending them is only safe when no
//! person has such a uid. The rule: **no job runs as a uid in
//! `1..=protected_uid_max`** (root, uid 0, runs what it likes anyway): the
//! Prolog refuses such a job ([`is_system_job_uid`]). And `fence install`,
//! `fence status`, `doctor` and `sweep` warn ([`range_warnings`]) when
//! `protected_uid_max` reaches `UID_MIN` of login.defs(5), or when NSS
//! knows login accounts ([`crate::host::users::UserEntry::is_login_account`])
//! at or below it: sites migrated from old RHEL (UID_MIN 500) or with low
//! LDAP ranges must lower `protected_uid_max` before their users run jobs.

use gpufence_model::config::Config;

use crate::host::users::Users;

/// How many accounts a warning names (the rest are counted).
const NAMED_MAX: usize = 10;

/// Whether a job of `uid` must be refused: a uid gpufence takes for a
/// system account (`1..=protected_uid_max`). Root (0) is not refused: it
/// is trusted with the fence itself.
pub fn is_system_job_uid(cfg: &Config, uid: u32) -> bool {
    uid != 0 && uid <= cfg.protected_uid_max
}

/// `UID_MIN` of login.defs(5) text: the first `UID_MIN <n>` line that is
/// not a comment; `None` when there is none.
pub fn uid_min(text: &str) -> Option<u32> {
    text.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        (it.next()? == "UID_MIN").then(|| it.next()?.parse().ok())?
    })
}

/// Warnings for the admin about `protected_uid_max` (each one line):
/// - it reaches `UID_MIN` of `cfg.login_defs` (a missing file or key is
///   no warning);
/// - NSS (or `passwd_file`) knows login accounts at or below it, root
///   aside: up to ten named, the rest counted.
///
/// Nothing when both are fine.
pub fn range_warnings(cfg: &Config, users: &Users) -> Vec<String> {
    let max = cfg.protected_uid_max;
    let mut out = Vec::new();
    if let Some(min) = std::fs::read_to_string(&cfg.login_defs)
        .ok()
        .as_deref()
        .and_then(uid_min)
    {
        if max >= min {
            out.push(format!(
                "protected_uid_max ({max}) is at or above UID_MIN ({min}) in {}: users with uids {min}-{max} would be taken for system accounts (never ended) and their jobs are refused; set protected_uid_max = {}",
                cfg.login_defs.display(),
                min.saturating_sub(1),
            ));
        }
    }
    out.extend(login_accounts_warning(max, users));
    out
}

fn login_accounts_warning(max: u32, users: &Users) -> Option<String> {
    let low: Vec<(String, u32)> = users
        .users()
        .into_iter()
        .filter(|u| u.uid != 0 && u.uid <= max && u.is_login_account())
        .map(|u| (u.name, u.uid))
        .collect();
    if low.is_empty() {
        return None;
    }
    let mut named: Vec<String> = low
        .iter()
        .take(NAMED_MAX)
        .map(|(n, u)| format!("{} ({u})", gpufence_model::text::printable(n)))
        .collect();
    if low.len() > NAMED_MAX {
        named.push(format!("and {} more", low.len() - NAMED_MAX));
    }
    Some(format!(
        "{} login account(s) at or below protected_uid_max ({max}): {}; gpufence takes them for system accounts (never ended) and refuses their jobs; if they are people, set protected_uid_max below their uids",
        low.len(),
        named.join(", ")
    ))
}

/// [`range_warnings`] with this host's users (`passwd_file`, then NSS).
pub fn host_range_warnings(cfg: &Config) -> Vec<String> {
    range_warnings(cfg, &Users::new(cfg.passwd_file.as_deref()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uid_min_reads_the_first_setting() {
        assert_eq!(
            uid_min("# UID_MIN 10\nMAIL_DIR /var/mail\nUID_MIN\t\t\t 1000\nUID_MIN 5\n"),
            Some(1000)
        );
        assert_eq!(uid_min("SYS_UID_MIN 100\n"), None);
        assert_eq!(uid_min("UID_MIN x\n"), None);
    }

    #[test]
    fn system_job_uids_are_the_protected_range_without_root() {
        let cfg = Config::default();
        assert!(!is_system_job_uid(&cfg, 0));
        assert!(is_system_job_uid(&cfg, 1));
        assert!(is_system_job_uid(&cfg, 600));
        assert!(is_system_job_uid(&cfg, 999));
        assert!(!is_system_job_uid(&cfg, 1000));
    }

    #[test]
    fn warnings_name_the_range_and_the_accounts() {
        let d = tempfile::tempdir().unwrap();
        let defs = d.path().join("login.defs");
        std::fs::write(&defs, "UID_MIN 500\n").unwrap();
        let passwd = d.path().join("passwd");
        let mut text = String::from(
            "root:x:0:0::/root:/bin/bash\npostgres:x:101:1::/var/lib/postgresql:/bin/bash\nolduser:x:600:600::/home/olduser:/bin/bash\nnew:x:1001:1001::/home/new:/bin/bash\n",
        );
        for i in 0..12 {
            text += &format!("u{i:02}:x:{}:1::/home/u{i}:/bin/sh\n", 700 + i);
        }
        std::fs::write(&passwd, text).unwrap();
        let cfg = Config {
            login_defs: defs.clone(),
            passwd_file: Some(passwd.clone()),
            ..Config::default()
        };
        // The fixture's accounts alone: the machine's NSS (a real uid-600
        // login on a site's node) must not change the counts.
        let users = Users::file_only(&passwd);
        let w = range_warnings(&cfg, &users);
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(
            w[0].starts_with("protected_uid_max (999) is at or above UID_MIN (500) in ")
                && w[0].contains("set protected_uid_max = 499"),
            "{}",
            w[0]
        );
        assert!(
            w[1].starts_with(
                "13 login account(s) at or below protected_uid_max (999): olduser (600), u00 (700)"
            ),
            "{}",
            w[1]
        );
        assert!(w[1].contains("and 3 more"), "{}", w[1]);
        assert!(
            !w[1].contains("postgres") && !w[1].contains("root"),
            "{}",
            w[1]
        );
        // Below the range: nothing to say.
        let ok = Config {
            protected_uid_max: 499,
            ..cfg.clone()
        };
        assert!(range_warnings(&ok, &users).is_empty());
        let gone = Config {
            login_defs: d.path().join("absent"),
            protected_uid_max: 599,
            ..cfg
        };
        assert!(range_warnings(&gone, &users).is_empty());
    }
}
