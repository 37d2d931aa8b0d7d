//! Users by uid and name, for findings and evidence: glibc NSS
//! (nsswitch.conf(5): `files`, `sss`, `ldap`, `systemd`...), so that sites
//! whose users come from LDAP or SSSD see their names, plus an optional
//! passwd-format file (`passwd_file`) read before NSS.
//!
//! NSS can hang (an LDAP server down, SSSD stuck): [`Users`] asks it from one
//! worker thread and waits at most [`NSS_BUDGET`] in all over its life; past
//! that it answers from what it already knows and [`Users::note`] says so.
//! Nothing on the SPANK path (`spank-plugin`, [`crate::job::grant`]) looks
//! users up: slurmstepd gives it the job's uid, which it compares as a
//! number, so a task start never waits on NSS.
//!
//! No group is named anywhere in gpufence (findings and records carry uids
//! only), so there is no group lookup here.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::CStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

/// How long, in all, one [`Users`] waits on NSS before it stops asking
/// (for a sweep or an Epilog: one run).
pub const NSS_BUDGET: Duration = Duration::from_secs(2);

/// The most users an NSS enumeration ([`Users::users`]) reads.
pub const MAX_ENUMERATED: usize = 100_000;

/// One user: the fields of a passwd entry gpufence uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UserEntry {
    /// Login name.
    pub name: String,
    /// uid.
    pub uid: u32,
    /// Home directory, as NSS or the file gives it (may be relative or
    /// missing on disk).
    pub home: PathBuf,
    /// Login shell, as NSS or the file gives it (empty: `/bin/sh`,
    /// passwd(5)).
    pub shell: PathBuf,
}

impl UserEntry {
    /// Whether this looks like a person's account rather than a service's:
    /// a shell one can log in with (not `nologin`, `false`, `true`,
    /// `sync`, `shutdown` or `halt`; empty is `/bin/sh`, passwd(5)) and a
    /// home outside the system's directories (`/`, `/nonexistent`, and
    /// anything under `/bin`, `/dev`, `/etc`, `/opt`, `/proc`, `/run`,
    /// `/sbin`, `/srv`, `/sys`, `/usr`, `/var`: where daemons such as
    /// PostgreSQL, which has a shell, keep theirs).
    pub fn is_login_account(&self) -> bool {
        const NO_LOGIN: [&str; 6] = ["nologin", "false", "true", "sync", "shutdown", "halt"];
        const SYSTEM_HOMES: [&str; 11] = [
            "/bin", "/dev", "/etc", "/opt", "/proc", "/run", "/sbin", "/srv", "/sys", "/usr",
            "/var",
        ];
        let shell_ok = self
            .shell
            .file_name()
            .and_then(|n| n.to_str())
            .is_none_or(|n| !NO_LOGIN.contains(&n));
        let home = &self.home;
        let home_ok = home.is_absolute()
            && home != Path::new("/")
            && home != Path::new("/nonexistent")
            && !SYSTEM_HOMES.iter().any(|d| home.starts_with(d));
        shell_ok && home_ok
    }
}

/// The users of a passwd-format file (`name:x:uid:gid:gecos:home:shell`),
/// parsed once; no NSS. [`Users`] reads `passwd_file` through it.
#[derive(Clone, Debug, Default)]
pub struct Passwd {
    entries: Vec<UserEntry>,
    by_uid: BTreeMap<u32, usize>,
    by_name: BTreeMap<String, usize>,
}

impl Passwd {
    /// Reads a passwd-format file; a missing or unreadable file gives no users.
    pub fn load(path: &Path) -> Passwd {
        Passwd::parse(&std::fs::read_to_string(path).unwrap_or_default())
    }

