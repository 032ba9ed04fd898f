"""The expert-parallel send-side Triton kernels (token_dispatch/triton_send.py) against their PyTorch reference
(token_dispatch.send_side.send_side_torch on the flat top-K routing): every field bitwise equal (dtype, shape,
values), on CPU under TRITON_INTERPRET=1 (compiled on a GPU when present). Outputs come from torch.empty,
poisoned here (deterministic fill), so an element the kernels forget to write shows."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from sonic_megatron.kernels.routing import TopKRouting  # noqa: E402
from sonic_megatron.token_dispatch import recv_side, send_side, validation  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _ep_send():
    try:
        from sonic_megatron.token_dispatch.triton_send import ep_send_side
    except Exception as exc:  # pragma: no cover - depends on the triton build
        pytest.skip(f"triton kernels cannot be imported here: {exc}")
    return ep_send_side


def _indices(T, K, L, P, mode, gen):
    """[T, K] int64 global experts, distinct per token (top-K): see CASES for the modes."""
    E = L * P
    rows = []
    for _ in range(T):
        if mode == "random":
            rows.append(torch.randperm(E, generator=gen)[:K])
        elif mode == "one_destination":  # every pair to rank P - 1 (the other ranks receive nothing)
            rows.append((P - 1) * L + torch.randperm(L, generator=gen)[:K])
        elif mode == "one_rank_per_token":  # a token's K experts all on one (random) rank
            d = int(torch.randint(0, P, (1,), generator=gen))
            rows.append(d * L + torch.randperm(L, generator=gen)[:K])
        elif mode == "bad":  # out of range both ways: must not crash nor write out of bounds
            rows.append(torch.randint(-3 * L, E + 3 * L, (K,), generator=gen))
        elif mode == "duplicate":  # in range, some tokens name an expert twice (the header's check)
            row = torch.randperm(E, generator=gen)[:K]
            if K > 1 and torch.rand(1, generator=gen).item() < 0.2:
                row[K - 1] = row[0]
            rows.append(row)
        else:
            raise AssertionError(mode)
    return torch.stack(rows) if T else torch.zeros(0, K, dtype=torch.int64)


def _run(T, K, L, P, N, *, mode="random", idx_dtype=torch.int64, score_dtype=torch.float32, bt=None, seed=0):
    ep_send_side = _ep_send()
    gen = torch.Generator().manual_seed(seed)
    idx = _indices(T, K, L, P, mode, gen).to(DEVICE, idx_dtype)
    scores = torch.randn(T, K, generator=gen, dtype=torch.float64).to(DEVICE, score_dtype)
    tok_R, exp_R, scores_R = send_side.flat_routing(TopKRouting(scores, idx))
    want = send_side.send_side_torch(tok_R, exp_R, scores_R, T, L, P, N)
    det, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        got = ep_send_side(idx, scores, T, L, P, N, block_tokens=bt)
    finally:
        torch.use_deterministic_algorithms(det)
        torch.utils.deterministic.fill_uninitialized_memory = fill
    side = send_side.SendSide(*got)  # the integrator's construction
    # the header's index stats: validation.index_stats of the flat top-K routing
    stats = validation.index_stats(tok_R, exp_R, T, False)
    want_stats = [int(v) for v in stats[:2]] + [int(stats[3])]
    got_stats = side.index_stats.minmax.tolist() + side.index_stats.duplicate.tolist()
    assert got_stats == want_stats, (got_stats, want_stats)
    for name in type(got)._fields[:-1]:
        a, b = getattr(side, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), f"{name}: {a.flatten().tolist()[:24]} vs {b.flatten().tolist()[:24]}"
    if mode != "bad":  # the score bits decode to the scores of the pairs in send order
        back = recv_side.scores_from_columns(side.pair_meta_RC[:, 2:], score_dtype)
        assert torch.equal(back, scores.reshape(-1)[side.order])
    return side


# (T, K, L, P, N, block_tokens): block_tokens small so that chunks span several tiles and T is no multiple.
RANDOM = {
    "p1_n1": (23, 2, 4, 1, 1, 8),
    "p2_n2": (37, 3, 3, 2, 2, 8),
    "p3_n3": (41, 2, 2, 3, 3, 4),
    "p4_n5": (45, 4, 2, 4, 5, 4),
    "p8_n2": (30, 5, 2, 8, 2, 8),
    "p8_n1_default_tile": (150, 3, 1, 8, 1, None),  # default tile (128 tokens): 2 tiles, the 2nd partly empty
    "p4_n3_one_tile_per_chunk": (33, 2, 3, 4, 3, None),
    "k_is_e": (19, 6, 3, 2, 2, 4),  # every token on every expert: each token sends a row to each rank
    "k1": (29, 1, 3, 4, 3, 8),
    "t1_n5": (1, 3, 2, 4, 5, None),  # more chunks than tokens: empty chunks
    "t1_k1_p1": (1, 1, 1, 1, 1, None),
    "t3_n5": (3, 2, 2, 2, 5, 1),  # one-token tiles
    "t0": (0, 4, 2, 4, 2, None),
    "t0_p1": (0, 1, 1, 1, 1, None),
}


@pytest.mark.parametrize("case", list(RANDOM))
def test_random_routing_matches_plan(case):
    T, K, L, P, N, bt = RANDOM[case]
    _run(T, K, L, P, N, bt=bt, seed=list(RANDOM).index(case))


@pytest.mark.parametrize("P, N", [(4, 1), (3, 2), (8, 3)])
def test_all_pairs_to_one_destination(P, N):
    side = _run(40, 2, 3, P, N, mode="one_destination", bt=8)
    rows = side.rows_NP.view(N, P)
    assert rows[:, : P - 1].sum() == 0 and rows[:, P - 1].sum() == 40  # one row per token, to rank P-1


@pytest.mark.parametrize("P, N", [(2, 1), (4, 3), (8, 2)])
def test_each_token_on_one_rank(P, N):
    side = _run(35, 3, 4, P, N, mode="one_rank_per_token", bt=8)
    assert side.combine_offsets.diff().eq(1).all()  # one send row per token: S = T rows of K pairs each


@pytest.mark.parametrize("score_dtype", [torch.float64, torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_dtypes(score_dtype, idx_dtype):
    side = _run(27, 3, 2, 4, 2, idx_dtype=idx_dtype, score_dtype=score_dtype, bt=8)
    assert side.pair_meta_RC.shape == (27 * 3, 4 if score_dtype == torch.float64 else 3)


def test_strided_inputs_and_grad():
    """Non-contiguous [T, K] views (column slices of wider tensors) and scores that require grad."""
    ep_send_side = _ep_send()
    gen = torch.Generator().manual_seed(7)
    T, K, L, P, N = 33, 3, 2, 4, 3
    wide = torch.stack([torch.randperm(L * P, generator=gen)[: K + 2] for _ in range(T)]).to(DEVICE)
    idx = wide[:, 1 : K + 1]
    scores = torch.rand(T, 2 * K, generator=gen).to(DEVICE)[:, ::2].requires_grad_()
    assert not idx.is_contiguous() and not scores.is_contiguous()
    got = ep_send_side(idx, scores, T, L, P, N, block_tokens=8)
    want = send_side.send_side_torch(*send_side.flat_routing(TopKRouting(scores, idx)), T, L, P, N)
    for a, b in zip(got[:-1], (getattr(want, f) for f in type(got)._fields[:-1]), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert scores.grad is None


@pytest.mark.parametrize("N", [1, 3])
def test_bad_expert_indices_do_not_crash(N):
    """Indices < 0 or >= E: destinations clamp as in the reference, so the results still agree."""
    _run(26, 3, 2, 4, N, mode="bad", bt=8)


@pytest.mark.parametrize("case", [(40, 3, 4, 2, 1, 4), (40, 2, 3, 4, 3, 8), (9, 5, 2, 4, 2, None)])
def test_duplicate_experts_in_a_row_are_flagged(case):
    """A token naming an expert twice sets the index stats' duplicate flag (tiles of several sizes)."""
    T, K, L, P, N, bt = case
    for seed in range(4):
        _run(T, K, L, P, N, mode="duplicate", bt=bt, seed=seed)


