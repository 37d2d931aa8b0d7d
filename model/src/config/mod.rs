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
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::cgpath::{CgroupPath, CgroupPathError};

mod exempt;
mod load;

pub use exempt::{default_exemptions, ExemptEntry, ExemptPlan, ExemptUser, MAX_PATTERN_MATCHES};
pub use load::{ConfigError, ConfigOrigin};

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
    use std::path::Path;

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
