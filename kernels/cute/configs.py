"""Tile configurations of the six grouped GEMMs on SM90, and how they are chosen.

``SONIC_MEGATRON_CUTE_TUNING`` selects the policy (read at every call):
    heuristic  (default) SonicMoE's hand-picked H100 tiles per GEMM and expert size F (SONICMOE.md section 4,
               restricted to configurations QuACK 0.4.1 implements); compiles one kernel per config, no
               autotuning, so the first call of a new shape costs compile time only.
    autotune   QuACK's autotuner (tuned=True): benchmarks every valid config at the first call of each shape
               (minutes), results cached on disk (see ``kernels/cute/__init__.py``).
    default    QuACK's untuned default (128x192 Ping-Pong, cluster 2x1) for every GEMM.
"""

from __future__ import annotations

import os

from quack.gemm_config import GemmConfig

POLICIES = ("heuristic", "autotune", "default")
GEMMS = ("up", "down", "dh", "dw2", "dx", "dw1")


def policy() -> str:
    value = os.environ.get("SONIC_MEGATRON_CUTE_TUNING", "heuristic")
    if value not in POLICIES:
        raise ValueError(f"SONIC_MEGATRON_CUTE_TUNING must be one of {POLICIES}, got {value!r}")
    return value


def _coop(tile_m: int, tile_n: int) -> GemmConfig:
    return GemmConfig(
        tile_m=tile_m, tile_n=tile_n, pingpong=False, cluster_m=2, cluster_n=1, is_dynamic_persistent=False
    )


def _pingpong(tile_m: int, tile_n: int) -> GemmConfig:
    return GemmConfig(
        tile_m=tile_m, tile_n=tile_n, pingpong=True, cluster_m=2, cluster_n=1, is_dynamic_persistent=False
    )


def heuristic_config(gemm: str, F: int) -> GemmConfig:
    """SonicMoE's H100 choice for GEMM ``gemm`` (one of GEMMS) at expert size F (n).

    Gathered GEMMs keep cluster_n = 1 (QuACK's requirement with A_idx); gated epilogues need tile_n % 32 == 0."""
    if gemm == "up":  # N = 2F, gathered X, SwiGLU epilogue
        return _coop(128, 256) if F >= 128 else _pingpong(128, 128)
    if gemm == "down":  # N = D, heavy Y store: Ping-Pong unless F is large
        return _coop(128, 256) if F >= 1024 else _pingpong(128, 192)
    if gemm == "dh":  # N = F, gathered dO, dSwiGLU epilogue with an extra H load
        return _pingpong(128, 128)
    if gemm == "dx":  # N = D, contiguous dH
        return _coop(128, 256) if F >= 512 else _pingpong(128, 192)
    if gemm in ("dw1", "dw2"):  # varlen-K, gathered along K
        return _coop(128, 256) if F >= 128 else _pingpong(128, 128)
    raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
