"""Send side of a token-sorted flat routing (the rounded routing under expert parallelism) in three Triton launches,
the kernels of ``triton_send.py`` with a token's pairs read from its CSR range instead of a [T, K] row.

Shape legend (as ``triton_send.py``): T tokens, R pairs (padded: real pairs [0, offsets[T]) first, then padding
pairs that no token's range holds), P ranks, L local experts, N chunks, BT tokens per program, J tiles per chunk.

The result equals, bit for bit, ``send_side.send_side_torch(..., padded=True)`` on the same pairs in every field the
plan reads: the send rows, the combine order and offsets, the counts, and the first offsets[T] entries of the pair
order and metadata (the padding pairs' entries there are never sent). The pair order's padding entries are the
reference's too (padding pairs go last, in flat order); the pair metadata's padding rows are left unwritten.

Token t's pairs are [offsets[t], offsets[t + 1]), sorted by expert (so a destination's pairs are consecutive, as
the dedup of the reference needs only distinct (token, destination)); their number varies per token, so each
program loops over the most pairs a token of its tile has. Rounding gives a token at most a few pairs more than K.

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
    _SCAN_ELEMS,
    _SCORE_DTYPES,
    _TILE_ELEMS,
    MAX_RANKS,
    MAX_SEGMENTS,
    EPSendSide,
    IndexStats,
    _scan_kernel,
    _tile_tokens,
)


@triton.jit
def _token_pairs(offsets_ptr, t, valid):
    """(first pair [BT] int64, pair count [BT] int64, the tile's largest count) of the tile's tokens."""
    first = tl.load(offsets_ptr + t, mask=valid, other=0).to(tl.int64)
    count = tl.where(valid, tl.load(offsets_ptr + t + 1, mask=valid, other=0).to(tl.int64) - first, 0)
    return first, count, tl.max(count, axis=0)


@triton.jit
def _csr_destination(exp_ptr, first, count, k, P, L):
    """(expert, destination, is a pair) [BT] of each token's k-th pair; destinations clamped to [0, P-1]."""
    ok = k < count
    e = tl.load(exp_ptr + first + k, mask=ok, other=0).to(tl.int64)
    d = tl.minimum(tl.maximum(e // L, 0), P - 1)
    return e, d, ok


@triton.jit
def _csr_pairs_per_destination(exp_ptr, first, count, kmax, P, L, BT: tl.constexpr, PP: tl.constexpr):
    """npair [BT, PP] int32: pairs of each token to each destination."""
    p = tl.arange(0, PP)
    npair = tl.zeros([BT, PP], dtype=tl.int32)
    for k in range(0, kmax):
        _, d, ok = _csr_destination(exp_ptr, first, count, k, P, L)
        npair += ((d[:, None] == p[None, :]) & ok[:, None]).to(tl.int32)
    return npair


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
    first, count, kmax = _token_pairs(offsets_in_ptr, t, valid)
    npair = _csr_pairs_per_destination(exp_ptr, first, count, kmax, P, L, BT, PP)
    flag = (npair > 0).to(tl.int32)
    p = tl.arange(0, PP)
    at = (c * P + p) * J + j
    tl.store(cnt_rows_ptr + at, tl.sum(flag, axis=0), mask=p < P)
    tl.store(cnt_pairs_ptr + at, tl.sum(npair, axis=0), mask=p < P)
    tl.store(tile_rows_ptr + c * J + j, tl.sum(tl.sum(flag, axis=1), axis=0))
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
    first, count, kmax = _token_pairs(offsets_in_ptr, t, valid)
    npair = _csr_pairs_per_destination(exp_ptr, first, count, kmax, P, L, BT, PP)
    flag = (npair > 0).to(tl.int32)
    is_row = flag > 0
    p = tl.arange(0, PP)
    p_ok = p < P
    seg_at = (c * P + p) * J
    row0 = tl.load(row_base_ptr + seg_at + j, mask=p_ok, other=0)
    seg_row0 = tl.load(row_base_ptr + seg_at, mask=p_ok, other=0)
    pair0 = tl.load(pair_base_ptr + seg_at + j, mask=p_ok, other=0)

    # Send rows and the combine order: as ``_place_kernel`` (tokens ascending inside a (segment, tile)).
    send_row = row0[None, :] + (tl.cumsum(flag, axis=0) - flag)
    tl.store(send_tok_ptr + send_row, tl.broadcast_to(t[:, None], [BT, PP]), mask=is_row)
    n_dest = tl.sum(flag, axis=1)
    tok_first = tl.load(tile_base_ptr + c * J + j) + (tl.cumsum(n_dest, axis=0) - n_dest)
    tl.store(offsets_ptr + t, tok_first, mask=valid)
    tl.store(comb_order_ptr + tok_first[:, None] + (tl.cumsum(flag, axis=1) - flag), send_row, mask=is_row)

    # Pairs: first pair of (token, destination), then the token's later pairs there in flat order.
    row_in_seg = (send_row - seg_row0[None, :]).to(tl.int32)
    pair_first = pair0[None, :] + (tl.cumsum(npair, axis=0) - npair)
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
        s = tl.load(score_ptr + first + k, mask=ok, other=0)
        if IS_F64:
            b = s.to(tl.int64, bitcast=True)
            tl.store(m_ptr + 2, b.to(tl.int32), mask=ok)
            tl.store(m_ptr + 3, (b >> 32).to(tl.int32), mask=ok)
        elif IS_BF16:
            tl.store(m_ptr + 2, s.to(tl.int16, bitcast=True).to(tl.int32) << 16, mask=ok)
        else:
            tl.store(m_ptr + 2, s.to(tl.float32).to(tl.int32, bitcast=True), mask=ok)

    # Tails [S, R) of the send rows and the combine order, and the padding pairs [offsets[T], R) of the pair
    # order (last, in flat order, as the reference's stable sort puts them): this program's FILL-slice.
    S = tl.load(offsets_ptr + T)
    real = tl.load(offsets_in_ptr + T).to(tl.int64)
    i = (c * J + j) * FILL + tl.arange(0, FILL)
    tail = (i >= S) & (i < R)
    tl.store(send_tok_ptr + i, tl.zeros([FILL], dtype=tl.int64) + T, mask=tail)
    tl.store(comb_order_ptr + i, i, mask=tail)
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
    for name, v, hi in (
        ("num_local_experts", num_local_experts, 2**31 - 1),
        ("world_size", world_size, MAX_RANKS),
        ("num_chunks", num_chunks, MAX_SEGMENTS),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
            bad(name, f"an int in [1, {hi}]", repr(v))
    if num_chunks * world_size > MAX_SEGMENTS:
        bad("num_chunks * world_size", f"<= {MAX_SEGMENTS}", num_chunks * world_size)
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
    i64 = dict(dtype=torch.int64, device=device)
    rows_R = torch.empty(3, R, **i64)
    order, send_tok, comb_order = rows_R[0], rows_R[1], rows_R[2]
    meta = torch.empty(R, 4 if f64 else 3, dtype=torch.int32, device=device)
    small = torch.empty(2 * NP + 3, **i64)
    rows_NP, pairs_NP = small[:NP], small[NP : 2 * NP]
    minmax, duplicate = small[2 * NP : 2 * NP + 2], small[2 * NP + 2 :]
    offsets = torch.empty(T + 1, **i64)
    PP = triton.next_power_of_2(P)
    if block_tokens is None:
        BT = max(4, min(128, _TILE_ELEMS // PP))
    elif isinstance(block_tokens, int) and block_tokens >= 1 and block_tokens & (block_tokens - 1) == 0:
        BT = block_tokens
    else:
        raise ValueError(f"ep_send_side_csr: block_tokens must be a power of two >= 1, got {block_tokens!r}")
    J = triton.cdiv(triton.cdiv(T, N), BT)
    n_tiles = N * J
    cnt = torch.empty(2 * NP * J + n_tiles, dtype=torch.int32, device=device)
    base = torch.empty(2 * NP * J + n_tiles + 3 * n_tiles, **i64)
    cnt_rows, cnt_pairs, tile_rows = cnt[: NP * J], cnt[NP * J : 2 * NP * J], cnt[2 * NP * J :]
    row_base, pair_base = base[: NP * J], base[NP * J : 2 * NP * J]
    tile_base, tile_stats = base[2 * NP * J : 2 * NP * J + n_tiles], base[2 * NP * J + n_tiles :]
    token_offsets, expert_idx_R, scores_R = token_offsets.contiguous(), expert_idx_R.contiguous(), scores_R.contiguous()
    grid = (J, N)
    _count_csr_kernel[grid](
        expert_idx_R, token_offsets, T, N, P, L, J, cnt_rows, cnt_pairs, tile_rows, tile_stats, n_tiles, BT=BT, PP=PP
    )
    NPB = triton.next_power_of_2(NP)
    _scan_kernel[(1,)](
        cnt_rows,
        cnt_pairs,
        tile_rows,
        NP,
        J,
        n_tiles,
        T,
        row_base,
        pair_base,
        rows_NP,
        pairs_NP,
        tile_base,
        offsets,
        tile_stats,
        minmax,
        duplicate,
        NPB=NPB,
        TB=max(1, _SCAN_ELEMS // NPB),
        B1=_SCAN_ELEMS,
        num_warps=8,
    )
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
        row_base,
        pair_base,
        tile_base,
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
    return EPSendSide(order, send_tok, comb_order, offsets, meta, rows_NP, pairs_NP, IndexStats(minmax, duplicate))
