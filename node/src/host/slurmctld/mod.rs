//! The job's GPUs on this node, asked of slurmctld.
//!
//! Why: the Prolog's `SLURM_JOB_GPUS` is incomplete when a node has several
//! GPU types. slurmd builds the Prolog environment by calling the gres
//! plugin once per job GRES record (one record per type) and every call
//! *overwrites* `SLURM_JOB_GPUS` (`gres_common_epilog_set_env` /
//! `gres_common_prep_set_env` in `src/plugins/gres/common/gres_common.c`,
//! `env_array_overwrite(..., "SLURM_JOB_GPUS", ...)`, 22.05 through 26.05
//! and master at 284c3b95f0, August 2026: no release fixed it), so only the last type's indices
//! survive (the last type with GPUs on the node: a record without any
//! leaves the variable as it was). Measured on 22.05.8 with
//! `gpu:sim` = indices 0-1 and `gpu:held` = 2-3: `--gres=gpu:sim:1,gpu:held:1`
//! gives the step `0,2` but the Prolog `2`; an untyped `--gres=gpu:3` on the
//! same node gives the step `0,1,2` and the Prolog `2` (slurmctld splits the
//! allocation by type).
//!
//! Why no node-local source instead (checked in the sources, 22.05 to
//! master):
//! - the Prolog's environment (`_build_env`,
//!   `src/plugins/prep/script/prep_script_slurmd.c`) holds no other GRES
//!   variable: `CUDA_VISIBLE_DEVICES` is overwritten by the same call, and
//!   the `SPANK_` variables are the user's;
//! - no `spank_item` names GRES (`enum spank_item`, `slurm/spank.h`);
//! - slurmstepd sets complete GPU variables after copying the user's
//!   environment, before `spank_init` (`_step_setup`,
//!   `src/slurmd/slurmstepd/slurmstepd.c`: `gres_g_job_set_env` for the
//!   batch step, `gres_g_step_set_env` for a step, each OR-ing every type's
//!   bits), but the extern step has no step GRES (its credential's
//!   `step_gres_list` is never set: `launch_prolog`,
//!   `src/slurmctld/node_scheduler.c`), the batch step runs on one node
//!   only, a step names only its own GPUs, and all of them come after the
//!   Prolog, whose clean start must cover every GPU of the job.
//!
//! What: slurmctld's `gres_detail` of the job, one string per node of the
//! job, in the order of the job's node list, e.g.
//! `gpu:sim:1(IDX:0),gpu:held:1(IDX:2)`. The string for this node is the
//! position of `SLURMD_NODENAME` in the expanded node list (what slurmd
//! itself does: `nodelist_find(req->nodes, conf->node_name)` in
//! `src/slurmd/slurmd/req.c`). Only `gpu` entries count: a `shard` or `mps`
//! allocation is not a GPU here, although slurmd does put the shard's GPU
//! in the Prolog's `SLURM_JOB_GPUS` (`--gres=shard:2` gave `0` on 22.05.8).
//!
//! How, by version (checked in the sources and, for 22.05.8, on a cluster):
//! - 23.02+: `scontrol --json show job <id>` (data_parser v0.0.39 .. v0.0.44):
//!   `.jobs[] | select(.job_id == ID) | .nodes, .gres_detail`.
//! - 22.05: `scontrol` has no `--json` (it answers "unrecognized option
//!   '--json'"), so `squeue --json` next to it is used: openapi v0.0.38,
//!   same paths. It ignores `-j` and dumps every job (about 3 KB and 0.3 ms
//!   per job here), which is the price of not parsing text.
//!
//! Nothing user-controlled is trusted: the non-JSON `scontrol show job`
//! text is never read (a job name with a newline forges a
//! `Nodes=... GRES=gpu:4(IDX:0-3)` line there: seen here), the JSON is
//! decoded lossily (a job name with invalid UTF-8 makes 22.05's output
//! invalid UTF-8: seen here), the job is picked by its numeric `job_id`, and
//! the `gres_detail` grammar is parsed strictly, knowing that a GRES type
//! may hold `(` and `)` but never `,` or `:` (see [`parse_gres_detail`]).
//! The child runs with an empty environment plus `SLURM_CONF`.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::NodeError;

mod gres_detail;
mod hostlist;
pub use gres_detail::{
    gpu_indices, parse_gres_detail, GresAlloc, GresDetailEntry, GresDetailError,
};
pub use hostlist::{expand_hostlist, hostlist_find, HostlistError};

/// The most bytes of output read from the command. 22.05's `squeue --json`
/// lists every job (about 3 KB each), so this allows some 80 000 jobs.
pub const MAX_OUTPUT_BYTES: usize = 256 << 20;
/// The most host names a job's node list may expand to.
pub const MAX_HOSTS: usize = 1 << 20;
/// The most GRES indices one `IDX:` list may name.
pub const MAX_INDICES: usize = 1 << 16;
/// Slurm formats an `IDX:` list with `bit_fmt` into a 128-byte buffer
/// (`tmp_str[128]` in `gres_ctld_job_build_details`, `src/slurmctld/gres_ctld.c`
/// 22.05-23.11, and `gres_stepmgr_job_build_details`,
/// `src/stepmgr/gres_stepmgr.c` 24.05-25.11), silently cutting it at 127
/// characters, possibly inside a number. A list this long is refused.
pub const IDX_TRUNCATED_LEN: usize = 127;

