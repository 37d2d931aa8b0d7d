//! The error of node operations. Each variant's message is the one line an
//! admin (or, through the plugin, a user) sees: what failed and what to do.

use std::io;
use std::path::{Path, PathBuf};

use gpufence_model::config::ConfigError;
use gpufence_model::record::StateError;
use gpufence_model::ParseError;

/// A node operation that failed.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The config file is missing, unreadable or invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The kernel layer failed (BPF, cgroups).
    #[error(transparent)]
    Kernel(#[from] gpufence_cgroup::Error),
    /// A state file is unreadable or corrupt.
    #[error(transparent)]
    State(#[from] StateError),
    /// A node input (`/proc/devices`, `slurmd -G`, `SLURM_JOB_GPUS`) is malformed.
    #[error(transparent)]
    Parse(#[from] ParseError),
    /// A file operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was attempted.
        op: &'static str,
        /// On what.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// The audit log cannot be written.
    #[error("{0}; gpufence records every grant before it takes effect: fix the audit log (disk full? permissions?)")]
    Audit(io::Error),
    /// A variable slurmd always sets is missing or malformed.
    #[error("{var}: {msg} (gpufence-prolog/epilog must run as slurmd's Prolog/Epilog)")]
    Env {
        /// The variable.
        var: &'static str,
        /// What is wrong.
        msg: String,
    },
    /// A GRES index the job was given is not in slurmd's list.
    #[error("job {job_id} was given GRES index {index} but slurmd lists {count} GPU(s) (from {source_name}): node GRES configuration problem")]
    UnmappedIndex {
        /// The job.
        job_id: u32,
        /// The index.
        index: u32,
        /// How many GPUs slurmd lists.
        count: usize,
        /// Where the list came from.
        source_name: String,
    },
    /// A device file named by slurmd is missing or is not a character device.
    #[error(
        "GRES index {index}: {path}: {msg}: node problem (driver not loaded? gres.conf wrong?)"
    )]
    BadDevice {
        /// The GRES index.
        index: u32,
        /// The file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// slurm.conf cannot be read: `slurmd -G` would retry it for a minute.
    #[error("slurm.conf {path} cannot be read ({source}): gpufence maps GRES indices to devices with `slurmd -G`, which needs it; SLURM_CONF in the Prolog's environment (slurmd sets it; configless nodes: slurmd's cached copy) or /etc/slurm/slurm.conf must name a readable file")]
    SlurmConf {
        /// The file.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// `slurmd -G` could not be run or failed.
    #[error("`{cmd}` failed: {msg}")]
    SlurmdG {
        /// The command line.
        cmd: String,
        /// Status and stderr.
        msg: String,
    },
    /// `slurmd -G` cannot be given a cgroup of its own: gpufence does not
    /// run it anywhere else (it would move itself, or reset the limits of
    /// the cgroup it runs in, see [`crate::host::gresmap`]).
    #[error("cannot {op} {cgroup}, the cgroup of gpufence's own that `slurmd -G` runs in: {msg}; `slurmd -G` sets up Slurm's cgroup plugin where it runs (it moves itself, and resets the cpuset and memory limits of its cgroup), so gpufence runs it nowhere else: run gpufence as root with the cgroup2 hierarchy at {mount} writable, or set slurmd_gres in {config} to a file holding `slurmd -G`'s output")]
    SlurmdGCgroup {
        /// What failed: `make`, `join`.
        op: &'static str,
        /// The cgroup, absolute (`/gpufence-exec/slurmd-G-1234`).
        cgroup: String,
        /// Why.
        msg: String,
        /// The cgroup2 mount.
        mount: PathBuf,
        /// The gpufence config file.
        config: String,
    },
    /// slurmd's GRES list has no GPU while gres.conf gives this node some:
    /// `slurmd -G` printed them in a way gpufence did not read, or slurmd
    /// dropped them; "0 GPUs" would be wrong either way.
    #[error("{source_name} lists no GPU, but {gres_conf}:{line} gives this node GPUs ({text}); gpufence cannot map GRES indices to device files: check `slurmd -G` by hand and report its output if it lists the GPUs")]
    NoGpusListed {
        /// The command or file the empty list came from.
        source_name: String,
        /// The gres.conf that names GPUs.
        gres_conf: PathBuf,
        /// Its 1-based line.
        line: usize,
        /// The line, comment removed.
        text: String,
    },
    /// `layout = "slurm"` while Slurm will not put slurmstepd in a cgroup2
    /// job cgroup before SPANK runs: every step would be refused.
    #[error("layout = \"slurm\" needs slurmstepd in Slurm's cgroup2 job cgroups, but {file} has {setting} ({why}): set {fix} in {file}, or on cgroup v1/hybrid hosts set layout = \"own\" in {gpufence_toml}")]
    SlurmLayout {
        /// slurm.conf or cgroup.conf.
        file: PathBuf,
        /// What it sets (`ProctrackType=proctrack/linuxproc`).
        setting: String,
        /// Why that cannot work.
        why: String,
        /// What to set instead (`ProctrackType=proctrack/cgroup`).
        fix: String,
        /// The gpufence config that sets the layout.
        gpufence_toml: String,
    },
    /// `layout = "own"` with `PrologFlags=RunInJob`: the plugin moves the
    /// extern slurmstepd into gpufence's own job cgroup, where Slurm then
    /// forks the Prolog and Epilog, and the own layout's clean-up of that
    /// cgroup kills them and the extern step: every job would fail.
    #[error("layout = \"own\" cannot run with PrologFlags=RunInJob ({file} has PrologFlags={flags}): Slurm runs the Prolog and Epilog inside the job's extern step, which the own layout moves into a job cgroup of gpufence's that its clean-up kills; use layout = \"slurm\" (Slurm's cgroup/v2 plugin with ProctrackType=proctrack/cgroup) in {gpufence_toml}, or remove RunInJob from PrologFlags")]
    OwnLayoutRunInJob {
        /// slurm.conf.
        file: PathBuf,
        /// Its PrologFlags.
        flags: String,
        /// The gpufence config that sets the layout.
        gpufence_toml: String,
    },
    /// slurm.conf or gres.conf changed since slurmd read them.
    #[error("slurm.conf or gres.conf changed since slurmd started ({cached} -> {now}); the running slurmd numbers GPUs by the old files, so GRES indices cannot be mapped safely: restart slurmd")]
    GresChanged {
        /// The cache key of slurmd's start.
        cached: String,
        /// The key now.
        now: String,
    },
    /// The fence is not installed: no GPU access can be controlled.
    #[error("the GPU fence is not installed on this node ({detail}), so GPU access cannot be controlled; admin: run `gpufence fence install`")]
    FenceMissing {
        /// What status found.
        detail: String,
    },
    /// A cgroup path given by the admin is not one (`..`).
    #[error(transparent)]
    CgroupPath(#[from] gpufence_model::CgroupPathError),
    /// `gpufence exec` run by a user other than root.
    #[error("gpufence exec: only root may run commands in the exempt cgroup")]
    ExecNotRoot,
    /// `gpufence exec` given no command.
    #[error("gpufence exec: no command (gpufence exec -- CMD ...)")]
    ExecNoCommand,
    /// The process asked about is gone.
    #[error("process {pid} is gone")]
    ProcessGone {
        /// The process.
        pid: i32,
    },
    /// The record the Prolog wrote is gone before its grant.
    #[error("job {job_id}: the record written a moment ago is gone from {}", path.display())]
    RecordGone {
        /// The job.
        job_id: u32,
        /// Where the record was.
        path: PathBuf,
    },
    /// slurmstepd is in no job cgroup of Slurm's (`layout = "slurm"`).
    #[error(
        "slurmstepd of job {job_id} step {step} (pid {pid}) is in cgroup {cgroup}, not in Slurm's \
         <job_{job_id} or SLUID>/step_{step}/slurm (layout = \"slurm\"): either Slurm's cgroup/v2 plugin \
         runs without proctrack/cgroup (set ProctrackType=proctrack/cgroup in slurm.conf and \
         CgroupPlugin=cgroup/v2 in cgroup.conf), or this is a cgroup v1/hybrid host, where Slurm \
         makes no cgroup2 job cgroups (set layout = \"own\" in gpufence.toml)"
    )]
    NoJobCgroup {
        /// The job.
        job_id: u32,
        /// The step, by name (`extern`, `batch`, `0`).
        step: String,
        /// slurmstepd.
        pid: i32,
        /// Its cgroup, absolute.
        cgroup: String,
    },
    /// slurmstepd could not be moved into its step's cgroup (`layout =
    /// "own"`).
    #[error("cannot move slurmstepd (pid {pid}) into {cgroup}: {source}")]
    MoveStepd {
        /// slurmstepd.
        pid: i32,
        /// The step's cgroup (relative).
        cgroup: String,
        /// Why.
        source: Box<gpufence_cgroup::Error>,
    },
    /// A Prolog or Epilog could not step out of the job cgroup into the
    /// exempt one (`PrologFlags=RunInJob`).
    #[error("cannot move the {tag} (pid {pid}) from {from} into the exempt cgroup {to}: {source}")]
    StepOut {
        /// `prolog`, `epilog`.
        tag: String,
        /// This process.
        pid: i32,
        /// Where it was, absolute.
        from: String,
        /// The exempt leaf, absolute.
        to: String,
        /// Why.
        source: Box<gpufence_cgroup::Error>,
    },
    /// The job cgroup lies outside `cgroup_root`: a grant there would
    /// guard nothing.
    #[error("job cgroup {job} is outside the fenced subtree {root}")]
    OutsideFence {
        /// The job cgroup, absolute.
        job: String,
        /// `cgroup_root`, absolute.
        root: String,
    },
    /// The job cgroup is below an exempt cgroup.
    #[error(
        "the job cgroup {job} is below the exempt cgroup {exempt}, so every process of every job could open every GPU: \
         remove {path} from exempt_cgroups in {config} (exemptions are for system services outside Slurm's job tree)"
    )]
    ExemptAncestor {
        /// The job cgroup, absolute.
        job: String,
        /// The exempt cgroup, absolute.
        exempt: String,
        /// The exempt cgroup as `exempt_cgroups` names it (relative).
        path: String,
        /// The gpufence config.
        config: String,
    },
    /// A Prolog or Epilog runs in another job's extern step: the text of
    /// `job::injob::WrongJob` (which names the job layer's facts this
    /// crate-root error cannot).
    #[error("{0}")]
    WrongJob(String),
    /// An MPS daemon's lock stayed taken past its wait.
    #[error("{} stayed locked for {waited_ms} ms (another Prolog or Epilog starting or stopping MPS daemon {daemon})", path.display())]
    MpsLocked {
        /// The lock file.
        path: PathBuf,
        /// How long it was waited for, ms.
        waited_ms: u64,
        /// The daemon.
        daemon: String,
    },
    /// Processes hold the job's GPUs before it starts (clean start).
    #[error("job {job_id}: {what} on its GPUs before it starts: {pids:?}; evidence in the evidence directory, see the audit log")]
    Strays {
        /// The job.
        job_id: u32,
        /// "processes survived SIGKILL" or "stray processes (policy: refuse)".
        what: String,
        /// The processes.
        pids: Vec<i32>,
    },
    /// Processes not read whole within `scan_budget_ms` (the scan, then a
    /// re-read of each alone) that gpufence does not end may hold the
    /// job's GPUs: the job does not start on them
    /// ([`crate::response::respond::uncovered`]).
    #[error("job {job_id}: {what}; see the audit log (scan_over_budget)")]
    NotRead {
        /// The job.
        job_id: u32,
        /// Each process's [`crate::response::respond::NotRead::reason`].
        what: String,
    },
    /// The job runs as a uid gpufence takes for a system account
    /// ([`crate::host::accounts::is_system_job_uid`]).
    #[error("job {job_id} runs as uid {uid}, at or below protected_uid_max ({max}) in {config}: gpufence takes such uids for system accounts (never ended), so it runs no job of theirs; admin: set protected_uid_max below your users' uids (UID_MIN in /etc/login.defs)")]
    SystemUidJob {
        /// The job.
        job_id: u32,
        /// Its uid.
        uid: u32,
        /// `protected_uid_max`.
        max: u32,
        /// The gpufence config.
        config: String,
    },
    /// `fence remove` found the fence's link attached somewhere else than
    /// `cgroup_root` (or `cgroup_root` missing): it may be the node's
    /// working fence, which a wrong config must not take down.
    #[error("the fence pinned in {bpffs_dir} is attached at {attached}, not at cgroup_root /{cgroup_root} of {config}: not removed, it may be this node's working fence; fix cgroup_root in {config}, or remove it with the config it was installed with")]
    FenceNotHere {
        /// The bpffs directory.
        bpffs_dir: PathBuf,
        /// Where the link is attached (a path, or the cgroup id).
        attached: String,
        /// The configured attach point.
        cgroup_root: String,
        /// The config.
        config: String,
    },
    /// `cgroup_root` does not exist.
    #[error("cgroup_root = {cgroup_root:?} in {config}: {path} does not exist; the fence attaches there: set cgroup_root to an existing cgroup2 directory (\"/\" for the whole node)")]
    NoCgroupRoot {
        /// The configured value.
        cgroup_root: String,
        /// The directory it names.
        path: PathBuf,
        /// The config.
        config: String,
    },
    /// A MIG capability in a GRES cannot be identified or is not grantable.
    #[error("MIG: {0}")]
    Mig(String),
    /// NVML answered with an error: the GPUs cannot be shown clean.
    #[error("NVML query failed, the job's GPUs cannot be shown clean: {0}")]
    Nvml(#[source] crate::host::gpus::GpuError),
    /// A step of the response to processes on a job's GPUs failed
    /// (evidence, a note, a holder that cannot be pinned): the clean start
    /// cannot be shown.
    #[error(transparent)]
    Response(Box<crate::response::respond::ResponseError>),
    /// The job record belongs to someone else.
    #[error("job {job_id}: the record in {path} is for uid {record_uid}, the step runs as uid {step_uid}: stale record of an earlier job with this id; no GPU access granted")]
    RecordMismatch {
        /// The job.
        job_id: u32,
        /// The record file.
        path: PathBuf,
        /// uid in the record.
        record_uid: u32,
        /// uid of the step.
        step_uid: u32,
    },
}

impl From<crate::response::respond::ResponseError> for NodeError {
    /// An audit line that could not be written stays [`NodeError::Audit`].
    fn from(e: crate::response::respond::ResponseError) -> Self {
        match e {
            crate::response::respond::ResponseError::Audit(e) => e,
            e => NodeError::Response(Box::new(e)),
        }
    }
}

impl NodeError {
    /// A file error with its operation and path.
    pub fn io(op: &'static str, path: &Path, source: io::Error) -> Self {
        NodeError::Io {
            op,
            path: path.to_path_buf(),
            source,
        }
    }
}
