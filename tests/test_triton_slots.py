"""The row slots' layout kernel (token_dispatch/triton_slots.py) against its PyTorch reference
(token_dispatch.slots.slot_layout_torch), bitwise, on CPU under TRITON_INTERPRET=1 (compiled on a GPU when present):
full and partly empty slots, a destination that gets nothing, rows past a slot (a rank with more tokens than C:
the plan then falls back to exact split sizes), entries past the send rows, several programs."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

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
