#!/usr/bin/env bash
# Two-node check: the same small training (examples/pretrain_gpt_sonic.py, fixed seed, --deterministic) launched
# by examples/train_multi_node.sh once as 1 node x N processes and once as 2 nodes x N/2 processes on this host
# (two torchrun launches, --nnodes 2 --node-rank 0/1, rendezvous on 127.0.0.1, started together); the per-step
# losses and the final parameters' checksum must be bitwise equal. Exit status 0 only then.
#   bash scripts/two_node_check.sh              # GPU host (>= 4 GPUs): N=4, 2 GPUs per node, default backend
#   DEVICE=cpu bash scripts/two_node_check.sh   # CPU: N=2, 1 process per node, gloo, torch backend
# Env: DEVICE (auto|gpu|cpu; auto = gpu with >= 4 GPUs), N (processes in all; default 4 on GPUs, 2 on CPU), EP
# (default N), STEPS (default 4), PRESET (default tiny), PHASE_TIMEOUT (s per phase, default 120 on GPUs,
# 180 on CPU), CONCURRENT (1: both phases at once, each GPU then serving one process of each; default 1 on GPUs,
# where start-up and kernel compilation dominate, 0 on CPU), TWO_NODE_DIR (logs, JSON; default out/two_node),
# PYTHON (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHON=$PY
DIR=${TWO_NODE_DIR:-out/two_node}
DEVICE=${DEVICE:-auto}
STEPS=${STEPS:-4}
PRESET=${PRESET:-tiny}
t_start=$(date +%s)

if [ "$DEVICE" = auto ]; then
  if [ -z "${CUDA_VISIBLE_DEVICES+set}" ] && command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    gpus=$(nvidia-smi -L | grep -c '^GPU') || true
  else
    gpus=$(timeout 60 "$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  fi
  if [ "${gpus:-0}" -ge 4 ]; then DEVICE=gpu; else DEVICE=cpu; fi
fi
case "$DEVICE" in
  gpu) N=${N:-4} PHASE_TIMEOUT=${PHASE_TIMEOUT:-120} CONCURRENT=${CONCURRENT:-1} ;;
  cpu)
    N=${N:-2} PHASE_TIMEOUT=${PHASE_TIMEOUT:-180} CONCURRENT=${CONCURRENT:-0}
    export CUDA_VISIBLE_DEVICES= SONIC_MEGATRON_BACKEND=torch
    ;;
  *) echo "two_node_check: DEVICE must be auto, gpu or cpu, got $DEVICE" >&2; exit 2 ;;
esac
if [ $((N % 2)) != 0 ] || [ "$N" -lt 2 ]; then
  echo "two_node_check: N must be even and >= 2, got $N" >&2
  exit 2
