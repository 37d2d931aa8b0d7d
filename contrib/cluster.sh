#!/usr/bin/env bash
# Start and stop an isolated one-node Slurm cluster on loopback, for the demo
# and the end-to-end tests.  Everything (munge key and socket, slurm.conf,
# state, spool, logs, pid files) lives in a directory chosen by the caller, so
# several clusters can exist side by side (with different port bases) and
# nothing system-wide is touched except the `gpufence-test` user.
#
#   cluster.sh start DIR   build DIR/slurm.conf, start munged, slurmctld and
#                          slurmd; exit 0 once the node is idle and jobs run
#                          as an unprivileged user.  Prints only errors.
#   cluster.sh stop DIR    kill what `start` started in DIR; idempotent.
#   cluster.sh env DIR     print `export SLURM_CONF=...` for `eval`.
#
# Inputs read from DIR (written by the caller before `start`):
#   slurm-extra.conf   lines appended to slurm.conf.  A key set there replaces
#                      the one this script would write (Slurm itself logs an
#                      error on every command for a key given twice), so a
#                      NodeName= or PartitionName= line there replaces the
#                      default node or partition.
#   gres.conf, cgroup.conf, plugstack.conf ...  found by Slurm next to
#                      slurm.conf.
# The check at the end of `start` runs one job (id 1, `srun true` as the
# test user), so the caller's Prolog, Epilog and SPANK plugins have already
# run once when `start` returns.  A batch job submitted within about 3 s of
# `start` may wait for slurmctld's first scheduling pass; later ones start
# within a second (SchedulerParameters=batch_sched_delay=0).
# Environment:
#   GPUFENCE_CLUSTER_PORT_BASE  slurmctld port (default 16817); slurmd uses
#                               base+1.  Two clusters at once need two bases.
#   GPUFENCE_SLURMD_CGROUP      existing cgroup2 directory to start slurmd in,
#                               so that slurmd, its prologs and its slurmstepds
#                               are all below it.
#   GPUFENCE_CLUSTER_ROOT=ROOT  run the cluster (daemons, start's check job,
#                               stop's scancel) chrooted in ROOT, a Debian root
#                               of another Slurm release (v2node/make-root.sh);
#                               DIR must be under /tmp, which ROOT shares.
#   GPUFENCE_CLUSTER_NODES="a b"  several nodes on this host (MULTIPLE_SLURMD):
#                               one slurmd per name (-N name), pid recorded as
#                               slurmd-<name>, in GPUFENCE_SLURMD_CGROUP with
#                               %n replaced by the name, with the KEY=VALUE
#                               lines of DIR/node-<name>.env added to its
#                               environment. The caller writes the NodeName
#                               lines (with Port=) and the %n paths of
#                               SlurmdSpoolDir/SlurmdLogFile/SlurmdPidFile.
#   GPUFENCE_CLUSTER_V2NODE=1   run slurmd as on a systemd-managed pure
#                               cgroup v2 node (v2node/enter.sh: INVOCATION_ID,
#                               and on a hybrid host a private mount namespace
#                               with cgroup2 at /sys/fs/cgroup); the caller
#                               writes cgroup.conf and the cgroup keys of
#                               slurm-extra.conf.
#   GPUFENCE_V2NODE_IMEX=1      with GPUFENCE_CLUSTER_V2NODE: slurmd gets a
#                               tmpfs of its own over
#                               /dev/nvidia-caps-imex-channels (Slurm's
#                               switch/nvidia_imex; v2node/enter.sh). The
#                               directory must exist on the host (/dev is an
#                               rbind of the host's in a root): start makes it
#                               when missing, stop removes it when start made it.
#   GPUFENCE_CLUSTER_CHECK=warn the check job of start may fail (it says so on
#                               stderr and start goes on): a node whose every
#                               step fails can still be measured.
#
# Needs root: Slurm daemons run as root (SlurmUser=root) and the test user is
# created with useradd.  `start` makes DIR mode 0755 (the test user reads
# slurm.conf and reaches the munge socket there), so every directory above
# DIR must be searchable by all: /tmp/x works, /root/x does not.
# Tested with Slurm 22.05.8 and munge 0.5.15 (Debian 12).

