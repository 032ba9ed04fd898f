"""Token rounding under expert parallelism in the kernels of rounding without it (``triton_round.py``), cut by a
decision the group shares, with no host sync (``rounding.round_ep``'s path for top-K routing on CUDA;
``rounding.round_routing_padded`` is the reference, with the same pairs, order and scores).

Shape legend: T tokens of this rank, K experts per token, E global experts, P ranks, M the tile, C = M - 1 the
most pairs one expert moves (each rank sends its best C candidates of each expert).

An expert's count is global (the sum over ranks), so is its cut: the n = |t_e - f_e| best candidates of the group,
ties to the lower global token index (the token's index on the concatenation of the ranks' tokens, as the
reference's). Each rank's best n of them are enough to find the group's:
1. ``_keys_kernel`` (as without EP) builds the keys and routed flags [E, T], and adds each expert's routed count
   and the distinct routed pairs into this rank's stats [E + 2] = (counts, T, distinct pairs - pairs naming an
   expert in range: nonzero if a token names an expert twice); one all-gather of the stats [P, E + 2].
2. ``_candidates_kernel`` (grid: experts): the global f_e, t_e and n (``TargetRule``), this rank's best
   min(n, its side's size) keys by ``_search_cut``, written as int64 candidates key << 32 | (2^32 - 1 - global token)
   -- one int64 order for (key, then the lower global token) -- into [E, C], the rest INT64_MIN; one all-gather.
3. ``torch.topk`` over each expert's P * C candidates (sorted): the n-th best is the group's cut.
4. ``_apply_kernel`` (grid: experts): this rank's (thr, cut) from the n-th best, ``_apply_cut`` as without EP,
   this rank's rows of the expert into the scan; the global f_e and t_e and this rank's dropped and added pairs
   into the stats the ``RoundingResult`` reports.
5. The scan and the placing and scores kernels of ``triton_round.py``: a padded ``FlatRouting`` of
   ``rounded_pairs_bound`` pairs, real pairs first, with autograd to the routing scores and dense probabilities.
Five Triton kernels, a topk and two all-gathers (device to device) in place of the reference's sorts over
[experts, tokens] and its per-expert PyTorch ops. Scores are compared at fp32 (exact for 32-bit and narrower scores;
wider ones take the reference).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..kernels.routing import FlatRouting, TopKRouting
from .comm import all_gather, group_rank, group_size
from .rounding import TARGET_RULES, RoundingMode, RoundingResult, rounded_pairs_bound
from .triton_round import (
    _apply_cut,
    _expert_rows,
    _keep_row,
    _search_cut,
    _target,
    launch_keys,
    rounded_routing,
    row_buffers,
    row_pass_args,
)

_INT64_MIN = -(2**63)
_CAND_BLOCK = 128  # candidates written per step of the sentinel fill


@triton.jit
def _group_decision(
    stats_ptr,
    e,
    rank,
    P,
    E,
    UP_PAST_HALF_TILES: tl.constexpr,
    TIES_TO_EVEN: tl.constexpr,
    KEEP_ONE_TILE: tl.constexpr,
    TILE: tl.constexpr,
):
    """Expert e's decision from the all-gathered stats [P, E + 2]: (f_e, the group's routed count; t_e, its target;
    this rank's first global token; this rank's routed count of e)."""
    f = tl.zeros([], dtype=tl.int64)
    total = tl.zeros([], dtype=tl.int64)
    first = tl.zeros([], dtype=tl.int64)
    for p in range(0, P):
        row = stats_ptr + p * (E + 2)
        f += tl.load(row + e)
        tokens = tl.load(row + E)
        total += tokens
        first += tl.where(p < rank, tokens, 0)
    target = _target(f, total, UP_PAST_HALF_TILES, TIES_TO_EVEN, KEEP_ONE_TILE, TILE)
    return f, target, first, tl.load(stats_ptr + rank * (E + 2) + e)


@triton.jit
def _candidates_kernel(
    key_ptr,
    routed_ptr,
    stats_ptr,
    cand_ptr,
    rank,
    P,
    E,
    T,
    C,
    UP_PAST_HALF_TILES: tl.constexpr,
    TIES_TO_EVEN: tl.constexpr,
    KEEP_ONE_TILE: tl.constexpr,
    TILE: tl.constexpr,
    T_BITS: tl.constexpr,
    BT: tl.constexpr,
    IN_REGS: tl.constexpr,
    SB: tl.constexpr,
    PB: tl.constexpr,
    CB: tl.constexpr,
):
    e = tl.program_id(0)
    row_key, row_routed, _, _ = _expert_rows(key_ptr, routed_ptr, key_ptr, e, T, PB)
    row_cand = cand_ptr + e.to(tl.int64) * C
    f, target, first, mine = _group_decision(
        stats_ptr, e, rank, P, E, UP_PAST_HALF_TILES, TIES_TO_EVEN, KEEP_ONE_TILE, TILE
    )
    delta = target - f
    want = delta < 0  # drop: among the routed tokens; add: among the others
    n = tl.minimum(tl.abs(delta), tl.where(want, mine, T - mine)).to(tl.int32)
    written = tl.zeros([], dtype=tl.int32)
    if n > 0:
        thr, cut = _search_cut(row_key, row_routed, want, n, T, T_BITS, BT, IN_REGS, SB)
        for s0 in range(0, T, SB):
            t = s0 + tl.arange(0, SB)
            routed = tl.load(row_routed + t, mask=t < T, other=0) > 0
            raw = tl.load(row_key + t, mask=t < T, other=0)
            k = (raw ^ -2147483648).to(tl.uint32, bitcast=True)
            sel = (routed == want) & ((k > thr) | ((k == thr) & (t <= cut))) & (t < T)
            at = written + tl.cumsum(sel.to(tl.int32), axis=0) - 1
            value = (raw.to(tl.int64) << 32) | (4294967295 - (first + t))
            tl.store(row_cand + at, value, mask=sel)
            written += tl.sum(sel.to(tl.int32), axis=0)
    for w0 in range(0, C, CB):
        w = w0 + tl.arange(0, CB)
        tl.store(row_cand + w, tl.zeros([CB], dtype=tl.int64) - 9223372036854775807 - 1, mask=(w >= written) & (w < C))


@triton.jit
def _apply_kernel(
    key_ptr,
    routed_ptr,
    stats_ptr,
    best_ptr,
    offsets_ptr,
    prefix_ptr,
    report_ptr,
    rank,
    P,
    E,
    T,
    C,
    UP_PAST_HALF_TILES: tl.constexpr,
    TIES_TO_EVEN: tl.constexpr,
    KEEP_ONE_TILE: tl.constexpr,
    TILE: tl.constexpr,
    T_BITS: tl.constexpr,
    BT: tl.constexpr,
    IN_REGS: tl.constexpr,
    SB: tl.constexpr,
    PB: tl.constexpr,
):
    e = tl.program_id(0)
    row_key, row_routed, NB, row_prefix = _expert_rows(key_ptr, routed_ptr, prefix_ptr, e, T, PB)
    f, target, first, mine = _group_decision(
        stats_ptr, e, rank, P, E, UP_PAST_HALF_TILES, TIES_TO_EVEN, KEEP_ONE_TILE, TILE
    )
    delta = target - f
    want = delta < 0
    n = tl.abs(delta)
    mine = mine.to(tl.int32)
    tl.store(report_ptr + e, f)
    tl.store(report_ptr + E + e, target)
    if n > 0:
        # the group's n-th best candidate (sorted descending by topk): key in the high half, global token below
        best = tl.load(best_ptr + e.to(tl.int64) * C + n - 1)
        thr = ((best >> 32).to(tl.int32) ^ -2147483648).to(tl.uint32, bitcast=True)
        cut = (4294967295 - (best & 4294967295)) - first  # the last cut token's index on this rank
        cut = tl.minimum(tl.maximum(cut, -1), T).to(tl.int32)
        rows = _apply_cut(row_key, row_routed, offsets_ptr, row_prefix, NB, want, delta, thr, cut, T, SB, PB)
        moved = tl.where(want, mine - rows, rows - mine).to(tl.int64)
        tl.atomic_add(report_ptr + 2 * E + tl.where(want, 0, 1), moved, sem="relaxed")
    else:
        rows = _keep_row(row_routed, row_prefix, NB, T, SB, PB)
    tl.store(offsets_ptr + T + 2 + e, rows)  # this rank's rows of the expert, scanned after the tokens' counts


@functools.lru_cache(maxsize=64)
def _stats_template(E: int, T: int, device: torch.device) -> torch.Tensor:
    """This rank's stats before the keys kernel adds into them: zero counts, T (read only: callers clone it)."""
    return torch.tensor([0] * E + [T, 0], dtype=torch.int64).to(device)


