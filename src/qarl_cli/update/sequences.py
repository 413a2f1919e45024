"""Rollouts as tensors: prompt + response right-padded into one [B, L] batch, with the response mask and the
engine's logprobs placed where the trainer's next-token logprobs land (position t predicts token t + 1), and, when
the engine returned them, the experts it routed each token to (routing replay, qarl_cli.forward.routing)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from qarl_cli.rollout.base import RolloutBatch


@dataclass
class Sequences:
    input_ids: Tensor  # [B, L] prompt then response, right-padded with pad_id
    attention_mask: Tensor  # [B, L]
    mask: Tensor  # [B, L - 1] bool: position t predicts a response token (input_ids[:, t + 1])
    rollout_logprobs: Tensor  # [B, L - 1] the engine's logprob of input_ids[:, t + 1]; 0 off the mask
    # [B, L, layers, top_k] int16: the experts the engine routed token t to; -1 where it reported none
    routed_experts: Optional[Tensor] = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: Tensor) -> "Sequences":
        """Rows `rows`, trimmed to their longest sequence (less padding to run through the model)."""
        width = int(self.attention_mask[rows].sum(-1).max())
        routed = self.routed_experts[rows, :width] if self.routed_experts is not None else None
        return Sequences(self.input_ids[rows, :width], self.attention_mask[rows, :width],
                         self.mask[rows, :width - 1], self.rollout_logprobs[rows, :width - 1], routed)

    def to(self, device: torch.device) -> "Sequences":
        # the routing stays where it is: the routers' hooks move a forward's share of it
        return Sequences(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.mask,
                                                   self.rollout_logprobs)), self.routed_experts)


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
    return Sequences(ids, attn, mask, mu, _routed(batch.routed_experts, width))


def _routed(per_sample: Optional[list[Tensor]], width: int) -> Optional[Tensor]:
    """[B, width, layers, k] of the samples' routing (each from position 0), -1 past what each reported."""
    if per_sample is None:
        return None
    shape = next((r.shape[1:] for r in per_sample if r.dim() == 3), None)
    if shape is None:
        return None
    out = torch.full((len(per_sample), width, *shape), -1, dtype=torch.int16)
    for b, r in enumerate(per_sample):
        n = min(len(r), width)
        out[b, :n] = r[:n].to(torch.int16)
    return out
