//! `slurmd -G` output and GRES index lists (`SLURM_JOB_GPUS`).
//!
//! The GRES index of a GPU is its position among the `Name=gpu` lines that
//! `slurmd -G` prints, counting from 0: slurmd numbers the devices of its
//! final GRES list in order (`src/common/gres.c` 22.05,
//! `src/interfaces/gres.c` 24.11+), and a job given `SLURM_JOB_GPUS=0` by
//! Slurm's own ConstrainDevices opens the first listed file (seen on 22.05
//! with a gres.conf listing `nvidia3` before `nvidia1`). The `Index=` field
//! on those lines is *not* that index: `_log_gres_slurmd_conf` (same files)
//! prints the number at the end of the `File=` string, so it is ignored here.
//!
//! Records, by version (`_log_gres_slurmd_conf`):
//! - 22.05: `Gres Name=gpu Type=(null) Count=1 Index=0 ID=7696487 File=/dev/nvidia0 (null)`
//! - 24.11+: `Gres Name=gpu ... File=/dev/nvidia0,/dev/nvidia-caps/nvidia-cap21 Links=(null) Flags=HAS_FILE,...`
//!   (and `Cores=... CoreCnt=...` before `Links=` when gres.conf sets cores)
//!
//! Each record is one `info()` line of Slurm's logger (`_log_msg`,
//! `src/common/log.c`), and its prefix on stderr changed across releases:
//! - 22.05-24.11 by default: `slurmd: Gres Name=...` (`argv0: `)
//! - 24.11 with `LogTimeFormat=...,format_stderr`, and every daemon from
//!   25.05 on: `[2026-12-01T22:02:21.693] Gres Name=...` (`[%M] `, the time
//!   in the `LogTimeFormat` chosen: iso8601(_ms), rfc5424(_ms)
//!   `2026-12-01T22:02:21.693+00:00`, rfc3339, clock `123456`, short
//!   `Dec 01 22:02:21`, thread_id)
//! - 22.05-24.11 with `LogTimeFormat=thread_id`: the id block of
//!   `_set_idbuf`, `Dec  1 22:02:21.693123  1234 slurmd       0x7f3a2b4c5d60: Gres Name=...`
//!
//! So a record is found as the `Gres Name=` token anywhere in the line, but
//! only when what precedes it is a log prefix (see [`record_start`]), never
//! inside an `error: ...` message that quotes one. A line that names
//! `Name=gpu` and is neither a record nor one of Slurm's diagnostics is an
//! error: a `slurmd -G` whose shape this parser does not know must not read
//! as "no GPU" (25.05 changed the prefix, and a parser that wanted
//! `slurmd: ` found none, without an error).
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
/// GRES-index order. Records are found with [`record_start`] (every prefix
/// shape Slurm 22.05-26.05 prints); records of other GRES names (`mps`,
/// `shard`, `nic`) and other lines (log noise) are skipped.
///
/// # Errors
/// A [`ParseError`] naming `source` and the line when a `gpu` record has no
/// `File=`, a malformed `Count=` or bracket expression, or a count that does
/// not match its files; and when a line names `Name=gpu` but is neither a
/// record nor one of Slurm's diagnostics (`error: `, `warning: `, ...,
/// see [`is_diagnostic_prefix`]): an output shape this parser does not know,
/// which must not be read as fewer GPUs.
pub fn parse_slurmd_g(text: &str, source: &Path) -> Result<Vec<GresDevice>, ParseError> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        let Some(start) = record_start(line) else {
            if let Some(at) = find_name_gpu(line) {
                if !is_diagnostic_prefix(&line[..at]) {
                    return Err(ParseError::new(
                        source,
                        i + 1,
                        format!(
                            "{line:?} names Name=gpu but is not a `Gres Name=` record in a shape slurmd -G prints \
                             (`slurmd: Gres ...`, `[<time>] Gres ...`): unknown output, the node's GPUs cannot be read from it"
                        ),
                    ));
                }
            }
            continue;
        };
        let rest = &line[start + "Gres ".len()..];
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
        let files = expand_file_list(file).map_err(|e| err(e.to_string()))?;
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

/// The token that starts a record of `_log_gres_slurmd_conf`.
pub const RECORD_TOKEN: &str = "Gres Name=";

