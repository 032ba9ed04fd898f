"""Micro-batch pairs of the experts' weight gradients (``kernels/weight_grad_pairs.py``, ``sonic_megatron/wgrad.py``):
the merged work's gradients equal the sum of the two micro-batches' (fp64, PyTorch backend; the Triton merge bit
for bit against its reference, on CPU under TRITON_INTERPRET=1), including padded rounded routings and empty
experts; and the sink under a Megatron-like schedule: held micro-batches, the last one never held, the finalize
hook running what is still held, nothing left behind and DDP's main_grad flags as Megatron expects."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sonic_megatron.kernels import FlatRouting, TopKRouting, torch_backend  # noqa: E402
from sonic_megatron.kernels.interface import compute_metadata  # noqa: E402
from sonic_megatron.kernels.weight_grad_pairs import WeightGradWork, merge_rows_torch  # noqa: E402

E, D, F = 5, 12, 6


def _work(T, K, seed, dtype=torch.float64, padded=False, empty_expert=None, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    if empty_expert is not None:
        logits[:, empty_expert] = -1e9
    idx = torch.topk(logits, K, dim=1).indices
    routing = TopKRouting(torch.rand(T, K, generator=g), idx)
    if padded:  # a flat routing with padding pairs past the real ones (as token rounding makes)
        pad = 7
        tok = torch.cat([torch.arange(T).repeat_interleave(K), torch.full((pad,), T)])
        exp = torch.cat([idx.reshape(-1), torch.full((pad,), E)])
        routing = FlatRouting(tok, exp, torch.rand(tok.numel(), generator=g), T, padded=True)
    _, meta = compute_metadata(routing, E)
    R = meta.num_rows
    t = [torch.randn(*s, generator=g, dtype=dtype) for s in ((T, D), (T, D), (R, F), (R, 2 * F))]
    meta = type(meta)(*(m.to(device) for m in meta.tensors()), pairs_per_token=meta.pairs_per_token)
    return WeightGradWork(torch_backend, *(x.to(device) for x in t), meta)


@pytest.mark.parametrize("padded", [False, True])
def test_merged_work_gives_the_sum_of_both_micro_batches(padded):
    a = _work(9, 2, 1, padded=padded, empty_expert=3)
    b = _work(13, 3, 2, padded=padded)
    merged = a.merged_with(b)
    got = merged()
    want = [x + y for x, y in zip(a(), b(), strict=True)]
    for u, v in zip(got, want, strict=True):
        torch.testing.assert_close(u, v, rtol=1e-12, atol=1e-12)
    # into main_grad-like buffers: stored, then added
    out = tuple(torch.full_like(w, 7.0) for w in want)
    merged(out=out, accumulate=False)
    merged(out=out, accumulate=True)
    for u, v in zip(out, want, strict=True):
        torch.testing.assert_close(u, 2 * v, rtol=1e-12, atol=1e-12)


def test_merge_kernel_equals_the_reference():
    try:
        from sonic_megatron.kernels.triton.wgrad_merge import merge_rows_triton
    except Exception as exc:  # pragma: no cover - depends on the triton build
        pytest.skip(f"triton kernels cannot be imported here: {exc}")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a = _work(40, 2, 3, dtype=torch.bfloat16, padded=True, empty_expert=0, device=dev)
    b = _work(30, 3, 4, dtype=torch.bfloat16, padded=True, device=dev)
    args = (a.dH_RG, a.aprime_RF, a.meta.x_gather_idx, a.meta.expert_offsets)
    args += (b.dH_RG, b.aprime_RF, b.meta.x_gather_idx, b.meta.expert_offsets, 40)
    for u, v in zip(merge_rows_triton(*args), merge_rows_torch(*args), strict=True):
        assert u.dtype == v.dtype and torch.equal(u, v)


def _megatron_like(num_micro, monkeypatch):
    """A sink whose params carry DDP's main_grad and flag, a config whose finalize function (Megatron's) runs the
    held work first (the hook the model builder installs), and the micro-batch count of Megatron's calculator."""
    from sonic_megatron import wgrad

    monkeypatch.setattr(wgrad, "_num_microbatches", lambda: num_micro)
    params = tuple(torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in ((E, 2 * F, D), (E, D, F)))
    for p in params:
        p.main_grad = torch.zeros_like(p)
        p.grad_added_to_main_grad = False
    finalized = []

    def finalize(*args, **kwargs):  # Megatron's finalize_model_grads reads the gradients
        finalized.append([p.main_grad.clone() for p in params])

    class Config:
        finalize_model_grads_func = None

    config = Config()
    wgrad.finalize_runs_held_weight_grads(config, finalize)
    sink = wgrad.WeightGradSink(params, delay=False, config=config, pair=True)
    return sink, params, config, finalized


