//! The audit log: JSON Lines, one object per event.
//!
//! Every object has `ts` (RFC 3339, UTC) and `event`; `job_id`, `uid`,
//! `pid` and `devices` appear where they apply; other fields are event
//! specific. Concurrent prologs, plugins and epilogs append to one file: each
//! event is one `write(2)` of a whole line on an `O_APPEND` descriptor under
//! an exclusive `flock(2)`, so lines never interleave or get lost.

use std::fs::OpenOptions;
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::{Map, Value};

use crate::fsutil::{create_dir_all_mode, lock_exclusive};
use crate::record::now_rfc3339;

/// Names of the events gpufence writes.
pub mod events {
    /// The fence was attached or its program replaced.
    pub const FENCE_INSTALLED: &str = "fence_installed";
    /// The fence was detached and its pins removed.
    pub const FENCE_REMOVED: &str = "fence_removed";
    /// The prolog recorded a job's devices.
    pub const GRANT_RECORDED: &str = "grant_recorded";
    /// The plugin put a job's grant into the fence for a cgroup.
    pub const GRANT_APPLIED: &str = "grant_applied";
    /// The plugin could not apply a grant: the step has no GPU access.
    pub const GRANT_REFUSED: &str = "grant_refused";
    /// The epilog removed a job's grant from the fence.
    pub const GRANT_REVOKED: &str = "grant_revoked";
    /// A process holds a job's device after the job and outside any grant.
    pub const LINGERING_PROCESS: &str = "lingering_process";
    /// A lingering process was killed and is gone.
    pub const PROCESS_KILLED: &str = "process_killed";
    /// A lingering process could not be killed.
    pub const SURVIVOR: &str = "survivor";
    /// Something went wrong that an admin must look at.
    pub const ERROR: &str = "error";
    /// A job left files in the shared-memory directory that no process
    /// holds (name, size, mode; removed or not).
    pub const SHM_LEFTOVERS: &str = "shm_leftovers";
    /// Configured exemptions were put (back) into the fence without a
    /// reinstall: an exempt service's cgroup was recreated with a new id
    /// (`gpufence fence watch`).
    pub const EXEMPTION_APPLIED: &str = "exemption_applied";
    /// A scan for the holders of a job's devices did not read some
    /// processes to their end within `scan_budget_ms` (other than the
    /// job's own and its user's outside every job, which are candidates):
    /// each read again alone; `not_read` lists those still unread (the
    /// Epilog drains, the Prolog fails; never killed).
    pub const SCAN_OVER_BUDGET: &str = "scan_over_budget";
    /// A driver registered an NVIDIA major after the install (uvm loaded
    /// later): the fence protects it now.
    pub const MAJORS_ADDED: &str = "majors_added";
    /// NVML is unavailable: the scans read descriptors only. Said once,
    /// again only when the reason changes.
    pub const NVML_UNAVAILABLE: &str = "nvml_unavailable";
    /// An NVML query failed in the Prolog or the Epilog and
    /// `nvml_failure = "report"`: the job's GPUs were judged by the
    /// descriptor scan alone (fields `component`, `reason`, `job_id`).
    pub const CHECK_FAILED: &str = "check_failed";
    /// An Epilog of a job an earlier Epilog already ended (slurmd ran it
    /// again): nothing revoked, scanned, killed or drained (field
    /// `ended_at`).
    pub const EPILOG_REPEATED: &str = "epilog_repeated";
    /// The Prolog removed what an earlier job with the same id left
    /// behind: grants, applied notes, its `own`-layout cgroup.
    pub const STALE_JOB_STATE: &str = "stale_job_state";
    /// gpufence's MPS control daemon for a gres/mps job's GPU started.
    pub const MPS_STARTED: &str = "mps_started";
    /// The Epilog of a GPU's last gres/mps job stopped its MPS control
    /// daemon.
    pub const MPS_STOPPED: &str = "mps_stopped";
    /// A process of a foreign uid (neither root nor the daemon's user) in
    /// one of gpufence's per-user MPS daemon cgroups, found by an MPS
    /// Prolog or Epilog and killed.
    pub const MPS_FOREIGN_PROCESS: &str = "mps_foreign_process";
    /// The evidence of a response outgrew its budget: executables not
    /// hashed, records cut or left out.
    pub const EVIDENCE_BUDGET: &str = "evidence_budget";
    /// A process an interrupted response left stopped was killed (or was
    /// already gone).
    pub const INTERRUPTED_RESPONSE: &str = "interrupted_response";
    /// The job's `--gpufence-report` was written, as the job's user.
    pub const REPORT_WRITTEN: &str = "report_written";
    /// The job's `--gpufence-report` could not be written.
    pub const REPORT_FAILED: &str = "report_failed";
    /// Processes of `slurmd -G` outlived `SIGKILL`: its cgroup is left to
    /// the next run.
    pub const SLURMD_G_CGROUP_LEFT: &str = "slurmd_g_cgroup_left";
    /// `gpufence exec` started a command in the exempt cgroup.
    pub const EXEC_START: &str = "exec_start";
    /// The command of `gpufence exec` ended.
    pub const EXEC_END: &str = "exec_end";
    /// Processes the command of `gpufence exec` left in its exempt leaf
    /// were ended.
    pub const EXEC_LEFTOVER: &str = "exec_leftover";
    /// `gpufence sweep` revoked a grant whose cgroup no longer exists.
    pub const GRANT_COLLECTED: &str = "grant_collected";
    /// `gpufence sweep --drain` drained the node.
    pub const SWEEP_DRAINED: &str = "sweep_drained";
    /// `gpufence respond PID` refused to touch the process: nothing done.
    pub const RESPOND_REFUSED: &str = "respond_refused";
    /// `gpufence respond PID` stopped the process tree.
    pub const RESPOND_FROZEN: &str = "respond_frozen";
    /// `gpufence respond PID` wrote the evidence and incident files.
    pub const RESPOND_EVIDENCE: &str = "respond_evidence";
    /// `gpufence respond PID` sent `SIGKILL` to the tree.
    pub const RESPOND_KILLED: &str = "respond_killed";
    /// Members of the tree `gpufence respond PID` killed outlived
    /// `SIGKILL`.
    pub const RESPOND_SURVIVOR: &str = "respond_survivor";
    /// `gpufence respond PID` listed the persistence entries of the
    /// process's user (never deleted).
    pub const RESPOND_PERSISTENCE: &str = "respond_persistence";
    /// `gpufence respond PID --drain` drained the node.
    pub const RESPOND_DRAINED: &str = "respond_drained";
    /// `gpufence respond PID --drain` could not drain the node.
    pub const RESPOND_DRAIN_FAILED: &str = "respond_drain_failed";
    /// `gpufence sweep` (`resume_when_clean`) resumed a node gpufence had
    /// drained, its cause gone: the old reason, when it was drained, the
    /// resumes within `resume_window_s` with this one, and the drain's job
    /// and devices when its record has them.
    pub const NODE_RESUMED: &str = "node_resumed";
    /// `gpufence sweep` found the cause of its drain gone for the
    /// `resume_max`th time within `resume_window_s`: the node stays drained
    /// with a reason saying it flaps, for an admin.
    pub const NODE_FLAPPING: &str = "node_flapping";
    /// The Epilog cut waits to end within its deadline
    /// (`epilog_deadline_ms`): the deadline, where it came from, the time
    /// taken, one line per wait cut.
    pub const EPILOG_DEADLINE: &str = "epilog_deadline";
    /// Credentials found in a batch job's script or submission
    /// environment, once per job (the batch step): `action` (`warn`,
    /// `refuse`), `findings` (each `rule`, `kind`, `place`, `hmac_8`:
    /// the first 8 hex digits of the HMAC-SHA256 of the match under the
    /// node's key, `state_dir/door.key`; never the value), `unread` (variables past the bound), `truncated` (a script
    /// longer than its first MiB).
    pub const JOB_SECRET: &str = "job_secret";
    /// A step names a container image by tag and not by digest, or from a
    /// registry outside `container_registries`: `action`, `step`,
    /// `images` (each `image`, `registry`, `source`, `issue`).
    pub const CONTAINER_IMAGE: &str = "container_image";

