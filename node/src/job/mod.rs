//! A job's life on the node: Prolog, grant step, Epilog, report.
//!
//! Its modules use one another one way (`tests/tests/layering.rs`):
//! `mps`, `report` and `jobmap` use none of the others;
//! `outcome` (what an Epilog did, as types) uses `mps`'s error, and
//! `leftovers` `outcome`'s; `door` (credentials and images at a step's start) uses `grant`
//! for the step's names;
//! `injob` uses `apply`; `prolog` and `epilog` use those below them; `timeouts` (their worst
//! durations against slurm.conf's timeouts) reads their waits; `step` (the
//! SPANK plugin's hooks as node calls: slurmd start, a step's start, its
//! tasks' lines) uses `grant`, `door` and `imex`, and nothing uses it.

pub mod door;
pub mod epilog;
pub mod grant;
pub mod imex;
pub mod injob;
pub mod jobmap;
pub mod leftovers;
pub mod mps;
pub mod outcome;
pub mod prolog;
pub mod report;
pub mod step;
pub mod timeouts;
