"""`qarl compare` on run directories written here with known numbers: the per-run records, the grouping by every
override but the seed, the mean ± std over each group's finished runs (worked out by hand below), failed runs
listed with their reason and left out of the means, and one-line errors for what is not a run."""

import json
import math

from qarl_cli.cli import main


def _run(run_dir, overrides, final, times, k3, status=None, error_log=None):
    """A run of len(times) steps; `final` = (avg@4, greedy, pass@4) at its last step's evaluation."""
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    rows = [{"step": 0, "eval/avg@4": 0.1, "eval/greedy_acc": 0.1, "eval/pass@4": 0.1}]
    for i, (t, kl) in enumerate(zip(times, k3), 1):
        rows.append({"step": i, "reward/mean": 0.5, "time/step": t, "mismatch/k3_kl": kl})
    if final:
        rows[-1].update({"eval/avg@4": final[0], "eval/greedy_acc": final[1], "eval/pass@4": final[2]})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if status:
        (run_dir / "status.json").write_text(json.dumps(status))
    if error_log:
        (run_dir / "error.log").write_text(error_log)
    return run_dir


def _sweep(root):
    done = {"status": "finished", "error": None}
    # 3 steps each: "late" mismatch is the last third of the steps, here the last step's
    _run(root / "0", ["steps=3", "lr=1", "seed=0"], (0.3, 0.4, 0.5), [1.0, 2.0, 3.0], [1e-3, 2e-3, 4e-3], done)
    _run(root / "1", ["steps=3", "lr=1", "seed=1"], (0.5, 0.6, 0.7), [2.0, 2.0, 2.0], [1e-3, 1e-3, 6e-3], done)
    _run(root / "2", ["steps=3", "lr=2", "seed=0"], (0.2, 0.2, 0.2), [4.0, 4.0, 4.0], [0.0, 0.0, 0.0], done)
    _run(root / "3", ["steps=3", "lr=2", "seed=1"], None, [9.0], [1.0],
         {"status": "failed", "error": "rollout failed at step 2 (RuntimeError: boom)"})
    (root / "multirun.yaml").write_text("{}\n")
    return root


def test_compare_groups_by_setting_with_mean_and_std_over_seeds(tmp_path, capsys):
    sweep = _sweep(tmp_path / "sweep")
    assert main(["compare", str(sweep)]) == 0  # one sweep: its summary goes into it
    out = capsys.readouterr().out
    summary = json.loads((sweep / "summary.json").read_text())
    assert summary["common_overrides"] == ["steps=3"] and summary["k"] == 4
    lr1, lr2 = summary["groups"]
    assert lr1["setting"] == ["lr=1"] and lr1["runs"] == ["0", "1"] and lr1["finished"] == 2
    # by hand: avg@4 0.3 and 0.5 -> mean 0.4, sample std sqrt((0.1^2 + 0.1^2) / 1) = sqrt(0.02)
    assert math.isclose(lr1["avg"]["mean"], 0.4) and math.isclose(lr1["avg"]["std"], math.sqrt(0.02))
    assert math.isclose(lr1["s_per_step"]["mean"], 2.0) and lr1["s_per_step"]["std"] == 0.0  # means 2.0 and 2.0
    # k3 of the last third (one step of three): 4e-3 and 6e-3 -> 5e-3 ± sqrt(2) * 1e-3
    assert math.isclose(lr1["k3_kl"]["mean"], 5e-3) and math.isclose(lr1["k3_kl"]["std"], math.sqrt(2) * 1e-3)
    # the failed job is listed, not averaged: lr=2 is its one finished run
    assert lr2["runs"] == ["2", "3"] and lr2["finished"] == 1 and lr2["avg"] == {"mean": 0.2, "std": 0.0}
    jobs = {j["run"]: j for j in summary["jobs"]}
    assert jobs["3"]["status"] == "failed" and "boom" in jobs["3"]["error"]
    assert jobs["0"]["pass"] == 0.5 and jobs["0"]["s_per_step"] == 2.0
    md = (sweep / "summary.md").read_text()
    assert "| lr=1 | 2 | 2 | 40.0 ± 14.1 | 50.0 ± 14.1 | 60.0 ± 14.1 | 2.00 ± 0.00 | 5.00e-03 ± 1.41e-03 |" in md
    assert "| 3 | lr=2 seed=1 | failed: rollout failed at step 2 (RuntimeError: boom) |" in md
    assert "4 runs, 3 finished, 1 not (3)" in md and "![held-out accuracy by setting](summary.png)" in md
    assert (sweep / "summary.png").stat().st_size > 10_000
    assert "40.0 ± 14.1" in out and "failed: rollout failed" in out  # the same tables on the console


def test_compare_runs_made_apart_and_runs_without_status(tmp_path, capsys, monkeypatch):
    """Runs older than status.json: finished when they wrote summary.json, failed (error.log's last line) when
    they left an error.log. Several directories: the comparison goes to compare/DATE/TIME/ here."""
    a = _run(tmp_path / "runs" / "a", ["lr=1", "seed=0"], (0.3, 0.3, 0.3), [1.0], [0.0])
    (a / "summary.json").write_text("{}")
    b = _run(tmp_path / "runs" / "b", ["lr=1", "seed=1"], None, [1.0], [0.0],
             error_log="Traceback ...\nOSError: [Errno 28] No space left on device\n")
    monkeypatch.chdir(tmp_path)
    assert main(["compare", str(a), str(b)]) == 0
    [written] = list(tmp_path.glob("compare/*/*/summary.json"))
    jobs = json.loads(written.read_text())["jobs"]
    assert [(j["status"], j["error"]) for j in jobs] == [
        ("finished", None), ("failed", "OSError: [Errno 28] No space left on device")]
    assert main(["compare", str(a), "--out", str(b)]) == 2  # a run's summary.json is its own
    assert "is a run directory" in capsys.readouterr().err


def test_compare_refuses_what_is_not_a_run_in_one_line(tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    assert main(["compare", str(tmp_path / "notes")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"qarl compare: {tmp_path / 'notes'} is not a qarl run or sweep directory (no metrics.jsonl in "
                   "it or its sub-directories)"]
