#!/usr/bin/env bash
# Megatron-LM's own launcher with the plugin spec, on one GPU host (device tool, nvidia-h200-x4).
# Needs Megatron-LM's pretrain_gpt.py, gpt_builders.py and model_provider.py (branch core_r0.19.0; in no wheel)
# in $MLM (default ./.mlm), and megatron-core >= 0.19 (megatron.training is in its wheel). Usage:
#   source .devbundle/setup.sh; bash scripts/gpu_pretrain_gpt.sh [extra pretrain_gpt.py flags]
# Env: NPROC (4), EP (4), ITERS (20), OUT. Prints Megatron's iteration log (loss, ms/iteration).
set -uo pipefail
MLM=${MLM:-$PWD/.mlm}
NPROC=${NPROC:-4}; EP=${EP:-4}; ITERS=${ITERS:-20}
source "$(dirname "$0")/pretrain_gpt_args.sh"
export PYTHONPATH=$MLM:$PWD${PYTHONPATH:+:$PYTHONPATH} CUDA_DEVICE_MAX_CONNECTIONS=1
# The megatron-core wheel lacks the dataset helpers' sources that pretrain_gpt.py compiles at start: take them
# from the same Megatron-LM branch ($MLM/datasets_Makefile, $MLM/datasets_helpers.cpp).
ds=$(python3 -c "import os, megatron.core.datasets as d; print(os.path.dirname(d.__file__))" 2>/dev/null)
if [ -n "$ds" ] && [ ! -f "$ds/Makefile" ] && [ -f "$MLM/datasets_Makefile" ]; then
  cp "$MLM/datasets_Makefile" "$ds/Makefile"; cp "$MLM/datasets_helpers.cpp" "$ds/helpers.cpp"
fi
python3 -m torch.distributed.run --nproc-per-node "$NPROC" --master-port 29541 "$MLM/pretrain_gpt.py" \
  "${PRETRAIN_GPT_ARGS[@]}" --spec sonic_megatron.spec sonic_block_spec "$@"
