//! The few keys of slurm.conf and cgroup.conf gpufence checks its layout
//! against, and that check ([`check_layout`]); and `PrologFlags`, whose
//! `RunInJob` tells the plugin that the extern step starts before the
//! Prolog ([`SlurmConf::run_in_job`]).
//!
//! `layout = "slurm"` finds the job cgroup from slurmstepd's own cgroup
//! when the plugin's `slurm_spank_init` runs. Slurm puts slurmstepd there
//! only with `ProctrackType=proctrack/cgroup`: slurmstepd calls
//! `proctrack_g_create` (which makes the step cgroup through the cgroup
//! plugin, `src/plugins/proctrack/cgroup/proctrack_cgroup.c`) before
//! `spank_init`, and `task_g_pre_setuid` (task/cgroup's cgroups) after it
//! (`job_manager`, `src/slurmd/slurmstepd/mgr.c`, 22.05-26.05). And only the
//! cgroup/v2 plugin makes cgroup2 job cgroups. Without them every step is
//! refused; slurmd start ([`check_node_layout`]) says so once, instead.
//!
//! The reader is tolerant, not Slurm's parser (`src/common/parse_config.c`):
//! one or more `Key=Value` pairs per line, `Key = Value` too; keys match
//! ignoring ASCII case (`xstrcasecmp`); a value is one word or `"quoted"`;
//! `#` starts a comment unless an odd number of `\` precede it
//! (`_strip_comments`); the last of several values counts, as in Slurm
//! ("specified more than once, latest value used"). `Include` lines are
//! not followed: a key set only in an included file reads as unset here,
//! which for `ProctrackType` means Slurm's default ([`DEFAULT_PROCTRACK_TYPE`]),
//! so an include can hide a wrong value from this check but never make it
//! refuse a right one.

use std::path::{Path, PathBuf};

use gpufence_model::config::{ConfigOrigin, Layout, DEFAULT_CONFIG_PATH};

use crate::{Node, NodeError};

/// slurm.conf where `SLURM_CONF` names none: Slurm's default
/// (`default_slurm_config_file`, `src/common/read_config.c`, set from
/// `SLURM_CONFIG_DEFAULT` at build time; `/etc/slurm/slurm.conf` in
/// Debian's packages and Slurm's own `--sysconfdir=/etc/slurm` builds).
pub const DEFAULT_SLURM_CONF: &str = "/etc/slurm/slurm.conf";

/// slurm.conf's path: `given` (a caller's `SLURM_CONF`: the Prolog's
/// environment), else [`DEFAULT_SLURM_CONF`].
pub fn slurm_conf_or_default(given: Option<&Path>) -> PathBuf {
    given
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_SLURM_CONF))
}

/// This process's slurm.conf: `$SLURM_CONF` when set and not empty
/// (slurmd sets it for its plugins, with `-f` and configless too, and
/// slurmstepd and the hooks inherit it), else [`DEFAULT_SLURM_CONF`]
/// ([`slurm_conf_or_default`]).
pub fn slurm_conf_path() -> PathBuf {
    let env = std::env::var_os("SLURM_CONF").filter(|v| !v.is_empty());
    slurm_conf_or_default(env.as_deref().map(Path::new))
}

/// Slurm's `ProctrackType` when slurm.conf sets none: `DEFAULT_PROCTRACK_TYPE`
/// in `src/common/read_config.h` (22.05-26.05) is `proctrack/cgroup` when
/// Slurm is built `WITH_CGROUP` (every Linux build; `proctrack/pgid`
/// otherwise), applied in `src/common/read_config.c` when the key is absent.
pub const DEFAULT_PROCTRACK_TYPE: &str = "proctrack/cgroup";

/// The `ProctrackType` that puts slurmstepd in the job cgroup before SPANK.
pub const PROCTRACK_CGROUP: &str = "proctrack/cgroup";

/// The `PrologFlags` flag that runs the Prolog and Epilog inside the job
/// (24.05+).
pub const PROLOG_FLAG_RUN_IN_JOB: &str = "RunInJob";

/// The `CgroupPlugin` value of cgroup v1 (cgroup.conf; the others are
/// `autodetect`, the default, `cgroup/v2` and `disabled`,
/// `src/interfaces/cgroup.c` 24.11+, `src/common/cgroup.c` 22.05).
pub const CGROUP_V1: &str = "cgroup/v1";

