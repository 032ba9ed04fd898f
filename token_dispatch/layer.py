"""``expert_parallel_experts``: the whole expert-parallel MoE experts block as ONE autograd node, pipelined.

Shape legend: see ``plan.py``. Forward, per chunk c (N = num_chunks):
    all dispatch all-to-alls are launched at once (async, in chunk order), then the receive metadata is
    built from the plan's pair all-to-alls (scores ride in them) while the rows travel; for each c: wait for
    chunk c's rows, run the local experts on it, launch its combine all-to-all; finally wait and sum.
    So the dispatch of chunk c+1 and the combine of chunk c-1 are in flight while chunk c computes.
Backward, per chunk c:
    all dO all-to-alls (and X's, with ``redispatch_x_in_backward``) are launched at once; for each c: wait
    for chunk c, dH/dS/dX~ (``backward_data``), launch the dX and dS all-to-alls back, THEN run chunk c's
    weight-gradient GEMMs (dW2, dW1) while those are in flight.
Async collectives need no private streams: NCCL orders each one after the current stream's queued work and
``wait()`` orders the current stream after it, so the schedule is race-free under repetition.
"""

from __future__ import annotations

import contextlib

import torch

from ..kernels.interface import resolve_backend
from ..kernels.routing import FlatRouting, TopKRouting
from . import exchange as X
from .comm import Pending
from .plan import EPPlan, make_plan
from .rounding import TokenRounding
from .stepwise import _weight_grads
from .wgrad import DeferredWeightGrad


