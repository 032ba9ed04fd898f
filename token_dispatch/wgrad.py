"""Deferred weight gradients (Megatron's ``backward_dw`` / ``--delay-wgrad-compute``)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def accumulate_weight_grad(w: torch.Tensor, g: torch.Tensor, use_main_grad: bool = True) -> None:
    """Add ``g`` to ``w.main_grad`` when it exists and ``use_main_grad`` (setting Megatron's
    ``w.grad_added_to_main_grad = True``), else to ``w.grad`` (created if absent), in that buffer's dtype."""
    main = getattr(w, "main_grad", None) if use_main_grad else None
    if main is not None:
        main.add_(g.to(main.dtype))
        w.grad_added_to_main_grad = True
    elif w.grad is None:
        w.grad = g.to(w.dtype)
    else:
        w.grad.add_(g.to(w.grad.dtype))


class DeferredWeightGrad:
    """Collects the expert weight-gradient GEMMs of backward passes instead of running them.

    Pass one instance as ``wgrad=`` to ``expert_parallel_experts`` / ``local_experts``: backward then
    returns no gradient for w1/w2 and records a closure over the tensors the GEMMs need (received X rows,
    received dO rows, A', dH and the metadata; these stay alive until ``compute()``). ``compute()`` runs
    every recorded GEMM in order and accumulates into ``w.main_grad`` when the weight has one (setting
    ``w.grad_added_to_main_grad = True``, Megatron's fused-accumulation convention), else into ``w.grad``.
    The weights must be leaf tensors (parameters).
    """

    def __init__(self) -> None:
        self._pending: list[tuple[Callable[[], tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]] = []

    def record(self, fn: Callable[[], tuple[torch.Tensor, torch.Tensor]], w1: torch.Tensor, w2: torch.Tensor) -> None:
        """Record ``fn() -> (dw1, dw2)`` to accumulate into ``w1`` / ``w2`` later."""
        self._pending.append((fn, w1, w2))

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @torch.no_grad()  # called outside autograd's backward (backward_dw), where the saved tensors may require grad
    def compute(self) -> None:
        """Run the recorded weight-gradient GEMMs and accumulate them (then forget them)."""
        pending, self._pending = self._pending, []
        for fn, w1, w2 in pending:
            dw1, dw2 = fn()
            for w, g in ((w1, dw1), (w2, dw2)):
                if w.requires_grad:
                    accumulate_weight_grad(w, g)
