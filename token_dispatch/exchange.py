"""Row and pair movement of a plan, without autograd: the building blocks of dispatch, combine and their
backward passes. Shape legend: see ``plan.py``. "Forward direction" = source rank -> expert rank."""

from __future__ import annotations

import torch

from .comm import Pending, all_to_all
from .plan import EPPlan

# The send side always passes the full buffer (all stages, sliced here); the receive side passes the stage's
# own tensor (a slice of a full buffer, or a stage result such as one stage's expert output). A stage is a
# token chunk: see ``EPPlan.num_stages``.


def _exchange(plan: EPPlan, i: int, out: torch.Tensor, inp: torch.Tensor, pending, *, back: bool, pairs: bool) -> None:
    """Stage i's movement of ``inp`` into ``out``: rows (or ``pairs``) towards the experts, or ``back`` towards
    their sources: the chunk's all-to-all with its per-rank split sizes."""
    send = (plan.send_pairs if pairs else plan.send_rows)[i]
    recv = (plan.recv_pairs if pairs else plan.recv_rows)[i]
    out_splits, in_splits = (send, recv) if back else (recv, send)
    pending.add(all_to_all(out, inp, out_splits, in_splits, plan.group, True))


def rows_to_experts(plan: EPPlan, send_SD: torch.Tensor, recv_stage: torch.Tensor, i: int, pending: Pending) -> None:
    """Launch stage i's exchange of send rows into that stage's receive rows; async."""
    s0, s1 = plan.send_row_range(i)
    _exchange(plan, i, recv_stage, send_SD[s0:s1], pending, back=False, pairs=False)


def rows_to_sources(plan: EPPlan, recv_stage: torch.Tensor, send_SD: torch.Tensor, i: int, pending: Pending) -> None:
    """Launch stage i's exchange of per-received-row results back into the send-ordered rows; async."""
    s0, s1 = plan.send_row_range(i)
    _exchange(plan, i, send_SD[s0:s1], recv_stage, pending, back=True, pairs=False)


def pairs_to_sources(plan: EPPlan, recv_stage: torch.Tensor, send_R: torch.Tensor, i: int, pending: Pending) -> None:
    """Launch stage i's exchange of per-received-pair values (dS) back to the pairs' sources; async. (Pair
    values towards the experts -- the scores -- ride in the plan's pair-metadata all-to-all.)"""
    s0, s1 = plan.send_pair_range(i)
    _exchange(plan, i, send_R[s0:s1], recv_stage, pending, back=True, pairs=True)


def recv_rows(plan: EPPlan, buf: torch.Tensor, i: int) -> torch.Tensor:
    r0, r1 = plan.recv_row_range(i)
    return buf[r0:r1]


def recv_pairs(plan: EPPlan, buf: torch.Tensor, i: int) -> torch.Tensor:
    r0, r1 = plan.recv_pair_range(i)
    return buf[r0:r1]


def gather_send_rows(plan: EPPlan, x_TD: torch.Tensor) -> torch.Tensor:
    """The send buffer [S, D]: one gather of this rank's token rows (a token once per destination); with row
    slots [P * C, D], rows that carry no token read token 0 (``slots.py``), or are zeros where there is none."""
    if plan.num_tokens == 0:
        return x_TD.new_zeros(plan.num_send_rows, x_TD.shape[1])
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

        # A token has at most one row per rank: one step of the power of two >= P covers every token.
        ppt = 1 << max(0, plan.world_size - 1).bit_length()
        return gather_sum(rows_SD.contiguous(), plan.combine_meta(), None, pairs_per_token=ppt)
    ct = torch.promote_types(rows_SD.dtype, torch.float32)
    ordered = rows_SD.index_select(0, plan.combine_order_S).to(ct)
    out = torch.segment_reduce(ordered, "sum", offsets=plan.combine_offsets, axis=0, unsafe=True)
    return out.to(rows_SD.dtype)


def scatter_pair_grads(plan: EPPlan, dscores_send: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Pair-score gradients back in the routing's flat pair order (each pair is sent exactly once)."""
    out = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
    out.index_copy_(0, plan.send_pair_idx, dscores_send.to(like.dtype))
    return out
