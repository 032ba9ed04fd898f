#!/usr/bin/env bash
# The experts GPU pass on one Hopper GPU: environment, first-call compile time (cold, then warm cache in a new
# process), GPU tests, Triton kernels compiled, and `bench experts`. Logs and JSON go to $OUT; the QuACK/Triton
# compile caches are packed into $OUT/cutecache.tgz (when small); put it in $CACHE/ to start the next pass warm.
#
#   bash scripts/gpu_experts.sh --providers ours,bmm --rounds 3 --against sonic.json
# (sonic-moe 0.1.2 pins an older CuTe-DSL than the cute backend needs: run `bench experts --providers sonic,bmm
#  --json sonic.json` in an environment of its own first; its first call autotunes for minutes per config.)
# Env: OUT (default ./out), CACHE (default ./.cutecache; restored from it when carried), TOTAL_S (whole-script
#      budget, default 560), TEST_BUDGET_S (default 200), SKIP_TESTS=1, SKIP_COMPILE=1, PYTEST_ARGS (extra
#      pytest arguments). Every phase is cut at its budget so the later ones still run; the benchmark gets
#      what is left (minus 20 s to pack the caches) and writes its JSON after each config.
set -u
OUT=${OUT:-$PWD/out}
CACHE=${CACHE:-$PWD/.cutecache}
mkdir -p "$OUT" "$CACHE"
export QUACK_CACHE_DIR=$CACHE/quack TRITON_CACHE_DIR=$CACHE/triton QUACK_CACHE_AUTOTUNING=1
export PYTHONUNBUFFERED=1
mkdir -p "$QUACK_CACHE_DIR" "$TRITON_CACHE_DIR"
T0=$(date +%s)
phase() { echo "=== $1 (t+$(( $(date +%s) - T0 ))s)"; }
left() { echo $(( ${TOTAL_S:-560} - ($(date +%s) - T0) - 20 )); }
budget() { local l; l=$(left); [ "$1" -lt "$l" ] && echo "$1" || echo "$(( l > 1 ? l : 1 ))"; }
if [ -f "$CACHE/cutecache.tgz" ]; then tar -xzf "$CACHE/cutecache.tgz" -C "$CACHE" && rm "$CACHE/cutecache.tgz"; fi

phase env
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -m sonic_megatron env; } 2>&1 | tee "$OUT/env.log"
echo "cache before: $(du -sh "$CACHE" | cut -f1)" | tee -a "$OUT/env.log"

phase "first call (cold or carried cache), then warm cache in a fresh process"
cat > /tmp/first_call.py <<'PY'
import json, sys, time
import torch
t0 = time.perf_counter()
from sonic_megatron.kernels import TopKRouting, moe_experts
import sonic_megatron.kernels.cute  # noqa: F401
t_import = time.perf_counter() - t0
T, d, n, E, K = (int(v) for v in sys.argv[1].split(","))
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(T, d, device="cuda", generator=g).bfloat16().requires_grad_()
w1 = (torch.randn(E, 2 * n, d, device="cuda", generator=g) * d**-0.5).bfloat16().requires_grad_()
w2 = (torch.randn(E, d, n, device="cuda", generator=g) * n**-0.5).bfloat16().requires_grad_()
idx = torch.rand(T, E, device="cuda", generator=g).argsort(-1)[:, :K]
s = torch.softmax(torch.randn(T, K, device="cuda", generator=g), -1).requires_grad_()
torch.cuda.synchronize(); t1 = time.perf_counter()
moe_experts(x, TopKRouting(s, idx), w1, w2, backend="cute").backward(torch.randn(T, d, device="cuda").bfloat16())
torch.cuda.synchronize(); t2 = time.perf_counter()
moe_experts(x, TopKRouting(s, idx), w1, w2, backend="cute").backward(torch.randn(T, d, device="cuda").bfloat16())
torch.cuda.synchronize(); t3 = time.perf_counter()
print(json.dumps({"config": sys.argv[1], "import_s": t_import, "first_fwd_bwd_s": t2 - t1, "second_fwd_bwd_s": t3 - t2}))
PY
for run in 1 2; do
  [ "${SKIP_COMPILE:-0}" = 1 ] && break
  timeout "$(budget 150)" python3 /tmp/first_call.py 24576,1536,256,128,8 2>&1 | tee -a "$OUT/compile.log"
done

phase "GPU tests"
[ "${SKIP_TESTS:-0}" = 1 ] || timeout "$(budget "${TEST_BUDGET_S:-200}")" python3 -m pytest -q -rfEs tests/test_cute_gpu.py tests/test_triton_interpret.py \
  tests/test_triton_topk_softmax.py \
  --junitxml="$OUT/pytest.xml" ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log"

phase "bench experts"
timeout "$(budget 100000)" python3 -m sonic_megatron bench experts --json "$OUT/bench.json" "$@" 2>&1 \
  | tee "$OUT/bench.log"

phase "pack caches"
du -sh "$CACHE"/* | tee -a "$OUT/env.log"
tar -czf /tmp/cutecache.tgz -C "$CACHE" . && size=$(stat -c %s /tmp/cutecache.tgz) && echo "cache tgz $size bytes" \
  && if [ "$size" -lt 15000000 ]; then cp /tmp/cutecache.tgz "$OUT/"; fi
phase done
