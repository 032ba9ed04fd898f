"""The plugin layer at expert-parallel size 1 (cute backend) captured in a CUDA graph, forward and backward: its
replays bitwise equal to eager steps on new inputs (the path has no host sync and no shape read back). The replay's
speed against eager: the graph step of scripts/gpu_megatron.py."""

from __future__ import annotations

import pytest
import torch
from test_kernels_helpers import require_cute

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def layer():
    require_cute()
    import torch.distributed as dist

    from sonic_megatron.testing import free_port, gpu_layer_inputs, init_distributed, init_model_parallel

    if not dist.is_initialized():
        init_distributed(0, 1, port=free_port())
    init_model_parallel(ep=1)
    return gpu_layer_inputs((4096, 1024, 512, 32, 4), seq=1024)


def test_graph_replays_equal_eager(layer):
    from sonic_megatron.testing import graphed_layer_step, layer_step

    module, params, x, grad = layer
    replay, static = graphed_layer_step(module, params, x, grad)
    for seed in (1, 2):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        with torch.no_grad():
            x.copy_(torch.randn(x.shape, generator=gen, device="cuda", dtype=x.dtype))
            grad.copy_(torch.randn(grad.shape, generator=gen, device="cuda", dtype=grad.dtype))
        replay()
        eager = layer_step(module, params, x, grad)
        names = ["out", "dx"] + [f"d{n}" for n in ("router", "w1", "w2")]
        for name, a, b in zip(names, static, eager, strict=True):
            assert torch.equal(a, b), f"seed {seed}: {name} differs between the graph replay and eager"
