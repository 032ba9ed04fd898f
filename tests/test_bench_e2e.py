"""``bench e2e`` without GPUs: Megatron's log lines parsed (format of core_r0.19.0 training.py), the
pretrain_gpt.py command per provider and config, argument errors, a provider that fails while the others still
run (a fake pretrain_gpt.py under torchrun), the Megatron-LM file copy; and the grouped-GEMM baseline experts
against Megatron's SequentialMLP with the same weights (outputs and gradients), its spec swap and its init."""

from __future__ import annotations

import argparse
import gzip
import inspect
import json
import os
import shlex
import statistics
import subprocess
import sys
import textwrap

import pytest
import torch

from sonic_megatron import cli
from sonic_megatron.bench import e2e, e2e_compare, e2e_launch, megatron_lm
from sonic_megatron.bench.e2e_log import (
    failure_excerpt,
    parse_iteration,
    parse_log,
    parse_memory,
    parse_validation,
    summarize,
)


def _iteration_line(it: int, total: int, ms: float, tflops: float, loss: float, global_batch: int = 16) -> str:
    """An iteration line as megatron/training/training.py (core_r0.19.0) training_log writes it."""
    s = " [2026-11-25 10:00:00.123456]"
    s += f" iteration {it:8d}/{total:8d} |"
    s += f" consumed samples: {global_batch * it:12d} |"
    s += f" elapsed time per iteration (ms): {ms:.1f} |"
    s += f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"
    s += f" learning rate: {3e-4:.6E} |"
    s += f" global batch size: {global_batch:5d} |"
    s += " {}: {:.6E} |".format("lm loss", loss)
    s += " {}: {:.6E} |".format("load_balancing_loss", 1.01)
    s += f" loss scale: {1.0:.1f} |"
    s += f" grad norm: {3.217:.3f} |"
    s += f" number of skipped iterations: {0:3d} |"
    s += f" number of nan iterations: {0:3d} |"
    return s


def _memory_line(after: int, max_allocated: float) -> str:
    """report_memory (megatron/training/utils/common_utils.py) as rank 0 prints it."""
    string = f"(after {after} iterations)" + " memory (MB)"
    string += f" | allocated: {1234.5:.2f}"
    string += f" | max allocated: {max_allocated:.2f}"
    string += f" | reserved: {4096.0:.2f}"
    string += f" | max reserved: {8192.0:.2f}"
    return f"[Rank {0}] {string}"


def _validation_line(it: int, loss: float) -> str:
    """evaluate_and_print_results (megatron/training/training.py, core_r0.19.0) after training."""
    string = f" validation loss at iteration {it} on validation set | "
    string += "{} value: {:.6E} | ".format("lm loss", loss)
    string += "{} PPL: {:.6E} | ".format("lm loss", 2.718281828**loss)
    return string


def test_parse_megatron_lines():
    it = parse_iteration(_iteration_line(7, 30, 812.4, 201.3, 10.3456))
    assert it["iteration"] == 7 and it["train_iters"] == 30
    assert it["elapsed time per iteration (ms)"] == 812.4
    assert it["throughput per GPU (TFLOP/s/GPU)"] == 201.3
    assert it["lm loss"] == pytest.approx(10.3456)
    assert it["grad norm"] == pytest.approx(3.217) and it["global batch size"] == 16
    mem = parse_memory(_memory_line(2, 30123.45))
    assert mem == {
        "rank": 0,
        "after_iterations": 2,
        "allocated": 1234.5,
        "max allocated": 30123.45,
        "reserved": 4096.0,
        "max reserved": 8192.0,
    }
    assert parse_iteration("number of skipped iterations:   0 |") is None
    assert parse_memory(_iteration_line(1, 2, 1.0, 1.0, 1.0)) is None
    val = parse_validation(_validation_line(200, 1.6509))
    assert val["iteration"] == 200 and val["lm loss value"] == pytest.approx(1.6509)
    assert parse_validation(_iteration_line(1, 2, 1.0, 1.0, 1.0)) is None
    lines = [_iteration_line(1, 1, 5.0, 1.0, 2.5), _validation_line(1, 2.25)]
    assert summarize(parse_log(lines), warmup=0, tokens_per_iteration=1, num_gpus=1)["eval_loss"] == 2.25
    assert summarize(parse_log(lines[:1]), warmup=0, tokens_per_iteration=1, num_gpus=1)["eval_loss"] is None


def test_failure_excerpt_shows_the_first_traceback():
    worker = [
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "pretrain_gpt.py", line 9, in <module>',
        "[rank0]:     build()",
        "[rank0]: ValueError: GroupedMMExperts does not support add_bias_linear=True",
    ]
    torchrun = [f"torchrun report line {i}" for i in range(30)]
    lines = ["> building GPT model ..."] * 50 + worker + ["[rank1]: more of the same"] * 10 + torchrun
    excerpt = failure_excerpt(lines, tail=5)
    assert excerpt == worker + ["..."] + torchrun[-5:]
    assert failure_excerpt(torchrun, tail=5) == torchrun[-5:], "no traceback: the last lines"


def test_summary_statistics():
    ms = [5000.0, 900.0, 880.0, 820.0, 800.0, 840.0, 810.0]
    lines = ["WARNING: some warning", _memory_line(1, 100.0)]
    lines += [_iteration_line(i + 1, len(ms), m, 100.0 + i, 10.0 - i) for i, m in enumerate(ms)]
    lines.insert(4, _memory_line(2, 300.0))
    lines.append(_memory_line(7, 250.0))
    lines.insert(1, "sonic_megatron.baseline: routed experts GroupedMMExperts")
    s = summarize(parse_log(lines), warmup=2, tokens_per_iteration=16 * 2048, num_gpus=2)
    timed = sorted(ms[2:])
    assert s["iterations_logged"] == 7 and s["iterations_timed"] == 5
    assert s["ms_per_iter_median"] == timed[2] and s["ms_per_iter_min"] == 800.0 and s["ms_per_iter_max"] == 880.0
    assert s["tokens_per_s_per_gpu"] == pytest.approx(16 * 2048 / (timed[2] / 1e3) / 2)
    assert s["tflops_per_gpu"] == 104.0
    assert s["peak_allocated_mib"] == 300.0 and s["peak_reserved_mib"] == 8192.0
    assert s["losses"] == [10.0 - i for i in range(7)] and s["final_loss"] == 4.0
    assert s["final_loss_mean10"] == pytest.approx(7.0)  # fewer than 10 logged: the mean of all
    assert s["baseline_experts"] == "GroupedMMExperts"
    empty = summarize(parse_log(["Traceback (most recent call last):"]), warmup=2, tokens_per_iteration=1, num_gpus=1)
    assert empty["ms_per_iter_median"] is None and empty["tokens_per_s_per_gpu"] is None and empty["losses"] == []


