//! What a gpufence node does, as library calls shared by the prolog, the
//! epilog, the SPANK plugin and the admin CLI (which are thin shells over it).
//!
//! The folders tell a job's life, and import one way only:
//! [`host`] ← [`holders`] ← [`response`] ← {[`job`], [`sweep`], [`admin`]};
//! the last three never import each other (a test keeps it so:
//! `layers::imports_go_one_way`).
//!
//! - [`Node`]: the loaded config and the handles every operation needs.
//! - [`host`]: what the node is made of: processes and users, GPUs
//!   through NVML and the driver's files, Slurm's configuration and
//!   controller, the fence's install and records, gpufence's own exempt
//!   cgroup, draining the node.
//! - [`holders`]: who holds a protected device (the scan), what covers a
//!   holder (a grant, an exemption), shared-memory leftovers.
//! - [`response`]: the one response engine (pin, freeze, evidence, kill,
//!   verify) and its two callers' front ends: the job-end candidates and
//!   `gpufence respond PID`.
//! - [`job`]: the Prolog, the plugin's grant step, the Epilog, the user's
//!   report, `PrologFlags=RunInJob`.
//! - [`sweep`]: the node health check, one file per family of checks.
//! - [`admin`]: doctor, grants, `gpufence exec`.
//! - [`crashpoint`]: the named step boundaries tests crash the prolog, the
//!   grant step and the epilog at (`GPUFENCE_TEST_CRASH_AT`).

pub mod admin;
pub mod crashpoint;
pub mod error;
pub mod holders;
pub mod host;
pub mod job;
pub mod response;
pub mod sweep;

use gpufence_cgroup::Cgroup2;
use gpufence_model::audit::{events, AuditEvent, AuditLog};
use gpufence_model::config::{Config, ConfigOrigin};
use gpufence_model::procdevices::{parse_proc_devices, ProtectedMajors};
use gpufence_model::record::StateDir;

pub use error::NodeError;

/// The config and the handles derived from it.
#[derive(Clone, Debug)]
pub struct Node {
    /// The configuration.
    pub cfg: Config,
    /// Where it came from.
    pub origin: ConfigOrigin,
    /// The cgroup2 mount.
    pub cg: Cgroup2,
    /// `state_dir`.
    pub state: StateDir,
    /// `audit_log`.
    pub audit: AuditLog,
    /// The Slurm node this process acts for, when slurmd names it (`slurmd
    /// -N NAME`; the Prolog's `SLURMD_NODENAME`): `slurmd -G` gets it as `-N`,
    /// so that on a host running several slurmd (`MULTIPLE_SLURMD`) it lists
    /// this node's GPUs, not those of the first node whose `NodeHostname` is
    /// the host's. `None`: slurmd picks the node by hostname.
    pub slurm_node: Option<String>,
    /// Users and their names (`passwd_file`, then NSS within
    /// [`host::users::NSS_BUDGET`]), made on first use and shared by the
    /// node's clones: one resolver per run, so that an Epilog's candidates
    /// × devices ask NSS once per name, not once per question
    /// ([`Node::users`]; a long-lived `fence watch` takes a fresh one per
    /// rewrite, [`Node::afresh`]).
    users: std::sync::Arc<std::sync::OnceLock<host::users::Users>>,
    /// The Epilog's deadline ([`host::deadline`]), shared by the node's
    /// clones; `None` (the Prolog, the sweep, the CLI): every wait its own
    /// bound.
    deadline: Option<std::sync::Arc<host::deadline::Deadline>>,
}

impl Node {
    /// Builds a node from a loaded config; finds the cgroup2 mount.
    ///
    /// # Errors
    /// [`NodeError::Kernel`] when there is no cgroup2 mount.
    pub fn new(cfg: Config, origin: ConfigOrigin) -> Result<Self, NodeError> {
        let cg = Cgroup2::discover()?;
        Ok(Node {
            state: StateDir::new(&cfg.state_dir),
            audit: AuditLog::new(&cfg.audit_log),
            cfg,
            origin,
            cg,
            slurm_node: None,
            users: Default::default(),
            deadline: None,
        })
    }

