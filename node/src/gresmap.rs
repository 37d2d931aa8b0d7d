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
//!
//! An empty list is an answer only when Slurm has no GPUs here: when
//! gres.conf (next to slurm.conf, where Slurm reads it) names GPUs for this
//! node, an empty list is [`NodeError::NoGpusListed`], never "0 GPUs" (25.05
//! changed the line prefix of `slurmd -G`, and a parser that wanted
//! `slurmd: ` read no GPU without an error).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use gpufence_model::gres::{expand_file_list, parse_slurmd_g, GresDevice};

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
/// output does not parse (a line naming `Name=gpu` in no shape the parser
/// knows included, [`parse_slurmd_g`]); [`NodeError::NoGpusListed`] when
/// the list is empty while gres.conf names GPUs for this node
/// ([`gres_conf_gpu_line`]); [`NodeError::GresChanged`] (see the module).
pub fn load(node: &Node, slurm_conf: Option<&Path>) -> Result<GresMap, NodeError> {
    let conf = slurm_conf
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_SLURM_CONF));
    if let Some(file) = &node.cfg.slurmd_gres {
        let text = std::fs::read_to_string(file).map_err(|e| NodeError::io("read", file, e))?;
        return checked(
            parse_slurmd_g(&text, file)?,
            file.display().to_string(),
            &conf,
        );
    }
    let key = cache_key(&conf);
    let cache = node.state.gres_cache_path();
    if let Ok(text) = std::fs::read_to_string(&cache) {
        let cached_key = text
            .lines()
            .next()
            .and_then(|l| l.strip_prefix(CACHE_HEADER))
            .unwrap_or("");
        if cached_key == key {
            return checked(
                parse_slurmd_g(&text, &cache)?,
                cache.display().to_string(),
                &conf,
            );
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

/// Runs `slurmd -G` for `slurm_conf` and rewrites the cache. Nothing is
/// cached when it fails.
///
/// # Errors
/// [`NodeError::SlurmdG`] when it cannot run, times out or exits non-zero;
/// [`NodeError::Parse`] when its output is malformed or has a line naming
/// `Name=gpu` in no shape the parser knows ([`parse_slurmd_g`]);
/// [`NodeError::NoGpusListed`] when it lists no GPU while gres.conf names
/// GPUs for this node ([`gres_conf_gpu_line`]).
pub fn refresh(node: &Node, slurm_conf: &Path) -> Result<GresMap, NodeError> {
    let key = cache_key(slurm_conf);
    let text = run_slurmd_g(&node.cfg.slurmd_bin, slurm_conf)?;
    let cmd = format!("{} -G", node.cfg.slurmd_bin.display());
    let map = checked(parse_slurmd_g(&text, Path::new(&cmd))?, cmd, slurm_conf)?;
    node.state
        .write_gres_cache(&format!("{CACHE_HEADER}{key}\n{text}"))?;
    Ok(map)
}

/// `devices` from `source` as a [`GresMap`], unless the list is empty while
/// the gres.conf next to `slurm_conf` names GPUs for this node.
fn checked(
    devices: Vec<GresDevice>,
    source: String,
    slurm_conf: &Path,
) -> Result<GresMap, NodeError> {
    if devices.is_empty() {
        let gres_conf = slurm_conf.with_file_name("gres.conf");
        // Absent or unreadable: nothing says this node has GPUs (slurmd
        // itself reports a gres.conf it cannot read).
        if let Ok(text) = std::fs::read_to_string(&gres_conf) {
            if let Some((line, text)) = gres_conf_gpu_line(&text, &crate::sweep::node_name()) {
                return Err(NodeError::NoGpusListed {
                    source_name: source,
                    gres_conf,
                    line,
                    text,
                });
            }
        }
    }
    Ok(GresMap { devices, source })
}

/// The first line of gres.conf `text` that gives this node GPUs, with its
/// 1-based number and text: a line with `Name=gpu`, or with `AutoDetect=`
/// set to anything but `off` (GPUs found through NVML, RSMI, ...), that
/// either has no `NodeName=` or whose `NodeName=` list names `node_name`.
///
/// A tolerant scan, not Slurm's parser (`src/interfaces/gres.c`): `#`
/// starts a comment; keys and the `gpu`/`off` values are matched ignoring
/// ASCII case, as Slurm does (`xstrcasecmp`, `xstrcasestr`); a `NodeName=`
/// list is expanded like a `File=` list (`gpu[01-04],gpu10`), and a list
/// that does not expand that way (two brackets in one name) is taken to
/// name this node. `Include` lines are not followed. Slurm matches
/// `NodeName=` against slurmd's own node name (`_parse_gres_config_node`);
/// gpufence knows it as `$SLURMD_NODENAME` (the Prolog) or the short host
/// name (slurmd start), see [`crate::sweep::node_name`].
pub fn gres_conf_gpu_line(text: &str, node_name: &str) -> Option<(usize, String)> {
    text.lines().enumerate().find_map(|(i, raw)| {
        let line = raw.split('#').next().unwrap_or("").trim();
        let mut gpus = false;
        let mut here = true;
        for tok in line.split_whitespace() {
            let Some((k, v)) = tok.split_once('=') else {
                continue;
            };
            let v = v.trim_matches('"');
            match k.to_ascii_lowercase().as_str() {
                "name" if v.eq_ignore_ascii_case("gpu") => gpus = true,
                "autodetect" if !v.eq_ignore_ascii_case("off") => gpus = true,
                "nodename" => {
                    here = expand_file_list(v).map_or(true, |names| {
                        names.iter().any(|n| n.as_os_str() == node_name)
                    })
                }
                _ => {}
            }
        }
        (gpus && here).then(|| (i + 1, line.to_string()))
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

    /// Every real `slurmd -G` shape, printed by a stand-in slurmd on stderr
    /// as slurmd prints it, gives gres.conf's two GPUs in its order, fresh
    /// and from the cache.
    #[test]
    fn real_release_outputs_map_the_same_gpus() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/slurmd-G");
        for name in [
            "slurmd-G-22.05.8.txt",
            "slurmd-G-24.11.5.txt",
            "slurmd-G-24.11.5-LogTimeFormat-format_stderr.txt",
            "slurmd-G-26.05.5.txt",
        ] {
            let d = tempfile::tempdir().unwrap();
            let s = fake_slurmd(d.path(), &format!("cat {} >&2", dir.join(name).display()));
            let n = node(d.path(), &s);
            let conf = d.path().join("slurm.conf");
            std::fs::write(&conf, "ClusterName=x\n").unwrap();
            std::fs::write(
                d.path().join("gres.conf"),
                "Name=gpu File=/dev/nvidia3\nName=gpu File=/dev/nvidia1\n",
            )
            .unwrap();
            let want = vec![
                vec![PathBuf::from("/dev/nvidia3")],
                vec![PathBuf::from("/dev/nvidia1")],
            ];
            let m = refresh(&n, &conf).unwrap();
            assert_eq!(
                m.devices
                    .iter()
                    .map(|g| g.files.clone())
                    .collect::<Vec<_>>(),
                want,
                "{name}"
            );
            let m = load(&n, Some(&conf)).unwrap();
            assert!(m.source.ends_with("slurmd-G.txt"), "{name}: cached");
            assert_eq!(
                m.devices
                    .iter()
                    .map(|g| g.files.clone())
                    .collect::<Vec<_>>(),
                want,
                "{name}"
            );
        }
    }

    /// No GPU from slurmd while gres.conf gives this node GPUs: an error
    /// naming the command (or file) and the gres.conf line; nothing cached.
    #[test]
    fn no_gpus_while_gres_conf_names_some_is_an_error() {
        let d = tempfile::tempdir().unwrap();
        let s = fake_slurmd(
            d.path(),
            "echo '[2026-12-01T22:02:21.693] error: Controller cpuset is not enabled!' >&2",
        );
        let n = node(d.path(), &s);
        let conf = d.path().join("slurm.conf");
        std::fs::write(&conf, "ClusterName=x\n").unwrap();
        let gres = d.path().join("gres.conf");
        for text in [
            "# two GPUs\nName=gpu File=/dev/nvidia3\n",
            "NAME=GPU File=/dev/nvidia3 # upper case, as Slurm allows\n",
            "AutoDetect=nvml\n",
            "NodeName=no-such-node-x Name=gpu File=/dev/nvidia0\nName=gpu Type=a100 File=/dev/nvidia1\n",
        ] {
            std::fs::write(&gres, text).unwrap();
            let e = refresh(&n, &conf).unwrap_err();
            assert!(
                matches!(&e, NodeError::NoGpusListed { source_name, gres_conf, .. }
                    if source_name.ends_with("slurmd -G") && *gres_conf == gres),
                "{text:?}: {e}"
            );
            assert!(e.to_string().contains("lists no GPU"), "{e}");
            assert!(!n.state.gres_cache_path().exists(), "nothing cached");
            let e = load(&n, Some(&conf)).unwrap_err();
            assert!(matches!(e, NodeError::NoGpusListed { .. }), "{e}");
        }
        // A node whose gres.conf gives it no GPU: an empty list is right.
        for text in [
            "",
            "# Name=gpu File=/dev/nvidia0\n",
            "AutoDetect=off\n",
            "NodeName=no-such-node-x Name=gpu File=/dev/nvidia0\n",
            "NodeName=no-such-node-[1-3] AutoDetect=nvml\n",
            "Name=mps Count=100 File=/dev/nvidia0\n",
        ] {
            std::fs::write(&gres, text).unwrap();
            assert!(refresh(&n, &conf).unwrap().devices.is_empty(), "{text:?}");
        }
        std::fs::remove_file(&gres).unwrap();
        assert!(
            refresh(&n, &conf).unwrap().devices.is_empty(),
            "no gres.conf"
        );

        // The slurmd_gres file of the config: the error names it.
        let file = d.path().join("gres-list.txt");
        std::fs::write(&file, "").unwrap();
        std::fs::write(&gres, "Name=gpu File=/dev/nvidia0\n").unwrap();
        let text = format!(
            "state_dir = \"{d}/state2\"\naudit_log = \"{d}/a.jsonl\"\nslurmd_gres = \"{f}\"\n",
            d = d.path().display(),
            f = file.display()
        );
        let n2 = Node::new(
            Config::parse(&text, Path::new("t.toml")).unwrap(),
            ConfigOrigin::Defaults,
        )
        .unwrap();
        let e = load(&n2, Some(&conf)).unwrap_err();
        assert!(
            matches!(&e, NodeError::NoGpusListed { source_name, line: 1, .. } if *source_name == file.display().to_string()),
            "{e}"
        );
    }

    /// A `slurmd -G` line that names a GPU in a shape the parser does not
    /// know fails the refresh; it is not read as "no GPU".
    #[test]
    fn an_unknown_output_shape_is_an_error() {
        let d = tempfile::tempdir().unwrap();
        let s = fake_slurmd(
            d.path(),
            "echo '<6>slurmd[12] Gres Name=gpu Type=(null) Count=1 ID=1 File=/dev/nvidia0' >&2",
        );
        let n = node(d.path(), &s);
        let conf = d.path().join("slurm.conf");
        let e = refresh(&n, &conf).unwrap_err();
        assert!(
            matches!(&e, NodeError::Parse(p) if p.line == 1 && p.msg.contains("names Name=gpu")),
            "{e}"
        );
        assert!(!n.state.gres_cache_path().exists(), "nothing cached");
    }

    #[test]
    fn gres_conf_lines_that_give_this_node_gpus() {
        let f = |t: &str| gres_conf_gpu_line(t, "gpu07");
        assert_eq!(
            f("# x\nName=gpu File=/dev/nvidia0\n"),
            Some((2, "Name=gpu File=/dev/nvidia0".into()))
        );
        assert_eq!(
            f("  name=Gpu type=a100 file=/dev/nvidia0"),
            Some((1, "name=Gpu type=a100 file=/dev/nvidia0".into()))
        );
        assert_eq!(f("AutoDetect=nvml"), Some((1, "AutoDetect=nvml".into())));
        assert_eq!(f("autodetect=OFF"), None);
        assert_eq!(
            f("NodeName=gpu[01-08] Name=gpu File=/dev/nvidia[0-3]").map(|l| l.0),
            Some(1)
        );
        assert_eq!(
            f("NodeName=gpu[01-06],gpu08 Name=gpu File=/dev/nvidia0"),
            None
        );
        assert_eq!(f("NodeName=gpu07 AutoDetect=nvml").map(|l| l.0), Some(1));
        assert_eq!(
            f("NodeName=gpu[01-02]-ib[0-1] Name=gpu File=/dev/nvidia0").map(|l| l.0),
            Some(1),
            "a list that does not expand here may name this node"
        );
        assert_eq!(
            f("Name=gpux File=/dev/x\nName=mps Count=100\n#Name=gpu"),
            None
        );
        assert_eq!(f("Name=shard Count=8 # Name=gpu"), None);
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
