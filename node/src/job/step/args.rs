//! The plugin's plugstack.conf arguments: `config=PATH`, `mode=audit|enforce`;
//! anything else is an error (the plugin then fails its callback).

use std::path::PathBuf;

use gpufence_model::config::Mode;

/// Why the plugstack.conf arguments are refused; the plugin then fails the
/// callback with this message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PluginArgsError {
    /// An argument that is not `config=PATH` (PATH not empty),
    /// `mode=audit` or `mode=enforce`.
    #[error("unknown plugstack.conf argument {0:?} (known: config=PATH, mode=audit|enforce)")]
    Unknown(String),
    /// An argument that is not UTF-8 (the plugin finds it reading Slurm's
    /// `argv`).
    #[error("plugstack.conf argument {0:?} is not UTF-8")]
    NotUtf8(std::ffi::CString),
}

/// Arguments from plugstack.conf (`required|optional PATH/gpufence.so
/// ARGS...`, `spank(8)`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PluginArgs {
    /// `config=PATH`: gpufence.toml (else `$GPUFENCE_CONFIG`, else the
    /// default path, [`crate::Node::load`]).
    pub config: Option<PathBuf>,
    /// `mode=audit|enforce`: overrides the config's `mode` for the fence the
    /// plugin installs at slurmd start.
    pub mode: Option<Mode>,
}

impl PluginArgs {
    /// Parses `key=value` arguments, in order (a key given twice: the
    /// last wins).
    ///
    /// # Errors
    /// [`PluginArgsError::Unknown`] naming the first unknown or malformed
    /// argument.
    pub fn parse<'a>(argv: impl IntoIterator<Item = &'a str>) -> Result<Self, PluginArgsError> {
        let mut a = PluginArgs::default();
        for arg in argv {
            match arg.split_once('=') {
                Some(("config", v)) if !v.is_empty() => a.config = Some(PathBuf::from(v)),
                Some(("mode", "audit")) => a.mode = Some(Mode::Audit),
                Some(("mode", "enforce")) => a.mode = Some(Mode::Enforce),
                _ => return Err(PluginArgsError::Unknown(arg.to_string())),
            }
        }
        Ok(a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args() {
        assert_eq!(PluginArgs::parse([]).unwrap(), PluginArgs::default());
        assert_eq!(
            PluginArgs::parse(["config=/etc/x.toml"]).unwrap().config,
            Some(PathBuf::from("/etc/x.toml"))
        );
        assert_eq!(
            PluginArgs::parse(["mode=audit"]).unwrap().mode,
            Some(Mode::Audit)
        );
        assert_eq!(
            PluginArgs::parse(["mode=audit", "mode=enforce"])
                .unwrap()
                .mode,
            Some(Mode::Enforce)
        );
        for bad in ["config=", "cfg=/x", "config", "mode=watch", "mode="] {
            assert_eq!(
                PluginArgs::parse([bad]),
                Err(PluginArgsError::Unknown(bad.into())),
                "{bad}"
            );
        }
        assert_eq!(
            PluginArgsError::Unknown("x".into()).to_string(),
            "unknown plugstack.conf argument \"x\" (known: config=PATH, mode=audit|enforce)"
        );
    }
}
