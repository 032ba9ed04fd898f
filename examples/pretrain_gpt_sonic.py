"""pretrain_gpt-style training of a GPT-MoE with the Sonic MoE layers, on megatron.core alone:
Megatron's GPTModel, DistributedDataParallel, distributed optimizer and pipeline schedules (including the
1F1B EP A2A overlap with ``--overlap-moe-expert-parallel-comm --delay-wgrad-compute``), mock data.

    torchrun --nproc-per-node 8 examples/pretrain_gpt_sonic.py --preset olmoe-small --steps 100
    torchrun ... examples/pretrain_gpt_sonic.py --spec stock        # the same run with Megatron's MoE layer

It needs no Megatron-LM checkout and no megatron.training (same code on megatron-core 0.16 .. 0.19). To use
the plugin with Megatron-LM's own ``pretrain_gpt.py`` instead, see examples/README.md (``--spec``).
Mock data: a learnable synthetic token stream (``sonic_megatron.gpt.synthetic_batch``), so the loss falls.
On a CPU it runs over gloo with the torch backend (fp32; the EP overlap needs bf16 on GPUs).
Each process takes GPU ``LOCAL_RANK`` of those it sees, so two torchrun "nodes" on one host need disjoint
``CUDA_VISIBLE_DEVICES`` (examples/train_multi_node.sh sets them). ``--deterministic --param-checksum`` is what
scripts/two_node_check.sh compares: the same run as 1 node x N and 2 nodes x N/2 processes.
``--save DIR --save-interval K --load DIR`` checkpoints (Megatron's torch_dist: model, optimizer, iteration, RNG
states) and resumes at the saved iteration with the same data, at any EP size (tests/test_resume.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny", help="model preset of sonic_megatron.gpt.PRESETS")
    p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--seq", type=int, default=None, help="override the preset's sequence length")
    p.add_argument("--micro-batch", type=int, default=None, help="override the preset's micro-batch size")
    p.add_argument("--num-microbatches", type=int, default=2, help="micro-batches per step (grad accumulation)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: world size)")
    p.add_argument("--spec", choices=("sonic", "stock"), default="sonic", help="MoE layer: plugin or stock")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    p.add_argument("--overlap-moe-expert-parallel-comm", action="store_true", help="Megatron's 1F1B EP A2A overlap")
    p.add_argument("--delay-wgrad-compute", action="store_true", help="defer expert wgrad to backward_dw()")
    p.add_argument(
        "--comm-sms",
        type=int,
        default=0,
        help="SonicConfig.comm_sms: SMs the expert GEMMs leave free for an all-to-all running beside them (pipelined "
        "mode, or with --overlap-moe-expert-parallel-comm); default 0",
    )
    p.add_argument("--use-distributed-optimizer", action="store_true", help="shard optimizer states over DP")
    p.add_argument("--json", default=None, help="write losses and throughput as JSON (rank 0)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the weights (and Megatron's model-parallel RNG)")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="torch.use_deterministic_algorithms (warn only) and CUBLAS_WORKSPACE_CONFIG, for run-to-run equal losses",
    )
    p.add_argument(
        "--param-checksum",
        action="store_true",
        help="print (and put in --json) a SHA-256 of every rank's parameters after the last step",
    )
    p.add_argument(
        "--save",
        default=None,
        metavar="DIR",
        help="write Megatron torch_dist checkpoints to DIR/iter_NNNNNNN (model, optimizer, iteration, RNG states) "
        "every --save-interval iterations and after the last one; DIR/latest_checkpointed_iteration.txt names "
        "the newest complete one",
    )
    p.add_argument("--save-interval", type=int, default=None, metavar="K", help="save every K iterations")
    p.add_argument(
        "--load",
        default=None,
        metavar="DIR",
        help="resume from DIR's latest checkpoint (at its iteration, same data order; another EP size reshards); "
        "without one in DIR, start from scratch",
    )
    p.add_argument(
        "--kill-after-iteration",
        type=int,
        default=None,
        metavar="N",
        help="TEST ONLY (tests/test_resume.py): after iteration N (and its checkpoint, if one is due) every rank "
        "is killed with SIGKILL (the ranks of a host kill each other), a crash between two checkpoints",
    )
    args = p.parse_args(argv)
    for name in ("save_interval", "kill_after_iteration"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.save_interval is not None and not args.save:
        p.error("--save-interval needs --save DIR")
    if args.use_distributed_optimizer and (args.save or args.load) and _distributed_optimizer_over_torch_adam():
        p.error(
            "--use-distributed-optimizer with --save / --load needs Apex or Transformer Engine: over torch's Adam, "
            "Megatron's distributed optimizer cannot reload its own checkpoints (its loaders fail on the "
            "per-parameter 'step' state that torch's Adam keeps)"
        )
    return args


def _distributed_optimizer_over_torch_adam() -> bool:
    """Whether Megatron's distributed optimizer would run over torch's Adam here: a GPU (on a CPU this trainer keeps
    the optimizer unsharded) and neither Apex nor Transformer Engine."""
    import torch

    if not torch.cuda.is_available():
        return False
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def main(argv=None) -> int:
    warnings.filterwarnings("ignore")
    args = parse_args(argv)

    from sonic_megatron.testing import init_distributed, init_model_parallel

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    os.environ.setdefault("MASTER_PORT", "29577")
    if args.deterministic:  # before the first cuBLAS handle
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = init_distributed(rank, world, local_rank=int(os.environ.get("LOCAL_RANK", rank)))
    if args.deterministic:
        import torch

        torch.use_deterministic_algorithms(True, warn_only=True)
    ep = args.ep or world
    init_model_parallel(ep=ep, seed=args.seed)
    res = train(args, device, ep)
    if rank == 0:
        if res["losses"]:
            print(
                f"done: loss {res['losses'][0]:.3f} -> {res['losses'][-1]:.3f}, {res['tokens_per_s_per_gpu']:.0f} "
                f"tokens/s/GPU, peak memory {res['peak_memory_mib']:.0f} MiB"
            )
        else:
            print(f"done: nothing left to train (resumed at iteration {res['start_iteration']} of {args.steps})")
        if "param_checksum" in res:
            print(f"param checksum {res['param_checksum']}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "world": world, "ep": ep, **res}, f, indent=2)
    _teardown()
    return 0


def _teardown() -> None:
    """Leave the process group together: a gloo peer torn down while another rank's gloo thread still waits on it
    ends that process with std::terminate. The barrier leaves no collective in flight; the rendezvous store then
    tells every rank that all ranks have returned from it, before any of them closes its connections."""
    import torch.distributed as dist

    dist.barrier()
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    store.set(f"sonic_megatron_teardown/{rank}", "1")
    store.wait([f"sonic_megatron_teardown/{r}" for r in range(world)])
    dist.destroy_process_group()


def train(args, device, ep: int) -> dict:
    import functools

    import torch
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from sonic_megatron.config import SonicConfig
    from sonic_megatron.gpt import PRESETS, layer_spec, peak_memory_mib, scaled, synthetic_batch, transformer_config
    from sonic_megatron.wgrad import finalize_runs_held_weight_grads

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    preset = scaled(PRESETS[args.preset], layers=args.layers, seq=args.seq, micro_batch=args.micro_batch)
    config = transformer_config(
        preset,
        ep=ep,
        dtype=dtype,
        overlap_moe_expert_parallel_comm=args.overlap_moe_expert_parallel_comm,
        delay_wgrad_compute=args.delay_wgrad_compute,
    )
    sonic = SonicConfig.resolve(SonicConfig(backend="auto" if cuda else "torch", comm_sms=args.comm_sms))
    torch.manual_seed(args.seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config, args.spec, sonic),
        vocab_size=preset.vocab,
        max_sequence_length=preset.seq,
        position_embedding_type="rope",
    ).to(device=device, dtype=dtype)  # every parameter in the training dtype, norms too, as Megatron-LM's Float16Module
    # casts them: Megatron's mixed-precision optimizer checkpoints only 16-bit parameters (it fails on fp32 ones)
    # The CPU fallback optimizer reads full main_grad, so no optimizer sharding there.
    args.use_distributed_optimizer = args.use_distributed_optimizer and cuda
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=args.use_distributed_optimizer,
        **({"delay_wgrad_compute": True} if args.delay_wgrad_compute else {}),
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    if cuda:
        opt_config = OptimizerConfig(
            optimizer="adam", lr=args.lr, bf16=True, use_distributed_optimizer=args.use_distributed_optimizer
        )
        optimizer = get_megatron_optimizer(opt_config, [model])
    else:
        # Megatron's optimizers allocate on "cuda"; on a CPU, torch Adam reads the DDP-reduced main_grad.
        optimizer = _MainGradAdam(model, args.lr)
    # Megatron's finalize, after the experts' held weight-gradient work (SonicConfig.pair_weight_grads)
    finalize_runs_held_weight_grads(config, finalize_model_grads)
    config.no_sync_func = model.no_sync
    config.grad_sync_func = None
    start = load_checkpoint(args.load, model, optimizer, args) if args.load else 0

    causal = torch.triu(torch.ones(preset.seq, preset.seq, device=device), diagonal=1).bool()[None, None]
    rank = dist.get_rank()

    def batches(step):
        for mb in range(args.num_microbatches):
            tokens, labels = synthetic_batch(preset, step * args.num_microbatches + mb, rank, device)
            yield tokens, labels

    def loss_func(loss_mask, output_tensor):
        losses = output_tensor.float().view(-1)
        loss = (losses * loss_mask.view(-1)).sum()
        n = loss_mask.sum().to(torch.int)
        return loss, n, {"lm loss": torch.stack([loss.detach(), n.float()])}

    def forward_step(data_iterator, model, return_schedule_plan: bool = False):
        tokens, labels = next(data_iterator)
        position_ids = torch.arange(preset.seq, device=device).unsqueeze(0).expand_as(tokens)
        loss_mask = torch.ones_like(labels, dtype=torch.float32)
        if return_schedule_plan:  # Megatron's 1F1B EP-overlap schedule asks for a schedule plan
            plan = model.build_schedule_plan(tokens, position_ids, causal, labels=labels, loss_mask=loss_mask)
            return plan, functools.partial(loss_func, loss_mask)
        output = model(tokens, position_ids, causal, labels=labels, loss_mask=loss_mask)
        return output, functools.partial(loss_func, loss_mask)

    forward_backward = get_forward_backward_func()
    losses, times = [], []
    log = print if rank == 0 else (lambda *a, **k: None)
    log(
        f"pretrain_gpt_sonic: spec {args.spec}, world {dist.get_world_size()}, EP {ep}, {dtype}, preset "
        f"{args.preset}, overlap {args.overlap_moe_expert_parallel_comm}, delay-wgrad {args.delay_wgrad_compute}"
    )
    tokens_per_step = preset.micro_batch * preset.seq * args.num_microbatches
    for step in range(start, args.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        if cuda:
            out = forward_backward(
                forward_step_func=forward_step,
                data_iterator=batches(step),
                model=[model],
                num_microbatches=args.num_microbatches,
                seq_length=preset.seq,
                micro_batch_size=preset.micro_batch,
                decoder_seq_length=preset.seq,
                forward_only=False,
            )
        else:
            out = _cpu_forward_backward(forward_step, batches(step), model, args.num_microbatches)
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        total = torch.stack([o["lm loss"] for o in out]).sum(0) if out else torch.zeros(2, device=device)
        dist.all_reduce(total)
        losses.append(float(total[0] / total[1]))
        log(f"step {step + 1:4d}/{args.steps}  lm loss {losses[-1]:.4f}  step {times[-1] * 1e3:.0f} ms")
        iteration = step + 1
        # Checkpoints are written here only, between iterations: forward_backward has returned, so Megatron's
        # finalize_model_grads_func (FinalizeAfterHeldWeightGrads, installed above) has run the weight-gradient
        # work the experts may hold between micro-batches (pair_weight_grads; they hold only where Megatron's
        # micro-batch calculator is set, as in Megatron-LM's training loop, not in this trainer) and backward_dw()
        # has run the delayed one; the optimizer has stepped. That work lives inside one iteration only, so
        # model + optimizer + iteration + RNG is the whole state; save_checkpoint checks that nothing is held.
        if args.save and (iteration == args.steps or (args.save_interval and iteration % args.save_interval == 0)):
            save_checkpoint(args.save, iteration, model, optimizer, args)
        if args.kill_after_iteration == iteration:
            _kill_every_rank(iteration)
    timed = times[1:] or times
    res = {
        "start_iteration": start,
        "losses": losses,
        "step_ms": [t * 1e3 for t in times],
        "tokens_per_s_per_gpu": tokens_per_step / (sum(timed) / len(timed)) if timed else 0.0,
        "peak_memory_mib": peak_memory_mib(device),
    }
    if args.param_checksum:
        res["param_checksum"] = param_checksum(model)
    return res


# Megatron-LM's checkpoint layout: DIR/iter_NNNNNNN/ (one torch_dist checkpoint) and DIR/<tracker> naming the
# newest complete one (written by rank 0 after every rank finished saving, so a crash mid-save keeps the old one).
CKPT_TRACKER = "latest_checkpointed_iteration.txt"
# Flags that fix the model's shapes and the data order (the synthetic batches are a function of the iteration
# and the rank: sonic_megatron.gpt.synthetic_batch); a checkpoint resumes only where they are the same.
CKPT_SAME_ARGS = ("preset", "layers", "seq", "micro_batch", "num_microbatches", "spec")


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_checkpoint_iteration(root: str) -> int | None:
    """The iteration in ``root``'s tracker file, None without one."""
    try:
        with open(os.path.join(root, CKPT_TRACKER)) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise ValueError(f"{os.path.join(root, CKPT_TRACKER)}: expected an iteration number, got {text!r}")
    return int(text)


