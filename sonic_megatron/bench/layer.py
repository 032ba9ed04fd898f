"""``bench layer``: one MoE layer's experts block, forward + backward, under expert parallelism.

    torchrun --nproc_per_node 4 -m sonic_megatron bench layer --tokens 16384 --hidden 1536 --ffn 256 \\
        --experts 128 --topk 8 --chunks 1,2

Providers (same routing, same weights, bf16):
  * ``ours`` -- ``token_dispatch.expert_parallel_experts`` (dedup dispatch, kernels/ experts, overlap of the
    dW GEMMs with the backward all-to-all), for each ``--chunks`` value N (``num_chunks``: N token chunks, each
    with its own all-to-alls) and each ``--comm-sms`` value (SMs the GEMMs leave free while an all-to-all is in
    flight);
  * ``megatron`` -- Megatron-core's ``MoEAlltoAllTokenDispatcher`` (unfused permute) + an experts module of
    two ``torch._grouped_mm`` calls with SwiGLU and the probs applied after the activation (Megatron's
    GroupedMLP order); autograd backward.
Per chunk count N, ours is also timed with every all-to-all of the layer skipped (``no a2a``: the receive buffers
keep stale rows, so only the timing means anything; the plan and its collectives stay), and t_a2a(N) is the
layer's all-to-alls alone with the SAME plan (its chunks; forward: rows to the experts -- scores ride in the
plan's pair-metadata all-to-all -- and rows back; backward: dO rows to the experts, dX rows and dS back), run back
to back. Ours' variants of one chunk count are timed INTERLEAVED: ``--iters`` rounds, each running every variant
once (the layer for each ``--comm-sms`` value, no a2a, the all-to-alls alone), each call from an idle device
after a barrier; a variant's time is its median over rounds (max over ranks per round). Per layer variant:
    a2a_hidden   = clip(1 - exposed / t_a2a(N), 0, 1),  exposed = median over rounds of t_layer - t_no_a2a:
                   the share of the all-to-all time that adds no wall time.
Per-round (paired) differences matter: the layer is host-bound at the size above, and blocks of calls timed
seconds apart drift by up to 1 ms on the same machine (docs/PERF.md).
When the layer is host-bound (host_ms close to ms) the all-to-alls also hide in GPU gaps left by the host, which
a2a_hidden counts; ``--profile`` adds the kernel-level share (all-to-all kernel time during which a compute
kernel runs on the GPU, from the trace), which counts only hiding behind kernels.
``host_ms`` is the time until the Python call (forward + backward) returns, before the final device sync.
``rel_diff_out`` / ``rel_diff_dx``: max relative difference of the output / dX against the first
``--chunks`` value (a check of the chunk plumbing; chunking only changes dW's rounding).
``bitwise`` says whether the output and all gradients with the largest ``--comm-sms`` value equal those with
comm_sms 0, bit for bit; ``bitwise_vs_first`` whether they equal those of the first ``--chunks`` value.
``--count-ops`` replaces the timing by a count of ours' host work (``token_dispatch/launch_count.py``), per
chunk count: would-be kernel launches, collectives and host syncs of ``make_plan`` alone, of the forward
(plan included) and of the backward; the forward's launches between the plan's last host sync and the first
row all-to-all; and, in brackets, the launches inside the experts backend (not the EP glue). Rank 0's counts.
``--profile DIR`` also runs torch.profiler over a few steps per chunk count and writes, per
rank 0, a table of the ``ep.*`` phase ranges and the top kernels (device and host time) and a Chrome trace.
Router and token rounding are outside the timed region (both providers get the same top-K routing).
On CPUs (``--device cpu``, gloo) Megatron's dispatcher runs under ``megatron_compat.patch_megatron_for_cpu`` (fake
CUDA streams etc.); use tiny sizes there -- it checks the plumbing, not speed.
Modules: ``layer_timing`` (chunk counts, interleaved rounds, the two all-to-all references), ``layer_baseline``
(Megatron's dispatcher + grouped_mm experts), ``layer_profile`` (--profile, --count-ops).
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.distributed as dist

from .common import print_table, write_json
from .dispatch import DTYPES, add_common_arguments, random_routing, setup_distributed, timed
from .layer_baseline import build_megatron_dispatcher, megatron_layer
from .layer_profile import count_ops, kernel_profile
from .layer_timing import a2a_alone, median, no_layer_a2a, paired, parse_chunks, timed_rounds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument(
        "--chunks",
        default="1,2",
        help="comma-separated num_chunks values for ours (N token chunks, each with its own all-to-alls); default 1,2",
    )
    parser.add_argument(
        "--comm-sms",
        default="0",
        help="comma-separated SM counts the GEMMs leave free while an all-to-all is in flight (comm_sms); every "
        "chunk count is timed for each value (default 0)",
    )
    parser.add_argument("--backend", default="auto", help="kernels backend for ours: auto|torch|cute (default auto)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the Megatron baseline")
    parser.add_argument(
        "--profile", default=None, help="directory for torch.profiler tables/traces of ours (rank 0); off if unset"
    )
    parser.add_argument("--profile-steps", type=int, default=3, help="profiled steps per chunk count (default 3)")
    parser.add_argument(
        "--count-ops",
        action="store_true",
        help="only count ours' host work per chunk count (would-be kernel launches, collectives, host syncs of "
        "make_plan, forward, backward; token_dispatch.launch_count) instead of timing; works on CPU/gloo",
    )


def run(args) -> int:
    from ..kernels import TopKRouting
    from ..token_dispatch import EPOptions, expert_parallel_experts, make_plan

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

    def ours(chunks, comm_sms=0):
        opts = EPOptions(backend=args.backend, num_chunks=chunks, comm_sms=comm_sms)

        def fn():
            out = expert_parallel_experts(x, routing, w1, w2, group=group, num_experts=E, options=opts)
            out.backward(grad)
            return out

        return fn

    def grads_of(fn):
        for t in (x, scores, w1, w2):
            t.grad = None
        out = fn().detach()
        return [out] + [t.grad.clone() for t in (x, scores, w1, w2)]

    chunk_list = parse_chunks(args.chunks)
    sms_list = [int(v) for v in args.comm_sms.split(",") if v.strip()]
    if any(v < 0 for v in sms_list):
        raise SystemExit(f"--comm-sms: SM counts must be >= 0, got {args.comm_sms!r}")
    if args.count_ops:

        def layer_call(chunks):
            opts = EPOptions(backend=args.backend, num_chunks=chunks)
            return expert_parallel_experts(x, routing, w1, w2, group=group, num_experts=E, options=opts)

        def plan_call(chunks):
            return make_plan(
                routing,
                num_experts=E,
                group=group,
                x_TD=x,
                w1_EGD=w1,
                w2_EDF=w2,
                options=EPOptions(activation="swiglu", num_chunks=chunks),
            )

        rows = count_ops(layer_call, plan_call, grad, chunk_list)
        if rank == 0:
            print(f"bench layer --count-ops: P={P} T={T} d={D} n={Fn} E={E} K={K} {args.dtype} on {device.type}")
            print_table(rows, list(rows[0]))
            config = dict(P=P, T=T, d=D, n=Fn, E=E, K=K, dtype=args.dtype, device=device.type, backend=args.backend)
            write_json(args.json, {"benchmark": "layer-count-ops", "config": config, "rows": rows})
        dist.barrier()
        dist.destroy_process_group()
        return 0
    first = None
    for chunks in chunk_list if args.profile else []:
        fn = ours(chunks, max(sms_list))
        for _ in range(args.warmup):
            fn()
        kernel_profile(fn, str(chunks), args.profile_steps, args.profile, rank, device)
    t_a2a = {}
    for chunks in chunk_list:
        ref = grads_of(ours(chunks, 0))
        same = all(torch.equal(a, b) for a, b in zip(ref, grads_of(ours(chunks, max(sms_list))), strict=True))
        # Sanity of the chunk metadata: output and dX against the first chunk count (max relative diff).
        first = first if chunks != chunk_list[0] else ref
        rel = [
            (a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)
            for a, b in zip(ref[:2], first[:2], strict=True)
        ]
        as_first = all(torch.equal(a, b) for a, b in zip(ref, first, strict=True))  # output and every gradient
        flags = [0.0 if same else 1.0, 0.0 if as_first else 1.0]
        flag = torch.stack([*torch.tensor(flags, device=device), *[r.to(device) for r in rel]])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        # Interleaved rounds: the layer (each comm_sms), the layer without its all-to-alls, and the all-to-alls
        # alone (same plan), each once per round.
        plan = make_plan(routing, num_experts=E, group=group, x_TD=x0, num_chunks=chunks)
        none = contextlib.nullcontext
        variants = {("layer", v): (ours(chunks, v), none) for v in sms_list}
        variants[("no a2a", 0)] = (ours(chunks, 0), no_layer_a2a)
        variants["a2a"] = (a2a_alone(plan, x0, device), none)
        timing = timed_rounds(variants, device, args.warmup, args.iters)
        t_a2a[chunks] = t_c = median(timing.pop("a2a")[0])
        t_none = timing[("no a2a", 0)][0]
        for (variant, comm_sms), (total, host) in timing.items():
            t = median(total)
            row = dict(provider="ours", chunks=chunks, comm_sms=comm_sms, variant=variant)
            row.update(ms=t * 1e3, host_ms=median(host) * 1e3, tokens_per_s=P * T / t, a2a_alone_ms=t_c * 1e3)
            if variant == "layer":
                exposed = paired(total, t_none)
                row["a2a_exposed_ms"] = exposed * 1e3
                row["a2a_hidden"] = max(0.0, min(1.0, 1 - exposed / t_c)) if t_c > 0 else None
                row.update(bitwise=bool(flag[0].item() == 0.0), bitwise_vs_first=bool(flag[1].item() == 0.0))
                row.update(rel_diff_out=float(flag[2]), rel_diff_dx=float(flag[3]))
            results.append(row)
            if rank == 0:
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    outputs["ours"] = ours(chunk_list[0], sms_list[0])().detach()

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
            row = dict(provider="megatron", chunks=1, variant="layer", ms=t * 1e3, tokens_per_s=P * T / t)
            results.append(row)
            outputs["megatron"] = baseline().detach()
        except Exception as exc:  # report, keep our numbers
            baseline_error = f"{type(exc).__name__}: {exc}"

    summary = {f"a2a_alone_ms_chunks{c}": t * 1e3 for c, t in t_a2a.items()}
    best_on = max((r for r in results if r.get("a2a_hidden") is not None), key=lambda r: r["a2a_hidden"], default=None)
    if best_on is not None:
        summary["max_a2a_hidden"] = best_on["a2a_hidden"]
        summary["max_a2a_hidden_at"] = f"chunks {best_on['chunks']} comm_sms {best_on['comm_sms']}"
    if "megatron" in outputs:
        mg = next(r for r in results if r["provider"] == "megatron")
        fastest = min(r["ms"] for r in results if r["provider"] == "ours" and r["variant"] == "layer")
        summary["speedup_vs_megatron"] = mg["ms"] / fastest
        diff = (outputs["ours"].float() - outputs["megatron"].float()).abs().max()
        scale = outputs["megatron"].float().abs().max().clamp(min=1e-6)
        rel = torch.stack([diff / scale])
        dist.all_reduce(rel, op=dist.ReduceOp.MAX)
        summary["max_rel_diff_ours_vs_megatron"] = float(rel)
    if rank == 0:
        print(f"bench layer: P={P} T={T} d={D} n={Fn} E={E} K={K} {args.dtype} on {device.type}")
        cols = ["provider", "chunks", "comm_sms", "variant", "ms", "host_ms", "tokens_per_s", "a2a_alone_ms"]
        cols += ["a2a_exposed_ms", "a2a_hidden"]
        print_table(results, cols + ["bitwise", "bitwise_vs_first", "rel_diff_out", "rel_diff_dx"])
        print(", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
        if baseline_error:
            print(f"megatron baseline failed: {baseline_error}")
        write_json(
            args.json,
            {
                "benchmark": "layer",
                "config": dict(
                    P=P, T=T, d=D, n=Fn, E=E, K=K, dtype=args.dtype, device=device.type, backend=args.backend
                ),
                "timing": f"interleaved: {args.iters} rounds, every variant of a chunk count once per round, "
                "medians; exposed is the median of per-round differences",
                "rows": results,
                "summary": summary,
                "baseline_error": baseline_error,
            },
        )
    dist.barrier()
    dist.destroy_process_group()
    return 0
