"""Every call into QuACK, in one place, checked against the supported version range.

``ops.py`` calls QuACK's ``gemm`` / ``gemm_add_inplace`` / ``gemm_gated`` / ``gemm_dgated`` itself under the
``autotune`` and ``default`` tunings. Under ``heuristic`` it calls the three functions here with a given
``GemmConfig``; each launches QuACK's own launch plan of the first call of its signature at every later call:
QuACK compiles a GEMM for dtypes, majors and flags and takes sizes at run time, so one plan serves every size,
while QuACK's own plan caches key on the full shapes, and an expert-parallel layer's row counts change at every
call. Inside ``reserve_sms(n)`` a plan runs on fewer clusters (``on_fewer_sms``: its ``max_active_clusters`` and
scheduler arguments).

- ``gemm`` (the default-epilogue GEMMs: down, dX~, dW1, dW2): the first call runs ``gemm_tuned.fn`` (the
  autotuner's undecorated function: QuACK's ``gemm`` takes no config), which returns its dispatch plan; later calls
  go through QuACK's warm-launch entry with it (``replay_plan``);
- ``gemm_gated`` / ``gemm_dgated``: QuACK's epilogue modules of those GEMMs (``linear_act_mod``, ``dgated_mod``)
  with the arguments QuACK's functions of those names give them; the first call runs the module's ``gemm``, which
  returns its plan, later calls ``run_gemm_epi_plan``.

QuACK keeps compiled kernels under ``QUACK_CACHE_DIR`` (read when QuACK is imported; default a folder under the
system's temporary directory, kept across processes) and autotuning results under ``QUACK_HOME``; set them before
the first import of the backend to move them. Nothing here assigns an attribute of a QuACK module or writes the
environment.

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

try:  # the gated and dgated GEMMs' epilogue modules: imported here, not at their first call in a forward
    from quack.epilogue.library import dgated_mod, linear_act_mod  # noqa: E402
except TypeError as exc:  # QuACK's fingerprint of the code its epilogue functions reach
    raise ImportError(
        f"QuACK's epilogue library does not import ({exc}). QuACK treats code outside a site-packages or "
        "dist-packages folder as its own and fingerprints it, which fails on CuTe-DSL's: install quack-kernels and "
        "nvidia-cutlass-dsl into the Python environment's site-packages (not with pip --target or PYTHONPATH)"
    ) from exc
from quack.gemm_config import GemmConfig  # noqa: E402
from quack.gemm_runtime.host import run_gemm_epi_plan  # noqa: E402
from quack.gemm_tvm_ffi_utils import make_scheduler_args  # noqa: E402
from quack.rounding import RoundingMode  # noqa: E402

from ..sm_reservation import budgeted_clusters  # noqa: E402

__all__ = ["GemmConfig", "gemm", "gemm_dgated", "gemm_gated", "on_fewer_sms", "replay_plan"]


# ----------------------------------------------------------------------------------------------------------
# Launch plans of the default-epilogue GEMMs
# ----------------------------------------------------------------------------------------------------------


def _layout(t) -> tuple | None:
    """What QuACK's compile key reads of a tensor: dtype, rank and its major (whether the last dim is contiguous)."""
    return None if t is None else (t.dtype, t.dim(), t.stride(-1) == 1)


# signature -> what gemm_tuned.fn decided: (config, split_k, dynamic scheduler, QuACK's dispatch plan)
_DECIDED: dict = {}
# (id of a plan, SMs to leave free) -> that plan on fewer clusters
_FEWER: dict = {}


