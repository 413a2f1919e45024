"""Objectives against numbers worked out by hand, plus the edge cases of issue 6.

Hand calculations use float64 inputs; "s" is a sequence ratio exp(mean_t(logprobs - old)), "r" a token ratio. With
seq-mean-token-mean over n sequences, d loss / d logprobs_t = -(1/n) * w * A * s / L on each of the L response tokens
of an unclipped sequence (GSPO token form), and -(1/n) * w * A * r / L for an unclipped token.
"""

import dataclasses
import math

import pytest
import torch

from qarl_cli.update.advantages import group_advantages
from qarl_cli.config.algorithm import LOSS_AGGS, MISMATCH_MODES, SCHEMAS, GRPOConfig, GSPOConfig, TBPOConfig
from qarl_cli.config.errors import ConfigError
from qarl_cli.update.base import PolicyBatch
from qarl_cli.update.objectives import AGGREGATIONS, DENOMINATORS, MISMATCH_LOG_RATIOS
from qarl_cli.stages import StageUnavailable, resolve


def get_objective(name):
    return resolve("algorithm", name)

LN = math.log
F64 = torch.float64


def run(cfg, logprobs, old, rollout, adv, mask):
    """Loss, d loss / d logprobs, metrics of the objective cfg.name."""
    lp = torch.tensor(logprobs, dtype=F64, requires_grad=True) if not torch.is_tensor(logprobs) else logprobs
    batch = PolicyBatch(lp, torch.as_tensor(old, dtype=lp.dtype), torch.as_tensor(rollout, dtype=lp.dtype),
                        torch.as_tensor(adv, dtype=lp.dtype), torch.as_tensor(mask, dtype=torch.bool))
    loss, metrics = get_objective(cfg.name)(batch, cfg)
    loss.backward()
    return loss.detach(), lp.grad, metrics


def close(actual, expected, tol=1e-9):
    # (not torch.testing.assert_close: its first call costs a second of imports)
    actual, expected = torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64)
    assert actual.shape == expected.shape and torch.allclose(actual, expected, rtol=tol, atol=tol), (actual, expected)


# ---- sequence ratio: tbpo, gspo ---------------------------------------------------------------------------------
# Four sequences, lengths 2, 3, 3, 2. Per-token logprobs - old vary, the means are what counts:
#   seq0 A=+0.5  mean 0.0002  s0 = e^0.0002  = 1.00020002000133   inside TBPO's [0.999, 1.001], GSPO's [0.9997, 1.0004]
#   seq1 A=+1.0  mean 0.001   s1 = e^0.001   = 1.00100050016671   above 1.001 and 1.0004: clipped
#   seq2 A=-1.5  mean 0.0005  s2 = e^0.0005  = 1.00050012502084   inside TBPO's negative band [0.999, 1.001]
#   seq3 A=-1.0  mean -0.0005 s3 = e^-0.0005 = 0.99950012497917   inside TBPO's band, below GSPO's 0.9997: clipped
# (token-wise, seq2's first token has r = e^0.0015, outside every band: only the mean may matter)
# Mismatch old - rollout per sequence mean: ln 1, ln 1.5, ln 3, ln 0.25 -> rho = 1, 1.5, 3, 0.25; TBPO's
# w = clamp(rho, 1/2, 2) = 1, 1.5, 2, 0.5; the one-sided min(rho, 2) = 1, 1.5, 2, 0.25.
SEQ_MASK = [[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0]]
SEQ_OLD = [[-1.0, -2.0, 0.0], [-0.5, -1.0, -3.0], [-2.0, -1.0, -1.0], [-1.0, -0.5, 0.0]]
SEQ_DELTA = [[0.0001, 0.0003, 0.0], [0.0, 0.001, 0.002], [0.0015, 0.0, 0.0], [-0.001, 0.0, 0.0]]
SEQ_MISMATCH = [[0.0, 0.0, 0.0], [LN(1.5) + 0.2, LN(1.5) - 0.2, LN(1.5)], [LN(3)] * 3, [LN(0.25)] * 2 + [0.0]]
SEQ_ADV = [0.5, 1.0, -1.5, -1.0]


