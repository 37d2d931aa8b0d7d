#!/usr/bin/env bash
# Builds gpufence's packages: a Debian package (cargo deb, metadata in
# cli/Cargo.toml) and, where rpmbuild exists, an RPM (contrib/gpufence.spec).
# Both contain the same files, staged once in target/release/package-stage/:
# binaries, the SPANK plugin, the plugstack.conf line (commented out), the
# systemd units, the example config, man pages generated from the CLI
# definitions, and shell completions. Prints the path of each package built,
# nothing else on stdout.
#
#   bash contrib/package.sh            -> target/packages/*_amd64.deb, x86_64/*.rpm
#   ARCH=arm64 bash contrib/package.sh -> target/packages/*_arm64.deb, aarch64/*.rpm
#                                      for Grace (GB200/GB300) nodes, cross-built
#                                      on an x86_64 host (contrib/setup.sh
#                                      installs the target, the cross gcc and
#                                      libc, qemu-user); the plugin from the
#                                      same Slurm headers, through
#                                      contrib/v2node/build-plugin.sh
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
SLURM_ROOT=${SLURM_ROOT:-/}
ARCH=${ARCH:-amd64}
# run: how this host runs the package's binaries (man pages, completions).
case $ARCH in
amd64 | x86_64)
    ARCH=amd64
    cargo build --locked --workspace --profile "$PROFILE"
    T=target/$DIR multiarch=x86_64-linux-gnu rpm_arch=x86_64 run=()
    # The files cargo-deb takes ("target/release/" is its name for the build's output directory).
    stage=target/release/package-stage
    ;;
arm64 | aarch64)
    ARCH=arm64
    # Only the three binaries, built once for every series: the plugin comes
    # from build-plugin.sh, per series. Both in build-plugin.sh's target
    # dir, target/slurm-plugins: the plugin's aarch64 dependencies are most
    # of the binaries', and the workspace's own build is left alone.
    # cargo-deb takes the files from target/<triple>/release/ when given
    # --target.
    triple=aarch64-unknown-linux-gnu multiarch=aarch64-linux-gnu rpm_arch=aarch64
    command -v qemu-aarch64 >/dev/null || { echo "package.sh: ARCH=arm64 needs qemu-aarch64 (apt-get install qemu-user, or bash contrib/setup.sh)" >&2; exit 1; }
    run=(qemu-aarch64 -L /usr/aarch64-linux-gnu)
    CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=${CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER:-aarch64-linux-gnu-gcc} \
        cargo build --locked --profile "$PROFILE" --target "$triple" --target-dir target/slurm-plugins \
        -p gpufence-cli -p gpufence-prolog -p gpufence-epilog
    T=target/slurm-plugins/$triple/$DIR
    stage=target/$triple/release/package-stage
    ;;
*)
    echo "package.sh: ARCH=$ARCH: amd64 (default) or arm64" >&2
    exit 1
    ;;
