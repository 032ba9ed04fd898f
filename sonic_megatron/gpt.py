"""A small GPT-MoE on ``megatron.core.models.gpt.GPTModel`` for the demo, ``bench train`` and the GPU check:
model presets, the plugin or stock spec, a learnable synthetic token stream, and one training step with
Megatron-style gradient reduction (dense parameters averaged over data parallel, expert parameters over
expert-data parallel) -- no megatron.training needed, so it runs on megatron-core 0.16 .. 0.19, CPU or GPU.

Shape legend: B micro-batch, S sequence length, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import SonicConfig


@dataclass(frozen=True)
class Preset:
    """Model shape. ``moe_every`` = 1: every layer MoE; 2: dense, MoE, dense, MoE..."""

    layers: int
    hidden: int
    heads: int
    ffn: int  # dense MLP width (dense layers, shared experts base)
    experts: int
    topk: int
    expert_ffn: int
    shared_ffn: int | None = None
    moe_every: int = 1
    first_dense: int = 0  # leading dense layers (DeepSeek style)
    vocab: int = 256
    seq: int = 64
    micro_batch: int = 2


PRESETS = {
    # CPU demo / tests: seconds per step on 2 cores.
    "tiny": Preset(layers=2, hidden=64, heads=4, ffn=128, experts=8, topk=2, expert_ffn=64, vocab=128, seq=32),
    # tiny with a shared expert and a leading dense layer (DeepSeek layout), for CPU runs.
    "tiny-shared": Preset(
        layers=3,
        hidden=64,
        heads=4,
        ffn=128,
        experts=8,
        topk=2,
        expert_ffn=64,
        shared_ffn=64,
        first_dense=1,
        vocab=128,
        seq=32,
    ),
    # OLMoE-1B-7B shape (64 experts, top-8, expert ffn 1024, hidden 2048) with 4 of its 16 layers.
    "olmoe-small": Preset(
        layers=4,
        hidden=2048,
        heads=16,
        ffn=8192,
        experts=64,
        topk=8,
        expert_ffn=1024,
        vocab=50304,
        seq=4096,
        micro_batch=1,
    ),
    # Qwen3-30B-A3B shape scaled down: 128 experts top-8, expert ffn 768, hidden 2048, 6 of 48 layers.
    "qwen3-small": Preset(
        layers=6,
        hidden=2048,
        heads=32,
        ffn=6144,
        experts=128,
        topk=8,
        expert_ffn=768,
        vocab=151936,
        seq=4096,
        micro_batch=1,
    ),
    # DeepSeek-V3-like: fine-grained experts + one shared expert, first layer dense.
    "deepseek-small": Preset(
        layers=4,
        hidden=2048,
        heads=16,
        ffn=10944,
        experts=64,
        topk=6,
        expert_ffn=1408,
        shared_ffn=2816,
        moe_every=1,
        vocab=102400,
        seq=4096,
        micro_batch=1,
    ),
}


def transformer_config(preset: Preset, *, ep: int, dtype: torch.dtype, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=preset.layers,
        hidden_size=preset.hidden,
        num_attention_heads=preset.heads,
        ffn_hidden_size=preset.ffn,
        num_moe_experts=preset.experts,
        moe_router_topk=preset.topk,
        moe_ffn_hidden_size=preset.expert_ffn,
        moe_shared_expert_intermediate_size=preset.shared_ffn,
        moe_layer_freq=[
            int(i >= preset.first_dense and i % preset.moe_every == preset.moe_every - 1) for i in range(preset.layers)
        ],
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        moe_router_dtype="fp32",
        expert_model_parallel_size=ep,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        normalization="RMSNorm",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
        init_method_std=0.02,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def layer_spec(config, spec: str, sonic_config: SonicConfig | None = None):
    """Decoder block spec: ``stock`` (Megatron's, SequentialMLP or TEGroupedMLP experts), ``grouped`` (stock
    MoE layer with ``sonic_megatron.baseline``'s grouped-GEMM experts) or ``sonic``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    use_te = _have_te() and torch.cuda.is_available()
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te)
    if spec == "stock":
        return block
    if spec == "grouped":
        from .baseline import swap_experts_spec

        return swap_experts_spec(block)
    if spec != "sonic":
        raise ValueError(f"spec must be 'sonic', 'grouped' or 'stock', got {spec!r}")
    from .spec import swap_moe_spec

    return swap_moe_spec(block, sonic_config)


