"""Pin each local rank's process to its own physical CPU cores (``--bind-cores`` of the benchmarks).

The EP layer is host-bound at the issue-4 size, and an all-to-all completes only when the slowest rank has
launched it, so a rank whose Python thread shares a physical core (a hyper-thread sibling) with another busy
thread slows every rank: on one lent 4x H200 machine two of four ranks ran all their host code ~1.4x slower
than the other two (docs/PERF.md section 2, session 8). Binding the process before CUDA and NCCL start makes
their threads (autograd, NCCL proxy, watchdog) inherit the same cores, disjoint between ranks.
"""

from __future__ import annotations

import os


def physical_cores(cpus: list[int], siblings_of) -> list[list[int]]:
    """``cpus`` grouped by physical core (``siblings_of(cpu)`` -> a hashable id of the cpu's core), in order of
    each core's first cpu."""
    cores: dict = {}
    for c in sorted(cpus):
        cores.setdefault(siblings_of(c), []).append(c)
    return list(cores.values())


def share(cores: list[list[int]], local_rank: int, local_world_size: int) -> list[int]:
    """Local rank's cpus: an equal, contiguous block of whole cores (all cores when there are fewer cores than
    ranks, i.e. no binding)."""
    n = len(cores) // local_world_size
    if n == 0:
        return sorted(c for core in cores for c in core)
    return sorted(c for core in cores[local_rank * n : (local_rank + 1) * n] for c in core)


def _sibling_id(cpu: int) -> str:
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            return f.read().strip()
    except OSError:  # no topology information: every cpu its own core
        return str(cpu)


def bind_local_rank() -> list[int]:
    """Pin this process (and the threads it starts later) to its share of the cpus it may use, by torchrun's
    LOCAL_RANK / LOCAL_WORLD_SIZE; returns the cpus. Call before CUDA / process-group initialisation."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    mine = share(physical_cores(list(os.sched_getaffinity(0)), _sibling_id), local_rank, local_world)
    os.sched_setaffinity(0, mine)
    return mine
