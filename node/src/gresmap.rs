//! GRES index → device files, from slurmd's own list (`slurmd -G`).
//!
//! Sources, first that applies: the config's `slurmd_gres` file; the cache
//! under `state_dir` (written by the plugin when slurmd starts) when its key
//! matches; else `slurmd -G` is run with the `SLURM_CONF` in force and its
//! output cached. The cache key names the slurm.conf path and the size and
//! mtime of slurm.conf and gres.conf next to it. When those files changed
//! since the cache was written, the running slurmd still numbers GPUs the
//! old way, so the Prolog refuses ([`NodeError::GresChanged`]) until slurmd
//! is restarted, rather than map indices with a newer list.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use gpufence_model::gres::{parse_slurmd_g, GresDevice};

use crate::{Node, NodeError};

/// Default slurm.conf when `SLURM_CONF` is unset (Debian's and Slurm's default).
pub const DEFAULT_SLURM_CONF: &str = "/etc/slurm/slurm.conf";
/// Set in the environment of the `slurmd -G` child, so a plugin loaded
/// there (it is not, as of 22.05-25.11, but cheap to guard) never recurses.
pub const IN_SLURMD_G_ENV: &str = "GPUFENCE_IN_SLURMD_G";
/// How long `slurmd -G` may take (NVML initialisation with AutoDetect is slow).
pub const SLURMD_G_TIMEOUT: Duration = Duration::from_secs(60);

const CACHE_HEADER: &str = "# gpufence slurmd -G cache key: ";

/// The node's GPUs in GRES-index order, and where the list came from.
#[derive(Clone, Debug)]
pub struct GresMap {
    /// The GPUs.
    pub devices: Vec<GresDevice>,
    /// The file or command they came from.
    pub source: String,
}

fn cache_key(slurm_conf: &Path) -> String {
    let stamp = |p: &Path| {
        std::fs::metadata(p)
            .map(|m| format!("{}:{}.{}", m.size(), m.mtime(), m.mtime_nsec()))
            .unwrap_or_else(|_| "absent".into())
    };
    let gres_conf = slurm_conf.with_file_name("gres.conf");
    format!(
        "{} {} {}",
        slurm_conf.display(),
        stamp(slurm_conf),
        stamp(&gres_conf)
    )
}

/// Loads the GRES list for this node. `slurm_conf` is the `SLURM_CONF` of
/// the caller (slurmd sets it for the Prolog), `None` for the default.
///
/// # Errors
/// [`NodeError`] when the file cannot be read, `slurmd -G` fails, or the
/// output does not parse.
pub fn load(node: &Node, slurm_conf: Option<&Path>) -> Result<GresMap, NodeError> {
    if let Some(file) = &node.cfg.slurmd_gres {
        let text = std::fs::read_to_string(file).map_err(|e| NodeError::io("read", file, e))?;
        return Ok(GresMap {
            devices: parse_slurmd_g(&text, file)?,
            source: file.display().to_string(),
        });
    }
    let conf = slurm_conf
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_SLURM_CONF));
    let key = cache_key(&conf);
    let cache = node.state.gres_cache_path();
    if let Ok(text) = std::fs::read_to_string(&cache) {
        let cached_key = text
            .lines()
            .next()
            .and_then(|l| l.strip_prefix(CACHE_HEADER))
            .unwrap_or("");
        if cached_key == key {
            return Ok(GresMap {
                devices: parse_slurmd_g(&text, &cache)?,
                source: cache.display().to_string(),
            });
        }
        // The cache is written when slurmd starts, and slurmd keeps the GRES
        // order it read then. If the same config files changed since, a
        // fresh `slurmd -G` would number GPUs differently from the running
        // slurmd: jobs would get each other's GPUs. Refuse instead.
        if cached_key.starts_with(&format!("{} ", conf.display())) {
            return Err(NodeError::GresChanged {
                cached: cached_key.to_string(),
                now: key,
            });
        }
    }
    refresh(node, &conf)
}

/// Runs `slurmd -G` for `slurm_conf` and rewrites the cache.
///
/// # Errors
/// [`NodeError::SlurmdG`] when it cannot run, times out or exits non-zero;
/// [`NodeError::Parse`] when its output is malformed.
pub fn refresh(node: &Node, slurm_conf: &Path) -> Result<GresMap, NodeError> {
    let key = cache_key(slurm_conf);
    let text = run_slurmd_g(&node.cfg.slurmd_bin, slurm_conf)?;
    let cmd = format!("{} -G", node.cfg.slurmd_bin.display());
    let devices = parse_slurmd_g(&text, Path::new(&cmd))?;
    node.state
        .write_gres_cache(&format!("{CACHE_HEADER}{key}\n{text}"))?;
    Ok(GresMap {
        devices,
        source: cmd,
    })
}

