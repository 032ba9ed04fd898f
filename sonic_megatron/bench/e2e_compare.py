"""Comparing ``bench e2e``'s provider rows: the ratios to the baseline within a seed, and each provider's per-seed
ratios to a reference provider over several seeds."""

from __future__ import annotations

import statistics


def add_ratios(rows: list[dict], baseline: str) -> None:
    """speedup_vs_grouped (``baseline``'s median ms / this one's) and memory_vs_grouped, when both ran at the row's
    seed."""
    bases = {r.get("seed"): r for r in rows if r["provider"] == baseline and r["status"] == "ok"}
    for r in rows:
        base = bases.get(r.get("seed"))
        ok = base is not None and r["status"] == "ok"
        r["speedup_vs_grouped"] = base["ms_per_iter_median"] / r["ms_per_iter_median"] if ok else None
        both_mem = ok and base["peak_allocated_mib"] and r["peak_allocated_mib"]
        r["memory_vs_grouped"] = r["peak_allocated_mib"] / base["peak_allocated_mib"] if both_mem else None


def _mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else None


def seed_ratios(rows: list[dict], reference: str) -> list[dict]:
    """Each other provider against ``reference`` over the seeds at which both finished: per seed the ratio of the
    training loss (mean of the last 10 iterations), of the validation loss (when evaluated) and the speed
    (``reference``'s median ms / the provider's); over the seeds the mean and standard deviation of the loss
    ratios and the mean, min and max of the speed."""
    done = [r for r in rows if r["status"] == "ok"]
    refs = {r["seed"]: r for r in done if r["provider"] == reference}
    out = []
    for name in dict.fromkeys(r["provider"] for r in done if r["provider"] != reference):
        pairs = [(refs[r["seed"]], r) for r in done if r["provider"] == name and r["seed"] in refs]
        if not pairs:
            continue
        loss = [
            r["final_loss_mean10"] / b["final_loss_mean10"]
            for b, r in pairs
            if b.get("final_loss_mean10") and r.get("final_loss_mean10") is not None
        ]
        evals = [r["eval_loss"] / b["eval_loss"] for b, r in pairs if b.get("eval_loss") and r.get("eval_loss")]
        speed = [b["ms_per_iter_median"] / r["ms_per_iter_median"] for b, r in pairs]
        (loss_mean, loss_sd), (eval_mean, eval_sd) = _mean_sd(loss), _mean_sd(evals)
        out.append(
            {
                "provider": name,
                "vs": reference,
                "seeds": [r["seed"] for _, r in pairs],
                "loss_ratios": loss,
                "eval_ratios": evals,
                "speed_ratios": speed,
                "n_seeds": len(pairs),
                "loss_ratio_mean": loss_mean,
                "loss_ratio_sd": loss_sd,
                "eval_ratio_mean": eval_mean,
                "eval_ratio_sd": eval_sd,
                "speed_mean": statistics.mean(speed),
                "speed_min": min(speed),
                "speed_max": max(speed),
            }
        )
    return out
