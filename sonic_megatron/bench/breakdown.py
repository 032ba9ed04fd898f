"""``python -m sonic_megatron bench breakdown``: the Megatron MoE layer against the bare kernels it wraps, on
one GPU (expert-parallel size 1), per phase.

Rows, all fwd+bwd of the same tokens in the same process (bf16, SwiGLU, top-K softmax router with fp32 logits
and Megatron's aux loss):
    kernels            the router GEMM (fp32) + fused top-K softmax + ``moe_experts``: what the layer wraps
    router             ``SonicRouter`` alone (the layer's route step, aux loss included)
    experts            ``SonicExperts.compute`` alone on the router's top-K
    plugin             ``SonicMoELayer`` (the plugin spec's layer)
    plugin+rounding    the same with ``token_rounding="nearest"``
    grouped            stock ``MoELayer`` + Megatron's alltoall dispatcher + grouped-GEMM experts
                       (``sonic_megatron.baseline``: TEGroupedMLP where Transformer Engine imports)
The rows run side by side: ``--iters`` rounds, each row once per round in rotating order, every call from fresh
gradients (``without_grads``: rows share weights and inputs, and DDP hands every ``.grad`` on). Per row: step ms (CUDA
events around the call; median and min-max over the rounds), GPU ms (its kernels' and copies' summed durations:
below the step ms the device waits for the host), host ms (CPU time to issue the call; a step whose host ms
reaches its step ms is host-bound), host syncs per call (PyTorch's sync debug mode), peak memory, and paired
ratios (median over rounds of the two rows' times in the same round): ``x_kernels`` = row / kernels,
``x_plugin`` = row / plugin, ``x_grouped`` = grouped / row (the speedup over the baseline). At expert-parallel size
1 the plugin layer has no plan, dispatch or combine phase (they pass tensors through), so router and experts are
its phases. Configs: ``qwen3`` = (T 16384, hidden 2048, ffn 768, 128 experts, top-8), ``sparse`` = (T
16384, hidden 2048, ffn 512, 256 experts, top-8), or ``T,d,n,E,K``.

``--routing balanced`` builds the tokens and router weights so that token t's top-K experts are
(t*K + k) mod E: every expert gets T*K/E tokens, a multiple of the tile at both configs, so token rounding has
nothing to change (its cost alone shows); ``random`` (default) uses random tokens and router weights.
"""

from __future__ import annotations

import argparse
import statistics
import time

CONFIGS = {"qwen3": (16384, 2048, 768, 128, 8), "sparse": (16384, 2048, 512, 256, 8)}
ROWS = ("kernels", "router", "experts", "plugin", "plugin+rounding", "grouped")


def _config(text: str) -> tuple[int, ...]:
    if text in CONFIGS:
        return CONFIGS[text]
    parts = text.split(",")
    if len(parts) != 5 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"--config must be one of {sorted(CONFIGS)} or T,d,n,E,K; got {text!r}")
    return tuple(int(p) for p in parts)


def _rows(text: str) -> list[str]:
    rows = [r.strip() for r in text.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad or not rows:
        raise argparse.ArgumentTypeError(f"--rows must be a comma-separated subset of {ROWS}; got {text!r}")
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=_config, action="append", help="qwen3 | sparse | T,d,n,E,K (repeatable)")
    parser.add_argument("--rows", type=_rows, default=list(ROWS), help=f"rows to run, from {','.join(ROWS)}")
    parser.add_argument("--iters", type=int, default=20, help="timed rounds (each row once per round)")
    parser.add_argument("--seq", type=int, default=4096, help="sequence length; batch = T / seq")
    parser.add_argument(
        "--routing",
        choices=("random", "balanced"),
        default="random",
        help="random tokens and router, or a balanced top-K (every expert T*K/E tokens: nothing to round)",
    )


def rotated(names: list[str], round_index: int) -> list[str]:
    """The order of the rows in one round: every row once, the first one rotating from round to round."""
    k = round_index % len(names)
    return names[k:] + names[:k]


def paired_ratio(ms_rounds: dict[str, list[float]], row: str, ref: str) -> float | None:
    """Median over rounds of row's time / ref's time in the same round (None if either row did not run)."""
    if row not in ms_rounds or ref not in ms_rounds:
        return None
    return statistics.median(a / b for a, b in zip(ms_rounds[row], ms_rounds[ref], strict=True))


