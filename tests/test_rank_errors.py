"""One rank's bad input raises the same clear error on every rank of the expert-parallel group, in time, instead of
leaving the others waiting in a collective: whatever the layer call could refuse on one rank alone is checked before
its first collective and rides in the plan's header, so that every rank raises together.

Rank 1 alone gets bad input -- x's dtype, hidden size or token count, the router's scores or expert indices, the
experts' weights, a backend that refuses them or cannot run, an argument that is no tensor -- through
SonicMoELayer's method split (the step-wise mode and the pipelined one, called as Megatron's MoELayer.forward calls
them, forward and backward) and through token_dispatch's ``expert_parallel_experts``, over gloo at 2 and 4 ranks.
Every rank must raise an ``EPInputError`` naming the argument, what it must be and what it got; afterwards a good
call works on every rank (the group is still in step). One process group per size runs every case (Megatron's
import dominates its time); a rank left waiting fails the fixture at its time limit instead of hanging the run.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed

BAD = 1  # the one rank with bad input
S, B, H, E = 3, 2, 32, 8  # tokens [S, B] per rank, hidden size, experts (moe_config's)
T = S * B
TIME_LIMIT = 150.0  # seconds for a whole group (4 ranks importing Megatron on a loaded 2-core machine included)

# case -> words every rank's message must contain
LAYER_CASES = {
    "x_dtype": ["rank 1", "x.dtype and w1.dtype must be equal", "torch.float64 and torch.float32"],
    "x_hidden_size": ["rank 1", "w1.shape[2] must be x.shape[1] = 40", "got 32"],
    "x_token_count": ["rank 1", "x.shape[0] must be the routing's token count 6", "got 5"],
    "scores_shape": ["rank 1", "routing.scores_TK.shape must be (6, 2)", "got (6, 1)"],
    "scores_dtype": ["routing scores dtype differs between ranks", "torch.float64", "the same on every rank"],
    "expert_index_too_large": ["rank 1", f"expert indices must be in [0, num_experts = {E})", f", {E}]"],
    "expert_index_negative": ["rank 1", f"expert indices must be in [0, num_experts = {E})", "got values in [-1,"],
    "indices_dtype": ["rank 1", "routing.indices_TK.dtype must be int32 or int64", "got torch.float32"],
    "expert_twice": ["rank 1", "routing.indices_TK must name K = 2 different experts"],
    "weights_dtype": ["rank 1", "x.dtype and w1.dtype must be equal", "torch.float32 and torch.float64"],
    "backend_refuses": ["rank 1", "backend 'stand-in': w1 must be contiguous", "got (1, 2, 3)"],
}
MODES = {"stepwise": {}, "pipelined": {"num_chunks": 2}}
API_CASES = {
    "backend_cannot_run": ["rank 1", "backend='cute' cannot run", "cpu"],
    "x_not_a_tensor": ["rank 1", "x must be a 2-D tensor [T, D] (a torch.Tensor)", "got list"],
    "routing_not_a_routing": ["rank 1", "routing must be TopKRouting or FlatRouting", "got NoneType"],
    "weights_not_leaves_with_wgrad": ["rank 1", "with wgrad, w1 and w2 must be leaf tensors"],
}


def _refuse(x_TD, w1_EGD, w2_EDF, activation):
    """A backend's argument rule failing on this rank only (as the cute backend's 16-byte rows or contiguous
    weights): the plan runs it before its first collective."""
    raise ValueError("backend 'stand-in': w1 must be contiguous, got (1, 2, 3)")


def _bad_layer_input(case, layer, x, routed):
    """(x, routed) of ``case`` on the bad rank; weight and backend cases change the layer (undone by the caller)."""
    from sonic_megatron.kernels import torch_backend

    idx = routed.indices_TK.clone()
    if case == "x_dtype":
        x = x.double()
    elif case == "x_hidden_size":
        x = torch.randn(S, B, H + 8)
    elif case == "x_token_count":
        x = x.reshape(T, 1, H)[:-1]
    elif case == "scores_shape":
        routed = dataclasses.replace(routed, scores_TK=routed.scores_TK[:, :1])
    elif case == "scores_dtype":
        routed = dataclasses.replace(routed, scores_TK=routed.scores_TK.double())
    elif case in ("expert_index_too_large", "expert_index_negative", "expert_twice", "indices_dtype"):
        if case == "expert_index_too_large":
            idx[0, 0] = E
        elif case == "expert_index_negative":
            idx[0, 0] = -1
        elif case == "expert_twice":
            idx[0, 1] = idx[0, 0]
        else:
            idx = idx.float()
        routed = dataclasses.replace(routed, indices_TK=idx)
    elif case == "weights_dtype":
        layer.experts.double()
    elif case == "backend_refuses":
        torch_backend.check_supported = _refuse
    return x, routed


def _undo(case, layer):
    from sonic_megatron.kernels import torch_backend

    if case == "weights_dtype":
        layer.experts.float()
    if case == "backend_refuses":
        del torch_backend.check_supported


def _layer_call(layer, x, routed):
    """Megatron's MoELayer.forward step by step (route given), then backward: the output."""
    x = x.detach().requires_grad_()
    local, probs = layer.preprocess(x, routed)
    dispatched, probs = layer.dispatch(local, probs)
    out, _ = layer.routed_experts_compute(dispatched, probs)
    y = layer.postprocess(layer.combine(out), None)
    y.sum().backward()
    return y.detach()


