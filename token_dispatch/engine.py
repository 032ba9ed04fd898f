"""The engine of the expert-parallel layer: one micro-batch's forward and backward, read top to bottom.

Shape legend: see ``send_side.py`` (T, D, L, P, N, R, S) and ``plan.py`` (U received rows, Q received pairs).

    forward:   1. route -> round -> plan   (``plan_call``: one header + counts exchange, the pair all-to-alls)
               2. dispatch                 (``launch_rows``: every stage's rows at once, in stage order)
               3. experts                  (per stage, as soon as its rows are in: ``forward_steps``)
               4. combine                  (each stage's result back as soon as it is computed; fixed-order sum)
    backward:  dO dispatch -> backward-data (dH, dS, dX~) -> dX / dS back -> weight gradients (while dX / dS
               travel) -> sums                                                           (``backward_steps``)

The unit of the pipeline is a stage (``EPPlan.num_stages``): a token chunk, or with ``by_source`` one (chunk,
source rank) exchange, this rank's own rows first (no communication), then a ring of point-to-point exchanges.
Forward and backward are step generators that yield right after launching collectives their next kernels wait
for: one autograd node runs each to its end (``run_steps``: ``layer.py``), two micro-batches alternate a forward
with the previous backward (``alternate``: ``interleave.py``), and Megatron's method split takes the dispatch,
experts and weight-gradient pieces one node at a time (``stepwise.py``).
Async collectives need no private streams: NCCL orders each one after the current stream's queued work and
``wait()`` orders the current stream after it, so the schedule is race-free under repetition.
GEMMs that run while a collective is in flight leave ``comm_sms`` SMs free (``ops.reserve_sms``): QuACK's
persistent GEMMs otherwise hold every SM until they end and the collective cannot start
(``kernels/cute/quack_adapter.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..kernels.interface import resolve_backend
from ..kernels.routing import RoutingMetadata
from . import exchange as X
from .comm import Pending
from .options import EPOptions
from .plan import EPPlan, plan_layer


def record_function(name: str):
    """A torch.profiler range while a profiler runs (bench layer --profile); otherwise nothing, because the
    layer is host-bound on GPUs and even an idle range costs a dispatcher call."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def experts_ops(options: EPOptions, device: torch.device):
    """The experts backend's op module (``kernels/interface.py``) for ``options.backend`` on ``device``."""
    return resolve_backend(options.backend, device)


# --- 1. route -> round -> plan ----------------------------------------------------------------------------------
def plan_call(
    routing,
    options: EPOptions,
    *,
    num_experts: int,
    group,
    rounding_scores_TE: torch.Tensor | None,
    x_TD: torch.Tensor,
    w1_EGD: torch.Tensor,
    w2_EDF: torch.Tensor,
    options_error: str | None = None,
    before_sync: Callable[[], object] | None = None,
) -> EPPlan:
    """The plan of one layer call (``plan.py``: it decides rounding), its inputs checked on every rank."""
    with record_function("ep.plan"):
        return plan_layer(
            routing,
            options,
            num_experts=num_experts,
            group=group,
            rounding_scores_TE=rounding_scores_TE,
            x_TD=x_TD,
            w1_EGD=w1_EGD,
            w2_EDF=w2_EDF,
            options_error=options_error,
            before_sync=before_sync,
        )


# --- 2. dispatch (and the rows back) ----------------------------------------------------------------------------
def launch_rows(plan: EPPlan, x_TD: torch.Tensor, recv_UD: torch.Tensor, eager: bool, gathered=None) -> list:
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


def all_rows(plan: EPPlan, send_SD: torch.Tensor) -> torch.Tensor:
    """Every stage's send rows to the experts at once, waited for: the receive buffer [U, D]."""
    recv_UD = send_SD.new_empty(plan.num_recv_rows, send_SD.shape[1])
    pending = Pending()
    for i in range(plan.num_stages):
        X.rows_to_experts(plan, send_SD, X.recv_rows(plan, recv_UD, i), i, pending)
    pending.wait()
    return recv_UD


def all_rows_back(plan: EPPlan, recv_UD: torch.Tensor) -> torch.Tensor:
    """Every stage's received-row results back to their sources at once, waited for: send order [S, D]."""
    send_SD = recv_UD.new_empty(plan.num_send_rows, recv_UD.shape[1])
    pending = Pending()
    for i in range(plan.num_stages):
        X.rows_to_sources(plan, X.recv_rows(plan, recv_UD, i), send_SD, i, pending)
    pending.wait()
    return send_SD


