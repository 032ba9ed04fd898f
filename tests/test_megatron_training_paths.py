"""Training-time paths of the plugin layer at EP=1 and EP=2 (gloo): delayed weight gradients
(``delay_wgrad_compute`` -> ``backward_dw()``, with DDP's hooks), accumulation into ``main_grad`` (by the
GEMMs wherever DDP allocated it, whatever ``gradient_accumulation_fusion`` says), and token rounding (received
counts are tile multiples in training, plain top-K -- identical to stock Megatron -- in eval)."""

from __future__ import annotations

import pytest
import torch

from sonic_megatron.compare import Case
from sonic_megatron.config import SonicConfig


def _effective_grad(p):
    """What Megatron's DDP ends up with: main_grad, plus .grad unless it was already added there."""
    g = p.main_grad.clone()
    if p.grad is not None and not p.grad_added_to_main_grad:
        g += p.grad
    return g


def _run(layer, x, g):
    x = x.detach().clone().requires_grad_()
    out, _ = layer(x)
    out.backward(g)
    return out.detach(), x.grad


def _worker(rank, world):
    from sonic_megatron.compare import build_pair
    from sonic_megatron.testing import init_model_parallel

    report = {}
    for ep in (1, 2):
        init_model_parallel(ep=ep)
        for dispatcher in ("sonic", "megatron"):
            case = Case("paths", sonic=SonicConfig(backend="torch", dispatcher=dispatcher))
            key = f"{dispatcher}@ep{ep}"
            torch.manual_seed(1000)
            _, ref = build_pair(case, torch.device("cpu"))
            gen = torch.Generator().manual_seed(5 + rank)
            x = torch.randn(8, 2, 32, generator=gen, dtype=torch.float64)
            g = torch.randn(8, 2, 32, generator=gen, dtype=torch.float64)
            out_ref, dx_ref = _run(ref, x, g)
            w_ref = [ref.experts.weight1.grad.clone(), ref.experts.weight2.grad.clone()]

            # delayed wgrad + DDP-style hooks
            torch.manual_seed(1000)
            delayed = Case("delay", {"delay_wgrad_compute": False}, sonic=case.sonic)
            _, lay = build_pair(delayed, torch.device("cpu"))
            lay.experts.config.delay_wgrad_compute = True
            lay.experts.__init_wgrad__()
            calls = []
            lay.experts.register_wgrad_accumulation_and_reduce_hooks(calls.append)
            out, dx = _run(lay, x, g)
            before = [lay.experts.weight1.grad, lay.experts.weight2.grad]
            pending = lay.experts.wgrad.num_pending
            lay.backward_dw()
            after = [lay.experts.weight1.grad, lay.experts.weight2.grad]
            report[f"delay:{key}"] = {
                "no_grad_before": all(b is None for b in before),
                "pending": pending,
                "hook_calls": len(calls),
                "out": float((out - out_ref).abs().max()),
                "dx": float((dx - dx_ref).abs().max()),
                "dw": max(float((a - r).abs().max()) for a, r in zip(after, w_ref, strict=True)),
                "pending_after": lay.experts.wgrad.num_pending,
            }

            # main_grad fusion (Megatron DDP's buffers), two micro-batches accumulate; the config's
            # gradient_accumulation_fusion (Megatron's fused-GEMM extension for its own layers) stays off
            torch.manual_seed(1000)
            _, lay = build_pair(case, torch.device("cpu"))
            assert not lay.experts.config.gradient_accumulation_fusion
            for p in (lay.experts.weight1, lay.experts.weight2):
                p.main_grad = torch.zeros_like(p)
                p.grad_added_to_main_grad = False
            _run(lay, x, g)
            _run(lay, x, g)
            eff = [_effective_grad(lay.experts.weight1), _effective_grad(lay.experts.weight2)]
            report[f"main_grad:{key}"] = {
                "err": max(float((e - 2 * r).abs().max()) for e, r in zip(eff, w_ref, strict=True)),
                "fused": all(p.grad_added_to_main_grad for p in (lay.experts.weight1, lay.experts.weight2)),
            }

            # micro-batch pairs of the weight gradients under a Megatron-like schedule: three micro-batches (the
            # first waits for the second, the last never waits), then the schedule's finalize (the builder's hook
            # in front of Megatron's function)
            from sonic_megatron import wgrad

            torch.manual_seed(1000)
            _, lay = build_pair(case, torch.device("cpu"))
            params = (lay.experts.weight1, lay.experts.weight2)
            for p in params:
                p.main_grad = torch.zeros_like(p)
                p.grad_added_to_main_grad = False
            counted, wgrad._num_microbatches = wgrad._num_microbatches, lambda: 3
            wgrad.finalize_runs_held_weight_grads(lay.config, lambda *args, **kwargs: None)
            try:
                _run(lay, x, g)
                held_first = lay.experts.wgrad._held is not None and all(p.grad is None for p in params)
                _run(lay, x, g)
                _run(lay, x, g)
                lay.config.finalize_model_grads_func([lay])
            finally:
                wgrad._num_microbatches = counted
                lay.config.finalize_model_grads_func = None
            eff = [_effective_grad(p) for p in params]
            report[f"pairs:{key}"] = {
                "err": max(float((e - 3 * r).abs().max()) for e, r in zip(eff, w_ref, strict=True)),
                "held_first": held_first,
            }

        # token rounding (sonic dispatcher): tile multiples in training, stock function in eval
        tile = 4
        case = Case("round", sonic=SonicConfig(backend="torch", token_rounding="up", rounding_tile=tile))
        torch.manual_seed(1000)
        stock, lay = build_pair(case, torch.device("cpu"))
        gen = torch.Generator().manual_seed(7 + rank)
        x = torch.randn(12, 2, 32, generator=gen, dtype=torch.float64)
        g = torch.randn(12, 2, 32, generator=gen, dtype=torch.float64)
        lay.train()
        out, dx = _run(lay, x, g)
        if ep == 1:  # no plan: the experts read the rounded (padded) routing directly
            E, exp_R = lay.config.num_moe_experts, lay.mode.routing.expert_idx_R
            per_expert = torch.bincount(exp_R[exp_R < E], minlength=E).tolist()
        else:
            counts = [torch.diff(m.expert_offsets).tolist() for m in lay.mode.plan.recv_meta]
            per_expert = [sum(c[e] for c in counts) for e in range(len(counts[0]))]
        lay.eval()
        stock.eval()
        with torch.no_grad():
            o_eval, _ = lay(x)
            o_stock, _ = stock(x)
        report[f"rounding@ep{ep}"] = {
            "counts": per_expert,
            "finite": bool(torch.isfinite(out).all() and torch.isfinite(dx).all()),
            "router_grad": float(lay.router.weight.grad.abs().max()),
            "eval_vs_stock": float((o_eval - o_stock).abs().max()),
            "tile": tile,
        }
    return report


