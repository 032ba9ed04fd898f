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


def add_into_main_grads(fn, params) -> bool:
    """When ``fusable_main_grads(params)``: ``fn(out=main_grads)`` adds the gradients there (inside the GEMMs)
    and every param gets ``grad_added_to_main_grad = True`` (as ``accumulate_weight_grad`` sets it); True.
    Otherwise nothing runs and the caller accumulates ``fn()``'s result itself; False."""
    mains = fusable_main_grads(params)
    if mains is None:
        return False
    fn(out=mains)
    for p in params:
        p.grad_added_to_main_grad = True
    return True


class DeferredWeightGrad:
    """Collects the expert weight-gradient GEMMs of backward passes instead of running them.

    Pass one instance as ``wgrad=`` to ``expert_parallel_experts`` / ``local_experts``: backward then
    returns no gradient for w1/w2 and records a closure over the tensors the GEMMs need (received X rows,
    received dO rows, A', dH and the metadata; these stay alive until ``compute()``). ``compute()`` runs
    every recorded GEMM in order and accumulates into ``w.main_grad`` when the weight has one (setting
    ``w.grad_added_to_main_grad = True``, Megatron's fused-accumulation convention; when both weights have one,
    the GEMMs add into them directly: ``fn(out=main_grads)``), else into ``w.grad``.
    The weights must be leaf tensors (parameters).
    """

    def __init__(self) -> None:
        self._pending: list[tuple[Callable[..., tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]] = []

    def record(self, fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], w1: torch.Tensor, w2: torch.Tensor) -> None:
        """Record ``fn() -> (dw1, dw2)`` to accumulate into ``w1`` / ``w2`` later; ``fn(out=(acc1, acc2))``
        must add them into those buffers instead (``backward_weights``' contract)."""
        self._pending.append((fn, w1, w2))

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @torch.no_grad()  # called outside autograd's backward (backward_dw), where the saved tensors may require grad
    def compute(self) -> None:
        """Run the recorded weight-gradient GEMMs and accumulate them (then forget them)."""
        pending, self._pending = self._pending, []
        for fn, w1, w2 in pending:
            if add_into_main_grads(fn, (w1, w2)):  # the GEMMs add straight into the fp32 main_grads
                continue
            dw1, dw2 = fn()
            for w, g in ((w1, dw1), (w2, dw2)):
                if w.requires_grad:
                    accumulate_weight_grad(w, g)
