"""`qarl plot` on metrics.jsonl files written here: which curves it draws (it says so on stdout), several runs and
a sweep's directory on the same axes, and one-line errors for what is not a run. The curves a real run draws
itself: test_sweep.py and test_train.py."""

import json

from qarl_cli.cli import main


def _write(run_dir, rows, overrides=()):
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    return run_dir


def _drawn(capsys) -> set:
    line = capsys.readouterr().out.strip().splitlines()[-1]
    return set(line.split(": ", 1)[1].split(", "))


ROWS = [{"step": 0, "eval/avg@2": 0.25, "eval/avg@2/arith level 1": 0.5, "eval/greedy_acc": 0.3},
        {"step": 1, "reward/mean": 0.4, "time/rollout": 1.5, "mismatch/abs_log_w_mean": 1e-4},
        {"step": 2, "reward/mean": 0.5, "time/rollout": 1.4, "eval/avg@2": 0.35, "eval/greedy_acc": 0.4,
         "response/neg_logprob_mean": 0.3}]


def test_plot_draws_the_eval_curves_a_run_logged(tmp_path, capsys):
    """avg@k is named after the run's eval_samples: a run with 2 samples logs eval/avg@2, and that is drawn;
    |log w| and the entropy estimate have panels of their own."""
    run = _write(tmp_path / "run", ROWS)
    assert main(["plot", str(run)]) == 0
    assert _drawn(capsys) == {"reward/mean", "eval/avg@2", "eval/greedy_acc", "time/rollout",
                              "mismatch/abs_log_w_mean", "response/neg_logprob_mean"}
    assert (run / "curves.png").stat().st_size > 10_000


def test_plot_draws_several_runs_and_a_sweeps_jobs_into_one_figure(tmp_path, capsys, monkeypatch):
    sweep = tmp_path / "sweep"
    for seed in (0, 1):
        _write(sweep / str(seed), ROWS[:2], [f"seed={seed}"])
    other = _write(tmp_path / "other", [{"step": 1, "reward/mean": 0.1, "mismatch/k3_kl": 1e-6}])
    (sweep / "multirun.yaml").write_text("{}\n")  # what Hydra leaves beside the jobs
    out = tmp_path / "both.png"
    assert main(["plot", str(sweep), str(other), "--out", str(out)]) == 0
    assert "(3 runs)" in capsys.readouterr().out and out.stat().st_size > 10_000
    monkeypatch.chdir(tmp_path)
    assert main(["plot", str(sweep / "0"), str(other)]) == 0  # several runs, no --out: here
    assert (tmp_path / "curves.png").is_file()


def test_plot_refuses_what_is_not_a_run_in_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    cases = [([str(tmp_path / "missing")], f"qarl plot: {tmp_path / 'missing'} does not exist"),  # not --out's
             ([str(tmp_path / "empty")], "is not a qarl run or sweep directory (no metrics.jsonl"),
             ([str(_write(tmp_path / "run", ROWS)), "--out", str(tmp_path / "x.txt")], "a figure file is expected")]
    for args, message in cases:
        assert main(["plot", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0] and err[0].startswith("qarl plot: "), err
