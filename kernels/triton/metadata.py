"""Routing metadata (SonicMoE's design) in four Triton launches, device-side and without a host sync.

Shape legend: see ``kernels/routing.py``; additionally NT = number of pair tiles of BLOCK pairs.

1. ``_tile_rank_kernel`` (grid NT): for each pair j of a tile, its rank among the earlier pairs of the same
   expert inside the tile (local_rank_R), and the tile's per-expert count (tile_counts_NTE, written by the
   last pair of each expert in the tile: one writer per element, no atomics).
2. ``_tile_scan_kernel`` (grid E blocks): exclusive scan of tile_counts_NTE over tiles, in place, and the
   per-expert totals.
3. ``_expert_scan_kernel`` (one program): exclusive scan of the totals -> expert_offsets [E+1].
4. ``_scatter_kernel`` (grid NT): row(j) = expert_offsets[e] + tile_prefix[tile, e] + local_rank[j]; writes
   s_scatter_idx[row] = j, x_gather_idx[row] = token(j), s_reverse_scatter_idx[j] = row.

Rows of one expert come out in ascending pair order (a stable sort by expert), as ``compute_metadata_torch``.
Integer arithmetic only, so results are exact and identical run to run. Expert indices must lie in [0, E).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..routing import RoutingMetadata

_CHUNK = 16  # pairs compared against the whole tile per step (bounds the [CHUNK, BLOCK] compare in registers)
# Launch parameters (results do not depend on them):
# 128 / 256 x 8 was the fastest of six combinations at every benchmark shape measured (docs/PERF.md, "Experts on one
# H100").
TILE_BLOCK = 128  # pairs per tile of the rank kernel (its work is R * TILE_BLOCK compares), grown for large E
SCAN_BLOCK_T, SCAN_BLOCK_E = 256, 8  # the tile scan: tiles per step x experts per program (more programs, fewer steps)


@triton.jit
def _tile_rank_kernel(expert_ptr, R, E, local_rank_ptr, tile_counts_ptr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    tile = tl.program_id(0).to(tl.int64)
    pos = tl.arange(0, BLOCK)
    j = tile * BLOCK + pos
    j_mask = j < R
    e = tl.load(expert_ptr + j, mask=j_mask, other=-1).to(tl.int32)
    before = tl.zeros([BLOCK], dtype=tl.int32)
    after = tl.zeros([BLOCK], dtype=tl.int32)
    for c in tl.static_range(0, BLOCK // CHUNK):
        ipos = c * CHUNK + tl.arange(0, CHUNK)
        i = tile * BLOCK + ipos
        ei = tl.load(expert_ptr + i, mask=i < R, other=-2).to(tl.int32)
        same = ei[:, None] == e[None, :]
        before += tl.sum((same & (ipos[:, None] < pos[None, :])).to(tl.int32), axis=0)
        after += tl.sum((same & (ipos[:, None] > pos[None, :])).to(tl.int32), axis=0)
    tl.store(local_rank_ptr + j, before, mask=j_mask)
    is_last = j_mask & (after == 0)
    tl.store(tile_counts_ptr + tile * E + e, before + 1, mask=is_last)


@triton.jit
def _tile_scan_kernel(tile_counts_ptr, n_tiles, E, totals_ptr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = e < E
    carry = tl.zeros([BLOCK_E], dtype=tl.int32)
    for t0 in range(0, n_tiles, BLOCK_T):
        t = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        mask = (t[:, None] < n_tiles) & e_mask[None, :]
        ptrs = tile_counts_ptr + t[:, None] * E + e[None, :]
        c = tl.load(ptrs, mask=mask, other=0)
        incl = tl.cumsum(c, axis=0)
        tl.store(ptrs, incl - c + carry[None, :], mask=mask)
        carry += tl.sum(c, axis=0)
    tl.store(totals_ptr + e, carry, mask=e_mask)


@triton.jit
def _expert_scan_kernel(totals_ptr, E, offsets_ptr, BLOCK_E: tl.constexpr):
    carry = tl.zeros([1], dtype=tl.int32)
    tl.store(offsets_ptr + tl.arange(0, 1), carry)
    for e0 in range(0, E, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        c = tl.load(totals_ptr + e, mask=e < E, other=0)
        incl = tl.cumsum(c, axis=0) + carry
        tl.store(offsets_ptr + 1 + e, incl, mask=e < E)
        carry += tl.sum(c, axis=0)


@triton.jit
def _scatter_kernel(
    expert_ptr,
    token_ptr,
    R,
    E,
    local_rank_ptr,
    tile_prefix_ptr,
    offsets_ptr,
    x_gather_ptr,
    s_scatter_ptr,
    s_reverse_ptr,
    BLOCK: tl.constexpr,
    FIXED_K: tl.constexpr,
):
    tile = tl.program_id(0).to(tl.int64)
    j = tile * BLOCK + tl.arange(0, BLOCK)
    j_mask = j < R
    e = tl.load(expert_ptr + j, mask=j_mask, other=0).to(tl.int64)
    if FIXED_K > 0:  # noqa: SIM108 - top-K: pair j belongs to token j // K (no flat token index built or read)
        tok = (j // FIXED_K).to(tl.int32)
    else:
        tok = tl.load(token_ptr + j, mask=j_mask, other=0).to(tl.int32)
    rank = tl.load(local_rank_ptr + j, mask=j_mask, other=0)
    base = tl.load(offsets_ptr + e, mask=j_mask, other=0)
    prefix = tl.load(tile_prefix_ptr + tile * E + e, mask=j_mask, other=0)
    row = base + prefix + rank
    tl.store(s_scatter_ptr + row, j.to(tl.int32), mask=j_mask)
    tl.store(x_gather_ptr + row, tok, mask=j_mask)
    tl.store(s_reverse_ptr + j, row, mask=j_mask)


def _tile_size(R: int, E: int) -> int:
    """Pairs per tile: TILE_BLOCK, grown so the [tiles, E] count matrix stays under 2^24 entries for large E."""
    block = TILE_BLOCK
    while block < 4096 and triton.cdiv(R, block) * E > (1 << 24):
        block *= 2
    return block


def compute_metadata_topk_triton(indices_TK: torch.Tensor, num_experts: int) -> RoutingMetadata:
    """Top-K routing's metadata (``pairs_per_token`` = K) without building the flat token index: the scatter
    kernel derives token = pair // K. Same arrays as ``compute_metadata_triton`` on ``flatten_routing``'s output."""
    T, K = indices_TK.shape
    i32 = dict(device=indices_TK.device, dtype=torch.int32)
    token_offsets = torch.arange(0, T * K + 1, K, **i32) if K else torch.zeros(T + 1, **i32)
    token_idx_R = None if K else torch.empty(0, **i32)
    return compute_metadata_triton(token_idx_R, indices_TK.reshape(-1), token_offsets, num_experts, pairs_per_token=K)


