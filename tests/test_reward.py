"""reward=math_verify: answer equivalence (a table written by hand), deadlines, dead workers, rewards, metrics."""

import random
import signal

import pytest

from qarl_cli.config.errors import ConfigError
from qarl_cli.config.reward import SCHEMAS, MathVerifyRewardConfig
from qarl_cli.reward import RewardResult, SampleDetail
from qarl_cli.reward.boxed import last_boxed
from qarl_cli.reward.math_verify import TEST_EXIT, TEST_HANG, MathVerifyReward

_rng = random.Random(0)
GARBAGE = "".join(_rng.choice("abcxyz{}\\^_()[]$0123456789+-*/ =.,") for _ in range(10_000))
NESTED = "\\boxed{" + "(" * 3000 + "3" + ")" * 3000 + "}"
SUM = "\\boxed{" + "+".join(["1"] * 5000) + "}"
# math-verify without a deadline computes 9^387420489 for minutes (measured: still running after 100 s).
TOWER = "\\boxed{9^{9^{9}}}"

# (gold, completion, acceptable statuses). One status where the answer is settled; two for random text.
TABLE = [
    ("42", r"\boxed{42}", {"correct"}),
    ("42", "The answer is 42.", {"correct"}),
    ("42", r"\boxed{42.0}", {"correct"}),
    (r"\frac{1}{2}", r"\boxed{0.5}", {"correct"}),
    ("0.5", r"\boxed{\frac{1}{2}}", {"correct"}),
    (r"\frac{1}{2}", r"\boxed{\dfrac12}", {"correct"}),
    ("1/2", r"\boxed{2/4}", {"correct"}),
    (r"\frac{3}{4}", r"\boxed{0.75}", {"correct"}),
    (r"\frac{1}{3}", r"\boxed{0.333333}", {"correct"}),  # equal at float_rounding=6
    (r"50\%", r"\boxed{50\%}", {"correct"}),
    (r"50\%", "The answer is 50%.", {"correct"}),
    ("0.5", r"\boxed{50\%}", {"correct"}),
    (r"50\%", r"\boxed{0.5}", {"correct"}),
    (r"12.5\%", r"\boxed{0.125}", {"correct"}),
    ("x^2+2x+1", r"\boxed{(x+1)^2}", {"correct"}),
    (r"3\sqrt{2}", r"\boxed{\sqrt{18}}", {"correct"}),
    (r"\frac{\sqrt{2}}{2}", r"\boxed{\frac{1}{\sqrt{2}}}", {"correct"}),
    (r"\sqrt{3}", r"\boxed{3^{1/2}}", {"correct"}),
    (r"2\pi", r"\boxed{6.283185}", {"correct"}),
    ("1,000", r"\boxed{1000}", {"correct"}),
    ("10^{6}", r"\boxed{1000000}", {"correct"}),
    ("12", r"\boxed{012}", {"correct"}),
    ("y = 2x+1", r"\boxed{y=1+2x}", {"correct"}),
    (r"\{1,2\}", r"\boxed{\{2,1\}}", {"correct"}),
    ("(1, 2)", r"\boxed{(1,2)}", {"correct"}),
    (r"\text{(B)}", r"\boxed{B}", {"correct"}),
    (r"\infty", r"\boxed{\infty}", {"correct"}),
    ("-3", r"\boxed{-3}", {"correct"}),
    ("5", r"\boxed{5\text{ cm}}", {"correct"}),
    (r"\begin{pmatrix}1\\2\end{pmatrix}", r"\boxed{\begin{pmatrix}1\\2\end{pmatrix}}", {"correct"}),
    (r"\boxed{7}", r"\boxed{7}", {"correct"}),  # a boxed gold is unwrapped
    (r"$\frac{1}{2}$", r"\boxed{\frac{1}{2}}", {"correct"}),  # so is one in dollars
    ("12", r"\boxed{\boxed{12}}", {"correct"}),
    ("42", r"First \boxed{41}, but fixing an error: \boxed{42}", {"correct"}),  # the last box counts
    ("42", "The final answer is $42$. I hope it is correct.", {"correct"}),
    ("42", r"\boxed{41}", {"wrong"}),
    ("42", r"\boxed{42} and later \boxed{41}", {"wrong"}),
    ("-3", r"\boxed{3}", {"wrong"}),
    (r"\frac{1}{3}", r"\boxed{0.333}", {"wrong"}),
    (r"2\pi", r"\boxed{6.28}", {"wrong"}),
    ("0.5", r"\boxed{5}", {"wrong"}),
    (r"50\%", r"\boxed{5}", {"wrong"}),
    ("x+y", r"\boxed{x-y}", {"wrong"}),
    ("x^2+1", r"\boxed{x^2-1}", {"wrong"}),
    ("(1, 2)", r"\boxed{(2,1)}", {"wrong"}),
    ("B", r"\boxed{C}", {"wrong"}),
    ("42", "I don't know.", {"no_answer"}),
    ("42", "", {"no_answer"}),
    ("42", r"\boxed{}", {"no_answer"}),
    ("", r"\boxed{1}", {"bad_gold"}),
    (r"\frac{1}{2", r"\boxed{1}", {"bad_gold"}),
    ("}{", r"\boxed{1}", {"bad_gold"}),
    ("42", GARBAGE, {"wrong", "no_answer"}),
    ("42", GARBAGE + r" so \boxed{42}", {"correct"}),
    (r"\frac{1}{3}", TOWER, {"timeout"}),  # not a plain number: the arithmetic check below passes it to sympy
    # Arithmetic left undone where the gold is a number: math-verify alone calls each of these correct.
    ("95", r"\boxed{88+7}", {"unevaluated"}),
    ("95", r"\boxed{88 + 7}.", {"unevaluated"}),
    ("12", r"\boxed{3 \times 4}", {"unevaluated"}),
    ("12", r"\boxed{3\cdot4}", {"unevaluated"}),
    ("8", r"\boxed{2^3}", {"unevaluated"}),
    ("4", r"\boxed{6-(2)}", {"unevaluated"}),
    ("1,000", r"\boxed{999+1}", {"unevaluated"}),
    ("95", "The answer is $88+7$.", {"unevaluated"}),
    ("3", TOWER, {"unevaluated"}),  # refused before sympy sees it
    ("95", r"\boxed{88+7=95}", {"correct"}),  # worked, then evaluated
    ("95", r"\boxed{88+7=96}", {"wrong"}),
    ("0.5", r"\boxed{1/2}", {"correct"}),  # a fraction is a value
    ("x+8", r"\boxed{8+x}", {"correct"}),  # not a number: arithmetic is the answer
]


