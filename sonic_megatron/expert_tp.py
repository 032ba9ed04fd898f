"""Expert tensor parallelism (``--expert-tensor-parallel-size`` ETP > 1) around the plugin's dispatch: the tokens
every rank of an expert-tensor-parallel group routes are gathered before the dispatch, so that the ETP ranks of one
expert hold the same tokens, and the partial outputs of their ffn shards are summed after the combine.

Shape legend: T tokens of this rank, P = ETP, H hidden, K top-K, E experts, R pairs of a flat routing.

Each rank's experts hold 1/P of every expert's ffn dimension (``experts.init_stacked_weights``: fc1's gate and up
rows alike, fc2's columns, as Megatron's ETP experts), so an expert's output is the sum over the ETP group of the
ranks' partial down-projections of the same rows. Megatron's alltoall dispatcher gets there by all-gathering the
dispatched rows over the ETP group after its expert-parallel all-to-all and reduce-scattering the experts' outputs
before the all-to-all back. The plugin's dispatch keeps a plan per rank (its receive metadata, its dedup), which
one rank cannot merge with another's, so the gather comes first instead, on this rank's tokens and routing:

    gather_routed: x [T, H], RouterOutput over T tokens  ->  x [P T, H], RouterOutput over P T tokens
                   (the ETP group's tokens in ETP-rank order, the same on every rank of the group)
    (the layer's mode: preprocess, dispatch over the EP group, experts on this rank's ffn shard, combine)
    sum_partials:  y [P T, H] (this rank's partial outputs of the gathered tokens)  ->  out [T, H]

The ranks of an ETP group hold the same expert ids (Megatron's expert grid puts ETP innermost), and each
dispatches the same gathered tokens and routing over its own EP group, whose other members hold their own ETP
groups' gathered tokens, identical across those groups' ranks too. So the EP groups of one ETP group's ranks see
the same token sets in the same rank order: every expert gets the same rows on each of its ETP shards, and token
rounding, decided over the EP group from the gathered routing, decides the same on all of them.

Autograd: the gather's backward reduce-scatters (sums over the ETP group: every rank's experts contribute a
partial dX and a partial score gradient), the sum's backward all-gathers dOut. These are Megatron's
sequence-parallel gather and reduce-scatter, the collectives of its own ETP path; the output is summed in fp32
when it is bf16/fp16, as Megatron sums it in the router's probability dtype (fp32 with ``--moe-router-dtype
fp32``).

Every rank of an ETP group must route the same number of tokens (sequence-parallel shards of one micro-batch, or
equal micro-batches where ETP spans data-parallel ranks): the gather is one equal-split collective, with no host
sync to read the sizes.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from .kernels import FlatRouting
from .router import RouterOutput


def _gather(t: torch.Tensor, group) -> torch.Tensor:
    """[n, ...] per rank -> [P n, ...] in group-rank order; backward: the gradient summed over the group and split."""
    return gather_from_sequence_parallel_region(t, group=group)


def gather_routed(x_TH: torch.Tensor, routed: RouterOutput, group) -> tuple[torch.Tensor, RouterOutput]:
    """This rank's tokens and routing -> the ETP group's (see the module docstring): top-K scores and indices,
    the dense probabilities token rounding ranks by, or a capacity-dropped flat routing, over ``P T`` tokens."""
    x = _gather(x_TH, group)
    dense = None if routed.dense_probs_TE is None else _gather(routed.dense_probs_TE, group)
    if routed.flat is not None:
        return x, RouterOutput(None, None, dense, flat=_gather_flat(routed.flat, group))
    return x, RouterOutput(_gather(routed.scores_TK, group), _gather(routed.indices_TK, group), dense)


def _gather_flat(flat: FlatRouting, group) -> FlatRouting:
    """A flat routing over this rank's T tokens -> over the group's P T tokens: rank p's token t becomes p T + t.
    Every rank's routing has the same pair count (Megatron's capacity bound of T tokens) and is sorted by token;
    a padded one ends in padding pairs (token T, expert E, score 0), which become token P T and move behind every
    real pair (a stable sort on the device: the real pairs' order is kept, and no host sync is needed)."""
    size, T = group.size(), flat.num_tokens
    tok = _gather(flat.token_idx_R, group)
    expert = _gather(flat.expert_idx_R, group)
    scores = _gather(flat.scores_R, group)
    src = torch.arange(size, device=tok.device, dtype=tok.dtype).repeat_interleave(flat.token_idx_R.shape[0])
    tok = torch.where(tok < T, tok + src * T, size * T)
    if flat.padded:
        order = torch.sort(tok, stable=True).indices
        tok, expert, scores = tok[order], expert[order], scores[order]
    return FlatRouting(tok, expert, scores, size * T, padded=flat.padded)


def sum_partials(y_PTH: torch.Tensor, group) -> torch.Tensor:
    """This rank's partial outputs of the group's gathered tokens [P T, H] -> the sum over the ETP group of this
    rank's own tokens' rows [T, H] (a reduce-scatter; bf16/fp16 partials are summed in fp32)."""
    if y_PTH.dtype in (torch.bfloat16, torch.float16):
        return reduce_scatter_to_sequence_parallel_region(y_PTH.float(), group=group).to(y_PTH.dtype)
    return reduce_scatter_to_sequence_parallel_region(y_PTH, group=group)
