//! `/proc/devices` and the set of NVIDIA majors the fence protects.
//!
//! `/proc/devices` (`fs/proc/devices.c`) lists `Character devices:` then
//! `Block devices:`, one `<major> <name>` per line, right-aligned majors.
//! Several names may share one major: driver 550 prints `195 nvidia` and
//! `195 nvidiactl` where older drivers printed `195 nvidia-frontend`
//! (`testdata/cases/proc-devices-driver550.txt`, `proc-devices-legacy.txt`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use crate::device::{DevNum, MAX_MAJOR};
use crate::error::ParseError;

/// The parsed character-device section of `/proc/devices`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcDevices {
    /// `(major, name)` of every character device driver, in file order.
    pub char_devices: Vec<(u32, String)>,
}

/// Parses `/proc/devices` text read from `source` (named in errors).
///
/// # Errors
/// A [`ParseError`] naming `source` and the line for a line that is not
/// `<major> <name>`, a major above [`MAX_MAJOR`], or text before the first
/// section header.
pub fn parse_proc_devices(text: &str, source: &Path) -> Result<ProcDevices, ParseError> {
    #[derive(PartialEq)]
    enum Section {
        None,
        Char,
        Block,
    }
    let mut section = Section::None;
    let mut out = ProcDevices::default();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        match line {
            "Character devices:" => {
                section = Section::Char;
                continue;
            }
            "Block devices:" => {
                section = Section::Block;
                continue;
            }
            _ => {}
        }
        if section == Section::None {
            return Err(ParseError::new(
                source,
                i + 1,
                format!("expected a section header, found {line:?}"),
            ));
        }
        let (num, name) = line.split_once(char::is_whitespace).ok_or_else(|| {
            ParseError::new(
                source,
                i + 1,
                format!("expected \"<major> <name>\", found {line:?}"),
            )
        })?;
        let major: u32 = num.parse().map_err(|_| {
            ParseError::new(source, i + 1, format!("major {num:?} is not a number"))
        })?;
        if major > MAX_MAJOR {
            return Err(ParseError::new(
                source,
                i + 1,
                format!("major {major} is above the kernel's limit {MAX_MAJOR}"),
            ));
        }
        if section == Section::Char {
            out.char_devices.push((major, name.trim().to_string()));
        }
    }
    Ok(out)
}

/// The NVIDIA majors the fence protects: major → the driver names that use it.
///
/// Built from `/proc/devices` (every character driver whose name starts with
/// `nvidia`) or from the config's `[majors]` table, which replaces discovery.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProtectedMajors {
    by_major: BTreeMap<u32, BTreeSet<String>>,
}

/// Fixed major of `/dev/nvidia*` and `/dev/nvidiactl` (NVIDIA's
/// `NV_MAJOR_DEVICE_NUMBER`, `kernel-open/common/inc/nv.h`).
pub const NVIDIA_MAJOR: u32 = 195;
/// Minor of `/dev/nvidiactl` (`NV_CONTROL_DEVICE_MINOR`, same header).
pub const NVIDIACTL_MINOR: u32 = 255;
/// Minor of `/dev/nvidia-uvm` on the `nvidia-uvm` major.
pub const UVM_MINOR: u32 = 0;
/// Minor of `/dev/nvidia-uvm-tools` on the `nvidia-uvm` major.
pub const UVM_TOOLS_MINOR: u32 = 1;

impl ProtectedMajors {
    /// Every character driver of `devices` whose name starts with `nvidia`,
    /// and always [`NVIDIA_MAJOR`]: it is fixed, so a node whose driver is
    /// not loaded yet (or a CPU node) still has `/dev/nvidia*` fenced the
    /// moment the driver appears. The dynamic majors (uvm, caps, nvswitch)
    /// are only known once registered: reinstall the fence after loading
    /// the driver (the systemd unit orders itself after it).
    pub fn from_proc_devices(devices: &ProcDevices) -> Self {
        let mut by_major: BTreeMap<u32, BTreeSet<String>> = BTreeMap::new();
        for (major, name) in &devices.char_devices {
            if name.starts_with("nvidia") {
                by_major.entry(*major).or_default().insert(name.clone());
            }
        }
        by_major
            .entry(NVIDIA_MAJOR)
            .or_insert_with(|| BTreeSet::from(["nvidia".to_string()]));
        ProtectedMajors { by_major }
    }

