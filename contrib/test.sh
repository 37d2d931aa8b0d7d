#!/usr/bin/env bash
# Runs every gpufence test on this machine, as root: unit and property tests,
# kernel tests (real BPF programs on test-owned cgroups), and the end-to-end
# suite on a real one-node Slurm cluster. Installs what is missing first.
# Privileged tests fail (never skip) when CI=true; here they run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
bash contrib/setup.sh
export CI="${CI:-true}"
cargo build --workspace --all-targets --locked
# The workspace's lints ([workspace.lints]) and clippy's, as errors.
cargo clippy --workspace --all-targets --locked -- -D warnings
# The fast tier first (docs with warnings denied, unit and property tests
# run as an unprivileged user): what fails there fails in a minute.
bash contrib/test-fast.sh
# Real cgroup/v2 nodes of the Slurm releases GPU sites run besides the
# host's 22.05 (tests/tests/e2e_v2node.rs): Debian 13 (24.11) and sid
# (26.05) roots, made once per machine (about half a minute each) and kept
# under GPUFENCE_SLURM_ROOTS, and the plugin built against each release's
# own headers (slurmd loads only a plugin of its own series).
roots=${GPUFENCE_SLURM_ROOTS:-/var/cache/gpufence/roots}
for suite in trixie sid; do
    bash contrib/v2node/make-root.sh "$suite" "$roots/$suite"
    bash contrib/v2node/build-plugin.sh "$roots/$suite" "target/v2node/$suite.gpufence.so"
done
cargo test --workspace --locked -- --test-threads="${GPUFENCE_TEST_THREADS:-2}"
# Benchmarks in smoke mode: they keep compiling and working; no time is
# asserted (BENCHMARKS.md has the real runs).
target/debug/gpufence-bench open --smoke >/dev/null
target/debug/gpufence-bench scan --smoke >/dev/null
target/debug/gpufence-bench job --smoke >/dev/null
target/debug/gpufence-bench respond --smoke >/dev/null
target/debug/gpufence-bench growth --smoke >/dev/null
target/debug/gpufence-bench flood --smoke >/dev/null
target/debug/gpufence-bench ctld --smoke >/dev/null
target/debug/gpufence-bench deadline --smoke >/dev/null
target/debug/gpufence-bench door --smoke >/dev/null
# Packages, one per tested Slurm series (the host's 22.05, then each root's):
# build the .deb and .rpm from this tree and check their contents, their
# plugstack lines, and dpkg installing the .deb with slurmd alone and with
# slurm-client alone of that series and refusing it with the other series
# (a few seconds per series: throwaway overlays of the roots).
for r in / "$roots/trixie" "$roots/sid"; do
    SLURM_ROOT=$r PROFILE=dev bash contrib/package.sh >/dev/null 2>&1 ||
        { SLURM_ROOT=$r PROFILE=dev bash contrib/package.sh >/dev/null; exit 1; }
    SLURM_ROOT=$r bash contrib/check-packages.sh
done
# The arm64 packages (Grace: GB200/GB300 nodes), cross-built for the same
# series: the binaries once, the plugin per series against that series'
# headers. check-packages.sh checks their contents, ELF machine, plugin path
# and control fields; dpkg installs only amd64 packages here.
for r in / "$roots/trixie" "$roots/sid"; do
    ARCH=arm64 SLURM_ROOT=$r PROFILE=dev bash contrib/package.sh >/dev/null 2>&1 ||
        { ARCH=arm64 SLURM_ROOT=$r PROFILE=dev bash contrib/package.sh >/dev/null; exit 1; }
    ARCH=arm64 SLURM_ROOT=$r bash contrib/check-packages.sh
done
bash contrib/test-arm64.sh
