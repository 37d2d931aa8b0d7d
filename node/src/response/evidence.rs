//! What is kept about a lingering process before it is killed.
//!
//! One JSON file per process in `evidence_dir`, mode 0600, created with
//! `O_EXCL` (never overwritten): `job<id>-pid<pid>-<utc time>.json`.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;
use sha2::{Digest, Sha256};

use gpufence_model::fsutil::{create_dir_all_mode, write_new};
use gpufence_model::record::now_rfc3339;

use crate::holders::scan::HeldFd;
use crate::response::engine::Stopped;
use crate::NodeError;

/// Evidence about one process.
#[derive(Clone, Debug, Serialize)]
pub struct Evidence {
    /// When it was collected (RFC 3339).
    pub collected: String,
    /// The job whose devices it holds.
    pub job_id: u32,
    /// Why it is here.
    pub reason: String,
    /// Process id.
    pub pid: i32,
    /// Parent pid.
    pub ppid: Option<i32>,
    /// Real uid.
    pub uid: Option<u32>,
    /// `comm`.
    pub comm: Option<String>,
    /// Command line.
    pub cmdline: Vec<String>,
    /// `readlink /proc/<pid>/exe`.
    pub exe: Option<String>,
    /// SHA-256 of the executable's content, read through `/proc/<pid>/exe`
    /// (works when the file was deleted); of its first `exe_hashed_bytes`
    /// when it is larger than `evidence_hash_max_mib`.
    pub exe_sha256: Option<String>,
    /// How many bytes of the executable were hashed.
    pub exe_hashed_bytes: Option<u64>,
    /// The executable's size in bytes.
    pub exe_size: Option<u64>,
    /// cgroup2 path. JSON: absolute (`/a/b`).
    #[serde(serialize_with = "crate::host::cgpath::option::serialize")]
    pub cgroup: Option<String>,
    /// Start time (RFC 3339), from `/proc/<pid>/stat` and the boot time.
    pub start_time: Option<String>,
    /// The descriptors on the job's devices.
    pub fds: Vec<HeldFd>,
    /// Its sockets, with addresses (from its network namespace's
    /// `/proc/<pid>/net/{tcp,tcp6,udp,udp6}`, matched by socket inode).
    pub sockets: Vec<SocketInfo>,
    /// The container it runs in, when its cgroup path names one.
    pub container: Option<ContainerRef>,
    /// GPU memory it uses per GPU, from NVML.
    pub gpu_memory: Vec<GpuMemory>,
    /// How it was stopped before this was written (`cgroup-freeze`, `SIGSTOP`).
    pub frozen: Option<Stopped>,
    /// What this record leaves out to stay within the response's
    /// [`Budget`] (empty when nothing).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub left_out: Vec<String>,
}

/// Most command-line bytes one record keeps.
pub const MAX_CMDLINE_BYTES: usize = 4096;
/// Most descriptors and sockets one record lists (each).
pub const MAX_LISTED: usize = 64;

/// What the evidence of one response (every holder of one Epilog, Prolog
/// or `gpufence respond`) may cost: each distinct executable (by device
/// and inode) is hashed once, up to `evidence_hash_max_mib` of it, and
/// hashing stops at a deadline (`evidence_time_ms`); the records written
/// together stay within `evidence_max_mib`. What is left out is counted.
#[derive(Debug)]
pub struct Budget {
    per_exe: u64,
    hash_deadline: Instant,
    bytes_left: u64,
    hashed: HashMap<(u64, u64), Option<(String, u64)>>,
    /// Executables not hashed because the time was spent.
    pub hashes_left_out: u32,
    /// Records cut to identity and devices because the bytes were spent.
    pub records_cut: u32,
    /// Records not written at all because the bytes were spent.
    pub records_left_out: u32,
}

impl Budget {
    /// A budget from now: `per_exe` bytes of each executable, hashing for
    /// `time`, `bytes` of records.
    pub fn new(per_exe: u64, time: Duration, bytes: u64) -> Budget {
        Budget {
            per_exe,
            hash_deadline: Instant::now() + time,
            bytes_left: bytes,
            hashed: HashMap::new(),
            hashes_left_out: 0,
            records_cut: 0,
            records_left_out: 0,
        }
    }

