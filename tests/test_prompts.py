"""Prompts are encoded in one place (data.prompts) and every prompt must fit the engine's context with
max_new_tokens of room: a file's prompts are checked when the run starts, and one that does not fit is a one-line
error naming its file and line, before any engine starts."""

import json

import pytest

from qarl_cli.cli import main
from qarl_cli.data.base import Problem
from qarl_cli.data.prompts import PromptTooLong, chat_messages, check_lengths
from qarl_cli.config.data import FileDataConfig

TINY = ["model.warm_start_steps=0", "model.num_layers=1", "rollout=torch", "reward.num_workers=1"]


def test_the_template_puts_system_problem_and_instruction_in_order():
    cfg = FileDataConfig(path="x", system_prompt="Be brief.", instruction="Box it.")
    assert chat_messages(cfg, Problem("1+1?", "2")) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?\n\nBox it."}]
    assert chat_messages(FileDataConfig(path="x", instruction=""), Problem("1+1?", "2")) == [
        {"role": "user", "content": "1+1?"}]


def test_check_lengths_names_the_first_prompt_that_leaves_no_room():
    problems = [Problem("a", "1", origin="f.jsonl, line 1"), Problem("b", "2", origin="f.jsonl, line 2")]
    check_lengths([[0] * 100, [0] * 244], problems, limit=256, max_new_tokens=12)  # 244 + 12 = 256 fits
    with pytest.raises(PromptTooLong, match=r"^f.jsonl, line 2: the prompt is 245 tokens; .* room for 244"):
        check_lengths([[0] * 100, [0] * 245], problems, limit=256, max_new_tokens=12)
    with pytest.raises(PromptTooLong, match=r"^max_new_tokens=256 does not fit the engine's context of 256"):
        check_lengths([[0]], problems[:1], limit=256, max_new_tokens=256)


def test_a_prompt_longer_than_the_model_context_fails_at_start_in_one_line(tmp_path, capsys, monkeypatch):
    """The tiny model's context is 256 tokens of one character each: a 400-character problem cannot fit."""
    monkeypatch.chdir(tmp_path)
    rows = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(12)]
    rows[7]["question"] = "What is " + "1 + " * 100 + "1?"
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["train", "data=gsm8k", f"data.path={data}", "data.test_size=2", "data.instruction=", *TINY,
                 "max_new_tokens=12",
                 f"hydra.run.dir={tmp_path / 'run'}"]) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]
    assert len(err) == 1 and f"{data}, line 8: the prompt is " in err[0] and "context of 256 tokens" in err[0]