    /// The host's users ([`host::users::Users`]: `passwd_file`, then NSS),
    /// asked once per node and run; answers (and NSS's budget) are kept.
    pub fn users(&self) -> &host::users::Users {
        self.users
            .get_or_init(|| host::users::Users::new(self.cfg.passwd_file.as_deref()))
    }

    /// This node with no users asked yet: for a long-lived process (`fence
    /// watch`) that must see accounts made since its last question.
    pub fn afresh(&self) -> Node {
        Node {
            users: Default::default(),
            ..self.clone()
        }
    }

    /// This node acting for Slurm node `name` ([`Node::slurm_node`]).
    pub fn for_slurm_node(&self, name: Option<&str>) -> Node {
        Node {
            slurm_node: name.map(str::to_string),
            ..self.clone()
        }
    }

    /// This node with every wait bound by `deadline` ([`Node::bound`]).
    pub fn with_deadline(&self, deadline: std::sync::Arc<host::deadline::Deadline>) -> Node {
        Node {
            deadline: Some(deadline),
            ..self.clone()
        }
    }

    /// The deadline this node's waits are bound by, if any.
    pub fn deadline(&self) -> Option<&host::deadline::Deadline> {
        self.deadline.as_deref()
    }

    /// How long `wait`, whose own bound is `configured`, may wait:
    /// `configured`, cut by the deadline when there is one
    /// ([`host::deadline::Deadline::bound`]).
    pub fn bound(
        &self,
        wait: host::deadline::Wait,
        configured: std::time::Duration,
    ) -> std::time::Duration {
        match &self.deadline {
            Some(d) => d.bound(wait, configured),
            None => configured,
        }
    }

    /// Loads the config (`explicit`, else `$GPUFENCE_CONFIG`, else the
    /// default path) and builds the node.
    ///
    /// # Errors
    /// [`NodeError::Config`] or [`NodeError::Kernel`].
    pub fn load(explicit: Option<&std::path::Path>) -> Result<Self, NodeError> {
        let (cfg, origin) = Config::locate(explicit, |k| std::env::var(k).ok())?;
        Node::new(cfg, origin)
    }

    /// The protected majors: the `[majors]` table, else every `nvidia*`
    /// character driver in `/proc/devices`.
    ///
    /// # Errors
    /// [`NodeError::Io`] / [`NodeError::Parse`] for `/proc/devices`.
    pub fn protected_majors(&self) -> Result<ProtectedMajors, NodeError> {
        if let Some(t) = &self.cfg.majors {
            return Ok(ProtectedMajors::from_table(t));
        }
        let path = std::path::Path::new("/proc/devices");
        let text = std::fs::read_to_string(path).map_err(|e| NodeError::io("read", path, e))?;
        Ok(ProtectedMajors::from_proc_devices(&parse_proc_devices(
            &text, path,
        )?))
    }

    /// Appends an audit event. A failure is returned so that callers that
    /// grant can refuse to proceed without a record of it.
    ///
    /// # Errors
    /// [`NodeError::Audit`].
    pub fn audit(&self, ev: AuditEvent) -> Result<(), NodeError> {
        self.audit.append(&ev).map_err(NodeError::Audit)
    }

    /// The major of `/dev/nvidia<minor>`: the one `/proc/devices` (or the
    /// table) names `nvidia` / `nvidia-frontend`, else 195.
    pub fn gpu_major(&self) -> u32 {
        let p = self.protected_majors().unwrap_or_default();
        ["nvidia", "nvidia-frontend", "nvidiactl"]
            .iter()
            .find_map(|n| p.major_of(n))
            .unwrap_or(gpufence_model::procdevices::NVIDIA_MAJOR)
    }

