//! What the job's door (`gpufence_node::job::door::check_step`, run by the
//! plugin in the batch step's `slurm_spank_init`) adds to a job's start:
//! the same call with `job_secrets`/`container_images` `off` and `warn`,
//! side by side (interleaved run by run), on inputs of four sizes:
//!
//! - **typical**: a 2 KiB batch script (the false-positive corpus's
//!   `torchrun-ddp.sh`) and an environment of 80 variables (a login
//!   shell's);
//! - **secret**: the same with a Hugging Face token in the script and one
//!   in the environment (the line and the audit event are written);
//! - **1 MiB script**: the corpus repeated to 1 MiB, the bound;
//! - **100k env**: the typical script and 100,000 variables (4096 read);
//! - **binary**: 1 MiB of pseudo-random bytes and the 100k environment;
//! - **1 MiB of tokens**: a GitLab token on every line to 1 MiB (some
//!   38,000 matches: the findings' bound and the line index, where a count
//!   from byte 0 per match once took 20 s and more);
//! - **srun step**: a step other than the batch one (images only: no
//!   script, no rules compiled), its Pyxis image by tag.
//!
//! Times are the call's wall time, ms: reading the script (page cache),
//! the keyword search, compiling the rules it selects, scanning, and for
//! findings the audit append. **Every run is a fresh process** (a `fork`
//! of the bench, which never scans itself): slurmstepd is one per step,
//! so the rules a step compiles are compiled again in the next; a
//! measurement in a process that has scanned before would not pay them.
//! Per input, interleaved run by run, each in its own child:
//!
//! - **off**: `check_step` with the checks `off`;
//! - **warn**: `check_step` at `warn` (keywords, then the rules they
//!   select, compiled);
//! - **warm**: the same in a child that ran it once before (rules already
//!   compiled: the scan alone);
//! - **all rules**: the door before the keyword prefilter, replicated here
//!   (not in the product): the script read as the door reads it, every
//!   rule and the AWS secret's regex compiled (ASCII, as the door does)
//!   and run over the script and the environment; no findings built.
//!
//! The slurm-spank conversion of `S_JOB_ENV` into a vector (one `strlen`
//! per variable, every variable) is outside it, and not measured.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Instant;

use gpufence_model::config::{Config, ConfigOrigin, DoorMode};
use gpufence_model::secrets::{self, ENV_MAX_BYTES, ENV_MAX_VARS, RULES, SCRIPT_MAX_BYTES};
use gpufence_node::job::door::{check_step, DoorStep, BATCH_STEP_ID};
use gpufence_node::job::grant::StepRequest;
use gpufence_node::Node;

/// One input, both modes.
#[derive(Debug, Clone)]
pub struct DoorResult {
    /// The input's name.
    pub input: String,
    /// Script bytes.
    pub script_bytes: usize,
    /// Variables.
    pub env_vars: usize,
    /// Median ms with the checks off.
    pub off_ms: f64,
    /// Median ms with `warn`, in a fresh process.
    pub warn_ms: f64,
    /// 95th percentile ms with `warn`, in a fresh process.
    pub warn_p95_ms: f64,
    /// Median ms with `warn` in a process that ran it before.
    pub warm_ms: f64,
    /// Median ms of every rule compiled and run (the door before the
    /// keyword prefilter, replicated in the bench).
    pub all_rules_ms: f64,
    /// The rules `warn` compiled.
    pub compiled: usize,
    /// Findings (the lines `warn` gave).
    pub lines: usize,
}

