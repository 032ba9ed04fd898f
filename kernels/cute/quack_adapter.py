"""Every use of QuACK's and CuTe-DSL's internals, in one place, checked against the tested versions.

``ops.py`` calls QuACK's public ``quack.gemm_interface`` functions (the ``autotune`` and ``default`` tunings) and,
under the ``heuristic`` tuning, the three launch functions here, which reach below that interface:

- ``gemm`` / ``gemm_gated`` / ``gemm_dgated`` run a GEMM with a given ``GemmConfig`` through the autotuner's
  undecorated function (``gemm_tuned.fn``, ``gemm_gated_tuned.fn``) or ``quack.gemm_dact.gemm_dact``, and go
  through ``LAUNCHES``: after a call signature's first call the compiled kernel is called directly with
  arguments rebuilt from our tensors (``kernels/launch_cache.py``), which needs QuACK's compile-cache function
  names and its scheduler options type (``TileSchedulerOptions``, rebuilt per call by ``_scheduler_now``);
- the SM budget: QuACK 0.4.1 sizes a persistent GEMM's grid with ``get_max_active_clusters``, looked up at call
  time in the modules of the three GEMM families we call (``quack.gemm``, ``quack.gemm_act``,
  ``quack.gemm_dact``): a runtime argument of the compiled kernel, not part of its compile key. Importing this
  module points those three names at a wrapper that subtracts the reservation of the calling context
  (``kernels/sm_reservation.py``: ``reserve_sms(n, gemms=k)``) and leaves QuACK's value untouched outside it.
  The tiles are the same, only how many CTAs share them changes: results are bitwise equal;
- QuACK's compile cache: it keeps compiled kernels and autotuning results under ``QUACK_CACHE_DIR``, read when
  QuACK is imported; unless the caller set it, it is pointed at ``KernelOptions.cache_folder()``
  (``SONIC_MEGATRON_CACHE_DIR``), so a restarted job loads kernels instead of compiling them again.

These depend on QuACK's and CuTe-DSL's private structure, so importing this module first checks the installed
versions against ``SUPPORTED`` and raises ``UnsupportedVersionError`` (an ImportError: ``backend="auto"`` then
falls back to ``torch`` with a warning that says why) naming the package, the found and the supported version.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os

import torch

from ..launch_cache import LaunchCache
from ..options import kernel_options
from ..sm_reservation import budgeted_clusters, take_reservation

SUPPORTED = (("quack-kernels", "0.4.1"), ("nvidia-cutlass-dsl", "4.4.2"))  # the tested pins (``hopper`` extra)


class UnsupportedVersionError(ImportError):
    """An installed QuACK / CuTe-DSL version other than the tested one (or none)."""


def check_versions() -> None:
    """Raise UnsupportedVersionError unless every package of ``SUPPORTED`` is installed at its version."""
    for package, supported in SUPPORTED:
        try:
            found = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            raise UnsupportedVersionError(
                f"{package} is not installed; the cute backend supports {package}=={supported} (the hopper extra)"
            ) from None
        if found != supported:
            raise UnsupportedVersionError(
                f"{package} {found} is installed; the cute backend supports {package}=={supported} only (it uses "
                "internals of QuACK and CuTe-DSL that change between versions; the hopper extra pins them)"
            )


check_versions()  # before importing QuACK: another version may fail to import in less clear ways
if not torch.cuda.is_available():
    raise ImportError("the cute backend needs a CUDA build of torch and a GPU")
os.environ.setdefault("QUACK_CACHE_DIR", kernel_options().cache_folder())  # QuACK reads both at import
os.environ.setdefault("QUACK_CACHE_AUTOTUNING", "1")

from cutlass import Int32  # noqa: E402
from quack import cute_dsl_utils  # noqa: E402
from quack import gemm_interface as qgemm  # noqa: E402
from quack.gemm_config import GemmConfig  # noqa: E402
from quack.gemm_dact import gemm_dact  # noqa: E402
from quack.tile_scheduler import TileSchedulerOptions  # noqa: E402

__all__ = ["LAUNCHES", "GemmConfig", "clusters_now", "gemm", "gemm_dgated", "gemm_gated"]

# ----------------------------------------------------------------------------------------------------------
# SM budget: QuACK's grid size less the reservation of the calling context
# ----------------------------------------------------------------------------------------------------------

_BUDGETED_MODULES = ("quack.gemm", "quack.gemm_act", "quack.gemm_dact")


def _install_sm_budget() -> None:
    """Route the three QuACK GEMM modules' cluster count through the reservation (idempotent)."""
    full = cute_dsl_utils.get_max_active_clusters

    def get_max_active_clusters(cluster_size: int, *args, **kwargs) -> int:
        return budgeted_clusters(full(cluster_size, *args, **kwargs), cluster_size, take_reservation())

    get_max_active_clusters.sonic_megatron_budget = True
    for name in _BUDGETED_MODULES:
        module = importlib.import_module(name)
        current = getattr(module, "get_max_active_clusters", None)
        if current is None:
            raise ImportError(f"{name} has no get_max_active_clusters: this QuACK version is not supported")
        if not getattr(current, "sonic_megatron_budget", False):
            module.get_max_active_clusters = get_max_active_clusters


_install_sm_budget()


def clusters_now(cluster_size: int) -> int:
    """The grid (clusters) of a persistent GEMM launched now: QuACK's count less the reservation, which this call
    takes (counts the launch). For the cached launches, which bypass QuACK's Python path."""
    return budgeted_clusters(cute_dsl_utils.get_max_active_clusters(cluster_size), cluster_size, take_reservation())


