//! Cgroup paths: the one place they are normalised, joined and compared.
//!
//! gpufence names a cgroup by its path relative to the cgroup2 mount, with
//! no leading `/` inside the code (`gpufence/job_4`, `""` for the mount's
//! root), and prints it absolute within the mount (`/gpufence/job_4`, `/`
//! for the root) in every message, audit field and JSON file.
//! [`CgroupPath`] holds that relative form, always normalised, so that two
//! spellings of one cgroup compare equal and "below" is decided per
//! component (`a/bc` is not below `a/b`). Code that joins cgroup paths, asks
//! whether one is below another or prints one goes through this type (the
//! node crate's `join_cgroup`, `is_under` and `host::cgpath` helpers are thin
//! wrappers of it).

use std::fmt;
use std::path::{Component, Path};

use serde::{Serialize, Serializer};

/// Why a text is not a cgroup path ([`CgroupPath::parse`]).
///
/// The message is the one `normalize_cgroup_path` always gave; the config
/// reports it after the key (`cgroup_root: "a/../b" contains `..``).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CgroupPathError {
    /// A `..` component: it could name a cgroup outside the intended subtree.
    #[error("{0:?} contains `..`")]
    ParentDir(String),
    /// A component that is not UTF-8 (only reachable from a non-UTF-8
    /// path; a `&str` never is).
    #[error("{0:?} is not UTF-8")]
    NotUtf8(String),
    /// A Windows path prefix (`C:`); never on Linux.
    #[error("{0:?} is not a cgroup path")]
    Prefix(String),
}

/// Whether a path component is a glob pattern: it holds `*`, `?` or `[`
/// (characters systemd never puts in a unit name, `systemd.unit(5)`: unit
/// names are ASCII letters, digits, `:-_.\\` and `@`).
pub fn is_glob(component: &str) -> bool {
    component.contains(['*', '?', '['])
}

/// A cgroup path relative to the cgroup2 mount, normalised: no leading or
/// trailing `/`, no empty, `.` or `..` component; `""` is the mount's root.
///
/// Made by [`CgroupPath::parse`] (or [`CgroupPath::root`]); printed (and
/// serialised) absolute, `/a/b`, by [`fmt::Display`] and [`CgroupPath::abs`];
/// [`CgroupPath::as_str`] gives the relative form the cgroup layer takes.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CgroupPath(String);

impl CgroupPath {
    /// The cgroup2 mount's root (`""`, printed `/`).
    pub fn root() -> Self {
        CgroupPath(String::new())
    }

    /// Normalises `p`, relative or absolute within the cgroup2 mount:
    /// strips leading and trailing `/`, collapses `//` and `.`.
    ///
    /// # Errors
    /// [`CgroupPathError::ParentDir`] when `p` holds `..` (it could name a
    /// cgroup outside the intended subtree).
    pub fn parse(p: &str) -> Result<Self, CgroupPathError> {
        let mut parts: Vec<&str> = Vec::new();
        for c in Path::new(p).components() {
            match c {
                Component::RootDir | Component::CurDir => {}
                Component::Normal(s) => parts.push(
                    s.to_str()
                        .ok_or_else(|| CgroupPathError::NotUtf8(p.to_string()))?,
                ),
                Component::ParentDir => return Err(CgroupPathError::ParentDir(p.to_string())),
                Component::Prefix(_) => return Err(CgroupPathError::Prefix(p.to_string())),
            }
        }
        Ok(CgroupPath(parts.join("/")))
    }

    /// The same as [`CgroupPath::parse`].
    ///
    /// # Errors
    /// See [`CgroupPath::parse`].
    pub fn new(p: &str) -> Result<Self, CgroupPathError> {
        Self::parse(p)
    }

    /// The relative form: `a/b`, `""` for the root.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The relative form, owned.
    pub fn into_string(self) -> String {
        self.0
    }

    /// The absolute form within the mount: `/a/b`, `/` for the root.
    pub fn abs(&self) -> String {
        format!("/{}", self.0)
    }

    /// Whether this is the mount's root.
    pub fn is_root(&self) -> bool {
        self.0.is_empty()
    }

    /// `rel` (one leaf or several components, parsed as [`CgroupPath::parse`]
    /// does) below this cgroup.
    ///
    /// # Errors
    /// When `rel` is not a cgroup path (`..`).
    pub fn join(&self, rel: &str) -> Result<Self, CgroupPathError> {
        Ok(self.join_path(&Self::parse(rel)?))
    }

