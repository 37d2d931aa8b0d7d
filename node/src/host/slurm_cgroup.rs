//! Slurm's job-cgroup layout in the cgroup2 hierarchy: which cgroup is a
//! job's (`job_<id>`, or a SLUID in 26.05), and the job cgroup of the
//! slurmstepd asking, found from its own cgroup. Names and paths only: the
//! hierarchy itself (mount, ids, moves) is `gpufence_cgroup::hierarchy`'s,
//! which knows nothing of Slurm.

/// A job cgroup of Slurm's cgroup/v2 plugin, found from slurmstepd's own
/// cgroup by [`find_job_cgroup`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlurmJobCgroup {
    /// The job cgroup, relative to the mount
    /// (`system.slice/node1_slurmstepd.scope/job_7`).
    pub path: String,
    /// Its name, for logs: `job_<id>` (Slurm 22.05-25.11, and 26.05.2+ with
    /// `CgroupJobIdPaths=yes`) or the job's SLUID (26.05 by default).
    pub dir: String,
    /// The step cgroup's name below it (`step_0`, `step_batch`,
    /// `step_extern`, `step_interactive`, `step_0+1` for a het component).
    pub step_dir: String,
}

/// In the `slurm` layout, finds the job cgroup from the cgroup slurmstepd
/// runs in (`own_cgroup`, from the kernel's `/proc/<pid>/cgroup`: where
/// Slurm put its own daemon; never the job's environment) for job `job_id`
/// and step `step` (`0`, `batch`, `extern`, `interactive`: the name Slurm
/// gives the step, as [`crate::job::grant::step_name`] spells it).
///
/// Slurm's cgroup/v2 plugin (`cgroup_p_step_create`,
/// `src/plugins/cgroup/v2/cgroup_v2.c`) makes
/// `<scope>/<job dir>/step_<step>/{slurm,user/task_<n>}` and puts slurmstepd
/// in `step_<step>/slurm`, a leaf; with `PrologFlags=RunInJob` (24.05+) the
/// Prolog runs in `<job dir>/step_extern/slurm` too. So `own_cgroup` must
/// end in exactly those three names:
/// - `<job dir>`: `job_<job_id>` for this job id (22.05-25.11; 26.05.2+
///   with `CgroupJobIdPaths=yes`), or a SLUID ([`is_sluid`]; 26.05 names
///   job cgroups by the job's SLUID, and SPANK gives no SLUID to compare
///   with, so any well-formed one is accepted: slurmstepd serves one job,
///   and the step below it must match);
/// - `step_<step>`, or `step_<step>+<n>` for component n of a
///   heterogeneous step (`log_build_step_id_str`, `src/common/log.c`,
///   22.05-25.11 with job ids);
/// - `slurm`.
///
/// Nothing above the job dir may look like a job or a step (`job_<n>`, a
/// SLUID, `step_*`): Slurm makes job dirs right in its scope, never inside
/// another job, so `.../job_7/step_0/user/task_0/job_8/step_0/slurm` (a
/// lookalike made inside job 7's task cgroup, e.g. by a container runtime
/// with a delegated subtree) gives `None` for job 8 (granting it would hand
/// job 8's GPUs to job 7's processes) and for job 7 (its slurmstepd is not
/// there). A deeper cgroup (`.../step_0/slurm/x`) or another step's
/// cgroup gives `None` as well.
pub fn find_job_cgroup(own_cgroup: &str, job_id: u32, step: &str) -> Option<SlurmJobCgroup> {
    let parts: Vec<&str> = own_cgroup.split('/').filter(|s| !s.is_empty()).collect();
    let [above @ .., job_dir, step_dir, leaf] = parts.as_slice() else {
        return None;
    };
    if *leaf != "slurm" {
        return None;
    }
    let step_ok = step_dir.strip_prefix("step_").is_some_and(|s| {
        s == step
            || s.strip_prefix(step)
                .and_then(|r| r.strip_prefix('+'))
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    });
    let job_ok = *job_dir == format!("job_{job_id}") || is_sluid(job_dir);
    let lookalike_above = above
        .iter()
        .any(|p| is_job_id_dir(p) || is_sluid(p) || p.starts_with("step_"));
    if !step_ok || !job_ok || lookalike_above {
        return None;
    }
    Some(SlurmJobCgroup {
        path: parts[..parts.len() - 2].join("/"),
        dir: job_dir.to_string(),
        step_dir: step_dir.to_string(),
    })
}

