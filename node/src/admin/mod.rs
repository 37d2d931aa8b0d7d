//! Admin tools: doctor, grants, `gpufence exec`.

pub mod doctor;
pub mod exec;
pub mod grants;
