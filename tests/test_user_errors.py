"""The errors a user meets first: strict SonicConfig fields and SONIC_MEGATRON_* variables, the
experts / expert-parallel divisibility at construction, the demo's argument checks (before any process
starts), a single-process ``bench dispatch``, plain-text command-line help, and ``make setup`` keeping an
installed torch. Everything here runs in this process (no spawned ranks)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sonic_megatron.config import OTHER_ENV_VARS, SonicConfig, known_env_vars

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_sonic_env(monkeypatch):
    """Tests here set the SONIC_MEGATRON_* variables they need; the caller's must not leak in."""
    for name in list(os.environ):
        if name.startswith("SONIC_MEGATRON_"):
            monkeypatch.delenv(name)


# ----------------------------------------------------------------------------------------------------------
# SonicConfig fields
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("redispatch_x_in_backward", "no", "a bool (True or False)"),
        ("pair_weight_grads", 1, "a bool (True or False)"),
        ("ep_slots", "no", "a bool (True or False)"),
        ("rounding_tile", True, "an int >= 1"),
        ("num_chunks", 2.0, "an int in [1, 16]"),
        ("comm_sms", "8", "an int >= 0"),
    ],
)
def test_wrong_field_type_names_field_expected_and_actual(field, value, expected):
    with pytest.raises(TypeError) as info:
        SonicConfig(**{field: value})
    msg = str(info.value)
    assert f"SonicConfig.{field}" in msg and expected in msg and repr(value) in msg, msg
    assert type(value).__name__ in msg, msg


@pytest.mark.parametrize(
    "field, value", [("rounding_tile", 0), ("num_chunks", -1), ("comm_sms", -2), ("backend", 1), ("dispatcher", "x")]
)
def test_wrong_field_value_names_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"SonicConfig\.{field} must be .*got {value!r}"):
        SonicConfig(**{field: value})


def test_valid_fields_are_kept():
    cfg = SonicConfig(
        redispatch_x_in_backward=True,
        pair_weight_grads=False,
        rounding_tile=64,
        num_chunks=2,
        comm_sms=8,
        ep_slots=False,
    )
    kept = (cfg.redispatch_x_in_backward, cfg.pair_weight_grads, cfg.rounding_tile, cfg.num_chunks, cfg.comm_sms)
    assert (*kept, cfg.ep_slots) == (True, False, 64, 2, 8, False)


# ----------------------------------------------------------------------------------------------------------
# SONIC_MEGATRON_* environment
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw, value", [("1", True), ("TRUE", True), ("Yes", True), ("0", False), ("no", False)])
def test_env_bool_words(raw, value):
    cfg = SonicConfig.resolve(None, {"SONIC_MEGATRON_REDISPATCH_X_IN_BACKWARD": raw})
    assert cfg.redispatch_x_in_backward is value


@pytest.mark.parametrize("raw", ["on", "maybe", "2", "y"])
def test_env_bool_rejects_other_words_naming_variable_and_allowed(raw):
    with pytest.raises(ValueError) as info:
        SonicConfig.resolve(None, {"SONIC_MEGATRON_REDISPATCH_X_IN_BACKWARD": raw})
    msg = str(info.value)
    assert "SONIC_MEGATRON_REDISPATCH_X_IN_BACKWARD" in msg and "0/1/false/true/no/yes" in msg and repr(raw) in msg, msg


@pytest.mark.parametrize("raw", ["two", "2.0", "1_000", "true", "²"])
def test_env_int_is_strict(raw):
    with pytest.raises(ValueError, match="SONIC_MEGATRON_NUM_CHUNKS must be an integer"):
        SonicConfig.resolve(None, {"SONIC_MEGATRON_NUM_CHUNKS": raw})


def test_env_value_rejected_by_the_field_names_the_variable():
    with pytest.raises(
        ValueError, match=r"num_chunks must be an int in \[1, 16\], got 0 .*SONIC_MEGATRON_NUM_CHUNKS='0'"
    ):
        SonicConfig.resolve(None, {"SONIC_MEGATRON_NUM_CHUNKS": "0"})
    with pytest.raises(ValueError, match="SONIC_MEGATRON_TOKEN_ROUNDING='sideways'"):
        SonicConfig.resolve(None, {"SONIC_MEGATRON_TOKEN_ROUNDING": "sideways"})


