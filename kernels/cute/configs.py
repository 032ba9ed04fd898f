"""Tile configurations of the six grouped GEMMs on SM90, and how they are chosen.

``SONIC_MEGATRON_CUTE_TUNING`` selects the policy (read at every call):
    heuristic  (default) fixed tiles per GEMM from H100 measurements (below); compiles one kernel per config,
               no autotuning, so the first call of a new shape costs compile time only.
    autotune   QuACK's autotuner (tuned=True): benchmarks every valid config at the first call of each shape
               (minutes; its key includes M, so varlen shapes that change every step re-tune), results cached
               on disk (see ``kernels/cute/__init__.py``). For fixed-shape benchmarks.
    default    QuACK's untuned default (128x192 Ping-Pong, cluster 2x1) for every GEMM.

``SONIC_MEGATRON_CUTE_TILES`` overrides single GEMMs under ``heuristic``, e.g. ``dx=P192x128c12,dw1=C256x192c21``
(C = cooperative, P = Ping-Pong, tile_m x tile_n, cluster m n); for tile sweeps without code changes.

Where the heuristic comes from: QuACK's autotuner timed every valid config of each GEMM on an H100 at
(T,d,n,E,K) = (24576,1536,256,128,8), (32768,2048,1024,64,8) and (32768,4096,1024,128,8); the tables are in
docs/perf/quack-tiles-h100-2026-11-21.txt. Per GEMM we take the config that is best (or within 2 %) on the
measured shapes, split by D or F where one config does not fit all; the comments give the evidence.
Gathered operands need cluster_n = 1 (QuACK's requirement with A_idx) and gated epilogues tile_n % 32 == 0.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

from quack.gemm_config import GemmConfig

POLICIES = ("heuristic", "autotune", "default")
GEMMS = ("up", "down", "dh", "dw2", "dx", "dw1")
_TILE_RE = re.compile(r"^([CP])(\d+)x(\d+)(?:c([12])([12]))?$")


def policy() -> str:
    value = os.environ.get("SONIC_MEGATRON_CUTE_TUNING", "heuristic")
    if value not in POLICIES:
        raise ValueError(f"SONIC_MEGATRON_CUTE_TUNING must be one of {POLICIES}, got {value!r}")
    return value


def _config(kind: str, tile_m: int, tile_n: int, cluster_m: int = 2, cluster_n: int = 1) -> GemmConfig:
    return GemmConfig(
        tile_m=tile_m,
        tile_n=tile_n,
        pingpong=kind == "P",
        cluster_m=cluster_m,
        cluster_n=cluster_n,
        is_dynamic_persistent=False,
    )


def parse_tile(spec: str) -> GemmConfig:
    """``C128x256c21`` -> cooperative 128x256 tile, cluster 2x1 (cluster optional, default 2x1)."""
    m = _TILE_RE.match(spec.strip())
    if not m:
        raise ValueError(f"SONIC_MEGATRON_CUTE_TILES: a tile must look like C128x256c21 or P192x128c12, got {spec!r}")
    kind, tm, tn, cm, cn = m.groups()
    return _config(kind, int(tm), int(tn), int(cm or 2), int(cn or 1))


def _overrides(value: str) -> dict[str, GemmConfig]:
    value = value.strip()
    out = {}
    for item in filter(None, (v.strip() for v in value.split(","))):
        gemm, _, spec = item.partition("=")
        if gemm not in GEMMS:
            raise ValueError(f"SONIC_MEGATRON_CUTE_TILES: GEMM name must be one of {GEMMS}, got {gemm!r} in {item!r}")
        out[gemm] = parse_tile(spec)
    return out


def heuristic_config(gemm: str, F: int, D: int, dynamic: bool = False) -> GemmConfig:
    """``_tile_config`` under the current ``SONIC_MEGATRON_CUTE_TILES`` (memoized: called at every launch);
    ``dynamic``: with QuACK's dynamic persistent tile scheduler (CTAs take tiles from an atomic counter)."""
    return _heuristic_config(gemm, F, D, os.environ.get("SONIC_MEGATRON_CUTE_TILES", ""), dynamic)


@functools.cache
def _heuristic_config(gemm: str, F: int, D: int, tiles_env: str, dynamic: bool) -> GemmConfig:
    config = _tile_config(gemm, F, D, tiles_env)
    return dataclasses.replace(config, is_dynamic_persistent=True) if dynamic else config


def _tile_config(gemm: str, F: int, D: int, tiles_env: str) -> GemmConfig:
    """The tile config of GEMM ``gemm`` (one of GEMMS) at expert size F (n) and hidden size D (d).

    Each rule cites the measured cost relative to the best config at the three measured shapes
    (D, F) = (1536, 256), (2048, 1024), (4096, 1024) (docs/perf/quack-tiles-h100-2026-11-21.txt)."""
    override = _overrides(tiles_env).get(gemm)
    if override is not None:
        return override
    if gemm == "up":  # N = 2F, gathered X, SwiGLU epilogue: C128x256 best at all three
        return _config("C", 128, 256) if F >= 128 else _config("P", 128, 128)
    if gemm == "down":  # N = D, contiguous A': P128x192c21 1.014 / 1.000 / 1.108; C256x128c12 1.010 / 1.016 / 1.000
        return _config("C", 256, 128, 1, 2) if D >= 4096 else _config("P", 128, 192)
    if gemm == "dh":  # N = F, gathered dO, dSwiGLU epilogue: P128x128 1.000 / 1.036 / 1.127; C128x256 1.028 / 1 / 1
        return _config("C", 128, 256) if F >= 512 else _config("P", 128, 128)
    if gemm == "dx":  # N = D, contiguous dH (W1 via concat_layout): P192x128c12 1 / 1 / 1.172 in QuACK's autotuning;
        # at D = 4096 the autotuner's pick C256x128c12 is slower in ours (A/B, same run: fwd+bwd 536.8 vs 551.0 TF)
        return _config("P", 192, 128, 1, 2)
    if gemm == "dw1":  # M = D, N = 2F, varlen-K gathered: C128x256 1 / 1.042 / 1.003; C256x192 1.108 / 1 / 1.037
        # (A/B at D = 4096, same run: C128x256 565.6 vs C256x192 551.0 TF fwd+bwd)
        return _config("C", 256, 192) if F >= 512 and D < 4096 else _config("C", 128, 256)
    if gemm == "dw2":  # M = D, N = F, varlen-K gathered: C128x256 best at all three
        return _config("C", 128, 256) if F >= 128 else _config("P", 128, 128)
    raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