/// Runs `f` in a forked child and returns what it gave: (ms, a count, a
/// count). The child exits with `_exit` (no destructor of the parent's
/// runs in it).
fn in_child(f: impl FnOnce() -> (f64, u32, u32)) -> (f64, u32, u32) {
    let mut fds = [0i32; 2];
    // SAFETY: a two-int array for pipe(2).
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0, "pipe");
    // SAFETY: the bench is one thread here; the child only runs `f` and
    // writes to the pipe before `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork");
    if pid == 0 {
        let (ms, a, b) = f();
        let mut buf = [0u8; 16];
        buf[..8].copy_from_slice(&ms.to_ne_bytes());
        buf[8..12].copy_from_slice(&a.to_ne_bytes());
        buf[12..].copy_from_slice(&b.to_ne_bytes());
        // SAFETY: writing our buffer to our pipe, then leaving at once.
        unsafe {
            libc::write(fds[1], buf.as_ptr().cast(), buf.len());
            libc::_exit(0);
        }
    }
    let mut buf = [0u8; 16];
    // SAFETY: closing our copy of the write end; reading into our buffer;
    // reaping our child.
    let n = unsafe {
        libc::close(fds[1]);
        let n = libc::read(fds[0], buf.as_mut_ptr().cast(), buf.len());
        libc::close(fds[0]);
        let mut st = 0;
        libc::waitpid(pid, &mut st, 0);
        n
    };
    assert_eq!(n, 16, "the child gave no result");
    let ms = f64::from_ne_bytes(buf[..8].try_into().unwrap_or_default());
    let a = u32::from_ne_bytes(buf[8..12].try_into().unwrap_or_default());
    let b = u32::from_ne_bytes(buf[12..].try_into().unwrap_or_default());
    (ms, a, b)
}

/// The door before the keyword prefilter, for comparison: the script
/// read to its bound, the environment joined to its bounds, every rule
/// (and the AWS secret's regex) compiled with Unicode off and run over
/// both. Returns the matches (so nothing is optimised away).
fn all_rules(script: &Path, env: &[&OsStr]) -> usize {
    let mut text = std::fs::read(script).unwrap_or_default();
    text.truncate(SCRIPT_MAX_BYTES);
    let mut joined = Vec::new();
    for v in env.iter().take(ENV_MAX_VARS) {
        if joined.len() + v.len() + 1 > ENV_MAX_BYTES {
            break;
        }
        joined.extend_from_slice(v.as_bytes());
        joined.push(b'\n');
    }
    let mut n = 0;
    for re in RULES.iter().map(|r| r.regex).chain([secrets::AWS_SECRET]) {
        let re = regex::bytes::RegexBuilder::new(re)
            .unicode(false)
            .build()
            .expect("rule");
        n += re.captures_iter(&text).count() + re.captures_iter(&joined).count();
    }
    n
}

/// (name, step id, script, environment).
type Input<'a> = (&'a str, u32, &'a [u8], &'a [Vec<u8>]);

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn p95(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() * 95) / 100).min(v.len() - 1)]
}

fn node(dir: &Path, mode: DoorMode) -> Node {
    let cfg = Config {
        state_dir: dir.join("state"),
        audit_log: dir.join("audit.jsonl"),
        job_secrets: mode,
        container_images: mode,
        ..Config::default()
    };
    Node::new(cfg, ConfigOrigin::Defaults).expect("node")
}

