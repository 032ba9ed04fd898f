"""The README's main job: examples/demo.py trains a tiny GPT-MoE with the plugin spec on CPU (gloo, EP=2,
torch backend) and its loss falls."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_trains(tmp_path):
    out = tmp_path / "demo.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--steps", "10", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tokens/s/rank" in proc.stdout and "peak memory" in proc.stdout
    res = json.loads(out.read_text())
    assert res["ep"] == 2 and res["args"]["spec"] == "sonic"
    losses = res["losses"]
    assert len(losses) == 10 and all(l == l for l in losses)  # noqa: E741 - finite check (no NaN)
    assert losses[-1] < losses[0] - 0.3, losses
    assert res["tokens_per_s_per_rank"] > 0 and res["peak_memory_mib"] > 0
