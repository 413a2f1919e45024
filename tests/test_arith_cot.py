"""data=arith_cot: worked solutions that are right line by line, one operation per line, and disjoint splits."""

import ast
import itertools
import re

import pytest
from test_arith import _value  # the independent evaluator (ast), unary minus included

from qarl_cli.config.data import ArithCotDataConfig
from qarl_cli.data import arith_cot

def _numbers(line):
    return len(re.findall(r"\d+", line))


@pytest.fixture(scope="module")
def source():
    return arith_cot.ArithCotSource(ArithCotDataConfig(), seed=0)


def test_every_line_of_a_solution_is_the_problem_with_one_operation_done(source):
    problems = source.test + list(itertools.islice(source.train_stream(0), 500))
    for p in problems:
        text = arith_cot.solution(p.prompt)
        *lines, boxed = text.split("\n")
        assert boxed == f"\\boxed{{{p.answer}}}"
        answer = _value(ast.parse(p.prompt, mode="eval"))
        assert str(answer) == p.answer
        assert _numbers(p.prompt) == p.level + 1  # `ops` operations: one number more
        previous = p.prompt
        for line in lines:
            assert line.startswith("= ")
            line = line[2:]
            assert _value(ast.parse(line, mode="eval")) == answer, (p.prompt, text)  # the value never changes
            assert _numbers(line) == _numbers(previous) - 1, (p.prompt, text)  # exactly one operation done
            previous = line
        assert previous == p.answer


def test_precedence_and_parentheses_decide_the_order():
    assert arith_cot.rewrites("2+3*4") == ["2+12", "14"]
    assert arith_cot.rewrites("(2+3)*4") == ["5*4", "20"]
    assert arith_cot.rewrites("12+(7-9)*4") == ["12+-2*4", "12+-8", "4"]
    assert arith_cot.rewrites("5-(8-10)") == ["5--2", "7"]


def test_responses_are_long_and_grow_with_the_operation_count(source):
    """Tokens as the tiny tokenizer counts them (one per character; \\boxed{ is one)."""
    lengths = {n: [len(arith_cot.solution(p.prompt)) - len("\\boxed{") + 1 for p in source.test if p.level == n]
               for n in ArithCotDataConfig().ops}
    assert all(len(v) == 100 for v in lengths.values())  # 500 test problems in equal shares
    assert min(min(v) for v in lengths.values()) >= 30 and max(max(v) for v in lengths.values()) <= 160
    medians = [sorted(v)[50] for _, v in sorted(lengths.items())]
    assert medians == sorted(medians) and medians[-1] > 2 * medians[0]
    assert max(max(v) for v in lengths.values()) + 1 <= ArithCotDataConfig().max_new_tokens


def test_splits_are_disjoint_fixed_and_indexed_by_position(source):
    train = list(itertools.islice(source.train_stream(0), 3000))
    assert not {p.prompt for p in train} & {p.prompt for p in source.test}
    assert [p.prompt for p in arith_cot.ArithCotSource(ArithCotDataConfig(), seed=7).test] == \
        [p.prompt for p in source.test]  # the test split does not depend on the seed
    assert [p.prompt for p in itertools.islice(source.train_stream(100), 5)] == [p.prompt for p in train[100:105]]


@pytest.mark.parametrize("ops", [[], [0], [9]])
def test_operation_counts_are_validated(ops):
    from qarl_cli.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^ops="):
        ArithCotDataConfig(ops=ops)
