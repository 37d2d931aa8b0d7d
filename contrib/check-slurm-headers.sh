#!/usr/bin/env bash
# Builds gpufence.so against the spank.h of other Slurm releases, to keep
# the plugin buildable beyond Debian 12's 22.05.
#
#   bash contrib/check-slurm-headers.sh SLURM_SRC_DIR BRANCH...
#   e.g. bash contrib/check-slurm-headers.sh ~/src/slurm slurm-23.11 slurm-24.11 slurm-25.11
#
# SLURM_SRC_DIR is a git clone of SchedMD/slurm. For each branch the public
# headers are taken from git (slurm_version.h is generated at configure
# time, so a minimal one is written from the branch name), and the plugin is
# built with SLURM_INCLUDE_DIR (read by spank-plugin/build.rs for the plugin
# version) and BINDGEN_EXTRA_CLANG_ARGS (read by slurm-spank's bindgen).
set -euo pipefail
src=${1:?usage: $0 SLURM_SRC_DIR BRANCH...}
shift
cd "$(dirname "$0")/.."
for br in "$@"; do
    ver=${br#slurm-}
    major=${ver%%.*}
    minor=${ver#*.}
    minor=${minor%%.*}
    hdr=$(mktemp -d)
    mkdir -p "$hdr/slurm"
    for h in spank.h slurm_errno.h; do
        git -C "$src" show "$br:slurm/$h" >"$hdr/slurm/$h"
    done
    printf '#define SLURM_VERSION_NUMBER 0x%02x%02x00\n#define SLURM_VERSION_MAJOR(a) (((a) >> 16) & 0xff)\n#define SLURM_VERSION_MINOR(a) (((a) >> 8) & 0xff)\n#define SLURM_VERSION_MICRO(a) ((a) & 0xff)\n' \
        "$((10#$major))" "$((10#$minor))" >"$hdr/slurm/slurm_version.h"
    echo "== $br"
    SLURM_INCLUDE_DIR=$hdr BINDGEN_EXTRA_CLANG_ARGS="-I$hdr" CARGO_TARGET_DIR="$hdr/target" \
        cargo build -q -p gpufence-spank
    rm -rf "$hdr"
    echo "ok"
done
