#!/usr/bin/env bash
# gpufence demo: on a fresh Debian 12 machine, as root. Installs what is
# missing, builds, starts a one-node Slurm cluster on this machine (nodes
# addressed on 127.0.0.1) whose "GPUs" are device nodes made with mknod, as a
# real cgroup/v2 node (Slurm's cgroup/v2 plugin, proctrack/cgroup,
# task/cgroup, ConstrainDevices=yes; on a hybrid-cgroup host through
# contrib/v2node/enter.sh, as the tests do), first with Slurm alone, then
# with gpufence's default configuration (layout = "slurm"), and shows side by
# side what jobs and an outsider open in each.
#
#   bash contrib/demo.sh          run the demo, then clean up
#   bash contrib/demo.sh --keep   leave the cluster running to play with
#                                 (then: bash contrib/demo.sh --stop)
#
# How to read the results: the GPU nodes have no driver behind them, so an
# open that the device cgroup ALLOWS fails with ENXIO ("no such device or
# address"), and an open the fence DENIES fails with EPERM. Slurm's cgroup/v2
# plugin builds its tree at the cgroup2 root (system.slice/...): the demo
# makes system.slice where none exists (it refuses to run where one with
# processes does: a systemd host's own services live there), fences that
# slice only, never the machine's root cgroup, and removes it at the end.
# Its bpffs directory is /sys/fs/bpf/gpufence-demo, its files are in
# /tmp/gpufence-demo; GPUFENCE_DEMO_DIR=/tmp/x names them gpufence-x.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
DEMO=${GPUFENCE_DEMO_DIR:-/tmp/gpufence-demo}
# The demo's cgroup subtree and bpffs directory are named after its
# directory, so two demos (different GPUFENCE_DEMO_DIR) never collide.
base=$(basename "$DEMO")
NAME=gpufence-$(printf '%s' "${base#gpufence-}" | tr -c 'A-Za-z0-9_.-' '_')
BPFFS=/sys/fs/bpf/$NAME
PORT_BASE=${GPUFENCE_CLUSTER_PORT_BASE:-17817}
USER_=gpufence-test

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
cg2() { awk '$9 == "cgroup2" { print $5; exit }' /proc/self/mountinfo; }
SLICE=system.slice
OUTSIDE=$SLICE/gpufence-demo-outside.service

stop_demo() {
    bash "$REPO/contrib/cluster.sh" stop "$DEMO/cluster" 2>/dev/null || true
    [[ -x $DEMO/bin/gpufence ]] && "$DEMO/bin/gpufence" --config "$DEMO/gpufence.toml" fence remove >/dev/null 2>&1 || true
    local root
    root="$(cg2)/$SLICE"
    # The slice the demo made: what is left in it is the demo's (a slice
    # with processes of its own was refused at the start).
    if [[ -f $DEMO/made-system-slice && -d $root ]]; then
        find "$root" -name cgroup.procs -exec cat {} + 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        sleep 0.2
        find "$root" -depth -type d -exec rmdir {} + 2>/dev/null || true
    fi
}

# verdicts: the probe's verdicts on one line (`PATH VERDICT` lines in).
verdicts() { awk '{ printf "%s%s", (NR > 1 ? " " : ""), $2 } END { print "" }'; }

if [[ ${1:-} == --stop ]]; then
    stop_demo
    rm -rf "$DEMO"
    echo "demo stopped and removed"
    exit 0
fi

step "1. Set up this machine (Debian packages, bpffs, demo user) and build"
bash contrib/setup.sh
cargo build --workspace --locked
T=$REPO/target/debug

