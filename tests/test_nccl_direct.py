"""token_dispatch.nccl_direct off the GPU: the switch is validated, and CPU tensors keep torch's collectives."""

from __future__ import annotations

import pytest
import torch
from _dist import run_distributed
from sonic_megatron.token_dispatch import nccl_direct


def test_ep_comm_switch_names_the_allowed_values(monkeypatch):
    monkeypatch.setenv("SONIC_MEGATRON_EP_COMM", "mpi")
    with pytest.raises(ValueError, match=r"SONIC_MEGATRON_EP_COMM must be one of \('nccl', 'torch'\)"):
        nccl_direct.impl()
    monkeypatch.setenv("SONIC_MEGATRON_EP_COMM", "torch")
    assert nccl_direct.impl() == "torch"
    monkeypatch.delenv("SONIC_MEGATRON_EP_COMM")
    assert nccl_direct.impl() == "nccl"


def test_unique_id_bytes_round_trip_with_zero_bytes_inside():
    raw = bytes([7, 0, 0, 255] * 32)  # NUL bytes must survive (ncclUniqueId is binary)
    uid = nccl_direct._id_from_bytes(raw)
    assert nccl_direct._id_bytes(uid) == raw
    with pytest.raises(ValueError, match="128 bytes"):
        nccl_direct._id_from_bytes(b"short")


def _gloo_worker(rank, world_size):
    from sonic_megatron.token_dispatch import comm

    group = torch.distributed.group.WORLD
    inp = torch.arange(4.0) + 10 * rank  # two rows to each rank
    out = torch.empty(4)
    comm.all_to_all(out, inp, [2, 2], [2, 2], group)
    return nccl_direct.available(group, inp), out


def test_cpu_tensors_on_gloo_use_torch_all_to_all():
    (avail0, out0), (avail1, out1) = run_distributed(_gloo_worker, 2)
    assert not avail0 and not avail1
    assert out0.tolist() == [0.0, 1.0, 10.0, 11.0] and out1.tolist() == [2.0, 3.0, 12.0, 13.0]
