"""``bench e2e --profile N``: where each provider's GPU time goes in its last N ``pretrain_gpt.py`` iterations.

Megatron's own profiler (``--profile --use-pytorch-profiler``) records the last N iterations of the run and writes a
Chrome trace; ``summarize_trace`` reads it back: per iteration, the GPU's busy time (the union of its kernels,
copies and memsets) and idle time (the rest of the window from the first GPU event to the last), the time of each
kernel family (``FAMILIES``), the kernels that took the most, and where the GPU waited: each idle gap is charged
to the host op that launched the GPU event ending it (the innermost ``cpu_op`` around its CUDA runtime call), which
tells a gap behind a host sync or a host-bound stretch from one inside a layer, and to that call's thread (the main
one runs the forward and the optimizer, autograd's the backward: a host sync in the forward shows as idle before the
main thread's launches). The communication: the time of NCCL's
kernels (the union of their intervals), of the all-to-all ones among them (``torch.distributed.all_to_all_single``
runs as NCCL's grouped sends and receives, ``ncclDevKernel_SendRecv``), and the share of the all-to-all time during
which a compute kernel (any kernel but NCCL's; copies and memsets are not compute) runs beside it on the same GPU:
the all-to-all time that expert-parallel overlap hides; the NCCL all-gather time (the expert-parallel plan's sizes
exchange: a rank's GPU waits in it for the slowest rank's host). The host: the time its threads wait for
the GPU in synchronizing CUDA calls, and the time they spend in host ops otherwise (per thread, the union of its
CPU ops and CUDA calls less those waits, summed over the threads: near the iteration's time, the host paces the run,
and host time cut from a layer is time cut from the iteration), with the outermost host ops that take the most of
it. Each is also given
per iteration window: the profiler's steps (``ProfilerStep#N``) split the GPU timeline where the first GPU event
that a step launched starts. The profiled iterations, the profiler's warm-up iteration before them and the last
iteration (the trace is written at its start) are left out of the run's timing statistics.
"""

from __future__ import annotations

import bisect
import collections
import gzip
import json
import os
import re
from collections.abc import Callable, Iterable

# (family, test on the kernel name); the first match names a kernel's family, "other" when none does.
FAMILIES: tuple[tuple[str, Callable[[str], bool]], ...] = (
    # QuACK's GEMMs: "quackgemm_..." and, for those with an epilogue of its own (gated, dgated), "quackepilogue..."
    ("expert_gemms_quack", lambda n: "kernel_quack" in n),
    ("grouped_gemms_cutlass", lambda n: "GroupProblemShape" in n),
    ("dense_gemms", lambda n: n.startswith("nvjet") or "gemm" in n.lower() or "xmma" in n),
    ("optimizer_multi_tensor", lambda n: "multi_tensor_apply" in n),
    ("triton", lambda n: re.fullmatch(r"_?[A-Za-z0-9_]+_kernel", n) is not None),  # bare names: ours and others
    ("softmax", lambda n: "softmax" in n.lower()),
    ("reductions", lambda n: "reduce_kernel" in n),
    ("elementwise_index_copy", lambda n: bool(re.search(r"elementwise|vectorized|unrolled|CatArray|index|scatter", n))),
)
COPIES, MEMSETS, OTHER = "copies", "memsets", "other"
TOP_KERNELS = 15
TOP_GAPS = 15  # idle charged per launching host op: the ops with the most idle time
TOP_HOST_OPS = 15  # the outermost host ops with the most time
UNKNOWN_LAUNCH = "(launch not in trace)"
_MAX_WALK = 5000
# NCCL's kernels: ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>), ncclDevKernel_AllGather_RING_LL(...),
# ncclKernel_... in older NCCL releases.
NCCL_PREFIX = "nccl"
# all_to_all_single is a group of point-to-point sends and receives in NCCL: one SendRecv kernel per call.
ALL_TO_ALL_MARKERS = ("sendrecv", "alltoall")
PROFILER_STEP = re.compile(r"ProfilerStep#(\d+)")
# The host op autograd's engine runs each backward node in; its thread launches the backward's kernels.
BACKWARD_NODE = "autograd::engine::evaluate_function"

Interval = tuple[float, float]


