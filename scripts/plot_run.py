"""Curves of a training run from its metrics.jsonl: reward and accuracy (train reward, test avg@k and greedy),
rollout mismatch (k3_kl), error-token rates, and the step-time split by stage.

    .venv/bin/python scripts/plot_run.py RUN_DIR [--out RUN_DIR/curves.png]"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PANELS = [
    ("reward and accuracy", ["reward/mean", "eval/avg@*", "eval/greedy_acc"]),  # avg@k for the run's eval_samples
    ("rollout mismatch", ["mismatch/k3_kl", "mismatch/abs_logp_diff_mean"]),
    ("error tokens", ["error_tokens/any_frac", "error_tokens/repeat_frac", "error_tokens/truncated_frac"]),
    ("seconds per step", ["time/rollout", "time/reward", "time/forward", "time/update", "time/sync"]),
]


def load(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"plot_run: {path} not found (is {run_dir} a qarl train run directory?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def curves(rows: list[dict], keys: list[str]) -> dict[str, list[tuple[int, float]]]:
    """key -> (step, value) of every row that has it, for the keys that some row has; a key ending in * stands for
    each key of the rows that it begins (eval/avg@* -> eval/avg@4, not eval/avg@4/level1)."""
    present = sorted({k for r in rows for k in r})
    names = []
    for key in keys:
        prefix = key.removesuffix("*")
        names += [k for k in present if k.startswith(prefix) and "/" not in k[len(prefix):]] if key != prefix \
            else [key]
    return {n: [(r["step"], r[n]) for r in rows if n in r] for n in names if any(n in r for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load(args.run_dir)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6))
    drawn = []
    for ax, (title, keys) in zip(axes, PANELS):
        for key, points in curves(rows, keys).items():
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o" if len(points) < 20 else None, label=key, linewidth=1.2)
            drawn.append(key)
        if title == "rollout mismatch":
            ax.set_yscale("symlog", linthresh=1e-6)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = args.out or args.run_dir / "curves.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}: {', '.join(drawn)}")


if __name__ == "__main__":
    main()
