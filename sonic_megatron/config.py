"""Plugin options (``SonicConfig``) and the validation of Megatron's TransformerConfig against them.

Where options come from, lowest to highest precedence:
1. the dataclass defaults below;
2. the ``sonic_config=SonicConfig(...)`` argument of the spec functions in ``sonic_megatron.spec`` (or of
   ``SonicMoELayer`` itself);
3. environment variables ``SONIC_MEGATRON_<FIELD>`` (upper-case field name, e.g.
   ``SONIC_MEGATRON_TOKEN_ROUNDING=up``), read when a layer is built. Environment variables win so that a
   launch script can switch options of a ``--spec sonic_megatron.spec ...`` run, which cannot pass arguments.
   They are parsed strictly (booleans: 0/1/true/false/yes/no, any case; integers: decimal), and a
   ``SONIC_MEGATRON_*`` variable that is neither a field nor one of ``OTHER_ENV_VARS`` is an error, so that a
   typo in a launch script fails instead of silently leaving the default.

Fields are type-checked: a bool field takes only ``True``/``False`` (a string such as ``"no"`` would be truthy)
and an int field only an ``int`` that is not a bool (``bool`` subclasses ``int``); wrong types raise
``TypeError``, wrong values ``ValueError``, each naming the field, what it takes and what it got.

Unsupported Megatron options fail when the layer is built, with a ``ValueError`` naming the option, its value
and what to use instead (``validate_megatron_config``). Megatron's capacity factor and drop-and-pad
(``moe_expert_capacity_factor``, ``moe_pad_expert_input_to_capacity``, ``moe_token_drop_policy``) are supported:
TopKRouter drops (and pads) the pairs exactly as in the stock layer, and the layer carries the result as a flat
routing; they cannot be combined with ``SonicConfig.token_rounding``.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from dataclasses import dataclass, fields

import torch.nn.functional as F

from .token_dispatch.rounding import NO_ROUNDING, check_mode, check_tile
from .token_dispatch.rounding import ROUNDING_MODES as TOKEN_ROUNDING_MODES
from .token_dispatch.validation import MAX_CHUNKS

DISPATCHERS = ("sonic", "megatron")
ROUNDING_MODES = (NO_ROUNDING, *TOKEN_ROUNDING_MODES)  # SonicConfig.token_rounding: off, or a TokenRounding mode
ENV_PREFIX = "SONIC_MEGATRON_"
# SONIC_MEGATRON_* variables that are not SonicConfig fields but are read elsewhere; any other name with the
# prefix is rejected by SonicConfig.resolve. Keep this in step with the os.environ reads under kernels/,
# token_dispatch/ and tests/ (tests/test_user_errors.py checks it against the sources).
OTHER_ENV_VARS = (
    "SONIC_MEGATRON_CUTE_TUNING",  # kernels/options.py: tile policy of the cute backend
    "SONIC_MEGATRON_CUTE_TILES",  # kernels/options.py: per-GEMM tile overrides
    "SONIC_MEGATRON_CACHE_DIR",  # kernels/options.py: no longer read; a value fails naming QuACK's variables
    "SONIC_MEGATRON_MLM_DIR",  # tests/test_megatron_launcher_spec.py: a Megatron-LM checkout
)
BOOL_WORDS = {"0": False, "1": True, "false": False, "true": True, "no": False, "yes": True}


@dataclass(frozen=True)
class SonicConfig:
    """Options of the sonic-megatron MoE layer.

    Attributes:
        backend: experts backend of ``sonic_megatron.kernels``, decided per layer when it is built
            (``layer_options.layer_backend``): ``auto`` (``cute`` where it runs the layer, else ``torch`` with one
            warning naming the reason), ``torch`` (plain PyTorch, any device) or ``cute`` (Hopper; a layer it cannot
            run fails at build, naming the reason).
        dispatcher: ``sonic`` (default): tokens travel through ``sonic_megatron.token_dispatch`` (each token
            crosses to a rank once however many of its experts live there; token rounding and chunked overlap
            available). ``megatron``: keep Megatron's dispatcher chosen by ``--moe-token-dispatcher-type``
            (alltoall, allgather, flex/DeepEP/HybridEP) and use the Sonic kernels for the experts only.
        token_rounding: tile-aware token rounding of every expert's token count to a multiple of
            ``rounding_tile`` in training: ``none`` (default; plain top-K, the same function as stock
            Megatron), ``nearest`` (an expert that top-K routed to keeps at least one tile: SonicMoE's nearest
            rounding would empty it), ``up`` or ``down``. Evaluation always uses plain top-K. Needs
            ``dispatcher='sonic'`` and no Megatron capacity factor (``moe_expert_capacity_factor``; both decide
            the experts' pair counts: refused when the layer is built). Rounding moves up to
            ``rounding_tile - 1`` pairs of every expert: ``up`` fills partial tiles and saves no GEMM tile,
            ``down`` drops the pairs of every partial tile. The measured loss of each mode against top-K's is in
            docs/PERF.md ("Token rounding"). The layer warns when experts average fewer than 2 tiles of routed
            pairs per micro-batch.
        rounding_tile: the multiple used by token rounding (the GEMM M tile; 128 on Hopper).
        num_chunks: pipeline the dispatch/experts/combine of a layer in this many chunks so that one chunk's
            all-to-all overlaps another's GEMMs (``dispatcher='sonic'``; 1 = no chunking, at most 16:
            token_dispatch's ``MAX_CHUNKS``). With N > 1 (or
            ``redispatch_x_in_backward``) the layer runs dispatch + experts + combine as one pipelined call
            inside ``routed_experts_compute`` (Megatron's dispatch/combine steps pass tensors through), so it
            cannot be combined with ``--overlap-moe-expert-parallel-comm`` (rejected at construction).
        redispatch_x_in_backward: cache only this rank's input tokens and dispatch them again in backward
            instead of keeping the received tokens (saves activation memory, costs one all-to-all; pipelined
            mode as above).
        comm_sms: SMs the expert GEMMs leave free while an all-to-all of the pipelined mode is in flight, so
            that NCCL's kernel can run beside QuACK's persistent GEMMs (``cute`` backend; 0 = all SMs to the
            GEMMs). NCCL needs one SM per channel; pick by ``bench layer --comm-sms``. Also used under Megatron's
            1F1B EP overlap (``--overlap-moe-expert-parallel-comm``), where another micro-batch's all-to-all runs
            beside the experts node: there the first GEMM of its forward and backward-data and its
            weight-gradient GEMMs leave the SMs free (``token_dispatch.local_experts``).
        pair_weight_grads: under Megatron's training schedules, wherever the experts' weight gradients go straight
            into DDP's ``main_grad`` (the sonic dispatcher at expert-parallel size 1, or ``dispatcher='megatron'``;
            not with ``delay_wgrad_compute``), run the experts' weight-gradient GEMMs once per pair of
            micro-batches, over both micro-batches' rows, instead of once per micro-batch: one read and write of
            the fp32 ``main_grad`` per pair. Holds one micro-batch's dO, X, A' and dH per layer until the next
            micro-batch's backward (``sonic_megatron/wgrad.py``). Off: every backward computes its own.
        ep_slots: with expert parallelism (the sonic dispatcher), a training call after a layer's first sends its
            tokens and pairs in slots sized by the previous call, so that its forward has no host sync, where slots
            pay for the routing's shape (``token_dispatch/slots.py``: top-K routing over few ranks) and neither
            Megatron's 1F1B EP overlap nor ``variable_seq_lengths`` is on. The price is activation memory: H, kept
            for backward, is sized by the bound of the pairs (P * min(K, L) per token of the largest micro-batch
            instead of about K: about P times its size) in every layer from its forward to its backward. False:
            every call plans with exact split sizes (a host sync per layer call in the forward) and keeps H at the
            size of the pairs received.
    """

    backend: str = "auto"
    dispatcher: str = "sonic"
    token_rounding: str = "none"
    rounding_tile: int = 128
    num_chunks: int = 1
    redispatch_x_in_backward: bool = False
    comm_sms: int = 0
    pair_weight_grads: bool = True
    ep_slots: bool = True

    def __post_init__(self) -> None:
        from .kernels import BACKENDS

        _check_choice("backend", self.backend, BACKENDS)
        _check_choice("dispatcher", self.dispatcher, DISPATCHERS)
        # token rounding: TokenRounding's own rules (its modes, or "none" for off; its tile check)
        check_mode("SonicConfig.token_rounding", self.token_rounding, off=NO_ROUNDING)
        check_tile("SonicConfig.rounding_tile", self.rounding_tile)
        # token_dispatch's bound (EPOptions.num_chunks): the counts exchange is sized for MAX_CHUNKS chunks
        _check_int("num_chunks", self.num_chunks, minimum=1, maximum=MAX_CHUNKS)
        _check_int("comm_sms", self.comm_sms, minimum=0)
        _check_bool("redispatch_x_in_backward", self.redispatch_x_in_backward)
        _check_bool("pair_weight_grads", self.pair_weight_grads)
        _check_bool("ep_slots", self.ep_slots)
        if self.dispatcher == "megatron" and self.token_rounding != "none":
            raise ValueError(
                f"SonicConfig.token_rounding={self.token_rounding!r} needs dispatcher='sonic' (got "
                "dispatcher='megatron'): Megatron's dispatchers cannot carry rounded routings consistently "
                "(DeepEP re-derives top-K from the probs)"
            )
        if self.dispatcher == "megatron" and self.pipelined:
            raise ValueError("SonicConfig.num_chunks > 1 and redispatch_x_in_backward need dispatcher='sonic'")

    @property
    def pipelined(self) -> bool:
        """Dispatch, experts and combine run as one pipelined call (see ``num_chunks``)."""
        return self.num_chunks > 1 or self.redispatch_x_in_backward

    @property
    def rounding_enabled(self) -> bool:
        return self.token_rounding != "none"

    @classmethod
    def resolve(cls, base: SonicConfig | None = None, environ: dict[str, str] | None = None) -> SonicConfig:
        """``base`` (or the defaults) with ``SONIC_MEGATRON_<FIELD>`` environment overrides applied.

        An empty variable counts as unset. Raises ValueError for an unknown ``SONIC_MEGATRON_*`` variable
        (naming the known ones) and for a value that does not parse or is not allowed (naming the variable)."""
        if base is not None and not isinstance(base, SonicConfig):
            raise TypeError(f"SonicConfig.resolve: base must be a SonicConfig or None, got {type(base).__name__}")
        base = base if base is not None else cls()
        environ = os.environ if environ is None else environ
        check_env_names(environ)
        check_kernel_env(environ)
        changes, applied = {}, []
        for f in fields(cls):
            name = env_var(f.name)
            raw = environ.get(name)
            if raw is None or raw == "":
                continue
            changes[f.name] = _parse_env(name, raw, f.type)
            applied.append(f"{name}={raw!r}")
        if not changes:
            return base
        try:
            return dataclasses.replace(base, **changes)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{exc} (environment overrides: {', '.join(applied)})") from None


def env_var(field_name: str) -> str:
    """The environment variable of a SonicConfig field (``num_chunks`` -> ``SONIC_MEGATRON_NUM_CHUNKS``)."""
    return ENV_PREFIX + field_name.upper()


def known_env_vars() -> tuple[str, ...]:
    """Every ``SONIC_MEGATRON_*`` variable the package reads: SonicConfig's fields, then ``OTHER_ENV_VARS``."""
    return tuple(env_var(f.name) for f in fields(SonicConfig)) + OTHER_ENV_VARS


