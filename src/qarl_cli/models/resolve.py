"""From the `model` config to a checkpoint directory on disk: model.path when set (any option), else the
option's implementation (`impl` of its schema) builds or fetches it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from qarl_cli.config.errors import ConfigError
from qarl_cli.config.model import ModelConfig


# The marker every built model writes (models/tiny.py, models/smollm2.py) and checkpoints trained from it carry.
BUILD_MARKER = "qarl_build.json"
LOCAL = "qarl_cli.models.resolve:local_checkpoint"  # the impl of options that take any checkpoint (model=hf)


def model_dir(cfg: ModelConfig, log: Callable[[str], None] = print) -> Path:
    """The Hugging Face checkpoint directory the run starts from, with every file a run reads from it (config,
    tokenizer, weights) checked to be there (models.integrity.check_model_dir)."""
    if cfg.path:
        path = Path(os.path.expanduser(str(cfg.path)))
        if getattr(type(cfg), "impl", LOCAL) != LOCAL and path.is_dir():  # an option that builds its own model
            from qarl_cli.models.integrity import training_checkpoint_model

            if training_checkpoint_model(path) is None:  # else check_model_dir points to its model/
                check_built_by(cfg, path)  # first: another model's checkpoint is model=hf's, whatever files it has
        return local_checkpoint(cfg, log)
    from qarl_cli.models.integrity import check_model_dir
    from qarl_cli.stages import resolve

    return check_model_dir(resolve("model", cfg.name)(cfg, log), f"model={cfg.name}")


def local_checkpoint(cfg: ModelConfig, log: Callable[[str], None] = print) -> Path:
    """model.path, checked to be a Hugging Face checkpoint directory a run can read."""
    from qarl_cli.models.integrity import check_model_dir

    return check_model_dir(Path(os.path.expanduser(str(cfg.path))), f"model.path={cfg.path}")


def check_built_by(cfg: ModelConfig, path: Path) -> None:
    """A model.path given to an option that builds its model (tiny_arith, smollm2_135m, ...) must be that option's
    model or a checkpoint trained from it (its BUILD_MARKER names the option): the option's settings, dtype first
    (float32 for the tiny models), are those of its own model. Any other checkpoint is model=hf's."""
    import json

    try:
        built = json.loads((path / BUILD_MARKER).read_text()).get("name")
    except (OSError, ValueError, AttributeError):
        built = None
    if built != cfg.name:
        what = f"its {BUILD_MARKER} names {built}" if built else f"it has no {BUILD_MARKER}"
        raise ConfigError(f"model={cfg.name}: model.path={cfg.path!r} is not a {cfg.name} checkpoint ({what}); for "
                          f"any other checkpoint use model=hf model.path={cfg.path}")
