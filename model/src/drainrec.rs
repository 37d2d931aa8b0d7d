//! gpufence's own record of the drains it made, what `scontrol show node`
//! says of a node, and the rule that resumes a drain whose cause is gone
//! (`resume_when_clean`).
//!
//! A drain is gpufence's when two things agree: the node's reason starts
//! with `gpufence:` ([`PREFIX`]) and equals the reason gpufence recorded
//! in `state_dir/drain/<node>.json` when it drained ([`DrainHistory`]).
//! Either alone is not enough: anyone can type a reason, and a record says
//! nothing of what an admin did since. The decision ([`decide`]) is pure:
//! the node's state and reason, the record, whether this sweep found the
//! node clean, and the resumes within the window give resume, leave, flap
//! or forget.

use std::io::Read;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::fsutil::{create_dir_all_mode, write_atomic};
use crate::record::{StateDir, StateError};

/// The prefix of every reason gpufence gives a drain (`clean_reason` in
/// `gpufence-node`'s `host::drain` adds it).
pub const PREFIX: &str = "gpufence:";

/// Resume times kept in a record, newest last (older ones are dropped
/// first; only those within `resume_window_s` are counted anyway).
pub const MAX_RESUMES_KEPT: usize = 64;

/// Devices kept in a drain record (the rest are counted in the reason).
pub const MAX_DEVICES: usize = 64;

/// The largest record file read (bytes): a bigger one is corrupt.
pub const MAX_RECORD_BYTES: u64 = 64 * 1024;

/// One drain gpufence made.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainRecord {
    /// The Slurm node drained.
    pub node: String,
    /// The reason exactly as passed to `scontrol update ... reason=`.
    pub reason: String,
    /// When, in seconds since the epoch.
    pub drained_at: i64,
    /// The job whose end drained it (the Epilog), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_id: Option<u32>,
    /// The devices the cause held (`major:minor`), when known; at most
    /// [`MAX_DEVICES`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<String>,
    /// The drain says the node flaps: gpufence never resumes it.
    #[serde(default)]
    pub flapping: bool,
}

/// `state_dir/drain/<node>.json`: the node's current gpufence drain, and
/// the times gpufence resumed it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainHistory {
    /// The drain in force, as gpufence made it; `None` after a resume.
    #[serde(default)]
    pub drain: Option<DrainRecord>,
    /// When gpufence resumed the node (seconds since the epoch), oldest
    /// first, at most [`MAX_RESUMES_KEPT`].
    #[serde(default)]
    pub resumes: Vec<i64>,
}

impl DrainHistory {
    /// The resumes within `window_s` seconds before `now` (both in seconds).
    pub fn resumes_within(&self, now: i64, window_s: u64) -> usize {
        let from = now.saturating_sub(i64::try_from(window_s).unwrap_or(i64::MAX));
        self.resumes.iter().filter(|t| **t > from).count()
    }

    /// Notes a resume at `now`: the drain is cleared, resumes older than
    /// `window_s` are dropped, at most [`MAX_RESUMES_KEPT`] are kept.
    pub fn note_resume(&mut self, now: i64, window_s: u64) {
        let from = now.saturating_sub(i64::try_from(window_s).unwrap_or(i64::MAX));
        self.drain = None;
        self.resumes.retain(|t| *t > from);
        self.resumes.push(now);
        let extra = self.resumes.len().saturating_sub(MAX_RESUMES_KEPT);
        self.resumes.drain(..extra);
    }
}

impl StateDir {
    /// `<state_dir>/drain`: one record per Slurm node drained.
    pub fn drain_dir(&self) -> PathBuf {
        self.root().join("drain")
    }

    /// `<state_dir>/drain/<node>.json`; characters outside
    /// `[A-Za-z0-9._-]` in the name become `_`.
    pub fn drain_path(&self, node: &str) -> PathBuf {
        self.drain_dir()
            .join(format!("{}.json", crate::record::node_file_name(node)))
    }

