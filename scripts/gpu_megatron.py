#!/usr/bin/env python3
"""Megatron-integration GPU pass in ONE device call (nvidia-h200-x4, megatron-core 0.19.2 from the bundle):

    source .devbundle/setup.sh; python scripts/gpu_megatron.py      # logs + JSON under $OUT (default ./out)

Steps in this order (each its own subprocess with a time limit; a failure or timeout is recorded in
$OUT/gpu_megatron_summary.json and the next step still runs; the pass stays under TOTAL_S, default 470 s,
later steps are skipped when time runs out):
  compare    torchrun x4: SonicMoELayer vs stock MoELayer (same weights) at EP=1, 2, 4 on NCCL: bf16 with
             the GPU backend (auto = cute on H100/H200) and fp32 with the torch backend, random / one-expert /
             rank-0-only routings, shared experts (+ overlap), Megatron's dispatcher with Sonic experts.
             Rule: error vs a float64 stock run <= 2x the stock layer's own error (+1e-6 of the magnitude).
  blockspec  ``sonic_block_spec`` (the --spec function for 0.19's GPTModelBuilder) on a GPTModelConfig with
             mixed dense/MoE layers builds SonicMoELayer exactly where the stock spec has MoE layers.
  ckpt       torchrun x4: real dist_checkpointing.save/load directories (torch_dist) along stock MoELayer
             (SequentialMLP) EP=4 -> Sonic EP=2 (x expert-DP 2) -> Sonic EP=1 -> stock EP=4: expert and router
             weights bitwise equal to the original global weights after every load, the layer output on a
             fixed input equal at the end; $OUT/ckpt_summary.json (per hop: max abs diffs, files, pass).
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
        ("compare", _torchrun(4, __file__, "compare", "--out", out), 100),
        ("blockspec", [PY, __file__, "blockspec"], 30),
        ("ckpt", _torchrun(4, __file__, "ckpt", "--out", out, port=29517), 60),
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


def compare_worker(out: str) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from sonic_megatron.compare import Case, compare_case, passes
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
    ]
    results = {}
    for ep in (e for e in (1, 2, 4) if world % e == 0):
        init_model_parallel(ep=ep)
        for case in cases:
            key = f"{case.name}@ep{ep}"
            try:
                res = compare_case(case, device, seed=10 + rank)
                fails = passes(res, case.dtype)
                results[key] = {"pass": not fails, "failures": fails, "bound": res.get("bound")}
            except Exception as exc:  # noqa: BLE001 - recorded per case
                results[key] = {"pass": False, "failures": [f"raised {exc!r}"]}
            if rank == 0:
                r = results[key]
                print(f"{key}: {'PASS' if r['pass'] else 'FAIL ' + '; '.join(r['failures'])}", flush=True)
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


# ---------------------------------------------------------------------------------------------------------
# ckpt step worker (under torchrun on GPUs; tests/test_megatron_checkpoint_files.py runs it on CPUs over gloo)
# ---------------------------------------------------------------------------------------------------------

# Hops of the checkpoint chain: (layer kind, EP size). Hop 0 sets random global weights and saves; every later
# hop loads the previous hop's checkpoint directory, checks it, and saves its own.
CKPT_CHAIN_4 = (("stock", 4), ("sonic", 2), ("sonic", 1), ("stock", 4))
CKPT_CHAIN_2 = (("stock", 2), ("sonic", 1), ("sonic", 2), ("stock", 2))
_CKPT_E, _CKPT_H, _CKPT_F = 8, 64, 96  # experts, hidden, expert ffn: small, so that the pass stays fast


def _ckpt_layer(kind: str, device):
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from sonic_megatron.config import SonicConfig
    from sonic_megatron.layer import SonicMoELayer
    from sonic_megatron.spec import moe_submodules_of
    from sonic_megatron.testing import moe_config

    config = moe_config(num_moe_experts=_CKPT_E, hidden_size=_CKPT_H, moe_ffn_hidden_size=_CKPT_F)
    torch.manual_seed(0)  # construction-time init; every hop overwrites it by loading or by _ckpt_set_global
    if kind == "stock":
        spec = get_gpt_layer_local_spec(num_experts=_CKPT_E, moe_grouped_gemm=False)
        layer = MoELayer(config, moe_submodules_of(spec.submodules.mlp))
    else:
        layer = SonicMoELayer(config, sonic_config=SonicConfig(backend="torch"))
    return layer.to(device)


def _ckpt_global_weights():
    """fc1 [E, 2F, H] ([gate ; up]), fc2 [E, H, F], router [E, H]: random, the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(2024)
    shapes = ((_CKPT_E, 2 * _CKPT_F, _CKPT_H), (_CKPT_E, _CKPT_H, _CKPT_F), (_CKPT_E, _CKPT_H))
    return tuple(torch.randn(s, generator=g) / s[-1] ** 0.5 for s in shapes)  # fan-in scaled


def _ckpt_local(layer):
    """This rank's (fc1, fc2, router) weights as float32 on the CPU."""
    from sonic_megatron.testing import local_moe_weights

    return tuple(t.float().cpu() for t in local_moe_weights(layer))


