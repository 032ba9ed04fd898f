"""Send side of the expert-parallel dispatch plan in THREE Triton launches (replaces about 40 small PyTorch ops).

Shape legend (as ``send_side.py``): T tokens, K experts per token, R = T*K pairs, P ranks, L local
experts (E = L*P), N chunks, S send rows (distinct (token, destination) of this rank); additionally
PP = P padded to a power of two, BT tokens per program ("tile"), J tiles per chunk, C score columns.

The result equals, bit for bit, ``send_side.send_side_torch`` (the reference and the CPU path) on the
flattened top-K routing; its docstring and ``SendSide`` define the fields. Segment of pair (t, k): chunk
c = t*N // T, destination d = clamp(expert // L, 0, P-1), segment c*P + d; pairs go out sorted by segment,
token, k; send rows sorted by segment, token.

Chunk c holds tokens [ceil(c*T/N), ceil((c+1)*T/N)), at most ceil(T/N) of them, so a program is one tile
of ONE chunk (grid [J, N], J = ceil(ceil(T/N) / BT); trailing tiles may be partly or wholly empty): its
tokens all share a chunk, so its counts per segment are plain column sums of per-token flags.

1. ``_count_kernel`` (grid [J, N]): per token the pairs to each destination npair [BT, PP]; per (segment,
   tile) the send rows (tokens with >= 1 pair there) and pairs, and per tile its send rows (for combine).
2. ``_scan_kernel`` (one program): exclusive scans, segment-major then tile: each (segment, tile)'s first
   send row and first send pair; per segment totals (rows_NP, pairs_NP); each tile's first combine
   position in token order; S, stored as combine_offsets[T].
3. ``_place_kernel`` (grid [J, N]): recomputes npair, places every send row (tile base + exclusive cumsum
   over the tile's tokens) and every pair (+ the token's earlier pairs to the same destination), writes
   order, send_token_idx, combine_order, combine_offsets[:T], pair metadata; and each program fills its
   slice of the tails send_token_idx[S:R] = T, combine_order[S:R] = S..R-1 (S read on the device).

Every output element has exactly one writer, integers only: deterministic, no atomics, no host sync. The count
and scan kernels also reduce the routing's index stats (smallest and largest expert, a token naming an expert
twice) for the plan's header check, so that check costs no launch of its own.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

_SCORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
MAX_RANKS = 256  # per-token destination flags [BT, PP] live in registers
MAX_SEGMENTS = 4096  # the scan holds a [N*P padded, block] tile
_TILE_ELEMS = 512  # BT * PP per program of kernels 1 and 3 (sm_90, K = 8: no register spills up to PP = 256)
_SCAN_ELEMS = 2048  # elements per step of the one-program scan (the tests shrink it to cover its loop)


class EPSendSide(NamedTuple):
    """Fields in ``send_side.SendSide`` order (``SendSide(*result)``); see the module docstring."""

    order: torch.Tensor  # int64 [R]: flat pair t*K + k of every pair, in send order
    send_token_idx_R: torch.Tensor  # int64 [R]: token of each send row; rows S.. hold the sentinel T
    combine_order_R: torch.Tensor  # int64 [R]: send rows by token (destination ascending), then S..R-1
    combine_offsets: torch.Tensor  # int64 [T + 1]: first combine position of each token, S at the end
    pair_meta_RC: torch.Tensor  # int32 [R, 2 + C]: row in segment, local expert, score bits (send order)
    rows_NP: torch.Tensor  # int64 [N*P]: send rows per segment
    pairs_NP: torch.Tensor  # int64 [N*P]: pairs per segment
    index_stats: IndexStats  # the expert-index check of the plan's header


class IndexStats(NamedTuple):
    """The header's expert-index fields of a top-K routing as int64 device tensors (``validation.index_stats``):
    ``minmax`` [2] the smallest and largest expert index, ``duplicate`` [1] 1 where a token names an expert twice
    (-1 for K = 1, no pairs to compare), else 0."""

    minmax: torch.Tensor
    duplicate: torch.Tensor


class SendOutputs(NamedTuple):
    """Where ``ep_send_side`` writes the per-segment counts and the index stats, e.g. slices of the plan's
    sizes-exchange buffer (so that no concatenation follows): int64 views ``rows_NP`` [N*P], ``pairs_NP`` [N*P],
    ``minmax`` [2], ``duplicate`` [1]."""

    rows_NP: torch.Tensor
    pairs_NP: torch.Tensor
    minmax: torch.Tensor
    duplicate: torch.Tensor

    @staticmethod
    def new(NP: int, device) -> SendOutputs:
        """New outputs for N*P = ``NP`` segments (views of one allocation)."""
        small = torch.empty(2 * NP + 3, dtype=torch.int64, device=device)
        return SendOutputs(small[:NP], small[NP : 2 * NP], small[2 * NP : 2 * NP + 2], small[2 * NP + 2 :])


@triton.jit
def _tile_tokens(T, N, J, BT: tl.constexpr):
    """Tokens [BT] (int64) of program (tile j, chunk c) and their validity; chunk c is [ceil(cT/N), ceil((c+1)T/N))."""
    j = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    start = (c * T + N - 1) // N
    end = ((c + 1) * T + N - 1) // N
    t = start + j * BT + tl.arange(0, BT).to(tl.int64)
    return t, t < end, c, j


@triton.jit
def _destination(idx_ptr, t, valid, k, stride_t, stride_k, P, L):
    """(expert, destination) [BT] of pair (t, k); destinations clamped to [0, P-1] as the reference."""
    e = tl.load(idx_ptr + t * stride_t + k * stride_k, mask=valid, other=0).to(tl.int64)
    d = tl.minimum(tl.maximum(e // L, 0), P - 1)  # // truncates or floors: equal after the clamp at 0
    return e, d


@triton.jit
def _pairs_per_destination(
    idx_ptr, t, valid, stride_t, stride_k, P, L, K: tl.constexpr, BT: tl.constexpr, PP: tl.constexpr
):
    """npair [BT, PP] int32: pairs of each token to each destination (0 for invalid tokens)."""
    p = tl.arange(0, PP)
    npair = tl.zeros([BT, PP], dtype=tl.int32)
    for k in tl.static_range(K):
        _, d = _destination(idx_ptr, t, valid, k, stride_t, stride_k, P, L)
        npair += ((d[:, None] == p[None, :]) & valid[:, None]).to(tl.int32)
    return npair


@triton.jit
def _index_stats(idx_ptr, t, valid, stride_t, stride_k, K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr):
    """(min expert, max expert, 1 where a token names an expert twice else 0) over the tile's valid pairs, int64
    scalars; garbage for a tile without valid tokens (the scan skips those). The expert-index check of the
    plan's header, computed while the indices are read anyway."""
    kk = tl.arange(0, KP)
    m2 = valid[:, None] & (kk[None, :] < K)
    e2 = tl.load(idx_ptr + t[:, None] * stride_t + kk[None, :] * stride_k, mask=m2, other=0).to(tl.int64)
    first = tl.sum(tl.sum(tl.where((tl.arange(0, BT)[:, None] == 0) & (kk[None, :] == 0), e2, 0), 1), 0)
    lo = tl.min(tl.min(tl.where(m2, e2, first), axis=1), axis=0)
    hi = tl.max(tl.max(tl.where(m2, e2, first), axis=1), axis=0)
    dup = tl.zeros_like(e2).to(tl.int32)
    for k in tl.static_range(K - 1):
        col = tl.sum(tl.where(kk[None, :] == k, e2, 0), axis=1)  # [BT]: pair k of every token
        dup += ((e2 == col[:, None]) & m2 & (kk[None, :] > k)).to(tl.int32)
    return lo, hi, (tl.max(tl.max(dup, axis=1), axis=0) > 0).to(tl.int64)


