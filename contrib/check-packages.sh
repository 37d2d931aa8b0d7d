#!/usr/bin/env bash
# Checks that the packages built by contrib/package.sh contain what the
# README's deploy section says they install, that each package's plugstack
# line names the plugin path of that package, and that dpkg resolves the
# .deb's dependencies as they mean:
#   - in a Debian root of the package's Slurm series (SLURM_ROOT) with
#     slurmd alone (a compute node) and with slurm-client alone (a login
#     node), dpkg -i installs it, and the root's plugstack.conf includes its
#     /etc/slurm/plugstack.conf.d/gpufence.conf;
#   - in a root of each other series at hand (this host's, those made by
#     contrib/v2node/make-root.sh under GPUFENCE_SLURM_ROOTS), dpkg -i
#     refuses it on account of slurmd or slurm-client.
# Each dpkg run is the root's own dpkg, chrooted in a throwaway overlay of
# the root (a private mount namespace, writes in a tmpfs): no root changes.
# The dpkg checks need root and a root of another series; where they cannot
# run they fail with CI=true and are skipped otherwise (with a line saying so).
#
# ARCH=arm64 checks the arm64 packages (ARCH=arm64 contrib/package.sh): the
# same contents, the plugin at Debian's aarch64 path, every binary and the
# plugin AArch64 ELF (amd64: x86-64). dpkg installs only packages of its own
# architecture, and the roots are amd64: for arm64 the dpkg checks are not
# run, the control fields that they exercise (Architecture, Depends, Breaks,
# Version) are checked as text instead, as they are for amd64.
set -euo pipefail
cd "$(dirname "$0")/.."
ARCH=${ARCH:-amd64}
case $ARCH in
amd64 | x86_64) ARCH=amd64 multiarch=x86_64-linux-gnu rpm_arch=x86_64 machine='Advanced Micro Devices X86-64' ;;
arm64 | aarch64) ARCH=arm64 multiarch=aarch64-linux-gnu rpm_arch=aarch64 machine=AArch64 ;;
*) echo "check-packages.sh: ARCH=$ARCH: amd64 (default) or arm64" >&2; exit 1 ;;
esac
deb=$(ls target/packages/gpufence_*_"$ARCH".deb)
plugin=usr/lib/$multiarch/slurm-wlm/gpufence.so
# The Slurm series of the package (SLURM_ROOT as for package.sh).
SLURM_ROOT=${SLURM_ROOT:-/}
num=$(awk '$1 == "#define" && $2 == "SLURM_VERSION_NUMBER" { print $3 }' "${SLURM_ROOT%/}/usr/include/slurm/slurm_version.h")
major=$(((num >> 16) & 0xff)) minor=$(((num >> 8) & 0xff))
series=$(printf '%d.%02d' "$major" "$minor")
next=$(printf '%d.%02d' "$major" $((minor + 1)))
fail=0
# A check that cannot run here: a failure in CI, a note elsewhere.
cannot() {
    if [[ ${CI:-} == true ]]; then
        echo "check-packages.sh: $1" >&2
        fail=1
    else
        echo "check-packages.sh: skipped: $1" >&2
    fi
}
# check_plugstack PKG TEXT PATHS: TEXT, the plugstack.conf lines PKG
# installs, has one plugin line, naming a gpufence.so that is among PATHS
# (the files PKG installs), and commented out (installing enables nothing).
check_plugstack() {
    local line path ok=0
    line=$(grep -E '^#?[[:space:]]*(required|optional)[[:space:]]' <<<"$2") || true
    if [[ -z $line || $line == *$'\n'* ]]; then
        echo "$1: its plugstack.conf lines hold no single plugin line" >&2
        return 1
    fi
    path=$(awk '{ print $2 }' <<<"${line#\#}")
    grep -qxF "$path" <<<"$3" || { echo "$1: its plugstack.conf line names $path, which it does not install" >&2; ok=1; }
    [[ $line == '#'* ]] || { echo "$1: its plugstack.conf line is not commented out: $line" >&2; ok=1; }
    return $ok
}
# check_snippet PKG TEXT: TEXT, the slurm.conf lines PKG ships, sets the
# hooks' limits with the keys of the package's series: PrologTimeout and
# EpilogTimeout on 25.05+ (and not PrologEpilogTimeout, which they
# override), PrologEpilogTimeout before (where the other two are unknown
# keys slurmd refuses); and is the file of the source tree for that series.
check_snippet() {
    local want=(PrologEpilogTimeout) not=(PrologTimeout EpilogTimeout) file=contrib/slurm.conf.snippet k ok=0
    if ((major * 100 + minor >= 2505)); then
        want=(PrologTimeout EpilogTimeout) not=(PrologEpilogTimeout) file=contrib/slurm.conf.snippet-25.05
    fi
    for k in "${want[@]}"; do
        grep -qE "^${k}=[0-9]+\$" <<<"$2" || { echo "$1: its slurm.conf.snippet does not set $k (Slurm $series)" >&2; ok=1; }
    done
    for k in "${not[@]}"; do
        ! grep -qE "^[[:space:]]*${k}[[:space:]]*=" <<<"$2" || { echo "$1: its slurm.conf.snippet sets $k, wrong for Slurm $series" >&2; ok=1; }
    done
    [[ $2 == "$(cat "$file")" ]] || { echo "$1: its slurm.conf.snippet is not $file" >&2; ok=1; }
    return $ok
}

