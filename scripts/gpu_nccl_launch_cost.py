#!/usr/bin/env python3
"""Host time to LAUNCH one EP all-to-all (not its transfer), per way of issuing it. Under torchrun, NCCL:

    torchrun --nproc_per_node 4 scripts/gpu_nccl_launch_cost.py [--rows 11000] [--calls 40]

In the two-micro-batch schedule the slowest rank's host sets the step time, and each all_to_all_single took
0.13-0.2 ms of host time in gpu_ep_timeline.py. Variants, each ``--calls`` launches back to back (async, waited
for at the end; median of 5 repeats; rank 0 prints, max over ranks):
  all_to_all_single   dist.all_to_all_single(out, inp, splits, splits, async_op=True)
  alltoall_base       the process group's C++ method directly (no Python wrapper)
  coalesced x2        two all_to_all_single inside dist._coalescing_manager(device=..., async_ops=True) (per pair)
  batch_isend_irecv   the same exchange as P2P ops without the rank itself (one NCCL group)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=11000, help="rows of 1536 bf16 per peer (default 11000: ~34 MB)")
    p.add_argument("--calls", type=int, default=40)
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, P = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    splits = [args.rows] * P
    inp = torch.randn(args.rows * P, 1536, device=device).to(torch.bfloat16)
    out = torch.empty_like(inp)
    inp2, out2 = torch.randn(args.rows * P, device=device), torch.empty(args.rows * P, device=device)

    def a2a():
        return [dist.all_to_all_single(out, inp, splits, splits, group=group, async_op=True)]

    def base():
        opts = dist.AllToAllOptions()
        opts.asyncOp = True
        return [group.alltoall_base(out, inp, splits, splits, opts)]

    def coalesced():
        with dist._coalescing_manager(group, device, async_ops=True) as cm:
            dist.all_to_all_single(out, inp, splits, splits, group=group, async_op=True)
            dist.all_to_all_single(out2, inp2, splits, splits, group=group, async_op=True)
        return [cm]

    def p2p():
        ops = []
        for peer in range(P):
            if peer == rank:
                continue
            s = slice(peer * args.rows, (peer + 1) * args.rows)
            ops.append(dist.P2POp(dist.isend, inp[s], peer, group))
            ops.append(dist.P2POp(dist.irecv, out[s], peer, group))
        return dist.batch_isend_irecv(ops)

    results = {}
    for name, fn in (
        ("all_to_all_single", a2a),
        ("alltoall_base", base),
        ("coalesced x2", coalesced),
        ("batch_isend_irecv", p2p),
    ):
        for _ in range(3):
            for w in fn():
                w.wait()
        reps = []
        for _ in range(5):
            torch.cuda.synchronize()
            dist.barrier()
            torch.cuda.synchronize()
            works = []
            t0 = time.perf_counter()
            for _ in range(args.calls):
                works += fn()
            reps.append((time.perf_counter() - t0) / args.calls * 1e6)
            for w in works:
                w.wait()
            torch.cuda.synchronize()
        t = torch.tensor([statistics.median(reps)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        results[name] = t.item()
    if rank == 0:
        print(f"host us per launch (max over {P} ranks, {args.rows} rows of 1536 bf16 per peer):")
        for k, v in results.items():
            print(f"  {k:20s} {v:8.1f}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
