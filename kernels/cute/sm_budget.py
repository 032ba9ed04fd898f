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
reservation is a ``contextvars.ContextVar`` (per thread / task), not a process-wide setting.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
from collections.abc import Iterator

_RESERVED_SMS: contextvars.ContextVar[int] = contextvars.ContextVar("sonic_megatron_reserved_sms", default=0)
_PATCHED_MODULES = ("quack.gemm", "quack.gemm_act", "quack.gemm_dact")


def reserved_sms() -> int:
    """SMs the GEMMs launched now leave free (0 outside ``reserve_sms``)."""
    return _RESERVED_SMS.get()


@contextlib.contextmanager
def reserve_sms(n: int) -> Iterator[None]:
    """QuACK GEMMs launched inside leave at least ``n`` SMs free (n >= 0; 0 = all SMs, QuACK's default)."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"reserve_sms: n must be an int >= 0 (SMs to leave free), got {n!r}")
    token = _RESERVED_SMS.set(n)
    try:
        yield
    finally:
        _RESERVED_SMS.reset(token)


def budgeted_clusters(full_clusters: int, cluster_size: int, reserved: int) -> int:
    """Clusters a persistent GEMM may launch when ``reserved`` SMs must stay free (at least one)."""
    if reserved <= 0:
        return full_clusters
    return max(1, full_clusters - -(-reserved // max(cluster_size, 1)))


def install() -> None:
    """Route the three QuACK GEMM modules' cluster count through the reservation (idempotent)."""
    from quack import cute_dsl_utils

    full = cute_dsl_utils.get_max_active_clusters

    def get_max_active_clusters(cluster_size: int, *args, **kwargs) -> int:
        return budgeted_clusters(full(cluster_size, *args, **kwargs), cluster_size, _RESERVED_SMS.get())

    get_max_active_clusters.sonic_megatron_budget = True
    for name in _PATCHED_MODULES:
        module = importlib.import_module(name)
        current = getattr(module, "get_max_active_clusters", None)
        if current is None:
            raise ImportError(f"{name} has no get_max_active_clusters: this QuACK version is not supported")
        if not getattr(current, "sonic_megatron_budget", False):
            module.get_max_active_clusters = get_max_active_clusters
