"""kernels/cute on the CPU against a fake QuACK: which QuACK entry point each tuning calls, with which tile
config and tile scheduler, and that the adapter installs the SM budget. The numerics are GPU-only
(tests/test_cute_gpu.py); this checks the wiring of ops.py, configs.py and quack_adapter.py where no GPU is."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import sys
import types
from typing import NamedTuple

import pytest
import torch
from sonic_megatron.kernels import options
from sonic_megatron.kernels.options import KernelOptions, set_kernel_options
from sonic_megatron.kernels.sm_reservation import reserve_sms

SMS = 132


@dataclasses.dataclass(frozen=True)
class _GemmConfig:  # the fields of quack.gemm_config.GemmConfig that ops.py and the adapter read
    tile_m: int
    tile_n: int
    pingpong: bool
    cluster_m: int
    cluster_n: int
    is_dynamic_persistent: bool
    cluster_k: int = 1
    tile_k: int | None = None
    max_swizzle_size: int = 8
    use_tma_gather: bool = False


class _SchedulerOptions(NamedTuple):
    max_active_clusters: object
    raster_order: int = 0
    max_swizzle_size: int = 8
    tile_count_semaphore: object = None
    batch_idx_permute: object = None


def _fake_quack(calls: list) -> dict[str, types.ModuleType]:
    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    def max_clusters(cluster_size, *args, **kwargs):
        return SMS // cluster_size

    def recorder(name, result=None):
        return lambda *args, **kwargs: calls.append((name, args, kwargs)) or result

    tuned = types.SimpleNamespace
    interface = module(
        "quack.gemm_interface",
        gemm_tuned=tuned(fn=recorder("gemm_tuned.fn")),
        gemm_gated_tuned=tuned(fn=recorder("gemm_gated_tuned.fn")),
        gemm=recorder("gemm"),
        gemm_add_inplace=recorder("gemm_add_inplace"),
        gemm_gated=recorder("gemm_gated"),
        gemm_dgated=recorder("gemm_dgated", (None, None, torch.zeros(3))),
    )
    fakes = {
        "cutlass": module("cutlass", Int32=lambda n: ("Int32", n)),
        "quack.cute_dsl_utils": module("quack.cute_dsl_utils", get_max_active_clusters=max_clusters),
        "quack.gemm_config": module("quack.gemm_config", GemmConfig=_GemmConfig),
        "quack.tile_scheduler": module("quack.tile_scheduler", TileSchedulerOptions=_SchedulerOptions),
        "quack.gemm_interface": interface,
        "quack.gemm": module("quack.gemm", get_max_active_clusters=max_clusters, _compile_gemm=None),
        "quack.gemm_act": module("quack.gemm_act", get_max_active_clusters=max_clusters, _compile_gemm_act=None),
        "quack.gemm_dact": module(
            "quack.gemm_dact",
            get_max_active_clusters=max_clusters,
            _compile_gemm_dact=None,
            gemm_dact=recorder("gemm_dact"),
        ),
    }
    fakes["quack"] = module("quack", gemm_interface=interface, cute_dsl_utils=fakes["quack.cute_dsl_utils"])
    return fakes


@pytest.fixture
def cute(monkeypatch, tmp_path):
    """(kernels.cute.ops imported over a fake QuACK on a 'CUDA' machine, the list of QuACK calls); every module
    and setting is restored afterwards."""
    calls: list = []
    for name, fake in _fake_quack(calls).items():
        monkeypatch.setitem(sys.modules, name, fake)
    supported = {"quack-kernels": "0.4.1", "nvidia-cutlass-dsl": "4.4.2"}
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: supported.get(name) or real_version(name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("QUACK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("QUACK_CACHE_AUTOTUNING", "1")
    monkeypatch.setattr(options, "_resolved", KernelOptions())
    monkeypatch.delattr(sys.modules["sonic_megatron.kernels"], "cute", raising=False)
    names = ("sonic_megatron.kernels.cute", "sonic_megatron.kernels.cute.ops")
    names += ("sonic_megatron.kernels.cute.quack_adapter", "sonic_megatron.kernels.cute.configs")
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    from sonic_megatron.kernels.cute import ops

    yield ops, calls
    for name in names:  # the modules imported over the fake
        sys.modules.pop(name, None)
    vars(sys.modules["sonic_megatron.kernels"]).pop("cute", None)  # (monkeypatch then restores a real one)


def _operands():
    A, B, out = torch.randn(8, 16), torch.randn(2, 16, 32), torch.empty(8, 32)
    return A, B, out, torch.tensor([0, 5, 8], dtype=torch.int32)


def test_heuristic_tuning_launches_the_heuristic_tiles_through_the_cache(cute):
    ops, calls = cute
    A, B, out, cu = _operands()
    ops._gemm("down", 32, 16, A, B, out, cu_seqlens_m=cu)
    name, _, kwargs = calls[-1]
    assert name == "gemm_tuned.fn" and kwargs["config"] == ops.heuristic_config("down", 32, 16)
    assert kwargs["dynamic_scheduler"] is False and kwargs["cu_seqlens_m"] is cu
    assert ops.quack_adapter.LAUNCHES.stats["slow"] == 1  # through the launch cache (the fake compiles nothing)
    ops._gemm_gated(32, A, B, out, out, "swiglu", cu, None)
    assert calls[-1][0] == "gemm_gated_tuned.fn" and calls[-1][2]["concat_layout"] == ("B",)
    dS = ops._gemm_dgated(32, A, B, out, out, out, torch.ones(8), "swiglu", cu, torch.arange(8))
    name, args, kwargs = calls[-1]
    assert name == "gemm_dact" and kwargs["colvec_reduce"].shape == (8, 1) and dS.shape == (8,)


def test_launches_past_the_reservation_use_the_dynamic_scheduler(cute):
    ops, calls = cute
    A, B, out, cu = _operands()
    with reserve_sms(16, gemms=1):
        for _ in range(2):
            ops._gemm("down", 32, 16, A, B, out, cu_seqlens_m=cu)
            sys.modules["quack.gemm"].get_max_active_clusters(2)  # what QuACK's path calls: takes the reservation
    (_, _, first), (_, _, second) = calls[-2:]
    assert not first["dynamic_scheduler"] and not first["config"].is_dynamic_persistent
    assert second["dynamic_scheduler"] and second["config"].is_dynamic_persistent


def test_the_sm_budget_is_installed_in_the_three_gemm_modules(cute):
    ops, _ = cute
    for name in ("quack.gemm", "quack.gemm_act", "quack.gemm_dact"):
        with reserve_sms(16):
            assert sys.modules[name].get_max_active_clusters(2) == SMS // 2 - 8, name
        assert sys.modules[name].get_max_active_clusters(2) == SMS // 2, name
    with reserve_sms(16, gemms=1):
        recorded = _SchedulerOptions(max_active_clusters=None, raster_order=3)
        got = ops.quack_adapter._scheduler_now(recorded, (2, None))
        assert got == _SchedulerOptions(("Int32", SMS // 2 - 8), 3)


@pytest.mark.parametrize("tuning", ["autotune", "default"])
def test_other_tunings_call_quacks_public_interface(cute, tuning):
    ops, calls = cute
    A, B, out, cu = _operands()
    set_kernel_options(KernelOptions(tuning=tuning))
    ops._gemm("dw1", 32, 16, A, B, out, cu_seqlens_k=cu, add_to_output=True)
    assert calls[-1][0] == "gemm_add_inplace" and calls[-1][2]["tuned"] == (tuning == "autotune")
    ops._gemm_gated(32, A, B, out, out, "swiglu", cu, None)
    assert calls[-1][0] == "gemm_gated" and calls[-1][2]["tuned"] == (tuning == "autotune")
    ops._gemm_dgated(32, A, B, out, out, out, torch.ones(8), "swiglu", cu, torch.arange(8))
    assert calls[-1][0] == "gemm_dgated" and calls[-1][2]["tuned"] == (tuning == "autotune")


def test_tile_overrides_replace_one_gemms_config(cute, monkeypatch):
    ops, calls = cute
    A, B, out, cu = _operands()
    set_kernel_options(KernelOptions(tiles="down=P64x96c12"))
    monkeypatch.setenv("SONIC_MEGATRON_CUTE_TILES", "down=C256x128")  # not read: the options are resolved
    ops._gemm("down", 32, 16, A, B, out, cu_seqlens_m=cu)
    config = calls[-1][2]["config"]
    assert (config.pingpong, config.tile_m, config.tile_n, config.cluster_m, config.cluster_n) == (True, 64, 96, 1, 2)
    ops._gemm("dx", 32, 16, A, B, out, cu_seqlens_m=cu)
    assert calls[-1][2]["config"] == ops.heuristic_config("dx", 32, 16)


def test_whole_tile_rows_take_a_128_row_dx_tile(cute):
    """Row counts in multiples of 128 (token rounding) fill 128-row tiles; the dx GEMM then takes one instead of
    its 192-row tile (RoutingMetadata.rows_multiple -> backward_data -> _gemm(rows_multiple=...))."""
    ops, calls = cute
    A, B, out, cu = _operands()
    for rows_multiple, tile_m in ((0, 192), (64, 192), (128, 128), (256, 128)):
        ops._gemm("dx", 32, 16, A, B, out, cu_seqlens_m=cu, rows_multiple=rows_multiple)
        assert calls[-1][2]["config"].tile_m == tile_m
    assert ops.heuristic_config("down", 32, 16, rows_multiple=128) == ops.heuristic_config("down", 32, 16)
