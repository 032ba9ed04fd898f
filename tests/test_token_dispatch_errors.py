"""Bad input under expert parallelism: every rank raises the same clear EPInputError (no hang, even when
only one rank's input is wrong), and the group stays usable afterwards."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from sonic_megatron.kernels import FlatRouting, TopKRouting
from sonic_megatron.token_dispatch import EPInputError, TokenRounding, expert_parallel_experts

T, D, F, E, K = 6, 8, 4, 8, 2


def _inputs(rank, P, *, E=E, D=D, dtype=torch.float64, L=None):
    g = torch.Generator().manual_seed(rank)
    L = E // P if L is None else L
    x = torch.randn(T, D, generator=g, dtype=dtype)
    probs = torch.randn(T, E, generator=g, dtype=torch.float64).softmax(-1)
    s, i = probs.topk(K, dim=-1)
    w1 = torch.randn(L, 2 * F, D, generator=g, dtype=dtype)
    w2 = torch.randn(L, D, F, generator=g, dtype=dtype)
    return dict(x=x, routing=TopKRouting(s, i), w1=w1, w2=w2, num_experts=E, probs=probs)


def _call(a, **kw):
    return expert_parallel_experts(
        a["x"],
        a["routing"],
        a["w1"],
        a["w2"],
        group=dist.group.WORLD,
        num_experts=a["num_experts"],
        backend="torch",
        **kw,
    )


def _bad(rank, P, case):
    """Inputs of ``case`` for ``rank`` (only rank 1 is wrong unless the case says otherwise)."""
    kw = {}
    if case == "experts_not_multiple_of_P":
        a = _inputs(rank, P, E=7, L=1)
    elif case == "hidden_size_differs":
        a = _inputs(rank, P, D=D + 8 * (rank == 1))
    elif case == "dtype_differs":
        a = _inputs(rank, P, dtype=torch.float32 if rank == 1 else torch.float64)
    elif case == "num_experts_differs":
        a = _inputs(rank, P, E=2 * E if rank == 1 else E)
    elif case == "group_does_not_match_weights":  # weights sharded for an EP group half this size
        a = _inputs(rank, P, L=2 * E // P)
    elif case == "wrong_local_expert_count":
        a = _inputs(rank, P, L=E // P + (rank == 1))
    elif case == "expert_index_out_of_range":
        a = _inputs(rank, P)
        if rank == 1:
            idx = a["routing"].indices_TK.clone()
            idx[0, 0] = E
            a["routing"] = TopKRouting(a["routing"].scores_TK, idx)
    elif case == "flat_tokens_unsorted":
        a = _inputs(rank, P)
        tok = torch.tensor([0, 1, 2, 3]) if rank != 1 else torch.tensor([3, 1, 2, 0])
        a["routing"] = FlatRouting(tok, torch.tensor([0, 1, 2, 3]), torch.rand(4, dtype=torch.float64), T)
    elif case == "rounding_without_scores":
        a = _inputs(rank, P)
        kw = dict(rounding=TokenRounding(), rounding_scores_TE=None if rank == 1 else a["probs"])
    elif case == "rounding_duplicate_pairs":  # rounding needs unique (token, expert) pairs
        a = _inputs(rank, P)
        tok = torch.tensor([0, 0, 1]) if rank == 1 else torch.tensor([0, 1, 2])
        exp = torch.tensor([2, 2, 3]) if rank == 1 else torch.tensor([2, 3, 4])
        a["routing"] = FlatRouting(tok, exp, torch.rand(3, dtype=torch.float64), T)
        kw = dict(rounding=TokenRounding("up", 4), rounding_scores_TE=a["probs"])
    elif case == "rounding_expert_index_out_of_range":  # rounding runs before the header check: no fault
        a = _inputs(rank, P)
        if rank == 1:
            idx = a["routing"].indices_TK.clone()
            idx[0, 0] = E
            a["routing"] = TopKRouting(a["routing"].scores_TK, idx)
        kw = dict(rounding=TokenRounding("up", 4), rounding_scores_TE=a["probs"])
    elif case == "rounding_flat_tokens_out_of_range":
        a = _inputs(rank, P)
        tok = torch.tensor([0, 1, 2, 3 + T * (rank == 1)])
        a["routing"] = FlatRouting(tok, torch.tensor([0, 1, 2, 3]), torch.rand(4, dtype=torch.float64), T)
        kw = dict(rounding=TokenRounding("up", 4), rounding_scores_TE=a["probs"])
    elif case == "rounding_differs":
        a = _inputs(rank, P)
        kw = dict(rounding=TokenRounding("up" if rank == 1 else "down", 4), rounding_scores_TE=a["probs"])
    elif case == "num_chunks_differs":
        a = _inputs(rank, P)
        kw = dict(num_chunks=1 + (rank == 1))
    elif case == "activation_differs":
        a = _inputs(rank, P)
        kw = dict(activation="geglu" if rank == 1 else "swiglu")
    elif case == "routing_shape":
        a = _inputs(rank, P)
        if rank == 1:
            a["routing"] = TopKRouting(a["routing"].scores_TK[:, :1], a["routing"].indices_TK)
    else:
        raise AssertionError(case)
    return a, kw


CASES = {  # case -> words the message must contain
    "experts_not_multiple_of_P": ["num_experts", "multiple"],
    "hidden_size_differs": ["hidden size", "differs"],
    "dtype_differs": ["x.dtype", "differs"],
    "num_experts_differs": ["num_experts", "differs"],
    "group_does_not_match_weights": ["rank 0", "rank 1", "w1.shape[0]", "num_experts / P"],
    "wrong_local_expert_count": ["rank 1", "w1.shape[0]"],
    "expert_index_out_of_range": ["rank 1", "expert indices", str(E)],
    "flat_tokens_unsorted": ["rank 1", "sorted"],
    "rounding_without_scores": ["rank 1", "rounding_scores_TE"],
    "rounding_duplicate_pairs": ["rank(s) [1]", "unique"],
    "rounding_expert_index_out_of_range": ["rank 1", "expert indices", str(E)],
    "rounding_flat_tokens_out_of_range": ["rank 1", "sorted", f"[0, T = {T})"],
    "rounding_differs": ["rounding mode", "differs"],
    "num_chunks_differs": ["num_chunks", "differs"],
    "activation_differs": ["activation", "differs"],
    "routing_shape": ["rank 1", "scores_TK"],
}


def _errors_worker(rank, P):
    msgs = {}
    for case in CASES:
        a, kw = _bad(rank, P, case)
        try:
            _call(a, **kw)
            msgs[case] = None
        except EPInputError as exc:
            msgs[case] = str(exc)
    # The group is still in step: a valid call afterwards works on every rank.
    out = _call(_inputs(rank, P))
    msgs["after"] = bool(torch.isfinite(out).all())
    return msgs


@pytest.fixture(scope="module", params=[2, 4])
def error_messages(request):
    return run_distributed(_errors_worker, request.param, timeout=120)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_on_every_rank(error_messages, case):
    for rank, msgs in enumerate(error_messages):
        msg = msgs[case]
        assert msg is not None, f"rank {rank} did not raise for {case}"
        for word in CASES[case]:
            assert word in msg, f"rank {rank}, {case}: {word!r} not in {msg!r}"


def test_group_usable_after_errors(error_messages):
    assert all(m["after"] for m in error_messages)


def test_single_process_errors_name_the_argument():
    a = _inputs(0, 1)
    with pytest.raises(EPInputError, match=r"w1.shape\[2\]"):
        expert_parallel_experts(a["x"], a["routing"], a["w1"][:, :, :4], a["w2"], num_experts=E, backend="torch")
    with pytest.raises(EPInputError, match="x.shape\\[0\\]"):
        expert_parallel_experts(a["x"][:3], a["routing"], a["w1"], a["w2"], num_experts=E, backend="torch")
    with pytest.raises(EPInputError, match="num_chunks"):
        expert_parallel_experts(a["x"], a["routing"], a["w1"], a["w2"], num_experts=E, backend="torch", num_chunks=0)
    with pytest.raises(EPInputError, match="redispatch_x_in_backward must be a bool"):
        kw = dict(num_experts=E, backend="torch", redispatch_x_in_backward=1)
        expert_parallel_experts(a["x"], a["routing"], a["w1"], a["w2"], **kw)
    with pytest.raises(ValueError, match="comm_sms"):
        expert_parallel_experts(a["x"], a["routing"], a["w1"], a["w2"], num_experts=E, backend="torch", comm_sms=-1)
