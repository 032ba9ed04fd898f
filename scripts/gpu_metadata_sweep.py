"""Launch parameters of the routing-metadata kernels (kernels/triton/metadata.py) on the benchmark shapes: GPU time
of ``compute_metadata_triton``'s kernels (torch.profiler; ``call_us`` is do_bench's time per call, host-bound at these
sizes) per (TILE_BLOCK, SCAN_BLOCK_T, SCAN_BLOCK_E), results checked bitwise against the first combination. The
kernels' outputs do not depend on these parameters; only their speed does.

    source .devbundle/setup.sh; python3 scripts/gpu_metadata_sweep.py [--json $OUT/metadata-sweep.json]
"""

from __future__ import annotations

import argparse
import json

import torch
from gpu_experts_profile import kernel_table  # scripts/ is on sys.path when this runs as a script
from sonic_megatron.kernels.triton import metadata as M
from triton.testing import do_bench

SHAPES = ((24576, 128, 8), (32768, 64, 8), (32768, 128, 8), (65536, 32, 8))  # (T, E, K)
COMBOS = ((256, 64, 32), (128, 64, 32), (256, 256, 8), (128, 256, 8), (128, 128, 16), (64, 256, 8))


def kernel_us(fn, calls: int = 20) -> dict:
    """GPU time per call (us) of each metadata kernel (our Triton kernels' names start with "_"), and their sum."""
    out = {name: ms * 1e3 for name, _, ms in kernel_table(fn, calls, warmup=1) if name.startswith("_")}
    out["kernels_us"] = sum(out.values())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for T, E, K in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        idx = torch.argsort(torch.rand(T, E, device="cuda", generator=g), dim=1)[:, :K].int()
        tok = torch.arange(T, device="cuda", dtype=torch.int32).repeat_interleave(K)
        off = torch.arange(T + 1, device="cuda", dtype=torch.int32) * K
        ref = None
        for tb, st, se in COMBOS:
            M.TILE_BLOCK, M.SCAN_BLOCK_T, M.SCAN_BLOCK_E = tb, st, se

            def run(idx=idx, tok=tok, off=off, E=E):
                return M.compute_metadata_triton(tok, idx.reshape(-1), off, E)

            out = run()
            fields = (out.expert_offsets, out.x_gather_idx, out.s_scatter_idx, out.s_reverse_scatter_idx)
            same = ref is None or all(torch.equal(a, b) for a, b in zip(fields, ref, strict=True))
            ref = ref or fields
            ms = do_bench(run, warmup=25, rep=200, return_mode="median")  # host-bound at these sizes
            row = dict(T=T, E=E, K=K, tile_block=tb, scan_block_t=st, scan_block_e=se, call_us=ms * 1e3, same=same)
            rows.append({**row, **kernel_us(run)})
            print(rows[-1], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
