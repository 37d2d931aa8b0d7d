//! The job's door: what the plugin checks in slurmstepd at a step's start
//! (`slurm_spank_init`, remote context), before any task runs.
//!
//! - **Credentials** (`job_secrets`), at the batch step only, once per
//!   job: the batch script and the environment the job was submitted
//!   with, both of which slurmctld keeps in its StateSaveLocation while
//!   the job lives (for batch jobs only: `_copy_job_desc_to_file`, called
//!   when the request has a script, `src/slurmctld/job_mgr.c`, 22.05) (and slurmdbd, with `AccountingStoreFlags=job_script`
//!   / `job_env`). The script is the file slurmstepd wrote before
//!   `spank_init`: `SlurmdSpoolDir/job%05u/slurm_script`, owned by the
//!   user, mode 0700, in a 0750 directory of root's, and the batch step's
//!   `argv[0]` (`_make_batch_dir`, `_make_batch_script`: `job->argv[0] =
//!   script`, `src/slurmd/slurmstepd/mgr.c`, 22.05 to 26.05), so the path
//!   comes from the spank item `S_JOB_ARGV`, never from the job's
//!   environment. It is opened `O_NOFOLLOW | O_NONBLOCK`, must be a
//!   regular file, and is read to its first MiB
//!   ([`gpufence_model::secrets::SCRIPT_MAX_BYTES`]); the environment
//!   (`S_JOB_ENV`) to its first 4096 variables and MiB. The rules and
//!   their sources: [`gpufence_model::secrets`].
//! - **Container images** (`container_images`, `container_registries`),
//!   at every step but the extern one: Pyxis's `--container-image` in the
//!   step's environment and a task that runs a container runtime
//!   ([`gpufence_model::image`]).
//!
//! `warn` gives one line per check for the job's stderr (task 0) and one
//! audit event; `refuse` gives that line as the step's refusal (the plugin
//! fails every task before it execs). A script or environment that
//! cannot be read is a `check_failed` audit line and a log line, never a
//! refusal. The value of a credential never leaves this module: lines and
//! audit events name the kind, the line or variable, and 8 hex digits of
//! its HMAC-SHA256 under the node's key ([`hash_key`]).

use std::ffi::OsStr;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use gpufence_model::audit::{events, AuditEvent};
use gpufence_model::config::DoorMode;
use gpufence_model::image::{self, ImageIssue, ImageRef, PYXIS_IMAGE_ENV};
use gpufence_model::secrets::{
    Finding, HashKey, Place, Scanner, ENV_MAX_BYTES, ENV_MAX_VARS, SCRIPT_MAX_BYTES,
};
use serde_json::json;

use crate::host::slurmconf::SlurmConf;
use crate::job::grant::{step_label, StepRequest, EXTERN_STEP_ID};
use crate::Node;

/// The batch step's id (`SLURM_BATCH_SCRIPT`, `slurm.h`).
pub const BATCH_STEP_ID: u32 = 0xffff_fffb;

/// The findings a line names at most; the rest are counted.
const LINE_FINDINGS: usize = 6;

/// What the door found for one step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Door {
    /// Lines for the job's stderr (task 0), in `warn` mode.
    pub user_lines: Vec<String>,
    /// The step's refusal (`refuse` mode): the line the user gets.
    pub refuse: Option<String>,
    /// Lines for slurmd's log (a script that could not be read, an audit
    /// line that could not be written).
    pub log_lines: Vec<String>,
}

/// The step as the plugin sees it: its spank items.
#[derive(Clone, Copy, Debug)]
pub struct DoorStep<'a> {
    /// The step.
    pub req: &'a StepRequest,
    /// `S_JOB_ARGV`: the batch step's is the script slurmstepd wrote; a
    /// step's, its tasks' command.
    pub argv: &'a [&'a OsStr],
    /// `S_JOB_ENV`; `None` when slurmstepd did not give it.
    pub env: Option<&'a [&'a OsStr]>,
}

/// Reads the first [`SCRIPT_MAX_BYTES`] of the batch script at `path`
/// without following a symbolic link or blocking on a FIFO; whether it
/// was longer.
///
/// # Errors
/// The `open(2)`/`read(2)` error, or `InvalidInput` when it is not a
/// regular file.
pub fn read_script(path: &Path) -> std::io::Result<(Vec<u8>, bool)> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)?;
    let meta = f.metadata()?;
    if !meta.file_type().is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    let mut buf = Vec::with_capacity((meta.len() as usize).min(SCRIPT_MAX_BYTES));
    f.take(SCRIPT_MAX_BYTES as u64).read_to_end(&mut buf)?;
    Ok((buf, meta.len() as usize > SCRIPT_MAX_BYTES))
}

