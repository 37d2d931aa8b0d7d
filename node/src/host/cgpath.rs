//! How cgroup paths appear in gpufence's JSON output (`--json` of every
//! command, evidence and incident files): absolute within the cgroup2
//! mount, `/` for its root, as `gpufence sweep`, `fence status` and the
//! audit log write them. Inside gpufence they stay relative (`a/b`, `""`
//! for the root), as [`gpufence_cgroup::hierarchy::Cgroup2::path`] takes
//! them. Thin wrappers of [`gpufence_model::CgroupPath`], the one place
//! cgroup paths are normalised, joined and compared, for code that still
//! holds them as `String`s.

use gpufence_model::CgroupPath;
use serde::Serializer;

/// `a/b` → `/a/b`; `""` → `/`: [`CgroupPath::abs`] of the normalised path
/// (a text that is not a cgroup path, `..`, keeps its components as they
/// are).
pub fn abs(rel: &str) -> String {
    match CgroupPath::parse(rel) {
        Ok(p) => p.abs(),
        Err(_) => format!("/{}", rel.trim_matches('/')),
    }
}

/// `#[serde(serialize_with = "crate::host::cgpath::serialize")]` for a relative
/// path held as a `String`.
///
/// # Errors
/// The serializer's.
pub fn serialize<S: Serializer, T: AsRef<str>>(rel: &T, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&abs(rel.as_ref()))
}

/// The same for an `Option<String>` (`None` stays `null`).
pub mod option {
    use serde::Serializer;

    /// See the module.
    ///
    /// # Errors
    /// The serializer's.
    pub fn serialize<S: Serializer>(rel: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
        match rel {
            Some(r) => s.serialize_some(&super::abs(r)),
            None => s.serialize_none(),
        }
    }
}

#[cfg(test)]
mod tests {
    #[derive(serde::Serialize)]
    struct T {
        #[serde(serialize_with = "super::serialize")]
        a: String,
        #[serde(serialize_with = "super::option::serialize")]
        b: Option<String>,
        #[serde(serialize_with = "super::option::serialize")]
        c: Option<String>,
    }

    #[test]
    fn paths_are_absolute_in_json() {
        let t = T {
            a: String::new(),
            b: Some("gpufence-demo/job_4".into()),
            c: None,
        };
        assert_eq!(
            serde_json::to_string(&t).unwrap(),
            r#"{"a":"/","b":"/gpufence-demo/job_4","c":null}"#
        );
        assert_eq!(super::abs("/x/y/"), "/x/y");
        assert_eq!(super::abs("x//y"), "/x/y");
        assert_eq!(super::abs("/x/../y"), "/x/../y");
    }
}
