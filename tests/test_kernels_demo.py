"""examples/experts_demo.py runs and reports sane numbers (small sizes, so it stays fast)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[1] / "examples" / "experts_demo.py"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_experts_demo_runs(capsys, dtype):
    spec = importlib.util.spec_from_file_location("experts_demo", DEMO)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    args = ["--tokens", "48", "--hidden", "32", "--ffn", "12", "--experts", "8", "--topk", "2", "--iters", "1"]
    assert demo.main(args + ["--dtype", dtype]) == 0
    out = capsys.readouterr().out
    errors = dict(re.findall(r"^\s+(out|dx|dscores|dw1|dw2)\s+(\S+)", out, flags=re.M))
    assert set(errors) == {"out", "dx", "dscores", "dw1", "dw2"}, out
    limit = 1e-5 if dtype == "fp32" else 3e-2
    assert all(float(v) < limit for v in errors.values()), out
    sonic, formula, naive = map(
        float, re.search(r"sonic ([\d.]+) MiB .*formula ([\d.]+) MiB\), naive ([\d.]+)", out).groups()
    )
    assert sonic == formula and naive > 2 * sonic, out
