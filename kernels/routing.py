"""Routing inputs and SonicMoE's routing metadata, computed on the device without a host sync.

Shape legend (torchtitan style, used across ``kernels/``):
    T  tokens            D  hidden size (d)          F  expert ffn size (n)
    E  experts           K  experts per token (top-K)
    R  routed (token, expert) pairs, "rows" (R = T*K for top-K routing)

A routing is either top-K (``TopKRouting``: scores [T, K] and expert indices [T, K]) or flat
(``FlatRouting``: R triples (token, expert, score) sorted by token, any number of experts per token,
which token rounding and expert parallelism need). Internally both become flat: pair j of token t lies
in ``token_offsets[t] : token_offsets[t+1]`` (CSR), and for top-K pair j is the entry t*K + k.

``RoutingMetadata`` holds the int32 arrays every backend uses (as in SonicMoE):
    expert_offsets        [E+1]  exclusive prefix sum of per-expert row counts (cu_seqlens of every
                                 varlen GEMM): expert e owns expert-sorted rows [off[e], off[e+1])
    x_gather_idx          [R]    expert-sorted row r reads token row x_gather_idx[r] of X (and of dO)
    s_scatter_idx         [R]    expert-sorted row r is flat pair s_scatter_idx[r] (index into scores)
    s_reverse_scatter_idx [R]    inverse: flat pair j is expert-sorted row s_reverse_scatter_idx[j]
    token_offsets         [T+1]  CSR offsets of each token's flat pairs
    pairs_per_token       int    K for top-K routing (every token has K pairs), 0 for flat routing
    rows_multiple         int    every expert's row count is a multiple of it (token rounding's tile), 0 if
                                 unknown; the GEMMs may then pick tiles that the rows fill exactly
Rows of one expert are ordered by ascending flat pair index, i.e. by token (a stable sort).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

INDEX_DTYPES = (torch.int32, torch.int64)


def _check_tensor(name: str, value: object) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


@dataclass(frozen=True)
class TopKRouting:
    """Top-K routing: token t uses experts ``indices_TK[t]`` with weights ``scores_TK[t]``."""

    scores_TK: torch.Tensor
    indices_TK: torch.Tensor

    def __post_init__(self) -> None:  # types only: shapes and values are the consumer's checks (no host sync)
        _check_tensor("TopKRouting.scores_TK", self.scores_TK)
        _check_tensor("TopKRouting.indices_TK", self.indices_TK)


@dataclass(frozen=True)
class FlatRouting:
    """Flat routing: pair j sends token ``token_idx_R[j]`` to expert ``expert_idx_R[j]`` with weight
    ``scores_R[j]``. ``token_idx_R`` must be sorted ascending (tokens may have 0..E pairs). ``num_tokens``
    is T, the row count of x (tokens with no pair get a zero output row)."""

    token_idx_R: torch.Tensor
    expert_idx_R: torch.Tensor
    scores_R: torch.Tensor
    num_tokens: int
    # True: the real pairs are followed by padding pairs (token ``num_tokens``, expert E, score 0) that every
    # backend skips. A routing decided on the device (token rounding) then has a host-known size, an upper
    # bound, instead of a host sync to read its real pair count.
    padded: bool = False
    # [T+1] int32 CSR offsets of each token's pairs when the producer has them (token rounding's scan); None:
    # found from token_idx_R (a binary search per token).
    token_offsets: torch.Tensor | None = None
    # The experts' metadata of these pairs when the producer built it (token rounding's placing kernel), exactly
    # what ``compute_metadata`` would build (padded: padding rows past expert_offsets[E], gathering token T - 1);
    # None: built by the experts.
    metadata: RoutingMetadata | None = None

    def __post_init__(self) -> None:  # types and T's sign only: shapes and index values are the consumer's checks
        for name in ("token_idx_R", "expert_idx_R", "scores_R"):
            _check_tensor(f"FlatRouting.{name}", getattr(self, name))
        n = self.num_tokens
        if isinstance(n, bool) or not isinstance(n, int | torch.SymInt):  # bool subclasses int; 6.0 is no count
            raise TypeError(
                f"FlatRouting.num_tokens must be an int >= 0 (T, x's row count), got {n!r} ({type(n).__name__})"
            )
        if n < 0:
            raise ValueError(f"FlatRouting.num_tokens must be an int >= 0 (T, x's row count), got {n!r}")
        if not isinstance(self.padded, bool):
            raise TypeError(f"FlatRouting.padded must be a bool, got {self.padded!r} ({type(self.padded).__name__})")
        if self.token_offsets is not None:
            _check_tensor("FlatRouting.token_offsets", self.token_offsets)


Routing = TopKRouting | FlatRouting


@dataclass(frozen=True)
class RoutingMetadata:
    """Int32 routing metadata shared by all backends (see the module docstring)."""

    expert_offsets: torch.Tensor  # [E+1]
    x_gather_idx: torch.Tensor  # [R]
    s_scatter_idx: torch.Tensor  # [R]
    s_reverse_scatter_idx: torch.Tensor  # [R]
    token_offsets: torch.Tensor  # [T+1]
    # K when every token has exactly K pairs (top-K routing: token_offsets[t] = K*t), so kernels may compute a
    # token's pair range instead of loading it; 0 when the counts vary (flat routing, expert parallelism).
    pairs_per_token: int = 0
    # M when every expert's row count is a multiple of M (token rounding to the tile M); 0: any counts
    rows_multiple: int = 0
    # The pairs a token with any has, for kernels that block over a token's pairs (0: the mean over all T tokens).
    # Where many "tokens" have none (expert parallelism's slotted receive rows) the mean over all would set another
    # blocking than the same pairs in a compact layout, and with it another summation order.
    pairs_per_token_hint: int = 0
    # the int32 arrays, in the order of ``tensors()``
    TENSOR_NAMES: ClassVar[tuple[str, ...]] = (
        "expert_offsets",
        "x_gather_idx",
        "s_scatter_idx",
        "s_reverse_scatter_idx",
        "token_offsets",
    )

    @property
    def num_experts(self) -> int:
        return self.expert_offsets.numel() - 1

    @property
    def num_rows(self) -> int:
        return self.x_gather_idx.numel()

    def tensors(self) -> tuple[torch.Tensor, ...]:
        # spelled out (not a loop over TENSOR_NAMES): called on every layer call
        return (
            self.expert_offsets,
            self.x_gather_idx,
            self.s_scatter_idx,
            self.s_reverse_scatter_idx,
            self.token_offsets,
        )


def run_offsets(sorted_R: torch.Tensor, n: int) -> torch.Tensor:
    """[n + 1] int64 offsets of the runs of the values 0..n-1 in the ascending ``sorted_R`` (CSR): value v's
    entries are ``sorted_R[off[v] : off[v + 1]]``, entries >= n lie past ``off[n]``. A binary search per value,
    no host sync."""
    return torch.searchsorted(sorted_R, torch.arange(n + 1, device=sorted_R.device, dtype=sorted_R.dtype))


def flatten_routing(routing: Routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_idx_R, expert_idx_R, scores_R, token_offsets) of a routing; scores keep autograd."""
    if isinstance(routing, TopKRouting):
        T, K = routing.indices_TK.shape
        device = routing.indices_TK.device
        token_idx_R = torch.arange(T, device=device, dtype=torch.int32).repeat_interleave(K)
        token_offsets = torch.arange(0, T * K + 1, K, device=device, dtype=torch.int32)
        return token_idx_R, routing.indices_TK.reshape(-1), routing.scores_TK.reshape(-1), token_offsets
    token_idx_R = routing.token_idx_R
    token_offsets = routing.token_offsets
    if token_offsets is None:
        token_offsets = run_offsets(token_idx_R, routing.num_tokens)
    return token_idx_R, routing.expert_idx_R, routing.scores_R, token_offsets.to(torch.int32)


