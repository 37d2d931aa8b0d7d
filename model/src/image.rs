//! Container images a job step names: pinned by digest or only by tag,
//! and from which registry. Pure: the node layer
//! (`gpufence_node::job::door`) hands it the step's argv and the Pyxis
//! option variable.
//!
//! A hint, not a control: a script can pull images itself, through any
//! tool; only the forms below are seen.
//!
//! - Pyxis's `--container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH`
//!   (Pyxis README) reaches slurmstepd as [`PYXIS_IMAGE_ENV`] in the
//!   step's environment;
//! - a task whose argv is `podman run|create|pull ... IMAGE`,
//!   `apptainer|singularity exec|run|shell|pull ... docker://IMAGE` (or
//!   `oras://`, `library://`) or `enroot import ... docker://IMAGE`.
//!
//! A digest is `@sha256:` and 64 hex digits (or `@sha512:` and 128), the
//! OCI image spec's form (`descriptor.md`, "Digests"). Local files (a
//! path, a `.sif`, a `.sqsh`) are not images of a registry and never
//! reported.

/// The variable a SPANK option of another plugin travels in:
/// `_SLURM_SPANK_OPTION_` (`SPANK_OPTION_ENV_PREFIX`,
/// `src/common/plugstack.h` in 22.05, `src/common/spank.h` in 26.05),
/// then the plugin's name, `_` and the option's name, each character not
/// alphanumeric made `_` (`_opt_env_name` and `_canonical_char`,
/// `src/common/plugstack.c` 22.05, `src/common/spank.c` 26.05). Pyxis's
/// plugin is `pyxis` (`SPANK_PLUGIN(pyxis, 1)`) and its option
/// `container-image`. sbatch and srun put it in the job's or step's
/// environment (`spank_init_post_opt`); slurmstepd reads and clears it
/// only after every plugin's `slurm_spank_init` (`spank_stack_post_opt`
/// runs after `_spank_init`), where gpufence reads it.
pub const PYXIS_IMAGE_ENV: &str = "_SLURM_SPANK_OPTION_pyxis_container_image";

/// The registry an image without one comes from (Docker's and enroot's
/// default: Docker Hub).
pub const DEFAULT_REGISTRY: &str = "docker.io";

/// One image a step names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageRef {
    /// As written (printable, at most 200 characters), for the user's
    /// line.
    pub text: String,
    /// The registry host (`nvcr.io`, `ghcr.io`, `localhost:5000`), or
    /// [`DEFAULT_REGISTRY`].
    pub registry: String,
    /// Whether it names a digest.
    pub pinned: bool,
    /// Where it was named: `--container-image` or the runtime (`podman`).
    pub source: &'static str,
}

/// What is wrong with an image ([`judge`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ImageIssue {
    /// Named by tag (or nothing, `latest`), not by digest.
    Unpinned(ImageRef),
    /// From a registry outside `container_registries`.
    Registry(ImageRef),
}

fn is_digest(d: &str) -> bool {
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    d.strip_prefix("sha256:").is_some_and(|h| hex(h, 64))
        || d.strip_prefix("sha512:").is_some_and(|h| hex(h, 128))
}

fn is_local(s: &str) -> bool {
    s.starts_with('/')
        || s.starts_with("./")
        || s.starts_with("../")
        || s.starts_with('~')
        || [".sif", ".sqsh", ".squashfs", ".simg", ".img", ".tar"]
            .iter()
            .any(|e| s.ends_with(e))
}

/// Parses an image reference, Docker's form (`[REGISTRY/]NAME[:TAG][@DIGEST]`)
/// or enroot's and Pyxis's (`[USER@][REGISTRY#]NAME[:TAG]`), after an
/// optional `docker://`; `None` for a local file or an empty name.
pub fn parse(s: &str, source: &'static str) -> Option<ImageRef> {
    let bare = s.strip_prefix("docker://").unwrap_or(s);
    if bare.is_empty() || is_local(bare) || bare.contains("://") {
        return None;
    }
    let (name, pinned) = match bare.rsplit_once('@') {
        Some((n, d)) if d.contains(':') && !d.contains('#') && !d.contains('/') => {
            (n, is_digest(d))
        }
        _ => (bare, false),
    };
    let registry = if let Some((reg, _)) = name.split_once('#') {
        // enroot: [USER@]REGISTRY#IMAGE
        reg.rsplit('@').next().unwrap_or(reg).to_string()
    } else {
        let name = name.rsplit_once('@').map_or(name, |(_, n)| n);
        match name.split_once('/') {
            Some((first, _))
                if first.contains('.') || first.contains(':') || first == "localhost" =>
            {
                first.to_string()
            }
            _ => DEFAULT_REGISTRY.to_string(),
        }
    };
    Some(ImageRef {
        text: crate::text::printable(s).chars().take(200).collect(),
        registry: registry.to_ascii_lowercase(),
        pinned,
        source,
    })
}

