"""Where the aligned learner pays: the rollout-mismatch dose-response on the long-response task.

The dose is the rollout's weight width (quant=wna16 quant.bits=8, 4, 3, 2: weight-only integer groups, the same
torch engine for every dose, so only the width changes), with the group size as a second axis (`--bits 3g32`:
3 bits in groups of 32 columns instead of the scheme's default; smaller groups, smaller error). For each dose and each regime, the arms

    bf16        unquantized rollout and learner (once per regime)     quant=none forward=bf16 algorithm=gspo
    naive       quantized rollout, bf16 learner                        quant=wna16 forward=bf16 algorithm=gspo
    naive+tis   the same with token-level truncated IS (C = 2)         ... algorithm.mismatch=tis
    naive+tbpo  TBPO with the bf16 learner (separates the objective     ... algorithm=tbpo
                from the alignment: qarl differs from naive in both)
    qarl        quantized rollout, rollout-aligned learner, TBPO       quant=wna16 forward=aligned algorithm=tbpo

train on +experiment=tiny_sum (running sums, 170-300-token worked solutions, where a wrong token early derails
the answer). Regimes: `on` = one optimizer update per rollout batch (the public recipes'); `off` = 4 updates per
batch at the same lr (pi_old drifts from the policy within a batch, so TBPO's band binds).

Fixed before the runs (no tuning on the test split): a run has COLLAPSED when its final test avg@4 is more than
5 points below its start or its last-10-step train reward is below half its first-10-step mean. Each final model
is evaluated twice on the test split: through its own quantized engine (the run's last evaluation) and as bf16
masters (`qarl eval quant=none` on its final checkpoint). Per step every run logs the mismatch (k3, chi-square,
the ESS of whole-sequence weights), gradient norm, response length, entropy and error tokens.

    .venv/bin/python scripts/dose_response.py [--bits 8,4,3,2] [--regimes on,off] [--arms bf16,naive,naive+tis,qarl]
        [--seeds 1] [--steps N] [--jobs 2] [--out-dir docs] [--runs-dir runs/dose]

Writes docs/dose_response.md (the table), .json (every run) and .png (final accuracy of each arm against
naive's mismatch, per regime). A finished run is read back, not trained again: the study can be grown over
several invocations (more doses, then more seeds). So is a run the out-dir's JSON already records (its run
directory gone, or made on another machine): the committed study is the record, and a run directory, where it
exists, takes its place. The JSON keeps every run it records, also those outside a later invocation's plan;
the table and plot cover the plan."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from reproduce_tiny import COLORS, one_run

from qarl_cli.results.summary import late_mean, mean_std, step_rows

ARMS = {
    "bf16": ["quant=none", "forward=bf16", "algorithm=gspo"],
    "naive": ["forward=bf16", "algorithm=gspo"],
    "naive+tis": ["forward=bf16", "algorithm=gspo", "algorithm.mismatch=tis"],
    "naive+tbpo": ["forward=bf16", "algorithm=tbpo"],
    "qarl": ["forward=aligned", "algorithm=tbpo"],
}
REGIMES = {"on": [], "off": ["minibatches=4"]}  # the same lr per update: four per batch move pi_old's policy further
COLLAPSE_POINTS = 5.0
PER_STEP = ("mismatch/k3_kl", "mismatch/chi2", "mismatch/seq_ess", "update/grad_norm", "response/len_mean",
            "response/neg_logprob_mean", "error_tokens/any_frac", "reward/mean")


def doses(spec: str) -> list[tuple[int, int | None]]:
    """`4,3g32` -> [(4, None), (3, 32)]: bits, and a group size where one is given (None: the scheme's)."""
    out = []
    for item in spec.split(","):
        bits, _, group = item.partition("g")
        out.append((int(bits), int(group) if group else None))
    return out


def quant_args(bits: int, group: int | None) -> list[str]:
    return ["quant=wna16", f"quant.bits={bits}", *([f"quant.group_size={group}"] if group else [])]


def dose_name(bits: int, group: int | None) -> str:
    return f"w{bits}" + (f"g{group}" if group else "")


def plan(dose_list: list[tuple[int, int | None]], regimes: list[str], arms: list[str], seeds: int) -> list[dict]:
    out = []
    for seed in range(seeds):  # seed by seed: a study cut short still has every arm
        for regime in regimes:
            for arm in arms:
                for b, g in ([(0, None)] if arm == "bf16" else dose_list):
                    out.append({"arm": arm, "bits": b, "group": g, "regime": regime, "seed": seed})
    return out


def overrides(run: dict) -> list[str]:
    quant = [] if run["arm"] == "bf16" else quant_args(run["bits"], run.get("group"))
    return ["+experiment=tiny_sum", f"seed={run['seed']}", *quant, *ARMS[run["arm"]], *REGIMES[run["regime"]]]


def name(run: dict) -> str:
    dose = "bf16" if run["arm"] == "bf16" else dose_name(run["bits"], run.get("group"))
    return f"{run['regime']}-{run['arm']}-{dose}-seed{run['seed']}"


def master_eval(run_dir: Path, core: int | None) -> float:
    """avg@4 of the final checkpoint's bf16 masters on the test split (rollout=torch, quant=none)."""
    from omegaconf import OmegaConf

    out = run_dir / "eval_masters"
    if not (out / "eval.json").is_file():
        ckpt = max((run_dir / "checkpoints").glob("step_*"))
        size = OmegaConf.load(run_dir / ".hydra" / "config.yaml").data.test_size  # the run's own test split
        subprocess.run([sys.executable, "-m", "qarl_cli.cli", "eval", "model=hf", f"model.path={ckpt / 'model'}",
                        "data=arith_sum", f"data.test_size={size}", "quant=none", "rollout=torch",
                        f"hydra.run.dir={out}"], check=True, stdout=subprocess.DEVNULL,
                       env={**os.environ, **({"OMP_NUM_THREADS": "1"} if core is not None else {})},
                       preexec_fn=None if core is None else lambda: os.sched_setaffinity(0, {core}))
    return json.loads((out / "eval.json").read_text())["metrics"]["eval/avg@4"]


def recorded_runs(path: Path) -> dict[str, dict]:
    """The runs an earlier invocation wrote into the study's JSON, by run name, in the shape `do` returns."""
    if not path.is_file():
        return {}
    out = {}
    for r in json.loads(path.read_text())["runs"]:
        r = {"group": None, **r}
        r["summary"] = {"first": r.pop("first"), "last": r.pop("last")}
        out[name(r)] = r
    return out


def start_table(dose_list: list[tuple[int, int | None]], runs_dir: Path, limit: int) -> list[dict]:
    """The preset's start model sampled through each dose's engine (`qarl eval`, avg@4 on the first `limit` test
    problems): what the dose does before any training, error tokens included."""
    rows = []
    for b, g in [(0, None), *dose_list]:
        out = runs_dir / "start" / (dose_name(b, g) if b else "bf16")
        if not (out / "eval.json").is_file():
            quant = quant_args(b, g) if b else ["quant=none"]
            subprocess.run([sys.executable, "-m", "qarl_cli.cli", "eval", "model=tiny_sum", "data=arith_sum",
                            "rollout=torch", f"limit={limit}", *quant, f"hydra.run.dir={out}"], check=True,
                           stdout=subprocess.DEVNULL)
        m = json.loads((out / "eval.json").read_text())["metrics"]
        rows.append({"rollout": label(b, g) if b else "unquantized", "avg@4": f"{100 * m['eval/avg@4']:.1f}",
                     "len": f"{m['eval/len_mean']:.0f}",
                     **{f"{k} %": f"{100 * m[f'error_tokens/{k}_frac']:.1f}"
                        for k in ("any", "truncated", "repeat", "garbled")}})
    return rows


def label(bits: int, group: int | None) -> str:
    return f"{bits}-bit" + (f" g{group}" if group else "")


def collapsed_accuracy(result: dict) -> bool:
    first, last = result["summary"]["first"]["eval/avg@4"], result["summary"]["last"]["eval/avg@4"]
    return 100 * (first - last) > COLLAPSE_POINTS


def collapsed_reward(result: dict) -> bool:
    rewards = [s["reward/mean"] for s in result["steps"]]
    return statistics.fmean(rewards[-10:]) < 0.5 * statistics.fmean(rewards[:10])


def collapsed(result: dict) -> bool:
    """The definition fixed before the runs: either criterion (the table also shows which fired)."""
    return collapsed_accuracy(result) or collapsed_reward(result)


def table(results: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["regime"], (r["bits"], r.get("group")), r["arm"]), []).append(r)
    naive_k3 = {(reg, b): statistics.fmean(late_mean(g["steps"], "mismatch/k3_kl") for g in grp)
                for (reg, b, arm), grp in groups.items() if arm == "naive"}
    naive_ess = {(reg, b): statistics.fmean(late_mean(g["steps"], "mismatch/seq_ess") for g in grp)
                 for (reg, b, arm), grp in groups.items() if arm == "naive"}
    rows = []
    for (regime, bits, arm), grp in sorted(groups.items(),
                                           key=lambda kv: (kv[0][0], -kv[0][1][0], -(kv[0][1][1] or 128), kv[0][2])):
        q, m = mean_std([100 * g["summary"]["last"]["eval/avg@4"] for g in grp]), \
            mean_std([100 * g["masters"] for g in grp])
        start = statistics.fmean(100 * g["summary"]["first"]["eval/avg@4"] for g in grp)
        late = {k: statistics.fmean(late_mean(g["steps"], k) for g in grp) for k in PER_STEP}
        rows.append({"regime": regime, "dose": "bf16" if arm == "bf16" else label(*bits), "arm": arm,
                     # "-" also where the plan has no naive run at this dose: no measured mismatch to show
                     "seeds": len(grp), "naive k3": f"{naive_k3[regime, bits]:.2e}" if (regime, bits) in naive_k3
                     else "-", "naive ESS": f"{naive_ess[regime, bits]:.3f}" if (regime, bits) in naive_ess else "-",
                     "start": f"{start:.1f}", "final (quantized)": f"{q[0]:.1f} ± {q[1]:.1f}",
                     "final (bf16 masters)": f"{m[0]:.1f} ± {m[1]:.1f}", "k3 (own)": f"{late['mismatch/k3_kl']:.2e}",
                     "error tok %": f"{100 * late['error_tokens/any_frac']:.1f}",
                     "len": f"{late['response/len_mean']:.0f}", "grad norm": f"{late['update/grad_norm']:.2f}",
                     "collapses": sum(map(collapsed, grp)),
                     "by accuracy / reward": f"{sum(map(collapsed_accuracy, grp))} / {sum(map(collapsed_reward, grp))}"})
    return rows


