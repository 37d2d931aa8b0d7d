#!/usr/bin/env bash
# gpufence on a real NVIDIA host: the checks no CI machine without a GPU can
# make. Run as root on a node with the driver loaded:
#
#   bash contrib/gpu-check.sh
#
# It builds the workspace if needed, installs the fence on its OWN cgroup
# subtree (/gpufence-gpucheck-<pid>; the machine's other processes are not
# under it), grants GPU 0 to a job cgroup in that subtree the way the prolog
# and plugin do, and checks the real driver:
#
#   1. the fence installs over the real majors (nvidia, nvidia-uvm, caps ...)
#   2. a granted cgroup lists the GPU (nvidia-smi) and runs CUDA (torch, when present)
#   3. an ungranted cgroup cannot open any /dev/nvidia* (EPERM), nor run nvidia-smi
#   4. NVML lists the granted cgroup's CUDA process (host pid)
#   5. the epilog finds a lingering holder (descriptor and NVML), writes
#      evidence, kills it, and the GPU's memory comes back
#
# One line per check: "ok  <check>" or "FAIL <check>: <why>". Exit 0 when all
# pass. Everything it made is removed at the end, whatever happens.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
REPO=$PWD
[[ $(id -u) -eq 0 ]] || { echo "gpu-check: run as root" >&2; exit 2; }
[[ -c /dev/nvidia0 && -c /dev/nvidiactl ]] || { echo "gpu-check: no /dev/nvidia0 or /dev/nvidiactl: not an NVIDIA host (or driver not loaded)" >&2; exit 2; }
command -v nvidia-smi >/dev/null || { echo "gpu-check: nvidia-smi not found" >&2; exit 2; }

FAILS=0
ok() { printf 'ok   %s\n' "$1"; }
fail() { printf 'FAIL %s: %s\n' "$1" "$2"; FAILS=$((FAILS + 1)); }
check() { # check NAME CMD... : ok when CMD succeeds
    local name=$1
    shift
    local out
    if out=$("$@" 2>&1); then ok "$name"; else fail "$name" "$(tail -n 3 <<<"$out" | tr '\n' ' ')"; fi
}

START=$SECONDS
if [[ ! -x target/debug/gpufence || ! -x target/debug/gpufence-probe ]]; then
    cargo build --workspace --locked -q || { echo "gpu-check: build failed" >&2; exit 2; }
fi
T=$REPO/target/debug
NAME=gpufence-gpucheck-$$
CG2=$(awk '$9 == "cgroup2" { print $5; exit }' /proc/self/mountinfo)
[[ -n $CG2 ]] || { echo "gpu-check: no cgroup2 mount" >&2; exit 2; }
WORK=$(mktemp -d /tmp/gpufence-gpucheck.XXXXXX)
chmod 0755 "$WORK"
ROOT=$CG2/$NAME
CFG=$WORK/gpufence.toml
PIDS=()

