"""The optimizer and learning-rate schedule of `qarl train` and of the tiny model's warm start: Muon
(momentum orthogonalized by Newton-Schulz) for the hidden weight matrices, AdamW for the rest, as one optimizer.

The QaRL paper trains with Muon. It also makes the tiny model's warm start several times faster per step than
AdamW, which is what lets the embedded default build in minutes on two CPU cores. torch.optim.Muon runs its
Newton-Schulz iterations in bf16, which CPUs without bf16 units emulate slowly; this one runs in the parameter's
own dtype."""

from __future__ import annotations

import math
from typing import Callable

import torch

# Quintic Newton-Schulz coefficients of Keller Jordan's Muon: five iterations push all singular values near 1.
_NS = (3.4445, -4.7750, 2.0315)


def orthogonalize(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Approximately U V^T of g = U S V^T, for a 2-D g."""
    x = g / (g.norm() + 1e-7)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    a, b, c = _NS
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """Muon is for the matrices inside the network; embeddings, the output head, norms and biases use AdamW."""
    return p.ndim == 2 and "embed" not in name and "lm_head" not in name


def _orthogonalize_whole(g: torch.Tensor) -> torch.Tensor:
    """orthogonalize() of the whole matrix. Under FSDP2 `g` is a DTensor holding this rank's rows only, and the
    orthogonalization of a row block is not a row block of the orthogonalization: every rank gathers the matrix,
    orthogonalizes it (the same result everywhere) and keeps its own shard of the update."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(g, DTensor):
        return orthogonalize(g)
    return distribute_tensor(orthogonalize(g.full_tensor()), g.device_mesh, g.placements)


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the hidden matrices and AdamW for the rest as one optimizer (one state dict, one schedule, one
    step hook): what the QaRL paper trains with. Muon's update has a fixed size per matrix whatever the gradient's
    noise (SGD-momentum, Nesterov, orthogonalized, scaled by 0.2 sqrt(max(rows, cols)) to the RMS an AdamW update
    would have); AdamW's moves every weight by about lr, noise-only gradients included. The AdamW part computes
    exactly what torch.optim.AdamW computes (the same operations in the same order)."""

    def __init__(self, model: torch.nn.Module, lr: float, *, adamw_lr_ratio: float, betas: tuple[float, float],
                 weight_decay: float = 0.0, momentum: float = 0.95, eps: float = 1e-8) -> None:
        """adamw_lr_ratio: the AdamW group's learning rate relative to Muon's (Muon's update entries have an RMS
        of 0.2 lr; AdamW's, early on, of about lr). betas: the AdamW part's (beta1, beta2)."""
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if is_hidden_matrix(n, p)], "muon": True, "lr": lr},
                  {"params": [p for n, p in named if not is_hidden_matrix(n, p)], "muon": False,
                   "lr": lr * adamw_lr_ratio}]
        super().__init__([g for g in groups if g["params"]], dict(lr=lr, weight_decay=weight_decay,
                                                                   momentum=momentum, betas=tuple(betas), eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if wd:
                    p.mul_(1 - lr * wd)
                if group["muon"]:
                    buf = state.setdefault("momentum", torch.zeros_like(p))
                    buf.mul_(group["momentum"]).add_(p.grad)
                    update = _orthogonalize_whole(p.grad.add(buf, alpha=group["momentum"]))
                    p.add_(update, alpha=-lr * 0.2 * max(p.shape) ** 0.5)
                    continue
                b1, b2 = group["betas"]
                state["step"] = t = state.get("step", 0) + 1
                m = state.setdefault("exp_avg", torch.zeros_like(p))
                v = state.setdefault("exp_avg_sq", torch.zeros_like(p))
                m.lerp_(p.grad, 1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (v.sqrt() / (1 - b2 ** t) ** 0.5).add_(group["eps"])
                p.addcdiv_(m, denom, value=-(lr / (1 - b1 ** t)))


def build_optimizer(model: torch.nn.Module, name: str, lr: float, betas: tuple[float, float],
                    weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer of `qarl train` (config `optimizer`): adamw, sgd (momentum betas[0]) or muon (MuonAdamW, its
    AdamW part at lr / 5: Muon's update entries have an RMS of 0.2 lr)."""
    if name == "muon":
        return MuonAdamW(model, lr=lr, weight_decay=weight_decay, adamw_lr_ratio=0.2, betas=tuple(betas))
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=betas[0], weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay)


def lr_lambda(warmup: int, total: int, schedule: str, final: float = 0.1) -> Callable[[int], float]:
    """The learning rate at step s as a fraction of the peak (torch's LambdaLR): a linear warm-up over `warmup`
    steps, then "constant" (1), or "cosine": a cosine decay from 1 at the end of the warm-up to `final` at
    `total`, staying at `final` after it (final = 1 is constant too)."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor
