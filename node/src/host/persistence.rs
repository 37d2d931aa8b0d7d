//! Where a user can make a process come back: crontabs and systemd units
//! (system and user), read for the sweep's persistence checks and for an
//! incident's evidence. Users' files are only read for evidence, and then
//! only regular files, opened without following links or blocking on
//! FIFOs, 64 KiB at most. Root reads nothing for a user that the user
//! could not read: a user's tree is walked from the home one component at
//! a time (`openat` with `O_NOFOLLOW`), every directory and file must be
//! the home owner's, and a file of another uid's is neither listed nor
//! read ([`UnitRoot`]); a crontab is read only when it is the user's or
//! root's.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};

use nix::dir::Dir;
use nix::fcntl::{openat, readlinkat, AtFlags, OFlag};
use nix::sys::stat::{fstatat, Mode, SFlag};

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

/// Opens `name` in the directory `dir` for reading only if it is a
/// regular file (owned by `owner`, when given), without following a
/// symlink and without blocking on a FIFO swapped in by its owner.
fn open_regular_at(dir: BorrowedFd<'_>, name: &Path, owner: Option<u32>) -> Option<File> {
    let fd = openat(
        dir,
        name,
        OFlag::O_RDONLY
            | OFlag::O_NOFOLLOW
            | OFlag::O_NONBLOCK
            | OFlag::O_NOCTTY
            | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .ok()?;
    let f = File::from(fd);
    let md = f.metadata().ok()?;
    (md.is_file() && owner.is_none_or(|o| md.uid() == o)).then_some(f)
}

/// Opens the directory `name` in `dir` without following a symlink; it
/// must be owned by `owner` when given.
fn open_dir_at(dir: BorrowedFd<'_>, name: &Path, owner: Option<u32>) -> Option<OwnedFd> {
    let fd = openat(
        dir,
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .ok()?;
    let md = File::from(fd.try_clone().ok()?).metadata().ok()?;
    owner.is_none_or(|o| md.uid() == o).then_some(fd)
}

/// Opens the directory `path` as given (an admin's path: the system unit
/// directory, the cron spool, a home as NSS names it), owned by `owner`
/// when given.
fn open_dir(path: &Path, owner: Option<u32>) -> Option<OwnedFd> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(path)
        .ok()?;
    let md = f.metadata().ok()?;
    (md.is_dir() && owner.is_none_or(|o| md.uid() == o)).then(|| OwnedFd::from(f))
}

/// Walks `rel` (plain components only) below the directory `root`, one
/// component at a time, never following a symlink, each directory owned
/// by `owner` when given; the last component is opened as a directory
/// (`dir`) or as a regular file of `owner`'s.
fn open_beneath(root: OwnedFd, rel: &Path, owner: Option<u32>, dir: bool) -> Option<OpenedAt> {
    let parts: Vec<&std::ffi::OsStr> = rel
        .components()
        .map(|c| match c {
            Component::Normal(n) => Some(n),
            _ => None,
        })
        .collect::<Option<_>>()?;
    let mut cur = root;
    for (i, part) in parts.iter().enumerate() {
        let last = i + 1 == parts.len();
        if last && !dir {
            return open_regular_at(cur.as_fd(), Path::new(part), owner).map(OpenedAt::File);
        }
        cur = open_dir_at(cur.as_fd(), Path::new(part), owner)?;
    }
    dir.then_some(OpenedAt::Dir(cur))
}

/// What [`open_beneath`] opened.
enum OpenedAt {
    Dir(OwnedFd),
    File(File),
}

/// The first [`EVIDENCE_MAX`] bytes of an open file.
fn read_prefix(f: File) -> Option<Vec<u8>> {
    let mut buf = Vec::new();
    f.take(EVIDENCE_MAX).read_to_end(&mut buf).ok()?;
    Some(buf)
}

fn sha256_hex(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// SHA-256 and (when it is text) the content of the first
/// [`EVIDENCE_MAX`] bytes.
fn evidence_of(b: Option<Vec<u8>>) -> (Option<String>, Option<String>) {
    match b {
        Some(b) => (Some(sha256_hex(&b)), String::from_utf8(b).ok()),
        None => (None, None),
    }
}

/// Where a tree of unit files is read from, and whose files in it are
/// read at all.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnitRoot {
    /// The tree's directory (`systemd_system_dir`,
    /// `~/.config/systemd/user`).
    pub path: PathBuf,
    /// A user's tree: the home (as NSS names it, opened as given) and its
    /// owner. Below the home every component is opened without following
    /// a symlink and must be a directory or file of the owner's: root never
    /// reads, through a user's link or a file someone else put there,
    /// what the user could not. `None`: the system tree, an admin's.
    pub user: Option<(PathBuf, u32)>,
}

impl UnitRoot {
    /// The system unit directory.
    pub fn system(path: &Path) -> UnitRoot {
        UnitRoot {
            path: path.to_path_buf(),
            user: None,
        }
    }

    /// `uid`'s `~/.config/systemd/user` under `home`.
    pub fn user(home: &Path, uid: u32) -> UnitRoot {
        UnitRoot::user_dir(home, uid, USER_UNIT_DIRS[0])
    }

    /// `uid`'s unit directory `rel` (one of [`USER_UNIT_DIRS`]) under `home`.
    pub fn user_dir(home: &Path, uid: u32, rel: &str) -> UnitRoot {
        UnitRoot {
            path: home.join(rel),
            user: Some((home.to_path_buf(), uid)),
        }
    }

    /// The user trees of `uid` with home `home`: one per [`USER_UNIT_DIRS`].
    pub fn user_trees(home: &Path, uid: u32) -> Vec<UnitRoot> {
        USER_UNIT_DIRS
            .iter()
            .map(|rel| UnitRoot::user_dir(home, uid, rel))
            .collect()
    }

    /// Whose files count: the user's, or anyone's in the system tree.
    fn owner(&self) -> Option<u32> {
        self.user.as_ref().map(|(_, u)| *u)
    }

    /// The tree's directory, opened as [`UnitRoot::user`] says.
    fn open(&self) -> Option<OwnedFd> {
        match &self.user {
            None => open_dir(&self.path, None),
            Some((home, uid)) => {
                let rel = self.path.strip_prefix(home).ok()?;
                match open_beneath(open_dir(home, Some(*uid))?, rel, Some(*uid), true)? {
                    OpenedAt::Dir(d) => Some(d),
                    OpenedAt::File(_) => None,
                }
            }
        }
    }

    /// SHA-256 and text content of the file `path` in this tree, opened
    /// from the tree's root one component at a time as `UnitRoot::open`
    /// does (never through a link; a user's file only if it is theirs).
    pub fn evidence(&self, path: &Path) -> (Option<String>, Option<String>) {
        let file = path.strip_prefix(&self.path).ok().and_then(|rel| {
            match open_beneath(self.open()?, rel, self.owner(), false)? {
                OpenedAt::File(f) => Some(f),
                OpenedAt::Dir(_) => None,
            }
        });
        evidence_of(file.and_then(read_prefix))
    }

    /// Every regular file and symlink of the tree (not following links;
    /// in a user's tree only the owner's files, below the owner's
    /// directories), with its fingerprint. `UNIT_DEPTH` levels and
    /// `UNIT_FILES_MAX` files at most. Nothing when the tree cannot be
    /// opened as `UnitRoot::open` says.
    pub fn files(&self) -> BTreeMap<PathBuf, Fingerprint> {
        let mut out = BTreeMap::new();
        let owner = self.owner();
        // Directories to read, by their path below the tree's root: each is
        // opened again from the root when its turn comes, so the walk holds
        // a handful of descriptors whatever the tree's shape (a user's
        // thousands of directories cannot run it out of descriptors and
        // hide a file past them). Directories count toward the cap.
        let mut stack: Vec<(PathBuf, usize)> = vec![(PathBuf::new(), 0)];
        let mut seen = 0usize;
        while let Some((rel, depth)) = stack.pop() {
            let fd = if rel.as_os_str().is_empty() {
                self.open()
            } else {
                match self.open().and_then(|r| open_beneath(r, &rel, owner, true)) {
                    Some(OpenedAt::Dir(d)) => Some(d),
                    _ => None,
                }
            };
            let Some(fd) = fd else {
                continue;
            };
            let Ok(mut dir) = fd
                .try_clone()
                .map_err(drop)
                .and_then(|d| Dir::from_fd(d).map_err(drop))
            else {
                continue;
            };
            let names: Vec<std::ffi::OsString> = dir
                .iter()
                .flatten()
                .map(|e| std::ffi::OsStr::from_bytes(e.file_name().to_bytes()).to_os_string())
                .filter(|n| n != "." && n != "..")
                .take(UNIT_FILES_MAX)
                .collect();
            drop(dir);
            for name in names {
                if seen >= UNIT_FILES_MAX {
                    return out;
                }
                seen += 1;
                let Ok(st) = fstatat(&fd, name.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW) else {
                    continue;
                };
                if owner.is_some_and(|o| st.st_uid != o) {
                    continue;
                }
                let kind = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits());
                if kind == SFlag::S_IFDIR {
                    if depth < UNIT_DEPTH {
                        stack.push((rel.join(&name), depth + 1));
                    }
                } else if kind == SFlag::S_IFREG || kind == SFlag::S_IFLNK {
                    let link = (kind == SFlag::S_IFLNK)
                        .then(|| readlinkat(&fd, name.as_os_str()).ok())
                        .flatten()
                        .map(|t| PathBuf::from(t).display().to_string());
                    out.insert(
                        self.path.join(&rel).join(&name),
                        Fingerprint {
                            link,
                            uid: st.st_uid,
                            mode: st.st_mode & 0o7777,
                            size: st.st_size as u64,
                            ino: st.st_ino,
                            mtime_ns: st.st_mtime * 1_000_000_000 + st.st_mtime_nsec,
                            ctime_ns: st.st_ctime * 1_000_000_000 + st.st_ctime_nsec,
                        },
                    );
                }
            }
        }
        out
    }
}

