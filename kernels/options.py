"""The kernels' tuning options, resolved once: ``kernel_options()``.

The environment variables below are the documented way to set them; they are read the first time
``kernel_options()`` is called (when a backend is first chosen, ``interface.resolve_backend``, before any kernel
runs, on every machine whether or not QuACK is installed; or earlier by the caller), validated, and frozen into one
``KernelOptions``. Parsing needs nothing but this module (no QuACK), so a bad value fails everywhere, naming the
variable, the allowed and the given value; ``SonicConfig.resolve`` checks them too when a layer is built
(``KernelOptions.from_env``). Launches read that object, never the environment, so changing a variable later has
no effect; ``set_kernel_options(KernelOptions(...))`` replaces the options explicitly (e.g.
a benchmark's ``--tuning``) for the launches after it.

    SONIC_MEGATRON_CUTE_TUNING  tile policy of the ``cute`` backend's GEMMs:
        heuristic  (default) fixed tiles per GEMM from measured timings (``kernels/cute/configs.py``); one
                   compiled kernel per config, no autotuning.
        autotune   QuACK's autotuner: benchmarks every valid config at the first call of each shape (minutes;
                   its key includes M, so varlen shapes that change every step re-tune). For fixed-shape runs.
        default    QuACK's untuned default config for every GEMM.
    SONIC_MEGATRON_CUTE_TILES   overrides single GEMMs under ``heuristic``, e.g. ``dx=P192x128c12,dw1=C256x192c21``
        (GEMM = one of ``GEMMS``; C = cooperative, P = Ping-Pong, tile_m x tile_n, optional cluster m n, default
        c21); for tile sweeps without code changes.
    SONIC_MEGATRON_CACHE_DIR    not read any more: a value fails, naming QuACK's own variables. QuACK keeps
        compiled kernels across processes under ``QUACK_CACHE_DIR`` and autotuning results under ``QUACK_HOME``
        (both read when QuACK is first imported; ``kernels/cute/quack_adapter.py`` says where they default to).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

__all__ = ["ENV_VARS", "GEMMS", "TUNINGS", "KernelOptions", "TileSpec", "kernel_options", "set_kernel_options"]

TUNINGS = ("heuristic", "autotune", "default")
GEMMS = ("up", "down", "dh", "dw2", "dx", "dw1")  # the cute backend's six grouped GEMMs (kernels/cute/ops.py)
TUNING_VAR = "SONIC_MEGATRON_CUTE_TUNING"
TILES_VAR = "SONIC_MEGATRON_CUTE_TILES"
CACHE_DIR_VAR = "SONIC_MEGATRON_CACHE_DIR"  # refused with a pointer to QuACK's variables
ENV_VARS = (TUNING_VAR, TILES_VAR, CACHE_DIR_VAR)  # every variable the kernels read
_TILE_RE = re.compile(r"^([CP])(\d+)x(\d+)(?:c([12])([12]))?$")


@dataclasses.dataclass(frozen=True)
class TileSpec:
    """One GEMM's tile config: ``C128x256c21`` = cooperative (P: Ping-Pong), 128 x 256 tile, cluster 2 x 1."""

    pingpong: bool
    tile_m: int
    tile_n: int
    cluster_m: int = 2
    cluster_n: int = 1

    @classmethod
    def parse(cls, spec: str, source: str = TILES_VAR) -> TileSpec:
        m = _TILE_RE.match(spec.strip())
        if not m:
            raise ValueError(f"{source}: a tile must look like C128x256c21 or P192x128c12, got {spec!r}")
        kind, tile_m, tile_n, cluster_m, cluster_n = m.groups()
        return cls(kind == "P", int(tile_m), int(tile_n), int(cluster_m or 2), int(cluster_n or 1))


def parse_tiles(value: str, source: str = TILES_VAR) -> tuple[tuple[str, TileSpec], ...]:
    """``"dx=P192x128c12,dw1=C256x192"`` -> ((gemm, TileSpec), ...), sorted by GEMM name."""
    out: dict[str, TileSpec] = {}
    for item in filter(None, (v.strip() for v in value.split(","))):
        gemm, sep, spec = item.partition("=")
        gemm = gemm.strip()
        if not sep:
            raise ValueError(f"{source}: each item must look like gemm=TILE (e.g. dx=P192x128c12), got {item!r}")
        if gemm not in GEMMS:
            raise ValueError(f"{source}: GEMM name must be one of {GEMMS}, got {gemm!r} in {item!r}")
        out[gemm] = TileSpec.parse(spec, source)
    return tuple(sorted(out.items()))


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Tuning of the ``cute`` backend (see the module docstring for each field's environment variable).

    ``tiles``: per-GEMM overrides under ``heuristic``, as ``{gemm: TileSpec}``, ``((gemm, TileSpec), ...)``
    or the variable's string form; stored as a sorted tuple (hashable: it keys the memoized tile configs)."""

    tuning: str = "heuristic"
    tiles: tuple[tuple[str, TileSpec], ...] = ()

    def __post_init__(self) -> None:
        if self.tuning not in TUNINGS:
            raise ValueError(f"KernelOptions.tuning ({TUNING_VAR}) must be one of {TUNINGS}, got {self.tuning!r}")
        tiles = self.tiles
        if isinstance(tiles, str):
            tiles = parse_tiles(tiles, f"KernelOptions.tiles ({TILES_VAR})")
        items = list(tiles.items()) if isinstance(tiles, Mapping) else list(tiles)
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2 and item[0] in GEMMS and isinstance(item[1], TileSpec)):
                raise ValueError(
                    f"KernelOptions.tiles ({TILES_VAR}): each override must be (gemm, TileSpec) with gemm one of "
                    f"{GEMMS}, got {item!r}"
                )
        object.__setattr__(self, "tiles", tuple(sorted(dict(items).items())))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KernelOptions:
        """The options the environment variables ask for (``environ``: default ``os.environ``)."""
        environ = os.environ if environ is None else environ
        tuning = environ.get(TUNING_VAR) or "heuristic"  # empty: unset, as for SonicConfig's variables
        if tuning not in TUNINGS:
            raise ValueError(f"{TUNING_VAR} must be one of {TUNINGS}, got {tuning!r}")
        tiles = parse_tiles(environ.get(TILES_VAR, ""))
        if environ.get(CACHE_DIR_VAR):
            raise ValueError(
                f"{CACHE_DIR_VAR} is no longer read, got {environ[CACHE_DIR_VAR]!r}: set QUACK_CACHE_DIR (QuACK's "
                "compiled kernels) and QUACK_HOME (its autotuning results) instead, before the cute backend is imported"
            )
        return cls(tuning=tuning, tiles=tiles)


_resolved: KernelOptions | None = None


def kernel_options() -> KernelOptions:
    """The options in force: resolved from the environment at the first call, the same object afterwards."""
    if _resolved is None:
        set_kernel_options(KernelOptions.from_env())
    return _resolved


def set_kernel_options(options: KernelOptions) -> None:
    """Use ``options`` for every launch from now on (replacing the environment's or earlier ones)."""
    global _resolved
    if not isinstance(options, KernelOptions):
        raise TypeError(f"set_kernel_options: options must be a KernelOptions, got {type(options).__name__}")
    _resolved = options
