//! The job options the SPANK plugin registers, as the Prolog and Epilog see
//! them: `--gpu-exclusive` and `--gpufence-report[=PATH]`.
//!
//! Slurm hands option values to the Prolog/Epilog environment as
//! `SPANK__SLURM_SPANK_OPTION_<plugin>_<option>` (and to the job as
//! `_SLURM_SPANK_OPTION_...`), non-alphanumeric characters of both names
//! turned into `_` (`_opt_env_name`, `src/common/plugstack.c`). They are
//! user input: parsed strictly here, and they never widen a grant (they
//! change a compute mode of the job's own GPUs, and where the job's report
//! is written, as the job's user).

use std::path::PathBuf;

/// Option names as registered (and shown in `sbatch --help`).
pub const OPT_GPU_EXCLUSIVE: &str = "gpu-exclusive";
/// See [`OPT_GPU_EXCLUSIVE`].
pub const OPT_REPORT: &str = "gpufence-report";
/// The plugin's name (`plugin_name`), part of the variables' names.
pub const PLUGIN_NAME: &str = "gpufence";

/// The longest report path accepted.
pub const MAX_PATH: usize = 1024;

/// The variable carrying `option` in the Prolog/Epilog environment.
pub fn env_name(option: &str, prolog: bool) -> String {
    let canon = |s: &str| {
        s.chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect::<String>()
    };
    format!(
        "{}_SLURM_SPANK_OPTION_{}_{}",
        if prolog { "SPANK_" } else { "" },
        canon(PLUGIN_NAME),
        canon(option)
    )
}

/// What the user asked for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JobOptions {
    /// `--gpu-exclusive`.
    pub gpu_exclusive: bool,
    /// `--gpufence-report`: `Some(None)` for the default place, `Some(Some(p))` for `=PATH`.
    pub report: Option<Option<PathBuf>>,
}

/// Why a job option's value is refused ([`check_report_path`],
/// [`JobOptions::from_env`]). Each message is one line for the user,
/// starting with the option (`--gpufence-report=PATH: empty path`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OptionsError {
    /// `--gpufence-report=` with an empty path.
    #[error("--gpufence-report=PATH: empty path")]
    EmptyPath,
    /// A report path longer than [`MAX_PATH`] bytes.
    #[error("--gpufence-report=PATH: longer than {MAX_PATH} bytes")]
    PathTooLong,
    /// A report path holding a control character (a newline...).
    #[error("--gpufence-report=PATH: control characters in the path")]
    ControlChars,
    /// `--gpu-exclusive` given a value other than the flag's (empty,
    /// `(null)`, `1`).
    #[error("--{OPT_GPU_EXCLUSIVE} takes no value (got {0:?})")]
    ExclusiveValue(String),
}

/// Checks a report path given by the user: non-empty, at most [`MAX_PATH`]
/// bytes, one line of printable characters. Relative paths are relative to
/// the job's working directory. Where it may be written is decided by the
/// user's own permissions: the report is written as the user.
///
/// # Errors
/// [`OptionsError`], one line for the user.
pub fn check_report_path(p: &str) -> Result<PathBuf, OptionsError> {
    if p.is_empty() {
        return Err(OptionsError::EmptyPath);
    }
    if p.len() > MAX_PATH {
        return Err(OptionsError::PathTooLong);
    }
    if p.chars().any(|c| c.is_control()) {
        return Err(OptionsError::ControlChars);
    }
    Ok(PathBuf::from(p))
}

/// Expands the filename patterns users know from sbatch's `--output` in a
/// report path: `%j` the job id, `%N` the node name, `%%` a `%`. Other
/// `%` sequences are kept as they are. Pure text: the path is still opened
/// as the job's user only.
pub fn expand_report_path(p: &std::path::Path, job_id: u32, node: &str) -> PathBuf {
    let s = p.to_string_lossy();
    let mut out = String::with_capacity(s.len());
    let mut it = s.chars().peekable();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.peek() {
            Some('j') => {
                it.next();
                out.push_str(&job_id.to_string());
            }
            Some('N') => {
                it.next();
                out.push_str(node);
            }
            Some('%') => {
                it.next();
                out.push('%');
            }
            _ => out.push('%'),
        }
    }
    PathBuf::from(out)
}

