"""Step-wise front-end for Megatron's method split: ``dispatch`` -> ``local_experts`` -> ``combine``, each its own
autograd node linked only through tensors, built from the engine's pieces (``engine.py``). Shape legend: see
``send_side.py`` and ``plan.py``; one buffer holds all chunks in receive order, so the step-wise form runs every
chunk's all-to-all at once (no pipelining: that is ``expert_parallel_experts``' job). Weight gradients of
``local_experts`` run right after dX is computed; ``options.wgrad`` defers them to ``DeferredWeightGrad.compute()``.

Errors: every step runs between collectives, so nothing here may raise on one rank alone. The plan checks x, the
routing, the weights and the experts backend on every rank together when ``make_plan`` is given ``x_TD``,
``w1_EGD`` and ``w2_EDF`` (``sonic_megatron/modes.py`` gives them); the checks below only compare a step's tensors
with the plan's sizes, which hold on every rank when each step gets the previous step's output (the x and weights
the plan checked, the same options). A caller passing other tensors fails on its own rank, with its peers left
waiting in the next all-to-all.
"""

from __future__ import annotations

import torch

from ..kernels.weight_grad_pairs import WeightGradWork
from . import engine as G
from . import exchange as X
from .comm import Pending
from .options import EPOptions, resolve_options
from .plan import EPPlan


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, scores_R, plan):
        ctx.plan, ctx.scores_like = plan, (scores_R.shape, scores_R.dtype, scores_R.device)
        recv_UD = G.all_rows(plan, X.gather_send_rows(plan, x_TD.contiguous()))
        return recv_UD, plan.recv_scores()  # the scores came with the plan's pair all-to-alls

    @staticmethod
    def backward(ctx, dx_recv, ds_recv):
        plan = ctx.plan
        shape, dtype, device = ctx.scores_like
        dx_TD = ds_R = None
        if ctx.needs_input_grad[0]:
            dx_TD = X.sum_rows_per_token(plan, G.all_rows_back(plan, dx_recv.contiguous()))
        if ctx.needs_input_grad[1]:
            ds_recv = ds_recv.contiguous()
            ds_send = ds_recv.new_empty(sum(map(sum, plan.send_pairs)))
            pending = Pending()
            for i in range(plan.num_stages):
                X.pairs_to_sources(plan, X.recv_pairs(plan, ds_recv, i), ds_send, i, pending)
            pending.wait()
            ds_R = X.scatter_pair_grads(plan, ds_send, torch.empty(shape, dtype=dtype, device=device))
        return dx_TD, ds_R, None


def _concat(per_chunk: list[torch.Tensor]) -> torch.Tensor:
    """The chunks' results in receive-buffer order (the chunks' ranges follow each other)."""
    return per_chunk[0] if len(per_chunk) == 1 else torch.cat(per_chunk)


class _LocalExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_UD, s_Q, w1, w2, plan, ops, options):
        store_h = any(ctx.needs_input_grad[:4])
        ys, hs = [], []
        for i in range(plan.num_stages):
            x_i, s_i, meta = X.recv_rows(plan, x_UD, i), X.recv_pairs(plan, s_Q, i), plan.recv_meta[i]
            with ops.reserve_sms(options.comm_sms, gemms=1):  # see local_experts
                o, h = ops.forward(x_i, s_i, w1, w2, meta, options.activation, store_h)
            ys.append(o)
            hs.append(h)
        ctx.plan, ctx.ops, ctx.options = plan, ops, options
        # Cached: the received (deduplicated) token rows, H per chunk, scores; never per-pair copies.
        ctx.save_for_backward(x_UD, s_Q, w1, w2, *hs)
        return _concat(ys)

    @staticmethod
    def backward(ctx, dy_UD):
        x_UD, s_Q, w1, w2, *hs = ctx.saved_tensors
        plan, ops, o = ctx.plan, ctx.ops, ctx.options
        dy_UD = dy_UD.contiguous()
        dxs, dss = [], []
        want_w = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
        dws, works = None, []
        for i in range(plan.num_stages):
            dO, x, meta = X.recv_rows(plan, dy_UD, i), X.recv_rows(plan, x_UD, i), plan.recv_meta[i]
            s_i = X.recv_pairs(plan, s_Q, i)
            with ops.reserve_sms(o.comm_sms, gemms=1):
                dx, ds, (ap, dH) = ops.backward_data(dO, x, hs[i], s_i, w1, w2, meta, o.activation)
            dxs.append(dx)
            dss.append(ds)
            if want_w and o.weight_grad_hook is not None:
                works.append(WeightGradWork(ops, dO, x, ap, dH, meta))
            elif want_w:
                dws = G.weight_grads(ops, dO, x, ap, dH, meta, w1, w2, o.wgrad, dws, plan.num_stages, o.comm_sms)
        dw1, dw2 = G.in_weight_dtype(dws, w1, w2)
        if works:
            dw1, dw2 = G.hooked_weight_grads(ops, works, o.weight_grad_hook, o.comm_sms)
        dx_UD = _concat(dxs)
        ds_Q = _concat(dss).to(s_Q.dtype)
        return dx_UD, ds_Q, dw1, dw2, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_UD, plan):
        ctx.plan = plan
        return X.sum_rows_per_token(plan, G.all_rows_back(plan, y_UD.contiguous()))

    @staticmethod
    def backward(ctx, grad_TD):
        plan = ctx.plan
        return G.all_rows(plan, X.gather_send_rows(plan, grad_TD.contiguous())), None