set -euo pipefail

readonly TEST_USER=gpufence-test
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
readonly HERE
# Every wait is bounded so that a broken cluster fails a test instead of
# hanging it.
readonly WAIT_S=30
# Each daemon gets this variable in its environment.  `stop` kills a pid only
# when its /proc/PID/environ carries it with this DIR, so a recycled pid or
# another cluster's daemon is never hit.  slurmstepd inherits slurmd's
# environment, which is how stray step daemons are found.
readonly MARK=GPUFENCE_CLUSTER_DIR
# Daemons started so far by this run of `start`, watched while waiting.
STARTED=()

die() {
    printf 'cluster.sh: %s\n' "$*" >&2
    exit 1
}

usage() {
    printf 'usage: %s start|stop|env DIR\n' "${0##*/}" >&2
    exit 2
}

# --- helpers ---------------------------------------------------------------

# has_mark PID: true when PID is alive and was started by this script for DIR.
has_mark() {
    local env
    env=$(tr '\0' '\n' 2>/dev/null <"/proc/$1/environ") || return 1
    grep -qxF "$MARK=$DIR" <<<"$env"
}

# pid_of NAME: the pid recorded for daemon NAME, if it is still ours.
pid_of() {
    local f="$DIR/run/$1.pid" pid
    [[ -r $f ]] || return 1
    read -r pid <"$f" || return 1
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    has_mark "$pid" || return 1
    printf '%s\n' "$pid"
}

# marked_stepds: slurmstepd processes forked by this cluster's slurmd.  They
# detach from slurmd (double fork), so the process tree alone misses them.
marked_stepds() {
    local d pid
    for d in /proc/[0-9]*; do
        pid=${d#/proc/}
        [[ $(cat "$d/comm" 2>/dev/null) == slurmstepd ]] || continue
        has_mark "$pid" && printf '%s\n' "$pid"
    done
    return 0
}

# descendants PID...: all processes below the given ones (not the roots).
# Collected before anything is killed, because a killed parent's children
# are reparented and can no longer be traced to it.
descendants() {
    ps -e -o pid=,ppid= | awk -v roots="$*" '
        BEGIN { n = split(roots, r, " "); for (i = 1; i <= n; i++) want[r[i]] = 1 }
        { parent[$1] = $2; order[NR] = $1 }
        END {
            do {
                grew = 0
                for (i = 1; i <= NR; i++) {
                    p = order[i]
                    if (!(p in want) && (parent[p] in want)) { want[p] = 1; out[p] = 1; grew = 1 }
                }
            } while (grew)
            for (p in out) print p
        }'
}

# wait_for SECONDS DESCRIPTION CMD...: poll CMD until it succeeds.
wait_for() {
    local limit=$1 what=$2 deadline=$((SECONDS + $1))
    shift 2
    until "$@" >/dev/null 2>&1; do
        # A daemon that died (bad config, port taken) will not come back:
        # fail now rather than at the deadline.
        local name
        # (Checked by the recorded pid alone: right after spawn the process
        # is still the wrapper shell, whose environ lacks the mark until it
        # execs the daemon; pid reuse within this one run is not a concern.)
        for name in "${STARTED[@]}"; do
            local pid
            read -r pid <"$DIR/run/$name.pid" 2>/dev/null || pid=
            if [[ -z $pid ]] || ! running "$pid"; then
                printf 'cluster.sh: %s exited while waiting for %s\n' "$name" "$what" >&2
                return 1
            fi
        done
        if ((SECONDS >= deadline)); then
            printf 'cluster.sh: timed out after %ss waiting for %s\n' "$limit" "$what" >&2
            return 1
        fi
        sleep 0.2
    done
}

# running PID: PID exists and is not a zombie.  Daemons detach, so their
# parent is init, and an init that does not reap (as in some containers)
# leaves zombies that kill -0 still finds.
running() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ ${stat:0:1} != Z ]]
}

# wait_gone PID...: wait until none of the pids runs, at most 10 s.
wait_gone() {
    local deadline=$((SECONDS + 10)) p alive
    while :; do
        alive=0
        for p in "$@"; do
            running "$p" && alive=1
        done
        ((alive)) || return 0
        ((SECONDS < deadline)) || return 1
        sleep 0.1
    done
}

