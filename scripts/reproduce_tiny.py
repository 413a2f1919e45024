"""The paper's comparison in miniature, on an embedded task (tiny model, this machine):

    bf16        unquantized rollout, unquantized training              quant=none forward=bf16 algorithm=gspo
    naive       quantized rollout, unquantized training                quant=Q forward=bf16 algorithm=gspo
    naive+tis   the same, with truncated importance sampling (C = 2)   ... algorithm.mismatch=tis
    qarl        quantized rollout, rollout-aligned training, TBPO      quant=Q forward=aligned algorithm=tbpo

for Q in int8 (W8A8) and w4a16, each in real vLLM where it serves the scheme on this CPU (qarl_cli.machine.capabilities),
else in the embedded torch engine, and several seeds each; and, with --settings, the ablations on the aligned
learner (ABLATIONS below): the paper's, and TBPO as qarl ran it before 2026-12 (4 updates per batch, the old band).
--task arith_cot (the default) is the long-response miniature, +experiment=tiny_cot (model=tiny_cot,
data=arith_cot: worked solutions of 40-150 tokens; its steps, batch, minibatches and lr unless given here);
--task arith the embedded default (6-token answers); --task smollm2_arith the real model (+experiment=smollm2_arith,
SmolLM2-135M-Instruct on level-0 arithmetic, its own steps, batch and lr unless given here). Every run is a `qarl train` subprocess
(one in-process vLLM engine per run); --jobs N runs N at once, each pinned to its own core with one thread.
Writes docs/results.md (final test accuracy mean and std, gain over the start, entropy, mismatch, error tokens,
collapses), docs/results.png (curves per arm) and docs/results.json; for --task arith docs/results_arith.*.

    .venv/bin/python scripts/reproduce_tiny.py [--task arith_cot|arith] [--seeds 3] [--steps N]
        [--prompts N] [--samples N] [--minibatches N] [--eval-every N] [--lr X] [--schemes int8,w4a16]
        [--settings bf16,naive,naive+tis,qarl] [--jobs 2] [--out-dir docs] [--runs-dir runs/tiny]

A run counts as collapsed when its final avg@k falls more than 5 points below its start."""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from qarl_cli.config.quant import SCHEMAS
from qarl_cli.results import runs as run_records
from qarl_cli.results.summary import late_mean as _late, mean_std as _mean_std, record, step_rows, tail as _tail

SETTINGS = {  # name -> overrides; "{q}" is the scheme
    "bf16": ["quant=none", "forward=bf16", "algorithm=gspo"],
    "naive": ["quant={q}", "forward=bf16", "algorithm=gspo"],
    "naive+tis": ["quant={q}", "forward=bf16", "algorithm=gspo", "algorithm.mismatch=tis"],
    "qarl": ["quant={q}", "forward=aligned", "algorithm=tbpo"],
}
ABLATIONS = {  # each QaRL with one part changed
    # several updates per rollout batch, where the trust band acts (lr / 4: the same Muon movement per batch)
    "qarl-4-minibatches": ["quant={q}", "forward=aligned", "algorithm=tbpo", "minibatches=4", "lr=5e-4"],
    # qarl's TBPO until 2026-12: GSPO's band and 7e-4, a one-sided weight cap, the keep mask, 4 updates per batch
    "qarl-old": ["quant={q}", "forward=aligned", "algorithm=tbpo", "minibatches=4", "lr=5e-4",
                 "algorithm.eps_low=3e-4", "algorithm.eps_high=4e-4", "algorithm.eps_neg_low=3e-4",
                 "algorithm.eps_neg_high=7e-4", "algorithm.mismatch_clip=upper", "algorithm.drop_outside_band=true"],
    "qarl-keep-mask": ["quant={q}", "forward=aligned", "algorithm=tbpo", "algorithm.drop_outside_band=true"],
    "aligned+gspo": ["quant={q}", "forward=aligned", "algorithm=gspo"],  # no mismatch weight, no dual clip
    "aligned+grpo-dualclip": ["quant={q}", "forward=aligned", "algorithm=grpo", "algorithm.dual_clip=true"],
    "qarl-positive-only": ["quant={q}", "forward=aligned", "algorithm=tbpo", "algorithm.positive_only=true"],
}
# The task's own settings; every setting's quant, forward and algorithm, and the flags given, override them.
TASKS = {"arith": [], "arith_cot": ["+experiment=tiny_cot"],
         # the real model (SmolLM2-135M-Instruct) on the arithmetic it can learn on a CPU, where W4A16 changes the
         # samples (docs/results_smollm2_arith.md)
         "smollm2_arith": ["+experiment=smollm2_arith"]}
