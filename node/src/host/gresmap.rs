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
//!
//! `slurmd -G` is no pure query: before it prints, it sets up Slurm's
//! cgroup plugin as slurmd does (`_slurmd_init`,
//! `src/slurmd/slurmd/slurmd.c`: `cgroup_g_init`, `src/interfaces/cgroup.c`,
//! calls `cgroup_p_setup_scope`, `src/plugins/cgroup/v2/cgroup_v2.c`), and
//! takes the cgroup it runs in for slurmd's:
//!
//! - without `INVOCATION_ID` in its environment (systemd's mark of a
//!   service it started; a Prolog's environment has none) it takes itself
//!   for a slurmd started by hand and moves into `<stepd scope>/slurmd`
//!   (`_migrate_to_stepd_scope`, 22.05 to 25.11.2;
//!   `_reparent_into_cgroup(stepd_scope_path, "slurmd")` from 25.11.3), a
//!   cgroup the fence does not exempt, so NVML's opens of its GPU
//!   autodetection (`AutoDetect=nvml`) would be denied by gpufence itself;
//! - with `INVOCATION_ID` it stays in the cgroup it was started in, and
//!   from 25.11.3 makes `<that cgroup>/slurmd` and moves into it, unless
//!   that cgroup is named `slurmd` already (`_reparent_into_cgroup`);
//! - then (24.11.4+, 25.05+) it resets `cpuset.cpus`, `cpuset.mems` and
//!   `memory.max` of the cgroup it ended up in (`_unset_cpu_mem_limits`):
//!   started from slurmd's own cgroup (the plugin at slurmd start, which
//!   inherits slurmd's `INVOCATION_ID`), that is slurmd's cgroup, with the
//!   limits slurmd set there (`CoreSpecCount`, `MemSpecLimit`).
//!
//! So gpufence runs it in a cgroup of its own, never in slurmd's or its
//! caller's: `<cgroup_root>/<exec_cgroup>/slurmd-G-<pid>`
//! ([`slurmd_g_cgroup`], `<pid>` the gpufence process running it), made
//! with [`crate::host::exec_cgroup::exec_leaf`] (exempt in the fence when one is
//! installed, made all the same when none is), and joined between fork and
//! exec ([`gpufence_cgroup::Cgroup2::join_at_exec`]: the child never runs
//! anywhere else), with a fresh `INVOCATION_ID` (Slurm only tests that it
//! is set: `invoc_id = getenv("INVOCATION_ID")`, `cgroup_p_setup_scope`).
//! Slurm's moves and resets then stay inside that cgroup, and NVML opens
//! the GPUs from an exempt one. When the child has ended (or timed out),
//! whatever is still in the cgroup is killed (`slurmd -G` may fork) and the
//! tree (with Slurm's `slurmd` below it) is removed; the cgroups of runs
//! killed before they could do that are removed by the next run
//! ([`is_stale_leaf`]). If the cgroup cannot be made or joined, the refresh
//! fails ([`NodeError::SlurmdGCgroup`]).

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gpufence_cgroup::Fence;
use gpufence_model::audit::{events, AuditEvent};
use gpufence_model::config::{ConfigOrigin, DEFAULT_CONFIG_PATH};
use gpufence_model::gres::{expand_file_list, parse_slurmd_g, GresDevice};

use crate::host::slurmconf::slurm_conf_or_default;
use crate::{join_cgroup, Node, NodeError};

/// Set in the environment of the `slurmd -G` child, so a plugin loaded
/// there (it is not, as of 22.05-25.11, but cheap to guard) never recurses.
pub const IN_SLURMD_G_ENV: &str = "GPUFENCE_IN_SLURMD_G";
/// How long `slurmd -G` may take (NVML initialisation with AutoDetect is slow).
pub const SLURMD_G_TIMEOUT: Duration = Duration::from_secs(60);
/// Set, fresh for each run, in the environment of the `slurmd -G` child:
/// with it Slurm stays in the cgroup it was started in (see the module).
/// systemd's own is a random 128-bit id in 32 hex digits
/// (`systemd.exec(5)`); any value does for Slurm.
pub const INVOCATION_ID_ENV: &str = "INVOCATION_ID";
/// The cgroups `slurmd -G` runs in are `<exec cgroup>/slurmd-G-<pid>`.
pub const SLURMD_G_LEAF_PREFIX: &str = "slurmd-G-";
/// How long killed processes of a `slurmd -G` cgroup may take to leave it
/// (and to close its output pipes).
const CLEANUP_WAIT: Duration = Duration::from_secs(5);
/// One `slurmd -G` at a time in a process: its cgroup is named by the pid.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

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
    load_with(node, slurm_conf, run_slurmd_g)
}

