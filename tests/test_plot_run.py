"""scripts/plot_run.py on a metrics.jsonl written here: which curves it draws (it says so on stdout). The
end-to-end run's plot: test_train.py."""

import json
import subprocess
import sys
from pathlib import Path


def _plot(run_dir) -> set:
    plot = subprocess.run([sys.executable, "scripts/plot_run.py", str(run_dir)], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parents[1])
    assert plot.returncode == 0, plot.stderr
    return set(plot.stdout.strip().split(": ", 1)[1].split(", "))


def test_plot_draws_the_eval_curves_a_run_logged(tmp_path):
    """avg@k is named after the run's eval_samples: a run with 2 samples logs eval/avg@2, and that is drawn."""
    rows = [{"step": 0, "eval/avg@2": 0.25, "eval/avg@2/arith level 1": 0.5, "eval/greedy_acc": 0.3},
            {"step": 1, "reward/mean": 0.4, "time/rollout": 1.5},
            {"step": 2, "reward/mean": 0.5, "time/rollout": 1.4, "eval/avg@2": 0.35, "eval/greedy_acc": 0.4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _plot(tmp_path) == {"reward/mean", "eval/avg@2", "eval/greedy_acc", "time/rollout"}
    assert (tmp_path / "curves.png").is_file()