def _args(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    e2e.add_arguments(parser)
    argv = []
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        argv += [flag] if v is True else [flag, str(v)]
    return parser.parse_args(argv)


def _flag(cmd: list[str], name: str, n: int = 1):
    i = cmd.index(name)
    return cmd[i + 1] if n == 1 else cmd[i + 1 : i + 1 + n]


def test_flags_per_config_and_provider():
    for config, experts, ffn in (("qwen3", "128", "768"), ("sparse", "256", "512")):
        flags = e2e.pretrain_flags(e2e.CONFIGS[config], iters=30, ep=2, seed=7)
        expect = {
            "--num-layers": "4",
            "--hidden-size": "2048",
            "--num-attention-heads": "16",
            "--seq-length": "2048",
            "--micro-batch-size": "4",
            "--global-batch-size": "16",
            "--num-experts": experts,
            "--moe-router-topk": "8",
            "--moe-ffn-hidden-size": ffn,
            "--expert-model-parallel-size": "2",
            "--train-iters": "30",
            "--seed": "7",
            "--moe-token-dispatcher-type": "alltoall",
            "--moe-router-load-balancing-type": "aux_loss",
            "--moe-router-dtype": "fp32",
            "--transformer-impl": "local",
            "--tokenizer-type": "NullTokenizer",
            "--log-interval": "1",
            "--log-memory-interval": "30",
        }
        for name, value in expect.items():
            assert _flag(flags, name) == value, (config, name)
        for switch in ("--bf16", "--swiglu", "--disable-bias-linear", "--mock-data", "--log-throughput"):
            assert switch in flags
        assert "--spec" not in flags
    assert e2e.provider_flags("sonic") == ["--spec", "sonic_megatron.spec", "sonic_block_spec"]
    assert e2e.provider_flags("sonic-rounding") == e2e.provider_flags("sonic")
    assert e2e.provider_flags("grouped") == ["--spec", "sonic_megatron.baseline", "grouped_block_spec"]
    assert e2e.provider_flags("sequential") == []
    cmd = e2e_launch.torchrun_command("/m/pretrain_gpt.py", 4, ["--bf16"], python="py")
    assert cmd == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"] + [
        "/m/pretrain_gpt.py",
        "--bf16",
    ]
    env = e2e.provider_env("sonic-rounding", "/m", {"PYTHONPATH": "/x", "HOME": "/h"})
    assert env["SONIC_MEGATRON_TOKEN_ROUNDING"] == "nearest" and env["HOME"] == "/h"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == os.path.abspath("/m")
    assert env["PYTHONPATH"].split(os.pathsep)[-1] == "/x" and env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert e2e_launch.shell_line(["py", "a b"], env, base={"PYTHONPATH": "/x", "HOME": "/h"}) == (
        f"PYTHONPATH={env['PYTHONPATH']} CUDA_DEVICE_MAX_CONNECTIONS=1 SONIC_MEGATRON_TOKEN_ROUNDING=nearest py 'a b'"
    )
    assert e2e.provider_env("sonic", "/m", {})["SONIC_MEGATRON_TOKEN_ROUNDING"] == "none"
    for mode in ("up", "down"):  # a provider per other rounding mode, the plugin's spec
        assert e2e.provider_env(f"sonic-rounding-{mode}", "/m", {})["SONIC_MEGATRON_TOKEN_ROUNDING"] == mode
        assert e2e.provider_flags(f"sonic-rounding-{mode}") == e2e.provider_flags("sonic")
    assert "SONIC_MEGATRON_TOKEN_ROUNDING" not in e2e.provider_env("grouped", "/m", {})


def test_markov_data_flags_and_dataset(tmp_path):
    shape = e2e.CONFIGS["small"]
    args = _args(config="small", data="markov", iters=20, seed=5)
    path = e2e.markov_data_path(str(tmp_path), e2e.markov_data_sizes(shape, args, 5))
    assert path.startswith(str(tmp_path)) and "d1024x1025-seed5" in path
    flags = e2e.pretrain_flags(shape, iters=20, ep=1, seed=5, data_path=path)
    assert "--mock-data" not in flags and _flag(flags, "--data-path") == path and _flag(flags, "--split") == "100,0,0"
    assert _args().data == "mock" and "--mock-data" in e2e.pretrain_flags(shape, iters=20, ep=1, seed=5)
    assert _flag(flags, "--eval-iters") == "0"
    # --eval-iters: held-out documents after the training ones, the split in documents, validation after training.
    eval_sizes = e2e.markov_data_sizes(shape, _args(config="small", data="markov", iters=20, seed=5, eval_iters=3), 5)
    assert (eval_sizes["docs"], eval_sizes["valid_docs"]) == (1024, 64) and e2e.markov_split(eval_sizes) == "1024,64,0"
    eval_path = e2e.markov_data_path(str(tmp_path), eval_sizes)
    assert "d1024x1025-valid64-seed5" in eval_path
    flags = e2e.pretrain_flags(shape, iters=20, ep=1, seed=5, data_path=eval_path, split="1024,64,0", eval_iters=3)
    assert _flag(flags, "--split") == "1024,64,0" and _flag(flags, "--eval-iters") == "3"
    assert int(_flag(flags, "--eval-interval")) > 20, "no validation during training"

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from sonic_megatron.bench import markov_data

    sizes = dict(vocab=50, successors=3, docs=6, doc_len=40, seed=5)
    prefix = markov_data.write_dataset(str(tmp_path / "mk" / "tokens"), **sizes)
    ds = IndexedDataset(prefix)
    tokens = markov_data.generate(**sizes)
    assert len(ds) == 6 and all((ds[i] == tokens[i]).all() for i in range(6))
    # Every step follows the chain: the next token is one of the current token's successors.
    next_VS, probs_S = markov_data.transition_table(50, 3, 5)
    follows = (next_VS[tokens[:, :-1]] == tokens[:, 1:, None]).any(-1)
    assert follows.all() and probs_S == pytest.approx([4 / 7, 2 / 7, 1 / 7])
    assert markov_data.entropy_rate(1) == 0.0 and 0.9 < markov_data.entropy_rate(3) < 1.0
    # Held-out walks follow the same chain, after the training walks, which do not depend on them.
    held = markov_data.write_dataset(str(tmp_path / "mv" / "tokens"), **sizes, valid_docs=4)
    ds_held = IndexedDataset(held)
    valid = markov_data.generate(**{**sizes, "docs": 4}, held_out=True)
    assert len(ds_held) == 10 and all((ds_held[i] == tokens[i]).all() for i in range(6))
    assert all((ds_held[6 + i] == valid[i]).all() for i in range(4)) and not (valid == tokens[:4]).all()
    assert (next_VS[valid[:, :-1]] == valid[:, 1:, None]).any(-1).all()
    # Written once: a second call with a dataset in place leaves it as it is.
    mtime = os.path.getmtime(prefix + ".bin")
    assert markov_data.write_dataset(prefix, **sizes) == prefix and os.path.getmtime(prefix + ".bin") == mtime
    with pytest.raises(ValueError, match="successors <= vocab"):
        markov_data.transition_table(4, 5, 0)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(providers="sonic,fast"), "--providers: unknown provider 'fast'; allowed: sonic, sonic-rounding"),
        (dict(providers="sonic,sonic"), "--providers: each provider once"),
        (dict(config="huge"), "--config: unknown config 'huge'; allowed: qwen3, sparse"),
        (dict(nproc=8), "--nproc: qwen3's global batch 16 must be a multiple"),
        (dict(nproc=2, ep=3), "--ep: must divide --nproc (2)"),
        (dict(iters=5, warmup=5), "--warmup: must be in [0, --iters)"),
        (dict(timeout=0), "--timeout: must be > 0"),
        (dict(seeds=0), "--seeds: must be >= 1 (the number of seeds from --seed on), got --seeds 0"),
        (dict(eval_iters=2), "--eval-iters: must be 0 (off) or N >= 1 with --data markov"),
        (dict(eval_iters=-1, data="markov"), "got --eval-iters -1 --data markov"),
        (dict(profile=-1), "--profile: must be 0 (off) or N >= 1"),
        (dict(iters=10, warmup=5, profile=3), "got --profile 3 --iters 10 --warmup 5"),
        (
            dict(microbatches=0),
            "--microbatches: must be >= 1 (micro-batches per data-parallel rank per iteration) or left out (the "
            "qwen3 global batch 16), got --microbatches 0",
        ),
        (dict(nproc=3), "got --nproc 3 (or set --microbatches)"),
        (dict(overlap_ep_comm=True), "--overlap-ep-comm: needs --ep >= 2"),
        (dict(overlap_ep_comm=True, nproc=2, ep=1), "got --ep 1"),
    ],
)
def test_argument_errors(kw, message):
    with pytest.raises(ValueError) as err:
        e2e.validate(_args(**{"nproc": 1, **kw}), gpu_count=0)
    assert message in str(err.value)


