#!/usr/bin/env bash
# ns-order.sh: run by chroot.sh in the mount namespace it just made, before
# a node's slurmd starts in it. Makes sure that a mount
# namespace made later, on any CPU this process may run on, can be
# bind-mounted from here: what Slurm's job_container/tmpfs (24.11) and
# 26.05's namespace/tmpfs do for every job (`_create_ns`: the extern
# step's child unshares, and slurmstepd binds /proc/<child>/ns/mnt onto
# <BasePath>/<job>/.ns).
#
# Why it is needed. The kernel refuses that bind with EINVAL ("ns base
# mount failed: Invalid argument" in slurmd.log, then the job's extern step
# fails with "container_g_stepd_create(N): Is a directory") when the bound
# namespace's id is not above the caller's: `mnt_ns_loop()` in
# fs/namespace.c compares the two ids, as a guard against namespace loops.
# Since Linux 6.18 those ids come from `gen_cookie_next()`
# (include/linux/cookie.h, via ns_tree_gen_id() in include/linux/nstree.h),
# which hands each CPU a batch of COOKIE_LOCAL_BATCH (4096) ids: a
# namespace made later on another CPU can get a smaller id. So a node
# whose namespace was made on the CPU holding the higher batch fails the
# jobs whose extern step happens to unshare on the other CPU. Seen on this
# project's CI machine (2 CPUs, kernel 6.18), Slurm alone as well as with
# gpufence; a real node's slurmd runs in the host's first namespace, whose
# id is below every other, and never meets it.
#
# What it does. For each CPU in this process's affinity list, a child
# pinned there makes a namespace, and this process tries the bind (onto a
# file in a private tmpfs made for it, removed after). Where it fails, that
# CPU's batch is behind: namespaces are made there (`unshare --mount true`,
# 256 at a time) until the CPU takes a new batch, which is above every id
# given out before, and the bind works. At most 5 rounds of 4096 ids per
# CPU; if it still fails, it says so and exits 1.
set -euo pipefail

scratch=$(mktemp -d /tmp/gpufence-ns-order.XXXXXX)
mount -t tmpfs -o size=64k,mode=0700 tmpfs "$scratch"
: >"$scratch/holder"
cleanup() {
    umount "$scratch/holder" 2>/dev/null || true
    umount "$scratch" 2>/dev/null || true
    rmdir "$scratch" 2>/dev/null || true
}
trap cleanup EXIT

self_ns=$(readlink /proc/self/ns/mnt)

# can_bind CPU: whether a namespace made now on CPU can be bound here.
can_bind() {
    local cpu=$1 pid ok=1
    taskset -c "$cpu" unshare --mount -- sleep 30 &
    pid=$!
    for _ in $(seq 200); do
        [[ $(readlink "/proc/$pid/ns/mnt" 2>/dev/null) != "$self_ns" ]] && break
        sleep 0.01
    done
    if mount --bind "/proc/$pid/ns/mnt" "$scratch/holder" 2>/dev/null; then
        umount "$scratch/holder"
        ok=0
    fi
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    return "$ok"
}

# The CPUs of this process's affinity list ("0-3,8,10-11" -> 0 1 2 3 8 10 11).
cpus=()
IFS=, read -ra ranges <<<"$(taskset -cp $$ | sed 's/.*: *//')"
for r in "${ranges[@]}"; do
    if [[ $r == *-* ]]; then
        for ((c = ${r%-*}; c <= ${r#*-}; c++)); do cpus+=("$c"); done
    else
        cpus+=("$r")
    fi
done

for cpu in "${cpus[@]}"; do
    rounds=0
    until can_bind "$cpu"; do
        if ((rounds >= 80)); then
            echo "ns-order.sh: a mount namespace made on CPU $cpu still cannot be bound from this one after $((rounds * 256)) new namespaces there: Slurm's job_container/tmpfs would fail jobs on this node" >&2
            exit 1
        fi
        taskset -c "$cpu" bash -c 'for _ in $(seq 256); do unshare --mount true; done'
        rounds=$((rounds + 1))
    done
done
