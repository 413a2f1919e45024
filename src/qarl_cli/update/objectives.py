"""Policy objectives: pure functions over right-padded [B, T] tensors with a response mask.

Each objective maps (PolicyBatch, AlgorithmConfig) to (scalar loss to minimise, metrics). Two cores differ only in
the importance ratio pi_theta / pi_old: one per sequence (tbpo, gspo) or one per token (grpo, dapo). What tells tbpo
from gspo, or grpo from dapo, is the constants of their config schema (qarl_cli.config.algorithm). Each algorithm
schema names its function in `impl` (qarl_cli.stages.resolve("algorithm", name)). Formulas, metric keys, numerics: docs/objectives.md.
"""

import math

import torch
from torch import Tensor

from qarl_cli.config.algorithm import AlgorithmConfig
from qarl_cli.config.errors import require
from qarl_cli.update.base import PolicyBatch
from qarl_cli.update.mismatch import LOG_RATIO_CLAMP, row_mean, sequence_log_ratio, sequence_mean


def _inputs(batch: PolicyBatch) -> PolicyBatch:
    """Padded positions zeroed (they may hold NaN, and NaN * 0 is NaN), computed in at least fp32; only `logprobs`
    keeps its gradient."""
    m = batch.mask.bool()

    def clean(x: Tensor) -> Tensor:
        return torch.where(m, x.to(torch.promote_types(x.dtype, torch.float32)), 0.0)

    lp = clean(batch.logprobs)
    return PolicyBatch(lp, clean(batch.old_logprobs).detach(), clean(batch.rollout_logprobs).detach(),
                       batch.advantages.detach().to(lp.dtype), m,
                       None if batch.entropy is None else clean(batch.entropy))


# Loss aggregation (config key loss_agg): per-token terms x [B, T] -> scalar. Denominators count response tokens
# or non-empty sequences, each at least 1, so an all-padding row or batch gives 0, never NaN.
def _token_mean(x: Tensor, m: Tensor) -> Tensor:
    return torch.where(m, x, 0.0).sum() / m.sum().clamp(min=1)


def _seq_mean_token_mean(x: Tensor, m: Tensor) -> Tensor:
    return sequence_mean(row_mean(x, m), m)


def _seq_mean_token_sum(x: Tensor, m: Tensor) -> Tensor:
    return sequence_mean(torch.where(m, x, 0.0).sum(-1), m)


AGGREGATIONS = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
}

# What each aggregation divides by, [B, T] mask -> count. Data-parallel ranks that each aggregate their share of a
# minibatch weigh their loss by (their count / the minibatch's count): the weighted sum is the minibatch's loss.
DENOMINATORS = {
    "token-mean": lambda m: m.bool().sum(),
    "seq-mean-token-mean": lambda m: m.bool().any(-1).sum(),
    "seq-mean-token-sum": lambda m: m.bool().any(-1).sum(),
}


# Mismatch correction (config key mismatch): the log of the raw ratio pi_old / mu that weights each token, [B, T].
def _no_mismatch(b: PolicyBatch) -> Tensor:
    return torch.zeros_like(b.old_logprobs)


