#!/usr/bin/env python3
"""The expert-parallel GPU pass on one host with 4 GPUs: NCCL equivalence checks at EP=2 and 4, then
``bench dispatch`` (EP=4) and ``bench layer`` (EP=4, EP=2, and EP=4 at 4x the tokens) at per-rank
(T,d,n,E,K) = (16384,1536,256,128,8).

    python scripts/gpu_ep.py            # logs + JSON under $OUT (default ./out)

Each step runs as its own torchrun with a time limit; a failing or timed-out step is reported in
$OUT/gpu_ep_summary.json and the next step still runs. The whole pass stays under TOTAL_S (default 470 s).
Env: OUT, TOTAL_S, CACHE (QuACK/Triton compile caches, as scripts/gpu_experts.sh), EP_BACKEND (default auto),
EP_CHUNKS (bench layer chunk counts at EP 4, default 1), EP_COMM_SMS (default 0,32), EP_BIG_TOKENS (the GPU-bound
size at EP 4, default 65536; empty: skip), EP_BIG_CHUNKS (its chunk counts, default 1,4), EP_LAYER_EP2=0 (skip
bench layer at EP 2), EP_CHUNKS_EP2 (its chunk counts, default 1), EP_LAYER_EXTRA (more bench layer arguments,
default "--iters 40").
EP_CHECK_CPU=1 runs the pass on CPU/gloo at tiny sizes with the torch backend (to test this script:
``EP_CHECK_CPU=1 EP_BIG_TOKENS= python scripts/gpu_ep.py``).

Checks (``python scripts/gpu_ep.py check`` under torchrun, run by the steps above), per rank, bf16 experts and
fp32 router probs, for random top-K, skewed (every token to experts 0..K-1 of rank 0: the other ranks receive
nothing), a rank without tokens, and flat routing:
  * EP output and every gradient (x, router logits, w1, w2) vs the float64 reference on the concatenated
    tokens: RMS and max error at most 2x PyTorch's bf16 error (+ eps/4, eps of the largest value);
  * EP == the single-process kernels (same backend) on the concatenation, reported (max relative diff);
  * num_chunks=2 + redispatch + deferred wgrad, comm_sms (+ chunks 2, deferred wgrad), and the step-wise path
    with the token rows and pairs in slots before the plan's sync (token_dispatch/slots.py) within the same
    criterion; repeated runs bitwise equal;
  * token rounding (nearest, tile 128): every local expert's received count a multiple of 128, and the
    decision (pairs and scores) bitwise equal to single-process rounding of the concatenation.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = ["--tokens", "16384", "--hidden", "1536", "--ffn", "256", "--experts", "128", "--topk", "8"]


# ---------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------


def _step(name: str, cmd: list[str], limit: float, out: str, summary: dict) -> None:
    log = os.path.join(out, f"{name}.log")
    print(f"=== {name} (limit {limit:.0f} s): {' '.join(cmd)}", flush=True)
    t0 = time.time()
    status = "ok"
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=limit, cwd=ROOT).returncode
            status = "ok" if rc == 0 else f"failed (rc {rc})"
        except subprocess.TimeoutExpired:
            status = f"timed out after {limit:.0f} s"
        except Exception as exc:  # keep going with the next step
            status = f"could not run: {exc}"
    summary[name] = {"status": status, "seconds": round(time.time() - t0, 1), "log": log}
    with open(log) as f:
        tail = f.read()[-3000:]
    print(tail, flush=True)
    print(f"--- {name}: {status} in {time.time() - t0:.0f} s", flush=True)


def drive() -> int:
    out = os.environ.get("OUT", os.path.join(ROOT, "out"))
    os.makedirs(out, exist_ok=True)
    cache = os.environ.get("CACHE", os.path.join(ROOT, ".cutecache"))
    os.environ.setdefault("QUACK_CACHE_DIR", os.path.join(cache, "quack"))
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(cache, "triton"))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    total = float(os.environ.get("TOTAL_S", 470))
    t0 = time.time()
    summary: dict = {}
    try:
        env = subprocess.run(
            [sys.executable, "-m", "sonic_megatron", "env"], capture_output=True, text=True, timeout=60, cwd=ROOT
        )
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        text = env.stdout + env.stderr + smi.stdout
    except Exception as exc:
        text = f"env failed: {exc}"
    print(text, flush=True)
    with open(os.path.join(out, "env.log"), "w") as f:
        f.write(text)

    def torchrun(P: int, *args: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(P), *args]

    bench = ["-m", "sonic_megatron", "bench"]
    backend = os.environ.get("EP_BACKEND", "auto")
    config = CONFIG
    if os.environ.get("EP_CHECK_CPU") == "1":  # smoke test of the driver on a CPU machine
        config = ["--tokens", "256", "--hidden", "64", "--ffn", "32", "--experts", "8", "--topk", "2"]
        config += ["--device", "cpu"]
        backend = "torch"
    chunks = os.environ.get("EP_CHUNKS", "1")  # bench layer chunk counts
    comm_sms = os.environ.get("EP_COMM_SMS", "0,32")
    big = os.environ.get("EP_BIG_TOKENS", "65536")  # a GPU-bound size as well ("" = skip)
    big_chunks = os.environ.get("EP_BIG_CHUNKS", "1,4")
    ep2_chunks = os.environ.get("EP_CHUNKS_EP2", "1")
    layer = [*bench, "layer", "--backend", backend, "--comm-sms", comm_sms]
    layer += os.environ.get("EP_LAYER_EXTRA", "--iters 40").split()
    layer_ep4 = [*layer, *config, "--chunks", chunks, "--json", f"{out}/layer_ep4.json"]
    steps = [
        ("check_ep2", torchrun(2, __file__, "check", "--out", out), 110),
        ("check_ep4", torchrun(4, __file__, "check", "--out", out), 110),
        ("bench_dispatch_ep4", torchrun(4, *bench, "dispatch", *config, "--json", f"{out}/dispatch_ep4.json"), 60),
        ("bench_layer_ep4", torchrun(4, *layer_ep4), 150),
    ]
    if os.environ.get("EP_LAYER_EP2", "1") == "1":
        steps.append(
            (
                "bench_layer_ep2",
                torchrun(2, *layer, *config, "--chunks", ep2_chunks, "--json", f"{out}/layer_ep2.json"),
                90,
            )
        )
    if big:
        big_config = [big if v == CONFIG[1] else v for v in config]
        steps.append(
            (
                f"bench_layer_ep4_T{big}",
                torchrun(4, *layer, *big_config, "--chunks", big_chunks, "--no-baseline", "--json", f"{out}/big.json"),
                180,
            )
        )
    for name, cmd, limit in steps:
        left = total - (time.time() - t0)
        if left < 20:
            summary[name] = {"status": "skipped (time budget spent)"}
            continue
        _step(name, cmd, min(limit, left - 5), out, summary)
    summary["total_seconds"] = round(time.time() - t0, 1)
    with open(os.path.join(out, "gpu_ep_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2), flush=True)
    return 0 if all(v.get("status") == "ok" for k, v in summary.items() if isinstance(v, dict)) else 1


# ---------------------------------------------------------------------------------------------------------
# Worker: equivalence checks under torchrun (NCCL)
# ---------------------------------------------------------------------------------------------------------


def _criterion(got, torch_low, ref64, eps):
    """None if ``got`` is as accurate as PyTorch in low precision (RMS and max), else a message."""
    if ref64.numel() == 0:
        return None
    g, t, r = got.double(), torch_low.double(), ref64.double()
    scale = r.abs().max().item()
    rms, rms_t = (g - r).pow(2).mean().sqrt().item(), (t - r).pow(2).mean().sqrt().item()
    mx, mx_t = (g - r).abs().max().item(), (t - r).abs().max().item()
    if math.isnan(rms) or rms > 2 * rms_t + eps / 4 * scale:
        return f"RMS {rms:.3g} > 2 x torch {rms_t:.3g} + {eps / 4 * scale:.3g}"
    if mx > 2 * mx_t + eps * scale:
        return f"max {mx:.3g} > 2 x torch {mx_t:.3g} + {eps * scale:.3g}"
    return None


def check(out: str) -> int:
    import torch
    import torch.distributed as dist
    from sonic_megatron.kernels import FlatRouting, TopKRouting, moe_experts, moe_experts_reference
    from sonic_megatron.kernels.interface import cute_unavailable_reason
    from sonic_megatron.token_dispatch import (
        DeferredWeightGrad,
        Slots,
        TokenRounding,
        combine_slots,
        dispatch_before_sync,
        expert_parallel_experts,
        local_experts_before_sync,
        round_routing,
        start_plan,
    )

    local = int(os.environ["LOCAL_RANK"])
    on_cpu = os.environ.get("EP_CHECK_CPU") == "1"  # plumbing test of this script on a CPU machine (gloo)
    if on_cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    rank, P = dist.get_rank(), dist.get_world_size()
    env_backend = os.environ.get("EP_BACKEND", "auto")
    backend = env_backend if env_backend != "auto" else ("cute" if cute_unavailable_reason(device) is None else "torch")
    # GPU: the hidden and ffn sizes of the benchmark, so the cute kernels compile once for the whole pass.
    T0, D, Fn, E, K = (64, 32, 16, 8, 2) if on_cpu else (1024, 1536, 256, 32, 4)
    tile = 16 if on_cpu else 128
    L = E // P
    bf16, eps = torch.bfloat16, torch.finfo(torch.bfloat16).eps
    report: dict = {"P": P, "backend": backend, "cases": {}}

    def global_inputs(kind, seed):
        g = torch.Generator().manual_seed(seed)
        T_r = [T0] * P
        if kind == "empty_rank":
            T_r[1] = 0
        T = sum(T_r)
        logits = torch.randn(T, E, generator=g)
        if kind == "empty_rank":
            logits[:, E - L :] = -30  # the last rank's experts: nobody routes there
        x = torch.randn(T, D, generator=g)
        w1 = torch.randn(E, 2 * Fn, D, generator=g) / D**0.5
        w2 = torch.randn(E, D, Fn, generator=g) / Fn**0.5
        grad = torch.randn(T, D, generator=g)
        mask = torch.rand(T, E, generator=g) < 3 / E if kind == "flat" else None
        return dict(T_r=T_r, logits=logits, x=x, w1=w1, w2=w2, grad=grad, mask=mask, kind=kind)

    def routing_of(c, logits, off, T):
        probs = logits.softmax(-1)
        if c["kind"] == "flat":
            tok, exp = c["mask"][off : off + T].to(device).nonzero(as_tuple=True)
            return FlatRouting(tok, exp, probs[tok, exp], T), probs
        if c["kind"] == "skewed":
            idx = torch.arange(K, device=device).expand(T, K).contiguous()
        else:
            idx = probs.detach().topk(K, dim=-1).indices
        return TopKRouting(probs.gather(1, idx), idx), probs

    def leaves(c, dtype, off, T, el):
        mk = lambda t: t.to(device=device, dtype=dtype).clone().requires_grad_()  # noqa: E731
        return (
            mk(c["x"][off : off + T]),
            c["logits"][off : off + T].to(device).clone().requires_grad_(),
            mk(c["w1"][el]),
            mk(c["w2"][el]),
        )

    def run_ep(c, **opts):
        off, T = sum(c["T_r"][:rank]), c["T_r"][rank]
        x, logits, w1, w2 = leaves(c, bf16, off, T, slice(rank * L, (rank + 1) * L))
        routing, probs = routing_of(c, logits, off, T)
        wgrad = DeferredWeightGrad() if opts.pop("deferred", False) else None
        if opts.pop("rounding", False):
            opts.update(rounding=TokenRounding("nearest", tile), rounding_scores_TE=probs)
        early = None
        if opts.pop("slots", False):  # the step-wise path in slots, its forward without the plan's host sync
            slots = Slots.for_layer(max(c["T_r"]) + 3, L, None if c["kind"] == "flat" else K)
            started = start_plan(
                routing, num_experts=E, group=dist.group.WORLD, x_TD=x, w1_EGD=w1, w2_EDF=w2, slots=slots
            )
            xr, ss, early = dispatch_before_sync(x, started.scores_R, started)
            y = local_experts_before_sync(xr, ss, w1, w2, early, backend=backend, wgrad=wgrad)
            o = combine_slots(y, early)
        else:
            o, plan = expert_parallel_experts(
                x,
                routing,
                w1,
                w2,
                group=dist.group.WORLD,
                num_experts=E,
                backend=backend,
                wgrad=wgrad,
                return_plan=True,
                **opts,
            )
        o.backward(c["grad"][off : off + T].to(device, bf16))
        if early is not None:  # the plan, made in backward
            plan = early.plan
            assert (plan.row_slots, plan.pair_slots) == (slots.rows, slots.pairs)
        if wgrad is not None:
            wgrad.compute()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return [t.detach() for t in (o, x.grad, logits.grad, w1.grad, w2.grad)], plan

    def run_single(c, dtype, impl, routing_override=None):
        T = sum(c["T_r"])
        x, logits, w1, w2 = leaves(c, dtype, 0, T, slice(None))
        routing, _ = routing_of(c, logits, 0, T)
        if routing_override is not None:
            routing = routing_override(logits)
        o = impl(x, routing, w1, w2)
        o.backward(c["grad"].to(device, dtype))
        off, Tr = sum(c["T_r"][:rank]), c["T_r"][rank]
        sl, el = slice(off, off + Tr), slice(rank * L, (rank + 1) * L)
        return [o.detach()[sl], x.grad[sl], logits.grad[sl], w1.grad[el], w2.grad[el]]

    ref_impl = lambda x, r, w1, w2: moe_experts_reference(x, r, w1, w2)  # noqa: E731
    ours_impl = lambda x, r, w1, w2: moe_experts(x, r, w1, w2, backend=backend)  # noqa: E731
    names = ("out", "dx", "dlogits", "dw1", "dw2")
    failures = []
    variants = [
        ("random", {}),
        ("skewed", {}),
        ("empty_rank", {}),
        ("flat", {}),
        ("random", {"num_chunks": 2, "redispatch_x_in_backward": True, "deferred": True}),
        ("skewed", {"comm_sms": 16}),
        ("empty_rank", {"num_chunks": 2, "comm_sms": 32, "deferred": True}),
        ("random", {"slots": True}),
        ("skewed", {"slots": True, "deferred": True}),
        ("empty_rank", {"slots": True}),
        ("flat", {"slots": True}),
    ]
    for i, (kind, opts) in enumerate(variants):
        label = "+".join([kind] + [k if v is True else f"{k}{v}" for k, v in opts.items()])
        try:
            c = global_inputs(kind, 100 + i)
            got, _ = run_ep(c, **dict(opts))
            again, _ = run_ep(c, **dict(opts))
            ref64 = run_single(
                dict(
                    c,
                    x=c["x"].bfloat16().float(),
                    w1=c["w1"].bfloat16().float(),
                    w2=c["w2"].bfloat16().float(),
                    grad=c["grad"].bfloat16().float(),
                ),
                torch.float64,
                ref_impl,
            )
            low = run_single(c, bf16, ref_impl)
            single = run_single(c, bf16, ours_impl)
            entry = {"bitwise_repeat": all(torch.equal(a, b) for a, b in zip(got, again, strict=True))}
            for n, g, lo, r, s in zip(names, got, low, ref64, single, strict=True):
                msg = _criterion(g, lo.to(g.dtype), r, eps)
                rel = (
                    ((g.double() - s.double()).abs().max() / s.double().abs().max().clamp(min=1e-30)).item()
                    if s.numel()
                    else 0.0
                )
                entry[n] = {"ok": msg is None, "msg": msg, "rel_diff_vs_single_process": rel}
                if msg:
                    failures.append(f"rank {rank} {label} {n}: {msg}")
            if not entry["bitwise_repeat"]:
                failures.append(f"rank {rank} {label}: repeated runs differ")
            report["cases"][label] = entry
        except Exception as exc:
            failures.append(f"rank {rank} {label}: {type(exc).__name__}: {exc}")
        print(f"[rank {rank}] {label}: done", flush=True)
    # Token rounding (nearest, tile 128; 16 in the CPU plumbing test) under EP.
    try:
        c = global_inputs("random", 200)
        _, plan = run_ep(c, rounding=True)
        recv = sum(torch.diff(m.expert_offsets.long()) for m in plan.recv_meta)
        ok_tiles = bool((recv % tile == 0).all())
        off = sum(c["T_r"][:rank])
        mine = (torch.stack([plan.token_idx_R + off, plan.expert_idx_R]).cpu(), plan.scores_R.detach().cpu())
        gathered = [None] * P
        dist.all_gather_object(gathered, mine)
        ep_pairs = torch.cat([g[0] for g in gathered], dim=1)
        ep_scores = torch.cat([g[1] for g in gathered])
        logits = c["logits"].to(device)
        probs = logits.softmax(-1)
        s, i = probs.topk(K, dim=-1)
        T = logits.shape[0]
        ref = round_routing(
            torch.arange(T, device=device).repeat_interleave(K),
            i.reshape(-1),
            s.reshape(-1),
            probs,
            num_experts=E,
            rounding=TokenRounding("nearest", tile),
        )
        ref_pairs = torch.stack([ref.token_idx_R, ref.expert_idx_R]).cpu()
        same = torch.equal(ep_pairs, ref_pairs) and torch.equal(ep_scores, ref.scores_R.detach().cpu())
        report["rounding"] = {
            "tile": tile,
            "received_counts_multiple_of_tile": ok_tiles,
            "equals_single_process": same,
            "received_counts": recv.tolist(),
        }
        if not (ok_tiles and same):
            failures.append(f"rank {rank} rounding: tiles {ok_tiles}, equal to single process {same}")
    except Exception as exc:
        failures.append(f"rank {rank} rounding: {type(exc).__name__}: {exc}")
    report["failures"] = failures
    all_reports = [None] * P
    dist.all_gather_object(all_reports, report)
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, f"check_ep{P}.json")
        with open(path, "w") as f:
            json.dump(all_reports, f, indent=2)
        bad = [m for r in all_reports for m in r["failures"]]
        print(f"EP={P} backend={backend}: {'PASS' if not bad else 'FAIL'}; wrote {path}")
        for m in bad:
            print("  " + m)
    dist.destroy_process_group()
    return 0 if not failures else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "check":
        sys.exit(check(sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else "."))
    sys.exit(drive())
