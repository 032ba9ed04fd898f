"""``bench e2e --profile N --profile-stacks``: a profile with Python call stacks, split by layer.

With ``--pytorch-profiler-collect-callstack`` (``--profile-stacks`` adds it) Megatron's profiler records the Python
frames around every op. It slows every provider's host, so the idle time of such a run is not the run's; what it
adds:

* **kernels by layer**: a GPU event (kernel, copy, memset) belongs to the MoE layers when the host call that launched
  it ran inside a frame of Megatron's MoE package (``MoELayer.forward``: the stock layer and the plugin's alike), or
  inside the backward node of an op that did (autograd numbers each forward op and names that number in its
  backward node); else to the rest of the model. NCCL's kernels are counted apart (their time includes waiting for
  peers). The rest of the model's kernels plus the MoE layers' other kernels is about what an iteration would take
  with nothing idle and every collective hidden;
* **host frames**: the frames of Megatron's MoE package and of the plugin with the most host time (inclusive: a
  frame's time holds its callees'), per iteration and per call: where the host's time in the MoE layers goes.
"""

from __future__ import annotations

import bisect
import collections
import re

from .e2e_profile import BACKWARD_NODE, is_nccl, union

MOE_LAYER_FRAME = re.compile(r"megatron/core/transformer/moe/")  # MoELayer.forward and everything it calls
HOST_FRAME = re.compile(r"(megatron/core/transformer/moe/|sonic_megatron/)")  # frames listed by host_frames
TOP_FRAMES = 25


def has_stacks(events: list[dict]) -> bool:
    """Whether the trace holds Python frames (Megatron's --pytorch-profiler-collect-callstack)."""
    return any(e.get("cat") == "python_function" for e in events)


class _Spans:
    """Per host thread, a union of intervals and the test whether a time falls in it."""

    def __init__(self, per_thread: dict):
        self.unions = {tid: union(iv) for tid, iv in per_thread.items()}
        self.starts = {tid: [s for s, _ in u] for tid, u in self.unions.items()}

    def holds(self, tid, ts: float) -> bool:
        i = bisect.bisect_right(self.starts.get(tid, []), ts) - 1
        return i >= 0 and self.unions[tid][i][1] >= ts


def moe_spans(events: list[dict]) -> _Spans:
    """Per host thread, where it runs the MoE layers: the MoE package's frames, and the backward nodes of the ops
    that ran inside them (by autograd's sequence number and the forward thread it names)."""
    frames: dict = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "python_function" and MOE_LAYER_FRAME.search(e["name"]):
            frames[e.get("tid")].append((e["ts"], e["ts"] + e["dur"]))
    in_frames = _Spans(frames)
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    backward_threads = {e.get("tid") for e in ops if e["name"].startswith(BACKWARD_NODE)}
    moe_ops = set()  # (forward thread, sequence number) of the ops run inside the MoE layers
    for e in ops:
        seq = (e.get("args") or {}).get("Sequence number")
        if seq is not None and e.get("tid") not in backward_threads and in_frames.holds(e.get("tid"), e["ts"]):
            moe_ops.add(seq)
    spans = collections.defaultdict(list, {tid: list(u) for tid, u in in_frames.unions.items()})
    for e in ops:
        args = e.get("args") or {}
        if e["name"].startswith(BACKWARD_NODE) and args.get("Sequence number") in moe_ops:
            spans[e.get("tid")].append((e["ts"], e["ts"] + e["dur"]))
    return _Spans(spans)


def kernels_by_layer(events: list[dict], gpu: list[dict], iterations: int) -> dict:
    """ms per iteration of the GPU events launched from the MoE layers and from the rest of the model, NCCL's apart:
    {"moe": ..., "moe_nccl": ..., "other": ..., "other_nccl": ...} (module docstring)."""
    spans = moe_spans(events)
    launch = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"):
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launch[corr] = spans.holds(e.get("tid"), e["ts"])
    total: dict[str, float] = collections.defaultdict(float)
    for g in gpu:
        where = "moe" if launch.get((g.get("args") or {}).get("correlation")) else "other"
        total[where + ("_nccl" if is_nccl(g["name"]) else "")] += g["dur"]
    return {k: total[k] * 1e-3 / iterations for k in ("moe", "moe_nccl", "other", "other_nccl")}


def host_frames(events: list[dict], iterations: int, top: int = TOP_FRAMES) -> list[dict]:
    """The frames of Megatron's MoE package and the plugin (``HOST_FRAME``) with the most inclusive host time:
    ms and calls per iteration, ms per call. A frame inside another of the same name (recursion) counts once."""
    per_thread: dict = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "python_function" and HOST_FRAME.search(e["name"]):
            per_thread[e.get("tid")].append(e)
    totals: dict = collections.defaultdict(lambda: [0.0, 0])
    for evs in per_thread.values():
        open_until: dict[str, float] = {}  # frame name -> end of its outermost open occurrence
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            if open_until.get(e["name"], float("-inf")) > e["ts"]:
                continue  # inside an occurrence of itself
            open_until[e["name"]] = e["ts"] + e["dur"]
            totals[e["name"]][0] += e["dur"]
            totals[e["name"]][1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [
        {"frame": name, "ms": t * 1e-3 / iterations, "calls": c / iterations, "ms_per_call": t * 1e-3 / c}
        for name, (t, c) in ranked
    ]


def frames_summary(events: list[dict], gpu: list[dict], iterations: int) -> dict:
    """``kernels_by_layer_ms`` and ``host_frames`` of a trace with Python frames; {} without them."""
    if not has_stacks(events):
        return {}
    split = kernels_by_layer(events, gpu, iterations)
    return {"kernels_by_layer_ms": split, "host_frames": host_frames(events, iterations)}


def summary_lines(provider: str, prof: dict, frames: int = 8) -> list[str]:
    """A provider's kernels by layer and its top host frames, one line each (nothing without stacks)."""
    split = prof.get("kernels_by_layer_ms")
    if not split:
        return []
    bound = split["moe"] + split["other"]
    lines = [
        f"  {provider}: kernels of the MoE layers {split['moe']:.2f} ms/iter (NCCL {split['moe_nccl']:.2f}), of the "
        f"rest {split['other']:.2f} (NCCL {split['other_nccl']:.2f}); with nothing idle and NCCL hidden about "
        f"{bound:.2f} ms/iter"
    ]
    for f in prof.get("host_frames", [])[:frames]:
        lines.append(
            f"  {provider}: host {f['ms']:.2f} ms/iter ({f['ms_per_call']:.3f} ms x {f['calls']:.0f}) in {f['frame']}"
        )
    return lines
