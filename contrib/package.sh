#!/usr/bin/env bash
# Builds gpufence's packages: a Debian package (cargo deb, metadata in
# cli/Cargo.toml) and, where rpmbuild exists, an RPM (contrib/gpufence.spec).
# Both contain the same files, staged once in target/release/package-stage/:
# binaries, the SPANK plugin, the plugstack.conf line (commented out), the
# systemd units, the example config, man pages generated from the CLI
# definitions, and shell completions. Prints the path of each package built,
# nothing else on stdout.
#
#   bash contrib/package.sh            -> target/packages/*.deb, x86_64/*.rpm
#   PROFILE=dev bash contrib/package.sh   (faster, for tests)
#   SLURM_ROOT=DIR bash contrib/package.sh
#                                      the plugin built against DIR/usr/include
#                                      (a root of another Slurm release,
#                                      contrib/v2node/make-root.sh); default /
#
# slurmd loads only a SPANK plugin of its own major.minor (_verify_syms,
# src/common/plugin.c), and on login nodes a plugin of another series makes
# srun/sbatch fail: each package is for one Slurm series X.Y. Its version
# carries the series (deb: <version>+slurmX.Y, rpm release 1.slurmX.Y). The
# .deb depends on slurmd or slurm-client >= X.Y and breaks both outside X.Y;
# the RPM requires slurm >= X.Y, < X.Y+1.
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
command -v cargo-deb >/dev/null || { echo "package.sh: cargo-deb missing (cargo install cargo-deb)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The staged files, for both packages. cargo-deb takes them from here
# whatever profile built them ("target/release/" is its name for the build's
# output directory), run without --profile: it warns that dev profiles will
# be refused, and about assets elsewhere under target/.
stage=target/release/package-stage
rm -rf "$stage" "$OUT"
mkdir -p "$stage/man" "$stage/completions" "$OUT"
cp "$T/gpufence" "$T/gpufence-prolog" "$T/gpufence-epilog" "$stage/"
if [[ $SLURM_ROOT == / ]]; then
    cp "$T/libgpufence.so" "$stage/gpufence.so"
else
    PROFILE=$PROFILE bash contrib/v2node/build-plugin.sh "$SLURM_ROOT" "$stage/gpufence.so" 2>"$work/plugin.log" ||
        { cat "$work/plugin.log" >&2; exit 1; }
fi
"$T/gpufence" man "$stage/man"
"$T/gpufence-prolog" --generate-man "$stage/man"
"$T/gpufence-epilog" --generate-man "$stage/man"
# cargo-deb compresses man pages only outside the build's output directory.
gzip -9n "$stage"/man/*.8 "$stage"/man/*.5
"$T/gpufence" completions bash >"$stage/completions/gpufence.bash"
"$T/gpufence" completions zsh >"$stage/completions/_gpufence"
"$T/gpufence" completions fish >"$stage/completions/gpufence.fish"
# The Debian package's plugstack.conf.d/gpufence.conf names its plugin path
# (the RPM's spec makes its own example from the same template).
deb_plugin=/$(sed -n 's|^ *\["target/release/package-stage/gpufence.so", "\([^"]*\)".*|\1|p' cli/Cargo.toml)
[[ $deb_plugin == /usr/*/gpufence.so ]] || { echo "package.sh: no plugin asset in cli/Cargo.toml" >&2; exit 1; }
sed "s|@GPUFENCE_PLUGIN@|$deb_plugin|g" contrib/plugstack.conf.in >"$stage/plugstack.conf"

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
# --fast: this .deb is only unpacked again, to fill in the Slurm series.
cargo deb -p gpufence-cli --no-build --fast -o "$work/cargo-deb.deb" --deb-version "$version+slurm$series" >/dev/null
dpkg-deb -R "$work/cargo-deb.deb" "$work/pkg"
sed -i "s/@SLURM_SERIES@/$series/g; s/@SLURM_NEXT@/$next/g" "$work/pkg/DEBIAN/control"
grep -q "^Breaks: slurmd (<< $series~)" "$work/pkg/DEBIAN/control" && ! grep -q @SLURM_ "$work/pkg/DEBIAN/control" ||
    { echo "package.sh: the control file's Slurm relations are not those of cli/Cargo.toml" >&2; exit 1; }
deb=$OUT/gpufence_${version}+slurm${series}_amd64.deb
dpkg-deb --root-owner-group -b "$work/pkg" "$deb" >/dev/null

rpm=
if command -v rpmbuild >/dev/null; then
    rpmbuild -bb contrib/gpufence.spec \
        --define "slurm_series $series" --define "slurm_next $next" \
        --define "_topdir $work/rpm" --define "_rpmdir $PWD/$OUT" \
        --define "gpufence_src $PWD" --define "gpufence_stage $PWD/$stage" \
        --define "gpufence_version $version" >"$work/rpmbuild.log" 2>&1 ||
        { tail -n 30 "$work/rpmbuild.log" >&2; exit 1; }
    rpm=$(sed -n "s|^Wrote: $PWD/||p" "$work/rpmbuild.log")
else
    echo "package.sh: rpmbuild not found, RPM not built (apt-get install rpm / dnf install rpm-build)" >&2
fi
printf '%s\n' "$deb" ${rpm:+"$rpm"}
