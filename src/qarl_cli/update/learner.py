"""The learner: the policy (bf16/fp32 masters behind the aligned forward), its optimizer and schedule, and the
update of one rollout batch: minibatches x epochs of objective + backward + clipped optimizer step.

A step whose loss or gradient is not finite is skipped: gradients are dropped before the optimizer sees them,
so the weights stay as they were, and the skip is counted (`update/skipped_steps`).

Under torchrun (train.distributed) every rank runs these same calls on its share of each minibatch; `dist` is
where they differ from one process (which rows, the loss weight, the sums over ranks)."""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn

from qarl_cli.forward.logprobs import next_token_logprobs
from qarl_cli.update.mismatch import mismatch_metrics
from qarl_cli.forward.routing import replay
from qarl_cli.update.base import PolicyBatch
from qarl_cli.update.objectives import DENOMINATORS
from qarl_cli.optim import lr_lambda
from qarl_cli.update.distributed import Single, rank_chunks
from qarl_cli.update.sequences import Sequences


def token_logprobs(model: nn.Module, seqs: Sequences, entropy: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """[B, L - 1] log p(input_ids[:, t + 1] | input_ids[:, :t + 1]), in fp32 (and the entropies, on request). A
    batch carrying the engine's routing is routed as the engine routed it (routing replay, qarl_cli.forward.routing)."""
    with replay(model, seqs.routed_experts):
        return next_token_logprobs(model, seqs.input_ids, seqs.attention_mask, entropy)


@contextmanager
def threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` for the block, then back (0: left as they are). torch._C's setter:
    vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process."""
    if n <= 0:
        yield
        return
    before = torch.get_num_threads()
    torch._C.set_num_threads(n)
    try:
        yield
    finally:
        torch._C.set_num_threads(before)


class Learner:
    def __init__(self, model: nn.Module, cfg: Any, objective: Callable, device: torch.device,
                 dist: Single = Single()) -> None:
        """`model`: already sharded where distributed (the optimizer is built over its parameters as they are)."""
        self.model, self.cfg, self.objective, self.device, self.dist = model, cfg, objective, device, dist
        from qarl_cli.optim import build_optimizer

        self.optimizer = build_optimizer(model, cfg.optimizer, cfg.lr, tuple(cfg.betas), cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.warmup_steps, cfg.steps, cfg.lr_schedule))
        self.skipped = 0
        from qarl_cli.forward.aligned import refresh_after

        refresh_after(self.optimizer, model)  # the aligned modules re-quantize the new masters (once per step)

    @torch.no_grad()
    def old_logprobs(self, seqs: Sequences, chunk: int = 256) -> Tensor:
        """pi_old: the aligned forward at the weights that sampled the batch (no grad), `chunk` rows per forward
        (micro_batch_size where that is set)."""
        with threads(self.cfg.train_threads):
            return self._old_logprobs(seqs, self.cfg.micro_batch_size or chunk)

    def _old_logprobs(self, seqs: Sequences, chunk: int) -> Tensor:
        self.model.eval()
        out = torch.zeros_like(seqs.rollout_logprobs)
        for rows, used in rank_chunks(self.dist, torch.arange(len(seqs)), chunk):
            part = seqs.select(rows).to(self.device)
            logprobs = token_logprobs(self.model, part).cpu()
            if used:
                out[rows, :part.mask.shape[1]] = logprobs
        return self.dist.all_sum(out)

    @property
    def needs_old_pass(self) -> bool:
        """One update over the batch is on-policy: pi_old is the first forward's own value, so the separate
        no-grad pass over the batch is only needed for several minibatches or epochs."""
        return self.cfg.minibatches > 1 or self.cfg.epochs_per_step > 1

    def update(self, seqs: Sequences, old: Tensor | None, advantages: Tensor, algo_cfg: Any,
               seed: int) -> dict[str, float]:
        """Epochs x minibatches over the batch (shuffled with `seed`); one optimizer step per minibatch.
        `old`: old_logprobs(seqs). Returns the objective's and the update's metrics (`update/optimizer_steps`:
        how many steps changed the weights), and the rollout mismatch (engine vs pi_old, qarl_cli.update.mismatch; with
        routing replay also what it would be without, train.routing)."""
        from qarl_cli.update.routing_agreement import no_replay_metrics

        with threads(self.cfg.train_threads):
            routing = no_replay_metrics(self.model, seqs, self.dist, self.cfg.micro_batch_size or 256, self.device)
            return {**self._update(seqs, old, advantages, algo_cfg, seed), **routing}

    def _update(self, seqs: Sequences, old: Tensor | None, advantages: Tensor, algo_cfg: Any,
                seed: int) -> dict[str, float]:
        self.model.train()
        lr = self.scheduler.get_last_lr()[0]
        gen = torch.Generator().manual_seed(seed)
        sums: dict[str, float] = {}
        steps = 0
        on_policy = old is None
        if on_policy:  # theta_old is theta: pi_old is each row's first forward, filled in as the rows come
            old = torch.zeros_like(seqs.rollout_logprobs)
        count = DENOMINATORS[algo_cfg.loss_agg]
        for _ in range(self.cfg.epochs_per_step):
            order = torch.randperm(len(seqs), generator=gen)
            for rows in order.chunk(self.cfg.minibatches):
                self.optimizer.zero_grad(set_to_none=True)
                stats = self._accumulate(seqs, rows, old, on_policy, advantages, algo_cfg, count)
                norm = self._clip()
                if self.dist.world > 1:
                    keys = sorted(stats)
                    summed = self.dist.all_sum(torch.tensor([stats[k] for k in keys], dtype=torch.float64))
                    stats = dict(zip(keys, summed.tolist()))
                if not (math.isfinite(stats["update/loss"]) and math.isfinite(norm)):
                    self.optimizer.zero_grad(set_to_none=True)  # the weights stay as they are
                    self.skipped += 1
                    continue
                self.optimizer.step()
                steps += 1
                for k, v in {**stats, "update/grad_norm": norm}.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
        if on_policy:
            old = self.dist.all_sum(old)
        out = {k: v / max(steps, 1) for k, v in sums.items()}
        out.update({"update/lr": lr, "update/skipped_steps": float(self.skipped),
                    "update/optimizer_steps": float(steps)})
        return {**out, **mismatch_metrics(old, seqs.rollout_logprobs, seqs.mask, algo_cfg.mismatch_cap)}

    def _accumulate(self, seqs: Sequences, rows: Tensor, old: Tensor, on_policy: bool, advantages: Tensor,
                    algo_cfg: Any, count: Callable) -> dict[str, float]:
        """Forward and backward of one minibatch (`rows`), micro-batch by micro-batch, gradients summed. Each
        micro-batch's loss is weighted by its share of the minibatch's denominator (tokens or sequences, over all
        ranks), so the summed gradient is the whole minibatch's; x world because FSDP averages over ranks.
        Returns this rank's share-weighted metrics (summed over ranks by the caller)."""
        size = self.cfg.micro_batch_size or math.ceil(len(rows) / self.dist.world)
        total = max(count(seqs.mask[rows]).item(), 1)
        stats: dict[str, float] = {}
        for micro, used in rank_chunks(self.dist, rows, size):  # a stand-in row is weighted 0
            part = seqs.select(micro).to(self.device)
            width = part.mask.shape[1]
            logprobs, entropy = token_logprobs(self.model, part, True) if algo_cfg.entropy_coef \
                else (token_logprobs(self.model, part), None)
            if on_policy and used:
                old[micro, :width] = logprobs.detach().cpu()
            batch = PolicyBatch(logprobs, old[micro, :width].to(self.device), part.rollout_logprobs,
                                advantages[micro].to(self.device), part.mask, entropy)
            loss, metrics = self.objective(batch, algo_cfg)
            share = count(part.mask).item() / total if used else 0.0
            (loss * (share * self.dist.world)).backward()
            for k, v in {**metrics, "update/loss": loss.detach()}.items():
                stats[k] = stats.get(k, 0.0) + share * float(v)
        return stats

    def end_step(self) -> None:
        """One RL step done (whether or not it had a learning signal): the LR schedule advances. torch warns when
        the schedule steps before any optimizer step, which is what a first step without signal does on purpose."""
        import warnings

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()` before")
            self.scheduler.step()

    def _clip(self) -> float:
        """Clip the gradients to a global norm of grad_clip (0: no clipping); returns the norm before clipping.
        Sharded gradients' norm is a DTensor; its full value needs the other ranks' shards."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_([p for p in self.model.parameters() if p.grad is not None],
                                                 self.cfg.grad_clip, norm)
        return norm.item()
