"""From the `model` config to a checkpoint directory on disk."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from qarl_cli.config.errors import ConfigError
from qarl_cli.config.model import ModelConfig, TinyModelConfig


def model_dir(cfg: ModelConfig, log: Callable[[str], None] = print) -> Path:
    """model.path when set (checked to be a Hugging Face checkpoint), else the built-in tiny model, built on
    first use."""
    if cfg.path:
        path = Path(os.path.expanduser(cfg.path))
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path={cfg.path!r}: not a Hugging Face checkpoint directory (no config.json)")
        return path
    if isinstance(cfg, TinyModelConfig):
        from qarl_cli.models.tiny import ensure_tiny_model

        return ensure_tiny_model(cfg, log)
    raise ConfigError(f"model={cfg.name} needs model.path=DIR")
