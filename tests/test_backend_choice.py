"""The experts backend is decided when a layer is built, from its config, by the cute backend's one rule
(``kernels/backends.py``): ``auto`` gives ``cute`` where it runs, else ``torch`` with one warning naming the reason;
an explicit ``cute`` that cannot run the layer fails at build. Also: ``--moe-router-topk`` > ``--num-experts`` is
refused at build. CPU only: the device capability and the backend's importability are injected."""

from __future__ import annotations

import types
import warnings

import pytest
import test_cute_wiring
import torch
import torch.nn.functional as F
from sonic_megatron.kernels import TopKRouting, backends, interface, moe_experts

from sonic_megatron.config import SonicConfig, validate_megatron_config
from sonic_megatron.experts import SonicExperts
from sonic_megatron.layer_options import LayerOptions
from sonic_megatron.testing import moe_config

cute = test_cute_wiring.cute  # kernels.cute.ops over a fake QuACK (the call-time check on CPU)

HOPPER = (9, 0)
BLACKWELL = (10, 0)
SUPPORTED = dict(params_dtype=torch.bfloat16, hidden_size=32, moe_ffn_hidden_size=48)  # swiglu (moe_config's)


@pytest.fixture
def device(monkeypatch):
    """Set the device the layer is built for: ``device(capability)`` (None: no CUDA), the backend importable;
    every warning issued once per reason afresh."""
    monkeypatch.setattr(backends, "_warned", set())
    monkeypatch.setattr(backends, "cute_import_reason", lambda: None)

    def set_capability(capability):
        monkeypatch.setattr(backends, "current_device_capability", lambda: capability)

    return set_capability


def _resolve(sonic=None, check_megatron=True, layers=1, **overrides):
    """(the backend of ``layers`` layers built with one config, the warnings their builds gave)."""
    config = moe_config(**{**SUPPORTED, **overrides})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = {LayerOptions.resolve(sonic, config, check_megatron=check_megatron).ep.backend for _ in range(layers)}
    (backend,) = chosen
    return backend, [str(w.message) for w in caught if "sonic_megatron" in str(w.message)]


# ----------------------------------------------------------------------------------------------------------
# The rule
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, words",
    [
        (("swiglu", torch.bfloat16, 4096, 1536, HOPPER), None),
        (("geglu", torch.float16, 32, 48, HOPPER), None),
        (("gelu", torch.bfloat16, 4096, 1536, HOPPER), ["'gelu' is not a gated activation", "swiglu"]),
        (("relu2", torch.bfloat16, 4096, 1536, HOPPER), ["'relu2' is not a gated activation"]),
        (("swiglu", torch.float32, 4096, 1536, HOPPER), ["params_dtype", "torch.float32", "torch.bfloat16"]),
        (("swiglu", torch.bfloat16, 100, 1536, HOPPER), ["hidden size D", "is 100, not a multiple of 8"]),
        (("swiglu", torch.bfloat16, 4096, 36, HOPPER), ["expert ffn size F", "is 36, not a multiple of 8"]),
        (("swiglu", torch.bfloat16, 4096, 1536, (8, 0)), ["sm_80", "Hopper (sm_90) only"]),
        (("swiglu", torch.bfloat16, 4096, 1536, None), ["no CUDA GPU"]),
        (("swiglu", torch.bfloat16, 4096, 1536, BLACKWELL), ["sm_100", "untested", "backend='cute'"]),
    ],
)
def test_the_rule_names_the_reason(args, words):
    reason = backends.cute_unsupported_reason(*args)
    if words is None:
        assert reason is None
    else:
        assert all(w in reason for w in words), reason


def test_blackwell_runs_cute_only_when_asked_for_by_name():
    """sm_100 (untested): the rule refuses it for 'auto' and admits it for an explicit 'cute', with its config rule;
    other GPUs stay refused either way."""
    assert backends.cute_unsupported_reason("swiglu", torch.bfloat16, 4096, 1536, BLACKWELL, explicit=True) is None
    assert "is 36" in backends.cute_unsupported_reason("swiglu", torch.bfloat16, 4096, 36, BLACKWELL, explicit=True)
    assert "sm_80" in backends.cute_unsupported_reason("swiglu", torch.bfloat16, 4096, 1536, (8, 0), explicit=True)
    assert "untested" in backends.untested_device_note(BLACKWELL)
    assert backends.untested_device_note(HOPPER) is None and backends.untested_device_note(None) is None


