"""SonicMoELayer vs Megatron's stock MoELayer (SequentialMLP experts, alltoall dispatcher), same weights:
outputs and every gradient at EP=1 and EP=2 over gloo, in float64 (must agree to 1e-12) and float32 (the
2x-PyTorch-error rule against a float64 stock run), for Megatron router options, shared experts (with and
without overlap), Megatron's own dispatcher with Sonic experts, the pipelined mode (num_chunks=2 + re-dispatch
in backward), zero-token experts and an EP rank that receives nothing. One pair of processes runs every case
(Megatron imports are slow); each case is reported as its own test."""

from __future__ import annotations

import pytest
import torch

from sonic_megatron.compare import Case
from sonic_megatron.config import SonicConfig

TORCH = SonicConfig(backend="torch")
SOFTMAX_OPTS = dict(
    moe_router_pre_softmax=True,
    moe_router_topk_scaling_factor=2.0,
    moe_z_loss_coeff=1e-3,
    moe_router_load_balancing_type="aux_loss",
    moe_aux_loss_coeff=1e-2,
)
SIGMOID_OPTS = dict(
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_num_groups=4,
    moe_router_group_topk=2,
    moe_router_load_balancing_type="seq_aux_loss",
    moe_aux_loss_coeff=1e-2,
)
SHARED = dict(moe_shared_expert_intermediate_size=40)

CASES = [
    Case("plain"),
    Case("softmax_options", SOFTMAX_OPTS),
    Case("sigmoid_bias_groups", SIGMOID_OPTS),
    Case("shared_experts", SHARED),
    Case("shared_experts_overlap", dict(SHARED, moe_shared_expert_overlap=True)),
    Case("megatron_dispatcher", sonic=SonicConfig(backend="torch", dispatcher="megatron")),
    Case(
        "allgather_megatron_dispatcher",
        dict(moe_token_dispatcher_type="allgather"),
        sonic=SonicConfig(backend="torch", dispatcher="megatron"),
    ),
    Case(
        "pipelined_chunks_redispatch", sonic=SonicConfig(backend="torch", num_chunks=2, redispatch_x_in_backward=True)
    ),
    Case("top4", dict(moe_router_topk=4)),
    Case("one_expert", route="one_expert"),
    Case("skewed_rank0_only", route="skewed"),
    Case("fp32", dtype=torch.float32, tokens=(16, 4)),
    Case("fp32_shared", SHARED, dtype=torch.float32, tokens=(16, 4)),
]
EP_SIZES = (1, 2)


def _worker(rank, world):
    from sonic_megatron.compare import compare_cases

    return compare_cases(CASES, EP_SIZES, torch.device("cpu"), seed=10 + rank)


@pytest.fixture(scope="module")
def results():
    from sonic_megatron.testing import spawn

    return spawn(_worker, 2, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("ep", EP_SIZES)
@pytest.mark.parametrize("case", [c.name for c in CASES])
def test_plugin_matches_stock(results, case, ep):
    for rank, res in enumerate(results):
        entry = res[f"{case}@ep{ep}"]
        assert not entry["failures"], f"rank {rank}: {entry['failures']}\n{entry.get('trace', entry.get('errors'))}"


def test_the_precision_rule_fails_a_second_call_that_differs():
    """``passes``: a layer whose second call differs from its first fails, whatever its errors; the float64 rule
    reads every error but the repeat flag, the low-precision rule the bounds."""
    from sonic_megatron.compare import passes

    assert passes({"out": 0.0, "repeat_differs": 0.0}, torch.float64) == []
    assert passes({"out": 0.0, "repeat_differs": 1.0}, torch.float64) == [
        "the layer's second call differs from its first"
    ]
    assert passes({"out": 1e-9, "repeat_differs": 0.0}, torch.float64) == ["out: 1e-09"]
    bound = {"out": (1e-3, 1e-3, 1.0)}
    assert passes({"bound": bound, "repeat_differs": 0.0}, torch.float32) == []
    assert passes({"bound": bound, "repeat_differs": 1.0}, torch.float32) == [
        "the layer's second call differs from its first"
    ]
