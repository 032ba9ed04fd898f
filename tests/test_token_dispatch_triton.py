"""The expert-parallel receive-side Triton kernel (token_dispatch/triton_recv.py) against its PyTorch reference
(token_dispatch.recv_side.recv_rows_keys_torch), on CPU under TRITON_INTERPRET=1 (compiled on a GPU when present).
Inputs follow the plan's invariants: segments (chunk, source) in order, every row with >= 1 pair, rows
ascending inside a segment; the counts are a column slice of a wider int64 tensor, as in ``make_plan``."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from sonic_megatron.token_dispatch.recv_side import recv_rows_keys_torch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAXC, HDR = 16, 18


def _inputs(P, N, L, rank, max_rows, max_pairs_per_row, seed, empty_sources=(), slot_rows=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 50, (P, HDR + 2 * MAXC * P), generator=g)  # junk outside the used columns
    meta = []
    for c in range(N):
        for p in range(P):
            n_rows = 0 if p in empty_sources else int(torch.randint(0, max_rows + 1, (1,), generator=g))
            n_pairs = 0
            for r in range(n_rows):
                k = int(torch.randint(1, max_pairs_per_row + 1, (1,), generator=g))
                for e in torch.randperm(L, generator=g)[:k].tolist():
                    meta.append((r, e, int(torch.randint(-(2**31), 2**31 - 1, (1,), generator=g))))
                n_pairs += k
            counts[p, HDR + c * P + rank] = n_rows
            counts[p, HDR + MAXC * P + c * P + rank] = n_pairs
    meta_QC = torch.tensor(meta, dtype=torch.int32).reshape(-1, 3)
    counts_PW = counts.to(DEVICE)[:, HDR:]
    U = int(sum(counts[p, HDR + c * P + rank] for c in range(N) for p in range(P)))
    if slot_rows:  # rows in slots of slot_rows per (chunk, source): the slots' rows past a count carry no pair
        U = N * P * slot_rows
    kw = dict(rank=rank, world_size=P, num_local_experts=L, num_chunks=N, pair_base=MAXC * P, num_recv_rows=U)
    if slot_rows:
        kw["slot_rows"] = slot_rows
    return meta_QC.to(DEVICE), counts_PW, kw


CASES = {
    "p2_n1": dict(P=2, N=1, L=3, rank=1, max_rows=5, max_pairs_per_row=3, seed=0),
    "p4_n3": dict(P=4, N=3, L=2, rank=2, max_rows=4, max_pairs_per_row=2, seed=1),
    "a_source_sends_nothing": dict(P=3, N=2, L=4, rank=0, max_rows=3, max_pairs_per_row=4, seed=2, empty_sources=(1,)),
    "nothing_received": dict(P=2, N=2, L=2, rank=0, max_rows=0, max_pairs_per_row=1, seed=3),
    "one_local_expert": dict(P=2, N=1, L=1, rank=0, max_rows=6, max_pairs_per_row=1, seed=4),
    "several_programs": dict(P=2, N=2, L=8, rank=1, max_rows=400, max_pairs_per_row=8, seed=5),  # Q > 1024
    "slots": dict(P=4, N=1, L=3, rank=1, max_rows=5, max_pairs_per_row=3, seed=6, slot_rows=7),
    "slots_a_source_sends_nothing": dict(
        P=3, N=1, L=2, rank=2, max_rows=4, max_pairs_per_row=2, seed=7, empty_sources=(0, 2), slot_rows=4
    ),
    "slots_nothing_received": dict(P=2, N=1, L=2, rank=0, max_rows=0, max_pairs_per_row=1, seed=8, slot_rows=3),
    "slots_more_rows_than_pairs": dict(P=2, N=1, L=4, rank=1, max_rows=300, max_pairs_per_row=2, seed=9, slot_rows=900),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ep_recv_rows_keys_matches_torch(case):
    try:
        from sonic_megatron.token_dispatch.triton_recv import ep_recv_rows_keys
    except Exception as exc:  # pragma: no cover - depends on the triton build
        pytest.skip(f"triton kernels cannot be imported here: {exc}")
    meta_QC, counts_PW, kw = _inputs(**CASES[case])
    want = recv_rows_keys_torch(meta_QC, counts_PW, **kw)
    # The kernel's outputs come from torch.empty: poisoned (max int) here, so an unwritten element shows.
    det, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        got = ep_recv_rows_keys(meta_QC, counts_PW, **kw)
    finally:
        torch.use_deterministic_algorithms(det)
        torch.utils.deterministic.fill_uninitialized_memory = fill
    for name, a, b in zip(("row_Q", "key_Q", "token_offsets"), got, want, strict=True):
        assert a.dtype == torch.int32 and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name}: {a.tolist()[:20]} vs {b.tolist()[:20]}"
    if case == "several_programs":
        assert meta_QC.shape[0] > 1024
    # The keys' meaning, counted here independently: pair q of segment (c, p) has key group c (its chunk) and
    # its local expert in the low part.
    P, N, L, rank = kw["world_size"], kw["num_chunks"], kw["num_local_experts"], kw["rank"]
    groups = []
    for c in range(N):
        for p in range(P):
            n_pairs = int(counts_PW[p, kw["pair_base"] + c * P + rank])
            groups += [c] * n_pairs
    key = got[1].long().cpu()
    assert key.tolist() == [g * L + int(e) for g, e in zip(groups, meta_QC[:, 1].cpu().tolist(), strict=True)]
    C = kw.get("slot_rows", 0)
    if C:  # pair q of source p's slot sits at row p * C + its row in the segment; a slot's empty rows own no pair
        seg = [p for p in range(P) for _ in range(int(counts_PW[p, kw["pair_base"] + rank]))]
        rows = [p * C + int(r) for p, r in zip(seg, meta_QC[:, 0].cpu().tolist(), strict=True)]
        assert got[0].long().cpu().tolist() == rows
        toff = got[2].long().cpu()
        assert toff[-1] == len(rows) and bool((toff.diff() >= 0).all())
        assert [int(toff[u + 1] - toff[u]) for u in range(kw["num_recv_rows"])] == [
            rows.count(u) for u in range(kw["num_recv_rows"])
        ]


def test_ep_recv_rows_keys_rejects_bad_input():
    from sonic_megatron.token_dispatch.triton_recv import ep_recv_rows_keys

    meta_QC, counts_PW, kw = _inputs(**CASES["p2_n1"])
    with pytest.raises(ValueError, match="meta_QC must be int32"):
        ep_recv_rows_keys(meta_QC.long(), counts_PW, **kw)
    with pytest.raises(ValueError, match="counts_PW must be int64"):
        ep_recv_rows_keys(meta_QC, counts_PW.int(), **kw)
