#!/usr/bin/env bash
# Multi-node GPT-MoE training with the Sonic MoE layers: run once per node with the same MASTER_ADDR/MASTER_PORT.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 PRESET=qwen3-small bash examples/train_multi_node.sh   # on node0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 PRESET=qwen3-small bash examples/train_multi_node.sh   # on node1
# Two "nodes" on one host (a multi-node launch in small; MASTER_ADDR 127.0.0.1 or localhost), both in the background:
#   for n in 0 1; do NNODES=2 NODE_RANK=$n MASTER_ADDR=127.0.0.1 GPUS=2 PRESET=tiny STEPS=10 LOG_DIR=out/mn \
#     bash examples/train_multi_node.sh & done; wait
# On one host each node takes its own GPUs (CUDA_VISIBLE_DEVICES = GPUs NODE_RANK*GPUS .. +GPUS-1, unless set;
# GPUS defaults to the host's GPUs / NNODES); SAME_HOST=1/0 overrides the loopback test. Without GPUs it runs on
# CPU (gloo, torch backend, GPUS=1 process per node; PRESET=tiny).
# EP defaults to all processes of all nodes (GPUS * NNODES, expert parallelism across nodes); EP=8 keeps it
# intra-node. MASTER_PORT (default 29500) must be free on MASTER_ADDR; RDZV_TIMEOUT (s, default 600) bounds the
# wait for the other nodes. LOG_DIR: each node's output goes to $LOG_DIR/node$NODE_RANK.log instead of the terminal.
# PYTHON (default python3). Presets and SONIC_MEGATRON_* options as in train_single_node.sh; extra arguments go
# to examples/pretrain_gpt_sonic.py.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
PY=${PYTHON:-python3}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_TIMEOUT=${RDZV_TIMEOUT:-600}
PRESET=${PRESET:-olmoe-small}
STEPS=${STEPS:-100}
SPEC=${SPEC:-sonic}
if [ "$NODE_RANK" -lt 0 ] || [ "$NODE_RANK" -ge "$NNODES" ]; then
  echo "train_multi_node.sh: NODE_RANK=$NODE_RANK is not in 0..$((NNODES - 1))" >&2
  exit 2
fi
case "$MASTER_ADDR" in 127.* | localhost | ::1) LOOPBACK=1 ;; *) LOOPBACK=0 ;; esac
SAME_HOST=${SAME_HOST:-$LOOPBACK}
# GPUs this launcher may use: those in CUDA_VISIBLE_DEVICES when set, else all of the host's (nvidia-smi, which
# answers in a fraction of torch's import time; torch where it is missing).
if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
  HOST_GPUS=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .) || true
elif command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  HOST_GPUS=$(nvidia-smi -L | grep -c '^GPU') || true
else
  HOST_GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
fi
if [ -z "${GPUS:-}" ]; then
  if [ "$HOST_GPUS" = 0 ]; then
    GPUS=1
  elif [ "$SAME_HOST" = 1 ] && [ -z "${CUDA_VISIBLE_DEVICES:-}" ]; then
    GPUS=$((HOST_GPUS / NNODES))
  else
    GPUS=$HOST_GPUS
  fi
fi
if [ "$GPUS" -lt 1 ]; then
  echo "train_multi_node.sh: $HOST_GPUS GPUs on this host are too few for $NNODES nodes on it" >&2
  exit 2
fi
if [ "$HOST_GPUS" -gt 0 ] && [ "$SAME_HOST" = 1 ] && [ -z "${CUDA_VISIBLE_DEVICES:-}" ]; then
  first=$((NODE_RANK * GPUS))
  if [ $((first + GPUS)) -gt "$HOST_GPUS" ]; then
    echo "train_multi_node.sh: node $NODE_RANK needs GPUs $first..$((first + GPUS - 1)), the host has $HOST_GPUS" >&2
    exit 2
  fi
  CUDA_VISIBLE_DEVICES=$(seq -s, "$first" $((first + GPUS - 1)))
  export CUDA_VISIBLE_DEVICES
fi
# Several launchers on one host: one thread per process unless set (torchrun sets that only for >1 process per node).
if [ "$SAME_HOST" = 1 ] && [ "$NNODES" -gt 1 ]; then export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}; fi
EP=${EP:-$((GPUS * NNODES))}
EXTRA=()
if [ "${OVERLAP:-0}" = 1 ]; then EXTRA+=(--overlap-moe-expert-parallel-comm --delay-wgrad-compute); fi
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
CMD=("$PY" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS"
  --rdzv-backend static --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --rdzv-conf "timeout=$RDZV_TIMEOUT"
  examples/pretrain_gpt_sonic.py --preset "$PRESET" --ep "$EP" --steps "$STEPS" --spec "$SPEC"
  --use-distributed-optimizer "${EXTRA[@]}" "$@")
echo "train_multi_node.sh: node $NODE_RANK/$NNODES, $GPUS processes, EP $EP, master $MASTER_ADDR:$MASTER_PORT," \
  "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-<unset>}${LOG_DIR:+, log $LOG_DIR/node$NODE_RANK.log}"
if [ -n "${LOG_DIR:-}" ]; then
  mkdir -p "$LOG_DIR"
  exec "${CMD[@]}" >"$LOG_DIR/node$NODE_RANK.log" 2>&1
fi
exec "${CMD[@]}"
