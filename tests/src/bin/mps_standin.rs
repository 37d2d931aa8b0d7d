//! `gpufence-mps-standin`: a stand-in for NVIDIA's MPS control daemon
//! (`nvidia-cuda-mps-control`) on a node without a GPU, behaving as the
//! tests need it to (nvidia-cuda-mps-control(1); docs.nvidia.com/deploy/mps):
//!
//! ```text
//! gpufence-mps-standin --gpu PATH -d   the control daemon: forks, returns once it listens on
//!                                      $CUDA_MPS_PIPE_DIRECTORY/control (pid file
//!                                      nvidia-cuda-mps-control.pid beside it). A client's
//!                                      connection starts (or finds) the server of the client's
//!                                      uid (SO_PEERCRED): a child of the daemon running as that
//!                                      uid that opens PATH and holds it, across the jobs of that
//!                                      user, until `quit`; a client of another uid while one
//!                                      server runs is refused ("busy UID": MPS queues it).
//! gpufence-mps-standin --gpu PATH      the control command: each line of stdin (`quit`,
//!                                      `status`) is sent to the daemon and its answer printed
//!                                      (`echo quit | nvidia-cuda-mps-control`)
//! gpufence-mps-standin client          an MPS client: connects through $CUDA_MPS_PIPE_DIRECTORY
//!                                      and prints "MPS server PID ok" (its server holds the GPU),
//!                                      "MPS server-failed EPERM|...", "MPS busy UID", or
//!                                      "MPS unreachable PIPE_DIR" / "MPS no-pipe-dir"
//! ```

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::ExitCode;

