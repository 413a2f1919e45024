"""Rollout mismatch: how far the engine's logprobs (mu, `rollout_logprobs`) are from the aligned trainer's at
theta_old (pi_old, `old_logprobs`) on the same sampled tokens. Also the masked reductions the objectives share.

All functions take right-padded [B, T] tensors and a mask that is True (or 1) on response tokens; values at padded
positions are ignored, whatever they hold. Definitions: docs/design.md "Metrics that every step logs", docs/objectives.md.
"""

import math

import torch
from torch import Tensor

# Log ratios are clamped to [-20, 20] before exp: e^20 ~ 4.9e8 is finite in every float dtype, while logprob
# differences can reach 1e4 (a token the other side gives probability ~0). Documented in docs/objectives.md.
LOG_RATIO_CLAMP = 20.0
# Response-length buckets of the by-length metrics, [0, 32) [32, 64) [64, 128) [128, 256) [256, inf) tokens: the
# mismatch of long responses is what the paper's mechanism is about (error tokens accumulate, the sequence weight
# drifts).
LENGTH_EDGES = (0, 32, 64, 128, 256)


def row_mean(x: Tensor, mask: Tensor) -> Tensor:
    """[B]: the mean of x over each row's response tokens; 0 for a row without any."""
    m = mask.bool()
    return torch.where(m, x, 0.0).sum(-1) / m.sum(-1).clamp(min=1)


def sequence_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Scalar: the mean of per-sequence values [B] over the sequences with at least one response token; 0 if none."""
    present = mask.bool().any(-1)
    return torch.where(present, values, 0.0).sum() / present.sum().clamp(min=1)


def sequence_log_ratio(num: Tensor, den: Tensor, mask: Tensor) -> Tensor:
    """[B]: log of the per-sequence geometric-mean ratio, mean_t(num - den) over response tokens, clamped."""
    return row_mean(num - den, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def by_length(name: str, values: Tensor, lengths: Tensor) -> dict[str, float]:
    """`{name}@a-b` (the last bucket `@a-`): the mean of per-sequence `values` [B] over the sequences whose length
    (`lengths` [B]) lies in [a, b), for each bucket of LENGTH_EDGES that holds a sequence."""
    out = {}
    for a, b in zip(LENGTH_EDGES, LENGTH_EDGES[1:] + (None,)):
        sel = (lengths >= a) & (lengths < b) if b is not None else lengths >= a
        if sel.any():
            out[f"{name}@{a}-{b if b is not None else ''}"] = values[sel].double().mean().item()
    return out


@torch.no_grad()
def mismatch_metrics(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, cap: float = 2.0
) -> dict[str, float]:
    """The `mismatch/*` metrics of one batch, over its response tokens (r = exp(old - rollout) per token):
    k3_kl = mean(r - 1 - log r); abs_logp_diff_{mean,p99,max} of |old - rollout| (p99: nearest rank);
    seq_weight_mean = mean over sequences of min(exp(mean_t(old - rollout)), cap); seq_weight_clipped_frac = the
    fraction of sequences whose weight exceeds cap; abs_log_w_mean = mean over sequences of |mean_t(old - rollout)|
    (how far the sequence weight w is from 1, either way), also by response length (`abs_log_w_mean@a-b`,
    by_length); chi2 = mean((r - 1)^2), the chi-square divergence the token ratios estimate; seq_ess = the
    normalized effective sample size (sum W)^2 / (n sum W^2) of the full sequence weights W = prod_t r (what
    importance sampling over whole sequences would weigh by: 1 when every W is equal, 1/n when one dominates;
    long responses drive it down first). All zeros (and no by-length keys) for a batch without response tokens,
    but seq_ess, which is then 1."""
    m = mask.bool()
    # fp64: well-aligned kernels give differences of 1e-5 and less, whose k3 (~d^2 / 2) fp32 rounding would swamp.
    old, rollout = (torch.where(m, x.double(), 0.0) for x in (old_logprobs, rollout_logprobs))
    tokens = (old - rollout)[m]
    n = tokens.numel()
    if n == 0:
        keys = ("k3_kl", "chi2", "abs_logp_diff_mean", "abs_logp_diff_p99", "abs_logp_diff_max",
                "seq_weight_mean", "seq_weight_clipped_frac", "abs_log_w_mean")
        return {**{f"mismatch/{k}": 0.0 for k in keys}, "mismatch/seq_ess": 1.0}
    # r - 1 - log r = expm1(d) - d, which keeps its precision for tiny d where r - 1 - log r cancels.
    d = tokens.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    abs_diff = tokens.abs()
    log_w = sequence_log_ratio(old, rollout, m)
    weight = log_w.exp()
    present = m.any(-1)
    # log W per sequence, summed in fp64 (no clamp: the ESS is computed in log space and stays finite)
    log_big_w = torch.where(m, old - rollout, 0.0).sum(-1)[present]
    log_ess = 2 * torch.logsumexp(log_big_w, 0) - math.log(log_big_w.numel()) - torch.logsumexp(2 * log_big_w, 0)
    return {
        "mismatch/k3_kl": (torch.expm1(d) - d).mean().item(),
        "mismatch/chi2": torch.expm1(d).square().mean().item(),
        "mismatch/seq_ess": log_ess.exp().item(),
        "mismatch/abs_logp_diff_mean": abs_diff.mean().item(),
        "mismatch/abs_logp_diff_p99": abs_diff.kthvalue(math.ceil(0.99 * n)).values.item(),
        "mismatch/abs_logp_diff_max": abs_diff.max().item(),
        "mismatch/seq_weight_mean": sequence_mean(weight.clamp(max=cap), m).item(),
        "mismatch/seq_weight_clipped_frac": sequence_mean((weight > cap).double(), m).item(),
        "mismatch/abs_log_w_mean": sequence_mean(log_w.abs(), m).item(),
        **by_length("mismatch/abs_log_w_mean", log_w.abs()[present], m.sum(-1)[present]),
    }
