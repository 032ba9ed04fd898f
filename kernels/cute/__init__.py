"""Backend ``cute`` (Hopper, SM90): QuACK CuTe-DSL grouped GEMMs with SonicMoE's fusions and own Triton
kernels for metadata and aggregation (``ops.py``). Importing it needs the ``hopper`` extra at its tested versions
and a CUDA build of torch: ``quack_adapter`` (imported first, before anything imports QuACK) checks both, points
QuACK's compile cache at a persistent folder and holds every use of QuACK's internals.
"""

from . import quack_adapter  # noqa: F401  (raises ImportError, saying why, where the backend cannot run)
