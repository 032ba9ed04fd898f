"""Token rounding without expert parallelism on the device (``round_local``): the same pairs, order and scores
as the single-process reference ``round_routing(group=None)``, with no host sync, as a padded FlatRouting that
every backend skips the padding of."""

from __future__ import annotations

import pytest
import torch
from sonic_megatron.kernels import FlatRouting, TopKRouting, moe_experts
from sonic_megatron.token_dispatch import TokenRounding, round_local, round_routing
from sonic_megatron.token_dispatch.rounding import rounded_pairs_bound


def _routing(T, E, K, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    if seed % 2:  # ties between scores and between dense probs
        logits = (logits * 2).round() / 2
    dense = torch.softmax(logits, -1).to(dtype).requires_grad_()
    idx = torch.topk(logits, K, dim=1).indices
    scores = torch.softmax(logits.gather(1, idx), -1).to(dtype).requires_grad_()
    return TopKRouting(scores, idx), dense


@pytest.mark.parametrize("mode", ["nearest", "up", "down"])
@pytest.mark.parametrize("T,E,K,M,seed", [(96, 8, 2, 16, 0), (200, 16, 4, 32, 1), (40, 4, 1, 64, 2), (7, 3, 2, 4, 3)])
def test_round_local_equals_reference(mode, T, E, K, M, seed):
    routing, dense = _routing(T, E, K, seed)
    rounding = TokenRounding(mode, M)
    got = round_local(routing, dense, num_experts=E, rounding=rounding)
    tok = torch.arange(T).repeat_interleave(K)
    ref = round_routing(
        tok, routing.indices_TK.reshape(-1), routing.scores_TK.reshape(-1), dense, num_experts=E, rounding=rounding
    )
    R = ref.token_idx_R.numel()
    assert got.padded and got.token_idx_R.numel() == rounded_pairs_bound(T * K, T, E, M)
    assert torch.equal(got.token_idx_R[:R], ref.token_idx_R) and torch.equal(got.expert_idx_R[:R], ref.expert_idx_R)
    assert torch.equal(got.scores_R[:R], ref.scores_R)
    assert (got.token_idx_R[R:] == T).all() and (got.expert_idx_R[R:] == E).all() and (got.scores_R[R:] == 0).all()
    counts = torch.bincount(ref.expert_idx_R, minlength=E)
    assert ((counts % M == 0) | (counts == torch.bincount(routing.indices_TK.reshape(-1), minlength=E))).all()
    # Gradients reach the same inputs with the same values.
    w = torch.randn(R)
    g_got = torch.autograd.grad((got.scores_R[:R] * w).sum(), (routing.scores_TK, dense))
    g_ref = torch.autograd.grad((ref.scores_R * w).sum(), (routing.scores_TK, dense))
    for a, b in zip(g_got, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_padded_flat_routing_equals_the_unpadded_one_in_the_experts():
    torch.manual_seed(0)
    T, D, F, E, K = 50, 16, 8, 6, 2
    routing, dense = _routing(T, E, K, 5, dtype=torch.float64)
    scores = routing.scores_TK.detach().float().requires_grad_()
    padded = round_local(
        TopKRouting(scores, routing.indices_TK), dense.float(), num_experts=E, rounding=TokenRounding("up", 8)
    )
    R = int((padded.expert_idx_R < E).sum())
    plain = FlatRouting(padded.token_idx_R[:R], padded.expert_idx_R[:R], padded.scores_R[:R], T)
    x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(E, 2 * F, D, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(E, D, F, dtype=torch.float64, requires_grad=True)
    outs = []
    for r in (padded, plain):
        r = FlatRouting(r.token_idx_R, r.expert_idx_R, r.scores_R.double(), T, padded=r.padded)
        o = moe_experts(x, r, w1, w2, backend="torch")
        dO = torch.randn_like(o, generator=torch.Generator().manual_seed(1))
        outs.append((o, *torch.autograd.grad(o, (x, w1, w2, scores), dO, retain_graph=True)))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b)


def test_padding_indices_are_rejected_without_the_padded_flag():
    T, D, F, E = 4, 8, 4, 2
    r = FlatRouting(torch.tensor([0, 1, T]), torch.tensor([0, 1, E]), torch.ones(3), T)
    x, w1, w2 = torch.randn(T, D), torch.randn(E, 2 * F, D), torch.randn(E, D, F)
    with pytest.raises(ValueError, match="routing expert indices"):
        moe_experts(x, r, w1, w2, backend="torch")
    out = moe_experts(
        x, FlatRouting(r.token_idx_R, r.expert_idx_R, r.scores_R, T, padded=True), w1, w2, backend="torch"
    )
    assert out.shape == (T, D) and torch.isfinite(out).all()