    /// The drain history of `node`; an empty one when there is no file.
    ///
    /// # Errors
    /// [`StateError::Io`] when the file cannot be read,
    /// [`StateError::Corrupt`] when it is not a history or is larger than
    /// [`MAX_RECORD_BYTES`].
    pub fn read_drain(&self, node: &str) -> Result<DrainHistory, StateError> {
        let p = self.drain_path(node);
        let f = match std::fs::File::open(&p) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(DrainHistory::default())
            }
            Err(source) => return Err(StateError::Io { path: p, source }),
        };
        let mut bytes = Vec::new();
        f.take(MAX_RECORD_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|source| StateError::Io {
                path: p.clone(),
                source,
            })?;
        if bytes.len() as u64 > MAX_RECORD_BYTES {
            return Err(StateError::Corrupt {
                path: p,
                msg: format!("larger than {MAX_RECORD_BYTES} bytes"),
            });
        }
        serde_json::from_slice(&bytes).map_err(|e| StateError::Corrupt {
            path: p,
            msg: e.to_string(),
        })
    }

    /// Writes the drain history of `node` atomically, root-only (`0600` in
    /// a `0700` directory).
    ///
    /// # Errors
    /// [`StateError::Io`].
    pub fn write_drain(&self, node: &str, h: &DrainHistory) -> Result<(), StateError> {
        let dir = self.drain_dir();
        create_dir_all_mode(&dir, 0o700).map_err(|source| StateError::Io {
            path: dir.clone(),
            source,
        })?;
        let p = self.drain_path(node);
        let bytes = serde_json::to_vec_pretty(h).map_err(|e| StateError::Corrupt {
            path: p.clone(),
            msg: e.to_string(),
        })?;
        write_atomic(&p, &bytes, 0o600).map_err(|source| StateError::Io { path: p, source })
    }
}

/// A node as `scontrol show node <name>` prints it (Slurm's
/// `slurm_sprint_node_table`, `src/api/node_info.c`): `State=` is the base
/// state and its flags joined by `+` (`IDLE+DRAIN`, `MIXED+DRAIN`,
/// `DOWN+DRAIN+NOT_RESPONDING`), and `Reason=` runs to the end of its own
/// line as `Reason=<reason> [<user>@<time>]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeShow {
    /// The `State=` value, e.g. `IDLE+DRAIN`.
    pub state: String,
    /// The reason without Slurm's ` [user@time]` suffix; `None` when the
    /// node has none.
    pub reason: Option<String>,
}

/// State words that keep a drained node as it is whatever gpufence found:
/// another cause (slurmd not answering, a reboot, maintenance) that
/// `state=resume` would wrongly clear or that is not gpufence's to judge
/// (`node_state_string`, `src/common/slurm_protocol_defs.c`).
pub const NOT_OURS: &[&str] = &[
    "DOWN",
    "FAIL",
    "FAILING",
    "MAINT",
    "REBOOT_REQUESTED",
    "REBOOT_ISSUED",
    "POWER_DOWN",
    "POWERED_DOWN",
    "POWERING_DOWN",
    "NOT_RESPONDING",
    "INVALID_REG",
];

impl NodeShow {
    /// The state's words (`IDLE+DRAIN` → `IDLE`, `DRAIN`), upper case,
    /// without sinfo's `*`.
    fn words(&self) -> impl Iterator<Item = String> + '_ {
        self.state
            .split('+')
            .map(|w| w.trim().trim_end_matches('*').to_ascii_uppercase())
    }

    /// Drained or draining: a `DRAIN` flag, or the `DRAINED` / `DRAINING`
    /// names sinfo uses.
    pub fn drained(&self) -> bool {
        self.words()
            .any(|w| matches!(w.as_str(), "DRAIN" | "DRAINED" | "DRAINING"))
    }

    /// The first state word that is another cause ([`NOT_OURS`]), if any.
    pub fn other_cause(&self) -> Option<String> {
        self.words().find(|w| NOT_OURS.contains(&w.as_str()))
    }
}

/// Parses `scontrol show node <name>` output (several lines); `None` when
/// it has no `State=`.
pub fn parse_show_node(text: &str) -> Option<NodeShow> {
    let state = text
        .split_whitespace()
        .find_map(|t| t.strip_prefix("State="))?
        .to_string();
    let reason = text
        .lines()
        .find_map(|l| l.trim_start().strip_prefix("Reason="))
        .map(|r| strip_reason_suffix(r.trim_end()).to_string())
        .filter(|r| !r.is_empty() && r != "(null)");
    Some(NodeShow { state, reason })
}

