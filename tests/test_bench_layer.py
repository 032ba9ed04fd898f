"""bench layer's measuring helpers: the kernel-level overlap share from a trace, and the "no a2a" reference."""

from __future__ import annotations

import pytest
import torch
from _dist import run_distributed
from sonic_megatron.token_dispatch import comm, exchange

from sonic_megatron.bench import layer as B


def _k(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_a2a_under_kernels_counts_only_time_under_compute_kernels():
    events = [
        _k("ncclDevKernel_SendRecv(x)", 0, 10),  # covered 5..10 by the merged compute span 5..12
        _k("ncclDevKernel_SendRecv(x)", 20, 4),  # covered 22..24 (the second span 22..30)
        _k("ncclDevKernel_AllGather_RING_LL(x)", 40, 100),  # the plan's all-gather: not an all-to-all
        _k("gemm", 5, 3),
        _k("gemm", 7, 5),
        _k("gather_sum", 22, 8),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy", "ts": 0, "dur": 30},  # not a compute kernel
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 30},
    ]
    ms, share = B._a2a_under_kernels(events)
    assert ms == pytest.approx(14 / 1e3)
    assert share == pytest.approx((5 + 2) / 14)
    assert B._a2a_under_kernels([_k("gemm", 0, 1)]) == (0.0, 0.0)


def _no_a2a_worker(rank, world_size):
    from sonic_megatron.kernels import TopKRouting
    from sonic_megatron.token_dispatch import expert_parallel_experts

    g = torch.Generator().manual_seed(rank)
    T, D, F, E, K = 16, 8, 4, 4, 2
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    routing = TopKRouting(torch.rand(T, K, generator=g, dtype=torch.float64), idx)
    w1 = torch.randn(E // world_size, 2 * F, D, generator=g, dtype=torch.float64)
    w2 = torch.randn(E // world_size, D, F, generator=g, dtype=torch.float64)
    kw = dict(group=torch.distributed.group.WORLD, num_experts=E, backend="torch")
    with B._no_layer_a2a():
        skipped = exchange.all_to_all is not comm.all_to_all
        expert_parallel_experts(x, routing, w1, w2, **kw)  # completes on every rank: no collective left unpaired
    return skipped, exchange.all_to_all is comm.all_to_all and exchange.send_recv is comm.send_recv


def test_no_layer_a2a_skips_the_layer_exchanges_and_restores_them():
    for skipped, restored in run_distributed(_no_a2a_worker, 2):
        assert skipped and restored
