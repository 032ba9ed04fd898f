"""The fused router top-K + softmax (kernels/triton/topk_softmax.py) against its float64 reference.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (set before kernels/triton is imported, as in
tests/test_triton_interpret.py); with a GPU the same tests run the compiled kernels. Outputs come from a
poisoning allocator (NaN / -7), so an element a kernel forgets to write fails the comparison.
Shape legend: T tokens, E experts, K experts per token.
"""

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# numpy's warnings from the interpreter's padded rows (never stored) and NaN inputs
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


@pytest.fixture
def ts(monkeypatch):
    """The module, with every output allocated poisoned."""
    try:
        # the package's attribute ``topk_softmax`` is the function; the module is this one
        mod = importlib.import_module("sonic_megatron.kernels.triton.topk_softmax")
    except Exception as exc:  # pragma: no cover - depends on the triton build
        pytest.skip(f"triton kernels cannot be imported here: {exc}")

    def poisoned(*shape, dtype, device):
        fill = float("nan") if dtype.is_floating_point else -7
        return torch.full(shape, fill, dtype=dtype, device=device)

    monkeypatch.setattr(mod, "_empty", poisoned)
    return mod


def _logits(T, E, dtype, seed):
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _ref64(logits_TE, k):
    """Scores, indices and the float64 autograd graph's input."""
    x64 = logits_TE.detach().double().requires_grad_(True)
    return (*_ref(x64, k), x64)


def _ref(x, k):
    from sonic_megatron.kernels.triton.topk_softmax import topk_softmax_reference

    return topk_softmax_reference(x, k)


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


# (T, E, K): T = 0 / 1 / not a multiple of the row block (E=40 -> 32 rows per program), k = 1, k = E,
# E not a power of two, E = 128 / 256, E = 1
SHAPES = [(37, 40, 8), (1, 6, 2), (0, 8, 2), (5, 96, 1), (9, 6, 6), (70, 128, 8), (6, 256, 16), (3, 1, 1)]
ALL_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
CASES = [(s, torch.bfloat16) for s in SHAPES] + [(s, d) for s in SHAPES[:2] for d in ALL_DTYPES[1:]]