/// Where the record starts in one line of `slurmd -G` output: the byte
/// offset of its [`RECORD_TOKEN`], or `None` when the line is no record.
/// The first `Gres Name=` of the line counts, and only when all that
/// precedes it is a log prefix of Slurm's logger (`_log_msg`,
/// `src/common/log.c`), in any combination and order:
/// - one leading `[...]` group: the `[%M]` time of `format_stderr` and of
///   every 25.05+ daemon, whatever `LogTimeFormat` fills it with;
/// - `slurmd:` (Slurm prints `argv0: `; any name starting with `slurmd`,
///   for a renamed binary);
/// - time stamps and numbers: tokens that start with a digit and hold only
///   letters, digits and `:.+-` (`2026-12-01T22:02:21.693+00:00`,
///   `22:02:21.693`, `01`, `123456`, a thread id `12345:`), and month
///   names (`Dec`);
/// - the thread id block of `LogTimeFormat=thread_id` (22.05-24.11,
///   `_set_idbuf`: `Dec  1 22:02:21.693123  1234 slurmd       0x7f3a2b4c5d60:`):
///   one thread name right before a `0x<hex>` thread pointer.
///
/// Anything else before it (a level prefix such as `error: `, a message)
/// makes the line no record: Slurm prints records with `info()`, which has
/// no level prefix.
pub fn record_start(line: &str) -> Option<usize> {
    let at = line.find(RECORD_TOKEN)?;
    is_log_prefix(&line[..at]).then_some(at)
}

fn is_log_prefix(pre: &str) -> bool {
    let mut s = pre.trim();
    if let Some(rest) = s.strip_prefix('[') {
        let Some(close) = rest.find(']') else {
            return false;
        };
        s = &rest[close + 1..];
    }
    let toks: Vec<&str> = s.split_whitespace().collect();
    let mut i = 0;
    while i < toks.len() {
        let t = toks[i];
        if is_argv0(t) || is_month(t) || is_stamp(t) {
            i += 1;
        } else if !t.ends_with(':') && toks.get(i + 1).is_some_and(|n| is_pointer(n)) {
            // a thread name, then its pointer
            i += 2;
        } else {
            return false;
        }
    }
    true
}

fn is_argv0(t: &str) -> bool {
    t.strip_suffix(':').is_some_and(|stem| {
        stem.starts_with("slurmd")
            && stem
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
    })
}

fn is_month(t: &str) -> bool {
    [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ]
    .contains(&t)
}

fn is_stamp(t: &str) -> bool {
    t.as_bytes().first().is_some_and(u8::is_ascii_digit)
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b":.+-".contains(&b))
}

