#!/usr/bin/env python3
"""Host time of the collectives inside an interleaved EP step (``ep_forward_backward``, schedule ``1i``), by
monkeypatching perf_counter timers around them (no CUDA events, no profiler; the library is unchanged):

    torchrun --nproc_per_node 4 scripts/gpu_a2a_host_cost.py --out $OUT [--rounds 40]

Variants, timed in the same rounds (each round runs every variant once, from an idle device after a barrier):
  * ``on``         -- the layer as it is (each all-to-all through the process group's own method, comm.py);
  * ``on wrapper`` -- each all-to-all through ``dist.all_to_all_single`` (torch.distributed's Python wrapper:
                      torch-function dispatch, argument checks, exception logging; the layer's way until
                      session 11);
  * ``on old order`` -- the previous micro-batch's dO all-to-all launched before this micro-batch's plan (the
                      order until session 11; now it goes out inside the plan, between the counts all-gather
                      and the host's wait for it: ``make_plan(before_sync=...)``);
  * ``no a2a``    -- the layer's row / pair all-to-alls skipped (bench layer's reference; the plan's stay).
Per variant: median over rounds of the step's host time (until the call returns) and wall time (max over
ranks), and per rank the median host time spent per step inside the layer's all-to-all launches, inside
``Pending.wait`` (stream waits on the collectives), in the plan's counts all-gather (its host sync included)
and in the plan's pair all-to-all launch. Run it with ``TORCH_FR_BUFFER_SIZE=0`` as well to see what PyTorch's
NCCL flight recorder adds per launch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import sonic_megatron.token_dispatch.comm as comm_mod
import sonic_megatron.token_dispatch.exchange as ex_mod
import sonic_megatron.token_dispatch.interleave as inter_mod
import sonic_megatron.token_dispatch.plan as plan_mod
import torch
import torch.distributed as dist
from ep_step import ISSUE4, TINY, init_ranks, interleaved_step

from sonic_megatron.bench.layer import _no_layer_a2a

ACC: dict | None = None  # name -> [seconds, calls] while a step is recorded
WRAPPER = [False]  # issue the all-to-alls through dist.all_to_all_single
OLD_ORDER = [False]  # launch the previous micro-batch's dO all-to-all before the plan


def _timed(owner, attr: str, name: str) -> None:
    fn = getattr(owner, attr)

    def wrapped(*a, **k):
        if ACC is None:
            return fn(*a, **k)
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            slot = ACC.setdefault(name, [0.0, 0])
            slot[0] += time.perf_counter() - t0
            slot[1] += 1

    setattr(owner, attr, wrapped)


def _wrapper_all_to_all(out, inp, out_splits, in_splits, group, async_op=False):
    """comm.all_to_all as it was until session 11: through torch.distributed's Python wrapper."""
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=async_op)


def _orderable(make_plan):
    def plan(*a, before_sync=None, **k):
        if OLD_ORDER[0] and before_sync is not None:
            before_sync()
            before_sync = None
        return make_plan(*a, before_sync=before_sync, **k)

    return plan


def _switchable(original):
    def a2a(*a, **k):
        return (_wrapper_all_to_all if WRAPPER[0] else original)(*a, **k)

    return a2a


