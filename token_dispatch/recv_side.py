"""The plan's receive side: the pair metadata that arrived by the plan's pair all-to-alls, turned into a
``FlatRouting``-like ``RoutingMetadata`` over this rank's L local experts whose "tokens" are receive-buffer rows
(the local grouped GEMM gathers straight from the receive buffer: no second permutation), and the scores.

Shape legend (as ``send_side.py``): Q received pairs, U received rows, C int32 columns of the pair metadata,
W columns of the all-gathered counts (header excluded). Nothing here syncs with the host: the split sizes come
from the device copy of the plan's counts exchange (``sizes.py``).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from ..kernels.routing import RoutingMetadata, compute_metadata_torch, run_offsets
from .comm import Pending, all_to_all
from .slots import slot_layout


def scores_from_columns(cols_QC: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``send_side.score_columns`` for the received pairs: [Q] of ``dtype`` (a new tensor)."""
    wire = torch.float64 if dtype == torch.float64 else torch.float32
    s = cols_QC.contiguous().view(wire).reshape(-1)
    return s.to(dtype) if s.dtype != dtype else s


class IncomingPairs:
    """The pair metadata (and score bits) on its way here: one all-to-all per chunk, launched by
    ``launch_pair_all_to_alls`` right after the plan's host sync and waited for only on first use."""

    def __init__(self, pending: Pending, meta_QC: torch.Tensor, counts_PW: torch.Tensor) -> None:
        self._pending, self._meta_QC, self.counts_PW = pending, meta_QC, counts_PW

    def meta_QC(self) -> torch.Tensor:
        self._pending.wait()  # no-op after the first call
        return self._meta_QC


class SlottedPairs:
    """``IncomingPairs``' interface over pairs that arrived in slots before the plan's sync (``slots.py``): compacted
    by ``compact`` on first use (the receive metadata of exact sizes needs them; the experts launched before the
    sync never ask)."""

    def __init__(self, compact, counts_PW: torch.Tensor) -> None:
        self._compact, self._meta_QC, self.counts_PW = compact, None, counts_PW

    def meta_QC(self) -> torch.Tensor:
        if self._meta_QC is None:
            self._meta_QC, self._compact = self._compact(), None
        return self._meta_QC


def launch_pair_all_to_alls(
    pair_meta_RC: torch.Tensor, send_pairs: list[list[int]], recv_pairs: list[list[int]], counts_PW: torch.Tensor, group
) -> IncomingPairs:
    """Send this rank's pair metadata [R, C] to the pairs' destinations, one async all-to-all per chunk
    (``send_pairs`` / ``recv_pairs``: the plan's host split sizes [N][P])."""
    meta_QC = pair_meta_RC.new_empty(sum(map(sum, recv_pairs)), pair_meta_RC.shape[1])
    pending = Pending()
    s0 = r0 = 0
    for out_splits, in_splits in zip(recv_pairs, send_pairs, strict=True):
        s1, r1 = s0 + sum(in_splits), r0 + sum(out_splits)
        pending.add(all_to_all(meta_QC[r0:r1], pair_meta_RC[s0:s1], out_splits, in_splits, group, True))
        s0, r0 = s1, r1
    return IncomingPairs(pending, meta_QC, counts_PW)


def _metadata_builder(device: torch.device):
    """The kernels' Triton metadata on CUDA (4 launches, same results as PyTorch's), PyTorch's elsewhere."""
    if device.type == "cuda":
        try:
            from ..kernels.triton import compute_metadata_triton

            return compute_metadata_triton
        except ImportError:  # no Triton: PyTorch's ops (same contract)
            pass
    return compute_metadata_torch