def seq_case(cfg):
    lp = [[o + d for o, d in zip(*rows)] for rows in zip(SEQ_OLD, SEQ_DELTA)]
    rollout = [[o - x for o, x in zip(*rows)] for rows in zip(SEQ_OLD, SEQ_MISMATCH)]
    return run(cfg, lp, SEQ_OLD, rollout, SEQ_ADV, SEQ_MASK)


S0, S2, S3 = 1.00020002000133, 1.00050012502084, 0.99950012497917


def test_tbpo_by_hand_as_the_public_loss_computes_it():
    cfg = TBPOConfig()
    assert (cfg.eps_high, cfg.eps_neg_low, cfg.eps_neg_high) == (1e-3, 1e-3, 1e-3)
    assert cfg.mismatch_clip == "both" and not cfg.drop_outside_band
    loss, grad, metrics = seq_case(cfg)
    # g = [0.5 s0, 1.0 * 1.001, -1.5 s2, -1.0 s3], w = [1, 1.5, 2, 0.5];  loss = -(1/4) sum_i w_i g_i
    close(loss, -(0.5 * S0 + 1.5 * 1.001 - 2 * 1.5 * S2 - 0.5 * S3) / 4)
    # seq0: -(1/4) * 1 * 0.5 * s0 / 2;  seq1 clipped;  seq2: -(1/4) * 2 * (-1.5) * s2 / 3;  seq3: -(1/4) * 0.5 * (-1) * s3 / 2
    g0, g2, g3 = -S0 / 16, S2 / 4, S3 / 16
    close(grad, [[g0, g0, 0], [0, 0, 0], [g2, g2, g2], [g3, g3, 0]])
    close(metrics["objective/clip_frac_pos"], 3 / 5)  # seq1's 3 of 5 positive tokens
    close(metrics["objective/clip_frac_neg"], 0.0)  # both negatives inside the band
    close(metrics["objective/dropped_frac"], 0.0)
    close(metrics["objective/seq_ratio_mean"], 1.0003001925420119)  # (s0 + s1 + s2 + s3) / 4
    close(metrics["objective/mismatch_weight_mean"], (1 * 2 + 1.5 * 3 + 2 * 3 + 0.5 * 2) / 10)  # per token
    close(metrics["objective/mismatch_weight_clipped_frac"], 0.5)  # seq2 (3 > 2) and seq3 (0.25 < 1/2): 5 tokens


def test_tbpo_one_sided_weight_clip_option_by_hand():
    loss, grad, metrics = seq_case(dataclasses.replace(TBPOConfig(), mismatch_clip="upper"))
    # as above with seq3's weight min(0.25, 2) = 0.25
    close(loss, -(0.5 * S0 + 1.5 * 1.001 - 2 * 1.5 * S2 - 0.25 * S3) / 4)
    close(grad[3], [S3 / 32, S3 / 32, 0])
    close(metrics["objective/mismatch_weight_clipped_frac"], 0.3)  # only seq2's 3 tokens are above 2


def test_tbpo_past_the_band_on_both_signs_and_an_empty_row_by_hand():
    # a: A=+1, mean 0.0005, s = e^0.0005, inside;      rho 4    -> w 2
    # b: A=+1, mean -0.01, s = e^-0.01, below the band: a positive keeps its gradient (min(s, 1.001) = s);
    #    rho 0.1 -> w 1/2
    # c: A=-1, mean 0.002, s = e^0.002 > 1.001: the term is -1.001, no gradient;   rho 0.8 -> w 0.8
    # d: A=-1, mean -0.002, s = e^-0.002 < 0.999: the term is -0.999, no gradient; rho 1.2 -> w 1.2
    # e: no response token: left out of the mean (over 4 sequences), no gradient
    mask = [[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]]
    old = [[-1.0, -2.0, -1.0]] * 5
    delta = [[0.0004, 0.0006, 0], [-0.01, -0.02, 0.0], [0.004, 0.0, 0], [-0.002, 0, 0], [0.5, 0.5, 0.5]]
    lp = [[o + d for o, d in zip(ro, rd)] for ro, rd in zip(old, delta)]
    log_rho = [LN(4), LN(0.1), LN(0.8), LN(1.2), 0.0]
    rollout = [[o - x for o in ro] for ro, x in zip(old, log_rho)]
    loss, grad, metrics = run(TBPOConfig(), lp, old, rollout, [1.0, 1.0, -1.0, -1.0, 1.0], mask)
    sa, sb = math.exp(0.0005), math.exp(-0.01)
    close(loss, -(2 * sa + 0.5 * sb - 0.8 * 1.001 - 1.2 * 0.999) / 4)
    ga, gb = -2 * sa / 4 / 2, -0.5 * sb / 4 / 3
    close(grad, [[ga, ga, 0], [gb, gb, gb], [0, 0, 0], [0, 0, 0], [0, 0, 0]])
    close(metrics["objective/clip_frac_pos"], 0.0)
    close(metrics["objective/clip_frac_neg"], 1.0)
    close(metrics["objective/mismatch_weight_clipped_frac"], 5 / 8)  # a's 2 and b's 3 of 8 response tokens


