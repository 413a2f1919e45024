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


def test_help_into_a_pipe_whose_reader_has_gone_is_quiet():
    # `qarl --help | head -3`: the reader exits before the help is written. The pipe's read end is closed before
    # qarl starts, so every write fails, deterministically.
    read, write = os.pipe()
    os.close(read)
    try:
        out = subprocess.run([*QARL, "--help"], stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert out.returncode == 141, out.stderr
    assert out.stderr == ""  # no traceback, no "Exception ignored" at the interpreter's exit


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
    """An option whose implementation needs a package that is not installed (as a plugin's engine would)."""
    from qarl_cli.config.stages import TorchRolloutConfig

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(TorchRolloutConfig, "impl", "qarl_plugin_not_installed.engine:Engine")
    assert main(["eval", "rollout=torch", "model.warm_start_steps=0", "model.num_layers=1"]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]  # (transformers' progress bars also go there)
    assert len(errors) == 1 and "rollout=torch" in errors[0] and "qarl_plugin_not_installed" in errors[0]
    assert "Traceback" not in err


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
    for seed, job in enumerate(jobs):  # each job ran its own composed config to the end, into its own directory
        assert f"\nseed: {seed}\n" in (job / ".hydra" / "config.yaml").read_text()
        assert [json.loads(line)["step"] for line in (job / "metrics.jsonl").read_text().splitlines()] == [0, 1]
        summary = json.loads((job / "summary.json").read_text())
        assert [h["step"] for h in summary["history"]] == [0, 1] and Path(summary["run_dir"]).resolve() == job.resolve()


def test_two_runs_started_in_the_same_second_get_their_own_dirs(tmp_path, monkeypatch):
    """The run directory is outputs/DATE/TIME-ID: two runs started in the same second (the clock held still
    here) must still differ, by their ids, and each must hold its own run."""
    from qarl_cli.config import registry

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QARL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(registry.time, "strftime", lambda fmt, *args: "12-00-00")
    assert main(["train", *TINY]) == 0
    assert main(["train", *TINY, "seed=1"]) == 0
    runs = sorted(tmp_path.glob("outputs/*/*"))
    assert len(runs) == 2 and all(r.name.startswith("12-00-00-") for r in runs)
    seeds = sorted((r / ".hydra" / "config.yaml").read_text().split("\nseed: ")[1].split("\n")[0] for r in runs)
    assert seeds == ["0", "1"] and all((r / "summary.json").is_file() for r in runs)
