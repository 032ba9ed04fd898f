"""Backend ``torch``: SonicMoE's algorithm in plain PyTorch, for CPUs, CI, debugging and as the numerics
oracle of the GPU backend. Same data flow and same cache as the GPU kernels; no autograd here (the one
autograd Function lives in ``interface.py``). Shape legend: see ``routing.py``; G = fc1 width (2F gated).

Forward:  H = gather(X) @ W1_e^T (per expert);  A = act(H);  Y = A @ W2_e^T;  O_t = sum_j s_j Y[row(j)] (fp32)
Backward (cache: X, H, scores, int32 metadata; never Y, gathered X or A):
    dA' = gather(dO) @ W2_e;  A = act(H) recomputed;  dS_row = <dA', A>;  dA = s*dA';  dH = act'(dA, H)
    A' = s*A;  dW2_e = dO_e^T A'_e;  dW1_e = dH_e^T X_e;  dX~ = dH @ W1_e;  dX_t = sum_j dX~[row(j)]

PyTorch needs each expert's row count on the host to slice its GEMMs, so this backend reads
``expert_offsets`` back once per phase (free on a CPU; one sync on a GPU). The GPU backend needs none.
Transient tensors of R x D rows (gathered X, Y, gathered dO) exist here inside a phase only.
"""

from __future__ import annotations

import contextlib

import torch

from .activations import act_forward, act_forward_backward
from .routing import RoutingMetadata
from .sm_reservation import check_reservation


def reserve_sms(n: int, gemms: int | None = None) -> contextlib.AbstractContextManager:
    """The backend contract's SM reservation (see ``cute/quack_adapter.py``): a no-op here, PyTorch's kernels are
    not persistent, so a concurrent collective always finds SMs."""
    check_reservation(n, gemms)
    return contextlib.nullcontext()


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _host_counts(meta: RoutingMetadata) -> list[int]:
    return torch.diff(meta.expert_offsets).tolist()


