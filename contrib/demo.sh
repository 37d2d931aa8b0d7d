#!/usr/bin/env bash
# gpufence demo: on a Debian 12 or 13 machine (systemd-booted or not), as
# root. Checks what it needs, installs what is missing, builds, starts a
# one-node Slurm cluster on this machine (nodes addressed on 127.0.0.1)
# whose "GPUs" are device nodes made with mknod, as a real cgroup/v2 node
# (Slurm's cgroup/v2 plugin, proctrack/cgroup, task/cgroup,
# ConstrainDevices=yes), first with Slurm alone, then with gpufence's
# default configuration (layout = "slurm"), and shows side by side what
# jobs and an outsider open in each.
#
#   bash contrib/demo.sh          run the demo, then clean up
#   bash contrib/demo.sh --keep   leave the cluster running to play with
#                                 (then: bash contrib/demo.sh --stop)
#   bash contrib/demo.sh --stop   stop a kept demo, or what an interrupted
#                                 one left, and remove its files
#
# How to read the results: the GPU nodes have no driver behind them, so an
# open that the device cgroup ALLOWS fails with ENXIO ("no such device or
# address"), and an open the fence DENIES fails with EPERM.
#
# Where it runs: everything the demo starts lives in a cgroup of its own,
# /gpufence-demo at the cgroup2 root (GPUFENCE_DEMO_DIR=/tmp/x names it
# /gpufence-x), which it makes and removes:
#   /gpufence-demo/demo    munged, slurmctld, the demo's srun and sbatch
#   /gpufence-demo/node    the node, as in a container: slurmd runs in a
#                          cgroup namespace rooted here (v2node/enter.sh,
#                          GPUFENCE_V2NODE_CGROUPNS), where Slurm finds
#                          system.slice/slurmd.service, builds its own tree
#                          in system.slice, and gpufence fences system.slice
# The machine's own /system.slice (a systemd host's services) is never
# made, entered, fenced or signalled. The clean-up (at the end, on error,
# on Ctrl-C, and for what an interrupted run left) kills the processes of
# the demo's own cgroup only (cgroup.kill), and only once it is sure that
# cgroup is the one a run of this demo made (its inode, recorded in
# DIR/owner when it was made). Its bpffs directory is
# /sys/fs/bpf/gpufence-demo, its files are in /tmp/gpufence-demo.
#
# For the tests: GPUFENCE_DEMO_PREBUILT=DIR skips contrib/setup.sh and the
# build and takes the binaries from DIR (target/debug of a built tree);
# GPUFENCE_CLUSTER_PORT_BASE moves the ports (17817 and 17818).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
DEMO=${GPUFENCE_DEMO_DIR:-/tmp/gpufence-demo}
# The demo's cgroup and bpffs directory are named after its directory, so
# two demos (different GPUFENCE_DEMO_DIR) never collide.
base=$(basename "$DEMO")
NAME=gpufence-$(printf '%s' "${base#gpufence-}" | tr -c 'A-Za-z0-9_.-' '_')
BPFFS=/sys/fs/bpf/$NAME
PORT_BASE=${GPUFENCE_CLUSTER_PORT_BASE:-17817}
PREBUILT=${GPUFENCE_DEMO_PREBUILT:-}
USER_=gpufence-test
# The node's own view (its cgroup namespace): where slurmd and the outsider run.
SLICE=system.slice
OUTSIDE=$SLICE/gpufence-demo-outside.service

MODE=run
case ${1:-} in
"") ;;
--keep) MODE=keep ;;
--stop) MODE=stop ;;
*)
    echo "usage: bash contrib/demo.sh [--keep|--stop]" >&2
    exit 2
    ;;
