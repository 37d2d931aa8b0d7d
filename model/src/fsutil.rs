//! Small file helpers with the guarantees the state and evidence files need,
//! and the one `flock(2)` helper of every lock gpufence takes on a file.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

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
    synced_temp(path, bytes, mode)?
        .persist(path)
        .map_err(|e| e.error)?;
    Ok(())
}

/// A temporary file beside `path` (`.gpufence-*.tmp`, mode `mode`)
/// holding `bytes`, synced: what [`write_atomic`] and
/// [`write_new_whole`] put in place.
fn synced_temp(path: &Path, bytes: &[u8], mode: u32) -> io::Result<tempfile::NamedTempFile> {
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    let mut tmp = tempfile::Builder::new()
        .prefix(".gpufence-")
        .suffix(".tmp")
        .tempfile_in(dir)?;
    tmp.as_file()
        .set_permissions(fs::Permissions::from_mode(mode))?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    Ok(tmp)
}

/// Writes `bytes` to `path` whole and only when `path` does not exist: a
/// temporary file in the same directory, `fsync`, permissions `mode`,
/// then `link(2)`, which never replaces. Readers see no file or the whole
/// one; a writer killed midway leaves no short file at `path` (a `.tmp`
/// one that readers ignore). Of concurrent writers, one wins.
///
/// # Errors
/// `AlreadyExists` when `path` is there (another writer's), or the
/// `io::Error` of the first failing step.
pub fn write_new_whole(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    synced_temp(path, bytes, mode)?
        .persist_noclobber(path)
        .map_err(|e| e.error)?;
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

/// Takes an exclusive `flock(2)` on `f`, waiting as long as another
/// holder keeps it. Held until every descriptor of that open file closes.
///
/// # Errors
/// The `io::Error` of `flock` (not `EINTR`: tried again).
pub fn lock_exclusive(f: &File) -> io::Result<()> {
    loop {
        // SAFETY: flock on a descriptor `f` owns.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Tries an exclusive `flock(2)` on `f` every `poll` until `wait` has
/// passed (once when `wait` is zero): `Ok(true)` when held (until `f`
/// closes), `Ok(false)` when another holder kept it.
///
/// # Errors
/// The `io::Error` of `flock` for anything but "held by another".
pub fn lock_exclusive_within(f: &File, wait: Duration, poll: Duration) -> io::Result<bool> {
    let deadline = Instant::now() + wait;
    loop {
        // SAFETY: flock on a descriptor `f` owns.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        if !matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
        ) {
            return Err(e);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        std::thread::sleep(poll);
    }
}

/// Opens (creating it when absent, never truncating) the lock file `path`
/// and takes its exclusive `flock(2)` within `wait`
/// ([`lock_exclusive_within`]): `Ok(Some(file))`, locked until dropped;
/// `Ok(None)` when another holder kept it.
///
/// # Errors
/// The `io::Error` of `open` or `flock`.
pub fn lock_file_within(path: &Path, wait: Duration, poll: Duration) -> io::Result<Option<File>> {
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)?;
    Ok(lock_exclusive_within(&f, wait, poll)?.then_some(f))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Written whole or not at all, never over an existing file; no
    /// temporary file stays after.
    #[test]
    fn a_new_file_is_whole_and_never_replaces() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("key");
        write_new_whole(&p, &[1; 32], 0o600).unwrap();
        let e = write_new_whole(&p, &[2; 32], 0o600).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(fs::read(&p).unwrap(), vec![1; 32]);
        assert_eq!(
            fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(
            fs::read_dir(d.path()).unwrap().count(),
            1,
            "no temporary file left"
        );
    }

    #[test]
    fn one_holder_at_a_time() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("lock");
        let (wait, poll) = (Duration::from_millis(30), Duration::from_millis(5));
        let first = lock_file_within(&p, wait, poll).unwrap().expect("free");
        // flock(2) locks belong to the open file: a second open waits.
        assert!(lock_file_within(&p, wait, poll).unwrap().is_none());
        let other = File::open(&p).unwrap();
        assert!(!lock_exclusive_within(&other, Duration::ZERO, poll).unwrap());
        drop(first);
        assert!(lock_exclusive_within(&other, Duration::ZERO, poll).unwrap());
        drop(other);
        lock_exclusive(&File::open(&p).unwrap()).unwrap();
    }
}
