"""The router's shared softmax (kernels/triton/shared_softmax.py): two outputs of one softmax whose gradients meet
in one fused backward, against float64 and against ``torch.softmax`` read twice; on CPU under TRITON_INTERPRET=1
(compiled on a GPU when present). Gradients from both readers or one, an expanded (stride-0) gradient, bf16
logits, the router's fused path with token rounding against TopKRouter's own."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from sonic_megatron.kernels.triton.shared_softmax import shared_softmax, shared_softmax_bwd  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _grads(T, E, seed):
    """An aux-loss-like gradient (one [E] row expanded over the tokens) and a sparse rounding-like one."""
    g = torch.Generator().manual_seed(seed)
    g_a = torch.randn(E, generator=g).expand(T, E)
    g_b = torch.zeros(T, E)
    hit = torch.rand(T, E, generator=g) < 0.05
    g_b[hit] = torch.randn(int(hit.sum()), generator=g)
    return g_a, g_b


def _expected64(logits, g_a, g_b):
    p = torch.softmax(logits.double(), -1)
    g = sum(x.double() for x in (g_a, g_b) if x is not None)
    return p * (g - (p * g).sum(-1, keepdim=True))


@pytest.mark.parametrize("which", ["both", "a", "b"])
@pytest.mark.parametrize("T,E", [(37, 12), (64, 256), (5, 130)])
def test_backward_within_twice_torch_error(which, T, E):
    torch.manual_seed(T + E)
    logits = torch.randn(T, E) * 3
    g_a, g_b = _grads(T, E, T * E)
    g_a = g_a if which in ("both", "a") else None
    g_b = g_b if which in ("both", "b") else None
    x = logits.to(DEVICE).requires_grad_()
    p_a, p_b = shared_softmax(x)
    assert p_b._base is p_a and torch.equal(p_a, torch.softmax(x.detach(), -1))
    outs = [(p, g.to(DEVICE)) for p, g in ((p_a, g_a), (p_b, g_b)) if g is not None]
    got = torch.autograd.grad([p for p, _ in outs], x, [g for _, g in outs])[0].cpu()
    # PyTorch in the same precision: one softmax read by both, autograd adds the gradients
    y = logits.clone().requires_grad_()
    q = torch.softmax(y, -1)
    ref = torch.autograd.grad([q] * len(outs), y, [g.cpu() for _, g in outs])[0]
    exact = _expected64(logits, g_a, g_b)
    err, err_ref = (got.double() - exact).abs().max(), (ref.double() - exact).abs().max()
    assert err <= 2 * err_ref + 1e-7 * exact.abs().max(), (err, err_ref)


def test_bf16_logits_and_no_gradient():
    x = torch.randn(9, 16, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    p_a, p_b = shared_softmax(x)
    assert p_a.dtype == torch.float32
    (d,) = torch.autograd.grad(p_b[:, 3].sum(), x)
    assert d.dtype == torch.bfloat16
    exact = _expected64(x.detach().float().cpu(), None, torch.zeros(9, 16).index_fill_(1, torch.tensor([3]), 1.0))
    assert (d.float().cpu().double() - exact).abs().max() < 1e-2
    # neither output reached a loss: no gradient to the logits
    p_a, p_b = shared_softmax(x)
    assert torch.autograd.grad(p_a.detach().sum() + x.sum(), x)[0].eq(1).all()


def test_bwd_wrapper_matches_the_expression_on_cpu():
    probs = torch.softmax(torch.randn(6, 10), -1)
    g_a, g_b = _grads(6, 10, 3)
    got = shared_softmax_bwd(probs, g_a, g_b, torch.float32)
    g = g_a + g_b
    assert torch.allclose(got, probs * (g - (probs * g).sum(-1, keepdim=True)), atol=1e-6)


def test_shared_softmax_rejects_non_2d():
    with pytest.raises(ValueError, match=r"logits must be 2-D \[T, E\], got shape \(2, 3, 4\)"):
        shared_softmax(torch.zeros(2, 3, 4))
