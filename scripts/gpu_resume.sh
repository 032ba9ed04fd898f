#!/usr/bin/env bash
# Resume after a crash on one GPU (cute backend, bf16): examples/pretrain_gpt_sonic.py trains STEPS iterations
# twice uninterrupted (the run-to-run noise), once with checkpoints every 2 iterations killed with SIGKILL after
# iteration KILL (between two checkpoints), and once resumed from that run's latest checkpoint. The resumed run's
# losses from the resume point on and its final parameter checksum are compared with the uninterrupted runs';
# the verdict (bitwise, or within the noise of the two uninterrupted runs) goes to OUTDIR/resume_summary.json.
# TRAINER_ARGS: more trainer flags for every run (--use-distributed-optimizer needs Apex or Transformer Engine here:
# over torch's Adam, Megatron's distributed optimizer cannot reload its own checkpoints and the trainer refuses it).
#   bash scripts/gpu_resume.sh OUTDIR            # tests/test_resume.py is the CPU (gloo, torch backend) version
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash scripts/gpu_resume.sh OUTDIR}
steps=${STEPS:-8}
kill_after=${KILL:-5}
mkdir -p "$out"
ckpt=$out/ckpt
rm -rf "$ckpt"
trainer() {  # log name, then trainer arguments
  local name=$1
  shift
  timeout 150 torchrun --nproc-per-node 1 --nnodes 1 --master-addr 127.0.0.1 --master-port $((29500 + RANDOM % 1000)) \
    examples/pretrain_gpt_sonic.py --steps "$steps" --deterministic ${TRAINER_ARGS:-} "$@" > "$out/$name.log" 2>&1
  echo "$name: rc $?"
}
trainer full1 --param-checksum --json "$out/full1.json"
trainer full2 --param-checksum --json "$out/full2.json"
trainer crash --save "$ckpt" --save-interval 2 --kill-after-iteration "$kill_after"
ls "$ckpt" > "$out/ckpt_listing.txt" 2>&1
trainer resumed --param-checksum --load "$ckpt" --json "$out/resumed.json"
python3 - "$out" "$steps" "$kill_after" <<'EOF'
import json, sys
from pathlib import Path

out, steps, kill_after = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
resume_at = kill_after // 2 * 2  # the crash run's last checkpoint
runs = {n: json.loads((out / f"{n}.json").read_text()) for n in ("full1", "full2", "resumed") if (out / f"{n}.json").exists()}
if set(runs) != {"full1", "full2", "resumed"}:
    summary = {"ok": False, "why": f"runs missing: have {sorted(runs)}"}
else:
    full, again, res = (runs[n]["losses"] for n in ("full1", "full2", "resumed"))
    start = runs["resumed"].get("start_iteration", 0)
    tail = full[start:]  # the resumed run logs the iterations after its checkpoint
    noise = max((abs(a - b) for a, b in zip(full, again)), default=0.0)
    diff = max((abs(a - b) for a, b in zip(tail, res)), default=0.0)
    same_params = runs["resumed"].get("param_checksum") == runs["full1"].get("param_checksum")
    summary = {
        "resumed_from_iteration": start,
        "expected_resume_iteration": resume_at,
        "resumed_iterations": len(res),
        "max_loss_diff_resumed_vs_full": diff,
        "max_loss_diff_full_vs_full": noise,
        "bitwise_losses": diff == 0.0,
        "bitwise_params": same_params,
        "uninterrupted_runs_bitwise": noise == 0.0 and runs["full1"].get("param_checksum") == runs["full2"].get("param_checksum"),
        # the resumed run must have loaded the crash run's checkpoint (from scratch it would equal trivially)
        "ok": start == resume_at > 0 and len(res) == steps - start
        and (diff <= noise if noise > 0 else diff == 0.0 and same_params),
    }
(out / "resume_summary.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary))
EOF