def check_env_names(environ) -> None:
    """Raise ValueError for a ``SONIC_MEGATRON_*`` name in ``environ`` that nothing reads (a typo would
    otherwise leave the option at its default without a word)."""
    known = known_env_vars()
    unknown = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in known)
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1)
        hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
    raise ValueError(
        f"unknown environment variable{'s' if len(unknown) > 1 else ''} {', '.join(hints)}; "
        f"the known SONIC_MEGATRON_* variables are {', '.join(known)}"
    )


def check_kernel_env(environ) -> None:
    """Raise ValueError for a bad value of the kernels' variables (``SONIC_MEGATRON_CUTE_TUNING``,
    ``SONIC_MEGATRON_CUTE_TILES``), naming the variable, what it takes and what it got. Parsed by
    ``kernels.options`` (no QuACK needed), so a bad value fails when the layer is built on any machine, not only
    where the ``cute`` backend is imported."""
    from .kernels.options import KernelOptions

    KernelOptions.from_env(environ)


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"SonicConfig.{name} must be one of {choices}, got {value!r} ({type(value).__name__})")


def _check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> None:
    rule = f"an int >= {minimum}" if maximum is None else f"an int in [{minimum}, {maximum}]"
    if isinstance(value, bool) or not isinstance(value, int):  # bool subclasses int: True would pass as 1
        raise TypeError(f"SonicConfig.{name} must be {rule}, got {value!r} ({type(value).__name__})")
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"SonicConfig.{name} must be {rule}, got {value!r}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):  # a string such as "no" would be truthy
        raise TypeError(f"SonicConfig.{name} must be a bool (True or False), got {value!r} ({type(value).__name__})")