    /// NVML as the config says; when it is unavailable, says so once in
    /// the audit log (again only when the reason changes), via a note in
    /// `state_dir`.
    pub fn open_gpus(&self) -> host::gpus::Gpus {
        let g = host::gpus::Gpus::open(&self.cfg);
        let marker = self.state.nvml_unavailable_path();
        match &g.unavailable {
            Some(why) => {
                let _ = gpufence_model::fsutil::create_dir_all_mode(self.state.root(), 0o700);
                // Compare and write under an exclusive lock on state_dir:
                // fifty prologs starting at once otherwise each find no
                // note and each write the line (issue 8, concurrency test).
                // Released when `dir` closes at the end of this arm.
                let dir = std::fs::File::open(self.state.root()).ok();
                if let Some(d) = &dir {
                    let _ = gpufence_model::fsutil::lock_exclusive(d);
                }
                if std::fs::read_to_string(&marker).ok().as_deref() != Some(why.as_str()) {
                    let _ = gpufence_model::fsutil::write_atomic(&marker, why.as_bytes(), 0o600);
                    let _ = self.audit(
                        AuditEvent::new(events::NVML_UNAVAILABLE)
                            .field("reason", why.clone())
                            .field("fallback", "descriptor scan only"),
                    );
                }
            }
            None => {
                let _ = std::fs::remove_file(&marker);
            }
        }
        g
    }

    /// A failed NVML query (`what`, error `e`) of job `job_id`'s Prolog
    /// or Epilog, by `nvml_failure`: `true` under `drain` (the caller
    /// fails the hook); under `report` a `check_failed` audit line and
    /// `false` (the caller goes on with the descriptor scan's answer).
    pub fn nvml_failed(&self, job_id: u32, what: &str, e: &dyn std::fmt::Display) -> bool {
        use gpufence_model::config::NvmlFailure;
        match self.cfg.nvml_failure {
            NvmlFailure::Drain => true,
            NvmlFailure::Report => {
                let _ = self.audit(
                    AuditEvent::new(events::CHECK_FAILED)
                        .job(job_id)
                        .field("component", "nvml")
                        .field("reason", format!("{what}: {e}"))
                        .field("policy", "nvml_failure = report: the descriptor scan alone"),
                );
                false
            }
        }
    }

    /// The cgroup `gpufence exec` runs commands in (relative to the mount).
    pub fn exec_cgroup(&self) -> String {
        join_cgroup(&self.cfg.cgroup_root, &self.cfg.exec_cgroup)
    }

    /// The cgroup (relative to the mount) of job `job_id` in the `own`
    /// layout: `<cgroup_root>/job_<id>`.
    pub fn own_job_cgroup(&self, job_id: u32) -> String {
        join_cgroup(&self.cfg.cgroup_root, &format!("job_{job_id}"))
    }
}

/// Joins cgroup path parts, `""` being the root: [`CgroupPath::join`]
/// (both normalised first). Text that is not a cgroup path (`..`) is
/// joined as text.
///
/// [`CgroupPath::join`]: gpufence_model::CgroupPath::join
pub fn join_cgroup(a: &str, b: &str) -> String {
    match gpufence_model::CgroupPath::parse(a).and_then(|a| a.join(b)) {
        Ok(p) => p.into_string(),
        Err(_) => match (a.is_empty(), b.is_empty()) {
            (true, _) => b.to_string(),
            (_, true) => a.to_string(),
            _ => format!("{a}/{b}"),
        },
    }
}

/// Whether cgroup `path` is `root` or below it, component by component:
/// [`CgroupPath::is_under`] (both normalised first). A text that is not a
/// cgroup path (`..`) is under nothing but the root.
///
/// [`CgroupPath::is_under`]: gpufence_model::CgroupPath::is_under
pub fn is_under(path: &str, root: &str) -> bool {
    use gpufence_model::CgroupPath;
    match (CgroupPath::parse(path), CgroupPath::parse(root)) {
        (Ok(p), Ok(r)) => p.is_under(&r),
        _ => root.is_empty(),
    }
}

#[cfg(test)]
mod layers {
    //! The folders import one way: `host` ← `holders` ← `response` ←
    //! {`job`, `sweep`, `admin`}, and those three never import each other.
    //! Read from the sources (product code: what comes before a file's
    //! `#[cfg(test)]`; comments aside).

