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
# ARCH=arm64 cross-builds it for aarch64-unknown-linux-gnu (Grace nodes;
# contrib/setup.sh installs the target, aarch64-linux-gnu-gcc and the cross
# libc): bindgen parses spank.h for aarch64 (clang --target) with the cross
# libc's headers (--sysroot) and, of ROOT's usr/include, only slurm/ (an
# include dir holding nothing else), so that no x86_64 or other release's
# libc header is read. The Slurm headers are the same on every architecture.
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
case ${ARCH:-amd64} in
amd64 | x86_64)
    ARCH=amd64
    SLURM_INCLUDE_DIR="$inc" BINDGEN_EXTRA_CLANG_ARGS="-I$inc" \
        cargo build --quiet --locked --profile "$profile" -p gpufence-spank --lib --target-dir "$target" \
        --manifest-path "$top/Cargo.toml"
    so="$target/$dir/libgpufence.so"
    ;;
arm64 | aarch64)
    ARCH=arm64
    triple=aarch64-unknown-linux-gnu sysroot=/usr/aarch64-linux-gnu
    [[ -d $sysroot/include ]] || { echo "build-plugin.sh: no $sysroot/include (apt-get install libc6-dev-arm64-cross)" >&2; exit 1; }
    # One include dir per series, so that the bindings rerun only when the series changes.
    slurm_only="$target/include/$version"
    mkdir -p "$slurm_only"
    ln -sfn "$inc/slurm" "$slurm_only/slurm"
    SLURM_INCLUDE_DIR="$inc" \
        BINDGEN_EXTRA_CLANG_ARGS="--target=aarch64-linux-gnu --sysroot=$sysroot -I$slurm_only" \
        CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=${CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER:-aarch64-linux-gnu-gcc} \
        cargo build --quiet --locked --profile "$profile" -p gpufence-spank --lib --target-dir "$target" \
        --target "$triple" --manifest-path "$top/Cargo.toml"
    so="$target/$triple/$dir/libgpufence.so"
    ;;
*)
    echo "build-plugin.sh: ARCH=$ARCH: amd64 or arm64" >&2
    exit 1
    ;;
esac
mkdir -p "$(dirname "$out")"
cp "$so" "$out.tmp"
mv "$out.tmp" "$out"
suffix=
if [[ $ARCH == arm64 ]]; then suffix=" for arm64"; fi
echo "$out: built against Slurm $version$suffix" >&2