fn run_slurmd_g(slurmd: &Path, slurm_conf: &Path) -> Result<String, NodeError> {
    let cmd = format!(
        "SLURM_CONF={} {} -G",
        slurm_conf.display(),
        slurmd.display()
    );
    let fail = |msg: String| NodeError::SlurmdG {
        cmd: cmd.clone(),
        msg,
    };
    let mut child = Command::new(slurmd)
        .arg("-G")
        .env("SLURM_CONF", slurm_conf)
        .env(IN_SLURMD_G_ENV, "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| fail(e.to_string()))?;
    // slurmd -G logs to stderr; read both pipes on threads so neither fills.
    let mut out = child.stdout.take();
    let mut err = child.stderr.take();
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(o) = out.as_mut() {
            let _ = std::io::Read::read_to_string(o, &mut s);
        }
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(e) = err.as_mut() {
            let _ = std::io::Read::read_to_string(e, &mut s);
        }
        s
    });
    let deadline = std::time::Instant::now() + SLURMD_G_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(fail(format!(
                    "no answer within {}s",
                    SLURMD_G_TIMEOUT.as_secs()
                )));
            }
            Err(e) => return Err(fail(e.to_string())),
        }
    };
    let stdout = t_out.join().unwrap_or_default();
    let stderr = t_err.join().unwrap_or_default();
    if !status.success() {
        let tail: Vec<&str> = stderr.lines().rev().take(3).collect();
        return Err(fail(format!(
            "{status}: {}",
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        )));
    }
    Ok(format!("{stdout}{stderr}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpufence_model::config::{Config, ConfigOrigin};
    use std::os::unix::fs::PermissionsExt;

    /// A stand-in `slurmd` at the C-library-free boundary we call: a script
    /// that prints `slurmd -G`-shaped lines on stderr (as slurmd does) and
    /// counts its runs.
    fn fake_slurmd(dir: &Path, body: &str) -> PathBuf {
        let p = dir.join("slurmd");
        std::fs::write(
            &p,
            format!(
                "#!/bin/sh\necho run >> {}/runs\n[ \"$1\" = -G ] || exit 9\n{body}\n",
                dir.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    fn node(dir: &Path, slurmd: &Path) -> Node {
        let text = format!(
            "state_dir = \"{d}/state\"\naudit_log = \"{d}/a.jsonl\"\nslurmd_bin = \"{s}\"\n",
            d = dir.display(),
            s = slurmd.display()
        );
        Node::new(
            Config::parse(&text, Path::new("t.toml")).unwrap(),
            ConfigOrigin::Defaults,
        )
        .unwrap()
    }

    fn runs(dir: &Path) -> usize {
        std::fs::read_to_string(dir.join("runs"))
            .unwrap_or_default()
            .lines()
            .count()
    }

    #[test]
    fn runs_slurmd_once_then_uses_the_cache_and_refuses_a_changed_config() {
        let d = tempfile::tempdir().unwrap();
        let s = fake_slurmd(
            d.path(),
            "echo \"slurmd: Gres Name=gpu Type=(null) Count=1 Index=3 ID=1 File=/dev/nvidia3 (null)\" >&2\n\
             echo \"slurmd: Gres Name=gpu Type=(null) Count=1 Index=1 ID=1 File=/dev/nvidia1 (null)\" >&2",
        );
        let n = node(d.path(), &s);
        let conf = d.path().join("slurm.conf");
        std::fs::write(&conf, "ClusterName=x\n").unwrap();
        let m = load(&n, Some(&conf)).unwrap();
        assert_eq!(m.devices[1].files, vec![PathBuf::from("/dev/nvidia1")]);
        assert_eq!(runs(d.path()), 1);
        let m = load(&n, Some(&conf)).unwrap();
        assert_eq!(
            (m.devices.len(), runs(d.path())),
            (2, 1),
            "served from the cache"
        );
        assert!(m.source.ends_with("slurmd-G.txt"));
        std::fs::write(d.path().join("gres.conf"), "Name=gpu File=/dev/nvidia1\n").unwrap();
        let e = load(&n, Some(&conf)).unwrap_err();
        assert!(matches!(e, NodeError::GresChanged { .. }), "{e}");
        assert!(e.to_string().contains("restart slurmd"), "{e}");
        assert_eq!(
            runs(d.path()),
            1,
            "gres.conf changed since slurmd started: refused, not recomputed"
        );
        let other = d.path().join("other.conf");
        std::fs::write(&other, "").unwrap();
        load(&n, Some(&other)).unwrap();
        assert_eq!(runs(d.path()), 2, "another SLURM_CONF: slurmd -G for it");
        refresh(&n, &conf).unwrap();
        load(&n, Some(&conf)).unwrap();
        assert_eq!(
            runs(d.path()),
            3,
            "a slurmd restart (refresh) pins the new order"
        );
    }

    #[test]
    fn failing_slurmd_is_an_error_with_its_words() {
        let d = tempfile::tempdir().unwrap();
        let s = fake_slurmd(
            d.path(),
            "echo 'slurmd: fatal: Unable to open gres.conf' >&2; exit 1",
        );
        let n = node(d.path(), &s);
        let e = load(&n, Some(&d.path().join("slurm.conf"))).unwrap_err();
        assert!(
            matches!(&e, NodeError::SlurmdG { msg, .. } if msg.contains("Unable to open gres.conf")),
            "{e}"
        );
        assert!(!n.state.gres_cache_path().exists(), "nothing cached");
    }
}
