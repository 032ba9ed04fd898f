"""Token rounding under expert parallelism through its Triton kernels (token_dispatch/triton_round_ep.py) against
the PyTorch reference (``round_routing_padded`` over the same group), on CPU gloo ranks with the kernels under
TRITON_INTERPRET=1 standing in for CUDA: pairs, order, scores, the global counts, this rank's dropped and added
pairs, the duplicate flags and the gradients to the routing scores and dense probabilities bitwise equal -- with ties
across ranks (the cut falls inside runs of equal keys held by several ranks), each mode, a rank without tokens,
unequal token counts; and whole plans through the kernels equal to the reference plans, bad input raising the same
error on every rank."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interprets the kernels on CPU tensors")

from _dist import part, part_results, poison_uninitialized_memory, run_distributed  # noqa: E402

K = 3
# name: (experts, tile, mode, ties, skew, tokens of rank r)
CASES = {
    "nearest_ties": (8, 8, "nearest", True, False, lambda r: 11 + 6 * r),
    "up": (12, 8, "up", False, False, lambda r: 20 - 3 * r),
    "down_ties": (8, 16, "down", True, False, lambda r: 17 + r),
    "nearest_skew_empty_last_rank": (8, 16, "nearest", True, True, lambda r: 13 + 5 * r),
    "up_tile_above_tokens": (4, 64, "up", False, False, lambda r: 5 + r),
}


def _inputs(rank, E, ties, skew, T, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    logits = torch.randn(T, E, generator=g)
    if skew:
        logits[:, 0] += 3.0
    if ties:  # equal scores and dense probabilities on every rank: ties across ranks decide the cut
        logits = (logits * 2).round() / 2
    dense = logits.softmax(-1)
    idx = torch.topk(logits, K, dim=1).indices if T else torch.zeros(0, K, dtype=torch.int64)
    scores = torch.softmax(logits.gather(1, idx), -1).to(dtype)
    return scores.requires_grad_(), idx, dense.requires_grad_()


def _compare_rounding(rank, P):
    import torch.distributed as dist
    from sonic_megatron.kernels import TopKRouting
    from sonic_megatron.token_dispatch.rounding import TokenRounding, round_routing_padded
    from sonic_megatron.token_dispatch.send_side import flat_routing
    from sonic_megatron.token_dispatch.triton_round_ep import round_ep_triton

    out = {}
    for seed, (name, (E, tile, mode, ties, skew, tokens)) in enumerate(CASES.items()):
        T = tokens(rank)
        if name == "nearest_skew_empty_last_rank" and rank == P - 1:
            T = 0
        scores, idx, dense = _inputs(rank, E, ties, skew, T, seed)
        routing = TopKRouting(scores, idx)
        tok, exp, s = flat_routing(routing)
        group = dist.group.WORLD
        ref, dup_ref = round_routing_padded(
            tok, exp, s, dense, num_experts=E, rounding=TokenRounding(mode, tile), group=group
        )
        got, dup_got = round_ep_triton(routing, dense, num_experts=E, mode=mode, tile=tile, group=group)
        fields = ("token_idx_R", "expert_idx_R", "scores_R", "counts_before_E", "counts_after_E", "dropped", "added")
        diff = [f for f in fields if not torch.equal(getattr(ref, f).detach(), getattr(got, f).detach())]
        if torch.equal(dup_ref != 0, dup_got) is False:
            diff.append("duplicates")
        w = torch.randn(ref.scores_R.shape, generator=torch.Generator().manual_seed(rank))
        if not diff and T:
            g_ref = torch.autograd.grad((ref.scores_R * w).sum(), (scores, dense), allow_unused=True)
            g_got = torch.autograd.grad((got.scores_R * w).sum(), (scores, dense), allow_unused=True)
            diff += [n for n, a, b in zip(("dscores", "ddense"), g_ref, g_got, strict=True) if not torch.equal(a, b)]
        moved = int(ref.dropped) + int(ref.added)
        out[name] = (diff, moved, int((ref.counts_after_E % tile).sum()))
    return out


def _plans(rank, P):
    """Whole plans (start_plan + finish_plan) with rounding through the kernels and through the reference: equal
    plans, and bad input on one rank raising the same error on every rank with either path."""
    import torch.distributed as dist
    from sonic_megatron.kernels import TopKRouting
    from sonic_megatron.token_dispatch import EPInputError, TokenRounding, finish_plan, start_plan
    from sonic_megatron.token_dispatch import plan as plan_mod
    from sonic_megatron.token_dispatch.triton_round_ep import round_ep_triton

    E, T = 4 * P, 9 + 4 * rank
    scores, idx, dense = _inputs(rank, E, True, False, T, seed=7)
    out = {}
    for case in ("plain", "out_of_range", "duplicate"):
        i = idx.clone()
        if rank == 1 and case == "out_of_range":
            i[T // 2, 1] = E + 2
        if rank == 1 and case == "duplicate":
            i[T - 1, 1] = i[T - 1, 0]
        routing = TopKRouting(scores, i)
        plans = []
        for fast in (False, True):
            plan_mod.rounding_kernels = (lambda *a: round_ep_triton) if fast else (lambda *a: None)
            kw = dict(num_experts=E, group=dist.group.WORLD, rounding=TokenRounding("nearest", 4), num_chunks=2)
            try:
                plans.append(finish_plan(start_plan(routing, rounding_scores_TE=dense, **kw)))
            except EPInputError as exc:
                plans.append(str(exc))
        ref, got = plans
        if isinstance(ref, str) or isinstance(got, str):
            out[case] = ("error", ref, got)
            continue
        same = all(getattr(ref, f) == getattr(got, f) for f in ("send_rows", "send_pairs", "recv_rows", "recv_pairs"))
        tensors = ("token_idx_R", "expert_idx_R", "scores_R", "send_token_idx_S", "send_pair_idx", "combine_order_S")
        same = same and all(torch.equal(getattr(ref, f), getattr(got, f)) for f in tensors)
        same = same and torch.equal(ref.recv_scores(), got.recv_scores())
        out[case] = ("ok" if same else "differ", None, None)
    return out


def _layer_with_an_empty_rank(rank, P):
    """The step-wise rounded layer (forward and backward) with the last rank holding no tokens, the rounding
    through the kernels and through the reference, with exact split sizes and in slots without a forward sync:
    every path completes on every rank (the empty rank joins every backward collective) with the reference's
    output and gradients."""
    import torch.distributed as dist
    from sonic_megatron.kernels import TopKRouting
    from sonic_megatron.token_dispatch import (
        EPOptions,
        Slots,
        combine,
        combine_slots,
        dispatch,
        dispatch_before_sync,
        finish_plan,
        local_experts,
        local_experts_before_sync,
        start_plan,
    )
    from sonic_megatron.token_dispatch import plan as plan_mod
    from sonic_megatron.token_dispatch.rounding import TokenRounding
    from sonic_megatron.token_dispatch.triton_round_ep import round_ep_triton

    E, D, F, tile = 4 * P, 8, 4, 4
    T = 0 if rank == P - 1 else 10 + 3 * rank
    g = torch.Generator().manual_seed(11 + rank)
    x0 = torch.randn(T, D, generator=g)  # fp32 throughout: the kernels take scores of at most 32 bits
    w10 = torch.randn(E // P, 2 * F, D, generator=g)
    w20 = torch.randn(E // P, D, F, generator=g)
    grad = torch.randn(T, D, generator=g)
    opts = EPOptions(backend="torch", rounding=TokenRounding("nearest", tile))
    results, chooser = [], plan_mod.rounding_kernels
    for fast, slotted in ((False, False), (True, False), (True, True)):
        plan_mod.rounding_kernels = (lambda *a: round_ep_triton) if fast else (lambda *a: None)
        scores, idx, dense = _inputs(rank, E, False, False, T, seed=3)
        x, w1, w2 = (t.clone().requires_grad_() for t in (x0, w10, w20))
        kw = dict(num_experts=E, group=dist.group.WORLD, rounding_scores_TE=dense, x_TD=x, w1_EGD=w1, w2_EDF=w2)
        if slotted:
            slots = Slots.for_layer(10 + 3 * (P - 2), E // P, K, rounding_tile=tile)
            started = start_plan(TopKRouting(scores, idx), options=opts, slots=slots, **kw)
            xr, ss, early = dispatch_before_sync(x, started.scores_R, started)
            y = combine_slots(local_experts_before_sync(xr, ss, w1, w2, early, options=opts), early)
        else:
            plan = finish_plan(start_plan(TopKRouting(scores, idx), options=opts, **kw))
            xr, sr = dispatch(x, plan)
            y = combine(local_experts(xr, sr, w1, w2, plan, options=opts), plan)
        y.backward(grad)
        results.append([y.detach(), x.grad, scores.grad, dense.grad, w1.grad, w2.grad])
    plan_mod.rounding_kernels = chooser

    def same(a, b):  # bitwise; no gradient and an empty one are the same (a rank without tokens)
        if a is None or b is None:
            return (a if b is None else b) is None or (a if b is None else b).numel() == 0
        return torch.equal(a, b)

    names = ("y", "dx", "dscores", "ddense", "dw1", "dw2")
    return [[n for n, a, b in zip(names, got, results[0], strict=True) if not same(a, b)] for got in results[1:]]


def _worker(rank, P):
    poison_uninitialized_memory()  # an output element the kernels leave unwritten fails the comparison
    return {
        "rounding": part(_compare_rounding, rank, P),
        "plans": part(_plans, rank, P),
        "empty_rank_layer": part(_layer_with_an_empty_rank, rank, P),
    }


@pytest.fixture(scope="module", params=[2, 4])
def runs(request):
    P = request.param
    return P, run_distributed(_worker, P, timeout=600)


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_equal_the_reference_rounding(runs, name):
    P, results = runs
    moved = 0
    for rank, res in enumerate(part_results(results, "rounding")):
        diff, n, off_tile = res[name]
        assert not diff, f"rank {rank} of {P}: {diff} differ"
        assert off_tile == 0, "every global count is a multiple of the tile"
        moved += n
    assert moved > 0, "the case moves pairs (else it checks nothing)"


def test_plans_through_the_kernels_equal_the_reference_and_raise_together(runs):
    P, results = runs
    res = part_results(results, "plans")
    assert all(r["plain"][0] == "ok" for r in res), res
    for case in ("out_of_range", "duplicate"):
        messages = {(r[case][1], r[case][2]) for r in res}
        assert all(r[case][0] == "error" for r in res), (case, res)
        assert len(messages) == 1, (case, messages)  # every rank, either path: one message
        ref, got = messages.pop()
        assert ref == got, (case, ref, got)


def test_a_rank_without_tokens_joins_the_rounded_layer(runs):
    P, results = runs
    for rank, res in enumerate(part_results(results, "empty_rank_layer")):
        assert res == [[], []], f"rank {rank} of {P}: differ from the reference path (kernels, kernels in slots): {res}"


@pytest.mark.parametrize("name", list(CASES))
def test_one_process_equals_the_reference(name):
    """Without a group (P = 1) the kernels give the reference's rounding of this process's tokens."""
    from sonic_megatron.kernels import TopKRouting
    from sonic_megatron.token_dispatch.rounding import TokenRounding, round_routing_padded
    from sonic_megatron.token_dispatch.send_side import flat_routing
    from sonic_megatron.token_dispatch.triton_round_ep import round_ep_triton

    E, tile, mode, ties, skew, tokens = CASES[name]
    scores, idx, dense = _inputs(0, E, ties, skew, tokens(3), seed=5)
    routing = TopKRouting(scores, idx)
    ref, dup_ref = round_routing_padded(
        *flat_routing(routing), dense, num_experts=E, rounding=TokenRounding(mode, tile)
    )
    got, dup_got = round_ep_triton(routing, dense, num_experts=E, mode=mode, tile=tile, group=None)
    for f in ("token_idx_R", "expert_idx_R", "scores_R", "counts_before_E", "counts_after_E", "dropped", "added"):
        assert torch.equal(getattr(ref, f).detach(), getattr(got, f).detach()), f
    assert torch.equal(dup_ref != 0, dup_got)
