//! What is kept about a lingering process before it is killed.
//!
//! One JSON file per process in `evidence_dir`, mode 0600, created with
//! `O_EXCL` (never overwritten): `job<id>-pid<pid>-<utc time>.json`.

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::Serialize;
use sha2::{Digest, Sha256};

use gpufence_model::fsutil::{create_dir_all_mode, write_new};
use gpufence_model::record::now_rfc3339;

use crate::scan::HeldFd;
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
    #[serde(serialize_with = "crate::cgpath::option::serialize")]
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
    pub frozen: Option<String>,
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

/// The sockets of `pid`, from its fd table and its network namespace's tables.
pub fn sockets_of(pid: i32) -> Vec<SocketInfo> {
    let Ok(p) = procfs::process::Process::new(pid) else {
        return Vec::new();
    };
    let inodes: std::collections::BTreeSet<u64> = match p.fd() {
        Ok(fds) => fds
            .flatten()
            .filter_map(|f| match f.target {
                procfs::process::FDTarget::Socket(i) => Some(i),
                _ => None,
            })
            .collect(),
        Err(_) => return Vec::new(),
    };
    let mut out = Vec::new();
    for (proto, entries) in [("tcp", p.tcp()), ("tcp6", p.tcp6())] {
        for e in entries.into_iter().flatten() {
            if inodes.contains(&e.inode) {
                out.push(SocketInfo {
                    proto,
                    local: e.local_address.to_string(),
                    remote: e.remote_address.to_string(),
                    state: Some(format!("{:?}", e.state)),
                    inode: e.inode,
                });
            }
        }
    }
    for (proto, entries) in [("udp", p.udp()), ("udp6", p.udp6())] {
        for e in entries.into_iter().flatten() {
            if inodes.contains(&e.inode) {
                out.push(SocketInfo {
                    proto,
                    local: e.local_address.to_string(),
                    remote: e.remote_address.to_string(),
                    state: None,
                    inode: e.inode,
                });
            }
        }
    }
    out
}

/// SHA-256 of the first `max` bytes of `p`, and how many were hashed.
fn sha256_file(p: &Path, max: u64) -> Option<(String, u64)> {
    let f = std::fs::File::open(p).ok()?;
    let mut f = f.take(max);
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut total = 0u64;
    loop {
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

/// Collects what can still be read about `pid`. Fields that cannot be read
/// (the process is exiting, a kernel thread) are `None`.
pub fn collect(
    pid: i32,
    job_id: u32,
    reason: &str,
    fds: Vec<HeldFd>,
    cgroup: Option<String>,
    gpu_memory: Vec<GpuMemory>,
    frozen: Option<String>,
    hash_max_bytes: u64,
) -> Evidence {
    let exe_path = PathBuf::from(format!("/proc/{pid}/exe"));
    let hashed = sha256_file(&exe_path, hash_max_bytes);
    let proc = procfs::process::Process::new(pid).ok();
    let stat = proc.as_ref().and_then(|p| p.stat().ok());
    let status = proc.as_ref().and_then(|p| p.status().ok());
    Evidence {
        collected: now_rfc3339(),
        job_id,
        reason: reason.to_string(),
        pid,
        ppid: stat.as_ref().map(|s| s.ppid),
        uid: status.as_ref().map(|s| s.ruid),
        comm: stat.as_ref().map(|s| s.comm.clone()),
        // Bytes that are not UTF-8 are replaced, never the whole list lost.
        cmdline: crate::sweep::read_cmdline(pid),
        exe: proc
            .as_ref()
            .and_then(|p| p.exe().ok())
            .map(|e| e.display().to_string()),
        exe_sha256: hashed.as_ref().map(|(h, _)| h.clone()),
        exe_hashed_bytes: hashed.as_ref().map(|(_, n)| *n),
        exe_size: std::fs::metadata(&exe_path).ok().map(|m| m.len()),
        container: cgroup.as_deref().and_then(container_of),
        cgroup,
        start_time: stat.as_ref().and_then(start_time),
        fds,
        sockets: sockets_of(pid),
        gpu_memory,
        frozen,
    }
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
    let prefix = if ev.job_id == 0 {
        format!("pid{}", ev.pid)
    } else {
        format!("job{}-pid{}", ev.job_id, ev.pid)
    };
    write_file(
        dir,
        &prefix,
        &serde_json::to_vec_pretty(ev).unwrap_or_default(),
    )
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
        let mut ev = collect(pid, 1, "test", Vec::new(), None, Vec::new(), None, 0);
        for _ in 0..100 {
            if ev.cmdline.len() == 4 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
            ev = collect(pid, 1, "test", Vec::new(), None, Vec::new(), None, 0);
        }
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(ev.cmdline, ["sh", "-c", "sleep 30; :", "x\u{fffd}"]);
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