def test_env_overrides_and_empty_means_unset():
    cfg = SonicConfig.resolve(
        SonicConfig(backend="torch", num_chunks=3),
        {"SONIC_MEGATRON_NUM_CHUNKS": "", "SONIC_MEGATRON_COMM_SMS": " 16 ", "SONIC_MEGATRON_DISPATCHER": "sonic"},
    )
    assert (cfg.backend, cfg.num_chunks, cfg.comm_sms) == ("torch", 3, 16)


def test_unknown_env_variable_names_the_known_ones():
    with pytest.raises(ValueError) as info:
        SonicConfig.resolve(None, {"SONIC_MEGATRON_NUM_CHUNK": "2", "PATH": "/bin"})
    msg = str(info.value)
    assert "SONIC_MEGATRON_NUM_CHUNK " in msg and "did you mean SONIC_MEGATRON_NUM_CHUNKS?" in msg, msg
    for name in known_env_vars():
        assert name in msg, (name, msg)


def test_kernel_variables_are_known():
    valid = {"SONIC_MEGATRON_CUTE_TUNING": "autotune", "SONIC_MEGATRON_CUTE_TILES": "dx=P192x128c12"}
    valid["SONIC_MEGATRON_CACHE_DIR"] = ""  # known, but a value is refused (tests/test_kernels_options.py)
    cfg = SonicConfig.resolve(None, {name: valid.get(name, "x") for name in OTHER_ENV_VARS})
    assert cfg == SonicConfig()


def test_kernel_options_variables_are_known():
    from sonic_megatron.kernels.options import ENV_VARS

    assert set(ENV_VARS) <= set(OTHER_ENV_VARS), sorted(set(ENV_VARS) - set(OTHER_ENV_VARS))