def compute_metadata_torch(
    token_idx_R: torch.Tensor, expert_idx_R: torch.Tensor, token_offsets: torch.Tensor, num_experts: int
) -> RoutingMetadata:
    """Routing metadata with PyTorch ops only; no host sync (R and E are known from shapes)."""
    device = expert_idx_R.device
    R = expert_idx_R.numel()
    # index_add_ instead of bincount: bincount reads max() back to the host on CUDA.
    counts_E = torch.zeros(num_experts, device=device, dtype=torch.int32)
    counts_E.index_add_(0, expert_idx_R.long(), torch.ones(R, device=device, dtype=torch.int32))
    expert_offsets = torch.zeros(num_experts + 1, device=device, dtype=torch.int32)
    torch.cumsum(counts_E, 0, out=expert_offsets[1:])
    # Stable sort by expert: inside an expert, rows keep ascending pair (= token) order.
    s_scatter_idx = torch.sort(expert_idx_R.int(), stable=True).indices.to(torch.int32)
    x_gather_idx = token_idx_R.to(torch.int32)[s_scatter_idx.long()]
    s_reverse_scatter_idx = torch.empty(R, device=device, dtype=torch.int32)
    s_reverse_scatter_idx.scatter_(0, s_scatter_idx.long(), torch.arange(R, device=device, dtype=torch.int32))
    return RoutingMetadata(
        expert_offsets=expert_offsets,
        x_gather_idx=x_gather_idx,
        s_scatter_idx=s_scatter_idx,
        s_reverse_scatter_idx=s_reverse_scatter_idx,
        token_offsets=token_offsets.to(torch.int32),
    )