cleanup() {
    for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done
    "$T/gpufence" --config "$CFG" fence remove >/dev/null 2>&1
    if [[ -d $ROOT ]]; then
        find "$ROOT" -name cgroup.procs -exec cat {} + 2>/dev/null | xargs -r kill -9 2>/dev/null
        sleep 0.3
        find "$ROOT" -depth -type d -exec rmdir {} + 2>/dev/null
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT

mkdir -p "$ROOT/outside" "$ROOT/job_1/step_0"
# slurmd -G as a file: each /dev/nvidiaN is one GPU, GRES index = position.
ls /dev/nvidia[0-9]* | sort -V | sed 's/^/slurmd: Gres Name=gpu Type=(null) Count=1 Index=0 ID=7696487 File=/; s/$/ (null)/' >"$WORK/slurmd-G.txt"
cat >"$CFG" <<TOML
cgroup_root = "$NAME"
layout = "own"
bpffs_dir = "/sys/fs/bpf/$NAME"
state_dir = "$WORK/state"
audit_log = "$WORK/audit.jsonl"
evidence_dir = "$WORK/evidence"
exempt_cgroups = []
slurmd_gres = "$WORK/slurmd-G.txt"
term_grace_ms = 2000
memory_wait_ms = 20000
TOML

in_cg() { # in_cg CGROUP CMD...: run CMD inside cgroup CGROUP of our subtree
    local cg=$1
    shift
    sh -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$ROOT/$cg" "$@"
}

# 1. Install over the real majors.
check "fence installs over the real NVIDIA majors ($(awk '$2 ~ /^nvidia/ {printf "%s=%s ", $2, $1}' /proc/devices))" \
    "$T/gpufence" --config "$CFG" fence install
check "fence status reports it installed" "$T/gpufence" --config "$CFG" fence status

# The prolog records GPU 0 (GRES index 0) for job 1; the plugin's apply
# places a slurmstepd stand-in in job_1/step_0 and grants.
check "prolog records GPU 0 for job 1 (clean start)" env SLURM_JOB_ID=1 SLURM_JOB_UID=0 SLURM_JOB_GPUS=0 \
    "$T/gpufence-prolog" --config "$CFG"
in_cg outside sleep 600 &
STEPD=$!
PIDS+=("$STEPD")
sleep 0.2
check "grant applied to job 1's cgroup" "$T/gpufence-probe" apply "$CFG" 1 0 "$STEPD"

# 2. Granted cgroup: nvidia-smi and CUDA.
out=$(in_cg job_1/step_0 nvidia-smi -L 2>&1)
if grep -q "^GPU 0" <<<"$out"; then ok "granted cgroup: nvidia-smi lists GPU 0"; else fail "granted cgroup: nvidia-smi lists GPU 0" "$out"; fi
HAVE_TORCH=0
python3 -c 'import torch' >/dev/null 2>&1 && HAVE_TORCH=1
if ((HAVE_TORCH)); then
    check "granted cgroup: CUDA runs (torch matmul on cuda:0)" in_cg job_1/step_0 python3 -c \
        'import torch; a=torch.ones(512,512,device="cuda:0"); assert float((a@a).sum())==512**3'
else
    ok "granted cgroup: CUDA workload skipped (python3 torch not installed; nvidia-smi above used the driver)"
fi

# 3. Ungranted cgroup: every NVIDIA node EPERM, nvidia-smi fails.
nodes=(/dev/nvidia[0-9]* /dev/nvidiactl)
[[ -e /dev/nvidia-uvm ]] && nodes+=(/dev/nvidia-uvm)
out=$(in_cg outside "$T/gpufence-probe" open "${nodes[@]}")
if [[ $(grep -vc ' EPERM$' <<<"$out") -eq 0 ]]; then ok "ungranted cgroup: ${#nodes[@]} NVIDIA device nodes all EPERM"; else fail "ungranted cgroup: NVIDIA nodes EPERM" "$out"; fi
if in_cg outside nvidia-smi -L >/dev/null 2>&1; then fail "ungranted cgroup: nvidia-smi fails" "it listed GPUs"; else ok "ungranted cgroup: nvidia-smi fails"; fi
out=$(in_cg job_1/step_0 "$T/gpufence-probe" open /dev/nvidia1 2>/dev/null)
if [[ -e /dev/nvidia1 ]]; then
    if [[ $out == *EPERM ]]; then ok "granted cgroup: another GPU (/dev/nvidia1) is EPERM"; else fail "granted cgroup: /dev/nvidia1 EPERM" "$out"; fi
fi

# 4 and 5. A CUDA process in the job, still running when the job "ends".
if ((HAVE_TORCH)); then
    in_cg job_1/step_0 python3 -c 'import torch, time; x=torch.ones(64*1024*1024, device="cuda:0"); print("ready", flush=True); time.sleep(600)' >"$WORK/cuda.out" 2>&1 &
else
    in_cg job_1/step_0 "$T/gpufence-probe" hold /dev/nvidia0 >"$WORK/cuda.out" 2>&1 &
fi
HOLDER=$!
PIDS+=("$HOLDER")
for _ in $(seq 100); do grep -qE '^(ready|held)' "$WORK/cuda.out" && break; sleep 0.2; done
if ((HAVE_TORCH)); then
    if nvidia-smi --query-compute-apps=pid --format=csv,noheader | grep -qx "$HOLDER"; then
        ok "NVML lists the granted cgroup's CUDA process (pid $HOLDER)"
    else
        fail "NVML lists the CUDA process" "nvidia-smi --query-compute-apps: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | tr '\n' ' ')"
    fi
fi
SLURM_JOB_ID=1 "$T/gpufence-epilog" --config "$CFG" >"$WORK/epilog.out" 2>&1
rc=$?
if kill -0 "$HOLDER" 2>/dev/null && ! grep -q '^State:.*Z' "/proc/$HOLDER/status"; then
    fail "epilog kills the lingering holder" "pid $HOLDER alive; epilog rc=$rc: $(tail -n 3 "$WORK/epilog.out" | tr '\n' ' ')"
else
    ok "epilog kills the lingering holder (rc=$rc)"
fi
ev=$(ls "$WORK"/evidence/job1-pid"$HOLDER"-*.json 2>/dev/null | head -1)
if [[ -n $ev && $(stat -c %a "$ev") == 600 ]]; then ok "evidence written (0600): $(basename "$ev")"; else fail "evidence written" "none for pid $HOLDER"; fi
if ((HAVE_TORCH)); then
    if grep -q '"gpu_memory": \[$' "$ev" && grep -q '"used_bytes": [0-9]' "$ev"; then ok "evidence has NVML GPU memory"; else fail "evidence has NVML GPU memory" "$(grep -A4 gpu_memory "$ev" | tr '\n' ' ')"; fi
    if [[ $rc -eq 0 ]]; then ok "GPU memory came back to idle (epilog clean)"; else fail "GPU memory came back" "$(grep -i 'survivor\|memory' "$WORK/epilog.out" | tr '\n' ' ')"; fi
fi
if grep -q '"event":"process_killed".*"pid":'"$HOLDER" "$WORK/audit.jsonl"; then ok "audit: process_killed for pid $HOLDER"; else fail "audit: process_killed" "$(tail -n 3 "$WORK/audit.jsonl")"; fi
grep -q '"event":"nvml_unavailable"' "$WORK/audit.jsonl" && fail "NVML available" "$(grep nvml_unavailable "$WORK/audit.jsonl")"

check "fence removes cleanly" "$T/gpufence" --config "$CFG" fence remove
[[ -e /sys/fs/bpf/$NAME ]] && fail "no pins left" "/sys/fs/bpf/$NAME exists"
echo "gpu-check: $FAILS failure(s) in $((SECONDS - START)) s"
((FAILS == 0))
