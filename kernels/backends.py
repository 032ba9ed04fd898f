"""What the ``cute`` backend can run: its rules, written once, as pure functions of sizes, dtype and device.

Two places ask, and both use these functions:
* at call time, ``cute/ops.py::check_supported`` (the kernels' own check of their inputs) and
  ``interface.moe_experts(backend="auto")`` (which picks ``torch`` for inputs ``cute`` cannot take);
* at build time, ``sonic_megatron.layer_options.LayerOptions.resolve``, which decides a Megatron layer's backend
  from its config (activation, params dtype, hidden and expert ffn sizes, the device) before any kernel runs.

``cute_unsupported_reason`` is the whole rule (device, then config); ``cute_device_reason`` and
``cute_config_reason`` are its two halves, for callers that know only one (the call-time check has tensors whose
device ``interface.cute_unavailable_reason`` already checked). ``cute_import_reason`` says whether the backend's
packages import here (an environment fact, not a rule of the config).
"""

from __future__ import annotations

import warnings

import torch

from .activations import GATED_ACTIVATIONS

CUTE_CAPABILITY = (9, 0)  # Hopper (sm_90): QuACK's SM90 GEMMs
# Blackwell datacenter GPUs (sm_100, sm_103): QuACK picks its SM100 GEMMs by the device, with the same arguments, and
# the heuristic tuning gives way to QuACK's default configs there (cute/ops.py). Untested (no such GPU was
# available): only an explicit backend='cute' runs there, with a warning; 'auto' keeps the torch backend.
CUTE_UNTESTED_MAJORS = (10,)
CUTE_DTYPES = (torch.bfloat16, torch.float16)
CUTE_ALIGN = 8  # elements: QuACK's TMA/cp.async need 16-byte aligned rows (8 x 16-bit)
CUTE_MAX_EXPERTS = 65535  # SonicMoE's metadata limit; one varlen batch per expert


def cute_device_reason(device_capability: tuple[int, int] | None, explicit: bool = False) -> str | None:
    """Why the ``cute`` backend cannot run on a device of compute capability ``device_capability`` (None: no CUDA
    device); None when it can. ``explicit``: the user asked for ``cute`` by name, which also admits the untested
    Blackwell GPUs (``CUTE_UNTESTED_MAJORS``; ``untested_device_note`` says so)."""
    if device_capability is None:
        return "no CUDA GPU is visible, and the cute backend needs a Hopper GPU (sm_90)"
    major, minor = device_capability
    if (major, minor) == CUTE_CAPABILITY or (explicit and major in CUTE_UNTESTED_MAJORS):
        return None
    if major in CUTE_UNTESTED_MAJORS:
        return (
            f"the GPU is sm_{major}{minor}, where the cute backend is untested (QuACK's Blackwell GEMMs); "
            "backend='cute' (SonicConfig.backend='cute') runs it there"
        )
    return f"the GPU is sm_{major}{minor}, and the cute backend supports Hopper (sm_90) only (sm_100: untested)"


def untested_device_note(device_capability: tuple[int, int] | None) -> str | None:
    """The warning for an explicit ``cute`` on an untested GPU (None elsewhere)."""
    if device_capability is None or device_capability[0] not in CUTE_UNTESTED_MAJORS:
        return None
    major, minor = device_capability
    return (
        f"the cute backend runs on sm_{major}{minor} untested: QuACK's Blackwell GEMMs with QuACK's default tile "
        "configs and the project's Triton kernels, never checked on such a GPU"
    )


def cute_config_reason(
    activation: str, dtype: torch.dtype, hidden: int, ffn: int, num_experts: int | None = None
) -> str | None:
    """Why the ``cute`` backend's kernels cannot compute experts of this shape and type, None when they can.

    Args:
        activation: the kernels' activation name (``swiglu``, ``geglu``, ``relu2``, ``gelu``).
        dtype: the dtype of x and the weights (a Megatron layer's ``params_dtype``).
        hidden: the hidden size D (x.shape[1], Megatron's ``hidden_size``).
        ffn: one expert's ffn size F (w2.shape[2], Megatron's ``moe_ffn_hidden_size``).
        num_experts: the experts E the kernels see at once (w1.shape[0]: the local experts), None if unknown.
    """
    if activation not in GATED_ACTIVATIONS:
        return (
            f"activation {activation!r} is not a gated activation {GATED_ACTIVATIONS}: the cute backend's GEMMs fuse "
            "only those (QuACK's gated epilogues)"
        )
    if dtype not in CUTE_DTYPES:
        return f"the dtype (x.dtype, the layer's params_dtype) is {dtype}; the cute backend computes in {CUTE_DTYPES}"
    if hidden % CUTE_ALIGN:
        return (
            f"the hidden size D (x.shape[1], hidden_size) is {hidden}, not a multiple of {CUTE_ALIGN} "
            "(the cute backend's GEMMs need 16-byte rows)"
        )
    if ffn % CUTE_ALIGN:
        return (
            f"the expert ffn size F (w2.shape[2], moe_ffn_hidden_size) is {ffn}, not a multiple of {CUTE_ALIGN} "
            "(the cute backend's GEMMs need 16-byte rows)"
        )
    if num_experts is not None and not 1 <= num_experts <= CUTE_MAX_EXPERTS:
        return f"the number of experts E (w1.shape[0]) is {num_experts}, not in [1, {CUTE_MAX_EXPERTS}]"
    return None


def cute_unsupported_reason(
    activation: str,
    dtype: torch.dtype,
    hidden: int,
    ffn: int,
    device_capability: tuple[int, int] | None,
    num_experts: int | None = None,
    explicit: bool = False,
) -> str | None:
    """Why the ``cute`` backend cannot run these experts on that device (the device first, then the config),
    None when it can. Pure: reads no device, imports nothing (see ``cute_import_reason``). ``explicit``: as
    ``cute_device_reason``."""
    device = cute_device_reason(device_capability, explicit)
    return device or cute_config_reason(activation, dtype, hidden, ffn, num_experts)


def current_device_capability() -> tuple[int, int] | None:
    """The compute capability of the current CUDA device, None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(torch.cuda.current_device()))


def cute_import_reason() -> str | None:
    """Why the ``cute`` backend's modules do not import here (the ``hopper`` extra missing or at other versions, a
    CPU build of torch), None when they do."""
    try:
        from . import cute  # noqa: F401
    except ImportError as exc:
        return (
            f"the cute backend could not be imported ({exc}); install the extra: pip install 'sonic-megatron[hopper]'"
        )
    return None


_warned: set[str] = set()


def warn_once(msg: str, stacklevel: int = 3) -> None:
    """``warnings.warn(msg)`` the first time this process sees ``msg`` (one warning per reason, not per layer)."""
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, stacklevel=stacklevel)
