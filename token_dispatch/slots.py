"""Row slots: the forward's token rows leave for the experts BEFORE the plan's host sync.

An all-to-all with per-rank split sizes needs those sizes on the host, so with exact splits the token rows can
leave only after the plan's sync -- which empties the GPU's queue: every launch after it then paces the GPU. With
row slots, every (source, destination) pair of ranks has a slot of C rows in the send and the receive buffers
[P * C, D]: a destination receives at most one row per source token, so C = the most tokens any rank has is always
enough. The all-to-all's splits are then C everywhere, host-known before the sync, and the rows travel while the
host waits for the sizes; the GPU still has them to move when the sync returns. The receive metadata, the GEMMs and
the combine read the slots' layout (``EPPlan.row_slots``): row j of slot p is source p's j-th row, rows past a
slot's count belong to no pair. The rows back (the combine, and both directions in backward) use the same slots.

The price is wire bytes: a slot is sent whole, also where a source sends few of its tokens to a destination.
``slots_pay`` decides it once per layer from the routing's shape (with top-K routing a token reaches most ranks
of a small group, so the slots are nearly full).

C must be the same on every rank before the sync, so it comes from the previous plan of the same layer: every rank
saw every rank's token count in that plan's header (``EPPlan.max_tokens``). A call where some rank has more tokens
than C falls back to exact split sizes (every rank sees it in the header), the slots' rows then unused; header field
21 carries C, so ranks that launched different slots raise together.

Shape legend: see ``send_side.py`` (T, P, R, S); C rows per slot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .comm import Pending, all_to_all

# The smallest expected share of a slot's rows that carry a token for ``slots_pay``: at 0.8 the slots send at most
# a quarter more bytes than the exact splits.
MIN_FILL = 0.8


def expected_fill(num_experts: int, top_k: int, world_size: int) -> float:
    """The share of a source's tokens that send a row to a given rank under uniform top-K routing: the chance that
    at least one of a token's K experts lies among the rank's E / P (``1 - C(E - E/P, K) / C(E, K)``)."""
    E, K, P = num_experts, top_k, world_size
    if E < 1 or P < 1 or K < 1 or E % P:
        return 0.0
    return 1.0 - math.comb(E - E // P, K) / math.comb(E, K)


def slots_pay(num_experts: int, top_k: int, world_size: int) -> bool:
    """Row slots for a layer of E experts, top-K routing, P ranks: where their expected fill reaches ``MIN_FILL``."""
    return world_size > 1 and expected_fill(num_experts, top_k, world_size) >= MIN_FILL


@dataclass(frozen=True)
class SlotLayout:
    """Where this rank's send rows sit in the slotted send buffer [P * C, D]: ``pos_R`` [R], slot row of send
    row s for s < S (P * C, a row past the buffer, for s >= S and for rows that overflow a slot), and
    ``token_idx`` [P * C], the token of every slot row (token 0 for rows that carry none: read, never used)."""

    pos_R: torch.Tensor
    token_idx: torch.Tensor


def slot_layout_torch(send_token_idx_R: torch.Tensor, rows_P: torch.Tensor, world_size: int, slots: int):
    """(pos_R, token_idx) of ``SlotLayout`` with PyTorch ops: the reference of (and the CPU path for) the one-launch
    Triton kernel of ``triton_slots.py``."""
    P, C, device = world_size, slots, send_token_idx_R.device
    R = send_token_idx_R.numel()
    end_P = torch.cumsum(rows_P, 0)
    s = torch.arange(R, device=device)
    dest = torch.searchsorted(end_P, s, right=True)  # P for s >= S
    in_slot = s - (end_P - rows_P)[dest.clamp(max=P - 1)]
    pos_R = torch.where((dest < P) & (in_slot < C), dest * C + in_slot, P * C)
    token_idx = torch.zeros(P * C + 1, dtype=torch.int64, device=device)
    token_idx.scatter_(0, pos_R, send_token_idx_R)  # the row past the buffer takes the rest; cut off below
    return pos_R, token_idx[: P * C]


def slot_layout(send_token_idx_R: torch.Tensor, rows_P: torch.Tensor, world_size: int, slots: int) -> SlotLayout:
    """The slot of every send row from the send side (``send_side.SendSide``, one chunk): rows ordered by
    destination, ``rows_P`` per destination, on the device (no host sync). One Triton launch on CUDA
    (``triton_slots.py``: this runs before the plan's sync, where host time paces the GPU), PyTorch's ops elsewhere;
    the same int64 results."""
    if send_token_idx_R.is_cuda:
        try:
            from .triton_slots import slot_layout_triton
        except ImportError:  # no Triton: PyTorch's ops (same results)
            pass
        else:
            return SlotLayout(*slot_layout_triton(send_token_idx_R, rows_P.contiguous(), world_size, slots))
    return SlotLayout(*slot_layout_torch(send_token_idx_R, rows_P, world_size, slots))


@dataclass(frozen=True)
class RowsInFlight:
    """The slotted row all-to-all towards the experts (``launch_slot_rows``): ``recv`` [P * C, D] is valid after
    ``wait()``."""

    recv: torch.Tensor
    pending: Pending

    def wait(self) -> torch.Tensor:
        self.pending.wait()
        return self.recv


def launch_slot_rows(started, x_TD: torch.Tensor) -> RowsInFlight:
    """Launch a started plan's (``plan.start_plan`` with ``row_slots``) token rows into their slots; async, before
    ``finish_plan``. Every rank of the group must call it for such a plan. A rank whose plan failed its checks
    (``started.error``) or has no tokens sends zero rows of the size every rank expects, so that the collective
    matches and ``finish_plan`` raises on every rank."""
    P, C = started.world_size, started.row_slots
    D, dtype, device = started.row_like
    good = (
        started.error is None
        and started.num_tokens > 0
        and isinstance(x_TD, torch.Tensor)
        and x_TD.dim() == 2
        and tuple(x_TD.shape) == (started.num_tokens, D)
        and x_TD.dtype == dtype
    )
    send = x_TD.index_select(0, started.slots.token_idx) if good else torch.zeros(P * C, D, dtype=dtype, device=device)
    recv = send.new_empty(P * C, D)
    pending = Pending()
    pending.add(all_to_all(recv, send, [C] * P, [C] * P, started.group, True))
    return RowsInFlight(recv, pending)
