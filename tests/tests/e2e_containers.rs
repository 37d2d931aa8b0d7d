//! Containers in jobs, on a real cgroup/v2 node of every tested Slurm
//! release (the host's 22.05, Debian trixie's 24.11 and sid's 26.05 in
//! roots entered through `contrib/v2node/chroot.sh`), with gpufence's
//! default configuration (`gpufence_tests::v2node`).
//!
//! The fence's rule is the job's cgroup: a container that stays in the
//! job's cgroup (or one below it) opens the job's GPUs only; one that a
//! runtime puts elsewhere gets none. Each test runs, as the job's user:
//!
//! - a user/pid/mount/cgroup-namespace container (`unshare --user
//!   --map-root-user --pid --fork --mount-proc --cgroup`) in a
//!   `--gres=gpu:sim:1` step, and the same container outside every job (in
//!   a cgroup of the fenced slice);
//! - rootless Podman with crun on a directory rootfs (no image, no
//!   network), with `--cgroups=disabled` (stays in the job) and with its
//!   default cgroup handling;
//! - Apptainer on the same directory as a sandbox, where the root ships it
//!   (sid), plain and with `--apply-cgroups`.
//!
//! GPUs are `mknod` stand-ins (open gives ENXIO when the device cgroup
//! allowed it, EPERM when it denied it) in a directory of the test's own
//! under `/dev`, removed afterwards: Apptainer mounts every other host path
//! it binds (`/tmp`, the sandbox itself) `nodev`, where any device node
//! gives EACCES whatever the cgroup says, and binds `/dev` as it is
//! (`mount dev = yes` in apptainer.conf).
//!
//! Each test prints what every runtime did (exit status, the cgroup the
//! container ran in, what it opened), so the per-release behaviour of the
//! runtimes' own cgroup handling is in the test log.

use std::ffi::CString;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Output;

use gpufence_tests::cluster::{test_uid, Cluster, ClusterSpec};
use gpufence_tests::out::{both, field, stdout, verdict};
use gpufence_tests::v2node::{Release, V2Slice};
use gpufence_tests::{privileged, workspace_bin, TestEnv};

/// A cgroup of the test's own under the fenced slice, where a user's
/// process outside every job runs (as in `tests/e2e_v2node.rs`).
const OUTSIDE: &str = "system.slice/gpufence-test-outside.service";

/// The stand-in GPUs, in `/dev/gpufence-test.<pid>.<tag>` (see the module
/// comment for why under `/dev`); the directory goes on drop.
struct Gpus {
    dir: PathBuf,
    /// GRES index 0: `nvidia3`, c 195:3.
    n3: PathBuf,
    /// GRES index 1: `nvidia1`, c 195:1.
    n1: PathBuf,
}

impl Gpus {
    fn make(tag: &str) -> Gpus {
        let dir = PathBuf::from(format!("/dev/gpufence-test.{}.{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).expect("mkdir under /dev");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let node = |name: &str, minor: u32| {
            let p = dir.join(name);
            let c = CString::new(p.to_str().unwrap()).unwrap();
            // SAFETY: mknod(2) with a NUL-terminated path.
            let r = unsafe {
                libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(195, minor))
            };
            assert_eq!(
                r,
                0,
                "mknod {}: {}",
                p.display(),
                std::io::Error::last_os_error()
            );
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o666)).unwrap();
            p
        };
        let n3 = node("nvidia3", 3);
        let n1 = node("nvidia1", 1);
        Gpus { dir, n3, n1 }
    }

    fn gres_conf(&self) -> String {
        format!(
            "Name=gpu Type=sim File={}\nName=gpu Type=sim File={}\n",
            self.n3.display(),
            self.n1.display()
        )
    }

    /// (the job's GPU, the other one) for GRES index `index`.
    fn mine(&self, index: usize) -> (&Path, &Path) {
        if index == 0 {
            (&self.n3, &self.n1)
        } else {
            (&self.n1, &self.n3)
        }
    }
}

