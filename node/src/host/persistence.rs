//! Where a user can make a process come back: crontabs and systemd units
//! (system and user), read for the sweep's persistence checks and for an
//! incident's evidence. Users' files are only read for evidence, and then
//! only regular files, opened without following links or blocking on
//! FIFOs, 64 KiB at most.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::host::users::Users;
use crate::Node;

/// The entries of a crontab: lines that are not blank, not comments and
/// not environment assignments (`NAME=value`).
pub fn cron_entries(text: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter(|l| {
            // An assignment: an identifier before `=`, no blank before it.
            // A schedule starts with a digit, `*`, `@` or a name list.
            match l.split_once('=') {
                Some((k, _)) => {
                    let k = k.trim();
                    k.is_empty()
                        || k.contains(char::is_whitespace)
                        || k.starts_with(|c: char| c.is_ascii_digit() || c == '*' || c == '@')
                }
                None => true,
            }
        })
        .map(String::from)
        .collect()
}

/// One persistence entry: a user's crontab or a systemd file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PersistenceEntry {
    /// `cron`, `systemd_system` or `systemd_user`.
    pub kind: &'static str,
    /// The file.
    pub path: PathBuf,
    /// Its owner (the crontab's user, the unit file's owner).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// The user's name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Crontab entries; empty for unit files.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub entries: Vec<String>,
    /// SHA-256 of a regular file's content.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// A symlink's target (`.wants/` links enable units).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub link: Option<String>,
    /// The file's content when it is small text (unit files, crontabs),
    /// so that evidence survives the file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// How a systemd file is remembered in the baseline: what `lstat` says,
/// so a sweep never reads a user's files to compare them (a user cannot
/// set a file's ctime: any write, rename or chmod moves it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fingerprint {
    /// Target (symlinks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link: Option<String>,
    /// Owner.
    pub uid: u32,
    /// Permission bits.
    pub mode: u32,
    /// Size in bytes.
    pub size: u64,
    /// Inode number.
    pub ino: u64,
    /// Modification time, ns since the epoch.
    pub mtime_ns: i64,
    /// Status change time, ns since the epoch.
    pub ctime_ns: i64,
}

/// How much of a file is hashed or kept as evidence. Unit files and
/// crontabs are a few hundred bytes.
const EVIDENCE_MAX: u64 = 64 << 10;
/// How deep and how many files a unit directory walk goes (a unit tree is
/// shallow: `foo.service.d/x.conf`, `multi-user.target.wants/foo.service`).
const UNIT_DEPTH: usize = 4;
const UNIT_FILES_MAX: usize = 20_000;
/// Reported systemd files that get a hash and content (a user can make
/// thousands of files: each is reported, only these many are read).
pub(crate) const UNIT_EVIDENCE_MAX: usize = 100;

/// Opens `p` for reading only if it is a regular file, without following
/// a symlink and without blocking on a FIFO swapped in by its owner.
fn open_regular(p: &Path) -> Option<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(p)
        .ok()?;
    f.metadata().ok()?.is_file().then_some(f)
}

/// The first [`EVIDENCE_MAX`] bytes of a regular file.
fn read_prefix(p: &Path) -> Option<Vec<u8>> {
    use std::io::Read;
    let mut buf = Vec::new();
    open_regular(p)?
        .take(EVIDENCE_MAX)
        .read_to_end(&mut buf)
        .ok()?;
    Some(buf)
}

fn sha256_hex(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// SHA-256 and (when it is text) the content of the first
/// [`EVIDENCE_MAX`] bytes of a regular file.
pub(crate) fn file_evidence(p: &Path) -> (Option<String>, Option<String>) {
    match read_prefix(p) {
        Some(b) => (Some(sha256_hex(&b)), String::from_utf8(b).ok()),
        None => (None, None),
    }
}

fn fingerprint(p: &Path) -> Option<Fingerprint> {
    let md = std::fs::symlink_metadata(p).ok()?;
    let ft = md.file_type();
    if !ft.is_symlink() && !ft.is_file() {
        return None;
    }
    Some(Fingerprint {
        link: ft
            .is_symlink()
            .then(|| std::fs::read_link(p).ok())
            .flatten()
            .map(|t| t.display().to_string()),
        uid: md.uid(),
        mode: md.mode() & 0o7777,
        size: md.size(),
        ino: md.ino(),
        mtime_ns: md.mtime() * 1_000_000_000 + md.mtime_nsec(),
        ctime_ns: md.ctime() * 1_000_000_000 + md.ctime_nsec(),
    })
}

/// Every regular file and symlink under `dir` (not following links), with
/// its fingerprint.
pub fn unit_files(dir: &Path) -> BTreeMap<PathBuf, Fingerprint> {
    let mut out = BTreeMap::new();
    let mut stack = vec![(dir.to_path_buf(), 0usize)];
    while let Some((d, depth)) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            if out.len() >= UNIT_FILES_MAX {
                return out;
            }
            let Ok(ft) = e.file_type() else { continue };
            let p = e.path();
            if ft.is_dir() {
                if depth < UNIT_DEPTH {
                    stack.push((p, depth + 1));
                }
            } else if let Some(f) = fingerprint(&p) {
                out.insert(p, f);
            }
        }
    }
    out
}

