#!/usr/bin/env bash
# plan_stream side vs current on 2 GPUs (nvidia-h200-x2): repeated steps bitwise (gpu_plan_stream_check.py), then
# timed paired in the same rounds; T = 32768 first, re-run under CUDA_LAUNCH_BLOCKING=1 if it fails; then T = 16384 and the
# host cost of the side-stream calls (gpu_side_stream_cost.py). Usage (device): bash scripts/device_pass.sh ps bash scripts/gpu_plan_stream.sh
set -u
C="--hidden 1536 --ffn 256 --experts 128 --topk 8 --no-baseline"
run() {  # name limit args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" torchrun --nproc_per_node 2 -m sonic_megatron bench layer "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name rc $rc"; grep -E "^ +ours|^provider|illegal|Error" "$OUT/$name.log" | head -20
  return $rc
}
python3 -m pytest -q tests/test_cute_gpu.py -k "side_stream" > "$OUT/pytest.log" 2>&1; tail -2 "$OUT/pytest.log"
timeout 150 torchrun --nproc_per_node 2 scripts/gpu_plan_stream_check.py > "$OUT/check.log" 2>&1; echo "check rc $?"
grep -E "PASS|FAIL|illegal" "$OUT/check.log" | head -3
if ! run layer32k 150 --tokens 32768 $C --chunks 1i --comm-sms 32 --plan-stream side,current --iters 30; then
  CUDA_LAUNCH_BLOCKING=1 run layer32k_blocking 150 --tokens 32768 $C --chunks 1i --comm-sms 32 --plan-stream side --iters 3
  run layer32k_current 150 --tokens 32768 $C --chunks 1i --comm-sms 32 --plan-stream current --iters 10
fi
run layer16k 200 --tokens 16384 $C --chunks 1,1i --comm-sms 32 --plan-stream side,current --iters 40
python3 scripts/gpu_side_stream_cost.py > "$OUT/side_cost.txt" 2>&1; cat "$OUT/side_cost.txt"
