"""``SonicMoELayer``: Megatron's MoELayer with SonicMoE's dispatch and experts.

It keeps MoELayer's method split and ``forward`` (route -> preprocess -> dispatch -> routed_experts_compute
-> combine -> postprocess, plus shared_experts_compute), so ``TransformerLayer.is_moe_layer``, selective
``moe`` recompute, shared-expert overlap and the 1F1B EP-overlap schedule (which calls these methods as
separate nodes) work unchanged. What changes per method, with ``SonicConfig.dispatcher='sonic'``:

* route: Megatron's router (``SonicRouter`` = TopKRouter with every option) in top-K format: a fused
  top-K + softmax kernel where the options allow, TopKRouter's own path otherwise; with token rounding in
  training it also keeps the dense router probabilities.
* preprocess / dispatch / combine / postprocess: ``SonicTokenDispatcher`` (token_dispatch underneath:
  each token crosses to a rank once, tile-aware token rounding, chunked overlap).
* routed_experts_compute: the local experts of ``SonicExperts`` on the received tokens (Sonic kernels:
  gather-fused up-projection, cached X and H only, per-token reduction before the combine). At
  expert-parallel size 1 there is nothing to dispatch: the experts read the router's top-K (or the rounded
  routing) directly, with no plan, no copies and no host sync.

With ``num_chunks > 1``, ``by_source`` or ``redispatch_x_in_backward`` (pipelined mode) routed_experts_compute runs
token_dispatch's pipelined ``expert_parallel_experts`` (dispatch + experts + combine, chunk i's all-to-all
overlapping chunk i+1's GEMMs) and dispatch/combine pass tensors through.

With ``dispatcher='megatron'`` Megatron's own dispatcher is kept (any ``moe_token_dispatcher_type``) and
only the experts are Sonic. Unsupported Megatron options fail here, at construction (``config.py``).
"""

from __future__ import annotations

import dataclasses

from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from .config import SonicConfig, validate_megatron_config
from .dispatcher import LocalPlan, PipelinedPlan, SonicTokenDispatcher
from .experts import SonicExperts
from .kernels import TopKRouting
from .megatron_compat import accepted_kwargs, default_pg_collection
from .router import SonicRouter
from .token_dispatch import EPOptions, expert_parallel_experts, local_experts


