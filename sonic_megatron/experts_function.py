"""Autograd for the experts inside Megatron: the same algorithm and cache as
``kernels.interface.MoEExpertsFunction`` (X, H, scores, int32 metadata), with the weight gradients routed
through a ``WeightGradSink`` (main_grad fusion, delayed wgrad for ``backward_dw``).

Shape legend: see ``kernels/routing.py`` (T tokens, D hidden, R routed pairs, E local experts, G = fc1 width).
"""

from __future__ import annotations

import torch

from .kernels import RoutingMetadata, compute_metadata, resolve_backend
from .kernels.interface import validate_inputs
from .kernels.routing import Routing
from .wgrad import WeightGradSink


class SonicExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, scores_R, w1_EGD, w2_EDF, ops, activation, sink, *meta_tensors):
        meta = RoutingMetadata(*meta_tensors)
        store_h = any(ctx.needs_input_grad[:4])
        o_TD, h_RG = ops.forward(x_TD, scores_R, w1_EGD, w2_EDF, meta, activation, store_h=store_h)
        ctx.ops, ctx.activation, ctx.sink = ops, activation, sink
        ctx.save_for_backward(x_TD, h_RG, scores_R, w1_EGD, w2_EDF, *meta_tensors)
        return o_TD

    @staticmethod
    def backward(ctx, dO_TD):
        x_TD, h_RG, scores_R, w1_EGD, w2_EDF, *meta_tensors = ctx.saved_tensors
        meta = RoutingMetadata(*meta_tensors)
        ops = ctx.ops
        dO_TD = dO_TD.contiguous()
        dx_TD, dscores_R, (aprime_RF, dH_RG) = ops.backward_data(
            dO_TD, x_TD, h_RG, scores_R, w1_EGD, w2_EDF, meta, ctx.activation
        )
        dw1 = dw2 = None
        if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:

            def weight_grads():
                return ops.backward_weights(dO_TD, x_TD, aprime_RF, dH_RG, meta)

            if ctx.sink is None:
                dw1, dw2 = weight_grads()
            else:
                dw1, dw2 = ctx.sink.grads_for_autograd(weight_grads)
        dscores_R = dscores_R.to(scores_R.dtype) if ctx.needs_input_grad[1] else None
        dx_TD = dx_TD if ctx.needs_input_grad[0] else None
        return (dx_TD, dscores_R, dw1, dw2, None, None, None) + (None,) * len(meta_tensors)


def sonic_experts(
    x_TD: torch.Tensor,
    routing: Routing,
    w1_EGD: torch.Tensor,
    w2_EDF: torch.Tensor,
    *,
    activation: str,
    backend: str,
    sink: WeightGradSink | None,
) -> torch.Tensor:
    """``kernels.moe_experts`` with weight gradients delivered through ``sink`` (None: plain autograd)."""
    validate_inputs(x_TD, routing, w1_EGD, w2_EDF, activation, None)
    ops = resolve_backend(backend, x_TD.device)
    scores_R, meta = compute_metadata(routing, w1_EGD.shape[0])
    return SonicExpertsFunction.apply(
        x_TD.contiguous(), scores_R, w1_EGD, w2_EDF, ops, activation, sink, *meta.tensors()
    )
