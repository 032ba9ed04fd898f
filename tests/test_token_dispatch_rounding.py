"""Tile-aware token rounding per local expert shard: invariants of the decision (single process), EP
rounding on P gloo ranks equal to single-process rounding of the concatenated tokens (ties included),
received counts per local expert multiples of the tile, and the rounded EP layer equal to the
single-process kernels on the concatenation (float64, all gradients, including the dense router
probabilities' gradient through added pairs)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import part, part_results, poison_uninitialized_memory, run_distributed_once
from sonic_megatron.kernels import FlatRouting, TopKRouting, moe_experts
from sonic_megatron.token_dispatch import (
    Slots,
    TokenRounding,
    combine_slots,
    dispatch_before_sync,
    expert_parallel_experts,
    local_experts_before_sync,
    make_plan,
    round_routing,
    start_plan,
)

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
    # The target, computed independently: floor / ceil / nearest (ties to even; never 0 for a routed expert),
    # and floor where the group has fewer tokens than the rounded-up count.
    for e in range(E):
        fe = int(f[e])
        lo, hi = fe // tile * tile, -(-fe // tile) * tile
        nearest = round(fe / tile) * tile or (tile if fe else 0)  # a routed expert keeps one tile
        want = {"down": lo, "up": hi, "nearest": nearest}[mode]
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
    poison_uninitialized_memory()
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
        grads = (o.detach(), x.grad, logits.grad, w1.grad, w2.grad)
        # The step-wise form in slots (sized for the pairs rounding adds), its forward without a host sync.
        x, logits, w1, w2 = (t.detach().clone().requires_grad_() for t in (x, logits, w1, w2))
        probs, routing = probs_and_routing(logits, p["ties"])
        slots = Slots.for_layer(max(T_r), L, K, rounding_tile=rounding.tile)
        started = start_plan(
            routing,
            num_experts=E,
            group=dist.group.WORLD,
            rounding=rounding,
            rounding_scores_TE=probs,
            x_TD=x,
            w1_EGD=w1,
            w2_EDF=w2,
            slots=slots,
        )
        xr, ss, early = dispatch_before_sync(x, started.scores_R, started)
        o = combine_slots(local_experts_before_sync(xr, ss, w1, w2, early, backend="torch"), early)
        o.backward(p["grad"][off : off + T])
        # The plan of the step-wise form must reach the same decision.
        plan2 = make_plan(routing, num_experts=E, group=dist.group.WORLD, rounding=rounding, rounding_scores_TE=probs)
        out[name] = dict(
            pairs=(plan.token_idx_R + off, plan.expert_idx_R, plan.scores_R.detach()),
            same_as_stepwise=torch.equal(plan.token_idx_R, plan2.token_idx_R)
            and torch.equal(plan.expert_idx_R, plan2.expert_idx_R),
            recv_counts=recv_counts,
            grads=grads,
            slot_grads=(o.detach(), x.grad, logits.grad, w1.grad, w2.grad),
            same_in_slots=torch.equal(early.plan.token_idx_R, plan2.token_idx_R),
        )
    return out


def _ep_worker(rank, P):
    """Every multi-rank part of this file at P ranks in one set of processes: the launch and sync counts first,
    the rounded EP layer, which turns on deterministic mode, last."""
    out = {}
    if P == 2:
        out["sync_count"] = part(_sync_count_worker, rank, P)
        out["split_plan"] = part(_split_plan_worker, rank, P)
        out["duplicates"] = {case: part(_duplicates_worker, rank, P, case) for case in DUPLICATE_CASES}
    out["rounding"] = part(_rounding_worker, rank, P)
    return out


def _ep_runs(P: int):
    return run_distributed_once(_ep_worker, P, timeout=600)


@pytest.fixture(scope="module", params=[2, 4])
def ep_rounding(request):
    return request.param, part_results(_ep_runs(request.param), "rounding")


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
        assert r[name]["same_in_slots"], f"rank {rank}: another rounding in slots"
        for form in ("grads", "slot_grads"):
            for n, a, b in zip(("out", "dx", "dlogits", "dw1", "dw2"), r[name][form], want, strict=True):
                tol = 1e-12 * max(b.abs().max().item() if b.numel() else 0.0, 1.0)
                assert (a - b).abs().max().item() <= tol if b.numel() else a.numel() == 0, f"rank {rank} {form} {n}"


# ---------------------------------------------------------------------------------------------------------
# EP: rounding costs no host sync of its own
# ---------------------------------------------------------------------------------------------------------


def _rank_probs_and_routing(rank, P, seed):
    """This rank's share (9 + 7 * rank tokens) of one problem of P ranks: (dense probs, top-K routing)."""
    p = problem([9 + 7 * r for r in range(P)], seed=seed)
    T_r = p["T_r"]
    off, T = sum(T_r[:rank]), T_r[rank]
    return probs_and_routing(p["logits"][off : off + T])