def recv_rows_keys_torch(
    meta_QC: torch.Tensor,
    counts_PW: torch.Tensor,
    *,
    rank,
    world_size,
    num_local_experts,
    num_chunks,
    pair_base,
    num_recv_rows,
    slot_rows=0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row_Q, key_Q, token_offsets) int32 of the received pairs with PyTorch ops: the reference of (and the
    CPU path for) the one-launch Triton kernel ``triton_recv.py`` (its docstring defines them). ``slot_rows``: C
    when the rows arrived in slots of C rows per source (``slots.py``), else 0."""
    N, P, L, device = num_chunks, world_size, num_local_experts, counts_PW.device
    Q, U = meta_QC.shape[0], num_recv_rows
    cols = rank + P * torch.arange(N, device=device)  # column of (chunk c, destination = this rank)
    recv_rows_NP = counts_PW[:, cols].t().reshape(-1)  # [(chunk, source)] rows received
    recv_pairs_NP = counts_PW[:, pair_base + cols].t().reshape(-1)
    seg_Q = torch.repeat_interleave(torch.arange(N * P, device=device), recv_pairs_NP, output_size=Q)
    if slot_rows:  # first receive row of each (chunk, source): its slot, or after the segments before it
        seg_row0 = torch.arange(N * P, device=device) * slot_rows
    else:
        seg_row0 = torch.cumsum(recv_rows_NP, 0) - recv_rows_NP
    row_Q = meta_QC[:, 0].long() + seg_row0[seg_Q]  # row in the whole receive buffer (non-decreasing)
    key_Q = torch.div(seg_Q, P, rounding_mode="floor") * L + meta_QC[:, 1].long()  # (chunk, local expert)
    token_offsets = run_offsets(row_Q, U)
    return row_Q.int(), key_Q.int(), token_offsets.int()


def _recv_rows_keys(meta_QC: torch.Tensor, counts_PW: torch.Tensor, **kw):
    """One Triton launch on CUDA, PyTorch's ops elsewhere (same int32 results)."""
    if counts_PW.is_cuda:
        try:
            from .triton_recv import ep_recv_rows_keys

            return ep_recv_rows_keys(meta_QC, counts_PW, **kw)
        except ImportError:
            pass
    return recv_rows_keys_torch(meta_QC, counts_PW, **kw)


