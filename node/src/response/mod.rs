//! The response to a process that holds what it must not: one engine, two front ends.

pub mod engine;
pub mod evidence;
pub mod incident;
pub mod respond;
