"""Exact bf16 splits of an fp32 matrix in one launch (the fp32 router GEMMs of ``sonic_megatron/router_gemm.py``).

Shape legend: T rows, E columns, P = 3 parts side by side.

    parts_TP[t, p * E + e] = part p of v[t, e]:  v1 = bf16(v),  v2 = bf16(v - v1),  v3 = bf16(v - v1 - v2)

Their sum is v exactly where the parts stay normal (each holds the next 8 of fp32's 24 significand bits); each part is
v's remainder rounded to nearest even on its bits, as PyTorch's cast rounds (Triton's interpreter truncates). In
PyTorch the three parts take seven launches and laying them side by side an eighth; here one memory-bound pass writes
the layout the GEMMs read: the first 2E columns are the 2-part split, and the transposed view is the 3E x T operand of
the weight gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _bf16_rne(x):
    """bf16(x) as fp32: round to nearest even on the bits (the interpreter's casts truncate); NaN stays NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded)


@triton.jit
def _split3_kernel(v_ptr, out_ptr, T, E, stride_v, BT: tl.constexpr, BE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    ok = (t < T)[:, None] & (e < E)[None, :]
    v = tl.load(v_ptr + t[:, None] * stride_v + e[None, :], mask=ok, other=0.0)
    p1 = _bf16_rne(v)
    rest = v - p1  # exact: v and p1 share their top 8 significand bits
    p2 = _bf16_rne(rest)
    p3 = _bf16_rne(rest - p2)
    out = out_ptr + t[:, None] * (3 * E) + e[None, :]
    # The parts are bf16 values: their casts are exact under any rounding.
    tl.store(out, p1.to(tl.bfloat16), mask=ok)
    tl.store(out + E, p2.to(tl.bfloat16), mask=ok)
    tl.store(out + 2 * E, p3.to(tl.bfloat16), mask=ok)


def split3_bf16(v_TE: torch.Tensor) -> torch.Tensor:
    """[T, 3E] bf16: the three exact bf16 parts of the fp32 ``v_TE`` [T, E] side by side (see the module docstring).
    ``v_TE`` needs unit stride along E."""
    if v_TE.dtype != torch.float32 or v_TE.dim() != 2:
        raise ValueError(f"split3_bf16: v must be a 2-D fp32 tensor, got {v_TE.dtype} of shape {tuple(v_TE.shape)}")
    if v_TE.shape[1] > 1 and v_TE.stride(1) != 1:
        v_TE = v_TE.contiguous()
    T, E = v_TE.shape
    out_TP = torch.empty(T, 3 * E, dtype=torch.bfloat16, device=v_TE.device)
    if T == 0 or E == 0:
        return out_TP
    be = min(triton.next_power_of_2(E), 256)
    bt = max(1, 4096 // be)
    _split3_kernel[(triton.cdiv(T, bt), triton.cdiv(E, be))](v_TE, out_TP, T, E, v_TE.stride(0), BT=bt, BE=be)
    return out_TP