/// Runs both checks for `step` as `node.cfg` says; `slurm` is slurm.conf
/// (where a secret is stored), `None` when it could not be read.
pub fn check_step(node: &Node, slurm: Option<&SlurmConf>, step: &DoorStep) -> Door {
    let mut door = Door::default();
    if step.req.step_id == BATCH_STEP_ID && node.cfg.job_secrets != DoorMode::Off {
        secrets(node, slurm, step, &mut door);
    }
    if step.req.step_id != EXTERN_STEP_ID && node.cfg.container_images != DoorMode::Off {
        images(node, step, &mut door);
    }
    door
}

/// Says `line` as `mode` asks.
fn say(door: &mut Door, mode: DoorMode, line: String) {
    match mode {
        DoorMode::Refuse => match &mut door.refuse {
            Some(r) => {
                r.push('\n');
                r.push_str(&line)
            }
            None => door.refuse = Some(line),
        },
        _ => door.user_lines.push(line),
    }
}

fn audit(node: &Node, door: &mut Door, ev: AuditEvent) {
    if let Err(e) = node.audit(ev) {
        door.log_lines.push(format!("gpufence: audit: {e}"));
    }
}

fn check_failed(node: &Node, door: &mut Door, req: &StepRequest, reason: String) {
    door.log_lines.push(format!(
        "gpufence: {}: not checked for credentials: {reason}",
        step_label(req)
    ));
    audit(
        node,
        door,
        AuditEvent::new(events::CHECK_FAILED)
            .job(req.job_id)
            .uid(req.uid)
            .field("component", "job_secrets")
            .field("reason", reason),
    );
}

/// The node's key of the hashes findings keep
/// ([`gpufence_model::secrets::HashKey`]): `<state_dir>/door.key`, made
/// (32 random bytes, 0600, root's; `O_EXCL`, so that concurrent steps
/// agree on one) when absent, read with `O_NOFOLLOW` and used only when
/// it is a regular file of exactly 32 bytes owned by this process's
/// effective uid (root in slurmstepd) and private to it. When it cannot be made or read so, a key of this step's own: the
/// hashes then tell findings of this job apart but not across jobs, and
/// are still not unkeyed. The reason, when there is one, is returned for
/// the step's log and an `error` audit line (`component` `job_secrets`).
pub fn hash_key(node: &Node) -> (HashKey, Option<String>) {
    let p = node.state.door_key_path();
    let read = || -> std::io::Result<HashKey> {
        use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(&p)?;
        let m = f.metadata()?;
        if !m.is_file()
            || m.uid() != nix::unistd::geteuid().as_raw()
            || m.mode() & 0o077 != 0
            || m.len() != 32
        {
            return Err(std::io::Error::other(
                "not a regular file of 32 bytes, ours (root's in slurmstepd), mode 0600",
            ));
        }
        let mut b = [0u8; 32];
        f.read_exact(&mut b)?;
        Ok(HashKey::from_bytes(b))
    };
    // Written whole to a temporary file (0600) in state_dir, synced, then
    // linked into place without replacing (`link(2)`): a step killed
    // halfway, or a full disk, leaves no short key behind, and concurrent
    // first steps read either no key or the whole one.
    let made = || -> std::io::Result<()> {
        let _ = gpufence_model::fsutil::create_dir_all_mode(node.state.root(), 0o700);
        let key = HashKey::random().ok_or_else(|| std::io::Error::other("getrandom"))?;
        match gpufence_model::fsutil::write_new_whole(&p, key.bytes(), 0o600) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => Err(e),
            _ => Ok(()),
        }
    };
    let why = match read() {
        Ok(k) => return (k, None),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => match made().and_then(|()| read()) {
            Ok(k) => return (k, None),
            Err(e) => e,
        },
        Err(e) => e,
    };
    let own = HashKey::random().unwrap_or_else(|| {
        // No randomness from the kernel: the time and the pid, still a key
        // no reader of the log holds.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let mut b = [0u8; 32];
        b[..16].copy_from_slice(&t.to_le_bytes());
        b[16..20].copy_from_slice(&std::process::id().to_le_bytes());
        HashKey::from_bytes(b)
    });
    (
        own,
        Some(format!(
            "hash key {}: {why}; this job's findings are hashed under a key of its own",
            p.display()
        )),
    )
}

