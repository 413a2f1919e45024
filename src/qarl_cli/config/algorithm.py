"""Schema of the `algorithm` config group: which policy objective the update uses, and its constants.

One dataclass per objective; its defaults are that objective's constants (docs/design.md, "Objectives") and live only
here (the schemas are the group's options). No torch import: `qarl --help` imports this module.
Formulas and the meaning of every field: docs/objectives.md.
"""

from dataclasses import dataclass
from typing import ClassVar

from omegaconf import MISSING

from qarl_cli.config.errors import ANY, between, ge, require

# What corrects for the rollout engine's logprobs (mu) differing from the aligned trainer's (pi_old):
# nothing, a per-token weight (truncated importance sampling), or one weight per sequence (TBPO's).
MISMATCH_MODES = ("none", "tis", "seq")
# How the mismatch weight rho = pi_old / mu is bounded by C (mismatch_cap): from above only, min(rho, C), as
# truncated importance sampling does; or on both sides, clamp(rho, 1/C, C), as TBPO's public loss does.
MISMATCH_CLIPS = ("upper", "both")
# How per-token loss terms become one scalar: over all response tokens; per sequence then over sequences;
# summed per sequence then averaged over sequences.
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclass
class AlgorithmConfig:
    """Fields every objective shares. "Ratio" is pi_theta / pi_old: per token, or per sequence (the geometric mean
    over its response tokens), depending on the objective. The MISSING fields are the constants each objective
    states (see the subclasses)."""

    name: str = MISSING  # option name: a key of SCHEMAS; the schema's `impl` is the loss function
    eps_low: float = MISSING  # clip band below 1: the ratio's lower bound is 1 - eps_low; in [0, 1)
    eps_high: float = MISSING  # clip band above 1: upper bound 1 + eps_high; >= 0 (inf: no upper clip)
    eps_neg_low: float = MISSING  # with dual_clip, the band of negative-advantage samples: 1 - eps_neg_low; [0, 1)
    eps_neg_high: float = MISSING  # with dual_clip: upper bound 1 + eps_neg_high for negative samples; >= 0
    # Negative-advantage samples: True clips their ratio on both sides (no gradient outside
    # [1 - eps_neg_low, 1 + eps_neg_high]); False applies the plain PPO rule (only the low side stops the gradient).
    dual_clip: bool = False
    mismatch: str = "none"  # rollout mismatch correction: one of MISMATCH_MODES
    mismatch_cap: float = 2.0  # C: the mismatch weight's bound (see mismatch_clip); >= 1 (inf: no bound)
    mismatch_clip: str = "upper"  # one of MISMATCH_CLIPS: min(rho, C), or clamp(rho, 1/C, C)
    # Mask out (weight 0) the tokens ("tis") or sequences ("seq") whose raw mismatch ratio lies outside [1/C, C];
    # they still count in the loss denominator. Needs mismatch != "none".
    drop_outside_band: bool = False
    # The paper's positive-only ablation: negative-advantage samples get weight 0 (no gradient; they still count in
    # the loss denominator, so the positive terms are exactly the full objective's).
    positive_only: bool = False
    loss_agg: str = "seq-mean-token-mean"  # one of LOSS_AGGS
    adv_std_normalize: bool = True  # advantages (r - group mean) / (group std + 1e-6); False: r - group mean
    drop_no_signal_groups: bool = True  # leave out of the update the groups whose rewards are all equal (A = 0)
    # loss -= entropy_coef * H, H the policy's next-token entropy aggregated like the loss: > 0 is an exploration
    # bonus, < 0 sharpens the policy (KL-free sharpening: it moves sampled accuracy toward greedy accuracy).
    entropy_coef: float = 0.0
    # Keys are relative to the group: the registry's validate() prefixes "algorithm.".
    DOMAINS: ClassVar[dict] = {
        **{key: between(0, 1, "the band's lower end 1 - eps is a ratio > 0", hi_open=True)
           for key in ("eps_low", "eps_neg_low")},
        **{key: ge(0, "the band's upper end is 1 + eps") for key in ("eps_high", "eps_neg_high")},
        "mismatch_cap": ge(1, "a cap below 1 down-weights every sample, and the drop band is [1/cap, cap]"),
        "entropy_coef": ANY}

    def __post_init__(self) -> None:
        require(self.mismatch in MISMATCH_MODES, "mismatch", self.mismatch, f"must be one of {MISMATCH_MODES}")
        require(not self.drop_outside_band or self.mismatch != "none", "drop_outside_band", self.drop_outside_band,
                "needs mismatch 'tis' or 'seq': which ratio to test against the band")
        require(self.mismatch_clip in MISMATCH_CLIPS, "mismatch_clip", self.mismatch_clip,
                f"must be one of {MISMATCH_CLIPS}")
        require(self.loss_agg in LOSS_AGGS, "loss_agg", self.loss_agg, f"must be one of {LOSS_AGGS}")


