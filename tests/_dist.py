"""Multi-process helpers for CPU tests: run a function on P gloo ranks and collect what each returns.

    results = run_distributed(fn, world_size, *args)   # fn(rank, world_size, *args) -> picklable
raises AssertionError with every failing rank's traceback, and fails (instead of hanging CI) when the
ranks do not finish within ``timeout`` seconds. ``fn`` must be importable (module level).
"""

from __future__ import annotations

import datetime
import io
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def poison_uninitialized_memory() -> None:
    """Deterministic algorithms on, so that torch.empty* fills new memory with NaN (ints with their max): an
    all-to-all or kernel that leaves rows unwritten fails the comparison. Set through the flag that
    ``torch.use_deterministic_algorithms`` sets for eager ops, without its import of Inductor's config, which loads
    the whole compiler stack: seconds of every spawned rank's start-up, for workers that compile nothing."""
    torch._C._set_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True


def part(fn, *args):
    """(True, ``fn(*args)``) or (False, its traceback): one of several parts that a worker runs in one set of
    processes (each rank's start-up costs more than most parts), so that a failing part fails only its tests."""
    try:
        return True, fn(*args)
    except Exception:
        return False, traceback.format_exc()


def part_results(results: list, *keys) -> list:
    """Each rank's result of the ``part`` at ``results[rank][keys[0]][keys[1]]...``, or an AssertionError with the
    tracebacks of the ranks where it failed."""
    got = []
    for res in results:
        for k in keys:
            res = res[k]
        got.append(res)
    failed = [f"rank {rank}:\n{res}" for rank, (ok, res) in enumerate(got) if not ok]
    assert not failed, "\n".join(failed)
    return [res for _, res in got]


_RUNS: dict = {}


def run_distributed_once(fn, world_size: int, *args, timeout: float = 300.0) -> list:
    """``run_distributed`` once per (fn, world_size, args) in a test session, for the tests that share one run:
    later calls get the same results, or the same failure without starting the ranks again (a hang costs its
    timeout once, not once per test)."""
    key = (fn, world_size, args)
    if key not in _RUNS:
        try:
            _RUNS[key] = (True, run_distributed(fn, world_size, *args, timeout=timeout))
        except AssertionError as exc:
            _RUNS[key] = (False, str(exc))
    ok, value = _RUNS[key]
    assert ok, value
    return value


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, threads):
    try:
        torch.set_num_threads(threads)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            # a collective waits this long for the other ranks: room for ranks that start apart on a loaded machine
            timeout=datetime.timedelta(seconds=180),
        )
        try:
            # Results travel as bytes: a tensor put on a torch queue would live in shared memory owned by
            # this process, which exits right after.
            buf = io.BytesIO()
            torch.save(fn(rank, world_size, *args), buf)
            queue.put((rank, True, buf.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, False, traceback.format_exc()))


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0, threads: int = 1) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; return the results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    env_before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, threads), daemon=True)
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
    finally:
        if env_before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_before
    results: dict[int, tuple[bool, object]] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(results) < world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                break
            try:
                rank, ok, payload = queue.get(timeout=min(left, 5.0))
            except Exception:  # queue.Empty: check whether a rank died without reporting
                if any(p.exitcode not in (None, 0) for p in procs if p.exitcode is not None) and not any(
                    p.is_alive() for p in procs
                ):
                    break
                continue
            results[rank] = (ok, payload)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    missing = [r for r in range(world_size) if r not in results]
    failures = [f"rank {r}:\n{payload}" for r, (ok, payload) in sorted(results.items()) if not ok]
    if missing:
        failures.append(f"ranks {missing} did not report within {timeout:.0f} s (hang or crash)")
    if failures:
        raise AssertionError("\n".join(failures))
    return [torch.load(io.BytesIO(results[r][1]), weights_only=False) for r in range(world_size)]
