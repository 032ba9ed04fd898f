"""Two micro-batches interleaved: the forward of micro-batch B runs with the backward of micro-batch A, so each
one's all-to-alls travel while the other one's kernels run (the overlap of DualPipe's forward-backward chunks
and of Megatron's 1F1B EP overlap, at the level of this package, without autograd).

Shape legend: see ``plan.py``. Within one micro-batch the forward's dispatch and combine have no kernels of
their own to hide behind (each waits for the other's result); across micro-batches they do. ``ep_forward_backward``
launches, in this order (every rank the same, so NCCL's one stream per group sees the same sequence):

    A: dO send rows gathered
    B: plan: its counts all-gather, then
    A:   dO all-to-all (the backward's rows towards the experts), launched before B's host waits for that gather
    B:   the host copy of the counts, pair all-to-all; dispatch all-to-all, receive metadata
    A: backward-data GEMMs, dX / dS all-to-alls back          <- while B's rows travel
    B: experts (up, down, gather-sum), combine all-to-all     <- while A's dX / dS travel
    A: weight-gradient GEMMs, dX sum                           <- while B's combine travels
    B: combine sum

Functional API (no autograd graph through the layer; gradients are returned):

    out_A, fwd_A = ep_forward(x_A, routing_A, w1, w2, group=g, num_experts=E)
    ...
    out_B, fwd_B, grads_A = ep_forward_backward(fwd_A, dout_A, x_B, routing_B, w1, w2, group=g, num_experts=E)
    grads_B = ep_backward(fwd_B, dout_B)

``EPGrads.dscores_R`` is the gradient w.r.t. ``fwd.plan.scores_R`` (the routed pairs' scores, with autograd links to
the router's output), so ``torch.autograd.backward(fwd.plan.scores_R, grads.dscores_R)`` carries it on into the router.
The results equal ``expert_parallel_experts`` + ``backward`` bitwise (tests/test_token_dispatch_interleave.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..kernels.routing import FlatRouting, TopKRouting
from . import engine as G
from .options import EPOptions, parse_options
from .plan import EPPlan


@dataclass
class EPForward:
    """A forward's state for its backward (``ep_backward`` / ``ep_forward_backward``)."""

    plan: EPPlan
    ops: object
    options: EPOptions
    saved: G.Saved
    w1_EGD: torch.Tensor
    w2_EDF: torch.Tensor


@dataclass
class EPGrads:
    """Gradients of one micro-batch: w.r.t. its x_TD, ``plan.scores_R``, w1 and w2."""

    dx_TD: torch.Tensor
    dscores_R: torch.Tensor
    dw1_EGD: torch.Tensor
    dw2_EDF: torch.Tensor


def _backward(fwd: EPForward, grad_TD: torch.Tensor, concurrent: bool):
    """fwd's backward steps; ``concurrent``: its GEMMs run beside another micro-batch's all-to-alls."""
    scores = fwd.plan.scores_R
    return G.backward_steps(
        grad_TD,
        replace(fwd.saved, free_sms=G.free_sms(fwd.plan, fwd.options, concurrent)),
        fwd.w1_EGD,
        fwd.w2_EDF,
        fwd.plan,
        fwd.ops,
        fwd.options,
        (True, True, True),
        (scores.shape, scores.dtype),
        gather_first=concurrent,  # interleaved: the dO all-to-all goes out inside the next micro-batch's plan
    )


def _check_backward_args(fwd, grad_TD, name: str) -> None:
    """The state is one ``ep_forward`` / ``ep_forward_backward`` returned, and the gradient matches its output."""
    if not isinstance(fwd, EPForward):
        raise TypeError(f"{name} must be the EPForward returned by ep_forward / ep_forward_backward, got {type(fwd)}")
    want = (fwd.plan.num_tokens, fwd.w2_EDF.shape[1])
    if not isinstance(grad_TD, torch.Tensor) or tuple(grad_TD.shape) != want:
        got = tuple(grad_TD.shape) if isinstance(grad_TD, torch.Tensor) else type(grad_TD)
        raise ValueError(f"the output gradient of {name} must be a tensor of shape {want} (its output's), got {got}")


def _interleaved_options(caller: str, options: EPOptions | None, option_kw: dict) -> tuple[EPOptions, str | None]:
    """The options of ``caller``, or an error for the plan to raise on every rank: the gradients are returned
    (no ``wgrad``), and the interleaved schedule runs token chunks (no ``by_source``)."""
    opts, error = parse_options(caller, options, option_kw)
    if error is None and opts.wgrad is not None:
        error = f"{caller}: wgrad must be None (the weight gradients are returned in EPGrads), got {opts.wgrad!r}"
    if error is None and opts.by_source:
        error = f"{caller}: by_source must be False (the interleaved schedule pipelines token chunks), got True"
    return opts, error


