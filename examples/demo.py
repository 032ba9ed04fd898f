"""sonic-megatron demo: train a tiny GPT-MoE (megatron.core GPTModel, Sonic MoE layers) for a few steps with
expert parallelism, printing loss, tokens/s and memory.

    python examples/demo.py                      # spawns 2 processes (CPU: gloo + torch backend; GPUs: NCCL)
    torchrun --nproc-per-node 2 examples/demo.py # or let torchrun start them
    python examples/demo.py --spec stock         # the same model with Megatron's stock MoE layer

Runs on a CPU-only machine with megatron-core >= 0.16 in well under two minutes. Arguments (and the
``SONIC_MEGATRON_*`` environment) are checked before any process starts.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings


def parse_args(argv=None):
    """The demo's arguments, checked against each other and this machine (argparse's usage error, exit
    status 2, on a bad one), so that nothing is spawned for a run that cannot start."""
    from sonic_megatron.kernels import BACKENDS

    from sonic_megatron.config import ROUNDING_MODES
    from sonic_megatron.gpt import PRESETS

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: all processes)")
    p.add_argument("--steps", type=int, default=20, help="training steps (>= 1)")
    p.add_argument("--preset", choices=list(PRESETS), default="tiny", help="model shape (sonic_megatron.gpt.PRESETS)")
    p.add_argument("--spec", choices=("sonic", "stock"), default="sonic", help="MoE layer: plugin or stock")
    p.add_argument(
        "--backend", choices=BACKENDS, default=None, help="experts backend; default auto on GPUs, torch on CPU"
    )
    p.add_argument("--token-rounding", choices=ROUNDING_MODES, default=None, help="plugin only; default none")
    p.add_argument("--rounding-tile", type=int, default=None, help="token rounding multiple (>= 1; default 128)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (> 0)")
    p.add_argument("--json", default=None, help="write losses/throughput as JSON (rank 0; its folder must exist)")
    args = p.parse_args(argv)
    problem = argument_problem(args, world_size(args), PRESETS[args.preset].experts)
    if problem:
        p.error(problem)
    return args


def world_size(args) -> int:
    """Processes of the run: torchrun's WORLD_SIZE, else --nproc."""
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.nproc


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def argument_problem(args, world: int, num_experts: int) -> str | None:
    """What makes these arguments unusable on this machine (None when they are fine)."""
    import torch
    from sonic_megatron.kernels.interface import cute_unavailable_reason

    if args.steps < 1:
        return f"--steps must be >= 1, got {args.steps}"
    if world < 1:
        return f"--nproc must be >= 1, got {world}"
    ep = expert_parallel_size(args, world)
    if ep < 1 or world % ep != 0:
        return f"--ep must be >= 1 and divide the {world} processes, got {ep}"
    if num_experts % ep != 0:
        return f"--preset {args.preset} has {num_experts} experts, which --ep {ep} does not divide"
    if args.rounding_tile is not None and args.rounding_tile < 1:
        return f"--rounding-tile must be >= 1, got {args.rounding_tile}"
    if not (math.isfinite(args.lr) and args.lr > 0):  # AdamW would refuse it in every process, after the spawn
        return f"--lr must be a finite number > 0, got {args.lr!r}"
    if args.json is not None:
        problem = json_path_problem(args.json)
        if problem:
            return f"--json {args.json!r}: {problem}"
    if args.spec == "stock" and (args.backend or args.token_rounding or args.rounding_tile):
        return "--backend, --token-rounding and --rounding-tile choose plugin options: use them with --spec sonic"
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    try:  # the plugin options and the SONIC_MEGATRON_* environment, as the workers will resolve them
        sonic = sonic_config(args, device.type)
    except (TypeError, ValueError) as exc:
        return str(exc)
    reason = None
    if args.spec == "sonic" and sonic.backend == "cute":
        reason = cute_unavailable_reason(device) if device.type == "cuda" else "it needs a CUDA GPU and none is visible"
    if reason:
        return f"backend 'cute' (--backend or SONIC_MEGATRON_BACKEND) cannot run on this machine: {reason}"
    return None


def expert_parallel_size(args, world: int) -> int:
    """--ep, or every process when it is not given (0 is a value to refuse, not "not given")."""
    return world if args.ep is None else args.ep


def json_path_problem(path: str) -> str | None:
    """Why the results cannot be written to ``path`` (checked before training, which would otherwise fail only at
    its end); None when they can."""
    if os.path.isdir(path):
        return "is a folder; give a file path"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"its folder {folder} does not exist"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"its folder {folder} is not writable"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return "the file exists and is not writable"
    return None


def sonic_config(args, device_type: str):
    """The plugin options of this run: the arguments, then SONIC_MEGATRON_* environment overrides."""
    from sonic_megatron.config import SonicConfig

    base = SonicConfig(
        backend=args.backend or ("auto" if device_type == "cuda" else "torch"),
        token_rounding=args.token_rounding or "none",
        rounding_tile=128 if args.rounding_tile is None else args.rounding_tile,
    )
    return SonicConfig.resolve(base)


def main_worker(rank: int, world: int, args) -> None:
    import torch

    from sonic_megatron.gpt import PRESETS, build_model, train
    from sonic_megatron.testing import init_model_parallel

    ep = expert_parallel_size(args, world)
    init_model_parallel(ep=ep)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    preset = PRESETS[args.preset]
    model = build_model(
        preset, args.spec, ep=ep, dtype=dtype, device=device, sonic_config=sonic_config(args, device.type)
    )
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
    if under_torchrun():
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