/// The last value of `key` (ASCII case ignored) in a slurm.conf-style
/// `text`, surrounding quotes removed; `None` when it is not set. See the
/// module for what is read and what is not.
pub fn conf_value(text: &str, key: &str) -> Option<String> {
    let mut found = None;
    for raw in text.lines() {
        let line = strip_comment(raw);
        let mut rest = line.trim_start();
        while !rest.is_empty() {
            let Some((k, v, tail)) = next_pair(rest) else {
                // Not a pair here (an `Include` line, a stray word): skip a word.
                rest = rest
                    .split_once(char::is_whitespace)
                    .map_or("", |(_, t)| t)
                    .trim_start();
                continue;
            };
            if k.eq_ignore_ascii_case(key) {
                found = Some(v.to_string());
            }
            rest = tail.trim_start();
        }
    }
    found
}

/// The line before an unescaped `#`.
fn strip_comment(line: &str) -> &str {
    let mut backslashes = 0usize;
    for (i, c) in line.char_indices() {
        match c {
            '#' if backslashes.is_multiple_of(2) => return &line[..i],
            '\\' => backslashes += 1,
            _ => backslashes = 0,
        }
    }
    line
}

/// `key [op]= value` at the start of `s` (after leading blanks): the key
/// (letters, digits, `_`, `.`), the value (quoted, or up to a blank) and
/// the rest.
fn next_pair(s: &str) -> Option<(&str, &str, &str)> {
    let key_end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.'))
        .unwrap_or(s.len());
    if key_end == 0 {
        return None;
    }
    let key = &s[..key_end];
    let after = s[key_end..].trim_start();
    let after = after
        .strip_prefix(['-', '*', '+', '/'])
        .unwrap_or(after)
        .strip_prefix('=')?
        .trim_start();
    if let Some(q) = after.strip_prefix('"') {
        let end = q.find('"')?;
        return Some((key, &q[..end], &q[end + 1..]));
    }
    let end = after.find(char::is_whitespace).unwrap_or(after.len());
    (end > 0).then(|| (key, &after[..end], &after[end..]))
}

/// The slurm.conf keys gpufence reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlurmConf {
    /// `ProctrackType`, as written; `None` when unset.
    pub proctrack_type: Option<String>,
    /// `TaskPlugin` (a comma list), as written; `None` when unset.
    pub task_plugin: Option<String>,
    /// `PrologFlags` (a comma list), as written; `None` when unset.
    pub prolog_flags: Option<String>,
    /// `SwitchType`, as written; `None` when unset.
    pub switch_type: Option<String>,
    /// `SwitchParameters` (a comma list), as written; `None` when unset.
    pub switch_parameters: Option<String>,
    /// `AccountingStoreFlags` (a comma list: `job_comment`, `job_env`,
    /// `job_extra`, `job_script`; slurm.conf(5)), as written; `None` when
    /// unset.
    pub accounting_store_flags: Option<String>,
    /// `StateSaveLocation`, as written; `None` when unset (Slurm's default
    /// is `/var/spool/slurmctld`, slurm.conf(5)).
    pub state_save_location: Option<String>,
}

/// The `SwitchType` of Slurm's IMEX channel plugin (24.05+,
/// `src/plugins/switch/nvidia_imex/`).
pub const SWITCH_NVIDIA_IMEX: &str = "switch/nvidia_imex";

/// What slurm.conf says of Slurm's IMEX channels ([`SlurmConf::imex_switch`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImexSwitch {
    /// `SwitchParameters=imex_dev_major=N`: the channels' major; `None`:
    /// the one `/proc/devices` names `nvidia-caps-imex-channels`
    /// (`imex_device.c`).
    pub dev_major: Option<u32>,
}

impl SlurmConf {
    /// Reads the keys from slurm.conf `text` ([`conf_value`]).
    pub fn parse(text: &str) -> Self {
        SlurmConf {
            proctrack_type: conf_value(text, "ProctrackType"),
            task_plugin: conf_value(text, "TaskPlugin"),
            prolog_flags: conf_value(text, "PrologFlags"),
            switch_type: conf_value(text, "SwitchType"),
            switch_parameters: conf_value(text, "SwitchParameters"),
            accounting_store_flags: conf_value(text, "AccountingStoreFlags"),
            state_save_location: conf_value(text, "StateSaveLocation"),
        }
    }

