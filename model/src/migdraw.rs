//! What `gpufence mig check` prints: a [`Plan`] of MIG instances on one GPU
//! (the whole request, or when it does not fit the best partial packing and
//! what is left over), drawn as text ([`render_text`], [`draw`]) or given as
//! JSON ([`plan_json`]). Pure: the CLI only prints these.
//!
//! The placement facts (profiles, memory-slice runs, allowed starts,
//! instance counts) are [`crate::mig`]'s tables, whose sources (NVIDIA's MIG
//! User Guide and the NVML reference) are cited there; nothing here adds a
//! fact about the GPUs.
//!
//! # Units
//!
//! Every position and length is in *memory slices* (8 per GPU on
//! A100/H100/H200, 4 on A30; [`GpuModel::memory_slices`]), as
//! [`Placement::start`] and [`Placement::size`], and as `nvidia-smi mig
//! -lgi` writes `start:size`. Compute (SM) slices are only counted
//! ([`GpuModel::compute_slices`]).
//!
//! # The drawing
//!
//! One row per GPU (one GPU per call): a box per instance spanning its
//! memory slices, with the profile name (a `+me` suffix on its own line when
//! the box is one slice wide) and its `start:size`, and a `free` box per
//! unused slice. Plain ASCII, every line at most [`MAX_COLUMNS`] wide. For
//! `3g.40gb,2g.20gb,1g.10gb` on an H100-80GB:
//!
//! ```text
//! slice     0        1        2        3        4        5        6        7
//!       +-----------------------------------+-----------------+--------+--------+
//! GPU 0 |              3g.40gb              |     2g.20gb     |1g.10gb |  free  |
//!       |                0:4                |       4:2       |  6:1   |        |
//!       +-----------------------------------+-----------------+--------+--------+
//!       memory slices used: 7 of 8, compute slices used: 6 of 7
//! ```

use serde_json::{json, Value};

use crate::mig::{find_profile, place, GpuModel, Placement, PlacementError, Profile};

/// The widest line [`draw`] writes, in columns (an 80-column terminal).
pub const MAX_COLUMNS: usize = 79;

/// Columns before a row's first `|`: the `slice` and `GPU 0` labels.
const MARGIN: usize = 6;

/// The largest slice width, in columns: A30's four slices get 18.
const MAX_SLICE_COLUMNS: usize = 18;

/// The hint printed under every plan.
pub const ORDER_HINT: &str =
    "(create the largest instances first: nvidia-smi places in the order given)";

/// What fits of a request on one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The GPU model.
    pub model: GpuModel,
    /// The instances placed, in request order (of those placed). The whole
    /// request when it fits.
    pub placements: Vec<Placement>,
    /// The requested instances not placed, in request order; empty when the
    /// request fits.
    pub left_over: Vec<&'static Profile>,
    /// Why the whole request does not fit (the first rule it breaks, as
    /// [`place`] reports it); `None` when it fits.
    pub refusal: Option<PlacementError>,
}

impl Plan {
    /// Whether the whole request fits.
    pub fn fits(&self) -> bool {
        self.refusal.is_none()
    }

    /// Memory slices the placed instances take.
    pub fn memory_slices_used(&self) -> u32 {
        self.placements.iter().map(|p| u32::from(p.size)).sum()
    }

    /// Compute slices the placed instances take.
    pub fn compute_slices_used(&self) -> u32 {
        self.placements
            .iter()
            .map(|p| u32::from(p.profile.compute_slices))
            .sum()
    }
}

/// Places `requested` (profile names in any form [`find_profile`] takes) on
/// one GPU of `model`: the whole request when [`place`] finds a layout,
/// otherwise the best partial packing.
///
/// The best partial packing is the subset of the requested instances that
/// fits (every rule of [`crate::mig`]: instance counts, one `+me`, memory
/// and compute slices, allowed starts) and uses the most memory slices, then
/// the most compute slices; among equals, the one with the most instances of
/// the largest profiles (profiles compared by memory slices, then compute
/// slices, then table order). Of several requested instances of one profile,
/// the first ones in request order are placed and the last ones left over.
/// Deterministic.
///
/// # Errors
/// [`PlacementError::UnknownProfile`] for a name that is not one of the
/// model's profiles: nothing is placed.
pub fn plan(model: GpuModel, requested: &[&str]) -> Result<Plan, PlacementError> {
    let wanted: Vec<&'static Profile> = requested
        .iter()
        .map(|n| find_profile(model, n))
        .collect::<Result<_, _>>()?;
    let refusal = match place(model, requested) {
        Ok(placements) => {
            return Ok(Plan {
                model,
                placements,
                left_over: Vec::new(),
                refusal: None,
            })
        }
        Err(e) => e,
    };
    let keep = best_subset(model, &wanted);
    let names: Vec<&str> = keep.iter().map(|&i| wanted[i].name).collect();
    let placements = place(model, &names).expect("best_subset returns a subset that places");
    let left_over = (0..wanted.len())
        .filter(|i| !keep.contains(i))
        .map(|i| wanted[i])
        .collect();
    Ok(Plan {
        model,
        placements,
        left_over,
        refusal: Some(refusal),
    })
}

