"""Thin wrappers over torch.distributed for one EP group (gloo on CPUs, NCCL on GPUs).

``group=None`` (or a group of size 1) means a single process: nothing is communicated and an all-to-all
returns its input. Every all-to-all can run asynchronously (``async_op=True``): on NCCL the collective runs
on the process group's internal stream, ordered after the work already queued on the current stream, and
``Work.wait()`` makes the current stream wait for it (ProcessGroupNCCL keeps the buffers alive until then),
so overlap needs no hand-made streams or events and stays race-free when repeated. On gloo the collective
runs on gloo's worker thread while the caller computes.

``CommThread`` (``comm_thread_for(group)``) optionally moves the host work of issuing the collectives off the calling
thread; every function here takes it as ``thread`` (``None``: issue directly).
"""

from __future__ import annotations

import collections
import sys
import threading

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


class _Queued:
    """A collective queued on a ``CommThread``: ``result()`` returns what the issuing call returned (a Work for
    async collectives) once it has been issued -- by the thread, or by the caller itself when the thread has
    not got to it yet (``CommThread.issue_through``); ``wait()`` then waits for the collective as
    ``Work.wait()`` does (on NCCL: the caller's current stream waits for it)."""

    __slots__ = ("_owner", "_fn", "_ready", "done", "_value", "_error")

    def __init__(self, owner: CommThread, fn, ready) -> None:
        self._owner, self._fn, self._ready = owner, fn, ready
        self.done = False
        self._value = self._error = None

    def result(self):
        if not self.done:
            self._owner.issue_through(self)
        if self._error is not None:
            raise self._error
        return self._value

    def wait(self) -> None:
        works = self.result()
        for w in works if isinstance(works, list) else [works]:
            if w is not None:
                w.wait()


class CommThread:
    """Issues one process group's collectives from a background thread, in the order they are submitted.

    Why: on GPUs, launching one NCCL all-to-all costs the host 0.13-0.20 ms inside the layer (ProcessGroupNCCL
    and NCCL's group launch; docs/PERF.md section 2), five per training step of a micro-batch. Where the host
    is the bottleneck that time is exposed even when the all-to-all itself hides behind kernels. Here the
    calling thread only records a CUDA event on its current stream (the point after which the collective
    may start) and queues the call; the thread makes its own stream wait for that event and issues the
    collective with that stream current, so NCCL orders it after exactly the work queued before ``submit``,
    not after the kernels the caller launches meanwhile. c10d releases the GIL for most of a launch, so both
    threads make progress. Results are bitwise those of issuing directly (same collectives, same order).

    When the caller needs a result the thread has not issued yet (it waits right after submitting, e.g. a
    synchronous all-gather), it issues the queued calls up to that one itself instead of waking the thread
    and sleeping until it is done: the worst case costs what issuing directly costs. A lock held while
    issuing keeps the FIFO order whichever thread issues.

    The thread needs the GIL for the Python part of each launch; CPython lets a thread that waits for the
    GIL wait up to its switch interval (5 ms by default) while another thread runs Python, so the first
    ``CommThread`` lowers the process's interval to ``SWITCH_INTERVAL_S`` (``sys.setswitchinterval``; it
    never raises it).

    One thread per group (``comm_thread_for``): NCCL and gloo need every rank to issue a group's collectives in
    the same order, which one FIFO keeps; every collective of this package on the group goes through it
    (plan, rounding, exchanges, error reports), and issuing directly first drains it (``drain``)."""

    SWITCH_INTERVAL_S = 20e-6
    ISSUE_FROM_CALLER = True

    def __init__(self, group) -> None:
        self.group = group
        self._items: collections.deque[_Queued] = collections.deque()
        self._wake = threading.Condition(threading.Lock())  # guards _items; the thread sleeps on it
        self._issuing = threading.Lock()  # held while a call is issued: one issuer at a time, in FIFO order
        self._cuda = dist.get_backend(group) == "nccl"
        self._device = torch.cuda.current_device() if self._cuda else None
        self._stream = torch.cuda.Stream(self._device) if self._cuda else None
        self._last: _Queued | None = None
        if sys.getswitchinterval() > self.SWITCH_INTERVAL_S:
            sys.setswitchinterval(self.SWITCH_INTERVAL_S)
        self._thread = threading.Thread(target=self._run, name="sonic-ep-comm", daemon=True)
        self._thread.start()

    def submit(self, fn) -> _Queued:
        """Queue ``fn()`` (a call that issues collectives of this group); returns its ``_Queued``."""
        ready = None
        if self._cuda:
            ready = torch.cuda.Event()
            ready.record()  # on the caller's current stream: the collective's inputs are queued before here
        item = _Queued(self, fn, ready)
        with self._wake:
            self._items.append(item)
            self._wake.notify()
        self._last = item
        return item

    def issue_through(self, target: _Queued) -> None:
        """Issue the queued calls up to ``target`` from the calling thread (those the thread has not taken);
        with ``ISSUE_FROM_CALLER`` off, sleep until the thread has issued ``target`` instead."""
        if not self.ISSUE_FROM_CALLER:
            with self._wake:
                while not target.done:
                    self._wake.wait()
            return
        with self._issuing:
            while not target.done:  # not done while we hold the lock: still queued, behind the older ones
                with self._wake:
                    item = self._items.popleft()
                self._issue(item)

    def drain(self) -> None:
        """Return once every submitted call has been issued (not completed)."""
        last, self._last = self._last, None
        if last is not None and not last.done:
            self.issue_through(last)

    def _issue(self, item: _Queued) -> None:
        """Issue one call (holding ``_issuing``), on the thread's stream after the submitter's event."""
        try:
            if item._ready is None:
                item._value = item._fn()
            else:
                with torch.cuda.stream(self._stream):
                    self._stream.wait_event(item._ready)
                    item._value = item._fn()
        except BaseException as exc:  # re-raised in the caller by result() / wait()
            item._error = exc
        item._fn = item._ready = None
        with self._wake:
            item.done = True
            self._wake.notify_all()  # a caller sleeping in issue_through (ISSUE_FROM_CALLER off)

    def _run(self) -> None:
        if self._cuda:
            torch.cuda.set_device(self._device)
        while True:
            with self._wake:
                while not self._items:
                    self._wake.wait()
            with self._issuing:
                with self._wake:
                    item = self._items.popleft() if self._items else None  # the caller may have taken it
                if item is not None:
                    self._issue(item)


