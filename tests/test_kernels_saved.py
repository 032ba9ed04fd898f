"""What the experts engine keeps for backward: exactly X, H, the routing scores and the int32 metadata
(plus the weight parameters), recorded with torch.autograd.graph.saved_tensors_hooks. Nothing of size
R x D (gathered X, Y, gathered dO) or R x F (A) is saved; inference keeps no H at all.

Sizes: T=37, D=24, F=10 (D != F, D != 2F), E=5, K=2, R=74, so that no two kinds of tensor share a numel.
"""

from __future__ import annotations

import pytest
import torch
from sonic_megatron.kernels import ACTIVATIONS, GATED_ACTIVATIONS, compute_metadata, torch_backend
from test_kernels_helpers import flat_problem, mask_variable, ours, topk_problem

T, D, F, E, K = 37, 24, 10, 5, 2


def _problem(kind: str, activation: str):
    if kind == "topk":
        return topk_problem(T, D, F, E, K, activation=activation, seed=51)
    return flat_problem(mask_variable(T, E, seed=52), D, F, activation=activation, seed=52)


def _leaves(p, dtype):
    x = p.x_TD.to(dtype).requires_grad_()
    s = p.scores.float().requires_grad_()  # fp32 router probabilities, as Megatron passes them
    w1 = p.w1_EGD.to(dtype).requires_grad_()
    w2 = p.w2_EDF.to(dtype).requires_grad_()
    return x, s, w1, w2


def _record_saved(fn):
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("kind", ["topk", "flat"])
def test_saved_set_is_exactly_x_h_scores_metadata(kind, activation):
    dtype = torch.bfloat16
    p = _problem(kind, activation)
    x, s, w1, w2 = _leaves(p, dtype)
    routing = p.routing(s)
    out, saved = _record_saved(lambda: ours(x, routing, w1, w2, activation))
    _, meta = compute_metadata(routing, E)
    R, G = meta.num_rows, w1.shape[1]
    assert R > T, "the problem must route more pairs than tokens"

    # Match every saved tensor to one expected tensor; leftovers on either side fail.
    remaining = list(saved)

    def take(what: str, pred) -> torch.Tensor:
        hits = [i for i, t in enumerate(remaining) if pred(t)]
        assert len(hits) == 1, f"{what}: {len(hits)} matching saved tensors among {_describe(remaining)}"
        return remaining.pop(hits[0])

    def same_memory(a):
        return lambda t: t.data_ptr() == a.data_ptr() and t.shape == a.reshape(t.shape).shape and t.dtype == a.dtype

    take("x", same_memory(x))
    take("w1", same_memory(w1))
    take("w2", same_memory(w2))
    take("scores (flat view of the router's tensor)", lambda t: t.data_ptr() == s.data_ptr() and t.numel() == R)
    for name, m in zip(meta.TENSOR_NAMES, meta.tensors(), strict=True):
        take(name, lambda t, m=m: t.dtype == torch.int32 and t.shape == m.shape and torch.equal(t, m))
    h = take("H", lambda t: t.shape == (R, G) and t.dtype == dtype)
    assert not remaining, f"unexpected saved tensors: {_describe(remaining)}"

    # H is the pre-activation of the gathered rows (not A, not a padded buffer).
    xg = x.detach().double()[meta.x_gather_idx.long()]
    expert_of_row = torch.repeat_interleave(torch.arange(E), torch.diff(meta.expert_offsets).long())
    h_expected = torch.einsum("rd,rgd->rg", xg, w1.detach().double()[expert_of_row])
    assert (h.double() - h_expected).abs().max() <= 2 * torch.finfo(dtype).eps * h_expected.abs().max()

    forbidden = {R * D: "R x D"} | ({R * F: "R x F"} if activation in GATED_ACTIVATIONS else {})
    for t in saved:
        assert t.numel() not in forbidden, f"saved a {forbidden[t.numel()]} tensor {tuple(t.shape)}"
    out.backward(torch.randn_like(out))  # the saved set suffices for backward
    assert all(t.grad is not None for t in (x, s, w1, w2))


def _describe(ts):
    return [f"{t.dtype} {tuple(t.shape)}" for t in ts]


def test_activation_bytes_formula():
    """Bytes kept besides the weights: 2TD + 2RG (bf16) + 4R (fp32 scores) + 4(E+1 + 3R + T+1)."""
    p = _problem("topk", "swiglu")
    x, s, w1, w2 = _leaves(p, torch.bfloat16)
    _, saved = _record_saved(lambda: ours(x, p.routing(s), w1, w2, "swiglu"))
    R, G = T * K, 2 * F
    kept = sum(t.numel() * t.element_size() for t in saved if t.data_ptr() not in (w1.data_ptr(), w2.data_ptr()))
    assert kept == 2 * T * D + 2 * R * G + 4 * R + 4 * (E + 1 + 3 * R + T + 1)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "no_input_requires_grad"])
def test_inference_keeps_no_h(monkeypatch, mode):
    p = _problem("topk", "swiglu")
    x, s, w1, w2 = _leaves(p, torch.float32)
    train_out = ours(x, p.routing(s), w1, w2, "swiglu").detach()
    calls = []
    forward = torch_backend.forward

    def spy(*args, **kwargs):
        o, h = forward(*args, **kwargs)
        calls.append((kwargs.get("store_h", True), h))
        return o, h

    monkeypatch.setattr(torch_backend, "forward", spy)
    if mode == "no_input_requires_grad":
        x, s, w1, w2 = (t.detach() for t in (x, s, w1, w2))
        ctx = torch.enable_grad()
    else:
        ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx:
        out, saved = _record_saved(lambda: ours(x, p.routing(s), w1, w2, "swiglu"))
    assert out.grad_fn is None and not saved
    assert calls == [(False, None)], "the backend must be told not to store H, and return none"
    assert torch.equal(out, train_out)


def test_training_stores_h(monkeypatch):
    """The spy above is meaningful: with grad the backend is asked for H."""
    p = _problem("topk", "swiglu")
    x, s, w1, w2 = _leaves(p, torch.float32)
    stored = []
    forward = torch_backend.forward
    monkeypatch.setattr(
        torch_backend, "forward", lambda *a, **k: stored.append(k.get("store_h", True)) or forward(*a, **k)
    )
    ours(x, p.routing(s), w1, w2, "swiglu")
    assert stored == [True]


def test_metadata_names_follow_its_tensors():
    from sonic_megatron.kernels import RoutingMetadata

    meta = RoutingMetadata(*(torch.full((1,), i, dtype=torch.int32) for i in range(5)))
    assert [int(getattr(meta, n)) for n in meta.TENSOR_NAMES] == [int(t) for t in meta.tensors()] == list(range(5))
