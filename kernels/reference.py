"""Float64 per-expert-loop reference with plain autograd: the oracle of every backend's tests.
Deliberately naive (a Python loop over experts and pairs' index_add); never used for speed."""

from __future__ import annotations

import torch

from .activations import act_forward
from .routing import Routing, flatten_routing


def moe_experts_reference(
    x_TD: torch.Tensor,
    routing: Routing,
    w1_EGD: torch.Tensor,
    w2_EDF: torch.Tensor,
    activation: str = "swiglu",
) -> torch.Tensor:
    """O [T, D] in the inputs' dtype (call it with float64 leaves for the reference)."""
    token_idx_R, expert_idx_R, scores_R, _ = flatten_routing(routing)
    out_TD = torch.zeros_like(x_TD)
    for e in range(w1_EGD.shape[0]):
        sel = (expert_idx_R == e).nonzero().flatten()
        if sel.numel() == 0:
            continue
        tok = token_idx_R[sel].long()
        h = x_TD[tok] @ w1_EGD[e].t()
        y = act_forward(activation, h).to(x_TD.dtype) @ w2_EDF[e].t()
        out_TD = out_TD.index_add(0, tok, y * scores_R[sel].to(x_TD.dtype)[:, None])
    return out_TD
