"""Deterministic fp32 gather-and-sum over each token's routed pairs (SonicMoE's "O kernel").

Shape legend: see ``kernels/routing.py`` (T tokens, D hidden, R routed pairs).

    out_TD[t] = sum_{j in token_offsets[t] : token_offsets[t+1]} w_R[j] * rows_RD[s_reverse_scatter_idx[j]]

``w_R`` is optional (forward: the routing scores; backward dX: no weights). One program owns one token's
output row (up to 8 D-blocks of BLOCK_D, one after the other) and walks that token's pairs in ascending order,
BLOCK_J at a time, summing in fp32 with a fixed reduction tree: no atomics, so the result is bitwise
reproducible, and the same for any launch parameters with the same BLOCK_J. Works for top-K (token_offsets =
K*t, which ``meta.pairs_per_token`` lets the kernel compute) and for flat routing with any number of pairs per
token (CSR offsets).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..routing import RoutingMetadata

_ROW_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _gather_sum_kernel(
    rows_ptr,
    w_ptr,
    rev_ptr,
    tok_off_ptr,
    out_ptr,
    D,
    stride_rows,
    stride_out,
    HAS_W: tl.constexpr,
    FIXED_K: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D_TILES: tl.constexpr,
):
    # FIXED_K > 0: every token has exactly FIXED_K pairs (top-K: token_offsets[t] = K*t), so the pair range
    # needs no load of token_offsets (one dependent load less before the row gather). D_TILES: D-blocks per
    # program, walked in order (the pair indices and weights are re-read per block, from cache).
    t = tl.program_id(0).to(tl.int64)
    if FIXED_K > 0:
        start = t * FIXED_K
        end = start + FIXED_K
    else:
        start = tl.load(tok_off_ptr + t).to(tl.int64)
        end = tl.load(tok_off_ptr + t + 1).to(tl.int64)
    for dt in tl.static_range(D_TILES):
        d = (tl.program_id(1) * D_TILES + dt) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_mask = d < D
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for j0 in range(start, end, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            j_mask = j < end
            row = tl.load(rev_ptr + j, mask=j_mask, other=0).to(tl.int64)
            vals = tl.load(
                rows_ptr + row[:, None] * stride_rows + d[None, :],
                mask=j_mask[:, None] & d_mask[None, :],
                other=0.0,
            ).to(tl.float32)
            if HAS_W:
                w = tl.load(w_ptr + j, mask=j_mask, other=0.0).to(tl.float32)
                vals = vals * w[:, None]
            acc += tl.sum(vals, axis=0)
        tl.store(out_ptr + t * stride_out + d, acc.to(out_ptr.dtype.element_ty), mask=d_mask)


def gather_sum(
    rows_RD: torch.Tensor,
    meta: RoutingMetadata,
    weights_R: torch.Tensor | None,
    *,
    pairs_per_token: int = 8,
) -> torch.Tensor:
    """[T, D] in rows' dtype: per token, the (weighted) fp32 sum of its pairs' rows, in pair order.

    Args:
        rows_RD: expert-sorted rows [R, D] (fp16/bf16/fp32, unit stride along D); rows past the pair count may
            follow (read only through ``s_reverse_scatter_idx``: the combine sums rows of a slotted buffer).
        meta: routing metadata (uses ``s_reverse_scatter_idx`` and ``token_offsets``).
        weights_R: per flat pair weights [R] (any float dtype, read as fp32), or None for a plain sum.
        pairs_per_token: expected pairs per token when ``meta.pairs_per_token`` is 0 (CSR routing); sets how
            many pairs one step loads (the power of two up to 16 at or below it). Any count is correct, this only
            tunes speed.
    """
    if rows_RD.dtype not in _ROW_DTYPES:
        raise ValueError(f"gather_sum: rows dtype must be one of {_ROW_DTYPES}, got {rows_RD.dtype}")
    if rows_RD.dim() != 2 or (rows_RD.shape[1] > 1 and rows_RD.stride(1) != 1):
        raise ValueError(f"gather_sum: rows must be 2-D with unit stride along D, got {tuple(rows_RD.stride())}")
    D, R = rows_RD.shape[1], meta.num_rows
    if rows_RD.shape[0] < R:
        raise ValueError(
            f"gather_sum: rows.shape[0] must be at least the routed pair count {R}, got {rows_RD.shape[0]}"
        )
    if weights_R is not None and weights_R.numel() != R:
        raise ValueError(f"gather_sum: weights must have {R} elements, got {weights_R.numel()}")
    T = meta.token_offsets.numel() - 1
    fixed_k = meta.pairs_per_token
    if fixed_k and T * fixed_k != R:
        raise ValueError(f"gather_sum: meta.pairs_per_token = {fixed_k} needs {T} x {fixed_k} rows, got {R}")
    out_TD = torch.empty(T, D, dtype=rows_RD.dtype, device=rows_RD.device)
    if T == 0 or D == 0:
        return out_TD
    # Pairs per step: all K at once for top-K; for CSR routing the largest power of two <= the expected count,
    # so that a token with the usual count takes one full step and one with more an extra one (a step of the next
    # power of two would mostly load masked lanes, measured slower over rounded routings).
    if fixed_k:
        block_j = min(16, triton.next_power_of_2(fixed_k))
    else:
        block_j = min(16, 1 << (max(1, pairs_per_token).bit_length() - 1))
    block_d = min(triton.next_power_of_2(D), max(64, 8192 // block_j), 1024)
    # One program walks all of a token's D-blocks (up to 8): measured faster than one program per (token, D-block)
    # and as fast as sonic-moe's kernel on the same inputs (docs/PERF.md, "Experts on one H100").
    n_blocks = triton.cdiv(D, block_d)
    d_tiles = min(n_blocks, 8)
    grid = (T, triton.cdiv(n_blocks, d_tiles))
    w = weights_R.detach().contiguous() if weights_R is not None else rows_RD  # dummy pointer when unused
    _gather_sum_kernel[grid](
        rows_RD,
        w,
        meta.s_reverse_scatter_idx,
        meta.token_offsets,
        out_TD,
        D,
        rows_RD.stride(0),
        out_TD.stride(0),
        HAS_W=weights_R is not None,
        FIXED_K=fixed_k,
        BLOCK_J=block_j,
        BLOCK_D=block_d,
        D_TILES=d_tiles,
        num_warps=4,
    )
    return out_TD
