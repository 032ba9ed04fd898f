"""All-to-all through NCCL's C API (ctypes) on a private communicator of the EP group's ranks.

Why: at the issue-4 size the EP layer is host-bound, and ``torch.distributed.all_to_all_single`` costs about
0.1 ms of host time per call on the GPU machine (ProcessGroupNCCL's work object, flight-recorder entry, stream
sync, the call's 2P send/recv) against 0.5 ms of transfer; a chunked schedule makes five such calls per stage.
This module issues the same grouped ``ncclSend`` / ``ncclRecv`` calls itself: one communicator per
(group, device), created collectively on first use (its unique id travels over the group), one side stream per
communicator. The bytes moved, their order and the results are those of ``all_to_all_single``.

Ordering: the side stream waits for the caller's current stream before the transfer; ``Work.wait()`` makes the
caller's current stream wait for the transfer's end (as ``all_to_all_single(async_op=True)``). The work object
keeps both tensors alive until it is waited for, so the caching allocator cannot hand their memory to another
kernel while the transfer runs. Operations are issued in program order on every rank, like any collective.

Selection (``comm.all_to_all``): CUDA tensors on an NCCL group of size > 1, unless
``SONIC_MEGATRON_EP_COMM=torch`` (A/B benchmarks; the default is ``nccl``). The communicator is never destroyed
(NCCL's teardown at interpreter exit can wait for peers that already left); it holds NCCL's usual per-peer
buffers on the device.
"""

from __future__ import annotations

import ctypes
import math
import os

import torch
import torch.distributed as dist

EP_COMM_IMPLS = ("nccl", "torch")
_NCCL_UINT8 = 1  # ncclDataType_t: ncclInt8 = 0, ncclUint8 = 1 (byte counts, any dtype)
_UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * _UNIQUE_ID_BYTES)]


def _id_bytes(uid: _UniqueId) -> bytes:
    """The id's 128 bytes (a c_char array field reads as NUL-terminated bytes, so read the memory)."""
    return ctypes.string_at(ctypes.addressof(uid), _UNIQUE_ID_BYTES)


def _id_from_bytes(raw: bytes) -> _UniqueId:
    if len(raw) != _UNIQUE_ID_BYTES:
        raise ValueError(f"an ncclUniqueId has {_UNIQUE_ID_BYTES} bytes, got {len(raw)}")
    uid = _UniqueId()
    ctypes.memmove(ctypes.addressof(uid), raw, _UNIQUE_ID_BYTES)
    return uid


_lib = None
_comms: dict = {}  # (id(group), device index) -> _Comm
_nccl_groups: dict = {}  # id(group) -> whether its backend is NCCL


def impl() -> str:
    """``SONIC_MEGATRON_EP_COMM`` (default ``nccl``), checked."""
    v = os.environ.get("SONIC_MEGATRON_EP_COMM", "nccl")
    if v not in EP_COMM_IMPLS:
        raise ValueError(f"SONIC_MEGATRON_EP_COMM must be one of {EP_COMM_IMPLS}, got {v!r}")
    return v


def _load():
    """NCCL's shared library: the one torch's NCCL backend loaded (same soname), with argument types."""
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libnccl.so.2")
        vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(_UniqueId)]
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(vp), i, _UniqueId, i]
        lib.ncclSend.argtypes = [vp, sz, i, i, vp, vp]
        lib.ncclRecv.argtypes = [vp, sz, i, i, vp, vp]
        lib.ncclGroupStart.argtypes = []
        lib.ncclGroupEnd.argtypes = []
        lib.ncclGetErrorString.argtypes = [i]
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        _lib = lib
    return _lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"token_dispatch.nccl_direct: {what} failed: {_load().ncclGetErrorString(rc).decode()}")


