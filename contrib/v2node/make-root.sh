#!/usr/bin/env bash
# make-root.sh SUITE DIR: a Debian root with another release's Slurm in DIR,
# for real cgroup/v2 nodes of that release on this machine (test.sh, the
# tests and the demo run its daemons in it through v2node/chroot.sh).
#
#   trixie (Debian 13): Slurm 24.11     sid: Slurm 26.05 (as of 2026-12)
#
# debootstrap --variant=minbase, then slurmd slurmctld slurm-client munge
# libslurm-dev (the plugin is built against the root's own headers), the
# few tools cluster.sh uses, and the container runtimes jobs run
# (tests/tests/e2e_containers.rs): rootless Podman with crun (uidmap gives
# the setuid newuidmap/newgidmap it maps the user's /etc/subuid range
# with), and Apptainer where the suite ships it (sid, not trixie, as of
# 2026-12). Nothing else Podman recommends is needed there: the tests run
# a directory rootfs (--rootfs: no image store, so no fuse-overlayfs) with
# --network=none (no passt/slirp4netns).
#
# Idempotent: a DIR that holds a finished root of SUITE with these
# packages (DIR/.gpufence-root names the suite and the package lists) is
# left as it is; one of SUITE with other packages gets them installed in
# place (a running node of that root goes on running). The packages come
# from the Debian mirror this machine's apt uses. Every step runs in a
# private mount namespace: they mount proc in the target. Needs root.
set -euo pipefail

suite=${1:?usage: make-root.sh SUITE DIR}
dir=${2:?usage: make-root.sh SUITE DIR}
stamp="$dir/.gpufence-root"
pkgs=(slurmd slurmctld slurm-client munge libslurm-dev procps hostname podman crun uidmap)
# Installed where the suite has them (apt-cache in the root says).
optional=(apptainer)
want="$suite ${pkgs[*]} optional: ${optional[*]}"

if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
    exit 0
fi
((EUID == 0)) || { echo "make-root.sh: run as root" >&2; exit 1; }

# install: the packages (and the optional ones the suite ships) into DIR.
install() {
    unshare --mount --propagation private -- bash -c '
        set -e
        mount -t proc proc "$1/proc"
        have=()
        for p in "${@:2}"; do
            case $p in
            optional:) opt=1 ;;
            *)
                if [[ -z ${opt:-} ]] || chroot "$1" apt-cache show "$p" >/dev/null 2>&1; then
                    have+=("$p")
                fi ;;
            esac
        done
        chroot "$1" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${have[@]}"
    ' _ "$dir" "${pkgs[@]}" optional: "${optional[@]}"
}

# A finished root of this suite with other packages: add them in place.
if [[ -f $stamp && $(cut -d' ' -f1 "$stamp") == "$suite" ]]; then
    echo "make-root.sh: installing ${pkgs[*]} (and ${optional[*]} where shipped) in $dir" >&2
    install >"$dir.packages.log" 2>&1 ||
        { tail -n 20 "$dir.packages.log" >&2; exit 1; }
    chroot "$dir" apt-get clean
    echo "$want" >"$stamp"
    exit 0
fi

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
install >"$dir.packages.log" 2>&1 ||
    { tail -n 20 "$dir.packages.log" >&2; exit 1; }
chroot "$dir" apt-get clean
echo "$want" >"$stamp"
