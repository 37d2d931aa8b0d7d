//! Golden text of `gpufence mig check` ([`migdraw::render_text`]) for each of
//! the six models [`GpuModel::ALL`] lists, for a request that fits and for
//! one that does not (drawn as its best partial packing, with what is left
//! over), and golden JSON ([`migdraw::plan_json`]) for the H100-80GB cases.
//!
//! The goldens are `testdata/mig/<model>-<case>.txt` (and `.json`) at the
//! workspace root, compared byte for byte. After a deliberate change of the
//! drawing, regenerate them and review the diff:
//!
//! ```text
//! GPUFENCE_BLESS=1 cargo test -p gpufence-model --test mig_golden
//! git diff testdata/mig
//! ```

use std::path::PathBuf;

use gpufence_model::mig::GpuModel;
use gpufence_model::migdraw::{self, MAX_COLUMNS};

/// (model, case, request): every model once fitting, once not.
const CASES: &[(GpuModel, &str, &str)] = &[
    (GpuModel::A100_40GB, "fit", "4g.20gb,2g.10gb,1g.5gb"),
    (GpuModel::A100_40GB, "nofit", "3g.20gb,3g.20gb,1g.5gb"),
    (
        GpuModel::A100_80GB,
        "fit",
        "3g.40gb,2g.20gb,1g.10gb,1g.10gb",
    ),
    (GpuModel::A100_80GB, "nofit", "4g.40gb,2g.20gb,2g.20gb"),
    (GpuModel::A30_24GB, "fit", "1g.6gb+me,2g.12gb,1g.6gb"),
    (GpuModel::A30_24GB, "nofit", "4g.24gb,1g.6gb"),
    (GpuModel::H100_80GB, "fit", "3g.40gb,2g.20gb,1g.10gb"),
    (GpuModel::H100_80GB, "nofit", "3g.40gb,3g.40gb,1g.10gb+me"),
    (
        GpuModel::H100_94GB,
        "fit",
        "1g.12gb+me,2g.24gb,2g.24gb,2g.24gb",
    ),
    (
        GpuModel::H100_94GB,
        "nofit",
        "4g.47gb,2g.24gb,1g.12gb,1g.12gb",
    ),
    (GpuModel::H200_141GB, "fit", "1g.35gb,2g.35gb,4g.71gb"),
    (
        GpuModel::H200_141GB,
        "nofit",
        "1g.18gb+me,1g.18gb+me,3g.71gb,2g.35gb",
    ),
];

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/mig")
}

fn bless() -> bool {
    std::env::var_os("GPUFENCE_BLESS").is_some_and(|v| v == "1")
}

/// Compares `got` with the golden `name`, or writes it under GPUFENCE_BLESS=1.
/// Returns a description of the mismatch, if any.
fn check(name: &str, got: &str) -> Option<String> {
    let path = golden_dir().join(name);
    if bless() {
        std::fs::create_dir_all(golden_dir()).unwrap();
        std::fs::write(&path, got).unwrap();
        return None;
    }
    match std::fs::read(&path) {
        Ok(want) if want == got.as_bytes() => None,
        Ok(want) => Some(format!(
            "{} differs (GPUFENCE_BLESS=1 to regenerate)\n--- want\n{}--- got\n{got}",
            path.display(),
            String::from_utf8_lossy(&want)
        )),
        Err(e) => Some(format!(
            "{}: {e} (GPUFENCE_BLESS=1 to generate)",
            path.display()
        )),
    }
}

fn file_stem(model: GpuModel, case: &str) -> String {
    format!("{}-{case}", model.name().to_ascii_lowercase())
}

fn request(list: &str) -> Vec<&str> {
    list.split(',').collect()
}

#[test]
fn every_model_is_covered_fitting_and_not() {
    for m in GpuModel::ALL {
        for case in ["fit", "nofit"] {
            assert!(
                CASES.iter().any(|(cm, c, _)| *cm == m && *c == case),
                "{m} {case}"
            );
        }
    }
}

#[test]
fn text_goldens() {
    let mut failures = Vec::new();
    for &(m, case, list) in CASES {
        let plan = migdraw::plan(m, &request(list)).unwrap();
        assert_eq!(plan.fits(), case == "fit", "{m} {list}");
        if case == "nofit" {
            assert!(!plan.left_over.is_empty(), "{m} {list}");
        }
        for line in migdraw::draw(m, &plan.placements).lines() {
            assert!(line.chars().count() <= MAX_COLUMNS, "{m} {list}: {line:?}");
        }
        let text = migdraw::render_text(&plan);
        if let Some(f) = check(&format!("{}.txt", file_stem(m, case)), &text) {
            failures.push(f);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn json_goldens_and_structure() {
    let mut failures = Vec::new();
    for &(m, case, list) in CASES {
        let req = request(list);
        let plan = migdraw::plan(m, &req).unwrap();
        let v = migdraw::plan_json(&plan);
        assert_eq!(v["model"], m.name());
        assert_eq!(v["fits"], plan.fits());
        assert_eq!(v["error"].is_null(), plan.fits());
        let instances = v["instances"].as_array().unwrap();
        let left = v["left_over"].as_array().unwrap();
        assert_eq!(instances.len() + left.len(), req.len(), "{m} {list}");
        let slices = v["slices"].as_array().unwrap();
        assert_eq!(slices.len(), usize::from(m.memory_slices()));
        // Each instance covers exactly its start..start+size, and the
        // placement string says the same.
        for (i, inst) in instances.iter().enumerate() {
            let (s, n) = (
                inst["start"].as_u64().unwrap() as usize,
                inst["size"].as_u64().unwrap() as usize,
            );
            assert_eq!(inst["placement"], format!("{s}:{n}"));
            for (k, slot) in slices.iter().enumerate() {
                let here = slot.as_u64() == Some(i as u64);
                assert_eq!(here, (s..s + n).contains(&k), "{m} {list} slice {k}");
            }
        }
        let used = slices.iter().filter(|s| !s.is_null()).count() as u64;
        assert_eq!(v["memory_slices_used"].as_u64(), Some(used));
        if m == GpuModel::H100_80GB {
            let text = serde_json::to_string_pretty(&v).unwrap() + "\n";
            if let Some(f) = check(&format!("{}.json", file_stem(m, case)), &text) {
                failures.push(f);
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
