#!/usr/bin/env bash
# Megatron-LM's own launcher with the plugin spec, on one GPU host (device tool, nvidia-h200-x4).
# Needs Megatron-LM's pretrain_gpt.py, gpt_builders.py and model_provider.py (branch core_r0.19.0; in no wheel)
# in $MLM (default ./.mlm), and megatron-core >= 0.19 (megatron.training is in its wheel). Usage:
#   source .devbundle/setup.sh; bash scripts/gpu_pretrain_gpt.sh [extra pretrain_gpt.py flags]
# Env: NPROC (4), EP (4), ITERS (20), OUT. Prints Megatron's iteration log (loss, ms/iteration).
set -uo pipefail
MLM=${MLM:-$PWD/.mlm}
NPROC=${NPROC:-4}; EP=${EP:-4}; ITERS=${ITERS:-20}
export PYTHONPATH=$MLM:$PWD${PYTHONPATH:+:$PYTHONPATH} CUDA_DEVICE_MAX_CONNECTIONS=1
# The megatron-core wheel lacks the dataset helpers' sources that pretrain_gpt.py compiles at start: take them
# from the same Megatron-LM branch ($MLM/datasets_Makefile, $MLM/datasets_helpers.cpp).
ds=$(python3 -c "import os, megatron.core.datasets as d; print(os.path.dirname(d.__file__))" 2>/dev/null)
if [ -n "$ds" ] && [ ! -f "$ds/Makefile" ] && [ -f "$MLM/datasets_Makefile" ]; then
  cp "$MLM/datasets_Makefile" "$ds/Makefile"; cp "$MLM/datasets_helpers.cpp" "$ds/helpers.cpp"
fi
python3 -m torch.distributed.run --nproc-per-node "$NPROC" --master-port 29541 "$MLM/pretrain_gpt.py" \
  --num-layers 2 --hidden-size 1024 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 \
  --micro-batch-size 4 --global-batch-size 16 --train-iters "$ITERS" --lr 3e-4 --min-lr 3e-5 \
  --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0 \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 \
  --num-experts 16 --moe-router-topk 4 --moe-ffn-hidden-size 512 --expert-model-parallel-size "$EP" \
  --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 \
  --moe-router-dtype fp32 --swiglu --disable-bias-linear --normalization RMSNorm \
  --position-embedding-type rope --untie-embeddings-and-output-weights --bf16 \
  --transformer-impl local --no-gradient-accumulation-fusion \
  --no-masked-softmax-fusion --no-bias-swiglu-fusion --no-persist-layer-norm --no-rope-fusion \
  --spec sonic_megatron.spec sonic_block_spec \
  --log-interval 1 --eval-iters 0 --eval-interval 1000000 --log-throughput "$@"
