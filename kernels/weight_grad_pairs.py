"""The experts' weight gradients as a unit of work, and two micro-batches' work merged into one.

Shape legend: see ``kernels/routing.py``; a and b two micro-batches of the same experts, G = 2F (gated) or F.

dW1 and dW2 are varlen-K GEMMs: every expert's rows are the K dimension and its whole weight gradient is the
output. Under Megatron the output is fp32 ``main_grad``, read and written once per call, which makes these
GEMMs store-bound at a few tiles of rows per expert. ``WeightGradWork.merged_with`` puts two micro-batches' rows
into one set of inputs (each expert's rows: a's, then b's; tokens [x_a; x_b]), so one call of the weight GEMMs
gives the sum of both micro-batches' gradients with one pass over ``main_grad`` instead of two. Merging copies
dH and A' once (``triton/wgrad_merge.py`` on CUDA; ``merge_rows_torch`` here is its reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from .routing import RoutingMetadata


def merge_rows_torch(dH_a, ap_a, idx_a, off_a, dH_b, ap_b, idx_b, off_b, num_tokens_a: int):
    """The merged (dH, A', gather index) of ``triton/wgrad_merge.py`` with PyTorch ops (its layout is described
    there)."""
    Ra, Rb = dH_a.shape[0], dH_b.shape[0]
    device = dH_a.device
    dst = []
    for R, off_self, shift_of_expert in (
        (Ra, off_a, off_b.long()),  # expert e's rows of a: after b's rows of the experts before e
        (Rb, off_b, torch.cat([off_a[1:].long(), torch.tensor([Ra], device=device)])),  # after a's rows up to e
    ):
        rows = torch.arange(R, device=device)
        expert = torch.searchsorted(off_self[1:].long().contiguous(), rows, right=True)  # padding rows: E
        dst.append(rows + shift_of_expert[expert])
    dst_all = torch.cat(dst)
    dH = torch.empty(Ra + Rb, dH_a.shape[1], dtype=dH_a.dtype, device=device)
    ap = torch.empty(Ra + Rb, ap_a.shape[1], dtype=ap_a.dtype, device=device)
    idx = torch.empty(Ra + Rb, dtype=torch.int32, device=device)
    dH[dst_all] = torch.cat([dH_a, dH_b])
    ap[dst_all] = torch.cat([ap_a, ap_b])
    idx[dst_all] = torch.cat([idx_a, idx_b + num_tokens_a]).to(torch.int32)
    return dH, ap, idx


@dataclass(frozen=True)
class WeightGradWork:
    """What one backward's weight GEMMs read, callable as ``ops.backward_weights`` on it (``out``, ``accumulate``
    as there). Weight gradients read only ``meta.expert_offsets`` and ``meta.x_gather_idx``."""

    ops: ModuleType
    dO_TD: torch.Tensor
    x_TD: torch.Tensor
    aprime_RF: torch.Tensor
    dH_RG: torch.Tensor
    meta: RoutingMetadata

    def __call__(self, out=None, accumulate: bool = True):
        return self.ops.backward_weights(
            self.dO_TD, self.x_TD, self.aprime_RF, self.dH_RG, self.meta, out=out, accumulate=accumulate
        )

    def merged_with(self, later: WeightGradWork) -> WeightGradWork:
        """One work whose weight gradients are this one's plus ``later``'s (same experts, same dtypes)."""
        a, b = self.meta, later.meta
        args = (self.dH_RG, self.aprime_RF, a.x_gather_idx, a.expert_offsets)
        args += (later.dH_RG, later.aprime_RF, b.x_gather_idx, b.expert_offsets, self.x_TD.shape[0])
        merge = merge_rows_torch
        if self.dH_RG.is_cuda:
            from .triton.wgrad_merge import merge_rows_triton as merge
        dH, ap, idx = merge(*(t.contiguous() if isinstance(t, torch.Tensor) else t for t in args))
        none = idx.new_empty(0)
        meta = RoutingMetadata(a.expert_offsets + b.expert_offsets, idx, none, none, none)
        x = torch.cat([self.x_TD, later.x_TD])
        dO = torch.cat([self.dO_TD, later.dO_TD])
        return WeightGradWork(self.ops, dO, x, ap, dH, meta)
