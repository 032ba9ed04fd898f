"""Reading Megatron-LM's training log (megatron/training/training.py ``training_log``, core_r0.18 / r0.19).

Lines it reads (one iteration line per ``--log-interval``; the memory report after iterations 1 and 2 and
every ``--log-memory-interval``)::

     [2026-11-25 10:00:00.123456] iteration        3/      30 | consumed samples:           48 | elapsed time
     per iteration (ms): 812.4 | throughput per GPU (TFLOP/s/GPU): 201.3 | learning rate: 2.999E-04 | global
     batch size:    16 | lm loss: 1.034567E+01 | load_balancing_loss: 1.002E+00 | loss scale: 1.0 | grad
     norm: 3.21 | number of skipped iterations:   0 | number of nan iterations:   0 |
    [Rank 0] (after 30 iterations) memory (MB) | allocated: 1.2 | max allocated: 3.4 | reserved: 5.6 | max
     reserved: 7.8
     validation loss at iteration 200 on validation set | lm loss value: 1.650962E+00 | lm loss PPL: 5.21E+00 |

(each a single line in the log). Keys are kept as Megatron writes them ("elapsed time per iteration (ms)",
"lm loss", ...). The iteration line's "global batch size" is the batch the run really trained on, whatever flags set
it: tokens/s comes from it (``logged_global_batch``).
"""

from __future__ import annotations

import re
import statistics

RANK_PREFIX_RE = re.compile(r"^\[(?:default)?rank\d+\]:\s?")
ITERATION_RE = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|(.*)$")
MEMORY_RE = re.compile(r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\)((?:\s*\|\s*[^|]+)+)")
# Printed by sonic_megatron.baseline.grouped_block_spec: which experts module the baseline run built.
BASELINE_EXPERTS_RE = re.compile(r"sonic_megatron\.baseline: routed experts (\w+)")
# evaluate_and_print_results after training (``--eval-iters``), printed by the last rank.
VALIDATION_RE = re.compile(r"\bvalidation loss at iteration (\d+) on validation set \|(.*)$")
VALID_LOSS_KEY = "lm loss value"
MS_KEY = "elapsed time per iteration (ms)"
TFLOPS_KEY = "throughput per GPU (TFLOP/s/GPU)"
LOSS_KEY = "lm loss"
GLOBAL_BATCH_KEY = "global batch size"


def _fields(text: str) -> dict[str, float]:
    """``| key: number | key: number |`` -> {key: number}; fields that are not numbers are skipped."""
    out = {}
    for part in text.split("|"):
        key, sep, value = part.partition(":")
        if not sep:
            continue
        try:
            out[key.strip()] = float(value.strip())
        except ValueError:
            continue
    return out


def parse_iteration(line: str) -> dict | None:
    """{"iteration": n, "train_iters": total, <Megatron's keys>: value} of an iteration log line, else None."""
    m = ITERATION_RE.search(line)
    if m is None:
        return None
    return {"iteration": int(m.group(1)), "train_iters": int(m.group(2)), **_fields(m.group(3))}


def parse_memory(line: str) -> dict | None:
    """{"rank", "after_iterations", "allocated", "max allocated", "reserved", "max reserved"} (MB) of a
    memory report line, else None."""
    m = MEMORY_RE.search(line)
    if m is None:
        return None
    return {"rank": int(m.group(1)), "after_iterations": int(m.group(2)), **_fields(m.group(3))}


def parse_validation(line: str) -> dict | None:
    """{"iteration": n, "lm loss value": v, ...} of a validation result line, else None."""
    m = VALIDATION_RE.search(line)
    if m is None:
        return None
    return {"iteration": int(m.group(1)), **_fields(m.group(2))}


def parse_log(lines) -> dict:
    """Every iteration record (last one wins per iteration number, in order), memory report and validation
    result of a log, and the baseline's experts class if the log names it."""
    iterations: dict[int, dict] = {}
    memory = []
    validation = []
    baseline_experts = None
    for line in lines:
        if (it := parse_iteration(line)) is not None:
            iterations[it["iteration"]] = it
        elif (mem := parse_memory(line)) is not None:
            memory.append(mem)
        elif (val := parse_validation(line)) is not None:
            validation.append(val)
        elif (m := BASELINE_EXPERTS_RE.search(line)) is not None:
            baseline_experts = m.group(1)
    return {
        "iterations": [iterations[k] for k in sorted(iterations)],
        "memory": memory,
        "validation": validation,
        "baseline_experts": baseline_experts,
    }


