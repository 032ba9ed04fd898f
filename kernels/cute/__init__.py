"""Backend ``cute`` (Hopper, SM90): QuACK CuTe-DSL grouped GEMMs with SonicMoE's fusions and own Triton
kernels for metadata and aggregation (``ops.py``). Importing it needs the ``hopper`` extra within its supported
versions and a CUDA build of torch: ``quack_adapter`` (imported first, before anything imports QuACK) checks both
and holds every launch of QuACK's GEMMs under the heuristic tuning (their launch plans, the SM budget).
"""

from . import quack_adapter  # noqa: F401  (raises ImportError, saying why, where the backend cannot run)