def _sync_count_worker(rank, P):
    from sonic_megatron.token_dispatch.launch_count import LaunchCounter

    probs, routing = _rank_probs_and_routing(rank, P, seed=3)
    out = {}
    for name, rounding in (("plain", None), ("rounded", TokenRounding("nearest", 4))):
        kw = dict(num_experts=E, group=dist.group.WORLD, rounding=rounding, rounding_scores_TE=probs, num_chunks=2)
        make_plan(routing, **kw)  # warm-up
        with LaunchCounter() as lc:
            plan = make_plan(routing, **kw)
        out[name] = (lc.summary(), [k for k, _, _ in lc.events if k != "launch"], plan.rounding is not None)
    return out


def test_ep_rounding_plan_has_the_one_host_sync_of_a_plan_without_rounding():
    """At EP = 2 the rounded plan syncs once, as the plan without rounding (it used to sync 4 times: header,
    duplicate flags, ``nonzero`` for the rounded pair count, the counts exchange again): its candidate
    all-gather travels before the header + counts all-gather, device to device."""
    for res in part_results(_ep_runs(2), "sync_count"):
        (plain, plain_kinds, _), (rounded, kinds, applied) = res["plain"], res["rounded"]
        assert applied
        assert plain["syncs"] == 1 and rounded["syncs"] == plain["syncs"], (plain, rounded)
        # candidates, header + counts, the sync, then the N = 2 pair all-to-alls (as without rounding)
        assert kinds == ["collective", *plain_kinds], (kinds, plain_kinds)
        assert plain_kinds == ["collective", "sync", "collective", "collective"], plain_kinds


def _split_plan_worker(rank, P):
    from sonic_megatron.token_dispatch import finish_plan, start_plan
    from sonic_megatron.token_dispatch.launch_count import LaunchCounter

    probs, routing = _rank_probs_and_routing(rank, P, seed=4)
    out = {}
    for name, rounding in (("plain", None), ("rounded", TokenRounding("nearest", 4))):
        kw = dict(num_experts=E, group=dist.group.WORLD, rounding=rounding, rounding_scores_TE=probs)
        whole = make_plan(routing, **kw)
        with LaunchCounter() as started_lc:
            started = start_plan(routing, **kw)
        side_work = torch.ones(3)
        dist.all_reduce(side_work)  # another collective between the two halves, as a schedule may queue
        with LaunchCounter() as finished_lc:
            split = finish_plan(started)
        fields = ("send_rows", "send_pairs", "recv_rows", "recv_pairs")
        tensors = ("token_idx_R", "expert_idx_R", "scores_R", "send_token_idx_S", "send_pair_idx", "combine_order_S")
        out[name] = dict(
            started=started_lc.summary(),
            finished=finished_lc.summary(),
            same_sizes=all(getattr(whole, f) == getattr(split, f) for f in fields),
            same_tensors=all(torch.equal(getattr(whole, f), getattr(split, f)) for f in tensors),
            same_recv=torch.equal(whole.recv_scores(), split.recv_scores())
            and all(
                torch.equal(a, b)
                for m, n in zip(whole.recv_meta, split.recv_meta, strict=True)
                for a, b in zip(m.tensors(), n.tensors(), strict=True)
            ),
            padded=started.scores_R.shape[0] >= split.scores_R.shape[0],
        )
    return out


def test_split_plan_waits_only_in_finish_and_equals_make_plan():
    """``start_plan`` launches the plan's collectives without a host sync; ``finish_plan`` holds the plan's one
    sync; work queued between the two does not change the plan (with and without rounding, whose padded scores
    ``finish_plan`` cuts to the real pairs)."""
    for rank, res in enumerate(part_results(_ep_runs(2), "split_plan")):
        for name, r in res.items():
            assert r["started"]["syncs"] == 0 and r["started"]["collectives"] >= 1, (rank, name, r)
            assert r["finished"]["syncs"] == 1, (rank, name, r)
            assert r["same_sizes"] and r["same_tensors"] and r["same_recv"] and r["padded"], (rank, name, r)


DUPLICATE_CASES = ("alone", "and_bad_index")


def _duplicates_worker(rank, P, case):
    from sonic_megatron.token_dispatch import EPInputError
    from sonic_megatron.token_dispatch.launch_count import LaunchCounter

    T = 6
    probs = torch.randn(T, E, generator=torch.Generator().manual_seed(rank), dtype=torch.float64).softmax(-1)
    tok, exp = torch.tensor([0, 1, 2]), torch.tensor([2, 3, 4])
    if rank == 1:  # (0, 2) twice
        tok, exp = torch.tensor([0, 0, 1]), torch.tensor([2, 2, 3])
    if case == "and_bad_index" and rank == 0:  # E is clamped to E - 1 before rounding: reported, not a duplicate
        tok, exp = torch.tensor([0, 1, 1]), torch.tensor([2, E - 1, E])
    routing = FlatRouting(tok, exp, torch.rand(3, dtype=torch.float64), T)
    kw = dict(num_experts=E, group=dist.group.WORLD, rounding=TokenRounding("up", 4), rounding_scores_TE=probs)
    msg = None
    with LaunchCounter() as lc:
        try:
            make_plan(routing, **kw)
        except EPInputError as exc:
            msg = str(exc)
    # The group is still in step: a valid plan afterwards works on every rank.
    plan = make_plan(TopKRouting(*probs.topk(K, dim=-1)), **kw)
    return msg, lc.summary()["syncs"], bool(plan.recv_scores().isfinite().all())


