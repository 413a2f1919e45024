"""The reward stage's step metrics (train.collect.score) on a hand-made rollout batch: the real tiny tokenizer and
math-verify reward, values worked out from the batch itself."""

import pytest

from qarl_cli.config.reward import MathVerifyRewardConfig
from qarl_cli.data.base import Problem
from qarl_cli.models.tokenizer import build_tokenizer
from qarl_cli.reward.math_verify import MathVerifyReward
from qarl_cli.rollout.base import RolloutBatch
from qarl_cli.train.collect import score


def test_score_gives_the_entropy_estimate_and_error_tokens_by_response_length(tmp_path):
    tok = build_tokenizer(tmp_path)
    short = tok("\\boxed{7}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # right, stopped
    looping = tok("1+1=" * 12, add_special_tokens=False)["input_ids"]  # 48 tokens, a loop cut at the limit
    long_ok = tok("2+3=5\n" * 6 + "\\boxed{5}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert len(short) < 32 and 32 <= len(looping) < 64 and 32 <= len(long_ok) < 64
    responses = [short, looping, long_ok]
    logprobs = [[-0.5] * len(short), [-0.1] * len(looping), [-2.0] * len(long_ok)]
    batch = RolloutBatch(prompt_index=[0, 0, 1], response_ids=responses, rollout_logprobs=logprobs,
                         finish_reasons=["stop", "length", "stop"], seconds=1.0)
    problems = [Problem("3+4", "7"), Problem("2+3", "5")]
    with MathVerifyReward(MathVerifyRewardConfig()) as reward:
        out = score(batch, problems, tok, reward, max_tokens=len(looping))
    assert out.rewards.tolist() == [1.0, 0.0, 1.0]
    m = out.metrics
    tokens = len(short) + len(looping) + len(long_ok)
    expected = (0.5 * len(short) + 0.1 * len(looping) + 2.0 * len(long_ok)) / tokens
    assert m["response/neg_logprob_mean"] == pytest.approx(expected, rel=1e-12)
    # the looping one is truncated and repeats; it is one of the two responses of 32-64 tokens
    assert m["error_tokens/any_frac@0-32"] == 0.0
    assert m["error_tokens/any_frac@32-64"] == 0.5
    assert not any(k.startswith("error_tokens/any_frac@64") or k.endswith("@128-") for k in m)
    assert m["error_tokens/any_frac"] == pytest.approx(1 / 3)
