"""kernels/launch_cache.py on the CPU, against a QuACK-like fake: an entry point that reshapes its inputs and
launches a kernel that a compile-cache function returns. The cached launch must hand the kernel the same
arguments the entry point would (so the results are equal), and keep the entry point where it cannot."""

from __future__ import annotations

import sys
import types
from typing import NamedTuple

import pytest
import torch
from sonic_megatron.kernels.launch_cache import LaunchCache


class Epi(NamedTuple):
    out: torch.Tensor
    scale: float


class Sched(NamedTuple):
    clusters: int
    swizzle: int
    semaphore: int | None = None  # an address (QuACK's dynamic tile scheduler's counter)


def _make_fake(name: str) -> types.ModuleType:
    """A module with ``compile_kernel`` (the spied compile cache) and ``entry`` (QuACK-like: permutes, views,
    builds NamedTuples, launches). The kernel computes out = (A @ W^T) * scale from the views it gets."""
    mod = types.ModuleType(name)
    mod.launched = []  # (args) of every kernel launch

    def kernel(a_1MK, w_NK, out_view, epi, sched, idx, *rest):
        mod.launched.append((a_1MK, w_NK, out_view, epi, sched, idx, *rest))
        rows = a_1MK[0] if idx is None else a_1MK[0].index_select(0, idx)
        res = rows.double() @ w_NK.double().T * epi.scale
        epi.out.view(out_view.dtype).copy_(res.to(epi.out.dtype).view(out_view.dtype))

    def compile_kernel(*key):
        return kernel

    def entry(
        a_MK,
        w_KN,
        out_MN,
        idx=None,
        *,
        scale=2.0,
        clusters=8,
        extra=None,
        pointer=None,
        sched_tensor=None,
        sem=None,
        chain=None,
    ):
        a = a_MK.unsqueeze(0)
        w = w_KN.permute(1, 0)
        out_view = out_MN.view(torch.int16) if out_MN.dtype == torch.bfloat16 else out_MN
        fn = mod.compile_kernel(a.dtype, w.stride(), scale)
        sched = Sched(clusters, 8, None if sem is None else sem.data_ptr())
        args = [a, w, out_view, Epi(out_MN, scale), sched, idx]
        if extra is not None:  # a tensor the entry point allocates itself
            args[3] = Epi(torch.empty_like(out_MN), scale)
            fn(*args)
            out_MN.copy_(args[3].out)
            return
        if pointer is not None:  # a device pointer passed as an int
            args.append(pointer)
        if chain is not None:  # a view of several ops: dtype view (16-bit), leading unit dim, permutation
            view = out_MN.view(torch.int16) if out_MN.dtype == torch.bfloat16 else out_MN
            args.append(view.unsqueeze(0).permute(0, 2, 1))
        if sched_tensor is not None:  # a tensor inside the per-call NamedTuple (its builder keeps the rest)
            args[4] = Sched(clusters, a_MK)
        fn(*args)

    mod.compile_kernel = compile_kernel
    mod.entry = entry
    return mod


@pytest.fixture
def fake():
    name = "_fake_quack_for_launch_cache"
    mod = _make_fake(name)
    sys.modules[name] = mod
    yield mod
    del sys.modules[name]


def _cache(mod, calls=None):
    def sched_now(recorded, ctx):
        if calls is not None:
            calls.append(ctx)
        return recorded._replace(clusters=ctx)

    return LaunchCache(((mod.__name__, "compile_kernel"),), per_call={Sched: sched_now})


def _inputs(M, K=16, N=12, dtype=torch.float32, seed=0, idx=False):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g).to(dtype)
    w = torch.randn(K, N, generator=g).to(dtype)
    out = torch.full((M, N), float("nan"), dtype=dtype)
    i = torch.randint(0, M, (M,), generator=g) if idx else None
    return a, w, out, i