def test_defaults_and_no_gpu_error():
    args = _args()
    assert (args.config, args.providers, args.iters, args.warmup, args.ep, args.timeout) == (
        "qwen3",
        "sonic,sonic-rounding,grouped",
        30,
        5,
        1,
        600.0,
    )
    assert e2e.validate(args, gpu_count=4)[1:] == (["sonic", "sonic-rounding", "grouped"], 4)
    with pytest.raises(ValueError, match="--nproc: must be >= 1, got 0 \\(no CUDA device visible"):
        e2e.validate(args, gpu_count=0)


def _dry_run_commands(printed: str) -> dict[str, list[str]]:
    """provider -> its printed shell line's words (the variables it sets first) of a --dry-run's output."""
    out = {}
    for line in printed.splitlines():
        if line.startswith("[") and "]" in line:
            name, _, shell = line.split("] ", 1)[1].partition(": ")
            out[name] = shlex.split(shell)
    return out


def test_dry_run_without_gpus_takes_nproc_from_ep():
    """A dry run on a machine without GPUs: --nproc defaults to --ep; a GPU count or --nproc wins over it."""
    assert e2e.validate(_args(dry_run=True), gpu_count=0)[2] == 1
    assert e2e.validate(_args(dry_run=True, ep=4), gpu_count=0)[2] == 4
    assert e2e.validate(_args(dry_run=True, ep=2), gpu_count=4)[2] == 4
    assert e2e.validate(_args(dry_run=True, nproc=2), gpu_count=0)[2] == 2
    with pytest.raises(ValueError, match="--ep: must divide"):
        e2e.validate(_args(dry_run=True, ep=3), gpu_count=0)


def test_readme_dry_run_example_runs_anywhere(tmp_path, monkeypatch, capsys):
    """The README's bench e2e --dry-run line, its arguments through the command line's entry point (``python -m
    sonic_megatron`` runs ``cli.main``), from a folder without Megatron-LM's files and, here, without GPUs: every
    default provider's command with the launcher path it would use, a note that the launcher is missing, nothing
    written."""
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")) as f:
        lines = [line.split("#")[0].strip() for line in f if "bench e2e" in line and "--dry-run" in line]
    assert len(lines) == 1, lines
    words = shlex.split(lines[0])
    assert words[:3] == ["python", "-m", "sonic_megatron"]
    monkeypatch.chdir(tmp_path)
    assert cli.main(words[3:]) == 0
    printed = capsys.readouterr()
    commands = _dry_run_commands(printed.out)
    assert sorted(commands) == sorted(e2e.DEFAULT_PROVIDERS.split(","))
    launcher = os.path.join(os.getcwd(), ".mlm", "pretrain_gpt.py")
    nproc = str(torch.cuda.device_count()) if torch.cuda.is_available() else "1"
    for cmd in commands.values():
        assert launcher in cmd and _flag(cmd, "--nproc-per-node") == nproc
    assert f"note: --megatron-lm: {launcher} does not exist" in printed.err
    assert os.listdir(tmp_path) == []


def test_microbatches_set_the_global_batch(tmp_path, capsys):
    """--microbatches N: global batch = micro-batch x data-parallel size (--nproc) x N, in --print-flags and every
    provider's command; a --global-batch-size in --pretrain-args comes after it (argparse keeps the last)."""
    shape = e2e.CONFIGS["qwen3"]
    assert e2e.global_batch_size(shape, 8, None) == 16 and e2e.global_batch_size(shape, 8, 3) == 4 * 8 * 3
    assert e2e.validate(_args(nproc=8, microbatches=1), gpu_count=0)[2] == 8, "no divisibility rule with N given"
    assert _args().microbatches is None
    assert e2e.run(_args(nproc=2, ep=2, microbatches=3, print_flags=True)) == 0
    flags = capsys.readouterr().out.splitlines()
    assert _flag(flags, "--global-batch-size") == "24" and _flag(flags, "--micro-batch-size") == "4"
    mlm = _fake_megatron_lm(tmp_path)
    args = _args(megatron_lm=mlm, nproc=2, ep=2, microbatches=2, providers="sonic,grouped", dry_run=True)
    assert e2e.run(args) == 0
    commands = _dry_run_commands(capsys.readouterr().out)
    assert sorted(commands) == ["grouped", "sonic"]
    for cmd in commands.values():
        assert _flag(cmd, "--global-batch-size") == "16" and _flag(cmd, "--nproc-per-node") == "2"
    args = _args(
        megatron_lm=mlm,
        nproc=2,
        microbatches=2,
        providers="sonic",
        pretrain_args="--global-batch-size 64",
        dry_run=True,
    )
    assert e2e.run(args) == 0
    cmd = _dry_run_commands(capsys.readouterr().out)["sonic"]
    assert e2e.last_flag_value(cmd, "--global-batch-size") == "64" and _flag(cmd, "--global-batch-size") == "16"
    assert e2e.last_flag_value(["--global-batch-size=32", "--x"], "--global-batch-size") == "32"
    assert e2e.last_flag_value(["--x"], "--global-batch-size") is None


def test_pretrain_args_take_a_lone_flag_from_the_command_line(tmp_path, capsys):
    """``--pretrain-args --one-flag`` (no space inside the value, so argparse would read it as an option of ours)
    reaches every provider's command through the command line's entry point, as does ``--pretrain-args=...``."""
    mlm = _fake_megatron_lm(tmp_path)
    for words in (["--pretrain-args", "--use-distributed-optimizer"], ["--pretrain-args=--use-distributed-optimizer"]):
        argv = ["bench", "e2e", "--megatron-lm", str(mlm), "--nproc", "1", "--providers", "sonic,grouped", "--dry-run"]
        assert cli.main(argv + words) == 0
        commands = _dry_run_commands(capsys.readouterr().out)
        assert sorted(commands) == ["grouped", "sonic"]
        assert all(cmd.count("--use-distributed-optimizer") == 1 for cmd in commands.values())
    assert cli.glue_command_line_values(["--pretrain-args"]) == ["--pretrain-args"]