impl Drop for Gpus {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The test user's container kit in the jobs directory (shared with the
/// roots, through `/tmp`): a directory rootfs holding the probe, `sh` and
/// `cat` with the libraries they load (this host's, so it runs the same in
/// every release), and `ctr.sh MODE`, the job's command. Owned by the test
/// user: rootless Podman writes `/etc/mtab` and the like into its rootfs,
/// and gets its HOME, XDG_RUNTIME_DIR and storage here.
struct Kit {
    dir: PathBuf,
}

const CTR_SH: &str = r#"#!/bin/sh
# ctr.sh MODE: one container run in a job step (or outside any job), as the
# test user. Prints GPUS= (the step's GPU indices), JOBCG= (the cgroup the
# step's task is in), then the runtime's own output, CTR_CG= lines (the
# cgroup the container's process is in, as /proc/self/cgroup shows it) and
# the probe's "PATH ENXIO|EPERM|..." lines, then RC= (the runtime's exit
# status).
kit=$(cd "$(dirname "$0")" && pwd)
mode=$1
shift
export HOME="$kit/home" XDG_CONFIG_HOME="$kit/home/.config" XDG_DATA_HOME="$kit/home/.local/share"
# One runtime directory per run: rootless Podman leaves a pause process
# (its user namespace) there, which Slurm kills with the step.
export XDG_RUNTIME_DIR="$kit/run.$mode.$$"
mkdir -m 0700 "$XDG_RUNTIME_DIR"
gpus=${SLURM_STEP_GPUS:-$SLURM_JOB_GPUS}
echo "GPUS=$gpus"
# Podman gets the step's GPU with --device, as a user passes it, and the
# directory of both with -v, so the other GPU's node is in the container
# too and only the fence denies it. (Podman 5 checks each --device with
# faccessat before it starts, and refuses the other GPU there: the fence
# denies access(2) as well, devcgroup_inode_permission from
# inode_permission, fs/namei.c.) The arguments are in GRES order.
case $gpus in 0) mine=$1 ;; 1) mine=$2 ;; *) mine=$1 ;; esac
devdir=$(dirname "$1")
echo "JOBCG=$(grep '^0::' /proc/self/cgroup | cut -c4-)"
# In the container (its rootfs has sh and no sed): its cgroup, then the probe.
inner='while read -r l; do case $l in 0::*) echo "CTR_CG=${l#0::}" ;; esac; done </proc/self/cgroup'
inner="$inner; /bin/gpufence-probe open $*"
case $mode in
unshare)
    # The release's tools, no rootfs: the namespaces are the container
    # (its cgroup namespace shows "/": it runs in the task's cgroup, JOBCG).
    unshare --user --map-root-user --pid --fork --mount-proc --cgroup \
        "$kit/rootfs/bin/gpufence-probe" open "$@"
    ;;
podman-disabled)
    podman --runtime crun run --rm --network=none --cgroups=disabled --cgroupns=host \
        --device "$mine" -v "$devdir:$devdir" \
        --rootfs "$kit/rootfs" /bin/sh -c "$inner"
    ;;
podman-default)
    podman --runtime crun run --rm --network=none --cgroupns=host \
        --device "$mine" -v "$devdir:$devdir" \
        --rootfs "$kit/rootfs" /bin/sh -c "$inner"
    ;;
apptainer)
    apptainer --quiet exec "$kit/rootfs" /bin/sh -c "$inner"
    ;;
apptainer-cgroups)
    apptainer --quiet exec --apply-cgroups "$kit/limits.toml" "$kit/rootfs" /bin/sh -c "$inner"
    ;;
*)
    echo "ctr.sh: unknown mode $mode" >&2
    exit 2
    ;;
esac
echo "RC=$?"
"#;

