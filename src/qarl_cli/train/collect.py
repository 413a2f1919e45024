"""The reward stage of a training step, from a rollout batch: the responses' texts, their rewards and error-token
flags, the step's reward metrics, and a few completions for the logger. Advantages and packing are the loop's
next calls (qarl_cli.update.advantages, train.sequences)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from qarl_cli.data.base import Problem
from qarl_cli.train.evaluate import decode
from qarl_cli.update.mismatch import by_length
from qarl_cli.reward.error_tokens import error_token_metrics
from qarl_cli.rollout.base import RolloutBatch


@dataclass
class Scored:
    rewards: Tensor  # [B], float32, in the batch's (prompt-major) order
    metrics: dict[str, float]
    samples: list[dict]  # a few completions for the logger


def score(batch: RolloutBatch, problems: Sequence[Problem], tokenizer: Any, reward: Any, max_tokens: int,
          keep_samples: int = 8) -> Scored:
    """Decode and score every response of `batch` against its problem's gold answer."""
    texts, flags = decode(batch, tokenizer, max_tokens)
    scored = reward.score(texts, [problems[i].answer for i in batch.prompt_index])
    lengths = torch.tensor(batch.lengths)
    logprobs = [x for row in batch.rollout_logprobs for x in row]
    metrics = {**scored.metrics(), **error_token_metrics(flags),
               **by_length("error_tokens/any_frac", torch.tensor([float(f.any) for f in flags]), lengths),
               "response/len_mean": sum(batch.lengths) / max(len(batch), 1),
               # -mean log mu(sampled token): at temperature 1 an unbiased estimate of the sampler's entropy
               "response/neg_logprob_mean": -sum(logprobs) / max(len(logprobs), 1),
               "throughput/rollout_tokens_per_s": batch.tokens_per_s}
    samples = [{"prompt": problems[i].prompt, "answer": problems[i].answer, "completion": t, "reward": r}
               for i, t, r in list(zip(batch.prompt_index, texts, scored.rewards))[:keep_samples]]
    return Scored(torch.tensor(scored.rewards, dtype=torch.float32), metrics, samples)
