"""``expert_parallel_experts``: the whole expert-parallel MoE experts block as ONE autograd node, pipelined.

Shape legend: see ``plan.py``. The unit of the pipeline is a stage (``EPPlan.num_stages``): a token chunk
(``num_chunks``), or with ``by_source`` one (chunk, source rank) exchange, this rank's own rows first (no
communication), then a ring of point-to-point exchanges. Forward, per stage i:
    all dispatch all-to-alls are launched at once (async, in stage order), then the receive metadata is
    built from the plan's pair all-to-alls (scores ride in them) while the rows travel; for each i: wait for
    stage i's rows, run the local experts on them, launch its combine all-to-all; finally wait and sum.
    So the dispatch of stage i+1 and the combine of stage i-1 are in flight while stage i computes.
Backward, per stage i:
    all dO all-to-alls (and X's, with ``redispatch_x_in_backward``) are launched at once; for each i: wait
    for stage i, dH/dS/dX~ (``backward_data``), launch the dX and dS all-to-alls back, THEN run stage i's
    weight-gradient GEMMs (dW2, dW1) while those are in flight.
Async collectives need no private streams: NCCL orders each one after the current stream's queued work and
``wait()`` orders the current stream after it, so the schedule is race-free under repetition.
GEMMs that run while a collective is in flight leave ``comm_sms`` SMs free (``ops.reserve_sms``): QuACK's
persistent GEMMs otherwise hold every SM until they end and the collective cannot start (kernels/cute/quack_adapter.py).
Forward and backward are written as step generators (``_forward_steps``, ``_backward_steps``) that yield right
after launching collectives their next kernels wait for: the autograd node runs each to its end
(``run_steps``); ``interleave.py`` alternates a forward with another micro-batch's backward.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from ..kernels.interface import resolve_backend
from ..kernels.routing import FlatRouting, TopKRouting
from . import exchange as X
from .comm import Pending
from .plan import EPPlan, make_plan
from .rounding import TokenRounding
from .stepwise import _in_weight_dtype, _weight_grads
from .validation import check_comm_sms
from .wgrad import DeferredWeightGrad


def record_function(name: str):
    """A torch.profiler range while a profiler runs (bench layer --profile); otherwise nothing, because the
    layer is host-bound on GPUs and even an idle range costs a dispatcher call."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def _launch_rows(plan: EPPlan, x_TD: torch.Tensor, recv_UD: torch.Tensor, eager: bool, gathered=None) -> list:
    """Launch every stage's row all-to-all, stage by stage: NCCL runs one group's collectives in launch order,
    so stage i waits only for stages <= i. Each stage's send rows are gathered just before its launch, so
    stage 0 leaves early -- unless ``gathered`` holds them already (``X.gather_send_rows``)."""
    send_SD = gathered if gathered is not None else x_TD.new_empty(plan.num_send_rows, x_TD.shape[1])
    pend = [Pending(eager) for _ in range(plan.num_stages)]
    for i in range(plan.num_stages):
        if gathered is None:
            s0, s1 = plan.send_row_range(i)
            torch.index_select(x_TD, 0, plan.send_token_idx_S[s0:s1], out=send_SD[s0:s1])
        X.rows_to_experts(plan, send_SD, X.recv_rows(plan, recv_UD, i), i, pend[i])
    return pend


def _comm_sms(plan: EPPlan, comm_sms: int, overlap: bool, multi_stage_only: bool) -> int:
    """SMs to leave free in a GEMM: only while a collective can be in flight (overlap on, P > 1, and for the
    forward / backward-data GEMMs more than one stage: with one stage nothing else is in flight then)."""
    if not overlap or plan.world_size == 1 or (multi_stage_only and plan.num_stages == 1):
        return 0
    return comm_sms


@dataclass(frozen=True)
class _SMBudget:
    """SMs the GEMMs leave free for collectives in flight: in a forward / backward-data call (``data``), in a
    weight-gradient call (``weights``), and in how many of each call's GEMMs (``gemms``; None: all of them)."""

    data: int
    weights: int
    gemms: int | None = None


@dataclass
class _Saved:
    """What the backward needs from the forward: the received (deduplicated) token rows -- or only the local X
    with ``redispatch`` -- the received scores, H per stage, and the schedule's settings."""

    x: torch.Tensor | None  # None inside the autograd context (the tensors go through save_for_backward)
    s_recv: torch.Tensor | None
    hs: list
    free_sms: _SMBudget
    eager: bool
    redispatch: bool