def _launch(cache, mod, a, w, out, i, ctx=8, **kw):
    site = ("site", tuple(sorted(kw)))
    return cache.launch(site, (a, w, out, i), lambda: mod.entry(a, w, out, i, clusters=ctx, **kw), ctx=ctx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_idx", [False, True])
@pytest.mark.parametrize("chain", [None, True])
def test_cached_launch_gives_the_entry_points_arguments(fake, dtype, with_idx, chain):
    """First call records, later calls (new tensors, other sizes) launch directly with equal arguments."""
    ctxs = []
    cache = _cache(fake, ctxs)
    kw = {} if chain is None else {"chain": chain}
    for step, M in enumerate((40, 40, 24, 64)):
        a, w, out, i = _inputs(M, dtype=dtype, seed=step, idx=with_idx)
        _launch(cache, fake, a, w, out, i, ctx=7 + step, **kw)
        got = fake.launched[-1]
        ref_out = torch.full_like(out, float("nan"))
        fake.entry(a, w, ref_out, i, clusters=7 + step, **kw)
        want = fake.launched[-1]
        assert torch.equal(out, ref_out), M
        for x, y in zip(got, want, strict=True):
            if isinstance(x, torch.Tensor):
                assert (x.dtype, x.shape, x.stride()) == (y.dtype, y.shape, y.stride()), M
                assert x.data_ptr() == (y.data_ptr() if y.data_ptr() != ref_out.data_ptr() else out.data_ptr())
            elif isinstance(x, Epi):
                assert x.out is out and x.scale == y.scale
            else:
                assert x == y, (M, x, y)
    assert cache.stats == {"fast": 3, "recorded": 1, "slow": 1}
    assert ctxs == [8, 9, 10]  # the per-call NamedTuple is rebuilt at every cached launch, with its ctx


def test_a_new_signature_records_again(fake):
    cache = _cache(fake)
    for dtype in (torch.float32, torch.bfloat16, torch.float32):
        a, w, out, i = _inputs(32, dtype=dtype)
        _launch(cache, fake, a, w, out, i)
    a, w, out, _ = _inputs(32)
    a_t = a.t().contiguous().t()  # same values, other strides: another signature
    _launch(cache, fake, a_t, w, out, None)
    assert cache.stats["recorded"] == 3 and cache.stats["fast"] == 1


def test_entry_point_allocations_and_pointers_are_never_cached(fake):
    for kw in ({"extra": True}, {"pointer": 2**40}, {"sched_tensor": True}):
        cache = _cache(fake)
        for seed in range(3):
            a, w, out, i = _inputs(20, seed=seed)
            _launch(cache, fake, a, w, out, i, **kw)
            assert torch.equal(out, (a.double() @ w.double() * 2.0).float()), kw
        assert cache.stats == {"fast": 0, "recorded": 0, "slow": 3}, kw


def test_per_call_namedtuple_with_an_address_is_rebuilt(fake):
    """An address inside a per-call NamedTuple (the dynamic scheduler's semaphore) does not keep QuACK's path:
    the builder replaces it at every call, so each cached launch gets that call's semaphore."""

    def sched_now(recorded, ctx):
        clusters, sem = ctx
        return recorded._replace(clusters=clusters, semaphore=sem.data_ptr())

    cache = LaunchCache(((fake.__name__, "compile_kernel"),), per_call={Sched: sched_now})
    for seed in range(3):
        a, w, out, i = _inputs(20, seed=seed)
        sem = torch.zeros(1, dtype=torch.int32)

        def entry(a=a, w=w, out=out, i=i, sem=sem):
            fake.entry(a, w, out, i, clusters=5, sem=sem)

        cache.launch("site", (a, w, out, i), entry, ctx=(5, sem))
        assert fake.launched[-1][4] == Sched(5, 8, sem.data_ptr()), seed
        assert torch.equal(out, (a.double() @ w.double() * 2.0).float())
    assert cache.stats == {"fast": 2, "recorded": 1, "slow": 1}


def test_aliased_or_ambiguous_inputs_are_recorded_later(fake):
    cache = _cache(fake)
    a, w, out, _ = _inputs(16, K=16, N=16)
    _launch(cache, fake, a, a, out, None)  # w aliases a: which input an argument came from is unknown
    assert cache.stats["recorded"] == 0
    a, w, out, _ = _inputs(16, K=16, N=16, seed=1)
    _launch(cache, fake, a, w, out, None)
    assert cache.stats["recorded"] == 1
    # K = 1, N = 1: the permuted w [N, K] is [1, 1] with equal strides, so two permutations fit
    cache = _cache(fake)
    a, w, out, _ = _inputs(8, K=1, N=1)
    _launch(cache, fake, a, w, out, None)
    assert cache.stats["recorded"] == 0 and cache.stats["slow"] == 1


def test_spy_is_removed_after_recording(fake):
    original = fake.compile_kernel
    cache = _cache(fake)
    a, w, out, i = _inputs(10)
    _launch(cache, fake, a, w, out, i)
    assert fake.compile_kernel is original
