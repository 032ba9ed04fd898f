"""Token rounding without expert parallelism through its Triton kernels (token_dispatch/triton_round.py) against
the PyTorch reference (``round_local_torch``) and the single-process ``round_routing``: pairs, order, scores and
the gradients to the routing scores and dense probabilities bitwise equal, on CPU under TRITON_INTERPRET=1
(compiled on a GPU when present). Ties between scores (the cut falls inside runs of equal keys), flat and
underflowing probabilities, experts that drop, add or keep, rows longer than one register block or one step of
the cut kernel's passes, each rounding mode."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from sonic_megatron.kernels import TopKRouting  # noqa: E402
from sonic_megatron.kernels.interface import compute_metadata  # noqa: E402
from sonic_megatron.kernels.routing import run_offsets  # noqa: E402
from sonic_megatron.token_dispatch import TokenRounding, round_routing  # noqa: E402
from sonic_megatron.token_dispatch.rounding import round_local_torch, rounded_pairs_bound, top_n_rows_torch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _kernels():
    try:
        from sonic_megatron.token_dispatch import triton_round
    except Exception as exc:  # pragma: no cover - depends on the triton build
        pytest.skip(f"triton kernels cannot be imported here: {exc}")
    return triton_round


def _assert_metadata_of(got, ref, E):
    """The kernels' metadata equals what the experts would build from the reference's pairs (PyTorch ops)."""
    assert got.metadata is not None
    built = compute_metadata(ref, E)[1]
    for name, a, b in zip(built.TENSOR_NAMES, got.metadata.tensors(), built.tensors(), strict=True):
        assert a.dtype == torch.int32 and torch.equal(a.cpu(), b), name
    assert got.metadata.pairs_per_token == built.pairs_per_token == 0


def _routing(T, E, K, seed, ties, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    if ties:  # equal scores and equal dense probs across tokens
        logits = (logits * 2).round() / 2
    dense = torch.softmax(logits, -1)
    idx = torch.topk(logits, K, dim=1).indices
    scores = torch.softmax(logits.gather(1, idx), -1).to(dtype)
    return scores, idx, dense


# (70, 40, ...): more experts than one keys program holds (two expert blocks, the second partial)
CASES = [
    (150, 8, 2, 16, 3, True),
    (96, 8, 2, 16, 0, False),
    (200, 16, 4, 32, 1, True),
    (7, 3, 2, 4, 3, False),
    (70, 40, 3, 16, 2, True),
]
MODES = ["nearest", "up", "down"]
# More experts than one placing step holds (128): the positions carry over. The modes differ only in the targets,
# which the cases above cover in every mode; one mode here, where nearly every expert gets a tile of pairs.
WIDE_CASE = (40, 140, 3, 16, 4, True, "nearest")


def _assert_equals_reference(scores, idx, dense, E, M, mode, seed=0):
    """Pairs, order, scores, metadata and both gradients of the kernels equal the reference's (bitwise); returns
    the kernels' routing."""
    (T, K), rnd = idx.shape, TokenRounding(mode, M)
    s_k, d_k = scores.to(DEVICE).requires_grad_(), dense.to(DEVICE).requires_grad_()
    got = _kernels().round_local_triton(TopKRouting(s_k, idx.to(DEVICE)), d_k, E, mode, M)
    s_r, d_r = scores.clone().requires_grad_(), dense.clone().requires_grad_()
    ref = round_local_torch(TopKRouting(s_r, idx), d_r, num_experts=E, rounding=rnd)
    assert got.padded and got.token_idx_R.numel() == rounded_pairs_bound(T * K, T, E, M)
    # the scan's token offsets: each token's pair range, as a binary search over the sorted tokens finds it
    assert torch.equal(got.token_offsets.cpu().long(), run_offsets(ref.token_idx_R, T))
    for a, b in (
        (got.token_idx_R, ref.token_idx_R),
        (got.expert_idx_R, ref.expert_idx_R),
        (got.scores_R, ref.scores_R),
    ):
        assert a.dtype == b.dtype and torch.equal(a.detach().cpu(), b.detach())
    _assert_metadata_of(got, ref, E)
    assert got.metadata.rows_multiple == M  # every expert's rows: a multiple of the tile
    # the single-process reference of the EP decision: the same real pairs
    tok = torch.arange(T).repeat_interleave(K)
    plain = round_routing(tok, idx.reshape(-1), scores.reshape(-1), dense, num_experts=E, rounding=rnd)
    R = plain.token_idx_R.numel()
    assert torch.equal(got.token_idx_R[:R].cpu(), plain.token_idx_R) and (got.expert_idx_R[R:] == E).all()
    w = torch.randn(got.scores_R.numel(), generator=torch.Generator().manual_seed(seed))
    g_got = torch.autograd.grad((got.scores_R * w.to(DEVICE)).sum(), (s_k, d_k))
    g_ref = torch.autograd.grad((ref.scores_R * w).sum(), (s_r, d_r))
    for a, b in zip(g_got, g_ref, strict=True):
        assert torch.equal(a.cpu(), b)
    return got