/// The value of Pyxis's `--container-image` ([`PYXIS_IMAGE_ENV`]).
pub fn from_pyxis(value: &str) -> Option<ImageRef> {
    parse(value.trim(), "--container-image")
}

/// Options of `podman run`/`create` that take a separate value
/// (podman-run(1)); the image is the first word after the subcommand that
/// is neither an option nor such a value.
const PODMAN_VALUED: &[&str] = &[
    "-a",
    "--attach",
    "--annotation",
    "--arch",
    "--authfile",
    "--blkio-weight",
    "--cap-add",
    "--cap-drop",
    "--cgroup-parent",
    "--cgroupns",
    "--cgroups",
    "--cidfile",
    "--cpus",
    "--cpuset-cpus",
    "--device",
    "--dns",
    "-e",
    "--env",
    "--env-file",
    "--entrypoint",
    "--gpus",
    "--group-add",
    "-h",
    "--hostname",
    "--ipc",
    "-l",
    "--label",
    "--log-driver",
    "-m",
    "--memory",
    "--mount",
    "--name",
    "--network",
    "--net",
    "--os",
    "-p",
    "--publish",
    "--pid",
    "--platform",
    "--pull",
    "--security-opt",
    "--shm-size",
    "--stop-signal",
    "--tmpfs",
    "-u",
    "--user",
    "--userns",
    "--ulimit",
    "-v",
    "--volume",
    "--volumes-from",
    "-w",
    "--workdir",
    "--hooks-dir",
    "--uts",
    "--add-host",
    "-c",
    "--cpu-shares",
    "--cert-dir",
    "--creds",
    "--decryption-key",
    "--dns-search",
    "--gidmap",
    "--health-cmd",
    "--ip",
    "--label-file",
    "--log-opt",
    "--memory-swap",
    "--pids-limit",
    "--pod",
    "--restart",
    "--retry",
    "--secret",
    "--stop-timeout",
    "--sysctl",
    "--uidmap",
    "--variant",
];

/// Options of `podman run`/`create`/`pull` that take no value
/// (podman-run(1), podman-pull(1)). An option in neither this list nor
/// [`PODMAN_VALUED`] could take the next word as its value: the argv then
/// names no image for gpufence, rather than a word that may not be one
/// (and may be a credential, as `--creds user:password` is).
const PODMAN_FLAGS: &[&str] = &[
    "-d",
    "--detach",
    "-i",
    "--interactive",
    "-t",
    "--tty",
    "-it",
    "-ti",
    "--rm",
    "--privileged",
    "--init",
    "--read-only",
    "--replace",
    "--no-hosts",
    "--http-proxy",
    "-q",
    "--quiet",
    "--tls-verify",
    "--all-tags",
    "--disable-content-trust",
    "--sig-proxy",
    "-P",
    "--publish-all",
    "--systemd",
    "--oom-kill-disable",
];

/// Global options of podman that take a separate value (podman(1)).
const PODMAN_GLOBAL_VALUED: &[&str] = &[
    "--root",
    "--runroot",
    "--log-level",
    "--storage-driver",
    "--cgroup-manager",
    "--url",
    "--connection",
    "--runtime",
    "--tmpdir",
    "--module",
];

