//! What a job leaves behind besides processes: its files in the
//! shared-memory directory ([`crate::holders::shm`]), reported (and on
//! request removed) by the Epilog.

use gpufence_model::audit::{events, AuditEvent};
use gpufence_model::record::JobRecord;

use crate::job::outcome::EpilogError;
use crate::Node;

/// Step 5d of [`crate::job::epilog::run_with`]: the job's leftovers in `shm_dir` (regular
/// files of the job's user, changed since its record was made, held by no
/// process: [`crate::holders::shm::leftovers`]) go into one `shm_leftovers` audit
/// line, and with `shm_remove_leftovers` are removed, unless another job
/// of the user has a record on the node (its files look the same) or a
/// live process could not be read within `scan_budget_ms` (cut by the
/// Epilog's deadline, [`crate::host::deadline::Wait::ScanBudget`]): it may
/// hold them ([`crate::holders::shm::Leftovers::unread`]), so they are
/// kept and the note and the line say why. The
/// line lists the first files by name within [`LISTED_BYTES`], then
/// counts them all (`files_total`, `bytes_total`; `examined_all` false
/// when the directory had more entries than one Epilog examines). What
/// failed goes to `errors`, what was found to `notes` (the Epilog's).
pub(crate) fn report(
    node: &Node,
    rec: &JobRecord,
    errors: &mut Vec<EpilogError>,
    notes: &mut Vec<String>,
) {
    let since = chrono::DateTime::parse_from_rfc3339(&rec.created)
        .ok()
        .map(std::time::SystemTime::from);
    let within = node.bound(
        crate::host::deadline::Wait::ScanBudget,
        std::time::Duration::from_millis(node.cfg.scan_budget_ms),
    );
    let found = crate::holders::shm::leftovers(&node.cfg.shm_dir, &|u| u == rec.uid, since, within);
    let files = &found.files;
    if files.is_empty() {
        return;
    }
    let others = other_jobs_of(node, rec);
    let unread = (found.unread > 0).then(|| {
        format!(
            "{} process(es) not read within {} ms: they may hold them",
            found.unread,
            within.as_millis()
        )
    });
    let (removed, why_not): (bool, Option<String>) = if !node.cfg.shm_remove_leftovers {
        (false, unread.clone())
    } else if let Some(u) = &unread {
        (false, Some(format!("not removed: {u}")))
    } else if !others.is_empty() {
        (
            false,
            Some(format!(
                "not removed: job(s) {others:?} of the same user run on this node"
            )),
        )
    } else {
        let failed = crate::holders::shm::remove(&node.cfg.shm_dir, files);
        // One error line for all of them: a user decides how many there are.
        if let Some((name, e)) = failed.first() {
            errors.push(EpilogError::ShmRemove {
                path: node.cfg.shm_dir.join(name),
                reason: e.clone(),
                more: failed.len() - 1,
            });
        }
        (failed.is_empty(), None)
    };
    let total = found.bytes();
    notes.push(format!(
        "{}{} file(s) ({total} bytes) left in {}{}",
        if found.complete { "" } else { "at least " },
        files.len(),
        node.cfg.shm_dir.display(),
        match (&unread, &why_not) {
            _ if removed => ": removed".to_string(),
            (Some(_), Some(w)) => format!(" ({w})"),
            _ => String::new(),
        }
    ));
    let listed = listed_within(files, LISTED_BYTES);
    let mut ev = AuditEvent::new(events::SHM_LEFTOVERS)
        .job(rec.job_id)
        .uid(rec.uid)
        .field("dir", node.cfg.shm_dir.display().to_string())
        .field("files_total", files.len())
        .field("bytes_total", total)
        .field("files_listed", listed.len())
        .field("examined_all", found.complete)
        .field("files", listed)
        .field("removed", removed)
        .field("processes_unread", found.unread);
    if let Some(w) = why_not {
        ev = ev.field("note", w);
    }
    if let Err(e) = node.audit(ev) {
        errors.push(EpilogError::Audit(e));
    }
}

/// How many bytes of file entries one `shm_leftovers` line lists: the line
/// stays under 64 KiB however many files a job leaves (the rest of it is
/// a few hundred bytes; the counts and total cover what is not listed).
pub const LISTED_BYTES: usize = 60 << 10;

/// The first of `files` (by name) as audit entries, as many as fit in
/// `budget` bytes of JSON.
fn listed_within(files: &[crate::holders::shm::Leftover], budget: usize) -> Vec<serde_json::Value> {
    let mut used = 0;
    let mut out = Vec::new();
    for f in files {
        let v = serde_json::json!({
            "name": gpufence_model::text::printable(&f.name),
            "size_bytes": f.size_bytes,
            "mode": f.mode,
        });
        // The entry and its separating comma.
        let len = v.to_string().len() + 1;
        if used + len > budget {
            break;
        }
        used += len;
        out.push(v);
    }
    out
}

/// Jobs other than `rec`'s with a record on this node for the same user.
fn other_jobs_of(node: &Node, rec: &JobRecord) -> Vec<u32> {
    node.state
        .recorded_jobs()
        .into_iter()
        .filter(|j| *j != rec.job_id)
        .filter(|j| {
            node.state
                .read_record(*j)
                .ok()
                .flatten()
                .is_some_and(|r| r.uid == rec.uid)
        })
        .collect()
}