def _token_mismatch(b: PolicyBatch) -> Tensor:
    return (b.old_logprobs - b.rollout_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _sequence_mismatch(b: PolicyBatch) -> Tensor:
    return sequence_log_ratio(b.old_logprobs, b.rollout_logprobs, b.mask)[:, None].expand_as(b.old_logprobs)


MISMATCH_LOG_RATIOS = {"none": _no_mismatch, "tis": _token_mismatch, "seq": _sequence_mismatch}


def _frac(hit: Tensor, among: Tensor) -> Tensor:
    return (hit & among).sum().double() / among.sum().clamp(min=1)


def _clipped_loss(log_ratio: Tensor, b: PolicyBatch, cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, float]]:
    """The clipped surrogate shared by every objective, given the log ratio on each token ([B, T], with grad)."""
    m, adv = b.mask, b.advantages[:, None]
    ratio = log_ratio.exp()
    neg = adv < 0
    band = neg & cfg.dual_clip  # negative samples clipped on both sides
    low = torch.full_like(ratio, 1 - cfg.eps_low).masked_fill(band, 1 - cfg.eps_neg_low)
    high = torch.full_like(ratio, 1 + cfg.eps_high).masked_fill(band, 1 + cfg.eps_neg_high)
    clipped = torch.minimum(torch.maximum(ratio, low), high) * adv
    # PPO takes the pessimistic min, so a ratio past the band on the side that would increase the objective gets no
    # gradient; the dual clip uses the clipped value alone, so a negative sample outside its band gets none either way.
    surrogate = torch.where(band, clipped, torch.minimum(ratio * adv, clipped))

    log_w = MISMATCH_LOG_RATIOS[cfg.mismatch](b)
    log_cap = math.log(cfg.mismatch_cap)
    dropped = (log_w.abs() > log_cap) if cfg.drop_outside_band else torch.zeros_like(m)
    two_sided = cfg.mismatch_clip == "both"
    weight = log_w.clamp(min=-log_cap if two_sided else None, max=log_cap).exp().masked_fill(dropped, 0.0)
    if cfg.positive_only:
        weight = weight.masked_fill(neg, 0.0)
    loss = -AGGREGATIONS[cfg.loss_agg](weight * surrogate, m)
    entropy = None
    if cfg.entropy_coef:
        require(b.entropy is not None, "algorithm.entropy_coef", cfg.entropy_coef, "needs the batch's entropy")
        entropy = AGGREGATIONS[cfg.loss_agg](b.entropy, m)
        loss = loss - cfg.entropy_coef * entropy

    with torch.no_grad():
        below, above = ratio < low, ratio > high
        cut = torch.where(neg, below | (band & above), above)  # where the clip stopped the gradient
        kept = m & ~dropped
        metrics = {
            "objective/clip_frac_pos": _frac(cut, m & (adv > 0)),
            "objective/clip_frac_neg": _frac(cut, m & neg),
            "objective/dropped_frac": _frac(dropped, m),
            "objective/seq_ratio_mean": sequence_mean(sequence_log_ratio(b.logprobs, b.old_logprobs, m).exp(), m),
            "objective/mismatch_weight_mean": torch.where(kept, weight, 0.0).sum() / kept.sum().clamp(min=1),
            "objective/mismatch_weight_clipped_frac": _frac((log_w.abs() if two_sided else log_w) > log_cap, m),
        }
        if entropy is not None:
            metrics["objective/entropy"] = entropy.detach()
    return loss, {k: v.item() for k, v in metrics.items()}


def sequence_ratio_loss(batch: PolicyBatch, cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, float]]:
    """tbpo and gspo: s_i = exp(mean_t(logprobs - old_logprobs)), one ratio per sequence. Its gradient takes the
    GSPO token form s_i,t = sg(s_i) * pi_theta(y_t) / sg(pi_theta(y_t)): value s_i on every token, d s_i,t / d
    logprobs_t = s_i; with seq-mean-token-mean this is exactly the gradient of the sequence-level objective."""
    b = _inputs(batch)
    log_s = sequence_log_ratio(b.logprobs.detach(), b.old_logprobs, b.mask)
    return _clipped_loss(log_s[:, None] + (b.logprobs - b.logprobs.detach()), b, cfg)


def token_ratio_loss(batch: PolicyBatch, cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, float]]:
    """grpo and dapo: r_i,t = exp(logprobs_t - old_logprobs_t), one ratio per token. The clamp of the log ratio
    removes the gradient of a token beyond e^+-20, which the clip removes anyway except for a negative sample above
    the band without dual clip (PPO would follow it)."""
    b = _inputs(batch)
    return _clipped_loss((b.logprobs - b.old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), b, cfg)
