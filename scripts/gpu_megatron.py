#!/usr/bin/env python3
"""The Megatron-integration GPU pass on one host with 4 GPUs (megatron-core >= 0.19):

    python scripts/gpu_megatron.py      # logs + JSON under $OUT (default ./out)

Steps in this order (each its own subprocess with a time limit; a failure or timeout is recorded in
$OUT/gpu_megatron_summary.json and the next step still runs; the pass stays under TOTAL_S, default 470 s,
later steps are skipped when time runs out):
  compare    torchrun x4: SonicMoELayer vs stock MoELayer (same weights) at EP=1, 2, 4 and, with expert tensor
             parallelism (TP = ETP = 2 with sequence parallel, and TP 1 with ETP 2), EP=1, 2 on NCCL: bf16 with the
             GPU backend (auto = cute on H100/H200) and fp32 with the torch backend, random / one-expert /
             rank-0-only routings, shared experts (+ overlap), Megatron's dispatcher with Sonic experts, the
             capacity factor (drop by probs with padding to capacity, drop by position).
             Rule: error vs a float64 stock run <= 2x the stock layer's own error (+1e-6 of the magnitude).
  blockspec  ``sonic_block_spec`` (the --spec function for 0.19's GPTModelBuilder) on a GPTModelConfig with
             mixed dense/MoE layers builds SonicMoELayer exactly where the stock spec has MoE layers.
  graph      the plugin layer at EP 1 (cute, bf16) as one CUDA graph, forward and backward, at the bench configs
             (T 16384, qwen3 / sparse): replays bitwise equal to eager steps, step ms of each; $OUT/cuda_graph.json.
  ckpt       torchrun x4 tests/megatron_ckpt_chain.py: real dist_checkpointing.save/load directories (torch_dist)
             along stock MoELayer (SequentialMLP) EP=4 -> Sonic EP=2 (x expert-DP 2) -> Sonic EP=1 -> stock EP=4,
             then with expert tensor parallelism stock ETP 2 -> Sonic ETP 2 -> Sonic ETP 1 (EP 1, EP 2) -> Sonic
             ETP 2 -> stock ETP 2: expert and router weights bitwise equal to the original global weights after every
             load, the layer output on a fixed input equal at the end; $OUT/ckpt_summary.json and
             $OUT/etp/ckpt_summary.json (per hop: max abs diffs, files, pass).
  overlap    examples/pretrain_gpt_sonic.py (2-layer OLMoE-like, EP=4) with --overlap-moe-expert-parallel-comm
             (Megatron's 1F1B EP A2A overlap schedule), then (overlap_delay_wgrad) also --delay-wgrad-compute
             (deferred expert wgrad in backward_dw; Megatron also defers attention wgrad then, which its local,
             non-Transformer-Engine linears may not support -- the log tells which layer failed).
  bench      bench train, 4-layer OLMoE-like model (EP=4): tokens/s/GPU and peak memory, plugin vs stock.
  curves     bench train, 2-layer OLMoE-like model, CURVE_STEPS (default 200) steps, plugin vs stock from the same
             seed (loss curves).
  twonode    examples/demo.py as two torchrun "nodes" of 2 GPUs (localhost rendezvous, EP=4).
  rounding   as curves with token rounding (nearest, tile 128), plugin only.
Env: OUT, TOTAL_S, STEPS (comma-separated step names to run; default all), CURVE_STEPS.
``python scripts/gpu_megatron.py compare --out DIR`` is step 1's worker (under torchrun).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


def _step(name: str, cmd: list[str], limit: float, out: str, summary: dict, env: dict | None = None) -> None:
    log = os.path.join(out, f"{name}.log")
    print(f"=== {name} (limit {limit:.0f} s): {' '.join(cmd)}", flush=True)
    t0 = time.time()
    with open(log, "w") as f:
        try:
            # Own session, so that a timeout kills torchrun's workers too (they would keep the GPUs busy).
            proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, **(env or {})},
                start_new_session=True,
            )  # fmt: skip
            try:
                rc = proc.wait(timeout=limit)
                status = "ok" if rc == 0 else f"failed (rc {rc})"
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                status = f"timed out after {limit:.0f} s"
        except Exception as exc:  # noqa: BLE001 - keep going with the next step
            status = f"could not run: {exc}"
    summary[name] = {"status": status, "seconds": round(time.time() - t0, 1), "log": log}
    with open(log) as f:
        print("".join(line for line in f.read()[-4000:].splitlines(True) if "warn" not in line.lower()), flush=True)
    print(f"--- {name}: {status} in {time.time() - t0:.0f} s", flush=True)
    with open(os.path.join(out, "gpu_megatron_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)


def _kill_group(proc: subprocess.Popen) -> None:
    import contextlib
    import signal

    # SIGTERM first: torchrun then stops its workers (they run in sessions of their own); then SIGKILL.
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=20)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _torchrun(nproc: int, *args: str, nnodes: int = 1, node_rank: int = 0, port: int = 29511) -> list[str]:
    return [
        PY, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--nnodes={nnodes}",
        f"--node-rank={node_rank}", "--master-addr=127.0.0.1", f"--master-port={port}", *args,
    ]  # fmt: skip


def driver() -> int:
    out = os.path.abspath(os.environ.get("OUT", "out"))
    os.makedirs(out, exist_ok=True)
    total = float(os.environ.get("TOTAL_S", "470"))
    t_start = time.time()
    summary: dict = {}
    bench = [PY, "-m", "sonic_megatron", "bench", "train"]
    curve_steps = os.environ.get("CURVE_STEPS", "200")  # loss-curve length of curves / rounding
    overlap_args = ("--preset", "olmoe-small", "--layers", "2", "--seq", "1024", "--steps", "10")
    plan = [
        ("compare", _torchrun(4, __file__, "compare", "--out", out), 140),
        ("blockspec", [PY, __file__, "blockspec"], 30),
        ("graph", [PY, __file__, "graph", "--out", out], 150),
        ("ckpt", _torchrun(4, "tests/megatron_ckpt_chain.py", "--out", out, port=29517), 150),
        ("overlap", _torchrun(4, "examples/pretrain_gpt_sonic.py", *overlap_args, "--overlap-moe-expert-parallel-comm",
                              "--json", os.path.join(out, "overlap.json")), 45),
        ("overlap_delay_wgrad", _torchrun(4, "examples/pretrain_gpt_sonic.py", *overlap_args,
                                          "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute",
                                          "--json", os.path.join(out, "overlap_delay_wgrad.json")), 45),
        ("bench", [*bench, "--steps", "8", "--warmup", "3", "--seq", "2048",
                   "--json", os.path.join(out, "bench_train.json")], 100),
        ("curves", [*bench, "--layers", "2", "--seq", "1024", "--steps", curve_steps, "--warmup", "0",
                    "--json", os.path.join(out, "train_curves.json")], 60 + int(curve_steps) * 0.5),
        ("twonode", None, 40),
        ("rounding", [*bench, "--layers", "2", "--seq", "1024", "--steps", curve_steps, "--warmup", "0",
                      "--specs", "sonic", "--token-rounding", "nearest",
                      "--json", os.path.join(out, "train_curves_rounding.json")], 40 + int(curve_steps) * 0.3),
    ]  # fmt: skip
    only = os.environ.get("STEPS")  # e.g. STEPS=blockspec,overlap: run only these steps
    if only:
        plan = [step for step in plan if step[0] in only.split(",")]
    for name, cmd, limit in plan:
        left = total - (time.time() - t_start)
        if left < 15:
            summary[name] = {"status": "skipped (out of time)"}
            continue
        if name == "twonode":
            _two_node(out, summary, min(limit, left))
            continue
        env = {"CUDA_DEVICE_MAX_CONNECTIONS": "32"} if name.startswith("overlap") else None  # Megatron's advice
        _step(name, cmd, min(limit, left), out, summary, env=env)
    with open(os.path.join(out, "gpu_megatron_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))
    return 0


def _two_node(out: str, summary: dict, limit: float) -> None:
    """Two torchrun groups of 2 GPUs each, one host, rendezvous on localhost: a multi-node launch in small."""
    t0 = time.time()
    procs, logs = [], []
    for node in (0, 1):
        log = open(os.path.join(out, f"twonode_{node}.log"), "w")  # noqa: SIM115 - closed below
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1" if node == 0 else "2,3"}
        cmd = _torchrun(
            2, "examples/demo.py", "--steps", "10", "--preset", "tiny", nnodes=2, node_rank=node, port=29533
        )
        procs.append(
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        )
        logs.append(log)
    status = "ok"
    for p in procs:
        try:
            rc = p.wait(timeout=max(limit - (time.time() - t0), 1))
            if rc != 0:
                status = f"failed (rc {rc})"
        except subprocess.TimeoutExpired:
            _kill_group(p)
            status = f"timed out after {limit:.0f} s"
    for log in logs:
        log.close()
    summary["twonode"] = {"status": status, "seconds": round(time.time() - t0, 1)}
    with open(os.path.join(out, "twonode_0.log")) as f:
        print(f.read()[-1500:], flush=True)
    print(f"--- twonode: {status}", flush=True)


# ---------------------------------------------------------------------------------------------------------
# Step 1 worker (under torchrun)
# ---------------------------------------------------------------------------------------------------------


def _capacity(factor: float, policy: str, pad: bool) -> dict:
    return dict(moe_expert_capacity_factor=factor, moe_token_drop_policy=policy, moe_pad_expert_input_to_capacity=pad)


def compare_worker(out: str) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from sonic_megatron.compare import Case, case_key, compare_case, passes
    from sonic_megatron.config import SonicConfig
    from sonic_megatron.testing import init_distributed, init_model_parallel

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = init_distributed(rank, world, local_rank=int(os.environ.get("LOCAL_RANK", rank)))
    gpu = SonicConfig(backend="auto")
    shared = dict(moe_shared_expert_intermediate_size=512)
    big = dict(hidden_size=1024, moe_ffn_hidden_size=512, num_moe_experts=16, moe_router_topk=4, num_attention_heads=8)
    kw = dict(tokens=(512, 4), dtype=torch.bfloat16)
    cases = [
        Case("bf16_random", big, gpu, **kw),
        Case("bf16_one_expert", big, gpu, route="one_expert", **kw),
        Case("bf16_rank0_only", big, gpu, route="skewed", **kw),
        Case("bf16_shared_overlap", dict(big, **shared, moe_shared_expert_overlap=True), gpu, **kw),
        Case("bf16_megatron_dispatcher", big, SonicConfig(backend="auto", dispatcher="megatron"), **kw),
        Case("fp32_torch_backend", big, SonicConfig(backend="torch"), tokens=(256, 2), dtype=torch.float32),
        # Megatron's capacity factor: the same pairs dropped (and padded to capacity) as the stock layer
        Case("bf16_capacity_probs_pad", dict(big, **_capacity(1.0, "probs", True)), gpu, **kw),
        Case("bf16_capacity_position", dict(big, **_capacity(0.5, "position", False)), gpu, **kw),
    ]
    results = {}
    # (tp, etp, ep): EP alone, TP = ETP = 2, and TP 1 with ETP 2 (Megatron's "MoE parallel folding")
    layouts = [(1, 1, e) for e in (1, 2, 4) if world % e == 0]
    layouts += [(t, 2, e) for t in (2, 1) for e in (1, 2) if world % (2 * e) == 0]
    for tp, etp, ep in layouts:
        init_model_parallel(ep=ep, tp=tp, etp=etp)
        for case in cases:
            key = case_key(case.name, ep, tp, etp)
            if tp > 1:  # Megatron's MoE layer trains with tensor parallelism only under sequence parallelism
                case = dataclasses.replace(case, overrides=dict(case.overrides, sequence_parallel=True))
            try:
                res = compare_case(case, device, seed=10 + rank)
                fails = passes(res, case.dtype)
                results[key] = {"pass": not fails, "failures": fails, "bound": res.get("bound")}
            except Exception as exc:  # noqa: BLE001 - recorded per case
                results[key] = {"pass": False, "failures": [f"raised {exc!r}"]}
            if rank == 0:
                r = results[key]
                print(f"{key}: {'PASS' if r['pass'] else 'FAIL ' + '; '.join(r['failures'])}", flush=True)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"compare_rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if all(r["pass"] for r in results.values()) else 1


def _blockspec_worker(rank: int, world: int) -> None:
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.training.models.gpt import GPTModelConfig

    from sonic_megatron import spec as S
    from sonic_megatron.layer import SonicMoELayer
    from sonic_megatron.testing import init_model_parallel, moe_config

    init_model_parallel(ep=1)
    transformer = moe_config(num_layers=4, moe_layer_freq=[0, 1, 0, 1], transformer_impl="local")  # no TE there
    cfg = GPTModelConfig(transformer=transformer, vocab_size=128, seq_length=32)
    block_spec = S.sonic_block_spec(cfg, vp_stage=None)
    n = S.count_sonic_layers(block_spec)
    block = TransformerBlock(transformer, block_spec).cuda()
    kinds = [type(layer.mlp).__name__ for layer in block.layers]
    print(f"sonic_block_spec: {n} Sonic MoE specs, layers {kinds}", flush=True)
    assert kinds == ["MLP", "SonicMoELayer", "MLP", "SonicMoELayer"] and n == 2, kinds
    assert all(isinstance(layer.mlp, SonicMoELayer) for layer in block.layers[1::2])


GRAPH_CONFIGS = {"qwen3": (16384, 2048, 768, 128, 8), "sparse": (16384, 2048, 512, 256, 8)}


def _ms(step, iters: int) -> list[float]:
    import torch

    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def run_graph_config(shape, iters: int) -> dict:
    """Capture, check and time the layer step at ``shape`` = (T, d, n, E, K)."""
    import statistics

    import torch

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


def graph_worker(out: str) -> int:
    """The plugin layer at EP 1 (cute, bf16) as one CUDA graph, forward and backward, against eager steps at the
    bench configs: replays bitwise equal to eager, and step ms of each (ITERS steps, default 30)."""
    import torch

    from sonic_megatron.testing import free_port, init_distributed, init_model_parallel

    iters = int(os.environ.get("ITERS", "30"))
    init_distributed(0, 1, port=free_port())
    init_model_parallel(ep=1)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "iters": iters, "configs": {}}
    for name, shape in GRAPH_CONFIGS.items():
        results["configs"][name] = entry = run_graph_config(shape, iters)
        print(name, json.dumps(entry), flush=True)
        torch.cuda.empty_cache()
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "cuda_graph.json"), "w") as f:
        json.dump(results, f, indent=2)
    return 0 if all(e.get("bitwise_equal_to_eager") for e in results["configs"].values()) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "blockspec":
        import warnings

        warnings.filterwarnings("ignore")
        sys.path.insert(0, ROOT)
        from sonic_megatron.testing import spawn

        spawn(_blockspec_worker, 1)
        print("blockspec: ok")
        sys.exit(0)
    if len(sys.argv) > 1 and sys.argv[1] == "compare":
        sys.exit(compare_worker(sys.argv[sys.argv.index("--out") + 1]))
    if len(sys.argv) > 1 and sys.argv[1] == "graph":
        sys.exit(graph_worker(sys.argv[sys.argv.index("--out") + 1]))
    sys.exit(driver())
