"""``SonicRouter``: Megatron's TopKRouter, unchanged (all its options: softmax/sigmoid scores, pre-softmax,
top-k scaling, expert bias, group-limited routing, aux/seq-aux/global-aux and z-loss, input jitter), that
also keeps the dense router probabilities of the last forward for token rounding.

Shape legend: T tokens (S/TP * B), E experts.

Token rounding adds (token, expert) pairs that top-K did not choose and drops chosen ones; it ranks both by
the router's dense probability and gives added pairs that probability as their weight (SonicMoE does the
same), so gradients reach the router through them. ``dense_probs_TE`` is that tensor: the score function
applied to the (z-loss-processed) logits, with autograd, before top-K and before any expert bias; padded
tokens (``padding_mask`` False) get probability 0. It is per-microbatch forward state: ``SonicMoELayer``
reads it in ``preprocess`` right after ``route`` (same schedule node) and drops the reference.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.router import TopKRouter


class SonicRouter(TopKRouter):
    """TopKRouter recording ``dense_probs_TE`` when ``keep_dense_probs`` is set (by SonicMoELayer when
    token rounding is on and the module is training)."""

    keep_dense_probs: bool = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dense_probs_TE: torch.Tensor | None = None

    def routing(self, logits: torch.Tensor, *args, **kwargs):
        probs, routing_map = super().routing(logits, *args, **kwargs)
        if self.keep_dense_probs:
            self.dense_probs_TE = self._dense_probs(logits, kwargs.get("padding_mask", args[0] if args else None))
        return probs, routing_map

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

    def pop_dense_probs(self) -> torch.Tensor | None:
        """The dense probabilities of the last forward (once; the reference is dropped)."""
        dense, self.dense_probs_TE = self.dense_probs_TE, None
        return dense
