//! `gpufence-mps-standin`: a stand-in for NVIDIA's MPS control daemon
//! (`nvidia-cuda-mps-control`) on a node without a GPU, modelling what the
//! real one does where gpufence's security rests on it
//! (nvidia-cuda-mps-control(1); docs.nvidia.com/deploy/mps):
//!
//! ```text
//! gpufence-mps-standin --gpu PATH -d   the control daemon: forks, returns once it listens on
//!                                      $CUDA_MPS_PIPE_DIRECTORY/control (pid file
//!                                      nvidia-cuda-mps-control.pid beside it). A client's
//!                                      connection starts (or finds) the server of the client's
//!                                      uid (SO_PEERCRED); a client of another uid while one
//!                                      server runs is answered "busy UID" (MPS queues it).
//!                                      `quit` from whoever connects ends the server and the daemon;
//!                                      `start_server -uid UID` starts UID's server (as root: any
//!                                      UID; as a user: its own, else "server-failed EPERM").
//! gpufence-mps-standin --gpu PATH      the control command: each line of stdin (`quit`,
//!                                      `status`) is sent to the daemon and its answer printed
//!                                      (`echo quit | nvidia-cuda-mps-control`); exit 1 when the
//!                                      daemon could not be reached
//! gpufence-mps-standin client          an MPS client: connects through $CUDA_MPS_PIPE_DIRECTORY
//!                                      and prints "MPS server PID ok" (its server holds the GPU),
//!                                      "MPS server-failed EPERM|...", "MPS busy UID", or
//!                                      "MPS unreachable PIPE_DIR EACCES|ENOENT|..." / "MPS no-pipe-dir"
//! gpufence-mps-standin server --gpu PATH --report FD
//!                                      the server, exec'ed by the daemon as the client's uid: opens
//!                                      PATH, keeps it as descriptor [`SERVER_FD`], says "ok" (or the
//!                                      errno's name) on FD, and holds it until killed
//! ```
//!
//! Each behaviour and the NVIDIA text it models:
//! - Several daemons side by side, each at its own pipe directory: "the
//!   pipe directory ... `CUDA_MPS_PIPE_DIRECTORY`" addresses one control
//!   daemon, and it writes `nvidia-cuda-mps-control.pid` there
//!   (docs.nvidia.com/deploy/mps, appendix "Tools and Interface
//!   Reference").
//! - `start_server -uid UID` ("Start a new MPS server for the specified
//!   user (UID)", nvidia-cuda-mps-control(1)) from whoever reaches the
//!   pipe: the daemon starts the server as UID, which only a daemon run as
//!   root can do for another uid. The stand-in, like gpufence's daemons,
//!   runs as whoever started it: as a user, a server of another uid fails
//!   with `setuid(2)`'s EPERM ("server-failed EPERM"). NVIDIA documents
//!   the control daemon as "typically" run as root and a daemon run as a
//!   user as serving that user only (docs.nvidia.com/deploy/mps); that
//!   NVIDIA's fails the same way is what only a real GPU can confirm.
//! - A server per client uid: the control daemon starts an MPS server
//!   with the uid of the requesting client, and a client of another uid
//!   while a server runs is queued until that server exits
//!   (nvidia-cuda-mps-control(1), paraphrased): here "busy UID", so that
//!   a test sees it at once.
//! - The server is its own executable (`nvidia-cuda-mps-server`), exec'ed
//!   after the daemon dropped to the client's uid: a process of that uid
//!   that is dumpable again after `execve(2)` (`begin_new_exec`,
//!   `fs/exec.c`, resets `dumpable` for an exec with no credential
//!   change), so its uid may `ptrace(2)` it or `pidfd_getfd(2)` its GPU
//!   descriptor, and another uid may not (`__ptrace_may_access`,
//!   `kernel/ptrace.c`). The stand-in execs itself in `server` mode.
//! - `quit` ("Shutdown the MPS control daemon process and all MPS servers",
//!   nvidia-cuda-mps-control(1)) from whoever reaches the control pipe:
//!   NVIDIA documents no per-command access check, so only the pipe
//!   directory's permissions keep anyone out.
//!
//! What only a real GPU can confirm: that NVIDIA's daemon, run as the
//! job's user, starts and serves that user's clients with nothing more
//! than this stand-in needs (its `pipe` and `log` directories its own,
//! 0700, under a root-owned directory only the user may traverse), that it
//! refuses `start_server -uid` of another uid, and how the driver
//! schedules two users' servers on one GPU.

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
        libc::ENOENT => "ENOENT".into(),
        n => format!("errno{n}"),
    }
}

