"""``--spec sonic_megatron.spec <name>`` as Megatron-LM's own launchers consume it on megatron-core 0.16-0.18.

Branches core_r0.16.0, core_r0.17.0 and core_r0.18.0 of Megatron-LM (gpt_builders.gpt_builder) do, with
``args.spec`` the argparse list ``['sonic_megatron.spec', '<name>']`` (``--spec`` has ``nargs='*'``)::

    transformer_layer_spec = import_module(args.spec)        # megatron.core.transformer.spec_utils
    model = GPTModel(config=config, transformer_layer_spec=transformer_layer_spec, ...)

and GPTModel's TransformerBlock accepts a TransformerBlockSubmodules, a block ModuleSpec or a layer ModuleSpec
(repeated num_layers times). This replays exactly that with the installed megatron-core (0.16.1 in CI): the
ready layer spec builds a GPTModel whose every layer is a SonicMoELayer and runs forward and backward on a
CPU; the 0.19 name (a function) is rejected by that path, as the spec module's docstring says."""

from __future__ import annotations

import os

import pytest
import torch


def _args_spec(name: str) -> list[str]:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", type=str, default=None, nargs="*")  # as megatron/training/arguments.py
    return parser.parse_args(["--spec", "sonic_megatron.spec", name]).spec


def _gpt_builder_worker(rank, world):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.spec_utils import ModuleSpec, import_module

    from sonic_megatron.experts import SonicExperts
    from sonic_megatron.layer import SonicMoELayer
    from sonic_megatron.testing import init_model_parallel, moe_config

    init_model_parallel(ep=world)
    config = moe_config(num_layers=2, normalization="RMSNorm")
    transformer_layer_spec = import_module(_args_spec("sonic_local_layer_spec"))
    assert isinstance(transformer_layer_spec, ModuleSpec), type(transformer_layer_spec)
    model = GPTModel(
        config=config,
        transformer_layer_spec=transformer_layer_spec,
        vocab_size=64,
        max_sequence_length=16,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    kinds = [type(layer.mlp) for layer in model.decoder.layers]
    assert kinds == [SonicMoELayer, SonicMoELayer], kinds
    assert all(isinstance(layer.mlp.experts, SonicExperts) for layer in model.decoder.layers)
    assert all(layer.mlp.options.sonic.backend == "torch" for layer in model.decoder.layers)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 64, (2, 16), generator=g)
    position_ids = torch.arange(16).expand(2, 16)
    mask = torch.triu(torch.ones(16, 16), 1).bool()[None, None]
    loss = model(tokens, position_ids, mask, labels=torch.randint(0, 64, (2, 16), generator=g))
    assert loss.shape == (2, 16) and torch.isfinite(loss).all(), loss
    loss.mean().backward()
    for layer in model.decoder.layers:
        grad = layer.mlp.experts.weight1.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0

    # The 0.19 spec function through the 0.16-0.18 path: GPTModel refuses it (it wants a spec object).
    fn = import_module(_args_spec("sonic_block_spec"))
    assert callable(fn) and not isinstance(fn, ModuleSpec)
    with pytest.raises(Exception, match="specialize for function"):
        GPTModel(config=config, transformer_layer_spec=fn, vocab_size=64, max_sequence_length=16)


@pytest.mark.slow
def test_ready_spec_through_gpt_builder_of_megatron_lm_0_16_to_0_18(monkeypatch):
    """On two ranks at EP 2: the spec path is the same at every EP size; EP 2 also runs the layer's all-to-alls."""
    from sonic_megatron.testing import spawn

    monkeypatch.setenv("SONIC_MEGATRON_BACKEND", "torch")  # the ready spec has no SonicConfig: env options
    spawn(_gpt_builder_worker, 2, timeout=300)


def _real_gpt_builder_worker(rank, world, mlm_dir):
    """Megatron-LM's own ``gpt_builders.gpt_builder`` from ``mlm_dir`` (its megatron/training and, before
    0.18, megatron/legacy must be importable: from the megatron-core wheel or from that checkout)."""
    import sys
    import types
    import typing

    sys.path.insert(0, mlm_dir)
    if not hasattr(typing, "override"):  # megatron.training 0.18 imports typing.override (Python 3.12)
        import typing_extensions

        typing.override = typing_extensions.override
    import gpt_builders
    from megatron.training import global_vars

    from sonic_megatron.layer import SonicMoELayer
    from sonic_megatron.testing import init_model_parallel, moe_config

    init_model_parallel(ep=world)
    config = moe_config(num_layers=2, normalization="RMSNorm")
    args = types.SimpleNamespace(
        spec=_args_spec("sonic_local_layer_spec"),
        yaml_cfg=None,
        use_legacy_models=False,
        mtp_num_layers=None,
        padded_vocab_size=64,
        max_position_embeddings=16,
        fp16_lm_cross_entropy=False,
        untie_embeddings_and_output_weights=True,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=10000,
        use_rope_scaling=False,
        rope_scaling_factor=8.0,
        transformer_impl="local",
    )
    global_vars._GLOBAL_ARGS = args  # get_args() inside the builder
    model = gpt_builders.gpt_builder(args, True, True, config=config)
    assert [type(layer.mlp) for layer in model.decoder.layers] == [SonicMoELayer] * 2
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
    mask = torch.triu(torch.ones(16, 16), 1).bool()[None, None]
    loss = model(tokens, torch.arange(16).expand(2, 16), mask, labels=tokens)
    assert torch.isfinite(loss).all()
    loss.mean().backward()


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("SONIC_MEGATRON_MLM_DIR"),
    reason="SONIC_MEGATRON_MLM_DIR (a Megatron-LM core_r0.16-0.18 checkout with gpt_builders.py) is not set",
)
def test_ready_spec_through_real_gpt_builder(monkeypatch):
    from sonic_megatron.testing import spawn

    monkeypatch.setenv("SONIC_MEGATRON_BACKEND", "torch")
    spawn(_real_gpt_builder_worker, 2, os.environ["SONIC_MEGATRON_MLM_DIR"], timeout=240)