_THREADS: dict[int, CommThread] = {}  # id(group) -> its CommThread (the group stays referenced by it)


def comm_thread_for(group) -> CommThread | None:
    """The group's ``CommThread``, started on first use (None for a single process: nothing to issue)."""
    if group_size(group) == 1:
        return None
    key = id(group)
    if key not in _THREADS:
        _THREADS[key] = CommThread(group)
    return _THREADS[key]


def _issue(fn, group, thread: CommThread | None):
    """Issue ``fn()`` through ``thread``, or directly after draining the group's thread if it has one."""
    if thread is not None:
        return thread.submit(fn)
    other = _THREADS.get(id(group))
    if other is not None:
        other.drain()
    return fn()


class Pending:
    """A list of in-flight collectives; ``wait()`` waits for all of them (in launch order).
    ``eager=True`` waits for each one as soon as it is added (no overlap; for measuring what overlap hides)."""

    def __init__(self, eager: bool = False) -> None:
        self._works: list = []
        self._eager = eager

    def add(self, work) -> None:
        if work is not None:
            if self._eager:
                work.wait()
            else:
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
    thread: CommThread | None = None,
):
    """All-to-all along dim 0 with uneven splits into the preallocated ``out``. Returns the work handle when
    ``async_op`` (None when nothing was communicated; a ``_Queued`` through ``thread``, whose ``wait()`` waits
    for it). Single process: copies ``inp`` into ``out``."""
    if group_size(group) == 1:
        out.copy_(inp)
        return None
    if thread is None:
        return _issue(
            lambda: dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=async_op),
            group,
            None,
        )
    queued = thread.submit(lambda: dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=True))
    if not async_op:
        queued.wait()
        return None
    return queued


def send_recv(inp: torch.Tensor, to: int, out: torch.Tensor, frm: int, group, thread: CommThread | None = None) -> list:
    """Send ``inp`` to group rank ``to`` and receive ``out`` from group rank ``frm`` as one async batch
    (``batch_isend_irecv``: one NCCL group, only the two peers synchronise); returns the work handles.
    Every rank of the group must call it at the same point (the by-source ring does). Empty tensors are
    exchanged too, so that sends and receives always pair up."""
    inp = inp.contiguous()

    def issue():
        ops = [
            dist.P2POp(dist.isend, inp, dist.get_global_rank(group, to), group),
            dist.P2POp(dist.irecv, out, dist.get_global_rank(group, frm), group),
        ]
        return dist.batch_isend_irecv(ops)

    works = _issue(issue, group, thread)
    return [works] if thread is not None else works


# torch >= 2.13 renames all_gather_into_tensor (and warns); the GPU image's torch 2.11 has only the old name.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather(t: torch.Tensor, group, thread: CommThread | None = None) -> torch.Tensor:
    """[P, *t.shape]: every rank's ``t`` (same shape on every rank by construction); the caller's current
    stream is ordered after it (as after a synchronous collective)."""
    P = group_size(group)
    if P == 1:
        return t.unsqueeze(0)
    out = t.new_empty(P * t.numel())
    flat = t.contiguous().reshape(-1)
    if thread is None:
        _issue(lambda: _all_gather_flat(out, flat, group=group), group, None)
    else:
        thread.submit(lambda: _all_gather_flat(out, flat, group=group, async_op=True)).wait()
    return out.view(P, *t.shape)


def all_gather_strings(msg: str, group, thread: CommThread | None = None) -> list[str]:
    """Every rank's message (only on the error path: pickles through ``all_gather_object``)."""
    if group_size(group) == 1:
        return [msg]
    out: list = [None] * group_size(group)
    if thread is None:
        _issue(lambda: dist.all_gather_object(out, msg, group=group), group, None)
    else:  # all_gather_object is synchronous on the thread (its own host copies); only its issue is waited for
        thread.submit(lambda: dist.all_gather_object(out, msg, group=group)).result()
    return out
