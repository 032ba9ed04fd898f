"""How many SMs the GEMMs launched now leave free for a concurrent collective: ``reserve_sms(n, gemms=None)``.

A context variable (per thread / task), read by the Hopper backend's GEMM launches (``cute/ops.py`` takes it,
``cute/quack_adapter.py`` launches QuACK's plans on fewer clusters); the torch backend's kernels are not persistent
and ignore it.
Results never depend on it: only how many CTAs share a GEMM's tiles changes.

``reserve_sms(n, gemms=k)`` reserves only in the first k GEMMs launched inside: for a phase whose collective is
shorter than the phase (another micro-batch's all-to-all beside it, under Megatron's 1F1B EP overlap), the later
GEMMs take every SM. A CTA keeps its SM until
it ends, so a NCCL kernel that started beside the first GEMM keeps running beside the next one, whose surplus CTAs
wait for it; that costs less than running the whole phase on fewer SMs when the collective ends early in it. The
cute backend launches those later GEMMs (``past_reservation()``) with QuACK's dynamic tile scheduler, so the CTAs
that wait take no tiles the running ones could take.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator


class _Reservation:
    """SMs to leave free, and in how many more GEMM launches (None: every one inside the context)."""

    __slots__ = ("sms", "gemms_left")

    def __init__(self, sms: int, gemms_left: int | None) -> None:
        self.sms, self.gemms_left = sms, gemms_left


_NONE = _Reservation(0, None)
_RESERVATION: contextvars.ContextVar[_Reservation] = contextvars.ContextVar("sonic_megatron_sms", default=_NONE)


def reserved_sms() -> int:
    """SMs the next GEMM launched now would leave free (0 outside ``reserve_sms``)."""
    r = _RESERVATION.get()
    return r.sms if r.gemms_left is None or r.gemms_left > 0 else 0


def past_reservation() -> bool:
    """Inside ``reserve_sms(n > 0, gemms=k)`` after its first k GEMM launches: a GEMM launched now takes every SM
    while the collective the reservation was made for may still hold some of them."""
    r = _RESERVATION.get()
    return r.sms > 0 and r.gemms_left == 0


def take_reservation() -> int:
    """The SMs a GEMM being launched now leaves free (``reserved_sms``); counts the launch against ``gemms``."""
    sms, r = reserved_sms(), _RESERVATION.get()
    if r.gemms_left:  # counts down to 0; None (every launch) is never counted
        r.gemms_left -= 1
    return sms


def check_reservation(n, gemms) -> None:
    """``reserve_sms``'s arguments: n an int >= 0, gemms None or an int >= 0."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"reserve_sms: n must be an int >= 0 (SMs to leave free), got {n!r}")
    if gemms is not None and (not isinstance(gemms, int) or isinstance(gemms, bool) or gemms < 0):
        raise ValueError(f"reserve_sms: gemms must be None (every GEMM) or an int >= 0, got {gemms!r}")


@contextlib.contextmanager
def reserve_sms(n: int, gemms: int | None = None) -> Iterator[None]:
    """QuACK GEMMs launched inside leave at least ``n`` SMs free (n >= 0; 0 = all SMs, QuACK's default);
    with ``gemms`` = k only the first k of them (the later ones take every SM)."""
    check_reservation(n, gemms)
    token = _RESERVATION.set(_Reservation(n, gemms))
    try:
        yield
    finally:
        _RESERVATION.reset(token)


def budgeted_clusters(full_clusters: int, cluster_size: int, reserved: int) -> int:
    """Clusters a persistent GEMM may launch when ``reserved`` SMs must stay free (at least one)."""
    if reserved <= 0:
        return full_clusters
    return max(1, full_clusters - -(-reserved // max(cluster_size, 1)))