@triton.jit
def _place_rows(
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
    BT: tl.constexpr,
    PP: tl.constexpr,
):
    """Kernel 3's rows, from the tile's pairs per (token, destination) ``npair`` [BT, PP]: writes every send row's
    token (inside a (segment, tile), tokens ascending), the tile's combine order (rows grouped by token, its
    destinations ascending) and combine offsets. Returns (row in segment [BT, PP] int32, first send position of each
    (token, destination)'s pairs [BT, PP], destinations [PP])."""
    flag = (npair > 0).to(tl.int32)  # one send row per (token, destination) flagged; 0 for invalid tokens
    is_row = flag > 0
    p = tl.arange(0, PP)
    p_ok = p < P
    seg_at = (c * P + p) * J
    row0 = tl.load(row_base_ptr + seg_at + j, mask=p_ok, other=0)  # first send row of (segment, this tile)
    seg_row0 = tl.load(row_base_ptr + seg_at, mask=p_ok, other=0)  # first send row of the segment
    pair0 = tl.load(pair_base_ptr + seg_at + j, mask=p_ok, other=0)
    send_row = row0[None, :] + (tl.cumsum(flag, axis=0) - flag)  # int64 [BT, PP]
    tl.store(send_tok_ptr + send_row, tl.broadcast_to(t[:, None], [BT, PP]), mask=is_row)
    n_dest = tl.sum(flag, axis=1)
    tok_first = tl.load(tile_base_ptr + c * J + j) + (tl.cumsum(n_dest, axis=0) - n_dest)  # int64 [BT]
    tl.store(offsets_ptr + t, tok_first, mask=valid)
    tl.store(comb_order_ptr + tok_first[:, None] + (tl.cumsum(flag, axis=1) - flag), send_row, mask=is_row)
    row_in_seg = (send_row - seg_row0[None, :]).to(tl.int32)
    pair_first = pair0[None, :] + (tl.cumsum(npair, axis=0) - npair)
    return row_in_seg, pair_first, p