def _unwrap(model):
    return getattr(model, "module", model)


def _sharded_metadata() -> dict:
    """Megatron-LM's sharded_state_dict metadata: per-parameter (fully reshardable) distributed-optimizer state
    without the chained optimizers' prefixes, so the keys are the same at every EP size."""
    from megatron.core import parallel_state as ps

    return {
        "singleton_local_shards": False,
        "distrib_optim_sharding_type": "fully_reshardable",
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
    }


def _rng_state():
    """The RNG states Megatron-LM checkpoints (``get_rng_state``: Python, NumPy, torch, CUDA, the model-parallel
    tracker), as its torch_dist ShardedObject: one per (pipeline, tensor) rank, saved by data-parallel rank 0 and
    loaded on every data-parallel rank (no --data-parallel-random-init), so it reshards across EP / DP sizes."""
    import random

    import numpy as np
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing import ShardedObject

    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    pp, tp = ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
    pp_rank, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    replica = ps.get_data_parallel_rank(with_context_parallel=True)
    return ShardedObject("rng_state", [state], (pp, tp), (pp_rank, tp_rank), replica_id=replica)


def _set_rng_state(states: list) -> None:
    import random

    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    state = states[0]
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    if state["rng_tracker_states"]:
        tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _checkpoint_state(model, optimizer, iteration: int, args, *, is_loading: bool) -> dict:
    """The sharded state dict Megatron-LM's ``generate_state_dict`` builds: the model's sharded_state_dict, the
    optimizer's on top of it, the RNG states, and common (rank 0) entries."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    metadata = _sharded_metadata()
    model_sd = _unwrap(model).sharded_state_dict(metadata=metadata)
    return {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata),
        "rng_state": _rng_state(),
        "iteration": iteration,
        "args": {
            **{k: getattr(args, k) for k in CKPT_SAME_ARGS},
            "world": dist.get_world_size(),
            "ep": ps.get_expert_model_parallel_world_size(),
        },
        "checkpoint_version": 3.0,
    }


def save_checkpoint(root: str, iteration: int, model, optimizer, args) -> str:
    """Write ``root/iter_NNNNNNN`` (dist_checkpointing.save, torch_dist), then the tracker. Collective."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from sonic_megatron.checkpoint import modules_holding_weight_grads

    held = modules_holding_weight_grads(_unwrap(model))
    if held:
        raise RuntimeError(f"checkpoint at iteration {iteration}: {held} still hold weight-gradient work")
    path = checkpoint_dir(root, iteration)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_checkpoint_state(model, optimizer, iteration, args, is_loading=False), path)
    dist.barrier()  # every rank's shards are written before the tracker names them
    if dist.get_rank() == 0:
        tmp = os.path.join(root, CKPT_TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, CKPT_TRACKER))
        print(f"saved checkpoint {path}", flush=True)
    dist.barrier()
    return path


