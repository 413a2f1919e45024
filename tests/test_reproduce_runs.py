"""The study scripts' runs (scripts/reproduce_tiny.py's `one_run`, which scripts/dose_response.py calls): a launch
into a run directory that another process is training in is refused by `qarl train`'s lock, and leaves that run's
console log whole. Before the log was appended to, the refused launch truncated it: two study invocations that
both planned one unfinished run cut the first 117 steps of that run's console output (its metrics were
untouched)."""

import argparse
import fcntl
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_a_refused_launch_keeps_the_live_runs_log(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from reproduce_tiny import one_run

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    live = "[qarl] step 1/240: reward 0.031 (the live run's console so far)\n"
    (run_dir / "stdout.log").write_text(live)
    flags = argparse.Namespace(steps=1, prompts=None, samples=None, minibatches=None, eval_every=0, lr=None)
    with open(run_dir / ".qarl.lock", "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a live `qarl train` holds
        lock.write("4242")
        lock.flush()
        with pytest.raises(SystemExit, match="failed"):
            one_run(run_dir, ["rollout=torch", "quant=none"], flags, None)
    log = (run_dir / "stdout.log").read_text()
    assert log.startswith(live)
    assert "is in use by another qarl train (pid 4242)" in log[len(live):]
    assert not (run_dir / "summary.json").exists()
