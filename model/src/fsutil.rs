//! Small file helpers with the guarantees the state and evidence files need.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Creates `dir` and its missing parents with `mode` (e.g. `0o700`), and sets
/// `mode` on `dir` itself when this call created it.
///
/// # Errors
/// The `io::Error` of the failing `mkdir`.
pub fn create_dir_all_mode(dir: &Path, mode: u32) -> io::Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    fs::DirBuilder::new().recursive(true).mode(mode).create(dir)
}

/// Writes `bytes` to `path` atomically: a temporary file in the same
/// directory, `fsync`, permissions `mode`, then `rename(2)` over `path`.
/// Readers see the old content or the new one, never a half-written file,
/// even if this process is killed midway (the temporary file is then left
/// with a `.tmp` name that readers ignore).
///
/// # Errors
/// The `io::Error` of the first failing step.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    let mut tmp = tempfile::Builder::new()
        .prefix(".gpufence-")
        .suffix(".tmp")
        .tempfile_in(dir)?;
    tmp.as_file()
        .set_permissions(fs::Permissions::from_mode(mode))?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}

/// Creates `path` with `mode`, failing if it exists (`O_EXCL`), and writes
/// `bytes`. Used for evidence, which is never overwritten.
///
/// # Errors
/// `AlreadyExists` when the file is there, or the failing write.
pub fn write_new(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}
