"""The CLI: help without torch, Hydra's flags, run directories, multirun, and the commands' errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qarl_cli.cli import COMMANDS, main

QARL = [sys.executable, "-m", "qarl_cli.cli"]


def _run(args, cwd, **env):
    return subprocess.run([*QARL, *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})


def test_help_lists_commands_without_importing_torch():
    code = ("import sys; from qarl_cli.cli import main; rc = main(['--help']); "
            "heavy = [m for m in ('torch', 'vllm', 'transformers', 'hydra') if m in sys.modules]; "
            "print('HEAVY', heavy); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "HEAVY []" in out.stdout
    for command in COMMANDS:
        assert f"  {command}" in out.stdout


def test_unknown_command(capsys):
    assert main(["trian"]) == 2
    assert "trian" in capsys.readouterr().err


def test_command_help_shows_groups(tmp_path):
    out = _run(["train", "--help"], tmp_path)
    assert out.returncode == 0, out.stderr
    for group in ("quant", "rollout", "algorithm"):
        assert group in out.stdout
    assert "int8" in out.stdout and "tbpo" in out.stdout


def test_cfg_job_prints_the_experiment(tmp_path):
    out = _run(["train", "--cfg", "job", "+experiment=qwen3_30b_a3b_fp8"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "name: fp8_block" in out.stdout and "enable_expert_parallel: true" in out.stdout
    assert not (tmp_path / "outputs").exists()  # printing a config runs nothing


def test_unimplemented_stage_says_so(tmp_path, capsys, monkeypatch):
    """An option that composes but has no implementation (as a plugin's would, before it is installed)."""
    from qarl_cli import stages

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(stages.IMPLEMENTATIONS, "rollout", {"vllm": stages.IMPLEMENTATIONS["rollout"]["vllm"]})
    assert main(["eval", "rollout=torch", "model.warm_start_steps=0", "model.num_layers=1"]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]  # (transformers' progress bars also go there)
    assert len(errors) == 1 and "rollout=torch" in errors[0] and "Traceback" not in err


# The smallest real run; the embedded engine starts in a second (vLLM runs are covered by test_train).
TINY = ["model.warm_start_steps=0", "model.num_layers=1", "data.test_size=6", "reward.num_workers=1", "steps=1",
        "prompts_per_step=2", "samples_per_prompt=2", "eval_samples=1", "rollout=torch"]


def test_multirun_launches_one_job_per_value_into_separate_dirs(tmp_path):
    out = _run(["train", "-m", "seed=0,1", *TINY], tmp_path, QARL_CACHE_DIR=str(tmp_path / "cache"))
    assert out.returncode == 0, out.stderr[-2000:]
    sweeps = list((tmp_path / "multirun").glob("*/*"))
    assert len(sweeps) == 1
    jobs = sorted(p for p in sweeps[0].iterdir() if p.is_dir())
    assert [p.name for p in jobs] == ["0", "1"]
    seeds = [(p / ".hydra" / "overrides.yaml").read_text() for p in jobs]
    assert "seed=0" in seeds[0] and "seed=1" in seeds[1]
    for job in jobs:
        assert json.loads((job / "summary.json").read_text())["last"]["eval/greedy_acc"] >= 0


def test_two_runs_started_together_get_their_own_dirs(tmp_path):
    env = {**os.environ, "QARL_CACHE_DIR": str(tmp_path / "cache")}
    _run(["train", *TINY], tmp_path, QARL_CACHE_DIR=env["QARL_CACHE_DIR"])  # build the model once
    procs = [subprocess.Popen([*QARL, "train", *TINY], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=600) == 0, p.stderr.read()[-2000:]
    runs = list((tmp_path / "outputs").glob("*/*"))
    assert len(runs) == 3 and len({r.name for r in runs}) == 3