fn unit_entry(kind: &'static str, path: &Path, f: &Fingerprint, users: &Users) -> PersistenceEntry {
    let (sha256, content) = file_evidence(path);
    PersistenceEntry {
        kind,
        path: path.to_path_buf(),
        uid: Some(f.uid),
        user: users.name(f.uid),
        entries: Vec::new(),
        sha256,
        link: f.link.clone(),
        content,
    }
}

/// The crontab of user `name` in the spool, when it has entries.
fn crontab_of(node: &Node, name: &str, users: &Users) -> Option<PersistenceEntry> {
    let path = node.cfg.cron_spool_dir.join(name);
    let bytes = read_prefix(&path)?;
    let entries = cron_entries(&String::from_utf8_lossy(&bytes));
    if entries.is_empty() {
        return None;
    }
    Some(PersistenceEntry {
        kind: "cron",
        uid: users.uid(name),
        user: Some(name.to_string()),
        entries,
        sha256: Some(sha256_hex(&bytes)),
        link: None,
        content: String::from_utf8(bytes).ok(),
        path,
    })
}

/// The crontabs with entries of users above `protected_uid_max` (a file
/// named by a user neither `passwd_file` nor NSS knows counts as such).
pub fn user_crontabs(node: &Node, users: &Users) -> Vec<PersistenceEntry> {
    let Ok(rd) = std::fs::read_dir(&node.cfg.cron_spool_dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = rd
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(String::from))
        // crontab(1) writes `tmp.XXXXXX` while editing.
        .filter(|n| !n.starts_with('.') && !n.starts_with("tmp."))
        .collect();
    names.sort();
    names
        .into_iter()
        .filter(|n| users.uid(n).is_none_or(|u| u > node.cfg.protected_uid_max))
        .filter_map(|n| crontab_of(node, &n, users))
        .collect()
}

fn user_unit_dir(home: &Path) -> PathBuf {
    home.join(".config/systemd/user")
}

/// The systemd files the sweep watches: `systemd_system_dir` and every
/// known user's `~/.config/systemd/user` (the users of [`Users::users`]:
/// where NSS does not enumerate, local users and those already looked up).
/// Values: the fingerprint and `systemd_system` / `systemd_user`.
pub fn systemd_files(node: &Node, users: &Users) -> BTreeMap<PathBuf, (Fingerprint, &'static str)> {
    let mut out: BTreeMap<PathBuf, (Fingerprint, &'static str)> =
        unit_files(&node.cfg.systemd_system_dir)
            .into_iter()
            .map(|(p, f)| (p, (f, "systemd_system")))
            .collect();
    let homes: BTreeSet<PathBuf> = users
        .users()
        .into_iter()
        .map(|u| u.home)
        .filter(|h| h.is_absolute())
        .collect();
    for h in homes {
        let d = user_unit_dir(&h);
        if d.starts_with(&node.cfg.systemd_system_dir) {
            continue;
        }
        out.extend(
            unit_files(&d)
                .into_iter()
                .map(|(p, f)| (p, (f, "systemd_user"))),
        );
    }
    out
}

/// The persistence entries of `uid`: its crontab (whatever the uid), the
/// files under its `~/.config/systemd/user`, and files it owns under
/// `systemd_system_dir` (for uids other than root, which owns them all).
/// The uid's name and home come from `users`.
pub fn persistence_of_uid(node: &Node, uid: u32, users: &Users) -> Vec<PersistenceEntry> {
    let mut out = Vec::new();
    if let Some(name) = users.name(uid) {
        out.extend(crontab_of(node, &name, users));
    }
    if let Some(home) = users.home(uid).filter(|h| h.is_absolute()) {
        for (p, f) in unit_files(&user_unit_dir(&home)) {
            out.push(unit_entry("systemd_user", &p, &f, users));
        }
    }
    if uid != 0 {
        for (p, f) in unit_files(&node.cfg.systemd_system_dir) {
            if f.uid == uid {
                out.push(unit_entry("systemd_system", &p, &f, users));
            }
        }
    }
    out
}