# port_busy PORT: something already listens there (another cluster, or a
# system slurmd).  Checked up front because the daemons would only log it.
port_busy() {
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

show_logs() {
    local f
    for f in "$DIR"/log/*.log "$DIR"/log/*.stderr; do
        [[ -s $f ]] || continue
        printf '==> %s <==\n' "$f" >&2
        tail -n 20 "$f" >&2
    done
}

# spawn NAME CGROUP CMD...: run CMD detached (own session, output in
# log/NAME.stderr, which holds what fails before the log file is opened, no
# inherited descriptors) and record its pid.  When CGROUP is set the
# wrapper shell moves itself there before exec, so CMD and everything it
# forks starts inside that cgroup.
spawn() {
    local name=$1 cg=$2
    shift 2
    (
        # A caller's pipe inherited by a long-lived daemon would keep the
        # caller waiting for EOF; close everything but stdio.
        for fd in /proc/"$BASHPID"/fd/*; do
            fd=${fd##*/}
            ((fd > 2)) && eval "exec $fd>&-"
        done
        # Do not pin the caller's working directory for the daemon's life.
        cd / || exit 1
        if [[ -n $cg ]]; then
            echo "$BASHPID" >"$cg/cgroup.procs" ||
                { echo "cannot join cgroup $cg" >&2; exit 1; }
        fi
        exec setsid env "$MARK=$DIR" SLURM_CONF="$CONF" "$@"
    ) </dev/null >>"$DIR/log/$name.stderr" 2>&1 &
    echo "$!" >"$DIR/run/$name.pid"
    STARTED+=("$name")
}

no_jobs() {
    [[ -z $(squeue -h -o %A 2>/dev/null) ]]
}

node_idle() {
    local states
    states=$(sinfo -h -N -o '%T') || return 1
    [[ -n $states ]] && ! grep -qvx idle <<<"$states"
}

# --- slurm.conf --------------------------------------------------------------

write_conf() {
    local extra="$DIR/slurm-extra.conf" host ctld_port slurmd_port line key
    host=$(hostname -s)
    ctld_port=${GPUFENCE_CLUSTER_PORT_BASE:-16817}
    if ! [[ $ctld_port =~ ^[0-9]+$ ]] || ((ctld_port < 1 || ctld_port > 65534)); then
        die "GPUFENCE_CLUSTER_PORT_BASE must be a port number below 65535"
    fi
    slurmd_port=$((ctld_port + 1))
    local p
    for p in "$ctld_port" "$slurmd_port"; do
        port_busy "$p" && die "port $p on 127.0.0.1 is already in use (set GPUFENCE_CLUSTER_PORT_BASE)"
    done

    local -a base=(
        "ClusterName=gpufence"
        "SlurmctldHost=$host(127.0.0.1)"
        "SlurmctldPort=$ctld_port"
        "SlurmdPort=$slurmd_port"
        "SlurmUser=root"
        "SlurmdUser=root"
        "AuthType=auth/munge"
        "CredType=cred/munge"
        # Slurm's own munge client otherwise talks to the system socket.
        "AuthInfo=socket=$DIR/munge/munge.socket"
        "StateSaveLocation=$DIR/state"
        "SlurmdSpoolDir=$DIR/spool"
        # Not run/NAME.pid: those are written by this script, and Slurm
        # truncates its pid file while rewriting it.
        "SlurmctldPidFile=$DIR/run/slurmctld.slurm-pid"
        "SlurmdPidFile=$DIR/run/slurmd.slurm-pid"
        "SlurmctldLogFile=$DIR/log/slurmctld.log"
        "SlurmdLogFile=$DIR/log/slurmd.log"
        "SlurmctldDebug=info"
        "SlurmdDebug=info"
        # The default (/bin/mail) is missing on most test machines.
        "MailProg=/bin/true"
        # No cgroups unless the caller asks for them: the host may be v1,
        # v2 or hybrid, and the fence under test owns device access.
        "ProctrackType=proctrack/linuxproc"
        "TaskPlugin=task/none"
        "JobAcctGatherType=jobacct_gather/none"
        "AccountingStorageType=accounting_storage/none"
        "JobCompType=jobcomp/none"
        "MpiDefault=none"
        "SwitchType=switch/none"
        "GresTypes=gpu"
        "SelectType=select/cons_tres"
        "SelectTypeParameters=CR_Core"
        # Take the node as configured: CI machines differ in cores and
        # memory, and a node with "less than configured" would be drained.
        "SlurmdParameters=config_overrides"
        # Short timeouts: tests kill jobs and restart daemons often.
        "KillWait=2"
        "MessageTimeout=10"
        "SlurmdTimeout=30"
        "SlurmctldTimeout=30"
        "InactiveLimit=0"
        "UnkillableStepTimeout=30"
        # A node that went DOWN comes back on its own when slurmd registers
        # (a DRAINed one still needs `scontrol update ... State=RESUME`).
        "ReturnToService=2"
        # Batch jobs otherwise wait up to 3 s for the scheduler; with 0
        # they start within about a second.
        "SchedulerParameters=batch_sched_delay=0"
        # Keep finished jobs visible to `scontrol show job` for a while.
        "MinJobAge=300"
        "NodeName=$host NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=2000 State=UNKNOWN"
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=60 State=UP"
    )

    {
        echo "# Generated by contrib/cluster.sh; edit slurm-extra.conf instead."
        for line in "${base[@]}"; do
            key=${line%%=*}
            # The caller's value wins; see the header.
            if [[ -f $extra ]] && grep -qiE "^[[:space:]]*${key}[[:space:]]*=" "$extra"; then
                continue
            fi
            echo "$line"
        done
        if [[ -f $extra ]]; then
            echo "# --- from slurm-extra.conf ---"
            cat "$extra"
            echo
        fi
    } >"$CONF.tmp"
    mv "$CONF.tmp" "$CONF"
    chmod 0644 "$CONF"
}

