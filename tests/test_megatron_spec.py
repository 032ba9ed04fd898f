"""Spec swap (mixed dense/MoE blocks, MTP blocks, ready --spec layer specs, no "Unknown MLP type" log from
Megatron's TransformerLayer) and construction-time validation of unsupported Megatron options and plugin
options."""

from __future__ import annotations

import copy
import inspect
import logging
import types

import pytest
import torch

from sonic_megatron.config import SonicConfig, validate_megatron_config


def _spec_worker(rank, world):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from sonic_megatron import spec as S
    from sonic_megatron.experts import SonicExperts
    from sonic_megatron.layer import SonicMoELayer
    from sonic_megatron.router import SonicRouter
    from sonic_megatron.testing import init_model_parallel, moe_config

    init_model_parallel(ep=1)
    layer_log = _Records("megatron.core.transformer.transformer_layer")
    config = moe_config(num_layers=4, moe_layer_freq=[0, 1, 0, 1], moe_shared_expert_intermediate_size=32)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    swapped = S.swap_moe_spec(block, SonicConfig(backend="torch"))
    assert S.count_sonic_layers(block) == 0, "the input spec must not be modified"
    assert S.count_sonic_layers(swapped) == 2
    model = TransformerBlock(config, swapped)
    assert not layer_log.matching("Unknown MLP type"), layer_log.matching("Unknown MLP type")
    kinds = [type(layer.mlp) for layer in model.layers]
    assert kinds == [MLP, SonicMoELayer, MLP, SonicMoELayer], kinds
    for layer in model.layers[1::2]:
        assert layer.is_moe_layer and isinstance(layer.mlp, MoELayer)
        assert isinstance(layer.mlp.experts, SonicExperts) and isinstance(layer.mlp.router, SonicRouter)
        assert layer.mlp.shared_experts is not None, "shared experts of the original spec are kept"
        assert layer.mlp.options.sonic.backend == "torch"
    x = torch.randn(6, 2, config.hidden_size)
    out = model(x, attention_mask=torch.triu(torch.ones(6, 6), 1).bool()[None, None])
    out = out[0] if isinstance(out, tuple) else out
    assert out.shape == x.shape and torch.isfinite(out).all()

    mtp_config = moe_config(num_layers=2, mtp_num_layers=1)
    mtp = get_gpt_mtp_block_spec(mtp_config, S.sonic_local_layer_spec, use_transformer_engine=False)
    assert S.count_sonic_layers(S.swap_moe_spec(mtp)) >= 1

    layer_spec = S.sonic_local_layer_spec
    assert layer_spec.submodules.mlp.module is SonicMoELayer
    block2 = TransformerBlock(moe_config(num_layers=2), layer_spec)
    assert all(type(layer.mlp) is SonicMoELayer for layer in block2.layers)
    assert not layer_log.matching("Unknown MLP type")

    # The same layer as a ModuleSpec is what megatron-core 0.16/0.17 logs about (the capture works).
    from megatron.core.transformer.spec_utils import ModuleSpec

    mlp = layer_spec.submodules.mlp
    as_module_spec = copy.deepcopy(layer_spec)
    as_module_spec.submodules.mlp = ModuleSpec(module=SonicMoELayer, submodules=mlp.submodules, params=mlp.params)
    TransformerBlock(moe_config(num_layers=1), as_module_spec)
    if "Unknown MLP type" in inspect.getsource(TransformerLayer.__init__):
        assert layer_log.matching("Unknown MLP type"), "the log capture missed Megatron's message"


class _Records(logging.Handler):
    """The records of one logger from now on."""

    def __init__(self, logger_name: str):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        logging.getLogger(logger_name).addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def matching(self, text: str) -> list[str]:
        return [r.getMessage() for r in self.records if text in r.getMessage()]


@pytest.mark.slow
def test_spec_swap_mixed_block_and_mtp():
    from sonic_megatron.testing import spawn

    spawn(_spec_worker, 1)


def _cfg(**kw):
    from megatron.core.activations import squared_relu

    base = dict(
        num_moe_experts=8,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        moe_apply_probs_on_input=False,
        expert_tensor_parallel_size=1,
        tensor_model_parallel_size=1,
        moe_expert_capacity_factor=None,
        moe_pad_expert_input_to_capacity=False,
        moe_router_padding_for_quantization=False,
        fp8=None,
        fp4=None,
        moe_latent_size=None,
        moe_token_dispatcher_type="alltoall",
        cuda_graph_impl="none",
    )
    base.update(kw)
    base.setdefault("_relu2", squared_relu)
    return types.SimpleNamespace(**base)