def paired(results: list[dict]) -> list[dict]:
    """Each arm against naive at the same regime, dose and seed: the seed fixes the start model's samples and the
    order of the problems, so the seed-by-seed difference removes what the arms share, which the spread over
    seeds in the main table does not. bf16 is paired with every dose's naive of its regime."""
    final = {(r["regime"], r["arm"], r["bits"], r.get("group"), r["seed"]): 100 * r["summary"]["last"]["eval/avg@4"]
             for r in results}
    start = {(r["regime"], r["arm"], r["bits"], r.get("group"), r["seed"]): r["summary"]["first"]["eval/avg@4"]
             for r in results}
    rows = []
    for regime, b, g in sorted({(reg, b, g) for reg, arm, b, g, _ in final if arm == "naive"},
                               key=lambda k: (k[0], -k[1], -(k[2] or 128))):
        naive = {seed: acc for (reg, arm, bb, gg, seed), acc in final.items()
                 if (reg, arm, bb, gg) == (regime, "naive", b, g)}
        for arm in sorted({arm for _, arm, *_ in final} - {"naive"}):
            dose = (0, None) if arm == "bf16" else (b, g)
            # rounded: avg@4 moves in steps of 1/(4 x problems), and a float remainder is no lead
            diffs = [round(final[regime, arm, *dose, seed] - naive[seed], 6)
                     for seed in sorted(naive) if (regime, arm, *dose, seed) in final]
            # A pair run on different CPU kinds samples differently from the step-0 evaluation on (the quantized
            # engine's GEMMs round differently), so it shares the seed but not the start: counted, not hidden.
            same = sum(start[regime, arm, *dose, seed] == start[regime, "naive", b, g, seed]
                       for seed in sorted(naive) if (regime, arm, *dose, seed) in final)
            if diffs:
                mean, std = mean_std(diffs)
                rows.append({"regime": regime, "dose": label(b, g), "arm": arm, "seeds": len(diffs),
                             "minus naive, by seed": ", ".join(f"{d:+.1f}" for d in diffs),
                             "mean ± std": f"{mean:+.1f} ± {std:.1f}",
                             "ahead / level / behind": " / ".join(str(sum(map(test, diffs))) for test in (
                                 lambda d: d > 0, lambda d: d == 0, lambda d: d < 0)),
                             "same start": f"{same} of {len(diffs)}" if arm != "bf16" else "-"})
    return rows