@triton.jit
def _store_score_bits(m_ptr, s, mask, IS_F64: tl.constexpr, IS_BF16: tl.constexpr):
    """A pair's score bits into its metadata row (columns 2.., ``send_side.score_columns``' layout)."""
    if IS_F64:  # two columns: low word, high word (little-endian view of the float64)
        b = s.to(tl.int64, bitcast=True)
        tl.store(m_ptr + 2, b.to(tl.int32), mask=mask)
        tl.store(m_ptr + 3, (b >> 32).to(tl.int32), mask=mask)
    elif IS_BF16:  # bf16 is the top half of its fp32: bit ops, no float convert
        tl.store(m_ptr + 2, s.to(tl.int16, bitcast=True).to(tl.int32) << 16, mask=mask)
    else:  # fp32 as is, fp16 widened (exact)
        tl.store(m_ptr + 2, s.to(tl.float32).to(tl.int32, bitcast=True), mask=mask)


@triton.jit
def _fill_tails(offsets_ptr, T, R, c, j, J, send_tok_ptr, comb_order_ptr, FILL: tl.constexpr):
    """Tails [S, R) of the send rows (the sentinel T) and of the combine order (S..R-1): this program's FILL-slice
    of them (N*J*FILL >= R); S was stored by the scan. Returns the slice's positions."""
    S = tl.load(offsets_ptr + T)
    i = (c * J + j) * FILL + tl.arange(0, FILL)
    tail = (i >= S) & (i < R)
    tl.store(send_tok_ptr + i, tl.zeros([FILL], dtype=tl.int64) + T, mask=tail)
    tl.store(comb_order_ptr + i, i, mask=tail)
    return i


@triton.jit
def _store_counts(npair, c, j, P, J, cnt_rows_ptr, cnt_pairs_ptr, tile_rows_ptr, PP: tl.constexpr):
    """Kernel 1's outputs from the tile's pairs per (token, destination) ``npair`` [BT, PP]: send rows and pairs per
    (segment, tile), send rows of the tile."""
    flag = (npair > 0).to(tl.int32)
    p = tl.arange(0, PP)
    at = (c * P + p) * J + j  # [segment, tile] layout: the scan's order is segment-major
    tl.store(cnt_rows_ptr + at, tl.sum(flag, axis=0), mask=p < P)
    tl.store(cnt_pairs_ptr + at, tl.sum(npair, axis=0), mask=p < P)
    tl.store(tile_rows_ptr + c * J + j, tl.sum(tl.sum(flag, axis=1), axis=0))


