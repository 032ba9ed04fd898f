"""Backend ``cute`` on a Hopper GPU: every output and gradient vs a float64 reference.

Rule: err(cute) <= 2 * err(torch backend, same dtype, same GPU) + atol, with atol one
rounding of the output dtype scaled to the reference's magnitude; errors are max-abs over the tensor.
The caching allocator is filled with NaN before each cute launch (``_poison``), so any output element a
kernel forgets to write shows up. Inputs are fresh random tensors (never zeros).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from sonic_megatron.kernels import FlatRouting, TopKRouting, moe_experts, moe_experts_reference
from sonic_megatron.kernels.interface import compute_metadata
from test_kernels_helpers import require_cute

pytestmark = pytest.mark.gpu


def _poison(nbytes: int = 1 << 30) -> None:
    """Fill freed blocks of the caching allocator with NaN (large pool and small pool)."""
    big = torch.full((nbytes // 2,), float("nan"), dtype=torch.bfloat16, device="cuda")
    small = [torch.full((1 << 18,), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(32)]
    del big, small


def _routing(kind: str, T: int, E: int, K: int, gen: torch.Generator):
    dev = "cuda"
    if kind == "flat":  # 0..K pairs per token, tokens ascending, some tokens with none
        n_T = torch.randint(0, K + 1, (T,), generator=gen)
        tok = torch.repeat_interleave(torch.arange(T), n_T)
        ex = torch.rand(T, E, generator=gen).argsort(-1)[:, :K][torch.arange(K)[None, :] < n_T[:, None]]
        scores = torch.rand(tok.numel(), generator=gen) + 0.1
        return FlatRouting(tok.int().to(dev), ex.int().to(dev), scores.to(dev), T)
    if kind == "whole_tiles":  # every expert 2T/E rows, a multiple of 128 (as token rounding leaves them)
        perm = torch.randperm(T, generator=gen)
        ex = torch.stack([perm % E, (perm + 1) % E], 1).reshape(-1)  # K = 2: each expert T/E + T/E pairs
        tok = torch.arange(T).repeat_interleave(2)
        scores = torch.rand(tok.numel(), generator=gen) + 0.1
        flat = FlatRouting(tok.int().to(dev), ex.int().to(dev), scores.to(dev), T)
        meta = compute_metadata(flat, E)[1]
        assert bool((meta.expert_offsets.diff() % 128 == 0).all())
        return dataclasses.replace(flat, metadata=dataclasses.replace(meta, rows_multiple=128))
    if kind == "hot":  # expert 0 in every token, the others from the first half: empty experts too
        rest = max(K, E // 2)
        idx = torch.cat([torch.zeros(T, 1), 1 + torch.rand(T, rest - 1, generator=gen).argsort(-1)[:, : K - 1]], 1)
    elif kind == "single":  # all tokens on one expert
        idx = torch.full((T, K), E - 1)
    else:  # uniform distinct experts: ragged counts, not multiples of 128
        idx = torch.rand(T, E, generator=gen).argsort(-1)[:, :K]
    scores = torch.softmax(torch.randn(T, K, generator=gen), -1)
    return TopKRouting(scores.to(dev), idx.long().to(dev))


def _leaves(x, routing, w1, w2, dtype):
    def leaf(t):
        return t.detach().to(dtype).requires_grad_(True)

    if isinstance(routing, TopKRouting):
        r = TopKRouting(leaf(routing.scores_TK), routing.indices_TK)
        s = r.scores_TK
    else:
        r = dataclasses.replace(routing, scores_R=leaf(routing.scores_R))  # its metadata too, if any
        s = r.scores_R
    return leaf(x), r, s, leaf(w1), leaf(w2)


def _run(backend, x, routing, w1, w2, dO, dtype, activation, forward_ctx=contextlib.nullcontext):
    """Output and gradients; ``forward_ctx()`` is entered around the forward only."""
    xl, r, s, w1l, w2l = _leaves(x, routing, w1, w2, dtype)
    if backend == "reference":
        out = moe_experts_reference(xl, r, w1l, w2l, activation)
    else:
        if backend == "cute":
            _poison()
        with forward_ctx():
            out = moe_experts(xl, r, w1l, w2l, activation=activation, backend=backend)
    if out.requires_grad:
        out.backward(dO.to(dtype))
    else:  # the naive reference builds no graph when no expert receives a token: all gradients are zero
        for t in (xl, s, w1l, w2l):
            t.grad = torch.zeros_like(t)
    return {"out": out.detach(), "dx": xl.grad, "dscores": s.grad, "dw1": w1l.grad, "dw2": w2l.grad}


def _case(T, D, F, E, K, kind="uniform", dtype=torch.bfloat16, activation="swiglu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen).cuda()
    w1 = (torch.randn(E, 2 * F, D, generator=gen) / D**0.5).cuda()
    w2 = (torch.randn(E, D, F, generator=gen) / F**0.5).cuda()
    dO = torch.randn(T, D, generator=gen).cuda()
    routing = _routing(kind, T, E, K, gen)
    return x, routing, w1, w2, dO, dtype, activation


def _check(args):
    dtype = args[5]
    got = _run("cute", *args)
    ref = _run("reference", *args[:5], torch.float64, args[6])
    base = _run("torch", *args)
    for name, r in ref.items():
        g, b = got[name], base[name]
        assert g is not None and g.shape == r.shape, name
        assert torch.isfinite(g.float()).all(), f"{name}: non-finite values (unwritten output?)"
        if r.numel() == 0:
            continue
        err = (g.double() - r).abs().max().item()
        base_err = (b.double() - r).abs().max().item()
        atol = torch.finfo(dtype).eps / 2 * r.abs().max().item()
        assert err <= 2 * base_err + atol, f"{name}: err {err:.3e} > 2 x torch {base_err:.3e} + atol {atol:.1e}"


SMALL = {
    # name: (T, D, F, E, K, kind)
    "ragged": (333, 256, 128, 8, 2, "uniform"),
    "hot_and_empty_experts": (517, 512, 256, 16, 4, "hot"),
    "all_on_one_expert": (300, 256, 128, 4, 1, "single"),
    "small_F": (129, 128, 64, 4, 2, "uniform"),
    "flat_variable_k": (211, 256, 128, 6, 3, "flat"),
    "unaligned_to_64": (97, 136, 72, 5, 2, "uniform"),
    "rank_receives_nothing": (0, 256, 128, 4, 2, "uniform"),
    "large_F": (1000, 512, 1024, 8, 2, "uniform"),
    # rows_multiple = 128: the dx GEMM takes its 128-row tile
    "whole_tile_rows": (768, 256, 128, 6, 2, "whole_tiles"),
}


@pytest.mark.parametrize("name", list(SMALL))
def test_cute_matches_float64(name):
    require_cute()
    _check(_case(*SMALL[name]))


@pytest.mark.parametrize("dtype,activation", [(torch.float16, "swiglu"), (torch.bfloat16, "geglu")])
def test_cute_dtypes_and_activations(dtype, activation):
    require_cute()
    _check(_case(257, 256, 128, 8, 2, dtype=dtype, activation=activation, seed=1))


BENCH = {
    "fine_grained_7B": (24576, 1536, 256, 128, 8),
    "olmoe_7B": (32768, 2048, 1024, 64, 8),
}


@pytest.mark.parametrize("name", list(BENCH))
def test_cute_benchmark_shapes(name):
    require_cute()
    _check(_case(*BENCH[name], seed=2))


def test_cute_bitwise_deterministic():
    require_cute()
    args = _case(4096, 512, 256, 32, 4, kind="hot", seed=3)
    a = _run("cute", *args)
    b = _run("cute", *args)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_reserve_sms_same_bits():
    """The layer inside ``reserve_sms`` gives the same bits (its default-epilogue GEMMs on fewer clusters)."""
    require_cute()
    from sonic_megatron.kernels.cute.ops import reserve_sms

    args = _case(4096, 512, 256, 32, 4, kind="hot", seed=4)
    a = _run("cute", *args)
    with reserve_sms(40):
        b = _run("cute", *args)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    with pytest.raises(ValueError, match="reserve_sms"), reserve_sms(-1):
        pass


def _quack_and_adapter_calls(gemm, config, rows, E, F, D, gen):
    """(QuACK's own call, ours through quack_adapter with ``reserved`` SMs left free) of one GEMM of the backend at
    ``rows`` routed rows over E experts, each filling fresh outputs and returning them."""
    from quack import gemm_interface as qgemm
    from sonic_megatron.kernels.cute import quack_adapter

    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    counts = torch.randint(0, 2 * rows // E, (E,), generator=gen, device="cuda")
    cu = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
    cu[1:] = counts.cumsum(0)
    R, T = int(cu[-1]), rows
    idx = torch.randint(0, T, (R,), generator=gen, device="cuda", dtype=torch.int32)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, **bf16) * scale

    def empty(*shape, dtype=torch.bfloat16):
        return torch.full(shape, float("nan"), device="cuda", dtype=dtype)

    if gemm in ("down", "dx", "dw2"):
        if gemm == "down":  # A [R, F] x W2_e^T, varlen-M
            A, B = randn(R, F), randn(E, D, F, scale=F**-0.5).permute(0, 2, 1)
            shape, kw = (R, D), (cu, None, None, None)
        elif gemm == "dx":  # dH [R, 2F] x W1_e through the concatenated layout, varlen-M
            A, B, shape, kw = randn(R, 2 * F), randn(E, 2 * F, D, scale=F**-0.5), (R, D), (cu, None, None, ("B",))
        else:  # dO^T gathered along K x A', varlen-K
            A, B, shape, kw = randn(T, D).t(), randn(R, F), (E, D, F), (None, cu, idx, None)
        names = ("cu_seqlens_m", "cu_seqlens_k", "A_idx", "concat_layout")

        def quack():
            out = empty(*shape)
            qgemm.gemm_tuned.fn(A, B, out, dynamic_scheduler=False, config=config, **dict(zip(names, kw, strict=True)))
            return (out,)

        def ours(reserved):
            out = empty(*shape)
            quack_adapter.gemm(config, False, A, B, out, *kw, False, reserved=reserved)
            return (out,)

    elif gemm == "up":  # X rows gathered x W1_e (concatenated [gate ; up]), SwiGLU epilogue
        x, B = randn(T, D), randn(E, 2 * F, D, scale=D**-0.5).permute(0, 2, 1)

        def quack():
            h, a = empty(R, 2 * F), empty(R, F)
            qgemm.gemm_gated(x, B, preact_out=h, postact_out=a, activation="swiglu", cu_seqlens_m=cu, A_idx=idx,
                             store_preact=True, dynamic_scheduler=False, tuned=False, config=config,
                             concat_layout=("B",))  # fmt: skip
            return h, a

        def ours(reserved):
            h, a = empty(R, 2 * F), empty(R, F)
            quack_adapter.gemm_gated(config, False, x, B, h, a, "swiglu", cu, idx, reserved=reserved)
            return h, a

    else:  # "dh": dO rows gathered x W2_e, dSwiGLU epilogue with the scores, dS per row
        dO, w2, h = randn(T, D), randn(E, D, F, scale=F**-0.5), randn(R, 2 * F)
        s = torch.rand(R, generator=gen, device="cuda")

        def quack():
            dh, a = empty(R, 2 * F), empty(R, F)
            ds = qgemm.gemm_dgated(dO, w2, h, activation="swiglu", dx_out=dh, postact_out=a, colvec_scale=s,
                                   colvec_reduce=True, cu_seqlens_m=cu, A_idx=idx, dynamic_scheduler=False,
                                   tuned=False, config=config)[2]  # fmt: skip
            return dh, a, ds

        def ours(reserved):
            dh, a = empty(R, 2 * F), empty(R, F)
            ds = quack_adapter.gemm_dgated(config, False, dO, w2, h, dh, a, s, "swiglu", cu, idx, reserved=reserved)
            return dh, a, ds

    return quack, ours


@pytest.mark.parametrize("gemm", ["up", "down", "dh", "dx", "dw2"])
def test_replayed_plans_equal_quacks_own_call(gemm):
    """``quack_adapter`` launches QuACK's plan of a signature's first call at later calls (``replay_plan``,
    ``run_gemm_epi_plan``) at other sizes and, with ``reserved``, on fewer clusters: bitwise QuACK's own call
    (``gemm_tuned.fn``, ``gemm_gated``, ``gemm_dgated``) at each size. Fails when QuACK changes those entries or
    what its plans hold."""
    require_cute()
    from sonic_megatron.kernels.cute import quack_adapter
    from sonic_megatron.kernels.cute.configs import heuristic_config

    E, F, D = 8, 256, 512
    gen = torch.Generator(device="cuda").manual_seed(9)
    config = heuristic_config(gemm, F, D)
    for rows in (1000, 4096, 333):  # the first records; the others replay
        quack, ours = _quack_and_adapter_calls(gemm, config, rows, E, F, D, gen)
        want = quack()
        for reserved in (0, 40):
            for w, g in zip(want, ours(reserved), strict=True):
                assert torch.equal(g, w), (gemm, rows, reserved)
    plans = {**quack_adapter._DECIDED, **quack_adapter._EPI_PLANS}
    assert any(config in k for k in plans), "the first call's plan was not kept"


@pytest.mark.parametrize("where", ["past_reservation", "every_launch"])
def test_dynamic_tile_scheduler_gives_the_same_bits(where, monkeypatch):
    """QuACK's dynamic persistent tile scheduler (CTAs take tiles from an atomic counter) in the launches past
    the reserved ones of ``reserve_sms(n, gemms=k)`` (``ops._dynamic``; here the forward's down GEMM, the
    reservation covers the forward only), or, test-only, in every launch (all six GEMM kinds). Output and every
    gradient equal the static scheduler's bitwise, at the first call and the later ones (QuACK allocates a fresh
    counter per launch: a stale one would skip tiles)."""
    require_cute()
    from sonic_megatron.kernels.cute import ops

    counters = []
    dynamic = ops._dynamic

    def counted():
        d = dynamic()
        if d:
            counters.append(1)
        return d

    monkeypatch.setattr(ops, "_dynamic", counted)
    for T, kind in ((4096, "hot"), (3001, "uniform")):
        args = _case(T, 512, 256, 32, 4, kind=kind, seed=7)
        want = _run("cute", *args)  # no reservation: the static scheduler everywhere
        assert not counters
        with monkeypatch.context() as patch:
            if where == "every_launch":
                patch.setattr(ops, "_dynamic", lambda: counters.append(1) or True)
            for _ in range(3):  # first: QuACK builds its launch plan, then replays it
                got = _run("cute", *args, forward_ctx=lambda: ops.reserve_sms(16, gemms=1))
                for name in want:
                    assert torch.equal(want[name], got[name]), (where, T, name)
        assert len(counters) == 3 * (6 if where == "every_launch" else 1), len(counters)
        counters.clear()


@pytest.mark.parametrize("tuning", ["default", "heuristic_with_tiles"])
def test_other_tunings_match_float64(tuning):
    """``KernelOptions`` set in code: QuACK's untuned default config (its public interface), and the heuristic
    with a tile override (``SONIC_MEGATRON_CUTE_TILES``'s form) for two GEMMs."""
    require_cute()
    from sonic_megatron.kernels.options import kernel_options, set_kernel_options

    before = kernel_options()
    if tuning == "default":
        set_kernel_options(dataclasses.replace(before, tuning="default"))
    else:
        set_kernel_options(dataclasses.replace(before, tuning="heuristic", tiles="dx=C128x128c21,dw2=P128x128"))
    try:
        _check(_case(333, 256, 128, 8, 2, seed=8))
    finally:
        set_kernel_options(before)


def test_triton_metadata_matches_torch_on_gpu():
    require_cute()
    from sonic_megatron.kernels.routing import TopKRouting, compute_metadata_torch, flatten_routing
    from sonic_megatron.kernels.triton import compute_metadata_topk_triton, compute_metadata_triton

    gen = torch.Generator().manual_seed(4)
    for kind, T, E, K in (("uniform", 32768, 128, 8), ("hot", 5000, 64, 4), ("flat", 3000, 16, 4)):
        routing = _routing(kind, T, E, K, gen)
        tok, ex, _, off = flatten_routing(routing)
        want = compute_metadata_torch(tok, ex, off, E)
        got = [compute_metadata_triton(tok, ex, off, E)]
        if isinstance(routing, TopKRouting):  # the top-K path (token = pair // K, no flat token index)
            got.append(compute_metadata_topk_triton(routing.indices_TK, E))
            assert got[-1].pairs_per_token == K
        for meta in got:
            for a, b in zip(meta.tensors(), want.tensors(), strict=True):
                assert torch.equal(a, b), kind


def test_cute_rejects_unsupported_inputs():
    require_cute()
    x, routing, w1, w2, *_ = _case(64, 256, 128, 4, 2)
    cases = [
        ((x, routing, w1, w2), {}, "x.dtype"),  # fp32
        ((x.bfloat16()[:, :100], routing, w1.bfloat16()[:, :, :100], w2.bfloat16()[:, :100]), {}, "hidden size D"),
        ((x.bfloat16(), routing, w1.bfloat16()[:, :128].contiguous(), w2.bfloat16()), {"activation": "relu2"}, "gated"),
        ((x.bfloat16(), routing, w1.bfloat16().transpose(1, 2).contiguous().transpose(1, 2), w2.bfloat16()), {}, "w1"),
    ]
    for args, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            moe_experts(*args, backend="cute", **kw)


@pytest.mark.parametrize("accumulate", [True, False])
@pytest.mark.parametrize("name", ["ragged", "hot_and_empty_experts", "rank_receives_nothing"])
def test_cute_weight_grads_added_into_fp32_out(name, accumulate):
    """``compute(out=(acc1, acc2))`` (Megatron's fused main_grad path, chunked EP backward): the GEMMs add dW1/dW2
    into fp32 accumulators in their epilogue, or store them there with ``accumulate=False`` (the first micro-batch
    after DDP zeroed its buffers). vs float64: acc0 + dW_ref (dW_ref when storing), within 2x the torch backend
    doing the same in bf16 (+ atol); experts without rows leave their accumulator bits untouched when adding and
    get zeros when storing; two runs bitwise equal."""
    require_cute()
    x, routing, w1, w2, dO, dtype, act = _case(*SMALL[name])
    ref = _run("reference", x, routing, w1, w2, dO, torch.float64, act)
    gen = torch.Generator().manual_seed(11)
    acc0 = (torch.randn(w1.shape, generator=gen).cuda(), torch.randn(w2.shape, generator=gen).cuda())

    def fused(backend):
        acc = tuple(a.clone() for a in acc0)
        xl, r, _, w1l, w2l = _leaves(x, routing, w1, w2, dtype)

        def hook(compute):
            compute(out=acc, accumulate=accumulate)
            return None, None

        if backend == "cute":
            _poison()
        out = moe_experts(xl, r, w1l, w2l, activation=act, backend=backend, weight_grad_hook=hook)
        if out.requires_grad:
            out.backward(dO.to(dtype))
        return acc

    got, again, base = fused("cute"), fused("cute"), fused("torch")
    used = torch.zeros(w1.shape[0], dtype=torch.bool)
    if isinstance(routing, TopKRouting) and x.shape[0]:
        used[routing.indices_TK.reshape(-1).unique().cpu()] = True
    for k, rname in enumerate(("dw1", "dw2")):
        r = acc0[k].double() + ref[rname] if accumulate else ref[rname]
        assert got[k].dtype == torch.float32 and torch.equal(got[k], again[k]), rname
        err = (got[k].double() - r).abs().max().item()
        base_err = (base[k].double() - r).abs().max().item()
        atol = torch.finfo(dtype).eps / 2 * ref[rname].abs().max().item()
        assert err <= 2 * base_err + atol, f"{rname}: err {err:.3e} > 2 x torch {base_err:.3e} + atol {atol:.1e}"
        empty = got[k][~used.cuda()]
        expected = acc0[k][~used.cuda()] if accumulate else torch.zeros_like(empty)
        assert torch.equal(empty, expected), f"{rname}: an empty expert's buffer is wrong"
