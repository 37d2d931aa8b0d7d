//! `gpufence mig check`: the binary prints what `gpufence_model::migdraw`
//! builds (text or `--json`) and exits 0 when the request fits, 1 when it
//! does not or names an unknown profile, 2 for an unknown GPU model. The
//! drawing itself is tested as goldens in `model/tests/mig_golden.rs`.

use std::process::Command;

use gpufence_model::mig::GpuModel;
use gpufence_model::migdraw;

fn run(args: &[&str]) -> (Option<i32>, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_gpufence"))
        .args(["mig", "check"])
        .args(args)
        .env_remove("GPUFENCE_CONFIG")
        .output()
        .unwrap();
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn text_is_the_model_rendering() {
    let (rc, out, _) = run(&["--gpu", "H100-80GB", "3g.40gb, 2g.20gb,1g.10gb"]);
    assert_eq!(rc, Some(0), "{out}");
    let plan = migdraw::plan(GpuModel::H100_80GB, &["3g.40gb", "2g.20gb", "1g.10gb"]).unwrap();
    assert_eq!(out, migdraw::render_text(&plan));
    assert!(
        out.contains("GPU 0 |") && out.contains("  3g.40gb at 0:4\n"),
        "{out}"
    );
    assert!(out.contains(migdraw::ORDER_HINT), "{out}");
}

#[test]
fn not_fitting_draws_the_partial_packing_and_exits_1() {
    let (rc, out, _) = run(&["--gpu", "A30", "4g.24gb,1g.6gb"]);
    assert_eq!(rc, Some(1), "{out}");
    assert!(out.starts_with("does not fit on one A30-24GB: "), "{out}");
    assert!(
        out.contains("  4g.24gb at 0:4\n") && out.contains("left over: 1g.6gb\n"),
        "{out}"
    );
    let (rc, out, _) = run(&["--gpu", "A30", "4g.24gb,1g.6gb", "--json"]);
    assert_eq!(rc, Some(1), "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["fits"], false);
    assert_eq!(v["instances"][0]["placement"], "0:4");
    assert_eq!(v["left_over"][0]["profile"], "1g.6gb");
    assert_eq!(v["slices"], serde_json::json!([0, 0, 0, 0]));
}

#[test]
fn json_when_it_fits() {
    let (rc, out, _) = run(&["--json", "--gpu", "H200", "3g.71gb,3g.71gb"]);
    assert_eq!(rc, Some(0), "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["model"], "H200-141GB");
    assert_eq!(v["fits"], true);
    assert!(v["error"].is_null());
    assert_eq!(v["instances"].as_array().unwrap().len(), 2);
    assert_eq!(v["slices"], serde_json::json!([0, 0, 0, 0, 1, 1, 1, 1]));
}

#[test]
fn unknown_profile_and_model() {
    let (rc, out, _) = run(&["--gpu", "H100-80GB", "5g.50gb"]);
    assert_eq!(rc, Some(1));
    assert!(out.contains("1g.10gb"), "lists the valid profiles: {out}");
    let (rc, out, _) = run(&["--gpu", "H100-80GB", "5g.50gb", "--json"]);
    assert_eq!(rc, Some(1));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["fits"], false);
    assert!(v["error"].as_str().unwrap().contains("5g.50gb"), "{v}");
    let (rc, _, err) = run(&["--gpu", "V100", "1g.5gb"]);
    assert_eq!(rc, Some(2));
    assert!(err.contains("unknown GPU model"), "{err}");
}
