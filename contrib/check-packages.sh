#!/usr/bin/env bash
# Checks that the packages built by contrib/package.sh contain what the
# README's deploy section says they install.
set -euo pipefail
cd "$(dirname "$0")/.."
deb=$(ls target/packages/gpufence_*.deb)
# The Slurm series of the package (SLURM_ROOT as for package.sh).
SLURM_ROOT=${SLURM_ROOT:-/}
num=$(awk '$1 == "#define" && $2 == "SLURM_VERSION_NUMBER" { print $3 }' "${SLURM_ROOT%/}/usr/include/slurm/slurm_version.h")
major=$(((num >> 16) & 0xff)) minor=$(((num >> 8) & 0xff))
series=$(printf '%d.%02d' "$major" "$minor")
next=$(printf '%d.%02d' "$major" $((minor + 1)))
want_deb=(
    ./usr/sbin/gpufence ./usr/sbin/gpufence-prolog ./usr/sbin/gpufence-epilog
    ./usr/lib/x86_64-linux-gnu/slurm-wlm/gpufence.so
    ./lib/systemd/system/gpufence.service
    ./etc/slurm/gpufence.toml ./etc/logrotate.d/gpufence
    ./usr/share/man/man1/gpufence.1.gz ./usr/share/man/man1/gpufence-prolog.1.gz ./usr/share/man/man1/gpufence-epilog.1.gz
    ./usr/share/man/man1/gpufence-sweep.1.gz
    ./usr/share/bash-completion/completions/gpufence
    ./usr/share/doc/gpufence/README.md ./usr/share/doc/gpufence/SECURITY.md
)
list=$(dpkg-deb -c "$deb" | awk '{print $6}')
fail=0
for f in "${want_deb[@]}"; do
    # cargo-deb places units in /lib or /usr/lib depending on its version
    g=${f/.\/lib\/systemd/.\/usr\/lib\/systemd}
    grep -qxF "$f" <<<"$list" || grep -qxF "$g" <<<"$list" || { echo "missing in $deb: $f" >&2; fail=1; }
done
[[ $(dpkg-deb -f "$deb" Depends) == "slurmd (>= $series), slurmd (<< $next) | slurm-client (>= $series), slurm-client (<< $next)" ]] \
    || { echo "$deb does not depend on slurmd or slurm-client of series $series only: $(dpkg-deb -f "$deb" Depends)" >&2; fail=1; }
[[ $(dpkg-deb -f "$deb" Version) == *"+slurm$series" ]] || { echo "$deb: version does not name Slurm $series" >&2; fail=1; }
# The plugin inside declares the series (plugin_version, checked by slurmd).
pv=$(dpkg-deb --fsys-tarfile "$deb" | tar -xO ./usr/lib/x86_64-linux-gnu/slurm-wlm/gpufence.so | od -An -tx1 -v | tr -s ' \n' '  ' |
    grep -o "$(printf ' %02x %02x 00' "$minor" "$major")" | head -1) || true
[[ -n $pv ]] || { echo "$deb: its gpufence.so holds no Slurm $series version word" >&2; fail=1; }
grep -qx '/etc/slurm/gpufence.toml' <(dpkg-deb --ctrl-tarfile "$deb" | tar -xO ./conffiles) || { echo "config is not a conffile" >&2; fail=1; }
if compgen -G "target/packages/x86_64/gpufence-*.rpm" >/dev/null; then
    rpm=$(ls target/packages/x86_64/gpufence-*.rpm)
    rlist=$(rpm -qlp "$rpm" 2>/dev/null)
    for f in /usr/sbin/gpufence /usr/sbin/gpufence-prolog /usr/sbin/gpufence-epilog /usr/lib64/slurm/gpufence.so \
        /usr/lib/systemd/system/gpufence.service /usr/lib/systemd/system/gpufence-sweep.timer /etc/slurm/gpufence.toml /usr/share/man/man1/gpufence.1; do
        grep -qxF "$f" <<<"$rlist" || { echo "missing in $rpm: $f" >&2; fail=1; }
    done
    rpm -qcp "$rpm" 2>/dev/null | grep -qx /etc/slurm/gpufence.toml || { echo "config is not %config in $rpm" >&2; fail=1; }
    # Installable on login nodes too: the base slurm package, not slurmd.
    rpm -qRp "$rpm" 2>/dev/null | grep -qx "slurm >= $series" || { echo "$rpm does not require slurm >= $series" >&2; fail=1; }
    rpm -qRp "$rpm" 2>/dev/null | grep -qx "slurm < $next" || { echo "$rpm does not require slurm < $next" >&2; fail=1; }
    [[ $(rpm -qp --qf '%{RELEASE}' "$rpm" 2>/dev/null) == 1.slurm"$series"* ]] || { echo "$rpm: release does not name Slurm $series" >&2; fail=1; }
    ! rpm -qRp "$rpm" 2>/dev/null | grep -q slurmd || { echo "$rpm requires slurmd (login nodes have none)" >&2; fail=1; }
fi
((fail == 0)) && echo "packages: ok ($(basename "$deb")${rpm:+, $(basename "$rpm")})"
exit $fail

