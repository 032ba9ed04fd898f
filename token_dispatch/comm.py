"""Thin wrappers over torch.distributed for one EP group (gloo on CPUs, NCCL on GPUs).

``group=None`` (or a group of size 1) means a single process: nothing is communicated and an all-to-all
returns its input. Every all-to-all can run asynchronously (``async_op=True``): on NCCL the collective runs
on the process group's internal stream, ordered after the work already queued on the current stream, and
``Work.wait()`` makes the current stream wait for it (ProcessGroupNCCL keeps the buffers alive until then),
so overlap needs no hand-made streams or events and stays race-free when repeated. On gloo the collective
runs on gloo's worker thread while the caller computes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    """P: number of ranks of the EP group (1 for ``None``)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This process's rank inside the EP group (0 for ``None``)."""
    return 0 if group is None else dist.get_rank(group)


def group_fingerprint(group) -> int:
    """A 61-bit hash of the group's global ranks, so that members that pass different groups of the same
    size (a wiring bug) find out in the header exchange instead of computing with mismatched peers."""
    if group is None:
        return 0
    h = 0
    for r in dist.get_process_group_ranks(group):
        h = (h * 1000003 + r + 1) % (2**61 - 1)
    return h


class Pending:
    """A list of in-flight collectives; ``wait()`` waits for all of them (in launch order)."""

    def __init__(self) -> None:
        self._works: list = []

    def add(self, work) -> None:
        if work is not None:
            self._works.append(work)

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works.clear()


def all_to_all(
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group,
    async_op: bool = False,
):
    """All-to-all along dim 0 with uneven splits into the preallocated ``out``. Returns the work handle when
    ``async_op`` (None when nothing was communicated). Single process: copies ``inp`` into ``out``."""
    if group_size(group) == 1:
        out.copy_(inp)
        return None
    opts = dist.AllToAllOptions()
    opts.asyncOp = async_op
    work = _group_all_to_all(group)(out, inp, list(out_splits), list(in_splits), opts)
    if async_op:
        return work
    if work is not None:  # NCCL's blocking form returns no work: it is already ordered on the current stream
        work.wait()
    return None


def _group_all_to_all(group):
    """The process group's own all-to-all method, called directly: ``dist.all_to_all_single``'s Python wrapper
    (torch-function dispatch, argument checks that hold here by construction, exception logging) costs host time
    on every call, and the layer's speed follows its host (docs/PERF.md, "Expert parallelism").
    Whichever of ``all_to_all_single`` / ``alltoall_base`` (older torch) the installed torch has."""
    method = getattr(group, "all_to_all_single", None)
    return method if method is not None else group.alltoall_base


# torch >= 2.13 renames all_gather_into_tensor (and warns); the GPU image's torch 2.11 has only the old name.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather(t: torch.Tensor, group) -> torch.Tensor:
    """[P, *t.shape]: every rank's ``t`` (same shape on every rank by construction)."""
    P = group_size(group)
    if P == 1:
        return t.unsqueeze(0)
    out = t.new_empty(P, *t.shape)
    all_gather_into(out, t, group)
    return out


def all_gather_into(out: torch.Tensor, t: torch.Tensor, group) -> None:
    """Every rank's ``t`` into the preallocated contiguous ``out`` [P, *t.shape]; the current stream waits for it."""
    if group_size(group) == 1:
        out[0].copy_(t)
        return
    _all_gather_flat(out.view(-1), t.contiguous().reshape(-1), group=group)


def all_gather_strings(msg: str, group) -> list[str]:
    """Every rank's message (only on the error path: pickles through ``all_gather_object``)."""
    if group_size(group) == 1:
        return [msg]
    out: list = [None] * group_size(group)
    dist.all_gather_object(out, msg, group=group)
    return out
