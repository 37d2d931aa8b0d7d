#!/usr/bin/env bash
# Builds gpufence's packages: a Debian package (cargo deb, metadata in
# cli/Cargo.toml) and, where rpmbuild exists, an RPM (contrib/gpufence.spec).
# Both contain the same files: binaries, the SPANK plugin, the systemd unit,
# the example config, man pages generated from the CLI definitions, and
# shell completions.
#
#   bash contrib/package.sh            -> target/packages/*.deb, *.rpm
#   PROFILE=dev bash contrib/package.sh   (faster, for tests)
set -euo pipefail
cd "$(dirname "$0")/.."
PROFILE=${PROFILE:-release}
DIR=$([[ $PROFILE == dev ]] && echo debug || echo "$PROFILE")
OUT=target/packages
cargo build --locked --workspace --profile "$PROFILE"
T=target/$DIR
rm -rf target/assets "$OUT"
mkdir -p target/assets/man target/assets/completions "$OUT"
"$T/gpufence" man target/assets/man
"$T/gpufence-prolog" --generate-man target/assets/man
"$T/gpufence-epilog" --generate-man target/assets/man
"$T/gpufence" completions bash >target/assets/completions/gpufence.bash
"$T/gpufence" completions zsh >target/assets/completions/_gpufence
"$T/gpufence" completions fish >target/assets/completions/gpufence.fish

command -v cargo-deb >/dev/null || { echo "package.sh: cargo-deb missing (cargo install cargo-deb)" >&2; exit 1; }
# cargo-deb maps the target/release/ prefix of asset paths to the profile's directory.
cargo deb -p gpufence-cli --no-build --profile "$PROFILE" -o "$OUT/"

if command -v rpmbuild >/dev/null; then
    top=$(mktemp -d)
    version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
    rpmbuild -bb contrib/gpufence.spec \
        --define "_topdir $top" --define "_rpmdir $PWD/$OUT" \
        --define "gpufence_src $PWD" --define "gpufence_bin $PWD/$T" \
        --define "gpufence_version $version" >"$top/rpmbuild.log" 2>&1 ||
        { tail -n 30 "$top/rpmbuild.log" >&2; exit 1; }
    rm -rf "$top"
else
    echo "package.sh: rpmbuild not found, RPM not built (apt-get install rpm / dnf install rpm-build)" >&2
fi
find "$OUT" -type f -name '*.deb' -o -type f -name '*.rpm'
