"""The aligned forward stage's contract (`forward` group): built as `impl(cfg, scheme)` from the option's schema
and the rollout's quantization scheme, `apply(model)` returns the policy the learner trains: with the scheme's
quantized modules in it (forward=aligned, qarl_cli.forward.aligned) or as it is (forward=bf16, the naive baseline)."""

from typing import Protocol

from torch import nn


class Forward(Protocol):
    def apply(self, model: nn.Module) -> nn.Module:
        ...
