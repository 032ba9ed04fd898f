#!/usr/bin/env python3
"""Copy-engine all-to-all probe: can the GPUs' copy engines move an EP all-to-all's bytes as fast as NCCL's
kernels, and without slowing a GEMM that runs at the same time? (NCCL's all-to-all runs as a kernel on SMs, so
a persistent GEMM and the all-to-all compete for SMs: ``comm_sms``.) One process drives every visible GPU:

    python3 scripts/gpu_ce_probe.py --json $OUT/ce_probe.json

For each size (MiB per (source, destination) pair): every GPU i copies one buffer to every other GPU j with
``dst.copy_(src)`` (cudaMemcpyAsync peer copy: a copy engine, no SM), each copy on its own stream pair, all at
once. Reported: the all-to-all's time and its outbound GB/s per GPU; then a bf16 GEMM loop on every GPU's
default stream alone, the all-to-all loop alone, and both together (GEMM slowdown, copy slowdown). The
default size, 46 MiB, is the dedup dispatch's bytes per peer at per-rank (T, d, E, K) = (16384, 1536, 128, 8)
on 4 ranks (``bench dispatch``: 8448 B per token, 3/4 of them remote). This is a measurement for a design
decision, not a transport: the plugin's all-to-alls are NCCL's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _sync_all(P: int) -> None:
    for d in range(P):
        torch.cuda.synchronize(d)


class CopyAllToAll:
    """Every GPU pushes one buffer of ``nbytes`` to every other GPU, each copy on its own streams."""

    def __init__(self, P: int, nbytes: int) -> None:
        n = nbytes // 2
        self.P, self.nbytes = P, n * 2
        self.pairs = [(i, j) for i in range(P) for j in range(P) if i != j]
        g = torch.Generator(device="cpu").manual_seed(0)
        self.src = {p: torch.randn(n, generator=g).to(torch.bfloat16).to(f"cuda:{p[0]}") for p in self.pairs}
        self.dst = {p: torch.empty(n, dtype=torch.bfloat16, device=f"cuda:{p[1]}") for p in self.pairs}
        # torch runs a peer copy on the source device's current stream with a two-way barrier against the
        # destination device's current stream: both are side streams here, so the default streams (the GEMMs)
        # are not waited for.
        self.s_src = {p: torch.cuda.Stream(device=p[0]) for p in self.pairs}
        self.s_dst = {p: torch.cuda.Stream(device=p[1]) for p in self.pairs}

    def launch(self) -> None:
        for p in self.pairs:
            with torch.cuda.stream(self.s_dst[p]), torch.cuda.stream(self.s_src[p]):
                self.dst[p].copy_(self.src[p], non_blocking=True)

    def check(self) -> bool:
        _sync_all(self.P)
        return all(torch.equal(self.dst[p].cpu(), self.src[p].cpu()) for p in self.pairs[:3])

    def time_ms(self, iters: int) -> tuple[float, float]:
        """(median all-to-all ms, median host ms to launch its copies)."""
        ts, hs = [], []
        for _ in range(iters):
            _sync_all(self.P)
            t0 = time.perf_counter()
            self.launch()
            t1 = time.perf_counter()
            _sync_all(self.P)
            ts.append((time.perf_counter() - t0) * 1e3)
            hs.append((t1 - t0) * 1e3)
        return statistics.median(ts), statistics.median(hs)


def _gemm_loop(P: int, mats: list, reps: int) -> list:
    ends = []
    for d in range(P):
        a, b = mats[d]
        with torch.cuda.device(d):
            for _ in range(reps):
                torch.mm(a, b)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            ends.append(ev)
    return ends


def overlap_probe(P: int, a2a: CopyAllToAll, gemm_n: int, gemm_reps: int, copy_reps: int) -> dict:
    mats = []
    for d in range(P):
        g = torch.Generator(device="cpu").manual_seed(d)
        a = torch.randn(gemm_n, gemm_n, generator=g).to(torch.bfloat16).to(f"cuda:{d}")
        mats.append((a, a.t().contiguous()))
    _gemm_loop(P, mats, 2)
    _sync_all(P)

    def run(gemm: bool, copies: bool) -> tuple[float, float]:
        _sync_all(P)
        t0 = time.perf_counter()
        if gemm:
            _gemm_loop(P, mats, gemm_reps)
        tg = time.perf_counter()
        if copies:
            for _ in range(copy_reps):
                a2a.launch()
        # the GEMMs end when every default stream is done; the copies when every side stream is
        for d in range(P):
            torch.cuda.default_stream(d).synchronize()
        t_gemm = time.perf_counter() - t0 if gemm else 0.0
        _sync_all(P)
        return t_gemm * 1e3, (time.perf_counter() - (tg if gemm else t0)) * 1e3

    gemm_alone = statistics.median(run(True, False)[0] for _ in range(3))
    copy_alone = statistics.median(run(False, True)[1] for _ in range(3))
    both = [run(True, True) for _ in range(3)]
    gemm_both = statistics.median(b[0] for b in both)
    flops = 2 * gemm_n**3 * gemm_reps
    return {
        "gemm_n": gemm_n,
        "gemm_reps": gemm_reps,
        "copy_reps": copy_reps,
        "gemm_alone_ms": round(gemm_alone, 3),
        "gemm_tflops_alone": round(flops / gemm_alone / 1e9, 1),
        "copies_alone_ms": round(copy_alone, 3),
        "gemm_with_copies_ms": round(gemm_both, 3),
        "gemm_slowdown": round(gemm_both / gemm_alone, 3),
        "note": "copies are issued after the GEMMs are queued; the GEMM loop is timed until every default stream ends",
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", default="4,16,46,128", help="MiB per (source, destination) pair, comma-separated")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--overlap-mib", type=float, default=46.0, help="pair size for the GEMM overlap probe")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    P = torch.cuda.device_count()
    if P < 2:
        print(f"gpu_ce_probe: needs >= 2 GPUs, found {P}")
        return 1
    out: dict = {"gpus": P, "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "sizes": []}
    peer = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(P)] for i in range(P)]
    out["peer_access"] = all(all(r) for r in peer)
    print(f"gpu_ce_probe: {P} x {out['device']}, peer access {out['peer_access']}", flush=True)
    print(f"{'MiB/pair':>9} {'a2a ms':>8} {'GB/s/GPU':>9} {'host ms':>8} {'equal':>6}", flush=True)
    for mib in (float(m) for m in args.mib.split(",")):
        a2a = CopyAllToAll(P, int(mib * 2**20))
        a2a.launch()
        ok = a2a.check()
        t, h = a2a.time_ms(args.iters)
        gbps = (P - 1) * a2a.nbytes / t / 1e6
        out["sizes"].append(
            {
                "mib_per_pair": mib,
                "a2a_ms": round(t, 3),
                "gbps_per_gpu": round(gbps, 1),
                "host_ms": round(h, 3),
                "equal": ok,
            }
        )
        print(f"{mib:9.0f} {t:8.3f} {gbps:9.1f} {h:8.3f} {str(ok):>6}", flush=True)
        del a2a
    a2a = CopyAllToAll(P, int(args.overlap_mib * 2**20))
    t, _ = a2a.time_ms(5)
    ov = overlap_probe(P, a2a, 8192, 8, max(1, int(8 * 1.4 / max(t, 1e-3))))
    out["overlap"] = ov
    print(json.dumps(ov, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
