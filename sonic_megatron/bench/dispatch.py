"""``bench dispatch``: bytes on the wire and all-to-all bandwidth of the dedup dispatch/combine, against
Megatron's MoEAlltoAllTokenDispatcher for the same routing.

Launch one process per GPU (or per CPU rank with ``--device cpu``, gloo)::

    torchrun --nproc_per_node 4 -m sonic_megatron bench dispatch --tokens 16384 --hidden 1536 --experts 128 --topk 8

Megatron's bytes follow its algorithm (``token_dispatcher.py``): permute-1 makes one row per (token, expert)
pair, and the EP all-to-all sends each row (D x element size) and its prob (fp32) to the expert's rank;
combine sends every pair row back. Ours sends a token once per destination rank (D x element size) plus,
per pair, an fp32 score and int32 (row, local expert) metadata, and combine returns one row per (token,
rank). Only rows that leave the rank count as wire bytes (a rank's rows to itself are a local copy).
The measured part times each scheme's token all-to-all with the split sizes the algorithm produces (ours:
dedup rows; Megatron's: one row per pair) on the same ``all_to_all_single``; GB/s = outbound wire bytes
of this rank / time ("a2a GB/s per GPU"). It needs two or more processes: one rank sends nothing over the
wire, so a single-process run is refused instead of reporting zeros.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from .common import print_table, write_json

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``bench dispatch`` and ``bench layer``."""
    parser.add_argument("--tokens", type=int, default=16384, help="T: tokens per rank (default 16384)")
    parser.add_argument("--hidden", type=int, default=1536, help="d: hidden size (default 1536)")
    parser.add_argument("--ffn", type=int, default=256, help="n: expert ffn size (default 256)")
    parser.add_argument("--experts", type=int, default=128, help="E: global experts (default 128)")
    parser.add_argument("--topk", type=int, default=8, help="K: experts per token (default 8)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="activation dtype (default bf16)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations (default 3)")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations, median reported (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="routing seed (default 0)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)


def setup_distributed(args) -> tuple[torch.device, object]:
    """Init the default group from torchrun's environment (NCCL on GPUs, gloo on CPUs); (device, group)."""
    use_cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python -m`: one rank
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
    return device, dist.group.WORLD


def random_routing(args, device, rank: int):
    """This rank's top-K routing from random logits (softmax probs): (x, probs_TE, scores_TK, indices_TK)."""
    g = torch.Generator(device="cpu").manual_seed(args.seed * 1000 + rank)
    logits = torch.randn(args.tokens, args.experts, generator=g).to(device)
    probs = logits.softmax(-1)
    scores, indices = probs.topk(args.topk, dim=-1)
    x = torch.randn(args.tokens, args.hidden, generator=g).to(device=device, dtype=DTYPES[args.dtype])
    return x, probs, scores, indices


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, warmup: int, iters: int) -> float:
    """Median seconds of ``fn`` over ``iters`` runs (each after a barrier), max over ranks."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def launched_world_size() -> int:
    """Processes of this run: the initialised default group's, else torchrun's WORLD_SIZE (1 without it)."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def run(args) -> int:
    world = launched_world_size()
    if world < 2:
        print(
            f"bench dispatch: needs torchrun with >= 2 processes (got {world}): it measures the traffic between "
            "expert-parallel ranks, and one rank sends nothing. Launch it as\n"
            "    torchrun --nproc-per-node 2 -m sonic_megatron bench dispatch ...   (add --device cpu without GPUs)",
            file=sys.stderr,
        )
        return 2
    from ..token_dispatch import make_plan
    from ..token_dispatch.engine import all_rows  # the dispatch all-to-all of all chunks

    device, group = setup_distributed(args)
    rank, P = dist.get_rank(), dist.get_world_size()
    x, _, scores, indices = random_routing(args, device, rank)
    from ..kernels import TopKRouting

    routing = TopKRouting(scores, indices)
    el, T, D, E, K = x.element_size(), args.tokens, args.hidden, args.experts, args.topk
    t_plan = timed(lambda: make_plan(routing, num_experts=E, group=group, x_TD=x), device, args.warmup, args.iters)
    plan = make_plan(routing, num_experts=E, group=group, x_TD=x)
    rows_remote, pairs_remote = plan.wire_rows()
    L = E // P
    dest = torch.div(indices, L, rounding_mode="floor")
    mg_pairs_remote = int((dest != rank).sum())
    ours_disp = rows_remote * D * el + pairs_remote * (4 + 8)
    ours_comb = rows_remote * D * el
    mg_disp = mg_pairs_remote * (D * el + 4)
    mg_comb = mg_pairs_remote * D * el

    # Timed token all-to-alls: ours (dedup rows) and Megatron's split sizes (one row per pair).
    x_send = x.index_select(0, plan.send_token_idx_S)
    t_ours = timed(lambda: all_rows(plan, x_send), device, args.warmup, args.iters)
    send_counts = torch.bincount(dest.reshape(-1), minlength=P)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    in_splits, out_splits = send_counts.tolist(), recv_counts.tolist()
    pair_rows = x.new_empty(T * K, D).normal_()
    pair_out = x.new_empty(sum(out_splits), D)

    def megatron_a2a():
        dist.all_to_all_single(pair_out, pair_rows, out_splits, in_splits, group=group)

    t_mg = timed(megatron_a2a, device, args.warmup, args.iters)

    per_rank = torch.tensor(
        [ours_disp, ours_comb, mg_disp, mg_comb, rows_remote, pairs_remote, mg_pairs_remote],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(per_rank)
    tot = per_rank.tolist()
    gbps = torch.tensor([ours_disp / t_ours / 1e9, mg_disp / t_mg / 1e9], dtype=torch.float64, device=device)
    dist.all_reduce(gbps)  # mean over ranks below
    gb = (gbps / P).tolist()
    rows = [
        dict(
            scheme="ours (dedup)",
            dispatch_B_per_tok=tot[0] / (P * T),
            combine_B_per_tok=tot[1] / (P * T),
            remote_rows_per_tok=tot[4] / (P * T),
            a2a_ms=t_ours * 1e3,
            a2a_GBps_per_gpu=gb[0],
        ),
        dict(
            scheme="megatron alltoall",
            dispatch_B_per_tok=tot[2] / (P * T),
            combine_B_per_tok=tot[3] / (P * T),
            remote_rows_per_tok=tot[6] / (P * T),
            a2a_ms=t_mg * 1e3,
            a2a_GBps_per_gpu=gb[1],
        ),
    ]
    ratio = (tot[0] + tot[1]) / max(tot[2] + tot[3], 1)
    if rank == 0:
        print(
            f"bench dispatch: P={P} T={T} d={D} E={E} K={K} {args.dtype} on {device.type}; plan {t_plan * 1e3:.2f} ms"
        )
        print_table(rows, list(rows[0]))
        print(f"bytes ours / megatron (dispatch + combine): {ratio:.3f}")
        write_json(
            args.json,
            {
                "benchmark": "dispatch",
                "config": dict(P=P, T=T, d=D, E=E, K=K, dtype=args.dtype, device=device.type),
                "rows": rows,
                "bytes_ratio_ours_over_megatron": ratio,
                "plan_ms": t_plan * 1e3,
            },
        )
    dist.barrier()
    dist.destroy_process_group()
    return 0