def default_submodules(sonic_config: SonicConfig | None = None) -> MoESubmodules:
    """Routed experts = SonicExperts, router = SonicRouter, no shared experts."""
    params = {"sonic_config": sonic_config} if sonic_config is not None else {}
    return MoESubmodules(experts=ModuleSpec(module=SonicExperts, params=params), router=SonicRouter)


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
        self.sonic = SonicConfig.resolve(sonic_config)
        validate_megatron_config(config, self.sonic)
        if submodules is None:
            submodules = default_submodules(self.sonic)
        if pg_collection is None:
            pg_collection = default_pg_collection()
        super().__init__(
            **accepted_kwargs(
                MoELayer.__init__,
                dict(
                    config=config,
                    submodules=submodules,
                    layer_number=layer_number,
                    pg_collection=pg_collection,
                    **kwargs,
                ),
            )
        )
        if isinstance(self.experts, SonicExperts):
            self.experts.sonic_config = self.sonic
        if self.sonic.rounding_enabled and not isinstance(self.router, SonicRouter):
            raise ValueError(
                f"SonicConfig.token_rounding={self.sonic.token_rounding!r} needs the router to be SonicRouter, "
                f"got {type(self.router).__name__}"
            )
        self._dense_probs_TE = None
        if self.sonic.dispatcher == "sonic":
            if not isinstance(self.experts, SonicExperts):
                raise ValueError(
                    "SonicConfig.dispatcher='sonic' needs MoESubmodules.experts = SonicExperts, got "
                    f"{type(self.experts).__name__} (use dispatcher='megatron' for other experts)"
                )
            pipelined = self.sonic.pipelined
            if pipelined and getattr(config, "overlap_moe_expert_parallel_comm", False):
                raise ValueError(
                    "SonicConfig.num_chunks > 1 / by_source / redispatch_x_in_backward run dispatch, experts and "
                    "combine as one pipelined node, which Megatron's overlap_moe_expert_parallel_comm cannot split; "
                    "use one or the other"
                )
            self.token_dispatcher = SonicTokenDispatcher(
                self.num_local_experts, self.local_expert_indices, config, pg_collection, self.sonic
            )
            if self.use_shared_expert and self.shared_expert_overlap:
                self.token_dispatcher.set_shared_experts(self.shared_experts)
            if hasattr(self, "_training_token_dispatcher"):  # 0.19 re-selects it in forward()
                self._training_token_dispatcher = self.token_dispatcher

    @property
    def _sonic_dispatch(self) -> bool:
        return isinstance(self.token_dispatcher, SonicTokenDispatcher)

    def route(self, hidden_states, padding_mask=None):
        rounding = self._sonic_dispatch and self.sonic.rounding_enabled and self.training
        if isinstance(self.router, SonicRouter):
            self.router.keep_dense_probs = rounding
            self.router.emit_topk = self._sonic_dispatch  # (scores [T, K], indices [T, K]) for our dispatcher
        probs, routing_map = super().route(hidden_states, padding_mask)
        self._dense_probs_TE = self.router.pop_dense_probs() if rounding else None
        return probs, routing_map

    def preprocess(self, hidden_states, probs, routing_map):
        if not self._sonic_dispatch:
            return super().preprocess(hidden_states, probs, routing_map)
        dense, self._dense_probs_TE = self._dense_probs_TE, None
        x, scores = self.token_dispatcher.dispatch_preprocess(hidden_states, routing_map, probs, dense_probs_TE=dense)
        if self._freed_by_1f1b_schedule:
            # The schedule frees the "moe_dispatch" node's inputs after its forward; ours would alias the
            # pre-MLP norm output (also read by shared experts' backward) and the routed probs.
            x, scores = x.clone(), scores.clone()
            if isinstance(self.token_dispatcher.plan, LocalPlan):  # its indices are the router's outputs
                self.token_dispatcher.plan = self.token_dispatcher.plan.cloned()
        return x, scores

    @property
    def _freed_by_1f1b_schedule(self) -> bool:
        """Megatron's 1F1B EP-overlap schedule (--overlap-moe-expert-parallel-comm) releases the storage of the
        inputs of its "moe_dispatch", "mlp" and "moe_combine" nodes right after their forward
        (megatron/core/models/common/utils.py should_free_input), because the stock dispatcher copies tokens in
        its permutations. Our path passes tokens without those copies, so in this mode the tensors that cross
        a freed node boundary and are still needed later get a private copy."""
        return bool(getattr(self.config, "overlap_moe_expert_parallel_comm", False))

    def _ep_options(self) -> EPOptions:
        """token_dispatch's options of this layer (SonicConfig's and the experts'), built once: they are fixed
        after construction, and the layer's host time counts."""
        if getattr(self, "_ep_options_cached", None) is None:
            self._ep_options_cached = EPOptions(
                activation=self.experts.activation,
                backend=self.sonic.backend,
                num_chunks=self.sonic.num_chunks,
                by_source=self.sonic.by_source,
                comm_sms=self.sonic.comm_sms,
                redispatch_x_in_backward=self.sonic.redispatch_x_in_backward,
                wgrad=self.experts.wgrad.ep_deferred,
            )
        return self._ep_options_cached

    def routed_experts_compute(self, hidden_states, probs):
        if not self._sonic_dispatch:
            return super().routed_experts_compute(hidden_states, probs)
        disp = self.token_dispatcher
        x_recv, _, scores_recv = disp.dispatch_postprocess(hidden_states, probs)
        plan = disp.plan
        if isinstance(plan, LocalPlan):  # EP = 1: the experts on the routing itself, no plan, no copies
            if self._freed_by_1f1b_schedule:  # the experts cache x for backward
                x_recv = x_recv.clone()
            return self.experts.compute(x_recv, plan.with_scores(scores_recv)), None
        if isinstance(plan, PipelinedPlan):  # dispatch + experts + combine in one pipelined call
            out = expert_parallel_experts(
                x_recv,
                TopKRouting(scores_recv, plan.indices_TK),
                self.experts.weight1,
                self.experts.weight2,
                group=disp.group,
                num_experts=disp.num_experts,
                rounding_scores_TE=plan.dense_probs_TE,
                options=dataclasses.replace(
                    self._ep_options(), rounding=disp.rounding() if plan.dense_probs_TE is not None else None
                ),
            )
            disp.plan = PipelinedPlan(plan.indices_TK, None)  # combine passes through; drop the dense probs
            return out, None
        if self._freed_by_1f1b_schedule:  # local_experts caches the received rows for backward
            x_recv = x_recv.clone()
        y = local_experts(
            x_recv,
            scores_recv,
            self.experts.weight1,
            self.experts.weight2,
            disp.plan,
            options=self._ep_options(),
            # Under the 1F1B EP overlap another micro-batch's all-to-all runs beside this node's GEMMs.
            comm_sms=self.sonic.comm_sms if self._freed_by_1f1b_schedule else 0,
        )
        return disp.combine_preprocess(y), None
