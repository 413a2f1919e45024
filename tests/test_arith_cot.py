"""data=arith_cot and data=arith_sum (its + and - only, long case): worked solutions that are right line by line,
one operation per line, of the lengths each task promises, and disjoint splits."""

import ast
import itertools
import re

import pytest
from test_arith import _value  # the independent evaluator (ast), unary minus included

from qarl_cli.config.data import ArithCotDataConfig, ArithSumDataConfig
from qarl_cli.data import arith_cot

# (config, the shortest and longest response in tokens its test split may hold)
# The first three problems of arith_cot's test split, as the code before `operators` drew them.
FIRST_COT_TEST = ["95+83*2*2+54", "8-(48+68)*5-30+81", "86-3-54-20+18-37*7"]
TASKS = {"arith_cot": (ArithCotDataConfig, 30, 160), "arith_sum": (ArithSumDataConfig, 160, 310)}


def _numbers(line):
    return len(re.findall(r"\d+", line))


@pytest.fixture(scope="module", params=list(TASKS))
def source(request):
    return arith_cot.ArithCotSource(TASKS[request.param][0](), seed=0)


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
        assert set(re.sub(r"[\d()]", "", p.prompt)) <= set(source.task["operators"])
        assert p.source == source.task["source"]


def test_precedence_and_parentheses_decide_the_order():
    assert arith_cot.rewrites("2+3*4") == ["2+12", "14"]
    assert arith_cot.rewrites("(2+3)*4") == ["5*4", "20"]
    assert arith_cot.rewrites("12+(7-9)*4") == ["12+-2*4", "12+-8", "4"]
    assert arith_cot.rewrites("5-(8-10)") == ["5--2", "7"]


def test_responses_are_long_and_grow_with_the_operation_count(source):
    """Tokens as the tiny tokenizer counts them (one per character; \\boxed{ is one)."""
    cfg, shortest, longest = TASKS[source.task["source"]]
    lengths = {n: [len(arith_cot.solution(p.prompt)) - len("\\boxed{") + 1 for p in source.test if p.level == n]
               for n in cfg().ops}
    counts = [len(v) for v in lengths.values()]
    assert sum(counts) == 500 and max(counts) - min(counts) <= 1  # 500 test problems in equal shares
    assert min(min(v) for v in lengths.values()) >= shortest and max(max(v) for v in lengths.values()) <= longest
    medians = [sorted(v)[len(v) // 2] for _, v in sorted(lengths.items())]
    assert medians == sorted(medians) and medians[-1] > medians[0] * (2 if cfg is ArithCotDataConfig else 1.3)
    assert max(max(v) for v in lengths.values()) + 1 <= cfg().max_new_tokens


def test_the_cot_split_is_what_it_was_before_operators_were_an_option():
    """arith_cot's problems are drawn as before (runs and the shipped recipes' numbers stay comparable)."""
    assert [p.prompt for p in arith_cot.test_split(3, [4, 5, 6, 7, 8])] == FIRST_COT_TEST


def test_splits_are_disjoint_fixed_and_indexed_by_position(source):
    train = list(itertools.islice(source.train_stream(0), 3000))
    assert not {p.prompt for p in train} & {p.prompt for p in source.test}
    cfg = TASKS[source.task["source"]][0]
    assert [p.prompt for p in arith_cot.ArithCotSource(cfg(), seed=7).test] == \
        [p.prompt for p in source.test]  # the test split does not depend on the seed
    assert [p.prompt for p in itertools.islice(source.train_stream(100), 5)] == [p.prompt for p in train[100:105]]


@pytest.mark.parametrize("cfg, ops", [(ArithCotDataConfig, []), (ArithCotDataConfig, [0]),
                                      (ArithCotDataConfig, [9]), (ArithSumDataConfig, [15])])
def test_operation_counts_are_validated(cfg, ops):
    from qarl_cli.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^ops="):
        cfg(ops=ops)


@pytest.mark.parametrize("operators", ["", "/", "++"])
def test_operators_are_validated(operators):
    from qarl_cli.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^operators="):
        ArithCotDataConfig(operators=operators)
