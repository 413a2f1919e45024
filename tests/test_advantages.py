"""Group-normalised advantages and the no-signal mask, against numbers worked out by hand."""

import pytest
import torch

from qarl_cli.update.advantages import group_advantages, signal_mask

# Three prompts, four samples each: mixed, all correct, one correct of four.
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0])


def test_std_normalized_by_hand():
    a = group_advantages(REWARDS, group_size=4)
    # group 0: mean 0.5, population std 0.5 -> +-0.5 / (0.5 + 1e-6) = +-0.999998000004
    # group 1: all equal -> 0 / (0 + 1e-6) = 0
    # group 2: mean 0.25, std sqrt((3 * 0.0625 + 0.5625) / 4) = sqrt(0.1875) = 0.4330127018922193
    #          -0.25 / 0.4330137 = -0.5773489358593717, 0.75 / 0.4330137 = 1.732046807578115
    expected = [0.999998000004, -0.999998000004, -0.999998000004, 0.999998000004, 0, 0, 0, 0,
                -0.5773489358593717, -0.5773489358593717, -0.5773489358593717, 1.732046807578115]
    assert a.tolist() == pytest.approx(expected, rel=1e-6)


def test_without_std():
    a = group_advantages(REWARDS, group_size=4, std_normalize=False)
    assert a.tolist() == [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, -0.25, -0.25, -0.25, 0.75]


def test_signal_mask():
    assert signal_mask(REWARDS, group_size=4).tolist() == [True] * 4 + [False] * 4 + [True] * 4


def test_single_sample_groups_have_no_signal_and_no_nan():
    rewards = torch.tensor([1.0, 0.0])
    assert group_advantages(rewards, group_size=1).tolist() == [0.0, 0.0]
    assert signal_mask(rewards, group_size=1).tolist() == [False, False]


@pytest.mark.parametrize("group_size", [0, 5])
def test_rejects_groups_that_do_not_split(group_size):
    with pytest.raises(ValueError, match=f"do not split into groups of {group_size}"):
        group_advantages(REWARDS, group_size)
