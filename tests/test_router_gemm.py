"""The router's fp32 logits on bf16 tensor cores (sonic_megatron/router_gemm.py): the bf16 split of fp32 values, the
chunked reduction (full chunks and a remainder), and logits, dX, dW and dbias against float64 within 2x the error
of the fp32 GEMMs Megatron runs (its ``router_gating_linear``, dX then cast to bf16), for bf16 and fp32 router
weights and the production hidden size; on CPU the GEMMs are upcast products (the same arithmetic as Megatron's),
on a GPU cuBLAS's bf16 GEMMs with fp32 accumulation. SonicRouter takes this path on CUDA only."""

from __future__ import annotations

import pytest
import torch

from sonic_megatron.router_gemm import router_logits, split_bf16, unsupported_reason

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def test_split_bf16_residual_bounds():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-60, 60, (4096,), generator=g).float())
    v64 = v.double()
    for parts, bound in ((1, 2.0**-8), (2, 2.0**-16), (3, 0.0)):  # 3 x 8 bits hold fp32's 24: exact
        pieces = split_bf16(v, parts)
        assert all(p.dtype == torch.bfloat16 for p in pieces)
        err = (v64 - sum(p.double() for p in pieces)).abs()
        assert bool((err <= bound * v64.abs()).all()), (parts, float((err / v64.abs()).max()))


@pytest.mark.parametrize("K", [1, 37, 256, 700, 1024])
def test_chunked_mm_matches_float64_sum(K):
    from sonic_megatron.router_gemm import chunked_mm_fp32

    g = torch.Generator().manual_seed(K)
    a = torch.randn(5, K, generator=g).bfloat16()
    b = torch.randn(K, 3, generator=g).bfloat16()
    # fp32 sums of K products of magnitude ~1: a few ulps of |sum| ~ sqrt(K)
    torch.testing.assert_close(chunked_mm_fp32(a, b, 256).double(), a.double() @ b.double(), rtol=1e-5, atol=1e-6 * K)


@pytest.mark.parametrize("K", [37, 700])
def test_chunked_mm_sums_row_parts_of_strided_operands(K):
    """a given as a transposed view (the GEMM reads it in place) whose rows are 3 stacked parts: one reduction over
    the chunks and the parts gives the sum of the parts' products."""
    from sonic_megatron.router_gemm import chunked_mm_fp32

    g = torch.Generator().manual_seed(K)
    a_KM = torch.randn(K, 3 * 5, generator=g).bfloat16()  # a = a_KM^T: [3 parts x 5 rows, K]
    b_KN = torch.randn(K, 4, generator=g).bfloat16()
    got = chunked_mm_fp32(a_KM.t(), b_KN, 256, row_parts=3)
    want = sum((a_KM.double().t() @ b_KN.double()).split(5, dim=0))
    assert got.shape == (5, 4)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=3e-6 * K)


def _errors(fn, x, w, b, dl):
    """(logits, dx, dw, dbias) errors of ``fn`` against float64."""
    outs = []
    for dtype_x, dtype_w in ((None, None), (torch.float64, torch.float64)):
        xi = (x if dtype_x is None else x.to(dtype_x)).detach().requires_grad_()
        wi = (w if dtype_w is None else w.to(dtype_w)).detach().requires_grad_()
        bi = (b if dtype_w is None else b.to(dtype_w)).detach().requires_grad_()
        y = fn(xi, wi, bi) if dtype_x is None else xi @ wi.t() + bi
        y.backward(dl.to(y.dtype))
        outs.append([y, xi.grad, wi.grad, bi.grad])
    return [(a.double() - r).abs().max().item() for a, r in zip(*outs, strict=True)]


def _megatron_fp32(x, w, b):
    """Megatron's router_gating_linear without Transformer Engine: fp32 GEMMs of the upcast operands (the input
    gradient cast back to the input's dtype)."""
    return _MegatronFP32.apply(x, w, b)


