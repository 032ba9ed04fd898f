#!/usr/bin/env python3
"""The plugin layer at expert-parallel size 1 (cute backend, bf16) as one CUDA graph, forward and backward, against
eager steps on one GPU: replays bitwise equal to eager on new inputs (tests/test_cuda_graph_gpu.py checks the same at a
small shape), and step ms of each (CUDA events around ITERS steps, median and min-max) for the bench configs.

    python scripts/gpu_cuda_graph.py [OUT_JSON]      # env ITERS (default 30)
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch

CONFIGS = {"qwen3": (16384, 2048, 768, 128, 8), "sparse": (16384, 2048, 512, 256, 8)}


def _ms(step, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def run_config(shape, iters: int) -> dict:
    """Capture, check and time the layer step at ``shape`` = (T, d, n, E, K)."""
    from sonic_megatron.testing import gpu_layer_inputs, graphed_layer_step, layer_step

    layer, params, x, grad = gpu_layer_inputs(shape)
    entry = {"shape_T_d_n_E_K": shape}
    try:
        replay, static = graphed_layer_step(layer, params, x, grad)
        replay()
        eager = layer_step(layer, params, x, grad)
        entry["bitwise_equal_to_eager"] = all(torch.equal(a, b) for a, b in zip(static, eager, strict=True))
        eager_ms = _ms(lambda: layer_step(layer, params, x, grad), iters)
        graph_ms = _ms(replay, iters)
        entry.update(
            eager_ms_median=statistics.median(eager_ms),
            eager_ms_min_max=(min(eager_ms), max(eager_ms)),
            graph_ms_median=statistics.median(graph_ms),
            graph_ms_min_max=(min(graph_ms), max(graph_ms)),
            speedup=statistics.median(eager_ms) / statistics.median(graph_ms),
        )
    except Exception as exc:  # reported, the next config still runs
        entry["error"] = f"{type(exc).__name__}: {exc}"
    return entry


def main() -> int:
    from sonic_megatron.testing import free_port, init_distributed, init_model_parallel

    out_path = sys.argv[1] if len(sys.argv) > 1 else "cuda_graph.json"
    iters = int(os.environ.get("ITERS", "30"))
    init_distributed(0, 1, port=free_port())
    init_model_parallel(ep=1)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "iters": iters, "configs": {}}
    for name, shape in CONFIGS.items():
        results["configs"][name] = entry = run_config(shape, iters)
        print(name, json.dumps(entry), flush=True)
        torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump(results, f, indent=2)
    ok = all(e.get("bitwise_equal_to_eager") for e in results["configs"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
