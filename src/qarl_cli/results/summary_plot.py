"""summary.png: per setting (the runs grouped as in results.summary), the mean over its finished runs of the
held-out avg@k, the greedy accuracy and the train reward, step by step, with a band of ± one standard deviation
where a setting has several runs."""

from __future__ import annotations

import statistics
from pathlib import Path

from qarl_cli.results.plot import legend_below
from qarl_cli.results.runs import FINISHED, Run
from qarl_cli.results.summary import mean_std, setting

REWARD_SMOOTH = 5  # train reward is one batch's mean: a running mean of this many steps shows the trend


def mean_curve(runs: list[Run], key: str, smooth: int = 1) -> tuple[list[int], list[float], list[float]]:
    """Steps at which every run logged `key`, and the mean and std over the runs there (after a running mean
    of `smooth` points along each run)."""
    per_run = []
    for run in runs:
        pts = [(r["step"], r[key]) for r in run.rows if key in r]
        ys = [statistics.fmean(v for _, v in pts[max(0, i - smooth + 1):i + 1]) for i in range(len(pts))]
        per_run.append(dict(zip((s for s, _ in pts), ys)))
    steps = sorted(set.intersection(*(set(c) for c in per_run))) if per_run else []
    stats = [mean_std([c[s] for c in per_run]) for s in steps]
    return steps, [m for m, _ in stats], [sd for _, sd in stats]


def draw(runs: list[Run], summary: dict, out: Path) -> None:
    from matplotlib.figure import Figure

    k = summary["k"]
    panels = [(f"eval/avg@{k}", f"held-out avg@{k}", 1), ("eval/greedy_acc", "held-out greedy accuracy", 1),
              ("reward/mean", f"train reward ({REWARD_SMOOTH}-step mean)", REWARD_SMOOTH)]
    by: dict[tuple, list[Run]] = {}
    for run in runs:
        if run.status == FINISHED:
            by.setdefault(tuple(setting(run.overrides, summary["common_overrides"])), []).append(run)
    fig = Figure(figsize=(16, 4.8))
    axes = fig.subplots(1, len(panels))
    for ax, (key, title, smooth) in zip(axes, panels):
        for i, (name, members) in enumerate(by.items()):
            steps, mean, std = mean_curve(members, key, smooth)
            if not steps:
                continue
            label = f"{' '.join(name) or 'all runs'} (n={len(members)})"
            ax.plot(steps, mean, color=f"C{i % 10}", marker="o" if len(steps) < 20 else None, markersize=3,
                    label=label)
            if len(members) > 1:
                ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                                color=f"C{i % 10}", alpha=0.15)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    if handles:
        legend_below(fig, handles, names)
    else:
        fig.tight_layout()
    fig.savefig(out, dpi=100)