@pytest.fixture(scope="module")
def scorer():
    with MathVerifyReward(MathVerifyRewardConfig()) as s:
        yield s


@pytest.fixture(scope="module")
def table_result(scorer):
    return scorer.score([c for _, c, _ in TABLE], [g for g, _, _ in TABLE])


@pytest.fixture(scope="module")
def hooked():
    """One worker, so that a killed one must be replaced before anything else is scored; short deadlines;
    a format penalty and a negative wrong_reward, so that every reward path has its own value."""
    cfg = MathVerifyRewardConfig(num_workers=1, timeout_s=1.0, kill_grace_s=0.5, format_penalty=0.25,
                                 wrong_reward=-0.5)
    with MathVerifyReward(cfg, _test_hooks=True) as s:
        yield s


@pytest.mark.parametrize("row", range(len(TABLE)), ids=[f"{g[:12]}|{c[:24]}" for g, c, _ in TABLE])
def test_answer_table(table_result, row):
    assert table_result.details[row].status in TABLE[row][2]


def test_table_rewards_follow_statuses(table_result):
    for d, r in zip(table_result.details, table_result.rewards):
        assert r == (1.0 if d.status == "correct" else 0.0)


def test_deadline_bounds_every_sample(table_result):
    """The power tower would run for minutes; it comes back as a timeout, after its deadline (no earlier), and is
    the only one: every other row is settled in milliseconds, far inside timeout_s."""
    cfg = MathVerifyRewardConfig()
    tower = next(i for i, (_, c, _) in enumerate(TABLE) if c == TOWER)
    assert [i for i, d in enumerate(table_result.details) if d.status == "timeout"] == [tower]
    assert table_result.details[tower].seconds >= cfg.timeout_s