def megatron_flags(iters: int, last: int, tensorboard_dir: str, stacks: bool = False) -> list[str]:
    """pretrain_gpt.py flags that profile ``last`` iterations, iters - last .. iters - 1, and write the trace under
    ``tensorboard_dir``/../torch_profile. Megatron steps its profiler at the start of each iteration: it warms up
    during the iteration before the window and writes the trace at the start of the run's last iteration.
    ``stacks``: with the Python frames around every op (``e2e_frames.py``)."""
    start = iters - last
    return [
        *("--profile", "--use-pytorch-profiler"),
        *("--profile-step-start", str(start), "--profile-step-end", str(start + last)),
        *("--tensorboard-dir", tensorboard_dir),
        *(("--pytorch-profiler-collect-callstack",) if stacks else ()),
    ]


def trace_path(tensorboard_dir: str) -> str:
    """Where Megatron writes rank 0's trace for ``--tensorboard-dir tensorboard_dir``."""
    return os.path.join(os.path.dirname(os.path.abspath(tensorboard_dir)), "torch_profile", "rank-0.json.gz")


def last_timed_iteration(iters: int, last: int) -> int:
    """The last iteration that the profiler leaves untouched (the one before its warm-up iteration)."""
    return iters - last - 2


def family(name: str, category: str) -> str:
    if category == "gpu_memcpy":
        return COPIES
    if category == "gpu_memset":
        return MEMSETS
    return next((fam for fam, test in FAMILIES if test(name)), OTHER)


class _HostOps:
    """The innermost host event around a time on a thread, among ``events`` (per thread, sorted by start)."""

    def __init__(self, events: list[dict]):
        by_tid: dict = collections.defaultdict(list)
        for e in events:
            by_tid[e.get("tid")].append((e["ts"], e["ts"] + e["dur"], e["name"]))
        self.ops = {tid: sorted(ops) for tid, ops in by_tid.items()}
        self.starts = {tid: [o[0] for o in ops] for tid, ops in self.ops.items()}

    def around(self, tid, ts: float) -> str | None:
        ops = self.ops.get(tid, [])
        i = bisect.bisect_right(self.starts.get(tid, []), ts)
        # the latest-starting event that still contains ts is the innermost (nested events start after their
        # parents); the walk back is bounded, as a launch sits within a few thousand host events of its op's start
        for j in range(i - 1, max(i - _MAX_WALK, 0) - 1, -1):
            if ops[j][1] >= ts:
                return ops[j][2]
        return None


def _is_context(e: dict) -> bool:
    """A host event that names where an op runs: a user annotation (the optimizer's step, Megatron's ranges) other
    than the profiler's step, or a non-ATen op (an autograd node's backward, a custom autograd Function)."""
    if e.get("cat") == "user_annotation":
        return not e["name"].startswith("ProfilerStep")
    return e.get("cat") == "cpu_op" and not e["name"].startswith("aten::")


def _launchers(events: list[dict], calls: dict) -> dict:
    """correlation id -> "op [context]": the innermost host op around the CUDA runtime call that launched that GPU
    event (``calls``: ``_launch_calls(events)``), and the innermost context (``_is_context``) around it."""
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    ops = _HostOps([e for e in host if e["cat"] == "cpu_op"])
    contexts = _HostOps([e for e in host if _is_context(e)])
    out = {}
    for corr, e in calls.items():
        op = ops.around(e.get("tid"), e["ts"]) or e["name"]
        context = contexts.around(e.get("tid"), e["ts"])
        out[corr] = f"{op} [{context}]" if context and context != op else op
    return out


# ----------------------------------------------------------------------------------------------------------
# Interval arithmetic: unions are sorted lists of disjoint (start, end) intervals
# ----------------------------------------------------------------------------------------------------------


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted disjoint intervals (touching ones merged)."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def length(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The intersection of two unions, by one sweep over both."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:  # the interval that ends first cannot meet anything further in the other union
            i += 1
        else:
            j += 1
    return out


def clip(intervals: list[Interval], lo: float, hi: float) -> list[Interval]:
    """The part of a union inside [lo, hi)."""
    i = bisect.bisect_right(intervals, lo, key=lambda iv: iv[1])  # the first interval ending after lo
    out = []
    while i < len(intervals) and intervals[i][0] < hi:
        out.append((max(intervals[i][0], lo), min(intervals[i][1], hi)))
        i += 1
    return out


# ----------------------------------------------------------------------------------------------------------
# Communication kernels and iteration windows
# ----------------------------------------------------------------------------------------------------------


def is_nccl(name: str) -> bool:
    return name.removeprefix("void ").startswith(NCCL_PREFIX)  # a demangled template kernel names its return type


def is_all_gather(name: str) -> bool:
    return is_nccl(name) and "allgather" in name.lower()


# CUDA runtime calls in which the host thread waits for the GPU (a cudaMemcpy without Async returns when done).
HOST_WAITS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")