    /// Slurm's IMEX channels, when `SwitchType` is `switch/nvidia_imex`:
    /// with `imex_dev_major` from `SwitchParameters` (a comma list of
    /// `key=value`, `switch_nvidia_imex.c` `_setup_params`), when set to a
    /// number.
    pub fn imex_switch(&self) -> Option<ImexSwitch> {
        let t = self.switch_type.as_deref()?.trim();
        if !t.eq_ignore_ascii_case(SWITCH_NVIDIA_IMEX) {
            return None;
        }
        let dev_major = self.switch_parameters.as_deref().and_then(|p| {
            p.split(',').find_map(|kv| {
                let (k, v) = kv.split_once('=')?;
                k.trim()
                    .eq_ignore_ascii_case("imex_dev_major")
                    .then(|| v.trim().parse().ok())
                    .flatten()
            })
        });
        Some(ImexSwitch { dev_major })
    }

    /// Reads slurm.conf at `path` ([`SlurmConf::parse`]).
    ///
    /// # Errors
    /// [`NodeError::Io`] when it cannot be read.
    pub fn load(path: &Path) -> Result<Self, NodeError> {
        std::fs::read_to_string(path)
            .map(|t| SlurmConf::parse(&t))
            .map_err(|e| NodeError::io("read", path, e))
    }

    /// Whether `PrologFlags` lists `RunInJob` (Slurm 24.05+): the Prolog and
    /// the Epilog then run from the job's extern slurmstepd, inside the job
    /// cgroup, and the extern step's `slurm_spank_init` runs before the
    /// Prolog ([`crate::job::injob`]). Slurm splits the list at `,` and compares
    /// each flag ignoring ASCII case (`prolog_str2flags`,
    /// `src/common/read_config.c`, 24.05-26.05); blanks around a flag are
    /// tolerated here.
    pub fn run_in_job(&self) -> bool {
        self.prolog_flags.as_deref().is_some_and(|f| {
            f.split(',')
                .any(|flag| flag.trim().eq_ignore_ascii_case(PROLOG_FLAG_RUN_IN_JOB))
        })
    }

    /// The `ProctrackType` Slurm uses: the one set, else
    /// [`DEFAULT_PROCTRACK_TYPE`].
    pub fn proctrack(&self) -> &str {
        self.proctrack_type
            .as_deref()
            .unwrap_or(DEFAULT_PROCTRACK_TYPE)
    }

    /// Whether `AccountingStoreFlags` lists `flag` (`job_script`,
    /// `job_env`), ignoring ASCII case: slurmdbd then keeps each batch
    /// job's script or environment (slurm.conf(5), `AccountingStoreFlags`).
    pub fn accounting_stores(&self, flag: &str) -> bool {
        self.accounting_store_flags
            .as_deref()
            .is_some_and(|f| f.split(',').any(|x| x.trim().eq_ignore_ascii_case(flag)))
    }

    /// Whether `TaskPlugin` lists `task/cgroup`.
    pub fn task_cgroup(&self) -> bool {
        self.task_plugin
            .as_deref()
            .is_some_and(|t| t.split(',').any(|p| p.trim() == "task/cgroup"))
    }
}

/// The cgroup.conf key gpufence reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CgroupConf {
    /// `CgroupPlugin`, as written; `None` when unset (Slurm: `autodetect`).
    pub cgroup_plugin: Option<String>,
}

impl CgroupConf {
    /// Reads the key from cgroup.conf `text` ([`conf_value`]).
    pub fn parse(text: &str) -> Self {
        CgroupConf {
            cgroup_plugin: conf_value(text, "CgroupPlugin"),
        }
    }
}

