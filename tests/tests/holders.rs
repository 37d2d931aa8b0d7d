//! Holds that `/proc/<pid>/fd` does not show (found in an attack on the
//! first version): a thread with its own descriptor table, a process whose
//! main thread exited, an io_uring registered file (live, here), a mapping
//! whose descriptor was closed (on fixture /proc shapes in `node::scan`'s
//! unit tests: test hosts have no mappable character device). Plus the epilog's answers to a holder that hands its
//! descriptor on while handling SIGTERM, and to one owned by a system account.

use std::collections::BTreeSet;

use gpufence_cgroup::fence::Fence;
use gpufence_model::config::{Config, ConfigOrigin};
use gpufence_model::device::DevNum;
use gpufence_node::holders::scan::{Holder, Scanner, Source, Via};
use gpufence_node::{host::fence_ops, job::epilog, Node};
use gpufence_tests::{gone, privileged, HoldableDevice, TestEnv};

/// Held by each test here that responds to holders or makes a ring the
/// kernel's iterator cannot read whole: such a ring is taken to hold every
/// job's devices (fail closed), so another test's Epilog would see it.
static RESPONSES: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn responses() -> std::sync::MutexGuard<'static, ()> {
    RESPONSES.lock().unwrap_or_else(|e| e.into_inner())
}

fn hold_via(env: &mut TestEnv, dev: &std::path::Path, via: &str) -> Option<i32> {
    let cg = env.cgroup("holders");
    let arg = format!("--via={via}");
    let mut cmd = env.command_in(&cg, gpufence_tests::probe_bin());
    cmd.args(["hold", &arg, dev.to_str().unwrap()]);
    let mut child = cmd.stdout(std::process::Stdio::piped()).spawn().unwrap();
    let pid = child.id() as i32;
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    if line.trim() != "held" {
        let _ = child.kill();
        let _ = child.wait();
        eprintln!("{via}: {}", line.trim());
        return None;
    }
    std::mem::forget(child); // killed with the test's cgroup
    Some(pid)
}

#[test]
fn hidden_holds_are_found() {
    if !privileged() {
        return;
    }
    let mut env = TestEnv::new("hidden");
    let real = HoldableDevice::claim();
    let dev = DevNum::new(real.major, real.minor);
    let node_path = env.mknod("held", real.major, real.minor);
    let want: BTreeSet<DevNum> = [dev].into();
    let mut pids = Vec::new();
    for (via, expect) in [("thread", Via::ThreadFd), ("leader-exit", Via::ThreadFd)] {
        let pid = hold_via(&mut env, &node_path, via).expect(via);
        // The main thread leaves right after saying "held": wait until its
        // table is gone from /proc/<pid>/fd.
        let t0 = std::time::Instant::now();
        while via == "leader-exit"
            && std::fs::read_dir(format!("/proc/{pid}/fd"))
                .map(|d| d.count() > 0)
                .unwrap_or(false)
            && t0.elapsed().as_secs() < 5
        {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        pids.push(pid);
        let h = Scanner::new()
            .holder(pid, &want)
            .unwrap_or_else(|| panic!("{via}: not found"));
        assert!(
            h.fds.iter().any(|f| f.via == expect && f.dev == dev),
            "{via}: {h:?}"
        );
        let plain = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|d| d.count())
            .unwrap_or(0);
        assert!(
            h.fds.iter().all(|f| f.via != Via::Fd),
            "{via}: the main table must not show it ({plain} entries there): {h:?}"
        );
    }
    // io_uring can be disabled by sysctl (kernel.io_uring_disabled); then
    // there is nothing to hide in and nothing to find.
    match hold_via(&mut env, &node_path, "io_uring") {
        Some(pid) => {
            let h = Scanner::new()
                .holder(pid, &want)
                .expect("io_uring registered file found");
            assert!(h.fds.iter().any(|f| f.via == Via::IoUring), "{h:?}");
        }
        None => eprintln!("io_uring unavailable here: registered-file holds cannot exist"),
    }
    // The ring only in a thread's private table (unshare(CLONE_FILES)):
    // read from that thread's fdinfo, by the walk and by the iterators.
    match hold_via(&mut env, &node_path, "io_uring-thread") {
        Some(pid) => {
            for mut sc in [Scanner::new(), Scanner::proc_walk()] {
                let found = sc
                    .holders(&want)
                    .into_iter()
                    .find(|h| h.pid == pid)
                    .unwrap_or_else(|| panic!("ring in a thread's table: {:?}", sc.source()));
                assert!(
                    found
                        .fds
                        .iter()
                        .any(|f| f.via == Via::IoUring && f.dev == dev && f.tid.is_some()),
                    "{found:?}"
                );
            }
            pids.push(pid);
        }
        None => assert_ne!(
            std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
                .unwrap_or_else(|_| "0".into())
                .trim(),
            "0",
            "io_uring is enabled, yet the probe could not hold through it"
        ),
    }
    // Killing a cgroup kills a process whose main thread exited, too (the
    // own layout's epilog and stale-job cleanup rely on it).
    let cg = format!("{}/holders", env.root);
    env.cg.kill(&cg).unwrap();
    let t0 = std::time::Instant::now();
    let dead = |p: i32| {
        gone(p)
            && std::fs::read_dir(format!("/proc/{p}/task"))
                .map(|d| d.count())
                .unwrap_or(0)
                <= 1
    };
    while !pids.iter().all(|p| dead(*p)) && t0.elapsed().as_secs() < 5 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    for p in pids {
        assert!(
            std::fs::read_dir(format!("/proc/{p}/task"))
                .map(|d| d.count())
                .unwrap_or(0)
                <= 1
                && gone(p),
            "pid {p} survived the cgroup kill"
        );
    }
}

/// A child of this process that maps `/dev/zero` privately (a character
/// device mapping with no descriptor left: what a GPU's mapping looks like
/// after `close()`; test hosts have no mappable GPU) and pauses. Dies with
/// this process.
fn map_dev_zero() -> i32 {
    let path = std::ffi::CString::new("/dev/zero").unwrap();
    forked("mapping /dev/zero", || {
        // SAFETY: async-signal-safe calls on a NUL-terminated path.
        unsafe {
            let fd = libc::open(path.as_ptr(), libc::O_RDONLY);
            let m = libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                fd,
                0,
            );
            libc::close(fd);
            m != libc::MAP_FAILED
        }
    })
}

/// Forks a child of this process that runs `set_up` (async-signal-safe
/// calls only), says whether it worked, and pauses until killed (it dies
/// with this process). Returns its pid once it has said `true`; panics
/// naming `what` otherwise.
fn forked(what: &str, set_up: impl FnOnce() -> bool) -> i32 {
    let mut ready = [0i32; 2];
    // SAFETY: pipe(2) into a local array.
    assert_eq!(unsafe { libc::pipe(ready.as_mut_ptr()) }, 0);
    // SAFETY: the child makes only async-signal-safe calls and never returns.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        // SAFETY: as above.
        unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
        let ok: u8 = if set_up() { b'y' } else { b'n' };
        // SAFETY: as above.
        unsafe {
            libc::write(ready[1], (&ok as *const u8).cast(), 1);
            loop {
                libc::pause();
            }
        }
    }
    let mut b = 0u8;
    // SAFETY: reads one byte from our pipe; closes our ends.
    unsafe {
        libc::close(ready[1]);
        libc::read(ready[0], (&mut b as *mut u8).cast(), 1);
        libc::close(ready[0]);
    }
    assert_eq!(b, b'y', "{what} failed");
    pid
}

