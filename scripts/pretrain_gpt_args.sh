# Sourced by scripts/gpu_pretrain_gpt.sh and scripts/gpu_pretrain_gpt_legacy.sh: the shared Megatron-LM
# pretrain_gpt.py flags of the plugin's launcher checks (2-layer GPT-MoE, 16 experts top-4, mock data, local
# transformer implementation because the GPU machine has no Transformer Engine or apex). Needs ITERS and EP set.
PRETRAIN_GPT_ARGS=(
  --num-layers 2 --hidden-size 1024 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024
  --micro-batch-size 4 --global-batch-size 16 --train-iters "$ITERS" --lr 3e-4 --min-lr 3e-5
  --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0
  --mock-data --tokenizer-type NullTokenizer --vocab-size 32000
  --num-experts 16 --moe-router-topk 4 --moe-ffn-hidden-size 512 --expert-model-parallel-size "$EP"
  --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
  --moe-router-dtype fp32 --swiglu --disable-bias-linear --normalization RMSNorm
  --position-embedding-type rope --untie-embeddings-and-output-weights --bf16
  --transformer-impl local --no-gradient-accumulation-fusion
  --no-masked-softmax-fusion --no-bias-swiglu-fusion --no-persist-layer-norm --no-rope-fusion
  --log-interval 1 --eval-iters 0 --eval-interval 1000000 --log-throughput
)
