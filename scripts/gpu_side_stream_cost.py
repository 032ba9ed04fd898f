#!/usr/bin/env python3
"""Host cost of the calls that plan_stream "side" adds to an interleaved step (one GPU, no collectives), each
timed in a loop with a GEMM queued on the current stream (as in the step): event create + record, stream
wait_event / wait_stream, entering a stream context, a pinned 2 KiB device-to-host copy + stream sync, an
allocation from the side stream's memory + record_stream, and a plain allocation for comparison.

    python3 scripts/gpu_side_stream_cost.py       # prints microseconds per call
"""

from __future__ import annotations

import time

import torch
from sonic_megatron.token_dispatch.streams import record_for, side_stream


def per_call_us(fn, n: int = 2000) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    total = 0.0
    for _ in range(n // 100):
        torch.mm(a, a)  # the current stream is busy, as when the step queues its GEMMs
        t0 = time.perf_counter()
        for _ in range(100):
            fn()
        total += time.perf_counter() - t0
        torch.cuda.synchronize()
    return total / n * 1e6


def main() -> None:
    side = side_stream(torch.device("cuda"))
    small = torch.arange(256, device="cuda", dtype=torch.int64)
    like = torch.empty(1, device="cuda", dtype=torch.bfloat16)

    def event():
        e = torch.cuda.Event()
        e.record()

    ev = torch.cuda.Event()
    ev.record()

    def d2h():
        with torch.cuda.stream(side):
            host = torch.empty(small.shape, dtype=small.dtype, pin_memory=True)
            host.copy_(small, non_blocking=True)
            side.synchronize()
            host.tolist()

    rows = {
        "event create + record": event,
        "side.wait_event": lambda: side.wait_event(ev),
        "current.wait_stream(side)": lambda: torch.cuda.current_stream().wait_stream(side),
        "enter + leave torch.cuda.stream(side)": lambda: _ctx(side),
        "pinned D2H 2 KiB + side.synchronize()": d2h,
        "pageable tolist 2 KiB (current, idle)": None,
        "64 MiB from the side stream + record_for + free": lambda: _side_buffer(like, side),
        "new_empty 64 MiB (current) + free": lambda: like.new_empty(32768, 1024),
    }
    for name, fn in rows.items():
        if fn is None:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                small.tolist()
            print(f"{name:45s} {(time.perf_counter() - t0) / 200 * 1e6:8.1f} us", flush=True)
            continue
        print(f"{name:45s} {per_call_us(fn):8.1f} us", flush=True)


def _side_buffer(like, stream) -> None:
    current = torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        record_for(like.new_empty(32768, 1024), current)


def _ctx(stream) -> None:
    with torch.cuda.stream(stream):
        pass


if __name__ == "__main__":
    main()