/// Waits (5 s at most) until `pid`'s main thread has exited while the
/// process lives on: its leader a zombie, another thread alive.
fn wait_leader_gone(pid: i32) -> bool {
    let t0 = std::time::Instant::now();
    while t0.elapsed().as_secs() < 5 {
        if gpufence_node::host::procs::leader_exited(pid) {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    false
}

fn ours(h: Vec<Holder>, pids: &[i32]) -> Vec<Holder> {
    h.into_iter().filter(|h| pids.contains(&h.pid)).collect()
}

/// The iterators (the default scan) find exactly what the /proc walk
/// finds, for every way the probe can hold a device (a plain descriptor, a
/// thread's own table, a process whose leader exited, an io_uring
/// registered file; its `mmap` needs a mappable device, so a private
/// /dev/zero mapping stands in), through `holders`, `holders_where` and the
/// sweep's `process_fds` (holds and sockets); the pinned scan split
/// between 1, 3 and 7 readers, too.
#[test]
fn iterators_find_what_the_proc_walk_finds() {
    if !privileged() {
        return;
    }
    // A ring kept by its mapping alone (below) is taken to hold every
    // device any scan looks for: no other test's scan may run meanwhile.
    let _serial = responses();
    let mut env = TestEnv::new("iterparity");
    let real = HoldableDevice::claim();
    let dev = DevNum::new(real.major, real.minor);
    let zero = DevNum::new(1, 5);
    let node_path = env.mknod("held", real.major, real.minor);
    let mut pids = Vec::new();
    let mut leader_exits = Vec::new();
    // (holder, how, device): each holder must be found holding that way.
    let mut expect = Vec::new();
    let dev_zero = std::path::Path::new("/dev/zero");
    for (via, kind, path, d) in [
        ("fd", Via::Fd, node_path.as_path(), dev),
        ("thread", Via::ThreadFd, &node_path, dev),
        ("leader-exit", Via::ThreadFd, &node_path, dev),
        ("mmap", Via::Mmap, &node_path, dev),
        ("io_uring", Via::IoUring, &node_path, dev),
        ("io_uring-thread", Via::IoUring, &node_path, dev),
        // Mapped, closed, main thread gone: only a live thread's view
        // shows the mapping (a private /dev/zero mapping stands in).
        ("mmap-leader-exit", Via::Mmap, dev_zero, zero),
        // A ring kept by its mapping alone, main thread gone.
        ("io_uring-mapped-leader-exit", Via::IoUring, &node_path, dev),
    ] {
        match hold_via(&mut env, path, via) {
            Some(pid) => {
                pids.push(pid);
                expect.push((pid, kind, d));
                if via.ends_with("leader-exit") {
                    leader_exits.push((via, pid));
                }
            }
            None if via == "mmap-leader-exit" => panic!("{via}: /dev/zero maps everywhere"),
            None => eprintln!("{via}: cannot hold that way here"),
        }
    }
    let mapper = map_dev_zero();
    pids.push(mapper);
    expect.push((mapper, Via::Mmap, zero));
    // The leader-exit holders' main threads leave right after "held".
    for (via, p) in &leader_exits {
        assert!(
            wait_leader_gone(*p),
            "{via}: the main thread of {p} did not exit"
        );
    }
    let want: BTreeSet<DevNum> = [dev, zero].into();
    let mut fast = Scanner::new();
    let got = ours(fast.holders(&want), &pids);
    assert_eq!(
        fast.source(),
        Some(&Source::Iterators),
        "{:?}",
        fast.source()
    );
    let mut slow = Scanner::proc_walk();
    let walked = ours(slow.holders(&want), &pids);
    assert_eq!(slow.source(), Some(&Source::Proc(None)));
    assert_eq!(got, walked);
    // What the Prolog and the Epilog read: the iterators the fence pinned
    // at install (one walk of every table and mapping, filtered in the
    // kernel by the fence's majors; both majors protected here), and the
    // same answer.
    let cfg = env.config(&format!(
        "nvml = false\n[majors]\nnvidia = 195\nfake-gpu = {}\nmem = 1\n",
        real.major
    ));
    let node = Node::new(Config::load(&cfg).unwrap(), ConfigOrigin::File(cfg)).unwrap();
    let installed = fence_ops::install(&node).unwrap();
    assert_eq!(installed.iterators_unpinned, None);
    let mut pinned = Scanner::with_pins(&env.bpffs);
    assert_eq!(ours(pinned.holders(&want), &pids), walked);
    assert!(pinned.read_pins(), "the pinned iterators were read");
    // Split between readers (one per CPU by default): one reader, and
    // more readers than this machine has CPUs, give the same answer.
    for readers in [1, 3, 7] {
        let mut split = Scanner::with_pins(&env.bpffs).with_readers(readers);
        assert_eq!(
            ours(split.holders(&want), &pids),
            walked,
            "split between {readers} readers"
        );
        assert!(split.read_pins());
    }
    // A device on a major the fence does not protect: the scan loads its
    // own iterators (the pinned ones would not show it) and finds it.
    let null: BTreeSet<DevNum> = [DevNum::new(1, 3), DevNum::new(5, 0)].into();
    let mut other = Scanner::with_pins(&env.bpffs);
    let _ = other.holders(&null);
    assert!(
        !other.read_pins(),
        "major 5 is not protected: not from the pins"
    );
    for (pid, via, d) in &expect {
        assert!(
            got.iter()
                .any(|h| h.pid == *pid && h.fds.iter().any(|f| f.via == *via && f.dev == *d)),
            "pid {pid} {via:?} {d}: {got:#?}"
        );
    }
    let sel = |d: DevNum| d == dev || d == zero;
    assert_eq!(
        ours(Scanner::new().holders_where(&sel), &pids),
        ours(Scanner::proc_walk().holders_where(&sel), &pids)
    );
    let mut sweep_fast = Scanner::new();
    let mut sweep_slow = Scanner::proc_walk();
    for p in &pids {
        assert_eq!(
            sweep_fast.process_fds(*p, &sel),
            sweep_slow.process_fds(*p, &sel),
            "pid {p}"
        );
    }
    assert_eq!(sweep_fast.source(), Some(&Source::Iterators));
    // SAFETY: kills and reaps our own child.
    unsafe {
        libc::kill(mapper, libc::SIGKILL);
        libc::waitpid(mapper, std::ptr::null_mut(), 0);
    }
}

/// When the iterators cannot run (here: the kernel's BTF is unreadable,
/// not BTF, or cut short), the scan walks /proc and finds the same holders,
/// saying why; it never answers "no holders" for an error.
#[test]
fn a_failing_fast_path_falls_back_to_the_same_answer() {
    if !privileged() {
        return;
    }
    let mut env = TestEnv::new("iterfallback");
    let real = HoldableDevice::claim();
    let dev = DevNum::new(real.major, real.minor);
    let node_path = env.mknod("held", real.major, real.minor);
    let pid = hold_via(&mut env, &node_path, "thread").expect("thread hold");
    let want: BTreeSet<DevNum> = [dev].into();
    let walked = ours(Scanner::proc_walk().holders(&want), &[pid]);
    assert_eq!(walked.len(), 1);
    // The epilog's walk is split between two threads; holders_where's is not.
    assert_eq!(
        ours(
            Scanner::proc_walk().holders_where(&|d| want.contains(&d)),
            &[pid]
        ),
        walked
    );
    let garbage = env.path("not-btf");
    std::fs::write(&garbage, b"\x9f\xeb\x01\x00 this is not BTF").unwrap();
    let truncated = env.path("truncated-btf");
    let vmlinux = std::fs::read(gpufence_cgroup::btf::VMLINUX_BTF).unwrap_or_default();
    std::fs::write(&truncated, &vmlinux[..vmlinux.len() / 2]).unwrap();
    for bad in [garbage, truncated, env.path("absent")] {
        let mut s = Scanner::with_btf(&bad);
        assert_eq!(ours(s.holders(&want), &[pid]), walked, "{}", bad.display());
        match s.source() {
            Some(Source::Proc(Some(why))) => assert!(why.contains("BTF"), "{why}"),
            other => panic!("{}: {other:?}", bad.display()),
        }
        let mut s = Scanner::with_btf(&bad);
        let f = s.process_fds(pid, &|d| d == dev);
        assert_eq!(f, Scanner::proc_walk().walk_process(pid, &|d| d == dev));
        assert!(f.holder.is_some());
        assert!(matches!(s.source(), Some(Source::Proc(Some(_)))));
    }
}

fn node(env: &TestEnv, major: u32) -> Node {
    let p = env.config(&format!(
        "term_grace_ms = 500\n[majors]\nnvidia = 195\nfake-gpu = {major}\n"
    ));
    Node::new(Config::load(&p).unwrap(), ConfigOrigin::File(p)).unwrap()
}

fn record(node: &Node, job: u32, dev: DevNum) {
    node.state
        .write_record(&gpufence_tests::job_record(
            job,
            0,
            Some((dev, std::path::Path::new("/dev/x"))),
        ))
        .unwrap();
}

/// A holder that, on SIGTERM, hands the descriptor to an accomplice that
/// hides it in a thread: the epilog's next round finds and kills the
/// accomplice too.
#[test]
fn a_descriptor_handed_on_during_sigterm_is_followed() {
    if !privileged() {
        return;
    }
    let _serial = responses();
    let mut env = TestEnv::new("handoff");
    let real = HoldableDevice::claim();
    let dev = DevNum::new(real.major, real.minor);
    let node = node(&env, real.major);
    fence_ops::install(&node).unwrap();
    let gpu = env.mknod("gpu", real.major, real.minor);
    let out = env.cgroup("outside");
    let sock = env.path("acc.sock");
    let s = sock.to_str().unwrap().to_string();
    std::fs::set_permissions(
        env.tmp.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let accomplice = env.spawn_user_probe(&out, &["recvfd", &s], "listening");
    // The first holder opens from outside the fenced subtree (where it may).
    let mut cmd = gpufence_tests::as_test_user(gpufence_tests::probe_bin());
    cmd.args([
        "hold",
        &format!("--pass-on-term={s}"),
        gpu.to_str().unwrap(),
    ]);
    let first = env.spawn_ready(cmd, "held");
    record(&node, 41, dev);
    let o = epilog::run(&node, 41, None);
    let who = |s: &epilog::Survivor| {
        s.to_string()
            .split_whitespace()
            .nth(1)
            .and_then(|p| std::fs::read(format!("/proc/{p}/cmdline")).ok())
            .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
    };
    assert!(
        o.clean(),
        "{o:?}\nsurvivors: {:?}",
        o.survivors.iter().map(who).collect::<Vec<_>>()
    );
    let pids: Vec<i32> = o.lingering.iter().map(|l| l.pid).collect();
    assert_eq!(pids, vec![first, accomplice], "{o:?}");
    assert!(gone(first) && gone(accomplice));
    assert!(
        o.notes.iter().any(|n| n.starts_with("round 2")),
        "{:?}",
        o.notes
    );
    let _ = Fence::open(&env.bpffs).unwrap();
}

/// A holder that ignores SIGTERM, in a cgroup of its own, against an
/// Epilog whose deadline (`epilog_deadline_ms` 1500) is far below its
/// waits (`term_grace_ms` 5000, the test config's `kill_wait_ms` 3000):
/// the Epilog cuts the
/// grace to fit, says which waits it cut (notes and one `epilog_deadline`
/// audit line), ends within less than the waits it was configured with,
/// and still fails closed: the holder is killed by SIGKILL, or, not seen
/// gone in a cut kill wait, the Epilog is unclean (the node drained).
/// How long it takes is measured in `gpufence-bench deadline`, not here.
#[test]
fn an_epilog_deadline_cuts_the_waits_and_fails_closed() {
    if !privileged() {
        return;
    }
    let _serial = responses();
    let mut env = TestEnv::new("deadline");
    let real = HoldableDevice::claim();
    let dev = DevNum::new(real.major, real.minor);
    let p = env.config(&format!(
        "term_grace_ms = 5000\nepilog_deadline_ms = 1500\n[majors]\nnvidia = 195\nfake-gpu = {}\n",
        real.major
    ));
    let node = Node::new(Config::load(&p).unwrap(), ConfigOrigin::File(p)).unwrap();
    fence_ops::install(&node).unwrap();
    let gpu = env.mknod("gpu", real.major, real.minor);
    let mut cmd = gpufence_tests::as_test_user(gpufence_tests::probe_bin());
    cmd.args(["hold", "--ignore-term", gpu.to_str().unwrap()]);
    let holder = env.spawn_ready(cmd, "held");
    let cg = env.cgroup("stubborn");
    env.cg.move_pid(&cg, holder).unwrap();
    record(&node, 48, dev);
    let t0 = std::time::Instant::now();
    let o = epilog::run(&node, 48, None);
    let took = t0.elapsed();
    // Under the 8 s of term_grace_ms + kill_wait_ms it waits without the
    // deadline (SIGTERM ignored: the whole grace).
    assert!(took < std::time::Duration::from_secs(8), "{took:?} {o:?}");
    let cut: Vec<&String> = o
        .notes
        .iter()
        .filter(|n| n.starts_with("epilog_deadline_ms 1500: "))
        .collect();
    assert!(
        cut.iter().any(|n| n.contains("of term_grace_ms 5000")
            || n.contains("term_grace_ms 5000 (nothing left)")),
        "{:?}",
        o.notes
    );
    let l = o.lingering.iter().find(|l| l.pid == holder).expect("found");
    match l.ended_by {
        Some(by) => {
            assert_eq!(by.as_str(), "SIGKILL", "it ignores SIGTERM: {o:?}");
            assert!(gone(holder));
        }
        None => assert!(!o.clean(), "not seen gone: unclean, drained: {o:?}"),
    }
    let audit = gpufence_tests::audit_log_settled(&node.cfg.audit_log);
    let line = audit
        .iter()
        .find(|e| e["event"] == "epilog_deadline")
        .expect("an epilog_deadline audit line");
    assert_eq!(line["deadline_ms"], 1500);
    assert_eq!(line["from"], "epilog_deadline_ms");
    assert!(
        line["cut"].as_array().is_some_and(|c| c
            .iter()
            .any(|v| v.as_str().is_some_and(|s| s.contains("term_grace_ms")))),
        "{line}"
    );
}

/// A root process holding a job's device (a user handed it a descriptor:
/// dbus keeps passed descriptors) is not killed: evidence, a survivor line,
/// an unclean epilog and a drain reason saying it was spared.
#[test]
fn system_accounts_are_spared_and_the_node_flagged() {
    if !privileged() {
        return;
    }
    let _serial = responses();
    let mut env = TestEnv::new("spared");
    let real = HoldableDevice::claim();
    let dev = DevNum::new(real.major, real.minor);
    let node = node(&env, real.major);
    fence_ops::install(&node).unwrap();
    let gpu = env.mknod("gpu", real.major, real.minor);
    let mut cmd = std::process::Command::new(gpufence_tests::probe_bin());
    cmd.args(["hold", gpu.to_str().unwrap()]);
    let daemon = env.spawn_ready(cmd, "held");
    record(&node, 42, dev);
    let o = epilog::run(&node, 42, None);
    assert!(!o.clean());
    assert!(!gone(daemon), "root's process is left alive");
    assert_eq!(o.lingering.len(), 1);
    assert!(
        o.lingering[0]
            .spared
            .as_ref()
            .unwrap()
            .to_string()
            .starts_with("system account (uid 0"),
        "{o:?}"
    );
    let ev = o.lingering[0].evidence.as_ref().unwrap();
    let name = ev.file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with(&format!("job42-pid{daemon}-")), "{name}");
    let r = o.drain_reason.unwrap();
    assert!(
        r.contains(&format!("pid {daemon}")) && r.contains("spared"),
        "{r}"
    );
}

/// An exempt cgroup covers system accounts only (the fence program checks
/// the task's real uid): a user's process that ends up there (slurmd runs
/// `su - <user>` in its own cgroup for `sbatch --get-user-env`) opens no
/// GPU, and one that brought a job's descriptor in is no exempt daemon:
/// the sweep reports it, the Epilog ends it with evidence, and `respond`
/// would act on it. Root's daemon beside it stays covered.
#[test]
fn a_users_process_in_an_exempt_cgroup_borrows_nothing() {
    if !privileged() {
        return;
    }
    let _serial = responses();
    let mut env = TestEnv::new("exempt-user");
    let real = HoldableDevice::claim();
    let dev = DevNum::new(real.major, real.minor);
    let exempt = env.cgroup("system.slice/slurmd.service");
    let p = env.config(&format!(
        "term_grace_ms = 500\nexempt_cgroups = [\"{exempt}\"]\n[majors]\nnvidia = 195\nfake-gpu = {}\n",
        real.major
    ));
    let node = Node::new(Config::load(&p).unwrap(), ConfigOrigin::File(p.clone())).unwrap();
    fence_ops::install(&node).unwrap();
    let gpu = env.mknod("gpu", real.major, real.minor);
    let n1 = env.mknod("nvidia1", 195, 1);
    // Opening there: root may, the user may not.
    assert_eq!(
        env.open_from(&exempt, &n1),
        "ENXIO",
        "root in the exemption"
    );
    let o = env
        .user_command_in(&exempt, gpufence_tests::probe_bin())
        .args(["open", n1.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        format!("{} EPERM", n1.display()),
        "a user's process in the exemption"
    );
    // The doctor says what the kernel does, for that user's process.
    let sleeper = env.spawn_user_sleeper(&exempt);
    let d = gpufence_node::admin::doctor::doctor(&node, Some(sleeper), None).unwrap();
    let v = d.devices.iter().find(|v| v.device == "195:1").unwrap();
    assert_eq!(
        (d.uid, v.verdict.as_str()),
        (gpufence_tests::cluster::test_uid(), "denied"),
        "{v:?}"
    );
    // A user's holder of a job's device moved into the exempt cgroup, and
    // root's daemon holding the same device there.
    let mut cmd = gpufence_tests::as_test_user(gpufence_tests::probe_bin());
    cmd.args(["hold", gpu.to_str().unwrap()]);
    let user = env.spawn_ready(cmd, "held");
    env.cg.move_pid(&exempt, user).unwrap();
    let mut cmd = env.command_in(&exempt, gpufence_tests::probe_bin());
    cmd.args(["hold", gpu.to_str().unwrap()]);
    let daemon = env.spawn_ready(cmd, "held");
    let swept = gpufence_node::sweep::execute(
        &node,
        &gpufence_node::sweep::SweepRequest {
            cgroup: Some(env.root.clone()),
            ..Default::default()
        },
    );
    let holders: Vec<i32> = swept
        .report
        .findings
        .iter()
        .filter(|f| f.kind == gpufence_node::sweep::Kind::UnfencedGpuHolder)
        .filter_map(|f| f.pid)
        .collect();
    assert_eq!(holders, vec![user], "{:?}", swept.report.findings);
    record(&node, 44, dev);
    let o = epilog::run(&node, 44, None);
    assert!(o.clean(), "{o:?}");
    let ended: Vec<i32> = o.lingering.iter().map(|l| l.pid).collect();
    assert_eq!(ended, vec![user], "{o:?}");
    assert!(o.lingering[0].evidence.is_some() && gone(user));
    assert!(!gone(daemon), "root's daemon in the exemption is covered");
    // A service account its entry names is covered again.
    std::fs::write(
        &p,
        std::fs::read_to_string(&p).unwrap().replace(
            &format!("exempt_cgroups = [\"{exempt}\"]"),
            &format!(
                "exempt_cgroups = [{{ cgroup = \"{exempt}\", users = [0, {}] }}]",
                gpufence_tests::cluster::test_uid()
            ),
        ),
    )
    .unwrap();
    let node = Node::new(Config::load(&p).unwrap(), ConfigOrigin::File(p)).unwrap();
    fence_ops::install(&node).unwrap();
    let o = env
        .user_command_in(&exempt, gpufence_tests::probe_bin())
        .args(["open", n1.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        format!("{} ENXIO", n1.display()),
        "a service uid in the exemption"
    );
}

/// Holders are pinned by a pidfd when they are found and checked again
/// before anything is done to them: one that let go of the device between
/// the scan and the response is left alone, and one that exited is skipped
/// (its pid may belong to another process by then).
#[test]
fn a_holder_that_let_go_is_left_alone() {
    if !privileged() {
        return;
    }
    let _serial = responses();
    let mut env = TestEnv::new("let-go");
    let real = HoldableDevice::claim();
    let dev = DevNum::new(real.major, real.minor);
    let node = node(&env, real.major);
    fence_ops::install(&node).unwrap();
    let gpu = env.mknod("gpu", real.major, real.minor);
    let flag = env.path("let-go");
    let mut cmd = gpufence_tests::as_test_user(gpufence_tests::probe_bin());
    cmd.args([
        "hold",
        &format!("--drop-when={}", flag.display()),
        gpu.to_str().unwrap(),
    ]);
    let released = env.spawn_ready(cmd, "held");
    let mut cmd = gpufence_tests::as_test_user(gpufence_tests::probe_bin());
    cmd.args(["hold", gpu.to_str().unwrap()]);
    let holder = env.spawn_ready(cmd, "held");
    let devs: BTreeSet<DevNum> = [dev].into();
    let cands =
        gpufence_node::response::respond::uncovered(&node, 0, None, &sought(&devs)).candidates;
    let mut found: Vec<i32> = cands.iter().map(|c| c.pid).collect();
    found.sort();
    let mut want = vec![released, holder];
    want.sort();
    assert_eq!(found, want);
    assert!(cands.iter().all(|c| c.pidfd.is_some()), "pinned when found");
    // One lets go of the device; the scan found it holding.
    std::fs::write(&flag, "").unwrap();
    let t0 = std::time::Instant::now();
    while gpufence_node::holders::scan::holder(released, &devs).is_some() {
        assert!(t0.elapsed().as_secs() < 5, "the probe never let go");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let (done, errors) = gpufence_node::response::respond::respond(
        &gpufence_node::response::respond::Responder {
            node: &node,
            job_id: 45,
            job_uid: None,
            phase: "epilog",
        },
        gpufence_node::response::respond::Mode::End,
        "test",
        cands,
        &mut gpufence_node::response::evidence::Budget::from_config(&node.cfg),
    );
    assert!(errors.is_empty(), "{errors:?}");
    let acted: Vec<i32> = done.iter().map(|l| l.pid).collect();
    assert_eq!(acted, vec![holder], "{done:?}");
    assert!(gone(holder));
    assert!(!gone(released), "a process that let go is not touched");
    let stat = std::fs::read_to_string(format!("/proc/{released}/stat")).unwrap();
    assert!(
        stat.rsplit(')')
            .next()
            .unwrap()
            .trim_start()
            .starts_with('S'),
        "not left stopped: {stat}"
    );
}

/// The response's evidence stays within its budget: every holder of one
/// executable shares one hash; with the hashing time spent, hashes are left
/// out and counted; with the bytes spent, records are cut to identity and
/// devices, then left out and counted. Every holder is ended either way.
#[test]
fn evidence_stays_within_its_budget() {
    if !privileged() {
        return;
    }
    let _serial = responses();
    use gpufence_node::response::evidence::Budget;
    use std::time::Duration;
    let mut env = TestEnv::new("budget");
    let real = HoldableDevice::claim();
    let dev = DevNum::new(real.major, real.minor);
    let node = node(&env, real.major);
    fence_ops::install(&node).unwrap();
    let gpu = env.mknod("gpu", real.major, real.minor);
    let devs: BTreeSet<DevNum> = [dev].into();
    let mut spawn = |n: usize| -> Vec<i32> {
        (0..n)
            .map(|_| {
                let mut cmd = gpufence_tests::as_test_user(gpufence_tests::probe_bin());
                cmd.args(["hold", gpu.to_str().unwrap()]);
                env.spawn_ready(cmd, "held")
            })
            .collect()
    };
    let respond = |budget: &mut Budget| {
        let cands =
            gpufence_node::response::respond::uncovered(&node, 0, None, &sought(&devs)).candidates;
        gpufence_node::response::respond::respond(
            &gpufence_node::response::respond::Responder {
                node: &node,
                job_id: 46,
                job_uid: None,
                phase: "epilog",
            },
            gpufence_node::response::respond::Mode::End,
            "test",
            cands,
            budget,
        )
    };
    let read = |l: &gpufence_node::response::respond::Lingering| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(l.evidence.as_ref().unwrap()).unwrap()).unwrap()
    };
    // Enough of everything: one hash for five holders of one executable.
    let pids = spawn(5);
    let mut b = Budget::new(1 << 30, Duration::from_secs(60), 1 << 30);
    let (done, errors) = respond(&mut b);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(done.len(), 5);
    assert!(pids.iter().all(|p| gone(*p)));
    assert_eq!(b.hashed(), 1, "one executable, hashed once");
    let hashes: BTreeSet<String> = done
        .iter()
        .map(|l| read(l)["exe_sha256"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(hashes.len(), 1, "{hashes:?}");
    assert_eq!(b.summary(), None);
    // No hashing time, and bytes for about two records.
    let pids = spawn(5);
    let first = read(&done[0]);
    let one = serde_json::to_vec_pretty(&first).unwrap().len() as u64;
    let mut b = Budget::new(1 << 30, Duration::ZERO, 2 * one);
    let (done, errors) = respond(&mut b);
    assert!(errors.is_empty(), "{errors:?}");
    assert!(pids.iter().all(|p| gone(*p)), "every holder ended");
    assert_eq!((b.hashed(), b.hashes_left_out), (0, 5));
    assert!(b.records_cut + b.records_left_out >= 3, "{b:?}");
    let written: u64 = done
        .iter()
        .filter_map(|l| l.evidence.as_ref())
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum();
    assert!(written <= 2 * one, "{written} > {}", 2 * one);
    let kept: Vec<serde_json::Value> = done
        .iter()
        .filter(|l| l.evidence.is_some())
        .map(read)
        .collect();
    assert!(kept.iter().all(|v| v["exe_sha256"].is_null()
        && v["left_out"][0]
            .as_str()
            .is_some_and(|s| s.contains("hashing time"))));
    assert!(
        b.summary()
            .is_some_and(|s| s.contains("5 hash(es) left out")),
        "{:?}",
        b.summary()
    );
}

/// An Epilog killed while it holds holders stopped (PrologEpilogTimeout)
/// leaves them noted: the next sweep (as the next Prolog or Epilog would)
/// kills each that is still the same process and thaws what was frozen,
/// and audits it. Nothing stays stopped for good.
#[test]
fn an_interrupted_response_leaves_nothing_stopped() {
    if !privileged() {
        return;
    }
    let _serial = responses();
    let mut env = TestEnv::new("interrupted");
    let real = HoldableDevice::claim();
    let dev = DevNum::new(real.major, real.minor);
    let node = node(&env, real.major);
    fence_ops::install(&node).unwrap();
    let gpu = env.mknod("gpu", real.major, real.minor);
    let hold = |env: &mut TestEnv| {
        let mut cmd = gpufence_tests::as_test_user(gpufence_tests::probe_bin());
        cmd.args(["hold", gpu.to_str().unwrap()]);
        env.spawn_ready(cmd, "held")
    };
    // One alone in a cgroup (frozen whole), one beside others (SIGSTOP).
    let alone = hold(&mut env);
    let cg = env.cgroup("leftovers");
    env.cg.move_pid(&cg, alone).unwrap();
    let beside = hold(&mut env);
    record(&node, 47, dev);
    let o = std::process::Command::new(gpufence_tests::workspace_bin("gpufence-epilog"))
        .args(["--config", env.path("gpufence.toml").to_str().unwrap()])
        .env("SLURM_JOB_ID", "47")
        .env("SLURM_JOB_UID", "0")
        .env(
            gpufence_node::crashpoint::ENV,
            gpufence_node::crashpoint::RESPOND_FROZEN.to_string(),
        )
        .output()
        .unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&o.status),
        Some(libc::SIGKILL),
        "{o:?}"
    );
    let events = std::fs::read_to_string(env.cg.path(&cg).join("cgroup.events")).unwrap();
    assert!(events.contains("frozen 1"), "{events}");
    let state = |p: i32| {
        std::fs::read_to_string(format!("/proc/{p}/stat"))
            .ok()
            .and_then(|s| s.rsplit(')').next().map(|r| r.trim_start().chars().next()))
            .flatten()
    };
    // (A stop is taken when the process next runs.)
    let t0 = std::time::Instant::now();
    while state(beside) != Some('T') && t0.elapsed().as_secs() < 5 {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(state(beside), Some('T'), "stopped by the killed Epilog");
    let swept = gpufence_node::sweep::execute(
        &node,
        &gpufence_node::sweep::SweepRequest {
            cgroup: Some(env.root.clone()),
            ..Default::default()
        },
    );
    assert!(gone(alone) && gone(beside), "{:?}", swept.report.notes);
    let ended: Vec<&String> = swept
        .report
        .notes
        .iter()
        .filter(|n| n.contains("left stopped by an interrupted response: killed"))
        .collect();
    assert_eq!(ended.len(), 2, "{:?}", swept.report.notes);
    let events = std::fs::read_to_string(env.cg.path(&cg).join("cgroup.events")).unwrap();
    assert!(events.contains("frozen 0"), "thawed: {events}");
    let audit = gpufence_tests::audit_log_settled(&node.cfg.audit_log);
    assert_eq!(
        audit
            .iter()
            .filter(|e| e["event"] == "interrupted_response" && e["killed"] == true)
            .count(),
        2
    );
    assert_eq!(
        std::fs::read_dir(node.state.responding_dir())
            .map(|d| d.count())
            .unwrap_or(0),
        0,
        "no note left"
    );
}

/// A note of a response that is still running (its responder alive, same
/// start time) is not another's to act on: a Prolog or sweep that starts
/// while an Epilog responds leaves the Epilog's stopped holders to it.
#[test]
fn a_running_response_is_left_alone() {
    if !privileged() {
        return;
    }
    let _serial = responses();
    let mut env = TestEnv::new("running-response");
    let real = HoldableDevice::claim();
    let node = node(&env, real.major);
    fence_ops::install(&node).unwrap();
    let cg = env.cgroup("held");
    let victim = env.spawn_user_sleeper(&cg);
    // SAFETY: stops a process this test started.
    unsafe { libc::kill(victim, libc::SIGSTOP) };
    let start = |p: i32| -> u64 {
        let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap();
        stat.rsplit(')')
            .next()
            .unwrap()
            .split_whitespace()
            .nth(19)
            .unwrap()
            .parse()
            .unwrap()
    };
    let dir = node.state.responding_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let note = dir.join(format!("{victim}-{}.json", start(victim)));
    let write = |by_pid: i32, by_start: u64| {
        std::fs::write(
            &note,
            serde_json::json!({"pid": victim, "start": start(victim), "job_id": 48,
                "cgroup": cg, "froze_cgroup": false, "by_pid": by_pid, "by_start": by_start})
            .to_string(),
        )
        .unwrap();
    };
    let me = std::process::id() as i32;
    write(me, start(me));
    let sweep = || {
        gpufence_node::sweep::execute(
            &node,
            &gpufence_node::sweep::SweepRequest {
                cgroup: Some(env.root.clone()),
                ..Default::default()
            },
        )
    };
    sweep();
    assert!(
        !gone(victim) && note.exists(),
        "a running response's holder is left to it"
    );
    // Its responder gone (another process at its pid, or none): ended.
    write(me, start(me) + 1);
    let o = sweep();
    assert!(gone(victim), "{:?}", o.report.notes);
    assert!(!note.exists());
}

/// A GPU descriptor registered in an io_uring whose own descriptor was
/// registered (`IORING_REGISTER_RING_FDS`) and closed: the ring is in no
/// descriptor table, so `/proc` never shows it; the kernel's ring iterator
/// reads it. A ring the iterator cannot read whole (the device behind
/// 10,000 other fixed files) is taken to hold the job's devices (fail
/// closed). The Epilog ends both holders with evidence.
#[test]
fn a_ring_in_no_descriptor_table_is_found() {
    if !privileged() {
        return;
    }
    let _serial = responses();
    let mut env = TestEnv::new("ring-fds");
    let real = HoldableDevice::claim();
    let dev = DevNum::new(real.major, real.minor);
    let node = node(&env, real.major);
    fence_ops::install(&node).unwrap();
    let gpu = env.mknod("gpu", real.major, real.minor);
    let want: BTreeSet<DevNum> = [dev].into();
    let hold = |env: &mut TestEnv, via: &str| -> Option<i32> {
        let mut cmd = gpufence_tests::as_test_user(gpufence_tests::probe_bin());
        cmd.args(["hold", &format!("--via={via}"), gpu.to_str().unwrap()]);
        let mut child = cmd.stdout(std::process::Stdio::piped()).spawn().unwrap();
        let pid = child.id() as i32;
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        if line.trim() != "held" {
            let _ = child.kill();
            let _ = child.wait();
            eprintln!("{via}: {}", line.trim());
            return None;
        }
        env.cg.move_pid(&env.cgroup("leftovers"), pid).unwrap();
        std::mem::forget(child);
        Some(pid)
    };
    let Some(plain) = hold(&mut env, "io_uring-registered") else {
        assert_ne!(
            std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
                .unwrap_or_else(|_| "0".into())
                .trim(),
            "0",
            "io_uring is enabled, yet the probe could not hold through a registered ring"
        );
        return;
    };
    let crowded = hold(&mut env, "io_uring-registered-crowded").expect("a crowded ring");
    let mapped = hold(&mut env, "io_uring-mapped").expect("a ring kept by its mapping");
    assert!(
        std::fs::read_dir(format!("/proc/{plain}/fd"))
            .unwrap()
            .flatten()
            .all(|e| std::fs::read_link(e.path())
                .is_ok_and(|t| !t.to_string_lossy().contains("io_uring"))),
        "the ring is in no descriptor table"
    );
    let mut sc = Scanner::new();
    let found = sc.holders(&want);
    assert_eq!(sc.ring_error(), None);
    let of = |pid: i32| found.iter().find(|h| h.pid == pid).cloned();
    let h = of(plain).unwrap_or_else(|| panic!("registered ring: {found:?}"));
    assert!(
        h.fds
            .iter()
            .any(|f| f.via == Via::IoUringRegisteredRing && f.dev == dev && f.tid == Some(plain)),
        "{h:?}"
    );
    assert!(h.fds.iter().all(|f| !f.unread), "read, not assumed: {h:?}");
    let h = of(crowded).unwrap_or_else(|| panic!("crowded ring: {found:?}"));
    assert!(
        h.fds.iter().any(|f| f.via == Via::IoUringRegisteredRing
            && f.path.to_string_lossy().contains("not read whole")),
        "{h:?}"
    );
    // The ring kept alive by its mapping alone cannot be read (a ring
    // file is not opened again by path): taken to hold the devices, by the
    // iterators' snapshot and by the /proc walk alike.
    for mut sc in [Scanner::new(), Scanner::proc_walk()] {
        let found = sc.holders(&want);
        let h = found
            .iter()
            .find(|h| h.pid == mapped)
            .unwrap_or_else(|| panic!("mapped ring ({:?}): {found:?}", sc.source()));
        assert!(
            h.fds
                .iter()
                .any(|f| f.via == Via::IoUring && f.unread && f.dev == dev),
            "{h:?}"
        );
    }
    // The /proc walk cannot see the registered ones, and says so.
    let mut walk = Scanner::proc_walk();
    let walked = walk.holders(&want);
    assert!(walked.iter().all(|h| h.pid != plain), "{walked:?}");
    assert!(walk.ring_error().is_some());
    // The Epilog ends both.
    record(&node, 49, dev);
    let o = epilog::run(&node, 49, None);
    assert!(o.clean(), "{o:?}");
    let mut ended: Vec<i32> = o.lingering.iter().map(|l| l.pid).collect();
    ended.sort();
    let mut want_ended = vec![plain, crowded, mapped];
    want_ended.sort();
    assert_eq!(ended, want_ended, "{o:?}");
    assert!(gone(plain) && gone(crowded) && gone(mapped));
    assert!(o.lingering.iter().all(|l| l.evidence.is_some()));
}

/// Tables one run of the fence's fd-table program cannot write whole
/// (`FD_RECORDS` records a task): a table alternating two protected
/// devices past it is read in further passes over that thread alone, in
/// the kernel, never by a `/proc` walk of the table: every descriptor
/// found, the same holds as the walk. Copies of one descriptor are one
/// record (no further pass), and a flood of io_uring rings without fixed
/// files (which hold nothing) writes nothing.
#[test]
fn tables_past_one_pass_are_read_in_further_passes() {
    if !privileged() {
        return;
    }
    let mut env = TestEnv::new("bigtable");
    let (a, b) = (HoldableDevice::claim(), HoldableDevice::claim());
    let (da, db) = (DevNum::new(a.major, a.minor), DevNum::new(b.major, b.minor));
    let (pa, pb) = (
        env.mknod("held-a", a.major, a.minor),
        env.mknod("held-b", b.major, b.minor),
    );
    let n = gpufence_cgroup::iter::fdtable::FD_RECORDS as usize + 50;
    let (ca, cb) = (
        std::ffi::CString::new(pa.to_str().unwrap()).unwrap(),
        std::ffi::CString::new(pb.to_str().unwrap()).unwrap(),
    );
    let raise_nofile = || {
        // SAFETY: getrlimit/setrlimit on a struct we own.
        unsafe {
            let mut lim = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    };
    let alternating = forked(&format!("opening two devices {n} times each"), || {
        raise_nofile();
        // SAFETY: async-signal-safe calls on NUL-terminated paths.
        (0..n).all(|_| unsafe {
            libc::open(ca.as_ptr(), libc::O_RDONLY) >= 0
                && libc::open(cb.as_ptr(), libc::O_RDONLY) >= 0
        })
    });
    let mut cmd = std::process::Command::new(gpufence_tests::probe_bin());
    cmd.args(["flood", pa.to_str().unwrap(), "5000", "2000", "1100"]);
    let copies = env.spawn_ready(cmd, "flooded");
    let cfg = env.config(&format!(
        "nvml = false\n[majors]\nnvidia = 195\nfake-gpu = {}\n",
        a.major
    ));
    let node = Node::new(Config::load(&cfg).unwrap(), ConfigOrigin::File(cfg)).unwrap();
    assert_eq!(fence_ops::install(&node).unwrap().iterators_unpinned, None);
    let want: BTreeSet<DevNum> = [da, db].into();
    let mut pinned = Scanner::with_pins(&env.bpffs);
    let got = ours(pinned.holders(&want), &[alternating, copies]);
    assert!(pinned.read_pins());
    assert!(
        pinned.passes() >= 2,
        "{} further passes for {} records",
        pinned.passes(),
        2 * n
    );
    assert!(pinned.over_budget().is_empty());
    let walked = ours(Scanner::proc_walk().holders(&want), &[alternating, copies]);
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(walked.len(), 2);
    // The alternating table: every descriptor, as the walk finds them.
    assert_eq!(got[0].pid.min(got[1].pid), walked[0].pid);
    let by = |h: &[Holder], pid: i32| h.iter().find(|x| x.pid == pid).cloned().unwrap();
    assert_eq!(by(&got, alternating), by(&walked, alternating));
    assert_eq!(by(&got, alternating).fds.len(), 2 * n, "every descriptor");
    // The copies: one record names the device; the walk lists all 5,001.
    let (g, w) = (by(&got, copies), by(&walked, copies));
    assert_eq!(g.devices(), [da].into());
    assert_eq!(w.devices(), [da].into());
    assert_eq!(w.fds.len(), 5001);
    assert_eq!(g.fds.len(), 1, "{g:?}");
    // The copies and the bare rings alone: one pass, nothing pending.
    // SAFETY: kills and reaps our own child.
    unsafe {
        libc::kill(alternating, libc::SIGKILL);
        libc::waitpid(alternating, std::ptr::null_mut(), 0);
    }
    let mut again = Scanner::with_pins(&env.bpffs);
    assert_eq!(ours(again.holders(&want), &[copies]).len(), 1);
    assert_eq!(
        again.passes(),
        0,
        "copies of one descriptor and bare rings need no further pass"
    );
}

/// A scan past its budget (`scan_budget_ms`; 0 here) fails closed. The
/// kernel's passes stop at a table's first clock check (1,024 slots): a
/// process whose table is larger is not read to its end. One of the job's
/// own user in the job's cgroup (`job_<id>`) then counts as holding all of
/// the job's devices (the usual response ends it); one of root there (a
/// job's slurmstepd) and one in another job are no candidates (never
/// killed for being unread): each is read again alone, within the budget,
/// and not read whole it is `not_read` (the GPU is not handed on), named
/// in one `scan_over_budget` audit line. A process with a small table is
/// read whole however late it comes, so the job's own small processes are
/// never taken for holders. With the default budget none is a candidate
/// and none unread.
#[test]
fn a_scan_past_its_budget_fails_closed_for_its_own_job_only() {
    if !privileged() {
        return;
    }
    let mut env = TestEnv::new("budget");
    let job = 4242;
    let in_job = env.cgroup(&format!("job_{job}/step_0/user/task_0"));
    let step = env.cgroup(&format!("job_{job}/step_extern/slurm"));
    let elsewhere = env.cgroup("job_4243/step_0/user/task_0");
    let big = ["flood", "-", "0", "2000", "0"];
    let mine = env.spawn_user_probe(&in_job, &big, "flooded");
    let small = env.spawn_user_sleeper(&in_job);
    let stepd = env.spawn_probe(&step, &big, "flooded");
    let other = env.spawn_user_probe(&elsewhere, &big, "flooded");
    let devs: BTreeSet<DevNum> = [DevNum::new(195, 0), DevNum::new(195, 1)].into();
    let cfg_at = |budget: u64| {
        let p = env.config(&format!(
            "nvml = false\nscan_budget_ms = {budget}\n[majors]\nnvidia = 195\n"
        ));
        Node::new(Config::load(&p).unwrap(), ConfigOrigin::File(p)).unwrap()
    };
    let node = cfg_at(0);
    fence_ops::install(&node).unwrap();
    let user = gpufence_tests::cluster::test_uid();
    let found = gpufence_node::response::respond::uncovered(&node, job, Some(user), &sought(&devs));
    let cands = found.candidates;
    let c = cands.iter().find(|c| c.pid == mine).unwrap_or_else(|| {
        panic!("pid {mine} of job {job} not read within the budget is no candidate: {cands:?}")
    });
    assert_eq!(c.devices, devs);
    assert!(c.fds.iter().all(|f| f.unread
        && f.path
            .to_string_lossy()
            .contains("within scan_budget_ms (0 ms)")));
    for (pid, who) in [
        (small, "the job's small process"),
        (stepd, "root's process in the job"),
        (other, "another job's process"),
    ] {
        assert!(
            !cands.iter().any(|c| c.pid == pid),
            "{who} ({pid}) is no candidate: {cands:?}"
        );
    }
    // Root's process in the job and the user's process in another job
    // are read again alone, within a budget of 0 ms: not read whole, so
    // the GPU is not handed on (never killed).
    for (pid, who) in [
        (stepd, "root's process in the job"),
        (other, "another job's"),
    ] {
        let n = found
            .not_read
            .iter()
            .find(|n| n.pid == pid)
            .unwrap_or_else(|| panic!("{who} ({pid}) not read: {:?}", found.not_read));
        assert!(n.reason().contains(&format!("pid {pid} ")), "{n:?}");
        assert!(n.reason().contains("not read within scan_budget_ms (0 ms)"));
    }
    assert!(!found
        .not_read
        .iter()
        .any(|n| n.pid == mine || n.pid == small));
    let lines: Vec<serde_json::Value> = gpufence_tests::audit_log(&env.path("log/audit.jsonl"))
        .into_iter()
        .filter(|e| e["event"] == "scan_over_budget")
        .collect();
    assert_eq!(lines.len(), 1, "{lines:?}");
    let unread: Vec<i64> = lines[0]["not_read"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p.as_i64())
        .collect();
    assert!(
        unread.contains(&i64::from(stepd)) || unread.len() == 20,
        "{lines:?}"
    );
    assert_eq!(lines[0]["job_id"], job);
    assert_eq!(lines[0]["budget_ms"], 0);
    assert!(lines[0]["processes"].as_u64().unwrap() >= 2, "{lines:?}");
    assert!(lines[0]["pids"].as_array().unwrap().len() <= 20);
    // The default budget: every table read, none a candidate.
    let node = cfg_at(2000);
    let found = gpufence_node::response::respond::uncovered(&node, job, Some(user), &sought(&devs));
    let cands = found.candidates;
    assert!(
        !found
            .not_read
            .iter()
            .any(|n| [mine, small, stepd, other].contains(&n.pid)),
        "{:?}",
        found.not_read
    );
    assert!(
        !cands
            .iter()
            .any(|c| [mine, small, stepd, other].contains(&c.pid)),
        "{cands:?}"
    );
}

/// A user hands their job's GPU descriptor to a process of another user's
/// job (anything that accepts descriptors on a socket it can reach) and
/// ends the job: the Epilog keeps evidence of the receiver but does not
/// end it (one user must not end another's job at will); it is a survivor,
/// so the node is not clean and is drained for an admin. The same hand-off
/// to a process of another user outside any job is ended as always.
#[test]
fn another_users_job_is_not_ended_for_a_descriptor_handed_to_it() {
    if !privileged() {
        return;
    }
    let _serial = responses();
    let mut env = TestEnv::new("xuser");
    let real = HoldableDevice::claim();
    let dev = DevNum::new(real.major, real.minor);
    let node = node(&env, real.major);
    fence_ops::install(&node).unwrap();
    let gpu = env.mknod("gpu", real.major, real.minor);
    let socks = env.path("socks");
    std::fs::create_dir_all(&socks).unwrap();
    std::fs::set_permissions(&socks, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    // Receivers of uid 23456: one in job 9's step cgroup, one outside jobs.
    let receiver = |env: &mut TestEnv, cg: &str, name: &str| {
        let sock = socks.join(name);
        let mut cmd = env.command_in(cg, "setpriv");
        cmd.args([
            "--reuid",
            "23456",
            "--regid",
            "23456",
            "--clear-groups",
            "--",
        ])
        .arg(gpufence_tests::probe_bin())
        .arg("recvfd")
        .arg(&sock);
        let pid = env.spawn_ready(cmd, "listening");
        let o = gpufence_tests::as_test_user(gpufence_tests::probe_bin())
            .arg("sendfd")
            .arg(&sock)
            .arg(&gpu)
            .output()
            .unwrap();
        assert!(String::from_utf8_lossy(&o.stdout).contains("sent"), "{o:?}");
        let t0 = std::time::Instant::now();
        while gpufence_node::holders::scan::holder(pid, &[dev].into()).is_none() {
            assert!(t0.elapsed().as_secs() < 5, "{name} never received it");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        pid
    };
    let in_job = env.cgroup("job_9/step_0/user/task_0");
    let outside = env.cgroup("outside");
    let other_job = receiver(&mut env, &in_job, "job9");
    let no_job = receiver(&mut env, &outside, "nojob");
    node.state
        .write_record(&gpufence_tests::job_record(
            48,
            gpufence_tests::cluster::test_uid(),
            Some((dev, &gpu)),
        ))
        .unwrap();
    let o = epilog::run(&node, 48, None);
    assert!(
        !o.clean(),
        "a survivor: the node is drained for an admin: {o:?}"
    );
    let spared = o
        .lingering
        .iter()
        .find(|l| l.pid == other_job)
        .expect("the receiver in job 9 is a holder");
    assert!(
        spared.spared.as_ref().is_some_and(|w| w
            .to_string()
            .contains("in another user's job (job_9, uid 23456)")),
        "{spared:?}"
    );
    assert!(spared.evidence.is_some(), "evidence kept");
    assert!(!gone(other_job), "another user's job is not ended");
    let ended = o.lingering.iter().find(|l| l.pid == no_job).unwrap();
    assert!(
        ended.gone() && gone(no_job),
        "outside any job: ended ({ended:?})"
    );
    let audit = gpufence_tests::audit_log(&env.path("log/audit.jsonl"));
    assert!(audit.iter().any(|e| e["event"] == "survivor"
        && e["pid"] == other_job
        && e["not_killed"]
            .as_str()
            .is_some_and(|w| w.contains("another user's job"))));
    // The spared holder is ended here, and gone, before the device is
    // released for another test to claim.
    env.cg.kill(&in_job).unwrap();
    let t0 = std::time::Instant::now();
    while !gpufence_node::holders::scan::holders(&[dev].into()).is_empty() {
        assert!(t0.elapsed().as_secs() < 5, "the spared holder did not end");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    drop(real);
}

/// Issue 33, point 1: a process of the job's user outside every job,
/// with 1,002 private descriptor tables (threads that
/// `unshare(CLONE_FILES)`) of as many descriptors as `RLIMIT_NOFILE`
/// allows (20 million descriptors on a 20,000 limit), holding the job's
/// device only in the last slot of the last table. The kernel's scan
/// finds it; the re-check before it is stopped looks at that descriptor
/// (not every descriptor of every table: 283 s before), and the kill
/// waits on its pidfd while its tables close (seconds: it was called a
/// survivor, and the node drained). The Epilog ends it, clean; so does
/// `gpufence respond` on another such process, which finds it gone.
/// Times are printed; the bound on them is only a stall guard.
#[test]
fn a_holder_of_a_thousand_tables_is_ended_not_walked() {
    if !privileged() {
        return;
    }
    let _serial = responses();
    let mut env = TestEnv::new("tables");
    let real = HoldableDevice::claim();
    let dev = DevNum::new(real.major, real.minor);
    let node = node(&env, real.major);
    fence_ops::install(&node).unwrap();
    let gpu = env.mknod("gpu", real.major, real.minor);
    std::fs::set_permissions(
        env.tmp.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let mut nofile = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit into a struct we own.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut nofile) };
    let slots = (nofile.rlim_max.min(1 << 20) as usize).saturating_sub(100);
    // GPUFENCE_TEST_TABLES=4002 measures the larger flood.
    let tables = std::env::var("GPUFENCE_TEST_TABLES").unwrap_or_else(|_| "1002".into());
    let flooded = |env: &mut TestEnv| {
        let mut cmd = gpufence_tests::as_test_user(gpufence_tests::probe_bin());
        cmd.args(["tables", gpu.to_str().unwrap(), &tables, &slots.to_string()]);
        env.spawn_ready(cmd, "held")
    };
    let holder = flooded(&mut env);
    record(&node, 51, dev);
    let t0 = std::time::Instant::now();
    let o = epilog::run(&node, 51, None);
    let epilog_took = t0.elapsed();
    eprintln!("epilog over {tables} tables of {slots} descriptors: {epilog_took:?}");
    assert!(o.clean(), "{o:?}");
    assert!(o.survivors.is_empty(), "{:?}", o.survivors);
    let l = o
        .lingering
        .iter()
        .find(|l| l.pid == holder)
        .unwrap_or_else(|| panic!("{holder} not responded to: {o:?}"));
    assert!(l.gone() && l.evidence.is_some(), "{l:?}");
    assert!(gone(holder));
    assert!(epilog_took.as_secs() < 60, "stalled: {epilog_took:?}");
    let audit = gpufence_tests::audit_log(&env.path("log/audit.jsonl"));
    assert!(
        !audit
            .iter()
            .any(|e| e["event"] == "survivor" && e["pid"] == holder),
        "{audit:?}"
    );

    // `gpufence respond PID`: bounded evidence, the truth about the kill.
    let other = flooded(&mut env);
    let t0 = std::time::Instant::now();
    let r = gpufence_node::response::incident::respond_pid(&node, other, None).unwrap();
    let respond_took = t0.elapsed();
    eprintln!("respond over {tables} tables of {slots} descriptors: {respond_took:?}");
    assert_eq!(r.killed, vec![other], "{r:?}");
    assert!(r.survivors.is_empty(), "{r:?}");
    assert!(gone(other));
    assert!(respond_took.as_secs() < 60, "stalled: {respond_took:?}");
    drop(real);
}

/// A node whose scan budget is `budget_ms` (0: the kernel's passes stop
/// at a table's first clock check, 1,024 slots, and a re-read at its
/// first descriptor).
fn node_with_budget(env: &TestEnv, major: u32, budget_ms: u64) -> Node {
    let p = env.config(&format!(
        "term_grace_ms = 500\nscan_budget_ms = {budget_ms}\n[majors]\nnvidia = 195\nfake-gpu = {major}\n"
    ));
    Node::new(Config::load(&p).unwrap(), ConfigOrigin::File(p)).unwrap()
}

/// `gpufence-probe tables PATH 8 2000` as uid 23456 (setpriv), in the
/// test's own cgroup (outside every job, and outside the cgroup the
/// test's fence is attached at, so it may open the device): eight private
/// descriptor tables of 2,000 slots, `path` in the last slot of the last.
fn tables_of_another_uid(env: &mut TestEnv, path: &std::path::Path) -> i32 {
    let mut cmd = std::process::Command::new("setpriv");
    cmd.args([
        "--reuid",
        "23456",
        "--regid",
        "23456",
        "--clear-groups",
        "--",
    ])
    .arg(gpufence_tests::probe_bin())
    .args(["tables", path.to_str().unwrap(), "8", "2000"]);
    env.spawn_ready(cmd, "held")
}

/// Survivors that are not this test's: "not read" lines of processes the
/// test did not make (a budget of 0 ms reads no large table on the
/// machine whole; their drain is the rule's, not this test's to judge).
fn others_not_read(survivors: &[epilog::Survivor], ours: &[i32]) -> bool {
    survivors.iter().map(ToString::to_string).all(|s| {
        s.contains("not read within scan_budget_ms")
            && !ours.iter().any(|p| s.starts_with(&format!("pid {p} ")))
    })
}

/// Issue 33, point 1 (second half), rule 2: past the budget, a process
/// of the job's user outside every job that could not be read whole is a
/// candidate, as it is inside the job. The job's user holds the job's
/// device in the last slot of the last of eight private tables of 2,000
/// slots, outside every job cgroup; with `scan_budget_ms = 0` the scan
/// cannot reach it. Before, it was one `scan_over_budget` line and kept
/// the GPU; now it is a candidate whose holds say "not read to its end",
/// and the Epilog ends it (`process_killed`), no drain for it. `gpufence
/// respond` on another such process says it was not read whole within
/// 0 ms.
#[test]
fn past_the_budget_the_job_users_process_outside_every_job_is_ended() {
    if !privileged() {
        return;
    }
    let _serial = responses();
    let mut env = TestEnv::new("budget-user");
    let real = HoldableDevice::claim();
    let dev = DevNum::new(real.major, real.minor);
    let node = node_with_budget(&env, real.major, 0);
    fence_ops::install(&node).unwrap();
    let gpu = env.mknod("gpu", real.major, real.minor);
    std::fs::set_permissions(
        env.tmp.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let user = gpufence_tests::cluster::test_uid();
    // In the test's own cgroup: outside every job.
    let flooded = |env: &mut TestEnv| {
        let mut cmd = gpufence_tests::as_test_user(gpufence_tests::probe_bin());
        cmd.args(["tables", gpu.to_str().unwrap(), "8", "2000"]);
        env.spawn_ready(cmd, "held")
    };
    let holder = flooded(&mut env);
    let devs: BTreeSet<DevNum> = [dev].into();
    let found = gpufence_node::response::respond::uncovered(&node, 53, Some(user), &sought(&devs));
    let c = found
        .candidates
        .iter()
        .find(|c| c.pid == holder)
        .unwrap_or_else(|| panic!("{holder} is no candidate: {found:?}"));
    assert_eq!(c.devices, devs);
    assert!(
        c.fds.iter().any(|f| f.unread
            && f.path
                .to_string_lossy()
                .contains("not read to its end within scan_budget_ms (0 ms)")),
        "{c:?}"
    );
    assert!(!found.not_read.iter().any(|n| n.pid == holder));
    // Another job's uid (unknown here): the same process is only read
    // again, never a candidate for being unread.
    let strangers =
        gpufence_node::response::respond::uncovered(&node, 53, Some(23457), &sought(&devs));
    assert!(
        !strangers.candidates.iter().any(|c| c.pid == holder),
        "{strangers:?}"
    );
    assert!(strangers.not_read.iter().any(|n| n.pid == holder));

    node.state
        .write_record(&gpufence_tests::job_record(53, user, Some((dev, &gpu))))
        .unwrap();
    let o = epilog::run(&node, 53, None);
    let l = o
        .lingering
        .iter()
        .find(|l| l.pid == holder)
        .unwrap_or_else(|| panic!("{holder} not responded to: {o:?}"));
    assert!(l.gone() && l.evidence.is_some(), "{l:?}");
    assert!(gone(holder));
    assert!(others_not_read(&o.survivors, &[holder]), "{o:?}");
    assert!(o.errors.is_empty(), "{o:?}");
    let audit = gpufence_tests::audit_log(&env.path("log/audit.jsonl"));
    assert!(audit
        .iter()
        .any(|e| e["event"] == "process_killed" && e["pid"] == holder));
    assert!(!audit
        .iter()
        .any(|e| e["event"] == "survivor" && e["pid"] == holder));

    // `gpufence respond PID`: it stops and kills, and says what it could
    // not read within the budget (0 ms) instead of calling it clean.
    let other = flooded(&mut env);
    let r = gpufence_node::response::incident::respond_pid(&node, other, None).unwrap();
    assert_eq!(r.killed, vec![other], "{r:?}");
    assert!(
        r.not_read
            .iter()
            .any(|n| n.starts_with(&format!("pid {other}: not read whole within 0 ms"))),
        "{r:?}"
    );
    assert!(gone(other));
    drop(real);
}

/// A scan the Epilog's deadline cut (`epilog_deadline_ms`): the job's
/// user's process outside every job that the cut scan could not read
/// whole (its systemd --user, tmux, dbus) is never a candidate for being
/// unread. The same process, with `scan_budget_ms = 0` configured (a full
/// budget), is one (rule 2, above); with the deadline leaving the scan
/// nothing of its 2000 ms it is read again, within what is left
/// (nothing), and is not read: never killed, the GPU not handed on
/// (`not_read`, the Epilog's drain reason). Then the Epilog itself, under
/// a deadline spent before it starts: the process lives, and the drain
/// reason names it "not read".
#[test]
fn a_deadline_cut_scan_never_ends_the_users_processes_outside_jobs() {
    if !privileged() {
        return;
    }
    let _serial = responses();
    let mut env = TestEnv::new("budget-cut");
    let real = HoldableDevice::claim();
    let dev = DevNum::new(real.major, real.minor);
    let node = node_with_budget(&env, real.major, 2000);
    fence_ops::install(&node).unwrap();
    let gpu = env.mknod("gpu", real.major, real.minor);
    std::fs::set_permissions(
        env.tmp.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let user = gpufence_tests::cluster::test_uid();
    // In the test's own cgroup: outside every job. It holds the job's
    // device in its last slot, so a scan that read it would find it.
    let mut cmd = gpufence_tests::as_test_user(gpufence_tests::probe_bin());
    cmd.args(["tables", gpu.to_str().unwrap(), "8", "2000"]);
    let session = env.spawn_ready(cmd, "held");
    let devs: BTreeSet<DevNum> = [dev].into();
    // Nothing left past the reserve: the scan gets 0 of its 2000 ms.
    let spent = std::sync::Arc::new(gpufence_node::host::deadline::Deadline::new(
        std::time::Duration::ZERO,
    ));
    let late = node.with_deadline(spent);
    let found = gpufence_node::response::respond::uncovered(&late, 56, Some(user), &sought(&devs));
    assert!(
        !found.candidates.iter().any(|c| c.pid == session),
        "a cut scan made it a candidate: {found:?}"
    );
    let n = found
        .not_read
        .iter()
        .find(|n| n.pid == session)
        .unwrap_or_else(|| panic!("{session} not in not_read: {found:?}"));
    assert!(
        n.reason()
            .contains("not read within scan_budget_ms (2000 ms)"),
        "{}",
        n.reason()
    );
    // Given its whole budget, the same process is read whole and found
    // holding: a candidate by what it holds, not for being unread.
    let full = gpufence_node::response::respond::uncovered(&node, 56, Some(user), &sought(&devs));
    let c = full
        .candidates
        .iter()
        .find(|c| c.pid == session)
        .unwrap_or_else(|| panic!("{session} not found holding: {full:?}"));
    assert!(c.fds.iter().all(|f| !f.unread), "{c:?}");

    // The Epilog under a deadline already spent: never killed, drained.
    node.state
        .write_record(&gpufence_tests::job_record(56, user, Some((dev, &gpu))))
        .unwrap();
    let o = epilog::run_within(
        &late,
        &epilog::EpilogEnv {
            job_id: 56,
            ..Default::default()
        },
    );
    assert!(
        !gone(session),
        "the user's process outside the job was killed: {o:?}"
    );
    assert!(!o.clean(), "{o:?}");
    assert!(!o.lingering.iter().any(|l| l.pid == session), "{o:?}");
    assert!(
        o.survivors.iter().any(|s| s
            .to_string()
            .starts_with(&format!("pid {session} (uid {user}, cgroup /"))
            && s.to_string()
                .contains("not read within scan_budget_ms (2000 ms)")),
        "{o:?}"
    );
    let reason = o.drain_reason.clone().unwrap_or_default();
    assert!(reason.contains("not read"), "{reason}");
    // SAFETY: kill(2) of our own child, made above.
    unsafe { libc::kill(session, libc::SIGKILL) };
    drop(real);
}

/// Rule 3: a process of another user (uid 23456), outside every job,
/// whose eight tables of 2,000 slots a budget of 0 ms cannot read, holding
/// nothing of the job's: it is read again alone, still not read whole,
/// and so the Epilog does not hand the GPU on: not clean, the drain reason
/// and the survivors name its pid and "not read", a `scan_over_budget`
/// line lists it under `not_read`, and the next job's Prolog fails
/// (`NodeError::NotRead`); it is never killed (it may be another user's
/// job). The re-read itself, given time ([`settle_over_budget`] of
/// the pids the real scan did not read): the one holding nothing is read
/// whole and clears (no drain); one holding the job's device in its last
/// slot is a holder (the usual rules apply); past its deadline, both are
/// not read.
#[test]
fn past_the_budget_another_users_process_is_read_again_or_drains() {
    if !privileged() {
        return;
    }
    let _serial = responses();
    let mut env = TestEnv::new("budget-other");
    let real = HoldableDevice::claim();
    let dev = DevNum::new(real.major, real.minor);
    let node = node_with_budget(&env, real.major, 0);
    fence_ops::install(&node).unwrap();
    let gpu = env.mknod("gpu", real.major, real.minor);
    std::fs::set_permissions(
        env.tmp.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let user = gpufence_tests::cluster::test_uid();
    let idle = tables_of_another_uid(&mut env, std::path::Path::new("/dev/null"));
    // Beside it, a holder the Epilog ends (the job's user outside every
    // job, unread): the Epilog looks again after each round, and reads
    // `idle` again only once.
    let mut cmd = gpufence_tests::as_test_user(gpufence_tests::probe_bin());
    cmd.args(["tables", gpu.to_str().unwrap(), "8", "2000"]);
    let ended = env.spawn_ready(cmd, "held");
    let devs: BTreeSet<DevNum> = [dev].into();

    node.state
        .write_record(&gpufence_tests::job_record(54, user, Some((dev, &gpu))))
        .unwrap();
    let o = epilog::run(&node, 54, None);
    assert!(!o.clean(), "not read whole: not handed on: {o:?}");
    assert!(!gone(idle), "never killed");
    assert!(
        o.lingering.iter().any(|l| l.pid == ended && l.gone()) && gone(ended),
        "{o:?}"
    );
    assert!(!o.lingering.iter().any(|l| l.pid == idle), "{o:?}");
    let line = o
        .survivors
        .iter()
        .map(ToString::to_string)
        .find(|s| s.starts_with(&format!("pid {idle} (uid 23456, cgroup /")))
        .unwrap_or_else(|| panic!("{idle} not named: {:?}", o.survivors));
    assert!(
        line.ends_with("not read within scan_budget_ms (0 ms); GPU not handed on"),
        "{line}"
    );
    let reason = o.drain_reason.clone().unwrap_or_default();
    assert!(
        reason.starts_with("gpufence: job 54: pid ") && reason.contains("not read"),
        "{reason}"
    );
    let audit = gpufence_tests::audit_log(&env.path("log/audit.jsonl"));
    assert!(
        audit.iter().any(|e| e["event"] == "scan_over_budget"
            && e["job_id"] == 54
            && e["not_read"]
                .as_array()
                .is_some_and(|a| a.iter().any(|p| *p == idle))),
        "{audit:?}"
    );
    assert!(audit.iter().any(|e| e["event"] == "error"
        && e["drain_reason"]
            .as_str()
            .is_some_and(|r| r.contains("not read"))));
    let reread = audit
        .iter()
        .filter(|e| {
            e["event"] == "scan_over_budget"
                && e["job_id"] == 54
                && e["pids"]
                    .as_array()
                    .is_some_and(|a| a.iter().any(|p| *p == idle))
        })
        .count();
    assert_eq!(reread, 1, "read again once per Epilog: {audit:?}");
    // The next job's Prolog does not start it on the GPU either.
    let fence = Fence::open(&env.bpffs).unwrap();
    let mut next = gpufence_tests::job_record(55, user, Some((dev, &gpu)));
    match gpufence_node::job::prolog::clean_start(&node, &fence, &mut next) {
        Err(e @ gpufence_node::NodeError::NotRead { .. }) => {
            let e = e.to_string();
            assert!(
                e.starts_with("job 55: ") && e.contains(&format!("pid {idle} (uid 23456, ")),
                "{e}"
            );
            assert!(e.contains("not read within scan_budget_ms (0 ms)"), "{e}");
        }
        other => panic!("the Prolog let job 55 start: {other:?}"),
    }
    assert!(!gone(idle), "never killed");

    // The re-read, given time.
    let holding = tables_of_another_uid(&mut env, &gpu);
    let mut scan = Scanner::with_pins(&env.bpffs).with_budget(std::time::Duration::ZERO);
    scan.holders(&devs);
    for p in [idle, holding] {
        assert!(scan.over_budget().contains(&p), "{p} read whole at 0 ms");
    }
    let settle = |deadline| {
        gpufence_node::response::respond::settle_over_budget(
            &node,
            54,
            Some(user),
            None,
            &devs,
            &[idle, holding],
            gpufence_node::response::respond::Settle {
                scan: gpufence_node::response::respond::ScanTime::Full,
                deadline,
            },
        )
    };
    let (cands, not_read) = settle(std::time::Instant::now() + std::time::Duration::from_secs(60));
    assert!(not_read.is_empty(), "read whole: {not_read:?}");
    assert_eq!(
        cands.iter().map(|c| c.pid).collect::<Vec<_>>(),
        vec![holding],
        "{cands:?}"
    );
    assert_eq!(cands[0].devices, devs);
    assert!(cands[0].fds.iter().all(|f| !f.unread && f.dev == dev));
    let (cands, not_read) = settle(std::time::Instant::now());
    assert!(cands.is_empty(), "{cands:?}");
    let mut unread: Vec<i32> = not_read.iter().map(|n| n.pid).collect();
    unread.sort();
    let mut want = vec![idle, holding];
    want.sort();
    assert_eq!(unread, want);
    for p in [idle, holding] {
        // SAFETY: kill(2) of our own children, made above.
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
    let t0 = std::time::Instant::now();
    while !(gone(idle) && gone(holding)) {
        assert!(
            t0.elapsed().as_secs() < 10,
            "the test's holders did not end"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    drop(real);
}

/// What the tests' scans look for: `devs` on major 195, no fence (only
/// exemptions cover), no NVML, no MIG.
fn sought(devs: &BTreeSet<DevNum>) -> gpufence_node::response::respond::Sought<'_> {
    gpufence_node::response::respond::Sought {
        fence: None,
        devs,
        gpu_info: &[],
        gpu_major: 195,
        mig: &[],
    }
}