@pytest.fixture(scope="module")
def short_deadline():
    # require_evaluated off: the costly answers below are sums and powers, which it would refuse unread.
    cfg = MathVerifyRewardConfig(num_workers=1, timeout_s=0.1, kill_grace_s=0.5, require_evaluated=False)
    with MathVerifyReward(cfg) as s:
        yield s


def test_costly_equal_answers_end_at_the_deadline_and_the_pool_goes_on(short_deadline):
    """Equal to their gold but costly for math-verify: with no deadline it works on them for seconds (the sum)
    to minutes (the nesting), then calls them wrong. With a deadline of 0.1 s, tens of times shorter, they come
    back as timeouts at or after it, and the next sample is scored as usual."""
    res = short_deadline.score([NESTED, SUM, r"\boxed{7}"], ["3", "5000", "7"])
    assert [d.status for d in res.details] == ["timeout", "timeout", "correct"]
    assert all(d.seconds >= 0.1 for d in res.details[:2])
    assert res.rewards == [0.0, 0.0, 1.0]


def test_math_verify_alone_accepts_restated_arithmetic(short_deadline):
    """Why require_evaluated exists: without it, the problem's own expression scores as its value."""
    res = short_deadline.score([r"\boxed{88+7}", r"\boxed{3 \times 4}", r"\boxed{2^3}"], ["95", "12", "8"])
    assert [d.status for d in res.details] == ["correct"] * 3


def test_hung_worker_is_killed_and_replaced(hooked):
    """A worker stuck where SIGALRM cannot reach (the hang would last an hour) is killed by the parent once
    timeout_s + kill_grace_s have passed, and a new worker scores what follows."""
    hooked.score([r"\boxed{1}"], ["1"])  # the worker is up
    stuck = hooked._workers[0].proc
    res = hooked.score([TEST_HANG, r"\boxed{2}"], ["1", "2"])
    assert [d.status for d in res.details] == ["timeout", "correct"]  # cut, not waited out (it would say wrong)
    assert res.details[0].seconds >= hooked.cfg.timeout_s + hooked.cfg.kill_grace_s  # not before the deadline
    assert stuck.exitcode == -signal.SIGKILL and hooked._workers[0].proc is not stuck
    assert res.rewards == [-0.75, 1.0]
    again = hooked.score([r"\boxed{3}"], ["3"])
    assert [d.status for d in again.details] == ["correct"]


def test_crashed_worker_is_replaced(hooked):
    res = hooked.score([TEST_EXIT, r"\boxed{4}", r"\boxed{5}"], ["1", "4", "4"])
    assert [d.status for d in res.details] == ["crash", "correct", "wrong"]
    assert res.rewards == [-0.75, 1.0, -0.5]
    assert res.metrics()["reward/crash_count"] == 1.0


def test_format_penalty(hooked):
    res = hooked.score([r"\boxed{2}", "The answer is 2.", r"\boxed{3}", "no idea"], ["2"] * 4)
    assert [d.status for d in res.details] == ["correct", "correct", "wrong", "no_answer"]
    assert [d.boxed for d in res.details] == [True, False, True, False]
    assert res.rewards == [1.0, 0.75, -0.5, -0.75]


