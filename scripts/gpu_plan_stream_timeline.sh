#!/usr/bin/env bash
# Host cost of plan_stream "side" (one GPU) and the interleaved step's per-phase timeline with each plan stream
# (2 GPUs). Usage (device, nvidia-h200-x2): bash scripts/device_pass.sh pst bash scripts/gpu_plan_stream_timeline.sh
set -u
python3 scripts/gpu_side_stream_cost.py 2>&1 | tee "$OUT/side_cost.txt"
for ps in current side; do
  TIMELINE_TAG=$ps timeout 120 torchrun --nproc_per_node 2 scripts/gpu_ep_timeline.py --out "$OUT" --schedules 1i \
    --steps 20 --plan-stream $ps > "$OUT/timeline_$ps.log" 2>&1
  echo "== $ps rc $?"; grep -B1 -A32 "schedule 1i overlap on" "$OUT/timeline_$ps.log" | grep -v "^--" | head -34
done
