"""Plugin layer vs stock Megatron MoELayer on the same weights and inputs: outputs and every gradient.

Used by the CPU tests (gloo, fp64 and fp32) and by ``scripts/gpu_megatron.py`` (NCCL, bf16). A case builds
a stock ``MoELayer`` (local spec: SequentialMLP experts, alltoall dispatcher) and a ``SonicMoELayer`` from one
config, copies router / expert / shared-expert weights, runs forward + backward on fresh random inputs
(outputs poisoned beforehand, gradients with a random upstream gradient) and returns max-abs errors.

Precision rule (the project's): a low-precision run passes when its error against a float64 run of the
stock layer is at most 2x the stock layer's own error in that precision plus ``atol_scale`` times the
reference's magnitude. In float64 both must agree to 1e-12 (outputs and gradients here are O(1e-3 .. 1e-1)).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import torch

from .config import SonicConfig
from .testing import copy_sequential_to_sonic, moe_config


@dataclass
class Case:
    """One comparison: Megatron config overrides, plugin options, and how tokens are routed."""

    name: str
    overrides: dict = field(default_factory=dict)
    sonic: SonicConfig = field(default_factory=lambda: SonicConfig(backend="torch"))
    route: str = "random"  # random | one_expert (all tokens to expert 0) | skewed (only rank 0's experts)
    tokens: tuple[int, int] = (8, 2)  # (S, B)
    dtype: torch.dtype = torch.float64


def _stock_spec():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False).submodules.mlp


def build_pair(case: Case, device: torch.device):
    """(stock MoELayer, SonicMoELayer) with identical weights, in ``case.dtype`` on ``device``."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from .layer import SonicMoELayer
    from .spec import moe_submodules_of, sonic_moe_spec

    overrides = dict(case.overrides)
    if case.dtype == torch.float64:
        # float64 cases must agree to 1e-12: the router too (fp32 logits would differ at fp32 rounding between
        # SonicRouter's fused top-K kernel and TopKRouter's torch ops; the kernel takes no float64).
        overrides.setdefault("moe_router_dtype", "fp64")
    config = moe_config(**overrides)
    stock_submodules = moe_submodules_of(_stock_spec())
    stock = MoELayer(config, copy.deepcopy(stock_submodules))
    sonic_spec = sonic_moe_spec(stock_submodules, case.sonic)
    sonic = SonicMoELayer(config, sonic_spec.submodules, sonic_config=case.sonic)
    with torch.no_grad():
        sonic.router.weight.copy_(stock.router.weight)
        if getattr(stock.router, "expert_bias", None) is not None:
            sonic.router.expert_bias.copy_(stock.router.expert_bias)
        copy_sequential_to_sonic(stock.experts, sonic.experts)
        if stock.shared_experts is not None:
            sonic.shared_experts.load_state_dict(stock.shared_experts.state_dict())
        _force_routing(case.route, stock, sonic)
    return stock.to(device=device, dtype=case.dtype), sonic.to(device=device, dtype=case.dtype)


