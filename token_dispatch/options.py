"""``EPOptions``: the settings of one expert-parallel layer call, one frozen object validated once.

Every front-end (``expert_parallel_experts``, ``make_plan`` / ``start_plan`` / ``local_experts``) takes
``options=EPOptions(...)`` and, for convenience, the same fields as keywords (they override ``options``' fields).
A bad value raises ``EPInputError`` naming the field, the expected and the given value; through a front-end that
plans (``parse_options``) the error rides in the plan's header exchange, so every rank of the group raises it
together instead of one rank leaving its peers in a collective.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from ..kernels.activations import ACTIVATIONS
from ..kernels.interface import BACKENDS
from .rounding import TokenRounding
from .validation import MAX_CHUNKS, EPInputError
from .wgrad import DeferredWeightGrad


@dataclass(frozen=True)
class EPOptions:
    """Settings of an expert-parallel layer call (all optional).

    Attributes:
        activation, backend: as ``sonic_megatron.kernels.moe_experts`` (backend one of ``BACKENDS``).
        rounding: tile-aware token rounding across the group (training only; ``None`` = plain routing; the
            call then needs ``rounding_scores_TE``).
        num_chunks: pipeline the layer in N token chunks, each with its own all-to-alls, N in [1, 16].
        comm_sms: SMs the GEMMs leave free while a collective is in flight (0 = every SM to the GEMMs).
        redispatch_x_in_backward: cache only the local X and dispatch it again in backward.
        wgrad: defer the weight-gradient GEMMs to ``wgrad.compute()`` (Megatron's backward_dw).
        weight_grad_hook: where the weight gradients go instead (not with ``wgrad``): backward calls it with one
            ``kernels.WeightGradWork`` over the call's received rows (every stage's rows as one work) and
            returns what it returns to autograd for (w1, w2): ``moe_experts``' ``weight_grad_hook`` contract
            (the work can add into fp32 buffers inside its GEMMs, be merged with a later micro-batch's, or be
            kept for later). Work it runs at once keeps ``comm_sms``; work it keeps runs on every SM.
    """

    activation: str = "swiglu"
    backend: str = "auto"
    rounding: TokenRounding | None = None
    num_chunks: int = 1
    comm_sms: int = 0
    redispatch_x_in_backward: bool = False
    wgrad: DeferredWeightGrad | None = None
    weight_grad_hook: Callable | None = None

    def __post_init__(self) -> None:
        problem = _problem({f: getattr(self, f) for f in FIELDS})
        if problem is not None:
            raise EPInputError(f"EPOptions: {problem}")


FIELDS = tuple(f.name for f in dataclasses.fields(EPOptions))
_BOOLS = ("redispatch_x_in_backward",)
_CHOICES = {"activation": ACTIVATIONS, "backend": BACKENDS}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _problem(values: dict) -> str | None:
    """The first invalid field of ``values`` as 'name must be ..., got ...', or None."""
    for name in _BOOLS:
        if not isinstance(values[name], bool):
            return f"{name} must be a bool, got {values[name]!r}"
    for name, choices in _CHOICES.items():
        if not isinstance(values[name], str) or values[name] not in choices:
            return f"{name} must be one of {choices}, got {values[name]!r}"
    n = values["num_chunks"]
    if not _is_int(n) or not 1 <= n <= MAX_CHUNKS:
        return f"num_chunks must be an int in [1, {MAX_CHUNKS}], got {n!r}"
    if not _is_int(values["comm_sms"]) or values["comm_sms"] < 0:
        return f"comm_sms must be an int >= 0, got {values['comm_sms']!r}"
    if values["rounding"] is not None and not isinstance(values["rounding"], TokenRounding):
        return f"rounding must be a TokenRounding or None, got {type(values['rounding']).__name__}"
    if values["wgrad"] is not None and not isinstance(values["wgrad"], DeferredWeightGrad):
        return f"wgrad must be a DeferredWeightGrad or None, got {type(values['wgrad']).__name__}"
    hook = values["weight_grad_hook"]
    if hook is not None and not callable(hook):
        return f"weight_grad_hook must be callable(work) or None, got {type(hook).__name__}"
    if hook is not None and values["wgrad"] is not None:
        return "wgrad and weight_grad_hook both say where the weight gradients go: pass one of them"
    return None


def _merged(caller: str, options: EPOptions | None, overrides: dict) -> dict:
    if options is not None and not isinstance(options, EPOptions):
        raise TypeError(f"{caller}: options must be an EPOptions or None, got {type(options).__name__}")
    unknown = sorted(set(overrides) - set(FIELDS))
    if unknown:
        raise TypeError(f"{caller}: unexpected keyword argument(s) {unknown}; the options are {FIELDS}")
    base = options if options is not None else _DEFAULT
    return {**{f: getattr(base, f) for f in FIELDS}, **overrides}


def resolve_options(caller: str, options: EPOptions | None, overrides: dict) -> EPOptions:
    """``options`` (default ``EPOptions()``) with the keyword ``overrides``; a bad value raises ``EPInputError``
    here, naming ``caller`` (for front-ends that do not plan, e.g. ``local_experts``)."""
    if not overrides and isinstance(options, EPOptions):  # validated when it was built: nothing to redo per call
        return options
    values = _merged(caller, options, overrides)
    problem = _problem(values)
    if problem is not None:
        raise EPInputError(f"{caller}: {problem}")
    return EPOptions(**values)


def parse_options(caller: str, options: EPOptions | None, overrides: dict) -> tuple[EPOptions, str | None]:
    """As ``resolve_options``, but a bad value is returned as a message next to the default options, for the
    plan to raise on every rank (its header exchange) instead of here on one."""
    if not overrides and isinstance(options, EPOptions):  # validated when it was built: nothing to redo per call
        return options, None
    values = _merged(caller, options, overrides)
    problem = _problem(values)
    if problem is not None:
        return _DEFAULT, f"{caller}: {problem}"
    return EPOptions(**values), None


_DEFAULT = EPOptions()
