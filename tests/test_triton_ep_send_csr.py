"""The send side of a token-sorted flat routing (token_dispatch/triton_send_csr.py: the rounded routing under expert
parallelism) against its PyTorch reference (send_side.send_side_torch with padded=True): bitwise equal in every
field the plan reads, on CPU under TRITON_INTERPRET=1 (compiled on a GPU when present). Outputs come from
torch.empty, poisoned here (deterministic fill), so an element the kernels forget to write shows."""

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from sonic_megatron.token_dispatch import recv_side, send_side  # noqa: E402
from sonic_megatron.token_dispatch.rounding import TokenRounding, round_routing_padded  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FIELDS = ("order", "send_token_idx_R", "combine_order_R", "combine_offsets", "pair_meta_RC", "rows_NP", "pairs_NP")


def _csr():
    try:
        from sonic_megatron.token_dispatch.triton_send_csr import ep_send_side_csr
    except Exception as exc:  # pragma: no cover - depends on the triton build
        pytest.skip(f"triton kernels cannot be imported here: {exc}")
    return ep_send_side_csr


def _routing(T, L, P, most, padding, gen):
    """Token-sorted pairs, each token 0..``most`` distinct experts ascending, then ``padding`` pairs (T, E)."""
    E, tok, exp = L * P, [], []
    for t in range(T):
        k = min(int(torch.randint(0, most + 1, (1,), generator=gen)), E)
        tok += [t] * k
        exp += torch.randperm(E, generator=gen)[:k].sort().values.tolist()
    tok += [T] * padding
    exp += [E] * padding
    return torch.tensor(tok, dtype=torch.int64), torch.tensor(exp, dtype=torch.int64)


def _check_equal(tok_R, exp_R, scores_R, T, L, P, N, *, offsets_dtype=torch.int64, bt=None):
    """The kernels' send side equals the reference's where the plan reads it; returns the real pair count."""
    tok_R, exp_R, scores_R = tok_R.to(DEVICE), exp_R.to(DEVICE), scores_R.to(DEVICE)
    offsets = torch.searchsorted(tok_R, torch.arange(T + 1, device=DEVICE)).to(offsets_dtype)
    real = int(offsets[-1])
    want = send_side.send_side_torch(tok_R, exp_R, scores_R, T, L, P, N, padded=True)
    det, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        got = send_side.SendSide(*_csr()(offsets, exp_R, scores_R, T, L, P, N, block_tokens=bt))
    finally:
        torch.use_deterministic_algorithms(det)
        torch.utils.deterministic.fill_uninitialized_memory = fill
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        if name == "pair_meta_RC":  # the padding pairs' rows are never sent (module docstring)
            a, b = a[:real], b[:real]
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), f"{name}: {a.flatten().tolist()[:24]} vs {b.flatten().tolist()[:24]}"
    back = recv_side.scores_from_columns(got.pair_meta_RC[:real, 2:], scores_R.dtype)
    assert torch.equal(back, scores_R[got.order[:real]])
    return real


CASES = {  # T, L, P, N, most pairs of a token, padding pairs, tokens per program
    "p4": (37, 3, 4, 1, 6, 7, 4),
    "p2_n3": (64, 4, 2, 3, 9, 0, 8),
    "p1": (5, 2, 1, 1, 3, 2, None),
    "p8_n2": (100, 8, 8, 2, 12, 30, 16),
    "l1": (33, 1, 4, 2, 3, 5, 4),
    "empty_tokens": (20, 4, 4, 2, 1, 3, 4),  # about half the tokens without pairs
    "no_pairs": (9, 2, 2, 1, 0, 4, 4),
    "t1_n3": (1, 3, 2, 3, 4, 1, None),  # more chunks than tokens
}


@pytest.mark.parametrize("case", list(CASES))
def test_random_token_sorted_routing_matches_reference(case):
    T, L, P, N, most, padding, bt = CASES[case]
    gen = torch.Generator().manual_seed(list(CASES).index(case))
    tok, exp = _routing(T, L, P, most, padding, gen)
    scores = torch.randn(tok.numel(), generator=gen)
    _check_equal(tok, exp, scores, T, L, P, N, bt=bt)


