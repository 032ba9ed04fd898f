"""``bench layer``: one MoE layer's experts block, forward + backward, under expert parallelism.

    torchrun --nproc_per_node 4 -m sonic_megatron bench layer --tokens 16384 --hidden 1536 --ffn 256 \\
        --experts 128 --topk 8 --chunks 1,2

Providers (same routing, same weights, bf16):
  * ``ours`` -- ``token_dispatch.expert_parallel_experts`` (dedup dispatch, kernels/ experts, overlap of the
    dW GEMMs with the backward all-to-all), for each ``--chunks`` value, with and without overlap
    (``overlap=False`` waits for each all-to-all at once: same bits, no hiding);
  * ``megatron`` -- Megatron-core's ``MoEAlltoAllTokenDispatcher`` (unfused permute) + an experts module of
    two ``torch._grouped_mm`` calls with SwiGLU and the probs applied after the activation (Megatron's
    GroupedMLP order); autograd backward.
The share of all-to-all time hidden = (time without overlap - time with overlap) / (time of the layer's
all-to-alls alone: dispatch + combine in forward, dO + dX in backward, run back to back), clipped to [0, 1].
Router and token rounding are outside the timed region (both providers get the same top-K routing).
On CPUs (``--device cpu``, gloo) Megatron's dispatcher runs with four documented monkeypatches (fake CUDA
streams etc.; docs MEGATRON.md 11.1); use tiny sizes there -- it checks the plumbing, not speed.
"""

from __future__ import annotations

import argparse
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .common import print_table, write_json
from .dispatch import DTYPES, add_common_arguments, random_routing, setup_distributed, timed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--chunks", default="1,2", help="comma-separated num_chunks values for ours (default 1,2)")
    parser.add_argument("--backend", default="auto", help="kernels backend for ours: auto|torch|cute (default auto)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the Megatron baseline")


# ---------------------------------------------------------------------------------------------------------
# Baseline: Megatron's alltoall dispatcher + torch._grouped_mm experts
# ---------------------------------------------------------------------------------------------------------


class _FakeStream:
    """Stands in for CUDA streams/events on CPU (Megatron's dispatcher builds a D2H side stream)."""

    def wait_stream(self, *a):
        pass

    def wait_event(self, *a):
        pass

    def synchronize(self):
        pass

    def record_event(self, *a):
        return self

    def record(self, *a):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def __eq__(self, other):
        return True

    def __hash__(self):
        return 0


def _patch_megatron_for_cpu() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    fake = _FakeStream()
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.Stream = lambda *a, **k: fake
    torch.cuda.current_stream = lambda *a, **k: fake
    torch.cuda.stream = lambda s: fake

    def to_cpu(t, as_numpy=False, record_stream=False):
        return t.numpy() if (as_numpy and isinstance(t, torch.Tensor)) else t

    token_dispatcher.maybe_move_tensor_to_cpu = to_cpu
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_megatron_dispatcher(args, device, group, P: int, rank: int):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if device.type == "cpu":
        _patch_megatron_for_cpu()
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


# ---------------------------------------------------------------------------------------------------------


def _a2a_alone(plan, x, device, args) -> float:
    """Seconds of the layer's row all-to-alls alone (fwd dispatch + combine, bwd dO dispatch + dX back)."""
    from ..token_dispatch.stepwise import _all_rows, _all_rows_back

    send = x.index_select(0, plan.send_token_idx_S)
    recv = _all_rows(plan, send)

    def fn():
        for _ in range(2):
            _all_rows(plan, send)
            _all_rows_back(plan, recv)

    return timed(fn, device, args.warmup, args.iters)