want_deb=(
    ./usr/sbin/gpufence ./usr/sbin/gpufence-prolog ./usr/sbin/gpufence-epilog
    "./$plugin"
    ./lib/systemd/system/gpufence.service ./lib/systemd/system/gpufence-watch.service
    ./etc/slurm/gpufence.toml ./etc/logrotate.d/gpufence
    ./etc/slurm/plugstack.conf.d/gpufence.conf
    ./usr/share/man/man8/gpufence.8.gz ./usr/share/man/man8/gpufence-prolog.8.gz ./usr/share/man/man8/gpufence-epilog.8.gz
    ./usr/share/man/man8/gpufence-sweep.8.gz ./usr/share/man/man5/gpufence.toml.5.gz
    ./usr/share/bash-completion/completions/gpufence
    ./usr/share/doc/gpufence/README.md ./usr/share/doc/gpufence/SECURITY.md
    ./usr/share/doc/gpufence/examples/slurm.conf.snippet
)
list=$(dpkg-deb -c "$deb" | awk '{print $6}')
for f in "${want_deb[@]}"; do
    # cargo-deb places units in /lib or /usr/lib depending on its version
    g=${f/.\/lib\/systemd/.\/usr\/lib\/systemd}
    grep -qxF "$f" <<<"$list" || grep -qxF "$g" <<<"$list" || { echo "missing in $deb: $f" >&2; fail=1; }
done
# slurmd or slurm-client of the series, none of another (see cli/Cargo.toml).
[[ ", $(dpkg-deb -f "$deb" Depends)," == *", slurmd (>= $series~) | slurm-client (>= $series~),"* ]] ||
    { echo "$deb does not depend on slurmd or slurm-client >= $series: $(dpkg-deb -f "$deb" Depends)" >&2; fail=1; }
[[ $(dpkg-deb -f "$deb" Breaks) == "slurmd (<< $series~), slurmd (>= $next~), slurm-client (<< $series~), slurm-client (>= $next~)" ]] ||
    { echo "$deb does not break slurmd and slurm-client outside $series: $(dpkg-deb -f "$deb" Breaks)" >&2; fail=1; }
[[ $(dpkg-deb -f "$deb" Version) == *"+slurm$series" ]] || { echo "$deb: version does not name Slurm $series" >&2; fail=1; }
[[ $(dpkg-deb -f "$deb" Architecture) == "$ARCH" ]] || { echo "$deb: Architecture is $(dpkg-deb -f "$deb" Architecture), not $ARCH" >&2; fail=1; }
# Every binary and the plugin are ELF files for the package's machine.
# elf_machine PKG LABEL: the ELF file on stdin (readelf reads only files).
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
elf_machine() {
    local m
    cat >"$scratch/elf"
    m=$(readelf -h "$scratch/elf" 2>/dev/null | sed -n 's/^ *Machine: *//p') || true
    [[ $m == "$machine" ]] || { echo "$1: $2 is not an ELF file for $machine (${m:-not ELF})" >&2; return 1; }
}
for f in ./usr/sbin/gpufence ./usr/sbin/gpufence-prolog ./usr/sbin/gpufence-epilog "./$plugin"; do
    dpkg-deb --fsys-tarfile "$deb" | tar -xO "$f" | elf_machine "$deb" "$f" || fail=1
done
# The plugin inside declares the series (plugin_version, checked by slurmd).
pv=$(dpkg-deb --fsys-tarfile "$deb" | tar -xO "./$plugin" | od -An -tx1 -v | tr -s ' \n' '  ' |
    grep -o "$(printf ' %02x %02x 00' "$minor" "$major")" | head -1) || true
[[ -n $pv ]] || { echo "$deb: its gpufence.so holds no Slurm $series version word" >&2; fail=1; }
conffiles=$(dpkg-deb --ctrl-tarfile "$deb" | tar -xO ./conffiles)
for f in /etc/slurm/gpufence.toml /etc/slurm/plugstack.conf.d/gpufence.conf; do
    grep -qxF "$f" <<<"$conffiles" || { echo "$deb: $f is not a conffile" >&2; fail=1; }