@pytest.mark.parametrize(("shape", "dtype"), CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_forward_vs_float64(ts, shape, dtype):
    T, E, k = shape
    x = _logits(T, E, dtype, seed=T * 1000 + E + k)
    scores, idx = ts.topk_softmax(x, k)
    ref_scores, ref_idx, _ = _ref64(x, k)
    assert scores.shape == (T, k) and scores.dtype == torch.float32 and scores.device == x.device
    assert idx.shape == (T, k) and idx.dtype == torch.int64 and not idx.requires_grad
    # same tie rule on the same values: equal even where logits tie (bf16 randn rows of 256 do)
    assert torch.equal(idx.cpu(), ref_idx.cpu())
    assert torch.isfinite(scores).all()
    base = torch.softmax(x.topk(k, dim=-1).values.float(), dim=-1)  # torch in the same precision
    err, base_err = _max_err(scores, ref_scores), _max_err(base, ref_scores)
    assert err <= 2 * base_err + torch.finfo(torch.float32).eps, (err, base_err)  # scores <= 1


@pytest.mark.parametrize(("shape", "dtype"), CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_backward_vs_float64(ts, shape, dtype):
    T, E, k = shape
    x = _logits(T, E, dtype, seed=T * 1000 + E + k + 1).requires_grad_(True)
    g = torch.randn(T, k, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    scores, _ = ts.topk_softmax(x, k)
    assert scores.grad_fn is not None and "TopKSoftmax" in type(scores.grad_fn).__name__
    (dx,) = torch.autograd.grad(scores, x, g)
    ref_scores, _, x64 = _ref64(x, k)
    (ref_dx,) = torch.autograd.grad(ref_scores, x64, g.double())
    xb = x.detach().requires_grad_(True)
    (base_dx,) = torch.autograd.grad(torch.softmax(xb.topk(k, dim=-1).values.float(), dim=-1), xb, g)
    assert dx.shape == (T, E) and dx.dtype == dtype
    assert torch.isfinite(dx).all()
    # zero off the selected entries: exactly (the reference's are exact zeros)
    assert torch.equal((dx == 0) | (ref_dx != 0), torch.ones_like(dx, dtype=torch.bool))
    err, base_err = _max_err(dx, ref_dx), _max_err(base_dx, ref_dx)
    atol = torch.finfo(dtype).eps / 2 * (ref_dx.abs().max().item() if ref_dx.numel() else 0.0)
    assert err <= 2 * base_err + atol, (err, base_err)


def test_kernel_path_is_the_one_tested(ts):
    """Guard against a vacuous pass: here the public function must run the kernels, not the fallback."""
    assert ts._kernel_runs_on(torch.device(DEVICE))


def test_ties_and_special_values(ts):
    E, k = 12, 5
    x = _logits(6, E, torch.bfloat16, seed=3)
    x[0] = 0.5  # all equal: the k lowest experts, distinct
    x[1] = 0.0
    x[1, ::2] = -0.0  # -0.0 == +0.0: still the lowest experts first
    x[2, [3, 7, 9]] = 9.0  # a three-way tie at the top
    x[3] = float("-inf")
    x[3, 11] = 1.0
    x[4, [2, 5]] = float("nan")  # NaN ranks first, as in torch.topk / torch.sort
    x[5, [0, 4]] = float("inf")
    scores, idx = ts.topk_softmax(x, k)
    ref_scores, ref_idx = _ref(x.double(), k)
    assert idx[0].tolist() == list(range(k)) and idx[1].tolist() == list(range(k))
    assert idx[2, :3].tolist() == [3, 7, 9]
    assert idx[3].tolist() == [11, 0, 1, 2, 3]
    assert idx[4, :2].tolist() == [2, 5]
    assert torch.equal(idx.cpu(), ref_idx.cpu())
    for t in range(x.shape[0]):
        assert len(set(idx[t].tolist())) == k
    assert torch.equal(scores.isnan().cpu(), ref_scores.isnan().cpu())  # NaN / inf rows: NaN like torch
    ok = ~ref_scores.isnan()
    assert torch.allclose(scores[ok].double().cpu(), ref_scores[ok].cpu(), rtol=1e-6, atol=1e-7)
    assert torch.allclose(scores[0].cpu(), torch.full((k,), 1.0 / k), rtol=1e-6)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_extreme_values_keep_order(ts, dtype):
    """Keys must order like the floats across signs, subnormals and the largest finite values."""
    fi = torch.finfo(dtype)
    vals = [fi.max, -fi.max, fi.tiny, -fi.tiny, fi.smallest_normal / 4, -fi.smallest_normal / 4, 1.0, -1.0, 0.0]
    x = torch.tensor([vals, vals[::-1]], dtype=dtype, device=DEVICE)
    _, idx = ts.topk_softmax(x, len(vals))
    assert torch.equal(idx.cpu(), _ref(x.double(), len(vals))[1].cpu())


def test_blockings_and_runs_bitwise_equal(ts):
    T, E, k = 45, 40, 4
    x = _logits(T, E, torch.bfloat16, seed=11)
    g = torch.randn(T, k, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    s0, i0 = ts.topk_softmax_fwd(x, k)
    d0 = ts.topk_softmax_bwd(g, s0, i0, E, x.dtype)
    for rows in (None, 1, 4, 64):
        s, i = ts.topk_softmax_fwd(x, k, rows_per_program=rows)
        d = ts.topk_softmax_bwd(g, s, i, E, x.dtype, rows_per_program=rows)
        assert torch.equal(s, s0) and torch.equal(i, i0) and torch.equal(d, d0)


def test_strided_logits(ts):
    """A column slice (row stride > E) and a transposed view (copied) give the contiguous result."""
    wide = _logits(20, 50, torch.bfloat16, seed=5)
    x = wide[:, 3:43]
    s, i = ts.topk_softmax(x, 6)
    s_ref, i_ref = ts.topk_softmax(x.contiguous(), 6)
    assert torch.equal(s, s_ref) and torch.equal(i, i_ref)
    s_t, i_t = ts.topk_softmax(x.contiguous().t().contiguous().t(), 6)
    assert torch.equal(s_t, s_ref) and torch.equal(i_t, i_ref)


def test_large_E(ts):
    """E = 1024 (one row per program), a few rows: indices and scores vs float64."""
    x = _logits(3, 1024, torch.bfloat16, seed=9)
    s, i = ts.topk_softmax(x, 8)
    ref_s, ref_i = _ref(x.double(), 8)
    assert torch.equal(i.cpu(), ref_i.cpu())
    assert torch.allclose(s.double().cpu(), ref_s.cpu(), rtol=1e-6, atol=1e-7)


def test_cpu_fallback_is_the_reference(ts, monkeypatch):
    monkeypatch.setattr(ts, "_kernel_runs_on", lambda device: False)
    x = _logits(9, 10, torch.bfloat16, seed=2).requires_grad_(True)
    s, i = ts.topk_softmax(x, 3)
    ref_s, ref_i = _ref(x.detach(), 3)
    assert s.dtype == torch.float32 and torch.equal(s, ref_s) and torch.equal(i, ref_i)
    (dx,) = torch.autograd.grad(s, x, torch.randn_like(s))
    assert dx.shape == x.shape and dx.dtype == x.dtype


@pytest.mark.parametrize(
    ("logits", "k", "match"),
    [
        (lambda: torch.zeros(2, 3, 4), 1, r"logits_TE must be 2-D \[T, E\], got shape \(2, 3, 4\)"),
        (lambda: torch.zeros(2, 4, dtype=torch.int32), 1, "logits_TE dtype must be one of .* got torch.int32"),
        (lambda: torch.zeros(2, 4, dtype=torch.float64), 1, "logits_TE dtype .* got torch.float64"),
        (lambda: torch.zeros(2, 0), 1, r"shape\[1\] \(E\) must be in \[1, 4096\], got 0"),
        (lambda: torch.zeros(1, 4097), 1, r"must be in \[1, 4096\], got 4097"),
        (lambda: torch.zeros(2, 4), 0, r"k must be an int in \[1, E=4\], got 0"),
        (lambda: torch.zeros(2, 4), 5, r"k must be an int in \[1, E=4\], got 5"),
        (lambda: torch.zeros(2, 4), 2.0, r"k must be an int in \[1, E=4\], got 2.0"),
        (lambda: torch.zeros(2, 4), True, r"k must be an int .* got True"),
        (lambda: [[1.0, 2.0]], 1, "logits_TE must be a torch.Tensor, got list"),
    ],
)
def test_bad_input(ts, logits, k, match):
    x = logits()
    if isinstance(x, torch.Tensor):
        x = x.to(DEVICE)
    with pytest.raises(ValueError, match=match):
        ts.topk_softmax(x, k)


def test_bad_blocking_and_grad_shape(ts):
    x = _logits(4, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match="rows_per_program must be a power of two >= 1, got 3"):
        ts.topk_softmax_fwd(x, 2, rows_per_program=3)
    s, i = ts.topk_softmax_fwd(x, 2)
    with pytest.raises(ValueError, match=r"grad of scores must have shape \(4, 2\), got \(4, 3\)"):
        ts.topk_softmax_bwd(torch.zeros(4, 3, device=DEVICE), s, i, 8, x.dtype)