def host_wait_us(events: list[dict]) -> float:
    """Time the host threads (the main one and autograd's, which launches the backward) spend waiting for the GPU in
    ``HOST_WAITS`` calls: little of it beside much GPU idle means the host, not the GPU, paces the run."""
    return sum(
        e["dur"]
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver") and e["name"] in HOST_WAITS
    )


def _host_events_by_thread(events: list[dict]) -> dict:
    """Per host thread (pid, tid), its CPU ops, user ranges (not the profiler's steps) and CUDA calls."""
    per_thread: dict = collections.defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver"):
            continue
        if e["cat"] == "user_annotation" and PROFILER_STEP.match(e["name"]):
            continue
        per_thread[(e.get("pid"), e.get("tid"))].append(e)
    return per_thread


def host_top_ops(events: list[dict], iterations: int) -> list[dict]:
    """The outermost host ops (per thread, an op inside no other op of its thread) with the most time, by name:
    ms and calls per iteration (``_LocalExperts`` in the forward, ``autograd::engine::evaluate_function: ...`` in the
    backward). Where the host paces the run, these are what to cut."""
    totals: dict = collections.defaultdict(lambda: [0.0, 0])
    for evs in _host_events_by_thread(events).values():
        end = float("-inf")
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            if e["ts"] >= end:
                totals[e["name"]][0] += e["dur"]
                totals[e["name"]][1] += 1
                end = e["ts"] + e["dur"]
    top = sorted(totals.items(), key=lambda kv: -kv[1][0])[:TOP_HOST_OPS]
    return [{"op": n, "ms": t * 1e-3 / iterations, "calls": c / iterations} for n, (t, c) in top]


def host_ops_us(events: list[dict]) -> float:
    """Time the host threads spend in ops other than waits for the GPU: per thread, the union of its CPU ops, user
    ranges (not the profiler's steps) and CUDA calls, less its ``HOST_WAITS`` calls, summed over the threads (the
    main one runs the forward, autograd's the backward)."""
    per_thread = _host_events_by_thread(events)
    waits = sum(
        e["dur"]
        for evs in per_thread.values()
        for e in evs
        if e["cat"] in ("cuda_runtime", "cuda_driver") and e["name"] in HOST_WAITS
    )
    spans = (union((e["ts"], e["ts"] + e["dur"]) for e in evs) for evs in per_thread.values())
    return sum(length(u) for u in spans) - waits


def is_all_to_all(name: str) -> bool:
    lower = name.lower()
    return is_nccl(name) and any(marker in lower for marker in ALL_TO_ALL_MARKERS)


def comm_unions(gpu: list[dict]) -> dict[str, list[list[Interval]]]:
    """Per GPU (the trace's ``pid`` of a GPU event), the unions of its NCCL kernels ("nccl"), of the all-to-all ones
    ("all_to_all") and of the all-to-all time with a compute kernel beside it ("all_to_all_hidden"): overlap
    counts within one GPU only, and copies and memsets are not compute."""
    kernels_by_gpu: dict = collections.defaultdict(list)
    for e in gpu:
        if e["cat"] == "kernel":
            kernels_by_gpu[e.get("pid")].append(e)
    out: dict[str, list[list[Interval]]] = {"nccl": [], "all_to_all": [], "all_to_all_hidden": [], "all_gather": []}
    for kernels in kernels_by_gpu.values():
        spans = [(e["name"], (e["ts"], e["ts"] + e["dur"])) for e in kernels]
        all_to_all = union(iv for name, iv in spans if is_all_to_all(name))
        compute = union(iv for name, iv in spans if not is_nccl(name))
        out["nccl"].append(union(iv for name, iv in spans if is_nccl(name)))
        out["all_gather"].append(union(iv for name, iv in spans if is_all_gather(name)))
        out["all_to_all"].append(all_to_all)
        out["all_to_all_hidden"].append(intersect(all_to_all, compute))
    return out


def _launch_calls(events: list[dict]) -> dict:
    """correlation id -> the CUDA runtime (or driver) call that launched that GPU event."""
    return {
        e["args"]["correlation"]: e
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") in ("cuda_runtime", "cuda_driver")
        and (e.get("args") or {}).get("correlation") is not None
    }


def _launch_threads(events: list[dict], calls: dict) -> dict:
    """correlation id -> "backward" where the CUDA call that launched that GPU event (``calls``:
    ``_launch_calls(events)``) ran on a thread of autograd's engine (one that runs ``BACKWARD_NODE`` ops), else
    "main" (the forward, the optimizer, the schedule)."""
    backward = {
        e.get("tid") for e in events if e.get("cat") == "cpu_op" and str(e.get("name", "")).startswith(BACKWARD_NODE)
    }
    return {c: "backward" if e.get("tid") in backward else "main" for c, e in calls.items()}


