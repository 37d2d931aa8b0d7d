//! Finding, reading and validating the config file: its errors, which
//! name the key, the line and the file.

use std::fmt;
use std::path::{Path, PathBuf};

use super::exempt::check_exempt_pattern;
use super::{
    normalize_cgroup_path, Config, ExemptUser, CONFIG_ENV, DEFAULT_CONFIG_PATH, REPORT_CGROUP,
};
use crate::cgpath::CgroupPath;
use crate::device::MAX_MAJOR;

/// A config that could not be read or does not validate.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file named by `--config`, `config=` or `$GPUFENCE_CONFIG` is unreadable.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// TOML syntax error, at a line and column of the file.
    #[error("config {}:{line}:{col}: {msg}", path.display())]
    Syntax {
        /// The file.
        path: PathBuf,
        /// 1-based line.
        line: usize,
        /// 1-based column (in characters).
        col: usize,
        /// toml's message, on one line.
        msg: String,
    },
    /// A key that does not exist or has the wrong type or value.
    #[error("config {}: key `{key}`: {msg}", at_line(path, *line))]
    Key {
        /// The file.
        path: PathBuf,
        /// The 1-based line that sets the key, when the file sets it (a
        /// default that fails validation has none).
        line: Option<usize>,
        /// Dotted key path (`majors.nvidia`); `.` for the top level.
        key: String,
        /// What is wrong.
        msg: String,
    },
}

fn at_line(path: &Path, line: Option<usize>) -> String {
    match line {
        Some(l) => format!("{}:{l}", path.display()),
        None => path.display().to_string(),
    }
}

/// Builds the error for a bad `key` of the file at `path`; [`Config::parse`]
/// fills in the line.
fn key_err_in(path: &Path) -> impl Fn(&str, String) -> ConfigError + '_ {
    move |key: &str, msg: String| ConfigError::Key {
        path: path.to_path_buf(),
        line: None,
        key: key.to_string(),
        msg,
    }
}

/// Joins the lines of a message into one (toml's messages span several).
fn one_line(msg: &str) -> String {
    msg.split('\n')
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

/// The 1-based line of `text` that sets `key` (`a`, `a.b`, `a[3]`): the
/// `a = ...` line at the top level, or the `b = ...` line in table `[a]`,
/// or the `[a]` header itself.
fn key_line(text: &str, key: &str) -> Option<usize> {
    let mut parts = key.split('.');
    let first = parts.next()?;
    let first = first.split('[').next().unwrap_or(first).trim();
    let sub = parts
        .next()
        .map(|s| s.split('[').next().unwrap_or(s).trim());
    if first.is_empty() {
        return None;
    }
    let sets = |line: &str, k: &str| {
        let l = line.trim_start();
        let l = l
            .strip_prefix(k)
            .or_else(|| l.strip_prefix(&format!("\"{k}\"")));
        l.is_some_and(|rest| rest.trim_start().starts_with('='))
    };
    let mut table: Option<&str> = None;
    let mut header_line = None;
    for (i, raw) in text.lines().enumerate() {
        let l = raw.trim();
        if let Some(h) = l.strip_prefix('[').and_then(|h| h.split(']').next()) {
            table = Some(h.trim_start_matches('[').trim());
            if table == Some(first) {
                header_line = Some(i + 1);
            }
            continue;
        }
        match (table, sub) {
            (None, _) if sets(l, first) => return Some(i + 1),
            (Some(t), Some(s)) if t == first && sets(l, s) => return Some(i + 1),
            _ => {}
        }
    }
    header_line
}

/// Which file a config came from, for messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConfigOrigin {
    /// Read from this file.
    File(PathBuf),
    /// No file was named and [`DEFAULT_CONFIG_PATH`] is absent.
    Defaults,
}

impl fmt::Display for ConfigOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigOrigin::File(p) => write!(f, "{}", p.display()),
            ConfigOrigin::Defaults => write!(f, "built-in defaults ({DEFAULT_CONFIG_PATH} absent)"),
        }
    }
}

