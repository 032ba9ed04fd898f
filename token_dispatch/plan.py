"""The dispatch plan: who sends which token rows and pairs where, computed once per layer call (``make_plan``).

Shape legend: see ``send_side.py`` (T, E, L, P, N, R, S); U received rows and Q received pairs of this rank.

A token crosses to a destination rank once, however many of its experts live there (dedup). Its pairs on
that rank travel as int32 (row within the (chunk, source) segment, local expert, the score's bits); the
receiver turns them into routing metadata over its L local experts whose "tokens" are receive-buffer rows.

``make_plan`` reads top to bottom -- the host sync drains the GPU queue, so as little as possible comes after it:
  1. route: check this rank's inputs and the experts backend's rules for them, flatten the routing (an error, or
     any failure of this rank's work before the header, travels in the header: every rank raises together);
  2. rounding, decided here and nowhere else, on the device before the sync: for top-K routing on CUDA in the
     kernels of ``triton_round_ep.py`` (two small all-gathers), else in PyTorch ops (``round_routing_padded``: one
     candidate all-gather), both device to device, with the same result: a padded routing of a host-known size
     (real pairs first, then padding pairs of token T and expert E); its duplicate-pair flag rides in the header.
     A rank with bad input still joins the all-gathers (with no pairs), and indices the header will report are
     skipped or clamped: that rounding is discarded when the header check raises. The all-gathers' sizes must
     agree on every rank: ranks that disagree on E, the tile, the router dtype or whether to round at all break
     those collectives before the header can report it;
  3. send side (``send_side.py``), on the device before the sync, sized by R (the padded size with rounding:
     padding pairs have no destination and count nothing) and sliced after it; for top-K routing on CUDA its
     kernels also write the counts and the index checks straight into the exchange vector of step 4; a rounding
     from the kernels comes token-sorted with its token offsets, and its send side from the same kernels reading
     each token's pair range (``triton_send_csr.py``);
  4. sizes (``sizes.py``): ONE all-gather of header + per (chunk, destination) counts and its copy to the host
     are launched (``start_plan`` ends here: nothing has waited yet); the caller may queue other work while it
     travels (Megatron's method split: whatever its schedule runs between dispatch_preprocess and
     token_dispatch), then ``finish_plan`` waits for that copy alone and checks the header -- the plan's one
     host sync, with or without rounding; the real rounded pair count is this rank's sent pair count, so the
     padding is cut off with no further sync;
  5. receive side (``recv_side.py``): the pair-metadata all-to-alls (one per chunk) are launched and NOT waited
     for; the caller launches its row all-to-alls and only then touches ``plan.recv_meta`` /
     ``plan.recv_scores()``, which wait for them and build the receive metadata while the rows travel.
     With ``slots`` (``slots.py``) the rows and pairs left before the sync (``stepwise.dispatch_before_sync``):
     the received pairs are compacted here instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..kernels.routing import FlatRouting, RoutingMetadata, TopKRouting
from . import validation as V
from .comm import group_fingerprint, group_rank, group_size
from .options import EPOptions, parse_options
from .recv_side import (
    IncomingPairs,
    SlottedPairs,
    entry_index,
    launch_pair_all_to_alls,
    recv_metadata,
    scores_from_columns,
)
from .rounding import RoundingResult, TokenRounding, round_routing_padded
from .send_side import SendSide, build_send_side, combine_metadata, flat_routing, triton_send_side
from .sizes import (
    SizesInFlight,
    check_slots_fit,
    counts_slot,
    exchange_buffer,
    exchange_outputs,
    launch_exchange,
    pair_base,
    receive_header_and_counts,
    split_sizes,
)
from .slots import SlotLayout, Slots, expected_fill, slot_layout


@dataclass
class EPPlan:
    """Everything dispatch, local_experts and combine need; built by ``make_plan``. Fields:

    group, rank, world_size (P), num_experts (E), num_local_experts (L), num_chunks (N), num_tokens (T).
    token_idx_R, expert_idx_R, scores_R: the routing actually used (after rounding; scores with autograd).
    send_token_idx_S: source token of every send row.  send_pair_idx: flat pair index of every sent pair,
    in send order.  combine_order_S / combine_offsets: send rows grouped by token in destination order
    (the fixed summation order of combine).  send_rows / send_pairs / recv_rows / recv_pairs: host
    [N][P] split sizes.  recv_meta (property, built on first use): per chunk, RoutingMetadata over the L
    local experts of the received pairs (rows index that chunk's receive buffer).  recv_scores(): the
    received pairs' scores.  rounding: the RoundingResult when rounding was applied.  row_slots / pair_slots:
    C / Cq when the rows and pairs travelled in slots (``slots.py``; send_rows = recv_rows = [[C] * P]), else
    None.  max_tokens: the most tokens of any rank (the next call's slots).
    """

    group: object
    rank: int
    world_size: int
    num_experts: int
    num_local_experts: int
    num_chunks: int
    num_tokens: int
    token_idx_R: torch.Tensor
    expert_idx_R: torch.Tensor
    scores_R: torch.Tensor
    send_token_idx_S: torch.Tensor
    send_pair_idx: torch.Tensor
    combine_order_S: torch.Tensor
    combine_offsets: torch.Tensor
    send_rows: list[list[int]]
    send_pairs: list[list[int]]
    recv_rows: list[list[int]]
    recv_pairs: list[list[int]]
    rounding: RoundingResult | None = None
    row_slots: int | None = None
    pair_slots: int | None = None
    rows_with_pairs: int = 0  # with slots: the received rows that carry pairs (U of exact split sizes)
    pairs_per_row_hint: int = 0  # top-K: the pairs a received row has on average under uniform routing
    max_tokens: int = 0
    _offsets: dict = field(default_factory=dict, repr=False)
    _incoming: IncomingPairs | SlottedPairs | None = field(default=None, repr=False)  # the pairs (recv_side.py)
    _recv_meta: list | None = field(default=None, repr=False)

    # --- the receive side: pair metadata and scores arrive by the plan's (async) all-to-alls -------------

    @property
    def recv_meta(self) -> list[RoutingMetadata]:
        """Per stage (``num_stages``: a chunk), RoutingMetadata over the L local experts of the stage's received
        pairs (rows index the stage's slice of the receive buffer). Built on first access, which waits for
        the plan's pair all-to-alls: call it after launching the row all-to-alls so that both are in flight
        together."""
        if self._recv_meta is None:
            self._recv_meta = recv_metadata(
                self._incoming,
                [(*self.recv_pair_range(i), *self.recv_row_range(i)) for i in range(self.num_stages)],
                rank=self.rank,
                world_size=self.world_size,
                num_local_experts=self.num_local_experts,
                num_chunks=self.num_chunks,
                num_recv_rows=self.num_recv_rows,
                pair_base=pair_base(self.world_size),
                slot_rows=self.row_slots or 0,
                rows_with_pairs=self.rows_with_pairs,
                pairs_per_row_hint=self.pairs_per_row_hint,
            )
        return self._recv_meta

    def pairs_from_slots(self, slotted: torch.Tensor) -> torch.Tensor:
        """The received pairs' entries [Q, ...] of a tensor in the pair slots' layout [P * Cq, ...] (with autograd:
        its gradient has zeros at the slots' unused entries)."""
        Cq = self.pair_slots
        parts = [slotted[p * Cq : p * Cq + n] for p, n in enumerate(self.recv_pairs[0])]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def recv_scores(self) -> torch.Tensor:
        """The received pairs' scores [Q] (dtype of ``scores_R``), in receive order; a new tensor per call."""
        return scores_from_columns(self._incoming.meta_QC()[:, 2:], self.scores_R.dtype)

    # --- stages: the unit of pipelining -----------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        """Stage i = chunk i: its all-to-alls move the chunk's rows between all ranks."""
        return self.num_chunks

    # --- host-side offsets inside the send / receive buffers (ordered chunk, then rank) -------------------
    def _cum(self, name: str) -> list[int]:
        """Prefix sums of the [N][P] counts ``name`` flattened in (chunk, rank) order: N*P + 1 offsets."""
        if name not in self._offsets:
            out = [0]
            for per_rank in getattr(self, name):
                for n in per_rank:
                    out.append(out[-1] + n)
            self._offsets[name] = out
        return self._offsets[name]

    def chunk_range(self, name: str, c: int) -> tuple[int, int]:
        """Chunk c's range in the buffer counted by ``name`` (send_rows, send_pairs, recv_rows, recv_pairs)."""
        o, P = self._cum(name), self.world_size
        return o[c * P], o[(c + 1) * P]

    def send_row_range(self, i: int) -> tuple[int, int]:
        """Stage i's rows in the send buffer [S, D]."""
        return self.chunk_range("send_rows", i)

    def recv_row_range(self, i: int) -> tuple[int, int]:
        """Stage i's rows in the receive buffer [U, D]."""
        return self.chunk_range("recv_rows", i)

    def send_pair_range(self, i: int) -> tuple[int, int]:
        return self.chunk_range("send_pairs", i)

    def recv_pair_range(self, i: int) -> tuple[int, int]:
        return self.chunk_range("recv_pairs", i)

    def combine_meta(self) -> RoutingMetadata:
        """The combine sum as routing metadata for the kernels' gather-sum: "pairs" are (token, destination)
        rows in token order (``combine_order_S``), CSR ``combine_offsets`` per token."""
        if "combine_meta" not in self._offsets:
            self._offsets["combine_meta"] = combine_metadata(self.combine_order_S, self.combine_offsets)
        return self._offsets["combine_meta"]

    @property
    def num_send_rows(self) -> int:
        return self._cum("send_rows")[-1]

    @property
    def num_recv_rows(self) -> int:
        return self._cum("recv_rows")[-1]

    @property
    def num_recv_pairs(self) -> int:
        return self._cum("recv_pairs")[-1]

    def wire_rows(self) -> tuple[int, int]:
        """(rows sent to other ranks, pairs sent to other ranks) by this rank: the dedup's byte count."""
        rows = sum(r for per in self.send_rows for p, r in enumerate(per) if p != self.rank)
        pairs = sum(r for per in self.send_pairs for p, r in enumerate(per) if p != self.rank)
        return rows, pairs


@dataclass(frozen=True)
class StartedPlan:
    """A plan up to its host sync (``start_plan``): steps 1-3 done on the device, the sizes exchange in flight.
    ``finish_plan`` waits for it. ``scores_R`` is the routing's flat scores (with rounding: padded to a host-known
    size, real pairs first); the finished plan's ``scores_R`` is its first ``num_pairs`` entries. With bad input
    (``error``: this rank's, None where only a peer's is bad) ``scores_R`` is an empty placeholder and
    ``finish_plan`` raises on every rank."""

    group: object
    rank: int
    world_size: int
    num_experts: int
    num_local_experts: int
    num_chunks: int
    num_tokens: int
    error: str | None
    token_idx_R: torch.Tensor | None
    expert_idx_R: torch.Tensor | None
    scores_R: torch.Tensor | None
    rounded: RoundingResult | None
    side: object
    sizes: SizesInFlight
    error_cause: Exception | None = None  # what raised on this rank: the cause of finish_plan's error here
    slots: Slots | None = None  # the rows and pairs go in slots before the sync (``slots.launch_slots``)
    row_layout: SlotLayout | None = None  # this rank's send rows in their slots (None with bad input)
    pair_layout: SlotLayout | None = None  # this rank's send pairs in theirs (None with bad input)
    row_like: tuple | None = None  # (D, dtype, device) of the slotted rows, the same on every rank
    pair_columns: int = 3  # int32 columns of the slotted pair metadata, the same on every rank
    pairs_per_row_hint: int = 0  # top-K: the pairs a received row has on average under uniform routing


@dataclass(frozen=True)
class PlanInputs:
    """What one plan is computed from (``make_plan``'s arguments other than the options): ``routing``,
    ``num_experts``, ``group``, ``rounding_scores_TE`` and the optional ``x_TD``, ``w1_EGD``, ``w2_EDF`` checked
    across ranks. The internal entry points (``plan_layer``, ``engine.plan_call``) take it whole."""

    routing: TopKRouting | FlatRouting
    num_experts: int
    group: object = None
    rounding_scores_TE: torch.Tensor | None = None
    x_TD: torch.Tensor | None = None
    w1_EGD: torch.Tensor | None = None
    w2_EDF: torch.Tensor | None = None


def make_plan(
    routing: TopKRouting | FlatRouting,
    *,
    num_experts: int,
    group=None,
    rounding_scores_TE: torch.Tensor | None = None,
    x_TD: torch.Tensor | None = None,
    w1_EGD: torch.Tensor | None = None,
    w2_EDF: torch.Tensor | None = None,
    options: EPOptions | None = None,
    **option_kw,
) -> EPPlan:
    """Plan one MoE layer call under expert parallelism (see the module docstring for its collectives):
    ``finish_plan(start_plan(...))``.

    Args:
        routing: this rank's ``TopKRouting`` / ``FlatRouting`` over GLOBAL expert ids [0, E).
        num_experts: E; must be a multiple of the group size P. Rank r owns experts [r*E/P, (r+1)*E/P).
        group: the EP process group; ``None`` or size 1 means no communication.
        rounding_scores_TE: dense router probabilities [T, E]; required with ``options.rounding``.
        x_TD, w1_EGD, w2_EDF: optional; when given, their shapes and dtypes are validated (w1's against
            ``options.activation``) and compared across ranks in the same header exchange (recommended: a
            mismatch then raises on all ranks instead of failing or hanging inside an all-to-all).
        options, option_kw: ``EPOptions`` (keywords override its fields). The plan reads ``rounding``,
            ``num_chunks`` (N contiguous token chunks, each with its own all-to-alls) and ``activation``; all
            must be equal on every rank (checked).
    """
    started = start_plan(
        routing,
        num_experts=num_experts,
        group=group,
        rounding_scores_TE=rounding_scores_TE,
        x_TD=x_TD,
        w1_EGD=w1_EGD,
        w2_EDF=w2_EDF,
        options=options,
        **option_kw,
    )
    return finish_plan(started)


def start_plan(
    routing: TopKRouting | FlatRouting,
    *,
    num_experts: int,
    group=None,
    rounding_scores_TE: torch.Tensor | None = None,
    x_TD: torch.Tensor | None = None,
    w1_EGD: torch.Tensor | None = None,
    w2_EDF: torch.Tensor | None = None,
    options: EPOptions | None = None,
    slots: Slots | None = None,
    **option_kw,
) -> StartedPlan:
    """``make_plan`` up to its host sync: the device work and the collectives are launched, nothing waits.
    ``finish_plan`` completes it; GPU work queued in between runs while the host waits there (Megatron's method
    split calls this in ``dispatch_preprocess`` and ``finish_plan`` in ``token_dispatch``). Arguments as
    ``make_plan``, and ``slots``: the same on every rank (``Slots.for_layer`` of the previous plan's ``max_tokens``),
    to send the token rows and pairs in slots before the sync (``slots.py``; one chunk, and x_TD or w1_EGD given).
    Every rank then calls ``slots.launch_slots`` and passes the received pairs to ``finish_plan``."""
    inputs = PlanInputs(
        routing=routing,
        num_experts=num_experts,
        group=group,
        rounding_scores_TE=rounding_scores_TE,
        x_TD=x_TD,
        w1_EGD=w1_EGD,
        w2_EDF=w2_EDF,
    )
    opts, error = parse_options("make_plan", options, option_kw)
    return _start_plan(inputs, opts, options_error=error, slots=slots)


def plan_layer(inputs: PlanInputs, options: EPOptions, *, options_error: str | None = None) -> EPPlan:
    """``make_plan`` with validated options; ``options_error`` (a caller's bad option) raises on every rank."""
    return finish_plan(_start_plan(inputs, options, options_error=options_error))


def _start_plan(
    inputs: PlanInputs, options: EPOptions, *, options_error: str | None = None, slots: Slots | None = None
) -> StartedPlan:
    """Steps 1-3 and the launch of step 4's exchange: device work and collectives only, no host wait. Every rank
    launches the same collectives, also with bad input: whatever fails on this rank before them (a check, the
    backend's argument rules, the device work on its own pairs) rides in the header, so that every rank raises it
    together instead of this one raising alone while its peers wait in the collectives below."""
    routing, num_experts, group = inputs.routing, inputs.num_experts, inputs.group
    rounding_scores_TE, x_TD, w1_EGD, w2_EDF = inputs.rounding_scores_TE, inputs.x_TD, inputs.w1_EGD, inputs.w2_EDF
    P, rank = group_size(group), group_rank(group)
    T = V.routing_num_tokens(routing)
    rounding = options.rounding
    device = _plan_device(routing, x_TD)
    is_topk, is_flat = isinstance(routing, TopKRouting), isinstance(routing, FlatRouting)
    # 1. route: this rank's checks and its flat pairs
    error, cause = options_error, None
    stats = tok_R = exp_R = scores_R = kernels = None
    if error is None:
        try:
            V.check_local(
                routing,
                num_experts=num_experts,
                group_size=P,
                rounding=rounding,
                rounding_scores_TE=rounding_scores_TE,
                x_TD=x_TD,
                w1_EGD=w1_EGD,
                w2_EDF=w2_EDF,
                activation=options.activation,
            )
            V.check_backend(options.backend, x_TD, w1_EGD, w2_EDF, options.activation)
            tok_R, exp_R, scores_R = flat_routing(routing)
            # top-K on CUDA without rounding: the send-side kernels also compute the index stats (fused below)
            # (T = 0: the reference path, whose header marks "no pairs" in the index fields)
            kernels = None if rounding is not None or not is_topk or T == 0 else triton_send_side(routing, P)
            stats = None if kernels is not None else V.index_stats(tok_R, exp_R, T, is_flat)
        except Exception as exc:  # noqa: BLE001 - raised on every rank by the header check
            error, cause = _local_error(exc), exc
            stats = tok_R = exp_R = scores_R = kernels = None
    N = options.num_chunks if error is None else 1
    L = max(num_experts // P, 1) if error is None else 1
    # Slots: the caller's, the same on every rank (a malformed one raises here on every rank alike, before any
    # collective); a combination they cannot serve rides in the header.
    row_like = _row_like(x_TD, w1_EGD)
    if slots is not None:
        if row_like is None:  # the slotted buffers' shape: every rank must know it to join the collectives
            raise ValueError("start_plan: slots need x_TD or w1_EGD (the token rows' width and dtype)")
        if not isinstance(slots, Slots) or not all(isinstance(n, int) and n >= 1 for n in (slots.rows, slots.pairs)):
            raise ValueError(f"start_plan: slots must be None or Slots with rows and pairs >= 1, got {slots!r}")
        if options.num_chunks != 1:
            error = error or f"slots need num_chunks = 1, got {options.num_chunks}"
    # 2. rounding: the one place that decides it, on the device (the candidate all-gather rides before step 4)
    rounded = duplicates = None
    if rounding is not None:
        rounded, duplicates = _round_on_device(
            routing, tok_R, exp_R, scores_R, rounding_scores_TE, T, num_experts, rounding, group, device
        )
        if error is None:
            tok_R, exp_R, scores_R = rounded.token_idx_R, rounded.expert_idx_R, rounded.scores_R
    indices = routing.indices_TK if is_topk else None
    fields = dict(
        error=False,
        num_tokens=T,
        x_TD=x_TD if isinstance(x_TD, torch.Tensor) else None,
        num_experts=num_experts,
        group_size=P,
        fingerprint=group_fingerprint(group),
        rounding=rounding,
        num_chunks=options.num_chunks,
        w1_EGD=w1_EGD if isinstance(w1_EGD, torch.Tensor) else None,
        w2_EDF=w2_EDF if isinstance(w2_EDF, torch.Tensor) else None,
        activation=options.activation,
        top_k=-1 if indices is None else (indices.shape[-1] if indices.dim() else 0),
        scores_dtype=_scores(routing).dtype if is_topk or is_flat else None,
        slots=slots,
    )
    # 3. send side, before the sync (rounded: padding pairs go nowhere). With the kernels, its counts and index
    # stats land straight in the sizes exchange's buffer, whose other fields come from a cached copy.
    side = exchange = None
    if error is None:
        try:
            if kernels is not None:
                exchange = exchange_buffer(V.header_host(**fields, device_fields=_KERNEL_STAT_FIELDS), P, device)
                side = SendSide(*kernels(indices, routing.scores_TK, T, L, P, N, out=exchange_outputs(exchange, P, N)))
            else:
                topk = routing if is_topk and rounding is None else None
                offsets = None if rounded is None else rounded.token_offsets
                side = build_send_side(
                    tok_R, exp_R, scores_R, T, L, P, N, topk, padded=rounding is not None, token_offsets=offsets
                )
        except Exception as exc:  # noqa: BLE001 - raised on every rank by the header check
            error, cause, side, exchange = _local_error(exc), exc, None, None
    row_layout = pair_layout = None
    if slots is not None and side is not None and error is None:
        row_layout = slot_layout(side.send_token_idx_R, side.rows_NP[:P], P, slots.rows)
        pair_layout = slot_layout(entry_index(side.order.numel(), device), side.pairs_NP[:P], P, slots.pairs)
    # 4a. sizes: header + counts launched towards the host
    if exchange is None:
        fields["error"] = error is not None
        hdr = V.header(**fields, index_stats=stats, duplicate_pairs=duplicates, device=device)
        exchange = torch.cat([*hdr, *counts_slot(side, P, N, device)])
    sizes = launch_exchange(exchange, group)
    return StartedPlan(
        group=group,
        rank=rank,
        world_size=P,
        num_experts=num_experts,
        num_local_experts=L,
        num_chunks=N,
        num_tokens=T,
        error=error,
        token_idx_R=tok_R,
        expert_idx_R=exp_R,
        # a bad rank's placeholder: callers pass it on (Megatron's schedule detaches it) until finish_plan raises
        scores_R=scores_R if error is None else torch.zeros(0, device=device),
        rounded=rounded,
        side=side,
        sizes=sizes,
        error_cause=cause,
        slots=slots,
        row_layout=row_layout,
        pair_layout=pair_layout,
        row_like=row_like if slots is not None else None,
        pair_columns=3 if fields["scores_dtype"] != torch.float64 else 4,
        pairs_per_row_hint=_pairs_per_row(num_experts, fields["top_k"], P),
    )


def _pairs_per_row(num_experts, top_k: int, world_size: int) -> int:
    """Top-K routing (``top_k`` > 0): the pairs a received row carries on average under uniform routing, K / P of a
    token's pairs over the share of tokens that reach a rank (``slots.expected_fill``), at least 1; 0 otherwise.
    The kernels block a row's pairs by it (``RoutingMetadata.pairs_per_token_hint``): from the routing's shape
    alone, so every layout of the same pairs (exact split sizes, slots, slots before the sync) sums them alike."""
    if top_k <= 0 or not isinstance(num_experts, int) or num_experts < 1 or num_experts % world_size:
        return 0
    fill = expected_fill(num_experts, top_k, world_size)
    return max(1, round(top_k / world_size / fill)) if fill > 0 else 0


def _row_like(x_TD, w1_EGD) -> tuple | None:
    """(D, dtype, device) of the token rows as every rank's model has them: from the weights where given (the
    layer's parameters), else from x; None where neither is a tensor of the right rank."""
    if isinstance(w1_EGD, torch.Tensor) and w1_EGD.dim() == 3:
        return w1_EGD.shape[2], w1_EGD.dtype, w1_EGD.device
    if isinstance(x_TD, torch.Tensor) and x_TD.dim() == 2:
        return x_TD.shape[1], x_TD.dtype, x_TD.device
    return None


# Header fields the send-side kernels write (min / max expert, the duplicate flag); top-K routing's tokens are 0..T-1
# by construction (field 12: no problem) and there is no rounding (field 18).
_KERNEL_STAT_FIELDS = {10: -1, 11: -1, 12: 0, 18: -1, 19: -1}


def _scores(routing: TopKRouting | FlatRouting) -> torch.Tensor:
    return routing.scores_TK if isinstance(routing, TopKRouting) else routing.scores_R


def _plan_device(routing, x_TD) -> torch.device:
    """Where the plan's tensors live: the routing's device, else x's, else the current CUDA device (NCCL's), else
    the CPU (a bad routing must still reach the header exchange)."""
    if isinstance(routing, TopKRouting):
        return routing.indices_TK.device
    if isinstance(routing, FlatRouting):
        return routing.token_idx_R.device
    if isinstance(x_TD, torch.Tensor):
        return x_TD.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _local_error(exc: Exception) -> str:
    """This rank's failure as the header check reports it: an input check's message as is, anything else (device
    work on this rank's pairs: out of memory, a kernel that failed to build) with its type."""
    if isinstance(exc, (V.EPInputError, TypeError)):
        return str(exc)
    return f"{type(exc).__name__} while planning: {exc}"


def finish_plan(started: StartedPlan, received_pairs: torch.Tensor | None = None) -> EPPlan:
    """Step 4's host sync (the plan's one: the header check raises here on every rank) and step 5. A plan started
    with ``slots`` takes ``received_pairs``, the pair metadata ``slots.launch_slots`` received: its rows and pairs
    have left already, so counts that do not fit the slots raise here, on every rank."""
    s, P, N = started, started.world_size, started.num_chunks
    if (s.slots is None) != (received_pairs is None):
        raise ValueError("finish_plan: received_pairs (from slots.launch_slots) is needed exactly for a slotted plan")
    try:
        counts_host, counts_PW, max_tokens = receive_header_and_counts(
            s.sizes, local_error=s.error, group=s.group, num_experts=s.num_experts
        )
    except V.EPInputError as exc:
        if s.error_cause is None:
            raise
        raise exc from s.error_cause  # this rank's own failure: its traceback stays in the chain
    if s.slots is not None:
        check_slots_fit(counts_host, s.slots.rows, s.slots.pairs)
    sizes = split_sizes(counts_host, counts_PW, rank=s.rank, num_chunks=N)
    S = sum(map(sum, sizes.send_rows))
    R = sum(map(sum, sizes.send_pairs))  # every real pair is sent (to this rank too); padding pairs are not
    tok_R, exp_R, scores_R, rounded = s.token_idx_R, s.expert_idx_R, s.scores_R, s.rounded
    if rounded is not None:  # the real rounded pairs come first: cut the padding off, on the host
        tok_R, exp_R, scores_R = tok_R[:R], exp_R[:R], scores_R[:R]
        rounded = replace(rounded, token_idx_R=tok_R, expert_idx_R=exp_R, scores_R=scores_R)
    side = s.side
    send_token_idx_S, combine_order_S = side.send_token_idx_R[:S], side.combine_order_R[:S]
    send_rows, recv_rows = sizes.send_rows, sizes.recv_rows
    if s.slots is not None:  # the rows travelled in slots (``slots.py``): the plan reads the slots' layout
        send_rows = recv_rows = [[s.slots.rows] * P]
        send_token_idx_S, combine_order_S = s.row_layout.token_idx, s.row_layout.pos_R[combine_order_S]
    plan = EPPlan(
        group=s.group,
        rank=s.rank,
        world_size=P,
        num_experts=s.num_experts,
        num_local_experts=s.num_local_experts,
        num_chunks=N,
        num_tokens=s.num_tokens,
        token_idx_R=tok_R,
        expert_idx_R=exp_R,
        scores_R=scores_R,
        send_token_idx_S=send_token_idx_S,
        send_pair_idx=side.order[:R],
        combine_order_S=combine_order_S,
        combine_offsets=side.combine_offsets,
        send_rows=send_rows,
        send_pairs=sizes.send_pairs,
        recv_rows=recv_rows,
        recv_pairs=sizes.recv_pairs,
        rounding=rounded,
        row_slots=None if s.slots is None else s.slots.rows,
        pair_slots=None if s.slots is None else s.slots.pairs,
        rows_with_pairs=sum(map(sum, sizes.recv_rows)),
        pairs_per_row_hint=s.pairs_per_row_hint,
        max_tokens=max_tokens,
    )
    # 5. receive side: the pair metadata leaves now, not waited for (``plan.recv_meta`` waits on first use); with
    # slots it is here: its received entries are compacted
    if s.slots is not None:
        plan._incoming = SlottedPairs(lambda: plan.pairs_from_slots(received_pairs), sizes.counts_PW)
    else:
        plan._incoming = launch_pair_all_to_alls(
            side.pair_meta_RC, sizes.send_pairs, sizes.recv_pairs, sizes.counts_PW, group=s.group
        )
    return plan


def rounding_kernels(routing, rounding_scores_TE, num_experts, device: torch.device):
    """``triton_round_ep.round_ep_triton`` where it runs this rounding (CUDA, top-K routing, scores and dense
    probabilities of at most 32 bits, E >= 1, Triton importable), else None (``round_routing_padded``). The choice
    must be the same on every rank (both paths run collectives): it reads only what a model's ranks share -- the
    device type, the routing's type, the router's dtypes and E -- so a rank whose routing is malformed otherwise
    (wrong shapes, bad indices) takes its peers' path and reports the problem in the plan's header."""
    if device.type != "cuda" or not isinstance(routing, TopKRouting) or not isinstance(num_experts, int):
        return None
    if num_experts < 1 or any(
        isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in (routing.scores_TK, rounding_scores_TE)
    ):
        return None
    try:
        from .triton_round_ep import round_ep_triton
    except ImportError:  # no Triton: PyTorch's ops (same results)
        return None
    return round_ep_triton


def _round_on_device(
    routing,
    tok_R: torch.Tensor | None,
    exp_R: torch.Tensor | None,
    scores_R: torch.Tensor | None,
    rounding_scores_TE: torch.Tensor | None,
    T: int,
    num_experts: int,
    rounding: TokenRounding,
    group,
    device: torch.device,
) -> tuple[RoundingResult, torch.Tensor]:
    """Step 2: (the padded rounding of this rank's pairs, its 0-d duplicate-pair flag) with no host sync: in the
    kernels for top-K routing on CUDA (``rounding_kernels``), else in PyTorch ops (``round_routing_padded``).

    It runs before the header check, so it must neither hang nor fault on bad input: a rank whose local check
    failed (``tok_R`` None) joins the collectives with no pairs and no tokens, and indices the header will report
    as out of range are clamped into range for the PyTorch ops (the kernels skip them). Either way the header
    check then raises on every rank and the result is never used."""
    kernels = rounding_kernels(routing, rounding_scores_TE, num_experts, device)
    if kernels is not None:
        if tok_R is None:  # a bad rank: no tokens
            empty = torch.zeros((0, 1), dtype=torch.int64, device=device)
            routing = TopKRouting(empty.float(), empty)
            rounding_scores_TE = torch.zeros((0, num_experts), device=device)
        rounded, duplicates_P = kernels(
            routing, rounding_scores_TE, num_experts=num_experts, mode=rounding.mode, tile=rounding.tile, group=group
        )
        return rounded, duplicates_P[group_rank(group)]
    E = num_experts if isinstance(num_experts, int) and num_experts > 0 else 0
    if tok_R is None:  # a bad rank: no pairs, no tokens
        tok_R = exp_R = torch.zeros(0, dtype=torch.int64, device=device)
        scores_R, rounding_scores_TE = torch.zeros(0, device=device), torch.zeros((0, E), device=device)
    elif T == 0:  # no tokens: any pair is out of range
        tok_R, exp_R, scores_R = tok_R[:0], exp_R[:0], scores_R[:0]
    else:
        tok_R, exp_R = tok_R.clamp(0, T - 1), exp_R.clamp(0, E - 1)
    rounded, duplicates_P = round_routing_padded(
        tok_R, exp_R, scores_R, rounding_scores_TE, num_experts=E, rounding=rounding, group=group
    )
    return rounded, duplicates_P[group_rank(group)] != 0
