"""Helpers shared by the benchmarks: a fixed-width table and a JSON record with the environment."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from collections.abc import Sequence

import torch


def environment() -> dict:
    env = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "host": platform.node(),
        "command": " ".join(sys.argv),
        # the plugin's options set from the environment (SonicConfig overrides, kernel tuning) in this process and
        # in every child it launches
        "sonic_megatron_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SONIC_MEGATRON_")},
    }
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["device_count"] = torch.cuda.device_count()
    else:
        env["device"] = "cpu"
    return env


def print_table(rows: Sequence[dict], columns: Sequence[str]) -> None:
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"environment": environment(), **payload}, f, indent=2)
        print(f"wrote {path}")