impl Kit {
    fn make(env: &TestEnv) -> Kit {
        let dir = env.path("jobs/ctr");
        let rootfs = dir.join("rootfs");
        for d in ["bin", "dev", "proc", "sys", "tmp", "etc", "home"] {
            std::fs::create_dir_all(rootfs.join(d)).unwrap();
        }
        std::fs::create_dir_all(dir.join("home")).unwrap();
        let bins = [
            (workspace_bin("gpufence-probe"), "bin/gpufence-probe"),
            (PathBuf::from("/bin/sh"), "bin/sh"),
            (PathBuf::from("/bin/cat"), "bin/cat"),
        ];
        for (from, to) in &bins {
            gpufence_tests::cluster::copy_exec(from, &rootfs.join(to));
            for lib in libraries(from) {
                let to = rootfs.join(lib.strip_prefix("/").unwrap());
                std::fs::create_dir_all(to.parent().unwrap()).unwrap();
                if !to.exists() {
                    std::fs::copy(&lib, &to)
                        .unwrap_or_else(|e| panic!("copy {}: {e}", lib.display()));
                }
            }
        }
        // An OCI LinuxResources table (Apptainer's --apply-cgroups format,
        // `apptainer help exec`): any limit makes it set up a cgroup.
        std::fs::write(dir.join("limits.toml"), "[pids]\nlimit = 1024\n").unwrap();
        let script = dir.join("ctr.sh");
        std::fs::write(&script, CTR_SH).unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let o = std::process::Command::new("chown")
            .arg("-R")
            .arg(format!("{}:{}", test_uid(), test_uid()))
            .arg(&dir)
            .output()
            .unwrap();
        assert!(o.status.success(), "chown: {}", both(&o));
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        Kit { dir }
    }

    fn script(&self) -> String {
        self.dir.join("ctr.sh").display().to_string()
    }
}

/// The libraries `exe` loads, as `ldd` lists them (absolute paths).
fn libraries(exe: &Path) -> Vec<PathBuf> {
    let o = std::process::Command::new("ldd").arg(exe).output().unwrap();
    stdout(&o)
        .lines()
        .filter_map(|l| {
            l.split_whitespace()
                .find(|w| w.starts_with('/'))
                .map(PathBuf::from)
        })
        .collect()
}

/// What one container run showed.
struct Run {
    out: String,
    /// The step's task cgroup (JOBCG=), empty outside a job.
    task_cg: String,
    /// The container's cgroup (CTR_CG=), `None` when it never ran.
    ctr_cg: Option<String>,
    /// The runtime's exit status (RC=).
    rc: Option<i32>,
    index: Option<usize>,
}

impl Run {
    fn of(o: &Output) -> Run {
        let out = both(o);
        Run {
            task_cg: field(&out, "JOBCG").unwrap_or_default(),
            ctr_cg: field(&out, "CTR_CG"),
            rc: field(&out, "RC").and_then(|v| v.parse().ok()),
            index: field(&out, "GPUS").and_then(|v| v.trim().parse().ok()),
            out,
        }
    }

    /// The job's cgroup: the task's, up to its `step_*` level
    /// (`<scope>/job_<id>/step_<n>/user/task_<n>` in 22.05-24.11, a SLUID
    /// in place of `job_<id>` in 26.05: src/plugins/cgroup/v2/cgroup_v2.c).
    fn job_cg(&self) -> String {
        match self.task_cg.find("/step_") {
            Some(i) => self.task_cg[..i].to_string(),
            None => self.task_cg.clone(),
        }
    }

    /// Whether the container ran in the job's cgroup or below it.
    fn in_job(&self) -> bool {
        let job = self.job_cg();
        !job.is_empty()
            && self.ctr_cg.as_ref().is_some_and(|c| {
                let c = c.split_whitespace().next().unwrap_or("");
                c == job || c.starts_with(&format!("{job}/"))
            })
    }

    fn summary(&self, mine: &Path, other: &Path) -> String {
        format!(
            "rc={:?} container cgroup={:?} (job {:?}) mine={} other={}",
            self.rc,
            self.ctr_cg,
            self.job_cg(),
            verdict(&self.out, mine),
            verdict(&self.out, other)
        )
    }
}

/// The runtime's warnings and errors in `out`, on one line.
fn said(out: &str) -> String {
    out.lines()
        .filter(|l| {
            [
                "level=warning",
                "level=error",
                "Error",
                "WARNING",
                "FATAL",
                "ERROR",
            ]
            .iter()
            .any(|w| l.contains(w))
        })
        .collect::<Vec<_>>()
        .join(" | ")
}