def replay_plan(decided: tuple, A, B, out, C, cu_seqlens_m, cu_seqlens_k, A_idx, concat_layout, plan) -> None:
    """Launch ``plan`` (QuACK's dispatch plan of an earlier call with the same signature) on these tensors through
    QuACK's warm-launch entry, the one its own interface plans replay through: the operand routing of
    ``gemm_tuned.fn`` (transposes, concat layouts) and the launch, no plan build. Not in QuACK's documented
    interface: tests/test_cute_gpu.py checks it against ``gemm_tuned.fn`` (bitwise, at other sizes, on fewer SMs)
    and fails when QuACK changes it; tests/test_cute_wiring.py pins the arguments of the supported release."""
    config, split_k, dynamic, _ = decided
    qgemm._gemm_execute(
        A,
        B,
        out,
        C,
        bias=None,
        alpha=1.0,
        beta=1.0,
        cu_seqlens_m=cu_seqlens_m,
        cu_seqlens_k=cu_seqlens_k,
        A_idx=A_idx,
        batch_idx_permute=None,
        add_to_output=False,
        dynamic_scheduler=dynamic,
        config=config,
        rounding_mode=RoundingMode.RN,
        sr_seed=0,
        concat_layout=concat_layout,
        SFA=None,
        SFB=None,
        split_k=split_k,
        split_k_mode=plan.split_k_mode,
        dispatch_plan=plan,
    )


def on_fewer_sms(plan, reserved: int):
    """``plan`` launching at most as many clusters as leave ``reserved`` SMs free (the plan itself when 0): its
    ``max_active_clusters`` and, where the scheduler arguments are prebuilt, those. Same bits: every tile is still
    computed once, by one CTA."""
    if reserved <= 0:
        return plan
    key = (id(plan), reserved)
    fewer = _FEWER.get(key)
    if fewer is None:
        clusters = budgeted_clusters(plan.max_active_clusters, plan.cluster_M * plan.cluster_N, reserved)
        static = plan.scheduler_static
        if static is not None:
            static = make_scheduler_args(clusters, plan.max_swizzle_size, None)
        fewer = _FEWER[key] = plan._replace(max_active_clusters=clusters, scheduler_static=static)
    return fewer


# ----------------------------------------------------------------------------------------------------------
# GEMMs with a given tile config (``dynamic``: QuACK's dynamic persistent tile scheduler, which allocates and
# zeroes its own tile counter per launch)
# ----------------------------------------------------------------------------------------------------------


