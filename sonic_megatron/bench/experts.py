"""``python -m sonic_megatron bench experts``: one GPU's MoE experts, fwd and fwd+bwd, against references.

Providers (all compute the same function from the same weights: a bf16 linear router, softmax over the
top-K logits, SwiGLU experts, the weighted sum; the router's time is included, its FLOPs are not):
    ours        bf16 router matmul + our fused top-K/softmax Triton kernel (``kernels.triton.topk_softmax``:
                one launch forward, one backward) + ``moe_experts(..., backend="cute")`` (QuACK GEMMs,
                our Triton kernels)
    sonic       sonic-moe 0.1.2 ``moe_TC_softmax_topk_layer`` (its own router/top-K kernels), when importable (an
                environment of its own, older CuTe-DSL: compare with ``--against``, below)
    grouped_mm  torch router + sort + ``torch._grouped_mm`` up/down projections + ``index_add`` (eager PyTorch)
    bmm         the cuBLAS bound: two perfectly balanced ``torch.bmm`` (E, TK/E rows each) + SwiGLU, no routing

TFLOPS follow SonicMoE's convention: forward 6TKdn, backward 12TKdn (backward time = fwd+bwd - fwd), timed
with ``triton.testing.do_bench`` (median) in ``--rounds`` rounds: each round times every provider once, the
order rotating from round to round, and the table shows each provider's median over the rounds (the JSON keeps
every round, and ``vs_sonic_rounds``: per round, sonic-moe's fwd+bwd time over this provider's).
``--interleaved N`` adds N cycles in which the providers' fwd+bwd calls alternate one by one (order rotating per
cycle; each call after an L2 flush and between CUDA events, as do_bench times it): all providers then share the
same clock and power conditions, which drift by several per cent under the H100's power cap between the rounds'
300 ms bursts. ``vs_sonic_paired`` is the median over cycles of sonic-moe's call time over this provider's in the
same cycle (``fwdbwd_ms_interleaved``: the provider's median call).
``act_MiB``: memory still allocated after the forward, minus the output (inputs and weights existed before):
what the autograd graph retains. ``bound_MiB``: the target 2Td + 4TKn + metadata (20TK + 2TE bytes) + 5 %.
``first_s``: the first fwd+bwd call in this process for the config (compilation, autotuning, caches).
``rel_err``: relative L2 error of the output vs ``grouped_mm``.

``--against FILE`` compares with sonic-moe measured by this command in another environment: sonic-moe 0.1.2 pins
an older CuTe-DSL than the ``cute`` backend needs, so the two cannot share a process. For every config this run has
no sonic row of its own, ``vs_sonic`` is the other runs' median sonic-moe fwd+bwd time over this provider's, and
``vs_sonic_anchored`` the same with each side's time divided by its own run's ``bmm`` time (the same PyTorch
GEMMs in both processes: what the GPU's clock did between the runs cancels).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from ..kernels.options import kernel_options, set_kernel_options
from .common import print_table, write_json

DEFAULT_CONFIGS = ("24576,1536,256,128,8", "32768,2048,1024,64,8", "32768,4096,1024,128,8")
PROVIDERS = ("ours", "sonic", "grouped_mm", "bmm")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        action="append",
        default=None,
        help="T,d,n,E,K (tokens, hidden, expert ffn, experts, top-K); repeatable. "
        f"Default: the issue's targets {', '.join(DEFAULT_CONFIGS)}",
    )
    parser.add_argument(
        "--providers", default=",".join(PROVIDERS), help=f"comma-separated subset of {','.join(PROVIDERS)}"
    )
    parser.add_argument("--warmup", type=int, default=5, help="do_bench warmup (ms)")
    parser.add_argument("--rep", type=int, default=300, help="do_bench measuring time per measurement (ms)")
    parser.add_argument(
        "--tuning",
        default=None,
        choices=("heuristic", "autotune", "default"),
        help="tile policy of the cute backend (replaces SONIC_MEGATRON_CUTE_TUNING's; default: leave it as is)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed of inputs and weights")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="timing rounds per config: every round times each provider once, the order rotating between "
        "rounds; medians over rounds are reported (default 3)",
    )
    parser.add_argument(
        "--interleaved",
        type=int,
        default=0,
        help="also time N cycles of alternating single fwd+bwd calls, one per provider per cycle (same clock and "
        "power conditions for all; reported as fwdbwd_ms_interleaved and vs_sonic_paired); default 0 = off",
    )
    parser.add_argument(
        "--against",
        action="append",
        default=None,
        metavar="FILE",
        help="the --json of this command run with sonic-moe in another environment (repeatable): adds vs_sonic and "
        "vs_sonic_anchored (each side over its own run's bmm time) for the configs both ran",
    )


def _parse(config: str) -> tuple[int, int, int, int, int]:
    parts = config.split(",")
    if len(parts) != 5 or not all(p.strip().isdigit() for p in parts):
        raise SystemExit(f"--config must be T,d,n,E,K (5 integers), got {config!r}")
    T, d, n, E, K = (int(p) for p in parts)
    if not 1 <= K <= E:
        raise SystemExit(f"--config {config}: K must be in [1, E], got K={K}, E={E}")
    return T, d, n, E, K


def _router(x, wr, K):
    """The torch router of ``grouped_mm`` (``ours`` fuses top-K and softmax: kernels.triton.topk_softmax)."""
    logits = x @ wr.t()
    top, idx = logits.topk(K, dim=-1)
    return torch.softmax(top.float(), dim=-1), idx


def _make_providers(names, T, d, n, E, K, seed):
    """{name: (fn() -> output, grad inputs)} over shared weights; missing dependencies become errors."""
    from sonic_megatron.kernels import TopKRouting, moe_experts

    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt, dev = torch.bfloat16, "cuda"

    def param(*shape, scale):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dt).requires_grad_(True)

    x = param(T, d, scale=1.0)
    wr = param(E, d, scale=d**-0.5)
    w1 = param(E, 2 * n, d, scale=d**-0.5)  # Megatron [gate ; up]
    w2 = param(E, d, n, scale=n**-0.5)
    out = {}

    if "ours" in names:
        from sonic_megatron.kernels.triton import topk_softmax

        def ours():
            scores, idx = topk_softmax(x @ wr.t(), K)
            return moe_experts(x, TopKRouting(scores, idx), w1, w2, backend="cute")

        out["ours"] = (ours, [x, wr, w1, w2])

    if "sonic" in names:
        try:
            from sonicmoe import moe_TC_softmax_topk_layer
            from sonicmoe.enums import ActivationType

            # sonic-moe's native interleaved fc1 rows, copied once from the same weights
            w1_sonic = w1.detach().view(E, 2, n, d).transpose(1, 2).reshape(E, 2 * n, d).clone().requires_grad_(True)
            w2_sonic = w2.detach().clone().requires_grad_(True)
            stream = torch.cuda.current_stream().cuda_stream

            def sonic():
                o, _, _ = moe_TC_softmax_topk_layer(
                    x, wr, w1_sonic.permute(1, 2, 0), None, w2_sonic.permute(1, 2, 0), None, K, stream,
                    ActivationType.SWIGLU, False,
                )  # fmt: skip
                return o

            out["sonic"] = (sonic, [x, wr, w1_sonic, w2_sonic])
        except ImportError as exc:
            out["sonic"] = exc

    if "grouped_mm" in names:

        def grouped_mm():
            scores, idx = _router(x, wr, K)
            flat = idx.reshape(-1)
            order = torch.argsort(flat, stable=True)
            tok = order // K
            offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
            h = torch._grouped_mm(x[tok], w1.transpose(1, 2), offs=offs)
            a = torch.nn.functional.silu(h[:, :n]) * h[:, n:]
            y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
            y = y * scores.reshape(-1)[order].to(dt)[:, None]
            return torch.zeros_like(x).index_add(0, tok, y)

        out["grouped_mm"] = (grouped_mm, [x, wr, w1, w2])

    if "bmm" in names:
        xb = param(E, T * K // E, d, scale=1.0)
        w1b = w1.detach().transpose(1, 2).contiguous().requires_grad_(True)  # (E, d, 2n)
        w2b = w2.detach().transpose(1, 2).contiguous().requires_grad_(True)  # (E, n, d)

        def bmm():
            h = torch.bmm(xb, w1b)
            return torch.bmm(torch.nn.functional.silu(h[..., :n]) * h[..., n:], w2b)

        out["bmm"] = (bmm, [xb, w1b, w2b])
    return out


def _prepare(fn, inputs):
    """(fwd, fwd_bwd, first_s, act_bytes): the timed closures, the first fwd+bwd call's seconds (compilation,
    autotuning, caches) and the activation memory the forward keeps for backward."""

    def fwd():
        return fn()

    def fwd_bwd():
        o = fn()
        torch.autograd.grad(o, inputs, grad_outputs=dO[0])

    with torch.no_grad():
        probe = fn()
    dO = [torch.randn_like(probe)]
    del probe
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fwd_bwd()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    m0 = torch.cuda.memory_allocated()
    o = fn()
    torch.cuda.synchronize()
    act = torch.cuda.memory_allocated() - m0 - o.numel() * o.element_size()
    del o
    return fwd, fwd_bwd, first_s, act


def _timing_row(fwd_ms: float, fwdbwd_ms: float, flops_fwd: int) -> dict:
    bwd_ms = fwdbwd_ms - fwd_ms
    return {
        "fwd_ms": fwd_ms,
        "fwdbwd_ms": fwdbwd_ms,
        "bwd_ms": bwd_ms,
        "fwd_TF": flops_fwd / fwd_ms * 1e-9,
        "bwd_TF": 2 * flops_fwd / bwd_ms * 1e-9 if bwd_ms > 0 else None,
        "fwdbwd_TF": 3 * flops_fwd / fwdbwd_ms * 1e-9,
    }


def _measure_config(names, providers, flops_fwd, args) -> dict[str, dict]:
    """Per provider: first-call seconds, activation memory, then ``args.rounds`` rounds of do_bench (fwd and
    fwd+bwd), each round timing every provider once in a rotated order (so drift of clocks or temperature
    during the run does not favour the provider that always goes first); medians over rounds."""
    from triton.testing import do_bench

    ready, out = {}, {}
    for name in names:
        entry = providers[name]
        if isinstance(entry, Exception):
            out[name] = {"error": f"{type(entry).__name__}: {entry}"}
            continue
        try:
            fwd, fwd_bwd, first_s, act = _prepare(*entry)
            ready[name] = (fwd, fwd_bwd)
            out[name] = {"act_MiB": act / 2**20, "first_s": first_s, "fwd_rounds": [], "fwdbwd_rounds": []}
        except Exception as exc:  # keep measuring the others; the error goes to the table/JSON
            out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    order = list(ready)
    for r in range(args.rounds):
        for name in order[r % len(order) :] + order[: r % len(order)] if order else []:
            fwd, fwd_bwd = ready[name]
            out[name]["fwd_rounds"].append(do_bench(fwd, warmup=args.warmup, rep=args.rep, return_mode="median"))
            out[name]["fwdbwd_rounds"].append(do_bench(fwd_bwd, warmup=args.warmup, rep=args.rep, return_mode="median"))
    for name in order:
        row = out[name]
        row.update(
            _timing_row(statistics.median(row["fwd_rounds"]), statistics.median(row["fwdbwd_rounds"]), flops_fwd)
        )
    if args.interleaved > 0 and order:
        calls = _interleaved_calls({name: ready[name][1] for name in order}, args.interleaved)
        for name in order:
            out[name]["fwdbwd_interleaved"] = calls[name]
            out[name]["fwdbwd_ms_interleaved"] = statistics.median(calls[name])
    return out


def _interleaved_calls(fns: dict, cycles: int) -> dict[str, list[float]]:
    """Per provider, ``cycles`` single-call times (ms): each cycle calls every provider once (order rotating),
    each call after do_bench's L2 flush and between CUDA events; one host sync at the end."""
    from triton import runtime

    driver = runtime.driver.active
    cache = driver.get_empty_cache_for_benchmark()
    flush = getattr(driver, "clear_cache", lambda buf: buf.zero_())  # older Triton: do_bench zeroes the buffer
    names = list(fns)
    for name in names:  # warm
        fns[name]()
    events = {name: [] for name in names}
    for c in range(cycles):
        for name in names[c % len(names) :] + names[: c % len(names)]:
            flush(cache)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fns[name]()
            b.record()
            events[name].append((a, b))
    torch.cuda.synchronize()
    return {name: [a.elapsed_time(b) for a, b in ev] for name, ev in events.items()}


