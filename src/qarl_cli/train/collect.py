"""From a rollout batch to what the update needs: rewards and their metrics, error-token flags, group-normalised
advantages with the no-signal groups marked, and the packed sequences."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from qarl_cli.advantages import group_advantages, signal_mask
from qarl_cli.evaluate import decode
from qarl_cli.reward.error_tokens import error_token_metrics
from qarl_cli.rollout.base import RolloutBatch
from qarl_cli.train.sequences import Sequences, pack


@dataclass
class Collected:
    seqs: Sequences
    rewards: Tensor  # [B]
    advantages: Tensor  # [B]
    keep: Tensor  # [B] bool: the samples the update uses
    metrics: dict[str, float]
    samples: list[dict]  # a few completions for the logger


def collect(batch: RolloutBatch, prompts: Sequence[Sequence[int]], problems: Sequence[Any], tokenizer: Any,
            reward: Any, n: int, max_tokens: int, algo: Any, keep_samples: int = 8) -> Collected:
    texts, flags = decode(batch, tokenizer, max_tokens)
    scored = reward.score(texts, [problems[i].answer for i in batch.prompt_index])
    rewards = torch.tensor(scored.rewards, dtype=torch.float32)
    advantages = group_advantages(rewards, n, algo.adv_std_normalize)
    keep = signal_mask(rewards, n) if algo.drop_no_signal_groups else torch.ones_like(rewards, dtype=torch.bool)
    metrics = {**scored.metrics(), **error_token_metrics(flags),
               "response/len_mean": sum(batch.lengths) / max(len(batch), 1),
               "advantage/signal_frac": keep.float().mean().item(),
               "throughput/rollout_tokens_per_s": batch.tokens_per_s}
    samples = [{"prompt": problems[i].prompt, "answer": problems[i].answer, "completion": t, "reward": r}
               for i, t, r in list(zip(batch.prompt_index, texts, scored.rewards))[:keep_samples]]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return Collected(pack(prompts, batch, pad), rewards, advantages, keep, metrics, samples)