    /// The budget the config sets (`evidence_hash_max_mib`,
    /// `evidence_time_ms`, `evidence_max_mib`), from now.
    pub fn from_config(cfg: &gpufence_model::config::Config) -> Budget {
        Budget::new(
            cfg.evidence_hash_max_mib << 20,
            Duration::from_millis(cfg.evidence_time_ms),
            cfg.evidence_max_mib << 20,
        )
    }

    /// [`Budget::from_config`] for `node`, its time cut by the node's
    /// deadline ([`crate::Node::bound`]).
    pub fn for_node(node: &crate::Node) -> Budget {
        let cfg = &node.cfg;
        Budget::new(
            cfg.evidence_hash_max_mib << 20,
            node.bound(
                crate::host::deadline::Wait::Evidence,
                Duration::from_millis(cfg.evidence_time_ms),
            ),
            cfg.evidence_max_mib << 20,
        )
    }

    /// How many executables were hashed.
    pub fn hashed(&self) -> usize {
        self.hashed.values().filter(|h| h.is_some()).count()
    }

    /// One line for the admin when something was left out.
    pub fn summary(&self) -> Option<String> {
        (self.hashes_left_out + self.records_cut + self.records_left_out > 0).then(|| {
            format!(
                "evidence budget: {} executable(s) hashed, {} hash(es) left out (time), {} record(s) cut and {} left out (size)",
                self.hashed(),
                self.hashes_left_out,
                self.records_cut,
                self.records_left_out
            )
        })
    }

    /// The hash of `pid`'s executable: from an earlier holder of the same
    /// file, or read now while time is left.
    fn exe_hash(&mut self, pid: i32, left_out: &mut Vec<String>) -> Option<(String, u64)> {
        let exe = crate::host::procs::live_view(pid).join("exe");
        let st = crate::host::procs::stat_cached(&exe, libc::STATX_SIZE)?;
        let key = (
            libc::makedev(st.stx_dev_major, st.stx_dev_minor),
            st.stx_ino,
        );
        if let Some(h) = self.hashed.get(&key) {
            return h.clone();
        }
        // Opening or reading a FUSE file waits on its daemon, which the
        // process's user may run (`fusermount` is setuid), and a mount in
        // another mount namespace may be a user namespace's (overlayfs
        // over the user's own FUSE reads through to it): only an
        // executable in this process's mount namespace, on no FUSE file
        // system, is read.
        if !same_mount_ns(pid) {
            left_out.push(
                "exe_sha256: the process is in another mount namespace, whose mounts the response does not read through"
                    .into(),
            );
            return None;
        }
        match crate::host::procs::fs_type_of(pid, st.stx_dev_major, st.stx_dev_minor) {
            Some(t) if !t.starts_with("fuse") => {}
            Some(t) => {
                left_out.push(format!(
                    "exe_sha256: the executable is on a {t} file system, whose daemon the response does not wait on"
                ));
                return None;
            }
            None => {
                left_out.push(format!(
                    "exe_sha256: the executable's file system is not in the first {} bytes of the process's mountinfo",
                    crate::host::procs::MOUNTINFO_MAX
                ));
                return None;
            }
        }
        if Instant::now() >= self.hash_deadline {
            self.hashes_left_out += 1;
            left_out.push("exe_sha256: the response's hashing time was spent".into());
            return None;
        }
        let h = sha256_file(&exe, self.per_exe, self.hash_deadline);
        if h.as_ref()
            .is_some_and(|(_, n)| *n < self.per_exe.min(st.stx_size))
        {
            left_out.push(
                "exe_sha256: of the first exe_hashed_bytes only, the response's hashing time ran out"
                    .into(),
            );
        }
        self.hashed.insert(key, h.clone());
        h
    }
}

/// Whether `pid` is in this process's mount namespace (`/proc/<pid>/ns/mnt`
/// names the same namespace as `/proc/self/ns/mnt`; namespaces(7)).
fn same_mount_ns(pid: i32) -> bool {
    let ns = |p: &str| std::fs::read_link(p).ok();
    let mine = ns("/proc/self/ns/mnt");
    mine.is_some() && ns(&format!("/proc/{pid}/ns/mnt")) == mine
}