@triton.jit(do_not_specialize=["T", "J"])
def _count_kernel(
    idx_ptr,
    stride_t,
    stride_k,
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
    K: tl.constexpr,
    KP: tl.constexpr,
    BT: tl.constexpr,
    PP: tl.constexpr,
):
    t, valid, c, j = _tile_tokens(T, N, J, BT)
    npair = _pairs_per_destination(idx_ptr, t, valid, stride_t, stride_k, P, L, K, BT, PP)
    _store_counts(npair, c, j, P, J, cnt_rows_ptr, cnt_pairs_ptr, tile_rows_ptr, PP)
    lo, hi, dup = _index_stats(idx_ptr, t, valid, stride_t, stride_k, K, KP, BT)
    tl.store(tile_stats_ptr + c * J + j, lo)  # [3, n_tiles]: min, max, duplicate flag per tile
    tl.store(tile_stats_ptr + n_tiles + c * J + j, hi)
    tl.store(tile_stats_ptr + 2 * n_tiles + c * J + j, dup)


@triton.jit(do_not_specialize=["J", "n_tiles", "T"])
def _scan_kernel(
    cnt_rows_ptr,
    cnt_pairs_ptr,
    tile_rows_ptr,
    NP,
    J,
    n_tiles,
    T,
    row_base_ptr,
    pair_base_ptr,
    rows_NP_ptr,
    pairs_NP_ptr,
    tile_base_ptr,
    offsets_ptr,
    tile_stats_ptr,
    minmax_ptr,
    dup_ptr,
    NPB: tl.constexpr,
    TB: tl.constexpr,
    B1: tl.constexpr,
):
    s = tl.arange(0, NPB)
    s_ok = s < NP
    # pass 1: per-segment totals
    rows_tot = tl.zeros([NPB], dtype=tl.int64)
    pairs_tot = tl.zeros([NPB], dtype=tl.int64)
    for j0 in range(0, J, TB):
        jj = j0 + tl.arange(0, TB)
        m = s_ok[:, None] & (jj[None, :] < J)
        at = s.to(tl.int64)[:, None] * J + jj[None, :]
        rows_tot += tl.sum(tl.load(cnt_rows_ptr + at, mask=m, other=0).to(tl.int64), axis=1)
        pairs_tot += tl.sum(tl.load(cnt_pairs_ptr + at, mask=m, other=0).to(tl.int64), axis=1)
    tl.store(rows_NP_ptr + s, rows_tot, mask=s_ok)
    tl.store(pairs_NP_ptr + s, pairs_tot, mask=s_ok)
    # pass 2: exclusive prefix of every (segment, tile) = segment's start + its earlier tiles
    row_carry = tl.cumsum(rows_tot, axis=0) - rows_tot
    pair_carry = tl.cumsum(pairs_tot, axis=0) - pairs_tot
    for j0 in range(0, J, TB):
        jj = j0 + tl.arange(0, TB)
        m = s_ok[:, None] & (jj[None, :] < J)
        at = s.to(tl.int64)[:, None] * J + jj[None, :]
        r = tl.load(cnt_rows_ptr + at, mask=m, other=0).to(tl.int64)
        q = tl.load(cnt_pairs_ptr + at, mask=m, other=0).to(tl.int64)
        tl.store(row_base_ptr + at, tl.cumsum(r, axis=1) - r + row_carry[:, None], mask=m)
        tl.store(pair_base_ptr + at, tl.cumsum(q, axis=1) - q + pair_carry[:, None], mask=m)
        row_carry += tl.sum(r, axis=1)
        pair_carry += tl.sum(q, axis=1)
    # tiles in token order (chunk, tile): first combine position of each tile; S at the end. The index stats
    # of the tiles that hold tokens (every valid token has a send row; tile 0 always holds one for T > 0).
    carry = tl.zeros([1], dtype=tl.int64)
    one = tl.arange(0, 1)
    lo = tl.load(tile_stats_ptr + one)
    hi = tl.load(tile_stats_ptr + n_tiles + one)
    dup = tl.zeros([1], dtype=tl.int64)
    for i0 in range(0, n_tiles, B1):
        i = i0 + tl.arange(0, B1)
        v = tl.load(tile_rows_ptr + i, mask=i < n_tiles, other=0).to(tl.int64)
        tl.store(tile_base_ptr + i, tl.cumsum(v, axis=0) - v + carry, mask=i < n_tiles)
        carry += tl.sum(v, axis=0)
        has = (i < n_tiles) & (v > 0)
        lo = tl.minimum(lo, tl.min(tl.load(tile_stats_ptr + i, mask=has, other=0) + tl.where(has, 0, lo), 0))
        hi = tl.maximum(hi, tl.max(tl.load(tile_stats_ptr + n_tiles + i, mask=has, other=0) + tl.where(has, 0, hi), 0))
        dup = tl.maximum(dup, tl.max(tl.load(tile_stats_ptr + 2 * n_tiles + i, mask=has, other=0), 0))
    tl.store(offsets_ptr + T + one, carry)
    tl.store(minmax_ptr + one, lo)
    tl.store(minmax_ptr + 1 + one, hi)
    tl.store(dup_ptr + one, dup)