    /// The config's `[majors]` table (`name = major`), taken as is: it may
    /// name majors that are not NVIDIA's (tests protect spare majors).
    pub fn from_table(table: &BTreeMap<String, u32>) -> Self {
        let mut by_major: BTreeMap<u32, BTreeSet<String>> = BTreeMap::new();
        for (name, major) in table {
            by_major.entry(*major).or_default().insert(name.clone());
        }
        ProtectedMajors { by_major }
    }

    /// The protected majors, ascending.
    pub fn majors(&self) -> impl Iterator<Item = u32> + '_ {
        self.by_major.keys().copied()
    }

    /// Whether `major` is protected.
    pub fn contains(&self, major: u32) -> bool {
        self.by_major.contains_key(&major)
    }

    /// Whether nothing is protected (no NVIDIA driver loaded and no table).
    pub fn is_empty(&self) -> bool {
        self.by_major.is_empty()
    }

    /// The names sharing `major`.
    pub fn names(&self, major: u32) -> impl Iterator<Item = &str> + '_ {
        self.by_major
            .get(&major)
            .into_iter()
            .flat_map(|s| s.iter().map(String::as_str))
    }

    /// The major a driver name is registered under.
    pub fn major_of(&self, name: &str) -> Option<u32> {
        self.by_major
            .iter()
            .find(|(_, names)| names.contains(name))
            .map(|(m, _)| *m)
    }

    /// `major -> [names]`, for status output.
    pub fn as_map(&self) -> &BTreeMap<u32, BTreeSet<String>> {
        &self.by_major
    }

    /// The control devices a CUDA program opens besides its GPUs, by number:
    /// `nvidiactl` (195:255, or the major named `nvidiactl` /
    /// `nvidia-frontend` / `nvidia` when the table says otherwise),
    /// `nvidia-uvm` (uvm:0) and `nvidia-uvm-tools` (uvm:1).
    ///
    /// Returns `(name, number)` pairs and, separately, the names that could
    /// not be numbered because their major is unknown on this node.
    pub fn control_devices(&self) -> (Vec<(&'static str, DevNum)>, Vec<&'static str>) {
        let ctl_major = ["nvidiactl", "nvidia-frontend", "nvidia"]
            .iter()
            .find_map(|n| self.major_of(n))
            .unwrap_or(NVIDIA_MAJOR);
        let mut found = vec![("nvidiactl", DevNum::new(ctl_major, NVIDIACTL_MINOR))];
        let mut missing = Vec::new();
        match self.major_of("nvidia-uvm") {
            Some(uvm) => {
                found.push(("nvidia-uvm", DevNum::new(uvm, UVM_MINOR)));
                found.push(("nvidia-uvm-tools", DevNum::new(uvm, UVM_TOOLS_MINOR)));
            }
            None => missing.extend(["nvidia-uvm", "nvidia-uvm-tools"]),
        }
        (found, missing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case(name: &str) -> String {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../testdata/cases")
            .join(name);
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    #[test]
    fn driver550_shares_195_between_two_names() {
        let d = parse_proc_devices(&case("proc-devices-driver550.txt"), Path::new("x")).unwrap();
        let p = ProtectedMajors::from_proc_devices(&d);
        assert_eq!(
            p.majors().collect::<Vec<_>>(),
            vec![195, 234, 235, 236, 237, 509]
        );
        assert_eq!(
            p.names(195).collect::<Vec<_>>(),
            vec!["nvidia", "nvidiactl"]
        );
        assert_eq!(p.major_of("nvidia-uvm"), Some(509));
        assert_eq!(p.major_of("nvidia-caps-imex-channels"), Some(236));
        // block major 8 and char "drm" 226 are not protected
        assert!(!p.contains(226) && !p.contains(8));
        let (ctl, missing) = p.control_devices();
        assert_eq!(
            ctl,
            vec![
                ("nvidiactl", DevNum::new(195, 255)),
                ("nvidia-uvm", DevNum::new(509, 0)),
                ("nvidia-uvm-tools", DevNum::new(509, 1)),
            ]
        );
        assert!(missing.is_empty());
    }

    #[test]
    fn legacy_frontend_and_other_uvm_major() {
        let d = parse_proc_devices(&case("proc-devices-legacy.txt"), Path::new("x")).unwrap();
        let p = ProtectedMajors::from_proc_devices(&d);
        assert_eq!(p.majors().collect::<Vec<_>>(), vec![195, 238, 510, 511]);
        assert_eq!(p.names(195).collect::<Vec<_>>(), vec!["nvidia-frontend"]);
        let (ctl, _) = p.control_devices();
        assert_eq!(ctl[0].1, DevNum::new(195, 255));
        assert_eq!(ctl[1].1, DevNum::new(510, 0));
    }

    #[test]
    fn a_node_without_the_driver_still_fences_195() {
        let d =
            parse_proc_devices("Character devices:\n  1 mem\n 10 misc\n", Path::new("x")).unwrap();
        let p = ProtectedMajors::from_proc_devices(&d);
        assert_eq!(p.majors().collect::<Vec<_>>(), vec![195]);
        assert_eq!(p.major_of("nvidia"), Some(195));
    }

    #[test]
    fn no_uvm_major_is_reported_missing() {
        let table = BTreeMap::from([("nvidia".to_string(), 195)]);
        let (ctl, missing) = ProtectedMajors::from_table(&table).control_devices();
        assert_eq!(ctl, vec![("nvidiactl", DevNum::new(195, 255))]);
        assert_eq!(missing, vec!["nvidia-uvm", "nvidia-uvm-tools"]);
    }

    #[test]
    fn malformed_lines_name_file_and_line() {
        let e = parse_proc_devices(
            "Character devices:\n  1 mem\nxyz\n",
            Path::new("/proc/devices"),
        )
        .unwrap_err();
        assert_eq!(e.line, 3);
        assert_eq!(
            e.to_string(),
            "/proc/devices:3: expected \"<major> <name>\", found \"xyz\""
        );
        let e = parse_proc_devices("Character devices:\n9999 big\n", Path::new("p")).unwrap_err();
        assert!(e.msg.contains("above"), "{e}");
        let e = parse_proc_devices("  1 mem\n", Path::new("p")).unwrap_err();
        assert_eq!(e.line, 1);
    }

    proptest::proptest! {
        #[test]
        fn parser_never_panics(s in "\\PC*") {
            if let Err(e) = parse_proc_devices(&s, Path::new("fuzz")) {
                proptest::prop_assert_eq!(e.source_name.as_path(), Path::new("fuzz"));
                proptest::prop_assert!(e.line >= 1 && e.line <= s.lines().count(), "{}", e);
            }
        }

        /// Lines shaped like the real file, some of them wrong: parsed, or
        /// an error naming the file and the offending line.
        #[test]
        fn near_misses_name_the_line(
            lines in proptest::collection::vec(
                proptest::prop_oneof![
                    proptest::strategy::Just("Character devices:".to_string()),
                    proptest::strategy::Just("Block devices:".to_string()),
                    proptest::strategy::Strategy::prop_map(
                        (0u32..5000, "[a-z][a-z0-9_-]{0,12}"),
                        |(m, n)| format!("{m:>3} {n}"),
                    ),
                    "[ -~]{0,16}",
                ],
                0..12,
            )
        ) {
            let text = lines.join("\n");
            match parse_proc_devices(&text, Path::new("/proc/devices")) {
                Ok(p) => proptest::prop_assert!(p.char_devices.iter().all(|(m, _)| *m <= MAX_MAJOR)),
                Err(e) => {
                    proptest::prop_assert!(e.to_string().starts_with("/proc/devices:"), "{}", e);
                    let bad = lines[e.line - 1].trim();
                    proptest::prop_assert!(!bad.is_empty() && !bad.ends_with("devices:"), "{}", e);
                }
            }
        }
    }
}