def load_against(paths: list[str] | None) -> list[dict]:
    """The rows of other ``bench experts --json`` runs (``--against``); an unreadable file stops before any GPU
    work, naming the argument."""
    rows = []
    for path in paths or ():
        try:
            with open(path) as f:
                payload = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise SystemExit(f"--against {path}: not a readable bench experts JSON ({exc})") from exc
        if payload.get("benchmark") != "experts" or not isinstance(payload.get("rows"), list):
            raise SystemExit(f"--against {path}: expected the --json of 'bench experts', got another file")
        rows.extend(payload["rows"])
    return rows


def compare_against(rows: list[dict], other_rows: list[dict]) -> None:
    """Adds ``vs_sonic`` / ``vs_sonic_anchored`` / ``sonic_runs`` to ``rows`` (one config's rows of this run) from
    the sonic-moe rows of other runs (``--against``), unless this run measured sonic-moe itself."""
    if not rows or any(r["provider"] == "sonic" and "fwdbwd_ms" in r for r in rows):
        return
    config = rows[0]["config"]
    timed = [r for r in other_rows if r.get("config") == config and "fwdbwd_ms" in r]
    sonic = [r["fwdbwd_ms"] for r in timed if r["provider"] == "sonic"]
    if not sonic:
        return
    other_bmm = [r["fwdbwd_ms"] for r in timed if r["provider"] == "bmm"]
    anchors = [r["fwdbwd_ms"] for r in rows if r["provider"] == "bmm" and "fwdbwd_ms" in r]
    sonic_ms = statistics.median(sonic)
    for r in rows:
        if "fwdbwd_ms" not in r or r["provider"] in ("sonic", "bmm"):
            continue
        r["vs_sonic"] = sonic_ms / r["fwdbwd_ms"]
        r["sonic_runs"] = len(sonic)
        if other_bmm and anchors:
            r["vs_sonic_anchored"] = (sonic_ms / statistics.median(other_bmm)) / (r["fwdbwd_ms"] / anchors[0])


