"""Values whose range an engine sets (config/engine_limits.py) are refused at compose time in one line naming
the key; the limits are checked here against vLLM's own SamplingParams, so that a vLLM that moves them fails this
test instead of a run at step 1."""

import pytest

from qarl_cli.cli import main
from qarl_cli.config.engine_limits import VLLM_MAX_TEMPERATURE, VLLM_MIN_TEMPERATURE, vllm_max_n


def test_the_limits_are_vllms():
    from vllm import SamplingParams

    n = vllm_max_n()
    SamplingParams(n=n, temperature=1.0)
    with pytest.raises(Exception, match="n must be at most"):  # vLLM's VLLMValidationError
        SamplingParams(n=n + 1, temperature=1.0)
    SamplingParams(temperature=VLLM_MAX_TEMPERATURE)
    with pytest.raises(Exception, match="temperature must be in"):
        SamplingParams(temperature=VLLM_MAX_TEMPERATURE + 0.01)
    # below the minimum, vLLM samples at another temperature than the one set, with only a log line
    assert SamplingParams(temperature=VLLM_MIN_TEMPERATURE / 10).temperature == VLLM_MIN_TEMPERATURE


def test_vllm_seeds_numpy_with_the_run_seed_and_numpy_takes_32_bits():
    import numpy as np

    np.random.seed(2**32 - 1)
    for bad in (-1, 2**32):
        with pytest.raises(ValueError):
            np.random.seed(bad)


@pytest.mark.parametrize("command, args, line", [
    ("train", ["samples_per_prompt=1000000"], "samples_per_prompt=1000000: vLLM samples at most 16384"),
    ("train", ["eval_samples=16385"], "eval_samples=16385: vLLM samples at most 16384"),
    ("eval", ["samples=16385"], "samples=16385: vLLM samples at most 16384"),
    ("train", ["temperature=2.5"], "temperature=2.5: vLLM samples at temperatures in [0, 2]"),
    ("train", ["temperature=0.001"], "temperature=0.001: vLLM would sample at 0.01 instead"),
    ("train", ["max_new_tokens=256"], "max_new_tokens=256: model=tiny_arith has 256 positions"),
    ("eval", ["max_new_tokens=100000"], "max_new_tokens=100000: model=tiny_arith has 256 positions"),
    ("train", ["rollout.max_model_len=257"], "rollout.max_model_len=257: model=tiny_arith has 256 positions"),
    ("train", ["seed=-1"], "seed=-1: must be in 0..4294967295"),
    ("train", ["seed=4294967296"], "seed=4294967296: must be in 0..4294967295"),
])
def test_engine_limits_are_one_line_at_compose_time(capsys, command, args, line):
    assert main([command, *args, "--cfg", "job"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"qarl {command}: error: {line}"), err


def test_the_model_s_own_positions_count_for_a_checkpoint(models, tmp_path, capsys):
    import json

    positions = json.loads((models["dense"] / "config.json").read_text())["max_position_embeddings"]
    args = ["train", "model=hf", f"model.path={models['dense']}"]
    assert main([*args, f"max_new_tokens={positions - 1}", "--cfg", "job"]) == 0
    capsys.readouterr()
    assert main([*args, f"max_new_tokens={positions}", "--cfg", "job"]) == 2
    assert f"max_new_tokens={positions}: model.path={models['dense']} has {positions} positions" in \
        capsys.readouterr().err


def test_a_dry_run_is_checked_for_what_it_samples(capsys, tmp_path):
    """dry_run=true samples DRY_RUN_NEW_TOKENS per response with the model's own context length, so a paper
    preset's budget composes on a tiny stand-in; the same budget without dry_run is refused."""
    from qarl_cli.config.root import TrainConfig

    data = tmp_path / "openr1.jsonl"
    data.write_text('{"problem": "What is 1 + 1?", "answer": "2"}\n')
    args = ["train", "+experiment=qwen3_30b_a3b_fp8", "model=tiny_moe", f"data.path={data}"]
    assert main([*args, "dry_run=true", "--cfg", "job"]) == 0
    capsys.readouterr()
    assert main([*args, "--cfg", "job"]) == 2
    assert "max_new_tokens=20480: model=tiny_moe has 256 positions" in capsys.readouterr().err
    assert main(["train", f"max_new_tokens={TrainConfig.DRY_RUN_NEW_TOKENS}", "model.max_position_embeddings="
                 f"{TrainConfig.DRY_RUN_NEW_TOKENS}", "dry_run=true", "--cfg", "job"]) == 2  # still its own limit


def test_the_torch_engine_is_not_held_to_vllm_s_sampling_limits(capsys):
    assert main(["train", "rollout=torch", "samples_per_prompt=20000", "temperature=3", "--cfg", "job"]) == 0
