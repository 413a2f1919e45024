"""The update stage's contract (`algorithm` group): an objective is a pure function of one minibatch, a
PolicyBatch, and its algorithm's config, returning the scalar loss to minimise and its metrics (the objectives:
qarl_cli.update.objectives)."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from torch import Tensor

from qarl_cli.config.algorithm import AlgorithmConfig


@dataclass(frozen=True)
class PolicyBatch:
    """One minibatch, names as in docs/design.md. Values at padded positions are ignored, whatever they hold."""

    logprobs: Tensor  # [B, T] pi_theta of the sampled tokens, with grad (aligned trainer forward)
    old_logprobs: Tensor  # [B, T] pi_old: aligned trainer at theta_old, no grad
    rollout_logprobs: Tensor  # [B, T] mu: the rollout engine's logprobs of the same tokens
    advantages: Tensor  # [B] one advantage per sequence
    mask: Tensor  # [B, T] bool or 0/1: True on response tokens
    entropy: Optional[Tensor] = None  # [B, T] the policy's next-token entropy, with grad; given when entropy_coef != 0

    def __post_init__(self) -> None:
        shape = self.mask.shape
        for name in ("logprobs", "old_logprobs", "rollout_logprobs"):
            if getattr(self, name).shape != shape:
                got = tuple(getattr(self, name).shape)
                raise ValueError(f"PolicyBatch.{name} has shape {got}, the mask {tuple(shape)}")
        if self.advantages.shape != shape[:1]:
            raise ValueError(f"PolicyBatch.advantages has shape {tuple(self.advantages.shape)}, want ({shape[0]},)")


Objective = Callable[[PolicyBatch, AlgorithmConfig], tuple[Tensor, dict[str, float]]]