class _MegatronFP32(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return torch.addmm(b.float(), x.float(), w.float().t())

    @staticmethod
    def backward(ctx, dl):
        x, w = ctx.saved_tensors
        dl = dl.float()
        return (dl @ w.float()).to(x.dtype), (dl.t() @ x.float()).to(w.dtype), dl.sum(0).to(w.dtype)


SHAPES = [(512, 256, 64), (37, 96, 5), (1100, 300, 8), (1024, 2048, 128)]
# The largest: the only one whose weight-gradient chunk is 256 (wgrad_chunk), with fp32 weights, whose dW is not
# rounded to bf16 at the end; the weight dtype changes the logits GEMM, which the shapes above check at D = 2048.
LARGEST = ((4096, 2048, 256), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "shape,weight_dtype",
    [(s, dt) for s in SHAPES for dt in (torch.bfloat16, torch.float32)] + [LARGEST],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v).removeprefix("torch."),
)
def test_router_logits_within_fp32_gemm_error(device, weight_dtype, shape):
    T, D, E = shape
    g = torch.Generator().manual_seed(T + D + E)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16).to(device)
    w = (torch.randn(E, D, generator=g) * 0.02).to(weight_dtype).to(device)
    b = (torch.randn(E, generator=g) * 0.1).to(weight_dtype).to(device)
    dl = torch.randn(T, E, generator=g, dtype=torch.float64).to(device)
    ours = _errors(router_logits, x, w, b, dl)
    ref = _errors(_megatron_fp32, x, w, b, dl)
    for name, e_ours, e_ref, ref_out in zip(("logits", "dx", "dw", "dbias"), ours, ref, (x, x, w, b), strict=True):
        atol = 1e-7 * max(1.0, float(ref_out.float().abs().max()))
        assert e_ours <= 2 * e_ref + atol, (name, e_ours, e_ref)


def test_router_logits_keeps_leading_dims_and_dtypes():
    x = torch.randn(6, 3, 32).to(torch.bfloat16).requires_grad_()
    w = torch.randn(8, 32, requires_grad=True)
    y = router_logits(x, w, None)
    assert y.shape == (6, 3, 8) and y.dtype == torch.float32
    y.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and x.grad.shape == x.shape and w.grad.dtype == torch.float32


def test_unsupported_reasons_name_the_option():
    x, w = torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(3, 4)
    assert "moe_router_dtype" in unsupported_reason(x, w, None)
    assert "moe_router_dtype" in unsupported_reason(x, w, "fp64")
    assert "input dtype" in unsupported_reason(x.half(), w, "fp32")
    assert "weight dtype" in unsupported_reason(x, w.double(), "fp32")
    assert "CUDA" in unsupported_reason(x, w, "fp32")  # the CPU keeps Megatron's gating


@pytest.mark.gpu
def test_sonic_router_gating_on_cuda_matches_topk_router():
    from megatron.core.transformer.moe.router import TopKRouter

    from sonic_megatron.megatron_compat import default_pg_collection
    from sonic_megatron.router import SonicRouter
    from sonic_megatron.testing import init_distributed, init_model_parallel, moe_config

    if not torch.distributed.is_initialized():
        from sonic_megatron.testing import free_port

        init_distributed(0, 1, port=free_port())
    init_model_parallel(ep=1)
    cfg = moe_config(hidden_size=256, num_moe_experts=64, moe_router_topk=4, moe_router_dtype="fp32")
    pgs = default_pg_collection()
    ours, ref = (cls(config=cfg, pg_collection=pgs).cuda().bfloat16() for cls in (SonicRouter, TopKRouter))
    with torch.no_grad():
        ref.weight.copy_(ours.weight)
    x = torch.randn(128, 4, 256, device="cuda", dtype=torch.bfloat16)
    assert unsupported_reason(x, ours.weight, "fp32") is None
    y_ours, y_ref = ours.gating(x), ref.gating(x)
    assert y_ours.dtype == y_ref.dtype == torch.float32
    torch.testing.assert_close(y_ours, y_ref, rtol=1e-5, atol=1e-5)
