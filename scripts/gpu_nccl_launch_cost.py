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
  a2a, 40 frames deep all_to_all_single under 40 more Python frames (the flight recorder, when on, records
                      every collective with its Python stack)
  30 kernels / 30 kernels + a2a   small kernel launches alone, and followed by one all_to_all_single
  fresh buffers       all_to_all_single into and from newly allocated tensors (as the layer does)
  fresh, uneven splits  the same with uneven split sizes that change from call to call
  GEMM queued + a2a   one 8192^3 bf16 GEMM launched first (~1.5 ms of GPU work queued ahead), then the a2a
  kernel launch, GPU idle / a2a in flight   one small kernel launch (of 30), with the GPU idle and while a long
                      all-to-all runs (is the host slower while NCCL works?)
It also prints whether the flight recorder holds entries (TORCH_FR_BUFFER_SIZE / TORCH_NCCL_TRACE_BUFFER_SIZE).
"""

from __future__ import annotations

import argparse
import itertools
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

    small = torch.zeros(1024, device=device)

    def kernels():  # 30 small kernel launches: the layer's context between two all-to-alls
        for _ in range(30):
            small.add_(1.0)
        return []

    def kernels_a2a():
        kernels()
        return a2a()

    def deep(depth: int, fn):  # the same call under `depth` more Python frames (the layer's call stack)
        return fn() if depth == 0 else deep(depth - 1, fn)

    def fresh():  # new receive and send buffers every call, as the layer allocates them
        o, i = torch.empty_like(out), torch.empty_like(inp)
        return [dist.all_to_all_single(o, i, splits, splits, group=group, async_op=True)]

    counter = itertools.count()

    def fresh_split():  # the layer's shape: uneven split sizes that change every call, fresh buffers
        k = next(counter) % 7  # the same on every rank
        to_peer = [args.rows - 50 * ((k + peer) % 5) for peer in range(P)]  # rows this rank sends to each peer
        from_peer = [args.rows - 50 * ((k + rank) % 5)] * P  # what every peer sends to this rank
        o, i = out.new_empty(sum(from_peer), 1536), inp.new_empty(sum(to_peer), 1536)
        return [dist.all_to_all_single(o, i, from_peer, to_peer, group=group, async_op=True)]

    gemm_a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def busy_a2a():  # with a long GEMM queued ahead on the current stream (a deep GPU queue)
        torch.mm(gemm_a, gemm_a)
        return a2a()

    results = {}
    for name, fn in (
        ("all_to_all_single", a2a),
        ("alltoall_base", base),
        ("coalesced x2", coalesced),
        ("batch_isend_irecv", p2p),
        ("a2a, 40 frames deep", lambda: deep(40, a2a)),
        ("30 kernels", kernels),
        ("30 kernels + a2a", kernels_a2a),
        ("fresh buffers", fresh),
        ("fresh, uneven splits", fresh_split),
        ("GEMM queued + a2a", busy_a2a),
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
    # Host time of one small kernel launch while a long all-to-all runs on the GPU, against the GPU idle.
    big_in = torch.randn(args.rows * P * 8, 1536, device=device).to(torch.bfloat16)  # ~8x longer transfer
    big_out, big_splits = torch.empty_like(big_in), [args.rows * 8] * P
    for label, in_flight in (("kernel launch, GPU idle", False), ("kernel launch, a2a in flight", True)):
        reps = []
        for _ in range(5):
            torch.cuda.synchronize()
            dist.barrier()
            work = None
            if in_flight:
                work = dist.all_to_all_single(big_out, big_in, big_splits, big_splits, group=group, async_op=True)
                time.sleep(0.0003)  # the transfer has started
            t0 = time.perf_counter()
            kernels()
            reps.append((time.perf_counter() - t0) / 30 * 1e6)
            if work is not None:
                work.wait()
            torch.cuda.synchronize()
        t = torch.tensor([statistics.median(reps)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        results[label] = t.item()
    fr = "unknown"
    try:  # is the flight recorder on (it records every collective, with its Python stack)?
        import pickle

        fr = f"{len(pickle.loads(torch._C._distributed_c10d._dump_nccl_trace()).get('entries', []))} entries"
    except Exception as exc:
        fr = f"unknown ({type(exc).__name__})"
    if rank == 0:
        env = {k: os.environ.get(k) for k in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")}
        print(f"flight recorder: {fr}; env {env}")
        print(f"host us per launch (max over {P} ranks, {args.rows} rows of 1536 bf16 per peer):")
        for k, v in results.items():
            print(f"  {k:20s} {v:8.1f}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