# A task's settings for one scheme: SmolLM2's 576-wide linears take W4A16 groups of 64, not the schema's 128.
TASK_SCHEME = {("smollm2_arith", "w4a16"): ["quant.group_size=64"]}
COLLAPSE_POINTS = 5.0
LOG_FLOOR = 1e-16  # where a log-scale curve draws an exact 0
COLORS = {"bf16": "tab:green", "naive": "tab:red", "naive+tis": "tab:orange", "qarl": "tab:blue",
          "qarl-4-minibatches": "tab:purple", "qarl-old": "tab:pink", "qarl-keep-mask": "tab:cyan", "aligned+gspo": "tab:brown", "aligned+grpo-dualclip": "tab:gray",
          "qarl-positive-only": "tab:olive", "naive+tbpo": "black"}


def runs(settings: list[str], schemes: list[str], seeds: int, ablation_schemes: list[str] | None = None,
         ablation_seeds: int | None = None) -> list[tuple[str, str, int, list[str]]]:
    """(setting, scheme, seed, overrides) for every run; bf16 once, not per scheme; the ablations on
    `ablation_schemes` with `ablation_seeds` seeds (by default as the main settings)."""
    table = {**SETTINGS, **ABLATIONS}
    out = []
    for setting in settings:
        ablation = setting in ABLATIONS
        qs = ["none"] if setting == "bf16" else (ablation_schemes or schemes) if ablation else schemes
        for q in qs:
            for seed in range((ablation_seeds or seeds) if ablation else seeds):
                out.append((setting, q, seed, [o.replace("{q}", q) for o in table[setting]]))
    return out


def engine_for(scheme: str) -> str:
    import torch

    from qarl_cli.machine.capabilities import vllm_serving

    # vLLM serves only some schemes on a CPU (qarl_cli.machine.capabilities); the others use rollout=torch there
    return "vllm" if vllm_serving(scheme, moe=False, gpu=torch.cuda.is_available()).served else "torch"


def one_run(run_dir: Path, overrides: list[str], args, core: int | None) -> dict:
    """Train (unless run_dir already holds a finished run) and read back its summary and metrics. With `core`,
    the run is pinned to that CPU core: torch and vLLM on one thread there."""
    if not (run_dir / "summary.json").is_file():
        given = {"steps": args.steps, "prompts_per_step": args.prompts, "samples_per_prompt": args.samples,
                 "minibatches": args.minibatches, "eval_every": args.eval_every, "lr": args.lr}
        own = {o.split("=", 1)[0] for o in overrides}  # a setting's own value wins over the flag's
        cmd = [sys.executable, "-m", "qarl_cli.cli", "train", f"hydra.run.dir={run_dir}", "checkpoint_every=0",
               "overwrite=true", *[f"{k}={v}" for k, v in given.items() if v is not None and k not in own],
               *overrides]
        env = dict(os.environ)
        if core is not None:
            cmd.append("train_threads=1")
            env.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND=str(core))
        run_dir.mkdir(parents=True, exist_ok=True)
        # appended to, never truncated: a launch into a directory that another process is training in is refused
        # by `qarl train`'s lock, and must not cut that live run's console log on its way out
        with (run_dir / "stdout.log").open("a") as log:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  preexec_fn=None if core is None else lambda: os.sched_setaffinity(0, {core}))
        if done.returncode != 0:
            raise SystemExit(f"reproduce_tiny: {' '.join(cmd)} failed (exit {done.returncode}); see "
                             f"{run_dir / 'stdout.log'}")
    summary = json.loads((run_dir / "summary.json").read_text())
    run = run_records.read(run_dir)
    # Hydra writes the config as the run starts, the summary is the run's last file: the run's wall time, also
    # for a run an earlier invocation trained.
    wall = (run_dir / "summary.json").stat().st_mtime - (run_dir / ".hydra" / "config.yaml").stat().st_mtime
    # record: the first and last held-out evaluation as `qarl compare` reads them (metrics.jsonl)
    return {"summary": summary, "record": record(run), "steps": step_rows(run.rows), "wall_s": wall}


