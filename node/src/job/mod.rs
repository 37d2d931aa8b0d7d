//! A job's life on the node: Prolog, grant step, Epilog, report.

pub mod apply;
pub mod epilog;
pub mod injob;
pub mod leftovers;
pub mod prolog;
pub mod report;
