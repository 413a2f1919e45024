"""`moe/*` metrics: how often the learner's own routing agrees with the engine's, per (token, layer) pair."""

from __future__ import annotations

import torch
from torch import Tensor


@torch.no_grad()
def agreement_counts(own: Tensor, engine: Tensor, valid: Tensor) -> tuple[Tensor, int]:
    """own, engine: [N, layers, k] expert indices of N tokens; valid: [N] bool, the tokens to count. A (token,
    layer) pair agrees when the two top-k sets are equal (order ignored). Returns the agreeing pairs per layer
    [layers] (float64) and the number of tokens counted."""
    valid = valid.bool()
    a, b = own[valid].long().sort(-1).values, engine[valid].long().sort(-1).values
    return (a == b).all(-1).double().sum(0), int(valid.sum())


def routing_agreement(own: Tensor, engine: Tensor, valid: Tensor) -> dict[str, float]:
    """`moe/routing_agreement`: the fraction of agreeing (token, layer) pairs over the valid tokens and every
    layer; `moe/routing_agreement_min_layer`: the lowest per-layer fraction. {} when no token is valid."""
    same, n = agreement_counts(own, engine, valid)
    if n == 0:
        return {}
    return {"moe/routing_agreement": (same.sum() / (n * same.numel())).item(),
            "moe/routing_agreement_min_layer": (same / n).min().item()}
