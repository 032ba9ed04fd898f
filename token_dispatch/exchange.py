"""Row and pair movement of a plan, without autograd: the building blocks of dispatch, combine and their
backward passes. Shape legend: see ``plan.py``. "Forward direction" = source rank -> expert rank."""

from __future__ import annotations

import torch

from .comm import Pending, all_to_all
from .plan import EPPlan

# The send side always passes the full buffer (all chunks, sliced here); the receive side passes the
# chunk's own tensor (a slice of a full buffer, or a chunk result such as one chunk's expert output).


def rows_to_experts(plan: EPPlan, send_SD: torch.Tensor, recv_chunk: torch.Tensor, c: int, pending: Pending) -> None:
    """Launch chunk c's all-to-all of send rows into that chunk's receive rows; async."""
    s0, s1 = plan.send_row_range(c)
    pending.add(all_to_all(recv_chunk, send_SD[s0:s1], plan.recv_rows[c], plan.send_rows[c], plan.group, True))


def rows_to_sources(plan: EPPlan, recv_chunk: torch.Tensor, send_SD: torch.Tensor, c: int, pending: Pending) -> None:
    """Launch chunk c's all-to-all of per-received-row results back into the send-ordered rows; async."""
    s0, s1 = plan.send_row_range(c)
    pending.add(all_to_all(send_SD[s0:s1], recv_chunk, plan.send_rows[c], plan.recv_rows[c], plan.group, True))


def pairs_to_sources(plan: EPPlan, recv_chunk: torch.Tensor, send_R: torch.Tensor, c: int, pending: Pending) -> None:
    """Launch chunk c's all-to-all of per-received-pair values (dS) back to the pairs' sources; async. (Pair
    values towards the experts -- the scores -- ride in the plan's pair-metadata all-to-all.)"""
    s0, s1 = plan.send_pair_range(c)
    pending.add(all_to_all(send_R[s0:s1], recv_chunk, plan.send_pairs[c], plan.recv_pairs[c], plan.group, True))


def recv_rows(plan: EPPlan, buf: torch.Tensor, c: int) -> torch.Tensor:
    r0, r1 = plan.recv_row_range(c)
    return buf[r0:r1]


def recv_pairs(plan: EPPlan, buf: torch.Tensor, c: int) -> torch.Tensor:
    r0, r1 = plan.recv_pair_range(c)
    return buf[r0:r1]


def gather_send_rows(plan: EPPlan, x_TD: torch.Tensor) -> torch.Tensor:
    """The send buffer [S, D]: one gather of this rank's token rows (a token once per destination)."""
    return x_TD.index_select(0, plan.send_token_idx_S)


def sum_rows_per_token(plan: EPPlan, rows_SD: torch.Tensor) -> torch.Tensor:
    """out[t] = sum of token t's returned rows, in destination-rank order, accumulated in fp32 (fp64 for
    fp64): a fixed-order sum, no atomics, so repeated runs are bitwise equal. On CUDA this is the kernels'
    Triton gather-sum (one program per token walks its rows in order); elsewhere a segment sum."""
    T, D = plan.num_tokens, rows_SD.shape[1]
    if rows_SD.shape[0] == 0:
        return rows_SD.new_zeros(T, D)
    if rows_SD.is_cuda and rows_SD.dtype in (torch.float16, torch.bfloat16, torch.float32):
        from ..kernels.triton import gather_sum

        return gather_sum(rows_SD.contiguous(), plan.combine_meta(), None, pairs_per_token=plan.world_size)
    ct = torch.promote_types(rows_SD.dtype, torch.float32)
    ordered = rows_SD.index_select(0, plan.combine_order_S).to(ct)
    out = torch.segment_reduce(ordered, "sum", offsets=plan.combine_offsets, axis=0, unsafe=True)
    return out.to(rows_SD.dtype)


def scatter_pair_grads(plan: EPPlan, dscores_send: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Pair-score gradients back in the routing's flat pair order (each pair is sent exactly once)."""
    out = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
    out.index_copy_(0, plan.send_pair_idx, dscores_send.to(like.dtype))
    return out