def run(args: argparse.Namespace) -> int:
    against = load_against(args.against)
    if not torch.cuda.is_available():
        print("bench experts needs a CUDA GPU")
        return 2
    if args.tuning:
        set_kernel_options(dataclasses.replace(kernel_options(), tuning=args.tuning))
    names = [p.strip() for p in args.providers.split(",") if p.strip()]
    bad = sorted(set(names) - set(PROVIDERS))
    if bad:
        raise SystemExit(f"--providers: unknown {bad}; choose from {PROVIDERS}")
    if "ours" in names:
        import sonic_megatron.kernels.cute  # noqa: F401  (sets QuACK's cache env before sonic-moe imports QuACK)
    rows = []
    for config in args.config or DEFAULT_CONFIGS:
        T, d, n, E, K = _parse(config)
        flops_fwd = 6 * T * K * d * n
        bound = (2 * T * d + 4 * T * K * n + 20 * T * K + 2 * T * E) * 1.05 / 2**20
        providers = _make_providers(names, T, d, n, E, K, args.seed)
        ref_out = None
        if "grouped_mm" in providers and not isinstance(providers["grouped_mm"], Exception):
            with torch.no_grad():
                ref_out = providers["grouped_mm"][0]().float()
        measured = _measure_config(names, providers, flops_fwd, args)
        cfg_rows = []
        for name in names:
            row = {"config": config, "provider": name, "bound_MiB": bound, **measured[name]}
            entry = providers[name]
            if ref_out is not None and name != "bmm" and "error" not in row:
                with torch.no_grad():
                    o = entry[0]().float()
                row["rel_err"] = ((o - ref_out).norm() / ref_out.norm()).item()
            cfg_rows.append(row)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        torch.cuda.empty_cache()
        sonic = next((r for r in cfg_rows if r["provider"] == "sonic" and "fwdbwd_TF" in r), None)
        for r in cfg_rows:
            if sonic and "fwdbwd_TF" in r:
                r["vs_sonic"] = r["fwdbwd_TF"] / sonic["fwdbwd_TF"]
                r["fwd_vs_sonic"] = r["fwd_TF"] / sonic["fwd_TF"]
                # per round (same round = close in time): sonic's time / ours
                r["vs_sonic_rounds"] = [a / b for a, b in zip(sonic["fwdbwd_rounds"], r["fwdbwd_rounds"], strict=True)]
                if "fwdbwd_interleaved" in r:  # same cycle = the same clock and power conditions
                    pairs = zip(sonic["fwdbwd_interleaved"], r["fwdbwd_interleaved"], strict=True)
                    r["vs_sonic_paired"] = statistics.median(a / b for a, b in pairs)
        compare_against(cfg_rows, against)
        rows.extend(cfg_rows)
        del providers, ref_out
        torch.cuda.empty_cache()
        print_table(cfg_rows, COLUMNS)  # per config as it completes, so a cut-off run still reports
        write_json(args.json, _payload(rows))
    print("\nall configs:")
    print_table(rows, COLUMNS)
    return 0


COLUMNS = ["config", "provider", "fwd_ms", "fwd_TF", "bwd_TF", "fwdbwd_ms", "fwdbwd_TF", "vs_sonic"]
COLUMNS += ["vs_sonic_anchored", "fwdbwd_ms_interleaved", "vs_sonic_paired"]
COLUMNS += ["act_MiB", "bound_MiB", "first_s", "rel_err", "error"]


def _payload(rows: list[dict]) -> dict:
    tuning = kernel_options().tuning
    return {"benchmark": "experts", "dtype": "bfloat16", "cute_tuning": tuning, "rows": rows}
