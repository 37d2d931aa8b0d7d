//! Who holds a GPU outside every grant: descriptors, mappings, rings, NVML.

use std::collections::{BTreeMap, BTreeSet};

use gpufence_cgroup::fence::GrantEntry;
use gpufence_model::device::DevNum;
use serde_json::json;

use super::procs::Walk;
use super::{check_failed, config_exempt, dev_list, Finding, Kind, Severity, Sweep};

/// The end of a finding's summary while the fence runs in audit mode.
const AUDIT_NOTE: &str = " (the fence runs in audit mode: enforcing, it would deny this; `gpufence denials --by-cgroup` lists what it would deny and suggests exemptions for system services)";
use crate::holders::cover::covered;
use crate::holders::scan::{HeldFd, Via};
use crate::response::evidence::GpuMemory;

/// What a process holds outside every grant, by descriptor and per NVML.
#[derive(Default)]
pub(super) struct Holding {
    pub(super) devices: BTreeSet<DevNum>,
    pub(super) fds: Vec<HeldFd>,
    pub(super) gpu_memory: Vec<GpuMemory>,
}

impl Sweep<'_> {
    /// Processes holding protected devices by descriptor that no grant
    /// or exemption covers.
    pub(super) fn descriptor_holders(&mut self, walk: &Walk) -> BTreeMap<i32, Holding> {
        let node = self.node;
        let mut holding = BTreeMap::new();
        for (pid, fds) in &walk.holders {
            let m = self.procs.meta(*pid);
            let cg = m.cgroup.as_deref();
            let devs: BTreeSet<DevNum> = fds
                .iter()
                .map(|f| f.dev)
                .filter(|d| {
                    !config_exempt(node, cg, m.uid)
                        && !covered(node, self.fence.as_ref(), cg, m.uid, *d)
                })
                .collect();
            if devs.is_empty() {
                continue;
            }
            let fds = fds
                .iter()
                .filter(|f| devs.contains(&f.dev))
                .cloned()
                .collect();
            holding.insert(
                *pid,
                Holding {
                    devices: devs,
                    fds,
                    gpu_memory: Vec::new(),
                },
            );
        }
        holding
    }

    /// NVML: processes on GPUs no grant covers (added to `holding`), and
    /// GPUs in use with no live grant.
    pub(super) fn gpus(&mut self, live: &[GrantEntry], holding: &mut BTreeMap<i32, Holding>) {
        let node = self.node;
        let gpus = node.open_gpus();
        if let Some(why) = &gpus.unavailable {
            self.report.notes.push(format!(
                "NVML unavailable ({why}): descriptor scan only, GPU use not checked"
            ));
            return;
        }
        let queried = gpus.minors().and_then(|minors| {
            let info = gpus.query(&minors)?;
            let util = gpus.utilization(&minors)?;
            Ok((info, util))
        });
        let (info, util) = match queried {
            Ok(q) => q,
            Err(e) => {
                self.findings.push(check_failed("NVML", e.to_string()));
                return;
            }
        };
        let gpu_major = node.gpu_major();
        let me = std::process::id() as i32;
        let util: BTreeMap<u32, Option<(u32, u32)>> = util
            .into_iter()
            .map(|u| (u.minor, u.gpu.zip(u.memory)))
            .collect();
        let granted: BTreeSet<u32> = live
            .iter()
            .filter(|e| e.dev.major == gpu_major)
            .map(|e| e.dev.minor)
            .collect();
        let idle_max = (node.cfg.idle_memory_mib + node.cfg.memory_tolerance_mib) << 20;
        for g in &info {
            let dev = DevNum::new(gpu_major, g.minor);
            // Processes NVML lists: no exemption covers them (`pids`),
            // an exemption does (`exempt_pids`), or out of scope.
            let mut pids = Vec::new();
            let mut exempt_pids = Vec::new();
            let mut listed_others = false;
            for p in &g.processes {
                let Ok(pid) = i32::try_from(p.pid) else {
                    continue;
                };
                if pid <= 0 || pid == me {
                    continue;
                }
                let m = self.procs.meta(pid);
                let cg = m.cgroup.as_deref();
                if !self.in_scope(cg) {
                    // Someone's, outside the swept subtree: not named, but
                    // the GPU's use is not an exempt daemon's.
                    listed_others = true;
                    continue;
                }
                if config_exempt(node, cg, m.uid)
                    || cg.is_some_and(|c| {
                        crate::holders::cover::exemption(node, self.fence.as_ref(), c, m.uid)
                            .is_some()
                    })
                {
                    exempt_pids.push(pid);
                    continue;
                }
                pids.push(pid);
                if covered(node, self.fence.as_ref(), cg, m.uid, dev) {
                    continue;
                }
                let h = holding.entry(pid).or_default();
                h.devices.insert(dev);
                h.gpu_memory.push(GpuMemory {
                    minor: g.minor,
                    uuid: g.uuid.clone(),
                    used_bytes: p.used_memory,
                });
            }
            if granted.contains(&g.minor) {
                continue;
            }
            let u = util.get(&g.minor).copied().flatten();
            let utilised = u.is_some_and(|(gu, mu)| gu > 0 || mu > 0);
            let mem_busy = g.memory_used > idle_max;
            if !utilised && !mem_busy && pids.is_empty() {
                continue;
            }
            // Busy without a grant means someone else's use: a GPU whose
            // only processes are exempt daemons (DCGM's host engine
            // running `dcgmi diag`, Fabric Manager) is theirs to use.
            if pids.is_empty() && !exempt_pids.is_empty() && !listed_others {
                continue;
            }
            let severity = if self.audit {
                Severity::Low
            } else if pids.is_empty() && !listed_others {
                node.cfg
                    .busy_without_process_severity
                    .parse()
                    .unwrap_or(Severity::High)
            } else {
                Severity::High
            };
            let mut why = Vec::new();
            if let Some((gu, mu)) = u.filter(|_| utilised) {
                why.push(format!("{gu}% GPU / {mu}% memory utilisation"));
            }
            if mem_busy {
                why.push(format!("{} MiB of memory in use", g.memory_used >> 20));
            }
            if !pids.is_empty() {
                why.push(format!("processes {pids:?}"));
            }
            if pids.is_empty() && !listed_others {
                why.push("no process listed".into());
            }
            self.findings.push(
                Finding::new(
                    Kind::GpuBusyWithoutGrant,
                    format!(
                        "GPU /dev/nvidia{} ({}) is in use with no live grant on it: {}{}",
                        g.minor,
                        g.uuid,
                        why.join(", "),
                        if self.audit { AUDIT_NOTE } else { "" }
                    ),
                    json!({
                        "minor": g.minor, "uuid": g.uuid, "pci_bus_id": g.pci_bus_id,
                        "utilization_gpu": u.map(|x| x.0), "utilization_memory": u.map(|x| x.1),
                        "memory_used_bytes": g.memory_used, "memory_total_bytes": g.memory_total,
                        "idle_threshold_bytes": idle_max, "pids": pids, "exempt_pids": exempt_pids,
                        "fence_mode": if self.audit { "audit" } else { "enforce" },
                    }),
                )
                .severity(severity),
            );
        }
    }

    /// Processes the `/proc` walk did not read whole within
    /// `scan_budget_ms` ([`Walk::not_read`]): they may hold a GPU. One
    /// outside every job cgroup that no exemption covers (for its uid) is
    /// a critical `not_read_whole` finding (`--drain` drains with a reason
    /// naming it); one in a job cgroup is medium (its job's Epilog judges
    /// it). Never ended: the sweep reports.
    pub(super) fn not_read(&mut self, walk: &Walk) {
        let node = self.node;
        for (pid, why) in &walk.not_read {
            let m = self.procs.meta(*pid);
            let cg = m.cgroup.as_deref();
            if config_exempt(node, cg, m.uid)
                || cg.is_some_and(|c| {
                    crate::holders::cover::exemption(node, self.fence.as_ref(), c, m.uid).is_some()
                })
            {
                continue;
            }
            let job = cg.and_then(|c| {
                c.split('/')
                    .find(|d| crate::host::slurm_cgroup::is_job_dir(d))
                    .map(str::to_string)
            });
            let mut f = Finding::new(
                Kind::NotReadWhole,
                format!(
                    "pid {pid} not read whole within scan_budget_ms ({} ms): {why}; it may hold a GPU outside every grant{}; `gpufence respond {pid}` ends it",
                    node.cfg.scan_budget_ms,
                    job.as_deref()
                        .map(|j| format!(" (in job cgroup {j}: its Epilog judges it)"))
                        .unwrap_or_default(),
                ),
                json!({
                    "not_read": why, "budget_ms": node.cfg.scan_budget_ms,
                    "job_cgroup": job, "cmdline": m.cmdline,
                }),
            )
            .who(&m);
            if job.is_some() {
                f = f.severity(Severity::Medium);
            }
            self.findings.push(f);
        }
    }

    pub(super) fn report_holders(&mut self, holding: BTreeMap<i32, Holding>) {
        for (pid, h) in holding {
            let m = self.procs.meta(pid);
            let how: Vec<String> = h
                .fds
                .iter()
                .map(|f| {
                    let via = match f.via {
                        Via::Fd => format!("fd {}", f.fd),
                        Via::ThreadFd => format!("thread {} fd {}", f.tid.unwrap_or(0), f.fd),
                        Via::Mmap => "mapping".into(),
                        Via::IoUring => format!("io_uring fd {}", f.fd),
                        Via::IoUringRegisteredRing => format!(
                            "thread {} io_uring registered ring {}",
                            f.tid.unwrap_or(0),
                            f.fd
                        ),
                    };
                    format!("{} {} ({via})", f.dev, f.path.display())
                })
                .chain(h.gpu_memory.iter().map(|g| {
                    format!(
                        "GPU {} per NVML{}",
                        g.minor,
                        g.used_bytes
                            .map(|b| format!(", {} MiB", b >> 20))
                            .unwrap_or_default()
                    )
                }))
                .collect();
            // In audit mode the fence allowed what it would deny: the
            // finding says so and stays below the drain threshold.
            let kind = if self.audit {
                Kind::AuditGpuHolder
            } else {
                Kind::UnfencedGpuHolder
            };
            self.findings.push(
                Finding::new(
                    kind,
                    format!(
                        "holds {} outside every grant and exemption: {}{}",
                        dev_list(&h.devices),
                        how.join("; "),
                        if self.audit { AUDIT_NOTE } else { "" }
                    ),
                    json!({
                        "devices": h.devices.iter().map(|d| d.to_string()).collect::<Vec<_>>(),
                        "holds": h.fds, "gpu_memory": h.gpu_memory, "cmdline": m.cmdline,
                        "fence_mode": if self.audit { "audit" } else { "enforce" },
                        "would_be_denied": true,
                    }),
                )
                .who(&m),
            );
        }
    }
}
