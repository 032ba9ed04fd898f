#!/usr/bin/env bash
# Train a GPT-MoE with the Sonic MoE layers on one node (torchrun, one process per GPU).
#   PRESET=olmoe-small GPUS=8 EP=8 bash examples/train_single_node.sh [extra pretrain_gpt_sonic.py args]
# Presets (sonic_megatron/gpt.py): olmoe-small (OLMoE-1B-7B shape, 4 layers), qwen3-small (Qwen3-30B-A3B
# shape scaled down), deepseek-small (fine-grained experts + shared expert, first layer dense), tiny (CPU).
# Plugin options come from SONIC_MEGATRON_* variables, e.g. SONIC_MEGATRON_TOKEN_ROUNDING=nearest.
# SPEC=stock runs the same model with Megatron's MoE layer. OVERLAP=1 adds Megatron's 1F1B EP A2A overlap.
set -euo pipefail
cd "$(dirname "$0")/.."
PRESET=${PRESET:-olmoe-small}
GPUS=${GPUS:-$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")}
EP=${EP:-$GPUS}
STEPS=${STEPS:-100}
SPEC=${SPEC:-sonic}
EXTRA=()
if [ "${OVERLAP:-0}" = 1 ]; then EXTRA+=(--overlap-moe-expert-parallel-comm --delay-wgrad-compute); fi
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
exec python -m torch.distributed.run --standalone --nproc-per-node "$GPUS" \
  examples/pretrain_gpt_sonic.py --preset "$PRESET" --ep "$EP" --steps "$STEPS" --spec "$SPEC" \
  --use-distributed-optimizer "${EXTRA[@]}" "$@"
