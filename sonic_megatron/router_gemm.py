"""The router's fp32 logits (``moe_router_dtype='fp32'``) on bf16 tensor cores, within the fp32 GEMMs' error.

Shape legend: T tokens, D hidden size, E experts, K a GEMM's reduction length, C chunks of it, p operand parts.

Megatron computes fp32 router logits with fp32 GEMMs of the upcast input and weight, forward and backward
(``router_gating_linear``). On Hopper those run on the CUDA cores and, with the casts around them, take a
sizeable share of the MoE layer's time (docs/PERF.md). Here all three run on the bf16 tensor cores, with two
measures that keep every result within the fp32 GEMM's own error:

* exact operands: an fp32 tensor v splits into bf16 parts v1 = bf16(v), v2 = bf16(v - v1), v3 = bf16(v - v1 - v2)
  whose sum IS v (each holds the next 8 of fp32's 24 significand bits; bf16 has fp32's exponent range, so no
  part overflows), and a product of two bf16 values is exact in fp32. An fp32 operand becomes its p parts,
  stacked along the GEMM's M or K dimension (one GEMM);
* short accumulations: the tensor cores' fp32 accumulation truncates, so its error grows linearly with the
  reduction length, while the fp32 GEMM's grows like its square root. The reduction is cut into chunks (one
  batched GEMM, fp32 partial results) that are then summed with round-to-nearest. Unchunked, the error against
  float64 exceeds the fp32 GEMM's, most for dW, whose reduction runs over all T tokens; with chunks of 256
  (logits) and of ``wgrad_chunk(T)`` (dW: the chunk follows sqrt(T), as the fp32 GEMM's error does) it stays
  within the fp32 GEMM's error at the sizes measured. The GEMMs on the tensor cores take less time than the fp32
  ones with their casts.

    logits = x W^T      x bf16 (exact), W in 1 part (bf16, Megatron's Float16Module) or 3 (fp32), chunks of 256
    dX     = dL W       returned in bf16: dL and W in 2 parts, the terms (1,1), (1,2), (2,1) as one GEMM over a
                        K = 3E concatenation with a bf16 output (the terms left out are ~2^-16 relative, below
                        bf16's 2^-8; the result is rounded once, as Megatron rounds its fp32 dX to bf16)
    dW     = dL^T x     dL in 3 parts stacked along M, chunks of ``wgrad_chunk(T)`` (the chunks' and the parts'
                        partial results summed in one reduction), returned in W's dtype

Host time counts here (the layer's host time paces training at 8192 tokens per micro-batch, docs/PERF.md): the
GEMMs read the operands in place through strided views (the bf16 weight, dL's parts), and one Triton launch
writes dL's three parts side by side (``kernels/triton/bf16_split.py``), where PyTorch needs eight launches.

``tests/test_router_gemm.py`` checks all of them against float64 and against the fp32 GEMMs' error.
"""

from __future__ import annotations

import torch

LOGITS_CHUNK = 256  # reduction chunk of the logits GEMM (K = D)


def wgrad_chunk(num_tokens: int) -> int:
    """Reduction chunk of the weight-gradient GEMM (K = T): the power of two at or below 4 sqrt(T) in [64, 512]
    (within the fp32 GEMM's error, see the module docstring)."""
    bound = int(4 * max(num_tokens, 1) ** 0.5)
    return min(512, max(64, 1 << (bound.bit_length() - 1)))