def test_overlap_ep_comm_flags_and_connections(tmp_path, capsys, monkeypatch):
    """--overlap-ep-comm: Megatron's --overlap-moe-expert-parallel-comm in every provider's command (and
    --print-flags) and CUDA_DEVICE_MAX_CONNECTIONS=32 in every provider's environment; without it neither flag and
    one connection."""
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    shape = e2e.CONFIGS["small"]
    flags = e2e.pretrain_flags(shape, iters=5, ep=2, seed=1, overlap_ep_comm=True)
    assert flags[-1] == "--overlap-moe-expert-parallel-comm" and "--delay-wgrad-compute" not in flags
    assert "--overlap-moe-expert-parallel-comm" not in e2e.pretrain_flags(shape, iters=5, ep=2, seed=1)
    for name in ("sonic", "grouped", "sequential"):
        assert e2e.provider_env(name, "/m", {}, overlap_ep_comm=True)["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"
        assert e2e.provider_env(name, "/m", {"CUDA_DEVICE_MAX_CONNECTIONS": "8"})["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert e2e.run(_args(config="small", nproc=2, ep=2, overlap_ep_comm=True, print_flags=True)) == 0
    assert "--overlap-moe-expert-parallel-comm" in capsys.readouterr().out.splitlines()
    mlm = _fake_megatron_lm(tmp_path)
    common = dict(
        megatron_lm=mlm, config="small", nproc=2, ep=2, providers="sonic,sonic-rounding,grouped", dry_run=True
    )
    assert e2e.run(_args(**common, overlap_ep_comm=True, microbatches=2)) == 0
    captured = capsys.readouterr()
    commands = _dry_run_commands(captured.out)
    assert sorted(commands) == ["grouped", "sonic", "sonic-rounding"] and "warning" not in captured.err
    for cmd in commands.values():
        assert "CUDA_DEVICE_MAX_CONNECTIONS=32" in cmd and "--overlap-moe-expert-parallel-comm" in cmd
        assert cmd.index("CUDA_DEVICE_MAX_CONNECTIONS=32") < cmd.index("-m"), "set in the environment"
    assert e2e.run(_args(**common)) == 0
    for cmd in _dry_run_commands(capsys.readouterr().out).values():
        assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in cmd and "--overlap-moe-expert-parallel-comm" not in cmd
    # One micro-batch per rank: nothing to overlap with; said, not refused.
    assert e2e.run(_args(**common, overlap_ep_comm=True, microbatches=1)) == 0
    assert "--overlap-ep-comm with 1 micro-batch per rank" in capsys.readouterr().err


def test_run_global_batch_from_the_log_else_the_flags():
    lines = [_iteration_line(i, 4, 100.0, 1.0, 5.0, global_batch=8 if i < 3 else 24) for i in range(1, 5)]
    cmd = ["--global-batch-size", "16", "--global-batch-size", "32"]
    parsed = parse_log(lines)
    assert e2e.run_global_batch(parsed, cmd, warmup=1, last_timed=None) == (24, "log")
    assert e2e.run_global_batch(parsed, cmd, warmup=1, last_timed=2) == (8, "log"), "the last timed iteration's"
    assert e2e.run_global_batch(parse_log(["Traceback"]), cmd, warmup=1, last_timed=None) == (32, "flags")
    no_batch = parse_log([line.replace("global batch size", "other") for line in lines])
    assert e2e.run_global_batch(no_batch, cmd, warmup=0, last_timed=None) == (32, "flags")


def test_missing_pretrain_gpt_names_the_flag(tmp_path, capsys):
    assert e2e.run(_args(megatron_lm=tmp_path, nproc=1)) == 2
    err = capsys.readouterr().err
    assert "--megatron-lm:" in err and str(tmp_path / "pretrain_gpt.py") in err


FAKE_PRETRAIN = """
import gzip, json, os, sys
args = sys.argv[1:]
spec = args[args.index("--spec") + 1:args.index("--spec") + 3] if "--spec" in args else []
iters = int(args[args.index("--train-iters") + 1])
global_batch = int([args[i + 1] for i, a in enumerate(args) if a == "--global-batch-size"][-1])  # argparse: last wins
if "--profile" in args:  # Megatron writes rank 0's trace beside --tensorboard-dir
    trace = os.path.join(os.path.dirname(args[args.index("--tensorboard-dir") + 1]), "torch_profile", "rank-0.json.gz")
    os.makedirs(os.path.dirname(trace), exist_ok=True)
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": COMM_TRACE()}, f)
if spec and spec[0] == "sonic_megatron.baseline":
    print("Traceback (most recent call last):\\nRuntimeError: fake failure of the grouped run", flush=True)
    sys.exit(3)
rounding = os.environ.get("SONIC_MEGATRON_TOKEN_ROUNDING")
base = {"none": 100.0, "nearest": 90.0}.get(rounding, 150.0)
seed = int(args[args.index("--seed") + 1])
shift = 0.1 * (seed % 2) if rounding == "nearest" else 0.0  # rounding's loss: higher at odd seeds
for i in range(1, iters + 1):
    print(LINE(i, iters, base + i % 2, 100.0, 10.0 - 0.1 * i + shift, global_batch), flush=True)
    if i in (1, 2, iters):
        print(MEM(i, 1000.0 if rounding else 2000.0), flush=True)
if int(args[args.index("--eval-iters") + 1]):
    print(VAL(iters, 3.0 if rounding == "nearest" else 2.0), flush=True)
"""


def _fake_megatron_lm(tmp_path):
    mlm = tmp_path / "mlm"
    mlm.mkdir()
    funcs = (_iteration_line, _memory_line, _validation_line, _comm_trace_events)
    helpers = "LINE, MEM, VAL, COMM_TRACE = " + ", ".join(f.__name__ for f in funcs) + "\n"
    source = "\n".join(textwrap.dedent(inspect.getsource(f)) for f in funcs)
    (mlm / "pretrain_gpt.py").write_text(source + "\n" + helpers + FAKE_PRETRAIN)
    return mlm


def test_failing_provider_does_not_stop_the_others(tmp_path, capsys):
    mlm = _fake_megatron_lm(tmp_path)
    out = tmp_path / "e2e.json"
    args = _args(
        json=out,
        megatron_lm=mlm,
        nproc=1,
        config="small",
        providers="sonic,grouped,sequential",
        iters=6,
        warmup=2,
        timeout=120,
    )
    assert e2e.run(args) == 1, "a failed provider makes the exit status 1"
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    rows = {r["provider"]: r for r in result["rows"]}
    assert [r["provider"] for r in result["rows"]] == ["sonic", "grouped", "sequential"]
    assert rows["grouped"]["status"] == "failed" and rows["grouped"]["returncode"] != 0
    assert any("fake failure of the grouped run" in line for line in rows["grouped"]["log_tail"])
    assert "fake failure of the grouped run" in printed and "torch.distributed.run" in printed
    for name, ms in (("sonic", 100.5), ("sequential", 150.5)):
        row = rows[name]
        assert row["status"] == "ok", (name, row.get("log_tail"))
        assert row["iterations_timed"] == 4 and row["ms_per_iter_median"] == ms
        assert row["ms_per_iter_min"] == ms - 0.5 and row["ms_per_iter_max"] == ms + 0.5
        assert row["losses"] == pytest.approx([10.0 - 0.1 * i for i in range(1, 7)])
        assert row["tokens_per_s_per_gpu"] == pytest.approx(16 * 1024 / (ms / 1e3))
        assert row["speedup_vs_grouped"] is None, "no baseline ratio when the baseline failed"
        assert os.path.isfile(row["log"])
    assert rows["sonic"]["peak_allocated_mib"] == 1000.0 and rows["sequential"]["peak_allocated_mib"] == 2000.0
    assert result["config"] == "small" and result["nproc"] == 1


def test_tokens_per_second_count_the_logged_global_batch(tmp_path, capsys):
    """--microbatches 2 sets --global-batch-size 8 (small: micro-batch 4, one GPU); --pretrain-args'
    --global-batch-size 24 comes last and is what Megatron trains on and logs: tokens/s counts 24 sequences."""
    out = tmp_path / "e2e.json"
    args = _args(
        json=out,
        megatron_lm=_fake_megatron_lm(tmp_path),
        nproc=1,
        config="small",
        providers="sonic",
        iters=4,
        warmup=1,
        microbatches=2,
        pretrain_args="--global-batch-size 24",
        timeout=120,
    )
    assert e2e.run(args) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert (result["global_batch"], result["microbatches"]) == (8, 2)
    assert (result["overlap_ep_comm"], result["cuda_device_max_connections"]) == (False, "1")
    assert row["global_batch"] == 24 and row["global_batch_source"] == "log"
    assert row["tokens_per_iteration"] == 24 * 1024 and row["ms_per_iter_median"] == 100.0  # iterations 2-4
    assert row["tokens_per_s"] == pytest.approx(24 * 1024 / 0.1) == row["tokens_per_s_per_gpu"]
    assert "global batch 24 (log)" in printed and "global batch 8 (2 micro-batch(es) per rank)" in printed


def _fake_markov_run(tmp_path, out, **extra) -> argparse.Namespace:
    """Arguments of a fake run of sonic and sonic-rounding on the markov data, 4 iterations and 2 evaluation
    batches, writing ``out``."""
    return _args(
        json=out,
        megatron_lm=_fake_megatron_lm(tmp_path),
        nproc=1,
        config="small",
        providers="sonic,sonic-rounding",
        iters=4,
        warmup=1,
        data="markov",
        eval_iters=2,
        timeout=120,
        **extra,
    )


def test_eval_loss_per_provider(tmp_path, capsys):
    """--data markov --eval-iters: the dataset with held-out walks, its split and the validation flags in every
    provider's command, each provider's validation loss in its row and the table."""
    out = tmp_path / "e2e.json"
    assert e2e.run(_fake_markov_run(tmp_path, out)) == 0
    printed = capsys.readouterr().out
    assert "eval_loss" in printed and "[sonic-rounding] validation loss after iteration 4: 3.0000" in printed
    result = json.loads(out.read_text())
    rows = {r["provider"]: r for r in result["rows"]}
    assert rows["sonic"]["eval_loss"] == 2.0 and rows["sonic-rounding"]["eval_loss"] == 3.0
    assert result["eval_iters"] == 2 and result["data"] == "markov"
    cmd = rows["sonic"]["command"]
    assert _flag(cmd, "--split") == "1024,48,0" and _flag(cmd, "--eval-iters") == "2"
    assert os.path.isfile(_flag(cmd, "--data-path") + ".idx")


def test_several_seeds_and_their_ratios(tmp_path, capsys):
    """--seeds 2: every provider at each seed (its own markov chain, its own log) and each provider's per-seed
    ratios to the first provider with their mean and spread."""
    out = tmp_path / "e2e.json"
    assert e2e.run(_fake_markov_run(tmp_path, out, seed=1234, seeds=2)) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["seeds"] == [1234, 1235] and result["seed"] == 1234
    assert [(r["provider"], r["seed"]) for r in result["rows"]] == [
        ("sonic", 1234),
        ("sonic-rounding", 1234),
        ("sonic", 1235),
        ("sonic-rounding", 1235),
    ]
    for r in result["rows"]:
        assert r["status"] == "ok" and r["log"].endswith(f"e2e-small-{r['provider']}-seed{r['seed']}.log")
        assert _flag(r["command"], "--seed") == str(r["seed"]) and f"-seed{r['seed']}" in _flag(
            r["command"], "--data-path"
        )
    (ratio,) = result["seed_ratios"]
    # the fake run: mean loss 9.75 at both seeds, +0.1 with rounding at the odd seed; 100 vs 90 ms; eval 2 vs 3
    assert ratio["provider"] == "sonic-rounding" and ratio["vs"] == "sonic" and ratio["seeds"] == [1234, 1235]
    assert ratio["loss_ratios"] == pytest.approx([1.0, 9.85 / 9.75])
    assert ratio["loss_ratio_mean"] == pytest.approx((1.0 + 9.85 / 9.75) / 2)
    assert ratio["loss_ratio_sd"] == pytest.approx(statistics.stdev([1.0, 9.85 / 9.75]))
    assert ratio["eval_ratio_mean"] == pytest.approx(1.5) and ratio["eval_ratio_sd"] == pytest.approx(0.0)
    assert ratio["speed_mean"] == pytest.approx(100 / 90) and ratio["speed_min"] == pytest.approx(100 / 90)
    assert "per-seed ratios to sonic over 2 seeds" in printed


def test_seed_ratios_skip_seeds_that_failed():
    def row(provider, seed, status="ok", loss=2.0, ms=100.0):
        return dict(
            provider=provider, seed=seed, status=status, final_loss_mean10=loss, ms_per_iter_median=ms, eval_loss=None
        )

    rows = [row("a", 1), row("b", 1, loss=2.2, ms=50.0), row("a", 2, status="failed"), row("b", 2)]
    (r,) = e2e_compare.seed_ratios(rows, "a")
    assert r["seeds"] == [1] and r["loss_ratios"] == pytest.approx([1.1]) and r["loss_ratio_sd"] is None
    assert r["speed_ratios"] == [2.0] and r["eval_ratios"] == [] and r["eval_ratio_mean"] is None
    assert e2e_compare.seed_ratios([row("a", 1)], "a") == []


def test_ratios_to_grouped():
    rows = [
        {"provider": "sonic", "status": "ok", "ms_per_iter_median": 50.0, "peak_allocated_mib": 500.0},
        {"provider": "grouped", "status": "ok", "ms_per_iter_median": 100.0, "peak_allocated_mib": 1000.0},
        {"provider": "sequential", "status": "timeout", "ms_per_iter_median": None, "peak_allocated_mib": None},
    ]
    e2e_compare.add_ratios(rows, e2e.BASELINE)
    assert [r["speedup_vs_grouped"] for r in rows] == [2.0, 1.0, None]
    assert [r["memory_vs_grouped"] for r in rows] == [0.5, 1.0, None]


def test_timeout_stops_the_run(tmp_path):
    log = tmp_path / "run.log"
    lines = []
    script = "import time; print('started', flush=True); time.sleep(60)"
    # the limit leaves a loaded machine the time to start Python and print; the script sleeps far longer
    rc, timed_out = e2e_launch.run_logged([sys.executable, "-c", script], dict(os.environ), str(log), 5.0, lines.append)
    assert timed_out and rc != 0 and lines == ["started\n"] and log.read_text() == "started\n"


def test_megatron_lm_files(tmp_path):
    src = tmp_path / "Megatron-LM"
    for path in megatron_lm.FILES.values():
        (src / path).parent.mkdir(parents=True, exist_ok=True)
        (src / path).write_text(f"# {path}\n")
    dest = tmp_path / "mlm"
    written = megatron_lm.fetch(str(src), str(dest))
    assert sorted(os.path.basename(p) for p in written) == sorted(megatron_lm.FILES)
    assert (dest / "datasets_Makefile").read_text() == "# megatron/core/datasets/Makefile\n"
    with pytest.raises(ValueError, match="source: .* neither a Megatron-LM checkout"):
        megatron_lm.fetch(str(tmp_path / "nothing"), str(dest))
    # A git directory: files come from the ref.
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    for path in megatron_lm.FILES.values():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(f"v1 {path}\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "v1"], check=True)
    (repo / "pretrain_gpt.py").unlink()  # not a checkout any more: read from the ref
    megatron_lm.fetch(str(repo), str(dest), ref="HEAD")
    assert (dest / "pretrain_gpt.py").read_text() == "v1 pretrain_gpt.py\n"
    with pytest.raises(ValueError, match="ref: nosuchref:pretrain_gpt.py not found"):
        megatron_lm.fetch(str(repo), str(dest), ref="nosuchref")
    # Dataset sources go where megatron-core lacks them, and only there.
    ds = tmp_path / "datasets"
    ds.mkdir()
    (ds / "helpers.cpp").write_text("wheel's own\n")
    installed = megatron_lm.install_dataset_sources(str(dest), str(ds))
    assert installed == [str(ds / "Makefile")]
    assert (ds / "helpers.cpp").read_text() == "wheel's own\n"
    assert megatron_lm.install_dataset_sources(str(dest), str(ds)) == []


# ----------------------------------------------------------------------------------------------------------
# The grouped-GEMM baseline experts
# ----------------------------------------------------------------------------------------------------------


def _run_experts(experts, x, counts, probs):
    x = x.clone().requires_grad_(True)
    probs = probs.clone().requires_grad_(True)
    out, bias = experts(x, counts, probs)
    assert bias is None
    g = torch.Generator().manual_seed(5)
    (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum().backward()
    return out.detach(), x.grad, probs.grad


def _baseline_worker(rank, world):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_block import TransformerBlock

    from sonic_megatron import baseline as B
    from sonic_megatron.gpt import PRESETS, build_model, scaled
    from sonic_megatron.megatron_compat import default_pg_collection
    from sonic_megatron.spec import moe_submodules_of
    from sonic_megatron.testing import init_model_parallel, moe_config

    init_model_parallel(ep=1)
    num_experts, hidden, ffn = 4, 32, 48
    counts = torch.tensor([5, 0, 9, 3])  # an expert without tokens included
    n = int(counts.sum())
    for dtype, tol, grouped_mm in ((torch.float64, 1e-12, False), (torch.float32, 1e-5, True)):
        config = moe_config(
            num_moe_experts=num_experts, hidden_size=hidden, moe_ffn_hidden_size=ffn, params_dtype=dtype
        )
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
        seq_submodules = moe_submodules_of(block.layer_specs[0].submodules.mlp).experts.submodules
        torch.manual_seed(11)
        seq = SequentialMLP(num_experts, config, seq_submodules, pg_collection=default_pg_collection())
        torch.manual_seed(11)
        grouped = B.GroupedMMExperts(num_experts, config)
        for e, expert in enumerate(seq.local_experts):  # initialised as Megatron initialises experts
            assert torch.equal(grouped.weight1[e], expert.linear_fc1.weight), f"fc1 init differs, expert {e}"
            assert torch.equal(grouped.weight2[e], expert.linear_fc2.weight), f"fc2 init differs, expert {e}"
        g = torch.Generator().manual_seed(3)
        x = torch.randn(n, hidden, generator=g, dtype=dtype)
        probs = torch.rand(n, generator=g, dtype=torch.float32).to(dtype)
        assert B.use_grouped_mm(x, grouped.weight1, grouped.weight2) is grouped_mm, dtype
        want = _run_experts(seq, x, counts, probs)
        got = _run_experts(grouped, x, counts, probs)
        for name, a, b in zip(("output", "dx", "dprobs"), got, want, strict=True):
            assert torch.allclose(a, b, atol=tol, rtol=tol), f"{dtype} {name}: {(a - b).abs().max()}"
        for e, expert in enumerate(seq.local_experts):
            for name, a, b in (
                ("dw1", grouped.weight1.grad[e], expert.linear_fc1.weight.grad),
                ("dw2", grouped.weight2.grad[e], expert.linear_fc2.weight.grad),
            ):
                assert torch.allclose(a, b, atol=tol, rtol=tol), f"{dtype} expert {e} {name}"
        assert grouped.weight1.grad[1].abs().sum() == 0, "the expert without tokens gets a zero gradient"
        assert grouped.weight1.allreduce is False and grouped.weight2.allreduce is False

    # The spec swap keeps Megatron's MoE layer and router, replaces the experts only, leaves the input alone.
    config = moe_config(num_layers=2, moe_layer_freq=[0, 1])
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    model = TransformerBlock(config, B.swap_experts_spec(block))
    moe = model.layers[1].mlp
    assert type(moe) is MoELayer and type(moe.router) is TopKRouter
    assert isinstance(moe.experts, B.GroupedMMExperts)
    assert isinstance(TransformerBlock(config, block).layers[1].mlp.experts, SequentialMLP)
    out = model(
        torch.randn(6, 2, config.hidden_size), attention_mask=torch.triu(torch.ones(6, 6), 1).bool()[None, None]
    )
    out = out[0] if isinstance(out, tuple) else out
    assert torch.isfinite(out).all()
    # bench train's "grouped" spec builds a GPT model with these experts.
    gpt = build_model(scaled(PRESETS["tiny"], layers=1), "grouped", ep=1, dtype=torch.float32, device="cpu")
    assert any(isinstance(m, B.GroupedMMExperts) for m in gpt.modules())
    with pytest.raises(ValueError, match="does not support add_bias_linear=True"):
        B.GroupedMMExperts(num_experts, moe_config(add_bias_linear=True))


@pytest.mark.slow
def test_grouped_baseline_matches_sequential_mlp():
    from sonic_megatron.testing import spawn

    spawn(_baseline_worker, 1, timeout=240)


def test_train_specs():
    from sonic_megatron.bench import train

    assert train.parse_specs("sonic,grouped,stock") == ["sonic", "grouped", "stock"]
    with pytest.raises(ValueError, match="--specs: expected names from sonic, grouped, stock, got 'sonic,te'"):
        train.parse_specs("sonic,te")
    assert train.baseline_spec(["sonic", "grouped", "stock"]) == "grouped"
    assert train.baseline_spec(["sonic", "stock"]) == "stock"
    assert train.baseline_spec(["sonic"]) is None
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    assert parser.parse_args([]).specs == "sonic,grouped"


def _trace(path, iterations_us):
    """A Chrome trace: QuACK and cuBLAS GEMMs, an optimizer kernel, a Triton kernel, a copy and a memset, with
    gaps; ``iterations_us`` = the window covered. The gaps end at the gather-sum (launched inside a host op nested
    in another), at the copy (launched inside the outer op only), at a kernel autograd's thread launched and at the
    optimizer kernel (launch not traced)."""
    ev = [
        {"ph": "X", "cat": "kernel", "name": "kernel_cutlass_kernel_quackgemm_default_epiGemm", "ts": 0, "dur": 300},
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_256x128", "ts": 250, "dur": 100},  # overlaps 50
        {"ph": "X", "cat": "kernel", "name": "_gather_sum_kernel", "ts": 400, "dur": 100, "args": {"correlation": 1}},
        {
            "ph": "X",
            "cat": "gpu_memcpy",
            "name": "Memcpy DtoD (Device -> Device)",
            "ts": 600,
            "dur": 200,
            "args": {"correlation": 2},
        },
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 800, "dur": 50},
        {
            "ph": "X",
            "cat": "kernel",
            "name": "void at::native::multi_tensor_apply_kernel<...>",
            "ts": 900,
            "dur": 100,
            "args": {"correlation": 3},
        },
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "aten::mm",
            "ts": 0,
            "dur": 5000,
            "tid": 1,
        },  # host events are not GPU time
        {"ph": "X", "cat": "cpu_op", "name": "aten::index", "ts": 390, "dur": 5, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#5", "ts": 0, "dur": 5000, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "SonicFunction", "ts": 380, "dur": 100, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "other thread's op", "ts": 580, "dur": 20, "tid": 2},
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cuLaunchKernel",
            "ts": 392,
            "dur": 1,
            "tid": 1,
            "args": {"correlation": 1},
        },
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaMemcpyAsync",
            "ts": 590,
            "dur": 1,
            "tid": 1,
            "args": {"correlation": 2},
        },
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 10},
        # a backward node on autograd's thread (tid 2), launching a kernel inside the gap before the optimizer's
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "autograd::engine::evaluate_function: MmBackward0",
            "ts": 850,
            "dur": 10,
            "tid": 2,
        },
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cuLaunchKernel",
            "ts": 852,
            "dur": 1,
            "tid": 2,
            "args": {"correlation": 4},
        },
        {"ph": "X", "cat": "kernel", "name": "_bwd_kernel", "ts": 860, "dur": 20, "args": {"correlation": 4}},
    ]
    host = ("cpu_op", "cuda_runtime", "user_annotation")
    assert max(e["ts"] + e.get("dur", 0) for e in ev if e["cat"] not in host) == iterations_us
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)