@dataclass
class TBPOConfig(AlgorithmConfig):
    """TBPO (QaRL) as its public sequence-level loss computes it (docs/objectives.md): sequence ratio in a trust
    band of 1e-3, negatives clipped on both sides, sequence mismatch weight clipped to [1/C, C], nothing dropped."""

    name: str = "tbpo"
    impl: ClassVar[str] = "qarl_cli.update.objectives:sequence_ratio_loss"
    eps_low: float = 1e-3  # a positive sample's lower end does not act (PPO's min), so this one is moot for tbpo
    eps_high: float = 1e-3
    eps_neg_low: float = 1e-3
    eps_neg_high: float = 1e-3
    dual_clip: bool = True
    # One weight per sequence, and no token-level importance weights on top (the public code switches them off).
    mismatch: str = "seq"
    mismatch_clip: str = "both"
    # The second public fork also returns a sequence keep mask, whose rule is not published; drop_outside_band=true
    # is a guess at it (sequences whose rho leaves [1/C, C] get weight 0), an option and not the method's default.
    drop_outside_band: bool = False


@dataclass
class GSPOConfig(AlgorithmConfig):
    """GSPO: the same sequence ratio, symmetric-rule PPO clip, no mismatch weight."""

    name: str = "gspo"
    impl: ClassVar[str] = "qarl_cli.update.objectives:sequence_ratio_loss"
    eps_low: float = 3e-4
    eps_high: float = 4e-4
    eps_neg_low: float = 3e-4  # used only with dual_clip=true, which then gives TBPO's negative band
    eps_neg_high: float = 7e-4


@dataclass
class GRPOConfig(AlgorithmConfig):
    """GRPO: per-token ratio, PPO clip 0.2."""

    name: str = "grpo"
    impl: ClassVar[str] = "qarl_cli.update.objectives:token_ratio_loss"
    eps_low: float = 0.2
    eps_high: float = 0.2
    eps_neg_low: float = 0.2  # with dual_clip=true: classic dual-clip PPO with c = 1 + eps_neg_high = 3
    eps_neg_high: float = 2.0


@dataclass
class DAPOConfig(AlgorithmConfig):
    """DAPO: per-token ratio, asymmetric clip 0.2 / 0.28 ("clip-higher"), token-mean loss."""

    name: str = "dapo"
    impl: ClassVar[str] = "qarl_cli.update.objectives:token_ratio_loss"
    eps_low: float = 0.2
    eps_high: float = 0.28
    eps_neg_low: float = 0.2  # with dual_clip=true: classic dual-clip PPO with c = 3
    eps_neg_high: float = 2.0
    loss_agg: str = "token-mean"


SCHEMAS: dict[str, type[AlgorithmConfig]] = {
    "tbpo": TBPOConfig,
    "gspo": GSPOConfig,
    "grpo": GRPOConfig,
    "dapo": DAPOConfig,
}
