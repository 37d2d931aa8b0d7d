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

# GPUFENCE_V2NODE_IMEX=1: Slurm's switch/nvidia_imex (24.05+) on this node.
# slurmd empties /dev/nvidia-caps-imex-channels at start and each step's
# slurmstepd mounts a tmpfs over it in a new mount namespace of its own
# after remounting / MS_SLAVE|MS_REC (src/plugins/switch/nvidia_imex/):
# so slurmd gets a tmpfs of its own over the directory here, in its private
# mount namespace (the host's directory, and the driver's channel0 on a
# real node, stay as they are), and / must be a mount point, or Slurm's
# remount fails with EINVAL and every step with "Error configuring
# interconnect", gpufence or not. v2node/chroot.sh's pivot_root makes the
# root one; the host's / is one. The directory must exist (cluster.sh
# makes it on the host).
imex_mount() {
    [[ ${GPUFENCE_V2NODE_IMEX:-} == 1 ]] || return 0
    awk '$5 == "/" { found = 1 } END { exit !found }' /proc/self/mountinfo ||
        { echo "enter.sh: / is not a mount point: Slurm's switch/nvidia_imex cannot remount it" >&2; exit 1; }
    [[ -d /dev/nvidia-caps-imex-channels ]] ||
        { echo "enter.sh: /dev/nvidia-caps-imex-channels is missing" >&2; exit 1; }
    mount -t tmpfs -o mode=0755 tmpfs /dev/nvidia-caps-imex-channels
}

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
    imex_mount
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
    if [[ ${GPUFENCE_V2NODE_IMEX:-} == 1 ]]; then
        # The tmpfs goes in a private mount namespace: v2node/chroot.sh's
        # is one already; on the host slurmd gets one here.
        if [[ ${GPUFENCE_CHROOTED:-} != 1 && ${GPUFENCE_V2NODE_INSIDE:-} != 1 ]]; then
            exec env GPUFENCE_V2NODE_INSIDE=1 unshare --mount --propagation private -- "$0" "$shim" "$@"
        fi
        unset GPUFENCE_V2NODE_INSIDE
        imex_mount
    fi
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
imex_mount
[[ -r $shim ]] || { echo "enter.sh: $shim is missing" >&2; exit 1; }
exec env INVOCATION_ID="$invocation" LD_PRELOAD="$shim" "$@"