fn secrets(node: &Node, slurm: Option<&SlurmConf>, step: &DoorStep, door: &mut Door) {
    let req = step.req;
    let (key, why) = hash_key(node);
    if let Some(why) = why {
        door.log_lines
            .push(format!("gpufence: {}: {why}", step_label(req)));
        audit(
            node,
            door,
            AuditEvent::new(events::ERROR)
                .job(req.job_id)
                .field("component", "job_secrets")
                .field("reason", why),
        );
    }
    let scanner = match Scanner::new(key) {
        Ok(s) => s,
        Err(e) => return check_failed(node, door, req, format!("rules: {e}")),
    };
    let mut findings: Vec<(&str, Finding)> = Vec::new();
    let mut truncated = false;
    match step.argv.first() {
        None => check_failed(node, door, req, "no batch script in S_JOB_ARGV".into()),
        Some(p) => match read_script(Path::new(p)) {
            Ok((text, cut)) => {
                truncated = cut;
                match scanner.scan_script(&text) {
                    Ok(f) => findings.extend(f.into_iter().map(|f| ("script", f))),
                    Err(e) => check_failed(node, door, req, format!("batch script: {e}")),
                }
            }
            Err(e) => check_failed(
                node,
                door,
                req,
                format!("batch script {}: {e}", Path::new(p).display()),
            ),
        },
    }
    let mut unread = 0;
    match step.env {
        None => check_failed(node, door, req, "no S_JOB_ENV".into()),
        Some(env) => match scanner.scan_env(env.iter().map(|v| v.as_bytes())) {
            Ok(e) => {
                unread = e.unread;
                findings.extend(e.findings.into_iter().map(|f| ("environment", f)));
            }
            Err(e) => check_failed(node, door, req, format!("environment: {e}")),
        },
    }
    if findings.is_empty() {
        // Nothing in what was read; what was not read is said, so that a
        // padded script or environment is seen in the audit log.
        if truncated || unread > 0 {
            let mut parts = Vec::new();
            if truncated {
                parts.push(format!(
                    "the batch script past its first {SCRIPT_MAX_BYTES} bytes"
                ));
            }
            if unread > 0 {
                parts.push(format!(
                    "{unread} variables past the environment's bounds ({ENV_MAX_VARS} variables, {ENV_MAX_BYTES} bytes)"
                ));
            }
            check_failed(
                node,
                door,
                req,
                format!(
                    "partly read, nothing found in the rest: {} not read",
                    parts.join(" and ")
                ),
            );
        }
        return;
    }
    let mode = node.cfg.job_secrets;
    say(door, mode, secrets_line(req, &findings, slurm, mode));
    let list: Vec<_> = findings
        .iter()
        .map(|(src, f)| {
            json!({"rule": f.rule, "kind": f.kind, "place": format!("{src} {}", f.place), "hmac_8": f.hash})
        })
        .collect();
    audit(
        node,
        door,
        AuditEvent::new(events::JOB_SECRET)
            .job(req.job_id)
            .uid(req.uid)
            .field("action", mode.to_string())
            .field("findings", list)
            .field("unread", unread)
            .field("truncated", truncated),
    );
}

