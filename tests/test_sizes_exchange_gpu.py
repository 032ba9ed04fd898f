"""GPU checks of the plan's sizes exchange (``token_dispatch/sizes.py``): it runs on a stream of its own, ordered
after the work that wrote the exchange vector, and the current stream does not wait for it."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _exchange():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.zeros(64, dtype=torch.int64, device="cuda")


def test_exchange_follows_the_writer():
    from sonic_megatron.token_dispatch.sizes import launch_exchange

    exchange = _exchange()
    torch.cuda._sleep(200_000_000)  # a slow writer on the current stream
    exchange.copy_(torch.arange(64, device="cuda"))
    sizes = launch_exchange(exchange, None)
    sizes.ready.synchronize()
    assert sizes.host.tolist() == [list(range(64))]
    assert torch.equal(sizes.device.cpu(), torch.arange(64).reshape(1, 64))


def test_exchange_leaves_the_current_stream_free():
    from sonic_megatron.token_dispatch.sizes import _exchange_stream, launch_exchange

    exchange = _exchange()
    exchange.copy_(torch.arange(64, device="cuda"))
    with torch.cuda.stream(_exchange_stream(exchange.device)):
        torch.cuda._sleep(400_000_000)  # the exchange's stream is busy for a while (a slow peer, in effect)
    sizes = launch_exchange(exchange, None)
    after = torch.cuda.Event()
    after.record()  # queued on the current stream after the exchange
    after.synchronize()
    assert not sizes.ready.query(), "the current stream waited for the sizes exchange"
    sizes.ready.synchronize()
    assert sizes.host.tolist() == [list(range(64))]
