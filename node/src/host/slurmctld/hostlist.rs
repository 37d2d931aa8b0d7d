//! Slurm hostlists (`node[1-3,5],gpu7`): finding this node's position without expanding more than needed.

use super::gres_detail::parse_u64;
use super::MAX_HOSTS;

/// Why a hostlist expression ([`hostlist_find`], [`expand_hostlist`]) does
/// not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HostlistError {
    /// An empty item (`a,,b`).
    #[error("empty host name")]
    EmptyName,
    /// A `[` inside brackets.
    #[error("nested '['")]
    Nested,
    /// A `[` or `]` without its other half.
    #[error("unbalanced '{0}'")]
    Unbalanced(char),
    /// `[]`.
    #[error("empty brackets")]
    EmptyBrackets,
    /// A part of a bracket that is not a number or a range of numbers.
    #[error("bad range {0:?}")]
    BadRange(String),
    /// A range `b-a` with `b > a`.
    #[error("descending range {0:?}")]
    Descending(String),
    /// More than [`MAX_HOSTS`] names.
    #[error("more than {MAX_HOSTS} hosts")]
    TooMany,
}

/// Where `name` is in the hostlist expression `list` (Slurm's
/// `hostlist_ranged_string` output: `gpu[01-03,10],login1`), and how many
/// names the list has. The position is that of the first match, as
/// Slurm's `hostlist_find`.
///
/// # Errors
/// [`HostlistError`] for unbalanced brackets, bad ranges and lists longer
/// than [`MAX_HOSTS`].
pub fn hostlist_find(list: &str, name: &str) -> Result<(Option<usize>, usize), HostlistError> {
    let mut count = 0usize;
    let mut pos = None;
    if list.is_empty() {
        return Ok((None, 0));
    }
    let mut buf = String::new();
    for item in split_hostlist(list)? {
        if item.is_empty() {
            return Err(HostlistError::EmptyName);
        }
        visit_hosts(item, &mut buf, &mut |h| {
            if pos.is_none() && h == name {
                pos = Some(count);
            }
            count += 1;
            if count > MAX_HOSTS {
                return Err(HostlistError::TooMany);
            }
            Ok(())
        })?;
    }
    Ok((pos, count))
}

/// Expands a hostlist expression into names, in order.
///
/// # Errors
/// As [`hostlist_find`].
pub fn expand_hostlist(list: &str) -> Result<Vec<String>, HostlistError> {
    let mut out = Vec::new();
    if list.is_empty() {
        return Ok(out);
    }
    let mut buf = String::new();
    for item in split_hostlist(list)? {
        if item.is_empty() {
            return Err(HostlistError::EmptyName);
        }
        visit_hosts(item, &mut buf, &mut |h| {
            if out.len() >= MAX_HOSTS {
                return Err(HostlistError::TooMany);
            }
            out.push(h.to_string());
            Ok(())
        })?;
    }
    Ok(out)
}

/// Splits on commas outside brackets; brackets do not nest.
pub(super) fn split_hostlist(s: &str) -> Result<Vec<&str>, HostlistError> {
    let mut parts = Vec::new();
    let mut open = false;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '[' if !open => open = true,
            '[' => return Err(HostlistError::Nested),
            ']' if open => open = false,
            ']' => return Err(HostlistError::Unbalanced(']')),
            ',' if !open => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if open {
        return Err(HostlistError::Unbalanced('['));
    }
    parts.push(&s[start..]);
    Ok(parts)
}

/// Calls `f` with every name of one item (`pre[1-2,05]suf`, where `suf`
/// may hold further brackets), the leftmost bracket varying slowest.
/// `buf` holds the name built so far.
pub(super) fn visit_hosts(
    item: &str,
    buf: &mut String,
    f: &mut dyn FnMut(&str) -> Result<(), HostlistError>,
) -> Result<(), HostlistError> {
    let Some(open) = item.find('[') else {
        if item.contains(']') {
            return Err(HostlistError::Unbalanced(']'));
        }
        let len = buf.len();
        buf.push_str(item);
        let r = f(buf);
        buf.truncate(len);
        return r;
    };
    let close = item[open..]
        .find(']')
        .map(|c| c + open)
        .ok_or(HostlistError::Unbalanced('['))?;
    let (prefix, body, suffix) = (&item[..open], &item[open + 1..close], &item[close + 1..]);
    if prefix.contains(']') {
        return Err(HostlistError::Unbalanced(']'));
    }
    if body.is_empty() {
        return Err(HostlistError::EmptyBrackets);
    }
    let len = buf.len();
    buf.push_str(prefix);
    for part in body.split(',') {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let num = |s: &str| parse_u64(s).ok_or_else(|| HostlistError::BadRange(part.to_string()));
        let (a, b) = (num(lo)?, num(hi)?);
        if b < a {
            return Err(HostlistError::Descending(part.to_string()));
        }
        if b - a >= MAX_HOSTS as u64 {
            return Err(HostlistError::TooMany);
        }
        let width = lo.len();
        for n in a..=b {
            let l2 = buf.len();
            buf.push_str(&format!("{n:0width$}"));
            let r = visit_hosts(suffix, buf, f);
            buf.truncate(l2);
            r?;
        }
    }
    buf.truncate(len);
    Ok(())
}
