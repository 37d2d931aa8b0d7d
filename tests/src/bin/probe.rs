//! `gpufence-probe`: what a job (or an intruder) does with a device node,
//! reported in words the tests compare. Opening a `mknod`-made node gives
//! ENXIO when the device cgroup allowed it (no driver behind it) and EPERM
//! when a device program denied it.
//!
//! ```text
//! gpufence-probe open [--ro] PATH...     one line per PATH: "PATH ok|ENXIO|EPERM|errno N"
//! gpufence-probe mknod PATH MAJOR MINOR  "PATH ok|EPERM|errno N"
//! gpufence-probe hold [--ignore-term] [--daemon] [--via=fd|thread|leader-exit|mmap|io_uring|
//!                     mmap-leader-exit|io_uring-mapped-leader-exit|...] PATH
//!                                        --pass-on-term=SOCK: on SIGTERM, send the descriptor to
//!                                        SOCK (an accomplice) and exit
//!                                        --via hides the hold where /proc/<pid>/fd does not show it:
//!                                        a thread with its own table, a thread outliving the main
//!                                        thread, a mapping (fd closed), an io_uring registered file
//!                                        open O_RDWR, print "held" (with --daemon: double-fork,
//!                                        setsid, print "held PID" from the grandchild, which
//!                                        keeps the device; the command returns), sleep until killed
//! gpufence-probe recvfd SOCKET           listen, print "listening", receive one fd, print "received", hold it
//! gpufence-probe recvfd --map-leader-exit SOCKET  the same, then map it privately, close it,
//!                                        and end the main thread (a thread keeps the mapping)
//! gpufence-probe getfd PID FD          pidfd_getfd(2) of PID's descriptor FD: "getfd ok|EPERM|errno N"
//! gpufence-probe trace PID               PTRACE_SEIZE PID, print "traced", sleep, never wait for it
//! gpufence-probe sendfd SOCKET PATH      open PATH, send the fd over SOCKET, print "sent"
//! gpufence-probe holders MAJOR:MINOR     the pids holding that character device, one per line
//! gpufence-probe objget PATH...          BPF_OBJ_GET each pinned object: "PATH ok|EACCES|EPERM|errno N";
//!                                        for a map it got, also try to write an all-zero entry:
//!                                        "PATH update ok|EPERM|..." (a job must get neither)
//! gpufence-probe write PATH...           open PATH for appending (creating it): "PATH ok|EACCES|..."
//! gpufence-probe apply CONFIG JOB UID PID apply job JOB's record for a slurmstepd stand-in PID,
//!                                        as the SPANK plugin does (for contrib/gpu-check.sh)
//! gpufence-probe listen ADDR PORT [ARG...]  bind ADDR:PORT (TCP), listen, print "listening",
//!                                        sleep; ARGs are ignored (they shape the command line
//!                                        the sweep reads, e.g. a notebook's flags)
//! gpufence-probe connect ADDR PORT [ARG...] connect to ADDR:PORT (TCP), print "connected", sleep
//! gpufence-probe flood PATH|- COPIES FILLERS RINGS  fill the descriptor table (soft NOFILE raised to
//!                                        the hard limit): PATH opened and dup'ed COPIES times,
//!                                        /dev/null opened and dup'ed FILLERS times, RINGS io_uring
//!                                        rings without fixed files; print "flooded", then
//!                                        "N descriptors", sleep until killed
//! gpufence-probe tables PATH TABLES SLOTS  TABLES descriptor tables of SLOTS descriptors each
//!                                        (soft NOFILE raised to the hard limit): /dev/null
//!                                        dup'ed SLOTS times, then TABLES-1 threads that each
//!                                        unshare(CLONE_FILES) (a private copy); the last of them
//!                                        puts PATH into its table's last slot (NOFILE-1); print
//!                                        "held", then "N tables", sleep until killed; with
//!                                        PATH --recv=SOCK the last thread listens on SOCK instead
//!                                        ("listening"), and puts the descriptor it receives
//!                                        (SCM_RIGHTS) there ("received")
//! ```

use std::ffi::CString;
use std::io::{IoSlice, IoSliceMut, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::ExitCode;

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};