/// The user's line for credentials found: the kinds and places, where
/// Slurm keeps them, the fix. `findings` are (`script` | `environment`,
/// finding); never a value.
pub fn secrets_line(
    req: &StepRequest,
    findings: &[(&str, Finding)],
    slurm: Option<&SlurmConf>,
    mode: DoorMode,
) -> String {
    let mut named: Vec<String> = findings
        .iter()
        .take(LINE_FINDINGS)
        .map(|(src, f)| match &f.place {
            Place::Line(n) => format!("{} on line {n} of the {src}", f.kind),
            Place::Var(v) => format!("{} in {v} of the {src}", f.kind),
            Place::VarAt(n) => format!("{} in variable #{n} of the {src}", f.kind),
        })
        .collect();
    if findings.len() > LINE_FINDINGS {
        named.push(format!("{} more", findings.len() - LINE_FINDINGS));
    }
    let in_script = findings.iter().any(|(s, _)| *s == "script");
    let in_env = findings.iter().any(|(s, _)| *s != "script");
    let what = match (in_script, in_env) {
        (true, true) => "the script and the environment",
        (true, false) => "the script",
        _ => "the environment",
    };
    let state = slurm
        .and_then(|s| s.state_save_location.as_deref())
        .map_or(String::new(), |p| format!(" ({p})"));
    let acct: Vec<&str> = [("job_script", in_script), ("job_env", in_env)]
        .iter()
        .filter(|(flag, here)| *here && slurm.is_some_and(|s| s.accounting_stores(flag)))
        .map(|(flag, _)| *flag)
        .collect();
    let kept = if acct.is_empty() {
        String::new()
    } else {
        format!(
            ", and slurmdbd keeps it for as long as accounting lives (AccountingStoreFlags={}: sacct --batch-script/--env-vars shows it)",
            acct.join(",")
        )
    };
    let fix = if in_env {
        "keep secrets in a secret manager or in a file only you can read (chmod 600) that the job reads at run time, and submit with --export=NONE (or --export=VAR,...) so your shell's environment is not sent"
    } else {
        "keep secrets in a secret manager or in a file only you can read (chmod 600) that the job reads at run time"
    };
    format!(
        "gpufence: job {}{}: credentials in the job's submission: {}; slurmctld keeps {what} in its StateSaveLocation{state} while the job lives{kept}; {fix}",
        req.job_id,
        if mode == DoorMode::Refuse {
            " refused (job_secrets = \"refuse\")"
        } else {
            ""
        },
        named.join(", ")
    )
}

fn images(node: &Node, step: &DoorStep, door: &mut Door) {
    let req = step.req;
    let mut found: Vec<ImageRef> = Vec::new();
    if let Some(env) = step.env {
        let key = format!("{PYXIS_IMAGE_ENV}=");
        // Every variable (a prefix comparison each): sbatch and srun add
        // the option's variable after the user's own.
        if let Some(v) = env
            .iter()
            .find_map(|v| v.as_bytes().strip_prefix(key.as_bytes()))
        {
            found.extend(image::from_pyxis(&String::from_utf8_lossy(v)));
        }
    }
    let argv: Vec<String> = step
        .argv
        .iter()
        .take(256)
        .map(|a| String::from_utf8_lossy(&a.as_bytes()[..a.len().min(4096)]).into_owned())
        .collect();
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    found.extend(image::from_argv(&argv));
    let issues: Vec<ImageIssue> = found
        .iter()
        .filter_map(|i| image::judge(i, &node.cfg.container_registries))
        .collect();
    if issues.is_empty() {
        return;
    }
    let mode = node.cfg.container_images;
    say(
        door,
        mode,
        images_line(req, &issues, &node.cfg.container_registries, mode),
    );
    let list: Vec<_> = issues
        .iter()
        .map(|i| {
            let (r, issue) = match i {
                ImageIssue::Unpinned(r) => (r, "tag, not digest"),
                ImageIssue::Registry(r) => (r, "registry not allowed"),
            };
            json!({"image": r.text, "registry": r.registry, "source": r.source, "issue": issue})
        })
        .collect();
    audit(
        node,
        door,
        AuditEvent::new(events::CONTAINER_IMAGE)
            .job(req.job_id)
            .uid(req.uid)
            .field("step", crate::job::grant::step_name(req.step_id))
            .field("action", mode.to_string())
            .field("images", list),
    );
}

