"""Backend ``cute`` (Hopper, SM90): QuACK CuTe-DSL grouped GEMMs with SonicMoE's fusions and own Triton
kernels for metadata and aggregation. Importing it needs the ``hopper`` extra and a CUDA build of torch.

Compile cache: QuACK keeps compiled kernels as .o files and autotuning results on disk, both under
``QUACK_CACHE_DIR``. Unless the caller set it, we point it at a persistent per-user folder
(``$XDG_CACHE_HOME/sonic_megatron/quack``, default ``~/.cache/sonic_megatron/quack``) before QuACK is
imported (it reads the variable at import), so a restarted job loads kernels in milliseconds instead of
recompiling every layer shape. ``SONIC_MEGATRON_CACHE_DIR`` overrides the folder.
"""

import os

import torch

if not torch.cuda.is_available():
    raise ImportError("the cute backend needs a CUDA build of torch and a GPU")


def _default_cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("SONIC_MEGATRON_CACHE_DIR") or os.path.join(root, "sonic_megatron", "quack")


os.environ.setdefault("QUACK_CACHE_DIR", _default_cache_dir())
os.environ.setdefault("QUACK_CACHE_AUTOTUNING", "1")

import quack  # noqa: E402, F401  (raises ImportError without the hopper extra)