    /// Every event name above: the vocabulary SECURITY.md's table of
    /// audit events names, no more, no less (tested).
    pub const ALL: &[&str] = &[
        FENCE_INSTALLED,
        FENCE_REMOVED,
        GRANT_RECORDED,
        GRANT_APPLIED,
        GRANT_REFUSED,
        GRANT_REVOKED,
        LINGERING_PROCESS,
        PROCESS_KILLED,
        SURVIVOR,
        ERROR,
        SHM_LEFTOVERS,
        EXEMPTION_APPLIED,
        SCAN_OVER_BUDGET,
        MAJORS_ADDED,
        NVML_UNAVAILABLE,
        CHECK_FAILED,
        EPILOG_REPEATED,
        EPILOG_DEADLINE,
        STALE_JOB_STATE,
        MPS_STARTED,
        MPS_STOPPED,
        MPS_FOREIGN_PROCESS,
        EVIDENCE_BUDGET,
        INTERRUPTED_RESPONSE,
        REPORT_WRITTEN,
        REPORT_FAILED,
        SLURMD_G_CGROUP_LEFT,
        EXEC_START,
        EXEC_END,
        EXEC_LEFTOVER,
        GRANT_COLLECTED,
        SWEEP_DRAINED,
        RESPOND_REFUSED,
        RESPOND_FROZEN,
        RESPOND_EVIDENCE,
        RESPOND_KILLED,
        RESPOND_SURVIVOR,
        RESPOND_PERSISTENCE,
        RESPOND_DRAINED,
        RESPOND_DRAIN_FAILED,
        NODE_RESUMED,
        NODE_FLAPPING,
        JOB_SECRET,
        CONTAINER_IMAGE,
    ];
}

