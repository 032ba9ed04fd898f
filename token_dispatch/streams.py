"""The CUDA side stream of the interleaved step (``interleave.py``, ``plan_stream="side"``) and the memory rules
that come with it.

The next micro-batch's plan sync and dispatch launch run on a side stream so that they do not wait behind
the previous micro-batch's GEMMs queued on the current stream. The caching allocator orders the reuse of a
freed block only within the stream it belongs to: a block freed on the current stream can be handed out
again while kernels queued earlier on that stream still use it. A buffer that the side stream -- or a
collective launched from it, which waits only for the side stream -- writes must therefore come from the
side stream's own memory (allocated while the side stream is current), and be recorded for the current
stream that reads it later (``record_for``: so that it is not reused before that stream is done with it).
"""

from __future__ import annotations

import contextlib
import functools

import torch


@functools.cache
def _cuda_side_stream(index: int) -> torch.cuda.Stream:
    # One per device for the process, so that its memory stays in one pool of the caching allocator.
    return torch.cuda.Stream(device=torch.device("cuda", index))


def side_stream(device: torch.device):
    """The side stream of ``device``; None on CPUs (gloo: no streams, the same order of work)."""
    if device.type != "cuda":
        return None
    return _cuda_side_stream(device.index if device.index is not None else torch.cuda.current_device())


def on(stream):
    """``torch.cuda.stream(stream)``, or nothing for ``None``."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def record_for(t: torch.Tensor, current) -> None:
    """Mark ``t`` -- allocated while the side stream was current, i.e. from its memory -- as used by ``current``
    too, so that its block is not handed out again before ``current`` is done with it; nothing for None."""
    if current is not None:
        t.record_stream(current)
