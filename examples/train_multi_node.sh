#!/usr/bin/env bash
# Multi-node GPT-MoE training with the Sonic MoE layers: run once per node with the same MASTER_ADDR.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 PRESET=qwen3-small bash examples/train_multi_node.sh   # on node0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 PRESET=qwen3-small bash examples/train_multi_node.sh   # on node1
# EP defaults to all GPUs of all nodes (expert parallelism across nodes); set EP=8 to keep it intra-node.
# Presets and SONIC_MEGATRON_* options as in train_single_node.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
MASTER_PORT=${MASTER_PORT:-29500}
PRESET=${PRESET:-olmoe-small}
GPUS=${GPUS:-$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")}
EP=${EP:-$((GPUS * NNODES))}
STEPS=${STEPS:-100}
SPEC=${SPEC:-sonic}
EXTRA=()
if [ "${OVERLAP:-0}" = 1 ]; then EXTRA+=(--overlap-moe-expert-parallel-comm --delay-wgrad-compute); fi
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
exec python -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  examples/pretrain_gpt_sonic.py --preset "$PRESET" --ep "$EP" --steps "$STEPS" --spec "$SPEC" \
  --use-distributed-optimizer "${EXTRA[@]}" "$@"
