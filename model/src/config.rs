//! The one configuration file every part of gpufence reads.
//!
//! TOML. Where it is: `--config PATH` on the binaries, `config=PATH` as a
//! plugstack.conf argument of the plugin, else `$GPUFENCE_CONFIG`, else
//! [`DEFAULT_CONFIG_PATH`]. When none was named and the default file is
//! absent, the defaults apply (they are the safe ones: deny everything that
//! no Slurm grant or exemption covers). Unknown keys and wrong types are
//! errors that name the key and the file.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::cgpath::{CgroupPath, CgroupPathError};
use crate::device::MAX_MAJOR;

/// Where the config lives when nothing else names it.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/slurm/gpufence.toml";
/// The environment variable that names the config file.
pub const CONFIG_ENV: &str = "GPUFENCE_CONFIG";

/// How the plugin finds (or makes) the cgroup a job's grant is keyed by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Layout {
    /// Slurm's cgroup/v2 plugin made the job cgroup: it is the job dir of
    /// slurmstepd's own cgroup, `<scope>/<job dir>/step_<n>/slurm`, where
    /// the job dir is `job_<id>` (22.05-25.11) or the job's SLUID (26.05;
    /// `CgroupJobIdPaths=yes` restores `job_<id>`). Needs
    /// `ProctrackType=proctrack/cgroup`: with another proctrack Slurm
    /// makes the job cgroup only after the plugin ran.
    Slurm,
    /// Slurm's cgroups are v1 or absent (hybrid hosts): the plugin creates
    /// `<cgroup_root>/job_<id>/step_<step>` in cgroup2 and moves slurmstepd
    /// there, so every task it forks inherits it.
    Own,
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Layout::Slurm => "slurm",
            Layout::Own => "own",
        })
    }
}

/// The configuration, with every default filled in.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// `enforce` (default) or `audit`.
    pub mode: Mode,
    /// Capacity of the denial records (an LRU map: the oldest make room).
    pub max_denials: u32,
    /// The subtree the fence is attached to, relative to the cgroup2 mount
    /// (`"/"`: the whole node). Stored without leading or trailing `/`.
    pub cgroup_root: String,
    /// How job cgroups are found; see [`Layout`].
    pub layout: Layout,
    /// bpffs directory holding the pinned link and maps.
    pub bpffs_dir: PathBuf,
    /// Job records, the `slurmd -G` cache and grant bookkeeping (tmpfs is right:
    /// they must not outlive a reboot, the pinned maps do not either).
    pub state_dir: PathBuf,
    /// JSON Lines audit log.
    pub audit_log: PathBuf,
    /// One root-only JSON file per lingering process found at job end.
    pub evidence_dir: PathBuf,
    /// Where device nodes live; names control devices in records.
    pub dev_dir: PathBuf,
    /// The exemptions: each a cgroup path (relative to the cgroup2 mount)
    /// whose processes, and their descendants, may open every NVIDIA device
    /// when their real uid is one of the entry's users ([`ExemptEntry`]):
    /// a bare string is root only; `{ cgroup = "...", users = [...] }`
    /// names the service accounts (by name or number). An entry's last
    /// component may be a pattern of service units
    /// (`system.slice/nvsm*.service`: shell wildcards, ending in
    /// `.service`), resolved to the cgroups that exist when the fence is
    /// installed and again by `gpufence fence watch`
    /// ([`Config::expand_exempt`]). The defaults are the NVIDIA daemons of
    /// HGX, DGX and GB200 nodes (contrib/gpufence.toml says what each opens).
    pub exempt_cgroups: Vec<ExemptEntry>,
    /// `name = major`: replaces `/proc/devices` discovery of NVIDIA majors.
    pub majors: Option<BTreeMap<String, u32>>,
    /// A file holding `slurmd -G` output. Absent: `slurmd -G` is run and its
    /// output cached under `state_dir`.
    pub slurmd_gres: Option<PathBuf>,
    /// The slurmd binary run as `slurmd -G` (the Prolog has no `PATH`).
    pub slurmd_bin: PathBuf,
    /// Capacity of the pinned grants map (entries: one per job cgroup and
    /// device).
    pub max_grants: u32,
    /// How long the epilog waits for a killed process to be gone, in ms.
    pub kill_wait_ms: u64,
    /// Between SIGTERM and SIGKILL of a lingering process, in ms.
    pub term_grace_ms: u64,
    /// Ask the driver (NVML) which processes use the job's GPUs, besides the
    /// descriptor scan. Without the library or driver, gpufence falls back
    /// to the scan and says so once in the audit log.
    pub nvml: bool,
    /// The NVML library to load (a name for the dynamic loader, or a path).
    pub nvml_library: PathBuf,
    /// After the kills, how long the used memory of each job GPU may take to
    /// return to its idle level, in ms.
    pub memory_wait_ms: u64,
    /// How far above its idle level a GPU's used memory may stay, in MiB.
    pub memory_tolerance_mib: u64,
    /// The Epilog's total deadline, in ms (1000 to 86400000): every wait
    /// on its path (`term_grace_ms`, `kill_wait_ms`, `memory_wait_ms`,
    /// each scan's `scan_budget_ms`, the evidence, the freezes, the MPS
    /// daemon's stop, the drain's scontrol call) is cut to what is left of
    /// it, less a reserve for the drain, and each cut is said. Unset (the
    /// default): 80% of the Epilog's timeout in slurm.conf (`EpilogTimeout`
    /// on 25.05+, else `PrologEpilogTimeout`), or 60 s when it sets none
    /// or cannot be read.
    pub epilog_deadline_ms: Option<u64>,
    /// The shared-memory directory whose leftovers the Epilog reports
    /// (`/dev/shm`: POSIX `shm_open` segments, and the files vLLM, NCCL,
    /// PSM and MPI stacks leave there when killed).
    pub shm_dir: PathBuf,
    /// Remove a job's leftovers in `shm_dir` at job end (regular files of
    /// the job's user, changed since the job started, held by no process),
    /// unless another job of that user runs on the node or a live process
    /// could not be read within `scan_budget_ms` (it may hold them). Off by default:
    /// sites with `job_container/tmpfs` give each job a private /dev/shm.
    pub shm_remove_leftovers: bool,
    /// The idle level when the prolog could not measure one, in MiB.
    pub idle_memory_mib: u64,
    /// What the prolog does with processes that hold the job's GPUs before it
    /// starts: `kill` (and refuse the job only if one survives) or `refuse`.
    pub prolog_strays: StrayPolicy,
    /// What a failed NVML query in the Prolog or Epilog does (the library
    /// loaded, then answered with an error: a driver hiccup, an Xid, a GPU
    /// fallen off the bus): `report` (the default: a `check_failed` audit
    /// line, the job's GPUs judged by the descriptor scan alone, a holder
    /// the scan finds still drains) or `drain` (the hook fails, Slurm
    /// drains the node).
    pub nvml_failure: NvmlFailure,
    /// Drain the node (`scontrol update ... state=drain`) when something
    /// survives, besides exiting non-zero.
    pub drain: bool,
    /// The scontrol binary used to drain, resume and read a node's state.
    pub scontrol_bin: PathBuf,
    /// `gpufence sweep` resumes a node that gpufence itself drained once
    /// the cause is gone (no unfenced holder, the fence installed and
    /// enforcing, nothing at or above the threshold or critical in that
    /// sweep), and only while the node's reason is still the one gpufence
    /// recorded. Off by default: a node that returns to service on its own
    /// is a fleet-wide change of what a drain means, which an admin opts
    /// into where it is wanted.
    pub resume_when_clean: bool,
    /// How many resumes within `resume_window_s` a node may have; at that
    /// number it is drained again as flapping and left to an admin. At
    /// least 1.
    pub resume_max: u32,
    /// The window `resume_max` counts resumes in, in seconds (default
    /// 86400, a day); 1 to 31536000 (a year).
    pub resume_window_s: u64,
    /// Processes of uids up to this one (system accounts: root, dbus,
    /// daemons) are never frozen or killed by the prolog or epilog: a user
    /// could otherwise hand a job's descriptor to such a daemon to have it
    /// killed. Evidence is kept and the node drained instead. It grants no
    /// exemption: an exempt cgroup covers only its entry's users
    /// ([`ExemptEntry`]).
    pub protected_uid_max: u32,
    /// Where the system's account ranges are read (`UID_MIN`,
    /// login.defs(5)): `fence install`, `fence status`, `doctor` and
    /// `sweep` warn when `protected_uid_max` reaches `UID_MIN` (users would
    /// be taken for system accounts). A missing file is no warning.
    pub login_defs: PathBuf,
    /// Removed: service accounts are named in their own `exempt_cgroups`
    /// entry (`users`, [`ExemptEntry`]). Kept as a key only so that a
    /// config still setting it gets an error that says how to rewrite it;
    /// it must be empty.
    pub service_uids: Vec<u32>,
    /// How much of a lingering process's executable is hashed for the
    /// evidence file, in MiB (a huge or sparse file must not stall the epilog).
    pub evidence_hash_max_mib: u64,
    /// How long the hashing of executables for one response may take, in
    /// ms (all holders of one Epilog, Prolog or `respond` together): each
    /// distinct executable (by device and inode) is hashed once, and those
    /// not hashed by then are left out and counted, so a thousand holders
    /// cannot hold the job's end.
    pub evidence_time_ms: u64,
    /// How many bytes of evidence one response may write, in MiB: records
    /// past it are cut to the process's identity and devices, and then left
    /// out and counted.
    pub evidence_max_mib: u64,
    /// How many times the epilog looks again for holders after killing
    /// (a holder may hand its descriptor on while it handles SIGTERM).
    pub response_rounds: u32,
    /// How long one scan for the holders of a job's devices may take, in
    /// ms (each Prolog and Epilog scan; the kernel's passes stop at it).
    /// Past it the GPU is never handed on uncertified: a process whose
    /// descriptor tables or mappings are not read to their end by then
    /// counts as holding the job's devices when it is in the job's own
    /// cgroup or is the job's user's outside every job (the usual
    /// response ends it); any other that no exemption covers is read
    /// again alone within a further budget, and, still not read whole,
    /// is never killed but keeps the GPU from the next job (the Epilog
    /// drains, the Prolog fails). The sweep's `/proc` walk and `gpufence
    /// respond` read each process within it too.
    pub scan_budget_ms: u64,
    /// Where the driver's /proc files are read (`driver/nvidia/gpus/*`,
    /// `driver/nvidia-caps/mig-minors`, capabilities); tests point it at
    /// fixture trees.
    pub proc_dir: PathBuf,
    /// Grant the MIG `monitor` capability when a job's GRES lists it
    /// (it lets a process watch every MIG instance of the node). The
    /// `config` capability (MIG reconfiguration) is never granted.
    pub grant_mig_monitor: bool,
    /// Remote TCP ports of mining pools: a connection to one is a finding.
    pub mining_ports: Vec<u16>,
    /// Slurm's own executables (as `/proc/<pid>/exe` names them): their
    /// wildcard listeners (srun's I/O and PMI ports, slurmstepd's) are part
    /// of running jobs, not a user's exposure, and are not `wildcard_listener`
    /// findings. The executable is the kernel's record of what runs, which a
    /// user cannot rename; a replaced or deleted binary (`... (deleted)`) no
    /// longer matches. A command line that disables a notebook's token is
    /// reported whatever the executable.
    pub slurm_listeners: Vec<PathBuf>,
    /// Where crontabs of users live (Debian: `/var/spool/cron/crontabs`,
    /// RHEL: `/var/spool/cron`).
    pub cron_spool_dir: PathBuf,
    /// System unit directory watched for new or changed units and timers.
    pub systemd_system_dir: PathBuf,
    /// An extra passwd-format file naming users and their home directories
    /// (whose `~/.config/systemd/user` is watched), read before NSS. Unset
    /// by default: users come from glibc NSS (nsswitch.conf(5): files,
    /// SSSD, LDAP...), asked for 2 s at most per run. Set it for users NSS
    /// does not know, or to name users without NSS on hosts and in tests;
    /// `/etc/passwd` (the old default) is harmless and redundant.
    pub passwd_file: Option<PathBuf>,
    /// The lowest severity that makes `gpufence sweep` exit non-zero:
    /// `info`, `low`, `medium`, `high` or `critical`.
    pub sweep_fail_severity: String,
    /// The severity of `gpu_busy_without_grant` when NVML lists no
    /// process on the GPU, only utilisation or memory above its idle
    /// level (a process NVML cannot name: another PID namespace, a
    /// driver-internal client; or a GPU slow to give its memory back):
    /// one of `info`, `low`, `medium`, `high`, `critical`. A GPU whose
    /// only processes are exempt daemons (DCGM's host engine running
    /// `dcgmi diag`) is not reported at all; one with any other process is
    /// `high`.
    pub busy_without_process_severity: String,
    /// Grant the driver's shared IMEX channel, `channel0` of the
    /// `nvidia-caps-imex-channels` major (made by the driver with
    /// `NVreg_CreateImexChannel0=1`, mode 0666), read and write, to every
    /// GPU job (a job with GRES devices), through its record. Off by
    /// default: NVIDIA means it only "in trusted environments where it is
    /// acceptable for applications to share the same IMEX channel"
    /// (`nv-reg.h`). Slurm's own channels (`SwitchType=switch/nvidia_imex`)
    /// need no setting: each job gets its own.
    pub imex_channel0: bool,
    /// The exempt cgroup `gpufence exec` runs admin commands in, relative to
    /// `cgroup_root`; always exempt in the fence.
    pub exec_cgroup: String,
    /// NVIDIA's MPS control daemon (`/usr/bin/nvidia-cuda-mps-control`).
    /// Set, gpufence runs one per GPU and user that gres/mps jobs hold: the
    /// Prolog of a user's first such job on a GPU starts it (`-d`) in
    /// `<cgroup_root>/<mps_cgroup>/gpu<minor>-u<uid>`, which is granted that
    /// GPU and the control devices while an MPS job of that user holds it;
    /// the Epilog of the user's last one stops it (`quit`), ends what is
    /// left in that cgroup and revokes the grant. Jobs get their user's
    /// `CUDA_MPS_PIPE_DIRECTORY` from the plugin. Unset (default): gpufence
    /// starts no MPS daemon, and one started elsewhere (Slurm's sample
    /// Prolog) is a process outside every job, denied the GPU.
    pub mps_control: Option<PathBuf>,
    /// Where each MPS daemon's pipe and log directories are made:
    /// `<mps_dir>/gpu<minor>/u<uid>/pipe` and `.../log` (default
    /// `/run/gpufence-mps`; `u<uid>` root's, 0700, with a POSIX ACL entry
    /// for that uid alone, so the file system must have POSIX ACLs). The
    /// jobs' MPS clients connect in `pipe`, so
    /// it may not lie inside `state_dir`, which is root's alone (`0700`):
    /// with `mps_control` set, such a value is a config error.
    pub mps_dir: PathBuf,
    /// The cgroup the MPS daemons run in, relative to `cgroup_root`: one
    /// leaf `gpu<minor>-u<uid>` per daemon. Never exempt: a leaf is granted
    /// its GPU only while an MPS job of its user holds that GPU.
    pub mps_cgroup: String,
    /// The job map for GPU monitoring: a directory (made `0755` if
    /// missing) with one file (`0644`) per GPU that jobs hold, named by
    /// the GPU's NVML index, or `<index>.<GPU instance id>` for a MIG
    /// slice, holding the ids of the jobs granted it, one per line,
    /// ascending: the format of dcgm-exporter's `--hpc-job-mapping-dir`
    /// (`internal/pkg/transformation/hpc.go`), CEEMS's `gpu_job_map_dir`
    /// and jobstats. The Prolog writes it from the job records and NVML,
    /// the Epilog takes the job out. Unset (default): no map is written.
    /// Files with such names in it are gpufence's: it removes those no
    /// job holds.
    pub job_map_dir: Option<PathBuf>,
    /// Credentials in a batch job's script and submission environment,
    /// found by the plugin at the batch step's start
    /// (`gpufence_node::job::door`): `warn` (default: one line on the
    /// job's stderr, one `job_secret` audit event), `refuse` (the job
    /// fails before its script runs, with that line) or `off`.
    pub job_secrets: DoorMode,
    /// A step's container image named by tag and not by digest, or from a
    /// registry outside `container_registries` (Pyxis's
    /// `--container-image`, a task running `podman run`,
    /// `apptainer`/`singularity exec|run`, `enroot import`): `warn`
    /// (default: a line on the step's stderr, a `container_image` audit
    /// event), `refuse` (the step fails before its tasks run) or `off`.
    /// A hint, not a control: a script can pull images itself.
    pub container_images: DoorMode,
    /// The registries (`nvcr.io`, `ghcr.io`, `docker.io` for Docker Hub,
    /// `registry.example:5000`) images may come from, compared ignoring
    /// ASCII case; empty (default): any registry.
    pub container_registries: Vec<String>,
}