    use std::path::Path;

    const LAYERS: [(&str, u8); 6] = [
        ("host", 0),
        ("holders", 1),
        ("response", 2),
        ("job", 3),
        ("sweep", 3),
        ("admin", 3),
    ];

    fn rank(name: &str) -> Option<u8> {
        LAYERS.iter().find(|(n, _)| *n == name).map(|(_, r)| *r)
    }

    /// The layers `text` names as `crate::<layer>`, in `use crate::{..}`
    /// lists too (one level of braces).
    fn named_layers(text: &str) -> Vec<String> {
        let mut out = Vec::new();
        for (at, _) in text.match_indices("crate::") {
            let rest = &text[at + "crate::".len()..];
            if let Some(list) = rest.strip_prefix('{') {
                let body = &list[..list.find('}').unwrap_or(list.len())];
                out.extend(
                    body.split([',', '{'])
                        .map(|p| p.trim().split("::").next().unwrap_or("").to_string()),
                );
            } else {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                out.push(name);
            }
        }
        out.retain(|n| rank(n).is_some());
        out
    }

    fn product_code(text: &str) -> String {
        let code = text.split("#[cfg(test)]").next().unwrap_or("");
        code.lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn imports_go_one_way() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut bad = Vec::new();
        let mut files = 0;
        for (layer, r) in LAYERS {
            let dir = src.join(layer);
            let mut stack = vec![dir];
            while let Some(d) = stack.pop() {
                for e in std::fs::read_dir(&d).unwrap().flatten() {
                    let p = e.path();
                    if p.is_dir() {
                        stack.push(p);
                        continue;
                    }
                    files += 1;
                    let text = product_code(&std::fs::read_to_string(&p).unwrap());
                    for other in named_layers(&text) {
                        let ro = rank(&other).unwrap();
                        if other != layer && ro >= r {
                            bad.push(format!("{} imports crate::{other}", p.display()));
                        }
                    }
                }
            }
        }
        assert!(files > 20, "only {files} files read");
        bad.sort();
        bad.dedup();
        assert!(
            bad.is_empty(),
            "imports against the layers:\n{}",
            bad.join("\n")
        );
    }

    #[test]
    fn the_check_sees_both_forms() {
        assert_eq!(
            named_layers(
                "use crate::{host::drain, job::prolog, Node};\nlet x = crate::sweep::f();"
            ),
            ["host", "job", "sweep"]
        );
    }
}

#[cfg(test)]
mod audit_vocabulary {
    //! Every audit event the node layer and the programs write is named in
    //! `gpufence_model::audit::events` (its one vocabulary, which
    //! SECURITY.md's table names exactly): an event written with a literal
    //! name (`AuditEvent::new("...")`) must be a name of that vocabulary.

    use std::path::{Path, PathBuf};

    fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                rust_files(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }

    #[test]
    fn literal_event_names_are_in_the_vocabulary() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut files = Vec::new();
        for dir in [
            "node/src",
            "cli/src",
            "prolog/src",
            "epilog/src",
            "spank-plugin/src",
        ] {
            rust_files(&root.join(dir), &mut files);
        }
        assert!(files.len() > 20, "only {} files read", files.len());
        let mut unknown = Vec::new();
        for p in &files {
            let text = std::fs::read_to_string(p).unwrap();
            let code = text.split("#[cfg(test)]").next().unwrap_or("");
            for (at, _) in code.match_indices("AuditEvent::new(\"") {
                let rest = &code[at + "AuditEvent::new(\"".len()..];
                let name = &rest[..rest.find('"').unwrap_or(0)];
                if !gpufence_model::audit::events::ALL.contains(&name) {
                    unknown.push(format!("{}: {name}", p.display()));
                }
            }
        }
        assert!(
            unknown.is_empty(),
            "audit events outside gpufence_model::audit::events:\n{}",
            unknown.join("\n")
        );
    }
}