def main() -> int:
    global ACC
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="out")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--comm-sms", type=int, default=32)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--tag", default=os.environ.get("HOST_COST_TAG", "default"))
    args = p.parse_args()
    device, rank, P = init_ranks(cpu_check=True)  # no GPU: the script's own check, gloo + torch backend
    cuda = device.type == "cuda"
    # comm.all_to_all behind both imports, switchable to the wrapper.
    a2a = _switchable(comm_mod.all_to_all)
    ex_mod.all_to_all = a2a
    plan_mod.all_to_all = a2a
    inter_mod.make_plan = _orderable(inter_mod.make_plan)
    _timed(ex_mod, "all_to_all", "layer a2a launch")
    _timed(plan_mod, "all_to_all", "plan pair a2a launch")
    _timed(plan_mod, "all_gather", "plan counts all-gather + sync")
    _timed(comm_mod.Pending, "wait", "Pending.wait")

    sizes = (args.tokens, *ISSUE4[1:]) if cuda else TINY
    step = interleaved_step(device, args.comm_sms, sizes, torch.bfloat16 if cuda else torch.float32)
    T = sizes[0]

    def sync():
        if cuda:
            torch.cuda.synchronize()

    variants = {
        "on": (False, False, False),
        "on wrapper": (True, False, False),
        "on old order": (False, True, False),
        "no a2a": (False, False, True),
    }
    for wrapper, old, skip in variants.values():  # warm-up
        WRAPPER[0], OLD_ORDER[0] = wrapper, old
        with _no_layer_a2a() if skip else contextlib.nullcontext():
            for _ in range(5):
                step()
    sync()
    times = torch.zeros(len(variants), args.rounds, 2, dtype=torch.float64)
    inner: dict = {v: [] for v in variants}
    for r in range(args.rounds):
        for v, (name, (wrapper, old, skip)) in enumerate(variants.items()):
            WRAPPER[0], OLD_ORDER[0] = wrapper, old
            with _no_layer_a2a() if skip else contextlib.nullcontext():
                sync()
                dist.barrier()
                sync()
                ACC = {}
                t0 = time.perf_counter()
                step()
                t_host = time.perf_counter() - t0
                sync()
                t_wall = time.perf_counter() - t0
                acc, ACC = ACC, None
            times[v, r, 0], times[v, r, 1] = t_wall, t_host
            inner[name].append({k: (s * 1e3, n) for k, (s, n) in acc.items()})
    times = times.to(device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    times = times.cpu()
    med = statistics.median
    report = {"tag": args.tag, "P": P, "T": T, "env_fr": os.environ.get("TORCH_FR_BUFFER_SIZE"), "variants": {}}
    for v, name in enumerate(variants):
        keys = sorted({k for step_acc in inner[name] for k in step_acc})
        per_rank = {
            k: {
                "ms_per_step": med([a.get(k, (0.0, 0))[0] for a in inner[name]]),
                "calls_per_step": med([a.get(k, (0.0, 0))[1] for a in inner[name]]),
            }
            for k in keys
        }
        mine = torch.tensor([per_rank[k]["ms_per_step"] for k in keys], dtype=torch.float64, device=device)
        gathered = [torch.zeros_like(mine) for _ in range(P)]
        dist.all_gather(gathered, mine)
        report["variants"][name] = {
            "wall_ms": med(times[v, :, 0].tolist()) * 1e3,
            "host_ms": med(times[v, :, 1].tolist()) * 1e3,
            "inner_ms_per_rank": {k: [round(t[i].item(), 4) for t in gathered] for i, k in enumerate(keys)},
            "calls_per_step": {k: per_rank[k]["calls_per_step"] for k in keys},
        }
    on = times[0, :, :]
    report["paired_ms"] = {
        name: {
            "wall_minus_on": med((times[v, :, 0] - on[:, 0]).tolist()) * 1e3,
            "host_minus_on": med((times[v, :, 1] - on[:, 1]).tolist()) * 1e3,
        }
        for v, name in enumerate(variants)
        if v > 0
    }
    if rank == 0:
        print(
            f"== {args.tag}: P={P} T={T}, schedule 1i, comm_sms {args.comm_sms}, {args.rounds} rounds, "
            f"TORCH_FR_BUFFER_SIZE={report['env_fr']}"
        )
        for name, rep in report["variants"].items():
            print(f"{name:10s} wall {rep['wall_ms']:.3f} ms  host {rep['host_ms']:.3f} ms")
            for k, per in rep["inner_ms_per_rank"].items():
                calls = rep["calls_per_step"][k]
                print(f"    {k:32s} calls {calls:4.0f}  ms per step, ranks: {' '.join(f'{t:.3f}' for t in per)}")
        print("paired (median over rounds, ms):", json.dumps(report["paired_ms"]))
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"a2a_host_cost_{args.tag}.json"), "w") as f:
            json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