impl JobOptions {
    /// Reads the options from a Prolog/Epilog environment (`get`).
    ///
    /// # Errors
    /// [`OptionsError`] when a value does not parse (the Prolog then records
    /// no options and says why; it never guesses).
    pub fn from_env(get: &dyn Fn(&str) -> Option<String>) -> Result<Self, OptionsError> {
        let mut o = JobOptions::default();
        let value = |opt: &str| get(&env_name(opt, true)).or_else(|| get(&env_name(opt, false)));
        if let Some(v) = value(OPT_GPU_EXCLUSIVE) {
            // a flag: Slurm passes an empty value (or "(null)")
            if !(v.is_empty() || v == "(null)" || v == "1") {
                return Err(OptionsError::ExclusiveValue(v));
            }
            o.gpu_exclusive = true;
        }
        if let Some(v) = value(OPT_REPORT) {
            o.report = Some(if v.is_empty() || v == "(null)" {
                None
            } else {
                Some(check_report_path(&v)?)
            });
        }
        Ok(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn report_paths_expand_job_and_node() {
        let e = |p: &str| expand_report_path(std::path::Path::new(p), 42, "gpu01");
        assert_eq!(e("rep-%j.txt"), PathBuf::from("rep-42.txt"));
        assert_eq!(
            e("/scratch/%N/%j-%j"),
            PathBuf::from("/scratch/gpu01/42-42")
        );
        assert_eq!(e("100%%-%x-%"), PathBuf::from("100%-%x-%"));
        assert_eq!(e("plain"), PathBuf::from("plain"));
    }

    #[test]
    fn names_follow_slurm() {
        assert_eq!(
            env_name("gpu-exclusive", true),
            "SPANK__SLURM_SPANK_OPTION_gpufence_gpu_exclusive"
        );
        assert_eq!(
            env_name("gpufence-report", false),
            "_SLURM_SPANK_OPTION_gpufence_gpufence_report"
        );
    }

    #[test]
    fn values() {
        let o = JobOptions::from_env(&env(&[
            ("SPANK__SLURM_SPANK_OPTION_gpufence_gpu_exclusive", ""),
            (
                "SPANK__SLURM_SPANK_OPTION_gpufence_gpufence_report",
                "/home/u/r.txt",
            ),
        ]))
        .unwrap();
        assert!(o.gpu_exclusive);
        assert_eq!(o.report, Some(Some(PathBuf::from("/home/u/r.txt"))));
        let o = JobOptions::from_env(&env(&[(
            "SPANK__SLURM_SPANK_OPTION_gpufence_gpufence_report",
            "",
        )]))
        .unwrap();
        assert_eq!(
            o,
            JobOptions {
                gpu_exclusive: false,
                report: Some(None)
            }
        );
        assert_eq!(
            JobOptions::from_env(&env(&[])).unwrap(),
            JobOptions::default()
        );
    }

    proptest::proptest! {
        /// Any option values (huge, binary, `..`, other jobs' paths): parsed
        /// strictly or refused with one line, never a panic; an accepted
        /// report path is one printable line of at most MAX_PATH bytes.
        #[test]
        fn any_option_value_is_checked(
            excl in proptest::option::of("\\PC{0,40}"),
            report in proptest::option::of(proptest::prop_oneof![
                "\\PC{0,64}",
                "(\\.\\./){1,8}etc/[a-z]{1,8}",
                proptest::strategy::Strategy::prop_map(
                    proptest::collection::vec(proptest::prelude::any::<char>(), 0..2000),
                    |v| v.into_iter().collect::<String>(),
                ),
            ]),
        ) {
            let mut vars = Vec::new();
            if let Some(v) = &excl {
                vars.push(("SPANK__SLURM_SPANK_OPTION_gpufence_gpu_exclusive", v.as_str()));
            }
            if let Some(v) = &report {
                vars.push(("SPANK__SLURM_SPANK_OPTION_gpufence_gpufence_report", v.as_str()));
            }
            match JobOptions::from_env(&env(&vars)) {
                Ok(o) => {
                    if let Some(Some(p)) = &o.report {
                        let s = p.to_str().unwrap();
                        proptest::prop_assert!(s.len() <= MAX_PATH && !s.chars().any(char::is_control));
                    }
                    proptest::prop_assert_eq!(o.gpu_exclusive, excl.is_some());
                }
                Err(e) => {
                    let m = e.to_string();
                    proptest::prop_assert!(!m.contains('\n') && m.starts_with("--"), "{}", m)
                }
            }
        }
    }

    #[test]
    fn hostile_values_are_refused() {
        for (k, v) in [
            ("SPANK__SLURM_SPANK_OPTION_gpufence_gpu_exclusive", "0,1,2"),
            ("SPANK__SLURM_SPANK_OPTION_gpufence_gpufence_report", "a\nb"),
            (
                "SPANK__SLURM_SPANK_OPTION_gpufence_gpufence_report",
                &"x".repeat(5000),
            ),
        ] {
            assert!(
                JobOptions::from_env(&env(&[(k, v)])).is_err(),
                "{k}={v:.20}"
            );
        }
    }
}
