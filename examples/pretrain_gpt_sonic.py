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
    return p.parse_args(argv)


def main(argv=None) -> int:
    warnings.filterwarnings("ignore")
    args = parse_args(argv)
    import torch.distributed as dist

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
        print(
            f"done: loss {res['losses'][0]:.3f} -> {res['losses'][-1]:.3f}, {res['tokens_per_s_per_gpu']:.0f} "
            f"tokens/s/GPU, peak memory {res['peak_memory_mib']:.0f} MiB"
        )
        if "param_checksum" in res:
            print(f"param checksum {res['param_checksum']}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "world": world, "ep": ep, **res}, f, indent=2)
    dist.destroy_process_group()
    return 0


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
    ).to(device)
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
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    config.grad_sync_func = None

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
    for step in range(args.steps):
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
    timed = times[1:] or times
    res = {
        "losses": losses,
        "step_ms": [t * 1e3 for t in times],
        "tokens_per_s_per_gpu": tokens_per_step / (sum(timed) / len(timed)),
        "peak_memory_mib": peak_memory_mib(device),
    }
    if args.param_checksum:
        res["param_checksum"] = param_checksum(model)
    return res


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


if __name__ == "__main__":
    sys.exit(main())