def load_checkpoint(root: str, model, optimizer, args) -> int:
    """Load ``root``'s latest checkpoint into the model, the optimizer and the RNGs; returns its iteration (0,
    starting from scratch, where ``root`` has none). Another EP size reshards (the experts' keys are global)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    iteration = latest_checkpoint_iteration(root)
    log = print if dist.get_rank() == 0 else (lambda *a, **k: None)
    if iteration is None:
        log(f"no checkpoint in {root} ({CKPT_TRACKER} absent): starting from scratch", flush=True)
        return 0
    path = checkpoint_dir(root, iteration)
    saved_args = dist_checkpointing.load_common_state_dict(path)["args"]
    differ = {k: (saved_args.get(k), getattr(args, k)) for k in CKPT_SAME_ARGS if saved_args.get(k) != getattr(args, k)}
    if differ:
        raise ValueError(
            f"--load {root}: checkpoint {path} was written with other model or data flags (saved, now): {differ}"
        )
    state = _checkpoint_state(model, optimizer, iteration, args, is_loading=True)
    loaded = dist_checkpointing.load(state, path)
    _unwrap(model).load_state_dict(loaded["model"], strict=True)
    optimizer.load_state_dict(loaded["optimizer"])
    _set_rng_state(loaded["rng_state"])
    if loaded["iteration"] != iteration:
        raise ValueError(f"{path}: holds iteration {loaded['iteration']}, {CKPT_TRACKER} says {iteration}")
    log(
        f"resumed from {path} at iteration {iteration} (saved at world {saved_args['world']} EP {saved_args['ep']})",
        flush=True,
    )
    return iteration


def _kill_every_rank(iteration: int) -> None:
    """--kill-after-iteration (test only): once every rank got here (and printed so), each sends SIGKILL to every
    rank of its host, itself last: all die by SIGKILL together, none is left to be stopped by torchrun."""
    import contextlib
    import signal
    import socket

    import torch.distributed as dist

    me = (socket.gethostname(), os.getpid())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, me)
    print(f"kill-after-iteration {iteration}: SIGKILL to rank {dist.get_rank()} (pid {me[1]})", flush=True)
    sys.stderr.flush()
    dist.barrier()  # every rank has printed its line
    # This rank's own helper processes first (the checkpoint writer's multiprocessing manager): a dead node takes
    # them down too, and an orphan would outlive the run (torchrun starts each rank in its own session).
    import multiprocessing

    for child in multiprocessing.active_children():
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)
    dist.barrier()  # every rank has killed its helpers: no rank dies before it has
    for host, pid in everyone:
        if host == me[0] and pid != me[1]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    os.kill(me[1], signal.SIGKILL)


def param_checksum(model) -> str:
    """SHA-256 over the ranks' SHA-256s of their parameters (name, shape, dtype and bytes, in module order):
    equal exactly when every rank holds bitwise the same parameters. Collective: every rank calls it."""
    import hashlib

    import torch
    import torch.distributed as dist

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        t = p.detach().contiguous().cpu()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, h.hexdigest())
    return hashlib.sha256(",".join(digests).encode()).hexdigest()


def _cpu_forward_backward(forward_step, data_iterator, model, num_microbatches: int) -> list[dict]:
    """CPU stand-in for Megatron's no-pipelining schedule (which allocates on "cuda"): the same micro-batch
    loop, loss scaled per micro-batch, then DDP's gradient sync (main_grad reduced over DP / expert-DP)."""
    out = []
    for _ in range(num_microbatches):
        output, loss_func = forward_step(data_iterator, model)
        loss, n, report = loss_func(output)
        (loss / n / num_microbatches).backward()
        out.append(report)
    for m in model.modules():
        if type(m).__name__ == "SonicExperts":
            m.backward_dw()
    model.finish_grad_sync()
    return out


