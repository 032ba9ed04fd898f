"""Ours vs sonic-moe under `bench experts`' own timing harness, with what the GPU did meanwhile: per-call times,
energy per call (NVML), SM clock and power-cap share, and the kernel table of the same loop. For the question
"same kernels in a profile, different do_bench medians": is it the harness, the clock, or a kernel?

    source .devbundle/setup.sh
    python3 scripts/gpu_experts_harness.py --config 32768,2048,1024,64,8 --rounds 4 --out $OUT

Each round times every provider (order alternating between rounds) in two loops of ``--rep`` ms each, the way
`triton.testing.do_bench` (triton 3.6) times a call: per iteration an L2 flush (zeroing 256 MB), a start event, the
call, an end event, no host sync inside the loop. Loops: ``flush`` (exactly do_bench) and ``noflush`` (the same
without the L2 flush); round 0 also runs ``--profile-calls`` iterations of ``flush`` under torch.profiler (per-kernel
device time per call). NVML's energy counter updates coarsely: over a 300 ms loop its J/call can imply a mean power
above the cap (seen on the H100), so read the clock and the cap share, not the energy.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import threading
import time

import torch
from torch.profiler import ProfilerActivity, profile

from sonic_megatron.bench import experts as B

NVML_CLOCK_SM = 1
SW_POWER_CAP = 0x4


class Nvml:
    """The few NVML calls we need, through ctypes (no pynvml on the device image)."""

    def __init__(self, index: int = 0) -> None:
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self.lib.nvmlInit_v2()
        self.handle = ctypes.c_void_p()
        self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle))

    def energy_mj(self) -> int:
        v = ctypes.c_ulonglong()
        self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(v))
        return v.value

    def sm_mhz(self) -> int:
        v = ctypes.c_uint()
        self.lib.nvmlDeviceGetClockInfo(self.handle, NVML_CLOCK_SM, ctypes.byref(v))
        return v.value

    def power_w(self) -> float:
        v = ctypes.c_uint()
        self.lib.nvmlDeviceGetPowerUsage(self.handle, ctypes.byref(v))
        return v.value / 1000

    def reasons(self) -> int:
        v = ctypes.c_ulonglong()
        self.lib.nvmlDeviceGetCurrentClocksThrottleReasons(self.handle, ctypes.byref(v))
        return v.value


class Sampler:
    """Samples SM clock, power and the power-cap throttle flag every ``period`` s on a thread."""

    def __init__(self, nvml: Nvml, period: float = 0.005) -> None:
        self.nvml, self.period, self.rows, self._stop = nvml, period, [], threading.Event()

    def __enter__(self):
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.rows.append((self.nvml.sm_mhz(), self.nvml.power_w(), bool(self.nvml.reasons() & SW_POWER_CAP)))
            time.sleep(self.period)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()

    def summary(self) -> dict:
        if not self.rows:
            return {}
        return {
            "sm_mhz_mean": statistics.mean(r[0] for r in self.rows),
            "power_w_mean": statistics.mean(r[1] for r in self.rows),
            "power_cap_share": sum(r[2] for r in self.rows) / len(self.rows),
            "samples": len(self.rows),
        }


def harness_loop(fn, rep_ms: float, flush: bool, nvml: Nvml, cache: torch.Tensor) -> dict:
    """do_bench's measuring loop (after its estimate and warm-up), with energy and clock samples."""
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(3):
        cache.zero_()
        fn()
    b.record()
    torch.cuda.synchronize()
    est = a.elapsed_time(b) / 3
    n = max(1, int(rep_ms / est))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    e0 = nvml.energy_mj()
    t0 = time.perf_counter()
    with Sampler(nvml) as s:
        for i in range(n):
            if flush:
                cache.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    e1 = nvml.energy_mj()
    times = [x.elapsed_time(y) for x, y in zip(starts, ends, strict=True)]
    return {
        "n": n,
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "max_ms": max(times),
        "wall_ms_per_call": wall * 1e3 / n,
        "energy_J_per_call": (e1 - e0) / 1e3 / n,
        **s.summary(),
    }


def profiled_loop(fn, calls: int, cache: torch.Tensor) -> dict:
    """Kernel table (device ms per call) of ``calls`` iterations of the flush loop."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            cache.zero_()
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0:
            rows.append((e.key[:90], e.count / calls, e.self_device_time_total / calls / 1000))
    rows.sort(key=lambda r: -r[2])
    return {"total_ms": sum(r[2] for r in rows), "kernels": rows[:16]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="32768,2048,1024,64,8")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--rep", type=float, default=300.0, help="ms per timed loop (bench experts' default)")
    ap.add_argument("--profile-calls", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    T, d, n, E, K = B._parse(args.config)
    import sonic_megatron.kernels.cute  # noqa: F401

    nvml = Nvml(torch.cuda.current_device())
    provs = B._make_providers(["ours", "sonic"], T, d, n, E, K, 0)
    calls = {}
    for name, val in provs.items():
        if isinstance(val, Exception):
            print(f"{name}: {val!r}")
            continue
        _, fwd_bwd, first_s, _ = B._prepare(*val)  # exactly what bench experts times
        calls[name] = fwd_bwd
        print(f"{name}: first call {first_s:.1f} s", flush=True)
    cache = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")  # do_bench's L2 flush buffer
    names = list(calls)
    rounds = []
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        row = {"order": order}
        for name in order:
            for _ in range(3):
                calls[name]()
            row[name] = {
                loop: harness_loop(calls[name], args.rep, loop == "flush", nvml, cache) for loop in ("flush", "noflush")
            }
            if r == 0:
                row[name]["profiled"] = profiled_loop(calls[name], args.profile_calls, cache)
            f = row[name]["flush"]
            print(
                f"round {r} {name:6s} flush {f['median_ms']:.3f} ms (min {f['min_ms']:.3f}) "
                f"{f['energy_J_per_call']:.2f} J/call {f.get('sm_mhz_mean', 0):.0f} MHz "
                f"{f.get('power_w_mean', 0):.0f} W "
                f"cap {f.get('power_cap_share', 0):.2f} | noflush {row[name]['noflush']['median_ms']:.3f} ms",
                flush=True,
            )
        rounds.append(row)
    for name in names:
        prof = rounds[0][name]["profiled"]
        print(f"\n== {name}: kernel total {prof['total_ms']:.3f} ms per call under the flush loop")
        for k, c, ms in prof["kernels"]:
            print(f"  {ms:8.3f} ms  x{c:<5.1f} {k}")
    if len(names) == 2:
        a, b = names
        for loop in ("flush", "noflush"):
            ratios = [rw[b][loop]["median_ms"] / rw[a][loop]["median_ms"] for rw in rounds]
            print(f"{loop}: {b} time / {a} time per round: {[round(x, 3) for x in ratios]}")
    with open(os.path.join(args.out, f"experts-harness-{args.config.replace(',', '_')}.json"), "w") as f:
        json.dump({"config": args.config, "rep_ms": args.rep, "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    main()
