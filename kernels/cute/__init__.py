"""Backend ``cute`` (Hopper, SM90): QuACK CuTe-DSL grouped GEMMs with SonicMoE's fusions and own Triton
kernels for metadata and aggregation. Importing it needs the ``hopper`` extra and a CUDA build of torch."""

import torch

if not torch.cuda.is_available():
    raise ImportError("the cute backend needs a CUDA build of torch and a GPU")
import quack  # noqa: F401  (raises ImportError without the hopper extra)