# ----------------------------------------------------------------------------------------------------------
# Launch cache: QuACK's compile-cache functions and its per-call scheduler options
# ----------------------------------------------------------------------------------------------------------


@functools.cache
def _int32(n: int):
    return Int32(n)


def _scheduler_now(recorded, ctx):
    """QuACK's scheduler options of a cached launch, with this launch's grid size (SM reservation) and semaphore.
    ``ctx`` = (CTAs per cluster, the dynamic tile scheduler's zeroed int32 counter or None)."""
    cluster_size, semaphore = ctx
    return TileSchedulerOptions(
        _int32(clusters_now(cluster_size)),
        recorded.raster_order,
        recorded.max_swizzle_size,
        None if semaphore is None else semaphore.data_ptr(),
        recorded.batch_idx_permute,
    )


# The heuristic tuning's launches go through this cache, which costs less host time per GEMM than QuACK's Python
# path (docs/PERF.md, "Expert parallelism"); the first call of a signature takes QuACK's own path and is recorded.
LAUNCHES = LaunchCache(
    (
        ("quack.gemm", "_compile_gemm"),
        ("quack.gemm_act", "_compile_gemm_act"),
        ("quack.gemm_dact", "_compile_gemm_dact"),
    ),
    per_call={TileSchedulerOptions: _scheduler_now},
)


# ----------------------------------------------------------------------------------------------------------
# GEMMs with a given tile config (``semaphore``: the dynamic tile scheduler's zeroed counter, or None = static)
# ----------------------------------------------------------------------------------------------------------


def gemm(config, semaphore, A, B, out, cu_seqlens_m, cu_seqlens_k, A_idx, concat_layout, add_to_output) -> None:
    """out = A @ B, or out += A @ B with ``add_to_output``: ``out`` is also QuACK's C operand, whose tile the
    epilogue loads (TMA), adds to the accumulator and stores back. Each element is read and written once, by the
    one tile that owns it, so the sum is deterministic. Chosen over QuACK's TMA reduce-add store (``add_to_output``
    in QuACK), which made the fp32 main_grad accumulation of the weight GEMMs slower for bitwise equal results
    (docs/PERF.md, "End to end")."""
    C = out if add_to_output else None
    if add_to_output and concat_layout and "out" in concat_layout:
        concat_layout = (*concat_layout, "C")  # C is the same interleaved view as out

    def quack_path():
        qgemm.gemm_tuned.fn(
            A,
            B,
            out,
            C=C,
            cu_seqlens_m=cu_seqlens_m,
            cu_seqlens_k=cu_seqlens_k,
            A_idx=A_idx,
            dynamic_scheduler=semaphore is not None,
            config=config,
            concat_layout=concat_layout,
        )

    site = ("gemm", id(config), concat_layout, add_to_output)  # configs are memoized: id() is stable
    inputs = (A, B, out, cu_seqlens_m, cu_seqlens_k, A_idx)  # C is out: rebuilt from the same input
    # gemm sizes its grid by cluster_m * cluster_n * cluster_k
    ctx = (config.cluster_m * config.cluster_n * config.cluster_k, semaphore)
    LAUNCHES.launch(site, inputs, quack_path, ctx=ctx)


def gemm_gated(config, semaphore, A, B, preact_out, postact_out, activation, cu_seqlens_m, A_idx) -> None:
    """preact_out = A @ B (gate/up interleaved), postact_out = activation of it; B read through concat_layout."""

    def quack_path():
        qgemm.gemm_gated_tuned.fn(
            A,
            B,
            preact_out,
            postact_out,
            activation=activation,
            cu_seqlens_m=cu_seqlens_m,
            A_idx=A_idx,
            dynamic_scheduler=semaphore is not None,
            config=config,
            concat_layout=("B",),
        )

    inputs = (A, B, preact_out, postact_out, cu_seqlens_m, A_idx)
    ctx = (config.cluster_m * config.cluster_n, semaphore)  # gemm_act's grid: cluster_m * cluster_n
    LAUNCHES.launch(("gated", id(config), activation), inputs, quack_path, ctx=ctx)


def gemm_dgated(
    config, semaphore, A, B, preact, dx_out, postact_out, colvec_scale, partial, activation, cu_seqlens_m, A_idx
) -> None:
    """The dgated GEMM (``gemm_dact``) with its colvec reduction's per-(row, N tile) partials written into
    ``partial`` (allocated by the caller, so that the launch reads only the caller's tensors: cacheable)."""

    def quack_path():
        gemm_dact(
            A,
            B.mT,
            dx_out,
            preact,
            postact_out,
            semaphore,
            activation,
            config.tile_m,
            config.tile_n,
            config.cluster_m,
            config.cluster_n,
            tile_K=config.tile_k,
            pingpong=config.pingpong,
            persistent=True,
            is_dynamic_persistent=semaphore is not None,
            max_swizzle_size=config.max_swizzle_size,
            colvec_scale=colvec_scale,
            colvec_reduce=partial,
            cu_seqlens_m=cu_seqlens_m,
            A_idx=A_idx,
            use_tma_gather=config.use_tma_gather,
        )

    inputs = (A, B, dx_out, preact, postact_out, colvec_scale, partial, cu_seqlens_m, A_idx)
    ctx = (config.cluster_m * config.cluster_n, semaphore)  # gemm_dact's grid: cluster_m * cluster_n
    LAUNCHES.launch(("dgated", id(config), activation), inputs, quack_path, ctx=ctx)