def _parse_env(name: str, raw: str, type_name) -> object:
    """A field's value from its environment variable ``name``: bool and int strictly, str as is."""
    type_name = type_name if isinstance(type_name, str) else type_name.__name__
    word = raw.strip().lower()
    if type_name == "bool":
        if word not in BOOL_WORDS:
            raise ValueError(f"{name} must be one of {'/'.join(BOOL_WORDS)} (any case), got {raw!r}")
        return BOOL_WORDS[word]
    if type_name == "int":
        if not re.fullmatch(r"[+-]?[0-9]+", word):  # int() would also take "1_000" and non-ASCII digits
            raise ValueError(f"{name} must be an integer (decimal digits), got {raw!r}")
        return int(word)
    return raw


# ----------------------------------------------------------------------------------------------------------
# Megatron TransformerConfig validation
# ----------------------------------------------------------------------------------------------------------


def kernels_activation(config) -> str:
    """The ``sonic_megatron.kernels`` activation name matching Megatron's ``activation_func`` and
    ``gated_linear_unit`` (``--swiglu`` = GLU + silu). Raises ValueError for anything else."""
    from megatron.core.activations import squared_relu

    act = config.activation_func
    if config.gated_linear_unit:
        if act is F.silu:
            return "swiglu"
        if act is F.gelu:
            return "geglu"
        raise ValueError(
            f"sonic_megatron: gated_linear_unit=True needs activation_func F.silu (--swiglu) or F.gelu, got {act!r}"
        )
    if act is squared_relu:
        return "relu2"
    if act is F.gelu:
        return "gelu"
    raise ValueError(
        "sonic_megatron: activation_func must be F.silu or F.gelu with gated_linear_unit=True (--swiglu), or "
        f"squared_relu / F.gelu without it, got {act!r} (gated_linear_unit={config.gated_linear_unit})"
    )