fn is_pointer(t: &str) -> bool {
    let t = t.strip_suffix(':').unwrap_or(t);
    t.strip_prefix("0x")
        .is_some_and(|h| !h.is_empty() && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Whether `pre`, the text of a line before what it quotes, holds one of
/// the level prefixes of Slurm's logger (`_log_msg`, `src/common/log.c`):
/// `fatal:`, `error:`, `warning:`, `debug:` ... `debug5:`, `sched:` (and
/// `internal error:`). Such a line is Slurm's diagnostic (e.g. `error:
/// gres.conf: Ignoring invalid Links=... for Name=gpu`), never a record.
pub fn is_diagnostic_prefix(pre: &str) -> bool {
    pre.split_whitespace().any(|t| {
        [
            "fatal:", "error:", "warning:", "debug:", "debug2:", "debug3:", "debug4:", "debug5:",
            "sched:",
        ]
        .contains(&t)
    })
}

/// The byte offset of a `Name=gpu` token in `line` (ASCII case ignored, as
/// gres.conf keys are; not part of a longer word such as `NodeName=gpu01`).
fn find_name_gpu(line: &str) -> Option<usize> {
    const PAT: &str = "name=gpu";
    let lower = line.to_ascii_lowercase();
    let b = lower.as_bytes();
    lower.match_indices(PAT).map(|(at, _)| at).find(|&at| {
        let before = at.checked_sub(1).map(|j| b[j]);
        let after = b.get(at + PAT.len()).copied();
        !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_')
            && !after.is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_')
    })
}

/// Why a `File=` value ([`expand_file_list`]) cannot be expanded. The
/// `slurmd -G` parser puts the message after the file and line.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FileListError {
    /// An empty item (`/dev/a,,/dev/b`), with the whole value.
    #[error("empty file name in {0:?}")]
    EmptyName(String),
    /// A `[` or `]` without its other half, with the item (or the whole
    /// value, for a stray `]`).
    #[error("unbalanced '{bracket}' in {text:?}")]
    Unbalanced {
        /// `[` or `]`.
        bracket: char,
        /// Where.
        text: String,
    },
    /// An item with a second bracket.
    #[error("more than one bracket in {0:?}")]
    MoreThanOneBracket(String),
    /// A bracket whose numbers do not parse, with the item.
    #[error("{source} in {item:?}")]
    Item {
        /// What is wrong in the bracket.
        source: Box<FileListError>,
        /// The item.
        item: String,
    },
    /// A bracket part that is not a number.
    #[error("bad number {0:?}")]
    BadNumber(String),
    /// A range `b-a` with `b > a`.
    #[error("descending range {0:?}")]
    Descending(String),
    /// A range of more than [`MAX_FILES_PER_RECORD`] numbers.
    #[error("range {0:?} is longer than {MAX_FILES_PER_RECORD}")]
    RangeTooLong(String),
    /// A bracket that takes the value past [`MAX_FILES_PER_RECORD`] files.
    #[error("{0:?} expands to more than {MAX_FILES_PER_RECORD} files")]
    ExpandsTooMany(String),
    /// A value of more than [`MAX_FILES_PER_RECORD`] files.
    #[error("{0:?} names more than {MAX_FILES_PER_RECORD} files")]
    NamesTooMany(String),
}

/// Expands a `File=` value: a comma list whose items may hold one hostlist
/// bracket (`/dev/nvidia[0-1,3]`), in order.
///
/// # Errors
/// [`FileListError`] for an unbalanced bracket, a bad range, or more than
/// [`MAX_FILES_PER_RECORD`] files.
pub fn expand_file_list(s: &str) -> Result<Vec<PathBuf>, FileListError> {
    let mut out = Vec::new();
    for item in split_top_level(s)? {
        if item.is_empty() {
            return Err(FileListError::EmptyName(s.to_string()));
        }
        match item.find('[') {
            None => out.push(PathBuf::from(item)),
            Some(open) => {
                let close = item[open..].find(']').map(|c| c + open).ok_or_else(|| {
                    FileListError::Unbalanced {
                        bracket: '[',
                        text: item.to_string(),
                    }
                })?;
                let (prefix, body, suffix) =
                    (&item[..open], &item[open + 1..close], &item[close + 1..]);
                if suffix.contains('[') || suffix.contains(']') {
                    return Err(FileListError::MoreThanOneBracket(item.to_string()));
                }
                for n in expand_numbers(body).map_err(|e| FileListError::Item {
                    source: Box::new(e),
                    item: item.to_string(),
                })? {
                    out.push(PathBuf::from(format!("{prefix}{n}{suffix}")));
                    if out.len() > MAX_FILES_PER_RECORD {
                        return Err(FileListError::ExpandsTooMany(s.to_string()));
                    }
                }
            }
        }
        if out.len() > MAX_FILES_PER_RECORD {
            return Err(FileListError::NamesTooMany(s.to_string()));
        }
    }
    Ok(out)
}

/// Splits on commas outside brackets.
fn split_top_level(s: &str) -> Result<Vec<&str>, FileListError> {
    let mut parts = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => {
                depth = depth
                    .checked_sub(1)
                    .ok_or_else(|| FileListError::Unbalanced {
                        bracket: ']',
                        text: s.to_string(),
                    })?
            }
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(FileListError::Unbalanced {
            bracket: '[',
            text: s.to_string(),
        });
    }
    parts.push(&s[start..]);
    Ok(parts)
}

