"""Tile-aware token rounding per local expert shard (training only), decided consistently across EP ranks.

Shape legend: T tokens of this rank, E global experts, R routed pairs, M the tile (``TokenRounding.tile``),
P ranks of the EP group.

SonicMoE rounds each expert's row count to a multiple of the GEMM M tile. Under expert parallelism an
expert's rows come from all P source ranks, so the decision must be global:
  1. f_e = the global routed count of expert e (sum over ranks);
  2. t_e = f_e rounded to a multiple of M: ``nearest`` (round half to even on f_e / M, as SonicMoE's
     ``torch.round``, except that 0 < f_e <= M / 2 gives M: an expert top-K routed to is never emptied),
     ``up`` or ``down``; |t_e - f_e| < M. If nearest/up asks for more tokens than the group has (t_e > total
     tokens), t_e falls back to the multiple below;
  3. t_e < f_e: drop the f_e - t_e routed pairs of e with the lowest routing scores across the group;
     t_e > f_e: add the t_e - f_e tokens with the highest ``rounding_scores_TE[:, e]`` that did not route to e;
  4. each rank contributes its M lowest routed and M highest non-routed candidates per expert (enough,
     since fewer than M move); one all-gather of [P, E, 3 + 4M] float64 (counts, T, a duplicate-pair flag,
     scores and token ids), device to device, gives every rank the same candidate lists, and a stable sort
     gives the same cut everywhere with the tie-break (score, rank, token index) -- the order of the global
     token index on the concatenation, so the result equals single-process rounding of the concatenated
     tokens (``group=None``);
  5. dropped pairs vanish; added pairs take ``rounding_scores_TE[t, e]`` as their score (with autograd),
     kept pairs keep their routing score. A sort of the kept and added pairs' (token, expert) keys gives a
     padded routing of a host-known size (``rounded_pairs_bound``), real pairs first: ``round_routing_padded``
     (no host sync; ``make_plan``'s). ``round_routing`` reads the flags and the real pair count back (one host
     copy), raises for duplicates on every rank and returns the pairs unpadded.
Drops are ranked by the pair's routing score (e.g. the renormalised top-K prob), additions by the dense
router probability, as in SonicMoE's TC-first score matrix. Routed (token, expert) pairs must be unique.

For top-K routing on CUDA the plan takes the same decision in Triton kernels (``triton_round_ep.py``: the kernels of
rounding without expert parallelism, cut by the group's candidates), bitwise equal to ``round_routing_padded``.

Without expert parallelism (``round_local``) the same decision runs on the device with no host sync: one
per-expert top-n selection over int32 keys cuts every expert (on CUDA in four Triton launches and a scan,
``triton_round.py``), and the result is a padded ``FlatRouting`` whose size is an upper bound known on the host
(``rounded_pairs_bound``): its real pairs come first, padding pairs (token T, expert E, score 0) after them,
and the kernels skip those.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import torch

from ..kernels.routing import FlatRouting, TopKRouting
from .comm import all_gather, group_rank
from .validation import EPInputError, duplicate_pairs_message


class RoundingMode(enum.StrEnum):
    """Where token rounding takes each expert's count: the multiple of the tile nearest to it, above it or below
    it (``TARGET_RULES`` says exactly how)."""

    NEAREST = "nearest"
    UP = "up"
    DOWN = "down"


ROUNDING_MODES = tuple(mode.value for mode in RoundingMode)  # the names, for messages and argument choices
NO_ROUNDING = "none"  # SonicConfig.token_rounding's word for off; a TokenRounding is never off (pass None instead)


def check_mode(name: str, mode: object, *, off: str | None = None) -> None:
    """The one rule for a rounding mode (``TokenRounding.mode``; ``SonicConfig.token_rounding`` with ``off="none"``):
    one of ``ROUNDING_MODES`` (a ``RoundingMode`` or its name), or ``off`` where the caller has a word for no
    rounding. Raises ValueError naming ``name``, the allowed and the given value."""
    allowed = (*((off,) if off is not None else ()), *ROUNDING_MODES)
    if isinstance(mode, str) and mode in allowed:
        return
    hint = ""
    if off is None and mode == NO_ROUNDING:
        hint = "; for no token rounding pass rounding=None instead of a TokenRounding"
    raise ValueError(f"{name} must be one of {allowed}, got {mode!r} ({type(mode).__name__}){hint}")


def check_tile(name: str, tile: object) -> None:
    """The one rule for a rounding tile (``TokenRounding.tile``, ``SonicConfig.rounding_tile``): an int >= 1 that is
    not a bool (``bool`` subclasses ``int``: True would pass as 1). TypeError for another type, ValueError for a
    smaller int; both name ``name``, the rule and the given value."""
    if isinstance(tile, bool) or not isinstance(tile, int):
        raise TypeError(f"{name} must be an int >= 1, got {tile!r} ({type(tile).__name__})")
    if tile < 1:
        raise ValueError(f"{name} must be an int >= 1, got {tile!r}")


@dataclass(frozen=True)
class TargetRule:
    """How one mode rounds an expert's routed count f to a multiple of the tile M. With lo = f rounded down to a
    multiple of M and r = f - lo, the target is lo + M where

    * 2r > ``up_past_half_tiles`` * M (0: any remainder, 1: more than half a tile, 2: never), or
    * 2r == ``up_past_half_tiles`` * M and lo / M is odd, when ``ties_to_even`` (a remainder of exactly half a tile
      goes to the even multiple, as ``torch.round`` does), or
    * lo == 0 < f, when ``keep_one_tile`` (an expert that top-K routed to is never emptied),

    else lo. A target above the tokens available falls back to lo. Both implementations read these constants:
    ``round_targets`` (PyTorch) and ``triton_round._select_kernel`` (as constexpr arguments)."""

    up_past_half_tiles: int
    ties_to_even: bool
    keep_one_tile: bool


TARGET_RULES = {
    RoundingMode.NEAREST: TargetRule(up_past_half_tiles=1, ties_to_even=True, keep_one_tile=True),
    RoundingMode.UP: TargetRule(up_past_half_tiles=0, ties_to_even=False, keep_one_tile=False),
    RoundingMode.DOWN: TargetRule(up_past_half_tiles=2, ties_to_even=False, keep_one_tile=False),
}


@dataclass(frozen=True)
class TokenRounding:
    """Tile-aware token rounding per local expert shard (training only; pass ``None`` in evaluation).

    Attributes:
        mode: ``"nearest"`` (default; round each expert's global count to the nearest multiple of ``tile``,
            but never to 0: an expert with 0 < count <= tile / 2 is padded to one tile), ``"up"`` (always pad
            with the best non-routed tokens) or ``"down"`` (always drop the weakest pairs). The guard departs
            from SonicMoE's nearest rounding, which empties such experts: those experts then learn nothing
            from the micro-batch, and early in training many experts hold fewer than tile / 2 pairs. The guard
            measured a lower loss than SonicMoE's rule (docs/PERF.md, "Token rounding"). There is no ``"none"``
            mode: no rounding is ``rounding=None`` (``SonicConfig.token_rounding="none"`` maps to it).
        tile: the GEMM M tile the counts are rounded to (default 128, the Hopper kernels' M tile); an int >= 1,
            not a bool. Both are checked by the rules ``SonicConfig`` uses too (``check_mode``, ``check_tile``).
    """

    mode: str = "nearest"
    tile: int = 128

    def __post_init__(self) -> None:
        check_mode("TokenRounding.mode", self.mode)
        check_tile("TokenRounding.tile", self.tile)

    @property
    def rule(self) -> TargetRule:
        return TARGET_RULES[RoundingMode(self.mode)]


@dataclass(frozen=True)
class RoundingResult:
    """The rounded routing of this rank (flat, sorted by token then expert; padded after its real pairs where
    ``round_routing_padded`` returns it) and the global decision."""

    token_idx_R: torch.Tensor  # int64 [R']
    expert_idx_R: torch.Tensor  # int64 [R']
    scores_R: torch.Tensor  # [R'] routing-score dtype, with autograd
    counts_before_E: torch.Tensor  # int64 [E] global f_e
    counts_after_E: torch.Tensor  # int64 [E] global t_e
    dropped: torch.Tensor  # int64 scalar: pairs dropped on this rank (a tensor: reading it is a host sync)
    added: torch.Tensor  # int64 scalar: pairs added on this rank
    # int64/int32 [T + 1]: token t's real pairs are [token_offsets[t], token_offsets[t + 1]) where the rounding
    # produced them (the kernels' path; the plan's send side then reads them: ``send_side.build_send_side``), else None
    token_offsets: torch.Tensor | None = None


def round_targets(f_E: torch.Tensor, total_tokens: torch.Tensor, rounding: TokenRounding) -> torch.Tensor:
    """Every expert's target count t_e [E] int64 from its routed count f_e, by ``rounding.rule`` (``TargetRule``)."""
    M, rule = rounding.tile, rounding.rule
    q = torch.div(f_E, M, rounding_mode="floor")
    lo = q * M
    twice_r, edge = 2 * (f_E - lo), rule.up_past_half_tiles * M
    up = twice_r > edge
    if rule.ties_to_even:
        up = up | ((twice_r == edge) & (q % 2 == 1))
    if rule.keep_one_tile:
        up = up | ((lo == 0) & (f_E > 0))
    t = torch.where(up, lo + M, lo)
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

    Returns the rounded pairs unpadded. Host syncs: the candidate all-gather is device-to-device; ONE host copy
    reads every rank's duplicate flag (so that all ranks raise together) and this rank's rounded pair count (it
    sizes the result). ``make_plan`` calls ``round_routing_padded`` instead (no host sync: the duplicate flag
    rides in its header, the padding pairs are left out of its counts).
    """
    res, duplicates_P = round_routing_padded(
        token_idx_R, expert_idx_R, scores_R, rounding_scores_TE, num_experts=num_experts, rounding=rounding, group=group
    )
    real_R = res.expert_idx_R < num_experts  # padding pairs have expert E
    *dup_P, num_pairs = torch.cat([duplicates_P.long(), real_R.sum().reshape(1)]).tolist()  # the host sync
    if any(dup_P):
        raise EPInputError(duplicate_pairs_message([r for r, d in enumerate(dup_P) if d]))
    return replace(
        res,
        token_idx_R=res.token_idx_R[:num_pairs],
        expert_idx_R=res.expert_idx_R[:num_pairs],
        scores_R=res.scores_R[:num_pairs],
    )


def round_routing_padded(
    token_idx_R: torch.Tensor,
    expert_idx_R: torch.Tensor,
    scores_R: torch.Tensor,
    rounding_scores_TE: torch.Tensor,
    *,
    num_experts: int,
    rounding: TokenRounding,
    group=None,
) -> tuple[RoundingResult, torch.Tensor]:
    """``round_routing`` without a host sync: (the result with its pairs padded to ``rounded_pairs_bound(R, T, E,
    tile)``, every rank's duplicate-pair flag [P] float64 on the device). The real pairs come first, sorted by
    (token, expert) as ``round_routing``'s, then padding pairs (token T, expert E, score 0). Nothing checks the
    flags here: the caller must (``make_plan`` sends this rank's in its header). Arguments as ``round_routing``."""
    T, E, M = rounding_scores_TE.shape[0], num_experts, rounding.tile
    tok, exp = token_idx_R.long(), expert_idx_R.long()
    rank = group_rank(group)
    cand_EC, routed_TE = _candidates(tok, exp, scores_R, rounding_scores_TE, E, M)
    all_PE = all_gather(cand_EC, group)  # the one extra collective of rounding (device to device)

    f_E = all_PE[:, :, 0].sum(0).long()
    total_tokens = all_PE[:, 0, 1].sum().long()
    t_E = round_targets(f_E, total_tokens, rounding)
    delta_E = t_E - f_E
    C = _CAND_COLS
    drop_tok_EW = _cut(all_PE[:, :, C : C + M], all_PE[:, :, C + M : C + 2 * M], (-delta_E).clamp(min=0), False, rank)
    add_tok_EW = _cut(all_PE[:, :, C + 2 * M : C + 3 * M], all_PE[:, :, C + 3 * M :], delta_E.clamp(min=0), True, rank)
    # This rank's dropped pairs, marked in a dense [T + 1, E] (row T: the entries not taken).
    e_EW = torch.arange(E, device=tok.device).unsqueeze(1).expand_as(drop_tok_EW)
    dropped_TE = torch.zeros((T + 1, E), dtype=torch.bool, device=tok.device)
    dropped_TE[torch.where(drop_tok_EW >= 0, drop_tok_EW, T), e_EW] = True
    dropped_R = dropped_TE[tok, exp]
    added_EW = add_tok_EW >= 0
    # Keys token * (E + 1) + expert: kept pairs and this rank's added pairs; dropped / not taken ones get the pad.
    pad = T * (E + 1) + E
    keys = torch.cat(
        [
            torch.where(dropped_R, pad, tok * (E + 1) + exp),
            torch.where(added_EW, add_tok_EW * (E + 1) + e_EW, pad).reshape(-1),
        ]
    )
    scores_all = torch.cat([scores_R, _added_scores(rounding_scores_TE, add_tok_EW, scores_R.dtype)])
    rounded = _pairs_from_keys(keys, scores_all, T, E, rounded_pairs_bound(tok.numel(), T, E, M))
    result = RoundingResult(
        token_idx_R=rounded.token_idx_R,
        expert_idx_R=rounded.expert_idx_R,
        scores_R=rounded.scores_R,
        counts_before_E=f_E,
        counts_after_E=t_E,
        dropped=dropped_R.sum(),
        added=added_EW.sum(),
    )
    return result, all_PE[:, 0, 2]


# Candidate columns: count, T, duplicate-pair flag, then four blocks of M: drop scores, drop tokens, add scores,
# add tokens.
_CAND_COLS = 3


def _candidates(tok, exp, scores_R, rounding_scores_TE, E, M) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's row of the candidate all-gather [E, 3 + 4M] float64, the routed mask [T, E]): the routed
    count, T, the duplicate flag, the M lowest routed and the M highest non-routed candidates of each expert."""
    T, device, R = rounding_scores_TE.shape[0], rounding_scores_TE.device, tok.numel()
    # Dense routed mask. T x E is small next to the layer's activations.
    routed_TE = torch.zeros((T, E), dtype=torch.bool, device=device)
    routed_TE[tok, exp] = True
    counts_E = routed_TE.sum(0)

    k = min(M, T)
    inf = float("inf")
    # Drop candidates: lowest routed scores; a stable sort over tokens breaks ties by token index.
    drop_key_ET = torch.full((E, T), inf, dtype=torch.float64, device=device)
    drop_key_ET[exp, tok] = scores_R.detach().double()
    drop_s, drop_t = torch.sort(drop_key_ET, dim=1, stable=True)
    # Add candidates: highest dense scores among non-routed tokens (descending, ties by token index).
    add_key_ET = rounding_scores_TE.detach().double().t().masked_fill(routed_TE.t(), -inf)
    add_s, add_t = torch.sort(add_key_ET, dim=1, descending=True, stable=True)

    C = _CAND_COLS
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
    return pack, routed_TE


def _cut(scores_PEM, tokens_PEM, n_E, descending: bool, rank: int) -> torch.Tensor:
    """This rank's tokens among each expert's ``n_E`` first candidates of the group, [E, M - 1] (n_E < M), -1
    where a slot is not taken or another rank's. Candidates are in (rank, per-rank order) order: a stable sort on
    the score keeps (rank, token) for ties."""
    P, E, M = scores_PEM.shape
    s_E_PM = scores_PEM.permute(1, 0, 2).reshape(E, P * M)
    t_E_PM = tokens_PEM.permute(1, 0, 2).reshape(E, P * M)
    order = torch.sort(s_E_PM, dim=1, descending=descending, stable=True).indices[:, : M - 1]
    tok = t_E_PM.gather(1, order).long()
    take = torch.arange(M - 1, device=order.device)[None, :] < n_E[:, None]
    mine = take & (torch.div(order, M, rounding_mode="floor") == rank) & (tok >= 0)  # candidate j is rank j // M's
    return torch.where(mine, tok, -1)


def _added_scores(rounding_scores_TE: torch.Tensor, add_tok_EW: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The added pairs' scores [E * W] (dense probabilities, with autograd; any value where no pair is added)."""
    T, E = rounding_scores_TE.shape
    if T == 0:  # nothing to gather from (and nothing added)
        return torch.zeros(add_tok_EW.numel(), dtype=dtype, device=add_tok_EW.device)
    e_EW = torch.arange(E, device=add_tok_EW.device).unsqueeze(1).expand_as(add_tok_EW)
    return rounding_scores_TE[add_tok_EW.clamp(min=0), e_EW].reshape(-1).to(dtype)


# ---------------------------------------------------------------------------------------------------------
# Expert-parallel size 1: the same decision on the device, no host sync
# ---------------------------------------------------------------------------------------------------------


def rounded_pairs_bound(num_pairs: int, num_tokens: int, num_experts: int, tile: int) -> int:
    """Host-known upper bound on the rounded pair count: each expert gains fewer than ``tile`` pairs (and at
    most as many as it has non-routed tokens)."""
    return num_pairs + num_experts * min(tile - 1, num_tokens)


_INT32_MAX = torch.iinfo(torch.int32).max
_INT32_MIN = torch.iinfo(torch.int32).min


def _ordered32(values: torch.Tensor) -> torch.Tensor:
    """int32 that orders like the fp32 value (the sign-folded bits). Values are compared as fp32 (exact for
    bf16/fp16/fp32 scores)."""
    bits = values.detach().float().contiguous().view(torch.int32)
    return torch.where(bits < 0, bits ^ _INT32_MAX, bits)


def top_n_rows_torch(key_ET: torch.Tensor, n_E: torch.Tensor, width: int) -> tuple[torch.Tensor, ...]:
    """Each row's ``n_E`` largest int32 keys, ties to the lower token: (thr [E], cut [E], tokens [E, width]
    ascending, -1 past n); the selected set is ``key > thr`` or ``key == thr and token <= cut`` (thr = INT32_MAX,
    cut = -1 where n = 0)."""
    E, T = key_ET.shape
    device = key_ET.device
    k = min(width, T)
    thr = torch.full((E,), _INT32_MAX, dtype=torch.int32, device=device)
    cut = torch.full((E,), -1, dtype=torch.int32, device=device)
    out = torch.full((E, width), -1, dtype=torch.int32, device=device)
    if k == 0:
        return thr, cut, out
    # One int64 key per entry orders like (key, -token) and never ties: top-k is the stable order's prefix.
    token_1T = torch.arange(T, device=device).unsqueeze(0)
    full_ET = (key_ET.long() << 32) | ((1 << 32) - 1 - token_1T)
    tok_Ek = torch.topk(full_ET, k, dim=1, largest=True, sorted=True).indices
    last = (n_E.long() - 1).clamp(min=0).unsqueeze(1)
    some = n_E > 0
    thr = torch.where(some, key_ET.gather(1, tok_Ek.gather(1, last)).squeeze(1), thr)
    cut = torch.where(some, tok_Ek.gather(1, last).squeeze(1).int(), cut)
    chosen_Ek = torch.arange(k, device=device).unsqueeze(0) < n_E.unsqueeze(1)
    tokens = torch.where(chosen_Ek, tok_Ek, T).sort(dim=1).values
    out[:, :k] = torch.where(tokens < T, tokens, -1).int()
    return thr, cut, out


def round_local(
    routing: TopKRouting, rounding_scores_TE: torch.Tensor, *, num_experts: int, rounding: TokenRounding
) -> FlatRouting:
    """``round_routing(..., group=None)`` on the device without a host sync (same pairs, same order, same
    scores for fp32 / 16-bit scores), as a padded ``FlatRouting`` of ``rounded_pairs_bound`` pairs: four Triton
    launches and a scan on CUDA (``triton_round.py``; for K <= 126, E <= 4096, scores of at most 32 bits and fewer
    than 2^30 pairs), which also hand the experts their metadata; ``round_local_torch`` elsewhere.

    Args:
        routing: top-K routing over the E experts, one process (scores [T, K], distinct indices per row).
        rounding_scores_TE: dense router probabilities [T, E] (ranks additions; added pairs take them as scores).
        num_experts: E.  rounding: the mode and tile.
    """
    T, K = routing.indices_TK.shape
    narrow = routing.scores_TK.dtype != torch.float64 and rounding_scores_TE.dtype != torch.float64
    small = 2 * rounded_pairs_bound(T * K, T, num_experts, rounding.tile) < 2**31  # the kernels' int32 scan
    if routing.indices_TK.is_cuda and T * K > 0 and K <= 126 and num_experts <= 4096 and narrow and small:
        try:
            from .triton_round import round_local_triton
        except ImportError:
            pass
        else:
            return round_local_triton(routing, rounding_scores_TE, num_experts, rounding.mode, rounding.tile)
    return round_local_torch(routing, rounding_scores_TE, num_experts=num_experts, rounding=rounding)


def round_local_torch(
    routing: TopKRouting, rounding_scores_TE: torch.Tensor, *, num_experts: int, rounding: TokenRounding
) -> FlatRouting:
    """The reference of ``round_local`` in PyTorch ops (and its path off CUDA).

    Args:
        routing: top-K routing over the E experts, one process (scores [T, K], distinct indices per row).
        rounding_scores_TE: dense router probabilities [T, E] (ranks additions; added pairs take them as scores).
        num_experts: E.  rounding: the mode and tile.

    Each expert either drops or adds pairs, never both, so one key matrix [E, T] holds both cuts: for an
    expert that adds, its non-routed tokens keyed by dense score; for one that drops, its routed tokens keyed by
    the reversed routing score. One per-row top-n selection (``top_n_rows_torch``) then cuts every expert at once;
    dropped pairs are recognised in [T, K] from the cut, added ones come as token lists. A sort of the kept and
    added pairs' (token, expert) keys gives the reference's token-major order, padding last.
    """
    idx_TK, scores_TK = routing.indices_TK.long(), routing.scores_TK
    T, K = idx_TK.shape
    E, M, device = num_experts, rounding.tile, idx_TK.device
    # index_add_, not bincount: bincount reads max() back to the host on CUDA.
    f_E = torch.zeros(E, dtype=torch.int64, device=device).index_add_(
        0, idx_TK.reshape(-1), torch.ones(T * K, dtype=torch.int64, device=device)
    )
    delta_E = round_targets(f_E, torch.full_like(f_E, T), rounding) - f_E
    adds_E = delta_E > 0
    adds_TK = adds_E[idx_TK]
    # Keys: int32 ordering like the score; ~key reverses the order (the lowest routing score is the largest).
    routed_key_TK = torch.where(adds_TK, _INT32_MIN, ~_ordered32(scores_TK))
    key_TE = torch.where(adds_E.unsqueeze(0), _ordered32(rounding_scores_TE), _INT32_MIN)
    key_TE.scatter_(1, idx_TK, routed_key_TK)
    W = min(M - 1, T)
    thr_E, cut_E, add_tok_EW = top_n_rows_torch(key_TE.t().contiguous(), delta_E.abs(), W)

    token_TK = torch.arange(T, device=device).unsqueeze(1)
    thr_TK, cut_TK = thr_E[idx_TK], cut_E[idx_TK]
    dropped_TK = (routed_key_TK > thr_TK) | ((routed_key_TK == thr_TK) & (token_TK <= cut_TK))
    expert_EW = torch.arange(E, device=device).unsqueeze(1).expand(E, W)
    added_EW = adds_E.unsqueeze(1) & (add_tok_EW >= 0)
    add_tok_EW = add_tok_EW.long().clamp(min=0)
    # (token, expert) keys, padding (T, E) for dropped pairs and empty slots.
    pad = T * (E + 1) + E
    pair_keys = torch.cat(
        [
            torch.where(dropped_TK, pad, token_TK * (E + 1) + idx_TK).reshape(-1),
            torch.where(added_EW, add_tok_EW * (E + 1) + expert_EW, pad).reshape(-1),
        ]
    )
    scores_all = torch.cat(
        [scores_TK.reshape(-1), rounding_scores_TE[add_tok_EW, expert_EW].reshape(-1).to(scores_TK.dtype)]
    )
    return _pairs_from_keys(pair_keys, scores_all, T, E, pair_keys.numel())


def _pairs_from_keys(
    keys: torch.Tensor, scores: torch.Tensor, num_tokens: int, num_experts: int, num_pairs: int
) -> FlatRouting:
    """The padded ``FlatRouting`` of pairs given as keys token * (E + 1) + expert (the pad key T * (E + 1) + E for
    a dropped pair or an empty slot) with their ``scores``: sorted by key -- the reference's token-major order,
    padding (token T, expert E, score 0) last -- and cut to ``num_pairs`` (at least the real pair count). The last
    step of both ``round_routing_padded`` and ``round_local_torch``."""
    T, E = num_tokens, num_experts
    pad = T * (E + 1) + E
    key_dtype = torch.int32 if pad <= _INT32_MAX else torch.int64  # int32 sorts faster where it fits
    sorted_R, order_R = torch.sort(keys.to(key_dtype))
    sorted_R, order_R = sorted_R[:num_pairs].long(), order_R[:num_pairs]
    valid_R = sorted_R < pad
    score_R = torch.where(valid_R, scores[order_R], torch.zeros((), dtype=scores.dtype, device=scores.device))
    tok_R = torch.div(sorted_R, E + 1, rounding_mode="floor")
    exp_R = sorted_R - tok_R * (E + 1)
    return FlatRouting(tok_R, exp_R, score_R, T, padded=True)