def test_trl_style_call(scorer):
    chat = [{"role": "assistant", "content": r"\boxed{5}"}]
    assert scorer([r"\boxed{4}", chat], answer=["4", "4"]) == [1.0, 0.0]


def test_empty_batch_and_length_mismatch(scorer):
    assert scorer.score([], []).rewards == []
    with pytest.raises(ValueError, match="2 completions but 1 gold"):
        scorer.score(["a", "b"], ["1"])


def test_close_is_prompt_and_final():
    """close() stops every worker, a busy one too: one stuck for an hour with SIGALRM blocked is killed, not
    waited for. A second close is a no-op; scoring after close is an error."""
    s = MathVerifyReward(MathVerifyRewardConfig(num_workers=1, timeout_s=600.0), _test_hooks=True)
    assert s.score([r"\boxed{1}"], ["1"]).rewards == [1.0]  # the worker is up
    worker = s._workers[0]
    worker.conn.send((TEST_HANG, "1"))  # it takes the task at once and hangs in it
    s.close()
    s.close()
    assert not worker.proc.is_alive() and worker.proc.exitcode == -signal.SIGKILL
    with pytest.raises(RuntimeError, match="after close"):
        s.score([r"\boxed{1}"], ["1"])


def test_metrics():
    details = [SampleDetail("correct", True, 0.1), SampleDetail("wrong", True, 0.2),
               SampleDetail("timeout", False, 4.0), SampleDetail("bad_gold", True, 0.0)]
    assert RewardResult([1.0, 0.0, 0.0, 0.0], details).metrics() == {
        "reward/mean": 0.25, "reward/acc": 0.25, "reward/boxed_frac": 0.75, "reward/sample_time_max_s": 4.0,
        "reward/correct_frac": 0.25, "reward/wrong_frac": 0.25, "reward/unevaluated_frac": 0.0,
        "reward/no_answer_frac": 0.0,
        "reward/timeout_frac": 0.25, "reward/crash_frac": 0.0, "reward/bad_gold_frac": 0.25,
        "reward/timeout_count": 1.0, "reward/crash_count": 0.0, "reward/bad_gold_count": 1.0,
    }


@pytest.mark.parametrize("text, content", [
    (r"\boxed{42}", "42"),
    (r"a \boxed{1} b \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\boxed{3}}", r"\boxed{3}"),
    (r"\boxed{5} then cut off \boxed{4", "5"),
    (r"\boxed{\{1,2\}}", r"\{1,2\}"),
    (r"\boxed{\left\{ x \right.}", r"\left\{ x \right."),
    (r"\fbox{7}", "7"),
    (r"\boxed {8}", "8"),
    ("no box here {}", None),
    ("\\boxed{" * 3000, None),
])
def test_last_boxed(text, content):
    assert last_boxed(text) == content


def test_config_defaults_and_registry():
    cfg = MathVerifyRewardConfig()
    assert (cfg.name, cfg.correct_reward, cfg.wrong_reward, cfg.format_penalty) == ("math_verify", 1.0, 0.0, 0.0)
    assert (cfg.num_workers, cfg.timeout_s, cfg.kill_grace_s, cfg.worker_memory_mb, cfg.float_rounding) == (
        2, 3.0, 1.0, 2048, 6)
    assert cfg.require_evaluated is True
    assert SCHEMAS == {"math_verify": MathVerifyRewardConfig}


@pytest.mark.parametrize("field, value", [
    ("correct_reward", 0.0), ("format_penalty", -0.1), ("num_workers", 0), ("timeout_s", 0.0),
    ("kill_grace_s", -1.0), ("worker_memory_mb", 100), ("float_rounding", 0),
])
def test_config_rejects(field, value):
    from qarl_cli.config.domains import check_domains  # ranges are the schema's DOMAINS, checked by validate

    with pytest.raises(ConfigError, match=f"^{field}="):
        check_domains(MathVerifyRewardConfig(**{field: value}))