fn spec(release: &Release, slice: &V2Slice, g: &Gpus) -> ClusterSpec {
    ClusterSpec {
        root: release.root.clone(),
        plugin: release.plugin.clone(),
        gres_conf: g.gres_conf(),
        node_gres: "gpu:sim:2".into(),
        port_base: std::env::var("GPUFENCE_CONTAINERS_PORT_BASE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(17977),
        v2node: Some(slice.spec("Alloc,Contain")),
        ..ClusterSpec::default()
    }
}

fn containers(release: &Release, tag: &str) {
    let t0 = std::time::Instant::now();
    let env = TestEnv::new(tag);
    let g = Gpus::make(tag);
    let slice = V2Slice::claim();
    let kit = Kit::make(&env);
    let cluster = Cluster::start_with(&env, &spec(release, &slice, &g));
    env.cg.create(OUTSIDE).unwrap();
    let gpus = [g.n3.display().to_string(), g.n1.display().to_string()];
    let mut report = vec![format!("containers on {}:", release.name())];

    // In a job step: (the run, the job's GPU, the other GPU).
    let in_job = |mode: &str| {
        let script = kit.script();
        let o = cluster.as_user(
            "srun",
            &["--gres=gpu:sim:1", "sh", &script, mode, &gpus[0], &gpus[1]],
        );
        let r = Run::of(&o);
        let index = r.index.unwrap_or_else(|| {
            panic!(
                "{mode}: one GPU index in the step's output:\n{}\n{}",
                r.out,
                cluster.log_tail("slurmd.log")
            )
        });
        let (mine, other) = g.mine(index);
        (r, mine.to_path_buf(), other.to_path_buf())
    };

    // --- namespaces alone: unshare --user --pid --mount --cgroup -----------
    let (r, mine, other) = in_job("unshare");
    report.push(format!("  unshare in a job: {}", r.summary(&mine, &other)));
    assert_eq!(r.rc, Some(0), "unshare in a job:\n{}", r.out);
    assert_eq!(
        (verdict(&r.out, &mine), verdict(&r.out, &other)),
        ("ENXIO".into(), "EPERM".into()),
        "a namespaced container in a job opens its GPU only:\n{}",
        r.out
    );
    // The same container as the same user outside every job: nothing.
    let o = env
        .user_command_in(OUTSIDE, "sh")
        .arg(kit.script())
        .arg("unshare")
        .args(&gpus)
        .output()
        .unwrap();
    let r = Run::of(&o);
    report.push(format!(
        "  unshare outside jobs: {}",
        r.summary(&g.n3, &g.n1)
    ));
    assert_eq!(r.rc, Some(0), "unshare outside jobs:\n{}", r.out);
    assert_eq!(
        (verdict(&r.out, &g.n3), verdict(&r.out, &g.n1)),
        ("EPERM".into(), "EPERM".into()),
        "a namespaced container outside every job opens no GPU:\n{}",
        r.out
    );

    // --- rootless Podman with crun -------------------------------------
    let (r, mine, other) = in_job("podman-disabled");
    report.push(format!(
        "  podman --cgroups=disabled in a job: {}",
        r.summary(&mine, &other)
    ));
    assert_eq!(r.rc, Some(0), "podman --cgroups=disabled:\n{}", r.out);
    assert!(
        r.in_job(),
        "podman --cgroups=disabled left the job's cgroup:\n{}",
        r.out
    );
    assert_eq!(
        (verdict(&r.out, &mine), verdict(&r.out, &other)),
        ("ENXIO".into(), "EPERM".into()),
        "podman --cgroups=disabled in a job opens its GPU only (both nodes in the container):\n{}",
        r.out
    );
    // Podman's default: a cgroup of its own where it can make one (through
    // systemd; rootless cgroupfs cannot write outside the user's cgroups,
    // and crun then runs the container where it is, "cannot configure
    // rootless cgroup using the cgroupfs manager", libcrun/cgroup.c). Never
    // the other GPU; its own only from within the job.
    let (r, mine, other) = in_job("podman-default");
    report.push(format!(
        "  podman (default cgroups) in a job: {}",
        r.summary(&mine, &other)
    ));
    assert_ne!(
        verdict(&r.out, &other),
        "ENXIO",
        "podman's default cgroups opened another job's GPU:\n{}",
        r.out
    );
    report.push(format!("    podman said: {}", said(&r.out)));
    if r.in_job() {
        assert_eq!(
            verdict(&r.out, &mine),
            "ENXIO",
            "podman (default) stayed in the job's cgroup:\n{}",
            r.out
        );
    } else {
        assert_ne!(
            verdict(&r.out, &mine),
            "ENXIO",
            "podman (default) outside the job's cgroup opened a GPU:\n{}",
            r.out
        );
    }

    // --- the line for the user -----------------------------------------
    // A task that runs `podman run` itself (as `srun podman run ...` does)
    // without --cgroups=disabled is told, on its stderr, where a GPU would
    // go missing and what to add; with the flag it is told nothing. The
    // run itself may fail (no image, no HOME here): the line comes from
    // the plugin's task_init, before podman is executed.
    let hint = "gpufence: podman may run this container in a cgroup of its own";
    for (args, want) in [
        (
            &["run", "--rm", "--rootfs", "/nonexistent", "true"][..],
            true,
        ),
        (
            &[
                "run",
                "--rm",
                "--cgroups=disabled",
                "--rootfs",
                "/nonexistent",
                "true",
            ][..],
            false,
        ),
    ] {
        let o = cluster.as_user(
            "srun",
            &[&["--gres=gpu:sim:1", "podman"][..], args].concat(),
        );
        assert_eq!(
            String::from_utf8_lossy(&o.stderr).contains(hint),
            want,
            "srun podman {args:?}: the hint {}expected:\n{}",
            if want { "" } else { "not " },
            both(&o)
        );
    }
    report.push("  the podman hint: shown without --cgroups=disabled, not with it".into());

    // --- Apptainer, where the release ships it -------------------------
    if release.file("/usr/bin/apptainer").exists() {
        let (r, mine, other) = in_job("apptainer");
        report.push(format!(
            "  apptainer in a job: {}",
            r.summary(&mine, &other)
        ));
        assert_eq!(r.rc, Some(0), "apptainer exec:\n{}", r.out);
        assert!(
            r.in_job(),
            "apptainer exec left the job's cgroup:\n{}",
            r.out
        );
        assert_eq!(
            (verdict(&r.out, &mine), verdict(&r.out, &other)),
            ("ENXIO".into(), "EPERM".into()),
            "apptainer exec in a job opens its GPU only (host /dev bound in):\n{}",
            r.out
        );
        let (r, mine, other) = in_job("apptainer-cgroups");
        report.push(format!(
            "  apptainer --apply-cgroups in a job: {}",
            r.summary(&mine, &other)
        ));
        assert_ne!(
            verdict(&r.out, &other),
            "ENXIO",
            "apptainer --apply-cgroups opened another job's GPU:\n{}",
            r.out
        );
        if r.in_job() {
            assert_eq!(verdict(&r.out, &mine), "ENXIO", "{}", r.out);
        } else {
            assert_ne!(
                verdict(&r.out, &mine),
                "ENXIO",
                "apptainer --apply-cgroups outside the job's cgroup opened a GPU:\n{}",
                r.out
            );
        }
        report.push(format!("    apptainer said: {}", said(&r.out)));
    } else {
        report.push("  apptainer: not in this release's root".into());
    }
    report.push(format!("  ({:.1} s)", t0.elapsed().as_secs_f64()));
    eprintln!("{}", report.join("\n"));
    drop(cluster);
}

#[test]
fn containers_in_jobs_22_05_host() {
    if !privileged() {
        return;
    }
    containers(&Release::host(), "ctr-host");
}

#[test]
fn containers_in_jobs_24_11_debian_trixie() {
    if !privileged() {
        return;
    }
    if let Some(r) = Release::debian_having("trixie", Some("/usr/bin/podman")) {
        containers(&r, "ctr-trixie");
    }
}

#[test]
fn containers_in_jobs_26_05_debian_sid() {
    if !privileged() {
        return;
    }
    if let Some(r) = Release::debian_having("sid", Some("/usr/bin/podman")) {
        containers(&r, "ctr-sid");
    }
}
