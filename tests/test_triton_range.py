"""The Triton range that pyproject.toml admits is the one CI checks: both extras state the same range, the Makefile's
TRITON_OLDEST (`make test-triton-oldest`) is its lower bound, and the Triton installed here (the one `make test`
runs) lies inside it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _triton_specifier():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    specs = {}
    for name in ("hopper", "test"):
        reqs = [Requirement(r) for r in extras[name]]
        specs[name] = next(r.specifier for r in reqs if r.name == "triton")
    assert specs["hopper"] == specs["test"], specs
    return specs["test"]


def test_triton_range_is_bounded_and_its_lower_bound_is_what_ci_runs():
    spec = _triton_specifier()
    lower = [Version(s.version) for s in spec if s.operator == ">="]
    assert len(lower) == 1 and any(s.operator == "<" for s in spec), f"a range with both ends: {spec}"
    oldest = re.search(r"^TRITON_OLDEST := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert oldest is not None and Version(oldest.group(1)) == lower[0], (oldest and oldest.group(1), spec)


def test_installed_triton_is_in_the_range():
    triton = pytest.importorskip("triton")
    spec = _triton_specifier()
    assert spec.contains(Version(triton.__version__), prereleases=True), f"triton {triton.__version__} not in {spec}"
