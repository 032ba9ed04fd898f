"""Step-wise front-end for Megatron's method split: ``dispatch`` -> ``local_experts`` -> ``combine``, each its own
autograd node linked only through tensors, built from the engine's pieces (``engine.py``). Shape legend: see
``send_side.py`` and ``plan.py``; one buffer holds all chunks in receive order, so the step-wise form runs every
chunk's all-to-all at once (no pipelining: that is ``expert_parallel_experts``' job). ``dispatch_before_sync`` is
``dispatch`` for a plan started with slots (``slots.py``): it runs before the plan's host sync, and with
``local_experts_before_sync`` and ``combine_slots`` the forward has none: ``EarlyDispatch.finish()`` runs in the
experts' backward. Weight gradients of ``local_experts`` run right after dX is computed; ``options.wgrad``
defers them to ``DeferredWeightGrad.compute()``.

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
from .comm import Pending, all_to_all
from .options import EPOptions, resolve_options
from .plan import EPPlan, StartedPlan, finish_plan
from .recv_side import first_entries, scores_from_columns, slotted_recv_metadata
from .sizes import pair_base
from .slots import SlotCombine, launch_slots
from .validation import EPInputError, SlotsTooSmall


def _dispatch_backward(ctx, plan: EPPlan, dx_recv, ds_recv):
    """dispatch's backward: (dx_TD, ds_R) from the received rows' and pairs' gradients (``ds_recv`` [Q]). Both
    exchanges run on every rank whatever this rank's inputs need: its peers' may need them (a rank without tokens
    can have scores without autograd), and a collective one rank skips leaves the others waiting."""
    shape, dtype, device = ctx.scores_like
    rows_back = G.all_rows_back(plan, dx_recv.contiguous())
    ds_recv = ds_recv.contiguous()
    ds_send = ds_recv.new_empty(sum(map(sum, plan.send_pairs)))
    pending = Pending()
    for i in range(plan.num_stages):
        X.pairs_to_sources(plan, X.recv_pairs(plan, ds_recv, i), ds_send, i, pending)
    pending.wait()
    dx_TD = X.sum_rows_per_token(plan, rows_back) if ctx.needs_input_grad[0] else None
    ds_R = None
    if ctx.needs_input_grad[1]:
        ds_R = X.scatter_pair_grads(plan, ds_send, torch.empty(shape, dtype=dtype, device=device))
    return dx_TD, ds_R


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, scores_R, plan):
        ctx.plan, ctx.scores_like = plan, (scores_R.shape, scores_R.dtype, scores_R.device)
        recv_UD = G.all_rows(plan, X.gather_send_rows(plan, x_TD.contiguous()))
        return recv_UD, plan.recv_scores()  # the scores came with the plan's pair all-to-alls

    @staticmethod
    def backward(ctx, dx_recv, ds_recv):
        return (*_dispatch_backward(ctx, ctx.plan, dx_recv, ds_recv), None)


class EarlyDispatch:
    """A dispatch sent in slots before its plan's host sync (``dispatch_before_sync``). ``finish()`` is that sync:
    it returns the plan (``finish_plan`` with the received pairs), which the dispatch's backward then uses."""

    def __init__(self, started: StartedPlan) -> None:
        self.started: StartedPlan | None = started
        self.received_pairs: torch.Tensor | None = None  # set by the dispatch
        self.plan: EPPlan | None = None
        self._combine: SlotCombine | None = None
        self.error: Exception | None = None  # the header check's, once raised
        self.hint = ""  # appended to SlotsTooSmall: the caller's way to plans that need no slots

    @property
    def combine_view(self) -> SlotCombine:
        """The combine's view of the slots (``combine_slots``), taken before ``finish`` releases the started plan."""
        if self._combine is None:
            self._combine = SlotCombine.of(self.started)
        return self._combine

    def finish(self) -> EPPlan:
        """The plan (its host sync and header check, once); a failed check raises again on every later call."""
        if self.error is not None:
            raise self.error
        if self.plan is None:
            if self.received_pairs is None:
                raise RuntimeError("EarlyDispatch.finish: the dispatch (dispatch_before_sync) has not run")
            try:
                self.plan = finish_plan(self.started, self.received_pairs)
            except SlotsTooSmall as exc:
                self.error = SlotsTooSmall(f"{exc}. {self.hint}") if self.hint else exc
                raise self.error from exc
            except EPInputError as exc:
                self.error = exc
                raise
            if self.received_pairs.is_cuda:  # the dispatch's stream made it; the experts' stream reads it
                self.received_pairs.record_stream(torch.cuda.current_stream(self.received_pairs.device))
            self.started = self.received_pairs = None  # the plan holds what is still needed
        return self.plan


