"""``bench breakdown`` without a GPU: the rotating order of the rows in a round, the paired ratios over
rounds, and the argument parsing (the timing itself needs CUDA)."""

from __future__ import annotations

import argparse

import pytest

from sonic_megatron.bench import breakdown


def test_every_row_leads_in_turn():
    names = ["kernels", "plugin", "grouped"]
    orders = [breakdown.rotated(names, r) for r in range(4)]
    assert orders[0] == names and orders[1] == ["plugin", "grouped", "kernels"]
    assert orders[3] == orders[0] and all(sorted(o) == sorted(names) for o in orders)
    assert [o[0] for o in orders[:3]] == names


def test_paired_ratio_is_the_median_of_same_round_ratios():
    # A slow drift of the device clock moves both rows; the per-round ratio stays 0.5.
    ms = {"plugin": [1.0, 2.0, 4.0, 8.0, 3.0], "grouped": [2.0, 4.0, 8.0, 16.0, 6.0]}
    assert breakdown.paired_ratio(ms, "plugin", "grouped") == 0.5
    assert breakdown.paired_ratio(ms, "grouped", "plugin") == 2.0
    # One disturbed round moves the paired ratio less than the ratio of the medians (4 / 6 here).
    ms["plugin"][4] = 6.0
    assert breakdown.paired_ratio(ms, "plugin", "grouped") == 0.5
    assert breakdown.paired_ratio(ms, "plugin", "kernels") is None


def test_arguments():
    parser = argparse.ArgumentParser()
    breakdown.add_arguments(parser)
    args = parser.parse_args(["--config", "sparse", "--config", "8,16,32,4,2", "--rows", "plugin,grouped"])
    assert args.config == [breakdown.CONFIGS["sparse"], (8, 16, 32, 4, 2)] and args.rows == ["plugin", "grouped"]
    for bad in (["--rows", "plugin,fast"], ["--rows", "rounding"], ["--config", "huge"], ["--routing", "skewed"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_rows_leave_no_gradients_behind():
    import torch

    layer = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    calls = []

    def step():
        assert layer.weight.grad is None and x.grad is None  # every call starts from fresh gradients
        layer(x).sum().backward()
        calls.append(layer.weight.grad.clone())

    row = breakdown.without_grads(step, layer, x)
    row()
    row()
    assert len(calls) == 2 and torch.equal(calls[0], calls[1])
    assert layer.weight.grad is None and layer.bias.grad is None and x.grad is None