@pytest.mark.parametrize(
    "overrides, option",
    [
        (dict(add_bias_linear=True), "add_bias_linear"),
        (dict(moe_apply_probs_on_input=True), "moe_apply_probs_on_input"),
        (dict(expert_tensor_parallel_size=5, moe_ffn_hidden_size=48), "expert_tensor_parallel_size=5"),
        (dict(moe_pad_expert_input_to_capacity=True), "moe_pad_expert_input_to_capacity"),  # without a capacity
        (dict(moe_router_padding_for_quantization=True), "moe_router_padding_for_quantization"),
        (dict(fp8="hybrid"), "fp8"),
        (dict(moe_latent_size=64), "moe_latent_size"),
        (dict(moe_token_dispatcher_type="flex"), "moe_token_dispatcher_type"),
        (dict(activation_func=torch.tanh), "activation_func"),
        (dict(num_moe_experts=None), "num_moe_experts"),
        (dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["moe"]), "cuda_graph_scope"),
    ],
)
def test_unsupported_megatron_options_fail_naming_the_option(overrides, option):
    with pytest.raises(ValueError, match=option):
        validate_megatron_config(_cfg(**overrides), SonicConfig())


@pytest.mark.parametrize(
    "impl, modules",
    [
        ("local", ["attn"]),
        ("local", []),
        ("transformer_engine", []),
        ("transformer_engine", "full"),
        ("full_iteration", []),
    ],
)
def test_cuda_graphs_around_an_expert_parallel_layer_fail_naming_the_options(impl, modules):
    """At EP > 1 the plan's host sync cannot be captured: every CUDA graph that Megatron puts around the whole layer
    is refused up front (megatron-core's local implementation graphs the whole layer for ``attn`` too)."""
    cfg = _cfg(cuda_graph_impl=impl, cuda_graph_modules=modules, expert_model_parallel_size=4)
    with pytest.raises(ValueError, match=r"cuda_graph_impl=.*cuda_graph_modules=.*expert_model_parallel_size=4"):
        validate_megatron_config(cfg, SonicConfig())


def test_cuda_graphs_that_leave_the_moe_layer_eager_or_run_at_ep1_pass():
    from megatron.core.transformer.enums import CudaGraphScope

    for impl, modules, ep in [
        ("transformer_engine", ["attn"], 4),
        ("transformer_engine", [CudaGraphScope.attn], 4),  # megatron-core's enum values
        ("local", ["attn"], 1),  # whole layer at EP 1: no host sync (tests/test_cuda_graph_gpu.py)
        ("local", [], 1),
        ("none", [], 4),
    ]:
        cfg = _cfg(cuda_graph_impl=impl, cuda_graph_modules=modules, expert_model_parallel_size=ep)
        assert validate_megatron_config(cfg, SonicConfig()) == "swiglu"
    with pytest.raises(ValueError, match="cuda_graph_modules"):  # Megatron's partial MoE scopes, at any EP
        validate_megatron_config(
            _cfg(cuda_graph_impl="local", cuda_graph_modules=[CudaGraphScope.moe_router]), SonicConfig()
        )


def test_supported_activations():
    from megatron.core.activations import squared_relu

    assert validate_megatron_config(_cfg(), SonicConfig()) == "swiglu"
    assert validate_megatron_config(_cfg(activation_func=torch.nn.functional.gelu), SonicConfig()) == "geglu"
    assert (
        validate_megatron_config(_cfg(gated_linear_unit=False, activation_func=squared_relu), SonicConfig()) == "relu2"
    )
    # Megatron's own dispatcher (any type) is fine when only the experts are Sonic.
    validate_megatron_config(_cfg(moe_token_dispatcher_type="flex"), SonicConfig(dispatcher="megatron"))


def test_sonic_config_options_and_env():
    with pytest.raises(ValueError, match="token_rounding"):
        SonicConfig(token_rounding="sideways")
    with pytest.raises(ValueError, match="token_rounding='up' needs dispatcher='sonic'"):
        SonicConfig(dispatcher="megatron", token_rounding="up")
    with pytest.raises(ValueError, match="num_chunks"):
        SonicConfig(num_chunks=0)
    cfg = SonicConfig.resolve(
        SonicConfig(backend="torch"),
        {
            "SONIC_MEGATRON_TOKEN_ROUNDING": "up",
            "SONIC_MEGATRON_ROUNDING_TILE": "16",
            "SONIC_MEGATRON_REDISPATCH_X_IN_BACKWARD": "1",
        },
    )
    assert (cfg.backend, cfg.token_rounding, cfg.rounding_tile, cfg.redispatch_x_in_backward) == (
        "torch",
        "up",
        16,
        True,
    )
    with pytest.raises(ValueError, match="SONIC_MEGATRON_NUM_CHUNKS must be an integer"):
        SonicConfig.resolve(None, {"SONIC_MEGATRON_NUM_CHUNKS": "two"})