def _reject(option: str, value: object, why: str) -> None:
    raise ValueError(f"sonic_megatron does not support {option}={value!r}: {why}")


def expert_ffn_per_rank(config, etp: int | None = None) -> int:
    """Each expert's ffn size on one rank: ``moe_ffn_hidden_size`` (else ``ffn_hidden_size``) / the expert
    tensor-parallel size ``etp`` (default: the config's, ``expert_tp_size``). Raises ValueError naming both when it
    does not divide."""
    ffn = getattr(config, "moe_ffn_hidden_size", None) or config.ffn_hidden_size
    etp = expert_tp_size(config) if etp is None else etp
    _check_ffn_split(ffn, etp)
    return ffn // etp


def expert_tp_size(config) -> int:
    """The expert tensor-parallel size of Megatron's ``config``: ``expert_tensor_parallel_size``, which Megatron
    takes from ``tensor_model_parallel_size`` when it is not given."""
    return getattr(config, "expert_tensor_parallel_size", None) or getattr(config, "tensor_model_parallel_size", 1) or 1


def _check_ffn_split(ffn: int, etp: int) -> None:
    if ffn % etp:
        raise ValueError(
            f"sonic_megatron: moe_ffn_hidden_size={ffn} (--moe-ffn-hidden-size) is not divisible by "
            f"expert_tensor_parallel_size={etp} (--expert-tensor-parallel-size; Megatron's default is "
            "--tensor-model-parallel-size): every expert-tensor-parallel rank holds an equal share of each expert's "
            "ffn dimension; pick an ffn size that is a multiple of it"
        )


