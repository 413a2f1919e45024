"""Curves of one or several runs from their metrics.jsonl, on the same axes: train reward, held-out avg@k and
greedy accuracy, rollout mismatch (k3_kl and |log w|), error-token rates, entropy, and the step time by stage.
One run: a colour per curve. Several: a colour per run, a line style per curve. `qarl train` draws its own
curves.png at each evaluation and at the end (draw_quietly); `qarl plot` draws any runs."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from qarl_cli.results.runs import METRICS, Run, labels, read

CURVES = "curves.png"
# (title, keys, log scale); a key ending in * stands for each key it begins (eval/avg@* -> eval/avg@4, the k of
# the run's eval_samples, and not eval/avg@4/<group>).
PANELS = [
    ("train reward", ["reward/mean"], False),
    ("held-out accuracy", ["eval/avg@*", "eval/greedy_acc"], False),
    ("rollout mismatch", ["mismatch/k3_kl", "mismatch/abs_log_w_mean"], True),
    ("error tokens (share of samples)", ["error_tokens/any_frac", "error_tokens/repeat_frac",
                                         "error_tokens/truncated_frac", "error_tokens/garbled_frac"], False),
    # -mean log mu of the sampled tokens (the sampler's entropy at temperature 1), and the objective's own
    # entropy where entropy_coef is set
    ("entropy", ["response/neg_logprob_mean", "objective/entropy"], False),
    ("seconds per step, by stage", ["time/rollout", "time/reward", "time/forward", "time/update", "time/sync"],
     False),
]
NAMES = {"mismatch/abs_log_w_mean": "|log w|", "response/neg_logprob_mean": "-log mu"}
STYLES = ["-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1))]  # the time panel has five curves
LINTHRESH = 1e-16  # mismatch runs from 1e-14 (fp32 rounding) to 1e-2, and is exactly 0 at times: symlog keeps all


def curves(rows: list[dict], keys: list[str]) -> dict[str, list[tuple[int, float]]]:
    """key -> (step, value) of every row that has it, for the keys some row has (patterns expanded)."""
    present = sorted({k for r in rows for k in r})
    names: list[str] = []
    for key in keys:
        prefix = key.removesuffix("*")
        names += [k for k in present if k.startswith(prefix) and "/" not in k[len(prefix):]] if key != prefix \
            else [key]
    return {n: [(r["step"], r[n]) for r in rows if n in r] for n in names if any(n in r for r in rows)}


def draw(runs: list[Run], out: Path) -> list[str]:
    """Draw the runs into `out`; returns the keys drawn."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend

    fig = Figure(figsize=(16, 8))
    axes = fig.subplots(2, 3).flatten()
    several = len(runs) > 1
    colours = [f"C{i % 10}" for i in range(len(runs))]
    drawn: list[str] = []
    for ax, (title, keys, log) in zip(axes, PANELS):
        for run, colour in zip(runs, colours):
            for i, (key, points) in enumerate(curves(run.rows, keys).items()):
                xs, ys = zip(*points)
                style = dict(color=colour, linestyle=STYLES[i % len(STYLES)]) if several else {}
                ax.plot(xs, ys, marker="o" if len(points) < 20 else None, markersize=3, linewidth=1.2,
                        label=NAMES.get(key, key.split("/", 1)[1]), **style)
                drawn += [key] if key not in drawn else []
        _finish(ax, title, log, several)
    if several:
        legend_below(fig, [_line(c) for c in colours], labels(runs))
    else:
        fig.tight_layout()
    fig.savefig(out, dpi=100)
    return drawn


def legend_below(fig, handles: list, names: list[str], width: int = 80) -> None:
    """A legend under the panels, its long names (a run's overrides) wrapped, the figure grown to hold it."""
    import textwrap

    names = ["\n".join(textwrap.wrap(n, width)) for n in names]
    ncol = 1 if len(names) < 4 else 2
    rows = [max(n.count("\n") + 1 for n in names[i:i + ncol]) for i in range(0, len(names), ncol)]
    extra = 0.15 * sum(rows) + 0.08 * len(rows) + 0.15  # inches: a line of 8-point text and the gap between rows
    w, h = fig.get_size_inches()
    fig.set_size_inches(w, h + extra)
    fig.legend(handles, names, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, extra / (h + extra), 1, 1))


def _finish(ax, title: str, log: bool, several: bool) -> None:
    if log:
        ax.set_yscale("symlog", linthresh=LINTHRESH)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    handles, names = ax.get_legend_handles_labels()
    if several:  # one entry per curve name, drawn in grey: the runs are told apart by the figure's legend
        seen = dict(zip(names, handles))
        handles = [_grey(h) for h in seen.values()]
        names = list(seen)
    if handles:
        ax.legend(handles, names, fontsize=7)


def _line(colour: str):
    from matplotlib.lines import Line2D

    return Line2D([], [], color=colour)


def _grey(handle):
    line = _line("0.4")
    line.update_from(handle)  # its line style, dash pattern included
    line.set_color("0.4")
    return line


def draw_quietly(run_dir: Path, warn: Callable[[str], None], metrics: str = METRICS) -> None:
    """The run's own curves.png, while it trains: a figure that cannot be drawn (a missing font, a full disk)
    is reported in one line and does not stop the run."""
    try:
        draw([read(run_dir, metrics)], run_dir / CURVES)
    except Exception as e:  # noqa: BLE001 - the curves are a view of the run, never a reason to end it
        first = (str(e).strip().splitlines() or [""])[0]
        warn(f"[qarl] {run_dir / CURVES} not drawn ({type(e).__name__}: {first})")