def test_tbpo_keep_mask_option_by_hand():
    loss, grad, metrics = seq_case(dataclasses.replace(TBPOConfig(), drop_outside_band=True))
    # band [1/2, 2]: seq2 (3) and seq3 (0.25) get weight 0 but still count among the 4 sequences
    close(loss, -(0.5 * S0 + 1.5 * 1.001) / 4)
    g0 = -S0 / 16
    close(grad, [[g0, g0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]])
    close(metrics["objective/dropped_frac"], 0.5)  # 5 of 10 tokens
    close(metrics["objective/mismatch_weight_mean"], 1.3)  # kept tokens only: (1 * 2 + 1.5 * 3) / 5


def test_positive_only_drops_negative_terms_but_keeps_their_count_by_hand():
    cfg = dataclasses.replace(TBPOConfig(), positive_only=True)
    loss, grad, _ = seq_case(cfg)
    # Only seq0 and seq1 contribute, still over 4 sequences: -(1 * 0.5 * s0 + 1.5 * 1.001) / 4
    close(loss, -(0.5 * 1.00020002000133 + 1.5 * 1.001) / 4)
    g0 = -1.00020002000133 / 16  # seq0's gradient is the full objective's: positive terms are unchanged
    close(grad, [[g0, g0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]])
    # GSPO (no weight): seq2, which GSPO alone would follow (grad s2 / 8), gets none
    _, grad, _ = seq_case(dataclasses.replace(GSPOConfig(), positive_only=True))
    close(grad, [[g0, g0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]])


def test_gspo_by_hand():
    loss, grad, metrics = seq_case(GSPOConfig())
    # no weight; negatives use the PPO min: seq2 (s2 > 1.0004, A < 0) keeps its gradient, seq3 (s3 < 0.9997) is cut
    # loss = -(0.5 s0 + 1.0004 - 1.5 s2 - 0.9997) / 4
    close(loss, 0.24998754438264675)
    g0, g2 = -1.00020002000133 / 16, 1.00050012502084 / 8  # seq2: -(1/4) * (-1.5) * s2 / 3
    close(grad, [[g0, g0, 0], [0, 0, 0], [g2, g2, g2], [0, 0, 0]])
    close(metrics["objective/clip_frac_pos"], 3 / 5)
    close(metrics["objective/clip_frac_neg"], 2 / 5)
    close(metrics["objective/mismatch_weight_mean"], 1.0)
    close(metrics["objective/mismatch_weight_clipped_frac"], 0.0)


# ---- token ratio: grpo, dapo ------------------------------------------------------------------------------------
# Two sequences; row1 has one padded position. Token ratios r and advantages:
#   row0 A=+0.5: r = 1.1, 1.25, 0.5        row1 A=-2: r = 0.5, 1.5
# GRPO band [0.8, 1.2]: row0 terms 0.55 (grad 0.55), 1.2 * 0.5 = 0.6 (cut), min(0.25, 0.4) = 0.25 (grad 0.25);
# row1 terms min(-1, -1.6) = -1.6 (cut), min(-3, -2.4) = -3 (grad A r = -3).
TOK_MASK = [[1, 1, 1], [1, 1, 0]]
TOK_OLD = [[-1.0, -2.0, -0.5], [-1.0, -1.5, 0.0]]
TOK_RATIO = [[1.1, 1.25, 0.5], [0.5, 1.5, 1.0]]
TOK_ADV = [0.5, -2.0]


