"""Where the experts' time goes on one GPU: kernel table of `ours` and sonic-moe (fwd, fwd+bwd) under the torch
profiler.

    source .devbundle/setup.sh; python3 scripts/gpu_experts_profile.py --config 32768,2048,1024,64,8 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch.profiler import ProfilerActivity, profile

from sonic_megatron.bench import experts as B


def kernel_table(fn, steps: int = 3, warmup: int = 2) -> list[tuple[str, int, float]]:
    """CUDA kernels of ``steps`` calls of ``fn`` (torch.profiler, after ``warmup`` calls): (name, launches per
    call, ms per call), slowest first."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0:
            rows.append((e.key[:600], e.count // steps, e.self_device_time_total / steps / 1000))
    return sorted(rows, key=lambda r: -r[2])


def timeline(fn, name: str, out: str, steps: int = 3, iters: int = 20) -> dict:
    """Where the GPU idles in ``steps`` calls of ``fn``: kernel busy time vs the span from the first kernel's
    start to the last one's end, the largest idle gaps with their neighbours (Chrome trace kept in ``out``),
    and the caching allocator's device mallocs/frees/retries over ``iters`` unprofiled calls (a cudaFree
    synchronises the device)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    keys = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
    before = {k: torch.cuda.memory_stats().get(k, 0) for k in keys}
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    after = {k: torch.cuda.memory_stats().get(k, 0) for k in keys}
    rep = {"wall_ms_per_call": a.elapsed_time(b) / iters, "allocator": {k: after[k] - before[k] for k in keys}}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    path = os.path.join(out, f"trace_{name}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        ev = json.load(f)["traceEvents"]
    gpu = sorted(
        (e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
        key=lambda e: e["ts"],
    )
    busy, gaps, end = 0.0, [], gpu[0]["ts"] if gpu else 0.0
    prev = None
    for e in gpu:
        if e["ts"] > end:
            gaps.append((e["ts"] - end, prev["name"][:80] if prev else "", e["name"][:80]))
        busy += e["dur"]
        if e["ts"] + e["dur"] > end:
            end, prev = e["ts"] + e["dur"], e
    span = (end - gpu[0]["ts"]) if gpu else 0.0
    gaps.sort(reverse=True)
    rep.update(
        span_ms_per_call=span / steps / 1e3,
        busy_ms_per_call=busy / steps / 1e3,
        idle_ms_per_call=sum(g[0] for g in gaps) / steps / 1e3,
        top_gaps=[{"us": round(g[0], 1), "after": g[1], "before": g[2]} for g in gaps[:12]],
    )
    print(
        f"\n== timeline {name}: wall {rep['wall_ms_per_call']:.3f} ms/call, span {rep['span_ms_per_call']:.3f}, "
        f"busy {rep['busy_ms_per_call']:.3f}, idle {rep['idle_ms_per_call']:.3f}; allocator {rep['allocator']}"
    )
    for g in rep["top_gaps"]:
        print(f"  gap {g['us']:8.1f} us  after {g['after'][:60]}  before {g['before'][:60]}")
    return rep


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="32768,2048,1024,64,8")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--steps", type=int, default=3, help="profiled steps per table")
    ap.add_argument("--timeline-only", action="store_true", help="only the idle-gap timeline of fwd+bwd")
    args = ap.parse_args()
    T, d, n, E, K = B._parse(args.config)  # bench experts' own check of T,d,n,E,K
    import sonic_megatron.kernels.cute  # noqa: F401

    provs = B._make_providers(["ours", "sonic"], T, d, n, E, K, 0)
    report = {"config": args.config}
    g = torch.randn(T, d, device="cuda").bfloat16()
    for name, val in provs.items():
        if isinstance(val, Exception):
            report[name] = repr(val)
            continue
        fn, inputs = val

        def fwd(fn=fn):  # with autograd on, as `bench experts` times it (stores what backward needs)
            fn()

        def fwd_bwd(fn=fn, inputs=inputs):
            fn().backward(g)
            for t in inputs:
                t.grad = None

        def fwd_grad(fn=fn, inputs=inputs):  # exactly what `bench experts` times
            torch.autograd.grad(fn(), inputs, grad_outputs=g)

        report[f"{name}_timeline"] = timeline(fwd_grad, name, args.out)
        if args.timeline_only:
            continue
        for phase, f in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
            table = kernel_table(f, args.steps)
            total = sum(r[2] for r in table)
            report[f"{name}_{phase}"] = {"total_ms": total, "kernels": table[:30]}
            print(f"\n== {name} {phase}: kernel total {total:.3f} ms per step")
            for k, c, ms in table[:30]:
                print(f"  {ms:8.3f} ms  x{c:<3d} {k[:110]}")
    with open(os.path.join(args.out, f"experts-profile-{args.config.replace(',', '_')}.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
