"""kernels/cute on the CPU against a fake QuACK: which QuACK entry point each tuning calls, with which tile
config and tile scheduler, and that importing the adapter assigns nothing in QuACK's modules and writes no
environment variable. The numerics are GPU-only (tests/test_cute_gpu.py); this checks the wiring of ops.py,
configs.py and quack_adapter.py where no GPU is."""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.metadata
import importlib.util
import os
import sys
import types
import typing
import warnings

import pytest
import torch
from sonic_megatron.kernels import backends, options
from sonic_megatron.kernels.options import KernelOptions, set_kernel_options
from sonic_megatron.kernels.sm_reservation import reserve_sms


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
    split_k: int = 1
    swap_ab: bool = False


class _Plan(typing.NamedTuple):  # the fields of QuACK's dispatch plan (quack.gemm._GemmPlan) the adapter reads
    max_active_clusters: int
    scheduler_static: object
    max_swizzle_size: int
    cluster_M: int
    cluster_N: int
    split_k_mode: int


FULL_CLUSTERS = 66


def _fake_quack(calls: list) -> dict[str, types.ModuleType]:
    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    def recorder(name, result=None):
        return lambda *args, **kwargs: calls.append((name, args, kwargs)) or result

    def gemm_tuned_fn(*args, config, dynamic_scheduler, **kwargs):
        calls.append(("gemm_tuned.fn", args, dict(kwargs, config=config, dynamic_scheduler=dynamic_scheduler)))
        plan = _Plan(FULL_CLUSTERS, ("static", FULL_CLUSTERS), 8, config.cluster_m, config.cluster_n, 0)
        return config, 1, dynamic_scheduler, plan  # QuACK 0.6.5: the decisions and the dispatch plan

    # QuACK 0.6.5's warm-launch entry, with its parameters (the adapter passes them all by name)
    def _gemm_execute(A, B, out, C, *, bias, alpha, beta, cu_seqlens_m, cu_seqlens_k, A_idx, batch_idx_permute,
                      add_to_output, dynamic_scheduler, config, rounding_mode, sr_seed, concat_layout, SFA, SFB,
                      split_k, split_k_mode, bs_format_a=None, bs_format_b=None, SFD=None, sfd_norm_const=None,
                      SFDCol=None, dispatch_plan=None):  # fmt: skip
        calls.append(("_gemm_execute", (A, B, out, C), dict(locals())))
        return dispatch_plan

    tuned = types.SimpleNamespace
    interface = module(
        "quack.gemm_interface",
        gemm_tuned=tuned(fn=gemm_tuned_fn),
        _gemm_execute=_gemm_execute,
        gemm=recorder("gemm"),
        gemm_add_inplace=recorder("gemm_add_inplace"),
        gemm_gated=recorder("gemm_gated"),
        gemm_dgated=recorder("gemm_dgated", (None, None, torch.zeros(3))),
    )
    fakes = {
        "quack.gemm_config": module("quack.gemm_config", GemmConfig=_GemmConfig),
        "quack.gemm_interface": interface,
        "quack.gemm_tvm_ffi_utils": module(
            "quack.gemm_tvm_ffi_utils", make_scheduler_args=lambda clusters, swizzle, sem: ("static", clusters)
        ),
        "quack.rounding": module("quack.rounding", RoundingMode=types.SimpleNamespace(RN=0)),
    }

    class _Mod:  # an epilogue module of QuACK 0.6.5: gemm() launches and returns its plan (its parameters)
        def __init__(self, kind):
            self.kind = kind

        def gemm(self, A, B, D, C=None, *, epi_args, tile_M=128, tile_N=256, cluster_M=2, cluster_N=1, tile_K=None,
                 pingpong=False, persistent=True, is_dynamic_persistent=False, max_swizzle_size=8,
                 tile_count_semaphore=None, cu_seqlens_m=None, A_idx=None, rounding_mode=0, epi_key_overrides=None,
                 b_kn=False, use_tma_gather=False, concat_layout=None, swap_ab=False):  # fmt: skip
            calls.append((f"{self.kind}.gemm", (A, B, D, C), dict(locals())))
            return _Plan(FULL_CLUSTERS, ("static", FULL_CLUSTERS), max_swizzle_size, cluster_M, cluster_N, 0)

    def run_gemm_epi_plan(plan, A, B, D, C, epi_values, *, ag_args=None, tile_count_semaphore=None,
                          cu_seqlens_m=None, cu_seqlens_k=None, A_idx=None, SFA=None, SFB=None,
                          split_k_buffers=None):  # fmt: skip
        calls.append(("run_gemm_epi_plan", (A, B, D, C), dict(locals())))

    mods = {"gated": _Mod("gated"), "dgated": _Mod("dgated")}
    fakes["quack.epilogue.library"] = module(
        "quack.epilogue.library",
        linear_act_mod=lambda activation, *, gated, **flags: mods["gated"],
        dgated_mod=lambda activation, *, has_scale, has_reduce: mods["dgated"],
    )
    fakes["quack.gemm_runtime.host"] = module("quack.gemm_runtime.host", run_gemm_epi_plan=run_gemm_epi_plan)
    fakes["quack.gemm_runtime"] = module("quack.gemm_runtime", host=fakes["quack.gemm_runtime.host"], __path__=[])
    fakes["quack.epilogue"] = module("quack.epilogue", library=fakes["quack.epilogue.library"], __path__=[])
    fakes["quack"] = module(
        "quack", gemm_interface=interface, gemm_config=fakes["quack.gemm_config"], epilogue=fakes["quack.epilogue"]
    )
    return fakes


