#!/usr/bin/env bash
# The arm64 (Grace) build's kernel-independent unit tests, cross-built for
# aarch64-unknown-linux-gnu and run under qemu-user (qemu-aarch64 with the
# cross libc; contrib/setup.sh installs them): the model's (config, policy,
# records, parsers) and gpufence-cgroup's (the BPF assembler, the fence
# program and its interpreter checked against the policy, map and uapi
# layouts). Quiet on success but for one line. Builds in target/slurm-plugins
# with the arm64 packages (contrib/package.sh), sharing their dependencies.
#
# qemu-user emulates user space only: bpf(2) is ENOSYS under it, so every
# test that loads a BPF program or makes a map needs an aarch64 kernel and is
# skipped here by name (they run on x86_64 in contrib/test.sh). qemu also
# fakes /proc/self/stat (state "0"), which this_process_reads_itself reads.
set -euo pipefail
cd "$(dirname "$0")/.."
triple=aarch64-unknown-linux-gnu
skip=(
    iter::live:: iter::fdtable::live:: level::live::
    sys::maps::tests::per_cpu_values_are_refused
    sys::maps::tests::batches_grow_and_miss_nothing
    sys::maps::tests::slices_of_another_size_never_reach_the_kernel
    procstat::tests::this_process_reads_itself
)
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# The property tests run their full count natively; here a few cases each.
if ! CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=${CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER:-aarch64-linux-gnu-gcc} \
    CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER=${CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER:-qemu-aarch64 -L /usr/aarch64-linux-gnu} \
    PROPTEST_CASES=${PROPTEST_CASES:-32} \
    cargo test --locked --target "$triple" --target-dir target/slurm-plugins -p gpufence-model -p gpufence-cgroup --lib \
    -- "${skip[@]/#/--skip=}" >"$log" 2>&1; then
    grep -E '^(test .* FAILED|error|failures:|    )' "$log" | tail -n 30 >&2
    echo "test-arm64.sh: the aarch64 unit tests failed under qemu-aarch64 (above)" >&2
    exit 1
fi
passed=$(awk '/^test result: ok/ { n += $4 } END { print n + 0 }' "$log")
echo "arm64: $passed unit tests passed under qemu-aarch64 (model, cgroup; BPF loads skipped: no aarch64 kernel)"
