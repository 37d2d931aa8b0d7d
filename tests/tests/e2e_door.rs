//! The job's door on real Slurm (`gpufence_node::job::door`): credentials
//! in batch scripts and submission environments, container images by tag,
//! on the host's 22.05 (layout `own`) and on 26.05 (Debian sid's root, a
//! real cgroup/v2 node).
//!
//! Every secret here is synthetic: the shape of its rule
//! (`gpufence_model::secrets`) with FAKE/TEST in it. After each job the
//! values must be absent from everything gpufence and Slurm's node side
//! write: the job's output file, the audit log, the evidence directory,
//! slurmd's log.
//!
//! There is no Pyxis on these nodes: the Pyxis option variable
//! (`_SLURM_SPANK_OPTION_pyxis_container_image`, which sbatch puts in the
//! job's environment when Pyxis is loaded) is set in sbatch's environment
//! directly, which reaches slurmstepd the same way.

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpufence_tests::cluster::{job_state, Cluster, ClusterSpec};
use gpufence_tests::out::{both, stdout};
use gpufence_tests::v2node::{Release, V2Slice};
use gpufence_tests::{privileged, TestEnv};
use serde_json::Value;

/// (gitleaks rule id, the line of the script, the secret in it).
fn secret_lines() -> Vec<(&'static str, String, String)> {
    let pem_body =
        "FAKEFAKEfakefake0123456789TESTtestTESTtest0123456789FAKEFAKEfakefake\n".repeat(2);
    let pem = format!("-----BEGIN RSA PRIVATE KEY-----\n{pem_body}-----END RSA PRIVATE KEY-----");
    let one = |id, line: &str, secret: &str| (id, line.to_string(), secret.to_string());
    vec![
        one(
            "github-pat",
            "git clone https://ghp_FAKEfake0123456789TESTtestFAKEfake0123@github.com/x/y || true",
            "ghp_FAKEfake0123456789TESTtestFAKEfake0123",
        ),
        one(
            "gitlab-pat",
            "export GL=glpat-FAKEfake0123TESTtest",
            "glpat-FAKEfake0123TESTtest",
        ),
        one(
            "huggingface-access-token",
            "export HF_TOKEN=hf_FAKEfakeFAKEfakeTESTtestTESTtestXY",
            "hf_FAKEfakeFAKEfakeTESTtestTESTtestXY",
        ),
        one(
            "slack-bot-token",
            "export SLACK=xoxb-1234567890-1234567890-FAKEfakeTESTtest",
            "xoxb-1234567890-1234567890-FAKEfakeTESTtest",
        ),
        one(
            "aws-access-token",
            "export AWS_ACCESS_KEY_ID=AKIAFAKE2345TESTFAKE AWS_SECRET_ACCESS_KEY=fakeFAKEfake0123456789/+TESTtestTESTtest",
            "fakeFAKEfake0123456789/+TESTtestTESTtest",
        ),
        one(
            "generic-api-key",
            "export WANDB_API_KEY=fake0123FAKE4567test89TEST",
            "fake0123FAKE4567test89TEST",
        ),
        (
            "private-key",
            format!("cat > /dev/null <<'EOF'\n{pem}\nEOF"),
            "FAKEFAKEfakefake0123456789TESTtestTESTtest0123456789FAKEFAKEfakefake".into(),
        ),
    ]
}

fn audit(env: &TestEnv) -> Vec<Value> {
    gpufence_tests::audit_log(&env.path("log/audit.jsonl"))
}

fn events(env: &TestEnv, job: u32, name: &str) -> Vec<Value> {
    audit(env)
        .into_iter()
        .filter(|e| e["job_id"] == job && e["event"] == name)
        .collect()
}

/// Submits `script` (written to the jobs directory as `name`) with sbatch
/// as the test user, `vars` in sbatch's environment, and waits (90 s at
/// most) for the job to leave the queue; (job id, its output).
fn run_batch(
    cluster: &Cluster,
    env: &TestEnv,
    name: &str,
    script: &str,
    vars: &[(&str, &str)],
) -> (u32, String) {
    let path = env.path(&format!("jobs/{name}"));
    std::fs::write(&path, script).unwrap();
    let out = env.path(&format!("jobs/{name}.out"));
    let mut cmd = cluster.user_cmd("env");
    for (k, v) in vars {
        cmd.arg(format!("{k}={v}"));
    }
    let o = cmd
        .args(["sbatch", "--parsable", "-o"])
        .arg(&out)
        .arg(&path)
        .output()
        .unwrap();
    assert!(o.status.success(), "sbatch {name}: {}", both(&o));
    let job: u32 = stdout(&o)
        .trim()
        .split(';')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        Cluster::wait_for(Duration::from_secs(90), || job_state(cluster, job)
            .is_empty()
            || ["COMPLETED", "FAILED"].contains(&job_state(cluster, job).as_str())
                && out.exists()),
        "job {job} ({name}) did not end: {}\n{}",
        job_state(cluster, job),
        cluster.log_tail("slurmd.log")
    );
    // the output file is complete once the batch step is gone
    std::thread::sleep(Duration::from_millis(500));
    let text = std::fs::read_to_string(&out).unwrap_or_default();
    eprintln!(
        "--- job {job} ({name}): {}\n{text}",
        job_state(cluster, job)
    );
    (job, text)
}