# --- 3. experts: SMs left free, weight gradients ----------------------------------------------------------------
@dataclass(frozen=True)
class SMBudget:
    """SMs the GEMMs leave free for collectives in flight: in a forward / backward-data call (``data``), in a
    weight-gradient call (``weights``), and in how many of each call's GEMMs (``gemms``; None: all of them)."""

    data: int
    weights: int
    gemms: int | None = None


def _comm_sms(plan: EPPlan, comm_sms: int, overlap: bool, multi_stage_only: bool) -> int:
    """SMs to leave free in a GEMM: only while a collective can be in flight (overlap on, P > 1, and for the
    forward / backward-data GEMMs more than one stage: with one stage nothing else is in flight then)."""
    if not overlap or plan.world_size == 1 or (multi_stage_only and plan.num_stages == 1):
        return 0
    return comm_sms


def free_sms(plan: EPPlan, options: EPOptions, concurrent: bool) -> SMBudget:
    """``options.comm_sms`` wherever a collective can be in flight. ``concurrent``: another micro-batch's
    all-to-alls run beside every GEMM (``interleave.py``). There, with ``sm_reservation`` "auto", only each call's
    first GEMM leaves SMs free: the NCCL kernel started beside it keeps its SMs into the second GEMM, which takes
    every SM with the cute backend's dynamic tile scheduler (its CTAs that wait for the NCCL kernel's SMs find the
    tiles already taken by the running ones; ``kernels/cute/ops.py``'s ``_dynamic``). "all": every GEMM (also the
    only policy with one micro-batch, whose stages' collectives are not bounded by one call)."""
    n, overlap = options.comm_sms, options.overlap
    return SMBudget(
        data=_comm_sms(plan, n, overlap, multi_stage_only=not concurrent),
        weights=_comm_sms(plan, n, overlap, multi_stage_only=False),
        gemms=1 if concurrent and options.sm_reservation == "auto" else None,
    )


def weight_grads(ops, dO, x, ap, dH, meta: RoutingMetadata, w1, w2, wgrad, acc, stages, comm_sms=0):
    """Run (or defer to ``wgrad``) one stage's dW GEMMs. With one stage: returns its (dW1, dW2). With more:
    adds them into fp32 accumulators (``acc``, created at the first stage: zeros) inside the GEMMs and returns
    those; the caller rounds once at the end (``in_weight_dtype``). ``comm_sms``: SMs the GEMMs leave free, also
    when deferred (they then run in Megatron's backward_dw, beside its all-to-alls)."""
    if wgrad is not None:

        def deferred(out=None, accumulate=True):
            with ops.reserve_sms(comm_sms):
                return ops.backward_weights(dO, x, ap, dH, meta, out=out, accumulate=accumulate)

        wgrad.record(deferred, w1, w2)
        return None
    # comm_sms 0 opens no reservation, so one the caller holds (backward_steps') stays in force.
    with ops.reserve_sms(comm_sms) if comm_sms else contextlib.nullcontext():
        if stages == 1:
            return ops.backward_weights(dO, x, ap, dH, meta)
        if acc is None:
            ct = torch.promote_types(w1.dtype, torch.float32)
            acc = (torch.zeros(w1.shape, dtype=ct, device=w1.device), torch.zeros(w2.shape, dtype=ct, device=w2.device))
        return ops.backward_weights(dO, x, ap, dH, meta, out=acc)


def in_weight_dtype(dws, w1, w2):
    """(dW1, dW2) in the weights' dtype (one rounding of the fp32 stage sums), or (None, None)."""
    if dws is None:
        return None, None
    return dws[0].to(w1.dtype), dws[1].to(w2.dtype)


def in_buffer_order(per_stage: list[torch.Tensor], stage_range) -> torch.Tensor:
    """One tensor of the stages' results in receive-buffer order: each stage's result goes to its range (by
    source, stages are not in buffer order: stage (c, k) holds source rank - k)."""
    if len(per_stage) == 1:
        return per_stage[0]
    out = per_stage[0].new_empty(sum(t.shape[0] for t in per_stage), *per_stage[0].shape[1:])
    for i, t in enumerate(per_stage):
        r0, r1 = stage_range(i)
        out[r0:r1] = t
    return out