def _ckpt_expected(ep_rank: int, ep: int):
    w1, w2, r = _ckpt_global_weights()
    sl = slice(ep_rank * (_CKPT_E // ep), (ep_rank + 1) * (_CKPT_E // ep))
    return w1[sl], w2[sl], r


def _ckpt_set_global(layer, ep_rank: int, ep: int) -> None:
    import torch

    w1, w2, r = _ckpt_expected(ep_rank, ep)
    with torch.no_grad():
        ex = layer.experts
        if hasattr(ex, "local_experts"):
            for i, e in enumerate(ex.local_experts):
                e.linear_fc1.weight.copy_(w1[i])
                e.linear_fc2.weight.copy_(w2[i])
        else:
            ex.weight1.copy_(w1)
            ex.weight2.copy_(w2)
        layer.router.weight.copy_(r)


def _ckpt_output(layer, rank: int, device):
    """The layer's output on a fixed input (seeded per rank; tokens cross ranks in the dispatch)."""
    import torch

    g = torch.Generator().manual_seed(99 + rank)
    x = torch.randn(16, 2, _CKPT_H, generator=g).to(device)
    with torch.no_grad():
        out, _ = layer(x)
    return out.float().cpu()


def ckpt_worker(rank: int, world: int, out: str, chain=CKPT_CHAIN_4, ckpt_root: str | None = None) -> dict:
    """Run the checkpoint chain with real ``dist_checkpointing.save/load`` (torch_dist) directories under
    ``ckpt_root`` (default ``out/ckpt``; one host's ranks share it). Per hop, all-reduced over ranks: the max
    abs difference of the loaded expert and router weights from the original global weights (must be 0:
    bitwise) and of the layer output on a fixed input from hop 0's output (must be 0 on the last hop, the
    same layer kind and EP size as hop 0; Sonic hops, fp32 with another EP size and summation order, must be
    within 1e-4 of the output's magnitude). Returns the summary (the same on every rank) and writes it to
    ``out/ckpt_summary.json`` on rank 0. The process group must already exist."""
    import shutil

    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from sonic_megatron.megatron_compat import allow_checkpoint_save_without_psutil
    from sonic_megatron.testing import init_model_parallel

    allow_checkpoint_save_without_psutil()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    root = ckpt_root or os.path.join(out, "ckpt")
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    dist.barrier()
    hops, out0 = [], None
    for i, (kind, ep) in enumerate(chain):
        t0 = time.time()
        init_model_parallel(ep=ep)
        layer = _ckpt_layer(kind, device)
        ep_rank = ps.get_expert_model_parallel_rank()
        hop = {"hop": i, "layer": kind, "ep": ep}
        if i == 0:
            _ckpt_set_global(layer, ep_rank, ep)
        else:
            src = os.path.join(root, f"hop{i - 1}")
            loaded = dist_checkpointing.load(layer.sharded_state_dict(prefix="mlp."), src)
            state = {k[len("mlp.") :]: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
            missing, unexpected = layer.load_state_dict(state, strict=False)
            missing = [k for k in missing if "_extra_state" not in k]
            if missing:
                raise RuntimeError(f"hop {i} ({kind} EP={ep}): keys not in the checkpoint: {missing}")
            hop["loaded_from"] = src
        pairs = zip(_ckpt_local(layer), _ckpt_expected(ep_rank, ep), strict=True)
        diffs = [(got - want).abs().max().item() for got, want in pairs]
        output = _ckpt_output(layer, rank, device)
        out0 = output if i == 0 else out0
        local_stats = [*diffs, (output - out0).abs().max().item(), out0.abs().max().item()]
        stats = torch.tensor(local_stats, dtype=torch.float64, device=device)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # over all ranks: every expert of the global tensors
        fc1, fc2, router, out_diff, out_mag = stats.tolist()
        hop.update(fc1_max_abs_diff=fc1, fc2_max_abs_diff=fc2, router_max_abs_diff=router)
        hop.update(output_max_abs_diff=out_diff, output_max_abs=out_mag)
        dst = os.path.join(root, f"hop{i}")
        if rank == 0:
            os.makedirs(dst)
        dist.barrier()
        dist_checkpointing.save(layer.sharded_state_dict(prefix="mlp."), dst)
        hop["saved_to"] = dst
        hop["files"] = sorted(os.listdir(dst))
        weights_equal = fc1 == 0 and fc2 == 0 and router == 0
        same_as_hop0 = (kind, ep) == tuple(chain[0])
        hop["pass"] = weights_equal and (out_diff == 0 if same_as_hop0 else out_diff <= 1e-4 * hop["output_max_abs"])
        hop["seconds"] = round(time.time() - t0, 2)
        hops.append(hop)
        if rank == 0:
            print(json.dumps(hop), flush=True)
    summary = {"chain": [list(c) for c in chain], "world": world, "hops": hops, "pass": all(h["pass"] for h in hops)}
    if rank == 0:
        with open(os.path.join(out, "ckpt_summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary


def _ckpt_main(out: str) -> int:
    """torchrun entry of the ckpt step: NCCL with a 120 s collective timeout (a stuck save fails instead of
    hanging; the driver's step limit is the outer bound)."""
    import datetime
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))
    # The checkpoint directories (a few MB) stay off $OUT, which is copied back from the device.
    root = os.path.join(os.environ.get("TMPDIR", "/tmp"), "sonic_megatron_ckpt")
    summary = ckpt_worker(rank, world, out, CKPT_CHAIN_4 if world >= 4 else CKPT_CHAIN_2, ckpt_root=root)
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "blockspec":
        import warnings

        warnings.filterwarnings("ignore")
        sys.path.insert(0, ROOT)
        from sonic_megatron.testing import spawn

        spawn(_blockspec_worker, 1)
        print("blockspec: ok")
        sys.exit(0)
    if len(sys.argv) > 1 and sys.argv[1] == "ckpt":
        sys.exit(_ckpt_main(sys.argv[sys.argv.index("--out") + 1]))
    if len(sys.argv) > 1 and sys.argv[1] == "compare":
        sys.exit(compare_worker(sys.argv[sys.argv.index("--out") + 1]))
    sys.exit(driver())
