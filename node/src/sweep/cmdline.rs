//! Command lines and sockets: mining pools, unauthenticated notebooks, wildcard listeners.

use std::collections::BTreeSet;
use std::path::PathBuf;

use gpufence_model::procnet::{TCP_ESTABLISHED, TCP_LISTEN, TCP_SYN_SENT};
use serde_json::json;

// The walk reads each command line's pool URLs (`stratum_urls`, in the
// walk's file so that the walk does not import the checks back).
pub use super::procs::stratum_urls;
use super::procs::{slurm_exe, Walk};
use super::{check_failed, Finding, Kind, Sweep};

/// The arguments that disable a notebook or dashboard server's
/// authentication: a Jupyter trait `--<Class>.token`, `.password` or
/// `.hashed_password` set to nothing (`--ServerApp.token=`, `=''`, `=""`,
/// or an empty next argument), and code-server's `--auth none`.
pub fn auth_disabled(cmdline: &[String]) -> Vec<String> {
    let empty = |v: &str| matches!(v.trim(), "" | "''" | "\"\"");
    let mut out = Vec::new();
    for (i, a) in cmdline.iter().enumerate() {
        if !a.starts_with("--") {
            continue;
        }
        let (key, val, joined) = match a.split_once('=') {
            Some((k, v)) => (k, Some(v.to_string()), true),
            None => (a.as_str(), cmdline.get(i + 1).cloned(), false),
        };
        let k = key.to_ascii_lowercase();
        let jupyter = k.contains('.')
            && (k.ends_with(".token")
                || k.ends_with(".password")
                || k.ends_with(".hashed_password"));
        if jupyter {
            if let Some(v) = val.filter(|v| joined || !v.starts_with("--")) {
                if empty(&v) {
                    out.push(if joined {
                        a.clone()
                    } else {
                        format!("{a} {v:?}")
                    });
                }
            }
        } else if k == "--auth"
            && val
                .as_deref()
                .is_some_and(|v| v.eq_ignore_ascii_case("none"))
        {
            out.push(if joined {
                a.clone()
            } else {
                format!("{a} none")
            });
        }
    }
    out
}

impl Sweep<'_> {
    /// Command lines with a pool URL.
    pub(super) fn stratum(&mut self, walk: &Walk) {
        for (pid, urls) in &walk.stratum {
            let m = self.procs.meta(*pid);
            self.findings.push(
                Finding::new(
                    Kind::MiningCmdline,
                    format!("mining pool URL in its command line: {}", urls.join(" ")),
                    json!({"arguments": urls, "cmdline": m.cmdline}),
                )
                .who(&m),
            );
        }
    }

    /// Each network namespace's TCP tables, read once: wildcard listeners
    /// of users, connections to mining-pool ports.
    pub(super) fn sockets(&mut self, walk: &Walk) {
        let node = self.node;
        let ports: BTreeSet<u16> = node.cfg.mining_ports.iter().copied().collect();
        let max = node.cfg.protected_uid_max;
        for (ns, rep) in &walk.netns {
            for proto in ["tcp", "tcp6"] {
                // Gone since the walk, or no IPv6: nothing to read.
                let path = PathBuf::from(format!("/proc/{rep}/net/{proto}"));
                let Ok(text) = std::fs::read_to_string(&path) else {
                    continue;
                };
                // A table that does not parse is reported, never skipped.
                let table = match gpufence_model::procnet::parse_tcp(&text, &path) {
                    Ok(t) => t,
                    Err(e) => {
                        self.findings
                            .push(check_failed("TCP sockets", e.to_string()));
                        continue;
                    }
                };
                for e in table {
                    let Some(owners) = walk.sockets.get(&e.inode) else {
                        continue;
                    };
                    let (local_address, remote_address) = (e.local, e.remote);
                    let listen = e.state == TCP_LISTEN;
                    if listen && local_address.ip().is_unspecified() {
                        let m = self.procs.meta(owners[0]);
                        if e.uid <= max && m.uid.is_none_or(|u| u <= max) {
                            continue;
                        }
                        let mut off = Vec::new();
                        for pid in owners {
                            off.extend(auth_disabled(&self.procs.meta(*pid).cmdline));
                        }
                        if off.is_empty() && owners.iter().all(|p| slurm_exe(node, *p)) {
                            continue;
                        }
                        let ev = json!({
                            "proto": proto, "local": local_address.to_string(),
                            "socket_uid": e.uid, "inode": e.inode, "netns": ns,
                            "pids": owners, "cmdline": m.cmdline, "auth_disabled": off,
                        });
                        let f = if off.is_empty() {
                            Finding::new(
                                Kind::WildcardListener,
                                format!("listens on {} ({proto}, every address)", local_address),
                                ev,
                            )
                        } else {
                            Finding::new(
                                Kind::UnauthenticatedNotebook,
                                format!(
                                    "listens on {} ({proto}, every address) with authentication disabled: {}",
                                    local_address,
                                    off.join(" ")
                                ),
                                ev,
                            )
                        };
                        self.findings.push(f.who(&m));
                    } else if matches!(e.state, TCP_ESTABLISHED | TCP_SYN_SENT)
                        && ports.contains(&remote_address.port())
                    {
                        let m = self.procs.meta(owners[0]);
                        self.findings.push(
                            Finding::new(
                                Kind::MiningConnection,
                                format!(
                                    "TCP connection to {} (a mining-pool port) from {}",
                                    remote_address, local_address
                                ),
                                json!({
                                    "proto": proto, "local": local_address.to_string(),
                                    "remote": remote_address.to_string(),
                                    "state": if e.state == TCP_SYN_SENT { "SynSent" } else { "Established" },
                                    "inode": e.inode,
                                    "netns": ns, "pids": owners, "cmdline": m.cmdline,
                                }),
                            )
                            .who(&m),
                        );
                    }
                }
            }
        }
    }
}