    /// Parses passwd-format text (`name:x:uid:gid:gecos:home:shell`); lines
    /// with fewer fields, a non-numeric uid or starting with `#` are skipped;
    /// the first entry of a uid or name wins.
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
            let i = p.entries.len();
            p.entries.push(UserEntry {
                name: f[0].to_string(),
                uid,
                home: PathBuf::from(f[5]),
                shell: PathBuf::from(f.get(6).copied().unwrap_or("")),
            });
            p.by_uid.entry(uid).or_insert(i);
            p.by_name.entry(f[0].to_string()).or_insert(i);
        }
        p
    }

    /// The name of `uid`.
    pub fn name(&self, uid: u32) -> Option<&str> {
        self.entry_of_uid(uid).map(|e| e.name.as_str())
    }

    /// The uid of `name`.
    pub fn uid(&self, name: &str) -> Option<u32> {
        self.entry_of_name(name).map(|e| e.uid)
    }

    /// The home of `uid`.
    pub fn home(&self, uid: u32) -> Option<&Path> {
        self.entry_of_uid(uid).map(|e| e.home.as_path())
    }

    /// Every `(name, uid, home)`, by name.
    pub fn users(&self) -> impl Iterator<Item = (&str, u32, &Path)> {
        self.by_name.iter().map(|(n, i)| {
            let e = &self.entries[*i];
            (n.as_str(), e.uid, e.home.as_path())
        })
    }

    /// Every entry, one per name, by name.
    fn entries(&self) -> impl Iterator<Item = &UserEntry> {
        self.by_name.values().map(|i| &self.entries[*i])
    }

    fn entry_of_uid(&self, uid: u32) -> Option<&UserEntry> {
        self.by_uid.get(&uid).map(|i| &self.entries[*i])
    }

    fn entry_of_name(&self, name: &str) -> Option<&UserEntry> {
        self.by_name.get(name).map(|i| &self.entries[*i])
    }
}

/// A question for the NSS worker.
#[derive(Debug)]
enum Ask {
    Uid(u32),
    Name(String),
    /// Enumerate, at most `max` users, stopping at `until`.
    All {
        max: usize,
        until: Instant,
    },
}

/// Its answer.
#[derive(Debug)]
enum Answer {
    One(Option<UserEntry>),
    /// The users, and why the enumeration stopped early, if it did.
    All(Vec<UserEntry>, Option<String>),
}

/// Where the worker's answers come from: NSS, or a stand-in in unit tests.
type Source = fn(Ask) -> Answer;

struct Worker {
    ask: mpsc::Sender<Ask>,
    answer: mpsc::Receiver<Answer>,
}

#[derive(Default)]
struct State {
    by_uid: HashMap<u32, Option<UserEntry>>,
    by_name: HashMap<String, Option<UserEntry>>,
    enumerated: Option<Vec<UserEntry>>,
    worker: Option<Worker>,
    /// Time waited on NSS so far.
    spent: Duration,
    /// NSS is no longer asked (it did not answer in time, or the worker is gone).
    given_up: bool,
    notes: Vec<String>,
}

/// Users by uid and name for one run (a sweep, an Epilog, a `gpufence`
/// command): first the passwd-format file `passwd_file` when one is set,
/// then glibc NSS (`getpwuid_r`, `getpwnam_r` through nix; `getpwent` to
/// enumerate), every answer cached for the instance's life.
///
/// NSS is asked from one worker thread; the callers wait at most
/// [`NSS_BUDGET`] in all. When NSS does not answer in time, every later
/// question NSS would have answered gets `None` (the worker is abandoned,
/// still blocked in NSS, and ends with the process) and [`Users::note`]
/// says so; the caller adds that note to its report.
pub struct Users {
    file: Passwd,
    budget: Duration,
    source: Source,
    state: Mutex<State>,
}

impl Users {
    /// The users of this host: `passwd_file` (when set; a missing file gives
    /// no users) before NSS, waiting on NSS at most [`NSS_BUDGET`].
    pub fn new(passwd_file: Option<&Path>) -> Users {
        Users::with_source(
            passwd_file.map(Passwd::load).unwrap_or_default(),
            NSS_BUDGET,
            nss,
        )
    }

    /// The users of `passwd_file` alone, NSS never asked: for tests whose
    /// counts must not depend on the machine's accounts (a real uid-600
    /// login on the host would otherwise join a fixture's).
    #[cfg(test)]
    pub(crate) fn file_only(passwd_file: &Path) -> Users {
        Users::with_source(Passwd::load(passwd_file), NSS_BUDGET, |q| match q {
            Ask::All { .. } => Answer::All(Vec::new(), None),
            Ask::Uid(_) | Ask::Name(_) => Answer::One(None),
        })
    }

