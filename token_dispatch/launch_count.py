"""Count the host-side work of a region: the torch ops that become GPU kernel launches, the collectives and the
host syncs, in call order -- on any device, so the host cost of the EP layer can be measured on CPUs (gloo).

    with LaunchCounter() as lc:
        out = expert_parallel_experts(...)
    lc.summary()   # {"launches": ..., "collectives": ..., "syncs": ..., "launches_sync_to_row_a2a": ...}

What counts as a launch: every aten op the dispatcher reaches (after autograd and composite decomposition,
as on CUDA) except views, allocations (``empty``/``new_empty``: no kernel) and ops returning no tensor.
``lift_fresh`` (a tensor built from a host list) counts, because on a GPU a host-to-device copy follows it.
Collectives are the ``c10d`` ops; a host sync is ``Tensor.tolist()`` / ``.item()`` (they wait for the
device) or ``nonzero`` (its output size is data on the device: the host waits for it). Triton kernels launched
from Python are not aten ops: the CUDA path replaces some aten chains by them, so CPU counts are those of the
PyTorch path (the reference), an upper bound of the CUDA launches.
"``launches_sync_to_row_a2a``": launches after the last host sync and before the first all-to-all of a
floating 2-D tensor (token rows): the host work that an idle GPU waits for before the first big transfer.
Ops run while ``region(name)`` is active are tallied under that name as well (e.g. the experts' kernels).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ALLOCATIONS = {"empty", "new_empty", "empty_strided", "new_empty_strided", "empty_like"}
_SIZED_BY_DATA = {"nonzero"}  # ops whose output size the host must read from the device


class LaunchCounter(TorchDispatchMode):
    """Records ``(kind, name, region)`` events: kind in launch | collective | sync | row_a2a."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str, str | None]] = []
        self._region: str | None = None
        self._patched: list = []

    # --- dispatch ---------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns, name = func.namespace, func._schema.name.split("::")[-1]
        if ns == "c10d":
            kind = "collective"
            if "alltoall" in name and _is_row_tensor(args):
                kind = "row_a2a"
            self.events.append((kind, name, self._region))
        elif name == "_local_scalar_dense":
            self.events.append(("sync", "item", self._region))
        elif name in _SIZED_BY_DATA:
            self.events.append(("sync", name, self._region))
        elif not (func.is_view or name in _ALLOCATIONS or not _returns_tensor(func)):
            self.events.append(("launch", f"{ns}.{name}", self._region))
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def region(self, name: str):
        """Tag the ops run inside with ``name`` (they still count in the totals)."""
        prev, self._region = self._region, name
        try:
            yield
        finally:
            self._region = prev

    # --- host syncs that bypass the dispatcher ------------------------------------------------------------
    def __enter__(self):
        orig = torch.Tensor.tolist
        counter = self

        def tolist(t, *a, **k):
            counter.events.append(("sync", "tolist", counter._region))
            return orig(t, *a, **k)

        torch.Tensor.tolist = tolist
        self._patched.append(orig)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._patched.pop()
        return super().__exit__(*exc)

    # --- results -----------------------------------------------------------------------------------------
    def summary(self) -> dict:
        ev = self.events
        out = {
            "launches": sum(k == "launch" for k, _, _ in ev),
            "collectives": sum(k in ("collective", "row_a2a") for k, _, _ in ev),
            "syncs": sum(k == "sync" for k, _, _ in ev),
        }
        first_row = next((i for i, (k, _, _) in enumerate(ev) if k == "row_a2a"), None)
        if first_row is not None:
            last_sync = max((i for i, (k, _, _) in enumerate(ev[:first_row]) if k == "sync"), default=-1)
            out["launches_sync_to_row_a2a"] = sum(k == "launch" for k, _, _ in ev[last_sync + 1 : first_row])
            out["collectives_sync_to_row_a2a"] = sum(k == "collective" for k, _, _ in ev[last_sync + 1 : first_row])
        regions = sorted({r for _, _, r in ev if r is not None})
        for r in regions:
            out[f"launches[{r}]"] = sum(k == "launch" and rr == r for k, _, rr in ev)
        return out

    def trace(self) -> list[str]:
        """The events as lines (kind name [region]), for reading what runs where."""
        return [f"{k:10s} {n}" + (f" [{r}]" if r else "") for k, n, r in self.events]


def _returns_tensor(func) -> bool:
    """False for ops that return no tensor (e.g. ``promote_types``): host-only, no kernel."""
    return any("Tensor" in str(r.type) for r in func._schema.returns)


def _is_row_tensor(args) -> bool:
    """True when the collective moves token rows: its first tensor argument is floating point and 2-D."""
    for a in args:
        ts = a if isinstance(a, (list, tuple)) else [a]
        for t in ts:
            if isinstance(t, torch.Tensor):
                return t.is_floating_point() and t.dim() == 2
    return False