esac
num=$(awk '$1 == "#define" && $2 == "SLURM_VERSION_NUMBER" { print $3 }' "${SLURM_ROOT%/}/usr/include/slurm/slurm_version.h")
[[ $num =~ ^0x[0-9a-fA-F]+$ ]] || { echo "package.sh: no SLURM_VERSION_NUMBER under $SLURM_ROOT/usr/include" >&2; exit 1; }
major=$(((num >> 16) & 0xff)) minor=$(((num >> 8) & 0xff))
series=$(printf '%d.%02d' "$major" "$minor")
next=$(printf '%d.%02d' "$major" $((minor + 1)))
command -v cargo-deb >/dev/null || { echo "package.sh: cargo-deb missing (cargo install cargo-deb)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The staged files, for both packages. cargo-deb takes them from here
# whatever profile built them, run without --profile: it warns that dev
# profiles will be refused, and about assets elsewhere under target/.
# Packages of the other architecture stay in $OUT.
rm -rf "$stage" "${OUT:?}/${rpm_arch:?}"
rm -f "$OUT"/gpufence_*_"$ARCH".deb
mkdir -p "$stage/man" "$stage/completions" "$OUT"
cp "$T/gpufence" "$T/gpufence-prolog" "$T/gpufence-epilog" "$stage/"
if [[ $SLURM_ROOT == / && $ARCH == amd64 ]]; then
    cp "$T/libgpufence.so" "$stage/gpufence.so"
else
    ARCH=$ARCH PROFILE=$PROFILE bash contrib/v2node/build-plugin.sh "$SLURM_ROOT" "$stage/gpufence.so" 2>"$work/plugin.log" ||
        { cat "$work/plugin.log" >&2; exit 1; }
fi
"${run[@]}" "$T/gpufence" man "$stage/man"
"${run[@]}" "$T/gpufence-prolog" --generate-man "$stage/man"
"${run[@]}" "$T/gpufence-epilog" --generate-man "$stage/man"
# cargo-deb compresses man pages only outside the build's output directory.
gzip -9n "$stage"/man/*.8 "$stage"/man/*.5
"${run[@]}" "$T/gpufence" completions bash >"$stage/completions/gpufence.bash"
"${run[@]}" "$T/gpufence" completions zsh >"$stage/completions/_gpufence"
"${run[@]}" "$T/gpufence" completions fish >"$stage/completions/gpufence.fish"
# The Debian package's plugstack.conf.d/gpufence.conf names its plugin path
# (the RPM's spec makes its own example from the same template): the asset
# of cli/Cargo.toml in this architecture's multiarch directory (arm64: its
# cargo-deb variant's).
deb_plugin=/$(sed -n "s|^ *\\[\"target/release/package-stage/gpufence.so\", \"\\(usr/lib/$multiarch/[^\"]*\\)\".*|\\1|p" cli/Cargo.toml)
[[ $deb_plugin == /usr/lib/"$multiarch"/*/gpufence.so ]] || { echo "package.sh: no $ARCH plugin asset in cli/Cargo.toml" >&2; exit 1; }
sed "s|@GPUFENCE_PLUGIN@|$deb_plugin|g" contrib/plugstack.conf.in >"$stage/plugstack.conf"
# The series' slurm.conf lines: a limit per hook (PrologTimeout,
# EpilogTimeout) from 25.05, which has them; PrologEpilogTimeout before,
# where they are unknown keys that slurmd refuses.
snippet=contrib/slurm.conf.snippet
((major * 100 + minor >= 2505)) && snippet=contrib/slurm.conf.snippet-25.05
cp "$snippet" "$stage/slurm.conf.snippet"

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
# --fast: this .deb is only unpacked again, to fill in the Slurm series.
# arm64: cargo-deb's variant (the plugin's path) and target (Architecture,
# the target/<triple>/release/ files, $auto resolved with the cross libc's
# shlibs, which name libc6:arm64: the qualifier is dropped, an arm64
# package's libc6 is arm64's).
cross=()
[[ $ARCH == amd64 ]] || cross=(--variant "$ARCH" --target "$triple")
cargo deb -p gpufence-cli "${cross[@]}" --no-build --fast -o "$work/cargo-deb.deb" --deb-version "$version+slurm$series" >/dev/null
dpkg-deb -R "$work/cargo-deb.deb" "$work/pkg"
sed -i "s/@SLURM_SERIES@/$series/g; s/@SLURM_NEXT@/$next/g" "$work/pkg/DEBIAN/control"
[[ $ARCH == amd64 ]] || sed -i "/^Depends:/ s/:$ARCH\b//g" "$work/pkg/DEBIAN/control"
grep -q "^Breaks: slurmd (<< $series~)" "$work/pkg/DEBIAN/control" && ! grep -q @SLURM_ "$work/pkg/DEBIAN/control" ||
    { echo "package.sh: the control file's Slurm relations are not those of cli/Cargo.toml" >&2; exit 1; }
[[ $(sed -n 's/^Architecture: //p' "$work/pkg/DEBIAN/control") == "$ARCH" ]] ||
    { echo "package.sh: cargo-deb made no $ARCH package" >&2; exit 1; }
deb=$OUT/gpufence_${version}+slurm${series}_${ARCH}.deb
dpkg-deb --root-owner-group -b "$work/pkg" "$deb" >/dev/null

rpm=
if command -v rpmbuild >/dev/null; then
    # arm64: --target aarch64, the package's architecture (%{_libdir} is /usr/lib64 there too).
    rpm_cross=()
    [[ $ARCH == amd64 ]] || rpm_cross=(--target "$rpm_arch")
    rpmbuild -bb contrib/gpufence.spec "${rpm_cross[@]}" \
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