stop_demo
rm -rf "$DEMO"
mkdir -p "$DEMO"/{bin,dev,jobs,cluster}
CGROOT=$(cg2)
if [[ -d $CGROOT/$SLICE ]]; then
    if [[ -n $(find "$CGROOT/$SLICE" -name cgroup.procs -exec cat {} + 2>/dev/null) ]]; then
        echo "demo: $CGROOT/$SLICE exists with processes (this machine's own services): the demo runs Slurm's cgroup/v2 node there and will not touch it; use a machine without one" >&2
        exit 1
    fi
    find "$CGROOT/$SLICE" -depth -type d -exec rmdir {} + 2>/dev/null || true
fi
mkdir -p "$CGROOT/$SLICE/slurmd.service" "$CGROOT/$OUTSIDE"
touch "$DEMO/made-system-slice"
chmod 0755 "$DEMO" "$DEMO"/{bin,dev,cluster}
chmod 1777 "$DEMO/jobs"
install -m 0755 "$T/gpufence" "$T/gpufence-prolog" "$T/gpufence-epilog" "$T/gpufence-probe" "$DEMO/bin/"
install -m 0755 "$T/libgpufence.so" "$DEMO/bin/gpufence.so"

step "2. Simulated GPUs: two device nodes on the NVIDIA major (195), nvidiactl, and one that really opens"
mknod -m 0666 "$DEMO/dev/nvidia0" c 195 0
mknod -m 0666 "$DEMO/dev/nvidia1" c 195 1
mknod -m 0666 "$DEMO/dev/nvidiactl" c 195 255
# A 195 node can never be held open (no driver: ENXIO). To show the epilog
# catching a process that keeps a GPU, the third "GPU" is a real misc device
# that no process on this machine holds (the epilog looks machine-wide).
HELD=
for minor in 234 237 256 257 235; do
    mknod -m 0666 "$DEMO/dev/probe" c 10 "$minor"
    if [[ -z $("$DEMO/bin/gpufence-probe" holders "10:$minor") ]] &&
        [[ $("$DEMO/bin/gpufence-probe" open "$DEMO/dev/probe") == *" ok" ]]; then
        HELD=$minor
        rm -f "$DEMO/dev/probe"
        break
    fi
    rm -f "$DEMO/dev/probe"
done
[[ -n $HELD ]] || { echo "demo: no free misc device to stand in for a held GPU" >&2; exit 1; }
mknod -m 0666 "$DEMO/dev/nvidia2" c 10 "$HELD"
ls -l "$DEMO/dev"

cat >"$DEMO/gpufence.toml" <<TOML
# The demo fences system.slice, where its Slurm node lives; a real node
# uses cgroup_root = "/" (the default). Everything else not set here is the
# default: layout = "slurm", slurmd.service exempt.
cgroup_root = "$SLICE"
bpffs_dir = "$BPFFS"
state_dir = "$DEMO/state"
audit_log = "$DEMO/audit.jsonl"
evidence_dir = "$DEMO/evidence"
dev_dir = "$DEMO/dev"
nvml = false
[majors]
nvidia = 195
nvidia-uvm = 241
# the misc major of the third stand-in, fenced in the demo's subtree only
demo-held-gpu = 10
TOML
for s in prolog epilog; do
    printf '#!/bin/sh\nexec %s --config %s\n' "$DEMO/bin/gpufence-$s" "$DEMO/gpufence.toml" >"$DEMO/bin/$s.sh"
    chmod 0755 "$DEMO/bin/$s.sh"