/// The descriptor the server keeps the GPU as (so that a test knows
/// which to ask `pidfd_getfd(2)` for).
pub const SERVER_FD: i32 = 9;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("client") {
        return client();
    }
    if args.first().map(String::as_str) == Some("server") {
        return match (
            args.get(1).map(String::as_str),
            args.get(2),
            args.get(3).map(String::as_str),
            args.get(4).and_then(|f| f.parse().ok()),
        ) {
            (Some("--gpu"), Some(gpu), Some("--report"), Some(fd)) => server(gpu, fd),
            _ => ExitCode::from(2),
        };
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

fn ask(dir: &std::path::Path, line: &str) -> Result<String, i32> {
    let ioerr = |e: std::io::Error| e.raw_os_error().unwrap_or(0);
    let mut s = UnixStream::connect(dir.join("control")).map_err(ioerr)?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .map_err(ioerr)?;
    writeln!(s, "{line}").map_err(ioerr)?;
    let mut answer = String::new();
    BufReader::new(s).read_line(&mut answer).map_err(ioerr)?;
    Ok(answer.trim().to_string())
}

fn client() -> ExitCode {
    let Some(dir) = pipe_dir() else {
        println!("MPS no-pipe-dir");
        return ExitCode::SUCCESS;
    };
    match ask(&dir, "client") {
        Ok(a) => println!("MPS {a}"),
        Err(e) => println!("MPS unreachable {} {}", dir.display(), errno_word(e)),
    }
    ExitCode::SUCCESS
}

fn command(dir: &std::path::Path) -> ExitCode {
    let mut ok = true;
    for line in std::io::stdin().lock().lines().map_while(Result::ok) {
        match ask(dir, line.trim()) {
            Ok(a) => println!("{a}"),
            Err(e) => {
                eprintln!("{}: {}", dir.display(), errno_word(e));
                ok = false;
            }
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
            // `start_server -uid UID` (nvidia-cuda-mps-control(1): "Start
            // a new MPS server for the specified user (UID)"), from
            // whoever reaches the pipe: the daemon drops to UID for the
            // server, which a daemon run as root may do for any UID and a
            // daemon run as a user only for its own (setuid(2): EPERM).
            cmd if cmd.starts_with("start_server -uid ") => {
                match cmd["start_server -uid ".len()..].trim().parse::<u32>() {
                    Err(_) => "start_server-failed bad-uid".into(),
                    // Modelled at its worst: started whatever server runs
                    // (NVIDIA documents no queueing for this command).
                    Ok(uid) => match server {
                        Some((u, pid)) if u == uid => format!("server {pid} ok"),
                        _ => match start_server(gpu, uid) {
                            Ok(pid) => {
                                server.get_or_insert((uid, pid));
                                format!("server {pid} ok")
                            }
                            Err(w) => format!("server-failed {w}"),
                        },
                    },
                }
            }
            other => format!("unknown {other}"),
        };
        let _ = writeln!(conn, "{answer}");
    }
    ExitCode::SUCCESS
}

/// The server: opens `gpu`, keeps it as [`SERVER_FD`], reports the open's
/// outcome on descriptor `report` and holds the GPU until killed.
fn server(gpu: &str, report: i32) -> ExitCode {
    // SAFETY: the descriptor the daemon passed us, ours alone now.
    let report = unsafe { OwnedFd::from_raw_fd(report) };
    let word = match std::fs::OpenOptions::new().read(true).write(true).open(gpu) {
        Ok(f) => {
            // SAFETY: dup2 of a descriptor we own onto a fixed number.
            unsafe { libc::dup2(f.as_raw_fd(), SERVER_FD) };
            "ok".to_string()
        }
        Err(e) => errno_word(e.raw_os_error().unwrap_or(0)),
    };
    let _ = std::fs::File::from(report).write_all(format!("{word}\n").as_bytes());
    if word != "ok" {
        return ExitCode::FAILURE;
    }
    loop {
        // SAFETY: pause(2) until a signal ends us.
        unsafe { libc::pause() };
    }
}

/// Forks and execs the server for `uid` (this program in `server` mode)
/// as `uid`, with its primary group and no supplementary groups. Its pid,
/// or what its open gave.
fn start_server(gpu: &str, uid: u32) -> Result<i32, String> {
    let mut fds = [0; 2];
    // SAFETY: pipe(2) into an array we own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err("pipe".into());
    }
    // SAFETY: both ends are fresh descriptors we own.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // The server's end, without O_CLOEXEC: it survives the exec.
    // SAFETY: dup(2) of a descriptor we own.
    let child_w = unsafe { libc::dup(w.as_raw_fd()) };
    if child_w < 0 {
        return Err("dup".into());
    }
    // SAFETY: the duplicate is ours.
    let child_w = unsafe { OwnedFd::from_raw_fd(child_w) };
    let gid = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
        .ok()
        .flatten()
        .map_or(uid, |u| u.gid.as_raw());
    let exe = std::env::current_exe().map_err(|e| format!("exe: {e}"))?;
    let c = |s: &str| std::ffi::CString::new(s).map_err(|_| "argument".to_string());
    let argv = [
        c(&exe.display().to_string())?,
        c("server")?,
        c("--gpu")?,
        c(gpu)?,
        c("--report")?,
        c(&child_w.as_raw_fd().to_string())?,
    ];
    let mut ptrs: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    ptrs.push(std::ptr::null());
    // SAFETY: fork in the single-threaded daemon; the child only makes
    // system calls before it execs.
    match unsafe { libc::fork() } {
        -1 => Err("fork".into()),
        0 => {
            drop(r);
            // SAFETY: the child drops to the client's uid and execs the
            // server; it dies with the daemon (the death signal is set
            // after setuid, which clears it, and kept across the exec).
            unsafe {
                // As a user: setgroups fails (EPERM) and leaves the
                // groups as they are; setgid to its own group succeeds.
                libc::setgroups(0, std::ptr::null());
                libc::setgid(gid);
                if libc::setuid(uid) != 0 {
                    if *libc::__errno_location() == libc::EPERM {
                        libc::write(w.as_raw_fd(), b"EPERM\n".as_ptr().cast(), 6);
                    } else {
                        libc::write(w.as_raw_fd(), b"setuid\n".as_ptr().cast(), 7);
                    }
                    libc::_exit(1);
                }
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                libc::execv(ptrs[0], ptrs.as_ptr());
                libc::write(w.as_raw_fd(), b"exec\n".as_ptr().cast(), 5);
                libc::_exit(1);
            }
        }
        pid => {
            drop(w);
            drop(child_w);
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
