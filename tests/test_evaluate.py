"""Evaluation: the unbiased pass@k estimator against brute-force enumeration, and `qarl eval` end to end with
the real vLLM engine, whose greedy accuracy must equal transformers' greedy decoding scored independently."""

import itertools
import json
import os
import subprocess
import sys

import pytest

from qarl_cli.train.evaluate import pass_at, pass_ks


@pytest.mark.parametrize("k", [1, 2, 4, 5, 8])
def test_pass_at_is_the_fraction_of_j_subsets_with_a_hit(k):
    for correct in range(k + 1):
        outcomes = [1] * correct + [0] * (k - correct)
        for j in range(1, k + 1):
            subsets = list(itertools.combinations(outcomes, j))
            expected = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at(k, correct, j) == pytest.approx(expected, abs=1e-12)


def test_pass_ks():
    assert pass_ks(1) == [1] and pass_ks(4) == [1, 2, 4] and pass_ks(6) == [1, 2, 4, 6]


@pytest.mark.slow
def test_qarl_eval_greedy_equals_transformers_greedy(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qarl_cli.config.data import ArithDataConfig
    from qarl_cli.config.model import TinyModelConfig
    from qarl_cli.data.splits import load_splits
    from qarl_cli.models.hf_eval import greedy_accuracy
    from qarl_cli.models.tiny import ensure_tiny_model

    limit = 150
    out = subprocess.run([sys.executable, "-m", "qarl_cli.cli", "eval", "temperature=0", "samples=2",
                          f"limit={limit}", f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600, env=os.environ)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "avg@2" in out.stdout and "arith level 3" in out.stdout
    result = json.loads((tmp_path / "run" / "eval.json").read_text())
    m = result["metrics"]
    assert m["eval/problems"] == limit and result["rollout"] == "vllm" and result["quant"] == "none"
    assert m["eval/pass@2"] == m["eval/avg@2"]  # greedy: both samples are the same answer
    assert set(result["groups"]) == {"arith level 1", "arith level 2", "arith level 3"}

    src = ensure_tiny_model(TinyModelConfig(), log=lambda _: None)  # the default model qarl eval used
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    problems = load_splits(ArithDataConfig(), 0).test[:limit]
    expected = greedy_accuracy(model, AutoTokenizer.from_pretrained(str(src)), problems)["accuracy"]
    assert 0.1 < expected < 0.7
    assert m["eval/avg@2"] == pytest.approx(expected, abs=1.5 / limit)  # at most one argmax tie apart
