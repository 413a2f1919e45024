"""Rollouts as tensors: prompt + response right-padded into one [B, L] batch, with the response mask and the
engine's logprobs placed where the trainer's next-token logprobs land (position t predicts token t + 1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from qarl_cli.rollout.base import RolloutBatch


@dataclass
class Sequences:
    input_ids: Tensor  # [B, L] prompt then response, right-padded with pad_id
    attention_mask: Tensor  # [B, L]
    mask: Tensor  # [B, L - 1] bool: position t predicts a response token (input_ids[:, t + 1])
    rollout_logprobs: Tensor  # [B, L - 1] the engine's logprob of input_ids[:, t + 1]; 0 off the mask

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: Tensor) -> "Sequences":
        """Rows `rows`, trimmed to their longest sequence (less padding to run through the model)."""
        width = int(self.attention_mask[rows].sum(-1).max())
        return Sequences(self.input_ids[rows, :width], self.attention_mask[rows, :width],
                         self.mask[rows, :width - 1], self.rollout_logprobs[rows, :width - 1])

    def to(self, device: torch.device) -> "Sequences":
        return Sequences(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.mask,
                                                   self.rollout_logprobs)))


def pack(prompts: Sequence[Sequence[int]], batch: RolloutBatch, pad_id: int = 0) -> Sequences:
    """One row per sample of `batch`; `prompts[i]` is the prompt of batch.prompt_index == i."""
    rows = [list(prompts[i]) + r for i, r in zip(batch.prompt_index, batch.response_ids)]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros(len(rows), width - 1, dtype=torch.bool)
    mu = torch.zeros(len(rows), width - 1)
    for b, (row, i, lps) in enumerate(zip(rows, batch.prompt_index, batch.rollout_logprobs)):
        ids[b, :len(row)] = torch.tensor(row)
        attn[b, :len(row)] = 1
        start = len(prompts[i]) - 1  # the position whose next token is the first response token
        mask[b, start:len(row) - 1] = True
        mu[b, start:len(row) - 1] = torch.tensor(lps, dtype=torch.float32)
    return Sequences(ids, attn, mask, mu)
