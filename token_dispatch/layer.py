"""``expert_parallel_experts``: the whole expert-parallel MoE experts block as ONE autograd node, pipelined.

A thin front-end over ``engine.py``: plan (route, round), then the engine's forward in the autograd node's
forward and its backward in the node's backward. Per token chunk, the dispatch of chunk i+1 and the combine of
chunk i-1 are in flight while chunk i computes; in backward each stage's weight-gradient GEMMs run while its dX / dS
all-to-alls travel. Shape legend: see ``send_side.py`` and ``plan.py``.
"""

from __future__ import annotations

import dataclasses

import torch

from ..kernels.routing import FlatRouting, TopKRouting
from . import engine as G
from .options import EPOptions, parse_options
from .plan import PlanInputs


class _EPExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, scores_R, w1, w2, plan, ops, options):
        free = G.free_sms(plan, options)
        store_h = any(ctx.needs_input_grad[:4])
        out_TD, saved = G.forward(x_TD, w1, w2, plan, ops, options, free=free, store_h=store_h)
        ctx.plan, ctx.ops, ctx.options = plan, ops, options
        ctx.saved = dataclasses.replace(saved, x=None, s_recv=None, hs=[])  # tensors go through save_for_backward
        ctx.scores_like = (scores_R.shape, scores_R.dtype)
        ctx.save_for_backward(saved.x, saved.s_recv, w1, w2, *saved.hs)
        return out_TD

    @staticmethod
    def backward(ctx, grad_TD):
        x_saved, s_recv, w1, w2, *hs = ctx.saved_tensors
        saved = dataclasses.replace(ctx.saved, x=x_saved, s_recv=s_recv, hs=hs)
        need = ctx.needs_input_grad
        want = (need[0], need[1], need[2] or need[3])
        dx_TD, ds_R, dw1, dw2 = G.backward(
            grad_TD, saved, w1, w2, ctx.plan, ctx.ops, ctx.options, want, ctx.scores_like
        )
        return dx_TD, ds_R, dw1, dw2, None, None, None


def expert_parallel_experts(
    x_TD: torch.Tensor,
    routing: TopKRouting | FlatRouting,
    w1_EGD: torch.Tensor,
    w2_EDF: torch.Tensor,
    *,
    group=None,
    num_experts: int,
    rounding_scores_TE: torch.Tensor | None = None,
    return_plan: bool = False,
    options: EPOptions | None = None,
    **option_kw,
):
    """MoE experts under expert parallelism: O[t] = sum over token t's pairs (t, e, s) of s * expert_e(x[t]),
    where expert e lives on rank e // (E/P). Returns O [T, D] for this rank's tokens (and the plan with
    ``return_plan``). Gradients reach x, the routing scores (and ``rounding_scores_TE`` for added pairs),
    w1 and w2 (unless ``options.wgrad`` defers the latter).

    Args:
        x_TD: this rank's tokens [T, D] (T may differ between ranks, and may be 0).
        routing: ``TopKRouting`` / ``FlatRouting`` over GLOBAL expert ids [0, E).
        w1_EGD, w2_EDF: this rank's E/P local experts (global ids rank*E/P ...), kernels/ layout.
        group: EP process group (NCCL or gloo); ``None`` or size 1: no communication.
        num_experts: E, a multiple of the group size.
        rounding_scores_TE: dense router probabilities [T, E]; required with ``options.rounding``.
        return_plan: also return the ``EPPlan`` (split sizes, rounding decision; for tests and benchmarks).
        options, option_kw: ``EPOptions`` (keywords override its fields): activation, backend, rounding,
            num_chunks (pipeline in N token chunks; each expert's M shrinks N-fold, so pick N by measurement),
            comm_sms (SMs the GEMMs leave free while a collective is in flight; the NCCL kernel needs one SM per
            channel, NCCL_MAX_NCHANNELS; ``bench layer --comm-sms``), redispatch_x_in_backward, wgrad (w1 and w2
            must then be leaf tensors). A bad option or input raises ``EPInputError`` on every rank of the group.
    """
    # Nothing raises on this rank alone before the plan: its errors ride in the plan's header (every rank raises).
    opts, error = parse_options("expert_parallel_experts", options, option_kw)
    if error is None and opts.wgrad is not None and not all(getattr(w, "is_leaf", True) for w in (w1_EGD, w2_EDF)):
        error = "expert_parallel_experts: with wgrad, w1 and w2 must be leaf tensors (parameters)"
    inputs = PlanInputs(
        routing=routing,
        num_experts=num_experts,
        group=group,
        rounding_scores_TE=rounding_scores_TE,
        x_TD=x_TD,
        w1_EGD=w1_EGD,
        w2_EDF=w2_EDF,
    )
    plan = G.plan_call(inputs, opts, options_error=error)
    ops = G.experts_ops(opts, x_TD.device)  # the plan resolved it on this device already (its local check)
    out = _EPExperts.apply(x_TD.contiguous(), plan.scores_R, w1_EGD, w2_EDF, plan, ops, opts)
    return (out, plan) if return_plan else out
