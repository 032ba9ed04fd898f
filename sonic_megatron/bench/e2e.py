"""``python -m sonic_megatron bench e2e``: Megatron-LM's own ``pretrain_gpt.py`` per provider, end to end.

Each provider is one ``torchrun ... pretrain_gpt.py`` run (same flags, seed and data: Megatron's mock data, or
with ``--data markov`` a synthetic corpus that no model memorises, ``markov_data.py``), one after another
on this machine; the iteration log gives ms/iteration (median of the iterations after ``--warmup``, with the
min/max spread), tokens/s/GPU, Megatron's TFLOP/s/GPU, peak allocated memory (Megatron's memory report of
rank 0, after iterations 1, 2 and the last one) and the loss curve; with ``--eval-iters N`` (markov data) also
the loss on held-out walks after training, Megatron's validation, where the plugin's layer routes plain top-K
in every provider: the quality of the trained model, the measure SonicMoE's paper compares token rounding by,
apart from the training loss of the rounded forward passes. Providers:

    sonic           --spec sonic_megatron.spec sonic_block_spec (SONIC_MEGATRON_TOKEN_ROUNDING=none)
    sonic-rounding  the same with SONIC_MEGATRON_TOKEN_ROUNDING=nearest
    sonic-rounding-up, sonic-rounding-down  the same with the other rounding modes
    grouped         --spec sonic_megatron.baseline grouped_block_spec: Megatron's MoE layer and alltoall
                    dispatcher, experts on torch._grouped_mm (TEGroupedMLP with Transformer Engine): the baseline
    sequential      no --spec: Megatron's default local spec (SequentialMLP experts)

Needs megatron-core >= 0.19 (``megatron.training`` in its wheel), CUDA, and the Megatron-LM files of
``python -m sonic_megatron.bench.megatron_lm`` in ``--megatron-lm`` (default ``.mlm``). Every provider's exact
command is printed before it starts and its whole output goes to a log file next to ``--json``; a provider
that fails or passes ``--timeout`` is reported with the tail of its log and the others still run. With
``--seeds N`` every provider runs at N seeds and each provider's per-seed ratios to the first one are summarised.
``--dry-run`` prints every provider's command on any machine: without GPUs --nproc defaults to --ep, and the
launcher path is printed whether or not its files are there yet.

Expert-parallel runs: ``--ep N`` carves the expert-parallel groups out of the data-parallel ranks (no tensor or
pipeline parallelism here, so every process is a data-parallel rank), ``--microbatches N`` sets the global batch to
the config's micro-batch x the processes x N (gradient accumulation over N micro-batches per rank), and
``--overlap-ep-comm`` runs Megatron's 1F1B expert-parallel overlap (``--overlap-moe-expert-parallel-comm``: one
micro-batch's forward beside another's backward, each one's all-to-all behind the other's compute) in every
provider, with the CUDA connections it asks for. tokens/s counts the global batch that Megatron's iteration lines
print (the flags' last ``--global-batch-size`` where they print none), so ``--pretrain-args`` that change it count
too; ``--profile N`` adds each provider's NCCL and all-to-all kernel time and the share of the all-to-all time
that compute kernels hide.

This file holds the configs, providers, arguments and flags and runs them; ``e2e_launch.py`` runs one launcher,
``e2e_log.py`` reads its log, ``e2e_compare.py`` compares the rows, ``e2e_profile.py`` reads a profile and
``e2e_frames.py`` splits one with Python frames by layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import time

from ..config import ROUNDING_MODES
from . import e2e_frames, e2e_profile
from .e2e_compare import add_ratios, seed_ratios
from .e2e_launch import log_excerpt, progress_printer, run_logged, shell_line, torchrun_command
from .e2e_log import logged_global_batch, parse_log, summarize
from .markov_data import entropy_rate
from .megatron_lm import install_dataset_sources

BASELINE = "grouped"
DEFAULT_PROVIDERS = "sonic,sonic-rounding,grouped"
DATA_CHOICES = ("mock", "markov")
VOCAB = 32000
MARKOV_SUCCESSORS = 4
TRAIN_ONLY_SPLIT = "100,0,0"  # --split: every document trains
# Megatron's 1F1B expert-parallel overlap. Its MoE guide pairs it with --delay-wgrad-compute, which Megatron accepts
# with --transformer-impl transformer_engine only; this bench runs the local implementation, so the overlap
# switch leaves it out (and the experts' weight gradients run inside each backward).
OVERLAP_EP_COMM_FLAGS = ("--overlap-moe-expert-parallel-comm",)
# CUDA_DEVICE_MAX_CONNECTIONS: one hardware queue launches kernels in issue order across streams (what Megatron asks
# for by default); the overlap needs several, or the all-to-all stream's kernels queue behind the compute
# stream's (Megatron's MoE guide: "> 1"; its argument check: "1 or 32"; examples/train_*.sh here use 32).
DEVICE_MAX_CONNECTIONS = "1"
OVERLAP_DEVICE_MAX_CONNECTIONS = "32"


@dataclasses.dataclass(frozen=True)
class Shape:
    """A GPT-MoE shape; every layer is a MoE layer."""

    layers: int
    hidden: int
    heads: int
    seq: int
    micro_batch: int
    global_batch: int
    experts: int
    topk: int
    moe_ffn: int


CONFIGS = {
    # Qwen3-30B-A3B's MoE shape with 4 of its 48 layers.
    "qwen3": Shape(
        layers=4, hidden=2048, heads=16, seq=2048, micro_batch=4, global_batch=16, experts=128, topk=8, moe_ffn=768
    ),
    # The same with twice the experts at 2/3 of the width: sparser, smaller GEMMs per expert.
    "sparse": Shape(
        layers=4, hidden=2048, heads=16, seq=2048, micro_batch=4, global_batch=16, experts=256, topk=8, moe_ffn=512
    ),
    # A quick launcher check (tens of seconds): 2 layers, 16 experts top-4.
    "small": Shape(
        layers=2, hidden=1024, heads=8, seq=1024, micro_batch=4, global_batch=16, experts=16, topk=4, moe_ffn=512
    ),
}


@dataclasses.dataclass(frozen=True)
class Provider:
    """How a provider differs from the others: its ``--spec`` (module, function) or None, and its env."""

    spec: tuple[str, str] | None
    env: dict[str, str]


def _plugin(token_rounding: str) -> Provider:
    """The plugin's spec with ``token_rounding`` (a ``SonicConfig`` mode) set through its environment override."""
    return Provider(("sonic_megatron.spec", "sonic_block_spec"), {"SONIC_MEGATRON_TOKEN_ROUNDING": token_rounding})