def test_kernel_families_of_quack_and_dense_gemms():
    from sonic_megatron.bench.e2e_profile import family

    quack = (
        "kernel_cutlass_kernel_quackgemm_default_epiGemmDefaultSm90_object_at__TiledMMA",
        "kernel_cutlass_kernel_quackepiloguefrontendGemmMod_linear_act_epi_ee8d_g_none_sm9_object_at__TiledMMA",
        "kernel_cutlass_kernel_quackepiloguefrontendGemmMod_dgated_epi_0f87_p_c_col_sm9_object_at__TiledMMA",
    )
    assert [family(n, "kernel") for n in quack] == ["expert_gemms_quack"] * 3
    assert family("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "kernel") == "dense_gemms"
    grouped = "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversal"
    grouped += "INS5_17GroupProblemShape"
    assert family(grouped, "kernel") == "grouped_gemms_cutlass"


def test_profile_summary_per_iteration(tmp_path):
    from sonic_megatron.bench import e2e_profile

    tb = tmp_path / "run-profile" / "tb"
    trace = e2e_profile.trace_path(str(tb))
    assert trace == str(tmp_path / "run-profile" / "torch_profile" / "rank-0.json.gz")
    os.makedirs(os.path.dirname(trace))
    _trace(trace, 1000)
    prof = e2e_profile.summarize_trace(trace, iterations=2)
    # the GPU's busy intervals in trace time (the first: two GEMMs overlapping), per iteration and in ms
    busy = [(0, 350), (400, 500), (600, 850), (860, 880), (900, 1000)]
    busy_ms = sum(b - a for a, b in busy) / 2 / 1000
    assert busy_ms == pytest.approx(0.41)
    assert prof["busy_ms"] == pytest.approx(busy_ms) and prof["idle_ms"] == pytest.approx(0.5 - busy_ms)
    fam = prof["families_ms"]
    assert fam["expert_gemms_quack"] == pytest.approx(0.15) and fam["dense_gemms"] == pytest.approx(0.05)
    assert fam["triton"] == pytest.approx(0.06) and fam["copies"] == pytest.approx(0.1)
    assert fam["memsets"] == pytest.approx(0.025) and fam["optimizer_multi_tensor"] == pytest.approx(0.05)
    assert prof["top_kernels"][0] == {
        "name": "kernel_cutlass_kernel_quackgemm_default_epiGemm",
        "ms": pytest.approx(0.15),
        "calls": 0.5,
    }
    # idle 350-400 before the gather-sum, 500-600 before the copy, 850-860 before the backward's kernel, 880-900
    # before the optimizer kernel
    assert prof["idle_by_launcher"] == [
        {"launcher": "aten::mm", "ms": pytest.approx(0.05), "gaps": 0.5},
        {"launcher": "aten::index [SonicFunction]", "ms": pytest.approx(0.025), "gaps": 0.5},
        {"launcher": e2e_profile.UNKNOWN_LAUNCH, "ms": pytest.approx(0.01), "gaps": 0.5},
        {"launcher": "autograd::engine::evaluate_function: MmBackward0", "ms": pytest.approx(0.005), "gaps": 0.5},
    ]
    assert sum(g["ms"] for g in prof["idle_by_launcher"]) == pytest.approx(prof["idle_ms"])
    by_thread = prof["idle_by_thread_ms"]
    assert by_thread == {
        "main": pytest.approx(0.075),
        "backward": pytest.approx(0.005),
        "not_traced": pytest.approx(0.01),
    }
    assert "(before the main thread's launches 0.07, the backward's 0.01)" in e2e_profile.summary_text(
        {**prof, "all_to_all_hidden_share": None}
    )
    assert prof["nccl_ms"] == 0.0 and prof["all_to_all_ms"] == 0.0 and prof["all_to_all_hidden_share"] is None
    rows, columns = e2e_profile.table_rows([{"provider": "sonic", "profile": prof}, {"provider": "x", "profile": None}])
    assert [r["provider"] for r in rows] == ["sonic"] and columns[:3] == ["provider", "busy_ms", "idle_ms"]
    assert rows[0]["grouped_gemms_cutlass"] == 0.0
    with pytest.raises(ValueError, match="no GPU events"):
        empty = tmp_path / "empty.json"
        empty.write_text(json.dumps({"traceEvents": []}))
        e2e_profile.summarize_trace(str(empty), 1)


def test_interval_arithmetic():
    from sonic_megatron.bench.e2e_profile import clip, intersect, length, union

    u = union([(5, 7), (0, 2), (1, 3), (3, 4), (6, 6.5)])  # overlapping, touching, nested, unsorted
    assert u == [(0, 4), (5, 7)] and length(u) == 6
    assert union([]) == [] and intersect(u, []) == []
    assert intersect(u, [(3, 6)]) == [(3, 4), (5, 6)]
    assert intersect([(0, 10)], [(1, 2), (4, 5), (9, 12)]) == [(1, 2), (4, 5), (9, 10)]
    assert intersect([(0, 1)], [(1, 2)]) == [], "touching intervals share no time"
    assert clip(u, 2, 6) == [(2, 4), (5, 6)] and clip(u, 4, 5) == [] and clip(u, -1, 100) == u


def _comm_trace_events() -> list:
    """Two profiler steps on GPU 0 and one kernel on GPU 1 (trace times in us). GPU 0: all-to-alls (SendRecv) on
    stream 7 at 100-200 (A), 300-400 (B) and 700-750 (C), an all-gather at 500-560; compute beside A: a GEMM at
    50-130 and an outer kernel at 150-190 with a nested one at 160-180 on another stream (A: 70 of 100 hidden), a
    memset at 135-145 inside A's exposed time (not compute); beside B a copy at 300-350 (not compute) and an
    element-wise kernel at 350-450 (B: 50 of 100 hidden); beside C only an all-reduce (NCCL, not compute) and, on
    GPU 1, a kernel (another GPU): C 0 of 50 hidden. Step 7 launches the GEMM, step 8 a kernel at 650-680."""
    send_recv = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"

    def gpu(name, ts, dur, stream, cat="kernel", pid=0, corr=None):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": stream} | (
            {"args": {"correlation": corr}} if corr else {}
        )

    return [
        gpu(send_recv, 100, 100, 7),
        gpu(send_recv, 300, 100, 7),
        gpu("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 500, 60, 7),
        gpu(send_recv, 700, 50, 7),
        gpu("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 720, 40, 8),
        gpu("nvjet_sm90_tst_256x128", 50, 80, 1, corr=11),
        gpu("outer_kernel", 150, 40, 1),
        gpu("inner_kernel", 160, 20, 2),
        gpu("Memset (Device)", 135, 10, 3, cat="gpu_memset"),
        gpu("Memcpy DtoD (Device -> Device)", 300, 50, 3, cat="gpu_memcpy"),
        gpu("vectorized_elementwise_kernel", 350, 100, 1),
        gpu("gemm_beside_the_all_gather", 500, 60, 1),
        gpu("step_8_kernel", 650, 30, 1, corr=12),
        gpu("other_gpu_kernel", 700, 50, 1, pid=1),
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#7", "ts": 0, "dur": 600, "pid": 9, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#8", "ts": 600, "dur": 400, "pid": 9, "tid": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 10, "dur": 1, "pid": 9, "tid": 1}
        | {"args": {"correlation": 11}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 610, "dur": 1, "pid": 9, "tid": 1}
        | {"args": {"correlation": 12}},
        # host waits: two calls on the launching thread, one on another thread (an asynchronous copy is no wait)
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaEventSynchronize", "ts": 300, "dur": 40, "pid": 9, "tid": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpy", "ts": 620, "dur": 20, "pid": 9, "tid": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 640, "dur": 5, "pid": 9, "tid": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 400, "dur": 90, "pid": 9, "tid": 2},
        # host ops: one around the first launch (counted once), one on the other thread
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 5, "dur": 20, "pid": 9, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 500, "dur": 8, "pid": 9, "tid": 2},
    ]


