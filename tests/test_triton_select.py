"""The per-row top-n selection of token rounding (token_dispatch/triton_select.py) against its PyTorch reference
(token_dispatch.rounding.top_n_rows_torch): thr, cut and the token lists bitwise equal, on CPU under
TRITON_INTERPRET=1 (compiled on a GPU when present). Keys with many ties (the cut falls inside a run of
equal keys), rows that select nothing or everything, rows longer than one register block (the chunked path)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from sonic_megatron.token_dispatch.rounding import top_n_rows_torch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _kernel():
    try:
        from sonic_megatron.token_dispatch import triton_select
    except Exception as exc:  # pragma: no cover - depends on the triton build
        pytest.skip(f"triton kernels cannot be imported here: {exc}")
    return triton_select


def _case(E, T, W, kind, gen):
    if kind == "ties":  # few distinct values: the cut lands inside runs of equal keys
        key = torch.randint(-3, 3, (E, T), generator=gen, dtype=torch.int32)
    elif kind == "extremes":  # int32 min / max and values around zero
        pool = torch.tensor([-(2**31), -(2**31) + 1, -1, 0, 1, 2**31 - 2, 2**31 - 1], dtype=torch.int32)
        key = pool[torch.randint(0, pool.numel(), (E, T), generator=gen)]
    else:
        key = torch.randint(-(2**31), 2**31 - 1, (E, T), generator=gen, dtype=torch.int32)
    n = torch.randint(0, min(W, T) + 1, (E,), generator=gen)
    n[0] = 0
    n[-1] = min(W, T)
    return key, n


@pytest.mark.parametrize("kind", ["random", "ties", "extremes"])
@pytest.mark.parametrize("E,T,W", [(6, 37, 8), (4, 1, 3), (3, 300, 300), (5, 64, 63)])
def test_top_n_rows_equals_reference(E, T, W, kind):
    gen = torch.Generator().manual_seed(E * 1000 + T + W)
    key, n = _case(E, T, W, kind, gen)
    got = _kernel().top_n_rows(key.to(DEVICE), n.to(DEVICE), W)
    ref = top_n_rows_torch(key, n, W)
    for a, b, name in zip(got, ref, ("thr", "cut", "tokens"), strict=True):
        assert a.dtype == b.dtype == torch.int32, name
        assert torch.equal(a.cpu(), b), name


def test_top_n_rows_chunked_rows(monkeypatch):
    """Rows longer than the register block are re-read per pass: the same results."""
    sel = _kernel()
    monkeypatch.setattr(sel, "_MAX_BLOCK", 32)
    gen = torch.Generator().manual_seed(7)
    key, n = _case(3, 100, 20, "ties", gen)
    got = sel.top_n_rows(key.to(DEVICE), n.to(DEVICE), 20)
    for a, b in zip(got, top_n_rows_torch(key, n, 20), strict=True):
        assert torch.equal(a.cpu(), b)


def test_reference_selects_the_largest_keys_lowest_tokens_first():
    key = torch.tensor([[5, 7, 7, 1, 7], [0, 0, 0, 0, 0]], dtype=torch.int32)
    thr, cut, out = top_n_rows_torch(key, torch.tensor([2, 0]), 3)
    assert thr.tolist() == [7, 2**31 - 1] and cut.tolist() == [2, -1]
    assert out.tolist() == [[1, 2, -1], [-1, -1, -1]]


@pytest.mark.parametrize("mode", ["nearest", "up", "down"])
def test_round_local_with_the_kernel_equals_the_reference(monkeypatch, mode):
    """round_local's cut through the Triton selection: the single-process reference's pairs, order and scores."""
    from sonic_megatron.kernels import TopKRouting
    from sonic_megatron.token_dispatch import TokenRounding, rounding

    monkeypatch.setattr(rounding, "top_n_rows", _kernel().top_n_rows)
    gen = torch.Generator().manual_seed(3)
    T, E, K, M = 150, 8, 2, 16
    logits = (torch.randn(T, E, generator=gen) * 2).round() / 2  # ties between scores
    dense = torch.softmax(logits, -1)
    idx = torch.topk(logits, K, dim=1).indices
    scores = torch.softmax(logits.gather(1, idx), -1)
    rnd = TokenRounding(mode, M)
    got = rounding.round_local(
        TopKRouting(scores.to(DEVICE), idx.to(DEVICE)), dense.to(DEVICE), num_experts=E, rounding=rnd
    )
    tok = torch.arange(T).repeat_interleave(K)
    ref = rounding.round_routing(tok, idx.reshape(-1), scores.reshape(-1), dense, num_experts=E, rounding=rnd)
    R = ref.token_idx_R.numel()
    assert torch.equal(got.token_idx_R[:R].cpu(), ref.token_idx_R)
    assert torch.equal(got.expert_idx_R[:R].cpu(), ref.expert_idx_R)
    assert torch.equal(got.scores_R[:R].cpu(), ref.scores_R)
    assert (got.expert_idx_R[R:] == E).all()
