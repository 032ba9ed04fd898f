"""Expert-parallel dispatch/combine on 2 and 4 gloo ranks vs the single-process kernels on the
concatenated tokens (float64 tight; bf16 against PyTorch's own bf16 error), options, determinism and
byte accounting. Every rank builds the same global inputs from a seed, runs its slice under EP and
compares its slice of the output and of every gradient with the single-process result.

Uninitialised buffers are poisoned with NaN (``torch.utils.deterministic.fill_uninitialized_memory``), so
an all-to-all or kernel that leaves rows unwritten fails the comparison.
"""

from __future__ import annotations

import contextlib
import os
import zlib

import pytest
import torch
import torch.distributed as dist
from _dist import part, part_results, poison_uninitialized_memory, run_distributed_once
from sonic_megatron.kernels import FlatRouting, RoutingMetadata, TopKRouting, moe_experts, moe_experts_reference
from sonic_megatron.token_dispatch import (
    DeferredWeightGrad,
    EPInputError,
    Slots,
    combine,
    combine_slots,
    dispatch,
    dispatch_before_sync,
    expert_parallel_experts,
    local_experts,
    local_experts_before_sync,
    make_plan,
    start_plan,
)
from test_kernels_helpers import within_torch_error

# The Triton gather-sum of combine (its GPU path) runs interpreted on CPU; the flag is read when the
# kernels are decorated, i.e. at the (lazy) import of sonic_megatron.kernels.triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D, F, K = 16, 8, 3


def _poison() -> None:
    poison_uninitialized_memory()