/// One socket of the process.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SocketInfo {
    /// `tcp`, `tcp6`, `udp`, `udp6`.
    pub proto: &'static str,
    /// Local address and port.
    pub local: String,
    /// Remote address and port.
    pub remote: String,
    /// TCP state (`Listen`, `Established`, ...); `None` for UDP.
    pub state: Option<String>,
    /// Socket inode.
    pub inode: u64,
}

/// A container named by a cgroup path.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ContainerRef {
    /// `docker`, `containerd`, `cri-o`, `podman`.
    pub runtime: &'static str,
    /// The container id (hex).
    pub id: String,
}

/// GPU memory of the process on one GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GpuMemory {
    /// `/dev/nvidia<minor>`.
    pub minor: u32,
    /// The GPU's UUID.
    pub uuid: String,
    /// Bytes, when NVML says.
    pub used_bytes: Option<u64>,
}

/// The container a cgroup path names, for the shapes runtimes use:
/// `docker-<id>.scope` and `docker/<id>` (Docker), `cri-containerd-<id>.scope`
/// (containerd CRI), `crio-<id>.scope` (CRI-O), `libpod-<id>.scope` (Podman).
/// Ids are 12 to 64 lowercase hex digits.
pub fn container_of(cgroup: &str) -> Option<ContainerRef> {
    let hex = |s: &str| {
        (12..=64).contains(&s.len())
            && s.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    };
    let parts: Vec<&str> = cgroup.split('/').collect();
    for (i, part) in parts.iter().enumerate().rev() {
        let scope = part.strip_suffix(".scope").unwrap_or(part);
        for (prefix, runtime) in [
            ("docker-", "docker"),
            ("cri-containerd-", "containerd"),
            ("crio-", "cri-o"),
            ("libpod-", "podman"),
        ] {
            if let Some(id) = scope.strip_prefix(prefix) {
                if hex(id) {
                    return Some(ContainerRef {
                        runtime,
                        id: id.to_string(),
                    });
                }
            }
        }
        if i > 0 && hex(part) && parts[i - 1] == "docker" {
            return Some(ContainerRef {
                runtime: "docker",
                id: part.to_string(),
            });
        }
    }
    None
}

/// The sockets of `pid`, from its fd table and its network namespace's
/// tables, read whole (no deadline: [`sockets_within`] for a response).
pub fn sockets_of(pid: i32) -> Vec<SocketInfo> {
    sockets_within(pid, None).0
}

/// How many descriptors [`sockets_within`] always examines, whatever its
/// deadline: a common process's table is read whole even when the
/// response's evidence time was spent on others.
pub const SOCKET_FDS_ALWAYS: usize = 1024;

/// Most descriptors [`sockets_within`] examines (a `readlink` each, some
/// 10 µs): a table of a million descriptors (`fs.nr_open`) would cost
/// seconds for one record.
pub const SOCKET_FDS_MAX: usize = 65_536;

/// Most bytes of one of a process's `/proc/<pid>/net/{tcp,tcp6,udp,udp6}`
/// tables a record reads (about 150 bytes a socket: some 28,000 sockets);
/// a network namespace's tables grow with the sockets its users make.
pub const NET_TABLE_MAX: usize = 4 << 20;

/// Table `name` of `view`'s network namespace (`<view>/net/<name>`), its
/// first [`NET_TABLE_MAX`] bytes cut back to the last whole line; `name`
/// joins `cuts` when the table was longer. `None` when it cannot be read.
fn net_table(view: &Path, name: &str, cuts: &mut Vec<String>) -> Option<Vec<u8>> {
    use std::io::Read;
    let mut buf = Vec::new();
    std::fs::File::open(view.join("net").join(name))
        .ok()?
        .take(NET_TABLE_MAX as u64 + 1)
        .read_to_end(&mut buf)
        .ok()?;
    if buf.len() > NET_TABLE_MAX {
        buf.truncate(NET_TABLE_MAX);
        let whole = buf.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
        buf.truncate(whole);
        cuts.push(format!("net/{name}"));
    }
    Some(buf)
}

