//! open() cost inside the kernel's device check: one process opening and
//! closing a device node in a loop, under
//!
//! - no device program (the floor);
//! - an empty device program (`return 1`): the kernel's cost of running any
//!   device program, which no program can go below;
//! - a Slurm-style program: a straight-line allow-list of 8 or 64 devices,
//!   default allow (the shape of Slurm's `src/plugins/cgroup/v2/ebpf.c`,
//!   `add_device_ebpf_prog`: per device `if type != c goto next; if major !=
//!   M goto next; if minor != m goto next; return verdict;`), the devices
//!   looked up placed last (its worst case);
//! - the gpufence fence with 1, 1,000 and 100,000 grants in the map (8
//!   devices per job cgroup, the job cgroups at level 3 like Slurm's
//!   `system.slice/slurmstepd.scope/job_<id>`, one exempt cgroup at level 2
//!   like `system.slice/slurmd.service`);
//!
//! for three devices (`/dev/null`, unprotected; a protected node the task is
//! granted, ENXIO; one it is not, EPERM) and tasks at cgroup depth 3, 8, 16.
//! Configurations alternate within each round; the result is the median
//! over rounds of ns per open.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::fd::{AsFd, OwnedFd};
use std::time::Instant;

use gpufence_cgroup::asm::{AluOp, Asm, JmpOp, Reg, Size};
use gpufence_cgroup::fence::{Fence, FenceSpec};
use gpufence_cgroup::{sys, Cgroup2};
use gpufence_model::device::{Access, DevNum};
use gpufence_model::procdevices::ProtectedMajors;

/// A configuration of what is attached at the bench root.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Config {
    /// Nothing.
    Floor,
    /// A device program that allows everything at once (`return 1`): what
    /// running any device program costs, the kernel's part.
    Empty,
    /// Slurm-style allow-list of N devices.
    Slurm(usize),
    /// gpufence with N grants.
    Fence(usize),
}

impl std::fmt::Display for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Config::Floor => write!(f, "no program (floor)"),
            Config::Empty => write!(f, "empty program (return 1)"),
            Config::Slurm(n) => write!(f, "Slurm-style, {n} devices"),
            Config::Fence(n) => write!(f, "gpufence, {n} grants"),
        }
    }
}

/// The device opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Target {
    /// `/dev/null`.
    Null,
    /// A protected node the task is granted (ENXIO).
    Granted,
    /// A protected node it is not (EPERM under the fence).
    Denied,
}

/// Result cell key.
pub type Cell = (Config, usize, Target);

/// The Slurm-style program: `n` device blocks, the granted device
/// (195:0, allow) and the denied one (195:1, deny) last, default allow.
fn slurm_program(n: usize) -> Vec<gpufence_cgroup::asm::RawInsn> {
    use Reg::*;
    let mut a = Asm::new();
    a.load(Size::W, R2, R1, 0)
        .alu32_imm(AluOp::And, R2, 0xffff)
        .load(Size::W, R3, R1, 0)
        .alu32_imm(AluOp::Rsh, R3, 16)
        .load(Size::W, R4, R1, 4)
        .load(Size::W, R5, R1, 8);
    for i in 0..n {
        let (minor, accept) = match n - i {
            2 => (0, 1),
            1 => (1, 0),
            _ => (100 + i as i32, 1),
        };
        let next = format!("next_{i}");
        a.jmp_imm(JmpOp::Ne, R2, 2, &next)
            .jmp_imm(JmpOp::Ne, R4, 195, &next)
            .jmp_imm(JmpOp::Ne, R5, minor, &next)
            .mov64_imm(R0, accept)
            .exit()
            .label(&next);
    }
    a.mov64_imm(R0, 1).exit();
    a.assemble().expect("slurm-style program").insns
}

/// What the bench built; removed on drop.
pub struct World {
    cg: Cgroup2,
    root: String,
    chain: Vec<String>,
    bpffs: std::path::PathBuf,
    _tmp: tempfile::TempDir,
    granted: std::path::PathBuf,
    denied: std::path::PathBuf,
}

