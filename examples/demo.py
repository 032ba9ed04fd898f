"""sonic-megatron demo: train a tiny GPT-MoE (megatron.core GPTModel, Sonic MoE layers) for a few steps with
expert parallelism, printing loss, tokens/s and memory.

    python examples/demo.py                      # spawns 2 processes (CPU: gloo + torch backend; GPUs: NCCL)
    torchrun --nproc-per-node 2 examples/demo.py # or let torchrun start them
    python examples/demo.py --spec stock         # the same model with Megatron's stock MoE layer

Runs on a CPU-only machine with megatron-core >= 0.16 in well under two minutes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: all processes)")
    p.add_argument("--steps", type=int, default=20, help="training steps")
    p.add_argument("--preset", default="tiny", help="model preset of sonic_megatron.gpt.PRESETS")
    p.add_argument("--spec", choices=("sonic", "stock"), default="sonic", help="MoE layer: plugin or stock")
    p.add_argument("--backend", default=None, help="experts backend (auto|torch|cute); default auto")
    p.add_argument("--token-rounding", default=None, help="none|nearest|up|down (plugin only)")
    p.add_argument("--rounding-tile", type=int, default=None, help="token rounding multiple")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--json", default=None, help="write losses/throughput as JSON (rank 0)")
    return p.parse_args(argv)


def main_worker(rank: int, world: int, args) -> None:
    import torch

    from sonic_megatron.config import SonicConfig
    from sonic_megatron.gpt import PRESETS, build_model, train
    from sonic_megatron.testing import init_model_parallel

    ep = args.ep or world
    init_model_parallel(ep=ep)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sonic = SonicConfig(
        backend=args.backend or ("auto" if device.type == "cuda" else "torch"),
        token_rounding=args.token_rounding or "none",
        rounding_tile=args.rounding_tile or 128,
    )
    preset = PRESETS[args.preset]
    model = build_model(preset, args.spec, ep=ep, dtype=dtype, device=device, sonic_config=SonicConfig.resolve(sonic))
    log = print if rank == 0 else (lambda *a, **k: None)
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"sonic-megatron demo: {args.spec} MoE layers, {world} processes, EP={ep}, device {device.type}, "
        f"{dtype}, preset {args.preset} ({n_params / 1e6:.2f} M params/rank)"
    )
    t0 = time.perf_counter()
    res = train(model, preset, steps=args.steps, lr=args.lr, device=device, log=log)
    log(
        f"done in {time.perf_counter() - t0:.1f} s: loss {res['losses'][0]:.3f} -> {res['losses'][-1]:.3f}, "
        f"{res['tokens_per_s_per_rank']:.0f} tokens/s/rank, peak memory {res['peak_memory_mib']:.0f} MiB/rank "
        f"({'GPU allocated' if device.type == 'cuda' else 'CPU RSS'})"
    )
    if rank == 0 and args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "world": world, "ep": ep, **res}, f, indent=2)


def _spawned(rank: int, world: int, args) -> None:
    main_worker(rank, world, args)


def main(argv=None) -> int:
    warnings.filterwarnings("ignore")
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        from sonic_megatron.testing import init_distributed

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        init_distributed(rank, world, local_rank=int(os.environ.get("LOCAL_RANK", rank)))
        main_worker(rank, world, args)
        import torch.distributed as dist

        dist.destroy_process_group()
        return 0
    from sonic_megatron.testing import spawn

    spawn(_spawned, args.nproc, args, timeout=1800)
    return 0


if __name__ == "__main__":
    sys.exit(main())