def tok_case(cfg, mismatch=((0.0, 0.0, 0.0), (0.0, 0.0, 0.0))):
    lp = [[o + LN(r) for o, r in zip(*rows)] for rows in zip(TOK_OLD, TOK_RATIO)]
    rollout = [[o - x for o, x in zip(*rows)] for rows in zip(TOK_OLD, mismatch)]
    return run(cfg, lp, TOK_OLD, rollout, TOK_ADV, TOK_MASK)


@pytest.mark.parametrize("agg, expected_loss, expected_grad", [
    # -(1/2) * ((0.55 + 0.6 + 0.25) / 3 + (-1.6 - 3) / 2) = -(1/2) * (7/15 - 23/10) = 11/12
    # grads -(1/2) * (1/L) * A r: row0 -0.55/6, 0, -0.25/6; row1 0, -(1/4) * (-3) = 0.75
    ("seq-mean-token-mean", 11 / 12, [[-0.55 / 6, 0, -0.25 / 6], [0, 0.75, 0]]),
    # -(0.55 + 0.6 + 0.25 - 1.6 - 3) / 5 = 3.2 / 5;  grads -(1/5) * A r
    ("token-mean", 0.64, [[-0.11, 0, -0.05], [0, 0.6, 0]]),
    # -(1/2) * ((0.55 + 0.6 + 0.25) + (-1.6 - 3)) = 1.6;  grads -(1/2) * A r
    ("seq-mean-token-sum", 1.6, [[-0.275, 0, -0.125], [0, 1.5, 0]]),
])
def test_grpo_by_hand(agg, expected_loss, expected_grad):
    loss, grad, metrics = tok_case(dataclasses.replace(GRPOConfig(), loss_agg=agg))
    close(loss, expected_loss)
    close(grad, expected_grad)
    close(metrics["objective/clip_frac_pos"], 1 / 3)  # r = 1.25 > 1.2
    close(metrics["objective/clip_frac_neg"], 1 / 2)  # r = 0.5 < 0.8
    # geometric means: (1.1 * 1.25 * 0.5)^(1/3) = 0.8641, sqrt(0.5 * 1.5) = 0.8660; their mean
    close(metrics["objective/seq_ratio_mean"], 0.8743062438079772)


def test_dapo_by_hand():
    loss, grad, metrics = tok_case(SCHEMAS["dapo"]())
    # band [0.8, 1.28]: r = 1.25 is now inside (term 0.625, grad 0.625); token-mean over 5 tokens
    # loss = -(0.55 + 0.625 + 0.25 - 1.6 - 3) / 5 = 3.175 / 5
    close(loss, 0.635)
    close(grad, [[-0.11, -0.125, -0.05], [0, 0.6, 0]])
    close(metrics["objective/clip_frac_pos"], 0.0)
    close(metrics["objective/clip_frac_neg"], 1 / 2)


# Token mismatch old - rollout: row0 ln 3, 0, ln 0.8 -> w = 2 (capped), 1, 0.8; row1 ln 1.5, ln 4 -> w = 1.5, 2 (capped)
TOK_MISMATCH = ((LN(3), 0.0, LN(0.8)), (LN(1.5), LN(4), 0.0))


def test_grpo_tis_by_hand():
    loss, grad, metrics = tok_case(dataclasses.replace(GRPOConfig(), mismatch="tis"), TOK_MISMATCH)
    # -(1/2) * ((2 * 0.55 + 0.6 + 0.8 * 0.25) / 3 + (1.5 * -1.6 + 2 * -3) / 2) = -(1/2) * (19/30 - 4.2) = 107/60
    close(loss, 107 / 60)
    # row0: -(1/6) * 2 * 0.55, 0, -(1/6) * 0.8 * 0.25;  row1: 0, -(1/4) * 2 * (-3)
    close(grad, [[-1.1 / 6, 0, -0.2 / 6], [0, 1.5, 0]])
    close(metrics["objective/mismatch_weight_mean"], 1.46)  # (2 + 1 + 0.8 + 1.5 + 2) / 5
    close(metrics["objective/mismatch_weight_clipped_frac"], 0.4)  # raw 3 and 4


