#!/usr/bin/env bash
# make-root.sh SUITE DIR: a Debian root with another release's Slurm in DIR,
# for real cgroup/v2 nodes of that release on this machine (test.sh, the
# tests and the demo run its daemons chrooted through v2node/chroot.sh).
#
#   trixie (Debian 13): Slurm 24.11     sid: Slurm 26.05 (as of 2026-12)
#
# debootstrap --variant=minbase, then slurmd slurmctld slurm-client munge
# libslurm-dev (the plugin is built against the root's own headers) and the
# few tools cluster.sh uses. Idempotent: a DIR that holds a finished root
# (DIR/.gpufence-root names the suite) is left as it is. The packages come
# from the Debian mirror this machine's apt uses. Both steps run in a
# private mount namespace: they mount proc in the target. Needs root.
set -euo pipefail

suite=${1:?usage: make-root.sh SUITE DIR}
dir=${2:?usage: make-root.sh SUITE DIR}
stamp="$dir/.gpufence-root"
pkgs=(slurmd slurmctld slurm-client munge libslurm-dev procps hostname)

if [[ -f $stamp && $(cat "$stamp") == "$suite ${pkgs[*]}" ]]; then
    exit 0
fi
((EUID == 0)) || { echo "make-root.sh: run as root" >&2; exit 1; }

# The mirror of the host's own Debian sources (deb822 or one-line form).
mirror=$(
    { cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '/^URIs:/ { print $2 }'
      cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
          awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { print $i; break } }'
    } | grep -v -- '-security' | head -n 1
) || true
[[ -n $mirror ]] || { echo "make-root.sh: no Debian mirror in this machine's apt sources" >&2; exit 1; }

if ! command -v debootstrap >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap >/dev/null
fi

rm -rf "$dir"
mkdir -p "$dir"
echo "make-root.sh: debootstrap $suite into $dir (about half a minute)" >&2
unshare --mount --propagation private -- \
    debootstrap --variant=minbase --keyring=/usr/share/keyrings/debian-archive-keyring.gpg \
    "$suite" "$dir" "$mirror" >"$dir.debootstrap.log" 2>&1 ||
    { tail -n 20 "$dir.debootstrap.log" >&2; exit 1; }
# No service starts from the packages' scripts (there is no init in a chroot).
printf '#!/bin/sh\nexit 101\n' >"$dir/usr/sbin/policy-rc.d"
chmod 0755 "$dir/usr/sbin/policy-rc.d"
unshare --mount --propagation private -- bash -c '
    set -e
    mount -t proc proc "$1/proc"
    chroot "$1" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${@:2}"
' _ "$dir" "${pkgs[@]}" >"$dir.packages.log" 2>&1 ||
    { tail -n 20 "$dir.packages.log" >&2; exit 1; }
chroot "$dir" apt-get clean
echo "$suite ${pkgs[*]}" >"$stamp"
