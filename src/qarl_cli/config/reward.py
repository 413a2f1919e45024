"""Schema of the `reward` group: how completions are scored against gold answers.

Imported by `qarl --help`: keep it free of heavy imports (no torch, no math-verify)."""

from dataclasses import dataclass
from typing import ClassVar

from qarl_cli.config.errors import ANY, between, ge, gt, require


@dataclass
class MathVerifyRewardConfig:
    """math-verify equivalence checking in a pool of worker processes, each sample under a deadline.

    Statuses: correct, wrong, unevaluated (see require_evaluated), no_answer (nothing extractable), timeout,
    crash (the worker raised or died), bad_gold (no math expression in the gold answer). Only `correct` earns `correct_reward`; every other status
    earns `wrong_reward`, so a policy cannot gain by producing answers that hang or crash the verifier."""

    name: str = "math_verify"  # option name
    impl: ClassVar[str] = "qarl_cli.reward.math_verify:MathVerifyReward"
    # Reward of a completion whose extracted answer is equivalent to the gold answer.
    correct_reward: float = 1.0
    # Reward of every other status (wrong, unevaluated, no_answer, timeout, crash, bad_gold).
    wrong_reward: float = 0.0
    # Subtracted from the reward of a completion that contains no \boxed{...}, whatever its status. Such a
    # completion is still graded (math-verify also reads "the final answer is 42" or the last number), so with
    # a penalty p a correct unboxed answer earns correct_reward - p. 0 disables the format check.
    format_penalty: float = 0.0
    # Worker processes (spawned; each imports sympy once, about 1.5 s, while the caller goes on working).
    num_workers: int = 2
    # Per-sample deadline in seconds. The worker interrupts itself with SIGALRM at timeout_s; the parent kills
    # and replaces a worker that has not answered by timeout_s + kill_grace_s (C code that never returns to the
    # interpreter does not see the signal). Either way the status is timeout.
    timeout_s: float = 3.0
    kill_grace_s: float = 1.0
    # Address-space limit of each worker in MiB: a runaway expansion raises MemoryError (status crash) instead
    # of exhausting the node's memory. 0 = unlimited.
    worker_memory_mb: int = 2048
    # Where the gold answer is a plain number, an answer that still holds arithmetic ('88+7', '3 \times 4', '2^3';
    # after its last '=') gets status unevaluated and wrong_reward: math-verify evaluates it and would call it
    # equal, and a policy paid for restating the problem stops solving it. Fractions pass. false: math-verify's
    # verdict alone.
    require_evaluated: bool = True
    # Decimal places math-verify rounds floats to before comparing (at 6, 0.333333 equals 1/3 but 0.333 does not).
    float_rounding: int = 6
    DOMAINS: ClassVar[dict] = {
        "correct_reward": ANY, "wrong_reward": ANY, "format_penalty": ge(0, "0 disables it"), "num_workers": ge(1),
        "timeout_s": gt(0, "seconds"), "kill_grace_s": gt(0, "seconds"),
        "worker_memory_mb": ge(256, "0: unlimited", zero=True), "float_rounding": between(1, 15)}

    def __post_init__(self) -> None:
        require(self.correct_reward > self.wrong_reward, "correct_reward", self.correct_reward,
                f"must be greater than wrong_reward={self.wrong_reward}")


SCHEMAS = {"math_verify": MathVerifyRewardConfig}
