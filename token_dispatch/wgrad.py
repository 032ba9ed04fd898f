"""Deferred weight gradients (Megatron's ``backward_dw`` / ``--delay-wgrad-compute``), convention-free: where a
gradient goes (``.grad``, a framework's fp32 buffer, ...) is decided by the sink the caller gives."""

from __future__ import annotations

from collections.abc import Callable

import torch

# fn(out=None) -> (dw1, dw2); with ``out=(acc1, acc2)`` it adds into those buffers, with ``accumulate=False`` too
# it stores there (``backward_weights``' contract).
WeightGradFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# sink(fn, (w1, w2)): runs fn and puts its gradients where the caller's framework wants them.
WeightGradSinkFn = Callable[[WeightGradFn, tuple[torch.Tensor, torch.Tensor]], None]


def add_to_grad(fn: WeightGradFn, params: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The default sink: autograd's convention, ``w.grad`` created (in w's dtype) or added to."""
    for w, g in zip(params, fn(), strict=True):
        if not w.requires_grad:
            continue
        if w.grad is None:
            w.grad = g.to(w.dtype)
        else:
            w.grad.add_(g.to(w.grad.dtype))


class DeferredWeightGrad:
    """Collects the expert weight-gradient GEMMs of backward passes instead of running them.

    Pass one instance as ``wgrad=`` (an ``EPOptions`` field) to ``expert_parallel_experts`` / ``local_experts``:
    backward then returns no gradient for w1/w2 and records a closure over the tensors the GEMMs need (received
    X rows, received dO rows, A', dH and the metadata; they stay alive until ``compute()``). ``compute()`` hands
    every recorded closure, in order, to ``sink(fn, (w1, w2))`` (default ``add_to_grad``: into ``w.grad``);
    Megatron's ``main_grad`` convention is ``sonic_megatron.wgrad.add_to_main_grads``. The weights must be leaf
    tensors (parameters).
    """

    def __init__(self, sink: WeightGradSinkFn | None = None) -> None:
        if sink is not None and not callable(sink):
            raise TypeError(f"DeferredWeightGrad: sink must be callable(fn, (w1, w2)) or None, got {type(sink)}")
        self._sink = sink if sink is not None else add_to_grad
        self._pending: list[tuple[WeightGradFn, torch.Tensor, torch.Tensor]] = []

    def record(self, fn: WeightGradFn, w1: torch.Tensor, w2: torch.Tensor) -> None:
        """Record ``fn() -> (dw1, dw2)`` to accumulate into ``w1`` / ``w2`` later; ``fn(out=(acc1, acc2))``
        must add them into those buffers instead (``backward_weights``' contract)."""
        self._pending.append((fn, w1, w2))

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @torch.no_grad()  # called outside autograd's backward (backward_dw), where the saved tensors may require grad
    def compute(self) -> None:
        """Hand the recorded weight-gradient GEMMs to the sink (then forget them)."""
        pending, self._pending = self._pending, []
        for fn, w1, w2 in pending:
            self._sink(fn, (w1, w2))
