"""``SonicMoELayer``: Megatron's MoELayer with SonicMoE's dispatch and experts.

It keeps MoELayer's method split and ``forward`` (route -> preprocess -> dispatch -> routed_experts_compute
-> combine -> postprocess, plus shared_experts_compute), so ``TransformerLayer.is_moe_layer``, selective
``moe`` recompute, shared-expert overlap and the 1F1B EP-overlap schedule (which calls these methods as
separate nodes) work unchanged. With ``SonicConfig.dispatcher='sonic'``:

* route: the router (``SonicRouter`` = TopKRouter with every option) gives one ``RouterOutput``: each token's
  top-K experts and scores (a fused top-K + softmax kernel where the options allow, TopKRouter's own path
  otherwise), and in training with token rounding the dense router probabilities. With Megatron's capacity
  factor: TopKRouter's dropped (and padded-to-capacity) pairs as a flat routing instead of top-K.
* preprocess / dispatch / combine / postprocess: ``SonicTokenDispatcher`` (Megatron's dispatcher protocol; the
  shared-expert overlap hooks), which hands each step to the layer's mode (``modes.py``).
* routed_experts_compute: the mode's experts step, on the local experts of ``SonicExperts`` (Sonic kernels:
  gather-fused up-projection, cached X and H only, per-token reduction before the combine).

The mode is chosen once, here: ``LocalMode`` at expert-parallel size 1 (the experts read the routing directly:
no plan, no copies, no host sync), ``ExpertParallelMode`` above it (token_dispatch's step-wise dispatch, local
experts and combine; the plan's one host sync in dispatch), ``PipelinedMode`` with ``num_chunks > 1`` or
``redispatch_x_in_backward`` (token_dispatch's pipelined ``expert_parallel_experts`` in routed_experts_compute,
chunk i's all-to-all overlapping chunk i+1's GEMMs; dispatch and combine pass tensors through).

With expert tensor parallelism (ETP > 1) the experts hold their ETP shard of every expert and the dispatcher
gathers the ETP group's tokens before the mode and sums the partial outputs after it (``expert_tp.py``).

With ``dispatcher='megatron'`` Megatron's own dispatcher is kept (any ``moe_token_dispatcher_type``) and only the
experts are Sonic: every step is MoELayer's. Options are resolved once (``LayerOptions``) and given to the router,
the experts and the mode at construction; unsupported Megatron options fail here (``config.py``).
"""

from __future__ import annotations

import dataclasses
import functools

from megatron.core import utils as megatron_utils
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from .config import SonicConfig
from .dispatcher import SonicTokenDispatcher
from .experts import SonicExperts
from .layer_options import LayerOptions
from .megatron_compat import accepted_kwargs, default_pg_collection
from .modes import choose_mode
from .router import RouterOutput, SonicRouter


def default_submodules() -> MoESubmodules:
    """Routed experts = SonicExperts, router = SonicRouter, no shared experts."""
    return MoESubmodules(experts=ModuleSpec(module=SonicExperts), router=SonicRouter)


def with_layer_options(submodules: MoESubmodules, options: LayerOptions) -> MoESubmodules:
    """``submodules`` whose SonicRouter and SonicExperts are built with the layer's options. MoELayer builds
    them in its ``__init__``; this is how they receive the options there, at construction."""
    router = submodules.router
    if isinstance(router, type) and issubclass(router, SonicRouter):
        router = functools.partial(router, options=options)
    experts = submodules.experts
    if isinstance(experts, type) and issubclass(experts, SonicExperts):
        experts = ModuleSpec(module=experts)
    if (
        isinstance(experts, ModuleSpec)
        and isinstance(experts.module, type)
        and issubclass(experts.module, SonicExperts)
    ):
        params = {k: v for k, v in experts.params.items() if k != "sonic_config"}  # the layer resolved it
        experts = dataclasses.replace(experts, params={**params, "options": options})
    return dataclasses.replace(submodules, router=router, experts=experts)


