//! Users by uid and name, for findings and evidence.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The users of `passwd_file` (never NSS: the sweep must not hang on LDAP).
#[derive(Clone, Debug, Default)]
pub struct Passwd {
    by_uid: BTreeMap<u32, (String, PathBuf)>,
    by_name: BTreeMap<String, (u32, PathBuf)>,
}

impl Passwd {
    /// Reads a passwd-format file; a missing file gives no users.
    pub fn load(path: &Path) -> Passwd {
        Passwd::parse(&std::fs::read_to_string(path).unwrap_or_default())
    }

    /// Parses passwd-format text (`name:x:uid:gid:gecos:home:shell`).
    pub fn parse(text: &str) -> Passwd {
        let mut p = Passwd::default();
        for l in text.lines() {
            let f: Vec<&str> = l.split(':').collect();
            if f.len() < 6 || f[0].is_empty() || f[0].starts_with('#') {
                continue;
            }
            let Ok(uid) = f[2].parse::<u32>() else {
                continue;
            };
            let home = PathBuf::from(f[5]);
            p.by_uid
                .entry(uid)
                .or_insert_with(|| (f[0].to_string(), home.clone()));
            p.by_name.entry(f[0].to_string()).or_insert((uid, home));
        }
        p
    }

    /// The name of `uid`.
    pub fn name(&self, uid: u32) -> Option<&str> {
        self.by_uid.get(&uid).map(|(n, _)| n.as_str())
    }

    /// The uid of `name`.
    pub fn uid(&self, name: &str) -> Option<u32> {
        self.by_name.get(name).map(|(u, _)| *u)
    }

    /// The home of `uid`.
    pub fn home(&self, uid: u32) -> Option<&Path> {
        self.by_uid.get(&uid).map(|(_, h)| h.as_path())
    }

    /// Every `(name, uid, home)`.
    pub fn users(&self) -> impl Iterator<Item = (&str, u32, &Path)> {
        self.by_name
            .iter()
            .map(|(n, (u, h))| (n.as_str(), *u, h.as_path()))
    }
}
