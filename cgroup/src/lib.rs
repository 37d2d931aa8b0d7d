//! The kernel layer of gpufence: eBPF programs and maps, and the cgroup2
//! hierarchy they are attached in. Most of it is BPF (an assembler, an
//! interpreter, the device program, the scan's iterators, the `bpf(2)`
//! calls); the crate keeps the name `gpufence-cgroup` it has in every
//! manifest of the workspace. It knows nothing of Slurm: which cgroup is a
//! job's is `gpufence_node::host::slurm_cgroup`'s.
//!
//! - [`uapi`]: the kernel's BPF numbers (commands, types, flags, opcode
//!   fields, helper ids), each said once.
//! - [`hierarchy`]: find the cgroup2 mount, cgroup ids, moves.
//! - [`asm`]: a small typed eBPF assembler with symbolic labels.
//! - [`program`]: the fence program, built purely from its parameters.
//! - [`interp`]: an interpreter for the instructions [`program`] emits, so the
//!   program can be checked against [`gpufence_model::policy`] without a kernel.
//! - [`sys`]: the `bpf(2)` calls, as owned file descriptors.
//! - [`btf`]: type ids and struct member offsets from the kernel's BTF.
//! - [`iter`]: BPF iterators over every task's open files and mappings,
//!   for the scans that look for device holders ([`iter::fdtable`]: the
//!   one the fence pins, filtered in the kernel).
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
//!
//! Modules import one way: no circle among the modules of a folder, nor
//! among the folders (`tests/tests/layering.rs` keeps it so).

pub mod asm;
pub mod btf;
pub mod error;
pub mod fence;
pub mod foreign;
pub mod hierarchy;
pub mod interp;
pub mod iter;
pub mod level;
pub mod maps;
pub mod program;
pub mod sys;
pub mod uapi;
pub mod verdict;

pub use error::Error;
pub use fence::{Fence, FenceSpec, FenceStatus};
pub use hierarchy::Cgroup2;
