"""Error-token detector: loops at the end, truncation, garbled text, and their metrics (hand-made cases)."""

import pytest

from qarl_cli.reward.error_tokens import ErrorFlags, detect, error_token_metrics, is_garbled, tail_loop


@pytest.mark.parametrize("ids, expected", [
    ([1, 2, 3] * 4, (3, 12)),
    ([1, 2, 3] * 3, (0, 0)),  # three repeats are not a loop
    ([9, 8] + [5] * 4, (1, 4)),
    ([5] * 3, (0, 0)),
    ([4] * 20, (1, 20)),  # the shortest block wins at equal span
    ([1, 2] * 4, (2, 8)),
    ([3] + [1, 2] * 4, (2, 8)),
    ([7] + [1, 2, 3] * 4 + [1, 2], (3, 14)),  # cut mid-block by the length limit
    (list(range(16)) * 4, (16, 64)),
    (list(range(17)) * 4, (0, 0)),  # a block longer than 16 tokens
    ([1, 2] * 10 + [3, 4, 5], (0, 0)),  # a loop the response left
    ([], (0, 0)),
    ([1, 2, 3, 4, 5, 6, 7, 8], (0, 0)),
])
def test_tail_loop(ids, expected):
    assert tail_loop(ids) == expected


@pytest.mark.parametrize("text, expected", [
    ("The answer is \\boxed{42}.", False),
    ("line\nnext\ttab\r\n", False),
    ("x\u00a0y and a\u2009b", False),  # no-break and thin spaces
    ("family \U0001f468\u200d\U0001f469 日本語 émoji 🙂", False),  # zero-width joiner
    ("", False),
    ("bad \ufffd byte", True),
    ("nul \x00 char", True),
    ("\x1b[31mred", True),
    ("private \ue000 use", True),
    ("unassigned \u0378", True),
])
def test_is_garbled(text, expected):
    assert is_garbled(text) is expected


@pytest.mark.parametrize("n, max_tokens, finish_reason, expected", [
    (10, 10, "length", True),
    (7, 10, "length", True),  # the engine knows best (a limit counted elsewhere)
    (10, 10, "stop", False),  # stopped on EOS at the very last position
    (10, 10, None, True),
    (9, 10, None, False),
])
def test_truncation(n, max_tokens, finish_reason, expected):
    assert detect(list(range(n)), "text", max_tokens, finish_reason).truncated is expected


def test_detect_loop_response():
    f = detect([11, 12] + [5, 6, 7] * 5, "so so so so so", max_tokens=17, finish_reason="length")
    assert f == ErrorFlags(repeat=True, truncated=True, garbled=False, repeated_tokens=12, num_tokens=17)
    assert f.any


def test_detect_clean_response():
    f = detect([1, 2, 3, 4, 5], "\\boxed{5}", max_tokens=100, finish_reason="stop")
    assert f == ErrorFlags(repeat=False, truncated=False, garbled=False, repeated_tokens=0, num_tokens=5)
    assert not f.any


def test_metrics():
    flags = [
        ErrorFlags(repeat=True, truncated=True, garbled=False, repeated_tokens=30, num_tokens=40),
        ErrorFlags(repeat=False, truncated=False, garbled=True, repeated_tokens=0, num_tokens=20),
        ErrorFlags(repeat=False, truncated=True, garbled=False, repeated_tokens=0, num_tokens=40),
        ErrorFlags(repeat=False, truncated=False, garbled=False, repeated_tokens=0, num_tokens=0),
    ]
    assert error_token_metrics(flags) == {
        "error_tokens/repeat_frac": 0.25, "error_tokens/truncated_frac": 0.5, "error_tokens/garbled_frac": 0.25,
        "error_tokens/any_frac": 0.75, "error_tokens/repeated_token_frac": 0.3,
    }


def test_metrics_of_nothing():
    assert set(error_token_metrics([]).values()) == {0.0}
