#!/usr/bin/env python3
"""The interleaved EP step (schedule 1i, issue-4 size) under each QuACK tile scheduler setting of the cute
backend (``kernels/cute/ops.py``'s ``SCHEDULER``: auto / static / dynamic), timed in the same rounds:

    torchrun --nproc_per_node 4 scripts/gpu_scheduler_ab.py --out $OUT [--rounds 40] [--comm-sms 32] [--tokens T] \
        [--settings static,auto,dynamic]

Variants, each once per round from an idle device after a barrier (``bench layer``'s ``_timed_rounds``): per
setting the step with its all-to-alls and without them (``no a2a``: bench layer's reference, no SMs reserved),
and the step's all-to-alls alone (same plan). Per setting: wall and host time (median over rounds, max over
ranks) and the share of all-to-all time hidden, 1 - (t_on - t_no_a2a) / t_a2a with the difference paired round
by round, as ``bench layer`` computes it; paired gain against "static" (median over rounds of t(static) -
t(setting)). Output and gradients of two interleaved micro-batches are checked bitwise equal across settings.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.distributed as dist
from ep_step import ISSUE4, init_ranks, interleaved_results, interleaved_step, report_and_finish, setting
from sonic_megatron.kernels.cute import ops
from sonic_megatron.token_dispatch.plan import make_plan

from sonic_megatron.bench.layer import _a2a_alone, _median, _paired, _timed_rounds


def _setting(scheduler: str, a2a: bool):
    return setting(ops, "SCHEDULER", scheduler, a2a)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="out")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--comm-sms", type=int, default=32)
    p.add_argument("--tokens", type=int, default=ISSUE4[0], help="T per rank (the other sizes: issue 4's)")
    p.add_argument("--settings", default="static,auto,dynamic", help=f"comma list of {ops.SCHEDULERS}")
    args = p.parse_args()
    schedulers = args.settings.split(",")
    if not set(schedulers) <= set(ops.SCHEDULERS):
        p.error(f"--settings: each setting must be one of {ops.SCHEDULERS}, got {args.settings!r}")
    device, rank, P = init_ranks()
    sizes = (args.tokens, *ISSUE4[1:])
    sms = {True: args.comm_sms, False: 0}  # the no-a2a reference reserves no SMs, as bench layer's
    steps = {a2a: interleaved_step(device, n, sizes) for a2a, n in sms.items()}
    x, routing, group, E = steps[True].inputs
    plan = make_plan(routing, num_experts=E, group=group, x_TD=x)
    variants = {
        (a2a, s): (steps[a2a], lambda a2a=a2a, s=s: _setting(s, a2a)) for s in schedulers for a2a in (True, False)
    }
    variants["a2a"] = (_a2a_alone(plan, x, device), contextlib.nullcontext)
    timing = _timed_rounds(variants, device, 5, args.rounds)
    t_a2a = _median(timing.pop("a2a")[0])
    results = {}
    for s in schedulers:
        with _setting(s, True):
            results[s] = interleaved_results(x, routing, group, E, args.comm_sms)
    same = all(
        all(torch.equal(a, b) for a, b in zip(results[schedulers[0]], results[s], strict=True)) for s in schedulers
    )
    flag = torch.tensor([0.0 if same else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    report = {"P": P, "T": args.tokens, "comm_sms": args.comm_sms, "rounds": args.rounds, "a2a_alone_ms": t_a2a * 1e3}
    report["bitwise_equal_across_settings"] = bool(flag.item() == 0.0)
    base = schedulers[0]
    for s in schedulers:
        on, none = timing[(True, s)][0], timing[(False, s)][0]
        exposed = _paired(on, none)
        report[s] = {
            "wall_ms": _median(on) * 1e3,
            "host_ms": _median(timing[(True, s)][1]) * 1e3,
            "no_a2a_wall_ms": _median(none) * 1e3,
            "a2a_exposed_ms": exposed * 1e3,
            "a2a_hidden": max(0.0, min(1.0, 1 - exposed / t_a2a)),
            f"gain_vs_{base}_ms": _paired(timing[(True, base)][0], on) * 1e3,
            f"no_a2a_gain_vs_{base}_ms": _paired(timing[(False, base)][0], none) * 1e3,
        }
    return report_and_finish(report, args.out, f"scheduler_ab_ep{P}_T{args.tokens}.json")


if __name__ == "__main__":
    raise SystemExit(main())
