"""SonicMoE's experts algorithm for one device's experts (no torch.distributed, no Megatron).

from sonic_megatron.kernels import moe_experts, TopKRouting, FlatRouting
out = moe_experts(x, TopKRouting(scores, indices), w1, w2, activation="swiglu", backend="auto")
"""

from .activations import ACTIVATIONS, GATED_ACTIVATIONS
from .interface import BACKENDS, MoEExpertsFunction, compute_metadata, moe_experts, resolve_backend
from .reference import moe_experts_reference
from .routing import FlatRouting, Routing, RoutingMetadata, TopKRouting

__all__ = [
    "ACTIVATIONS",
    "BACKENDS",
    "GATED_ACTIVATIONS",
    "FlatRouting",
    "MoEExpertsFunction",
    "Routing",
    "RoutingMetadata",
    "TopKRouting",
    "compute_metadata",
    "moe_experts",
    "moe_experts_reference",
    "resolve_backend",
]
