#!/usr/bin/env python3
"""How much of launching one NCCL all-to-all runs with the GIL released (the premise of token_dispatch's
CommThread: a background thread can take that host time off the caller only if c10d releases the GIL while it
launches). Under torchrun, NCCL:

    torchrun --nproc_per_node 2 scripts/gpu_gil_probe.py [--rows 11000] [--calls 40]

Per variant: host µs per launch (median of 5 repeats of --calls launches, no other thread), and, in a second
pass with a helper thread counting in a Python loop (switch interval 20 µs), the helper's count during the
launches relative to its rate alone ("GIL released": ~1 means the GIL was free during the whole launch, ~0 held;
the launches take longer in that pass). Variants:
  a2a            dist.all_to_all_single(..., async_op=True)
  a2a+kernels    the same, each launch after 30 small kernel launches (the layer's context: cold caches)
  thread a2a     submitted to token_dispatch.comm.CommThread (submit cost on the caller; issued by the thread)
Rank 0 prints (max over ranks).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist


class Counter:
    def __init__(self) -> None:
        self.n, self.run = 0, True
        self.t = threading.Thread(target=self._loop, daemon=True)
        self.t.start()

    def _loop(self) -> None:
        while self.run:
            self.n += 1


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=11000)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--switch-us", type=float, default=None, help="sys.setswitchinterval in µs (default: CPython's)")
    args = p.parse_args()
    if args.switch_us:
        sys.setswitchinterval(args.switch_us * 1e-6)
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    from sonic_megatron.token_dispatch import comm

    rank, P = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    splits = [args.rows] * P
    inp = torch.randn(args.rows * P, 1536, device=device).to(torch.bfloat16)
    out = torch.empty_like(inp)
    small = torch.zeros(1024, device=device)
    thread = comm.comm_thread_for(group)

    def a2a():
        return dist.all_to_all_single(out, inp, splits, splits, group=group, async_op=True)

    def a2a_kernels():
        for _ in range(30):
            small.add_(1.0)
        return a2a()

    def threaded():
        return comm.all_to_all(out, inp, splits, splits, group, async_op=True, thread=thread)

    variants = {"a2a": a2a, "a2a+kernels": a2a_kernels, "thread a2a": threaded}
    rows = {}

    def launches(fn, counter: Counter | None) -> tuple[float, float]:
        """(seconds per launch, counter increments during the launches or 0)."""
        dist.barrier()
        torch.cuda.synchronize()
        n1, t1 = (counter.n if counter else 0), time.perf_counter()
        works = [fn() for _ in range(args.calls)]
        dt = time.perf_counter() - t1
        n2 = counter.n if counter else 0
        for w in works:
            w.wait()
        torch.cuda.synchronize()
        return dt / args.calls, n2 - n1

    default_interval = sys.getswitchinterval()
    for name, fn in variants.items():
        for _ in range(3):
            fn().wait()
        torch.cuda.synchronize()
        per = statistics.median(launches(fn, None)[0] for _ in range(5))  # host time, no helper thread
        # GIL share: a counting helper thread (switch interval 20 µs so the caller gets the GIL back quickly).
        sys.setswitchinterval(20e-6)
        rel = []
        for _ in range(5):
            c = Counter()
            time.sleep(0.002)
            n0, t0 = c.n, time.perf_counter()
            time.sleep(0.005)
            rate = (c.n - n0) / (time.perf_counter() - t0)
            dt, n = launches(fn, c)
            c.run = False
            c.t.join()
            rel.append(n / (rate * dt * args.calls) if rate > 0 else float("nan"))
        sys.setswitchinterval(default_interval)
        rows[name] = (per * 1e6, statistics.median(rel))
    t = torch.tensor([[u, r] for u, r in rows.values()], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"P={P} rows/peer={args.rows} calls={args.calls} switch interval {sys.getswitchinterval() * 1e6:.0f} us")
        print(f"{'variant':14s} {'host us/launch':>15s} {'GIL released':>13s}")
        for (name, _), (u, r) in zip(rows.items(), t.tolist(), strict=True):
            print(f"{name:14s} {u:15.1f} {r:13.2f}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
