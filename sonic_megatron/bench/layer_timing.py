"""``bench layer``'s timing: the ``--chunks`` values, the interleaved rounds and their paired medians, and
the two references of the all-to-all share -- the layer with its all-to-alls skipped and the all-to-alls alone.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist

from .dispatch import sync


def parse_chunks(text: str) -> list[int]:
    """``--chunks``: comma-separated chunk counts N >= 1 (at least one)."""
    entries = [t.strip() for t in text.split(",") if t.strip()]
    if not entries or any(not t.isdigit() or int(t) < 1 for t in entries):
        raise SystemExit(f"--chunks: comma-separated chunk counts N >= 1 (e.g. 1,2), got {text!r}")
    return [int(t) for t in entries]


@contextlib.contextmanager
def no_layer_a2a():
    """Skip the layer's own all-to-alls (token_dispatch.exchange's), not the plan's collectives: the ``no a2a``
    reference of a2a_hidden. Receive buffers keep stale contents; timing only."""
    from ..token_dispatch import exchange

    saved = exchange.all_to_all
    exchange.all_to_all = lambda *a, **k: None
    try:
        yield
    finally:
        exchange.all_to_all = saved


def a2a_alone(plan, x, device):
    """A call of the layer's all-to-alls alone with this plan (its chunks): forward rows to the experts and
    rows back, backward dO rows to the experts and dX rows + dS back. (The forward's scores ride in the
    plan's pair-metadata all-to-all, which is part of the plan, not timed here.)"""
    from ..token_dispatch import exchange as X
    from ..token_dispatch.comm import Pending
    from ..token_dispatch.engine import all_rows, all_rows_back

    send = x.index_select(0, plan.send_token_idx_S)
    recv = all_rows(plan, send)
    s_send = torch.zeros(plan.send_pair_idx.numel(), dtype=torch.float32, device=device)
    s_recv = s_send.new_empty(plan.num_recv_pairs)

    def scores_back():
        pend = Pending()
        for i in range(plan.num_stages):
            X.pairs_to_sources(plan, X.recv_pairs(plan, s_recv, i), s_send, i, pend)
        pend.wait()

    def fn():
        all_rows(plan, send)  # forward dispatch
        all_rows_back(plan, recv)  # forward combine
        all_rows(plan, send)  # backward dO
        all_rows_back(plan, recv)  # backward dX
        scores_back()

    return fn


def timed_rounds(variants: dict, device, warmup: int, rounds: int) -> dict:
    """Interleaved timing: each round runs every variant once, in order, each call from an idle device after a
    barrier. Returns, per variant key, (seconds per round, host seconds per round until the call returned), each
    the max over ranks of that round. Interleaving puts all variants under the same host and clock conditions,
    so the difference of two variants is taken round by round (paired) instead of between blocks of calls
    measured seconds apart (the layer is host-bound at the benchmark size, and blocks drifted by up to 1 ms).
    ``variants``: key -> (fn, context factory entered around each call, e.g. ``no_layer_a2a``)."""
    for fn, ctx in variants.values():
        with ctx():
            for _ in range(warmup):
                fn()
    times = torch.zeros(len(variants), rounds, 2, dtype=torch.float64)
    for r in range(rounds):
        for v, (fn, ctx) in enumerate(variants.values()):
            with ctx():
                sync(device)
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                t_host = time.perf_counter() - t0
                sync(device)
                times[v, r, 0], times[v, r, 1] = time.perf_counter() - t0, t_host
    times = times.to(device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    times = times.cpu()
    return {key: (times[v, :, 0].tolist(), times[v, :, 1].tolist()) for v, key in enumerate(variants)}


def median(xs) -> float:
    return statistics.median(xs)


def paired(a: list[float], b: list[float]) -> float:
    """Median over rounds of a[r] - b[r]."""
    return median([x - y for x, y in zip(a, b, strict=True)])
