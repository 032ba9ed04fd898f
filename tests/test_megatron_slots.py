"""The Megatron layer's sync-free forward at EP = 2 (CPU, gloo, float64): from a layer's second training call on, rows
and pairs travel in slots sized by the previous call's plan and the plan's host sync waits in the experts' backward.
Top-K and token-rounded routing, each against the same layer with exact split sizes (``SonicConfig.ep_slots=False``,
which never uses slots): outputs and every gradient equal, call after call; more tokens than the slots hold raise on
every rank with Megatron's way out, and the next call plans exactly. (Under Megatron's 1F1B EP overlap the layer
plans every call exactly: test_megatron_overlap_nodes.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from sonic_megatron.token_dispatch.validation import SlotsTooSmall

from sonic_megatron.compare import Case
from sonic_megatron.config import SonicConfig

CPU = torch.device("cpu")

# top-4 (top-3) of 8 experts at EP 2 fills slots. "rank0": every token's top-3 among rank 0's 4 experts, so that
# every source slot to rank 0 is full before rounding and the rounding's added pairs need the slots' room for them
# (rank 1 receives nothing).
CASES = {
    "top4": (Case("top4", {"moe_router_topk": 4}, sonic=SonicConfig(backend="torch")), False),
    "top3_rounded_rank0": (
        Case(
            "top3_rounded_rank0",
            {"moe_router_topk": 3},
            SonicConfig(backend="torch", token_rounding="up", rounding_tile=4),
        ),
        True,
    ),
}


def _forward_backward(layer, x, g):
    xr = x.clone().requires_grad_()
    out, _ = layer(xr)
    out.backward(g)
    return out.detach(), xr.grad


def _grads(layer):
    return [p.grad.clone() for p in (layer.router.weight, layer.experts.weight1, layer.experts.weight2)]


def _worker(rank, world):
    from sonic_megatron.compare import build_pair
    from sonic_megatron.testing import init_model_parallel

    init_model_parallel(ep=2, tp=1)
    report = {}
    for name, (case, rank0) in CASES.items():
        torch.manual_seed(1000)
        _, exact = build_pair(dataclasses.replace(case, sonic=dataclasses.replace(case.sonic, ep_slots=False)), CPU)
        torch.manual_seed(1000)
        _, lay = build_pair(case, CPU)
        if rank0:  # a large router weight on input feature 0 (set to 1 below) for rank 0's experts
            with torch.no_grad():
                for layer in (lay, exact):
                    layer.router.weight[:4, 0] += 50.0
        gen = torch.Generator().manual_seed(3 + rank)
        slotted, errs = [], {}
        for call in range(3):
            x = torch.randn(8, 2, 32, generator=gen, dtype=torch.float64)
            g = torch.randn(8, 2, 32, generator=gen, dtype=torch.float64)
            if rank0:
                x[..., 0] = 1.0
            for layer in (lay, exact):
                layer.zero_grad(set_to_none=True)
            out, dx = _forward_backward(lay, x, g)
            slotted.append(lay.mode.plan is None and lay.mode._unfinished is not None)
            out_ref, dx_ref = _forward_backward(exact, x, g)
            assert exact.mode.plan is not None and exact.mode._slots is None  # ep_slots=False: never in slots
            for k, a, b in zip(
                ("out", "dx", "router", "w1", "w2"),
                (out, dx, *_grads(lay)),
                (out_ref, dx_ref, *_grads(exact)),
                strict=True,
            ):
                errs[f"{k}@{call}"] = float((a - b).abs().max())
        report[name] = {"slotted": slotted, "errs": errs}
        # more tokens than the slots of the previous call: every rank raises, naming Megatron's way out, and
        # the next call plans with exact split sizes
        xl = torch.randn(12, 2, 32, generator=gen, dtype=torch.float64)
        if rank0:
            xl[..., 0] = 1.0
        try:
            _forward_backward(lay, xl, xl)
            report[name]["grown_tokens_error"] = None
        except SlotsTooSmall as exc:
            report[name]["grown_tokens_error"] = str(exc)
        lay.zero_grad(set_to_none=True)
        _forward_backward(lay, xl, xl)
        report[name]["grown_then_exact"] = lay.mode.plan is not None
    return report


@pytest.mark.slow
def test_layer_sync_free_forward_equals_exact_split_sizes():
    from sonic_megatron.testing import spawn

    for r, rep in enumerate(spawn(_worker, 2, timeout=300)):
        assert set(rep) == set(CASES)
        for name, res in rep.items():
            assert res["slotted"] == [False, True, True], (r, name, res["slotted"])
            bad = {k: v for k, v in res["errs"].items() if v > 1e-12}
            assert not bad, f"rank {r} {name}: {bad}"
            grown = res["grown_tokens_error"]
            assert grown is not None and "--variable-seq-lengths" in grown, (r, name, grown)
            assert res["grown_then_exact"], (r, name)