@pytest.mark.parametrize("num_micro", [1, 2, 3, 4])
def test_sink_pairs_micro_batches_and_leaves_nothing_behind(num_micro, monkeypatch):
    sink, params, config, finalized = _megatron_like(num_micro, monkeypatch)
    for it in range(2):  # two iterations: the count restarts at finalize
        for p in params:
            p.main_grad.zero_()
            p.grad_added_to_main_grad = False
        works = [_work(8 + m, 2, 10 * it + m) for m in range(num_micro)]
        returned = [sink.grads_for_autograd(w) for w in works]
        held = [r[0] is None for r in returned]
        # micro-batches 0, 2, ... wait for the next one, the last never waits
        assert held == [m % 2 == 0 and m < num_micro - 1 for m in range(num_micro)]
        assert all(p.grad_added_to_main_grad for p in params)
        config.finalize_model_grads_func()
        want = [sum(parts) for parts in zip(*(w() for w in works), strict=True)]
        for got, v in zip(finalized[-1], want, strict=True):
            torch.testing.assert_close(got, v, rtol=1e-12, atol=1e-12)


def test_finalize_runs_work_left_held(monkeypatch):
    """A schedule that ends an iteration early (fewer backward calls than the calculator says): the finalize
    hook runs the held micro-batch before Megatron's own finalize reads the gradients."""
    sink, params, config, finalized = _megatron_like(4, monkeypatch)
    works = [_work(8, 2, m) for m in range(3)]
    assert [sink.grads_for_autograd(w)[0] is None for w in works] == [True, False, True]
    config.finalize_model_grads_func()
    want = [sum(parts) for parts in zip(*(w() for w in works), strict=True)]
    for got, v in zip(finalized[-1], want, strict=True):
        torch.testing.assert_close(got, v, rtol=1e-12, atol=1e-12)
    assert sink._held is None and sink._backwards == 0


def test_no_pairs_outside_megatron_schedules(monkeypatch):
    """Without a config (plain autograd, benchmarks), with a finalize function that does not run held work
    (a training loop that replaced the builder's hook) or without the option, nothing is held."""
    sink, params, config, _ = _megatron_like(4, monkeypatch)
    sink.config = None
    assert sink.grads_for_autograd(_work(8, 2, 0))[0] is not None
    hook = config.finalize_model_grads_func
    config.finalize_model_grads_func = hook.finalize
    sink.config = config
    assert sink.grads_for_autograd(_work(8, 2, 1))[0] is not None
    config.finalize_model_grads_func, sink.pair = hook, False
    assert sink.grads_for_autograd(_work(8, 2, 2))[0] is not None


def test_finalize_hook_is_installed_once():
    """The builder's hook wraps the finalize function it finds (Megatron's when there is none), is kept when
    installed again, and stays the same object in a copied config."""
    import copy

    from megatron.core.distributed import finalize_model_grads

    from sonic_megatron import wgrad

    class Config:
        finalize_model_grads_func = None

    config = Config()
    hook = wgrad.finalize_runs_held_weight_grads(config)
    assert config.finalize_model_grads_func is hook and hook.finalize is finalize_model_grads
    assert wgrad.finalize_runs_held_weight_grads(config) is hook
    assert copy.deepcopy(config).finalize_model_grads_func is hook
    own = Config()
    own.finalize_model_grads_func = print
    assert wgrad.finalize_runs_held_weight_grads(own).finalize is print


def test_no_pairs_while_a_cuda_graph_is_captured(monkeypatch):
    """A captured backward replays one choice for every micro-batch: while capturing, each backward computes its
    own, and a capture that begins while work is held is refused, naming the option."""
    from types import SimpleNamespace

    sink, params, config, _ = _megatron_like(4, monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    cuda_work = SimpleNamespace(x_TD=SimpleNamespace(is_cuda=True), merged_with=None)
    assert not sink._pairs_here(cuda_work)
    sink._held = _work(8, 2, 0)
    with pytest.raises(RuntimeError, match="pair_weight_grads=False"):
        sink._pairs_here(cuda_work)
