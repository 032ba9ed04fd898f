"""kernels/activations.py against torch.nn.functional with autograd, in float64. The float64 reference
(kernels/reference.py) shares act_forward with the backends, so this is the check that the shared
activation math itself is right. Gated layout: H = [gate | up] (Megatron's concatenation)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as nnf
from sonic_megatron.kernels.activations import ACTIVATIONS, act_forward, act_forward_backward, is_gated

R, F = 33, 7


def torch_activation(activation: str, h: torch.Tensor) -> torch.Tensor:
    """The same activations written with torch.nn.functional (independent of kernels/)."""
    if is_gated(activation):
        n = h.shape[-1] // 2
        g, u = h[..., :n], h[..., n:]
        gate = nnf.silu(g) if activation == "swiglu" else nnf.gelu(g, approximate="tanh")
        return gate * u
    if activation == "relu2":
        return nnf.relu(h) ** 2
    return nnf.gelu(h, approximate="tanh")


def _h(activation: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    h = 3 * torch.randn(R, 2 * F if is_gated(activation) else F, generator=g, dtype=torch.float64)
    h[0, 0] = 0.0  # relu2's kink and gelu/silu at 0
    return h


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_forward_and_backward_match_torch(activation):
    h = _h(activation, 81).requires_grad_()
    dA = torch.randn(R, F, generator=torch.Generator().manual_seed(82), dtype=torch.float64)
    expected_a = torch_activation(activation, h)
    (expected_dh,) = torch.autograd.grad(expected_a, h, dA)
    a = act_forward(activation, h.detach())
    a2, dh = act_forward_backward(activation, h.detach(), dA)
    assert a.dtype == a2.dtype == dh.dtype == torch.float64
    torch.testing.assert_close(a, expected_a.detach(), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(a2, a, rtol=0, atol=0)
    torch.testing.assert_close(dh, expected_dh, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_low_precision_input_computes_in_fp32(dtype):
    h = _h("swiglu", 83).to(dtype)
    a = act_forward("swiglu", h)
    a_bwd, dh = act_forward_backward("swiglu", h, torch.ones(R, F, dtype=dtype))
    assert a.dtype == a_bwd.dtype == dh.dtype == torch.float32
    torch.testing.assert_close(a, torch_activation("swiglu", h.double()).float(), rtol=1e-6, atol=1e-6)


def test_gate_is_the_first_half():
    h = _h("swiglu", 84)
    swapped = torch.cat([h[:, F:], h[:, :F]], dim=1)
    assert not torch.allclose(act_forward("swiglu", h), act_forward("swiglu", swapped))


@pytest.mark.parametrize("fn", [act_forward, lambda a, h: act_forward_backward(a, h, h)])
def test_unknown_activation(fn):
    with pytest.raises(ValueError, match="activation must be one of .*got 'swish'"):
        fn("swish", torch.ones(2, 2))