/// The user's line for images named by tag or from a registry outside
/// `allowed`.
pub fn images_line(
    req: &StepRequest,
    issues: &[ImageIssue],
    allowed: &[String],
    mode: DoorMode,
) -> String {
    let parts: Vec<String> = issues
        .iter()
        .map(|i| match i {
            ImageIssue::Unpinned(r) => format!(
                "{} ({}) is named by tag, not by digest: the tag can be moved to other content; pin it as NAME@sha256:<digest> (skopeo inspect or podman image inspect gives it)",
                r.text, r.source
            ),
            ImageIssue::Registry(r) => format!(
                "{} ({}) comes from {}, not a registry of container_registries ({})",
                r.text,
                r.source,
                r.registry,
                allowed.join(", ")
            ),
        })
        .collect();
    format!(
        "gpufence: {}{}: container image {}",
        step_label(req),
        if mode == DoorMode::Refuse {
            " refused (container_images = \"refuse\")"
        } else {
            ""
        },
        parts.join("; ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    const HF: &str = "hf_FAKEfakeFAKEfakeTESTtestTESTtestXY";

    fn node(dir: &Path, extra: &str) -> Node {
        let cfg = gpufence_model::config::Config::parse(
            &format!(
                "state_dir = \"{d}/state\"\naudit_log = \"{d}/audit.jsonl\"\n{extra}",
                d = dir.display()
            ),
            Path::new("/t.toml"),
        )
        .unwrap();
        Node::new(cfg, gpufence_model::config::ConfigOrigin::Defaults).unwrap()
    }

    fn req(step_id: u32) -> StepRequest {
        StepRequest {
            job_id: 42,
            step_id,
            uid: 1000,
            stepd_pid: 1,
        }
    }

    fn audit_text(dir: &Path) -> String {
        std::fs::read_to_string(dir.join("audit.jsonl")).unwrap_or_default()
    }

    /// The node's hash key: made once (32 bytes, 0600) and the same for
    /// every later step; a key file that is a link, the wrong size or
    /// another uid's is not used, and the reason says so.
    #[test]
    fn the_hash_key_is_the_nodes_own_file_or_a_steps_own() {
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir().unwrap();
        let n = node(d.path(), "");
        let p = n.state.door_key_path();
        let (k1, why1) = hash_key(&n);
        let (k2, why2) = hash_key(&n);
        let m = std::fs::metadata(&p).unwrap();
        assert_eq!((m.len(), m.mode() & 0o777), (32, 0o600));
        assert_eq!((why1, why2), (None, None));
        assert_eq!(k1.bytes(), k2.bytes(), "one key for the node");
        assert_eq!(&std::fs::read(&p).unwrap()[..], &k1.bytes()[..]);
        // Another uid's key is not used (as root: chown it away).
        if nix::unistd::geteuid().is_root() {
            std::os::unix::fs::chown(&p, Some(1), None).unwrap();
            let (k, why) = hash_key(&n);
            assert!(why.is_some_and(|w| w.contains("ours")));
            assert_ne!(k.bytes(), k1.bytes());
            std::os::unix::fs::chown(&p, Some(0), None).unwrap();
        }
        // A link in its place is not followed.
        std::fs::remove_file(&p).unwrap();
        let elsewhere = d.path().join("elsewhere.key");
        std::fs::write(&elsewhere, [9u8; 32]).unwrap();
        std::fs::set_permissions(&elsewhere, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &p).unwrap();
        let (k, why) = hash_key(&n);
        assert!(why.is_some(), "a link is refused");
        assert_ne!(k.bytes(), &[9u8; 32]);
        // The wrong size.
        std::fs::remove_file(&p).unwrap();
        std::fs::write(&p, [9u8; 31]).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let (k, why) = hash_key(&n);
        assert!(why.is_some_and(|w| w.contains("32 bytes")));
        assert_ne!(&k.bytes()[..31], &[9u8; 31]);
    }

    #[test]
    fn warn_names_kind_and_place_never_the_value() {
        let d = tempfile::tempdir().unwrap();
        let script = d.path().join("slurm_script");
        std::fs::write(
            &script,
            format!("#!/bin/sh\necho hi\nexport HF_TOKEN={HF}\n"),
        )
        .unwrap();
        let n = node(d.path(), "");
        let conf = SlurmConf::parse(
            "AccountingStoreFlags=job_script,job_env\nStateSaveLocation=/var/spool/slurmctld\n",
        );
        let argv = [script.as_os_str()];
        let gl = OsStr::new("GL=glpat-FAKEfake0123TESTtest");
        let env = [OsStr::new("PATH=/bin"), gl];
        let door = check_step(
            &n,
            Some(&conf),
            &DoorStep {
                req: &req(BATCH_STEP_ID),
                argv: &argv,
                env: Some(&env),
            },
        );
        assert!(door.refuse.is_none());
        assert_eq!(door.user_lines.len(), 1, "{door:?}");
        let l = &door.user_lines[0];
        for want in [
            "a Hugging Face token on line 3 of the script",
            "a GitLab token in GL of the environment",
            "StateSaveLocation (/var/spool/slurmctld)",
            "AccountingStoreFlags=job_script,job_env",
            "--export=NONE",
            "secret manager",
        ] {
            assert!(l.contains(want), "{want} not in {l}");
        }
        let audit = audit_text(d.path());
        assert_eq!(audit.lines().count(), 1, "{audit}");
        assert!(audit.contains("\"job_secret\"") && audit.contains("hmac_8"));
        for out in [l.as_str(), audit.as_str()] {
            assert!(!out.contains(HF) && !out.contains("glpat-FAKE"), "{out}");
        }
    }

    #[test]
    fn refuse_and_unreadable_and_off() {
        let d = tempfile::tempdir().unwrap();
        let script = d.path().join("slurm_script");
        std::fs::write(&script, format!("export HF_TOKEN={HF}\n")).unwrap();
        let argv = [script.as_os_str()];
        let env: [&OsStr; 0] = [];
        let step = DoorStep {
            req: &req(BATCH_STEP_ID),
            argv: &argv,
            env: Some(&env),
        };
        let door = check_step(&node(d.path(), "job_secrets = \"refuse\""), None, &step);
        let r = door.refuse.unwrap();
        assert!(r.starts_with("gpufence: job 42 refused"), "{r}");
        assert!(door.user_lines.is_empty());
        // off: nothing read, nothing said
        let door = check_step(&node(d.path(), "job_secrets = \"off\""), None, &step);
        assert_eq!(door, Door::default());
        // a symbolic link is not followed; unreadable: check_failed only
        let link = d.path().join("link");
        std::os::unix::fs::symlink(&script, &link).unwrap();
        let largv = [link.as_os_str()];
        let e = tempfile::tempdir().unwrap();
        let door = check_step(
            &node(e.path(), "job_secrets = \"refuse\""),
            None,
            &DoorStep {
                argv: &largv,
                ..step
            },
        );
        assert!(door.refuse.is_none() && door.user_lines.is_empty());
        assert_eq!(door.log_lines.len(), 1, "{door:?}");
        assert!(audit_text(e.path()).contains("check_failed"));
        // a FIFO does not block
        let fifo = d.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo(3) with a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(read_script(&fifo).is_err());
        let _ = std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o700));
    }

    #[test]
    fn only_the_batch_step_is_scanned_for_secrets() {
        let d = tempfile::tempdir().unwrap();
        let hf = format!("HF_TOKEN={HF}");
        let env = [OsStr::new(&hf)];
        let argv = [OsStr::new("python")];
        for step in [0, EXTERN_STEP_ID] {
            let door = check_step(
                &node(d.path(), ""),
                None,
                &DoorStep {
                    req: &req(step),
                    argv: &argv,
                    env: Some(&env),
                },
            );
            assert_eq!(door, Door::default());
        }
    }

    #[test]
    fn images_by_tag_warned_by_digest_silent() {
        let d = tempfile::tempdir().unwrap();
        let n = node(d.path(), "");
        let tag = format!("{PYXIS_IMAGE_ENV}=nvcr.io#nvidia/pytorch:24.05-py3");
        let pinned = format!(
            "{PYXIS_IMAGE_ENV}=nvcr.io#nvidia/pytorch@sha256:{}",
            "ab".repeat(32)
        );
        let argv = [OsStr::new("python")];
        let run = |n: &Node, v: &str| {
            let env = [OsStr::new(v)];
            check_step(
                n,
                None,
                &DoorStep {
                    req: &req(0),
                    argv: &argv,
                    env: Some(&env),
                },
            )
        };
        let door = run(&n, &tag);
        assert_eq!(door.user_lines.len(), 1);
        assert!(door.user_lines[0]
            .contains("nvcr.io#nvidia/pytorch:24.05-py3 (--container-image) is named by tag"));
        assert!(audit_text(d.path()).contains("\"container_image\""));
        assert_eq!(run(&n, &pinned), Door::default());
        let strict = node(
            d.path(),
            "container_images = \"refuse\"\ncontainer_registries = [\"ghcr.io\"]",
        );
        let r = run(&strict, &pinned).refuse.unwrap();
        assert!(
            r.contains("comes from nvcr.io, not a registry of container_registries (ghcr.io)"),
            "{r}"
        );
        // podman in a task's argv
        let argv = [
            OsStr::new("podman"),
            OsStr::new("run"),
            OsStr::new("ubuntu:22.04"),
        ];
        let door = check_step(
            &n,
            None,
            &DoorStep {
                req: &req(1),
                argv: &argv,
                env: None,
            },
        );
        assert!(
            door.user_lines[0].contains("ubuntu:22.04 (podman)"),
            "{door:?}"
        );
    }
}
