"""The slots' kernels (token_dispatch/triton_slots.py) against their PyTorch references, bitwise, on CPU under
TRITON_INTERPRET=1 (compiled on a GPU when present). The row slots' layout (slots.slot_layout_torch): full and partly
empty slots, a destination that gets nothing, rows past a slot (a rank with more tokens than C: the plan then falls
back to exact split sizes), entries past the send rows, several programs. The received pairs' rows and keys
(recv_side.slotted_rows_keys_torch): partly full, full and empty slots, a bad peer's rows and experts out of range,
several programs."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from sonic_megatron.token_dispatch.recv_side import slotted_rows_keys_torch  # noqa: E402
from sonic_megatron.token_dispatch.slots import slot_layout_torch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = {
    "partly_full": dict(rows=[3, 5, 1, 4], C=6, extra=7),
    "a_destination_gets_nothing": dict(rows=[4, 0, 2], C=4, extra=0),
    "exactly_full": dict(rows=[5, 5], C=5, extra=3),
    "rows_past_a_slot": dict(rows=[2, 9, 3], C=6, extra=2),
    "nothing_sent": dict(rows=[0, 0], C=3, extra=4),
    "several_programs": dict(rows=[700, 1300, 5, 900], C=1400, extra=1500),
    "one_rank_strided_count": dict(rows=[5], C=8, extra=3, count_stride=7),
    "strided_counts": dict(rows=[3, 5, 1], C=6, extra=2, count_stride=4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_slot_layout_kernel_matches_torch(case):
    from sonic_megatron.token_dispatch.triton_slots import slot_layout_triton

    rows, C, extra = CASES[case]["rows"], CASES[case]["C"], CASES[case]["extra"]
    g = torch.Generator().manual_seed(len(case))
    T = max(1, C + 3)
    S = sum(rows)
    # send rows: per destination ascending tokens; entries past S hold the sentinel T (as the send side's)
    toks = [torch.randperm(T, generator=g)[:n].sort().values for n in rows]
    send_token_idx_R = torch.cat([*toks, torch.full((extra,), T)]).to(DEVICE)
    stride = CASES[case].get("count_stride", 1)  # a column of the counts matrix, as the receive side passes it
    rows_P = torch.tensor([[n] * stride for n in rows], dtype=torch.int64).to(DEVICE)[:, 0]
    P = len(rows)
    want_pos, want_tok = slot_layout_torch(send_token_idx_R, rows_P, P, C)
    det, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # an unwritten output element shows
    try:
        got_pos, got_tok = slot_layout_triton(send_token_idx_R, rows_P, P, C)
    finally:
        torch.use_deterministic_algorithms(det)
        torch.utils.deterministic.fill_uninitialized_memory = fill
    assert torch.equal(got_pos, want_pos) and torch.equal(got_tok, want_tok)
    # the meaning, counted here: send row s of destination p sits at p * C + (its place among p's rows)
    pos, tok, s = want_pos.cpu().tolist(), want_tok.cpu().tolist(), 0
    for p, n in enumerate(rows):
        for j in range(n):
            assert pos[s] == (p * C + j if j < C else P * C)
            if j < C:
                assert tok[p * C + j] == int(send_token_idx_R[s])
            s += 1
        assert all(tok[p * C + j] == 0 for j in range(n, C))
    assert all(v == P * C for v in pos[S:])


RECV_CASES = {  # pairs each source sent here (per slot of Cq), C rows per slot, L local experts
    "partly_full": dict(arrived=[5, 2, 7], Cq=8, C=4, L=3),
    "full_and_empty": dict(arrived=[6, 0], Cq=6, C=3, L=2),
    "nothing_arrived": dict(arrived=[0, 0, 0, 0], Cq=5, C=2, L=4),
    "a_bad_peer": dict(arrived=[9, 4], Cq=9, C=5, L=3, bad=True),
    "several_programs": dict(arrived=[1500, 700, 1999], Cq=2000, C=600, L=16),
}


@pytest.mark.parametrize("case", list(RECV_CASES))
def test_slotted_rows_keys_kernel_matches_torch(case):
    from sonic_megatron.token_dispatch.triton_slots import slotted_rows_keys_triton

    c = RECV_CASES[case]
    arrived, Cq, C, L = c["arrived"], c["Cq"], c["C"], c["L"]
    P = len(arrived)
    g = torch.Generator().manual_seed(len(case))
    # each source's pairs in its slot: rows ascending within the source (as a send side orders them), local experts
    pairs = torch.zeros(P * Cq, 3, dtype=torch.int32)
    pairs[:, 2] = torch.randint(-(2**31), 2**31 - 1, (P * Cq,), generator=g, dtype=torch.int64).int()  # score bits
    for p, n in enumerate(arrived):
        pairs[p * Cq : p * Cq + n, 0] = torch.randint(0, C, (n,), generator=g).sort().values.int()
        pairs[p * Cq : p * Cq + n, 1] = torch.randint(0, L, (n,), generator=g).int()
        pairs[p * Cq + n : (p + 1) * Cq, :2] = torch.randint(-9, 99, (Cq - n, 2), generator=g).int()  # stale bytes
    if c.get("bad"):  # a peer's pairs past the receive buffer and its experts (the header check raises later)
        pairs[1, 0], pairs[2, 0], pairs[3, 1], pairs[Cq, 1] = C + 7, -3, L + 2, -1
    arrived_P = torch.tensor(arrived, dtype=torch.int64)
    slot_of = slot_layout_torch(torch.arange(P * Cq), arrived_P, P, Cq)[0]
    kw = dict(world_size=P, num_local_experts=L, row_slots=C, pair_slots=Cq)
    want = slotted_rows_keys_torch(pairs.to(DEVICE), slot_of.to(DEVICE), **kw)
    got = slotted_rows_keys_triton(pairs.to(DEVICE), slot_of.to(DEVICE), **kw)
    for name, a, b in zip(("row_Q", "key_Q", "token_offsets"), got, want, strict=True):
        assert a.dtype == b.dtype == torch.int32 and torch.equal(a.cpu(), b.cpu()), name
    # the meaning, counted here: the real pairs first, source by source, each at its source's rows
    row_Q, key_Q, offsets = (t.cpu().tolist() for t in want)
    q = 0
    for p, n in enumerate(arrived):
        for j in range(n):
            r, e = int(pairs[p * Cq + j, 0]), int(pairs[p * Cq + j, 1])
            assert row_Q[q] == p * C + min(max(r, 0), C - 1) and key_Q[q] == min(max(e, 0), L)
            q += 1
    assert all(k == L for k in key_Q[q:]) and all(r == P * C - 1 for r in row_Q[q:])
    assert offsets[0] == 0 and offsets[-1] == q and offsets == sorted(offsets)
