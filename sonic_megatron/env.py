"""``python -m sonic_megatron env``: what this machine can run."""

from __future__ import annotations

import importlib.metadata as md

import torch


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def report() -> int:
    from .kernels.interface import cute_unavailable_reason

    print(f"torch {torch.__version__}, megatron-core {_version('megatron-core')}, triton {_version('triton')}")
    print(f"nvidia-cutlass-dsl {_version('nvidia-cutlass-dsl')}, quack-kernels {_version('quack-kernels')}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            dev = torch.device("cuda", i)
            reason = cute_unavailable_reason(dev)
            status = "ok" if reason is None else "no: " + reason
            print(f"cuda:{i} {torch.cuda.get_device_name(i)}: backend cute {status}")
    else:
        print("no CUDA GPU: backend torch only")
    return 0
