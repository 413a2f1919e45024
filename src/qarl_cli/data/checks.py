"""What every data source must give the command that loads it, checked once where the source is built
(data.splits.load_splits), for any source (a file, a generated one, one added later): a non-empty test split
(evaluated, and used at start-up to size the engine and probe the sync), and for training a non-empty training
set where the source has a finite one. Each failure is one line naming data.test_size and what to set."""

from __future__ import annotations

from typing import Any

from qarl_cli.config.errors import ConfigError


def check_splits(source: Any, cfg: Any, train: bool = True) -> Any:
    """`source` unchanged, or ConfigError. `cfg`: the data config; `train`: whether the command trains on it
    (qarl eval does not: there a test_size covering the whole file evaluates all of it)."""
    size = getattr(cfg, "test_size", None)
    where = f"data.path={cfg.path}" if getattr(cfg, "path", None) else f"data={cfg.name}"
    if not source.test:
        raise ConfigError(f"data.test_size={size}: the test split of {where} is empty (it is evaluated, and used "
                          "at start-up); set data.test_size to 1 or more")
    rest = getattr(source, "train", None) if train else None  # None: generated on the fly, never runs out
    if rest is not None and not rest:
        n = len(source.test)
        raise ConfigError(f"data.test_size={size}: {where} has {n} problem{'s' if n != 1 else ''}, and holding out "
                          f"{min(size, n)} for the test split leaves none to train on; set data.test_size below {n} "
                          "or give a separate data.test_path=FILE")
    return source
