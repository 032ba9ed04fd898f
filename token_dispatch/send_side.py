"""The plan's send side: which token rows and pairs this rank sends where, all on the device, before any host
size is known (so it is launched BEFORE the plan's host sync, sized by R, and sliced to S after it).

Shape legend (extends ``kernels/routing.py``):
    T  tokens of this rank       E  global experts        L  local experts (E / P)     P  EP ranks
    N  chunks (num_chunks)       R  routed pairs of this rank (after rounding: padded, see ``padded`` below)
    S  send rows: distinct (token, destination rank) of this rank, ordered (chunk, destination, token)
    C  int32 columns of the pair metadata: row in segment, local expert, the score's bits (1 or 2 columns)

A segment is one (chunk, destination rank): pairs are stably sorted by segment (tokens stay ascending
inside one), and consecutive pairs of one token and destination form one send row (dedup). Two
implementations with bitwise the same results: PyTorch ops (``send_side_torch``: the reference; CPU, flat
routing, rounded routing) and, for top-K routing on CUDA, the Triton kernels of ``triton_send.py`` (a few
launches instead of ~40). ``build_send_side`` picks.

A rounded routing is padded (``FlatRouting.padded``: real pairs first, then pairs of token T and expert E):
``padded=True`` gives padding pairs the segment N*P, past every destination, so that they sort after all real
pairs and no row or pair count includes them -- the send side of the real pairs is what it would be unpadded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..kernels.routing import RoutingMetadata, TopKRouting, flatten_routing, run_offsets


def flat_routing(routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_idx_R int64, expert_idx_R int64, scores_R) of a ``TopKRouting`` / ``FlatRouting``; top-K
    routing flattens without a launch for int64 indices (views and a cached token index)."""
    if isinstance(routing, TopKRouting) and routing.indices_TK.dim() == 2:
        T, K = routing.indices_TK.shape
        tok = _topk_tokens(T, K, routing.indices_TK.device)
        return tok, routing.indices_TK.reshape(-1).long(), routing.scores_TK.reshape(-1)
    tok, exp, scores, _ = flatten_routing(routing)
    return tok.long(), exp.long(), scores


@functools.lru_cache(maxsize=16)
def _topk_tokens(T: int, K: int, device: torch.device) -> torch.Tensor:
    """Token of every pair t * K + k of a [T, K] top-K routing: the same for every call of one shape, so built
    once (read only: nothing writes a plan's token index)."""
    return torch.arange(T, device=device).unsqueeze(1).expand(T, K).reshape(-1)


def score_columns(scores_R: torch.Tensor) -> torch.Tensor:
    """The scores' bits as int32 columns [R, 1 or 2] (they ride in the pair-metadata all-to-all): float32 as
    is, float64 as two columns, 16-bit floats widened to float32 first (exact)."""
    s = scores_R.detach()
    if s.dtype != torch.float64:
        s = s.float()
    return s.contiguous().view(torch.int32).view(s.numel(), 2 if s.dtype == torch.float64 else 1)


@dataclass
class SendSide:
    """The send side of a plan, all on the device and sized by R (>= S): nothing here needs a host size."""

    order: torch.Tensor  # send_pair_idx [R]: flat pair index of every pair, in send order
    send_token_idx_R: torch.Tensor  # [R]; rows S.. hold the sentinel T
    combine_order_R: torch.Tensor  # [R]; the first S entries are the combine order of the S send rows
    combine_offsets: torch.Tensor  # [T + 1]
    pair_meta_RC: torch.Tensor  # int32 [R, C]: row in segment, local expert, score bits
    rows_NP: torch.Tensor  # int64 [N*P]: send rows per segment
    pairs_NP: torch.Tensor  # int64 [N*P]: pairs per segment
    index_stats: object = None  # triton_send.IndexStats where the kernels computed them, else None


def combine_metadata(combine_order_S: torch.Tensor, combine_offsets: torch.Tensor) -> RoutingMetadata:
    """The combine sum as routing metadata for the kernels' gather-sum: "pairs" are a token's returned rows in
    destination order (``combine_order_S``: their positions in the returned buffer), CSR ``combine_offsets`` per
    token."""
    order = combine_order_S.to(torch.int32)
    return RoutingMetadata(
        expert_offsets=torch.zeros(2, dtype=torch.int32, device=order.device),
        x_gather_idx=order,
        s_scatter_idx=order,
        s_reverse_scatter_idx=order,
        token_offsets=combine_offsets.to(torch.int32),
    )