def recv_metadata(
    incoming: IncomingPairs,
    stages: list[tuple[int, int, int, int]],
    *,
    rank: int,
    world_size: int,
    num_local_experts: int,
    num_chunks: int,
    num_recv_rows: int,
    pair_base: int,
    slot_rows: int = 0,
    rows_with_pairs: int = 0,
    pairs_per_row_hint: int = 0,
) -> list[RoutingMetadata]:
    """Per stage (a chunk), RoutingMetadata of the stage's received pairs over the L local experts (rows index
    that stage's slice of the receive buffer; ``slot_rows``: C for rows in slots, ``slots.py``, else 0, and then
    ``rows_with_pairs`` the rows that carry pairs, whose mean count the kernels block by as for compact rows, unless
    ``pairs_per_row_hint`` (top-K: from the routing's shape) sets it). Built
    ONCE for all stages -- experts (chunk, local expert), N*L of them, so stage i's expert-sorted rows are exactly
    its pair range -- then shifted per stage (5 int32 ops a stage). ``stages``: per stage, its pairs [q0, q1)
    and rows [u0, u1) in the receive buffers. ``pair_base``: the column of the first pair count in
    ``incoming.counts_PW``."""
    L = num_local_experts
    row_Q, key_Q, token_offsets = _recv_rows_keys(
        incoming.meta_QC(),
        incoming.counts_PW,
        rank=rank,
        world_size=world_size,
        num_local_experts=L,
        num_chunks=num_chunks,
        pair_base=pair_base,
        num_recv_rows=num_recv_rows,
        slot_rows=slot_rows,
    )
    meta = _metadata_builder(incoming.counts_PW.device)(row_Q, key_Q, token_offsets, len(stages) * L)
    if pairs_per_row_hint:
        meta = replace(meta, pairs_per_token_hint=pairs_per_row_hint)
    elif slot_rows:  # one stage
        return [replace(meta, pairs_per_token_hint=max(1, meta.num_rows // max(rows_with_pairs, 1)))]
    if len(stages) == 1:
        return [meta]
    return [
        RoutingMetadata(
            expert_offsets=meta.expert_offsets[g * L : (g + 1) * L + 1] - q0,
            x_gather_idx=meta.x_gather_idx[q0:q1] - u0,
            s_scatter_idx=meta.s_scatter_idx[q0:q1] - q0,
            s_reverse_scatter_idx=meta.s_reverse_scatter_idx[q0:q1] - q0,
            token_offsets=meta.token_offsets[u0 : u1 + 1] - q0,
            pairs_per_token_hint=meta.pairs_per_token_hint,
        )
        for g, (q0, q1, u0, u1) in enumerate(stages)
    ]


def slotted_recv_metadata(
    received_pairs: torch.Tensor,
    counts_PW: torch.Tensor,
    *,
    rank: int,
    world_size: int,
    num_local_experts: int,
    row_slots: int,
    pair_slots: int,
    pair_base: int,
    pairs_per_row_hint: int,
) -> tuple[RoutingMetadata, torch.Tensor]:
    """Before the plan's host sync: the receive metadata of pairs that arrived in slots (``slots.py``, one chunk),
    over Q_max = P * Cq entries, since only the device knows how many arrived. The received pairs come first, in
    the order exact split sizes give them (so the first Q entries of every array are those of ``recv_metadata``),
    then placeholders of an extra expert L past the local ones, which no GEMM reads (``expert_offsets`` has L + 1
    entries). ``counts_PW``: the all-gathered counts on the device. Returns (the metadata, ``slot_of`` [Q_max]: the
    pair slot of each entry, P * Cq for the placeholders). A peer's bad pair (a row or an expert out of range: the
    plan's header check raises for it after these kernels) is clamped into range, so nothing here reads or writes
    out of bounds."""
    P, Cq, device = world_size, pair_slots, received_pairs.device
    Q_max = P * Cq
    arrived_P = counts_PW[:, pair_base + rank]  # pairs each source sent here
    slot_of = slot_layout(entry_index(Q_max, device), arrived_P, P, Cq).pos_R
    kw = dict(world_size=P, num_local_experts=num_local_experts, row_slots=row_slots, pair_slots=Cq)
    row_Q, key_Q, token_offsets = _slotted_rows_keys(received_pairs, slot_of, **kw)
    meta = _metadata_builder(device)(row_Q, key_Q, token_offsets, num_local_experts + 1)
    meta = replace(
        meta, expert_offsets=meta.expert_offsets[: num_local_experts + 1], pairs_per_token_hint=pairs_per_row_hint
    )
    return meta, slot_of


def slotted_rows_keys_torch(
    received_pairs: torch.Tensor,
    slot_of: torch.Tensor,
    *,
    world_size: int,
    num_local_experts: int,
    row_slots: int,
    pair_slots: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The metadata kernels' inputs of ``slotted_recv_metadata`` with PyTorch ops, the reference of (and the CPU path
    for) the one-launch Triton kernel of ``triton_slots.py``: (row_Q [Q_max] int32, the receive-buffer row of each
    entry, clamped into the buffer; key_Q [Q_max] int32, its local expert, L for placeholders and a bad peer's
    experts past L; token_offsets [U + 1] int32, the real pairs of the rows before each row). ``slot_of`` [Q_max]:
    the pair slot of each entry, Q_max for placeholders."""
    P, L, C, Cq, device = world_size, num_local_experts, row_slots, pair_slots, received_pairs.device
    Q_max, U = P * Cq, P * C
    real = slot_of < Q_max
    source = torch.div(slot_of, Cq, rounding_mode="floor").clamp(max=P - 1)
    meta_QC = received_pairs.index_select(0, slot_of.clamp(max=Q_max - 1))
    row_Q = torch.where(real, meta_QC[:, 0].long().clamp(0, C - 1) + source * C, U)
    key_Q = torch.where(real, meta_QC[:, 1].long().clamp(0, L), L)
    # pairs per row by counting (the same offsets as run_offsets for the real rows, which ascend; never out of
    # range for a bad peer's rows): off[u] = the real pairs of rows < u
    per_row = torch.zeros(U + 2, dtype=torch.int64, device=device)
    per_row.index_add_(0, row_Q + 1, torch.ones_like(row_Q))
    token_offsets = torch.cumsum(per_row[: U + 1], 0)
    return row_Q.clamp(max=max(U - 1, 0)).int(), key_Q.int(), token_offsets.int()


def _slotted_rows_keys(received_pairs: torch.Tensor, slot_of: torch.Tensor, **kw):
    """One Triton launch (and a scan) on CUDA (before the plan's sync, where host time paces the GPU), PyTorch's
    ops elsewhere; the same results."""
    if received_pairs.is_cuda:
        try:
            from .triton_slots import slotted_rows_keys_triton
        except ImportError:  # no Triton: PyTorch's ops (same results)
            pass
        else:
            return slotted_rows_keys_triton(received_pairs, slot_of, **kw)
    return slotted_rows_keys_torch(received_pairs, slot_of, **kw)


def first_entries(meta: RoutingMetadata, n: int) -> RoutingMetadata:
    """``slotted_recv_metadata``'s metadata cut to its first ``n`` entries (the real pairs, once the host knows
    how many): the receive metadata of exact split sizes."""
    return replace(
        meta,
        x_gather_idx=meta.x_gather_idx[:n],
        s_scatter_idx=meta.s_scatter_idx[:n],
        s_reverse_scatter_idx=meta.s_reverse_scatter_idx[:n],
    )


@functools.lru_cache(maxsize=16)
def entry_index(n: int, device: torch.device) -> torch.Tensor:
    """0 .. n-1 (int64), the same for every call of one size, so built once (read only)."""
    return torch.arange(n, device=device)
