#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py of megatron-core 0.18 (branch core_r0.18.0) with the plugin's READY spec,
# `--spec sonic_megatron.spec sonic_local_layer_spec`: the path of 0.16-0.18, whose gpt_builders.py passes
# import_module(args.spec) to GPTModel as is (0.19 calls a function instead: scripts/gpu_pretrain_gpt.sh).
#
# Two modes:
#   bash scripts/gpu_pretrain_gpt_legacy.sh prepare    # here (registry + Megatron-LM mirror): builds
#        $LEGACY_TAR (default .mlm/legacy/mcore-0.18.tar.xz, ~1.2 MB): the megatron-core 0.18.2 wheel
#        (megatron/core and megatron/training; a wheel is zip, 2.0 MB: xz makes it fit the device call) plus
#        pretrain_gpt.py, gpt_builders.py, model_provider.py and the dataset helpers' sources of core_r0.18.0.
#   source .devbundle/setup.sh; bash scripts/gpu_pretrain_gpt_legacy.sh [extra pretrain_gpt.py flags]
#        on the device (nvidia-h200-x4, carry .devbundle and .mlm): unpacks it into a private prefix that goes
#        FIRST on PYTHONPATH (ahead of the bundle's megatron-core 0.19.2) and runs ~10 iterations at EP=4.
# Env: NPROC (4), EP (4), ITERS (10), OUT (log: $OUT/pretrain_gpt_legacy.log), LEGACY_TAR, MIRROR.
set -uo pipefail
LEGACY_TAR=${LEGACY_TAR:-$PWD/.mlm/legacy/mcore-0.18.tar.xz}

if [ "${1:-}" = prepare ]; then
  set -e
  MIRROR=${MIRROR:-/work/.mirror/NVIDIA+Megatron-LM/repo}
  tmp=$(mktemp -d)
  python3 -m pip download "megatron-core==0.18.2" --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 -d "$tmp/whl" -q
  mkdir -p "$tmp/p"
  (cd "$tmp/p" && python3 -m zipfile -e "$tmp"/whl/megatron_core-0.18.2-*.whl .)
  git -C "$MIRROR" archive core_r0.18.0 pretrain_gpt.py gpt_builders.py model_provider.py \
    megatron/core/datasets/Makefile megatron/core/datasets/helpers.cpp | tar -x -C "$tmp/p"
  mkdir -p "$(dirname "$LEGACY_TAR")"
  tar -cJf "$LEGACY_TAR" -C "$tmp/p" --exclude=__pycache__ .
  rm -rf "$tmp"
  ls -l "$LEGACY_TAR"
  exit 0
fi

NPROC=${NPROC:-4}; EP=${EP:-4}; ITERS=${ITERS:-10}; OUT=${OUT:-$PWD/out}
source "$(dirname "$0")/pretrain_gpt_args.sh"
mkdir -p "$OUT"
[ -f "$LEGACY_TAR" ] || { echo "missing $LEGACY_TAR: run 'bash $0 prepare' where the registry is reachable"; exit 2; }
PREFIX=${TMPDIR:-/tmp}/mcore-legacy-0.18
if [ ! -f "$PREFIX/.ready" ]; then
  rm -rf "$PREFIX"; mkdir -p "$PREFIX" && tar -xJf "$LEGACY_TAR" -C "$PREFIX" && touch "$PREFIX/.ready"
fi
export PYTHONPATH=$PREFIX:$PWD${PYTHONPATH:+:$PYTHONPATH} CUDA_DEVICE_MAX_CONNECTIONS=1
python3 -c "import megatron.core as c, megatron.training as t; print('megatron-core', c.__version__, c.__file__, t.__file__)" \
  2>&1 | tee "$OUT/pretrain_gpt_legacy.log"
timeout -k 10 "${LIMIT_S:-150}" python3 -m torch.distributed.run --nproc-per-node "$NPROC" --master-port 29543 \
  "$PREFIX/pretrain_gpt.py" \
  "${PRETRAIN_GPT_ARGS[@]}" --spec sonic_megatron.spec sonic_local_layer_spec "$@" >> "$OUT/pretrain_gpt_legacy.log" 2>&1
rc=$?
echo "pretrain_gpt.py (core_r0.18.0, megatron-core 0.18.2) --spec sonic_megatron.spec sonic_local_layer_spec: rc $rc"
grep -E "megatron-core|iteration +[0-9]+/|Error|error|Traceback" "$OUT/pretrain_gpt_legacy.log" | grep -vi warn | tail -25
exit $rc
