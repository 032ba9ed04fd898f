import os

import pytest
import torch

if not torch.cuda.is_available():
    # Our Triton kernels run on the CPU under Triton's interpreter, which must be on before kernels/triton is
    # imported (a @triton.jit function made without it cannot be interpreted), whichever test module imports it
    # first while the suite is collected.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords or "hopper" in item.keywords:
            item.add_marker(skip)