/// Whether `layout` can work with these Slurm settings. Only `slurm` needs
/// anything: `ProctrackType=proctrack/cgroup` (set, or unset: Slurm's
/// default) and no `CgroupPlugin=cgroup/v1`. `slurm_conf` and
/// `cgroup_conf` name the files for the message; `cgroup` is `None` when
/// there is no cgroup.conf; `gpufence_toml` is where the layout was set.
///
/// # Errors
/// [`NodeError::SlurmLayout`], one line: what is set where, what to set,
/// or `layout = "own"` for cgroup v1/hybrid hosts.
pub fn check_layout(
    layout: Layout,
    slurm: &SlurmConf,
    slurm_conf: &Path,
    cgroup: Option<&CgroupConf>,
    cgroup_conf: &Path,
    gpufence_toml: &str,
) -> Result<(), NodeError> {
    if layout != Layout::Slurm {
        return Ok(());
    }
    let proctrack = slurm.proctrack();
    if proctrack != PROCTRACK_CGROUP {
        let why = if slurm.task_cgroup() {
            "with it, task/cgroup makes the job cgroup only after slurm_spank_init"
        } else {
            "with it, Slurm makes no job cgroup for slurmstepd"
        };
        return Err(NodeError::SlurmLayout {
            file: slurm_conf.to_path_buf(),
            setting: format!("ProctrackType={proctrack}"),
            why: why.into(),
            fix: format!("ProctrackType={PROCTRACK_CGROUP}"),
            gpufence_toml: gpufence_toml.into(),
        });
    }
    if let Some(v) = cgroup.and_then(|c| c.cgroup_plugin.as_deref()) {
        if v == CGROUP_V1 {
            return Err(NodeError::SlurmLayout {
                file: cgroup_conf.to_path_buf(),
                setting: format!("CgroupPlugin={v}"),
                why: "cgroup v1 job cgroups are not in cgroup2, where the fence is".into(),
                fix: "CgroupPlugin=cgroup/v2".into(),
                gpufence_toml: gpufence_toml.into(),
            });
        }
    }
    Ok(())
}

