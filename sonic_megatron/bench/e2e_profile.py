"""``bench e2e --profile N``: where each provider's GPU time goes in its last N ``pretrain_gpt.py`` iterations.

Megatron's own profiler (``--profile --use-pytorch-profiler``) records the last N iterations of the run and writes a
Chrome trace; ``summarize_trace`` reads it back: per iteration, the GPU's busy time (the union of its kernels,
copies and memsets) and idle time (the rest of the window from the first GPU event to the last), the time of each
kernel family (``FAMILIES``), and the kernels that took the most. The profiled iterations, the profiler's warm-up
iteration before them and the last iteration (the trace is written at its start) are left out of the run's timing
statistics.
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import re
from collections.abc import Callable

# (family, test on the kernel name); the first match names a kernel's family, "other" when none does.
FAMILIES: tuple[tuple[str, Callable[[str], bool]], ...] = (
    ("expert_gemms_quack", lambda n: "quackgemm" in n),
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


def megatron_flags(iters: int, last: int, tensorboard_dir: str) -> list[str]:
    """pretrain_gpt.py flags that profile ``last`` iterations, iters - last .. iters - 1, and write the trace under
    ``tensorboard_dir``/../torch_profile. Megatron steps its profiler at the start of each iteration: it warms up
    during the iteration before the window and writes the trace at the start of the run's last iteration."""
    start = iters - last
    return [
        *("--profile", "--use-pytorch-profiler"),
        *("--profile-step-start", str(start), "--profile-step-end", str(start + last)),
        *("--tensorboard-dir", tensorboard_dir),
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
    start, end = gpu[0]["ts"], max(e["ts"] + e["dur"] for e in gpu)
    busy, covered = 0.0, start
    families: dict[str, float] = collections.defaultdict(float)
    kernels: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for e in gpu:
        s, f = e["ts"], e["ts"] + e["dur"]
        if f > covered:
            busy += f - max(s, covered)
            covered = f
        families[family(e["name"], e["cat"])] += e["dur"]
        kernels[e["name"]][0] += e["dur"]
        kernels[e["name"]][1] += 1
    per_iter_ms = 1e-3 / iterations  # trace times are in microseconds
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    return {
        "iterations": iterations,
        "trace": path,
        "busy_ms": busy * per_iter_ms,
        "idle_ms": (end - start - busy) * per_iter_ms,
        "families_ms": {k: v * per_iter_ms for k, v in sorted(families.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n, "ms": t * per_iter_ms, "calls": c / iterations} for n, (t, c) in top],
    }


def table_rows(rows: list[dict]) -> tuple[list[dict], list[str]]:
    """One flat row per profiled provider (busy, idle, each family's ms per iteration) and its columns."""
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
                    **{f: prof["families_ms"].get(f, 0.0) for f in fams},
                }
            )
    return out, ["provider", "busy_ms", "idle_ms", *fams]