def _outcome(fn):
    """(the EPInputError's message or what else happened, seconds taken)."""
    from sonic_megatron.token_dispatch import EPInputError

    t0 = time.perf_counter()
    try:
        fn()
        msg = "no error"
    except EPInputError as exc:
        msg = str(exc)
    except Exception as exc:  # noqa: BLE001 - reported: a rank that failed alone, or in the wrong way
        msg = f"not an EPInputError: {type(exc).__name__}: {exc}"
    return msg, time.perf_counter() - t0


def _layer_cases(rank, P):
    from sonic_megatron.config import SonicConfig
    from sonic_megatron.layer import SonicMoELayer
    from sonic_megatron.testing import moe_config

    results, finite = {}, {}
    for mode, options in MODES.items():
        torch.manual_seed(0)  # the same weights on every rank (as after Megatron's initialisation)
        layer = SonicMoELayer(moe_config(), sonic_config=SonicConfig(backend="torch", **options))
        torch.manual_seed(1 + rank)
        x = torch.randn(S, B, H)
        routed = layer.route(x)[0]
        for case in LAYER_CASES:
            bad_x, bad_routed = _bad_layer_input(case, layer, x, routed) if rank == BAD else (x, routed)
            try:
                results[f"{mode}/{case}"] = _outcome(lambda: _layer_call(layer, bad_x, bad_routed))  # noqa: B023
            finally:
                if rank == BAD:
                    _undo(case, layer)
        finite[mode] = bool(torch.isfinite(_layer_call(layer, x, routed)).all())
    return results, finite


def _api_inputs(rank):
    from sonic_megatron.kernels import TopKRouting

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g)
    s, i = torch.randn(T, E, generator=g).softmax(-1).topk(2, dim=-1)
    w1 = torch.randn(E // dist.get_world_size(), 2 * 16, H, generator=g, requires_grad=True)
    w2 = torch.randn(E // dist.get_world_size(), H, 16, generator=g, requires_grad=True)
    return x, TopKRouting(s, i), w1, w2


def _api_call(rank, case):
    from sonic_megatron.token_dispatch import DeferredWeightGrad, expert_parallel_experts

    x, routing, w1, w2 = _api_inputs(rank)
    kw = dict(group=dist.group.WORLD, num_experts=E, backend="torch")
    bad = rank == BAD and case is not None
    if case == "backend_cannot_run" and bad:
        kw["backend"] = "cute"
    elif case == "x_not_a_tensor" and bad:
        x = x.tolist()
    elif case == "routing_not_a_routing" and bad:
        routing = None
    elif case == "weights_not_leaves_with_wgrad":
        kw["wgrad"] = DeferredWeightGrad()
        if bad:
            w1 = w1 * 1
    out = expert_parallel_experts(x, routing, w1, w2, **kw)
    out.sum().backward()
    return out.detach()


def _worker(rank, P):
    import warnings

    warnings.filterwarnings("ignore")  # Megatron's "no TE / no Apex" notices
    from sonic_megatron.megatron_compat import patch_megatron_for_cpu
    from sonic_megatron.testing import init_model_parallel

    patch_megatron_for_cpu()
    init_model_parallel(ep=P)
    results, finite = _layer_cases(rank, P)
    for case in API_CASES:
        results[f"api/{case}"] = _outcome(lambda: _api_call(rank, case))  # noqa: B023
    finite["api"] = bool(torch.isfinite(_api_call(rank, None)).all())
    return {"results": results, "finite": finite}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"{p}ranks")
def outcomes(request):
    return run_distributed(_worker, request.param, timeout=TIME_LIMIT)


CASES = {f"{m}/{c}": words for m in MODES for c, words in LAYER_CASES.items()}
CASES.update({f"api/{c}": words for c, words in API_CASES.items()})


@pytest.mark.parametrize("case", list(CASES))
def test_one_bad_rank_raises_on_every_rank(outcomes, case):
    for rank, out in enumerate(outcomes):
        msg, seconds = out["results"][case]
        for word in CASES[case]:
            assert word in msg, f"rank {rank}, {case}: {word!r} not in {msg!r}"
        assert seconds < 30, f"rank {rank}, {case}: raised after {seconds:.1f} s (a wait in a collective)"


def test_the_group_is_in_step_after_the_errors(outcomes):
    for rank, out in enumerate(outcomes):
        assert all(out["finite"].values()), f"rank {rank}: {out['finite']}"


def test_received_pairs_beyond_int32_rows_are_refused_for_every_rank_alike():
    """Every rank knows every rank's counts, so the bound on what one rank receives raises on all of them."""
    from sonic_megatron.token_dispatch import EPInputError
    from sonic_megatron.token_dispatch.sizes import check_received_pairs, pair_base

    P = 2
    counts = [[0] * (2 * pair_base(P)) for _ in range(P)]
    check_received_pairs(counts)
    for src in range(P):  # each source sends 2^30 pairs to rank 1 in chunk 0
        counts[src][pair_base(P) + 1] = 2**30
    with pytest.raises(EPInputError, match=r"the routed pairs rank 1 receives must be < 2147483647 .*got 2147483648"):
        check_received_pairs(counts)