/// [`check_layout`] for this node: its layout, slurm.conf at `slurm_conf`
/// (`$SLURM_CONF`, which slurmd sets for its plugins, else
/// [`DEFAULT_SLURM_CONF`]) and the cgroup.conf next to it
/// (where Slurm reads it). What slurmd start runs.
///
/// # Errors
/// [`NodeError::SlurmLayout`]; [`NodeError::Io`] when the layout is `slurm`
/// and slurm.conf cannot be read (slurmd has just read it: fail closed).
/// A missing cgroup.conf is Slurm's defaults, not an error.
pub fn check_node_layout(node: &Node, slurm_conf: &Path) -> Result<(), NodeError> {
    let toml = || match &node.origin {
        ConfigOrigin::File(p) => p.display().to_string(),
        ConfigOrigin::Defaults => DEFAULT_CONFIG_PATH.to_string(),
    };
    if node.cfg.layout != Layout::Slurm {
        // The own layout reads nothing of Slurm's, save this one refusal
        // (an unreadable slurm.conf is left to slurmd, as before).
        if let Ok(slurm) = SlurmConf::load(slurm_conf) {
            if slurm.run_in_job() {
                return Err(NodeError::OwnLayoutRunInJob {
                    file: slurm_conf.to_path_buf(),
                    flags: slurm.prolog_flags.clone().unwrap_or_default(),
                    gpufence_toml: toml(),
                });
            }
        }
        return Ok(());
    }
    let slurm = SlurmConf::load(slurm_conf)?;
    let cgroup_conf: PathBuf = slurm_conf.with_file_name("cgroup.conf");
    let cgroup = match std::fs::read_to_string(&cgroup_conf) {
        Ok(t) => Some(CgroupConf::parse(&t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(NodeError::io("read", &cgroup_conf, e)),
    };
    check_layout(
        node.cfg.layout,
        &slurm,
        slurm_conf,
        cgroup.as_ref(),
        &cgroup_conf,
        &toml(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_imex_switch_and_its_major() {
        let c = SlurmConf::parse("SwitchType=switch/nvidia_imex\nSwitchParameters=imex_channel_count=16,imex_dev_major=120\n");
        assert_eq!(
            c.imex_switch(),
            Some(ImexSwitch {
                dev_major: Some(120)
            })
        );
        let c = SlurmConf::parse("SwitchType=Switch/NVIDIA_IMEX\n");
        assert_eq!(c.imex_switch(), Some(ImexSwitch { dev_major: None }));
        let c =
            SlurmConf::parse("SwitchType=switch/nvidia_imex\nSwitchParameters=imex_dev_major=x\n");
        assert_eq!(c.imex_switch(), Some(ImexSwitch { dev_major: None }));
        assert_eq!(
            SlurmConf::parse("SwitchType=switch/none\n").imex_switch(),
            None
        );
        assert_eq!(
            SlurmConf::parse("SwitchParameters=imex_dev_major=120\n").imex_switch(),
            None
        );
    }

    #[test]
    fn reads_keys_as_slurm_does() {
        let text = "\
# ProctrackType=proctrack/pgid
ClusterName=c1
proctracktype = proctrack/linuxproc   # the old one
PROCTRACKTYPE=proctrack/cgroup
TaskPlugin=task/affinity,task/cgroup SwitchType=switch/none
Include /etc/slurm/extra.conf
NodeName=n[1-4] CPUs=4 Gres=gpu:2 State=UNKNOWN
";
        let c = SlurmConf::parse(text);
        assert_eq!(
            c.proctrack_type.as_deref(),
            Some("proctrack/cgroup"),
            "the last one"
        );
        assert_eq!(c.task_plugin.as_deref(), Some("task/affinity,task/cgroup"));
        assert!(c.task_cgroup());
        assert_eq!(
            conf_value(text, "switchtype").as_deref(),
            Some("switch/none")
        );
        assert_eq!(conf_value(text, "Include"), None);
        assert_eq!(conf_value(text, "CPUs").as_deref(), Some("4"));
        assert_eq!(
            conf_value("ProctrackType=\"proctrack/pgid\"", "ProctrackType").as_deref(),
            Some("proctrack/pgid")
        );
        assert_eq!(
            conf_value("X=a\\#b # c", "X").as_deref(),
            Some("a\\#b"),
            "an escaped # is no comment"
        );
        assert_eq!(
            conf_value("  #ProctrackType=proctrack/pgid", "ProctrackType"),
            None
        );
        assert_eq!(conf_value("ProctrackType=", "ProctrackType"), None);
        assert_eq!(conf_value("ProctrackTypeX=a", "ProctrackType"), None);
        let none = SlurmConf::parse("ClusterName=c1\n");
        assert_eq!(none.proctrack_type, None);
        assert_eq!(none.proctrack(), "proctrack/cgroup", "Slurm's default");
        assert!(!none.task_cgroup());
        assert_eq!(
            CgroupConf::parse("cgroupplugin=cgroup/v1\nIgnoreSystemd=yes\n")
                .cgroup_plugin
                .as_deref(),
            Some("cgroup/v1")
        );
    }

    #[test]
    fn prolog_flags_run_in_job() {
        for (text, want) in [
            ("PrologFlags=Alloc,Contain,RunInJob\n", true),
            ("prologflags=runinjob\n", true),
            ("PrologFlags=RUNINJOB,X11\n", true),
            ("PrologFlags=\"Alloc, RunInJob\"\n", true),
            (
                "PrologFlags=Contain\nPrologFlags=Alloc,RunInJob # last wins\n",
                true,
            ),
            ("PrologFlags=Alloc,RunInJob\nPrologFlags=Contain\n", false),
            ("PrologFlags=Alloc,Contain\n", false),
            ("PrologFlags=RunInJobs\n", false),
            ("#PrologFlags=RunInJob\n", false),
            ("ClusterName=c1\n", false),
            ("", false),
        ] {
            let c = SlurmConf::parse(text);
            assert_eq!(c.run_in_job(), want, "{text:?}");
        }
        assert_eq!(
            SlurmConf::parse("PrologFlags=Alloc,Contain,RunInJob\n")
                .prolog_flags
                .as_deref(),
            Some("Alloc,Contain,RunInJob")
        );
        assert_eq!(SlurmConf::parse("ClusterName=c1\n").prolog_flags, None);
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("slurm.conf");
        assert!(matches!(SlurmConf::load(&p), Err(NodeError::Io { .. })));
        std::fs::write(&p, "PrologFlags=Contain,RunInJob\n").unwrap();
        assert!(SlurmConf::load(&p).unwrap().run_in_job());
    }

    fn check(layout: Layout, slurm: &str, cgroup: Option<&str>) -> Result<(), NodeError> {
        check_layout(
            layout,
            &SlurmConf::parse(slurm),
            Path::new("/etc/slurm/slurm.conf"),
            cgroup.map(CgroupConf::parse).as_ref(),
            Path::new("/etc/slurm/cgroup.conf"),
            "/etc/slurm/gpufence.toml",
        )
    }

    #[test]
    fn layout_slurm_needs_proctrack_cgroup_and_no_cgroup_v1() {
        for ok in [
            (
                "ProctrackType=proctrack/cgroup\n",
                Some("CgroupPlugin=cgroup/v2\n"),
            ),
            ("ProctrackType=proctrack/cgroup\n", None),
            ("ClusterName=c\n", Some("CgroupPlugin=autodetect\n")),
            ("ClusterName=c\n", Some("IgnoreSystemd=yes\n")),
        ] {
            check(Layout::Slurm, ok.0, ok.1).unwrap();
        }
        let e = check(
            Layout::Slurm,
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n",
            None,
        )
        .unwrap_err();
        assert!(matches!(e, NodeError::SlurmLayout { .. }), "{e}");
        let msg = e.to_string();
        for want in [
            "layout = \"slurm\"",
            "/etc/slurm/slurm.conf has ProctrackType=proctrack/linuxproc",
            "set ProctrackType=proctrack/cgroup in /etc/slurm/slurm.conf",
            "layout = \"own\" in /etc/slurm/gpufence.toml",
            "cgroup v1/hybrid",
        ] {
            assert!(msg.contains(want), "{want:?} not in {msg}");
        }
        assert!(!msg.contains('\n'), "one line: {msg}");
        let e = check(
            Layout::Slurm,
            "ProctrackType=proctrack/pgid\nTaskPlugin=task/cgroup,task/affinity\n",
            None,
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("task/cgroup makes the job cgroup only after"),
            "{e}"
        );
        let e = check(
            Layout::Slurm,
            "ProctrackType=proctrack/cgroup\n",
            Some("CgroupPlugin=cgroup/v1\n"),
        )
        .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("/etc/slurm/cgroup.conf has CgroupPlugin=cgroup/v1")
                && msg.contains("set CgroupPlugin=cgroup/v2 in /etc/slurm/cgroup.conf")
                && msg.contains("layout = \"own\""),
            "{msg}"
        );
        // The own layout makes its own cgroups: any Slurm will do.
        check(
            Layout::Own,
            "ProctrackType=proctrack/linuxproc\n",
            Some("CgroupPlugin=cgroup/v1\n"),
        )
        .unwrap();
    }

    #[test]
    fn check_node_layout_reads_the_files() {
        use gpufence_model::config::Config;
        let d = tempfile::tempdir().unwrap();
        let node = |layout: &str| {
            let text = format!(
                "layout = \"{layout}\"\naudit_log = \"{}/a.jsonl\"\n",
                d.path().display()
            );
            let toml = d.path().join("gpufence.toml");
            Node::new(
                Config::parse(&text, &toml).unwrap(),
                ConfigOrigin::File(toml),
            )
            .unwrap()
        };
        let conf = d.path().join("slurm.conf");
        let e = check_node_layout(&node("slurm"), &conf).unwrap_err();
        assert!(
            matches!(e, NodeError::Io { .. }),
            "slurm.conf unreadable: {e}"
        );
        check_node_layout(&node("own"), &conf).unwrap();
        std::fs::write(&conf, "ProctrackType=proctrack/cgroup\n").unwrap();
        check_node_layout(&node("slurm"), &conf).unwrap();
        std::fs::write(d.path().join("cgroup.conf"), "CgroupPlugin=cgroup/v1\n").unwrap();
        let e = check_node_layout(&node("slurm"), &conf).unwrap_err();
        assert!(
            e.to_string()
                .contains(&format!("in {}", d.path().join("gpufence.toml").display())),
            "{e}"
        );
        std::fs::write(&conf, "ProctrackType=proctrack/linuxproc\n").unwrap();
        std::fs::remove_file(d.path().join("cgroup.conf")).unwrap();
        let e = check_node_layout(&node("slurm"), &conf).unwrap_err();
        assert!(matches!(e, NodeError::SlurmLayout { .. }), "{e}");
        // The own layout cannot run with RunInJob; without it, it runs
        // whatever Slurm's proctrack.
        check_node_layout(&node("own"), &conf).unwrap();
        std::fs::write(&conf, "PrologFlags=Alloc,Contain,RunInJob\n").unwrap();
        let e = check_node_layout(&node("own"), &conf).unwrap_err();
        assert!(
            matches!(e, NodeError::OwnLayoutRunInJob { .. })
                && e.to_string().contains("PrologFlags=Alloc,Contain,RunInJob"),
            "{e}"
        );
        check_node_layout(&node("slurm"), &conf).unwrap();
    }
}