def _launch_times(events: list[dict]) -> dict:
    """correlation id -> host time of the CUDA runtime call that launched that GPU event."""
    return {c: e["ts"] for c, e in _launch_calls(events).items()}


def iteration_windows(events: list[dict], gpu: list[dict], end: float) -> list[tuple[int, float, float]]:
    """(step, start, end) per profiler step that launched GPU work: a step's window on the GPU timeline starts where
    the first GPU event launched inside its host range (``ProfilerStep#N``) starts and ends where the next step's
    starts (the last at ``end``), so that the windows tile the timeline and each idle gap falls in one of them."""
    steps = sorted(
        (e["ts"], e["ts"] + e["dur"], int(m.group(1)))
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and (m := PROFILER_STEP.fullmatch(e["name"]))
    )
    step_starts = [s[0] for s in steps]
    launched = _launch_times(events)
    first_start: dict[int, float] = {}
    for e in gpu:
        ts = launched.get((e.get("args") or {}).get("correlation"))
        i = bisect.bisect_right(step_starts, ts) - 1 if ts is not None else -1
        if i >= 0 and ts <= steps[i][1]:
            step = steps[i][2]
            first_start[step] = min(first_start.get(step, e["ts"]), e["ts"])
    starts = sorted((t, step) for step, t in first_start.items())
    return [(step, t, starts[k + 1][0] if k + 1 < len(starts) else end) for k, (t, step) in enumerate(starts)]


def _window_summary(step: int, lo: float, hi: float, busy: list[Interval], comm: dict) -> dict:
    """One iteration window's GPU idle, NCCL and all-to-all ms and the all-to-all's hidden share."""

    def ms(name: str) -> float:
        return sum(length(clip(u, lo, hi)) for u in comm[name]) * 1e-3

    all_to_all = ms("all_to_all")
    return {
        "step": step,
        "window_ms": (hi - lo) * 1e-3,
        "idle_ms": (hi - lo - length(clip(busy, lo, hi))) * 1e-3,
        "nccl_ms": ms("nccl"),
        "all_to_all_ms": all_to_all,
        "all_to_all_hidden_share": ms("all_to_all_hidden") / all_to_all if all_to_all else None,
    }


def comm_summary(events: list[dict], gpu: list[dict], iterations: int) -> dict:
    """NCCL and all-to-all ms per iteration, the all-to-all's hidden share over the whole trace and per iteration
    window (see the module docstring)."""
    comm = comm_unions(gpu)
    total = {name: sum(length(u) for u in unions) for name, unions in comm.items()}
    end = max(e["ts"] + e["dur"] for e in gpu)
    busy = union((e["ts"], e["ts"] + e["dur"]) for e in gpu)
    windows = iteration_windows(events, gpu, end)
    per_iter_ms = 1e-3 / iterations
    return {
        "nccl_ms": total["nccl"] * per_iter_ms,
        "all_gather_ms": total["all_gather"] * per_iter_ms,
        "all_to_all_ms": total["all_to_all"] * per_iter_ms,
        "all_to_all_hidden_ms": total["all_to_all_hidden"] * per_iter_ms,
        "all_to_all_hidden_share": total["all_to_all_hidden"] / total["all_to_all"] if total["all_to_all"] else None,
        "per_iteration": [_window_summary(step, lo, hi, busy, comm) for step, lo, hi in windows],
    }