PROVIDERS = {
    "sonic": _plugin("none"),
    "sonic-rounding": _plugin("nearest"),
    **{f"sonic-rounding-{mode}": _plugin(mode) for mode in ROUNDING_MODES if mode not in ("none", "nearest")},
    "grouped": Provider(("sonic_megatron.baseline", "grouped_block_spec"), {}),
    "sequential": Provider(None, {}),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="qwen3", help=f"model shape: {', '.join(CONFIGS)}")
    parser.add_argument(
        "--providers", default=DEFAULT_PROVIDERS, help=f"comma-separated, run in order: {', '.join(PROVIDERS)}"
    )
    parser.add_argument("--megatron-lm", default=".mlm", help="directory holding Megatron-LM's pretrain_gpt.py")
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="GPUs (processes) per run (default: all GPUs; a --dry-run where none is visible: --ep)",
    )
    parser.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel size (Megatron carves it out of the data-parallel ranks, here all --nproc of them)",
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        default=None,
        metavar="N",
        help="micro-batches per data-parallel rank per iteration: the global batch becomes the config's micro-batch "
        "x --nproc (the data-parallel size) x N and --global-batch-size follows it (default: the config's global "
        "batch)",
    )
    parser.add_argument(
        "--overlap-ep-comm",
        action="store_true",
        help="add Megatron's --overlap-moe-expert-parallel-comm (1F1B expert-parallel overlap: one micro-batch's "
        "all-to-all behind another's compute; needs --ep >= 2, overlaps only with 2 or more micro-batches per rank) "
        f"to every provider, with CUDA_DEVICE_MAX_CONNECTIONS={OVERLAP_DEVICE_MAX_CONNECTIONS} instead of "
        f"{DEVICE_MAX_CONNECTIONS}",
    )
    parser.add_argument("--iters", type=int, default=30, help="training iterations per provider")
    parser.add_argument("--warmup", type=int, default=5, help="first iterations left out of the statistics")
    parser.add_argument("--seed", type=int, default=1234, help="Megatron's --seed (the same for every provider)")
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        metavar="N",
        help="run every provider at the seeds --seed .. --seed + N - 1 (each seed its own initialisation and, with "
        "--data markov, its own chain; a seed's providers run back to back) and report each provider's per-seed "
        "ratios to the first provider: training and validation loss (mean, standard deviation) and speed "
        "(mean, min-max). One 200-iteration run does not resolve a 1 %% loss difference (default 1)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per provider run")
    parser.add_argument("--log-dir", default=None, help="per-provider logs (default: next to --json, else out/)")
    parser.add_argument(
        "--data",
        choices=DATA_CHOICES,
        default="mock",
        help="mock: Megatron's --mock-data (counting sequences, memorised: loss -> 0); markov: a random Markov "
        "chain's walks written as an indexed dataset under --log-dir (a loss that still compares after hundreds "
        "of iterations)",
    )
    parser.add_argument(
        "--eval-iters",
        type=int,
        default=0,
        metavar="N",
        help="after training, Megatron's validation over N global batches of held-out markov walks (written "
        "with the training ones; needs --data markov); reported as eval_loss (default 0: off)",
    )
    parser.add_argument("--pretrain-args", default="", help="extra pretrain_gpt.py flags for every provider")
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="profile each provider's last N iterations (Megatron's --profile --use-pytorch-profiler) and report "
        "GPU busy / idle time, NCCL and all-to-all kernel time and the share of the all-to-all time hidden behind "
        "compute kernels (also per iteration window), time per kernel family and idle time per launching host op "
        "and thread (forward and optimizer, or backward), per iteration; those iterations, the profiler's warm-up "
        "one and the last one are not timed (default 0: off)",
    )
    parser.add_argument(
        "--profile-stacks",
        action="store_true",
        help="with --profile: record the Python frames around every op (Megatron's "
        "--pytorch-profiler-collect-callstack; it slows the profiled iterations' hosts) and report each provider's "
        "kernel time by layer (the MoE layers' and the rest's, NCCL apart) and the MoE frames with the most host time",
    )
    parser.add_argument("--dry-run", action="store_true", help="print each provider's command and stop")
    parser.add_argument(
        "--print-flags",
        action="store_true",
        help="print the shared pretrain_gpt.py flags of --config/--iters/--ep/--microbatches/--overlap-ep-comm/"
        "--seed, one per line, and stop",
    )