/// Indices (ascending) of the requested instances in the best partial
/// packing, as [`plan`] defines it.
fn best_subset(model: GpuModel, wanted: &[&'static Profile]) -> Vec<usize> {
    let table_index = |p: &Profile| {
        model
            .profiles()
            .iter()
            .position(|q| q == p)
            .unwrap_or(usize::MAX)
    };
    // Distinct profiles, largest first, each with its request indices.
    let mut groups: Vec<(&'static Profile, Vec<usize>)> = Vec::new();
    for (i, p) in wanted.iter().enumerate() {
        match groups.iter_mut().find(|(q, _)| q == p) {
            Some((_, idx)) => idx.push(i),
            None => groups.push((p, vec![i])),
        }
    }
    groups.sort_by_key(|(p, _)| {
        (
            std::cmp::Reverse(p.memory_slices),
            std::cmp::Reverse(p.compute_slices),
            table_index(p),
        )
    });
    struct Best {
        score: (u32, u32),
        counts: Vec<usize>,
    }
    fn go(
        model: GpuModel,
        groups: &[(&'static Profile, Vec<usize>)],
        counts: &mut Vec<usize>,
        best: &mut Best,
    ) {
        let chosen = || {
            groups
                .iter()
                .zip(counts.iter())
                .flat_map(|((p, _), &n)| std::iter::repeat_n(p.name, n))
        };
        // A subset of a packing that fits fits too: stop at the first that
        // does not.
        let names: Vec<&str> = chosen().collect();
        if place(model, &names).is_err() {
            return;
        }
        let k = counts.len();
        let Some((p, idx)) = groups.get(k) else {
            let score = groups
                .iter()
                .zip(counts.iter())
                .fold((0, 0), |(m, c), ((p, _), &n)| {
                    (
                        m + u32::from(p.memory_slices) * n as u32,
                        c + u32::from(p.compute_slices) * n as u32,
                    )
                });
            // Strictly better only: the first of equals (most large
            // profiles) stays.
            if score > best.score || best.counts.is_empty() {
                best.score = score;
                best.counts = counts.clone();
            }
            return;
        };
        let most = idx.len().min(usize::from(p.max_count));
        for n in (0..=most).rev() {
            counts.push(n);
            go(model, groups, counts, best);
            counts.pop();
        }
    }
    let mut best = Best {
        score: (0, 0),
        counts: Vec::new(),
    };
    go(model, &groups, &mut Vec::new(), &mut best);
    let mut keep: Vec<usize> = groups
        .iter()
        .zip(&best.counts)
        .flat_map(|((_, idx), &n)| idx[..n].iter().copied())
        .collect();
    keep.sort_unstable();
    keep
}

/// Columns one memory slice takes in [`draw`], its right border included:
/// the widest that keeps a row within [`MAX_COLUMNS`], at most 18 (9 for 8
/// slices, 18 for the A30's 4).
pub fn slice_columns(model: GpuModel) -> usize {
    let slices = usize::from(model.memory_slices()).max(1);
    ((MAX_COLUMNS - MARGIN - 1) / slices).clamp(2, MAX_SLICE_COLUMNS)
}

/// One box of the row: `size` slices from `start`, with its text lines.
struct Cell {
    size: usize,
    lines: Vec<String>,
}

/// The profile name in lines of at most `width` columns: whole when it
/// fits, else split before a `+` (`1g.10gb` / `+me`), else cut.
fn name_lines(name: &str, width: usize) -> Vec<String> {
    let cut = |s: &str| s.chars().take(width).collect::<String>();
    if name.len() <= width {
        return vec![name.to_string()];
    }
    match name.find('+') {
        Some(i) if i > 0 => vec![cut(&name[..i]), cut(&name[i..])],
        _ => vec![cut(name)],
    }
}

fn center(text: &str, width: usize) -> String {
    let len = text.chars().count().min(width);
    let left = (width - len) / 2;
    let text: String = text.chars().take(width).collect();
    format!(
        "{}{text}{}",
        " ".repeat(left),
        " ".repeat(width - len - left)
    )
}

/// The row of one GPU of `model` with `placements` on it.
///
/// Shape, for a model of `n` memory slices of `w` columns each
/// ([`slice_columns`]): a `slice` axis line with each slice's index centred
/// over it; a border line; as many content lines as the tallest box needs
/// (the first labelled `GPU 0`); a border line; a `memory slices used: A of
/// B, compute slices used: C of D` line. A box of `k` slices is `k * w - 1`
/// columns inside; an instance's box holds its profile name and
/// `start:size`, a free slice's box `free`. Every line ends in a newline and
/// is at most [`MAX_COLUMNS`] columns wide; no line ends in a blank.
///
/// Placements that overlap or leave the GPU (never from [`place`]) are
/// drawn at their first free slice run or skipped, never panicking.
pub fn draw(model: GpuModel, placements: &[Placement]) -> String {
    let total = usize::from(model.memory_slices());
    let cw = slice_columns(model);
    let mut by_start: Vec<&Placement> = placements.iter().collect();
    by_start.sort_by_key(|p| p.start);
    let mut cells: Vec<Cell> = Vec::new();
    let mut at = 0usize;
    for p in by_start {
        let (start, size) = (usize::from(p.start), usize::from(p.size).max(1));
        if start < at || start + size > total {
            continue;
        }
        while at < start {
            cells.push(Cell {
                size: 1,
                lines: vec!["free".to_string()],
            });
            at += 1;
        }
        let mut lines = name_lines(p.profile.name, size * cw - 1);
        lines.push(format!("{}:{}", p.start, p.size));
        cells.push(Cell { size, lines });
        at = start + size;
    }
    while at < total {
        cells.push(Cell {
            size: 1,
            lines: vec!["free".to_string()],
        });
        at += 1;
    }
    let height = cells.iter().map(|c| c.lines.len()).max().unwrap_or(1);

    let mut out = String::new();
    let mut axis = format!("{:<MARGIN$}", "slice");
    for i in 0..total {
        axis.push(' ');
        axis.push_str(&center(&i.to_string(), cw - 1));
    }
    out.push_str(axis.trim_end());
    out.push('\n');
    let mut border = format!("{:MARGIN$}+", "");
    for c in &cells {
        border.push_str(&"-".repeat(c.size * cw - 1));
        border.push('+');
    }
    out.push_str(&border);
    out.push('\n');
    for j in 0..height {
        let label = if j == 0 { "GPU 0" } else { "" };
        let mut line = format!("{label:<MARGIN$}|");
        for c in &cells {
            let text = c.lines.get(j).map(String::as_str).unwrap_or("");
            line.push_str(&center(text, c.size * cw - 1));
            line.push('|');
        }
        out.push_str(&line);
        out.push('\n');
    }
    out.push_str(&border);
    out.push('\n');
    let mem: u32 = placements.iter().map(|p| u32::from(p.size)).sum();
    let cmp: u32 = placements
        .iter()
        .map(|p| u32::from(p.profile.compute_slices))
        .sum();
    out.push_str(&format!(
        "{:MARGIN$}memory slices used: {mem} of {total}, compute slices used: {cmp} of {}\n",
        "",
        model.compute_slices()
    ));
    out
}

/// The whole text `gpufence mig check` prints for `plan`, each line ending
/// in a newline:
///
/// - `fits on one MODEL:`, or `does not fit on one MODEL: REASON` followed
///   by `best partial packing: K of N instances fit:`;
/// - the [`draw`]ing;
/// - one line per placed instance, request order: `  NAME at START:SIZE`;
/// - when some do not fit, `left over: NAME, NAME` (request order);
/// - [`ORDER_HINT`].
///
/// Only the drawing's lines are bound to [`MAX_COLUMNS`]; the reason is one
/// line, however long.
pub fn render_text(plan: &Plan) -> String {
    let model = plan.model;
    let mut out = String::new();
    match &plan.refusal {
        None => out.push_str(&format!("fits on one {model}:\n")),
        Some(e) => {
            out.push_str(&format!("does not fit on one {model}: {e}\n"));
            out.push_str(&format!(
                "best partial packing: {} of {} instances fit:\n",
                plan.placements.len(),
                plan.placements.len() + plan.left_over.len()
            ));
        }
    }
    out.push_str(&draw(model, &plan.placements));
    for p in &plan.placements {
        out.push_str(&format!("  {p}\n"));
    }
    if !plan.left_over.is_empty() {
        let names: Vec<&str> = plan.left_over.iter().map(|p| p.name).collect();
        out.push_str(&format!("left over: {}\n", names.join(", ")));
    }
    out.push_str(ORDER_HINT);
    out.push('\n');
    out
}

/// `plan` as the JSON `gpufence mig check --json` prints:
///
/// ```json
/// {
///   "model": "H100-80GB",
///   "memory_slices": 8,
///   "compute_slices": 7,
///   "fits": true,
///   "error": null,
///   "instances": [
///     {"profile": "3g.40gb", "profile_id": 9, "start": 0, "size": 4,
///      "compute_slices": 3, "placement": "0:4"}
///   ],
///   "left_over": [],
///   "slices": [0, 0, 0, 0, null, null, null, null],
///   "memory_slices_used": 4,
///   "compute_slices_used": 3
/// }
/// ```
///
/// `instances` in request order (of those placed); `start` and `size` in
/// memory slices; `placement` is `start:size` as `nvidia-smi mig -lgi`
/// writes it. `left_over`: the requested instances not placed, request
/// order, each `{"profile", "profile_id", "size", "compute_slices"}`.
/// `error`: why the whole request does not fit (`null` when it fits).
/// `slices`: one entry per memory slice, the index into `instances` of the
/// instance on it or `null` when free.
pub fn plan_json(plan: &Plan) -> Value {
    let total = usize::from(plan.model.memory_slices());
    let mut slices: Vec<Value> = vec![Value::Null; total];
    for (i, p) in plan.placements.iter().enumerate() {
        let (s, n) = (usize::from(p.start), usize::from(p.size));
        for slot in slices.iter_mut().skip(s).take(n) {
            *slot = json!(i);
        }
    }
    let instances: Vec<Value> = plan
        .placements
        .iter()
        .map(|p| {
            json!({
                "profile": p.profile.name,
                "profile_id": p.profile.profile_id,
                "start": p.start,
                "size": p.size,
                "compute_slices": p.profile.compute_slices,
                "placement": format!("{}:{}", p.start, p.size),
            })
        })
        .collect();
    let left_over: Vec<Value> = plan
        .left_over
        .iter()
        .map(|p| {
            json!({
                "profile": p.name,
                "profile_id": p.profile_id,
                "size": p.memory_slices,
                "compute_slices": p.compute_slices,
            })
        })
        .collect();
    json!({
        "model": plan.model.name(),
        "memory_slices": plan.model.memory_slices(),
        "compute_slices": plan.model.compute_slices(),
        "fits": plan.fits(),
        "error": plan.refusal.as_ref().map(|e| e.to_string()),
        "instances": instances,
        "left_over": left_over,
        "slices": slices,
        "memory_slices_used": plan.memory_slices_used(),
        "compute_slices_used": plan.compute_slices_used(),
    })
}

/// The JSON for a request [`plan`] refused outright (an unknown profile):
/// `{"model": MODEL, "fits": false, "error": MESSAGE}`.
pub fn error_json(model: GpuModel, error: &PlacementError) -> Value {
    json!({
        "model": model.name(),
        "fits": false,
        "error": error.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(ps: &[&'static Profile]) -> Vec<&'static str> {
        ps.iter().map(|p| p.name).collect()
    }

    #[test]
    fn whole_request_when_it_fits() {
        let p = plan(GpuModel::H100_80GB, &["3g.40gb", "2g.20gb", "1g.10gb"]).unwrap();
        assert!(p.fits());
        assert_eq!(p.placements.len(), 3);
        assert!(p.left_over.is_empty());
        assert_eq!((p.memory_slices_used(), p.compute_slices_used()), (7, 6));
    }

    #[test]
    fn best_partial_prefers_memory_then_large_profiles() {
        let m = GpuModel::H100_80GB;
        // 7g takes the whole GPU: the 1g instances are left over.
        let p = plan(m, &["1g.10gb", "7g.80gb", "1g.10gb"]).unwrap();
        assert!(matches!(
            p.refusal,
            Some(PlacementError::MemoryExceeded { .. })
        ));
        assert_eq!(p.placements.len(), 1);
        assert_eq!(p.placements[0].profile.name, "7g.80gb");
        assert_eq!(names(&p.left_over), ["1g.10gb", "1g.10gb"]);
        // 4g+3g and 3g+2g+2g both use 8 memory and 7 compute slices: the
        // one with the larger profile wins.
        let p = plan(m, &["2g.20gb", "2g.20gb", "3g.40gb", "4g.40gb"]).unwrap();
        let placed: Vec<&str> = p.placements.iter().map(|x| x.profile.name).collect();
        assert_eq!(placed, ["3g.40gb", "4g.40gb"]);
        assert_eq!(names(&p.left_over), ["2g.20gb", "2g.20gb"]);
        // Too many of one profile: the last requested are left over.
        let p = plan(m, &["1g.10gb"; 8]).unwrap();
        assert_eq!(p.placements.len(), 7);
        assert_eq!(names(&p.left_over), ["1g.10gb"]);
        // Two +me: one is placed.
        let p = plan(m, &["1g.10gb+me", "1g.10gb+me", "3g.40gb"]).unwrap();
        assert_eq!(p.placements.len(), 2);
        assert_eq!(names(&p.left_over), ["1g.10gb+me"]);
    }

    #[test]
    fn unknown_profile_is_an_error() {
        let e = plan(GpuModel::A30_24GB, &["4g.24gb", "9g.1gb"]).unwrap_err();
        assert!(matches!(e, PlacementError::UnknownProfile { .. }));
        assert_eq!(error_json(GpuModel::A30_24GB, &e)["fits"], false);
    }

    #[test]
    fn partial_packing_is_the_best_by_brute_force() {
        // Every subset of a few over-full requests, checked against the
        // score plan() promises.
        let cases: &[(GpuModel, &[&str])] = &[
            (
                GpuModel::A100_40GB,
                &["3g.20gb", "3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb+me"],
            ),
            (
                GpuModel::A30_24GB,
                &["2g.12gb+me", "1g.6gb+me", "2g.12gb", "1g.6gb"],
            ),
            (
                GpuModel::H200_141GB,
                &[
                    "4g.71gb", "3g.71gb", "2g.35gb", "1g.35gb", "1g.18gb", "1g.18gb",
                ],
            ),
        ];
        for (m, req) in cases {
            let p = plan(*m, req).unwrap();
            assert!(!p.fits());
            let mut best = (0, 0);
            for mask in 0u32..(1 << req.len()) {
                let sub: Vec<&str> = (0..req.len())
                    .filter(|i| mask & (1 << i) != 0)
                    .map(|i| req[i])
                    .collect();
                if let Ok(ps) = place(*m, &sub) {
                    let mem: u32 = ps.iter().map(|x| u32::from(x.size)).sum();
                    let cmp: u32 = ps.iter().map(|x| u32::from(x.profile.compute_slices)).sum();
                    best = best.max((mem, cmp));
                }
            }
            assert_eq!(
                (p.memory_slices_used(), p.compute_slices_used()),
                best,
                "{m} {req:?}"
            );
            assert_eq!(p.placements.len() + p.left_over.len(), req.len());
        }
    }

    #[test]
    fn drawing_lines_fit_80_columns_and_wrap_me() {
        for m in GpuModel::ALL {
            let all: Vec<&str> = m.profiles().iter().map(|p| p.name).collect();
            for name in &all {
                let d = draw(m, &place(m, &[name]).unwrap());
                for line in d.lines() {
                    assert!(line.chars().count() <= MAX_COLUMNS, "{m} {name}: {line:?}");
                    assert_eq!(line, line.trim_end());
                }
            }
        }
        let d = draw(
            GpuModel::H100_80GB,
            &place(GpuModel::H100_80GB, &["1g.10gb+me"]).unwrap(),
        );
        assert!(d.contains("|1g.10gb |") && d.contains("|  +me   |"), "{d}");
        assert!(name_lines("abcdefghij", 4) == ["abcd"]);
    }
}
