"""The learner: the policy (bf16/fp32 masters behind the aligned forward), its optimizer and schedule, and the
update of one rollout batch: minibatches x epochs of objective + backward + clipped optimizer step.

A step whose loss or gradient is not finite is skipped: gradients are dropped before the optimizer sees them,
so the weights stay as they were, and the skip is counted (`update/skipped_steps`)."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor, nn

from qarl_cli.logprobs import next_token_logprobs
from qarl_cli.objectives import PolicyBatch
from qarl_cli.train.sequences import Sequences


def token_logprobs(model: nn.Module, seqs: Sequences) -> Tensor:
    """[B, L - 1] log p(input_ids[:, t + 1] | input_ids[:, :t + 1]), in fp32."""
    return next_token_logprobs(model, seqs.input_ids, seqs.attention_mask)


def lr_lambda(warmup: int, total: int, schedule: str) -> Callable[[int], float]:
    """Linear warm-up over `warmup` steps, then constant or cosine decay to 10 % at `total`."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


class Learner:
    def __init__(self, model: nn.Module, cfg: Any, objective: Callable, device: torch.device) -> None:
        self.model, self.cfg, self.objective, self.device = model, cfg, objective, device
        params = [p for p in model.parameters() if p.requires_grad]
        if cfg.optimizer == "muon":
            from qarl_cli.optim import MuonAdamW

            self.optimizer = MuonAdamW(model, lr=cfg.lr, weight_decay=cfg.weight_decay, adamw_lr_ratio=0.2)
        elif cfg.optimizer == "sgd":
            self.optimizer = torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.warmup_steps, cfg.steps, cfg.lr_schedule))
        self.skipped = 0
        from qarl_cli.quant.aligned import refresh_after

        refresh_after(self.optimizer, model)  # the aligned modules re-quantize the new masters (once per step)

    @torch.no_grad()
    def old_logprobs(self, seqs: Sequences, chunk: int = 256) -> Tensor:
        """pi_old: the aligned forward at the weights that sampled the batch (no grad)."""
        self.model.eval()
        out = torch.zeros_like(seqs.rollout_logprobs)
        for lo in range(0, len(seqs), chunk):
            rows = torch.arange(lo, min(lo + chunk, len(seqs)))
            part = seqs.select(rows).to(self.device)
            out[rows, :part.mask.shape[1]] = token_logprobs(self.model, part).cpu()
        return out

    @property
    def needs_old_pass(self) -> bool:
        """One update over the batch is on-policy: pi_old is the first forward's own value, so the separate
        no-grad pass over the batch is only needed for several minibatches or epochs."""
        return self.cfg.minibatches > 1 or self.cfg.epochs_per_step > 1

    def update(self, seqs: Sequences, old: Tensor | None, advantages: Tensor, algo_cfg: Any,
               seed: int) -> tuple[dict[str, float], Tensor]:
        """Epochs x minibatches over the batch (shuffled with `seed`); one optimizer step per minibatch.
        `old`: pi_old of the batch, or None when not needs_old_pass. Returns the metrics and pi_old."""
        self.model.train()
        lr = self.scheduler.get_last_lr()[0]
        gen = torch.Generator().manual_seed(seed)
        sums: dict[str, float] = {}
        steps = 0
        for _ in range(self.cfg.epochs_per_step):
            order = torch.randperm(len(seqs), generator=gen)
            for rows in order.chunk(self.cfg.minibatches):
                part = seqs.select(rows).to(self.device)
                width = part.mask.shape[1]
                logprobs = token_logprobs(self.model, part)
                if old is None:  # on-policy: theta_old is theta
                    old = torch.zeros_like(seqs.rollout_logprobs)
                    old[rows, :width] = logprobs.detach().cpu()
                batch = PolicyBatch(logprobs, old[rows, :width].to(self.device), part.rollout_logprobs,
                                    advantages[rows].to(self.device), part.mask)
                loss, metrics = self.objective(batch, algo_cfg)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
                if not (torch.isfinite(loss) and torch.isfinite(norm)):
                    self.optimizer.zero_grad(set_to_none=True)  # the weights stay as they are
                    self.skipped += 1
                    continue
                self.optimizer.step()
                steps += 1
                for k, v in {**metrics, "update/loss": loss.item(), "update/grad_norm": norm.item()}.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
        self.scheduler.step()
        out = {k: v / max(steps, 1) for k, v in sums.items()}
        out.update({"update/lr": lr, "update/skipped_steps": float(self.skipped)})
        return out, old