/// `reason [user@time]` → `reason` (the suffix `slurm_sprint_node_table`
/// adds); text without such a suffix is returned as it is.
fn strip_reason_suffix(r: &str) -> &str {
    if let Some(body) = r.strip_suffix(']') {
        if let Some(i) = body.rfind(" [") {
            if body[i + 2..].contains('@') {
                return &r[..i];
            }
        }
    }
    r
}

/// What a sweep does with the node's drain ([`decide`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Not drained, no record: nothing to do or say.
    Nothing,
    /// `scontrol update state=resume`: the drain is gpufence's and its
    /// cause is gone. `resumes_in_window` counts this one.
    Resume {
        /// Resumes within the window, this one included.
        resumes_in_window: usize,
    },
    /// Drain again with `reason` (the node flaps) and never resume it.
    Flap {
        /// The new reason.
        reason: String,
        /// Resumes within the window.
        resumes_in_window: usize,
    },
    /// Leave the node as it is; the text says why (a note of the sweep).
    Leave(String),
    /// The node is no longer drained (someone resumed it): drop the drain
    /// record (and the resume count, when an admin resumed a flapping
    /// node); the text says so.
    Forget {
        /// The note.
        note: String,
        /// Forget the resumes too (an admin resumed a flapping node).
        reset_resumes: bool,
    },
}

/// How `resume_window_s` reads in a reason: `24h`, `90m`, `45s`.
pub fn window_words(window_s: u64) -> String {
    if window_s.is_multiple_of(3600) {
        format!("{}h", window_s / 3600)
    } else if window_s.is_multiple_of(60) {
        format!("{}m", window_s / 60)
    } else {
        format!("{window_s}s")
    }
}

