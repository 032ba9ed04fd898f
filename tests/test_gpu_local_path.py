"""GPU checks of the expert-parallel-size-1 path: token rounding on the device (``round_local``) equals the
reference on CUDA, and a padded FlatRouting gives the cute backend's outputs and gradients bit for bit as the
same routing without padding (the padding rows sort past every GEMM's rows and every token's sum)."""

from __future__ import annotations

import pytest
import torch
from sonic_megatron.kernels import FlatRouting, TopKRouting, moe_experts
from sonic_megatron.token_dispatch import TokenRounding, round_local, round_routing

pytestmark = pytest.mark.gpu


def _inputs(T, D, F, E, K, seed, skew=0.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(T, E, device="cuda", generator=g)
    logits -= skew * torch.arange(E, device="cuda") / E  # skew > 0: the last experts get few tokens
    dense = torch.softmax(logits, -1)
    top, idx = torch.topk(logits, K, dim=1)
    scores = torch.softmax(top, -1).requires_grad_()
    x = (torch.randn(T, D, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w1 = (torch.randn(E, 2 * F, D, device="cuda", generator=g) * D**-0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(E, D, F, device="cuda", generator=g) * F**-0.5).bfloat16().requires_grad_()
    return TopKRouting(scores, idx), dense, x, w1, w2


@pytest.mark.parametrize("skew", [0.0, 6.0])
@pytest.mark.parametrize("mode", ["nearest", "up", "down"])
def test_round_local_equals_reference_on_cuda(mode, skew):
    routing, dense, *_ = _inputs(4096, 64, 32, 64, 8, 0, skew)
    rounding = TokenRounding(mode, 128)
    got = round_local(routing, dense, num_experts=64, rounding=rounding)
    T, K = routing.indices_TK.shape
    tok = torch.arange(T, device="cuda").repeat_interleave(K)
    ref = round_routing(
        tok, routing.indices_TK.reshape(-1), routing.scores_TK.reshape(-1), dense, num_experts=64, rounding=rounding
    )
    R = ref.token_idx_R.numel()
    assert torch.equal(got.token_idx_R[:R], ref.token_idx_R) and torch.equal(got.expert_idx_R[:R], ref.expert_idx_R)
    assert torch.equal(got.scores_R[:R], ref.scores_R) and bool((got.expert_idx_R[R:] == 64).all())


def test_padded_routing_is_bitwise_the_unpadded_one_on_cute():
    routing, dense, x, w1, w2 = _inputs(4096, 512, 256, 32, 4, 1)
    padded = round_local(routing, dense, num_experts=32, rounding=TokenRounding("nearest", 128))
    R = int((padded.expert_idx_R < 32).sum())
    plain = FlatRouting(padded.token_idx_R[:R], padded.expert_idx_R[:R], padded.scores_R[:R], 4096)
    dO = torch.randn_like(x)
    results = []
    for r in (padded, plain):
        out = moe_experts(x, r, w1, w2, backend="cute")
        grads = torch.autograd.grad(out, (x, w1, w2, routing.scores_TK), dO, retain_graph=True)
        results.append((out, *grads))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    assert torch.isfinite(results[0][0]).all()


@pytest.mark.parametrize("mode", ["nearest", "up", "down"])
def test_ep_rounding_kernels_without_a_group_equal_the_reference_on_cuda(mode):
    """The expert-parallel rounding kernels compiled (the CPU tests interpret them), one process: the reference's
    pairs, order, scores and counts, with ties (quantised probabilities)."""
    from sonic_megatron.token_dispatch.rounding import round_routing_padded
    from sonic_megatron.token_dispatch.send_side import flat_routing
    from sonic_megatron.token_dispatch.triton_round_ep import round_ep_triton

    routing, dense, *_ = _inputs(4096, 64, 32, 64, 8, 2, skew=4.0)
    dense = (dense * 64).round() / 64
    rounding = TokenRounding(mode, 128)
    ref, dup_ref = round_routing_padded(*flat_routing(routing), dense, num_experts=64, rounding=rounding)
    got, dup_got = round_ep_triton(routing, dense, num_experts=64, mode=mode, tile=128, group=None)
    for f in ("token_idx_R", "expert_idx_R", "scores_R", "counts_before_E", "counts_after_E", "dropped", "added"):
        assert torch.equal(getattr(ref, f).detach(), getattr(got, f).detach()), f
    assert torch.equal(dup_ref != 0, dup_got)


def test_ep_rounding_kernels_on_a_rank_without_tokens_on_cuda():
    """A rank without tokens still runs the per-expert kernels (it joins the group's decision): no pairs out, no
    fault from empty buffers."""
    from sonic_megatron.token_dispatch.triton_round_ep import round_ep_triton

    idx = torch.zeros(0, 8, dtype=torch.int64, device="cuda")
    routing = TopKRouting(torch.zeros(0, 8, device="cuda"), idx)
    got, dup = round_ep_triton(
        routing, torch.zeros(0, 64, device="cuda"), num_experts=64, mode="nearest", tile=128, group=None
    )
    assert got.token_idx_R.numel() == 0 and not bool(dup.any())
    assert int(got.counts_before_E.sum()) == 0 and int(got.counts_after_E.sum()) == 0
