"""Expert activations in PyTorch: forward A = act(H) and the backward dH from dA, recomputing from H.

Gated activations read H [R, 2F] in Megatron's concatenated layout, gate columns first ``[gate | up]``,
and give A [R, F]. Non-gated ones map H [R, F] to A [R, F]. Math runs in fp32; callers cast.

    swiglu  silu(g) * u                   (Megatron ``--swiglu``)
    geglu   gelu_tanh(g) * u              (tanh approximation, as QuACK's gated epilogue)
    relu2   relu(h)^2                     (non-gated, "squared ReLU")
    gelu    gelu_tanh(h)                  (non-gated, tanh approximation)
"""

from __future__ import annotations

import math

import torch

GATED_ACTIVATIONS = ("swiglu", "geglu")
ACTIVATIONS = GATED_ACTIVATIONS + ("relu2", "gelu")

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def is_gated(activation: str) -> bool:
    return activation in GATED_ACTIVATIONS


def _gelu_tanh_and_grad(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inner = _SQRT_2_OVER_PI * (x + 0.044715 * x**3)
    t = torch.tanh(inner)
    y = 0.5 * x * (1.0 + t)
    dinner = _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x**2)
    dy = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner
    return y, dy


def _silu_and_grad(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sig = torch.sigmoid(x)
    return x * sig, sig * (1.0 + x * (1.0 - sig))


def _gate_fn(activation: str, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if activation in ("swiglu",):
        return _silu_and_grad(g)
    return _gelu_tanh_and_grad(g)


def act_forward(activation: str, h: torch.Tensor) -> torch.Tensor:
    """A = act(H), computed in fp32 (or fp64 for fp64 input), returned in that compute dtype."""
    hc = h.to(torch.promote_types(h.dtype, torch.float32))
    if is_gated(activation):
        g, u = hc.chunk(2, dim=-1)
        return _gate_fn(activation, g)[0] * u
    if activation == "relu2":
        return torch.relu(hc).square()
    if activation == "gelu":
        return _gelu_tanh_and_grad(hc)[0]
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def act_forward_backward(activation: str, h: torch.Tensor, dA: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, dH) from H and dA, both in the compute dtype (fp32 or fp64)."""
    ct = torch.promote_types(h.dtype, torch.float32)
    hc, dAc = h.to(ct), dA.to(ct)
    if is_gated(activation):
        g, u = hc.chunk(2, dim=-1)
        act_g, dact_g = _gate_fn(activation, g)
        return act_g * u, torch.cat([dAc * u * dact_g, dAc * act_g], dim=-1)
    if activation == "relu2":
        r = torch.relu(hc)
        return r.square(), dAc * 2.0 * r
    if activation == "gelu":
        y, dy = _gelu_tanh_and_grad(hc)
        return y, dAc * dy
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
