"""mismatch_metrics against numbers worked out by hand (docs/design.md, "Metrics that every step logs")."""

import math

import pytest
import torch

from qarl_cli.update.mismatch import mismatch_metrics

LN2 = math.log(2)


def metrics_for(diff, mask, cap=2.0, dtype=torch.float64):
    """Metrics for per-token differences old - rollout (old fixed, rollout = old - diff)."""
    diff, mask = torch.tensor(diff, dtype=dtype), torch.tensor(mask)
    old = -torch.linspace(0.5, 3.0, diff.numel(), dtype=dtype).view_as(diff)
    return mismatch_metrics(old, old - diff, mask, cap)


def test_by_hand():
    # Response tokens old - rollout: row0 ln 2, 0 (+ one padded position holding garbage); row1 ln 2, ln 4, ln 8;
    # row2 is an empty response. r = exp(d): 2, 1, 2, 4, 8.
    diff = [[LN2, 0.0, 50.0], [LN2, 2 * LN2, 3 * LN2], [9.0, 9.0, 9.0]]
    mask = [[1, 1, 0], [1, 1, 1], [0, 0, 0]]
    m = metrics_for(diff, mask)
    # k3 = r - 1 - ln r: 2 - 1 - 0.693147 = 0.306853 (twice), 0, 4 - 1 - 1.386294 = 1.613706,
    #                    8 - 1 - 2.079442 = 4.920558
    # mean over 5 tokens = (2 * 0.306853 + 1.613706 + 4.920558) / 5
    assert m["mismatch/k3_kl"] == pytest.approx(1.4295939472160761, rel=1e-12)
    # |d| = (1 + 0 + 1 + 2 + 3) ln 2 / 5 = 1.4 ln 2; p99 of 5 values by nearest rank: the ceil(4.95) = 5th, the max
    assert m["mismatch/abs_logp_diff_mean"] == pytest.approx(0.9704060527839233, rel=1e-12)
    assert m["mismatch/abs_logp_diff_p99"] == pytest.approx(2.0794415416798357, rel=1e-12)  # 3 ln 2
    assert m["mismatch/abs_logp_diff_max"] == pytest.approx(2.0794415416798357, rel=1e-12)
    # sequence weights exp(mean_t d): row0 exp(ln 2 / 2) = sqrt 2; row1 exp(2 ln 2) = 4 -> capped at 2; row2 excluded
    assert m["mismatch/seq_weight_mean"] == pytest.approx(1.7071067811865475, rel=1e-12)  # (sqrt 2 + 2) / 2
    assert m["mismatch/seq_weight_clipped_frac"] == 0.5
    # |log w| = |mean_t d|: row0 ln 2 / 2, row1 2 ln 2 (uncapped), mean 1.25 ln 2; both rows are under 32 tokens
    assert m["mismatch/abs_log_w_mean"] == pytest.approx(1.25 * LN2, rel=1e-12)
    assert m["mismatch/abs_log_w_mean@0-32"] == pytest.approx(1.25 * LN2, rel=1e-12)
    # chi2 = mean (r - 1)^2 = (1 + 0 + 1 + 9 + 49) / 5 = 12; sequence weights W = prod r: row0 2, row1 64, so
    # ESS = (2 + 64)^2 / (2 * (4 + 4096)) = 4356 / 8200
    assert m["mismatch/chi2"] == pytest.approx(12.0, rel=1e-12)
    assert m["mismatch/seq_ess"] == pytest.approx(4356 / 8200, rel=1e-12)


def test_ess_of_long_sequences_stays_finite_and_equal_weights_give_one():
    """400 tokens at d = +0.5 against 400 at d = -0.5: W = e^200 and e^-200 (each overflows fp32 products);
    the ESS is (e^200 + e^-200)^2 / (2 (e^400 + e^-400)) = 1/2 to double precision. Equal W: ESS 1."""
    m = metrics_for([[0.5] * 400, [-0.5] * 400], [[1] * 400] * 2)
    assert m["mismatch/seq_ess"] == pytest.approx(0.5, rel=1e-12)
    m = metrics_for([[0.3, -0.1], [0.1, 0.1]], [[1, 1]] * 2)
    assert m["mismatch/seq_ess"] == pytest.approx(1.0, rel=1e-12)


