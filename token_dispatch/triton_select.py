"""Per-row top-n selection over int32 keys in ONE Triton launch: the cut of token rounding without expert
parallelism (``rounding.select_top_n`` is the PyTorch reference and the CPU path; same outputs).

Shape legend: E rows (experts), T columns (tokens), W the width of the selected-token lists.

Row e selects its ``n[e]`` largest keys, ties going to the lower token. The selection is described by its last
element, the ``n[e]``-th in the order (key descending, token ascending): ``thr[e]`` its key, ``cut[e]`` its token;
the selected set is ``key > thr`` or ``key == thr and token <= cut``. Rows with ``n[e] == 0`` get
``thr = INT32_MAX, cut = -1`` (nothing). The selected tokens are also written, ascending, into ``out[e, :n[e]]``.

One program per row. ``thr`` is found bit by bit (32 counting passes over the row); ``cut`` is the last tie at
``thr`` (one pass) unless ties straddle the cut, then it is found bit by bit over the token index. A row of up
to ``_MAX_BLOCK`` keys is loaded once and searched in registers; longer rows are re-read per pass (from L2: an
[E, T] int32 key matrix of the sizes token rounding meets fits in it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_BLOCK = 16384


@triton.jit
def _chunk(keys, row_ptr, t, T, NUM_CHUNKS: tl.constexpr):
    """The row's keys at tokens t, shifted to [0, 2^32): the register block when the row is one chunk."""
    if NUM_CHUNKS == 1:
        return keys
    return tl.load(row_ptr + t, mask=t < T, other=0).to(tl.int64) + 2147483648


@triton.jit
def _count(key_ptr, T, cand, BLOCK_T: tl.constexpr, NUM_CHUNKS: tl.constexpr, keys, cmp: tl.constexpr, cut):
    """How many keys of the row are >= cand (cmp 0), > cand (cmp 1), or == cand with token < cut (cmp 2)."""
    offs = tl.arange(0, BLOCK_T)
    total = tl.zeros([], dtype=tl.int32)
    for c in range(NUM_CHUNKS):
        t = c * BLOCK_T + offs
        k = _chunk(keys, key_ptr, t, T, NUM_CHUNKS)
        valid = t < T
        if cmp == 0:
            hit = valid & (k >= cand)
        elif cmp == 1:
            hit = valid & (k > cand)
        else:
            hit = valid & (k == cand) & (t < cut)
        total += tl.sum(hit.to(tl.int32), axis=0)
    return total


@triton.jit
def _top_n_rows_kernel(
    key_ptr,
    n_ptr,
    thr_ptr,
    cut_ptr,
    out_ptr,
    T,
    W,
    T_BITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    row = tl.program_id(0)
    n = tl.load(n_ptr + row).to(tl.int32)
    row_ptr = key_ptr + row.to(tl.int64) * T
    offs = tl.arange(0, BLOCK_T)
    # Keys as int64 shifted to [0, 2^32): unsigned order, so the threshold is built from the top bit down.
    keys = tl.load(row_ptr + offs, mask=offs < T, other=0).to(tl.int64) + 2147483648
    thr = tl.zeros([], dtype=tl.int64) + 4294967295  # n == 0: above every key
    cut = tl.zeros([], dtype=tl.int32) - 1
    if n > 0:
        thr = tl.zeros([], dtype=tl.int64)
        for i in range(32):
            cand = thr | (tl.zeros([], dtype=tl.int64) + 1) << (31 - i)
            if _count(row_ptr, T, cand, BLOCK_T, NUM_CHUNKS, keys, 0, 0) >= n:
                thr = cand
        need = n - _count(row_ptr, T, thr, BLOCK_T, NUM_CHUNKS, keys, 1, 0)  # ties at thr to take (>= 1)
        if _count(row_ptr, T, thr, BLOCK_T, NUM_CHUNKS, keys, 0, 0) == n:  # every tie at thr is taken: the last
            cut = tl.zeros([], dtype=tl.int32) - 1
            for c in range(NUM_CHUNKS):
                t = c * BLOCK_T + offs
                k = _chunk(keys, row_ptr, t, T, NUM_CHUNKS)
                cut = tl.maximum(cut, tl.max(tl.where((t < T) & (k == thr), t, -1), axis=0))
        else:  # ties straddle the cut
            # The need-th tie in token order: the largest p with fewer than ``need`` ties below it.
            p = tl.zeros([], dtype=tl.int32)
            for i in range(T_BITS):
                cand_t = p | (1 << (T_BITS - 1 - i))
                if _count(row_ptr, T, thr, BLOCK_T, NUM_CHUNKS, keys, 2, cand_t) < need:
                    p = cand_t
            cut = p
        # The selected tokens, ascending, into out[row, :n].
        base = tl.zeros([], dtype=tl.int32)
        for c in range(NUM_CHUNKS):
            t = c * BLOCK_T + offs
            k = _chunk(keys, row_ptr, t, T, NUM_CHUNKS)
            sel = (t < T) & ((k > thr) | ((k == thr) & (t <= cut)))
            pos = base + tl.cumsum(sel.to(tl.int32), axis=0) - 1
            tl.store(out_ptr + row.to(tl.int64) * W + pos, t.to(tl.int32), mask=sel)
            base += tl.sum(sel.to(tl.int32), axis=0)
    tl.store(thr_ptr + row, (thr - 2147483648).to(tl.int32))
    tl.store(cut_ptr + row, cut)


def top_n_rows(key_ET: torch.Tensor, n_E: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(thr [E] int32, cut [E] int32, tokens [E, width] int32, -1 past n) of each row's ``n_E`` largest keys
    (ties: lower token first). ``key_ET`` int32 [E, T] contiguous; ``n_E`` <= min(width, T) per row."""
    E, T = key_ET.shape
    key_ET = key_ET.contiguous()
    thr = torch.empty(E, dtype=torch.int32, device=key_ET.device)
    cut = torch.empty(E, dtype=torch.int32, device=key_ET.device)
    out = torch.full((E, width), -1, dtype=torch.int32, device=key_ET.device)
    if E == 0 or T == 0:
        thr.fill_(torch.iinfo(torch.int32).max)
        cut.fill_(-1)
        return thr, cut, out
    block = min(triton.next_power_of_2(T), _MAX_BLOCK)
    _top_n_rows_kernel[(E,)](
        key_ET,
        n_E,
        thr,
        cut,
        out,
        T,
        width,
        T_BITS=max(int(T - 1).bit_length(), 1),
        BLOCK_T=block,
        NUM_CHUNKS=triton.cdiv(T, block),
        num_warps=16 if block >= 8192 else 8 if block >= 2048 else 4,
    )
    return thr, cut, out