@triton.jit(do_not_specialize=["T", "R", "J"])
def _place_kernel(
    idx_ptr,
    stride_t,
    stride_k,
    score_ptr,
    score_stride_t,
    score_stride_k,
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
    K: tl.constexpr,
    BT: tl.constexpr,
    PP: tl.constexpr,
    CC: tl.constexpr,
    IS_F64: tl.constexpr,
    IS_BF16: tl.constexpr,
    FILL: tl.constexpr,
):
    t, valid, c, j = _tile_tokens(T, N, J, BT)
    npair = _pairs_per_destination(idx_ptr, t, valid, stride_t, stride_k, P, L, K, BT, PP)
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
    # Pairs: first pair of (token, destination), then k ascending among that token's pairs there.
    seen = tl.zeros([BT, PP], dtype=tl.int32)
    for k in tl.static_range(K):
        e, d = _destination(idx_ptr, t, valid, k, stride_t, stride_k, P, L)
        hit = d[:, None] == p[None, :]  # exactly one column per token
        pos = tl.sum(tl.where(hit, pair_first + seen, 0), axis=1)
        seen += hit.to(tl.int32)
        local = e % L
        local = tl.where(local < 0, local + L, local)  # Python's (torch.remainder's) sign, for any index
        tl.store(order_ptr + pos, t * K + k, mask=valid)
        m_ptr = meta_ptr + pos * CC
        tl.store(m_ptr, tl.sum(tl.where(hit, row_in_seg, 0), axis=1), mask=valid)
        tl.store(m_ptr + 1, local.to(tl.int32), mask=valid)
        s = tl.load(score_ptr + t * score_stride_t + k * score_stride_k, mask=valid, other=0)
        _store_score_bits(m_ptr, s, valid, IS_F64, IS_BF16)
    _fill_tails(offsets_ptr, T, R, c, j, J, send_tok_ptr, comb_order_ptr, FILL)


