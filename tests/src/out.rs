//! Reading what commands and jobs printed, for the cluster tests.

use std::path::Path;
use std::process::Output;

/// A command's stdout, lossily decoded.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// stdout then stderr, for failure messages.
pub fn both(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `KEY=value` from a job's output.
pub fn field(out: &str, key: &str) -> Option<String> {
    out.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}=")))
        .map(str::to_string)
}

/// What the probe (or the job's shell) printed after `subject ` (a device
/// path, for `gpufence-probe open`): `ENXIO`, `EPERM`, `ok`; `missing`
/// when there is no such line.
pub fn verdict(out: &str, subject: impl AsRef<std::ffi::OsStr>) -> String {
    let p = Path::new(subject.as_ref()).display().to_string();
    out.lines()
        .find_map(|l| l.strip_prefix(&format!("{p} ")))
        .unwrap_or("missing")
        .to_string()
}