/// What the job's door does with what it finds ([`Config::job_secrets`],
/// [`Config::container_images`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DoorMode {
    /// Not checked.
    Off,
    /// One line on the job's stderr and one audit event; the job runs.
    #[default]
    Warn,
    /// That line, the audit event, and the job (or step) fails before its
    /// tasks run.
    Refuse,
}

impl fmt::Display for DoorMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DoorMode::Off => "off",
            DoorMode::Warn => "warn",
            DoorMode::Refuse => "refuse",
        })
    }
}

/// Whether the fence denies or only records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Deny (EPERM) what no grant or exemption covers, and record it.
    Enforce,
    /// Record what would be denied, and allow it (rollout: observe first).
    Audit,
}

/// What a failed NVML query in the Prolog or Epilog does
/// ([`Config::nvml_failure`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NvmlFailure {
    /// Report it (`check_failed`) and go on with the descriptor scan's
    /// answer: never drain on ignorance; a holder found still drains.
    #[default]
    Report,
    /// Fail the hook: the Epilog drains the node, the Prolog fails the job
    /// (Slurm requeues it and drains the node).
    Drain,
}

/// What the prolog does with a process found on the job's GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StrayPolicy {
    /// Freeze, keep evidence, kill; refuse the job only if one survives.
    Kill,
    /// Keep evidence and refuse the job (Slurm drains the node, requeues the job).
    Refuse,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            mode: Mode::Enforce,
            max_denials: 4096,
            cgroup_root: String::new(),
            layout: Layout::Slurm,
            bpffs_dir: "/sys/fs/bpf/gpufence".into(),
            state_dir: "/run/gpufence".into(),
            audit_log: "/var/log/gpufence/audit.jsonl".into(),
            evidence_dir: "/var/lib/gpufence/evidence".into(),
            dev_dir: "/dev".into(),
            exempt_cgroups: default_exemptions(),
            majors: None,
            slurmd_gres: None,
            slurmd_bin: "/usr/sbin/slurmd".into(),
            max_grants: 65536,
            kill_wait_ms: 5000,
            term_grace_ms: 5000,
            nvml: true,
            nvml_library: "libnvidia-ml.so.1".into(),
            memory_wait_ms: 10_000,
            memory_tolerance_mib: 64,
            epilog_deadline_ms: None,
            shm_dir: "/dev/shm".into(),
            shm_remove_leftovers: false,
            idle_memory_mib: 1024,
            prolog_strays: StrayPolicy::Kill,
            nvml_failure: NvmlFailure::Report,
            drain: true,
            scontrol_bin: "/usr/bin/scontrol".into(),
            resume_when_clean: false,
            resume_max: 3,
            resume_window_s: 86_400,
            protected_uid_max: 999,
            login_defs: "/etc/login.defs".into(),
            service_uids: Vec::new(),
            evidence_hash_max_mib: 256,
            evidence_time_ms: 2000,
            evidence_max_mib: 16,
            response_rounds: 3,
            scan_budget_ms: 2000,
            proc_dir: "/proc".into(),
            grant_mig_monitor: false,
            mining_ports: vec![3333, 4444, 5555, 7777, 9999, 14444, 45700],
            slurm_listeners: vec![
                "/usr/bin/srun".into(),
                "/usr/bin/salloc".into(),
                "/usr/sbin/slurmstepd".into(),
            ],
            cron_spool_dir: "/var/spool/cron/crontabs".into(),
            systemd_system_dir: "/etc/systemd/system".into(),
            passwd_file: None,
            sweep_fail_severity: "medium".into(),
            busy_without_process_severity: "high".into(),
            imex_channel0: false,
            exec_cgroup: "gpufence-exec".into(),
            mps_control: None,
            mps_dir: "/run/gpufence-mps".into(),
            mps_cgroup: "gpufence-mps".into(),
            job_map_dir: None,
            job_secrets: DoorMode::Warn,
            container_images: DoorMode::Warn,
            container_registries: Vec::new(),
        }
    }
}

