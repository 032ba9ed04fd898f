"""Public entry point of ``sonic_megatron.kernels``: validation, backend choice and the one autograd
Function shared by all backends (FlashAttention-style: per-backend op modules, glue here).

Weights use Megatron's convention, stacked over the local experts:
    w1_EGD [E, G, D]  fc1 of each expert as nn.Linear stores it: G = 2F rows ``[gate ; up]`` (gate first)
                      for gated activations, G = F otherwise. (SonicMoE's kernels want gate/up
                      interleaved; the ``cute`` backend reads this concatenated layout directly through
                      QuACK's ``concat_layout`` and never copies the weights per step.)
    w2_EDF [E, D, F]  fc2 of each expert ([hidden, ffn], nn.Linear layout).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType

import torch

from . import torch_backend
from .activations import ACTIVATIONS, is_gated
from .backends import cute_config_reason, cute_device_reason, cute_import_reason, untested_device_note, warn_once
from .options import kernel_options
from .routing import (
    INDEX_DTYPES,
    FlatRouting,
    Routing,
    RoutingMetadata,
    TopKRouting,
    compute_metadata_torch,
    flatten_routing,
    run_offsets,
)
from .weight_grad_pairs import WeightGradWork

BACKENDS = ("auto", "torch", "cute")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# weight_grad_hook(compute) -> (dW1 or None, dW2 or None); compute (a WeightGradWork) returns (dW1, dW2), and
# compute(out=(dW1_acc, dW2_acc)) adds them into those buffers instead (fused accumulation, e.g. main_grad), and
# compute(out=..., accumulate=False) stores them there (buffers that hold no gradient yet);
# compute.merged_with(later) is one work over both micro-batches' rows.
WeightGradHook = Callable[[WeightGradWork], tuple[torch.Tensor | None, ...]]

# ----------------------------------------------------------------------------------------------------------
# Backend choice
# ----------------------------------------------------------------------------------------------------------


def cute_unavailable_reason(device: torch.device, explicit: bool = False) -> str | None:
    """Why the ``cute`` backend cannot run on ``device`` (None when it can): the device rule of
    ``backends.cute_device_reason`` (``explicit``: asked for by name), then whether the backend imports."""
    if device.type != "cuda":
        return f"the input is on {device.type}, and the cute backend needs a CUDA GPU"
    capability = tuple(torch.cuda.get_device_capability(device))
    return cute_device_reason(capability, explicit) or cute_import_reason()


def resolve_backend(backend: str, device: torch.device, config_reason: str | None = None) -> ModuleType:
    """The op module of a backend name. ``auto`` picks ``cute`` where it runs (a Hopper ``device``, the backend
    importable, and no ``config_reason``: why ``cute`` cannot take these inputs, ``backends.cute_config_reason``),
    else ``torch`` with a warning naming the reason. An explicit ``cute`` ignores ``config_reason``: its kernels'
    own check (``cute/ops.py::check_supported``, the same rule) raises, naming the argument."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    kernel_options()  # SONIC_MEGATRON_CUTE_TUNING / _TILES, read once on every machine: a bad value fails here too
    if backend == "auto":
        reason = cute_unavailable_reason(device) or config_reason
        if reason is None:
            backend = "cute"
        else:
            warn_once(f"sonic_megatron.kernels: backend='auto' uses the torch backend because {reason}.")
            backend = "torch"
    if backend == "torch":
        return torch_backend
    reason = cute_unavailable_reason(device, explicit=True)
    if reason is not None:
        raise RuntimeError(f"backend='cute' cannot run: {reason}")
    note = untested_device_note(tuple(torch.cuda.get_device_capability(device)))
    if note is not None:
        warn_once(f"sonic_megatron.kernels: {note}")
    from .cute import ops as cute_ops

    return cute_ops


# ----------------------------------------------------------------------------------------------------------
# Validation (before any computation)
# ----------------------------------------------------------------------------------------------------------


class ArgumentTypeError(TypeError, ValueError):
    """A tensor argument that is no tensor (e.g. a list): a TypeError, and a ValueError as every other bad input of
    ``moe_experts`` is (callers catching ValueError keep working)."""


def _fail(arg: str, expected: str, got: object) -> None:
    raise ValueError(f"moe_experts: {arg} must be {expected}, got {got}")