class _DispatchBeforeSync(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, scores_R, early):
        ctx.early, ctx.scores_like = early, (scores_R.shape, scores_R.dtype, scores_R.device)
        recv_rows, recv_pairs = launch_slots(early.started, x_TD.contiguous())
        early.received_pairs = recv_pairs
        return recv_rows, scores_from_columns(recv_pairs[:, 2:], scores_R.dtype)  # the score bits, slotted

    @staticmethod
    def backward(ctx, dx_slots, ds_slots):
        plan = ctx.early.plan
        if plan is None:
            raise RuntimeError("dispatch_before_sync: backward before EarlyDispatch.finish() made the plan")
        return (*_dispatch_backward(ctx, plan, dx_slots, plan.pairs_from_slots(ds_slots)), None)


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
        return (*_experts_backward(ctx, dy_UD, x_UD, s_Q, w1, w2, hs), None, None, None)


def _experts_backward(ctx, dy_UD, x_UD, s_Q, w1, w2, hs):
    """local_experts' backward: (dx_UD, ds_Q, dw1, dw2), the weight gradients None where deferred or where
    ``options.weight_grad_hook`` says so."""
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
    return _concat(dxs), _concat(dss).to(s_Q.dtype), dw1, dw2


class _LocalExpertsBeforeSync(torch.autograd.Function):
    """``_LocalExperts`` with no host sync in its forward: the GEMMs run over the receive metadata of the slotted
    pairs with the device's counts (``recv_side.slotted_recv_metadata``), over the bound of the pairs. The plan's
    host sync (``early.finish()``) waits in backward, long after its sizes arrived; there the cached tensors are cut
    to the real pairs (views) and the backward of exact split sizes runs."""

    @staticmethod
    def forward(ctx, x_UD, s_slots, w1, w2, early, ops, options):
        store_h = any(ctx.needs_input_grad[:4])
        started = early.started
        sizes, slots = started.sizes, started.slots
        if sizes.ready is not None:  # the counts come from the exchange's stream: the GPU waits, the host does not
            torch.cuda.current_stream(x_UD.device).wait_event(sizes.ready)
        meta, slot_of = slotted_recv_metadata(
            early.received_pairs,
            sizes.counts_PW,
            rank=started.rank,
            world_size=started.world_size,
            num_local_experts=started.num_local_experts,
            row_slots=slots.rows,
            pair_slots=slots.pairs,
            pair_base=pair_base(started.world_size),
            pairs_per_row_hint=started.pairs_per_row_hint,
        )
        s_all = s_slots.index_select(0, slot_of.clamp(max=s_slots.shape[0] - 1))
        with ops.reserve_sms(options.comm_sms, gemms=1):  # see local_experts
            o, h = ops.forward(x_UD, s_all, w1, w2, meta, options.activation, store_h)
        ctx.early, ctx.meta, ctx.ops, ctx.options = early, meta, ops, options
        ctx.slot_shape = s_slots.shape
        ctx.save_for_backward(x_UD, s_all, w1, w2, slot_of, *([h] if h is not None else []))
        return o

    @staticmethod
    def backward(ctx, dy_UD):
        plan = ctx.early.finish()  # the plan's host sync: its sizes arrived long ago (the header check raises here)
        Q = plan.num_recv_pairs
        plan._recv_meta = [first_entries(ctx.meta, Q)]
        ctx.plan, ctx.meta = plan, None
        x_UD, s_all, w1, w2, slot_of, *hs = ctx.saved_tensors
        dx_UD, ds_Q, dw1, dw2 = _experts_backward(ctx, dy_UD, x_UD, s_all[:Q], w1, w2, [h[:Q] for h in hs])
        ds_slots = ds_Q.new_zeros(ctx.slot_shape).index_copy_(0, slot_of[:Q], ds_Q)
        return dx_UD, ds_slots, dw1, dw2, None, None, None


class _CombineSlots(torch.autograd.Function):
    """``_Combine`` for rows in slots, with no host size: the rows go back in their slots (equal splits) and each
    token sums its rows at their slot positions in destination order (the combine order over the send side's
    bound; the token offsets stop every sum at the real rows)."""

    @staticmethod
    def forward(ctx, y_UD, early):
        s = ctx.view = early.combine_view
        back = torch.empty_like(y_UD)
        _slots_all_to_all(back, y_UD.contiguous(), s)
        return X.sum_rows_per_token(s, back)

    @staticmethod
    def backward(ctx, grad_TD):
        s = ctx.view
        rows = X.gather_send_rows(s, grad_TD.contiguous())
        recv = torch.empty_like(rows)
        _slots_all_to_all(recv, rows, s)
        return recv, None


