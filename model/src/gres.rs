//! `slurmd -G` output and GRES index lists (`SLURM_JOB_GPUS`).
//!
//! The GRES index of a GPU is its position among the `Name=gpu` lines that
//! `slurmd -G` prints, counting from 0 (`../shared/domain/slurm.md`). The
//! `Index=` field on those lines is *not* that index: `_log_gres_slurmd_conf`
//! (`src/common/gres.c` 22.05, `src/interfaces/gres.c` 24.11) prints the
//! number at the end of the `File=` string, so it is ignored here.
//!
//! Line shapes, by version:
//! - 22.05: `slurmd: Gres Name=gpu Type=(null) Count=1 Index=0 ID=7696487 File=/dev/nvidia0 (null)`
//! - 24.11+: `... File=/dev/nvidia0,/dev/nvidia-caps/nvidia-cap21 Links=(null) Flags=HAS_FILE,...`
//!
//! `File=` may be a comma list (MIG: parent GPU, GI cap, CI cap; or
//! `MultipleFiles=` in gres.conf) and may hold hostlist brackets
//! (`/dev/nvidia[0-3]`). A record with `Count=1` is one device that owns all
//! its files; a record with `Count=N>1` and exactly N files is N devices, one
//! file each, in order.

use std::path::{Path, PathBuf};

use crate::error::ParseError;

/// The most files one `File=` expression may expand to. A bound against a
/// corrupt or hostile input such as `nvidia[0-4294967295]`.
pub const MAX_FILES_PER_RECORD: usize = 4096;

/// One GPU as slurmd numbers it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GresDevice {
    /// The GRES index: position among `Name=gpu` devices, from 0.
    pub index: u32,
    /// `Type=` (e.g. `a100_3g.20gb`); `None` for `(null)`.
    pub gres_type: Option<String>,
    /// The device files that make up this GPU: one for a whole GPU, three
    /// (parent, GI cap, CI cap) for a MIG slice.
    pub files: Vec<PathBuf>,
}

/// Parses `slurmd -G` output read from `source` into the node's GPUs in
/// GRES-index order. Lines that are not `Gres Name=...` records (log noise)
/// and records of other GRES names (`mps`, `shard`, `nic`) are skipped.
///
/// # Errors
/// A [`ParseError`] naming `source` and the line when a `gpu` record has no
/// `File=`, a malformed `Count=` or bracket expression, or a count that does
/// not match its files.
pub fn parse_slurmd_g(text: &str, source: &Path) -> Result<Vec<GresDevice>, ParseError> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        let line = line
            .strip_prefix("slurmd:")
            .map(str::trim_start)
            .unwrap_or(line);
        let Some(rest) = line.strip_prefix("Gres ") else {
            continue;
        };
        let err = |msg: String| ParseError::new(source, i + 1, msg);
        let mut name = None;
        let mut gres_type = None;
        let mut count: Option<u64> = None;
        let mut file = None;
        for tok in rest.split_whitespace() {
            let Some((k, v)) = tok.split_once('=') else {
                continue; // "(null)" printed for empty Links in 22.05
            };
            match k {
                "Name" => name = Some(v),
                "Type" => gres_type = (v != "(null)").then(|| v.to_string()),
                "Count" => {
                    count = Some(
                        v.parse()
                            .map_err(|_| err(format!("Count={v:?} is not a number")))?,
                    )
                }
                "File" => file = Some(v),
                _ => {}
            }
        }
        if name != Some("gpu") {
            continue;
        }
        let count = count.ok_or_else(|| err("gpu record without Count=".into()))?;
        let file = file.filter(|f| *f != "(null)").ok_or_else(|| {
            err("gpu record without File=: the fence cannot grant a GPU it cannot name".into())
        })?;
        let files = expand_file_list(file).map_err(err)?;
        let next = |out: &Vec<GresDevice>| -> Result<u32, ParseError> {
            u32::try_from(out.len()).map_err(|_| err("too many GPUs".into()))
        };
        if count == 1 {
            out.push(GresDevice {
                index: next(&out)?,
                gres_type,
                files,
            });
        } else if count as usize == files.len() {
            for f in files {
                out.push(GresDevice {
                    index: next(&out)?,
                    gres_type: gres_type.clone(),
                    files: vec![f],
                });
            }
        } else {
            return Err(err(format!(
                "Count={count} but File={file} names {} files",
                files.len()
            )));
        }
    }
    Ok(out)
}