class _MainGradAdam:
    """CPU stand-in for Megatron's optimizer: torch Adam on the gradients Megatron's DDP reduced into
    ``param.main_grad``."""

    def __init__(self, model, lr: float):
        import torch

        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.Adam(self.params, lr=lr)

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def step(self) -> None:
        for p in self.params:
            p.grad = p.main_grad.to(p.dtype)
        self.opt.step()

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None) -> dict:
        """What Megatron's FP32Optimizer.sharded_state_dict gives for its torch Adam: exp_avg / exp_avg_sq as
        ``optimizer.state.*`` tensors sharded like their parameters, the step shared by all (``common_step``).
        Loading first creates the states to load into."""
        import torch
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        if is_loading:
            for p in self.params:
                if not self.opt.state[p]:
                    self.opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    self.opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)
        state = self.opt.state_dict()
        steps = {float(s["step"]) for s in state["state"].values() if "step" in s}
        if len(steps) > 1:
            raise ValueError(f"the optimizer's step differs per parameter: {sorted(steps)}")
        step = next((s["step"] for s in state["state"].values() if "step" in s), None)
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, self.params)
        optim_state_to_sharding_state(state, id_map, exclude_keys="step")
        if step is not None:
            state["state"]["common_step"] = step
        return state

    def load_state_dict(self, state: dict) -> None:
        import copy

        step = state["state"].pop("common_step", None)
        if step is not None:
            for s in state["state"].values():
                s["step"] = copy.deepcopy(step)
        self.opt.load_state_dict(state)


if __name__ == "__main__":
    sys.exit(main())
