"""Group-normalised advantages: each prompt's n samples are compared with each other (GRPO-style, no critic).

Rewards come as one flat tensor [num_prompts * n], the n samples of a prompt consecutive.
"""

from typing import Any

import torch
from torch import Tensor

STD_EPS = 1e-6  # added to the group std, so a group of equal rewards gives 0 / 1e-6 = 0, not 0 / 0


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    if group_size < 1 or rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    return rewards.view(-1, group_size)


def group_advantages(rewards: Tensor, group_size: int, std_normalize: bool = True) -> Tensor:
    """[num_prompts * n]: A = r - mean of its group, divided by (std of its group + STD_EPS) when std_normalize.
    The std is the population std (divide by n), so it is defined for n = 1 and a normalised group has unit RMS."""
    groups = _groups(rewards, group_size).to(torch.promote_types(rewards.dtype, torch.float32))
    centred = groups - groups.mean(-1, keepdim=True)
    if std_normalize:
        centred = centred / (groups.std(-1, correction=0, keepdim=True) + STD_EPS)
    return centred.flatten()


def signal_mask(rewards: Tensor, group_size: int) -> Tensor:
    """[num_prompts * n] bool: True for the samples of groups whose rewards are not all equal. The others have zero
    advantage: they carry no learning signal, only dilute the loss, and the trainer may drop them."""
    groups = _groups(rewards, group_size)
    has_signal = (groups != groups[:, :1]).any(-1, keepdim=True)
    return has_signal.expand_as(groups).flatten()


def step_advantages(rewards: Tensor, group_size: int, algo: Any) -> tuple[Tensor, Tensor]:
    """The update's advantages [B] and which samples it uses [B] (bool), by the algorithm config's
    adv_std_normalize and drop_no_signal_groups."""
    advantages = group_advantages(rewards, group_size, algo.adv_std_normalize)
    keep = signal_mask(rewards, group_size) if algo.drop_no_signal_groups else torch.ones_like(rewards, dtype=torch.bool)
    return advantages, keep