/// The sockets of `pid` as [`sockets_of`], with its descriptor table
/// (the leader's, or a live thread's when the leader exited) read for at
/// most [`SOCKET_FDS_MAX`] descriptors and, past the first
/// [`SOCKET_FDS_ALWAYS`], not after `deadline`. Returns the sockets and,
/// when the table was not read whole, why (the record's `left_out`).
pub fn sockets_within(pid: i32, deadline: Option<Instant>) -> (Vec<SocketInfo>, Option<String>) {
    // A live thread's view when the leader exited: its table is gone.
    let Ok(p) = procfs::process::Process::new_with_root(crate::host::procs::live_view(pid)) else {
        return (Vec::new(), None);
    };
    let mut inodes = std::collections::BTreeSet::new();
    let mut cut = None;
    match p.fd() {
        Ok(fds) => {
            for (n, f) in fds.enumerate() {
                let late = n >= SOCKET_FDS_ALWAYS && deadline.is_some_and(|d| Instant::now() >= d);
                if n >= SOCKET_FDS_MAX || late {
                    cut = Some(format!(
                        "sockets: the descriptor table read up to {n} descriptors ({})",
                        if late {
                            "the response's evidence time was spent"
                        } else {
                            "at most 65,536"
                        }
                    ));
                    break;
                }
                if let Ok(procfs::process::FDInfo {
                    target: procfs::process::FDTarget::Socket(i),
                    ..
                }) = f
                {
                    inodes.insert(i);
                }
            }
        }
        Err(_) => return (Vec::new(), None),
    }
    // No socket: the namespace's tables (as long as a user makes them)
    // are not read at all.
    if inodes.is_empty() {
        return (Vec::new(), cut);
    }
    let mut out = Vec::new();
    let view = crate::host::procs::live_view(pid);
    let si = procfs::current_system_info();
    let mut cuts = Vec::new();
    for proto in ["tcp", "tcp6", "udp", "udp6"] {
        let Some(buf) = net_table(&view, proto, &mut cuts) else {
            continue;
        };
        let rows: Vec<(
            std::net::SocketAddr,
            std::net::SocketAddr,
            Option<String>,
            u64,
        )> = if proto.starts_with("tcp") {
            <procfs::net::TcpNetEntries as procfs::FromBufReadSI>::from_buf_read(&buf[..], si)
                .map(|t| t.0)
                .unwrap_or_default()
                .into_iter()
                .map(|e| {
                    (
                        e.local_address,
                        e.remote_address,
                        Some(format!("{:?}", e.state)),
                        e.inode,
                    )
                })
                .collect()
        } else {
            <procfs::net::UdpNetEntries as procfs::FromBufReadSI>::from_buf_read(&buf[..], si)
                .map(|t| t.0)
                .unwrap_or_default()
                .into_iter()
                .map(|e| (e.local_address, e.remote_address, None, e.inode))
                .collect()
        };
        for (local, remote, state, inode) in rows {
            if inodes.contains(&inode) {
                out.push(SocketInfo {
                    proto,
                    local: local.to_string(),
                    remote: remote.to_string(),
                    state,
                    inode,
                });
            }
        }
    }
    if !cuts.is_empty() {
        let more = format!(
            "sockets: {} read up to {} bytes each",
            cuts.join(", "),
            NET_TABLE_MAX
        );
        cut = Some(match cut {
            Some(c) => format!("{c}; {more}"),
            None => more,
        });
    }
    (out, cut)
}

/// SHA-256 of the first `max` bytes of `p`, and how many were hashed; it
/// stops early at `deadline` (the hash is then of the bytes read so far).
fn sha256_file(p: &Path, max: u64, deadline: Instant) -> Option<(String, u64)> {
    let f = std::fs::File::open(p).ok()?;
    let mut f = f.take(max);
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut total = 0u64;
    loop {
        if Instant::now() >= deadline {
            break;
        }
        let n = f.read(&mut buf).ok()?;
        if n == 0 {
            break;
        }
        total += n as u64;
        h.update(&buf[..n]);
    }
    Some((
        h.finalize().iter().map(|b| format!("{b:02x}")).collect(),
        total,
    ))
}

