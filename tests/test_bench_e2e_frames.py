"""bench e2e --profile-stacks: kernels by layer and host frames of a trace with Python frames (synthetic)."""

from __future__ import annotations

import gzip
import json

import pytest
from test_bench_e2e import _args

from sonic_megatron.bench import e2e, e2e_frames, e2e_profile

MOE = "megatron/core/transformer/moe/moe_layer.py(607): forward"
PLAN = "sonic_megatron/token_dispatch/plan.py(271): start_plan"


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "args": args}


def _stack_trace() -> list[dict]:
    """One iteration: a MoE layer forward (a GEMM and an all-to-all launched in it), attention outside it, both
    GEMMs' backward nodes on autograd's thread, a launch outside any op, a recursive plugin frame."""
    return [
        _x("user_annotation", "ProfilerStep#5", 0, 1000),
        _x("python_function", MOE, 100, 100),
        _x("python_function", PLAN, 110, 30),
        _x("python_function", PLAN, 150, 20),
        _x("cpu_op", "aten::mm", 120, 10, **{"Sequence number": 7}),
        _x("cuda_runtime", "cudaLaunchKernel", 125, 2, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 160, 2, correlation=2),
        _x("python_function", "megatron/core/transformer/attention.py(1278): forward", 300, 100),
        _x("cpu_op", "aten::mm", 310, 10, **{"Sequence number": 8}),
        _x("cuda_runtime", "cudaLaunchKernel", 320, 2, correlation=3),
        _x("python_function", "sonic_megatron/x.py(1): f", 500, 40),
        _x("python_function", "sonic_megatron/x.py(1): f", 510, 10),
        _x("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 600, 50, tid=2, **{"Sequence number": 7}),
        _x("cuda_runtime", "cudaLaunchKernel", 610, 2, tid=2, correlation=4),
        _x("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 700, 50, tid=2, **{"Sequence number": 8}),
        _x("cuda_runtime", "cudaLaunchKernel", 710, 2, tid=2, correlation=5),
        _x("cuda_runtime", "cudaLaunchKernel", 800, 2, tid=2, correlation=6),
        _x("kernel", "kernel_cutlass_kernel_quackgemm_default_epiGemm", 130, 50, tid=7, correlation=1),
        _x("kernel", "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 180, 30, tid=8, correlation=2),
        _x("kernel", "nvjet_sm90_tst_256x128", 330, 100, tid=7, correlation=3),
        _x("kernel", "kernel_cutlass_kernel_quackgemm_dgrad", 620, 40, tid=7, correlation=4),
        _x("kernel", "nvjet_sm90_tst_dgrad", 720, 20, tid=7, correlation=5),
        _x("gpu_memset", "Memset (Device)", 810, 5, tid=7, correlation=6),
    ]


def test_kernels_by_layer_follow_the_moe_frames_into_the_backward():
    """A kernel is the MoE layers' when launched inside MoELayer.forward's frame or inside the backward node of an
    op that ran there (autograd's sequence number); NCCL's apart; the rest is the model's."""
    events = _stack_trace()
    gpu = [e for e in events if e["cat"] in ("kernel", "gpu_memset")]
    split = e2e_frames.kernels_by_layer(events, gpu, iterations=1)
    assert split == pytest.approx({"moe": 0.09, "moe_nccl": 0.03, "other": 0.125, "other_nccl": 0.0})


def test_host_frames_rank_the_moe_and_plugin_frames_counting_recursion_once():
    frames = {f["frame"]: f for f in e2e_frames.host_frames(_stack_trace(), iterations=1)}
    assert set(frames) == {MOE, PLAN, "sonic_megatron/x.py(1): f"}  # attention.py is neither package
    assert frames[PLAN] == {"frame": PLAN, "ms": pytest.approx(0.05), "calls": 2, "ms_per_call": pytest.approx(0.025)}
    assert frames["sonic_megatron/x.py(1): f"]["ms"] == pytest.approx(0.04)  # the inner call is inside the outer
    assert frames[MOE]["ms"] == pytest.approx(0.1) and frames[MOE]["calls"] == 1


def test_summarize_trace_adds_them_only_with_stacks(tmp_path):
    path = tmp_path / "rank-0.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _stack_trace()}, f)
    prof = e2e_profile.summarize_trace(str(path), iterations=1)
    assert prof["kernels_by_layer_ms"]["moe"] == pytest.approx(0.09) and prof["host_frames"][0]["frame"] == MOE
    lines = e2e_frames.summary_lines("sonic", prof)
    assert "kernels of the MoE layers 0.09 ms/iter (NCCL 0.03), of the rest 0.12" in lines[0]
    assert "nothing idle and NCCL hidden about 0.21 ms/iter" in lines[0] and "in " + MOE in lines[1]
    no_stacks = [e for e in _stack_trace() if e["cat"] != "python_function"]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": no_stacks}, f)
    prof = e2e_profile.summarize_trace(str(path), iterations=1)
    assert "kernels_by_layer_ms" not in prof and e2e_frames.summary_lines("sonic", prof) == []


def test_profile_stacks_flag(tmp_path):
    flags = e2e_profile.megatron_flags(12, 2, "/logs/tb", stacks=True)
    assert flags[-1] == "--pytorch-profiler-collect-callstack"
    assert "--pytorch-profiler-collect-callstack" not in e2e_profile.megatron_flags(12, 2, "/logs/tb")
    args = _args(megatron_lm=tmp_path, nproc=1, iters=12, warmup=3, profile_stacks=True, dry_run=True)
    with pytest.raises(ValueError, match="--profile-stacks: needs --profile N"):
        e2e.validate(args, gpu_count=0)
    args = _args(megatron_lm=tmp_path, nproc=1, iters=12, warmup=3, profile=2, profile_stacks=True, dry_run=True)
    assert e2e.validate(args, gpu_count=0)[2] == 1