def test_p99_is_nearest_rank():
    # |d| = 0.01, 0.02, ..., 2.00 (200 tokens, shuffled, signs alternating): the ceil(0.99 * 200) = 198th is 1.98
    order = torch.randperm(200, generator=torch.Generator().manual_seed(0)).add(1).tolist()
    values = [0.01 * k * (-1) ** k for k in order]
    m = metrics_for([values[:100], values[100:]], [[1] * 100] * 2)
    assert m["mismatch/abs_logp_diff_p99"] == pytest.approx(1.98, rel=1e-12)
    assert m["mismatch/abs_logp_diff_max"] == pytest.approx(2.0, rel=1e-12)
    assert m["mismatch/abs_logp_diff_mean"] == pytest.approx(1.005, rel=1e-12)  # 0.01 * 201 / 2


def test_cap_is_a_parameter():
    # one sequence with weight e^1 = 2.718: clipped under cap 2, not under cap 3
    assert metrics_for([[1.0, 1.0]], [[1, 1]], cap=2.0)["mismatch/seq_weight_mean"] == pytest.approx(2.0)
    m = metrics_for([[1.0, 1.0]], [[1, 1]], cap=3.0)
    assert m["mismatch/seq_weight_mean"] == pytest.approx(2.718281828459045, rel=1e-12)
    assert m["mismatch/seq_weight_clipped_frac"] == 0.0


def test_tiny_differences_keep_k3_precise():
    # fp32 input, d = 1e-7 (nearly identical kernels): k3 = e^d - 1 - d = d^2 / 2 + d^3 / 6 = 5e-15 (+ 2e-22).
    # r - 1 - log r is rounding noise in fp32 and 2 % off even in fp64; expm1(d) - d in fp64 is exact.
    old = torch.zeros(1, 1)  # old = 0 so that d is the fp32 value of 1e-7 itself (1.0000000117e-7)
    m = mismatch_metrics(old, torch.tensor([[-1e-7]]), torch.ones(1, 1))
    assert m["mismatch/k3_kl"] == pytest.approx(5e-15, rel=1e-6, abs=0)


def test_extreme_differences_stay_finite():
    # old - rollout = 1e4: the log ratio is clamped at 20 for k3 and the weight; |d| is reported unclamped
    m = metrics_for([[1e4, -1e4, 0.0]], [[1, 1, 1]], dtype=torch.float32)
    assert all(math.isfinite(v) for v in m.values())
    # k3: (e^20 - 1 - 20) + (e^-20 - 1 + 20) + 0, over 3 tokens
    assert m["mismatch/k3_kl"] == pytest.approx((485165174.4097903 + 19.000000002) / 3, rel=1e-6)
    assert m["mismatch/abs_logp_diff_max"] == 1e4
    assert m["mismatch/seq_weight_mean"] == 1.0  # mean_t d = 0 -> weight 1


def test_no_response_tokens_gives_zeros():
    m = metrics_for([[float("nan"), 1.0]], [[0, 0]])
    assert set(m) == {"mismatch/k3_kl", "mismatch/chi2", "mismatch/abs_logp_diff_mean", "mismatch/abs_logp_diff_p99",
                      "mismatch/abs_logp_diff_max", "mismatch/seq_weight_mean", "mismatch/seq_weight_clipped_frac",
                      "mismatch/abs_log_w_mean", "mismatch/seq_ess"}
    assert m.pop("mismatch/seq_ess") == 1.0 and all(v == 0.0 for v in m.values())


def test_abs_log_w_by_response_length():
    # Three sequences: 2 tokens with d = ln 2, ln 2 (|log w| = ln 2); 40 tokens with d = -ln 4 (|log w| = ln 4);
    # 40 tokens half +1, half -1 (log w = 0). Buckets of LENGTH_EDGES: [0, 32) holds the first, [32, 64) the others.
    width = 40
    diff = [[LN2, LN2] + [0.0] * (width - 2), [-2 * LN2] * width, [1.0, -1.0] * (width // 2)]
    mask = [[1, 1] + [0] * (width - 2), [1] * width, [1] * width]
    m = metrics_for(diff, mask)
    assert m["mismatch/abs_log_w_mean"] == pytest.approx((LN2 + 2 * LN2 + 0.0) / 3, rel=1e-12)
    assert m["mismatch/abs_log_w_mean@0-32"] == pytest.approx(LN2, rel=1e-12)
    assert m["mismatch/abs_log_w_mean@32-64"] == pytest.approx(LN2, rel=1e-12)  # (ln 4 + 0) / 2
    assert not any(k.startswith("mismatch/abs_log_w_mean@64") or k.endswith("@128-") for k in m)