def _slots_all_to_all(out: torch.Tensor, inp: torch.Tensor, s: SlotCombine) -> None:
    """Rows in their slots, one slot per rank each way (equal splits)."""
    splits = [s.row_slots] * s.world_size
    all_to_all(out, inp, splits, splits, s.group)


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


def dispatch_before_sync(
    x_TD: torch.Tensor, scores_R: torch.Tensor, started: StartedPlan
) -> tuple[torch.Tensor, torch.Tensor, EarlyDispatch]:
    """``dispatch`` before the plan's host sync, for a plan started with ``slots`` (``slots.py``): the rows and
    pairs leave in their slots now, and the host waits for the sizes only in ``early.finish()``.

    Returns (x_recv [P * C, D] in the slots' layout, which ``local_experts`` takes as is; scores in the pair slots'
    layout [P * Cq], which ``plan.pairs_from_slots`` turns into ``local_experts``' scores_recv; ``early``).
    ``scores_R``: the started plan's ``scores_R`` (or a copy of it); gradients return to it and to ``x_TD``.
    Every rank of the group calls it (with bad input too: ``early.finish()`` then raises on every rank)."""
    if started.slots is None:
        raise ValueError("dispatch_before_sync: the plan was started without slots (start_plan(..., slots=...))")
    D, dtype, _ = started.row_like
    if started.error is None and (tuple(x_TD.shape) != (started.num_tokens, D) or x_TD.dtype != dtype):
        raise ValueError(  # holds for the x the plan checked (module docstring)
            f"dispatch_before_sync: x must be [T = {started.num_tokens}, D = {D}] of {dtype} (the plan's tokens), got "
            f"{tuple(x_TD.shape)} of {x_TD.dtype}"
        )
    early = EarlyDispatch(started)
    x_recv, scores_slots = _DispatchBeforeSync.apply(x_TD, scores_R, early)
    return x_recv, scores_slots, early


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


def local_experts_before_sync(
    x_recv: torch.Tensor,
    scores_slots: torch.Tensor,
    w1_EGD: torch.Tensor,
    w2_EDF: torch.Tensor,
    early: EarlyDispatch,
    *,
    options: EPOptions | None = None,
    **option_kw,
) -> torch.Tensor:
    """``local_experts`` on ``dispatch_before_sync``'s outputs with no host sync: the GEMMs run over an upper bound
    of the pairs (the device's counts say how many are real; buffers sized by the bound cost no GEMM tiles; H is
    kept at the bound until backward). Returns y_recv [P * C, D] for ``combine_slots``. Its backward runs
    ``early.finish()`` (the plan's host sync and header check: the sizes arrived long before) and then the backward
    of exact split sizes; ``early.plan`` is the plan from then on.
    Options as ``local_experts``. Top-K routing sums a row's pairs as exact split sizes do (same bits); other
    routings block them by the bound."""
    opts = resolve_options("local_experts_before_sync", options, option_kw)
    started = early.started
    if started is None or early.received_pairs is None:
        raise ValueError("local_experts_before_sync: needs the EarlyDispatch of dispatch_before_sync, unfinished")
    P, slots = started.world_size, started.slots
    if tuple(x_recv.shape[:1]) != (P * slots.rows,) or tuple(scores_slots.shape) != (P * slots.pairs,):
        raise ValueError(
            f"local_experts_before_sync: x_recv must have {P * slots.rows} rows and scores_slots "
            f"{P * slots.pairs} entries (the slots'), got {tuple(x_recv.shape)} and {tuple(scores_slots.shape)}"
        )
    ops = G.experts_ops(opts, x_recv.device)
    return _LocalExpertsBeforeSync.apply(x_recv, scores_slots, w1_EGD, w2_EDF, early, ops, opts)


def combine_slots(y_recv: torch.Tensor, early: EarlyDispatch) -> torch.Tensor:
    """``combine`` for ``local_experts_before_sync``'s output, before the plan's host sync: [T, D]."""
    s = early.combine_view
    if y_recv.dim() != 2 or y_recv.shape[0] != s.world_size * s.row_slots:
        raise ValueError(f"combine_slots: y_recv must be [{s.world_size * s.row_slots}, D], got {tuple(y_recv.shape)}")
    return _CombineSlots.apply(y_recv, early)


def combine(y_recv: torch.Tensor, plan: EPPlan) -> torch.Tensor:
    """Send each received row's result back to its source and sum per token in a fixed order: [T, D]."""
    if y_recv.dim() != 2 or y_recv.shape[0] != plan.num_recv_rows:  # holds for local_experts' output
        raise ValueError(f"combine: y_recv must be [{plan.num_recv_rows}, D], got {tuple(y_recv.shape)}")
    return _Combine.apply(y_recv, plan)
