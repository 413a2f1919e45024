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
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):  # arith_cot's rewrites write "12+-8"
        return -_value(node.operand)
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


def test_question_rewords_the_prompt_and_nothing_else():
    """data.question changes only the user-facing wording: answers, levels and the train/test membership of each
    problem are those of the bare expression."""
    from qarl_cli.config.data import ArithDataConfig

    bare = arith.ArithSource(ArithDataConfig(levels=[0, 3], test_size=20), seed=3)
    worded = arith.ArithSource(ArithDataConfig(levels=[0, 3], test_size=20, question="Calculate {spaced}."), seed=3)
    for a, b in itertools.chain(zip(bare.test, worded.test),
                                zip(itertools.islice(bare.train_stream(5), 30),
                                    itertools.islice(worded.train_stream(5), 30))):
        assert (b.answer, b.level) == (a.answer, a.level)
        # the worded prompt, read back: strip the template, drop the spaces, and it is the expression again
        assert b.prompt.startswith("Calculate ") and b.prompt.endswith(".")
        inner = b.prompt[len("Calculate "):-1]
        assert inner.replace(" ", "") == a.prompt and re.fullmatch(r"[()\d]+( [-+*] [()\d]+)+", inner), b.prompt
        assert str(_value(ast.parse(inner, mode="eval"))) == b.answer


def test_spaced_puts_one_space_around_each_operator():
    assert arith.spaced("17+5") == "17 + 5"
    assert arith.spaced("(17-5)*3") == "(17 - 5) * 3"
    assert arith.spaced("12*3-45") == "12 * 3 - 45"


@pytest.mark.parametrize("question", ["Calculate.", "{problem}?", "{expr", "What is {expr} and {x}?"])
def test_a_question_without_the_problem_or_with_unknown_fields_is_refused(question):
    from qarl_cli.config.data import ArithDataConfig
    from qarl_cli.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^question=.*must name the problem as \{expr\} or \{spaced\}"):
        ArithDataConfig(question=question)
