"""Helpers shared by the Megatron tests, the demo and the GPU check script: process-group setup (gloo on
CPUs, NCCL on GPUs), small MoE configs, and weight copies between SequentialMLP and SonicExperts.

Shape legend: El local experts, F expert ffn size, H hidden size.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(rank: int, world_size: int, port: int | None = None, local_rank: int | None = None):
    """Join the default process group (NCCL with GPU ``local_rank`` (default: rank) when CUDA is present, else
    gloo and the CPU patches of ``megatron_compat``). Returns this rank's device."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)
    if torch.cuda.is_available():
        torch.cuda.set_device((rank if local_rank is None else local_rank) % torch.cuda.device_count())
        dist.init_process_group("nccl", rank=rank, world_size=world_size)
        return torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from .megatron_compat import patch_megatron_for_cpu

    patch_megatron_for_cpu()
    return torch.device("cpu")


def init_model_parallel(ep: int = 1, tp: int = 1, seed: int = 1234, etp: int | None = None) -> None:
    """Megatron's parallel_state with expert parallelism ``ep``, tensor parallelism ``tp`` and expert tensor
    parallelism ``etp`` (default ``tp``, as Megatron's; ``tp=1, etp=2`` is its "MoE parallel folding": attention
    data-parallel, every expert split over two ranks), and model-parallel RNG on GPUs."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
    )
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    import warnings

    warnings.filterwarnings("ignore")  # Megatron's "no TE / no Apex" notices, once per process
    try:
        init_distributed(rank, world_size, port)
        queue.put((rank, None, fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent verbatim
        queue.put((rank, traceback.format_exc(), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args, timeout: float = 300.0) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes joined in a process group; return
    what each rank's ``fn`` returned (picklable, without tensors: plain data), by rank, or raise with the failing
    ranks' tracebacks. ``fn`` must be importable (module level)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    errors, results = [], [None] * world_size
    try:
        for _ in range(world_size):
            # After a failure the other ranks are usually stuck in a collective: give them a short grace.
            rank, err, results[rank] = queue.get(timeout=30 if errors else timeout)
            if err:
                errors.append(f"rank {rank}:\n{err}")
    except Exception:  # noqa: BLE001 - queue.Empty: ranks that never reported
        errors.append("some ranks did not report (stuck after another rank failed, or timed out)")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("distributed worker failed:\n" + "\n".join(errors))
    return results


def moe_config(**overrides):
    """A small dropless MoE TransformerConfig the plugin supports (SwiGLU, no biases, fp32 router)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=1,
        hidden_size=32,
        ffn_hidden_size=64,
        moe_ffn_hidden_size=48,
        num_attention_heads=4,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none",
        moe_router_dtype="fp32",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        use_cpu_initialization=not torch.cuda.is_available(),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
    )
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        kw["expert_model_parallel_size"] = parallel_state.get_expert_model_parallel_world_size()
        kw["tensor_model_parallel_size"] = parallel_state.get_tensor_model_parallel_world_size()
        kw["expert_tensor_parallel_size"] = parallel_state.get_expert_tensor_parallel_world_size()
    kw.update(overrides)
    return TransformerConfig(**kw)


@torch.no_grad()
def copy_sequential_to_sonic(sequential, sonic) -> None:
    """Copy SequentialMLP expert weights (fc1 [G, H], fc2 [H, F] per expert) into SonicExperts' stacks."""
    for e, expert in enumerate(sequential.local_experts):
        sonic.weight1[e].copy_(expert.linear_fc1.weight)
        sonic.weight2[e].copy_(expert.linear_fc2.weight)


def etp_shard(w1: torch.Tensor, w2: torch.Tensor, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert tensor-parallel rank ``rank``'s share (of ``size``) of stacked expert weights ``w1`` [El, 2F, H]
    (``[gate ; up]``) and ``w2`` [El, H, F]: ``[gate_r ; up_r]`` [El, 2F/size, H] and fc2's columns [El, H, F/size],
    the layout of Megatron's ETP experts (``experts.init_stacked_weights``)."""
    f = w2.shape[-1] // size
    rows = slice(rank * f, (rank + 1) * f)
    gate, up = w1.chunk(2, dim=1)
    return torch.cat([gate[:, rows], up[:, rows]], dim=1), w2[..., rows]


def sonic_grads_as_sequential(sonic) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """SonicExperts' weight grads per expert, in SequentialMLP's (fc1, fc2) shapes."""
    g1, g2 = sonic.weight1.grad, sonic.weight2.grad
    return [(g1[e], g2[e]) for e in range(sonic.num_local_experts)]


def local_moe_weights(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's (fc1 [El, 2F, H], fc2 [El, H, F], router [E, H]) of a stock (SequentialMLP) or Sonic MoE
    layer, detached, in the layer's dtype and device."""
    ex = layer.experts
    if hasattr(ex, "local_experts"):
        w1 = torch.stack([e.linear_fc1.weight for e in ex.local_experts])
        w2 = torch.stack([e.linear_fc2.weight for e in ex.local_experts])
    else:
        w1, w2 = ex.weight1, ex.weight2
    return w1.detach(), w2.detach(), layer.router.weight.detach()


def layer_step(layer, params: list, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One training step of an MoE layer without touching ``.grad``: (output, dx, d params...) as new tensors
    (``torch.autograd.grad``), so that the same step can run eagerly and inside a CUDA graph."""
    out, _ = layer(x)
    grads = torch.autograd.grad(out, [x, *params], grad)
    return (out.detach(), *grads)


def graphed_layer_step(layer, params: list, x: torch.Tensor, grad: torch.Tensor, warmup: int = 3):
    """``layer_step`` captured in a CUDA graph (after ``warmup`` eager steps on a side stream, which compile and
    cache every kernel): (replay, static outputs). ``replay()`` reruns the captured step on whatever ``x`` and
    ``grad`` hold then and refills the static outputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            layer_step(layer, params, x, grad)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = layer_step(layer, params, x, grad)
    return graph.replay, static


def bench_moe_config(shape: tuple[int, int, int, int, int]):
    """The benchmarks' bf16 MoE TransformerConfig for ``shape`` = (T, d, n, E, K): SwiGLU, fp32 router logits with
    Megatron's aux loss, weights initialised on the GPU."""
    _, d, n, E, K = shape
    return moe_config(
        hidden_size=d,
        ffn_hidden_size=4 * d,
        moe_ffn_hidden_size=n,
        num_attention_heads=16,
        num_moe_experts=E,
        moe_router_topk=K,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        params_dtype=torch.bfloat16,
        bf16=True,
        use_cpu_initialization=False,
    )


def gpu_layer_inputs(shape: tuple[int, int, int, int, int], seq: int = 2048, sonic_config=None):
    """(plugin layer, its parameters [router, w1, w2], x [seq, T / seq, d], output gradient) on the current CUDA
    device for ``shape`` = (T, d, n, E, K) (``bench_moe_config``), at expert-parallel size 1 (call
    ``init_model_parallel`` first)."""
    from .config import SonicConfig
    from .layer import SonicMoELayer
    from .megatron_compat import default_pg_collection

    T, d = shape[0], shape[1]
    config = bench_moe_config(shape)
    layer = SonicMoELayer(config, pg_collection=default_pg_collection(), sonic_config=sonic_config or SonicConfig())
    layer = layer.cuda().train()
    params = [layer.router.weight, layer.experts.weight1, layer.experts.weight2]
    x = torch.randn(seq, T // seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(seq, T // seq, d, device="cuda", dtype=torch.bfloat16)
    return layer, params, x, grad
