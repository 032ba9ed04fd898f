"""bench layer's measuring helpers: the kernel-level overlap share from a trace, and the "no a2a" reference."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from _dist import part, part_results, run_distributed
from sonic_megatron.token_dispatch import comm, exchange

from sonic_megatron.bench import layer as B
from sonic_megatron.bench import layer_profile, layer_timing


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
    ms, share = layer_profile.a2a_under_kernels(events)
    assert ms == pytest.approx(14 / 1e3)
    assert share == pytest.approx((5 + 2) / 14)
    assert layer_profile.a2a_under_kernels([_k("gemm", 0, 1)]) == (0.0, 0.0)


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
    with layer_timing.no_layer_a2a():
        skipped = exchange.all_to_all is not comm.all_to_all
        expert_parallel_experts(x, routing, w1, w2, **kw)  # completes on every rank: no collective left unpaired
    return skipped, exchange.all_to_all is comm.all_to_all


def test_no_layer_a2a_skips_the_layer_exchanges_and_restores_them(ep_runs):
    for skipped, restored in part_results(ep_runs[1], "no_a2a"):
        assert skipped and restored


def test_chunks_entries():
    assert layer_timing.parse_chunks("1, 2,4 ") == [1, 2, 4]
    for bad in ("0", "", "2s", "1i", "1,x"):
        with pytest.raises(SystemExit, match="--chunks"):
            layer_timing.parse_chunks(bad)


def test_paired_difference_is_the_median_of_per_round_differences():
    # blocks drift (round 3 is slow for both variants); the paired median ignores the drift
    on, none = [5.0, 5.1, 9.0, 5.0, 5.2], [4.0, 4.0, 8.1, 4.1, 4.0]
    assert layer_timing.paired(on, none) == pytest.approx(1.0)
    assert layer_timing.median([3.0, 1.0, 2.0]) == 2.0


def _bench_layer_worker(
    rank,
    world_size,
    path,
    extra=("--chunks", "1,2", "--comm-sms", "0,8", "--no-baseline"),
):
    import argparse

    parser = argparse.ArgumentParser()
    B.add_arguments(parser)
    parser.add_argument("--json", default=None)  # added by the CLI for every benchmark
    common = ["--device", "cpu", "--tokens", "32", "--hidden", "16", "--ffn", "8", "--experts", "4", "--topk", "2"]
    common += ["--backend", "torch", "--warmup", "1", "--iters", "3"]
    destroy = B.dist.destroy_process_group
    B.dist.destroy_process_group = lambda *a, **k: None  # the test harness owns the group
    try:
        B.run(parser.parse_args([*common, *extra, "--json", path]))
    finally:
        B.dist.destroy_process_group = destroy
    return True


BASELINE_ARGS = ("--chunks", "1", "--dtype", "fp32")


def _ep_worker(rank, world_size, folder, with_megatron):
    """Every two-rank part of this file in one set of processes (each rank's start-up costs more than a part):
    the layer without its all-to-alls, bench layer's variants, and last its Megatron baseline."""
    out = {
        "no_a2a": part(_no_a2a_worker, rank, world_size),
        "variants": part(_bench_layer_worker, rank, world_size, os.path.join(folder, "layer.json")),
    }
    if with_megatron:
        baseline = os.path.join(folder, "baseline.json")
        out["baseline"] = part(_bench_layer_worker, rank, world_size, baseline, BASELINE_ARGS)
    return out


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench_layer")
    with_megatron = importlib.util.find_spec("megatron") is not None
    return folder, run_distributed(_ep_worker, 2, str(folder), with_megatron, timeout=600)


def test_bench_layer_on_cpu_times_every_variant_interleaved(ep_runs):
    folder, runs = ep_runs
    assert all(part_results(runs, "variants"))
    with open(folder / "layer.json") as f:
        result = json.load(f)
    rows = result["rows"]
    assert result["timing"].startswith("interleaved: 3 rounds")
    for chunks in (1, 2):
        mine = [r for r in rows if r["chunks"] == chunks]
        # the layer for comm_sms 0 and 8, then the layer without its all-to-alls
        assert [(r["variant"], r["comm_sms"]) for r in mine] == [("layer", 0), ("layer", 8), ("no a2a", 0)]
        for r in mine:
            assert r["ms"] > 0 and r["host_ms"] > 0 and r["a2a_alone_ms"] > 0
        for r in mine[:2]:
            assert 0.0 <= r["a2a_hidden"] <= 1.0
            assert r["bitwise"] and r["rel_diff_out"] < 1e-5
            assert r["bitwise_vs_first"] or chunks != 1


def test_bench_layer_on_cpu_with_the_megatron_baseline(ep_runs):
    """The baseline (Megatron's alltoall dispatcher + grouped_mm experts) runs on CPU/gloo under
    megatron_compat's CPU patches and agrees with ours."""
    pytest.importorskip("megatron.core")
    folder, runs = ep_runs
    assert all(part_results(runs, "baseline"))
    with open(folder / "baseline.json") as f:
        result = json.load(f)
    assert result["baseline_error"] is None
    (mg,) = [r for r in result["rows"] if r["provider"] == "megatron"]
    assert mg["ms"] > 0
    assert result["summary"]["speedup_vs_megatron"] > 0
    assert result["summary"]["max_rel_diff_ours_vs_megatron"] < 1e-4  # fp32 on CPU
