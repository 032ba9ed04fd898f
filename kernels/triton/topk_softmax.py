"""Fused router top-K + softmax: one forward launch, one backward launch (the router side of SonicMoE).

Shape legend: see ``kernels/routing.py`` (T tokens, E experts, K experts per token).

    indices_TK[t] = the K largest logits_TE[t], in descending logit order; ties: the lower expert first
    scores_TK[t]  = softmax(logits_TE[t, indices_TK[t]]) in fp32
    dlogits_TE    = softmax backward over the K selected entries of each row, zero elsewhere

``torch.topk`` followed by a softmax costs two launches, an intermediate [T, K] tensor and, in backward,
zeros + scatter; this file does each direction in one memory-bound pass. Stack (QuACK style): Triton
kernels -> host wrappers -> ``TopKSoftmaxFunction`` -> ``topk_softmax``; ``topk_softmax_reference`` is the
PyTorch definition the tests compare against (and the fallback off CUDA when the interpreter is off).

How the forward selects: each program owns BLOCK_T rows, padded along E to a power of two. Every logit
becomes one integer key that orders like the logit and carries its column in the low bits (inverted, so
that of equal logits the lower column has the larger key). Then K times: the row max of the keys is the
next winner (value and column decode from it: one reduction per step, no separate argmax), and that key
is replaced by a sentinel below every real key. Keys:
    fp32 bits b -> ordered o = b ^ 0x7FFFFFFF if b < 0 else b (signed integer order == float order);
    -0.0 is first mapped to +0.0 (they compare equal) and every NaN to +qNaN (ranked above +inf, as
    ``torch.sort`` / ``torch.topk`` rank NaN; its scores are NaN).
    fp16/bf16: the fp32 upcast has its 13 low mantissa bits zero, so the column fits there: an int32 key.
    fp32: o is shifted left by 13 bits into an int64 key.
No atomics and a fixed reduction order: two runs are bitwise equal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_EXPERTS = 4096  # one row's keys live in registers; the key's column field has 13 bits (up to 8191)


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output is allocated here (uninitialized): the tests replace it with a poisoning allocator."""
    return torch.empty(*shape, dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------------- reference
def topk_softmax_reference(logits_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: a stable descending sort (ties: lower expert first; NaN first, as torch ranks it),
    the first k, softmax in fp32 (or in float64 for float64 logits). Differentiable through autograd."""
    top_TK, idx_TK = torch.sort(logits_TE, dim=-1, descending=True, stable=True)
    top_TK, idx_TK = top_TK[:, :k], idx_TK[:, :k]
    return torch.softmax(top_TK.to(torch.promote_types(top_TK.dtype, torch.float32)), dim=-1), idx_TK


# ------------------------------------------------------------------------------------------------ kernels
@triton.jit
def _topk_softmax_fwd_kernel(
    logits_ptr,
    scores_ptr,
    indices_ptr,
    T,
    E,
    stride_logits,
    K,
    IS_BF16: tl.constexpr,
    KEY64: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    LOW: tl.constexpr = (1 << 13) - 1  # the key's column field: 13 bits
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    valid = row_ok[:, None] & (cols[None, :] < E)
    x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_logits + cols[None, :], mask=valid, other=0.0)
    # fp32 bits, then integer ops only: float compares and converts may flush subnormals to zero
    if IS_BF16:  # noqa: SIM108  (constexpr branches read better in a kernel)
        bits = x.to(tl.int16, bitcast=True).to(tl.int32) << 16  # bf16 is the top half of an fp32
    else:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    bits = tl.where(bits == -(1 << 31), 0, bits)  # -0.0 == +0.0: same key, so the lower column wins the tie
    bits = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC00000, bits)  # every NaN -> +qNaN, above +inf
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    if KEY64:
        key = (ordered.to(tl.int64) << 13) | (LOW - cols[None, :]).to(tl.int64)
        sentinel = -(1 << 63)
    else:
        key = (ordered & ~LOW) | (LOW - cols[None, :])
        sentinel = -(1 << 31)
    # below every real key (the lowest real key is -inf's, > sentinel): padding and taken entries
    key = tl.where(valid, key, sentinel)

    kcols = tl.arange(0, BLOCK_K)
    top = tl.full([BLOCK_T, BLOCK_K], sentinel, key.dtype)
    for i in range(K):
        best = tl.max(key, axis=1)
        key = tl.where(key == best[:, None], sentinel, key)  # keys are unique per row: exactly one entry
        top = tl.where(kcols[None, :] == i, best[:, None], top)

    idx = (LOW - (top & LOW)).to(tl.int32)
    if KEY64:
        o = (top >> 13).to(tl.int32)
        vbits = tl.where(o < 0, o ^ 0x7FFFFFFF, o)
    else:
        o = top & ~LOW
        vbits = tl.where(o < 0, (o | LOW) ^ 0x7FFFFFFF, o)  # the low bits of the value were zero
    k_ok = kcols[None, :] < K
    val = tl.where(k_ok, vbits.to(tl.float32, bitcast=True), float("-inf"))
    row_max = tl.max(val, axis=1)  # == the first winner
    p = tl.exp(val - row_max[:, None])
    p = tl.where(k_ok, p, 0.0)
    denom = tl.broadcast_to(tl.sum(p, axis=1)[:, None], [BLOCK_T, BLOCK_K])
    scores = tl.math.div_rn(p, denom)  # IEEE division: `/` on fp32 is an approximate one on NVIDIA GPUs
    out_off = rows.to(tl.int64)[:, None] * K + kcols[None, :]
    out_mask = row_ok[:, None] & k_ok
    tl.store(scores_ptr + out_off, scores, mask=out_mask)
    tl.store(indices_ptr + out_off, idx.to(tl.int64), mask=out_mask)


@triton.jit
def _topk_softmax_bwd_kernel(
    dscores_ptr,
    scores_ptr,
    indices_ptr,
    dlogits_ptr,
    T,
    E,
    K,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """dlogits[t, idx[t, j]] = s_j (g_j - sum_i s_i g_i); every other entry of the row is written 0."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    kcols = tl.arange(0, BLOCK_K)
    k_mask = row_ok[:, None] & (kcols[None, :] < K)
    tk_off = rows64[:, None] * K + kcols[None, :]
    s = tl.load(scores_ptr + tk_off, mask=k_mask, other=0.0)
    g = tl.load(dscores_ptr + tk_off, mask=k_mask, other=0.0).to(tl.float32)
    dot = tl.sum(s * g, axis=1)

    cols = tl.arange(0, BLOCK_E)
    dense = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for j in range(K):
        # column j again, from L1/L2 (just loaded as a tile): a register tile has no cheap column slice
        s_j = tl.load(scores_ptr + rows64 * K + j, mask=row_ok, other=0.0)
        g_j = tl.load(dscores_ptr + rows64 * K + j, mask=row_ok, other=0.0).to(tl.float32)
        e_j = tl.load(indices_ptr + rows64 * K + j, mask=row_ok, other=-1).to(tl.int32)
        dense = tl.where(cols[None, :] == e_j[:, None], (s_j * (g_j - dot))[:, None], dense)
    out_mask = row_ok[:, None] & (cols[None, :] < E)
    tl.store(dlogits_ptr + rows64[:, None] * E + cols[None, :], dense.to(dlogits_ptr.dtype.element_ty), mask=out_mask)


# -------------------------------------------------------------------------------------------- host side
def _blocking(E: int, k: int, rows_per_program: int | None) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_E, BLOCK_K, num_warps): about 2048 padded elements per program (E=64: 32 rows)."""
    block_e = triton.next_power_of_2(E)
    block_k = triton.next_power_of_2(k)
    if rows_per_program is None:
        block_t = max(1, min(128, 2048 // block_e))
    else:
        if rows_per_program < 1 or rows_per_program & (rows_per_program - 1):
            raise ValueError(f"topk_softmax: rows_per_program must be a power of two >= 1, got {rows_per_program}")
        block_t = rows_per_program
    num_warps = 8 if block_t * block_e >= 4096 else 4
    return block_t, block_e, block_k, num_warps


def _check(logits_TE: torch.Tensor, k: int) -> None:
    if not isinstance(logits_TE, torch.Tensor):
        raise ValueError(f"topk_softmax: logits_TE must be a torch.Tensor, got {type(logits_TE).__name__}")
    if logits_TE.dim() != 2:
        raise ValueError(f"topk_softmax: logits_TE must be 2-D [T, E], got shape {tuple(logits_TE.shape)}")
    if logits_TE.dtype not in _DTYPES:
        raise ValueError(f"topk_softmax: logits_TE dtype must be one of {_DTYPES}, got {logits_TE.dtype}")
    E = logits_TE.shape[1]
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"topk_softmax: logits_TE.shape[1] (E) must be in [1, {MAX_EXPERTS}], got {E}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= E:
        raise ValueError(f"topk_softmax: k must be an int in [1, E={E}], got {k!r}")


def topk_softmax_fwd(
    logits_TE: torch.Tensor, k: int, *, rows_per_program: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of the forward kernel (no autograd): (scores_TK fp32, indices_TK int64).

    Args:
        logits_TE: [T, E] bf16/fp16/fp32 router logits (rows with unit stride along E; copied otherwise).
        k: experts per token, 1 <= k <= E.
        rows_per_program: rows each program owns (a power of two); None picks about 2048 padded elements
            per program. Any value is correct, this only tunes speed.
    """
    _check(logits_TE, k)
    if logits_TE.stride(1) != 1:
        logits_TE = logits_TE.contiguous()
    T, E = logits_TE.shape
    scores_TK = _empty(T, k, dtype=torch.float32, device=logits_TE.device)
    indices_TK = _empty(T, k, dtype=torch.int64, device=logits_TE.device)
    if T == 0:
        return scores_TK, indices_TK
    block_t, block_e, block_k, num_warps = _blocking(E, k, rows_per_program)
    _topk_softmax_fwd_kernel[(triton.cdiv(T, block_t),)](
        logits_TE,
        scores_TK,
        indices_TK,
        T,
        E,
        logits_TE.stride(0),
        k,
        IS_BF16=logits_TE.dtype == torch.bfloat16,
        KEY64=logits_TE.dtype == torch.float32,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )
    return scores_TK, indices_TK


def topk_softmax_bwd(
    dscores_TK: torch.Tensor,
    scores_TK: torch.Tensor,
    indices_TK: torch.Tensor,
    num_experts: int,
    dtype: torch.dtype,
    *,
    rows_per_program: int | None = None,
) -> torch.Tensor:
    """One launch of the backward kernel: dense dlogits [T, num_experts] in ``dtype``, every element written.

    Args:
        dscores_TK: upstream gradient of the scores [T, K] (any float dtype, read as fp32).
        scores_TK: the forward's fp32 scores [T, K].
        indices_TK: the forward's int64 indices [T, K] (distinct per row, in [0, num_experts)).
        num_experts: E, the column count of the logits.
        dtype: the logits' dtype (that of the returned gradient).
        rows_per_program: as in ``topk_softmax_fwd``.
    """
    T, k = scores_TK.shape
    if dscores_TK.shape != scores_TK.shape:
        raise ValueError(f"topk_softmax: grad of scores must have shape {tuple(scores_TK.shape)}, got "
                         f"{tuple(dscores_TK.shape)}")  # fmt: skip
    dscores_TK = dscores_TK.contiguous()
    dlogits_TE = _empty(T, num_experts, dtype=dtype, device=scores_TK.device)
    if T == 0:
        return dlogits_TE
    block_t, block_e, block_k, num_warps = _blocking(num_experts, k, rows_per_program)
    _topk_softmax_bwd_kernel[(triton.cdiv(T, block_t),)](
        dscores_TK,
        scores_TK.contiguous(),
        indices_TK.contiguous(),
        dlogits_TE,
        T,
        num_experts,
        k,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )
    return dlogits_TE


class TopKSoftmaxFunction(torch.autograd.Function):
    """Autograd over the two kernels; saves the fp32 scores and int64 indices ([T, K] each), not the logits."""

    @staticmethod
    def forward(ctx, logits_TE: torch.Tensor, k: int):
        scores_TK, indices_TK = topk_softmax_fwd(logits_TE, k)
        ctx.save_for_backward(scores_TK, indices_TK)
        ctx.num_experts, ctx.logits_dtype = logits_TE.shape[1], logits_TE.dtype
        ctx.mark_non_differentiable(indices_TK)
        return scores_TK, indices_TK

    @staticmethod
    def backward(ctx, dscores_TK: torch.Tensor, _dindices):
        scores_TK, indices_TK = ctx.saved_tensors
        return topk_softmax_bwd(dscores_TK, scores_TK, indices_TK, ctx.num_experts, ctx.logits_dtype), None


def _kernel_runs_on(device: torch.device) -> bool:
    """CUDA tensors always; CPU tensors only under the Triton interpreter (the flag is read at decoration,
    so the kernel object says whether it is interpreted)."""
    if device.type == "cuda":
        return True
    return type(_topk_softmax_fwd_kernel).__name__ == "InterpretedFunction"


def topk_softmax(logits_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router top-K + softmax in one launch (and one in backward).

    Args:
        logits_TE: [T, E] router logits, bf16/fp16/fp32, T >= 0, 1 <= E <= 4096.
        k: experts per token, 1 <= k <= E.

    Returns:
        scores_TK: [T, k] fp32, softmax over the k selected logits (differentiable w.r.t. ``logits_TE``;
            the gradient is dense [T, E] in the logits' dtype, zero off the selected entries).
        indices_TK: [T, k] int64, the selected experts in descending logit order (ties: lower expert
            first; NaN ranks above +inf as in ``torch.topk``); no gradient.

    Off CUDA the PyTorch reference runs instead, unless the Triton interpreter is on (TRITON_INTERPRET=1
    before this module is imported), in which case the kernels run on CPU.
    """
    _check(logits_TE, k)
    if not _kernel_runs_on(logits_TE.device):
        scores_TK, indices_TK = topk_softmax_reference(logits_TE, k)
        return scores_TK, indices_TK
    return TopKSoftmaxFunction.apply(logits_TE, k)