def test_grpo_tis_drop_outside_band_by_hand():
    cfg = dataclasses.replace(GRPOConfig(), mismatch="tis", drop_outside_band=True)
    loss, grad, metrics = tok_case(cfg, TOK_MISMATCH)
    # raw 3 and 4 lie outside [0.5, 2]: weight 0. -(1/2) * ((0.6 + 0.8 * 0.25) / 3 + (1.5 * -1.6) / 2) = 7/15
    close(loss, 7 / 15)
    close(grad, [[0, 0, -0.2 / 6], [0, 0, 0]])
    close(metrics["objective/dropped_frac"], 0.4)
    close(metrics["objective/mismatch_weight_mean"], 1.1)  # (1 + 0.8 + 1.5) / 3 kept tokens


# ---- far outside the band ---------------------------------------------------------------------------------------

def test_far_outside_band_negatives_get_no_gradient_under_tbpo():
    # seq0 A=+1 and seq1 A=-1 at s = e^0.05 = 1.0513 (above both bands), seq2 A=-1 at s = e^-0.05 (below).
    # TBPO: every g is its clipped value: -(1.001 - 1.001 - 0.999) / 3 = 0.333, and no gradient anywhere.
    old = [[-1.0, -1.0]] * 3
    lp = [[-1.0 + 0.05] * 2, [-1.0 + 0.05] * 2, [-1.0 - 0.05] * 2]
    loss, grad, _ = run(TBPOConfig(), lp, old, old, [1.0, -1.0, -1.0], [[1, 1]] * 3)
    close(loss, 0.999 / 3)
    close(grad, torch.zeros(3, 2))
    # GSPO's PPO rule follows a negative sample above its band: seq1 gets -(1/3) * (-1) * e^0.05 / 2 = 0.1752
    _, grad, _ = run(GSPOConfig(), lp, old, old, [1.0, -1.0, -1.0], [[1, 1]] * 3)
    close(grad, [[0, 0], [0.175211849396004] * 2, [0, 0]])


def test_dual_clip_stops_token_ratio_far_above_band():
    # GRPO, A = -1, r = e^2 = 7.389: PPO follows it (grad -(1/1) * (-1) * e^2 / 2 per token with seq-mean-token-mean);
    # with dual_clip the band is [0.8, 1 + 2.0 = 3] (classic dual-clip PPO, c = 3): no gradient.
    lp, old = [[2.0, 2.0]], [[0.0, 0.0]]
    _, grad, _ = run(GRPOConfig(), lp, old, old, [-1.0], [[1, 1]])
    close(grad, [[7.38905609893065 / 2] * 2])
    _, grad, metrics = run(dataclasses.replace(GRPOConfig(), dual_clip=True), lp, old, old, [-1.0], [[1, 1]])
    close(grad, [[0.0, 0.0]])
    close(metrics["objective/clip_frac_neg"], 1.0)


# ---- edge cases over every objective ----------------------------------------------------------------------------

CONFIGS = [cls() for cls in SCHEMAS.values()] + [
    dataclasses.replace(GRPOConfig(), mismatch="tis", drop_outside_band=True),
    dataclasses.replace(GSPOConfig(), mismatch="tis"),
    dataclasses.replace(SCHEMAS["dapo"](), mismatch="seq", dual_clip=True),
    dataclasses.replace(TBPOConfig(), mismatch_clip="upper", drop_outside_band=True),
]
IDS = [f"{c.name}-{c.mismatch}-{c.mismatch_clip}" + ("-keep" if c.drop_outside_band else "") for c in CONFIGS]


def random_case(seed, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 5, generator=g, dtype=dtype) * 3
    return dict(logprobs=old + torch.randn(4, 5, generator=g, dtype=dtype) * 1e-3, old=old,
                rollout=old + torch.randn(4, 5, generator=g, dtype=dtype) * 0.3,
                adv=torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=dtype),
                mask=torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]))


