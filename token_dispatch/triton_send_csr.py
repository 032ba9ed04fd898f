"""Send side of a token-sorted flat routing (the rounded routing under expert parallelism) in three Triton launches,
the kernels of ``triton_send.py`` with a token's pairs read from its CSR range instead of a [T, K] row.

Shape legend (as ``triton_send.py``): T tokens, R pairs (padded: real pairs [0, offsets[T]) first, then padding
pairs that no token's range holds), P ranks, L local experts, N chunks, BT tokens per program, J tiles per chunk.

The result equals, bit for bit, ``send_side.send_side_torch(..., padded=True)`` on the same pairs in every field the
plan reads: the send rows, the combine order and offsets, the counts, and the first offsets[T] entries of the pair
order and metadata (the padding pairs' entries there are never sent). The pair order's padding entries are the
reference's too (padding pairs go last, in flat order); the pair metadata's padding rows are left unwritten.

Token t's pairs are [offsets[t], offsets[t + 1]) (tokens ascending, any order inside a token: a send row is a
distinct (token, destination)); their number varies per token, so each program loops over the most pairs a token of
its tile has.

1. ``_count_csr_kernel`` (grid [J, N]): as ``_count_kernel``; the index stats (the header's) are the top-K
   routing's, taken before rounding, so these tiles report none.
2. ``triton_send._scan_kernel``, unchanged.
3. ``_place_csr_kernel`` (grid [J, N]): as ``_place_kernel``; a pair's flat index is offsets[t] + k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_send import (
    _SCORE_DTYPES,
    EPSendSide,
    IndexStats,
    ScanBuffers,
    SendOutputs,
    _fill_tails,
    _place_rows,
    _store_counts,
    _store_score_bits,
    _tile_tokens,
    check_layout,
    tiling,
)


@triton.jit
def _csr_destination(exp_ptr, first, count, k, P, L):
    """(expert, destination, is a pair) [BT] of each token's k-th pair; destinations clamped to [0, P-1]."""
    ok = k < count
    e = tl.load(exp_ptr + first + k, mask=ok, other=0).to(tl.int64)
    d = tl.minimum(tl.maximum(e // L, 0), P - 1)
    return e, d, ok


@triton.jit
def _csr_pairs(exp_ptr, offsets_ptr, t, valid, P, L, BT: tl.constexpr, PP: tl.constexpr):
    """The tile's tokens' pairs: (npair [BT, PP] int32 pairs of each token to each destination, first pair [BT]
    int64, pair count [BT] int64, the tile's largest count)."""
    first = tl.load(offsets_ptr + t, mask=valid, other=0).to(tl.int64)
    count = tl.where(valid, tl.load(offsets_ptr + t + 1, mask=valid, other=0).to(tl.int64) - first, 0)
    kmax = tl.max(count, axis=0)
    p = tl.arange(0, PP)
    npair = tl.zeros([BT, PP], dtype=tl.int32)
    for k in range(0, kmax):
        _, d, ok = _csr_destination(exp_ptr, first, count, k, P, L)
        npair += ((d[:, None] == p[None, :]) & ok[:, None]).to(tl.int32)
    return npair, first, count, kmax


@triton.jit(do_not_specialize=["T", "J"])
def _count_csr_kernel(
    exp_ptr,
    offsets_in_ptr,
    T,
    N,
    P,
    L,
    J,
    cnt_rows_ptr,
    cnt_pairs_ptr,
    tile_rows_ptr,
    tile_stats_ptr,
    n_tiles,
    BT: tl.constexpr,
    PP: tl.constexpr,
):
    t, valid, c, j = _tile_tokens(T, N, J, BT)
    npair, _, _, _ = _csr_pairs(exp_ptr, offsets_in_ptr, t, valid, P, L, BT, PP)
    _store_counts(npair, c, j, P, J, cnt_rows_ptr, cnt_pairs_ptr, tile_rows_ptr, PP)
    zero = tl.zeros([1], dtype=tl.int64)  # no index stats here (module docstring); the scan reads defined values
    one = tl.arange(0, 1)
    tl.store(tile_stats_ptr + c * J + j + one, zero)
    tl.store(tile_stats_ptr + n_tiles + c * J + j + one, zero)
    tl.store(tile_stats_ptr + 2 * n_tiles + c * J + j + one, zero)


@triton.jit(do_not_specialize=["T", "R", "J"])
def _place_csr_kernel(
    exp_ptr,
    offsets_in_ptr,
    score_ptr,
    T,
    R,
    N,
    P,
    L,
    J,
    row_base_ptr,
    pair_base_ptr,
    tile_base_ptr,
    offsets_ptr,
    order_ptr,
    send_tok_ptr,
    comb_order_ptr,
    meta_ptr,
    BT: tl.constexpr,
    PP: tl.constexpr,
    CC: tl.constexpr,
    IS_F64: tl.constexpr,
    IS_BF16: tl.constexpr,
    FILL: tl.constexpr,
):
    t, valid, c, j = _tile_tokens(T, N, J, BT)
    npair, first, count, kmax = _csr_pairs(exp_ptr, offsets_in_ptr, t, valid, P, L, BT, PP)
    row_in_seg, pair_first, p = _place_rows(
        npair,
        t,
        valid,
        c,
        j,
        P,
        J,
        row_base_ptr,
        pair_base_ptr,
        tile_base_ptr,
        offsets_ptr,
        send_tok_ptr,
        comb_order_ptr,
        BT,
        PP,
    )
    # Pairs: first pair of (token, destination), then the token's later pairs there in flat order.
    seen = tl.zeros([BT, PP], dtype=tl.int32)
    for k in range(0, kmax):
        e, d, ok = _csr_destination(exp_ptr, first, count, k, P, L)
        hit = (d[:, None] == p[None, :]) & ok[:, None]
        pos = tl.sum(tl.where(hit, pair_first + seen, 0), axis=1)
        seen += hit.to(tl.int32)
        local = e % L
        local = tl.where(local < 0, local + L, local)
        tl.store(order_ptr + pos, first + k, mask=ok)
        m_ptr = meta_ptr + pos * CC
        tl.store(m_ptr, tl.sum(tl.where(hit, row_in_seg, 0), axis=1), mask=ok)
        tl.store(m_ptr + 1, local.to(tl.int32), mask=ok)
        _store_score_bits(m_ptr, tl.load(score_ptr + first + k, mask=ok, other=0), ok, IS_F64, IS_BF16)
    # The tails of the send rows and the combine order, and the padding pairs [offsets[T], R) of the pair order
    # (last, in flat order, as the reference's stable sort puts them).
    i = _fill_tails(offsets_ptr, T, R, c, j, J, send_tok_ptr, comb_order_ptr, FILL)
    real = tl.load(offsets_in_ptr + T).to(tl.int64)
    tl.store(order_ptr + i, i, mask=(i >= real) & (i < R))


def _check(token_offsets, expert_idx_R, scores_R, num_tokens, num_local_experts, world_size, num_chunks) -> None:
    def bad(name, want, got):
        raise ValueError(f"ep_send_side_csr: {name} must be {want}, got {got}")

    for name, t in (("token_offsets", token_offsets), ("expert_idx_R", expert_idx_R), ("scores_R", scores_R)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1:
            bad(name, "a 1-D tensor", getattr(t, "shape", type(t).__name__))
    if token_offsets.dtype not in (torch.int32, torch.int64) or expert_idx_R.dtype not in (torch.int32, torch.int64):
        bad("token_offsets / expert_idx_R dtype", "int32 or int64", (token_offsets.dtype, expert_idx_R.dtype))
    if scores_R.dtype not in _SCORE_DTYPES:
        bad("scores_R dtype", f"one of {_SCORE_DTYPES}", scores_R.dtype)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        bad("num_tokens", "an int >= 1 (no tokens: the reference)", repr(num_tokens))
    if token_offsets.numel() != num_tokens + 1:
        bad("token_offsets", f"[T + 1 = {num_tokens + 1}]", tuple(token_offsets.shape))
    if scores_R.shape != expert_idx_R.shape:
        bad("scores_R", f"expert_idx_R's shape {tuple(expert_idx_R.shape)}", tuple(scores_R.shape))
    devices = {token_offsets.device, expert_idx_R.device, scores_R.device}
    if len(devices) != 1:
        bad("the tensors' devices", "one device", sorted(map(str, devices)))
    check_layout(bad, num_local_experts, world_size, num_chunks)
    if expert_idx_R.numel() >= 2**31:
        bad("expert_idx_R", "fewer than 2^31 pairs", expert_idx_R.numel())


def ep_send_side_csr(
    token_offsets: torch.Tensor,
    expert_idx_R: torch.Tensor,
    scores_R: torch.Tensor,
    num_tokens: int,
    num_local_experts: int,
    world_size: int,
    num_chunks: int,
    *,
    block_tokens: int | None = None,
) -> EPSendSide:
    """The plan's send side of a token-sorted flat routing (module docstring), equal to
    ``send_side.send_side_torch(token_idx_R, expert_idx_R, scores_R, T, L, P, N, padded=True)`` where the plan reads.

    Args:
        token_offsets: int32/int64 [T + 1], token t's pairs are [token_offsets[t], token_offsets[t + 1]), sorted by
            expert; pairs past token_offsets[T] are padding (sent nowhere).
        expert_idx_R: int32/int64 [R] GLOBAL expert ids in [0, L*P) for the real pairs.
        scores_R: [R] float32/bf16/fp16/float64 (only read); its bits ride in the pair metadata.
        num_tokens, num_local_experts, world_size, num_chunks: T >= 1, L, P, N as ``triton_send.ep_send_side``.
        block_tokens: tokens per program, a power of two (the tests use small ones); None: as ``ep_send_side``.
    ``index_stats`` of the result holds zeros: the header's stats are the top-K routing's (module docstring).
    Three launches, no host sync."""
    _check(token_offsets, expert_idx_R, scores_R, num_tokens, num_local_experts, world_size, num_chunks)
    T, L, P, N = num_tokens, num_local_experts, world_size, num_chunks
    R, NP, device = expert_idx_R.numel(), N * P, expert_idx_R.device
    f64 = scores_R.dtype == torch.float64
    rows_R = torch.empty(3, R, dtype=torch.int64, device=device)
    order, send_tok, comb_order = rows_R[0], rows_R[1], rows_R[2]
    meta = torch.empty(R, 4 if f64 else 3, dtype=torch.int32, device=device)
    out = SendOutputs.new(NP, device)
    offsets = torch.empty(T + 1, dtype=torch.int64, device=device)
    BT, PP, J = tiling(T, N, P, block_tokens, "ep_send_side_csr")
    n_tiles = N * J
    b = ScanBuffers.new(NP, J, n_tiles, device)
    token_offsets, expert_idx_R, scores_R = token_offsets.contiguous(), expert_idx_R.contiguous(), scores_R.contiguous()
    grid = (J, N)
    _count_csr_kernel[grid](
        expert_idx_R,
        token_offsets,
        T,
        N,
        P,
        L,
        J,
        b.cnt_rows,
        b.cnt_pairs,
        b.tile_rows,
        b.tile_stats,
        n_tiles,
        BT=BT,
        PP=PP,
    )
    b.scan(NP, J, n_tiles, T, out, offsets)
    _place_csr_kernel[grid](
        expert_idx_R,
        token_offsets,
        scores_R,
        T,
        R,
        N,
        P,
        L,
        J,
        b.row_base,
        b.pair_base,
        b.tile_base,
        offsets,
        order,
        send_tok,
        comb_order,
        meta,
        BT=BT,
        PP=PP,
        CC=meta.shape[1],
        IS_F64=f64,
        IS_BF16=scores_R.dtype == torch.bfloat16,
        FILL=triton.next_power_of_2(max(1, triton.cdiv(R, n_tiles))),
    )
    return EPSendSide(
        order, send_tok, comb_order, offsets, meta, out.rows_NP, out.pairs_NP, IndexStats(out.minmax, out.duplicate)
    )