/// The first positional word of `args`, skipping options and the values
/// of those in `valued` (`--opt value`; `--opt=value` is one word). With
/// `flags`, an option in neither list (its arity unknown) gives `None`.
fn first_positional<'a>(
    args: &[&'a str],
    valued: &[&str],
    flags: Option<&[&str]>,
) -> Option<(usize, &'a str)> {
    let mut i = 0;
    while i < args.len() {
        let a = args[i];
        if a == "--" {
            return args.get(i + 1).map(|w| (i + 1, *w));
        }
        if a.starts_with('-') && a.len() > 1 {
            if valued.contains(&a) {
                i += 2;
                continue;
            }
            if let Some(flags) = flags {
                if !a.contains('=') && !flags.contains(&a) {
                    return None;
                }
            }
            i += 1;
            continue;
        }
        return Some((i, a));
    }
    None
}

/// The images a task's `argv` names when it runs a container runtime
/// itself (see the module comment); empty for any other program.
pub fn from_argv(argv: &[&str]) -> Vec<ImageRef> {
    let Some(prog) = argv.first().and_then(|p| p.rsplit('/').next()) else {
        return Vec::new();
    };
    let args = &argv[1..];
    let mut out = Vec::new();
    match prog {
        "podman" => {
            if let Some((i, sub)) = first_positional(args, PODMAN_GLOBAL_VALUED, None) {
                if matches!(sub, "run" | "create" | "pull") {
                    if let Some((_, img)) =
                        first_positional(&args[i + 1..], PODMAN_VALUED, Some(PODMAN_FLAGS))
                    {
                        out.extend(parse(img, "podman"));
                    }
                }
            }
        }
        "apptainer" | "singularity" => {
            if let Some((i, sub)) = first_positional(args, &[], None) {
                if matches!(sub, "exec" | "run" | "shell" | "pull" | "build") {
                    for w in &args[i + 1..] {
                        if let Some(rest) = ["docker://", "oras://", "library://"]
                            .iter()
                            .find_map(|p| w.strip_prefix(p).map(|r| (p, r)))
                        {
                            let img = if *rest.0 == "docker://" { *w } else { rest.1 };
                            out.extend(parse(img, "apptainer").map(|mut r| {
                                if *rest.0 != "docker://" {
                                    r.registry = rest.0.trim_end_matches("://").to_string();
                                    r.text = crate::text::printable(w).chars().take(200).collect();
                                }
                                r
                            }));
                            break;
                        }
                    }
                }
            }
        }
        "enroot" => {
            if let Some((i, sub)) = first_positional(args, &[], None) {
                if sub == "import" {
                    if let Some((_, uri)) =
                        first_positional(&args[i + 1..], &["-o", "--output", "-a", "--arch"], None)
                    {
                        if uri.starts_with("docker://") {
                            out.extend(parse(uri, "enroot"));
                        }
                    }
                }
            }
        }
        _ => {}
    }
    out
}