/// A config that could not be read or does not validate.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file named by `--config`, `config=` or `$GPUFENCE_CONFIG` is unreadable.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// TOML syntax error, at a line and column of the file.
    #[error("config {}:{line}:{col}: {msg}", path.display())]
    Syntax {
        /// The file.
        path: PathBuf,
        /// 1-based line.
        line: usize,
        /// 1-based column (in characters).
        col: usize,
        /// toml's message, on one line.
        msg: String,
    },
    /// A key that does not exist or has the wrong type or value.
    #[error("config {}: key `{key}`: {msg}", at_line(path, *line))]
    Key {
        /// The file.
        path: PathBuf,
        /// The 1-based line that sets the key, when the file sets it (a
        /// default that fails validation has none).
        line: Option<usize>,
        /// Dotted key path (`majors.nvidia`); `.` for the top level.
        key: String,
        /// What is wrong.
        msg: String,
    },
}

fn at_line(path: &Path, line: Option<usize>) -> String {
    match line {
        Some(l) => format!("{}:{l}", path.display()),
        None => path.display().to_string(),
    }
}

/// Builds the error for a bad `key` of the file at `path`; [`Config::parse`]
/// fills in the line.
fn key_err_in(path: &Path) -> impl Fn(&str, String) -> ConfigError + '_ {
    move |key: &str, msg: String| ConfigError::Key {
        path: path.to_path_buf(),
        line: None,
        key: key.to_string(),
        msg,
    }
}

/// Joins the lines of a message into one (toml's messages span several).
fn one_line(msg: &str) -> String {
    msg.split('\n')
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

/// The 1-based line of `text` that sets `key` (`a`, `a.b`, `a[3]`): the
/// `a = ...` line at the top level, or the `b = ...` line in table `[a]`,
/// or the `[a]` header itself.
fn key_line(text: &str, key: &str) -> Option<usize> {
    let mut parts = key.split('.');
    let first = parts.next()?;
    let first = first.split('[').next().unwrap_or(first).trim();
    let sub = parts
        .next()
        .map(|s| s.split('[').next().unwrap_or(s).trim());
    if first.is_empty() {
        return None;
    }
    let sets = |line: &str, k: &str| {
        let l = line.trim_start();
        let l = l
            .strip_prefix(k)
            .or_else(|| l.strip_prefix(&format!("\"{k}\"")));
        l.is_some_and(|rest| rest.trim_start().starts_with('='))
    };
    let mut table: Option<&str> = None;
    let mut header_line = None;
    for (i, raw) in text.lines().enumerate() {
        let l = raw.trim();
        if let Some(h) = l.strip_prefix('[').and_then(|h| h.split(']').next()) {
            table = Some(h.trim_start_matches('[').trim());
            if table == Some(first) {
                header_line = Some(i + 1);
            }
            continue;
        }
        match (table, sub) {
            (None, _) if sets(l, first) => return Some(i + 1),
            (Some(t), Some(s)) if t == first && sets(l, s) => return Some(i + 1),
            _ => {}
        }
    }
    header_line
}

/// Which file a config came from, for messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConfigOrigin {
    /// Read from this file.
    File(PathBuf),
    /// No file was named and [`DEFAULT_CONFIG_PATH`] is absent.
    Defaults,
}

impl fmt::Display for ConfigOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigOrigin::File(p) => write!(f, "{}", p.display()),
            ConfigOrigin::Defaults => write!(f, "built-in defaults ({DEFAULT_CONFIG_PATH} absent)"),
        }
    }
}

/// At most this many cgroups one `exempt_cgroups` pattern expands to
/// ([`Config::expand_exempt`]): a unit family (DGX OS's `nvsm*` units)
/// is a handful; more is a pattern that says too much.
pub const MAX_PATTERN_MATCHES: usize = 64;

/// An `exempt_cgroups` entry with wildcards ([`crate::cgpath::is_glob`])
/// has them in its last component only (a unit name pattern such as
/// `system.slice/nvsm*.service`: the slice is named), with at least one
/// literal character there (`system.slice/*` would exempt every
/// service, and any user's transient scope), and is a valid glob.
fn check_exempt_pattern(n: &CgroupPath) -> Result<(), String> {
    let parts: Vec<&str> = n.components().collect();
    let Some((last, parents)) = parts.split_last() else {
        return Ok(());
    };
    if let Some(p) = parents.iter().find(|p| crate::cgpath::is_glob(p)) {
        return Err(format!(
            "{n}: a wildcard may only stand in the last component (the unit's name), not in {p:?}"
        ));
    }
    if !crate::cgpath::is_glob(last) {
        return Ok(());
    }
    if let Err(e) = glob::Pattern::new(last) {
        return Err(format!("{n}: not a valid pattern: {e}"));
    }
    // What a pattern must name literally: the unit's type suffix
    // (`.service`, `.scope`), so that `nvsm*` cannot also take a slice.
    if !last.ends_with(".service") {
        return Err(format!(
            "{n}: a pattern names service units: its last component ends in `.service` (e.g. `system.slice/nvsm*.service`)"
        ));
    }
    Ok(())
}

/// A user an [`ExemptEntry`] covers: a uid, or a name resolved through
/// `passwd_file` and NSS when the fence is installed (and whenever
/// userspace asks whether an exemption covers a process). A name that
/// does not resolve covers no one.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(untagged, expecting = "a user name or a uid")]
pub enum ExemptUser {
    /// A uid, at most [`crate::policy::ExemptIdentities::MAX_UID`].
    Uid(u32),
    /// A user name.
    Name(String),
}

impl fmt::Display for ExemptUser {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExemptUser::Uid(u) => write!(f, "{u}"),
            ExemptUser::Name(n) => f.write_str(n),
        }
    }
}

/// One `exempt_cgroups` entry: a cgroup (or a pattern of service units)
/// and the users whose processes there, and below, may open every NVIDIA
/// device. An exemption is a cgroup *and* its users, never a uid range:
/// any other process in that cgroup (a user's login shell that slurmd
/// runs there for `sbatch --get-user-env`) is fenced as anywhere else.
///
/// In TOML either a bare string, which covers root (uid 0) only, or a
/// table `{ cgroup = "system.slice/nvidia-persistenced.service", users =
/// ["nvidia-persistenced", "root"] }` (users by name or uid, 1 to
/// [`crate::policy::ExemptIdentities::MAX_UIDS`] of them).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "RawExemptEntry", into = "RawExemptEntry")]
pub struct ExemptEntry {
    /// The cgroup or pattern, relative to the cgroup2 mount (normalised by
    /// [`Config::parse`]).
    pub cgroup: String,
    /// Whom it covers; `[Uid(0)]` for a bare entry.
    pub users: Vec<ExemptUser>,
}

impl ExemptEntry {
    /// An entry that covers root only (what a bare string means).
    pub fn root(cgroup: impl Into<String>) -> ExemptEntry {
        ExemptEntry {
            cgroup: cgroup.into(),
            users: vec![ExemptUser::Uid(0)],
        }
    }

    /// An entry that covers `users`.
    pub fn with_users(cgroup: impl Into<String>, users: &[ExemptUser]) -> ExemptEntry {
        ExemptEntry {
            cgroup: cgroup.into(),
            users: users.to_vec(),
        }
    }

