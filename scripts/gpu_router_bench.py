"""Router top-K + softmax on one GPU: torch (``topk`` + fp32 softmax, as bench experts' ``_router`` after the
matmul) against our fused kernel (kernels/triton/topk_softmax.py), forward and forward+backward. A device tool,
not a test. Also sweeps the kernel's rows per program (forward and backward kernels alone) and checks that
both give the same scores and the same selected logits.

    source .devbundle/setup.sh; python3 scripts/gpu_router_bench.py $OUT/router.json

Columns: ``*_ms`` median of ``triton.testing.do_bench``; ``GBps`` the forward's bytes (logits read, fp32
scores + int64 indices written) over the time; ``rows`` the rows per program (``auto``: the default).
"""

from __future__ import annotations

import sys

import torch
from sonic_megatron.kernels.triton.topk_softmax import topk_softmax, topk_softmax_bwd, topk_softmax_fwd
from triton.testing import do_bench

from sonic_megatron.bench.common import print_table, write_json

CONFIGS = ((32768, 64, 8), (24576, 128, 8), (32768, 128, 8))  # (T, E, K)
ROWS = (2, 4, 8, 16, 32, 64, 128)
COLUMNS = ["T", "E", "K", "impl", "rows", "fwd_ms", "fwdbwd_ms", "bwd_kernel_ms", "GBps"]
COLUMNS += ["vs_torch_fwd", "vs_torch_fwdbwd"]


def _torch_router(logits_TE: torch.Tensor, k: int):
    top, idx = logits_TE.topk(k, dim=-1)
    return torch.softmax(top.float(), dim=-1), idx


def _bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def _check(logits_TE: torch.Tensor, k: int) -> dict:
    """Same scores as torch (to fp32 rounding) and the same selected logit values (indices may differ on ties)."""
    s_ref, i_ref = _torch_router(logits_TE, k)
    s, i = topk_softmax(logits_TE, k)
    same_vals = torch.equal(logits_TE.gather(1, i), logits_TE.gather(1, i_ref))
    distinct = bool((i.sort(dim=1).values.diff(dim=1) > 0).all()) if k > 1 else True
    return {"max_score_diff": (s - s_ref).abs().max().item(), "same_selected": same_vals, "distinct": distinct}


def _config_rows(T: int, E: int, K: int, gen: torch.Generator) -> list[dict]:
    logits = torch.randn(T, E, device="cuda", generator=gen).bfloat16().requires_grad_(True)
    x = logits.detach()
    g = torch.randn(T, K, device="cuda", generator=gen)
    base = {"T": T, "E": E, "K": K}
    check = _check(x, K)
    print(base, check, flush=True)

    def fwdbwd(fn):
        def step():
            s, _ = fn(logits, K)
            torch.autograd.grad(s, logits, g)

        return step

    with torch.no_grad():
        t_fwd = _bench(lambda: _torch_router(logits, K))
        o_fwd = _bench(lambda: topk_softmax(logits, K))
    torch_row = {**base, "impl": "torch", "fwd_ms": t_fwd, "fwdbwd_ms": _bench(fwdbwd(_torch_router))}
    ours_row = {**base, "impl": "ours", "rows": "auto", "fwd_ms": o_fwd, "fwdbwd_ms": _bench(fwdbwd(topk_softmax))}
    ours_row.update(check)
    out = [torch_row, ours_row]
    for r in ROWS:
        s, i = topk_softmax_fwd(x, K, rows_per_program=r)
        fwd_ms = _bench(lambda r=r: topk_softmax_fwd(x, K, rows_per_program=r))
        bwd_ms = _bench(lambda r=r, s=s, i=i: topk_softmax_bwd(g, s, i, E, x.dtype, rows_per_program=r))
        out.append({**base, "impl": "ours kernels", "rows": r, "fwd_ms": fwd_ms, "bwd_kernel_ms": bwd_ms})
    nbytes = T * E * x.element_size() + T * K * (4 + 8)
    for row in out:
        row["GBps"] = nbytes / (row["fwd_ms"] * 1e-3) / 1e9
        row["vs_torch_fwd"] = t_fwd / row["fwd_ms"]
        if "fwdbwd_ms" in row:
            row["vs_torch_fwdbwd"] = torch_row["fwdbwd_ms"] / row["fwdbwd_ms"]
    return out


def main(out_json: str | None) -> int:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for T, E, K in CONFIGS:
        cfg_rows = _config_rows(T, E, K, gen)
        rows.extend(cfg_rows)
        print_table(cfg_rows, COLUMNS)
        write_json(out_json, {"benchmark": "router_topk_softmax", "dtype": "bfloat16", "rows": rows})
    print("\nall configs:")
    print_table(rows, COLUMNS)
    return 0


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("gpu_router_bench.py needs a CUDA GPU")
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else None))
