"""Per-token log-probabilities of given sequences under a Hugging Face causal LM: what the trainer compares with
the engine's `rollout_logprobs` (raw model logprobs, no temperature)."""

from __future__ import annotations

from typing import Sequence

import torch


def next_token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """[B, L - 1] log p(input_ids[:, t + 1] | input_ids[:, :t + 1]), in fp32 (with grad if enabled); with
    entropy=True also the [B, L - 1] entropy of each next-token distribution (one more [B, L, vocab] pass)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1)
    picked = logp.gather(-1, input_ids[:, 1:, None])[..., 0]
    return (picked, -(logp.exp() * logp).sum(-1)) if entropy else picked


@torch.no_grad()
def sequence_logprobs(model: torch.nn.Module, sequences: Sequence[Sequence[int]], batch_size: int = 64,
                      pad_id: int = 0) -> list[list[float]]:
    """log p(s_t | s_<t) for t = 1 .. len-1 of each sequence (right-padded batches; padding is never attended
    by the real tokens, which come first)."""
    device = next(model.parameters()).device
    out: list[list[float]] = []
    for i in range(0, len(sequences), batch_size):
        chunk = [list(s) for s in sequences[i:i + batch_size]]
        width = max(map(len, chunk))
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for row, s in enumerate(chunk):
            ids[row, :len(s)] = torch.tensor(s)
            mask[row, :len(s)] = 1
        logp = next_token_logprobs(model, ids, mask)
        out += [logp[row, :len(s) - 1].tolist() for row, s in enumerate(chunk)]
    return out