def dispatch(x_TD: torch.Tensor, plan: EPPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Send each token once to every rank that holds one of its experts, with its pairs' scores.

    Returns (x_recv [U, D] rows ordered (chunk, source rank, token), scores_recv [Q] per received pair).
    Gradients return to ``x_TD`` and to ``plan.scores_R`` (hence to the routing scores)."""
    if x_TD.dim() != 2 or x_TD.shape[0] != plan.num_tokens:  # holds for the x the plan checked (module docstring)
        raise ValueError(f"dispatch: x must be [T = {plan.num_tokens}, D] (the plan's tokens), got {tuple(x_TD.shape)}")
    return _Dispatch.apply(x_TD, plan.scores_R, plan)


def local_experts(
    x_recv: torch.Tensor,
    scores_recv: torch.Tensor,
    w1_EGD: torch.Tensor,
    w2_EDF: torch.Tensor,
    plan: EPPlan,
    *,
    options: EPOptions | None = None,
    **option_kw,
) -> torch.Tensor:
    """This rank's L experts on the received rows: y_recv [U, D], row u = sum over its local pairs of
    score * expert(x_recv[u]) (pre-reduced per received token, ready for ``combine``).

    Options (``EPOptions``, or its fields as keywords) read here:
        activation, backend: as ``sonic_megatron.kernels.moe_experts``.
        wgrad: defer the weight-gradient GEMMs to ``wgrad.compute()`` (Megatron's backward_dw).
        comm_sms: SMs left free for a collective that runs beside these GEMMs (Megatron's 1F1B EP overlap runs
            another micro-batch's all-to-all beside this node): in the first GEMM of the forward and of the
            backward-data call (the NCCL kernel started beside it keeps its SMs; the later GEMMs take every SM,
            with the cute backend's dynamic tile scheduler, ``kernels/cute/ops.py``), and in the weight-gradient
            GEMMs. 0 = every SM (persistent GEMMs then keep NCCL's kernel waiting). Same bits.
    """
    # dispatch's outputs and the weights the plan checked pass these checks on every rank (module docstring)
    opts = resolve_options("local_experts", options, option_kw)
    if tuple(x_recv.shape[:1]) != (plan.num_recv_rows,) or tuple(scores_recv.shape) != (plan.num_recv_pairs,):
        raise ValueError(
            f"local_experts: x_recv must have {plan.num_recv_rows} rows and scores_recv {plan.num_recv_pairs} "
            f"entries (the plan's), got {tuple(x_recv.shape)} and {tuple(scores_recv.shape)}"
        )
    if w1_EGD.shape[0] != plan.num_local_experts:
        raise ValueError(f"local_experts: w1.shape[0] must be {plan.num_local_experts}, got {w1_EGD.shape[0]}")
    ops = G.experts_ops(opts, x_recv.device)  # resolved, its argument rules checked, by the plan given the weights
    return _LocalExperts.apply(x_recv, scores_recv, w1_EGD, w2_EDF, plan, ops, opts)


def combine(y_recv: torch.Tensor, plan: EPPlan) -> torch.Tensor:
    """Send each received row's result back to its source and sum per token in a fixed order: [T, D]."""
    if y_recv.dim() != 2 or y_recv.shape[0] != plan.num_recv_rows:  # holds for local_experts' output
        raise ValueError(f"combine: y_recv must be [{plan.num_recv_rows}, D], got {tuple(y_recv.shape)}")
    return _Combine.apply(y_recv, plan)
