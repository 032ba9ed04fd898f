"""Tile-aware token rounding per local expert shard (training only), decided consistently across EP ranks.

Shape legend: T tokens of this rank, E global experts, R routed pairs, M the tile (``TokenRounding.tile``),
P ranks of the EP group.

SonicMoE rounds each expert's row count to a multiple of the GEMM M tile. Under expert parallelism an
expert's rows come from all P source ranks, so the decision must be global:
  1. f_e = the global routed count of expert e (sum over ranks);
  2. t_e = f_e rounded to a multiple of M: ``nearest`` (round half to even on f_e / M, as SonicMoE's
     ``torch.round``), ``up`` or ``down``; |t_e - f_e| < M. If nearest/up asks for more tokens than the
     group has (t_e > total tokens), t_e falls back to the multiple below;
  3. t_e < f_e: drop the f_e - t_e routed pairs of e with the lowest routing scores across the group;
     t_e > f_e: add the t_e - f_e tokens with the highest ``rounding_scores_TE[:, e]`` that did not route to e;
  4. each rank contributes its M lowest routed and M highest non-routed candidates per expert (enough,
     since fewer than M move); one all-gather of [P, E, 3 + 4M] float64 (counts, T, a duplicate-pair flag,
     scores and token ids)
     gives every rank the same candidate lists, and a stable sort gives the same cut everywhere with the
     tie-break (score, rank, token index) -- the order of the global token index on the concatenation, so
     the result equals single-process rounding of the concatenated tokens (``group=None``);
  5. dropped pairs vanish; added pairs take ``rounding_scores_TE[t, e]`` as their score (with autograd),
     kept pairs keep their routing score.
Drops are ranked by the pair's routing score (e.g. the renormalised top-K prob), additions by the dense
router probability, as in SonicMoE's TC-first score matrix. Routed (token, expert) pairs must be unique.

Without expert parallelism (``round_local``) the same decision runs on the device with no host sync: the
candidates come from one ``topk`` per direction over integer keys that order like (score, token), and the
result is a padded ``FlatRouting`` whose size is an upper bound known on the host (``rounded_pairs_bound``):
its real pairs come first, padding pairs (token T, expert E, score 0) after them, and the kernels skip those.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.routing import FlatRouting, TopKRouting
from .comm import all_gather, group_rank, group_size
from .validation import EPInputError

ROUNDING_MODES = ("nearest", "up", "down")


@dataclass(frozen=True)
class TokenRounding:
    """Tile-aware token rounding per local expert shard (training only; pass ``None`` in evaluation).

    Attributes:
        mode: ``"nearest"`` (default; round each expert's global count to the nearest multiple of ``tile``),
            ``"up"`` (always pad with the best non-routed tokens) or ``"down"`` (always drop the weakest pairs).
        tile: the GEMM M tile the counts are rounded to (default 128, the Hopper kernels' M tile).
    """

    mode: str = "nearest"
    tile: int = 128

    def __post_init__(self) -> None:
        if self.mode not in ROUNDING_MODES:
            raise ValueError(f"TokenRounding.mode must be one of {ROUNDING_MODES}, got {self.mode!r}")
        if not isinstance(self.tile, int) or self.tile < 1:
            raise ValueError(f"TokenRounding.tile must be an int >= 1, got {self.tile!r}")


@dataclass(frozen=True)
class RoundingResult:
    """The rounded routing of this rank (flat, sorted by token then expert) and the global decision."""

    token_idx_R: torch.Tensor  # int64 [R']
    expert_idx_R: torch.Tensor  # int64 [R']
    scores_R: torch.Tensor  # [R'] routing-score dtype, with autograd
    counts_before_E: torch.Tensor  # int64 [E] global f_e
    counts_after_E: torch.Tensor  # int64 [E] global t_e
    dropped: torch.Tensor  # int64 scalar: pairs dropped on this rank (a tensor: reading it is a host sync)
    added: torch.Tensor  # int64 scalar: pairs added on this rank


def _targets(f_E: torch.Tensor, total_tokens: torch.Tensor, rounding: TokenRounding) -> torch.Tensor:
    M = rounding.tile
    lo = torch.div(f_E, M, rounding_mode="floor") * M
    if rounding.mode == "down":
        return lo
    up = torch.where(f_E % M == 0, f_E, lo + M)
    t = up if rounding.mode == "up" else torch.round(f_E.double() / M).long() * M
    return torch.where(t > total_tokens, lo, t)


def round_routing(
    token_idx_R: torch.Tensor,
    expert_idx_R: torch.Tensor,
    scores_R: torch.Tensor,
    rounding_scores_TE: torch.Tensor,
    *,
    num_experts: int,
    rounding: TokenRounding,
    group=None,
) -> RoundingResult:
    """Round this rank's routing so that every expert's global count is a multiple of ``rounding.tile``.

    Args:
        token_idx_R, expert_idx_R, scores_R: this rank's routed pairs (flat, tokens in [0, T)).
        rounding_scores_TE: dense router probabilities [T, E] (ranks additions, gives added pairs' scores).
        num_experts: E.
        rounding: the mode and tile.
        group: EP process group (``None``: single process, i.e. the reference on concatenated tokens).

    Host syncs: the candidate all-gather is device-to-device; reading the duplicate flags of all ranks
    back (a few bytes, so that all ranks raise together) and the rounded pair count (``nonzero``: it sizes
    the dispatch buffers) are the syncs.
    """
    T, E, M = rounding_scores_TE.shape[0], num_experts, rounding.tile
    P, rank = group_size(group), group_rank(group)
    device = rounding_scores_TE.device
    tok, exp = token_idx_R.long(), expert_idx_R.long()
    R = tok.numel()
    # Dense pair index (-1: not routed). T x E int64 is small next to the layer's activations.
    pidx_TE = torch.full((T, E), -1, dtype=torch.int64, device=device)
    pidx_TE[tok, exp] = torch.arange(R, device=device)
    routed_TE = pidx_TE >= 0
    counts_E = routed_TE.sum(0)

    k = min(M, T)
    s_routed = scores_R.detach().double()
    inf = float("inf")
    # Drop candidates: lowest routed scores; a stable sort over tokens breaks ties by token index.
    drop_key_ET = torch.full((E, T), inf, dtype=torch.float64, device=device)
    drop_key_ET[exp, tok] = s_routed
    drop_s, drop_t = torch.sort(drop_key_ET, dim=1, stable=True)
    # Add candidates: highest dense scores among non-routed tokens (descending, ties by token index).
    add_key_ET = rounding_scores_TE.detach().double().t().masked_fill(routed_TE.t(), -inf)
    add_s, add_t = torch.sort(add_key_ET, dim=1, descending=True, stable=True)

    # Columns: count, T, duplicate-pair flag, then four blocks of M: drop scores, drop tokens, add scores,
    # add tokens.
    C = 3
    pack = torch.full((E, C + 4 * M), -1.0, dtype=torch.float64, device=device)
    pack[:, 0] = counts_E.double()
    pack[:, 1] = float(T)
    pack[:, 2] = (counts_E.sum() != R).double()  # routed (token, expert) pairs must be unique
    j = torch.arange(k, device=device)
    drop_valid = j[None, :] < counts_E[:, None]
    add_valid = j[None, :] < (T - counts_E)[:, None]
    pack[:, C : C + M] = inf
    pack[:, C : C + k] = torch.where(drop_valid, drop_s[:, :k], inf)
    pack[:, C + M : C + M + k] = torch.where(drop_valid, drop_t[:, :k].double(), -1.0)
    pack[:, C + 2 * M : C + 3 * M] = -inf
    pack[:, C + 2 * M : C + 2 * M + k] = torch.where(add_valid, add_s[:, :k], -inf)
    pack[:, C + 3 * M : C + 3 * M + k] = torch.where(add_valid, add_t[:, :k].double(), -1.0)
    all_PE = all_gather(pack, group)  # the one extra collective of rounding

    f_E = all_PE[:, :, 0].sum(0).long()
    total_tokens = all_PE[:, 0, 1].sum().long()
    t_E = _targets(f_E, total_tokens, rounding)
    delta_E = t_E - f_E

    def cut(scores_P_EM, tokens_P_EM, descending, n_E):
        # Candidates in (rank, per-rank order) order; a stable sort on score keeps (rank, token) for ties.
        s_E_PM = scores_P_EM.permute(1, 0, 2).reshape(E, P * M)
        t_E_PM = tokens_P_EM.permute(1, 0, 2).reshape(E, P * M)
        r_E_PM = torch.arange(P, device=device).repeat_interleave(M).expand(E, P * M)
        order = torch.sort(s_E_PM, dim=1, descending=descending, stable=True).indices
        take = torch.arange(P * M, device=device)[None, :] < n_E[:, None]
        mine = take & (r_E_PM.gather(1, order) == rank)
        sel_tok = t_E_PM.gather(1, order).long()
        e_idx = torch.arange(E, device=device)[:, None].expand(E, P * M)
        mask_TE = torch.zeros((T + 1, E), dtype=torch.bool, device=device)
        # Entries not selected go to the spare row T (then cut off), keeping this free of host syncs.
        rows = torch.where(mine, sel_tok, torch.full_like(sel_tok, T))
        mask_TE[rows.reshape(-1), e_idx.reshape(-1)] = True
        return mask_TE[:T]

    dup_P = all_PE[:, 0, 2].tolist()  # host sync (tiny): every rank must see a bad rank and raise with it
    if any(dup_P):
        bad = [r for r, d in enumerate(dup_P) if d]
        raise EPInputError(
            f"token rounding: the routed (token, expert) pairs of rank(s) {bad} must be unique, got duplicates"
        )
    drop_TE = cut(all_PE[:, :, C : C + M], all_PE[:, :, C + M : C + 2 * M], False, (-delta_E).clamp(min=0))
    add_TE = cut(all_PE[:, :, C + 2 * M : C + 3 * M], all_PE[:, :, C + 3 * M :], True, delta_E.clamp(min=0))
    keep_TE = routed_TE & ~drop_TE
    final_TE = keep_TE | add_TE
    # Host sync: the rounded pair count sizes everything downstream.
    new_tok, new_exp = final_TE.nonzero(as_tuple=True)
    added = add_TE[new_tok, new_exp]
    kept_scores = scores_R[pidx_TE[new_tok, new_exp].clamp(min=0)]
    added_scores = rounding_scores_TE[new_tok, new_exp].to(scores_R.dtype)
    new_scores = torch.where(added, added_scores, kept_scores)
    return RoundingResult(
        token_idx_R=new_tok,
        expert_idx_R=new_exp,
        scores_R=new_scores,
        counts_before_E=f_E,
        counts_after_E=t_E,
        dropped=drop_TE.sum(),
        added=added.sum(),
    )


# ---------------------------------------------------------------------------------------------------------
# Expert-parallel size 1: the same decision on the device, no host sync
# ---------------------------------------------------------------------------------------------------------


def rounded_pairs_bound(num_pairs: int, num_tokens: int, num_experts: int, tile: int) -> int:
    """Host-known upper bound on the rounded pair count: each expert gains fewer than ``tile`` pairs (and at
    most as many as it has non-routed tokens)."""
    return num_pairs + num_experts * min(tile - 1, num_tokens)


def _ordered_key(values: torch.Tensor) -> torch.Tensor:
    """int64 that orders like the fp32 value (integer order of the sign-folded bits), shifted left by 32 so a
    token index fits below it. Values are compared as fp32 (exact for bf16/fp16/fp32 scores)."""
    bits = values.detach().float().contiguous().view(torch.int32).long()
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return ordered << 32


def round_local(
    routing: TopKRouting, rounding_scores_TE: torch.Tensor, *, num_experts: int, rounding: TokenRounding
) -> FlatRouting:
    """``round_routing(..., group=None)`` on the device without a host sync (same pairs, same order, same
    scores for fp32 / 16-bit scores), as a padded ``FlatRouting`` of ``rounded_pairs_bound`` pairs.

    Args:
        routing: top-K routing over the E experts, one process (scores [T, K], distinct indices per row).
        rounding_scores_TE: dense router probabilities [T, E] (ranks additions; added pairs take them as scores).
        num_experts: E.  rounding: the mode and tile.
    """
    idx_TK, scores_TK = routing.indices_TK.long(), routing.scores_TK
    T, K = idx_TK.shape
    E, M, device = num_experts, rounding.tile, idx_TK.device
    routed_TE = torch.zeros(T, E, dtype=torch.bool, device=device).scatter_(1, idx_TK, True)
    f_E = routed_TE.sum(0)
    delta_E = _targets(f_E, torch.full_like(f_E, T), rounding) - f_E
    k = min(M, T)
    # Keys [E, T] (contiguous along tokens: one top-k per expert row). A key orders like (score, token) and
    # never ties, so top-k's result is the stable sort's prefix: ties go to the lower token, as the reference.
    routed_ET = routed_TE.t()
    token_1T = torch.arange(T, device=device).unsqueeze(0)
    routed_scores_TE = torch.zeros(T, E, dtype=scores_TK.dtype, device=device).scatter(1, idx_TK, scores_TK)
    int64 = torch.iinfo(torch.int64)
    # Drop candidates: the k lowest routed scores per expert.
    drop_key_ET = torch.where(routed_ET, _ordered_key(routed_scores_TE.t()) | token_1T, int64.max)
    drop_tok_Ek = torch.topk(drop_key_ET, k, dim=1, largest=False, sorted=True).indices
    # Add candidates: the k highest dense scores among non-routed tokens.
    add_key_ET = torch.where(routed_ET, int64.min, _ordered_key(rounding_scores_TE.t()) | ((1 << 32) - 1 - token_1T))
    add_tok_Ek = torch.topk(add_key_ET, k, dim=1, largest=True, sorted=True).indices
    rank_1k = torch.arange(k, device=device).unsqueeze(0)
    expert_Ek = torch.arange(E, device=device).unsqueeze(1).expand(E, k)
    true = torch.ones((), dtype=torch.bool, device=device)  # a fill, not a host-to-device copy (which would wait)

    def mark(tok_Ek: torch.Tensor, n_E: torch.Tensor) -> torch.Tensor:
        rows = torch.where(rank_1k < n_E.unsqueeze(1), tok_Ek, T)  # unselected candidates go to the spare row T
        return torch.zeros(T + 1, E, dtype=torch.bool, device=device).index_put_((rows, expert_Ek), true)[:T]

    drop_TE = mark(drop_tok_Ek, (-delta_E).clamp(min=0))
    add_TE = mark(add_tok_Ek, delta_E.clamp(min=0))
    final_TE = (routed_TE & ~drop_TE) | add_TE
    bound = rounded_pairs_bound(T * K, T, E, M)
    pairs_R2 = torch.nonzero_static(final_TE, size=bound, fill_value=-1)  # token-major, like nonzero()
    valid_R = pairs_R2[:, 0] >= 0
    tok_R = torch.where(valid_R, pairs_R2[:, 0], T)
    exp_R = torch.where(valid_R, pairs_R2[:, 1], E)
    flat_R = pairs_R2[:, 0].clamp(min=0) * E + pairs_R2[:, 1].clamp(min=0)
    kept_R = routed_scores_TE.reshape(-1).gather(0, flat_R)
    added_R = rounding_scores_TE.reshape(-1).gather(0, flat_R).to(scores_TK.dtype)
    score_R = torch.where(add_TE.reshape(-1).gather(0, flat_R), added_R, kept_R)
    score_R = torch.where(valid_R, score_R, torch.zeros((), dtype=score_R.dtype, device=device))
    return FlatRouting(tok_R, exp_R, score_R, T, padded=True)
