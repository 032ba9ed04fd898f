import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Our Triton kernels run on the CPU under Triton's interpreter, which must be on before kernels/triton is
    # imported (a @triton.jit function made without it cannot be interpreted), whichever test module imports it
    # first while the suite is collected.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    """Before Triton 3.7, Triton's interpreter converts one-element arrays to Python ints in a way that numpy 2.4
    rejects: every interpreted kernel would fail with a TypeError. Say that once, with the way out."""
    if os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None:
        return
    import numpy
    import triton
    from packaging.version import Version

    if Version(triton.__version__) < Version("3.7") and Version(numpy.__version__) >= Version("2.4"):
        raise pytest.UsageError(
            f"Triton {triton.__version__}'s interpreter (our Triton kernels on CPU) needs numpy < 2.4, found numpy "
            f"{numpy.__version__}: install 'numpy<2.4' or 'triton>=3.7,<3.10'"
        )


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords or "hopper" in item.keywords:
            item.add_marker(skip)
