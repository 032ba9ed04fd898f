"""The engine of the expert-parallel layer: one micro-batch's forward and backward, read top to bottom.

Shape legend: see ``send_side.py`` (T, D, L, P, N, R, S) and ``plan.py`` (U received rows, Q received pairs).

    forward:   1. route -> round -> plan   (``plan_call``: one header + counts exchange, the pair all-to-alls)
               2. dispatch                 (``launch_rows``: every chunk's rows at once, in chunk order)
               3. experts                  (per chunk, as soon as its rows are in: ``forward``)
               4. combine                  (each chunk's result back as soon as it is computed; fixed-order sum)
    backward:  dO dispatch -> backward-data (dH, dS, dX~) -> dX / dS back -> weight gradients (while dX / dS
               travel) -> sums                                                                 (``backward``)

The unit of the pipeline is a stage (``EPPlan.num_stages``): a token chunk. One autograd node runs the forward
and the backward (``layer.py``); Megatron's method split takes the dispatch, experts and weight-gradient pieces one
node at a time (``stepwise.py``).
Async collectives need no private streams: NCCL orders each one after the current stream's queued work and
``wait()`` orders the current stream after it, so the schedule is race-free under repetition. The one exception is
the plan's sizes exchange, whose stream lets the current stream go on while it waits for the slowest peer
(``sizes.launch_exchange``).
GEMMs that run while a collective is in flight leave ``comm_sms`` SMs free (``ops.reserve_sms``): QuACK's
persistent GEMMs otherwise hold every SM until they end and the collective cannot start (the cute backend launches
QuACK's plans on fewer clusters, ``kernels/cute/quack_adapter.py``).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from ..kernels.interface import resolve_backend
from ..kernels.routing import RoutingMetadata
from ..kernels.weight_grad_pairs import WeightGradWork
from . import exchange as X
from .comm import Pending
from .options import EPOptions
from .plan import EPPlan, PlanInputs, plan_layer


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
def plan_call(inputs: PlanInputs, options: EPOptions, *, options_error: str | None = None) -> EPPlan:
    """The plan of one layer call (``plan.py``: it decides rounding), its inputs checked on every rank."""
    with record_function("ep.plan"):
        return plan_layer(inputs, options, options_error=options_error)


# --- 2. dispatch (and the rows back) ----------------------------------------------------------------------------
def launch_rows(plan: EPPlan, x_TD: torch.Tensor, recv_UD: torch.Tensor) -> list:
    """Launch every stage's row all-to-all, stage by stage: NCCL runs one group's collectives in launch order,
    so stage i waits only for stages <= i. Each stage's send rows are gathered just before its launch, so
    stage 0 leaves early."""
    send_SD = x_TD.new_empty(plan.num_send_rows, x_TD.shape[1])
    pend = [Pending() for _ in range(plan.num_stages)]
    for i in range(plan.num_stages):
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
    """SMs every GEMM of a call leaves free for collectives in flight: in a forward / backward-data call
    (``data``) and in a weight-gradient call (``weights``)."""

    data: int
    weights: int


def free_sms(plan: EPPlan, options: EPOptions) -> SMBudget:
    """``options.comm_sms`` wherever a collective can be in flight: with P > 1, beside the weight-gradient GEMMs
    (the dX / dS all-to-alls travel) and, with more than one stage, beside the forward / backward-data GEMMs
    (with one stage nothing else is in flight then)."""
    n = 0 if plan.world_size == 1 else options.comm_sms
    return SMBudget(data=n if plan.num_stages > 1 else 0, weights=n)


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
    # comm_sms 0 opens no reservation, so one the caller holds (``backward``'s) stays in force.
    with ops.reserve_sms(comm_sms) if comm_sms else contextlib.nullcontext():
        if stages == 1:
            return ops.backward_weights(dO, x, ap, dH, meta)
        if acc is None:
            ct = torch.promote_types(w1.dtype, torch.float32)
            acc = (torch.zeros(w1.shape, dtype=ct, device=w1.device), torch.zeros(w2.shape, dtype=ct, device=w2.device))
        return ops.backward_weights(dO, x, ap, dH, meta, out=acc)


def hooked_weight_grads(ops, works: list[WeightGradWork], hook, comm_sms=0):
    """``EPOptions.weight_grad_hook`` on every stage's weight work merged into one: what it returns to autograd
    for (w1, w2). ``comm_sms`` as in ``weight_grads`` for work the hook runs at once."""
    work = functools.reduce(WeightGradWork.merged_with, works)
    with ops.reserve_sms(comm_sms) if comm_sms else contextlib.nullcontext():
        return hook(work)


def in_weight_dtype(dws, w1, w2):
    """(dW1, dW2) in the weights' dtype (one rounding of the fp32 stage sums), or (None, None)."""
    if dws is None:
        return None, None
    return dws[0].to(w1.dtype), dws[1].to(w2.dtype)