def test_the_device_is_checked_first_and_the_expert_count_when_given():
    assert "no CUDA GPU" in backends.cute_unsupported_reason("gelu", torch.float32, 7, 7, None)
    assert "not in [1, 65535]" in backends.cute_unsupported_reason("swiglu", torch.bfloat16, 8, 8, HOPPER, 70000)


def test_the_kernels_call_time_check_is_the_same_rule(cute):
    """``cute/ops.py::check_supported`` raises the rule's reason (no copy of its own)."""
    ops, _ = cute
    x, w1, w2 = torch.zeros(4, 36, dtype=torch.bfloat16), torch.zeros(2, 96, 36), torch.zeros(2, 36, 48)
    reason = backends.cute_config_reason("swiglu", torch.bfloat16, 36, 48, 2)
    with pytest.raises(ValueError) as info:
        ops.check_supported(x, w1.bfloat16(), w2.bfloat16(), "swiglu")
    assert str(info.value) == f"backend 'cute': {reason}"


def test_moe_experts_auto_asks_the_rule_before_any_kernel(monkeypatch):
    """``moe_experts(backend='auto')`` on a (pretended) Hopper GPU: inputs cute cannot take go to torch, with the
    rule's reason in the warning, instead of raising inside the kernels."""
    monkeypatch.setattr(backends, "_warned", set())
    monkeypatch.setattr(interface, "cute_unavailable_reason", lambda device: None)  # "Hopper, backend importable"
    gen = torch.Generator().manual_seed(0)
    x, w1, w2 = torch.randn(6, 16, generator=gen), torch.randn(4, 24, 16, generator=gen), torch.randn(4, 16, 24)
    indices = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(6)])  # two different experts each
    routing = TopKRouting(torch.rand(6, 2, generator=gen), indices)
    with pytest.warns(UserWarning, match="backend='auto' uses the torch backend because activation 'gelu'"):
        out = moe_experts(x, routing, w1, w2, activation="gelu", backend="auto")
    assert torch.equal(out, moe_experts(x, routing, w1, w2, activation="gelu", backend="torch"))


# ----------------------------------------------------------------------------------------------------------
# At build: LayerOptions.resolve
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("check_megatron", [True, False])
def test_auto_picks_cute_where_it_runs(device, check_megatron):
    device(HOPPER)
    assert _resolve(check_megatron=check_megatron) == ("cute", [])
    assert _resolve(SonicConfig(backend="torch"), check_megatron=check_megatron) == ("torch", [])
    assert _resolve(SonicConfig(backend="cute"), check_megatron=check_megatron) == ("cute", [])


@pytest.mark.parametrize(
    "capability, overrides, reason",
    [
        (HOPPER, dict(gated_linear_unit=False, activation_func=F.gelu), "activation 'gelu' is not a gated"),
        (HOPPER, dict(params_dtype=torch.float32), "is torch.float32"),
        (HOPPER, dict(hidden_size=36), "hidden size D (x.shape[1], hidden_size) is 36"),
        (HOPPER, dict(moe_ffn_hidden_size=44), "expert ffn size F (w2.shape[2], moe_ffn_hidden_size) is 44"),
        ((8, 0), {}, "the GPU is sm_80"),
        (None, {}, "no CUDA GPU is visible"),
    ],
)
@pytest.mark.parametrize("check_megatron", [True, False])
def test_auto_uses_torch_with_one_warning_naming_the_reason(device, capability, overrides, reason, check_megatron):
    device(capability)
    backend, warned = _resolve(check_megatron=check_megatron, layers=3, **overrides)
    assert backend == "torch"
    assert len(warned) == 1 and "SonicConfig.backend='auto' uses the torch backend" in warned[0], warned
    assert reason in warned[0]


@pytest.mark.parametrize("check_megatron", [True, False])
def test_a_layer_on_blackwell_takes_cute_only_when_asked_for_saying_it_is_untested(device, check_megatron):
    device(BLACKWELL)
    backend, warned = _resolve(check_megatron=check_megatron)
    assert backend == "torch" and len(warned) == 1 and "sm_100, where the cute backend is untested" in warned[0]
    backend, warned = _resolve(SonicConfig(backend="cute"), check_megatron=check_megatron, layers=3)
    assert backend == "cute" and len(warned) == 1 and "SonicConfig.backend='cute'" in warned[0]
    assert "runs on sm_100 untested" in warned[0]


