"""A small CPU run of the SonicMoE experts engine (``sonic_megatron.kernels``, torch backend).

Routes a few hundred random tokens with a softmax top-K router, runs forward + backward, and prints:
shapes, milliseconds per forward and forward+backward, the largest error of the output and of every
gradient against the float64 per-expert reference (next to the error of plain PyTorch in the same
precision), and the activation bytes autograd keeps for backward: ours (X, H, scores, int32 metadata)
versus a naive MoE that keeps gathered X, the activation and Y per expert.

    python examples/experts_demo.py [--tokens 512 --hidden 256 --ffn 128 --experts 8 --topk 2 --dtype fp32]

Shape legend as in kernels/routing.py: T tokens, D hidden, F expert ffn, E experts, K top-K, R = T*K pairs.
"""

from __future__ import annotations

import argparse
import statistics
import time
import weakref

import torch
from sonic_megatron.kernels import GATED_ACTIVATIONS, TopKRouting, moe_experts, moe_experts_reference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=512, help="T, tokens routed to the experts")
    p.add_argument("--hidden", type=int, default=256, help="D, hidden size")
    p.add_argument("--ffn", type=int, default=128, help="F, each expert's ffn size (fc1 is 2F wide when gated)")
    p.add_argument("--experts", type=int, default=8, help="E, number of experts")
    p.add_argument("--topk", type=int, default=2, help="K, experts per token")
    p.add_argument("--activation", default="swiglu", help="swiglu, geglu, relu2 or gelu")
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="fp32",
        help="precision of x and the weights (bf16 is slow on most CPUs)",
    )
    p.add_argument("--iters", type=int, default=5, help="timed iterations (after one warm-up)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the data")
    return p.parse_args(argv)


def make_problem(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """float64 leaves: tokens, a softmax top-K routing from a random router, expert weights, dO."""
    g = torch.Generator().manual_seed(args.seed)
    T, D, F, E, K = args.tokens, args.hidden, args.ffn, args.experts, args.topk
    G = 2 * F if args.activation in GATED_ACTIVATIONS else F
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    router = torch.randn(D, E, generator=g, dtype=torch.float64) / D**0.5
    probs = torch.softmax(x @ router, dim=-1)
    scores, indices = probs.topk(K, dim=-1)
    return dict(
        x=x,
        scores=scores,
        indices=indices,
        w1=torch.randn(E, G, D, generator=g, dtype=torch.float64) / D**0.5,
        w2=torch.randn(E, D, F, generator=g, dtype=torch.float64) / F**0.5,
        dO=torch.randn(T, D, generator=g, dtype=torch.float64),
    )


def leaves(prob: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    # Router probabilities stay fp32 (as Megatron hands them over); x and the weights take ``dtype``.
    score_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return tuple(
        prob[k].to(score_dtype if k == "scores" else dtype).requires_grad_() for k in ("x", "scores", "w1", "w2")
    )


def run_once(fn, prob, dtype, activation) -> tuple[dict[str, torch.Tensor], int]:
    """Forward + backward; returns the output and gradients, and the bytes autograd saved for backward
    (distinct storages, weights excluded)."""
    x, s, w1, w2 = leaves(prob, dtype)
    packed: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x, TopKRouting(s, prob["indices"]), w1, w2, activation=activation)
    # Count what the graph still holds: tensors saved by branches that died during forward (e.g. an
    # unused derivative) were freed, and their addresses may have been reused.
    weights = {w1.untyped_storage().data_ptr(), w2.untyped_storage().data_ptr()}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for r in packed if (t := r()) is not None}
    saved_bytes = sum(n for ptr, n in storages.items() if ptr not in weights)
    grads = torch.autograd.grad(out, (x, s, w1, w2), prob["dO"].to(out.dtype))
    results = dict(zip(("out", "dx", "dscores", "dw1", "dw2"), (out.detach(), *grads), strict=True))
    return results, saved_bytes


def time_ms(fns: dict, prob, dtype, activation, iters: int) -> dict[str, tuple[float, float]]:
    """Median milliseconds of forward and of forward+backward per provider. Providers alternate within
    each iteration, so that a busy machine slows them alike."""
    x, s, w1, w2 = leaves(prob, dtype)
    routing = TopKRouting(s, prob["indices"])
    dO = prob["dO"].to(dtype)
    fwd: dict[str, list[float]] = {name: [] for name in fns}
    total: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(iters + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            out = fn(x, routing, w1, w2, activation=activation)
            t1 = time.perf_counter()
            torch.autograd.grad(out, (x, s, w1, w2), dO)
            t2 = time.perf_counter()
            if i:  # the first iteration warms up
                fwd[name].append(1e3 * (t1 - t0))
                total[name].append(1e3 * (t2 - t0))
    return {name: (statistics.median(fwd[name]), statistics.median(total[name])) for name in fns}


def sonic(x, routing, w1, w2, activation):
    return moe_experts(x, routing, w1, w2, activation=activation, backend="torch")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    prob = make_problem(args)
    T, D, F, E, K = args.tokens, args.hidden, args.ffn, args.experts, args.topk
    counts = torch.bincount(prob["indices"].reshape(-1), minlength=E).tolist()
    print(f"experts demo: T={T} D={D} F={F} E={E} K={K} activation={args.activation} dtype={args.dtype}")
    print(f"  x [{T}, {D}]  w1 [{E}, {prob['w1'].shape[1]}, {D}]  w2 [{E}, {D}, {F}]  tokens per expert {counts}")

    ref64, _ = run_once(moe_experts_reference, prob, torch.float64, args.activation)
    ours, ours_bytes = run_once(sonic, prob, dtype, args.activation)
    naive, naive_bytes = run_once(moe_experts_reference, prob, dtype, args.activation)

    print(f"  max |error| vs float64 reference, relative to max |reference| (PyTorch {args.dtype} in brackets):")
    for name, ref in ref64.items():
        scale = ref.abs().max().item()
        err = (ours[name].double() - ref).abs().max().item() / scale
        err_naive = (naive[name].double() - ref).abs().max().item() / scale
        print(f"    {name:8s} {err:9.2e}  ({err_naive:.2e})")

    ms = time_ms({"sonic": sonic, "naive": moe_experts_reference}, prob, dtype, args.activation, args.iters)
    print(
        f"  time (median of {args.iters}): sonic fwd {ms['sonic'][0]:.1f} ms, fwd+bwd {ms['sonic'][1]:.1f} ms;", end=" "
    )
    print(f"naive per-expert loop fwd {ms['naive'][0]:.1f} ms, fwd+bwd {ms['naive'][1]:.1f} ms")

    R, G, b = T * K, prob["w1"].shape[1], torch.finfo(dtype).bits // 8
    expected = b * T * D + b * R * G + 4 * R + 4 * (E + 1 + 3 * R + T + 1)  # X, H, fp32 scores, int32 metadata
    print(f"  cached for backward (weights excluded): sonic {ours_bytes / 2**20:.2f} MiB", end=" ")
    print(f"(X, H, scores, int32 metadata; formula {expected / 2**20:.2f} MiB),", end=" ")
    print(f"naive {naive_bytes / 2**20:.2f} MiB = {naive_bytes / ours_bytes:.1f}x", end=" ")
    print(f"(gathered X, H, A, Y, activation temporaries; R={R})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