def test_outputs_written_in_place():
    """``out`` slices (the plan's exchange buffer) receive the counts and index stats; nothing else of the buffer
    is touched."""
    from sonic_megatron.token_dispatch.triton_send import SendOutputs

    ep_send_side = _ep_send()
    T, K, L, P, N = 21, 2, 3, 2, 2
    gen = torch.Generator().manual_seed(3)
    idx = _indices(T, K, L, P, "random", gen).to(DEVICE)
    scores = torch.rand(T, K, generator=gen).to(DEVICE)
    buf = torch.full((40,), -7, dtype=torch.int64, device=DEVICE)
    out = SendOutputs(buf[2 : 2 + N * P], buf[10 : 10 + N * P], buf[20:22], buf[30:31])
    got = ep_send_side(idx, scores, T, L, P, N, block_tokens=8, out=out)
    ref = ep_send_side(idx, scores, T, L, P, N, block_tokens=8)
    assert torch.equal(buf[2 : 2 + N * P], ref.rows_NP) and torch.equal(buf[10 : 10 + N * P], ref.pairs_NP)
    assert buf[20:22].tolist() == ref.index_stats.minmax.tolist() and buf[30].item() == 0
    assert got.rows_NP.data_ptr() == buf[2:].data_ptr()
    untouched = torch.ones(40, dtype=torch.bool)
    for a, b in ((2, 2 + N * P), (10, 10 + N * P), (20, 22), (30, 31)):
        untouched[a:b] = False
    assert (buf.cpu()[untouched] == -7).all()


