"""The slots' kernels (``slots.py``), each ONE Triton launch for about 15-20 small PyTorch ops whose host time sits
before the plan's sync, where the host paces the GPU.

Row slots' layout. Shape legend (as ``slots.py``): R send-side entries (send rows first, S of them, ordered by
destination), P ranks, C rows per slot. Outputs, as ``slots.slot_layout_torch`` (the reference and the CPU path):
    pos_R      [R] int64: slot row p * C + j of the j-th send row to destination p; P * C for entries past S and for
               rows past a slot's C
    token_idx  [P * C] int64: the token of every slot row; 0 for rows past a slot's count
Each program takes BLOCK entries of both outputs and walks the P destination counts (a prefix sum) to place them:
one writer per element, integers only.

Received pairs in slots (``recv_side.slotted_recv_metadata``): Q_max = P * Cq entries, ``slot_of`` the pair slot of
each (Q_max for placeholders). Outputs, as ``recv_side.slotted_rows_keys_torch``: row_Q and key_Q per entry (one
writer each) and the rows' pair counts by integer atomics (order-free, so exact), scanned by one ``torch.cumsum``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _slot_layout_kernel(tok_ptr, rows_ptr, rows_stride, R, P, C, pos_ptr, slot_tok_ptr, BLOCK: tl.constexpr):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    slot_of_e = e // C  # e as a slot row: its destination ...
    row_in_slot = e - slot_of_e * C  # ... and its row there
    pos = tl.full([BLOCK], 0, dtype=tl.int64) + P * C
    first = tl.zeros([BLOCK], dtype=tl.int64)  # first send row of e's slot
    count = tl.zeros([BLOCK], dtype=tl.int64)  # send rows of e's slot
    start = tl.zeros([1], dtype=tl.int64)
    for p in range(0, P):
        n = tl.load(rows_ptr + p * rows_stride)
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
    int64 [P] of any stride, e.g. a column of the counts matrix; both on the device)."""
    if send_token_idx_R.dtype != torch.int64 or rows_P.dtype != torch.int64:
        raise ValueError(
            f"slot_layout_triton: send_token_idx_R and rows_P must be int64, got {send_token_idx_R.dtype} and "
            f"{rows_P.dtype}"
        )
    P, C, R = world_size, slots, send_token_idx_R.numel()
    device = send_token_idx_R.device
    pos_R = torch.empty(R, dtype=torch.int64, device=device)
    token_idx = torch.empty(P * C, dtype=torch.int64, device=device)
    grid = (max(1, triton.cdiv(max(R, P * C), _BLOCK)),)
    stride = rows_P.stride(0) if rows_P.numel() > 1 else 1
    _slot_layout_kernel[grid](send_token_idx_R, rows_P, stride, R, P, C, pos_R, token_idx, BLOCK=_BLOCK)
    return pos_R, token_idx


@triton.jit
def _slotted_rows_keys_kernel(
    slot_ptr,
    pairs_ptr,
    pairs_stride,
    Q_max,
    P,
    Cq,
    C,
    L,
    U,
    row_ptr,
    key_ptr,
    per_row_ptr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < Q_max
    slot = tl.load(slot_ptr + i, mask=mask, other=0)
    real = slot < Q_max
    source = tl.minimum(slot // Cq, P - 1)
    at = tl.minimum(slot, Q_max - 1)  # a placeholder reads the last slot's pair, then drops it
    r = tl.load(pairs_ptr + at * pairs_stride, mask=mask, other=0).to(tl.int64)
    e = tl.load(pairs_ptr + at * pairs_stride + 1, mask=mask, other=0).to(tl.int64)
    row = tl.where(real, tl.minimum(tl.maximum(r, 0), C - 1) + source * C, U)
    key = tl.where(real, tl.minimum(tl.maximum(e, 0), L), L)
    tl.store(row_ptr + i, tl.minimum(row, tl.maximum(U - 1, 0)).to(tl.int32), mask=mask)
    tl.store(key_ptr + i, key.to(tl.int32), mask=mask)
    tl.atomic_add(per_row_ptr + row + 1, tl.full([BLOCK], 1, dtype=tl.int32), mask=mask, sem="relaxed")


def slotted_rows_keys_triton(
    received_pairs: torch.Tensor,
    slot_of: torch.Tensor,
    *,
    world_size: int,
    num_local_experts: int,
    row_slots: int,
    pair_slots: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row_Q, key_Q, token_offsets) of ``recv_side.slotted_rows_keys_torch`` in one launch and a scan
    (``received_pairs`` int32 [P * Cq, columns] with unit column stride, ``slot_of`` int64 [P * Cq])."""
    if received_pairs.dtype != torch.int32 or received_pairs.stride(1) != 1 or slot_of.dtype != torch.int64:
        raise ValueError(
            f"slotted_rows_keys_triton: received_pairs must be int32 with unit column stride and slot_of int64, got "
            f"{received_pairs.dtype} stride {received_pairs.stride()} and {slot_of.dtype}"
        )
    P, L, C, Cq, device = world_size, num_local_experts, row_slots, pair_slots, received_pairs.device
    Q_max, U = P * Cq, P * C
    row_Q = torch.empty(Q_max, dtype=torch.int32, device=device)
    key_Q = torch.empty(Q_max, dtype=torch.int32, device=device)
    per_row = torch.zeros(U + 2, dtype=torch.int32, device=device)  # [0] stays 0; [U + 1] takes the placeholders
    grid = (max(1, triton.cdiv(Q_max, _BLOCK)),)
    _slotted_rows_keys_kernel[grid](
        slot_of, received_pairs, received_pairs.stride(0), Q_max, P, Cq, C, L, U, row_Q, key_Q, per_row, BLOCK=_BLOCK
    )
    return row_Q, key_Q, torch.cumsum(per_row[: U + 1], 0, dtype=torch.int32)