fn pipe_dir() -> Option<PathBuf> {
    std::env::var_os("CUDA_MPS_PIPE_DIRECTORY")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

fn errno_word(e: i32) -> String {
    match e {
        libc::ENXIO => "ENXIO".into(),
        libc::EPERM => "EPERM".into(),
        libc::EACCES => "EACCES".into(),
        n => format!("errno{n}"),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("client") {
        return client();
    }
    let (Some("--gpu"), Some(gpu)) = (args.first().map(String::as_str), args.get(1)) else {
        eprintln!("usage: gpufence-mps-standin --gpu PATH [-d] | client");
        return ExitCode::from(2);
    };
    let Some(dir) = pipe_dir() else {
        eprintln!("CUDA_MPS_PIPE_DIRECTORY is not set");
        return ExitCode::from(2);
    };
    if args.get(2).map(String::as_str) == Some("-d") {
        daemon(gpu, &dir)
    } else {
        command(&dir)
    }
}

fn ask(dir: &std::path::Path, line: &str) -> Option<String> {
    let mut s = UnixStream::connect(dir.join("control")).ok()?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .ok()?;
    writeln!(s, "{line}").ok()?;
    let mut answer = String::new();
    BufReader::new(s).read_line(&mut answer).ok()?;
    Some(answer.trim().to_string())
}

fn client() -> ExitCode {
    let Some(dir) = pipe_dir() else {
        println!("MPS no-pipe-dir");
        return ExitCode::SUCCESS;
    };
    match ask(&dir, "client") {
        Some(a) => println!("MPS {a}"),
        None => println!("MPS unreachable {}", dir.display()),
    }
    ExitCode::SUCCESS
}

fn command(dir: &std::path::Path) -> ExitCode {
    let mut ok = true;
    for line in std::io::stdin().lock().lines().map_while(Result::ok) {
        match ask(dir, line.trim()) {
            Some(a) => println!("{a}"),
            None => ok = false,
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn daemon(gpu: &str, dir: &std::path::Path) -> ExitCode {
    let sock = dir.join("control");
    let _ = std::fs::remove_file(&sock);
    let listener = match UnixListener::bind(&sock) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("{}: {e}", sock.display());
            return ExitCode::FAILURE;
        }
    };
    // Every local user's clients connect, as to the real daemon's pipes.
    let _ = std::fs::set_permissions(&sock, std::os::unix::fs::PermissionsExt::from_mode(0o777));
    // SAFETY: fork in a single-threaded process; the child goes on with
    // this program's own code only.
    match unsafe { libc::fork() } {
        -1 => return ExitCode::FAILURE,
        0 => {}
        _ => return ExitCode::SUCCESS,
    }
    // SAFETY: setsid in the child; stdio onto /dev/null (a daemon's).
    unsafe {
        libc::setsid();
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        for fd in 0..3 {
            libc::dup2(null, fd);
        }
    }
    let _ = std::fs::write(
        dir.join("nvidia-cuda-mps-control.pid"),
        format!("{}\n", std::process::id()),
    );
    // (uid, pid) of the server running.
    let mut server: Option<(u32, i32)> = None;
    for conn in listener.incoming() {
        let Ok(mut conn) = conn else { continue };
        let _ = conn.set_read_timeout(Some(std::time::Duration::from_secs(5)));
        let mut line = String::new();
        if BufReader::new(&conn).read_line(&mut line).is_err() {
            continue;
        }
        // A server that died is no server.
        if let Some((_, pid)) = server {
            let mut st = 0;
            // SAFETY: reaping our own child without blocking.
            if unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) } == pid {
                server = None;
            }
        }
        let answer = match line.trim() {
            "quit" => {
                if let Some((_, pid)) = server {
                    // SAFETY: signalling and reaping our own child.
                    unsafe {
                        libc::kill(pid, libc::SIGTERM);
                        libc::waitpid(pid, std::ptr::null_mut(), 0);
                    }
                }
                let _ = writeln!(conn, "bye");
                let _ = std::fs::remove_file(&sock);
                let _ = std::fs::remove_file(dir.join("nvidia-cuda-mps-control.pid"));
                return ExitCode::SUCCESS;
            }
            "status" => match server {
                Some((uid, pid)) => format!("server {pid} uid {uid}"),
                None => "no server".into(),
            },
            "client" => {
                let uid =
                    nix::sys::socket::getsockopt(&conn, nix::sys::socket::sockopt::PeerCredentials)
                        .map(|c| c.uid())
                        .unwrap_or(u32::MAX);
                match server {
                    Some((u, pid)) if u == uid => format!("server {pid} ok"),
                    Some((u, _)) => format!("busy {u}"),
                    None => match start_server(gpu, uid) {
                        Ok(pid) => {
                            server = Some((uid, pid));
                            format!("server {pid} ok")
                        }
                        Err(w) => format!("server-failed {w}"),
                    },
                }
            }
            other => format!("unknown {other}"),
        };
        let _ = writeln!(conn, "{answer}");
    }
    ExitCode::SUCCESS
}

/// Forks the server for `uid`: it opens `gpu` as that uid and holds it.
/// Its pid, or what the open gave.
fn start_server(gpu: &str, uid: u32) -> Result<i32, String> {
    let mut fds = [0; 2];
    // SAFETY: pipe(2) into an array we own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err("pipe".into());
    }
    // SAFETY: both ends are fresh descriptors we own.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let gid = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
        .ok()
        .flatten()
        .map_or(uid, |u| u.gid.as_raw());
    let path = std::ffi::CString::new(gpu).map_err(|_| "path".to_string())?;
    // SAFETY: fork in the single-threaded daemon; the child only makes
    // system calls and writes to the pipe before it sleeps.
    match unsafe { libc::fork() } {
        -1 => Err("fork".into()),
        0 => {
            drop(r);
            // SAFETY: the child drops to the client's uid, opens the GPU,
            // reports, and holds it; it dies with the daemon.
            unsafe {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                libc::setgroups(0, std::ptr::null());
                libc::setgid(gid);
                if libc::setuid(uid) != 0 {
                    libc::write(w.as_raw_fd(), b"setuid\n".as_ptr().cast(), 7);
                    libc::_exit(1);
                }
                let fd = libc::open(path.as_ptr(), libc::O_RDWR);
                let word = if fd < 0 {
                    errno_word(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
                } else {
                    "ok".to_string()
                };
                let msg = format!("{word}\n");
                libc::write(w.as_raw_fd(), msg.as_ptr().cast(), msg.len());
                drop(w);
                if fd < 0 {
                    libc::_exit(1);
                }
                loop {
                    libc::pause();
                }
            }
        }
        pid => {
            drop(w);
            let mut word = String::new();
            let _ = std::fs::File::from(r).read_to_string(&mut word);
            match word.trim() {
                "ok" => Ok(pid),
                other => {
                    // SAFETY: reaping our own child.
                    unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
                    Err(other.to_string())
                }
            }
        }
    }
}