def _send_layout(tok_R, exp_R, T, L, P, N, padded=False):
    """Device-side send layout: (pair order, sorted segment ids, sorted tokens, send row of each sorted pair,
    per-segment row counts [N*P], per-segment pair counts [N*P], first send row of each segment [N*P + 1]).
    No host sync."""
    device = tok_R.device
    R = tok_R.numel()
    seg_R = torch.div(exp_R, L, rounding_mode="floor").clamp(0, P - 1)  # destination; bad indices fail later
    if N > 1:
        chunk_R = torch.div(tok_R.clamp(min=0) * N, max(T, 1), rounding_mode="floor").clamp(0, N - 1)
        seg_R = chunk_R * P + seg_R
    if padded:  # padding pairs (expert E) have no destination: the segment past the last one
        seg_R = torch.where(exp_R < L * P, seg_R, N * P)
    # Pairs arrive sorted by token; a stable sort by segment keeps tokens ascending inside a segment. The
    # narrowest key dtype: CUDA's radix sort makes one pass per key byte (int16: 2 passes, int64: 8).
    key_dtype = torch.int16 if N * P + padded <= 2**15 else torch.int32
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
    bounds = run_offsets(seg_s, N * P)
    rows_before = new_before[bounds]  # [N*P + 1] send rows before each segment (and the padding's segment)
    return order, seg_s, tok_s, row_of_pair, rows_before.diff(), bounds.diff(), rows_before


def send_side_torch(tok_R, exp_R, scores_R, T, L, P, N, padded=False) -> SendSide:
    """The send side from PyTorch ops: the reference (and the path for CPU, flat and rounded routing).
    ``padded``: (tok_R, exp_R) end in padding pairs (expert E = L * P) that are sent nowhere (module docstring)."""
    layout = _send_layout(tok_R, exp_R, T, L, P, N, padded)
    order, seg_s, tok_s, row_of_pair, rows_NP, pairs_NP, seg_row_start = layout
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
    combine_offsets = run_offsets(sorted_keys, T)
    return SendSide(order, send_token_idx_R, combine_order_R, combine_offsets, pair_meta_RC, rows_NP, pairs_NP)


def triton_send_side(topk: TopKRouting, world_size: int):
    """``triton_send.ep_send_side`` where it runs this top-K routing (CUDA, [T, K] indices, P <= its MAX_RANKS, Triton
    importable), else None."""
    if not topk.indices_TK.is_cuda or topk.indices_TK.dim() != 2:
        return None
    try:
        from .triton_send import MAX_RANKS, ep_send_side
    except ImportError:  # no Triton: PyTorch's ops (same contract)
        return None
    return ep_send_side if world_size <= MAX_RANKS else None  # the kernels keep one tile of flags per token


def build_send_side(
    tok_R,
    exp_R,
    scores_R,
    T,
    L,
    P,
    N,
    topk: TopKRouting | None = None,
    padded: bool = False,
    token_offsets: torch.Tensor | None = None,
) -> SendSide:
    """The send side of the flat pairs (tok_R, exp_R, scores_R): from the Triton kernels on CUDA when
    ``topk`` (the same pairs as top-K routing) is given, or when ``token_offsets`` [T + 1] gives each token's range of
    token-sorted pairs (the rounded routing: ``triton_send_csr.py``), else from ``send_side_torch`` (same results).
    ``padded``: the pairs end in padding pairs (token T, expert E), which no segment includes."""
    kernels = None if topk is None else triton_send_side(topk, P)
    if kernels is not None:
        return SendSide(*kernels(topk.indices_TK, topk.scores_TK, T, L, P, N))
    csr = None if token_offsets is None or not padded else _csr_send_side(token_offsets, T, P)
    if csr is not None:
        return SendSide(*csr(token_offsets, exp_R, scores_R, T, L, P, N))
    return send_side_torch(tok_R, exp_R, scores_R, T, L, P, N, padded)


def _csr_send_side(token_offsets: torch.Tensor, T: int, world_size: int):
    """``triton_send_csr.ep_send_side_csr`` where it runs (CUDA, T >= 1, P <= its MAX_RANKS, Triton importable),
    else None."""
    if not token_offsets.is_cuda or T < 1:
        return None
    try:
        from .triton_send import MAX_RANKS
        from .triton_send_csr import ep_send_side_csr
    except ImportError:  # no Triton: PyTorch's ops (same contract)
        return None
    return ep_send_side_csr if world_size <= MAX_RANKS else None
