"""The dispatch plan: who sends which token rows and pairs where, computed once per layer call.

Shape legend (extends ``kernels/routing.py``):
    T  tokens of this rank       E  global experts        L  local experts (E / P)     P  EP ranks
    N  chunks (num_chunks)       R  routed pairs of this rank (after rounding)
    S  send rows: distinct (token, destination rank) of this rank, ordered (chunk, destination, token)
    U  received rows of one chunk, ordered (source rank, token)      Q  received pairs of one chunk

A token crosses to a destination rank once, however many of its experts live there (dedup). Its pairs on
that rank travel as int32 (row within the (chunk, source) segment, local expert, the score's bits: one
column for float32 and 16-bit floats, two for float64); the receiver turns them into a ``FlatRouting``
over its L local experts whose "tokens" are receive-buffer rows, so the local grouped GEMM gathers
straight from the receive buffer (no second permutation).

Order of ``make_plan`` -- the host sync drains the GPU queue, so as little as possible comes after it:
  1. before the sync, on the device: validation header, send layout and everything of the send side that
     needs no host size, sized by R (>= S send rows) and sliced after the sync: send rows' tokens, pair
     metadata + score bits, combine order and offsets (``_send_side``; for top-K routing on CUDA the Triton
     kernels of ``triton_send.py``, same results in a few launches).
  2. no rounding: ONE all-gather of [18 + 2 * 16 * P] int64 (header + per-(chunk, destination) row and
     pair counts, sized for up to MAX_CHUNKS = 16 chunks so that every rank sends the same size even when
     their inputs disagree) and ONE host copy of it (split sizes must be host ints for all_to_all_single;
     the header check rides along). Between the all-gather's launch and the host copy the caller's
     ``before_sync`` runs (interleave.py launches the previous micro-batch's dO all-to-all there: its host
     cost then overlaps the wait for the all-gather).
     rounding: the same all-gather (counts left empty) and host copy come first (so bad input fails before
     rounding), then rounding's one candidate all-gather and two host syncs (the all-ranks duplicate-pair
     flags, a few bytes; ``nonzero``: the rounded pair count), then the send side, the counts all-gather
     and its host copy.
  3. after the sync: host split lists, then at once one all-to-all per chunk of the pair metadata (sizes
     known), NOT waited for. ``make_plan`` returns; the caller launches its row all-to-alls and only then
     touches ``plan.recv_meta`` / ``plan.recv_scores()``, which wait for the pair all-to-alls and build the
     receive metadata (``_recv_metadata``) while the rows are in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..kernels.routing import FlatRouting, RoutingMetadata, TopKRouting, compute_metadata_torch, flatten_routing
from . import validation as V
from .comm import Pending, all_gather, all_to_all, group_fingerprint, group_rank, group_size
from .rounding import RoundingResult, TokenRounding, round_routing


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
    received pairs' scores.  rounding: the RoundingResult when rounding was applied.  by_source: stages per
    (chunk, source rank).
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
    by_source: bool = False
    _offsets: dict = field(default_factory=dict, repr=False)
    _incoming: tuple | None = field(default=None, repr=False)  # (pending pair all-to-alls, meta_QC, counts)
    _recv_meta: list | None = field(default=None, repr=False)

    # --- the receive side: pair metadata and scores arrive by the plan's (async) all-to-alls -------------
    def _received(self) -> tuple[torch.Tensor, torch.Tensor]:
        pending, meta_QC, counts_dev = self._incoming
        pending.wait()  # no-op after the first call
        return meta_QC, counts_dev

    @property
    def recv_meta(self) -> list[RoutingMetadata]:
        """Per stage (``num_stages``), RoutingMetadata over the L local experts of the stage's received
        pairs (rows index the stage's slice of the receive buffer). Built on first access, which waits for
        the plan's pair all-to-alls: call it after launching the row all-to-alls so that both are in flight
        together."""
        if self._recv_meta is None:
            self._recv_meta = _recv_metadata(self, *self._received())
        return self._recv_meta

    def recv_scores(self) -> torch.Tensor:
        """The received pairs' scores [Q] (dtype of ``scores_R``), in receive order; a new tensor per call."""
        meta_QC, _ = self._received()
        return scores_from_columns(meta_QC[:, 2:], self.scores_R.dtype)

    # --- stages: the unit of pipelining -----------------------------------------------------------------
    # Chunk mode (by_source False): stage i = chunk i, its all-to-alls move the chunk's rows between all ranks.
    # By source: stage i = (chunk c, ring offset k), k = i mod P: this rank sends chunk c's rows for rank
    # + k and receives those of rank - k (a point-to-point exchange); k = 0 is this rank's own rows, which
    # need no communication, so the first stage's GEMMs start at once while stage 1's rows travel.
    @property
    def num_stages(self) -> int:
        return self.num_chunks * (self.world_size if self.by_source else 1)

    def stage_peers(self, i: int) -> tuple[int, int | None, int | None]:
        """(chunk, destination rank, source rank) of stage i; (c, None, None) in chunk mode (all ranks)."""
        if not self.by_source:
            return i, None, None
        c, k = divmod(i, self.world_size)
        return c, (self.rank + k) % self.world_size, (self.rank - k) % self.world_size

    def is_local_stage(self, i: int) -> bool:
        """Stage i moves only this rank's own rows (by source, k = 0): a device copy, no collective."""
        return self.by_source and i % self.world_size == 0

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

    def _range(self, name: str, i: int) -> tuple[int, int]:
        c, dst, src = self.stage_peers(i)
        peer = dst if name.startswith("send") else src
        if peer is None:
            return self.chunk_range(name, c)
        o, P = self._cum(name), self.world_size
        return o[c * P + peer], o[c * P + peer + 1]

    def chunk_range(self, name: str, c: int) -> tuple[int, int]:
        """Chunk c's range in the buffer counted by ``name`` (send_rows, send_pairs, recv_rows, recv_pairs)."""
        o, P = self._cum(name), self.world_size
        return o[c * P], o[(c + 1) * P]

    def send_row_range(self, i: int) -> tuple[int, int]:
        """Stage i's rows in the send buffer [S, D]."""
        return self._range("send_rows", i)

    def recv_row_range(self, i: int) -> tuple[int, int]:
        """Stage i's rows in the receive buffer [U, D]."""
        return self._range("recv_rows", i)

    def send_pair_range(self, i: int) -> tuple[int, int]:
        return self._range("send_pairs", i)

    def recv_pair_range(self, i: int) -> tuple[int, int]:
        return self._range("recv_pairs", i)

    def combine_meta(self) -> RoutingMetadata:
        """The combine sum as routing metadata for the kernels' gather-sum: "pairs" are (token, destination)
        rows in token order (``combine_order_S``), CSR ``combine_offsets`` per token."""
        if "combine_meta" not in self._offsets:
            order = self.combine_order_S.to(torch.int32)
            self._offsets["combine_meta"] = RoutingMetadata(
                expert_offsets=torch.zeros(2, dtype=torch.int32, device=order.device),
                x_gather_idx=order,
                s_scatter_idx=order,
                s_reverse_scatter_idx=order,
                token_offsets=self.combine_offsets.to(torch.int32),
            )
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


def _flat(routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if isinstance(routing, TopKRouting) and routing.indices_TK.dim() == 2:  # 2 launches (no CSR offsets)
        T, K = routing.indices_TK.shape
        tok = torch.arange(T, device=routing.indices_TK.device).unsqueeze(1).expand(T, K).reshape(-1)
        return tok, routing.indices_TK.reshape(-1).long(), routing.scores_TK.reshape(-1)
    tok, exp, scores, _ = flatten_routing(routing)
    return tok.long(), exp.long(), scores


def _send_layout(tok_R, exp_R, T, L, P, N):
    """Device-side send layout: (pair order, sorted segment ids, sorted tokens, send row of each sorted pair,
    per-segment row counts [N*P], per-segment pair counts [N*P], first send row of each segment [N*P]).
    No host sync."""
    device = tok_R.device
    R = tok_R.numel()
    seg_R = torch.div(exp_R, L, rounding_mode="floor").clamp(0, P - 1)  # destination; bad indices fail later
    if N > 1:
        chunk_R = torch.div(tok_R.clamp(min=0) * N, max(T, 1), rounding_mode="floor").clamp(0, N - 1)
        seg_R = chunk_R * P + seg_R
    # Pairs arrive sorted by token; a stable sort by segment keeps tokens ascending inside a segment. The
    # narrowest key dtype: CUDA's radix sort makes one pass per key byte (int16: 2 passes, int64: 8).
    key_dtype = torch.int16 if N * P <= 2**15 else torch.int32
    order = torch.sort(seg_R.to(key_dtype), stable=True).indices
    seg_s, tok_s = seg_R[order], tok_R[order]
    key = seg_s * (T + 1) + tok_s
    is_new = torch.ones(R, dtype=torch.bool, device=device)
    if R > 1:
        is_new[1:] = key[1:] != key[:-1]
    new_before = torch.zeros(R + 1, dtype=torch.int64, device=device)  # send rows started before pair i
    torch.cumsum(is_new, 0, dtype=torch.int64, out=new_before[1:])
    row_of_pair = new_before[1:] - 1
    # Per-segment counts from the segment boundaries of the sorted pairs (no atomics, unlike index_add_).
    bounds = torch.searchsorted(seg_s, torch.arange(N * P + 1, dtype=seg_s.dtype, device=device))
    rows_before = new_before[bounds]  # [N*P + 1] send rows before each segment
    return order, seg_s, tok_s, row_of_pair, rows_before.diff(), bounds.diff(), rows_before[:-1]


def score_columns(scores_R: torch.Tensor) -> torch.Tensor:
    """The scores' bits as int32 columns [R, 1 or 2] (they ride in the pair-metadata all-to-all): float32 as
    is, float64 as two columns, 16-bit floats widened to float32 first (exact)."""
    s = scores_R.detach()
    if s.dtype != torch.float64:
        s = s.float()
    return s.contiguous().view(torch.int32).view(s.numel(), 2 if s.dtype == torch.float64 else 1)


def scores_from_columns(cols_QC: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``score_columns`` for the received pairs: [Q] of ``dtype`` (a new tensor)."""
    wire = torch.float64 if dtype == torch.float64 else torch.float32
    s = cols_QC.contiguous().view(wire).reshape(-1)
    return s.to(dtype) if s.dtype != dtype else s


@dataclass
class _SendSide:
    """The send side of a plan, all on the device and sized by R (>= S): nothing here needs a host size, so it
    is all launched BEFORE the plan's host sync and sliced to S after it."""

    order: torch.Tensor  # send_pair_idx [R]
    send_token_idx_R: torch.Tensor  # [R]; rows S.. hold the sentinel T
    combine_order_R: torch.Tensor  # [R]; the first S entries are the combine order of the S send rows
    combine_offsets: torch.Tensor  # [T + 1]
    pair_meta_RC: torch.Tensor  # int32 [R, 2 + score columns]: row in segment, local expert, score bits
    rows_NP: torch.Tensor
    pairs_NP: torch.Tensor


def _send_side(tok_R, exp_R, scores_R, T, L, P, N) -> _SendSide:
    order, seg_s, tok_s, row_of_pair, rows_NP, pairs_NP, seg_row_start = _send_layout(tok_R, exp_R, T, L, P, N)
    R, device = tok_R.numel(), tok_R.device
    # Send rows number S <= R (host-known only after the sync): an R buffer whose rows past S keep the
    # sentinel T, so that they sort after every real row in the combine order below and are sliced off.
    send_token_idx_R = torch.full((R,), T, dtype=torch.int64, device=device)
    send_token_idx_R.scatter_(0, row_of_pair, tok_s)  # duplicates of a row write the same token
    row_in_seg = row_of_pair - seg_row_start[seg_s]
    local_exp = exp_R[order].remainder(L)  # = expert - destination * L (expert indices checked >= 0)
    cols = [row_in_seg.to(torch.int32).unsqueeze(1), local_exp.to(torch.int32).unsqueeze(1)]
    pair_meta_RC = torch.cat([*cols, score_columns(scores_R)[order]], dim=1)
    # int32 keys: half the radix passes of int64 (tokens < 2^31).
    keys_R = send_token_idx_R.to(torch.int32) if T < 2**31 else send_token_idx_R
    sorted_keys, combine_order_R = torch.sort(keys_R, stable=True)
    combine_offsets = torch.searchsorted(sorted_keys, torch.arange(T + 1, device=device, dtype=keys_R.dtype))
    return _SendSide(order, send_token_idx_R, combine_order_R, combine_offsets, pair_meta_RC, rows_NP, pairs_NP)


def _build_send_side(routing, tok_R, exp_R, scores_R, T, L, P, N) -> _SendSide:
    """The send side of top-K routing on CUDA from the Triton kernels (``triton_send.py``: a few launches
    instead of ~40, bitwise the same results), else from ``_send_side``'s PyTorch ops (the reference; CPU,
    flat routing, rounded routing)."""
    topk = isinstance(routing, TopKRouting) and routing.indices_TK.dim() == 2
    if tok_R.is_cuda and topk:
        try:
            from .triton_send import MAX_RANKS, ep_send_side
        except ImportError:  # no Triton: PyTorch's ops (same contract)
            pass
        else:
            if P <= MAX_RANKS:  # the kernels keep one tile of destination flags per token
                return _SendSide(*ep_send_side(routing.indices_TK, routing.scores_TK, T, L, P, N))
    return _send_side(tok_R, exp_R, scores_R, T, L, P, N)


def make_plan(
    routing: TopKRouting | FlatRouting,
    *,
    num_experts: int,
    group=None,
    rounding: TokenRounding | None = None,
    rounding_scores_TE: torch.Tensor | None = None,
    num_chunks: int = 1,
    by_source: bool = False,
    x_TD: torch.Tensor | None = None,
    w1_EGD: torch.Tensor | None = None,
    w2_EDF: torch.Tensor | None = None,
    activation: str | None = None,
    before_sync: Callable[[], object] | None = None,
) -> EPPlan:
    """Plan one MoE layer call under expert parallelism (see the module docstring for its collectives).

    Args:
        routing: this rank's ``TopKRouting`` / ``FlatRouting`` over GLOBAL expert ids [0, E).
        num_experts: E; must be a multiple of the group size P. Rank r owns experts [r*E/P, (r+1)*E/P).
        group: the EP process group; ``None`` or size 1 means no communication.
        rounding: tile-aware token rounding (training only; ``None`` = plain routing).
        rounding_scores_TE: dense router probabilities [T, E]; required with ``rounding``.
        num_chunks: split this rank's tokens into N contiguous chunks, each with its own all-to-alls.
        by_source: also split every chunk by source rank (``EPPlan.num_stages`` = N * P stages, own rows
            first, then a ring of point-to-point exchanges), so each stage's rows can be computed as soon as
            they arrive. Must be equal on all ranks (checked).
        x_TD, w1_EGD, w2_EDF, activation: optional; when given, their shapes and dtypes are validated and
            compared across ranks in the same header exchange (recommended: a mismatch then raises on all
            ranks instead of failing or hanging inside an all-to-all).
        before_sync: called once, after the first all-gather is launched and before the host waits for it,
            on every rank (also when the inputs are bad, so every rank launches the same collectives): work
            whose host cost should overlap that wait, e.g. launching another micro-batch's all-to-all. Its
            collectives queue after the all-gather; it must not wait for the GPU.
    """
    P, rank = group_size(group), group_rank(group)
    T = V.routing_num_tokens(routing)
    error = None
    try:
        V.check_local(
            routing,
            num_experts=num_experts,
            group_size=P,
            rounding=rounding,
            rounding_scores_TE=rounding_scores_TE,
            num_chunks=num_chunks,
            by_source=by_source,
            x_TD=x_TD,
            w1_EGD=w1_EGD,
            w2_EDF=w2_EDF,
            activation=activation,
        )
    except (V.EPInputError, TypeError) as exc:
        error = str(exc)
    device = (routing.indices_TK if isinstance(routing, TopKRouting) else routing.token_idx_R).device
    N = num_chunks if error is None else 1
    L = max(num_experts // P, 1) if error is None else 1
    stats = None
    if error is None:
        tok_R, exp_R, scores_R = _flat(routing)
        stats = V.index_stats(tok_R, exp_R, T, isinstance(routing, FlatRouting))
    hdr = V.header(
        error=error is not None,
        num_tokens=T,
        x_TD=x_TD,
        num_experts=num_experts,
        group_size=P,
        fingerprint=group_fingerprint(group),
        rounding=rounding,
        num_chunks=num_chunks,
        by_source=by_source,
        w1_EGD=w1_EGD,
        w2_EDF=w2_EDF,
        activation=activation,
        top_k=routing.indices_TK.shape[-1] if isinstance(routing, TopKRouting) else -1,
        index_stats=stats,
        device=device,
    )

    def counts_slot(side: _SendSide | None) -> list[torch.Tensor]:
        # Fixed size (MAX_CHUNKS) so that ranks passing different num_chunks still exchange equal sizes.
        if side is None:
            return [torch.zeros(2 * V.MAX_CHUNKS * P, dtype=torch.int64, device=device)]
        pad = torch.zeros((V.MAX_CHUNKS - N) * P, dtype=torch.int64, device=device)
        return [side.rows_NP, pad, side.pairs_NP, pad]

    # Everything that needs no host size is launched before the sync: the send side (sized by R).
    side = _build_send_side(routing, tok_R, exp_R, scores_R, T, L, P, N) if error is None and rounding is None else None
    # The one host sync of the plan without rounding: header + split sizes (the header check rides along).
    gathered_dev = all_gather(torch.cat([*hdr, *counts_slot(side)]), group)
    if before_sync is not None:
        before_sync()
    gathered = gathered_dev.tolist()
    V.check_headers([g[: V.HEADER_LEN] for g in gathered], error, group, num_experts)
    counts_P = [g[V.HEADER_LEN :] for g in gathered]
    counts_dev = gathered_dev[:, V.HEADER_LEN :]  # the same counts on the device (receive metadata)
    rounded = None
    if rounding is not None:
        rounded = round_routing(
            tok_R, exp_R, scores_R, rounding_scores_TE, num_experts=num_experts, rounding=rounding, group=group
        )
        tok_R, exp_R, scores_R = rounded.token_idx_R, rounded.expert_idx_R, rounded.scores_R
        side = _send_side(tok_R, exp_R, scores_R, T, L, P, N)
        counts_dev = all_gather(torch.cat(counts_slot(side)), group)
        counts_P = counts_dev.tolist()  # host sync: sizes after rounding

    # --- after the sync: host split sizes [N][P], then at once the pair-metadata all-to-alls ---------------
    def split(src: int, c: int, pairs: bool) -> list[int]:
        base = V.MAX_CHUNKS * P if pairs else 0
        return counts_P[src][base + c * P : base + (c + 1) * P]

    send_rows = [split(rank, c, False) for c in range(N)]
    send_pairs = [split(rank, c, True) for c in range(N)]
    recv_rows = [[split(src, c, False)[rank] for src in range(P)] for c in range(N)]
    recv_pairs = [[split(src, c, True)[rank] for src in range(P)] for c in range(N)]
    S = sum(map(sum, send_rows))
    plan = EPPlan(
        group=group,
        rank=rank,
        world_size=P,
        num_experts=num_experts,
        num_local_experts=L,
        num_chunks=N,
        num_tokens=T,
        token_idx_R=tok_R,
        expert_idx_R=exp_R,
        scores_R=scores_R,
        send_token_idx_S=side.send_token_idx_R[:S],
        send_pair_idx=side.order,
        combine_order_S=side.combine_order_R[:S],
        combine_offsets=side.combine_offsets,
        send_rows=send_rows,
        send_pairs=send_pairs,
        recv_rows=recv_rows,
        recv_pairs=recv_pairs,
        rounding=rounded,
        by_source=by_source,
    )
    # Pair metadata (and scores): one all-to-all per chunk, launched now and NOT waited for: the receive
    # metadata is built on first use of ``plan.recv_meta`` (after the caller launched its row all-to-alls).
    meta_QC = side.pair_meta_RC.new_empty(plan.num_recv_pairs, side.pair_meta_RC.shape[1])
    pending = Pending()
    for c in range(N):
        s0, s1 = plan.chunk_range("send_pairs", c)
        r0, r1 = plan.chunk_range("recv_pairs", c)
        pending.add(
            all_to_all(meta_QC[r0:r1], side.pair_meta_RC[s0:s1], recv_pairs[c], send_pairs[c], group, async_op=True)
        )
    plan._incoming = (pending, meta_QC, counts_dev)
    return plan


def _metadata_builder(device: torch.device):
    """The kernels' Triton metadata on CUDA (4 launches, same results as PyTorch's), PyTorch's elsewhere."""
    if device.type == "cuda":
        try:
            from ..kernels.triton import compute_metadata_triton

            return compute_metadata_triton
        except ImportError:  # no Triton: PyTorch's ops (same contract)
            pass
    return compute_metadata_torch


def _recv_rows_keys_torch(
    meta_QC: torch.Tensor,
    counts_PW: torch.Tensor,
    *,
    rank,
    world_size,
    num_local_experts,
    num_chunks,
    pair_base,
    num_recv_rows,
    by_source=False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row_Q, key_Q, token_offsets) int32 of the received pairs with PyTorch ops: the reference of (and the
    CPU path for) the one-launch Triton kernel ``triton_recv.py`` (its docstring defines them)."""
    N, P, L, device = num_chunks, world_size, num_local_experts, counts_PW.device
    Q, U = meta_QC.shape[0], num_recv_rows
    cols = rank + P * torch.arange(N, device=device)  # column of (chunk c, destination = this rank)
    recv_rows_NP = counts_PW[:, cols].t().reshape(-1)  # [(chunk, source)] rows received
    recv_pairs_NP = counts_PW[:, pair_base + cols].t().reshape(-1)
    seg_Q = torch.repeat_interleave(torch.arange(N * P, device=device), recv_pairs_NP, output_size=Q)
    seg_row0 = torch.cumsum(recv_rows_NP, 0) - recv_rows_NP  # first receive row of each (chunk, source)
    row_Q = meta_QC[:, 0].long() + seg_row0[seg_Q]  # row in the whole receive buffer (non-decreasing)
    group_Q = seg_Q if by_source else torch.div(seg_Q, P, rounding_mode="floor")  # (chunk, source) or chunk
    key_Q = group_Q * L + meta_QC[:, 1].long()
    token_offsets = torch.searchsorted(row_Q, torch.arange(U + 1, device=device, dtype=torch.int64))
    return row_Q.int(), key_Q.int(), token_offsets.int()


def _recv_rows_keys(meta_QC: torch.Tensor, counts_PW: torch.Tensor, **kw):
    """One Triton launch on CUDA, PyTorch's ops elsewhere (same int32 results)."""
    if counts_PW.is_cuda:
        try:
            from .triton_recv import ep_recv_rows_keys

            return ep_recv_rows_keys(meta_QC, counts_PW, **kw)
        except ImportError:
            pass
    return _recv_rows_keys_torch(meta_QC, counts_PW, **kw)


def _recv_metadata(plan: EPPlan, recv_meta_QC: torch.Tensor, counts_dev: torch.Tensor) -> list[RoutingMetadata]:
    """Per stage, RoutingMetadata of the stage's received pairs over the L local experts (rows index that
    stage's slice of the receive buffer). Built ONCE for all stages -- experts (stage, local expert), i.e.
    N*L (chunk mode) or N*P*L (by source) of them, so stage i's expert-sorted rows are exactly its pair
    range -- then shifted per stage (5 int32 ops a stage). Split sizes come from the device copy of the
    counts exchange: no host-to-device copy, no stream sync."""
    L, S = plan.num_local_experts, plan.num_stages
    row_Q, key_Q, token_offsets = _recv_rows_keys(
        recv_meta_QC,
        counts_dev,
        rank=plan.rank,
        world_size=plan.world_size,
        num_local_experts=L,
        num_chunks=plan.num_chunks,
        pair_base=V.MAX_CHUNKS * plan.world_size,
        num_recv_rows=plan.num_recv_rows,
        by_source=plan.by_source,
    )
    meta = _metadata_builder(counts_dev.device)(row_Q, key_Q, token_offsets, S * L)
    if S == 1:
        return [meta]
    out = []
    for i in range(S):
        q0, q1 = plan.recv_pair_range(i)
        u0, u1 = plan.recv_row_range(i)
        # the stage's experts: (chunk, source) segment c * P + source by source, chunk c otherwise
        c, _, src = plan.stage_peers(i)
        g = c if src is None else c * plan.world_size + src
        out.append(
            RoutingMetadata(
                expert_offsets=meta.expert_offsets[g * L : (g + 1) * L + 1] - q0,
                x_gather_idx=meta.x_gather_idx[q0:q1] - u0,
                s_scatter_idx=meta.s_scatter_idx[q0:q1] - q0,
                s_reverse_scatter_idx=meta.s_reverse_scatter_idx[q0:q1] - q0,
                token_offsets=meta.token_offsets[u0 : u1 + 1] - q0,
            )
        )
    return out