    /// The uids this entry covers, names resolved by `resolve` (a name it
    /// does not know is left out and returned in the second list: never
    /// a wider set).
    pub fn uids(
        &self,
        resolve: &dyn Fn(&str) -> Option<u32>,
    ) -> (std::collections::BTreeSet<u32>, Vec<String>) {
        let mut uids = std::collections::BTreeSet::new();
        let mut unknown = Vec::new();
        for u in &self.users {
            match u {
                ExemptUser::Uid(n) => {
                    uids.insert(*n);
                }
                // A name that resolves past what the program compares
                // (`MAX_UID`) is left out as an unknown one: the entry
                // covers no one by it, and the install goes on.
                ExemptUser::Name(n) => match resolve(n) {
                    Some(id) if id <= crate::policy::ExemptIdentities::MAX_UID => {
                        uids.insert(id);
                    }
                    Some(id) => unknown.push(format!(
                        "{n} (uid {id}, above {})",
                        crate::policy::ExemptIdentities::MAX_UID
                    )),
                    None => unknown.push(n.clone()),
                },
            }
        }
        (uids, unknown)
    }

    /// Whether this entry covers a process of `uid` (names resolved by
    /// `resolve`).
    pub fn covers_uid(&self, uid: u32, resolve: &dyn Fn(&str) -> Option<u32>) -> bool {
        uid <= crate::policy::ExemptIdentities::MAX_UID
            && self.users.iter().any(|u| match u {
                ExemptUser::Uid(n) => *n == uid,
                ExemptUser::Name(n) => resolve(n) == Some(uid),
            })
    }

    /// Whether this is a bare (root-only) entry.
    pub fn is_root_only(&self) -> bool {
        self.users == [ExemptUser::Uid(0)]
    }
}

impl From<&str> for ExemptEntry {
    /// [`ExemptEntry::root`].
    fn from(cgroup: &str) -> ExemptEntry {
        ExemptEntry::root(cgroup)
    }
}

impl From<String> for ExemptEntry {
    /// [`ExemptEntry::root`].
    fn from(cgroup: String) -> ExemptEntry {
        ExemptEntry::root(cgroup)
    }
}

impl fmt::Display for ExemptEntry {
    /// The TOML form: a quoted string, or an inline table.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let quote = |s: &str| toml::Value::String(s.to_string()).to_string();
        if self.is_root_only() {
            return f.write_str(&quote(&self.cgroup));
        }
        let users: Vec<String> = self
            .users
            .iter()
            .map(|u| match u {
                ExemptUser::Uid(n) => n.to_string(),
                ExemptUser::Name(n) => quote(n),
            })
            .collect();
        write!(
            f,
            "{{ cgroup = {}, users = [{}] }}",
            quote(&self.cgroup),
            users.join(", ")
        )
    }
}

/// The TOML shapes of an [`ExemptEntry`].
#[derive(Clone, Serialize, Deserialize)]
#[serde(
    untagged,
    expecting = "a cgroup path string, or a table { cgroup = \"...\", users = [\"name\" or uid, ...] }"
)]
enum RawExemptEntry {
    Bare(String),
    Table(ExemptTable),
}

#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExemptTable {
    cgroup: String,
    users: Vec<ExemptUser>,
}

impl From<RawExemptEntry> for ExemptEntry {
    fn from(r: RawExemptEntry) -> ExemptEntry {
        match r {
            RawExemptEntry::Bare(c) => ExemptEntry::root(c),
            RawExemptEntry::Table(t) => ExemptEntry {
                cgroup: t.cgroup,
                users: t.users,
            },
        }
    }
}

impl From<ExemptEntry> for RawExemptEntry {
    fn from(e: ExemptEntry) -> RawExemptEntry {
        if e.is_root_only() {
            RawExemptEntry::Bare(e.cgroup)
        } else {
            RawExemptEntry::Table(ExemptTable {
                cgroup: e.cgroup,
                users: e.users,
            })
        }
    }
}

/// The default `exempt_cgroups`: the NVIDIA daemons of HGX, DGX and GB200
/// nodes and slurmd, each for the accounts it runs as.
///
/// - slurmd: root (`slurmd.service`).
/// - nvidia-persistenced: the `nvidia-persistenced` user when started
///   with `--user nvidia-persistenced` (NVIDIA's sample unit,
///   `nvidia-persistenced/init/systemd/nvidia-persistenced.service.template`,
///   and the distro packages), else root.
/// - DCGM's nv-hostengine (`nvidia-dcgm.service`, older `dcgm.service`):
///   `nvidia-dcgm` (DCGM 3.x runs it with `--service-account
///   nvidia-dcgm`), else root.
/// - Fabric Manager, IMEX, the MIG manager and NVSM: root.
pub fn default_exemptions() -> Vec<ExemptEntry> {
    let named = |cg: &str, user: &str| {
        ExemptEntry::with_users(cg, &[ExemptUser::Name(user.into()), ExemptUser::Uid(0)])
    };
    vec![
        ExemptEntry::root("system.slice/slurmd.service"),
        named(
            "system.slice/nvidia-persistenced.service",
            "nvidia-persistenced",
        ),
        named("system.slice/nvidia-dcgm.service", "nvidia-dcgm"),
        named("system.slice/dcgm.service", "nvidia-dcgm"),
        ExemptEntry::root("system.slice/nvidia-fabricmanager.service"),
        ExemptEntry::root("system.slice/nvidia-imex.service"),
        ExemptEntry::root("system.slice/nvidia-mig-manager.service"),
        ExemptEntry::root("system.slice/nvsm*.service"),
    ]
}

/// The exemptions resolved for the fence: the identity classes and each
/// `exempt_cgroups` entry's class ([`Config::exempt_plan`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExemptPlan {
    /// The classes; class [`crate::policy::ExemptIdentities::ROOT_CLASS`]
    /// is root only.
    pub identities: crate::policy::ExemptIdentities,
    /// Entry `i`'s class index.
    pub entry_class: Vec<u32>,
    /// `(entry's cgroup, user name)` for each name that did not resolve
    /// (left out of its class).
    pub unknown: Vec<(String, String)>,
}

impl Config {
    /// The first `exempt_cgroups` entry that `cg` (relative to the cgroup2
    /// mount) is in or under, patterns matched per component
    /// ([`CgroupPath::is_under_pattern`]), whoever its users are; `None`
    /// when none is, or `cg` is not a cgroup path. Whether it covers a
    /// process is [`Config::exempt_entry_for`].
    pub fn exempt_entry_covering(&self, cg: &str) -> Option<&ExemptEntry> {
        let c = CgroupPath::parse(cg).ok()?;
        self.exempt_cgroups
            .iter()
            .find(|e| CgroupPath::parse(&e.cgroup).is_ok_and(|e| c.is_under_pattern(&e)))
    }

    /// The first `exempt_cgroups` entry that covers a process of real uid
    /// `uid` in cgroup `cg` (relative to the cgroup2 mount): `cg` is in or
    /// under it and `uid` is one of its users (names resolved by
    /// `resolve`). The rule the fence program applies: an exemption is a
    /// cgroup and its users.
    pub fn exempt_entry_for(
        &self,
        cg: &str,
        uid: u32,
        resolve: &dyn Fn(&str) -> Option<u32>,
    ) -> Option<&ExemptEntry> {
        let c = CgroupPath::parse(cg).ok()?;
        self.exempt_cgroups.iter().find(|e| {
            CgroupPath::parse(&e.cgroup).is_ok_and(|p| c.is_under_pattern(&p))
                && e.covers_uid(uid, resolve)
        })
    }

    /// Whether `uid` is a system account or a service account: at most
    /// `protected_uid_max`, or a uid some `exempt_cgroups` entry names
    /// (names resolved by `resolve`). Not an exemption: what the accounts
    /// checks (`sweep`'s shared-memory leftovers, the suggested
    /// exemptions) ask.
    pub fn is_system_or_service_uid(
        &self,
        uid: u32,
        resolve: &dyn Fn(&str) -> Option<u32>,
    ) -> bool {
        uid <= self.protected_uid_max
            || self
                .exempt_cgroups
                .iter()
                .any(|e| e.covers_uid(uid, resolve))
    }

    /// The identity classes of the exemptions: class 0 root only, then one
    /// class per distinct set of resolved uids, and each entry's class.
    /// An entry whose users all fail to resolve gets an empty class
    /// (covers no one). The config's validation bounds the number of
    /// distinct user lists, so classes never run out; were they to, the
    /// entry would get an empty class too (fail closed).
    pub fn exempt_plan(&self, resolve: &dyn Fn(&str) -> Option<u32>) -> ExemptPlan {
        use crate::policy::ExemptIdentities;
        let mut identities = ExemptIdentities::default();
        let mut entry_class = Vec::new();
        let mut unknown = Vec::new();
        for e in &self.exempt_cgroups {
            let (uids, missing) = e.uids(resolve);
            unknown.extend(missing.into_iter().map(|n| (e.cgroup.clone(), n)));
            let class = identities
                .class_of(&uids)
                .or_else(|| identities.class_of(&Default::default()))
                .unwrap_or(ExemptIdentities::MAX_CLASSES as u32);
            entry_class.push(class);
        }
        ExemptPlan {
            identities,
            entry_class,
            unknown,
        }
    }

