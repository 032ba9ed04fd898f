"""Resume after a crash: examples/pretrain_gpt_sonic.py (plugin spec, torch backend, gloo, fp32, fixed seed) under
torchrun trains N iterations uninterrupted; then the same run with ``--save --save-interval K`` is killed with
SIGKILL on every rank between two checkpoints (the trainer's test-only ``--kill-after-iteration``: after that
iteration every rank prints a line, then the ranks SIGKILL each other and torchrun fails); a third launch resumes
with ``--load`` and finishes. The losses after the resume point and the final parameters (checksum over every
rank's bytes) must be bitwise equal to the uninterrupted run's, at EP=1 (one process) and EP=2 (two processes).

The EP=2 checkpoint also resumes at EP=1 on the same two processes (the experts become data parallel): Megatron's
dist_checkpointing reshards the expert weights and Adam states exactly (tests/test_megatron_checkpoint_files.py
checks the weights bitwise), but training at another EP size sums the expert weight gradients in another order
(EP=2: one GEMM over both ranks' tokens; EP=1: a GEMM per rank, then DP's all-reduce), so its parameters differ
from the EP=2 run's in the last bits (about 1e-8 after 4 iterations); its losses and its final parameters and
optimizer states (read from the final torch_dist checkpoints) must agree within 1e-5, far below one Adam step
(lr 3e-3), which a lost or misplaced optimizer state would exceed.

Every launch has a port chosen at runtime, a timeout, and its own process group, killed (and checked empty) after
it. About 70 s on 2 idle CPU cores (90 s under load): torchrun and import start-up dominate (7 launches); the
training is 6 tiny steps."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "examples" / "pretrain_gpt_sonic.py"
STEPS, SAVE_EVERY, KILL_AFTER = 6, 2, 3  # saves after 2, 4, 6; the crash after 3 loses iteration 3
RESUME_AT = KILL_AFTER // SAVE_EVERY * SAVE_EVERY
TIMEOUT_S = 240  # per launch; a healthy one takes 7-15 s on 2 busy cores
TRACKER = "latest_checkpointed_iteration.txt"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
    ),
    pytest.mark.skipif(not hasattr(os, "killpg"), reason="needs POSIX process groups"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_gone(pgid: int, wait_s: float = 15.0) -> bool:
    """Whether no process of group ``pgid`` is left (waiting up to ``wait_s`` for SIGKILLed ones to go)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # a reused id now owned by someone else: not ours
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def _processes_with(env_entry: str, wait_s: float = 15.0) -> list[int]:
    """Pids of live processes whose environment holds ``env_entry`` (Linux /proc; none found elsewhere), waiting up
    to ``wait_s`` for dying ones to go."""
    deadline, needle = time.monotonic() + wait_s, env_entry.encode() + b"\0"
    while True:
        found = []
        for entry in Path("/proc").glob("[0-9]*"):
            with contextlib.suppress(OSError):
                if needle in (entry / "environ").read_bytes() and (entry / "stat").read_text().split()[2] != "Z":
                    found.append(int(entry.name))
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def _torchrun(nproc: int, args: list[str], log: Path) -> tuple[int, str]:
    """One torchrun launch of the trainer in its own session (process group); returns (exit status, output).
    The whole group gets SIGKILL afterwards (on timeout too), and must then be empty."""
    marker = f"{os.getpid()}-{time.monotonic_ns()}"  # every process of this launch inherits it
    env = {
        **os.environ,
        "RESUME_TEST_LAUNCH": marker,
        "CUDA_VISIBLE_DEVICES": "",
        "SONIC_MEGATRON_BACKEND": "torch",
        "OMP_NUM_THREADS": "1",  # the same threads in every launch (torchrun sets 1 only for nproc > 1)
        "PYTHONUNBUFFERED": "1",
    }
    for attempt in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1"]
        cmd += ["--master-addr=127.0.0.1", f"--master-port={_free_port()}", str(TRAINER), *args]
        with open(log, "w") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
            )
            try:
                rc = proc.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        text = log.read_text(errors="replace")
        assert _group_gone(proc.pid), f"processes of the launch are left over: {cmd}"
        # torchrun starts every rank in a session of its own, out of reach of the group kill: their children
        # (the checkpoint writer's multiprocessing manager) must be gone too
        left = _processes_with(f"RESUME_TEST_LAUNCH={marker}")
        assert not left, f"processes of the launch outlived it: pids {left}: {cmd}"
        assert rc is not None, f"timed out after {TIMEOUT_S} s: {cmd}\n{text[-4000:]}"
        if rc != 0 and "address already in use" in text.lower() and attempt == 0:
            continue  # the free port was taken by someone else between choosing and binding it: once more
        return rc, text
    raise AssertionError("unreachable")


def _train(nproc: int, tmp: Path, name: str, *extra: str) -> dict:
    """A launch that must succeed; returns rank 0's --json."""
    out = tmp / f"{name}.json"
    rc, text = _torchrun(
        nproc,
        ["--steps", str(STEPS), "--deterministic", "--param-checksum", "--json", str(out), *extra],
        tmp / f"{name}.log",
    )
    assert rc == 0, f"{name} failed (rc {rc}):\n{text[-4000:]}"
    return json.loads(out.read_text())


