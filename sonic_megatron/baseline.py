"""The grouped-GEMM baseline: Megatron's stock MoE layer and dispatcher with experts on ``torch._grouped_mm``
(or Transformer Engine's ``TEGroupedMLP`` where TE imports), for benchmarks against the plugin.

Shape legend: N dispatched rows (grouped by local expert), H hidden size, F expert ffn size, El local experts,
G = 2F (GLU) or F. Parameters are stacked per local expert in nn.Linear layout, as ``SonicExperts``:
    weight1 [El, G, H]  fc1, GLU rows ``[gate ; up]`` (Megatron's order)
    weight2 [El, H, F]  fc2
so checkpoints use SequentialMLP's keys (``sonic_megatron.checkpoint``).

``--spec sonic_megatron.baseline grouped_block_spec`` with Megatron-LM's ``pretrain_gpt.py`` (megatron-core >=
0.19, which calls the function with ``(config, vp_stage)``): Megatron's default GPT layer/block spec with the
stock ``MoELayer``, ``TopKRouter`` and dispatcher, only the experts module replaced. In code, on any version:
``swap_experts_spec(spec)``.

Without CUDA ``torch._grouped_mm`` may be missing or refuse the dtype or strides (CPU: fp32/bf16/fp16 with
16-byte aligned rows only); there the module runs one GEMM per expert instead. On CUDA it always calls
``torch._grouped_mm``, so a benchmark never measures the loop by accident.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from .checkpoint import drop_extra_state_keys, stacked_experts_sharded_state_dict
from .experts import init_stacked_weights
from .megatron_compat import accepted_kwargs, default_pg_collection, expert_rng_context, experts_are_built_by_call

_CPU_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class GroupedMMExperts(MegatronModule):
    """Megatron's experts contract on ``torch._grouped_mm``: fc1 -> activation (GLU) -> x prob -> fc2.

    Args:
        num_local_experts: experts on this EP rank (El).
        config: Megatron TransformerConfig (``hidden_size``, ``moe_ffn_hidden_size``, ``activation_func``,
            ``gated_linear_unit``, ``params_dtype``, ``use_cpu_initialization``, ``perform_initialization``,
            ``init_method``, ``output_layer_init_method``).
        submodules: accepted and ignored (Megatron's expert specs pass MLP submodules).
        pg_collection: process groups (``ep``, ``expt_dp``, ``expt_tp``); Megatron's defaults if None.
        **kwargs: newer Megatron arguments (``name``...) are accepted and ignored.
    """

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None, **kwargs):
        super().__init__(config=config)
        _check_supported(config)
        if pg_collection is None:
            pg_collection = default_pg_collection()
        self.gated = bool(config.gated_linear_unit)
        init_stacked_weights(self, config, num_local_experts, pg_collection, self.gated)
        if config.perform_initialization:
            self._init_weights()
        self.register_load_state_dict_post_hook(drop_extra_state_keys)

    @torch.no_grad()
    def _init_weights(self) -> None:
        """Per expert, fc1 then fc2, as SequentialMLP builds its experts' linears: on the CPU an fp32 master
        drawn from the default generator and cast (``_initialize_affine_weight_cpu``), on a GPU drawn in
        place under the expert-parallel RNG tracker (``_initialize_affine_weight_gpu(is_expert=True)``)."""
        cpu = self.config.use_cpu_initialization
        rng = contextlib.nullcontext() if cpu else expert_rng_context()
        with rng:
            for e in range(self.num_local_experts):
                for w, init in (
                    (self.weight1, self.config.init_method),
                    (self.weight2, self.config.output_layer_init_method),
                ):
                    if cpu:
                        master = torch.empty(w.shape[1:], dtype=torch.float32)
                        init(master)
                        w[e].copy_(master.to(w.dtype))
                    else:
                        init(w[e])

    def _activation(self, h_NG: torch.Tensor) -> torch.Tensor:
        """Megatron MLP's unfused activation (``--no-bias-swiglu-fusion``), clamp and linear offset included."""
        act = self.config.activation_func
        if not self.gated:
            return act(h_NG)
        gate_NF, up_NF = torch.chunk(h_NG, 2, dim=-1)
        clamp = getattr(self.config, "activation_func_clamp_value", None)
        if clamp is not None:
            gate_NF = gate_NF.clamp(min=None, max=clamp)
            up_NF = up_NF.clamp(min=-clamp, max=clamp)
        return act(gate_NF) * (up_NF + getattr(self.config, "glu_linear_offset", 0.0))

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, **kwargs):
        """Rows grouped by local expert (``tokens_per_expert`` [El], any device), one prob per row applied
        after the activation. Returns (output [N, H], None)."""
        if kwargs.get("output_buffer") is not None or kwargs.get("grad_input_buffer") is not None:
            raise ValueError(
                "GroupedMMExperts: NCCL-EP zero-copy buffers (output_buffer, grad_input_buffer) unsupported"
            )
        x_NH = permuted_local_hidden_states
        counts_E = torch.as_tensor(tokens_per_expert)
        if counts_E.numel() != self.num_local_experts:
            raise ValueError(
                f"GroupedMMExperts: tokens_per_expert must have {self.num_local_experts} entries, "
                f"got {counts_E.numel()}"
            )
        w1_EHG = self.weight1.transpose(1, 2)
        w2_EFH = self.weight2.transpose(1, 2)
        if use_grouped_mm(x_NH, self.weight1, self.weight2):
            offs_E = torch.cumsum(counts_E.to(device=x_NH.device, dtype=torch.int32), 0, dtype=torch.int32)
            h_NG = torch._grouped_mm(x_NH, w1_EHG, offs=offs_E)
            a_NF = self._scaled_activation(h_NG, permuted_probs)
            return torch._grouped_mm(a_NF, w2_EFH, offs=offs_E), None
        counts = counts_E.tolist()
        # Every expert's GEMM runs, empty ones too, so that every weight gets a (zero) gradient.
        h_NG = torch.cat([x @ w1_EHG[e] for e, x in enumerate(torch.split(x_NH, counts))])
        a_NF = self._scaled_activation(h_NG, permuted_probs)
        return torch.cat([a @ w2_EFH[e] for e, a in enumerate(torch.split(a_NF, counts))]), None

    def _scaled_activation(self, h_NG: torch.Tensor, probs_N: torch.Tensor) -> torch.Tensor:
        # As Megatron's MLP: the product with the (fp32) probs promotes, the result goes back to the GEMM dtype.
        return (self._activation(h_NG) * probs_N.unsqueeze(-1)).to(h_NG.dtype)

    def backward_dw(self) -> None:
        """Weight gradients are computed in the backward pass (``delay_wgrad_compute`` is refused at build)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """SequentialMLP-compatible keys and global shapes (see ``sonic_megatron.checkpoint``)."""
        return stacked_experts_sharded_state_dict(self, prefix, sharded_offsets, metadata)


def _check_supported(config) -> None:
    unsupported = {
        "add_bias_linear": (bool(config.add_bias_linear), "pass --disable-bias-linear"),
        "moe_apply_probs_on_input": (
            bool(getattr(config, "moe_apply_probs_on_input", False)),
            "probs apply after the activation",
        ),
        "delay_wgrad_compute": (
            bool(getattr(config, "delay_wgrad_compute", False)),
            "weight gradients are not deferred",
        ),
        "fp8": (bool(getattr(config, "fp8", None)), "bf16/fp16/fp32 GEMMs only"),
        "fp4": (bool(getattr(config, "fp4", None)), "bf16/fp16/fp32 GEMMs only"),
    }
    for option, (is_set, why) in unsupported.items():
        if is_set:
            raise ValueError(f"GroupedMMExperts does not support {option}={getattr(config, option)!r}: {why}")


def use_grouped_mm(x_NH: torch.Tensor, w1_EGH: torch.Tensor, w2_EHF: torch.Tensor) -> bool:
    """True when ``torch._grouped_mm`` computes these operands: always on CUDA; on other devices only when it
    exists and takes the dtype and the row widths (multiples of 16 bytes), else the per-expert loop runs."""
    if x_NH.is_cuda:
        return True
    if not hasattr(torch, "_grouped_mm") or x_NH.dtype not in _CPU_GROUPED_MM_DTYPES:
        return False
    row_elems = (w1_EGH.shape[1], w1_EGH.shape[2], w2_EHF.shape[1], w2_EHF.shape[2])
    return all(n * x_NH.element_size() % 16 == 0 for n in row_elems)


# ----------------------------------------------------------------------------------------------------------
# Specs
# ----------------------------------------------------------------------------------------------------------


def _have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


def grouped_experts_builder():
    """What ``MoESubmodules.experts`` holds for the baseline on this install: Transformer Engine's
    ``TEGroupedMLP`` when TE imports, else ``GroupedMMExperts``; a ``ModuleSpec`` on megatron-core 0.16-0.18
    (``build_module``), the builder itself on >= 0.19 (``MoELayer`` calls it)."""
    if _have_te():
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        provider = TESpecProvider()
        flags = {"moe_use_grouped_gemm": True, "moe_use_legacy_grouped_gemm": False}
        experts = provider.grouped_mlp_modules(**accepted_kwargs(provider.grouped_mlp_modules, flags))
        if isinstance(experts, tuple):  # 0.16-0.18: (module, MLPSubmodules), the activation set by the caller
            module, submodules = experts
            if submodules is not None:
                submodules.activation_func = provider.activation_func()
            return ModuleSpec(module=module, submodules=submodules)
        return experts
    if experts_are_built_by_call():
        return GroupedMMExperts
    return ModuleSpec(module=GroupedMMExperts)


def _swap_experts(obj, experts, seen: dict):
    if id(obj) in seen:
        return seen[id(obj)]
    out = obj
    if isinstance(obj, MoESubmodules):
        obj.experts = experts
    elif isinstance(obj, ModuleSpec):
        obj.submodules = _swap_experts(obj.submodules, experts, seen)
    elif isinstance(obj, functools.partial):
        out = functools.partial(
            obj.func, *obj.args, **{k: _swap_experts(v, experts, seen) for k, v in obj.keywords.items()}
        )
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            setattr(obj, f.name, _swap_experts(getattr(obj, f.name), experts, seen))
    elif isinstance(obj, list):
        out = [_swap_experts(v, experts, seen) for v in obj]
    elif isinstance(obj, tuple):
        out = tuple(_swap_experts(v, experts, seen) for v in obj)
    seen[id(obj)] = out
    return out


def swap_experts_spec(spec, experts=None):
    """A deep copy of a GPT layer / block / MTP spec whose MoE layers keep Megatron's MoELayer, router and
    shared experts and get ``experts`` (default: ``grouped_experts_builder()``) as their routed experts."""
    return _swap_experts(copy.deepcopy(spec), experts if experts is not None else grouped_experts_builder(), {})


def grouped_block_spec(config, vp_stage: int | None = None):
    """megatron-core >= 0.19 (``GPTModelBuilder``, ``--spec sonic_megatron.baseline grouped_block_spec``):
    Megatron's default GPT layer/block spec for ``config`` with the grouped-GEMM experts."""
    try:
        from megatron.training.models.gpt import default_layer_spec
    except ImportError as exc:
        raise RuntimeError(
            "grouped_block_spec needs megatron-core >= 0.19 (megatron.training.models.gpt); on older versions "
            "build the spec in code with sonic_megatron.baseline.swap_experts_spec"
        ) from exc
    experts = grouped_experts_builder()
    if torch.distributed.is_initialized() and torch.distributed.get_rank() == 0:  # which baseline ran, in the log
        cls = getattr(experts, "module", getattr(experts, "func", experts))
        print(f"sonic_megatron.baseline: routed experts {getattr(cls, '__name__', cls)}", flush=True)
    return swap_experts_spec(default_layer_spec(config, vp_stage), experts)