/// Expands a `File=` value: a comma list whose items may hold one hostlist
/// bracket (`/dev/nvidia[0-1,3]`), in order.
///
/// # Errors
/// A message for an unbalanced bracket, a bad range, or more than
/// [`MAX_FILES_PER_RECORD`] files.
pub fn expand_file_list(s: &str) -> Result<Vec<PathBuf>, String> {
    let mut out = Vec::new();
    for item in split_top_level(s)? {
        if item.is_empty() {
            return Err(format!("empty file name in {s:?}"));
        }
        match item.find('[') {
            None => out.push(PathBuf::from(item)),
            Some(open) => {
                let close = item[open..]
                    .find(']')
                    .map(|c| c + open)
                    .ok_or_else(|| format!("unbalanced '[' in {item:?}"))?;
                let (prefix, body, suffix) =
                    (&item[..open], &item[open + 1..close], &item[close + 1..]);
                if suffix.contains('[') || suffix.contains(']') {
                    return Err(format!("more than one bracket in {item:?}"));
                }
                for n in expand_numbers(body).map_err(|e| format!("{e} in {item:?}"))? {
                    out.push(PathBuf::from(format!("{prefix}{n}{suffix}")));
                    if out.len() > MAX_FILES_PER_RECORD {
                        return Err(format!(
                            "{s:?} expands to more than {MAX_FILES_PER_RECORD} files"
                        ));
                    }
                }
            }
        }
        if out.len() > MAX_FILES_PER_RECORD {
            return Err(format!(
                "{s:?} names more than {MAX_FILES_PER_RECORD} files"
            ));
        }
    }
    Ok(out)
}

/// Splits on commas outside brackets.
fn split_top_level(s: &str) -> Result<Vec<&str>, String> {
    let mut parts = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => {
                depth = depth
                    .checked_sub(1)
                    .ok_or_else(|| format!("unbalanced ']' in {s:?}"))?
            }
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(format!("unbalanced '[' in {s:?}"));
    }
    parts.push(&s[start..]);
    Ok(parts)
}

/// Expands `0-2,5` into numbers, keeping zero padding (`01-03` → `01 02 03`).
fn expand_numbers(body: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for part in body.split(',') {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let width = lo.len();
        let a: u32 = lo.parse().map_err(|_| format!("bad number {lo:?}"))?;
        let b: u32 = hi.parse().map_err(|_| format!("bad number {hi:?}"))?;
        if b < a {
            return Err(format!("descending range {part:?}"));
        }
        if (b - a) as usize >= MAX_FILES_PER_RECORD {
            return Err(format!(
                "range {part:?} is longer than {MAX_FILES_PER_RECORD}"
            ));
        }
        for n in a..=b {
            out.push(format!("{n:0width$}"));
        }
    }
    Ok(out)
}