impl World {
    /// Creates the bench's cgroup chain (16 levels below the cgroup2 root)
    /// and device nodes.
    pub fn new() -> World {
        let cg = Cgroup2::discover().expect("cgroup2");
        let root = format!("gpufence-bench-{}", std::process::id());
        let mut chain = vec![root.clone()];
        for l in 2..=16 {
            chain.push(format!("{}/l{l}", chain.last().unwrap()));
        }
        cg.create(chain.last().unwrap())
            .expect("create cgroup chain");
        cg.create(&format!("{root}/exempt"))
            .expect("create exempt cgroup");
        let tmp = tempfile::tempdir().expect("tempdir");
        let mk = |name: &str, minor: u32| {
            let p = tmp.path().join(name);
            let c = CString::new(p.to_str().unwrap()).unwrap();
            // SAFETY: mknod(2) with a NUL-terminated path.
            let made = unsafe {
                libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(195, minor))
            };
            assert_eq!(made, 0, "mknod");
            p
        };
        World {
            bpffs: std::path::PathBuf::from("/sys/fs/bpf").join(&root),
            granted: mk("granted", 0),
            denied: mk("denied", 1),
            _tmp: tmp,
            cg,
            root,
            chain,
        }
    }

    fn path(&self, t: Target) -> &std::path::Path {
        match t {
            Target::Null => std::path::Path::new("/dev/null"),
            Target::Granted => &self.granted,
            Target::Denied => &self.denied,
        }
    }

    /// Sets up `c`; returns what must stay alive while it is measured.
    fn setup(&self, c: Config) -> Option<OwnedFd> {
        match c {
            Config::Floor => None,
            Config::Empty | Config::Slurm(_) => {
                let insns = match c {
                    Config::Slurm(n) => slurm_program(n),
                    _ => {
                        let mut a = Asm::new();
                        a.mov64_imm(Reg::R0, 1).exit();
                        a.assemble().expect("empty program").insns
                    }
                };
                let prog =
                    sys::prog_load_cgroup_device(&insns, "bench_compare").expect("load program");
                let dir = std::fs::File::open(self.cg.path(&self.root)).unwrap();
                sys::prog_attach_cgroup_device(prog.as_fd(), dir.as_fd(), sys::F_ALLOW_MULTI)
                    .expect("attach");
                Some(prog)
            }
            Config::Fence(n) => {
                let spec = FenceSpec {
                    cgroup_root: self.root.clone(),
                    bpffs_dir: self.bpffs.clone(),
                    protected: ProtectedMajors::from_table(&[("nvidia".to_string(), 195)].into()),
                    exempt: vec![gpufence_cgroup::fence::ExemptCgroup::root(format!(
                        "{}/exempt",
                        self.root
                    ))],
                    max_grants: (n as u32 + 16).max(1024),
                    max_denials: 4096,
                    audit: false,
                    identities: Default::default(),
                };
                let (fence, _) = Fence::install(&self.cg, &spec).expect("install fence");
                // The job cgroup at level 3, like Slurm's job_<id>.
                let job = &self.chain[2];
                fence
                    .grant(
                        self.cg.id(job).unwrap(),
                        job,
                        1,
                        &[(DevNum::new(195, 0), Access::RW)],
                    )
                    .expect("grant");
                // Filler grants of other (absent) job cgroups at level 3.
                fill_grants(&self.bpffs, n.saturating_sub(1), 3);
                None
            }
        }
    }

    fn teardown(&self, c: Config, keep: Option<OwnedFd>) {
        match c {
            Config::Floor => {}
            Config::Empty | Config::Slurm(_) => {
                if let Some(prog) = keep {
                    let dir = std::fs::File::open(self.cg.path(&self.root)).unwrap();
                    sys::prog_detach_cgroup_device(prog.as_fd(), dir.as_fd()).expect("detach");
                }
            }
            Config::Fence(_) => {
                Fence::remove(&self.bpffs).expect("remove fence");
            }
        }
    }

    /// ns per open of `t` by a task at `depth`, `iters` opens.
    fn measure(&self, depth: usize, t: Target, iters: u32) -> f64 {
        let procs = CString::new(
            self.cg
                .path(&self.chain[depth - 1])
                .join("cgroup.procs")
                .to_str()
                .unwrap(),
        )
        .unwrap();
        let path = CString::new(self.path(t).to_str().unwrap()).unwrap();
        let mut fds = [0i32; 2];
        // SAFETY: pipe(2) into a local array.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: the child only makes syscalls and exits with _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: in the forked child: raw syscalls on NUL-terminated
            // paths and buffers we own, then _exit.
            unsafe {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY);
                if fd < 0 || libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                    libc::_exit(2);
                }
                libc::close(fd);
                // warm up
                for _ in 0..1000 {
                    let f = libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
                    if f >= 0 {
                        libc::close(f);
                    }
                }
                let mut a = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                };
                let mut b = a;
                libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut a);
                for _ in 0..iters {
                    let f = libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
                    if f >= 0 {
                        libc::close(f);
                    }
                }
                libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut b);
                let ns: u64 =
                    (b.tv_sec - a.tv_sec) as u64 * 1_000_000_000 + (b.tv_nsec - a.tv_nsec) as u64;
                libc::write(fds[1], (&ns as *const u64).cast(), 8);
                libc::_exit(0);
            }
        }
        let mut ns = 0u64;
        // SAFETY: read of 8 bytes into a u64, waitpid of our child.
        unsafe {
            libc::close(fds[1]);
            libc::read(fds[0], (&mut ns as *mut u64).cast(), 8);
            libc::close(fds[0]);
            let mut st = 0;
            libc::waitpid(pid, &mut st, 0);
        }
        ns as f64 / iters as f64
    }
}

