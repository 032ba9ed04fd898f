"""Receive-side routing of expert-parallel dispatch in ONE Triton launch (replaces about 20 small PyTorch ops).

Shape legend: Q received pairs, U received rows, P ranks, N chunks, L local experts, C int32 columns of the
pair metadata (column 0: row within its (chunk, source) segment, column 1: local expert; more columns, e.g.
score bits, are ignored). Segments j = c * P + p (chunk c, source rank p) follow each other in the receive
buffers; segment j holds ``counts[p, c*P + rank]`` rows and ``counts[p, pair_base + c*P + rank]`` pairs,
``counts`` being the all-gathered int64 split sizes of the plan (still on the device: no host sync).

Outputs (int32), as ``recv_side.recv_rows_keys_torch`` (the reference and the CPU path):
    row_Q          receive-buffer row of each pair (segment's first row + row within the segment)
    key_Q          expert of each pair over N*L "chunk experts": c * L + local expert
    token_offsets  [U + 1] CSR offsets of each row's pairs: the first pair of row u, Q at the end

Each program takes BLOCK pairs and walks the N*P segment sizes (at most 16 * P) to place them. Every
received row has at least one pair and row_Q steps by 0 or 1, so the first pair of row u is the pair q with
row_Q[q] != row_Q[q - 1]: exactly one writer per ``token_offsets`` element, no atomics, exact integers.
With row slots (``slots.py``: segment j's rows start at j * slot_rows, rows past its count carry no pair), each
program also takes BLOCK rows and writes the offsets of the rows without pairs: the pairs before the next segment.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _recv_rows_keys_kernel(
    meta_ptr,
    C,
    counts_ptr,
    counts_stride,
    pair_base,
    rank,
    P,
    L,
    NP,
    Q,
    U,
    slot_rows,
    row_ptr,
    key_ptr,
    toff_ptr,
    BLOCK: tl.constexpr,
    SLOTTED: tl.constexpr,
):
    pid = tl.program_id(0)
    q = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = q < Q
    qp = q - 1  # the previous pair (same row or the row before)
    rloc = tl.load(meta_ptr + q * C, mask=mask, other=0).to(tl.int64)
    lexp = tl.load(meta_ptr + q * C + 1, mask=mask, other=0).to(tl.int64)
    rloc_p = tl.load(meta_ptr + qp * C, mask=mask & (qp >= 0), other=0).to(tl.int64)
    row = tl.zeros([BLOCK], dtype=tl.int64)
    row_p = tl.zeros([BLOCK], dtype=tl.int64)
    key = tl.zeros([BLOCK], dtype=tl.int64)
    pstart = tl.zeros([1], dtype=tl.int64)
    rstart = tl.zeros([1], dtype=tl.int64)
    u = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # this program's rows (slots only)
    empty_row_off = tl.full([BLOCK], -1, dtype=tl.int64)
    for j in range(0, NP):
        c = j // P
        p = j - c * P
        base = counts_ptr + p.to(tl.int64) * counts_stride + c * P + rank
        n_rows = tl.load(base)
        n_pairs = tl.load(base + pair_base)
        pend = pstart + n_pairs
        row = tl.where((q >= pstart) & (q < pend), rloc + rstart, row)
        key = tl.where((q >= pstart) & (q < pend), lexp + c * L, key)
        row_p = tl.where((qp >= pstart) & (qp < pend), rloc_p + rstart, row_p)
        pstart = pend
        if SLOTTED:
            empty_row_off = tl.where((u >= rstart + n_rows) & (u < rstart + slot_rows), pend, empty_row_off)
            rstart = rstart + slot_rows
        else:
            rstart = rstart + n_rows
    tl.store(row_ptr + q, row.to(tl.int32), mask=mask)
    tl.store(key_ptr + q, key.to(tl.int32), mask=mask)
    first = mask & ((q == 0) | (row != row_p))
    tl.store(toff_ptr + row, q.to(tl.int32), mask=first)
    if SLOTTED:
        tl.store(toff_ptr + u, empty_row_off.to(tl.int32), mask=(u < U) & (empty_row_off >= 0))
    if pid == 0:
        tl.store(toff_ptr + U, Q)


def ep_recv_rows_keys(
    meta_QC: torch.Tensor,
    counts_PW: torch.Tensor,
    *,
    rank: int,
    world_size: int,
    num_local_experts: int,
    num_chunks: int,
    pair_base: int,
    num_recv_rows: int,
    slot_rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row_Q, key_Q, token_offsets) int32 of the received pairs (see the module docstring).

    Args:
        meta_QC: int32 [Q, C >= 2] received pair metadata (row stride C, unit column stride).
        counts_PW: int64 [P, W] all-gathered split sizes (row counts at c*P + r, pair counts at
            pair_base + c*P + r); may be a column slice of a wider tensor (unit column stride).
        rank, world_size, num_local_experts, num_chunks: r, P, L, N.
        pair_base: column offset of the pair counts in ``counts_PW``.
        num_recv_rows: U (host-known after the plan's sync).
        slot_rows: C when the rows arrived in slots of C rows per (chunk, source) (``slots.py``), else 0.
    """
    Q = meta_QC.shape[0]
    if meta_QC.dtype != torch.int32 or meta_QC.dim() != 2 or meta_QC.shape[1] < 2 or meta_QC.stride(1) != 1:
        raise ValueError(f"ep_recv_rows_keys: meta_QC must be int32 [Q, C >= 2], got {meta_QC.dtype} {meta_QC.shape}")
    if counts_PW.dtype != torch.int64 or counts_PW.stride(1) != 1 or counts_PW.shape[0] != world_size:
        raise ValueError(
            f"ep_recv_rows_keys: counts_PW must be int64 [P = {world_size}, W] with unit column stride, got "
            f"{counts_PW.dtype} {tuple(counts_PW.shape)} strides {counts_PW.stride()}"
        )
    device = meta_QC.device
    row_Q = torch.empty(Q, dtype=torch.int32, device=device)
    key_Q = torch.empty(Q, dtype=torch.int32, device=device)
    token_offsets = torch.empty(num_recv_rows + 1, dtype=torch.int32, device=device)
    grid = (max(1, triton.cdiv(max(Q, num_recv_rows) if slot_rows else Q, _BLOCK)),)
    _recv_rows_keys_kernel[grid](
        meta_QC,
        meta_QC.stride(0),
        counts_PW,
        counts_PW.stride(0),
        pair_base,
        rank,
        world_size,
        num_local_experts,
        num_chunks * world_size,
        Q,
        num_recv_rows,
        slot_rows,
        row_Q,
        key_Q,
        token_offsets,
        BLOCK=_BLOCK,
        SLOTTED=bool(slot_rows),
    )
    return row_Q, key_Q, token_offsets