/// One audit event, built with the setters and written by [`AuditLog::append`].
#[derive(Clone, Debug, Serialize)]
pub struct AuditEvent {
    event: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    job_id: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    uid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pid: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    devices: Option<Vec<String>>,
    #[serde(flatten)]
    fields: Map<String, Value>,
}

impl AuditEvent {
    /// An event named `event` (see [`events`]).
    pub fn new(event: &str) -> Self {
        AuditEvent {
            event: event.to_string(),
            job_id: None,
            uid: None,
            pid: None,
            devices: None,
            fields: Map::new(),
        }
    }
    /// Sets `job_id`.
    pub fn job(mut self, job_id: u32) -> Self {
        self.job_id = Some(job_id);
        self
    }
    /// Sets `uid`.
    pub fn uid(mut self, uid: u32) -> Self {
        self.uid = Some(uid);
        self
    }
    /// Sets `pid`.
    pub fn pid(mut self, pid: i32) -> Self {
        self.pid = Some(pid);
        self
    }
    /// Sets `devices`, each written with its `Display` form.
    pub fn devices<I, D>(mut self, devices: I) -> Self
    where
        I: IntoIterator<Item = D>,
        D: std::fmt::Display,
    {
        self.devices = Some(devices.into_iter().map(|d| d.to_string()).collect());
        self
    }
    /// Adds an event-specific field. Keys `ts`, `event`, `job_id`, `uid`,
    /// `pid`, `devices` are reserved and ignored here.
    pub fn field(mut self, key: &str, value: impl Into<Value>) -> Self {
        if !matches!(key, "ts" | "event" | "job_id" | "uid" | "pid" | "devices") {
            self.fields.insert(key.to_string(), value.into());
        }
        self
    }

