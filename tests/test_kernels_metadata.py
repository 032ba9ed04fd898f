"""Invariants of RoutingMetadata (kernels/routing.py) on random routings, and the GPU no-host-sync check.

expert_offsets        exclusive cumsum of per-expert counts; [0] = 0, [E] = R
s_scatter_idx         a permutation of the pairs, sorted by expert, stable (ascending pair index)
s_reverse_scatter_idx its inverse
x_gather_idx          the token of each expert-sorted row
token_offsets         CSR offsets of each token's pairs
"""

from __future__ import annotations

import pytest
import torch
from sonic_megatron.kernels import FlatRouting, RoutingMetadata, TopKRouting, compute_metadata
from test_kernels_helpers import (
    flat_problem,
    mask_from_counts,
    mask_variable,
    poison_uninitialized,  # noqa: F401  (fixture)
    topk_problem,
)

pytestmark = pytest.mark.usefixtures("poison_uninitialized")

PROBLEMS = {
    "topk": lambda: topk_problem(50, 4, 2, 7, 3, seed=61),
    "topk_int32": lambda: topk_problem(50, 4, 2, 7, 2, seed=62, index_dtype=torch.int32),
    "topk_empty_experts": lambda: topk_problem(30, 4, 2, 9, 2, seed=63, experts=[0, 4, 8]),
    "topk_one_expert": lambda: topk_problem(30, 4, 2, 5, 1, seed=64, experts=[2]),
    "topk_T0": lambda: topk_problem(0, 4, 2, 5, 2, seed=65),
    "E1": lambda: topk_problem(10, 4, 2, 1, 1, seed=66),
    "flat_variable": lambda: flat_problem(mask_variable(60, 6, seed=67), 4, 2, seed=67),
    "flat_off_tile": lambda: flat_problem(mask_from_counts(300, [129, 0, 1, 255, 64]), 4, 2, seed=68),
    "flat_no_pairs": lambda: flat_problem(torch.zeros(7, 3, dtype=torch.bool), 4, 2, seed=69),
    "flat_T0": lambda: flat_problem(torch.zeros(0, 3, dtype=torch.bool), 4, 2, seed=70),
}


def _pairs(p) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, expert) of every flat pair, as int64."""
    if p.indices_TK is not None:
        T, K = p.indices_TK.shape
        return torch.arange(T).repeat_interleave(K), p.indices_TK.reshape(-1).long()
    return p.token_idx_R.long(), p.expert_idx_R.long()


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_metadata_invariants(name):
    p = PROBLEMS[name]()
    E, T = p.num_experts, p.num_tokens
    token_R, expert_R = _pairs(p)
    R = expert_R.numel()
    scores_R, meta = compute_metadata(p.routing(p.scores), E)

    assert isinstance(meta, RoutingMetadata) and meta.num_experts == E and meta.num_rows == R
    shapes = {"expert_offsets": (E + 1,), "x_gather_idx": (R,), "s_scatter_idx": (R,)}
    shapes |= {"s_reverse_scatter_idx": (R,), "token_offsets": (T + 1,)}
    for field, shape in shapes.items():
        t = getattr(meta, field)
        assert t.dtype == torch.int32 and tuple(t.shape) == shape, (field, t.dtype, t.shape)

    off = meta.expert_offsets.long()
    counts = torch.bincount(expert_R, minlength=E)
    assert off[0] == 0 and torch.equal(torch.diff(off), counts) and off[-1] == R

    perm = meta.s_scatter_idx.long()
    assert torch.equal(perm.sort().values, torch.arange(R)), "s_scatter_idx is not a permutation"
    rev = meta.s_reverse_scatter_idx.long()
    assert torch.equal(rev[perm], torch.arange(R)) and torch.equal(perm[rev], torch.arange(R))

    for e in range(E):
        rows = perm[off[e] : off[e + 1]]
        assert (expert_R[rows] == e).all(), f"row block of expert {e} holds other experts' pairs"
        assert (torch.diff(rows) > 0).all(), f"rows of expert {e} are not in ascending pair order"
    assert torch.equal(meta.x_gather_idx.long(), token_R[perm])

    tok_off = meta.token_offsets.long()
    assert tok_off[0] == 0 and tok_off[-1] == R
    assert torch.equal(torch.diff(tok_off), torch.bincount(token_R, minlength=T))
    assert torch.equal(scores_R.detach(), p.scores.reshape(-1))


def test_topk_metadata_closed_forms():
    """Top-K: pair j = t*K + k, so the token of row r is s_scatter_idx[r] // K and token_offsets = K*t."""
    p = PROBLEMS["topk"]()
    K = p.indices_TK.shape[1]
    _, meta = compute_metadata(p.routing(p.scores), p.num_experts)
    assert torch.equal(meta.x_gather_idx, meta.s_scatter_idx // K)
    assert torch.equal(meta.token_offsets, torch.arange(0, p.num_tokens * K + 1, K, dtype=torch.int32))


def test_topk_and_equivalent_flat_routing_agree():
    p = PROBLEMS["topk"]()
    token_R, expert_R = _pairs(p)
    _, meta_topk = compute_metadata(p.routing(p.scores), p.num_experts)
    flat = FlatRouting(token_R, expert_R, p.scores.reshape(-1), p.num_tokens)
    _, meta_flat = compute_metadata(flat, p.num_experts)
    for a, b in zip(meta_topk.tensors(), meta_flat.tensors(), strict=True):
        assert torch.equal(a, b)


def test_index_dtype_does_not_change_metadata():
    p = PROBLEMS["flat_variable"]()
    r64 = FlatRouting(p.token_idx_R.long(), p.expert_idx_R.long(), p.scores, p.num_tokens)
    r32 = FlatRouting(p.token_idx_R.int(), p.expert_idx_R.int(), p.scores, p.num_tokens)
    meta64, meta32 = (compute_metadata(r, p.num_experts)[1] for r in (r64, r32))
    for a, b in zip(meta64.tensors(), meta32.tensors(), strict=True):
        assert torch.equal(a, b)


def test_scores_keep_autograd():
    p = PROBLEMS["topk"]()
    s = p.scores.clone().requires_grad_()
    scores_R, _ = compute_metadata(TopKRouting(s, p.indices_TK), p.num_experts)
    w = torch.rand(scores_R.shape, dtype=scores_R.dtype)
    (scores_R * w).sum().backward()
    assert torch.equal(s.grad.reshape(-1), w)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["topk", "flat"])
def test_metadata_does_not_sync_on_gpu(kind):
    """The torch metadata path must not read anything back to the host (training stays sync-free)."""
    p = PROBLEMS["topk" if kind == "topk" else "flat_variable"]()
    _, expected = compute_metadata(p.routing(p.scores), p.num_experts)
    dev = torch.device("cuda")
    if kind == "topk":
        routing = TopKRouting(p.scores.float().to(dev), p.indices_TK.to(dev))
    else:
        routing = FlatRouting(p.token_idx_R.to(dev), p.expert_idx_R.to(dev), p.scores.float().to(dev), p.num_tokens)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):  # the mode is live: a host read fails
            torch.ones(1, device=dev).item()
        _, meta = compute_metadata(routing, p.num_experts)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(meta.tensors(), expected.tensors(), strict=True):
        assert a.is_cuda and torch.equal(a.cpu(), b)