def plot(rows: list[dict], results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regimes = sorted({r["regime"] for r in rows})
    fig, axes = plt.subplots(2, len(regimes), figsize=(6.5 * len(regimes), 8.5), squeeze=False)
    for col, regime in enumerate(regimes):
        ax = axes[0][col]
        bf16 = [r for r in rows if r["regime"] == regime and r["arm"] == "bf16"]
        for arm in ("naive", "naive+tis", "naive+tbpo", "qarl"):
            pts = sorted((float(r["naive k3"]), *map(float, r["final (quantized)"].split(" ± ")))
                         for r in rows if r["regime"] == regime and r["arm"] == arm and r["naive k3"] != "-")
            if pts:
                xs, ys, es = zip(*pts)
                ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, color=COLORS[arm], label=arm)
        for r in bf16:
            ax.axhline(float(r["final (quantized)"].split(" ± ")[0]), color=COLORS["bf16"], linestyle=":",
                       label="bf16")
        ax.set_xscale("log")
        ax.set_xlabel("naive's rollout mismatch k3 (last third of its steps)")
        ax.set_ylabel("final test avg@4 (%), quantized engine")
        ax.set_title(f"regime {regime}: {'1 update' if regime == 'on' else '4 updates'} per rollout batch",
                     fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        curves = axes[1][col]
        for r in results:
            if r["regime"] != regime or r["seed"] != 0:
                continue
            pts = [(s["step"], s["reward/mean"]) for s in r["steps"]]
            xs, ys = zip(*pts)
            ys = [statistics.fmean(ys[max(0, i - 9):i + 1]) for i in range(len(ys))]
            curves.plot(xs, ys, color=COLORS[r["arm"]], alpha=0.4 + 0.15 * (r["bits"] in (2, 0)),
                        linestyle={8: ":", 4: "-.", 3: "--", 2: "-", 0: "-"}[r["bits"]], linewidth=0.9,
                        label=f"{r['arm']} {r['bits'] or 'bf16'}")
        curves.set_title("train reward (10-step mean), seed 0; line style: 8 : 4 -. 3 -- 2 -", fontsize=9)
        curves.set_xlabel("step")
        curves.grid(alpha=0.3)
        curves.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", default="8,4,3,2", help="doses: widths, each with an optional group size (3g32)")
    ap.add_argument("--regimes", default="on,off")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: the preset's)")
    ap.add_argument("--eval-every", type=int, default=None, help="eval_every (default: the preset's)")
    ap.add_argument("--extra", nargs="*", default=[], help="more qarl train overrides for every run")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once, each pinned to one core")
    ap.add_argument("--out-dir", type=Path, default=Path("docs"))
    ap.add_argument("--runs-dir", type=Path, default=Path("runs/dose"))
    ap.add_argument("--finished-only", action="store_true",
                    help="train nothing: tabulate the runs of the plan that have finished")
    ap.add_argument("--start-only", type=int, default=0, metavar="N",
                    help="only evaluate the start model through each dose on N test problems, print and stop")
    args = ap.parse_args()
    import queue

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from qarl_cli.machine.capabilities import cpu_kind
    from qarl_cli.results import runs as run_records
    from qarl_cli.results.tables import markdown

    if args.start_only:
        rows = start_table(doses(args.bits), args.runs_dir, args.start_only)
        print(markdown(list(rows[0]), [list(r.values()) for r in rows]))
        (args.runs_dir / "start" / "start.json").write_text(json.dumps(rows, indent=1) + "\n")
        return
    todo = plan(doses(args.bits), args.regimes.split(","), args.arms.split(","), args.seeds)
    recorded = recorded_runs(args.out_dir / "dose_response.json")

    def finished(run: dict) -> bool:
        return (args.runs_dir / name(run) / "eval_masters" / "eval.json").is_file()

    if args.finished_only:
        todo = [run for run in todo if finished(run) or name(run) in recorded]
    cores = queue.Queue()
    for c in sorted(os.sched_getaffinity(0))[:args.jobs] if args.jobs > 1 else [None]:
        cores.put(c)
    flags = argparse.Namespace(steps=args.steps, prompts=None, samples=None, minibatches=None,
                               eval_every=args.eval_every, lr=None)
    start = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:
        task = bar.add_task(f"{len(todo)} runs", total=len(todo))

        def do(run: dict) -> dict:
            if not finished(run) and name(run) in recorded:
                bar.advance(task)
                return recorded[name(run)]
            core = cores.get()
            try:
                r = one_run(args.runs_dir / name(run), overrides(run) + args.extra, flags, core)
                masters = master_eval(args.runs_dir / name(run), core)
            finally:
                cores.put(core)
            first, last = r["summary"]["first"]["eval/avg@4"], r["summary"]["last"]["eval/avg@4"]
            bar.console.print(f"[dose] {name(run)}: avg@4 {first:.1%} -> {last:.1%} (bf16 masters {masters:.1%})",
                              markup=False)
            bar.advance(task)
            run_steps = step_rows(run_records.read(args.runs_dir / name(run)).rows)
            return {**run, "summary": r["summary"], "steps": [{k: s.get(k) for k in ("step", *PER_STEP)
                                                              if k in s} for s in run_steps],
                    "masters": masters, "wall_s": r["wall_s"], "cpu": cpu_kind()}  # paired seeds share a CPU

        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            results = list(pool.map(do, todo))
    rows, pairs = table(results), paired(results)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    plot(rows, results, args.out_dir / "dose_response.png")
    text = markdown(list(rows[0]), [list(map(str, r.values())) for r in rows])
    minutes = (time.perf_counter() - start) / 60
    reread = sum(1 for run in todo if not finished(run) and name(run) in recorded)
    scale = (f"{len(results)} runs ({reread} read back from the JSON of an earlier invocation), seeds "
             f"{sorted({r['seed'] for r in results})}, {sum(r['wall_s'] for r in results) / 60:.0f} run-minutes "
             f"({minutes:.0f} minutes for this invocation, {args.jobs} at once)")
    # The JSON is the study's record: runs an earlier invocation recorded outside this plan (another dose, regime
    # or arm) stay in it, so growing the study one leg at a time into one out-dir never drops a leg already run.
    planned = {name(r) for r in results}
    kept = [r for n, r in recorded.items() if n not in planned]
    if kept:
        scale += f"; the JSON also keeps {len(kept)} recorded runs outside this plan"
    start_file = args.runs_dir / "start" / "start.json"
    # The start table is kept in the study's JSON too, so that a checkout without the runs keeps it.
    earlier = args.out_dir / "dose_response.json"
    start = (json.loads(start_file.read_text()) if start_file.is_file()
             else json.loads(earlier.read_text()).get("start", []) if earlier.is_file() else [])
    start_md = ("\n## Before training: the start model through each dose\n\n`--start-only N` (`qarl eval` of "
                "model=tiny_sum on the first N test problems, rollout=torch):\n\n"
                + markdown(list(start[0]), [list(r.values()) for r in start])) if start else ""
    pairs_md = ("\n## Against naive, seed by seed\n\nFinal test avg@4 (quantized engine) of each arm minus naive's "
                "at the same regime, dose and seed (the seed fixes the problem order and the sampling), in points; "
                "same start: the pairs whose step-0 evaluation came out identical (a pair run on different CPU kinds "
                "may not; bf16 starts unquantized):\n\n"
                + markdown(list(pairs[0]), [list(r.values()) for r in pairs])) if pairs else ""
    (args.out_dir / "dose_response.md").write_text(
        "# The mismatch dose-response on the long-response task\n\nProduced by `scripts/dose_response.py` "
        f"(`{' '.join(sys.argv[1:]) or 'defaults'}`); numbers as measured, whichever way they came out.\n\n"
        f"Scale: {scale}.\n\n{text}\nnaive k3 and ESS: the naive arm's per-token k3 between its bf16 learner "
        "and the low-bit sampler, and the normalized effective sample size of its whole-sequence weights, means "
        "over the last third of its steps. k3 (own), error tokens, len and grad norm: the arm's own, over the same "
        "steps. final (quantized): the last test avg@4 through the run's own low-bit engine; final (bf16 masters): "
        "the final checkpoint's masters evaluated unquantized. A collapse: final avg@4 more than "
        f"{COLLAPSE_POINTS:g} points below the start, or the last 10 steps' train reward below half the first "
        "10's.\n\n![dose response](dose_response.png)\n" + pairs_md + start_md)
    (args.out_dir / "dose_response.json").write_text(json.dumps(
        {"scale": scale, "rows": rows, "paired": pairs, "start": start,
         "runs": [{k: v for k, v in r.items() if k != "summary"} | {"first": r["summary"]["first"],
                                                                    "last": r["summary"]["last"]}
                  for r in results + kept]}, indent=1)
        + "\n")
    print(text)
    print(f"{scale}; wrote {args.out_dir}/dose_response.md, .json and .png")


if __name__ == "__main__":
    main()
