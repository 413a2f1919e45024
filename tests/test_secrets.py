"""A key given on the command line never reaches what a run writes: the run directory (`.hydra/` record, logs,
checkpoints' config), a sweep's `multirun.yaml`, the loggers' config. What is recorded is that one was set."""

import os
import subprocess
import sys

from qarl_cli.config.secrets import REDACTED, redact, scrub_files

SECRET = "k3y-th4t-must-n0t-l3ak"


def test_redact_replaces_set_secret_fields_at_any_depth():
    cfg = {"rollout": {"api_key": SECRET, "urls": ["http://h:1"]}, "runs": [{"api_key": None}], "lr": 1e-3}
    assert redact(cfg) == {"rollout": {"api_key": REDACTED, "urls": ["http://h:1"]}, "runs": [{"api_key": None}],
                           "lr": 1e-3}


def test_scrub_files_rewrites_only_files_holding_the_secret(tmp_path):
    holding, clean = tmp_path / "a.yaml", tmp_path / "b.yaml"
    holding.write_text(f"- rollout.api_key={SECRET}\nkey: {SECRET}\n")
    clean.write_text("lr: 0.001\n")
    before = clean.stat().st_mtime_ns
    scrub_files([holding, clean, tmp_path / "missing.yaml"], [SECRET])
    assert holding.read_text() == f"- rollout.api_key={REDACTED}\nkey: {REDACTED}\n"
    assert clean.stat().st_mtime_ns == before


def _grep(root, text):
    return [p for p in root.rglob("*") if p.is_file() and text.encode() in p.read_bytes()]


def test_a_key_on_the_command_line_reaches_no_file_of_the_run_or_the_sweep(tmp_path):
    """A run (attached to nothing, so it stops after Hydra wrote its record) and a two-job sweep of them."""
    args = ["rollout=vllm_server", f"rollout.api_key={SECRET}", "rollout.urls=[http://127.0.0.1:1]", "rollout.attach_grace_s=1", "steps=1",
            "eval_every=0"]
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "qarl_cli.cli", "train", *args, f"hydra.run.dir={run}"],
                         capture_output=True, text=True, timeout=300, env=os.environ)
    assert out.returncode != 0 and "nothing answers at http://127.0.0.1:1" in out.stderr, out.stderr[-2000:]
    assert (run / ".hydra" / "overrides.yaml").read_text().count(f"rollout.api_key={REDACTED}") == 1
    assert _grep(run, SECRET) == [] and SECRET not in out.stdout + out.stderr
    sweep = tmp_path / "sweep"
    out = subprocess.run([sys.executable, "-m", "qarl_cli.cli", "train", "-m", *args, "seed=0,1",
                          f"hydra.sweep.dir={sweep}"], capture_output=True, text=True, timeout=300, env=os.environ)
    assert (sweep / "multirun.yaml").is_file(), out.stderr[-2000:]
    assert _grep(sweep, SECRET) == []


ARGV_DURING_THE_JOB = """
import sys
import qarl_cli.commands.train as train
from qarl_cli.cli import main
train.run = lambda cfg, run_dir: print("argv:", sys.argv) or 0
sys.exit(main(sys.argv[1:]))
"""


def test_the_command_line_libraries_see_during_the_job_has_no_key(tmp_path):
    """wandb records sys.argv in its run's metadata (it put a key given on the command line into the offline run
    file): during the job the key in sys.argv is replaced, and the real argv is back afterwards."""
    out = subprocess.run([sys.executable, "-c", ARGV_DURING_THE_JOB, "train", "rollout=vllm_server",
                          f"rollout.api_key={SECRET}", f"hydra.run.dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, timeout=300, env=os.environ)
    assert out.returncode == 0, out.stderr[-2000:]
    argv = next(line for line in out.stdout.splitlines() if line.startswith("argv:"))
    assert SECRET not in argv and f"rollout.api_key={REDACTED}" in argv, argv