def _have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def build_model(preset: Preset, spec: str, *, ep: int, dtype: torch.dtype, device, sonic_config=None, seed=1234):
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(preset, ep=ep, dtype=dtype)
    torch.manual_seed(seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config, spec, sonic_config),
        vocab_size=preset.vocab,
        max_sequence_length=preset.seq,
        position_embedding_type="rope",
    )
    return model.to(device)


def synthetic_batch(preset: Preset, step: int, rank: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, S], labels [B, S]) of a learnable stream: x[t+1] = (5 x[t] + 3) mod V from a random start,
    with 1 token in 8 replaced by noise, so the loss falls visibly within a few steps (from ln V)."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    B, S, V = preset.micro_batch, preset.seq, preset.vocab
    a, b = 5, 3
    x0 = torch.randint(0, V, (B, 1), generator=g)
    seq = [x0]
    for _ in range(S):
        seq.append((a * seq[-1] + b) % V)
    seq = torch.cat(seq, dim=1)
    noise = torch.rand(seq.shape, generator=g) < 0.125
    seq = torch.where(noise, torch.randint(0, V, seq.shape, generator=g), seq)
    return seq[:, :-1].contiguous().to(device), seq[:, 1:].contiguous().to(device)


def reduce_gradients(model) -> None:
    """Average gradients like Megatron's DDP: dense parameters over the data-parallel group, expert
    parameters (``allreduce=False``) over the expert-data-parallel group, both scaled by 1/DP."""
    from megatron.core import parallel_state as ps

    dp_group = ps.get_data_parallel_group()
    edp_group = ps.get_expert_data_parallel_group()
    dp = dist.get_world_size(dp_group)
    for p in model.parameters():
        if p.grad is None:
            continue
        group = dp_group if getattr(p, "allreduce", True) else edp_group
        if dist.get_world_size(group) > 1:
            dist.all_reduce(p.grad, group=group)
        p.grad.div_(dp)


def train(model, preset: Preset, *, steps: int, lr: float, device, log=print, warmup: int = 1) -> dict:
    """Train ``steps`` steps (AdamW); returns losses, tokens/s (this rank, after ``warmup`` steps) and peak
    memory. Every rank must call it (collectives)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    rank = dist.get_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses, times = [], []
    tokens_per_step = preset.micro_batch * preset.seq
    # Causal mask given explicitly (True = masked): Megatron's default one is allocated on "cuda".
    causal_mask = torch.triu(torch.ones(preset.seq, preset.seq, device=device), diagonal=1).bool()[None, None]
    for step in range(steps):
        tokens, labels = synthetic_batch(preset, step, rank, device)
        position_ids = torch.arange(preset.seq, device=device).unsqueeze(0).expand_as(tokens)
        _sync(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_BS = model(tokens, position_ids, causal_mask, labels=labels)
        loss = loss_BS.float().mean()
        loss.backward()
        for m in model.modules():  # deferred expert weight gradients (no-op unless delay_wgrad_compute)
            if hasattr(m, "backward_dw") and type(m).__name__ == "SonicExperts":
                m.backward_dw()
        reduce_gradients(model)
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss = float(mean_loss) / dist.get_world_size()
        losses.append(mean_loss)
        clear_aux_losses_tracker()
        timed = times[warmup:] or times
        log(
            f"step {step + 1:3d}/{steps}  loss {mean_loss:.4f}  "
            f"tokens/s/rank {tokens_per_step / (sum(timed) / len(timed)):.0f}  step {times[-1] * 1e3:.0f} ms"
        )
    timed = times[warmup:] or times
    return {
        "losses": losses,
        "step_ms": [t * 1e3 for t in times],
        "tokens_per_s_per_rank": tokens_per_step / (sum(timed) / len(timed)),
        "peak_memory_mib": peak_memory_mib(device),
    }


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def peak_memory_mib(device) -> float:
    """Peak GPU memory allocated (CUDA) or peak resident set size of this process (CPU), MiB."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def scaled(preset: Preset, **changes) -> Preset:
    return dataclasses.replace(preset, **{k: v for k, v in changes.items() if v is not None})


def world_from_env() -> tuple[int, int] | None:
    """(rank, world_size) when launched by torchrun, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None
