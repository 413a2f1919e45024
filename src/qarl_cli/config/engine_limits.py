"""Values whose valid range is set by an engine rather than by qarl, checked at compose time, so that a value the
engine would refuse at step 1 (as a traceback from inside vLLM) is one line naming the key now. Each limit is
the engine's own, read where the engine reads it:

- samples per prompt (train's samples_per_prompt and eval_samples, eval's samples) is vLLM's SamplingParams `n`:
  at most VLLM_MAX_N_SEQUENCES (vllm/envs.py; 16384 unless that variable is set);
- temperature: vLLM refuses above 2 and raises (0, 0.01) to 0.01 with only a log line (sampling_params.py
  `_MAX_TEMP`): a set value it would not use is refused rather than silently changed;
- max_new_tokens (and rollout.max_model_len) against the model's positions (max_position_embeddings): a
  response cannot run past the model's context, whatever the engine (vLLM refuses at start-up, the torch
  engine would index past its position table). A dry run is checked for what it samples (DRY_RUN_NEW_TOKENS),
  so a paper preset's dry run on a tiny stand-in model composes.

The seed's range (numpy's, which vLLM seeds with it) is its DOMAINS entry in config/root.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from qarl_cli.config.errors import ConfigError

VLLM_ROLLOUTS = ("vllm", "vllm_server")
VLLM_MAX_TEMPERATURE = 2.0  # vllm/sampling_params.py: "temperature must be in [0, 2]"
VLLM_MIN_TEMPERATURE = 1e-2  # vllm/sampling_params.py _MAX_TEMP: smaller nonzero values are raised to it


def vllm_max_n() -> int:
    """vLLM's limit on SamplingParams.n, from the variable vLLM reads it from (vllm/envs.py)."""
    try:
        return int(os.environ.get("VLLM_MAX_N_SEQUENCES", "16384"))
    except ValueError:
        return 16384


def check_engine_limits(cfg: Any) -> None:
    rollout = getattr(getattr(cfg, "rollout", None), "name", None)
    if rollout in VLLM_ROLLOUTS:
        limit = vllm_max_n()
        for key in ("samples_per_prompt", "eval_samples", "samples"):
            value = getattr(cfg, key, None)
            if value is not None and value > limit:
                raise ConfigError(f"{key}={value}: vLLM samples at most {limit} sequences per prompt "
                                  "(VLLM_MAX_N_SEQUENCES)")
        temperature = getattr(cfg, "temperature", None)
        if temperature is not None and temperature > VLLM_MAX_TEMPERATURE:
            raise ConfigError(f"temperature={temperature}: vLLM samples at temperatures in [0, 2]")
        if temperature is not None and 0 < temperature < VLLM_MIN_TEMPERATURE:
            raise ConfigError(f"temperature={temperature}: vLLM would sample at {VLLM_MIN_TEMPERATURE} instead "
                              f"(it raises 0 < temperature < {VLLM_MIN_TEMPERATURE}); use 0 for greedy or at least "
                              f"{VLLM_MIN_TEMPERATURE}")
    _check_positions(cfg)


def _check_positions(cfg: Any) -> None:
    model, new = getattr(cfg, "model", None), getattr(cfg, "max_new_tokens", None)
    if model is None or new is None:
        return
    positions, where = _positions(model)
    if positions is None:
        return
    max_len = getattr(getattr(cfg, "rollout", None), "max_model_len", None)
    if getattr(cfg, "dry_run", False):  # what the dry run will sample (commands/train.py dry), not the preset's
        new, max_len = min(new, cfg.DRY_RUN_NEW_TOKENS), None
    if new >= positions:
        raise ConfigError(f"max_new_tokens={new}: {where} has {positions} positions (max_position_embeddings), "
                          "the prompt included: set it below that")
    if max_len is not None and max_len > positions:
        raise ConfigError(f"rollout.max_model_len={max_len}: {where} has {positions} positions "
                          "(max_position_embeddings)")


def _positions(model: Any) -> tuple[Optional[int], str]:
    """The model's position count: its config.json when model.path names one, else the option's own schema
    (the tiny models declare it); None when neither says (a registry model not fetched yet)."""
    path = getattr(model, "path", None)
    if path:
        try:
            config = json.loads((Path(os.path.expanduser(str(path))) / "config.json").read_text())
        except (OSError, ValueError):
            return None, ""  # a missing or bad config.json is named by the model check, with its file
        value = config.get("max_position_embeddings") if isinstance(config, dict) else None
        return (value, f"model.path={path}") if isinstance(value, int) else (None, "")
    value = getattr(model, "max_position_embeddings", None)
    return (value, f"model={model.name}") if isinstance(value, int) else (None, "")
