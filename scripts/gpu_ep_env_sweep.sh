#!/usr/bin/env bash
# NCCL / PyTorch environment sweep for the EP layer at the issue-4 size, one device call (nvidia-h200-x4):
#   source .devbundle/setup.sh; bash scripts/device_pass.sh envsweep bash scripts/gpu_ep_env_sweep.sh
# Per variant (each its own torchrun, since NCCL reads its environment at communicator creation):
#   bench dispatch (all-to-all time and GB/s; DISPATCH=0 skips it) and bench layer $LAYER_ARGS (default: 1 and 2
#   chunks, comm_sms 0 and 32, --no-baseline), JSON under $OUT/<variant>-dispatch.json and
#   $OUT/<variant>-T<tokens>-layer.json.
#   CE_PROBE=1 first runs scripts/gpu_ce_probe.py (copy-engine all-to-all).
# TOKENS (default 16384): tokens per rank. VARIANTS picks a subset by name; TOTAL_S (default 540) caps the
# whole sweep, LAYER_S (default 70) one bench layer; a variant that does not fit in what is left is skipped.
set -uo pipefail
out=${OUT:-$PWD/out}
mkdir -p "$out"
tokens=${TOKENS:-16384}
C="--tokens $tokens --hidden 1536 --ffn 256 --experts 128 --topk 8"
total=${TOTAL_S:-540}
start=$(date +%s)
left() { echo $(( total - ($(date +%s) - start) )); }

declare -A ENVS=(
  [default]=""
  [highprio]="TORCH_NCCL_HIGH_PRIORITY=1"
  [simple]="NCCL_PROTO=Simple"
  [chunk1m]="NCCL_P2P_NVL_CHUNKSIZE=1048576"
  [chunk2m]="NCCL_P2P_NVL_CHUNKSIZE=2097152"
  [p2pch32]="NCCL_MIN_P2P_NCHANNELS=32 NCCL_MAX_P2P_NCHANNELS=32"
  [cememcpy]="NCCL_P2P_USE_CUDA_MEMCPY=1 NCCL_CREATE_THREAD_CONTEXT=1"
)
order=${VARIANTS:-default,highprio,simple,chunk2m,p2pch32,cememcpy}
layer_args=${LAYER_ARGS:---chunks 1,2 --comm-sms 0,32 --no-baseline}
layer_s=${LAYER_S:-70}

if [ "${CE_PROBE:-0}" = 1 ]; then
  echo "=== ce probe"
  timeout 90 python3 scripts/gpu_ce_probe.py --json "$out/ce_probe.json" > "$out/ce_probe.log" 2>&1
  echo "ce probe rc $?"; tail -25 "$out/ce_probe.log"
fi

for v in ${order//,/ }; do
  if [ "$(left)" -lt 75 ]; then echo "=== $v: skipped ($(left) s left)"; continue; fi
  e=${ENVS[$v]}
  extra=""
  [ "$v" = default ] && extra="NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING"
  echo "=== $v: $e"
  if [ "${DISPATCH:-1}" = 1 ]; then
    lim=$(( $(left) < 40 ? $(left) : 40 ))
    env $e $extra timeout "$lim" python3 -m torch.distributed.run --nproc_per_node 4 -m sonic_megatron bench dispatch \
      $C --json "$out/$v-dispatch.json" > "$out/$v-dispatch.log" 2>&1
    echo "dispatch rc $?"; grep -E "ours \(dedup\)|megatron alltoall|bytes ours" "$out/$v-dispatch.log"
    [ "$v" = default ] && grep -E "NCCL version|nChannels|p2p|P2P" "$out/$v-dispatch.log" | sort -u | head -20
  fi
  lim=$(( $(left) < layer_s ? $(left) : layer_s ))
  env $e timeout "$lim" python3 -m torch.distributed.run --nproc_per_node 4 -m sonic_megatron bench layer \
    $C --backend auto $layer_args --json "$out/$v-T$tokens-layer.json" > "$out/$v-T$tokens-layer.log" 2>&1
  echo "layer rc $?"; grep -A24 "^provider" "$out/$v-T$tokens-layer.log" | head -26
done
echo "sweep done in $(( $(date +%s) - start )) s"
