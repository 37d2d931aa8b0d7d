//! The kernel side of gpufence.
//!
//! - [`hierarchy`]: find the cgroup2 mount, cgroup ids, job cgroups, moves.
//! - [`asm`]: a small typed eBPF assembler with symbolic labels.
//! - [`program`]: the fence program, built purely from its parameters.
//! - [`interp`]: an interpreter for the instructions [`program`] emits, so the
//!   program can be checked against [`gpufence_model::policy`] without a kernel.
//! - [`sys`]: the `bpf(2)` calls, as owned file descriptors.
//! - [`btf`]: type ids and struct member offsets from the kernel's BTF.
//! - [`iter`]: BPF iterators over every task's open files and mappings,
//!   for the scans that look for device holders.
//! - [`level`]: a cgroup's level as the kernel counts it (a BPF cgroup
//!   iterator), for cgroup namespaces, where paths count from elsewhere.
//! - [`maps`]: the layouts of the pinned maps.
//! - [`fence`]: install, open, status, remove; grant and revoke.
//! - [`verdict`]: the fence program's answer for a task, computed by
//!   running the program over the live maps (for `doctor` and `status`).
//!
//! The kernel facts this rests on (`kernel/bpf/cgroup.c`,
//! `compute_effective_progs` and `__cgroup_bpf_attach`): a `BPF_F_ALLOW_MULTI` program (or a cgroup
//! `bpf_link`, which has MULTI semantics) at a cgroup runs for every task
//! below it, ANDed with whatever Slurm, systemd or a container runtime
//! attach lower down.

pub mod asm;
pub mod btf;
pub mod error;
pub mod fdtable;
pub mod fence;
pub mod foreign;
pub mod hierarchy;
pub mod interp;
pub mod iter;
pub mod level;
pub mod maps;
pub mod program;
pub mod sys;
pub mod verdict;

pub use error::Error;
pub use fence::{Fence, FenceSpec, FenceStatus};
pub use hierarchy::Cgroup2;
