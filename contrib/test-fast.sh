#!/usr/bin/env bash
# The fast tier: what needs no root and no Slurm. Formatting, the docs with
# warnings denied, and every crate's unit and property tests (`--lib
# --bins`), which never need root (those that load BPF or make cgroups
# skip, saying so, without it; the kernel and Slurm tests are the
# integration tests contrib/test.sh runs). About a minute after a build.
#
# As any user but root, `cargo test` runs them as that user. As root (CI,
# contrib/test.sh) they are built here and then run as the unprivileged
# `gpufence-test` user (contrib/setup.sh makes it), so that a unit test
# that needs root fails here instead of passing by privilege; where that
# user cannot read this tree (a clone under /root), they run as root and
# a line says so.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked --quiet
if ((EUID != 0)); then
    exec env -u CI cargo test --workspace --lib --bins --locked
fi
user=gpufence-test
# "CRATE_DIR<tab>TEST_BINARY" for each unit-test binary cargo builds.
mapfile -t bins < <(
    cargo test --workspace --lib --bins --locked --no-run --message-format=json 2>/dev/null |
        python3 -c '
import json, os, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(os.path.dirname(m["manifest_path"]) + "\t" + m["executable"])
' | sort -u
)
((${#bins[@]})) || { echo "test-fast.sh: no test binaries built" >&2; exit 1; }
as_user=(setpriv --reuid "$user" --regid "$user" --clear-groups --reset-env
    env PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/tmp TMPDIR=/tmp)
if ! "${as_user[@]}" test -r Cargo.toml -a -x "${bins[0]#*$'\t'}"; then
    echo "test-fast.sh: $user cannot read $(pwd): the unit tests run as root" >&2
    as_user=(env -u CI)
fi
for line in "${bins[@]}"; do
    dir=${line%%$'\t'*} b=${line#*$'\t'}
    # From its crate's directory, as `cargo test` runs it.
    if ! out=$(cd "$dir" && "${as_user[@]}" "$b" --quiet 2>&1); then
        echo "$out" >&2
        echo "test-fast.sh: $b failed (run as ${as_user[2]:-root})" >&2
        exit 1
    fi
    echo "$(basename "$b"): $(grep '^test result' <<<"$out" | tail -n 1)"
done
