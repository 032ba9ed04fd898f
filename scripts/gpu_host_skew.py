#!/usr/bin/env python3
"""Is one rank's host slower than the others, and does pinning the ranks to cores change it?

    torchrun --nproc_per_node 4 scripts/gpu_host_skew.py --out $OUT

Session 8's and 11's timelines showed ranks of one machine running every host phase 1.3-1.4x slower than the
others (same code, same sizes); the interleaved EP step then waits for the slowest rank at every all-to-all.
Per CPU placement (``default``: as torchrun starts the ranks; ``numa``: each rank restricted to the cores of its
GPU's NUMA node, from ``nvidia-smi topo``; ``core``: each rank pinned to one core of that node, a different one
per rank), every rank runs at the same time (after a barrier):
  * ``python_ms``: a fixed pure-Python loop (host speed of the interpreter on that core);
  * ``launch_us``: one tiny CUDA kernel launch (torch.add on a 1-element tensor), averaged over 2000;
  * ``step_host_ms`` / ``step_ms``: the interleaved EP step (``ep_forward_backward``, schedule 1i, comm_sms 32,
    the issue-4 size): median over rounds of its host time on this rank / its wall time (max over ranks).
Rank 0 prints a table per placement and writes ``host_skew.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import time

import torch
import torch.distributed as dist
from ep_step import init_ranks, interleaved_step


def _numa_cpus(gpu: int) -> set[int] | None:
    """The CPU affinity list nvidia-smi reports for this GPU (its NUMA-local cores), or None."""
    try:
        text = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in text.splitlines():
        if line.startswith(f"GPU{gpu}\t") or line.startswith(f"GPU{gpu} "):
            for field in line.split("\t"):
                if re.fullmatch(r"[0-9,\-]+", field.strip()) and ("-" in field or "," in field):
                    cpus: set[int] = set()
                    for part in field.strip().split(","):
                        a, _, b = part.partition("-")
                        cpus.update(range(int(a), int(b or a) + 1))
                    return cpus
    return None


def _python_ms() -> float:
    t0 = time.perf_counter()
    acc = 0
    for i in range(1_000_000):
        acc += i & 7
    return (time.perf_counter() - t0) * 1e3


def _launch_us(device) -> float:
    a = torch.zeros(1, device=device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(2000):
        a.add_(1)
    t = (time.perf_counter() - t0) / 2000 * 1e6
    torch.cuda.synchronize()
    return t


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="out")
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args()
    device, rank, P = init_ranks()
    local = device.index  # this rank's GPU
    step = interleaved_step(device, comm_sms=32)

    started = os.sched_getaffinity(0)
    numa = _numa_cpus(local)
    placements = {"default": started}
    if numa:
        local_cpus = sorted(numa & started) or sorted(numa)
        placements["numa"] = set(local_cpus)
        # One core per rank: ranks sharing a NUMA node take different cores of it.
        same_node = [r for r in range(P) if _numa_cpus(r) == numa]
        placements["core"] = {local_cpus[(same_node.index(local) * 2) % len(local_cpus)]}
    report: dict = {"P": P, "numa_cpus_of_gpu": {}, "placements": {}}
    for name, cpus in placements.items():
        os.sched_setaffinity(0, cpus)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        dist.barrier()
        py = statistics.median(_python_ms() for _ in range(5))
        dist.barrier()
        launch = statistics.median(_launch_us(device) for _ in range(5))
        hosts, walls = [], []
        for _ in range(args.rounds):
            torch.cuda.synchronize()
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            hosts.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
        wall = torch.tensor(walls, device=device, dtype=torch.float64)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        mine = torch.tensor([py, launch, statistics.median(hosts) * 1e3, len(cpus)], device=device)
        rows = [torch.zeros_like(mine) for _ in range(P)]
        dist.all_gather(rows, mine)
        report["placements"][name] = {
            "step_ms_max_over_ranks": statistics.median(wall.tolist()) * 1e3,
            "per_rank": [
                dict(zip(("python_ms", "launch_us", "step_host_ms", "cpus"), r.tolist(), strict=True)) for r in rows
            ],
        }
    report["numa_cpus_of_gpu"][rank] = sorted(numa) if numa else None
    os.sched_setaffinity(0, started)
    if rank == 0:
        for name, rep in report["placements"].items():
            print(f"== placement {name}: step {rep['step_ms_max_over_ranks']:.3f} ms (median, max over ranks)")
            for r, row in enumerate(rep["per_rank"]):
                print(
                    f"   rank {r}: python {row['python_ms']:.1f} ms  launch {row['launch_us']:.1f} us  "
                    f"step host {row['step_host_ms']:.3f} ms  cpus {int(row['cpus'])}"
                )
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_skew.json"), "w") as f:
            json.dump(report, f, indent=1)
        print(subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout)
        print(subprocess.run(["lscpu"], capture_output=True, text=True).stdout[:3000])
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
