"""``python -m sonic_megatron bench train``: GPT-MoE training throughput (tokens/s per GPU) and peak memory,
plugin spec vs Megatron's stock spec, same config, same data, same seed.

Spawns ``--nproc`` processes (default: every GPU, or 2 on a CPU) with EP = ``--ep`` (default: all of them),
trains each spec for ``--warmup`` + ``--steps`` steps (AdamW, synthetic tokens) and reports the mean step
time of the timed steps. The stock spec is whatever Megatron builds for this install
(``get_gpt_decoder_block_spec``: TEGroupedMLP with Transformer Engine, else its local experts); the JSON
records the experts class so the baseline is explicit.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default=None, help="model preset (default: olmoe-small on GPUs, tiny on CPU)")
    parser.add_argument("--nproc", type=int, default=None, help="processes (default: GPU count, or 2 on CPU)")
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: nproc)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per spec")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per spec")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    parser.add_argument("--seq", type=int, default=None, help="override the preset's sequence length")
    parser.add_argument("--micro-batch", type=int, default=None, help="override the preset's micro-batch")
    parser.add_argument("--specs", default="sonic,stock", help="comma-separated specs to run, in order")
    parser.add_argument("--token-rounding", default="none", help="plugin token rounding: none|nearest|up|down")


def _worker(rank: int, world: int, args: argparse.Namespace, out_path: str) -> None:
    import torch

    from ..config import SonicConfig
    from ..gpt import PRESETS, build_model, scaled, train
    from ..testing import init_model_parallel

    ep = args.ep or world
    init_model_parallel(ep=ep)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    preset = scaled(
        PRESETS[args.preset or ("olmoe-small" if cuda else "tiny")],
        layers=args.layers,
        seq=args.seq,
        micro_batch=args.micro_batch,
    )
    rows = []
    for spec in args.specs.split(","):
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        sonic = SonicConfig.resolve(
            SonicConfig(backend="auto" if cuda else "torch", token_rounding=args.token_rounding)
        )
        model = build_model(preset, spec, ep=ep, dtype=dtype, device=device, sonic_config=sonic)
        experts = sorted({type(m.experts).__name__ for m in model.modules() if hasattr(m, "token_dispatcher")})
        log = print if rank == 0 else (lambda *a, **k: None)
        log(f"[{spec}] experts {experts}, world {world}, EP {ep}, {dtype}")
        res = train(model, preset, steps=args.warmup + args.steps, lr=1e-4, device=device, log=log, warmup=args.warmup)
        tps = torch.tensor([res["tokens_per_s_per_rank"], res["peak_memory_mib"]], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(tps[:1])
        torch.distributed.all_reduce(tps[1:], op=torch.distributed.ReduceOp.MAX)
        rows.append(
            {
                "spec": spec,
                "experts": ",".join(experts),
                "tokens_per_s_per_gpu": float(tps[0]) / world,
                "peak_memory_mib": float(tps[1]),
                "final_loss": res["losses"][-1],
                "step_ms_timed": res["step_ms"][args.warmup :],
                "losses": res["losses"],
            }
        )
        del model
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"preset": preset.__dict__, "world": world, "ep": ep, "dtype": str(dtype), "rows": rows}, f)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..testing import spawn
    from .common import print_table, write_json

    nproc = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "train.json")
        spawn(_worker, nproc, args, out, timeout=3600)
        with open(out) as f:
            result = json.load(f)
    rows = result["rows"]
    base = next((r for r in rows if r["spec"] == "stock"), None)
    for r in rows:
        r["speedup_vs_stock"] = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"] if base else None
    print_table(rows, ["spec", "experts", "tokens_per_s_per_gpu", "speedup_vs_stock", "peak_memory_mib", "final_loss"])
    write_json(args.json, {"benchmark": "train", **result})
    return 0
