#!/usr/bin/env bash
# chroot.sh ROOT CMD...: run CMD with ROOT (a Debian root made by
# make-root.sh, holding another Slurm release) as its root directory, in a
# private mount namespace with what a node needs mounted into ROOT: proc,
# /dev (rbind), a fresh sysfs with cgroup2 at sys/fs/cgroup, the host's
# bpffs at sys/fs/bpf (the fence's pins are shared with the host), a tmpfs
# on run, and the host's /tmp (rbind), so that the cluster directory, the
# test's device nodes, binaries and logs have the same paths inside and
# out. The host's mounts stay as they are. Needs root.
#
# ROOT is entered with pivot_root(2), as container runtimes do (runc's
# pivotRoot in libcontainer/rootfs_linux.go), not chroot(2): ROOT is bound
# onto itself (pivot_root needs a mount point), becomes the namespace's
# root, and the old root is unmounted. In a chroot the kernel refuses a
# new user namespace (unshare(CLONE_NEWUSER): EPERM when the caller's root
# is not its mount namespace's root, current_chrooted() in
# kernel/user_namespace.c create_user_ns), so rootless Podman, Apptainer
# and `unshare --user` could not run in a job there.
set -euo pipefail

root=${1:?usage: chroot.sh ROOT CMD...}
shift
(($#)) || { echo "usage: chroot.sh ROOT CMD..." >&2; exit 2; }
[[ -f $root/.gpufence-root ]] || { echo "chroot.sh: $root is not a root made by make-root.sh" >&2; exit 1; }

if [[ ${GPUFENCE_CHROOT_INSIDE:-} != 1 ]]; then
    exec env GPUFENCE_CHROOT_INSIDE=1 unshare --mount --propagation private -- "$0" "$root" "$@"
fi
unset GPUFENCE_CHROOT_INSIDE
# GPUFENCE_NS_ORDER=1 (cluster.sh sets it to start a node with a namespace
# plugin): a namespace a job's extern step makes later must be bindable
# from this one, on every CPU (ns-order.sh says why: Linux 6.18's per-CPU
# namespace ids against Slurm's job_container/tmpfs). It costs up to a few
# seconds, so only such a node pays it.
if [[ ${GPUFENCE_NS_ORDER:-} == 1 ]]; then
    "$(dirname "$0")/ns-order.sh"
fi
unset GPUFENCE_NS_ORDER

root=$(cd "$root" && pwd -P)
mount --bind "$root" "$root"
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
mount -t sysfs sysfs "$root/sys"
mount -t cgroup2 cgroup2 "$root/sys/fs/cgroup"
if grep -q ' /sys/fs/bpf bpf ' /proc/self/mounts; then
    mount --bind /sys/fs/bpf "$root/sys/fs/bpf"
fi
mount -t tmpfs -o mode=0755 tmpfs "$root/run"
mkdir -p "$root/run/lock"
mount --rbind /tmp "$root/tmp"
[[ -e $root/etc/hosts ]] || : >"$root/etc/hosts"
mount --bind /etc/hosts "$root/etc/hosts"
# pivot_root(".", "."): the old root ends up stacked on the new one, and
# the lazy unmount of "." takes it away (pivot_root(2), NOTES). From here
# on the commands are ROOT's own.
cd "$root"
pivot_root . .
umount -l .
cd /
# enter.sh learns that this mount namespace is private already.
exec env GPUFENCE_CHROOTED=1 "$@"
