//! The Epilog: revoke the job's grant, then prove nothing still holds the
//! job's devices.
//!
//! Order: revoke (from now on nothing new opens the devices) → find every
//! process whose descriptors point at the job's devices and that is neither
//! in a cgroup with a live grant for that device nor exempt → for each,
//! evidence first, then SIGKILL and check it is gone → in the `own` layout,
//! kill what is left in the job's cgroup and remove it → forget the record.
//! Exit 0 when the node is clean (also after kills); non-zero when anything
//! survives or a grant could not be revoked (Slurm then drains the node).

use std::collections::BTreeSet;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use gpufence_cgroup::fence::{Fence, GrantEntry};
use gpufence_model::audit::{events, AuditEvent};
use gpufence_model::config::Layout;
use gpufence_model::device::DevNum;

use crate::evidence;
use crate::scan::{self, Holder};
use crate::Node;

/// A process found holding the job's devices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lingering {
    /// The process.
    pub pid: i32,
    /// Its cgroup.
    pub cgroup: Option<String>,
    /// The devices it holds without a grant.
    pub devices: Vec<DevNum>,
    /// The evidence file, when written.
    pub evidence: Option<std::path::PathBuf>,
    /// Whether it is gone now.
    pub gone: bool,
}

/// What the epilog did.
#[derive(Clone, Debug, Default)]
pub struct EpilogOutcome {
    /// Grants removed from the fence.
    pub revoked: Vec<GrantEntry>,
    /// Processes that held the job's devices.
    pub lingering: Vec<Lingering>,
    /// Problems that make the node unsafe (non-zero exit).
    pub errors: Vec<String>,
    /// Things worth a line that do not fail the epilog.
    pub notes: Vec<String>,
}

impl EpilogOutcome {
    /// Whether the node is clean: nothing survived and every revoke worked.
    pub fn clean(&self) -> bool {
        self.errors.is_empty() && self.lingering.iter().all(|l| l.gone)
    }
}

fn pidfd_open(pid: i32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open(2) returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Sends SIGKILL through `pidfd` and waits up to `wait` for the process to
/// exit. Returns whether it is gone.
fn kill_and_wait(pidfd: &OwnedFd, wait: Duration) -> bool {
    // SAFETY: pidfd_send_signal(2) on a pidfd we own.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return true;
    }
    let deadline = Instant::now() + wait;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut pfd = libc::pollfd {
            fd: pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // A pidfd becomes readable when the process exits (zombie or reaped).
        // SAFETY: poll on one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(i32::MAX as u128) as i32) };
        if n > 0 {
            return true;
        }
        if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        return false;
    }
}

/// Whether `holder` may hold `dev`: some cgroup ancestor is exempt or holds a
/// live grant for it.
fn covered(node: &Node, fence: Option<&Fence>, cgroup: Option<&str>, dev: DevNum) -> bool {
    let (Some(fence), Some(cg)) = (fence, cgroup) else {
        return false;
    };
    node.cg.ancestry(cg).into_iter().any(|(_, id)| {
        fence.is_exempt(id).unwrap_or(false) || fence.lookup(id, dev).ok().flatten().is_some()
    })
}

