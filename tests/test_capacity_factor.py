"""Megatron's capacity factor and drop-and-pad (``--moe-expert-capacity-factor``, ``--moe-token-drop-policy``,
``--moe-pad-expert-input-to-capacity``) in the plugin's layer: against the stock MoELayer (SequentialMLP experts,
Megatron's alltoall dispatcher) with the same weights and inputs, outputs and every gradient (input, router,
expert weights) in float64 at EP=1 and EP=2 over gloo, for capacities that drop pairs (0.5, 1.0; all tokens to
one expert), both drop policies, with and without padding to capacity; plus the flat routing built from
Megatron's map and the build-time refusal of token rounding together with a capacity factor."""

from __future__ import annotations

import pytest
import torch

from sonic_megatron.compare import Case
from sonic_megatron.config import SonicConfig

TORCH = SonicConfig(backend="torch")


def _cap(factor, policy, pad):
    return dict(moe_expert_capacity_factor=factor, moe_token_drop_policy=policy, moe_pad_expert_input_to_capacity=pad)


CASES = [
    Case(f"cf{factor}_{policy}{'_pad' if pad else ''}", _cap(factor, policy, pad), sonic=TORCH, tokens=(16, 2))
    for factor in (0.5, 1.0)
    for policy in ("probs", "position")
    for pad in (False, True)
]
CASES += [
    # every token's first choice is expert 0: most of its pairs are dropped whatever the policy
    Case("one_expert_probs", _cap(1.0, "probs", False), sonic=TORCH, route="one_expert", tokens=(16, 2)),
    Case("one_expert_position_pad", _cap(1.0, "position", True), sonic=TORCH, route="one_expert", tokens=(16, 2)),
    # the other router options still go through TopKRouter's path before the capacity
    Case(
        "cf0.5_softmax_options",
        dict(
            _cap(0.5, "probs", False),
            moe_router_pre_softmax=True,
            moe_router_topk_scaling_factor=2.0,
            moe_z_loss_coeff=1e-3,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=1e-2,
        ),
        sonic=TORCH,
        tokens=(16, 2),
    ),
    Case(
        "cf1.0_pipelined",
        _cap(1.0, "probs", False),
        sonic=SonicConfig(backend="torch", num_chunks=2, redispatch_x_in_backward=True),
        tokens=(16, 2),
    ),
    Case(
        "cf1.0_megatron_dispatcher_pad",
        _cap(1.0, "probs", True),
        sonic=SonicConfig(backend="torch", dispatcher="megatron"),
        tokens=(16, 2),
    ),
]
EP_SIZES = (1, 2)


def _worker(rank, world):
    from sonic_megatron.compare import compare_cases

    return compare_cases(CASES, EP_SIZES, torch.device("cpu"), seed=20 + rank)


@pytest.fixture(scope="module")
def results():
    from sonic_megatron.testing import spawn

    return spawn(_worker, 2, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("ep", EP_SIZES)
@pytest.mark.parametrize("case", [c.name for c in CASES])
def test_capacity_factor_matches_stock(results, case, ep):
    for rank, res in enumerate(results):
        entry = res[f"{case}@ep{ep}"]
        assert not entry["failures"], f"rank {rank}: {entry['failures']}\n{entry.get('trace', entry.get('errors'))}"


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("policy", ["probs", "position"])
def test_flat_routing_holds_the_maps_pairs(policy, pad):
    """The flat routing of TopKRouter's dropped (padded) map: its True entries sorted by token, with their probs,
    padding pairs after them where the count is only bounded."""
    from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping

    from sonic_megatron.router import RouterOutput
    from sonic_megatron.testing import moe_config

    T, E, K = 24, 8, 2
    config = moe_config(
        num_moe_experts=E,
        moe_router_topk=K,
        moe_expert_capacity_factor=0.75,
        moe_token_drop_policy=policy,
        moe_pad_expert_input_to_capacity=pad,
    )
    gen = torch.Generator().manual_seed(3)
    scores = torch.rand(T, E, generator=gen, dtype=torch.float64)
    top = scores.topk(K, dim=1).indices
    probs = torch.zeros_like(scores).scatter(1, top, scores.gather(1, top)).requires_grad_()
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, top, True)
    probs_d, map_d = apply_router_token_dropping(probs, routing_map, K, 0.75, policy, pad)
    assert int(map_d.sum()) < T * K or pad  # pairs were dropped
    flat = RouterOutput.from_megatron(probs_d, map_d, K, config).flat
    assert flat.padded == (not pad)
    tok, exp = map_d.nonzero(as_tuple=True)  # row-major: sorted by token, then expert
    n = tok.numel()
    assert torch.equal(flat.token_idx_R[:n], tok) and torch.equal(flat.expert_idx_R[:n], exp)
    assert torch.equal(flat.scores_R[:n], probs_d[tok, exp])
    if not pad:
        assert bool((flat.token_idx_R[n:] == T).all()) and bool((flat.expert_idx_R[n:] == E).all())
        assert bool((flat.scores_R[n:] == 0).all())
    else:
        assert flat.token_idx_R.numel() == n
    flat.scores_R.sum().backward()  # autograd reaches Megatron's probs
    assert torch.equal(probs.grad != 0, map_d)


def test_token_rounding_with_capacity_factor_fails_at_build():
    from sonic_megatron.config import validate_megatron_config
    from sonic_megatron.testing import moe_config

    config = moe_config(moe_expert_capacity_factor=1.0)
    assert validate_megatron_config(config, TORCH) == "swiglu"
    with pytest.raises(ValueError, match="moe_expert_capacity_factor=1.0.*SonicConfig.token_rounding='nearest'"):
        validate_megatron_config(config, SonicConfig(backend="torch", token_rounding="nearest"))


def test_bad_drop_policy_fails_at_build():
    from sonic_megatron.config import validate_megatron_config
    from sonic_megatron.testing import moe_config

    config = moe_config(moe_expert_capacity_factor=1.0, moe_token_drop_policy="random")
    with pytest.raises(ValueError, match="moe_token_drop_policy='random'"):
        validate_megatron_config(config, TORCH)