done
check_plugstack "$deb" "$(dpkg-deb --fsys-tarfile "$deb" | tar -xO ./etc/slurm/plugstack.conf.d/gpufence.conf 2>/dev/null)" "$(sed 's|^\.||' <<<"$list")" || fail=1
check_snippet "$deb" "$(dpkg-deb --fsys-tarfile "$deb" | tar -xO ./usr/share/doc/gpufence/examples/slurm.conf.snippet 2>/dev/null)" || fail=1

if compgen -G "target/packages/$rpm_arch/gpufence-*.rpm" >/dev/null; then
    rpm=$(ls target/packages/"$rpm_arch"/gpufence-*.rpm)
    [[ $(rpm -qp --qf '%{ARCH}' "$rpm" 2>/dev/null) == "$rpm_arch" ]] || { echo "$rpm: its architecture is not $rpm_arch" >&2; fail=1; }
    for f in ./usr/sbin/gpufence ./usr/sbin/gpufence-prolog ./usr/sbin/gpufence-epilog ./usr/lib64/slurm/gpufence.so; do
        # shellcheck disable=SC2094 # elf_machine only names $rpm
        rpm2archive -n - <"$rpm" | tar -xO "$f" | elf_machine "$rpm" "$f" || fail=1
    done
    rlist=$(rpm -qlp "$rpm" 2>/dev/null)
    for f in /usr/sbin/gpufence /usr/sbin/gpufence-prolog /usr/sbin/gpufence-epilog /usr/lib64/slurm/gpufence.so \
        /usr/lib/systemd/system/gpufence.service /usr/lib/systemd/system/gpufence-sweep.timer /etc/slurm/gpufence.toml \
        /usr/share/man/man8/gpufence.8.gz /usr/share/man/man5/gpufence.toml.5.gz /usr/share/doc/gpufence/examples/plugstack.conf; do
        grep -qxF "$f" <<<"$rlist" || { echo "missing in $rpm: $f" >&2; fail=1; }
    done
    rpm -qcp "$rpm" 2>/dev/null | grep -qx /etc/slurm/gpufence.toml || { echo "config is not %config in $rpm" >&2; fail=1; }
    # Installable on login nodes too: the base slurm package, not slurmd.
    rpm -qRp "$rpm" 2>/dev/null | grep -qx "slurm >= $series" || { echo "$rpm does not require slurm >= $series" >&2; fail=1; }
    rpm -qRp "$rpm" 2>/dev/null | grep -qx "slurm < $next" || { echo "$rpm does not require slurm < $next" >&2; fail=1; }
    [[ $(rpm -qp --qf '%{RELEASE}' "$rpm" 2>/dev/null) == 1.slurm"$series"* ]] || { echo "$rpm: release does not name Slurm $series" >&2; fail=1; }
    ! rpm -qRp "$rpm" 2>/dev/null | grep -q slurmd || { echo "$rpm requires slurmd (login nodes have none)" >&2; fail=1; }
    # The example names the RPM's plugin path (Slurm's RPMs: /usr/lib64/slurm).
    check_plugstack "$rpm" "$(rpm2archive -n - <"$rpm" | tar -xO ./usr/share/doc/gpufence/examples/plugstack.conf 2>/dev/null)" "$rlist" || fail=1
    check_snippet "$rpm" "$(rpm2archive -n - <"$rpm" | tar -xO ./usr/share/doc/gpufence/examples/slurm.conf.snippet 2>/dev/null)" || fail=1
fi

