#!/usr/bin/env bash
# The expert-parallel end-to-end pass behind docs/PERF.md's "Expert parallelism in pretrain_gpt.py" table, on one
# host with NPROC GPUs (default 4): Megatron-LM's pretrain_gpt.py, plugin vs the grouped-GEMM baseline, in one run so
# that every ratio comes from the same machine:
#   1. qwen3 at EP = NPROC, 4 micro-batches per rank: one micro-batch at a time, then Megatron's 1F1B EP overlap
#      (--overlap-ep-comm), both profiled (GPU idle, all-to-all ms and the share of it beside compute)
#   2. sparse, the same, with token rounding in the first schedule (sonic-rounding)
#   3. qwen3 at EP 1 on one GPU (the per-GPU work of the EP rows)
#   4. the two-node launch check (scripts/two_node_check.sh)
# and, as phases to pick: the NCCL EP equivalence checks (check: scripts/gpu_ep.py check at EP = NPROC), qwen3 with
# expert tensor parallelism 2 on two GPUs (etp: TP 1, ETP 2, plugin vs grouped), the crash-resume check on one GPU
# (resume: scripts/gpu_resume.sh).
# Each phase has a time limit (PHASE_S seconds, default 200) and writes its JSON and log under OUTDIR as it ends;
# a failed phase is reported and the next one still runs. PHASES picks some (default: all, in this order:
# qwen3-ep qwen3-ep-overlap sparse-ep sparse-ep-overlap qwen3-ep1 two-node; also: check etp resume); the whole
# default pass takes about 12 minutes.
# E2E_EXTRA: more bench e2e flags for every phase (--dry-run prints the commands).
#   bash scripts/gpu_ep_e2e.sh OUTDIR [MEGATRON_LM_DIR]     # MEGATRON_LM_DIR: python -m sonic_megatron.bench.megatron_lm
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:?usage: bash scripts/gpu_ep_e2e.sh OUTDIR [MEGATRON_LM_DIR] (or OUT set)}}
mlm=${2:-.mlm}
nproc=${NPROC:-4}
phase_s=${PHASE_S:-200}
phases=${PHASES:-qwen3-ep qwen3-ep-overlap sparse-ep sparse-ep-overlap qwen3-ep1 two-node}
mkdir -p "$out"
e2e() {  # name, then bench e2e arguments
  local name=$1
  shift
  timeout "$phase_s" python3 -m sonic_megatron bench e2e --megatron-lm "$mlm" --iters 14 --warmup 3 \
    --json "$out/$name.json" --log-dir "$out/$name-logs" ${E2E_EXTRA:-} "$@" > "$out/$name.txt" 2>&1
  echo "$name: rc $?"
  grep -E "^ *(sonic|sonic-rounding|grouped) +ok" "$out/$name.txt" | head -3
}
ep="--nproc $nproc --ep $nproc --microbatches 4 --profile 3"
dry=$([[ " ${E2E_EXTRA:-} " == *" --dry-run "* ]] && echo 1)
run_or_print() {  # a phase's command: run it, or print it on a dry run
  if [ -n "$dry" ]; then echo "would run: $*"; else "$@"; fi
}
for phase in $phases; do
  case $phase in
    qwen3-ep) e2e "$phase" --config qwen3 $ep --providers sonic,grouped ;;
    qwen3-ep-overlap) e2e "$phase" --config qwen3 $ep --overlap-ep-comm --providers sonic,grouped ;;
    sparse-ep) e2e "$phase" --config sparse $ep --providers sonic,sonic-rounding,grouped ;;
    sparse-ep-overlap) e2e "$phase" --config sparse $ep --overlap-ep-comm --providers sonic,grouped ;;
    qwen3-ep1) CUDA_VISIBLE_DEVICES=0 e2e "$phase" --config qwen3 --nproc 1 --ep 1 --microbatches 4 --providers sonic,grouped ;;
    check)
      run_or_print timeout "$phase_s" torchrun --nproc_per_node "$nproc" scripts/gpu_ep.py check --out "$out" \
        > "$out/check.txt" 2>&1
      echo "check: rc $?"
      grep -A8 "^EP=" "$out/check.txt"
      ;;
    etp)
      e2e "$phase" --config qwen3 --nproc 2 --microbatches 4 --providers sonic,grouped \
        --pretrain-args "--tensor-model-parallel-size 1 --expert-tensor-parallel-size 2"
      ;;
    resume)
      CUDA_VISIBLE_DEVICES=0 run_or_print timeout "$phase_s" bash scripts/gpu_resume.sh "$out/resume" > "$out/resume.txt" 2>&1
      echo "resume: rc $?"
      tail -1 "$out/resume.txt"
      ;;
    two-node)
      TWO_NODE_DIR="$out/two-node" timeout "$phase_s" bash scripts/two_node_check.sh > "$out/two-node.txt" 2>&1
      echo "two-node: rc $?"
      tail -3 "$out/two-node.txt"
      ;;
    *) echo "gpu_ep_e2e: unknown phase $phase (known: qwen3-ep qwen3-ep-overlap sparse-ep sparse-ep-overlap qwen3-ep1 two-node check etp resume)" >&2 ;;
  esac
done