    /// The event's name.
    pub fn name(&self) -> &str {
        &self.event
    }

    /// The JSON line (with `ts` set to now, and a trailing newline).
    pub fn to_line(&self) -> Vec<u8> {
        let mut obj = Map::new();
        obj.insert("ts".into(), Value::String(now_rfc3339()));
        if let Ok(Value::Object(m)) = serde_json::to_value(self) {
            obj.extend(m);
        }
        let mut line = serde_json::to_vec(&Value::Object(obj)).unwrap_or_default();
        line.push(b'\n');
        line
    }
}

/// The audit log file.
#[derive(Clone, Debug)]
pub struct AuditLog {
    path: PathBuf,
}

impl AuditLog {
    /// The log at `path` (created on first append, with its directory).
    pub fn new(path: impl Into<PathBuf>) -> Self {
        AuditLog { path: path.into() }
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one event as one line.
    ///
    /// # Errors
    /// The `io::Error` of `mkdir`, `open`, `flock` or `write`, with the path.
    pub fn append(&self, ev: &AuditEvent) -> io::Result<()> {
        let with_path = |e: io::Error| {
            io::Error::new(e.kind(), format!("audit log {}: {e}", self.path.display()))
        };
        if let Some(dir) = self.path.parent() {
            create_dir_all_mode(dir, 0o750).map_err(with_path)?;
        }
        let mut f = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .mode(0o640)
            .custom_flags(libc::O_CLOEXEC)
            .open(&self.path)
            .map_err(with_path)?;
        // Released when `f` closes.
        lock_exclusive(&f).map_err(with_path)?;
        // A writer killed in the middle of its write(2) leaves a line
        // without its newline: start on a fresh line, so only that line is
        // lost, not this one too.
        let mut line = ev.to_line();
        if !ends_with_newline(&f) {
            line.insert(0, b'\n');
        }
        f.write_all(&line).map_err(with_path)
    }
}

/// Whether the file is empty or its last byte is a newline (read with
/// `pread`, which an `O_APPEND` descriptor allows).
fn ends_with_newline(f: &std::fs::File) -> bool {
    use std::os::unix::fs::FileExt;
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    if len == 0 {
        return true;
    }
    let mut b = [0u8; 1];
    // An unreadable tail: assume the worst, an empty line costs nothing.
    f.read_exact_at(&mut b, len - 1).is_ok() && b[0] == b'\n'
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn repo_file(name: &str) -> String {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(name);
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    /// The names `pub const X: &str = "name";` gives in `mod events`.
    fn declared_events() -> Vec<String> {
        let src = repo_file("model/src/audit.rs");
        let body = src
            .split("pub mod events {")
            .nth(1)
            .and_then(|b| b.split("\n}\n").next())
            .expect("mod events");
        body.lines()
            .filter_map(|l| {
                let rest = l.trim().strip_prefix("pub const ")?;
                let (_, value) = rest.split_once(": &str = \"")?;
                Some(value.strip_suffix("\";")?.to_string())
            })
            .collect()
    }

    #[test]
    fn the_vocabulary_is_every_declared_name_once() {
        let declared = declared_events();
        let all: Vec<String> = events::ALL.iter().map(|s| s.to_string()).collect();
        let unique: BTreeSet<&String> = all.iter().collect();
        assert_eq!(unique.len(), all.len(), "a name twice in ALL: {all:?}");
        assert_eq!(
            declared.iter().collect::<BTreeSet<_>>(),
            unique,
            "events::ALL and the constants of mod events differ"
        );
        for n in &all {
            assert!(
                !n.is_empty() && n.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{n:?}"
            );
        }
    }

    /// SECURITY.md's table of audit events (section "The audit log", one
    /// row per event, the name first in backquotes) names exactly the
    /// vocabulary; README.md lists none of its own but points there.
    #[test]
    fn security_md_names_exactly_the_vocabulary() {
        let doc = repo_file("SECURITY.md");
        let section = doc
            .split("\n## The audit log\n")
            .nth(1)
            .expect("SECURITY.md has a section \"## The audit log\"");
        let section = section.split("\n## ").next().unwrap_or(section);
        let rows: Vec<&str> = section
            .lines()
            .filter_map(|l| l.strip_prefix("| `")?.split('`').next())
            .collect();
        let listed: BTreeSet<&str> = rows.iter().copied().collect();
        assert_eq!(listed.len(), rows.len(), "an event listed twice: {rows:?}");
        let vocabulary: BTreeSet<&str> = events::ALL.iter().copied().collect();
        assert_eq!(
            listed.difference(&vocabulary).collect::<Vec<_>>(),
            Vec::<&&str>::new(),
            "in SECURITY.md, not in audit::events"
        );
        assert_eq!(
            vocabulary.difference(&listed).collect::<Vec<_>>(),
            Vec::<&&str>::new(),
            "in audit::events, not in SECURITY.md"
        );
        let readme = repo_file("README.md");
        assert!(
            readme.contains("SECURITY.md#the-audit-log"),
            "README.md's audit log paragraph points to SECURITY.md's table"
        );
    }

    #[test]
    fn a_torn_last_line_does_not_swallow_the_next() {
        let d = tempfile::tempdir().unwrap();
        let log = AuditLog::new(d.path().join("audit.jsonl"));
        log.append(&AuditEvent::new("first")).unwrap();
        // A writer killed mid-line.
        let mut f = OpenOptions::new().append(true).open(log.path()).unwrap();
        f.write_all(b"{\"ts\":\"2026-").unwrap();
        drop(f);
        log.append(&AuditEvent::new("second")).unwrap();
        let text = std::fs::read_to_string(log.path()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert_eq!(lines[1], "{\"ts\":\"2026-");
        let second: Value = serde_json::from_str(lines[2]).unwrap();
        assert_eq!(second["event"], "second");
        assert!(text.ends_with('\n'));
    }

    #[test]
    fn lines_carry_ts_event_and_fields() {
        let ev = AuditEvent::new(events::GRANT_RECORDED)
            .job(42)
            .uid(1000)
            .devices(["195:0 rw /dev/nvidia0"])
            .field("ts", "spoof")
            .field("step", "batch");
        let v: Value = serde_json::from_slice(&ev.to_line()).unwrap();
        assert_eq!(v["event"], "grant_recorded");
        assert_eq!(v["job_id"], 42);
        assert_eq!(v["uid"], 1000);
        assert_eq!(v["devices"][0], "195:0 rw /dev/nvidia0");
        assert_eq!(v["step"], "batch");
        let ts = v["ts"].as_str().unwrap();
        assert!(chrono::DateTime::parse_from_rfc3339(ts).is_ok(), "{ts}");
        assert!(v.get("pid").is_none());
    }

    #[test]
    fn concurrent_appends_never_interleave() {
        let d = tempfile::tempdir().unwrap();
        let log = AuditLog::new(d.path().join("sub/audit.jsonl"));
        let big = "x".repeat(20_000); // larger than PIPE_BUF and a page
        std::thread::scope(|s| {
            for t in 0..8 {
                let log = log.clone();
                let big = big.clone();
                s.spawn(move || {
                    for i in 0..50 {
                        log.append(
                            &AuditEvent::new("t")
                                .job(t)
                                .pid(i)
                                .field("pad", big.as_str()),
                        )
                        .unwrap();
                    }
                });
            }
        });
        let text = std::fs::read_to_string(log.path()).unwrap();
        let mut seen = BTreeSet::new();
        for line in text.lines() {
            let v: Value = serde_json::from_str(line).expect("every line is whole JSON");
            assert!(seen.insert((v["job_id"].as_u64().unwrap(), v["pid"].as_i64().unwrap())));
        }
        assert_eq!(seen.len(), 400);
    }
}