impl Drop for World {
    fn drop(&mut self) {
        let _ = Fence::remove(&self.bpffs);
        let _ = self.cg.remove_tree(&self.root);
    }
}

/// Runs the benchmark: `rounds` rounds, `iters` opens per cell.
pub fn run(configs: &[Config], depths: &[usize], rounds: usize, iters: u32) -> BTreeMap<Cell, f64> {
    let w = World::new();
    let mut samples: BTreeMap<Cell, Vec<f64>> = BTreeMap::new();
    let t0 = Instant::now();
    for r in 0..rounds {
        // Rotate the order each round so that no configuration always
        // runs first (caches, frequency).
        let n = configs.len();
        for k in 0..n {
            let c = configs[(k + r) % n];
            let keep = w.setup(c);
            for &d in depths {
                for t in [Target::Null, Target::Granted, Target::Denied] {
                    samples
                        .entry((c, d, t))
                        .or_default()
                        .push(w.measure(d, t, iters));
                }
            }
            w.teardown(c, keep);
        }
        eprintln!(
            "round {}/{rounds} done ({:.0} s)",
            r + 1,
            t0.elapsed().as_secs_f64()
        );
    }
    samples
        .into_iter()
        .map(|(k, mut v)| {
            v.sort_by(|a, b| a.total_cmp(b));
            (k, v[v.len() / 2])
        })
        .collect()
}

/// Fills the fence's maps in `bpffs` with `n` grants of 8 devices each to
/// cgroups that do not exist (ids from 2^48 up, job id `u32::MAX`), flagged
/// GRANTED at `level` (which a real grant has already set in the `levels`
/// mask): what a node with many live grants looks like to the program,
/// written straight into the pinned maps (one bulk write instead of
/// `n / 8` [`Fence::grant`] calls, which check each cgroup's path).
fn fill_grants(bpffs: &std::path::Path, n: usize, level: u32) {
    use gpufence_cgroup::maps::{
        CgroupValue, CgroupsMap, GrantKey, GrantValue, GrantsMap, CGROUP_GRANTED,
    };
    let grants = Fence::open_map::<GrantsMap>(bpffs).expect("open grants");
    let cgroups = Fence::open_map::<CgroupsMap>(bpffs).expect("open cgroups");
    for i in 0..n as u64 {
        let cgroup_id = (1u64 << 48) + i / 8;
        let key = GrantKey::new(cgroup_id, DevNum::new(195, (i % 8) as u32));
        grants
            .update(&key, &GrantValue::new(Access::RW, u32::MAX))
            .expect("fill grants");
        if i % 8 == 0 {
            let flags = CgroupValue {
                flags: CGROUP_GRANTED,
                level,
            };
            cgroups.update(&cgroup_id, &flags).expect("fill cgroups");
        }
    }
}
