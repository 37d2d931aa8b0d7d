#!/usr/bin/env bash
# enter.sh SHIM CMD...: run CMD (slurmd) as on a systemd-managed pure
# cgroup v2 node, even on a hybrid-cgroup host.
#
# - Pure cgroup v2 host (cgroup2 at /sys/fs/cgroup): CMD runs as it is.
# - Hybrid host (cgroup v1 controllers under /sys/fs/cgroup/<ctrl>, cgroup2
#   elsewhere, e.g. /sys/fs/cgroup/unified on Debian 12): in a private mount
#   namespace (the host's mounts stay as they are), every mount under
#   /sys/fs/cgroup is unmounted and cgroup2 is mounted at /sys/fs/cgroup, so
#   Slurm's cgroup/v2 plugin finds a pure v2 tree; SHIM (an LD_PRELOAD
#   library built from proc-cgroup-v2only.c) hides the v1 lines of
#   /proc/<pid>/cgroup, on which Slurm would otherwise die ("Hybrid mode is
#   not supported"). slurmstepd inherits both from slurmd; job tasks get the
#   job's environment, without SHIM.
#
# Either way CMD gets INVOCATION_ID, as systemd sets it for a service:
# without it Slurm moves slurmd out of the cgroup it was started in
# (_migrate_to_stepd_scope in src/plugins/cgroup/v2/cgroup_v2.c, 22.05+).
# The caller places this script's process in the cgroup slurmd must run
# in (system.slice/slurmd.service) before running it.
#
# Test and demo harness only; needs root.
set -euo pipefail

shim=${1:?usage: enter.sh SHIM CMD...}
shift
(($#)) || { echo "usage: enter.sh SHIM CMD..." >&2; exit 2; }

fstype() { stat -f -c %T "$1" 2>/dev/null; }

# GPUFENCE_V2NODE_CGROUPNS=1: slurmd in a container (Kubernetes-hosted
# Slurm, any `unshare --cgroup`): the cgroup the caller placed this
# process in becomes the root of a new cgroup namespace, cgroup2 is mounted
# at /sys/fs/cgroup inside it (paths there are relative to that root, while
# the kernel counts cgroup levels from the true root), and slurmd runs in
# system.slice/slurmd.service below it, as systemd would run it in the
# container.
#
# Slurm 23.11+ also reads /proc/1/cgroup for the root of its tree; pid 1
# (this host's init) is outside the namespace, where a container's init
# would be at its root: SHIM then answers it as the root (see
# proc-cgroup-v2only.c), on a pure cgroup v2 host too.
if [[ ${GPUFENCE_V2NODE_CGROUPNS:-} == 1 ]]; then
    if [[ ${GPUFENCE_V2NODE_INSIDE:-} != 1 ]]; then
        # In v2node/chroot.sh's root the namespace chroot.sh made is
        # private already, and the new one copies it: its propagation is
        # left as it is.
        prop=private
        [[ ${GPUFENCE_CHROOTED:-} == 1 ]] && prop=unchanged
        exec env GPUFENCE_V2NODE_INSIDE=1 unshare --mount --cgroup --propagation "$prop" -- "$0" "$shim" "$@"
    fi
    unset GPUFENCE_V2NODE_INSIDE GPUFENCE_V2NODE_CGROUPNS
    mapfile -t mounts < <(awk '$5 == "/sys/fs/cgroup" || index($5, "/sys/fs/cgroup/") == 1 { print $5 }' /proc/self/mountinfo | sort -r -u)
    for m in "${mounts[@]}"; do
        umount -l "$m"
    done
    mount -t cgroup2 cgroup2 /sys/fs/cgroup
    mkdir -p /sys/fs/cgroup/system.slice/slurmd.service
    echo $$ >/sys/fs/cgroup/system.slice/slurmd.service/cgroup.procs
    invocation=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
    if grep -qv '^0::' /proc/self/cgroup || grep -q '^0::/\.\.' /proc/1/cgroup; then
        [[ -r $shim ]] || { echo "enter.sh: $shim is missing" >&2; exit 1; }
        exec env INVOCATION_ID="$invocation" LD_PRELOAD="$shim" "$@"
    fi
    exec env INVOCATION_ID="$invocation" "$@"
fi

invocation=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')

# The kernel lists v1 hierarchies in /proc/<pid>/cgroup whatever the mount
# namespace: a hybrid host shows them even where cgroup2 is mounted at
# /sys/fs/cgroup (v2node/chroot.sh does that for another release's root).
v1_lines() { grep -qv '^0::' /proc/self/cgroup; }

if [[ $(fstype /sys/fs/cgroup) == cgroup2fs ]]; then
    if v1_lines; then
        [[ -r $shim ]] || { echo "enter.sh: $shim is missing" >&2; exit 1; }
        exec env INVOCATION_ID="$invocation" LD_PRELOAD="$shim" "$@"
    fi
    exec env INVOCATION_ID="$invocation" "$@"
fi

if [[ ${GPUFENCE_V2NODE_INSIDE:-} != 1 ]]; then
    exec env GPUFENCE_V2NODE_INSIDE=1 unshare --mount --propagation private -- "$0" "$shim" "$@"
fi
unset GPUFENCE_V2NODE_INSIDE

# Deepest first, so every mount below /sys/fs/cgroup goes before it.
mapfile -t mounts < <(awk '$5 == "/sys/fs/cgroup" || index($5, "/sys/fs/cgroup/") == 1 { print $5 }' /proc/self/mountinfo | sort -r -u)
for m in "${mounts[@]}"; do
    umount -l "$m"
done
mount -t cgroup2 cgroup2 /sys/fs/cgroup
[[ -r $shim ]] || { echo "enter.sh: $shim is missing" >&2; exit 1; }
exec env INVOCATION_ID="$invocation" LD_PRELOAD="$shim" "$@"