/// How `slurmd -G` is run: [`run_slurmd_g`]; the unit tests, which have no
/// cgroup2 to write, run a stand-in without a cgroup of its own.
type Runner = fn(&Node, &Path) -> Result<String, NodeError>;

fn load_with(node: &Node, slurm_conf: Option<&Path>, run: Runner) -> Result<GresMap, NodeError> {
    let conf = slurm_conf_or_default(slurm_conf);
    if let Some(file) = &node.cfg.slurmd_gres {
        let text = std::fs::read_to_string(file).map_err(|e| NodeError::io("read", file, e))?;
        return checked(
            parse_slurmd_g(&text, file)?,
            file.display().to_string(),
            &conf,
        );
    }
    let key = cache_key(&conf);
    // This node's own cache (slurmd named its node: a host may run several
    // slurmd, each listing its own GPUs), else the one a slurmd started
    // without -N wrote (one slurmd on the host, found by hostname).
    let own = node.state.gres_cache_path_for(node.slurm_node.as_deref());
    let cache = if node.slurm_node.is_some() && !own.exists() {
        node.state.gres_cache_path()
    } else {
        own
    };
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
    refresh_with(node, &conf, run)
}

/// Runs `slurmd -G` for `slurm_conf`, in a cgroup of gpufence's own (see
/// the module), and rewrites the cache. Nothing is cached when it fails.
///
/// # Errors
/// [`NodeError::SlurmdGCgroup`] when its cgroup cannot be made or joined
/// (it does not run then); [`NodeError::SlurmdG`] when it cannot run,
/// times out or exits non-zero, or the fence cannot exempt its cgroup;
/// [`NodeError::Parse`] when its output is malformed or has a line naming
/// `Name=gpu` in no shape the parser knows ([`parse_slurmd_g`]);
/// [`NodeError::NoGpusListed`] when it lists no GPU while gres.conf names
/// GPUs for this node ([`gres_conf_gpu_line`]).
pub fn refresh(node: &Node, slurm_conf: &Path) -> Result<GresMap, NodeError> {
    refresh_with(node, slurm_conf, run_slurmd_g)
}

