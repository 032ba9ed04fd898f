"""The row slots' layout (``slots.py``) in ONE Triton launch (replaces about 15 small PyTorch ops, whose host time
sits in the plan before its sync, where the host paces the GPU).

Shape legend (as ``slots.py``): R send-side entries (send rows first, S of them, ordered by destination), P ranks,
C rows per slot. Outputs, as ``slots.slot_layout_torch`` (the reference and the CPU path):
    pos_R      [R] int64: slot row p * C + j of the j-th send row to destination p; P * C for entries past S and for
               rows past a slot's C
    token_idx  [P * C] int64: the token of every slot row; 0 for rows past a slot's count

Each program takes BLOCK entries of both outputs and walks the P destination counts (a prefix sum) to place them:
one writer per element, integers only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _slot_layout_kernel(tok_ptr, rows_ptr, R, P, C, pos_ptr, slot_tok_ptr, BLOCK: tl.constexpr):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    slot_of_e = e // C  # e as a slot row: its destination ...
    row_in_slot = e - slot_of_e * C  # ... and its row there
    pos = tl.full([BLOCK], 0, dtype=tl.int64) + P * C
    first = tl.zeros([BLOCK], dtype=tl.int64)  # first send row of e's slot
    count = tl.zeros([BLOCK], dtype=tl.int64)  # send rows of e's slot
    start = tl.zeros([1], dtype=tl.int64)
    for p in range(0, P):
        n = tl.load(rows_ptr + p)
        here = (e >= start) & (e < start + n) & (e - start < C)
        pos = tl.where(here, p * C + e - start, pos)
        first = tl.where(slot_of_e == p, start, first)
        count = tl.where(slot_of_e == p, n, count)
        start = start + n
    tl.store(pos_ptr + e, pos, mask=e < R)
    carries = (e < P * C) & (row_in_slot < count)
    tok = tl.load(tok_ptr + first + row_in_slot, mask=carries, other=0)
    tl.store(slot_tok_ptr + e, tok, mask=e < P * C)


def slot_layout_triton(send_token_idx_R: torch.Tensor, rows_P: torch.Tensor, world_size: int, slots: int):
    """(pos_R, token_idx) of ``slots.slot_layout_torch`` in one launch (``send_token_idx_R`` int64 [R], ``rows_P``
    int64 [P] with unit stride, or one count; both on the device)."""
    unit = rows_P.numel() < 2 or rows_P.stride(0) == 1  # one count: any stride (a column of one rank's counts)
    if send_token_idx_R.dtype != torch.int64 or rows_P.dtype != torch.int64 or not unit:
        raise ValueError(
            f"slot_layout_triton: send_token_idx_R and rows_P must be int64 (rows_P with unit stride), got "
            f"{send_token_idx_R.dtype} and {rows_P.dtype} stride {rows_P.stride()}"
        )
    P, C, R = world_size, slots, send_token_idx_R.numel()
    device = send_token_idx_R.device
    pos_R = torch.empty(R, dtype=torch.int64, device=device)
    token_idx = torch.empty(P * C, dtype=torch.int64, device=device)
    grid = (max(1, triton.cdiv(max(R, P * C), _BLOCK)),)
    _slot_layout_kernel[grid](send_token_idx_R, rows_P, R, P, C, pos_R, token_idx, BLOCK=_BLOCK)
    return pos_R, token_idx