def _crash(nproc: int, tmp: Path, ckpt: Path) -> str:
    """The run that saves every SAVE_EVERY iterations and dies by SIGKILL on every rank after KILL_AFTER."""
    args = ["--steps", str(STEPS), "--deterministic", "--save", str(ckpt), "--save-interval", str(SAVE_EVERY)]
    args += ["--load", str(ckpt), "--kill-after-iteration", str(KILL_AFTER)]
    rc, text = _torchrun(nproc, args, tmp / "crash.log")
    assert rc != 0, f"the killed run exited 0:\n{text[-4000:]}"
    for rank in range(nproc):
        assert f"kill-after-iteration {KILL_AFTER}: SIGKILL to rank {rank} " in text, text[-4000:]
    assert f"step {KILL_AFTER + 1:4d}/" not in text, "a rank trained past the kill"
    assert (ckpt / TRACKER).read_text().strip() == str(RESUME_AT)
    assert sorted(p.name for p in ckpt.glob("iter_*")) == [
        f"iter_{i:07d}" for i in range(SAVE_EVERY, KILL_AFTER + 1, SAVE_EVERY)
    ]
    return text


def _runs(tmp: Path, nproc: int, ep: int) -> dict:
    """Uninterrupted, crashed, resumed: the resumed run saves into a second directory so that the crashed run's
    checkpoint (tracker at RESUME_AT) stays for the EP-change test."""
    full = _train(nproc, tmp, "full", "--ep", str(ep))
    ckpt, after = tmp / "ckpt", tmp / "ckpt_resumed"
    _crash(nproc, tmp, ckpt)
    resumed = _train(nproc, tmp, "resumed", "--ep", str(ep), "--load", str(ckpt), "--save", str(after))
    return {"full": full, "resumed": resumed, "ckpt": ckpt, "resumed_ckpt": after}


@pytest.fixture(scope="module")
def ep2_runs(tmp_path_factory):
    return _runs(tmp_path_factory.mktemp("resume_ep2"), nproc=2, ep=2)


def _assert_bitwise_resume(runs: dict, world: int, ep: int) -> None:
    full, resumed = runs["full"], runs["resumed"]
    assert (full["world"], full["ep"]) == (resumed["world"], resumed["ep"]) == (world, ep)
    assert full["start_iteration"] == 0 and resumed["start_iteration"] == RESUME_AT
    assert len(full["losses"]) == STEPS
    assert resumed["losses"] == full["losses"][RESUME_AT:], "losses after the resume differ"
    assert resumed["param_checksum"] == full["param_checksum"], "final parameters differ"


def test_resume_after_sigkill_is_bitwise_ep1(tmp_path):
    """One process, EP=1; the resumed run saves into and loads from the same directory, as a restarted job does."""
    full = _train(1, tmp_path, "full", "--ep", "1")
    ckpt = tmp_path / "ckpt"
    _crash(1, tmp_path, ckpt)
    again = ["--ep", "1", "--load", str(ckpt), "--save", str(ckpt), "--save-interval", str(SAVE_EVERY)]
    resumed = _train(1, tmp_path, "resumed", *again)
    assert (ckpt / TRACKER).read_text().strip() == str(STEPS)
    _assert_bitwise_resume({"full": full, "resumed": resumed}, world=1, ep=1)


def test_resume_after_sigkill_is_bitwise_ep2(ep2_runs):
    _assert_bitwise_resume(ep2_runs, world=2, ep=2)
    log = (ep2_runs["ckpt"].parent / "resumed.log").read_text()
    assert f"resumed from {ep2_runs['ckpt'] / f'iter_{RESUME_AT:07d}'} at iteration {RESUME_AT}" in log


def _final_state(ckpt: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """Every global tensor (model and optimizer) of ckpt's final torch_dist checkpoint, read on one process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = tmp / f"{ckpt.name}.pt"
    dcp_to_torch_save(ckpt / f"iter_{STEPS:07d}", flat)
    state = torch.load(flat, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def test_resume_ep2_checkpoint_at_ep1(ep2_runs, tmp_path):
    """The EP=2 crash's checkpoint resumed by 2 processes at EP=1 (experts data parallel instead of split)."""
    ref = ep2_runs["full"]
    other = _train(
        2, tmp_path, "ep1", "--ep", "1", "--load", str(ep2_runs["ckpt"]), "--save", str(tmp_path / "ckpt_ep1")
    )
    assert (other["world"], other["ep"], other["start_iteration"]) == (2, 1, RESUME_AT)
    want = torch.tensor(ref["losses"][RESUME_AT:], dtype=torch.float64)
    torch.testing.assert_close(torch.tensor(other["losses"], dtype=torch.float64), want, rtol=1e-5, atol=0)
    log = (tmp_path / "ep1.log").read_text()
    assert "(saved at world 2 EP 2)" in log, log[-3000:]
    # Final parameters and Adam states: the EP=2 resumed run's equal the uninterrupted EP=2 run's (checksum).
    a, b = _final_state(ep2_runs["resumed_ckpt"], tmp_path), _final_state(tmp_path / "ckpt_ep1", tmp_path)
    assert a.keys() == b.keys() and any("experts.linear_fc1.weight" in k for k in a)
    assert any(k.startswith("optimizer.state.exp_avg.") for k in a)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
