"""A real sweep in this process (`qarl train -m`, the tiny model, the embedded engine): every job draws its own
curves.png (at each evaluation and at the end), writes status.json, and the sweep ends with summary.md, .json
and .png; a job that fails at run time is recorded, the next job and the summary still happen, and the exit code
says a job failed. A figure that cannot be drawn is one line, never a failed run."""

import json
from pathlib import Path

import pytest

from qarl_cli.cli import main
from qarl_cli.results import plot

# 2 steps of 2 prompts x 2 samples, evaluated at the start and after each step, on a one-layer model built
# without warm start (seconds to build into the test's cache).
TINY = ["model.warm_start_steps=0", "model.num_layers=1", "data.test_size=6", "reward.num_workers=1", "steps=2",
        "prompts_per_step=2", "samples_per_prompt=2", "eval_samples=1", "eval_every=1", "rollout=torch"]


@pytest.fixture
def sweep_here(tmp_path, monkeypatch, tmp_path_factory):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QARL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "sweep-cache"))

    def only_sweep() -> Path:
        [sweep] = list(tmp_path.glob("multirun/*/*"))
        return sweep
    return only_sweep


def _final(job: Path, key: str) -> float:
    rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r][-1]


def test_a_sweep_ends_with_its_summary_and_each_job_draws_its_curves(sweep_here, monkeypatch, capsys):
    drawn = []
    real = plot.draw
    monkeypatch.setattr(plot, "draw", lambda runs, out: drawn.append(out) or real(runs, out))
    assert main(["train", "-m", "seed=0,1", *TINY]) == 0
    sweep = sweep_here()
    jobs = [sweep / "0", sweep / "1"]
    # after step 1's evaluation, and at the end (step 2's evaluation is the end's)
    assert drawn == [jobs[0] / "curves.png"] * 2 + [jobs[1] / "curves.png"] * 2
    for job in jobs:
        assert (job / "curves.png").stat().st_size > 10_000
        assert json.loads((job / "status.json").read_text()) == {"status": "finished", "error": None}
    summary = json.loads((sweep / "summary.json").read_text())
    [group] = summary["groups"]  # the seed is not a setting: one group of two runs
    assert group["setting"] == [] and group["runs"] == ["0", "1"] and group["finished"] == 2
    finals = [_final(job, "eval/avg@1") for job in jobs]
    assert group["avg"]["mean"] == pytest.approx(sum(finals) / 2)
    assert group["avg"]["std"] == pytest.approx(abs(finals[0] - finals[1]) / 2 ** 0.5)  # n - 1 = 1
    assert [j["overrides"][0] for j in summary["jobs"]] == ["seed=0", "seed=1"]
    md = (sweep / "summary.md").read_text()
    assert "2 runs, 2 finished." in md and "| 0 | seed=0 | finished |" in md and "| (all) | 2 | 2 |" in md
    assert (sweep / "summary.png").stat().st_size > 10_000
    assert f"wrote summary.md, summary.json, summary.png in {sweep}" in capsys.readouterr().out


def test_a_failed_job_is_recorded_and_the_sweep_goes_on(sweep_here, monkeypatch, capsys, tmp_path):
    """Job 1 holds out all ten problems of its file for the test split: a valid config that fails only once the
    run reads the file (a resume of a missing checkpoint, say, is refused for the whole sweep before anything
    runs). Curves that cannot be drawn (a full disk, say) are one line in job 0, which still finishes."""
    def full_disk(runs, out):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plot, "draw", full_disk)
    data = tmp_path / "ten.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(10)))
    tiny = [a for a in TINY if not a.startswith("data.test_size=")]
    assert main(["train", "-m", "data=file", f"data.path={data}", "data.test_size=4,10", "max_new_tokens=32",
                 *tiny]) == 2  # the failed job's code (a bad value)
    sweep = sweep_here()
    out, err = capsys.readouterr()
    why = f"data.test_size=10: data.path={data} has 10 problems, and holding out 10"
    assert f"[qarl] {sweep / '0' / 'curves.png'} not drawn (OSError: [Errno 28] No space left on device)" in out
    assert f"qarl train: job {sweep / '1'} failed: {why}" in err
    assert "Traceback" not in err
    status = json.loads((sweep / "1" / "status.json").read_text())
    assert status["status"] == "failed" and status["error"].startswith(why)
    summary = json.loads((sweep / "summary.json").read_text())
    assert [(j["run"], j["status"]) for j in summary["jobs"]] == [("0", "finished"), ("1", "failed")]
    assert [g["finished"] for g in summary["groups"]] == [1, 0]
    assert f"| 1 | data.test_size=10 | failed: {why}" in (sweep / "summary.md").read_text()


def test_a_sweep_value_that_cannot_run_is_refused_before_any_job(sweep_here, capsys, tmp_path):
    """A value whose refusal depends only on the disk (a resume of a checkpoint that does not exist) stops the
    whole sweep in one line before Hydra creates its directory: no job runs and nothing is written."""
    missing = tmp_path / "nothing"
    assert main(["train", "-m", f"resume=null,{missing}", *TINY]) == 2
    assert not (tmp_path / "multirun").exists()
    err = capsys.readouterr().err
    assert err.startswith(f"qarl train: error: resume='{missing}': no checkpoint") and len(err.splitlines()) == 1


def test_a_sweep_into_a_directory_holding_one_is_refused_before_hydra_writes(sweep_here, capsys, tmp_path):
    """The second launch into the same hydra.sweep.dir had Hydra rewrite multirun.yaml and every job's .hydra/
    records, each job was then refused for holding a run, and the summary was rewritten: now refused in one
    line with every byte of the first sweep kept. overwrite=true replaces its runs."""
    from disk_snapshot import changes, snapshot

    sweep = tmp_path / "mine"
    args = ["train", "-m", "seed=0,1", *TINY, "steps=1", f"hydra.sweep.dir={sweep}"]
    assert main(args) == 0
    capsys.readouterr()
    before = snapshot(sweep)
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"qarl train: error: hydra.sweep.dir='{sweep}' already holds a sweep (multirun.yaml, "
                   "summary.json, 0, 1): give this sweep a new directory (the default is a new one per launch), "
                   "or replace its runs with overwrite=true"]
    assert changes(before, snapshot(sweep)) == []
    assert main([*args, "overwrite=true"]) == 0
    assert json.loads((sweep / "summary.json").read_text())["groups"][0]["finished"] == 2