def summarise(results: list[dict], k: int) -> list[dict]:
    rows = []
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        groups.setdefault((r["setting"], r["scheme"]), []).append(r)
    for (setting, scheme), group in groups.items():
        acc = [100 * g["record"]["avg"] for g in group]
        start = [100 * g["record"]["start_avg"] for g in group]
        greedy = [100 * g["record"]["greedy"] for g in group]
        (am, asd), (gm, gsd) = _mean_std(acc), _mean_std(greedy)
        late = {key: statistics.fmean(_late(g["steps"], key) for g in group)
                for key in ("mismatch/k3_kl", "mismatch/abs_log_w_mean", "error_tokens/any_frac",
                            "response/neg_logprob_mean", "response/len_mean", "sync/lowbit_changed_frac")}
        rows.append({
            "setting": setting, "rollout": scheme, "seeds": len(group),
            f"start avg@{k}": round(statistics.fmean(start), 1),
            f"final avg@{k}": f"{am:.1f} ± {asd:.1f}",
            "gain": f"{am - statistics.fmean(start):+.1f}",
            "final greedy": f"{gm:.1f} ± {gsd:.1f}",
            "k3_kl": f"{late['mismatch/k3_kl']:.2e}",
            "mean abs log w": f"{late['mismatch/abs_log_w_mean']:.2e}",
            "error tokens %": f"{100 * late['error_tokens/any_frac']:.2f}",
            "entropy": f"{late['response/neg_logprob_mean']:.3f}",
            "len": f"{late['response/len_mean']:.0f}",
            # of the low-bit weights, the share that changed at a sync (an update below a quantization step
            # leaves the engine's policy as it was)
            "low-bit changed %": "-" if scheme == "none" else f"{100 * late['sync/lowbit_changed_frac']:.2f}",
            "collapses": sum(a < s - COLLAPSE_POINTS for a, s in zip(acc, start)),
        })
    return rows


def _curve(ax, results: list[dict], key: str, title: str, smooth: int = 5, log: bool = False) -> None:
    for r in results:
        pts = [(s["step"], s[key]) for s in r["steps"] if key in s]
        if not pts:
            continue
        xs, ys = zip(*pts)
        ys = [statistics.fmean(ys[max(0, i - smooth + 1):i + 1]) for i in range(len(ys))]
        if log:  # an exact match (0) is drawn at the floor of the axis
            ys = [max(y, LOG_FLOOR) for y in ys]
        style = "-" if r["scheme"] in ("none", "int8") else "--"
        ax.plot(xs, ys, color=COLORS[r["setting"]], linestyle=style, linewidth=0.9, alpha=0.7,
                label=f"{r['setting']} {r['scheme']}" if r["seed"] == 0 else None)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    if log:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)


