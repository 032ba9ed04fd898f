"""SonicRouter's fused top-K path (one Triton top-K + softmax kernel; on a GPU, or interpreted on CPU) against
Megatron's TopKRouter with the same weights: the same experts per token, scores and router-weight gradients
(with z-loss and the aux losses attached, and token rounding's dense probabilities read too) within the
2x-PyTorch-error rule against a float64 TopKRouter, and TopKRouter's own path for the options the kernel does not
cover."""

from __future__ import annotations

import json
import os

import pytest
import torch

FUSED_CASES = {
    "plain": dict(),
    "aux_zloss_scaling": dict(
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        moe_z_loss_coeff=1e-3,
        moe_router_topk_scaling_factor=2.5,
    ),
    "seq_aux_pre_softmax": dict(
        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2, moe_router_pre_softmax=True
    ),
    # token rounding's dense probabilities read too: one softmax, two outputs, one fused backward
    "aux_scaling_rounding_probs": dict(
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, moe_router_topk_scaling_factor=2.5
    ),
    "seq_aux_pre_softmax_rounding_probs": dict(
        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2, moe_router_pre_softmax=True
    ),
}
ROUNDING_PROBS = ("aux_scaling_rounding_probs", "seq_aux_pre_softmax_rounding_probs")
FALLBACK_CASES = {"sigmoid_bias": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)}


def _run(opts, dtype, fused_expected, rounding_probs=False):
    from megatron.core.transformer.moe.router import TopKRouter

    from sonic_megatron.config import SonicConfig
    from sonic_megatron.layer_options import LayerOptions
    from sonic_megatron.megatron_compat import default_pg_collection
    from sonic_megatron.router import SonicRouter, as_topk
    from sonic_megatron.testing import moe_config

    S, B, H = 24, 3, 32
    cfgs = {
        d: moe_config(hidden_size=H, num_moe_experts=16, moe_router_topk=4, moe_router_dtype=d, **opts)
        for d in ("fp32", "fp64")
    }
    # Megatron's gating moves a CPU router to the GPU wherever there is one: the GPU there, the CPU elsewhere.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    x = torch.randn(S, B, H).to(device)
    weight = torch.randn(16, H, dtype=torch.float64) * 0.5
    outs = {}
    for name, cls, dt in (
        ("sonic", SonicRouter, dtype),
        ("ref", TopKRouter, torch.float64),
        ("ref32", TopKRouter, dtype),
    ):
        cfg = cfgs["fp64" if dt == torch.float64 else "fp32"]
        kw = {}
        if cls is SonicRouter:  # the plugin layer's router: top-K output, the dense probabilities when rounding
            sonic = SonicConfig(backend="torch", token_rounding="nearest" if rounding_probs else "none")
            kw["options"] = LayerOptions.resolve(sonic, cfg, check_megatron=True)
        router = cls(config=cfg, pg_collection=default_pg_collection(), **kw).to(device=device, dtype=dt)
        with torch.no_grad():
            router.weight.copy_(weight)
        router.train()
        if cls is SonicRouter:
            assert (router.fused_unsupported_reason(x.to(dt), None) is None) == fused_expected
        x_in = x.to(dt).requires_grad_()
        if cls is SonicRouter:
            routed = router(x_in)
            scores_TK, idx_TK = routed.scores_TK, routed.indices_TK
            assert (routed.dense_probs_TE is not None) == rounding_probs
        else:
            scores_TK, idx_TK = as_topk(*router(x_in), 4)
        order = torch.sort(idx_TK, dim=1)
        scores_TK = scores_TK.gather(1, order.indices)
        ramp = torch.linspace(-1, 1, scores_TK.numel(), device=device).view_as(scores_TK)
        loss = (scores_TK * ramp.to(dt)).sum()
        if rounding_probs:  # a rounding-like reader of the dense probabilities: a few pairs' weights
            if cls is SonicRouter:
                dense_TE = routed.dense_probs_TE
            else:  # TopKRouter's softmax over its own logits (z-loss leaves their values)
                scale = router.config.moe_router_topk_scaling_factor or 1.0
                dense_TE = (
                    torch.softmax(
                        router.gating(x_in).view(-1, 16), -1, dtype=torch.float32 if dt != torch.float64 else dt
                    )
                    * scale
                )
            pick = torch.zeros(dense_TE.shape, device=device, dtype=dense_TE.dtype)
            pick[::3, 5] = 1.0
            pick[1::4, 0] = -2.0
            loss = loss + (dense_TE * pick).sum()
        loss.backward()
        outs[name] = (order.values, scores_TK.detach().double(), router.weight.grad.double())
    idx, s, g = outs["sonic"]
    idx_ref, s_ref, g_ref = outs["ref"]
    _, s32, g32 = outs["ref32"]
    assert torch.equal(idx, idx_ref), (idx != idx_ref).sum()
    for got, ref, same_precision in ((s, s_ref, s32), (g, g_ref, g32)):
        err, base = (got - ref).abs().max().item(), (same_precision - ref).abs().max().item()
        assert err <= 2 * base + 1e-6 * ref.abs().max().item(), (err, base)


def _worker(rank, world, out_dir):
    from sonic_megatron.testing import init_model_parallel

    init_model_parallel(ep=1)
    results = {}
    for cases, fused in ((FUSED_CASES, True), (FALLBACK_CASES, False)):
        for name, opts in cases.items():
            try:
                _run(opts, torch.float32, fused, rounding_probs=name in ROUNDING_PROBS)
                results[name] = None
            except Exception:  # noqa: BLE001 - reported per case
                import traceback

                results[name] = traceback.format_exc()
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from sonic_megatron.testing import spawn

    out = tmp_path_factory.mktemp("router_fused")
    # Without a GPU the worker runs on the CPU, its Triton kernel under the interpreter, which it must see before it
    # imports Triton: a spawned process takes the environment at its start. This process keeps its own (set here for
    # good, the interpreter would also run every later test's kernels). With a GPU it runs there, compiled.
    with pytest.MonkeyPatch.context() as env:
        if not torch.cuda.is_available():
            env.setenv("TRITON_INTERPRET", "1")
        spawn(_worker, 1, str(out), timeout=600)
    return json.load(open(out / "result.json"))


@pytest.mark.parametrize("case", [*FUSED_CASES, *FALLBACK_CASES])
def test_sonic_router_matches_topk_router(results, case):
    assert results[case] is None, results[case]
