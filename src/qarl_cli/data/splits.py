"""From the `data` config to a training stream and a test split."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Iterator

from qarl_cli.config.data import ArithDataConfig, DataConfig
from qarl_cli.data import arith
from qarl_cli.data.base import Problem


@dataclass
class Splits:
    test: list[Problem]
    _train: list[Problem] | None  # a file's training problems (None: generated on the fly)
    _cfg: DataConfig
    _seed: int

    def train_stream(self, start: int = 0) -> Iterator[Problem]:
        """Training problems from position `start` on; the same (seed, position) gives the same problem, so a
        resumed run continues exactly. Files are reshuffled every epoch, deterministically."""
        if self._train is None:
            assert isinstance(self._cfg, ArithDataConfig)
            return arith.train_stream(self._seed, self._cfg.levels, start)
        from qarl_cli.data.files import epoch_order

        n = len(self._train)
        epoch, offset = divmod(start, n)

        def stream() -> Iterator[Problem]:
            for e in itertools.count(epoch):
                order = epoch_order(n, self._seed, e)
                for i in order[offset if e == epoch else 0:]:
                    yield self._train[i]

        return stream()


def load_splits(cfg: DataConfig, seed: int) -> Splits:
    if isinstance(cfg, ArithDataConfig):
        return Splits(arith.test_split(cfg.test_size, cfg.levels), None, cfg, seed)
    from qarl_cli.data.files import epoch_order, load_problems

    train = load_problems(os.path.expanduser(cfg.path), cfg.layout, source=cfg.name)
    if cfg.test_path:
        test = load_problems(os.path.expanduser(cfg.test_path), cfg.layout, source=cfg.name)
    else:  # hold out a fixed, seed-independent sample of the file
        order = epoch_order(len(train), 0, 0)
        held = set(order[:cfg.test_size])
        test = [train[i] for i in sorted(held)]
        train = [p for i, p in enumerate(train) if i not in held]
    return Splits(test, train, cfg, seed)


def chat_messages(cfg: DataConfig, problem: Problem) -> list[dict[str, str]]:
    """The prompt template: an optional system message, then the problem and the instruction."""
    user = f"{problem.prompt}\n\n{cfg.instruction}" if cfg.instruction else problem.prompt
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    return [*system, {"role": "user", "content": user}]
