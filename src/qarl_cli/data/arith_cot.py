"""Arithmetic with worked solutions: longer expressions whose answer a small model reaches by rewriting them one
operation at a time, so that responses run 40-150 tokens where data=arith's are about 6.

A problem is an expression of `ops` binary operations (+, -, * on one- and two-digit numbers, with parentheses
now and then); its worked solution is the chain of rewrites that evaluates it, each line one operation
(innermost parentheses first, then * before + and -, left to right):

    12+(7-9)*4        ->   = 12+-2*4
                           = 12+-8
                           = 4
                           \\boxed{4}

Every line evaluates to the answer, which is what the tests check. The solution is what a warm start learns from;
RL is scored on the boxed answer only. The split works as data=arith's: a CRC of the expression sends one problem
in ten to test, so train and test are disjoint whatever the seed."""

from __future__ import annotations

import random
import re
import zlib
from typing import Iterator, Sequence

from qarl_cli.data.arith import asked, draw_test, draw_train, evaluate
from qarl_cli.data.base import Problem

_TOKEN = re.compile(r"\d+|[-+*()]")


def generate(rng: random.Random, ops: int, operators: str = "+-*") -> str:
    """An expression of `ops` operations drawn from `operators`; intermediate values stay small (|v| < 1000) so
    the rewrites stay short."""
    while True:
        parts = [str(rng.randint(1, 99) if rng.random() < 0.5 else rng.randint(1, 9))]
        for _ in range(ops):
            op = rng.choice(operators)
            num = rng.randint(2, 9) if op == "*" else rng.randint(1, 99)
            parts += [op, str(num)]
        expr = "".join(parts)
        if ops >= 2 and rng.random() < 0.5:  # parenthesize one + or - operation, so the order is not left to right
            at = [i for i in range(1, len(parts), 2) if parts[i] in "+-"]
            if at:
                i = rng.choice(at)
                parts[i - 1], parts[i + 1] = "(" + parts[i - 1], parts[i + 1] + ")"
                expr = "".join(parts)
        if max(abs(int(t)) for line in [expr, *rewrites(expr)] for t in _tokens(line) if t not in "+-*()") < 1000:
            return expr


def _tokens(expr: str) -> list[str]:
    """Numbers (a '-' that opens the expression, a parenthesis or follows an operator is a sign), operators and
    parentheses."""
    raw, out = _TOKEN.findall(expr), []
    for tok in raw:
        if out and out[-1] == "-" and tok.isdigit() and (len(out) == 1 or out[-2] in "+-*("):
            out[-1] = "-" + tok
        else:
            out.append(tok)
    return out


def _apply(a: str, op: str, b: str) -> str:
    x, y = int(a), int(b)
    return str(x + y if op == "+" else x - y if op == "-" else x * y)


def _reduce(toks: list[str]) -> list[str]:
    """One operation done: in the innermost parentheses (or the whole expression), the first * or else the first
    + or -; parentheses left around a single number are dropped in the same step."""
    lo, hi = 0, len(toks)
    for i, t in enumerate(toks):
        if t == "(":
            lo = i + 1
        elif t == ")":
            hi = i
            break
    span = toks[lo:hi]
    ops = [i for i in range(1, len(span), 2) if span[i] == "*"] or list(range(1, len(span), 2))
    i = ops[0]
    span = span[:i - 1] + [_apply(span[i - 1], span[i], span[i + 1])] + span[i + 2:]
    if lo > 0 and len(span) == 1:
        return toks[:lo - 1] + span + toks[hi + 1:]
    return toks[:lo] + span + toks[hi:]


def rewrites(expr: str) -> list[str]:
    """The worked solution's lines after the problem, the last being the value."""
    toks, out = _tokens(expr), []
    while len(toks) > 1:
        toks = _reduce(toks)
        out.append("".join(toks))
    return out


def solution(expr: str) -> str:
    """The worked solution a model is taught to write."""
    steps = rewrites(expr)
    return "".join(f"= {s}\n" for s in steps) + f"\\boxed{{{steps[-1] if steps else expr}}}"


def is_test(expr: str) -> bool:
    return zlib.crc32(b"cot:" + expr.encode()) % 10 == 0


def _task(operators: str, source: str):
    """(draw, make): problems of these operators, named `source` (arith_cot, or arith_sum for + and - only).
    arith_cot's draws are what they were before operators became an option (the same test split)."""
    prefix = "arith-cot" if operators == "+-*" else f"arith-cot-{operators}"

    def draw(rng: random.Random, ops: int) -> str:
        return generate(rng, ops, operators)

    def make(expr: str, ops: int) -> Problem:
        return Problem(prompt=expr, answer=str(evaluate(expr)), source=source, level=ops)

    return prefix, draw, make


def test_split(size: int, ops: Sequence[int], operators: str = "+-*", source: str = "arith_cot") -> list[Problem]:
    """`size` distinct test problems, operation counts in equal shares; the same on every machine."""
    prefix, draw, make = _task(operators, source)
    return draw_test(prefix, size, ops, draw, is_test, make, what="ops")


def train_stream(seed: int, ops: Sequence[int], start: int = 0, operators: str = "+-*",
                 source: str = "arith_cot") -> Iterator[Problem]:
    """An endless stream of training problems (never a test problem); problem i depends only on (seed, i)."""
    prefix, draw, make = _task(operators, source)
    return draw_train(prefix, seed, ops, draw, is_test, make, start)


class ArithCotSource:
    """data=arith_cot and data=arith_sum: the fixed test split, and training problems generated from (seed,
    position)."""

    def __init__(self, cfg, seed: int) -> None:
        self.ops, self.seed, self.question = list(cfg.ops), seed, cfg.question
        self.task = {"operators": cfg.operators, "source": cfg.name}
        self.test = [asked(p, self.question) for p in test_split(cfg.test_size, self.ops, **self.task)]

    def train_stream(self, start: int = 0) -> Iterator[Problem]:
        return (asked(p, self.question) for p in train_stream(self.seed, self.ops, start, **self.task))
