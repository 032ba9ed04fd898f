"""Tile configurations of the six grouped GEMMs on SM90 under the ``heuristic`` tuning (``kernels/options.py``).

``KernelOptions.tiles`` (``SONIC_MEGATRON_CUTE_TILES``) overrides single GEMMs; the ``autotune`` and ``default``
tunings use QuACK's own choice (``ops.py``).

Where the heuristic comes from: QuACK's autotuner timed every valid config of each GEMM on an H100 at
(T,d,n,E,K) = (24576,1536,256,128,8), (32768,2048,1024,64,8) and (32768,4096,1024,128,8); the tables are in
docs/perf/quack-tiles-h100-2026-11-21.txt. Per GEMM we take the config that is best (or within 2 %) on the
measured shapes, split by D or F where one config does not fit all; the comments give the evidence.
Gathered operands need cluster_n = 1 (QuACK's requirement with A_idx) and gated epilogues tile_n % 32 == 0.
"""

from __future__ import annotations

import dataclasses
import functools

from ..options import GEMMS, TileSpec
from .quack_adapter import GemmConfig


def _config(kind: str, tile_m: int, tile_n: int, cluster_m: int = 2, cluster_n: int = 1) -> GemmConfig:
    return GemmConfig(
        tile_m=tile_m,
        tile_n=tile_n,
        pingpong=kind == "P",
        cluster_m=cluster_m,
        cluster_n=cluster_n,
        is_dynamic_persistent=False,
    )


def _from_spec(spec: TileSpec) -> GemmConfig:
    return _config("P" if spec.pingpong else "C", spec.tile_m, spec.tile_n, spec.cluster_m, spec.cluster_n)


@functools.cache
def heuristic_config(
    gemm: str,
    F: int,
    D: int,
    tiles: tuple = (),
    dynamic: bool = False,
    main_grad: str | None = None,
    rows_multiple: int = 0,
) -> GemmConfig:
    """``_tile_config``, or the override of ``tiles`` (``KernelOptions.tiles``: ((gemm, TileSpec), ...)); memoized
    (called at every launch; the launch cache keys on the returned object's id). ``dynamic``: with QuACK's
    dynamic persistent tile scheduler (CTAs take tiles from an atomic counter). ``main_grad``: "add" / "store"
    for a weight GEMM writing a caller's accumulator (fp32 ``main_grad``: added to, or stored into at an
    iteration's first micro-batch). ``rows_multiple``: every expert's row count is a multiple of it (token
    rounding's tile; ``RoutingMetadata.rows_multiple``), 0 if unknown."""
    override = dict(tiles).get(gemm)
    config = _from_spec(override) if override is not None else _tile_config(gemm, F, D, main_grad, rows_multiple)
    return dataclasses.replace(config, is_dynamic_persistent=True) if dynamic else config


def _tile_config(gemm: str, F: int, D: int, main_grad: str | None = None, rows_multiple: int = 0) -> GemmConfig:
    """The tile config of GEMM ``gemm`` (one of GEMMS) at expert size F (n) and hidden size D (d).

    Each rule cites the measured cost relative to the best config at the three measured shapes
    (D, F) = (1536, 256), (2048, 1024), (4096, 1024) (docs/perf/quack-tiles-h100-2026-11-21.txt)."""
    if main_grad and gemm in ("dw1", "dw2"):
        # fp32 main_grads make the weight GEMMs store-bound (every expert's weights written per micro-batch, and
        # read too when adding: the epilogue loads the old values as the C operand). dW1 + dW2 ms on an H100 at
        # (T, D, E, K) = (8192, 2048, *, 8), same tile for both, F 768 E 128 / F 512 E 256 (bf16 outputs: 1.11 /
        # 1.05): add   P128x128 2.30 / 2.96, P128x192 2.34 / -, C128x256 2.37 / 2.72, C256x128 2.30 / 2.96;
        #        store P128x128 1.71 / 1.69, P128x192 1.51 / -, C128x256 1.51 / 1.47, C256x128 1.71 / 1.68.
        return _config("P", 128, 128) if main_grad == "add" and F >= 768 else _config("C", 128, 256)
    if gemm == "up":  # N = 2F, gathered X, SwiGLU epilogue: C128x256 best at all three
        return _config("C", 128, 256) if F >= 128 else _config("P", 128, 128)
    if gemm == "down":  # N = D, contiguous A': P128x192c21 1.014 / 1.000 / 1.108; C256x128c12 1.010 / 1.016 / 1.000
        return _config("C", 256, 128, 1, 2) if D >= 4096 else _config("P", 128, 192)
    if gemm == "dh":  # N = F, gathered dO, dSwiGLU epilogue: P128x128 1.000 / 1.036 / 1.127; C128x256 1.028 / 1 / 1
        return _config("C", 128, 256) if F >= 512 else _config("P", 128, 128)
    if gemm == "dx":  # N = D, contiguous dH (W1 via concat_layout): P192x128c12 1 / 1 / 1.172 in QuACK's autotuning;
        # at D = 4096 the autotuner's pick C256x128c12 is slower in ours (A/B, same run: fwd+bwd 536.8 vs 551.0 TF)
        if rows_multiple and rows_multiple % 128 == 0:
            # Row counts in multiples of 128 fill 128-row tiles (192-row ones waste a third of a tile per expert at
            # 512 rows): dx of the rounded layer at (T, D, F, E, K) = (16384, 2048, 512, 256, 8), H100 (torch
            # profiler, medians of 10 calls): P128x192c21 0.819 ms, P192x128c12 0.862, C128x256c21 0.847,
            # C128x192c21 0.851, C256x128c12 0.871, P128x128c21 0.884
            return _config("P", 128, 192)
        return _config("P", 192, 128, 1, 2)
    if gemm == "dw1":  # M = D, N = 2F, varlen-K gathered: C128x256 1 / 1.042 / 1.003; C256x192 1.108 / 1 / 1.037
        # (A/B at D = 4096, same run: C128x256 565.6 vs C256x192 551.0 TF fwd+bwd)
        return _config("C", 256, 192) if F >= 512 and D < 4096 else _config("C", 128, 256)
    if gemm == "dw2":  # M = D, N = F, varlen-K gathered: C128x256 best at all three
        return _config("C", 128, 256) if F >= 128 else _config("P", 128, 128)
    raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