    /// `rel` below this cgroup; joining the root is a no-op either side.
    pub fn join_path(&self, rel: &CgroupPath) -> Self {
        match (self.is_root(), rel.is_root()) {
            (true, _) => rel.clone(),
            (_, true) => self.clone(),
            _ => CgroupPath(format!("{}/{}", self.0, rel.0)),
        }
    }

    /// Whether this cgroup is `root` or below it, component by component
    /// (`a/bc` is not below `a/b`); the mount's root covers everything.
    pub fn is_under(&self, root: &CgroupPath) -> bool {
        root.is_root()
            || self.0 == root.0
            || (self.0.len() > root.0.len()
                && self.0.starts_with(&root.0)
                && self.0.as_bytes()[root.0.len()] == b'/')
    }

    /// Whether this cgroup is at or below a cgroup that `pattern` names,
    /// component by component: a component of `pattern` that
    /// [`is_glob`] is matched with the shell's rules (`glob::Pattern`:
    /// `*`, `?`, `[...]`, never across a `/`), any other compares equal.
    /// `system.slice/nvsm-core.service/x` is under `system.slice/nvsm*.service`;
    /// `system.slice/nvsmx` is not. A component that is not a valid
    /// pattern matches nothing (the config refuses such an entry).
    pub fn is_under_pattern(&self, pattern: &CgroupPath) -> bool {
        let mut mine = self.components();
        pattern.components().all(|p| {
            mine.next().is_some_and(|c| {
                if is_glob(p) {
                    glob::Pattern::new(p).is_ok_and(|g| g.matches(c))
                } else {
                    p == c
                }
            })
        })
    }

    /// The components, root first (none for the root).
    pub fn components(&self) -> impl Iterator<Item = &str> {
        self.0.split('/').filter(|s| !s.is_empty())
    }

    /// The cgroups from the mount's root down to this one, both included:
    /// `""`, `a`, `a/b` for `a/b`.
    pub fn ancestors(&self) -> Vec<CgroupPath> {
        let mut out = vec![CgroupPath::root()];
        let mut cur = CgroupPath::root();
        for c in self.components() {
            cur = cur.join_path(&CgroupPath(c.to_string()));
            out.push(cur.clone());
        }
        out
    }
}

impl fmt::Display for CgroupPath {
    /// The absolute form ([`CgroupPath::abs`]).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "/{}", self.0)
    }
}

