"""``bench layer``'s profiling: a torch.profiler table and trace per chunk count (with the share of all-to-all
kernel time under compute kernels) and ``--count-ops`` (would-be kernel launches, collectives and host syncs of
ours, ``token_dispatch.launch_count``).
"""

from __future__ import annotations

import json
import os

import torch.distributed as dist

from .dispatch import sync


def kernel_profile(fn, chunks: str, steps: int, out_dir: str, rank: int, device) -> None:
    """torch.profiler over ``steps`` calls; rank 0 writes the phase/kernel table and a Chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    dist.barrier()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        sync(device)
    if rank != 0:
        return
    os.makedirs(out_dir, exist_ok=True)
    dev_key = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    avgs = prof.key_averages()
    lines = [f"profile chunks={chunks}, {steps} steps, rank 0 (times are totals over the steps)"]
    lines.append(f"{'name':60s} {'calls':>6s} {'host ms':>9s} {'device ms':>10s}")
    rows = sorted(avgs, key=lambda e: getattr(e, dev_key, 0.0), reverse=True)
    phases = [e for e in rows if e.key.startswith("ep.")]
    others = [e for e in rows if not e.key.startswith("ep.")][:30]
    for title, group in (("-- phases (ep.* ranges)", phases), ("-- top ops/kernels by device time", others)):
        lines.append(title)
        for e in group:
            dev_us = getattr(e, dev_key, 0.0)
            lines.append(f"{e.key[:60]:60s} {e.count:6d} {e.cpu_time_total / 1e3:9.3f} {dev_us / 1e3:10.3f}")
    trace = os.path.join(out_dir, f"trace_chunks{chunks}_rank0.json")
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        a2a_ms, share = a2a_under_kernels(json.load(f)["traceEvents"])
    lines.append(
        f"-- all-to-all kernels: {a2a_ms / steps:.3f} ms per step, {share:.1%} of it with a compute kernel running"
    )
    text = "\n".join(lines)
    print(text, flush=True)
    with open(os.path.join(out_dir, f"profile_chunks{chunks}.txt"), "w") as f:
        f.write(text + "\n")


def a2a_under_kernels(events: list[dict]) -> tuple[float, float]:
    """(ms of all-to-all kernels, share of that time during which some compute kernel runs) from a Chrome
    trace: NCCL send/recv kernels (the all-to-alls, including the plan's pair-metadata one; the all-gather is
    excluded) against the union of every non-NCCL kernel's interval."""
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "SendRecv" in e["name"]]
    merged: list[list[float]] = []
    for a, b in sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    total = sum(b - a for a, b in comm)
    covered = sum(max(0.0, min(b, d) - max(a, c)) for a, b in comm for c, d in merged)
    return total / 1e3, (covered / total if total else 0.0)


class _RegionOps:
    """A kernels backend whose calls are tallied under the "experts" region of the counter ``holder[0]``."""

    def __init__(self, ops, holder: list) -> None:
        self._ops, self._holder = ops, holder

    def __getattr__(self, name):
        fn = getattr(self._ops, name)
        if name not in ("forward", "backward_data", "backward_weights"):
            return fn

        def call(*a, **k):
            with self._holder[0].region("experts"):
                return fn(*a, **k)

        return call


def count_ops(layer_call, plan_call, grad, chunk_list) -> list[dict]:
    """This rank's host-work counts of ours per chunk count (see the module docstring)."""
    from ..token_dispatch import engine as engine_mod
    from ..token_dispatch.launch_count import LaunchCounter

    rows = []
    resolve = engine_mod.resolve_backend
    holder: list = [None]  # the counter that the experts' calls report to (forward, then backward)
    engine_mod.resolve_backend = lambda *a, **k: _RegionOps(resolve(*a, **k), holder)
    try:
        for chunks in chunk_list:
            holder[0] = LaunchCounter()
            layer_call(chunks).backward(grad)  # warm-up: lazy imports and first-call work are not per-call cost
            with LaunchCounter() as lc_plan:
                plan_call(chunks)
            lc_fwd = holder[0] = LaunchCounter()
            with lc_fwd:
                out = layer_call(chunks)
            lc_bwd = holder[0] = LaunchCounter()
            with lc_bwd:
                out.backward(grad)
            p, f, b = lc_plan.summary(), lc_fwd.summary(), lc_bwd.summary()
            rows.append(
                dict(
                    chunks=chunks,
                    plan_launches=p["launches"],
                    plan_collectives=p["collectives"],
                    plan_syncs=p["syncs"],
                    fwd_launches=f["launches"],
                    fwd_experts=f.get("launches[experts]", 0),
                    fwd_collectives=f["collectives"],
                    fwd_syncs=f["syncs"],
                    sync_to_row_a2a=f.get("launches_sync_to_row_a2a"),
                    bwd_launches=b["launches"],
                    bwd_experts=b.get("launches[experts]", 0),
                    bwd_collectives=b["collectives"],
                    bwd_syncs=b["syncs"],
                )
            )
    finally:
        engine_mod.resolve_backend = resolve
    return rows
