"""``--cpu-bind``: pin each rank's process to a CPU core of its own (benchmarks run on one node).

Why: the EP layer is host-bound at the issue-4 size, and every all-to-all of a step waits for the slowest rank's
host, so one rank on a slow core sets the pace for all of them. On the lent 4x H200 machine (a KVM guest, 64 vCPUs,
one NUMA node) a fixed pure-Python loop took 35-39 ms on some vCPUs and 52-67 ms on others, and the rank that
landed on a slow one ran the step's host work 1.4x slower than the rest (docs/PERF.md section 2, session 11).

Modes: ``none`` (default): as started. ``fast``: local rank 0 times a short Python loop on every core this process
may use (about 10 ms per core), and local rank r pins itself to the r-th fastest. Threads started before the
binding (NCCL's, the process group's watchdog) keep their affinity. Every rank of the run must be on this node.
"""

from __future__ import annotations

import os
import time

import torch.distributed as dist

CPU_BIND_MODES = ("none", "fast")


def _loop_seconds(n: int = 100_000) -> float:
    t0 = time.perf_counter()
    acc = 0
    for i in range(n):
        acc += i & 7
    return time.perf_counter() - t0


def core_speeds(cpus) -> list[tuple[float, int]]:
    """(seconds of the probe loop, core) for each core in ``cpus``, fastest first (best of 3 per core); the
    process's affinity is restored afterwards."""
    saved = os.sched_getaffinity(0)
    timings = []
    try:
        for core in sorted(cpus):
            os.sched_setaffinity(0, {core})
            timings.append((min(_loop_seconds() for _ in range(3)), core))
    finally:
        os.sched_setaffinity(0, saved)
    return sorted(timings)


def bind_cpu(mode: str) -> dict | None:
    """Apply ``--cpu-bind`` ``mode`` to this process (after init_process_group when distributed). Returns
    what was done (core, its probe time, the fastest and slowest probe times of the node) or None for "none"."""
    if mode not in CPU_BIND_MODES:
        raise SystemExit(f"--cpu-bind must be one of {CPU_BIND_MODES}, got {mode!r}")
    if mode == "none":
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    distributed = dist.is_available() and dist.is_initialized()
    if distributed and dist.get_world_size() != local_world:
        raise SystemExit(
            f"--cpu-bind fast: every rank must run on this node (world size {dist.get_world_size()}, "
            f"LOCAL_WORLD_SIZE {local_world})"
        )
    speeds = [core_speeds(os.sched_getaffinity(0)) if local_rank == 0 else None]
    if distributed:
        dist.broadcast_object_list(speeds, src=0)
    speeds = speeds[0]
    if len(speeds) < local_world:
        raise SystemExit(f"--cpu-bind fast: {local_world} ranks but only {len(speeds)} usable cores")
    seconds, core = speeds[local_rank]
    os.sched_setaffinity(0, {core})
    return dict(core=core, probe_ms=seconds * 1e3, fastest_ms=speeds[0][0] * 1e3, slowest_ms=speeds[-1][0] * 1e3)