/// The GPU indices (positions in `slurmd -G`'s GPU list, from 0) that
/// slurmctld allocated to job `job_id` on node `node_name`, ascending and
/// without duplicates; empty when the job has none there.
///
/// Runs `<scontrol> --json show job <job_id>` with `SLURM_CONF=slurm_conf`
/// (when given) and nothing else in its environment; when that `scontrol`
/// has no `--json` (22.05), runs `squeue --json` from the same directory.
/// `timeout` bounds both together; a command still running then is killed.
///
/// # Errors
/// [`NodeError::SlurmdG`] (its `cmd` is the command line) when the command
/// cannot run, times out, fails, or answers something other than the
/// expected JSON; when the job is not in the answer or does not list
/// `node_name`; and when the node's `gres_detail` does not parse, has a
/// `gpu` entry without indices, or an index list Slurm may have truncated.
pub fn job_gpu_indices(
    scontrol: &Path,
    slurm_conf: Option<&Path>,
    job_id: u32,
    node_name: &str,
    timeout: Duration,
) -> Result<Vec<u32>, NodeError> {
    let (cmd, json) = query_job_json(scontrol, slurm_conf, job_id, timeout)?;
    gpu_indices_from_json(&json, job_id, node_name).map_err(|e| NodeError::SlurmdG {
        cmd,
        msg: e.to_string(),
    })
}

/// Runs the query and returns the command line used and its stdout.
fn query_job_json(
    scontrol: &Path,
    slurm_conf: Option<&Path>,
    job_id: u32,
    timeout: Duration,
) -> Result<(String, Vec<u8>), NodeError> {
    let deadline = Instant::now() + timeout;
    let id = job_id.to_string();
    let args = ["--json", "show", "job", id.as_str()];
    let cmd = command_line(scontrol, &args, slurm_conf);
    match run(scontrol, &args, slurm_conf, timeout) {
        Ok(out) => return Ok((cmd, out)),
        Err(RunError::Failed { stderr, .. }) if lacks_json_option(&stderr) => {}
        Err(e) => {
            return Err(NodeError::SlurmdG {
                cmd,
                msg: e.to_string(),
            })
        }
    }
    // Slurm 22.05: only squeue, sinfo and sacct speak JSON.
    let squeue = scontrol.with_file_name("squeue");
    let args = ["--json"];
    let cmd = command_line(&squeue, &args, slurm_conf);
    let left = deadline.saturating_duration_since(Instant::now());
    match run(&squeue, &args, slurm_conf, left) {
        Ok(out) => Ok((cmd, out)),
        Err(e) => Err(NodeError::SlurmdG {
            cmd,
            msg: format!(
                "{e} (asked because `{}` has no --json: Slurm 22.05)",
                scontrol.display()
            ),
        }),
    }
}

/// Whether stderr is getopt's complaint about `--json` (22.05's scontrol:
/// `scontrol: unrecognized option '--json'`).
fn lacks_json_option(stderr: &str) -> bool {
    stderr.lines().any(|l| {
        (l.contains("unrecognized option") || l.contains("invalid option")) && l.contains("json")
    })
}

fn command_line(prog: &Path, args: &[&str], slurm_conf: Option<&Path>) -> String {
    let mut s = String::new();
    if let Some(c) = slurm_conf {
        s.push_str(&format!("SLURM_CONF={} ", c.display()));
    }
    s.push_str(&prog.display().to_string());
    for a in args {
        s.push(' ');
        s.push_str(a);
    }
    s
}

#[derive(Debug)]
enum RunError {
    Spawn(std::io::Error),
    Timeout(Duration),
    TooBig,
    Failed {
        status: std::process::ExitStatus,
        stderr: String,
        stdout_errors: Option<String>,
    },
}

impl std::fmt::Display for RunError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RunError::Spawn(e) => write!(f, "cannot run it: {e}"),
            RunError::Timeout(t) => write!(f, "no answer within {} ms (killed)", t.as_millis()),
            RunError::TooBig => write!(f, "more than {MAX_OUTPUT_BYTES} bytes of output"),
            RunError::Failed {
                status,
                stderr,
                stdout_errors,
            } => {
                write!(f, "{status}")?;
                if let Some(e) = stdout_errors {
                    write!(f, ": {e}")?;
                }
                let tail: Vec<&str> = stderr
                    .lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty())
                    .rev()
                    .take(3)
                    .collect();
                if !tail.is_empty() {
                    let tail: Vec<&str> = tail.into_iter().rev().collect();
                    write!(f, ": {}", clip(&tail.join(" | "), 600))?;
                }
                Ok(())
            }
        }
    }
}

fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// Reads `r` to the end, keeping at most `cap` bytes; the flag says whether
/// more came (the rest is drained so that the child never blocks).
fn read_capped(mut r: impl Read, cap: usize) -> (Vec<u8>, bool) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 64 * 1024];
    let mut over = false;
    loop {
        match r.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => {
                if !over && buf.len() + n <= cap {
                    buf.extend_from_slice(&chunk[..n]);
                } else {
                    over = true;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    (buf, over)
}

fn run(
    prog: &Path,
    args: &[&str],
    slurm_conf: Option<&Path>,
    timeout: Duration,
) -> Result<Vec<u8>, RunError> {
    let mut c = Command::new(prog);
    c.args(args)
        .env_clear()
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(conf) = slurm_conf {
        c.env("SLURM_CONF", conf);
    }
    let mut child = c.spawn().map_err(RunError::Spawn)?;
    let out = child
        .stdout
        .take()
        .map(|o| std::thread::spawn(move || read_capped(o, MAX_OUTPUT_BYTES)));
    let err = child
        .stderr
        .take()
        .map(|e| std::thread::spawn(move || read_capped(e, 64 * 1024)));
    let status = match crate::host::procs::wait_until(
        &mut child,
        Instant::now() + timeout,
        Duration::from_millis(1),
    ) {
        Ok(Some(s)) => s,
        Ok(None) => return Err(RunError::Timeout(timeout)),
        Err(e) => return Err(RunError::Spawn(e)),
    };
    let (stdout, too_big) = out.and_then(|t| t.join().ok()).unwrap_or_default();
    let (stderr, _) = err.and_then(|t| t.join().ok()).unwrap_or_default();
    if !status.success() {
        return Err(RunError::Failed {
            status,
            stderr: String::from_utf8_lossy(&stderr).into_owned(),
            stdout_errors: serde_json::from_str::<Value>(&String::from_utf8_lossy(&stdout))
                .ok()
                .and_then(|v| json_errors(&v)),
        });
    }
    if too_big {
        return Err(RunError::TooBig);
    }
    Ok(stdout)
}

/// The `errors` list of a Slurm JSON answer, as one line; `None` when empty.
fn json_errors(doc: &Value) -> Option<String> {
    let errs = doc.get("errors")?.as_array()?;
    if errs.is_empty() {
        return None;
    }
    let parts: Vec<String> = errs
        .iter()
        .map(|e| {
            let field = |k: &str| e.get(k).and_then(Value::as_str).filter(|s| !s.is_empty());
            match (field("description"), field("error")) {
                (Some(d), Some(x)) => format!("{d} ({x})"),
                (Some(d), None) => d.to_string(),
                (None, Some(x)) => x.to_string(),
                (None, None) => clip(&e.to_string(), 200),
            }
        })
        .collect();
    Some(clip(&parts.join("; "), 600))
}

/// A JSON unsigned number, plain or in data_parser's `{"set": true,
/// "number": N}` wrapper.
fn json_u64(v: &Value) -> Option<u64> {
    match v {
        Value::Number(n) => n.as_u64(),
        Value::Object(m) => {
            if m.get("set").and_then(Value::as_bool) == Some(false)
                || m.get("infinite").and_then(Value::as_bool) == Some(true)
            {
                return None;
            }
            m.get("number").and_then(Value::as_u64)
        }
        _ => None,
    }
}

/// Why slurmctld's answer ([`gpu_indices_from_json`]) does not give the
/// job's GPU indices on this node. [`job_gpu_indices`] reports it as
/// [`NodeError::SlurmdG`] with the command line.
#[derive(Debug, thiserror::Error)]
pub enum JobJsonError {
    /// The output is not JSON.
    #[error("the output is not JSON: {0}")]
    NotJson(#[source] serde_json::Error),
    /// slurmctld's `errors` list is not empty (clipped).
    #[error("slurmctld answered with errors: {0}")]
    Errors(String),
    /// No `jobs` list.
    #[error("the output has no \"jobs\" list")]
    NoJobs,
    /// The job is not in the list (it ended).
    #[error("job {0} is not in slurmctld's answer (has it ended?)")]
    JobMissing(u32),
    /// The job is in the list twice.
    #[error("job {0} is in slurmctld's answer twice")]
    JobTwice(u32),
    /// The job's `nodes` is not a string.
    #[error("job {job_id}: \"nodes\" is not a string: {value}")]
    NodesNotString {
        /// The job.
        job_id: u32,
        /// What `nodes` is.
        value: Value,
    },
    /// The job has no `gres_detail` list.
    #[error("job {0}: no \"gres_detail\" list in the output")]
    NoGresDetail(u32),
    /// The job's node list does not parse.
    #[error("job {job_id}: node list {nodes:?}: {source}")]
    NodeList {
        /// The job.
        job_id: u32,
        /// Its node list.
        nodes: String,
        /// Why.
        source: HostlistError,
    },
    /// The job does not run on this node.
    #[error("job {job_id} runs on {nodes:?}, which does not include this node ({node_name})")]
    NotOnNode {
        /// The job.
        job_id: u32,
        /// Its node list.
        nodes: String,
        /// This node.
        node_name: String,
    },
    /// `gres_detail` has not one entry per node.
    #[error("job {job_id}: {entries} gres_detail entries for {count} node(s) in {nodes:?}")]
    DetailCount {
        /// The job.
        job_id: u32,
        /// How many entries.
        entries: usize,
        /// How many nodes.
        count: usize,
        /// Its node list.
        nodes: String,
    },
    /// This node's `gres_detail` entry is neither a string nor null.
    #[error("job {job_id}: gres_detail entry {pos} is not a string: {value}")]
    DetailNotString {
        /// The job.
        job_id: u32,
        /// This node's position in the node list.
        pos: usize,
        /// What the entry is.
        value: Value,
    },
    /// This node's `gres_detail` string does not parse, or its `gpu`
    /// entries have no indices.
    #[error("job {job_id} on {node_name}: gres_detail {detail:?}: {source}")]
    Detail {
        /// The job.
        job_id: u32,
        /// This node.
        node_name: String,
        /// The string.
        detail: String,
        /// Why.
        source: GresDetailError,
    },
}

/// The GPU indices of `job_id` on `node_name` in the output of
/// `scontrol --json show job` or `squeue --json` (any version 22.05-25.11).
///
/// # Errors
/// [`JobJsonError`]: output that is not the expected JSON, a job that is
/// not in it (or is in it twice), a node the job does not list, a
/// `gres_detail` list whose length is not the job's node count, and the
/// errors of [`parse_gres_detail`] and [`gpu_indices`].
pub fn gpu_indices_from_json(
    json: &[u8],
    job_id: u32,
    node_name: &str,
) -> Result<Vec<u32>, JobJsonError> {
    // User-controlled strings (job names, comments) may be invalid UTF-8:
    // 22.05 copies their bytes into the JSON unchanged.
    let text = String::from_utf8_lossy(json);
    let doc: Value = serde_json::from_str(&text).map_err(JobJsonError::NotJson)?;
    if let Some(e) = json_errors(&doc) {
        return Err(JobJsonError::Errors(e));
    }
    let jobs = doc
        .get("jobs")
        .and_then(Value::as_array)
        .ok_or(JobJsonError::NoJobs)?;
    let mut found = jobs
        .iter()
        .filter(|j| j.get("job_id").and_then(json_u64) == Some(u64::from(job_id)));
    let job = found.next().ok_or(JobJsonError::JobMissing(job_id))?;
    if found.next().is_some() {
        return Err(JobJsonError::JobTwice(job_id));
    }
    let nodes = match job.get("nodes") {
        Some(Value::String(s)) => s.as_str(),
        Some(Value::Null) | None => "",
        Some(other) => {
            return Err(JobJsonError::NodesNotString {
                job_id,
                value: other.clone(),
            })
        }
    };
    let details = job
        .get("gres_detail")
        .and_then(Value::as_array)
        .ok_or(JobJsonError::NoGresDetail(job_id))?;
    let (pos, count) =
        hostlist_find(nodes, node_name).map_err(|source| JobJsonError::NodeList {
            job_id,
            nodes: nodes.to_string(),
            source,
        })?;
    let pos = pos.ok_or_else(|| JobJsonError::NotOnNode {
        job_id,
        nodes: nodes.to_string(),
        node_name: node_name.to_string(),
    })?;
    if details.is_empty() {
        // No GRES with indices (or the job has not started or has ended).
        return Ok(Vec::new());
    }
    if details.len() != count {
        return Err(JobJsonError::DetailCount {
            job_id,
            entries: details.len(),
            count,
            nodes: nodes.to_string(),
        });
    }
    let detail = match &details[pos] {
        Value::Null => return Ok(Vec::new()),
        Value::String(s) => s.as_str(),
        other => {
            return Err(JobJsonError::DetailNotString {
                job_id,
                pos,
                value: other.clone(),
            })
        }
    };
    let in_detail = |source| JobJsonError::Detail {
        job_id,
        node_name: node_name.to_string(),
        detail: detail.to_string(),
        source,
    };
    gpu_indices(&parse_gres_detail(detail).map_err(in_detail)?).map_err(in_detail)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::os::unix::fs::PermissionsExt;
    use std::path::PathBuf;

    /// `testdata/slurmctld` at the workspace root.
    fn fixture_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/slurmctld")
    }

    fn fixture(name: &str) -> Vec<u8> {
        std::fs::read(fixture_dir().join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    fn idx(v: &[u32]) -> GresAlloc {
        GresAlloc::Idx(v.to_vec())
    }

    // --- real captures, Slurm 22.05.8 `squeue --json` (openapi v0.0.38) ----
    // Node gf1: gpu:sim = indices 0-1, gpu:held = 2-3, shard:8 over all four.

    #[test]
    fn real_2205_multi_type_requests() {
        for (file, job, want, prolog_saw) in [
            // --gres=gpu:sim:1,gpu:held:1: Prolog's SLURM_JOB_GPUS was "2".
            ("squeue-22.05-sim1-held1.json", 2, vec![0, 2], "2"),
            // --gres=gpu:held:2,gpu:sim:1: Prolog saw "0".
            ("squeue-22.05-held2-sim1.json", 3, vec![0, 2, 3], "0"),
            // --gpus=sim:1,held:1: Prolog saw "2".
            ("squeue-22.05-gpus-option.json", 7, vec![0, 2], "2"),
            // --gres=gpu:3 (untyped request, typed node): Prolog saw "2".
            ("squeue-22.05-untyped-gpu3.json", 5, vec![0, 1, 2], "2"),
            // --gres=gpu:held:1: single type, Prolog was right.
            ("squeue-22.05-held1.json", 4, vec![2], "2"),
        ] {
            let got = gpu_indices_from_json(&fixture(file), job, "gf1").unwrap();
            assert_eq!(got, want, "{file}");
            let env: Vec<u32> = prolog_saw.split(',').map(|x| x.parse().unwrap()).collect();
            assert!(env.iter().all(|i| got.contains(i)), "{file}");
        }
    }

    #[test]
    fn real_2205_no_gpus() {
        // A job without GRES, a shard-only job (shard entries are not GPUs),
        // and cancelled jobs (slurmctld sends no gres_detail once a job ended).
        assert_eq!(
            gpu_indices_from_json(&fixture("squeue-22.05-nogres.json"), 8, "gf1").unwrap(),
            Vec::<u32>::new()
        );
        let shard = fixture("squeue-22.05-shard2.json");
        assert_eq!(
            gpu_indices_from_json(&shard, 9, "gf1").unwrap(),
            Vec::<u32>::new()
        );
        assert_eq!(
            gpu_indices_from_json(&shard, 2, "gf1").unwrap(),
            Vec::<u32>::new()
        );
    }

    #[test]
    fn real_2205_errors() {
        let f = fixture("squeue-22.05-shard2.json");
        // Never started: nodes "".
        let e = gpu_indices_from_json(&f, 6, "gf1").unwrap_err().to_string();
        assert!(e.contains("does not include this node"), "{e}");
        let e = gpu_indices_from_json(&f, 4242, "gf1")
            .unwrap_err()
            .to_string();
        assert!(e.contains("not in slurmctld's answer"), "{e}");
        let e = gpu_indices_from_json(&fixture("squeue-22.05-sim1-held1.json"), 2, "gf2")
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not include this node (gf2)"), "{e}");
    }

    #[test]
    fn real_2205_hostile_job_name_and_comment() {
        // Job 3's name holds a newline, a forged "Nodes=gf1 ... GRES=gpu:4(IDX:0-3)"
        // line (which `scontrol show job -d` prints as if it were real) and
        // invalid UTF-8; its comment holds a forged JSON fragment and more
        // invalid UTF-8. The file is not valid UTF-8.
        let raw = fixture("squeue-22.05-hostile-names.json");
        assert!(std::str::from_utf8(&raw).is_err());
        assert_eq!(gpu_indices_from_json(&raw, 3, "gf1").unwrap(), vec![1, 2]);
        assert_eq!(gpu_indices_from_json(&raw, 2, "gf1").unwrap(), vec![0]);
        assert_eq!(
            gpu_indices_from_json(&raw, 1, "gf1").unwrap(),
            Vec::<u32>::new()
        );
    }

    #[test]
    fn real_2205_colliding_type_spelling() {
        // Asked for --gres=gpu:PGJCPGJCPGJCPFIB(IDX:1 (same gres_build_id hash
        // as "held"); slurmctld printed the node's type.
        let f = fixture("squeue-22.05-colliding-type.json");
        assert_eq!(gpu_indices_from_json(&f, 10, "gf1").unwrap(), vec![2]);
    }

    #[test]
    fn real_2205_scontrol_has_no_json() {
        let stderr = String::from_utf8(fixture("scontrol-22.05-json-stderr.txt")).unwrap();
        assert!(lacks_json_option(&stderr));
        assert!(!lacks_json_option(
            "scontrol: error: Invalid job id specified"
        ));
    }

    // --- hand-written, from the data_parser sources -------------------------

    #[test]
    fn later_versions_shapes() {
        // 23.02, data_parser v0.0.39: one node.
        let f = fixture("scontrol-23.02-v0.0.39.json");
        assert_eq!(
            gpu_indices_from_json(&f, 1201, "node07").unwrap(),
            vec![1, 3]
        );
        // 23.11, v0.0.40: shared-GRES form next to GPUs.
        let f = fixture("scontrol-23.11-v0.0.40.json");
        assert_eq!(gpu_indices_from_json(&f, 88, "gpu02").unwrap(), vec![0, 2]);
        // 24.11, v0.0.42: three nodes, a null entry for a node without GPUs.
        let f = fixture("scontrol-24.11-v0.0.42.json");
        assert_eq!(
            gpu_indices_from_json(&f, 5150, "gpu01").unwrap(),
            vec![0, 1, 2, 3]
        );
        assert_eq!(
            gpu_indices_from_json(&f, 5150, "gpu02").unwrap(),
            vec![4, 7]
        );
        assert_eq!(
            gpu_indices_from_json(&f, 5150, "gpu10").unwrap(),
            Vec::<u32>::new()
        );
        let e = gpu_indices_from_json(&f, 5150, "gpu03")
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not include"), "{e}");
        // 25.11, v0.0.44: two array tasks in the answer; pick by job_id.
        let f = fixture("scontrol-25.11-v0.0.44.json");
        assert_eq!(gpu_indices_from_json(&f, 7001, "a-n001").unwrap(), vec![6]);
        assert_eq!(
            gpu_indices_from_json(&f, 7002, "a-n001").unwrap(),
            vec![0, 1, 2]
        );
        // An answer with errors (job not found, 24.05+).
        let f = fixture("scontrol-25.11-errors.json");
        let e = gpu_indices_from_json(&f, 99, "gpu01")
            .unwrap_err()
            .to_string();
        assert!(e.contains("Unable to find job"), "{e}");
    }

    #[test]
    fn json_shape_problems() {
        for (doc, want) in [
            (&b"not json"[..], "not JSON"),
            (b"{}", "no \"jobs\""),
            (
                br#"{"jobs":[{"job_id":1,"nodes":"n1"}]}"#,
                "no \"gres_detail\"",
            ),
            (
                br#"{"jobs":[{"job_id":1,"nodes":"n1","gres_detail":[]},{"job_id":1}]}"#,
                "twice",
            ),
            (
                br#"{"jobs":[{"job_id":1,"nodes":"n[1-2]","gres_detail":["gpu:1(IDX:0)"]}]}"#,
                "1 gres_detail entries for 2",
            ),
            (
                br#"{"jobs":[{"job_id":1,"nodes":"n1","gres_detail":[7]}]}"#,
                "not a string",
            ),
            (
                br#"{"jobs":[{"job_id":1,"nodes":"n1","gres_detail":["gpu(CNT:2)"]}]}"#,
                "by count",
            ),
            (
                br#"{"jobs":[{"job_id":1,"nodes":"n1","gres_detail":["gpu:2(IDX:0-1"]}]}"#,
                "no (IDX",
            ),
            (
                br#"{"jobs":[{"job_id":1,"nodes":"n[1","gres_detail":[]}]}"#,
                "unbalanced",
            ),
        ] {
            let e = gpu_indices_from_json(doc, 1, "n1").unwrap_err().to_string();
            assert!(e.contains(want), "{e} (wanted {want})");
        }
        // data_parser's number wrapper, and a job_id that is not ours.
        let doc = br#"{"jobs":[{"job_id":{"set":true,"infinite":false,"number":1},"nodes":"n1","gres_detail":["gpu:1(IDX:3)"]},
                              {"job_id":2,"nodes":"n1","gres_detail":["gpu:1(IDX:0)"]}]}"#;
        assert_eq!(gpu_indices_from_json(doc, 1, "n1").unwrap(), vec![3]);
        // Empty string or null for this node: nothing.
        let doc = br#"{"jobs":[{"job_id":1,"nodes":"n[1-2]","gres_detail":["", null]}]}"#;
        assert_eq!(
            gpu_indices_from_json(doc, 1, "n1").unwrap(),
            Vec::<u32>::new()
        );
        assert_eq!(
            gpu_indices_from_json(doc, 1, "n2").unwrap(),
            Vec::<u32>::new()
        );
    }

    // --- gres_detail grammar -------------------------------------------------

    #[test]
    fn detail_shapes() {
        let e = parse_gres_detail("gpu:sim:1(IDX:0),gpu:held:2(IDX:2-3)").unwrap();
        assert_eq!(
            e,
            vec![
                GresDetailEntry {
                    name: "gpu".into(),
                    gres_type: Some("sim".into()),
                    count: Some(1),
                    alloc: idx(&[0])
                },
                GresDetailEntry {
                    name: "gpu".into(),
                    gres_type: Some("held".into()),
                    count: Some(2),
                    alloc: idx(&[2, 3])
                },
            ]
        );
        let e = parse_gres_detail("gpu:3(IDX:0,2-3)").unwrap();
        assert_eq!(e[0].gres_type, None);
        assert_eq!(e[0].alloc, idx(&[0, 2, 3]));
        let e = parse_gres_detail("gpu:a100(CNT:2),nic(CNT:1)").unwrap();
        assert_eq!(e[0].alloc, GresAlloc::Cnt(2));
        assert_eq!(e[0].gres_type.as_deref(), Some("a100"));
        assert_eq!(e[0].count, None);
        assert_eq!(e[1].gres_type, None);
        let e = parse_gres_detail("shard:a100:6(0/8,4/8,2/8,0/8),gpu:a100:1(IDX:1),mps:100(IDX:0)")
            .unwrap();
        assert_eq!(
            e[0].alloc,
            GresAlloc::Shared(vec![(0, 8), (4, 8), (2, 8), (0, 8)])
        );
        assert_eq!(gpu_indices(&e).unwrap(), vec![1]);
        // no_consume GPUs print a count of 0; an empty bitmap prints no list.
        assert_eq!(
            gpu_indices(&parse_gres_detail("gpu:0(IDX:0-1)").unwrap()).unwrap(),
            vec![0, 1]
        );
        assert_eq!(
            gpu_indices(&parse_gres_detail("gpu:t:0(IDX:)").unwrap()).unwrap(),
            Vec::<u32>::new()
        );
        // A typed and an untyped record naming the same device.
        assert_eq!(
            gpu_indices(&parse_gres_detail("gpu:2(IDX:0-1),gpu:x:1(IDX:1)").unwrap()).unwrap(),
            vec![0, 1]
        );
        assert_eq!(parse_gres_detail("").unwrap(), vec![]);
    }

    #[test]
    fn detail_types_with_parentheses() {
        // User-chosen type spellings: anything but ',' and ':'.
        for (s, want) in [
            ("gpu:a(IDX:2(IDX:0)", vec![0]),
            ("gpu:x(1/2):1(IDX:3)", vec![3]),
            ("gpu:x(1/2)(CNT:1),gpu:1(IDX:4)", vec![4]),
            ("gpu:)(:1(IDX:5),gpu:((IDX:1(IDX:6)", vec![5, 6]),
            (
                "shard:((0/8):2(0/8,2/8),gpu:y)(CNT)(IDX)x:1(IDX:7)",
                vec![7],
            ),
        ] {
            let e = parse_gres_detail(s).unwrap_or_else(|e| panic!("{s}: {e}"));
            let got: Vec<u32> = e
                .iter()
                .filter(|e| e.name == "gpu")
                .flat_map(|e| match &e.alloc {
                    GresAlloc::Idx(v) => v.clone(),
                    _ => vec![],
                })
                .collect();
            assert_eq!(got, want, "{s}: {e:?}");
        }
        let e = parse_gres_detail("gpu:a(IDX:2(IDX:0)").unwrap();
        assert_eq!(e[0].gres_type.as_deref(), Some("a(IDX"));
        assert_eq!(e[0].count, Some(2));
    }

    #[test]
    fn detail_rejects() {
        for s in [
            "gpu",
            "gpu:1",
            "gpu:1(IDX:0",
            "gpu:1(IDX:0),",
            ",gpu:1(IDX:0)",
            "gpu:1(IDX:0)x",
            "gpu:1(IDX:0)(IDX:1)",
            "(IDX:0)",
            ":1(IDX:0)",
            "gpu(IDX:0)",
            "gpu::1(IDX:0)",
            "gpu:a:b:1(IDX:0)",
            "gpu:x(IDX:0)",
            "gpu:1(IDX:1-0)",
            "gpu:1(IDX:3,1)",
            "gpu:1(IDX:1,1)",
            "gpu:1(IDX:0-)",
            "gpu:1(IDX:-1)",
            "gpu:1(IDX:,)",
            "gpu:1(IDX:4294967296)",
            "gpu:1(IDX:0-4294967295)",
            "gpu(CNT:)",
            "gpu:1(CNT:1x)",
            "shard:1(1/)",
            "shard:1(/)",
        ] {
            assert!(
                parse_gres_detail(s).is_err(),
                "{s:?} parsed: {:?}",
                parse_gres_detail(s)
            );
        }
        // 127 characters may be a cut list.
        let long: Vec<String> = (0..64).map(|i| (i * 2).to_string()).collect();
        let list = long.join(",");
        let cut = &list[..IDX_TRUNCATED_LEN];
        let e = parse_gres_detail(&format!("gpu:64(IDX:{cut})"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot be trusted"), "{e}");
        let ok = &list[..list[..IDX_TRUNCATED_LEN - 1].rfind(',').unwrap()];
        assert!(parse_gres_detail(&format!("gpu:1(IDX:{ok})")).is_ok());
    }

    // --- hostlists -----------------------------------------------------------

    #[test]
    fn hostlists() {
        assert_eq!(expand_hostlist("gf1").unwrap(), ["gf1"]);
        assert_eq!(expand_hostlist("").unwrap(), Vec::<String>::new());
        assert_eq!(
            expand_hostlist("gpu[01-02,10],login,n[8-10]").unwrap(),
            ["gpu01", "gpu02", "gpu10", "login", "n8", "n9", "n10"]
        );
        assert_eq!(
            expand_hostlist("r[1-2]n[1-2]-ib").unwrap(),
            ["r1n1-ib", "r1n2-ib", "r2n1-ib", "r2n2-ib"]
        );
        assert_eq!(
            expand_hostlist("a[001-3]").unwrap(),
            ["a001", "a002", "a003"]
        );
        assert_eq!(
            hostlist_find("gpu[01-02,10],login", "gpu10").unwrap(),
            (Some(2), 4)
        );
        assert_eq!(
            hostlist_find("gpu[01-02,10],login", "gpu1").unwrap(),
            (None, 4)
        );
        assert_eq!(hostlist_find("n1,n1", "n1").unwrap(), (Some(0), 2));
        for bad in [
            "a[",
            "a]",
            "a[1-",
            "a[2-1]",
            "a[]",
            "a[[1]]",
            "a,,b",
            "a[x]",
            "a[1-2",
            ",a",
            "a[0-99999999999]",
        ] {
            assert!(hostlist_find(bad, "a").is_err(), "{bad}");
        }
    }

    // --- the command -----------------------------------------------------------

    fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    const ONE: &str = r#"{"errors":[],"jobs":[{"job_id":5,"nodes":"n[1-2]","gres_detail":["gpu:a:1(IDX:1)","gpu:a:1(IDX:0),gpu:b:1(IDX:3)"]}]}"#;

    #[test]
    fn runs_scontrol_with_a_clean_environment() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("out.json");
        std::fs::write(&out, ONE).unwrap();
        let log = d.path().join("log");
        let sc = script(
            d.path(),
            "scontrol",
            &format!(
                "echo \"$*|$SLURM_CONF|${{HOME-unset}}|$(pwd)\" > {}\ncat {}",
                log.display(),
                out.display()
            ),
        );
        let conf = Path::new("/etc/x/slurm.conf");
        let got = job_gpu_indices(&sc, Some(conf), 5, "n2", Duration::from_secs(10)).unwrap();
        assert_eq!(got, vec![0, 3]);
        assert_eq!(
            std::fs::read_to_string(&log).unwrap().trim(),
            "--json show job 5|/etc/x/slurm.conf|unset|/"
        );
    }

    #[test]
    fn falls_back_to_squeue_on_2205() {
        let d = tempfile::tempdir().unwrap();
        let sc = script(
            d.path(),
            "scontrol",
            "echo \"scontrol: unrecognized option '--json'\" >&2\necho 'Try \"scontrol --help\" for more information' >&2\nexit 1",
        );
        let fx = fixture_dir().join("squeue-22.05-sim1-held1.json");
        script(
            d.path(),
            "squeue",
            &format!("[ \"$*\" = --json ] || exit 3\ncat {}", fx.display()),
        );
        let got = job_gpu_indices(&sc, None, 2, "gf1", Duration::from_secs(10)).unwrap();
        assert_eq!(got, vec![0, 2]);
        // No squeue next to it.
        std::fs::remove_file(d.path().join("squeue")).unwrap();
        let e = job_gpu_indices(&sc, None, 2, "gf1", Duration::from_secs(10)).unwrap_err();
        let NodeError::SlurmdG { cmd, msg } = &e else {
            panic!("{e}")
        };
        assert!(cmd.ends_with("squeue --json"), "{cmd}");
        assert!(msg.contains("Slurm 22.05"), "{msg}");
    }

    #[test]
    fn command_failures() {
        let d = tempfile::tempdir().unwrap();
        let t = Duration::from_secs(10);
        let err = |body: &str, name: &str| {
            let sc = script(d.path(), name, body);
            let e = job_gpu_indices(&sc, None, 5, "n1", t).unwrap_err();
            match e {
                NodeError::SlurmdG { cmd, msg } => {
                    assert!(cmd.contains("--json show job 5"), "{cmd}");
                    msg
                }
                other => panic!("{other}"),
            }
        };
        let m = err(
            "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1",
            "a",
        );
        assert!(
            m.contains("exit status: 1") && m.contains("Invalid job id"),
            "{m}"
        );
        let m = err(
            r#"echo '{"errors":[{"description":"Unable to find job","error":"Invalid job id specified"}],"jobs":[]}'; exit 1"#,
            "b",
        );
        assert!(
            m.contains("Unable to find job (Invalid job id specified)"),
            "{m}"
        );
        let m = err("kill -SEGV $$", "c");
        assert!(m.contains("signal"), "{m}");
        let m = err("echo '{\"jobs\": []}'", "d");
        assert!(m.contains("not in slurmctld's answer"), "{m}");
        let m = err("echo 'JobId=5 JobName=x'", "e");
        assert!(m.contains("not JSON"), "{m}");
        let e = job_gpu_indices(&d.path().join("missing"), None, 5, "n1", t).unwrap_err();
        assert!(e.to_string().contains("cannot run it"), "{e}");
    }

    #[test]
    fn slow_command_is_killed() {
        let d = tempfile::tempdir().unwrap();
        let sc = script(d.path(), "scontrol", "exec sleep 30");
        let start = Instant::now();
        let e = job_gpu_indices(&sc, None, 5, "n1", Duration::from_millis(200)).unwrap_err();
        assert!(e.to_string().contains("no answer within 200 ms"), "{e}");
        assert!(start.elapsed() < Duration::from_secs(5));
    }

    // --- properties -------------------------------------------------------------

    /// A gres_detail item formatted as Slurm does.
    #[derive(Clone, Debug)]
    enum Item {
        Idx {
            name: &'static str,
            typ: Option<String>,
            count: u64,
            set: Vec<u32>,
        },
        Cnt {
            name: &'static str,
            typ: Option<String>,
            count: u64,
        },
        Shared {
            name: &'static str,
            typ: Option<String>,
            count: u64,
            per: Vec<(u64, u64)>,
        },
    }

    fn bit_fmt(set: &[u32]) -> String {
        let mut parts = Vec::new();
        let mut i = 0;
        while i < set.len() {
            let mut j = i;
            while j + 1 < set.len() && set[j + 1] == set[j] + 1 {
                j += 1;
            }
            parts.push(if i == j {
                set[i].to_string()
            } else {
                format!("{}-{}", set[i], set[j])
            });
            i = j + 1;
        }
        parts.join(",")
    }

    fn render(items: &[Item]) -> String {
        let name = |n: &str, t: &Option<String>| match t {
            Some(t) => format!("{n}:{t}"),
            None => n.to_string(),
        };
        items
            .iter()
            .map(|it| match it {
                Item::Idx {
                    name: n,
                    typ,
                    count,
                    set,
                } => format!("{}:{count}(IDX:{})", name(n, typ), bit_fmt(set)),
                Item::Cnt {
                    name: n,
                    typ,
                    count,
                } => format!("{}(CNT:{count})", name(n, typ)),
                Item::Shared {
                    name: n,
                    typ,
                    count,
                    per,
                } => format!(
                    "{}:{count}({})",
                    name(n, typ),
                    per.iter()
                        .map(|(a, b)| format!("{a}/{b}"))
                        .collect::<Vec<_>>()
                        .join(",")
                ),
            })
            .collect::<Vec<_>>()
            .join(",")
    }

    fn arb_item() -> impl Strategy<Value = Item> {
        // Types: anything but ',' and ':' (user text), parentheses included.
        let typ = proptest::option::of("[a-zA-Z0-9_()/ IDXCNT.-]{1,12}");
        let name = prop_oneof![Just("gpu"), Just("shard"), Just("mps"), Just("nic")];
        let set = proptest::collection::btree_set(0u32..64, 0..10)
            .prop_map(|s| s.into_iter().collect::<Vec<_>>());
        prop_oneof![
            (name.clone(), typ.clone(), 0u64..100, set).prop_map(|(name, typ, count, set)| {
                Item::Idx {
                    name,
                    typ,
                    count,
                    set,
                }
            }),
            (name.clone(), typ.clone(), 0u64..100).prop_map(|(name, typ, count)| Item::Cnt {
                name,
                typ,
                count
            }),
            (
                Just("shard"),
                typ,
                0u64..100,
                proptest::collection::vec((0u64..9, 0u64..9), 1..5)
            )
                .prop_map(|(name, typ, count, per)| Item::Shared {
                    name,
                    typ,
                    count,
                    per
                }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn detail_parser_never_panics(s in "\\PC*") {
            let _ = parse_gres_detail(&s);
        }

        #[test]
        fn detail_parser_never_panics_on_near_misses(s in "[gpu:shard(IDX:CNT)0-9,/ -]{0,60}") {
            if let Ok(entries) = parse_gres_detail(&s) {
                let _ = gpu_indices(&entries);
            }
        }

        #[test]
        fn detail_round_trip(items in proptest::collection::vec(arb_item(), 1..6)) {
            let s = render(&items);
            let got = parse_gres_detail(&s).map_err(|e| TestCaseError::fail(format!("{s}: {e}")))?;
            prop_assert_eq!(got.len(), items.len(), "{}", s);
            for (g, it) in got.iter().zip(&items) {
                match it {
                    Item::Idx { name, typ, count, set } => {
                        prop_assert_eq!(&g.name, name);
                        prop_assert_eq!(&g.gres_type, typ);
                        prop_assert_eq!(g.count, Some(*count));
                        prop_assert_eq!(&g.alloc, &GresAlloc::Idx(set.clone()));
                    }
                    Item::Cnt { name, typ, count } => {
                        prop_assert_eq!(&g.name, name);
                        prop_assert_eq!(&g.gres_type, typ);
                        prop_assert_eq!(&g.alloc, &GresAlloc::Cnt(*count));
                    }
                    Item::Shared { name, typ, count, per } => {
                        prop_assert_eq!(&g.name, name);
                        prop_assert_eq!(&g.gres_type, typ);
                        prop_assert_eq!(g.count, Some(*count));
                        prop_assert_eq!(&g.alloc, &GresAlloc::Shared(per.clone()));
                    }
                }
            }
        }

        #[test]
        fn hostlist_never_panics(s in "[a-c0-9\\[\\],-]{0,40}", n in "[a-c0-9]{1,4}") {
            let _ = hostlist_find(&s, &n);
            let _ = expand_hostlist(&s);
        }

        #[test]
        fn hostlist_ranges_expand_like_slurm(prefix in "[a-z]{1,4}", nums in proptest::collection::btree_set(0u32..300, 1..20), width in 1usize..4) {
            let nums: Vec<u32> = nums.into_iter().collect();
            let list = format!("{prefix}[{}]", bit_fmt(&nums).split(',').map(|p| {
                let (a, b) = p.split_once('-').unwrap_or((p, p));
                let (a, b): (u32, u32) = (a.parse().unwrap(), b.parse().unwrap());
                if a == b { format!("{a:0width$}") } else { format!("{a:0width$}-{b:0width$}") }
            }).collect::<Vec<_>>().join(","));
            let want: Vec<String> = nums.iter().map(|n| format!("{prefix}{n:0width$}")).collect();
            prop_assert_eq!(expand_hostlist(&list).unwrap(), want.clone());
            for (i, h) in want.iter().enumerate() {
                prop_assert_eq!(hostlist_find(&list, h).unwrap(), (Some(i), want.len()));
            }
        }
    }
}
