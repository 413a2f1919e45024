"""Reward stage: scoring completions against gold answers (reward=math_verify: math-verify in a process pool,
built through qarl_cli.stages), and the error-token detector for quantized rollouts (reward.error_tokens).
Kept light: implementations import their heavy dependencies themselves."""

from qarl_cli.reward.base import FAILURES, STATUSES, RewardFn, RewardResult, SampleDetail

__all__ = ["FAILURES", "STATUSES", "RewardFn", "RewardResult", "SampleDetail"]