/// The decision for one node: `show` is what Slurm says now, `hist` what
/// gpufence recorded, `clean` whether this sweep found the cause gone
/// (`Err(why)` when not), `now` in seconds since the epoch, `max` and
/// `window_s` the config's `resume_max` and `resume_window_s`.
///
/// In this order: no record: nothing (a `gpufence:` reason without one is
/// left with a note); not drained: forget; reason not the recorded one
/// (an admin's, or replaced): leave; flapping: leave; another cause in the
/// state (`DOWN`, `MAINT`...): leave; not clean: leave; `max` resumes
/// already within the window: flap; else resume.
pub fn decide(
    show: &NodeShow,
    hist: &DrainHistory,
    clean: Result<(), &str>,
    now: i64,
    max: u32,
    window_s: u64,
) -> Decision {
    let reason = show.reason.as_deref().unwrap_or("");
    let Some(rec) = &hist.drain else {
        if show.drained() && reason.starts_with(PREFIX) {
            return Decision::Leave(format!(
                "node drained with a gpufence reason ({reason}) that gpufence has no record of: left for an admin"
            ));
        }
        return Decision::Nothing;
    };
    if !show.drained() {
        return Decision::Forget {
            note: format!(
                "node {} is no longer drained (state {}): gpufence forgets its drain ({})",
                rec.node, show.state, rec.reason
            ),
            reset_resumes: rec.flapping,
        };
    }
    if reason != rec.reason {
        return Decision::Leave(format!(
            "node {} is drained with another reason than gpufence's ({reason:?}, gpufence drained it with {:?}): an admin's drain, left as it is",
            rec.node, rec.reason
        ));
    }
    if rec.flapping {
        return Decision::Leave(format!(
            "node {} flaps: gpufence resumes it no more; resume it by hand",
            rec.node
        ));
    }
    if let Some(w) = show.other_cause() {
        return Decision::Leave(format!(
            "node {} is {} ({w}): not gpufence's to resume",
            rec.node, show.state
        ));
    }
    if let Err(why) = clean {
        return Decision::Leave(format!("node {} stays drained: {why}", rec.node));
    }
    let n = hist.resumes_within(now, window_s);
    if n >= max as usize {
        let cause = rec
            .reason
            .strip_prefix(PREFIX)
            .unwrap_or(&rec.reason)
            .trim_start();
        return Decision::Flap {
            reason: format!(
                "{PREFIX} flapping: {n} resumes in {}; last cause: {cause}; resume by hand",
                window_words(window_s)
            ),
            resumes_in_window: n,
        };
    }
    Decision::Resume {
        resumes_in_window: n + 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `scontrol show node` of Slurm 22.05 (`slurm_sprint_node_table`),
    /// drained by gpufence.
    const SHOW: &str = "NodeName=n1 Arch=x86_64 CoresPerSocket=1 \n   CPUAlloc=0 CPUTot=2 CPULoad=0.10\n   AvailableFeatures=(null)\n   Gres=gpu:sim:2\n   NodeAddr=127.0.0.1 NodeHostName=n1 Version=22.05.8\n   State=IDLE+DRAIN ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A\n   Partitions=debug \n   CfgTRES=cpu=2,mem=2000M,billing=2\n   Reason=gpufence: sweep: critical unfenced_gpu_holder pid 7 (x): holds 10:237 [root@2026-12-07T11:00:00]\n\n";

    #[test]
    fn show_node_gives_state_and_reason_without_the_suffix() {
        let s = parse_show_node(SHOW).unwrap();
        assert_eq!(s.state, "IDLE+DRAIN");
        assert_eq!(
            s.reason.as_deref(),
            Some("gpufence: sweep: critical unfenced_gpu_holder pid 7 (x): holds 10:237")
        );
        assert!(s.drained());
        assert_eq!(s.other_cause(), None);
        let idle = parse_show_node("NodeName=n1\n   State=IDLE ThreadsPerCore=1\n").unwrap();
        assert_eq!(
            (idle.state.as_str(), idle.reason.as_deref()),
            ("IDLE", None)
        );
        assert!(!idle.drained());
        let down = parse_show_node("   State=DOWN+DRAIN+NOT_RESPONDING x\n   Reason=maint [a@b]\n")
            .unwrap();
        assert!(down.drained());
        assert_eq!(down.other_cause().as_deref(), Some("DOWN"));
        assert_eq!(down.reason.as_deref(), Some("maint"));
        // A reason of brackets without a user@time is the reason.
        assert_eq!(strip_reason_suffix("x [y]"), "x [y]");
        assert!(parse_show_node("Node n1 not found\n").is_none());
        for st in ["MIXED+DRAIN", "DRAINED", "draining", "ALLOCATED+DRAIN"] {
            let s = NodeShow {
                state: st.into(),
                reason: None,
            };
            assert!(s.drained(), "{st}");
        }
    }

    fn rec(reason: &str) -> DrainHistory {
        DrainHistory {
            drain: Some(DrainRecord {
                node: "n1".into(),
                reason: reason.into(),
                drained_at: 1000,
                job_id: Some(5),
                devices: vec!["10:237".into()],
                flapping: false,
            }),
            resumes: Vec::new(),
        }
    }

    fn show(state: &str, reason: Option<&str>) -> NodeShow {
        NodeShow {
            state: state.into(),
            reason: reason.map(String::from),
        }
    }

    const R: &str = "gpufence: job 5: pid 7 (x) survived SIGKILL holding 10:237";

    #[test]
    fn decisions() {
        let drained = show("IDLE+DRAIN", Some(R));
        let h = rec(R);
        assert_eq!(
            decide(&drained, &h, Ok(()), 5000, 3, 86400),
            Decision::Resume {
                resumes_in_window: 1
            }
        );
        // Not clean: left, saying why.
        match decide(&drained, &h, Err("1 unfenced holder"), 5000, 3, 86400) {
            Decision::Leave(n) => assert!(n.contains("1 unfenced holder"), "{n}"),
            d => panic!("{d:?}"),
        }
        // An admin's drain, no record: nothing; a gpufence reason and no
        // record: left with a note.
        assert_eq!(
            decide(
                &show("IDLE+DRAIN", Some("maintenance")),
                &DrainHistory::default(),
                Ok(()),
                5000,
                3,
                86400
            ),
            Decision::Nothing
        );
        assert!(matches!(
            decide(&drained, &DrainHistory::default(), Ok(()), 5000, 3, 86400),
            Decision::Leave(_)
        ));
        // The reason replaced by an admin's (or another gpufence reason).
        for other in ["maintenance", "gpufence: job 6: other"] {
            match decide(&show("IDLE+DRAIN", Some(other)), &h, Ok(()), 5000, 3, 86400) {
                Decision::Leave(n) => assert!(n.contains("another reason"), "{n}"),
                d => panic!("{d:?}"),
            }
        }
        // No reason at all is not ours either.
        assert!(matches!(
            decide(&show("IDLE+DRAIN", None), &h, Ok(()), 5000, 3, 86400),
            Decision::Leave(_)
        ));
        // Down, or in maintenance: not ours.
        assert!(matches!(
            decide(
                &show("DOWN+DRAIN+NOT_RESPONDING", Some(R)),
                &h,
                Ok(()),
                5000,
                3,
                86400
            ),
            Decision::Leave(_)
        ));
        // Resumed by someone: forget.
        assert_eq!(
            decide(&show("IDLE", None), &h, Ok(()), 5000, 3, 86400),
            Decision::Forget {
                note: format!(
                    "node n1 is no longer drained (state IDLE): gpufence forgets its drain ({R})"
                ),
                reset_resumes: false
            }
        );
        // Not drained, no record: nothing.
        assert_eq!(
            decide(
                &show("IDLE", None),
                &DrainHistory::default(),
                Ok(()),
                5000,
                3,
                86400
            ),
            Decision::Nothing
        );
    }

    #[test]
    fn the_third_resume_in_a_window_flaps() {
        let drained = show("IDLE+DRAIN", Some(R));
        let mut h = rec(R);
        h.resumes = vec![100, 4000, 4500];
        // 100 is outside the window of 4000 s before 5000: two count.
        assert_eq!(h.resumes_within(5000, 4000), 2);
        assert_eq!(
            decide(&drained, &h, Ok(()), 5000, 3, 4000),
            Decision::Resume {
                resumes_in_window: 3
            }
        );
        match decide(&drained, &h, Ok(()), 5000, 3, 86400) {
            Decision::Flap {
                reason,
                resumes_in_window,
            } => {
                assert_eq!(resumes_in_window, 3);
                assert_eq!(
                    reason,
                    "gpufence: flapping: 3 resumes in 24h; last cause: job 5: pid 7 (x) survived SIGKILL holding 10:237; resume by hand"
                );
            }
            d => panic!("{d:?}"),
        }
        // Flapping: never resumed, even clean; an admin's resume resets.
        let mut f = h.clone();
        if let Some(d) = f.drain.as_mut() {
            d.flapping = true;
        }
        assert!(matches!(
            decide(&drained, &f, Ok(()), 5000, 3, 86400),
            Decision::Leave(_)
        ));
        assert!(matches!(
            decide(&show("IDLE", None), &f, Ok(()), 5000, 3, 86400),
            Decision::Forget {
                reset_resumes: true,
                ..
            }
        ));
        assert_eq!(window_words(5400), "90m");
        assert_eq!(window_words(45), "45s");
    }

    #[test]
    fn the_record_round_trips_bounded_and_root_only() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let st = StateDir::new(d.path());
        assert_eq!(st.read_drain("n1").unwrap(), DrainHistory::default());
        let mut h = rec(R);
        st.write_drain("n/1", &h).unwrap();
        let p = st.drain_path("n/1");
        assert_eq!(p, d.path().join("drain/n_1.json"));
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(
            std::fs::metadata(st.drain_dir())
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o700
        );
        assert_eq!(st.read_drain("n/1").unwrap(), h);
        for t in 0..100 {
            h.note_resume(10_000 + t, 86400);
        }
        assert_eq!(h.drain, None);
        assert_eq!(h.resumes.len(), MAX_RESUMES_KEPT);
        assert_eq!(h.resumes.last(), Some(&10_099));
        // Old resumes fall out of the window when the next one is noted.
        h.note_resume(1_000_000, 60);
        assert_eq!(h.resumes, vec![1_000_000]);
        std::fs::write(&p, "{").unwrap();
        assert!(matches!(
            st.read_drain("n/1"),
            Err(StateError::Corrupt { .. })
        ));
        std::fs::write(&p, vec![b' '; MAX_RECORD_BYTES as usize + 1]).unwrap();
        assert!(matches!(
            st.read_drain("n/1"),
            Err(StateError::Corrupt { .. })
        ));
    }
}