done
cat >"$DEMO/cluster/gres.conf" <<GRES
Name=gpu Type=sim File=$DEMO/dev/nvidia0
Name=gpu Type=sim File=$DEMO/dev/nvidia1
Name=gpu Type=held File=$DEMO/dev/nvidia2
GRES
# A stock cgroup/v2 node, as far as this host allows (no v2 controllers
# here: the resource constraints are off; devices need none).
cat >"$DEMO/cluster/cgroup.conf" <<CONF
CgroupPlugin=cgroup/v2
IgnoreSystemd=yes
ConstrainDevices=yes
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainSwapSpace=no
CONF
node_conf() {
    cat <<CONF
NodeName=$(hostname -s) NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=2000 Gres=gpu:sim:2,gpu:held:1 State=UNKNOWN
ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup
PrologFlags=Alloc,Contain
CONF
}
start_node() {
    GPUFENCE_CLUSTER_PORT_BASE=$PORT_BASE GPUFENCE_SLURMD_CGROUP="$CGROOT/$SLICE/slurmd.service" GPUFENCE_CLUSTER_V2NODE=1 \
        bash "$REPO/contrib/cluster.sh" start "$DEMO/cluster"
}
export SLURM_CONF=$DEMO/cluster/slurm.conf
as_user() { setpriv --reuid="$USER_" --regid="$USER_" --init-groups -- env SLURM_CONF="$SLURM_CONF" "$@"; }
outsider() { sh -c "echo \$\$ > $CGROOT/$OUTSIDE/cgroup.procs; exec setpriv --reuid=$USER_ --regid=$USER_ --init-groups -- $*"; }
PROBE=$DEMO/bin/gpufence-probe
ALL="$DEMO/dev/nvidia0 $DEMO/dev/nvidia1 $DEMO/dev/nvidia2 $DEMO/dev/nvidiactl"
cd "$DEMO/jobs"

step "3. Slurm alone (its ConstrainDevices, no gpufence) on a real cgroup/v2 node: what jobs and an outsider open"
: >"$DEMO/cluster/plugstack.conf"
node_conf >"$DEMO/cluster/slurm-extra.conf"
start_node
# shellcheck disable=SC2086 # ALL is a list of paths
{
    alone_job=$(as_user srun --gres=gpu:sim:1 "$PROBE" open $ALL | verdicts)
    alone_cpu=$(as_user srun "$PROBE" open $ALL | verdicts)
    alone_out=$(outsider "$PROBE" open $ALL | verdicts)
}
printf '  of nvidia0 nvidia1 nvidia2 nvidiactl:\n  %-28s %s\n  %-28s %s\n  %-28s %s\n' \
    "a --gres=gpu:sim:1 job" "$alone_job" "a CPU-only job" "$alone_cpu" "the user outside any job" "$alone_out"
bash "$REPO/contrib/cluster.sh" stop "$DEMO/cluster"

step "4. The same node with gpufence (default layout = \"slurm\"): the plugin installs the fence at slurmd start"
echo "required $DEMO/bin/gpufence.so config=$DEMO/gpufence.toml" >"$DEMO/cluster/plugstack.conf"
{
    node_conf
    echo "PlugStackConfig=$DEMO/cluster/plugstack.conf"
    echo "Prolog=$DEMO/bin/prolog.sh"
    echo "Epilog=$DEMO/bin/epilog.sh"
} >"$DEMO/cluster/slurm-extra.conf"
start_node
GF=("$DEMO/bin/gpufence" --config "$DEMO/gpufence.toml")
"${GF[@]}" fence status
sinfo
# shellcheck disable=SC2086
{
    fenced_job=$(as_user srun --gres=gpu:sim:1 "$PROBE" open $ALL | verdicts)
    fenced_cpu=$(as_user srun "$PROBE" open $ALL | verdicts)
    fenced_out=$(outsider "$PROBE" open $ALL | verdicts)
}
echo "Side by side, what each opens of nvidia0 nvidia1 nvidia2 nvidiactl"
echo "(ENXIO or ok: the device cgroup allowed the open, EPERM: denied):"
printf '  %-28s %-30s %s\n' "" "Slurm ConstrainDevices alone" "Slurm + gpufence" \
    "a --gres=gpu:sim:1 job" "$alone_job" "$fenced_job" \
    "a CPU-only job" "$alone_cpu" "$fenced_cpu" \
    "the user outside any job" "$alone_out" "$fenced_out"

