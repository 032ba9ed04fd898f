"""The router's dense probabilities for two readers, whose gradients meet inside one softmax backward.

Shape legend: T tokens, E experts.

    probs_TE   = softmax(logits_TE) in fp32, returned twice (the second a view of the first)
    dlogits_TE = probs_TE * (g_TE - sum_e(probs_TE * g_TE)),  g_TE = g_a_TE + g_b_TE

With token rounding the router's dense probabilities have two readers: Megatron's auxiliary losses and the
rounding (which ranks added pairs by them and gives them as scores). One tensor read twice gets one gradient:
autograd first adds the two ([T, E] fp32: a full read and write) and the softmax backward then reads the sum.
Here each reader gets its own output, so the backward receives both gradients and adds them on the way into
the softmax backward: one launch, no [T, E] sum. Either gradient may be strided (the aux loss's is usually an
expanded [E] row) or absent.

Stack: Triton kernel -> host wrapper ``shared_softmax_bwd`` -> ``SharedSoftmaxFunction`` -> ``shared_softmax``;
off CUDA (unless the Triton interpreter is on) the backward is the PyTorch expression above. The kernel sums
each row in a fixed order: two runs are bitwise equal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .topk_softmax import _kernel_runs_on  # CUDA, or CPU under the Triton interpreter

_ROWS = 8  # rows per program (fewer for wide rows, see shared_softmax_bwd)


@triton.jit
def _shared_softmax_bwd_kernel(
    probs_ptr,
    ga_ptr,
    gb_ptr,
    out_ptr,
    T,
    E,
    stride_ga_t,
    stride_ga_e,
    stride_gb_t,
    stride_gb_e,
    HAS_A: tl.constexpr,
    HAS_B: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    ok = (t < T)[:, None] & (e < E)[None, :]
    p = tl.load(probs_ptr + t[:, None] * E + e[None, :], mask=ok, other=0.0)
    g = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    if HAS_A:
        g += tl.load(ga_ptr + t[:, None] * stride_ga_t + e[None, :] * stride_ga_e, mask=ok, other=0.0).to(tl.float32)
    if HAS_B:
        g += tl.load(gb_ptr + t[:, None] * stride_gb_t + e[None, :] * stride_gb_e, mask=ok, other=0.0).to(tl.float32)
    dot = tl.sum(p * g, axis=1)
    out = p * (g - dot[:, None])
    tl.store(out_ptr + t[:, None] * E + e[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


def shared_softmax_bwd(
    probs_TE: torch.Tensor, g_a_TE: torch.Tensor | None, g_b_TE: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """dlogits [T, E] in ``dtype`` from the fp32 probabilities and the two readers' gradients (None: absent)."""
    T, E = probs_TE.shape
    if not _kernel_runs_on(probs_TE.device) or E > 8192:
        g_TE = g_a_TE if g_b_TE is None else (g_b_TE if g_a_TE is None else g_a_TE + g_b_TE)
        g_TE = g_TE.float()
        return (probs_TE * (g_TE - (probs_TE * g_TE).sum(-1, keepdim=True))).to(dtype)
    out_TE = torch.empty(T, E, dtype=dtype, device=probs_TE.device)
    if T == 0:
        return out_TE
    a = g_a_TE if g_a_TE is not None else probs_TE  # a dummy pointer when absent
    b = g_b_TE if g_b_TE is not None else probs_TE
    block_e = triton.next_power_of_2(E)
    rows = max(1, min(_ROWS, 2048 // block_e))
    _shared_softmax_bwd_kernel[(triton.cdiv(T, rows),)](
        probs_TE,
        a,
        b,
        out_TE,
        T,
        E,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        HAS_A=g_a_TE is not None,
        HAS_B=g_b_TE is not None,
        BLOCK_T=rows,
        BLOCK_E=block_e,
    )
    return out_TE


class SharedSoftmaxFunction(torch.autograd.Function):
    """softmax(logits) in fp32 as two outputs (the second a view of the first); saves the probabilities."""

    @staticmethod
    def forward(ctx, logits_TE: torch.Tensor):
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        ctx.save_for_backward(probs_TE)
        ctx.logits_dtype = logits_TE.dtype
        ctx.set_materialize_grads(False)  # a reader that reached no loss sends None, not [T, E] zeros
        return probs_TE, probs_TE.view_as(probs_TE)

    @staticmethod
    def backward(ctx, g_a_TE, g_b_TE):
        if g_a_TE is None and g_b_TE is None:
            return None
        (probs_TE,) = ctx.saved_tensors
        return shared_softmax_bwd(probs_TE, g_a_TE, g_b_TE, ctx.logits_dtype)


def shared_softmax(logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs_TE, probs_TE again): softmax over the last dimension of 2-D logits in fp32, for two readers.

    Both outputs hold the same values (the second is a view of the first: neither may be modified in place);
    their gradients reach ``logits_TE`` through one fused softmax backward (see the module docstring).
    """
    if logits_TE.dim() != 2:
        raise ValueError(f"shared_softmax: logits must be 2-D [T, E], got shape {tuple(logits_TE.shape)}")
    return SharedSoftmaxFunction.apply(logits_TE)
