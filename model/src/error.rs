//! The error shared by the line-oriented parsers of node inputs.

use std::path::PathBuf;

/// A malformed line in a node input (`/proc/devices`, `slurmd -G` output,
/// a GRES index list). Names the file (or the variable) and the 1-based line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{source_name}:{line}: {msg}")]
pub struct ParseError {
    /// The file or environment variable the input came from.
    pub source_name: PathBuf,
    /// 1-based line number; 0 when the input is a single value.
    pub line: usize,
    /// What is wrong, with the offending text.
    pub msg: String,
}

impl ParseError {
    /// Builds an error for `line` (1-based) of `source_name`.
    pub fn new(source_name: impl Into<PathBuf>, line: usize, msg: impl Into<String>) -> Self {
        ParseError {
            source_name: source_name.into(),
            line,
            msg: msg.into(),
        }
    }
}