fn start_time(stat: &procfs::process::Stat) -> Option<String> {
    let btime = procfs::boot_time_secs().ok()?;
    let ticks = procfs::ticks_per_second();
    if ticks == 0 {
        return None;
    }
    let secs = btime as i64 + (stat.starttime / ticks) as i64;
    let nanos = ((stat.starttime % ticks) * 1_000_000_000 / ticks) as u32;
    chrono::DateTime::from_timestamp(secs, nanos)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
}

/// Collects what can still be read about `pid` within `budget`. Fields
/// that cannot be read (the process is exiting, a kernel thread) are
/// `None`; the command line, descriptors and sockets are capped
/// ([`MAX_CMDLINE_BYTES`], [`MAX_LISTED`]), the descriptor table is read
/// for its sockets within the response's evidence time
/// ([`sockets_within`]), and the record says what it left out. Its cost
/// does not grow with the process's threads or tables: the holds come
/// from `found`, never from a walk here.
pub fn collect(
    pid: i32,
    job_id: u32,
    reason: &str,
    found: Found,
    frozen: Option<Stopped>,
    budget: &mut Budget,
) -> Evidence {
    let mut left_out = Vec::new();
    // `exe`, the command line and sockets through a live thread when the
    // leader exited (its own directory shows none of them).
    let view = crate::host::procs::live_view(pid);
    let exe_path = view.join("exe");
    let hashed = budget.exe_hash(pid, &mut left_out);
    let proc = procfs::process::Process::new(pid).ok();
    let proc_view = procfs::process::Process::new_with_root(view).ok();
    let stat = proc.as_ref().and_then(|p| p.stat().ok());
    let status = proc.as_ref().and_then(|p| p.status().ok());
    // Bytes that are not UTF-8 are replaced, never the whole list lost.
    let mut cmdline = crate::host::procs::read_cmdline(pid);
    let mut total = 0;
    if let Some(cut) = cmdline.iter().position(|a| {
        total += a.len() + 1;
        total > MAX_CMDLINE_BYTES
    }) {
        left_out.push(format!(
            "cmdline: {} of {} arguments kept ({MAX_CMDLINE_BYTES} bytes)",
            cut,
            cmdline.len()
        ));
        cmdline.truncate(cut);
    }
    let Found {
        mut fds,
        cgroup,
        gpu_memory,
        unread,
    } = found;
    if let Some(why) = unread {
        left_out.push(format!("fds: the process was not read whole ({why})"));
    }
    let (mut sockets, cut) = sockets_within(pid, Some(budget.hash_deadline));
    left_out.extend(cut);
    for (what, n) in [("fds", fds.len()), ("sockets", sockets.len())] {
        if n > MAX_LISTED {
            left_out.push(format!("{what}: {MAX_LISTED} of {n} listed"));
        }
    }
    fds.truncate(MAX_LISTED);
    sockets.truncate(MAX_LISTED);
    Evidence {
        collected: now_rfc3339(),
        job_id,
        reason: reason.to_string(),
        pid,
        ppid: stat.as_ref().map(|s| s.ppid),
        uid: status.as_ref().map(|s| s.ruid),
        comm: stat.as_ref().map(|s| s.comm.clone()),
        cmdline,
        exe: proc_view
            .as_ref()
            .and_then(|p| p.exe().ok())
            .map(|e| e.display().to_string()),
        exe_sha256: hashed.as_ref().map(|(h, _)| h.clone()),
        exe_hashed_bytes: hashed.as_ref().map(|(_, n)| *n),
        exe_size: crate::host::procs::stat_cached(&exe_path, libc::STATX_SIZE).map(|s| s.stx_size),
        container: cgroup.as_deref().and_then(container_of),
        cgroup,
        start_time: stat.as_ref().and_then(start_time),
        fds,
        sockets,
        gpu_memory,
        frozen,
        left_out,
    }
}

/// What the scan found of a process: its descriptors on the devices, its
/// cgroup, its GPU memory per NVML.
#[derive(Clone, Debug, Default)]
pub struct Found {
    /// Its descriptors on the job's devices.
    pub fds: Vec<HeldFd>,
    /// Its cgroup2 path.
    pub cgroup: Option<String>,
    /// Its GPU memory per NVML.
    pub gpu_memory: Vec<GpuMemory>,
    /// Where a look at its holds stopped, when it did not read the
    /// process whole within its deadline
    /// ([`crate::holders::scan::Bounded::cut`]): `fds` may be short.
    pub unread: Option<String>,
}