def _count_syncs(fn) -> int:
    """Host syncs of one call, as PyTorch's sync debug mode reports them (item(), blocking copies to the host,
    nonzero, ...)."""
    import warnings

    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _gpu_ms(fn, device, calls: int = 3) -> float:
    """GPU time of one call: the summed durations of its kernels and copies (torch profiler, ``calls`` calls);
    below the step time, the device idles for the host."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize(device)
    device_events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    return sum(e.device_time_total for e in device_events) / 1e3 / calls


def measure_rows(fns: dict, iters: int, device) -> dict[str, dict]:
    """Per row: 3 warm-up calls, then peak memory, host syncs and GPU time from calls of its own; then ``iters``
    rounds in which every row runs once, in rotating order (``rotated``), timed by CUDA events around the call
    (step ms) and the host clock (host ms: the CPU time to issue it). Rows of one round share the device's
    clock and temperature, so ``paired_ratio`` over rounds compares them side by side."""
    import torch

    names = list(fns)
    stats = {}
    for name in names:
        fn = fns[name]
        for _ in range(3):
            fn()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        _count_syncs(fn)  # the first counted call of a process reports one sync more (a one-time event)
        syncs = _count_syncs(fn)
        torch.cuda.synchronize(device)
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        stats[name] = {"peak_mib": peak, "host_syncs": syncs, "gpu_ms": _gpu_ms(fn, device)}
    events = {n: [] for n in names}
    host = {n: [] for n in names}
    for r in range(iters):
        for name in rotated(names, r):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fns[name]()
            host[name].append((time.perf_counter() - t0) * 1e3)
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize(device)
    for name in names:
        ms = [s.elapsed_time(e) for s, e in events[name]]
        stats[name].update(
            ms=statistics.median(ms),
            ms_min=min(ms),
            ms_max=max(ms),
            host_ms=statistics.median(host[name]),
            ms_rounds=ms,
        )
    return stats


def _layers(cfg, device, seq: int):
    """(plugin, plugin with rounding, grouped baseline) with the same router and expert weights."""
    import torch
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.router import TopKRouter

    from ..baseline import grouped_experts_builder
    from ..config import SonicConfig
    from ..layer import SonicMoELayer
    from ..megatron_compat import accepted_kwargs, default_pg_collection
    from ..testing import bench_moe_config

    config = bench_moe_config(cfg)
    pgs = default_pg_collection()
    plugin = SonicMoELayer(config, pg_collection=pgs, sonic_config=SonicConfig())
    rounded = SonicMoELayer(config, pg_collection=pgs, sonic_config=SonicConfig(token_rounding="nearest"))
    submodules = MoESubmodules(experts=grouped_experts_builder(), router=TopKRouter)
    grouped = MoELayer(
        **accepted_kwargs(MoELayer.__init__, dict(config=config, submodules=submodules, pg_collection=pgs))
    )
    with torch.no_grad():
        for other in (rounded, grouped):
            other.router.weight.copy_(plugin.router.weight)
        rounded.experts.weight1.copy_(plugin.experts.weight1)
        rounded.experts.weight2.copy_(plugin.experts.weight2)
    return [m.to(device).train() for m in (plugin, rounded, grouped)]


def without_grads(fn, *holders):
    """``fn`` followed by dropping every gradient it left in ``holders`` (modules and leaf tensors). Each call
    then writes fresh gradients, as under Megatron's DDP (whose hooks hand every ``.grad`` on and set it to None),
    instead of adding into the previous call's: a row whose weights or input another row shares would otherwise
    time an extra add of every gradient (1.5 ms for the experts' weights at qwen3)."""
    import torch

    def step():
        fn()
        for holder in holders:
            if isinstance(holder, torch.nn.Module):
                holder.zero_grad(set_to_none=True)
            else:
                holder.grad = None

    return step


def _layer_step(layer, x, g):
    def step():
        out, _ = layer(x)
        out.backward(g)

    return without_grads(step, layer, x)


def _balanced_inputs(plugin_router_weight, T: int, d: int, E: int, K: int, seq: int, device):
    """Tokens and router weights (set in place) whose top-K for token t is experts (t*K + k) mod E, by a wide
    margin: router row e reads feature e; token t carries 1 on its K features over noise of 0.1."""
    import torch

    if d < E or K > E:
        raise ValueError(f"--routing balanced needs hidden >= experts and top-K <= experts, got d={d} E={E} K={K}")
    with torch.no_grad():
        plugin_router_weight.zero_()
        plugin_router_weight[:, :E].copy_(8.0 * torch.eye(E))
    x_TD = 0.1 * torch.randn(T, d, device=device)
    chosen_TK = (torch.arange(T, device=device).unsqueeze(1) * K + torch.arange(K, device=device)) % E
    x_TD.scatter_add_(1, chosen_TK, torch.ones(T, K, device=device))
    return x_TD.to(torch.bfloat16).view(T // seq, seq, d).transpose(0, 1).contiguous()


def run_config(cfg, rows, iters: int, seq: int, device, routing: str = "random") -> list[dict]:
    import torch
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from ..kernels import TopKRouting, moe_experts
    from ..kernels.triton.topk_softmax import topk_softmax

    T, d, n, E, K = cfg
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device=device))
    plugin, rounded, grouped = _layers(cfg, device, seq)
    torch.manual_seed(0)
    if routing == "balanced":
        x = _balanced_inputs(plugin.router.weight, T, d, E, K, seq, device).requires_grad_()
        with torch.no_grad():
            for other in (rounded, grouped):
                other.router.weight.copy_(plugin.router.weight)
    else:
        x = torch.randn(seq, T // seq, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    x_TD, g_TD = x.detach().view(-1, d).requires_grad_(), g.view(-1, d)
    w_r = plugin.router.weight.detach().requires_grad_()
    w1 = plugin.experts.weight1.detach().requires_grad_()
    w2 = plugin.experts.weight2.detach().requires_grad_()

    def kernels():
        logits = torch.nn.functional.linear(x_TD.float(), w_r.float())
        scores, idx = topk_softmax(logits, K)
        out = moe_experts(x_TD, TopKRouting(scores, idx), w1, w2)
        out.backward(g_TD)

    def router():
        plugin.router(x).scores_TK.sum().backward()

    with torch.no_grad():
        logits = torch.nn.functional.linear(x_TD.float(), w_r.float())
        scores, idx = topk_softmax(logits, K)
        counts = torch.zeros(E, dtype=torch.int64, device=device).index_add_(
            0, idx.reshape(-1), torch.ones(idx.numel(), dtype=torch.int64, device=device)
        )
        untiled = int((counts % 128 != 0).sum())
    print(f"  routing {routing}: {untiled} of {E} experts' token counts are not multiples of 128", flush=True)

    def experts():
        out = plugin.experts.compute(x_TD, TopKRouting(scores, idx))
        out.backward(g_TD)

    fns = {
        "kernels": without_grads(kernels, x_TD, w_r, w1, w2),
        "router": without_grads(router, plugin.router, x),
        "experts": without_grads(experts, plugin.experts, x_TD),
        "plugin": _layer_step(plugin, x, g),
        "plugin+rounding": _layer_step(rounded, x, g),
        "grouped": _layer_step(grouped, x, g),
    }
    print(f"  rows {', '.join(rows)}: warm-up, memory, syncs and GPU time per row, then {iters} rounds", flush=True)
    stats = measure_rows({name: fns[name] for name in rows}, iters, device)
    ms_rounds = {name: st["ms_rounds"] for name, st in stats.items()}
    out = []
    for name in rows:
        out.append(
            {
                "config": ",".join(map(str, cfg)),
                "routing": routing,
                "row": name,
                **stats[name],
                "x_kernels": paired_ratio(ms_rounds, name, "kernels"),
                "x_plugin": paired_ratio(ms_rounds, name, "plugin"),
                "x_grouped": paired_ratio(ms_rounds, "grouped", name),  # the speedup over the baseline
            }
        )
    return out


def run(args) -> int:
    import torch

    from ..testing import free_port, init_distributed, init_model_parallel
    from .common import print_table, write_json

    if not torch.cuda.is_available():
        print("bench breakdown needs a CUDA GPU (it times the Megatron layer against the GPU kernels)")
        return 2
    if args.iters < 1:
        print(f"--iters must be >= 1, got {args.iters}")
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    if not torch.distributed.is_initialized():
        init_distributed(0, 1, port=free_port())
    init_model_parallel(ep=1)
    configs = args.config or [CONFIGS["qwen3"]]
    results = []
    for cfg in configs:
        if cfg[0] % args.seq:
            print(f"--seq {args.seq} must divide T = {cfg[0]}")
            return 2
        print(f"config (T,d,n,E,K) = {cfg}", flush=True)
        results += run_config(cfg, args.rows, args.iters, args.seq, device, args.routing)
    columns = ["config", "routing", "row", "ms", "ms_min", "ms_max", "gpu_ms", "host_ms", "host_syncs", "peak_mib"]
    print_table(results, columns + ["x_kernels", "x_plugin", "x_grouped"])
    write_json(args.json, {"benchmark": "breakdown", "results": results})
    return 0
