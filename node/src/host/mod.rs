//! What the node is made of: processes, users, GPUs, Slurm (its
//! configuration, its controller, its job cgroups), the fence.

pub mod accounts;
pub mod cgpath;
pub mod deadline;
pub mod denials;
pub mod drain;
pub mod exec_cgroup;
pub mod fence_ops;
pub mod gpus;
pub mod gresmap;
pub mod inventory;
pub mod mps_cgroups;
pub mod persistence;
pub mod procs;
pub mod slurm_cgroup;
pub mod slurmconf;
pub mod slurmctld;
pub mod users;