/// Panics when any of `secrets` is in a file gpufence or slurmd wrote.
fn assert_nowhere(cluster: &Cluster, env: &TestEnv, outputs: &[String], secrets: &[String]) {
    let mut files: Vec<(String, String)> = outputs
        .iter()
        .enumerate()
        .map(|(i, o)| (format!("job output {i}"), o.clone()))
        .collect();
    for p in [
        env.path("log/audit.jsonl"),
        cluster.dir.join("log/slurmd.log"),
    ] {
        files.push((
            p.display().to_string(),
            std::fs::read_to_string(&p).unwrap_or_default(),
        ));
    }
    let evidence = env.path("evidence");
    for e in walk(&evidence) {
        files.push((
            e.display().to_string(),
            String::from_utf8_lossy(&std::fs::read(&e).unwrap_or_default()).into_owned(),
        ));
    }
    for s in secrets {
        for (name, text) in &files {
            assert!(!text.contains(s.as_str()), "{name} holds the secret {s}");
        }
    }
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(walk(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}

/// The credentials' line of a job's output.
fn door_line(out: &str) -> Option<&str> {
    out.lines().find(|l| {
        l.starts_with("gpufence: job ") && l.contains("credentials in the job's submission")
    })
}

/// Appends `text` to the cluster's gpufence config (the plugin loads it
/// at each step).
fn add_config(cluster: &Cluster, text: &str) {
    let mut c = std::fs::read_to_string(&cluster.config).unwrap();
    // top-level keys go before any table
    match c.find("\n[") {
        Some(i) => c.insert_str(i + 1, &format!("{text}\n")),
        None => c.push_str(&format!("\n{text}\n")),
    }
    std::fs::write(&cluster.config, c).unwrap();
}

const TAG: &str = "nvcr.io#nvidia/pytorch:24.05-py3";
const PYXIS: &str = "_SLURM_SPANK_OPTION_pyxis_container_image";

#[test]
fn secrets_and_images_at_the_door_slurm_22_05() {
    if !privileged() {
        return;
    }
    let env = TestEnv::new("e2edoor");
    let n0 = env.mknod("nvidia0", 195, 0);
    let cluster = Cluster::start(
        &env,
        &format!("Name=gpu Type=sim File={}\n", n0.display()),
        "gpu:sim:1",
        &format!(
            "layout = \"own\"\nnvml = false\nexempt_cgroups = [\"{}/slurmd\"]\n[majors]\nnvidia = 195\n",
            env.root
        ),
        std::env::var("GPUFENCE_E2E_PORT_BASE")
            .ok()
            .and_then(|v| v.parse::<u16>().ok())
            .map_or(18717, |p| p + 1800),
    );
    // The plugin reads slurm.conf at each step; the daemons keep theirs
    // (there is no slurmdbd here: the flag is what the line reports).
    let mut conf = std::fs::read_to_string(&cluster.slurm_conf).unwrap();
    conf.push_str("AccountingStoreFlags=job_script,job_env\n");
    std::fs::write(&cluster.slurm_conf, conf).unwrap();

    let mut outputs = Vec::new();
    let mut secrets: Vec<String> = Vec::new();

    // 1. Every kind in one script: warned, each on its line, the job runs.
    let lines = secret_lines();
    let mut script = String::from("#!/bin/sh\n");
    for (_, line, secret) in &lines {
        script.push_str(line);
        script.push('\n');
        secrets.push(secret.clone());
    }
    script.push_str("echo RAN\n");
    let (job, out) = run_batch(&cluster, &env, "kinds.sh", &script, &[]);
    assert!(out.lines().any(|l| l == "RAN"), "warn runs the job:\n{out}");
    let line = door_line(&out).unwrap_or_else(|| panic!("no credentials line:\n{out}"));
    for kind in [
        "a GitHub token on line 2 of the script",
        "a GitLab token on line 3",
        "a Hugging Face token on line 4",
        "a Slack token on line 5",
        "an AWS access key on line 6",
        "a password or token on line 7",
        "1 more",
        "StateSaveLocation",
        "AccountingStoreFlags=job_script",
        "secret manager",
    ] {
        assert!(line.contains(kind), "{kind:?} not in {line}");
    }
    let ev = events(&env, job, "job_secret");
    assert_eq!(ev.len(), 1, "one audit event per job: {ev:?}");
    let rules: Vec<&str> = ev[0]["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["rule"].as_str().unwrap())
        .collect();
    for (id, _, _) in &lines {
        assert!(rules.contains(id), "{id} not in {rules:?}");
    }
    assert_eq!(ev[0]["action"], "warn");
    outputs.push(out);

    // 2. A secret in the submission environment: named by variable.
    let hf = "hf_TESTtestTESTtestFAKEfakeFAKEfakeZZ";
    secrets.push(hf.into());
    let (job, out) = run_batch(
        &cluster,
        &env,
        "envsecret.sh",
        "#!/bin/sh\necho RAN\n",
        &[("HF_TOKEN", hf)],
    );
    let line = door_line(&out).unwrap_or_else(|| panic!("no line:\n{out}"));
    assert!(
        line.contains("a Hugging Face token in HF_TOKEN of the environment")
            && line.contains("--export=NONE")
            && line.contains("AccountingStoreFlags=job_env"),
        "{line}"
    );
    assert_eq!(events(&env, job, "job_secret").len(), 1);
    outputs.push(out);

    // 3. The false-positive corpus: real scripts of the kinds sites run,
    //    their #SBATCH lines made comments (they ask for nodes and GPUs
    //    this one-node cluster lacks); silent.
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/secrets");
    let mut names: Vec<PathBuf> = walk(&corpus.join("clean"));
    names.sort();
    for p in &names {
        let text = std::fs::read_to_string(p)
            .unwrap()
            .replace("#SBATCH", "#-SBATCH");
        let name = p.file_name().unwrap().to_str().unwrap();
        let (job, out) = run_batch(&cluster, &env, name, &text, &[]);
        assert!(door_line(&out).is_none(), "{name} warned:\n{out}");
        assert!(events(&env, job, "job_secret").is_empty(), "{name}");
    }

    //    And a login environment of the same kinds (Lmod's base64
    //    module table, conda, NCCL, GPU UUIDs, digests), sent by sbatch.
    let login = std::fs::read_to_string(corpus.join("clean-env.txt")).unwrap();
    let vars: Vec<(&str, &str)> = login
        .lines()
        .filter_map(|l| l.split_once('='))
        .filter(|(k, _)| {
            !k.starts_with("BASH_FUNC")
                && ![
                    "PATH",
                    "HOME",
                    "USER",
                    "LOGNAME",
                    "SHELL",
                    "PWD",
                    "LD_LIBRARY_PATH",
                ]
                .contains(k)
        })
        .collect();
    assert!(vars.len() > 30);
    let (job, out) = run_batch(
        &cluster,
        &env,
        "login-env.sh",
        "#!/bin/sh\necho RAN\n",
        &vars,
    );
    assert!(
        out.lines().any(|l| l == "RAN") && door_line(&out).is_none(),
        "{out}"
    );
    assert!(events(&env, job, "job_secret").is_empty());

    // 4. A huge script (2 MiB, its secret past the first MiB): read to its
    //    first MiB, silent to the user, runs; the audit log says what was
    //    not read (a padded script is seen).
    let big = format!(
        "#!/bin/sh\n{}\nexport T=ghp_FAKEfake0123456789TESTtestFAKEfake9999\necho RAN\n",
        format!("# {}\n", "x".repeat(1000)).repeat(2048)
    );
    let (job, out) = run_batch(&cluster, &env, "big.sh", &big, &[]);
    assert!(
        out.lines().any(|l| l == "RAN") && door_line(&out).is_none(),
        "{out}"
    );
    let partly = events(&env, job, "check_failed");
    assert_eq!(partly.len(), 1, "{partly:?}");
    assert!(
        partly[0]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("partly read") && r.contains("first 1048576 bytes")),
        "{partly:?}"
    );

    // 5. Images through the Pyxis option variable: a tag warned, a digest
    //    silent.
    let (job, out) = run_batch(
        &cluster,
        &env,
        "tag.sh",
        "#!/bin/sh\necho RAN\n",
        &[(PYXIS, TAG)],
    );
    assert!(
        out.lines().any(|l| l.contains(&format!(
            "container image {TAG} (--container-image) is named by tag, not by digest"
        ))) && out.lines().any(|l| l == "RAN"),
        "{out}"
    );
    assert_eq!(events(&env, job, "container_image").len(), 1);
    let digest = format!("nvcr.io#nvidia/pytorch@sha256:{}", "5c8b1e0f".repeat(8));
    let (job, out) = run_batch(
        &cluster,
        &env,
        "digest.sh",
        "#!/bin/sh\necho RAN\n",
        &[(PYXIS, &digest)],
    );
    assert!(!out.contains("container image"), "{out}");
    assert!(events(&env, job, "container_image").is_empty());

    // 6. refuse: the job fails before its script runs, with the line.
    add_config(
        &cluster,
        "job_secrets = \"refuse\"\ncontainer_images = \"refuse\"",
    );
    let (job, out) = run_batch(
        &cluster,
        &env,
        "refused.sh",
        "#!/bin/sh\necho RAN\nexport GL=glpat-FAKEfake0123TESTtest\n",
        &[],
    );
    assert!(!out.lines().any(|l| l == "RAN"), "refused job ran:\n{out}");
    assert!(
        out.lines().any(|l| l.starts_with(&format!(
            "gpufence: job {job} refused (job_secrets = \"refuse\"): credentials"
        )) && l.contains("a GitLab token on line 3 of the script")),
        "{out}"
    );
    let ev = events(&env, job, "job_secret");
    assert!(ev.len() == 1 && ev[0]["action"] == "refuse", "{ev:?}");
    let o = cluster.admin("scontrol", &["show", "job", &job.to_string()]);
    assert!(stdout(&o).contains("JobState=FAILED"), "{}", both(&o));
    outputs.push(out);
    let (_, out) = run_batch(
        &cluster,
        &env,
        "tag-refused.sh",
        "#!/bin/sh\necho RAN\n",
        &[(PYXIS, TAG)],
    );
    assert!(!out.lines().any(|l| l == "RAN"), "{out}");
    assert!(out.contains("container image"), "{out}");
    outputs.push(out);

    assert_nowhere(&cluster, &env, &outputs, &secrets);
}

#[test]
fn a_secret_at_the_door_slurm_26_05_debian_sid() {
    if !privileged() {
        return;
    }
    let Some(release) = Release::debian("sid") else {
        return;
    };
    let env = TestEnv::new("door-sid");
    let n0 = env.mknod("nvidia0", 195, 0);
    let slice = V2Slice::claim();
    let cluster = Cluster::start_with(
        &env,
        &ClusterSpec {
            root: release.root.clone(),
            plugin: release.plugin.clone(),
            gres_conf: format!("Name=gpu Type=sim File={}\n", n0.display()),
            node_gres: "gpu:sim:1".into(),
            gpufence_extra: "nvml = false\n[majors]\nnvidia = 195\n".into(),
            port_base: std::env::var("GPUFENCE_V2NODE_PORT_BASE")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(17417),
            v2node: Some(slice.spec("Alloc,Contain")),
            ..ClusterSpec::default()
        },
    );
    let (hf_line, hf) = (
        "export HF_TOKEN=hf_FAKEfakeFAKEfakeTESTtestTESTtestXY",
        "hf_FAKEfakeFAKEfakeTESTtestTESTtestXY",
    );
    let gl = "glpat-FAKEfake0123TESTtest";
    let (job, out) = run_batch(
        &cluster,
        &env,
        "sid.sh",
        &format!("#!/bin/sh\n{hf_line}\necho RAN\n"),
        &[("GL_TOKEN", gl), (PYXIS, TAG)],
    );
    assert!(
        out.lines().any(|l| l == "RAN"),
        "{out}\n{}",
        cluster.log_tail("slurmd.log")
    );
    let line = door_line(&out).unwrap_or_else(|| panic!("no line:\n{out}"));
    assert!(
        line.contains("a Hugging Face token on line 2 of the script")
            && line.contains("a GitLab token in GL_TOKEN of the environment"),
        "{line}"
    );
    assert!(out.contains("(--container-image) is named by tag"), "{out}");
    assert_eq!(events(&env, job, "job_secret").len(), 1);
    assert_eq!(events(&env, job, "container_image").len(), 1);
    Cluster::wait_for(Duration::from_secs(10), || {
        slice
            .job_cgroups(&gpufence_tests::cluster::hostname())
            .is_empty()
    });
    assert_nowhere(&cluster, &env, &[out], &[hf.into(), gl.into()]);
}
