//! slurmd start, in the plugin's slurmd context: slurmd's settings checked
//! against the layout, the fence installed or refreshed, the IMEX scope
//! granted, slurmd's own exemption checked, and the `slurmd -G` cache
//! warmed.

use gpufence_model::config::Mode;

use crate::host::slurmconf::{check_node_layout, slurm_conf_path, SlurmConf};
use crate::host::{fence_ops, gresmap};
use crate::job::imex;
use crate::{Node, NodeError};

use super::{Level, Log};

/// What the plugin does at slurmd start (`slurm_spank_init`, slurmd
/// context, root), with gpufence.toml at `config` (else the default
/// lookup, [`Node::load`]) and `mode` overriding its `mode`: reads this
/// process's (slurmd's) `-N` ([`slurmd_node_arg`]); refuses when Slurm's
/// settings cannot work with the layout ([`check_node_layout`] on
/// [`slurm_conf_path`]); installs or refreshes the fence
/// ([`fence_ops::install`]); then, each failure one `Error` line in `log`
/// and never a failed start: exempt entries naming unknown users, IMEX
/// channels under `SwitchType=switch/nvidia_imex` ([`imex::grant_scope_mknod`]),
/// whether slurmd's own cgroup is exempt
/// ([`fence_ops::slurmd_exemption_note`]), and the `slurmd -G` cache
/// ([`gresmap::refresh`], unless `slurmd_gres` is set or this is the
/// `slurmd -G` child itself).
///
/// # Errors
/// [`NodeError`] from loading the config, the layout check or the install:
/// the plugin fails slurmd's start with it (fail closed, one line).
pub fn slurmd_start(
    config: Option<&std::path::Path>,
    mode: Option<Mode>,
    log: Log,
) -> Result<(), NodeError> {
    let mut node = Node::load(config)?;
    if let Some(m) = mode {
        node.cfg.mode = m;
    }
    node.slurm_node = slurmd_node_arg(&own_command_line());
    let conf = slurm_conf_path();
    // layout = "slurm" without proctrack/cgroup (or with cgroup/v1) would
    // refuse every step: refuse slurmd instead, with the one line that says
    // what to set.
    check_node_layout(&node, &conf)?;
    let r = fence_ops::install(&node)?;
    log(
        Level::Info,
        &format!(
            "fence {} at /{} (program {}), protected majors {:?}",
            if r.replaced_program {
                "refreshed"
            } else {
                "installed"
            },
            node.cfg.cgroup_root,
            r.prog_id,
            r.majors
        ),
    );
    for p in &r.exempt_missing {
        log(
            Level::Info,
            &format!("exempt cgroup /{p} does not exist: not exempt"),
        );
    }
    for (c, n) in fence_ops::unknown_exempt_users(&node) {
        log(Level::Error, &fence_ops::unknown_exempt_user_line(&c, &n));
    }
    // Slurm's IMEX channels: slurmstepd (and, with a namespace plugin, the
    // extern step before its slurm_spank_init) makes channel nodes in the
    // jobs' cgroups under Slurm's scope (crate::job::imex).
    let slurm = SlurmConf::load(&conf).ok();
    if let Some(s) = slurm.as_ref().and_then(SlurmConf::imex_switch) {
        match slurm.as_ref().and_then(|c| imex::switch_major(&node, c)) {
            Some(major) => {
                if let Err(e) = imex::grant_scope_mknod(&node, major) {
                    log(Level::Error, &format!("IMEX channels: Slurm's scope cannot be granted mknod: {e}"));
                }
            }
            None => log(Level::Error, &format!(
                "SwitchType=switch/nvidia_imex, but the IMEX major ({}) is not one the fence protects: jobs get no channel; name it in [majors] as nvidia-caps-imex-channels",
                s.dev_major
                    .map(|m| m.to_string())
                    .unwrap_or_else(|| "no nvidia-caps-imex-channels in /proc/devices".into())
            )),
        }
    }
    // Where slurmd actually runs (this process), against the exemptions.
    if let Ok(own) = node.cg.cgroup_of(std::process::id() as i32) {
        if let Some(line) = fence_ops::slurmd_exemption_note(&node, &own) {
            log(Level::Error, &line);
        }
    }
    // Warm the slurmd -G cache; the prolog recomputes it if this fails.
    // An empty list is only "0 GPUs" when gres.conf gives this node none:
    // otherwise refresh fails (NoGpusListed, or a line naming Name=gpu in
    // an unknown shape) and the error is what the log says.
    if node.cfg.slurmd_gres.is_none() && std::env::var_os(gresmap::IN_SLURMD_G_ENV).is_none() {
        match gresmap::refresh(&node, &conf) {
            Ok(m) if m.devices.is_empty() => log(
                Level::Info,
                "slurmd -G lists no GPU and gres.conf gives this node none: no GPU, cached",
            ),
            Ok(m) => log(
                Level::Info,
                &format!("{} GPU(s) in slurmd -G, cached", m.devices.len()),
            ),
            Err(e) => log(
                Level::Error,
                &format!(
                    "GRES cache not warmed (the Prolog of each GPU job runs slurmd -G again): {e}"
                ),
            ),
        }
    }
    Ok(())
}

