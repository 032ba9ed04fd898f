"""Host time of each kernel call of the experts backend against the floor of its launch mechanism, on one GPU.

    source .devbundle/setup.sh; python3 scripts/gpu_host_floor.py [--rows 131072] [--experts 32] [--out $OUT]

The EP layer is host-bound (docs/PERF.md section 2): the slowest rank's host paces every all-to-all. This measures,
per call, the host time of the way the backend launches it today and of the bare launch underneath it:
  QuACK GEMMs   ops' call through QuACK's path (our wrapper -> QuACK's *_tuned.fn -> gemm/gemm_act/gemm_dact ->
                compiled kernel; ``ops.LAUNCHES.enabled = False``), through our launch cache
                (kernels/launch_cache.py), and calling the compiled TVM-FFI function again with the arguments
                QuACK built (recorded by the launch cache's spy on QuACK's compile-cache functions): the floor;
  ops.*         forward / backward_data / backward_weights with the launch cache off and on;
  Triton        gather_sum vs its JIT kernel launch alone.
Every timing keeps the GPU busy (``torch.cuda._sleep`` queued first) so the host never waits; median of
``--calls`` back-to-back calls per repeat, median of 7 repeats. Then a cProfile (tottime) of the three backend
calls (forward, backward_data, backward_weights) at the same shapes, 20 repetitions.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import json
import os
import pstats
import statistics
import time

import torch


def per_call_us(fn, calls: int) -> float:
    reps = []
    for _ in range(7):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued: the launches below never wait
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        reps.append((time.perf_counter() - t) / calls)
        torch.cuda.synchronize()
    return statistics.median(reps) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=131072, help="received pairs R (EP 4 issue size: ~131072)")
    ap.add_argument("--tokens", type=int, default=55000, help="received rows U")
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--experts", type=int, default=32, help="local experts L")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    from sonic_megatron.kernels import FlatRouting
    from sonic_megatron.kernels.cute import ops
    from sonic_megatron.kernels.interface import compute_metadata
    from sonic_megatron.kernels.triton import gather_sum

    gs_mod = importlib.import_module("sonic_megatron.kernels.triton.gather_sum")

    torch.manual_seed(0)
    dev = torch.device("cuda")
    U, R, D, F, L = args.tokens, args.rows, args.hidden, args.ffn, args.experts
    bf = torch.bfloat16
    x = torch.randn(U, D, device=dev, dtype=bf)
    tok = torch.sort(torch.randint(0, U, (R,), device=dev)).values
    exp = torch.randint(0, L, (R,), device=dev)
    s = torch.rand(R, device=dev)
    routing = FlatRouting(tok.int(), exp.int(), s, U)
    _, meta = compute_metadata(routing, L, ops)
    w1 = torch.randn(L, 2 * F, D, device=dev, dtype=bf) * 0.02
    w2 = torch.randn(L, D, F, device=dev, dtype=bf) * 0.02
    dO = torch.randn(U, D, device=dev, dtype=bf)
    rep: dict[str, dict] = {}
    ops.LAUNCHES.enabled = False  # QuACK's own path: the spy below sees its compiled-kernel call
    with torch.no_grad():
        o, h = ops.forward(x, s, w1, w2, meta, "swiglu", True)
        dx, ds, (ap_, dH) = ops.backward_data(dO, x, h, s, w1, w2, meta, "swiglu")
        ops.backward_weights(dO, x, ap_, dH, meta)
        torch.cuda.synchronize()
        a = torch.empty(R, F, device=dev, dtype=bf)
        y = torch.empty(R, D, device=dev, dtype=bf)
        gemm_calls = {
            "up (gemm_gated)": lambda: ops._gemm_gated(
                F, x, w1.permute(0, 2, 1), h, a, "swiglu", meta.expert_offsets, meta.x_gather_idx
            ),
            "down (gemm)": lambda: ops._gemm("down", F, D, a, w2.permute(0, 2, 1), y, cu_seqlens_m=meta.expert_offsets),
        }
        for label, fn in gemm_calls.items():
            calls: list = []
            with ops.LAUNCHES.spying(calls):
                fn()
            compiled, cargs = calls[0]
            rep[label] = {
                "quack_us": per_call_us(fn, args.calls),
                "floor_us": per_call_us(lambda c=compiled, a=cargs: c(*a), args.calls),
            }
        ops.LAUNCHES.enabled = True
        for label, fn in gemm_calls.items():
            fn()  # records
            rep[label]["cached_us"] = per_call_us(fn, args.calls)
        for enabled in (False, True):
            ops.LAUNCHES.enabled = enabled
            tag = "cached" if enabled else "quack"
            rep.setdefault("ops.forward", {})[tag + "_us"] = per_call_us(
                lambda: ops.forward(x, s, w1, w2, meta, "swiglu", True), args.calls
            )
            rep.setdefault("ops.backward_data", {})[tag + "_us"] = per_call_us(
                lambda: ops.backward_data(dO, x, h, s, w1, w2, meta, "swiglu"), args.calls
            )
            rep.setdefault("ops.backward_weights", {})[tag + "_us"] = per_call_us(
                lambda: ops.backward_weights(dO, x, ap_, dH, meta), args.calls
            )
        rep["launch cache stats"] = dict(ops.LAUNCHES.stats)
        rep["gather_sum"] = {"call_us": per_call_us(lambda: gather_sum(y, meta, s, pairs_per_token=4), args.calls)}
        rep["torch.empty (reference)"] = {
            "call_us": per_call_us(lambda: torch.empty(R, D, device=dev, dtype=bf), args.calls)
        }
        rep["torch add_ (reference)"] = {"call_us": per_call_us(lambda: s.add_(0.0), args.calls)}
        # Triton: the JIT launch alone (gather_sum's arguments and grid).
        kern = gs_mod._gather_sum_kernel
        T = meta.token_offsets.numel() - 1
        out = torch.empty(T, D, device=dev, dtype=bf)
        kargs = (y, s, meta.s_reverse_scatter_idx, meta.token_offsets, out, D, y.stride(0), out.stride(0))
        kw = dict(HAS_W=True, FIXED_K=0, BLOCK_J=4, BLOCK_D=1024, D_TILES=2, num_warps=4)
        grid = (T, 1)
        rep["triton jit launch"] = {"call_us": per_call_us(lambda: kern[grid](*kargs, **kw), args.calls)}
        # gather_sum's own steps around that launch
        rep["gather_sum pieces"] = {
            "empty_out_us": per_call_us(lambda: torch.empty(T, D, dtype=bf, device=dev), args.calls),
            "weights_detach_contiguous_us": per_call_us(lambda: s.detach().contiguous(), args.calls),
            "checks_us": per_call_us(
                lambda: (
                    y.dtype in (torch.float16, torch.bfloat16, torch.float32),
                    y.dim(),
                    y.stride(1),
                    meta.num_rows,
                    s.numel(),
                    meta.token_offsets.numel(),
                ),
                args.calls,
            ),
        }
        torch.cuda.synchronize()
        for k, v in rep.items():
            print(f"{k:32s} " + "  ".join(f"{a}={b:.1f}" if isinstance(b, float) else f"{a}={b}" for a, b in v.items()))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            o, h = ops.forward(x, s, w1, w2, meta, "swiglu", True)
            dx, ds, (ap_, dH) = ops.backward_data(dO, x, h, s, w1, w2, meta, "swiglu")
            ops.backward_weights(dO, x, ap_, dH, meta)
        prof.disable()
        torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(40)
    print(buf.getvalue())
    rep["device"] = torch.cuda.get_device_name()
    with open(os.path.join(args.out, "host-floor.json"), "w") as f:
        json.dump(rep, f, indent=1)
    with open(os.path.join(args.out, "host-floor-cprofile.txt"), "w") as f:
        f.write(buf.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