    fn with_source(file: Passwd, budget: Duration, source: Source) -> Users {
        Users {
            file,
            budget,
            source,
            state: Mutex::new(State::default()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Asks the worker (started on first use); `None` once NSS is given up.
    fn ask(&self, st: &mut State, q: Ask) -> Option<Answer> {
        if st.given_up {
            return None;
        }
        if st.worker.is_none() {
            let (ask_tx, ask_rx) = mpsc::channel::<Ask>();
            let (ans_tx, ans_rx) = mpsc::channel::<Answer>();
            let source = self.source;
            let spawned = std::thread::Builder::new()
                .name("gpufence-nss".into())
                .spawn(move || {
                    for q in ask_rx {
                        if ans_tx.send(source(q)).is_err() {
                            break;
                        }
                    }
                });
            if let Err(e) = spawned {
                st.given_up = true;
                st.notes.push(format!(
                    "NSS not asked (no thread for it: {e}): user names left out"
                ));
                return None;
            }
            st.worker = Some(Worker {
                ask: ask_tx,
                answer: ans_rx,
            });
        }
        let w = st.worker.as_ref()?;
        let left = self.budget.saturating_sub(st.spent);
        let t0 = Instant::now();
        let got = w
            .ask
            .send(q)
            .map_err(|_| mpsc::RecvTimeoutError::Disconnected)
            .and_then(|()| w.answer.recv_timeout(left));
        st.spent += t0.elapsed();
        match got {
            Ok(a) => Some(a),
            Err(e) => {
                st.given_up = true;
                st.worker = None;
                st.notes.push(match e {
                    mpsc::RecvTimeoutError::Timeout => format!(
                        "NSS did not answer within {} s: user names left out",
                        self.budget.as_secs_f64()
                    ),
                    mpsc::RecvTimeoutError::Disconnected => {
                        "NSS lookup failed (its thread ended): user names left out".to_string()
                    }
                });
                None
            }
        }
    }

    fn by_uid(&self, uid: u32) -> Option<UserEntry> {
        if let Some(e) = self.file.entry_of_uid(uid) {
            return Some(e.clone());
        }
        let mut st = self.state();
        if let Some(e) = st.by_uid.get(&uid) {
            return e.clone();
        }
        let e = match self.ask(&mut st, Ask::Uid(uid)) {
            Some(Answer::One(e)) => e,
            // Given up: not cached, None from now on anyway.
            _ => return None,
        };
        st.by_uid.insert(uid, e.clone());
        e
    }

    /// The name of `uid`; `None` when neither the file nor NSS knows it, or
    /// NSS did not answer in time.
    pub fn name(&self, uid: u32) -> Option<String> {
        self.by_uid(uid).map(|e| e.name)
    }

    /// Whether `uid` is a login account ([`UserEntry::is_login_account`]:
    /// a shell and a home of a person), as [`Users::name`]; `false` when
    /// unknown.
    pub fn is_login_account(&self, uid: u32) -> bool {
        self.by_uid(uid).is_some_and(|e| e.is_login_account())
    }

    /// The home directory of `uid`, as [`Users::name`].
    pub fn home(&self, uid: u32) -> Option<PathBuf> {
        self.by_uid(uid).map(|e| e.home)
    }

    /// The uid of user `name`, as [`Users::name`].
    pub fn uid(&self, name: &str) -> Option<u32> {
        if let Some(e) = self.file.entry_of_name(name) {
            return Some(e.uid);
        }
        let mut st = self.state();
        if let Some(e) = st.by_name.get(name) {
            return e.as_ref().map(|e| e.uid);
        }
        let e = match self.ask(&mut st, Ask::Name(name.to_string())) {
            Some(Answer::One(e)) => e,
            _ => return None,
        };
        st.by_name.insert(name.to_string(), e.clone());
        e.map(|e| e.uid)
    }

    /// Every user known, one entry per name, by name: the file's, those NSS
    /// enumerates (`setpwent`/`getpwent`/`endpwent`, at most
    /// [`MAX_ENUMERATED`] within half of what is left of [`NSS_BUDGET`]; a
    /// note says when it stopped early), and those
    /// already looked up by uid or name. Sites whose NSS does not enumerate
    /// (SSSD's default, `enumerate = false`; nslcd with
    /// `nss_disable_enumeration yes`) see their local users plus the owners
    /// of the processes and files the caller has already named.
    pub fn users(&self) -> Vec<UserEntry> {
        let mut st = self.state();
        if st.enumerated.is_none() && !st.given_up {
            // Half of what is left: the lookups after it keep the rest,
            // and the worker stops before the caller's wait ends.
            let left = self.budget.saturating_sub(st.spent);
            let q = Ask::All {
                max: MAX_ENUMERATED,
                until: Instant::now() + left / 2,
            };
            let all = match self.ask(&mut st, q) {
                Some(Answer::All(all, stopped)) => {
                    st.notes.extend(stopped);
                    all
                }
                _ => Vec::new(),
            };
            st.enumerated = Some(all);
        }
        let mut seen = BTreeSet::new();
        let mut out: Vec<UserEntry> = Vec::new();
        let file = self.file.entries().cloned();
        let nss = st.enumerated.iter().flatten().cloned();
        let looked_up = st
            .by_uid
            .values()
            .chain(st.by_name.values())
            .flatten()
            .cloned();
        for e in file.chain(nss).chain(looked_up) {
            if seen.insert(e.name.clone()) {
                out.push(e);
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// What the caller's report should say about NSS: that it did not
    /// answer in time (and names were left out), or that an enumeration
    /// stopped early; `None` when every question was answered.
    pub fn note(&self) -> Option<String> {
        let st = self.state();
        (!st.notes.is_empty()).then(|| st.notes.join("; "))
    }
}

impl std::fmt::Debug for Users {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Users")
            .field("file_users", &self.file.entries.len())
            .field("budget", &self.budget)
            .finish_non_exhaustive()
    }
}

fn entry(u: nix::unistd::User) -> UserEntry {
    UserEntry {
        name: u.name,
        uid: u.uid.as_raw(),
        home: u.dir,
        shell: u.shell,
    }
}

/// The NSS source, run on the worker thread.
fn nss(q: Ask) -> Answer {
    use nix::unistd::{Uid, User};
    match q {
        // An NSS error (EIO, a module's ERANGE past nix's buffer limit) is
        // no answer, as an unknown user.
        Ask::Uid(uid) => Answer::One(User::from_uid(Uid::from_raw(uid)).ok().flatten().map(entry)),
        Ask::Name(n) => Answer::One(User::from_name(&n).ok().flatten().map(entry)),
        Ask::All { max, until } => {
            let (all, stopped) = enumerate(max, until);
            Answer::All(all, stopped)
        }
    }
}

/// One enumeration at a time in this process: `getpwent`'s position and
/// buffer are process-wide.
static ENUMERATION: Mutex<()> = Mutex::new(());

/// Every NSS user (`setpwent`, `getpwent` until NULL, `endpwent`), at most
/// `max`, stopping at `until`; and why it stopped early.
fn enumerate(max: usize, until: Instant) -> (Vec<UserEntry>, Option<String>) {
    let _one = ENUMERATION.lock().unwrap_or_else(|e| e.into_inner());
    let mut out = Vec::new();
    let mut stopped = None;
    // SAFETY: setpwent/getpwent/endpwent are only called here, under
    // ENUMERATION; each entry is copied before the next call.
    unsafe { libc::setpwent() };
    loop {
        if out.len() >= max {
            stopped = Some(format!(
                "NSS enumeration stopped after {max} users: some users' systemd units not read"
            ));
            break;
        }
        if Instant::now() >= until {
            stopped = Some(format!(
                "NSS enumeration stopped after {} users (out of time): some users' systemd units not read",
                out.len()
            ));
            break;
        }
        // SAFETY: as above.
        let p = unsafe { libc::getpwent() };
        if p.is_null() {
            break;
        }
        // SAFETY: a non-NULL getpwent result points to a valid passwd whose
        // strings are NUL-terminated (or NULL), valid until the next call.
        let (name, dir, uid, shell) =
            unsafe { ((*p).pw_name, (*p).pw_dir, (*p).pw_uid, (*p).pw_shell) };
        if name.is_null() {
            continue;
        }
        // SAFETY: see above.
        let name = unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned();
        let home = if dir.is_null() {
            PathBuf::new()
        } else {
            // SAFETY: see above.
            let d = unsafe { CStr::from_ptr(dir) };
            PathBuf::from(std::ffi::OsStr::from_bytes(d.to_bytes()))
        };
        let shell = if shell.is_null() {
            PathBuf::new()
        } else {
            // SAFETY: see above.
            let s = unsafe { CStr::from_ptr(shell) };
            PathBuf::from(std::ffi::OsStr::from_bytes(s.to_bytes()))
        };
        out.push(UserEntry {
            name,
            uid,
            home,
            shell,
        });
    }
    // SAFETY: as above.
    unsafe { libc::endpwent() };
    (out, stopped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwd_names_uids_and_homes() {
        let p = Passwd::parse(
            "root:x:0:0:root:/root:/bin/bash\nalice:x:1001:1001::/home/alice:/bin/sh\nbad line\n#c:x:5:5::/:/\n",
        );
        assert_eq!(p.name(1001), Some("alice"));
        assert_eq!(p.uid("root"), Some(0));
        assert_eq!(p.home(1001), Some(Path::new("/home/alice")));
        assert_eq!(p.users().count(), 2);
    }

    #[test]
    fn login_accounts_have_a_shell_and_a_home_of_their_own() {
        let p = Passwd::parse(
            "root:x:0:0:root:/root:/bin/bash\n\
             postgres:x:101:104::/var/lib/postgresql:/bin/bash\n\
             daemon:x:1:1::/usr/sbin:/usr/sbin/nologin\n\
             sync:x:4:65534:sync:/bin:/bin/sync\n\
             _apt:x:42:65534::/nonexistent:/usr/sbin/nologin\n\
             olduser:x:600:600::/home/olduser:/bin/bash\n\
             ldapuser:x:700:700::/u/ldapuser:\n\
             locked:x:800:800::/home/locked:/bin/false\n",
        );
        let login: Vec<&str> = p
            .entries()
            .filter(|e| e.is_login_account())
            .map(|e| e.name.as_str())
            .collect();
        assert_eq!(login, ["ldapuser", "olduser", "root"]);
        assert_eq!(p.entry_of_uid(700).unwrap().shell, PathBuf::new());
    }

    fn slow(_: Ask) -> Answer {
        std::thread::sleep(Duration::from_secs(5));
        Answer::One(None)
    }

    fn fixed(q: Ask) -> Answer {
        let bob = UserEntry {
            name: "bob".into(),
            uid: 5000,
            home: "/home/bob".into(),
            shell: "/bin/sh".into(),
        };
        match q {
            Ask::Uid(5000) => Answer::One(Some(bob)),
            Ask::Name(n) if n == "bob" => Answer::One(Some(bob)),
            Ask::All { .. } => Answer::All(vec![bob], Some("stopped early".into())),
            _ => Answer::One(None),
        }
    }

    #[test]
    fn file_first_then_the_source() {
        let f =
            Passwd::parse("bob:x:7:7::/srv/bob:/bin/sh\nalice:x:1001:1001::/home/alice:/bin/sh\n");
        let u = Users::with_source(f, NSS_BUDGET, fixed);
        assert_eq!(u.name(1001).as_deref(), Some("alice"));
        assert_eq!(u.uid("bob"), Some(7), "the file wins");
        assert_eq!(u.name(5000).as_deref(), Some("bob"));
        assert_eq!(u.home(5000), Some(PathBuf::from("/home/bob")));
        assert_eq!(u.name(5001), None);
        assert_eq!(u.note(), None);
        let all = u.users();
        let names: Vec<(&str, u32)> = all.iter().map(|e| (e.name.as_str(), e.uid)).collect();
        assert_eq!(names, [("alice", 1001), ("bob", 7)]);
        assert_eq!(u.note().as_deref(), Some("stopped early"));
    }

    #[test]
    fn a_hanging_nss_is_given_up_once() {
        let f = Passwd::parse("alice:x:1001:1001::/home/alice:/bin/sh\n");
        let u = Users::with_source(f, Duration::from_millis(200), slow);
        let t0 = Instant::now();
        assert_eq!(u.name(5000), None);
        assert_eq!(u.uid("bob"), None);
        assert_eq!(u.home(5001), None);
        assert_eq!(u.users().len(), 1);
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        // The file still answers.
        assert_eq!(u.name(1001).as_deref(), Some("alice"));
        assert_eq!(
            u.note().as_deref(),
            Some("NSS did not answer within 0.2 s: user names left out")
        );
    }

    /// This host's NSS (`files` at least) knows root, by uid and name, and
    /// enumerates it.
    #[test]
    fn real_nss_names_root() {
        let u = Users::new(None);
        assert_eq!(u.name(0).as_deref(), Some("root"));
        assert_eq!(u.uid("root"), Some(0));
        assert!(u.home(0).is_some());
        assert!(u.users().iter().any(|e| e.uid == 0 && e.name == "root"));
        assert_eq!(u.note(), None);
    }

    #[test]
    fn enumeration_is_bounded() {
        let (all, stopped) = enumerate(1, Instant::now() + NSS_BUDGET);
        assert!(all.len() <= 1);
        if all.len() == 1 {
            assert!(stopped.is_some_and(|s| s.contains("after 1 users")));
        }
        let (all, stopped) = enumerate(10, Instant::now());
        assert!(all.is_empty());
        assert!(stopped.is_some_and(|s| s.contains("out of time")));
    }
}
