"""Where each stage option is implemented: a name table per config group, imported lazily, so that choosing an
option costs nothing until the stage is built (and `qarl --help` imports neither torch nor vLLM).

A group option without an entry here composes and validates, but has no implementation yet: `build` says so."""

from __future__ import annotations

import importlib
from typing import Any

from qarl_cli.config.errors import UserError

IMPLEMENTATIONS: dict[str, dict[str, str]] = {
    # Schemes: Scheme(cfg.quant, device) (see qarl_cli.quant.base.Scheme).
    "quant": {
        "int8": "qarl_cli.quant.int8:Int8Scheme",
        "fp8_block": "qarl_cli.quant.fp8_block:Fp8BlockScheme",
        "w4a16": "qarl_cli.quant.w4a16:W4A16Scheme",
        "none": "qarl_cli.quant.none:NoQuantScheme",
    },
    # Forward(cfg.forward, scheme).apply(model) -> model.
    "forward": {"aligned": "qarl_cli.quant.aligned:AlignedForward", "bf16": "qarl_cli.quant.aligned:BF16Forward"},
    # Engine(cfg.rollout, model_dir, scheme, weights=..., ...) (see qarl_cli.rollout.base.build_engine).
    "rollout": {"vllm": "qarl_cli.rollout.vllm_engine:VLLMEngine", "torch": "qarl_cli.rollout.torch_engine:TorchEngine"},
    "reward": {"math_verify": "qarl_cli.reward.math_verify:MathVerifyReward"},
    "algorithm": {name: f"qarl_cli.objectives:OBJECTIVES.{name}" for name in ("tbpo", "gspo", "grpo", "dapo")},
}


class StageUnavailable(UserError, RuntimeError):
    """A configured stage option that this version of qarl does not implement."""


def is_implemented(group: str, name: str) -> bool:
    return name in IMPLEMENTATIONS.get(group, {})


def resolve(group: str, name: str) -> Any:
    """The object implementing `group=name` (a class or a function), imported on first use."""
    try:
        target = IMPLEMENTATIONS[group][name]
    except KeyError:
        raise StageUnavailable(f"{group}={name} has no implementation in this version of qarl") from None
    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return obj