def test_scan_loops_over_blocks(monkeypatch):
    """Shrink the scan's step so that it loops over several tile blocks and segment rows."""
    from sonic_megatron.token_dispatch import triton_send as ep_send

    _ep_send()
    monkeypatch.setattr(ep_send, "_SCAN_ELEMS", 4)
    _run(60, 2, 2, 3, 2, bt=4)  # 8 tiles per chunk, 6 segments, 16 tiles in token order


def test_rejects_bad_input():
    ep_send_side = _ep_send()
    idx = torch.zeros(4, 2, dtype=torch.int64, device=DEVICE)
    s = torch.rand(4, 2, device=DEVICE)
    with pytest.raises(ValueError, match="indices_TK dtype must be int32 or int64"):
        ep_send_side(idx.float(), s, 4, 2, 2, 1)
    with pytest.raises(ValueError, match=r"scores_TK must be a tensor of shape \(4, 2\)"):
        ep_send_side(idx, s[:3], 4, 2, 2, 1)
    with pytest.raises(ValueError, match="scores_TK dtype"):
        ep_send_side(idx, s.int(), 4, 2, 2, 1)
    with pytest.raises(ValueError, match=r"num_tokens must be indices_TK.shape\[0\] = 4, got 5"):
        ep_send_side(idx, s, 5, 2, 2, 1)
    with pytest.raises(ValueError, match="world_size must be an int in"):
        ep_send_side(idx, s, 4, 2, 0, 1)
    with pytest.raises(ValueError, match="num_local_experts must be an int in"):
        ep_send_side(idx, s, 4, 2.0, 2, 1)
    with pytest.raises(ValueError, match="block_tokens must be a power of two"):
        ep_send_side(idx, s, 4, 2, 2, 1, block_tokens=12)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 2])
def test_large_on_gpu(N):
    """T=16384, K=8, E=128, P=4 with the default tile, top-K of random logits, fp32 and bf16 scores."""
    ep_send_side = _ep_send()
    gen = torch.Generator(device="cuda").manual_seed(N)
    T, K, E, P = 16384, 8, 128, 4
    logits = torch.randn(T, E, device="cuda", generator=gen)
    scores, idx = torch.topk(logits.softmax(-1), K, dim=-1)
    for s in (scores, scores.bfloat16()):
        want = send_side.send_side_torch(*send_side.flat_routing(TopKRouting(s, idx)), T, E // P, P, N)
        got = ep_send_side(idx, s, T, E // P, P, N)
        for name in type(got)._fields[:-1]:  # all but the index stats, which the plain send side has not
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