# ----------------------------------------------------------------------------------------------------------
# Arguments and commands
# ----------------------------------------------------------------------------------------------------------


def parse_providers(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"--providers: expected at least one of {', '.join(PROVIDERS)}, got {text!r}")
    for n in names:
        if n not in PROVIDERS:
            raise ValueError(f"--providers: unknown provider {n!r}; allowed: {', '.join(PROVIDERS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--providers: each provider once, got {text!r}")
    return names


def validate(args: argparse.Namespace, *, gpu_count: int) -> tuple[Shape, list[str], int]:
    """(shape, providers, nproc) for valid arguments; ValueError naming the flag otherwise. Without --nproc,
    nproc is ``gpu_count``; a dry run on a machine without GPUs takes --ep (the fewest processes that hold one
    expert-parallel group), so that it prints the commands anywhere."""
    if args.config not in CONFIGS:
        raise ValueError(f"--config: unknown config {args.config!r}; allowed: {', '.join(CONFIGS)}")
    shape = CONFIGS[args.config]
    providers = parse_providers(args.providers)
    if args.nproc is not None:
        nproc = args.nproc
    elif gpu_count < 1 and args.dry_run:
        nproc = max(args.ep, 1)
    else:
        nproc = gpu_count
    if nproc < 1:
        raise ValueError(
            f"--nproc: must be >= 1, got {nproc}"
            + (" (no CUDA device visible; pretrain_gpt.py needs GPUs)" if args.nproc is None else "")
        )
    if args.ep < 1 or nproc % args.ep or shape.experts % args.ep:
        raise ValueError(
            f"--ep: must divide --nproc ({nproc}) and the {args.config} experts ({shape.experts}), got {args.ep}"
        )
    if args.overlap_ep_comm and args.ep < 2:
        raise ValueError(
            f"--overlap-ep-comm: needs --ep >= 2 (Megatron overlaps the expert-parallel all-to-all, which one rank "
            f"per expert group does not have), got --ep {args.ep}"
        )
    if args.microbatches is not None and args.microbatches < 1:
        raise ValueError(
            f"--microbatches: must be >= 1 (micro-batches per data-parallel rank per iteration) or left out (the "
            f"{args.config} global batch {shape.global_batch}), got --microbatches {args.microbatches}"
        )
    if args.microbatches is None and shape.global_batch % (shape.micro_batch * nproc):
        raise ValueError(
            f"--nproc: {args.config}'s global batch {shape.global_batch} must be a multiple of micro-batch "
            f"{shape.micro_batch} x data-parallel size (= --nproc), got --nproc {nproc} (or set --microbatches)"
        )
    if args.iters < 1 or not 0 <= args.warmup < args.iters:
        raise ValueError(f"--warmup: must be in [0, --iters), got --warmup {args.warmup} --iters {args.iters}")
    if args.eval_iters < 0 or (args.eval_iters and args.data != "markov"):
        raise ValueError(
            f"--eval-iters: must be 0 (off) or N >= 1 with --data markov (held-out walks; mock data is memorised), "
            f"got --eval-iters {args.eval_iters} --data {args.data}"
        )
    if args.timeout <= 0:
        raise ValueError(f"--timeout: must be > 0 seconds, got {args.timeout}")
    if args.seeds < 1:
        raise ValueError(f"--seeds: must be >= 1 (the number of seeds from --seed on), got --seeds {args.seeds}")
    if args.profile < 0 or (args.profile and e2e_profile.last_timed_iteration(args.iters, args.profile) <= args.warmup):
        raise ValueError(
            f"--profile: must be 0 (off) or N >= 1 with --iters > --warmup + N + 2 (the N profiled iterations, the "
            f"profiler's warm-up one and the last one are not timed), got --profile {args.profile} "
            f"--iters {args.iters} --warmup {args.warmup}"
        )
    if args.profile_stacks and not args.profile:
        raise ValueError("--profile-stacks: needs --profile N (the profiled iterations whose frames it records)")
    return shape, providers, nproc


