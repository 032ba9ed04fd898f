"""Two micro-batches' weight-gradient rows merged by expert, in one Triton launch per micro-batch
(``kernels/weight_grad_pairs.py``; ``merge_rows_torch`` there is the reference and the path off CUDA).

Shape legend: see ``kernels/routing.py``; a and b the two micro-batches, R_a / R_b their row counts (padding
rows past ``expert_offsets[E]`` included), G / F the widths of dH and A'.

Merged layout: expert e's rows are a's rows of e, then b's rows of e; the padding rows of a, then those of b,
come after every real row. So a's row r of expert e moves to r + off_b[e] (e = E for its padding rows: all of
b's real rows come first), and b's row r of expert e to r + off_a[e + 1] (r + R_a for its padding rows).
One program moves BLOCK_R rows of one micro-batch: their expert (a count of the expert end offsets <= r), their
destination, their gather index (b's shifted by T_a: b's tokens follow a's in the merged X) and their dH and A'
rows, BLOCK_C columns at a time. Plain stores to distinct rows: deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows x columns per step, warps: as fast as the best of the other tilings measured at the end-to-end shapes; the
# merge runs near the GPU's copy bandwidth.
_BLOCK_R, _BLOCK_C, _BLOCK_E, _WARPS = 8, 1024, 128, 4


@triton.jit
def _merge_rows_kernel(
    dh_ptr,
    ap_ptr,
    idx_ptr,
    off_self_ptr,
    off_other_ptr,
    dh_out_ptr,
    ap_out_ptr,
    idx_out_ptr,
    R,
    E,
    G,
    F,
    idx_shift,
    pad_shift,
    LATER: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < R
    e = tl.zeros([BLOCK_R], dtype=tl.int32)
    for e0 in range(0, E, BLOCK_E):
        j = e0 + tl.arange(0, BLOCK_E)
        ends = tl.load(off_self_ptr + 1 + j, mask=j < E, other=2147483647)
        e += tl.sum((ends[None, :] <= r[:, None]).to(tl.int32), axis=1)
    if LATER:  # after the earlier micro-batch's rows of the same expert; padding after all of its rows
        shift = tl.load(off_other_ptr + 1 + e, mask=ok & (e < E), other=0)
        shift = tl.where(e < E, shift, pad_shift)
    else:  # before the later micro-batch's rows of this expert
        shift = tl.load(off_other_ptr + e, mask=ok, other=0)
    dst = (r + shift).to(tl.int64)
    r64 = r.to(tl.int64)
    tl.store(idx_out_ptr + dst, tl.load(idx_ptr + r64, mask=ok, other=0) + idx_shift, mask=ok)
    for c0 in range(0, G, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        m = ok[:, None] & (c < G)[None, :]
        v = tl.load(dh_ptr + r64[:, None] * G + c[None, :], mask=m)
        tl.store(dh_out_ptr + dst[:, None] * G + c[None, :], v, mask=m)
    for c0 in range(0, F, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        m = ok[:, None] & (c < F)[None, :]
        v = tl.load(ap_ptr + r64[:, None] * F + c[None, :], mask=m)
        tl.store(ap_out_ptr + dst[:, None] * F + c[None, :], v, mask=m)


def merge_rows_triton(dH_a, ap_a, idx_a, off_a, dH_b, ap_b, idx_b, off_b, num_tokens_a: int):
    """(dH [R_a + R_b, G], A' [R_a + R_b, F], gather index [R_a + R_b] int32) in the merged layout (module
    docstring); rows contiguous, offsets and indices int32 on the rows' device."""
    Ra, G = dH_a.shape
    Rb, F = ap_b.shape[0], ap_a.shape[1]
    E = off_a.numel() - 1
    dH = torch.empty(Ra + Rb, G, dtype=dH_a.dtype, device=dH_a.device)
    ap = torch.empty(Ra + Rb, F, dtype=ap_a.dtype, device=ap_a.device)
    idx = torch.empty(Ra + Rb, dtype=torch.int32, device=dH_a.device)
    for later, (dh_s, ap_s, idx_s, off_s, off_o, R, shift) in enumerate(
        ((dH_a, ap_a, idx_a, off_a, off_b, Ra, 0), (dH_b, ap_b, idx_b, off_b, off_a, Rb, num_tokens_a))
    ):
        if R == 0:
            continue
        _merge_rows_kernel[(triton.cdiv(R, _BLOCK_R),)](
            dh_s, ap_s, idx_s, off_s, off_o, dH, ap, idx, R, E, G, F, shift, Ra,
            LATER=bool(later), BLOCK_R=_BLOCK_R, BLOCK_C=_BLOCK_C, BLOCK_E=_BLOCK_E, num_warps=_WARPS,
        )  # fmt: skip
    return dH, ap, idx
