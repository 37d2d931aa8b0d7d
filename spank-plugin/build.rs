//! Declares the plugin with the Slurm version of the headers it is built
//! against: Slurm loads a SPANK plugin only when its `plugin_version` has the
//! running Slurm's major and minor (`src/common/plugin.c`, `_verify_syms`,
//! mask 0xffff00 for type "spank"). The version comes from
//! `$SLURM_INCLUDE_DIR/slurm/slurm_version.h` (default /usr/include), the
//! same headers slurm-spank's bindgen reads (point bindgen at another tree
//! with `BINDGEN_EXTRA_CLANG_ARGS=-I<dir>`).

use std::path::PathBuf;

fn main() {
    let inc = std::env::var("SLURM_INCLUDE_DIR").unwrap_or_else(|_| "/usr/include".into());
    let header = PathBuf::from(&inc).join("slurm/slurm_version.h");
    println!("cargo:rerun-if-env-changed=SLURM_INCLUDE_DIR");
    println!("cargo:rerun-if-changed={}", header.display());
    let text = std::fs::read_to_string(&header).unwrap_or_else(|e| {
        panic!(
            "gpufence-spank: cannot read {} ({e}); install Slurm's headers (Debian: libslurm-dev) \
             or set SLURM_INCLUDE_DIR",
            header.display()
        )
    });
    let version = text
        .lines()
        .find_map(|l| {
            let mut it = l.split_whitespace();
            (it.next() == Some("#define") && it.next() == Some("SLURM_VERSION_NUMBER"))
                .then(|| it.next())?
        })
        .unwrap_or_else(|| panic!("no SLURM_VERSION_NUMBER in {}", header.display()))
        .to_string();
    let lit = if let Some(hex) = version.strip_prefix("0x") {
        u32::from_str_radix(hex, 16).ok()
    } else {
        version.parse().ok()
    }
    .unwrap_or_else(|| panic!("SLURM_VERSION_NUMBER {version:?} is not a number"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    std::fs::write(
        out.join("plugin_decl.rs"),
        format!("/// Slurm version of the headers this plugin was built against.\npub const BUILT_FOR_SLURM: u32 = {lit:#x};\n"),
    )
    .expect("write plugin_decl.rs");
}