def summarize_trace(path: str, iterations: int) -> dict:
    """GPU time per iteration of a Chrome trace covering ``iterations`` iterations (see the module docstring)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    gpu = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
        key=lambda e: e["ts"],
    )
    if not gpu:
        raise ValueError(f"{path}: no GPU events (was the run on CUDA, and did the profiler window close?)")
    calls = _launch_calls(events)  # the CUDA calls that launched GPU work, by correlation id
    launchers, threads = _launchers(events, calls), _launch_threads(events, calls)
    start, end = gpu[0]["ts"], max(e["ts"] + e["dur"] for e in gpu)
    busy, covered = 0.0, start
    families: dict[str, float] = collections.defaultdict(float)
    kernels: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    idle_by: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    idle_thread = {"main": 0.0, "backward": 0.0, "not_traced": 0.0}
    for e in gpu:
        s, f = e["ts"], e["ts"] + e["dur"]
        if s > covered:  # an idle gap, ended by e: charge it to e's launcher and its thread
            corr = (e.get("args") or {}).get("correlation")
            launcher = launchers.get(corr, UNKNOWN_LAUNCH)
            idle_by[launcher][0] += s - covered
            idle_by[launcher][1] += 1
            idle_thread[threads.get(corr, "not_traced")] += s - covered
        if f > covered:
            busy += f - max(s, covered)
            covered = f
        families[family(e["name"], e["cat"])] += e["dur"]
        kernels[e["name"]][0] += e["dur"]
        kernels[e["name"]][1] += 1
    per_iter_ms = 1e-3 / iterations  # trace times are in microseconds
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    gaps = sorted(idle_by.items(), key=lambda kv: -kv[1][0])[:TOP_GAPS]
    return {
        "iterations": iterations,
        "trace": path,
        "busy_ms": busy * per_iter_ms,
        "idle_ms": (end - start - busy) * per_iter_ms,
        "host_wait_ms": host_wait_us(events) * per_iter_ms,
        "host_ops_ms": host_ops_us(events) * per_iter_ms,
        **comm_summary(events, gpu, iterations),
        "families_ms": {k: v * per_iter_ms for k, v in sorted(families.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n, "ms": t * per_iter_ms, "calls": c / iterations} for n, (t, c) in top],
        "idle_by_launcher": [{"launcher": n, "ms": t * per_iter_ms, "gaps": c / iterations} for n, (t, c) in gaps],
        "idle_by_thread_ms": {k: v * per_iter_ms for k, v in idle_thread.items()},
        "host_top_ops": host_top_ops(events, iterations),
        **frames_summary(events, gpu, iterations),
    }


def frames_summary(events: list[dict], gpu: list[dict], iterations: int) -> dict:
    """Kernels by layer and host frames where the trace has Python frames (``e2e_frames.py``)."""
    from . import e2e_frames  # it reads this module's interval helpers

    return e2e_frames.frames_summary(events, gpu, iterations)


COMM_COLUMNS = ("host_wait_ms", "host_ops_ms", "nccl_ms", "all_gather_ms", "all_to_all_ms", "all_to_all_hidden_share")


def table_rows(rows: list[dict]) -> tuple[list[dict], list[str]]:
    """One flat row per profiled provider (busy, idle, host wait, NCCL, all-gather and all-to-all ms and the
    all-to-all's hidden share, each family's ms per iteration) and its columns."""
    fams = [f for f, _ in FAMILIES] + [COPIES, MEMSETS, OTHER]
    out = []
    for r in rows:
        prof = r.get("profile")
        if prof:
            out.append(
                {
                    "provider": r["provider"],
                    "busy_ms": prof["busy_ms"],
                    "idle_ms": prof["idle_ms"],
                    **{c: prof.get(c) for c in COMM_COLUMNS},
                    **{f: prof["families_ms"].get(f, 0.0) for f in fams},
                }
            )
    return out, ["provider", "busy_ms", "idle_ms", *COMM_COLUMNS, *fams]


def _share_text(share: float | None) -> str:
    return "no all-to-all" if share is None else f"{100 * share:.0f} % of it hidden behind compute"


def summary_text(prof: dict) -> str:
    """The communication part of a provider's summary line, per iteration."""
    return (
        f"GPU idle {prof['idle_ms']:.2f} ms/iter{_idle_threads_text(prof)}, host waiting for the GPU "
        f"{prof['host_wait_ms']:.2f} ms/iter "
        f"(in other ops {prof['host_ops_ms']:.2f}), "
        f"NCCL {prof['nccl_ms']:.2f} ms/iter (all-gather {prof['all_gather_ms']:.2f}), all-to-all "
        f"{prof['all_to_all_ms']:.2f} ms/iter ({_share_text(prof['all_to_all_hidden_share'])})"
    )


def _idle_threads_text(prof: dict) -> str:
    """Where the idle gaps end: in work the main thread launched (forward, optimizer) or autograd's (backward)."""
    by = prof.get("idle_by_thread_ms")
    if not by:
        return ""
    return f" (before the main thread's launches {by['main']:.2f}, the backward's {by['backward']:.2f})"


def window_lines(provider: str, prof: dict) -> list[str]:
    """One line per iteration window of a profile: its idle, NCCL and all-to-all ms and the hidden share."""
    return [
        f"  {provider}: step {w['step']}: {w['window_ms']:.2f} ms window, GPU idle {w['idle_ms']:.2f} ms, NCCL "
        f"{w['nccl_ms']:.2f} ms, all-to-all {w['all_to_all_ms']:.2f} ms ({_share_text(w['all_to_all_hidden_share'])})"
        for w in prof.get("per_iteration", [])
    ]
