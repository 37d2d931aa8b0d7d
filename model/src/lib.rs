//! The model of gpufence, shared by the fence, the prolog, the epilog, the
//! SPANK plugin and the admin CLI.
//!
//! Everything here is pure or touches only ordinary files: configuration
//! ([`config`]), device numbers and access bits ([`device`]), the parsers of
//! node inputs (`/proc/devices` in [`procdevices`], `slurmd -G` and GRES index
//! lists in [`gres`]), the policy the BPF fence implements ([`policy`]), the
//! job records kept under `state_dir` ([`record`]), the JSON Lines audit
//! log and its vocabulary ([`audit`]), file helpers and `flock(2)`
//! ([`fsutil`]), `/proc/<pid>/stat` ([`procstat`]) and the node's name
//! ([`nodename`]), the credential rules for job scripts and environments
//! ([`secrets`]) and container image references ([`image`]). Nothing here
//! loads BPF or touches cgroups.

pub mod audit;
pub mod cgpath;
pub mod config;
pub mod device;
pub mod drainrec;
pub mod error;
pub mod fsutil;
pub mod gres;
pub mod image;
pub mod mig;
pub mod migdraw;
pub mod nodename;
pub mod nvproc;
pub mod options;
pub mod policy;
pub mod procdevices;
pub mod procnet;
pub mod procstat;
pub mod record;
pub mod secrets;
pub mod text;
pub mod visible;

pub use cgpath::{CgroupPath, CgroupPathError};
pub use error::ParseError;