class SonicMoELayer(MoELayer):
    """MoELayer computing with SonicMoE (see the module docstring).

    Args:
        config: Megatron TransformerConfig (validated by ``validate_megatron_config``).
        submodules: ``MoESubmodules``; experts must be ``SonicExperts`` with ``dispatcher='sonic'``, the
            router should be ``SonicRouter`` (required for token rounding). Default: ``default_submodules``.
        layer_number, pg_collection: as MoELayer.
        sonic_config: plugin options; ``SONIC_MEGATRON_*`` environment variables override them.
        **kwargs: forwarded to MoELayer when its version accepts them (0.19: ``is_mtp_layer``, ``name``).
    """

    def __init__(
        self,
        config,
        submodules: MoESubmodules | None = None,
        layer_number: int | None = None,
        pg_collection=None,
        sonic_config: SonicConfig | None = None,
        **kwargs,
    ):
        options = LayerOptions.resolve(sonic_config, config, check_megatron=True)  # the layer's one resolution
        if submodules is None:
            submodules = default_submodules()
        if pg_collection is None:
            pg_collection = default_pg_collection()
        super().__init__(
            **accepted_kwargs(
                MoELayer.__init__,
                dict(
                    config=config,
                    submodules=with_layer_options(submodules, options),
                    layer_number=layer_number,
                    pg_collection=pg_collection,
                    **kwargs,
                ),
            )
        )
        self.options = options
        if options.rounding is not None and not isinstance(self.router, SonicRouter):
            raise ValueError(
                f"SonicConfig.token_rounding={options.sonic.token_rounding!r} needs the router to be SonicRouter, "
                f"got {type(self.router).__name__}"
            )
        self.mode = None  # Megatron's dispatcher: MoELayer's steps
        if not options.sonic_dispatch:
            return
        if not isinstance(self.experts, SonicExperts):
            raise ValueError(
                "SonicConfig.dispatcher='sonic' needs MoESubmodules.experts = SonicExperts, got "
                f"{type(self.experts).__name__} (use dispatcher='megatron' for other experts)"
            )
        if options.sonic.pipelined and getattr(config, "overlap_moe_expert_parallel_comm", False):
            raise ValueError(
                "SonicConfig.num_chunks > 1 / redispatch_x_in_backward run dispatch, experts and combine as one "
                "pipelined node, which Megatron's overlap_moe_expert_parallel_comm cannot split; use one or the other"
            )
        group = pg_collection.ep if megatron_utils.get_pg_size(pg_collection.ep) > 1 else None
        self.mode = choose_mode(self.experts, options, config, group)
        self._router_gives_topk = getattr(self.router, "gives_topk", False)  # else TopKRouter's (probs, map)
        self.token_dispatcher = SonicTokenDispatcher(
            self.mode, options, self.num_local_experts, self.local_expert_indices, config, pg_collection
        )
        if self.use_shared_expert and self.shared_expert_overlap:
            self.token_dispatcher.set_shared_experts(self.shared_experts)
        if hasattr(self, "_training_token_dispatcher"):  # 0.19 re-selects it in forward()
            self._training_token_dispatcher = self.token_dispatcher

    def route(self, hidden_states, padding_mask=None):
        """The router's output as one value (``RouterOutput``), in the first of the two slots Megatron's forward
        hands on to ``preprocess``; the second, Megatron's routing map, is None (the output holds the indices)."""
        if self.mode is None:
            return super().route(hidden_states, padding_mask)
        routed = self.router(hidden_states, padding_mask)
        if not self._router_gives_topk:
            routed = RouterOutput.from_megatron(*routed, self.config.moe_router_topk, self.config)
        return routed, None

    def preprocess(self, hidden_states, routed, routing_map=None):
        if self.mode is None:
            return super().preprocess(hidden_states, routed, routing_map)
        return self.token_dispatcher.dispatch_preprocess(hidden_states, routed)

    def routed_experts_compute(self, hidden_states, probs):
        if self.mode is None:
            return super().routed_experts_compute(hidden_states, probs)
        x_recv, _, scores_recv = self.token_dispatcher.dispatch_postprocess(hidden_states, probs)
        y_recv = self.mode.compute(x_recv, scores_recv)
        return self.token_dispatcher.combine_preprocess(y_recv), None