@pytest.mark.parametrize(
    "score_dtype, offsets_dtype",
    [(torch.bfloat16, torch.int32), (torch.float16, torch.int64), (torch.float64, torch.int32)],
)
def test_dtypes(score_dtype, offsets_dtype):
    gen = torch.Generator().manual_seed(7)
    tok, exp = _routing(40, 4, 4, 5, 6, gen)
    scores = torch.randn(tok.numel(), generator=gen, dtype=torch.float64).to(score_dtype)
    _check_equal(tok, exp, scores, 40, 4, 4, 2, offsets_dtype=offsets_dtype, bt=8)


@pytest.mark.parametrize("P, tile", [(2, 4), (4, 8)])
def test_a_rounded_routing_matches_reference(P, tile):
    """The pairs token rounding returns (real pairs first, padding after), with the offsets of its tokens."""
    gen = torch.Generator().manual_seed(P)
    T, E, K = 48, 4 * P, 3
    probs = torch.randn(T, E, generator=gen).softmax(-1)
    scores, idx = probs.topk(K, dim=-1)
    tok = torch.arange(T).repeat_interleave(K)
    rounded, _ = round_routing_padded(
        tok, idx.reshape(-1), scores.reshape(-1), probs, num_experts=E, rounding=TokenRounding("nearest", tile)
    )
    real = _check_equal(rounded.token_idx_R, rounded.expert_idx_R, rounded.scores_R.detach(), T, E // P, P, 2, bt=8)
    assert 0 < real <= rounded.token_idx_R.numel()


def test_rejects_bad_input():
    f = _csr()
    off, exp, s = torch.tensor([0, 1, 2]), torch.tensor([0, 1]), torch.rand(2)
    with pytest.raises(ValueError, match="num_tokens must be an int >= 1"):
        f(off[:1], exp[:0], s[:0], 0, 2, 2, 1)
    with pytest.raises(ValueError, match=r"token_offsets must be \[T \+ 1 = 4\]"):
        f(off, exp, s, 3, 2, 2, 1)
    with pytest.raises(ValueError, match="scores_R must be expert_idx_R's shape"):
        f(off, exp, s[:1], 2, 2, 2, 1)
    with pytest.raises(ValueError, match="world_size must be an int in"):
        f(off, exp, s, 2, 2, 0, 1)
    with pytest.raises(ValueError, match="block_tokens must be a power of two"):
        f(off, exp, s, 2, 2, 2, 1, block_tokens=3)


def test_build_send_side_takes_the_kernels_on_cuda_only():
    """``build_send_side`` picks these kernels for a padded routing with token offsets on CUDA with tokens; the
    reference elsewhere (same results)."""
    off = torch.tensor([0, 1])
    assert send_side._csr_send_side(off, 1, 2) is None  # a CPU tensor
    assert send_side._csr_send_side(off.to(DEVICE), 0, 2) is None  # no tokens
    if DEVICE == "cuda":
        assert send_side._csr_send_side(off.cuda(), 1, 2) is not None


@pytest.mark.gpu
def test_large_rounded_on_gpu():
    """T = 8192, E = 128, K = 8, P = 4, tile 128: the rounding kernels' routing and offsets, bf16 scores."""
    from sonic_megatron.kernels.routing import TopKRouting
    from sonic_megatron.token_dispatch.triton_round_ep import round_ep_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    T, E, K, P = 8192, 128, 8, 4
    probs = torch.randn(T, E, device="cuda", generator=gen).softmax(-1)
    scores, idx = probs.topk(K, dim=-1)
    rounded, _ = round_ep_triton(
        TopKRouting(scores.bfloat16(), idx), probs, num_experts=E, mode="nearest", tile=128, group=None
    )
    assert rounded.token_offsets is not None
    tok, exp, s = rounded.token_idx_R, rounded.expert_idx_R, rounded.scores_R.detach()
    want = send_side.send_side_torch(tok, exp, s, T, E // P, P, 2, padded=True)
    got = send_side.build_send_side(tok, exp, s, T, E // P, P, 2, padded=True, token_offsets=rounded.token_offsets)
    real = int(rounded.token_offsets[-1])
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        if name == "pair_meta_RC":
            a, b = a[:real], b[:real]
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name


def _plan_with_and_without_kernels(rank, world_size):
    """One rounded EP layer call (plan, dispatch, experts, combine, backward) twice: with the plan's send side from
    these kernels (forced on the CPU: the CPU rounding's pairs are token-sorted too, their offsets searched here)
    and from the reference; every plan field, output and gradient bitwise equal on every rank."""
    import torch.distributed as dist
    from sonic_megatron.kernels import TopKRouting
    from sonic_megatron.token_dispatch import (
        EPOptions,
        Slots,
        combine,
        combine_slots,
        dispatch,
        dispatch_before_sync,
        local_experts,
        local_experts_before_sync,
        make_plan,
        start_plan,
    )
    from sonic_megatron.token_dispatch import plan as plan_module
    from sonic_megatron.token_dispatch.triton_send_csr import ep_send_side_csr

    reference = plan_module.build_send_side

    def with_kernels(tok_R, exp_R, scores_R, T, L, P, N, topk=None, padded=False, token_offsets=None):
        assert padded and topk is None and T > 0
        offsets = torch.searchsorted(tok_R, torch.arange(T + 1))
        return send_side.SendSide(*ep_send_side_csr(offsets, exp_R, scores_R, T, L, P, N, block_tokens=4))

    T, D, F, E, K = 24 if rank else 19, 16, 8, 4 * world_size, 3
    g = torch.Generator().manual_seed(rank)
    x0, logits0 = torch.randn(T, D, generator=g, dtype=torch.float64), torch.randn(T, E, generator=g)
    w10 = torch.randn(E // world_size, 2 * F, D, generator=g, dtype=torch.float64)
    w20 = torch.randn(E // world_size, D, F, generator=g, dtype=torch.float64)
    grad = torch.randn(T, D, generator=g, dtype=torch.float64)
    opts = EPOptions(backend="torch", rounding=TokenRounding("nearest", 4), num_chunks=2)

    def run(kernels: bool):
        plan_module.build_send_side = with_kernels if kernels else reference
        try:
            x, logits = x0.clone().requires_grad_(), logits0.clone().requires_grad_()
            w1, w2 = w10.clone().requires_grad_(), w20.clone().requires_grad_()
            probs = logits.softmax(-1)
            s, idx = probs.topk(K, dim=-1)
            plan = make_plan(
                TopKRouting(s, idx), num_experts=E, group=dist.group.WORLD, rounding_scores_TE=probs, options=opts
            )
            xr, sr = dispatch(x, plan)
            y = combine(local_experts(xr, sr, w1, w2, plan, options=opts), plan)
            y.backward(grad)
        finally:
            plan_module.build_send_side = reference
        sizes = (plan.send_rows, plan.send_pairs, plan.recv_rows, plan.recv_pairs)
        fields = (plan.send_token_idx_S, plan.send_pair_idx, plan.combine_order_S, plan.combine_offsets)
        return sizes, (*fields, y, x.grad, logits.grad, w1.grad, w2.grad)

    def run_slotted() -> tuple:
        """One chunk, the kernels' send side, in slots sized for the pairs rounding adds, no forward sync."""
        one = dataclasses.replace(opts, num_chunks=1)
        plan_module.build_send_side = with_kernels
        try:
            x, logits = x0.clone().requires_grad_(), logits0.clone().requires_grad_()
            w1, w2 = w10.clone().requires_grad_(), w20.clone().requires_grad_()
            probs = logits.softmax(-1)
            s, idx = probs.topk(K, dim=-1)
            slots = Slots.for_layer(24, E // world_size, K, rounding_tile=one.rounding.tile)
            started = start_plan(
                TopKRouting(s, idx),
                num_experts=E,
                group=dist.group.WORLD,
                rounding_scores_TE=probs,
                x_TD=x,
                w1_EGD=w1,
                w2_EDF=w2,
                options=one,
                slots=slots,
            )
            xr, ss, early = dispatch_before_sync(x, started.scores_R, started)
            y = combine_slots(local_experts_before_sync(xr, ss, w1, w2, early, options=one), early)
            y.backward(grad)
        finally:
            plan_module.build_send_side = reference
        return y, x.grad, logits.grad, w1.grad, w2.grad

    (sizes_a, a), (sizes_b, b) = run(True), run(False)
    same = sizes_a == sizes_b and all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    # in slots: the exact split sizes' results (one chunk there too), bitwise
    opts = dataclasses.replace(opts, num_chunks=1)
    _, exact = run(True)
    slotted = run_slotted()
    return same and all(torch.equal(u, v) for u, v in zip(exact[4:], slotted, strict=True))


@pytest.mark.parametrize("world_size", [2, 4])
def test_rounded_plan_from_the_kernels_equals_the_reference(world_size):
    from sonic_megatron.testing import spawn

    assert spawn(_plan_with_and_without_kernels, world_size) == [True] * world_size