esac

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
say() { printf 'demo: %s\n' "$*" >&2; }
# The cgroup2 mount: the filesystem type is the field after the "-" of a
# mountinfo line (the optional fields before it vary).
cg2() {
    awk '{ for (i = 7; i < NF; i++) if ($i == "-") { if ($(i + 1) == "cgroup2") { print $5; exit } break } }' /proc/self/mountinfo
}
# run_in CGROUP CMD...: CMD in that cgroup (it moves itself there, then execs).
run_in() {
    local cg=$1
    shift
    sh -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$cg" "$@"
}
# starttime PID: when PID started (field 22 of /proc/PID/stat); empty when gone.
starttime() {
    local s
    s=$(cat "/proc/$1/stat" 2>/dev/null) || return 0
    s=${s##*) }
    # shellcheck disable=SC2086 # the fields, one per word
    set -- $s
    printf '%s\n' "${20}"
}
# verdicts: the probe's verdicts on one line (`PATH VERDICT` lines in).
verdicts() { awk '{ printf "%s%s", (NR > 1 ? " " : ""), $2 } END { print "" }'; }
port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

[[ $DEMO == /*/* && $DEMO != *[[:space:],]* ]] || { say "GPUFENCE_DEMO_DIR must be an absolute path below a directory, without spaces or commas: $DEMO"; exit 2; }
((EUID == 0)) || { say "run as root (sudo bash contrib/demo.sh): it starts Slurm's daemons, makes cgroups and device nodes, and loads BPF programs"; exit 1; }
CGMNT=$(cg2)
[[ -n $CGMNT ]] || { say "no cgroup2 hierarchy is mounted (see /proc/self/mountinfo): the demo runs a cgroup v2 node; mount one (mount -t cgroup2 none /sys/fs/cgroup/unified) or boot with cgroup v2"; exit 1; }
CG=$CGMNT/$NAME
CG_DEMO=$CG/demo
CG_NODE=$CG/node
OWNER=$DEMO/owner

# --- what an earlier run left ---------------------------------------------------

# demo_cgroup_is_ours: $CG is the cgroup a run of this demo made (the inode
# recorded in $OWNER when it made it). Sets OWNER_RUNNING to the pid of
# the run that made it while that run still goes (a --keep one has ended).
OWNER_RUNNING=
demo_cgroup_is_ours() {
    local ino pid start
    OWNER_RUNNING=
    [[ -r $OWNER ]] || return 1
    read -r ino pid start <"$OWNER" || return 1
    [[ $ino =~ ^[0-9]+$ && $(stat -c %i "$CG" 2>/dev/null) == "$ino" ]] || return 1
    if [[ $pid =~ ^[0-9]+$ && $pid != "$$" && -n $start && $(starttime "$pid") == "$start" ]]; then
        OWNER_RUNNING=$pid
    fi
    return 0
}

# in_demo_cgroup ID: process or thread ID is in the demo's cgroup (its
# cgroup2 path is /$NAME or below it).
in_demo_cgroup() {
    local line
    line=$(grep -m1 '^0::' "/proc/$1/cgroup" 2>/dev/null) || return 1
    line=${line#0::}
    [[ $line == "/$NAME" || $line == "/$NAME/"* ]]
}

# kill_cgroup DIR: kills every process in cgroup DIR and below (DIR is the
# demo's own cgroup or one below it: all of them are the demo's) and waits
# until none is left, at most 10 s.
kill_cgroup() {
    local dir=$1 i id
    [[ -d $dir ]] || return 0
    echo 1 >"$dir/cgroup.kill" 2>/dev/null || true
    for i in $(seq 100); do
        grep -qx 'populated 0' "$dir/cgroup.events" 2>/dev/null && return 0
        # cgroup.kill can miss a process whose main thread has exited while
        # others live on (seen on 6.18): each thread still listed there gets
        # SIGKILL, once /proc shows it in the demo's cgroup.
        if ((i % 10 == 0)); then
            for id in $(find "$dir" -name cgroup.threads -exec cat {} + 2>/dev/null); do
                if in_demo_cgroup "$id"; then kill -9 "$id" 2>/dev/null || true; fi
            done
            echo 1 >"$dir/cgroup.kill" 2>/dev/null || true
        fi
        sleep 0.1
    done
    return 1
}

# rmdir_tree DIR: removes cgroup DIR and the cgroups below it, deepest
# first (an empty cgroup only: rmdir never signals anything).
rmdir_tree() {
    local i
    for i in $(seq 50); do
        [[ -d $1 ]] || return 0
        find "$1" -depth -type d -exec rmdir {} + 2>/dev/null || true
        sleep 0.1
    done
    [[ ! -d $1 ]]
}

# remove_demo_cgroup: stops everything the demo started (all of it in
# $CG) and removes $CG. Only called once $CG is known to be the demo's.
remove_demo_cgroup() {
    [[ -d $CG ]] || return 0
    kill_cgroup "$CG" || true
    if ! rmdir_tree "$CG"; then
        say "could not remove $CG (processes left: $(find "$CG" -name cgroup.procs -exec cat {} + 2>/dev/null | tr '\n' ' '))"
        return 1
    fi
}

# remove_fence_pins: the demo's fence, pinned in its own bpffs directory
# (what it was attached to, the demo's node, is gone by then).
remove_fence_pins() {
    [[ -e $BPFFS ]] || return 0
    rm -rf "$BPFFS" 2>/dev/null || say "could not remove $BPFFS"
}

# take_over_leftovers: what an interrupted or kept run of this demo left
# (same directory, same cgroup): stopped and removed, when it is provably
# the demo's; otherwise nothing is touched and the demo stops here.
take_over_leftovers() {
    if [[ -f $DEMO/made-system-slice ]]; then
        # An older demo.sh made system.slice at the cgroup2 root and killed
        # what it found there at its next run. Nothing there is touched now.
        say "ignoring $DEMO/made-system-slice, left by an older version of this demo: $CGMNT/system.slice is not touched (remove what that run left there yourself, if anything)"
        rm -f "$DEMO/made-system-slice"
    fi
    if [[ -d $CG ]]; then
        if demo_cgroup_is_ours; then
            if [[ -n $OWNER_RUNNING ]]; then
                say "another run of this demo (pid $OWNER_RUNNING) is using $CG; wait for it to end, or use another GPUFENCE_DEMO_DIR"
                exit 1
            fi
            echo "demo: stopping what an earlier run of this demo left in $CG"
            remove_demo_cgroup || exit 1
        elif grep -qx 'populated 0' "$CG/cgroup.events" 2>/dev/null; then
            # Empty: a run interrupted between making it and recording it.
            rmdir_tree "$CG" || { say "$CG exists and cannot be removed; it is left alone"; exit 1; }
        else
            say "$CG exists with processes, and no record in $OWNER says this demo made it: it is left alone; remove it yourself once you know what runs there, or use another GPUFENCE_DEMO_DIR"
            exit 1
        fi
    fi
    remove_fence_pins
    rm -rf "$DEMO"
}

take_over_leftovers
if [[ $MODE == stop ]]; then
    echo "demo stopped and removed"
    exit 0
fi

# --- from here on, the clean-up trap ------------------------------------------------

MADE_CG=0
KEEP_AT_EXIT=0
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    set +e
    ((KEEP_AT_EXIT)) && exit "$rc"
    if ((MADE_CG)); then
        remove_demo_cgroup
    fi
    remove_fence_pins
    if ((rc != 0)) && [[ -d $DEMO/cluster/log ]]; then
        say "stopped; everything it started is gone, the cluster's logs are in $DEMO/cluster/log (GPUFENCE_DEMO_DIR=$DEMO bash contrib/demo.sh --stop removes them)"
    else
        rm -rf "$DEMO"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

mkdir -p "$DEMO"
chmod 0755 "$DEMO"
if mkdir "$CG" 2>"$DEMO/mkdir.err"; then
    MADE_CG=1
    printf '%s %s %s\n' "$(stat -c %i "$CG")" "$$" "$(starttime $$)" >"$OWNER"
    mkdir "$CG_DEMO" "$CG_NODE" "$CG/probe"
fi

# --- what the demo needs, checked before anything is installed ---------------------

PROBLEMS=()
need() { PROBLEMS+=("$*"); }

# bpf_probe ARCH CGROUP: loads a cgroup device program that calls the
# helpers the fence calls (bpf_get_current_ancestor_cgroup_id among them)
# and attaches it to CGROUP through a bpf_link, as the fence install does;
# the link goes when the probe exits. Prints "ok" or what failed.
bpf_probe() {
    perl - "$@" <<'PERL'
use strict;
use warnings;
my ($arch, $cg) = @ARGV;
my %nr = (x86_64 => 321, aarch64 => 280, riscv64 => 280, ppc64le => 361, s390x => 351);
my $nr = $nr{$arch};
defined $nr or do { print "ok (not probed: no bpf() number known for $arch)\n"; exit 0 };
sub ins { my ($op, $dst, $src, $off, $imm) = @_; pack("C C s< l<", $op, ($src << 4) | $dst, $off, $imm) }
sub call { ins(0x85, 0, 0, 0, $_[0]) }
# ancestor_cgroup_id(1); cgroup_id(); pid_tgid(); uid_gid(); ktime_get_ns();
# comm(buf, 16); return 1;  (the program gpufence's install probes with)
my $prog = join '', ins(0xb7, 1, 0, 0, 1), call(123), call(80), call(14), call(15), call(5),
    ins(0xbf, 1, 10, 0, 0), ins(0x07, 1, 0, 0, -16), ins(0xb7, 2, 0, 0, 16), call(16),
    ins(0xb7, 0, 0, 0, 1), ins(0x95, 0, 0, 0, 0);
my $license = "GPL\0";
my $log = "\0" x 65536;
sub ptr { unpack("J", pack("p", $_[0])) }
# union bpf_attr for BPF_PROG_LOAD (5): BPF_PROG_TYPE_CGROUP_DEVICE (15).
my $attr = pack("L L J J L L J L L", 15, length($prog) / 8, ptr($prog), ptr($license), 1, length($log), ptr($log), 0, 0);
$attr .= "\0" x (128 - length $attr);
my $fd = syscall($nr, 5, $attr, length $attr);
if ($fd < 0) {
    my $err = "$!";
    (my $l = $log) =~ s/\0.*//s;
    my @why = grep { /\S/ && !/^(processed|verification time|stack depth)/ } split /\n/, $l;
    print "load: $err", (@why ? " ($why[-1])" : ""), "\n";
    exit 1;
}
sysopen(my $dir, $cg, 0) or do { print "open $cg: $!\n"; exit 1 };
# BPF_LINK_CREATE (28): prog_fd, target_fd, BPF_CGROUP_DEVICE (6), flags.
my $link_attr = pack("L L L L", $fd, fileno($dir), 6, 0) . ("\0" x 112);
my $link = syscall($nr, 28, $link_attr, length $link_attr);
if ($link < 0) { print "link: $!\n"; exit 1 }
print "ok\n";
PERL
}

# cgroupns_probe CGROUP: a cgroup namespace rooted at CGROUP, with cgroup2
# mounted inside it, as v2node/enter.sh makes for slurmd.
cgroupns_probe() {
    local d rc=0
    d=$(mktemp -d)
    run_in "$1" unshare --cgroup --mount --propagation private -- \
        sh -c 'mount -t cgroup2 none "$0" && [ -f "$0/cgroup.procs" ] && grep -qx "0::/" /proc/self/cgroup' "$d" 2>&1 || rc=1
    rmdir "$d"
    return "$rc"
}

preflight() {
    local t missing=() out
    for t in unshare nsenter setpriv mknod perl awk; do
        command -v "$t" >/dev/null || missing+=("$t")
    done
    ((${#missing[@]} == 0)) || need "missing commands: ${missing[*]} (Debian's util-linux, coreutils, perl-base)"
    if [[ -n $PREBUILT ]]; then
        for t in gpufence gpufence-prolog gpufence-epilog gpufence-probe libgpufence.so; do
            [[ -f $PREBUILT/$t ]] || missing+=("$PREBUILT/$t")
        done
        ((${#missing[@]} == 0)) || need "GPUFENCE_DEMO_PREBUILT: not built: ${missing[*]}"
        for t in slurmd slurmctld srun munged; do
            command -v "$t" >/dev/null || need "$t is not installed (GPUFENCE_DEMO_PREBUILT skips contrib/setup.sh, which installs it)"
        done
    else
        [[ -f /etc/debian_version ]] ||
            need "not a Debian machine (no /etc/debian_version): contrib/setup.sh installs Debian's Slurm and munge packages with apt-get"
        if ! command -v cargo >/dev/null; then
            need "no cargo in PATH: install a Rust toolchain 1.88 or newer (https://rustup.rs), as the user that runs the demo"
        else
            out=$(cargo --version 2>/dev/null || true)
            if [[ $out =~ ^cargo\ 1\.([0-9]+)\. ]] && ((BASH_REMATCH[1] < 88)); then
                need "$out is too old: gpufence needs Rust 1.88 or newer (rustup update)"
            fi
        fi
    fi
    # Rust links with cc; on a hybrid-cgroup host the node also needs a
    # small library built with it (v2node/proc-cgroup-v2only.c).
    command -v cc >/dev/null || need "no C compiler (cc): Rust links with it and the demo builds a small library with it (apt-get install gcc)"
    if ((!MADE_CG)); then
        need "cannot make the demo's cgroup $CG: $(cat "$DEMO/mkdir.err" 2>/dev/null) (the cgroup2 mount must be writable by root)"
    else
        [[ -f $CG/cgroup.kill ]] ||
            need "this kernel has no cgroup.kill (Linux 5.14 or later): the demo stops everything it started through it"
        out=$(cgroupns_probe "$CG/probe" 2>&1) ||
            need "cannot run the node in a cgroup namespace (unshare --cgroup, then cgroup2 mounted inside it): ${out:-failed}"
        out=$(bpf_probe "$(uname -m)" "$CG/probe" 2>&1) || true
        [[ $out == ok* ]] ||
            need "the kernel refused gpufence's device program or its attachment (a cgroup device BPF program calling bpf_get_current_ancestor_cgroup_id, Linux 6.1 or later or a backport, attached through a bpf_link): $out"
        rmdir "$CG/probe" 2>/dev/null || true
    fi
    if [[ ! -r /sys/kernel/btf/vmlinux ]]; then
        need "no kernel BTF (/sys/kernel/btf/vmlinux, CONFIG_DEBUG_INFO_BTF): gpufence's BPF iterators need it"
    elif ! grep -aq 'bpf_iter__cgroup' /sys/kernel/btf/vmlinux; then
        need "this kernel has no BPF cgroup iterator (bpf_iter__cgroup, Linux 6.1 or later): in the node's cgroup namespace gpufence reads each cgroup's true level with it"
    fi
    if ! grep -q ' /sys/fs/bpf bpf ' /proc/self/mounts; then
        [[ -d /sys/fs/bpf ]] && unshare --mount --propagation private -- mount -t bpf bpf /sys/fs/bpf 2>/dev/null ||
            need "cannot mount bpffs at /sys/fs/bpf (CONFIG_BPF_SYSCALL): the fence pins its program there"
    fi
    grep -Eq '^ *(234|237|256|257|235) ' /proc/misc 2>/dev/null ||
        need "no misc device to stand in for a GPU that a process holds (/proc/misc lists none of minors 234 237 256 257 235)"
    [[ $PORT_BASE =~ ^[0-9]+$ ]] && ((PORT_BASE > 0 && PORT_BASE < 65535)) ||
        need "GPUFENCE_CLUSTER_PORT_BASE must be a port number below 65535: $PORT_BASE"
    for t in "$PORT_BASE" "$((PORT_BASE + 1))"; do
        if port_busy "$t"; then
            need "port $t on 127.0.0.1 is in use (the demo's slurmctld and slurmd use $PORT_BASE and $((PORT_BASE + 1)); GPUFENCE_CLUSTER_PORT_BASE=N moves them to N and N+1)"
        fi
    done
}

preflight
rm -f "$DEMO/mkdir.err"
if ((${#PROBLEMS[@]})); then
    for p in "${PROBLEMS[@]}"; do say "$p"; done
    say "nothing was installed or started"
    exit 1
fi

if [[ -z $PREBUILT ]]; then
    step "1. Set up this machine (Debian packages, bpffs, demo user) and build"
    bash contrib/setup.sh
    cargo build --workspace --locked
    T=${CARGO_TARGET_DIR:-$REPO/target}/debug
else
    step "1. Set up this machine and build: skipped (GPUFENCE_DEMO_PREBUILT=$PREBUILT)"
    id "$USER_" >/dev/null 2>&1 || useradd --create-home --shell /bin/bash "$USER_"
    grep -q ' /sys/fs/bpf bpf ' /proc/self/mounts || mount -t bpf bpf /sys/fs/bpf -o mode=0700
    T=$PREBUILT
fi

mkdir -p "$DEMO"/{bin,dev,jobs,cluster} "$CG_NODE/$SLICE/slurmd.service" "$CG_NODE/$OUTSIDE"
chmod 0755 "$DEMO"/{bin,dev,cluster}
chmod 1777 "$DEMO/jobs"
install -m 0755 "$T/gpufence" "$T/gpufence-prolog" "$T/gpufence-epilog" "$T/gpufence-probe" "$DEMO/bin/"
install -m 0755 "$T/libgpufence.so" "$DEMO/bin/gpufence.so"
# The admin CLI as the node sees things: in slurmd's mount and cgroup
# namespaces (what `kubectl exec` or `nsenter` gives an admin of a
# containerised node).
cat >"$DEMO/bin/in-node" <<SH
#!/bin/sh
# in-node CMD...: CMD in the demo node's mount and cgroup namespaces.
pid=\$(cat "$DEMO/cluster/run/slurmd.pid" 2>/dev/null) || { echo "in-node: the demo's slurmd is not running" >&2; exit 1; }
exec nsenter -t "\$pid" -m -C -- "\$@"
SH
chmod 0755 "$DEMO/bin/in-node"

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
[[ -n $HELD ]] || { say "no free misc device to stand in for a held GPU"; exit 1; }
mknod -m 0666 "$DEMO/dev/nvidia2" c 10 "$HELD"
ls -l "$DEMO/dev"

cat >"$DEMO/gpufence.toml" <<TOML
# The demo's node runs in a cgroup namespace rooted at $CG_NODE,
# so "system.slice" here is $CG_NODE/system.slice on this
# machine, never the machine's own. A real node uses cgroup_root = "/"
# (the default). Everything else not set here is the default:
# layout = "slurm", slurmd.service exempt.
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
# the misc major of the third stand-in, fenced in the demo's node only
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
# A stock cgroup/v2 node, as far as the demo's cgroup allows (it passes
# no v2 controllers down, so the resource constraints are off; devices
# need none).
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
start_cluster() {
    GPUFENCE_CLUSTER_PORT_BASE=$PORT_BASE GPUFENCE_SLURMD_CGROUP=$CG_NODE GPUFENCE_CLUSTER_V2NODE=1 GPUFENCE_V2NODE_CGROUPNS=1 \
        run_in "$CG_DEMO" bash "$REPO/contrib/cluster.sh" start "$DEMO/cluster"
}
# stop_cluster: everything in the demo's cgroup, and Slurm's tree in the
# node (the next cluster numbers its jobs from 1 again).
stop_cluster() {
    kill_cgroup "$CG_NODE" && kill_cgroup "$CG_DEMO" || { say "processes of the demo outlived SIGKILL"; return 1; }
    local scope
    for scope in "$CG_NODE/$SLICE"/*_slurmstepd.scope; do
        [[ -d $scope ]] && rmdir_tree "$scope"
    done
    return 0
}
export SLURM_CONF=$DEMO/cluster/slurm.conf
as_user() { run_in "$CG_DEMO" setpriv --reuid="$USER_" --regid="$USER_" --init-groups -- env SLURM_CONF="$SLURM_CONF" "$@"; }
outsider() { run_in "$CG_NODE/$OUTSIDE" setpriv --reuid="$USER_" --regid="$USER_" --init-groups -- "$@"; }
PROBE=$DEMO/bin/gpufence-probe
ALL=("$DEMO/dev/nvidia0" "$DEMO/dev/nvidia1" "$DEMO/dev/nvidia2" "$DEMO/dev/nvidiactl")
cd "$DEMO/jobs"

step "3. Slurm alone (its ConstrainDevices, no gpufence) on a real cgroup/v2 node: what jobs and an outsider open"
: >"$DEMO/cluster/plugstack.conf"
node_conf >"$DEMO/cluster/slurm-extra.conf"
start_cluster
alone_job=$(as_user srun --gres=gpu:sim:1 "$PROBE" open "${ALL[@]}" | verdicts)
alone_cpu=$(as_user srun "$PROBE" open "${ALL[@]}" | verdicts)
alone_out=$(outsider "$PROBE" open "${ALL[@]}" | verdicts)
printf '  of nvidia0 nvidia1 nvidia2 nvidiactl:\n  %-28s %s\n  %-28s %s\n  %-28s %s\n' \
    "a --gres=gpu:sim:1 job" "$alone_job" "a CPU-only job" "$alone_cpu" "the user outside any job" "$alone_out"
stop_cluster

step "4. The same node with gpufence (default layout = \"slurm\"): the plugin installs the fence at slurmd start"
echo "required $DEMO/bin/gpufence.so config=$DEMO/gpufence.toml" >"$DEMO/cluster/plugstack.conf"
{
    node_conf
    echo "PlugStackConfig=$DEMO/cluster/plugstack.conf"
    echo "Prolog=$DEMO/bin/prolog.sh"
    echo "Epilog=$DEMO/bin/epilog.sh"
} >"$DEMO/cluster/slurm-extra.conf"
start_cluster
GF=("$DEMO/bin/in-node" "$DEMO/bin/gpufence" --config "$DEMO/gpufence.toml")
"${GF[@]}" fence status
sinfo
fenced_job=$(as_user srun --gres=gpu:sim:1 "$PROBE" open "${ALL[@]}" | verdicts)
fenced_cpu=$(as_user srun "$PROBE" open "${ALL[@]}" | verdicts)
fenced_out=$(outsider "$PROBE" open "${ALL[@]}" | verdicts)
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

step "7. The same user outside any job (a miner on an idle node, in the node's /$OUTSIDE): every GPU denied"
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
if [[ $MODE == keep ]]; then
    KEEP_AT_EXIT=1
    step "Left running. To use it:"
    echo "  export SLURM_CONF=$SLURM_CONF GPUFENCE_CONFIG=$DEMO/gpufence.toml PATH=$DEMO/bin:\$PATH"
    echo "  (GPUFENCE_CONFIG matters: without it gpufence reads /etc/slurm/gpufence.toml, a whole-node fence)"
    echo "  the admin CLI as the node sees it (its cgroup namespace): in-node gpufence grants"
    echo "  jobs as the demo's user, from its job directory (reports are written there):"
    echo "  cd $DEMO/jobs && setpriv --reuid=$USER_ --regid=$USER_ --init-groups -- env SLURM_CONF=$SLURM_CONF srun --gres=gpu:1 --gpufence-report $PROBE open $DEMO/dev/nvidia0"
    echo "  stop with: GPUFENCE_DEMO_DIR=$DEMO bash contrib/demo.sh --stop"
else
    step "11. Stop the cluster, remove the fence and the demo's cgroup /$NAME"
    "${GF[@]}" fence remove >/dev/null
    remove_demo_cgroup
    MADE_CG=0
    [[ -e $BPFFS ]] && echo "fence pins left in $BPFFS" >&2 || echo "fence removed, no pins left in /sys/fs/bpf; /$NAME removed"
    rm -rf "$DEMO"
fi
