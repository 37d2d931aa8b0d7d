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
//! - **srun step**: a step other than the batch one (images only: no
//!   script, no rules compiled), its Pyxis image by tag.
//!
//! Times are the call's wall time, ms: reading the script (page cache),
//! compiling the rules, scanning, and for findings the audit append. The
//! slurm-spank conversion of `S_JOB_ENV` into a vector (one `strlen` per
//! variable, every variable) is outside it, and not measured.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Instant;

use gpufence_model::config::{Config, ConfigOrigin, DoorMode};
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
    /// Median ms with `warn`.
    pub warn_ms: f64,
    /// 95th percentile ms with `warn`.
    pub warn_p95_ms: f64,
    /// Findings (the lines `warn` gave).
    pub lines: usize,
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
        let (mut t_off, mut t_warn) = (Vec::new(), Vec::new());
        let mut lines = 0;
        for i in 0..runs.max(1) {
            for first in [i % 2 == 0, i % 2 != 0] {
                let n = if first { &off } else { &warn };
                let t = Instant::now();
                let d = check_step(n, None, &step);
                let ms = t.elapsed().as_secs_f64() * 1e3;
                if first {
                    t_off.push(ms);
                } else {
                    t_warn.push(ms);
                    lines = d.user_lines.len();
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
            lines,
        });
    }
    out
}

/// The results as a Markdown table.
pub fn print(r: &[DoorResult], runs: usize) {
    println!(
        "| input | script | variables | off, ms | warn, ms (median) | warn p95 | added | lines |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for x in r {
        println!(
            "| {} | {} B | {} | {:.3} | {:.2} | {:.2} | {:.2} ms | {} |",
            x.input,
            x.script_bytes,
            x.env_vars,
            x.off_ms,
            x.warn_ms,
            x.warn_p95_ms,
            x.warn_ms - x.off_ms,
            x.lines
        );
    }
    println!("\n{runs} runs per mode, interleaved.");
}
