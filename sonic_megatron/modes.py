"""How one MoE layer's tokens reach its experts and come back: one mode object per layer, chosen when the layer
is built (``choose_mode``).

Shape legend: T tokens of this rank, H hidden, K top-K, Tr rows received by this rank (one per (source token,
this rank), not one per pair).

Megatron's MoELayer runs a forward as steps, each of which may be its own node of the 1F1B EP-overlap schedule;
``SonicTokenDispatcher`` and ``SonicMoELayer.routed_experts_compute`` hand each step to the layer's mode:

    preprocess(x [T, H], RouterOutput) -> (x, scores)   this micro-batch's routing is decided (rounding, plan)
    dispatch(x, scores) -> (x_recv [Tr, H], scores_recv) tokens to the ranks of their experts
    compute(x_recv, scores_recv) -> y_recv               this rank's experts
    combine(y_recv) -> out [T, H]                        results back to their tokens

Three modes:
* ``LocalMode`` (expert-parallel size 1): nothing to dispatch; the experts read the routing directly.
* ``ExpertParallelMode``: the steps above over token_dispatch's step-wise functions.
* ``PipelinedMode`` (``SonicConfig.pipelined``): dispatch, experts and combine as one pipelined call in ``compute``.

Scores travel as the steps' arguments: each step computes with the scores it is passed, so the only autograd
links between steps are the tensors Megatron passes, as its overlap schedule requires. Between the steps of one
forward a mode keeps one value (the routing, the started plan, the plan), replaced step by step, as Megatron's
alltoall dispatcher keeps its splits; backward reads what it needs from autograd contexts only.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from .kernels import FlatRouting, TopKRouting
from .router import RouterOutput
from .token_dispatch import (
    EarlyDispatch,
    EPPlan,
    Slots,
    StartedPlan,
    TokenRounding,
    combine,
    combine_slots,
    dispatch,
    dispatch_before_sync,
    finish_plan,
    round_local,
    start_plan,
)
from .token_dispatch.slots import slots_pay

if TYPE_CHECKING:
    from .experts import SonicExperts
    from .layer_options import LayerOptions


class DispatchMode:
    """What every mode holds: the layer's experts, its options, Megatron's config, the expert-parallel group
    (None at size 1) and the global expert count."""

    def __init__(self, experts: SonicExperts, options: LayerOptions, config, group, num_experts: int):
        self.experts = experts
        self.options = options
        self.config = config
        self.group = group
        self.num_experts = num_experts

    @property
    def freed_by_1f1b_schedule(self) -> bool:
        """Megatron's 1F1B EP-overlap schedule (``--overlap-moe-expert-parallel-comm``) releases the storage of the
        inputs of its "moe_dispatch", "mlp" and "moe_combine" nodes right after their forward
        (``should_free_input``), because the stock dispatcher copies tokens in its permutations. The modes pass
        tokens on without those copies, so under that schedule a tensor that crosses a freed node boundary and is
        read later is handed on as a private copy."""
        return bool(getattr(self.config, "overlap_moe_expert_parallel_comm", False))

    def rounding(self, routed: RouterOutput) -> TokenRounding | None:
        """This micro-batch's token rounding: the layer's policy where the router gave the dense probabilities
        (training), else None (plain top-K)."""
        return None if routed.dense_probs_TE is None else self.options.rounding

    def preprocess(self, x_TH: torch.Tensor, routed: RouterOutput) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def dispatch(self, x: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def compute(self, x_recv: torch.Tensor, scores_recv: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def combine(self, y_recv: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class LocalMode(DispatchMode):
    """Expert-parallel size 1: no plan, no communication, no host sync. The experts read this micro-batch's
    routing directly (top-K, or ``round_local``'s rounded flat routing); dispatch and combine pass tensors
    through."""

    routing: TopKRouting | FlatRouting | None = None  # this forward's, as preprocess decided it

    def preprocess(self, x_TH, routed):
        routing = _routing(routed)
        rounding = self.rounding(routed)
        if rounding is not None:
            routing = round_local(routing, routed.dense_probs_TE, num_experts=self.num_experts, rounding=rounding)
        scores = _scores(routing)
        if self.freed_by_1f1b_schedule:
            # x aliases the pre-MLP norm output (shared experts' backward reads it) and the routing holds the
            # router's outputs: the schedule frees both
            x_TH, scores, routing = x_TH.clone(), scores.clone(), _owning_indices(routing)
        self.routing = routing
        return x_TH, scores

    def dispatch(self, x, scores):
        if self.freed_by_1f1b_schedule:  # a pass-through node hands on copies, not the inputs the schedule frees
            return x.clone(), scores.clone()
        return x, scores

    def compute(self, x_recv, scores_recv):
        if self.freed_by_1f1b_schedule:  # the experts cache x for backward
            x_recv = x_recv.clone()
        return self.experts.compute(x_recv, _with_scores(self.routing, scores_recv))

    def combine(self, y_recv):
        return y_recv.clone() if self.freed_by_1f1b_schedule else y_recv


class ExpertParallelMode(DispatchMode):
    """Expert-parallel size > 1, one step per Megatron method: preprocess starts the plan, dispatch finishes it
    (the one host sync) and sends every token once to each rank that holds one of its experts, compute runs this
    rank's experts on the received rows (pre-reduced per row), combine sends the rows back and sums them per
    token in a fixed order.

    Where slots pay for the layer's routing shape (``token_dispatch/slots.py``) and every micro-batch has the same
    tokens (``variable_seq_lengths`` off), a training call after the layer's first has no host sync in its forward:
    the rows and pairs travel in slots sized by the previous call, the experts' GEMMs run over the bound of the
    pairs and the combine reads the slots; the plan's sync (split sizes, header check) waits in the experts'
    backward, or at the layer's next call if no backward ran. A sync per layer call would empty the GPU's queue and
    the host's lead with it, and the rest of the forward would be paced by the host. Token-rounded calls use slots
    that fit the rounding's added pairs. Calls without gradients, and every call under Megatron's 1F1B EP overlap
    (where another micro-batch's backward keeps the GPU busy while the host waits for the sizes, and the bound's
    larger GEMMs and slots cost more than the sync), or with ``SonicConfig.ep_slots`` off (H at the bound of the
    pairs costs activation memory), use exact split sizes."""

    _started: StartedPlan | None = None  # between preprocess and dispatch
    _early: EarlyDispatch | None = None  # between dispatch and compute, with slots
    plan: EPPlan | None = None  # this forward's, from dispatch on (None with slots: made in backward)
    _slots: Slots | None = None  # the next plan's slots: from the last plan's largest token count
    _unfinished: EarlyDispatch | None = None  # the last slotted call, from compute on (its plan sizes the next slots)

    def __init__(self, experts, options, config, group, num_experts):
        super().__init__(experts, options, config, group, num_experts)
        P = torch.distributed.get_world_size(group)
        self._slots_pay = options.sonic.ep_slots and slots_pay(num_experts, config.moe_router_topk, P)
        tile = options.rounding.tile if options.rounding is not None else 0
        self._slot_shape = (num_experts // P, config.moe_router_topk, tile)  # L, K, rounding tile
        # what the plan reads of token_dispatch's options, with and without this layer's rounding
        self._plan_options = options.ep
        self._rounded_plan_options = (
            dataclasses.replace(options.ep, rounding=options.rounding) if options.rounding is not None else None
        )

    def preprocess(self, x_TH, routed):
        if self._unfinished is not None:  # the last slotted call's plan: its sizes arrived long ago (no GPU wait)
            early, self._unfinished = self._unfinished, None
            reported, self._slots = early.error is not None, None  # exact split sizes unless the plan says otherwise
            if not reported:  # raises here what that call's backward did not (a forward without backward)
                self._set_plan(early.finish())
        rounded = self.rounding(routed) is not None
        routing = _unpadded(_routing(routed))
        # The plan's device work and its sizes exchange are launched here; its host sync waits in dispatch (with
        # slots: in the experts' backward), so that work a schedule queues in between (Megatron's 1F1B EP overlap:
        # another micro-batch's backward) keeps the GPU busy while the host waits. It checks x and the experts'
        # weights (and the backend's rules for them) on every rank together, so that the later steps find nothing
        # to refuse on one rank alone.
        self._started = start_plan(
            routing,
            num_experts=self.num_experts,
            group=self.group,
            rounding_scores_TE=routed.dense_probs_TE,
            x_TD=x_TH,
            w1_EGD=self.experts.weight1,
            w2_EDF=self.experts.weight2,
            options=self._rounded_plan_options if rounded else self._plan_options,
            slots=self._slots if isinstance(routing, TopKRouting) and torch.is_grad_enabled() else None,
        )
        # The routing actually used (after rounding: padded, real pairs first), with autograd to the router; with
        # bad input on this rank an empty placeholder: dispatch raises on every rank before reading it.
        scores = self._started.scores_R
        if self.freed_by_1f1b_schedule:  # x aliases the pre-MLP norm output, which the schedule frees
            x_TH, scores = x_TH.clone(), scores.clone()
        return x_TH, scores

    def dispatch(self, x, scores):
        started, self._started = self._started, None
        if started.slots is not None:  # before the sync: compute waits for it
            x_recv, scores_slots, self._early = dispatch_before_sync(x, scores, started)
            return x_recv, scores_slots
        self._set_plan(finish_plan(started))  # the host sync: the split sizes
        # Dispatch the scores Megatron passed in (under the 1F1B overlap schedule: a detached copy of the plan's
        # scores), so that autograd links between schedule nodes are only the tensors passed. With rounding they
        # were padded: the real pairs come first.
        num_pairs = self.plan.scores_R.shape[0]
        if scores.shape[0] != num_pairs:
            scores = scores[:num_pairs]
        return dispatch(x, dataclasses.replace(self.plan, scores_R=scores))

    def _set_plan(self, plan: EPPlan) -> None:
        """This forward's plan, and the next call's slots from it."""
        self.plan = plan
        fixed_tokens = not getattr(self.config, "variable_seq_lengths", False)
        slotted = self._slots_pay and fixed_tokens and not self.freed_by_1f1b_schedule
        self._slots = Slots.for_layer(plan.max_tokens, *self._slot_shape) if slotted and plan.max_tokens else None

    def compute(self, x_recv, scores_recv):
        beside_all_to_all = self.freed_by_1f1b_schedule  # another micro-batch's all-to-all runs beside this node
        if beside_all_to_all:  # local_experts caches the received rows for backward
            x_recv = x_recv.clone()
        if self._early is None:
            return self.experts.compute_received(x_recv, scores_recv, self.plan, beside_all_to_all=beside_all_to_all)
        # no host sync: the GEMMs over the bound of the pairs; the plan is finished in backward
        early, self._early = self._early, None
        early.hint = (
            "Megatron's variable_seq_lengths (--variable-seq-lengths) plans every call of the MoE layers with exact "
            "split sizes instead"
        )
        y_recv = self.experts.compute_received_before_sync(
            x_recv, scores_recv, early, beside_all_to_all=beside_all_to_all
        )
        self._unfinished, self.plan = early, None
        return y_recv

    def combine(self, y_recv):
        if self.plan is None:  # slotted: no host size needed
            return combine_slots(y_recv, self._unfinished)
        return combine(y_recv, self.plan)


class PipelinedMode(DispatchMode):
    """``SonicConfig.pipelined`` (num_chunks > 1 or redispatch_x_in_backward): planning, dispatch, experts and
    combine all run in ``compute`` (token_dispatch's ``expert_parallel_experts``, where the all-to-all of one chunk
    overlaps another chunk's GEMMs); the other steps pass tensors through. Megatron's 1F1B EP overlap cannot split
    that node (refused when the layer is built)."""

    routed: RouterOutput | None = None  # between preprocess and compute

    def preprocess(self, x_TH, routed):
        if routed.flat is not None:
            routed = dataclasses.replace(routed, flat=_unpadded(routed.flat))
        self.routed = routed
        return x_TH, _scores(_routing(routed))

    def dispatch(self, x, scores):
        return x, scores

    def compute(self, x_recv, scores_recv):
        routed, self.routed = self.routed, None  # the dense probabilities are not kept past this step
        return self.experts.compute_expert_parallel(
            x_recv,
            _with_scores(_routing(routed), scores_recv),
            group=self.group,
            num_experts=self.num_experts,
            rounding_scores_TE=routed.dense_probs_TE,
            rounding=self.rounding(routed),
        )

    def combine(self, y_recv):
        return y_recv


def choose_mode(experts: SonicExperts, options: LayerOptions, config, group) -> DispatchMode:
    """The layer's mode: pipelined where ``SonicConfig.pipelined`` asks for it, else local without expert
    parallelism (``group`` None), else step-wise expert parallel."""
    if options.sonic.pipelined:
        cls = PipelinedMode
    elif group is None:
        cls = LocalMode
    else:
        cls = ExpertParallelMode
    return cls(experts, options, config, group, config.num_moe_experts)


# -- the local routing -------------------------------------------------------------------------------------


def _routing(routed: RouterOutput) -> TopKRouting | FlatRouting:
    """The router's decision as a kernels routing: flat under Megatron's capacity factor, else top-K."""
    return routed.flat if routed.flat is not None else TopKRouting(routed.scores_TK, routed.indices_TK)


def _unpadded(routing: TopKRouting | FlatRouting) -> TopKRouting | FlatRouting:
    """The routing without its padding pairs (a capacity-dropped flat routing sized by its upper bound; the
    expert-parallel plan takes real pairs only). Reading the real pair count is a host sync, as in Megatron's
    alltoall dispatcher with a capacity factor and without pad-to-capacity."""
    if not isinstance(routing, FlatRouting) or not routing.padded:
        return routing
    n = int((routing.token_idx_R < routing.num_tokens).sum())  # padding pairs are last
    return FlatRouting(routing.token_idx_R[:n], routing.expert_idx_R[:n], routing.scores_R[:n], routing.num_tokens)


def _scores(routing: TopKRouting | FlatRouting) -> torch.Tensor:
    return routing.scores_TK if isinstance(routing, TopKRouting) else routing.scores_R


def _with_scores(routing: TopKRouting | FlatRouting, scores: torch.Tensor) -> TopKRouting | FlatRouting:
    """The routing with the scores Megatron passed between the schedule's nodes (the autograd link)."""
    if isinstance(routing, TopKRouting):
        return TopKRouting(scores, routing.indices_TK)
    return dataclasses.replace(routing, scores_R=scores)


def _owning_indices(routing: TopKRouting | FlatRouting) -> TopKRouting | FlatRouting:
    """A copy of the routing that owns its index tensors, metadata included (scores stay: the passed ones are
    used)."""
    if isinstance(routing, TopKRouting):
        return TopKRouting(routing.scores_TK, routing.indices_TK.clone())
    offsets = None if routing.token_offsets is None else routing.token_offsets.clone()
    meta = routing.metadata
    if meta is not None:
        meta = dataclasses.replace(
            meta, **{n: t.clone() for n, t in zip(meta.TENSOR_NAMES, meta.tensors(), strict=True)}
        )
    return dataclasses.replace(
        routing,
        token_idx_R=routing.token_idx_R.clone(),
        expert_idx_R=routing.expert_idx_R.clone(),
        token_offsets=offsets,
        metadata=meta,
    )