# The NodeName slurmd must claim (-N): the first NodeName= of the extra file
# when it is a single plain name, so the caller may name the node freely.
node_name() {
    local extra="$DIR/slurm-extra.conf" name
    [[ -f $extra ]] || return 0
    name=$(sed -nE 's/^[[:space:]]*NodeName[[:space:]]*=[[:space:]]*([^[:space:]]+).*/\1/Ip' "$extra" | head -n 1)
    [[ -n $name && $name != *[\[,]* && ${name,,} != default ]] && printf '%s\n' "$name"
    return 0
}

# build_shim: v2node/proc-cgroup-v2only.c built into DIR (kept across
# starts; a root made by make-root.sh has no compiler, so it is built on the
# host before entering one); prints its path.
build_shim() {
    local shim="$DIR/proc-cgroup-v2only.so" src="$HERE/v2node/proc-cgroup-v2only.c"
    if [[ ! -f $shim || $src -nt $shim ]]; then
        cc -shared -fPIC -O2 -o "$shim.tmp" "$src" -ldl >&2 && mv "$shim.tmp" "$shim" || return 1
    fi
    printf '%s\n' "$shim"
}

# in_root CMD ARGS: with GPUFENCE_CLUSTER_ROOT set (a Debian root of another
# Slurm release, v2node/make-root.sh), run this script's CMD chrooted there
# (v2node/chroot.sh) with the same DIR, after giving the root the test user
# with this host's uid and gid (the fence and the epilog compare uids
# across the two) and translating GPUFENCE_SLURMD_CGROUP to the root's
# cgroup2 mount. Returns only when there is no root to enter.
in_root() {
    [[ ${GPUFENCE_CLUSTER_IN_ROOT:-} != 1 ]] || return 0
    local root=${GPUFENCE_CLUSTER_ROOT:-}
    # stop finds the root that start used.
    if [[ $1 == start ]]; then
        if [[ -n $root ]]; then echo "$root" >"$DIR/.cluster-root"; else rm -f "$DIR/.cluster-root"; fi
    elif [[ -z $root && -f $DIR/.cluster-root ]]; then
        root=$(cat "$DIR/.cluster-root")
    fi
    [[ -n $root ]] || return 0
    [[ -f $root/.gpufence-root ]] || die "GPUFENCE_CLUSTER_ROOT=$root is not a root made by v2node/make-root.sh"
    [[ $DIR == /tmp/* ]] || die "with GPUFENCE_CLUSTER_ROOT, DIR must be under /tmp (shared with the root): $DIR"
    if [[ $1 == start ]]; then
        local uid gid
        uid=$(id -u "$TEST_USER" 2>/dev/null) || { useradd --no-create-home --home-dir / --shell /bin/sh --user-group "$TEST_USER"; uid=$(id -u "$TEST_USER"); }
        gid=$(id -g "$TEST_USER")
        if [[ $(chroot "$root" id -u "$TEST_USER" 2>/dev/null) != "$uid" ]]; then
            chroot "$root" userdel "$TEST_USER" >/dev/null 2>&1 || true
            chroot "$root" groupdel "$TEST_USER" >/dev/null 2>&1 || true
            chroot "$root" groupadd -g "$gid" "$TEST_USER"
            chroot "$root" useradd -M -d / -s /bin/sh -u "$uid" -g "$gid" "$TEST_USER"
        fi
        build_shim >/dev/null || die "cannot build the v2node library (is a C compiler installed?)"
    fi
    local inner="$DIR/.cluster-sh"
    rm -rf "$inner"
    mkdir -p "$inner/v2node"
    cp -p "$HERE/cluster.sh" "$inner/"
    cp -p "$HERE/v2node/enter.sh" "$HERE/v2node/proc-cgroup-v2only.c" "$inner/v2node/"
    local cg=${GPUFENCE_SLURMD_CGROUP:-} mnt
    if [[ -n $cg ]]; then
        mnt=$(awk '$9 == "cgroup2" { print $5; exit }' /proc/self/mountinfo)
        cg=$(cd "$cg" && pwd -P)
        [[ $cg == "$mnt"/* ]] || die "GPUFENCE_SLURMD_CGROUP=$cg is not below the cgroup2 mount $mnt"
        cg="/sys/fs/cgroup/${cg#"$mnt"/}"
    fi
    # A namespace plugin binds each job's namespace from slurmd's: the
    # daemons' namespace is ordered for it (v2node/ns-order.sh), once, at
    # start, where slurm-extra.conf configures one.
    local order=0
    if [[ $1 == start ]] && grep -Eqi '^[[:space:]]*(JobContainerType|NamespaceType)[[:space:]]*=' "$DIR/slurm-extra.conf" 2>/dev/null; then
        order=1
    fi
    exec env GPUFENCE_CLUSTER_IN_ROOT=1 GPUFENCE_SLURMD_CGROUP="$cg" GPUFENCE_NS_ORDER="$order" \
        bash "$HERE/v2node/chroot.sh" "$root" bash "$inner/cluster.sh" "$1" "$DIR"
}

# subids: the test user's ranges in /etc/subuid and /etc/subgid, which
# rootless Podman maps into its user namespace through the setuid
# newuidmap/newgidmap (uidmap package; newuidmap(1), subuid(5)); jobs run
# containers (tests/tests/e2e_containers.rs). useradd adds them where
# login.defs gives SUB_UID_COUNT (shadow 4.13+'s default), so this only
# fills in a range past every other user's where there is none. In a root
# (GPUFENCE_CLUSTER_ROOT) this runs inside it, on the root's own files.
subids() {
    local f start
    for f in /etc/subuid /etc/subgid; do
        grep -q "^$TEST_USER:" "$f" 2>/dev/null && continue
        start=$({ cat "$f" 2>/dev/null || true; } | awk -F: 'BEGIN { m = 100000 } $2 + $3 > m { m = $2 + $3 } END { print m }')
        printf '%s:%s:65536\n' "$TEST_USER" "$start" >>"$f" || return 1
    done
}

# --- commands ------------------------------------------------------------------

start_munged() {
    local key="$DIR/munge/munge.key"
    # A key of its own, never the host's: on a machine that belongs to a
    # real cluster, the demo must not be able to mint its credentials.
    if [[ ! -s $key ]]; then
        if command -v mungekey >/dev/null; then
            mungekey --create --keyfile="$key" >/dev/null || return 1
        else
            dd if=/dev/urandom of="$key" bs=1024 count=1 status=none || return 1
        fi
    fi
    # munged refuses a key readable by others or owned by another user.
    # (set -e is off here: this function runs on the left of ||.)
    chown root:root "$key" && chmod 0600 "$key" || return 1
    rm -f "$DIR/munge/munge.socket" "$DIR/munge/munge.socket.lock"
    # munged runs fine as root; in daemon mode it returns only once its
    # socket is ready, and it writes its own pid file.  The socket is
    # created mode 0777, so the unprivileged user's srun can reach it.
    (
        for fd in /proc/"$BASHPID"/fd/*; do
            fd=${fd##*/}
            ((fd > 2)) && eval "exec $fd>&-"
        done
        cd / || exit 1
        exec env "$MARK=$DIR" munged \
            --socket="$DIR/munge/munge.socket" \
            --key-file="$key" \
            --pid-file="$DIR/run/munged.pid" \
            --log-file="$DIR/log/munged.log" \
            --seed-file="$DIR/munge/munged.seed"
    ) </dev/null >>"$DIR/log/munged.stderr" 2>&1 || return 1
    wait_for "$WAIT_S" "munged" munge -n -S "$DIR/munge/munge.socket" || return 1
    STARTED+=(munged)
}

# fail MESSAGE: a failed start shows why, then takes down what it started so
# that a caller that does not call stop is not left with stray daemons.
fail() {
    printf 'cluster.sh: %s\n' "$*" >&2
    show_logs
    cmd_stop >/dev/null 2>&1 || true
    exit 1
}

cmd_start() {
    ((EUID == 0)) || die "start must run as root"
    [[ ! -e $DIR/run ]] || [[ -z $(any_alive) ]] ||
        die "a cluster is already running in $DIR; run stop first"

    local cg=${GPUFENCE_SLURMD_CGROUP:-}
    if [[ -n $cg && $cg != *%n* ]]; then
        [[ -f $cg/cgroup.procs ]] || die "GPUFENCE_SLURMD_CGROUP=$cg is not a cgroup directory"
        # Absolute, because the daemon wrapper changes to / first.
        cg=$(cd "$cg" && pwd -P)
    elif [[ -n $cg ]]; then
        [[ ${GPUFENCE_CLUSTER_NODES:-} ]] || die "GPUFENCE_SLURMD_CGROUP=$cg names %n without GPUFENCE_CLUSTER_NODES"
        [[ $cg == /* ]] || die "GPUFENCE_SLURMD_CGROUP=$cg must be absolute"
        local n
        for n in $GPUFENCE_CLUSTER_NODES; do
            [[ -f ${cg//%n/$n}/cgroup.procs ]] || die "${cg//%n/$n} is not a cgroup directory"
        done
    fi

    # Start state: a fresh controller state (drained nodes and job ids of a
    # previous run in the same DIR must not leak into the next test).
    rm -rf "$DIR/state" "$DIR/spool" "$DIR/run" "$DIR/log"
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/run" "$DIR/log" "$DIR/munge"
    # munged checks that every directory up to its socket is searchable by
    # all and writable only by its owner; the test user needs to read
    # slurm.conf.  mktemp -d makes 0700 directories.
    chmod 0755 "$DIR" "$DIR/munge" "$DIR/spool" "$DIR/log" "$DIR/run"
    chmod 0700 "$DIR/state"

    id -u "$TEST_USER" >/dev/null 2>&1 ||
        useradd --no-create-home --home-dir / --shell /bin/sh --user-group "$TEST_USER" ||
        die "cannot create user $TEST_USER"
    subids || die "cannot give $TEST_USER subordinate ids"

    write_conf
    trap 'fail "interrupted"' INT TERM

    if [[ ${GPUFENCE_V2NODE_IMEX:-} == 1 && ! -d /dev/nvidia-caps-imex-channels ]]; then
        mkdir /dev/nvidia-caps-imex-channels || die "cannot make /dev/nvidia-caps-imex-channels"
        : >"$DIR/.imex-dir-made"
    fi

    start_munged || fail "munged failed to start"

    # -i: ignore (empty) state; -D so that the pid recorded is the daemon's.
    spawn slurmctld "" slurmctld -D -i -f "$CONF"
    wait_for "$WAIT_S" "slurmctld" scontrol ping || fail "slurmctld did not answer"

    local -a nflag=()
    local name
    name=$(node_name)
    [[ -n $name ]] && nflag=(-N "$name")
    local -a wrap=()
    if [[ ${GPUFENCE_CLUSTER_V2NODE:-} == 1 ]]; then
        # A real cgroup/v2 node, even on a hybrid host: see v2node/enter.sh.
        local shim
        shim=$(build_shim) || fail "cannot build the v2node library (is a C compiler installed?)"
        wrap=(bash "$HERE/v2node/enter.sh" "$shim")
    fi
    if [[ -n ${GPUFENCE_CLUSTER_NODES:-} ]]; then
        # Several nodes on this host (Slurm built with MULTIPLE_SLURMD, as
        # Debian's is): one slurmd per name, each claiming its node (-N).
        local n ncg
        local -a nenv
        for n in $GPUFENCE_CLUSTER_NODES; do
            ncg=${cg//%n/$n}
            # SlurmdSpoolDir=.../spool/%n: slurmd does not make it.
            mkdir -p "$DIR/spool/$n"
            nenv=()
            [[ -f $DIR/node-$n.env ]] && mapfile -t nenv <"$DIR/node-$n.env"
            spawn "slurmd-$n" "$ncg" "${wrap[@]}" env "${nenv[@]}" slurmd -D -f "$CONF" -N "$n"
        done
    else
        spawn slurmd "$cg" "${wrap[@]}" slurmd -D -f "$CONF" "${nflag[@]}"
    fi
    wait_for "$WAIT_S" "the node to be idle" node_idle || fail "the node did not become idle: $(sinfo -h -N -o '%N %T %E' 2>&1)"

    # A job as the unprivileged user exercises munge (client side as that
    # user), the prolog/epilog and the SPANK stack end to end.  Run from /
    # because the user cannot enter the caller's directory.  (No batch job
    # here: slurmctld's first scheduling pass, the only thing that starts
    # batch jobs, comes about 3 s after it started, which would triple the
    # time of every start.)
    local check
    if ! check=$(cd / && timeout "$WAIT_S" runuser -u "$TEST_USER" -- srun --quiet -N1 true 2>&1); then
        [[ ${GPUFENCE_CLUSTER_CHECK:-} == warn ]] || fail "srun as $TEST_USER failed: $check"
        printf 'cluster.sh: warning: the check job (srun as %s) failed: %s\n' "$TEST_USER" "$check" >&2
    fi
    # The last epilog may still be running; tests that check node state
    # expect idle.
    wait_for "$WAIT_S" "the node to be idle again" node_idle || fail "the node did not return to idle: $(sinfo -h -N -o '%N %T %E' 2>&1)"
    trap - INT TERM
}

# any_alive: pids of this DIR's daemons and step daemons still running.
any_alive() {
    local n
    for n in slurmctld munged $(slurmd_names); do
        pid_of "$n" || true
    done
    marked_stepds
}

# kill_all SIGNAL PID...: signal whichever of the pids still exist.
kill_all() {
    local sig=$1
    shift
    (($#)) || return 0
    kill "-$sig" "$@" 2>/dev/null || true
}

# slurmd_names: the names the slurmd pids were recorded under (slurmd, or
# slurmd-<node> for each node of GPUFENCE_CLUSTER_NODES).
slurmd_names() {
    local f
    for f in "$DIR"/run/slurmd.pid "$DIR"/run/slurmd-*.pid; do
        [[ -f $f ]] || continue
        f=${f##*/}
        printf '%s\n' "${f%.pid}"
    done
}

cmd_stop() {
    [[ -d $DIR/run ]] || return 0
    local ctld slurmd munged n p
    ctld=$(pid_of slurmctld || true)
    slurmd=
    for n in $(slurmd_names); do
        p=$(pid_of "$n" || true)
        [[ -n $p ]] && slurmd+="${slurmd:+ }$p"
    done
    munged=$(pid_of munged || true)

    # Cancel jobs first while the daemons are up, so that their epilogs run
    # and linuxproc kills the tasks; bounded because a wedged slurmd must not
    # block teardown.
    if [[ -n $ctld && -n $slurmd ]]; then
        local jobs
        jobs=$(squeue -h -o %A 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            # shellcheck disable=SC2086 # one job id per word
            scancel $jobs 2>/dev/null || true
            wait_for 5 "jobs to end" no_jobs 2>/dev/null || true
        fi
    fi

    # Everything below slurmd (prologs) and below each of its step daemons
    # (the job tasks), gathered before the parents die.  slurmctld's own
    # children (slurmscriptd) go with it on SIGTERM; they are only killed
    # when slurmctld had to be killed.
    local -a stepds workers=() ctld_tree=() late=()
    mapfile -t stepds < <(marked_stepds)
    if [[ -n $slurmd || ${#stepds[@]} -gt 0 ]]; then
        # shellcheck disable=SC2086 # one pid per word
        mapfile -t workers < <(descendants $slurmd "${stepds[@]}")
    fi
    workers+=("${stepds[@]}")
    [[ -n $ctld ]] && mapfile -t ctld_tree < <(descendants "$ctld")
    kill_all KILL "${workers[@]}"
    # slurmd first, while slurmctld still answers: its shutdown waits for
    # threads that may be reporting a killed prolog to the controller.
    if [[ -n $slurmd ]]; then
        # shellcheck disable=SC2086
        kill_all TERM $slurmd
        # shellcheck disable=SC2086
        wait_gone $slurmd || kill_all KILL $slurmd
    fi
    if [[ -n $ctld ]]; then
        kill_all TERM "$ctld"
        wait_gone "$ctld" || kill_all KILL "$ctld" "${ctld_tree[@]}"
    fi
    # A step daemon forked while slurmd was shutting down.
    mapfile -t late < <(marked_stepds)
    kill_all KILL "${late[@]}"
    # munged last: slurmd and slurmctld authenticate until they exit.
    if [[ -n $munged ]]; then
        kill_all TERM "$munged"
        wait_gone "$munged" || kill_all KILL "$munged"
    fi
    local -a all=("${workers[@]}" "${ctld_tree[@]}" "${late[@]}")
    # shellcheck disable=SC2206
    [[ -n $slurmd ]] && all+=($slurmd)
    [[ -n $ctld ]] && all+=("$ctld")
    ((${#all[@]} == 0)) || wait_gone "${all[@]}" ||
        echo "cluster.sh: some processes of $DIR did not exit" >&2
    rm -f "$DIR"/run/*.pid "$DIR"/run/*.slurm-pid
    # Only when start made it, and only while empty (another node's
    # directory, or the driver's, stays).
    if [[ -f $DIR/.imex-dir-made ]]; then
        # A failed start stops in its own mount namespace, where
        # v2node/enter.sh mounted slurmd's tmpfs on it.
        umount -l /dev/nvidia-caps-imex-channels 2>/dev/null || true
        rmdir /dev/nvidia-caps-imex-channels 2>/dev/null || true
        rm -f "$DIR/.imex-dir-made"
    fi
    return 0
}

cmd_env() {
    printf 'export SLURM_CONF=%q\n' "$CONF"
}

# --- main ------------------------------------------------------------------------

(($# == 2)) || usage
# Stopping a cluster whose directory is already gone has nothing to do.
[[ $1 == stop && ! -d $2 ]] && exit 0
[[ -d $2 ]] || die "$2 is not a directory"
DIR=$(cd "$2" && pwd -P)
# slurm.conf values end at whitespace and AuthInfo options at commas.
[[ $DIR != *[[:space:],]* ]] || die "DIR must not contain spaces or commas: $DIR"
CONF="$DIR/slurm.conf"
export SLURM_CONF="$CONF"

[[ $1 == env ]] || in_root "$1"

case $1 in
start) cmd_start ;;
stop) cmd_stop ;;
env) cmd_env ;;
*) usage ;;
esac