/// `ev` cut to the process's identity, cgroup and devices (no command
/// line, no sockets, at most 4 descriptors), saying so.
pub fn cut(ev: &Evidence) -> Evidence {
    let mut cut = ev.clone();
    cut.cmdline.clear();
    cut.sockets.clear();
    cut.fds.truncate(4);
    cut.left_out.push(
        "record cut to identity and devices: the response's evidence bytes were spent".into(),
    );
    cut
}

/// Writes `ev` within `budget` ([`write()`]): a record that does not fit
/// what is left is cut to the process's identity, cgroup and devices, and
/// not written at all (`Ok(None)`) when even that does not fit.
///
/// # Errors
/// As [`write()`].
pub fn write_within(
    dir: &Path,
    ev: &Evidence,
    budget: &mut Budget,
) -> Result<Option<PathBuf>, NodeError> {
    let full = serde_json::to_vec_pretty(ev).unwrap_or_default();
    let bytes = if (full.len() as u64) <= budget.bytes_left {
        full
    } else {
        let cut = serde_json::to_vec_pretty(&cut(ev)).unwrap_or_default();
        if (cut.len() as u64) > budget.bytes_left {
            budget.records_left_out += 1;
            return Ok(None);
        }
        budget.records_cut += 1;
        cut
    };
    budget.bytes_left -= bytes.len() as u64;
    write_bytes(dir, ev, &bytes).map(Some)
}

/// Writes `ev` as a new root-only file in `dir` and returns its path.
///
/// # Errors
/// [`NodeError::Io`] when the directory or file cannot be created.
/// Files are `job<J>-pid<P>-<UTC stamp>.json`, or `pid<P>-<UTC stamp>.json`
/// for a process outside every job (`gpufence respond`, job id 0).
///
/// # Errors
/// [`NodeError::Io`] when the directory or file cannot be created.
pub fn write(dir: &Path, ev: &Evidence) -> Result<PathBuf, NodeError> {
    write_bytes(dir, ev, &serde_json::to_vec_pretty(ev).unwrap_or_default())
}

fn write_bytes(dir: &Path, ev: &Evidence, bytes: &[u8]) -> Result<PathBuf, NodeError> {
    let prefix = if ev.job_id == 0 {
        format!("pid{}", ev.pid)
    } else {
        format!("job{}-pid{}", ev.job_id, ev.pid)
    };
    write_file(dir, &prefix, bytes)
}

