"""Our Triton kernels (kernels/triton/) on CPU under TRITON_INTERPRET=1, against the torch backend and float64.

The interpreter flag is read when a kernel is decorated, so it is set before kernels/triton is imported; when
a GPU is present the same tests run the compiled kernels on it instead. Shapes stay tiny: the interpreter
runs each program in Python.
"""

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from sonic_megatron.kernels.routing import (  # noqa: E402
    FlatRouting,
    TopKRouting,
    compute_metadata_torch,
    flatten_routing,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _kernels():
    try:
        from sonic_megatron.kernels.triton import compute_metadata_triton, gather_sum
    except Exception as exc:  # pragma: no cover - depends on the triton build
        pytest.skip(f"triton kernels cannot be imported here: {exc}")
    return compute_metadata_triton, gather_sum


def _topk(T, K, E, gen, experts=None):
    pool = E if experts is None else experts
    idx = torch.stack([torch.randperm(pool, generator=gen)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
    return TopKRouting(torch.rand(T, K, generator=gen), idx.to(torch.int64))


def _flat(T, E, gen):
    """Variable pairs per token (0..E), tokens ascending."""
    tok, ex = [], []
    for t in range(T):
        n = int(torch.randint(0, E + 1, (1,), generator=gen))
        for e in torch.randperm(E, generator=gen)[:n].tolist():
            tok.append(t)
            ex.append(e)
    R = len(tok)
    return FlatRouting(
        torch.tensor(tok, dtype=torch.int32), torch.tensor(ex, dtype=torch.int32), torch.rand(R, generator=gen), T
    )


def _to(routing, device):
    if isinstance(routing, TopKRouting):
        return TopKRouting(routing.scores_TK.to(device), routing.indices_TK.to(device))
    return FlatRouting(
        routing.token_idx_R.to(device), routing.expert_idx_R.to(device), routing.scores_R.to(device), routing.num_tokens
    )


CASES = {
    "topk_ragged": lambda g: (_topk(37, 3, 7, g), 7),
    "empty_experts": lambda g: (_topk(20, 2, 9, g, experts=3), 9),
    "one_expert": lambda g: (_topk(25, 1, 5, g, experts=1), 5),
    "no_tokens": lambda g: (_topk(0, 2, 4, g), 4),
    "flat_variable_k": lambda g: (_flat(23, 5, g), 5),
    "many_tiles": lambda g: (_topk(300, 2, 3, g), 3),  # > 256 pairs: several tiles with one expert spanning them
}


@pytest.mark.parametrize("case", list(CASES))
def test_metadata_matches_torch(case):
    compute_metadata_triton, _ = _kernels()
    routing, E = CASES[case](torch.Generator().manual_seed(1))
    tok, ex, _, off = flatten_routing(_to(routing, DEVICE))
    got = compute_metadata_triton(tok, ex, off, E)
    want = compute_metadata_torch(tok, ex, off, E)
    for name, a, b in zip(
        ("expert_offsets", "x_gather_idx", "s_scatter_idx", "s_reverse", "tok"),
        got.tensors(),
        want.tensors(),
        strict=True,
    ):
        assert a.dtype == torch.int32, name
        assert torch.equal(a.cpu(), b.cpu()), name


@pytest.mark.parametrize("case", ["topk_ragged", "empty_experts", "one_expert", "no_tokens", "many_tiles"])
def test_metadata_topk_path_matches_flat(case):
    """Top-K metadata without the flat token index (token = pair // K): the same arrays, pairs_per_token = K."""
    from sonic_megatron.kernels.triton import compute_metadata_topk_triton

    routing, E = CASES[case](torch.Generator().manual_seed(7))
    routing = _to(routing, DEVICE)
    tok, ex, _, off = flatten_routing(routing)
    got = compute_metadata_topk_triton(routing.indices_TK, E)
    assert got.pairs_per_token == routing.indices_TK.shape[1]
    for a, b in zip(got.tensors(), compute_metadata_torch(tok, ex, off, E).tensors(), strict=True):
        assert a.dtype == b.dtype == torch.int32 and torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("params", [(64, 256, 8), (128, 128, 16)])
def test_metadata_launch_parameters_do_not_change_results(params, monkeypatch):
    """Other tile sizes of the rank kernel and blockings of the tile scan (the sweep's alternatives): same results."""
    compute_metadata_triton, _ = _kernels()
    from sonic_megatron.kernels.triton import metadata as M

    monkeypatch.setattr(M, "TILE_BLOCK", params[0])
    monkeypatch.setattr(M, "SCAN_BLOCK_T", params[1])
    monkeypatch.setattr(M, "SCAN_BLOCK_E", params[2])
    routing, E = CASES["many_tiles"](torch.Generator().manual_seed(3))
    tok, ex, _, off = flatten_routing(_to(routing, DEVICE))
    got, want = compute_metadata_triton(tok, ex, off, E), compute_metadata_torch(tok, ex, off, E)
    for a, b in zip(got.tensors(), want.tensors(), strict=True):
        assert torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("case", ["topk_ragged", "empty_experts", "no_tokens", "flat_variable_k"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weighted", [True, False])
def test_gather_sum_vs_float64(case, dtype, weighted):
    _check_gather_sum(case, dtype, weighted, D=72)  # not a power of two: masked D tail


# 1536: 2 D-blocks per program (the 2nd masked), in both dtypes; 9216: 9 blocks, 2 programs (how a row splits over
# programs does not depend on the dtype, which the smaller D covers)
@pytest.mark.parametrize(
    "D,dtype",
    [(1536, torch.bfloat16), (1536, torch.float32), (9216, torch.bfloat16)],
    ids=["1536-bf16", "1536-fp32", "9216-bf16"],
)
def test_gather_sum_vs_float64_several_blocks(D, dtype):
    _check_gather_sum("topk_ragged", dtype, True, D=D)


def _topk_meta(case, gen):
    """(meta with pairs_per_token = K as compute_metadata sets it for top-K routing, the same with 0, scores)."""
    routing, E = CASES[case](gen)
    tok, ex, scores, off = flatten_routing(_to(routing, DEVICE))
    meta = compute_metadata_torch(tok, ex, off, E)
    return dataclasses.replace(meta, pairs_per_token=routing.indices_TK.shape[1]), meta, scores


@pytest.mark.parametrize("case", ["topk_ragged", "empty_experts", "one_expert"])
def test_gather_sum_fixed_k_equals_offsets(case):
    """Top-K: the pair range computed from K gives bitwise the result of reading token_offsets at the same load width
    (the fixed-K path loads the next power of two of K pairs per step; summed in other groups, fp32 rounds
    differently, as a GPU shows at K = 3)."""
    _, gather_sum = _kernels()
    gen = torch.Generator().manual_seed(5)
    fixed, csr, scores = _topk_meta(case, gen)
    assert fixed.pairs_per_token > 0
    rows = torch.randn(csr.num_rows, 1100, generator=gen).to(DEVICE, torch.bfloat16)
    for w in (scores, None):
        a = gather_sum(rows, fixed, w)
        b = gather_sum(rows, csr, w, pairs_per_token=triton.next_power_of_2(fixed.pairs_per_token))
        assert torch.equal(a, b)


def test_gather_sum_rejects_wrong_pairs_per_token():
    _, gather_sum = _kernels()
    fixed, _, _ = _topk_meta("topk_ragged", torch.Generator().manual_seed(6))
    bad = dataclasses.replace(fixed, pairs_per_token=fixed.pairs_per_token + 1)
    with pytest.raises(ValueError, match="pairs_per_token"):
        gather_sum(torch.zeros(fixed.num_rows, 8, device=DEVICE), bad, None)


def _check_gather_sum(case, dtype, weighted, D):
    """Error vs float64 at most 2x the torch backend's (same dtype) error plus an atol scaled to |out|."""
    _, gather_sum = _kernels()
    from sonic_megatron.kernels.torch_backend import gather_sum as gather_sum_torch

    gen = torch.Generator().manual_seed(2)
    routing, E = CASES[case](gen)
    tok, ex, scores, off = flatten_routing(_to(routing, DEVICE))
    meta = compute_metadata_torch(tok, ex, off, E)
    rows = torch.randn(meta.num_rows, D, generator=gen).to(DEVICE, dtype)
    w = scores if weighted else None
    out = gather_sum(rows, meta, w, pairs_per_token=2)
    ref = gather_sum_torch(rows.double(), meta, None if w is None else w.double())
    base = gather_sum_torch(rows, meta, w)
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item() if out.numel() else 0.0
    base_err = (base.double() - ref).abs().max().item() if out.numel() else 0.0
    # One rounding of the output to its dtype (unit roundoff x |out|): a tie can flip either way.
    atol = torch.finfo(dtype).eps / 2 * (ref.abs().max().item() if ref.numel() else 0.0)
    assert err <= 2 * base_err + atol, (err, base_err)


def test_gather_sum_deterministic():
    _, gather_sum = _kernels()
    gen = torch.Generator().manual_seed(3)
    routing, E = CASES["topk_ragged"](gen)
    tok, ex, scores, off = flatten_routing(_to(routing, DEVICE))
    meta = compute_metadata_torch(tok, ex, off, E)
    rows = torch.randn(meta.num_rows, 40, generator=gen).to(DEVICE, torch.bfloat16)
    a = gather_sum(rows, meta, scores, pairs_per_token=3)
    b = gather_sum(rows, meta, scores, pairs_per_token=3)
    assert torch.equal(a, b)


def test_gather_sum_rejects_bad_input():
    _, gather_sum = _kernels()
    routing, E = CASES["topk_ragged"](torch.Generator().manual_seed(4))
    tok, ex, scores, off = flatten_routing(_to(routing, DEVICE))
    meta = compute_metadata_torch(tok, ex, off, E)
    with pytest.raises(ValueError, match="rows dtype"):
        gather_sum(torch.zeros(meta.num_rows, 8, dtype=torch.int32, device=DEVICE), meta, None)
    with pytest.raises(ValueError, match="routed pair count"):
        gather_sum(torch.randn(meta.num_rows - 1, 8, device=DEVICE), meta, None)


def test_gather_sum_reads_only_the_pairs_rows_of_a_longer_buffer():
    """Rows past the pair count (a slotted buffer, as the expert-parallel combine's) are never read."""
    _, gather_sum = _kernels()
    routing, E = CASES["topk_ragged"](torch.Generator().manual_seed(5))
    tok, ex, scores, off = flatten_routing(_to(routing, DEVICE))
    meta = compute_metadata_torch(tok, ex, off, E)
    rows = torch.randn(meta.num_rows, 8, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    longer = torch.cat([rows, torch.full((5, 8), float("nan"), device=DEVICE)])
    assert torch.equal(gather_sum(longer, meta, scores), gather_sum(rows, meta, scores))


@pytest.mark.parametrize("shape", [(37, 100), (64, 256), (5, 1)])
def test_split3_bf16_is_the_exact_three_part_split(shape):
    """One launch writes PyTorch's three bf16 parts side by side, bit for bit (round to nearest even), for values
    across fp32's range: zeros, halfway cases of the first cast, large magnitudes, and on the GPU subnormals (the
    interpreter's bit casts of subnormal values differ); a strided input."""
    from sonic_megatron.kernels.triton.bf16_split import split3_bf16

    from sonic_megatron.router_gemm import split_bf16

    T, E = shape
    g = torch.Generator().manual_seed(T * E)
    low = -130 if DEVICE == "cuda" else -90  # parts of values from 2^-90 up stay normal
    v = torch.randn(T, 2 * E, generator=g) * torch.exp2(torch.randint(low, 120, (T, 2 * E), generator=g).float())
    n = min(4, E)  # signed zeros and ties of bf16(v) (to even: 1 down, 1 + 2^-6 up) in the strided view
    v[0, : 2 * n : 2] = torch.tensor([0.0, -0.0, 1.0 + 2.0**-8, -(1.0 + 3 * 2.0**-8)])[:n]
    v_TE = v.to(DEVICE)[:, ::2]  # stride 2 along E
    got = split3_bf16(v_TE)
    want = torch.cat(split_bf16(v_TE, 3), dim=1)
    assert got.shape == (T, 3 * E) and got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    normal = v_TE.abs() >= 2.0**-100  # the parts of smaller values can fall below bf16's subnormals
    parts_sum = sum(p.double() for p in got.double().split(E, dim=1))
    assert torch.equal(parts_sum[normal], v_TE.double()[normal])  # exact
