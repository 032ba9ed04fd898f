"""``SonicExperts``: Megatron's experts module contract on top of ``sonic_megatron.kernels``.

Shape legend: N dispatched rows, T tokens, H hidden size, F expert ffn size of this rank (``moe_ffn_hidden_size``
/ ETP, the expert tensor-parallel size), El local experts, G = 2F (GLU) or F. Parameters are stacked as the
kernels want them (nn.Linear layout per expert):
    weight1 [El, G, H]  fc1, GLU rows ``[gate ; up]`` (gate first, Megatron's order; with ETP > 1 this rank's
                        share of each, ``init_stacked_weights``)
    weight2 [El, H, F]  fc2 (with ETP > 1 this rank's columns: the output is a partial sum)

Ways in:
* ``forward(tokens_NH, tokens_per_expert, probs_N, **kwargs) -> (out_NH, None)``: Megatron's contract (rows
  grouped by local expert, one prob per row, applied to the activation). Used with Megatron's own
  dispatchers (``SonicConfig.dispatcher='megatron'``), by the stock ``MoELayer`` and by tests.
* ``compute(x_TD, routing)``: a kernels routing over local expert ids (each token once, its experts'
  outputs summed); the plugin's layer at expert-parallel size 1.
* ``compute_received`` / ``compute_expert_parallel``: token_dispatch's step-wise ``local_experts`` and pipelined
  ``expert_parallel_experts`` over these weights (the plugin's layer under expert parallelism).
Weight gradients go through ``self.wgrad`` (a ``WeightGradSink``): added into Megatron DDP's ``main_grad`` by
the GEMMs themselves wherever DDP allocated it (under Megatron's schedules once per pair of micro-batches,
``SonicConfig.pair_weight_grads``), and deferred to ``backward_dw()`` with ``delay_wgrad_compute``.
Selective recompute of ``moe_act`` and activation offloading of ``expert_fc1``/``moe_act`` are not needed:
the Sonic kernels cache only X and H (never the activation or the gathered tokens).
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.transformer.module import MegatronModule

from .checkpoint import drop_extra_state_keys, stacked_experts_sharded_state_dict
from .config import SonicConfig, expert_ffn_per_rank
from .kernels import FlatRouting, TopKRouting, moe_experts
from .kernels.activations import is_gated
from .kernels.routing import Routing
from .layer_options import LayerOptions
from .megatron_compat import default_pg_collection, expert_rng_context
from .token_dispatch import (
    EarlyDispatch,
    EPPlan,
    TokenRounding,
    expert_parallel_experts,
    local_experts,
    local_experts_before_sync,
)
from .wgrad import WeightGradSink


def init_stacked_weights(module, config, num_local_experts: int, pg_collection, gated: bool) -> None:
    """The stacked expert parameters every experts module of this package keeps (``weight1`` [El, G/ETP, H], fc1
    with GLU rows ``[gate ; up]``; ``weight2`` [El, H, F/ETP], fc2), uninitialised, with the process groups and the
    parameter attributes of Megatron's expert linears.

    Expert tensor parallelism (``pg_collection.expt_tp`` of size ETP > 1) splits every expert's ffn dimension as
    Megatron's ETP experts do (SequentialMLP's ColumnParallel fc1 / RowParallel fc2, TEGroupedMLP alike), so that
    local shapes and checkpoints are interchangeable: ETP rank r holds gate rows ``[r F/ETP, (r+1) F/ETP)`` and the
    same up rows, stacked ``[gate_r ; up_r]`` (what Megatron's GLU chunks its local fc1 output into), and fc2's
    columns ``[r F/ETP, (r+1) F/ETP)``. Its output is a partial down-projection: whoever dispatches to it sums
    the partials over the ETP group (Megatron's dispatchers, or ``expert_tp.py`` for the plugin's)."""
    module.num_local_experts = num_local_experts
    module.ep_group = pg_collection.ep
    module.dp_group = pg_collection.expt_dp
    module.tp_group = pg_collection.expt_tp
    module.etp_size = module.tp_group.size() if module.tp_group is not None else 1
    module.etp_rank = module.tp_group.rank() if module.tp_group is not None else 0
    hidden = config.hidden_size
    ffn = expert_ffn_per_rank(config, module.etp_size)
    fc1_rows = 2 * ffn if gated else ffn
    device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
    module.weight1 = torch.nn.Parameter(
        torch.empty(num_local_experts, fc1_rows, hidden, dtype=config.params_dtype, device=device)
    )
    module.weight2 = torch.nn.Parameter(
        torch.empty(num_local_experts, hidden, ffn, dtype=config.params_dtype, device=device)
    )
    for p, dim in ((module.weight1, 1), (module.weight2, 2)):
        # Expert parameters: reduced over the expert-data-parallel group by DDP/optimizer/clipping
        # (allreduce=False); tensor-parallel over the expert-tensor-parallel group along the ffn dimension, as
        # Megatron's expert linears (``partition_dim`` in the stacked layout), so that the gradient norm counts
        # every shard once.
        p.allreduce = False
        p.tensor_model_parallel = True
        p.partition_dim = dim
        p.partition_stride = 1


class SonicExperts(MegatronModule):
    """Stacked local experts computed by the Sonic kernels.

    Args:
        num_local_experts: experts on this EP rank (El).
        config: Megatron TransformerConfig (``hidden_size``, ``moe_ffn_hidden_size``, activation, dtypes,
            ``use_cpu_initialization``, ``perform_initialization``, ``init_method``,
            ``output_layer_init_method``, ``delay_wgrad_compute``).
        submodules: accepted and ignored (Megatron's expert specs pass MLP submodules).
        pg_collection: process groups (``ep``, ``expt_dp``, ``expt_tp``); Megatron's defaults if None.
        sonic_config: plugin options, resolved here (env overrides apply) when ``options`` is None, i.e. when
            a stock MoELayer builds these experts.
        options: the layer's resolved options (``SonicMoELayer`` passes them).
        **kwargs: newer Megatron arguments (``name``...) are accepted and ignored.
    """

    def __init__(
        self,
        num_local_experts: int,
        config,
        submodules=None,
        pg_collection=None,
        sonic_config: SonicConfig | None = None,
        options: LayerOptions | None = None,
        **kwargs,
    ):
        super().__init__(config=config)
        if pg_collection is None:
            pg_collection = default_pg_collection()
        if options is None:  # built by a stock MoELayer, not by SonicMoELayer
            options = LayerOptions.resolve(sonic_config, config, check_megatron=False)
        self.options = options
        self.activation = self.options.ep.activation
        self.gated = is_gated(self.activation)
        init_stacked_weights(self, config, num_local_experts, pg_collection, self.gated)
        if config.perform_initialization:
            self._init_weights()
        self.__init_wgrad__()
        self.register_load_state_dict_post_hook(drop_extra_state_keys)

    def __init_wgrad__(self) -> None:
        """(Re)build the weight-gradient sink from ``config.delay_wgrad_compute``, and with it ``ep_options``."""
        delay = bool(getattr(self.config, "delay_wgrad_compute", False))
        for p in (self.weight1, self.weight2):
            p.skip_backward_post_hook = delay
        self.wgrad = WeightGradSink(
            (self.weight1, self.weight2),
            delay=delay,
            config=self.config,
            pair=self.options.sonic.pair_weight_grads,
        )
        # token_dispatch's options of these experts: the layer's, with the weight gradients going through the sink
        # as the local path's do (main_grad fusion, micro-batch pairs, delayed wgrad)
        self.ep_options = dataclasses.replace(self.options.ep, weight_grad_hook=self.wgrad.grads_for_autograd)

    @torch.no_grad()
    def _init_weights(self) -> None:
        """Megatron's init methods per expert (fp32 master, then cast), under the expert RNG tracker."""
        with expert_rng_context():
            inits = ((self.weight1, self.config.init_method), (self.weight2, self.config.output_layer_init_method))
            for w, init in inits:
                for e in range(self.num_local_experts):
                    master = torch.empty(w.shape[1:], dtype=torch.float32, device=w.device)
                    init(master)
                    w[e].copy_(master)

    # ------------------------------------------------------------------------------------------------
    def compute(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Combined output [T, H] of the local experts for a kernels routing over local expert ids."""
        return moe_experts(
            x_TD,
            routing,
            self.weight1,
            self.weight2,
            activation=self.activation,
            backend=self.options.ep.backend,
            weight_grad_hook=self.wgrad.grads_for_autograd,  # main_grad fusion, delayed wgrad
        )

    def compute_received(
        self, x_recv: torch.Tensor, scores_recv: torch.Tensor, plan: EPPlan, *, beside_all_to_all: bool
    ) -> torch.Tensor:
        """token_dispatch's ``local_experts`` on the rows ``plan`` brought to this rank: y_recv, one row per
        received row (its pairs' outputs summed). ``beside_all_to_all``: another micro-batch's all-to-all runs
        beside these GEMMs (Megatron's 1F1B EP overlap), which then leave ``SonicConfig.comm_sms`` SMs free."""
        return local_experts(
            x_recv,
            scores_recv,
            self.weight1,
            self.weight2,
            plan,
            options=self.ep_options,
            comm_sms=self.options.sonic.comm_sms if beside_all_to_all else 0,
        )

    def compute_received_before_sync(
        self, x_recv: torch.Tensor, scores_slots: torch.Tensor, early: EarlyDispatch, *, beside_all_to_all: bool
    ) -> torch.Tensor:
        """``compute_received`` on ``dispatch_before_sync``'s slots with no host sync (token dispatch's
        ``local_experts_before_sync``; ``combine_slots`` takes its output): ``early.plan`` exists after backward."""
        return local_experts_before_sync(
            x_recv,
            scores_slots,
            self.weight1,
            self.weight2,
            early,
            options=self.ep_options,
            comm_sms=self.options.sonic.comm_sms if beside_all_to_all else 0,
        )

    def compute_expert_parallel(
        self,
        x_TD: torch.Tensor,
        routing: TopKRouting,
        *,
        group,
        num_experts: int,
        rounding_scores_TE: torch.Tensor | None,
        rounding: TokenRounding | None,
    ) -> torch.Tensor:
        """token_dispatch's pipelined ``expert_parallel_experts`` over these weights: plan, dispatch, experts and
        combine of this rank's tokens in one call (``rounding`` with the dense ``rounding_scores_TE``, or None)."""
        options = self.ep_options if rounding is None else dataclasses.replace(self.ep_options, rounding=rounding)
        return expert_parallel_experts(
            x_TD,
            routing,
            self.weight1,
            self.weight2,
            group=group,
            num_experts=num_experts,
            rounding_scores_TE=rounding_scores_TE,
            options=options,
        )

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
        **kwargs,
    ):
        """Megatron's experts contract: rows grouped by local expert (``tokens_per_expert`` [El] rows
        each, on any device), one prob per row applied to the activation. Returns (output [N, H], None)."""
        if kwargs.get("output_buffer") is not None or kwargs.get("grad_input_buffer") is not None:
            raise ValueError("SonicExperts: NCCL-EP zero-copy buffers (output_buffer, grad_input_buffer) unsupported")
        x_NH = permuted_local_hidden_states
        n = x_NH.shape[0]
        counts = torch.as_tensor(tokens_per_expert)
        if counts.numel() != self.num_local_experts:
            raise ValueError(
                f"SonicExperts: tokens_per_expert must have {self.num_local_experts} entries, got {counts.numel()}"
            )
        expert_ids = torch.arange(self.num_local_experts, dtype=torch.int32, device=counts.device)
        expert_idx_N = torch.repeat_interleave(expert_ids, counts.long(), output_size=n).to(x_NH.device)
        token_idx_N = torch.arange(n, dtype=torch.int32, device=x_NH.device)
        routing = FlatRouting(token_idx_N, expert_idx_N, permuted_probs.reshape(-1), n)
        return self.compute(x_NH, routing), None

    def backward_dw(self) -> None:
        """Compute the weight gradients deferred by ``delay_wgrad_compute`` (no-op otherwise)."""
        self.wgrad.compute()

    def register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
        """Megatron DDP (``delay_wgrad_compute``) registers its per-parameter grad-ready hooks here; they run
        after ``backward_dw()`` has accumulated the weight gradients."""
        self.wgrad.register_hook(hook)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """SequentialMLP-compatible keys and global shapes (see ``sonic_megatron.checkpoint``)."""
        return stacked_experts_sharded_state_dict(self, prefix, sharded_offsets, metadata)
