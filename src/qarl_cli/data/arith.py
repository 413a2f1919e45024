"""The embedded default's data: seeded, procedurally generated arithmetic with exact integer answers.

Three levels: 1) a two-digit number plus or minus a one- or two-digit one; 2) a two- or three-digit number times
a digit; 3) two-step expressions. (The tiny model learns level 1 in its warm start, level 2 partly, level 3 hardly: the
mixed-reward groups that RL learns from.) Level 0, a number up to 30 plus or minus a digit, is for small pretrained
models: SmolLM2-135M-Instruct gets about a fifth of it right at temperature 0.7 and almost none of level 1.
Which split a problem belongs to is a property of the problem itself (a hash of its text: one in ten is a test
problem), so train and test never overlap whatever the seeds, sizes or levels, and the tiny model's warm start
never sees a test problem. The test split is fixed; the seed orders the training stream, which is indexed by
position so that resuming is exact."""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import replace
from typing import Callable, Iterator, Sequence

from qarl_cli.data.base import Problem


def _level0(rng: random.Random) -> str:
    return f"{rng.randint(1, 30)}{rng.choice('+-')}{rng.randint(1, 9)}"


def _level1(rng: random.Random) -> str:
    b = rng.randint(1, 9) if rng.random() < 0.5 else rng.randint(10, 99)
    return f"{rng.randint(10, 99)}{rng.choice('+-')}{b}"


def _level2(rng: random.Random) -> str:
    a = rng.randint(10, 99) if rng.random() < 0.5 else rng.randint(100, 999)
    return f"{a}*{rng.randint(2, 9)}"


def _level3(rng: random.Random) -> str:
    a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(2, 9)
    return rng.choice([f"{a}+{b}*{c}", f"{a}-{b}*{c}", f"({a}+{b})*{c}", f"({a}-{b})*{c}", f"{a}*{c}-{b}"])


LEVELS = {0: _level0, 1: _level1, 2: _level2, 3: _level3}


def evaluate(expr: str) -> int:
    """The exact value of a generated expression (digits, + - *, parentheses only)."""
    if not set(expr) <= set("0123456789+-*() "):
        raise ValueError(f"not an arithmetic expression: {expr!r}")
    return int(eval(expr, {"__builtins__": {}}))  # noqa: S307 - charset checked above


def make(expr: str, level: int) -> Problem:
    return Problem(prompt=expr, answer=str(evaluate(expr)), source="arith", level=level)


def is_test(expr: str) -> bool:
    return zlib.crc32(expr.encode()) % 10 == 0


def draw_test(prefix: str, size: int, kinds: Sequence[int], gen: Callable, is_test: Callable[[str], bool],
              make: Callable[[str, int], Problem], what: str = "levels") -> list[Problem]:
    """`size` distinct test problems of a generated task, its kinds (arith's levels, arith_cot's operation counts)
    in equal shares (round robin), drawn by `gen(rng, kind)` from one fixed seed: the same on every machine."""
    rng = random.Random(f"{prefix}-test")
    seen: set[str] = set()
    out: list[Problem] = []
    for _ in range(1000 * size + 1000):  # a bound, so that an impossible size fails instead of looping
        if len(out) == size:
            return out
        kind = kinds[len(out) % len(kinds)]
        expr = gen(rng, kind)
        if is_test(expr) and expr not in seen:
            seen.add(expr)
            out.append(make(expr, kind))
    raise ValueError(f"{prefix.replace('-', '_')}: not enough distinct test problems for test_size={size} at {what} "
                     f"{list(kinds)}")


def draw_train(prefix: str, seed: int, kinds: Sequence[int], gen: Callable, is_test: Callable[[str], bool],
               make: Callable[[str, int], Problem], start: int = 0) -> Iterator[Problem]:
    """An endless stream of training problems (never a test problem); problem i depends only on (seed, i)."""
    i = start
    while True:
        rng = random.Random(f"{prefix}-train-{seed}-{i}")
        kind = kinds[rng.randrange(len(kinds))]
        expr = gen(rng, kind)
        while is_test(expr):
            expr = gen(rng, kind)
        yield make(expr, kind)
        i += 1


def _generate(rng: random.Random, level: int) -> str:
    return LEVELS[level](rng)


def test_split(size: int, levels: Sequence[int]) -> list[Problem]:
    """`size` distinct test problems, levels in equal shares (round robin); the same on every machine."""
    return draw_test("arith", size, levels, _generate, is_test, make)


def train_stream(seed: int, levels: Sequence[int], start: int = 0) -> Iterator[Problem]:
    """An endless stream of training problems (never a test problem); problem i depends only on (seed, i)."""
    return draw_train("arith", seed, levels, _generate, is_test, make, start)


def spaced(expr: str) -> str:
    """The expression with a space on each side of every binary operator: "(17-5)*3" -> "(17 - 5) * 3"."""
    return re.sub(r"\s*([-+*])\s*", r" \1 ", expr).strip()


def asked(problem: Problem, question: str) -> Problem:
    """The problem worded by the template `question` (ArithDataConfig.question); answer and level unchanged."""
    if question == "{expr}":
        return problem
    return replace(problem, prompt=question.format(expr=problem.prompt, spaced=spaced(problem.prompt)))


class ArithSource:
    """data=arith: the fixed test split, and training problems generated from (seed, position)."""

    def __init__(self, cfg, seed: int) -> None:
        self.levels, self.seed, self.question = list(cfg.levels), seed, cfg.question
        self.test = [asked(p, self.question) for p in test_split(cfg.test_size, self.levels)]

    def train_stream(self, start: int = 0) -> Iterator[Problem]:
        return (asked(p, self.question) for p in train_stream(self.seed, self.levels, start))