def _check_router_topk(topk, num_experts: int) -> None:
    """Each token picks ``topk`` distinct experts: more than there are fails inside Megatron's top-k at the first
    forward ("selected index k out of range"), so refuse it here, naming both values."""
    if topk is not None and topk > num_experts:
        raise ValueError(
            f"sonic_megatron: moe_router_topk={topk} (--moe-router-topk) is larger than num_moe_experts={num_experts} "
            "(--num-experts): each token picks that many distinct experts; pass --moe-router-topk <= --num-experts"
        )


def _check_cuda_graphs(impl: str, modules, ep: int, field: str) -> None:
    """Refuse Megatron CUDA graphs that would capture the plugin's MoE layer where it cannot be captured:
    Megatron's partial MoE scopes (``moe``, ``moe_router``, ``moe_preprocess``) wrap MoELayer's own route and
    preprocess, which the plugin replaces; and at expert-parallel size > 1 any graph around the layer, because
    its plan reads the split sizes on the host once per call. Megatron captures the whole layer with
    ``full_iteration``, with an empty module list (``full`` in megatron-core 0.16), and with ``local`` for
    ``attn`` (megatron-core's local implementation graphs the whole TransformerLayer when it graphs the
    attention). ``field``: the config field holding the modules (``cuda_graph_modules``, 0.16's
    ``cuda_graph_scope``)."""
    if impl == "none":
        return
    modules = [modules] if isinstance(modules, str) else list(modules or [])
    names = [getattr(m, "name", str(m)) for m in modules]
    flag = "--" + field.replace("_", "-")
    if any("moe" in n for n in names):
        _reject(field, names, "capturing the plugin's MoE layer in a CUDA graph is not supported yet")
    whole_layer = (
        impl == "full_iteration"
        or not names
        or {"full", "full_iteration"} & set(names)  # megatron-core 0.16's spellings of the whole layer / iteration
        or (impl == "local" and "attn" in names)
    )
    if ep > 1 and whole_layer:
        raise ValueError(
            f"sonic_megatron: cuda_graph_impl={impl!r} (--cuda-graph-impl) with {field}={names} ({flag}) captures "
            f"the whole MoE layer in a CUDA graph, and at expert_model_parallel_size={ep} the layer reads its "
            "all-to-all split sizes on the host once per call, which a graph cannot capture; pass --cuda-graph-impl "
            f"transformer_engine {flag} attn (the attention only), or no CUDA graphs"
        )


