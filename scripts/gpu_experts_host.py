"""Host-side (CPU launch) time of the experts' pieces on one GPU, next to their GPU time, and a check for hidden
host syncs. A piece whose host time exceeds the GPU time of the work queued before it leaves the GPU idle.

    source .devbundle/setup.sh; python3 scripts/gpu_experts_host.py --config 32768,2048,1024,64,8 --out $OUT
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time
import warnings

import torch

from sonic_megatron.bench import experts as B


def host_ms(fn, n: int = 15) -> float:
    """Median wall time of launching ``fn`` on an idle GPU (no sync inside the timed region)."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        r = fn()
        times.append(time.perf_counter() - t)
        del r
        torch.cuda.synchronize()
    return statistics.median(times) * 1e3


def gpu_ms(fn, n: int = 15) -> float:
    """Median event time from launch start to GPU completion (includes GPU idle while the host launches)."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        r = fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
        del r
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="32768,2048,1024,64,8")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    T, d, n, E, K = B._parse(args.config)  # bench experts' own check of T,d,n,E,K
    import sonic_megatron.kernels.cute  # noqa: F401
    from sonic_megatron.kernels import TopKRouting
    from sonic_megatron.kernels.cute import ops
    from sonic_megatron.kernels.interface import compute_metadata
    from sonic_megatron.kernels.triton import gather_sum

    provs = B._make_providers(["ours", "sonic"], T, d, n, E, K, 0)
    ours, (x, wr, w1, w2) = provs["ours"]
    g = torch.randn(T, d, device="cuda").bfloat16()
    rep = {"config": args.config}

    with torch.no_grad():
        scores, idx = B._router(x, wr, K)
        _, meta = compute_metadata(TopKRouting(scores, idx), E, ops)
        R = T * K
        h = torch.empty(R, 2 * n, dtype=x.dtype, device="cuda")
        a = torch.empty(R, n, dtype=x.dtype, device="cuda")
        y = torch.empty(R, d, dtype=x.dtype, device="cuda")
        pieces = {
            "router (matmul, topk, softmax)": lambda: B._router(x, wr, K),
            "metadata (4 Triton launches)": lambda: compute_metadata(TopKRouting(scores, idx), E, ops),
            "up GEMM (QuACK call)": lambda: ops._gemm_gated(
                n, x, w1.permute(0, 2, 1), h, a, "swiglu", meta.expert_offsets, meta.x_gather_idx
            ),
            "down GEMM (QuACK call)": lambda: ops._gemm(
                "down", n, d, a, w2.permute(0, 2, 1), y, cu_seqlens_m=meta.expert_offsets
            ),
            "gather_sum (Triton)": lambda: gather_sum(y, meta, scores.reshape(-1), pairs_per_token=K),
            "ops.forward (all of the above but router/metadata)": lambda: ops.forward(
                x, scores.reshape(-1), w1, w2, meta, "swiglu", True
            ),
        }
        for name, fn in pieces.items():
            rep[name] = {"host_ms": host_ms(fn), "gpu_ms": gpu_ms(fn)}
            r = rep[name]
            print(f"{name:55s} host {r['host_ms']:7.3f} ms   launch->done {r['gpu_ms']:7.3f} ms", flush=True)

    for name in ("ours", "sonic"):
        val = provs[name]
        if isinstance(val, Exception):
            print(name, "unavailable:", val)
            continue
        fn, inputs = val
        outs = []

        def bwd(inputs=inputs, outs=outs):
            torch.autograd.grad(outs[-1], inputs, grad_outputs=g)

        def fwd(fn=fn, outs=outs):
            outs[:] = [None]  # free the previous graph first
            outs[:] = [fn()]

        f_host, f_gpu = host_ms(fwd), gpu_ms(fwd)
        outs.clear()
        bh, bg = [], []
        for _ in range(15):
            fwd()
            bh.append(host_ms(bwd, 1))
            fwd()
            bg.append(gpu_ms(bwd, 1))
        outs.clear()
        rep[name + " total"] = {
            "fwd_host_ms": f_host,
            "fwd_gpu_ms": f_gpu,
            "bwd_host_ms": statistics.median(bh),
            "bwd_gpu_ms": statistics.median(bg),
        }
        print(name, rep[name + " total"], flush=True)

    # Hidden host syncs in one fwd+bwd of ours (torch's sync debug mode warns at every sync).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        o = ours()
        torch.autograd.grad(o, [x, wr, w1, w2], grad_outputs=g)
        torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message)[:200] for w in caught if "synchron" in str(w.message).lower()]
    rep["ours_syncs"] = syncs
    print(f"ours fwd+bwd host syncs: {len(syncs)}", *syncs[:5], sep="\n  ")
    # Python-level host profile of 10 fwd+bwd steps of ours (cProfile inflates absolute times; shares count).
    prof = cProfile.Profile()
    for i in range(12):
        if i == 2:
            prof.enable()
        o = ours()
        torch.autograd.grad(o, [x, wr, w1, w2], grad_outputs=g)
        torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf).sort_stats("cumulative")
    st.print_stats(45)
    st.sort_stats("tottime").print_stats(25)
    print(buf.getvalue())
    with open(os.path.join(args.out, f"experts-host-{args.config.replace(',', '_')}.json"), "w") as f:
        json.dump(rep, f, indent=1)


if __name__ == "__main__":
    main()