/// At most this many cgroups one `exempt_cgroups` pattern expands to
/// ([`Config::expand_exempt`]): a unit family (DGX OS's `nvsm*` units)
impl Config {
    /// Finds and loads the config: `explicit` (from `--config` / `config=`),
    /// else `$GPUFENCE_CONFIG` (read from `env`), else [`DEFAULT_CONFIG_PATH`]
    /// when it exists, else the defaults.
    ///
    /// # Errors
    /// [`ConfigError`] when a named file is unreadable or invalid.
    pub fn locate(
        explicit: Option<&Path>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<(Config, ConfigOrigin), ConfigError> {
        let named = explicit
            .map(Path::to_path_buf)
            .or_else(|| env(CONFIG_ENV).filter(|s| !s.is_empty()).map(PathBuf::from));
        let path = match named {
            Some(p) => p,
            None => {
                let d = PathBuf::from(DEFAULT_CONFIG_PATH);
                if !d.exists() {
                    return Ok((Config::default(), ConfigOrigin::Defaults));
                }
                d
            }
        };
        let cfg = Config::load(&path)?;
        Ok((cfg, ConfigOrigin::File(path)))
    }

    /// Reads and validates one file.
    ///
    /// # Errors
    /// [`ConfigError`] naming `path` and, for bad keys, the key.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::parse(&text, path)
    }

