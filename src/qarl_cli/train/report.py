"""What a training run shows: the periodic test-split evaluation (avg@k at the rollout temperature and greedy
accuracy, through the rollout engine), one summary line per step, and the final table (also summary.json)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from rich.table import Table


def evaluate_now(run: Any, step: int, console: Any, metrics: Optional[dict] = None) -> list[dict]:
    """Evaluate the engine's current weights on the test split; the eval/* keys go into `metrics` (or are
    logged on their own at `step` when there is no step's metrics, as at the start). Returns one history row."""
    from qarl_cli.train.evaluate import evaluate

    cfg = run.cfg
    problems, prompts = run.splits.test, run.test_prompts
    common = dict(max_tokens=cfg.max_new_tokens, seed=cfg.seed + 1_000 * step)
    sampled = evaluate(run.engine, run.tokenizer, problems, prompts, run.reward, k=cfg.eval_samples,
                       temperature=cfg.temperature, top_p=cfg.top_p, **common)
    greedy = evaluate(run.engine, run.tokenizer, problems, prompts, run.reward, k=1, temperature=0.0, top_p=1.0,
                      **common)
    k = cfg.eval_samples
    out = {f"eval/avg@{k}": sampled.metrics[f"eval/avg@{k}"], f"eval/pass@{k}": sampled.metrics[f"eval/pass@{k}"],
           "eval/greedy_acc": greedy.metrics["eval/avg@1"], "eval/len_mean": sampled.metrics["eval/len_mean"],
           "eval/error_tokens_any_frac": sampled.metrics["error_tokens/any_frac"]}
    for group, g in greedy.groups.items():
        out[f"eval/greedy_acc/{group}"] = g["eval/avg@1"]
    if metrics is None:
        run.logger.log(step, out)
    else:
        metrics.update(out)
    console.print(f"[qarl] eval step {step}: avg@{k} {out[f'eval/avg@{k}']:.1%}, greedy {out['eval/greedy_acc']:.1%}, "
                  f"pass@{k} {out[f'eval/pass@{k}']:.1%} on {len(problems)} test problems")
    return [{"step": step, **out}]


def step_line(step: int, total: int, m: dict) -> str:
    g = lambda key: m.get(key, 0.0)  # noqa: E731 - a step without signal has no update or mismatch keys
    return (f"[qarl] step {step}/{total}: reward {g('reward/mean'):.3f}, signal {g('advantage/signal_frac'):.0%}, "
            f"k3_kl {g('mismatch/k3_kl'):.2e}, error tokens {g('error_tokens/any_frac'):.1%}, "
            f"len {g('response/len_mean'):.1f}, {g('time/step'):.2f} s (rollout {g('time/rollout'):.2f}, "
            f"update {g('time/update'):.2f})")


def final_table(console: Any, history: list[dict], run_dir: Path) -> None:
    """The evaluations as a table and summary.json, which every finished run writes: with eval_every=0 its
    history is empty and first / last are null (the train curves are in metrics.jsonl)."""
    if not history:
        _write_summary(run_dir, {"first": None, "last": None, "history": [], "run_dir": str(run_dir)})
        return
    keys = [k for k in history[0] if k != "step" and "/" in k and k.count("/") == 1]
    table = Table(title="qarl train: test-split evaluation")
    table.add_column("step", justify="right")
    for k in keys:
        table.add_column(k.removeprefix("eval/"), justify="right")
    for row in history:
        table.add_row(str(row["step"]), *[f"{100 * row[k]:.1f}" if "acc" in k or "@" in k or "frac" in k
                                          else f"{row[k]:.2f}" for k in keys])
    console.print(table)
    first, last = history[0], history[-1]
    summary = {"first": first, "last": last, "history": history, "run_dir": str(run_dir)}
    _write_summary(run_dir, summary)
    k = next(k for k in keys if k.startswith("eval/avg@"))
    console.print(f"[qarl] {k.removeprefix('eval/')}: {first[k]:.1%} -> {last[k]:.1%}; greedy "
                  f"{first['eval/greedy_acc']:.1%} -> {last['eval/greedy_acc']:.1%}; run dir {run_dir}")


def draw_curves(run: Any, console: Any) -> None:
    """curves.png in the run directory (rank 0), from what metrics.jsonl holds so far; never fails the run."""
    if run.dist.main:
        from qarl_cli.results.plot import draw_quietly

        draw_quietly(run.run_dir, console.print, run.cfg.logger.metrics_file)


def _write_summary(run_dir: Path, summary: dict) -> None:
    """Written beside and renamed over: a kill mid-write leaves the earlier file whole, never a cut one."""
    tmp = run_dir / f".summary.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, run_dir / "summary.json")
