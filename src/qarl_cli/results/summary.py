"""The comparison of several runs (a sweep's jobs, or runs made apart): one record per run (its final held-out
avg@k, greedy and pass@k, mean seconds per step, late mismatch, status), and the runs grouped by every override
but the seed, with the mean and standard deviation over each group's finished runs (results.compare writes them
out)."""

from __future__ import annotations

import statistics
from typing import Optional

from qarl_cli.results.runs import FINISHED, Run, common_overrides

# The values compared, each a number per run (None where the run has none); grouped as mean and std.
METRICS = ("avg", "greedy", "pass", "s_per_step", "k3_kl")
LATE = 1 / 3  # mismatch is compared late in the run, where quantization error has had time to act


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def step_rows(rows: list[dict]) -> list[dict]:
    """The training steps' records (an evaluation before the first step logs a row of its own)."""
    return [r for r in rows if "reward/mean" in r]


def tail(steps: list[dict], frac: float = LATE) -> list[dict]:
    return steps[-max(1, int(len(steps) * frac)):]


def late_mean(steps: list[dict], key: str, frac: float = LATE) -> float:
    """The mean of a step metric over the last `frac` of the steps (0 where none of them logged it)."""
    vals = [s[key] for s in tail(steps, frac) if key in s]
    return statistics.fmean(vals) if vals else 0.0


def eval_k(rows: list[dict]) -> Optional[int]:
    """k of the run's avg@k (its eval_samples), from the keys it logged."""
    for r in rows:
        for key in r:
            if key.startswith("eval/avg@") and "/" not in key.removeprefix("eval/"):
                return int(key.removeprefix("eval/avg@"))
    return None


def record(run: Run) -> dict:
    k = eval_k(run.rows)
    evals = [r for r in run.rows if f"eval/avg@{k}" in r]
    first, last = (evals[0], evals[-1]) if evals else ({}, {})
    steps = step_rows(run.rows)
    times = [s["time/step"] for s in steps if "time/step" in s]
    return {"run": run.name, "dir": str(run.path), "overrides": run.overrides, "status": run.status,
            "error": run.error, "k": k, "steps": steps[-1]["step"] if steps else 0,
            "start_avg": first.get(f"eval/avg@{k}"), "avg": last.get(f"eval/avg@{k}"),
            "greedy": last.get("eval/greedy_acc"), "pass": last.get(f"eval/pass@{k}"),
            "s_per_step": statistics.fmean(times) if times else None,
            "k3_kl": late_mean(steps, "mismatch/k3_kl") if any("mismatch/k3_kl" in s for s in steps) else None}


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def setting(overrides: list[str], common: list[str]) -> list[str]:
    """What sets a run's group apart: its overrides but the seed and those every run shares."""
    return [o for o in overrides if _key(o) != "seed" and o not in common]


def groups(records: list[dict], common: list[str]) -> list[dict]:
    """Records grouped by setting, in the order each setting first appears; stats over the finished runs."""
    by: dict[tuple, list[dict]] = {}
    for r in records:
        by.setdefault(tuple(setting(r["overrides"], common)), []).append(r)
    out = []
    for key, members in by.items():
        done = [m for m in members if m["status"] == FINISHED]
        stats = {}
        for metric in METRICS:
            values = [m[metric] for m in done if m[metric] is not None]
            stats[metric] = dict(zip(("mean", "std"), mean_std(values))) if values else None
        out.append({"setting": list(key), "runs": [m["run"] for m in members], "finished": len(done), **stats})
    return out


def summarise(runs: list[Run]) -> dict:
    common = common_overrides(runs)
    records = [record(r) for r in runs]
    ks = {r["k"] for r in records if r["k"] is not None}
    return {"common_overrides": common, "k": ks.pop() if len(ks) == 1 else None, "groups": groups(records, common),
            "jobs": records}
