"""``SonicRouter``: Megatron's TopKRouter with a fused top-K path for the plugin's layer.

Shape legend: T tokens (S/TP * B), E experts, K experts per token.

Which output the router gives is fixed when it is built, by the layer's resolved options (``LayerOptions``):

* **Megatron's format** (no options, or ``SonicConfig.dispatcher='megatron'``; every TopKRouter option):
  ``(probs [T, E], routing_map [T, E] bool)`` from TopKRouter's own ``routing``.
* **Top-K format** (the plugin's own dispatcher): one ``RouterOutput``: scores [T, K], indices [T, K] int64 and,
  in training with token rounding, the dense probabilities rounding ranks by. Where the options allow
  (``fused_unsupported_reason`` is None), the logits go through one fused top-K + softmax kernel
  (``kernels/triton/topk_softmax.py``) instead of TopKRouter's softmax, ``torch.topk`` over [T, E], dense probs and
  a bool map that the layer would only turn back into [T, K]. Covered exactly: softmax scores over the top-K logits
  (``moe_router_pre_softmax`` off) or over all logits (on), the top-K scaling factor, z-loss and the aux / seq-aux
  / global-aux losses (Megatron's own loss functions on the same statistics: dense softmax scores and the routed
  map). Anything else (sigmoid / sqrtsoftplus scores, expert bias, group-limited routing, sinkhorn, router replay,
  a padding mask) takes TopKRouter's path and is converted to top-K afterwards, so every option keeps working.
  Ties between equal logits: the fused kernel takes the lower expert, ``torch.topk`` leaves the order unspecified.
* **Flat format** (the plugin's dispatcher with Megatron's ``moe_expert_capacity_factor``): TopKRouter's own
  routing, which drops the pairs past every expert's capacity by ``moe_token_drop_policy`` (and with
  ``moe_pad_expert_input_to_capacity`` fills every expert to its capacity with prob-0 pairs), exactly as in the
  stock layer; a token then keeps 0..E pairs, so the output is one ``RouterOutput`` whose ``flat`` holds the map's
  pairs as a ``FlatRouting`` sorted by token (``flat_from_map``; no host sync: its size is the capacity's bound,
  exact with pad-to-capacity, else followed by padding pairs). Token rounding is refused with a capacity factor.

The logits: with ``moe_router_dtype='fp32'`` and a bf16 input on CUDA, the logits GEMM and its two gradients run
on the bf16 tensor cores over exact bf16 splits of fp32 operands with chunked accumulation, within the error of
Megatron's fp32 GEMMs on the CUDA cores (``router_gemm.py``); anything else takes TopKRouter's ``gating``.

Token rounding adds (token, expert) pairs that top-K did not choose and drops chosen ones; it ranks both by
the router's dense probability and gives added pairs that probability as their weight (SonicMoE does the
same), so gradients reach the router through them. ``RouterOutput.dense_probs_TE`` is that tensor: the score
function applied to the (z-loss-processed) logits, with autograd, before top-K and before any expert bias; padded
tokens (``padding_mask`` False) get probability 0. On the fused path, where the losses read the same
probabilities, rounding gets its own output of one softmax (``kernels/triton/shared_softmax.py``): the two
gradients meet inside the softmax backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from megatron.core.transformer.moe.router import TopKRouter

from .kernels import FlatRouting
from .router_gemm import router_logits, unsupported_reason

if TYPE_CHECKING:
    from .layer_options import LayerOptions

FUSED_ROUTING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")


def topk_indices(routing_map_TE: torch.Tensor, k: int) -> torch.Tensor:
    """The K expert ids of every token, ascending, from Megatron's bool routing map, without a host sync.
    A row with fewer than K routed experts (padding tokens) gets unrouted ids whose prob is 0."""
    keys = routing_map_TE.to(torch.int32) * routing_map_TE.shape[1] - torch.arange(
        routing_map_TE.shape[1], device=routing_map_TE.device, dtype=torch.int32
    )
    idx_TK = torch.topk(keys, k, dim=1).indices
    return torch.sort(idx_TK, dim=1).values


def as_topk(probs: torch.Tensor, routing_map: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [T, K], indices [T, K]) from either router format (see the module docstring)."""
    if routing_map.dtype != torch.bool:  # already top-K
        return probs, routing_map
    idx_TK = topk_indices(routing_map, k)
    return probs.gather(1, idx_TK), idx_TK


