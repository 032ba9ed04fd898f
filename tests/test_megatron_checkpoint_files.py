"""Real checkpoint directories: ``dist_checkpointing.save`` / ``load`` (torch_dist format, files on disk) along
stock MoELayer (SequentialMLP) EP=2 -> Sonic EP=1 -> Sonic EP=2 -> stock EP=2 on two gloo ranks, and with expert
tensor parallelism (TP = ETP = 2, EP 1) stock ETP 2 -> Sonic ETP 2 -> Sonic ETP 1 (EP 1, EP 2) -> Sonic ETP 2 ->
stock ETP 2. The chain
(``megatron_ckpt_chain``) is also the GPU pass's ``ckpt`` step (scripts/gpu_megatron.py, EP 4 -> 2 -> 1 -> 4 on 4
GPUs), so this also checks the GPU step's logic. After every load the expert and router weights must equal the
original global weights bitwise, and the last hop's output on a fixed input must equal hop 0's.

The save used to hang on this CPU setup: megatron-core's writer process calls psutil (not one of its
dependencies) outside its try block, dies without reporting, and the saving rank waits forever;
``megatron_compat.allow_checkpoint_save_without_psutil`` removes that call when psutil is missing."""

from __future__ import annotations

import json
import os

import pytest
from megatron_ckpt_chain import CKPT_CHAIN_2, CKPT_CHAIN_ETP_2, ckpt_worker

CHAINS = {"ep": CKPT_CHAIN_2, "etp": CKPT_CHAIN_ETP_2}


def _worker(rank, world, out):
    for name, chain in CHAINS.items():  # one process group for both chains (Megatron imports are slow)
        summary = ckpt_worker(rank, world, os.path.join(out, name), chain)
        with open(os.path.join(out, name, f"rank{rank}.json"), "w") as f:
            json.dump(summary, f)


@pytest.fixture(scope="module")
def chain_dirs(tmp_path_factory):
    from sonic_megatron.testing import spawn

    out = tmp_path_factory.mktemp("ckpt_files")
    spawn(_worker, 2, str(out), timeout=300)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, layouts",
    [
        ("ep", [("stock", 2, 1), ("sonic", 1, 1), ("sonic", 2, 1), ("stock", 2, 1)]),
        ("etp", [("stock", 1, 2), ("sonic", 1, 2), ("sonic", 1, 1), ("sonic", 2, 1), ("sonic", 1, 2), ("stock", 1, 2)]),
    ],
)
def test_checkpoint_files_round_trip_across_implementations_and_parallel_sizes(chain_dirs, name, layouts):
    tmp_path = chain_dirs / name
    summaries = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for h0, h1 in zip(summaries[0]["hops"], summaries[1]["hops"], strict=True):  # all-reduced: the same on all ranks
        assert {k: v for k, v in h0.items() if k != "seconds"} == {k: v for k, v in h1.items() if k != "seconds"}
    hops = summaries[0]["hops"]
    assert [(h["layer"], h["ep"], h["etp"]) for h in hops] == layouts
    for h in hops:
        where = f"hop {h['hop']} ({h['layer']} EP={h['ep']} ETP={h['etp']})"
        assert h["fc1_max_abs_diff"] == 0 and h["fc2_max_abs_diff"] == 0, f"{where}: expert weights differ"
        assert h["router_max_abs_diff"] == 0, f"{where}: router weight differs"
        assert {".metadata", "metadata.json"} <= set(h["files"]), f"{where}: not a torch_dist directory: {h['files']}"
        assert any(f.endswith(".distcp") for f in h["files"]), h["files"]
        assert h["pass"], h
    assert hops[-1]["output_max_abs_diff"] == 0, "stock layer output changed after the round trip"
    assert hops[0]["output_max_abs"] > 0, "the output must not be all zeros"
    assert summaries[0]["pass"]
    assert os.path.isfile(tmp_path / "ckpt_summary.json")
