"""``bench experts --against``: sonic-moe measured in another environment, compared per config (CPU only)."""

import json

import pytest

from sonic_megatron.bench.experts import compare_against, load_against


def _row(config, provider, ms):
    return {"config": config, "provider": provider, "fwdbwd_ms": ms}


def test_ratio_and_bmm_anchor():
    ours = [_row("a", "ours", 2.0), _row("a", "bmm", 1.0), _row("a", "grouped_mm", 8.0)]
    other = [_row("a", "sonic", 2.2), _row("a", "sonic", 2.6), _row("a", "bmm", 1.2), _row("b", "sonic", 9.0)]
    compare_against(ours, other)
    assert ours[0]["vs_sonic"] == pytest.approx(2.4 / 2.0)
    assert ours[0]["sonic_runs"] == 2
    # the other process ran 1.2x slower on the same bmm: that part of its time is the clock's, not sonic-moe's
    assert ours[0]["vs_sonic_anchored"] == pytest.approx((2.4 / 1.2) / (2.0 / 1.0))
    assert ours[2]["vs_sonic"] == pytest.approx(2.4 / 8.0)
    assert "vs_sonic" not in ours[1]  # the anchor itself


def test_own_sonic_row_and_missing_config_left_alone():
    own = [_row("a", "ours", 2.0), _row("a", "sonic", 2.1)]
    compare_against(own, [_row("a", "sonic", 5.0)])
    assert "vs_sonic" not in own[0]
    other_config = [_row("c", "ours", 2.0)]
    compare_against(other_config, [_row("a", "sonic", 5.0)])
    assert "vs_sonic" not in other_config[0]
    no_anchor = [_row("a", "ours", 2.0)]
    compare_against(no_anchor, [_row("a", "sonic", 3.0), {"config": "a", "provider": "sonic", "error": "x"}])
    assert no_anchor[0]["vs_sonic"] == pytest.approx(1.5) and "vs_sonic_anchored" not in no_anchor[0]


def test_load_against_names_the_argument(tmp_path):
    good = tmp_path / "sonic.json"
    good.write_text(json.dumps({"benchmark": "experts", "rows": [_row("a", "sonic", 1.0)]}))
    assert load_against([str(good)]) == [_row("a", "sonic", 1.0)]
    other = tmp_path / "e2e.json"
    other.write_text(json.dumps({"benchmark": "e2e", "rows": []}))
    with pytest.raises(SystemExit, match="--against .*e2e.json"):
        load_against([str(other)])
    with pytest.raises(SystemExit, match="--against .*missing.json"):
        load_against([str(tmp_path / "missing.json")])
    assert load_against(None) == []