def run_case(cfg, c):
    lp = c["logprobs"].clone().requires_grad_(True)
    return run(cfg, lp, c["old"], c["rollout"], c["adv"], c["mask"])


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_equal_rewards_give_zero_loss_and_gradient(cfg):
    c = random_case(0)
    c["adv"] = group_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), group_size=2).to(F64)  # two flat groups
    loss, grad, metrics = run_case(cfg, c)
    assert loss.item() == 0.0 and torch.all(grad == 0)
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_padding_garbage_changes_nothing(cfg):
    clean, dirty = random_case(1), random_case(1)
    pad = ~dirty["mask"].bool()
    for key, junk in (("logprobs", float("nan")), ("old", 1e4), ("rollout", -float("inf"))):
        dirty[key] = dirty[key].masked_fill(pad, junk)
    loss, grad, metrics = run_case(cfg, clean)
    dirty_loss, dirty_grad, dirty_metrics = run_case(cfg, dirty)
    close(dirty_loss, loss, tol=0)
    close(dirty_grad, grad, tol=0)
    assert dirty_metrics == metrics


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_empty_response_row_changes_nothing(cfg):
    c = random_case(2)
    loss, grad, metrics = run_case(cfg, c)
    # the same batch plus a fifth, all-padding row holding garbage
    bigger = {k: torch.cat([v, v[:1] * 7]) for k, v in c.items()}
    bigger["mask"][4] = 0
    bigger_loss, bigger_grad, bigger_metrics = run_case(cfg, bigger)
    close(bigger_loss, loss, tol=1e-12)
    close(bigger_grad, torch.cat([grad, torch.zeros(1, 5, dtype=F64)]), tol=1e-12)
    assert bigger_metrics == pytest.approx(metrics, rel=1e-12)
    # and a batch of nothing but empty rows: a zero loss, no NaN
    c["mask"] = torch.zeros_like(c["mask"])
    loss, grad, metrics = run_case(cfg, c)
    assert loss.item() == 0.0 and torch.all(grad == 0)
    assert all(v == 0.0 for v in metrics.values())


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_extreme_logprobs_stay_finite(cfg):
    c = random_case(3, dtype=torch.float32)
    c["logprobs"][:, 0] = -1e4  # the policy gives a sampled token almost no probability
    c["old"][:, 1] = -1e4  # the aligned trainer does
    c["rollout"][:, 2] = -1e4  # the engine does
    loss, grad, metrics = run_case(cfg, c)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(math.isfinite(v) for v in metrics.values())


# ---- selection and configuration --------------------------------------------------------------------------------

def test_get_objective_rejects_unknown_name():
    with pytest.raises(StageUnavailable, match=r"algorithm=ppo is not an option.*dapo, grpo, gspo, tbpo"):
        get_objective("ppo")


def test_tables_match_config_choices():
    assert tuple(AGGREGATIONS) == LOSS_AGGS
    assert tuple(MISMATCH_LOG_RATIOS) == MISMATCH_MODES
    assert all(SCHEMAS[name]().name == name for name in SCHEMAS)
    # the sequence-ratio objectives share one core, the token-ratio ones the other
    assert get_objective("tbpo") is get_objective("gspo") is not get_objective("grpo") is get_objective("dapo")


