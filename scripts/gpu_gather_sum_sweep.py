"""Launch-parameter sweep of the Triton gather-sum (``kernels/triton/gather_sum.py``) on real routing metadata,
next to sonic-moe 0.1.2's autotuned token gather-sum on the same inputs, for the forward O (weighted) and the
backward dX (plain) sums of the experts benchmark shapes. Every variant must be bitwise equal to the default
launch (same pair order and reduction tree); the script fails otherwise.

    source .devbundle/setup.sh; python3 scripts/gpu_gather_sum_sweep.py --out $OUT

Variants: BLOCK_D x num_warps x D_TILES (1 = one program per (token, D-block); all = one program per token
walking its D-blocks) x FIXED_K (0 = pair range from token_offsets; K = computed, top-K only).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.testing
from sonic_megatron.kernels.routing import TopKRouting, compute_metadata_torch, flatten_routing
from sonic_megatron.kernels.triton.gather_sum import _gather_sum_kernel, gather_sum

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run under TRITON_INTERPRET=1
SHAPES = ((24576, 1536, 8, 128), (32768, 2048, 8, 64), (32768, 4096, 8, 128))  # (T, D, K, E)


def _sonic_fn():
    try:
        from sonicmoe.functional.reduction_over_k_gather import token_gather_and_sum_varlen_K_triton
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        print(f"sonic-moe gather-sum not importable: {e!r}")
        return None
    return token_gather_and_sum_varlen_K_triton


def sweep_shape(T, D, K, E, has_w, sonic):
    torch.manual_seed(0)
    idx_TK = torch.rand(T, E, device=DEV).argsort(dim=1)[:, :K]  # K distinct experts per token
    tok_R, exp_R, _, tok_off = flatten_routing(TopKRouting(torch.rand(T, K, device=DEV), idx_TK))
    meta = compute_metadata_torch(tok_R, exp_R, tok_off, E)
    R = T * K
    rows = torch.randn(R, D, device=DEV).bfloat16()
    w = torch.rand(R, device=DEV) if has_w else None
    ref = gather_sum(rows, meta, w, pairs_per_token=K)
    bytes_moved = R * D * 2 + T * D * 2 + R * (8 if has_w else 4)
    out = torch.empty_like(ref)
    res = []

    def record(name, fn, **params):
        ms = triton.testing.do_bench(fn, warmup=25, rep=150) if DEV == "cuda" else (fn(), float("nan"))[1]
        res.append({"variant": name, **params, "ms": ms, "GBps": bytes_moved / ms / 1e6})
        print(f"  {name:8s} {params} {ms * 1e3:8.1f} us {bytes_moved / ms / 1e6:7.0f} GB/s", flush=True)

    record("current", lambda: gather_sum(rows, meta, w, pairs_per_token=K))
    for block_d in (256, 512, 1024, 2048) if DEV == "cuda" else (32, 64):
        if block_d > triton.next_power_of_2(D) or block_d * 8 > 16384:
            continue
        n_blocks = triton.cdiv(D, block_d)
        for warps in (1, 2, 4, 8):
            if block_d // (32 * warps) < 8 and DEV == "cuda":  # below 16-byte loads per thread
                continue
            for d_tiles in sorted({1, n_blocks}):
                for fixed_k in (0, K):

                    def go(block_d=block_d, warps=warps, d_tiles=d_tiles, fixed_k=fixed_k, n_blocks=n_blocks):
                        _gather_sum_kernel[(T, triton.cdiv(n_blocks, d_tiles))](
                            rows, w if has_w else rows, meta.s_reverse_scatter_idx, meta.token_offsets, out, D,
                            rows.stride(0), out.stride(0), HAS_W=has_w, FIXED_K=fixed_k, BLOCK_J=8,
                            BLOCK_D=block_d, D_TILES=d_tiles, num_warps=warps,
                        )  # fmt: skip

                    out.fill_(float("nan"))
                    go()
                    if not torch.equal(out, ref):
                        raise SystemExit(f"variant {block_d, warps, d_tiles, fixed_k} differs from the default launch")
                    record("ours", go, block_d=block_d, num_warps=warps, d_tiles=d_tiles, fixed_k=fixed_k)
    if sonic is not None:
        perm = meta.s_reverse_scatter_idx
        off = meta.token_offsets
        sout = torch.empty(T, D, device=DEV, dtype=torch.bfloat16)

        def sgo():
            sonic(rows, w, sout, perm, off, T, K, D, False)  # fixed top-K, as its forward calls it

        sgo()
        err = (sout - ref.float()).abs().max().item()
        print(f"  sonic max |diff| vs ours: {err:.3g}")
        record("sonic", sgo)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    sonic = _sonic_fn()
    report = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "shapes": {}}
    for T, D, K, E in SHAPES if DEV == "cuda" else ((5, 96, 3, 8),):
        for has_w in (True, False):
            key = f"T{T}_D{D}_K{K}_{'weighted' if has_w else 'plain'}"
            print(f"== {key}", flush=True)
            res = sweep_shape(T, D, K, E, has_w, sonic)
            best = min((r for r in res if r["variant"] == "ours"), key=lambda r: r["ms"])
            cur = next(r for r in res if r["variant"] == "current")
            print(f"  best ours {best} vs current {cur['ms'] * 1e3:.1f} us", flush=True)
            report["shapes"][key] = res
    with open(os.path.join(args.out, "gather-sum-sweep.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
