//! The raw C side the slurm-spank crate does not cover: the options
//! registered by hand, their callback, and the plugstack.conf arguments
//! read from Slurm's `argc`/`argv`. FFI only: the rules are
//! `gpufence_node::job::step`'s.

use std::os::raw::{c_char, c_int};
use std::panic::catch_unwind;

use gpufence_node::job::step::{self, Level, PluginArgs, PluginArgsError};

use crate::log;

/// Registers `--gpu-exclusive` and `--gpufence-report[=PATH]` with Slurm,
/// raw: slurm-spank's `register_option` cannot make an option whose value
/// is optional (`has_arg = 2`), and Slurm ignores a static `spank_options`
/// table in sbatch/salloc (allocator context, `_spank_plugin_create`,
/// `src/common/plugstack.c`). Slurm copies the struct, so a stack value is
/// fine. Values reach the Prolog and Epilog as
/// `SPANK__SLURM_SPANK_OPTION_gpufence_*`, which act on them.
pub(crate) fn register_options(spank: slurm_spank::spank_sys::spank_t) -> c_int {
    use slurm_spank::spank_sys::{spank_option, spank_option_register};
    let mut opts = [
        spank_option {
            name: c"gpu-exclusive".as_ptr(),
            arginfo: std::ptr::null(),
            usage: c"run this job's GPUs in exclusive-process compute mode (restored at job end)".as_ptr(),
            has_arg: 0,
            val: 1,
            cb: Some(option_cb),
        },
        spank_option {
            name: c"gpufence-report".as_ptr(),
            arginfo: c"PATH".as_ptr(),
            usage: c"at job end, write a report of the job's GPU use (devices, denied opens, lingering processes, GPU-seconds); =PATH is optional (%j job id, %N node), without it: gpufence-<jobid>.txt in the job's working directory".as_ptr(),
            has_arg: 2,
            val: 2,
            cb: Some(option_cb),
        },
    ];
    for o in opts.iter_mut() {
        // SAFETY: a valid spank handle from Slurm and a valid option struct.
        let rc = unsafe { spank_option_register(spank, o) };
        if rc != 0 {
            log(
                Level::Error,
                &format!("cannot register an option (spank error {rc})"),
            );
            return -1;
        }
    }
    0
}

/// Validates option values where the user types them (srun, sbatch):
/// [`step::check_report_option`]. Never panics.
unsafe extern "C" fn option_cb(val: c_int, optarg: *const c_char, _remote: c_int) -> c_int {
    let r = catch_unwind(|| {
        if val == 2 && !optarg.is_null() {
            // SAFETY: Slurm passes a NUL-terminated string or NULL.
            let s = unsafe { std::ffi::CStr::from_ptr(optarg) }.to_string_lossy();
            if let Err(e) = step::check_report_option(&s) {
                log(Level::Error, &e.to_string());
                return -1;
            }
        }
        0
    });
    r.unwrap_or(-1)
}

/// Reads the arguments Slurm passes to a callback. A plugstack.conf line
/// with no arguments comes as `argc == 0` and `argv` NULL (`_spank_plugin_create`,
/// `src/common/plugstack.c`): slurm-spank 0.2.4's `plugin_argv` then makes a
/// slice from a NULL pointer, which is undefined behaviour (debug builds
/// abort, taking slurmd down), so the plugin reads them itself.
///
/// # Safety
/// `argv` is NULL or points to `ac` pointers, each NULL or to a
/// NUL-terminated string, valid for the call.
pub(crate) unsafe fn raw_plugin_args(
    ac: c_int,
    argv: *const *const c_char,
) -> Result<PluginArgs, PluginArgsError> {
    if ac <= 0 || argv.is_null() {
        return Ok(PluginArgs::default());
    }
    let mut words = Vec::new();
    for i in 0..ac as usize {
        // SAFETY: i < ac, as the caller promises.
        let p = unsafe { *argv.add(i) };
        if p.is_null() {
            continue;
        }
        // SAFETY: a NUL-terminated string, as the caller promises.
        let w = unsafe { std::ffi::CStr::from_ptr(p) };
        words.push(
            w.to_str()
                .map_err(|_| PluginArgsError::NotUtf8(w.to_owned()))?
                .to_string(),
        );
    }
    PluginArgs::parse(words.iter().map(String::as_str))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    #[test]
    fn raw_args_without_any() {
        // A plugstack.conf line with no arguments: argc 0, argv NULL.
        // SAFETY: NULL argv with argc 0 is what the function handles.
        let a = unsafe { raw_plugin_args(0, std::ptr::null()) };
        assert_eq!(a, Ok(PluginArgs::default()));
        let words = [c"config=/etc/x.toml".as_ptr(), c"mode=audit".as_ptr()];
        // SAFETY: two valid C strings.
        let a = unsafe { raw_plugin_args(2, words.as_ptr()) }.unwrap();
        assert_eq!(
            (a.config, a.mode),
            (
                Some(PathBuf::from("/etc/x.toml")),
                Some(gpufence_model::config::Mode::Audit)
            )
        );
        let bad = [c"cfg=/x".as_ptr()];
        // SAFETY: one valid C string.
        assert!(unsafe { raw_plugin_args(1, bad.as_ptr()) }.is_err());
        let not_utf8 = [c"config=/\xff".as_ptr()];
        // SAFETY: one valid C string.
        let a = unsafe { raw_plugin_args(1, not_utf8.as_ptr()) };
        assert!(matches!(a, Err(PluginArgsError::NotUtf8(_))), "{a:?}");
    }
}