    /// The cgroups `exempt_cgroups` names now (relative to the mount), each
    /// with the index of its entry: each plain entry as it is, whether or not it exists; each pattern
    /// replaced by the existing children of its parent that match it,
    /// sorted, at most [`MAX_PATTERN_MATCHES`] of them. `children` lists
    /// the names of a cgroup's child cgroups (empty when it has none or
    /// does not exist). A match that contains the fenced subtree
    /// (`cgroup_root`) or job reports' cgroup is left out, as the config
    /// refuses such a plain entry.
    pub fn expand_exempt(
        &self,
        children: impl Fn(&CgroupPath) -> Vec<String>,
    ) -> Vec<(String, usize)> {
        let root = CgroupPath::parse(&self.cgroup_root).unwrap_or_default();
        let reports = root.join_path(&CgroupPath::parse(REPORT_CGROUP).unwrap_or_default());
        let mut out = Vec::new();
        for (i, e) in self.exempt_cgroups.iter().enumerate() {
            let Ok(n) = CgroupPath::parse(&e.cgroup) else {
                continue;
            };
            let Some(last) = n.components().last().filter(|l| crate::cgpath::is_glob(l)) else {
                out.push((n.into_string(), i));
                continue;
            };
            let Ok(pat) = glob::Pattern::new(last) else {
                continue;
            };
            let parent = CgroupPath::parse(
                n.as_str()
                    .rsplit_once('/')
                    .map(|(p, _)| p)
                    .unwrap_or_default(),
            )
            .unwrap_or_default();
            let mut names: Vec<String> = children(&parent)
                .into_iter()
                .filter(|c| !c.contains('/') && pat.matches(c))
                .collect();
            names.sort();
            out.extend(
                names
                    .into_iter()
                    .filter_map(|c| parent.join(&c).ok())
                    .filter(|m| !root.is_under(m) && !m.is_under(&reports) && !reports.is_under(m))
                    .take(MAX_PATTERN_MATCHES)
                    .map(|m| (m.into_string(), i)),
            );
        }
        out
    }

    /// Finds and loads the config: `explicit` (from `--config` / `config=`),
    /// else `$GPUFENCE_CONFIG` (read from `env`), else [`DEFAULT_CONFIG_PATH`]
    /// when it exists, else the defaults.
    ///
    /// # Errors
    /// [`ConfigError`] when a named file is unreadable or invalid.
    pub fn locate(
        explicit: Option<&Path>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<(Config, ConfigOrigin), ConfigError> {
        let named = explicit
            .map(Path::to_path_buf)
            .or_else(|| env(CONFIG_ENV).filter(|s| !s.is_empty()).map(PathBuf::from));
        let path = match named {
            Some(p) => p,
            None => {
                let d = PathBuf::from(DEFAULT_CONFIG_PATH);
                if !d.exists() {
                    return Ok((Config::default(), ConfigOrigin::Defaults));
                }
                d
            }
        };
        let cfg = Config::load(&path)?;
        Ok((cfg, ConfigOrigin::File(path)))
    }

    /// Reads and validates one file.
    ///
    /// # Errors
    /// [`ConfigError`] naming `path` and, for bad keys, the key.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::parse(&text, path)
    }

