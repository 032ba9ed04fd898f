"""Step-wise form for Megatron's method split: ``dispatch`` -> ``local_experts`` -> ``combine``, each its own
autograd node linked only through tensors. Shape legend: see ``plan.py``; one buffer holds all stages (chunks,
or (chunk, source) exchanges with ``by_source``) in receive order, so the step-wise form runs every stage's
all-to-all at once (no pipelining: that is ``expert_parallel_experts``' job). Weight gradients of
``local_experts`` run right after dX is computed; ``wgrad=`` defers them to ``DeferredWeightGrad.compute()``.
"""

from __future__ import annotations

import contextlib

import torch

from ..kernels.interface import resolve_backend
from ..kernels.routing import RoutingMetadata
from . import exchange as X
from .comm import Pending
from .plan import EPPlan
from .validation import check_comm_sms
from .wgrad import DeferredWeightGrad


def _all_rows(plan: EPPlan, send_SD: torch.Tensor) -> torch.Tensor:
    recv_UD = send_SD.new_empty(plan.num_recv_rows, send_SD.shape[1])
    pending = Pending()
    for i in range(plan.num_stages):
        X.rows_to_experts(plan, send_SD, X.recv_rows(plan, recv_UD, i), i, pending)
    pending.wait()
    return recv_UD


def _all_rows_back(plan: EPPlan, recv_UD: torch.Tensor) -> torch.Tensor:
    send_SD = recv_UD.new_empty(plan.num_send_rows, recv_UD.shape[1])
    pending = Pending()
    for i in range(plan.num_stages):
        X.rows_to_sources(plan, X.recv_rows(plan, recv_UD, i), send_SD, i, pending)
    pending.wait()
    return send_SD


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, scores_R, plan):
        ctx.plan, ctx.scores_like = plan, (scores_R.shape, scores_R.dtype, scores_R.device)
        recv_UD = _all_rows(plan, X.gather_send_rows(plan, x_TD.contiguous()))
        return recv_UD, plan.recv_scores()  # the scores came with the plan's pair all-to-alls

    @staticmethod
    def backward(ctx, dx_recv, ds_recv):
        plan = ctx.plan
        shape, dtype, device = ctx.scores_like
        dx_TD = ds_R = None
        if ctx.needs_input_grad[0]:
            dx_TD = X.sum_rows_per_token(plan, _all_rows_back(plan, dx_recv.contiguous()))
        if ctx.needs_input_grad[1]:
            ds_recv = ds_recv.contiguous()
            ds_send = ds_recv.new_empty(sum(map(sum, plan.send_pairs)))
            pending = Pending()
            for i in range(plan.num_stages):
                X.pairs_to_sources(plan, X.recv_pairs(plan, ds_recv, i), ds_send, i, pending)
            pending.wait()
            ds_R = X.scatter_pair_grads(plan, ds_send, torch.empty(shape, dtype=dtype, device=device))
        return dx_TD, ds_R, None


class _LocalExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_UD, s_Q, w1, w2, plan, ops, activation, wgrad, comm_sms):
        store_h = any(ctx.needs_input_grad[:4])
        ys, hs = [], []
        for i in range(plan.num_stages):
            x_i, s_i, meta = X.recv_rows(plan, x_UD, i), X.recv_pairs(plan, s_Q, i), plan.recv_meta[i]
            with ops.reserve_sms(comm_sms, gemms=1):  # see local_experts
                o, h = ops.forward(x_i, s_i, w1, w2, meta, activation, store_h)
            ys.append(o)
            hs.append(h)
        ctx.plan, ctx.ops, ctx.activation, ctx.wgrad, ctx.comm_sms = plan, ops, activation, wgrad, comm_sms
        # Cached: the received (deduplicated) token rows, H per chunk, scores; never per-pair copies.
        ctx.save_for_backward(x_UD, s_Q, w1, w2, *hs)
        return _in_buffer_order(ys, plan.recv_row_range)

    @staticmethod
    def backward(ctx, dy_UD):
        x_UD, s_Q, w1, w2, *hs = ctx.saved_tensors
        plan, ops = ctx.plan, ctx.ops
        dy_UD = dy_UD.contiguous()
        dxs, dss = [], []
        want_w = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
        dws = None
        for i in range(plan.num_stages):
            dO, x, meta = X.recv_rows(plan, dy_UD, i), X.recv_rows(plan, x_UD, i), plan.recv_meta[i]
            s_i = X.recv_pairs(plan, s_Q, i)
            with ops.reserve_sms(ctx.comm_sms, gemms=1):
                dx, ds, (ap, dH) = ops.backward_data(dO, x, hs[i], s_i, w1, w2, meta, ctx.activation)
            dxs.append(dx)
            dss.append(ds)
            if want_w:
                dws = _weight_grads(ops, dO, x, ap, dH, meta, w1, w2, ctx.wgrad, dws, plan.num_stages, ctx.comm_sms)
        dw1, dw2 = _in_weight_dtype(dws, w1, w2)
        dx_UD = _in_buffer_order(dxs, plan.recv_row_range)
        ds_Q = _in_buffer_order(dss, plan.recv_pair_range).to(s_Q.dtype)
        return dx_UD, ds_Q, dw1, dw2, None, None, None, None, None