@pytest.mark.parametrize("case", DUPLICATE_CASES)
def test_ep_rounding_duplicate_pairs_raise_on_every_rank_in_the_one_sync(case):
    """Duplicate (token, expert) pairs on rank 1 raise EPInputError on every rank naming rank 1, from the plan's
    header check (no sync of their own); rank 0's out-of-range index is reported as such, not as a duplicate."""
    for rank, (msg, syncs, ok) in enumerate(part_results(_ep_runs(2), "duplicates", case)):
        assert msg is not None, f"rank {rank} did not raise"
        assert "rank(s) [1] must be unique" in msg, (rank, msg)
        assert ("rank 0: routing expert indices" in msg) == (case == "and_bad_index"), (rank, msg)
        assert syncs == 1, (rank, syncs)
        assert ok


def test_single_process_duplicate_pairs_raise():
    from sonic_megatron.token_dispatch import EPInputError

    probs = torch.rand(3, E, dtype=torch.float64)
    tok, exp, sc = torch.tensor([0, 0, 1]), torch.tensor([2, 2, 3]), torch.rand(3, dtype=torch.float64)
    with pytest.raises(EPInputError, match=r"rank\(s\) \[0\] must be unique"):
        round_routing(tok, exp, sc, probs, num_experts=E, rounding=TokenRounding("up", 4))
    with pytest.raises(EPInputError, match=r"rank\(s\) \[0\] must be unique"):
        make_plan(
            FlatRouting(tok, exp, sc, 3), num_experts=E, rounding=TokenRounding("up", 4), rounding_scores_TE=probs
        )


@pytest.mark.parametrize("N", [1, 3])
def test_padded_send_side_equals_the_unpadded_one(N):
    """Padding pairs (token T, expert E) after the real pairs go nowhere: the send side of the real pairs is
    bitwise that of the unpadded pairs, and no count includes the padding."""
    from sonic_megatron.token_dispatch.send_side import send_side_torch

    T, P = 11, 4
    g = torch.Generator().manual_seed(N)
    routed_TE = torch.rand(T, E, generator=g) < 0.3
    tok, exp = routed_TE.nonzero(as_tuple=True)
    sc = torch.rand(tok.numel(), generator=g)
    R, pad = tok.numel(), 5
    padded = [
        torch.cat([tok, torch.full((pad,), T)]),
        torch.cat([exp, torch.full((pad,), E)]),
        torch.cat([sc, torch.zeros(pad)]),
    ]
    want = send_side_torch(tok, exp, sc, T, E // P, P, N)
    got = send_side_torch(*padded, T, E // P, P, N, padded=True)
    S = int(want.rows_NP.sum())
    assert torch.equal(got.rows_NP, want.rows_NP) and torch.equal(got.pairs_NP, want.pairs_NP)
    assert torch.equal(got.order[:R], want.order) and torch.equal(got.pair_meta_RC[:R], want.pair_meta_RC)
    assert torch.equal(got.send_token_idx_R[:S], want.send_token_idx_R[:S])
    assert torch.equal(got.combine_order_R[:S], want.combine_order_R[:S])
    assert torch.equal(got.combine_offsets, want.combine_offsets)


def test_padded_rounding_is_the_reference_then_padding():
    """``round_routing_padded``: the reference's pairs first, then padding (T, E, 0), ``rounded_pairs_bound`` long."""
    from sonic_megatron.token_dispatch.rounding import round_routing_padded, rounded_pairs_bound

    p = problem([40], seed=2, ties=True)
    probs, routing = probs_and_routing(p["logits"], ties=True)
    rounding = TokenRounding("nearest", 8)
    ref = round_routing(*flat_pairs(routing), probs, num_experts=E, rounding=rounding)
    got, dup_P = round_routing_padded(*flat_pairs(routing), probs, num_experts=E, rounding=rounding)
    n, T = ref.token_idx_R.numel(), 40
    assert got.token_idx_R.numel() == rounded_pairs_bound(40 * K, T, E, 8) and not bool(dup_P.any())
    assert torch.equal(got.token_idx_R[:n], ref.token_idx_R) and torch.equal(got.expert_idx_R[:n], ref.expert_idx_R)
    assert torch.equal(got.scores_R[:n], ref.scores_R)
    assert bool(
        (got.token_idx_R[n:] == T).all() and (got.expert_idx_R[n:] == E).all() and (got.scores_R[n:] == 0).all()
    )