fn open(path: &str, ro: bool) -> Result<OwnedFd, i32> {
    let c = CString::new(path).map_err(|_| libc::EINVAL)?;
    let flags = if ro { libc::O_RDONLY } else { libc::O_RDWR };
    // SAFETY: open(2) with a NUL-terminated path.
    let fd = unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC) };
    if fd < 0 {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    } else {
        // SAFETY: fresh descriptor.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

fn word(r: Result<(), i32>) -> String {
    match r {
        Ok(()) => "ok".into(),
        Err(libc::ENXIO) => "ENXIO".into(),
        Err(libc::EPERM) => "EPERM".into(),
        Err(libc::EACCES) => "EACCES".into(),
        Err(n) => format!("errno {n}"),
    }
}

fn say(s: &str) {
    let mut o = std::io::stdout();
    let _ = writeln!(o, "{s}");
    let _ = o.flush();
}

fn sleep_forever() -> ! {
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}

static TERM: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_term(_: libc::c_int) {
    TERM.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// Holds `path`; on SIGTERM hands the descriptor to `sock` and exits.
fn hold_then_pass(path: &str, sock: &str) -> ExitCode {
    let fd = match open(path, false) {
        Ok(fd) => fd,
        Err(e) => {
            say(&format!("{path} {}", word(Err(e))));
            return ExitCode::FAILURE;
        }
    };
    // SAFETY: installing a handler that only stores to an atomic.
    unsafe { libc::signal(libc::SIGTERM, on_term as *const () as libc::sighandler_t) };
    say("held");
    while !TERM.load(std::sync::atomic::Ordering::SeqCst) {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    if let Ok(s) = UnixStream::connect(sock) {
        let fds = [fd.as_raw_fd()];
        let iov = [IoSlice::new(b"x")];
        let _ = sendmsg::<()>(
            s.as_raw_fd(),
            &iov,
            &[ControlMessage::ScmRights(&fds)],
            MsgFlags::empty(),
            None,
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    ExitCode::SUCCESS
}

/// Opens `path`, registers it as the one fixed file of a new io_uring,
/// closes the descriptor: the ring alone holds the device. The ring's
/// descriptor, or a line saying why not.
fn ring_holding(path: &str) -> Result<i32, String> {
    ring_holding_after(path, 0)
}

/// [`ring_holding`] with `crowd` fixed files before the device,
/// alternating `/dev/null` and `/dev/zero`.
fn ring_holding_after(path: &str, crowd: usize) -> Result<i32, String> {
    let fd = open(path, false).map_err(|e| format!("{path} {}", word(Err(e))))?;
    ring_with(fd.as_raw_fd(), crowd)
}

/// A new io_uring with `crowd` fixed files (alternating `/dev/null` and
/// `/dev/zero`) and then descriptor `fd` registered: its descriptor.
fn ring_with(fd: RawFd, crowd: usize) -> Result<i32, String> {
    let null = open("/dev/null", true).map_err(|e| format!("/dev/null {}", word(Err(e))))?;
    let zero = open("/dev/zero", true).map_err(|e| format!("/dev/zero {}", word(Err(e))))?;
    // Fixed files count against RLIMIT_NOFILE: the soft limit up to the hard.
    // SAFETY: getrlimit/setrlimit with a valid struct.
    unsafe {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
    // struct io_uring_params is 120 bytes; zeroed asks for defaults.
    let mut params = [0u8; 120];
    // SAFETY: io_uring_setup(2) with a zeroed params struct.
    let ring = unsafe { libc::syscall(libc::SYS_io_uring_setup, 4u32, params.as_mut_ptr()) };
    if ring < 0 {
        return Err(format!("no io_uring: {}", std::io::Error::last_os_error()));
    }
    let mut fds: Vec<i32> = (0..crowd)
        .map(|i| {
            if i % 2 == 0 {
                null.as_raw_fd()
            } else {
                zero.as_raw_fd()
            }
        })
        .collect();
    fds.push(fd);
    // IORING_REGISTER_FILES = 2
    // SAFETY: io_uring_register(2) of fds.len() descriptors.
    let r = unsafe {
        libc::syscall(
            libc::SYS_io_uring_register,
            ring as i32,
            2u32,
            fds.as_ptr(),
            fds.len() as u32,
        )
    };
    if r < 0 {
        return Err(format!(
            "register failed: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(ring as i32)
}

/// Listens on `sock` (0777), says "listening", takes one descriptor sent
/// over it.
fn receive_one(sock: &str) -> Option<OwnedFd> {
    let _ = std::fs::remove_file(sock);
    let l = UnixListener::bind(sock).ok()?;
    let _ = std::fs::set_permissions(sock, std::os::unix::fs::PermissionsExt::from_mode(0o777));
    say("listening");
    let (s, _) = l.accept().ok()?;
    let mut buf = [0u8; 8];
    let mut iov = [IoSliceMut::new(&mut buf)];
    let mut cmsg = nix::cmsg_space!([RawFd; 1]);
    let msg = recvmsg::<()>(s.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::empty()).ok()?;
    for c in msg.cmsgs().into_iter().flatten() {
        if let ControlMessageOwned::ScmRights(fds) = c {
            // SAFETY: a descriptor received over SCM_RIGHTS is ours.
            return fds.first().map(|fd| unsafe { OwnedFd::from_raw_fd(*fd) });
        }
    }
    None
}

/// Registers ring `ring`'s own descriptor (IORING_REGISTER_RING_FDS) and
/// closes it.
fn register_and_close(ring: i32) -> Result<(), String> {
    // struct io_uring_rsrc_update { u32 offset; u32 resv; u64 data; }:
    // offset -1 takes any free slot; IORING_REGISTER_RING_FDS = 20.
    let mut upd = [u64::from(u32::MAX), ring as u64];
    // SAFETY: io_uring_register(2) with one update struct.
    let r = unsafe {
        libc::syscall(
            libc::SYS_io_uring_register,
            ring,
            20u32,
            upd.as_mut_ptr(),
            1u32,
        )
    };
    if r != 1 {
        return Err(format!(
            "register ring fd failed: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: closes the ring's descriptor: it lives on in this task's
    // registered ring slots only.
    unsafe { libc::close(ring) };
    Ok(())
}

/// Maps `fd` privately (a private mapping of a character device keeps the
/// device file: what a GPU mapping looks like after `close()`; `/dev/zero`
/// stands in where no GPU is) and closes it.
fn map_and_close(fd: OwnedFd) -> Result<(), String> {
    // SAFETY: a private read mapping of a descriptor we own.
    let m = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ,
            libc::MAP_PRIVATE,
            fd.as_raw_fd(),
            0,
        )
    };
    if m == libc::MAP_FAILED {
        return Err(format!("mmap failed: {}", std::io::Error::last_os_error()));
    }
    drop(fd);
    Ok(())
}

/// Maps ring `ring`'s submission ring and closes its descriptor: the
/// mapping alone keeps the ring (and its fixed files).
fn map_ring_and_close(ring: i32) -> Result<(), String> {
    // IORING_OFF_SQ_RING = 0.
    // SAFETY: a shared mapping of the ring's first page.
    let m = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_POPULATE,
            ring,
            0,
        )
    };
    if m == libc::MAP_FAILED {
        return Err(format!("mmap failed: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: closes the ring's descriptor; the mapping keeps it.
    unsafe { libc::close(ring) };
    Ok(())
}

/// Starts a thread that sleeps for ever, prints `msg`, and ends the main
/// thread alone: the process lives on in the other thread, and
/// `/proc/<pid>/{fd,maps,map_files,exe,cmdline}` show nothing of it.
fn leader_leaves(msg: &str) -> ExitCode {
    std::thread::spawn(|| sleep_forever());
    say(msg);
    // exit(2), not exit_group(2) and not pthread_exit (whose forced
    // unwind Rust's runtime aborts on).
    // SAFETY: ends only the calling thread.
    unsafe { libc::syscall(libc::SYS_exit, 0) };
    ExitCode::FAILURE
}

/// Holds `path` somewhere `/proc/<pid>/fd` does not show, prints "held",
/// sleeps. For the scanner's tests.
fn hold_hidden(path: &str, via: &str) -> ExitCode {
    let path = path.to_string();
    match via {
        "thread" => {
            std::thread::spawn(move || {
                // SAFETY: unshare of this thread's fd table.
                if unsafe { libc::unshare(libc::CLONE_FILES) } != 0 {
                    say("unshare failed");
                    return;
                }
                match open(&path, false) {
                    Ok(fd) => {
                        say("held");
                        let _keep = fd;
                        sleep_forever();
                    }
                    Err(e) => say(&format!("{path} {}", word(Err(e)))),
                }
            });
            sleep_forever();
        }
        "leader-exit" => {
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || match open(&path, false) {
                Ok(fd) => {
                    let _ = tx.send(true);
                    let _keep = fd;
                    sleep_forever();
                }
                Err(e) => {
                    say(&format!("{path} {}", word(Err(e))));
                    let _ = tx.send(false);
                }
            });
            if rx.recv() == Ok(true) {
                say("held");
                // The main thread goes; the process lives on in the other
                // thread. exit(2), not exit_group(2) and not pthread_exit
                // (whose forced unwind Rust's runtime aborts on).
                // SAFETY: ends only the calling thread.
                unsafe { libc::syscall(libc::SYS_exit, 0) };
            }
            ExitCode::FAILURE
        }
        "mmap" => {
            let fd = match open(&path, false) {
                Ok(fd) => fd,
                Err(e) => {
                    say(&format!("{path} {}", word(Err(e))));
                    return ExitCode::FAILURE;
                }
            };
            // SAFETY: a shared read mapping of a descriptor we own.
            let m = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    4096,
                    libc::PROT_READ,
                    libc::MAP_SHARED,
                    fd.as_raw_fd(),
                    0,
                )
            };
            if m == libc::MAP_FAILED {
                say(&format!("mmap failed: {}", std::io::Error::last_os_error()));
                return ExitCode::FAILURE;
            }
            drop(fd);
            say("held");
            sleep_forever();
        }
        // Mapped, closed, and the main thread gone: only a thread's view
        // (`/proc/<tid>/maps`) shows the mapping.
        "mmap-leader-exit" => match open(&path, false)
            .or_else(|_| open(&path, true))
            .map_err(|e| format!("{path} {}", word(Err(e))))
            .and_then(map_and_close)
        {
            Ok(()) => leader_leaves("held"),
            Err(e) => {
                say(&e);
                ExitCode::FAILURE
            }
        },
        // A ring kept by its mapping alone, and the main thread gone.
        "io_uring-mapped-leader-exit" => match ring_holding(&path).and_then(map_ring_and_close) {
            Ok(()) => leader_leaves("held"),
            Err(e) => {
                say(&e);
                ExitCode::FAILURE
            }
        },
        "io_uring" => match ring_holding(&path) {
            Ok(_ring) => {
                say("held");
                sleep_forever();
            }
            Err(e) => {
                say(&e);
                ExitCode::FAILURE
            }
        },
        // The ring's own descriptor registered (IORING_REGISTER_RING_FDS)
        // and closed: the ring is in no descriptor table; `-crowded`: the
        // device comes after 10,000 other fixed files.
        "io_uring-registered" | "io_uring-registered-crowded" => {
            let crowd = if via.ends_with("crowded") { 10_000 } else { 0 };
            match ring_holding_after(&path, crowd).and_then(register_and_close) {
                Ok(()) => {
                    say("held");
                    sleep_forever();
                }
                Err(e) => {
                    say(&e);
                    ExitCode::FAILURE
                }
            }
        }
        // The ring kept alive by its mapped submission ring alone: its
        // descriptor closed, never registered.
        "io_uring-mapped" => match ring_holding(&path).and_then(map_ring_and_close) {
            Ok(()) => {
                say("held");
                sleep_forever();
            }
            Err(e) => {
                say(&e);
                ExitCode::FAILURE
            }
        },
        // The ring only in a thread's private table (unshare(CLONE_FILES)):
        // the leader's table has neither the device nor the ring.
        "io_uring-thread" => {
            std::thread::spawn(move || {
                // SAFETY: unshare of this thread's fd table.
                if unsafe { libc::unshare(libc::CLONE_FILES) } != 0 {
                    say("unshare failed");
                    return;
                }
                match ring_holding(&path) {
                    Ok(_ring) => {
                        say("held");
                        sleep_forever();
                    }
                    Err(e) => say(&e),
                }
            });
            sleep_forever();
        }
        _ => ExitCode::from(2),
    }
}

/// `flood`: a descriptor table as large as the user may make it, of
/// copies of one device, `/dev/null` and bare rings.
fn flood(path: &str, copies: usize, fillers: usize, rings: usize) -> ExitCode {
    let need = (copies + fillers + rings + 64) as libc::rlim_t;
    // SAFETY: getrlimit/setrlimit on a struct we own. Root may raise the
    // hard limit (up to fs.nr_open); anyone the soft one to the hard.
    unsafe {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        if lim.rlim_max < need {
            let raised = libc::rlimit {
                rlim_cur: need,
                rlim_max: need,
            };
            libc::setrlimit(libc::RLIMIT_NOFILE, &raised);
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        }
        lim.rlim_cur = lim.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
    }
    let mut made = 0usize;
    let dup_n = |fd: RawFd, n: usize| -> Option<usize> {
        for _ in 0..n {
            // SAFETY: dup(2) of a descriptor we hold; the copy is kept.
            if unsafe { libc::dup(fd) } < 0 {
                return None;
            }
        }
        Some(n)
    };
    if path != "-" {
        let Ok(dev) = open(path, false) else {
            say(&format!("{path} not opened"));
            return ExitCode::FAILURE;
        };
        let Some(n) = dup_n(dev.as_raw_fd(), copies) else {
            say("dup failed");
            return ExitCode::FAILURE;
        };
        made += n + 1;
        std::mem::forget(dev);
    }
    if fillers > 0 {
        let Ok(null) = open("/dev/null", true) else {
            return ExitCode::FAILURE;
        };
        let Some(n) = dup_n(null.as_raw_fd(), fillers) else {
            say("dup failed");
            return ExitCode::FAILURE;
        };
        made += n + 1;
        std::mem::forget(null);
    }
    for _ in 0..rings {
        let mut params = [0u8; 120];
        // SAFETY: io_uring_setup(2) with a zeroed params struct; the ring
        // is kept.
        if unsafe { libc::syscall(libc::SYS_io_uring_setup, 1u32, params.as_mut_ptr()) } < 0 {
            say(&format!(
                "io_uring_setup: {}",
                std::io::Error::last_os_error()
            ));
            return ExitCode::FAILURE;
        }
        made += 1;
    }
    say("flooded");
    say(&format!("{made} descriptors"));
    sleep_forever();
}

/// `tables`: a process of `tables` private descriptor tables of `slots`
/// descriptors each (threads that `unshare(CLONE_FILES)`), holding
/// `path` only in the last slot of the last table: what a walk of
/// `/proc` pays for in full (issue 33).
fn tables(path: &str, tables: usize, slots: usize) -> ExitCode {
    // SAFETY: getrlimit/setrlimit on a struct we own.
    let last = unsafe {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur = lim.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        lim.rlim_cur.min(i32::MAX as libc::rlim_t) as RawFd - 1
    };
    let Ok(null) = open("/dev/null", true) else {
        say("/dev/null not opened");
        return ExitCode::FAILURE;
    };
    for _ in 0..slots.min(last.max(1) as usize - 1) {
        // SAFETY: dup(2) of a descriptor we hold; the copy is kept.
        if unsafe { libc::dup(null.as_raw_fd()) } < 0 {
            say("dup failed");
            return ExitCode::FAILURE;
        }
    }
    std::mem::forget(null);
    let (tx, rx) = std::sync::mpsc::channel::<Result<(), String>>();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let mut go_rx = Some(go_rx);
    let threads = tables.saturating_sub(1);
    let recv = path.strip_prefix("--recv=").map(str::to_string);
    for i in 0..threads {
        let tx = tx.clone();
        let path = path.to_string();
        let recv = recv.clone();
        let go = if i + 1 == threads { go_rx.take() } else { None };
        let spawned = std::thread::Builder::new()
            .stack_size(64 << 10)
            .spawn(move || {
                // SAFETY: unshare of this thread's descriptor table.
                if unsafe { libc::unshare(libc::CLONE_FILES) } != 0 {
                    let _ = tx.send(Err("unshare failed".into()));
                    return;
                }
                if let (Some(sock), Some(go)) = (&recv, go) {
                    // Every other table made first; then the descriptor
                    // handed over lands in this table's last slot.
                    let _ = tx.send(Ok(()));
                    let _ = go.recv();
                    let Some(fd) = receive_one(sock) else {
                        say("nothing");
                        sleep_forever();
                    };
                    // SAFETY: dup2(2) into this thread's own table.
                    if unsafe { libc::dup2(fd.as_raw_fd(), last) } == last {
                        drop(fd);
                        say("received");
                    } else {
                        say(&format!("dup2 to {last} failed"));
                    }
                    sleep_forever();
                }
                if i + 1 == threads {
                    match open(&path, false) {
                        // SAFETY: dup2(2) into this thread's own table.
                        Ok(fd) if unsafe { libc::dup2(fd.as_raw_fd(), last) } == last => {
                            drop(fd);
                        }
                        Ok(_) => {
                            let _ = tx.send(Err(format!("dup2 to {last} failed")));
                            return;
                        }
                        Err(e) => {
                            let _ = tx.send(Err(format!("{path} {}", word(Err(e)))));
                            return;
                        }
                    }
                }
                let _ = tx.send(Ok(()));
                sleep_forever();
            });
        if spawned.is_err() {
            say(&format!("thread {i} not started"));
            return ExitCode::FAILURE;
        }
    }
    for _ in 0..threads {
        match rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                say(&e);
                return ExitCode::FAILURE;
            }
            Err(_) => return ExitCode::FAILURE,
        }
    }
    if recv.is_some() {
        let _ = go_tx.send(());
    } else {
        say("held");
        say(&format!("{} tables", threads + 1));
    }
    sleep_forever();
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    match a.as_slice() {
        ["flood", path, copies, fillers, rings] => {
            match (copies.parse(), fillers.parse(), rings.parse()) {
                (Ok(c), Ok(f), Ok(r)) => return flood(path, c, f, r),
                _ => return ExitCode::from(2),
            }
        }
        ["tables", path, n, slots] => match (n.parse(), slots.parse()) {
            (Ok(n), Ok(s)) => return tables(path, n, s),
            _ => return ExitCode::from(2),
        },
        ["open", rest @ ..] => {
            let (ro, paths) = match rest {
                ["--ro", p @ ..] => (true, p),
                p => (false, p),
            };
            for p in paths {
                say(&format!("{p} {}", word(open(p, ro).map(|_| ()))));
            }
        }
        // NVML as gpufence loads it (nvml-wrapper): init, then each
        // device's handle by index: "init ok" or "init <error>", then
        // "handle <i> minor <m>" or "handle <i> <error>".
        ["nvml", lib] => match nvml_wrapper::Nvml::builder()
            .lib_path(std::ffi::OsStr::new(lib))
            .init()
        {
            Err(e) => say(&format!("init {e:?}")),
            Ok(n) => {
                say("init ok");
                for i in 0..n.device_count().unwrap_or(0) {
                    match n.device_by_index(i).and_then(|d| d.minor_number()) {
                        Ok(m) => say(&format!("handle {i} minor {m}")),
                        Err(e) => say(&format!("handle {i} {e:?}")),
                    }
                }
            }
        },
        ["objget", paths @ ..] => {
            use gpufence_cgroup::sys;
            for p in paths {
                match sys::obj_get(std::path::Path::new(p)) {
                    Err(e) => say(&format!("{p} {}", word(Err(e.raw_os_error().unwrap_or(0))))),
                    Ok(fd) => {
                        say(&format!("{p} ok"));
                        if let Ok(map) = sys::MapFd::from_fd(fd) {
                            let k = vec![0u8; map.shape().key_size as usize];
                            let v = vec![0u8; map.shape().value_size as usize];
                            let r = sys::map_update(&map, &k, &v)
                                .map_err(|e| e.raw_os_error().unwrap_or(0));
                            say(&format!("{p} update {}", word(r)));
                        }
                    }
                }
            }
        }
        ["write", paths @ ..] => {
            for p in paths {
                let r = std::fs::OpenOptions::new()
                    .append(true)
                    .create(true)
                    .open(p)
                    .map(|_| ())
                    .map_err(|e| e.raw_os_error().unwrap_or(0));
                say(&format!("{p} {}", word(r)));
            }
        }
        ["mknod", path, major, minor] => {
            let (Ok(ma), Ok(mi)) = (major.parse::<u32>(), minor.parse::<u32>()) else {
                return ExitCode::from(2);
            };
            let c = CString::new(*path).unwrap_or_default();
            // SAFETY: mknod(2) with a NUL-terminated path.
            let r =
                unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o600, libc::makedev(ma, mi)) };
            let res = if r == 0 {
                let _ = std::fs::remove_file(path);
                Ok(())
            } else {
                Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
            };
            say(&format!("{path} {}", word(res)));
        }
        ["hold", rest @ ..] if !rest.is_empty() => {
            let path = rest[rest.len() - 1];
            let flags = &rest[..rest.len() - 1];
            if flags.iter().any(|f| {
                !matches!(*f, "--ignore-term" | "--daemon")
                    && !f.starts_with("--via=")
                    && !f.starts_with("--pass-on-term=")
                    && !f.starts_with("--drop-when=")
            }) {
                return ExitCode::from(2);
            }
            let via = flags
                .iter()
                .find_map(|f| f.strip_prefix("--via="))
                .unwrap_or("fd");
            if via != "fd" {
                return hold_hidden(path, via);
            }
            if let Some(sock) = flags.iter().find_map(|f| f.strip_prefix("--pass-on-term=")) {
                return hold_then_pass(path, sock);
            }
            if flags.contains(&"--ignore-term") {
                // SAFETY: setting a signal disposition to SIG_IGN.
                unsafe { libc::signal(libc::SIGTERM, libc::SIG_IGN) };
            }
            if flags.contains(&"--daemon") {
                // SAFETY: fork in a single-threaded process; the children
                // only call async-signal-safe functions and our own code.
                unsafe {
                    match libc::fork() {
                        -1 => return ExitCode::FAILURE,
                        0 => {
                            libc::setsid();
                            if libc::fork() != 0 {
                                libc::_exit(0);
                            }
                        }
                        child => {
                            let mut st = 0;
                            libc::waitpid(child, &mut st, 0);
                            // give the grandchild time to report
                            std::thread::sleep(std::time::Duration::from_millis(300));
                            return ExitCode::SUCCESS;
                        }
                    }
                }
            }
            let drop_when = flags.iter().find_map(|f| f.strip_prefix("--drop-when="));
            match open(path, false) {
                Ok(fd) => {
                    if let Some(flag) = drop_when {
                        // Holds until the file `flag` appears, then lets
                        // go of the device and lives on.
                        say("held");
                        while !std::path::Path::new(flag).exists() {
                            std::thread::sleep(std::time::Duration::from_millis(10));
                        }
                        drop(fd);
                        sleep_forever();
                    }
                    if flags.contains(&"--daemon") {
                        say(&format!("held {}", std::process::id()));
                        // Let the job's output pipe close: nothing keeps it open.
                        // SAFETY: replacing our own stdio with /dev/null.
                        unsafe {
                            let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
                            libc::dup2(null, 0);
                            libc::dup2(null, 1);
                            libc::dup2(null, 2);
                        }
                    } else {
                        say("held");
                    }
                    sleep_forever();
                }
                Err(e) => {
                    say(&format!("{path} {}", word(Err(e))));
                    return ExitCode::FAILURE;
                }
            }
        }
        // Another process's descriptor, as a debugger takes it
        // (`pidfd_getfd(2)`: PTRACE_MODE_ATTACH_REALCREDS on the target).
        ["getfd", pid, fd] => {
            let (Ok(pid), Ok(fd)) = (pid.parse::<i32>(), fd.parse::<i32>()) else {
                return ExitCode::from(2);
            };
            // SAFETY: pidfd_open(2) and pidfd_getfd(2) with integers; the
            // descriptors returned are closed at exit.
            let r = unsafe {
                let pfd = libc::syscall(libc::SYS_pidfd_open, pid, 0);
                if pfd < 0 {
                    -1
                } else {
                    libc::syscall(libc::SYS_pidfd_getfd, pfd as i32, fd, 0)
                }
            };
            let res = if r < 0 {
                Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
            } else {
                Ok(())
            };
            say(&format!("getfd {}", word(res)));
        }
        ["trace", pid] => {
            // A tracer that never waits: the tracee's exit is reported to
            // it, so its parent's wait(2) waits as long as this lives.
            let Ok(pid) = pid.parse::<i32>() else {
                return ExitCode::FAILURE;
            };
            // SAFETY: PTRACE_SEIZE of a pid; no memory is passed.
            let r = unsafe { libc::ptrace(libc::PTRACE_SEIZE, pid, 0, 0) };
            if r != 0 {
                say(&format!("trace {}", std::io::Error::last_os_error()));
                return ExitCode::FAILURE;
            }
            say("traced");
            sleep_forever();
        }
        // `--ring=registered`: the received descriptor goes into an
        // io_uring whose own descriptor is registered
        // (IORING_REGISTER_RING_FDS) and closed; `--ring=thread`: into a
        // ring kept only in a thread's private table. Then it is closed:
        // the ring alone holds it.
        // Receives a descriptor, maps it, closes it, and the main thread
        // leaves: the mapping is seen through a live thread only.
        ["recvfd", "--map-leader-exit", sock] => {
            let Some(fd) = receive_one(sock) else {
                return ExitCode::FAILURE;
            };
            match map_and_close(fd) {
                Ok(()) => return leader_leaves("received"),
                Err(e) => {
                    say(&e);
                    return ExitCode::FAILURE;
                }
            }
        }
        ["recvfd", ring, sock] if ring.starts_with("--ring=") => {
            let Some(fd) = receive_one(sock) else {
                return ExitCode::FAILURE;
            };
            match &ring["--ring=".len()..] {
                "registered" => match ring_with(fd.as_raw_fd(), 0).and_then(register_and_close) {
                    Ok(()) => {
                        drop(fd);
                        say("received");
                        sleep_forever();
                    }
                    Err(e) => {
                        say(&e);
                        return ExitCode::FAILURE;
                    }
                },
                "thread" => {
                    let raw = std::os::fd::IntoRawFd::into_raw_fd(fd);
                    let (tx, rx) = std::sync::mpsc::channel();
                    std::thread::spawn(move || {
                        // SAFETY: unshare of this thread's fd table (a
                        // copy: the received descriptor is in it too).
                        if unsafe { libc::unshare(libc::CLONE_FILES) } != 0 {
                            say("unshare failed");
                            let _ = tx.send(false);
                            return;
                        }
                        let ok = ring_with(raw, 0).map_err(|e| say(&e)).is_ok();
                        // SAFETY: closes this table's copy of the descriptor.
                        unsafe { libc::close(raw) };
                        let _ = tx.send(ok);
                        sleep_forever();
                    });
                    if rx.recv() != Ok(true) {
                        return ExitCode::FAILURE;
                    }
                    // The main table's copy goes: only the thread's ring
                    // holds it.
                    // SAFETY: closes the main table's copy.
                    unsafe { libc::close(raw) };
                    say("received");
                    sleep_forever();
                }
                _ => return ExitCode::from(2),
            }
        }
        ["recvfd", sock] => {
            let _ = std::fs::remove_file(sock);
            let l = match UnixListener::bind(sock) {
                Ok(l) => l,
                Err(e) => {
                    say(&format!("bind: {e}"));
                    return ExitCode::FAILURE;
                }
            };
            let _ =
                std::fs::set_permissions(sock, std::os::unix::fs::PermissionsExt::from_mode(0o777));
            say("listening");
            let Ok((s, _)) = l.accept() else {
                return ExitCode::FAILURE;
            };
            let mut buf = [0u8; 8];
            let mut iov = [IoSliceMut::new(&mut buf)];
            let mut cmsg = nix::cmsg_space!([RawFd; 1]);
            let Ok(msg) =
                recvmsg::<()>(s.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::empty())
            else {
                return ExitCode::FAILURE;
            };
            let mut held = Vec::new();
            for c in msg.cmsgs().into_iter().flatten() {
                if let ControlMessageOwned::ScmRights(fds) = c {
                    // SAFETY: descriptors received over SCM_RIGHTS are ours.
                    held.extend(
                        fds.into_iter()
                            .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                    );
                }
            }
            say(if held.is_empty() {
                "nothing"
            } else {
                "received"
            });
            sleep_forever();
        }
        ["sendfd", sock, path] => {
            let fd = match open(path, false) {
                Ok(fd) => fd,
                Err(e) => {
                    say(&format!("{path} {}", word(Err(e))));
                    return ExitCode::FAILURE;
                }
            };
            let Ok(s) = UnixStream::connect(sock) else {
                say("connect failed");
                return ExitCode::FAILURE;
            };
            let fds = [fd.as_raw_fd()];
            let iov = [IoSlice::new(b"x")];
            match sendmsg::<()>(
                s.as_raw_fd(),
                &iov,
                &[ControlMessage::ScmRights(&fds)],
                MsgFlags::empty(),
                None,
            ) {
                Ok(_) => say("sent"),
                Err(e) => {
                    say(&format!("sendmsg: {e}"));
                    return ExitCode::FAILURE;
                }
            }
        }
        ["holders", dev] => {
            let Some((ma, mi)) = dev.split_once(':') else {
                return ExitCode::from(2);
            };
            let (Ok(ma), Ok(mi)) = (ma.parse(), mi.parse()) else {
                return ExitCode::from(2);
            };
            let want = [gpufence_model::device::DevNum::new(ma, mi)].into();
            for h in gpufence_node::holders::scan::holders(&want) {
                say(&h.pid.to_string());
            }
        }
        ["apply", config, job, uid, pid] => {
            let (Ok(job), Ok(uid), Ok(pid)) = (job.parse(), uid.parse(), pid.parse()) else {
                return ExitCode::from(2);
            };
            let node = match gpufence_node::Node::load(Some(std::path::Path::new(config))) {
                Ok(n) => n,
                Err(e) => {
                    say(&format!("error: {e}"));
                    return ExitCode::FAILURE;
                }
            };
            let req = gpufence_node::job::grant::StepRequest {
                job_id: job,
                step_id: 0,
                uid,
                stepd_pid: pid,
            };
            // The plugin's own step (a CPU-less stand-in for slurmstepd).
            match gpufence_node::job::grant::grant_step(&node, &req, "this node", || false).outcome
            {
                Ok(o) => say(&format!("{o:?}")),
                Err(e) => {
                    say(&format!("error: {e}"));
                    return ExitCode::FAILURE;
                }
            }
        }
        ["listen", addr, port, ..] => {
            let Ok(port) = port.parse::<u16>() else {
                return ExitCode::from(2);
            };
            match std::net::TcpListener::bind((*addr, port)) {
                Ok(l) => {
                    say("listening");
                    let _keep = l;
                    sleep_forever();
                }
                Err(e) => {
                    say(&format!("bind {addr}:{port}: {e}"));
                    return ExitCode::FAILURE;
                }
            }
        }
        ["connect", addr, port, ..] => {
            let Ok(port) = port.parse::<u16>() else {
                return ExitCode::from(2);
            };
            match std::net::TcpStream::connect((*addr, port)) {
                Ok(s) => {
                    say("connected");
                    let _keep = s;
                    sleep_forever();
                }
                Err(e) => {
                    say(&format!("connect {addr}:{port}: {e}"));
                    return ExitCode::FAILURE;
                }
            }
        }
        _ => {
            eprintln!("usage: gpufence-probe open [--ro] PATH... | mknod PATH MAJOR MINOR | hold PATH | recvfd SOCK | sendfd SOCK PATH | holders MAJOR:MINOR | apply CONFIG JOB UID PID | listen ADDR PORT [ARG...] | connect ADDR PORT [ARG...]");
            return ExitCode::from(2);
        }
    }
    ExitCode::SUCCESS
}