def _grouped_mm(a_RK: torch.Tensor, b_EKN: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Varlen-M grouped GEMM: rows of expert e (a contiguous block) times b_EKN[e]."""
    out_RN = a_RK.new_empty(a_RK.shape[0], b_EKN.shape[2])
    start = 0
    for e, c in enumerate(counts):
        if c:
            torch.mm(a_RK[start : start + c], b_EKN[e], out=out_RN[start : start + c])
        start += c
    return out_RN


def _grouped_mm_varlen_k(a_RM: torch.Tensor, b_RN: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Varlen-K grouped GEMM (weight gradients): out[e] = a_e^T @ b_e, zeros for experts with no rows."""
    out_EMN = a_RM.new_zeros(len(counts), a_RM.shape[1], b_RN.shape[1])
    start = 0
    for e, c in enumerate(counts):
        if c:
            torch.mm(a_RM[start : start + c].t(), b_RN[start : start + c], out=out_EMN[e])
        start += c
    return out_EMN


def gather_sum(rows_RD: torch.Tensor, meta: RoutingMetadata, weights_R: torch.Tensor | None) -> torch.Tensor:
    """out_t = sum over token t's flat pairs j (in order) of w_j * rows[s_reverse_scatter_idx[j]], accumulated
    in fp32 (fp64 for fp64 rows). Deterministic: a segment sum in a fixed order, no atomics."""
    ct = _compute_dtype(rows_RD.dtype)
    pairs_RD = rows_RD.index_select(0, meta.s_reverse_scatter_idx.long()).to(ct)
    if weights_R is not None:
        pairs_RD = pairs_RD * weights_R.to(ct)[:, None]
    T = meta.token_offsets.numel() - 1
    pairs_RD = pairs_RD[: int(meta.token_offsets[-1])]  # padding pairs (FlatRouting.padded) lie past the last token
    if pairs_RD.shape[0] == 0:
        return rows_RD.new_zeros(T, rows_RD.shape[1])
    out_TD = torch.segment_reduce(pairs_RD, "sum", offsets=meta.token_offsets.long(), axis=0, unsafe=True)
    return out_TD.to(rows_RD.dtype)


def forward(
    x_TD: torch.Tensor,
    scores_R: torch.Tensor,
    w1_EGD: torch.Tensor,
    w2_EDF: torch.Tensor,
    meta: RoutingMetadata,
    activation: str,
    store_h: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(O [T, D], H [R, G] or None): up-projection over gathered rows, activation, down-projection,
    weighted fp32 gather-and-sum. ``store_h=False`` (inference) keeps no H."""
    counts = _host_counts(meta)
    xg_RD = x_TD.index_select(0, meta.x_gather_idx.long())
    h_RG = _grouped_mm(xg_RD, w1_EGD.transpose(1, 2), counts)
    del xg_RD
    a_RF = act_forward(activation, h_RG).to(x_TD.dtype)
    y_RD = _grouped_mm(a_RF, w2_EDF.transpose(1, 2), counts)
    del a_RF
    s_R = scores_R.detach()
    o_TD = gather_sum(y_RD, meta, s_R)
    return o_TD, (h_RG if store_h else None)


def backward_data(
    dO_TD: torch.Tensor,
    x_TD: torch.Tensor,
    h_RG: torch.Tensor,
    scores_R: torch.Tensor,
    w1_EGD: torch.Tensor,
    w2_EDF: torch.Tensor,
    meta: RoutingMetadata,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """(dX [T, D], dScores [R] fp32, (A' [R, F], dH [R, G]) for ``backward_weights``).

    dS_row = <dA', A> comes from the same pass that makes dH (SonicMoE's dH kernel), without Y."""
    counts = _host_counts(meta)
    dtype, ct = x_TD.dtype, _compute_dtype(x_TD.dtype)
    dOg_RD = dO_TD.index_select(0, meta.x_gather_idx.long())
    dAp_RF = _grouped_mm(dOg_RD, w2_EDF, counts)  # dA' = dO_e W2_e
    del dOg_RD
    s_R = scores_R.detach().to(ct).index_select(0, meta.s_scatter_idx.long())
    a_RF, dH_RG = act_forward_backward(activation, h_RG, s_R[:, None] * dAp_RF.to(ct))
    ds_rows_R = (dAp_RF.to(ct) * a_RF).sum(-1)
    del dAp_RF
    aprime_RF = (s_R[:, None] * a_RF).to(dtype)
    dH_RG = dH_RG.to(dtype)
    dxg_RD = _grouped_mm(dH_RG, w1_EGD, counts)  # dX~ = dH W1_e
    dx_TD = gather_sum(dxg_RD, meta, None)
    dscores_R = torch.empty_like(ds_rows_R, dtype=torch.float32 if ct == torch.float32 else ct)
    dscores_R.index_copy_(0, meta.s_scatter_idx.long(), ds_rows_R.to(dscores_R.dtype))
    return dx_TD, dscores_R, (aprime_RF, dH_RG)


def check_weight_grad_out(out, shapes: tuple[tuple[int, ...], tuple[int, ...]], device, dtypes=None) -> None:
    """Raise ValueError unless ``out`` is a pair of contiguous floating tensors of ``shapes`` on ``device``
    (and of one of ``dtypes`` when given): the accumulators of ``backward_weights(..., out=...)``."""
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise ValueError(f"backward_weights: out must be a pair (dW1 accumulator, dW2 accumulator), got {type(out)}")
    for name, t, shape in (("out[0] (dW1)", out[0], shapes[0]), ("out[1] (dW2)", out[1], shapes[1])):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t)
            raise ValueError(f"backward_weights: {name} must have shape {tuple(shape)}, got {got}")
        if not t.is_floating_point() or (dtypes is not None and t.dtype not in dtypes):
            raise ValueError(f"backward_weights: {name}.dtype must be one of {dtypes or 'float dtypes'}, got {t.dtype}")
        if t.device != device or not t.is_contiguous():
            raise ValueError(f"backward_weights: {name} must be contiguous on {device}, got {t.device}, {t.stride()}")


def backward_weights(
    dO_TD: torch.Tensor,
    x_TD: torch.Tensor,
    aprime_RF: torch.Tensor,
    dH_RG: torch.Tensor,
    meta: RoutingMetadata,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    accumulate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dW1 [E, G, D], dW2 [E, D, F]) as varlen-K grouped GEMMs over gathered rows of X and dO.

    ``out=(dW1_acc, dW2_acc)`` (those shapes, contiguous, any float dtype, typically fp32): the gradients are
    ADDED into these buffers, which are returned (fused accumulation: Megatron's ``main_grad``, the chunks of
    an expert-parallel backward), or with ``accumulate=False`` stored there (their old values are not read).
    Here the sum is formed in the compute dtype and added; the GPU backend adds inside its GEMM epilogue."""
    E, F = meta.num_experts, aprime_RF.shape[1]
    if out is not None:
        check_weight_grad_out(out, ((E, dH_RG.shape[1], x_TD.shape[1]), (E, x_TD.shape[1], F)), x_TD.device)
    counts = _host_counts(meta)
    gather = meta.x_gather_idx.long()
    dw2_EDF = _grouped_mm_varlen_k(dO_TD.index_select(0, gather), aprime_RF, counts)
    dw1_EGD = _grouped_mm_varlen_k(dH_RG, x_TD.index_select(0, gather), counts)
    if out is None:
        return dw1_EGD, dw2_EDF
    for acc, dw in zip(out, (dw1_EGD, dw2_EDF), strict=True):
        if accumulate:
            acc.add_(dw.to(acc.dtype))
        else:
            acc.copy_(dw)
    return out[0], out[1]