def timed_iterations(parsed: dict, *, warmup: int, last_timed: int | None = None) -> list[dict]:
    """The iteration records after the first ``warmup`` ones and up to ``last_timed`` (when given: the iterations
    the profiler touches are not timed) that carry a time."""
    return [
        it
        for it in parsed["iterations"]
        if it["iteration"] > warmup and (last_timed is None or it["iteration"] <= last_timed) and MS_KEY in it
    ]


def logged_global_batch(parsed: dict, *, warmup: int, last_timed: int | None = None) -> int | None:
    """The global batch size Megatron printed for the last timed iteration (``timed_iterations``; the batch is
    fixed without ``--rampup-batch-size``, and at its end after a ramp-up), None when the log prints none."""
    timed = timed_iterations(parsed, warmup=warmup, last_timed=last_timed)
    batches = [it[GLOBAL_BATCH_KEY] for it in timed if GLOBAL_BATCH_KEY in it]
    return int(batches[-1]) if batches else None


def summarize(
    parsed: dict, *, warmup: int, tokens_per_iteration: int, num_gpus: int, last_timed: int | None = None
) -> dict:
    """Statistics of the iterations after the first ``warmup`` ones (and up to ``last_timed``, when given:
    ``timed_iterations``): median / min / max ms per iteration, tokens/s and tokens/s/GPU (``tokens_per_iteration``
    over the median time) and TFLOP/s/GPU at the median, peak memory (the largest "max allocated" reported), the
    loss curve of every iteration, the last loss and the mean of the last 10 (one step's loss is noisy), and the
    last validation loss (``--eval-iters``).
    Missing values are None (a run that died early)."""
    its = parsed["iterations"]
    timed = timed_iterations(parsed, warmup=warmup, last_timed=last_timed)
    ms = [it[MS_KEY] for it in timed]
    tflops = [it[TFLOPS_KEY] for it in timed if TFLOPS_KEY in it]
    median_ms = statistics.median(ms) if ms else None
    peaks = [m["max allocated"] for m in parsed["memory"] if "max allocated" in m]
    reserved = [m["max reserved"] for m in parsed["memory"] if "max reserved" in m]
    losses = [it.get(LOSS_KEY) for it in its]
    logged = [v for v in losses if v is not None]
    valid = [v[VALID_LOSS_KEY] for v in parsed["validation"] if VALID_LOSS_KEY in v]
    return {
        "baseline_experts": parsed.get("baseline_experts"),
        "iterations_logged": len(its),
        "iterations_timed": len(ms),
        "ms_per_iter_median": median_ms,
        "ms_per_iter_min": min(ms) if ms else None,
        "ms_per_iter_max": max(ms) if ms else None,
        "tokens_per_s": tokens_per_iteration / (median_ms / 1e3) if median_ms else None,
        "tokens_per_s_per_gpu": tokens_per_iteration / (median_ms / 1e3) / num_gpus if median_ms else None,
        "tflops_per_gpu": statistics.median(tflops) if tflops else None,
        "peak_allocated_mib": max(peaks) if peaks else None,
        "peak_reserved_mib": max(reserved) if reserved else None,
        "final_loss": logged[-1] if logged else None,
        "final_loss_mean10": statistics.fmean(logged[-10:]) if logged else None,
        "eval_loss": valid[-1] if valid else None,
        "losses": losses,
        "ms_per_iter": [it.get(MS_KEY) for it in its],
    }


def failure_excerpt(lines: list[str], *, tail: int = 20, first_max: int = 40) -> list[str]:
    """What to show of a failed run's log: its first Python traceback (a worker's: torchrun's own report of
    the failure follows it and says little), up to the exception line, then the last ``tail`` lines."""
    last = lines[-tail:]
    start = next((i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line), None)
    if start is None or start >= len(lines) - tail:
        return last
    end = start + 1
    while end < len(lines) and end - start < first_max:
        body = RANK_PREFIX_RE.sub("", lines[end])
        end += 1
        if body and not body[0].isspace():  # the exception line closes the traceback
            break
    return lines[start:end] + (["..."] if end < len(lines) - tail else []) + lines[max(end, len(lines) - tail) :]
