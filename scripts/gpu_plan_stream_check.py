#!/usr/bin/env python3
"""Repeated interleaved steps with ``plan_stream`` "side" against "current", bitwise, on NCCL (torchrun, one GPU
per rank): each step has fresh tokens and routing (random, or all on one expert on odd steps), so buffers change
size and the caching allocator hands out different blocks every step -- the side stream's memory rules
(``token_dispatch/streams.py``) are exercised where a missed one corrupts results or faults.

    torchrun --nproc_per_node 2 scripts/gpu_plan_stream_check.py [--tokens 32768] [--steps 12]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from sonic_megatron.kernels import TopKRouting
from sonic_megatron.token_dispatch import ep_forward, ep_forward_backward


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--comm-sms", type=int, default=32)
    args = p.parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, P = dist.get_rank(), dist.get_world_size()
    T, D, F, E, K = args.tokens, 1536, 256, 128, 8
    g = torch.Generator().manual_seed(5 + rank)
    w1 = (torch.randn(E // P, 2 * F, D, generator=g) / D**0.5).to(device, torch.bfloat16)
    w2 = (torch.randn(E // P, D, F, generator=g) / F**0.5).to(device, torch.bfloat16)

    def batch(i):
        gi = torch.Generator().manual_seed(1000 * i + rank)
        x = torch.randn(T - 97 * (i % 3), D, generator=gi).to(device, torch.bfloat16)
        n = x.shape[0]
        hot = torch.arange(K).expand(n, K).contiguous()  # experts 0..K-1 (rank 0's): the others receive nothing
        idx = hot if i % 2 else torch.rand(n, E, generator=gi).argsort(-1)[:, :K]
        scores = torch.softmax(torch.randn(n, K, generator=gi), -1)
        grad = torch.randn(n, D, generator=gi).to(device, torch.bfloat16)
        return x, TopKRouting(scores.to(device), idx.to(device)), grad

    def run(plan_stream):
        kw = dict(group=dist.group.WORLD, num_experts=E, backend="auto", comm_sms=args.comm_sms)
        kw["plan_stream"] = plan_stream
        x, r, grad = batch(0)
        _, state = ep_forward(x, r, w1, w2, **kw)
        results = []
        for i in range(1, args.steps + 1):
            x, r, grad_next = batch(i)
            out, state, gr = ep_forward_backward(state, grad, x, r, w1, w2, **kw)
            results.append([t.clone() for t in (out, gr.dx_TD, gr.dscores_R, gr.dw1_EGD, gr.dw2_EDF)])
            grad = grad_next
        torch.cuda.synchronize()
        return results

    current, side = run("current"), run("side")
    bad = [
        (i, k)
        for i, (a, b) in enumerate(zip(current, side, strict=True))
        for k, (u, v) in enumerate(zip(a, b, strict=True))
        if not torch.equal(u, v)
    ]
    flag = torch.tensor([len(bad)], device=device)
    dist.all_reduce(flag)
    if rank == 0:
        verdict = "PASS" if flag.item() == 0 else f"FAIL ({flag.item()} mismatches; rank 0: {bad[:5]})"
        print(f"plan_stream side == current, bitwise, {args.steps} steps, P={P} T={T}: {verdict}", flush=True)
    dist.destroy_process_group()
    return 0 if flag.item() == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