/// Runs every input `runs` times in each mode, alternating.
pub fn run(runs: usize) -> Vec<DoorResult> {
    let dir = tempfile::tempdir().expect("tempdir");
    let corpus = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/secrets/clean/torchrun-ddp.sh"),
    )
    .expect("corpus");
    let login_env: Vec<Vec<u8>> = (0..80)
        .map(|i| format!("VAR_{i}=/usr/local/share/some/path/{i}:/usr/bin").into_bytes())
        .collect();
    let big_env: Vec<Vec<u8>> = (0..100_000)
        .map(|i| format!("V{i}=value-of-variable-{i}").into_bytes())
        .collect();
    let mut secret_script = corpus.clone();
    secret_script.extend_from_slice(b"export HF_TOKEN=hf_FAKEfakeFAKEfakeTESTtestTESTtestXY\n");
    let mut secret_env = login_env.clone();
    secret_env.push(b"GL_TOKEN=glpat-FAKEfake0123TESTtest".to_vec());
    let mut mib = Vec::new();
    while mib.len() < (1 << 20) {
        mib.extend_from_slice(&corpus);
    }
    mib.truncate(1 << 20);
    let mut tokens = Vec::new();
    let mut i = 0u64;
    while tokens.len() < (1 << 20) {
        tokens.extend_from_slice(format!("T=glpat-{:020x}\n", i * 2_654_435_761).as_bytes());
        i += 1;
    }
    tokens.truncate(1 << 20);
    let binary: Vec<u8> = (0..(1u32 << 20))
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let mut pyxis_env = login_env.clone();
    pyxis_env.push(
        b"_SLURM_SPANK_OPTION_pyxis_container_image=nvcr.io#nvidia/pytorch:24.05-py3".to_vec(),
    );
    let inputs: Vec<Input> = vec![
        ("typical", BATCH_STEP_ID, &corpus, &login_env),
        ("secret", BATCH_STEP_ID, &secret_script, &secret_env),
        ("1 MiB script", BATCH_STEP_ID, &mib, &login_env),
        ("100k env", BATCH_STEP_ID, &corpus, &big_env),
        ("binary + 100k env", BATCH_STEP_ID, &binary, &big_env),
        ("1 MiB of tokens", BATCH_STEP_ID, &tokens, &login_env),
        ("srun step, image by tag", 0, b"", &pyxis_env),
    ];
    let off = node(dir.path(), DoorMode::Off);
    let warn = node(dir.path(), DoorMode::Warn);
    let mut out = Vec::new();
    for (name, step_id, script, env) in inputs {
        let req = StepRequest {
            job_id: 1,
            step_id,
            uid: 1000,
            stepd_pid: std::process::id() as i32,
        };
        let path = dir.path().join("slurm_script");
        std::fs::write(&path, script).expect("script");
        let python = OsStr::new("python");
        let argv = [if step_id == BATCH_STEP_ID {
            path.as_os_str()
        } else {
            python
        }];
        let env: Vec<&OsStr> = env.iter().map(|v| OsStr::from_bytes(v)).collect();
        let step = DoorStep {
            req: &req,
            argv: &argv,
            env: Some(&env),
        };
        let (mut t_off, mut t_warn, mut t_warm, mut t_all) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut lines, mut compiled) = (0, 0);
        for i in 0..runs.max(1) {
            for k in 0..4 {
                match (i + k) % 4 {
                    0 => t_off.push(
                        in_child(|| {
                            let t = Instant::now();
                            let _ = check_step(&off, None, &step);
                            (t.elapsed().as_secs_f64() * 1e3, 0, 0)
                        })
                        .0,
                    ),
                    1 => {
                        let (ms, c, l) = in_child(|| {
                            let t = Instant::now();
                            let d = check_step(&warn, None, &step);
                            let ms = t.elapsed().as_secs_f64() * 1e3;
                            let c = secrets::compiled_rules().len() as u32;
                            (ms, c, d.user_lines.len() as u32)
                        });
                        t_warn.push(ms);
                        compiled = c as usize;
                        lines = l as usize;
                    }
                    2 => t_warm.push(
                        in_child(|| {
                            let _ = check_step(&warn, None, &step);
                            let t = Instant::now();
                            let _ = check_step(&warn, None, &step);
                            (t.elapsed().as_secs_f64() * 1e3, 0, 0)
                        })
                        .0,
                    ),
                    _ => t_all.push(
                        in_child(|| {
                            let t = Instant::now();
                            let n = all_rules(&path, &env);
                            (t.elapsed().as_secs_f64() * 1e3, n as u32, 0)
                        })
                        .0,
                    ),
                }
            }
        }
        out.push(DoorResult {
            input: name.into(),
            script_bytes: script.len(),
            env_vars: env.len(),
            off_ms: median(&mut t_off),
            warn_ms: median(&mut t_warn),
            warn_p95_ms: p95(&mut t_warn),
            warm_ms: median(&mut t_warm),
            all_rules_ms: median(&mut t_all),
            compiled,
            lines,
        });
    }
    out
}

/// The results as a Markdown table.
pub fn print(r: &[DoorResult], runs: usize) {
    println!(
        "| input | script | variables | off, ms | warn, ms (median) | warn p95 | added | rules compiled | warm, ms | all rules (before), ms | lines |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for x in r {
        println!(
            "| {} | {} B | {} | {:.3} | {:.2} | {:.2} | {:.2} ms | {} of {} | {:.2} | {:.2} | {} |",
            x.input,
            x.script_bytes,
            x.env_vars,
            x.off_ms,
            x.warn_ms,
            x.warn_p95_ms,
            x.warn_ms - x.off_ms,
            x.compiled,
            RULES.len(),
            x.warm_ms,
            x.all_rules_ms,
            x.lines
        );
    }
    println!("\n{runs} runs per mode, interleaved, each in a fresh (forked) process.");
}
