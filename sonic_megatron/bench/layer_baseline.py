"""``bench layer``'s baseline: Megatron-core's ``MoEAlltoAllTokenDispatcher`` (unfused permute) + an experts
module of two ``torch._grouped_mm`` calls with SwiGLU and the probs applied after the activation (Megatron's
GroupedMLP order).

Legend: T tokens, E experts, L local experts, D hidden size, F expert ffn size, G = 2F (gate ; up).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .dispatch import DTYPES


def build_megatron_dispatcher(args, device, group, P: int, rank: int):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if device.type == "cpu":
        from ..megatron_compat import patch_megatron_for_cpu

        patch_megatron_for_cpu()
    self_groups = [dist.new_group([r]) for r in range(P)]  # every rank creates every group
    pg = types.SimpleNamespace(ep=group, expt_tp=self_groups[rank], tp_ep=group, tp=self_groups[rank])
    config = TransformerConfig(
        num_layers=1,
        hidden_size=args.hidden,
        num_attention_heads=1,
        num_moe_experts=args.experts,
        moe_router_topk=args.topk,
        moe_ffn_hidden_size=args.ffn,
        expert_model_parallel_size=P,
        moe_token_dispatcher_type="alltoall",
        moe_router_dtype="fp32",
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        bf16=args.dtype == "bf16",
        params_dtype=DTYPES[args.dtype],
        use_cpu_initialization=device.type == "cpu",
    )
    L = args.experts // P
    return MoEAlltoAllTokenDispatcher(L, list(range(rank * L, (rank + 1) * L)), config, pg_collection=pg)


def grouped_mm_experts(tokens, tokens_per_expert, probs, w1_LDG, w2_LFD):
    """Megatron-GroupedMLP-like experts: fc1 -> SwiGLU * prob -> fc2 with torch._grouped_mm."""
    counts = torch.as_tensor(tokens_per_expert).to(device=tokens.device, dtype=torch.int32)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    h = torch._grouped_mm(tokens, w1_LDG, offs=offs)
    g, u = h.chunk(2, dim=-1)
    a = (F.silu(g.float()) * u.float() * probs.float()[:, None]).to(tokens.dtype)
    return torch._grouped_mm(a, w2_LFD, offs=offs)


def megatron_layer(disp, x, routing_map, probs_TE, w1_LDG, w2_LFD):
    tokens, p = disp.dispatch_preprocess(x, routing_map, probs_TE)
    tokens, p = disp.token_dispatch(tokens, p)
    tokens, tpe, p = disp.dispatch_postprocess(tokens, p)
    y = grouped_mm_experts(tokens, tpe, p, w1_LDG, w2_LFD)
    y = disp.combine_preprocess(y)
    y = disp.token_combine(y)
    return disp.combine_postprocess(y)
