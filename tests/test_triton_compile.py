"""The expert-parallel send-side Triton kernels compiled for Hopper (sm_90) down to a cubin, on any machine: Triton's
front end and ptxas (bundled with Triton) run without a GPU. The interpreter tests check what the kernels compute;
this catches what only the compiler rejects (a constexpr branch, a helper's types, a bitcast of the wrong width)
before a GPU sees the code. The compiles run in a child process without TRITON_INTERPRET (under the interpreter
``triton.jit`` gives functions that cannot be compiled)."""

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

I64, I32 = "*i64", "*i32"
PLACE = dict(
    row_base_ptr=I64,
    pair_base_ptr=I64,
    tile_base_ptr=I64,
    offsets_ptr=I64,
    order_ptr=I64,
    send_tok_ptr=I64,
    comb_order_ptr=I64,
    meta_ptr=I32,
)
SCORES = {"fp32": dict(IS_F64=False, IS_BF16=False, CC=3), "bf16": dict(IS_F64=False, IS_BF16=True, CC=3)}
SCORES["fp64"] = dict(IS_F64=True, IS_BF16=False, CC=4)
COUNTS = dict(cnt_rows_ptr=I32, cnt_pairs_ptr=I32, tile_rows_ptr=I32, tile_stats_ptr=I64)
SCAN = dict(
    cnt_rows_ptr=I32,
    cnt_pairs_ptr=I32,
    tile_rows_ptr=I32,
    row_base_ptr=I64,
    pair_base_ptr=I64,
    rows_NP_ptr=I64,
    pairs_NP_ptr=I64,
    tile_base_ptr=I64,
    offsets_ptr=I64,
    tile_stats_ptr=I64,
    minmax_ptr=I64,
    dup_ptr=I64,
)


def _cases():
    """(module, kernel, argument types (default i64), constexprs) of every compile."""
    cases = []
    for score, flags in SCORES.items():
        types = dict(PLACE, idx_ptr=I64, score_ptr="*" + score)
        cases.append(("triton_send", "_place_kernel", types, dict(K=8, BT=128, PP=4, FILL=1024, **flags)))
        types = dict(PLACE, exp_ptr=I64, offsets_in_ptr=I32, score_ptr="*" + score)
        cases.append(("triton_send_csr", "_place_csr_kernel", types, dict(BT=64, PP=8, FILL=256, **flags)))
    cases.append(("triton_send", "_count_kernel", dict(COUNTS, idx_ptr=I64), dict(K=8, KP=8, BT=128, PP=4)))
    types = dict(COUNTS, exp_ptr=I64, offsets_in_ptr=I64)
    cases.append(("triton_send_csr", "_count_csr_kernel", types, dict(BT=128, PP=4)))
    cases.append(("triton_send", "_scan_kernel", SCAN, dict(NPB=4, TB=512, B1=2048)))
    return cases


def _compile_all() -> dict:
    """In the child: compile every case; returns {case: "ok" or the error's last lines, or "skip: why"}."""
    import importlib

    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia import compiler as _nvidia  # noqa: F401
        from triton.compiler import ASTSource
    except ImportError as exc:  # a Triton build without the NVIDIA backend
        return {"all": f"skip: Triton's NVIDIA backend is not importable here: {exc}"}
    results = {}
    for module, name, types, constexprs in _cases():
        fn = getattr(importlib.import_module(f"sonic_megatron.token_dispatch.{module}"), name)
        signature = {n: types.get(n, "i64") for n in fn.arg_names if n not in constexprs}
        signature.update({n: "constexpr" for n in constexprs})
        key = f"{name} {constexprs}"
        try:
            index = {(fn.arg_names.index(n),): v for n, v in constexprs.items()}
            kernel = triton.compile(ASTSource(fn, signature, constexprs=index), target=GPUTarget("cuda", 90, 32))
            results[key] = "ok" if kernel.asm.get("cubin") else "no cubin"
        except Exception as exc:  # noqa: BLE001 - reported to the test verbatim
            results[key] = f"{type(exc).__name__}: {str(exc)[-800:]}"
    return results


def test_send_side_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    if list(results) == ["all"] and results["all"].startswith("skip:"):
        pytest.skip(results["all"][5:])
    bad = {k: v for k, v in results.items() if v != "ok"}
    assert not bad, bad
    assert len(results) == len(_cases())


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