# root_series ROOT: the Slurm series of ROOT's slurmd and slurm-client when
# dpkg has both installed there, else nothing.
root_series() {
    local v s=() p
    for p in slurmd slurm-client; do
        v=$(dpkg-query --admindir="${1%/}/var/lib/dpkg" -W -f '${db:Status-Status} ${Version}' "$p" 2>/dev/null) || return 0
        [[ $v =~ ^installed\ ([0-9]+:)?([0-9]+)\.([0-9]+) ]] || return 0
        s+=("$(printf '%d.%02d' "${BASH_REMATCH[2]}" "$((10#${BASH_REMATCH[3]}))")")
    done
    if [[ ${s[0]} == "${s[1]}" ]]; then echo "${s[0]}"; fi
}
# deb_install ROOT KEEP LOG: dpkg -i of the .deb in a throwaway overlay of
# ROOT, chrooted, after dpkg has removed those of slurmctld, slurmd and
# slurm-client that KEEP (one of them, or "all") does not name. Their
# maintainer scripts are not run: they would stop daemons and cancel jobs,
# and only dpkg's record of what is installed matters here. After an install,
# also checks that dpkg calls gpufence installed and that the root's
# plugstack.conf includes gpufence.conf. Output in LOG; fails as dpkg does.
deb_install() {
    local tmp rc=0
    tmp=$(mktemp -d)
    unshare --mount --propagation private -- bash -euo pipefail -c '
        root=$1 keep=$2 deb=$3 top=$4 m=$4/root
        mount -t tmpfs -o mode=0755 gpufence-check "$top"
        mkdir "$top/upper" "$top/work" "$m"
        mount -t overlay overlay -o "lowerdir=$root,upperdir=$top/upper,workdir=$top/work" "$m"
        mount --rbind /dev "$m/dev"
        mount -t proc proc "$m/proc"
        drop=()
        for p in slurmctld slurmd slurm-client; do
            [[ $keep == all || $p == "$keep" ]] || drop+=("$p")
        done
        if ((${#drop[@]})); then
            for p in "${drop[@]}"; do rm -f "$m/var/lib/dpkg/info/$p.prerm" "$m/var/lib/dpkg/info/$p.postrm"; done
            chroot "$m" dpkg --no-triggers --remove "${drop[@]}" >/dev/null
        fi
        cp "$deb" "$m/tmp/gpufence.deb"
        chroot "$m" dpkg --no-triggers -i /tmp/gpufence.deb
        [[ $(chroot "$m" dpkg-query -W -f "\${db:Status-Status}" gpufence) == installed ]] ||
            { echo "dpkg does not call gpufence installed"; exit 1; }
        chroot "$m" bash -c "
            while read -r word paths; do
                [[ \$word == include ]] || continue
                for f in \$paths; do [[ \$f == /etc/slurm/plugstack.conf.d/gpufence.conf ]] && exit 0; done
            done </etc/slurm/plugstack.conf
            exit 1" || { echo "/etc/slurm/plugstack.conf includes no /etc/slurm/plugstack.conf.d/gpufence.conf"; exit 1; }
    ' _ "$1" "$2" "$PWD/$deb" "$tmp" >"$3" 2>&1 || rc=$?
    rmdir "$tmp"
    return $rc
}
dpkg_checks=
if [[ $ARCH != amd64 ]]; then
    dpkg_checks="; dpkg: not run for $ARCH (the roots are amd64), its control fields checked as text"
elif ((EUID != 0)); then
    cannot "dpkg checks need root (they mount an overlay of each Debian root)"
elif [[ $(root_series "$SLURM_ROOT") != "$series" ]]; then
    cannot "dpkg checks: $SLURM_ROOT has no slurmd and slurm-client of Slurm $series installed"
else
    logs=$(mktemp -d)
    trap 'rm -rf "$logs" "$scratch"' EXIT
    for keep in slurmd slurm-client; do
        deb_install "$SLURM_ROOT" "$keep" "$logs/$keep" ||
            { echo "$deb: dpkg -i failed in $SLURM_ROOT with $keep $series alone:" >&2; tail -n 15 "$logs/$keep" >&2; fail=1; }
    done
    # Roots of other series: this host and make-root.sh's.
    others=() refused=()
    declare -A seen=(["$(realpath "$SLURM_ROOT")"]=1)
    for r in / "${GPUFENCE_SLURM_ROOTS:-/var/cache/gpufence/roots}"/*/; do
        [[ -d $r ]] || continue
        r=$(realpath "$r")
        [[ -z ${seen[$r]:-} ]] || continue
        seen[$r]=1
        other=$(root_series "$r")
        [[ -n $other && $other != "$series" ]] || continue
        others+=("$other")
        if deb_install "$r" all "$logs/other"; then
            echo "$deb: dpkg -i installed it in $r, with Slurm $other" >&2
            fail=1
        elif ! grep -qE 'slurmd|slurm-client' "$logs/other"; then
            echo "$deb: dpkg -i in $r (Slurm $other) failed, but not on account of slurmd or slurm-client:" >&2
            tail -n 15 "$logs/other" >&2
            fail=1
        else
            refused+=("$other")
        fi
    done
    if ((${#others[@]} == 0)); then
        cannot "dpkg checks: no Debian root of another Slurm series (contrib/v2node/make-root.sh)"
    fi
    dpkg_checks="; dpkg: installs with slurmd $series alone and slurm-client $series alone, refused with Slurm ${refused[*]:-(none)}"
fi
((fail == 0)) && echo "packages: ok ($(basename "$deb")${rpm:+, $(basename "$rpm")}$dpkg_checks)"
exit $fail