# --- 4. the forward and backward steps --------------------------------------------------------------------------
@dataclass
class Saved:
    """What the backward needs from the forward: the received (deduplicated) token rows -- or only the local X
    with ``redispatch`` -- the received scores, H per stage, and the schedule's settings."""

    x: torch.Tensor | None  # None inside the autograd context (the tensors go through save_for_backward)
    s_recv: torch.Tensor | None
    hs: list
    free_sms: SMBudget
    eager: bool
    redispatch: bool


def forward_steps(x_TD, w1, w2, plan: EPPlan, ops, options: EPOptions, *, free: SMBudget, store_h: bool):
    """The forward (dispatch -> experts -> combine) as a generator of steps: it yields right after launching
    collectives that its next work waits for (so that the kernels of another micro-batch can run meanwhile; run
    alone, the yields are no-ops) and returns (out_TD, Saved)."""
    S, D, eager, redispatch = plan.num_stages, x_TD.shape[1], not options.overlap, options.redispatch_x_in_backward
    x_recv = x_TD.new_empty(plan.num_recv_rows, D)
    metas = plan.recv_meta if eager else None  # no overlap: the pair all-to-alls complete before the rows
    with record_function("ep.fwd.dispatch_launch"):
        pend_x = launch_rows(plan, x_TD, x_recv, eager)
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
        with record_function(f"ep.fwd.experts[{i}]"), ops.reserve_sms(free.data, free.gemms):
            o, h = ops.forward(
                X.recv_rows(plan, x_recv, i),
                X.recv_pairs(plan, s_recv, i),
                w1,
                w2,
                metas[i],
                options.activation,
                store_h,
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
    return out_TD, Saved(x_TD if redispatch else x_recv, s_recv, hs, free, eager, redispatch)


def backward_steps(
    grad_TD, saved: Saved, w1, w2, plan: EPPlan, ops, options: EPOptions, want, scores_like, *, gather_first=False
):
    """The backward as a generator of steps (yields as ``forward_steps``: after launching the dO all-to-alls,
    and before the last stage's weight-gradient GEMMs); returns (dx_TD, dscores_R, dw1, dw2).
    ``want``: which of (dx, dscores, weights) are needed; ``scores_like``: (shape, dtype) of plan.scores_R;
    weight gradients go to ``options.wgrad`` when set.
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
        pend_dO = launch_rows(plan, grad_TD, dO_recv, eager, gathered=send_dO)
        if saved.redispatch:
            x_recv = saved.x.new_empty(plan.num_recv_rows, D)
            pend_x = launch_rows(plan, saved.x, x_recv, eager, gathered=send_x)
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
                dO, x, saved.hs[i], X.recv_pairs(plan, saved.s_recv, i), w1, w2, meta, options.activation
            )
            ds = ds.to(ct)
        X.rows_to_sources(plan, dx, dx_send, i, pend_back)
        X.pairs_to_sources(plan, ds, ds_send, i, pend_back)
        keep.append((dx, ds))
        if i == S - 1:
            yield  # the last stage's dX / dS all-to-alls are in flight
        if want_w:  # runs while stage i's dX / dS all-to-alls are in flight
            with record_function(f"ep.bwd.weights[{i}]"), ops.reserve_sms(free.weights, free.gemms):
                dws = weight_grads(ops, dO, x, ap, dH, meta, w1, w2, options.wgrad, dws, S)
    pend_back.wait()
    dw1, dw2 = in_weight_dtype(dws, w1, w2)
    with record_function("ep.bwd.combine_sum"):
        dx_TD = X.sum_rows_per_token(plan, dx_send) if want_dx else None
    ds_R = None
    if want_ds:
        shape, dtype = scores_like
        ds_R = X.scatter_pair_grads(plan, ds_send, torch.empty(shape, dtype=dtype, device=grad_TD.device))
    return dx_TD, ds_R, dw1, dw2


# --- 5. running the steps ---------------------------------------------------------------------------------------
def run_steps(steps):
    """Run a step generator to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def alternate(first, second):
    """Advance two step generators in turn, ``first`` first, until both end; their results (first, second)."""
    steps, results, live = [first, second], [None, None], [True, True]
    while any(live):
        for k in (0, 1):
            if live[k]:
                try:
                    next(steps[k])
                except StopIteration as done:
                    results[k], live[k] = done.value, False
    return results[0], results[1]