/// Runs the epilog for `job_id`.
pub fn run(node: &Node, job_id: u32) -> EpilogOutcome {
    let mut out = EpilogOutcome::default();
    let rec = match node.state.read_record(job_id) {
        Ok(r) => r,
        Err(e) => {
            out.errors.push(e.to_string());
            None
        }
    };
    let fence = match Fence::open(&node.cfg.bpffs_dir) {
        Ok(f) => Some(f),
        Err(e) => {
            out.notes.push(format!("no fence to revoke from: {e}"));
            None
        }
    };
    // 1. Revoke.
    if let Some(f) = &fence {
        match f.revoke_job(job_id) {
            Ok(gone) => out.revoked = gone,
            Err(e) => out
                .errors
                .push(format!("revoking job {job_id}'s grant: {e}")),
        }
    }
    let mut devs: BTreeSet<DevNum> = rec
        .iter()
        .flat_map(|r| r.devices.iter().map(|d| d.dev))
        .collect();
    devs.extend(out.revoked.iter().map(|e| e.dev));
    if !out.revoked.is_empty() || rec.as_ref().is_some_and(|r| !r.devices.is_empty()) {
        let cgroups: BTreeSet<u64> = out.revoked.iter().map(|e| e.cgroup_id).collect();
        let ev = AuditEvent::new(events::GRANT_REVOKED)
            .job(job_id)
            .devices(devs.iter())
            .field("cgroup_ids", cgroups.into_iter().collect::<Vec<_>>())
            .field("entries", out.revoked.len());
        let ev = match &rec {
            Some(r) => ev.uid(r.uid),
            None => ev,
        };
        if let Err(e) = node.audit(ev) {
            out.errors.push(e.to_string());
        }
    }

    // 2. Find holders not covered by a live grant or an exemption.
    for h in scan::holders(&devs) {
        handle_holder(node, fence.as_ref(), job_id, h, &mut out);
    }

    // 3. Own layout: the job's cgroup goes with the job.
    if node.cfg.layout == Layout::Own {
        let job_cg = node.own_job_cgroup(job_id);
        if node.cg.path(&job_cg).exists() {
            let left = node.cg.procs_recursive(&job_cg);
            if !left.is_empty() {
                out.notes.push(format!(
                    "killing {} leftover process(es) in /{job_cg}",
                    left.len()
                ));
                let _ = node.cg.kill(&job_cg);
            }
            let deadline = Instant::now() + Duration::from_millis(node.cfg.kill_wait_ms);
            loop {
                match node.cg.remove_tree(&job_cg) {
                    Ok(()) => break,
                    Err(_) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(10))
                    }
                    Err(e) => {
                        out.errors.push(format!(
                            "{e} (processes left: {:?})",
                            node.cg.procs_recursive(&job_cg)
                        ));
                        break;
                    }
                }
            }
        }
    }

    // 4. Forget the job, unless its grant is still in the fence.
    if out.errors.iter().all(|e| !e.starts_with("revoking")) {
        if let Err(e) = node
            .state
            .remove_record(job_id)
            .and_then(|_| node.state.remove_applied(job_id))
        {
            out.errors.push(e.to_string());
        }
    }
    out
}

fn handle_holder(
    node: &Node,
    fence: Option<&Fence>,
    job_id: u32,
    h: Holder,
    out: &mut EpilogOutcome,
) {
    let cgroup = node.cg.cgroup_of(h.pid).ok();
    let uncovered: Vec<DevNum> = h
        .devices()
        .into_iter()
        .filter(|d| !covered(node, fence, cgroup.as_deref(), *d))
        .collect();
    if uncovered.is_empty() {
        return;
    }
    // Pin the process's identity before anything else, so the kill can
    // never hit a recycled pid.
    let Some(pidfd) = pidfd_open(h.pid) else {
        return; // gone already
    };
    let fds: Vec<_> = h
        .fds
        .iter()
        .filter(|f| uncovered.contains(&f.dev))
        .cloned()
        .collect();
    let ev = evidence::collect(
        h.pid,
        job_id,
        "holds a device of an ended job outside any grant",
        fds,
        cgroup.clone(),
    );
    let mut l = Lingering {
        pid: h.pid,
        cgroup: cgroup.clone(),
        devices: uncovered.clone(),
        evidence: None,
        gone: false,
    };
    match evidence::write(&node.cfg.evidence_dir, &ev) {
        Ok(p) => l.evidence = Some(p),
        Err(e) => out.errors.push(format!("evidence for pid {}: {e}", h.pid)),
    }
    let audit = |name: &str| {
        let mut a = AuditEvent::new(name)
            .job(job_id)
            .pid(h.pid)
            .devices(uncovered.iter())
            .field(
                "cgroup",
                cgroup
                    .as_deref()
                    .map(|c| format!("/{c}"))
                    .unwrap_or_default(),
            )
            .field("comm", ev.comm.clone().unwrap_or_default());
        if let Some(u) = ev.uid {
            a = a.uid(u);
        }
        if let Some(p) = &l.evidence {
            a = a.field("evidence", p.display().to_string());
        }
        a
    };
    if let Err(e) = node.audit(audit(events::LINGERING_PROCESS)) {
        out.errors.push(e.to_string());
    }
    l.gone = kill_and_wait(&pidfd, Duration::from_millis(node.cfg.kill_wait_ms));
    let name = if l.gone {
        events::PROCESS_KILLED
    } else {
        events::SURVIVOR
    };
    if let Err(e) = node.audit(audit(name)) {
        out.errors.push(e.to_string());
    }
    out.lingering.push(l);
}
