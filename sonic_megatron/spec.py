"""Layer/block specs with the Sonic MoE layer, for megatron-core 0.16 .. 0.19.

Swap helper (any version, any spec shape)::

    from sonic_megatron.spec import swap_moe_spec
    block_spec = swap_moe_spec(get_gpt_decoder_block_spec(config, use_transformer_engine=True))
    mtp_spec = swap_moe_spec(get_gpt_mtp_block_spec(config, block_spec, use_transformer_engine=True))

``swap_moe_spec`` returns a deep copy in which every MoE mlp -- a ``ModuleSpec(module=MoELayer)`` (0.16-0.18)
or a ``functools.partial(MoELayer, submodules=...)`` (0.19) -- becomes a ``SonicMoELayerSpec`` (see
``sonic_moe_spec``) building a ``SonicMoELayer`` with ``SonicExperts`` routed experts, ``SonicRouter``, and
the original shared experts; dense mlps and everything else are untouched. It walks layer specs,
``TransformerBlockSubmodules`` (mixed dense/MoE layer lists, e.g. ``--moe-layer-freq``), block ``ModuleSpec``s
and MTP block submodules alike.

``--spec sonic_megatron.spec <name>`` with Megatron-LM's ``pretrain_gpt.py`` -- which name per version:

==================  =====================================  ==============================================
megatron-core       name                                   what that branch's launcher does with it
==================  =====================================  ==============================================
0.16, 0.17, 0.18    ``sonic_local_layer_spec``             ``gpt_builders.gpt_builder``: ``import_module(
                    (``sonic_te_layer_spec`` with TE)      args.spec)`` -> ``GPTModel(transformer_layer_
                                                           spec=...)`` as is: a layer ModuleSpec, repeated
                                                           ``--num-layers`` times. A function is refused
                                                           there ("specialize for function").
0.19                ``sonic_block_spec``                   ``GPTModelBuilder`` calls it with
                                                           ``(config, vp_stage)``.
==================  =====================================  ==============================================

* ``sonic_local_layer_spec`` / ``sonic_te_layer_spec`` (ready layer ``ModuleSpec``s): every layer is a MoE
  layer (``--moe-layer-freq`` 1) built from Megatron's local / Transformer Engine GPT layer spec with default
  options: flags that shape a spec (``--qk-layernorm``, ``--multi-latent-attention``, mixed dense/MoE
  layers) are not followed -- build your own spec with ``swap_moe_spec`` / ``gpt_block_spec`` for those.
  ``sonic_te_layer_spec`` exists only when Transformer Engine is importable. On 0.16-0.18
  ``--mtp-num-layers`` cannot be combined with any ``--spec`` (that ``gpt_builder`` reads ``use_te``, which
  only its no-spec branch sets). Checked: tests/test_megatron_launcher_spec.py replays that consumption on
  the installed megatron-core, and with ``SONIC_MEGATRON_MLM_DIR`` also calls a branch's real
  ``gpt_builder``; docs/PERF.md ("Expert parallelism in pretrain_gpt.py") has core_r0.18.0's pretrain_gpt.py
  run on GPUs.
* ``sonic_block_spec`` (a function ``fn(config, vp_stage=None)``; megatron-core >= 0.19 where
  ``GPTModelBuilder`` calls it): Megatron's ``default_layer_spec(config, vp_stage)`` swapped, so mixed
  dense/MoE layers, VPP and MTP follow the usual flags.
Options: ``SONIC_MEGATRON_*`` environment variables (see ``sonic_megatron.config``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools

from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from .config import SonicConfig
from .experts import SonicExperts
from .layer import SonicMoELayer
from .router import SonicRouter
from .wgrad import finalize_runs_held_weight_grads


class SonicMoELayerSpec:
    """The mlp spec of a Sonic MoE layer: a class whose attributes read like a ModuleSpec's (``module``,
    ``submodules``, ``params``) and whose call builds ``module(*args, submodules=..., **params, **kwargs)``.

    Why a class and not ``ModuleSpec(module=SonicMoELayer)``: megatron-core 0.16/0.17's TransformerLayer
    picks the keyword arguments of a ModuleSpec mlp by its exact module class (MoELayer, MLP, ...) and logs
    "Unknown MLP type ... Using default kwargs" for any other class, subclasses included, once per layer.
    A class goes through ``build_module``'s plain-class path, which passes ``submodules`` and ``params`` from
    these attributes and no other keyword, the same as that fallback; megatron-core >= 0.18 calls the mlp
    spec as ``spec(config=, pg_collection=, is_mtp_layer=, name=)``, which this call takes too. Calling it
    returns a ``SonicMoELayer`` instance, not an instance of this class.
    """

    module = SonicMoELayer
    submodules: MoESubmodules | None = None
    params: dict = {}  # each spec class made by sonic_moe_spec gets its own
    metainfo: dict = {}  # ModuleSpec has this field too

    def __new__(cls, *args, **kwargs):
        if cls is SonicMoELayerSpec:
            raise TypeError("SonicMoELayerSpec is the base of the spec classes; build one with sonic_moe_spec()")
        kwargs = {"submodules": cls.submodules, **cls.params, **kwargs}
        return cls.module(*args, **kwargs)


def sonic_moe_spec(
    old_submodules: MoESubmodules | None = None, sonic_config: SonicConfig | None = None
) -> type[SonicMoELayerSpec]:
    """The mlp spec of a SonicMoELayer keeping ``old_submodules.shared_experts`` (if any): a new
    ``SonicMoELayerSpec`` subclass whose ``submodules``/``params`` hold this layer's choices."""
    shared = getattr(old_submodules, "shared_experts", None) if old_submodules is not None else None
    params = {"sonic_config": sonic_config} if sonic_config is not None else {}
    submodules = MoESubmodules(
        experts=ModuleSpec(module=SonicExperts, params=dict(params)),
        shared_experts=shared,
        router=SonicRouter,
    )
    return type("SonicMoELayerSpec", (SonicMoELayerSpec,), {"submodules": submodules, "params": params, "metainfo": {}})


