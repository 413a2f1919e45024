"""The arithmetic data: exact answers, disjoint splits, determinism."""

import ast
import itertools
import operator
import re

import pytest

from qarl_cli.data import arith

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _value(node):
    """An evaluator written from the syntax tree, independent of the generator's own."""
    if isinstance(node, ast.Expression):
        return _value(node.body)
    if isinstance(node, ast.BinOp):
        return OPS[type(node.op)](_value(node.left), _value(node.right))
    assert isinstance(node, ast.Constant) and isinstance(node.value, int)
    return node.value


def test_answers_are_exact():
    problems = arith.test_split(300, [1, 2, 3]) + list(itertools.islice(arith.train_stream(3, [0, 1, 2, 3]), 300))
    for p in problems:
        assert p.answer == str(_value(ast.parse(p.prompt, mode="eval"))), p


@pytest.mark.parametrize("level,pattern", [
    (0, r"^([1-9]|[12]\d|30)[+-][1-9]$"),
    (1, r"^\d{2}[+-]\d{1,2}$"),
    (2, r"^\d{2,3}\*\d$"),
    (3, r"^(\d{2}[+-]\d{2}\*\d|\(\d{2}[+-]\d{2}\)\*\d|\d{2}\*\d-\d{2})$"),
])
def test_levels_have_their_shape(level, pattern):
    for p in arith.test_split(40 if level == 0 else 60, [level]):  # level 0 has 47 test problems in all
        assert p.level == level and re.match(pattern, p.prompt), p.prompt


def test_train_and_test_are_disjoint():
    test = {p.prompt for p in arith.test_split(500, [1, 2, 3])}
    train = {p.prompt for p in itertools.islice(arith.train_stream(0, [1, 2, 3]), 20000)}
    assert len(test) == 500
    assert len(train) > 10000  # level 1 has 17,640 expressions in all: repeats are expected
    assert not test & train


def test_test_split_is_fixed_and_balanced():
    a, b = arith.test_split(500, [1, 2, 3]), arith.test_split(500, [1, 2, 3])
    assert a == b
    assert [sum(p.level == lv for p in a) for lv in (1, 2, 3)] == [167, 167, 166]
    assert arith.test_split(100, [1, 2, 3]) == a[:100]  # a smaller split is a prefix


def test_stream_is_indexed_by_position():
    full = list(itertools.islice(arith.train_stream(7, [1, 2, 3]), 50))
    assert list(itertools.islice(arith.train_stream(7, [1, 2, 3], start=20), 30)) == full[20:]
    other = list(itertools.islice(arith.train_stream(8, [1, 2, 3]), 50))
    assert other != full


def test_evaluate_refuses_anything_but_arithmetic():
    with pytest.raises(ValueError):
        arith.evaluate("__import__('os')")
