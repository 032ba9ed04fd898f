"""Tile configurations of the six grouped GEMMs on SM90 under the ``heuristic`` tuning (``kernels/options.py``).

``KernelOptions.tiles`` (``SONIC_MEGATRON_CUTE_TILES``) overrides single GEMMs; the ``autotune`` and ``default``
tunings use QuACK's own choice (``ops.py``).

Where the heuristic comes from: QuACK's autotuner timed every valid config of each GEMM on an H100 at
(T,d,n,E,K) = (24576,1536,256,128,8), (32768,2048,1024,64,8) and (32768,4096,1024,128,8); the tables are in
docs/perf/quack-tiles-h100-2026-11-21.txt. Per GEMM we take the config that is best (or within 2 %) on the
measured shapes, split by D or F where one config does not fit all; where our own A/Bs disagreed with the
autotuner, or for cases it did not time (fp32 main_grad outputs, whole-tile rows), docs/PERF.md ("Experts on one
H100") gives the timings.
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

    Each rule names the config that was fastest (or within 2 % of it) at the three measured shapes
    (D, F) = (1536, 256), (2048, 1024), (4096, 1024) (docs/perf/quack-tiles-h100-2026-11-21.txt), or that won
    our own A/B where one is named (docs/PERF.md, "Experts on one H100")."""
    if main_grad and gemm in ("dw1", "dw2"):
        # fp32 main_grads make the weight GEMMs store-bound (every expert's weights written per micro-batch, and
        # read too when adding: the epilogue loads the old values as the C operand). Our A/B of dW1 + dW2 (same
        # tile for both): adding, P128x128 is the fastest at F 768 and C128x256 at F 512; storing, C128x256.
        return _config("P", 128, 128) if main_grad == "add" and F >= 768 else _config("C", 128, 256)
    if gemm == "up":  # N = 2F, gathered X, SwiGLU epilogue: C128x256 best at all three
        return _config("C", 128, 256) if F >= 128 else _config("P", 128, 128)
    if gemm == "down":  # N = D, contiguous A': P128x192c21 within 2 % of the best below D = 4096, C256x128c12 the
        # best at D = 4096
        return _config("C", 256, 128, 1, 2) if D >= 4096 else _config("P", 128, 192)
    if gemm == "dh":  # N = F, gathered dO, dSwiGLU epilogue: P128x128 the best at F = 256, C128x256 at F = 1024
        return _config("C", 128, 256) if F >= 512 else _config("P", 128, 128)
    if gemm == "dx":  # N = D, contiguous dH (W1 via concat_layout): P192x128c12 the best at D = 1536 and 2048; at
        # D = 4096 the autotuner's pick C256x128c12 lost our A/B to it
        if rows_multiple and rows_multiple % 128 == 0:
            # Row counts in multiples of 128 fill 128-row tiles (192-row ones waste a third of a tile per expert at
            # 512 rows): P128x192c21 the fastest of six configs in our A/B of the rounded layer's dx
            return _config("P", 128, 192)
        return _config("P", 192, 128, 1, 2)
    if gemm == "dw1":  # M = D, N = 2F, varlen-K gathered: C256x192 the best at (2048, 1024), C128x256 at D = 1536
        # and, in our A/B, at D = 4096
        return _config("C", 256, 192) if F >= 512 and D < 4096 else _config("C", 128, 256)
    if gemm == "dw2":  # M = D, N = F, varlen-K gathered: C128x256 best at all three
        return _config("C", 128, 256) if F >= 128 else _config("P", 128, 128)
    raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