def round_ep_triton(
    routing: TopKRouting, dense_TE: torch.Tensor, *, num_experts: int, mode: str, tile: int, group
) -> tuple[RoundingResult, torch.Tensor]:
    """``round_routing_padded`` of a [T, K] top-K routing in the kernels (module docstring): (the result, every
    rank's duplicate-pair flag [P] on the device). T may be 0 (the rank still joins both all-gathers); E >= 1,
    scores and dense probabilities of at most 32 bits."""
    idx_TK, scores_TK, dense_TE = routing.indices_TK.contiguous(), routing.scores_TK.contiguous(), dense_TE.contiguous()
    T, K = idx_TK.shape
    E, C, device = num_experts, max(tile - 1, 1), idx_TK.device
    rank, P = group_rank(group), group_size(group)
    rule = TARGET_RULES[RoundingMode(mode)]
    rules = dict(
        UP_PAST_HALF_TILES=rule.up_past_half_tiles,
        TIES_TO_EVEN=rule.ties_to_even,
        KEEP_ONE_TILE=rule.keep_one_tile,
        TILE=tile,
    )
    # a rank without tokens still launches the per-expert kernels (nothing of its rows is read): buffers of one
    # token, so that no kernel argument is an empty tensor's null pointer
    key_ET, routed_ET, scan, prefix_EB = row_buffers(max(T, 1), E, device)
    # 1. keys and flags; this rank's stats: counts [E], T, distinct routed pairs - pairs in range
    stats = _stats_template(E, T, device).clone()
    if T > 0:
        scan.zero_()
        launch_keys(idx_TK, scores_TK, dense_TE, key_ET, routed_ET, scan, counts=stats)
    stats_PS = all_gather(stats, group)
    # 2. this rank's best candidates of each expert
    passes = row_pass_args(max(T, 1))
    cand_EC = torch.empty(E, C, dtype=torch.int64, device=device)
    _candidates_kernel[(E,)](key_ET, routed_ET, stats_PS, cand_EC, rank, P, E, T, C, **rules, **passes, CB=_CAND_BLOCK)
    cand_PEC = all_gather(cand_EC, group)
    # 3. the group's best C of each expert, best first (values are unique but for the INT64_MIN fill)
    best_EC = torch.topk(cand_PEC.permute(1, 0, 2).reshape(E, P * C), C, dim=1, sorted=True).values
    # 4. this rank's cut; report = f [E], t [E], dropped, added
    report = torch.zeros(2 * E + 2, dtype=torch.int64, device=device)
    _apply_kernel[(E,)](
        key_ET, routed_ET, stats_PS, best_EC, scan, prefix_EB, report, rank, P, E, T, C, **rules, **passes
    )
    # 5. the padded routing, real pairs first
    if T > 0:
        rounded = rounded_routing(scores_TK, dense_TE, routed_ET, scan, prefix_EB, E, tile)
    else:
        empty = torch.zeros(rounded_pairs_bound(0, 0, E, tile), dtype=torch.int64, device=device)
        # scores with autograd to the (empty) router outputs, as on a rank with tokens: every rank's backward then
        # runs the same nodes (and their collectives)
        linked = scores_TK.new_zeros(empty.shape) + 0 * (scores_TK.sum() + dense_TE.sum().to(scores_TK.dtype))
        rounded = FlatRouting(empty, empty + E, linked, 0, padded=True)
    result = RoundingResult(
        token_idx_R=rounded.token_idx_R,
        expert_idx_R=rounded.expert_idx_R,
        scores_R=rounded.scores_R,
        counts_before_E=report[:E],
        counts_after_E=report[E : 2 * E],
        dropped=report[2 * E],
        added=report[2 * E + 1],
        token_offsets=rounded.token_offsets,
    )
    return result, stats_PS[:, E + 1] != 0