def _in_buffer_order(per_stage: list[torch.Tensor], stage_range) -> torch.Tensor:
    """One tensor of the stages' results in receive-buffer order: each stage's result goes to its range (by
    source, stages are not in buffer order: stage (c, k) holds source rank - k)."""
    if len(per_stage) == 1:
        return per_stage[0]
    out = per_stage[0].new_empty(sum(t.shape[0] for t in per_stage), *per_stage[0].shape[1:])
    for i, t in enumerate(per_stage):
        r0, r1 = stage_range(i)
        out[r0:r1] = t
    return out


def _weight_grads(
    ops, dO, x, ap, dH, meta: RoutingMetadata, w1, w2, wgrad: DeferredWeightGrad | None, acc, stages, comm_sms=0
):
    """Run (or defer) one stage's dW GEMMs. With one stage: returns its (dW1, dW2). With more: adds them
    into fp32 accumulators (``acc``, created at the first stage: zeros) inside the GEMMs and returns those;
    the caller rounds once at the end. ``comm_sms``: SMs the GEMMs leave free, also when deferred (they then
    run in Megatron's backward_dw, beside its all-to-alls)."""
    if wgrad is not None:

        def deferred(out=None):
            with ops.reserve_sms(comm_sms):
                return ops.backward_weights(dO, x, ap, dH, meta, out=out)

        wgrad.record(deferred, w1, w2)
        return None
    # comm_sms 0 opens no reservation, so one the caller holds (layer.py's) stays in force.
    with ops.reserve_sms(comm_sms) if comm_sms else contextlib.nullcontext():
        if stages == 1:
            return ops.backward_weights(dO, x, ap, dH, meta)
        if acc is None:
            ct = torch.promote_types(w1.dtype, torch.float32)
            acc = (torch.zeros(w1.shape, dtype=ct, device=w1.device), torch.zeros(w2.shape, dtype=ct, device=w2.device))
        return ops.backward_weights(dO, x, ap, dH, meta, out=acc)


def _in_weight_dtype(dws, w1, w2):
    """(dW1, dW2) in the weights' dtype (one rounding of the fp32 stage sums), or (None, None)."""
    if dws is None:
        return None, None
    return dws[0].to(w1.dtype), dws[1].to(w2.dtype)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_UD, plan):
        ctx.plan = plan
        return X.sum_rows_per_token(plan, _all_rows_back(plan, y_UD.contiguous()))

    @staticmethod
    def backward(ctx, grad_TD):
        plan = ctx.plan
        return _all_rows(plan, X.gather_send_rows(plan, grad_TD.contiguous())), None


def dispatch(x_TD: torch.Tensor, plan: EPPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Send each token once to every rank that holds one of its experts, with its pairs' scores.

    Returns (x_recv [U, D] rows ordered (chunk, source rank, token), scores_recv [Q] per received pair).
    Gradients return to ``x_TD`` and to ``plan.scores_R`` (hence to the routing scores)."""
    if x_TD.dim() != 2 or x_TD.shape[0] != plan.num_tokens:
        raise ValueError(f"dispatch: x must be [T = {plan.num_tokens}, D] (the plan's tokens), got {tuple(x_TD.shape)}")
    return _Dispatch.apply(x_TD, plan.scores_R, plan)


def local_experts(
    x_recv: torch.Tensor,
    scores_recv: torch.Tensor,
    w1_EGD: torch.Tensor,
    w2_EDF: torch.Tensor,
    plan: EPPlan,
    *,
    activation: str = "swiglu",
    backend: str = "auto",
    wgrad: DeferredWeightGrad | None = None,
    comm_sms: int = 0,
) -> torch.Tensor:
    """This rank's L experts on the received rows: y_recv [U, D], row u = sum over its local pairs of
    score * expert(x_recv[u]) (pre-reduced per received token, ready for ``combine``).

    Args:
        activation, backend: as ``sonic_megatron.kernels.moe_experts``.
        wgrad: defer the weight-gradient GEMMs to ``wgrad.compute()`` (Megatron's backward_dw).
        comm_sms: SMs left free for a collective that runs beside these GEMMs (Megatron's 1F1B EP overlap runs
            another micro-batch's all-to-all beside this node): in the first GEMM of the forward and of the
            backward-data call (later GEMMs get every SM, as ``ep_forward_backward``'s "auto" policy), and in the
            weight-gradient GEMMs. 0 = every SM (persistent GEMMs then keep NCCL's kernel waiting). Same bits.
    """
    if tuple(x_recv.shape[:1]) != (plan.num_recv_rows,) or tuple(scores_recv.shape) != (plan.num_recv_pairs,):
        raise ValueError(
            f"local_experts: x_recv must have {plan.num_recv_rows} rows and scores_recv {plan.num_recv_pairs} "
            f"entries (the plan's), got {tuple(x_recv.shape)} and {tuple(scores_recv.shape)}"
        )
    if w1_EGD.shape[0] != plan.num_local_experts:
        raise ValueError(f"local_experts: w1.shape[0] must be {plan.num_local_experts}, got {w1_EGD.shape[0]}")
    check_comm_sms(comm_sms, "local_experts")
    ops = resolve_backend(backend, x_recv.device)
    return _LocalExperts.apply(x_recv, scores_recv, w1_EGD, w2_EDF, plan, ops, activation, wgrad, comm_sms)


def combine(y_recv: torch.Tensor, plan: EPPlan) -> torch.Tensor:
    """Send each received row's result back to its source and sum per token in a fixed order: [T, D]."""
    if y_recv.dim() != 2 or y_recv.shape[0] != plan.num_recv_rows:
        raise ValueError(f"combine: y_recv must be [{plan.num_recv_rows}, D], got {tuple(y_recv.shape)}")
    return _Combine.apply(y_recv, plan)