@pytest.mark.parametrize("T,E,K,M,seed,ties,mode", [(*case, mode) for case in CASES for mode in MODES] + [WIDE_CASE])
def test_round_local_kernels_equal_the_reference(mode, T, E, K, M, seed, ties):
    scores, idx, dense = _routing(T, E, K, seed, ties)
    _assert_equals_reference(scores, idx, dense, E, M, mode, seed)


@pytest.mark.parametrize("mode", ["nearest", "down"])
@pytest.mark.parametrize("scale", [0.0, 60.0])
def test_round_local_kernels_flat_and_underflowing_scores(mode, scale):
    """Every key of a side equal (all logits 0: the search has no bit to try, every key is a tie) and dense
    probabilities that underflow to 0 for most pairs (huge logits: long runs of equal keys at the cut)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(90, 12, generator=g) * scale
    dense = torch.softmax(logits, -1)
    idx = torch.topk(logits, 3, dim=1).indices
    scores = torch.softmax(logits.gather(1, idx), -1)
    _assert_equals_reference(scores, idx, dense, 12, 8, mode)


@pytest.mark.parametrize("max_block,stream_block", [(32, 32), (4096, 32)])
def test_round_local_kernels_bf16_scores_and_chunked_rows(monkeypatch, max_block, stream_block):
    """bf16 routing scores (keys compare as fp32, scores come back in bf16); rows whose search re-reads them per
    pass (max_block 32) or holds them in registers, with the other passes in steps of 32 tokens."""
    tr = _kernels()
    monkeypatch.setattr(tr, "_MAX_BLOCK", max_block)
    monkeypatch.setattr(tr, "_STREAM_BLOCK", stream_block)
    scores, idx, dense = _routing(100, 6, 2, 5, True, dtype=torch.bfloat16)
    got = _assert_equals_reference(scores, idx, dense, 6, 8, "nearest")  # block prefixes cross steps of 32 tokens
    assert got.scores_R.dtype == torch.bfloat16


def test_top_n_rows_reference_selects_the_largest_keys_lowest_tokens_first():
    key = torch.tensor([[5, 7, 7, 1, 7], [0, 0, 0, 0, 0]], dtype=torch.int32)
    thr, cut, out = top_n_rows_torch(key, torch.tensor([2, 0]), 3)
    assert thr.tolist() == [7, 2**31 - 1] and cut.tolist() == [2, -1]
    assert out.tolist() == [[1, 2, -1], [-1, -1, -1]]


@pytest.mark.parametrize("path", ["kernels", "reference"])
def test_nearest_never_empties_a_routed_expert(path):
    """Experts with 0 < f <= tile / 2 routed pairs get one tile (SonicMoE's nearest rounding would empty them);
    experts top-K never chose stay empty. Skewed logits give counts from 0 to well above the tile."""
    T, E, K, M = 160, 12, 2, 16
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(T, E, generator=g) - 5.0 * torch.arange(E) / E
    dense = torch.softmax(logits, -1)
    idx = torch.topk(logits, K, dim=1).indices
    scores = torch.softmax(logits.gather(1, idx), -1)
    f = torch.bincount(idx.reshape(-1), minlength=E)
    assert ((f > 0) & (f < M // 2)).any() and (f == 0).any() and (f > 2 * M).any(), f.tolist()
    if path == "kernels":
        got = _kernels().round_local_triton(
            TopKRouting(scores.to(DEVICE), idx.to(DEVICE)), dense.to(DEVICE), E, "nearest", M
        )
    else:
        got = round_local_torch(TopKRouting(scores, idx), dense, num_experts=E, rounding=TokenRounding("nearest", M))
    t = torch.bincount(got.expert_idx_R.cpu(), minlength=E + 1)[:E]
    want = torch.where((f > 0) & (f <= M // 2), M, torch.round(f.double() / M).long() * M)
    assert torch.equal(t, want), (f.tolist(), t.tolist())


def test_experts_read_the_rounded_metadata():
    """The experts on the kernels' rounded routing (its metadata from the placing kernel) give the outputs and
    gradients of the same pairs with the metadata built by the experts; the CPU check of the indices compares the
    two metadata, and a metadata of the wrong size is refused naming the field."""
    import dataclasses

    from sonic_megatron.kernels import moe_experts

    T, E, K, M, D, F = 60, 6, 2, 8, 16, 8
    scores, idx, dense = _routing(T, E, K, 9, False)
    got = _kernels().round_local_triton(TopKRouting(scores.to(DEVICE), idx.to(DEVICE)), dense.to(DEVICE), E, "up", M)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    w1 = torch.randn(E, 2 * F, D, generator=g, dtype=torch.float64) / 4
    w2 = torch.randn(E, D, F, generator=g, dtype=torch.float64) / 4
    results = []
    for routing in (got, dataclasses.replace(got, metadata=None)):
        routing = dataclasses.replace(
            routing,
            **{f: getattr(routing, f).cpu() for f in ("token_idx_R", "expert_idx_R", "token_offsets")},
            scores_R=routing.scores_R.detach().cpu().double().requires_grad_(),
        )
        if routing.metadata is not None:
            meta = routing.metadata
            routing = dataclasses.replace(
                routing, metadata=type(meta)(*(t.cpu() for t in meta.tensors()), pairs_per_token=0)
            )
        xs, a, b = (t.clone().requires_grad_() for t in (x, w1, w2))
        out = moe_experts(xs, routing, a, b, backend="torch", check_indices=True)
        out.backward(torch.ones_like(out))
        real = int(routing.token_offsets[-1])  # padding pairs' score gradients are left unwritten
        results.append((out, xs.grad, routing.scores_R.grad[:real], a.grad, b.grad))
    for u, v in zip(*results, strict=True):
        assert torch.equal(u, v)
    meta = got.metadata
    short = type(meta)(meta.expert_offsets[:-1], *meta.tensors()[1:], pairs_per_token=0)
    with pytest.raises(ValueError, match="routing.metadata.expert_offsets"):
        x_, w1_, w2_ = (t.to(DEVICE, torch.float32) for t in (x, w1, w2))
        moe_experts(x_, dataclasses.replace(got, metadata=short), w1_, w2_)


def test_local_routing_copy_owns_the_rounded_metadata():
    """Megatron's 1F1B EP-overlap schedule frees node inputs: the EP = 1 mode's copy of the routing owns every index
    tensor of the rounded routing, its metadata included (equal values, new storage)."""
    from sonic_megatron.modes import _owning_indices

    scores, idx, dense = _routing(40, 5, 2, 11, False)
    got = _kernels().round_local_triton(TopKRouting(scores.to(DEVICE), idx.to(DEVICE)), dense.to(DEVICE), 5, "up", 8)
    copy = _owning_indices(got)
    pairs = [(a, b) for a, b in zip(copy.metadata.tensors(), got.metadata.tensors(), strict=True)]
    pairs += [(copy.token_idx_R, got.token_idx_R), (copy.token_offsets, got.token_offsets)]
    for a, b in pairs:
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    assert copy.metadata.rows_multiple == got.metadata.rows_multiple == 8
