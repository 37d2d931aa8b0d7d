//! `CUDA_VISIBLE_DEVICES`, in every form Slurm and CUDA use.
//!
//! A comma list whose items are, per the CUDA C Programming Guide
//! ("CUDA Environment Variables") and NVIDIA's MIG User Guide ("CUDA Device
//! Enumeration"):
//!
//! - `N`: a device ordinal (Slurm writes GRES indices, renumbered 0..n-1 in
//!   steps under ConstrainDevices);
//! - `GPU-<uuid>`: a whole GPU by UUID;
//! - `MIG-<uuid>`: a MIG compute instance by UUID (R470+ drivers);
//! - `MIG-GPU-<uuid>/<gi>/<ci>`: a MIG compute instance by parent UUID and
//!   GPU/compute instance ids (drivers before R470).
//!
//! A value that does not parse is an error, never a guess: gpufence never
//! grants from this variable, but it reports it, and a malformed one in
//! slurmd's Prolog environment is a node problem.

use std::fmt;

use crate::error::ParseError;

/// One item of `CUDA_VISIBLE_DEVICES`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VisibleDevice {
    /// A device ordinal.
    Index(u32),
    /// `GPU-<uuid>` (the whole string, with its prefix).
    GpuUuid(String),
    /// `MIG-<uuid>`.
    MigUuid(String),
    /// `MIG-GPU-<uuid>/<gi>/<ci>`: the parent's `GPU-<uuid>` and the ids.
    MigLegacy {
        /// `GPU-<uuid>` of the parent.
        gpu_uuid: String,
        /// GPU instance id.
        gi: u32,
        /// Compute instance id.
        ci: u32,
    },
}

impl fmt::Display for VisibleDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VisibleDevice::Index(i) => write!(f, "{i}"),
            VisibleDevice::GpuUuid(u) | VisibleDevice::MigUuid(u) => f.write_str(u),
            VisibleDevice::MigLegacy { gpu_uuid, gi, ci } => write!(f, "MIG-{gpu_uuid}/{gi}/{ci}"),
        }
    }
}

/// Whether `s` is a UUID body: 8-4-4-4-12 hex digits.
fn is_uuid(s: &str) -> bool {
    let parts: Vec<&str> = s.split('-').collect();
    parts.len() == 5
        && parts
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(p, n)| p.len() == n && p.bytes().all(|b| b.is_ascii_hexdigit()))
}

fn parse_item(item: &str) -> Option<VisibleDevice> {
    if !item.is_empty() && item.bytes().all(|b| b.is_ascii_digit()) {
        return item.parse().ok().map(VisibleDevice::Index);
    }
    if let Some(rest) = item.strip_prefix("MIG-GPU-") {
        let mut it = rest.split('/');
        let (uuid, gi, ci) = (it.next()?, it.next()?, it.next()?);
        if it.next().is_some() || !is_uuid(uuid) {
            return None;
        }
        let num = |s: &str| {
            (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                .then(|| s.parse().ok())
                .flatten()
        };
        return Some(VisibleDevice::MigLegacy {
            gpu_uuid: format!("GPU-{uuid}"),
            gi: num(gi)?,
            ci: num(ci)?,
        });
    }
    if let Some(rest) = item.strip_prefix("MIG-") {
        return is_uuid(rest).then(|| VisibleDevice::MigUuid(item.to_string()));
    }
    if let Some(rest) = item.strip_prefix("GPU-") {
        return is_uuid(rest).then(|| VisibleDevice::GpuUuid(item.to_string()));
    }
    None
}

/// Parses a `CUDA_VISIBLE_DEVICES` value read from `var`. Empty means none.
///
/// # Errors
/// A [`ParseError`] naming `var` and the item that does not parse.
pub fn parse_visible_devices(value: &str, var: &str) -> Result<Vec<VisibleDevice>, ParseError> {
    let v = value.trim();
    if v.is_empty() {
        return Ok(Vec::new());
    }
    v.split(',')
        .map(|item| {
            parse_item(item.trim()).ok_or_else(|| {
                ParseError::new(
                    var,
                    0,
                    format!("{item:?} is not a device index, GPU-<uuid>, MIG-<uuid> or MIG-GPU-<uuid>/<gi>/<ci>"),
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const U: &str = "4a3b2c1d-0000-1111-2222-333344445555";

    #[test]
    fn every_form() {
        let v = format!("0,GPU-{U},MIG-{U},MIG-GPU-{U}/1/0, 3");
        let got = parse_visible_devices(&v, "CUDA_VISIBLE_DEVICES").unwrap();
        assert_eq!(
            got,
            vec![
                VisibleDevice::Index(0),
                VisibleDevice::GpuUuid(format!("GPU-{U}")),
                VisibleDevice::MigUuid(format!("MIG-{U}")),
                VisibleDevice::MigLegacy {
                    gpu_uuid: format!("GPU-{U}"),
                    gi: 1,
                    ci: 0
                },
                VisibleDevice::Index(3),
            ]
        );
        assert_eq!(got[3].to_string(), format!("MIG-GPU-{U}/1/0"));
        assert!(parse_visible_devices("", "V").unwrap().is_empty());
    }

    #[test]
    fn anything_else_is_an_error() {
        for bad in [
            "-1",
            "0,,1",
            "GPU-123",
            "GPU-zzzzzzzz-0000-1111-2222-333344445555",
            &format!("MIG-GPU-{U}/1"),
            &format!("MIG-GPU-{U}/1/0/2"),
            &format!("MIG-GPU-{U}/a/0"),
            &format!("gpu-{U}"),
            "NoDevFiles",
            "0x1",
            "1 2",
        ] {
            let e = parse_visible_devices(bad, "CUDA_VISIBLE_DEVICES").unwrap_err();
            assert!(
                e.to_string().starts_with("CUDA_VISIBLE_DEVICES:0: "),
                "{bad}: {e}"
            );
        }
    }

    proptest::proptest! {
        #[test]
        fn never_panics(s in "\\PC*") {
            let _ = parse_visible_devices(&s, "V");
        }
    }
}
