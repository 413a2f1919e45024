"""Where each stage option is implemented. The registry is qarl_cli.config.registry.GROUPS (group -> option ->
schema); a schema names its implementation in its `impl` class attribute ("module:attr"), imported here on first
use, so that choosing an option costs nothing until the stage is built (and `qarl --help` imports neither torch
nor vLLM).

What each group's implementation is called with (one contract per stage):

| group     | impl(...)                                  | contract                                         |
|-----------|--------------------------------------------|--------------------------------------------------|
| model     | (cfg, log) -> checkpoint directory         | models.resolve.model_dir                         |
| data      | (cfg, seed) -> DataSource                  | data.base.DataSource                             |
| quant     | (cfg, device) -> Scheme                    | quant.base.Scheme                                |
| forward   | (cfg, scheme).apply(model) -> model        | quant.aligned                                    |
| rollout   | (cfg, model_dir, scheme, ...) -> engine    | rollout.base.RolloutEngine                       |
| reward    | (cfg) -> reward                            | reward.base.Reward                               |
| algorithm | the loss function itself                   | update.base.Objective                             |
| sync      | (cfg, scheme, plan, probe, gather) -> sync | sync.base.Sync                                   |
| logger    | (cfg, run_dir, config dict) -> logger      | train.loggers.Logger                             |
"""

from __future__ import annotations

import importlib
from typing import Any

from qarl_cli.config.errors import UserError


class StageUnavailable(UserError, RuntimeError):
    """A configured stage option that this version of qarl does not implement (an `impl` that fails to import
    because an optional dependency is missing)."""


def target(group: str, name: str) -> str:
    """The `module:attr` that implements `group=name`."""
    from qarl_cli.config.registry import GROUPS

    try:
        return GROUPS[group][name].impl
    except KeyError:
        raise StageUnavailable(f"{group}={name} is not an option of '{group}'; choose from: "
                               f"{', '.join(sorted(GROUPS.get(group, {})))}") from None


def resolve(group: str, name: str) -> Any:
    """The object implementing `group=name` (a class or a function), imported on first use."""
    module, _, attr = target(group, name).partition(":")
    try:
        obj: Any = importlib.import_module(module)
    except ModuleNotFoundError as e:  # an optional dependency (vllm, wandb, a plugin); ours missing is a bug
        if e.name and (e.name == "qarl_cli" or e.name.startswith("qarl_cli.")):
            raise
        raise StageUnavailable(f"{group}={name} needs the Python package {e.name!r}, which is not installed "
                               "here") from e
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
