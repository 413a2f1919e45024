"""A model directory lacking a file a run reads (config.json, the tokenizer, the weights) fails in one line naming
the directory and the file, when it is resolved, for every command; and a resume with no steps left stops before
anything loads, leaving the run's records as they were."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qarl_cli.config.model import TinyModelConfig

QARL = [sys.executable, "-m", "qarl_cli.cli"]
SMALL = ["prompts_per_step=16", "samples_per_prompt=4", "data.test_size=16", "reward.num_workers=1"]


@pytest.fixture(scope="module")
def tiny():
    from qarl_cli.models.tiny import ensure_tiny_model

    return ensure_tiny_model(TinyModelConfig(), log=lambda _: None)  # built once per cache


def _qarl(*args, cwd):
    return subprocess.run([*QARL, *args], capture_output=True, text=True, timeout=600, cwd=cwd, env=os.environ)


def _one_error_line(out) -> str:
    assert out.returncode != 0 and "Traceback" not in out.stderr and "HYDRA_FULL_ERROR" not in out.stderr, \
        out.stderr[-3000:]
    errors = [ln for ln in out.stderr.splitlines() if ": error: " in ln]
    assert len(errors) == 1, out.stderr[-3000:]
    return errors[0]


@pytest.mark.parametrize("command,removed,named", [
    ("train", ["config.json"], "no config.json in"),
    ("train", ["tokenizer.json", "tokenizer_config.json"], "no tokenizer (tokenizer.json or tokenizer_config.json) in"),
    ("train", ["model.safetensors"], "no weights (model.safetensors"),
    ("eval", ["tokenizer.json", "tokenizer_config.json"], "no tokenizer (tokenizer.json or tokenizer_config.json) in"),
    ("quantize", ["model.safetensors"], "no weights (model.safetensors"),
])
def test_a_checkpoint_missing_a_file_fails_in_one_line_naming_it(tiny, tmp_path, command, removed, named):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny, ckpt)
    for name in removed:
        (ckpt / name).unlink()
    extra = {"train": ["dry_run=true", "rollout=torch"], "eval": ["rollout=torch", "limit=1"],
             "quantize": [f"out={tmp_path / 'out'}"]}[command]
    line = _one_error_line(_qarl(command, "model=hf", f"model.path={ckpt}", *extra, cwd=tmp_path))
    assert line.startswith(f"qarl {command}: error: model.path={ckpt}: {named}") and f" in {ckpt}" in line, line


def test_an_unreadable_config_json_is_named(tiny, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny, ckpt)
    (ckpt / "config.json").write_text('{"model_type": ')  # cut short
    line = _one_error_line(_qarl("train", "model=hf", f"model.path={ckpt}", "dry_run=true", "rollout=torch",
                                 cwd=tmp_path))
    assert f"{ckpt / 'config.json'} cannot be read" in line, line


def _snapshot(run: Path) -> dict:
    return {str(p.relative_to(run)): (p.stat().st_mtime_ns, p.read_bytes() if p.name == "metrics.jsonl" else None)
            for p in [run / "metrics.jsonl", *(run / "checkpoints").rglob("*")] if p.is_file()}


@pytest.mark.slow
def test_a_resume_with_no_steps_left_stops_before_loading_and_keeps_the_run(tiny, tmp_path):
    run = tmp_path / "run"
    args = [*SMALL, "rollout=torch", "eval_every=0", f"hydra.run.dir={run}"]
    out = _qarl("train", *args, "steps=2", "checkpoint_every=2", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    ckpt = run / "checkpoints" / "step_000002"
    before = _snapshot(run)
    assert (ckpt / "trainer.pt").is_file() and "metrics.jsonl" in before
    for steps, why in ((1, "has done 2 steps and steps=1 asks for fewer: set steps above 2 to train further"),
                       (2, "has done all steps=2: nothing to train; set steps above 2 to train further")):
        out = _qarl("train", *args, f"resume={run}", f"steps={steps}", cwd=tmp_path)
        assert out.returncode == 2
        assert _one_error_line(out) == f"qarl train: error: resume: checkpoint {ckpt} {why}"
        assert "Loading weights" not in out.stderr  # refused before any model loaded
        assert _snapshot(run) == before


def test_a_resume_checkpoint_missing_a_file_is_named(tiny, tmp_path):
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_000002"
    shutil.copytree(tiny, ckpt / "model")
    import torch

    torch.save({"step": 2}, ckpt / "trainer.pt")  # complete, never loaded: the model's check refuses first
    (ckpt / "model" / "model.safetensors").unlink()
    out = _qarl("train", *SMALL, "rollout=torch", "steps=3", f"resume={run}", f"hydra.run.dir={run}", cwd=tmp_path)
    line = _one_error_line(out)
    assert line == f"qarl train: error: resume={run}: no weights (model.safetensors, or model.safetensors.index.json " \
                   f"and its shards) in {ckpt / 'model'}", line


@pytest.mark.parametrize("option", [[], ["model=hf"]])
def test_a_training_checkpoint_folder_points_to_its_model(models, tmp_path, monkeypatch, capsys, option):
    """model.path=RUN/checkpoints/step_N (the folder rather than its model/) said "use model=hf model.path=SAME",
    which then failed with "no tokenizer": neither said model/. Both forms now name model/."""
    from qarl_cli.cli import main

    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "RUN" / "checkpoints" / "step_000002"
    shutil.copytree(models["dense"], ckpt / "model")
    (ckpt / "trainer.pt").write_bytes(b"state")
    assert main(["eval", *option, f"model.path={ckpt}", "limit=2", "rollout=torch"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ": error: " in ln]
    assert len(err) == 1 and err[0].endswith(f"{ckpt} is a training checkpoint; its model is {ckpt / 'model'}: "
                                             f"model.path={ckpt / 'model'}"), err