@pytest.mark.parametrize("schema, field, value, message", [
    (TBPOConfig, "eps_low", -1e-4, "eps_low=-0.0001: must be in [0, 1)"),
    (TBPOConfig, "eps_neg_low", 1.0, "eps_neg_low=1.0: must be in [0, 1)"),
    (TBPOConfig, "eps_high", -0.1, "eps_high=-0.1: must be >= 0"),
    (GRPOConfig, "eps_neg_high", -0.5, "eps_neg_high=-0.5: must be >= 0"),  # nan: config/finite.py's
    (TBPOConfig, "mismatch_cap", 0.5, "mismatch_cap=0.5: must be >= 1"),
    (TBPOConfig, "mismatch_clip", "lower", "mismatch_clip='lower': must be one of"),
    (TBPOConfig, "mismatch", "is", "mismatch='is': must be one of ('none', 'tis', 'seq')"),
    (GRPOConfig, "loss_agg", "mean", "loss_agg='mean': must be one of ('token-mean', 'seq-mean-token-mean', "),
    (GSPOConfig, "drop_outside_band", True, "drop_outside_band=True: needs mismatch 'tis' or 'seq'"),
])
def test_config_rejects_bad_values(schema, field, value, message):
    from qarl_cli.config.domains import check_domains  # ranges: the schema's DOMAINS; the rest: its validators

    with pytest.raises(ConfigError) as err:
        check_domains(schema(**{field: value}))
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
def test_rank_shares_weighted_by_their_denominators_sum_to_the_whole_batch_loss(agg):
    """What data-parallel ranks rely on: each rank aggregates its rows, weighted by its share of the batch's
    denominator; the weighted sum is the whole batch's aggregate, for any split (an all-padding row included)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    m = torch.rand(7, 5, generator=gen) > 0.4
    m[2] = False  # a row without response tokens
    whole = AGGREGATIONS[agg](x, m)
    count = DENOMINATORS[agg]
    for parts in ([[0, 2, 4, 6], [1, 3, 5]], [[2], [0, 1, 3, 4, 5, 6]], [[0, 1], [2, 3], [4, 5, 6]]):
        total = sum(count(m[p]).item() / count(m).item() * AGGREGATIONS[agg](x[p], m[p]) for p in parts)
        assert total.item() == pytest.approx(whole.item(), rel=1e-12)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_entropy_coef_subtracts_the_aggregated_entropy_and_its_gradient(name):
    """entropy_coef c: loss = the objective's loss - c * agg(H), for c < 0 (sharpening) and c > 0 (bonus); padded
    positions of H (here NaN) never count. H's gradient is -c times the aggregation's weight of each position."""
    cfg0 = dataclasses.replace(SCHEMAS[name](), loss_agg="token-mean")
    lp = [[o + d for o, d in zip(*rows)] for rows in zip(SEQ_OLD, SEQ_DELTA)]
    base, _, _ = run(cfg0, lp, SEQ_OLD, SEQ_OLD, SEQ_ADV, SEQ_MASK)
    h_values = [[0.5, 1.0, float("nan")], [0.2, 0.3, 0.4], [1.5, 0.1, 0.0], [0.7, 0.9, float("nan")]]
    n_tokens = sum(map(sum, SEQ_MASK))  # 10
    mean_h = sum(h for row, m in zip(h_values, SEQ_MASK) for h, k in zip(row, m) if k) / n_tokens
    for c in (-0.1, 0.05):
        cfg = dataclasses.replace(cfg0, entropy_coef=c)
        h = torch.tensor(h_values, dtype=F64, requires_grad=True)
        batch = PolicyBatch(torch.tensor(lp, dtype=F64, requires_grad=True), torch.tensor(SEQ_OLD, dtype=F64),
                            torch.tensor(SEQ_OLD, dtype=F64), torch.tensor(SEQ_ADV, dtype=F64),
                            torch.tensor(SEQ_MASK, dtype=torch.bool), h)
        loss, metrics = get_objective(name)(batch, cfg)
        loss.backward()
        close(loss.detach(), base - c * mean_h)
        assert metrics["objective/entropy"] == pytest.approx(mean_h, rel=1e-12)
        close(h.grad, [[-c / n_tokens * k for k in row] for row in SEQ_MASK])


def test_next_token_entropy_is_the_categorical_entropy_of_each_position():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from qarl_cli.forward.logprobs import next_token_logprobs

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)).eval()
    ids = torch.randint(0, 40, (3, 7))
    attn = torch.ones_like(ids)
    logp, h = next_token_logprobs(model, ids, attn, entropy=True)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    expected = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.allclose(h, expected, atol=1e-5)
    picked = torch.distributions.Categorical(logits=logits).log_prob(ids[:, 1:])  # log p of each next token
    assert logp.shape == (3, 6) and torch.allclose(logp, picked, atol=1e-5)
    assert torch.equal(logp, next_token_logprobs(model, ids, attn))  # the same with or without the entropy