def capacity_pairs(config, num_tokens: int) -> tuple[int, bool]:
    """(pair count, exact) of a routing after Megatron's capacity (``apply_router_token_dropping``) for
    ``num_tokens`` tokens: every expert keeps at most ``capacity = ceil(T * K / E * capacity_factor)`` pairs (all T
    tokens where the capacity exceeds T). With ``moe_pad_expert_input_to_capacity`` every expert gets exactly
    ``min(capacity, T)`` pairs (``exact``); without it that is an upper bound, as is T * K."""
    from megatron.core.transformer.moe.moe_utils import get_capacity

    T, E, K = num_tokens, config.num_moe_experts, config.moe_router_topk
    capacity = get_capacity(num_tokens=T * K, num_experts=E, capacity_factor=config.moe_expert_capacity_factor)
    per_expert = min(capacity, T)
    if config.moe_pad_expert_input_to_capacity:
        return E * per_expert, True
    return min(E * per_expert, T * K), False


def flat_from_map(probs_TE: torch.Tensor, routing_map_TE: torch.Tensor, num_pairs: int, exact: bool) -> FlatRouting:
    """Megatron's ``(probs, routing_map)`` [T, E] as a ``FlatRouting`` of ``num_pairs`` pairs, sorted by token then
    expert, with no host sync: the map's True entries in row-major order. ``exact``: the map has exactly
    ``num_pairs`` True entries; else at most that many, and the rest are padding pairs (token T, expert E, score 0;
    ``FlatRouting.padded``). Scores keep autograd to ``probs_TE`` (a pair Megatron padded to capacity has prob 0)."""
    T, E = routing_map_TE.shape
    map_N = routing_map_TE.reshape(-1)
    dump = T * E  # the index of an empty slot (and where unrouted entries are scattered to, then cut off)
    slot_N = torch.where(map_N, torch.cumsum(map_N, 0) - 1, num_pairs)
    idx = torch.full((num_pairs + 1,), dump, dtype=torch.int64, device=map_N.device)
    idx.scatter_(0, slot_N, torch.arange(T * E, dtype=torch.int64, device=map_N.device))
    idx = idx[:num_pairs]
    if exact:
        return FlatRouting(idx // E, idx % E, probs_TE.reshape(-1)[idx], T)
    valid = idx < dump
    scores = torch.where(valid, probs_TE.reshape(-1)[idx.clamp(max=max(dump - 1, 0))], 0)
    return FlatRouting(idx // E, torch.where(valid, idx % E, E), scores.to(probs_TE.dtype), T, padded=True)


@dataclass(frozen=True)
class RouterOutput:
    """The router's decision for one micro-batch, in top-K format: token t uses experts ``indices_TK[t]`` with
    weights ``scores_TK[t]`` (with autograd to the router). ``dense_probs_TE`` [T, E] (with autograd) is given
    exactly when this forward rounds (training with ``SonicConfig.token_rounding``): rounding ranks by it and weighs
    the pairs it adds with it. None: plain top-K.

    With Megatron's capacity factor (``moe_expert_capacity_factor``) a token may keep 0..E pairs: the decision is
    then ``flat`` (a ``FlatRouting`` over global expert ids, ``flat_from_map``) and ``scores_TK`` / ``indices_TK``
    are None."""

    scores_TK: torch.Tensor | None
    indices_TK: torch.Tensor | None
    dense_probs_TE: torch.Tensor | None = None
    flat: FlatRouting | None = None

    @classmethod
    def from_megatron(cls, probs: torch.Tensor, routing_map: torch.Tensor, k: int, config=None) -> RouterOutput:
        """From a router in Megatron's format (``probs`` and ``routing_map`` [T, E]), without rounding. With a
        capacity factor in ``config`` (Megatron's token dropping applied by the router) the output is flat."""
        if probs.dim() != 2 or routing_map.dim() != 2:
            raise ValueError(
                "RouterOutput.from_megatron: probs and routing_map must be 2-D ([T, E] with a bool map, or top-K "
                f"[T, K] with int64 indices), got {tuple(probs.shape)} {tuple(routing_map.shape)} {routing_map.dtype}"
            )
        if (
            config is not None
            and getattr(config, "moe_expert_capacity_factor", None) is not None
            and routing_map.dtype == torch.bool
        ):
            return cls.from_capacity_map(probs, routing_map, config)
        return cls(*as_topk(probs, routing_map, k))

    @classmethod
    def from_capacity_map(cls, probs: torch.Tensor, routing_map: torch.Tensor, config) -> RouterOutput:
        """The flat output of TopKRouter's ``(probs, routing_map)`` after its capacity (``capacity_pairs``)."""
        num_pairs, exact = capacity_pairs(config, routing_map.shape[0])
        return cls(None, None, flat=flat_from_map(probs, routing_map, num_pairs, exact))


class SonicRouter(TopKRouter):
    """TopKRouter with the fused top-K path and the dense probabilities for token rounding (see the module
    docstring).

    Args:
        *args, **kwargs: TopKRouter's (``config``, ``pg_collection``, ...).
        options: the layer's resolved options: with the plugin's dispatcher the router gives one ``RouterOutput``
            per forward (with the dense probabilities in training when ``options.rounding`` is set). None, or
            ``dispatcher='megatron'``: TopKRouter's ``(probs, routing_map)``.
    """

    def __init__(self, *args, options: LayerOptions | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.gives_topk = options is not None and options.sonic_dispatch
        self.rounds_in_training = self.gives_topk and options.rounding is not None
        # Megatron's capacity factor: TopKRouter's routing drops (and pads) the pairs; the output is flat
        self.drops_to_capacity = getattr(self.config, "moe_expert_capacity_factor", None) is not None
        self._fused_reason = self._static_fused_reason()

    # -- which path --------------------------------------------------------------------------------------
    def _static_fused_reason(self) -> str | None:
        cfg = self.config
        if self.score_function != "softmax":
            return f"moe_router_score_function={self.score_function!r} (fused: 'softmax')"
        if self.routing_type not in FUSED_ROUTING_TYPES:
            return f"moe_router_load_balancing_type={self.routing_type!r} (fused: {FUSED_ROUTING_TYPES})"
        if getattr(self, "expert_bias", None) is not None:
            return "moe_router_enable_expert_bias"
        if getattr(cfg, "moe_router_num_groups", None):
            return "moe_router_num_groups (group-limited routing)"
        if getattr(cfg, "moe_expert_capacity_factor", None) is not None:
            return "moe_expert_capacity_factor"
        if getattr(self, "router_replay", None) is not None:
            return "router replay"
        if cfg.num_moe_experts > 4096:
            return f"num_moe_experts={cfg.num_moe_experts} (fused: <= 4096)"
        return None

    def fused_unsupported_reason(self, logits: torch.Tensor, padding_mask: torch.Tensor | None) -> str | None:
        """None when this forward can take the fused top-K path, else why not."""
        if self._fused_reason is not None:
            return self._fused_reason
        if padding_mask is not None:
            return "a padding mask"
        if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"router logits dtype {logits.dtype} (fused: fp32, bf16, fp16)"
        from .kernels.triton.topk_softmax import _kernel_runs_on

        if not _kernel_runs_on(logits.device):
            return f"device {logits.device} (the fused kernel runs on CUDA, or on CPU under TRITON_INTERPRET=1)"
        return None

    # -- gating ------------------------------------------------------------------------------------------
    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """TopKRouter's logits; fp32 logits of a bf16 input on CUDA on the tensor cores (``router_gemm.py``)."""
        if unsupported_reason(input, self.weight, self.config.moe_router_dtype) is not None:
            return super().gating(input)
        return router_logits(input, self.weight, self.bias)

    # -- routing -----------------------------------------------------------------------------------------
    def forward(self, input: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """Megatron's format: TopKRouter's ``(probs, routing_map)``. Top-K format: one ``RouterOutput``."""
        first, second = super().forward(input, padding_mask)  # TopKRouter: jitter, gating, then routing() below
        return first if self.gives_topk else (first, second)

    def routing(self, logits: torch.Tensor, *args, **kwargs):
        """Megatron's format: TopKRouter's. Top-K format: ``(RouterOutput, None)``, the pair TopKRouter.forward
        unpacks (``forward`` above returns the output alone)."""
        if not self.gives_topk:
            return super().routing(logits, *args, **kwargs)
        if self.drops_to_capacity:  # TopKRouter's capacity and drop policy (never the fused path: see above)
            return RouterOutput.from_capacity_map(*super().routing(logits, *args, **kwargs), self.config), None
        padding_mask = kwargs.get("padding_mask", args[0] if args else None)
        keep_dense = self.rounds_in_training and self.training
        if self.fused_unsupported_reason(logits, padding_mask) is None:
            return self._fused_routing(logits, keep_dense), None
        probs, routing_map = super().routing(logits, *args, **kwargs)
        dense_TE = self._dense_probs(logits, padding_mask) if keep_dense else None
        return RouterOutput(*as_topk(probs, routing_map, self.topk), dense_TE), None

    def _fused_routing(self, logits: torch.Tensor, keep_dense: bool) -> RouterOutput:
        """TopKRouter.routing's softmax top-K in one kernel; the losses through Megatron's own functions."""
        from .kernels.triton.shared_softmax import shared_softmax
        from .kernels.triton.topk_softmax import topk_softmax

        seq_length, bsz = logits.shape[:2]
        logits_TE = self.apply_z_loss(logits.view(-1, self.config.num_moe_experts))
        scores_TK, idx_TK = topk_softmax(logits_TE, self.topk)  # fp32 softmax over the K selected logits
        with_aux = self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled()
        dense_TE = rounding_TE = None
        if keep_dense and (with_aux or self.config.moe_router_pre_softmax):
            # two readers (the losses or the pre-softmax scores, and token rounding): one output each, so that
            # their gradients meet inside one softmax backward instead of in a [T, E] sum
            dense_TE, rounding_TE = shared_softmax(logits_TE)
        elif with_aux or self.config.moe_router_pre_softmax or keep_dense:
            dense_TE = rounding_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        if self.config.moe_router_pre_softmax:  # Megatron: top-K of softmax over all experts, no renormalising
            scores_TK = dense_TE.type_as(logits_TE).gather(1, idx_TK)
        elif logits_TE.dtype != torch.float32:
            scores_TK = scores_TK.type_as(logits_TE)  # TopKRouter's probs keep the logits' dtype
        scale = getattr(self.config, "moe_router_topk_scaling_factor", None)
        if scale:
            scores_TK = scores_TK * scale
        if with_aux:
            map_TE = torch.zeros_like(logits_TE, dtype=torch.bool).scatter_(1, idx_TK, True)
            scores_TK = self._apply_aux_loss(scores_TK, dense_TE, map_TE, with_padding_mask=False)
            scores_TK = self._apply_seq_aux_loss(scores_TK, dense_TE, map_TE, seq_length, bsz, with_padding_mask=False)
            scores_TK = self._apply_global_aux_loss(scores_TK, dense_TE, map_TE, with_padding_mask=False)
        if not keep_dense:
            return RouterOutput(scores_TK, idx_TK)
        return RouterOutput(scores_TK, idx_TK, rounding_TE * scale if scale else rounding_TE)

    def _dense_probs(self, logits: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
        logits_TE = logits.reshape(-1, self.config.num_moe_experts).float()
        fn = self.score_function
        if fn == "softmax":
            dense = torch.softmax(logits_TE, dim=-1)
        elif fn == "sigmoid":
            dense = torch.sigmoid(logits_TE)
        elif fn == "sqrtsoftplus":
            dense = torch.nn.functional.softplus(logits_TE).sqrt()
        else:
            raise ValueError(f"SonicRouter: token rounding does not support moe_router_score_function={fn!r}")
        scale = getattr(self.config, "moe_router_topk_scaling_factor", None)
        if scale:
            dense = dense * scale
        if padding_mask is not None:
            dense = dense * padding_mask.reshape(-1, 1).to(dense.dtype)
        return dense