def test_auto_without_the_hopper_extra_uses_torch(device, monkeypatch):
    device(HOPPER)
    monkeypatch.setattr(backends, "cute_import_reason", lambda: "the cute backend could not be imported (no quack)")
    backend, warned = _resolve()
    assert backend == "torch" and "could not be imported (no quack)" in warned[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine's own device: none")
def test_auto_on_this_cpu_machine_uses_torch(monkeypatch):
    monkeypatch.setattr(backends, "_warned", set())
    backend, warned = _resolve()
    assert backend == "torch" and "no CUDA GPU is visible" in warned[0]


def test_each_layer_decides_for_itself(device):
    """A model with a layer cute runs and one it cannot: each gets its own backend."""
    device(HOPPER)
    assert _resolve()[0] == "cute"
    assert _resolve(params_dtype=torch.float32)[0] == "torch"


@pytest.mark.parametrize(
    "capability, overrides, reason",
    [
        (HOPPER, dict(gated_linear_unit=False, activation_func=F.gelu), "activation 'gelu' is not a gated"),
        (HOPPER, dict(params_dtype=torch.float32), "is torch.float32"),
        (HOPPER, dict(moe_ffn_hidden_size=44), "moe_ffn_hidden_size) is 44"),
        (None, {}, "no CUDA GPU is visible"),
    ],
)
@pytest.mark.parametrize("check_megatron", [True, False])
def test_explicit_cute_that_cannot_run_fails_at_build(device, capability, overrides, reason, check_megatron):
    device(capability)
    with pytest.raises(ValueError) as info:
        _resolve(SonicConfig(backend="cute"), check_megatron=check_megatron, **overrides)
    msg = str(info.value)
    for words in ("SonicConfig.backend='cute'", "SONIC_MEGATRON_BACKEND", "('auto', 'torch', 'cute')", reason):
        assert words in msg, msg


def test_explicit_cute_from_the_environment_fails_at_build(device, monkeypatch):
    device(HOPPER)
    monkeypatch.setenv("SONIC_MEGATRON_BACKEND", "cute")
    with pytest.raises(ValueError, match=r"SonicConfig.backend='cute' \(SONIC_MEGATRON_BACKEND\) cannot run"):
        _resolve(params_dtype=torch.float32)


def _stock_built_experts(sonic_config, **overrides):
    """SonicExperts as a stock MoELayer builds them (no options from SonicMoELayer), on CPU."""
    config = moe_config(**{**SUPPORTED, "use_cpu_initialization": True, **overrides})
    groups = types.SimpleNamespace(ep=None, expt_dp=None, expt_tp=None)
    return SonicExperts(4, config, pg_collection=groups, sonic_config=sonic_config)


def test_experts_built_by_a_stock_moe_layer_resolve_the_backend(device):
    device(HOPPER)
    experts = _stock_built_experts(None)
    assert experts.options.ep.backend == experts.ep_options.backend == "cute"
    with pytest.warns(UserWarning, match="uses the torch backend for this layer: activation 'gelu'"):
        experts = _stock_built_experts(None, gated_linear_unit=False, activation_func=F.gelu)
    assert experts.options.ep.backend == experts.ep_options.backend == "torch"
    with pytest.raises(ValueError, match="SonicConfig.backend='cute'.*cannot run this layer: the dtype"):
        _stock_built_experts(SonicConfig(backend="cute"), params_dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------------
# --moe-router-topk larger than --num-experts
# ----------------------------------------------------------------------------------------------------------


def test_router_topk_larger_than_the_experts_fails_at_build(device):
    device(None)
    config = moe_config(num_moe_experts=4, moe_router_topk=8)
    with pytest.raises(ValueError) as info:
        validate_megatron_config(config, SonicConfig())
    for words in ("moe_router_topk=8", "--moe-router-topk", "num_moe_experts=4", "--num-experts"):
        assert words in str(info.value)
    with pytest.raises(ValueError, match="moe_router_topk=8"):
        LayerOptions.resolve(SonicConfig(backend="torch"), config, check_megatron=True)
    assert validate_megatron_config(moe_config(num_moe_experts=4, moe_router_topk=4), SonicConfig()) == "swiglu"