/// Every regular file and symlink under the admin's directory `dir` (not
/// following links), with its fingerprint ([`UnitRoot::files`] of the
/// system tree).
pub fn unit_files(dir: &Path) -> BTreeMap<PathBuf, Fingerprint> {
    UnitRoot::system(dir).files()
}

fn unit_entry(
    kind: &'static str,
    root: &UnitRoot,
    path: &Path,
    f: &Fingerprint,
    users: &Users,
) -> PersistenceEntry {
    let (sha256, content) = root.evidence(path);
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

/// The crontab of user `name` in the spool, when it has entries. Read
/// only when it is a regular file (never a link) owned by that user or by
/// root (cronie's spool files are root's, Debian's the user's): never a
/// file of another uid's.
fn crontab_of(node: &Node, name: &str, users: &Users) -> Option<PersistenceEntry> {
    let path = node.cfg.cron_spool_dir.join(name);
    let uid = users.uid(name);
    let spool = open_dir(&node.cfg.cron_spool_dir, None)?;
    let f = open_regular_at(spool.as_fd(), Path::new(name), None)?;
    let owner = f.metadata().ok()?.uid();
    if owner != 0 && Some(owner) != uid {
        return None;
    }
    let bytes = read_prefix(f)?;
    let entries = cron_entries(&String::from_utf8_lossy(&bytes));
    if entries.is_empty() {
        return None;
    }
    Some(PersistenceEntry {
        kind: "cron",
        uid,
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

/// Where systemd reads a user's own units, below the home
/// (systemd.unit(5), "User Unit Search Path": `$XDG_CONFIG_HOME/systemd/user`,
/// `$XDG_CONFIG_HOME/systemd/user.control` for `systemctl --user
/// set-property`, `$XDG_DATA_HOME/systemd/user`, with their XDG defaults).
pub const USER_UNIT_DIRS: [&str; 3] = [
    ".config/systemd/user",
    ".config/systemd/user.control",
    ".local/share/systemd/user",
];

/// The systemd files the sweep watches: `systemd_system_dir` and every
/// known user's `~/.config/systemd/user` (the users of [`Users::users`]:
/// where NSS does not enumerate, local users and those already looked up),
/// read as [`UnitRoot::files`] says. Values: the fingerprint,
/// `systemd_system` / `systemd_user`, and the tree it is in (for
/// [`UnitRoot::evidence`]).
pub fn systemd_files(
    node: &Node,
    users: &Users,
) -> BTreeMap<PathBuf, (Fingerprint, &'static str, UnitRoot)> {
    let system = UnitRoot::system(&node.cfg.systemd_system_dir);
    let mut out: BTreeMap<PathBuf, (Fingerprint, &'static str, UnitRoot)> = system
        .files()
        .into_iter()
        .map(|(p, f)| (p, (f, "systemd_system", system.clone())))
        .collect();
    let homes: BTreeSet<(PathBuf, u32)> = users
        .users()
        .into_iter()
        .map(|u| (u.home, u.uid))
        .filter(|(h, _)| h.is_absolute())
        .collect();
    for (h, uid) in homes {
        for root in UnitRoot::user_trees(&h, uid) {
            if root.path.starts_with(&node.cfg.systemd_system_dir) {
                continue;
            }
            out.extend(
                root.files()
                    .into_iter()
                    .map(|(p, f)| (p, (f, "systemd_user", root.clone()))),
            );
        }
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
        for root in UnitRoot::user_trees(&home, uid) {
            for (p, f) in root.files() {
                out.push(unit_entry("systemd_user", &root, &p, &f, users));
            }
        }
    }
    if uid != 0 {
        let system = UnitRoot::system(&node.cfg.systemd_system_dir);
        for (p, f) in system.files() {
            if f.uid == uid {
                out.push(unit_entry("systemd_system", &system, &p, &f, users));
            }
        }
    }
    out
}