def test_profile_all_to_all_time_and_its_hidden_share(tmp_path):
    """NCCL and all-to-all kernel time (unions) and the share of the all-to-all time with compute beside it on the
    same GPU, over the trace and per iteration window; every number below changes if memsets, copies, other NCCL
    kernels or another GPU's kernels counted as compute, or if nested kernels counted twice."""
    from sonic_megatron.bench import e2e_profile

    assert e2e_profile.is_all_to_all("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)")
    assert e2e_profile.is_nccl("ncclDevKernel_AllGather_RING_LL(x)") and e2e_profile.is_nccl("void ncclKernel_x<1>()")
    assert not e2e_profile.is_all_to_all("ncclDevKernel_AllGather_RING_LL(x)") and not e2e_profile.is_nccl("gemm")
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _comm_trace_events()}, f)
    prof = e2e_profile.summarize_trace(str(path), iterations=2)
    # NCCL: A 100 + B 100 + all-gather 60 + C with the all-reduce 700-760 60 = 320 us; all-to-all 250 us, 120 hidden
    assert prof["nccl_ms"] == pytest.approx(0.16) and prof["all_to_all_ms"] == pytest.approx(0.125)
    assert prof["all_to_all_hidden_ms"] == pytest.approx(0.06)
    assert prof["all_to_all_hidden_share"] == pytest.approx(0.48)
    assert prof["all_gather_ms"] == pytest.approx(0.03) and prof["host_wait_ms"] == pytest.approx(0.075)
    # host ops less waits: thread 1 5-25, 300-340, 610-611, 620-645 less 60 waiting = 26; thread 2 8 (its 90 wait)
    assert prof["host_ops_ms"] == pytest.approx(0.017)
    # outermost host ops per thread (the launch inside aten::mm is not one), by time per iteration
    top = {o["op"]: (o["ms"], o["calls"]) for o in prof["host_top_ops"]}
    assert top == {
        "cudaStreamSynchronize": (pytest.approx(0.045), 0.5),
        "cudaEventSynchronize": (pytest.approx(0.02), 0.5),
        "aten::mm": (pytest.approx(0.01), 0.5),
        "cudaMemcpy": (pytest.approx(0.01), 0.5),
        "aten::add": (pytest.approx(0.004), 0.5),
        "cudaMemcpyAsync": (pytest.approx(0.0025), 0.5),
        "cudaLaunchKernel": (pytest.approx(0.0005), 0.5),
    }
    assert [o["op"] for o in prof["host_top_ops"]][:2] == ["cudaStreamSynchronize", "cudaEventSynchronize"]
    # busy 50-200, 300-450, 500-560, 650-680, 700-760 = 450 of 710 us
    assert prof["idle_ms"] == pytest.approx(0.13)
    step7, step8 = prof["per_iteration"]
    assert step7 == {
        "step": 7,
        "window_ms": pytest.approx(0.6),  # 50-650
        "idle_ms": pytest.approx(0.24),
        "nccl_ms": pytest.approx(0.26),
        "all_to_all_ms": pytest.approx(0.2),
        "all_to_all_hidden_share": pytest.approx(0.6),
    }
    assert step8 == {
        "step": 8,
        "window_ms": pytest.approx(0.11),  # 650-760
        "idle_ms": pytest.approx(0.02),
        "nccl_ms": pytest.approx(0.06),
        "all_to_all_ms": pytest.approx(0.05),
        "all_to_all_hidden_share": 0.0,
    }
    assert step7["idle_ms"] + step8["idle_ms"] == pytest.approx(2 * prof["idle_ms"]), "the windows tile the trace"
    assert "all-to-all 0.12 ms/iter (48 % of it hidden behind compute)" in e2e_profile.summary_text(prof)
    rows, columns = e2e_profile.table_rows([{"provider": "sonic", "profile": prof}])
    assert columns[3:9] == [
        "host_wait_ms",
        "host_ops_ms",
        "nccl_ms",
        "all_gather_ms",
        "all_to_all_ms",
        "all_to_all_hidden_share",
    ]
    text = e2e_profile.summary_text(prof)
    assert "host waiting for the GPU 0.07 ms/iter (in other ops 0.02), NCCL 0.16 ms/iter (all-gather 0.03)" in text
    assert rows[0]["all_to_all_hidden_share"] == pytest.approx(0.48)
    assert e2e_profile.window_lines("sonic", prof)[1] == (
        "  sonic: step 8: 0.11 ms window, GPU idle 0.02 ms, NCCL 0.06 ms, all-to-all 0.05 ms (0 % of it hidden "
        "behind compute)"
    )