/// `job_<digits>`: a job cgroup of Slurm by job id.
fn is_job_id_dir(name: &str) -> bool {
    name.strip_prefix("job_")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The job id of a `job_<digits>` cgroup directory name (Slurm's
/// `job_%u`), `None` for anything else (a SLUID names no id).
pub fn job_dir_id(name: &str) -> Option<u32> {
    is_job_id_dir(name)
        .then(|| name.strip_prefix("job_").and_then(|n| n.parse().ok()))
        .flatten()
}

/// Whether cgroup directory `name` is a Slurm job's: `job_<digits>` or a
/// SLUID ([`is_sluid`]).
pub fn is_job_dir(name: &str) -> bool {
    is_job_id_dir(name) || is_sluid(name)
}

/// Whether `name` is a SLUID as Slurm prints it (`print_sluid`,
/// `src/common/sluid.c`, 25.11+): `s`, then 13 characters of Crockford's
/// base32 upper case (`0-9A-Z` without `I L O U`), most significant first,
/// 14 in all (`SLUID_STR_BYTES` 15 with the NUL). 13 × 5 bits hold the
/// 64-bit id, so the first of them carries only 4 bits (`0`-`F`). An id of
/// 0 is invalid (`log_build_step_id_str` prints `Invalid`; the cluster id
/// in the top 12 bits is 2-4095, `generate_cluster_id`), so all zeros is
/// refused. Example: `s7C5M8ST6RSJ00`.
pub fn is_sluid(name: &str) -> bool {
    const CB32: &[u8] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";
    let Some(body) = name.strip_prefix('s') else {
        return false;
    };
    let b = body.as_bytes();
    b.len() == 13
        && b.iter().all(|c| CB32.contains(c))
        && b[0] <= b'F'
        && b.iter().any(|c| *c != b'0')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(own: &str, job: u32, step: &str) -> Option<(String, String)> {
        find_job_cgroup(own, job, step).map(|j| (j.path, j.dir))
    }

    fn some(path: &str, dir: &str) -> Option<(String, String)> {
        Some((path.to_string(), dir.to_string()))
    }

    /// 22.05 and 24.11 (seen): `job_<id>`, slurmstepd in `step_<n>/slurm`.
    #[test]
    fn job_id_dirs() {
        let scope = "system.slice/node1_slurmstepd.scope";
        for (step, name) in [
            ("0", "step_0"),
            ("batch", "step_batch"),
            ("extern", "step_extern"),
            ("interactive", "step_interactive"),
            ("3", "step_3+1"),
        ] {
            let own = format!("{scope}/job_7/{name}/slurm");
            assert_eq!(
                found(&own, 7, step),
                some(&format!("{scope}/job_7"), "job_7"),
                "{own}"
            );
        }
        let j = find_job_cgroup(&format!("{scope}/job_7/step_batch/slurm"), 7, "batch").unwrap();
        assert_eq!(j.step_dir, "step_batch");
        assert_eq!(found("job_7/step_0/slurm", 7, "0"), some("job_7", "job_7"));
        assert_eq!(
            found("system.slice/slurmstepd.scope/job_42/step_0/slurm", 4, "0"),
            None,
            "job_42 is not job_4"
        );
        assert_eq!(found(&format!("{scope}/job_7/step_0/slurm"), 8, "0"), None);
    }

    /// 26.05 (seen): the job dir is the job's SLUID.
    #[test]
    fn sluid_dirs() {
        let scope = "system.slice/node1_slurmstepd.scope";
        assert_eq!(
            found(
                &format!("{scope}/s7C5M8ST6RSJ00/step_extern/slurm"),
                9,
                "extern"
            ),
            some(&format!("{scope}/s7C5M8ST6RSJ00"), "s7C5M8ST6RSJ00")
        );
        assert_eq!(
            found(&format!("{scope}/s7C5M8ST6RSJ00/step_0/slurm"), 9, "0"),
            some(&format!("{scope}/s7C5M8ST6RSJ00"), "s7C5M8ST6RSJ00")
        );
        for name in ["s7C5M8ST6RSJ00", "sF000000000001", "s0123456789ABC"] {
            assert!(is_sluid(name), "{name}");
        }
        for name in [
            "S7C5M8ST6RSJ00",  // print_sluid writes a lower-case s
            "s7c5m8st6rsj00",  // and upper-case digits
            "s7C5M8ST6RSJ0",   // 12 digits
            "s7C5M8ST6RSJ000", // 14
            "s7C5M8ST6RSJ0I",  // I is no Crockford digit
            "s7C5M8ST6RSJ0U",
            "sG000000000000", // more than 64 bits
            "s0000000000000", // id 0: invalid
            "x7C5M8ST6RSJ00",
            "job_7",
            "",
        ] {
            assert!(!is_sluid(name), "{name}");
        }
        assert_eq!(
            found(&format!("{scope}/s7c5m8st6rsj00/step_0/slurm"), 9, "0"),
            None
        );
    }

    #[test]
    fn wrong_step_or_leaf_finds_nothing() {
        let scope = "system.slice/node1_slurmstepd.scope";
        for (own, step) in [
            (format!("{scope}/job_7/step_0/slurm"), "1"),
            (format!("{scope}/job_7/step_0/slurm"), "batch"),
            (format!("{scope}/job_7/step_10/slurm"), "1"),
            (format!("{scope}/job_7/step_1+/slurm"), "1"),
            (format!("{scope}/job_7/step_1+x/slurm"), "1"),
            (format!("{scope}/job_7/step_extern/slurm"), "batch"),
            // the task's cgroup, not slurmstepd's
            (format!("{scope}/job_7/step_0/user/task_0"), "0"),
            (format!("{scope}/job_7/step_0/user"), "0"),
            (format!("{scope}/job_7/step_0"), "0"),
            (format!("{scope}/job_7"), "0"),
            // below slurmstepd's leaf
            (format!("{scope}/job_7/step_0/slurm/x"), "0"),
            (format!("{scope}/job_7/x/step_0/slurm"), "0"),
            (format!("{scope}/job_7/step_0/slurmx"), "0"),
        ] {
            assert_eq!(found(&own, 7, step), None, "{own} step {step}");
        }
    }

    /// A cgroup that looks like Slurm's, made inside job 7's task cgroup:
    /// neither job 8 (its "job cgroup" would be inside job 7: job 7's
    /// processes would get job 8's GPUs) nor job 7 (its slurmstepd is not
    /// there) is found.
    #[test]
    fn lookalikes_inside_a_job_find_nothing() {
        let scope = "system.slice/node1_slurmstepd.scope";
        let own = format!("{scope}/job_7/step_0/user/task_0/job_8/step_0/slurm");
        assert_eq!(found(&own, 8, "0"), None);
        assert_eq!(found(&own, 7, "0"), None);
        let own = format!("{scope}/s7C5M8ST6RSJ00/step_0/user/task_0/s7C5M8ST6RSJ01/step_0/slurm");
        assert_eq!(found(&own, 8, "0"), None);
        let own = format!("{scope}/job_7/step_0/user/task_0/x/job_8/step_0/slurm");
        assert_eq!(found(&own, 8, "0"), None);
    }

    #[test]
    fn no_match() {
        for own in [
            "",
            "system.slice/slurmd.service",
            "system.slice/slurmd.service/slurmd",
            "user.slice/user-1000.slice/session-3.scope",
            "system.slice/node1_slurmstepd.scope",
            "system.slice/node1_slurmstepd.scope/job_/step_0/slurm",
            "system.slice/node1_slurmstepd.scope/job_x/step_0/slurm",
            "system.slice/node1_slurmstepd.scope/7/step_0/slurm",
        ] {
            assert_eq!(found(own, 7, "0"), None, "{own}");
        }
    }
}
