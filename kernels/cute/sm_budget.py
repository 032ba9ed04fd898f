"""Leave SMs free for a collective that runs while the GEMMs do: ``reserve_sms(n)``.

QuACK's SM90 GEMMs are persistent: each launches min(tiles, max active clusters) CTA clusters, i.e. one CTA
on every SM, and every CTA keeps its SM until the whole GEMM ends. A NCCL kernel that becomes ready while such a
GEMM runs (the next chunk's all-to-all on the process group's stream) finds no free SM and starts only when
the GEMM ends: the all-to-all that was meant to overlap runs after it. Inside ``with reserve_sms(n):`` every
QuACK GEMM launches ceil(n / cluster size) fewer clusters, so n SMs stay free for the collective's CTAs (NCCL
runs one CTA per channel; ``NCCL_MAX_NCHANNELS`` / ``NCCL_MIN_NCHANNELS`` set how many). The tiles are the same;
only how many CTAs share them changes, so results are bitwise equal with and without a reservation.

How: QuACK 0.4.1 sizes the grid with ``quack.cute_dsl_utils.get_max_active_clusters`` (a runtime argument of
the compiled kernel, not part of its compile key: no recompilation), looked up at call time in the modules of
the three GEMM families we call (``quack.gemm``, ``quack.gemm_act``, ``quack.gemm_dact``). ``install()``
(called when ``kernels.cute`` is imported) points those three names at a wrapper that subtracts the
reservation of the calling context, and leaves QuACK's value untouched outside ``reserve_sms``. The
reservation itself (a ``contextvars.ContextVar``, per thread / task, not a process-wide setting; optionally for
the first k GEMM launches only) lives in ``kernels/sm_reservation.py``.
"""

from __future__ import annotations

import importlib

from quack import cute_dsl_utils

from ..sm_reservation import budgeted_clusters, reserve_sms, reserved_sms, take_reservation

__all__ = ["clusters_now", "install", "reserve_sms", "reserved_sms"]

_PATCHED_MODULES = ("quack.gemm", "quack.gemm_act", "quack.gemm_dact")


def install() -> None:
    """Route the three QuACK GEMM modules' cluster count through the reservation (idempotent)."""
    full = cute_dsl_utils.get_max_active_clusters

    def get_max_active_clusters(cluster_size: int, *args, **kwargs) -> int:
        return budgeted_clusters(full(cluster_size, *args, **kwargs), cluster_size, take_reservation())

    get_max_active_clusters.sonic_megatron_budget = True
    for name in _PATCHED_MODULES:
        module = importlib.import_module(name)
        current = getattr(module, "get_max_active_clusters", None)
        if current is None:
            raise ImportError(f"{name} has no get_max_active_clusters: this QuACK version is not supported")
        if not getattr(current, "sonic_megatron_budget", False):
            module.get_max_active_clusters = get_max_active_clusters


def clusters_now(cluster_size: int) -> int:
    """The grid (clusters) of a persistent GEMM launched now: QuACK's count less the reservation, which this call
    takes (counts the launch). For launches that bypass QuACK's Python path (``ops.LAUNCHES``)."""
    return budgeted_clusters(cute_dsl_utils.get_max_active_clusters(cluster_size), cluster_size, take_reservation())