def available(group, t: torch.Tensor) -> bool:
    """Whether ``all_to_all`` below applies: a CUDA tensor, an NCCL group, NCCL's library loadable, and the
    environment does not ask for torch's collective."""
    if not t.is_cuda or impl() != "nccl":
        return False
    key = id(group)
    if key not in _nccl_groups:
        try:
            _nccl_groups[key] = "nccl" in str(dist.get_backend(group)) and _load() is not None
        except OSError:
            _nccl_groups[key] = False
    return _nccl_groups[key]


class _Comm:
    """A communicator over ``group``'s ranks on ``device`` and its side stream. Collective to create."""

    def __init__(self, group, device: torch.device) -> None:
        lib = _load()
        self.group = group  # held: keeps id(group), the cache key, from being reused by another group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        uid = _UniqueId()
        if self.rank == 0:
            _check(lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        buf = torch.tensor(list(_id_bytes(uid)), dtype=torch.uint8, device=device)  # zeros off rank 0
        dist.broadcast(buf, src=dist.get_global_rank(group, 0), group=group)
        uid = _id_from_bytes(bytes(buf.tolist()))
        self.comm = ctypes.c_void_p()
        with torch.cuda.device(device):
            _check(lib.ncclCommInitRank(ctypes.byref(self.comm), self.size, uid, self.rank), "ncclCommInitRank")
        self.stream = torch.cuda.Stream(device=device)


class Work:
    """An in-flight all-to-all; ``wait()`` orders the current stream after it (and releases its tensors)."""

    def __init__(self, done: torch.cuda.Event, device: torch.device, tensors: tuple) -> None:
        self._done, self._device, self._tensors = done, device, tensors

    def wait(self) -> None:
        torch.cuda.current_stream(self._device).wait_event(self._done)
        self._tensors = ()


def _comm(group, device: torch.device) -> _Comm:
    key = (id(group), device.index)
    c = _comms.get(key)
    if c is None:
        c = _comms[key] = _Comm(group, device)
    return c


def all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> Work:
    """``all_to_all_single(out, inp, out_splits, in_splits, group, async_op=True)`` along dim 0 (contiguous
    tensors of one dtype), through NCCL's C API. Returns the work handle."""
    lib = _load()
    c = _comm(group, out.device)
    P = c.size
    if len(out_splits) != P or len(in_splits) != P:
        raise ValueError(f"nccl_direct.all_to_all: {P} split sizes per side expected, got {out_splits}, {in_splits}")
    if sum(in_splits) != inp.shape[0] or sum(out_splits) != out.shape[0]:
        raise ValueError(
            f"nccl_direct.all_to_all: split sizes {in_splits} -> {out_splits} do not add up to the tensors' "
            f"rows {inp.shape[0]} -> {out.shape[0]}"
        )
    if not (inp.is_contiguous() and out.is_contiguous()) or inp.dtype != out.dtype or inp.shape[1:] != out.shape[1:]:
        raise ValueError("nccl_direct.all_to_all: contiguous tensors of the same dtype and row shape expected")
    row = math.prod(inp.shape[1:]) * inp.element_size()  # bytes per row (also with zero rows)
    current = torch.cuda.current_stream(out.device)
    c.stream.wait_stream(current)
    s = ctypes.c_void_p(c.stream.cuda_stream)
    src, dst = inp.data_ptr(), out.data_ptr()
    _check(lib.ncclGroupStart(), "ncclGroupStart")
    try:
        so = ro = 0
        for p in range(P):
            if in_splits[p]:
                _check(lib.ncclSend(src + so * row, in_splits[p] * row, _NCCL_UINT8, p, c.comm, s), "ncclSend")
            if out_splits[p]:
                _check(lib.ncclRecv(dst + ro * row, out_splits[p] * row, _NCCL_UINT8, p, c.comm, s), "ncclRecv")
            so, ro = so + in_splits[p], ro + out_splits[p]
    finally:
        _check(lib.ncclGroupEnd(), "ncclGroupEnd")
    done = torch.cuda.Event()
    done.record(c.stream)
    return Work(done, out.device, (out, inp))