def split_bf16(v: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """``parts`` bf16 tensors whose sum is the fp32 tensor ``v`` to 2^-(8 * parts) relative (exact for 3)."""
    out, rest = [], v.float()
    for i in range(parts):
        part = rest.to(torch.bfloat16)
        out.append(part)
        if i + 1 < parts:
            rest = rest - part.float()
    return out


def _bmm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 a @ b (batched) of bf16 operands with fp32 accumulation: cuBLAS's bf16 GEMM with fp32 output on
    CUDA, the upcast product elsewhere (exact products, fp32 sums)."""
    if a.is_cuda:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def _mm_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16 a @ b of bf16 operands, accumulated in fp32 and rounded once to bf16 (cuBLAS's bf16 GEMM on CUDA; the
    upcast product elsewhere)."""
    if a.is_cuda:
        return torch.mm(a, b)
    return (a.float() @ b.float()).to(torch.bfloat16)


def split3_side_by_side(v_TE: torch.Tensor) -> torch.Tensor:
    """[T, 3E] bf16: the 3-part split of the fp32 ``v_TE`` with the parts side by side (one Triton launch on CUDA,
    ``kernels/triton/bf16_split.py``; PyTorch ops elsewhere, the same values)."""
    if v_TE.is_cuda:
        from .kernels.triton.bf16_split import split3_bf16

        return split3_bf16(v_TE)
    return torch.cat(split_bf16(v_TE, 3), dim=1)


def chunked_mm_fp32(a_MK: torch.Tensor, b_KN: torch.Tensor, chunk: int, row_parts: int = 1) -> torch.Tensor:
    """fp32 a @ b for bf16 a [M, K] and b [K, N] (each a strided view a GEMM reads: unit stride along one of its
    dimensions): the products of each K chunk accumulated on the tensor cores, the chunks' fp32 partial results
    summed with round-to-nearest. With ``row_parts`` > 1 a's rows are that many equal blocks (the parts of a split
    operand) whose products are summed in the same reduction: the result is [M / row_parts, N]."""
    M, K = a_MK.shape
    C, rest = divmod(K, chunk)
    out = None
    if C:
        a_CMk = a_MK[:, : C * chunk].view(M, C, chunk).transpose(0, 1)
        prod_CMN = _bmm_fp32(a_CMk, b_KN[: C * chunk].view(C, chunk, -1))
        out = prod_CMN.view(C * row_parts, M // row_parts, -1).sum(0)
    if rest or not C:
        last_MN = _bmm_fp32(a_MK[:, C * chunk :].unsqueeze(0), b_KN[C * chunk :].unsqueeze(0))[0]
        last = last_MN.view(row_parts, M // row_parts, -1).sum(0) if row_parts > 1 else last_MN
        out = last if out is None else out + last
    return out


def _sum_parts(stacked: torch.Tensor, parts: int, dim: int) -> torch.Tensor:
    """Sum of the ``parts`` equal blocks of ``stacked`` along ``dim``, smallest (last) first."""
    blocks = stacked.chunk(parts, dim=dim)
    total = blocks[-1]
    for block in reversed(blocks[:-1]):
        total = total + block
    return total


class RouterLogits(torch.autograd.Function):
    """logits_TE = x_TD @ w_ED^T (+ bias_E) in fp32 (see the module docstring)."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, w_ED: torch.Tensor, bias_E: torch.Tensor | None) -> torch.Tensor:
        lead, D = x_TD.shape[:-1], x_TD.shape[-1]
        x2_TD = x_TD.reshape(-1, D)
        if w_ED.dtype == torch.bfloat16:  # read in place: the GEMM takes the transposed view
            logits_TE = chunked_mm_fp32(x2_TD, w_ED.t(), LOGITS_CHUNK)
        else:
            w_DP = torch.cat(split_bf16(w_ED, 3), dim=0).t()  # [D, 3E]
            logits_TE = _sum_parts(chunked_mm_fp32(x2_TD, w_DP, LOGITS_CHUNK), 3, dim=1)
        if bias_E is not None:
            logits_TE = logits_TE + bias_E.float()
        ctx.save_for_backward(x2_TD, w_ED)
        ctx.has_bias, ctx.lead = bias_E is not None, lead
        return logits_TE.reshape(*lead, -1)

    @staticmethod
    def backward(ctx, dlogits: torch.Tensor):
        x2_TD, w_ED = ctx.saved_tensors
        E = w_ED.shape[0]
        dl_TE = dlogits.reshape(-1, E).float()
        dl_TP = split3_side_by_side(dl_TE)  # [dl1 | dl2 | dl3], [T, 3E]
        dx = dw = dbias = None
        if ctx.needs_input_grad[0]:
            # the 2-part split of dL is the 3-part split's first two parts
            if w_ED.dtype == torch.bfloat16:
                a_TK, b_KD = dl_TP[:, : 2 * E], torch.cat([w_ED, w_ED], dim=0)
            else:
                dl1, dl2 = dl_TP[:, :E], dl_TP[:, E : 2 * E]
                w1, w2 = split_bf16(w_ED, 2)
                a_TK, b_KD = torch.cat([dl1, dl1, dl2], dim=1), torch.cat([w1, w2, w1], dim=0)
            dx = _mm_bf16(a_TK, b_KD).reshape(*ctx.lead, x2_TD.shape[1])
        if ctx.needs_input_grad[1]:
            chunk = wgrad_chunk(x2_TD.shape[0])
            dw = chunked_mm_fp32(dl_TP.t(), x2_TD.contiguous(), chunk, row_parts=3).to(w_ED.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            dbias = dl_TE.sum(0)
        return dx, dw, dbias


def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``x @ weight^T + bias`` for a bf16 ``x`` and a bf16 or fp32 ``weight`` (see the module docstring)."""
    return RouterLogits.apply(x, weight, bias)


def unsupported_reason(x: torch.Tensor, weight: torch.Tensor, router_dtype: str | None) -> str | None:
    """None when ``router_logits`` computes this router's logits, else why Megatron's ``router_gating_linear``
    does."""
    if router_dtype != "fp32":
        return f"moe_router_dtype={router_dtype!r} (tensor-core path: 'fp32')"
    if x.dtype != torch.bfloat16:
        return f"input dtype {x.dtype} (tensor-core path: bfloat16; fp16 parts would overflow)"
    if weight.dtype not in (torch.bfloat16, torch.float32):
        return f"router weight dtype {weight.dtype} (tensor-core path: bfloat16 or float32)"
    if not x.is_cuda or weight.device != x.device:
        return "input and router weight not on the same CUDA device"
    return None
