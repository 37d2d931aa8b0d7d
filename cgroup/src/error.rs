//! The error of the kernel layer.

use std::io;
use std::path::PathBuf;

/// What went wrong talking to the kernel, with the operation, the object and
/// the errno, and where a fix is known, the fix.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A `bpf(2)` command failed.
    #[error("bpf({op}) on {what}: {source}")]
    Bpf {
        /// The command, e.g. `BPF_MAP_CREATE`.
        op: &'static str,
        /// The object: a pin path, a map name.
        what: String,
        /// errno.
        source: io::Error,
    },
    /// The verifier refused the fence program.
    #[error("the kernel's verifier refused the fence program ({source}):\n{log}")]
    Verifier {
        /// errno of `BPF_PROG_LOAD`.
        source: io::Error,
        /// The verifier's log.
        log: String,
    },
    /// The kernel lacks `bpf_get_current_ancestor_cgroup_id` for device programs.
    #[error(
        "this kernel does not let cgroup device programs call bpf_get_current_ancestor_cgroup_id \
         (helper 123): gpufence needs Linux 6.1 or later, or a kernel with that helper backported \
         for BPF_PROG_TYPE_CGROUP_DEVICE (RHEL 9.3+). The fence is NOT installed. ({detail})"
    )]
    HelperUnsupported {
        /// The probe's verifier output or errno.
        detail: String,
    },
    /// No fence is pinned at the configured bpffs directory.
    #[error(
        "the fence is not installed ({path} has no pinned {what}); run `gpufence fence install`"
    )]
    NotInstalled {
        /// The bpffs directory.
        path: PathBuf,
        /// What was missing.
        what: &'static str,
    },
    /// A pinned map exists with another layout (a fence installed by
    /// another gpufence version, or someone else's pin): its type, key
    /// size, value size, or a capacity the layout fixes differ
    /// ([`crate::maps::MapSpec`]). Nothing is written to it.
    #[error(
        "pinned map {path} has {found}, but this gpufence needs {expected} (a fence installed by \
         another gpufence version?): run `gpufence fence remove`, then `gpufence fence install`"
    )]
    MapMismatch {
        /// The pin.
        path: PathBuf,
        /// What the kernel reports (`type T key K value V max_entries N`).
        found: String,
        /// What this version needs, in the same words.
        expected: String,
    },
    /// A gpufence program is already attached at `cgroup_root`, but not
    /// through the link pinned in `bpffs_dir` (its pins live in another
    /// mount namespace's bpffs, or under another `bpffs_dir`): a second
    /// fence would stack on it.
    #[error(
        "a gpufence fence program (id {prog_ids}) is already attached at {path}, but its pins are \
         not in {bpffs_dir} (bpffs mounted elsewhere, a private mount namespace, or another \
         bpffs_dir in the config): it still enforces. Not attaching a second one: run gpufence \
         where that fence's pins are visible (the host's mount namespace, the bpffs_dir it was \
         installed with). The fence is NOT (re)installed."
    )]
    FenceElsewhere {
        /// The cgroup directory.
        path: PathBuf,
        /// The pinned link's directory this config names.
        bpffs_dir: PathBuf,
        /// The programs' ids, comma-separated.
        prog_ids: String,
    },
    /// No cgroup2 hierarchy is mounted.
    #[error("no cgroup2 filesystem in /proc/self/mountinfo: gpufence needs the unified hierarchy (mount -t cgroup2 none /sys/fs/cgroup/unified, or boot with systemd.unified_cgroup_hierarchy)")]
    NoCgroup2,
    /// The bpffs directory is not on a bpf filesystem and could not be put on one.
    #[error(
        "bpffs_dir {path} is not on a writable bpf filesystem ({detail}); the fence's pins need one: \
         mount -t bpf bpf /sys/fs/bpf and set bpffs_dir below it. The fence is NOT installed."
    )]
    NotBpffs {
        /// The configured directory.
        path: PathBuf,
        /// Why it could not be mounted.
        detail: String,
    },
    /// The attach point already holds as many device programs as the kernel
    /// allows on one cgroup (`BPF_CGROUP_MAX_PROGS`, 64).
    #[error(
        "cgroup {path} already holds {count} device programs, the kernel's limit per cgroup \
         (BPF_CGROUP_MAX_PROGS = 64): another tool leaks programs there (an old runc?); list them \
         with `bpftool cgroup show {path}`, detach the stale ones, then run `gpufence fence install`. \
         The fence is NOT installed."
    )]
    TooManyPrograms {
        /// The cgroup directory.
        path: PathBuf,
        /// How many programs are attached there now.
        count: usize,
    },
    /// A cgroup filesystem operation failed.
    #[error("{op} {path}: {source}")]
    Cgroup {
        /// What was attempted.
        op: &'static str,
        /// The cgroup directory or file.
        path: PathBuf,
        /// errno.
        source: io::Error,
    },
    /// The cgroup2 mount does not show the whole hierarchy (a cgroup
    /// namespace: a container, `unshare --cgroup`), so paths under it do
    /// not count levels from the kernel's root, and the kernel could not
    /// say where the mount's root sits.
    #[error(
        "the cgroup2 mount {mount} shows cgroup id {root_id} at its root, not the hierarchy's root          (id 1): this process is in a cgroup namespace (a container, unshare --cgroup), where paths          count levels from the namespace's root while the fence program counts them from the          kernel's. gpufence reads the kernel's level with a BPF cgroup iterator (bpf_iter__cgroup,          kernel/bpf/cgroup_iter.c: Linux 6.1 or later, vmlinux BTF from CONFIG_DEBUG_INFO_BTF,          CAP_BPF and CAP_PERFMON), which failed: {detail}. Nothing is granted or exempted at a          guessed level: run gpufence where that works, or outside the cgroup namespace."
    )]
    KernelLevelUnknown {
        /// The mount point.
        mount: PathBuf,
        /// The cgroup id of the mount's root directory.
        root_id: u64,
        /// Why the kernel could not be asked.
        detail: String,
    },
    /// A cgroup path that leaves the mount: a process outside this cgroup
    /// namespace's root (`/proc/<pid>/cgroup` shows `/../..` for it).
    #[error("cgroup path /{path} is outside this cgroup namespace's root (or has . or .. components): its level cannot be counted from here")]
    OutsideMount {
        /// The path as given.
        path: String,
    },
    /// A cgroup cannot be granted: it is deeper than the fence walks.
    #[error("cgroup {path} is at kernel level {level}, deeper than the {max} levels the fence walks; grants there would never match")]
    TooDeep {
        /// The cgroup.
        path: String,
        /// Its level (root = 0).
        level: usize,
        /// The fence's limit.
        max: usize,
    },
    /// The fence program did not run in the interpreter (a bug).
    #[error("running the fence program in the interpreter: {0}")]
    Interp(#[from] crate::interp::InterpError),
    /// Assembling the program failed (a bug in the builder).
    #[error("fence program assembly: {0}")]
    Asm(#[from] crate::asm::AsmError),
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