def is_sonic_moe_spec(obj) -> bool:
    """A Sonic MoE mlp spec: a ``sonic_moe_spec`` class or a ``ModuleSpec(module=SonicMoELayer)``."""
    if isinstance(obj, type):
        return issubclass(obj, SonicMoELayerSpec)
    return isinstance(obj, ModuleSpec) and obj.module is SonicMoELayer


def moe_submodules_of(mlp_spec) -> MoESubmodules | None:
    """The MoESubmodules of a MoE mlp spec: ``ModuleSpec.submodules`` (0.16-0.18) or the ``submodules``
    keyword of a ``functools.partial`` (0.19)."""
    if isinstance(mlp_spec, functools.partial):
        return mlp_spec.keywords.get("submodules")
    return getattr(mlp_spec, "submodules", None)


def _is_stock_moe(obj) -> bool:
    cls = obj.module if isinstance(obj, ModuleSpec) else obj.func if isinstance(obj, functools.partial) else None
    return isinstance(cls, type) and issubclass(cls, MoELayer) and not issubclass(cls, SonicMoELayer)


def _swap(obj, sonic_config, seen: dict):
    if id(obj) in seen:
        return seen[id(obj)]
    if _is_stock_moe(obj):
        out = sonic_moe_spec(moe_submodules_of(obj), sonic_config)
    elif isinstance(obj, ModuleSpec):
        obj.submodules = _swap(obj.submodules, sonic_config, seen)
        out = obj
    elif isinstance(obj, functools.partial):
        out = functools.partial(
            obj.func, *obj.args, **{k: _swap(v, sonic_config, seen) for k, v in obj.keywords.items()}
        )
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            setattr(obj, f.name, _swap(getattr(obj, f.name), sonic_config, seen))
        out = obj
    elif isinstance(obj, list):
        out = [_swap(v, sonic_config, seen) for v in obj]
    elif isinstance(obj, tuple):
        out = tuple(_swap(v, sonic_config, seen) for v in obj)
    else:
        out = obj
    seen[id(obj)] = out
    return out


def swap_moe_spec(spec, sonic_config: SonicConfig | None = None):
    """A deep copy of a GPT layer / block / MTP spec with every stock MoE layer replaced by SonicMoELayer."""
    return _swap(copy.deepcopy(spec), sonic_config, {})


def count_sonic_layers(spec) -> int:
    """How many SonicMoELayer specs a (swapped) spec contains (tests, sanity checks in launchers)."""
    found = []

    def walk(obj, seen):
        if is_sonic_moe_spec(obj):
            found.append(obj)  # counted per occurrence (block specs share one layer spec object)
            return
        if isinstance(obj, ModuleSpec):  # specs are DAGs (shared layer specs), never cycles
            walk(obj.submodules, seen)
        elif isinstance(obj, functools.partial):
            for v in obj.keywords.values():
                walk(v, seen)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name), seen)
        elif isinstance(obj, list | tuple):
            for v in obj:
                walk(v, seen)

    walk(spec, set())
    return len(found)


# ----------------------------------------------------------------------------------------------------------
# Ready specs for `--spec sonic_megatron.spec <name>` (module attributes, built at import: Megatron reads
# them with vars(module)[name], so lazy attributes would not be found).
# ----------------------------------------------------------------------------------------------------------


def _layer_spec(use_te: bool) -> ModuleSpec:
    from megatron.core.models.gpt import gpt_layer_specs as g

    if use_te:
        return swap_moe_spec(g.get_gpt_layer_with_transformer_engine_spec(num_experts=8, moe_grouped_gemm=True))
    return swap_moe_spec(g.get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False))


def _have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


sonic_local_layer_spec: ModuleSpec = _layer_spec(use_te=False)
if _have_te():
    sonic_te_layer_spec: ModuleSpec = _layer_spec(use_te=True)


def sonic_block_spec(config, vp_stage: int | None = None):
    """megatron-core >= 0.19 (``GPTModelBuilder``): Megatron's default GPT layer/block spec for ``config``
    (a GPTModelConfig) with the MoE layers swapped for Sonic. As the model's builder it also installs the finalize
    hook that runs the experts' held weight-gradient work (``wgrad.finalize_runs_held_weight_grads``; Megatron-LM's
    training loop keeps a finalize function the builder set, and sets its own otherwise)."""
    try:
        from megatron.training.models.gpt import default_layer_spec
    except ImportError as exc:
        raise RuntimeError(
            "sonic_block_spec needs megatron-core >= 0.19 (megatron.training.models.gpt); on 0.16-0.18 pass "
            "--spec sonic_megatron.spec sonic_local_layer_spec (or sonic_te_layer_spec)"
        ) from exc
    finalize_runs_held_weight_grads(config)
    return swap_moe_spec(default_layer_spec(config, vp_stage))


def gpt_block_spec(config, use_transformer_engine: bool, vp_stage: int | None = None, sonic_config=None, **kwargs):
    """``get_gpt_decoder_block_spec`` (mixed dense/MoE per ``moe_layer_freq``) with Sonic MoE layers."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_transformer_engine, vp_stage=vp_stage, **kwargs
    )
    return swap_moe_spec(spec, sonic_config)