def plot(results: list[dict], rows: list[dict], k: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 5, figsize=(25, 8.5))
    bars = axes[0][0]
    labels = [f"{r['setting']}\n{r['rollout']}" for r in rows]
    means = [float(r[f"final avg@{k}"].split(" ± ")[0]) for r in rows]
    stds = [float(r[f"final avg@{k}"].split(" ± ")[1]) for r in rows]
    bars.bar(range(len(rows)), means, yerr=stds, capsize=4, color=[COLORS[r["setting"]] for r in rows], alpha=0.8)
    bars.scatter(range(len(rows)), [r[f"start avg@{k}"] for r in rows], color="black", zorder=3, label="start")
    bars.set_xticks(range(len(rows)), labels, fontsize=6)
    bars.set_ylabel(f"test avg@{k} (%)")
    bars.set_title("final test accuracy (mean ± std over seeds)", fontsize=9)
    bars.legend(fontsize=7)
    evals = [dict(r, steps=r["summary"]["history"]) for r in results]
    _curve(axes[0][1], evals, f"eval/avg@{k}", f"held-out avg@{k}", smooth=1)
    _curve(axes[0][2], evals, "eval/greedy_acc", "held-out greedy accuracy", smooth=1)
    _curve(axes[0][3], results, "reward/mean", "train reward (5-step mean)")
    _curve(axes[1][0], results, "response/neg_logprob_mean", "entropy (-mean log mu of sampled tokens)")
    _curve(axes[1][1], results, "error_tokens/any_frac", "error-token rate (repeat, garble, truncation)")
    _curve(axes[1][2], results, "mismatch/k3_kl", "rollout mismatch k3_kl (aligned or bf16 learner)", log=True)
    _curve(axes[0][4], [r for r in results if r["scheme"] != "none"], "sync/lowbit_changed_frac",
           "low-bit weight values changed per sync", smooth=1)
    _curve(axes[1][4], results, "response/len_mean", "response length (tokens)")
    by_len = axes[1][3]
    for i, r in enumerate(rows):  # mean |log w| by response length, last third of the runs, per arm
        group = [x for x in results if (x["setting"], x["scheme"]) == (r["setting"], r["rollout"])]
        keys = sorted({key for g in group for s in g["steps"] for key in s
                       if key.startswith("mismatch/abs_log_w_mean@")}, key=lambda key: int(key.split("@")[1].split("-")[0]))
        # a bucket no late step of the arm's runs held (no response that long or short) is left out, not drawn as 0
        held = [(key, [g for g in group if any(key in s for s in _tail(g["steps"]))]) for key in keys]
        held = [(key, gs) for key, gs in held if gs]
        if held:
            ys = [max(LOG_FLOOR, statistics.fmean(_late(g["steps"], key) for g in gs)) for key, gs in held]
            by_len.plot([key.split("@")[1] for key, _ in held], ys, marker="o", color=COLORS[r["setting"]],
                        linestyle="-" if r["rollout"] in ("none", "int8") else "--", label=labels[i].replace("\n", " "))
    by_len.set_yscale("log")
    by_len.set_title("mean |log w| by response length (tokens), last third", fontsize=9)
    by_len.grid(alpha=0.3)
    by_len.legend(fontsize=6)
    axes[0][1].legend(fontsize=6)
    fig.suptitle("solid: int8 (vLLM) / none; dashed: w4a16", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="arith_cot", choices=sorted(TASKS))
    ap.add_argument("--seeds", type=int, default=3)
    # Unset: the task's own (TASKS: +experiment=tiny_cot for arith_cot; qarl train's defaults for arith).
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=None, help="prompts_per_step")
    ap.add_argument("--samples", type=int, default=None, help="samples_per_prompt")
    ap.add_argument("--minibatches", type=int, default=None, help="optimizer updates per rollout batch")
    ap.add_argument("--eval-every", type=int, default=None, help="eval_every (also at the start and the end)")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--schemes", default="int8,w4a16")
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help=f"comma list of {', '.join([*SETTINGS, *ABLATIONS])}")
    ap.add_argument("--ablation-schemes", default=None, help="schemes of the ablation settings (default --schemes)")
    ap.add_argument("--ablation-seeds", type=int, default=None, help="seeds of the ablation settings (default --seeds)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once, each pinned to one core (<= cores)")
    ap.add_argument("--out-dir", type=Path, default=Path("docs"))
    ap.add_argument("--runs-dir", type=Path, default=Path("runs/tiny"))
    args = ap.parse_args()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    settings = args.settings.split(",")
    unknown = [s for s in settings if s not in SETTINGS and s not in ABLATIONS]
    if unknown:
        raise SystemExit(f"reproduce_tiny: --settings {','.join(unknown)}: not one of "
                         f"{', '.join([*SETTINGS, *ABLATIONS])}")
    plan = runs(settings, args.schemes.split(","), args.seeds,
                args.ablation_schemes.split(",") if args.ablation_schemes else None, args.ablation_seeds)
    plan.sort(key=lambda run: run[2])  # seed by seed: a sweep cut short still has every setting
    cores = queue.Queue()
    for c in sorted(os.sched_getaffinity(0))[:args.jobs] if args.jobs > 1 else [None]:
        cores.put(c)
    results, start = [], time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:
        task = bar.add_task(f"{len(plan)} runs", total=len(plan))

        def do(item):
            setting, scheme, seed, overrides = item
            name = f"{args.task}-{setting}-{scheme}-seed{seed}"
            extra = (TASKS[args.task] + TASK_SCHEME.get((args.task, scheme), []) + [f"seed={seed}"]
                     + ([] if engine_for(scheme) == "vllm" else ["rollout=torch"]))
            core = cores.get()
            try:
                r = one_run(args.runs_dir / name, overrides + extra, args, core)
            finally:
                cores.put(core)
            first, last = r["summary"]["first"], r["summary"]["last"]
            bar.console.print(f"[qarl] {name}: avg@4 {first['eval/avg@4']:.1%} -> {last['eval/avg@4']:.1%}, "
                              f"greedy {last['eval/greedy_acc']:.1%}", markup=False)
            bar.advance(task)
            return {"setting": setting, "scheme": scheme, "seed": seed, **r}

        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            results = list(pool.map(do, plan))
    minutes = (time.perf_counter() - start) / 60
    k = 4
    rows = summarise(results, k)
    from qarl_cli.results.tables import markdown as _markdown

    markdown = lambda rows: _markdown(list(rows[0]), [list(map(str, r.values())) for r in rows])  # noqa: E731
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = "results" if args.task == "arith_cot" else f"results_{args.task}"
    plot(results, rows, k, args.out_dir / f"{stem}.png")
    from omegaconf import OmegaConf

    run = OmegaConf.load(args.runs_dir / f"{args.task}-{'-'.join(map(str, plan[0][:2]))}-seed0" / ".hydra" /
                         "config.yaml")  # what the runs resolved to
    scale = (f"task {args.task} ({' '.join(TASKS[args.task]) or 'the embedded default'}), {len(plan)} runs "
             f"({args.seeds} seeds per setting{f', {args.ablation_seeds} per ablation' if args.ablation_seeds else ''}"
             f"), {run.steps} steps of {run.prompts_per_step} prompts x {run.samples_per_prompt} samples in "
             f"{run.minibatches} minibatches, {run.optimizer} lr {run.lr}; test "
             f"split of the task (avg@{k} at temperature {run.temperature:g} and greedy); "
             f"{sum(r['wall_s'] for r in results) / 60:.0f} run-minutes in all on this machine, one core per run "
             f"when several ran at once (this invocation: {args.jobs} at once, {minutes:.0f} minutes)")
    table = {**SETTINGS, **ABLATIONS}
    what = "on the real model (SmolLM2-135M-Instruct" if args.task.startswith("smollm2") else "in miniature (tiny model"
    text = (f"# The comparison {what}, {args.task})\n\n"
            "Produced by `scripts/reproduce_tiny.py`; numbers as measured, whichever way they came out.\n\n"
            f"Scale: {scale}.\n\n" + markdown(rows) +
            "\nk3_kl, mean abs log w (|mean_t(log pi_old - log mu)| per sequence), error tokens, entropy (-mean "
            "log mu of the sampled tokens), len and low-bit changed (the share of the engine's low-bit weight "
            "values a sync changed): means over the last third of each run's steps.\n"
            f"\n![results]({stem}.png)\n\nSettings: " +
            "; ".join(f"{n}: `{' '.join(table[n])}`" for n in settings) +
            f". A collapse: final avg@{k} more than {COLLAPSE_POINTS:g} points below the start.\n")
    (args.out_dir / f"{stem}.md").write_text(text)
    (args.out_dir / f"{stem}.json").write_text(json.dumps(
        {"scale": scale, "rows": rows, "runs": [{k2: v for k2, v in r.items() if k2 not in ("steps", "record")}
                                                for r in results]},
        indent=2) + "\n")
    print(markdown(rows))
    print(f"wrote {args.out_dir / stem}.md, .png, .json ({minutes:.1f} min)")


if __name__ == "__main__":
    main()