def global_batch_size(shape: Shape, nproc: int, microbatches: int | None) -> int:
    """The run's global batch: ``microbatches`` micro-batches on each of the ``nproc`` data-parallel ranks (every
    process: no tensor or pipeline parallelism, and expert parallelism is carved out of data parallelism), or the
    config's global batch when ``microbatches`` is None."""
    return shape.global_batch if microbatches is None else shape.micro_batch * nproc * microbatches


def microbatches_per_rank(shape: Shape, nproc: int, global_batch: int) -> int:
    return global_batch // (shape.micro_batch * nproc)


def last_flag_value(cmd: list[str], flag: str) -> str | None:
    """The value of the last ``flag`` in ``cmd`` (``flag value`` or ``flag=value``): the one argparse keeps."""
    value = None
    for i, arg in enumerate(cmd):
        if arg == flag and i + 1 < len(cmd):
            value = cmd[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def pretrain_flags(
    shape: Shape,
    *,
    iters: int,
    ep: int,
    seed: int,
    data_path: str | None = None,
    split: str = TRAIN_ONLY_SPLIT,
    eval_iters: int = 0,
    global_batch: int | None = None,
    overlap_ep_comm: bool = False,
) -> list[str]:
    """pretrain_gpt.py flags shared by every provider: the shape, bf16 SwiGLU without biases, the alltoall
    dispatcher with aux loss and an fp32 router, mock data (or the indexed dataset at ``data_path``, parts by
    ``split``), the local transformer implementation (no Transformer Engine needed), fused kernels off (they
    need apex/TE), a log line per iteration with throughput, a memory report at the last iteration too,
    ``eval_iters`` batches of validation after training only (none during it), ``global_batch`` samples per
    iteration (default: the shape's) and, with ``overlap_ep_comm``, Megatron's 1F1B expert-parallel overlap."""
    data = ["--mock-data"] if data_path is None else ["--data-path", data_path, "--split", split]
    global_batch = shape.global_batch if global_batch is None else global_batch
    return [
        *("--num-layers", str(shape.layers), "--hidden-size", str(shape.hidden)),
        *("--num-attention-heads", str(shape.heads), "--seq-length", str(shape.seq)),
        *("--max-position-embeddings", str(shape.seq)),
        *("--micro-batch-size", str(shape.micro_batch), "--global-batch-size", str(global_batch)),
        *("--train-iters", str(iters), "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine"),
        *("--lr-warmup-iters", "2", "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", str(seed)),
        *data,
        *("--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB)),
        *("--num-experts", str(shape.experts), "--moe-router-topk", str(shape.topk)),
        *("--moe-ffn-hidden-size", str(shape.moe_ffn), "--expert-model-parallel-size", str(ep)),
        *("--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "aux_loss"),
        *("--moe-aux-loss-coeff", "1e-2", "--moe-router-dtype", "fp32"),
        *("--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type", "rope"),
        *("--untie-embeddings-and-output-weights", "--bf16", "--transformer-impl", "local"),
        *("--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion"),
        *("--no-persist-layer-norm", "--no-rope-fusion"),
        *("--log-interval", "1", "--log-throughput", "--log-memory-interval", str(iters)),
        *("--eval-iters", str(eval_iters), "--eval-interval", "1000000"),
        *(OVERLAP_EP_COMM_FLAGS if overlap_ep_comm else ()),
    ]


def markov_data_sizes(shape: Shape, args: argparse.Namespace, seed: int, global_batch: int | None = None) -> dict:
    """The markov dataset for a run at ``seed`` with ``global_batch`` samples per iteration (default: the shape's):
    one document per sample, enough for every iteration once (no epoch repeats), at least 1024 documents; and as
    many held-out documents as ``--eval-iters`` batches take."""
    batch = shape.global_batch if global_batch is None else global_batch
    docs = max(1024, batch * args.iters + batch)
    valid_docs = batch * (args.eval_iters + 1) if args.eval_iters else 0
    return dict(
        vocab=VOCAB,
        successors=MARKOV_SUCCESSORS,
        docs=docs,
        doc_len=shape.seq + 1,
        seed=seed,
        valid_docs=valid_docs,
    )


def markov_data_path(log_dir: str, sizes: dict) -> str:
    """The ``--data-path`` prefix under ``log_dir`` of the dataset of ``markov_data_sizes``; its name holds every
    size that shapes it."""
    name = "markov-v{vocab}-s{successors}-d{docs}x{doc_len}".format(**sizes)
    name += f"-valid{sizes['valid_docs']}" if sizes["valid_docs"] else ""
    return os.path.join(os.path.abspath(log_dir), name + f"-seed{sizes['seed']}", "tokens")


def markov_split(sizes: dict) -> str:
    """``--split`` in documents: the training walks, then the held-out ones (Megatron normalises the weights,
    so the parts are exactly these documents)."""
    return f"{sizes['docs']},{sizes['valid_docs']},0" if sizes["valid_docs"] else TRAIN_ONLY_SPLIT


def provider_flags(name: str) -> list[str]:
    spec = PROVIDERS[name].spec
    return ["--spec", *spec] if spec else []


def device_max_connections(overlap_ep_comm: bool) -> str:
    """CUDA_DEVICE_MAX_CONNECTIONS for every provider: one queue as Megatron asks, several for the overlap."""
    return OVERLAP_DEVICE_MAX_CONNECTIONS if overlap_ep_comm else DEVICE_MAX_CONNECTIONS


def provider_env(name: str, mlm_dir: str, base: dict[str, str], overlap_ep_comm: bool = False) -> dict[str, str]:
    """``base`` with Megatron-LM's files and this checkout first on PYTHONPATH (pretrain_gpt.py imports
    gpt_builders/model_provider as top-level modules; --spec imports sonic_megatron), the CUDA connections per
    device of ``device_max_connections``, and the provider's own variables."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [os.path.abspath(mlm_dir), repo] + ([base["PYTHONPATH"]] if base.get("PYTHONPATH") else [])
    connections = {"CUDA_DEVICE_MAX_CONNECTIONS": device_max_connections(overlap_ep_comm)}
    return {**base, "PYTHONPATH": os.pathsep.join(paths), **connections, **PROVIDERS[name].env}


def profile_dir(log_path: str) -> str:
    """The ``--tensorboard-dir`` of a profiled run (the trace lands beside it, ``e2e_profile.trace_path``)."""
    return os.path.join(os.path.splitext(log_path)[0] + "-profile", "tb")


def run_global_batch(parsed: dict, cmd: list[str], *, warmup: int, last_timed: int | None) -> tuple[int, str]:
    """(the global batch the run trained on, where it comes from): Megatron's iteration lines ("log"), else the
    last ``--global-batch-size`` of ``cmd`` ("flags"; a run that died before its first timed iteration)."""
    logged = logged_global_batch(parsed, warmup=warmup, last_timed=last_timed)
    if logged is not None:
        return logged, "log"
    return int(last_flag_value(cmd, "--global-batch-size")), "flags"


def run_provider(name: str, index: int, count: int, cmd: list[str], env: dict, log_path: str, args) -> dict:
    tag = f"[{index}/{count}] {name}"
    print(f"{tag}: starting, log {log_path}", flush=True)
    print(f"  {shell_line(cmd, env)}", flush=True)
    t0 = time.perf_counter()
    rc, timed_out = run_logged(cmd, env, log_path, args.timeout, progress_printer(name, args.iters))
    elapsed = time.perf_counter() - t0
    with open(log_path, errors="replace") as f:
        parsed = parse_log(f)
    last_timed = e2e_profile.last_timed_iteration(args.iters, args.profile) if args.profile else None
    global_batch, global_batch_source = run_global_batch(parsed, cmd, warmup=args.warmup, last_timed=last_timed)
    # the sequence length too as the command sets it: --pretrain-args may change either
    tokens_per_iteration = global_batch * int(last_flag_value(cmd, "--seq-length"))
    stats = summarize(
        parsed,
        warmup=args.warmup,
        tokens_per_iteration=tokens_per_iteration,
        num_gpus=args.nproc_resolved,
        last_timed=last_timed,
    )
    if timed_out:
        status = "timeout"
    elif rc != 0:
        status = "failed"
    elif stats["iterations_timed"] == 0:
        status = "no-iterations"  # exited 0 without the iteration lines (not Megatron's launcher?)
    else:
        status = "ok"
    row = {
        "provider": name,
        "status": status,
        "returncode": rc,
        "elapsed_s": elapsed,
        "spec": " ".join(PROVIDERS[name].spec) if PROVIDERS[name].spec else None,
        "env": PROVIDERS[name].env,
        "command": cmd,
        "log": log_path,
        "global_batch": global_batch,
        "global_batch_source": global_batch_source,
        "tokens_per_iteration": tokens_per_iteration,
        **stats,
    }
    if args.profile and status == "ok":
        trace = e2e_profile.trace_path(profile_dir(log_path))
        try:
            row["profile"] = e2e_profile.summarize_trace(trace, args.profile)
        except (OSError, ValueError) as exc:
            row["profile"] = None
            print(f"  warning: no profile summary from {trace}: {exc}", flush=True)
    summary = f"{tag}: {status} in {elapsed:.1f} s (rc {rc})"
    if stats["ms_per_iter_median"] is not None:
        summary += (
            f", {stats['ms_per_iter_median']:.1f} ms/iter (min {stats['ms_per_iter_min']:.1f}, max "
            f"{stats['ms_per_iter_max']:.1f}), global batch {global_batch} ({global_batch_source}), "
            f"{stats['tokens_per_s']:.0f} tokens/s, peak allocated {stats['peak_allocated_mib'] or 0:.0f} MiB"
        )
    if row.get("profile"):
        summary += f"; {e2e_profile.summary_text(row['profile'])}"
    print(summary, flush=True)
    if status != "ok":
        row["log_tail"] = log_excerpt(log_path)
        print(f"  first error and last lines of {log_path}:", flush=True)
        for line in row["log_tail"]:
            print(f"  | {line}", flush=True)
    return row


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _megatron_core_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def run(args: argparse.Namespace) -> int:
    from .common import print_table, write_json

    gpu_count = _gpu_count() if args.nproc is None else 0
    try:
        shape, providers, nproc = validate(args, gpu_count=gpu_count)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.nproc_resolved = nproc
    log_dir = args.log_dir or (os.path.dirname(os.path.abspath(args.json)) if args.json else "out")
    seeds = list(range(args.seed, args.seed + args.seeds))
    global_batch = global_batch_size(shape, nproc, args.microbatches)
    microbatches = microbatches_per_rank(shape, nproc, global_batch)

    def seed_flags(seed: int) -> tuple[list[str], dict | None]:
        """pretrain_gpt.py's shared flags at ``seed`` and the sizes of the markov dataset they read (None: mock
        data), which is written at ``markov_data_path(log_dir, sizes)``."""
        sizes = markov_data_sizes(shape, args, seed, global_batch) if args.data == "markov" else None
        data = {"data_path": markov_data_path(log_dir, sizes), "split": markov_split(sizes)} if sizes else {}
        flags = pretrain_flags(
            shape,
            iters=args.iters,
            ep=args.ep,
            seed=seed,
            eval_iters=args.eval_iters,
            global_batch=global_batch,
            overlap_ep_comm=args.overlap_ep_comm,
            **data,
        )
        return flags + shlex.split(args.pretrain_args), sizes

    if args.print_flags:
        print("\n".join(seed_flags(seeds[0])[0]))
        return 0
    pretrain_gpt = os.path.abspath(os.path.join(args.megatron_lm, "pretrain_gpt.py"))
    if not os.path.isfile(pretrain_gpt):
        # a dry run prints the commands with the launcher path they would use; a run needs the launcher
        print(
            f"{'note' if args.dry_run else 'error'}: --megatron-lm: {pretrain_gpt} does not exist; copy "
            f"Megatron-LM's launcher files there with `python -m sonic_megatron.bench.megatron_lm <Megatron-LM "
            f"checkout> --dest {args.megatron_lm}`",
            file=sys.stderr,
        )
        if not args.dry_run:
            return 2
    if not args.dry_run:
        os.makedirs(log_dir, exist_ok=True)
        try:
            for path in install_dataset_sources(args.megatron_lm):
                print(f"installed {path} (pretrain_gpt.py compiles megatron-core's dataset helpers with it)")
        except OSError as exc:  # a read-only install: Megatron's own error follows if the helpers are missing
            print(f"warning: could not install the dataset helper sources: {exc}", file=sys.stderr)
    overlap = f", EP overlap (CUDA_DEVICE_MAX_CONNECTIONS={OVERLAP_DEVICE_MAX_CONNECTIONS})"
    no_gpu_dry_run = args.dry_run and args.nproc is None and gpu_count < 1
    gpus = f"{nproc} GPU(s)" + (" (--nproc left out and no GPU visible: --ep's count)" if no_gpu_dry_run else "")
    print(
        f"bench e2e: config {args.config} {dataclasses.asdict(shape)}, {gpus}, EP {args.ep}, global batch "
        f"{global_batch} ({microbatches} micro-batch(es) per rank), {args.iters} iterations ({args.warmup} warm-up), "
        f"providers {', '.join(providers)}"
        + (f", seeds {seeds[0]}-{seeds[-1]}" if len(seeds) > 1 else "")
        + (overlap if args.overlap_ep_comm else ""),
        flush=True,
    )
    if args.overlap_ep_comm and microbatches < 2:
        print(
            f"warning: --overlap-ep-comm with {microbatches} micro-batch per rank: Megatron's overlap schedule has no "
            "second micro-batch to hide the all-to-all behind (set --microbatches 2 or more)",
            file=sys.stderr,
            flush=True,
        )
    rows, count = [], len(providers) * len(seeds)
    for s_index, seed in enumerate(seeds):
        flags, sizes = seed_flags(seed)
        if len(seeds) > 1:
            print(f"seed {seed} ({s_index + 1} of {len(seeds)}):", flush=True)
        if sizes and not args.dry_run:
            from .markov_data import write_dataset

            data_path = markov_data_path(log_dir, sizes)
            print(f"writing the markov dataset {data_path} ...", flush=True)
            write_dataset(data_path, **sizes)
        for p_index, name in enumerate(providers):
            i = s_index * len(providers) + p_index + 1
            suffix = f"-seed{seed}" if len(seeds) > 1 else ""
            log_path = os.path.join(log_dir, f"e2e-{args.config}-{name}{suffix}.log")
            extra = []
            if args.profile:
                extra = e2e_profile.megatron_flags(args.iters, args.profile, profile_dir(log_path), args.profile_stacks)
            cmd = torchrun_command(pretrain_gpt, nproc, flags + provider_flags(name) + extra)
            env = provider_env(name, args.megatron_lm, dict(os.environ), overlap_ep_comm=args.overlap_ep_comm)
            if args.dry_run:
                print(f"[{i}/{count}] {name}: {shell_line(cmd, env)}")
                continue
            rows.append({**run_provider(name, i, count, cmd, env, log_path, args), "seed": seed})
    if args.dry_run:
        return 0
    add_ratios(rows, BASELINE)
    columns = [
        "provider",
        *(["seed"] if len(seeds) > 1 else []),
        "status",
        "global_batch",
        "ms_per_iter_median",
        "ms_per_iter_min",
        "ms_per_iter_max",
        "tokens_per_s",
        "tokens_per_s_per_gpu",
        "tflops_per_gpu",
        "peak_allocated_mib",
        "speedup_vs_grouped",
        "memory_vs_grouped",
        "final_loss",
        "final_loss_mean10",
        *(["eval_loss"] if args.eval_iters else []),
        "elapsed_s",
    ]
    print_table(rows, columns)
    ratios = seed_ratios(rows, providers[0]) if len(seeds) > 1 else None
    if ratios:
        print(
            f"per-seed ratios to {providers[0]} over {len(seeds)} seeds (loss: this / {providers[0]}; speed: "
            f"{providers[0]}'s ms / this):"
        )
        print_table(
            ratios,
            [
                "provider",
                "n_seeds",
                "loss_ratio_mean",
                "loss_ratio_sd",
                "eval_ratio_mean",
                "eval_ratio_sd",
                "speed_mean",
                "speed_min",
                "speed_max",
            ],
        )
    if args.profile:
        prof_rows, prof_columns = e2e_profile.table_rows(rows)
        print(f"GPU ms per iteration over each provider's last {args.profile} iterations (torch profiler):")
        print_table(prof_rows, prof_columns)
        for r in rows:
            for line in e2e_profile.window_lines(r["provider"], r.get("profile") or {}):
                print(line)
        for r in rows:
            for gap in (r.get("profile") or {}).get("idle_by_launcher", [])[:8]:
                where = f"in {gap['gaps']:.0f} gaps before {gap['launcher']}"
                print(f"  {r['provider']}: idle {gap['ms']:.2f} ms/iter {where}")
        for r in rows:
            for op in (r.get("profile") or {}).get("host_top_ops", [])[:8]:
                print(f"  {r['provider']}: host {op['ms']:.2f} ms/iter in {op['calls']:.0f} calls of {op['op']}")
        for r in rows:
            for line in e2e_frames.summary_lines(r["provider"], r.get("profile") or {}):
                print(line)
    write_json(
        args.json,
        {
            "benchmark": "e2e",
            "config": args.config,
            "shape": dataclasses.asdict(shape),
            "nproc": nproc,
            "ep": args.ep,
            "global_batch": global_batch,
            "microbatches": microbatches,
            "overlap_ep_comm": args.overlap_ep_comm,
            "cuda_device_max_connections": device_max_connections(args.overlap_ep_comm),
            "iters": args.iters,
            "warmup": args.warmup,
            "seed": args.seed,
            "seeds": seeds,
            "data": args.data,
            "eval_iters": args.eval_iters,
            "markov_entropy_nats": entropy_rate(MARKOV_SUCCESSORS) if args.data == "markov" else None,
            "megatron_lm": os.path.abspath(args.megatron_lm),
            "megatron_core": _megatron_core_version(),
            "baseline": BASELINE,
            "rows": rows,
            "seed_ratios": ratios,
        },
    )
    return 0 if all(r["status"] == "ok" for r in rows) else 1
