//! slurmctld's `gres_detail` strings, parsed strictly: `gpu:<type>:<n>(IDX:<list>)` entries.

use super::{IDX_TRUNCATED_LEN, MAX_INDICES};

/// One `gres_detail` item of one node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GresDetailEntry {
    /// GRES name (`gpu`, `shard`, `mps`, ...).
    pub name: String,
    /// GRES type (`a100`), `None` when untyped.
    pub gres_type: Option<String>,
    /// The allocated count printed before the parenthesis; `None` in the
    /// `(CNT:n)` form, which has none.
    pub count: Option<u64>,
    /// What is in the parenthesis.
    pub alloc: GresAlloc,
}

/// The parenthesised part of a `gres_detail` item.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GresAlloc {
    /// `(IDX:0-1,3)`: the node's GRES indices of this name, ascending.
    Idx(Vec<u32>),
    /// `(CNT:2)`: a count without indices (GRES without device files).
    Cnt(u64),
    /// `(0/8,4/8)` (23.11+, shared GRES such as `shard` with per-device
    /// counts): allocated/available per device of the node.
    Shared(Vec<(u64, u64)>),
}

/// Why a `gres_detail` string ([`parse_gres_detail`]) or its `gpu` entries
/// ([`gpu_indices`]) cannot be used. [`gpu_indices_from_json`](super::gpu_indices_from_json) puts the
/// message after the job, node and string it is about.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GresDetailError {
    /// An item with none of the three bodies (from where it starts).
    #[error("no (IDX:...), (CNT:...) or (a/b,...) part after {0:?}")]
    NoBody(String),
    /// A `,` with no item after it.
    #[error("trailing ','")]
    TrailingComma,
    /// An item whose name, type or counts do not parse (`why`: "bad GRES
    /// name", "bad CNT", ...).
    #[error("{why} in {header:?}{body}")]
    Item {
        /// What is wrong.
        why: &'static str,
        /// The item before its parenthesis (`gpu:sim:2`).
        header: String,
        /// Its parenthesis (`(IDX:0-1)`).
        body: String,
    },
    /// An item whose index list does not parse.
    #[error("{source} in {header:?}{body}")]
    ItemIndices {
        /// Why the list does not parse.
        source: Box<GresDetailError>,
        /// The item before its parenthesis.
        header: String,
        /// Its parenthesis.
        body: String,
    },
    /// An index list as long as Slurm's cut ([`IDX_TRUNCATED_LEN`]).
    #[error("the index list is {0} characters long: Slurm cuts it at {IDX_TRUNCATED_LEN}, so it cannot be trusted")]
    Truncated(usize),
    /// A part of an index list that is not a number or range of `u32`.
    #[error("bad index {0:?}")]
    BadIndex(String),
    /// A range `b-a` with `b > a`.
    #[error("descending range {0:?}")]
    Descending(String),
    /// A part not above the part before it.
    #[error("{0:?} is not after the previous index")]
    NotAscending(String),
    /// More than [`MAX_INDICES`] indices.
    #[error("more than {MAX_INDICES} indices")]
    TooMany,
    /// A `gpu` entry by count (`(CNT:n)`): GPUs without device files.
    #[error("{0} GPU(s) allocated by count, without indices (gres.conf has no File= for them)")]
    ByCount(u64),
    /// A `gpu` entry in the shared form.
    #[error("a gpu entry in the shared-GRES form")]
    Shared,
}