/// Parses a GRES index list as slurmd sets it in the Prolog environment
/// (`SLURM_JOB_GPUS=0,2`; `src/plugins/gres/common/gres_common.c`,
/// `gres_common_epilog_set_env`, joins indices with commas). Ranges (`0-3`)
/// are accepted too. An empty or absent value means no GPUs. Duplicates are
/// removed; order is kept.
///
/// # Errors
/// A [`ParseError`] naming `var` for anything that is not a number, a range
/// or a comma, and for more than [`MAX_FILES_PER_RECORD`] indices.
pub fn parse_index_list(value: &str, var: &str) -> Result<Vec<u32>, ParseError> {
    let mut out: Vec<u32> = Vec::new();
    let v = value.trim();
    if v.is_empty() {
        return Ok(out);
    }
    for part in v.split(',') {
        let part = part.trim();
        let bad = || {
            ParseError::new(
                var,
                0,
                format!("{part:?} in {value:?} is not a GRES index or range"),
            )
        };
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let valid = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !valid(lo) || !valid(hi) {
            return Err(bad());
        }
        let a: u32 = lo.parse().map_err(|_| bad())?;
        let b: u32 = hi.parse().map_err(|_| bad())?;
        if b < a || (b - a) as usize >= MAX_FILES_PER_RECORD {
            return Err(bad());
        }
        for n in a..=b {
            if !out.contains(&n) {
                out.push(n);
            }
            if out.len() > MAX_FILES_PER_RECORD {
                return Err(ParseError::new(var, 0, "too many GRES indices"));
            }
        }
    }
    Ok(out)
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

    fn paths(v: &[&str]) -> Vec<PathBuf> {
        v.iter().map(PathBuf::from).collect()
    }

    #[test]
    fn plain_22_05_output() {
        let g = parse_slurmd_g(&case("slurmd-G-plain.txt"), Path::new("x")).unwrap();
        assert_eq!(g.len(), 2);
        assert_eq!((g[0].index, &g[0].files), (0, &paths(&["/dev/nvidia0"])));
        assert_eq!((g[1].index, &g[1].files), (1, &paths(&["/dev/nvidia1"])));
        assert_eq!(g[0].gres_type, None);
    }

    #[test]
    fn mig_output_index_is_position_not_printed_index() {
        let g = parse_slurmd_g(&case("slurmd-G-mig.txt"), Path::new("x")).unwrap();
        assert_eq!(g.len(), 3);
        // printed Index=22 for the first line: its GRES index is 0
        assert_eq!(g[0].index, 0);
        assert_eq!(
            g[0].files,
            paths(&[
                "/dev/nvidia0",
                "/dev/nvidia-caps/nvidia-cap21",
                "/dev/nvidia-caps/nvidia-cap22"
            ])
        );
        assert_eq!(g[0].gres_type.as_deref(), Some("a100_3g.20gb"));
        assert_eq!(g[1].index, 1);
        assert_eq!(
            g[1].files[2],
            PathBuf::from("/dev/nvidia-caps/nvidia-cap31")
        );
        // printed Index=1 on the third line: its GRES index is 2
        assert_eq!((g[2].index, &g[2].files), (2, &paths(&["/dev/nvidia1"])));
    }

    #[test]
    fn order_follows_lines_not_names() {
        let text = "slurmd: Gres Name=gpu Type=(null) Count=1 Index=3 ID=1 File=/dev/nvidia3 (null)\n\
                    slurmd: Gres Name=mps Type=(null) Count=100 Index=3 ID=2 File=/dev/nvidia3 (null)\n\
                    slurmd: Gres Name=gpu Type=(null) Count=1 Index=1 ID=1 File=/dev/nvidia1 (null)\n";
        let g = parse_slurmd_g(text, Path::new("x")).unwrap();
        assert_eq!(g[0].files, paths(&["/dev/nvidia3"]));
        assert_eq!(g[1].files, paths(&["/dev/nvidia1"]));
        assert_eq!(g.len(), 2, "mps records are not GPUs");
    }

    #[test]
    fn counted_range_splits_into_devices() {
        let text = "Gres Name=gpu Type=sim Count=3 Index=2 ID=1 File=/d/nvidia[0-2] (null)";
        let g = parse_slurmd_g(text, Path::new("x")).unwrap();
        assert_eq!(g.iter().map(|d| d.index).collect::<Vec<_>>(), vec![0, 1, 2]);
        assert_eq!(g[2].files, paths(&["/d/nvidia2"]));
        assert_eq!(g[2].gres_type.as_deref(), Some("sim"));
    }

    #[test]
    fn mismatched_count_and_missing_file_are_errors() {
        let e =
            parse_slurmd_g("Gres Name=gpu Count=2 File=/d/nvidia0", Path::new("G")).unwrap_err();
        assert_eq!(e.line, 1);
        assert!(e.msg.contains("Count=2"), "{e}");
        let e = parse_slurmd_g("x\nGres Name=gpu Count=1 ID=1 (null)", Path::new("G")).unwrap_err();
        assert_eq!(e.line, 2);
        assert!(parse_slurmd_g("Gres Name=gpu Count=1 File=/d/n[0-", Path::new("G")).is_err());
        assert!(parse_slurmd_g("Gres Name=gpu Count=x File=/d/n0", Path::new("G")).is_err());
    }

    #[test]
    fn brackets_and_padding() {
        assert_eq!(
            expand_file_list("/d/a[01-03],/d/b,/d/c[5,7]").unwrap(),
            paths(&["/d/a01", "/d/a02", "/d/a03", "/d/b", "/d/c5", "/d/c7"])
        );
        assert!(expand_file_list("/d/a[0-4294967295]").is_err());
        assert!(expand_file_list("/d/a]").is_err());
        assert!(expand_file_list("/d/a,,/d/b").is_err());
    }

    #[test]
    fn index_lists() {
        assert_eq!(
            parse_index_list("0,2", "SLURM_JOB_GPUS").unwrap(),
            vec![0, 2]
        );
        assert_eq!(parse_index_list("1-3,1", "V").unwrap(), vec![1, 2, 3]);
        assert_eq!(parse_index_list("", "V").unwrap(), Vec::<u32>::new());
        for bad in [
            "-1",
            "0,,1",
            "a",
            "0x1",
            "1-",
            "3-1",
            "0-99999999",
            "GPU-123",
            "1 2",
        ] {
            let e = parse_index_list(bad, "SLURM_JOB_GPUS").unwrap_err();
            assert!(
                e.to_string().starts_with("SLURM_JOB_GPUS:0: "),
                "{bad}: {e}"
            );
        }
    }

    proptest::proptest! {
        #[test]
        fn parsers_never_panic(s in "\\PC*") {
            if let Err(e) = parse_slurmd_g(&s, Path::new("fuzz")) {
                proptest::prop_assert_eq!(e.source_name.as_path(), Path::new("fuzz"));
                proptest::prop_assert!(e.line >= 1 && e.line <= s.lines().count(), "{}", e);
            }
            if let Err(e) = parse_index_list(&s, "V") {
                proptest::prop_assert!(e.to_string().starts_with("V:0: "), "{}", e);
            }
            let _ = expand_file_list(&s);
        }

        /// Records of `slurmd -G` with faults: parsed, or an error naming
        /// the file and the line of the faulty gpu record.
        #[test]
        fn faulty_records_name_their_line(
            recs in proptest::collection::vec(
                (
                    proptest::sample::select(vec!["gpu", "mps", "shard"]),
                    proptest::sample::select(vec!["1", "2", "0", "x", "-1", "99999999999999999999"]),
                    proptest::sample::select(vec![
                        "/dev/nvidia0", "/dev/nvidia[0-1]", "/dev/nvidia[1-0]", "(null)",
                        "/dev/nvidia0,/dev/nvidia-caps/nvidia-cap1", "/dev/nvidia[0-",
                        "/dev/nvidia[0-99999]", "",
                    ]),
                ),
                0..8,
            )
        ) {
            let text: String = recs
                .iter()
                .map(|(n, c, f)| format!("slurmd: Gres Name={n} Type=(null) Count={c} Index=0 ID=1 File={f} (null)\n"))
                .collect();
            match parse_slurmd_g(&text, Path::new("/run/gpufence/slurmd-G.txt")) {
                Ok(devs) => proptest::prop_assert!(devs.iter().enumerate().all(|(i, d)| d.index as usize == i)),
                Err(e) => {
                    proptest::prop_assert!(e.to_string().starts_with("/run/gpufence/slurmd-G.txt:"), "{}", e);
                    // A gpu record, or any record whose Count= is not a
                    // number (refused too: slurmd never prints one).
                    let (name, count, _) = recs[e.line - 1];
                    proptest::prop_assert!(name == "gpu" || count.parse::<u64>().is_err(), "{}", e);
                }
            }
        }

        #[test]
        fn gres_lines_never_panic(files in "[/a-z0-9\\[\\],-]{0,40}", count in 0u64..6) {
            let line = format!("slurmd: Gres Name=gpu Type=(null) Count={count} Index=0 ID=1 File={files} (null)");
            let _ = parse_slurmd_g(&line, Path::new("fuzz"));
        }
    }
}
