"""``python -m sonic_megatron bench train``: GPT-MoE training throughput (tokens/s per GPU) and peak memory,
plugin spec vs a grouped-GEMM baseline, same config, same data, same seed.

Spawns ``--nproc`` processes (default: every GPU, or 2 on a CPU) with EP = ``--ep`` (default: all of them),
trains each spec for ``--warmup`` + ``--steps`` steps (AdamW, synthetic tokens) and reports the mean step
time of the timed steps. Specs (``--specs``): ``sonic`` (the plugin), ``grouped`` (Megatron's MoE layer and
dispatcher with ``sonic_megatron.baseline``'s torch._grouped_mm experts, TEGroupedMLP with Transformer Engine:
the baseline of the speedup column when it runs), ``stock`` (whatever Megatron builds for this install with
``get_gpt_decoder_block_spec``: its local SequentialMLP without Transformer Engine; the baseline when
``grouped`` does not run). The JSON records each spec's experts class so the baseline is explicit.
End to end on Megatron-LM's own launcher: ``bench e2e``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
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
    parser.add_argument(
        "--specs", default="sonic,grouped", help="comma-separated specs to run, in order: sonic, grouped, stock"
    )
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

    try:
        args.specs = ",".join(parse_specs(args.specs))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    nproc = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "train.json")
        spawn(_worker, nproc, args, out, timeout=3600)
        with open(out) as f:
            result = json.load(f)
    rows = result["rows"]
    baseline = baseline_spec([r["spec"] for r in rows])
    base = next((r for r in rows if r["spec"] == baseline), None)
    for r in rows:
        r["speedup_vs_baseline"] = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"] if base else None
    print(f"baseline: {baseline or 'none'}")
    print_table(
        rows, ["spec", "experts", "tokens_per_s_per_gpu", "speedup_vs_baseline", "peak_memory_mib", "final_loss"]
    )
    write_json(args.json, {"benchmark": "train", "baseline": baseline, **result})
    return 0


SPECS = ("sonic", "grouped", "stock")


def parse_specs(text: str) -> list[str]:
    specs = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in specs if s not in SPECS]
    if not specs or unknown:
        raise ValueError(f"--specs: expected names from {', '.join(SPECS)}, got {text!r}")
    return specs


def baseline_spec(specs: list[str]) -> str | None:
    """The spec the speedups are measured against: ``grouped`` when it runs, else ``stock``, else none."""
    return next((s for s in ("grouped", "stock") if s in specs), None)