def compute_metadata_triton(
    token_idx_R: torch.Tensor | None,
    expert_idx_R: torch.Tensor,
    token_offsets: torch.Tensor,
    num_experts: int,
    pairs_per_token: int = 0,
) -> RoutingMetadata:
    """Same contract and results as ``routing.compute_metadata_torch`` (int32 arrays, stable by pair).
    ``pairs_per_token`` = K > 0: every token has K pairs (top-K); ``token_idx_R`` may then be None."""
    if token_idx_R is None and pairs_per_token <= 0:
        raise ValueError("compute_metadata_triton: token_idx_R may be None only with pairs_per_token > 0 (top-K)")
    device = expert_idx_R.device
    R, E = expert_idx_R.numel(), num_experts
    if R >= 2**31 - 1:
        raise ValueError(f"compute_metadata_triton: routed pairs must be < 2^31 - 1, got {R}")
    if not 1 <= E < 2**31 // 2:
        raise ValueError(f"compute_metadata_triton: num_experts must be in [1, 2^30), got {E}")
    i32 = dict(device=device, dtype=torch.int32)
    expert_offsets = torch.empty(E + 1, **i32)
    x_gather_idx = torch.empty(R, **i32)
    s_scatter_idx = torch.empty(R, **i32)
    s_reverse_scatter_idx = torch.empty(R, **i32)
    expert_idx_R = expert_idx_R.contiguous()
    token_idx_R = expert_idx_R if token_idx_R is None else token_idx_R.contiguous()  # unread with FIXED_K
    block = _tile_size(R, E)
    n_tiles = triton.cdiv(R, block)
    tile_counts = torch.zeros(max(n_tiles, 1), E, **i32)  # becomes the per-tile exclusive prefix
    local_rank = torch.empty(R, **i32)
    totals = torch.empty(E, **i32)
    if n_tiles:
        _tile_rank_kernel[(n_tiles,)](expert_idx_R, R, E, local_rank, tile_counts, BLOCK=block, CHUNK=_CHUNK)
    _tile_scan_kernel[(triton.cdiv(E, SCAN_BLOCK_E),)](
        tile_counts, n_tiles, E, totals, BLOCK_T=SCAN_BLOCK_T, BLOCK_E=SCAN_BLOCK_E
    )
    _expert_scan_kernel[(1,)](totals, E, expert_offsets, BLOCK_E=1024)
    if n_tiles:
        _scatter_kernel[(n_tiles,)](
            expert_idx_R,
            token_idx_R,
            R,
            E,
            local_rank,
            tile_counts,
            expert_offsets,
            x_gather_idx,
            s_scatter_idx,
            s_reverse_scatter_idx,
            BLOCK=block,
            FIXED_K=pairs_per_token,
        )
    return RoutingMetadata(
        expert_offsets=expert_offsets,
        x_gather_idx=x_gather_idx,
        s_scatter_idx=s_scatter_idx,
        s_reverse_scatter_idx=s_reverse_scatter_idx,
        token_offsets=token_offsets.to(torch.int32),
        pairs_per_token=pairs_per_token,
    )