def validate_megatron_config(config, sonic: SonicConfig) -> str:
    """Check that Megatron's config is a combination the plugin computes exactly; return the kernels
    activation name. Every failure names the Megatron option.

    Capacity factor / drop-and-pad (``moe_expert_capacity_factor``, ``moe_pad_expert_input_to_capacity``,
    ``moe_token_drop_policy``) are accepted: the router applies Megatron's own capacity and drop policy, so the
    same pairs are dropped (and padded with prob 0) as in the stock layer. Refused: pad-to-capacity without a
    capacity factor, and a capacity factor together with ``SonicConfig.token_rounding``."""
    g = lambda name, default=None: getattr(config, name, default)  # noqa: E731 - 0.16/0.19 field sets differ
    if not g("num_moe_experts"):
        _reject("num_moe_experts", g("num_moe_experts"), "a MoE layer needs --num-experts")
    ep = g("expert_model_parallel_size", 1) or 1
    if g("num_moe_experts") % ep != 0:  # checked here: Megatron's MoELayer asserts it with no message
        raise ValueError(
            f"sonic_megatron: num_moe_experts={g('num_moe_experts')} is not divisible by "
            f"expert_model_parallel_size={ep} (every expert-parallel rank holds the same number of experts); "
            "pick --num-experts as a multiple of --expert-model-parallel-size"
        )
    _check_router_topk(g("moe_router_topk"), g("num_moe_experts"))
    ffn = g("moe_ffn_hidden_size") or g("ffn_hidden_size")
    if ffn is not None:  # expert tensor parallelism splits the ffn dimension evenly
        _check_ffn_split(ffn, expert_tp_size(config))
    activation = kernels_activation(config)
    if g("add_bias_linear"):
        _reject("add_bias_linear", True, "the Sonic experts have no biases; pass --disable-bias-linear")
    if g("moe_apply_probs_on_input"):
        _reject("moe_apply_probs_on_input", True, "Sonic applies probs to the activation (SonicMoE's A' = s*A)")
    capacity_factor = g("moe_expert_capacity_factor")
    if g("moe_pad_expert_input_to_capacity") and capacity_factor is None:
        _reject(
            "moe_pad_expert_input_to_capacity",
            True,
            "padding to capacity needs a capacity; pass --moe-expert-capacity-factor (moe_expert_capacity_factor)",
        )
    policy = g("moe_token_drop_policy", "probs")
    if capacity_factor is not None and policy not in ("probs", "position"):
        _reject("moe_token_drop_policy", policy, "Megatron's drop policies are 'probs' and 'position'")
    if capacity_factor is not None and sonic.rounding_enabled:
        raise ValueError(
            f"sonic_megatron: moe_expert_capacity_factor={capacity_factor!r} (--moe-expert-capacity-factor) and "
            f"SonicConfig.token_rounding={sonic.token_rounding!r} ({env_var('token_rounding')}) both decide how many "
            "pairs every expert keeps; use one of them (token_rounding='none' with a capacity factor, or no capacity "
            "factor with token rounding)"
        )
    if g("moe_router_padding_for_quantization"):
        _reject("moe_router_padding_for_quantization", True, "for fp8/fp4 only; use token_rounding instead")
    for flag in ("fp8", "fp4"):
        if g(flag):
            _reject(flag, g(flag), "the Sonic kernels compute in bf16/fp16/fp32")
    if g("moe_latent_size"):
        _reject("moe_latent_size", g("moe_latent_size"), "MoE latent projections are not implemented")
    if g("moe_mlp_glu_interleave_size"):
        _reject("moe_mlp_glu_interleave_size", g("moe_mlp_glu_interleave_size"), "fc1 must be [gate ; up]")
    if g("glu_linear_offset", 0.0):
        _reject("glu_linear_offset", g("glu_linear_offset"), "the kernels compute act(gate) * up")
    if g("activation_func_clamp_value") is not None:
        _reject("activation_func_clamp_value", g("activation_func_clamp_value"), "not in the Sonic kernels")
    if g("overlap_dispatch_backward_with_experts_wgrad"):
        _reject("overlap_dispatch_backward_with_experts_wgrad", True, "needs Transformer Engine experts")
    field = "cuda_graph_modules" if hasattr(config, "cuda_graph_modules") else "cuda_graph_scope"
    _check_cuda_graphs(g("cuda_graph_impl", "none") or "none", g("cuda_graph_scope") or g(field), ep, field)
    dispatcher_type = g("moe_token_dispatcher_type")
    if sonic.dispatcher == "sonic" and dispatcher_type != "alltoall":
        _reject(
            "moe_token_dispatcher_type",
            dispatcher_type,
            "SonicConfig.dispatcher='sonic' replaces Megatron's alltoall dispatcher; pass "
            "--moe-token-dispatcher-type alltoall (or set SONIC_MEGATRON_DISPATCHER=megatron to keep "
            f"{dispatcher_type!r} and use the Sonic kernels for the experts only)",
        )
    return activation
