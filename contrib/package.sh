#!/usr/bin/env bash
# Builds gpufence's packages: a Debian package (cargo deb, metadata in
# cli/Cargo.toml) and, where rpmbuild exists, an RPM (contrib/gpufence.spec).
# Both contain the same files: binaries, the SPANK plugin, the systemd unit,
# the example config, man pages generated from the CLI definitions, and
# shell completions.
#
#   bash contrib/package.sh            -> target/packages/*.deb, *.rpm
#   PROFILE=dev bash contrib/package.sh   (faster, for tests)
#   SLURM_ROOT=DIR bash contrib/package.sh
#                                      the plugin built against DIR/usr/include
#                                      (a root of another Slurm release,
#                                      contrib/v2node/make-root.sh); default /
#
# slurmd loads only a SPANK plugin of its own major.minor (_verify_syms,
# src/common/plugin.c), and on login nodes a plugin of another series makes
# srun/sbatch fail: each package is for one Slurm series X.Y. Its version
# carries the series (deb: <version>+slurmX.Y, rpm release 1.slurmX.Y) and it
# depends on >= X.Y and << X.Y+1 of Slurm.
set -euo pipefail
cd "$(dirname "$0")/.."
PROFILE=${PROFILE:-release}
DIR=$([[ $PROFILE == dev ]] && echo debug || echo "$PROFILE")
OUT=target/packages
cargo build --locked --workspace --profile "$PROFILE"
T=target/$DIR
SLURM_ROOT=${SLURM_ROOT:-/}
num=$(awk '$1 == "#define" && $2 == "SLURM_VERSION_NUMBER" { print $3 }' "${SLURM_ROOT%/}/usr/include/slurm/slurm_version.h")
[[ $num =~ ^0x[0-9a-fA-F]+$ ]] || { echo "package.sh: no SLURM_VERSION_NUMBER under $SLURM_ROOT/usr/include" >&2; exit 1; }
major=$(((num >> 16) & 0xff)) minor=$(((num >> 8) & 0xff))
series=$(printf '%d.%02d' "$major" "$minor")
next=$(printf '%d.%02d' "$major" $((minor + 1)))
rm -rf target/assets "$OUT"
mkdir -p target/assets/man target/assets/completions "$OUT"
if [[ $SLURM_ROOT == / ]]; then
    cp "$T/libgpufence.so" target/assets/gpufence.so
else
    PROFILE=$PROFILE bash contrib/v2node/build-plugin.sh "$SLURM_ROOT" target/assets/gpufence.so 2>/dev/null
fi
"$T/gpufence" man target/assets/man
"$T/gpufence-prolog" --generate-man target/assets/man
"$T/gpufence-epilog" --generate-man target/assets/man
"$T/gpufence" completions bash >target/assets/completions/gpufence.bash
"$T/gpufence" completions zsh >target/assets/completions/_gpufence
"$T/gpufence" completions fish >target/assets/completions/gpufence.fish

command -v cargo-deb >/dev/null || { echo "package.sh: cargo-deb missing (cargo install cargo-deb)" >&2; exit 1; }
# cargo-deb maps the target/release/ prefix of asset paths to the profile's directory.
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
cargo deb -p gpufence-cli --no-build --profile "$PROFILE" -o "$OUT/gpufence.deb" --deb-version "$version+slurm$series"
# The Slurm series the plugin was built for, in the dependencies.
work=$(mktemp -d)
dpkg-deb -R "$OUT/gpufence.deb" "$work/pkg"
sed -i "s/^Depends: .*/Depends: slurmd (>= $series), slurmd (<< $next) | slurm-client (>= $series), slurm-client (<< $next)/" "$work/pkg/DEBIAN/control"
grep -q '^Depends: slurmd' "$work/pkg/DEBIAN/control" || { echo "package.sh: no Depends in the control file" >&2; exit 1; }
dpkg-deb --root-owner-group -b "$work/pkg" "$OUT/gpufence_${version}+slurm${series}_amd64.deb" >/dev/null
rm -rf "$work" "$OUT/gpufence.deb"

if command -v rpmbuild >/dev/null; then
    top=$(mktemp -d)
    rpmbuild -bb contrib/gpufence.spec \
        --define "gpufence_plugin $PWD/target/assets/gpufence.so" \
        --define "slurm_series $series" --define "slurm_next $next" \
        --define "_topdir $top" --define "_rpmdir $PWD/$OUT" \
        --define "gpufence_src $PWD" --define "gpufence_bin $PWD/$T" \
        --define "gpufence_version $version" >"$top/rpmbuild.log" 2>&1 ||
        { tail -n 30 "$top/rpmbuild.log" >&2; exit 1; }
    rm -rf "$top"
else
    echo "package.sh: rpmbuild not found, RPM not built (apt-get install rpm / dnf install rpm-build)" >&2
fi
find "$OUT" -type f -name '*.deb' -o -type f -name '*.rpm'
