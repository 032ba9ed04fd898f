"""``SonicTokenDispatcher``: Megatron's token-dispatcher protocol on top of ``sonic_megatron.token_dispatch``.

Shape legend: S sequence (/TP), B batch, T = S*B tokens of this rank, H hidden, E global experts, K top-K,
Tr rows received by this rank (one per (source token, this rank), not one per pair).

Megatron's MoELayer calls, in order (each step may be its own node of the 1F1B overlap schedule):
    dispatch_preprocess(hidden [S,B,H], routing_map [T,E] bool, probs [T,E]) -> (x [T,H], scores [T,K])
        local: picks each token's K experts from the map (no host sync), builds the plan (token
        rounding and the small counts exchange happen here when enabled)
    token_dispatch(x, scores)        -> (x_recv [Tr,H], scores_recv)      all-to-all (EP)
    dispatch_postprocess(x_recv, scores_recv) -> (x_recv, None, scores_recv)
    [SonicMoELayer.routed_experts_compute runs the local experts on the plan]
    combine_preprocess(y_recv) -> y_recv;   token_combine(y_recv) -> out [T,H] (all-to-all back)
    combine_postprocess(out) -> [S,B,H] (+ overlapped shared-expert output)
Scores travel as method arguments (never hidden in the plan), so the only autograd links between steps are
the tensors Megatron passes, as its overlap schedule requires. The plan (int metadata, no autograd) is the
per-microbatch forward state kept on the dispatcher between the steps of one forward -- as Megatron's
alltoall dispatcher keeps its splits; backward reads what it needs from autograd contexts only.

Shared-expert overlap (``--moe-shared-expert-overlap``) calls SharedExpertMLP's stream hooks at the same
points as Megatron 0.16's alltoall dispatcher: its fc1 runs while the dispatch all-to-all is in flight.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from .config import SonicConfig
from .kernels import FlatRouting, TopKRouting
from .router import as_topk
from .token_dispatch import EPOptions, TokenRounding, combine, dispatch, finish_plan, round_local, start_plan

# Token rounding moves up to rounding_tile - 1 pairs of every expert, a large share of an expert's batch when it
# holds few tiles. Measured with nearest rounding (Megatron-LM pretrain_gpt.py, 200 iterations on the markov corpus,
# docs/PERF.md): with 2 tiles per expert on average (256 pairs, tile 128) the model's training loss against top-K's
# was -0.2 % on average over five seeds (-4.7 % to +2.4 % per seed), with 4 tiles -1.6 % and +1.1 % (two configs).
# SonicMoE's paper finds rounding robust from 2 tiles per expert and degraded at 1; nothing here measured fewer.
FEW_TILES_PER_EXPERT = 2
_warned_few_tiles: set[tuple] = set()  # few_tiles_message's arguments already checked


def few_tiles_message(num_tokens: int, topk: int, ep_size: int, num_experts: int, mode: str, tile: int) -> str | None:
    """Why token rounding may cost model quality at this micro-batch (fewer than ``FEW_TILES_PER_EXPERT`` tiles of
    routed pairs per expert on average, counted over the EP group as rounding counts them), else None."""
    per_expert = num_tokens * topk * ep_size / num_experts
    if per_expert >= FEW_TILES_PER_EXPERT * tile:
        return None
    return (
        f"SonicConfig.token_rounding={mode!r}: {per_expert:.0f} routed pairs per expert per micro-batch on average "
        f"({num_tokens} tokens x top-{topk} x EP {ep_size} / {num_experts} experts) is fewer than "
        f"{FEW_TILES_PER_EXPERT} x rounding_tile ({tile}). Rounding moves up to {tile - 1} pairs of every expert; "
        "measured (pretrain_gpt.py, 200 iterations), 2 tiles per expert ended -0.2 % against top-K's loss on average "
        "over five seeds, and SonicMoE's paper reports a loss of quality at 1 tile (docs/PERF.md). Use more tokens "
        "per micro-batch, token_rounding='up' (it fills partial tiles, saving no GEMM tile) or token_rounding='none'."
    )


@dataclass
class PipelinedPlan:
    """``SonicConfig.pipelined`` (num_chunks > 1, by_source or redispatch_x_in_backward): planning, dispatch,
    experts and combine all run inside ``routed_experts_compute`` (token_dispatch's pipelined
    ``expert_parallel_experts``, where the all-to-all of one stage overlaps another stage's GEMMs); the other
    steps pass tensors through."""

    indices_TK: torch.Tensor
    dense_probs_TE: torch.Tensor | None


@dataclass
class LocalPlan:
    """Expert-parallel size 1: no plan, no communication, no host sync. The routing (top-K, or the rounded flat
    routing) goes straight to the local experts (``SonicExperts.compute``); dispatch and combine pass tensors
    through. Its scores travel as the method arguments, as in the EP plan."""

    routing: TopKRouting | FlatRouting

    def with_scores(self, scores: torch.Tensor) -> TopKRouting | FlatRouting:
        """The routing with the scores Megatron passed between the schedule's nodes (autograd link)."""
        if isinstance(self.routing, TopKRouting):
            return TopKRouting(scores, self.routing.indices_TK)
        return dataclasses.replace(self.routing, scores_R=scores)

    def cloned(self) -> LocalPlan:
        """A copy owning its index tensors (Megatron's 1F1B EP-overlap schedule frees the router's outputs)."""
        r = self.routing
        if isinstance(r, TopKRouting):
            return LocalPlan(TopKRouting(r.scores_TK, r.indices_TK.clone()))
        offsets = None if r.token_offsets is None else r.token_offsets.clone()
        meta = r.metadata
        if meta is not None:
            meta = dataclasses.replace(
                meta, **{n: t.clone() for n, t in zip(meta.TENSOR_NAMES, meta.tensors(), strict=True)}
            )
        return LocalPlan(
            dataclasses.replace(
                r,
                token_idx_R=r.token_idx_R.clone(),
                expert_idx_R=r.expert_idx_R.clone(),
                token_offsets=offsets,
                metadata=meta,
            )
        )


class SonicTokenDispatcher(MoETokenDispatcher):
    """Megatron dispatcher protocol over ``token_dispatch`` (see the module docstring)."""

    def __init__(self, num_local_experts: int, local_expert_indices, config, pg_collection, sonic: SonicConfig):
        super().__init__(config=config, pg_collection=pg_collection)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.sonic = sonic
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.group = self.ep_group if self.ep_size > 1 else None
        self.plan = None
        self.hidden_shape = None
        self.ep_rank = self.ep_group.rank()

    # -- per-microbatch forward state ---------------------------------------------------------------------
    def dispatch_preprocess(self, hidden_states, routing_map, probs, dense_probs_TE=None):
        """Plan the dispatch. ``dense_probs_TE`` (router probabilities, with autograd) enables rounding."""
        self.hidden_shape = hidden_states.shape
        x_TH = hidden_states.reshape(-1, self.hidden_shape[-1])
        if probs.dim() != 2 or routing_map.dim() != 2:
            raise ValueError(
                "SonicTokenDispatcher: probs and routing_map must be 2-D ([T, E] with a bool map, or top-K [T, K] "
                f"with int64 indices), got {tuple(probs.shape)} {tuple(routing_map.shape)} {routing_map.dtype}"
            )
        scores_TK, idx_TK = as_topk(probs, routing_map, self.topk)
        if dense_probs_TE is not None:
            self._warn_few_tiles(x_TH.shape[0])
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states)
        if self.pipelined:
            self.plan = PipelinedPlan(idx_TK, dense_probs_TE)
            return x_TH, scores_TK
        rounding = None
        if dense_probs_TE is not None:
            rounding = self.rounding()
        if self.group is None:  # EP = 1: the experts read the routing directly
            routing = TopKRouting(scores_TK, idx_TK)
            if rounding is not None:
                routing = round_local(routing, dense_probs_TE, num_experts=self.num_experts, rounding=rounding)
            self.plan = LocalPlan(routing)
            return x_TH, routing.scores_TK if isinstance(routing, TopKRouting) else routing.scores_R
        # The plan's device work and its sizes exchange are launched here; its host sync waits in token_dispatch,
        # so that work a schedule queues in between (Megatron's 1F1B EP overlap: another micro-batch's backward)
        # keeps the GPU busy while the host waits.
        self.plan = start_plan(
            TopKRouting(scores_TK, idx_TK),
            num_experts=self.num_experts,
            group=self.group,
            rounding_scores_TE=dense_probs_TE,
            x_TD=x_TH,
            options=EPOptions(rounding=rounding, num_chunks=self.sonic.num_chunks),
        )
        # The routing actually used (after rounding: padded, real pairs first), with autograd to the router's probs.
        return x_TH, self.plan.scores_R

    @property
    def pipelined(self) -> bool:
        return self.sonic.pipelined

    def rounding(self) -> TokenRounding:
        return TokenRounding(mode=self.sonic.token_rounding, tile=self.sonic.rounding_tile)

    def _warn_few_tiles(self, num_tokens: int) -> None:
        """``few_tiles_message`` as a warning, once per process and set of its arguments."""
        key = (
            num_tokens,
            self.topk,
            self.ep_size,
            self.num_experts,
            self.sonic.token_rounding,
            self.sonic.rounding_tile,
        )
        if key in _warned_few_tiles:
            return
        _warned_few_tiles.add(key)
        msg = few_tiles_message(*key)
        if msg is not None:
            warnings.warn(msg, UserWarning, stacklevel=3)

    def _freed_by_1f1b_schedule(self) -> bool:
        """Megatron's 1F1B EP-overlap schedule frees each node's inputs after its forward: a pass-through
        step must then hand on a copy, not the freed tensor (see SonicMoELayer._freed_by_1f1b_schedule)."""
        return isinstance(self.plan, LocalPlan) and bool(
            getattr(self.config, "overlap_moe_expert_parallel_comm", False)
        )

    def token_dispatch(self, hidden_states, probs):
        if self._freed_by_1f1b_schedule():
            return hidden_states.clone(), probs.clone()
        if isinstance(self.plan, (PipelinedPlan, LocalPlan)):
            return hidden_states, probs
        self.plan = finish_plan(self.plan)  # the host sync: the split sizes
        # Dispatch the scores Megatron passed in (under the 1F1B overlap schedule: a detached copy of the
        # plan's scores), so autograd links between schedule nodes are only the tensors passed. With rounding
        # they were padded: the real pairs come first.
        num_pairs = self.plan.scores_R.shape[0]
        if probs.shape[0] != num_pairs:
            probs = probs[:num_pairs]
        return dispatch(hidden_states, dataclasses.replace(self.plan, scores_R=probs))

    def dispatch_postprocess(self, hidden_states, probs):
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(hidden_states)
        return hidden_states, None, probs

    def combine_preprocess(self, hidden_states):
        return hidden_states

    def token_combine(self, hidden_states, *args, **kwargs):
        if self._freed_by_1f1b_schedule():
            return hidden_states.clone()
        if isinstance(self.plan, (PipelinedPlan, LocalPlan)):
            return hidden_states
        return combine(hidden_states, self.plan)

    def combine_postprocess(self, hidden_states):
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(hidden_states)
            self.shared_experts.post_forward_comm()
        output = hidden_states.view(self.hidden_shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts.get_output()
        return output

    def get_expert_zero_copy_buffers(self):
        """megatron-core 0.19 asks every dispatcher; only NCCL-EP has them."""
        return None, None
