"""Expert tensor parallelism (ETP 2) in the plugin's layer, on 4 gloo ranks, at TP = ETP = 2 (sequence parallel:
the ranks of an ETP group hold shards of one sequence) and at TP 1 (Megatron's "MoE parallel folding": attention is
data-parallel, so the ranks of an ETP group route different micro-batches, which both layers gather over it).

* Against Megatron's stock MoELayer (SequentialMLP experts with ETP-sharded fc1/fc2, alltoall dispatcher with its
  all-gather / reduce-scatter over the ETP group), same weights and inputs: outputs and every gradient (input,
  router, expert weights, shared experts) at EP 1 (two independent ETP pairs of ranks) and EP 2 (ETP groups
  {0, 1}, {2, 3}; EP groups {0, 2}, {1, 3}), float64 to 1e-12 and float32 by the 2x-stock-error rule
  (``compare.passes``), for router options, shared experts, Megatron's own dispatcher with Sonic experts, the
  pipelined mode, Megatron's capacity factor (padded and exact flat routings), zero-token experts and an EP rank
  that receives nothing.
* Token rounding (no stock counterpart): the layer at ETP 2 equals the layer at ETP 1, with the whole expert
  weights, run on each ETP group's gathered tokens (the reference's EP groups hold the same token sets), in
  float64: outputs and each rank's shard of the expert weight gradients to 1e-12; dX and the router gradient
  (summed over the ETP group) to 1e-6 of their magnitude, because the dense probabilities that weigh the pairs
  rounding adds are fp32 in SonicRouter, so their gradient is summed over the ETP group as fp32 partials; and
  rounding changed the output there.
* The grouped-GEMM baseline that ``bench e2e`` compares against (``GroupedMMExperts`` in the stock layer) equals
  SequentialMLP at ETP 2 too, and both hold Megatron's ETP shapes (fc2 columns F / ETP).
One process group runs every case (Megatron imports are slow); each case is reported as its own test."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sonic_megatron.compare import Case, case_key
from sonic_megatron.config import SonicConfig

ETP = 2
TP_SIZES = (2, 1)  # TP = ETP, and ETP decoupled from TP ("MoE parallel folding")
WORLD = 4
EP_SIZES = (1, 2)
SP = dict(sequence_parallel=True)  # Megatron's MoELayer refuses tensor parallelism without it in training
SHARED = dict(moe_shared_expert_intermediate_size=40)


def _cap(factor, policy, pad):
    return dict(moe_expert_capacity_factor=factor, moe_token_drop_policy=policy, moe_pad_expert_input_to_capacity=pad)


CASES = [
    Case("plain"),
    Case(
        "softmax_options",
        dict(
            moe_router_pre_softmax=True,
            moe_router_topk_scaling_factor=2.0,
            moe_z_loss_coeff=1e-3,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=1e-2,
        ),
    ),
    Case("shared_experts", SHARED),
    Case("shared_experts_overlap", dict(SHARED, moe_shared_expert_overlap=True)),
    Case("megatron_dispatcher", sonic=SonicConfig(backend="torch", dispatcher="megatron")),
    Case(
        "pipelined_chunks_redispatch",
        sonic=SonicConfig(backend="torch", num_chunks=2, redispatch_x_in_backward=True),
    ),
    Case("cf0.5_probs", _cap(0.5, "probs", False), tokens=(16, 2)),
    Case("cf1.0_position_pad", _cap(1.0, "position", True), tokens=(16, 2)),
    Case("one_expert", route="one_expert"),
    Case("skewed_rank0_only", route="skewed"),
    Case("fp32", dtype=torch.float32, tokens=(16, 4)),
]


def _cases(tp: int) -> list[Case]:
    """CASES at tensor-parallel size ``tp``: with sequence parallelism where ``tp`` > 1."""
    return [dataclasses.replace(c, overrides={**c.overrides, **SP}) for c in CASES] if tp > 1 else CASES


ROUNDING = SonicConfig(backend="torch", token_rounding="nearest", rounding_tile=4)
E, H, F, T = 8, 32, 48, 24  # rounding check: experts, hidden, expert ffn, tokens per rank


def _rounding_layer(sonic: SonicConfig, w1, w2, router):
    """A float64 plugin layer at Megatron's parallel state (already set) holding this rank's experts of the global
    weights, its ETP share of them."""
    from megatron.core import parallel_state as ps

    from sonic_megatron.layer import SonicMoELayer
    from sonic_megatron.testing import etp_shard, moe_config

    overrides = SP if ps.get_tensor_model_parallel_world_size() > 1 else {}
    config = moe_config(num_moe_experts=E, hidden_size=H, moe_ffn_hidden_size=F, moe_router_dtype="fp64", **overrides)
    layer = SonicMoELayer(config, sonic_config=sonic).to(torch.float64)
    n = E // ps.get_expert_model_parallel_world_size()
    sl = slice(ps.get_expert_model_parallel_rank() * n, (ps.get_expert_model_parallel_rank() + 1) * n)
    l1, l2 = etp_shard(w1[sl], w2[sl], ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
    with torch.no_grad():
        layer.experts.weight1.copy_(l1)
        layer.experts.weight2.copy_(l2)
        layer.router.weight.copy_(router)
    return layer, sl


def _err(got: torch.Tensor, want: torch.Tensor) -> list[float]:
    return [float((got - want).abs().max()), float(want.abs().max())]


def _rounding_check(rank: int, ep: int, tp: int) -> dict:
    """[max-abs error, reference magnitude] of the ETP 2 layer (at TP ``tp``) with token rounding against the ETP 1
    layer on gathered tokens (see the module docstring), plus how much rounding moved the reference's output."""
    import torch.distributed as dist

    from sonic_megatron.compare import run_layer
    from sonic_megatron.testing import etp_shard, init_model_parallel

    gen = torch.Generator().manual_seed(5)
    w1 = torch.randn(E, 2 * F, H, generator=gen, dtype=torch.float64) / H**0.5
    w2 = torch.randn(E, H, F, generator=gen, dtype=torch.float64) / F**0.5
    router = torch.randn(E, H, generator=gen, dtype=torch.float64)
    x = torch.randn(WORLD, T, 1, H, generator=gen, dtype=torch.float64)  # every rank's tokens, [S, B=1, H] each
    g = torch.randn(WORLD, T, 1, H, generator=gen, dtype=torch.float64)

    init_model_parallel(ep=ep, tp=tp, etp=ETP)  # ETP groups {2k, 2k + 1}
    layer, _ = _rounding_layer(ROUNDING, w1, w2, router)
    layer.train()
    out, grads = run_layer(layer, x[rank], g[rank])
    etp_results = [None] * WORLD
    dist.all_gather_object(etp_results, (out, grads))

    # The reference rank with expert-parallel rank e holds ETP group k = rank % (WORLD / ETP)'s tokens: with EP 2
    # its EP group then holds groups 0 and 1 at EP ranks 0 and 1, as the ETP 2 layer's EP groups {0, 2} and {1, 3}
    # do.
    k = rank % (WORLD // ETP)
    members = (ETP * k, ETP * k + 1)
    init_model_parallel(ep=ep, tp=1)
    errors = {}
    outs = {}
    for name, sonic in (("rounded", ROUNDING), ("topk", SonicConfig(backend="torch"))):
        ref, sl = _rounding_layer(sonic, w1, w2, router)
        ref.train()
        outs[name], ref_grads = run_layer(ref, torch.cat([x[m] for m in members]), torch.cat([g[m] for m in members]))
        if name != "rounded":
            continue
        for j, m in enumerate(members):
            got_out, got = etp_results[m]
            rows = slice(j * T, (j + 1) * T)
            errors[f"out.{j}"] = _err(got_out, outs[name][rows])
            errors[f"grad.x.{j}"] = _err(got["x"], ref_grads["x"][rows])
            s1, s2 = etp_shard(ref_grads["w1"], ref_grads["w2"], j, ETP)
            errors[f"grad.w1.{j}"] = _err(got["w1"], s1)
            errors[f"grad.w2.{j}"] = _err(got["w2"], s2)
        errors["grad.router"] = _err(sum(etp_results[m][1]["router"] for m in members), ref_grads["router"])
    moved = float((outs["rounded"] - outs["topk"]).abs().max())
    return {"errors": errors, "rounding_moved_output": moved}


def _baseline_check(rank: int, ep: int, tp: int) -> dict:
    """Max-abs errors of the stock layer with ``GroupedMMExperts`` against the stock layer with SequentialMLP at
    TP ``tp``, ETP 2, and the fc2 columns both hold."""
    import copy

    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec

    from sonic_megatron.baseline import GroupedMMExperts
    from sonic_megatron.compare import _stock_spec, run_layer
    from sonic_megatron.spec import moe_submodules_of
    from sonic_megatron.testing import copy_sequential_to_sonic, init_model_parallel, moe_config

    init_model_parallel(ep=ep, tp=tp, etp=ETP)
    config = moe_config(moe_router_dtype="fp64", **(SP if tp > 1 else {}))
    torch.manual_seed(1000)
    submodules = moe_submodules_of(_stock_spec())
    stock = MoELayer(config, copy.deepcopy(submodules)).to(torch.float64)
    grouped_submodules = dataclasses.replace(copy.deepcopy(submodules), experts=ModuleSpec(module=GroupedMMExperts))
    grouped = MoELayer(config, grouped_submodules).to(torch.float64)
    with torch.no_grad():
        grouped.router.weight.copy_(stock.router.weight)
        copy_sequential_to_sonic(stock.experts, grouped.experts)
    gen = torch.Generator().manual_seed(7 + rank)
    x, g = (torch.randn(8, 2, config.hidden_size, generator=gen, dtype=torch.float64) for _ in range(2))
    (out_ref, grads_ref), (out, grads) = run_layer(stock, x, g), run_layer(grouped, x, g)
    errors = {
        "out": float((out - out_ref).abs().max()),
        **{k: float((grads[k] - v).abs().max()) for k, v in grads_ref.items()},
    }
    columns = [stock.experts.local_experts[0].linear_fc2.weight.shape[1], grouped.experts.weight2.shape[2]]
    return {"errors": errors, "fc2_columns": columns, "ffn": config.moe_ffn_hidden_size}


def _worker(rank, world):
    from sonic_megatron.compare import compare_cases

    results = {}
    for tp in TP_SIZES:
        results.update(compare_cases(_cases(tp), EP_SIZES, torch.device("cpu"), seed=30 + rank, tp=tp, etp=ETP))
        for ep in EP_SIZES:
            results[case_key("rounding", ep, tp, ETP)] = _rounding_check(rank, ep, tp)
            results[case_key("baseline", ep, tp, ETP)] = _baseline_check(rank, ep, tp)
    return results


@pytest.fixture(scope="module")
def results():
    from sonic_megatron.testing import spawn

    return spawn(_worker, WORLD, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("ep", EP_SIZES)
@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("case", [c.name for c in CASES])
def test_plugin_matches_stock_at_expert_tensor_parallel_2(results, case, tp, ep):
    for rank, res in enumerate(results):
        entry = res[case_key(case, ep, tp, ETP)]
        assert not entry["failures"], f"rank {rank}: {entry['failures']}\n{entry.get('trace', entry.get('errors'))}"


@pytest.mark.slow
@pytest.mark.parametrize("ep", EP_SIZES)
@pytest.mark.parametrize("tp", TP_SIZES)
def test_token_rounding_at_etp_2_equals_etp_1_on_the_gathered_tokens(results, tp, ep):
    for rank, res in enumerate(results):
        entry = res[case_key("rounding", ep, tp, ETP)]
        bad = {
            k: (err, mag)
            for k, (err, mag) in entry["errors"].items()
            if err > (1e-6 * mag if k.startswith(("grad.x", "grad.router")) else 1e-12)
        }
        assert not bad, f"rank {rank}: {bad}"
        assert entry["rounding_moved_output"] > 1e-3, f"rank {rank}: token rounding changed nothing: {entry}"


@pytest.mark.slow
@pytest.mark.parametrize("ep", EP_SIZES)
@pytest.mark.parametrize("tp", TP_SIZES)
def test_grouped_baseline_matches_stock_at_etp_2(results, tp, ep):
    for rank, res in enumerate(results):
        entry = res[case_key("baseline", ep, tp, ETP)]
        bad = {k: v for k, v in entry["errors"].items() if v > 1e-12}
        assert not bad, f"rank {rank}: {bad}"
        assert entry["fc2_columns"] == [entry["ffn"] // ETP] * 2, f"rank {rank}: {entry}"