def gemm(config, dynamic, A, B, out, cu_seqlens_m, cu_seqlens_k, A_idx, concat_layout, add_to_output, reserved=0):
    """out = A @ B, or out += A @ B with ``add_to_output``: ``out`` is also QuACK's C operand, whose tile the
    epilogue loads (TMA), adds to the accumulator and stores back. Each element is read and written once, by the
    one tile that owns it, so the sum is deterministic. Chosen over QuACK's TMA reduce-add store (``add_to_output``
    in QuACK), which made the fp32 main_grad accumulation of the weight GEMMs slower for bitwise equal results
    (docs/PERF.md, "End to end"). ``reserved``: SMs to leave free (``on_fewer_sms``); a signature's first launch
    takes QuACK's own path, on every SM."""
    C = out if add_to_output else None
    if add_to_output and concat_layout and "out" in concat_layout:
        concat_layout = (*concat_layout, "C")  # C is the same interleaved view as out
    key = (config, dynamic, concat_layout, A.device, cu_seqlens_m is None, cu_seqlens_k is None, A_idx is None)
    key += (_layout(A), _layout(B), _layout(out), _layout(C))
    decided = _DECIDED.get(key)
    if decided is not None:
        plan = on_fewer_sms(decided[3], reserved)
        replay_plan(decided, A, B, out, C, cu_seqlens_m, cu_seqlens_k, A_idx, concat_layout, plan)
        return
    decided = qgemm.gemm_tuned.fn(
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
    if isinstance(decided, tuple) and len(decided) == 4 and hasattr(decided[3], "max_active_clusters"):
        _DECIDED[key] = decided


# ----------------------------------------------------------------------------------------------------------
# The gated and dgated GEMMs: QuACK's epilogue modules
# ----------------------------------------------------------------------------------------------------------

# signature -> QuACK's epilogue plan (``GemmEpiPlan``) of its first call
_EPI_PLANS: dict = {}


def _epilogue_gemm(mod, key, A, B_d, D, C, epi_args, config, dynamic, cu_seqlens_m, A_idx, b_kn, concat, reserved):
    """One GEMM of epilogue module ``mod`` with the arguments QuACK's ``gemm_gated`` / ``gemm_dgated`` give it
    (``B_d`` as they pass B, ``epi_args`` the outputs, operands and reduction partials by QuACK's names). The first
    call of a signature (``key``) runs ``mod.gemm``, which launches and returns its plan (compiled for dtypes,
    majors and flags; sizes at run time); later calls launch that plan (``run_gemm_epi_plan``), on fewer clusters
    inside ``reserve_sms`` (``on_fewer_sms``)."""
    dynamic = dynamic or config.is_dynamic_persistent
    semaphore = torch.zeros(1, dtype=torch.int32, device=A.device) if dynamic else None  # the dynamic tile counter
    plan = _EPI_PLANS.get(key)
    if plan is not None:
        run_gemm_epi_plan(
            on_fewer_sms(plan, reserved),
            A,
            B_d,
            D,
            C,
            epi_args,
            tile_count_semaphore=semaphore,
            cu_seqlens_m=cu_seqlens_m,
            A_idx=A_idx,
        )
        return
    _EPI_PLANS[key] = mod.gemm(
        A,
        B_d,
        D,
        C,
        epi_args=epi_args,
        tile_M=config.tile_m,
        tile_N=config.tile_n,
        cluster_M=config.cluster_m,
        cluster_N=config.cluster_n,
        tile_K=config.tile_k,
        pingpong=config.pingpong,
        persistent=True,
        is_dynamic_persistent=dynamic,
        max_swizzle_size=config.max_swizzle_size,
        tile_count_semaphore=semaphore,
        cu_seqlens_m=cu_seqlens_m,
        A_idx=A_idx,
        b_kn=b_kn,
        use_tma_gather=config.use_tma_gather,
        concat_layout=concat,
        swap_ab=config.swap_ab,
    )


def gemm_gated(config, dynamic, A, B, preact_out, postact_out, activation, cu_seqlens_m, A_idx, reserved=0) -> None:
    """preact_out = A @ B (gate/up interleaved; None: not stored), postact_out = activation of it; B [E, K, 2F]
    read through the concatenated layout. ``reserved``: SMs to leave free."""
    mod = linear_act_mod(activation, gated=True, has_c=False, has_rowvec=False, has_colvec=False)
    B_d = B.mT  # concat layouts take B (n, k), no (k, n) relabel: as QuACK's gemm_gated passes it
    key = ("gated", config, dynamic, activation, A.device, cu_seqlens_m is None, A_idx is None)
    key += (_layout(A), _layout(B_d), _layout(preact_out), _layout(postact_out))
    epi_args = {"mAuxOut": postact_out}
    args = (A, B_d, preact_out, None, epi_args, config, dynamic, cu_seqlens_m, A_idx, False, ("B",), reserved)
    _epilogue_gemm(mod, key, *args)


def gemm_dgated(
    config, dynamic, A, B, preact, dx_out, postact_out, colvec_scale, activation, cu_seqlens_m, A_idx, reserved=0
):
    """The dgated GEMM; returns its colvec reduction per row (fp32): sum over f of postact * unscaled dout, from
    per-(row, N tile) partials (what QuACK's gemm_dgated allocates and sums). ``reserved``: SMs to leave free."""
    mod = dgated_mod(activation, has_scale=True, has_reduce=True)
    rows = A_idx.shape[0] if A_idx is not None else A.shape[0]
    partials = torch.empty(rows, -(-B.shape[-1] // config.tile_n), dtype=torch.float32, device=A.device)
    key = ("dgated", config, dynamic, activation, A.device, cu_seqlens_m is None, A_idx is None)
    key += (_layout(A), _layout(B), _layout(preact), _layout(dx_out), _layout(postact_out), _layout(colvec_scale))
    epi_args = {"mColVecBroadcast": colvec_scale, "mAuxOut": postact_out, "mColVecReduce": partials}
    args = (A, B, dx_out, preact, epi_args, config, dynamic, cu_seqlens_m, A_idx, True, None, reserved)
    _epilogue_gemm(mod, key, *args)
    return partials.sum(dim=-1)