# --- 4. the forward and backward --------------------------------------------------------------------------------
@dataclass
class Saved:
    """What the backward needs from the forward: the received (deduplicated) token rows -- or only the local X
    with ``redispatch`` -- the received scores, H per stage, and the schedule's settings."""

    x: torch.Tensor | None  # None inside the autograd context (the tensors go through save_for_backward)
    s_recv: torch.Tensor | None
    hs: list
    free_sms: SMBudget
    redispatch: bool


def forward(x_TD, w1, w2, plan: EPPlan, ops, options: EPOptions, *, free: SMBudget, store_h: bool):
    """The forward (dispatch -> experts -> combine): (out_TD, Saved)."""
    S, D, redispatch = plan.num_stages, x_TD.shape[1], options.redispatch_x_in_backward
    x_recv = x_TD.new_empty(plan.num_recv_rows, D)
    with record_function("ep.fwd.dispatch_launch"):
        pend_x = launch_rows(plan, x_TD, x_recv)
    # Receive metadata and scores (they came with the plan's pair all-to-alls, launched before the rows):
    # built while the row all-to-alls are in flight.
    with record_function("ep.fwd.recv_metadata"):
        metas = plan.recv_meta
        s_recv = plan.recv_scores()
    y_send = x_TD.new_empty(plan.num_send_rows, D)
    pend_y, hs, keep = Pending(), [], []
    for i in range(S):
        pend_x[i].wait()  # stage i's rows and scores
        with record_function(f"ep.fwd.experts[{i}]"), ops.reserve_sms(free.data):
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
    pend_y.wait()
    del keep
    with record_function("ep.fwd.combine_sum"):
        out_TD = X.sum_rows_per_token(plan, y_send)
    # Cache: received (deduplicated) token rows -- or only the local X with redispatch -- H, scores.
    return out_TD, Saved(x_TD if redispatch else x_recv, s_recv, hs, free, redispatch)


def backward(grad_TD, saved: Saved, w1, w2, plan: EPPlan, ops, options: EPOptions, want, scores_like):
    """The backward: (dx_TD, dscores_R, dw1, dw2). ``want``: which of (dx, dscores, weights) are needed;
    ``scores_like``: (shape, dtype) of plan.scores_R; weight gradients go to ``options.wgrad`` when set. Each
    stage's dO (and X) send rows are gathered right before its launch, so stage 0 leaves early."""
    S, D = plan.num_stages, grad_TD.shape[1]
    free = saved.free_sms
    want_dx, want_ds, want_w = want
    grad_TD = grad_TD.contiguous()
    dO_recv = grad_TD.new_empty(plan.num_recv_rows, D)
    with record_function("ep.bwd.dispatch_launch"):
        pend_dO = launch_rows(plan, grad_TD, dO_recv)
        if saved.redispatch:
            x_recv = saved.x.new_empty(plan.num_recv_rows, D)
            pend_x = launch_rows(plan, saved.x, x_recv)
        else:
            x_recv, pend_x = saved.x, [Pending() for _ in range(S)]
    dx_send = grad_TD.new_empty(plan.num_send_rows, D)
    ct = torch.promote_types(grad_TD.dtype, torch.float32)
    ds_send = torch.empty(sum(map(sum, plan.send_pairs)), dtype=ct, device=grad_TD.device)
    pend_back, keep = Pending(), []
    dws, works = None, []
    for i in range(S):
        pend_dO[i].wait()
        pend_x[i].wait()
        dO, x, meta = X.recv_rows(plan, dO_recv, i), X.recv_rows(plan, x_recv, i), plan.recv_meta[i]
        with record_function(f"ep.bwd.data[{i}]"), ops.reserve_sms(free.data):
            dx, ds, (ap, dH) = ops.backward_data(
                dO, x, saved.hs[i], X.recv_pairs(plan, saved.s_recv, i), w1, w2, meta, options.activation
            )
            ds = ds.to(ct)
        X.rows_to_sources(plan, dx, dx_send, i, pend_back)
        X.pairs_to_sources(plan, ds, ds_send, i, pend_back)
        keep.append((dx, ds))
        if want_w and options.weight_grad_hook is not None:
            works.append(WeightGradWork(ops, dO, x, ap, dH, meta))
        elif want_w:  # runs while stage i's dX / dS all-to-alls are in flight
            with record_function(f"ep.bwd.weights[{i}]"), ops.reserve_sms(free.weights):
                dws = weight_grads(ops, dO, x, ap, dH, meta, w1, w2, options.wgrad, dws, S)
    dw1, dw2 = in_weight_dtype(dws, w1, w2)
    if works:  # while the last stage's dX / dS all-to-alls are in flight
        with record_function("ep.bwd.weights"), ops.reserve_sms(free.weights):
            dw1, dw2 = hooked_weight_grads(ops, works, options.weight_grad_hook)
    pend_back.wait()
    with record_function("ep.bwd.combine_sum"):
        dx_TD = X.sum_rows_per_token(plan, dx_send) if want_dx else None
    ds_R = None
    if want_ds:
        shape, dtype = scores_like
        ds_R = X.scatter_pair_grads(plan, ds_send, torch.empty(shape, dtype=dtype, device=grad_TD.device))
    return dx_TD, ds_R, dw1, dw2
