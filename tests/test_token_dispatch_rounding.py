"""Tile-aware token rounding per local expert shard: invariants of the decision (single process), EP
rounding on P gloo ranks equal to single-process rounding of the concatenated tokens (ties included),
received counts per local expert multiples of the tile, and the rounded EP layer equal to the
single-process kernels on the concatenation (float64, all gradients, including the dense router
probabilities' gradient through added pairs)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from sonic_megatron.kernels import FlatRouting, TopKRouting, moe_experts
from sonic_megatron.token_dispatch import TokenRounding, expert_parallel_experts, make_plan, round_routing

E, K, D, F = 8, 2, 8, 4


def problem(T_r, seed, ties=False, skew=False):
    g = torch.Generator().manual_seed(seed)
    T = sum(T_r)
    logits = torch.randn(T, E, generator=g, dtype=torch.float64)
    if skew:  # most tokens prefer expert 0: its count far from the others
        logits[:, 0] += 3.0
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    w1 = torch.randn(E, 2 * F, D, generator=g, dtype=torch.float64) / D**0.5
    w2 = torch.randn(E, D, F, generator=g, dtype=torch.float64) / F**0.5
    grad = torch.randn(T, D, generator=g, dtype=torch.float64)
    return dict(T_r=T_r, logits=logits, x=x, w1=w1, w2=w2, grad=grad, ties=ties)


def probs_and_routing(logits, ties=False):
    """(dense probs [T, E], top-K routing) differentiable w.r.t. logits. ``ties`` quantises the probs to
    multiples of 1/8 (gradient passed straight through): many equal scores, so the tie-break decides."""
    probs = logits.softmax(-1)
    if ties:
        probs = probs + ((probs * 8).round() / 8 - probs).detach()
    return probs, TopKRouting(*probs.topk(K, dim=-1))


def quantised(p):
    return p["logits"]


def flat_pairs(routing):
    T = routing.indices_TK.shape[0]
    return torch.arange(T).repeat_interleave(K), routing.indices_TK.reshape(-1), routing.scores_TK.reshape(-1)


# ---------------------------------------------------------------------------------------------------------
# Single process: invariants
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["nearest", "up", "down"])
@pytest.mark.parametrize("tile", [4, 7, 64])
@pytest.mark.parametrize("shape", ["plain", "ties", "skew"])
def test_rounding_invariants(mode, tile, shape):
    p = problem([50], seed=tile, ties=shape == "ties", skew=shape == "skew")
    logits = quantised(p).requires_grad_()
    probs, routing = probs_and_routing(logits, shape == "ties")
    tok, exp, sc = flat_pairs(routing)
    r = round_routing(tok, exp, sc, probs, num_experts=E, rounding=TokenRounding(mode, tile))
    T = logits.shape[0]
    before = torch.zeros(T, E, dtype=torch.bool)
    before[tok, exp] = True
    after = torch.zeros(T, E, dtype=torch.bool)
    after[r.token_idx_R, r.expert_idx_R] = True
    assert int(after.sum()) == r.token_idx_R.numel(), "pairs must be unique"
    assert bool((r.token_idx_R[1:] >= r.token_idx_R[:-1]).all()), "rounded pairs sorted by token"
    f, t = before.sum(0), after.sum(0)
    assert torch.equal(f, r.counts_before_E) and torch.equal(t, r.counts_after_E)
    assert bool((t % tile == 0).all()), f"counts {t.tolist()} not multiples of {tile}"
    assert bool(((t - f).abs() < tile).all())
    # The target, computed independently: floor / ceil / nearest (ties to even), and floor where the
    # group has fewer tokens than the rounded-up count.
    for e in range(E):
        fe = int(f[e])
        lo, hi = fe // tile * tile, -(-fe // tile) * tile
        want = {"down": lo, "up": hi, "nearest": round(fe / tile) * tile}[mode]
        want = lo if want > T else want
        assert int(t[e]) == want, f"expert {e}: f={fe} -> {int(t[e])}, expected {want}"
    dense = probs.detach()
    routed_score = torch.full((T, E), float("nan"), dtype=torch.float64)
    routed_score[tok, exp] = sc.detach()
    for e in range(E):
        dropped, kept = before[:, e] & ~after[:, e], before[:, e] & after[:, e]
        added, left = after[:, e] & ~before[:, e], ~after[:, e] & ~before[:, e]
        if dropped.any() and kept.any():
            assert routed_score[dropped, e].max() <= routed_score[kept, e].min(), "drops must be the lowest"
        if added.any() and left.any():
            assert dense[added, e].min() >= dense[left, e].max(), "additions must be the highest"
    # Scores: kept pairs keep the routing score, added pairs take the dense probability (with autograd).
    was_routed = before[r.token_idx_R, r.expert_idx_R]
    expect = torch.where(was_routed, routed_score[r.token_idx_R, r.expert_idx_R], dense[r.token_idx_R, r.expert_idx_R])
    assert torch.equal(r.scores_R.detach(), expect)
    assert r.scores_R.requires_grad
    n_added = int((~was_routed).sum())
    assert int(r.added) == n_added and int(r.dropped) == int((before & ~after).sum())


def test_rounding_falls_back_down_when_tokens_run_out():
    """nearest/up cannot reach a multiple above the number of tokens: the expert rounds down instead."""
    p = problem([5], seed=1)
    probs, routing = probs_and_routing(p["logits"])
    r = round_routing(*flat_pairs(routing), probs, num_experts=E, rounding=TokenRounding("up", 8))
    assert bool((r.counts_after_E == 0).all())
    assert r.token_idx_R.numel() == 0


def test_token_rounding_rejects_bad_options():
    with pytest.raises(ValueError, match="mode"):
        TokenRounding("sideways")
    with pytest.raises(ValueError, match="tile"):
        TokenRounding("up", 0)


# ---------------------------------------------------------------------------------------------------------
# EP: P ranks == single process on the concatenation
# ---------------------------------------------------------------------------------------------------------

EP_CASES = {
    "plain_nearest_4": (dict(seed=3), TokenRounding("nearest", 4)),
    "ties_up_4": (dict(seed=4, ties=True), TokenRounding("up", 4)),
    "ties_down_8": (dict(seed=5, ties=True), TokenRounding("down", 8)),
    "skew_nearest_16": (dict(seed=6, skew=True), TokenRounding("nearest", 16)),
    "ties_nearest_128": (dict(seed=7, ties=True), TokenRounding()),
}


def _rounding_worker(rank, P):
    torch.use_deterministic_algorithms(True)
    out = {}
    for name, (kw, rounding) in EP_CASES.items():
        T_r = [9 + 7 * r for r in range(P)]
        T_r[-1] = 0 if name == "skew_nearest_16" else T_r[-1]  # a rank without tokens
        p = problem(T_r, **kw)
        off, T = sum(T_r[:rank]), T_r[rank]
        L = E // P
        logits = quantised(p)[off : off + T].clone().requires_grad_()
        probs, routing = probs_and_routing(logits, p["ties"])
        x = p["x"][off : off + T].clone().requires_grad_()
        w1 = p["w1"][rank * L : (rank + 1) * L].clone().requires_grad_()
        w2 = p["w2"][rank * L : (rank + 1) * L].clone().requires_grad_()
        o, plan = expert_parallel_experts(
            x,
            routing,
            w1,
            w2,
            group=dist.group.WORLD,
            num_experts=E,
            backend="torch",
            rounding=rounding,
            rounding_scores_TE=probs,
            num_chunks=2,
            return_plan=True,
        )
        o.backward(p["grad"][off : off + T])
        recv_counts = sum(torch.diff(m.expert_offsets.long()) for m in plan.recv_meta)
        # The plan of the step-wise form must reach the same decision.
        plan2 = make_plan(routing, num_experts=E, group=dist.group.WORLD, rounding=rounding, rounding_scores_TE=probs)
        out[name] = dict(
            pairs=(plan.token_idx_R + off, plan.expert_idx_R, plan.scores_R.detach()),
            same_as_stepwise=torch.equal(plan.token_idx_R, plan2.token_idx_R)
            and torch.equal(plan.expert_idx_R, plan2.expert_idx_R),
            recv_counts=recv_counts,
            grads=(o.detach(), x.grad, logits.grad, w1.grad, w2.grad),
        )
    return out


@pytest.fixture(scope="module", params=[2, 4])
def ep_rounding(request):
    return request.param, run_distributed(_rounding_worker, request.param, timeout=180)


@pytest.mark.parametrize("name", list(EP_CASES))
def test_ep_rounding_equals_single_process(ep_rounding, name):
    P, res = ep_rounding
    kw, rounding = EP_CASES[name]
    T_r = [9 + 7 * r for r in range(P)]
    T_r[-1] = 0 if name == "skew_nearest_16" else T_r[-1]
    p = problem(T_r, **kw)
    logits = quantised(p).clone().requires_grad_()
    probs, routing = probs_and_routing(logits, p["ties"])
    ref = round_routing(*flat_pairs(routing), probs, num_experts=E, rounding=rounding)
    tok = torch.cat([r[name]["pairs"][0] for r in res])
    exp = torch.cat([r[name]["pairs"][1] for r in res])
    sc = torch.cat([r[name]["pairs"][2] for r in res])
    assert torch.equal(tok, ref.token_idx_R) and torch.equal(exp, ref.expert_idx_R)
    assert torch.equal(sc, ref.scores_R.detach())
    assert all(r[name]["same_as_stepwise"] for r in res)
    # Every local expert's received count (over all sources) is a multiple of the tile.
    for rank, r in enumerate(res):
        counts = r[name]["recv_counts"]
        assert bool((counts % rounding.tile == 0).all()), f"rank {rank}: received {counts.tolist()}"
    # The rounded layer equals the single-process kernels on the rounded routing of the concatenation.
    x = p["x"].clone().requires_grad_()
    w1, w2 = p["w1"].clone().requires_grad_(), p["w2"].clone().requires_grad_()
    o = moe_experts(
        x, FlatRouting(ref.token_idx_R, ref.expert_idx_R, ref.scores_R, x.shape[0]), w1, w2, backend="torch"
    )
    o.backward(p["grad"])
    L = E // P
    for rank, r in enumerate(res):
        off, T = sum(T_r[:rank]), T_r[rank]
        want = (
            o.detach()[off : off + T],
            x.grad[off : off + T],
            logits.grad[off : off + T],
            w1.grad[rank * L : (rank + 1) * L],
            w2.grad[rank * L : (rank + 1) * L],
        )
        for n, a, b in zip(("out", "dx", "dlogits", "dw1", "dw2"), r[name]["grads"], want, strict=True):
            tol = 1e-12 * max(b.abs().max().item() if b.numel() else 0.0, 1.0)
            assert (a - b).abs().max().item() <= tol if b.numel() else a.numel() == 0, f"rank {rank} {n}"
