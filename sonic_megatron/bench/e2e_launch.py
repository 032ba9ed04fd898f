"""Running one ``pretrain_gpt.py`` under ``torchrun`` for ``bench e2e``: the command and its shell line, the run
with its output logged and a timeout that stops the whole process group, the progress lines printed as the log
comes, and the excerpt of a failed run's log."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

from .e2e_log import (
    LOSS_KEY,
    MS_KEY,
    TFLOPS_KEY,
    VALID_LOSS_KEY,
    failure_excerpt,
    parse_iteration,
    parse_validation,
)

LOG_TAIL_LINES = 20


def torchrun_command(pretrain_gpt: str, nproc: int, flags: list[str], python: str = sys.executable) -> list[str]:
    # --standalone: a fresh rendezvous on a free local port per run, so that back-to-back runs never collide.
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), pretrain_gpt, *flags]


def shell_line(cmd: list[str], env: dict[str, str], base: dict[str, str] | None = None) -> str:
    """The command as one shell line, prefixed by the variables it sets beyond ``base`` (default: ours)."""
    base = os.environ if base is None else base
    assignments = [f"{k}={shlex.quote(v)}" for k, v in env.items() if base.get(k) != v]
    return " ".join([*assignments, shlex.join(cmd)])


def run_logged(
    cmd: list[str], env: dict[str, str], log_path: str, timeout: float, on_line: Callable[[str], None]
) -> tuple[int | None, bool]:
    """Run ``cmd`` in its own process group, its output (stdout + stderr) to ``log_path`` and, line by line,
    to ``on_line``; after ``timeout`` seconds the group gets SIGTERM, then SIGKILL. Returns (exit code,
    timed out)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )

        def pump():
            for line in proc.stdout:
                log.write(line)
                on_line(line)
            log.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            stop_group(proc)
        reader.join(timeout=30)
    return proc.returncode, timed_out


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the run's process group (torchrun passes it to its workers), SIGKILL after 20 s."""
    for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def progress_printer(name: str, iters: int) -> Callable[[str], None]:
    """Prints iteration 1, every 10th and the last one of a run, and its validation loss, as they come."""

    def on_line(line: str) -> None:
        val = parse_validation(line)
        if val is not None and VALID_LOSS_KEY in val:
            print(
                f"  [{name}] validation loss after iteration {val['iteration']}: {val[VALID_LOSS_KEY]:.4f}", flush=True
            )
            return
        it = parse_iteration(line)
        if it is None or not (it["iteration"] in (1, iters) or it["iteration"] % 10 == 0):
            return
        parts = [f"  [{name}] iteration {it['iteration']}/{it['train_iters']}"]
        if MS_KEY in it:
            parts.append(f"{it[MS_KEY]:.1f} ms")
        if TFLOPS_KEY in it:
            parts.append(f"{it[TFLOPS_KEY]:.1f} TFLOP/s/GPU")
        if LOSS_KEY in it:
            parts.append(f"lm loss {it[LOSS_KEY]:.4f}")
        print(", ".join(parts), flush=True)

    return on_line


def log_excerpt(log_path: str, tail: int = LOG_TAIL_LINES) -> list[str]:
    """The first error and the last ``tail`` lines of a run's log."""
    with open(log_path, errors="replace") as f:
        return failure_excerpt([line.rstrip("\n") for line in f], tail=tail)
