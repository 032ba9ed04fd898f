"""Own Triton kernels for the memory-bound parts of the ``cute`` backend (as in SonicMoE):

    metadata.py    routing metadata (expert offsets and the three index arrays), device-side, no host sync
    gather_sum.py  deterministic fp32 gather-and-sum over each token's pairs: the forward aggregation
                   O_t = sum_j s_j Y[row(j)] and the backward dX_t = sum_j dX~[row(j)]
    topk_softmax.py router top-K + softmax over the logits in one launch, its dense backward in one launch
    bf16_split.py   exact bf16 parts of an fp32 matrix side by side in one launch (the router's fp32 GEMMs)
    shared_softmax.py the router's dense softmax for two readers (aux losses, token rounding): their gradients
                   added inside one softmax backward launch

No atomics: every output element is written by exactly one program, sums run in a fixed order, so two runs
give bitwise equal results. They run on CPU too under ``TRITON_INTERPRET=1`` (tests/test_triton_interpret.py).
Importing this package needs ``triton`` (not a dependency of CPU installs).
"""

from .gather_sum import gather_sum
from .metadata import compute_metadata_topk_triton, compute_metadata_triton
from .topk_softmax import topk_softmax

__all__ = [
    "compute_metadata_topk_triton",
    "compute_metadata_triton",
    "gather_sum",
    "topk_softmax",
]