/// The indices of the `gpu` entries, ascending, without duplicates.
///
/// # Errors
/// [`GresDetailError::ByCount`] for a `gpu` entry without indices
/// (`(CNT:n)`: GPUs without device files, which cannot be fenced),
/// [`GresDetailError::Shared`] for one in the shared form.
pub fn gpu_indices(entries: &[GresDetailEntry]) -> Result<Vec<u32>, GresDetailError> {
    let mut out = Vec::new();
    for e in entries.iter().filter(|e| e.name == "gpu") {
        match &e.alloc {
            GresAlloc::Idx(v) => out.extend_from_slice(v),
            GresAlloc::Cnt(n) => return Err(GresDetailError::ByCount(*n)),
            GresAlloc::Shared(_) => return Err(GresDetailError::Shared),
        }
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// Parses one node's `gres_detail` string.
///
/// Shapes (`gres_ctld_job_build_details`, `src/slurmctld/gres_ctld.c`
/// 22.05-23.11; `gres_stepmgr_job_build_details`, `src/stepmgr/gres_stepmgr.c`
/// 24.05-25.11), items joined by `,`:
/// - `NAME[:TYPE]:COUNT(IDX:LIST)`, LIST from `bit_fmt` (`0-1,3`), all versions;
/// - `NAME[:TYPE](CNT:COUNT)`, all versions;
/// - `NAME[:TYPE]:COUNT(A/B,C/D,...)`, 23.11+, shared GRES with per-device counts.
///
/// NAME comes from GresTypes (admin). TYPE was observed to be the node's
/// configured type even when the user asked for a colliding spelling (22.05
/// builds the allocation from the node's types), but as a job request it is
/// user text with anything except `,` and `:` (`_get_next_gres`,
/// `src/common/gres.c`), so it is treated as such: it may contain `(` and
/// `)`. An item's parenthesis is therefore the first `(` at which one of
/// the bodies above matches *and* is followed by `,` or the end; a `(`
/// inside TYPE never is (TYPE is followed by `:` or `(`), and `(IDX:` and
/// `(CNT:` cannot occur inside TYPE at all.
///
/// # Errors
/// [`GresDetailError`] for anything else, for an index list Slurm may have
/// truncated ([`IDX_TRUNCATED_LEN`]) and for more than [`MAX_INDICES`]
/// indices.
pub fn parse_gres_detail(s: &str) -> Result<Vec<GresDetailEntry>, GresDetailError> {
    let mut out = Vec::new();
    if s.is_empty() {
        return Ok(out);
    }
    let b = s.as_bytes();
    let mut p = 0;
    loop {
        let (q, body, end) = (p..b.len())
            .filter(|&q| b[q] == b'(')
            .find_map(|q| match_body(b, q).map(|(body, end)| (q, body, end)))
            .ok_or_else(|| GresDetailError::NoBody(s[p..].to_string()))?;
        let header = &s[p..q];
        out.push(entry(header, body, &s[q..end])?);
        if end == b.len() {
            return Ok(out);
        }
        // match_body guarantees a ',' here.
        p = end + 1;
        if p == b.len() {
            return Err(GresDetailError::TrailingComma);
        }
    }
}

/// A body recognised at `q` (`b[q] == b'('`), without its validation.
pub(super) enum Body<'a> {
    Idx(&'a str),
    Cnt(&'a str),
    Shared(&'a str),
}

/// The body starting at `q`, and the index just past its `)`, when it has
/// one of the three shapes and is followed by `,` or the end.
pub(super) fn match_body(b: &[u8], q: usize) -> Option<(Body<'_>, usize)> {
    let rest = &b[q + 1..];
    let close = rest.iter().position(|&c| c == b')')?;
    let end = q + 1 + close + 1;
    if end != b.len() && b[end] != b',' {
        return None;
    }
    let inner = std::str::from_utf8(&rest[..close]).ok()?;
    if let Some(list) = inner.strip_prefix("IDX:") {
        // bit_fmt: digits, '-' and ','; an empty bitmap prints nothing.
        if list
            .bytes()
            .all(|c| c.is_ascii_digit() || c == b'-' || c == b',')
        {
            return Some((Body::Idx(list), end));
        }
        return None;
    }
    if let Some(n) = inner.strip_prefix("CNT:") {
        if !n.is_empty() && n.bytes().all(|c| c.is_ascii_digit()) {
            return Some((Body::Cnt(n), end));
        }
        return None;
    }
    if !inner.is_empty()
        && inner.contains('/')
        && inner
            .bytes()
            .all(|c| c.is_ascii_digit() || c == b'/' || c == b',')
    {
        return Some((Body::Shared(inner), end));
    }
    None
}

pub(super) fn parse_u64(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

pub(super) fn entry(
    header: &str,
    body: Body<'_>,
    whole_body: &str,
) -> Result<GresDetailEntry, GresDetailError> {
    let bad = |why: &'static str| GresDetailError::Item {
        why,
        header: header.to_string(),
        body: whole_body.to_string(),
    };
    let (name, rest) = match header.find(':') {
        Some(i) => (&header[..i], Some(&header[i + 1..])),
        None => (header, None),
    };
    if name.is_empty() || name.bytes().any(|c| matches!(c, b'(' | b')' | b',' | b' ')) {
        return Err(bad("bad GRES name"));
    }
    let typ = |t: &str| -> Result<Option<String>, GresDetailError> {
        if t.is_empty() || t.contains(':') {
            return Err(bad("bad GRES type"));
        }
        Ok(Some(t.to_string()))
    };
    let (gres_type, count, alloc) = match body {
        Body::Cnt(n) => {
            let n = parse_u64(n).ok_or_else(|| bad("bad CNT"))?;
            let t = match rest {
                None => None,
                Some(t) => typ(t)?,
            };
            (t, None, GresAlloc::Cnt(n))
        }
        Body::Idx(_) | Body::Shared(_) => {
            let rest = rest.ok_or_else(|| bad("no count"))?;
            let (t, c) = match rest.rfind(':') {
                Some(i) => (typ(&rest[..i])?, &rest[i + 1..]),
                None => (None, rest),
            };
            let c = parse_u64(c).ok_or_else(|| bad("bad count"))?;
            let alloc = match body {
                Body::Idx(list) => GresAlloc::Idx(parse_idx_list(list).map_err(|e| {
                    GresDetailError::ItemIndices {
                        source: Box::new(e),
                        header: header.to_string(),
                        body: whole_body.to_string(),
                    }
                })?),
                Body::Shared(list) => {
                    let mut v = Vec::new();
                    for part in list.split(',') {
                        let (a, b) = part
                            .split_once('/')
                            .ok_or_else(|| bad("bad shared count"))?;
                        let a = parse_u64(a).ok_or_else(|| bad("bad shared count"))?;
                        let b = parse_u64(b).ok_or_else(|| bad("bad shared count"))?;
                        v.push((a, b));
                    }
                    GresAlloc::Shared(v)
                }
                Body::Cnt(_) => unreachable!(),
            };
            (t, Some(c), alloc)
        }
    };
    Ok(GresDetailEntry {
        name: name.to_string(),
        gres_type,
        count,
        alloc,
    })
}

/// Parses a `bit_fmt` list (`0-1,3`; empty for no bit) into ascending indices.
pub(super) fn parse_idx_list(list: &str) -> Result<Vec<u32>, GresDetailError> {
    if list.len() >= IDX_TRUNCATED_LEN {
        return Err(GresDetailError::Truncated(list.len()));
    }
    let mut out: Vec<u32> = Vec::new();
    if list.is_empty() {
        return Ok(out);
    }
    for part in list.split(',') {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let num = |s: &str| {
            parse_u64(s)
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| GresDetailError::BadIndex(part.to_string()))
        };
        let (a, b) = (num(lo)?, num(hi)?);
        if b < a {
            return Err(GresDetailError::Descending(part.to_string()));
        }
        if out.last().is_some_and(|&l| a <= l) {
            return Err(GresDetailError::NotAscending(part.to_string()));
        }
        if (b - a) as usize >= MAX_INDICES || out.len() + (b - a) as usize >= MAX_INDICES {
            return Err(GresDetailError::TooMany);
        }
        out.extend(a..=b);
    }
    Ok(out)
}