    /// Parses and validates TOML text read from `path`.
    ///
    /// # Errors
    /// [`ConfigError`] naming `path` and, for bad keys, the key.
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let table: toml::Table = toml::from_str(text).map_err(|e| {
            let at = e.span().map_or(0, |s| s.start).min(text.len());
            let before = text.get(..at).unwrap_or(text);
            ConfigError::Syntax {
                path: path.to_path_buf(),
                line: before.matches('\n').count() + 1,
                col: before.rsplit('\n').next().unwrap_or("").chars().count() + 1,
                msg: one_line(e.message()),
            }
        })?;
        let mut cfg: Config =
            serde_path_to_error::deserialize(toml::Value::Table(table)).map_err(|e| {
                let key = e.path().to_string();
                ConfigError::Key {
                    path: path.to_path_buf(),
                    line: key_line(text, &key),
                    key,
                    msg: one_line(&e.into_inner().to_string()),
                }
            })?;
        cfg.validate(path).map_err(|e| match e {
            ConfigError::Key { path, key, msg, .. } => ConfigError::Key {
                line: key_line(text, &key),
                path,
                key,
                msg,
            },
            other => other,
        })?;
        Ok(cfg)
    }

    /// Checks what serde cannot, one group of keys at a time in this order,
    /// and returns the first error found (with `line: None`; [`parse`] fills
    /// it in).
    ///
    /// [`parse`]: Config::parse
    fn validate(&mut self, path: &Path) -> Result<(), ConfigError> {
        self.validate_cgroup_root_and_exemptions(path)?;
        self.validate_majors(path)?;
        self.validate_absolute_paths(path)?;
        self.validate_exec_cgroup(path)?;
        self.validate_sweep_fail_severity(path)?;
        self.validate_exempt_identities(path)?;
        self.validate_mps_dir(path)?;
        self.validate_limits(path)
    }

    /// `cgroup_root` and `exempt_cgroups`, normalised in place; no exempt
    /// cgroup may be the cgroup2 root, contain the fenced subtree or be where
    /// job reports are written.
    fn validate_cgroup_root_and_exemptions(&mut self, path: &Path) -> Result<(), ConfigError> {
        let key_err = key_err_in(path);
        let root = CgroupPath::parse(&self.cgroup_root)
            .map_err(|e| key_err("cgroup_root", e.to_string()))?;
        // The report writers run the user's own process there: an
        // exemption would hand it every GPU.
        let reports = root.join_path(&CgroupPath::parse(REPORT_CGROUP).expect("a cgroup name"));
        for (i, e) in self.exempt_cgroups.iter_mut().enumerate() {
            let p = &mut e.cgroup;
            let n = CgroupPath::parse(p)
                .map_err(|e| key_err(&format!("exempt_cgroups[{i}]"), e.to_string()))?;
            if n.is_root() {
                return Err(key_err(
                    &format!("exempt_cgroups[{i}]"),
                    "the cgroup2 root cannot be exempt: that would open every GPU to every process"
                        .into(),
                ));
            }
            // An exempt cgroup at or above the fenced subtree's root would
            // exempt every process the fence is meant to stop.
            if root.is_under(&n) {
                return Err(key_err(
                    &format!("exempt_cgroups[{i}]"),
                    format!("{n} contains the fenced subtree {root}: exempting it would open every GPU to every process"),
                ));
            }
            if n.is_under(&reports) {
                return Err(key_err(
                    &format!("exempt_cgroups[{i}]"),
                    format!("{n} is where job reports are written as the job's user: it is never exempt"),
                ));
            }
            check_exempt_pattern(&n).map_err(|e| key_err(&format!("exempt_cgroups[{i}]"), e))?;
            *p = n.into_string();
        }
        self.cgroup_root = root.into_string();
        Ok(())
    }

    /// `majors`, when set: every major in 1..=[`MAX_MAJOR`], and not empty.
    fn validate_majors(&self, path: &Path) -> Result<(), ConfigError> {
        let key_err = key_err_in(path);
        if let Some(m) = &self.majors {
            for (name, major) in m {
                if *major == 0 || *major > MAX_MAJOR {
                    return Err(key_err(
                        &format!("majors.{name}"),
                        format!("{major} is not a valid character major (1..={MAX_MAJOR})"),
                    ));
                }
            }
            if m.is_empty() {
                return Err(key_err(
                    "majors",
                    "an empty table protects nothing; remove it to use /proc/devices".into(),
                ));
            }
        }
        Ok(())
    }

    /// Every directory, file and binary key is an absolute path.
    fn validate_absolute_paths(&self, path: &Path) -> Result<(), ConfigError> {
        let key_err = key_err_in(path);
        for (key, p) in [
            ("bpffs_dir", &self.bpffs_dir),
            ("state_dir", &self.state_dir),
            ("audit_log", &self.audit_log),
            ("evidence_dir", &self.evidence_dir),
            ("dev_dir", &self.dev_dir),
            ("slurmd_bin", &self.slurmd_bin),
            ("scontrol_bin", &self.scontrol_bin),
            ("proc_dir", &self.proc_dir),
            ("cron_spool_dir", &self.cron_spool_dir),
            ("systemd_system_dir", &self.systemd_system_dir),
            ("login_defs", &self.login_defs),
            ("mps_dir", &self.mps_dir),
        ]
        .into_iter()
        .chain(self.passwd_file.as_ref().map(|p| ("passwd_file", p)))
        .chain(self.mps_control.as_ref().map(|p| ("mps_control", p)))
        .chain(self.job_map_dir.as_ref().map(|p| ("job_map_dir", p)))
        {
            if !p.is_absolute() {
                return Err(key_err(
                    key,
                    format!("{} is not an absolute path", p.display()),
                ));
            }
        }
        Ok(())
    }

    /// With `mps_control` set, `mps_dir` lies outside `state_dir` (root's
    /// alone, `0700`), where the jobs' MPS clients can reach it.
    fn validate_mps_dir(&self, path: &Path) -> Result<(), ConfigError> {
        if self.mps_control.is_some() && self.mps_dir.starts_with(&self.state_dir) {
            return Err(key_err_in(path)(
                "mps_dir",
                format!(
                    "{} is inside state_dir {}, which only root may enter: no job's MPS client could reach its pipe directory; use a directory outside it (the default is /run/gpufence-mps)",
                    self.mps_dir.display(),
                    self.state_dir.display()
                ),
            ));
        }
        Ok(())
    }

    /// `exec_cgroup` and `mps_cgroup`, normalised in place: two cgroups
    /// below `cgroup_root`, neither inside the other.
    fn validate_exec_cgroup(&mut self, path: &Path) -> Result<(), ConfigError> {
        let key_err = key_err_in(path);
        self.exec_cgroup = normalize_cgroup_path(&self.exec_cgroup)
            .map_err(|e| key_err("exec_cgroup", e.to_string()))?;
        if self.exec_cgroup.is_empty() {
            return Err(key_err(
                "exec_cgroup",
                "must name a cgroup below cgroup_root".into(),
            ));
        }
        self.mps_cgroup = normalize_cgroup_path(&self.mps_cgroup)
            .map_err(|e| key_err("mps_cgroup", e.to_string()))?;
        if self.mps_cgroup.is_empty() {
            return Err(key_err(
                "mps_cgroup",
                "must name a cgroup below cgroup_root".into(),
            ));
        }
        // Below or above the exempt exec cgroup, a daemon would be exempt,
        // or the exec cgroup's leaves in the MPS tree.
        let under = |a: &str, b: &str| a == b || a.starts_with(&format!("{b}/"));
        if under(&self.mps_cgroup, &self.exec_cgroup) || under(&self.exec_cgroup, &self.mps_cgroup)
        {
            return Err(key_err(
                "mps_cgroup",
                format!(
                    "{} must not be exec_cgroup ({}), below it or above it (its leaves are exempt)",
                    self.mps_cgroup, self.exec_cgroup
                ),
            ));
        }
        Ok(())
    }

    /// `sweep_fail_severity` is one of the sweep's severities.
    fn validate_sweep_fail_severity(&self, path: &Path) -> Result<(), ConfigError> {
        let key_err = key_err_in(path);
        for (key, v) in [
            ("sweep_fail_severity", &self.sweep_fail_severity),
            (
                "busy_without_process_severity",
                &self.busy_without_process_severity,
            ),
        ] {
            if !matches!(v.as_str(), "info" | "low" | "medium" | "high" | "critical") {
                return Err(key_err(
                    key,
                    format!("{v:?} is not one of info, low, medium, high, critical"),
                ));
            }
        }
        Ok(())
    }

    /// Each `exempt_cgroups` entry's users fit the fence program (1 to
    /// [`ExemptIdentities::MAX_UIDS`](crate::policy::ExemptIdentities::MAX_UIDS)
    /// users, uids at most `MAX_UID`, names not empty), the distinct user
    /// lists fit its classes, and `service_uids` is empty (it was removed:
    /// the error says how to rewrite it).
    fn validate_exempt_identities(&self, path: &Path) -> Result<(), ConfigError> {
        let key_err = key_err_in(path);
        use crate::policy::ExemptIdentities;
        if !self.service_uids.is_empty() {
            return Err(key_err(
                "service_uids",
                format!(
                    "removed: an exemption is a cgroup and its users, never a uid list for all of them; \
                     name each service account in its own entry instead, e.g. \
                     exempt_cgroups = [..., {{ cgroup = \"system.slice/nvidia-dcgm.service\", users = [{}] }}], \
                     and delete service_uids",
                    self.service_uids
                        .iter()
                        .map(u32::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
        let mut lists: std::collections::BTreeSet<std::collections::BTreeSet<&ExemptUser>> =
            std::collections::BTreeSet::new();
        lists.insert([&ExemptUser::Uid(0)].into());
        for (i, e) in self.exempt_cgroups.iter().enumerate() {
            let key = format!("exempt_cgroups[{i}].users");
            if e.users.is_empty() {
                return Err(key_err(
                    &key,
                    "empty: the entry would exempt no one; remove it, or name the service's users"
                        .into(),
                ));
            }
            if e.users.len() > ExemptIdentities::MAX_UIDS {
                return Err(key_err(
                    &key,
                    format!(
                        "{} users; at most {} per entry",
                        e.users.len(),
                        ExemptIdentities::MAX_UIDS
                    ),
                ));
            }
            for u in &e.users {
                match u {
                    ExemptUser::Uid(n) if *n > ExemptIdentities::MAX_UID => {
                        return Err(key_err(
                            &key,
                            format!("{n} is above {}", ExemptIdentities::MAX_UID),
                        ));
                    }
                    ExemptUser::Name(n) if n.is_empty() || n.contains(['/', ':', '\n']) => {
                        return Err(key_err(&key, format!("{n:?} is not a user name")));
                    }
                    _ => {}
                }
            }
            lists.insert(e.users.iter().collect());
        }
        if lists.len() > ExemptIdentities::MAX_CLASSES {
            return Err(key_err(
                "exempt_cgroups",
                format!(
                    "{} distinct user lists (root only counts as one); the fence program tells at most {} apart: \
                     give entries of the same service the same users",
                    lists.len(),
                    ExemptIdentities::MAX_CLASSES
                ),
            ));
        }
        Ok(())
    }

    /// The evidence sizes, `max_denials` and `max_grants`.
    fn validate_limits(&self, path: &Path) -> Result<(), ConfigError> {
        let key_err = key_err_in(path);
        for (key, v) in [
            ("evidence_hash_max_mib", self.evidence_hash_max_mib),
            ("evidence_max_mib", self.evidence_max_mib),
        ] {
            if v > 1 << 20 {
                return Err(key_err(key, format!("{v} MiB; at most 1048576 (1 TiB)")));
            }
        }
        if let Some(d) = self
            .epilog_deadline_ms
            .filter(|d| !(1000..=86_400_000).contains(d))
        {
            return Err(key_err(
                "epilog_deadline_ms",
                format!("{d} ms; 1000 to 86400000 (a day)"),
            ));
        }
        if self.max_denials == 0 {
            return Err(key_err("max_denials", "must be at least 1".into()));
        }
        if self.max_grants == 0 {
            return Err(key_err("max_grants", "must be at least 1".into()));
        }
        if self.resume_max == 0 {
            return Err(key_err("resume_max", "must be at least 1".into()));
        }
        if !(1..=31_536_000).contains(&self.resume_window_s) {
            return Err(key_err(
                "resume_window_s",
                format!("{} s; 1 to 31536000 (a year)", self.resume_window_s),
            ));
        }
        Ok(())
    }
}
