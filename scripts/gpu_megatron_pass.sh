#!/usr/bin/env bash
# The lead's one-call Megatron pass on nvidia-h200-x4 (megatron-core 0.19.2 from the bundle): Megatron-LM's own
# pretrain_gpt.py with --spec sonic_megatron.spec sonic_block_spec (time-limited), then scripts/gpu_megatron.py.
# Usage: source .devbundle/setup.sh; bash scripts/device_pass.sh megatron bash scripts/gpu_megatron_pass.sh
set -uo pipefail
timeout -k 5 "${PRETRAIN_S:-80}" bash scripts/gpu_pretrain_gpt.sh > "$OUT/pretrain_gpt.log" 2>&1
echo "pretrain_gpt.py --spec sonic_megatron.spec sonic_block_spec: rc $?"
grep -E "iteration +[0-9]+/|Error|error|Traceback" "$OUT/pretrain_gpt.log" | grep -vi warn | tail -25
pkill -f pretrain_gpt.py; sleep 1
python3 scripts/gpu_megatron.py