def _force_routing(route: str, *layers) -> None:
    """Bias the router so that routing hits the edge cases (zero-token experts, ranks receiving nothing)."""
    if route == "random":
        return
    w = layers[0].router.weight
    E = w.shape[0]
    boost = torch.zeros(E, dtype=w.dtype)
    if route == "one_expert":
        boost[0] = 1.0  # expert 0 first for every token; the others get the remaining top-K slots
    elif route == "skewed":
        boost[: max(E // 4, 1)] = 1.0  # experts of EP rank 0 (of 2..4) only; other ranks receive nothing
    else:
        raise ValueError(f"unknown route {route!r}")
    for layer in layers:
        # Input feature 0 is set to a constant (compare_case); a large router weight on it makes the boosted
        # experts win for every token.
        layer.router.weight[:, 0] += boost * 50.0


def run_layer(layer, x, g, padding_mask=None):
    x = x.detach().clone().requires_grad_()
    for p in layer.parameters():
        p.grad = None
    out, bias = layer(x) if padding_mask is None else layer(x, padding_mask=padding_mask)
    assert bias is None
    out.backward(g)
    if not hasattr(layer.experts, "local_experts"):
        layer.backward_dw()  # Sonic experts: runs deferred weight gradients (no-op without delay)
    grads = {"x": x.grad.detach().clone()}
    grads["router"] = layer.router.weight.grad.detach().clone()
    if hasattr(layer.experts, "local_experts"):
        grads["w1"] = torch.stack([e.linear_fc1.weight.grad for e in layer.experts.local_experts])
        grads["w2"] = torch.stack([e.linear_fc2.weight.grad for e in layer.experts.local_experts])
    else:
        grads["w1"], grads["w2"] = layer.experts.weight1.grad.clone(), layer.experts.weight2.grad.clone()
    if layer.shared_experts is not None:
        for name, p in layer.shared_experts.named_parameters():
            grads[f"shared.{name}"] = p.grad.detach().clone()
    return out.detach().clone(), grads


def compare_case(case: Case, device: torch.device, seed: int) -> dict:
    """Errors of the plugin vs the stock layer (same dtype) and, for low precision, vs a float64 stock run."""
    torch.manual_seed(1000)  # same weights on every rank before the EP split picks local experts
    stock, sonic = build_pair(case, device)
    S, B = case.tokens
    H = stock.config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(S, B, H, generator=gen, dtype=torch.float64)
    if case.route != "random":
        x[..., 0] = 3.0  # the constant feature the boosted router rows read
    g = torch.randn(S, B, H, generator=gen, dtype=torch.float64)
    xs, gs = x.to(device, case.dtype), g.to(device, case.dtype)
    stock.train()
    sonic.train()
    out_ref, grads_ref = run_layer(stock, xs, gs)
    out, grads = run_layer(sonic, xs, gs)
    result = {"out": _err(out, out_ref)}
    if sonic.mode is not None:
        # With the plugin's dispatch (fixed-order sums, no atomics), a second call gives the first one's bits: no
        # state carried from call to call changes a result. (Megatron's dispatcher sums with atomics on GPUs.)
        again_out, again_grads = run_layer(sonic, xs, gs)
        pairs = zip((out, *grads.values()), (again_out, *again_grads.values()), strict=True)
        result["repeat_differs"] = float(not all(torch.equal(a, b) for a, b in pairs))
    for k, v in grads_ref.items():
        result[f"grad.{k}"] = _err(grads[k], v)
    if case.dtype != torch.float64:
        torch.manual_seed(1000)  # the same weights again, built in float64 (modules with groups cannot deepcopy)
        stock64, _ = build_pair(dataclasses.replace(case, dtype=torch.float64), device)
        stock64.train()
        out64, grads64 = run_layer(stock64, x.to(device), g.to(device))
        result["bound"] = {
            "out": (_err(out, out64), _err(out_ref, out64), _mag(out64)),
            **{f"grad.{k}": (_err(grads[k], v), _err(grads_ref[k], v), _mag(v)) for k, v in grads64.items()},
        }
    return result


def case_key(name: str, ep: int, tp: int = 1, etp: int | None = None) -> str:
    """A result's key: ``<name>@ep<ep>``, ``<name>@tp<tp>ep<ep>`` with tensor parallelism (the expert
    tensor-parallel size following it), ``<name>@tp<tp>etp<etp>ep<ep>`` where the ETP size differs from ``tp``."""
    etp = tp if etp is None else etp
    if etp != tp:
        return f"{name}@tp{tp}etp{etp}ep{ep}"
    return f"{name}@ep{ep}" if tp == 1 else f"{name}@tp{tp}ep{ep}"


def compare_cases(
    cases: list[Case], ep_sizes: tuple[int, ...], device: torch.device, seed: int, tp: int = 1, etp: int | None = None
) -> dict:
    """``compare_case`` for every case at every expert-parallel size (Megatron's parallel state set per size, with
    tensor-parallel size ``tp`` and expert tensor-parallel size ``etp``, default ``tp``) on this rank:
    ``{case_key(...): {"failures": [...], "errors": ...}}``, ready for JSON. A case that raises is reported with its
    traceback and the others still run."""
    import traceback

    from .testing import init_model_parallel

    results = {}
    for ep in ep_sizes:
        init_model_parallel(ep=ep, tp=tp, etp=etp)
        for case in cases:
            key = case_key(case.name, ep, tp, etp)
            try:
                res = compare_case(case, device, seed=seed)
                results[key] = {"failures": passes(res, case.dtype), "errors": _json_ready(res)}
            except Exception as exc:  # noqa: BLE001 - reported per case
                results[key] = {"failures": [f"raised {exc!r}"], "trace": traceback.format_exc()}
    return results


def _json_ready(result: dict) -> dict:
    """``compare_case``'s result with its per-quantity bound tuples as lists."""
    return {k: (v if not isinstance(v, dict) else {kk: list(vv) for kk, vv in v.items()}) for k, v in result.items()}


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _mag(t: torch.Tensor) -> float:
    return float(t.double().abs().max()) if t.numel() else 0.0


def passes(result: dict, dtype: torch.dtype, atol_scale: float = 1e-6) -> list[str]:
    """Names of the quantities that fail the precision rule (empty list: pass)."""
    failures = ["the layer's second call differs from its first"] if result.get("repeat_differs") else []
    if dtype == torch.float64:
        for k, v in result.items():
            if k not in ("bound", "repeat_differs") and v > 1e-12:
                failures.append(f"{k}: {v:.3g}")
        return failures
    for k, (ours, theirs, mag) in result["bound"].items():
        if ours > 2 * theirs + atol_scale * mag:
            failures.append(f"{k}: ours {ours:.3g} > 2 x stock {theirs:.3g} + tol (|ref| {mag:.3g})")
    return failures