/// Writes `bytes` as a new root-only (0600) file
/// `<dir>/<prefix>-<UTC stamp, microseconds>[-n].json`, never replacing
/// one (`O_EXCL`; a clash takes the next `-n`), and returns its path.
/// `dir` is made 0700 when missing. Evidence and incident files use it.
///
/// # Errors
/// [`NodeError::Io`] when the directory or file cannot be created, or 100
/// files of one name exist.
pub fn write_file(dir: &Path, prefix: &str, bytes: &[u8]) -> Result<PathBuf, NodeError> {
    create_dir_all_mode(dir, 0o700).map_err(|e| NodeError::io("mkdir", dir, e))?;
    let stamp = chrono::Utc::now().format("%Y%m%dT%H%M%S%.6fZ");
    for n in 0..100 {
        let suffix = if n == 0 {
            String::new()
        } else {
            format!("-{n}")
        };
        let p = dir.join(format!("{prefix}-{stamp}{suffix}.json"));
        match write_new(&p, bytes, 0o600) {
            Ok(()) => return Ok(p),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(NodeError::io("create", &p, e)),
        }
    }
    Err(NodeError::io(
        "create",
        dir,
        std::io::Error::other("100 evidence files with the same name"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A command line with bytes that are not UTF-8 is kept, the bytes
    /// replaced (it was dropped whole).
    #[test]
    fn cmdlines_that_are_not_utf8_are_kept() {
        use std::os::unix::ffi::OsStrExt;
        let mut child = std::process::Command::new("sh")
            .args(["-c", "sleep 30; :"])
            .arg(std::ffi::OsStr::from_bytes(b"x\xff"))
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let mut b = Budget::new(0, Duration::from_secs(1), 1 << 20);
        let mut ev = collect(pid, 1, "test", Found::default(), None, &mut b);
        for _ in 0..100 {
            if ev.cmdline.len() == 4 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
            ev = collect(pid, 1, "test", Found::default(), None, &mut b);
        }
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(ev.cmdline, ["sh", "-c", "sleep 30; :", "x\u{fffd}"]);
    }

    /// Records past the byte budget are cut, then left out; each counted.
    #[test]
    fn records_are_cut_then_left_out() {
        let dir = tempfile::tempdir().unwrap();
        let me = std::process::id() as i32;
        let mut b = Budget::new(0, Duration::ZERO, 1 << 20);
        let mut ev = collect(me, 1, "test", Found::default(), None, &mut b);
        ev.cmdline = vec!["x".repeat(3000)];
        let full = serde_json::to_vec_pretty(&ev).unwrap().len() as u64;
        let small = serde_json::to_vec_pretty(&cut(&ev)).unwrap().len() as u64;
        assert!(small + 2900 < full, "{small} {full}");
        let mut b = Budget::new(0, Duration::ZERO, full + small);
        let p1 = write_within(dir.path(), &ev, &mut b).unwrap().unwrap();
        let p2 = write_within(dir.path(), &ev, &mut b).unwrap().unwrap();
        assert_eq!(write_within(dir.path(), &ev, &mut b).unwrap(), None);
        assert_eq!((b.records_cut, b.records_left_out), (1, 1));
        assert_eq!(std::fs::metadata(&p1).unwrap().len(), full);
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p2).unwrap()).unwrap();
        assert_eq!(v["cmdline"], serde_json::json!([]));
        assert!(v["left_out"].to_string().contains("record cut"), "{v}");
        assert!(b
            .summary()
            .is_some_and(|s| s.contains("1 record(s) cut and 1 left out")));
    }

    /// A command line past MAX_CMDLINE_BYTES is cut, and says so.
    #[test]
    fn long_command_lines_are_cut() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "sleep 30; :"])
            .args(std::iter::repeat_n("y".repeat(100), 100))
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let mut b = Budget::new(0, Duration::ZERO, 1 << 20);
        let mut ev = collect(pid, 1, "test", Found::default(), None, &mut b);
        for _ in 0..100 {
            if ev.cmdline.first().is_some_and(|a| a == "sh") {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
            ev = collect(pid, 1, "test", Found::default(), None, &mut b);
        }
        let _ = child.kill();
        let _ = child.wait();
        let bytes: usize = ev.cmdline.iter().map(|a| a.len() + 1).sum();
        assert!(
            bytes <= MAX_CMDLINE_BYTES && ev.cmdline.len() > 30,
            "{}",
            ev.cmdline.len()
        );
        assert!(
            ev.left_out
                .iter()
                .any(|l| l.contains("of 103 arguments kept")),
            "{:?}",
            ev.left_out
        );
    }

    #[test]
    fn containers_from_cgroup_paths() {
        let id = "3f4e5d6c7b8a99887766554433221100ffeeddccbbaa99887766554433221100";
        for (path, runtime) in [
            (format!("system.slice/docker-{id}.scope"), "docker"),
            (format!("docker/{id}"), "docker"),
            (format!("kubepods.slice/kubepods-pod1.slice/cri-containerd-{id}.scope"), "containerd"),
            (format!("kubepods.slice/crio-{id}.scope"), "cri-o"),
            (format!("user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{id}.scope/container"), "podman"),
        ] {
            assert_eq!(
                container_of(&path),
                Some(ContainerRef { runtime, id: id.to_string() }),
                "{path}"
            );
        }
        for path in [
            "system.slice/slurmd.service",
            "docker-xyz.scope",
            "job_1/step_0",
            "",
            "docker/ABCDEF123456",
        ] {
            assert_eq!(container_of(path), None, "{path}");
        }
    }

    /// The sockets of a table are read whole within the time, and, with
    /// the time spent, still the first `SOCKET_FDS_ALWAYS` descriptors;
    /// past those the read stops and says so.
    #[test]
    fn socket_reads_are_bounded() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let me = std::process::id() as i32;
        let later = Some(Instant::now() + Duration::from_secs(60));
        let (s, cut) = sockets_within(me, later);
        assert_eq!(cut, None);
        assert!(s.iter().any(|x| x.local == format!("127.0.0.1:{port}")));
        // SAFETY: getrlimit/setrlimit on a struct we own: the soft
        // descriptor limit raised to the hard one, for the copies below.
        unsafe {
            let mut lim = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
        let null = std::fs::File::open("/dev/null").unwrap();
        let copies: Vec<std::fs::File> = (0..SOCKET_FDS_ALWAYS + 10)
            .map_while(|_| null.try_clone().ok())
            .collect();
        if copies.len() == SOCKET_FDS_ALWAYS + 10 {
            let (_, cut) = sockets_within(me, Some(Instant::now()));
            assert!(
                cut.as_deref().is_some_and(|c| c.contains("evidence time")),
                "{cut:?}"
            );
        }
        drop((copies, null, l));
    }

    /// Only a process of this mount namespace has its executable read: one
    /// in a user namespace's mount namespace (where a user mounts overlayfs
    /// over their own FUSE) is not.
    #[test]
    fn executables_are_read_in_this_mount_namespace_only() {
        assert!(same_mount_ns(std::process::id() as i32));
        let mut child = std::process::Command::new("unshare")
            .args(["-Urm", "sleep", "30"])
            .spawn()
            .expect("unshare");
        let pid = child.id() as i32;
        let moved = (0..200).any(|_| {
            std::thread::sleep(Duration::from_millis(10));
            std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|e| e.ends_with("sleep"))
        });
        let same = same_mount_ns(pid);
        let _ = child.kill();
        let _ = child.wait();
        assert!(moved, "unshare -Urm did not exec sleep");
        assert!(!same, "a process in its own mount namespace");
    }

    /// A network namespace's table is read up to NET_TABLE_MAX bytes, cut
    /// back to whole lines, and the cut is named; a short one whole.
    #[test]
    fn net_tables_are_read_within_their_bound() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("net")).unwrap();
        let line = "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4242 1 0 100 0 0 10 0\n";
        let short = format!("  sl  local_address\n{line}");
        std::fs::write(d.path().join("net/tcp"), &short).unwrap();
        let mut cuts = Vec::new();
        assert_eq!(
            net_table(d.path(), "tcp", &mut cuts).unwrap(),
            short.as_bytes()
        );
        assert!(cuts.is_empty());
        let long = short.clone() + &line.repeat(NET_TABLE_MAX / line.len() + 10);
        std::fs::write(d.path().join("net/tcp6"), &long).unwrap();
        let got = net_table(d.path(), "tcp6", &mut cuts).unwrap();
        assert!(got.len() <= NET_TABLE_MAX && got.len() > NET_TABLE_MAX - line.len());
        assert!(got.ends_with(b"\n") && got.starts_with(short.as_bytes()));
        assert_eq!(cuts, ["net/tcp6"]);
        let rows = <procfs::net::TcpNetEntries as procfs::FromBufReadSI>::from_buf_read(
            &got[..],
            procfs::current_system_info(),
        )
        .unwrap();
        assert_eq!(rows.0.len(), got.split(|b| *b == b'\n').count() - 2);
        assert!(rows.0.iter().all(|e| e.inode == 4242));
        assert!(net_table(d.path(), "udp", &mut cuts).is_none());
    }

    #[test]
    fn sockets_are_found_by_inode_with_addresses() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let s = sockets_of(std::process::id() as i32);
        assert!(
            s.iter()
                .any(|x| x.local == format!("127.0.0.1:{port}")
                    && x.state.as_deref() == Some("Listen")),
            "{s:?}"
        );
        let peer = c.local_addr().unwrap();
        assert!(
            s.iter()
                .any(|x| x.local == peer.to_string() && x.remote == format!("127.0.0.1:{port}")),
            "{s:?}"
        );
    }
}