def _free_sms(plan: EPPlan, comm_sms: int, overlap: bool, concurrent: bool, reservation: str = "auto") -> _SMBudget:
    """``comm_sms`` wherever a collective can be in flight. ``concurrent``: another micro-batch's all-to-alls
    run beside every GEMM (``interleave.py``). There, with ``reservation`` "auto", only each call's first GEMM
    leaves SMs free: the NCCL kernel started beside it keeps its SMs into the second GEMM, which takes every SM
    with the cute backend's dynamic tile scheduler (its CTAs that wait for the NCCL kernel's SMs find the tiles
    already taken by the running ones; ``kernels/cute/ops.py``'s ``_dynamic``). "all": every GEMM (also the only
    policy with one micro-batch, whose stages' collectives are not bounded by one call)."""
    return _SMBudget(
        data=_comm_sms(plan, comm_sms, overlap, multi_stage_only=not concurrent),
        weights=_comm_sms(plan, comm_sms, overlap, multi_stage_only=False),
        gemms=1 if concurrent and reservation == "auto" else None,
    )


def _forward_steps(x_TD, w1, w2, plan: EPPlan, ops, activation, *, overlap, free_sms, store_h, redispatch):
    """The forward as a generator of steps: it yields right after launching collectives that its next work
    waits for (so that the kernels of another micro-batch can run meanwhile: ``interleave.py``; run alone,
    the yields are no-ops) and returns (out_TD, _Saved)."""
    S, D, eager = plan.num_stages, x_TD.shape[1], not overlap
    x_recv = x_TD.new_empty(plan.num_recv_rows, D)
    metas = plan.recv_meta if eager else None  # no overlap: the pair all-to-alls complete before the rows
    with record_function("ep.fwd.dispatch_launch"):
        pend_x = _launch_rows(plan, x_TD, x_recv, eager)
    # Receive metadata and scores (they came with the plan's pair all-to-alls, launched before the rows):
    # built while the row all-to-alls are in flight.
    with record_function("ep.fwd.recv_metadata"):
        metas = plan.recv_meta
        s_recv = plan.recv_scores()
    yield  # the rows are in flight
    y_send = x_TD.new_empty(plan.num_send_rows, D)
    pend_y, hs, keep = Pending(eager), [], []
    for i in range(S):
        pend_x[i].wait()  # stage i's rows and scores
        with record_function(f"ep.fwd.experts[{i}]"), ops.reserve_sms(free_sms.data, free_sms.gemms):
            o, h = ops.forward(
                X.recv_rows(plan, x_recv, i), X.recv_pairs(plan, s_recv, i), w1, w2, metas[i], activation, store_h
            )
        X.rows_to_sources(plan, o, y_send, i, pend_y)
        keep.append(o)  # alive until its all-to-all completes
        hs.append(h)
    yield  # the combine all-to-alls are in flight
    pend_y.wait()
    del keep
    with record_function("ep.fwd.combine_sum"):
        out_TD = X.sum_rows_per_token(plan, y_send)
    # Cache: received (deduplicated) token rows -- or only the local X with redispatch -- H, scores.
    return out_TD, _Saved(x_TD if redispatch else x_recv, s_recv, hs, free_sms, eager, redispatch)


