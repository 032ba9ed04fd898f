#!/usr/bin/env python3
"""The interleaved EP step (schedule 1i, issue-4 size) with the cute backend's QuACK launch cache on and off
(``kernels/cute/ops.py``'s ``LAUNCHES``, kernels/launch_cache.py), timed in the same rounds:

    torchrun --nproc_per_node 4 scripts/gpu_launch_cache_ab.py --out $OUT [--rounds 40] [--comm-sms 32]

Variants, each once per round from an idle device after a barrier (``bench layer``'s ``_timed_rounds``): the
step with its all-to-alls and without them (``no a2a``: the layer's row / pair all-to-alls skipped and no SMs
reserved, bench layer's reference), each with the cache on and off, the same two with ``bench layer``'s call
(leaves that require grad, gradients added into ``.grad``; cache on), and the step's all-to-alls alone (same
plan). Per cache setting: wall and host time (median over rounds, max over ranks), and the share of all-to-all
time hidden, 1 - (t_on - t_no_a2a) / t_a2a with the difference paired round by round, as ``bench layer``
computes it. Paired cache gain (median over rounds of t(off) - t(on)) for both steps. Results are bitwise equal
either way (checked here on two micro-batches' output and gradients).
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
from ep_step import ISSUE4, init_ranks, interleaved_results, interleaved_step, report_and_finish, setting
from sonic_megatron.kernels.cute import ops
from sonic_megatron.token_dispatch.plan import make_plan

from sonic_megatron.bench.layer import _a2a_alone, _median, _paired, _timed_rounds


def _setting(cache: bool, a2a: bool):
    return setting(ops.LAUNCHES, "enabled", cache, a2a)


def _host_profile(steps: dict, rank: int, out: str) -> None:
    """cProfile (tottime, top 30) of 20 calls of each step on rank 0, into ``out``/host_profile.txt."""
    import cProfile
    import io
    import pstats

    text = io.StringIO()
    for name, fn in steps.items():
        torch.cuda.synchronize()
        dist.barrier()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        text.write(f"== {name}\n")
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "host_profile.txt"), "w") as f:
            f.write(text.getvalue())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="out")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--comm-sms", type=int, default=32)
    p.add_argument("--tokens", type=int, default=ISSUE4[0], help="T per rank (the other sizes: issue 4's)")
    p.add_argument("--host-profile", action="store_true", help="cProfile both step kinds (rank 0, 20 steps)")
    args = p.parse_args()
    device, rank, P = init_ranks()
    sizes = (args.tokens, *ISSUE4[1:])
    # As in bench layer, the no-a2a reference leaves no SMs free (comm_sms 0): what the step would cost if
    # communication were free, so the share hidden also counts what the reservation costs the GEMMs.
    sms = {True: args.comm_sms, False: 0}
    steps = {a2a: interleaved_step(device, n, sizes) for a2a, n in sms.items()}
    bench_style = {a2a: interleaved_step(device, n, sizes, leaf_grads=True) for a2a, n in sms.items()}
    x, routing, group, E = steps[True].inputs
    plan = make_plan(routing, num_experts=E, group=group, x_TD=x)
    variants = {
        (a2a, cache): (steps[a2a], lambda a2a=a2a, cache=cache: _setting(cache, a2a))
        for a2a in (True, False)
        for cache in (True, False)
    }
    for a2a in (True, False):
        variants[(a2a, "leaf grads")] = (bench_style[a2a], lambda a2a=a2a: _setting(True, a2a))
    variants["a2a"] = (_a2a_alone(plan, x, device), contextlib.nullcontext)
    timing = _timed_rounds(variants, device, 5, args.rounds)
    t_a2a = _median(timing.pop("a2a")[0])
    results = {}
    for cache in (True, False):
        with _setting(cache, True):
            results[cache] = interleaved_results(x, routing, group, E, args.comm_sms)
    same = all(torch.equal(a, b) for a, b in zip(results[True], results[False], strict=True))
    flag = torch.tensor([0.0 if same else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    report = {"P": P, "T": args.tokens, "comm_sms": args.comm_sms, "rounds": args.rounds, "a2a_alone_ms": t_a2a * 1e3}
    report["bitwise_cache_on_vs_off"] = bool(flag.item() == 0.0)
    for cache in (True, False):
        on, none = timing[(True, cache)][0], timing[(False, cache)][0]
        exposed = _paired(on, none)
        report["cache on" if cache else "cache off"] = {
            "wall_ms": _median(on) * 1e3,
            "host_ms": _median(timing[(True, cache)][1]) * 1e3,
            "no_a2a_wall_ms": _median(none) * 1e3,
            "no_a2a_host_ms": _median(timing[(False, cache)][1]) * 1e3,
            "a2a_exposed_ms": exposed * 1e3,
            "a2a_hidden": max(0.0, min(1.0, 1 - exposed / t_a2a)),
        }
    on, none = timing[(True, "leaf grads")][0], timing[(False, "leaf grads")][0]
    report["cache on, leaf grads (bench layer's call)"] = {
        "wall_ms": _median(on) * 1e3,
        "host_ms": _median(timing[(True, "leaf grads")][1]) * 1e3,
        "no_a2a_wall_ms": _median(none) * 1e3,
        "no_a2a_host_ms": _median(timing[(False, "leaf grads")][1]) * 1e3,
        "a2a_hidden": max(0.0, min(1.0, 1 - _paired(on, none) / t_a2a)),
    }
    if args.host_profile:
        _host_profile({"plain": steps[True], "leaf grads": bench_style[True]}, rank, args.out)
    report["cache_gain_ms"] = {
        "with a2a": _paired(timing[(True, False)][0], timing[(True, True)][0]) * 1e3,
        "no a2a": _paired(timing[(False, False)][0], timing[(False, True)][0]) * 1e3,
        "host, with a2a": _paired(timing[(True, False)][1], timing[(True, True)][1]) * 1e3,
    }
    return report_and_finish(report, args.out, f"launch_cache_ab_ep{P}_T{args.tokens}.json")


if __name__ == "__main__":
    raise SystemExit(main())
