//! The minimum Rust version the workspace declares (`rust-version` in the
//! root Cargo.toml), held: every member inherits it, so clippy's
//! `incompatible_msrv` lint (run with `-D warnings` in CI) refuses any
//! standard-library item stabilized later; and no locked dependency
//! declares a newer one (this test, from `cargo metadata`). Only one
//! toolchain exists on the CI machines, so the declared version itself is
//! never run: language features newer than it would pass unseen.

use std::path::Path;
use std::process::Command;

/// `"1.88"` or `"1.88.0"` as `(1, 88, 0)`.
fn version(s: &str) -> (u32, u32, u32) {
    let mut it = s.trim().split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    (
        it.next().unwrap_or(0),
        it.next().unwrap_or(0),
        it.next().unwrap_or(0),
    )
}

#[test]
fn every_crate_and_locked_dependency_fits_the_declared_rust_version() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    // The root's `[workspace.package]` says `rust-version = "X.Y"` (what
    // each member inherits; `cargo metadata` shows it per member below).
    let text = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let declared = text
        .lines()
        .skip_while(|l| l.trim() != "[workspace.package]")
        .take_while(|l| !l.starts_with('[') || l.trim() == "[workspace.package]")
        .find_map(|l| l.trim().strip_prefix("rust-version = "))
        .map(|v| v.trim_matches('"').to_string())
        .expect("rust-version in [workspace.package]");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let o = Command::new(cargo)
        .current_dir(&root)
        .args([
            "metadata",
            "--locked",
            "--offline",
            "--format-version",
            "1",
            "--filter-platform",
            "x86_64-unknown-linux-gnu",
        ])
        .output()
        .expect("cargo metadata");
    assert!(
        o.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let m: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let used: std::collections::BTreeSet<&str> = m["resolve"]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n["id"].as_str())
        .collect();
    let members: std::collections::BTreeSet<&str> = m["workspace_members"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    let mut too_new = Vec::new();
    let mut undeclared = Vec::new();
    for p in m["packages"].as_array().unwrap() {
        let id = p["id"].as_str().unwrap_or("");
        if !used.contains(id) {
            continue;
        }
        let name = format!("{} {}", p["name"].as_str().unwrap_or("?"), p["version"]);
        match p["rust_version"].as_str() {
            Some(v) if version(v) > version(&declared) => too_new.push(format!("{name} needs {v}")),
            None if members.contains(id) => undeclared.push(name),
            _ => {}
        }
    }
    assert!(
        too_new.is_empty(),
        "locked crates need a newer Rust than rust-version {declared}: {too_new:?}"
    );
    assert!(
        undeclared.is_empty(),
        "members without `rust-version.workspace = true` (clippy would not hold them to {declared}): {undeclared:?}"
    );
}