impl std::str::FromStr for CgroupPath {
    type Err = CgroupPathError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl AsRef<str> for CgroupPath {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl Serialize for CgroupPath {
    /// The absolute form, as gpufence's JSON output writes cgroups.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn p(s: &str) -> CgroupPath {
        CgroupPath::parse(s).unwrap()
    }

    #[test]
    fn parse_normalises() {
        for (input, want) in [
            ("", ""),
            ("/", ""),
            ("//", ""),
            (".", ""),
            ("/a/b/", "a/b"),
            ("a//b", "a/b"),
            ("./a/./b/.", "a/b"),
            ("system.slice/slurmd.service", "system.slice/slurmd.service"),
        ] {
            assert_eq!(p(input).as_str(), want, "{input:?}");
        }
    }

    #[test]
    fn parse_refuses_parent_dirs_with_the_old_message() {
        for bad in ["..", "a/../b", "/a/..", "../x"] {
            let e = CgroupPath::parse(bad).unwrap_err();
            assert_eq!(e, CgroupPathError::ParentDir(bad.to_string()));
            assert_eq!(e.to_string(), format!("{bad:?} contains `..`"));
        }
    }

    #[test]
    fn join_and_abs() {
        assert_eq!(p("").join("job_4").unwrap().as_str(), "job_4");
        assert_eq!(p("a").join("").unwrap().as_str(), "a");
        assert_eq!(p("a").join("/b/c/").unwrap().as_str(), "a/b/c");
        assert!(p("a").join("../b").is_err());
        assert_eq!(p("").abs(), "/");
        assert_eq!(p("a/b").abs(), "/a/b");
        assert_eq!(p("a/b").to_string(), "/a/b");
    }

    #[test]
    fn is_under_pattern_matches_globs_per_component() {
        let under = |c: &str, pat: &str| p(c).is_under_pattern(&p(pat));
        assert!(under(
            "system.slice/nvsm.service",
            "system.slice/nvsm*.service"
        ));
        assert!(under(
            "system.slice/nvsm-core.service/x",
            "system.slice/nvsm*.service"
        ));
        assert!(under(
            "system.slice/nvsm_api_gateway-mqtt.service",
            "system.slice/nvsm*.service"
        ));
        assert!(!under("system.slice/nvsmx", "system.slice/nvsm*.service"));
        assert!(!under(
            "system.slice/evil.nvsm.service",
            "system.slice/nvsm*.service"
        ));
        // `*` never crosses a `/`.
        assert!(!under(
            "system.slice/nvsm-a/b.service",
            "system.slice/nvsm*.service"
        ));
        assert!(!under("system.slice", "system.slice/nvsm*.service"));
        assert!(!under(
            "user.slice/nvsm.service",
            "system.slice/nvsm*.service"
        ));
        // A plain entry is is_under.
        assert!(under("a/b/c", "a/b"));
        assert!(!under("a/bc", "a/b"));
        assert!(under("a", ""));
        // Not a valid pattern: matches nothing.
        assert!(!under("a/[x", "a/[x"));
        assert!(
            is_glob("nvsm*.service")
                && is_glob("a?")
                && is_glob("[ab]")
                && !is_glob("slurmd.service")
        );
    }

    #[test]
    fn is_under_is_per_component() {
        assert!(p("a/b").is_under(&p("")));
        assert!(p("").is_under(&p("")));
        assert!(p("a/b").is_under(&p("a/b")));
        assert!(p("a/b/c").is_under(&p("a/b")));
        assert!(!p("a/bc").is_under(&p("a/b")));
        assert!(!p("a").is_under(&p("a/b")));
        assert!(!p("").is_under(&p("a")));
    }

    #[test]
    fn ancestors_run_from_the_root() {
        let a: Vec<String> = p("a/b").ancestors().into_iter().map(|c| c.abs()).collect();
        assert_eq!(a, ["/", "/a", "/a/b"]);
        assert_eq!(p("").ancestors(), [CgroupPath::root()]);
    }

    #[test]
    fn serialises_absolute() {
        assert_eq!(serde_json::to_string(&p("a/b")).unwrap(), r#""/a/b""#);
        assert_eq!(serde_json::to_string(&p("")).unwrap(), r#""/""#);
    }

    /// Texts made of cgroup-name components, `.`, empty components and
    /// leading or trailing slashes.
    fn messy() -> impl Strategy<Value = String> {
        (
            any::<bool>(),
            prop::collection::vec(
                prop_oneof!["[a-z_]{1,3}", Just(".".to_string()), Just(String::new())],
                0..6,
            ),
            any::<bool>(),
        )
            .prop_map(|(lead, parts, trail)| {
                let mut s = parts.join("/");
                if lead {
                    s.insert(0, '/');
                }
                if trail {
                    s.push('/');
                }
                s
            })
    }

    proptest! {
        #[test]
        fn normalised_form_is_a_fixed_point(s in messy()) {
            let n = p(&s);
            prop_assert!(!n.as_str().starts_with('/') && !n.as_str().ends_with('/'));
            prop_assert!(n.components().all(|c| c != "." && c != ".." && !c.is_empty()));
            prop_assert_eq!(&p(n.as_str()), &n);
            prop_assert_eq!(&p(&n.abs()), &n);
            let kept: Vec<&str> = s.split('/').filter(|c| !c.is_empty() && *c != ".").collect();
            prop_assert_eq!(n.as_str(), kept.join("/"));
        }

        #[test]
        fn joined_paths_are_under_their_base(a in messy(), b in messy()) {
            let (a, b) = (p(&a), p(&b));
            let j = a.join(b.as_str()).unwrap();
            prop_assert!(j.is_under(&a));
            prop_assert_eq!(&j, &a.join_path(&b));
            let parts: Vec<&str> = a.components().chain(b.components()).collect();
            prop_assert_eq!(j.as_str(), parts.join("/"));
        }

        #[test]
        fn is_under_matches_component_prefixes(a in messy(), b in messy()) {
            let (a, b) = (p(&a), p(&b));
            let ac: Vec<&str> = a.components().collect();
            let bc: Vec<&str> = b.components().collect();
            prop_assert_eq!(a.is_under(&b), ac.starts_with(&bc));
            prop_assert_eq!(a.is_under(&b) && b.is_under(&a), a == b);
        }

        #[test]
        fn parent_dirs_are_always_refused(a in messy(), b in messy()) {
            let s = format!("{a}/../{b}");
            prop_assert!(CgroupPath::parse(&s).is_err());
        }
    }
}
