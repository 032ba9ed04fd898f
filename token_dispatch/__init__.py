"""Expert-parallel dispatch and combine for SonicMoE's experts (knows torch.distributed, not Megatron).

One call (training or eval); the settings travel as one frozen ``EPOptions`` (or as its fields, by keyword)::

    from sonic_megatron.token_dispatch import EPOptions, TokenRounding, expert_parallel_experts
    opts = EPOptions(rounding=TokenRounding("nearest", 128), num_chunks=1, comm_sms=0,
                     redispatch_x_in_backward=False, wgrad=None)
    out_TD = expert_parallel_experts(x_TD, routing, w1_EGD, w2_EDF, group=ep_group, num_experts=E,
                                     rounding_scores_TE=probs_TE, options=opts)

Step-wise, for Megatron's method split (each step its own autograd node, linked only by tensors)::

    plan = make_plan(routing, num_experts=E, group=ep_group, rounding_scores_TE=..., x_TD=x_TD,
                     options=opts)                     # one small all-gather + one host copy (split sizes)
    x_recv, scores_recv = dispatch(x_TD, plan)         # each token once per destination rank
    y_recv = local_experts(x_recv, scores_recv, w1, w2, plan, options=opts)
    out_TD = combine(y_recv, plan)                     # one row per (token, rank) back; fixed-order sum

Refinements of the team contract (all contract names work as specified):
  * ``make_plan`` also takes ``options`` (it reads ``rounding``, ``num_chunks``, ``activation``) and, optionally,
    ``x_TD``, ``w1_EGD``, ``w2_EDF``: given, they are checked on every rank and compared across ranks in the plan's
    header exchange (a mismatch raises ``EPInputError`` on all ranks instead of hanging in an all-to-all).
  * ``make_plan`` = ``finish_plan(start_plan(...))``: ``start_plan`` launches the plan's device work and its sizes
    exchange without waiting, ``finish_plan`` holds the host sync; GPU work queued between the two runs while the
    host waits (Megatron's dispatcher calls them in ``dispatch_preprocess`` and ``token_dispatch``).
  * Dispatch before the host sync, in slots (``slots.py``)::

        started = start_plan(routing, ..., x_TD=x_TD, slots=Slots.for_layer(max_tokens, L, K))
        x_recv, scores_slots, early = dispatch_before_sync(x_TD, started.scores_R, started)  # no host wait
        plan = early.finish()                          # the host sync: split sizes, header check
        y_recv = local_experts(x_recv, plan.pairs_from_slots(scores_slots), w1, w2, plan, options=opts)
        y_TD = combine(y_recv, plan)
        # or a forward with no host sync (the plan's sync and header check wait in backward; early.plan after it):
        y_recv = local_experts_before_sync(x_recv, scores_slots, w1, w2, early, options=opts)
        y_TD = combine_slots(y_recv, early)
  * ``expert_parallel_experts(..., return_plan=True)`` also returns the ``EPPlan``.
  * ``DeferredWeightGrad(sink=...)``: pass as ``EPOptions.wgrad``; ``wgrad.compute()`` runs the deferred dW GEMMs
    and hands each result to the sink (default: ``.grad``).
  * ``round_routing`` (rounding alone; ``group=None`` is the single-process reference) and
    ``RoundingResult`` are exported for tests and for routers that want the decision.
  * Bad input, bad options included, raises ``EPInputError`` (a ``ValueError``) on every rank of the group.
  * ``redispatch_x_in_backward`` applies to ``expert_parallel_experts``; in the step-wise form
    ``local_experts`` caches the received rows.
Modules: options (``EPOptions``), engine (one micro-batch's forward and backward: plan, dispatch, experts,
combine), front-ends layer (one autograd node) and stepwise (Megatron's method split); plan
(``EPPlan``/``make_plan``, decides rounding) from send_side (+ triton_send), sizes (the one counts exchange),
recv_side (+ triton_recv) and slots (rows and pairs sent before the sync); rounding (+ triton_round), exchange (row
movement), comm (collectives), validation (header), wgrad (deferral), launch_count (host-work counter of
``bench layer --count-ops``).
"""

from .layer import expert_parallel_experts
from .options import EPOptions
from .plan import EPPlan, StartedPlan, finish_plan, make_plan, start_plan
from .rounding import ROUNDING_MODES, RoundingResult, TokenRounding, round_local, round_routing
from .slots import Slots
from .stepwise import (
    EarlyDispatch,
    combine,
    combine_slots,
    dispatch,
    dispatch_before_sync,
    local_experts,
    local_experts_before_sync,
)
from .validation import EPInputError
from .wgrad import DeferredWeightGrad

__all__ = [
    "ROUNDING_MODES",
    "DeferredWeightGrad",
    "EPInputError",
    "EPOptions",
    "EPPlan",
    "EarlyDispatch",
    "RoundingResult",
    "Slots",
    "StartedPlan",
    "TokenRounding",
    "combine",
    "dispatch",
    "dispatch_before_sync",
    "expert_parallel_experts",
    "finish_plan",
    "local_experts",
    "local_experts_before_sync",
    "combine_slots",
    "make_plan",
    "round_local",
    "round_routing",
    "start_plan",
]