def _check_index_tensor(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dtype not in INDEX_DTYPES:
        _fail(f"{name}.dtype", "int32 or int64", t.dtype)
    if t.dim() != ndim:
        _fail(f"{name}", f"{ndim}-D", f"shape {tuple(t.shape)}")


def validate_inputs(
    x_TD: torch.Tensor,
    routing: Routing,
    w1_EGD: torch.Tensor,
    w2_EDF: torch.Tensor,
    activation: str,
    check_indices: bool | None,
) -> None:
    """Raise ValueError naming the argument, the expected and the actual value (TypeError where a tensor argument
    is not a tensor). Index values are read back to the host only when ``check_indices`` (default: True on CPU,
    False on GPU, to keep training free of syncs; out-of-range indices then trip PyTorch's device asserts or are
    undefined in kernels): their range, the order of a flat routing's tokens, and that no token names an expert
    twice (a top-K row, a flat routing's (token, expert) pairs)."""
    if activation not in ACTIVATIONS:
        _fail("activation", f"one of {ACTIVATIONS}", repr(activation))
    for name, t, shape in (
        ("x", x_TD, "2-D tensor [T, D]"),
        ("w1", w1_EGD, "3-D tensor [E, G, D]"),
        ("w2", w2_EDF, "3-D tensor [E, D, F]"),
    ):
        if not isinstance(t, torch.Tensor):  # e.g. a list: would fail later as "'list' object has no attribute"
            raise ArgumentTypeError(f"moe_experts: {name} must be a {shape} (a torch.Tensor), got {type(t).__name__}")
    if x_TD.dim() != 2:
        _fail("x", "a 2-D tensor [T, D]", f"shape {tuple(x_TD.shape)}")
    if x_TD.dtype not in FLOAT_DTYPES:
        _fail("x.dtype", f"one of {FLOAT_DTYPES}", x_TD.dtype)
    T, D = x_TD.shape
    if D == 0:
        _fail("x.shape[1] (hidden size D)", "> 0", D)
    for name, w in (("w1", w1_EGD), ("w2", w2_EDF)):
        if w.dim() != 3:
            _fail(name, "a 3-D tensor (experts first)", f"shape {tuple(w.shape)}")
        if w.dtype != x_TD.dtype:
            _fail(f"{name}.dtype", f"x.dtype ({x_TD.dtype})", w.dtype)
        if w.device != x_TD.device:
            _fail(f"{name}.device", f"x.device ({x_TD.device})", w.device)
    E, G, D1 = w1_EGD.shape
    E2, D2, F = w2_EDF.shape
    if E == 0:
        _fail("w1.shape[0] (experts E)", ">= 1", E)
    if E2 != E:
        _fail("w2.shape[0] (experts)", f"w1.shape[0] = {E}", E2)
    if D1 != D:
        _fail("w1.shape[2]", f"x.shape[1] = {D}", D1)
    if D2 != D:
        _fail("w2.shape[1]", f"x.shape[1] = {D}", D2)
    G_expected = 2 * F if is_gated(activation) else F
    if G_expected != G or F == 0:
        _fail(
            "w1.shape[1]",
            f"{'2 * ' if is_gated(activation) else ''}w2.shape[2] = {G_expected} (> 0) for activation {activation!r}",
            G,
        )
    if isinstance(routing, TopKRouting):
        s, idx = routing.scores_TK, routing.indices_TK
        _check_index_tensor("routing.indices_TK", idx, 2)
        if s.dim() != 2 or tuple(s.shape) != tuple(idx.shape):
            _fail("routing.scores_TK", f"shape {tuple(idx.shape)} (as indices_TK)", tuple(s.shape))
        if idx.shape[0] != T:
            _fail("routing.indices_TK.shape[0]", f"x.shape[0] = {T}", idx.shape[0])
        K = idx.shape[1]
        if not 1 <= K <= E:
            _fail("top-K (routing.indices_TK.shape[1])", f"in [1, E = {E}]", K)
        expert_idx, token_idx = idx, None
    elif isinstance(routing, FlatRouting):
        _check_index_tensor("routing.token_idx_R", routing.token_idx_R, 1)
        _check_index_tensor("routing.expert_idx_R", routing.expert_idx_R, 1)
        s = routing.scores_R
        R = routing.token_idx_R.numel()
        for name, t in (("routing.expert_idx_R", routing.expert_idx_R), ("routing.scores_R", s)):
            if t.dim() != 1 or t.numel() != R:
                _fail(name, f"1-D of length {R} (as token_idx_R)", tuple(t.shape))
        if routing.num_tokens != T:
            _fail("routing.num_tokens", f"x.shape[0] = {T}", routing.num_tokens)
        offsets = routing.token_offsets
        if offsets is not None:
            _check_index_tensor("routing.token_offsets", offsets, 1)
            if offsets.numel() != T + 1:
                _fail("routing.token_offsets", f"1-D of length T + 1 = {T + 1}", tuple(offsets.shape))
        if routing.metadata is not None:
            _check_metadata_shapes(routing.metadata, R, T, E, x_TD.device)
        expert_idx, token_idx = routing.expert_idx_R, routing.token_idx_R
    else:
        raise TypeError(f"moe_experts: routing must be TopKRouting or FlatRouting, got {type(routing).__name__}")
    if not s.is_floating_point():
        _fail("routing scores dtype", "floating point", s.dtype)
    located = (("routing scores", s), ("routing expert indices", expert_idx), ("routing.token_idx_R", token_idx))
    for name, t in located:
        if t is not None and t.device != x_TD.device:
            _fail(f"{name}.device", f"x.device ({x_TD.device})", t.device)
    if check_indices is None:
        check_indices = x_TD.device.type == "cpu"
    if check_indices and expert_idx.numel():
        pad = int(isinstance(routing, FlatRouting) and routing.padded)  # padding pairs: expert E, token T
        lo, hi = int(expert_idx.min()), int(expert_idx.max())
        if lo < 0 or hi >= E + pad:
            _fail(
                "routing expert indices", f"in [0, E = {E}{' (E: padding)' if pad else ')'}", f"values in [{lo}, {hi}]"
            )
        if token_idx is None:  # top-K: row t is token t's K experts
            _check_topk_rows_unique(expert_idx)
        if token_idx is not None:
            lo, hi = int(token_idx.min()), int(token_idx.max())
            if lo < 0 or hi >= T + pad:
                _fail(
                    "routing.token_idx_R", f"in [0, T = {T}{' (T: padding)' if pad else ')'}", f"values in [{lo}, {hi}]"
                )
            if bool((token_idx[1:] < token_idx[:-1]).any()):
                _fail("routing.token_idx_R", "sorted ascending", "an unsorted tensor")
            offsets = routing.token_offsets  # token_idx is a FlatRouting's
            if offsets is not None and not torch.equal(offsets.long(), run_offsets(token_idx, T)):
                _fail("routing.token_offsets", "each token's first pair in token_idx_R (CSR offsets)", "others")
            _check_flat_pairs_unique(token_idx, expert_idx, T, E, padded=bool(pad))
            meta = routing.metadata
            if meta is not None:
                built = compute_metadata(dataclasses.replace(routing, metadata=None), E)[1]
                for name, a, b in zip(RoutingMetadata.TENSOR_NAMES, meta.tensors(), built.tensors(), strict=True):
                    if not torch.equal(a, b):
                        _fail(f"routing.metadata.{name}", "the metadata of the routing's pairs", "other values")


def _check_topk_rows_unique(indices_TK: torch.Tensor) -> None:
    """Every row of ``indices_TK`` names K different experts (a token routes to an expert once); host read."""
    K = indices_TK.shape[1]
    if K < 2 or indices_TK.shape[0] == 0:
        return
    sorted_TK = indices_TK.sort(dim=1).values
    same_TK = sorted_TK[:, 1:] == sorted_TK[:, :-1]
    rows = same_TK.any(dim=1).nonzero()
    if rows.numel():
        t = int(rows[0])
        e = int(sorted_TK[t, 1:][same_TK[t]][0])
        raise ValueError(
            f"moe_experts: routing.indices_TK row {t} must name K = {K} different experts (a token routes to an "
            f"expert once), got {indices_TK[t].tolist()} (expert {e} twice)"
        )


def _check_flat_pairs_unique(
    token_idx_R: torch.Tensor, expert_idx_R: torch.Tensor, T: int, E: int, padded: bool
) -> None:
    """Every (token, expert) pair of a flat routing appears once (padding pairs, token T / expert E, aside);
    host read. Indices are in range (checked before)."""
    keys_R = token_idx_R.long() * (E + 1) + expert_idx_R.long()
    pos_R = torch.arange(keys_R.numel(), device=keys_R.device)
    if padded:
        real_R = (token_idx_R < T) & (expert_idx_R < E)
        keys_R, pos_R = keys_R[real_R], pos_R[real_R]
    if keys_R.numel() < 2:
        return
    keys_R, order_R = keys_R.sort(stable=True)
    dup = (keys_R[1:] == keys_R[:-1]).nonzero()
    if dup.numel():
        j = int(dup[0])
        t, e = divmod(int(keys_R[j]), E + 1)
        first, second = int(pos_R[order_R[j]]), int(pos_R[order_R[j + 1]])
        _fail(
            f"the pairs of token {t} (routing.token_idx_R, routing.expert_idx_R)",
            "unique (a token routes to an expert once)",
            f"expert {e} twice (pairs {first} and {second})",
        )


def _check_metadata_shapes(meta: RoutingMetadata, R: int, T: int, E: int, device: torch.device) -> None:
    """A producer's metadata (``FlatRouting.metadata``): int32 arrays of the routing's sizes on x's device."""
    sizes = (E + 1, R, R, R, T + 1)
    for name, t, n in zip(RoutingMetadata.TENSOR_NAMES, meta.tensors(), sizes, strict=True):
        if t.dtype != torch.int32 or t.dim() != 1 or t.numel() != n:
            _fail(f"routing.metadata.{name}", f"1-D int32 of length {n}", f"{t.dtype} of shape {tuple(t.shape)}")
        if t.device != device:
            _fail(f"routing.metadata.{name}.device", f"x.device ({device})", t.device)


# ----------------------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------------------


class MoEExpertsFunction(torch.autograd.Function):
    """Saves exactly X, H, the scores and the int32 metadata (plus the weights, which are parameters).
    A, Y, gathered X and gathered dO are never saved. Under ``torch.no_grad()`` it would still compute H
    (``ctx.needs_input_grad`` ignores grad mode): callers with an inference path call
    ``ops.forward(..., store_h=False)`` instead, as ``moe_experts`` does."""

    @staticmethod
    def forward(ctx, x_TD, scores_R, w1_EGD, w2_EDF, ops, activation, weight_grad_hook, layout, *meta_tensors):
        pairs_per_token, rows_multiple = layout
        meta = RoutingMetadata(*meta_tensors, pairs_per_token=pairs_per_token, rows_multiple=rows_multiple)
        store_h = any(ctx.needs_input_grad[:4])  # inference keeps no H
        o_TD, h_RG = ops.forward(x_TD, scores_R, w1_EGD, w2_EDF, meta, activation, store_h=store_h)
        ctx.ops, ctx.activation, ctx.weight_grad_hook = ops, activation, weight_grad_hook
        ctx.layout = layout
        ctx.save_for_backward(x_TD, h_RG, scores_R, w1_EGD, w2_EDF, *meta_tensors)
        return o_TD

    @staticmethod
    def backward(ctx, dO_TD):
        x_TD, h_RG, scores_R, w1_EGD, w2_EDF, *meta_tensors = ctx.saved_tensors
        pairs_per_token, rows_multiple = ctx.layout
        meta = RoutingMetadata(*meta_tensors, pairs_per_token=pairs_per_token, rows_multiple=rows_multiple)
        ops = ctx.ops
        dO_TD = dO_TD.contiguous()
        dx_TD, dscores_R, (aprime_RF, dH_RG) = ops.backward_data(
            dO_TD, x_TD, h_RG, scores_R, w1_EGD, w2_EDF, meta, ctx.activation
        )
        dw1 = dw2 = None
        if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
            weight_grads = WeightGradWork(ops, dO_TD, x_TD, aprime_RF, dH_RG, meta)
            hook = ctx.weight_grad_hook
            dw1, dw2 = weight_grads() if hook is None else hook(weight_grads)
        dscores_R = dscores_R.to(scores_R.dtype) if ctx.needs_input_grad[1] else None
        dx_TD = dx_TD if ctx.needs_input_grad[0] else None
        return (dx_TD, dscores_R, dw1, dw2, None, None, None, None) + (None,) * len(meta_tensors)


def compute_metadata(
    routing: Routing, num_experts: int, ops: ModuleType = torch_backend
) -> tuple[torch.Tensor, RoutingMetadata]:
    """(flat scores_R with autograd, metadata) for a routing; device-side, no host sync. A backend's op
    module may bring its own metadata kernels (``ops.compute_metadata``, same contract, and optionally
    ``ops.compute_metadata_topk(indices_TK, E)`` for top-K routing); else PyTorch's."""
    build_topk = getattr(ops, "compute_metadata_topk", None)
    if isinstance(routing, TopKRouting) and build_topk is not None:
        # Fewer launches before the first GEMM (the host is on the critical path of short calls).
        return routing.scores_TK.reshape(-1), build_topk(routing.indices_TK, num_experts)
    if isinstance(routing, FlatRouting) and routing.metadata is not None:  # the producer built it
        return routing.scores_R, routing.metadata
    token_idx_R, expert_idx_R, scores_R, token_offsets = flatten_routing(routing)
    build = getattr(ops, "compute_metadata", compute_metadata_torch)
    if isinstance(routing, FlatRouting) and routing.padded:
        # Padding pairs are expert E: they sort after every real row, past expert_offsets[E], where no GEMM
        # reads; token T: past token_offsets[T], where no sum reads. Their gather index is clamped into x.
        meta = build(token_idx_R, expert_idx_R, token_offsets, num_experts + 1)
        last_token = max(routing.num_tokens - 1, 0)
        return scores_R, dataclasses.replace(
            meta,
            expert_offsets=meta.expert_offsets[: num_experts + 1],
            x_gather_idx=meta.x_gather_idx.clamp(max=last_token),
        )
    meta = build(token_idx_R, expert_idx_R, token_offsets, num_experts)
    if isinstance(routing, TopKRouting):
        meta = dataclasses.replace(meta, pairs_per_token=routing.indices_TK.shape[1])
    return scores_R, meta


def moe_experts(
    x_TD: torch.Tensor,
    routing: Routing,
    w1_EGD: torch.Tensor,
    w2_EDF: torch.Tensor,
    *,
    activation: str = "swiglu",
    backend: str = "auto",
    check_indices: bool | None = None,
    weight_grad_hook: WeightGradHook | None = None,
) -> torch.Tensor:
    """SonicMoE experts: ``O[t] = sum_{(t, e, s)} s * fc2_e(act(fc1_e(x[t])))``, O [T, D] in x's dtype.

    Args:
        x_TD: tokens [T, D] (fp16/bf16/fp32/fp64; T may be 0, e.g. an EP rank that received nothing).
        routing: ``TopKRouting(scores_TK, indices_TK)`` or ``FlatRouting(token_idx_R, expert_idx_R,
            scores_R, num_tokens)`` (token_idx_R sorted ascending). Scores may be any float dtype; their
            gradient comes back in that dtype.
        w1_EGD: fc1 weights [E, G, D], G = 2F ``[gate ; up]`` for gated activations, else F.
        w2_EDF: fc2 weights [E, D, F].
        activation: one of ``swiglu`` (default), ``geglu``, ``relu2``, ``gelu``.
        backend: ``auto`` (``cute`` on Hopper where it takes these inputs, ``kernels/backends.py``; else ``torch``,
            with a warning saying why), ``torch`` or ``cute``.
        check_indices: read index values back to validate their range and order (default: on CPU only).
        weight_grad_hook: called in backward with a ``WeightGradWork`` computing ``(dW1, dW2)``; returns what autograd
            gets for the weights (e.g. ``(None, None)`` after accumulating them elsewhere, or after deferring the
            call, as Megatron's ``main_grad`` fusion and ``backward_dw()`` do). None: plain autograd. The
            function also takes ``out=(dW1_acc, dW2_acc)``: the gradients are then ADDED into those buffers
            (on GPUs inside the GEMM epilogue, e.g. straight into fp32 ``main_grad``s), or stored there with
            ``accumulate=False`` (buffers known to hold nothing yet: no read of their old values).

    Gradients reach x, the routing scores, w1 and w2.
    """
    validate_inputs(x_TD, routing, w1_EGD, w2_EDF, activation, check_indices)
    config_reason = None
    if backend == "auto":  # the cute backend's rule for these inputs (kernels/backends.py), checked before any kernel
        config_reason = cute_config_reason(activation, x_TD.dtype, x_TD.shape[1], w2_EDF.shape[2], w1_EGD.shape[0])
    ops = resolve_backend(backend, x_TD.device, config_reason)
    scores_R, meta = compute_metadata(routing, w1_EGD.shape[0], ops)
    x_TD = x_TD.contiguous()
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (x_TD, scores_R, w1_EGD, w2_EDF))):
        # Inference: no autograd node and no H (SonicMoE stores only A). This must be decided here: inside
        # Function.forward grad mode is always off and ctx.needs_input_grad ignores torch.no_grad().
        return ops.forward(x_TD, scores_R, w1_EGD, w2_EDF, meta, activation, store_h=False)[0]
    args = (ops, activation, weight_grad_hook, (meta.pairs_per_token, meta.rows_multiple))
    return MoEExpertsFunction.apply(x_TD, scores_R, w1_EGD, w2_EDF, *args, *meta.tensors())
