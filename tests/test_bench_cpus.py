"""``--bind-cores``: each local rank gets whole physical cores (hyper-thread siblings together), disjoint."""

from __future__ import annotations

import os

from sonic_megatron.bench.cpus import bind_local_rank, physical_cores, share


def test_ranks_get_disjoint_whole_cores():
    cores = physical_cores(list(range(8)), lambda c: c % 4)  # siblings c and c + 4
    assert cores == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert share(cores, 0, 2) == [0, 1, 4, 5]
    assert share(cores, 1, 2) == [2, 3, 6, 7]
    assert share(cores, 3, 4) == [3, 7]


def test_fewer_cores_than_ranks_binds_nothing():
    cores = physical_cores([0, 1], lambda c: c)
    assert share(cores, 2, 4) == [0, 1]


def test_bind_local_rank_pins_this_process(monkeypatch):
    before = os.sched_getaffinity(0)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    try:
        assert set(bind_local_rank()) == before  # one rank: all of its cpus
        assert os.sched_getaffinity(0) == before
    finally:
        os.sched_setaffinity(0, before)