def _backward_steps(
    grad_TD, saved: _Saved, w1, w2, plan: EPPlan, ops, activation, wgrad, want, scores_like, gather_first=False
):
    """The backward as a generator of steps (yields as ``_forward_steps``: after launching the dO all-to-alls,
    and before the last stage's weight-gradient GEMMs); returns (dx_TD, dscores_R, dw1, dw2).
    ``want``: which of (dx, dscores, weights) are needed; ``scores_like``: (shape, dtype) of plan.scores_R.
    ``gather_first``: gather every stage's dO (and X) send rows in a step of their own before the launches
    (``interleave.py`` launches them inside the next micro-batch's plan); otherwise each stage's rows are gathered
    right before its launch, so stage 0 leaves early."""
    S, D, eager = plan.num_stages, grad_TD.shape[1], saved.eager
    free = saved.free_sms
    want_dx, want_ds, want_w = want
    grad_TD = grad_TD.contiguous()
    send_dO = send_x = None
    if gather_first:
        with record_function("ep.bwd.dispatch_gather"):
            send_dO = X.gather_send_rows(plan, grad_TD)
            send_x = X.gather_send_rows(plan, saved.x) if saved.redispatch else None
        yield  # the send rows are gathered; their all-to-alls go out in the next step
    dO_recv = grad_TD.new_empty(plan.num_recv_rows, D)
    with record_function("ep.bwd.dispatch_launch"):
        pend_dO = _launch_rows(plan, grad_TD, dO_recv, eager, gathered=send_dO)
        if saved.redispatch:
            x_recv = saved.x.new_empty(plan.num_recv_rows, D)
            pend_x = _launch_rows(plan, saved.x, x_recv, eager, gathered=send_x)
        else:
            x_recv, pend_x = saved.x, [Pending() for _ in range(S)]
    yield  # the dO (and X) rows are in flight
    dx_send = grad_TD.new_empty(plan.num_send_rows, D)
    ct = torch.promote_types(grad_TD.dtype, torch.float32)
    ds_send = torch.empty(sum(map(sum, plan.send_pairs)), dtype=ct, device=grad_TD.device)
    pend_back, keep = Pending(eager), []
    dws = None
    for i in range(S):
        pend_dO[i].wait()
        pend_x[i].wait()
        dO, x, meta = X.recv_rows(plan, dO_recv, i), X.recv_rows(plan, x_recv, i), plan.recv_meta[i]
        with record_function(f"ep.bwd.data[{i}]"), ops.reserve_sms(free.data, free.gemms):
            dx, ds, (ap, dH) = ops.backward_data(
                dO, x, saved.hs[i], X.recv_pairs(plan, saved.s_recv, i), w1, w2, meta, activation
            )
            ds = ds.to(ct)
        X.rows_to_sources(plan, dx, dx_send, i, pend_back)
        X.pairs_to_sources(plan, ds, ds_send, i, pend_back)
        keep.append((dx, ds))
        if i == S - 1:
            yield  # the last stage's dX / dS all-to-alls are in flight
        if want_w:  # runs while stage i's dX / dS all-to-alls are in flight
            with record_function(f"ep.bwd.weights[{i}]"), ops.reserve_sms(free.weights, free.gemms):
                dws = _weight_grads(ops, dO, x, ap, dH, meta, w1, w2, wgrad, dws, S)
    pend_back.wait()
    dw1, dw2 = _in_weight_dtype(dws, w1, w2)
    with record_function("ep.bwd.combine_sum"):
        dx_TD = X.sum_rows_per_token(plan, dx_send) if want_dx else None
    ds_R = None
    if want_ds:
        shape, dtype = scores_like
        ds_R = X.scatter_pair_grads(plan, ds_send, torch.empty(shape, dtype=dtype, device=grad_TD.device))
    return dx_TD, ds_R, dw1, dw2


def run_steps(steps):
    """Run a step generator to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


class _EPExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, scores_R, w1, w2, plan, ops, activation, redispatch, wgrad, overlap, comm_sms):
        free_sms = _free_sms(plan, comm_sms, overlap, concurrent=False)
        store_h = any(ctx.needs_input_grad[:4])
        kw = dict(overlap=overlap, free_sms=free_sms, store_h=store_h, redispatch=redispatch)
        out_TD, saved = run_steps(_forward_steps(x_TD, w1, w2, plan, ops, activation, **kw))
        ctx.plan, ctx.ops, ctx.activation, ctx.wgrad = plan, ops, activation, wgrad
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
        steps = _backward_steps(
            grad_TD, saved, w1, w2, ctx.plan, ctx.ops, ctx.activation, ctx.wgrad, want, ctx.scores_like
        )
        dx_TD, ds_R, dw1, dw2 = run_steps(steps)
        return dx_TD, ds_R, dw1, dw2, None, None, None, None, None, None, None


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
    by_source: bool = False,
    comm_sms: int = 0,
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
        by_source: pipeline each chunk by source rank as well (P stages per chunk: this rank's own rows
            first, which need no communication, then one point-to-point exchange per peer, each overlapping
            the previous stage's kernels); must be equal on all ranks.
        comm_sms: SMs the GEMMs leave free while a collective is in flight (overlap on, P > 1), so the
            all-to-all's kernel can run beside a persistent GEMM; 0 = all SMs to the GEMMs. The NCCL kernel
            needs one SM per channel (NCCL_MAX_NCHANNELS); pick by measurement (``bench layer --comm-sms``).
        redispatch_x_in_backward: cache only the local X and re-dispatch it in backward (saves the
            received rows' memory for one more all-to-all).
        wgrad: defer the weight-gradient GEMMs to ``wgrad.compute()`` (Megatron's backward_dw).
        return_plan: also return the ``EPPlan`` (split sizes, rounding decision; for tests and benchmarks).
        overlap: ``False`` waits for every all-to-all right after launching it (same results, bitwise;
            for benchmarks that measure how much all-to-all time the overlap hides).
    """
    ops = resolve_backend(backend, x_TD.device)
    check_comm_sms(comm_sms, "expert_parallel_experts")
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
            by_source=by_source,
            x_TD=x_TD,
            w1_EGD=w1_EGD,
            w2_EDF=w2_EDF,
            activation=activation,
        )
    args = (plan, ops, activation, redispatch_x_in_backward, wgrad, overlap, comm_sms)
    out = _EPExperts.apply(x_TD.contiguous(), plan.scores_R, w1_EGD, w2_EDF, *args)
    return (out, plan) if return_plan else out
