"""Command line: ``python -m sonic_megatron <command> ...``.

    env                         what this machine can run (backends, versions, GPUs)
    bench experts|dispatch|layer|train|e2e ...   benchmarks: print a table, write JSON (--json PATH)

Each benchmark lives in ``sonic_megatron/bench/<name>.py`` with ``add_arguments(parser)`` and ``run(args)``.
Help is plain text: ``PlainTextParser`` (which every subcommand's parser inherits) drops the reST markup that
help strings taken from docstrings carry.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys

# :role:`target` (:role:`~a.b.c` shows as c, as Sphinx does), ``literal``, `quoted`.
_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`(~(?:[\w.]*\.)?)?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")
_QUOTED = re.compile(r"`([^`]+)`")


def plain_text(text: str) -> str:
    """``text`` without reST roles, double-backtick literals and backtick quotes (their contents stay)."""
    return _QUOTED.sub(r"\1", _LITERAL.sub(r"\1", _ROLE.sub(r"\2", text)))


class PlainTextParser(argparse.ArgumentParser):
    """An ArgumentParser whose help and usage are plain text. ``add_subparsers`` builds subcommand parsers
    with the parent's class, so subcommands registered later are plain text too."""

    def format_help(self) -> str:
        return plain_text(super().format_help())

    def format_usage(self) -> str:
        return plain_text(super().format_usage())


BENCHMARKS = {
    "experts": "one GPU's experts: ours vs sonic-moe, torch._grouped_mm MoE, cuBLAS bmm bound",
    "dispatch": "expert-parallel dispatch/combine: bytes on the wire and a2a GB/s vs Megatron's alltoall",
    "layer": "MoE layer fwd+bwd under EP: ours vs Megatron alltoall + torch._grouped_mm experts",
    "breakdown": "the Megatron MoE layer vs the bare kernels on one GPU, per phase, and vs a grouped-GEMM MoELayer",
    "train": "GPT-MoE training tokens/s/GPU and peak memory: plugin spec vs grouped-GEMM baseline (and stock)",
    "e2e": "Megatron-LM's pretrain_gpt.py per provider (plugin, grouped-GEMM baseline, ...): ms/iter, memory, loss",
}


def build_parser() -> argparse.ArgumentParser:
    parser = PlainTextParser(
        prog="python -m sonic_megatron", description="sonic-megatron's command line: environment report, benchmarks"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="print what this machine can run")
    env.set_defaults(func=_run_env)
    bench = sub.add_parser("bench", help="benchmarks (table + JSON)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, help_text in BENCHMARKS.items():
        p = bench_sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--json", default=None, help="write the results as JSON to this path")
        module = _bench_module(name)
        if module is not None:
            module.add_arguments(p)
            p.set_defaults(func=module.run)
        else:
            p.set_defaults(func=lambda args, n=name: _missing(n))
    return parser


def _bench_module(name: str):
    try:
        return importlib.import_module(f"sonic_megatron.bench.{name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"sonic_megatron.bench.{name}":
            return None
        raise


def _missing(name: str) -> int:
    print(f"benchmark {name!r} is not available in this build")
    return 2


def _run_env(args: argparse.Namespace) -> int:
    from .env import report

    return report()


# Options whose value is itself a command line: argparse takes a lone flag after them ("--pretrain-args
# --use-distributed-optimizer") for an option of ours and stops, so the value is glued on ("--pretrain-args=...").
COMMAND_LINE_OPTIONS = ("--pretrain-args",)


def glue_command_line_values(argv: list[str]) -> list[str]:
    """``argv`` with each ``COMMAND_LINE_OPTIONS`` option and its next word joined as ``option=value``."""
    out: list[str] = []
    words = iter(argv)
    for word in words:
        value = next(words, None) if word in COMMAND_LINE_OPTIONS else None
        out.append(word if value is None else f"{word}={value}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(glue_command_line_values(sys.argv[1:] if argv is None else argv))
    return int(args.func(args) or 0)
