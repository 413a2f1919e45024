"""A run directory belongs to one live run: the lock, fresh runs into a used directory, what a resume may change,
and the records a resume cuts back (train.rundir); then the CLI's one-line refusals, which leave the record of the
earlier run as it was."""

import json
import os
import signal
import subprocess
import sys

import pytest

from qarl_cli.cli import main
from qarl_cli.config.errors import ConfigError
from qarl_cli.train import rundir

HOLD = """
import sys
from pathlib import Path
from qarl_cli.train.rundir import claim
claim(Path(sys.argv[1]))
print("held", flush=True)
sys.stdin.read()
"""


def test_a_live_process_holds_the_directory_and_a_dead_one_does_not(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(rundir.RunDirInUse, match=f"in use by another qarl train \\(pid {holder.pid}\\)"):
            rundir.claim(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    rundir.claim(tmp_path)  # the kernel dropped the dead process's lock
    rundir.claim(tmp_path)  # and claiming again in the same process is a no-op
    assert (tmp_path / rundir.LOCK).read_text() == str(os.getpid())


def test_a_fresh_run_refuses_a_directory_holding_a_run_unless_told_to_replace_it(tmp_path):
    rundir.check_fresh(tmp_path, overwrite=False)  # empty: fine
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "checkpoints" / ".step_000001.tmp-1").mkdir(parents=True)  # stopped in its first checkpoint
    with pytest.raises(ConfigError, match="stopped before its first checkpoint.*overwrite=true") as err:
        rundir.check_fresh(tmp_path, overwrite=False)
    assert "resume" not in str(err.value).replace("to resume", "")  # resume=true would find nothing
    (tmp_path / "checkpoints" / "step_000001").mkdir()
    (tmp_path / "checkpoints" / "step_000001" / "trainer.pt").write_bytes(b"x")
    with pytest.raises(ConfigError, match="already holds a run.*resume=true.*overwrite=true"):
        rundir.check_fresh(tmp_path, overwrite=False)
    assert (tmp_path / "metrics.jsonl").exists()  # a refusal loses nothing
    rundir.check_fresh(tmp_path, overwrite=True)
    aside = rundir.set_aside(tmp_path)  # replaced: moved beside, not deleted, until the new run has a checkpoint
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoints").exists()
    assert (aside / "metrics.jsonl").read_text() == '{"step": 1}\n' and (aside / "checkpoints").is_dir()
    rundir.drop_replaced(tmp_path)
    assert not aside.exists()


def test_resume_refuses_changed_keys_by_name_and_allows_the_resumable_ones(tmp_path):
    saved = {"lr": 0.002, "steps": 160, "quant": {"name": "int8", "kernel": "fake"}, "logger": {"name": "console"}}
    (tmp_path / rundir.CONFIG).write_text(json.dumps(saved))
    rundir.check_resume(tmp_path, {**saved, "steps": 320, "logger": {"name": "wandb"}})  # run longer, log elsewhere
    with pytest.raises(ConfigError) as err:
        rundir.check_resume(tmp_path, {**saved, "lr": 0.001, "quant": {"name": "w4a16", "kernel": "fake"}})
    message = str(err.value)
    assert "lr=0.001 (was 0.002)" in message and "quant.name='w4a16' (was 'int8')" in message
    assert "\n" not in message


def test_resume_cuts_the_records_back_to_its_checkpoint(tmp_path):
    lines = [json.dumps({"step": s, "reward/mean": s / 10}) for s in (0, 1, 2, 3, 4)] + ['{"step": 5, "rew']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    partial = tmp_path / "checkpoints" / ".step_000004.tmp-12345"
    partial.mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000002").mkdir()
    rundir.tidy_for_resume(tmp_path, 2, "metrics.jsonl", main=True)
    assert (tmp_path / "metrics.jsonl").read_text() == "\n".join(lines[:3]) + "\n"
    assert not partial.exists() and (tmp_path / "checkpoints" / "step_000002").is_dir()


def test_cli_refuses_a_fresh_run_into_a_used_directory_and_keeps_its_record(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("lr: 0.002  # the earlier run's record\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["train", f"hydra.run.dir={run}", "rollout=torch"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "already holds a run" in err[0] and str(run) in err[0]
    assert (run / ".hydra" / "config.yaml").read_text() == "lr: 0.002  # the earlier run's record\n"
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'


@pytest.mark.parametrize("args,names", [
    (["samples_per_prompt=1"], ["samples_per_prompt=1", ">= 2"]),
    (["eval_every=-1"], ["eval_every=-1", ">= 0"]),
    (["checkpoint_every=-1"], ["checkpoint_every=-1", ">= 0"]),
])
def test_values_that_would_train_or_save_nothing_are_refused(capsys, args, names):
    assert main(["train", *args, "--cfg", "job"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(n in err for n in names), err