step "5. A job with one GPU (srun --gres=gpu:1, as user $USER_): its GPU opens (ENXIO), the other is denied (EPERM)"
as_user srun --gres=gpu:1 sh -c "echo \"job \$SLURM_JOB_ID was given GRES index \$SLURM_STEP_GPUS\"; $PROBE open $DEMO/dev/nvidia0 $DEMO/dev/nvidia1"

step "6. A job that sets CUDA_VISIBLE_DEVICES=0,1 itself still gets one GPU"
as_user env CUDA_VISIBLE_DEVICES=0,1 srun --export=ALL --gres=gpu:1 sh -c "$PROBE open $DEMO/dev/nvidia0 $DEMO/dev/nvidia1"

step "7. The same user outside any job (a miner on an idle node, in /$OUTSIDE): every GPU denied"
outsider "$PROBE" open "$DEMO/dev/nvidia0" "$DEMO/dev/nvidia1"

step "8. Live grants while a batch job runs, and none after it"
jid=$(as_user sbatch --parsable --gres=gpu:sim:2 -o /dev/null --wrap "sleep 3")
for _ in $(seq 50); do [[ $(squeue -h -j "$jid" -o %T) == RUNNING ]] && break; sleep 0.2; done
sleep 0.5
"${GF[@]}" grants
for _ in $(seq 100); do squeue -h -j "$jid" | grep -q . || break; sleep 0.2; done
sleep 1
"${GF[@]}" grants

step "9. The audit log (JSON Lines): job $jid recorded by the prolog, applied by the plugin, revoked by the epilog"
grep "\"job_id\":$jid[,}]" "$DEMO/audit.jsonl"

step "10. A job hands its open GPU descriptor to a process outside the job, then ends"
echo "   (the kernel checks at open only, so the descriptor keeps working; the epilog finds it by st_rdev)"
outsider "$PROBE" recvfd "$DEMO/jobs/handoff.sock" >"$DEMO/jobs/receiver.out" &
for _ in $(seq 50); do [[ -S $DEMO/jobs/handoff.sock ]] && break; sleep 0.1; done
as_user srun --gres=gpu:held:1 sh -c "echo \"job \$SLURM_JOB_ID: \$($PROBE sendfd $DEMO/jobs/handoff.sock $DEMO/dev/nvidia2)\""
for _ in $(seq 100); do grep -q process_killed "$DEMO/audit.jsonl" && break; sleep 0.1; done
grep -E '"event":"(lingering_process|process_killed)"' "$DEMO/audit.jsonl"
ev=$(ls "$DEMO"/evidence/*.json 2>/dev/null | head -1)
[[ -n $ev ]] && {
    echo "evidence file $ev (mode $(stat -c %a "$ev")), its first lines:"
    head -n 16 "$ev"
    echo "  ... ($(($(wc -l <"$ev") - 16)) more lines)"
}
wait 2>/dev/null || true

cd "$REPO"
if [[ ${1:-} == --keep ]]; then
    step "Left running. To use it:"
    echo "  export SLURM_CONF=$SLURM_CONF GPUFENCE_CONFIG=$DEMO/gpufence.toml PATH=$DEMO/bin:\$PATH"
    echo "  (GPUFENCE_CONFIG matters: without it gpufence reads /etc/slurm/gpufence.toml, a whole-node fence)"
    echo "  jobs as the demo's user, from its job directory (reports are written there):"
    echo "  cd $DEMO/jobs && setpriv --reuid=$USER_ --regid=$USER_ --init-groups -- env SLURM_CONF=$SLURM_CONF srun --gres=gpu:1 --gpufence-report $PROBE open $DEMO/dev/nvidia0"
    echo "  stop with: GPUFENCE_DEMO_DIR=$DEMO bash contrib/demo.sh --stop"
else
    step "11. Stop the cluster, remove the fence and the demo's system.slice"
    stop_demo
    [[ -e $BPFFS ]] && echo "fence pins left in $BPFFS" >&2 || echo "fence removed, no pins left in /sys/fs/bpf"
    rm -rf "$DEMO"
fi