def global_case(kind: str, P: int, seed: int = 0, dtype=torch.float64, E: int = 8):
    """Global inputs (identical on every rank): per-rank token counts, x, logits, weights, routing builder."""
    g = torch.Generator().manual_seed(seed)
    T_r = [13 + 5 * r for r in range(P)]
    if kind == "empty_rank":
        T_r[1] = 0
    T = sum(T_r)
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    logits = torch.randn(T, E, generator=g, dtype=torch.float64)
    if kind == "empty_rank":  # no token picks the last rank's experts: that rank receives nothing
        logits[:, E - E // P :] = -30.0
    w1 = torch.randn(E, 2 * F, D, generator=g, dtype=torch.float64) / D**0.5
    w2 = torch.randn(E, D, F, generator=g, dtype=torch.float64) / F**0.5
    grad = torch.randn(T, D, generator=g, dtype=torch.float64)
    flat_mask = None
    if kind == "flat":  # 0..4 experts per token, some tokens with none
        n = torch.randint(0, 5, (T,), generator=g)
        order = torch.rand(T, E, generator=g).argsort(1)
        flat_mask = torch.zeros(T, E, dtype=torch.bool)
        for t in range(T):
            flat_mask[t, order[t, : n[t]]] = True
    return dict(T_r=T_r, x=x, logits=logits, w1=w1, w2=w2, grad=grad, kind=kind, E=E, flat_mask=flat_mask, dtype=dtype)


def build_routing(case, logits_TE: torch.Tensor, token_offset: int, T: int):
    """Routing of tokens [token_offset, token_offset + T) with scores differentiable w.r.t. logits_TE
    (the rows of those tokens)."""
    kind, E = case["kind"], case["E"]
    probs = logits_TE.float().softmax(-1) if case["dtype"] != torch.float64 else logits_TE.softmax(-1)
    if kind == "flat":
        mask = case["flat_mask"][token_offset : token_offset + T]
        tok, exp = mask.nonzero(as_tuple=True)
        return FlatRouting(tok, exp, probs[tok, exp], T)
    if kind == "skewed":  # every token to experts 0 and 1 (both on rank 0)
        idx = torch.tensor([0, 1]).expand(T, 2).contiguous()
    elif kind == "one_expert":  # every token to the last expert only
        idx = torch.full((T, 1), E - 1, dtype=torch.int64)
    else:
        idx = probs.detach().topk(K, dim=-1).indices
    return TopKRouting(probs.gather(1, idx), idx)


def _leaves(case, rank, P, dtype):
    L = case["E"] // P
    off = sum(case["T_r"][:rank])
    T = case["T_r"][rank]
    x = case["x"][off : off + T].detach().to(dtype).clone().requires_grad_()
    logits = case["logits"][off : off + T].detach().clone().requires_grad_()
    w1 = case["w1"][rank * L : (rank + 1) * L].detach().to(dtype).clone().requires_grad_()
    w2 = case["w2"][rank * L : (rank + 1) * L].detach().to(dtype).clone().requires_grad_()
    return off, T, x, logits, w1, w2


def run_ep(case, rank, P, *, dtype, mode="fused", group=None, **opts):
    """(out, dx, dlogits, dw1, dw2) of this rank's slice under EP."""
    group = dist.group.WORLD if group is None else group
    off, T, x, logits, w1, w2 = _leaves(case, rank, P, dtype)
    routing = build_routing(case, logits, off, T)
    wgrad = DeferredWeightGrad() if opts.pop("deferred", False) else None
    where = {"wgrad": wgrad, "weight_grad_hook": _hook(opts.pop("hook", None), kept := [])}
    if mode == "fused":
        out = expert_parallel_experts(
            x, routing, w1, w2, group=group, num_experts=case["E"], backend="torch", **where, **opts
        )
    elif mode in ("slots", "sync_free"):  # rows and pairs in slots of the largest T + slot_extra rows, before the sync
        before_sync = mode == "sync_free"
        top_k = routing.indices_TK.shape[1] if isinstance(routing, TopKRouting) else None
        slots = Slots.for_layer(max(case["T_r"]) + opts.pop("slot_extra"), case["E"] // P, top_k)
        started = start_plan(
            routing, num_experts=case["E"], group=group, x_TD=x, w1_EGD=w1, w2_EDF=w2, slots=slots, **opts
        )
        xr, ss, early = dispatch_before_sync(x, started.scores_R, started)
        assert (xr.shape[0], ss.shape[0]) == (P * slots.rows, P * slots.pairs)
        if before_sync:  # no host sync in the forward: the experts over the bound of the pairs, the combine in slots
            y = local_experts_before_sync(xr, ss, w1, w2, early, backend="torch", wgrad=wgrad)
            assert early.plan is None
            out = combine_slots(y, early)
        else:
            plan = early.finish()  # the host sync, after the rows and pairs left
            y = local_experts(xr, plan.pairs_from_slots(ss), w1, w2, plan, backend="torch", wgrad=wgrad)
            out = combine(y, plan)
    else:
        plan = make_plan(routing, num_experts=case["E"], group=group, x_TD=x, **opts)
        xr, sr = dispatch(x, plan)
        out = combine(local_experts(xr, sr, w1, w2, plan, backend="torch", **where), plan)
    out.backward(case["grad"][off : off + T].to(dtype))
    if mode in ("slots", "sync_free"):
        plan = early.plan  # made in backward without a sync
        assert (plan.max_tokens, plan.row_slots, plan.pair_slots) == (max(case["T_r"]), slots.rows, slots.pairs)
    if wgrad is not None:
        assert w1.grad is None and wgrad.num_pending > 0
        wgrad.compute()
    if kept:  # the kept works store into fp32 buffers, as Megatron's main_grad
        assert w1.grad is None and len(kept) == 1
        ct = torch.promote_types(dtype, torch.float32)
        acc = (torch.full(w1.shape, float("nan"), dtype=ct), torch.full(w2.shape, float("nan"), dtype=ct))
        kept[0](out=acc, accumulate=False)
        w1.grad, w2.grad = acc[0].to(dtype), acc[1].to(dtype)
    return [t.detach() for t in (out, x.grad, logits.grad, w1.grad, w2.grad)]


def _hook(when: str | None, kept: list):
    """An ``EPOptions.weight_grad_hook``: None; "now" runs the work and hands its gradients to autograd; "kept"
    appends it to ``kept`` (run after backward) and hands autograd nothing."""
    if when == "now":
        return lambda work: work()
    if when == "kept":
        return lambda work: (kept.append(work), (None, None))[1]
    assert when is None, when
    return None


def run_reference(case, rank, P, dtype, impl):
    """The same slice from the single-process computation on ALL tokens (``impl``: kernels or reference)."""
    T_all = sum(case["T_r"])
    x = case["x"].detach().to(dtype).clone().requires_grad_()
    logits = case["logits"].detach().clone().requires_grad_()
    w1 = case["w1"].detach().to(dtype).clone().requires_grad_()
    w2 = case["w2"].detach().to(dtype).clone().requires_grad_()
    routing = build_routing(case, logits, 0, T_all)
    if impl == "kernels":
        out = moe_experts(x, routing, w1, w2, backend="torch")
    else:
        out = moe_experts_reference(x, routing, w1, w2)
    out.backward(case["grad"].to(dtype))
    L = case["E"] // P
    off, T = sum(case["T_r"][:rank]), case["T_r"][rank]
    sl, el = slice(off, off + T), slice(rank * L, (rank + 1) * L)
    return [out.detach()[sl], x.grad[sl], logits.grad[sl], w1.grad[el], w2.grad[el]]


NAMES = ("out", "dx", "dlogits", "dw1", "dw2")


def _max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _scale(t) -> float:
    return t.double().abs().max().item() if t.numel() else 0.0


def _equivalence_worker(rank, P):
    _poison()
    res = {}
    # float64: EP == single-process kernels on the concatenation, tight.
    variants = {
        "random": ("random", {}),
        "skewed": ("skewed", {}),
        "one_expert": ("one_expert", {}),
        "empty_rank": ("empty_rank", {}),
        "flat": ("flat", {}),
        "chunks3": ("random", {"num_chunks": 3}),
        "redispatch": ("random", {"redispatch_x_in_backward": True}),
        "deferred_wgrad": ("random", {"deferred": True}),
        "chunks2_redispatch_deferred_flat": (
            "flat",
            {"num_chunks": 2, "redispatch_x_in_backward": True, "deferred": True},
        ),
        "stepwise": ("random", {"mode": "stepwise"}),
        "stepwise_chunks2_empty_rank": ("empty_rank", {"mode": "stepwise", "num_chunks": 2}),
        "slots": ("random", {"mode": "slots", "slot_extra": 3}),
        "slots_exactly_full": ("skewed", {"mode": "slots", "slot_extra": 0}),
        "slots_empty_rank": ("empty_rank", {"mode": "slots", "slot_extra": 1}),
        "slots_one_expert_deferred": ("one_expert", {"mode": "slots", "slot_extra": 2, "deferred": True}),
        "slots_flat": ("flat", {"mode": "slots", "slot_extra": 1}),
        "sync_free": ("random", {"mode": "sync_free", "slot_extra": 2}),
        "sync_free_skewed_full": ("skewed", {"mode": "sync_free", "slot_extra": 0}),
        "sync_free_empty_rank_deferred": ("empty_rank", {"mode": "sync_free", "slot_extra": 1, "deferred": True}),
        "sync_free_one_expert": ("one_expert", {"mode": "sync_free", "slot_extra": 3}),
        "sync_free_flat": ("flat", {"mode": "sync_free", "slot_extra": 1}),
        "hook_kept_chunks3": ("random", {"num_chunks": 3, "hook": "kept"}),
        "stepwise_hook_kept_chunks2_empty_rank": ("empty_rank", {"mode": "stepwise", "num_chunks": 2, "hook": "kept"}),
    }
    for name, (kind, opts) in variants.items():
        case = global_case(kind, P, seed=zlib.crc32(name.encode()) % 1000)
        ours = run_ep(case, rank, P, dtype=torch.float64, **opts)
        ref = run_reference(case, rank, P, torch.float64, "kernels")
        res[f"f64/{name}"] = {n: (_max_err(a, b), _scale(b)) for n, a, b in zip(NAMES, ours, ref, strict=True)}
    # bf16: error vs the float64 reference at most 2x PyTorch's own bf16 error (+ tiny atol).
    for kind in ("random", "flat", "skewed"):
        case = global_case(kind, P, seed=7, dtype=torch.bfloat16)
        ours = run_ep(case, rank, P, dtype=torch.bfloat16, num_chunks=2)
        ref64 = run_reference(case, rank, P, torch.float64, "reference")
        # The float64 reference must see the bf16-rounded inputs: rebuild it from rounded values.
        case64 = dict(
            case,
            x=case["x"].bfloat16().double(),
            w1=case["w1"].bfloat16().double(),
            w2=case["w2"].bfloat16().double(),
            grad=case["grad"].bfloat16().double(),
        )
        ref64 = run_reference(case64, rank, P, torch.float64, "reference")
        torch_lp = run_reference(case, rank, P, torch.bfloat16, "reference")
        res[f"bf16/{kind}"] = {n: (a, t, r) for n, a, t, r in zip(NAMES, ours, torch_lp, ref64, strict=True)}
    # Determinism: repeated runs bitwise equal (bf16, chunked, both forms).
    case = global_case("random", P, seed=3, dtype=torch.bfloat16)
    for mode, opts in (("fused", {"num_chunks": 3}), ("stepwise", {}), ("slots", {"slot_extra": 2})):
        a = run_ep(case, rank, P, dtype=torch.bfloat16, mode=mode, **opts)
        b = run_ep(case, rank, P, dtype=torch.bfloat16, mode=mode, **opts)
        res[f"bitwise/{mode}"] = all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    # Options that must not change a single bit: redispatch, deferred wgrad, a weight-gradient hook that runs
    # the work at once (each against the same form without it).
    base = {mode: run_ep(case, rank, P, dtype=torch.bfloat16, mode=mode) for mode in ("fused", "stepwise")}
    for name, opts in (
        ("redispatch", {"redispatch_x_in_backward": True}),
        ("deferred", {"deferred": True}),
        ("comm_sms", {"comm_sms": 16}),
        ("hook_now", {"hook": "now"}),
        ("stepwise_hook_now", {"mode": "stepwise", "hook": "now"}),
    ):
        other = run_ep(case, rank, P, dtype=torch.bfloat16, **opts)
        same = base[opts.get("mode", "fused")]
        res[f"same_bits/{name}"] = all(torch.equal(u, v) for u, v in zip(same, other, strict=True))
    # Row slots against exact split sizes, both step-wise: the same bits.
    base = base["stepwise"]
    other = run_ep(case, rank, P, dtype=torch.bfloat16, mode="slots", slot_extra=5)
    res["same_bits/slots"] = all(torch.equal(u, v) for u, v in zip(base, other, strict=True))
    other = run_ep(case, rank, P, dtype=torch.bfloat16, mode="sync_free", slot_extra=4)
    res["same_bits/sync_free"] = all(torch.equal(u, v) for u, v in zip(base, other, strict=True))
    return res


def _ep_worker(rank, P):
    """Every multi-rank part of this file at P ranks in one set of processes: the host-order counts first, before
    the other parts turn on deterministic mode (its fills of new memory would be counted as launches)."""
    out = {}
    if P == 2:
        out["host_order"] = {N: part(_host_order_worker, rank, P, N) for N in (1, 2)}
        out["slots_host_order"] = part(_slots_host_order_worker, rank, P)
        out["reservation"] = part(_autograd_reservation_worker, rank, P)
    out["equivalence"] = part(_equivalence_worker, rank, P)
    out["slots_overflow"] = part(_slots_overflow_worker, rank, P)
    out["bytes"] = part(_bytes_worker, rank, P)
    return out


def _ep_runs(P: int):
    return run_distributed_once(_ep_worker, P, timeout=600)


def _results(P: int, *keys) -> list:
    return part_results(_ep_runs(P), *keys)


def _equivalence(P: int):
    return _results(P, "equivalence")


F64_CASES = (
    "random",
    "skewed",
    "one_expert",
    "empty_rank",
    "flat",
    "chunks3",
    "redispatch",
    "deferred_wgrad",
    "chunks2_redispatch_deferred_flat",
    "stepwise",
    "stepwise_chunks2_empty_rank",
    "slots",
    "slots_exactly_full",
    "slots_empty_rank",
    "slots_one_expert_deferred",
    "slots_flat",
    "sync_free",
    "sync_free_skewed_full",
    "sync_free_empty_rank_deferred",
    "sync_free_one_expert",
    "sync_free_flat",
    "hook_kept_chunks3",
    "stepwise_hook_kept_chunks2_empty_rank",
)


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("case", F64_CASES)
def test_float64_equals_single_process(P, case):
    for rank, res in enumerate(_equivalence(P)):
        for name, (err, scale) in res[f"f64/{case}"].items():
            assert err <= 1e-12 * max(scale, 1.0), f"rank {rank} {case} {name}: err {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("case", ["random", "flat", "skewed"])
def test_bf16_within_torch_tolerance(P, case):
    """The criterion of the kernel tests (RMS and max error at most 2x PyTorch's bf16 error, vs float64)."""
    for rank, res in enumerate(_equivalence(P)):
        for name, (got, torch_low, ref64) in res[f"bf16/{case}"].items():
            if name == "dlogits":  # fp32 router leaf: compare as fp32 results of a bf16 computation
                torch_low = torch_low.to(got.dtype)
            msg = within_torch_error(name, got, torch_low, ref64, torch.bfloat16)
            assert msg is None, f"rank {rank} {case}: {msg}"


@pytest.mark.parametrize("P", [2, 4])
def test_repeated_runs_bitwise_equal(P):
    assert {k for k in _equivalence(P)[0] if "/" in k and k.split("/")[0] in ("bitwise", "same_bits")} == {
        "bitwise/fused",
        "bitwise/stepwise",
        "bitwise/slots",
        "same_bits/slots",
        "same_bits/sync_free",
        "same_bits/redispatch",
        "same_bits/deferred",
        "same_bits/comm_sms",
        "same_bits/hook_now",
        "same_bits/stepwise_hook_now",
    }
    for rank, res in enumerate(_equivalence(P)):
        for key in [k for k in res if k.startswith(("bitwise/", "same_bits/"))]:
            assert res[key] is True, f"rank {rank}: {key}"


def _slots_overflow_worker(rank, P):
    """Slots too small for the call (every token to rank 0's experts): too few rows per slot, then too few pairs;
    then a bad expert index on one rank with the experts launched before the sync. The rows and pairs (and the
    GEMMs) have run before the sync, so the plan raises there on every rank; the group stays usable."""
    case = global_case("skewed", P, seed=5)
    out = {}
    for name, extra_rows, top_k in (("rows", -1, 2), ("pairs", 0, 1)):
        off, T, x, logits, w1, w2 = _leaves(case, rank, P, torch.float64)
        routing = build_routing(case, logits, off, T)
        slots = Slots.for_layer(max(case["T_r"]) + extra_rows, case["E"] // P, top_k)
        started = start_plan(
            routing, num_experts=case["E"], group=dist.group.WORLD, x_TD=x, w1_EGD=w1, w2_EDF=w2, slots=slots
        )
        _, _, early = dispatch_before_sync(x, started.scores_R, started)
        try:
            early.finish()
            out[name] = None
        except EPInputError as exc:
            out[name] = str(exc)
    # a bad expert index on rank 0, the experts launched before the sync: every rank raises at the sync
    off, T, x, logits, w1, w2 = _leaves(case, rank, P, torch.float64)
    routing = build_routing(case, logits, off, T)
    if rank == 0:
        routing = TopKRouting(routing.scores_TK, torch.full_like(routing.indices_TK, case["E"]))
    slots = Slots.for_layer(max(case["T_r"]), case["E"] // P, 2)
    started = start_plan(
        routing, num_experts=case["E"], group=dist.group.WORLD, x_TD=x, w1_EGD=w1, w2_EDF=w2, slots=slots
    )
    xr, ss, early = dispatch_before_sync(x, started.scores_R, started)
    try:  # nothing in the forward waits: the check raises in backward
        y = local_experts_before_sync(xr, ss, w1, w2, early, backend="torch")
        combine_slots(y, early).sum().backward()
        out["bad_expert"] = None
    except EPInputError as exc:
        out["bad_expert"] = str(exc)
    out["after"] = run_ep(case, rank, P, dtype=torch.float64, mode="stepwise")[0].shape[0]
    return out


@pytest.mark.parametrize("P", [2, 4])
def test_slots_errors_raise_on_every_rank(P):
    for rank, res in enumerate(_results(P, "slots_overflow")):
        assert res["rows"] is not None and " rows to rank 0, more than the " in res["rows"], (rank, res)
        assert res["pairs"] is not None and " pairs to rank 0, more than the " in res["pairs"], (rank, res)
        assert res["bad_expert"] is not None and "rank 0" in res["bad_expert"], (rank, res)
        assert res["after"] >= 0  # the next plan of the group ran


# ---------------------------------------------------------------------------------------------------------
# Byte accounting of the dedup
# ---------------------------------------------------------------------------------------------------------


def _bytes_worker(rank, P):
    _poison()
    case = global_case("random", P, seed=11, E=8)
    off, T, x, logits, _, _ = _leaves(case, rank, P, torch.float64)
    routing = build_routing(case, logits, off, T)
    plan = make_plan(routing, num_experts=8, group=dist.group.WORLD, x_TD=x, num_chunks=2)
    L = 8 // P
    idx = routing.indices_TK.tolist()
    distinct = {(t, e // L) for t in range(T) for e in idx[t]}
    remote_rows = sum(1 for _, d in distinct if d != rank)
    remote_pairs = sum(1 for t in range(T) for e in idx[t] if e // L != rank)
    # What backward keeps (through saved_tensors_hooks, as activation offloading would see it).
    saved = {}
    for redispatch in (False, True):
        shapes = []

        def pack(t, shapes=shapes):
            shapes.append(tuple(t.shape))
            return t

        x_leaf = x.detach().clone().requires_grad_()
        w1, w2 = (case[k][rank * L : (rank + 1) * L].clone().requires_grad_() for k in ("w1", "w2"))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            expert_parallel_experts(
                x_leaf,
                routing,
                w1,
                w2,
                group=dist.group.WORLD,
                num_experts=8,
                backend="torch",
                redispatch_x_in_backward=redispatch,
            )
        saved[redispatch] = shapes
    recv_total = torch.tensor([plan.num_recv_rows])
    dist.all_reduce(recv_total)
    return dict(
        send_rows=plan.num_send_rows,
        distinct=len(distinct),
        wire=plan.wire_rows(),
        expected_wire=(remote_rows, remote_pairs),
        pairs=T * K,
        recv_total=int(recv_total),
        send_token_idx=plan.send_token_idx_S,
        combine_meta=plan.combine_meta().tensors(),
        send_rows_split=plan.send_rows,
        saved=saved,
        recv_rows=plan.num_recv_rows,
        recv_pairs=plan.num_recv_pairs,
        T=T,
    )


def _check_combine_order(r) -> None:
    """The combine metadata lists each token's send rows in destination order (CSR per token), and the
    kernels' Triton gather-sum (GPU path; interpreted here) sums them like a per-token loop."""
    tok = r["send_token_idx"]
    meta = RoutingMetadata(*r["combine_meta"])
    T = meta.token_offsets.numel() - 1
    dest = torch.cat([torch.full((n,), p) for per in r["send_rows_split"] for p, n in enumerate(per)])
    rows = torch.randn(tok.numel(), 8, generator=torch.Generator().manual_seed(0))
    want = torch.zeros(T, 8)
    for t in range(T):
        j = meta.s_reverse_scatter_idx[meta.token_offsets[t] : meta.token_offsets[t + 1]].long()
        assert bool((tok[j] == t).all()) and bool((dest[j][1:] > dest[j][:-1]).all())
        want[t] = rows[(tok == t).nonzero().flatten()].sum(0)
    assert int(meta.token_offsets[-1]) == tok.numel()
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        from sonic_megatron.kernels.triton import gather_sum

        got = gather_sum(rows.to(DEVICE), RoutingMetadata(*(t.to(DEVICE) for t in meta.tensors())), None)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("P", [2, 4])
def test_dedup_byte_accounting(P):
    res = _results(P, "bytes")
    total_sent = 0
    for rank, r in enumerate(res):
        assert r["send_rows"] == r["distinct"], f"rank {rank}: a token must cross to a rank once"
        _check_combine_order(r)
        assert r["wire"] == r["expected_wire"], f"rank {rank}: {r['wire']} != {r['expected_wire']}"
        assert r["send_rows"] < r["pairs"], "dedup must send fewer rows than T*K"
        # Memory: backward keeps the received (deduplicated) rows, or only the local X with redispatch;
        # never a (pairs x D) tensor. Saved: X rows, scores [Q], w1, w2, H [Q, 2F].
        U, Q, T = r["recv_rows"], r["recv_pairs"], r["T"]
        w_shapes = {(8 // P, 2 * F, D), (8 // P, D, F)}
        assert sorted(r["saved"][False]) == sorted([(U, D), (Q,), (Q, 2 * F), *w_shapes]), r["saved"][False]
        assert sorted(r["saved"][True]) == sorted([(T, D), (Q,), (Q, 2 * F), *w_shapes]), r["saved"][True]
        total_sent += r["send_rows"]
    assert res[0]["recv_total"] == total_sent


def test_group_none_is_single_process():
    """group=None: no communication, same result as the kernels (all chunks, both forms)."""
    case = global_case("flat", 1, seed=5)
    ref = run_reference(case, 0, 1, torch.float64, "kernels")
    for mode, opts in (("fused", {"num_chunks": 3}), ("stepwise", {"num_chunks": 2})):
        off, T, x, logits, w1, w2 = _leaves(case, 0, 1, torch.float64)
        routing = build_routing(case, logits, off, T)
        if mode == "fused":
            out = expert_parallel_experts(x, routing, w1, w2, num_experts=case["E"], backend="torch", **opts)
        else:
            plan = make_plan(routing, num_experts=case["E"], **opts)
            xr, sr = dispatch(x, plan)
            out = combine(local_experts(xr, sr, w1, w2, plan, backend="torch"), plan)
        out.backward(case["grad"])
        for n, a, b in zip(NAMES, (out, x.grad, logits.grad, w1.grad, w2.grad), ref, strict=True):
            assert _max_err(a, b) <= 1e-12 * max(_scale(b), 1.0), f"{mode} {n}"


def test_blocking_all_to_all_takes_no_work_from_nccl(monkeypatch):
    """The blocking all-to-all (the slotted combine's) on a group whose blocking collective returns no work
    (NCCL: already ordered on the current stream) returns without waiting; a returned work is waited for."""
    from sonic_megatron.token_dispatch import comm

    class Work:
        waited = 0

        def wait(self):
            Work.waited += 1

    for returned, waits in ((None, 0), (Work(), 1)):
        Work.waited = 0
        calls = []

        def collective(out, inp, out_splits, in_splits, opts, returned=returned, calls=calls):
            calls.append(opts.asyncOp)
            out.copy_(inp)
            return returned

        monkeypatch.setattr(comm, "group_size", lambda group: 2)
        monkeypatch.setattr(comm, "_group_all_to_all", lambda group: collective)
        out, inp = torch.zeros(4), torch.arange(4.0)
        assert comm.all_to_all(out, inp, [2, 2], [2, 2], group=object()) is None
        assert calls == [False] and Work.waited == waits and torch.equal(out, inp)


def test_weight_grads_run_while_backward_all_to_all_in_flight(monkeypatch):
    """Schedule of the pipelined backward: chunk c's dW GEMMs start after its dX/dS all-to-alls are
    launched and before anything waits for them; forward launches every dispatch before computing."""
    from sonic_megatron.kernels import torch_backend
    from sonic_megatron.token_dispatch import comm, exchange

    log = []

    def wrap(mod, name):
        orig = getattr(mod, name)

        def f(*a, **k):
            log.append(name)
            return orig(*a, **k)

        monkeypatch.setattr(mod, name, f)

    for name in ("rows_to_experts", "rows_to_sources", "pairs_to_sources"):
        wrap(exchange, name)
    for name in ("forward", "backward_data", "backward_weights"):
        wrap(torch_backend, name)
    orig_wait = comm.Pending.wait
    monkeypatch.setattr(comm.Pending, "wait", lambda self: (log.append("wait"), orig_wait(self))[1])
    case = global_case("random", 1, seed=9)
    off, T, x, logits, w1, w2 = _leaves(case, 0, 1, torch.float64)
    out = expert_parallel_experts(
        x, build_routing(case, logits, off, T), w1, w2, num_experts=case["E"], backend="torch", num_chunks=3
    )
    fwd = log[log.index("rows_to_experts") :]
    assert fwd[:3] == ["rows_to_experts"] * 3, fwd  # all dispatches launched before the first expert
    log.clear()
    out.backward(case["grad"])
    bwd = list(log)
    for c in range(3):
        i_dw = [i for i, e in enumerate(bwd) if e == "backward_weights"][c]
        i_launch = [i for i, e in enumerate(bwd) if e == "rows_to_sources"][c]
        assert i_launch < i_dw, bwd
        waits_between = [e for e in bwd[i_launch:i_dw] if e == "wait"]
        assert not waits_between, f"chunk {c}: dW must not wait for its all-to-all: {bwd}"
    last_dw = max(i for i, e in enumerate(bwd) if e == "backward_weights")
    assert "wait" in bwd[last_dw:], f"the backward all-to-alls are waited for after the last dW: {bwd}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [0, 1, 7])
def test_scores_ride_in_pair_metadata_bitwise(dtype, n):
    """Scores travel as int32 columns of the pair-metadata all-to-all: the round trip is exact for every dtype."""
    from sonic_megatron.token_dispatch.recv_side import scores_from_columns
    from sonic_megatron.token_dispatch.send_side import score_columns

    s = (torch.randn(n, dtype=torch.float64) * 3).to(dtype)
    cols = score_columns(s)
    assert cols.dtype == torch.int32 and cols.shape == (n, 2 if dtype == torch.float64 else 1)
    meta = torch.cat([torch.full((n, 2), -7, dtype=torch.int32), cols], dim=1)  # as on the wire
    back = scores_from_columns(meta[:, 2:], dtype)
    assert back.dtype == dtype and torch.equal(back.view(-1), s)


def _host_order_worker(rank, P, N):
    from sonic_megatron.token_dispatch.launch_count import LaunchCounter

    case = global_case("random", P, seed=5, E=8)
    off, T, x, logits, _, _ = _leaves(case, rank, P, torch.float32)
    routing = build_routing(case, logits, off, T)
    L = 8 // P
    w1, w2 = (case[k][rank * L : (rank + 1) * L].float().clone().requires_grad_() for k in ("w1", "w2"))
    kw = dict(group=dist.group.WORLD, num_experts=8, backend="torch", num_chunks=N)
    expert_parallel_experts(x, routing, w1, w2, **kw).sum().backward()  # warm-up
    with LaunchCounter() as lc:
        expert_parallel_experts(x, routing, w1, w2, **kw)
    kinds = [k for k, _, _ in lc.events if k != "launch"]
    return lc.summary(), kinds


@pytest.mark.parametrize("N", [1, 2])
def test_forward_host_order(N):
    """Issue #4: after the plan's one host sync the forward launches the pair all-to-alls and (after the one X
    gather) the row all-to-alls before anything else; scores need no all-to-all of their own."""
    for summary, kinds in _results(2, "host_order", N):
        assert summary["launches_sync_to_row_a2a"] <= 1, summary
        first_sync = kinds.index("sync")
        # all-gather (header + counts), sync, N pair all-to-alls, N row all-to-alls, then N row all-to-alls back
        assert kinds[: first_sync + 1] == ["collective", "sync"], kinds
        assert kinds[first_sync + 1 : first_sync + 1 + 2 * N] == ["collective"] * N + ["row_a2a"] * N, kinds
        assert summary["collectives"] == 1 + 3 * N, summary


def _slots_host_order_worker(rank, P):
    from sonic_megatron.token_dispatch.launch_count import LaunchCounter

    case = global_case("random", P, seed=5, E=8)
    off, T, x, logits, w1, w2 = _leaves(case, rank, P, torch.float32)
    routing = build_routing(case, logits, off, T)
    slots = Slots.for_layer(max(case["T_r"]), 8 // P, routing.indices_TK.shape[1])
    kw = dict(num_experts=8, group=dist.group.WORLD, x_TD=x, w1_EGD=w1, w2_EDF=w2, slots=slots)
    with LaunchCounter() as lc:
        started = start_plan(routing, **kw)
        xr, ss, early = dispatch_before_sync(x, started.scores_R, started)
        plan = early.finish()
        y = local_experts(xr, plan.pairs_from_slots(ss), w1, w2, plan, backend="torch")
        combine(y, plan)
    return [k for k, _, _ in lc.events if k != "launch"]


def test_slots_leave_before_the_sync():
    """With slots the sizes all-gather, the pairs' and the rows' all-to-alls are all launched before the plan's
    host sync, and nothing is exchanged after it until the combine sends the rows back (the torch backend of the
    experts syncs on its own, after the plan's sync)."""
    for kinds in _results(2, "slots_host_order"):
        first_sync = kinds.index("sync")
        assert kinds[:first_sync] == ["collective", "collective", "row_a2a"], kinds
        assert [k for k in kinds[first_sync:] if k != "sync"] == ["row_a2a"], kinds


def test_slot_sizes_and_row_blocking():
    """Slots fit a row per token and min(K, L) pairs per row (L without top-K); the pairs a received row carries on
    average under uniform top-K routing (the kernels' blocking of a row's pairs): K at one rank, K / P over the share
    of tokens that reach a rank otherwise, nothing without top-K."""
    from sonic_megatron.token_dispatch.plan import _pairs_per_row
    from sonic_megatron.token_dispatch.slots import expected_fill, slots_pay

    assert Slots.for_layer(8192, 32, 8) == Slots(rows=8192, pairs=8192 * 8)
    assert Slots.for_layer(100, 4, 8) == Slots(rows=100, pairs=400)
    assert Slots.for_layer(100, 4, None) == Slots(rows=100, pairs=400)
    assert _pairs_per_row(128, 8, 1) == 8
    assert abs(expected_fill(128, 8, 4) - 0.9073) < 1e-3 and _pairs_per_row(128, 8, 4) == 2
    assert _pairs_per_row(128, -1, 4) == 0 and _pairs_per_row(130, 8, 4) == 0
    assert slots_pay(128, 8, 4) and not slots_pay(128, 8, 8) and not slots_pay(128, 8, 1)


def _recorded_wgrad_fn(calls, g1, g2):
    """A recorded weight-gradient closure with ``backward_weights``' contract: returns (g1, g2), or adds them
    into ``out`` (stores them with ``accumulate=False``); logs whether it got ``out``."""

    def fn(out=None, accumulate=True):
        calls.append(out is not None)
        if out is None:
            return g1.clone(), g2.clone()  # fresh tensors, as the GEMMs return
        for acc, g in zip(out, (g1, g2), strict=True):
            acc.add_(g) if accumulate else acc.copy_(g)
        return out

    return fn


def test_deferred_wgrad_default_sink_adds_to_grad_and_a_given_sink_gets_every_closure():
    """Without a sink, compute() adds the returned gradients into ``.grad`` (created, then accumulated), also
    when a weight has a ``main_grad`` (that convention is the caller's sink); a given sink receives every
    recorded closure with its weights, in order."""
    w1, w2 = torch.zeros(2, 4, 3, requires_grad=True), torch.zeros(2, 3, 2, requires_grad=True)
    g1, g2 = torch.randn(2, 4, 3), torch.randn(2, 3, 2)
    calls = []
    fn = _recorded_wgrad_fn(calls, g1, g2)
    wg = DeferredWeightGrad()
    wg.record(fn, w1, w2)
    w1.main_grad = torch.ones(w1.shape)
    wg.record(fn, w1, w2)
    wg.compute()
    assert calls == [False, False] and wg.num_pending == 0
    assert torch.equal(w1.grad, g1 + g1) and torch.equal(w2.grad, g2 + g2) and torch.equal(w1.main_grad, 1 + 0 * g1)
    seen = []
    wg = DeferredWeightGrad(sink=lambda f, params: seen.append((f, params)))
    wg.record(fn, w1, w2)
    wg.record(fn, w2, w1)
    wg.compute()
    assert [(f, tuple(map(id, ps))) for f, ps in seen] == [(fn, (id(w1), id(w2))), (fn, (id(w2), id(w1)))]
    with pytest.raises(TypeError, match="sink must be callable"):
        DeferredWeightGrad(sink=3)


def test_main_grad_sink_adds_into_main_grads_through_out():
    """Megatron's sink (``sonic_megatron.wgrad.add_to_main_grads``): with a contiguous main_grad on both
    weights, the recorded GEMMs get them as ``out`` (fused accumulation, no temporary; stored while DDP's flag
    says they are empty); otherwise the returned gradients are accumulated (into ``.grad`` where a weight has no
    main_grad)."""
    from sonic_megatron.wgrad import add_to_main_grads

    w1, w2 = torch.zeros(2, 4, 3, requires_grad=True), torch.zeros(2, 3, 2, requires_grad=True)
    g1, g2 = torch.randn(2, 4, 3), torch.randn(2, 3, 2)
    calls = []
    fn = _recorded_wgrad_fn(calls, g1, g2)
    wg = DeferredWeightGrad(sink=add_to_main_grads)
    wg.record(fn, w1, w2)
    wg.compute()  # no main_grad: returned gradients go to .grad
    assert calls == [False] and torch.equal(w1.grad, g1) and torch.equal(w2.grad, g2)
    for w in (w1, w2):  # main_grads that already hold a gradient (DDP's flag set): added to
        w.main_grad = torch.ones(w.shape, dtype=torch.float32)
        w.grad_added_to_main_grad = True
    wg.record(fn, w1, w2)
    wg.record(fn, w1, w2)
    wg.compute()
    assert calls == [False, True, True] and wg.num_pending == 0
    torch.testing.assert_close(w1.main_grad, 1 + g1 + g1, rtol=0, atol=0)
    torch.testing.assert_close(w2.main_grad, 1 + g2 + g2, rtol=0, atol=0)
    for w in (w1, w2):  # freshly zeroed by DDP (flag cleared): the first gradient is stored, stale values unread
        w.main_grad.fill_(float("nan"))
        w.grad_added_to_main_grad = False
    wg.record(fn, w1, w2)
    wg.record(fn, w1, w2)
    wg.compute()
    torch.testing.assert_close(w1.main_grad, g1 + g1, rtol=0, atol=0)
    torch.testing.assert_close(w2.main_grad, g2 + g2, rtol=0, atol=0)
    assert w1.grad_added_to_main_grad and w2.grad_added_to_main_grad


@contextlib.contextmanager
def recording_reservations():
    """Patch the torch backend so that each forward / backward_data / backward_weights call logs (its name, the
    (SMs, GEMM count) reservation active around it); yields the log and restores the backend afterwards."""
    from sonic_megatron.kernels import torch_backend

    active, log = [(0, None)], []
    names = ("reserve_sms", "forward", "backward_data", "backward_weights")
    originals = {n: getattr(torch_backend, n) for n in names}

    @contextlib.contextmanager
    def reserve(n, gemms=None):
        with originals["reserve_sms"](n, gemms):
            active.append((n, gemms))
            try:
                yield
            finally:
                active.pop()

    def logged(name):
        return lambda *a, **k: (log.append((name, active[-1])), originals[name](*a, **k))[1]

    torch_backend.reserve_sms = reserve
    for name in names[1:]:
        setattr(torch_backend, name, logged(name))
    try:
        yield log
    finally:
        for name, fn in originals.items():
            setattr(torch_backend, name, fn)


def test_local_experts_comm_sms_same_results_and_checked():
    """``local_experts(comm_sms=n)`` (Megatron's 1F1B overlap) runs the forward and backward-data calls under
    ``reserve_sms(n, gemms=1)`` and the (deferred) weight gradients under ``reserve_sms(n)``, computes the same
    output and gradients as without, and a bad value names the argument."""
    case = global_case("random", 1, seed=11)
    outs = []
    for comm_sms in (0, 8):
        off, T, x, logits, w1, w2 = _leaves(case, 0, 1, torch.float64)
        plan = make_plan(build_routing(case, logits, off, T), num_experts=case["E"], x_TD=x)
        xr, sr = dispatch(x, plan)
        wgrad = DeferredWeightGrad()
        with recording_reservations() as log:
            y = local_experts(xr, sr, w1, w2, plan, backend="torch", wgrad=wgrad, comm_sms=comm_sms)
            combine(y, plan).backward(case["grad"])
            wgrad.compute()
        outs.append([y.detach(), x.grad, logits.grad, w1.grad, w2.grad])
        want = [("forward", (comm_sms, 1)), ("backward_data", (comm_sms, 1)), ("backward_weights", (comm_sms, None))]
        assert log == want, log
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
    with pytest.raises(ValueError, match="local_experts: comm_sms must be an int >= 0, got -1"):
        local_experts(xr, sr, w1, w2, plan, backend="torch", comm_sms=-1)


def _autograd_reservation_worker(rank, P):
    """The (SMs, GEMM count) reservation active around each backend call of ``expert_parallel_experts``."""
    _poison()
    case = global_case("random", P, seed=5)
    logs = {}
    for chunks in (1, 2):
        with recording_reservations() as log:
            run_ep(case, rank, P, dtype=torch.float64, num_chunks=chunks, comm_sms=8, deferred=chunks == 2)
        logs[chunks] = log
    return logs


def test_expert_parallel_experts_reserves_sms_where_a_collective_is_in_flight():
    """With comm_sms = n every GEMM of a forward / backward-data call leaves n SMs free only with more than one
    chunk (with one chunk nothing else is in flight then), every GEMM of a weight-gradient call always (the dX / dS
    all-to-alls travel beside it); deferred weight gradients run later, in ``wgrad.compute()``, reserving none."""
    for logs in _results(2, "reservation"):
        one = [("forward", (0, None)), ("backward_data", (0, None)), ("backward_weights", (8, None))]
        assert logs[1] == one, logs[1]
        data, deferred = (8, None), (0, None)
        two = [("forward", data)] * 2 + [("backward_data", data)] * 2 + [("backward_weights", deferred)] * 2
        assert logs[2] == two, logs[2]


def test_options_validated_once_frozen_and_keywords_override():
    """EPOptions rejects a bad field naming it, the expected and the given value (bools are no ints, ints no
    bools), is frozen, and a front-end's keywords override ``options``' fields: the same bits either way."""
    import dataclasses

    from sonic_megatron.token_dispatch import EPInputError, EPOptions

    bad = [
        ("num_chunks", True, r"num_chunks must be an int in \[1, 16\], got True"),
        ("num_chunks", 17, r"num_chunks must be an int in \[1, 16\], got 17"),
        ("redispatch_x_in_backward", "yes", "redispatch_x_in_backward must be a bool"),
        ("comm_sms", False, "comm_sms must be an int >= 0, got False"),
        ("comm_sms", -1, "comm_sms must be an int >= 0, got -1"),
        ("backend", "x", r"backend must be one of \('auto', 'torch', 'cute'\), got 'x'"),
        ("activation", "tanh", "activation must be one of"),
        ("rounding", "up", "rounding must be a TokenRounding or None, got str"),
        ("wgrad", object(), "wgrad must be a DeferredWeightGrad or None, got object"),
        ("weight_grad_hook", 3, r"weight_grad_hook must be callable\(work\) or None, got int"),
    ]
    for name, value, msg in bad:
        with pytest.raises(EPInputError, match="EPOptions: " + msg):
            EPOptions(**{name: value})
    with pytest.raises(EPInputError, match="EPOptions: wgrad and weight_grad_hook both say where"):
        EPOptions(wgrad=DeferredWeightGrad(), weight_grad_hook=lambda work: work())
    opts = EPOptions(num_chunks=2, backend="torch")
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.num_chunks = 3
    case = global_case("random", 1, seed=3)
    results = []
    for kw in (
        dict(options=opts),
        dict(num_chunks=2, backend="torch"),
        dict(options=EPOptions(), num_chunks=2, backend="torch"),
    ):
        off, T, x, logits, w1, w2 = _leaves(case, 0, 1, torch.float64)
        out = expert_parallel_experts(x, build_routing(case, logits, off, T), w1, w2, num_experts=case["E"], **kw)
        out.backward(case["grad"])
        results.append([out.detach(), x.grad, logits.grad, w1.grad, w2.grad])
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0], r, strict=True))
    off, T, x, logits, w1, w2 = _leaves(case, 0, 1, torch.float64)
    routing = build_routing(case, logits, off, T)
    with pytest.raises(TypeError, match=r"expert_parallel_experts: unexpected keyword argument\(s\) \['chunks'\]"):
        expert_parallel_experts(x, routing, w1, w2, num_experts=case["E"], chunks=2)
    with pytest.raises(TypeError, match="options must be an EPOptions or None, got dict"):
        make_plan(routing, num_experts=case["E"], options={"num_chunks": 2})
    with pytest.raises(EPInputError, match="make_plan: num_chunks must be an int"):
        make_plan(routing, num_experts=case["E"], options=opts, num_chunks=0)
