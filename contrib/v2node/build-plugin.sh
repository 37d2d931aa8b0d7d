#!/usr/bin/env bash
# build-plugin.sh ROOT OUT: builds gpufence.so against the Slurm headers of
# ROOT (a root made by make-root.sh; "/" for this host's libslurm-dev) and
# copies it to OUT. slurmd loads only a SPANK plugin built for its own
# major.minor (_verify_syms in src/common/plugin.c): one build per Slurm
# series. Builds go to target/slurm-plugins/ so that they do not rebuild
# the workspace's own. PROFILE=release for a release build (default: dev).
# Every series shares target/slurm-plugins: switching series rebuilds only
# the bindings and the plugin (their build scripts rerun when
# SLURM_INCLUDE_DIR / BINDGEN_EXTRA_CLANG_ARGS change), not the deps.
set -euo pipefail
root=${1:?usage: build-plugin.sh ROOT OUT}
out=${2:?usage: build-plugin.sh ROOT OUT}
top=$(cd "$(dirname "$0")/../.." && pwd)
inc="${root%/}/usr/include"
# SLURM_VERSION_NUMBER 0x180b05 -> 24.11 (the series: what slurmd checks).
num=$(awk '$1 == "#define" && $2 == "SLURM_VERSION_NUMBER" { print $3 }' "$inc/slurm/slurm_version.h")
[[ $num =~ ^0x[0-9a-fA-F]+$ ]] || { echo "build-plugin.sh: no SLURM_VERSION_NUMBER in $inc/slurm/slurm_version.h" >&2; exit 1; }
version=$(printf '%d.%02d' $(((num >> 16) & 0xff)) $(((num >> 8) & 0xff)))
profile=${PROFILE:-dev}
dir=debug
[[ $profile == release ]] && dir=release
target="$top/target/slurm-plugins"
SLURM_INCLUDE_DIR="$inc" BINDGEN_EXTRA_CLANG_ARGS="-I$inc" \
    cargo build --quiet --locked --profile "$profile" -p gpufence-spank --lib --target-dir "$target" \
    --manifest-path "$top/Cargo.toml"
mkdir -p "$(dirname "$out")"
cp "$target/$dir/libgpufence.so" "$out.tmp"
mv "$out.tmp" "$out"
echo "$out: built against Slurm $version" >&2