def tiling(T: int, N: int, P: int, block_tokens: int | None, caller: str) -> tuple[int, int, int]:
    """(BT tokens per program, PP = P padded to a power of two, J tiles per chunk) of kernels 1 and 3;
    ``block_tokens`` None: 128, fewer for P > 4 (BT * PP = ``_TILE_ELEMS``, BT >= 4), else a power of two."""
    PP = triton.next_power_of_2(P)
    if block_tokens is None:
        BT = max(4, min(128, _TILE_ELEMS // PP))
    elif isinstance(block_tokens, int) and block_tokens >= 1 and block_tokens & (block_tokens - 1) == 0:
        BT = block_tokens
    else:
        raise ValueError(f"{caller}: block_tokens must be a power of two >= 1, got {block_tokens!r}")
    return BT, PP, triton.cdiv(triton.cdiv(T, N), BT)


class ScanBuffers(NamedTuple):
    """Kernel 1's counts per (segment, tile) and per tile, kernel 2's prefixes of them (two allocations, views)."""

    cnt_rows: torch.Tensor  # int32 [N*P, J]
    cnt_pairs: torch.Tensor  # int32 [N*P, J]
    tile_rows: torch.Tensor  # int32 [n_tiles]
    row_base: torch.Tensor  # int64 [N*P, J]
    pair_base: torch.Tensor  # int64 [N*P, J]
    tile_base: torch.Tensor  # int64 [n_tiles]
    tile_stats: torch.Tensor  # int64 [3, n_tiles]: min, max expert and the duplicate flag per tile

    @staticmethod
    def new(NP: int, J: int, n_tiles: int, device) -> ScanBuffers:
        cnt = torch.empty(2 * NP * J + n_tiles, dtype=torch.int32, device=device)
        base = torch.empty(2 * NP * J + n_tiles + 3 * n_tiles, dtype=torch.int64, device=device)
        return ScanBuffers(
            cnt[: NP * J],
            cnt[NP * J : 2 * NP * J],
            cnt[2 * NP * J :],
            base[: NP * J],
            base[NP * J : 2 * NP * J],
            base[2 * NP * J : 2 * NP * J + n_tiles],
            base[2 * NP * J + n_tiles :],
        )

    def scan(self, NP: int, J: int, n_tiles: int, T: int, out: SendOutputs, offsets: torch.Tensor) -> None:
        """Kernel 2 (one program): the prefixes, ``out``'s counts and index stats, and S at ``offsets[T]``."""
        NPB = triton.next_power_of_2(NP)
        _scan_kernel[(1,)](
            self.cnt_rows,
            self.cnt_pairs,
            self.tile_rows,
            NP,
            J,
            n_tiles,
            T,
            self.row_base,
            self.pair_base,
            out.rows_NP,
            out.pairs_NP,
            self.tile_base,
            offsets,
            self.tile_stats,
            out.minmax,
            out.duplicate,
            NPB=NPB,
            TB=max(1, _SCAN_ELEMS // NPB),
            B1=_SCAN_ELEMS,
            num_warps=8,
        )


def check_layout(bad, num_local_experts, world_size: int, num_chunks: int) -> None:
    """L, P and N in the kernels' ranges; ``bad(name, expected, got)`` raises."""
    for name, v, hi in (
        ("num_local_experts", num_local_experts, 2**31 - 1),
        ("world_size", world_size, MAX_RANKS),
        ("num_chunks", num_chunks, MAX_SEGMENTS),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
            bad(name, f"an int in [1, {hi}]", repr(v))
    if num_chunks * world_size > MAX_SEGMENTS:
        bad("num_chunks * world_size", f"<= {MAX_SEGMENTS}", num_chunks * world_size)


def _check(indices_TK, scores_TK, num_tokens, num_local_experts, world_size, num_chunks) -> None:
    def bad(name, want, got):
        raise ValueError(f"ep_send_side: {name} must be {want}, got {got}")

    if not isinstance(indices_TK, torch.Tensor) or indices_TK.dim() != 2:
        bad("indices_TK", "a 2-D tensor [T, K]", getattr(indices_TK, "shape", type(indices_TK).__name__))
    if indices_TK.dtype not in (torch.int32, torch.int64):
        bad("indices_TK dtype", "int32 or int64", indices_TK.dtype)
    if not isinstance(scores_TK, torch.Tensor) or scores_TK.shape != indices_TK.shape:
        bad("scores_TK", f"a tensor of shape {tuple(indices_TK.shape)}", getattr(scores_TK, "shape", scores_TK))
    if scores_TK.dtype not in _SCORE_DTYPES:
        bad("scores_TK dtype", f"one of {_SCORE_DTYPES}", scores_TK.dtype)
    if scores_TK.device != indices_TK.device:
        bad("scores_TK device", f"indices_TK's ({indices_TK.device})", scores_TK.device)
    T, K = indices_TK.shape
    if num_tokens != T:
        bad("num_tokens", f"indices_TK.shape[0] = {T}", num_tokens)
    check_layout(bad, num_local_experts, world_size, num_chunks)
    if K < 1 or T * K >= 2**31:
        bad("indices_TK.shape", "[T, K] with K >= 1 and T*K < 2^31", tuple(indices_TK.shape))


def ep_send_side(
    indices_TK: torch.Tensor,
    scores_TK: torch.Tensor,
    num_tokens: int,
    num_local_experts: int,
    world_size: int,
    num_chunks: int,
    *,
    block_tokens: int | None = None,
    out: SendOutputs | None = None,
) -> EPSendSide:
    """The plan's send side for top-K routing, equal bit for bit to ``send_side.send_side_torch`` (module docstring),
    and the routing's index stats (``IndexStats``).

    Args:
        indices_TK: int32/int64 [T, K] GLOBAL expert ids in [0, E), E = L*P (any strides). Bad ids do not
            crash nor write out of bounds (destinations are clamped as the reference does); validation
            rejects them elsewhere, from the index stats.
        scores_TK: [T, K] float32/bf16/fp16/float64 (any strides; only read, autograd untouched). Its bits
            ride in ``pair_meta_RC`` as ``send_side.score_columns`` puts them: C = 2 columns for float64, else 1.
        num_tokens: T (must equal indices_TK.shape[0]; T = 0 gives empty outputs and offsets [0]).
        num_local_experts: L >= 1.
        world_size: P in [1, MAX_RANKS].
        num_chunks: N >= 1 (N * P <= MAX_SEGMENTS).
        block_tokens: tokens per program, a power of two; None: 128, fewer for P > 4 (BT * PP = 512, BT >= 4).
            Any value gives the same result (the tests use small ones to cover several tiles).
        out: where the counts and index stats go (``SendOutputs``); None: new tensors.
    Three launches, no host sync; sizes come from the shapes only.
    """
    _check(indices_TK, scores_TK, num_tokens, num_local_experts, world_size, num_chunks)
    T, K = indices_TK.shape
    L, P, N = num_local_experts, world_size, num_chunks
    R, NP, device = T * K, N * P, indices_TK.device
    f64 = scores_TK.dtype == torch.float64
    i64 = dict(dtype=torch.int64, device=device)
    # One allocation for the int64 outputs sized by R (views below): fewer allocator calls on the host.
    rows_R = torch.empty(3, R, **i64)
    order, send_tok, comb_order = rows_R[0], rows_R[1], rows_R[2]
    meta = torch.empty(R, 4 if f64 else 3, dtype=torch.int32, device=device)
    if out is None:
        out = SendOutputs.new(NP, device)
    stats = IndexStats(out.minmax, out.duplicate)
    if T == 0:
        for t in out:
            t.fill_(0 if t is out.rows_NP or t is out.pairs_NP else -1)
        return EPSendSide(order, send_tok, comb_order, torch.zeros(1, **i64), meta, out.rows_NP, out.pairs_NP, stats)
    offsets = torch.empty(T + 1, **i64)

    BT, PP, J = tiling(T, N, P, block_tokens, "ep_send_side")
    n_tiles = N * J
    b = ScanBuffers.new(NP, J, n_tiles, device)
    grid = (J, N)
    st, sk = indices_TK.stride()
    KP = triton.next_power_of_2(K)
    _count_kernel[grid](
        indices_TK,
        st,
        sk,
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
        K=K,
        KP=KP,
        BT=BT,
        PP=PP,
    )
    b.scan(NP, J, n_tiles, T, out, offsets)
    if K == 1:  # no pair of a token to compare with
        out.duplicate.fill_(-1)
    _place_kernel[grid](
        indices_TK,
        st,
        sk,
        scores_TK,
        *scores_TK.stride(),
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
        K=K,
        BT=BT,
        PP=PP,
        CC=meta.shape[1],
        IS_F64=f64,
        IS_BF16=scores_TK.dtype == torch.bfloat16,
        FILL=triton.next_power_of_2(BT * K),
    )
    return EPSendSide(order, send_tok, comb_order, offsets, meta, out.rows_NP, out.pairs_NP, stats)