/// What is wrong with `img` under `allowed` (`container_registries`;
/// empty: any registry): a registry outside the list first, else a tag
/// without a digest; `None` when it is fine.
pub fn judge(img: &ImageRef, allowed: &[String]) -> Option<ImageIssue> {
    if !allowed.is_empty()
        && !allowed
            .iter()
            .any(|a| a.eq_ignore_ascii_case(&img.registry))
    {
        return Some(ImageIssue::Registry(img.clone()));
    }
    (!img.pinned).then(|| ImageIssue::Unpinned(img.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:0d2b5e3c9f1a7b4e6d8c2a0f9e1b3d5c7a9e0f2b4d6c8a1e3f5b7d9c0a2e4f6b";

    #[test]
    fn pyxis_forms() {
        let r = from_pyxis("nvcr.io#nvidia/pytorch:24.05-py3").unwrap();
        assert_eq!((r.registry.as_str(), r.pinned), ("nvcr.io", false));
        let r = from_pyxis(&format!("nvcr.io#nvidia/pytorch@{D}")).unwrap();
        assert!(r.pinned);
        let r = from_pyxis("alice@registry.example:5000#team/img:v1").unwrap();
        assert_eq!(r.registry, "registry.example:5000");
        let r = from_pyxis("ubuntu").unwrap();
        assert_eq!((r.registry.as_str(), r.pinned), ("docker.io", false));
        assert!(from_pyxis("/shared/images/pytorch.sqsh").is_none());
        assert!(from_pyxis("./x.sqsh").is_none());
        // a near miss of a digest: too short
        assert!(!from_pyxis("ubuntu@sha256:abc").unwrap().pinned);
    }

    #[test]
    fn runtimes_in_argv() {
        let one = |a: &[&str]| from_argv(a);
        let r = one(&[
            "podman",
            "run",
            "--rm",
            "-v",
            "/a:/b",
            "--device",
            "nvidia.com/gpu=all",
            "docker.io/library/ubuntu:22.04",
            "nvidia-smi",
        ]);
        assert_eq!(r.len(), 1);
        assert_eq!((r[0].registry.as_str(), r[0].pinned), ("docker.io", false));
        let r = one(&[
            "/usr/bin/podman",
            "--log-level",
            "info",
            "run",
            &format!("ghcr.io/x/y@{D}"),
        ]);
        assert!(r[0].pinned && r[0].registry == "ghcr.io");
        assert!(one(&["podman", "images"]).is_empty());
        let r = one(&[
            "apptainer",
            "exec",
            "--nv",
            "docker://nvcr.io/nvidia/pytorch:24.05-py3",
            "python",
        ]);
        assert_eq!((r[0].registry.as_str(), r[0].pinned), ("nvcr.io", false));
        assert!(one(&["singularity", "run", "/shared/x.sif"]).is_empty());
        let r = one(&["singularity", "run", "library://alice/default/img:latest"]);
        assert_eq!(r[0].registry, "library");
        let r = one(&[
            "enroot",
            "import",
            "-o",
            "/tmp/x.sqsh",
            "docker://nvcr.io#nvidia/cuda:12.4.1-base-ubuntu22.04",
        ]);
        assert_eq!((r[0].registry.as_str(), r[0].pinned), ("nvcr.io", false));
        assert!(one(&["enroot", "start", "x"]).is_empty());
        assert!(one(&["python", "podman", "run", "x:1"]).is_empty());
        assert!(one(&[]).is_empty());
    }

    /// Options that take a value are skipped with it (`--restart always`,
    /// `--secret name`); an option gpufence does not know names no image
    /// rather than a word that may be its value: `--creds user:token`
    /// never becomes an "image" printed to the job, the log and the audit.
    #[test]
    fn podman_option_values_are_never_images() {
        let pinned = format!("ghcr.io/x/y@{D}");
        for opts in [
            &["--restart", "always"][..],
            &["--secret", "mysecret"],
            &[
                "--creds",
                "alice:ghp_FAKEfake0123456789TESTtestFAKEfake9999",
            ],
            &["-c", "512"],
            &["--pod", "p1"],
        ] {
            let mut argv = vec!["podman", "run"];
            argv.extend_from_slice(opts);
            argv.push(&pinned);
            let r = from_argv(&argv);
            assert_eq!(r.len(), 1, "{argv:?}: {r:?}");
            assert!(r[0].pinned && r[0].registry == "ghcr.io", "{argv:?}: {r:?}");
        }
        // Unknown, so nothing: neither the word after it nor the image.
        let r = from_argv(&[
            "podman",
            "pull",
            "--some-new-opt",
            "alice:ghp_FAKE",
            &pinned,
        ]);
        assert!(r.is_empty(), "{r:?}");
        // Known flags and --opt=value forms still find the image.
        let r = from_argv(&[
            "podman",
            "run",
            "-it",
            "--rm",
            "--creds=a:b",
            "ubuntu:22.04",
        ]);
        assert_eq!((r.len(), r[0].pinned), (1, false), "{r:?}");
    }

    #[test]
    fn judged() {
        let tag = from_pyxis("nvcr.io#nvidia/pytorch:24.05-py3").unwrap();
        let pinned = from_pyxis(&format!("nvcr.io#nvidia/pytorch@{D}")).unwrap();
        assert!(matches!(judge(&tag, &[]), Some(ImageIssue::Unpinned(_))));
        assert_eq!(judge(&pinned, &[]), None);
        let allow = vec!["nvcr.io".to_string()];
        assert_eq!(judge(&pinned, &allow), None);
        let hub = from_pyxis(&format!("ubuntu@{D}")).unwrap();
        assert!(matches!(judge(&hub, &allow), Some(ImageIssue::Registry(_))));
    }
}