def run(args) -> int:
    from ..kernels import TopKRouting
    from ..token_dispatch import expert_parallel_experts, make_plan

    device, group = setup_distributed(args)
    rank, P = dist.get_rank(), dist.get_world_size()
    dtype, D, Fn, E, K, T = DTYPES[args.dtype], args.hidden, args.ffn, args.experts, args.topk, args.tokens
    L = E // P
    x0, probs, scores, indices = random_routing(args, device, rank)
    g = torch.Generator(device="cpu").manual_seed(1234 + rank)
    w1 = (torch.randn(L, 2 * Fn, D, generator=g) / D**0.5).to(device=device, dtype=dtype).requires_grad_()
    w2 = (torch.randn(L, D, Fn, generator=g) / Fn**0.5).to(device=device, dtype=dtype).requires_grad_()
    grad = torch.randn(T, D, generator=g).to(device=device, dtype=dtype)
    x = x0.clone().requires_grad_()
    scores = scores.clone().requires_grad_()
    routing = TopKRouting(scores, indices)
    results, outputs = [], {}

    def ours(chunks, overlap):
        def fn():
            out = expert_parallel_experts(
                x,
                routing,
                w1,
                w2,
                group=group,
                num_experts=E,
                backend=args.backend,
                num_chunks=chunks,
                overlap=overlap,
            )
            out.backward(grad)
            return out

        return fn

    for chunks in [int(c) for c in args.chunks.split(",")]:
        for overlap in (True, False):
            t = timed(ours(chunks, overlap), device, args.warmup, args.iters)
            results.append(dict(provider="ours", chunks=chunks, overlap=overlap, ms=t * 1e3, tokens_per_s=P * T / t))
    outputs["ours"] = ours(1, True)().detach()
    plan = make_plan(routing, num_experts=E, group=group, x_TD=x0)
    t_a2a = _a2a_alone(plan, x0, device, args)

    baseline_error = None
    if not args.no_baseline:
        try:
            disp = build_megatron_dispatcher(args, device, group, P, rank)
            w1_LDG = w1.detach().transpose(1, 2).contiguous().requires_grad_()
            w2_LFD = w2.detach().transpose(1, 2).contiguous().requires_grad_()
            routing_map = torch.zeros(T, E, dtype=torch.bool, device=device).scatter_(1, indices, True)

            def baseline():
                probs_TE = torch.zeros(T, E, dtype=torch.float32, device=device).scatter(1, indices, scores)
                out = megatron_layer(disp, x, routing_map, probs_TE, w1_LDG, w2_LFD)
                out.backward(grad)
                return out

            t = timed(baseline, device, args.warmup, args.iters)
            results.append(dict(provider="megatron", chunks=1, overlap=False, ms=t * 1e3, tokens_per_s=P * T / t))
            outputs["megatron"] = baseline().detach()
        except Exception as exc:  # report, keep our numbers
            baseline_error = f"{type(exc).__name__}: {exc}"

    best = {}
    for r in results:
        if r["provider"] == "ours":
            best.setdefault(r["chunks"], {})[r["overlap"]] = r["ms"] / 1e3
    for r in results:
        if r["provider"] == "ours" and r["overlap"]:
            t_on, t_off = best[r["chunks"]][True], best[r["chunks"]][False]
            r["a2a_hidden"] = max(0.0, min(1.0, (t_off - t_on) / t_a2a)) if t_a2a > 0 else None
    summary = {"a2a_alone_ms": t_a2a * 1e3}
    if "megatron" in outputs:
        mg = next(r for r in results if r["provider"] == "megatron")
        fastest = min(r["ms"] for r in results if r["provider"] == "ours")
        summary["speedup_vs_megatron"] = mg["ms"] / fastest
        diff = (outputs["ours"].float() - outputs["megatron"].float()).abs().max()
        scale = outputs["megatron"].float().abs().max().clamp(min=1e-6)
        rel = torch.stack([diff / scale])
        dist.all_reduce(rel, op=dist.ReduceOp.MAX)
        summary["max_rel_diff_ours_vs_megatron"] = float(rel)
    if rank == 0:
        print(f"bench layer: P={P} T={T} d={D} n={Fn} E={E} K={K} {args.dtype} on {device.type}")
        print_table(results, ["provider", "chunks", "overlap", "ms", "tokens_per_s", "a2a_hidden"])
        print(", ".join(f"{k} {v:.3g}" for k, v in summary.items()))
        if baseline_error:
            print(f"megatron baseline failed: {baseline_error}")
        write_json(
            args.json,
            {
                "benchmark": "layer",
                "config": dict(
                    P=P, T=T, d=D, n=Fn, E=E, K=K, dtype=args.dtype, device=device.type, backend=args.backend
                ),
                "rows": results,
                "summary": summary,
                "baseline_error": baseline_error,
            },
        )
    dist.barrier()
    dist.destroy_process_group()
    return 0