def _attributes(fakes: dict[str, types.ModuleType]) -> dict:
    return {name: dict(vars(m)) for name, m in fakes.items()} | {
        "quack.gemm_interface.gemm_tuned": dict(vars(fakes["quack.gemm_interface"].gemm_tuned))
    }


@pytest.fixture
def cute(monkeypatch, tmp_path):
    """(kernels.cute.ops imported over a fake QuACK on a 'CUDA' machine, the list of QuACK calls); every module
    and setting is restored afterwards."""
    calls: list = []
    fakes = _fake_quack(calls)
    for name, fake in fakes.items():
        monkeypatch.setitem(sys.modules, name, fake)
    supported = {"quack-kernels": "0.6.5", "nvidia-cutlass-dsl": "4.7.1"}
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: supported.get(name) or real_version(name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(options, "_resolved", KernelOptions())
    monkeypatch.setattr(backends, "_warned", set())
    monkeypatch.delattr(sys.modules["sonic_megatron.kernels"], "cute", raising=False)
    names = ("sonic_megatron.kernels.cute", "sonic_megatron.kernels.cute.ops")
    names += ("sonic_megatron.kernels.cute.quack_adapter", "sonic_megatron.kernels.cute.configs")
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    before = (_attributes(fakes), dict(os.environ))
    from sonic_megatron.kernels.cute import ops

    ops.imported_over = before, (_attributes(fakes), dict(os.environ))  # read by the test of the import itself
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
    assert kwargs["dynamic_scheduler"] is False and kwargs["cu_seqlens_m"] is cu and kwargs["C"] is None
    ops._gemm("dw1", 32, 16, A, B, out, cu_seqlens_k=cu, concat_layout=("out",), add_to_output=True)
    _, args, kwargs = calls[-1]
    assert args[2] is out and kwargs["C"] is out and kwargs["concat_layout"] == ("out", "C")
    ops._gemm_gated(32, A, B, out, out, "swiglu", cu, None)
    name, args, kwargs = calls[-1]
    config = ops.heuristic_config("up", 32, 16)
    assert name == "gated.gemm" and kwargs["concat_layout"] == ("B",) and kwargs["b_kn"] is False
    assert (kwargs["tile_M"], kwargs["tile_N"], kwargs["pingpong"]) == (config.tile_m, config.tile_n, config.pingpong)
    assert args[1].shape == B.mT.shape and args[2] is out and kwargs["epi_args"] == {"mAuxOut": out}
    dS = ops._gemm_dgated(32, A, B, out, out, out, torch.ones(8), "swiglu", cu, torch.arange(8))
    name, args, kwargs = calls[-1]
    config = ops.heuristic_config("dh", 32, 16)
    assert name == "dgated.gemm" and kwargs["b_kn"] is True and args[1] is B and args[3] is out
    assert sorted(kwargs["epi_args"]) == ["mAuxOut", "mColVecBroadcast", "mColVecReduce"]
    partials = kwargs["epi_args"]["mColVecReduce"]
    assert partials.shape == (8, -(-B.shape[-1] // config.tile_n)) and dS.shape == (8,)  # summed per row


def test_launches_past_the_reservation_use_the_dynamic_scheduler(cute):
    ops, calls = cute
    A, B, out, cu = _operands()
    with reserve_sms(16, gemms=1):
        for _ in range(2):
            ops._gemm("down", 32, 16, A, B, out, cu_seqlens_m=cu)
    (_, _, first), (_, _, second) = calls[-2:]
    assert not first["dynamic_scheduler"] and not first["config"].is_dynamic_persistent
    assert second["dynamic_scheduler"] and second["config"].is_dynamic_persistent


def test_later_calls_replay_quacks_plans_on_fewer_sms_inside_a_reservation(cute):
    """A signature's first call goes through QuACK's gemm_tuned.fn (or the epilogue module's gemm); later ones, at
    other sizes too, launch the plan it returned (QuACK's warm-launch entry, run_gemm_epi_plan), inside
    ``reserve_sms(n)`` with fewer clusters and scheduler arguments to match."""
    ops, calls = cute
    A, B, out, cu = _operands()
    ops._gemm("down", 32, 16, A, B, out, cu_seqlens_m=cu)
    assert calls[-1][0] == "gemm_tuned.fn"
    plan = ops.quack_adapter._DECIDED[next(iter(ops.quack_adapter._DECIDED))][3]
    A2, out2 = torch.randn(5, 16), torch.empty(5, 32)
    ops._gemm("down", 32, 16, A2, B, out2, cu_seqlens_m=cu)
    name, args, kwargs = calls[-1]
    assert name == "_gemm_execute" and args[0] is A2 and args[2] is out2 and kwargs["dispatch_plan"] is plan
    assert kwargs["config"] == ops.heuristic_config("down", 32, 16) and kwargs["cu_seqlens_m"] is cu
    ops._gemm_gated(32, A, B, out, out, "swiglu", cu, None)
    assert calls[-1][0] == "gated.gemm"
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        with reserve_sms(16):
            ops._gemm("down", 32, 16, A2, B, out2, cu_seqlens_m=cu)
            fewer = calls[-1][2]["dispatch_plan"]
            ops._gemm_gated(32, A2, B, out2, out2, "swiglu", cu, None)
            name, args, kwargs = calls[-1]
    assert not warned
    # cluster_m 2 x cluster_n 1 (the down GEMM's tiles): 16 SMs = 8 clusters fewer
    assert fewer.max_active_clusters == FULL_CLUSTERS - 16 // (plan.cluster_M * plan.cluster_N)
    assert fewer.scheduler_static == ("static", fewer.max_active_clusters)
    assert name == "run_gemm_epi_plan" and args[0] is A2 and args[2] is out2
    assert kwargs["epi_values"] == {"mAuxOut": out2}
    gated = kwargs["plan"]
    assert gated.max_active_clusters == FULL_CLUSTERS - 16 // (gated.cluster_M * gated.cluster_N)
    ops._gemm("down", 32, 16, A2, B, out2, cu_seqlens_m=cu)
    assert calls[-1][2]["dispatch_plan"] is plan  # outside the reservation: every SM again


def test_a_reservation_under_quacks_own_tunings_is_reported_once(cute):
    ops, _ = cute
    A, B, out, cu = _operands()
    set_kernel_options(KernelOptions(tuning="default"))
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        with reserve_sms(16):
            ops._gemm("down", 32, 16, A, B, out, cu_seqlens_m=cu)
            ops._gemm_gated(32, A, B, out, out, "swiglu", cu, None)
    assert len(warned) == 1 and "run on every SM" in str(warned[0].message)


def test_importing_the_adapter_assigns_nothing_in_quack_and_writes_no_environment(cute):
    ops, _ = cute
    (attributes, environ), (attributes_after, environ_after) = ops.imported_over
    assert attributes_after == attributes
    assert environ_after == environ


def test_other_gpus_take_quacks_default_config_under_the_heuristic_tuning(cute, monkeypatch):
    """Off Hopper (e.g. Blackwell, sm_100) the Hopper-measured tiles are not used: QuACK's public functions pick
    their kernels and default config by the device's compute capability."""
    ops, calls = cute
    A, B, out, cu = _operands()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    ops._gemm("down", 32, 16, A, B, out, cu_seqlens_m=cu)
    assert calls[-1][0] == "gemm" and calls[-1][2]["tuned"] is False
    ops._gemm_gated(32, A, B, out, out, "swiglu", cu, None)
    assert calls[-1][0] == "gemm_gated" and calls[-1][2]["tuned"] is False and "config" not in calls[-1][2]


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


class _RaisingLoader(importlib.abc.Loader, importlib.abc.MetaPathFinder):
    """Imports of ``name`` raise what QuACK's epilogue library raised where its packages sat outside site-packages."""

    name = "quack.epilogue.library"

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname == self.name else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise TypeError("epilogue fn depends on <Logger CUTE_DSL (Level 51)> (type logging.Logger)")


def test_an_epilogue_library_that_does_not_import_makes_the_backend_unavailable_saying_why(cute, monkeypatch):
    """QuACK imports its epilogue library at the gated GEMM's first call; the adapter imports it first, so a failure
    there (QuACK's packages outside site-packages) reaches the backend choice as a reason, not a forward's error."""
    ops, _ = cute
    monkeypatch.delitem(sys.modules, "quack.epilogue.library")
    monkeypatch.setattr(sys, "meta_path", [_RaisingLoader(), *sys.meta_path])
    for name in ("sonic_megatron.kernels.cute", "sonic_megatron.kernels.cute.ops"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delitem(sys.modules, "sonic_megatron.kernels.cute.quack_adapter", raising=False)
    monkeypatch.delattr(sys.modules["sonic_megatron.kernels"], "cute", raising=False)
    reason = backends.cute_import_reason()
    assert reason is not None and "QuACK's epilogue library does not import" in reason and "site-packages" in reason


def test_an_explicit_cute_on_blackwell_runs_untested_and_auto_keeps_torch(cute, monkeypatch):
    """sm_100: moe_experts' backend='cute' takes the cute ops with one warning that they are untested there (QuACK's
    own configs, ``_tuning``); 'auto' takes torch, naming why."""
    from sonic_megatron.kernels import interface

    ops, _ = cute
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        assert interface.resolve_backend("cute", torch.device("cuda")) is ops
        assert interface.resolve_backend("auto", torch.device("cuda")) is interface.torch_backend
    messages = [str(w.message) for w in warned]
    assert len(messages) == 2 and "runs on sm_100 untested" in messages[0], messages
    assert "backend='auto' uses the torch backend because the GPU is sm_100" in messages[1]
    assert ops._tuning(torch.device("cuda")) == "default"
