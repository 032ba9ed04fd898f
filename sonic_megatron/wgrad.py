"""Where expert weight gradients go: autograd's ``.grad`` or Megatron DDP's ``main_grad``, now or later
(``delay_wgrad_compute`` → ``backward_dw()``).

Shape legend: see ``kernels/routing.py``.

Megatron's contract, mirrored here:
* fused accumulation: where DDP gave both weights a contiguous ``main_grad``, the weight-gradient GEMMs add into
  it themselves (``compute(out=main_grads)``: fp32 accumulation in the epilogue, no bf16 gradient, no add
  kernel; at an iteration's first micro-batch, while DDP's zeroed buffers hold nothing, they store instead,
  ``main_grads_empty``), ``param.grad_added_to_main_grad`` is set, and autograd receives a dummy tensor so that DDP's
  per-parameter hook still fires (it skips the add because of the flag) -- what Megatron's own linear layers do
  under ``gradient_accumulation_fusion``. That flag selects Megatron's fused-GEMM extension (apex / Transformer
  Engine) for its linear layers; the experts' GEMMs accumulate natively, so they fuse whatever it says. At
  EP > 1 the same hook receives the sonic dispatcher's work (``EPOptions.weight_grad_hook``);
* delayed wgrad: backward records what the weight GEMMs need and returns no weight gradient; ``compute()``
  (called from ``backward_dw()``) runs the GEMMs, accumulates, then calls the hooks DDP registered through
  ``register_wgrad_accumulation_and_reduce_hooks`` (parameters carry ``skip_backward_post_hook``).
The recorded work lives in a FIFO owned by the experts module; backward of microbatch i always precedes
its ``backward_dw``, so the queue never holds more than the microbatches in flight.

Micro-batch pairs (``SonicConfig.pair_weight_grads``, fused accumulation, not delayed): under Megatron's training
schedules, the weight GEMMs of an iteration's micro-batches 2i and 2i+1 run once, over both micro-batches' rows
(``WeightGradWork.merged_with``): one pass over the fp32 ``main_grad`` per pair instead of one per micro-batch.
Micro-batch 2i's work is held until 2i+1's backward (autograd gets no weight gradient for 2i, so DDP's hook fires
at 2i+1); the iteration's last micro-batch never waits (``get_num_microbatches``). Megatron's schedules call the
model config's ``finalize_model_grads_func`` once per iteration, after the last backward and before the gradients
are reduced or read: a sink holds work only while that function is a ``FinalizeAfterHeldWeightGrads``, which runs
the work its sinks still hold (and restarts their micro-batch counts) before Megatron's finalize, so no gradient
can be left behind. The model builder installs it (``finalize_runs_held_weight_grads``: ``spec.sonic_block_spec``
does, for Megatron-LM's ``GPTModelBuilder``, whose training loop keeps a finalize function the builder set); a
sink registers with it at its first pairable backward. Anywhere else (no such finalize function, no micro-batch
calculator) each backward computes its own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch


def accumulate_weight_grad(w: torch.Tensor, g: torch.Tensor) -> None:
    """Add ``g`` to ``w.main_grad`` when it exists (setting Megatron's ``w.grad_added_to_main_grad = True``),
    else to ``w.grad`` (created if absent), in that buffer's dtype."""
    main = getattr(w, "main_grad", None)
    if main is not None:
        main.add_(g.to(main.dtype))
        w.grad_added_to_main_grad = True
    elif w.grad is None:
        w.grad = g.to(w.dtype)
    else:
        w.grad.add_(g.to(w.grad.dtype))


def fusable_main_grads(params) -> tuple[torch.Tensor, ...] | None:
    """The params' ``main_grad`` buffers when every param requires grad and has a contiguous ``main_grad`` of
    its shape (then ``backward_weights(..., out=...)`` can add into them directly); else None."""
    mains = []
    for p in params:
        m = getattr(p, "main_grad", None)
        if not p.requires_grad or m is None or m.shape != p.shape or not m.is_contiguous():
            return None
        mains.append(m)
    return tuple(mains)


def main_grads_empty(params) -> bool:
    """Whether the params' ``main_grad`` buffers hold no gradient yet: Megatron DDP clears
    ``grad_added_to_main_grad`` where it zeroes the buffers (``zero_grad_buffer``, at every iteration's start),
    and only a fused accumulation sets it, so False on every param means zeros there. The weight GEMMs then
    store into the buffers instead of adding (no read of the fp32 zeros, measured faster: docs/PERF.md). A param
    without the attribute (no DDP) is never taken as empty."""
    return all(getattr(p, "grad_added_to_main_grad", True) is False for p in params)


def add_into_main_grads(fn, params) -> bool:
    """When ``fusable_main_grads(params)``: ``fn(out=main_grads)`` adds the gradients there (inside the GEMMs;
    stores them where ``main_grads_empty``) and every param gets ``grad_added_to_main_grad = True`` (as
    ``accumulate_weight_grad`` sets it); True. Otherwise nothing runs and the caller accumulates ``fn()``'s
    result itself; False."""
    mains = fusable_main_grads(params)
    if mains is None:
        return False
    fn(out=mains, accumulate=not main_grads_empty(params))
    for p in params:
        p.grad_added_to_main_grad = True
    return True


def add_to_main_grads(fn, params) -> None:
    """Run ``fn`` (a weight-gradient work) into Megatron's buffers: the GEMMs add straight into the fp32
    ``main_grad`` buffers when both weights have one, else ``fn()``'s gradients go to ``main_grad`` (or ``.grad``
    where a weight has none) through ``accumulate_weight_grad``; a weight that does not require grad gets none.
    ``WeightGradSink`` runs its held and delayed work with it; it is also a sink for
    ``token_dispatch.DeferredWeightGrad``."""
    if add_into_main_grads(fn, params):
        return
    for w, g in zip(params, fn(), strict=True):
        if w.requires_grad:
            accumulate_weight_grad(w, g)


def _num_microbatches() -> int | None:
    """Megatron's micro-batches per iteration, None outside its training setup."""
    try:
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        return int(get_num_microbatches())
    except Exception:  # no calculator initialised (plain autograd use, tests, benchmarks)
        return None


class FinalizeAfterHeldWeightGrads:
    """A model's ``finalize_model_grads_func``: runs the weight-gradient work its sinks hold, then ``finalize``
    (Megatron's). Sinks register at their first pairable backward; only while this object is the config's finalize
    function do they hold work (see the module docstring).

    Args:
        finalize: the function Megatron's schedules would call otherwise (``finalize_model_grads``).
    """

    def __init__(self, finalize: Callable):
        self.finalize = finalize
        self._sinks: list[WeightGradSink] = []

    def register(self, sink: WeightGradSink) -> None:
        self._sinks.append(sink)

    def __call__(self, *args, **kwargs):
        for sink in self._sinks:
            sink.flush()
        return self.finalize(*args, **kwargs)

    def __deepcopy__(self, memo) -> FinalizeAfterHeldWeightGrads:
        return self  # a copied config keeps calling the same hook, as it would a plain function


def finalize_runs_held_weight_grads(config, finalize: Callable | None = None) -> FinalizeAfterHeldWeightGrads:
    """Install the hook on ``config.finalize_model_grads_func`` (a TransformerConfig, or a config that forwards its
    attributes to one): in front of ``finalize``, else of the function already there, else of Megatron's
    ``finalize_model_grads``. A hook already there is kept and returned. Call it before training, after any
    finalize function of your own is set (sinks find the hook at their first pairable backward)."""
    current = getattr(config, "finalize_model_grads_func", None)
    if isinstance(current, FinalizeAfterHeldWeightGrads):
        return current
    if finalize is None:
        finalize = current
    if finalize is None:
        from megatron.core.distributed import finalize_model_grads as finalize
    hook = FinalizeAfterHeldWeightGrads(finalize)
    config.finalize_model_grads_func = hook
    return hook


class WeightGradSink:
    """Receives (w1, w2) weight gradients for one experts module.

    Args:
        params: (w1, w2).
        delay: Megatron's ``delay_wgrad_compute`` (record in backward, compute in ``backward_dw()``).
        config: the model's TransformerConfig, whose ``finalize_model_grads_func`` must be a
            ``FinalizeAfterHeldWeightGrads`` for micro-batch pairs; None: no pairs.
        pair: ``SonicConfig.pair_weight_grads`` (see the module docstring).
    """

    def __init__(self, params: tuple[torch.nn.Parameter, ...], *, delay: bool, config=None, pair: bool = False):
        self.params = params
        self.delay = delay
        self.config = config
        self.pair = pair
        self._pending: deque[Callable[[], tuple[torch.Tensor, ...]]] = deque()
        self._hooks: list[Callable] = []
        self._held = None  # a micro-batch's WeightGradWork waiting for the next micro-batch's
        self._backwards = 0  # backward calls since Megatron's last finalize
        self._finalize: FinalizeAfterHeldWeightGrads | None = None  # the hook this sink registered with

    # -- called from autograd backward ---------------------------------------------------------------
    def grads_for_autograd(self, compute: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor | None, ...]:
        """What backward returns for the weights. ``compute()`` yields the weight gradients (one per param)."""
        if self.delay:
            self._pending.append(compute)
            return (None,) * len(self.params)
        mains = fusable_main_grads(self.params)
        if mains is None:  # no DDP buffers: plain autograd gradients
            return compute()
        if self._pairs_here(compute):
            index, self._backwards = self._backwards, self._backwards + 1
            if self._held is None:
                count = _num_microbatches()
                if count is not None and index < count - 1:  # not the iteration's last: wait for the next one
                    self._held = compute
                    return (None,) * len(self.params)
            else:
                compute, self._held = self._held.merged_with(compute), None
        # The GEMMs add straight into the fp32 main_grads (no temporary, no add kernel), or store there at the
        # iteration's first micro-batch (or pair).
        compute(out=mains, accumulate=not main_grads_empty(self.params))
        return tuple(self._added_to_main_grad(p) for p in self.params)

    def _pairs_here(self, compute) -> bool:
        """Micro-batch pairs apply: asked for, a mergeable work, no CUDA graph being captured (a captured backward
        would replay one micro-batch's choice, hold or compute, for every later one), and a finalize function that
        runs held work (this sink registers with it)."""
        if not self.pair or not hasattr(compute, "merged_with"):
            return False
        if compute.x_TD.is_cuda and torch.cuda.is_current_stream_capturing():
            if self._held is not None:
                raise RuntimeError(
                    "SonicConfig.pair_weight_grads: a CUDA graph capture began while a micro-batch's weight "
                    "gradients were held for the next one; capture the MoE layer's backward with "
                    "pair_weight_grads=False (SONIC_MEGATRON_PAIR_WEIGHT_GRADS=0)"
                )
            return False
        finalize = getattr(self.config, "finalize_model_grads_func", None)
        if not isinstance(finalize, FinalizeAfterHeldWeightGrads):
            return False
        if finalize is not self._finalize:
            finalize.register(self)
            self._finalize = finalize
        return True

    @torch.no_grad()  # Megatron's finalize runs outside autograd's backward; the held tensors may require grad
    def flush(self) -> None:
        """Run the held work (alone), and restart the micro-batch count (a new iteration follows)."""
        held, self._held = self._held, None
        self._backwards = 0
        if held is not None:
            add_to_main_grads(held, self.params)

    @staticmethod
    def _added_to_main_grad(p: torch.nn.Parameter) -> torch.Tensor | None:
        """After adding p's gradient into ``p.main_grad``: Megatron's flag, and what autograd gets for p."""
        if not hasattr(p, "grad_added_to_main_grad"):
            return None
        p.grad_added_to_main_grad = True
        # A dummy grad keeps DDP's grad-ready hook firing; DDP skips the add (flag set above) unless the
        # parameter asks for ``zero_out_wgrad``, where it adds this dummy: zeros then, as Megatron's layers do.
        if getattr(p, "zero_out_wgrad", False):
            return torch.zeros(p.shape, dtype=p.dtype, device=p.device)
        return torch.empty(p.shape, dtype=p.dtype, device=p.device)

    # -- called from backward_dw() ---------------------------------------------------------------------
    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @torch.no_grad()  # backward_dw runs outside autograd's backward; the saved tensors may require grad
    def compute(self) -> None:
        """Run every recorded weight-gradient computation, accumulate, then fire DDP's hooks."""
        if not self.num_pending:
            return
        while self._pending:
            add_to_main_grads(self._pending.popleft(), self.params)
        for hook in self._hooks:
            hook(None)  # DDP's hook takes (*unused)

    def register_hook(self, hook: Callable) -> None:
        self._hooks.append(hook)