def _env_names_in_sources() -> set[str]:
    names = set()
    for folder in ("kernels", "token_dispatch", "sonic_megatron", "examples", "scripts", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == Path(__file__).resolve() or path == ROOT / "sonic_megatron" / "config.py":
                continue  # this file's deliberate typos; the list itself
            names.update(re.findall(r"SONIC_MEGATRON_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    return names


def test_known_env_list_matches_the_sources():
    """Every SONIC_MEGATRON_* name the code mentions is known (else setting it would be rejected), and every
    entry of OTHER_ENV_VARS is still mentioned somewhere (else the list keeps a variable nothing reads)."""
    in_sources = _env_names_in_sources()
    assert not in_sources - set(known_env_vars()), sorted(in_sources - set(known_env_vars()))
    assert not set(OTHER_ENV_VARS) - in_sources, sorted(set(OTHER_ENV_VARS) - in_sources)


# ----------------------------------------------------------------------------------------------------------
# Experts not divisible by the expert-parallel size
# ----------------------------------------------------------------------------------------------------------


def test_experts_not_divisible_by_ep_fail_when_the_layer_is_built():
    """Through Megatron's own build path (the ready layer spec's mlp, as TransformerLayer builds it), before
    MoELayer's bare ``assert`` and before any process group is needed."""
    from megatron.core.transformer.spec_utils import build_module

    from sonic_megatron.spec import sonic_local_layer_spec
    from sonic_megatron.testing import moe_config

    config = moe_config(num_moe_experts=6, expert_model_parallel_size=4)
    with pytest.raises(ValueError, match=r"num_moe_experts=6 is not divisible by expert_model_parallel_size=4"):
        build_module(sonic_local_layer_spec.submodules.mlp, config=config)


def test_expert_ffn_not_divisible_by_the_expert_tensor_parallel_size_fails_naming_both():
    """Expert tensor parallelism splits every expert's ffn dimension evenly. Megatron takes the expert
    tensor-parallel size from --tensor-model-parallel-size when it is not given: the error names that default."""
    from sonic_megatron.config import validate_megatron_config
    from sonic_megatron.testing import moe_config

    config = moe_config()  # moe_ffn_hidden_size 48
    config.tensor_model_parallel_size, config.expert_tensor_parallel_size = 2, None
    assert validate_megatron_config(config, SonicConfig()) == "swiglu"  # 24 per rank
    config.tensor_model_parallel_size = 5
    with pytest.raises(
        ValueError, match=r"moe_ffn_hidden_size=48 .*expert_tensor_parallel_size=5 .*--tensor-model-parallel-size"
    ):
        validate_megatron_config(config, SonicConfig())


# ----------------------------------------------------------------------------------------------------------
# examples/demo.py
# ----------------------------------------------------------------------------------------------------------


def _example(filename: str):
    """A script of examples/ imported as a module (its ``main`` not run)."""
    spec = importlib.util.spec_from_file_location(f"sonic_example_{filename[:-3]}", ROOT / "examples" / filename)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
        (["--backend", "fast"], "argument --backend: invalid choice: 'fast'"),
        (["--backend", "cute"], "backend 'cute' (--backend or SONIC_MEGATRON_BACKEND) cannot run on this machine"),
        (["--nproc", "3"], "--preset tiny has 8 experts, which --ep 3 does not divide"),
        (["--ep", "3"], "--ep must be >= 1 and divide the 2 processes, got 3"),
        (["--rounding-tile", "0"], "--rounding-tile must be >= 1, got 0"),
        (["--spec", "stock", "--token-rounding", "up"], "use them with --spec sonic"),
        # issue 41: --ep 0 ran with EP = 2, --lr -1 failed in every process's optimizer, --json into a missing
        # folder failed only after training
        (["--ep", "0"], "--ep must be >= 1 and divide the 2 processes, got 0"),
        (["--lr", "-1"], "--lr must be a finite number > 0, got -1.0"),
        (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
        (["--json", "/missing/dir/out.json"], "--json '/missing/dir/out.json': its folder /missing/dir does not exist"),
    ],
)
def test_demo_rejects_bad_arguments_before_starting_processes(argv, message, monkeypatch, capsys):
    import torch

    import sonic_megatron.testing

    if argv == ["--backend", "cute"] and torch.cuda.is_available():
        pytest.skip("cute may run on this machine's GPU")

    def no_spawn(*args, **kwargs):
        raise AssertionError("the demo started processes for arguments it should have rejected")

    monkeypatch.setattr(sonic_megatron.testing, "spawn", no_spawn)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as info:
        _example("demo.py").main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_rejects_a_bad_environment_before_starting_processes(monkeypatch, capsys):
    import sonic_megatron.testing

    monkeypatch.setattr(sonic_megatron.testing, "spawn", lambda *a, **k: pytest.fail("processes started"))
    monkeypatch.setenv("SONIC_MEGATRON_TOKEN_ROUNDIN", "up")
    with pytest.raises(SystemExit):
        _example("demo.py").main([])
    assert "did you mean SONIC_MEGATRON_TOKEN_ROUNDING?" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--save", "ckpt"], ["--load", "ckpt"]])
def test_trainer_refuses_checkpoints_of_the_distributed_optimizer_over_torch_adam(flags, monkeypatch, capsys):
    """Megatron's distributed optimizer over torch's Adam (no Apex, no Transformer Engine) cannot reload its own
    checkpoints: the example trainer says so before anything starts, and only then (GPU machines)."""
    trainer = _example("pretrain_gpt_sonic.py")
    monkeypatch.setattr(trainer, "_distributed_optimizer_over_torch_adam", lambda: True)
    with pytest.raises(SystemExit) as info:
        trainer.parse_args(["--use-distributed-optimizer", *flags])
    assert info.value.code == 2
    needs = "--use-distributed-optimizer with --save / --load needs Apex or Transformer Engine"
    assert needs in capsys.readouterr().err
    assert trainer.parse_args(["--use-distributed-optimizer"]).use_distributed_optimizer  # no checkpoints: fine
    monkeypatch.setattr(trainer, "_distributed_optimizer_over_torch_adam", lambda: False)
    assert trainer.parse_args(["--use-distributed-optimizer", *flags]).use_distributed_optimizer


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------


def test_bench_dispatch_refuses_one_process(monkeypatch, capsys):
    import torch.distributed as dist

    from sonic_megatron.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["bench", "dispatch", "--device", "cpu", "--tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert "needs torchrun with >= 2 processes (got 1)" in err, err
    assert not dist.is_initialized(), "refused before any process group was made"


def _all_parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_parsers(sub)


MARKUP = re.compile(r"``|:[a-z]+:`|`")


def test_every_help_is_plain_text():
    from sonic_megatron.cli import build_parser

    parsers = list(_all_parsers(build_parser()))
    assert {p.prog.split()[-1] for p in parsers} >= {"sonic_megatron", "env", "experts", "dispatch", "layer"}
    for p in parsers:
        text = p.format_help() + p.format_usage()
        assert not MARKUP.search(text), (p.prog, MARKUP.search(text).group(), text)


def test_subcommands_registered_later_get_plain_help_too():
    from sonic_megatron.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    p = sub.add_parser("extra", description="runs :func:`sonic_megatron.kernels.moe_experts` on ``x [T, D]``")
    p.add_argument("--mode", help="one of `a`, :class:`~pkg.mod.Thing`")
    text = p.format_help()
    assert "runs sonic_megatron.kernels.moe_experts on x [T, D]" in text and "one of a, Thing" in text, text


def test_module_help_runs_plain(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "sonic_megatron", "bench", "dispatch", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0 and "--tokens" in proc.stdout, proc.stderr[-2000:]
    assert not MARKUP.search(proc.stdout), proc.stdout


# ----------------------------------------------------------------------------------------------------------
# make setup
# ----------------------------------------------------------------------------------------------------------


FAKE_PYTHON = """#!/bin/sh
# Stands in for python in `make setup`: records each call; `-c "import torch"` fails unless HAVE_TORCH=1.
echo "$@" >> "$CALLS"
if [ "$1" = "-c" ]; then [ "$HAVE_TORCH" = 1 ]; exit $?; fi
exit 0
"""


@pytest.mark.parametrize("have_torch", [True, False])
def test_make_setup_keeps_an_installed_torch(have_torch, tmp_path):
    if not Path("/usr/bin/make").exists() and not any(
        (Path(d) / "make").exists() for d in os.environ.get("PATH", "").split(os.pathsep)
    ):
        pytest.skip("make is not installed")
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    calls = tmp_path / "calls.txt"
    env = dict(os.environ, CALLS=str(calls), HAVE_TORCH="1" if have_torch else "0")
    proc = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "setup", f"PYTHON={fake}"], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = calls.read_text().splitlines()
    torch_installs = [line for line in lines if "torch==2.13.0" in line]
    assert lines[0] == "-c import torch", lines
    assert torch_installs == ([] if have_torch else ["-m pip install -q torch==2.13.0"]), lines
    assert lines[-1] == "-m pip install -q -e .[test]", lines


def test_token_rounding_warns_below_two_tiles_per_expert():
    """Rounding with few routed pairs per expert is named with its numbers and what to use instead."""
    from sonic_megatron.dispatcher import FEW_TILES_PER_EXPERT, few_tiles_message

    # 4096 tokens x top-8 / 256 experts = 128 pairs = 1 tile of 128
    msg = few_tiles_message(4096, 8, 1, 256, "nearest", 128)
    assert msg is not None and "128 routed pairs per expert" in msg and "token_rounding='none'" in msg
    # the sparse end-to-end config: 8192 x 8 / 256 = 256 pairs = 2 tiles; under EP the count is over the group
    assert few_tiles_message(8192, 8, 1, 256, "nearest", 128) is None
    assert few_tiles_message(4096, 8, 2, 256, "nearest", 128) is None
    assert few_tiles_message(4095, 8, 2, 256, "up", 128) is not None
    assert FEW_TILES_PER_EXPERT * 128 == 256


# ----------------------------------------------------------------------------------------------------------
# Bad input probed as a new user would (issue 41): refused where it is given, naming what it takes
# ----------------------------------------------------------------------------------------------------------


def test_num_chunks_bound_is_token_dispatchs_for_the_field_and_the_variable():
    """SonicConfig.num_chunks takes token_dispatch's bound (MAX_CHUNKS, the counts exchange's size) when it is
    built, not at the first forward; the variable is named; EPOptions states the same rule."""
    from sonic_megatron.token_dispatch import EPInputError, EPOptions
    from sonic_megatron.token_dispatch.validation import MAX_CHUNKS

    assert SonicConfig(num_chunks=MAX_CHUNKS).num_chunks == MAX_CHUNKS
    rule = f"num_chunks must be an int in [1, {MAX_CHUNKS}]"
    with pytest.raises(ValueError, match=re.escape(f"SonicConfig.{rule}, got 1000000000")):
        SonicConfig(num_chunks=10**9)
    with pytest.raises(ValueError) as info:
        SonicConfig.resolve(None, {"SONIC_MEGATRON_NUM_CHUNKS": "100000"})
    msg = str(info.value)
    assert f"{rule}, got 100000" in msg and "SONIC_MEGATRON_NUM_CHUNKS='100000'" in msg, msg
    with pytest.raises(EPInputError, match=re.escape(f"EPOptions: {rule}, got {MAX_CHUNKS + 1}")):
        EPOptions(num_chunks=MAX_CHUNKS + 1)


def test_token_rounding_and_sonic_config_share_one_rule():
    """The same modes (RoundingMode; SonicConfig adds 'none' for off, a TokenRounding is never off: rounding=None)
    and the same tile check (an int >= 1, not a bool: TypeError) for both."""
    from sonic_megatron.token_dispatch.rounding import ROUNDING_MODES, RoundingMode, TokenRounding

    for mode in RoundingMode:
        assert TokenRounding(mode.value, 8).mode == SonicConfig(token_rounding=mode.value).token_rounding
    with pytest.raises(TypeError, match=re.escape("TokenRounding.tile must be an int >= 1, got True (bool)")):
        TokenRounding("nearest", True)
    with pytest.raises(TypeError, match=re.escape("SonicConfig.rounding_tile must be an int >= 1, got True (bool)")):
        SonicConfig(rounding_tile=True)
    with pytest.raises(TypeError, match=re.escape("TokenRounding.tile must be an int >= 1, got 8.0 (float)")):
        TokenRounding("up", 8.0)
    with pytest.raises(ValueError, match=re.escape("TokenRounding.tile must be an int >= 1, got 0")):
        TokenRounding("up", 0)
    with pytest.raises(ValueError) as info:
        TokenRounding("none")
    msg = str(info.value)
    assert f"TokenRounding.mode must be one of {ROUNDING_MODES}, got 'none'" in msg and "rounding=None" in msg, msg
    assert SonicConfig(token_rounding="none").rounding_enabled is False
    with pytest.raises(ValueError, match=re.escape(f"one of {('none', *ROUNDING_MODES)}, got 'sideways'")):
        SonicConfig(token_rounding="sideways")


@pytest.mark.parametrize(
    "name, value, message, shown",
    [
        (
            "SONIC_MEGATRON_CUTE_TUNING",
            "fast",
            "SONIC_MEGATRON_CUTE_TUNING must be one of ('heuristic', 'autotune', ",
            "fast",
        ),
        (
            "SONIC_MEGATRON_CUTE_TILES",
            "dx=Q128x128",
            "SONIC_MEGATRON_CUTE_TILES: a tile must look like C128x256c21",
            "Q128x128",
        ),
        (
            "SONIC_MEGATRON_CUTE_TILES",
            "fc1=C128x128",
            "SONIC_MEGATRON_CUTE_TILES: GEMM name must be one of ('up', ",
            "fc1",
        ),
    ],
)
def test_bad_kernel_variables_fail_on_any_machine(name, value, message, shown, monkeypatch):
    """Without the Hopper extra (no QuACK, as on CI) a bad cute tuning variable was never read: now the layer's
    options (SonicConfig.resolve, as the demo and a layer build call it) and the first backend choice of
    moe_experts, whatever the backend, refuse it naming the variable, the allowed and the given value."""
    import torch
    from sonic_megatron.kernels import TopKRouting, moe_experts, options

    with pytest.raises(ValueError, match=re.escape(message)) as info:
        SonicConfig.resolve(None, {name: value})
    assert f"got {shown!r}" in str(info.value), str(info.value)
    monkeypatch.setattr(options, "_resolved", None)  # as in a new process: not resolved yet
    monkeypatch.setenv(name, value)
    x, w1, w2 = torch.randn(3, 8), torch.randn(4, 8, 8), torch.randn(4, 8, 4)
    routing = TopKRouting(torch.rand(3, 2), torch.tensor([[0, 1], [2, 3], [1, 0]]))
    with pytest.raises(ValueError, match=re.escape(message)):
        moe_experts(x, routing, w1, w2, backend="torch")


def _duplicate_routings():
    import torch
    from sonic_megatron.kernels import FlatRouting, TopKRouting

    topk = TopKRouting(torch.rand(3, 2, dtype=torch.float64), torch.tensor([[1, 1], [0, 2], [3, 0]]))
    flat = FlatRouting(torch.tensor([0, 1, 1, 2]), torch.tensor([0, 3, 3, 1]), torch.rand(4, dtype=torch.float64), 3)
    return {
        "topk": (topk, "must name K = 2 different experts", "twice"),
        "flat": (flat, "the pairs of token 1 (routing.token_idx_R, routing.expert_idx_R) must be unique", "expert 3"),
    }


@pytest.mark.parametrize("kind", ["topk", "flat"])
@pytest.mark.parametrize("where", ["moe_experts", "expert_parallel"])
def test_a_token_naming_an_expert_twice_is_refused_naming_the_row(kind, where):
    """indices [[1, 1], ...] (or a flat routing's pair (1, 3) twice) were computed as two pairs: refused by
    moe_experts' index checks and by the expert-parallel header check (no rounding needed), naming the row."""
    import torch
    from sonic_megatron.kernels import moe_experts
    from sonic_megatron.token_dispatch import expert_parallel_experts

    routing, rule, got = _duplicate_routings()[kind]
    x = torch.randn(3, 8, dtype=torch.float64)
    w1, w2 = torch.randn(4, 8, 8, dtype=torch.float64), torch.randn(4, 8, 4, dtype=torch.float64)
    with pytest.raises(ValueError) as info:
        if where == "moe_experts":
            moe_experts(x, routing, w1, w2, backend="torch")
        else:
            expert_parallel_experts(x, routing, w1, w2, num_experts=4, backend="torch")
    msg = str(info.value)
    assert rule in msg and got in msg, msg
    if kind == "topk" and where == "moe_experts":
        assert "row 0" in msg and "got [1, 1]" in msg, msg


@pytest.mark.parametrize(
    "num_tokens, error, shown",
    [(6.0, TypeError, "6.0 (float)"), (True, TypeError, "True (bool)"), (-1, ValueError, "-1")],
)
def test_flat_routing_num_tokens_is_an_int_at_least_zero(num_tokens, error, shown):
    import torch
    from sonic_megatron.kernels import FlatRouting

    with pytest.raises(
        error, match=re.escape(f"FlatRouting.num_tokens must be an int >= 0 (T, x's row count), got {shown}")
    ):
        FlatRouting(torch.tensor([0]), torch.tensor([0]), torch.rand(1), num_tokens)
    assert FlatRouting(torch.tensor([0]), torch.tensor([0]), torch.rand(1), 6).num_tokens == 6


@pytest.mark.parametrize("argument", ["x", "w1", "w2", "scores_TK", "indices_TK"])
def test_a_list_for_a_tensor_argument_is_a_type_error_naming_it(argument):
    """Not ``AttributeError: 'list' object has no attribute 'dim'``."""
    import torch
    from sonic_megatron.kernels import TopKRouting, moe_experts

    args = dict(
        x=torch.randn(3, 8),
        w1=torch.randn(4, 8, 8),
        w2=torch.randn(4, 8, 4),
        scores_TK=torch.rand(3, 2),
        indices_TK=torch.tensor([[0, 1], [2, 3], [1, 0]]),
    )
    args[argument] = args[argument].tolist()
    expected = {
        "x": "moe_experts: x must be a 2-D tensor [T, D] (a torch.Tensor), got list",
        "w1": "moe_experts: w1 must be a 3-D tensor [E, G, D] (a torch.Tensor), got list",
        "w2": "moe_experts: w2 must be a 3-D tensor [E, D, F] (a torch.Tensor), got list",
        "scores_TK": "TopKRouting.scores_TK must be a torch.Tensor, got list",
        "indices_TK": "TopKRouting.indices_TK must be a torch.Tensor, got list",
    }[argument]
    with pytest.raises(TypeError, match=re.escape(expected)):
        moe_experts(
            args["x"], TopKRouting(args["scores_TK"], args["indices_TK"]), args["w1"], args["w2"], backend="torch"
        )