@pytest.fixture(scope="module")
def reports():
    from sonic_megatron.testing import spawn

    return spawn(_worker, 2, timeout=600)


KEYS = [f"{d}@ep{ep}" for ep in (1, 2) for d in ("sonic", "megatron")]


@pytest.mark.slow
@pytest.mark.parametrize("key", KEYS)
def test_delayed_wgrad(reports, key):
    for rep in reports:
        r = rep[f"delay:{key}"]
        assert r["no_grad_before"] and r["pending"] >= 1, r
        assert r["pending_after"] == 0 and r["hook_calls"] == 1, r  # one hook, called once
        assert r["out"] < 1e-12 and r["dx"] < 1e-12 and r["dw"] < 1e-12, r


@pytest.mark.slow
@pytest.mark.parametrize("key", KEYS)
def test_main_grad_accumulation(reports, key):
    for rep in reports:
        r = rep[f"main_grad:{key}"]
        # fused on every path: the sonic dispatcher's EP > 1 steps hand their work to the same sink
        assert r["err"] < 1e-12 and r["fused"], r


def test_fused_main_grad_dummy_follows_zero_out_wgrad():
    """Autograd's dummy for a fused weight: DDP adds it only under ``zero_out_wgrad``, so it is zeros there."""
    from sonic_megatron.wgrad import WeightGradSink

    w = torch.nn.Parameter(torch.ones(2, 3))
    w.main_grad = torch.zeros(2, 3)
    w.grad_added_to_main_grad = False
    w.zero_out_wgrad = True
    sink = WeightGradSink((w,), delay=False)

    def compute(out=None, accumulate=True):
        if out is not None:
            out[0].add_(1.0) if accumulate else out[0].fill_(1.0)
            return None
        return (torch.full((2, 3), 1.0),)

    (dummy,) = sink.grads_for_autograd(compute)
    assert w.grad_added_to_main_grad and torch.equal(w.main_grad, torch.ones(2, 3))
    assert torch.equal(dummy, torch.zeros(2, 3))


@pytest.mark.parametrize("delay", [False, True])
def test_fused_main_grad_stores_at_first_microbatch_then_adds(delay):
    """While DDP's flag says the zeroed main_grads hold nothing (``grad_added_to_main_grad`` False on every
    weight), the weight GEMMs store into them; after that, and where any weight has the flag set or lacks it,
    they add. Checked with the real backward (torch backend) against autograd's gradients."""
    from sonic_megatron.kernels import TopKRouting, moe_experts

    from sonic_megatron.wgrad import WeightGradSink

    torch.manual_seed(0)
    T, D, F, E, K = 16, 8, 4, 3, 2
    w1 = torch.nn.Parameter(torch.randn(E, 2 * F, D, dtype=torch.float64))
    w2 = torch.nn.Parameter(torch.randn(E, D, F, dtype=torch.float64))
    x = torch.randn(T, D, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    routing = TopKRouting(torch.rand(T, K, dtype=torch.float64), idx)
    moe_experts(x, routing, w1, w2, backend="torch").sum().backward()
    ref = (w1.grad.clone(), w2.grad.clone())
    sink = WeightGradSink((w1, w2), delay=delay)
    for p in (w1, w2):
        p.grad = None
        p.main_grad = torch.full_like(p, float("nan"))  # stale values: must never be read while "empty"
        p.grad_added_to_main_grad = False
    for step in range(2):
        out = moe_experts(x, routing, w1, w2, backend="torch", weight_grad_hook=sink.grads_for_autograd)
        out.sum().backward()
        sink.compute()
        for p, g in zip((w1, w2), ref, strict=True):
            assert p.grad_added_to_main_grad
            torch.testing.assert_close(p.main_grad, (step + 1) * g)


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2])
def test_token_rounding_in_layer(reports, ep):
    for rep in reports:
        r = rep[f"rounding@ep{ep}"]
        assert all(c % r["tile"] == 0 for c in r["counts"]), r
        assert r["finite"] and r["router_grad"] > 0, r
        assert r["eval_vs_stock"] < 1e-12, r


@pytest.mark.slow
@pytest.mark.parametrize("key", KEYS)
def test_weight_grad_pairs(reports, key):
    """Three micro-batches and the schedule's finalize: main_grad holds all three micro-batches' gradients, and
    the first one waited for the second on every path (the sonic dispatcher's EP > 1 steps too)."""
    for rep in reports:
        r = rep[f"pairs:{key}"]
        assert r["err"] < 1e-10, r
        assert r["held_first"], r
