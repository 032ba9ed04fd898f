"""Every call into QuACK, in one place, through QuACK's public ``quack.gemm_interface``, checked against the
supported version range.

``ops.py`` calls QuACK's ``gemm`` / ``gemm_add_inplace`` / ``gemm_gated`` / ``gemm_dgated`` itself under the
``autotune`` and ``default`` tunings; under ``heuristic`` it calls the three functions here, which pass a given
``GemmConfig``:

- ``gemm``: ``gemm_tuned.fn``, the autotuner's undecorated function (QuACK's ``gemm`` takes no config), with our
  output as its C operand when adding into it;
- ``gemm_gated`` / ``gemm_dgated``: QuACK's public functions of those names, which take ``config=``.

What the project no longer does with QuACK (each needed internals that QuACK 0.6 changed or hides):

- no SM budget inside QuACK: QuACK 0.6 sizes a persistent GEMM's grid once per launch plan (cached per tensor
  metadata, built with ``get_max_active_clusters``) and takes no grid argument, so ``reserve_sms(n > 0)`` cannot
  shrink its grid from outside. ``sm_budget_applies()`` says so; ``ops.py`` warns once when a reservation reaches
  a launch (the launches past it still take the dynamic tile scheduler, which needs no grid change);
- no launch replay: the compiled kernels were recorded by replacing QuACK's compile functions, which QuACK 0.6
  no longer has under those names; its own launch plans replay a call whose tensors have the same metadata
  (shapes included);
- no cache folder: QuACK keeps compiled kernels under ``QUACK_CACHE_DIR`` (read when QuACK is imported; default
  a folder under the system's temporary directory, kept across processes) and autotuning results under
  ``QUACK_HOME``. Set them before the first import of the backend to move them.

Importing this module checks the installed versions against ``SUPPORTED`` first and raises
``UnsupportedVersionError`` (an ImportError: ``backend="auto"`` then falls back to ``torch`` with a warning that
says why) naming the package, the installed and the supported versions.
"""

from __future__ import annotations

import importlib.metadata
import re

import torch

# (package, lowest supported, first unsupported): the ``hopper`` extra's ranges
SUPPORTED = (("quack-kernels", "0.6.5", "0.7"), ("nvidia-cutlass-dsl", "4.7", "4.9"))


class UnsupportedVersionError(ImportError):
    """An installed QuACK / CuTe-DSL version outside the supported range (or none)."""


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string ("4.8.1" -> (4, 8, 1); "0.6.5.dev1" -> (0, 6, 5))."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(p) for p in match.group(0).split(".")) if match else ()


def supported_range(lowest: str, first_unsupported: str) -> str:
    return f">={lowest},<{first_unsupported}"


def check_versions() -> None:
    """Raise UnsupportedVersionError unless every package of ``SUPPORTED`` is installed within its range."""
    installed = {}
    for package, _, _ in SUPPORTED:
        try:
            installed[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            installed[package] = None
    wanted = ", ".join(f"{p}{supported_range(lo, hi)}" for p, lo, hi in SUPPORTED)
    found = ", ".join(f"{p} {v or 'not installed'}" for p, v in installed.items())
    for package, lowest, first_unsupported in SUPPORTED:
        version = installed[package]
        if version is None:
            raise UnsupportedVersionError(
                f"{package} is not installed; the cute backend supports {wanted} (the hopper extra); found: {found}"
            )
        if not _release(lowest) <= _release(version) < _release(first_unsupported):
            raise UnsupportedVersionError(
                f"{package} {version} is installed; the cute backend supports {wanted} (the hopper extra); "
                f"found: {found}"
            )


check_versions()  # before importing QuACK: another version may fail to import in less clear ways
if not torch.cuda.is_available():
    raise ImportError("the cute backend needs a CUDA build of torch and a GPU")

from quack import gemm_interface as qgemm  # noqa: E402
from quack.gemm_config import GemmConfig  # noqa: E402

__all__ = ["GemmConfig", "gemm", "gemm_dgated", "gemm_gated", "sm_budget_applies"]


def sm_budget_applies() -> bool:
    """Whether ``reserve_sms(n)`` shrinks the grid of the GEMMs launched inside: not with QuACK 0.6, whose public
    interface takes no grid size (see the module docstring)."""
    return False


# ----------------------------------------------------------------------------------------------------------
# GEMMs with a given tile config (``dynamic``: QuACK's dynamic persistent tile scheduler, which allocates and
# zeroes its own tile counter per launch)
# ----------------------------------------------------------------------------------------------------------


def gemm(config, dynamic, A, B, out, cu_seqlens_m, cu_seqlens_k, A_idx, concat_layout, add_to_output) -> None:
    """out = A @ B, or out += A @ B with ``add_to_output``: ``out`` is also QuACK's C operand, whose tile the
    epilogue loads (TMA), adds to the accumulator and stores back. Each element is read and written once, by the
    one tile that owns it, so the sum is deterministic. Chosen over QuACK's TMA reduce-add store (``add_to_output``
    in QuACK), which made the fp32 main_grad accumulation of the weight GEMMs slower for bitwise equal results
    (docs/PERF.md, "End to end")."""
    C = out if add_to_output else None
    if add_to_output and concat_layout and "out" in concat_layout:
        concat_layout = (*concat_layout, "C")  # C is the same interleaved view as out
    qgemm.gemm_tuned.fn(
        A,
        B,
        out,
        C=C,
        cu_seqlens_m=cu_seqlens_m,
        cu_seqlens_k=cu_seqlens_k,
        A_idx=A_idx,
        dynamic_scheduler=dynamic,
        config=config,
        concat_layout=concat_layout,
    )


def gemm_gated(config, dynamic, A, B, preact_out, postact_out, activation, cu_seqlens_m, A_idx) -> None:
    """preact_out = A @ B (gate/up interleaved), postact_out = activation of it; B read through concat_layout."""
    qgemm.gemm_gated(
        A,
        B,
        preact_out=preact_out,
        postact_out=postact_out,
        activation=activation,
        cu_seqlens_m=cu_seqlens_m,
        A_idx=A_idx,
        store_preact=preact_out is not None,
        dynamic_scheduler=dynamic,
        tuned=False,
        config=config,
        concat_layout=("B",),
    )


def gemm_dgated(config, dynamic, A, B, preact, dx_out, postact_out, colvec_scale, activation, cu_seqlens_m, A_idx):
    """The dgated GEMM; returns its colvec reduction per row (fp32): sum over f of postact * unscaled dout."""
    return qgemm.gemm_dgated(
        A,
        B,
        preact,
        activation=activation,
        dx_out=dx_out,
        postact_out=postact_out,
        colvec_scale=colvec_scale,
        colvec_reduce=True,
        cu_seqlens_m=cu_seqlens_m,
        A_idx=A_idx,
        dynamic_scheduler=dynamic,
        tuned=False,
        config=config,
    )[2]
