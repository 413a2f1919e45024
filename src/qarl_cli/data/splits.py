"""From the `data` config to a DataSource (data.base): `load_splits` builds the option's implementation.
FileSource is the implementation of every file-backed option (file, gsm8k, math500, aime, dapo_math, ...)."""

from __future__ import annotations

import itertools
import os
from typing import Any, Iterator

from qarl_cli.data.base import DataSource, Problem


def load_splits(cfg: Any, seed: int, train: bool = True) -> DataSource:
    """The data option's source: impl(cfg, seed) of its schema, with a test split and (train=True: the command
    trains on it) training problems, or a one-line ConfigError (data.checks)."""
    from qarl_cli.data.checks import check_splits
    from qarl_cli.stages import resolve

    return check_splits(resolve("data", cfg.name)(cfg, seed), cfg, train)


class FileSource:
    """Problems from a local jsonl / parquet file. The test split is data.test_path, or a fixed, seed-independent
    held-out sample of `test_size` problems of data.path; training reshuffles the rest every epoch, from the seed."""

    def __init__(self, cfg: Any, seed: int) -> None:
        from qarl_cli.data.files import epoch_order, load_problems

        train = load_problems(os.path.expanduser(cfg.path), cfg.layout, source=cfg.name)
        if cfg.test_path:
            test = load_problems(os.path.expanduser(cfg.test_path), cfg.layout, source=cfg.name)
        else:  # hold out a fixed, seed-independent sample of the file
            held = set(epoch_order(len(train), 0, 0)[:cfg.test_size])
            test = [train[i] for i in sorted(held)]
            train = [p for i, p in enumerate(train) if i not in held]
        self.test, self.train, self.seed = test, train, seed

    def train_stream(self, start: int = 0) -> Iterator[Problem]:
        """Position `start` of the endless stream: epoch start // n, offset start % n of that epoch's order."""
        from qarl_cli.data.files import epoch_order

        n = len(self.train)
        epoch, offset = divmod(start, n)
        for e in itertools.count(epoch):
            for i in epoch_order(n, self.seed, e)[offset if e == epoch else 0:]:
                yield self.train[i]
