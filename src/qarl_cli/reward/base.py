"""The reward stage's contract: score completions against gold answers, with per-sample details."""

from dataclasses import dataclass
from typing import Protocol

# Every sample ends in exactly one of these.
# unevaluated: arithmetic where the gold is a number ('88+7' for 95), which math-verify alone would accept.
STATUSES = ("correct", "wrong", "unevaluated", "no_answer", "timeout", "crash", "bad_gold")
# Statuses that say something went wrong in scoring rather than in the answer; counted separately in metrics.
FAILURES = ("timeout", "crash", "bad_gold")


@dataclass(frozen=True)
class SampleDetail:
    status: str  # one of STATUSES
    boxed: bool  # the completion contains a closed \boxed{...} (the format check)
    seconds: float  # wall time from handing the sample to a worker until its answer (or its kill)


@dataclass
class RewardResult:
    rewards: list[float]
    details: list[SampleDetail]

    def metrics(self) -> dict[str, float]:
        """`reward/mean`, `reward/acc` (fraction correct), `reward/<status>_frac` for every status,
        `reward/<failure>_count` for timeout, crash and bad_gold, `reward/boxed_frac`, `reward/sample_time_max_s`."""
        n = len(self.details)
        count = {s: 0 for s in STATUSES}
        for d in self.details:
            count[d.status] += 1
        out = {
            "reward/mean": sum(self.rewards) / max(n, 1),
            "reward/acc": count["correct"] / max(n, 1),
            "reward/boxed_frac": sum(d.boxed for d in self.details) / max(n, 1),
            "reward/sample_time_max_s": max((d.seconds for d in self.details), default=0.0),
        }
        out.update({f"reward/{s}_frac": count[s] / max(n, 1) for s in STATUSES})
        out.update({f"reward/{s}_count": float(count[s]) for s in FAILURES})
        return out


class RewardFn(Protocol):
    def score(self, completions: list[str], golds: list[str]) -> RewardResult:
        """One reward per completion; golds[i] is the gold final answer of completions[i]. Never hangs:
        a sample that cannot be scored in time gets a failure status."""
        ...

    def close(self) -> None:
        """Release workers; idempotent."""
        ...