/// Expands `0-2,5` into numbers, keeping zero padding (`01-03` → `01 02 03`).
fn expand_numbers(body: &str) -> Result<Vec<String>, FileListError> {
    let mut out = Vec::new();
    for part in body.split(',') {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let width = lo.len();
        let a: u32 = lo
            .parse()
            .map_err(|_| FileListError::BadNumber(lo.to_string()))?;
        let b: u32 = hi
            .parse()
            .map_err(|_| FileListError::BadNumber(hi.to_string()))?;
        if b < a {
            return Err(FileListError::Descending(part.to_string()));
        }
        if (b - a) as usize >= MAX_FILES_PER_RECORD {
            return Err(FileListError::RangeTooLong(part.to_string()));
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

    /// The real outputs of 22.05.8, 24.11.5 (plain and `format_stderr`) and
    /// 26.05.5 for one gres.conf (`testdata/slurmd-G/README.md`): the same
    /// two GPUs, in gres.conf's order (nvidia3 first), from every shape.
    #[test]
    fn every_release_shape_gives_the_same_gpus_in_order() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/slurmd-G");
        let mut names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "txt"))
            .collect();
        names.sort();
        assert_eq!(names.len(), 4, "{names:?}");
        for p in names {
            let text = std::fs::read_to_string(&p).unwrap();
            let g = parse_slurmd_g(&text, &p).unwrap_or_else(|e| panic!("{e}"));
            let got: Vec<_> = g.iter().map(|d| (d.index, d.files.clone())).collect();
            assert_eq!(
                got,
                vec![(0, paths(&["/dev/nvidia3"])), (1, paths(&["/dev/nvidia1"]))],
                "{}",
                p.display()
            );
            assert!(g.iter().all(|d| d.gres_type.is_none()));
        }
    }

    /// Prefixes of other `LogTimeFormat`s and of `thread_id`
    /// (`src/common/log.c`: `_log_msg`, `_set_idbuf`, `xlogfmtcat`).
    #[test]
    fn other_log_prefixes_are_read() {
        let rec = "Gres Name=gpu Type=(null) Count=1 Index=3 ID=7696487 File=/dev/nvidia3 Links=(null) Flags=HAS_FILE";
        for pre in [
            "",
            "slurmd: ",
            "slurmd.real: ",
            "[2026-12-01T22:02:21.693] ",
            "[2026-12-01T22:02:21] ",
            "[2026-12-01T22:02:21.693+00:00] ",
            "[2026-12-01T22:02:21Z] ",
            "[123456] ",
            "[Dec 01 22:02:21] ",
            "2026-12-01T22:02:21.693+00:00 ",
            "Dec 01 22:02:21.693 ",
            "slurmd: 12345: ",
            "12345: ",
            "[2026-12-01T22:02:21.693] 12345: ",
            "[2026-12-01T22:02:21.693] slurmd: 12345: ",
            // 22.05-24.11 LogTimeFormat=thread_id on stderr, and 25.05+ in [%M]
            "Dec  1 22:02:21.693123  1234 slurmd       0x7f3a2b4c5d60: ",
            "[Dec  1 22:02:21.693123  1234 slurmd       0x7f3a2b4c5d60] ",
            "Dec  1 22:02:21.693123  1234 0x7f3a2b4c5d60: ",
        ] {
            let line = format!("{pre}{rec}");
            assert_eq!(record_start(&line), Some(pre.len()), "{line:?}");
            let g = parse_slurmd_g(&format!("  {line}\n"), Path::new("G")).unwrap();
            assert_eq!(g.len(), 1, "{line:?}");
            assert_eq!(g[0].files, paths(&["/dev/nvidia3"]), "{line:?}");
        }
    }

    /// A `Gres Name=` quoted in a message, or behind anything that is not
    /// a log prefix, is no record.
    #[test]
    fn quoted_records_are_not_records() {
        let rec = "Gres Name=gpu Count=1 File=/dev/nvidia0";
        for pre in [
            "slurmd: error: ",
            "[2026-12-01T22:02:21.693] error: ",
            "slurmd: warning: bad ",
            "[2026-12-01T22:02:21.693] debug:  ",
            "slurmd: error: gres.conf: saw ",
            "error: ",
        ] {
            let line = format!("{pre}{rec}");
            assert_eq!(record_start(&line), None, "{line:?}");
            // Slurm's own diagnostics: skipped, not an error
            assert_eq!(
                parse_slurmd_g(&line, Path::new("G")).unwrap(),
                vec![],
                "{line:?}"
            );
        }
        for pre in ["gpu list: ", "[x] note ", "slurmd - ", "[2026-12-01 "] {
            let line = format!("{pre}{rec}");
            assert_eq!(record_start(&line), None, "{line:?}");
        }
    }

    /// A line that names `Name=gpu` in no shape this parser knows is an
    /// error naming its line, not "no GPU" (25.05 changed the prefix and
    /// a parser expecting `slurmd: ` read nothing, silently).
    #[test]
    fn unknown_gpu_lines_are_errors() {
        for (text, line) in [
            ("gpu list: Gres Name=gpu Count=1 File=/dev/nvidia0", 1),
            (
                "slurmd: ok\n<6>slurmd Gres Name=gpu Count=1 File=/dev/nvidia0",
                2,
            ),
            ("slurmd: GRES: Name=gpu Count=1 File=/dev/nvidia0", 1),
            ("slurmd: Gres: name=GPU Count=1 File=/dev/nvidia0", 1),
        ] {
            let e = parse_slurmd_g(text, Path::new("slurmd -G")).unwrap_err();
            assert_eq!(e.line, line, "{e}");
            assert!(e.msg.contains("names Name=gpu"), "{e}");
        }
        // Slurm's diagnostics that quote a GPU's gres.conf line are not
        // records and not errors; other words ending in name=gpu are no
        // Name=gpu token.
        for ok in [
            "slurmd: error: gres.conf: Ignoring invalid Links=-1 for Name=gpu",
            "[2026-12-01T22:02:21.693] warning: something about Name=gpu",
            "slurmd: NodeName=gpu01 CPUs=4",
            "slurmd: Name=gpux",
            "slurmd: Gres Name=mps Type=(null) Count=100 Index=0 ID=1 File=/dev/nvidia0 (null)",
        ] {
            assert_eq!(parse_slurmd_g(ok, Path::new("G")).unwrap(), vec![], "{ok}");
        }
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
