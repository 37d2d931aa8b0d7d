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
cargo test --workspace --locked -- --test-threads="${GPUFENCE_TEST_THREADS:-2}"
# Benchmarks in smoke mode: they keep compiling and working; no time is
# asserted (BENCHMARKS.md has the real runs).
target/debug/gpufence-bench open --smoke >/dev/null
target/debug/gpufence-bench scan --smoke >/dev/null
target/debug/gpufence-bench job --smoke >/dev/null
# Packages: build the .deb and .rpm from this tree and check their contents.
PROFILE=dev bash contrib/package.sh >/dev/null
bash contrib/check-packages.sh