fi
EP=${EP:-$N}
# Same threads in both layouts (torchrun sets 1 only for more than one process per node): CPU kernels may sum
# in another order with another thread count.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
rm -f "$DIR"/one_node.* "$DIR"/two_nodes.*
mkdir -p "$DIR"
free_port() { "$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
TRAIN_ARGS=(--deterministic --param-checksum --num-microbatches 2)
echo "two-node check: $DEVICE, $N processes, EP $EP, preset $PRESET, $STEPS steps, logs in $DIR"

# One launch of examples/train_multi_node.sh in the background (its own process group through timeout, killed on
# timeout with its workers); its pid (timeout's) is $!.
launch() {  # nnodes node_rank nproc port json log
  NNODES=$1 NODE_RANK=$2 GPUS=$3 MASTER_ADDR=127.0.0.1 MASTER_PORT=$4 SAME_HOST=1 RDZV_TIMEOUT=$PHASE_TIMEOUT \
    EP=$EP PRESET=$PRESET STEPS=$STEPS \
    timeout -k 10 "$PHASE_TIMEOUT" bash examples/train_multi_node.sh "${TRAIN_ARGS[@]}" --json "$5" >"$6" 2>&1 &
}

# Wait for the given launches; when one fails, stop the others (they would wait in a collective until timeout).
wait_all() {
  local rc=0 left=("$@") pid p still
  while [ ${#left[@]} -gt 0 ]; do
    still=()
    for pid in "${left[@]}"; do
      if kill -0 "$pid" 2>/dev/null; then
        still+=("$pid")
      else
        wait "$pid"
        local r=$?
        if [ $r != 0 ] && [ $rc = 0 ]; then  # the first failure's status; the others are killed below
          rc=$r
          for p in "${left[@]}"; do [ "$p" != "$pid" ] && kill -TERM "$p" 2>/dev/null; done
        fi
      fi
    done
    left=("${still[@]}")
    [ ${#left[@]} -gt 0 ] && sleep 0.5
  done
  return $rc
}

show_fail() {  # phase rc logs...
  local phase=$1 rc=$2
  shift 2
  [ "$rc" = 124 ] && echo "two-node check: $phase timed out after ${PHASE_TIMEOUT} s" \
    || echo "two-node check: $phase failed (rc $rc)"
  for f in "$@"; do [ -f "$f" ] && { echo "--- $f (last lines)"; grep -v -i warn "$f" | tail -n 25; }; done
}

ONE=("$DIR/one_node.log")
TWO=("$DIR/two_nodes.node0.log" "$DIR/two_nodes.node1.log")
start_one() {  # phase 1: one node of N processes
  launch 1 0 "$N" "$(free_port)" "$DIR/one_node.json" "${ONE[0]}"
  PIDS+=($!)
}
start_two() {  # phase 2: two nodes of N/2 processes each, started together, rendezvous on 127.0.0.1:port
  local port
  port=$(free_port)
  launch 2 0 $((N / 2)) "$port" "$DIR/two_nodes.json" "${TWO[0]}"
  PIDS+=($!)
  launch 2 1 $((N / 2)) "$port" "$DIR/two_nodes.json" "${TWO[1]}"
  PIDS+=($!)
}
run_phase() {  # label, the start functions to run together, then the phase's logs
  local label=$1 starts=$2 t0 rc
  shift 2
  t0=$(date +%s)
  PIDS=()
  for start in $starts; do $start; done
  wait_all "${PIDS[@]}"
  rc=$?
  echo "$label: rc $rc in $(($(date +%s) - t0)) s"
  if [ $rc != 0 ]; then show_fail "$label" $rc "$@"; exit 1; fi
}
if [ "$CONCURRENT" = 1 ]; then
  run_phase "1 node x $N and 2 nodes x $((N / 2)), run together" "start_one start_two" "${ONE[@]}" "${TWO[@]}"
else
  run_phase "phase 1, 1 node x $N" start_one "${ONE[@]}"
  run_phase "phase 2, 2 nodes x $((N / 2))" start_two "${TWO[@]}"
fi

# Compare (rank 0 of each run wrote its JSON; floats in JSON round-trip exactly).
"$PY" - "$DIR/one_node.json" "$DIR/two_nodes.json" "$N" <<'EOF'
import json
import sys

one, two = (json.load(open(p)) for p in sys.argv[1:3])
n = int(sys.argv[3])
a, b = one["losses"], two["losses"]
print(f"losses, 1 node x {n}:  {a!r}")
print(f"losses, 2 nodes x {n // 2}: {b!r}")
print(f"param checksum, 1 node:  {one.get('param_checksum')}")
print(f"param checksum, 2 nodes: {two.get('param_checksum')}")
problems = []
if (one["world"], one["ep"]) != (two["world"], two["ep"]):
    problems.append(f"world/EP differ: {one['world']}/{one['ep']} vs {two['world']}/{two['ep']}")
if a != b:
    diffs = [abs(x - y) for x, y in zip(a, b)]
    first = next((i for i, d in enumerate(diffs) if d != 0), len(diffs))
    problems.append(
        f"losses differ: {len(a)} vs {len(b)} steps, first at step {first + 1}, max |diff| {max(diffs, default=0):.3e}"
    )
if one.get("param_checksum") != two.get("param_checksum"):
    problems.append("final parameters differ (checksum)")
if problems:
    print("two-node check: DIFFERENT: " + "; ".join(problems))
    sys.exit(1)
print(f"two-node check: equal ({len(a)} losses bitwise equal, final parameters equal)")
EOF
rc=$?
echo "two-node check: total $(($(date +%s) - t_start)) s"
exit $rc