fn refresh_with(node: &Node, slurm_conf: &Path, run: Runner) -> Result<GresMap, NodeError> {
    // slurmd -G retries an unreadable slurm.conf for 60 s before it fails
    // (`s_p_parse_file`: "retrying in 1sec up to 60sec"): say why at once.
    if let Err(e) = std::fs::File::open(slurm_conf) {
        return Err(NodeError::SlurmConf {
            path: slurm_conf.to_path_buf(),
            source: e,
        });
    }
    let key = cache_key(slurm_conf);
    let text = run(node, slurm_conf)?;
    let cmd = format!("{} -G", node.cfg.slurmd_bin.display());
    let map = checked(parse_slurmd_g(&text, Path::new(&cmd))?, cmd, slurm_conf)?;
    node.state.write_gres_cache_for(
        node.slurm_node.as_deref(),
        &format!("{CACHE_HEADER}{key}\n{text}"),
    )?;
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
            if let Some((line, text)) =
                gres_conf_gpu_line(&text, &gpufence_model::nodename::node_name(None))
            {
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
/// name (slurmd start), see [`gpufence_model::nodename::node_name`].
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

/// The name of the cgroup the `slurmd -G` of process `pid` runs in, below
/// the exec cgroup: `slurmd-G-<pid>`.
pub fn slurmd_g_leaf(pid: u32) -> String {
    format!("{SLURMD_G_LEAF_PREFIX}{pid}")
}

/// The cgroup (relative to the mount) the `slurmd -G` of process `pid`
/// runs in: `<cgroup_root>/<exec_cgroup>/slurmd-G-<pid>`.
pub fn slurmd_g_cgroup(node: &Node, pid: u32) -> String {
    join_cgroup(&node.exec_cgroup(), &slurmd_g_leaf(pid))
}

/// The pid in the name of a `slurmd -G` cgroup: `Some` for
/// `slurmd-G-<pid>` as [`slurmd_g_leaf`] writes it (decimal, no sign, no
/// leading zero, not 0), `None` for any other name.
pub fn slurmd_g_leaf_pid(name: &str) -> Option<u32> {
    crate::host::exec_cgroup::pid_in_name(name.strip_prefix(SLURMD_G_LEAF_PREFIX)?)
}

/// Whether `name`, a cgroup in the exec cgroup, was left by an earlier
/// `slurmd -G` and is to be removed (what is in it killed first): a
/// `slurmd-G-<pid>` whose process is gone (`alive` says no: it was killed,
/// by a Prolog's timeout say, before it removed its cgroup), or whose pid
/// is `me`, this process (one run at a time in a process, so a cgroup of
/// its own is what an earlier run could not remove, or a dead process's
/// whose pid it now has). The cgroup of another live process is its run
/// in progress, left alone; so is anything not named `slurmd-G-<pid>`
/// (`gpufence exec`'s, the Prolog's and Epilog's).
pub fn is_stale_leaf(name: &str, me: u32, alive: impl Fn(u32) -> bool) -> bool {
    slurmd_g_leaf_pid(name).is_some_and(|pid| pid == me || !alive(pid))
}

fn pid_alive(pid: u32) -> bool {
    i32::try_from(pid).is_ok_and(crate::host::procs::alive)
}

/// A fresh `INVOCATION_ID`: 128 random bits in 32 lowercase hex digits, as
/// systemd writes its own.
fn fresh_invocation_id() -> String {
    let mut b = [0u8; 16];
    // SAFETY: getrandom writes at most `b.len()` bytes into `b`.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if usize::try_from(n).ok() != Some(b.len()) {
        // Slurm only tests that the variable is set; the clock and the pid
        // make it differ from run to run all the same.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        b = (t ^ (u128::from(std::process::id()) << 96)).to_le_bytes();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The `slurmd -G` command line, for messages.
fn cmd_line(slurmd: &Path, slurm_conf: &Path) -> String {
    format!(
        "SLURM_CONF={} {} -G",
        slurm_conf.display(),
        slurmd.display()
    )
}

/// `slurmd -G` with `SLURM_CONF`, the recursion guard and piped output;
/// where it runs is the caller's to say.
fn slurmd_g_command(slurmd: &Path, slurm_conf: &Path, slurm_node: Option<&str>) -> Command {
    let mut cmd = Command::new(slurmd);
    cmd.arg("-G");
    if let Some(n) = slurm_node {
        // Several slurmd on one host (MULTIPLE_SLURMD): this node's list.
        cmd.args(["-N", n]);
    }
    cmd.env("SLURM_CONF", slurm_conf)
        .env(IN_SLURMD_G_ENV, "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// [`NodeError::SlurmdGCgroup`] for cgroup `rel`.
fn cgroup_error(node: &Node, op: &'static str, rel: &str, msg: String) -> NodeError {
    NodeError::SlurmdGCgroup {
        op,
        cgroup: crate::host::cgpath::abs(rel),
        msg,
        mount: node.cg.mount().to_path_buf(),
        config: match &node.origin {
            ConfigOrigin::File(p) => p.display().to_string(),
            ConfigOrigin::Defaults => DEFAULT_CONFIG_PATH.to_string(),
        },
    }
}

/// Removes the cgroups earlier runs left in the exec cgroup
/// ([`is_stale_leaf`]), killing what is in them. Best effort: one that
/// cannot be removed now is tried again by the next run.
fn remove_stale_leaves(node: &Node, me: u32) {
    let base = node.exec_cgroup();
    let Ok(rd) = std::fs::read_dir(node.cg.path(&base)) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if e.file_type().is_ok_and(|t| t.is_dir()) && is_stale_leaf(&name, me, pid_alive) {
            let _ = node
                .cg
                .kill_and_remove(&join_cgroup(&base, &name), CLEANUP_WAIT);
        }
    }
}

/// Makes the cgroup the `slurmd -G` of process `me` runs in
/// ([`slurmd_g_cgroup`]), exempt in the fence when one is installed, and
/// checks that it can be joined.
fn make_cgroup(node: &Node, me: u32, cmd: &str) -> Result<String, NodeError> {
    let rel = slurmd_g_cgroup(node, me);
    let fence = match Fence::open(&node.cfg.bpffs_dir) {
        Ok(f) => Some(f),
        // No fence (yet): nothing to exempt; the cgroup is still its own.
        Err(gpufence_cgroup::Error::NotInstalled { .. }) => None,
        Err(e) => {
            return Err(NodeError::SlurmdG {
                cmd: cmd.to_string(),
                msg: format!(
                    "cannot open the fence to exempt its cgroup {}: {e}",
                    crate::host::cgpath::abs(&node.exec_cgroup())
                ),
            })
        }
    };
    crate::host::exec_cgroup::exec_leaf(node, fence.as_ref(), &slurmd_g_leaf(me)).map_err(|e| {
        match e {
            NodeError::Kernel(gpufence_cgroup::Error::Cgroup { .. }) => {
                cgroup_error(node, "make", &rel, e.to_string())
            }
            e => NodeError::SlurmdG {
                cmd: cmd.to_string(),
                msg: format!(
                    "cannot exempt its cgroup {} in the fence: {e}",
                    crate::host::cgpath::abs(&node.exec_cgroup())
                ),
            },
        }
    })?;
    // The child joins it by writing its cgroup.procs between fork and
    // exec; a cgroup that cannot be joined is an error of its own here,
    // not an exec failure.
    let procs = node.cg.path(&rel).join("cgroup.procs");
    if let Err(e) = std::fs::OpenOptions::new().write(true).open(&procs) {
        let _ = node.cg.remove_tree(&rel);
        return Err(cgroup_error(
            node,
            "join",
            &rel,
            format!("open {}: {e}", procs.display()),
        ));
    }
    Ok(rel)
}

/// Runs `slurmd -G` for `slurm_conf` in its own cgroup (see the module)
/// and returns its output (stdout, then stderr, where slurmd logs).
fn run_slurmd_g(node: &Node, slurm_conf: &Path) -> Result<String, NodeError> {
    run_contained(node, slurm_conf, SLURMD_G_TIMEOUT)
}

fn run_contained(node: &Node, slurm_conf: &Path, timeout: Duration) -> Result<String, NodeError> {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner);
    let cmdline = cmd_line(&node.cfg.slurmd_bin, slurm_conf);
    let me = std::process::id();
    remove_stale_leaves(node, me);
    let rel = make_cgroup(node, me, &cmdline)?;
    let mut cmd = slurmd_g_command(&node.cfg.slurmd_bin, slurm_conf, node.slurm_node.as_deref());
    cmd.env(INVOCATION_ID_ENV, fresh_invocation_id());
    if let Err(e) = node.cg.join_at_exec(&rel, &mut cmd) {
        let _ = node.cg.remove_tree(&rel);
        return Err(cgroup_error(node, "join", &rel, e.to_string()));
    }
    let start_note = format!(
        " (in its cgroup {}, which the child joins before exec: it ran nowhere else)",
        crate::host::cgpath::abs(&rel)
    );
    let out = spawn_and_collect(cmd, &cmdline, timeout, &start_note, &|| {
        let _ = node.cg.kill(&rel);
    });
    if let Err(e) = node.cg.kill_and_remove(&rel, CLEANUP_WAIT) {
        let _ = node.audit(
            AuditEvent::new(events::SLURMD_G_CGROUP_LEFT)
                .field("cgroup", crate::host::cgpath::abs(&rel))
                .field("error", e.to_string())
                .field(
                    "why",
                    "processes of slurmd -G outlived SIGKILL; the next slurmd -G removes it",
                ),
        );
    }
    out
}

/// Spawns `cmd` (stdout and stderr piped) and returns stdout then stderr,
/// or [`NodeError::SlurmdG`] naming `cmdline` when it cannot start (the
/// message ends with `start_note`), gives
/// no answer within `timeout` (it is killed) or exits non-zero (with the
/// last lines of stderr). `ended` runs once the child has exited or been
/// found late, before its output is read to the end: it kills what the
/// child left running, which may hold the pipes open.
fn spawn_and_collect(
    mut cmd: Command,
    cmdline: &str,
    timeout: Duration,
    start_note: &str,
    ended: &dyn Fn(),
) -> Result<String, NodeError> {
    let fail = |msg: String| NodeError::SlurmdG {
        cmd: cmdline.to_string(),
        msg,
    };
    let mut child = cmd
        .spawn()
        .map_err(|e| fail(format!("cannot start: {e}{start_note}")))?;
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
    let waited = crate::host::procs::wait_until(
        &mut child,
        Instant::now() + timeout,
        Duration::from_millis(5),
    );
    ended();
    let status = match waited {
        Ok(Some(s)) => s,
        Ok(None) => return Err(fail(format!("no answer within {}s", timeout.as_secs()))),
        Err(e) => return Err(fail(e.to_string())),
    };
    let held = Instant::now() + CLEANUP_WAIT;
    let (Some(stdout), Some(stderr)) = (collect(t_out, held), collect(t_err, held)) else {
        return Err(fail(format!(
            "{status}, but its output stayed open {}s after it ended (a process it started outlived SIGKILL)",
            CLEANUP_WAIT.as_secs()
        )));
    };
    if !status.success() {
        let tail: Vec<&str> = stderr.lines().rev().take(3).collect();
        return Err(fail(format!(
            "{status}: {}",
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        )));
    }
    Ok(format!("{stdout}{stderr}"))
}

/// What a pipe reader read, once it is done; `None` when it is not done by
/// `deadline` (it is left to finish on its own).
fn collect(h: JoinHandle<String>, deadline: Instant) -> Option<String> {
    while !h.is_finished() {
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Some(h.join().unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpufence_model::config::{Config, ConfigOrigin};
    use std::os::unix::fs::PermissionsExt;
    use std::path::PathBuf;

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

    /// `slurmd -G` run as [`run_slurmd_g`] runs it, but without a cgroup
    /// of its own: these tests of the output, the cache and the errors have
    /// no cgroup2 to write. The placement's tests are below.
    fn uncontained(node: &Node, conf: &Path) -> Result<String, NodeError> {
        let cmd = slurmd_g_command(&node.cfg.slurmd_bin, conf, node.slurm_node.as_deref());
        let line = cmd_line(&node.cfg.slurmd_bin, conf);
        spawn_and_collect(cmd, &line, SLURMD_G_TIMEOUT, "", &|| {})
    }

    fn load_here(node: &Node, conf: Option<&Path>) -> Result<GresMap, NodeError> {
        load_with(node, conf, uncontained)
    }

    fn refresh_here(node: &Node, conf: &Path) -> Result<GresMap, NodeError> {
        refresh_with(node, conf, uncontained)
    }

    /// A node whose state and audit log are in `dir`, and whose fence
    /// would be pinned there (so none is found: a test never exempts
    /// anything in a fence this machine may have).
    fn node(dir: &Path, slurmd: &Path) -> Node {
        let text = format!(
            "state_dir = \"{d}/state\"\naudit_log = \"{d}/a.jsonl\"\nslurmd_bin = \"{s}\"\nbpffs_dir = \"{d}/bpf\"\n",
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
    fn each_slurm_node_of_a_host_has_its_own_list_and_cache() {
        // Two slurmd on one host (MULTIPLE_SLURMD), one gpufence config:
        // `slurmd -G -N na` and `-N nb` list different GPUs, and neither
        // node's Prolog may map indices through the other's list.
        let d = tempfile::tempdir().unwrap();
        let s = fake_slurmd(
            d.path(),
            "case \"$3\" in\n\
             na) echo \"slurmd: Gres Name=gpu Type=(null) Count=1 Index=0 ID=1 File=/dev/nvidia0 (null)\" >&2 ;;\n\
             nb) echo \"slurmd: Gres Name=gpu Type=(null) Count=1 Index=1 ID=1 File=/dev/nvidia1 (null)\" >&2 ;;\n\
             *) exit 7 ;;\n\
             esac",
        );
        let n = node(d.path(), &s);
        let conf = d.path().join("slurm.conf");
        std::fs::write(&conf, "ClusterName=x\n").unwrap();
        let (na, nb) = (n.for_slurm_node(Some("na")), n.for_slurm_node(Some("nb")));
        refresh_here(&na, &conf).unwrap();
        refresh_here(&nb, &conf).unwrap();
        let files = |m: GresMap| m.devices[0].files.clone();
        assert_eq!(
            files(load_here(&na, Some(&conf)).unwrap()),
            vec![PathBuf::from("/dev/nvidia0")]
        );
        assert_eq!(
            files(load_here(&nb, Some(&conf)).unwrap()),
            vec![PathBuf::from("/dev/nvidia1")]
        );
        assert_eq!(runs(d.path()), 2, "both served from their own cache");
        assert!(n.state.gres_cache_path_for(Some("na")).exists());
        assert!(!n.state.gres_cache_path().exists());
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
        let m = load_here(&n, Some(&conf)).unwrap();
        assert_eq!(m.devices[1].files, vec![PathBuf::from("/dev/nvidia1")]);
        assert_eq!(runs(d.path()), 1);
        let m = load_here(&n, Some(&conf)).unwrap();
        assert_eq!(
            (m.devices.len(), runs(d.path())),
            (2, 1),
            "served from the cache"
        );
        assert!(m.source.ends_with("slurmd-G.txt"));
        std::fs::write(d.path().join("gres.conf"), "Name=gpu File=/dev/nvidia1\n").unwrap();
        let e = load_here(&n, Some(&conf)).unwrap_err();
        assert!(matches!(e, NodeError::GresChanged { .. }), "{e}");
        assert!(e.to_string().contains("restart slurmd"), "{e}");
        assert_eq!(
            runs(d.path()),
            1,
            "gres.conf changed since slurmd started: refused, not recomputed"
        );
        let other = d.path().join("other.conf");
        std::fs::write(&other, "").unwrap();
        load_here(&n, Some(&other)).unwrap();
        assert_eq!(runs(d.path()), 2, "another SLURM_CONF: slurmd -G for it");
        refresh_here(&n, &conf).unwrap();
        load_here(&n, Some(&conf)).unwrap();
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
            let m = refresh_here(&n, &conf).unwrap();
            assert_eq!(
                m.devices
                    .iter()
                    .map(|g| g.files.clone())
                    .collect::<Vec<_>>(),
                want,
                "{name}"
            );
            let m = load_here(&n, Some(&conf)).unwrap();
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
            let e = refresh_here(&n, &conf).unwrap_err();
            assert!(
                matches!(&e, NodeError::NoGpusListed { source_name, gres_conf, .. }
                    if source_name.ends_with("slurmd -G") && *gres_conf == gres),
                "{text:?}: {e}"
            );
            assert!(e.to_string().contains("lists no GPU"), "{e}");
            assert!(!n.state.gres_cache_path().exists(), "nothing cached");
            let e = load_here(&n, Some(&conf)).unwrap_err();
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
            assert!(
                refresh_here(&n, &conf).unwrap().devices.is_empty(),
                "{text:?}"
            );
        }
        std::fs::remove_file(&gres).unwrap();
        assert!(
            refresh_here(&n, &conf).unwrap().devices.is_empty(),
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
        let e = load_here(&n2, Some(&conf)).unwrap_err();
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
        std::fs::write(&conf, "").unwrap();
        let e = refresh_here(&n, &conf).unwrap_err();
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
        std::fs::write(d.path().join("slurm.conf"), "").unwrap();
        let e = load_here(&n, Some(&d.path().join("slurm.conf"))).unwrap_err();
        assert!(
            matches!(&e, NodeError::SlurmdG { msg, .. } if msg.contains("Unable to open gres.conf")),
            "{e}"
        );
        assert!(!n.state.gres_cache_path().exists(), "nothing cached");
    }

    /// An unreadable slurm.conf is said at once: `slurmd -G` (which would
    /// retry it for 60 s) is not run.
    #[test]
    fn an_unreadable_slurm_conf_is_said_without_running_slurmd() {
        let d = tempfile::tempdir().unwrap();
        let ran = d.path().join("ran");
        let s = fake_slurmd(d.path(), &format!("touch {}; exit 1", ran.display()));
        let n = node(d.path(), &s);
        let conf = d.path().join("missing/slurm.conf");
        let e = load_here(&n, Some(&conf)).unwrap_err();
        assert!(
            matches!(&e, NodeError::SlurmConf { path, .. } if *path == conf),
            "{e}"
        );
        assert!(e.to_string().contains("SLURM_CONF"), "{e}");
        assert!(!ran.exists(), "slurmd -G was not run");
    }

    #[test]
    fn the_cgroup_of_slurmd_g_is_named_by_the_pid() {
        assert_eq!(slurmd_g_leaf(4242), "slurmd-G-4242");
        assert_eq!(slurmd_g_leaf_pid("slurmd-G-4242"), Some(4242));
        assert_eq!(slurmd_g_leaf_pid(&slurmd_g_leaf(1)), Some(1));
        for name in [
            "slurmd-G-",
            "slurmd-G-0",
            "slurmd-G-042",
            "slurmd-G-+42",
            "slurmd-G--1",
            "slurmd-G-42x",
            "slurmd-G-42/slurmd",
            "slurmd-G-99999999999",
            "slurmd-g-42",
            "prolog-42",
            "epilog-42",
            "4242",
            "slurmd",
        ] {
            assert_eq!(slurmd_g_leaf_pid(name), None, "{name}");
        }
        let d = tempfile::tempdir().unwrap();
        let n = node(d.path(), Path::new("/usr/sbin/slurmd"));
        assert_eq!(slurmd_g_cgroup(&n, 7), "gpufence-exec/slurmd-G-7");
        let mut n = n;
        n.cfg.cgroup_root = "fenced".into();
        n.cfg.exec_cgroup = "admin".into();
        assert_eq!(slurmd_g_cgroup(&n, 7), "fenced/admin/slurmd-G-7");
    }

    /// A `slurmd-G-<pid>` whose pid is gone, or is this process's, was left
    /// by an earlier run; another live process's is a run in progress;
    /// nothing else is `slurmd -G`'s.
    #[test]
    fn which_cgroups_earlier_runs_left() {
        let alive = |p: u32| p == 10 || p == 11;
        assert!(is_stale_leaf("slurmd-G-12", 11, alive), "pid gone");
        assert!(is_stale_leaf("slurmd-G-11", 11, alive), "this process's");
        assert!(!is_stale_leaf("slurmd-G-10", 11, alive), "a live run");
        for name in ["prolog-12", "epilog-12", "12", "slurmd", "slurmd-G-012"] {
            assert!(!is_stale_leaf(name, 11, alive), "{name}");
        }
        assert!(pid_alive(std::process::id()));
        assert!(pid_alive(1));
        assert!(!pid_alive(u32::MAX), "above any pid_max");
    }

    #[test]
    fn invocation_ids_are_fresh_and_shaped_as_systemds() {
        let a = fresh_invocation_id();
        let b = fresh_invocation_id();
        for id in [&a, &b] {
            assert_eq!(id.len(), 32, "{id}");
            assert!(
                id.bytes()
                    .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)),
                "{id}"
            );
        }
        assert_ne!(a, b);
    }

    /// No cgroup of its own to run in: the refresh fails with the typed
    /// error naming the cgroup and the fix, `slurmd -G` does not run (in
    /// the caller's cgroup or anywhere), nothing is cached.
    #[test]
    fn without_a_cgroup_of_its_own_slurmd_g_does_not_run() {
        let d = tempfile::tempdir().unwrap();
        let s = fake_slurmd(
            d.path(),
            "echo \"slurmd: Gres Name=gpu Type=(null) Count=1 Index=0 ID=1 File=/dev/nvidia0 (null)\" >&2",
        );
        let conf = d.path().join("slurm.conf");
        std::fs::write(&conf, "ClusterName=x\n").unwrap();
        let mut n = node(d.path(), &s);
        let leaf = format!("/gpufence-exec/slurmd-G-{}", std::process::id());

        // The hierarchy cannot be written (here: its "mount" is a file).
        let file = d.path().join("not-a-hierarchy");
        std::fs::write(&file, "").unwrap();
        n.cg = gpufence_cgroup::Cgroup2::at(&file);
        let e = refresh(&n, &conf).unwrap_err();
        assert!(
            matches!(&e, NodeError::SlurmdGCgroup { op: "make", cgroup, mount, .. }
                if *cgroup == leaf && *mount == file),
            "{e}"
        );
        let msg = e.to_string();
        for want in [
            leaf.as_str(),
            "resets the cpuset and memory limits",
            "as root with the cgroup2 hierarchy at",
            "set slurmd_gres in /etc/slurm/gpufence.toml",
        ] {
            assert!(msg.contains(want), "{want:?} not in {msg}");
        }

        // Made, but it cannot be joined (a directory that is no cgroup).
        let fake = d.path().join("fake");
        std::fs::create_dir(&fake).unwrap();
        n.cg = gpufence_cgroup::Cgroup2::at(&fake);
        let e = load(&n, Some(&conf)).unwrap_err();
        assert!(
            matches!(&e, NodeError::SlurmdGCgroup { op: "join", cgroup, msg, .. }
                if *cgroup == leaf && msg.contains("cgroup.procs")),
            "{e}"
        );
        assert!(
            !fake.join(leaf.trim_start_matches('/')).exists(),
            "the cgroup it made is removed again"
        );
        assert!(fake.join("gpufence-exec").is_dir(), "the exec cgroup stays");

        assert_eq!(runs(d.path()), 0, "slurmd -G never ran");
        assert!(!n.state.gres_cache_path().exists(), "nothing cached");
    }

    /// Removes a cgroup tree of a test, what is in it killed, when dropped.
    struct Removed(Node, String);

    impl Drop for Removed {
        fn drop(&mut self) {
            let _ = self.0.cg.kill_and_remove(&self.1, CLEANUP_WAIT);
        }
    }

    /// The placement itself, on this machine's cgroup2: needs root and a
    /// writable hierarchy (`cargo test -p gpufence-node --lib -- --ignored
    /// own_cgroup`). Everything is made below `gpufence-unit-<pid>` and
    /// removed; no fence is involved (its pins would be in the temporary
    /// directory).
    #[test]
    #[ignore = "needs root and a writable cgroup2 hierarchy"]
    fn slurmd_g_runs_in_an_own_cgroup_that_is_removed_after() {
        let d = tempfile::tempdir().unwrap();
        let dp = d.path().display().to_string();
        let me = std::process::id();
        let mount = gpufence_cgroup::Cgroup2::discover().unwrap();
        let m = mount.mount().display().to_string();
        // As 25.11.3+ with INVOCATION_ID: makes <its cgroup>/slurmd and
        // moves there; forks a process that holds its output open.
        let s = fake_slurmd(
            d.path(),
            &format!(
                "grep ^0:: /proc/self/cgroup > {dp}/cgroup\n\
                 echo \"$INVOCATION_ID\" >> {dp}/invocation\n\
                 sleep 1000 &\n\
                 echo $! > {dp}/forked\n\
                 cg=$(sed -n 's/^0:://p' /proc/self/cgroup)\n\
                 mkdir {m}$cg/slurmd && echo $$ > {m}$cg/slurmd/cgroup.procs\n\
                 grep ^0:: /proc/self/cgroup > {dp}/cgroup-after\n\
                 echo \"slurmd: Gres Name=gpu Type=(null) Count=1 Index=0 ID=1 File=/dev/nvidia0 (null)\" >&2"
            ),
        );
        let mut n = node(d.path(), &s);
        n.cfg.cgroup_root = format!("gpufence-unit-{me}");
        let _gone = Removed(n.clone(), n.cfg.cgroup_root.clone());
        let base = n.exec_cgroup();
        // Left by earlier runs: a dead pid's (with Slurm's slurmd below),
        // this process's; a live process's run in progress.
        let dead = join_cgroup(&base, &slurmd_g_leaf(u32::MAX - 1));
        n.cg.create(&join_cgroup(&dead, "slurmd")).unwrap();
        let live = join_cgroup(&base, &slurmd_g_leaf(1));
        n.cg.create(&live).unwrap();
        let own = slurmd_g_cgroup(&n, me);
        n.cg.create(&join_cgroup(&own, "slurmd")).unwrap();
        let conf = d.path().join("slurm.conf");
        std::fs::write(&conf, "ClusterName=x\n").unwrap();

        for round in 0..2 {
            let map = refresh(&n, &conf).unwrap();
            assert_eq!(map.devices.len(), 1);
            let read = |f: &str| std::fs::read_to_string(d.path().join(f)).unwrap();
            assert_eq!(
                read("cgroup").trim(),
                format!("0::/{own}"),
                "it started there"
            );
            assert_eq!(read("cgroup-after").trim(), format!("0::/{own}/slurmd"));
            let ids: Vec<String> = read("invocation").lines().map(str::to_string).collect();
            assert_eq!(ids.len(), round + 1);
            assert!(ids.iter().all(|i| i.len() == 32), "{ids:?}");
            if round == 1 {
                assert_ne!(ids[0], ids[1], "fresh per run");
            }
            let forked: u32 = read("forked").trim().parse().unwrap();
            let stat = std::fs::read_to_string(format!("/proc/{forked}/stat")).unwrap_or_default();
            assert!(
                stat.is_empty() || stat.contains(") Z "),
                "what it forked is killed: {stat}"
            );
            assert!(!n.cg.path(&own).exists(), "its cgroup is removed");
            assert!(!n.cg.path(&dead).exists(), "a dead run's is removed");
            assert!(n.cg.path(&live).exists(), "a live run's stays");
        }

        // No answer in time: killed with everything it started, removed.
        let s = fake_slurmd(d.path(), "sleep 1000 & sleep 1000");
        n.cfg.slurmd_bin = s;
        let t = Instant::now();
        let e = run_contained(&n, &conf, Duration::from_secs(1)).unwrap_err();
        assert!(e.to_string().contains("no answer within 1s"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        assert!(!n.cg.path(&own).exists(), "removed after the timeout");
    }
}