def test_profile_numbers_printed_per_provider(tmp_path, capsys):
    """--profile: the fake launcher writes the trace above; the provider's summary line, the profile table and the
    per-step lines show its all-to-all numbers, and the JSON row holds them."""
    out = tmp_path / "e2e.json"
    args = _args(
        json=out,
        megatron_lm=_fake_megatron_lm(tmp_path),
        nproc=1,
        config="small",
        providers="sonic",
        iters=8,
        warmup=2,
        profile=2,
        timeout=120,
    )
    assert e2e.run(args) == 0
    printed = capsys.readouterr().out
    summary = next(line for line in printed.splitlines() if line.startswith("[1/1] sonic: ok"))
    assert "NCCL 0.16 ms/iter (all-gather 0.03), all-to-all 0.12 ms/iter (48 % of it hidden behind compute)" in summary
    assert "all_to_all_hidden_share" in printed and "  sonic: step 7: 0.60 ms window" in printed
    (row,) = json.loads(out.read_text())["rows"]
    assert row["profile"]["all_to_all_hidden_share"] == pytest.approx(0.48)
    assert [w["step"] for w in row["profile"]["per_iteration"]] == [7, 8]


def test_profile_flags_and_untimed_iterations(tmp_path):
    from sonic_megatron.bench import e2e_profile

    args = _args(megatron_lm=tmp_path, nproc=1, iters=12, warmup=3, profile=2, dry_run=True)
    assert e2e.validate(args, gpu_count=0)[2] == 1
    flags = e2e_profile.megatron_flags(12, 2, "/logs/run-profile/tb")
    assert _flag(flags, "--profile-step-start", 2) == ["10", "--profile-step-end"]
    assert _flag(flags, "--profile-step-end") == "12" and "--use-pytorch-profiler" in flags
    assert e2e_profile.last_timed_iteration(12, 2) == 8  # 9: the profiler's warm-up; 10, 11 profiled; 12 writes
    lines = [_iteration_line(i, 12, 100.0 + (50 if i > 8 else 0), 1.0, 5.0) for i in range(1, 13)]
    s = summarize(parse_log(lines), warmup=3, tokens_per_iteration=1, num_gpus=1, last_timed=8)
    assert s["iterations_timed"] == 5 and s["ms_per_iter_max"] == 100.0
    assert e2e.profile_dir(str(tmp_path / "e2e-qwen3-sonic.log")) == str(tmp_path / "e2e-qwen3-sonic-profile" / "tb")


def test_benchmark_json_records_the_options_set_from_the_environment(monkeypatch):
    """A run switched by SONIC_MEGATRON_* variables (e.g. the weight-gradient pairs off) says so in its JSON."""
    from sonic_megatron.bench.common import environment

    monkeypatch.setenv("SONIC_MEGATRON_PAIR_WEIGHT_GRADS", "0")
    monkeypatch.setenv("UNRELATED_VARIABLE", "1")
    env = environment()["sonic_megatron_env"]
    assert env.get("SONIC_MEGATRON_PAIR_WEIGHT_GRADS") == "0" and "UNRELATED_VARIABLE" not in env