def _forward_with(prev, grad_prev_TD, x_TD, routing, w1_EGD, w2_EDF, caller, group, num_experts, scores_TE, kw):
    """This micro-batch's forward, with ``prev``'s backward interleaved when ``prev`` is given:
    (out_TD, EPForward, prev's EPGrads or None). ``kw``: ``options`` and the option keywords of ``caller``."""
    opts, error = _interleaved_options(caller, kw.pop("options", None), kw)
    # before prev's collectives go out; with an error the plan raises (on every rank)
    ops = G.experts_ops(opts, x_TD.device) if error is None else None
    bwd, launch_prev = None, None
    if prev is not None:  # checked by ep_forward_backward
        bwd = _backward(prev, grad_prev_TD, concurrent=True)  # prev's GEMMs leave prev's comm_sms SMs free
        with torch.no_grad():
            next(bwd)  # prev's dO send rows gathered (GPU work queued before this micro-batch's plan)

        def launch_prev():
            # prev's dO all-to-all, launched inside this plan between its counts all-gather and the host's wait
            # for it: the launch's host time overlaps that wait instead of adding to the step's start,
            # where the GPU waits for the host. It queues after the all-gather (small) on NCCL's stream.
            with torch.no_grad():
                next(bwd)

    # The plan outside no_grad: its scores_R keeps the autograd link to the router (EPGrads.dscores_R's target).
    plan = G.plan_call(
        routing,
        opts,
        num_experts=num_experts,
        group=group,
        rounding_scores_TE=scores_TE,
        x_TD=x_TD,
        w1_EGD=w1_EGD,
        w2_EDF=w2_EDF,
        options_error=error,
        before_sync=launch_prev,
    )
    free = G.free_sms(plan, opts, concurrent=bwd is not None)
    fwd = G.forward_steps(x_TD.contiguous(), w1_EGD, w2_EDF, plan, ops, opts, free=free, store_h=True)
    with torch.no_grad():
        (out_TD, saved), grads = G.alternate(fwd, bwd) if bwd is not None else (G.run_steps(fwd), None)
    state = EPForward(plan, ops, opts, saved, w1_EGD, w2_EDF)
    return out_TD, state, None if grads is None else EPGrads(*grads)


def ep_forward(
    x_TD: torch.Tensor,
    routing: TopKRouting | FlatRouting,
    w1_EGD: torch.Tensor,
    w2_EDF: torch.Tensor,
    *,
    group=None,
    num_experts: int,
    rounding_scores_TE: torch.Tensor | None = None,
    options: EPOptions | None = None,
    **option_kw,
) -> tuple[torch.Tensor, EPForward]:
    """The expert-parallel experts forward of one micro-batch without autograd: (out_TD, state for the
    backward; it keeps H and the received rows, as the autograd path does in training). Arguments as
    ``expert_parallel_experts`` (options: ``EPOptions`` or its fields as keywords; not ``wgrad`` nor
    ``by_source``). ``options.sm_reservation``: in which GEMMs of an interleaved step the ``comm_sms`` reservation
    applies -- "auto" (default): only the first GEMM of each forward / backward-data / weight-gradient call; the
    second takes every SM, with the cute backend's dynamic tile scheduler so that its CTAs held back by the NCCL
    kernel's SMs cost no tail; "all": every GEMM beside a collective. Results are bitwise the same either way."""
    kw = dict(option_kw, options=options)
    out_TD, state, _ = _forward_with(
        None, None, x_TD, routing, w1_EGD, w2_EDF, "ep_forward", group, num_experts, rounding_scores_TE, kw
    )
    return out_TD, state


def ep_backward(fwd: EPForward, grad_TD: torch.Tensor) -> EPGrads:
    """The backward of ``fwd`` for the output gradient ``grad_TD``: its gradients (nothing is accumulated)."""
    _check_backward_args(fwd, grad_TD, "fwd")
    with torch.no_grad():
        return EPGrads(*G.run_steps(_backward(fwd, grad_TD, concurrent=False)))


def ep_forward_backward(
    prev: EPForward,
    grad_prev_TD: torch.Tensor,
    x_TD: torch.Tensor,
    routing: TopKRouting | FlatRouting,
    w1_EGD: torch.Tensor,
    w2_EDF: torch.Tensor,
    *,
    group=None,
    num_experts: int,
    rounding_scores_TE: torch.Tensor | None = None,
    options: EPOptions | None = None,
    **option_kw,
) -> tuple[torch.Tensor, EPForward, EPGrads]:
    """The backward of micro-batch ``prev`` (output gradient ``grad_prev_TD``) interleaved with the forward of
    the next micro-batch (the remaining arguments, as ``ep_forward``): (out_TD, its state, prev's gradients).
    Each one's all-to-alls are in flight while the other one's kernels run (module docstring); the GEMMs leave
    ``comm_sms`` SMs free for them. Results equal ``ep_backward(prev, ...)`` then ``ep_forward(...)``, bitwise.
    ``prev`` and this micro-batch must use the same group (the weights may differ, e.g. another layer's)."""
    _check_backward_args(prev, grad_prev_TD, "prev")
    kw = dict(option_kw, options=options)
    return _forward_with(
        prev,
        grad_prev_TD,
        x_TD,
        routing,
        w1_EGD,
        w2_EDF,
        "ep_forward_backward",
        group,
        num_experts,
        rounding_scores_TE,
        kw,
    )
