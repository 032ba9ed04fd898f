"""Slots: the forward's token rows AND pair metadata leave for the experts BEFORE the plan's host sync.

An all-to-all with per-rank split sizes needs those sizes on the host, so with exact splits nothing can leave
before the plan's sync. With slots, every (source, destination) pair of ranks has a slot of C rows and one of Cq
pairs in the send and receive buffers ([P * C, D] rows, [P * Cq, columns] pair metadata): a destination receives
at most one row per source token, so C = the most tokens any rank has is always enough, and at most
min(K, L) pairs per row (top-K routing; L otherwise). The splits are then C and Cq everywhere, host-known before
the sync, so the whole dispatch runs before it (``launch_slots``), and so can the experts' GEMMs: their receive
metadata comes from the slotted pairs and the device's copy of the counts, over the bound P * Cq of the pairs
(``recv_side.slotted_recv_metadata``, ``stepwise.local_experts_before_sync``), and so can the combine
(``stepwise.combine_slots``): the forward needs no host size at all, and the plan's host sync waits in the experts'
backward, long after the sizes arrived. Where the receive metadata is built after the sync instead, the received
pairs are compacted first (``EPPlan.pairs_from_slots``). The rows stay where they are: the receive metadata, the
GEMMs and the combine read the slots' layout (row j of slot p is source p's j-th row, rows past a slot's count
belong to no pair), and the rows back (the combine, and both directions in backward) use the same slots.

The price is wire bytes: a slot is sent whole, also where a source sends few of its tokens to a destination; and
memory: H (the up-projection's output, kept for backward) is sized by the bound P * Cq of the pairs until backward.
``slots_pay`` decides it once per layer from the routing's shape (with top-K routing a token reaches most ranks
of a small group, so the slots are nearly full).

C and Cq must be the same on every rank before the sync, so they come from what every rank shares: the previous
plan of the same layer (every rank saw every rank's token count in its header, ``EPPlan.max_tokens``) and the
model's top-K. Header fields 21 and 22 carry them, so ranks that launched different slots raise together; a call
whose counts do not fit raises on every rank where its plan is finished (the rows have left: there is no exact
fallback), in backward when the GEMMs ran before the sync.

Shape legend: see ``send_side.py`` (T, P, L, K, R, S); C rows and Cq pairs per slot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .comm import Pending, all_to_all
from .send_side import combine_metadata

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
    """Slots for a layer of E experts, top-K routing, P ranks: where their expected fill reaches ``MIN_FILL``."""
    return world_size > 1 and expected_fill(num_experts, top_k, world_size) >= MIN_FILL


@dataclass(frozen=True)
class SlotLayout:
    """Where this rank's send entries (token rows, or pairs) sit in a slotted send buffer of P slots of C entries:
    ``pos_R`` [R], slot position of entry s for s < S (P * C, past the buffer, for s >= S and for entries that
    overflow a slot), and ``token_idx`` [P * C], the source index of every slot position (a row's token, a pair's
    send-order index; 0 for positions that carry none: read, never used)."""

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
    """The slot of every send entry from the send side (``send_side.SendSide``, one chunk): entries ordered by
    destination (rows, or pairs), ``rows_P`` of them per destination, on the device (no host sync). One Triton
    launch on CUDA (``triton_slots.py``: this runs before the plan's sync, where host time paces the GPU), PyTorch's
    ops elsewhere; the same int64 results."""
    if send_token_idx_R.is_cuda:
        try:
            from .triton_slots import slot_layout_triton
        except ImportError:  # no Triton: PyTorch's ops (same results)
            pass
        else:
            return SlotLayout(*slot_layout_triton(send_token_idx_R, rows_P, world_size, slots))
    return SlotLayout(*slot_layout_torch(send_token_idx_R, rows_P, world_size, slots))


@dataclass(frozen=True)
class Slots:
    """The slot sizes of one plan, the same on every rank: ``rows`` (C) token rows and ``pairs`` (Cq) pairs per
    (source, destination)."""

    rows: int
    pairs: int

    @staticmethod
    def for_layer(max_tokens: int, num_local_experts: int, top_k: int | None, rounding_tile: int = 0) -> Slots:
        """Slots that always fit a call of at most ``max_tokens`` tokens per rank: a row per token and, per row,
        ``top_k`` pairs for top-K routing (``None`` for any other routing: at most one pair per local expert).
        ``rounding_tile``: the top-K routing is token-rounded to that tile first, which adds fewer than a tile of
        pairs to an expert (from any source), so a slot takes ``tile - 1`` more pairs per local expert (and no more
        rows: an added pair of a token is at most its one row on that rank)."""
        per_row = num_local_experts if top_k is None else min(top_k, num_local_experts)
        added = num_local_experts * max(rounding_tile - 1, 0)
        return Slots(rows=max_tokens, pairs=max_tokens * per_row + added)


@dataclass
class SlotCombine:
    """What the combine of rows in slots reads, with no host size (``stepwise.combine_slots``): the attributes of
    ``EPPlan`` that ``exchange.gather_send_rows`` and ``exchange.sum_rows_per_token`` use. ``combine_order_S``: the
    slot position of every send row in token order, over the send side's bound (entries past the real rows are
    clamped into the buffer and never summed: ``combine_offsets`` stop each token's sum at its rows)."""

    group: object
    world_size: int
    row_slots: int
    num_tokens: int
    send_token_idx_S: torch.Tensor
    combine_order_S: torch.Tensor
    combine_offsets: torch.Tensor
    _meta: object = None

    @property
    def num_send_rows(self) -> int:
        return self.world_size * self.row_slots

    @staticmethod
    def of(started) -> SlotCombine:
        P, C, side, layout = started.world_size, started.slots.rows, started.side, started.row_layout
        if side is None or layout is None:  # bad input on this rank: zeros of the expected sizes (the check raises)
            device = started.row_like[2]
            zeros = torch.zeros(0, dtype=torch.int64, device=device)
            offsets = torch.zeros(started.num_tokens + 1, dtype=torch.int64, device=device)
            token_idx = torch.zeros(P * C, dtype=torch.int64, device=device)
            return SlotCombine(started.group, P, C, started.num_tokens, token_idx, zeros, offsets)
        order = side.combine_order_R[: P * C]  # the real rows (at most P * C) come first
        pos = layout.pos_R.index_select(0, order).clamp_(max=P * C - 1)
        return SlotCombine(started.group, P, C, started.num_tokens, layout.token_idx, pos, side.combine_offsets)

    def combine_meta(self):
        if self._meta is None:
            self._meta = combine_metadata(self.combine_order_S, self.combine_offsets)
        return self._meta


def launch_slots(started, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A started plan's (``plan.start_plan`` with ``slots``) token rows (of ``x_TD``, the tokens the plan checked)
    and pair metadata into their slots, before ``finish_plan``: (received rows [P * C, D], received pair metadata
    [P * Cq, columns]), both all-to-alls ordered before the current stream's later work (no host wait). Every rank
    of the group must call it for such a plan. A rank whose plan failed its checks (``started.error``) or has no
    tokens sends zeros of the sizes every rank expects, so that the collectives match and ``finish_plan`` raises
    on every rank."""
    P, C, Cq = started.world_size, started.slots.rows, started.slots.pairs
    D, dtype, device = started.row_like
    side = started.side
    good = started.error is None and side is not None and started.num_tokens > 0 and side.pair_meta_RC.shape[0] > 0
    if good:
        send_pairs = side.pair_meta_RC.index_select(0, started.pair_layout.token_idx)
        send_rows = x_TD.index_select(0, started.row_layout.token_idx)
    else:
        send_pairs = torch.zeros(P * Cq, started.pair_columns, dtype=torch.int32, device=device)
        send_rows = torch.zeros(P * C, D, dtype=dtype, device=device)
    recv_pairs, recv_rows = send_pairs.new_empty(send_pairs.shape), send_rows.new_empty(send_rows.shape)
    pending = Pending()  # the pairs first: the receive metadata is built from them while the rows may still travel
    pending.add(all_to_all(recv_pairs, send_pairs, [Cq] * P, [Cq] * P, started.group, True))
    pending.add(all_to_all(recv_rows, send_rows, [C] * P, [C] * P, started.group, True))
    pending.wait()
    return recv_rows, recv_pairs