    /// Parses and validates TOML text read from `path`.
    ///
    /// # Errors
    /// [`ConfigError`] naming `path` and, for bad keys, the key.
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let table: toml::Table = toml::from_str(text).map_err(|e| {
            let at = e.span().map_or(0, |s| s.start).min(text.len());
            let before = text.get(..at).unwrap_or(text);
            ConfigError::Syntax {
                path: path.to_path_buf(),
                line: before.matches('\n').count() + 1,
                col: before.rsplit('\n').next().unwrap_or("").chars().count() + 1,
                msg: one_line(e.message()),
            }
        })?;
        let mut cfg: Config =
            serde_path_to_error::deserialize(toml::Value::Table(table)).map_err(|e| {
                let key = e.path().to_string();
                ConfigError::Key {
                    path: path.to_path_buf(),
                    line: key_line(text, &key),
                    key,
                    msg: one_line(&e.into_inner().to_string()),
                }
            })?;
        cfg.validate(path).map_err(|e| match e {
            ConfigError::Key { path, key, msg, .. } => ConfigError::Key {
                line: key_line(text, &key),
                path,
                key,
                msg,
            },
            other => other,
        })?;
        Ok(cfg)
    }

    /// Checks what serde cannot, one group of keys at a time in this order,
    /// and returns the first error found (with `line: None`; [`parse`] fills
    /// it in).
    ///
    /// [`parse`]: Config::parse
    fn validate(&mut self, path: &Path) -> Result<(), ConfigError> {
        self.validate_cgroup_root_and_exemptions(path)?;
        self.validate_majors(path)?;
        self.validate_absolute_paths(path)?;
        self.validate_exec_cgroup(path)?;
        self.validate_sweep_fail_severity(path)?;
        self.validate_exempt_identities(path)?;
        self.validate_mps_dir(path)?;
        self.validate_limits(path)
    }

    /// `cgroup_root` and `exempt_cgroups`, normalised in place; no exempt
    /// cgroup may be the cgroup2 root, contain the fenced subtree or be where
    /// job reports are written.
    fn validate_cgroup_root_and_exemptions(&mut self, path: &Path) -> Result<(), ConfigError> {
        let key_err = key_err_in(path);
        let root = CgroupPath::parse(&self.cgroup_root)
            .map_err(|e| key_err("cgroup_root", e.to_string()))?;
        // The report writers run the user's own process there: an
        // exemption would hand it every GPU.
        let reports = root.join_path(&CgroupPath::parse(REPORT_CGROUP).expect("a cgroup name"));
        for (i, e) in self.exempt_cgroups.iter_mut().enumerate() {
            let p = &mut e.cgroup;
            let n = CgroupPath::parse(p)
                .map_err(|e| key_err(&format!("exempt_cgroups[{i}]"), e.to_string()))?;
            if n.is_root() {
                return Err(key_err(
                    &format!("exempt_cgroups[{i}]"),
                    "the cgroup2 root cannot be exempt: that would open every GPU to every process"
                        .into(),
                ));
            }
            // An exempt cgroup at or above the fenced subtree's root would
            // exempt every process the fence is meant to stop.
            if root.is_under(&n) {
                return Err(key_err(
                    &format!("exempt_cgroups[{i}]"),
                    format!("{n} contains the fenced subtree {root}: exempting it would open every GPU to every process"),
                ));
            }
            if n.is_under(&reports) {
                return Err(key_err(
                    &format!("exempt_cgroups[{i}]"),
                    format!("{n} is where job reports are written as the job's user: it is never exempt"),
                ));
            }
            check_exempt_pattern(&n).map_err(|e| key_err(&format!("exempt_cgroups[{i}]"), e))?;
            *p = n.into_string();
        }
        self.cgroup_root = root.into_string();
        Ok(())
    }

    /// `majors`, when set: every major in 1..=[`MAX_MAJOR`], and not empty.
    fn validate_majors(&self, path: &Path) -> Result<(), ConfigError> {
        let key_err = key_err_in(path);
        if let Some(m) = &self.majors {
            for (name, major) in m {
                if *major == 0 || *major > MAX_MAJOR {
                    return Err(key_err(
                        &format!("majors.{name}"),
                        format!("{major} is not a valid character major (1..={MAX_MAJOR})"),
                    ));
                }
            }
            if m.is_empty() {
                return Err(key_err(
                    "majors",
                    "an empty table protects nothing; remove it to use /proc/devices".into(),
                ));
            }
        }
        Ok(())
    }

    /// Every directory, file and binary key is an absolute path.
    fn validate_absolute_paths(&self, path: &Path) -> Result<(), ConfigError> {
        let key_err = key_err_in(path);
        for (key, p) in [
            ("bpffs_dir", &self.bpffs_dir),
            ("state_dir", &self.state_dir),
            ("audit_log", &self.audit_log),
            ("evidence_dir", &self.evidence_dir),
            ("dev_dir", &self.dev_dir),
            ("slurmd_bin", &self.slurmd_bin),
            ("scontrol_bin", &self.scontrol_bin),
            ("proc_dir", &self.proc_dir),
            ("cron_spool_dir", &self.cron_spool_dir),
            ("systemd_system_dir", &self.systemd_system_dir),
            ("login_defs", &self.login_defs),
            ("mps_dir", &self.mps_dir),
        ]
        .into_iter()
        .chain(self.passwd_file.as_ref().map(|p| ("passwd_file", p)))
        .chain(self.mps_control.as_ref().map(|p| ("mps_control", p)))
        .chain(self.job_map_dir.as_ref().map(|p| ("job_map_dir", p)))
        {
            if !p.is_absolute() {
                return Err(key_err(
                    key,
                    format!("{} is not an absolute path", p.display()),
                ));
            }
        }
        Ok(())
    }

    /// With `mps_control` set, `mps_dir` lies outside `state_dir` (root's
    /// alone, `0700`), where the jobs' MPS clients can reach it.
    fn validate_mps_dir(&self, path: &Path) -> Result<(), ConfigError> {
        if self.mps_control.is_some() && self.mps_dir.starts_with(&self.state_dir) {
            return Err(key_err_in(path)(
                "mps_dir",
                format!(
                    "{} is inside state_dir {}, which only root may enter: no job's MPS client could reach its pipe directory; use a directory outside it (the default is /run/gpufence-mps)",
                    self.mps_dir.display(),
                    self.state_dir.display()
                ),
            ));
        }
        Ok(())
    }

    /// `exec_cgroup` and `mps_cgroup`, normalised in place: two cgroups
    /// below `cgroup_root`, neither inside the other.
    fn validate_exec_cgroup(&mut self, path: &Path) -> Result<(), ConfigError> {
        let key_err = key_err_in(path);
        self.exec_cgroup = normalize_cgroup_path(&self.exec_cgroup)
            .map_err(|e| key_err("exec_cgroup", e.to_string()))?;
        if self.exec_cgroup.is_empty() {
            return Err(key_err(
                "exec_cgroup",
                "must name a cgroup below cgroup_root".into(),
            ));
        }
        self.mps_cgroup = normalize_cgroup_path(&self.mps_cgroup)
            .map_err(|e| key_err("mps_cgroup", e.to_string()))?;
        if self.mps_cgroup.is_empty() {
            return Err(key_err(
                "mps_cgroup",
                "must name a cgroup below cgroup_root".into(),
            ));
        }
        // Below or above the exempt exec cgroup, a daemon would be exempt,
        // or the exec cgroup's leaves in the MPS tree.
        let under = |a: &str, b: &str| a == b || a.starts_with(&format!("{b}/"));
        if under(&self.mps_cgroup, &self.exec_cgroup) || under(&self.exec_cgroup, &self.mps_cgroup)
        {
            return Err(key_err(
                "mps_cgroup",
                format!(
                    "{} must not be exec_cgroup ({}), below it or above it (its leaves are exempt)",
                    self.mps_cgroup, self.exec_cgroup
                ),
            ));
        }
        Ok(())
    }

    /// `sweep_fail_severity` is one of the sweep's severities.
    fn validate_sweep_fail_severity(&self, path: &Path) -> Result<(), ConfigError> {
        let key_err = key_err_in(path);
        for (key, v) in [
            ("sweep_fail_severity", &self.sweep_fail_severity),
            (
                "busy_without_process_severity",
                &self.busy_without_process_severity,
            ),
        ] {
            if !matches!(v.as_str(), "info" | "low" | "medium" | "high" | "critical") {
                return Err(key_err(
                    key,
                    format!("{v:?} is not one of info, low, medium, high, critical"),
                ));
            }
        }
        Ok(())
    }

    /// Each `exempt_cgroups` entry's users fit the fence program (1 to
    /// [`ExemptIdentities::MAX_UIDS`](crate::policy::ExemptIdentities::MAX_UIDS)
    /// users, uids at most `MAX_UID`, names not empty), the distinct user
    /// lists fit its classes, and `service_uids` is empty (it was removed:
    /// the error says how to rewrite it).
    fn validate_exempt_identities(&self, path: &Path) -> Result<(), ConfigError> {
        let key_err = key_err_in(path);
        use crate::policy::ExemptIdentities;
        if !self.service_uids.is_empty() {
            return Err(key_err(
                "service_uids",
                format!(
                    "removed: an exemption is a cgroup and its users, never a uid list for all of them; \
                     name each service account in its own entry instead, e.g. \
                     exempt_cgroups = [..., {{ cgroup = \"system.slice/nvidia-dcgm.service\", users = [{}] }}], \
                     and delete service_uids",
                    self.service_uids
                        .iter()
                        .map(u32::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
        let mut lists: std::collections::BTreeSet<std::collections::BTreeSet<&ExemptUser>> =
            std::collections::BTreeSet::new();
        lists.insert([&ExemptUser::Uid(0)].into());
        for (i, e) in self.exempt_cgroups.iter().enumerate() {
            let key = format!("exempt_cgroups[{i}].users");
            if e.users.is_empty() {
                return Err(key_err(
                    &key,
                    "empty: the entry would exempt no one; remove it, or name the service's users"
                        .into(),
                ));
            }
            if e.users.len() > ExemptIdentities::MAX_UIDS {
                return Err(key_err(
                    &key,
                    format!(
                        "{} users; at most {} per entry",
                        e.users.len(),
                        ExemptIdentities::MAX_UIDS
                    ),
                ));
            }
            for u in &e.users {
                match u {
                    ExemptUser::Uid(n) if *n > ExemptIdentities::MAX_UID => {
                        return Err(key_err(
                            &key,
                            format!("{n} is above {}", ExemptIdentities::MAX_UID),
                        ));
                    }
                    ExemptUser::Name(n) if n.is_empty() || n.contains(['/', ':', '\n']) => {
                        return Err(key_err(&key, format!("{n:?} is not a user name")));
                    }
                    _ => {}
                }
            }
            lists.insert(e.users.iter().collect());
        }
        if lists.len() > ExemptIdentities::MAX_CLASSES {
            return Err(key_err(
                "exempt_cgroups",
                format!(
                    "{} distinct user lists (root only counts as one); the fence program tells at most {} apart: \
                     give entries of the same service the same users",
                    lists.len(),
                    ExemptIdentities::MAX_CLASSES
                ),
            ));
        }
        Ok(())
    }

    /// The evidence sizes, `max_denials` and `max_grants`.
    fn validate_limits(&self, path: &Path) -> Result<(), ConfigError> {
        let key_err = key_err_in(path);
        for (key, v) in [
            ("evidence_hash_max_mib", self.evidence_hash_max_mib),
            ("evidence_max_mib", self.evidence_max_mib),
        ] {
            if v > 1 << 20 {
                return Err(key_err(key, format!("{v} MiB; at most 1048576 (1 TiB)")));
            }
        }
        if let Some(d) = self
            .epilog_deadline_ms
            .filter(|d| !(1000..=86_400_000).contains(d))
        {
            return Err(key_err(
                "epilog_deadline_ms",
                format!("{d} ms; 1000 to 86400000 (a day)"),
            ));
        }
        if self.max_denials == 0 {
            return Err(key_err("max_denials", "must be at least 1".into()));
        }
        if self.max_grants == 0 {
            return Err(key_err("max_grants", "must be at least 1".into()));
        }
        if self.resume_max == 0 {
            return Err(key_err("resume_max", "must be at least 1".into()));
        }
        if !(1..=31_536_000).contains(&self.resume_window_s) {
            return Err(key_err(
                "resume_window_s",
                format!("{} s; 1 to 31536000 (a year)", self.resume_window_s),
            ));
        }
        Ok(())
    }
}

/// The subtree of `cgroup_root` where `--gpufence-report` writers run, as
/// the job's user: fenced, never granted, never exempt.
pub const REPORT_CGROUP: &str = "gpufence-report";

/// Normalises a cgroup path relative to the cgroup2 mount: strips leading and
/// trailing `/`, collapses `//` and `.`; `..` is refused (it could name a
/// cgroup outside the intended subtree). The relative form of
/// [`CgroupPath::parse`].
///
/// # Errors
/// [`CgroupPathError`] when the path holds `..`.
pub fn normalize_cgroup_path(p: &str) -> Result<String, CgroupPathError> {
    CgroupPath::parse(p).map(CgroupPath::into_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Config, ConfigError> {
        Config::parse(s, Path::new("/etc/slurm/gpufence.toml"))
    }

    #[test]
    fn the_report_writers_cgroup_is_never_exempt() {
        for (root, exempt) in [
            ("", "gpufence-report"),
            ("", "gpufence-report/job_4"),
            ("fenced", "fenced/gpufence-report"),
        ] {
            let e = parse(&format!(
                "cgroup_root = \"{root}\"\nexempt_cgroups = [\"{exempt}\"]\n"
            ))
            .unwrap_err()
            .to_string();
            assert!(e.contains("never exempt"), "{root} {exempt}: {e}");
        }
        // A sibling of that name elsewhere is fine.
        assert!(
            parse("cgroup_root = \"fenced\"\nexempt_cgroups = [\"other/gpufence-report\"]\n")
                .is_ok()
        );
    }

    #[test]
    fn exempt_patterns_name_service_units_in_their_last_component() {
        let c = parse("exempt_cgroups = [\"/system.slice//nvsm*.service\", \"a/b.service\"]\n")
            .unwrap();
        assert_eq!(
            c.exempt_cgroups,
            vec![
                ExemptEntry::root("system.slice/nvsm*.service"),
                ExemptEntry::root("a/b.service")
            ]
        );
        for (bad, why) in [
            ("system.slice/*", "ends in `.service`"),
            ("system.slice/nvsm*", "ends in `.service`"),
            ("*.slice/x.service", "only stand in the last component"),
            ("system.slice/[x.service", "not a valid pattern"),
        ] {
            let e = parse(&format!("exempt_cgroups = [\"{bad}\"]\n"))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("exempt_cgroups[0]") && e.contains(why),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn an_exemption_is_a_cgroup_and_its_users() {
        let c = parse(
            "exempt_cgroups = [\"system.slice/slurmd.service\", \
             { cgroup = \"/system.slice/nvidia-persistenced.service\", users = [\"nvidia-persistenced\", 0] }, \
             { cgroup = \"system.slice/x.service\", users = [\"ghost\", 1500] }]\n",
        )
        .unwrap();
        assert!(c.exempt_cgroups[0].is_root_only());
        assert_eq!(
            c.exempt_cgroups[1],
            ExemptEntry::with_users(
                "system.slice/nvidia-persistenced.service",
                &[
                    ExemptUser::Name("nvidia-persistenced".into()),
                    ExemptUser::Uid(0)
                ]
            )
        );
        let nss = |n: &str| (n == "nvidia-persistenced").then_some(120);
        // slurmd's cgroup covers root only: a uid-600 login shell there
        // (sbatch --get-user-env) is not covered, nor is protected_uid_max.
        let slurmd = "system.slice/slurmd.service/x";
        assert!(c.exempt_entry_for(slurmd, 0, &nss).is_some());
        for uid in [600, 999, 120, 1500] {
            assert!(c.exempt_entry_for(slurmd, uid, &nss).is_none(), "{uid}");
        }
        let p = "system.slice/nvidia-persistenced.service";
        assert!(c.exempt_entry_for(p, 120, &nss).is_some());
        assert!(c.exempt_entry_for(p, 0, &nss).is_some());
        assert!(c.exempt_entry_for(p, 600, &nss).is_none());
        // Another entry's service account is not covered here.
        assert!(c.exempt_entry_for(p, 1500, &nss).is_none());
        // An unknown name covers no one and is reported.
        let plan = c.exempt_plan(&nss);
        assert_eq!(
            plan.unknown,
            vec![("system.slice/x.service".to_string(), "ghost".to_string())]
        );
        assert_eq!(plan.entry_class, vec![0, 1, 2]);
        assert_eq!(
            plan.identities.classes,
            vec![[0].into(), [0, 120].into(), [1500].into()]
        );
        assert!(c
            .exempt_entry_for("system.slice/x.service", 0, &nss)
            .is_none());
        // A name resolving past what the program compares (an NSS uid
        // above i32::MAX) is left out as unknown; the classes still fit.
        let huge = |n: &str| (n == "nvidia-persistenced").then_some(3_000_000_000);
        let plan = c.exempt_plan(&huge);
        assert!(plan.unknown.contains(&(
            p.to_string(),
            "nvidia-persistenced (uid 3000000000, above 2147483647)".to_string()
        )));
        assert!(plan.identities.fits(), "{:?}", plan.identities);
        assert!(c.exempt_entry_for(p, 3_000_000_000, &huge).is_none());
        assert!(c.exempt_entry_for(p, 0, &huge).is_some());
        // A round trip keeps both forms.
        let text = toml::to_string(&c).unwrap();
        assert_eq!(parse(&text).unwrap(), c);
        // Display gives TOML.
        assert_eq!(
            c.exempt_cgroups[1].to_string(),
            "{ cgroup = \"system.slice/nvidia-persistenced.service\", users = [\"nvidia-persistenced\", 0] }"
        );
        assert_eq!(
            c.exempt_cgroups[0].to_string(),
            "\"system.slice/slurmd.service\""
        );
    }

    #[test]
    fn the_default_exemptions_name_each_daemons_own_accounts() {
        let c = Config::default();
        let users = |cg: &str| {
            c.exempt_cgroups
                .iter()
                .find(|e| e.cgroup == cg)
                .map(|e| e.users.clone())
                .unwrap()
        };
        let root = vec![ExemptUser::Uid(0)];
        for cg in [
            "system.slice/slurmd.service",
            "system.slice/nvidia-fabricmanager.service",
            "system.slice/nvidia-imex.service",
            "system.slice/nvidia-mig-manager.service",
            "system.slice/nvsm*.service",
        ] {
            assert_eq!(users(cg), root, "{cg}");
        }
        let named = |n: &str| vec![ExemptUser::Name(n.into()), ExemptUser::Uid(0)];
        assert_eq!(
            users("system.slice/nvidia-persistenced.service"),
            named("nvidia-persistenced")
        );
        for cg in [
            "system.slice/nvidia-dcgm.service",
            "system.slice/dcgm.service",
        ] {
            assert_eq!(users(cg), named("nvidia-dcgm"), "{cg}");
        }
        // protected_uid_max covers no one anywhere: a uid-600 user in
        // slurmd's cgroup, or in any default exemption, is not exempt.
        let nss = |n: &str| match n {
            "nvidia-persistenced" => Some(120),
            "nvidia-dcgm" => Some(121),
            _ => None,
        };
        for e in &c.exempt_cgroups {
            assert!(!e.covers_uid(600, &nss), "{}", e.cgroup);
            assert!(e.covers_uid(0, &nss), "{}", e.cgroup);
        }
    }

    #[test]
    fn exemption_users_are_checked() {
        for (text, key, why) in [
            (
                "exempt_cgroups = [{ cgroup = \"a.service\", users = [] }]",
                "exempt_cgroups[0].users",
                "exempt no one",
            ),
            (
                "exempt_cgroups = [{ cgroup = \"a.service\", users = [1,2,3,4,5,6,7,8,9] }]",
                "exempt_cgroups[0].users",
                "at most 8",
            ),
            (
                "exempt_cgroups = [{ cgroup = \"a.service\", users = [2147483648] }]",
                "exempt_cgroups[0].users",
                "above 2147483647",
            ),
            (
                "exempt_cgroups = [{ cgroup = \"a.service\", users = [\"a:b\"] }]",
                "exempt_cgroups[0].users",
                "not a user name",
            ),
            (
                "exempt_cgroups = [{ cgroup = \"a.service\", user = [\"x\"] }]",
                "exempt_cgroups[0]",
                "a cgroup path string, or a table",
            ),
            ("service_uids = [1500]", "service_uids", "users = [1500]"),
        ] {
            let e = parse(text).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains(why), "{text}: {e}");
        }
        let many: Vec<String> = (1..=8)
            .map(|i| format!("{{ cgroup = \"s{i}.service\", users = [{i}] }}"))
            .collect();
        let e = parse(&format!("exempt_cgroups = [{}]", many.join(", ")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("9 distinct user lists"), "{e}");
        // Seven named lists and root only fit.
        parse(&format!("exempt_cgroups = [{}]", many[..7].join(", "))).unwrap();
    }

    #[test]
    fn the_default_exemptions_cover_the_nvidia_daemons_and_no_one_else() {
        let c = Config::default();
        for (cg, entry) in [
            (
                "system.slice/nvidia-fabricmanager.service",
                Some("system.slice/nvidia-fabricmanager.service"),
            ),
            (
                "system.slice/nvidia-imex.service/x",
                Some("system.slice/nvidia-imex.service"),
            ),
            (
                "system.slice/nvidia-mig-manager.service",
                Some("system.slice/nvidia-mig-manager.service"),
            ),
            (
                "system.slice/nvsm-core.service",
                Some("system.slice/nvsm*.service"),
            ),
            (
                "system.slice/nvsm_api_gateway.service",
                Some("system.slice/nvsm*.service"),
            ),
            (
                "system.slice/slurmd.service",
                Some("system.slice/slurmd.service"),
            ),
            ("system.slice/sshd.service", None),
            ("system.slice/slurmstepd.scope/job_1", None),
            ("user.slice/user-1000.slice/nvsm.service", None),
            ("system.slice", None),
        ] {
            assert_eq!(
                c.exempt_entry_covering(cg).map(|e| e.cgroup.as_str()),
                entry,
                "{cg}"
            );
        }
    }

    #[test]
    fn patterns_expand_to_existing_children_bounded_and_sorted() {
        let c = parse(
            "cgroup_root = \"\"\nexempt_cgroups = [\"system.slice/slurmd.service\", \"system.slice/nvsm*.service\"]\n",
        )
        .unwrap();
        let kids = |p: &CgroupPath| -> Vec<String> {
            assert_eq!(p.as_str(), "system.slice");
            let mut v: Vec<String> = vec![
                "sshd.service".into(),
                "nvsm.service".into(),
                "nvsm-core.service".into(),
                "nvsm-core.service-x".into(),
            ];
            v.extend((0..100).map(|i| format!("nvsm-{i:03}.service")));
            v
        };
        let x: Vec<String> = c.expand_exempt(kids).into_iter().map(|(p, _)| p).collect();
        assert_eq!(x[0], "system.slice/slurmd.service");
        assert_eq!(x[1], "system.slice/nvsm-000.service");
        assert_eq!(x.len(), 1 + MAX_PATTERN_MATCHES);
        assert!(x.iter().all(|p| p == "system.slice/slurmd.service"
            || (p.starts_with("system.slice/nvsm") && p.ends_with(".service"))));
        // A plain entry stays whether or not it exists; a pattern that
        // matches nothing is nothing.
        let none = c.expand_exempt(|_| Vec::new());
        assert_eq!(none, vec![("system.slice/slurmd.service".to_string(), 0)]);
        // A match that holds the fenced subtree is left out.
        let c = parse(
            "cgroup_root = \"system.slice/nvsm-x.service/jobs\"\nexempt_cgroups = [\"system.slice/nvsm*.service\"]\n",
        )
        .unwrap();
        let x = c.expand_exempt(|_| vec!["nvsm-x.service".into(), "nvsm-y.service".into()]);
        assert_eq!(x, vec![("system.slice/nvsm-y.service".to_string(), 0)]);
    }

    #[test]
    fn empty_file_gives_documented_defaults() {
        let c = parse("").unwrap();
        assert_eq!(c, Config::default());
        assert_eq!(c.cgroup_root, "");
        assert_eq!(c.layout, Layout::Slurm);
        assert_eq!(c.bpffs_dir, PathBuf::from("/sys/fs/bpf/gpufence"));
        assert_eq!(c.state_dir, PathBuf::from("/run/gpufence"));
        assert_eq!(c.audit_log, PathBuf::from("/var/log/gpufence/audit.jsonl"));
        assert_eq!(c.evidence_dir, PathBuf::from("/var/lib/gpufence/evidence"));
        assert_eq!(c.dev_dir, PathBuf::from("/dev"));
        assert!(c
            .exempt_cgroups
            .contains(&ExemptEntry::root("system.slice/slurmd.service")));
        assert!(c.majors.is_none() && c.slurmd_gres.is_none() && c.passwd_file.is_none());
        assert!(c.job_map_dir.is_none(), "no job map unless asked");
    }

    #[test]
    fn the_shipped_example_is_every_key_at_its_default() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../contrib/gpufence.toml");
        let c = Config::load(&p).unwrap();
        assert_eq!(
            c,
            Config::default(),
            "contrib/gpufence.toml drifted from the defaults"
        );
        let text = std::fs::read_to_string(&p).unwrap();
        let table: toml::Table = toml::from_str(&text).unwrap();
        let documented: std::collections::BTreeSet<&str> =
            table.keys().map(String::as_str).collect();
        let all = serde_json::to_value(Config::default()).unwrap();
        for key in all.as_object().unwrap().keys() {
            // optional keys are documented commented out
            if matches!(
                key.as_str(),
                "majors"
                    | "slurmd_gres"
                    | "passwd_file"
                    | "mps_control"
                    | "job_map_dir"
                    | "epilog_deadline_ms"
            ) {
                assert!(
                    text.contains(&format!("# {key}")) || text.contains(&format!("# [{key}]")),
                    "{key} undocumented"
                );
                continue;
            }
            assert!(
                documented.contains(key.as_str()),
                "{key} missing from contrib/gpufence.toml"
            );
        }
    }

    #[test]
    fn full_file_parses_and_normalises() {
        let c = parse(
            r#"
            cgroup_root = "/gpufence-test/"
            layout = "own"
            exempt_cgroups = ["/system.slice//slurmd.service"]
            slurmd_gres = "/tmp/g.txt"
            [majors]
            nvidia = 195
            nvidia-uvm = 240
            "#,
        )
        .unwrap();
        assert_eq!(c.cgroup_root, "gpufence-test");
        assert_eq!(c.layout, Layout::Own);
        assert_eq!(
            c.exempt_cgroups,
            vec![ExemptEntry::root("system.slice/slurmd.service")]
        );
        assert_eq!(c.majors.unwrap()["nvidia-uvm"], 240);
    }

    #[test]
    fn unknown_key_names_key_and_file() {
        let e = parse("cgroup_rot = \"/\"").unwrap_err().to_string();
        assert!(
            e.starts_with("config /etc/slurm/gpufence.toml:1: key `cgroup_rot`: unknown field"),
            "{e}"
        );
        assert!(e.contains("cgroup_rot"), "{e}");
    }

    #[test]
    fn wrong_type_names_key_and_file() {
        let e = parse("[majors]\nnvidia = \"195\"").unwrap_err().to_string();
        assert!(
            e.contains("/etc/slurm/gpufence.toml") && e.contains("majors.nvidia"),
            "{e}"
        );
        let e = parse("layout = \"v1\"").unwrap_err().to_string();
        assert!(e.contains("key `layout`"), "{e}");
        let e = parse("kill_wait_ms = -1").unwrap_err().to_string();
        assert!(e.contains("key `kill_wait_ms`"), "{e}");
    }

    #[test]
    fn invalid_values_are_refused() {
        for (text, key) in [
            ("cgroup_root = \"a/../b\"", "cgroup_root"),
            ("exempt_cgroups = [\"/\"]", "exempt_cgroups[0]"),
            (
                "cgroup_root = \"a/b\"\nexempt_cgroups = [\"a/b\"]",
                "exempt_cgroups[0]",
            ),
            (
                "cgroup_root = \"a/b\"\nexempt_cgroups = [\"x\", \"a\"]",
                "exempt_cgroups[1]",
            ),
            ("[majors]\nnvidia = 0", "majors.nvidia"),
            ("[majors]\nnvidia = 4096", "majors.nvidia"),
            ("[majors]", "majors"),
            ("passwd_file = \"etc/passwd\"", "passwd_file"),
            ("job_map_dir = \"run/gpu-job-map\"", "job_map_dir"),
            ("state_dir = \"run/x\"", "state_dir"),
            ("max_grants = 0", "max_grants"),
        ] {
            let e = parse(text).unwrap_err().to_string();
            assert!(e.contains(&format!("key `{key}`")), "{text}: {e}");
        }
    }

    #[test]
    fn syntax_errors_name_the_file() {
        let e = parse("cgroup_root = ").unwrap_err().to_string();
        assert!(e.starts_with("config /etc/slurm/gpufence.toml:1:"), "{e}");
        let e = parse("mode = \"audit\"\n\ncgroup_root = [\n")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("config /etc/slurm/gpufence.toml:3:"), "{e}");
        assert!(!e.contains('\n'), "one line: {e}");
    }

    #[test]
    fn key_errors_name_the_line() {
        for (text, want) in [
            (
                "mode = \"audit\"\ncgroup_rot = \"/\"",
                ":2: key `cgroup_rot`",
            ),
            (
                "state_dir = \"/x\"\n[majors]\nnvidia = \"195\"",
                ":3: key `majors.nvidia`",
            ),
            (
                "state_dir = \"/x\"\n\n[majors]\nnvidia = 0",
                ":4: key `majors.nvidia`",
            ),
            ("\n\n[majors]\n", ":3: key `majors`"),
            (
                "# c\nexempt_cgroups = [\"a\", \"/\"]",
                ":2: key `exempt_cgroups[1]`",
            ),
            ("\n\nmax_grants = 0", ":3: key `max_grants`"),
        ] {
            let e = parse(text).unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("config /etc/slurm/gpufence.toml{want}")),
                "{text:?}: {e}"
            );
            assert!(!e.contains('\n'), "one line: {e}");
        }
        // A key the file does not set has no line to name.
        let e = parse("cgroup_root = \"a\"\nexec_cgroup = \"/\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains(":2: key `exec_cgroup`"), "{e}");
        // The MPS daemons' cgroup is never exempt: not the exec cgroup, nor
        // inside it, nor around it.
        for bad in ["gpufence-exec", "gpufence-exec/mps", "/"] {
            let e = parse(&format!("mps_cgroup = \"{bad}\""))
                .unwrap_err()
                .to_string();
            assert!(e.contains(":1: key `mps_cgroup`"), "{bad}: {e}");
        }
        let e = parse("exec_cgroup = \"a/b\"\nmps_cgroup = \"a\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("key `mps_cgroup`"), "{e}");
        let c =
            parse("mps_cgroup = \"/x/mps/\"\nmps_control = \"/usr/bin/nvidia-cuda-mps-control\"")
                .unwrap();
        assert_eq!(c.mps_cgroup, "x/mps");
        let e = parse("mps_control = \"nvidia-cuda-mps-control\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("key `mps_control`"), "{e}");
        // The defaults leave the pipe directories reachable by the jobs'
        // clients: outside the 0700 state_dir.
        let d = Config::default();
        assert!(!d.mps_dir.starts_with(&d.state_dir), "{d:?}");
        assert!(parse("mps_control = \"/usr/bin/nvidia-cuda-mps-control\"").is_ok());
        let e = parse(
            "mps_control = \"/usr/bin/nvidia-cuda-mps-control\"\nmps_dir = \"/run/gpufence/mps\"",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("key `mps_dir`") && e.contains("inside state_dir /run/gpufence"),
            "{e}"
        );
        // Without mps_control the key is unused.
        assert!(parse("mps_dir = \"/run/gpufence/mps\"").is_ok());
    }

    fn check_error(
        e: &ConfigError,
        lines: usize,
    ) -> Result<(), proptest::test_runner::TestCaseError> {
        let s = e.to_string();
        proptest::prop_assert!(s.starts_with("config /f"), "{}", s);
        proptest::prop_assert!(!s.contains('\n'), "one line: {}", s);
        match e {
            ConfigError::Syntax { line, col, .. } => {
                proptest::prop_assert!(*line >= 1 && *line <= lines + 1, "{}", s);
                proptest::prop_assert!(*col >= 1, "{}", s);
            }
            ConfigError::Key { line: Some(l), .. } => {
                proptest::prop_assert!(*l >= 1 && *l <= lines, "{}", s)
            }
            _ => {}
        }
        Ok(())
    }

    proptest::proptest! {
        #[test]
        fn any_text_gives_a_config_or_one_line_naming_the_file(s in "\\PC{0,200}") {
            if let Err(e) = Config::parse(&s, Path::new("/f")) {
                check_error(&e, s.lines().count())?;
            }
        }

        #[test]
        fn near_misses_name_the_line(
            lines in proptest::collection::vec(
                (
                    proptest::sample::select(vec![
                        "mode", "cgroup_root", "layout", "bpffs_dir", "state_dir", "audit_log",
                        "exempt_cgroups", "max_grants", "max_denials", "kill_wait_ms", "nvml",
                        "exec_cgroup", "sweep_fail_severity", "job_map_dir", "nvidia", "nvidia-uvm", "[majors]",
                        "[other]", "unknown_key", "", "#",
                    ]),
                    proptest::sample::select(vec![
                        " = ", "=", " ", " == ",
                    ]),
                    proptest::sample::select(vec![
                        "\"audit\"", "\"enforce\"", "\"own\"", "\"/a/b\"", "\"a/../b\"",
                        "\"rel\"", "0", "1", "-1", "4096", "195", "true", "[\"/\"]",
                        "[\"x\", \"y\"]", "[", "\"", "{}", "\"\\u0000\"", "99999999999999999999",
                    ]),
                ),
                0..10,
            )
        ) {
            let text: String = lines.iter().map(|(k, sep, v)| {
                if k.starts_with('[') || k.is_empty() || *k == "#" { format!("{k}\n") } else { format!("{k}{sep}{v}\n") }
            }).collect();
            if let Err(e) = Config::parse(&text, Path::new("/f")) {
                check_error(&e, lines.len())?;
            }
        }
    }

    #[test]
    fn locate_prefers_explicit_then_env() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.toml");
        let b = dir.path().join("b.toml");
        std::fs::write(&a, "layout = \"own\"").unwrap();
        std::fs::write(&b, "layout = \"slurm\"\nkill_wait_ms = 7").unwrap();
        let env_b = |k: &str| (k == CONFIG_ENV).then(|| b.display().to_string());
        let (c, o) = Config::locate(Some(&a), env_b).unwrap();
        assert_eq!((c.layout, o), (Layout::Own, ConfigOrigin::File(a.clone())));
        let (c, o) = Config::locate(None, env_b).unwrap();
        assert_eq!((c.kill_wait_ms, o), (7, ConfigOrigin::File(b.clone())));
        let missing = dir.path().join("missing.toml");
        assert!(matches!(
            Config::locate(Some(&missing), |_| None),
            Err(ConfigError::Read { .. })
        ));
    }
}