/// This process's command line, `argv[0]` first: `/proc/self/cmdline`
/// split at its NULs (`proc(5)`), each word read lossily as UTF-8, the
/// empty word after the last NUL kept (an operand to [`slurmd_node_arg`]);
/// empty when it cannot be read.
fn own_command_line() -> Vec<String> {
    split_command_line(&std::fs::read("/proc/self/cmdline").unwrap_or_default())
}

/// [`own_command_line`]'s split of `/proc/<pid>/cmdline` bytes.
fn split_command_line(raw: &[u8]) -> Vec<String> {
    raw.split(|b| *b == 0)
        .map(|w| String::from_utf8_lossy(w).into_owned())
        .collect()
}

/// slurmd's short options (`opt_string` in `_process_cmdline`,
/// `src/slurmd/slurmd/slurmd.c`, the same from 22.05 to master): a letter
/// followed by `:` takes an argument, by `::` an optional one (only when
/// attached).
const SLURMD_OPTS: &str = "bcCd:Df:F::GhL:Mn:N:svVZ";

/// slurmd's long options that take an argument (`long_options`, same file;
/// 22.05 has the first two, master all).
const SLURMD_LONG_WITH_ARG: [&str; 8] = [
    "conf",
    "conf-server",
    "authinfo",
    "ca-cert-file",
    "extra",
    "instance-id",
    "instance-type",
    "parameters",
];

/// The node name slurmd was started with: the argument of `-N`, read from
/// its command line (`args`, `argv[0]` first) as getopt does: short options
/// may be clustered (`-DN name`, `-DNname`), the arguments of other options
/// (`-L FILE`, `--conf-server HOST`) are skipped, `--` ends the options, and
/// the last `-N` wins. `None` when there is none (slurmd then finds its node
/// by hostname).
pub fn slurmd_node_arg(args: &[String]) -> Option<String> {
    let takes_arg = |c: char| -> Option<bool> {
        // Some(true): required argument; Some(false): none or optional.
        let i = SLURMD_OPTS.find(c)?;
        let rest = &SLURMD_OPTS[i + 1..];
        Some(rest.starts_with(':') && !rest.starts_with("::"))
    };
    let mut node = None;
    let mut it = args.iter().skip(1);
    while let Some(a) = it.next() {
        if a == "--" {
            break;
        }
        if let Some(long) = a.strip_prefix("--") {
            if !long.contains('=') && SLURMD_LONG_WITH_ARG.contains(&long) {
                it.next();
            }
            continue;
        }
        let Some(cluster) = a.strip_prefix('-').filter(|c| !c.is_empty()) else {
            continue; // an operand: getopt permutes past it
        };
        for (pos, c) in cluster.char_indices() {
            match takes_arg(c) {
                Some(true) => {
                    let attached = &cluster[pos + c.len_utf8()..];
                    let value = if attached.is_empty() {
                        it.next().cloned()
                    } else {
                        Some(attached.to_string())
                    };
                    if c == 'N' {
                        node = value.filter(|v| !v.is_empty());
                    }
                    break;
                }
                Some(false) if c == 'F' => break, // F:: takes the rest, if any
                _ => {}
            }
        }
    }
    node
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn node_name_from_slurmd_command_line() {
        assert_eq!(
            slurmd_node_arg(&args(&["slurmd", "-D", "-f", "/x.conf", "-N", "gfn2"])),
            Some("gfn2".into())
        );
        assert_eq!(
            slurmd_node_arg(&args(&["slurmd", "-Ngfn1"])),
            Some("gfn1".into())
        );
        assert_eq!(
            slurmd_node_arg(&args(&["slurmd", "-DN", "na"])),
            Some("na".into())
        );
        assert_eq!(
            slurmd_node_arg(&args(&["slurmd", "-DNna"])),
            Some("na".into())
        );
        // -L takes an argument: "-Nx.log" is the log file, not a node.
        assert_eq!(
            slurmd_node_arg(&args(&["slurmd", "-L", "-Nx.log", "-N", "na"])),
            Some("na".into())
        );
        assert_eq!(
            slurmd_node_arg(&args(&["slurmd", "--conf-server", "-N", "-N", "nb"])),
            Some("nb".into())
        );
        assert_eq!(slurmd_node_arg(&args(&["slurmd", "-D"])), None);
        assert_eq!(slurmd_node_arg(&args(&["slurmd", "-N"])), None);
        assert_eq!(slurmd_node_arg(&args(&["slurmd", "--", "-N", "x"])), None);
        assert_eq!(slurmd_node_arg(&args(&["-N", "argv0-is-skipped"])), None);
        assert_eq!(
            slurmd_node_arg(&args(&["slurmd", "-Fx", "-N", "n"])),
            Some("n".into())
        );
    }

    #[test]
    fn command_line_split_at_nuls() {
        assert_eq!(
            split_command_line(b"slurmd\0-D\0-N\0gfn1\0"),
            ["slurmd", "-D", "-N", "gfn1", ""]
        );
        assert_eq!(
            slurmd_node_arg(&split_command_line(b"slurmd\0-N\0gfn1\0")),
            Some("gfn1".into())
        );
        assert_eq!(split_command_line(b""), [""]);
        assert!(!own_command_line()[0].is_empty(), "argv[0] of this test");
    }
}