def record_function(name: str):
    """A torch.profiler range while a profiler runs (bench layer --profile); otherwise nothing, because the
    layer is host-bound on GPUs and even an idle range costs a dispatcher call."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def _launch_rows(plan: EPPlan, x_TD: torch.Tensor, recv_UD: torch.Tensor, eager: bool) -> list:
    """Launch every chunk's row all-to-all, chunk by chunk: NCCL runs one group's collectives in launch order,
    so chunk c waits only for chunks <= c. Each chunk's send rows are gathered just before its launch, so
    chunk 0 leaves early."""
    send_SD = x_TD.new_empty(plan.num_send_rows, x_TD.shape[1])
    pend = [Pending(eager) for _ in range(plan.num_chunks)]
    for c in range(plan.num_chunks):
        s0, s1 = plan.send_row_range(c)
        torch.index_select(x_TD, 0, plan.send_token_idx_S[s0:s1], out=send_SD[s0:s1])
        X.rows_to_experts(plan, send_SD, X.recv_rows(plan, recv_UD, c), c, pend[c])
    return pend


class _EPExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, scores_R, w1, w2, plan, ops, activation, redispatch, wgrad, overlap):
        N, D, eager = plan.num_chunks, x_TD.shape[1], not overlap
        x_recv = x_TD.new_empty(plan.num_recv_rows, D)
        metas = plan.recv_meta if eager else None  # no overlap: the pair all-to-alls complete before the rows
        with record_function("ep.fwd.dispatch_launch"):
            pend_x = _launch_rows(plan, x_TD, x_recv, eager)
        # Receive metadata and scores (they came with the plan's pair all-to-alls, launched before the rows):
        # built while the row all-to-alls are in flight.
        with record_function("ep.fwd.recv_metadata"):
            metas = plan.recv_meta
            s_recv = plan.recv_scores()
        store_h = any(ctx.needs_input_grad[:4])
        y_send = x_TD.new_empty(plan.num_send_rows, D)
        pend_y, hs, keep = Pending(eager), [], []
        for c in range(N):
            pend_x[c].wait()  # chunk c's rows and scores
            with record_function(f"ep.fwd.experts[{c}]"):
                o, h = ops.forward(
                    X.recv_rows(plan, x_recv, c),
                    X.recv_pairs(plan, s_recv, c),
                    w1,
                    w2,
                    metas[c],
                    activation,
                    store_h,
                )
            X.rows_to_sources(plan, o, y_send, c, pend_y)
            keep.append(o)  # alive until its all-to-all completes
            hs.append(h)
        pend_y.wait()
        del keep
        with record_function("ep.fwd.combine_sum"):
            out_TD = X.sum_rows_per_token(plan, y_send)
        ctx.plan, ctx.ops, ctx.activation = plan, ops, activation
        ctx.redispatch, ctx.wgrad, ctx.eager = redispatch, wgrad, eager
        ctx.scores_meta = (scores_R.shape, scores_R.dtype)
        # Cache: received (deduplicated) token rows -- or only the local X with redispatch -- H, scores.
        ctx.save_for_backward(x_TD if redispatch else x_recv, s_recv, w1, w2, *hs)
        return out_TD

    @staticmethod
    def backward(ctx, grad_TD):
        x_saved, s_recv, w1, w2, *hs = ctx.saved_tensors
        plan, ops, N = ctx.plan, ctx.ops, ctx.plan.num_chunks
        grad_TD = grad_TD.contiguous()
        D = grad_TD.shape[1]
        dO_recv = grad_TD.new_empty(plan.num_recv_rows, D)
        eager = ctx.eager
        with record_function("ep.bwd.dispatch_launch"):
            pend_dO = _launch_rows(plan, grad_TD, dO_recv, eager)
            if ctx.redispatch:
                x_recv = x_saved.new_empty(plan.num_recv_rows, D)
                pend_x = _launch_rows(plan, x_saved, x_recv, eager)
            else:
                x_recv, pend_x = x_saved, [Pending() for _ in range(N)]
        dx_send = grad_TD.new_empty(plan.num_send_rows, D)
        ct = torch.promote_types(grad_TD.dtype, torch.float32)
        ds_send = torch.empty(sum(map(sum, plan.send_pairs)), dtype=ct, device=grad_TD.device)
        pend_back, keep = Pending(eager), []
        want_w = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
        dw1 = dw2 = None
        for c in range(N):
            pend_dO[c].wait()
            pend_x[c].wait()
            dO, x, meta = X.recv_rows(plan, dO_recv, c), X.recv_rows(plan, x_recv, c), plan.recv_meta[c]
            with record_function(f"ep.bwd.data[{c}]"):
                dx, ds, (ap, dH) = ops.backward_data(
                    dO, x, hs[c], X.recv_pairs(plan, s_recv, c), w1, w2, meta, ctx.activation
                )
                ds = ds.to(ct)
            X.rows_to_sources(plan, dx, dx_send, c, pend_back)
            X.pairs_to_sources(plan, ds, ds_send, c, pend_back)
            keep.append((dx, ds))
            if want_w:  # runs while chunk c's dX / dS all-to-alls are in flight
                with record_function(f"ep.bwd.weights[{c}]"):
                    dw1, dw2 = _weight_grads(ops, dO, x, ap, dH, meta, w1, w2, ctx.wgrad, dw1, dw2)
        pend_back.wait()
        if dw1 is not None:
            dw1, dw2 = dw1.to(w1.dtype), dw2.to(w2.dtype)
        with record_function("ep.bwd.combine_sum"):
            dx_TD = X.sum_rows_per_token(plan, dx_send) if ctx.needs_input_grad[0] else None
        ds_R = None
        if ctx.needs_input_grad[1]:
            shape, dtype = ctx.scores_meta
            ds_R = X.scatter_pair_grads(plan, ds_send, torch.empty(shape, dtype=dtype, device=grad_TD.device))
        return dx_TD, ds_R, dw1, dw2, None, None, None, None, None, None


def expert_parallel_experts(
    x_TD: torch.Tensor,
    routing: TopKRouting | FlatRouting,
    w1_EGD: torch.Tensor,
    w2_EDF: torch.Tensor,
    *,
    group=None,
    num_experts: int,
    activation: str = "swiglu",
    backend: str = "auto",
    rounding: TokenRounding | None = None,
    rounding_scores_TE: torch.Tensor | None = None,
    num_chunks: int = 1,
    redispatch_x_in_backward: bool = False,
    wgrad: DeferredWeightGrad | None = None,
    return_plan: bool = False,
    overlap: bool = True,
):
    """MoE experts under expert parallelism: O[t] = sum over token t's pairs (t, e, s) of s * expert_e(x[t]),
    where expert e lives on rank e // (E/P). Returns O [T, D] for this rank's tokens (and the plan with
    ``return_plan``). Gradients reach x, the routing scores (and ``rounding_scores_TE`` for added pairs),
    w1 and w2 (unless ``wgrad`` defers the latter).

    Args:
        x_TD: this rank's tokens [T, D] (T may differ between ranks, and may be 0).
        routing: ``TopKRouting`` / ``FlatRouting`` over GLOBAL expert ids [0, E).
        w1_EGD, w2_EDF: this rank's E/P local experts (global ids rank*E/P ...), kernels/ layout.
        group: EP process group (NCCL or gloo); ``None`` or size 1: no communication.
        num_experts: E, a multiple of the group size.
        activation, backend: as ``sonic_megatron.kernels.moe_experts``.
        rounding: tile-aware token rounding across the group (training only; ``None`` in evaluation).
        rounding_scores_TE: dense router probabilities [T, E]; required with ``rounding``.
        num_chunks: pipeline the layer in N token chunks (the all-to-alls of one chunk overlap the
            kernels of its neighbours; each expert's M shrinks N-fold, so pick N by measurement).
        redispatch_x_in_backward: cache only the local X and re-dispatch it in backward (saves the
            received rows' memory for one more all-to-all).
        wgrad: defer the weight-gradient GEMMs to ``wgrad.compute()`` (Megatron's backward_dw).
        return_plan: also return the ``EPPlan`` (split sizes, rounding decision; for tests and benchmarks).
        overlap: ``False`` waits for every all-to-all right after launching it (same results, bitwise;
            for benchmarks that measure how much all-to-all time the overlap hides).
    """
    ops = resolve_backend(backend, x_TD.device)
    if wgrad is not None and not (w1_EGD.is_leaf and w2_EDF.is_leaf):
        raise ValueError("expert_parallel_experts: with wgrad, w1 and w2 must be leaf tensors (parameters)")
    with record_function("ep.plan"):
        plan = make_plan(
            routing,
            num_experts=num_experts,
            group=group,
            rounding=rounding,
            rounding_scores_TE=rounding_scores_TE,
            num_chunks=num_chunks,
            x_TD=x_TD,
            w1_EGD=w1_EGD,
            w2_EDF=w2_EDF,
            activation=activation,
        )
    args = (plan, ops, activation, redispatch_x_in_backward, wgrad, overlap)
    out = _EPExperts.apply(x_TD.contiguous(), plan.scores_R, w1_EGD, w2_EDF, *args)
    return (out, plan) if return_plan else out
