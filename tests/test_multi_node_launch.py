"""examples/train_multi_node.sh as two torchrun "nodes" on one host: scripts/two_node_check.sh on CPU trains the
same tiny GPT-MoE (plugin spec, torch backend, gloo, EP=2, fixed seed) as 1 node x 2 processes and as 2 nodes x 1
process (--nnodes 2, rendezvous on 127.0.0.1 at a free port) and requires bitwise equal per-step losses and final
parameters."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
    ),
    pytest.mark.skipif(
        shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout"
    ),
]


def _run_check(out: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "DEVICE": "cpu",
        "STEPS": "3",
        "PHASE_TIMEOUT": "150",
        "TWO_NODE_DIR": str(out),
        "PYTHON": sys.executable,
    }
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "two_node_check.sh")],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
        env=env,
    )


def _logs(out: Path) -> str:
    return "".join(
        f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}\n" for f in sorted(out.glob("*.log")) if f.is_file()
    )


def test_two_nodes_equal_one_node(tmp_path):
    out = tmp_path / "two_node"
    proc = _run_check(out)
    if proc.returncode != 0 and "address already in use" in _logs(out).lower():
        proc = _run_check(out)  # a free port taken by someone else between choosing and binding it: once more
    report = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report + _logs(out)
    assert "two-node check: equal" in proc.stdout, report
    one = json.loads((out / "one_node.json").read_text())
    two = json.loads((out / "two_nodes.json").read_text())
    assert one["world"] == two["world"] == 2 and one["ep"] == two["ep"] == 2
    assert len(one["losses"]) == 3 and one["losses"] == two["losses"]
    assert one["param_checksum"] == two["param_checksum"]
    assert all(node in proc.stdout for node in ("1 node x 2", "2 nodes x 1"))
