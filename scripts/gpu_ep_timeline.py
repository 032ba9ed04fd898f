#!/usr/bin/env python3
"""Where one EP layer step's time goes: host launch time and GPU progress per phase, without the profiler's
inflation. Run under torchrun (NCCL, one GPU per rank):

    torchrun --nproc_per_node 4 scripts/gpu_ep_timeline.py --out $OUT [--schedules 1,2] [--steps 20]

Each phase of ``expert_parallel_experts`` (plan pieces, row launches, experts, waits, sums; wrapped here by
monkeypatching, the library is unchanged) records its host enter/exit times and a CUDA event at enter and exit on
the current stream. Per phase, rank 0 prints medians over the steps of: host start and duration, and the GPU
time at which the stream reached the phase's start and end (ms from the step start; the device is idle then).
``gpu lag`` = GPU start - host start: about 0 means the GPU waited for the host there (host-bound), larger means
queued work. Variants: overlap on (each schedule: N chunks, or Ni = two micro-batches interleaved), and the same
without the layer's row all-to-alls (``no a2a``).
Also: the caching allocator's device allocs/frees and retries per step; under --out, every rank's phase table
(JSON) and a torch.profiler Chrome trace of 2 steps of the first schedule, overlap on.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import shutil
import statistics
import time

import sonic_megatron.token_dispatch.comm as comm_mod
import sonic_megatron.token_dispatch.exchange as ex_mod
import sonic_megatron.token_dispatch.interleave as inter_mod
import sonic_megatron.token_dispatch.layer as layer_mod
import sonic_megatron.token_dispatch.plan as plan_mod
import sonic_megatron.token_dispatch.validation as val_mod
import torch
import torch.distributed as dist
from sonic_megatron.kernels import TopKRouting
from sonic_megatron.kernels.interface import resolve_backend

from sonic_megatron.bench.layer import _no_layer_a2a  # the same "no a2a" reference as bench layer's

REC: list | None = None  # (name, host enter, host exit, event enter, event exit) while recording
CUDA = torch.cuda.is_available()
DTYPE = torch.bfloat16 if CUDA else torch.float32


class _HostEvent:
    """CPU stand-in for a CUDA event (the script's own test: ``--cpu``): times the host."""

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


def _event():
    return torch.cuda.Event(enable_timing=True) if CUDA else _HostEvent()


def _sync():
    if CUDA:
        torch.cuda.synchronize()


def _wrap(owner, attr: str, name: str) -> None:
    fn = getattr(owner, attr)

    def wrapped(*a, **k):
        if REC is None:
            return fn(*a, **k)
        e0 = _event()
        e1 = _event()
        h0 = time.perf_counter()
        e0.record()
        try:
            return fn(*a, **k)
        finally:
            e1.record()
            REC.append((name, h0, time.perf_counter(), e0, e1))

    setattr(owner, attr, wrapped)


def instrument(ops) -> None:
    _wrap(layer_mod, "make_plan", "plan")
    _wrap(inter_mod, "make_plan", "plan")
    _wrap(plan_mod, "_build_send_side", "plan.send_side")
    _wrap(plan_mod, "all_gather", "plan.counts_all_gather")
    _wrap(val_mod, "check_headers", "plan.after_sync(check_headers)")
    _wrap(plan_mod, "_recv_metadata", "recv_metadata")
    _wrap(layer_mod, "_launch_rows", "launch_rows")
    _wrap(ex_mod, "all_to_all", "a2a_launch")
    _wrap(ex_mod, "rows_to_sources", "rows_to_sources")
    _wrap(ex_mod, "pairs_to_sources", "pairs_to_sources")
    _wrap(ex_mod, "sum_rows_per_token", "sum_rows_per_token")
    _wrap(ex_mod, "scatter_pair_grads", "scatter_pair_grads")
    _wrap(comm_mod.Pending, "wait", "pending.wait")
    for attr in ("forward", "backward_data", "backward_weights"):
        _wrap(ops, attr, f"ops.{attr}")
    _wrap(layer_mod._EPExperts, "forward", "EPExperts.forward")
    _wrap(layer_mod._EPExperts, "backward", "EPExperts.backward")


def one_step(fn) -> list[tuple]:
    global REC
    _sync()
    dist.barrier()
    _sync()
    REC = []
    e_start = _event()
    h_start = time.perf_counter()
    e_start.record()
    fn()
    h_ret = time.perf_counter()
    e_end = _event()
    e_end.record()
    _sync()
    h_done = time.perf_counter()
    rec, REC = REC, None
    rows = [
        (n, (h0 - h_start) * 1e3, (h1 - h0) * 1e3, e_start.elapsed_time(e0), e_start.elapsed_time(e1))
        for n, h0, h1, e0, e1 in rec
    ]
    rows.append(
        (
            "STEP (host return / gpu end / wall)",
            (h_ret - h_start) * 1e3,
            0.0,
            e_start.elapsed_time(e_end),
            (h_done - h_start) * 1e3,
        )
    )
    rows.sort(key=lambda r: r[1])
    return rows


def summarize(steps: list[list[tuple]]) -> list[dict]:
    # Phases by (name, occurrence): the call sequence is the same every step.
    keyed = []
    for rows in steps:
        seen: dict = {}
        keyed.append({})
        for r in rows:
            k = (r[0], seen.get(r[0], 0))
            seen[r[0]] = k[1] + 1
            keyed[-1][k] = r
    out = []
    for k in keyed[0]:
        vals = [s[k] for s in keyed if k in s]
        med = [statistics.median(v[i] for v in vals) for i in range(1, 5)]
        out.append(dict(phase=f"{k[0]}#{k[1]}", host_start=med[0], host_ms=med[1], gpu_start=med[2], gpu_end=med[3]))
    out.sort(key=lambda d: d["host_start"])
    return out


def print_rows(title: str, rows: list[dict]) -> None:
    print(f"\n== {title}")
    print(f"{'phase':44s} {'host start':>10s} {'host ms':>8s} {'gpu start':>10s} {'gpu end':>8s} {'gpu lag':>8s}")
    for r in rows:
        lag = r["gpu_start"] - r["host_start"]
        print(
            f"{r['phase'][:44]:44s} {r['host_start']:10.3f} {r['host_ms']:8.3f} {r['gpu_start']:10.3f} "
            f"{r['gpu_end']:8.3f} {lag:8.3f}"
        )


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="out")
    p.add_argument("--schedules", default="1,2")
    p.add_argument("--comm-sms", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--tag", default=os.environ.get("TIMELINE_TAG", "default"))
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    if CUDA:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:  # the script's own check on CPU: gloo, torch backend
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    from sonic_megatron.token_dispatch import expert_parallel_experts

    T, D, F, E, K = args.tokens, args.hidden, args.ffn, args.experts, args.topk
    L = E // P
    g = torch.Generator(device="cpu").manual_seed(7 + rank)
    probs = torch.randn(T, E, generator=g).softmax(-1).to(device)
    scores, indices = probs.topk(K, dim=-1)
    x = torch.randn(T, D, generator=g).to(device, DTYPE).requires_grad_()
    w1 = (torch.randn(L, 2 * F, D, generator=g) / D**0.5).to(device, DTYPE).requires_grad_()
    w2 = (torch.randn(L, D, F, generator=g) / F**0.5).to(device, DTYPE).requires_grad_()
    grad = torch.randn(T, D, generator=g).to(device, DTYPE)
    scores = scores.clone().requires_grad_()
    routing = TopKRouting(scores, indices)
    ops = resolve_backend("auto", device)
    instrument(ops)

    def step_fn(chunks: int):
        def fn():
            out = expert_parallel_experts(
                x, routing, w1, w2, group=dist.group.WORLD, num_experts=E, num_chunks=chunks, comm_sms=args.comm_sms
            )
            out.backward(grad)

        return fn

    def interleaved_fn(chunks: int):
        """The forward of a micro-batch with the backward of the previous one (``ep_forward_backward``)."""
        kw = dict(group=dist.group.WORLD, num_experts=E, num_chunks=chunks, comm_sms=args.comm_sms)
        state = []

        def fn():
            if not state:
                state.append(inter_mod.ep_forward(x, routing, w1, w2, **kw)[1])
            state[0] = inter_mod.ep_forward_backward(state[0], grad, x, routing, w1, w2, **kw)[1]

        return fn

    variants = []
    for sched in args.schedules.split(","):
        c, make = (int(sched[:-1]), interleaved_fn) if sched.endswith("i") else (int(sched), step_fn)
        variants.append((f"schedule {sched} overlap on", make(c), contextlib.nullcontext))
        variants.append((f"schedule {sched} no a2a", make(c), _no_layer_a2a))
    report: dict = {
        "tag": args.tag,
        "P": P,
        "config": [T, D, F, E, K],
        "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL", "PYTORCH_CUDA"))},
    }
    for title, fn, ctx in variants:
        with ctx():
            for _ in range(5):
                fn()
            _sync()
            m0 = torch.cuda.memory_stats() if CUDA else {}
            steps = [one_step(fn) for _ in range(args.steps)]
            m1 = torch.cuda.memory_stats() if CUDA else {}
        mem = {
            k: (m1.get(k, 0) - m0.get(k, 0)) / args.steps
            for k in ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
        }
        rows = summarize(steps)
        report[title] = {"phases": rows, "alloc_per_step": mem}
        if rank == 0:
            print_rows(f"{args.tag}: {title} (rank 0, medians of {args.steps} steps; allocator per step {mem})", rows)
    # A Chrome trace of the first schedule, overlap on (every rank).
    from torch.profiler import ProfilerActivity, profile

    fn = variants[0][1]
    _sync()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])) as prof:
        for _ in range(2):
            fn()
        _sync()
    os.makedirs(args.out, exist_ok=True)
    tmp = os.path.join(args.out, f"trace_{args.tag}_rank{rank}.json")
    prof.export_chrome_trace(tmp)
    with open(tmp, "rb") as f, gzip.open(tmp + ".gz", "wb") as z:
        shutil.copyfileobj(f, z)
    os.remove(tmp)
    with open(os.path.join(args.out, f"timeline_{args.tag}_rank{rank}.json"), "w") as f:
        json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
