"""``SonicTokenDispatcher``: Megatron's token-dispatcher protocol over the layer's dispatch mode (``modes.py``).

Shape legend: S sequence (/TP), B batch, T = S*B tokens of this rank, P expert tensor-parallel size (ETP), H
hidden, K top-K, Tr rows received by this rank.

Megatron's MoELayer calls, in order (each step may be its own node of the 1F1B overlap schedule):
    dispatch_preprocess(hidden [S,B,H], RouterOutput) -> (x [PT,H], scores)  [ETP gather], mode.preprocess
    token_dispatch(x, scores) -> (x_recv [Tr,H], scores_recv)               mode.dispatch
    dispatch_postprocess(x_recv, scores_recv) -> (x_recv, None, scores_recv)
    [SonicMoELayer.routed_experts_compute: mode.compute]
    combine_preprocess(y_recv) -> y_recv;   token_combine(y_recv) -> out [T,H]   mode.combine, [ETP sum]
    combine_postprocess(out) -> [S,B,H] (+ overlapped shared-expert output)
The dispatcher keeps what the protocol needs around the mode: the input's shape, expert tensor parallelism (with
ETP > 1 the mode works on the ETP group's gathered tokens and the ranks' partial outputs are summed back onto
each rank's own tokens: ``expert_tp.py``), the shared-expert overlap (its stream hooks at the same points as
Megatron 0.16's alltoall dispatcher: fc1 runs while the dispatch all-to-all is in flight) and the warning about
rounding few tiles.
"""

from __future__ import annotations

import warnings

from megatron.core import utils as megatron_utils
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from .expert_tp import gather_routed, sum_partials
from .layer_options import LayerOptions
from .modes import DispatchMode
from .router import RouterOutput

# Token rounding moves up to rounding_tile - 1 pairs of every expert: when an expert holds only a few tiles of
# routed pairs per micro-batch, that is a large share of its batch and model quality can suffer (measured, and
# what SonicMoE reports: docs/PERF.md, "Token rounding"). The layer warns below this many tiles per expert.
FEW_TILES_PER_EXPERT = 2


def few_tiles_message(num_tokens: int, topk: int, ep_size: int, num_experts: int, mode: str, tile: int) -> str | None:
    """Why token rounding may cost model quality at this micro-batch (fewer than ``FEW_TILES_PER_EXPERT`` tiles of
    routed pairs per expert on average, counted over the EP group as rounding counts them), else None."""
    per_expert = num_tokens * topk * ep_size / num_experts
    if per_expert >= FEW_TILES_PER_EXPERT * tile:
        return None
    return (
        f"SonicConfig.token_rounding={mode!r}: {per_expert:.0f} routed pairs per expert per micro-batch on average "
        f"({num_tokens} tokens x top-{topk} x EP {ep_size} / {num_experts} experts) is fewer than "
        f"{FEW_TILES_PER_EXPERT} x rounding_tile ({tile}). Rounding moves up to {tile - 1} pairs of every expert, a "
        'large share of so few, and can cost model quality (docs/PERF.md, "Token rounding"). Use more tokens per '
        "micro-batch, token_rounding='up' (it fills partial tiles, saving no GEMM tile) or token_rounding='none'."
    )


class SonicTokenDispatcher(MoETokenDispatcher):
    """Megatron's dispatcher protocol over ``mode`` (see the module docstring).

    Args:
        mode: the layer's dispatch mode (``modes.choose_mode``).
        options: the layer's resolved options (token rounding's, for the few-tiles warning).
        num_local_experts, local_expert_indices, config, pg_collection: as Megatron's dispatchers.
    """

    def __init__(
        self,
        mode: DispatchMode,
        options: LayerOptions,
        num_local_experts: int,
        local_expert_indices,
        config,
        pg_collection,
    ):
        super().__init__(config=config, pg_collection=pg_collection)
        self.mode = mode
        self.options = options
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.hidden_shape = None
        self._warned_few_tiles: set[int] = set()  # token counts already checked
        # expert tensor parallelism: the group whose tokens the mode sees gathered (None at ETP 1)
        etp_group = pg_collection.expt_tp
        self.etp_group = etp_group if megatron_utils.get_pg_size(etp_group) > 1 else None

    def dispatch_preprocess(self, hidden_states, routed: RouterOutput):
        self.hidden_shape = hidden_states.shape
        x_TH = hidden_states.reshape(-1, self.hidden_shape[-1])
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states)
        if self.etp_group is not None:
            x_TH, routed = gather_routed(x_TH, routed, self.etp_group)
        if routed.dense_probs_TE is not None:
            self._warn_few_tiles(x_TH.shape[0])
        return self.mode.preprocess(x_TH, routed)

    def _warn_few_tiles(self, num_tokens: int) -> None:
        """``few_tiles_message`` as a warning, once per token count."""
        if num_tokens in self._warned_few_tiles:
            return
        self._warned_few_tiles.add(num_tokens)
        rounding = self.options.rounding
        msg = few_tiles_message(
            num_tokens,
            self.config.moe_router_topk,
            self.ep_size,
            self.config.num_moe_experts,
            rounding.mode,
            rounding.tile,
        )
        if msg is not None:
            warnings.warn(msg, UserWarning, stacklevel=3)

    def token_dispatch(self, hidden_states, probs):
        return self.mode.dispatch(hidden_states, probs)

    def dispatch_postprocess(self, hidden_states, probs):
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(hidden_states)
        return hidden_states, None, probs

    def combine_preprocess(self, hidden_states):
        return hidden_states

    def token_combine(self, hidden_states, *args, **kwargs):
        out = self.mode.combine(hidden_states)
        return out if self.etp_group is None else sum_partials(out, self.etp_group)

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
